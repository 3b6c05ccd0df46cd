"""The neuron layers' GPU kernels (neuron.py's classes take them as ``forward_gpu``/``backward_gpu``).

Each keeps the CPU layer's order of operations, and NaN passes through every
kernel as through the CPU's NumPy code (np.maximum, np.sign and exp keep NaN),
so a diverging run shows NaN on both devices and the NaN stop fires.
A kernel function returns False where the layer's own array code should run
(on CuPy) instead.
"""
from __future__ import annotations

import numpy as np

from ..backend import kernels
from ..backend.kernels import contiguous, i32, i64
from .reduce_gpu import DOT_NEGATIVE, channel_sums

kernels.register("neuron", r"""
#define SN_ISNAN(v) ((v) != (v))
extern "C" __global__ void relu_fwd(const T* x, T* y, long long n, T slope) {
  GRID_LOOP(i, n) {
    T v = x[i];
    y[i] = SN_ISNAN(v) ? v : (v > 0 ? v : (T)0) + slope * (v < 0 ? v : (T)0);
  }
}

extern "C" __global__ void relu_bwd(const T* s, const T* dy, T* dx, long long n, T slope) {
  GRID_LOOP(i, n) dx[i] = dy[i] * (s[i] > 0 ? (T)1 : slope);
}

extern "C" __global__ void prelu_fwd(const T* x, const T* slope, T* y, long long n, int C, long long inner) {
  GRID_LOOP(i, n) {
    T v = x[i];
    T neg = (v < 0 ? v : (T)0) * slope[(i / inner) % C];
    y[i] = SN_ISNAN(v) ? v : (v > 0 ? v : (T)0) + neg;
  }
}

extern "C" __global__ void prelu_bwd(const T* x, const T* dy, const T* slope, T* dx, long long n, int C,
    long long inner) {
  GRID_LOOP(i, n) dx[i] = dy[i] * (x[i] > 0 ? (T)1 : slope[(i / inner) % C]);
}

extern "C" __global__ void elu_fwd(const T* x, T* y, long long n, T alpha) {
  GRID_LOOP(i, n) {
    T v = x[i];
    T neg = (sn_exp(v < 0 ? v : (T)0) - (T)1) * alpha;    // Caffe's exp(x) - 1, not expm1
    y[i] = SN_ISNAN(v) ? v : (v > 0 ? v : (T)0) + neg;
  }
}

extern "C" __global__ void elu_bwd(const T* s, const T* y, const T* dy, T* dx, long long n, T alpha) {
  GRID_LOOP(i, n) dx[i] = dy[i] * (s[i] > 0 ? (T)1 : y[i] + alpha);
}

extern "C" __global__ void sigmoid_fwd(const T* x, T* y, long long n) {
  GRID_LOOP(i, n) y[i] = sn_tanh(x[i] * (T)0.5) * (T)0.5 + (T)0.5;
}

extern "C" __global__ void sigmoid_bwd(const T* y, const T* dy, T* dx, long long n) {
  GRID_LOOP(i, n) {
    T v = y[i];
    dx[i] = dy[i] * (((T)1 - v) * v);
  }
}

extern "C" __global__ void tanh_fwd(const T* x, T* y, long long n) {
  GRID_LOOP(i, n) y[i] = sn_tanh(x[i]);
}

extern "C" __global__ void tanh_bwd(const T* y, const T* dy, T* dx, long long n) {
  GRID_LOOP(i, n) {
    T v = y[i];
    dx[i] = dy[i] * ((T)1 - v * v);
  }
}

extern "C" __global__ void abs_fwd(const T* x, T* y, long long n) {
  GRID_LOOP(i, n) y[i] = sn_abs(x[i]);
}

// dx = sign(x) dy, sign(NaN) = NaN as np.sign
extern "C" __global__ void abs_bwd(const T* x, const T* dy, T* dx, long long n) {
  GRID_LOOP(i, n) {
    T v = x[i];
    dx[i] = dy[i] * (SN_ISNAN(v) ? v : (T)((v > 0) - (v < 0)));
  }
}

// y = (shift + scale x)^power, each step only where it changes something (as the CPU layer)
extern "C" __global__ void power_fwd(const T* x, T* y, long long n, T scale, T shift, T power) {
  GRID_LOOP(i, n) {
    T v = x[i];
    if (scale != (T)1) v = v * scale;
    if (shift != (T)0) v = v + shift;
    if (power != (T)1) v = sn_pow(v, power);
    y[i] = v;
  }
}

// Caffe's backward branches: 2 power == 2, 3 shift == 0 (power y / x), 4 the general one
extern "C" __global__ void power_bwd(const T* x, const T* y, const T* dy, T* dx, long long n, int branch,
    T a, T b, T c) {
  GRID_LOOP(i, n) {
    T d;
    if (branch == 2) {                   // a = diff_scale scale, b = diff_scale shift (c: has shift)
      d = x[i] * a;
      if (c != (T)0) d = d + b;
    } else if (branch == 3) {            // a = power
      d = y[i] / x[i];
      d = d * a;
    } else {                             // a = scale, b = shift, c = diff_scale
      d = x[i] * a;
      d = d + b;
      d = y[i] / d;
      d = d * c;
    }
    dx[i] = dy[i] * d;
  }
}
""")


def _run(name, n, *args, dtype):
    kernels.launch("neuron", name, n, *args, dtype=dtype)


def relu_forward(layer, x, y):
    contiguous(x, y)
    _run("relu_fwd", x.size, x, y, i64(x.size), x.dtype.type(layer.slope), dtype=x.dtype)


def relu_backward(layer, x, y, dy, dx, propagate):
    if propagate:
        contiguous(x, y, dy, dx)
        s = y if layer.slope >= 0 else x
        _run("relu_bwd", dy.size, s, dy, dx, i64(dy.size), dy.dtype.type(layer.slope), dtype=dy.dtype)


def _prelu_view(layer, x):
    """(C, inner) of PReLU's slope broadcast: one shared slope, or one per channel (axis 1)."""
    if layer.shared:
        return 1, x.size
    return x.shape[1], int(np.prod(x.shape[2:], dtype=np.int64))


def prelu_forward(layer, x, y):
    contiguous(x, y)
    C, inner = _prelu_view(layer, x)
    _run("prelu_fwd", x.size, x, layer.blobs[0].data, y, i64(x.size), i32(C), i64(inner), dtype=x.dtype)


def prelu_backward(layer, x, y, dy, dx, propagate):
    contiguous(x, dy, dx)
    n = dy.size
    C, inner = _prelu_view(layer, x)
    slope = layer.blobs[0]
    grad, _ = channel_sums(dy, (n // (C * inner), C, inner), DOT_NEGATIVE, b=x)   # before dx overwrites dy
    slope.diff += grad.reshape(slope.diff.shape)
    if propagate:
        _run("prelu_bwd", n, x, dy, slope.data, dx, i64(n), i32(C), i64(inner), dtype=dy.dtype)


def elu_forward(layer, x, y):
    contiguous(x, y)
    _run("elu_fwd", x.size, x, y, i64(x.size), x.dtype.type(layer.alpha), dtype=x.dtype)


def elu_backward(layer, x, y, dy, dx, propagate):
    if propagate:
        contiguous(x, y, dy, dx)
        s = x if layer.needs_x else y
        _run("elu_bwd", dy.size, s, y, dy, dx, i64(dy.size), dy.dtype.type(layer.alpha), dtype=dy.dtype)


def _unary(name):
    def forward(layer, x, y):
        contiguous(x, y)
        _run(name, x.size, x, y, i64(x.size), dtype=x.dtype)
    return forward


sigmoid_forward, tanh_forward, abs_forward = _unary("sigmoid_fwd"), _unary("tanh_fwd"), _unary("abs_fwd")


def _from_y(name):
    def backward(layer, x, y, dy, dx, propagate):
        if propagate:
            contiguous(y, dy, dx)
            _run(name, dy.size, y, dy, dx, i64(dy.size), dtype=dy.dtype)
    return backward


sigmoid_backward, tanh_backward = _from_y("sigmoid_bwd"), _from_y("tanh_bwd")


def abs_backward(layer, x, y, dy, dx, propagate):
    if propagate:
        contiguous(x, dy, dx)
        _run("abs_bwd", dy.size, x, dy, dx, i64(dy.size), dtype=dy.dtype)


def power_forward(layer, x, y):
    if layer.diff_scale == 0:
        return False                # a constant: the layer's own fill
    contiguous(x, y)
    T = x.dtype.type
    _run("power_fwd", x.size, x, y, i64(x.size), T(layer.scale), T(layer.shift), T(layer.power), dtype=x.dtype)


def power_backward(layer, x, y, dy, dx, propagate):
    if not propagate:
        return None
    ds, scale, shift, power = layer.diff_scale, layer.scale, layer.shift, layer.power
    if ds == 0 or power == 1:
        return False                # a constant derivative: the layer's own multiply
    contiguous(x, y, dy, dx)
    if power == 2:
        branch, a, b, c = 2, ds * scale, ds * shift, float(shift != 0)
    elif shift == 0:
        branch, a, b, c = 3, power, 0, 0
    else:
        branch, a, b, c = 4, scale, shift, ds
    T = dy.dtype.type
    _run("power_bwd", dy.size, x, y if y is not None else x, dy, dx, i64(dy.size), i32(branch), T(a), T(b), T(c),
         dtype=dy.dtype)
