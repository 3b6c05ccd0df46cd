"""Layers that move elements without arithmetic: Crop, Tile, Im2col (Caffe's crop, tile and
im2col layers). Each forward is a copy into the top; each backward the adjoint copy (Crop:
into the window, zeros elsewhere; Tile: the sum of the copies; Im2col: col2im, overlaps summed).
"""
from __future__ import annotations

import itertools

from .base import Layer, canonical_axis, count, register


@register
class Crop(Layer):
    """Crop bottom[0] to the shape of bottom[1] from ``axis`` on. One offset applies to every
    cropped axis, several give one per axis; axes before ``axis`` keep their size. bottom[1]
    only gives a shape: it never gets a gradient (Caffe leaves its diff at 0)."""
    type = "Crop"
    exact_bottoms, exact_tops = 2, 1
    backward_needs = ()
    cheap = True

    def setup(self, bottom_shapes):
        p = self.param.crop_param
        shape, ref = (tuple(s) for s in bottom_shapes)
        n = len(shape)
        start = canonical_axis(self, p.axis, n)
        offsets = list(p.offset)
        if len(offsets) > 1 and start + len(offsets) != n:
            raise self.error(f"{len(offsets)} offsets given for axes {start}.. of a {n}-axis bottom: "
                             "give one offset, or one per axis from crop axis on")
        if len(ref) < n:
            raise self.error(f"reference bottom {ref} has fewer axes than the data bottom {shape}")
        self.offsets, top = [0] * n, list(shape)
        for i in range(start, n):
            off = offsets[0] if len(offsets) == 1 else offsets[i - start] if offsets else 0
            if shape[i] - off < ref[i]:
                raise self.error(f"the crop for axis {i} is out of bounds: size {ref[i]} at offset "
                                 f"{off} in a bottom of size {shape[i]} (bottom shape {shape})")
            self.offsets[i], top[i] = off, ref[i]
        self.top_shape = tuple(top)
        return [self.top_shape]

    def allow_force_backward(self, bottom_index):
        return bottom_index == 0

    def window(self):
        return tuple(slice(o, o + s) for o, s in zip(self.offsets, self.top_shape))

    def forward(self, bottom, top):
        top[0].data[...] = bottom[0].data[self.window()]

    def backward(self, top, propagate_down, bottom):
        if propagate_down[0]:
            dx = bottom[0].diff
            dx.fill(0)
            dx[self.window()] = top[0].diff
        if propagate_down[1]:
            bottom[1].diff.fill(0)      # the reference gives a shape only


@register
class Tile(Layer):
    """Repeat the block of axes ``axis``.. ``tiles`` times along ``axis`` (concat([x] * tiles, axis))."""
    type = "Tile"
    exact_bottoms = exact_tops = 1
    backward_needs = ()
    cheap = True

    def setup(self, bottom_shapes):
        p, shape = self.param.tile_param, tuple(bottom_shapes[0])
        axis = canonical_axis(self, p.axis, len(shape))
        if not p.HasField("tiles"):
            raise self.error("tile_param.tiles must be specified")
        if p.tiles < 1:
            raise self.error(f"tile_param.tiles must be positive, got {p.tiles}")
        self.tiles, self.outer, self.inner = p.tiles, count(shape, 0, axis), count(shape, axis)
        return [shape[:axis] + (shape[axis] * p.tiles,) + shape[axis + 1:]]

    def forward(self, bottom, top):
        y = top[0].data.reshape(self.outer, self.tiles, self.inner)
        y[...] = bottom[0].data.reshape(self.outer, 1, self.inner)

    def backward(self, top, propagate_down, bottom):
        if propagate_down[0]:
            dy = top[0].diff.reshape(self.outer, self.tiles, self.inner)
            dy.sum(axis=1, out=bottom[0].diff.reshape(self.outer, self.inner))


def _per_axis(layer, p, name, n, default):
    """Caffe's repeated ``name`` (once, or once per spatial axis) or its _h/_w pair."""
    short = "kernel" if name == "kernel_size" else name
    hw = (f"{short}_h", f"{short}_w") if name != "dilation" else ()
    values = list(getattr(p, name))
    if any(p.HasField(f) for f in hw):
        if n != 2:
            raise layer.error(f"{short}_h & {short}_w can only be used for 2D convolution")
        if values:
            raise layer.error(f"either {name} or {short}_h/w should be specified; not both")
        return [getattr(p, hw[0]), getattr(p, hw[1])]
    if not values:
        if default is None:
            raise layer.error(f"{name} must be specified")
        return [default] * n
    if len(values) not in (1, n):
        raise layer.error(f"{name} must be specified once, or once per spatial dimension "
                          f"({name} specified {len(values)} times; {n} spatial dims)")
    return values * n if len(values) == 1 else values


@register
class Im2col(Layer):
    """Caffe's im2col as a layer (ConvolutionParameter kernel/stride/pad/dilation, any number of
    spatial axes after ``axis``): top channel (c k_0 + i_0) k_1 + i_1 ... holds, at each output
    position, input channel c at kernel tap (i_0, i_1, ...), 0 in the padding."""
    type = "Im2col"
    exact_bottoms = exact_tops = 1
    backward_needs = ()

    def setup(self, bottom_shapes):
        p, shape = self.param.convolution_param, tuple(bottom_shapes[0])
        axis = canonical_axis(self, p.axis, len(shape))
        n = len(shape) - axis - 1
        if n < 1:
            raise self.error(f"needs at least one spatial axis after channel axis {axis}, bottom is {shape}")
        self.kernel = _per_axis(self, p, "kernel_size", n, None)
        self.stride = _per_axis(self, p, "stride", n, 1)
        self.pad = _per_axis(self, p, "pad", n, 0)
        self.dilation = _per_axis(self, p, "dilation", n, 1)
        if min(self.kernel) < 1 or min(self.stride) < 1:
            raise self.error(f"kernel {self.kernel} and stride {self.stride} must be positive")
        spatial = shape[axis + 1:]
        out = []
        for size, k, s, q, d in zip(spatial, self.kernel, self.stride, self.pad, self.dilation):
            o = (size + 2 * q - (d * (k - 1) + 1)) // s + 1
            if o < 1:
                raise self.error(f"kernel extent {d * (k - 1) + 1} does not fit the padded size "
                                 f"{size + 2 * q} (bottom {shape})")
            out.append(o)
        self.num, self.channels, self.spatial, self.out = count(shape, 0, axis), shape[axis], spatial, out
        padded = tuple(size + 2 * q for size, q in zip(spatial, self.pad))
        self.workspace_specs = {"padded": ((self.num, self.channels) + padded, None)}
        return [shape[:axis] + (self.channels * count(self.kernel),) + tuple(out)]

    def _taps(self):
        """(kernel tap index, slices of the padded image that tap reads at every output position)."""
        for t, tap in enumerate(itertools.product(*(range(k) for k in self.kernel))):
            yield t, (Ellipsis,) + tuple(slice(i * d, i * d + s * (o - 1) + 1, s)
                                         for i, d, s, o in zip(tap, self.dilation, self.stride, self.out))

    def _views(self, top_array, padded):
        cols = top_array.reshape((self.num, self.channels, count(self.kernel)) + tuple(self.out))
        inner = tuple(slice(q, q + size) for q, size in zip(self.pad, self.spatial))
        return cols, padded[(slice(None), slice(None)) + inner]

    def forward(self, bottom, top):
        padded = self.workspace["padded"]
        cols, interior = self._views(top[0].data, padded)
        padded.fill(0)
        interior[...] = bottom[0].data.reshape(interior.shape)
        for t, win in self._taps():
            cols[:, :, t] = padded[win]

    def backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        padded = self.workspace["padded"]
        cols, interior = self._views(top[0].diff, padded)
        padded.fill(0)
        for t, win in self._taps():
            padded[win] += cols[:, :, t]          # col2im: overlapping taps add up
        bottom[0].diff.reshape(interior.shape)[...] = interior
