"""Per-channel layers of SENet (Axpy) and ShuffleNet (ShuffleChannel)."""
from __future__ import annotations

from .base import Layer, array_module, count, register


@register
class Axpy(Layer):
    """SENet's top = a * x + y: bottoms a (N, C) or (N, C, 1, 1), x and y (N, C, ...) of one
    shape; a scales every cell of its channel."""
    type = "Axpy"
    exact_bottoms, exact_tops = 3, 1
    backward_needs = ("bottom",)

    def setup(self, bottom_shapes):
        a, x, y = (tuple(s) for s in bottom_shapes)
        if len(x) < 2 or a[:2] != x[:2] or count(a, 2) != 1 or (len(a) == 4 and a[2:] != (1, 1)):
            raise self.error(f"the scale {a} must be (num, channels) or (num, channels, 1, 1) of x {x}")
        if x != y:
            raise self.error(f"x {x} and y {y} must have one shape")
        self.view = (x[0], x[1], count(x, 2))
        return [x]

    def forward(self, bottom, top):
        a, x, y = (b.data for b in bottom)
        xp = array_module(x)
        out = top[0].data.reshape(self.view)
        xp.multiply(x.reshape(self.view), a.reshape(self.view[:2] + (1,)), out=out)
        out += y.reshape(self.view)

    def backward(self, top, propagate_down, bottom):
        dy = top[0].diff.reshape(self.view)
        a, x = bottom[0].data, bottom[1].data
        xp = array_module(dy)
        if propagate_down[0]:
            bottom[0].diff.reshape(self.view[:2])[...] = (dy * x.reshape(self.view)).sum(axis=2)
        if propagate_down[1]:
            xp.multiply(dy, a.reshape(self.view[:2] + (1,)), out=bottom[1].diff.reshape(self.view))
        if propagate_down[2]:
            bottom[2].diff[...] = top[0].diff


@register
class ShuffleChannel(Layer):
    """ShuffleNet's channel shuffle: the channels, read as (group, C / group), are written as
    (C / group, group)."""
    type = "ShuffleChannel"
    exact_bottoms = exact_tops = 1
    backward_needs = ()

    def setup(self, bottom_shapes):
        shape = tuple(bottom_shapes[0])
        g = self.param.shuffle_channel_param.group
        if g <= 0:
            raise self.error("shuffle_channel_param.group must be > 0")
        if len(shape) < 2 or shape[1] % g:
            raise self.error(f"the channels of {shape} do not split into {g} groups")
        self.group = g
        self.view = (shape[0], g, shape[1] // g, count(shape, 2))
        return [shape]

    def _shuffle(self, src, dst, groups):
        """dst, read as (N, C / groups, groups, ...), takes src read as (N, groups, C / groups, ...)."""
        N, _, _, S = self.view
        s = src.reshape(N, groups, -1, S)
        dst.reshape(N, s.shape[2], groups, S)[...] = s.transpose(0, 2, 1, 3)

    def forward(self, bottom, top):
        x = bottom[0].data
        self._shuffle(x.copy() if self.inplace else x, top[0].data, self.group)

    def backward(self, top, propagate_down, bottom):
        if propagate_down[0]:   # the inverse: a shuffle by C / group
            dy = top[0].diff
            self._shuffle(dy.copy() if self.inplace else dy, bottom[0].diff, self.view[2])
