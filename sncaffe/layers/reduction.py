"""Reduction and MVN: statistics over the trailing axes of each item (Caffe's reduction and
mvn layers)."""
from __future__ import annotations

import numpy as np

from .base import Layer, array_module, canonical_axis, count, register


@register
class Reduction(Layer):
    """SUM, ASUM, SUMSQ or MEAN over every axis from ``axis`` to the end, times ``coeff``; the
    top keeps the axes before ``axis`` (axis 0: a 0-axis scalar)."""
    type = "Reduction"
    exact_bottoms = exact_tops = 1

    def setup(self, bottom_shapes):
        p, shape = self.param.reduction_param, tuple(bottom_shapes[0])
        axis = canonical_axis(self, p.axis, len(shape))
        self.op = p.ReductionOp.Name(p.operation)
        self.num, self.dim = count(shape, 0, axis), count(shape, axis)
        # Caffe's coeff_ is a Dtype: for MEAN, coeff / dim in the net's precision (the proto's coeff is a float)
        t = np.dtype(self.dtype).type
        self.coeff = float(t(np.float32(p.coeff)) / t(self.dim)) if self.op == "MEAN" else p.coeff
        self.backward_needs = ("bottom",) if self.op in ("ASUM", "SUMSQ") else ()
        return [shape[:axis]]

    def forward(self, bottom, top):
        xp = array_module(bottom[0].data)
        x = bottom[0].data.reshape(self.num, self.dim)
        y = top[0].data.reshape(self.num)
        if self.op in ("SUM", "MEAN"):
            x.sum(axis=1, out=y)
        elif self.op == "ASUM":
            xp.abs(x).sum(axis=1, out=y)
        else:
            xp.multiply(x, x).sum(axis=1, out=y)
        if self.coeff != 1:
            y *= self.coeff

    def backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        xp = array_module(top[0].diff)
        g = top[0].diff.reshape(self.num, 1) * top[0].diff.dtype.type(self.coeff)
        dx = bottom[0].diff.reshape(self.num, self.dim)
        if self.op in ("SUM", "MEAN"):
            dx[...] = g
        elif self.op == "ASUM":
            xp.sign(bottom[0].data.reshape(self.num, self.dim), out=dx)
            dx *= g
        else:
            xp.multiply(bottom[0].data.reshape(self.num, self.dim), 2 * g, out=dx)


@register
class MVN(Layer):
    """Mean-variance normalization per (item, channel), or per item across channels:
    y = (x - mean) / (std + eps) with the population std, or y = x - mean. Caffe's legacy 4-D
    view: at most 4 axes, and the top is (num, channels, height, width)."""
    type = "MVN"
    exact_bottoms = exact_tops = 1
    flops_per_output = 6        # forward FLOPs per top element (plan/planner.layer_flops)

    def setup(self, bottom_shapes):
        p, shape = self.param.mvn_param, tuple(bottom_shapes[0])
        if len(shape) > 4:
            raise self.error(f"takes a bottom of at most 4 axes (num, channels, height, width), got {shape}")
        legacy = shape + (1,) * (4 - len(shape))
        self.across, self.normalize, self.eps = p.across_channels, p.normalize_variance, p.eps
        self.num = legacy[0] if self.across else legacy[0] * legacy[1]
        self.dim = count(legacy) // self.num if self.num else 0
        if self.normalize:
            self.scratch_specs = {"std": ((self.num, 1), None)}
            self.backward_needs = ("top",)
        else:
            self.backward_needs = ()
        return [legacy]

    def forward(self, bottom, top):
        xp = array_module(bottom[0].data)
        x = bottom[0].data.reshape(self.num, self.dim)
        y = top[0].data.reshape(self.num, self.dim)
        mean = x.sum(axis=1, keepdims=True)
        mean *= x.dtype.type(1 / self.dim)
        xp.subtract(x, mean, out=y)
        if self.normalize:
            std = self.scratch["std"]
            xp.multiply(y, y).sum(axis=1, keepdims=True, out=std)
            std *= std.dtype.type(1 / self.dim)
            xp.sqrt(std, out=std)
            std += std.dtype.type(self.eps)
            y /= std

    def backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        xp = array_module(top[0].diff)
        dy = top[0].diff.reshape(self.num, self.dim)
        dx = bottom[0].diff.reshape(self.num, self.dim)
        mean_dy = dy.sum(axis=1, keepdims=True)          # before dx overwrites dy (in place)
        if not self.normalize:
            mean_dy *= dy.dtype.type(1 / self.dim)
            xp.subtract(dy, mean_dy, out=dx)
            return
        y = top[0].data.reshape(self.num, self.dim)
        # Caffe: dx = (dy - (y sum(y dy) + sum(dy)) / dim) / (std + eps)
        t = y * xp.multiply(y, dy).sum(axis=1, keepdims=True)
        t += mean_dy
        t *= dy.dtype.type(-1 / self.dim)
        xp.add(dy, t, out=dx)
        dx /= self.scratch["std"]
