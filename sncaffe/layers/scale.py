"""Scale and Bias: multiply or add a blob broadcast along axes [axis, axis + num_axes) of bottom[0].

The scale (or bias) is a learned blob, or bottom[1] when given. Both view
bottom[0] as (outer, dim, inner) around the broadcast axes, as Caffe does.
"""
from __future__ import annotations

import numpy as np

from ..backend import fused, onednn, workers
from . import scale_gpu
from .base import Layer, array_module, canonical_axis, count, register
from .normalization import sum_over_images


class _BroadcastLayer(Layer):
    """Shared shape logic: the operand's shape and the (outer, dim, inner) view of bottom[0]."""
    min_bottoms, max_bottoms, exact_tops = 1, 2, 1

    def operand_shape(self, p, bottom_shapes):
        """The scale/bias shape: bottom[1]'s, or bottom[0].shape[axis:axis+num_axes]."""
        shape = tuple(bottom_shapes[0])
        if len(bottom_shapes) > 1:
            operand = tuple(bottom_shapes[1])
        else:
            axis = canonical_axis(self, p.axis, len(shape))
            if p.num_axes < -1:
                raise self.error(f"num_axes must be >= 0, or -1 for all remaining axes; got {p.num_axes}")
            end = len(shape) if p.num_axes == -1 else axis + p.num_axes
            if end > len(shape):
                raise self.error(f"axis {p.axis} + num_axes {p.num_axes} extends past bottom shape {shape}")
            operand = shape[axis:end]
        # A scalar operand broadcasts the same along any axis; Caffe takes axis 0.
        axis = canonical_axis(self, p.axis, len(shape)) if operand else 0
        if shape[axis:axis + len(operand)] != operand:
            raise self.error(f"shape {operand} does not match bottom shape {shape} from axis {axis}")
        self.view = (count(shape, 0, axis), count(operand), count(shape, axis + len(operand)))
        return operand

    def as3(self, a):
        return a.reshape(self.view)

    def operand3(self, a):
        return a.reshape(1, self.view[1], 1)

    def sum_into(self, total, target, accumulate):
        """A (dim,) sum over outer and inner: += into a parameter diff, = into a bottom diff."""
        total = total.reshape(target.shape)
        if accumulate:
            target += total
        else:
            target[...] = total

    def fill(self, blob, filler, rng):
        from ..fillers import fill
        fill(filler, blob.data, rng)


@register
class Scale(_BroadcastLayer):
    """top = bottom[0] * scale (+ bias with bias_term). Blobs: [scale] (one bottom), then [bias].

    In place, a copy of the input is kept in scratch for the scale's gradient, as in Caffe;
    after a training BatchNorm that copy is BatchNorm's own x_norm (graph.SHARED_SCRATCH).
    """
    type = "Scale"

    def setup(self, bottom_shapes):
        p = self.param.scale_param
        shape = self.operand_shape(p, bottom_shapes)
        self.scale_is_param = len(bottom_shapes) == 1
        self.bias_term = p.bias_term
        self.param_shapes = [shape] * (self.scale_is_param + self.bias_term)
        if self.inplace:
            self.scratch_specs = {"bottom": (tuple(bottom_shapes[0]), None)}
            if self.scale_is_param:     # a training BatchNorm's per-image sums (graph.Fusion)
                self.scratch_specs["partials"] = ((2,) + self.view[:2], None)
                self.optional_scratch = frozenset({"partials"})
        self.backward_needs = () if self.inplace and self.scale_is_param else ("bottom",)
        return [tuple(bottom_shapes[0])]

    def init_params(self, rng):
        from ..proto import sncaffe_pb2 as pb
        p = self.param.scale_param
        if self.scale_is_param:
            filler = p.filler if p.HasField("filler") else pb.FillerParameter(type="constant", value=1)
            self.fill(self.blobs[0], filler, rng)
        if self.bias_term:
            self.fill(self.blobs[-1], p.bias_filler, rng)

    def scale_blob(self, bottom):
        return self.blobs[0] if self.scale_is_param else bottom[1]

    # The broadcast axis is split over threads (backend/workers): each piece of channels does
    # its own whole computation, its sums included, so every sum keeps its order.
    def forward(self, bottom, top):
        x = bottom[0].data
        std = None
        if self.fused("forward"):
            x = self.scratch["bottom"]      # BatchNorm's x_norm: its top was not written (graph.Fusion)
            std = self.fusion.bn.layer.std_of_x_norm()      # and, centered, not yet divided
        keep = self.inplace and "bottom" not in self.shared_scratch
        if array_module(x) is not np:
            if keep:
                self.scratch["bottom"][...] = x
            return scale_gpu.scale_forward(self, x, self.scale_blob(bottom).data,
                                           self.blobs[-1].data if self.bias_term else None, top[0].data)
        x3, y3 = self.as3(x), self.as3(top[0].data)
        kept = self.as3(self.scratch["bottom"]) if keep else None
        scale = self.scale_blob(bottom).data.reshape(-1)
        bias = self.blobs[-1].data.reshape(-1) if self.bias_term else None
        if std is not None:
            return self._divided_forward(x3, std, scale, bias, y3)
        # large float32 tensors: one pass on oneDNN (onednn.binary_for: the same bytes)
        fast = onednn.binary_for(self.view, (x, top[0].data, scale, bias), onednn.MUL,
                                 ((onednn.ADD, False),) if bias is not None else ())
        if fast is not None:
            if keep:
                kept[...] = x3
            return fast.run(x, scale, top[0].data, *(() if bias is None else (bias,)))

        def run(cs):
            if keep:
                kept[:, cs] = x3[:, cs]
            np.multiply(x3[:, cs], scale[cs, None], out=y3[:, cs])
            if bias is not None:
                y3[:, cs] += bias[cs, None]
        workers.split(self.view[1], (2 + keep) * x.size, run)

    def _divided_forward(self, x3, std, scale, bias, y3):
        """y = ((x / std) * scale) + bias, per channel: BatchNorm's division and this layer in one
        pass, each operation rounded as the two layers apart round it."""
        posts = ((onednn.MUL, False),) + (((onednn.ADD, False),) if bias is not None else ())
        operands = (scale,) + (() if bias is None else (bias,))
        fast = onednn.binary_for(self.view, (x3, y3, std, *operands), onednn.DIV, posts)
        if fast is not None:
            return fast.run(x3, std, y3, *operands)

        def run(cs):
            np.divide(x3[:, cs], std[cs, None], out=y3[:, cs])
            y3[:, cs] *= scale[cs, None]
            if bias is not None:
                y3[:, cs] += bias[cs, None]
        workers.split(self.view[1], 2 * x3.size, run)

    def backward(self, top, propagate_down, bottom):
        xp = array_module(top[0].diff)
        if xp is not np:
            return scale_gpu.scale_backward(self, top, propagate_down, bottom)
        dy3 = self.as3(top[0].diff)
        if self.fused("backward") and propagate_down[0]:
            return self._fused_backward(dy3)
        scale = self.scale_blob(bottom)
        scale_grad = self.scale_is_param or propagate_down[1]
        if scale_grad and self.fusion is not None:      # BatchNorm's x_norm, divided if still centered
            self.fusion.bn.layer.normalized()
        x3 = self.as3(self.scratch["bottom"] if self.inplace else bottom[0].data) if scale_grad else None
        dx3 = self.as3(bottom[0].diff) if propagate_down[0] else None
        sums = np.empty((2, self.view[1]), dy3.dtype)        # per channel: bias, scale gradients
        s = scale.data.reshape(-1)

        fast = onednn.binary_for(self.view, (dy3, dx3, s), onednn.MUL) if dx3 is not None else None

        def run(cs):
            g = dy3[:, cs]
            if self.bias_term:
                sums[0, cs] = np.einsum("ijk->j", g)
            if scale_grad:
                sums[1, cs] = np.einsum("ijk,ijk->j", g, x3[:, cs])
            if dx3 is not None and fast is None:     # last: dx may be dy itself (in place)
                np.multiply(g, s[cs, None], out=dx3[:, cs])
        work = 1 + self.bias_term + 2 * scale_grad + 2 * (dx3 is not None and fast is None)
        workers.split(self.view[1], work * dy3.size, run)
        if fast is not None:                         # after the sums: dx may be dy itself
            fast.run(dy3, s, dx3)
        if self.bias_term:
            self.sum_into(sums[0], self.blobs[-1].diff, True)
        if scale_grad:
            self.sum_into(sums[1], scale.diff, self.scale_is_param)

    def _fused_backward(self, dy3):
        """After a training BatchNorm (graph.Fusion): each image's sums of dy and dy * x_norm into
        BatchNorm's per-image sums, the gradients their sums over the images; dy is left as it is
        (BatchNorm multiplies it by the scale). x_norm as BatchNorm left it: centered, the scale's
        gradient is divided by std per channel after the sum."""
        partials, x_norm = self.scratch["partials"], self.as3(self.scratch["bottom"])
        std = self.fusion.bn.layer.std_of_x_norm()

        def run(cs):
            np.einsum("ncs->nc", dy3[:, cs], out=partials[0][:, cs])
            np.einsum("ncs,ncs->nc", x_norm[:, cs], dy3[:, cs], out=partials[1][:, cs])
        if fused.usable(dy3, x_norm, partials):       # both sums in one pass (backend/fused.py)
            fused.kernels().two_sums(dy3, x_norm, partials[0], partials[1])
        else:
            workers.split(self.view[1], 3 * dy3.size, run)
        sums = np.empty((2, self.view[1]), dy3.dtype)
        if self.bias_term:
            self.sum_into(sum_over_images([partials[0]], sums[0]), self.blobs[-1].diff, True)
        sum_over_images([partials[1]], sums[1])
        if std is not None:
            sums[1] /= std
        self.sum_into(sums[1], self.blobs[0].diff, True)


@register
class Bias(_BroadcastLayer):
    """top = bottom[0] + bias. Blobs: [bias] unless it is bottom[1]."""
    type = "Bias"
    backward_needs = ()

    def setup(self, bottom_shapes):
        shape = self.operand_shape(self.param.bias_param, bottom_shapes)
        self.bias_is_param = len(bottom_shapes) == 1
        self.param_shapes = [shape] if self.bias_is_param else []
        return [tuple(bottom_shapes[0])]

    def init_params(self, rng):
        self.fill(self.blobs[0], self.param.bias_param.filler, rng)   # unset: constant 0

    def forward(self, bottom, top):
        bias = self.blobs[0] if self.bias_is_param else bottom[1]
        array_module(bias.data).add(self.as3(bottom[0].data), self.operand3(bias.data),
                                    out=self.as3(top[0].data))

    def backward(self, top, propagate_down, bottom):
        dy = top[0].diff
        if self.bias_is_param or propagate_down[1]:
            target = self.blobs[0].diff if self.bias_is_param else bottom[1].diff
            if array_module(dy) is not np:
                scale_gpu.bias_backward(self, dy, target, self.bias_is_param)
            else:
                self.sum_into(np.einsum("ijk->j", self.as3(dy)), target, self.bias_is_param)
        if propagate_down[0] and bottom[0].diff is not dy:
            bottom[0].diff[...] = dy
