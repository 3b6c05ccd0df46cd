"""Caffe's fillers (include/caffe/filler.hpp): ``fill(filler_param, array, rng)``.

Values are drawn on the host with a NumPy Generator and written into the
array in place (NumPy, or CuPy through ``.set``). Caffe's legacy accessors set
the fans: num = shape[0], channels = shape[1] (1 when absent),
fan_in = count / num, fan_out = count / channels.
"""
from __future__ import annotations

import math

import numpy as np


def fill(filler_param, array, rng) -> None:
    """Fill ``array`` in place as Caffe's filler ``filler_param.type`` would."""
    kind = filler_param.type
    make = _FILLERS.get(kind)
    if make is None:
        raise ValueError(f'unknown filler type "{kind}" (supported: {", ".join(sorted(_FILLERS))})')
    if kind != "gaussian" and filler_param.sparse != -1:
        raise ValueError(f'filler "{kind}": sparsity is supported only by the gaussian filler')
    shape = tuple(array.shape)
    values = make(filler_param, shape, rng, np.dtype(array.dtype))
    if isinstance(array, np.ndarray):
        array[...] = values
    else:                                   # CuPy: one host-to-device copy
        array.set(np.ascontiguousarray(np.broadcast_to(values, shape), dtype=array.dtype))


def _fans(shape):
    n = math.prod(shape)
    num = shape[0] if len(shape) > 0 else 1
    channels = shape[1] if len(shape) > 1 else 1
    return n // num, n // channels


def _variance_n(p, shape):
    fan_in, fan_out = _fans(shape)
    norm = p.VarianceNorm.Name(p.variance_norm)
    return {"FAN_IN": fan_in, "FAN_OUT": fan_out, "AVERAGE": (fan_in + fan_out) / 2}[norm]


def _uniform(rng, shape, lo, hi):
    if lo > hi:
        raise ValueError(f"uniform filler: min {lo} > max {hi}")
    return rng.uniform(lo, hi, shape)


def _gaussian(rng, shape, mean, std):
    if not std > 0:
        raise ValueError(f"gaussian filler: std must be > 0, got {std}")
    return mean + std * rng.standard_normal(shape)


def _constant(p, shape, rng, dtype):
    return p.value


def _uniform_filler(p, shape, rng, dtype):
    return _uniform(rng, shape, p.min, p.max)


def _gaussian_filler(p, shape, rng, dtype):
    x = _gaussian(rng, shape, p.mean, p.std)
    if p.sparse < -1:
        raise ValueError(f"gaussian filler: sparse must be >= -1, got {p.sparse}")
    if p.sparse >= 0:
        if not shape:
            raise ValueError("gaussian filler: sparse needs a blob with at least one axis")
        # Caffe divides by num_outputs = shape[0] (not by the fan-in its comment suggests).
        prob = p.sparse / shape[0]
        if prob > 1:
            raise ValueError(f"gaussian filler: sparse {p.sparse} / shape[0] {shape[0]} > 1")
        x *= rng.random(shape) < prob
    return x


def _positive_unitball(p, shape, rng, dtype):
    x = rng.random(shape).astype(dtype)
    rows = x.reshape(shape[0] if shape else 1, -1)
    rows /= rows.sum(axis=1, keepdims=True)
    return x


def _xavier(p, shape, rng, dtype):
    scale = math.sqrt(3.0 / _variance_n(p, shape))
    return _uniform(rng, shape, -scale, scale)


def _msra(p, shape, rng, dtype):
    return _gaussian(rng, shape, 0.0, math.sqrt(2.0 / _variance_n(p, shape)))


def _bilinear(p, shape, rng, dtype):
    if len(shape) != 4 or shape[2] != shape[3]:
        raise ValueError(f"bilinear filler needs a 4-D blob with a square kernel, got shape {shape}")
    k = shape[3]
    f = math.ceil(k / 2)
    c = dtype.type((k - 1) / (2.0 * f))     # the fixed formula of BVLC master (#5713)
    x = np.arange(k, dtype=dtype)
    w = 1 - np.abs(x / dtype.type(f) - c)
    return np.outer(w, w)                   # the same k x k kernel for every (n, c)


_FILLERS = {
    "constant": _constant,
    "uniform": _uniform_filler,
    "gaussian": _gaussian_filler,
    "positive_unitball": _positive_unitball,
    "xavier": _xavier,
    "msra": _msra,
    "bilinear": _bilinear,
}
