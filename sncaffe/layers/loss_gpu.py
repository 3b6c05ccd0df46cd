"""Softmax, SoftmaxWithLoss and SigmoidCrossEntropyLoss on the GPU (loss.py's CPU code beside).

Softmax takes one block per row with a reduction over its threads where the
softmax axis is the last (inner = 1: classifier outputs), one thread per
position otherwise. Out-of-range labels are found on the GPU and reported
without a device-to-host sync per iteration: ``check_labels`` reads a flag
once the GPU is past it (usually on the layer's next forward).
"""
from __future__ import annotations

import weakref

import numpy as np

from ..backend import kernels
from ..backend.kernels import contiguous, i32, i64
from .base import array_module

kernels.register("loss", r"""
// Softmax over C of an (outer, C, inner) view with inner > 1, one thread per (outer, inner)
// position (neighbouring threads read neighbouring memory); y may be x
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


// Softmax over the rows of an (outer, C) view (inner = 1): one block per row, a reduction over
// the block's threads for the maximum and the sum (blockDim a power of 2); y may be x
extern "C" __global__ void softmax_rows_fwd(const T* x, T* y, long long rows, int C) {
  __shared__ T red[SN_SUM_THREADS];
  int t = threadIdx.x;
  for (long long r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* xs = x + r * C;
    T* ys = y + r * C;
    T m = xs[0];
    for (int c = t; c < C; c += blockDim.x) m = xs[c] > m ? xs[c] : m;
    red[t] = m;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
      if (t < s) red[t] = red[t + s] > red[t] ? red[t + s] : red[t];
      __syncthreads();
    }
    m = red[0];
    __syncthreads();
    T sum = 0;
    for (int c = t; c < C; c += blockDim.x) {
      T e = sn_exp(xs[c] - m);
      ys[c] = e;
      sum += e;
    }
    red[t] = sum;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
      if (t < s) red[t] += red[t + s];
      __syncthreads();
    }
    sum = red[0];
    __syncthreads();
    for (int c = t; c < C; c += blockDim.x) ys[c] = ys[c] / sum;
  }
}

// dx = (dy - sum_c dy y) y over the rows of an (outer, C) view, one block per row; dx may be dy
extern "C" __global__ void softmax_rows_bwd(const T* y, const T* dy, T* dx, long long rows, int C) {
  __shared__ T red[SN_SUM_THREADS];
  int t = threadIdx.x;
  for (long long r = blockIdx.x; r < rows; r += gridDim.x) {
    long long base = r * C;
    T dot = 0;
    for (int c = t; c < C; c += blockDim.x) dot += dy[base + c] * y[base + c];
    red[t] = dot;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
      if (t < s) red[t] += red[t + s];
      __syncthreads();
    }
    dot = red[0];
    __syncthreads();
    for (int c = t; c < C; c += blockDim.x) dx[base + c] = (dy[base + c] - dot) * y[base + c];
  }
}

""")


def _run(name, n, *args, dtype, grid=None, block=None):
    kernels.launch("loss", name, n, *args, dtype=dtype, grid=grid, block=block)


def _row_block(C):
    """Threads per row: a power of 2 covering C, at least a warp, at most kernels.BLOCK."""
    return min(kernels.BLOCK, max(32, 1 << (int(C) - 1).bit_length()))


def _rows_grid(outer):
    return (max(1, min(int(outer), kernels.MAX_BLOCKS)),)


def softmax_forward(x, y, dims):
    """Softmax over axis 1 of the (outer, C, inner) view ``dims``; y may be x."""
    contiguous(x, y)
    outer, C, inner = dims
    if inner == 1:
        _run("softmax_rows_fwd", 0, x, y, i64(outer), i32(C), dtype=x.dtype, grid=_rows_grid(outer),
             block=_row_block(C))
    else:
        _run("softmax_fwd", outer * inner, x, y, i64(outer * inner), i32(C), i64(inner), dtype=x.dtype)


def softmax_backward(y, dy, dx, dims):
    contiguous(y, dy, dx)
    outer, C, inner = dims
    if inner == 1:
        _run("softmax_rows_bwd", 0, y, dy, dx, i64(outer), i32(C), dtype=y.dtype, grid=_rows_grid(outer),
             block=_row_block(C))
    else:
        _run("softmax_bwd", outer * inner, y, dy, dx, i64(outer * inner), i32(C), i64(inner), dtype=y.dtype)


# -- labels out of range, without a sync per iteration ------------------------------------------

_pending = weakref.WeakKeyDictionary()      # layer -> [(device flag, event or None)]


def check_labels(layer, bad, channels, wait=False):
    """Raise the layer's error if an earlier call's labels were out of [0, channels); queue this
    call's ``bad`` (a device bool array). A flag is read once its event says the GPU has
    computed it, so the host never waits for the GPU here (``wait``: read them all now).
    Where the arrays have no CUDA events (the emulation), the check is immediate."""
    cuda = getattr(array_module(bad), "cuda", None) if bad is not None else None
    queue = _pending.setdefault(layer, [])
    if bad is not None:
        flag = bad.any()
        event = None
        if cuda is not None:
            event = cuda.Event(disable_timing=True)
            event.record()
        queue.append((flag, event))
    while queue and (wait or queue[0][1] is None or queue[0][1].done):
        flag, _ = queue.pop(0)
        if bool(flag):
            queue.clear()
            raise layer.error(f"label out of range [0, {channels})")


def _ignore(layer):
    return i32(layer.ignore_label is not None), i32(layer.ignore_label or 0)


def softmax_loss_forward(layer, bottom, top):
    x = bottom[0].data
    xp, (outer, C, inner) = array_module(x), layer.dims
    prob = top[1].data if len(top) > 1 else layer.workspace["prob"]
    softmax_forward(x, prob, layer.dims)
    label = bottom[1].data
    contiguous(label)
    logp, valid = xp.empty(outer * inner, x.dtype), xp.empty(outer * inner, x.dtype)
    _run("softmax_loss_fwd", outer * inner, prob, label, logp, valid, i64(outer * inner), i32(C), i64(inner),
         *_ignore(layer), dtype=x.dtype)
    check_labels(layer, valid < 0, C)
    mask = None if layer.ignore_label is None else valid > 0
    top[0].data[...] = -logp.sum() / layer.normalizer(xp, x.dtype, outer, inner, mask)


def softmax_loss_backward(layer, top, propagate_down, bottom):
    layer.check_label_backward(propagate_down)
    if not propagate_down[0]:
        return
    x, dx, label = bottom[0].data, bottom[0].diff, bottom[1].data
    xp, (outer, C, inner) = array_module(x), layer.dims
    softmax_forward(x, dx, layer.dims)
    mask = None if layer.ignore_label is None else label.reshape(-1).astype(np.int32) != layer.ignore_label
    scale = xp.asarray(top[0].diff / layer.normalizer(xp, dx.dtype, outer, inner, mask), dx.dtype)
    _run("softmax_loss_bwd", dx.size, dx, label, scale, i64(dx.size), i32(C), i64(inner), *_ignore(layer),
         dtype=dx.dtype)


def sigmoid_ce_forward(layer, bottom, top):
    x, t = bottom[0].data, bottom[1].data
    contiguous(x, t)
    xp, n = array_module(x), x.size
    loss, valid = xp.empty(n, x.dtype), xp.empty(n, x.dtype)
    _run("sigmoid_ce_fwd", n, x, t, loss, valid, i64(n), *_ignore(layer), dtype=x.dtype)
    mask = None if layer.ignore_label is None else valid > 0
    top[0].data[...] = loss.sum() / layer.normalizer(xp, x.dtype, layer.outer, layer.inner, mask)


def sigmoid_ce_backward(layer, top, propagate_down, bottom):
    layer.check_label_backward(propagate_down)
    if not propagate_down[0]:
        return
    x, t, dx = bottom[0].data, bottom[1].data, bottom[0].diff
    contiguous(x, t, dx)
    xp, n = array_module(x), x.size
    mask = None if layer.ignore_label is None else t.reshape(-1).astype(np.int32) != layer.ignore_label
    scale = xp.asarray(top[0].diff / layer.normalizer(xp, dx.dtype, layer.outer, layer.inner, mask), dx.dtype)
    _run("sigmoid_ce_bwd", n, x, t, dx, scale, i64(n), *_ignore(layer), dtype=dx.dtype)
