"""Programs: where a schedule holds only allocations, frees, operators and collectives, each
location's worker runs its own instructions in the plan's order (runtime/dispatcher.py), the issuing
thread only walking the schedule. The same bits and peaks as the general path, each location's
work on its own worker, and a split operator's part on another stream kept between its
neighbours."""
import threading

import numpy as np
import pytest

from sncaffe.runtime.parts import Part
from sncaffe.parallel.replicas import Replicas, replicate
from sncaffe.proto import sncaffe_pb2 as pb
from sncaffe.prototxt import parse_text
from sncaffe.solvers import Solver

from test_sync_bn import CONV, feed

LOCATIONS = ["cpu:0", "cpu:1"]


def make_solver(programs, mode="none"):
    p = pb.SolverParameter(base_lr=0.1, momentum=0.9, weight_decay=5e-4, lr_policy="fixed", max_iter=3,
                           random_seed=7, snapshot_after_train=False)
    p.memory_param.mode = mode
    p.net_param.CopyFrom(replicate(parse_text(CONV, pb.NetParameter()), LOCATIONS))
    solver = Solver(p, device="cpu", dtype=np.float64)
    solver.feed = feed
    solver.net.executor.programs = programs
    return solver


def assert_same_weights(ref, net):
    for name, blobs in ref.params.items():
        for x, y in zip(blobs, net.params[name]):
            assert np.array_equal(x.data, y.data), name


@pytest.mark.parametrize("mode", ["none", "recompute"])
def test_programs_give_the_general_paths_bits_and_each_planned_peak(mode):
    """Two replicas with cross-replica BatchNorm and summing operators: trained with programs
    and on the general path, the weights, solver history and running statistics are the same
    bits, and every location's pool peaks where its plan says."""
    runs = []
    for programs in (True, False):
        solver = make_solver(programs, mode)
        reps = Replicas(solver)
        taken = []
        real = solver.net.executor._programs
        solver.net.executor._programs = lambda instrs: (taken.append(len(instrs)), real(instrs))
        for d in solver.net.devices.values():
            d.pool.reset_peak()
        solver.solve()
        assert bool(taken) == programs          # the path under test was the one taken
        for loc, peak in solver.net.plan.peaks.items():
            assert solver.net.devices[loc].pool.peak == peak, (programs, loc)
        runs.append({(name, k): (b.data.copy(), b.diff.copy()) for name, blobs in solver.net.params.items()
                     for k, b in enumerate(blobs)})
        runs[-1]["history"] = [h.copy() for h in solver.history] if hasattr(solver, "history") else []
        reps.close()
    a, b = runs
    assert a.keys() == b.keys()
    for key in a:
        if key == "history":
            assert all(np.array_equal(x, y) for x, y in zip(a[key], b[key]))
            continue
        assert np.array_equal(a[key][0], b[key][0]) and np.array_equal(a[key][1], b[key][1]), key


def test_each_location_runs_its_own_allocations_and_operators_on_its_worker():
    solver = make_solver(True)
    reps = Replicas(solver)
    net, ex = solver.net, solver.net.executor
    ran, allocated = {}, {}
    run_op = ex.run_op

    def traced(op, recompute, ws, chunk):
        loc = op.node.layer.param.location
        if op.node.type != "Copy":          # (a copy runs on the copy stream of its destination)
            ran.setdefault(loc, set()).add(threading.current_thread())
        run_op(op, recompute, ws, chunk)
    ex.run_op = traced
    for loc in LOCATIONS:
        device = net.devices[loc]

        def alloc(*args, device=device, loc=loc, real=device.alloc, **kwargs):
            allocated.setdefault(loc, set()).add(threading.current_thread())
            return real(*args, **kwargs)
        device.alloc = alloc
    solver.step(2)
    reps.close()
    main = threading.main_thread()
    for loc in LOCATIONS:
        assert len(ran[loc]) == 1 and main not in ran[loc], loc
        assert allocated[loc] == ran[loc], loc          # the worker allocates what it runs
    assert ran["cpu:0"] != ran["cpu:1"]


def test_a_part_on_another_stream_runs_between_its_operators_neighbours():
    """A split operator's part that touches its tensors on another stream (here the exchange
    stream) runs after the steps before it on its operator's worker and before the steps after:
    the record's events say so, and the numbers are those of the operator unsplit."""
    ref = make_solver(True)
    ref_reps = Replicas(ref)
    solver = make_solver(True)
    reps = Replicas(solver)
    net, ex = solver.net, solver.net.executor
    relu = next(n for n in net.graph.layers if n.name == "relu1@cpu:0").layer
    where = []

    def extra():
        where.append(threading.current_thread().name)

    relu.split_op = lambda kind, recompute: [Part(), Part(name="relu1 extra", fn=extra, stream="exchange")] \
        if kind == "forward" else None
    ex.record = []
    solver.step(1)
    ref.step(1)
    records = ex.record
    ex.record = None
    assert where == ["sncaffe-exchange"]
    order = [r for r in records if r["location"] == "cpu:0" and r["stream"] == "compute"
             and r["name"].endswith(":forward")]
    names = [r["name"] for r in order]
    i = names.index("relu1@cpu:0:forward")
    part = next(r for r in records if r["name"] == "relu1 extra")
    assert order[i]["event"].end <= part["event"].start
    assert part["event"].end <= order[i + 1]["event"].start
    assert_same_weights(ref.net, net)
    reps.close()
    ref_reps.close()


def _fail_once(op):
    """``op``'s next ``before`` (as the collective is issued) raises; the list it returns records it."""
    real, failed = op.before, []

    def before(ready=None):
        if not failed:
            failed.append(True)
            raise RuntimeError("the comm stream is gone")
        return real(ready)
    op.before = before
    return failed


def test_an_error_while_the_schedule_is_walked_is_raised_and_the_next_pass_runs():
    """A collective that fails as it is issued (its ``before``), halfway through backward's walk:
    the steps handed out before it stop or finish, backward raises that error instead of hanging,
    and the next iteration trains to the bits of a run that never failed."""
    ref = make_solver(True)
    ref_reps = Replicas(ref)
    feed(ref.net, 0)
    ref.net.forward()               # as below, without the failure: a forward whose backward never ran
    ref.step(2)
    solver = make_solver(True)
    reps = Replicas(solver)
    failed = _fail_once(reps.ops[len(reps.ops) // 2])
    net = solver.net
    feed(net, 0)
    net.forward()
    with pytest.raises(RuntimeError, match="the comm stream is gone"):
        net.backward()
    solver.step(2)                  # starts afresh: the failed pass left nothing behind
    assert_same_weights(ref.net, net)
    reps.close()
    ref_reps.close()


def test_a_failure_between_two_replicas_splits_does_not_leave_an_exchange_waited_for():
    """The second replica's BatchNorm backward fails as it is split, after the first's stages are
    handed out waiting for the exchange only the second would issue: backward raises promptly
    (run in a thread, so a wait for that exchange, BIND_TIMEOUT long, fails the test) and the
    next iteration runs. (Here the waiting worker meets another failed event first, so the
    test passes also without the walk binding the unissued exchange to the failure.)"""
    solver = make_solver(True)
    reps = Replicas(solver)
    group = reps.batch_norms[0]
    reals, calls = [layer.split_op for layer in group.layers], []

    def splitter(real):
        def split(kind, recompute):
            if kind == "backward":
                calls.append(kind)
                if len(calls) == 2:
                    raise RuntimeError("replica 1 cannot split")
            return real(kind, recompute)
        return split
    for layer, real in zip(group.layers, reals):
        layer.split_op = splitter(real)
    net, errors = solver.net, []
    feed(net, 0)
    net.forward()

    def backward():
        try:
            net.backward()
        except RuntimeError as e:
            errors.append(e)
    thread = threading.Thread(target=backward, daemon=True)
    thread.start()
    thread.join(30)
    assert not thread.is_alive(), "backward waited for an exchange that was never issued"
    assert errors and "replica 1 cannot split" in str(errors[0])
    for layer, real in zip(group.layers, reals):
        layer.split_op = real
    solver.step(1)                  # and the next iteration runs
    reps.close()


def _params(net):
    return {(name, k): b.data.copy() for name, blobs in net.params.items() for k, b in enumerate(blobs)}


def test_a_replayed_pass_gives_the_walked_passes_bits_until_its_operators_split_otherwise():
    """From the second pass of a schedule on, its programs are replayed from the first pass's
    recording (runtime/dispatcher.py, _Recording): the same weights, running statistics and history
    as walking every pass. Once the cross-replica BatchNorms are detached (their operators no
    longer split), the recording no longer fits: the next passes are walked again, and give the
    bits of a walked run detached at the same iteration."""
    runs = []
    for replay in (True, False):
        solver = make_solver(True)
        reps = Replicas(solver)
        ex = solver.net.executor
        ex.replay = replay
        replays = []
        real = ex._replay
        ex._replay = lambda rec, workers: (replays.append(rec), real(rec, workers))
        solver.step(2)
        assert (len(replays) == 2) == replay            # iteration 2's forward and backward
        for bn in reps.batch_norms:
            bn.detach()
        before = len(replays)
        solver.step(1)
        assert len(replays) == before                   # detached: walked, and recorded anew
        solver.step(1)
        assert (len(replays) == before + 2) == replay
        runs.append((_params(solver.net), [h.copy() for h in solver.history]))
        reps.close()
    (a, ha), (b, hb) = runs
    for key in a:
        assert np.array_equal(a[key], b[key]), key
    assert all(np.array_equal(x, y) for x, y in zip(ha, hb))


def test_a_failure_while_a_pass_is_replayed_is_raised_and_the_next_pass_runs():
    """A collective that fails as a replayed pass issues it (its ``before``): backward raises that
    error instead of hanging, and the next iteration trains to the bits of a run that never
    failed."""
    ref = make_solver(True)
    ref_reps = Replicas(ref)
    ref.step(1)
    feed(ref.net, 0)
    ref.net.forward()               # as below, without the failure: a forward whose backward never ran
    ref.step(2)
    solver = make_solver(True)
    reps = Replicas(solver)
    solver.step(1)                  # recorded: the next backward is a replay
    failed = _fail_once(reps.ops[len(reps.ops) // 2])
    net = solver.net
    feed(net, 0)
    net.forward()
    with pytest.raises(RuntimeError, match="the comm stream is gone"):
        net.backward()
    solver.step(2)
    assert failed
    assert_same_weights(ref.net, net)
    reps.close()
    ref_reps.close()
