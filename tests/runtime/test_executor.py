"""The executor: operators wait for the copies they depend on, frees wait for copies in
flight, copies run on the copy streams' threads, and partial iterations are cleaned up."""
import threading
from types import SimpleNamespace

from dataclasses import replace

import numpy as np
import pytest

import sncaffe.backend.cpu as cpu
from sncaffe import config
from sncaffe import Net
from sncaffe.backend import CPUDevice
from sncaffe.graph import Operator, Tensor
from sncaffe.layers import pooling
from sncaffe.runtime.dispatcher import Dispatcher
from sncaffe.plan.liveness import op_tensors
from sncaffe.plan.planner import MemoryExhausted, make_plan
from sncaffe.plan.schedule import Instr
from test_liveness import TEXT
from test_modes import assert_same_bits, feed, graph_of, train, unchunked
from test_recompute import param_of


@pytest.fixture
def slow_copies(monkeypatch):
    """Every host<->device copy sleeps first, so the compute thread races ahead of it
    unless it waits; records the thread each copy runs on. Pooling runs NumPy's taps: where
    oneDNN pools blocked copies (AVX2), their workspace is the tiny net's peak and mode ``all``
    then keeps every offloaded tensor resident, prefetching nothing."""
    monkeypatch.setattr(pooling, "ONEDNN", False)
    # sncaffe's own convolutions too: the plans these tests need (a prefetch in mode all) should
    # not follow oneDNN's layouts and workspaces
    monkeypatch.setattr(config, "settings", replace(config.settings, conv="native"))
    threads, copy = [], cpu._copy

    def slow(dst, src, after):
        threads.append(threading.current_thread().name)
        threading.Event().wait(0.01)
        copy(dst, src, after)
    monkeypatch.setattr(cpu, "_copy", slow)
    return threads


def test_copies_run_on_the_copy_stream_threads(slow_copies):
    plan, steps = train(param_of(TEXT), "all", iters=1)
    assert plan.d2h_bytes and plan.h2d_bytes
    assert set(slow_copies) == {"sncaffe-d2h", "sncaffe-h2d"}
    assert threading.current_thread().name not in slow_copies


@pytest.mark.parametrize("mode", ["offload", "all"])
def test_slow_copies_give_the_same_bits(slow_copies, mode, monkeypatch):
    """Prefetches and offloads that finish late: every operator waits for what it needs."""
    monkeypatch.setattr(config, "settings", replace(config.settings, conv="native"))     # plan_capacity's steps are drawn for ConvPlan's workspaces
    _, ref = train(param_of(TEXT), "none")
    plan, steps = train(param_of(TEXT), mode, capacity=plan_capacity(mode))
    assert plan.h2d_bytes > 0
    assert_same_bits(steps, ref)


def plan_capacity(mode):
    """The smallest capacity (in 256-byte steps) above the uncached peak that the plan fits."""
    graph = graph_of(param_of(TEXT))
    peak = make_plan(graph, mode).peak
    return next(c for c in range(peak + 256, 2 * peak, 256)
                if unchunked(make_plan(graph, mode, c)))


def test_an_operator_waits_for_the_prefetch_of_what_it_reads(slow_copies):
    net = Net(param_of(TEXT), "TRAIN", device=CPUDevice("64MiB"), memory="all")
    feed(net, np.random.default_rng(0))
    executor, pending = net.executor, []
    to_device = net.device.copy_to_device

    def record(array, host, after=None):
        event = to_device(array, host, after)
        pending.append((array, event))
        return event
    net.device.copy_to_device = record
    run_op, checked = executor.run_op, []

    def check(op, recompute, ws, chunk):
        for r, _ in op_tensors(op):
            a = executor.arrays.get(id(r))
            for array, event in pending:
                if a is not None and array.ctypes.data == a.ctypes.data and array.nbytes == a.nbytes:
                    assert event.query(), f"{op.name} runs before the prefetch of {r.name} is done"
                    checked.append(r.name)
        run_op(op, recompute, ws, chunk)
    executor.run_op = check
    net.forward()
    net.backward()
    assert pending and checked and executor.stats["waits"] > 0


def executor():
    """An executor on a small device, with nothing bound."""
    device = CPUDevice("1MiB", host_capacity="1MiB")
    return Dispatcher(device, {}, lambda *a: None), device


def block(name, n=16384):
    return Tensor(name, (n,), np.dtype(np.float32), "data")


def test_free_waits_for_an_offload_in_flight():
    ex, device = executor()
    t, u = block("t"), block("u")
    gate = threading.Event()
    device.stream("d2h").submit(gate.wait)               # the offload queues behind this
    ex.execute([Instr("alloc", t, fill=1.0), Instr("offload", t)])
    off = ex.offsets[id(t)]
    threading.Timer(0.05, gate.set).start()
    ex.execute([Instr("free", t), Instr("alloc", u, fill=2.0)])   # free must wait for the copy
    assert ex.offsets[id(u)] == off                      # the same block, rewritten
    host = ex.host[id(t)][1].view(np.float32)
    assert ex.stats["waits"] >= 1 and np.all(host == 1.0)
    ex.execute([Instr("drop", t), Instr("free", u)])
    assert device.pool.in_use == 0 and device.host_pool.in_use == 0


def test_an_operator_waits_for_the_offload_of_what_it_overwrites():
    ex, device = executor()
    t = block("t")
    node = SimpleNamespace(workspace={}, backward_workspace={})
    op = Operator("overwrite:forward", "forward", node, [], [t])
    ex.run_op = lambda op, recompute, ws, chunk: ex.arrays[id(t)].fill(3.0)
    gate = threading.Event()
    device.stream("d2h").submit(gate.wait)
    ex.execute([Instr("alloc", t, fill=1.0), Instr("offload", t)])
    threading.Timer(0.05, gate.set).start()
    ex.execute([Instr("run", op=op)])
    assert np.all(ex.host[id(t)][1].view(np.float32) == 1.0) and np.all(ex.arrays[id(t)] == 3.0)
    # and the prefetch back brings the offloaded value, not the overwritten one
    ex.run_op = lambda *a: None
    ex.execute([Instr("prefetch", t), Instr("run", op=Operator("read:forward", "forward", node, [t], []))])
    assert np.all(ex.arrays[id(t)] == 1.0)
    ex.reset()
    assert device.pool.in_use == 0 and device.host_pool.in_use == 0 and not ex.busy


@pytest.mark.parametrize("mode", ["liveness", "offload", "recompute", "all"])
def test_forward_without_backward_is_cleaned_up(mode):
    capacity = plan_capacity(mode) if mode in ("offload", "all") else "64MiB"
    net = Net(param_of(TEXT), "TRAIN", device=CPUDevice(capacity), memory=mode)
    pool, host, persistent = net.device.pool, net.device.host_pool, net.plan.persistent_bytes
    feed(net, np.random.default_rng(0))
    assert pool.in_use == persistent
    net.forward()
    assert pool.in_use > persistent and net.executor.busy
    net.executor.reset()
    assert pool.in_use == persistent and host.in_use == 0 and not net.executor.busy
    loss = net.forward()
    assert net.forward() == loss                          # a forward after a forward resets first
    pool.reset_peak()
    net.forward()
    net.backward()
    assert pool.in_use == persistent and host.in_use == 0 and pool.peak == net.plan.peak


def test_memory_taken_outside_the_plan_is_a_clear_error_and_recoverable():
    capacity = plan_capacity("offload")
    net = Net(param_of(TEXT), "TRAIN", device=CPUDevice(capacity), memory="offload")
    feed(net, np.random.default_rng(0))
    pool = net.device.pool
    thief = pool.alloc(pool.largest_free - 4096)         # another buffer on the device
    error = None
    try:
        net.forward()
    except MemoryExhausted as e:
        error = str(e)
    assert error and "at step" in error and "outside the plan" in error
    pool.free(thief)
    pool.reset_peak()
    net.forward()                                         # resets what the failed forward left
    net.backward()
    assert pool.in_use == net.plan.persistent_bytes and pool.peak == net.plan.peak


def test_bench_dispatch_prints_the_time_per_operator(capsys):
    import sys
    from conftest import ROOT
    sys.path.insert(0, str(ROOT / "tools"))
    import bench_dispatch
    assert bench_dispatch.main(["--net", str(ROOT / "prototxt/cifar10_resnet.prototxt"), "--batch", "2",
                                "--passes", "2"]) == 0
    out = capsys.readouterr().out
    assert "cifar10_resnet.prototxt batch 2: " in out and " us an operator" in out
    with pytest.raises(SystemExit, match="bench_dispatch: .*no_such.prototxt"):
        bench_dispatch.main(["--net", str(ROOT / "no_such.prototxt"), "--passes", "1"])


def test_an_operator_on_the_calling_thread_waits_for_a_collective_still_running():
    """While a collective runs on its stream the dispatcher tracks every operator's tensors (its
    fast path is for when nothing is pending): an operator reading what the collective writes
    waits for it, and once nothing is pending operators run untracked again."""
    import time
    ex, device = executor()
    g = Tensor("g", (4,), np.dtype(np.float32), "param_diff")
    ex.alloc(g, fill=0, persistent=True)
    node = SimpleNamespace(workspace={}, backward_workspace={})
    seen = []
    ex.run_op = lambda op, recompute, ws, chunk: seen.append(ex.arrays[id(g)].copy())

    def slow_sum(arrays, token):
        time.sleep(0.1)
        arrays[0][...] = 7.0
    collective = SimpleNamespace(name="all-reduce", tensors=[g], location="", nbytes=16, timeout=5,
                                 before=lambda ready=None: None, run=slow_sum, timed_out=lambda: None)
    read = Operator("read:forward", "forward", node, [g], [])
    ex.execute([Instr("collective", op=collective), Instr("run", op=read)])
    assert np.all(seen[-1] == 7.0)
    writers = dict(ex._writer)
    ex.execute([Instr("run", op=Operator("write:forward", "forward", node, [], [g]))])
    assert ex._writer == writers and not ex._async         # nothing pending: not tracked
