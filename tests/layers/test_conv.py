"""Convolution and Deconvolution: forward against direct loops, numerical gradients,
every kernel layout, batch chunks, setting errors, and Caffe's golden cases."""
import numpy as np
import pytest

from conftest import needs_shared
from golden import run_golden_layer
from sncaffe.gradcheck import Harness, check_gradient, make_layer
from sncaffe.layers.base import LayerError

# (bottom shape, num_output, convolution_param fields); list values repeat the field
CASES = [
    ((2, 3, 7, 6), 4, dict(kernel_size=3)),
    ((2, 3, 7, 6), 4, dict(kernel_size=3, pad=1)),
    ((2, 4, 9, 8), 6, dict(kernel_size=3, stride=2, pad=1)),
    ((1, 6, 9, 9), 6, dict(kernel_size=3, stride=2, pad=1, dilation=2, group=3)),
    ((2, 3, 8, 7), 4, dict(kernel_h=3, kernel_w=2, stride_h=1, stride_w=2, pad_h=0, pad_w=1, bias_term=False)),
    ((2, 5, 6, 6), 3, dict(kernel_size=1)),
    ((2, 5, 7, 7), 3, dict(kernel_size=1, stride=2)),
    ((2, 4, 6, 6), 4, dict(kernel_size=1, group=2, bias_term=False)),
    ((1, 3, 5, 5), 2, dict(kernel_size=1, pad=1)),
    ((2, 2, 11, 10), 3, dict(kernel_size=5, stride=3, pad=2)),
    ((1, 3, 9, 9), 2, dict(kernel_size=2, stride=3)),            # stride > kernel: unread pixels
    ((1, 2, 4, 4), 2, dict(kernel_size=[3, 2], pad=[2, 0], stride=[1, 2], dilation=[1, 2])),
    ((1, 2, 3, 3), 2, dict(kernel_size=3, pad=3)),               # pad > kernel extent - 1
    ((1, 4, 6, 5), 4, dict(kernel_size=2, stride=2, pad=1, group=2)),
    ((1, 2, 4, 3), 128, dict(kernel_size=3, pad=1, bias_term=False)),   # wide: the direct col filter GEMM
]
# the forms of im2col.ConvPlan: per image or batched, per tap or column matrix (always batched;
# col_bytes=1: one image per block), stride-1 backward-data by the flipped kernel or by scatter-add,
# the weight gradient per tap or by a column matrix under a per-tap forward; batched per-tap with a
# flipped backward-data packs dy once where the geometry allows (ConvPlan.lead)
LAYOUTS = [dict(batched=False, col=False, flip=True), dict(batched=True, col=False, flip=False, col_filter=False),
           dict(col=True, flip=True), dict(col=True, col_bytes=1, flip=False),
           dict(batched=True, col=False, col_filter=True, flip=False),
           dict(batched=True, col=False, col_filter=True, col_bytes=1, flip=True),
           dict(batched=True, col=False, col_filter=False, flip=True)]
LAYOUT_IDS = ["image-taps-flip", "batch-taps-scatter", "col-flip", "col-blocks-scatter",
              "taps-colfilter-scatter", "taps-colfilter-blocks-flip", "batch-taps-flip"]


def _text(kind, M, kw):
    parts = [f"{k}: {str(x).lower() if isinstance(x, bool) else x}"
             for k, v in kw.items() for x in (v if isinstance(v, list) else [v])]
    return f'type: "{kind}" convolution_param {{ num_output: {M} {" ".join(parts)} }}'


def _geometry(kw):
    def pair(name, default):
        if f"{name}_h" in kw:
            return kw[f"{name}_h"], kw[f"{name}_w"]
        v = kw.get(name, default)
        return tuple(v) if isinstance(v, list) else (v, v)
    return dict(stride=pair("stride", 1), pad=pair("pad", 0), dilation=pair("dilation", 1),
                group=kw.get("group", 1))


def _layer(kind, M, kw, layout=None, **attrs):
    layer = make_layer(_text(kind, M, kw))
    layer.plan_options = layout or {}
    for k, v in attrs.items():
        setattr(layer, k, v)
    return layer


def naive_conv(x, w, b, stride, pad, dilation, group):
    """Caffe's convolution by direct loops over the output (float64)."""
    N, C, H, W = x.shape
    M, Cg, kh, kw = w.shape
    (sh, sw), (ph, pw), (dh, dw) = stride, pad, dilation
    Ho, Wo = (H + 2 * ph - dh * (kh - 1) - 1) // sh + 1, (W + 2 * pw - dw * (kw - 1) - 1) // sw + 1
    xp = np.zeros((N, C, H + 2 * ph, W + 2 * pw))
    xp[:, :, ph:ph + H, pw:pw + W] = x
    y = np.zeros((N, M, Ho, Wo))
    Mg = M // group
    for m in range(M):
        g = m // Mg
        for oh in range(Ho):
            for ow in range(Wo):
                patch = xp[:, g * Cg:(g + 1) * Cg, oh * sh:oh * sh + dh * (kh - 1) + 1:dh,
                           ow * sw:ow * sw + dw * (kw - 1) + 1:dw]
                y[:, m, oh, ow] = np.tensordot(patch, w[m], axes=3)
    return y if b is None else y + b.reshape(-1, 1, 1)


def naive_deconv(x, w, b, stride, pad, dilation, group):
    """Caffe's deconvolution: every input pixel scattered through the kernel, then cropped."""
    N, C, H, W = x.shape
    _, Mg, kh, kw = w.shape
    (sh, sw), (ph, pw), (dh, dw) = stride, pad, dilation
    Ho, Wo = sh * (H - 1) + dh * (kh - 1) + 1, sw * (W - 1) + dw * (kw - 1) + 1
    y = np.zeros((N, Mg * group, Ho, Wo))
    Cg = C // group
    for c in range(C):
        g = c // Cg
        for h in range(H):
            for v in range(W):
                y[:, g * Mg:(g + 1) * Mg, h * sh:h * sh + dh * (kh - 1) + 1:dh,
                  v * sw:v * sw + dw * (kw - 1) + 1:dw] += x[:, c, h, v, None, None, None] * w[c]
    y = y[:, :, ph:Ho - ph, pw:Wo - pw]
    return y if b is None else y + b.reshape(-1, 1, 1)


def _deconv_ok(shape, kw):
    g = _geometry(kw)
    k = kw.get("kernel_size", (kw.get("kernel_h"), kw.get("kernel_w")))
    k = k if isinstance(k, (list, tuple)) else (k, k)
    return all(s * (n - 1) + d * (kk - 1) + 1 - 2 * p >= 1
               for n, s, d, kk, p in zip(shape[2:], g["stride"], g["dilation"], k, g["pad"]))


DECONV_CASES = [c for c in CASES if _deconv_ok(c[0], c[2])]


@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
@pytest.mark.parametrize("kind,shape,M,kw", [("Convolution",) + c for c in CASES]
                         + [("Deconvolution",) + c for c in DECONV_CASES])
def test_forward_matches_direct_loop(kind, shape, M, kw, layout):
    layer = _layer(kind, M, kw, layout)
    x = np.random.default_rng(1).standard_normal(shape)
    y = Harness(layer, [x]).forward()[0]
    w, b = layer.blobs[0].data, (layer.blobs[1].data if len(layer.blobs) > 1 else None)
    ref = (naive_deconv if kind == "Deconvolution" else naive_conv)(x, w, b, **_geometry(kw))
    assert y.shape == ref.shape
    np.testing.assert_allclose(y, ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
@pytest.mark.parametrize("shape,M,kw", CASES)
def test_convolution_gradient(shape, M, kw, layout):
    check_gradient(_layer("Convolution", M, kw, layout), [np.random.default_rng(2).standard_normal(shape)],
                   max_probes=60)


@pytest.mark.parametrize("layout", LAYOUTS[:2], ids=LAYOUT_IDS[:2])
@pytest.mark.parametrize("shape,M,kw", DECONV_CASES)
def test_deconvolution_gradient(shape, M, kw, layout):
    check_gradient(_layer("Deconvolution", M, kw, layout), [np.random.default_rng(3).standard_normal(shape)],
                   max_probes=60)


@pytest.mark.parametrize("stride", [1, 2])
@pytest.mark.parametrize("kind", ["Convolution", "Deconvolution"])
@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
def test_chunks_and_float32(kind, layout, stride):
    """Batch chunks of 2 (last chunk 1) and float32 give the whole-batch float64 result."""
    kw = dict(kernel_size=3, stride=stride, pad=1, group=2)
    x = np.random.default_rng(4).standard_normal((5, 4, 7, 6))
    ref = Harness(_layer(kind, 6, kw, layout), [x])
    outs = []
    for dtype, chunk in ((np.float64, 2), (np.float32, None)):
        h = Harness(_layer(kind, 6, kw, dict(layout, reduce_block=2), chunk=chunk), [x], dtype=dtype,
                    params=[b.data for b in ref.layer.blobs])
        y = h.forward()[0]
        outs.append((y, h.backward([np.ones_like(y) * 0.5 + np.arange(y.size).reshape(y.shape) % 3])))
    y0 = ref.forward()[0]
    grads0 = ref.backward([np.ones_like(y0) * 0.5 + np.arange(y0.size).reshape(y0.shape) % 3])
    for (y, (bd, pd)), tol in zip(outs, (1e-12, 1e-4)):
        np.testing.assert_allclose(y, y0, rtol=tol, atol=tol)
        for a, e in zip(bd + pd, grads0[0] + grads0[1]):
            np.testing.assert_allclose(a, e, rtol=tol, atol=tol * 10)


def _pass_bits(layer, x, dy, params):
    """Bytes of top, bottom diff and parameter diffs after one forward and backward (float32)."""
    h = Harness(layer, [x], dtype=np.float32, params=params)
    y = h.forward()[0]
    (dx,), dparams = h.backward([dy.astype(np.float32)])
    return [a.tobytes() for a in [y, dx] + list(dparams)]


@pytest.mark.parametrize("kind", ["Convolution", "Deconvolution"])
@pytest.mark.parametrize("layout", LAYOUTS + [{}], ids=LAYOUT_IDS + ["chosen"])
def test_chunks_of_reduction_blocks_give_the_whole_batch_bits(kind, layout):
    """The chunk contract (conv.py): chunks that are multiples of reduce_block give the bits of
    the whole batch in one pass, in every layout, forward and backward; other chunks are refused."""
    kw = dict(kernel_size=3, stride=1, pad=1, group=2)
    rng = np.random.default_rng(6)
    x = rng.standard_normal((7, 4, 9, 8)).astype(np.float32)
    layout = dict(layout, reduce_block=2) if layout else {}
    ref = _layer(kind, 6, kw, layout)
    whole = Harness(ref, [x], dtype=np.float32)
    params = [b.data.copy() for b in ref.blobs]
    dy = rng.standard_normal(whole.forward()[0].shape)
    expected = _pass_bits(_layer(kind, 6, kw, layout), x, dy, params)
    block = ref.reduce_block
    assert list(ref.chunk_sizes(7)) == list(range(block, 7, block))
    for chunk in ref.chunk_sizes(7):
        assert _pass_bits(_layer(kind, 6, kw, layout, chunk=chunk), x, dy, params) == expected, chunk
    if 1 < block < 6:
        with pytest.raises(LayerError, match="not a multiple of its reduction block"):
            _pass_bits(_layer(kind, 6, kw, layout, chunk=block + 1), x, dy, params)


def test_two_bottoms_share_weights_and_frozen_bias():
    layer = make_layer(_text("Convolution", 3, dict(kernel_size=3, pad=1)) +
                       " param { lr_mult: 1 } param { lr_mult: 0 }", n_bottoms=2, n_tops=2)
    rng = np.random.default_rng(5)
    h = check_gradient(layer, [rng.standard_normal((2, 2, 5, 5)), rng.standard_normal((2, 2, 5, 5))],
                       check_params=False, max_probes=40)
    ys = h.forward()
    w, b = layer.blobs[0].data, layer.blobs[1].data
    for x, y in zip(h.inputs, ys):
        np.testing.assert_allclose(y, naive_conv(x, w, b, (1, 1), (1, 1), (1, 1), 1), atol=1e-12)
    _, (dw, db) = h.backward([np.ones_like(y) for y in ys])
    assert not db.any()       # lr_mult 0: no bias gradient, as in Caffe
    assert dw.any()


@pytest.mark.parametrize("kind,shape,M,kw,message", [
    ("Convolution", (1, 3, 5, 5), 4, dict(kernel_size=3, group=2), "multiples of group"),
    ("Convolution", (1, 4, 5, 5), 3, dict(kernel_size=3, group=2), "multiples of group"),
    ("Convolution", (1, 3, 5, 5), 4, dict(kernel_size=0), "kernel size must be positive"),
    ("Convolution", (1, 3, 5, 5), 4, dict(kernel_h=3), "kernel size must be positive"),
    ("Convolution", (1, 3, 5, 5), 4, dict(kernel_size=3, stride=0), "stride must be positive"),
    ("Convolution", (1, 3, 5, 5), 4, dict(kernel_size=3, kernel_h=3, kernel_w=3), "not both"),
    ("Convolution", (1, 3, 5, 5), 4, dict(kernel_size=3, pad=1, pad_h=1), "not both"),
    ("Convolution", (1, 3, 5, 5), 4, dict(kernel_size=[3, 3, 3]), "1 or 2 values"),
    ("Convolution", (1, 3, 5, 5), 4, dict(kernel_size=7), "exceeds the padded input"),
    ("Convolution", (1, 3, 5, 5), 0, dict(kernel_size=3), "num_output"),
    ("Convolution", (1, 3, 5, 5, 5), 4, dict(kernel_size=[3, 3]), "1 or 3 values"),    # N-d: conv_nd.py
    ("Convolution", (1, 3, 5, 5), 4, dict(kernel_size=3, axis=2), "axis"),
    ("Deconvolution", (1, 3, 1, 1), 4, dict(kernel_size=1, pad=1), "output size"),
    # checked in setup, before an engine (oneDNN's primitive descriptors) is given the geometry
    ("Convolution", (1, 1, 4, 4), 2, dict(kernel_size=3, pad=2**31 - 1), r"\(1, 2, 4294967296, 4294967296\), .* 2\^31"),
    ("Deconvolution", (1, 1, 4, 4), 2, dict(kernel_size=3, stride=2**31 - 1), r"over 2\^31 - 1"),
])
def test_bad_settings_name_the_layer(kind, shape, M, kw, message):
    layer = make_layer(_text(kind, M, kw))
    with pytest.raises(LayerError, match=message) as err:
        layer.setup([shape])
    assert f'"{layer.name}"' in str(err.value)


# -- Caffe's own outputs ---------------------------------------------------------

@needs_shared
@pytest.mark.parametrize("case", ["conv_s2_p1_d2_g3", "conv_s2_p1_d2_g3_nobias", "conv_rect_nobias",
                                  "deconv_s2_p1_g3", "deconv_d2_nobias"])
@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
def test_golden(case, layout):
    run_golden_layer(case, attrs={"plan_options": layout})


@pytest.mark.parametrize("size,kernel,pad,dilation", [
    ((32, 32), (3, 3), (1, 1), (1, 1)), ((7, 9), (3, 3), (1, 1), (1, 1)), ((8, 8), (3, 5), (1, 2), (1, 1)),
    ((12, 10), (5, 5), (0, 0), (1, 1)), ((9, 9), (3, 3), (2, 2), (2, 2)), ((6, 11), (2, 2), (1, 0), (1, 1)),
    ((5, 5), (1, 3), (0, 1), (1, 1))])
def test_weight_gradient_grid_is_the_flipped_packed_dy(size, kernel, pad, dilation):
    """Where ConvPlan.lead is set, the weight gradient's grid of dy, as written into the flipped
    plan's rows, is exactly what the flipped plan packs from dy itself (so it is not packed twice)."""
    from sncaffe.layers.im2col import ConvPlan
    plan = ConvPlan(3, 4, 1, size, kernel, (1, 1), pad, dilation, batched=True, col=False,
                    col_filter=False, flip=True)
    assert plan.lead is not None, "these geometries share the packing"
    n = 3
    rng = np.random.default_rng(1)
    dy = rng.standard_normal((n, 4) + plan.out_shape).astype(np.float32)
    sizes = plan.workspace(n)
    ws = {k: np.full(v, np.nan, np.float32) for k, v in sizes.items()}
    _, rows = plan._flip_image_grid(dy, ws)
    assert np.shares_memory(rows, ws["grid"])
    L = plan.flip._rows(n)[1]
    mine = ws["grid"][:4 * L].reshape(1, 1, 4, L).copy()
    own = {k: np.full(v, np.nan, np.float32) for k, v in plan.flip.workspace(n).items()}
    np.testing.assert_array_equal(mine, plan.flip._image(dy, own))


def test_frozen_weights_with_shared_packing():
    """lr_mult 0 on the weights: backward-data alone, packing dy into the swapped buffers."""
    kw = dict(kernel_size=3, pad=1)
    layer = make_layer(_text("Convolution", 4, kw) + " param { lr_mult: 0 } param { lr_mult: 1 }")
    layer.plan_options = dict(batched=True, col=False, col_filter=False, flip=True)
    check_gradient(layer, [np.random.default_rng(2).standard_normal((2, 3, 6, 5))],
                       check_params=False, max_probes=30)
    assert layer.plan.lead is not None
    assert not np.any(layer.blobs[0].diff)
