"""A training BatchNorm and the in-place Scale after it run as one on the CPU (graph.Fusion):
found only where it is sound, the same forward bits as the two layers apart, the same gradients
up to the order of the sums, oneDNN's bytes equal to NumPy's, and pycaffe's partial passes see
each layer's own result."""
from dataclasses import replace

import numpy as np
import pytest

import sncaffe.pycaffe as caffe
from sncaffe import config
from sncaffe import Net
from sncaffe.backend import onednn
from sncaffe.proto import sncaffe_pb2 as pb
from sncaffe.prototxt import parse_text

SCALE = ('scale_param { bias_term: true filler { type: "gaussian" std: 0.5 mean: 1 } '
         'bias_filler { type: "gaussian" } }')


def net_text(shape, bn_top="c", between="", scale=SCALE, scale_top=None, phase_stats=""):
    n, c = shape[:2]
    dims = " ".join(f"dim: {d}" for d in shape)
    scale_top = scale_top or bn_top
    return f'''
layer {{ name: "in" type: "Input" top: "x" input_param {{ shape {{ {dims} }} }} }}
layer {{ name: "conv" type: "Convolution" bottom: "x" top: "c"
  convolution_param {{ num_output: {c} kernel_size: 1 weight_filler {{ type: "gaussian" std: 0.5 }} }} }}
layer {{ name: "bn" type: "BatchNorm" bottom: "c" top: "{bn_top}" {phase_stats} }}
{between}
layer {{ name: "sc" type: "Scale" bottom: "{bn_top}" top: "{scale_top}" {scale} }}
layer {{ name: "relu" type: "ReLU" bottom: "{scale_top}" top: "{scale_top}" }}
layer {{ name: "loss" type: "EuclideanLoss" bottom: "{scale_top}" bottom: "x" top: "l" }}'''


def make(text, phase="TRAIN"):
    net = Net(parse_text(text, pb.NetParameter()), phase, seed=0)
    net.blobs["x"].data[...] = np.random.default_rng(1).standard_normal(net.blobs["x"].shape) * 2 + 0.5
    return net


def step(net, fused=True):
    for f in net.graph.fusions:
        f.forward, f.backward = fused, fused and f.on("backward")
    net.clear_param_diffs()
    out = {"loss": np.float64(net.forward())}
    net.backward()
    top = next(name for name in ("s", "c") if name in net.blobs)
    if net.blobs[top].data is not None:             # (other memory modes than none free them)
        out.update({"top": net.blobs[top].data.copy(), "conv.diff": net.blobs["c"].diff.copy()})
    out.update({f"{name}.{i}": b.diff.copy() for name, blobs in net.params.items() for i, b in enumerate(blobs)})
    return out


@pytest.mark.parametrize("between", ["", 'layer { name: "p" type: "Power" bottom: "x" top: "p" }'],
                         ids=["next", "a-layer-on-another-blob-between"])
def test_the_pair_is_fused_and_its_operators_say_what_they_touch(between):
    net = make(net_text((2, 4, 3, 3), between=between))
    (fusion,) = net.graph.fusions
    assert (fusion.bn.name, fusion.scale.name) == ("bn", "sc")
    ops = {op.name: op for op in net.graph.ops}
    bn, sc = fusion.bn, fusion.scale
    assert sc.scratch["partials"] is bn.scratch["partials"]
    assert any(t is bn.scratch["x_norm"] for t in ops["sc:forward"].reads)
    assert any(t is bn.scratch["partials"] for t in ops["sc:backward"].writes)
    assert any(t is sc.params[0][0] for t in ops["bn:backward"].reads)


@pytest.mark.parametrize("text, phase", [
    (net_text((2, 4, 3, 3), scale_top="s"), "TRAIN"),                  # Scale not in place
    (net_text((2, 4, 3, 3), between='layer { name: "r0" type: "ReLU" bottom: "c" top: "c" }'), "TRAIN"),
    (net_text((2, 4, 3, 3)), "TEST"),                                    # global statistics
    (net_text((2, 4, 3, 3), scale='scale_param { axis: 1 num_axes: 2 }'), "TRAIN"),   # (C, H) scale
], ids=["scale-not-in-place", "relu-between", "global-stats", "scale-over-two-axes"])
def test_no_fusion_where_it_would_not_hold(text, phase):
    net = make(text, phase)
    assert net.graph.fusions == []
    sc = next(n for n in net.graph.layers if n.name == "sc")
    assert "partials" not in sc.scratch          # kept only to be shared
    out = step(net)
    assert np.isfinite(out["top"]).all()


@pytest.mark.parametrize("shape", [(2, 4, 5, 5), (4, 16, 64, 64)])     # NumPy; past onednn.BINARY_MIN
def test_fused_pair_gives_the_layers_results(shape):
    """Forward: the same bits. Backward: BatchNorm's sums are scale * sum(dy) instead of
    sum(scale * dy), so the gradients agree to float32 rounding."""
    net = make(net_text(shape))
    assert len(net.graph.fusions) == 1
    apart, fused, again = step(net, fused=False), step(net), step(net)
    assert fused["top"].tobytes() == apart["top"].tobytes()
    # (the conv's own gradients are sums of BatchNorm's dx, which cancel to about 0 per channel:
    # its rounding, not the pair's; dx itself is "conv.diff")
    atol = 1e-4 * np.abs(apart["conv.diff"]).max()
    for k in (k for k in apart if not k.startswith("conv.")):
        np.testing.assert_allclose(fused[k], apart[k], rtol=2e-4, atol=atol, err_msg=k)
        assert fused[k].tobytes() == again[k].tobytes()      # and no state carried over


@pytest.mark.skipif(onednn.choice() != "onednn", reason="oneDNN is not in use on this machine")
def test_fused_pair_on_onednn_gives_numpys_bytes(monkeypatch):
    shape = (4, 16, 64, 64)
    assert np.prod(shape) >= onednn.BINARY_MIN
    calls = []
    real = onednn.Binary.run
    monkeypatch.setattr(onednn.Binary, "run", lambda self, *a: calls.append(1) or real(self, *a))
    fast = step(make(net_text(shape)))
    assert calls
    monkeypatch.setattr(config, "settings", replace(config.settings, conv="native"))
    calls.clear()
    native = step(make(net_text(shape)))
    assert not calls
    same = [k for k in fast if not k.startswith("conv.")]      # the convolution itself runs on oneDNN or not
    assert {k: fast[k].tobytes() for k in same} == {k: native[k].tobytes() for k in same}


def test_pycaffe_partial_passes_see_each_layers_own_result(tmp_path):
    path = tmp_path / "net.prototxt"
    path.write_text(net_text((2, 4, 5, 5)))
    net = caffe.Net(str(path), caffe.TRAIN)
    x = net.blobs["x"].data
    x[...] = np.random.default_rng(2).standard_normal(x.shape)
    net.forward(end="bn")
    c = net.forward(end="conv")["c"].astype(np.float64)
    net.forward(end="bn")
    mean = c.mean(axis=(0, 2, 3), keepdims=True)
    var = c.var(axis=(0, 2, 3), keepdims=True)
    bn_out = net.blobs["c"].data.copy()
    np.testing.assert_allclose(bn_out, (c - mean) / np.sqrt(var + 1e-5), rtol=1e-4, atol=1e-5)
    gamma, beta = (b.data.reshape(1, -1, 1, 1) for b in net.params["sc"])
    net.forward(start="sc", end="sc")
    np.testing.assert_allclose(net.blobs["c"].data, bn_out * gamma + beta, rtol=1e-6, atol=1e-6)

    net.forward()
    dy = np.random.default_rng(3).standard_normal(x.shape).astype(np.float32)
    net.blobs["c"].diff[...] = dy
    net.backward(start="sc", end="sc")            # Scale alone: dx = dy * scale
    np.testing.assert_allclose(net.blobs["c"].diff, dy * gamma, rtol=1e-6)
    # and the whole backward afterwards runs the pair as one again
    assert all(f.forward and f.backward for f in net._net.graph.fusions)


@pytest.mark.parametrize("bn_top", ["c", "b"], ids=["in-place", "batchnorm-not-in-place"])
def test_fused_pair_in_every_memory_mode_gives_the_bits_of_none_and_meets_its_plan(bn_top):
    """The memory runtime sees Scale read x_norm in forward and write BatchNorm's sums in
    backward, and an out-of-place BatchNorm write its top's diff (graph._operators): liveness,
    offload, recompute and all keep them where needed."""
    from sncaffe.backend.cpu import CPUDevice
    text = net_text((4, 8, 6, 6), bn_top=bn_top)
    runs = {}
    for mode in ("none", "liveness", "offload", "recompute", "all"):
        net = Net(parse_text(text, pb.NetParameter()), "TRAIN", device=CPUDevice(64 << 20), memory=mode, seed=0)
        assert len(net.graph.fusions) == 1
        net.blobs["x"].data[...] = np.random.default_rng(1).standard_normal(net.blobs["x"].shape)
        runs[mode] = step(net)
        assert net.device.pool.peak == net.plan.peak, mode
    for mode, out in runs.items():
        assert len(out) >= 7 and {k: v.tobytes() for k, v in out.items()} == {
            k: runs["none"][k].tobytes() for k in out}, mode          # loss and every parameter's gradient


@pytest.mark.parametrize("shape", [(2, 4, 5, 5), (4, 16, 64, 64)])     # NumPy; past onednn.BINARY_MIN
def test_a_batchnorm_not_in_place_fuses_and_leaves_its_tops_diff_as_caffe_does(shape):
    """BatchNorm into a blob of its own, Scale in place on it (DenseNet's): fused forward (the
    same bits) and backward, after which that blob's diff is dy * scale as Caffe leaves it, to the
    bit, and the gradients agree with the layers apart to rounding (as in place)."""
    net = make(net_text(shape, bn_top="b"))
    (fusion,) = net.graph.fusions
    assert not fusion.in_place and fusion.forward and fusion.backward
    ops = {op.name: op for op in net.graph.ops}
    assert any(t is fusion.bn.scratch["partials"] for t in ops["sc:backward"].writes)
    assert any(t is net.graph.blobs["b"].diff for t in ops["bn:backward"].writes)
    apart = step(net, fused=False)
    b_apart = net.blobs["b"].diff.copy()
    fused = step(net)
    b_fused = net.blobs["b"].diff.copy()
    assert b_fused.tobytes() == b_apart.tobytes()
    atol = 1e-4 * np.abs(apart["conv.diff"]).max()
    assert fused["loss"] == apart["loss"]
    for k in (k for k in apart if not k.startswith("conv.") and k != "top"):
        np.testing.assert_allclose(fused[k], apart[k], rtol=2e-4, atol=atol, err_msg=k)
    np.testing.assert_allclose(fused["conv.diff"], apart["conv.diff"], rtol=2e-4, atol=atol)


def test_each_layer_apart_after_a_fused_forward_reads_x_norm_divided(tmp_path):
    """A fused forward leaves x_norm centered (Scale divides by std in its own pass); pycaffe's
    backward of either layer alone afterwards sees it divided: Scale's gradients are the sums of
    dy and dy * x_hat, BatchNorm's dx the textbook one."""
    path = tmp_path / "net.prototxt"
    path.write_text(net_text((3, 4, 5, 5)))
    net = caffe.Net(str(path), caffe.TRAIN)
    x = net.blobs["x"].data
    x[...] = np.random.default_rng(2).standard_normal(x.shape)
    c = net.forward(end="conv")["c"].astype(np.float64)
    net.forward()
    bn = next(n.layer for n in net._net.graph.layers if n.name == "bn")
    assert bn.centered                                  # the fused forward left it so
    x_hat = (c - c.mean(axis=(0, 2, 3), keepdims=True)) / np.sqrt(c.var(axis=(0, 2, 3), keepdims=True) + 1e-5)
    dy = np.random.default_rng(3).standard_normal(x.shape).astype(np.float32)
    for b in net.params["sc"]:
        b.diff[...] = 0
    net.blobs["c"].diff[...] = dy
    net.backward(start="sc", end="sc")
    assert not bn.centered
    gamma = net.params["sc"][0].data.reshape(1, -1, 1, 1).astype(np.float64)
    np.testing.assert_allclose(net.params["sc"][0].diff, (dy * x_hat).sum(axis=(0, 2, 3)), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(net.params["sc"][1].diff, dy.sum(axis=(0, 2, 3)), rtol=1e-4, atol=1e-5)
    g = net.blobs["c"].diff.astype(np.float64)      # dy * gamma, BatchNorm's dy
    np.testing.assert_allclose(g, dy * gamma, rtol=1e-6)
    net.backward(start="bn", end="bn")
    std = np.sqrt(c.var(axis=(0, 2, 3), keepdims=True) + 1e-5)
    mean = lambda a: a.mean(axis=(0, 2, 3), keepdims=True)      # noqa: E731
    want = (g - mean(g) - x_hat * mean(g * x_hat)) / std
    np.testing.assert_allclose(net.blobs["c"].diff, want, rtol=1e-3, atol=1e-4 * np.abs(want).max())
