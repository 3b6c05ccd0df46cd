"""Pooling on oneDNN's kernel (onednn.Pool) against sncaffe's own NumPy taps, which the golden
tests hold to Caffe: MAX the same values and the same argmax (the first maximum of a window,
ties included), AVE the same up to float rounding; and where it is not used."""
from dataclasses import replace

import numpy as np
import pytest

from sncaffe import config
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
    monkeypatch.setattr(config, "settings", replace(config.settings, conv="native"))
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


def test_the_blocked_tag_is_nchw8c():
    """_NCHW8C names channels in blocks of 8 in the loaded library (oneDNN numbers its tags per
    version): an identity pooling's reordered copy of x holds, per block of 8 channels, each
    position's 8 channels together, the channels past C zero."""
    shape = (1, 12, 1, 2)
    p = onednn.Pool(shape, (1, 2), (1, 1), (1, 1), (0, 0), onednn.POOL_AVG, blocked=True)
    x = np.arange(np.prod(shape), dtype=np.float32).reshape(shape) + 1
    y, ws = np.empty_like(x), np.zeros(p.nbytes, np.uint8)
    p.forward(x, y, None, ws)
    assert y.tobytes() == x.tobytes()
    _, offset = p.kernels[1].forward_step.slot(onednn.SRC)
    copy = ws[offset:offset + 16 * 2 * 4].view(np.float32).reshape(2, 2, 8)      # (block, w, channel)
    padded = np.zeros((16, 2), np.float32)
    padded[:12] = x[0, :, 0]
    np.testing.assert_array_equal(copy, padded.reshape(2, 8, 2).transpose(0, 2, 1))


@pytest.mark.parametrize("blocks", [False, True], ids=["one block", "blocks"])
@pytest.mark.parametrize("method", ["MAX", "AVE"])
@pytest.mark.parametrize("name", list(GEOMETRIES))
def test_blocked_pooling_gives_nchws_bits(name, method, blocks, monkeypatch):
    """Blocked (channels reordered into blocks of 8) and NCHW kernels give the same results,
    whichever of them a machine has JIT kernels for, in one block of images or several: MAX the
    same bytes forward and the same cells backward (overlapping windows' sums may add in another
    order); pool() keeps a JIT one."""
    shape, pooling = GEOMETRIES[name]
    shape = (5, 11) + shape[2:]         # channels past a block, the last one partly filled; 5 images
    net = make(shape, pooling, method)
    layer = next(n.layer for n in net.graph.layers if n.name == "pool")
    if blocks:      # two images' copies (channels padded to 16): blocks of 2 images, then 1
        copies = 16 * (shape[2] * shape[3] + layer.pooled[0] * layer.pooled[1]) * 4
        monkeypatch.setattr(onednn, "POOL_BLOCK_BYTES", 2 * copies)
    alg = onednn.POOL_MAX if method == "MAX" else onednn.POOL_AVG
    args = (shape, layer.pooled, layer.kernel, layer.stride, layer.pad, alg)
    rng = np.random.default_rng(3)
    x = np.maximum(np.round(rng.standard_normal(shape) * 2), 0).astype(np.float32)      # ties
    dy = rng.standard_normal((shape[0], shape[1]) + layer.pooled).astype(np.float32)
    out = []
    for blocked in (False, True):
        p = onednn.Pool(*args, blocked=blocked)
        assert p.blocked == blocked
        assert sorted(p.kernels) == ([1, 2] if blocked and blocks else [5])
        argmax = np.zeros(p.ws_bytes, np.uint8) if p.ws is not None else None
        ws = np.zeros(p.nbytes, np.uint8)
        y, dx = np.empty(dy.shape, np.float32), np.empty(shape, np.float32)
        p.forward(x, y, argmax, ws)
        p.backward(dy, dx, argmax, ws)
        out.append((y, dx))
    (y0, dx0), (y1, dx1) = out
    if method == "MAX":
        assert y0.tobytes() == y1.tobytes()
        assert ((dx0 != 0) == (dx1 != 0)).all()
    np.testing.assert_allclose(y1, y0, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(dx1, dx0, rtol=1e-6, atol=1e-6)
    chosen = onednn.pool(*args)
    assert chosen is None or chosen.jit
