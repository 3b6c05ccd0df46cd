"""Neuron layers: gradients (out of place and in place), NumPy references, golden Caffe cases, Dropout."""
import numpy as np
import pytest

from sncaffe.gradcheck import Harness, check_gradient, make_layer
from sncaffe.layers.base import TEST, TRAIN, Blob
from conftest import needs_shared
from golden import run_golden_layer

SHAPE = (2, 3, 4, 5)


def away_from_zero(seed, shape=SHAPE, margin=0.05):
    """Normal inputs kept |x| >= margin, so finite differences never straddle a kink."""
    x = np.random.default_rng(seed).standard_normal(shape)
    return np.where(np.abs(x) < margin, np.copysign(margin, x) + x, x)


def positive(seed, shape=SHAPE):
    return np.random.default_rng(seed).uniform(0.1, 2.0, shape)


def sigmoid(x):
    return 1 / (1 + np.exp(-x))


def leaky(x, a):
    return np.where(x > 0, x, a * x)


def elu(x, alpha):
    return np.where(x > 0, x, alpha * np.expm1(x))


# (layer text, input, float64 reference y = f(x), params or None)
CASES = {
    "relu": ('type: "ReLU"', away_from_zero, lambda x: np.maximum(x, 0)),
    "relu_leaky": ('type: "ReLU" relu_param { negative_slope: 0.1 }', away_from_zero, lambda x: leaky(x, 0.1)),
    "relu_negslope": ('type: "ReLU" relu_param { negative_slope: -0.3 }', away_from_zero,
                      lambda x: leaky(x, np.float32(-0.3))),
    "elu": ('type: "ELU"', away_from_zero, lambda x: elu(x, 1.0)),
    "elu_half": ('type: "ELU" elu_param { alpha: 0.5 }', away_from_zero, lambda x: elu(x, 0.5)),
    "elu_negalpha": ('type: "ELU" elu_param { alpha: -0.5 }', away_from_zero, lambda x: elu(x, -0.5)),
    "sigmoid": ('type: "Sigmoid"', away_from_zero, sigmoid),
    "tanh": ('type: "TanH"', away_from_zero, np.tanh),
    "absval": ('type: "AbsVal"', away_from_zero, np.abs),
    "power_default": ('type: "Power"', away_from_zero, lambda x: x),
    "power_linear": ('type: "Power" power_param { scale: -2 shift: 0.5 }', away_from_zero, lambda x: 0.5 - 2 * x),
    "power_zero": ('type: "Power" power_param { power: 0 scale: 3 shift: 2 }', away_from_zero,
                   lambda x: np.ones_like(x)),
    "power_scale0": ('type: "Power" power_param { power: 3 scale: 0 shift: 2 }', away_from_zero,
                     lambda x: np.full_like(x, 8.0)),
    "power_sq": ('type: "Power" power_param { power: 2 scale: 0.5 shift: 1 }', away_from_zero,
                 lambda x: (1 + 0.5 * x) ** 2),
    "power_sq_noshift": ('type: "Power" power_param { power: 2 scale: -1.5 }', away_from_zero,
                         lambda x: (1.5 * x) ** 2),
    "power_sqrt": ('type: "Power" power_param { power: 0.5 scale: 2 shift: 3 }', positive,
                   lambda x: np.sqrt(3 + 2 * x)),
    "power_cube_noshift": ('type: "Power" power_param { power: 3 scale: 0.7 }', away_from_zero,
                           lambda x: (np.float32(0.7) * x) ** 3),
    "power_recip_noshift": ('type: "Power" power_param { power: -1.5 scale: 2 }', positive,
                            lambda x: (2 * x) ** -1.5),
}

# What each backward reads, out of place and in place (in place a needed x lives in scratch).
NEEDS = {
    "relu": (("top",), ("top",)), "relu_negslope": (("bottom",), ()),
    "elu": (("top",), ("top",)), "elu_negalpha": (("bottom", "top"), ("top",)),
    "sigmoid": (("top",), ("top",)), "tanh": (("top",), ("top",)), "absval": (("bottom",), ()),
    "power_linear": ((), ()), "power_zero": ((), ()), "power_sq": (("bottom",), ()),
    "power_sqrt": (("bottom", "top"), ("top",)), "power_cube_noshift": (("bottom", "top"), ("top",)),
}


@pytest.mark.parametrize("inplace", [False, True], ids=["out", "inplace"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_forward_and_gradient(case, inplace):
    text, make_x, ref = CASES[case]
    x = make_x(3)
    layer = make_layer(text, inplace=inplace)
    h = check_gradient(layer, [x], atol=1e-6)
    np.testing.assert_allclose(h.forward()[0], ref(x), rtol=1e-6, atol=1e-7)
    assert set(layer.scratch_specs) == ({"bottom"} if inplace and layer.needs_x else set())


@pytest.mark.parametrize("case", sorted(NEEDS))
def test_backward_needs(case):
    for inplace, want in zip((False, True), NEEDS[case]):
        layer = make_layer(CASES[case][0], inplace=inplace)
        layer.setup([SHAPE])
        assert tuple(layer.backward_needs) == want, (case, inplace)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("case", ["relu_leaky", "elu_half", "sigmoid", "tanh", "power_cube_noshift"])
def test_dtype_kept(case, dtype):
    text, make_x, ref = CASES[case]
    x = make_x(5)
    h = Harness(make_layer(text), [x], dtype)
    y = h.forward()[0]
    dx, _ = h.backward([np.ones(SHAPE)])
    assert y.dtype == dtype and dx[0].dtype == dtype
    np.testing.assert_allclose(y, ref(x.astype(dtype)), rtol=1e-5, atol=1e-6)


def test_sigmoid_saturates_without_overflow():
    x = np.array([-1000.0, -50.0, 0.0, 50.0, 1000.0], np.float32)
    with np.errstate(all="raise"):
        y = Harness(make_layer('type: "Sigmoid"'), [x], np.float32).forward()[0]
    np.testing.assert_allclose(y, [0, 0, 0.5, 1, 1], atol=1e-7)


def test_power_noshift_zero_input_is_nan_like_caffe():
    """Caffe's shift == 0 branch computes power * y / x, which is 0/0 at x = 0."""
    h = Harness(make_layer('type: "Power" power_param { power: 3 }'), [np.array([0.0, 2.0])])
    h.forward()
    with np.errstate(invalid="ignore"):
        dx = h.backward([np.ones(2)])[0][0]
    assert np.isnan(dx[0]) and dx[1] == pytest.approx(12.0)


# -- PReLU ---------------------------------------------------------------------

PRELU = 'type: "PReLU" prelu_param { channel_shared: %s }'


@pytest.mark.parametrize("inplace", [False, True], ids=["out", "inplace"])
@pytest.mark.parametrize("shape", [SHAPE, (4, 3)])
@pytest.mark.parametrize("shared", ["false", "true"])
def test_prelu(shared, shape, inplace):
    layer = make_layer(PRELU % shared, inplace=inplace)
    x = away_from_zero(4, shape)
    h = check_gradient(layer, [x], atol=1e-6)
    slope = layer.blobs[0].data
    assert slope.shape == (() if shared == "true" else (3,))
    bcast = slope if shared == "true" else slope.reshape((3,) + (1,) * (len(shape) - 2))
    np.testing.assert_allclose(h.forward()[0], leaky(x, bcast), rtol=1e-12)
    assert layer.backward_needs == (() if inplace else ("bottom",))
    if inplace:
        assert "bottom" in layer.scratch_specs


def test_prelu_propagate_down_false_still_learns_slope():
    x = away_from_zero(6)
    h = Harness(make_layer(PRELU % "false"), [x])
    h.forward()
    g = np.random.default_rng(1).standard_normal(SHAPE)
    dx, (dslope,) = h.backward([g], propagate_down=[False])
    np.testing.assert_allclose(dslope, (g * np.minimum(x, 0)).sum(axis=(0, 2, 3)), rtol=1e-12)
    assert not dx[0].any()    # untouched


@pytest.mark.parametrize("text,value", [(PRELU % "false", 0.25),
                                        ('type: "PReLU" prelu_param { filler { type: "constant" value: 0.5 } }', 0.5)])
def test_prelu_filler(text, value):
    layer = make_layer(text)
    layer.setup([SHAPE])
    layer.blobs = [Blob("slope", np.zeros(s)) for s in layer.param_shapes]
    layer.init_params(np.random.default_rng(0))
    np.testing.assert_array_equal(layer.blobs[0].data, np.full(3, value))


def test_prelu_needs_two_axes():
    with pytest.raises(ValueError, match="at least 2 axes"):
        make_layer(PRELU % "false").setup([(5,)])


# -- Dropout ---------------------------------------------------------------------

def dropout(ratio=None, phase=TRAIN, inplace=False):
    text = 'type: "Dropout"' + (f" dropout_param {{ dropout_ratio: {ratio} }}" if ratio is not None else "")
    return make_layer(text, phase=phase, inplace=inplace)


@pytest.mark.parametrize("ratio", [None, 0.2, 0.9])
def test_dropout_mask_statistics_and_scaling(ratio):
    r = 0.5 if ratio is None else ratio
    x = np.random.default_rng(0).uniform(0.5, 1.5, (40, 50, 50))     # no zeros
    h = Harness(dropout(ratio), [x], np.float32)
    y = h.forward()[0]
    mask = h.layer.scratch["mask"]
    assert mask.dtype == np.bool_ and mask.shape == x.shape
    n = x.size
    assert abs(mask.mean() - (1 - r)) < 5 * np.sqrt(r * (1 - r) / n)
    np.testing.assert_array_equal(y != 0, mask)
    np.testing.assert_allclose(y[mask], x[mask] / np.float32(1 - r), rtol=1e-6)
    # Neighbouring elements are independent: no visible correlation along any axis.
    m = mask.astype(np.float64) - mask.mean()
    assert abs((m[..., 1:] * m[..., :-1]).mean()) / m.var() < 0.02


@pytest.mark.parametrize("inplace", [False, True], ids=["out", "inplace"])
def test_dropout_backward_uses_forward_mask(inplace):
    x = np.random.default_rng(0).uniform(0.5, 1.5, SHAPE)
    layer = dropout(0.3, inplace=inplace)
    h = Harness(layer, [x])
    y = h.forward()[0]
    g = np.random.default_rng(1).standard_normal(SHAPE)
    dx = h.backward([g])[0][0]
    np.testing.assert_allclose(dx, g * (y != 0) / (1 - float(np.float32(0.3))), rtol=1e-12)
    assert layer.backward_needs == ()
    check_gradient(dropout(0.3, inplace=inplace), [x])


def test_dropout_redraw_false_reuses_mask():
    x = np.random.default_rng(0).standard_normal(SHAPE)
    layer = dropout()
    h = Harness(layer, [x])
    y = h.forward()[0]
    layer.rng = np.random.default_rng(123)
    layer.forward(h.bottom, h.top, redraw=False)     # a recomputation
    np.testing.assert_array_equal(h.top[0].data, y)
    layer.forward(h.bottom, h.top)                   # a new draw
    assert not np.array_equal(h.top[0].data, y)


@pytest.mark.parametrize("inplace", [False, True], ids=["out", "inplace"])
def test_dropout_test_phase_is_identity(inplace):
    x = np.random.default_rng(0).standard_normal(SHAPE)
    layer = dropout(0.4, phase=TEST, inplace=inplace)
    h = Harness(layer, [x], np.float32)
    np.testing.assert_array_equal(h.forward()[0], x.astype(np.float32))
    assert layer.scratch_specs == {}
    g = np.random.default_rng(1).standard_normal(SHAPE).astype(np.float32)
    np.testing.assert_array_equal(h.backward([g])[0][0], g)


def test_dropout_ratio_zero_keeps_all_and_bad_ratio_fails():
    x = np.random.default_rng(0).standard_normal(SHAPE)
    np.testing.assert_array_equal(Harness(dropout(0.0), [x]).forward()[0], x)
    with pytest.raises(ValueError, match="dropout_ratio"):
        dropout(1.0).setup([SHAPE])


# -- golden Caffe cases ---------------------------------------------------------------

@needs_shared
@pytest.mark.parametrize("case", ["relu", "relu_leaky", "prelu", "prelu_shared", "elu", "sigmoid", "tanh",
                                  "absval", "power_sq", "power_sqrt", "power_cube_noshift"])
def test_golden(case):
    run_golden_layer(case)
