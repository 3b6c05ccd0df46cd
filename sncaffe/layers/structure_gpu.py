"""Eltwise MAX on the GPU: the winner and its bottom index in one pass per bottom, no mask."""
from __future__ import annotations

from ..backend import kernels
from ..backend.kernels import contiguous, i32, i64

kernels.register("eltwise", r"""
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

""")


def eltwise_max_forward(xs, y, argmax):
    contiguous(y, argmax, *xs)
    n = y.size
    kernels.launch("eltwise", "eltwise_max_first", n, xs[0], xs[1], y, argmax, i64(n), dtype=y.dtype)
    for k, x in enumerate(xs[2:], 2):
        kernels.launch("eltwise", "eltwise_max_next", n, x, y, argmax, i64(n), i32(k), dtype=y.dtype)


def eltwise_max_backward(dy, argmax, dx, k):
    contiguous(dy, argmax, dx)
    kernels.launch("eltwise", "eltwise_max_bwd", dy.size, dy, argmax, dx, i64(dy.size), i32(k), dtype=dy.dtype)
