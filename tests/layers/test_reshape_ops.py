"""Crop, Tile, Im2col: NumPy references and gradients (Im2col also 1-D and 3-D, with dilation)."""
import itertools

import numpy as np
import pytest

from sncaffe.gradcheck import check_gradient, make_layer
from sncaffe.layers.base import LayerError


def rand(seed, *shape):
    return np.random.default_rng(seed).standard_normal(shape)


@pytest.mark.parametrize("crop,ref_shape,window", [
    ("axis: 2 offset: 1 offset: 2", (2, 3, 4, 4), np.s_[:, :, 1:5, 2:6]),
    ("axis: 1 offset: 1", (2, 2, 3, 3), np.s_[:, 1:3, 1:4, 1:4]),
    ("", (2, 3, 5, 2), np.s_[:, :, 0:5, 0:2]),                     # default axis 2, offset 0
    ("axis: -1 offset: 3", (9, 9, 9, 4), np.s_[:, :, :, 3:7]),
])
def test_crop(crop, ref_shape, window):
    x, ref = rand(0, 2, 3, 6, 7), rand(1, *ref_shape)
    layer = make_layer(f'type: "Crop" crop_param {{ {crop} }}', n_bottoms=2)
    h = check_gradient(layer, [x, ref])
    np.testing.assert_array_equal(h.forward()[0], x[window])
    assert not layer.allow_force_backward(1)
    (dx, dref), _ = h.backward([np.ones(h.top_shapes[0])], [True, True])
    assert dx.sum() == np.prod(h.top_shapes[0]) and not dref.any()


@pytest.mark.parametrize("crop,match", [
    ("axis: 2 offset: 1 offset: 2 offset: 3", "give one offset, or one per axis"),
    ("axis: 2 offset: 3", "out of bounds"),
    ("axis: 4", "axis 4 out of range"),
])
def test_crop_refusals(crop, match):
    layer = make_layer(f'type: "Crop" crop_param {{ {crop} }}', n_bottoms=2)
    with pytest.raises(LayerError, match=rf'layer "crop" \(Crop\): .*{match}'):
        check_gradient(layer, [rand(0, 2, 3, 6, 7), rand(1, 2, 3, 4, 4)])


@pytest.mark.parametrize("axis,tiles", [(1, 3), (0, 2), (-1, 4), (2, 1)])
def test_tile(axis, tiles):
    x = rand(2, 2, 3, 2)
    h = check_gradient(make_layer(f'type: "Tile" tile_param {{ axis: {axis} tiles: {tiles} }}'), [x])
    np.testing.assert_array_equal(h.forward()[0], np.concatenate([x] * tiles, axis=axis))


def test_tile_needs_tiles():
    with pytest.raises(LayerError, match="tiles must be specified"):
        check_gradient(make_layer('type: "Tile" tile_param { axis: 1 }'), [rand(0, 2, 3)])


def im2col_reference(x, kernel, stride, pad, dilation):
    """Caffe's im2col_nd_cpu, one output element at a time (x: (C, *spatial))."""
    C, spatial = x.shape[0], x.shape[1:]
    out = [(n + 2 * p - (d * (k - 1) + 1)) // s + 1 for n, k, s, p, d in zip(spatial, kernel, stride, pad, dilation)]
    cols = np.zeros((C * int(np.prod(kernel)),) + tuple(out))
    for c, (t, tap) in itertools.product(range(C), enumerate(itertools.product(*map(range, kernel)))):
        for pos in itertools.product(*map(range, out)):
            src = [o * s - p + i * d for o, s, p, i, d in zip(pos, stride, pad, tap, dilation)]
            if all(0 <= v < n for v, n in zip(src, spatial)):
                cols[(c * int(np.prod(kernel)) + t,) + pos] = x[(c,) + tuple(src)]
    return cols


@pytest.mark.parametrize("shape,conv,kernel,stride,pad,dilation", [
    ((2, 3, 5, 6), "kernel_size: 3 stride: 2 pad: 1", (3, 3), (2, 2), (1, 1), (1, 1)),
    ((1, 2, 6, 5), "kernel_h: 2 kernel_w: 3 pad_h: 1 stride_h: 1 stride_w: 2 dilation: 2",
     (2, 3), (1, 2), (1, 0), (2, 2)),
    ((2, 2, 7), "kernel_size: 3 stride: 2", (3,), (2,), (0,), (1,)),
    ((1, 2, 3, 4, 4), "kernel_size: 2 kernel_size: 1 kernel_size: 3 pad: 1 stride: 2", (2, 1, 3), (2, 2, 2),
     (1, 1, 1), (1, 1, 1)),
])
def test_im2col(shape, conv, kernel, stride, pad, dilation):
    x = rand(4, *shape)
    h = check_gradient(make_layer(f'type: "Im2col" convolution_param {{ {conv} }}'), [x])
    y = h.forward()[0]
    for n in range(shape[0]):
        np.testing.assert_array_equal(y[n], im2col_reference(x[n], kernel, stride, pad, dilation))


def test_im2col_refusals():
    with pytest.raises(LayerError, match=r'\(Im2col\): kernel_size must be specified'):
        check_gradient(make_layer('type: "Im2col"'), [rand(0, 1, 2, 4, 4)])
    with pytest.raises(LayerError, match="once per spatial dimension"):
        check_gradient(make_layer('type: "Im2col" convolution_param { kernel_size: 1 kernel_size: 2 kernel_size: 3 }'),
                       [rand(0, 1, 2, 4, 4)])
