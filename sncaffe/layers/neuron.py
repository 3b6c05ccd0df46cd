"""Neuron layers: one bottom, one top of the same shape, elementwise, allowed in place.

Each layer says what its backward reads: ``needs_x`` (the input) and
``needs_y`` (the output). In place the input is overwritten, so a layer that
needs it keeps a copy in scratch, as Caffe's PReLU does; ReLU and ELU read the
sign of x from y instead (exact for negative_slope, alpha >= 0), which also
lets the memory runtime free their bottom out of place.
"""
from __future__ import annotations

import numpy as np

from ..backend import onednn, workers
from ..backend.upload import upload
from . import neuron_gpu
from .base import TRAIN, Layer, array_module, register


class NeuronLayer(Layer):
    exact_bottoms = exact_tops = 1
    needs_x = needs_y = False   # what backward reads; set by read_param where it depends on it
    forward_gpu = backward_gpu = None   # the GPU kernels (neuron_gpu), else the array code on CuPy
    per_element = True      # the array code works element by element: run on pieces over threads

    def read_param(self, shape):
        """Read the layer's parameters (hook)."""

    def setup(self, bottom_shapes):
        shape = tuple(bottom_shapes[0])
        self.read_param(shape)
        self.keeps_x = self.needs_x and self.inplace
        if self.keeps_x:
            self.scratch_specs["bottom"] = (shape, None)
        self.backward_needs = (("bottom",) if self.needs_x and not self.inplace else ()) + \
                              (("top",) if self.needs_y else ())
        return [shape]

    def forward(self, bottom, top):
        x = bottom[0].data
        if self.keeps_x:
            self.scratch["bottom"][...] = x
        if array_module(x) is np and self.per_element:
            workers.elementwise(self.forward_array, x, top[0].data)
        elif array_module(x) is np or self.forward_gpu is None or self.forward_gpu(x, top[0].data) is False:
            self.forward_array(x, top[0].data)

    def backward(self, top, propagate_down, bottom):
        x = self.scratch["bottom"] if self.keeps_x else bottom[0].data
        args = (x, top[0].data, top[0].diff, bottom[0].diff, propagate_down[0])
        if array_module(top[0].diff) is np and self.per_element:
            workers.elementwise(lambda *arrays: self.backward_array(*arrays, propagate_down[0]), *args[:4])
        elif array_module(top[0].diff) is np or self.backward_gpu is None or self.backward_gpu(*args) is False:
            self.backward_array(*args)

    def forward_array(self, x, y):
        """y = f(x); y may be x (in place)."""
        raise NotImplementedError

    def backward_array(self, x, y, dy, dx, propagate):
        """dx = f'(x) * dy where ``propagate``; dx may be dy (in place). x, y: only if needed."""
        if propagate:
            xp = array_module(dy)
            xp.multiply(dy, self.derivative(xp, x, y), out=dx)

    def derivative(self, xp, x, y):
        raise NotImplementedError


def _leaky(xp, x, slope, y):
    """Caffe's max(x, 0) + slope * min(x, 0); slope a scalar or a broadcastable array."""
    neg = xp.minimum(x, 0)
    neg *= slope
    xp.maximum(x, 0, out=y)
    y += neg


@register
class ReLU(NeuronLayer):
    type = "ReLU"
    forward_gpu, backward_gpu = neuron_gpu.relu_forward, neuron_gpu.relu_backward

    def read_param(self, shape):
        self.slope = self.param.relu_param.negative_slope
        # y > 0 iff x > 0 unless the slope is negative; then only x tells.
        self.needs_x, self.needs_y = self.slope < 0, self.slope >= 0

    def forward_array(self, x, y):
        if self.slope:
            _leaky(array_module(x), x, self.slope, y)
        else:
            array_module(x).maximum(x, 0, out=y)

    # On the CPU, large float32 tensors run on oneDNN's ReLU (onednn.relu_for: the same bytes,
    # faster, on all the budget's threads).
    def forward(self, bottom, top):
        if self.fused("forward"):       # the Eltwise before it took the max (graph.EltwiseReLU)
            return
        r = onednn.relu_for(self.slope, bottom[0].data, top[0].data)
        if r is None:
            return super().forward(bottom, top)
        r.forward(bottom[0].data, top[0].data)

    def backward(self, top, propagate_down, bottom):
        if self.fused("backward"):      # the Eltwise before it applies the mask
            return
        r = onednn.relu_for(self.slope, top[0].data, top[0].diff, bottom[0].diff) if propagate_down[0] else None
        if r is None:
            return super().backward(top, propagate_down, bottom)
        r.backward(top[0].data, top[0].diff, bottom[0].diff)

    def derivative(self, xp, x, y):
        sign = y if self.slope >= 0 else x
        if not self.slope:
            return sign > 0
        return xp.where(sign > 0, sign.dtype.type(1), sign.dtype.type(self.slope))


@register
class PReLU(NeuronLayer):
    """ReLU with a learned negative slope per channel (axis 1), or one shared."""
    type = "PReLU"
    forward_gpu, backward_gpu = neuron_gpu.prelu_forward, neuron_gpu.prelu_backward
    needs_x = True
    per_element = False     # slopes broadcast per channel; backward sums the slopes' gradient

    def read_param(self, shape):
        if len(shape) < 2:
            raise self.error(f"needs a bottom with at least 2 axes, got {shape}")
        self.shared = self.param.prelu_param.channel_shared
        self.param_shapes = [() if self.shared else (shape[1],)]   # Caffe's shared slope is 0-axis
        self.bcast = () if self.shared else (shape[1],) + (1,) * (len(shape) - 2)
        self.sum_axes = tuple(i for i in range(len(shape)) if self.shared or i != 1)

    def init_params(self, rng):
        from ..fillers import fill
        from ..proto import sncaffe_pb2 as pb
        p = self.param.prelu_param
        filler = p.filler if p.HasField("filler") else pb.FillerParameter(type="constant", value=0.25)
        fill(filler, self.blobs[0].data, rng)

    def forward_array(self, x, y):
        _leaky(array_module(x), x, self.blobs[0].data.reshape(self.bcast), y)

    def backward_array(self, x, y, dy, dx, propagate):
        xp = array_module(dy)
        slope = self.blobs[0].data.reshape(self.bcast)
        # d/d slope = dy * min(x, 0), summed over all but the channel axis; before dx overwrites dy.
        grad = xp.minimum(x, 0)
        grad *= dy
        self.blobs[0].diff += grad.sum(axis=self.sum_axes)
        if propagate:
            xp.multiply(dy, xp.where(x > 0, x.dtype.type(1), slope), out=dx)


@register
class ELU(NeuronLayer):
    type = "ELU"
    forward_gpu, backward_gpu = neuron_gpu.elu_forward, neuron_gpu.elu_backward
    needs_y = True

    def read_param(self, shape):
        self.alpha = self.param.elu_param.alpha
        self.needs_x = self.alpha < 0   # y > 0 iff x > 0 unless alpha is negative

    def forward_array(self, x, y):
        xp = array_module(x)
        neg = xp.minimum(x, 0)
        xp.exp(neg, out=neg)    # Caffe's exp(x) - 1, not expm1
        neg -= 1
        neg *= self.alpha
        xp.maximum(x, 0, out=y)
        y += neg

    def derivative(self, xp, x, y):
        return xp.where((x if self.needs_x else y) > 0, y.dtype.type(1), y + y.dtype.type(self.alpha))


@register
class Sigmoid(NeuronLayer):
    type = "Sigmoid"
    forward_gpu, backward_gpu = neuron_gpu.sigmoid_forward, neuron_gpu.sigmoid_backward
    needs_y = True

    def forward_array(self, x, y):
        xp = array_module(x)
        xp.multiply(x, 0.5, out=y)    # 0.5 tanh(x/2) + 0.5: no overflow in exp
        xp.tanh(y, out=y)
        y *= 0.5
        y += 0.5

    def derivative(self, xp, x, y):
        d = 1 - y
        d *= y
        return d


@register
class TanH(NeuronLayer):
    type = "TanH"
    forward_gpu, backward_gpu = neuron_gpu.tanh_forward, neuron_gpu.tanh_backward
    needs_y = True

    def forward_array(self, x, y):
        array_module(x).tanh(x, out=y)

    def derivative(self, xp, x, y):
        d = y * y
        xp.subtract(1, d, out=d)
        return d


@register
class AbsVal(NeuronLayer):
    """|x|. Caffe refuses it in place; here in place keeps a copy of x."""
    type = "AbsVal"
    forward_gpu, backward_gpu = neuron_gpu.abs_forward, neuron_gpu.abs_backward
    needs_x = True

    def forward_array(self, x, y):
        array_module(x).abs(x, out=y)

    def derivative(self, xp, x, y):
        return xp.sign(x)


@register
class Power(NeuronLayer):
    """y = (shift + scale x)^power, with the branches of Caffe's power_layer.cpp."""
    type = "Power"
    forward_gpu, backward_gpu = neuron_gpu.power_forward, neuron_gpu.power_backward

    def read_param(self, shape):
        p = self.param.power_param
        self.power, self.scale, self.shift = p.power, p.scale, p.shift
        self.diff_scale = self.power * self.scale
        constant = self.diff_scale == 0 or self.power == 1   # dy/dx is a constant
        self.needs_x = not constant
        self.needs_y = not constant and self.power != 2

    def forward_array(self, x, y):
        xp = array_module(x)
        if self.diff_scale == 0:
            y[...] = 1 if self.power == 0 else self.shift ** self.power
            return
        if self.scale != 1:
            xp.multiply(x, self.scale, out=y)
        elif y is not x:
            y[...] = x
        if self.shift:
            y += self.shift
        if self.power != 1:
            xp.power(y, self.power, out=y)

    def backward_array(self, x, y, dy, dx, propagate):
        if not propagate:
            return
        if self.diff_scale == 0:
            dx[...] = 0
        elif self.power == 1:
            xp = array_module(dy)
            xp.multiply(dy, self.diff_scale, out=dx)
        else:
            super().backward_array(x, y, dy, dx, propagate)

    def derivative(self, xp, x, y):
        if self.power == 2:     # 2 scale (shift + scale x)
            d = x * (self.diff_scale * self.scale)
            if self.shift:
                d += self.diff_scale * self.shift
        elif self.shift == 0:   # power y / x
            d = y / x
            d *= self.power
        else:                   # diff_scale y / (shift + scale x)
            d = x * self.scale
            d += self.shift
            xp.divide(y, d, out=d)
            d *= self.diff_scale
        return d


@register
class Dropout(NeuronLayer):
    """TRAIN: y = x * mask / (1 - ratio), mask ~ Bernoulli(1 - ratio) from ``self.rng``; TEST: y = x
    (unless caffe-segnet's ``sample_weights_test``: as in TRAIN).

    The mask is kept in scratch for backward. ``forward(..., redraw=False)``
    reuses the kept mask instead of drawing a new one, so the memory runtime
    can recompute the top exactly.
    """
    type = "Dropout"

    def read_param(self, shape):
        p = self.param.dropout_param
        self.ratio = p.dropout_ratio
        if not 0 <= self.ratio < 1:
            raise self.error(f"dropout_ratio must be in [0, 1), got {self.ratio}")
        self.train = self.phase == TRAIN or p.sample_weights_test     # caffe-segnet's Monte Carlo dropout
        if self.train:
            self.scratch_specs = {"mask": (shape, np.bool_)}
        self.scale = 1 / (1 - self.ratio) if self.train else 1.0

    def recompute(self, bottom, top):
        self.forward(bottom, top, redraw=False)   # the kept mask, so recomputation is exact

    def forward(self, bottom, top, *, redraw=True):
        x, y = bottom[0].data, top[0].data
        xp = array_module(x)
        if self.train:
            mask = self.scratch["mask"]
            if redraw:   # drawn on the host from self.rng, so CPU and GPU runs share masks
                host = self.rng.random(mask.shape, dtype=np.float32) < 1 - self.ratio
                if xp is np:
                    mask[...] = host
                else:
                    upload(mask, host)      # pinned and asynchronous
            xp.multiply(x, mask, out=y)
        elif y is not x:
            y[...] = x
        if self.scale != 1:
            y *= self.scale

    def backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        dy, dx = top[0].diff, bottom[0].diff
        xp = array_module(dy)
        if self.train:
            xp.multiply(dy, self.scratch["mask"], out=dx)
        elif dx is not dy:
            dx[...] = dy
        if self.scale != 1:
            dx *= self.scale
