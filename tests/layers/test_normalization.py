import h5py
import numpy as np
import pytest

from conftest import needs_shared
from golden import golden_case, golden_dir, run_golden_layer
from sncaffe.gradcheck import Harness, check_gradient, make_layer
from sncaffe.layers import LayerError
from sncaffe.layers.base import TEST, TRAIN


def randn(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape)


def f32(v):
    """A float proto field's value, as the layer sees it."""
    return float(np.float32(v))


# -- LRN -------------------------------------------------------------------------
def lrn_text(region="ACROSS_CHANNELS", **fields):
    body = " ".join(f"{k}: {v}" for k, v in fields.items())
    return f'type: "LRN" lrn_param {{ norm_region: {region} {body} }}'


def lrn_reference(x, region, local_size=5, alpha=1.0, beta=0.75, k=1.0):
    """Caffe's formulas, one output cell's window at a time."""
    N, C, H, W = x.shape
    alpha, beta, k = f32(alpha), f32(beta), f32(k)
    size, r = local_size, (local_size - 1) // 2
    scale = np.empty_like(x)
    for c in range(C):
        if region == "ACROSS_CHANNELS":
            window = x[:, max(0, c - r):c + r + 1] ** 2
            scale[:, c] = k + alpha / size * window.sum(axis=1)
            continue
        for h in range(H):
            for w in range(W):
                window = x[:, c, max(0, h - r):h + r + 1, max(0, w - r):w + r + 1] ** 2
                scale[:, c, h, w] = 1 + alpha / size ** 2 * window.sum(axis=(1, 2))   # k unused
    return x * scale ** -beta


LRN_SETTINGS = [
    ("ACROSS_CHANNELS", dict(local_size=3, alpha=0.2, beta=0.75, k=2)),
    ("ACROSS_CHANNELS", dict(local_size=5, alpha=1.5, beta=0.6)),        # window wider than C
    ("ACROSS_CHANNELS", dict(local_size=1, alpha=0.5, beta=1.3, k=0.5)),
    ("WITHIN_CHANNEL", dict(local_size=3, alpha=0.2, beta=0.75, k=2)),
    ("WITHIN_CHANNEL", dict(local_size=5, alpha=2.0, beta=0.5)),
]


@pytest.mark.parametrize("region,fields", LRN_SETTINGS)
def test_lrn_forward_matches_reference(region, fields):
    x = randn(2, 4, 5, 6)
    y = Harness(make_layer(lrn_text(region, **fields)), [x]).forward()[0]
    np.testing.assert_allclose(y, lrn_reference(x, region, **fields), rtol=1e-12)


@pytest.mark.parametrize("region,fields", LRN_SETTINGS)
def test_lrn_gradient(region, fields):
    check_gradient(make_layer(lrn_text(region, **fields)), [randn(2, 4, 5, 4, seed=1)])


@pytest.mark.parametrize("text,inplace,message", [
    (lrn_text(local_size=4), False, "odd"),
    (lrn_text(local_size=3), True, "in place"),
])
def test_lrn_bad_settings(text, inplace, message):
    with pytest.raises(LayerError, match=message):
        make_layer(text, inplace=inplace).setup([(1, 3, 4, 4)])


# -- BatchNorm -------------------------------------------------------------------
def bn_text(**fields):
    body = " ".join(f"{k}: {v}" for k, v in fields.items())
    return f'type: "BatchNorm" batch_norm_param {{ {body} }}'


def bn_stats(x):
    axes = (0,) + tuple(range(2, x.ndim))
    return x.mean(axis=axes), x.var(axis=axes), x.size // x.shape[1]


def channels(v, ndim):
    return v.reshape((1, -1) + (1,) * (ndim - 2))


SHAPES = [(4, 3, 3, 5), (6, 4), (3, 2, 7)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("inplace", [False, True])
def test_batchnorm_train_forward_and_stats(shape, inplace):
    x = 1.5 * randn(*shape) + 0.7
    layer = make_layer(bn_text(moving_average_fraction=0.9, eps=1e-4), inplace=inplace)
    h = Harness(layer, [x])
    assert not layer.use_global_stats and not layer.learnable
    mean, var, m = bn_stats(x)
    for step in range(2):
        y = h.forward()[0]
        np.testing.assert_allclose(y, (x - channels(mean, x.ndim)) / np.sqrt(channels(var, x.ndim) + f32(1e-4)),
                                   rtol=1e-12, atol=1e-12)
    # Two forwards on the same batch: each sum is (0.9 + 1) times one batch's statistic.
    np.testing.assert_allclose(layer.blobs[0].data, 1.9 * mean, rtol=1e-6)
    np.testing.assert_allclose(layer.blobs[1].data, 1.9 * var * m / (m - 1), rtol=1e-6)
    np.testing.assert_allclose(layer.blobs[2].data, [1.9], rtol=1e-6)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_batchnorm_per_image_sums_are_the_same_bits_for_any_batch_and_address(dtype):
    """Each (image, channel) sum of a training BatchNorm (forward: of x; backward: of dy and of
    dy * x_norm) comes out the same bits whatever the images beside it and wherever the rows lie
    in memory: what lets a replica's sums, added image after image, give one location's bits
    (parallel/sync_bn.py). Images [2, 5) of a batch of 6, alone, at every offset in memory,
    against the batch's rows."""
    from types import SimpleNamespace
    rng = np.random.default_rng(11)
    x, dy, xn = (rng.standard_normal((6, 5, 7, 9)).astype(dtype) for _ in range(3))

    def sums(layer, x, dy, xn):
        layer.sums([SimpleNamespace(data=x)])
        of_x = layer.scratch["partials"][0].copy()
        layer.scratch["x_norm"][...] = xn
        layer.grad_sums([SimpleNamespace(diff=dy)])
        return of_x, layer.scratch["partials"].copy()

    whole = make_layer(bn_text())
    Harness(whole, [x], dtype=dtype)
    of_x, of_dy = sums(whole, x, dy, xn)
    part = make_layer(bn_text())
    Harness(part, [x[2:5]], dtype=dtype)

    def placed(a, offset):          # a copy of ``a`` that starts ``offset`` bytes past a 64-byte line
        buf = np.empty(a.nbytes + 128, np.uint8)
        start = (-buf.ctypes.data) % 64 + offset
        out = buf[start:start + a.nbytes].view(dtype).reshape(a.shape)
        out[...] = a
        return out
    for offset in range(0, 64, np.dtype(dtype).itemsize):
        p_x, p_dy = sums(part, placed(x[2:5], offset), placed(dy[2:5], offset), xn[2:5])
        assert p_x.tobytes() == of_x[2:5].tobytes()
        assert p_dy.tobytes() == of_dy[:, 2:5].tobytes()


def test_batchnorm_recomputed_forward_leaves_stats():
    layer = make_layer(bn_text())
    h = Harness(layer, [randn(4, 3, 2, 2)])
    y = h.forward()[0]
    before = [b.data.copy() for b in layer.blobs]
    layer.forward(h.bottom, h.top, update_stats=False)
    np.testing.assert_array_equal(h.top[0].data, y)
    for b, old in zip(layer.blobs, before):
        np.testing.assert_array_equal(b.data, old)


@pytest.mark.parametrize("phase,fields,is_global", [
    (TRAIN, {}, False), (TEST, {}, True), (TRAIN, dict(use_global_stats="true"), True),
    (TEST, dict(use_global_stats="false"), False)])
def test_batchnorm_global_stats_default_follows_phase(phase, fields, is_global):
    layer = make_layer(bn_text(**fields), phase=phase)
    layer.setup([(2, 3, 4, 4)])
    assert layer.use_global_stats == is_global
    assert ("x_norm" in layer.scratch_specs) != is_global


@pytest.mark.parametrize("shape", SHAPES)
def test_batchnorm_global_forward(shape):
    x, C = randn(*shape), shape[1]
    params = [randn(C, seed=1), np.abs(randn(C, seed=2)) + 0.5, [2.5]]
    y = Harness(make_layer(bn_text(use_global_stats="true", eps=1e-3)), [x], params=params).forward()[0]
    mean, var = channels(params[0] / 2.5, x.ndim), channels(params[1] / 2.5, x.ndim)
    np.testing.assert_allclose(y, (x - mean) / np.sqrt(var + f32(1e-3)), rtol=1e-12)
    # A zero scale factor means zero mean and variance, as in Caffe.
    y0 = Harness(make_layer(bn_text(use_global_stats="true")), [x], params=params[:2] + [[0]]).forward()[0]
    np.testing.assert_allclose(y0, x / np.sqrt(f32(1e-5)), rtol=1e-12)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("use_global", [False, True])
def test_batchnorm_gradient(shape, inplace, use_global):
    C = shape[1]
    params = [randn(C, seed=1), np.abs(randn(C, seed=2)) + 0.5, [1.9]]
    layer = make_layer(bn_text(use_global_stats=str(use_global).lower()), inplace=inplace)
    check_gradient(layer, [1.5 * randn(*shape, seed=3) + 0.7], params=params)


def test_batchnorm_learnable_statistics_are_an_error():
    layer = make_layer('type: "BatchNorm" param { lr_mult: 0 } param { lr_mult: 1 }')
    with pytest.raises(LayerError, match="lr_mult"):
        layer.setup([(2, 3, 4, 4)])
    make_layer('type: "BatchNorm" param { lr_mult: 0 } param { lr_mult: 0 }').setup([(2, 3)])


# -- golden Caffe cases ------------------------------------------------------------
@needs_shared
@pytest.mark.parametrize("case", ["lrn_across", "lrn_within", "batchnorm_train", "batchnorm_global"])
def test_golden(case):
    run_golden_layer(case, check_param_data=True)   # BatchNorm: the running sums after this pass


@needs_shared
def test_golden_batchnorm_global_weights_from_two_train_forwards():
    """batchnorm_global's stored statistics are two TRAIN forwards (maf 0.999) from zero."""
    _, expected = golden_case("batchnorm_global")
    with h5py.File(golden_dir("batchnorm_global") / "make_weights_input.h5") as f:
        x = f["inputs/x"][()]
    layer = make_layer(bn_text(use_global_stats="false"))
    h = Harness(layer, [x], np.float32)
    h.forward()
    h.forward()
    for blob, want in zip(layer.blobs, expected):
        np.testing.assert_allclose(blob.data, want, rtol=1e-5, atol=1e-6)
