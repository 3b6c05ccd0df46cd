"""Parameter state on the disk tier. Where the host pool cannot hold the parameters,
their gradients and the solver's history (host_params), they live in the spill file, read per
layer on the copy streams and written back after the update: the same bits as with enough
host memory, and the device, host and spill-file peaks measured equal to the plan's."""
import os

import numpy as np
import pytest

from sncaffe.backend import CPUDevice
from sncaffe.plan.planner import MemoryExhausted
from sncaffe.runtime.spill import spill_of
from sncaffe.proto import sncaffe_pb2 as pb
from sncaffe.solvers.solver import Solver
from conftest import ROOT
from test_modes import feed, net_param

R50 = ROOT / "prototxt" / "resnet50.prototxt"


def solve(device, mode="all", iters=2, prefix=None):
    p = pb.SolverParameter(base_lr=0.01, momentum=0.9, max_iter=iters, display=0, random_seed=1,
                           lr_policy="fixed", snapshot_after_train=prefix is not None, weight_decay=1e-4)
    if prefix is not None:
        p.snapshot_prefix = str(prefix)
    p.net_param.CopyFrom(net_param(R50))
    p.memory_param.mode, p.memory_param.host_params = mode, True
    solver = Solver(p, device=device, feed=lambda net, it: feed(net, np.random.default_rng(it)))
    solver.solve() if prefix is not None else solver.step(iters)
    return solver


@pytest.mark.parametrize("mode", ["all", "liveness"])
def test_parameter_state_beyond_the_host_pool_trains_through_the_disk_tier(tmp_path, mode):
    ref = solve(CPUDevice("1GiB", "1GiB"), mode)
    assert not ref.net.plan.param_disk and ref.net.plan.disk_peak == 0
    state = sum(a.nbytes for a in ref.state_arrays()) + sum(q.blob.diff.nbytes for q in ref._learnable)
    device = CPUDevice("1GiB", state // 4)           # a host pool a quarter of the parameter state
    device.spill_dir = tmp_path
    solver = solve(device, mode)
    plan = solver.net.plan
    assert plan.param_disk and plan.fits and plan.disk_peak >= state and plan.host_peak <= state // 4
    for a, b in zip(ref.state_arrays(), solver.state_arrays()):     # parameters and history, bit for bit
        assert np.array_equal(a, b)
    for q, r in zip(solver._learnable, ref._learnable):
        assert np.array_equal(q.blob.diff, r.blob.diff)
    spill = spill_of(device)
    assert device.pool.peak == plan.peak
    assert device.host_pool.peak == plan.host_peak
    assert spill.pool.peak == plan.disk_peak
    assert os.listdir(tmp_path) == []               # the spill file has no name
    assert not solver.net.executor.busy


def test_without_a_disk_tier_host_parameters_that_do_not_fit_are_refused():
    device = CPUDevice("1GiB", "1MiB")
    device.spills = False
    with pytest.raises(MemoryExhausted, match="of host memory but the host pool has"):
        solve(device)


def lenet_solver(device):
    from test_joint import feed as lenet_feed, lenet
    train, test = lenet()
    p = pb.SolverParameter(base_lr=0.01, momentum=0.9, lr_policy="fixed", max_iter=4, display=0, random_seed=1,
                           test_iter=[2], test_interval=2, snapshot_after_train=False)
    p.train_net_param.CopyFrom(train)
    p.test_net_param.add().CopyFrom(test)
    p.memory_param.mode, p.memory_param.host_params = "all", True
    s = Solver(p, device=device, feed=lenet_feed)
    s.step(4)                   # tests at iterations 0 and 2, between training iterations
    return s


def test_with_a_test_net_the_joint_plan_counts_the_parameters_on_disk(tmp_path):
    ref = lenet_solver(CPUDevice("64MiB", "64MiB"))
    device = CPUDevice("64MiB", "8MiB")     # parameter state 9 MiB with the solver's work buffers
    device.spill_dir = tmp_path
    s = lenet_solver(device)
    plans = [s.net.plan] + [n.plan for n in s.test_nets]
    assert s.net.plan.param_disk and all(p.fits for p in plans)
    for a, b in zip(ref.state_arrays(), s.state_arrays()):
        assert np.array_equal(a, b)
    assert device.pool.peak == max(p.peak for p in plans)
    assert device.host_pool.peak == max(p.host_peak for p in plans)
    assert spill_of(device).pool.peak == max(p.disk_peak for p in plans) >= s.net.plan.disk_base > 0


def test_snapshots_of_parameters_on_disk_are_the_same_files(tmp_path):
    ref = solve(CPUDevice("1GiB", "1GiB"), prefix=tmp_path / "host")
    state = sum(a.nbytes for a in ref.state_arrays()) + sum(q.blob.diff.nbytes for q in ref._learnable)
    device = CPUDevice("1GiB", state // 4)
    device.spill_dir = tmp_path / "spill"
    solver = solve(device, prefix=tmp_path / "disk")
    assert solver.net.plan.param_disk
    (model_a, state_a), (model_b, state_b) = ref.last_snapshot, solver.last_snapshot
    assert open(model_a, "rb").read() == open(model_b, "rb").read()
    a, b = (pb.SolverState.FromString(open(f, "rb").read()) for f in (state_a, state_b))
    assert len(a.history) > 0 and a.iter == b.iter == 2
    a.ClearField("learned_net"), b.ClearField("learned_net")      # (the two files' own names)
    assert a == b


def test_mapped_pages_leave_the_resident_set_and_keep_their_bytes(tmp_path):
    """What keeps resident memory within the pools: the views' pages are dropped (trim) without
    losing what was written, which pread (the copy streams) and the view read back."""
    from sncaffe.runtime.budget import process_memory
    from sncaffe.runtime.spill import SpillFile
    spill = SpillFile(tmp_path)
    spill._stop.set()                           # no trimmer: this test trims by hand
    n = 64 << 20
    a = spill.view(spill.alloc(n), n, np.float32, (n // 4,))
    a[...] = np.arange(n // 4, dtype=np.float32)
    before = process_memory()["rss"]
    spill.trim()
    assert before - process_memory()["rss"] >= n // 2
    back = np.empty(n // 4, np.float32)
    spill.read(0, back)
    assert np.array_equal(back, np.arange(n // 4, dtype=np.float32)) and np.array_equal(a, back)
