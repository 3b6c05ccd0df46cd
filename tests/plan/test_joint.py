"""A solver's train net, test nets and history are planned as one. Under
tight devices where the test net used to exhaust the pool at the iteration-0 test, auto
trains, and the pool's measured peak (device and host) is the joint plan's."""
import re

import numpy as np
import pytest

from sncaffe.backend import CPUDevice
from sncaffe.plan.planner import MemoryExhausted
from sncaffe.proto import sncaffe_pb2 as pb
from sncaffe.prototxt import read_text, replace_data_layers
from sncaffe.solvers.solver import Solver
from conftest import ROOT

MiB = 1 << 20


def lenet():
    """LeNet's train_test net with Input layers for its LMDBs (train batch 64, test batch 100)."""
    param = read_text(ROOT / "prototxt" / "lenet_train_test.prototxt", pb.NetParameter())
    train = replace_data_layers(param, {"data": (64, 1, 28, 28), "label": (64,)})
    test = replace_data_layers(param, {"data": (100, 1, 28, 28), "label": (100,)})
    return train, test


def feed(net, it):
    rng = np.random.default_rng(it)
    net.blobs["data"].data[...] = rng.random(net.blobs["data"].shape, dtype=np.float32)
    net.blobs["label"].data[...] = rng.integers(0, 10, net.blobs["label"].shape)


def solver(capacity, mode=None):
    train, test = lenet()
    p = pb.SolverParameter(base_lr=0.01, momentum=0.9, lr_policy="fixed", max_iter=4, display=0, random_seed=1,
                           test_iter=[2], test_interval=2, snapshot_after_train=False)
    p.train_net_param.CopyFrom(train)
    p.test_net_param.add().CopyFrom(test)
    if mode:
        p.memory_param.mode = mode
    return Solver(p, device=CPUDevice(capacity), feed=feed)


@pytest.mark.parametrize("mib", [12, 16, 20, 24, 32, 40])
def test_joint_plan_peak_is_the_measured_peak(mib):
    s = solver(mib * MiB)
    plans = [s.net.plan] + [n.plan for n in s.test_nets]
    assert all(p.fits for p in plans)
    for net in s.test_nets:             # a test runs forward only, and is planned so
        assert net.plan.mode not in ("none", "liveness") or not net.plan.schedule.backward
    s.step(4)                   # tests at iterations 0 and 2, between training iterations
    assert s.device.pool.peak == max(p.peak for p in plans)
    assert s.device.host_pool.peak == max(p.host_peak for p in plans)
    assert np.isfinite(s.smoothed_loss) and s.test_scores[0]


def test_explicit_mode_is_planned_jointly_or_refused_clearly():
    s = solver(40 * MiB, "liveness")
    assert s.net.plan.mode == s.test_nets[0].plan.mode == "liveness"
    s.step(4)
    assert s.device.pool.peak == max(s.net.plan.peak, s.test_nets[0].plan.peak)
    with pytest.raises(MemoryExhausted, match="planned together"):
        solver(4 * MiB)


def test_progress_inside_an_iteration_at_quarters_and_every_few_seconds(capsys):
    """Nets of thousands of layers show progress inside each iteration: a line at each quarter
    and, where a quarter is slow (ResNet-2500: minutes), at least every EVERY seconds."""
    from sncaffe.progress import StepProgress
    from sncaffe.progress import Console, console
    s = solver(40 * MiB)
    steps = sum(1 for ins in s.net.plan.schedule if ins.kind == "run")
    for every, lines in ((1e9, 4), (0.0, steps)):
        with console(bar=False):
            progress = StepProgress(Console(False), s.net, s)
            progress.EVERY = every
            s.net.step_hook = progress
            feed(s.net, 0)
            s.net.forward()
            s.net.backward()
        out = capsys.readouterr().out
        assert out.count("Iteration 0: ") == lines and "Iteration 0: 100% of the pass" in out
        assert re.search(r"Iteration 0: \d+% of the pass \(.*\), about [\d.]+ s/iter, ETA \d+[smhd]", out)


@pytest.mark.parametrize("mode", ["liveness", "offload", "all", "recompute"])
def test_a_test_net_is_planned_for_its_forward_pass_alone(mode):
    """A test runs forward alone: in every mode its plan has no backward and moves nothing, and
    the pool's peak during a test is the test plan's peak (once the plan of offload/recompute
    held backward's values and copies too, above what a test takes)."""
    s = solver(40 * MiB, mode)
    test = s.test_nets[0].plan
    assert test.mode == mode and not test.schedule.backward
    assert test.d2h_bytes == test.h2d_bytes == test.recompute_flops == 0
    s.device.pool.reset_peak()
    s.test(0)
    assert s.device.pool.peak == test.peak
    assert s.device.pool.in_use == test.timeline.device[0]        # what the test left went back
