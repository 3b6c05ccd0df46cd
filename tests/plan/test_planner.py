"""The planner: peaks per mode, the lower bound, schedules that are valid step by step,
``auto``, exhaustion errors, and ResNet-2500 in 12 GiB."""

from dataclasses import replace

import pytest

from sncaffe import config
from sncaffe import Net
from sncaffe.backend import CPUDevice
from sncaffe.plan.liveness import op_tensors, workspaces
from sncaffe.plan.planner import (AUTO_ORDER, MODES, MemoryExhausted, PlanError, _cost, auto_plan, check_fits,
                                  make_plan, quick_bound)
from sncaffe.sizes import align
from sncaffe.plan.schedule import simulate
from sncaffe.proto import sncaffe_pb2 as pb
from sncaffe.prototxt import read_text, set_batch
from conftest import ROOT, SHARED
from test_liveness import TEXT, graph_of as text_graph
from test_modes import graph_of, net_param

GiB = 1 << 30


class Planned:
    """A graph and its plans, with a short repr: pytest prints the arguments of a failing
    test, and a graph's repr (a cyclic dataclass) takes minutes to build."""

    def __init__(self, name, graph):
        self.name, self.graph = name, graph
        self.plans = {m: make_plan(graph, m) for m in MODES}

    def __repr__(self):
        return f"<{self.name}>"


def resnet(depth, batch=16):
    """A real ResNet at a real batch: planned only, nothing is allocated."""
    return graph_of(set_batch(read_text(ROOT / "prototxt" / f"resnet{depth}.prototxt", pb.NetParameter()), batch))


@pytest.fixture(scope="module")
def r50():
    return Planned("resnet50 batch 16", resnet(50))


def check_schedule(plan):
    """Replay a schedule symbolically: every operator finds what it touches on the device,
    nothing is allocated twice or freed unallocated, copies have both ends, the capacity is
    never exceeded, and the iteration ends with only the persistent tensors on the device.
    Returns the names of the host copies still held at the end (see test_host_copies_dropped)."""
    persistent = {id(r) for r in plan.persistent}
    live, hosted, used = {}, {}, plan.persistent_bytes + plan.extra_bytes
    for k, ins in enumerate(plan.schedule):
        t = ins.tensor
        if ins.kind == "alloc":
            assert id(t) not in live and id(t) not in persistent, f"{k}: {ins} twice"
            live[id(t)] = t
            used += align(t.nbytes)
            assert plan.capacity is None or used <= plan.capacity, f"{k}: {ins} exceeds the capacity"
        elif ins.kind == "free":
            assert live.pop(id(t), None) is not None, f"{k}: {ins} not allocated"
            used -= align(t.nbytes)
        elif ins.kind == "run":
            for r, _ in op_tensors(ins.op):
                assert id(r) in persistent or id(r) in live, f"{k}: {ins}: {r.name} not on the device"
            ws = ins.workspace.values() if ins.workspace else workspaces(ins.op)
            assert all(id(w) in live for w in ws), f"{k}: {ins}: workspace missing"
        elif ins.kind == "offload":
            assert id(ins.source or t) in live, f"{k}: {ins} from nowhere"
            hosted[id(t)] = t.name
        elif ins.kind == "prefetch":
            assert id(t) in hosted and id(ins.source or t) in live, f"{k}: {ins}"
        elif ins.kind == "drop":
            del hosted[id(t)]
        elif ins.kind in ("snapshot", "restore"):
            assert id(t) in live and id(ins.source) in live, f"{k}: {ins}"
    assert not live, "the iteration leaves tensors on the device"
    assert used == plan.persistent_bytes + plan.extra_bytes
    return sorted(hosted.values())


@pytest.mark.parametrize("net", ["tiny", "resnet50"])
def test_host_copies_dropped(r50, net):
    """A checkpoint is offloaded only for a segment that is replayed, and dropped after it."""
    graph = text_graph(TEXT) if net == "tiny" else r50.graph
    plan = make_plan(graph, "all", cost_aware=False)
    assert check_schedule(plan) == [] and plan.timeline.host[-1] == 0


def test_resnet_mode_peaks_ordered(r50):
    p = {m: plan.peak for m, plan in r50.plans.items()}
    assert p["none"] >= p["liveness"] >= p["recompute"]
    # (recomputation saves less since an in-place Scale shares BatchNorm's x_norm: 1.18x here)
    assert p["liveness"] >= 1.1 * p["recompute"]
    assert max(p["offload"], p["all"]) <= p["recompute"] / 2          # well below
    lb = {plan.lower_bound for plan in r50.plans.values()}
    assert len(lb) == 1 and lb.pop() <= min(p.values())
    assert p["all"] <= 1.5 * r50.plans["all"].lower_bound


@pytest.mark.parametrize("mode", MODES)
def test_resnet_schedules_are_valid(r50, mode):
    check_schedule(r50.plans[mode])


@pytest.mark.parametrize("mode", MODES)
def test_timeline_is_the_schedule(r50, mode):
    plan = r50.plans[mode]
    t = simulate(plan.schedule, plan.persistent_bytes + plan.extra_bytes)
    assert t.peak == plan.peak == plan.timeline.peak and t.device == plan.timeline.device
    assert t.device[0] == t.device[-1] == plan.persistent_bytes
    assert t.host[-1] == 0 or mode == "all"               # see test_host_copies_dropped
    assert plan.host_peak == t.host_peak and (plan.host_peak > 0) == (mode in ("offload", "all"))
    assert [name for _, name in t.steps].count("fc1000:forward") == 1


def test_transfers_and_recomputation_by_mode(r50):
    for mode, plan in r50.plans.items():
        assert (plan.d2h_bytes > 0) == (plan.h2d_bytes > 0) == (mode in ("offload", "all")), mode
        if not plan.note:   # (cost-aware: "all" may have found recomputation not worth it)
            assert (plan.recomputed_ops > 0) == (plan.recompute_flops > 0) == (mode in ("recompute", "all")), mode
        assert plan.h2d_bytes <= plan.d2h_bytes


def test_lower_bound_is_the_largest_step(r50):
    plan = r50.plans["liveness"]
    persistent = {id(r) for r in plan.persistent}
    own = max(sum(align(r.nbytes) for r, _ in op_tensors(op) if id(r) not in persistent)
              + sum(align(t.nbytes) for t in workspaces(op)) for op in r50.graph.ops)
    assert plan.lower_bound == plan.persistent_bytes + own
    assert plan.lower_bound_step in {op.name for op in r50.graph.ops}


@pytest.mark.parametrize("mode", MODES)
def test_reserve_adds_to_every_step(mode):
    graph = text_graph(TEXT)
    base, reserved = make_plan(graph, mode), make_plan(graph, mode, None, 1000)
    assert reserved.peak == base.peak + align(1000) and reserved.lower_bound == base.lower_bound + align(1000)
    assert reserved.extra_bytes == align(1000)


def test_unknown_mode():
    with pytest.raises(PlanError, match="unknown memory mode"):
        make_plan(text_graph(TEXT), "sometimes")


def test_auto_picks_the_cheapest_mode_that_fits(r50):
    p = {m: plan.peak for m, plan in r50.plans.items()}
    assert AUTO_ORDER[:3] == ("none", "liveness", "recompute")
    assert auto_plan(r50.graph, p["none"]).mode == "none"
    assert auto_plan(r50.graph, p["none"] - 1).mode == "liveness"
    assert auto_plan(r50.graph, p["recompute"] + GiB // 8).mode == "recompute"
    coarse = auto_plan(r50.graph, (p["offload"] + p["recompute"]) // 2)     # whole blocks replayed
    assert coarse.mode == "recompute" and coarse.granularity >= 1 and coarse.fits
    finest = make_plan(r50.graph, "recompute", granularity=1).peak
    lean = auto_plan(r50.graph, (p["offload"] + finest) // 2)
    assert lean.mode in ("offload", "all") and lean.fits and lean.peak <= lean.capacity
    hopeless = auto_plan(r50.graph, p["all"] // 2)
    assert hopeless.mode == "all" and not hopeless.fits


def test_check_fits_names_the_step_and_suggests_a_mode(r50):
    capacity = r50.plans["liveness"].peak + GiB // 16
    check_fits(r50.graph, r50.plans["liveness"], capacity)
    with pytest.raises(MemoryExhausted) as e:
        check_fits(r50.graph, r50.plans["none"], capacity)
    msg = str(e.value)
    assert "memory mode 'none'" in msg and "at step" in msg and "short" in msg
    assert "memory mode 'liveness' fits" in msg
    step = msg.split("at step ", 1)[1].split(",")[0]
    assert step.split(" ")[0] in {op.name for op in r50.graph.ops}
    with pytest.raises(MemoryExhausted, match="no memory mode fits"):
        check_fits(r50.graph, r50.plans["all"], r50.plans["all"].lower_bound // 2)


def test_net_refuses_a_plan_that_does_not_fit_before_allocating():
    param = net_param(ROOT / "prototxt" / "lenet_train_test.prototxt")
    graph = graph_of(param)
    from test_net import smallest_fit
    need = smallest_fit(graph, "liveness")
    assert not make_plan(graph, "none", need).fits
    device = CPUDevice(need)
    with pytest.raises(MemoryExhausted, match=r"memory mode 'none' needs .* at step .*; memory mode '\w+' fits"):
        Net(param, "TRAIN", device=device, memory="none")
    assert device.pool.in_use == 0
    net = Net(param, "TRAIN", device=device, memory="auto")
    assert net.plan.mode != "none" and net.plan.fits
    net.forward()
    net.backward()
    assert device.pool.peak == net.plan.peak <= need


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ["tiny", "resnet50-small"])
def test_small_schedules_are_valid_with_and_without_capacity(name, mode):
    graph = text_graph(TEXT) if name == "tiny" else graph_of(net_param(ROOT / "prototxt" / "resnet50.prototxt"))
    check_schedule(make_plan(graph, mode))
    tight = make_plan(graph, mode).peak
    plan = make_plan(graph, mode, tight + 256)
    if plan.fits:
        check_schedule(plan)


def test_resnet2500_fits_12gib_with_sgd_history():
    from sncaffe.solvers.solver import history_blocks
    graph = resnet(2500)
    history = history_blocks(graph, 1)          # SGD: one history blob per parameter, 2 work buffers
    params = sum(d.nbytes for n in graph.layers for d, _ in n.params)
    assert params > 3 * GiB                    # 0.9 billion parameters
    plan = make_plan(graph, "all", 12 * GiB, history)
    assert plan.fits and plan.peak <= 12 * GiB and not plan.overflow
    assert plan.lower_bound <= plan.peak and plan.extra_bytes >= params
    check_schedule(plan)


def test_all_is_no_worse_than_offload(r50):
    assert r50.plans["all"].peak <= r50.plans["offload"].peak
    # the guarantee is the cost-aware choice: offload's plan (noted) exactly where recomputation costs more
    raw = make_plan(r50.graph, "all", cost_aware=False)
    assert bool(r50.plans["all"].note) == (_cost(r50.plans["offload"]) < _cost(raw))
    assert r50.plans["all"].peak == min(raw.peak, r50.plans["offload"].peak)


@pytest.mark.skipif(SHARED is None, reason="tests/data/shared/zoo is not present")
@pytest.mark.parametrize("name", ["cifar10__cifar10_quick_train_test", "cifar10__cifar10_full_train_test"])
def test_recompute_is_no_worse_than_liveness(name):
    graph = graph_of(net_param(SHARED / "zoo" / "bvlc" / f"{name}.prototxt"))
    assert make_plan(graph, "recompute").peak <= make_plan(graph, "liveness").peak


HUGE = """
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 1000000 dim: 2 dim: 8 dim: 8 } } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
        convolution_param { num_output: 2 kernel_size: 3 weight_filler { type: "xavier" } } }
layer { name: "loss" type: "EuclideanLoss" bottom: "conv" bottom: "conv" top: "loss" }
"""


def test_a_huge_batch_chunks_by_bisection(monkeypatch):
    """--batch 1000000 must not try every smaller chunk one by one (a million workspace
    trials per convolution). The search is a bisection: at most log2(batch) + 1
    trials per choice, counted by the plan."""
    monkeypatch.setattr(config, "settings", replace(config.settings, conv="native"))    # ConvPlan's workspace grows with the chunk
    import math
    from sncaffe.prototxt import parse_text, prepare_net
    from sncaffe.graph import build_graph
    graph = build_graph(prepare_net(parse_text(HUGE, pb.NetParameter()), pb.TRAIN), pb.TRAIN)
    full = make_plan(graph, "liveness")
    biggest = max(t.nbytes for op in graph.ops for t in workspaces(op))
    plan = make_plan(graph, "liveness", full.peak - biggest // 2)     # the full workspace cannot fit
    runs = [ins for ins in plan.schedule if ins.kind == "run"]
    chunked = [ins for ins in runs if ins.chunk]
    assert chunked and all(1 <= ins.chunk < 1_000_000 for ins in chunked)
    assert 0 < plan.chunk_trials <= len(chunked) * (math.floor(math.log2(1_000_000)) + 1)


@pytest.mark.parametrize("name", ["resnet50 batch 16", "zoo"])
def test_quick_bounds_are_at_most_the_peaks(r50, name):
    """auto skips a mode whose quick bound exceeds the capacity: the bound must never be more
    than the mode's plan, at no capacity or at a tight one, with a solver's history beside it."""
    from test_modes import ZOO
    graphs = [r50.graph] if name != "zoo" else [graph_of(net_param(p)) for p in ZOO[:6]]
    if not graphs:
        pytest.skip("tests/data/shared/zoo is not present")
    for graph in graphs:
        for mode in ("none", "liveness", "recompute"):
            free = make_plan(graph, mode, None, 4096)
            bound = quick_bound(graph, mode, 4096)
            assert 0 < bound <= free.peak, mode
            tight = make_plan(graph, mode, bound + (free.peak - bound) // 2, 4096)
            assert bound <= tight.peak, mode
