import itertools
import math

import numpy as np
import pytest

from conftest import needs_shared
from golden import run_golden_layer
from sncaffe.gradcheck import Harness, check_gradient, make_layer
from sncaffe.layers import LayerError
from sncaffe.layers.base import TEST


def pool_text(pool="MAX", **fields):
    body = " ".join(f"{k}: {v}" for k, v in fields.items())
    return f'type: "Pooling" pooling_param {{ pool: {pool} {body} }}'


def distinct(shape, seed=0):
    """Values with gaps far above the checker's eps, so no MAX window has a tie."""
    rng = np.random.default_rng(seed)
    return rng.permutation(math.prod(shape)).reshape(shape) * 0.1 - 3.0


def reference(x, pool, k, s, p, ceil=True):
    """Caffe's pooling loops, one window at a time: top, mask, and the backward map."""
    N, C, H, W = x.shape
    size = [(-(-(n + 2 * pp - kk) // ss) if ceil else (n + 2 * pp - kk) // ss) + 1
            for n, kk, ss, pp in zip((H, W), k, s, p)]
    if p[0] or p[1]:
        size = [o - 1 if (o - 1) * ss >= n + pp else o for o, n, ss, pp in zip(size, (H, W), s, p)]
    PH, PW = size
    top = np.zeros((N, C, PH, PW))
    mask = np.full((N, C, PH, PW), -1.0)
    windows = {}
    for ph, pw in itertools.product(range(PH), range(PW)):
        hs, ws = ph * s[0] - p[0], pw * s[1] - p[1]
        he, we = min(hs + k[0], H + p[0]), min(ws + k[1], W + p[1])
        pool_size = (he - hs) * (we - ws)
        hs, ws, he, we = max(hs, 0), max(ws, 0), min(he, H), min(we, W)
        win = x[:, :, hs:he, ws:we].reshape(N, C, -1)
        if win.size == 0:       # a window past the input (ceil rounding, stride > kernel)
            top[:, :, ph, pw] = -np.finfo(np.float32).max if pool == "MAX" else 0
        elif pool == "MAX":
            a = win.argmax(axis=2)
            top[:, :, ph, pw] = win.max(axis=2)
            mask[:, :, ph, pw] = (hs + a // (we - ws)) * W + ws + a % (we - ws)
        else:
            top[:, :, ph, pw] = win.sum(axis=2) / pool_size
        windows[ph, pw] = (hs, he, ws, we, pool_size)
    return top, mask, windows


def reference_backward(x, dy, pool, mask, windows):
    N, C, H, W = x.shape
    dx = np.zeros_like(x)
    for (ph, pw), (hs, he, ws, we, pool_size) in windows.items():
        if pool == "MAX":
            m = mask[:, :, ph, pw].astype(int)
            for n, c in itertools.product(range(N), range(C)):
                if m[n, c] >= 0:
                    dx[n, c, m[n, c] // W, m[n, c] % W] += dy[n, c, ph, pw]
        else:
            dx[:, :, hs:he, ws:we] += dy[:, :, ph, pw][:, :, None, None] / pool_size
    return dx


# (fields, input shape): overlapping, ceil overhang, padding, rectangular, floor,
# global, a kernel equal to the input; then two only for the reference test: a
# window past the input (its -FLT_MAX top swamps finite differences) and a
# kernel with more than 256 taps (slow to probe).
SETTINGS = [
    (dict(kernel_size=3, stride=2), (2, 3, 8, 8)),
    (dict(kernel_size=3, stride=2), (1, 2, 7, 9)),
    (dict(kernel_size=2, stride=2), (2, 2, 6, 6)),
    (dict(kernel_size=3, stride=1, pad=1), (1, 2, 5, 6)),
    (dict(kernel_size=3, stride=2, pad=1), (2, 2, 7, 7)),
    (dict(kernel_h=2, kernel_w=3, stride=2, pad=1), (1, 3, 5, 8)),
    (dict(kernel_h=3, kernel_w=2, stride_h=1, stride_w=2, pad_h=1, pad_w=0), (1, 2, 6, 5)),
    (dict(kernel_size=1, stride=3), (1, 2, 7, 7)),
    (dict(kernel_size=3, stride=2, round_mode="FLOOR"), (1, 2, 8, 8)),
    (dict(global_pooling="true"), (2, 3, 5, 7)),
    (dict(kernel_h=4, kernel_w=5, stride=2), (2, 2, 4, 5)),
]
REFERENCE_ONLY = [
    (dict(kernel_size=1, stride=3), (1, 2, 5, 5)),
    (dict(kernel_size=17, stride=1), (1, 1, 18, 18)),
]


def geometry(fields, shape):
    if fields.get("global_pooling"):
        return shape[2:], (1, 1), (0, 0)
    k = (fields.get("kernel_h", fields.get("kernel_size")), fields.get("kernel_w", fields.get("kernel_size")))
    s = (fields.get("stride_h", fields.get("stride", 1)), fields.get("stride_w", fields.get("stride", 1)))
    p = (fields.get("pad_h", fields.get("pad", 0)), fields.get("pad_w", fields.get("pad", 0)))
    return k, s, p


@pytest.mark.parametrize("pool", ["MAX", "AVE"])
@pytest.mark.parametrize("fields,shape", SETTINGS + REFERENCE_ONLY)
def test_forward_backward_match_reference(pool, fields, shape):
    x = distinct(shape)
    n_tops = 2 if pool == "MAX" else 1
    layer = make_layer(pool_text(pool, **fields), n_tops=n_tops)
    h = Harness(layer, [x])
    tops = h.forward()
    top, mask, windows = reference(x, pool, *geometry(fields, shape),
                                   ceil=fields.get("round_mode") != "FLOOR")
    np.testing.assert_allclose(tops[0], top, rtol=1e-12, atol=1e-12)
    if pool == "MAX":
        np.testing.assert_array_equal(tops[1], mask)
    dy = np.random.default_rng(1).standard_normal(top.shape)
    (dx,), _ = h.backward([dy] + [np.zeros_like(top)] * (n_tops - 1))
    np.testing.assert_allclose(dx, reference_backward(x, dy, pool, mask, windows), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("pool", ["MAX", "AVE"])
@pytest.mark.parametrize("fields,shape", SETTINGS)
def test_gradient(pool, fields, shape):
    check_gradient(make_layer(pool_text(pool, **fields)), [distinct(shape, seed=2)])


def test_max_first_maximum_wins_and_float32():
    # A tie: Caffe's strict > keeps the first cell in row-major window order.
    x = np.zeros((1, 1, 4, 4), np.float32)
    x[0, 0, 1, 0] = x[0, 0, 1, 1] = 5
    layer = make_layer(pool_text("MAX", kernel_size=2, stride=2), n_tops=2)
    h = Harness(layer, [x], np.float32)
    top, mask = h.forward()
    assert top.dtype == np.float32 and top[0, 0, 0, 0] == 5 and mask[0, 0, 0, 0] == 4
    assert layer.scratch["argmax"].dtype == np.uint8


def test_window_without_input_cells():
    # kernel 1 stride 3 on 5 rows: ceil gives a third window starting past the input.
    layer = make_layer(pool_text("MAX", kernel_size=1, stride=3), n_tops=2)
    h = Harness(layer, [distinct((1, 1, 5, 5))])
    top, mask = h.forward()
    assert top.shape == (1, 1, 3, 3)
    assert top[0, 0, 2, 0] == -np.finfo(np.float32).max and mask[0, 0, 2, 0] == -1
    ave = Harness(make_layer(pool_text("AVE", kernel_size=1, stride=3)), [distinct((1, 1, 5, 5))])
    assert ave.forward()[0][0, 0, 2, 0] == 0


# -- STOCHASTIC ---------------------------------------------------------------
def test_stochastic_train_picks_by_value():
    x = np.abs(distinct((2, 2, 7, 7))) + 0.1
    layer = make_layer(pool_text("STOCHASTIC", kernel_size=3, stride=2))
    h = Harness(layer, [x], seed=5)
    top = h.forward()[0]
    u = np.random.default_rng(5 + 1).random(top.shape)     # the Harness seeds layer.rng with seed + 1
    _, _, windows = reference(x, "AVE", (3, 3), (2, 2), (0, 0))
    for (ph, pw), (hs, he, ws, we, _) in windows.items():
        win = x[:, :, hs:he, ws:we].reshape(2, 2, -1)
        cum = np.cumsum(win, axis=2)      # Caffe: the first cell whose running sum reaches u * sum
        pick = np.argmax(cum >= (u[:, :, ph, pw] * cum[:, :, -1])[..., None], axis=2)
        np.testing.assert_array_equal(top[:, :, ph, pw], np.take_along_axis(win, pick[..., None], 2)[..., 0])
    check_gradient(layer, [x], seed=5)


def test_stochastic_test_is_weighted_average():
    x = np.tile(np.arange(36.0).reshape(6, 6), (1, 2, 1, 1))
    x[0, 1, :2, :2] = 0         # an all-zero window gives 0
    layer = make_layer(pool_text("STOCHASTIC", kernel_size=2, stride=2), phase=TEST)
    top = Harness(layer, [x]).forward()[0]
    win = x.reshape(1, 2, 3, 2, 3, 2).transpose(0, 1, 2, 4, 3, 5).reshape(1, 2, 3, 3, 4)
    total = win.sum(-1)
    expect = np.where(total > 0, (win ** 2).sum(-1) / np.where(total > 0, total, 1), 0)
    assert expect[0, 1, 0, 0] == 0
    np.testing.assert_allclose(top, expect)


# -- errors ---------------------------------------------------------------------
@pytest.mark.parametrize("text,n_tops,shape,message", [
    (pool_text("AVE", kernel_size=2), 2, (1, 1, 4, 4), "second top"),
    (pool_text("MAX", kernel_size=2, kernel_h=2, kernel_w=2), 1, (1, 1, 4, 4), "kernel_size"),
    (pool_text("MAX", kernel_h=2), 1, (1, 1, 4, 4), "kernel_size"),
    (pool_text("MAX", global_pooling="true", kernel_size=2), 1, (1, 1, 4, 4), "global_pooling"),
    (pool_text("MAX", global_pooling="true", stride=2), 1, (1, 1, 4, 4), "global_pooling"),
    (pool_text("MAX", kernel_size=2, pad_h=1), 1, (1, 1, 4, 4), "pad"),
    (pool_text("MAX", kernel_size=2, pad=2), 1, (1, 1, 4, 4), "pad"),
    (pool_text("STOCHASTIC", kernel_size=3, pad=1), 1, (1, 1, 4, 4), "pad"),
    (pool_text("MAX", kernel_size=6), 1, (1, 1, 4, 4), "does not fit"),
    (pool_text("MAX", kernel_size=2), 1, (1, 4, 4), "4 axes"),
])
def test_bad_settings_are_layer_errors(text, n_tops, shape, message):
    layer = make_layer(text, n_tops=n_tops)
    with pytest.raises(LayerError, match=message):
        layer.setup([shape])


# -- golden Caffe cases -----------------------------------------------------------
@needs_shared
@pytest.mark.parametrize("case", ["pool_max_ceil", "pool_max_pad_rect", "pool_max_mask", "pool_ave_ceil",
                                  "pool_ave_pad", "pool_ave_pad_rect", "pool_global_max", "pool_global_ave"])
def test_golden(case):
    run_golden_layer(case)
