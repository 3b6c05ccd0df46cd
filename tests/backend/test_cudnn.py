"""cuDNN bindings: what needs no library, what needs the library (descriptors and shapes
answer without a GPU), and what needs a GPU (every call against a NumPy reference)."""
import itertools
import math
import os
from dataclasses import replace

import numpy as np
import pytest

from sncaffe.backend.cuda import unusable_reason as cuda_unusable_reason

from sncaffe import config
from sncaffe.backend import cudnn
from sncaffe.layers.pooling import pooled_size

FLT_MAX = float(np.finfo(np.float32).max)
HAVE_CUDNN = cudnn.available()
needs_cudnn = pytest.mark.skipif(not HAVE_CUDNN, reason="cuDNN 9 is not installed (no nvidia-cudnn-cu13/-cu12 "
                                                        "wheel, $SNCAFFE_CUDNN or system libcudnn.so.9)")


def _gpu_reason():
    return "cuDNN 9 is not installed" if not HAVE_CUDNN else cuda_unusable_reason()

GPU_REASON = _gpu_reason()
needs_gpu = pytest.mark.skipif(GPU_REASON is not None, reason=str(GPU_REASON))


@pytest.fixture
def fresh_load():
    """Forget the loaded library around a test that changes how it is found."""
    def clear():
        cudnn.tensor.cache_clear()
        cudnn._function.cache_clear()
        cudnn.load.cache_clear()
    clear()
    yield
    clear()


# -- no library needed ----------------------------------------------------------------

@pytest.mark.parametrize("number, version", [(92801, (9, 28, 1)), (90000, (9, 0, 0)), (91002, (9, 10, 2)),
                                             (8907, (8, 9, 7)), (7605, (7, 6, 5)), (100100, (10, 1, 0))])
def test_parse_version(number, version):
    assert cudnn.parse_version(number) == version


@pytest.mark.parametrize("number", [8907, 7605, 100100])
def test_check_version_refuses_other_majors(number):
    with pytest.raises(cudnn.CudnnVersionError, match=r"needs cuDNN 9\.x.*sncaffe\[cuda13\]"):
        cudnn.check_version(number, "/x/libcudnn.so")
    assert cudnn.check_version(92801) == (9, 28, 1)


@pytest.mark.parametrize("status, cls, name", [
    (1001, cudnn.CudnnError, "CUDNN_STATUS_NOT_INITIALIZED"),
    (1002, cudnn.CudnnError, "CUDNN_STATUS_SUBLIBRARY_VERSION_MISMATCH"),
    (2000, cudnn.CudnnError, "CUDNN_STATUS_BAD_PARAM"),
    (2002, cudnn.CudnnError, "CUDNN_STATUS_BAD_PARAM_NULL_POINTER"),
    (3000, cudnn.CudnnNotSupported, "CUDNN_STATUS_NOT_SUPPORTED"),
    (3007, cudnn.CudnnNotSupported, "CUDNN_STATUS_NOT_SUPPORTED_ARCH_MISMATCH"),
    (4000, cudnn.CudnnError, "CUDNN_STATUS_INTERNAL_ERROR"),
    (4003, cudnn.CudnnOutOfMemory, "CUDNN_STATUS_INTERNAL_ERROR_HOST_ALLOCATION_FAILED"),
    (4004, cudnn.CudnnOutOfMemory, "CUDNN_STATUS_INTERNAL_ERROR_DEVICE_ALLOCATION_FAILED"),
    (5000, cudnn.CudnnError, "CUDNN_STATUS_EXECUTION_FAILED"),
    (5003, cudnn.CudnnError, "CUDNN_STATUS_EXECUTION_FAILED_CUDART"),
    (6001, cudnn.CudnnError, "CUDNN_STATUS_6001"),            # a status newer than this table
])
def test_status_becomes_exception(status, cls, name):
    e = cudnn.status_error(status, "cudnnConvolutionForward", "workspace too small")
    assert type(e) is cls and isinstance(e, RuntimeError)
    assert (e.status, e.name, e.category) == (status, name, status // 1000 * 1000)
    assert str(e) == f"cudnnConvolutionForward: {name} ({status}): workspace too small"
    assert isinstance(e, MemoryError) == (status in (4003, 4004))


def test_every_known_status_has_its_name():
    for status, name in cudnn.STATUS.items():
        if status:
            assert cudnn.status_error(status).name == name and name in str(cudnn.status_error(status))


def test_env_override_to_a_missing_file(fresh_load, monkeypatch, tmp_path):
    missing = str(tmp_path / "libcudnn.so.9")
    monkeypatch.setattr(config, "settings", replace(config.settings, cudnn=missing))
    assert cudnn.candidates() == [("$SNCAFFE_CUDNN", missing)]
    with pytest.raises(cudnn.CudnnNotFound, match=r"\$SNCAFFE_CUDNN points to .*libcudnn.so.9, which does not exist"):
        cudnn.load()
    assert not cudnn.available()
    with pytest.raises(cudnn.CudnnNotFound):
        cudnn.tensor((1, 2, 3, 4))


def test_env_override_to_a_file_that_is_no_library(fresh_load, monkeypatch, tmp_path):
    bad = tmp_path / "libcudnn.so.9"
    bad.write_bytes(b"not an ELF file")
    monkeypatch.setattr(config, "settings", replace(config.settings, cudnn=str(bad)))
    with pytest.raises(cudnn.CudnnNotFound, match=r"tried \$SNCAFFE_CUDNN: .*libcudnn.so.9.*sncaffe\[cuda12\]"):
        cudnn.load()


def test_discovery_order_wheel_then_system(fresh_load, monkeypatch, tmp_path):
    monkeypatch.setattr(config, "settings", replace(config.settings, cudnn=""))
    lib = tmp_path / "nvidia" / "cudnn" / "lib"
    lib.mkdir(parents=True)
    (lib / "libcudnn.so.9").write_bytes(b"")
    monkeypatch.setattr(cudnn, "_site_dirs", lambda: [str(tmp_path / "elsewhere"), str(tmp_path)])
    found = cudnn.candidates()
    assert found[0] == ("nvidia-cudnn wheel", str(lib / "libcudnn.so.9"))
    assert found[1] == ("system loader", "libcudnn.so.9")
    assert all(where == "system loader" for where, _ in found[1:])


def test_nothing_loads_lists_what_was_tried(fresh_load, monkeypatch, tmp_path):
    bad = tmp_path / "libcudnn.so.9"
    bad.write_bytes(b"")
    monkeypatch.setattr(cudnn, "candidates", lambda: [("nvidia-cudnn wheel", str(bad)),
                                                      ("system loader", "libcudnn_absent_for_test.so.9")])
    with pytest.raises(cudnn.CudnnNotFound) as info:
        cudnn.load()
    text = str(info.value)
    assert text.index(str(bad)) < text.index("libcudnn_absent_for_test.so.9")
    assert "pip install 'sncaffe[cuda13]'" in text


def _caffe_pool_1d(x, kernel, pad, stride, out, method):
    """Caffe's pooling loops (pooling_layer.cpp) along one axis; its 0/0 of an empty AVE window read as 0."""
    size, res = len(x), []
    for j in range(out):
        hstart = j * stride - pad
        hend = min(hstart + kernel, size + pad)
        pool_size = hend - hstart
        hstart, hend = max(hstart, 0), min(hend, size)
        if method == "max":
            res.append(max(x[hstart:hend], default=-FLT_MAX))
        else:
            res.append(sum(x[hstart:hend]) / pool_size if pool_size > 0 else 0.0)
    return np.array(res)


def _cudnn_recipe_1d(x, g, kernel, stride, method):
    """cuDNN's floor pooling, symmetric pad, on the input padded by ``extra`` after the end; AVE scaled."""
    fill = -FLT_MAX if method == "max" else 0.0
    xp = np.concatenate([[fill] * g.pad, x, [fill] * g.pad_end])
    assert (len(xp) - kernel) // stride + 1 == g.out            # cuDNN's own formula gives Caffe's size
    win = [xp[j * stride:j * stride + kernel] for j in range(g.out)]
    if method == "max":
        return np.array([w.max() for w in win])
    return np.array([w.sum() / kernel for w in win]) * np.array(g.scale)


def test_caffe_pool_geometry_reproduces_caffe():
    rng = np.random.default_rng(0)
    checked = 0
    for size, kernel, stride in itertools.product(range(1, 13), range(1, 6), range(1, 5)):
        for pad in range(kernel):
            for padded in {bool(pad), True}:            # padded: the other axis may carry the padding
                if size + 2 * pad < kernel:
                    continue
                g = cudnn.caffe_pool_geometry(size, kernel, pad, stride, padded)
                assert g.out == pooled_size(size, kernel, stride, pad, True, padded)   # the CPU layer's
                assert g.pad == pad and g.pad_end >= pad and g.extra == g.pad_end - pad
                x = rng.standard_normal(size)
                for method in ("max", "ave"):
                    np.testing.assert_allclose(_cudnn_recipe_1d(x, g, kernel, stride, method),
                                               _caffe_pool_1d(x, kernel, pad, stride, g.out, method),
                                               rtol=1e-12, atol=1e-12)
                checked += 1
    assert checked > 700


def test_fastest_takes_the_quickest_that_runs_and_fits():
    algos = [cudnn.Algorithm(1, "IMPLICIT_PRECOMP_GEMM", 0, 0.5, 100, True, "fma"),
             cudnn.Algorithm(6, "WINOGRAD", 0, 0.2, 10 ** 9, True, "fma"),
             cudnn.Algorithm(4, "FFT", 3000, 0.1, 0, True, "fma")]            # does not run: skipped
    assert cudnn.fastest(algos).algo == 6
    assert cudnn.fastest(algos, workspace_limit=1000).algo == 1
    heuristic = [a._replace(time=-1.0) for a in algos]                        # _v7 order is the ranking
    assert cudnn.fastest(heuristic, 1000).algo == 1
    with pytest.raises(cudnn.CudnnNotSupported, match="within 10 bytes"):
        cudnn.fastest(algos, workspace_limit=10)


def test_caffe_pooled_size_examples():
    assert cudnn.caffe_pooled_size(112, 3, 0, 2) == 56       # ResNet/GoogLeNet: ceil, where cuDNN gives 55
    assert cudnn.caffe_pool_geometry(112, 3, 0, 2).extra == 1
    assert cudnn.caffe_pooled_size(7, 3, 1, 2) == 4 and cudnn.caffe_pool_geometry(7, 3, 1, 2).extra == 0
    assert cudnn.caffe_pooled_size(6, 2, 1, 2) == 4 and cudnn.caffe_pool_geometry(6, 2, 1, 2).extra == 0


# -- the library, no GPU needed ---------------------------------------------------------

@needs_cudnn
def test_library_is_version_9():
    assert cudnn.version()[0] == 9
    path = cudnn.library_path()
    assert os.path.exists(path) or path.startswith("libcudnn")


@needs_cudnn
@pytest.mark.parametrize("shape, pad, stride, dilation, groups, kernel", [
    ((2, 3, 5, 7), 1, 2, 1, 1, (4, 3, 3, 3)),
    ((2, 4, 9, 8), (0, 1), (1, 2), (2, 1), 2, (6, 2, 3, 3)),
    ((1, 6, 224, 224), 3, 2, 1, 1, (64, 6, 7, 7)),
    ((3, 8, 10, 10), 2, 1, 2, 8, (8, 1, 3, 3)),              # depthwise, dilated
])
def test_conv_output_shape_is_caffes(shape, pad, stride, dilation, groups, kernel):
    pad, stride, dilation = (cudnn._pair(v) for v in (pad, stride, dilation))
    x, w = cudnn.tensor(shape), cudnn.FilterDesc(kernel)
    conv = cudnn.ConvDesc(pad, stride, dilation, groups)
    hw = [(shape[2 + i] + 2 * pad[i] - (dilation[i] * (kernel[2 + i] - 1) + 1)) // stride[i] + 1 for i in (0, 1)]
    assert cudnn.conv_output_shape(conv, x, w) == (shape[0], kernel[0], *hw)


@needs_cudnn
def test_pooling_with_the_caffe_geometry_gives_caffes_size():
    for (h, w), kernel, pad, stride in [((112, 112), 3, 0, 2), ((7, 9), 3, 1, 2), ((13, 13), 3, 0, 2),
                                        ((6, 5), 2, 1, 2), ((10, 11), 5, 2, 3)]:
        gh, gw = (cudnn.caffe_pool_geometry(n, kernel, pad, stride, bool(pad)) for n in (h, w))
        for mode in ("max", "ave"):
            pool = cudnn.PoolingDesc(mode, kernel, pad, stride)
            assert cudnn.pooling_output_shape(pool, cudnn.tensor((2, 3, h + gh.extra, w + gw.extra))) \
                == (2, 3, gh.out, gw.out)
            assert cudnn.pooling_output_shape(pool, cudnn.tensor((2, 3, h, w)))[2:] == \
                ((h + 2 * pad - kernel) // stride + 1, (w + 2 * pad - kernel) // stride + 1)   # cuDNN floors


@needs_cudnn
def test_descriptors():
    t = cudnn.tensor((2, 3, 4, 5))
    assert cudnn.tensor((2, 3, 4, 5)) is t and t.size_in_bytes() == 2 * 3 * 4 * 5 * 4
    assert cudnn.tensor((6, 10), np.float64).shape == (6, 10, 1, 1)
    assert cudnn.TensorDesc((2, 3, 4, 5, 6), np.float64).size_in_bytes() == 720 * 8
    assert cudnn.TensorDesc((2, 3, 4, 5), strides=(60, 1, 15, 3)).size_in_bytes() == 120 * 4   # NHWC
    assert cudnn.bn_param_desc(t).size_in_bytes() == 3 * 4
    assert cudnn.bn_param_desc(cudnn.tensor((2, 3, 4, 5), np.float64)).size_in_bytes() == 3 * 8
    assert cudnn.dropout_reserve_size(t) > 0
    for make in (lambda: cudnn.ActivationDesc("clipped_relu", 6.0), lambda: cudnn.LRNDesc(5, 1e-4, 0.75, 2.0),
                 lambda: cudnn.OpTensorDesc("mul", np.float64), lambda: cudnn.PoolingDesc("ave", (3, 2), 1, 2),
                 lambda: cudnn.ConvDesc(1, 1, math="default"), lambda: cudnn.FilterDesc((4, 2, 3, 3, 3))):
        d = make()
        assert d.ptr
        d.close()
        assert d.ptr is None
        d.close()                                              # twice is harmless


@needs_cudnn
def test_failed_calls_raise_with_cudnns_message():
    with pytest.raises(cudnn.CudnnError) as info:
        cudnn.TensorDesc((0, 3, 4, 5))
    e = info.value
    assert e.name == "CUDNN_STATUS_BAD_PARAM" and e.function == "cudnnSetTensor4dDescriptor"
    assert str(e).startswith("cudnnSetTensor4dDescriptor: CUDNN_STATUS_BAD_PARAM (2000)")
    with pytest.raises(cudnn.CudnnError, match="cudnnSetLRNDescriptor: CUDNN_STATUS_BAD_PARAM"):
        cudnn.LRNDesc(17, 1e-4, 0.75, 1.0)                     # cuDNN's window is at most 16
    with pytest.raises(TypeError, match="complex128"):
        cudnn.tensor((1, 2, 3, 4), np.complex128)


@needs_cudnn
def test_handle_without_a_gpu_is_a_cudnn_error():
    if GPU_REASON is None:
        pytest.skip("a GPU is present: the handle is created (tested below)")
    try:
        cudnn.Handle()
    except cudnn.CudnnError as e:
        assert e.function == "cudnnCreate" and e.name.startswith("CUDNN_STATUS_")


# -- on a GPU: every call against NumPy ---------------------------------------------------

@pytest.fixture(scope="module")
def gpu():
    import cupy
    cupy.cuda.Stream.null.use()                       # CuPy's arrays and cuDNN on one stream
    handle = cudnn.Handle(0)
    yield cupy, handle
    handle.close()


def _conv_ref(x, w, pad, stride, dil, groups):
    N, C, H, W = x.shape
    K, Cg, kh, kw = w.shape
    Kg = K // groups
    xp = np.pad(x, ((0, 0), (0, 0), (pad[0],) * 2, (pad[1],) * 2))
    Ho = (H + 2 * pad[0] - dil[0] * (kh - 1) - 1) // stride[0] + 1
    Wo = (W + 2 * pad[1] - dil[1] * (kw - 1) - 1) // stride[1] + 1
    y = np.zeros((N, K, Ho, Wo))
    for g, i, j in itertools.product(range(groups), range(kh), range(kw)):
        patch = xp[:, g * Cg:(g + 1) * Cg, i * dil[0]:i * dil[0] + stride[0] * (Ho - 1) + 1:stride[0],
                   j * dil[1]:j * dil[1] + stride[1] * (Wo - 1) + 1:stride[1]]
        y[:, g * Kg:(g + 1) * Kg] += np.einsum("nchw,kc->nkhw", patch, w[g * Kg:(g + 1) * Kg, :, i, j])
    return y


@needs_gpu
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("pad, stride, dil, groups", [((1, 1), (1, 1), (1, 1), 1), ((0, 2), (2, 1), (1, 2), 2),
                                                      ((1, 1), (2, 2), (1, 1), 4)])
def test_convolution(gpu, dtype, pad, stride, dil, groups):
    cp, h = gpu
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 4, 9, 8))
    w = rng.standard_normal((8, 4 // groups, 3, 3))
    y_ref = _conv_ref(x, w, pad, stride, dil, groups)
    xd, wd = cudnn.tensor(x.shape, dtype), cudnn.FilterDesc(w.shape, dtype)
    conv = cudnn.ConvDesc(pad, stride, dil, groups, dtype)
    assert cudnn.conv_output_shape(conv, xd, wd) == y_ref.shape
    yd = cudnn.tensor(y_ref.shape, dtype)
    gx, gw, gy = (cp.asarray(a, dtype) for a in (x, w, np.zeros_like(y_ref)))
    ws = cp.zeros(64 << 20, np.uint8)
    algos = cudnn.find_forward_algorithms(h, xd, gx, wd, gw, conv, yd, gy, ws, ws.nbytes)
    assert algos and all(isinstance(a.memory, int) and a.name for a in algos)
    best = cudnn.fastest(algos, ws.nbytes)
    assert best.status == 0 and best.memory <= ws.nbytes and best.time >= 0
    assert cudnn.fastest(cudnn.get_forward_algorithms(h, xd, wd, conv, yd)).status == 0
    size = cudnn.forward_workspace_size(h, xd, wd, conv, yd, best.algo)
    cudnn.convolution_forward(h, xd, gx, wd, gw, conv, best.algo, ws, size, yd, gy)
    tol = dict(rtol=1e-10, atol=1e-10) if dtype == np.float64 else dict(rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(gy.get(), y_ref, **tol)

    dy = rng.standard_normal(y_ref.shape)
    gdy, gdx, gdw = cp.asarray(dy, dtype), cp.zeros(x.shape, dtype), cp.full(w.shape, 0.5, dtype)
    a = cudnn.fastest(cudnn.find_backward_data_algorithms(h, wd, gw, yd, gdy, conv, xd, gdx, ws, ws.nbytes),
                      ws.nbytes)
    assert cudnn.backward_data_workspace_size(h, wd, yd, conv, xd, a.algo) >= 0
    cudnn.convolution_backward_data(h, wd, gw, yd, gdy, conv, a.algo, ws, ws.nbytes, xd, gdx)
    scratch = cp.zeros(w.shape, dtype)
    a = cudnn.fastest(cudnn.find_backward_filter_algorithms(h, xd, gx, yd, gdy, conv, wd, scratch, ws, ws.nbytes),
                      ws.nbytes)
    assert cudnn.get_backward_filter_algorithms(h, xd, yd, conv, wd)
    assert cudnn.get_backward_data_algorithms(h, wd, yd, conv, xd)
    cudnn.convolution_backward_filter(h, xd, gx, yd, gdy, conv, a.algo, ws, ws.nbytes, wd, gdw)   # accumulates
    # conv is linear in x and in w: <conv(x, w), dy> = <x, dx> = <w, dw>
    lhs = float((y_ref * dy).sum())
    assert math.isclose(float((x * gdx.get()).sum()), lhs, rel_tol=tol["rtol"] * 10, abs_tol=1e-3)
    assert math.isclose(float((w * (gdw.get() - 0.5)).sum()), lhs, rel_tol=tol["rtol"] * 10, abs_tol=1e-3)
    db = cp.ones((1, 8, 1, 1), dtype)
    cudnn.convolution_backward_bias(h, yd, gdy, cudnn.tensor((1, 8, 1, 1), dtype), db)
    np.testing.assert_allclose(db.get().ravel(), 1 + dy.sum(axis=(0, 2, 3)), **tol)


@needs_gpu
def test_pooling_caffe_recipe(gpu):
    cp, h = gpu
    rng = np.random.default_rng(2)
    H, W, k, pad, s = 9, 8, 3, 1, 2
    x = rng.standard_normal((2, 3, H, W))
    gh, gw = (cudnn.caffe_pool_geometry(n, k, pad, s) for n in (H, W))
    for mode, fill in (("max", -FLT_MAX), ("ave", 0.0)):
        xpad = np.full((2, 3, H + gh.extra, W + gw.extra), fill)
        xpad[:, :, :H, :W] = x
        xd, yd = cudnn.tensor(xpad.shape, np.float64), cudnn.tensor((2, 3, gh.out, gw.out), np.float64)
        pool = cudnn.PoolingDesc(mode, k, pad, s)
        gx, gy = cp.asarray(xpad), cp.zeros((2, 3, gh.out, gw.out))
        cudnn.pooling_forward(h, pool, xd, gx, yd, gy)
        y = gy.get() * (np.outer(gh.scale, gw.scale) if mode == "ave" else 1)
        ref = np.empty_like(y)
        for i, j in itertools.product(range(gh.out), range(gw.out)):   # Caffe's 2-d loops
            h0, w0 = i * s - pad, j * s - pad
            h1, w1 = min(h0 + k, H + pad), min(w0 + k, W + pad)
            win = x[:, :, max(h0, 0):min(h1, H), max(w0, 0):min(w1, W)]
            ref[:, :, i, j] = win.max(axis=(2, 3)) if mode == "max" else win.sum(axis=(2, 3)) / ((h1 - h0) * (w1 - w0))
        np.testing.assert_allclose(y, ref, rtol=1e-12, atol=1e-12)
        dy = rng.standard_normal(y.shape)
        gdx = cp.zeros_like(gx)
        cudnn.pooling_backward(h, pool, yd, gy, yd, cp.asarray(dy), xd, gx, xd, gdx)
        # linear (AVE) or piecewise linear (MAX): <pool(x), dy> = <x, dx>
        assert math.isclose(float((gy.get() * dy).sum()), float((xpad * gdx.get()).sum()), rel_tol=1e-9)


@needs_gpu
@pytest.mark.parametrize("mode, coef, f, df", [
    ("relu", 0.0, lambda x: np.maximum(x, 0), lambda x, y: (x > 0) * 1.0),
    ("sigmoid", 0.0, lambda x: 1 / (1 + np.exp(-x)), lambda x, y: y * (1 - y)),
    ("tanh", 0.0, np.tanh, lambda x, y: 1 - y * y),
    ("elu", 0.7, lambda x: np.where(x > 0, x, 0.7 * np.expm1(x)), lambda x, y: np.where(x > 0, 1, y + 0.7)),
    ("clipped_relu", 1.5, lambda x: np.clip(x, 0, 1.5), lambda x, y: ((x > 0) & (x < 1.5)) * 1.0),
])
def test_activation(gpu, mode, coef, f, df):
    cp, h = gpu
    x = np.random.default_rng(3).standard_normal((2, 3, 4, 5)) * 2
    dy = np.random.default_rng(4).standard_normal(x.shape)
    d, act = cudnn.tensor(x.shape, np.float64), cudnn.ActivationDesc(mode, coef)
    gx, gy, gdx = cp.asarray(x), cp.zeros(x.shape), cp.zeros(x.shape)
    cudnn.activation_forward(h, act, d, gx, d, gy)
    np.testing.assert_allclose(gy.get(), f(x), rtol=1e-10, atol=1e-12)
    cudnn.activation_backward(h, act, d, gy, d, cp.asarray(dy), d, gx, d, gdx)
    np.testing.assert_allclose(gdx.get(), dy * df(x, f(x)), rtol=1e-10, atol=1e-12)


@needs_gpu
def test_softmax(gpu):
    cp, h = gpu
    x = np.random.default_rng(5).standard_normal((2, 5, 3, 1)) * 30          # large: needs the max subtracted
    dy = np.random.default_rng(6).standard_normal(x.shape)
    d = cudnn.tensor(x.shape, np.float64)
    gy, gdx = cp.zeros(x.shape), cp.zeros(x.shape)
    cudnn.softmax_forward(h, d, cp.asarray(x), d, gy)
    e = np.exp(x - x.max(axis=1, keepdims=True))
    y = e / e.sum(axis=1, keepdims=True)
    np.testing.assert_allclose(gy.get(), y, rtol=1e-12, atol=1e-15)
    cudnn.softmax_backward(h, d, gy, d, cp.asarray(dy), d, gdx)
    np.testing.assert_allclose(gdx.get(), y * (dy - (dy * y).sum(axis=1, keepdims=True)), rtol=1e-10, atol=1e-14)


def _directional(f, x, v, eps=1e-6):
    return (f(x + eps * v) - f(x - eps * v)) / (2 * eps)


@needs_gpu
def test_lrn(gpu):
    cp, h = gpu
    n, alpha, beta, k = 5, 1e-1, 0.75, 2.0
    rng = np.random.default_rng(7)
    x, dy, v = (rng.standard_normal((2, 7, 3, 4)) for _ in range(3))
    d, lrn = cudnn.tensor(x.shape, np.float64), cudnn.LRNDesc(n, alpha, beta, k)

    def ref(x):                                       # Caffe's ACROSS_CHANNELS
        sq = np.pad(x * x, ((0, 0), (n // 2, n // 2), (0, 0), (0, 0)))
        s = sum(sq[:, i:i + x.shape[1]] for i in range(n))
        return x / (k + alpha / n * s) ** beta

    def run(x):
        gy = cp.zeros(x.shape)
        cudnn.lrn_forward(h, lrn, d, cp.asarray(x), d, gy)
        return gy.get()

    np.testing.assert_allclose(run(x), ref(x), rtol=1e-10)
    gy, gdx = cp.asarray(run(x)), cp.zeros(x.shape)
    cudnn.lrn_backward(h, lrn, d, gy, d, cp.asarray(dy), d, cp.asarray(x), d, gdx)
    assert math.isclose((gdx.get() * v).sum(), (dy * _directional(ref, x, v)).sum(), rel_tol=1e-6)


@needs_gpu
def test_batch_norm(gpu):
    cp, h = gpu
    rng = np.random.default_rng(8)
    x, dy, v = (rng.standard_normal((4, 3, 5, 2)) * 3 + 1 for _ in range(3))
    eps, C, m = 1e-5, 3, 4 * 5 * 2
    d = cudnn.tensor(x.shape, np.float64)
    pd = cudnn.bn_param_desc(d)
    ones, zeros = cp.ones(C), cp.zeros(C)
    mean, var, save_mean, save_inv = (cp.zeros(C) for _ in range(4))

    def ref(x):
        mu, s2 = x.mean(axis=(0, 2, 3), keepdims=True), x.var(axis=(0, 2, 3), keepdims=True)
        return (x - mu) / np.sqrt(s2 + eps)

    def run(x):
        gy = cp.zeros(x.shape)
        cudnn.batch_norm_forward_training(h, d, cp.asarray(x), d, gy, pd, ones, zeros, 1.0, mean, var, eps,
                                          save_mean, save_inv)
        return gy.get()

    np.testing.assert_allclose(run(x), ref(x), rtol=1e-9, atol=1e-10)
    # factor 1: the running buffers receive the batch mean and the unbiased variance (Caffe's blob update input)
    np.testing.assert_allclose(mean.get(), x.mean(axis=(0, 2, 3)), rtol=1e-12)
    np.testing.assert_allclose(var.get(), x.var(axis=(0, 2, 3)) * m / (m - 1), rtol=1e-9)
    np.testing.assert_allclose(save_inv.get(), 1 / np.sqrt(x.var(axis=(0, 2, 3)) + eps), rtol=1e-9)
    gdx, dscale, dbias = cp.zeros(x.shape), cp.zeros(C), cp.zeros(C)
    cudnn.batch_norm_backward(h, d, cp.asarray(x), d, cp.asarray(dy), d, gdx, pd, ones, dscale, dbias, eps,
                              save_mean, save_inv)
    assert math.isclose((gdx.get() * v).sum(), (dy * _directional(ref, x, v)).sum(), rel_tol=1e-6)
    np.testing.assert_allclose(dbias.get(), dy.sum(axis=(0, 2, 3)), rtol=1e-10)
    gy = cp.zeros(x.shape)
    cudnn.batch_norm_forward_inference(h, d, cp.asarray(x), d, gy, pd, ones, zeros, mean, var, eps)
    mu, s2 = x.mean(axis=(0, 2, 3), keepdims=True), x.var(axis=(0, 2, 3), keepdims=True) * m / (m - 1)
    np.testing.assert_allclose(gy.get(), (x - mu) / np.sqrt(s2 + eps), rtol=1e-9, atol=1e-10)


@needs_gpu
def test_dropout(gpu):
    cp, h = gpu
    ratio, shape = 0.3, (64, 32, 8, 8)
    d = cudnn.tensor(shape)
    states = cp.zeros(cudnn.dropout_states_size(h), np.uint8)
    drop = cudnn.DropoutDesc(h, ratio, states, states.nbytes, seed=5)
    reserve = cp.zeros(cudnn.dropout_reserve_size(d), np.uint8)
    x, y, dx = cp.ones(shape, np.float32), cp.zeros(shape, np.float32), cp.zeros(shape, np.float32)
    cudnn.dropout_forward(h, drop, d, x, d, y, reserve, reserve.nbytes)
    kept = y.get() != 0
    assert abs(1 - kept.mean() - ratio) < 0.01
    np.testing.assert_allclose(y.get()[kept], 1 / (1 - ratio), rtol=1e-6)
    cudnn.dropout_backward(h, drop, d, x * 2, d, dx, reserve, reserve.nbytes)
    np.testing.assert_array_equal(dx.get() != 0, kept)
    again = cudnn.DropoutDesc(h, ratio, states, states.nbytes, seed=5, restore=True)
    assert again.ratio == ratio


@needs_gpu
def test_tensor_arithmetic(gpu):
    cp, h = gpu
    rng = np.random.default_rng(9)
    a, c = rng.standard_normal((2, 3, 4, 5)), rng.standard_normal((2, 3, 4, 5))
    bias = rng.standard_normal((1, 3, 1, 1))
    d, bd = cudnn.tensor(a.shape, np.float64), cudnn.tensor(bias.shape, np.float64)
    gc = cp.asarray(c)
    cudnn.add_tensor(h, bd, cp.asarray(bias), d, gc, alpha=2.0, beta=1.0)
    np.testing.assert_allclose(gc.get(), c + 2 * bias, rtol=1e-12)
    out = cp.zeros(a.shape)
    cudnn.op_tensor(h, cudnn.OpTensorDesc("mul", np.float64), d, cp.asarray(a), bd, cp.asarray(bias), d, out,
                    alpha1=1.0, alpha2=3.0)
    np.testing.assert_allclose(out.get(), a * 3 * bias, rtol=1e-12)
    cudnn.scale_tensor(h, d, out, 0.5)
    np.testing.assert_allclose(out.get(), a * 1.5 * bias, rtol=1e-12)
    cudnn.set_tensor(h, d, out, 7.0)
    assert (out.get() == 7).all()
