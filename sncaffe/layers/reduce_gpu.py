"""Per-channel sums on the GPU, shared by the PReLU, BatchNorm, Scale and Bias kernels.

Over (outer, inner) per channel of an (outer, C, inner) view, in double: a grid
of (C, parts) blocks writes partial sums with a fixed tree per block, then
``finish_sums`` adds the parts in order, so a run gives the same bits whatever
the memory mode.
"""
from __future__ import annotations

import numpy as np

from ..backend import kernels
from ..backend.kernels import contiguous, f64, i32, i64
from .base import array_module

kernels.register("sums", r"""
// mode 0: sum a; 1: sum a and sum a b; 2: sum a min(b, 0); 3: sum a b; 4: sum (a - b[c])^2
extern "C" __global__ void channel_sums(const T* a, const T* b, int mode, long long outer, int C, long long inner,
    int parts, double* partial) {
  __shared__ double s0[SN_SUM_THREADS];
  __shared__ double s1[SN_SUM_THREADS];
  int c = blockIdx.x, part = blockIdx.y, t = threadIdx.x;
  long long m = outer * inner;
  double acc0 = 0, acc1 = 0;
  double center = mode == 4 ? (double)b[c] : 0.0;
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
      acc0 += v * (double)((u < 0 || u != u) ? u : (T)0);   // min(u, 0), NaN kept as np.minimum
    } else if (mode == 3) {
      acc0 += v * (double)b[at];
    } else {
      double d = v - center;
      acc0 += d * d;
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

// out0 = scale sum0; out1 (both) = scale sum1
extern "C" __global__ void finish_sums(const double* partial, int parts, int C, T* out0, T* out1, int both,
    double scale) {
  GRID_LOOP(c, C) {
    double s0 = 0, s1 = 0;
    for (int p = 0; p < parts; ++p) {
      s0 += partial[(c * parts + p) * 2];
      s1 += partial[(c * parts + p) * 2 + 1];
    }
    out0[c] = (T)(s0 * scale);
    if (both) out1[c] = (T)(s1 * scale);
  }
}
""")

SUM, SUM_AND_DOT, DOT_NEGATIVE, DOT, CENTERED_SQUARES = range(5)        # channel_sums' modes


def channel_sums(a, view, mode=SUM, b=None, scale=1.0, out0=None, out1=None):
    """Per channel c of ``a`` seen as ``view`` = (outer, C, inner), summed in double and times
    ``scale``: SUM a; SUM_AND_DOT a and a*b; DOT_NEGATIVE a*min(b, 0); DOT a*b;
    CENTERED_SQUARES (a - b[c])^2 (b: C values). Returns (out0, out1) (C each, a's dtype;
    out1 only for SUM_AND_DOT)."""
    outer, C, inner = (int(v) for v in view)
    contiguous(a, b)
    xp, m = array_module(a), outer * inner
    parts = max(1, min(-(-512 // C), m // 4096, 1024))     # enough blocks to fill the GPU
    partial = xp.empty(C * parts * 2, np.float64)
    kernels.launch("sums", "channel_sums", 0, a, a if b is None else b, i32(mode), i64(outer), i32(C), i64(inner),
                   i32(parts), partial, dtype=a.dtype, grid=(C, parts), block=kernels.BLOCK)
    out0 = xp.empty(C, a.dtype) if out0 is None else out0
    both = mode == SUM_AND_DOT
    if both and out1 is None:
        out1 = xp.empty(C, a.dtype)
    kernels.launch("sums", "finish_sums", C, partial, i32(parts), i32(C), out0, out1 if both else out0,
                   i32(both), f64(scale), dtype=a.dtype)
    return out0, out1


def mean_and_variance(x, view, var_out=None):
    """Per-channel mean and biased variance in two passes (the variance from the centered
    values, not E[x^2] - E[x]^2, which cancels catastrophically when |mean| >> std)."""
    outer, _, inner = view
    scale = 1.0 / (outer * inner)
    mean, _ = channel_sums(x, view, SUM, scale=scale)
    var, _ = channel_sums(x, view, CENTERED_SQUARES, b=mean, scale=scale, out0=var_out)
    return mean, var
