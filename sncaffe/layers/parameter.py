"""Parameter: a learnable blob as a top (Caffe's parameter_layer.hpp)."""
from __future__ import annotations

from .base import Layer, register


@register
class Parameter(Layer):
    """No bottom; one top with ``parameter_param.shape``, holding the layer's one parameter blob.
    Caffe shares the top's data and diff with the blob; here forward copies the data out and
    backward adds the top diff to the parameter diff, which gives the same values. Caffe gives
    the blob no filler: it starts at 0 unless weights are loaded."""
    type = "Parameter"
    exact_bottoms, exact_tops = 0, 1
    backward_needs = ()

    def setup(self, bottom_shapes):
        shape = tuple(int(d) for d in self.param.parameter_param.shape.dim)
        self.param_shapes = [shape]
        return [shape]

    def forward(self, bottom, top):
        top[0].data[...] = self.blobs[0].data

    def backward(self, top, propagate_down, bottom):
        self.blobs[0].diff += top[0].diff
