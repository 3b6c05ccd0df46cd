from dataclasses import replace

import numpy as np
import pytest

from sncaffe import config
from sncaffe import Net
from sncaffe.backend.cpu import CPUDevice
from sncaffe.graph import GraphError
from sncaffe.sizes import align
from sncaffe.proto import sncaffe_pb2 as pb
from sncaffe.prototxt import parse_text

SMALL = """
name: "small"
layer { name: "input" type: "Input" top: "data" top: "label"
        input_param { shape { dim: 2 dim: 3 dim: 8 dim: 8 } shape { dim: 2 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1" %s
        convolution_param { num_output: 4 kernel_size: 3 pad: 1 weight_filler { type: "xavier" } } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }
layer { name: "pool1" type: "Pooling" bottom: "conv1" top: "pool1" pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "ip" type: "InnerProduct" bottom: "pool1" top: "ip" inner_product_param { num_output: 3 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
"""


def small(extra="", **kw):
    return Net(parse_text(SMALL % extra, pb.NetParameter()), "TRAIN", device=CPUDevice(64 << 20), **kw)


def fill(net, seed=0):
    rng = np.random.default_rng(seed)
    net.blobs["data"].data[...] = rng.standard_normal(net.blobs["data"].data.shape)
    net.blobs["label"].data[...] = [0, 2]


def test_every_tensor_is_carved_from_the_pool():
    net = small()
    arena = net.device.arena
    arrays = [a for b in net.blobs.values() for a in (b.data, b.diff) if a is not None]
    arrays += [a for bl in net.params.values() for b in bl for a in (b.data, b.diff)]
    arrays += [a for layer in net.layers for a in layer.scratch.values()]
    assert all(np.shares_memory(a, arena) for a in arrays)
    roots = {id(t.root): t.root for op in net.graph.ops for t in op.reads + op.writes if t.kind != "workspace"}
    assert net.device.pool.in_use == sum(align(t.nbytes) for t in roots.values())
    workspace = max((sum(align(t.nbytes) for t in ws.values()) for n in net.graph.layers
                     for ws in (n.workspace, n.backward_workspace)), default=0)
    fill(net)
    net.forward()
    net.backward()
    assert net.device.pool.peak == net.device.pool.in_use + workspace


def test_forward_backward_and_gradient_against_finite_differences():
    net = small()
    fill(net)
    loss = net.forward()
    assert loss > 0
    net.clear_param_diffs()
    net.backward()
    w = net.params["ip"][0]
    i = (1, 5)
    analytic = float(w.diff[i])
    old = float(w.data[i])
    eps = 1e-2
    w.data[i] = old + eps
    lp = net.forward()
    w.data[i] = old - eps
    lm = net.forward()
    w.data[i] = old
    assert analytic == pytest.approx((lp - lm) / (2 * eps), rel=1e-2, abs=1e-4)


def test_backward_decisions_follow_caffe():
    net = small()
    assert net.blobs["data"].diff is None          # no force_backward: no gradient for the data
    assert net.blobs["label"].diff is None
    frozen = small('param { lr_mult: 0 } param { lr_mult: 0 }')
    assert frozen.graph.layer("conv1").need_backward is False
    assert frozen.graph.layer("pool1").need_backward is False   # nothing below it learns
    assert frozen.graph.layer("ip").need_backward is True
    fill(frozen)
    frozen.forward(); frozen.backward()
    assert not np.any(frozen.params["conv1"][0].diff)
    p = parse_text(SMALL % "", pb.NetParameter())
    p.force_backward = True
    forced = Net(p, "TRAIN", device=CPUDevice(64 << 20))
    assert forced.blobs["data"].diff is not None and forced.blobs["label"].diff is None


def test_layers_not_under_a_loss_get_no_backward():
    text = (SMALL % "") + 'layer { name: "side" type: "TanH" bottom: "pool1" top: "side" }'
    net = Net(parse_text(text, pb.NetParameter()), "TRAIN", device=CPUDevice(64 << 20))
    assert net.graph.layer("side").need_backward is False
    assert "side" in net.outputs and "pool1_pool1_0_split_0" in net.blobs


def test_caffemodel_round_trip(tmp_path):
    a = small(seed=1)
    path = tmp_path / "a.caffemodel"
    a.save(path)
    b = small(seed=2, weights=path)
    for name in a.params:
        for x, y in zip(a.params[name], b.params[name]):
            np.testing.assert_array_equal(x.data, y.data)
    parsed = pb.NetParameter.FromString(path.read_bytes())
    assert [len(layer.blobs) for layer in parsed.layer if layer.blobs] == [2, 2]


def test_caffemodel_shape_mismatch_names_the_layer(tmp_path):
    p = parse_text(SMALL % "", pb.NetParameter())
    p.layer[1].convolution_param.num_output = 5
    other = Net(p, "TRAIN", device=CPUDevice(64 << 20))
    other.save(tmp_path / "o.caffemodel")
    with pytest.raises(ValueError, match=r'layer "conv1" blob 0: shape \(5, 3, 3, 3\) in the file, \(4, 3, 3, 3\)'):
        small(weights=tmp_path / "o.caffemodel")


def test_unsupported_type_and_shape_mismatch_name_the_layers():
    bad = 'layer { name: "input" type: "Input" top: "x" input_param { shape { dim: 1 } } }' \
          'layer { name: "w" type: "Warp" bottom: "x" top: "y" }'
    with pytest.raises(GraphError, match='layer "w": unsupported layer type "Warp"'):
        Net(parse_text(bad, pb.NetParameter()))
    mismatch = """
      layer { name: "input" type: "Input" top: "x" input_param { shape { dim: 1 dim: 2 dim: 6 dim: 6 } } }
      layer { name: "c1" type: "Convolution" bottom: "x" top: "a" convolution_param { num_output: 2 kernel_size: 3 } }
      layer { name: "c2" type: "Convolution" bottom: "x" top: "b" convolution_param { num_output: 2 kernel_size: 1 } }
      layer { name: "sum" type: "Eltwise" bottom: "a" bottom: "b" top: "s" }
    """
    with pytest.raises(GraphError) as e:
        Net(parse_text(mismatch, pb.NetParameter()))
    msg = str(e.value)
    assert 'layer "sum"' in msg and 'layer "c1"' in msg and 'layer "c2"' in msg
    dup = 'layer { name: "input" type: "Input" top: "x" input_param { shape { dim: 1 } } }' \
          'layer { name: "r" type: "TanH" bottom: "x" top: "x2" }' \
          'layer { name: "s" type: "TanH" bottom: "x" top: "x2" }'
    with pytest.raises(GraphError, match='top blob "x2" is already produced by layer "r"'):
        Net(parse_text(dup, pb.NetParameter()))


def smallest_fit(graph, mode):
    """The smallest capacity (to 256 bytes) at which ``mode``'s plan fits, by bisection."""
    from sncaffe.plan.planner import make_plan
    lo, hi = 256, make_plan(graph, mode).peak + 256
    while not make_plan(graph, mode, hi).fits:     # fragmentation: its peak may not be enough
        lo, hi = hi, hi + (64 << 10)
    while hi - lo > 256:
        mid = (lo + hi) // 2 // 256 * 256
        lo, hi = (lo, mid) if make_plan(graph, mode, mid).fits else (mid, hi)
    return hi


def test_a_plan_that_does_not_fit_is_refused_with_what_would_fit(monkeypatch):
    # ConvPlan: its workspace shrinks with the chunk, so liveness's leanest plan is below none's
    # (oneDNN's scratchpad and 16-channel blocks for this 3-channel conv make the workspace the peak)
    monkeypatch.setattr(config, "settings", replace(config.settings, conv="native"))
    net_param = parse_text(SMALL % "", pb.NetParameter())
    from sncaffe.plan.planner import make_plan
    graph = Net(net_param, "TRAIN", device=CPUDevice(64 << 20)).graph
    capacity = smallest_fit(graph, "liveness")      # (convolutions chunk their batch to get there)
    assert not make_plan(graph, "none", capacity).fits
    with pytest.raises(MemoryError) as e:
        Net(net_param, "TRAIN", device=CPUDevice(capacity), memory="none")     # (auto would pick liveness)
    msg = str(e.value)
    assert "memory mode 'none' needs" in msg and "short) at step" in msg and "memory mode 'liveness' fits" in msg
    with pytest.raises(MemoryError, match="no memory mode fits; the leanest"):
        Net(net_param, "TRAIN", device=CPUDevice(4096), memory="all")


def test_running_out_at_a_step_names_the_step_and_tensor():
    net = small()
    net.device.alloc((net.device.pool.largest_free - 256,), "uint8", "someone else")   # taken behind the plan
    fill(net)
    with pytest.raises(MemoryError) as e:
        net.forward()
    msg = str(e.value)
    assert "conv1:forward" in msg and 'tensor "' in msg and "short" in msg


def test_a_blob_rewritten_in_place_at_the_end_is_an_output_and_outlives_the_pass():
    text = """
      layer { name: "input" type: "Input" top: "x" input_param { shape { dim: 2 dim: 3 } } }
      layer { name: "ip" type: "InnerProduct" bottom: "x" top: "lw" inner_product_param { num_output: 4 } }
      layer { name: "bn" type: "BatchNorm" bottom: "lw" top: "lw" }
    """
    for mode in ("none", "liveness", "all"):
        net = Net(parse_text(text, pb.NetParameter()), "TRAIN", device=CPUDevice(64 << 20), memory=mode)
        assert net.outputs == ["lw"]
        net.blobs["x"].data[...] = np.arange(6).reshape(2, 3)
        net.forward()
        assert net.blobs["lw"].data is not None and np.all(np.isfinite(net.blobs["lw"].data))


BN_SCALE = """
name: "bn_scale"
force_backward: true
layer { name: "input" type: "Input" top: "data" top: "label"
        input_param { shape { dim: 4 dim: 3 dim: 6 dim: 6 } shape { dim: 4 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
        convolution_param { num_output: 4 kernel_size: 3 pad: 1 weight_filler { type: "xavier" } } }
layer { name: "bn1" type: "BatchNorm" bottom: "conv1" top: "conv1" }
layer { name: "scale1" type: "Scale" bottom: "conv1" top: "conv1" scale_param { bias_term: true } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }
layer { name: "scale2" type: "Scale" bottom: "conv1" top: "conv1"
        scale_param { filler { type: "uniform" min: 0.5 max: 1.5 } } }
layer { name: "ip" type: "InnerProduct" bottom: "conv1" top: "ip" inner_product_param { num_output: 3 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
"""


def _bn_scale_net(memory="none"):
    net = Net(parse_text(BN_SCALE, pb.NetParameter()), "TRAIN", device=CPUDevice(64 << 20), memory=memory)
    rng = np.random.default_rng(1)
    net.blobs["data"].data[...] = rng.standard_normal(net.blobs["data"].data.shape)
    net.blobs["label"].data[...] = [0, 2, 1, 2]
    return net


def _run(net):
    loss = net.forward()
    net.backward()
    return loss, {k: [b.diff.copy() for b in v] for k, v in net.params.items()}, net.blobs["data"].diff.copy()


@pytest.mark.parametrize("memory", ["none", "liveness", "all"])
def test_scale_after_batchnorm_shares_its_x_norm_with_the_same_bits(monkeypatch, memory):
    """An in-place Scale keeps its input for its gradient; after a training BatchNorm that input
    is BatchNorm's x_norm, so the graph points one at the other (the copy and its memory go),
    and every gradient comes out as with the copy. A Scale after another layer keeps its own."""
    import sncaffe.graph as graph
    net = _bn_scale_net(memory)
    bn, s1, s2 = (net.graph.layer(n) for n in ("bn1", "scale1", "scale2"))
    assert s1.scratch["bottom"] is bn.scratch["x_norm"] and s1.shared_scratch == {"bottom", "partials"}
    assert s2.scratch["bottom"] is not bn.scratch["x_norm"] and not s2.shared_scratch
    fwd = next(op for op in net.graph.ops if op.name == "scale1:forward")
    bwd = next(op for op in net.graph.ops if op.name == "scale1:backward")
    assert bn.scratch["x_norm"] not in fwd.writes and bn.scratch["x_norm"] in bwd.reads
    (fusion,) = net.graph.fusions       # run apart here (tests/layers/test_batchnorm_scale.py: as one)
    fusion.forward = fusion.backward = False
    shared = _run(net)
    monkeypatch.setattr(graph, "SHARED_SCRATCH", {})
    plain = _bn_scale_net(memory)
    assert "bottom" not in plain.graph.layer("scale1").shared_scratch
    copied = _run(plain)
    assert shared[0] == copied[0] and np.array_equal(shared[2], copied[2])
    for k in copied[1]:
        assert all(np.array_equal(a, b) for a, b in zip(shared[1][k], copied[1][k])), k
    if memory == "none":     # everything resident: exactly the copy's bytes fewer
        assert plain.plan.peak - net.plan.peak == align(bn.scratch["x_norm"].nbytes)


def test_scale_keeps_its_copy_after_a_batchnorm_with_global_stats():
    param = parse_text(BN_SCALE, pb.NetParameter())
    param.layer[2].batch_norm_param.use_global_stats = True
    net = Net(param, "TRAIN", device=CPUDevice(64 << 20))
    assert not net.graph.layer("scale1").shared_scratch and "x_norm" not in net.graph.layer("bn1").scratch
