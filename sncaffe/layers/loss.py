"""Softmax, the loss layers, and the forward-only evaluation layers (Accuracy, ArgMax).

Loss layers write a 0-axis top whose diff is the loss weight; their backward
scales by it. Like Caffe's LossLayer they need bottom[0].shape[0] ==
bottom[1].shape[0] and never differentiate the label (or target) bottom,
except EuclideanLoss. Backward recomputes softmax/sigmoid from the bottom
instead of keeping it from forward: the bottoms are alive anyway (labels).
"""
from __future__ import annotations

import numpy as np

from ..backend import is_gpu, workers
from . import loss_gpu
from .base import Layer, array_module, canonical_axis, count, register

FLT_MIN = float(np.finfo(np.float32).tiny)   # Caffe clamps log(prob) with FLT_MIN for every Dtype


def _split(shape, axis):
    """(outer, channels, inner) around ``axis``: the 3-D view all these layers work on."""
    return count(shape, 0, axis), shape[axis], count(shape, axis + 1)


def _softmax(xp, x3, out3):
    """Stable softmax over axis 1 of (outer, C, inner) views; ``out3`` may be ``x3``."""
    m = x3.max(axis=1, keepdims=True)
    xp.subtract(x3, m, out=out3)
    xp.exp(out3, out=out3)
    out3 /= out3.sum(axis=1, keepdims=True)


def _softmax_rows(x3, out3):
    """``_softmax`` of NumPy views, its outer rows on threads (backend/workers): each row's
    max and sum are its own, so the pieces keep every sum's order."""
    workers.split(x3.shape[0], 4 * x3.size, lambda rows: _softmax(np, x3[rows], out3[rows]))


def _sigmoid(xp, x, out):
    """Caffe's sigmoid: 0.5 * tanh(0.5 x) + 0.5."""
    xp.multiply(x, 0.5, out=out)
    xp.tanh(out, out=out)
    out *= 0.5
    out += 0.5


def _ignore_label(p):
    """An optional ignore_label: None unless the field is set (Caffe's has_ignore_label)."""
    return p.ignore_label if p.HasField("ignore_label") else None


def _labels(layer, xp, label, outer, inner, channels, ignore_label):
    """Labels as (outer, inner) ints (static_cast<int>: truncation) and the valid mask.

    Ignored labels are replaced by 0 so they can index; the mask is None
    without ignore_label. Labels out of [0, channels) are an error.
    """
    lab = label.reshape(outer, inner).astype(xp.int64)
    valid = None if ignore_label is None else lab != ignore_label
    bad = (lab < 0) | (lab >= channels)
    if valid is not None:
        bad &= valid
        lab = xp.where(valid, lab, 0)
    if xp is not np:                # no device-to-host sync per iteration
        loss_gpu.check_labels(layer, bad, channels)
    elif bool(bad.any()):
        i, j = divmod(int(bad.ravel().argmax()), inner)
        value = float(label.reshape(outer, inner)[i, j])
        at = f"item {i} of the batch" + (f", position {j}" if inner > 1 else "")
        raise layer.error(f"label out of range [0, {channels}): {value:g} at {at}")
    return lab, valid


def _pick(x3, lab):
    """x3[i, lab[i, j], j] for every (i, j)."""
    xp = array_module(x3)
    outer, _, inner = x3.shape
    return x3[xp.arange(outer)[:, None], lab, xp.arange(inner)[None, :]]


class _Loss(Layer):
    """Common setup of Caffe's LossLayer subclasses: two bottoms, a 0-axis loss top."""
    exact_bottoms = 2
    exact_tops = 1
    is_loss = True
    backward_needs = ("bottom",)
    default_normalization = "VALID"

    def allow_force_backward(self, bottom_index):
        return bottom_index != 1

    def setup_loss(self, bottom_shapes):
        a, b = bottom_shapes
        if not a or not b or a[0] != b[0]:
            raise self.error(f"data {a} and label {b} should have the same first dimension")
        p = self.param.loss_param
        self.ignore_label = _ignore_label(p)
        # Caffe: an explicit normalization wins, then the legacy bool, then the layer's default.
        if p.HasField("normalization"):
            self.normalization = p.NormalizationMode.Name(p.normalization)
        elif p.HasField("normalize"):
            self.normalization = "VALID" if p.normalize else "BATCH_SIZE"
        else:
            self.normalization = self.default_normalization

    def normalizer(self, xp, dtype, outer, inner, valid):
        """Caffe's get_normalizer, clamped below at 1, as a 0-d array of ``dtype``."""
        mode = self.normalization
        if mode == "FULL" or (mode == "VALID" and valid is None):
            n = outer * inner
        elif mode == "VALID":
            return xp.maximum(valid.sum(), 1).astype(dtype)
        else:
            n = outer if mode == "BATCH_SIZE" else 1
        return xp.asarray(max(n, 1), dtype=dtype)

    def check_label_backward(self, propagate_down):
        if propagate_down[1]:
            raise self.error("cannot backpropagate to the label input")


@register
class Softmax(Layer):
    type = "Softmax"
    exact_bottoms = exact_tops = 1
    backward_needs = ("top",)

    def setup(self, bottom_shapes):
        shape = bottom_shapes[0]
        self.dims = _split(shape, canonical_axis(self, self.param.softmax_param.axis, len(shape)))
        return [shape]

    def forward(self, bottom, top):
        xp = array_module(bottom[0].data)
        if xp is not np:
            return loss_gpu.softmax_forward(bottom[0].data, top[0].data, self.dims)
        _softmax_rows(bottom[0].data.reshape(self.dims), top[0].data.reshape(self.dims))

    def backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        xp = array_module(top[0].data)
        if xp is not np:
            return loss_gpu.softmax_backward(top[0].data, top[0].diff, bottom[0].diff, self.dims)
        y, dy = top[0].data.reshape(self.dims), top[0].diff.reshape(self.dims)
        dx = bottom[0].diff.reshape(self.dims)

        def rows(r):        # each outer row's sum is its own: split over threads
            dot = np.einsum("ocn,ocn->on", dy[r], y[r])[:, None, :]   # before dx: dx may alias dy in place
            np.subtract(dy[r], dot, out=dx[r])
            dx[r] *= y[r]
        workers.split(self.dims[0], 4 * y.size, rows)


@register
class SoftmaxWithLoss(_Loss):
    type = "SoftmaxWithLoss"
    exact_tops = None
    min_tops, max_tops = 1, 2

    def setup(self, bottom_shapes):
        self.setup_loss(bottom_shapes)
        shape, label_shape = bottom_shapes
        axis = canonical_axis(self, self.param.softmax_param.axis, len(shape))
        self.dims = _split(shape, axis)
        outer, _, inner = self.dims
        if count(label_shape) != outer * inner:
            raise self.error(f"label count {count(label_shape)} must be outer * inner = {outer * inner} "
                             f"(data {shape}, softmax axis {axis})")
        self.class_weights = self._class_weights(shape[axis])
        if len(self.param.top) > 1:
            return [(), shape]              # the second top is the softmax itself
        self.workspace_specs = {"prob": (shape, None)}
        self.backward_workspace_specs = {}  # backward writes the softmax into bottom[0].diff
        return [()]

    def _class_weights(self, channels):
        """caffe-segnet's weight_by_label_freqs: one class_weighting per class (None: unweighted)."""
        p = self.param.loss_param
        if not p.weight_by_label_freqs:
            return None
        if len(p.class_weighting) != channels:
            raise self.error(f"loss_param gives {len(p.class_weighting)} class_weighting values for {channels} classes")
        if is_gpu(self.target):
            raise self.error("weight_by_label_freqs runs on the CPU only")
        return np.asarray(p.class_weighting, np.float64)

    def read_labels(self, xp, label):
        outer, channels, inner = self.dims
        return _labels(self, xp, label, outer, inner, channels, self.ignore_label)

    def forward(self, bottom, top):
        xp = array_module(bottom[0].data)
        if xp is not np:
            return loss_gpu.softmax_loss_forward(self, bottom, top)
        prob = (top[1].data if len(top) > 1 else self.workspace["prob"]).reshape(self.dims)
        _softmax_rows(bottom[0].data.reshape(self.dims), prob)
        lab, valid = self.read_labels(xp, bottom[1].data)
        logp = xp.log(xp.maximum(_pick(prob, lab), FLT_MIN))
        if self.class_weights is not None:
            logp = logp * self.class_weights.astype(logp.dtype)[lab]
        if valid is not None:
            logp = xp.where(valid, logp, 0)
        top[0].data[...] = -logp.sum() / self.normalizer(xp, logp.dtype, self.dims[0], self.dims[2], valid)

    def backward(self, top, propagate_down, bottom):
        if array_module(bottom[0].data) is not np:
            return loss_gpu.softmax_loss_backward(self, top, propagate_down, bottom)
        self.check_label_backward(propagate_down)
        if not propagate_down[0]:
            return
        xp = array_module(bottom[0].data)
        dx = bottom[0].diff.reshape(self.dims)
        _softmax_rows(bottom[0].data.reshape(self.dims), dx)
        lab, valid = self.read_labels(xp, bottom[1].data)
        outer, _, inner = self.dims
        dx[xp.arange(outer)[:, None], lab, xp.arange(inner)[None, :]] -= 1
        if self.class_weights is not None:
            dx *= self.class_weights.astype(dx.dtype)[lab][:, None, :]
        if valid is not None:
            dx *= valid[:, None, :]
        dx *= top[0].diff / self.normalizer(xp, dx.dtype, outer, inner, valid)


@register
class EuclideanLoss(_Loss):
    type = "EuclideanLoss"

    def allow_force_backward(self, bottom_index):
        return True

    def setup(self, bottom_shapes):
        self.setup_loss(bottom_shapes)
        a, b = bottom_shapes
        if count(a) != count(b):
            raise self.error(f"bottoms {a} and {b} must have the same count")
        self.workspace_specs = {"diff": (a, None)}
        self.backward_workspace_specs = {}
        return [()]

    def forward(self, bottom, top):
        xp = array_module(bottom[0].data)
        d = self.workspace["diff"]
        xp.subtract(bottom[0].data, bottom[1].data.reshape(d.shape), out=d)
        d = d.reshape(-1)
        top[0].data[...] = xp.dot(d, d) / d.dtype.type(bottom[0].shape[0]) / 2

    def backward(self, top, propagate_down, bottom):
        xp = array_module(bottom[0].data)
        shape = bottom[0].shape
        a, b = bottom[0].data, bottom[1].data.reshape(shape)
        for i, sign in ((0, 1), (1, -1)):
            if propagate_down[i]:
                dx = bottom[i].diff.reshape(shape)
                xp.subtract(a, b, out=dx)
                dx *= sign * top[0].diff / bottom[i].shape[0]


@register
class SigmoidCrossEntropyLoss(_Loss):
    type = "SigmoidCrossEntropyLoss"
    default_normalization = "BATCH_SIZE"    # unlike SoftmaxWithLoss (see golden README)

    def setup(self, bottom_shapes):
        self.setup_loss(bottom_shapes)
        a, b = bottom_shapes
        if count(a) != count(b):
            raise self.error(f"logits {a} and targets {b} must have the same count")
        self.outer, self.inner = a[0], count(a, 1)
        return [()]

    def _valid(self, xp, target):
        if self.ignore_label is None:
            return None
        return target.astype(xp.int64) != self.ignore_label   # static_cast<int> of the target

    def forward(self, bottom, top):
        xp = array_module(bottom[0].data)
        if xp is not np:
            return loss_gpu.sigmoid_ce_forward(self, bottom, top)
        x = bottom[0].data
        t = bottom[1].data.reshape(x.shape)
        pos = (x >= 0).astype(x.dtype)
        # Caffe's stable form: x (t - [x >= 0]) - log(1 + exp(x - 2 x [x >= 0])), negated
        loss = xp.log(1 + xp.exp(x - 2 * x * pos)) - x * (t - pos)
        valid = self._valid(xp, t)
        if valid is not None:
            loss = xp.where(valid, loss, 0)
        top[0].data[...] = loss.sum() / self.normalizer(xp, x.dtype, self.outer, self.inner, valid)

    def backward(self, top, propagate_down, bottom):
        if array_module(bottom[0].data) is not np:
            return loss_gpu.sigmoid_ce_backward(self, top, propagate_down, bottom)
        self.check_label_backward(propagate_down)
        if not propagate_down[0]:
            return
        xp = array_module(bottom[0].data)
        x, dx = bottom[0].data, bottom[0].diff
        t = bottom[1].data.reshape(x.shape)
        _sigmoid(xp, x, dx)
        dx -= t
        valid = self._valid(xp, t)
        if valid is not None:
            dx *= valid
        dx *= top[0].diff / self.normalizer(xp, dx.dtype, self.outer, self.inner, valid)


class _ForwardOnly(Layer):
    """Caffe's NOT_IMPLEMENTED backward: nothing to differentiate, ever."""
    backward_needs = ()

    def allow_force_backward(self, bottom_index):
        return False

    def backward(self, top, propagate_down, bottom):
        if any(propagate_down):
            raise self.error("has no backward")


@register
class Accuracy(_ForwardOnly):
    type = "Accuracy"
    exact_bottoms = 2
    min_tops, max_tops = 1, 2

    def setup(self, bottom_shapes):
        shape, label_shape = bottom_shapes
        p = self.param.accuracy_param
        self.top_k, self.ignore_label = p.top_k, _ignore_label(p)
        self.dims = _split(shape, canonical_axis(self, p.axis, len(shape)))
        outer, channels, inner = self.dims
        if count(label_shape) != outer * inner:
            raise self.error(f"label count {count(label_shape)} must be outer * inner = {outer * inner}")
        if self.top_k > count(shape) // count(label_shape):
            raise self.error(f"top_k {self.top_k} must be <= the number of classes")
        return [()] + [(channels,)] * (len(self.param.top) - 1)   # second top: per-class accuracy

    def forward(self, bottom, top):
        xp = array_module(bottom[0].data)
        outer, channels, inner = self.dims
        x = bottom[0].data.reshape(self.dims)
        lab, valid = _labels(self, xp, bottom[1].data, outer, inner, channels, self.ignore_label)
        # Rank of the true class, ties counted against it: Caffe's ">=" count minus itself.
        better = (x >= _pick(x, lab)[:, None, :]).sum(axis=1) - 1
        hit = better < self.top_k
        if valid is not None:
            hit &= valid
        n = xp.asarray(outer * inner) if valid is None else valid.sum()
        top[0].data[...] = xp.where(n == 0, 0, hit.sum() / xp.maximum(n, 1))
        if len(top) > 1:
            labels = lab.reshape(-1) if valid is None else lab[valid]
            nums = xp.bincount(labels, minlength=channels)
            hits = xp.bincount(lab[hit], minlength=channels)
            top[1].data[...] = xp.where(nums == 0, 0, hits / xp.maximum(nums, 1))


@register
class ArgMax(_ForwardOnly):
    type = "ArgMax"
    exact_bottoms = exact_tops = 1

    def setup(self, bottom_shapes):
        shape = bottom_shapes[0]
        p = self.param.argmax_param
        self.top_k, self.out_max_val = p.top_k, p.out_max_val
        if self.top_k < 1:
            raise self.error("top_k must be >= 1")
        if p.HasField("axis"):
            axis = canonical_axis(self, p.axis, len(shape))
            if self.top_k > shape[axis]:
                raise self.error(f"top_k {self.top_k} must be <= dimension {shape[axis]} of axis {axis}")
            self.dims, self.pairs = _split(shape, axis), False
            top = list(shape)
            top[axis] = self.top_k
        else:
            # Caffe: over each instance flattened; top (N, 1 or 2, top_k) padded with 1s to the bottom's axes.
            if self.top_k > count(shape, 1):
                raise self.error(f"top_k {self.top_k} must be <= the instance size {count(shape, 1)}")
            self.dims, self.pairs = (shape[0], count(shape, 1), 1), self.out_max_val
            top = [1] * max(3, len(shape))
            top[0], top[1], top[2] = shape[0], 2 if self.out_max_val else 1, self.top_k
        return [tuple(top)]

    def forward(self, bottom, top):
        xp = array_module(bottom[0].data)
        x = bottom[0].data.reshape(self.dims)
        outer, _, inner = self.dims
        # std::partial_sort with std::greater on (value, index): ties put the larger index first,
        # which is the reverse of a stable ascending sort.
        kind = "stable" if xp is np else None
        idx = xp.argsort(x, axis=1, kind=kind)[:, ::-1][:, :self.top_k]
        out = top[0].data.reshape(outer, -1, self.top_k, inner)   # (outer, 1 or 2, top_k, inner)
        if self.pairs:
            out[:, 0] = idx
            out[:, 1] = xp.take_along_axis(x, idx, axis=1)
        else:
            out[:, 0] = xp.take_along_axis(x, idx, axis=1) if self.out_max_val else idx
