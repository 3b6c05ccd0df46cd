"""Reduction and MVN: float64 references and gradients."""
import numpy as np
import pytest

from sncaffe.gradcheck import Harness, check_gradient, make_layer
from sncaffe.layers.base import LayerError


def rand(seed, *shape):
    x = np.random.default_rng(seed).standard_normal(shape)
    return np.where(np.abs(x) < 0.05, 0.1, x)      # ASUM's kink at 0


@pytest.mark.parametrize("op,axis,coeff", [("SUM", 1, 1.0), ("ASUM", 0, 1.0), ("SUMSQ", 1, 2.0),
                                           ("MEAN", 2, 0.5), ("SUM", -1, -3.0), ("MEAN", 0, 1.0)])
def test_reduction(op, axis, coeff):
    x = rand(0, 2, 3, 4)
    layer = make_layer(f'type: "Reduction" reduction_param {{ operation: {op} axis: {axis} coeff: {coeff} }}')
    h = check_gradient(layer, [x])
    a = axis % 3
    flat = x.reshape(x.shape[:a] + (-1,))
    want = {"SUM": flat.sum(-1), "ASUM": np.abs(flat).sum(-1), "SUMSQ": (flat ** 2).sum(-1),
            "MEAN": flat.mean(-1)}[op] * coeff
    y = h.forward()[0]
    assert y.shape == x.shape[:a]
    np.testing.assert_allclose(y, want, rtol=1e-6)


MVN_CASES = [(p, s, i) for p in ("", "across_channels: true", "normalize_variance: false",
                                  "normalize_variance: false across_channels: true", "eps: 0.1")
             for s in ((2, 3, 4, 5), (3, 4)) for i in (False, True) if not (i and len(s) < 4)]


@pytest.mark.parametrize("param,shape,inplace", MVN_CASES)
def test_mvn(param, shape, inplace):
    """Caffe's gradient treats std + eps as a constant of the mean: exact only for a tiny eps,
    so with eps 0.1 the backward is compared with that formula instead of finite differences."""
    x = 2 * rand(1, *shape) + 0.5
    layer = make_layer(f'type: "MVN" mvn_param {{ {param} }}', inplace=inplace)
    if "eps" in param:
        h = Harness(layer, [x])
    else:
        h = check_gradient(layer, [x], rtol=1e-4, atol=1e-6)
    x4 = x.reshape(shape + (1,) * (4 - len(shape)))
    axes = (1, 2, 3) if "across" in param else (2, 3)
    want = x4 - x4.mean(axis=axes, keepdims=True)
    if "normalize_variance: false" not in param:
        eps = 0.1 if "eps" in param else 1e-9
        want /= np.sqrt((want ** 2).mean(axis=axes, keepdims=True)) + eps     # population std, then eps
    y = h.forward()[0]
    assert y.shape == x4.shape
    np.testing.assert_allclose(y, want, rtol=1e-6, atol=1e-7)
    if "eps" in param:
        dy = rand(2, *y.shape)
        std = np.sqrt(((x4 - x4.mean(axis=axes, keepdims=True)) ** 2).mean(axis=axes, keepdims=True)) + 0.1
        caffe = (dy - dy.mean(axis=axes, keepdims=True) - y * (y * dy).mean(axis=axes, keepdims=True)) / std
        np.testing.assert_allclose(h.backward([dy])[0][0], caffe.reshape(shape), rtol=1e-6, atol=1e-9)


def test_mvn_takes_at_most_4_axes():
    with pytest.raises(LayerError, match=r'layer "mvn" \(MVN\): takes a bottom of at most 4 axes'):
        check_gradient(make_layer('type: "MVN"'), [rand(0, 1, 2, 2, 2, 2)])
