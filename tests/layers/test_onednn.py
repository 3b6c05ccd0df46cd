"""Convolution and Deconvolution on oneDNN (backend/onednn.py, layers/conv_onednn.py): float32
against ConvPlan in float64, numerical gradients in float32, the weight gradient's block
sums (same bits for every chunk that is a multiple of reduce_block), the pool peak against
the plan, and the errors of SNCAFFE_CONV."""
from dataclasses import replace

import numpy as np
import pytest

from sncaffe import config
from sncaffe import Net
from sncaffe.backend import CPUDevice, onednn
from sncaffe.gradcheck import Harness, check_gradient, make_layer
from sncaffe.layers.base import LayerError
from sncaffe.plan.planner import MemoryExhausted
from sncaffe.layers import conv_onednn
from sncaffe.proto import sncaffe_pb2 as pb
from sncaffe.prototxt import parse_text
from test_conv import _text

needs_onednn = pytest.mark.skipif(onednn.version() is None,
                                  reason=f"oneDNN is not installed ({onednn.INSTALL})")

# (kind, bottom shape, num_output, convolution_param fields)
CASES = [
    ("Convolution", (2, 3, 7, 6), 4, dict(kernel_size=3)),
    ("Convolution", (2, 4, 9, 8), 6, dict(kernel_size=3, stride=2, pad=1)),
    ("Convolution", (2, 16, 8, 8), 16, dict(kernel_size=3, pad=1)),                # blocked channels
    ("Convolution", (1, 6, 9, 9), 6, dict(kernel_size=3, stride=2, pad=1, dilation=2, group=3)),
    ("Convolution", (2, 3, 8, 7), 4, dict(kernel_h=3, kernel_w=2, stride_h=1, stride_w=2, pad_h=0, pad_w=1,
                                          bias_term=False)),
    ("Convolution", (2, 5, 6, 6), 3, dict(kernel_size=1)),                          # 1x1: NCHW
    ("Convolution", (2, 16, 7, 7), 32, dict(kernel_size=1, stride=2, bias_term=False)),
    ("Convolution", (2, 2, 11, 10), 3, dict(kernel_size=5, stride=3, pad=2)),
    ("Convolution", (1, 3, 9, 9), 2, dict(kernel_size=2, stride=3)),               # unread pixels
    ("Convolution", (2, 16, 9, 9), 16, dict(kernel_size=3, pad=1, group=16)),      # depthwise
    ("Convolution", (2, 8, 10, 10), 8, dict(kernel_size=3, stride=2, pad=1, group=8, bias_term=False)),
    ("Convolution", (2, 16, 6, 6), 32, dict(kernel_size=3, pad=1, group=4)),
    ("ConvolutionDepthwise", (2, 8, 7, 7), 8, dict(kernel_size=3, pad=1)),
    ("Deconvolution", (2, 4, 5, 5), 3, dict(kernel_size=3, stride=2, pad=1)),
    ("Deconvolution", (2, 6, 4, 4), 6, dict(kernel_size=4, stride=2, pad=1, group=3)),
    ("Deconvolution", (2, 16, 5, 5), 8, dict(kernel_size=1, bias_term=False)),
    ("Convolution", (5, 1, 9, 8), 5, dict(kernel_size=3, pad=1)),                  # one input channel
    ("Convolution", (3, 20, 12, 12), 50, dict(kernel_size=5)),                      # LeNet's conv2
]
IDS = [f"{k}-{'x'.join(map(str, s))}-{M}-" + "-".join(f"{a}{v}" for a, v in kw.items()) for k, s, M, kw in CASES]


@pytest.fixture(autouse=True)
def default_choice(monkeypatch):
    monkeypatch.setattr(config, "settings", replace(config.settings, conv=""))


def _run(kind, shape, M, kw, dtype, params=None, chunk=None, seed=0):
    layer = make_layer(_text(kind, M, kw))
    layer.chunk = chunk
    x = np.random.default_rng(seed).standard_normal(shape)
    h = Harness(layer, [x], dtype, params=params)
    top = h.forward()[0]
    dy = np.random.default_rng(seed + 1).standard_normal(top.shape)
    (dx,), dparams = h.backward([dy])
    return layer, top, dx, dparams


@needs_onednn
@pytest.mark.parametrize("kind,shape,M,kw", CASES, ids=IDS)
def test_float32_on_onednn_matches_convplan_in_float64(kind, shape, M, kw):
    ref, *want = _run(kind, shape, M, kw, np.float64)
    assert ref.dnn is None, "float64 runs on ConvPlan"
    layer, *got = _run(kind, shape, M, kw, np.float32, params=[b.data for b in ref.blobs])
    p = layer.plan      # conv_onednn.layout: 1x1s as given, NHWC where the outputs do not fill a block
    assert layer.dnn.layout == ("nchw" if p.kernel == (1, 1) else "nhwc" if p.Cg >= 4 and p.Mg % 8 else "any")
    top, dx, dparams = got
    for what, g, w in [("top", top, want[0]), ("bottom diff", dx, want[1])] + [
            (f"param diff {i}", g, w) for i, (g, w) in enumerate(zip(dparams, want[2]))]:
        assert g.dtype == np.float32
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4 * np.abs(w).max(), err_msg=what)


@needs_onednn
@pytest.mark.parametrize("kind,shape,M,kw", [CASES[i] for i in (1, 3, 6, 10, 14)], ids=[IDS[i] for i in (1, 3, 6, 10, 14)])
def test_gradient_through_onednn(kind, shape, M, kw):
    """The gradient checker in float32: a convolution is linear, so a large step is exact up to
    float32 rounding."""
    layer = make_layer(_text(kind, M, kw))
    x = np.random.default_rng(3).standard_normal(shape)
    check_gradient(layer, [x], dtype=np.float32, eps=1e-1, rtol=2e-3, atol=2e-3, max_probes=60)
    assert layer.dnn is not None


@needs_onednn
@pytest.mark.parametrize("kind", ["Convolution", "Deconvolution"])
def test_chunks_that_are_multiples_of_reduce_block_give_the_same_weight_bits(kind, monkeypatch):
    shape, M, kw = (12, 16, 6, 6), 8, dict(kernel_size=3, stride=2, pad=1, bias_term=False)
    per_image = 6 * 6 if kind == "Convolution" else 11 * 11    # the image side: a Deconvolution's top
    monkeypatch.setattr(conv_onednn, "BLOCK_POSITIONS", 2 * per_image)     # blocks of 2 images
    runs = {chunk: _run(kind, shape, M, kw, np.float32, chunk=chunk) for chunk in (None, 2, 4, 6, 12)}
    ref = runs[None]
    params = [b.data for b in ref[0].blobs]
    for chunk, (layer, top, dx, dparams) in runs.items():
        assert layer.dnn is not None and layer.reduce_block == 2
        assert [b.data.tobytes() for b in layer.blobs] == [p.tobytes() for p in params]   # the same weights
        assert dparams[0].tobytes() == ref[3][0].tobytes(), f"chunk {chunk}"
        assert dx.tobytes() == ref[2].tobytes() and top.tobytes() == ref[1].tobytes(), f"chunk {chunk}"
    # a block of the whole batch sums in another order: close, and (most likely) other bits
    monkeypatch.setattr(conv_onednn, "BLOCK_POSITIONS", 1 << 30)
    whole = _run(kind, shape, M, kw, np.float32)
    np.testing.assert_allclose(whole[3][0], ref[3][0], rtol=1e-4, atol=1e-4)


@needs_onednn
@pytest.mark.parametrize("blocks", [1, 2])
def test_weight_gradient_added_by_the_reorder_gives_numpys_add(blocks, monkeypatch):
    """Where oneDNN keeps the weight gradient in its own layout, its reorder out adds it into the
    diff (``onednn.Conv.adds``): the bytes of writing it to the workspace and adding it with
    NumPy, onto a diff that already holds a gradient (Caffe accumulates), in one block or several
    (blocks of 1 image: the second adds onto the first's gradient); every case, the input
    gradient unchanged."""
    def backward(kind, shape, M, kw):
        layer = make_layer(_text(kind, M, kw))
        rng = np.random.default_rng(5)
        h = Harness(layer, [rng.standard_normal(shape)], np.float32)
        h.top[0].diff[...] = rng.standard_normal(h.forward()[0].shape)
        layer.blobs[0].diff[...] = rng.standard_normal(layer.blobs[0].diff.shape)
        before = layer.blobs[0].diff.copy()
        layer.backward(h.top, [True], h.bottom)
        assert layer.blobs[0].diff.tobytes() != before.tobytes()
        assert layer.reduce_block == 1 if blocks == 2 else layer.reduce_block >= shape[0]
        adds = layer.dnn.conv(min(layer.reduce_block, shape[0])).adds("y" if kind == "Convolution" else "x")
        return layer.blobs[0].diff.tobytes(), h.bottom[0].diff.tobytes(), adds

    if blocks == 2:
        monkeypatch.setattr(conv_onednn, "BLOCK_POSITIONS", 1)
    real = onednn.Conv.adds
    added = 0
    for case in CASES:
        monkeypatch.setattr(onednn.Conv, "adds", real)
        dw, dx, adds = backward(*case)
        monkeypatch.setattr(onednn.Conv, "adds", lambda self, first=None: False)
        assert (dw, dx) == backward(*case)[:2], case
        added += adds
    assert added >= 5, "the blocked and NHWC cases keep the gradient in oneDNN's layout"


NET = """
name: "onednn" force_backward: true
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 8 dim: 16 dim: 12 dim: 12 } } }
layer { name: "target" type: "Input" top: "target" input_param { shape { dim: 8 dim: 8 dim: 12 dim: 12 } } }
layer { name: "c1" type: "Convolution" bottom: "data" top: "c1"
        convolution_param { num_output: 32 kernel_size: 3 pad: 1 weight_filler { type: "xavier" } } }
layer { name: "r1" type: "ReLU" bottom: "c1" top: "c1" }
layer { name: "dw" type: "Convolution" bottom: "c1" top: "dw"
        convolution_param { num_output: 32 group: 32 kernel_size: 3 stride: 2 pad: 1 weight_filler { type: "xavier" } } }
layer { name: "pw" type: "Convolution" bottom: "dw" top: "pw"
        convolution_param { num_output: 16 kernel_size: 1 weight_filler { type: "xavier" } } }
layer { name: "up" type: "Deconvolution" bottom: "pw" top: "up"
        convolution_param { num_output: 8 kernel_size: 4 stride: 2 pad: 1 weight_filler { type: "xavier" } } }
layer { name: "loss" type: "EuclideanLoss" bottom: "up" bottom: "target" top: "loss" }
"""


def _net(mode, capacity):
    net = Net(parse_text(NET, pb.NetParameter()), "TRAIN", device=CPUDevice(capacity), memory=mode, seed=1)
    rng = np.random.default_rng(0)
    for name in net.inputs:
        net.blobs[name].data[...] = rng.standard_normal(net.blobs[name].shape)
    net.device.pool.reset_peak()
    net.forward()
    net.backward()
    return net


@needs_onednn
@pytest.mark.parametrize("mode", ["none", "liveness", "all"])
def test_pool_peak_is_the_plan(mode):
    """The workspaces oneDNN's passes take (scratchpads, blocked copies, the weight gradient's
    block) are the planned ones: the measured pool peak is the plan's."""
    net = _net(mode, "256MiB")
    convs = [layer for layer in net.layers if layer.type in ("Convolution", "Deconvolution")]
    assert len(convs) == 4 and all(layer.dnn is not None for layer in convs)
    assert net.device.pool.peak == net.plan.peak
    assert net.device.pool.in_use == net.plan.persistent_bytes


@needs_onednn
def test_workspace_is_one_blocks_and_the_tight_plan_meets_its_peak(monkeypatch):
    """oneDNN runs every primitive block by block, so a convolution's workspace is one block's
    whatever the batch (chunking saves nothing more), and a plan at its own peak is met."""
    monkeypatch.setattr(conv_onednn, "BLOCK_POSITIONS", 2 * 12 * 12)    # blocks of 2 images
    full = _net("liveness", "256MiB")
    conv = full.layers[list(full.layer_names).index("c1")]
    assert conv.reduce_block == 2
    assert conv.workspace_specs == conv_onednn.workspace(conv, 2) == conv_onednn.workspace(conv, 8)
    assert not conv.chunk_sizes(8)          # so the planner tries no chunk that would save nothing
    for slack in (1.0, 1.05, 1.1, 1.25):       # the least capacity its blocks pack into
        try:
            net = _net("liveness", int(full.plan.peak * slack))
            break
        except MemoryExhausted:
            continue
    assert net.device.pool.peak == net.plan.peak <= full.plan.peak


def test_float64_and_native_stay_on_convplan(monkeypatch):
    layer, *_ = _run("Convolution", (1, 2, 5, 5), 2, dict(kernel_size=3), np.float64)
    assert layer.dnn is None
    monkeypatch.setattr(config, "settings", replace(config.settings, conv="native"))
    layer, *_ = _run("Convolution", (1, 2, 5, 5), 2, dict(kernel_size=3), np.float32)
    assert layer.dnn is None and "xq" in layer.workspace_specs


def test_bad_choice_is_a_layer_error(monkeypatch):
    monkeypatch.setattr(config, "settings", replace(config.settings, conv="mkldnn"))
    with pytest.raises(LayerError, match=r'layer "convolution".*SNCAFFE_CONV=.mkldnn.: give .onednn. or .native.'):
        _run("Convolution", (1, 2, 5, 5), 2, dict(kernel_size=3), np.float32)


def test_forced_and_absent_names_the_extra(monkeypatch, tmp_path):
    """No libdnnl.so.3 where the loader looks (an empty prefix, no loader path): forcing oneDNN
    says how to install it; unset, the layer runs on ConvPlan."""
    monkeypatch.setattr(onednn, "_candidates", lambda: [str(tmp_path / onednn.LIBRARY)])
    for name, value in (("_lib", None), ("_engine", None), ("_tried", False)):
        monkeypatch.setattr(onednn, name, value)
    monkeypatch.setattr(config, "settings", replace(config.settings, conv="onednn"))
    with pytest.raises(LayerError, match=r"SNCAFFE_CONV=onednn.*not found.*pip install onednn-cpu-gomp"):
        _run("Convolution", (1, 2, 5, 5), 2, dict(kernel_size=3), np.float32)
    monkeypatch.setattr(config, "settings", replace(config.settings, conv=""))
    layer, *_ = _run("Convolution", (1, 2, 5, 5), 2, dict(kernel_size=3), np.float32)
    assert layer.dnn is None


@needs_onednn
@pytest.mark.parametrize("kind,shape,M,kw", [CASES[i] for i in (2, 3, 5, 16, 17)],
                         ids=[IDS[i] for i in (2, 3, 5, 16, 17)])
def test_only_the_weight_gradient_bits_follow_the_thread_count(kind, shape, M, kw, monkeypatch):
    """Forward and input gradient on a team of one and of two: the same bytes, in one block and in
    blocks of one image. The weight gradient agrees to rounding: oneDNN splits its sum over a
    block's images (a 1x1's over positions) among the team (README, "CPU convolutions")."""
    from sncaffe.backend import threads
    for positions in (conv_onednn.BLOCK_POSITIONS, 1):
        monkeypatch.setattr(conv_onednn, "BLOCK_POSITIONS", positions)
        got = {}
        for team in (1, 2):
            monkeypatch.setattr(threads, "_decision", threads.Decision(team, 2, "--threads"))
            layer, top, dx, dparams = _run(kind, shape, M, kw, np.float32)
            assert layer.dnn.conv(layer.reduce_block).threads == team
            got[team] = top, dx, dparams[0]
        assert [a.tobytes() for a in got[1][:2]] == [a.tobytes() for a in got[2][:2]], positions
        np.testing.assert_allclose(got[1][2], got[2][2], rtol=1e-5, atol=1e-5 * np.abs(got[1][2]).max())


@needs_onednn
def test_a_strided_argument_is_refused():
    """oneDNN reads raw memory: a view with other strides must not reach it."""
    conv = onednn.conv(2, 4, 4, 1, (5, 5), (3, 3), (1, 1), (1, 1), (1, 1))
    x = np.zeros((2, 8, 5, 5), np.float32)[:, ::2]
    w, y = np.zeros((4, 4, 3, 3), np.float32), np.zeros((2, 4, 5, 5), np.float32)
    ws = np.zeros(conv.nbytes("forward"), np.uint8)
    with pytest.raises(ValueError, match="C-contiguous float32"):
        conv.run("forward", ws, x=x, w=w, y=y)
    conv.run("forward", ws, x=np.ascontiguousarray(x), w=w, y=y)


@needs_onednn
@pytest.mark.parametrize("stride,kind,name", [(1, "data", "y"), (1, "forward", "x"), (2, "data", "y")])
def test_backward_passes_sharing_one_reordered_dy_give_the_bytes_of_two(stride, kind, name):
    """run_two reorders dy once for the weight gradient and the input gradient (a Convolution's dy
    is both passes' grid side, a Deconvolution's their image side): the same bytes as two separate
    passes, and the fill of a stale workspace does not leak in. Where the kernels want dy in two
    layouts (stride 2 here) ``shares`` says no and each pass reorders its own."""
    rng = np.random.default_rng(1)
    conv = onednn.conv(3, 16, 16, 1, (10, 10), (3, 3), (stride, stride), (1, 1), (1, 1))
    out = (10 + 2 - 3) // stride + 1
    x = rng.standard_normal((3, 16, 10, 10)).astype(np.float32)
    y = rng.standard_normal((3, 16, out, out)).astype(np.float32)
    w = rng.standard_normal((16, 16, 3, 3)).astype(np.float32)
    shared, other = (y, x) if name == "y" else (x, y)
    size = max(conv.nbytes(k, f) for k in ("weights", kind) for f in (None, name))
    o = "x" if name == "y" else "y"
    expected = {"weights": np.zeros_like(w), kind: np.zeros_like(other)}
    conv.run("weights", np.zeros(size, np.uint8), x=x, w=expected["weights"], y=y)
    conv.run(kind, np.zeros(size, np.uint8), **{name: shared, o: expected[kind], "w": w})
    assert conv.shares("weights", kind, name) == (stride == 1 or name == "x")
    dw, dother = np.zeros_like(w), np.zeros_like(other)
    conv.run_two(np.full(size, 255, np.uint8), ("weights", {o: other, "w": dw}), (kind, {o: dother, "w": w}),
                 name, shared)
    assert dw.tobytes() == expected["weights"].tobytes()
    assert dother.tobytes() == expected[kind].tobytes()


@needs_onednn
def test_threads_running_a_fresh_geometry_at_once_all_get_its_result():
    """Two locations of one process run their first step of one geometry on their own threads at
    the same time: one creates the primitives, every thread computes the same output (the
    primitive was once published before its reorders: a thread found it and no reorders)."""
    import threading
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 16, 9, 9)).astype(np.float32)
    w = rng.standard_normal((16, 16, 3, 3)).astype(np.float32)
    for stride, dilation in [(s, d) for s in (1, 2) for d in (1, 2, 3)]:     # geometries no other test built
        conv = onednn.conv(2, 16, 16, 1, (9, 9), (3, 3), (1, stride), (1, 1), (1, dilation))
        width = (9 + 2 - (1 + 2 * dilation)) // stride + 1
        outs, errors = [], []
        start = threading.Barrier(8)

        def run(k):
            try:
                y, ws = np.empty((2, 16, 9, width), np.float32), np.empty(conv.nbytes("forward"), np.uint8)
                start.wait()
                threading.Event().wait(k * 2e-4)     # staggered: some arrive while the first creates
                conv.run("forward", ws, x=x, w=w, y=y)
                outs.append(y)
            except Exception as e:     # noqa: BLE001 - the test reports every thread's error
                errors.append(e)
        threads = [threading.Thread(target=run, args=(k,)) for k in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert not errors, errors
        assert len(outs) == 8 and all(np.array_equal(outs[0], y) for y in outs[1:])


def _onednn_and_native(monkeypatch, text, bottoms, dy, counted, inplace=False, n_bottoms=1, n_tops=1):
    """One float32 forward and backward of the layer ``text`` on oneDNN's element-wise kernels,
    then on sncaffe's NumPy code (SNCAFFE_CONV=native): for each, the tops, the bottom and
    parameter gradients and the parameters (running statistics); and how many calls of the
    ``counted`` (class, method) pairs the two runs made (the native run makes none). ``dy``: the
    top's gradient, or a list of the tops'."""
    calls = []
    for cls, name in counted:
        real = getattr(cls, name)
        monkeypatch.setattr(cls, name, (lambda r: lambda self, *a, **k: calls.append(1) or r(self, *a, **k))(real))
    runs = []
    for native in (False, True):
        if native:
            monkeypatch.setattr(config, "settings", replace(config.settings, conv="native"))
        else:
            monkeypatch.setattr(config, "settings", replace(config.settings, conv=""))
        layer = make_layer(text, inplace=inplace, n_bottoms=n_bottoms, n_tops=n_tops)
        h = Harness(layer, bottoms, dtype=np.float32)
        y = h.forward()
        dx, dp = h.backward(dy if isinstance(dy, list) else [dy])
        runs.append([*y, *dx, *dp, *(b.data.copy() for b in layer.blobs)])
    return runs[0], runs[1], len(calls)


@needs_onednn
@pytest.mark.parametrize("slope", [0.0, 0.1])
@pytest.mark.parametrize("inplace", [False, True])
def test_relu_on_onednn_gives_numpys_bytes(slope, inplace, monkeypatch):
    """ReLU on oneDNN (float32 tensors of RELU_MIN values or more) against sncaffe's NumPy code:
    forward and backward, in place and not, byte for byte without a slope; with one, the same
    values (a zero's sign aside: oneDNN's slope * -0 is -0 where NumPy's max(x, 0) + slope *
    min(x, 0) adds to +0)."""
    rng = np.random.default_rng(3)
    shape = (4, 16, 32, 32)
    assert np.prod(shape) >= onednn.RELU_MIN
    x = rng.standard_normal(shape).astype(np.float32)
    x[0, 0, 0, :4] = [0.0, -0.0, 1e-45, -1e-45]            # zeros and denormals
    dy = rng.standard_normal(shape).astype(np.float32)
    fast, native, calls = _onednn_and_native(
        monkeypatch, f'type: "ReLU" relu_param {{ negative_slope: {slope} }}', [x], dy,
        [(onednn.Relu, "forward"), (onednn.Relu, "backward")], inplace=inplace)
    assert calls == 2                               # forward and backward ran on oneDNN
    assert all(np.array_equal(a, b) for a, b in zip(fast, native))
    if slope == 0:
        assert [a.tobytes() for a in fast] == [b.tobytes() for b in native]


@needs_onednn
def test_relu_on_onednn_passes_the_gradient_checker():
    """ReLU on oneDNN: the gradient checker in float32 through the layer (linear on each side
    of the kink, so a large step is exact up to float32 rounding; no value within it of 0)."""
    layer = make_layer('type: "ReLU"')
    rng = np.random.default_rng(4)
    x = rng.standard_normal((4, 8, 32, 32))
    x[np.abs(x) < 0.15] = 0.5
    assert x.size >= onednn.RELU_MIN
    check_gradient(layer, [x], dtype=np.float32, eps=1e-1, rtol=5e-3, atol=5e-3, max_probes=60)


SCALES = [
    ('type: "Scale" scale_param { bias_term: true filler { type: "gaussian" } bias_filler { type: "gaussian" } }', 1),
    ('type: "Scale" scale_param { filler { type: "gaussian" } }', 1),
    ('type: "Scale" scale_param { axis: 1 num_axes: 2 bias_term: true filler { type: "gaussian" } '
     'bias_filler { type: "gaussian" } }', 1),
    ('type: "Scale" scale_param { axis: 0 bias_term: true }', 2),        # scale from bottom[1]
]


@needs_onednn
@pytest.mark.parametrize("text, n_bottoms, inplace", [(t, n, inplace) for t, n in SCALES
                                                      for inplace in (False, True) if not (inplace and n == 2)])
def test_scale_on_onednn_gives_numpys_bytes(text, n_bottoms, inplace, monkeypatch):
    """Scale's product (and bias) on oneDNN against sncaffe's NumPy code: top, bottom and parameter
    gradients byte for byte, in place and not (Caffe's in-place Scale has one bottom)."""
    rng = np.random.default_rng(5)
    shape = (16, 16, 32, 32)
    assert np.prod(shape) >= onednn.BINARY_MIN
    bottoms = [rng.standard_normal(shape)] + ([rng.standard_normal(shape[:1])] if n_bottoms == 2 else [])
    dy = rng.standard_normal(shape).astype(np.float32)
    fast, native, calls = _onednn_and_native(monkeypatch, text, bottoms, dy, [(onednn.Binary, "run")],
                                             inplace=inplace, n_bottoms=n_bottoms)
    assert calls == 2                               # forward and backward's dx ran on oneDNN
    assert [a.tobytes() for a in fast] == [b.tobytes() for b in native]


@needs_onednn
def test_scale_on_onednn_passes_the_gradient_checker():
    layer = make_layer('type: "Scale" scale_param { bias_term: true filler { type: "gaussian" } '
                       'bias_filler { type: "gaussian" } }')
    x = np.random.default_rng(6).standard_normal((8, 32, 32, 32))
    assert x.size >= onednn.BINARY_MIN
    check_gradient(layer, [x], dtype=np.float32, eps=1e-1, rtol=5e-3, atol=5e-3, max_probes=60)


@needs_onednn
@pytest.mark.parametrize("inplace", [False, True])
def test_batchnorm_on_onednn_gives_numpys_bytes(inplace, monkeypatch):
    """A training BatchNorm's centring, normalizing and input gradient on oneDNN against sncaffe's
    NumPy code: top, bottom gradient and the running statistics byte for byte, in place and not
    (the compiled centring of backend/fused.py off: tests/backend/test_fused.py has it)."""
    from sncaffe.backend import fused
    monkeypatch.setattr(fused, "_kernels", False)
    rng = np.random.default_rng(7)
    shape = (16, 16, 32, 32)
    assert np.prod(shape) >= onednn.BINARY_MIN
    x = rng.standard_normal(shape) * 3 + 1
    dy = rng.standard_normal(shape).astype(np.float32)
    fast, native, calls = _onednn_and_native(monkeypatch, 'type: "BatchNorm"', [x], dy,
                                             [(onednn.Binary, "run")], inplace=inplace)
    assert calls == 4                       # centre, normalize, and the gradient's two passes
    assert [a.tobytes() for a in fast] == [b.tobytes() for b in native]


@needs_onednn
def test_batchnorm_on_onednn_passes_the_gradient_checker():
    layer = make_layer('type: "BatchNorm"')
    x = np.random.default_rng(8).standard_normal((8, 32, 32, 32))
    assert x.size >= onednn.BINARY_MIN
    check_gradient(layer, [x], dtype=np.float32, eps=2e-2, rtol=2e-2, atol=2e-3, max_probes=40)


@needs_onednn
@pytest.mark.parametrize("text, n_bottoms, n_tops", [
    ('type: "Eltwise"', 2, 1),                                   # SUM: x0 + x1
    ('type: "Eltwise" eltwise_param { coeff: 1 coeff: 1 coeff: 1 }', 3, 1),   # (x0 + x1) + x2
    ('type: "Split"', 1, 2),                                     # backward: d0 + d1
    ('type: "Split"', 1, 3),                                     # (d0 + d1) + d2
])
@pytest.mark.parametrize("team", [1, 2])
def test_sums_on_onednn_give_numpys_bytes(text, n_bottoms, n_tops, team, monkeypatch):
    """Eltwise's SUM (coefficients 1) and Split's backward add on oneDNN's binary kernel, left to
    right as NumPy adds: tops and bottom gradients byte for byte (signed zeros, infinities and a
    NaN included), one oneDNN call per pass; with a team of two, Eltwise's gradient copies (dx =
    dy) run on it too (``onednn.copy_on_team``), one call each."""
    from sncaffe.backend import threads
    monkeypatch.setattr(threads, "_decision", threads.Decision(team, 2, "--threads"))
    rng = np.random.default_rng(9)
    shape = (16, 16, 32, 32)
    assert np.prod(shape) >= onednn.BINARY_MIN
    bottoms = [rng.standard_normal(shape).astype(np.float32) for _ in range(n_bottoms)]
    dys = [rng.standard_normal(shape).astype(np.float32) for _ in range(n_tops)]
    for a in bottoms[:2] + dys[:2]:
        a[0, 0, 0, :4] = [-0.0, np.inf, 1e-45, np.nan]
    fast, native, calls = _onednn_and_native(monkeypatch, text, bottoms, dys, [(onednn.Binary, "run")],
                                             n_bottoms=n_bottoms, n_tops=n_tops)
    copies = n_bottoms if team == 2 and "Eltwise" in text else 0
    assert calls == 1 + copies              # Eltwise's forward or Split's backward, and the copies
    assert [a.tobytes() for a in fast] == [b.tobytes() for b in native]


@needs_onednn
def test_eltwise_sum_on_onednn_passes_the_gradient_checker():
    layer = make_layer('type: "Eltwise"', n_bottoms=2)
    rng = np.random.default_rng(10)
    xs = [rng.standard_normal((8, 32, 32, 32)) for _ in range(2)]
    assert xs[0].size >= onednn.BINARY_MIN
    check_gradient(layer, xs, dtype=np.float32, eps=1e-1, rtol=5e-3, atol=5e-3, max_probes=40)


@needs_onednn
@pytest.mark.parametrize("path", ["share-dy", "sum", "binary", "relu", "bn-scale", "sgd-step", "pooling", "nhwc",
                                  "nchw-1x1", "dw-add"])
def test_bench_toggle_times_both_forms_and_puts_the_path_back(path, capsys):
    """tools/bench_toggle.py switches one fast path off on every other iteration: it prints both
    forms' times and leaves the entry point it replaced as it found it (nhwc: on LeNet, whose data
    layers it replaces by inputs)."""
    import sys
    from conftest import ROOT
    sys.path.insert(0, str(ROOT / "tools"))
    import bench_toggle
    from sncaffe.solvers.update import SGD
    owner, name = {"share-dy": (onednn.Conv, "_pair"), "sum": (onednn, "sum_for"),
                   "binary": (onednn, "binary_for"), "relu": (onednn, "relu_for"), "sgd-step": (SGD, "step"),
                   "bn-scale": (onednn, "binary_for"),     # (bn-scale flips the net's own flags,
                   "pooling": (onednn, "pool"),             # pooling and nhwc build a second net)
                   "nhwc": (conv_onednn, "layout"), "nchw-1x1": (conv_onednn, "layout"),
                   "dw-add": (onednn.Conv, "adds")}[path]
    before = getattr(owner, name)
    net = ["--net", "prototxt/lenet_train_test.prototxt"] if path == "nhwc" else []
    assert bench_toggle.main(["--path", path, "--batch", "2", "--iterations", "1"] + net) == 0
    assert getattr(owner, name) is before
    from sncaffe.layers import pooling
    assert pooling.ONEDNN                   # the pooling path's second net leaves the switch as it was
    out = capsys.readouterr().out
    assert f"{path} (" in out and " off/on " in out


@needs_onednn
def test_bench_conv_backends_times_both_engines(capsys):
    """tools/bench_conv.py --backends: a shape's row times oneDNN and ConvPlan and names oneDNN's
    kernels for each pass."""
    import sys
    from types import SimpleNamespace
    from conftest import ROOT
    sys.path.insert(0, str(ROOT / "tools"))
    import bench_conv
    bench_conv.backends(np, None, SimpleNamespace(only="lenet 5x5 20>50", quick=True, repeat=1, lenet_batch=2,
                                                  cifar_batch=2, batch=1))
    row = [line for line in capsys.readouterr().out.splitlines() if line.startswith("lenet 5x5 20>50")]
    assert len(row) == 1
    times = row[0].split("|")[1].split()
    assert len(times) == 3 and all(float(t) > 0 for t in times[:2]) and times[2] == "-", row
    kernels = row[0].split("|")[-1].split()[2:]         # after the two ratios: one kernel name a pass
    assert len(kernels) == 3 and all(":" in k for k in kernels), row


@needs_onednn
@pytest.mark.parametrize("full, posts", [(False, ((onednn.ADD, True),)), (True, ((onednn.ADD, False),)),
                                         (False, ((onednn.SUB, True), (onednn.DIV, False)))])
def test_binary_takes_src1_and_each_post_operand_in_its_own_shape(full, posts):
    """src1 per channel or whole (``full``) whatever the post-operands are, and each post-operand
    by its own flag: the bytes of NumPy's separate calls."""
    rng = np.random.default_rng(12)
    view = (2, 3, 5)
    whole, channel = (lambda: rng.standard_normal(view).astype(np.float32)), (lambda: rng.random(3).astype(np.float32) + 1)
    x, src1 = whole(), (whole() if full else channel())
    operands = [whole() if w else channel() for _, w in posts]
    ops = {onednn.ADD: np.add, onednn.SUB: np.subtract, onednn.DIV: np.divide, onednn.MUL: np.multiply}
    shaped = lambda a: a if a.ndim == 3 else a[None, :, None]     # noqa: E731
    expected = np.multiply(x, shaped(src1))
    for (alg, _), a in zip(posts, operands):
        expected = ops[alg](expected, shaped(a))
    y = np.empty_like(x)
    onednn.binary(view, onednn.MUL, posts, full).run(x, src1, y, *operands)
    assert y.tobytes() == expected.astype(np.float32).tobytes()


@pytest.mark.parametrize("n", [1, 4095, 4096, 3 * 4096, 64 * 4096, 2359296, 1000003, 8192 * 63])
def test_flat_views_cover_n_in_rows_of_at_least_4_ki(n):
    """``flat(n)``: rows x 1 x inner = n, at most 64 rows, each of 4 Ki values or more (one row
    where no such split divides n)."""
    rows, one, inner = onednn.flat(n)
    assert rows * one * inner == n and one == 1 and 1 <= rows <= 64
    assert rows == 1 or inner >= 4096
    if n % 64 == 0 and n >= 64 * 4096:
        assert rows == 64


@needs_onednn
def test_times_one_on_a_flat_view_copies_every_bit():
    """SGD's ``diff = history`` runs as history * 1 on a flat view (all the threads): signed
    zeros, subnormals, infinities and NaN come through unchanged."""
    rng = np.random.default_rng(13)
    n = 64 * 4096
    x = rng.standard_normal(n).astype(np.float32)
    x[:6] = [-0.0, 1e-45, -1e-45, np.inf, -np.inf, np.nan]
    y = np.empty_like(x)
    onednn.binary(onednn.flat(n), onednn.MUL).run(x, np.ones(1, np.float32), y)
    assert y.tobytes() == x.tobytes()


@needs_onednn
@pytest.mark.parametrize("team", [1, 2])
def test_a_team_takes_mid_sized_tensors_to_onednn(team, monkeypatch):
    """Between BINARY_MIN_TEAM and BINARY_MIN values a binary runs on oneDNN only on a team of two
    or more; from BINARY_MIN on either; below BINARY_MIN_TEAM on neither."""
    from sncaffe.backend import threads
    monkeypatch.setattr(threads, "_decision", threads.Decision(team, 2, "--threads"))
    for n, expected in [(onednn.BINARY_MIN_TEAM - 64, False), (onednn.BINARY_MIN_TEAM, team == 2),
                        (onednn.BINARY_MIN, True)]:
        x = np.ones(n, np.float32)
        assert (onednn.binary_for(onednn.flat(n), (x, x), onednn.ADD, full=True) is not None) == expected
