"""SPP: each level equals Caffe's Pooling with SPP's kernel, stride and pad; gradients."""
import numpy as np
import pytest

from sncaffe.gradcheck import Harness, check_gradient, make_layer
from sncaffe.layers.base import LayerError


@pytest.mark.parametrize("pool,height,hw", [("MAX", 3, (7, 9)), ("AVE", 2, (7, 9)), ("MAX", 1, (4, 5)),
                                            ("AVE", 3, (8, 8))])
def test_spp(pool, height, hw):
    x = np.random.default_rng(0).permutation(2 * 3 * hw[0] * hw[1]).reshape((2, 3) + hw) / 10.0   # no ties
    h = check_gradient(make_layer(f'type: "SPP" spp_param {{ pyramid_height: {height} pool: {pool} }}'), [x])
    y = h.forward()[0]
    assert y.shape == ((2, 3, 1, 1) if height == 1 else (2, 3 * sum(4 ** level for level in range(height))))
    y = y.reshape(2, -1)
    start = 0
    for level in range(height):
        bins = 2 ** level
        kh, kw = -(-hw[0] // bins), -(-hw[1] // bins)
        ph, pw = (kh * bins - hw[0] + 1) // 2, (kw * bins - hw[1] + 1) // 2
        text = (f'type: "Pooling" pooling_param {{ pool: {pool} kernel_h: {kh} kernel_w: {kw} stride_h: {kh} '
                f'stride_w: {kw} pad_h: {ph} pad_w: {pw} }}')
        want = Harness(make_layer(text), [x]).forward()[0]
        assert want.shape[2:] == (bins, bins)
        np.testing.assert_array_equal(y[:, start:start + want[0].size], want.reshape(2, -1))
        start += want[0].size


def test_spp_needs_4_axes():
    with pytest.raises(LayerError, match=r'layer "spp" \(SPP\): input must have 4 axes'):
        Harness(make_layer('type: "SPP" spp_param { pyramid_height: 2 }'), [np.ones((2, 3, 4))])
