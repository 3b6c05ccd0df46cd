"""Pooling on oneDNN's kernel (onednn.Pool) against sncaffe's own NumPy taps, which the golden
tests hold to Caffe: MAX the same values and the same argmax (the first maximum of a window,
ties included), AVE the same up to float rounding; and where it is not used."""
import numpy as np
import pytest

from sncaffe import Net
from sncaffe.backend import onednn
from sncaffe.proto import sncaffe_pb2 as pb
from sncaffe.prototxt import parse_text

pytestmark = pytest.mark.skipif(onednn.choice() != "onednn", reason="oneDNN is not in use on this machine")

GEOMETRIES = {                                  # (N, C, H, W), pooling_param
    "lenet 2x2/2": ((4, 5, 24, 24), "kernel_size: 2 stride: 2"),
    "resnet 3x3/2 pad 1": ((2, 3, 13, 13), "kernel_size: 3 stride: 2 pad: 1"),
    "googlenet 3x3/2 ceil": ((2, 3, 14, 14), "kernel_size: 3 stride: 2"),
    "3x3/1 pad 1": ((2, 3, 7, 9), "kernel_size: 3 stride: 1 pad: 1"),
    "rect 2x3/(1,2)": ((2, 3, 8, 11), "kernel_h: 2 kernel_w: 3 stride_h: 1 stride_w: 2"),
}


def make(shape, pooling, method):
    dims = " ".join(f"dim: {d}" for d in shape)
    text = f'''force_backward: true
layer {{ name: "in" type: "Input" top: "x" input_param {{ shape {{ {dims} }} }} }}
layer {{ name: "pool" type: "Pooling" bottom: "x" top: "y" pooling_param {{ pool: {method} {pooling} }} }}'''
    net = Net(parse_text(text, pb.NetParameter()), "TRAIN", seed=0)
    return net


def run(shape, pooling, method, x, dy):
    net = make(shape, pooling, method)
    net.blobs["x"].data[...] = x
    net.forward()
    y = net.blobs["y"].data.copy()
    net.blobs["y"].diff[...] = dy
    net.backward()
    layer = next(n.layer for n in net.graph.layers if n.name == "pool")
    return layer.dnn is not None, y, net.blobs["x"].diff.copy()


@pytest.mark.parametrize("method", ["MAX", "AVE"])
@pytest.mark.parametrize("ties", [False, True], ids=["random", "ties"])
@pytest.mark.parametrize("name", list(GEOMETRIES))
def test_onednn_pooling_gives_numpys_results(monkeypatch, name, method, ties):
    shape, pooling = GEOMETRIES[name]
    rng = np.random.default_rng(5)
    x = rng.standard_normal(shape).astype(np.float32)
    if ties:                # after a ReLU, and small integers: windows with several maxima
        x = np.maximum(np.round(x * 2), 0).astype(np.float32)
    net = make(shape, pooling, method)
    dy = rng.standard_normal(net.blobs["y"].shape).astype(np.float32)
    fast, y, dx = run(shape, pooling, method, x, dy)
    monkeypatch.setenv("SNCAFFE_CONV", "native")
    native, y0, dx0 = run(shape, pooling, method, x, dy)
    past = name == "googlenet 3x3/2 ceil"       # its last windows reach past the input
    assert fast == (method == "MAX" or not past) and not native
    if method == "MAX":
        assert y.tobytes() == y0.tobytes()
        np.testing.assert_allclose(dx, dx0, rtol=1e-6, atol=1e-6)     # same cells; sums may reorder
        assert ((dx != 0) == (dx0 != 0)).all()
    else:
        np.testing.assert_allclose(y, y0, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(dx, dx0, rtol=1e-6, atol=1e-6)


def test_a_mask_top_stays_on_numpy():
    text = '''layer { name: "in" type: "Input" top: "x" input_param { shape { dim: 2 dim: 3 dim: 8 dim: 8 } } }
layer { name: "pool" type: "Pooling" bottom: "x" top: "y" top: "mask" pooling_param { pool: MAX kernel_size: 2 stride: 2 } }'''
    net = Net(parse_text(text, pb.NetParameter()), "TRAIN", seed=0)
    assert next(n.layer for n in net.graph.layers if n.name == "pool").dnn is None
