"""Every net, every memory mode, trained on a small batch, gives the
planned pool peak to the byte and the results of mode ``none`` to the last bit.

Nets come from prototxt/ and tests/data/shared/zoo. The big ones are shrunk (SHRINK) in ways that
keep every layer and connection, so the memory runtime sees the same graph with smaller
tensors. ResNet-2500 (0.9 billion parameters) is only planned: see test_planner.py.
"""
import math

from dataclasses import replace

import numpy as np
import pytest

from sncaffe import config
from sncaffe import Net
from sncaffe.backend import CPUDevice
from sncaffe.graph import build_graph
from sncaffe.plan import passes
from sncaffe.plan.planner import MODES, MemoryExhausted, make_plan
from sncaffe.proto import sncaffe_pb2 as pb
from sncaffe.prototxt import DATA_LAYERS, parse_text, prepare_net, read_text, replace_data_layers, set_batch
from sncaffe.solvers.solver import Solver
from conftest import ROOT, SHARED

BATCH = 2
PLAN_ONLY = {"resnet2500"}
OWN = sorted(p for p in (ROOT / "prototxt").glob("*.prototxt") if "solver" not in p.name and p.stem not in PLAN_ONLY)
ZOO = sorted(p for p in (SHARED / "zoo").rglob("*.prototxt") if "solver" not in p.name) if SHARED else []
# Input shapes (C, H, W) standing in for each train_val net's data layer (as tests/test_zoo.py).
DATA_SHAPES = {"bvlc_alexnet": (3, 227, 227), "bvlc_googlenet": (3, 224, 224),
               "cifar10": (3, 32, 32), "mnist": (1, 28, 28), "lenet": (1, 28, 28)}
# What is shrunk, by file name prefix: ``width`` divides every Convolution/InnerProduct num_output
# (every branch alike, so Concat and Eltwise still agree); ``hw`` is the input's height and
# width, with the 7x7 average pooling meant for 224x224 inputs made global.
SHRINK = {"resnet": dict(width=16, hw=32), "ResNet": dict(width=16, hw=32),
          "bvlc_googlenet": dict(width=8, hw=96), "bvlc_alexnet": dict(width=8, hw=67),
          "bvlc_reference_caffenet": dict(width=8, hw=67), "alexnet": dict(width=8, hw=67),
          "vgg": dict(width=16, hw=32), "inception_v4": dict(width=16, hw=299),
          "cifar10_resnet": dict(width=2)}
# Nets run under a tight capacity: one of each family (ResNet-101/152 repeat ResNet-50's
# blocks, the zoo's LeNets and CaffeNet repeat prototxt/lenet and AlexNet).
TIGHT = {"resnet50", "lenet_train_test", "bvlc_alexnet__train_val", "bvlc_googlenet__train_val",
         "cifar10__cifar10_full_sigmoid_train_test_bn", "cifar10__cifar10_full_train_test", "ResNet-50-deploy"}
# Tight-capacity cases where the LRU cache must miss (evict, then prefetch back).
# (ResNet-50's unchunked plans cache every offloaded copy once its Scales share BatchNorm's x_norm;
# tests/plan/test_cache.py makes it miss below the uncached peak, where convolutions chunk.)
MISSES = {("cifar10__cifar10_full_train_test", "offload")}


def _shrink(param, width=1, hw=None):
    for layer in param.layer:
        if layer.type in ("Convolution", "InnerProduct") and width > 1:
            p = layer.convolution_param if layer.type == "Convolution" else layer.inner_product_param
            group = getattr(p, "group", 1) or 1
            p.num_output = group * max(1, math.ceil(p.num_output / width / group))
        elif layer.type == "Input" and hw:
            for s in layer.input_param.shape:
                if len(s.dim) == 4:
                    s.dim[2] = s.dim[3] = hw
        elif layer.type == "Pooling" and hw and layer.pooling_param.kernel_size == 7 \
                and layer.pooling_param.pool == pb.PoolingParameter.AVE:
            layer.pooling_param.ClearField("kernel_size")
            layer.pooling_param.global_pooling = True
    return param


def net_param(path, batch=BATCH):
    """The file as a small training net: Input layers for data layers, shrunk, force_backward."""
    param = read_text(path, pb.NetParameter())
    if any(layer.type in DATA_LAYERS for layer in param.layer):
        chw = next(v for k, v in DATA_SHAPES.items() if k in path.name)
        param = replace_data_layers(param, {"data": (batch,) + chw, "label": (batch,)})
    param = set_batch(param, batch)
    param = _shrink(param, **next((v for k, v in SHRINK.items() if path.name.startswith(k)), {}))
    param.force_backward = True
    return param


def graph_of(param):
    return build_graph(prepare_net(param, pb.TRAIN), pb.TRAIN)


def init_weights(net, rng):
    """Deploy nets have no fillers: random weights where a file leaves them all zero."""
    for layer in net.layers:
        if layer.learnable and not any(np.any(b.data) for b in layer.blobs):
            for b in layer.blobs:
                b.data[...] = rng.normal(0, 0.05, b.data.shape)
        elif layer.type == "BatchNorm" and layer.use_global_stats:
            layer.blobs[1].data[...] = 1          # unit running variance
            layer.blobs[2].data[...] = 1


def feed(net, rng):
    for name in net.inputs:
        blob = net.blobs[name]
        blob.data[...] = rng.integers(0, 2, blob.shape) if name == "label" else rng.standard_normal(blob.shape)


def train(param, mode, capacity="1GiB", iters=2, device=None, planner=None):
    """``iters`` SGD steps from fixed weights and inputs. Returns the plan and, per iteration,
    the pool peak and a copy of everything that must equal mode none's bit for bit.
    ``planner(net)``: the plan to bind the net to, where not the one Net makes."""
    device = device or CPUDevice(capacity)
    try:
        net = Net(param, "TRAIN", device=device, memory=mode, seed=1, defer=planner is not None)
        if planner is not None:
            net.place(planner(net))
        error = None
    except MemoryExhausted as e:
        error = str(e)
    if error:           # failed outside the except block: pytest would print the graph (for minutes)
        pytest.fail(error)
    rng = np.random.default_rng(0)
    init_weights(net, rng)
    pool, steps = device.pool, []
    for _ in range(iters):
        feed(net, rng)
        net.clear_param_diffs()
        pool.reset_peak()
        loss = net.forward()
        for name in net.outputs:        # deploy nets have no loss: feed a gradient into their outputs
            blob = net.blobs[name]
            if blob.diff is not None and blob.data.ndim:
                blob.diff[...] = rng.standard_normal(blob.shape)
        net.backward()
        state = {"loss": np.float64(loss)}
        for name, blobs in net.params.items():     # BatchNorm's running statistics included
            for i, b in enumerate(blobs):
                state[f"{name}[{i}]"], state[f"{name}[{i}].diff"] = b.data.copy(), b.diff.copy()
        for name in net.inputs:
            if net.blobs[name].diff is not None:
                state[f"{name}.diff"] = net.blobs[name].diff.copy()
        steps.append((pool.peak, state))
        for blobs in net.params.values():
            for b in blobs:
                b.data -= np.float32(0.01) * b.diff
    assert pool.in_use == net.plan.persistent_bytes, "an iteration left blocks behind"
    assert device.host_pool.in_use == 0, "an iteration left host blocks behind"
    return net.plan, steps


_reference = {}


def reference(path):
    """Mode none's run of ``path`` on this test's convolutions (cases are ordered net by net:
    keep only the last)."""
    key = (path, config.settings.conv)
    if key not in _reference:
        _reference.clear()
        _reference[key] = train(net_param(path), "none")
    return _reference[key]


@pytest.fixture
def native_conv(monkeypatch):
    """Convolutions on ConvPlan: these tests need workspaces that shrink with the chunk down to
    a few images, and capacities drawn from ConvPlan's sizes (oneDNN's scratchpads do not
    shrink with the chunk; tests/layers/test_onednn.py checks its pool peak against the plan)."""
    monkeypatch.setattr(config, "settings", replace(config.settings, conv="native"))


def assert_same_bits(steps, ref_steps):
    for it, ((_, state), (_, ref)) in enumerate(zip(steps, ref_steps)):
        assert state.keys() == ref.keys()
        differ = [k for k in ref if state[k].dtype != ref[k].dtype or state[k].tobytes() != ref[k].tobytes()]
        assert not differ, f"iteration {it}: differs from mode none in {differ[:8]}"


def assert_peaks(steps, plan):
    assert [peak for peak, _ in steps] == [plan.peak] * len(steps), "pool peak != planned peak"


CASES = [pytest.param(p, id=f"prototxt/{p.name}") for p in OWN]
CASES += [pytest.param(p, id=f"zoo/{p.name}") for p in ZOO]
if not ZOO:
    CASES.append(pytest.param(None, id="zoo", marks=pytest.mark.skip(reason="tests/data/shared/zoo is not present")))


def unchunked(plan):
    return plan.fits and not any(ins.kind == "run" and ins.chunk for ins in plan.schedule)


def half_the_chains(net):
    """Whole segments replayed with the better half of their layer chains kept (planner.with_kept
    keeps as many as a capacity has room for): every net runs the coarsest recomputation too."""
    return make_plan(net.graph, "recompute", granularity=1, keep=len(passes.chains(net.graph, 1)) // 2)


@pytest.mark.parametrize("path,mode", [pytest.param(c.values[0], m, id=f"{c.id}-{m}", marks=c.marks)
                                       for c in CASES for m in (*MODES, "chains")])
def test_mode_matches_plan_and_none(path, mode):
    ref_plan, ref_steps = reference(path)
    plan, steps = (ref_plan, ref_steps) if mode == "none" else \
        train(net_param(path), "recompute", planner=half_the_chains) if mode == "chains" else \
        train(net_param(path), mode)
    assert_peaks(steps, plan)
    assert plan.lower_bound <= plan.peak <= ref_plan.peak
    assert_same_bits(steps, ref_steps)


@pytest.mark.parametrize("path,mode", [pytest.param(c.values[0], m, id=f"{c.id}-{m}", marks=c.marks)
                                       for c in CASES for m in ("offload", "all")
                                       if c.values[0] is None or c.values[0].stem in TIGHT])
def test_tight_capacity_matches_plan_and_none(path, mode, native_conv):
    """The smallest device (in steps of 1/64 of the transient bytes) whose capacity-bound plan
    fits, from the peak of the plan without a cache: the LRU cache evicts and prefetches, and
    every block is placed where the planner placed it."""
    param = net_param(path)
    graph = graph_of(param)
    uncached = make_plan(graph, mode)
    step = max(256, (uncached.peak - uncached.persistent_bytes) // 64 // 256 * 256)
    # (A plan that chunks a convolution's batch sums its weight gradient in another order, so
    # bit equality asks for a capacity where the full workspaces can be placed.)
    capacity = next((c for c in range(uncached.peak + 256, 2 * uncached.peak, step)
                     if unchunked(make_plan(graph, mode, c))), None)
    assert capacity, "no capacity up to twice the uncached peak can be planned"
    plan, steps = train(param, mode, capacity)
    assert plan.capacity == capacity and plan.fits
    assert_peaks(steps, plan)
    if (path.stem, mode) in MISSES:
        assert plan.cache_misses > 0 and plan.h2d_bytes > 0
    assert_same_bits(steps, reference(path)[1])


@pytest.mark.parametrize("mode", ["offload", "all"])
def test_fits_at_its_uncached_peak(mode, native_conv):
    """At the uncached plan's own peak the free memory is fragmented; a convolution whose full
    workspace cannot be placed works in chunks of the batch, and the run meets its plan (batch
    14: a chunk is a multiple of the convolution's reduction block, conv1's is 7 images here)."""
    param = net_param(ROOT / "prototxt" / "resnet50.prototxt", 14)
    capacity = make_plan(graph_of(param), mode).peak + 256
    plan = make_plan(graph_of(param), mode, capacity)
    assert plan.fits, plan.overflow
    assert any(ins.kind == "run" and ins.chunk for ins in plan.schedule)
    plan, steps = train(param, mode, capacity)
    assert_peaks(steps, plan)


# -- the Solver: memory_param.mode, history reserved beside the net -----------------------

SOLVER = """
base_lr: 0.01 momentum: 0.9 weight_decay: 0.0005 lr_policy: "step" gamma: 0.5 stepsize: 2
max_iter: 4 display: 0 random_seed: 3 snapshot_after_train: false type: "{type}"
"""


def solve(mode, solver_type="SGD", iters=3):
    param = parse_text(SOLVER.format(type=solver_type), pb.SolverParameter())
    param.net_param.CopyFrom(net_param(ROOT / "prototxt" / "resnet50.prototxt"))
    param.memory_param.mode = mode
    solver = Solver(param, device=CPUDevice("256MiB"), feed=lambda net, it: feed(net, np.random.default_rng(it)))
    pool = solver.device.pool
    pool.reset_peak()
    solver.step(iters)
    return solver, pool.peak


@pytest.mark.parametrize("solver_type", ["SGD", "Adam"])
def test_solver_modes_train_alike(solver_type):
    ref, ref_peak = solve("none", solver_type)
    assert ref.net.plan.extra_bytes > 0 and ref_peak == ref.net.plan.peak
    for mode in MODES[1:]:
        solver, peak = solve(mode, solver_type)
        assert solver.net.plan.mode == mode
        assert peak == solver.net.plan.peak, mode          # the solver's history included
        assert solver.net.plan.extra_bytes == ref.net.plan.extra_bytes
        for name, blobs in ref.net.params.items():
            for a, b in zip(blobs, solver.net.params[name]):
                assert a.data.tobytes() == b.data.tobytes(), (mode, name)
        for a, b in zip(ref.history, solver.history):
            assert a.tobytes() == b.tobytes(), mode
