"""InnerProduct: gradients, a NumPy reference, parameter accumulation, Caffe golden cases."""
import numpy as np
import pytest

from conftest import needs_shared
from golden import run_golden_layer
from sncaffe.gradcheck import Harness, check_gradient, make_layer
from sncaffe.layers import LayerError

SETTINGS = [  # (inner_product_param text, bottom shape)
    ("num_output: 4", (2, 3, 2, 2)),
    ("num_output: 3 axis: 2", (2, 3, 4)),
    ("num_output: 5 transpose: true", (3, 6)),
    ("num_output: 2 bias_term: false", (2, 3, 2)),
    ("num_output: 3 axis: -1 transpose: true bias_term: false", (2, 2, 4)),
    ("num_output: 2 axis: 0", (2, 3)),
]


def ip(text):
    return make_layer(f'type: "InnerProduct" inner_product_param {{ {text} '
                      f'weight_filler {{ type: "gaussian" std: 0.5 }} }}')


def reference(layer, x):
    p = layer.param.inner_product_param
    axis = p.axis % x.ndim
    w = layer.blobs[0].data.T if p.transpose else layer.blobs[0].data
    y = x.reshape(int(np.prod(x.shape[:axis])), -1) @ w.T
    if p.bias_term:
        y = y + layer.blobs[1].data
    return y.reshape(x.shape[:axis] + (p.num_output,))


@pytest.mark.parametrize("text,shape", SETTINGS)
def test_gradient(text, shape):
    check_gradient(ip(text), [np.random.default_rng(1).standard_normal(shape)])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("text,shape", SETTINGS)
def test_forward_matches_reference(text, shape, dtype):
    layer = ip(text)
    x = np.random.default_rng(2).standard_normal(shape)
    h = Harness(layer, [x], dtype)
    p = layer.param.inner_product_param
    n, axis = p.num_output, p.axis % len(shape)
    k = int(np.prod(shape[axis:]))
    assert [b.data.shape for b in layer.blobs] == (
        [(k, n) if p.transpose else (n, k)] + [(n,)] * p.bias_term)
    (y,) = h.forward()
    assert y.dtype == dtype and y.shape == shape[:axis] + (n,)
    tol = 1e-5 if dtype == np.float32 else 1e-12
    np.testing.assert_allclose(y, reference(layer, h.inputs[0].astype(np.float64)), rtol=tol, atol=tol)


def test_param_diffs_accumulate():
    layer = ip("num_output: 3")
    rng = np.random.default_rng(3)
    h = Harness(layer, [rng.standard_normal((4, 5))])
    h.forward()
    dy = rng.standard_normal((4, 3))
    _, (dw, db) = h.backward([dy])
    layer.backward(h.top, [True], h.bottom)      # again, without clearing the param diffs
    np.testing.assert_allclose(layer.blobs[0].diff, 2 * dw)
    np.testing.assert_allclose(layer.blobs[1].diff, 2 * db)
    np.testing.assert_allclose(db, dy.sum(0))


def test_init_params_uses_fillers():
    layer = make_layer('type: "InnerProduct" inner_product_param { num_output: 3 '
                       'weight_filler { type: "constant" value: 2 } bias_filler { type: "constant" value: -1 } }')
    Harness(layer, [np.zeros((2, 4))], params=None)   # Harness randomizes learnable params afterwards
    layer.init_params(np.random.default_rng(0))
    assert np.all(layer.blobs[0].data == 2) and np.all(layer.blobs[1].data == -1)


def test_errors():
    with pytest.raises(LayerError, match='"innerproduct".*num_output'):
        ip("").setup([(2, 3)])
    with pytest.raises(LayerError, match="axis 3"):
        ip("num_output: 2 axis: 3").setup([(2, 3)])


# -- golden cases from BVLC Caffe ---------------------------------------------------
@needs_shared
@pytest.mark.parametrize("case", ["ip_axis1", "ip_transpose", "ip_axis2_nobias"])
def test_golden(case):
    run_golden_layer(case)
