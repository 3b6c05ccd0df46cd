"""BatchNorm and LRN (ACROSS_CHANNELS) on the GPU: Caffe's semantics, normalization.py's scratch.

BatchNorm normalizes and differentiates from its kept ``x_norm`` and ``std``;
the batch variance is two-pass (centered squares), as the CPU layer's. LRN
sums each window in place (no padded workspace).
"""
from __future__ import annotations

from ..backend import kernels
from ..backend.kernels import contiguous, i32, i64
from .base import array_module
from .reduce_gpu import SUM_AND_DOT, channel_sums, mean_and_variance

kernels.register("normalization", r"""
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
""")


def _run(name, n, *args, dtype):
    kernels.launch("normalization", name, n, *args, dtype=dtype)


def batch_norm_forward(layer, x, y, update_stats=True):
    """Caffe's BatchNorm forward on (N, C, spatial) views: batch statistics (and the running
    sums) or the stored ones; ``std`` (and ``x_norm``) kept in scratch for backward."""
    contiguous(x, y)
    xp, view = array_module(x), layer.view
    N, C, S = view
    std = layer.scratch["std"]
    if layer.use_global_stats:
        factor = layer.blobs[2].data
        inv_factor = (factor != 0) / xp.where(factor == 0, 1, factor)      # no host sync
        mean = layer.blobs[0].data * inv_factor
        xp.multiply(layer.blobs[1].data, inv_factor, out=std)
        std += layer.eps
        xp.sqrt(std, out=std)
    else:
        m, T = N * S, x.dtype.type
        mean, _ = mean_and_variance(x, view, var_out=std)
        mean_sum, var_sum, factor = (b.data for b in layer.blobs)
        _run("bn_stats", C, mean, std, mean_sum, var_sum, factor, i32(update_stats), i32(C), T(layer.maf),
             T(m / (m - 1) if m > 1 else 1), T(layer.eps), dtype=x.dtype)
    x_norm = y if layer.use_global_stats else layer.scratch["x_norm"]
    _run("bn_normalize", x.size, x, mean.astype(x.dtype, copy=False), std, y, x_norm,
         i32(not layer.use_global_stats), i64(x.size), i32(C), i64(S), dtype=x.dtype)


def batch_norm_backward(layer, dy, dx):
    contiguous(dy, dx)
    std = layer.scratch["std"]
    N, C, S = layer.view
    if layer.use_global_stats:
        array_module(dy).divide(dy.reshape(layer.view), std[:, None], out=dx.reshape(layer.view))
        return
    x_norm = layer.scratch["x_norm"]
    mean_dy, mean_dy_xn = channel_sums(dy, layer.view, SUM_AND_DOT, b=x_norm, scale=1.0 / (N * S))
    _run("bn_backward", dy.size, dy, x_norm, mean_dy, mean_dy_xn, std, dx, i64(dy.size), i32(C), i64(S),
         dtype=dy.dtype)


def lrn_forward(layer, x, y, scale):
    contiguous(x, y, scale)
    N, C = x.shape[:2]
    hw, T = x.size // (N * C), x.dtype.type
    _run("lrn_fwd", N * hw, x, scale, y, i64(N * hw), i32(C), i64(hw), i32(layer.size),
         T(layer.alpha_over_n), T(layer.k), T(layer.beta), dtype=x.dtype)


def lrn_backward(layer, x, y, dy, dx, scale):
    contiguous(x, y, dy, dx, scale)
    N, C = x.shape[:2]
    hw, T = x.size // (N * C), x.dtype.type
    _run("lrn_bwd", N * hw, x, y, dy, scale, dx, i64(N * hw), i32(C), i64(hw), i32(layer.size),
         T(-2 * layer.alpha_over_n * layer.beta), T(layer.beta), dtype=x.dtype)
