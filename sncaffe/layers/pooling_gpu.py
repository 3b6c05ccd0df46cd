"""MAX and AVE pooling on the GPU: Caffe's pooling_layer.cu, keeping the CPU layer's argmax.

The argmax is the tap index in the window (row-major), so a window is read
once forward and never in backward (cuDNN's pooling backward would re-read
bottom and top). STOCHASTIC pooling runs the layer's own array code.
"""
from __future__ import annotations

import numpy as np

from ..backend import kernels
from ..backend.kernels import contiguous, i32, i64

kernels.register("pool", r"""
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
""", index_types=(np.uint8, np.int32))


def _geometry(layer):
    (H, W), (PH, PW), (kh, kw), (sh, sw), (ph, pw) = layer.in_hw, layer.pooled, layer.kernel, layer.stride, layer.pad
    return tuple(i32(v) for v in (H, W, PH, PW, kh, kw, sh, sw, ph, pw))


def pool_forward(layer, x, y, idx=None, mask=None):
    """Caffe's MAX (argmax kept in ``idx``, Caffe's mask top in ``mask``) or AVE pooling."""
    contiguous(x, y, idx, mask)
    n, geo = y.size, _geometry(layer)
    if layer.method == 0:
        kernels.launch("pool", "max_pool_fwd", n, x, y, idx, y if mask is None else mask, i32(mask is not None),
                       i64(n), *geo, dtype=x.dtype, index=idx.dtype)
    else:
        kernels.launch("pool", "ave_pool_fwd", n, x, y, i64(n), *geo, dtype=x.dtype)


def pool_backward(layer, dy, dx, idx=None):
    contiguous(dy, dx, idx)
    n, geo = dx.size, _geometry(layer)
    if layer.method == 0:
        kernels.launch("pool", "max_pool_bwd", n, dy, idx, dx, i64(n), *geo, dtype=dy.dtype, index=idx.dtype)
    else:
        kernels.launch("pool", "ave_pool_bwd", n, dy, dx, i64(n), *geo, dtype=dy.dtype)
