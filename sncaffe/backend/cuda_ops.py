"""The layers' GPU kernels: cuDNN convolutions and CUDA kernels with Caffe's exact semantics.

A layer's GPU branch (``xp is not numpy``) calls one function here with its
arrays; device plumbing (modules, handles, descriptors, algorithm search)
stays in this file. Nothing here imports CuPy at module load.

- Convolution and Deconvolution run on cuDNN (``conv_forward``,
  ``conv_backward``): descriptors per shape, and per shape and direction
  the algorithms measured once (cudnnFind*Ex) and cached; each call takes
  the fastest that fits the workspace the layer was given. Under
  ``building_for(device)`` the layer declares that workspace in setup
  (``conv_workspace_specs``: the fastest algorithm within
  ``layer.workspace_limit``, default WORKSPACE_LIMIT); otherwise the largest
  workspace buffer the layer has is used.
- Everything else is CUDA C (RawModule, compiled once per dtype and cached
  by CuPy), written against the scratch each layer declares for the CPU, so
  ``backward_needs`` holds on both devices: pooling keeps Caffe's argmax in
  scratch and never re-reads bottom or top (cuDNN's pooling backward would);
  BatchNorm normalizes and differentiates from its kept ``x_norm`` and
  ``std`` in place; reductions over channels are deterministic (a fixed
  tree per block, then a fixed sum of the blocks), so a run gives the same
  bits whatever the memory mode.
- Dropout (its mask drawn on the host, as on the CPU), STOCHASTIC pooling,
  LRN WITHIN_CHANNEL, Eltwise SUM/PROD, InnerProduct (cuBLAS), Concat, Slice,
  EuclideanLoss, Accuracy and ArgMax run the layers' own array code on CuPy.

``building_for(device)`` marks the device a graph is being built for, so a
layer's ``setup`` can declare GPU workspaces (and drop CPU-only ones); see
``gpu_target()``. ``MATH`` ("fma": exact fp32; "default": TF32 allowed) and
``DETERMINISTIC`` (deterministic convolution algorithms wherever one fits)
apply to every convolution.
"""
from __future__ import annotations

import functools
import threading
from contextlib import contextmanager

import numpy as np

from ..layers.base import array_module as _xp      # numpy or cupy, from an array
from . import cudnn

WORKSPACE_LIMIT = 256 << 20     # a convolution's workspace, unless the layer says workspace_limit
MATH = "fma"                    # cuDNN math type of every convolution: exact fp32
DETERMINISTIC = True            # the same bits every run, whatever the memory mode
BLOCK = 256                     # threads per block (a power of 2, at most 256)
MAX_BLOCKS = 8192               # grid-stride loops cover the rest


def _cupy():
    from .cuda import import_cupy
    return import_cupy()


# -- the device a graph is being built for ---------------------------------------------

_local = threading.local()


@contextmanager
def building_for(device):
    """Layers set up inside this block run on ``device`` (their setup may ask gpu_target())."""
    previous = getattr(_local, "device", None)
    _local.device = device
    if getattr(device, "cudnn", None) is not None:
        register_device(device)
    try:
        yield device
    finally:
        _local.device = previous


def gpu_target():
    """The CUDA device the graph being built will run on, or None (CPU, or not known)."""
    device = getattr(_local, "device", None)
    return device if device is not None and getattr(device, "xp", np) is not np else None


# -- cuDNN handles: one per (GPU, stream) ------------------------------------------------

_handles: dict = {}


def register_device(device) -> None:
    """Use the device's own cuDNN handle for work on its compute stream."""
    _handles[(device.index, device.compute.ptr)] = device.cudnn


def handle():
    """The cuDNN handle bound to CuPy's current device and stream (made on first use)."""
    cp = _cupy()
    stream = cp.cuda.get_current_stream()
    key = (cp.cuda.Device().id, stream.ptr)
    h = _handles.get(key)
    if h is None or h.ptr is None:          # closed with its device
        h = _handles[key] = cudnn.Handle(stream)
    return h


# -- CUDA C ------------------------------------------------------------------------------

_PRELUDE = r"""
typedef %(T)s T;
typedef %(I)s I;
#define SN_FLT_MAX 3.402823466e+38f
#define SN_FLT_MIN 1.175494351e-38f
#define SN_SUM_THREADS 256
#define GRID_LOOP(i, n) \
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < (n); \
       i += (long long)blockDim.x * gridDim.x)
__device__ __forceinline__ float sn_exp(float x) { return expf(x); }
__device__ __forceinline__ double sn_exp(double x) { return exp(x); }
__device__ __forceinline__ float sn_log(float x) { return logf(x); }
__device__ __forceinline__ double sn_log(double x) { return log(x); }
__device__ __forceinline__ float sn_tanh(float x) { return tanhf(x); }
__device__ __forceinline__ double sn_tanh(double x) { return tanh(x); }
__device__ __forceinline__ float sn_pow(float x, float y) { return powf(x, y); }
__device__ __forceinline__ double sn_pow(double x, double y) { return pow(x, y); }
__device__ __forceinline__ float sn_sqrt(float x) { return sqrtf(x); }
__device__ __forceinline__ double sn_sqrt(double x) { return sqrt(x); }
__device__ __forceinline__ float sn_abs(float x) { return fabsf(x); }
__device__ __forceinline__ double sn_abs(double x) { return fabs(x); }
__device__ __forceinline__ int sn_min(int a, int b) { return a < b ? a : b; }
__device__ __forceinline__ int sn_max(int a, int b) { return a > b ? a : b; }
"""

# Caffe's pooling (pooling_layer.cu), keeping the CPU layer's argmax: the tap index in the
# window (row-major), so a window is read once forward and never in backward.
_POOL = r"""
extern "C" __global__ void max_pool_fwd(const T* x, T* y, I* idx, T* mask, int has_mask, long long n,
    int H, int W, int PH, int PW, int kh, int kw, int sh, int sw, int ph, int pw) {
  GRID_LOOP(i, n) {
    int qw = (int)(i % PW);
    long long r = i / PW;
    int qh = (int)(r % PH);
    long long nc = r / PH;
    int hs = qh * sh - ph, ws = qw * sw - pw;
    int he = sn_min(hs + kh, H), we = sn_min(ws + kw, W);
    const T* xs = x + nc * H * W;
    T best = -SN_FLT_MAX;               // Caffe's start; padding never wins
    int tap = 0;
    for (int h = sn_max(hs, 0); h < he; ++h)
      for (int w = sn_max(ws, 0); w < we; ++w) {
        T v = xs[h * W + w];
        if (v > best) { best = v; tap = (h - hs) * kw + (w - ws); }   // strict: the first maximum
      }
    y[i] = best;
    idx[i] = (I)tap;
    if (has_mask) {
      int h = hs + tap / kw, w = ws + tap % kw;
      mask[i] = (h >= 0 && h < H && w >= 0 && w < W) ? (T)(h * W + w) : (T)(-1);
    }
  }
}

extern "C" __global__ void ave_pool_fwd(const T* x, T* y, long long n,
    int H, int W, int PH, int PW, int kh, int kw, int sh, int sw, int ph, int pw) {
  GRID_LOOP(i, n) {
    int qw = (int)(i % PW);
    long long r = i / PW;
    int qh = (int)(r % PH);
    long long nc = r / PH;
    int hs = qh * sh - ph, ws = qw * sw - pw;
    int he = sn_min(hs + kh, H + ph), we = sn_min(ws + kw, W + pw);
    int size = (he - hs) * (we - ws);   // cells in the padding count, cells past it do not
    he = sn_min(he, H);
    we = sn_min(we, W);
    const T* xs = x + nc * H * W;
    T s = 0;
    for (int h = sn_max(hs, 0); h < he; ++h)
      for (int w = sn_max(ws, 0); w < we; ++w)
        s += xs[h * W + w];
    y[i] = s / (T)size;
  }
}

extern "C" __global__ void max_pool_bwd(const T* dy, const I* idx, T* dx, long long n,
    int H, int W, int PH, int PW, int kh, int kw, int sh, int sw, int ph, int pw) {
  GRID_LOOP(i, n) {
    int w = (int)(i % W);
    long long r = i / W;
    int h = (int)(r % H);
    long long nc = r / H;
    int hp = h + ph, wp = w + pw;
    int qh0 = hp < kh ? 0 : (hp - kh) / sh + 1, qh1 = sn_min(hp / sh + 1, PH);
    int qw0 = wp < kw ? 0 : (wp - kw) / sw + 1, qw1 = sn_min(wp / sw + 1, PW);
    const T* d = dy + nc * PH * PW;
    const I* a = idx + nc * PH * PW;
    T g = 0;
    for (int qh = qh0; qh < qh1; ++qh)
      for (int qw = qw0; qw < qw1; ++qw)
        if ((int)a[qh * PW + qw] == (hp - qh * sh) * kw + (wp - qw * sw)) g += d[qh * PW + qw];
    dx[i] = g;
  }
}

extern "C" __global__ void ave_pool_bwd(const T* dy, T* dx, long long n,
    int H, int W, int PH, int PW, int kh, int kw, int sh, int sw, int ph, int pw) {
  GRID_LOOP(i, n) {
    int w = (int)(i % W);
    long long r = i / W;
    int h = (int)(r % H);
    long long nc = r / H;
    int hp = h + ph, wp = w + pw;
    int qh0 = hp < kh ? 0 : (hp - kh) / sh + 1, qh1 = sn_min(hp / sh + 1, PH);
    int qw0 = wp < kw ? 0 : (wp - kw) / sw + 1, qw1 = sn_min(wp / sw + 1, PW);
    const T* d = dy + nc * PH * PW;
    T g = 0;
    for (int qh = qh0; qh < qh1; ++qh) {
      int hs = qh * sh - ph, rows = sn_min(hs + kh, H + ph) - hs;
      for (int qw = qw0; qw < qw1; ++qw) {
        int ws = qw * sw - pw, cols = sn_min(ws + kw, W + pw) - ws;
        g += d[qh * PW + qw] / (T)(rows * cols);
      }
    }
    dx[i] = g;
  }
}
"""

# Elementwise and per-position kernels. ``c = i / inner % C`` is the channel of element i
# of an (outer, C, inner) view. Formulas keep the CPU layers' order of operations.
_OPS = r"""
extern "C" __global__ void relu_fwd(const T* x, T* y, long long n, T slope) {
  GRID_LOOP(i, n) {
    T v = x[i];
    y[i] = (v > 0 ? v : (T)0) + slope * (v < 0 ? v : (T)0);
  }
}

extern "C" __global__ void relu_bwd(const T* s, const T* dy, T* dx, long long n, T slope) {
  GRID_LOOP(i, n) dx[i] = dy[i] * (s[i] > 0 ? (T)1 : slope);
}

extern "C" __global__ void prelu_fwd(const T* x, const T* slope, T* y, long long n, int C, long long inner) {
  GRID_LOOP(i, n) {
    T v = x[i];
    T neg = (v < 0 ? v : (T)0) * slope[(i / inner) % C];
    y[i] = (v > 0 ? v : (T)0) + neg;
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
    y[i] = (v > 0 ? v : (T)0) + neg;
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

extern "C" __global__ void abs_bwd(const T* x, const T* dy, T* dx, long long n) {
  GRID_LOOP(i, n) {
    T v = x[i];
    dx[i] = dy[i] * (T)((v > 0) - (v < 0));
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

// Eltwise MAX: the winner's value and bottom index (ties: bottom 1 over 0, then the earlier)
extern "C" __global__ void eltwise_max_first(const T* a, const T* b, T* y, int* idx, long long n) {
  GRID_LOOP(i, n) {
    T u = a[i], v = b[i];
    if (u > v) { y[i] = u; idx[i] = 0; } else { y[i] = v; idx[i] = 1; }
  }
}

extern "C" __global__ void eltwise_max_next(const T* x, T* y, int* idx, long long n, int k) {
  GRID_LOOP(i, n) {
    T v = x[i];
    if (v > y[i]) { y[i] = v; idx[i] = k; }
  }
}

extern "C" __global__ void eltwise_max_bwd(const T* dy, const int* idx, T* dx, long long n, int k) {
  GRID_LOOP(i, n) dx[i] = idx[i] == k ? dy[i] : (T)0;
}

// y = x * s[c] (+ b[c])
extern "C" __global__ void channel_scale(const T* x, const T* s, const T* b, int has_bias, T* y, long long n,
    int C, long long inner) {
  GRID_LOOP(i, n) {
    int c = (int)((i / inner) % C);
    T v = x[i] * s[c];
    if (has_bias) v = v + b[c];
    y[i] = v;
  }
}

// BatchNorm's statistics: Caffe's running sums from the batch mean and biased variance (update:
// factor = maf factor + 1, sum = maf sum + batch value, the variance unbiased), then var -> std
extern "C" __global__ void bn_stats(const T* mean, T* var, T* mean_sum, T* var_sum, T* factor, int update, int C,
    T maf, T unbias, T eps) {
  GRID_LOOP(c, C) {
    T v = var[c];
    if (update) {
      mean_sum[c] = mean_sum[c] * maf + mean[c];
      var_sum[c] = var_sum[c] * maf + v * unbias;
      if (c == 0) factor[0] = factor[0] * maf + (T)1;
    }
    var[c] = sn_sqrt(v + eps);
  }
}

// BatchNorm: y = (x - mean[c]) / std[c]; x_norm keeps it for backward
extern "C" __global__ void bn_normalize(const T* x, const T* mean, const T* std, T* y, T* x_norm, int keep,
    long long n, int C, long long inner) {
  GRID_LOOP(i, n) {
    int c = (int)((i / inner) % C);
    T v = (x[i] - mean[c]) / std[c];
    y[i] = v;
    if (keep) x_norm[i] = v;
  }
}

// dx = (dy - mean(dy) - mean(dy x_norm) x_norm) / std; dx may be dy
extern "C" __global__ void bn_backward(const T* dy, const T* x_norm, const T* mean_dy, const T* mean_dy_xn,
    const T* std, T* dx, long long n, int C, long long inner) {
  GRID_LOOP(i, n) {
    int c = (int)((i / inner) % C);
    T t = x_norm[i] * mean_dy_xn[c];
    T v = dy[i] - mean_dy[c];
    dx[i] = (v - t) / std[c];
  }
}

// Softmax over C of an (outer, C, inner) view, one thread per (outer, inner) position; y may be x
extern "C" __global__ void softmax_fwd(const T* x, T* y, long long n, int C, long long inner) {
  GRID_LOOP(i, n) {
    long long o = i / inner, k = i - o * inner;
    const T* xs = x + o * C * inner + k;
    T* ys = y + o * C * inner + k;
    T m = xs[0];
    for (int c = 1; c < C; ++c) m = xs[c * inner] > m ? xs[c * inner] : m;
    T s = 0;
    for (int c = 0; c < C; ++c) {
      T e = sn_exp(xs[c * inner] - m);
      ys[c * inner] = e;
      s += e;
    }
    for (int c = 0; c < C; ++c) ys[c * inner] = ys[c * inner] / s;
  }
}

// dx = (dy - sum_c dy y) y; dx may be dy
extern "C" __global__ void softmax_bwd(const T* y, const T* dy, T* dx, long long n, int C, long long inner) {
  GRID_LOOP(i, n) {
    long long o = i / inner, k = i - o * inner;
    long long base = o * C * inner + k;
    T dot = 0;
    for (int c = 0; c < C; ++c) dot += dy[base + c * inner] * y[base + c * inner];
    for (int c = 0; c < C; ++c) dx[base + c * inner] = (dy[base + c * inner] - dot) * y[base + c * inner];
  }
}

// Per position: log(max(prob of the label, FLT_MIN)), and 1 valid / 0 ignored / -1 label out of range
extern "C" __global__ void softmax_loss_fwd(const T* prob, const T* label, T* logp, T* valid, long long n,
    int C, long long inner, int has_ignore, int ignore) {
  GRID_LOOP(i, n) {
    long long o = i / inner, k = i - o * inner;
    int l = (int)label[i];                  // static_cast<int>
    if (has_ignore && l == ignore) { logp[i] = 0; valid[i] = 0; continue; }
    if (l < 0 || l >= C) { logp[i] = 0; valid[i] = -1; continue; }
    T p = prob[(o * C + l) * inner + k];
    logp[i] = sn_log(p > (T)SN_FLT_MIN ? p : (T)SN_FLT_MIN);
    valid[i] = 1;
  }
}

// dx holds the softmax: dx = (dx - [c == label]) * scale[0], 0 where the label is ignored
extern "C" __global__ void softmax_loss_bwd(T* dx, const T* label, const T* scale, long long n, int C,
    long long inner, int has_ignore, int ignore) {
  GRID_LOOP(i, n) {
    long long k = i % inner, r = i / inner;
    int c = (int)(r % C);
    long long o = r / C;
    int l = (int)label[o * inner + k];
    if (has_ignore && l == ignore) { dx[i] = 0; continue; }
    dx[i] = (dx[i] - (c == l ? (T)1 : (T)0)) * scale[0];
  }
}

// Caffe's stable sigmoid cross-entropy, per element, and 1 valid / 0 ignored
extern "C" __global__ void sigmoid_ce_fwd(const T* x, const T* t, T* loss, T* valid, long long n,
    int has_ignore, int ignore) {
  GRID_LOOP(i, n) {
    T v = x[i], pos = v >= 0 ? (T)1 : (T)0;
    if (has_ignore && (int)t[i] == ignore) { loss[i] = 0; valid[i] = 0; continue; }
    loss[i] = sn_log((T)1 + sn_exp(v - (T)2 * v * pos)) - v * (t[i] - pos);
    valid[i] = 1;
  }
}

extern "C" __global__ void sigmoid_ce_bwd(const T* x, const T* t, T* dx, const T* scale, long long n,
    int has_ignore, int ignore) {
  GRID_LOOP(i, n) {
    if (has_ignore && (int)t[i] == ignore) { dx[i] = 0; continue; }
    T s = sn_tanh(x[i] * (T)0.5) * (T)0.5 + (T)0.5;
    dx[i] = (s - t[i]) * scale[0];
  }
}

// LRN across channels, one thread per (n, h, w): scale = k + alpha/n sum of x^2 over the
// window of ``size`` channels, y = x scale^-beta
extern "C" __global__ void lrn_fwd(const T* x, T* scale, T* y, long long n, int C, long long hw, int size,
    T alpha_over_n, T k, T beta) {
  GRID_LOOP(i, n) {
    long long b = i / hw, p = i - b * hw;
    long long base = b * C * hw + p;
    int pre = (size - 1) / 2;
    for (int c = 0; c < C; ++c) {
      T s = 0;
      for (int j = c - pre; j <= c + pre; ++j)
        if (j >= 0 && j < C) { T v = x[base + j * hw]; s += v * v; }
      s = s * alpha_over_n;
      s = s + k;
      scale[base + c * hw] = s;
      y[base + c * hw] = sn_pow(s, -beta) * x[base + c * hw];
    }
  }
}

// dx = dy scale^-beta + ratio x sum over the window of dy y / scale (ratio = -2 alpha beta / n)
extern "C" __global__ void lrn_bwd(const T* x, const T* y, const T* dy, const T* scale, T* dx, long long n,
    int C, long long hw, int size, T ratio, T beta) {
  GRID_LOOP(i, n) {
    long long b = i / hw, p = i - b * hw;
    long long base = b * C * hw + p;
    int pre = (size - 1) / 2;
    for (int c = 0; c < C; ++c) {
      T s = 0;
      for (int j = c - pre; j <= c + pre; ++j)
        if (j >= 0 && j < C) { long long at = base + j * hw; s += dy[at] * y[at] / scale[at]; }
      long long at = base + c * hw;
      dx[at] = s * x[at] * ratio + sn_pow(scale[at], -beta) * dy[at];
    }
  }
}
"""

# Sums over (outer, inner) per channel of an (outer, C, inner) view, in double: a grid of
# (C, parts) blocks writes partial sums, then finish_sums adds the parts in order.
_SUMS = r"""
// mode 0: sum a; 1: sum a and sum a b; 2: sum a min(b, 0); 3: sum a b
extern "C" __global__ void channel_sums(const T* a, const T* b, int mode, long long outer, int C, long long inner,
    int parts, double* partial) {
  __shared__ double s0[SN_SUM_THREADS];
  __shared__ double s1[SN_SUM_THREADS];
  int c = blockIdx.x, part = blockIdx.y, t = threadIdx.x;
  long long m = outer * inner;
  double acc0 = 0, acc1 = 0;
  for (long long e = (long long)part * blockDim.x + t; e < m; e += (long long)parts * blockDim.x) {
    long long o = e / inner;
    long long at = (o * C + c) * inner + (e - o * inner);
    double v = (double)a[at];
    if (mode == 0) {
      acc0 += v;
    } else if (mode == 1) {
      acc0 += v;
      acc1 += v * (double)b[at];
    } else if (mode == 2) {
      T u = b[at];
      acc0 += v * (double)(u < 0 ? u : (T)0);
    } else {
      acc0 += v * (double)b[at];
    }
  }
  s0[t] = acc0;
  s1[t] = acc1;
  __syncthreads();
  for (int s = blockDim.x / 2; s > 0; s >>= 1) {
    if (t < s) {
      s0[t] += s0[t + s];
      s1[t] += s1[t + s];
    }
    __syncthreads();
  }
  if (t == 0) {
    partial[((long long)c * parts + part) * 2] = s0[0];
    partial[((long long)c * parts + part) * 2 + 1] = s1[0];
  }
}

// out0 = scale sum0; out1 (both) = scale sum1, or (both == 2) the variance scale sum1 - out0^2
extern "C" __global__ void finish_sums(const double* partial, int parts, int C, T* out0, T* out1, int both,
    double scale) {
  GRID_LOOP(c, C) {
    double s0 = 0, s1 = 0;
    for (int p = 0; p < parts; ++p) {
      s0 += partial[(c * parts + p) * 2];
      s1 += partial[(c * parts + p) * 2 + 1];
    }
    out0[c] = (T)(s0 * scale);
    if (both == 1) out1[c] = (T)(s1 * scale);
    if (both == 2) out1[c] = (T)(s1 * scale - (s0 * scale) * (s0 * scale));
  }
}
"""

SOURCES = {"pool": _POOL, "ops": _OPS, "sums": _SUMS}
_CTYPES = {"float32": "float", "float64": "double", "uint8": "unsigned char", "int32": "int"}


def source(family: str, dtype, index=np.uint8) -> str:
    """The CUDA C of one kernel family for these types (T: data, I: pooling's argmax)."""
    return _PRELUDE % {"T": _CTYPES[np.dtype(dtype).name], "I": _CTYPES[np.dtype(index).name]} + SOURCES[family]


@functools.lru_cache(maxsize=None)
def _module(family: str, dtype: str, index: str):
    return _cupy().RawModule(code=source(family, dtype, index))


_kernels: dict = {}


def _run(family, name, n, *args, dtype, index=np.uint8, grid=None):
    """Launch kernel ``name`` with ``args`` (arrays and NumPy scalars), covering ``n`` threads
    in a grid-stride loop unless ``grid`` is given."""
    key = (family, name, np.dtype(dtype).name, np.dtype(index).name)
    kernel = _kernels.get(key)
    if kernel is None:
        kernel = _kernels[key] = _module(family, key[2], key[3]).get_function(name)
    grid = grid or (max(1, min(-(-int(n) // BLOCK), MAX_BLOCKS)),)
    kernel(tuple(grid), (BLOCK,), args)


def _c(*arrays):
    for a in arrays:
        if a is not None and not a.flags.c_contiguous:
            raise ValueError(f"GPU kernels need C-contiguous arrays, got strides {a.strides}")


i32, i64, f64 = np.int32, np.int64, np.float64


# -- reductions over channels --------------------------------------------------------------

SUM, SUM_AND_DOT, DOT_NEGATIVE, DOT = range(4)        # channel_sums' modes


def channel_sums(a, view, mode=SUM, b=None, scale=1.0, out0=None, out1=None, variance=False):
    """Per channel c of ``a`` seen as ``view`` = (outer, C, inner), summed in double and times
    ``scale``: SUM a; SUM_AND_DOT a and a*b; DOT_NEGATIVE a*min(b, 0); DOT a*b. Returns (out0,
    out1) (C each, a's dtype; out1 only for SUM_AND_DOT, where ``variance`` makes it scale sum
    a*b - out0^2: with b = a, the biased variance)."""
    outer, C, inner = (int(v) for v in view)
    _c(a, b)
    xp, m = _xp(a), outer * inner
    parts = max(1, min(-(-512 // C), m // 4096, 1024))     # enough blocks to fill the GPU
    partial = xp.empty(C * parts * 2, np.float64)
    _run("sums", "channel_sums", 0, a, a if b is None else b, i32(mode), i64(outer), i32(C), i64(inner),
         i32(parts), partial, dtype=a.dtype, grid=(C, parts))
    out0 = xp.empty(C, a.dtype) if out0 is None else out0
    both = mode == SUM_AND_DOT
    if both and out1 is None:
        out1 = xp.empty(C, a.dtype)
    _run("sums", "finish_sums", C, partial, i32(parts), i32(C), out0, out1 if both else out0,
         i32(2 if variance else both), f64(scale), dtype=a.dtype)
    return out0, out1


# -- pooling ------------------------------------------------------------------------------

def _pool_geometry(layer):
    (H, W), (PH, PW), (kh, kw), (sh, sw), (ph, pw) = layer.in_hw, layer.pooled, layer.kernel, layer.stride, layer.pad
    return tuple(i32(v) for v in (H, W, PH, PW, kh, kw, sh, sw, ph, pw))


def pool_forward(layer, x, y, idx=None, mask=None):
    """Caffe's MAX (argmax kept in ``idx``, Caffe's mask top in ``mask``) or AVE pooling."""
    _c(x, y, idx, mask)
    n, geo = y.size, _pool_geometry(layer)
    if layer.method == 0:
        _run("pool", "max_pool_fwd", n, x, y, idx, y if mask is None else mask, i32(mask is not None), i64(n),
             *geo, dtype=x.dtype, index=idx.dtype)
    else:
        _run("pool", "ave_pool_fwd", n, x, y, i64(n), *geo, dtype=x.dtype)


def pool_backward(layer, dy, dx, idx=None):
    _c(dy, dx, idx)
    n, geo = dx.size, _pool_geometry(layer)
    if layer.method == 0:
        _run("pool", "max_pool_bwd", n, dy, idx, dx, i64(n), *geo, dtype=dy.dtype, index=idx.dtype)
    else:
        _run("pool", "ave_pool_bwd", n, dy, dx, i64(n), *geo, dtype=dy.dtype)


# -- neuron layers --------------------------------------------------------------------------

def _prelu_view(layer, x):
    """(C, inner) of PReLU's slope broadcast: one shared slope, or one per channel (axis 1)."""
    if layer.shared:
        return 1, x.size
    return x.shape[1], int(np.prod(x.shape[2:], dtype=np.int64))


def neuron_forward(layer, x, y) -> bool:
    """y = f(x) for the neuron layers with a kernel here; False: the layer's own code runs."""
    _c(x, y)
    n, t, T = x.size, layer.type, x.dtype.type
    if t == "ReLU":
        _run("ops", "relu_fwd", n, x, y, i64(n), T(layer.slope), dtype=x.dtype)
    elif t == "PReLU":
        C, inner = _prelu_view(layer, x)
        _run("ops", "prelu_fwd", n, x, layer.blobs[0].data, y, i64(n), i32(C), i64(inner), dtype=x.dtype)
    elif t == "ELU":
        _run("ops", "elu_fwd", n, x, y, i64(n), T(layer.alpha), dtype=x.dtype)
    elif t in ("Sigmoid", "TanH", "AbsVal"):
        name = {"Sigmoid": "sigmoid_fwd", "TanH": "tanh_fwd", "AbsVal": "abs_fwd"}[t]
        _run("ops", name, n, x, y, i64(n), dtype=x.dtype)
    elif t == "Power" and layer.diff_scale != 0:
        _run("ops", "power_fwd", n, x, y, i64(n), T(layer.scale), T(layer.shift), T(layer.power), dtype=x.dtype)
    else:
        return False
    return True


def neuron_backward(layer, x, y, dy, dx, propagate) -> bool:
    """dx = f'(x) dy (and PReLU's slope gradient); False: the layer's own code runs."""
    _c(x, y, dy, dx)
    n, t, T = dy.size, layer.type, dy.dtype.type
    if t == "PReLU":
        C, inner = _prelu_view(layer, x)
        slope = layer.blobs[0]
        # before dx overwrites dy (in place)
        grad, _ = channel_sums(dy, (n // (C * inner), C, inner), DOT_NEGATIVE, b=x)
        slope.diff += grad.reshape(slope.diff.shape)
        if propagate:
            _run("ops", "prelu_bwd", n, x, dy, slope.data, dx, i64(n), i32(C), i64(inner), dtype=dy.dtype)
        return True
    if not propagate:
        return t in ("ReLU", "ELU", "Sigmoid", "TanH", "AbsVal", "Power")
    if t == "ReLU":
        _run("ops", "relu_bwd", n, y if layer.slope >= 0 else x, dy, dx, i64(n), T(layer.slope), dtype=dy.dtype)
    elif t == "ELU":
        _run("ops", "elu_bwd", n, x if layer.needs_x else y, y, dy, dx, i64(n), T(layer.alpha), dtype=dy.dtype)
    elif t in ("Sigmoid", "TanH"):
        _run("ops", "sigmoid_bwd" if t == "Sigmoid" else "tanh_bwd", n, y, dy, dx, i64(n), dtype=dy.dtype)
    elif t == "AbsVal":
        _run("ops", "abs_bwd", n, x, dy, dx, i64(n), dtype=dy.dtype)
    elif t == "Power" and layer.diff_scale != 0 and layer.power != 1:
        ds, scale, shift, power = layer.diff_scale, layer.scale, layer.shift, layer.power
        if power == 2:
            branch, a, b, c = 2, ds * scale, ds * shift, float(shift != 0)
        elif shift == 0:
            branch, a, b, c = 3, power, 0, 0
        else:
            branch, a, b, c = 4, scale, shift, ds
        _run("ops", "power_bwd", n, x, y if y is not None else x, dy, dx, i64(n), i32(branch), T(a), T(b), T(c),
             dtype=dy.dtype)
    else:
        return False
    return True


# -- BatchNorm, Scale, Bias ------------------------------------------------------------------

def batch_norm_forward(layer, x, y, update_stats=True):
    """Caffe's BatchNorm forward on (N, C, spatial) views: batch statistics (and the running
    sums) or the stored ones; ``std`` (and ``x_norm``) kept in scratch for backward."""
    _c(x, y)
    xp, view = _xp(x), layer.view
    N, C, S = view
    std = layer.scratch["std"]
    if layer.use_global_stats:
        factor = layer.blobs[2].data
        inv_factor = (factor != 0) / xp.where(factor == 0, 1, factor)
        mean = layer.blobs[0].data * inv_factor
        xp.multiply(layer.blobs[1].data, inv_factor, out=std)
        std += layer.eps
        xp.sqrt(std, out=std)
    else:
        m, T = N * S, x.dtype.type
        mean, _ = channel_sums(x, view, SUM_AND_DOT, b=x, scale=1.0 / m, out1=std, variance=True)
        mean_sum, var_sum, factor = (b.data for b in layer.blobs)
        _run("ops", "bn_stats", C, mean, std, mean_sum, var_sum, factor, i32(update_stats), i32(C), T(layer.maf),
             T(m / (m - 1) if m > 1 else 1), T(layer.eps), dtype=x.dtype)
    x_norm = y if layer.use_global_stats else layer.scratch["x_norm"]
    _run("ops", "bn_normalize", x.size, x, mean.astype(x.dtype, copy=False), std, y, x_norm,
         i32(not layer.use_global_stats), i64(x.size), i32(C), i64(S), dtype=x.dtype)


def batch_norm_backward(layer, dy, dx):
    _c(dy, dx)
    std = layer.scratch["std"]
    N, C, S = layer.view
    if layer.use_global_stats:
        _xp(dy).divide(dy.reshape(layer.view), std[:, None], out=dx.reshape(layer.view))
        return
    x_norm = layer.scratch["x_norm"]
    mean_dy, mean_dy_xn = channel_sums(dy, layer.view, SUM_AND_DOT, b=x_norm, scale=1.0 / (N * S))
    _run("ops", "bn_backward", dy.size, dy, x_norm, mean_dy, mean_dy_xn, std, dx, i64(dy.size), i32(C), i64(S),
         dtype=dy.dtype)


def scale_forward(layer, x, scale, bias, y):
    """y = x * scale (+ bias), the operands broadcast over Scale's (outer, dim, inner) view."""
    _c(x, scale, bias, y)
    _, C, inner = layer.view
    _run("ops", "channel_scale", x.size, x, scale, scale if bias is None else bias, i32(bias is not None), y,
         i64(x.size), i32(C), i64(inner), dtype=x.dtype)


def scale_backward(layer, top, propagate_down, bottom):
    """Scale's backward: bias and scale gradients as one pass of channel sums, then dx."""
    dy = top[0].diff
    scale = layer.scale_blob(bottom)
    want_scale = layer.scale_is_param or propagate_down[1]
    x = (layer.scratch["bottom"] if layer.inplace else bottom[0].data) if want_scale else None
    if layer.bias_term or want_scale:
        mode = SUM_AND_DOT if layer.bias_term and want_scale else (SUM if layer.bias_term else DOT)
        s0, s1 = channel_sums(dy, layer.view, mode, b=x)
        if layer.bias_term:
            layer.sum_into(s0, layer.blobs[-1].diff, True)
        if want_scale:
            layer.sum_into(s1 if mode == SUM_AND_DOT else s0, scale.diff, layer.scale_is_param)
    if propagate_down[0]:
        scale_forward(layer, dy, scale.data, None, bottom[0].diff)


def bias_backward(layer, dy, target, accumulate):
    layer.sum_into(channel_sums(dy, layer.view, SUM)[0], target, accumulate)


# -- Eltwise MAX -------------------------------------------------------------------------------

def eltwise_max_forward(xs, y, argmax):
    _c(y, argmax, *xs)
    n = y.size
    _run("ops", "eltwise_max_first", n, xs[0], xs[1], y, argmax, i64(n), dtype=y.dtype)
    for k, x in enumerate(xs[2:], 2):
        _run("ops", "eltwise_max_next", n, x, y, argmax, i64(n), i32(k), dtype=y.dtype)


def eltwise_max_backward(dy, argmax, dx, k):
    _c(dy, argmax, dx)
    _run("ops", "eltwise_max_bwd", dy.size, dy, argmax, dx, i64(dy.size), i32(k), dtype=dy.dtype)


# -- softmax and the losses --------------------------------------------------------------------

def softmax_forward(x, y, dims):
    """Softmax over axis 1 of the (outer, C, inner) view ``dims``; y may be x."""
    _c(x, y)
    outer, C, inner = dims
    _run("ops", "softmax_fwd", outer * inner, x, y, i64(outer * inner), i32(C), i64(inner), dtype=x.dtype)


def softmax_backward(y, dy, dx, dims):
    _c(y, dy, dx)
    outer, C, inner = dims
    _run("ops", "softmax_bwd", outer * inner, y, dy, dx, i64(outer * inner), i32(C), i64(inner), dtype=y.dtype)


def _ignore(layer):
    return i32(layer.ignore_label is not None), i32(layer.ignore_label or 0)


def _check_labels(layer, valid, channels):
    if bool((valid < 0).any()):
        raise layer.error(f"label out of range [0, {channels})")


def softmax_loss_forward(layer, bottom, top):
    x = bottom[0].data
    xp, (outer, C, inner) = _xp(x), layer.dims
    prob = top[1].data if len(top) > 1 else layer.workspace["prob"]
    softmax_forward(x, prob, layer.dims)
    label = bottom[1].data
    _c(label)
    logp, valid = xp.empty(outer * inner, x.dtype), xp.empty(outer * inner, x.dtype)
    _run("ops", "softmax_loss_fwd", outer * inner, prob, label, logp, valid, i64(outer * inner), i32(C),
         i64(inner), *_ignore(layer), dtype=x.dtype)
    _check_labels(layer, valid, C)
    mask = None if layer.ignore_label is None else valid > 0
    top[0].data[...] = -logp.sum() / layer.normalizer(xp, x.dtype, outer, inner, mask)


def softmax_loss_backward(layer, top, propagate_down, bottom):
    layer.check_label_backward(propagate_down)
    if not propagate_down[0]:
        return
    x, dx, label = bottom[0].data, bottom[0].diff, bottom[1].data
    xp, (outer, C, inner) = _xp(x), layer.dims
    softmax_forward(x, dx, layer.dims)
    mask = None if layer.ignore_label is None else label.reshape(-1).astype(np.int32) != layer.ignore_label
    scale = xp.asarray(top[0].diff / layer.normalizer(xp, dx.dtype, outer, inner, mask), dx.dtype)
    _run("ops", "softmax_loss_bwd", dx.size, dx, label, scale, i64(dx.size), i32(C), i64(inner), *_ignore(layer),
         dtype=dx.dtype)


def sigmoid_ce_forward(layer, bottom, top):
    x, t = bottom[0].data, bottom[1].data
    _c(x, t)
    xp, n = _xp(x), x.size
    loss, valid = xp.empty(n, x.dtype), xp.empty(n, x.dtype)
    _run("ops", "sigmoid_ce_fwd", n, x, t, loss, valid, i64(n), *_ignore(layer), dtype=x.dtype)
    mask = None if layer.ignore_label is None else valid > 0
    top[0].data[...] = loss.sum() / layer.normalizer(xp, x.dtype, layer.outer, layer.inner, mask)


def sigmoid_ce_backward(layer, top, propagate_down, bottom):
    layer.check_label_backward(propagate_down)
    if not propagate_down[0]:
        return
    x, t, dx = bottom[0].data, bottom[1].data, bottom[0].diff
    _c(x, t, dx)
    xp, n = _xp(x), x.size
    mask = None if layer.ignore_label is None else t.reshape(-1).astype(np.int32) != layer.ignore_label
    scale = xp.asarray(top[0].diff / layer.normalizer(xp, dx.dtype, layer.outer, layer.inner, mask), dx.dtype)
    _run("ops", "sigmoid_ce_bwd", n, x, t, dx, scale, i64(n), *_ignore(layer), dtype=dx.dtype)


# -- LRN (ACROSS_CHANNELS) -----------------------------------------------------------------------

def lrn_forward(layer, x, y, scale):
    _c(x, y, scale)
    N, C = x.shape[:2]
    hw, T = x.size // (N * C), x.dtype.type
    _run("ops", "lrn_fwd", N * hw, x, scale, y, i64(N * hw), i32(C), i64(hw), i32(layer.size),
         T(layer.alpha_over_n), T(layer.k), T(layer.beta), dtype=x.dtype)


def lrn_backward(layer, x, y, dy, dx, scale):
    _c(x, y, dy, dx, scale)
    N, C = x.shape[:2]
    hw, T = x.size // (N * C), x.dtype.type
    _run("ops", "lrn_bwd", N * hw, x, y, dy, scale, dx, i64(N * hw), i32(C), i64(hw), i32(layer.size),
         T(-2 * layer.alpha_over_n * layer.beta), T(layer.beta), dtype=x.dtype)


# -- convolution (cuDNN) ---------------------------------------------------------------------------

DIRECTIONS = ("forward", "backward_data", "backward_filter")


def conv_settings(layer):
    """(kernel, stride, pad, dilation, group) of a Convolution/Deconvolution layer, (h, w) each."""
    from ..layers.conv import _spatial
    p = layer.param.convolution_param
    return (_spatial(layer, p, "kernel_size", 0), _spatial(layer, p, "stride", 1), _spatial(layer, p, "pad", 0),
            _spatial(layer, p, "dilation", 1), int(p.group))


class ConvShape:
    """One convolution at one batch size, in Caffe's conv view (image -> grid; a
    Deconvolution's top is the image): cuDNN descriptors, and per direction the
    algorithms as cudnnFind*Ex measured them (time, workspace), found once."""

    def __init__(self, image, grid, weight, stride, pad, dilation, group, dtype):
        self.image, self.grid, self.weight = image, grid, weight
        self.dtype = np.dtype(dtype)
        self.x = cudnn.TensorDesc(image, dtype)
        self.y = cudnn.TensorDesc(grid, dtype)
        self.w = cudnn.FilterDesc(weight, dtype)
        self.conv = cudnn.ConvDesc(pad, stride, dilation, group, dtype, MATH)
        self.measured = {}          # direction -> (workspace bytes it was measured with, [Algorithm])

    def _args(self, direction, x, w, y):
        return {"forward": (self.x, x, self.w, w, self.conv, self.y, y),
                "backward_data": (self.w, w, self.y, y, self.conv, self.x, x),
                "backward_filter": (self.x, x, self.y, y, self.conv, self.w, w)}[direction]

    def measure(self, h, direction, x, w, y, workspace, nbytes):
        """Time every algorithm on these buffers (the output one is overwritten)."""
        find = getattr(cudnn, f"find_{direction}_algorithms")
        algos = find(h, *self._args(direction, x, w, y), workspace, nbytes)
        self.measured[direction] = (nbytes, algos)
        return algos

    def algorithm(self, direction, limit):
        """The fastest measured algorithm whose workspace fits ``limit`` bytes (deterministic
        ones first where DETERMINISTIC); None where it has not been measured up to ``limit``."""
        nbytes, algos = self.measured.get(direction, (-1, None))
        if algos is None or (nbytes < limit and any(a.status != 0 for a in algos)):
            return None
        ok = [a for a in algos if a.status == 0 and a.memory <= limit]
        exact = [a for a in ok if a.deterministic] if DETERMINISTIC else ok
        pick = exact or ok
        if not pick:
            raise cudnn.CudnnNotSupported(3000, f"convolution {direction}",
                                          f"no algorithm runs within {limit} bytes of workspace "
                                          f"(image {self.image}, weight {self.weight})")
        return min(pick, key=lambda a: a.time)


_shapes: dict = {}


def conv_shape(layer, n, dtype) -> ConvShape:
    """The ConvShape of ``layer`` for ``n`` images (shared by every layer of the same geometry)."""
    image, grid, weight, (kernel, stride, pad, dilation, group) = layer._conv_view
    key = (image[1:], grid[1:], n, weight, stride, pad, dilation, group, np.dtype(dtype).name, MATH)
    shape = _shapes.get(key)
    if shape is None:
        shape = _shapes[key] = ConvShape((n,) + image[1:], (n,) + grid[1:], weight, stride, pad, dilation, group,
                                         dtype)
    return shape


def _set_conv_view(layer, bottom_shape):
    """``layer._conv_view``: the (image, grid, weight) shapes of the conv view, and the settings."""
    bottom_shape = tuple(bottom_shape)
    if getattr(layer, "_conv_view_of", None) == bottom_shape:
        return
    settings = kernel, stride, pad, dilation, group = conv_settings(layer)
    N, C, H, W = bottom_shape
    M = layer.param.convolution_param.num_output
    ext = [d * (k - 1) + 1 for k, d in zip(kernel, dilation)]
    if layer.deconv:
        out = tuple(s * (n - 1) + e - 2 * p for n, s, e, p in zip((H, W), stride, ext, pad))
        view = (N, M) + out, (N, C, H, W), (C, M // group) + tuple(kernel)
    else:
        out = tuple((n + 2 * p - e) // s + 1 for n, s, e, p in zip((H, W), stride, ext, pad))
        view = (N, C, H, W), (N, M) + out, (M, C // group) + tuple(kernel)
    layer._conv_view, layer._conv_view_of = view + (settings,), bottom_shape


def _layer_directions(layer):
    """(forward's, backward's) cuDNN directions of a layer in the conv view."""
    if layer.deconv:
        return ("backward_data",), ("forward", "backward_filter")
    return ("forward",), ("backward_filter", "backward_data")


def conv_workspace_specs(layer, bottom_shape, chunk=None):
    """Setup under building_for(cuda): (forward, backward) workspace specs of the layer's cuDNN
    algorithms for ``chunk`` images at a time (None: the batch): per direction the fastest
    whose workspace fits ``layer.workspace_limit``, measured now on temporary buffers
    (outside the pool, released at once) unless a layer of the same shape was measured."""
    _set_conv_view(layer, bottom_shape)
    dtype = np.dtype(getattr(layer, "dtype", None) or np.float32)
    shape = conv_shape(layer, chunk or bottom_shape[0], dtype)
    limit = int(getattr(layer, "workspace_limit", WORKSPACE_LIMIT))
    todo = [d for d in DIRECTIONS if shape.algorithm(d, limit) is None]
    if todo:
        cp = _cupy()
        x, y, w = cp.zeros(shape.image, dtype), cp.zeros(shape.grid, dtype), cp.zeros(shape.weight, dtype)
        ws = cp.empty(limit, np.uint8)
        for direction in todo:
            shape.measure(handle(), direction, x, w, y, ws, limit)
        del x, y, w, ws
        stray = getattr(gpu_target(), "stray", None)
        if stray is not None:
            stray.pool.free_all_blocks()        # give the GPU its memory back, not to CuPy's cache
    sizes = {d: shape.algorithm(d, limit).memory for d in DIRECTIONS}
    forward, backward = _layer_directions(layer)
    spec = lambda dirs: {"cudnn": ((max(1, max(sizes[d] for d in dirs)),), np.uint8)}    # noqa: E731
    return spec(forward), spec(backward)


def conv_workspace_for_chunk(layer, chunk):
    """The memory runtime's chunked pass on the GPU (Layer.workspace_for_chunk): one cuDNN
    workspace for ``chunk`` images, forward's and backward's alike."""
    forward, backward = conv_workspace_specs(layer, layer._conv_view_of, chunk)
    return {"cudnn": ((max(forward["cudnn"][0][0], backward["cudnn"][0][0]),), np.uint8)}


def _workspace(layer):
    """The layer's workspace as (array, bytes): its "cudnn" buffer, else its largest one."""
    ws = layer.workspace.get("cudnn")
    if ws is None and layer.workspace:
        ws = max(layer.workspace.values(), key=lambda a: a.nbytes)
    return (ws, int(ws.nbytes)) if ws is not None else (None, 0)


def _algorithm(shape, h, direction, x, w, y, workspace, nbytes, scratch=None):
    """The algorithm for this call: measured once per shape, on these buffers the first time
    (``scratch`` stands in for an output that must not be overwritten: the weight diff)."""
    algo = shape.algorithm(direction, nbytes)
    if algo is None:
        out = {"forward": y, "backward_data": x, "backward_filter": w}[direction]
        if scratch is not None:
            out = scratch
        args = {"forward": (x, w, out), "backward_data": (out, w, y), "backward_filter": (x, out, y)}[direction]
        shape.measure(h, direction, *args, workspace, nbytes)
        algo = shape.algorithm(direction, nbytes)
    return algo


def _bias_desc(layer, dtype):
    return cudnn.tensor((1, layer.param.convolution_param.num_output, 1, 1), np.dtype(dtype))


def conv_forward(layer, bottom, top):
    """Convolution: top = conv(bottom, w) + bias; Deconvolution: top = conv^T(bottom, w) + bias."""
    _set_conv_view(layer, bottom[0].data.shape)
    h, (ws, nbytes) = handle(), _workspace(layer)
    w = layer.blobs[0].data
    for b, t in zip(bottom, top):
        for c in layer._chunks(b.data.shape[0]):
            x_, y_ = b.data[c], t.data[c]
            shape = conv_shape(layer, x_.shape[0], x_.dtype)
            if layer.deconv:
                algo = _algorithm(shape, h, "backward_data", y_, w, x_, ws, nbytes)
                cudnn.convolution_backward_data(h, shape.w, w, shape.y, x_, shape.conv, algo.algo, ws, nbytes,
                                                shape.x, y_)
            else:
                algo = _algorithm(shape, h, "forward", x_, w, y_, ws, nbytes)
                cudnn.convolution_forward(h, shape.x, x_, shape.w, w, shape.conv, algo.algo, ws, nbytes,
                                          shape.y, y_)
            if layer.bias_term:
                desc = shape.x if layer.deconv else shape.y
                cudnn.add_tensor(h, _bias_desc(layer, w.dtype), layer.blobs[1].data, desc, y_)


def conv_backward(layer, top, propagate_down, bottom):
    """Bias and weight gradients accumulate (+=, Caffe's param diffs); bottom diffs are overwritten."""
    _set_conv_view(layer, bottom[0].data.shape)
    h, (ws, nbytes) = handle(), _workspace(layer)
    w = layer.blobs[0].data
    learn_w, learn_b = layer._learns(0), layer.bias_term and layer._learns(1)
    scratch = None
    for i, (t, b) in enumerate(zip(top, bottom)):
        for c in layer._chunks(t.diff.shape[0]):
            dy, x, dx = t.diff[c], b.data[c], (b.diff[c] if propagate_down[i] else None)
            shape = conv_shape(layer, dy.shape[0], dy.dtype)
            if learn_b:
                cudnn.convolution_backward_bias(h, shape.x if layer.deconv else shape.y, dy,
                                                _bias_desc(layer, dy.dtype), layer.blobs[1].diff)
            # in the conv view: image = (x, dx) for Convolution, (top diff) for Deconvolution
            image, grid = (dy, x) if layer.deconv else (x, dy)
            if learn_w:
                if shape.algorithm("backward_filter", nbytes) is None and scratch is None:
                    scratch = _xp(w).empty_like(w)     # measuring overwrites: not the accumulated diff
                algo = _algorithm(shape, h, "backward_filter", image, w, grid, ws, nbytes, scratch)
                cudnn.convolution_backward_filter(h, shape.x, image, shape.y, grid, shape.conv, algo.algo, ws,
                                                  nbytes, shape.w, layer.blobs[0].diff, beta=1.0)
            if dx is None:
                continue
            if layer.deconv:
                algo = _algorithm(shape, h, "forward", dy, w, dx, ws, nbytes)
                cudnn.convolution_forward(h, shape.x, dy, shape.w, w, shape.conv, algo.algo, ws, nbytes,
                                          shape.y, dx)
            else:
                algo = _algorithm(shape, h, "backward_data", dx, w, dy, ws, nbytes)
                cudnn.convolution_backward_data(h, shape.w, w, shape.y, dy, shape.conv, algo.algo, ws, nbytes,
                                                shape.x, dx)
