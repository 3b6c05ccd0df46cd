"""Every tier is planned. The host pool's measured peak equals the plan's host
peak (offloaded copies, parameters kept on the host, the solver's history there), and on the
CPU, where device and host pools are one RAM, a plan fits only when both peaks together do."""
import numpy as np
import pytest

from sncaffe import Net
from sncaffe.backend import CPUDevice
from sncaffe.runtime.budget import margin, physical_ram, process_memory, ram_budget
from sncaffe.plan.planner import MemoryExhausted, auto_plan, make_plan
from sncaffe.proto import sncaffe_pb2 as pb
from sncaffe.solvers.solver import Solver
from conftest import ROOT
from test_modes import feed, graph_of, net_param

R50 = ROOT / "prototxt" / "resnet50.prototxt"


def run(net, device, iters=2):
    rng = np.random.default_rng(0)
    for _ in range(iters):
        feed(net, rng)
        net.forward()
        net.backward()
    return device.pool.peak, device.host_pool.peak


@pytest.mark.parametrize("mode,host_params", [("offload", False), ("all", False), ("all", True), ("liveness", True)])
def test_host_pool_peak_is_the_planned_host_peak(mode, host_params):
    device = CPUDevice("1GiB")
    net = Net(net_param(R50), "TRAIN", device=device, memory=mode, host_params=host_params)
    assert net.plan.host_peak > 0
    assert run(net, device) == (net.plan.peak, net.plan.host_peak)


def test_solver_history_on_the_host_is_planned():
    p = pb.SolverParameter(base_lr=0.01, momentum=0.9, max_iter=2, display=0, random_seed=1, lr_policy="fixed",
                           snapshot_after_train=False, type="Adam")
    p.net_param.CopyFrom(net_param(R50))
    p.memory_param.mode, p.memory_param.host_params = "all", True
    solver = Solver(p, device=CPUDevice("1GiB"), feed=lambda net, it: feed(net, np.random.default_rng(it)))
    plan = solver.net.plan
    assert plan.host_extra > 0 and plan.extra_bytes == 0      # Adam's two history blobs per parameter
    solver.step(2)
    assert solver.device.host_pool.peak == plan.host_peak
    assert solver.device.pool.peak == plan.peak


def test_one_ram_counts_both_tiers():
    """Offloading on the CPU holds a value in both pools while it is cached: under a RAM
    budget below device + host peaks, auto plans the device smaller so the two fit together."""
    graph = graph_of(net_param(R50, 4))
    off = make_plan(graph, "offload", 1 << 30)
    assert off.host_peak > 0
    ram = off.peak + off.host_peak - 1
    assert not make_plan(graph, "offload", 1 << 30, ram=ram).fits
    plan = auto_plan(graph, 1 << 30, ram=ram)
    assert plan.fits and plan.peak + plan.host_peak <= ram


def test_a_host_tier_that_does_not_fit_is_refused_naming_it():
    device = CPUDevice("1GiB", "64KiB")
    device.spills = False               # no disk tier to take what the host cannot (see test_disk.py)
    with pytest.raises(MemoryExhausted, match="of host memory but the host pool has"):
        Net(net_param(R50), "TRAIN", device=device, memory="offload")


def test_budget_is_available_ram_less_a_margin():
    budget = ram_budget()           # available RAM less the margin, at least a sixteenth of RAM
    assert physical_ram() // 16 <= budget < physical_ram() and margin() >= physical_ram() // 10
    device = CPUDevice()
    assert device.pool.capacity <= ram_budget() + (1 << 30) and device.ram is not None
    assert CPUDevice("1GiB", "1GiB").ram is None        # both pools given: the user's split
    assert process_memory()["rss"] > 0


def test_copies_go_to_the_host_while_it_has_room_then_to_disk():
    from sncaffe.plan.liveness import analyze, persistent_roots
    from sncaffe.sizes import align
    from sncaffe.plan.tiers import Tiers
    graph = graph_of(net_param(R50))
    values = [r for r, _ in analyze(graph.ops, persistent_roots(graph)).values()][:4]
    room = align(values[0].nbytes) + align(values[1].nbytes)
    tiers = Tiers(room, 0)
    assert [tiers.place(r) for r in values[:3]] == ["host", "host", "disk"]
    assert tiers.used == room
    tiers.release(values[2])                            # a disk copy gives back no host bytes
    tiers.release(values[0])
    assert tiers.used == align(values[1].nbytes)
    assert tiers.place(values[3]) == ("host" if align(values[3].nbytes) <= room - tiers.used else "disk")
