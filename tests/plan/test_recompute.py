"""Recomputation: segments split at checkpoints, cross-segment in-place writes, BatchNorm's
running statistics moved once, Dropout's mask kept, each segment replayed once; coarse
segments of whole units (convolutions replayed) with none's bits and the planned peak."""
from dataclasses import replace

import numpy as np
import pytest

from sncaffe import config
from sncaffe import Net
from sncaffe.backend import CPUDevice
from sncaffe.gradcheck import Harness, make_layer
from sncaffe.plan.liveness import op_tensors, persistent_roots
from sncaffe.plan import passes
from sncaffe.plan.planner import GRANULARITIES, make_plan
from sncaffe.plan.report import plan_line, verdict
from sncaffe.plan.recompute import is_cheap, is_replayable, segments, units
from sncaffe.proto import sncaffe_pb2 as pb
from sncaffe.prototxt import parse_text
from test_liveness import TEXT, graph_of
from test_modes import ZOO, assert_peaks, assert_same_bits, net_param, reference, train
from test_modes import graph_of as build
from conftest import ROOT

CONV = 'weight_filler { type: "gaussian" std: 0.3 } bias_filler { type: "constant" value: 0.1 }'
# relu_x runs in place on pool1, a value of conv1's segment, from inside conv2's segment.
CROSS = f'''
name: "cross"
layer {{ name: "data" type: "Input" top: "data" top: "label"
        input_param {{ shape {{ dim: 2 dim: 3 dim: 8 dim: 8 }} shape {{ dim: 2 }} }} }}
layer {{ name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
        convolution_param {{ num_output: 4 kernel_size: 3 pad: 1 {CONV} }} }}
layer {{ name: "pool1" type: "Pooling" bottom: "conv1" top: "pool1" pooling_param {{ pool: MAX kernel_size: 2 stride: 2 }} }}
layer {{ name: "conv2" type: "Convolution" bottom: "data" top: "conv2"
        convolution_param {{ num_output: 4 kernel_size: 2 stride: 2 {CONV} }} }}
layer {{ name: "relu_x" type: "ReLU" bottom: "pool1" top: "pool1" }}
layer {{ name: "sum" type: "Eltwise" bottom: "conv2" bottom: "pool1" top: "sum" }}
layer {{ name: "ip" type: "InnerProduct" bottom: "sum" top: "ip"
        inner_product_param {{ num_output: 2 {CONV} }} }}
layer {{ name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }}
'''
# BatchNorm (batch statistics) and Dropout between checkpoints.
BN_DROP = f'''
name: "bn_drop"
layer {{ name: "data" type: "Input" top: "data" top: "label"
        input_param {{ shape {{ dim: 4 dim: 3 dim: 6 dim: 6 }} shape {{ dim: 4 }} }} }}
layer {{ name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
        convolution_param {{ num_output: 5 kernel_size: 3 pad: 1 {CONV} }} }}
layer {{ name: "bn1" type: "BatchNorm" bottom: "conv1" top: "conv1" }}
layer {{ name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }}
layer {{ name: "drop1" type: "Dropout" bottom: "conv1" top: "drop1" dropout_param {{ dropout_ratio: 0.5 }} }}
layer {{ name: "pool1" type: "Pooling" bottom: "drop1" top: "pool1" pooling_param {{ pool: AVE kernel_size: 2 stride: 2 }} }}
layer {{ name: "ip" type: "InnerProduct" bottom: "pool1" top: "ip" inner_product_param {{ num_output: 3 {CONV} }} }}
layer {{ name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }}
'''


def param_of(text):
    param = parse_text(text, pb.NetParameter())
    param.force_backward = True
    return param


def segs_by_name(graph):
    F = graph.forward_ops
    segs, seg_of = segments(F, {id(r) for r in persistent_roots(graph)})
    named = [(None if s.checkpoint is None else F[s.checkpoint].node.name,
              [F[k].node.name for k in s.cheap]) for s in segs]
    return named, segs, seg_of


def test_segments_start_at_checkpoints():
    graph = graph_of(TEXT)
    named, segs, seg_of = segs_by_name(graph)
    assert named == [("data", []), ("conv1", ["bn1", "scale1", "relu1", "conv1_relu1_0_split"]),
                     ("conv2", []), ("sum", ["sum_sum_0_split"]), ("conv3", []), ("cat", ["pool"]),
                     ("ip", []), ("loss", [])]
    F = graph.forward_ops
    for s in segs:
        assert not is_cheap(F[s.checkpoint].node) and all(is_cheap(F[k].node) for k in s.cheap)
        assert all(seg_of[k] == s.index for k in [s.checkpoint] + s.cheap)
        assert s.cheap == list(range(s.checkpoint + 1, s.checkpoint + 1 + len(s.cheap)))   # contiguous


def test_stochastic_pooling_is_not_cheap():
    graph = graph_of(TEXT.replace("pool: MAX", "pool: STOCHASTIC"))
    named, _, _ = segs_by_name(graph)
    assert ("pool", []) in named


def test_cheap_in_place_layer_on_another_segments_tensor_becomes_a_checkpoint():
    graph = graph_of(CROSS)
    named, _, _ = segs_by_name(graph)
    # relu_x, and pool1 too: replaying pool1 would clobber relu_x's output, which relu_x's backward reads
    assert ("relu_x", []) in named and ("pool1", []) in named and ("conv1", []) in named
    plain = graph_of(CROSS.replace('bottom: "pool1" top: "pool1"', 'bottom: "pool1" top: "relu_x"')
                     .replace('bottom: "conv2" bottom: "pool1"', 'bottom: "conv2" bottom: "relu_x"'))
    assert ("conv1", ["pool1"]) in segs_by_name(plain)[0]   # out of place: nothing to break


@pytest.mark.parametrize("mode", ["recompute", "all"])
def test_cross_segment_net_trains_alike(mode):
    ref_plan, ref = train(param_of(CROSS), "none")
    plan, steps = train(param_of(CROSS), mode)
    assert_peaks(steps, plan)
    assert_same_bits(steps, ref)


def test_segments_replayed_once_and_only_cheap_outputs_dropped():
    graph = graph_of(TEXT)
    plan = make_plan(graph, "recompute")
    replays = [ins.op for ins in plan.schedule.backward if ins.kind == "run" and ins.recompute]
    assert replays and len(replays) == len({id(op) for op in replays}) == plan.recomputed_ops
    assert all(op.kind == "forward" and is_cheap(op.node) for op in replays)
    assert plan.recompute_flops > 0 and not any(ins.recompute for ins in plan.schedule.forward)
    # what is dropped was last written in forward by a cheap layer (a split's or an in-place layer's top)
    F, dropped = graph.forward_ops, set(plan.dropped)
    last_writer = {r.name: op for op in F for r, w in op_tensors(op) if w}
    assert dropped and all(is_cheap(last_writer[name].node) for name in dropped)
    assert make_plan(graph, "liveness").recomputed_ops == 0


def test_in_place_chain_restores_the_checkpoint_value():
    """bn1 overwrites conv1's output in place: replaying bn1 needs conv1's value kept aside."""
    graph = graph_of(TEXT)
    kinds = {m: [(i.kind, i.tensor.name) for i in make_plan(graph, m, cost_aware=False).schedule if i.kind != "run"]
             for m in ("recompute", "all")}
    assert ("snapshot", "conv1") in kinds["recompute"] and ("restore", "conv1") in kinds["recompute"]
    assert ("offload", "conv1@checkpoint") in kinds["all"] and ("prefetch", "conv1@checkpoint") in kinds["all"]
    assert ("drop", "conv1@checkpoint") in kinds["all"]


def test_batchnorm_recompute_leaves_running_statistics_alone():
    layer = make_layer('type: "BatchNorm"', inplace=True)
    h = Harness(layer, [np.random.default_rng(0).standard_normal((4, 3, 5, 5))])
    y = h.forward()[0]
    stats = [b.data.copy() for b in layer.blobs]
    assert stats[2][0] == 1                                  # moved once by forward
    h.bottom[0].data[...] = h.inputs[0]
    layer.recompute(h.bottom, h.top)
    assert np.array_equal(h.top[0].data, y)
    assert all(np.array_equal(b.data, s) for b, s in zip(layer.blobs, stats))


def test_dropout_recompute_keeps_its_mask():
    layer = make_layer('type: "Dropout" dropout_param { dropout_ratio: 0.5 }')
    h = Harness(layer, [np.random.default_rng(0).standard_normal((4, 50))], dtype=np.float32)
    y = h.forward()[0]
    state = layer.rng.bit_generator.state
    layer.recompute(h.bottom, h.top)
    assert np.array_equal(h.top[0].data, y) and layer.rng.bit_generator.state == state


@pytest.mark.parametrize("mode", ["recompute", "all"])
def test_batchnorm_and_dropout_nets_recompute_exactly(mode, monkeypatch):
    # ConvPlan: the planner replays bn1 and drop1 where that lowers the peak, which its conv1
    # workspace leaves them to do (oneDNN's smaller one moves the peak elsewhere)
    monkeypatch.setattr(config, "settings", replace(config.settings, conv="native"))
    plan, steps = train(param_of(BN_DROP), mode, iters=2)
    replayed = {ins.op.node.name for ins in plan.schedule.backward if ins.kind == "run" and ins.recompute}
    assert {"bn1", "drop1"} <= replayed
    assert_peaks(steps, plan)
    _, ref = train(param_of(BN_DROP), "none", iters=2)
    assert_same_bits(steps, ref)
    assert steps[0][1]["bn1[2]"][0] == 1 and steps[1][1]["bn1[2]"][0] == np.float32(0.999) + 1   # once per pass


def test_dropout_draws_once_per_iteration():
    nets = {}
    for mode in ("none", "recompute"):
        net = Net(param_of(BN_DROP), "TRAIN", device=CPUDevice("64MiB"), memory=mode, seed=5)
        net.forward()
        net.backward()
        nets[mode] = net
    layers = {m: next(n.layer for n in net.graph.layers if n.name == "drop1") for m, net in nets.items()}
    assert layers["none"].rng.bit_generator.state == layers["recompute"].rng.bit_generator.state


# -- coarse segments: whole units replayed, convolutions included ---------------------------

def crossing(forward, persistent_ids, cut):
    """The values written before ``cut`` and used at or after it (brute force)."""
    before = {id(r) for op in forward[:cut] for r, w in op_tensors(op) if id(r) not in persistent_ids}
    return {id(r) for op in forward[cut:] for r, _ in op_tensors(op) if id(r) in before}


def test_units_start_at_articulations():
    graph = build(net_param(ROOT / "prototxt" / "resnet50.prototxt"))
    F, pid = graph.forward_ops, {id(r) for r in persistent_roots(graph)}
    cuts = units(F, pid)
    blocks = [f"res{s}{b}_branch{'1' if b == 'a' else '2a'}" for s, n in ((2, 3), (3, 4), (4, 6), (5, 3))
              for b in "abcdef"[:n]]
    assert [F[c].node.name for c in cuts] == ["data", "conv1", "pool1"] + blocks + ["pool5", "fc1000", "loss"]
    for cut in range(1, len(F)):
        across = crossing(F, pid, cut)
        written_after = {id(r) for op in F[cut:] for r, w in op_tensors(op) if w}
        assert (cut in cuts) == (len(across) <= 1 and not across & written_after), F[cut].name


COARSE = {"lenet": ROOT / "prototxt" / "lenet_train_test.prototxt",
          "cifar10_resnet": ROOT / "prototxt" / "cifar10_resnet.prototxt",
          "resnet50": ROOT / "prototxt" / "resnet50.prototxt", "bn_drop": BN_DROP, "cross": CROSS}
COARSE.update({"googlenet": p for p in ZOO if p.stem == "bvlc_googlenet__train_val"})    # Inception's branches


def coarse_param(name):
    source = COARSE[name]
    return param_of(source) if isinstance(source, str) else net_param(source)


@pytest.mark.parametrize("granularity", [1, 3])
@pytest.mark.parametrize("name", list(COARSE))
def test_coarse_segments_give_nones_bits_and_the_planned_peak(name, granularity):
    plan, steps = train(coarse_param(name), "recompute",
                        planner=lambda net: make_plan(net.graph, "recompute", granularity=granularity))
    assert plan.granularity == granularity
    replayed = [ins.op.node for ins in plan.schedule.backward if ins.kind == "run" and ins.recompute]
    assert replayed and all(is_replayable(node) for node in replayed)
    assert not any(ins.recompute for ins in plan.schedule.forward)
    if name in ("cifar10_resnet", "resnet50", "googlenet"):
        assert any(node.type == "Convolution" for node in replayed)
    assert_peaks(steps, plan)
    _, ref = train(coarse_param(name), "none")
    assert_same_bits(steps, ref)


@pytest.mark.parametrize("name", list(COARSE))
def test_kept_chains_give_nones_bits_and_the_planned_peak(name):
    """Half the layer chains kept (their values held from forward to backward; a net of one
    chain keeps it): the replays run only what the rest needs, with none's bits and the planned
    peak."""
    graph = build(coarse_param(name))
    n = (len(passes.chains(graph, 1)) + 1) // 2
    whole = make_plan(graph, "recompute", granularity=1, keep=0)
    plan, steps = train(coarse_param(name), "recompute",
                        planner=lambda net: make_plan(net.graph, "recompute", granularity=1, keep=n))
    assert plan.kept == n and plan.recompute_flops < whole.recompute_flops
    kept = {uses_name for ids, _, _ in passes.chains(graph, 1)[:n] for uses_name in ids}
    assert kept and not kept & set(passes.analyze(graph, graph.forward_ops + graph.backward_ops,
                                                  len(graph.forward_ops), "recompute", granularity=1,
                                                  keep=n).rc.dropped)
    assert_peaks(steps, plan)
    _, ref = train(coarse_param(name), "none")
    assert_same_bits(steps, ref)


def test_chains_spare_the_most_flops_per_byte_first():
    """ResNet-50's chains: the spatial convolutions' (3x3, and the 7x7 stem: the most FLOPs per
    byte of their output) before any 1x1's; keeping more never recomputes more."""
    graph = build(net_param(ROOT / "prototxt" / "resnet50.prototxt"))
    found = passes.chains(graph, 1)
    rates = [cost / size for _, size, cost in found]
    assert rates == sorted(rates, reverse=True)
    F = graph.forward_ops
    first = {F[k].node.name for k in range(len(F)) for ids, _, _ in found[:14]
             if any(id(r) in ids for r, w in op_tensors(F[k]) if w) and F[k].node.type == "Convolution"}
    assert len(first) == 14 and all(name.endswith("branch2b") or name == "conv1" for name in first), first
    flops = [make_plan(graph, "recompute", granularity=1, keep=n).recompute_flops for n in (0, 8, 24, len(found))]
    assert flops == sorted(flops, reverse=True) and flops[-1] < flops[0] // 10


def test_coarse_plans_keep_the_chains_their_capacity_has_room_for():
    """Between the whole-segment plan's peak and per layer's, the plan keeps chains within the
    capacity: less replayed than whole segments, more the more room, and it runs as planned."""
    param = net_param(ROOT / "prototxt" / "resnet50.prototxt")
    graph = build(param)
    whole, per_layer = make_plan(graph, "recompute", granularity=1, keep=0), make_plan(graph, "recompute")
    plans = [make_plan(graph, "recompute", whole.peak + (per_layer.peak - whole.peak) * k // 4) for k in (1, 3)]
    for plan in plans:
        assert plan.fits and plan.granularity and plan.kept and plan.peak <= plan.capacity
    assert whole.recompute_flops > plans[0].recompute_flops > plans[1].recompute_flops
    assert "kept" in plan_line(plans[1])
    sizes = [size for _, size, _ in passes.chains(graph, plans[1].granularity)]
    assert plans[1].kept_bytes == sum(sizes[:plans[1].kept]) > 0
    assert "of layer chains to replay less" in verdict(plans[1], "ResNet-50")
    ran, steps = train(param, "recompute", plans[0].capacity)
    assert ran.kept == plans[0].kept
    assert_peaks(steps, ran)


def test_coarse_segments_keep_only_their_outputs():
    """What a segment drops only its own operators use in forward (a block output the next
    segment reads is a checkpoint), and each replayed operator runs once."""
    graph = build(net_param(ROOT / "prototxt" / "resnet50.prototxt"))
    F, pid = graph.forward_ops, {id(r) for r in persistent_roots(graph)}
    _, uses = passes.liveness(graph, graph.forward_ops + graph.backward_ops, "recompute")
    segs = passes.coarse_segments(F, uses, pid, 1, passes.unit_table(graph))
    seg_of = {k: s.index for s in segs for k in s.span}
    plan = make_plan(graph, "recompute", granularity=1)
    by_name = {r.name: key for key, (r, _) in uses.items()}
    for name in plan.dropped:
        u = uses[by_name[name]][1]
        assert len({seg_of.get(x) for x in u.reads + u.writes if x < len(F)}) == 1, name
    kept = [r.name for key, (r, u) in uses.items() if len({seg_of[x] for x in u.reads + u.writes if x < len(F)}) > 1]
    assert len(kept) >= len(segs) - 2 and not set(kept) & set(plan.dropped)
    replays = [ins.op for ins in plan.schedule.backward if ins.kind == "run" and ins.recompute]
    assert len(replays) == len({id(op) for op in replays}) == plan.recomputed_ops
    assert plan.peak < make_plan(graph, "recompute", granularity=0).peak


def test_recompute_goes_coarse_only_where_per_layer_does_not_fit():
    param = net_param(ROOT / "prototxt" / "resnet50.prototxt")
    graph = build(param)
    per_layer, finest = make_plan(graph, "recompute"), make_plan(graph, "recompute", granularity=1)
    assert make_plan(graph, "recompute", per_layer.peak + (1 << 20)).granularity == 0
    capacity = (finest.peak + per_layer.peak) // 2
    plan = make_plan(graph, "recompute", capacity)
    assert plan.fits and plan.granularity >= 1 and plan.peak <= capacity and plan.segments > 1
    assert f"convolutions included: {plan.segments}" in plan_line(plan)
    assert plan.recompute_flops > per_layer.recompute_flops
    plan, steps = train(param, "recompute", capacity)
    assert plan.granularity >= 1
    assert_peaks(steps, plan)
    assert_same_bits(steps, reference(ROOT / "prototxt" / "resnet50.prototxt")[1])


@pytest.mark.parametrize("name", ["cifar10_resnet", "resnet50", "googlenet", "cross"])
def test_coarse_floor_is_below_every_granularitys_peak(name):
    """The bound that spares the search building plans that cannot fit never exceeds a peak."""
    if name not in COARSE:
        pytest.skip("the zoo's GoogLeNet is not present")
    graph = build(coarse_param(name))
    for g in GRANULARITIES[:7]:
        plan = make_plan(graph, "recompute", granularity=g)
        floor = plan.persistent_bytes + plan.extra_bytes + passes.coarse_floor(graph, g)
        assert plan.persistent_bytes < floor <= plan.peak, g
