"""BNLL, Clip, Exp, Log, Swish, Threshold: float64 references, gradients out of place and in place."""
import numpy as np
import pytest

from sncaffe.gradcheck import Harness, check_gradient, make_layer
from sncaffe.layers.base import LayerError

SHAPE = (2, 3, 4)


def normal(seed, scale=1.0):
    return scale * np.random.default_rng(seed).standard_normal(SHAPE)


def away_from(x, points, margin=0.02):
    """x moved off the kinks at ``points`` so finite differences never straddle one."""
    for p in points:
        near = np.abs(x - p) < margin
        x = np.where(near, p + np.copysign(margin, x - p) * 2, x)
    return x


def sigmoid(x):
    return 1 / (1 + np.exp(-x))


# (layer text, input, float64 reference)
CASES = {
    "bnll": ('type: "BNLL"', lambda s: normal(s, 3), lambda x: np.log1p(np.exp(x))),
    "clip": ('type: "Clip" clip_param { min: -0.5 max: 0.7 }', lambda s: away_from(normal(s), (-0.5, 0.7)),
             lambda x: np.clip(x, -0.5, 0.7)),
    "exp": ('type: "Exp"', normal, np.exp),
    "exp_base2": ('type: "Exp" exp_param { base: 2 scale: 0.8 shift: -0.4 }', normal,
                  lambda x: 2 ** (-0.4 + np.float32(0.8) * x)),
    "log": ('type: "Log" log_param { scale: 0.5 shift: 3 }', normal, lambda x: np.log(3 + 0.5 * x)),
    "log_base10": ('type: "Log" log_param { base: 10 }', lambda s: np.abs(normal(s)) + 0.1, np.log10),
    "swish": ('type: "Swish" swish_param { beta: 1.5 }', normal, lambda x: x * sigmoid(1.5 * x)),
    "swish_default": ('type: "Swish"', normal, lambda x: x * sigmoid(x)),
}


@pytest.mark.parametrize("inplace", [False, True], ids=["out", "inplace"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_forward_and_gradient(case, inplace):
    text, make_input, reference = CASES[case]
    x = make_input(3)
    h = check_gradient(make_layer(text, inplace=inplace), [x], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(h.forward()[0], reference(x), rtol=1e-5, atol=1e-6)


def test_bnll_large_inputs_do_not_overflow():
    x = np.array([-200.0, -60.0, 0.0, 60.0, 200.0], np.float32)
    h = Harness(make_layer('type: "BNLL"'), [x], np.float32)
    y = h.forward()[0]
    np.testing.assert_allclose(y, [0, np.exp(-60), np.log(2), 60, 200], rtol=1e-6)
    dx = h.backward([np.ones(5, np.float32)])[0][0]
    assert np.all(np.isfinite(dx)) and dx[-1] == 1 and dx[0] == 0


def test_threshold_forward_only():
    x = np.array([-1.0, 0.2, 0.2000001, 3.0])
    layer = make_layer('type: "Threshold" threshold_param { threshold: 0.2 }')
    h = Harness(layer, [x], np.float32)
    np.testing.assert_array_equal(h.forward()[0], [0, 0, 1, 1])
    with pytest.raises(LayerError, match=r'layer "threshold" \(Threshold\): has no backward'):
        h.backward([np.ones(4)], [True])
    h.backward([np.ones(4)], [False])       # nothing asked, nothing refused


@pytest.mark.parametrize("text,match", [
    ('type: "Exp" exp_param { base: -2 }', "base must be strictly positive"),
    ('type: "Log" log_param { base: 0 }', "base must be strictly positive"),
    ('type: "Clip" clip_param { min: 0 }', "needs both min and max"),
])
def test_bad_parameters_name_the_layer(text, match):
    with pytest.raises(LayerError, match=match):
        Harness(make_layer(text), [np.ones(SHAPE)])
