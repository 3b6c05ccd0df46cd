"""Plans near the edge run as planned: every plan that fits a capacity runs at it, with the
pool's peak equal to the plan's (a sample of tools/edge_sweep.py, which sweeps every net)."""
import sys

import pytest

from conftest import ROOT
from sncaffe.backend import CPUDevice
from sncaffe.plan.planner import make_plan
from test_modes import graph_of, net_param, train

sys.path.insert(0, str(ROOT / "tools"))
import edge_sweep  # noqa: E402

LENET = ROOT / "prototxt" / "lenet_train_test.prototxt"
CIFAR = ROOT / "prototxt" / "cifar10_resnet.prototxt"


@pytest.mark.parametrize("mode", edge_sweep.SWEPT)
def test_every_plan_that_fits_runs_at_its_capacity(mode):
    # LeNet's finest whole-segment plan peaks where its per-layer plan does: the CIFAR ResNet's
    # lies below, so its capacities there are planned and run as whole segments
    net, steps = (CIFAR, 10) if mode == "segments" else (CIFAR, 4) if mode == "chains" else (LENET, 6)
    points = edge_sweep.sweep(net, mode, steps=steps)
    fit = [p for p in points if p[1]]
    assert fit, "no capacity near the peak fits"
    assert all(met for _, _, met, _ in fit), [p for p in fit if not p[2]][:2]
    if mode == "segments":
        graph = graph_of(net_param(net))
        assert any(make_plan(graph, "recompute", c).granularity for c, *_ in fit), "no whole-segment plan ran"
    if mode == "chains":
        graph = graph_of(net_param(net))
        assert any(make_plan(graph, "recompute", c).kept for c, *_ in fit), "no plan kept a chain"


def test_a_plan_that_fragments_its_capacity_is_placed_in_a_smaller_arena():
    """Best fit is not monotone in the arena: LeNet's liveness plan fragments at 5 % over its
    peak; the plan is placed in an arena between its peak and the capacity, and runs there."""
    param = net_param(LENET, 64)
    graph = graph_of(param)
    low = make_plan(graph, "liveness").peak
    fragmented = [c for c in range(low, low * 11 // 10, max(256, low // 200))
                  if make_plan(graph, "liveness", c).arena is not None]
    assert fragmented, "no capacity near the peak needs a smaller arena (the case this guards)"
    capacity = fragmented[0]
    plan = make_plan(graph, "liveness", capacity)
    assert plan.fits and plan.capacity == capacity and low <= plan.arena < capacity
    device = CPUDevice(capacity, host_capacity="1GiB")
    ran, steps = train(param, "liveness", capacity, iters=1, device=device)
    assert ran.arena == plan.arena and device.pool.capacity == plan.arena
    assert [peak for peak, _ in steps] == [plan.peak]
