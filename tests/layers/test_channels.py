"""Axpy (SENet) and ShuffleChannel (ShuffleNet): values, PyTorch's channel_shuffle, gradients."""
import numpy as np
import pytest

from sncaffe.gradcheck import Harness, check_gradient, make_layer
from sncaffe.layers.base import LayerError


@pytest.mark.parametrize("a_shape", [(2, 3, 1, 1), (2, 3)])
def test_axpy(a_shape):
    rng = np.random.default_rng(0)
    a, x, y = rng.standard_normal(a_shape), rng.standard_normal((2, 3, 4, 5)), rng.standard_normal((2, 3, 4, 5))
    h = check_gradient(make_layer('type: "Axpy"', n_bottoms=3), [a, x, y])
    np.testing.assert_allclose(h.forward()[0], a.reshape(2, 3, 1, 1) * x + y, rtol=1e-12)


def test_axpy_checks_the_scale():
    with pytest.raises(LayerError, match=r"the scale \(2, 3, 2, 1\) must be"):
        Harness(make_layer('type: "Axpy"', n_bottoms=3), [np.ones((2, 3, 2, 1)), np.ones((2, 3, 2, 1)),
                                                          np.ones((2, 3, 2, 1))])


@pytest.mark.parametrize("group,inplace", [(3, False), (2, True), (1, False)])
def test_shuffle_channel_is_torch_channel_shuffle(group, inplace):
    torch = pytest.importorskip("torch")
    x = np.random.default_rng(1).standard_normal((2, 6, 3, 2))
    layer = make_layer(f'type: "ShuffleChannel" shuffle_channel_param {{ group: {group} }}', inplace=inplace)
    h = check_gradient(layer, [x])
    want = torch.nn.functional.channel_shuffle(torch.from_numpy(x), group).numpy()
    np.testing.assert_array_equal(h.forward()[0], want)


def test_shuffle_channel_needs_whole_groups():
    with pytest.raises(LayerError, match=r"do not split into 4 groups"):
        Harness(make_layer('type: "ShuffleChannel" shuffle_channel_param { group: 4 }'), [np.ones((1, 6, 2, 2))])
