"""More of Caffe's loss layers: ContrastiveLoss, HingeLoss, InfogainLoss,
MultinomialLogisticLoss (their *_loss_layer.cpp). The ``_Loss`` base of loss.py gives the
0-axis top, the label checks and the normalization modes; only InfogainLoss uses those modes,
the others divide by the batch size as Caffe does.
"""
from __future__ import annotations

import os

import numpy as np

from .base import array_module, canonical_axis, count, register
from .loss import _Loss, _labels, _softmax, _split

LOG_THRESHOLD = 1e-20       # Caffe's kLOG_THRESHOLD: log(max(p, 1e-20))


def _legacy4(shape):
    return tuple(shape) + (1,) * (4 - len(shape)) if len(shape) <= 4 else None


def _rows(layer, xp, label, n, classes):
    """One label per item, (n,) ints in [0, classes)."""
    lab, _ = _labels(layer, xp, label, n, 1, classes, None)
    return lab.reshape(n)


@register
class ContrastiveLoss(_Loss):
    """Loss over pairs (a, b) with similarity sim: similar pairs add d^2, dissimilar ones
    max(margin - d, 0)^2 (legacy_version: max(margin - d^2, 0)); the sum is divided by 2N.
    As Caffe, the non-legacy gradient divides by d + 1e-4, and sim never gets a gradient."""
    type = "ContrastiveLoss"
    exact_bottoms = 3

    def allow_force_backward(self, bottom_index):
        return bottom_index != 2

    def setup(self, bottom_shapes):
        self.setup_loss(bottom_shapes[:2])
        a, b, sim = (_legacy4(s) for s in bottom_shapes)
        if None in (a, b, sim) or a[1] != b[1] or a[2:] != (1, 1) or b[2:] != (1, 1) or sim[1:] != (1, 1, 1):
            raise self.error(f"bottoms must be (N, C), (N, C) and (N) (with trailing 1s), got "
                             f"{[tuple(s) for s in bottom_shapes]}")
        p = self.param.contrastive_loss_param
        self.margin, self.legacy = p.margin, p.legacy_version
        self.num, self.channels = a[0], a[1]
        return [()]

    def _pairs(self, bottom):
        xp = array_module(bottom[0].data)
        diff = bottom[0].data.reshape(self.num, self.channels) - bottom[1].data.reshape(self.num, self.channels)
        dist_sq = xp.einsum("ij,ij->i", diff, diff)
        similar = bottom[2].data.reshape(self.num).astype(xp.int64) != 0     # static_cast<int>
        return xp, diff, dist_sq, similar

    def forward(self, bottom, top):
        xp, _, dist_sq, similar = self._pairs(bottom)
        T = dist_sq.dtype.type
        if self.legacy:
            apart = xp.maximum(T(self.margin) - dist_sq, 0)
        else:
            apart = xp.maximum(T(self.margin) - xp.sqrt(dist_sq), 0) ** 2
        top[0].data[...] = xp.where(similar, dist_sq, apart).sum() / T(self.num) / T(2)

    def backward(self, top, propagate_down, bottom):
        if len(propagate_down) > 2 and propagate_down[2]:
            bottom[2].diff.fill(0)          # Caffe never writes the similarity's diff
        if not (propagate_down[0] or propagate_down[1]):
            return
        xp, diff, dist_sq, similar = self._pairs(bottom)
        T = diff.dtype.type
        alpha = top[0].diff.astype(diff.dtype) / T(self.num)
        if self.legacy:
            mdist, beta = T(self.margin) - dist_sq, -alpha
        else:
            dist = xp.sqrt(dist_sq)
            mdist = T(self.margin) - dist
            beta = -alpha * mdist / (dist + T(1e-4))
        coef = xp.where(similar, alpha, xp.where(mdist > 0, beta, T(0)))[:, None]
        for i, sign in ((0, 1), (1, -1)):
            if propagate_down[i]:
                xp.multiply(diff, coef * T(sign), out=bottom[i].diff.reshape(self.num, self.channels))


@register
class HingeLoss(_Loss):
    """One-vs-all hinge: with s = -1 at the true class and +1 elsewhere, m = max(0, 1 + s x);
    L1 loss sum(m)/N, L2 loss sum(m^2)/N."""
    type = "HingeLoss"

    def setup(self, bottom_shapes):
        self.setup_loss(bottom_shapes)
        shape = tuple(bottom_shapes[0])
        self.num, self.dim = shape[0], count(shape) // shape[0]
        if count(bottom_shapes[1]) != self.num:
            raise self.error(f"needs one label per item: {count(bottom_shapes[1])} labels for {self.num} items")
        self.norm = self.param.hinge_loss_param.Norm.Name(self.param.hinge_loss_param.norm)
        return [()]

    def _margins(self, bottom):
        """(s, m) as (num, dim) arrays."""
        xp = array_module(bottom[0].data)
        x = bottom[0].data.reshape(self.num, self.dim)
        lab = _rows(self, xp, bottom[1].data, self.num, self.dim)
        s = xp.ones_like(x)
        s[xp.arange(self.num), lab] = -1
        return s, xp.maximum(1 + s * x, 0)

    def forward(self, bottom, top):
        _, m = self._margins(bottom)
        T = m.dtype.type
        top[0].data[...] = (m.sum() if self.norm == "L1" else (m * m).sum()) / T(self.num)

    def backward(self, top, propagate_down, bottom):
        self.check_label_backward(propagate_down)
        if not propagate_down[0]:
            return
        s, m = self._margins(bottom)
        scale = top[0].diff.astype(m.dtype) / m.dtype.type(self.num)
        dx = bottom[0].diff.reshape(self.num, self.dim)
        if self.norm == "L1":
            array_module(m).multiply(s, m > 0, out=dx)
            dx *= scale
        else:
            array_module(m).multiply(s, m, out=dx)
            dx *= 2 * scale


@register
class MultinomialLogisticLoss(_Loss):
    """-mean log p[label] of probabilities (not renormalised), p clamped below at 1e-20; the diff
    is -1/(N p) at the label, 0 elsewhere."""
    type = "MultinomialLogisticLoss"

    def setup(self, bottom_shapes):
        self.setup_loss(bottom_shapes)
        shape, label = (tuple(s) for s in bottom_shapes)
        label4 = _legacy4(label)
        if label4 is None or label4[1:] != (1, 1, 1):
            raise self.error(f"label must be (N) or (N, 1, 1, 1), got {label}")
        self.num, self.dim = shape[0], count(shape) // shape[0]
        return [()]

    def _picked(self, bottom):
        xp = array_module(bottom[0].data)
        p = bottom[0].data.reshape(self.num, self.dim)
        lab = _rows(self, xp, bottom[1].data, self.num, self.dim)
        return xp, lab, xp.maximum(p[xp.arange(self.num), lab], p.dtype.type(LOG_THRESHOLD))

    def forward(self, bottom, top):
        xp, _, prob = self._picked(bottom)
        top[0].data[...] = -xp.log(prob).sum() / prob.dtype.type(self.num)

    def backward(self, top, propagate_down, bottom):
        self.check_label_backward(propagate_down)
        if not propagate_down[0]:
            return
        xp, lab, prob = self._picked(bottom)
        dx = bottom[0].diff.reshape(self.num, self.dim)
        dx.fill(0)
        scale = -top[0].diff.astype(prob.dtype) / prob.dtype.type(self.num)
        dx[xp.arange(self.num), lab] = scale / prob


@register
class InfogainLoss(_Loss):
    """Softmax of bottom[0] over ``axis``, then -sum_l H[y, l] log p_l, normalized as
    loss_param says (default VALID). H is a third bottom, or read at setup from
    ``infogain_loss_param.source``, a BlobProto file resolved against the working directory, as
    Caffe (only its count must be K^2). Neither the label nor H ever gets a gradient: with
    force_backward Caffe stops at Backward, and so does this layer. An optional second top is
    the softmax."""
    type = "InfogainLoss"
    exact_bottoms = exact_tops = None
    min_bottoms, max_bottoms, min_tops, max_tops = 2, 3, 1, 2

    def setup(self, bottom_shapes):
        if self.param.loss_param.HasField("normalize"):
            raise self.error('loss_param.normalize is deprecated; use "normalization"')
        self.setup_loss(bottom_shapes[:2])
        shape = tuple(bottom_shapes[0])
        axis = canonical_axis(self, self.param.infogain_loss_param.axis, len(shape))
        self.dims = _split(shape, axis)
        outer, K, inner = self.dims
        if count(bottom_shapes[1]) != outer * inner:
            raise self.error(f"number of labels {count(bottom_shapes[1])} must match the number of "
                             f"predictions {outer * inner} (data {shape}, infogain axis {axis})")
        if len(bottom_shapes) == 3:
            self.H = None
            n = count(bottom_shapes[2])
        else:
            self.H = self._read_source(K)
            n = self.H.size
        if n != K * K:
            raise self.error(f"H must be {K}x{K} ({K * K} values), got {n}")
        self.workspace_specs = {"prob": (shape, None), "H": ((K, K), None)}
        self.backward_workspace_specs = {"H": ((K, K), None)}
        return [(), shape][:len(self.param.top)]

    def _read_source(self, K):
        from .. import blobproto
        from ..proto import sncaffe_pb2 as pb
        p = self.param.infogain_loss_param
        if not p.source:
            raise self.error("infogain matrix source must be specified (infogain_loss_param.source) "
                             "when H is not a third bottom")
        if not os.path.isfile(p.source):
            raise self.error(f'infogain matrix file not found: "{p.source}" (resolved against the working '
                             f'directory {os.getcwd()}, as Caffe does, not the prototxt\'s folder)')
        try:
            return blobproto.to_array(blobproto.read_binary(p.source, pb.BlobProto()), np.float64)
        except ValueError as e:
            raise self.error(f'cannot read the infogain matrix "{p.source}": {e}') from None

    def allow_force_backward(self, bottom_index):
        return bottom_index != 1

    def _H(self, bottom):
        """H as (K, K) in this call's workspace (from the third bottom or the file)."""
        H = self.workspace["H"]
        src = bottom[2].data if len(bottom) > 2 else self.H
        if isinstance(src, np.ndarray) and not isinstance(H, np.ndarray):
            H.set(src.reshape(H.shape).astype(H.dtype))
        else:
            H[...] = src.reshape(H.shape)
        return H

    def _labels(self, xp, bottom):
        outer, K, inner = self.dims
        return _labels(self, xp, bottom[1].data, outer, inner, K, self.ignore_label)

    def forward(self, bottom, top):
        xp = array_module(bottom[0].data)
        outer, K, inner = self.dims
        prob = (top[1].data if len(top) > 1 else self.workspace["prob"]).reshape(self.dims)
        _softmax(xp, bottom[0].data.reshape(self.dims), prob)
        H = self._H(bottom)
        lab, valid = self._labels(xp, bottom)
        logp = xp.log(xp.maximum(prob, prob.dtype.type(LOG_THRESHOLD)))       # (outer, K, inner)
        rows = H[lab]                                                        # (outer, inner, K)
        per = -xp.einsum("oik,oki->oi", rows, logp)
        if valid is not None:
            per = xp.where(valid, per, 0)
        top[0].data[...] = per.sum() / self.normalizer(xp, per.dtype, outer, inner, valid)

    def backward(self, top, propagate_down, bottom):
        self.check_label_backward(propagate_down)
        if len(propagate_down) > 2 and propagate_down[2]:
            raise self.error("cannot backpropagate to the infogain input H (bottom[2]), as in Caffe; "
                             "remove force_backward or the gradient H asks for")
        if not propagate_down[0]:
            return
        xp = array_module(bottom[0].data)
        outer, K, inner = self.dims
        dx = bottom[0].diff.reshape(self.dims)
        _softmax(xp, bottom[0].data.reshape(self.dims), dx)
        H = self._H(bottom)
        lab, valid = self._labels(xp, bottom)
        rows = H[lab].transpose(0, 2, 1)                                     # (outer, K, inner)
        dx *= H.sum(axis=1)[lab][:, None, :]
        dx -= rows
        if valid is not None:
            dx *= valid[:, None, :]
        dx *= top[0].diff / self.normalizer(xp, dx.dtype, outer, inner, valid)
