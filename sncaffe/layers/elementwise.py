"""More neuron layers, each as Caffe's *_layer.cpp: BNLL, Clip, Exp, Log, Swish, Threshold.

All follow ``neuron.NeuronLayer``: one bottom, one top of the same shape, in
place allowed (a layer whose backward reads x keeps a copy of it in place).
Threshold has no backward, as in Caffe, where it is NOT_IMPLEMENTED.
"""
from __future__ import annotations

import math

import numpy as np

from .base import array_module, register
from .neuron import NeuronLayer

BNLL_THRESHOLD = 50.0       # Caffe's kBNLL_THRESHOLD: exp(min(x, 50)) in backward


def _log_base(layer, base):
    """Caffe's log(base), base -1 meaning e; a base <= 0 is refused."""
    if base == -1:
        return 1.0
    if not base > 0:
        raise layer.error(f"base must be strictly positive (or -1 for e), got {base}")
    return math.log(np.float32(base))


class _Cheap(NeuronLayer):
    cheap = True                # memory runtime: recompute rather than keep (plan/recompute.py)
    flops_per_output = 4        # forward FLOPs per element (plan/planner.layer_flops): a few each


@register
class BNLL(_Cheap):
    """y = log(1 + exp(x)), computed as x + log(1 + exp(-x)) for x > 0."""
    type = "BNLL"
    needs_x = True

    def forward_array(self, x, y):
        xp = array_module(x)
        pos = xp.log1p(xp.exp(-xp.abs(x)))        # log(1 + exp(-|x|)): both of Caffe's branches
        xp.maximum(x, 0, out=y)
        y += pos

    def derivative(self, xp, x, y):
        e = xp.exp(xp.minimum(x, BNLL_THRESHOLD))
        return e / (e + 1)


@register
class Clip(_Cheap):
    """y = max(min, min(x, max)); the gradient passes where min <= x <= max."""
    type = "Clip"
    needs_x = True

    def read_param(self, shape):
        p = self.param.clip_param
        if not (p.HasField("min") and p.HasField("max")):
            raise self.error("clip_param needs both min and max (required in Caffe)")
        self.lo, self.hi = p.min, p.max

    def forward_array(self, x, y):
        array_module(x).clip(x, self.lo, self.hi, out=y)

    def derivative(self, xp, x, y):
        return (x >= x.dtype.type(self.lo)) & (x <= x.dtype.type(self.hi))


@register
class Exp(_Cheap):
    """y = base^(shift + scale x) = outer exp(inner x); backward reads y only."""
    type = "Exp"
    needs_y = True

    def read_param(self, shape):
        p = self.param.exp_param
        log_base = _log_base(self, p.base)
        self.inner = log_base * p.scale
        self.outer = 1.0 if p.shift == 0 else (math.pow(p.base, p.shift) if p.base != -1 else math.exp(p.shift))

    def forward_array(self, x, y):
        xp = array_module(x)
        xp.multiply(x, self.inner, out=y)
        xp.exp(y, out=y)
        if self.outer != 1:
            y *= self.outer

    def derivative(self, xp, x, y):
        return y * self.inner


@register
class Log(_Cheap):
    """y = log_base(shift + scale x)."""
    type = "Log"
    needs_x = True

    def read_param(self, shape):
        p = self.param.log_param
        self.base_scale = 1.0 / _log_base(self, p.base)
        self.scale, self.shift = p.scale, p.shift

    def _arg(self, xp, x, out):
        xp.multiply(x, self.scale, out=out)
        out += self.shift
        return out

    def forward_array(self, x, y):
        xp = array_module(x)
        xp.log(self._arg(xp, x, y), out=y)
        if self.base_scale != 1:
            y *= self.base_scale

    def derivative(self, xp, x, y):
        d = self._arg(xp, x, xp.empty_like(x))
        xp.reciprocal(d, out=d)
        d *= self.scale * self.base_scale
        return d


@register
class Swish(_Cheap):
    """y = x sigmoid(beta x); dy/dx = beta y + s (1 - beta y), s recomputed from x."""
    type = "Swish"
    needs_x = True

    def read_param(self, shape):
        self.beta = self.param.swish_param.beta

    def _sigmoid(self, xp, x, out):
        xp.multiply(x, 0.5 * self.beta, out=out)     # Caffe's Sigmoid: 0.5 tanh(x/2) + 0.5
        xp.tanh(out, out=out)
        out *= 0.5
        out += 0.5
        return out

    def forward_array(self, x, y):
        xp = array_module(x)
        s = self._sigmoid(xp, x, xp.empty_like(x))
        xp.multiply(x, s, out=y)

    def derivative(self, xp, x, y):
        s = self._sigmoid(xp, x, xp.empty_like(x))
        by = x * s
        by *= self.beta
        return by + s * (1 - by)


@register
class Threshold(NeuronLayer):
    """y = 1 where x > threshold, else 0. Forward only: Caffe's backward is NOT_IMPLEMENTED,
    so a net that needs a gradient through it is refused at backward, as Caffe does."""
    type = "Threshold"
    cheap = True

    def read_param(self, shape):
        self.threshold = self.param.threshold_param.threshold

    def forward_array(self, x, y):
        y[...] = x > x.dtype.type(self.threshold)

    def backward(self, top, propagate_down, bottom):
        if any(propagate_down):
            raise self.error("has no backward (Caffe: Not Implemented Yet); it cannot be "
                             "differentiated, so no layer below it may need a gradient "
                             "(check force_backward)")
