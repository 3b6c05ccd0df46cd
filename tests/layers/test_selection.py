"""Embed, BatchReindex, Filter, Parameter: references, gradients, and Caffe's refusal to
differentiate indices (the gradient checker asks for no gradient there)."""
import numpy as np
import pytest

from sncaffe.gradcheck import Harness, check_gradient, make_layer
from sncaffe.layers.base import LayerError


def rand(seed, *shape):
    return np.random.default_rng(seed).standard_normal(shape)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(2, 3), (5,), (2, 1, 2)])
def test_embed(shape, bias):
    idx = np.random.default_rng(1).integers(0, 7, shape).astype(np.float64)
    text = f'type: "Embed" embed_param {{ input_dim: 7 num_output: 4 bias_term: {str(bias).lower()} }}'
    h = check_gradient(make_layer(text), [idx], check_bottoms=[], propagate_down=[False])
    w = h.layer.blobs[0].data
    want = w[idx.astype(int)] + (h.layer.blobs[1].data if bias else 0)
    np.testing.assert_allclose(h.forward()[0], want)
    # rows of indices that never occur get exactly 0
    _, (dw, *_) = h.backward([np.ones(shape + (4,))], [False])
    unused = sorted(set(range(7)) - set(idx.astype(int).ravel()))
    assert not dw[unused].any()


def test_embed_refusals():
    layer = make_layer('type: "Embed" embed_param { input_dim: 3 num_output: 2 }')
    h = Harness(layer, [np.array([0.0, 2.0])])
    h.forward()
    with pytest.raises(LayerError, match=r'layer "embed" \(Embed\): can.t backpropagate to the Embed input'):
        h.backward([np.ones((2, 2))], [True])
    h.inputs[0][1] = 3
    with pytest.raises(LayerError, match=r"index 3.0 out of range \[0, 3\)"):
        h.forward()


def test_batch_reindex():
    x, idx = rand(0, 4, 2, 3), np.array([3.0, 0, 3, 1, 0])
    layer = make_layer('type: "BatchReindex"', n_bottoms=2)
    h = check_gradient(layer, [x, idx], check_bottoms=[0], propagate_down=[True, False])
    np.testing.assert_array_equal(h.forward()[0], x[[3, 0, 3, 1, 0]])
    (dx, _), _ = h.backward([np.ones((5, 2, 3))], [True, False])
    np.testing.assert_array_equal(dx[:, 0, 0], [2, 1, 0, 2])       # repeats sum, item 2 unused
    with pytest.raises(LayerError, match=r'\(BatchReindex\): cannot backprop to index'):
        h.backward([np.ones((5, 2, 3))], [True, True])
    h.inputs[1][0] = 4
    with pytest.raises(LayerError, match="out of range"):
        h.forward()


@pytest.mark.parametrize("sel", [[1.0, 2.0, -1.0, 0.5], [0.0, 1.0, 0.0, 3.0], [0.0, 0.0, 0.0, 1.0]])
def test_filter(sel):
    """Bound to whole-batch arrays (no Net to reshape them), the kept items fill the tops' first
    rows; the other rows stay constant, so finite differences still check backward."""
    x, t, sel = rand(0, 4, 2), rand(1, 4, 3, 1), np.array(sel)
    layer = make_layer('type: "Filter"', n_bottoms=3, n_tops=2)
    h = check_gradient(layer, [x, t, sel], check_bottoms=[0, 1], propagate_down=[True, True, False])
    kept = np.flatnonzero(sel)
    assert layer.top_shapes(h.bottom) == [(len(kept), 2), (len(kept), 3, 1)]
    y, tf = h.forward()
    np.testing.assert_array_equal(y[:len(kept)], x[kept])
    np.testing.assert_array_equal(tf[:len(kept)], t[kept])
    (dx, _, _), _ = h.backward([np.ones((4, 2)), np.ones((4, 3, 1))], [True, False, False])
    np.testing.assert_array_equal(dx.any(axis=1), sel != 0)          # dropped items get 0
    with pytest.raises(LayerError, match=r'\(Filter\): cannot backpropagate to the filter index input'):
        h.backward([np.ones((4, 2)), np.ones((4, 3, 1))], [True, True, True])


def test_parameter():
    layer = make_layer('type: "Parameter" parameter_param { shape { dim: 2 dim: 3 } }', n_bottoms=0)
    h = check_gradient(layer, [])
    np.testing.assert_array_equal(h.forward()[0], layer.blobs[0].data)
