"""An Eltwise sum and the in-place ReLU after it run as one on the CPU (graph.EltwiseReLU): found
only where it is sound, the bits of the two layers apart (forward, every diff pycaffe shows, the
gradients), pycaffe's partial passes see each layer's own result, and every memory mode gives
the bits of none and meets its plan."""
import numpy as np
import pytest

import sncaffe.pycaffe as caffe
from sncaffe import Net
from sncaffe.backend import fused
from sncaffe.proto import sncaffe_pb2 as pb
from sncaffe.prototxt import parse_text


def net_text(shape, eltwise="", relu="", relu_top="s", between=""):
    n, c = shape[:2]
    dims = " ".join(f"dim: {d}" for d in shape)
    conv = ('convolution_param {{ num_output: {c} kernel_size: 3 pad: 1 '
            'weight_filler {{ type: "gaussian" std: 0.3 }} }}').format(c=c)
    return f'''
layer {{ name: "in" type: "Input" top: "x" input_param {{ shape {{ {dims} }} }} }}
layer {{ name: "c1" type: "Convolution" bottom: "x" top: "a" {conv} }}
layer {{ name: "c2" type: "Convolution" bottom: "a" top: "b" {conv} }}
layer {{ name: "sum" type: "Eltwise" bottom: "a" bottom: "b" top: "s" {eltwise} }}
{between}
layer {{ name: "relu" type: "ReLU" bottom: "s" top: "{relu_top}" {relu} }}
layer {{ name: "c3" type: "Convolution" bottom: "{relu_top}" top: "o" {conv} }}
layer {{ name: "loss" type: "EuclideanLoss" bottom: "o" bottom: "x" top: "l" }}'''


def make(text, **kw):
    net = Net(parse_text(text, pb.NetParameter()), "TRAIN", seed=0, **kw)
    net.blobs["x"].data[...] = np.random.default_rng(1).standard_normal(net.blobs["x"].shape)
    return net


def step(net, fused_on=True):
    for f in net.graph.fusions:
        f.forward, f.backward = fused_on, fused_on and f.on("backward")
    net.clear_param_diffs()
    out = {"loss": np.float64(net.forward())}
    net.backward()
    for name in ("s", "a", "b"):        # the sum's top (after the ReLU) and both bottoms, data and diff
        blob = net.blobs[name]
        if blob.data is not None:       # (other memory modes than none free them)
            out[name] = blob.data.copy()
            out[name + ".diff"] = blob.diff.copy()
    out.update({f"{name}.{i}": b.diff.copy() for name, blobs in net.params.items() for i, b in enumerate(blobs)})
    return out


def test_the_pair_is_fused_and_eltwises_backward_says_it_reads_the_top_and_writes_its_diff():
    net = make(net_text((2, 4, 5, 5)))
    (fusion,) = net.graph.fusions
    assert (fusion.eltwise.name, fusion.relu.name) == ("sum", "relu") and fusion.forward and fusion.backward
    ops = {op.name: op for op in net.graph.ops}
    s = net.graph.blobs["s"]
    assert any(t is s.data for t in ops["sum:backward"].reads)
    assert any(t is s.diff for t in ops["sum:backward"].writes)


@pytest.mark.parametrize("kw", [
    {"eltwise": "eltwise_param { coeff: 1 coeff: 2 }"},
    {"eltwise": "eltwise_param { operation: PROD }"},
    {"eltwise": "eltwise_param { operation: MAX }"},
    {"relu": "relu_param { negative_slope: 0.1 }"},
    {"relu_top": "r"},                                              # ReLU not in place
    {"between": 'layer { name: "p" type: "Power" bottom: "s" top: "s" power_param { scale: 2 } }'},
], ids=["coefficients", "prod", "max", "leaky", "relu-not-in-place", "a-layer-on-the-top-between"])
def test_no_fusion_where_it_would_not_hold(kw):
    net = make(net_text((2, 4, 5, 5), **kw))
    assert net.graph.fusions == []
    assert np.isfinite(step(net)["loss"])


@pytest.mark.parametrize("shape", [(2, 4, 5, 5), (4, 16, 32, 32)])     # NumPy and oneDNN's sizes apart
@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "numpy"])
def test_fused_pair_gives_the_layers_bits(shape, compiled, monkeypatch):
    if compiled and fused.kernels() is None:
        pytest.skip("numba is not installed (pip install 'sncaffe[fast]')")
    if not compiled:
        monkeypatch.setattr(fused, "_kernels", False)
    net = make(net_text(shape))
    assert len(net.graph.fusions) == 1
    apart, together, again = step(net, fused_on=False), step(net), step(net)
    assert len(apart) >= 10 and (apart["s"] == 0).any() and (apart["s"] > 0).any()
    for k in apart:
        assert together[k].tobytes() == apart[k].tobytes(), k
        assert again[k].tobytes() == apart[k].tobytes(), k


def test_pycaffe_partial_passes_see_each_layers_own_result(tmp_path):
    path = tmp_path / "net.prototxt"
    path.write_text(net_text((2, 4, 5, 5)))
    net = caffe.Net(str(path), caffe.TRAIN)
    x = net.blobs["x"].data
    x[...] = np.random.default_rng(2).standard_normal(x.shape)
    net.forward(end="sum")                              # the sum alone: no ReLU in it
    a, b = net.blobs["a"].data.copy(), net.blobs["b"].data.copy()
    s = net.blobs["s"].data.copy()
    assert s.tobytes() == np.add(a, b).tobytes() and (s < 0).any()
    net.forward(start="relu", end="relu")
    assert net.blobs["s"].data.tobytes() == np.maximum(s, 0).tobytes()

    net.forward()
    dy = np.random.default_rng(3).standard_normal(x.shape).astype(np.float32)
    net.blobs["s"].diff[...] = dy
    net.backward(start="sum", end="sum")                # the sum alone: dy copied, no mask
    first, second = (b.name for b in net._net.graph.layer("sum").bottoms)   # (a Split's top, b)
    assert net.blobs[first].diff.tobytes() == dy.tobytes() == net.blobs[second].diff.tobytes()
    net.blobs["s"].diff[...] = dy
    net.backward(start="relu", end="relu")              # the ReLU alone
    assert net.blobs["s"].diff.tobytes() == np.multiply(dy, net.blobs["s"].data > 0).tobytes()
    assert all(f.forward and f.backward for f in net._net.graph.fusions)   # whole passes: as one again


def test_fused_pair_in_every_memory_mode_gives_the_bits_of_none_and_meets_its_plan():
    from sncaffe.backend.cpu import CPUDevice
    text = net_text((4, 8, 6, 6))
    runs = {}
    for mode in ("none", "liveness", "offload", "recompute", "all"):
        net = make(text, device=CPUDevice(64 << 20), memory=mode)
        assert len(net.graph.fusions) == 1
        runs[mode] = step(net)
        assert net.device.pool.peak == net.plan.peak, mode
    for mode, out in runs.items():
        assert len(out) >= 7 and {k: v.tobytes() for k, v in out.items()} == {
            k: runs["none"][k].tobytes() for k in out}, mode
