"""Compiled kernels (numba, optional): BatchNorm's and Scale's per-image sums, and SGD's step.

BatchNorm's statistics and Scale's gradients are sums over each (image, channel) row of a
float32 tensor. NumPy takes a pass over memory per sum (einsum's one-operand sum, its slower
two-operand one) and one more for x - mean; these kernels fuse what reads the same rows:

- ``row_sums(x, out)``: out[r] = sum of row r;
- ``center_squares(x, mean, xn, out)``: xn = x - mean[r % C] and out[r] = sum of xn^2, one pass;
- ``two_sums(dy, xn, sum_dy, sum_dy_xn)``: both backward sums, one pass;
- ``image_sum(part, out, first)``: the per-image sums added image after image (no reassociation:
  the order is the result), where a Python loop took 70 us a call at 128 images of 32 channels;
- ``add_relu(a, b, y)`` and ``relu_grad_copy(y, dy, *dx)``: an Eltwise sum with the in-place
  ReLU after it, forward in one pass (where the two layers read and wrote the top twice) and
  backward the ReLU's mask applied and copied to Eltwise's bottoms in one pass (graph.EltwiseReLU);
- ``sgd_step(data, diff, history, decay, rate, momentum)``: SGD's update of one parameter in one
  pass (three arrays read and written once, where NumPy's seven calls make eighteen array passes
  and oneDNN's chain eleven), each operation rounded as NumPy rounds it: the same bytes.

Each row is summed by one thread, in an order fixed by the row's length alone (LLVM vectorizes
the loop, ``reassoc``; no NaN or infinity assumptions, so they propagate as NumPy's do), so a
row's sum does not depend on the number of images, the row's address or the thread count: one
location and the replicas of cross-replica BatchNorm add the same partials (tested). They are
not einsum's bits: another summation order, within float32 rounding of it.

numba (with llvmlite, about 210 MB installed) is an extra (``pip install 'sncaffe[fast]'``,
also in ``[test]``); without it, or with ``SNCAFFE_NUMBA=0``, the layers use einsum. The rows
run on the thread budget from the main thread (numba's own pool); elsewhere (a replica's worker,
which shares the process with another) on the calling thread: numba's default thread pool does
not take launches from two threads at once.
"""
from __future__ import annotations

import threading

import numpy as np

from .. import config
from . import threads as _threads

_kernels = None
# Element-wise kernels (SGD's step) run on one thread below this many values: SGD's step on
# 64 Ki values took 8.4 us on one thread and 10.0 on two, on 128 Ki 22.8 and 14.1 (warm, medians
# of 400 calls).
PARALLEL_MIN = 1 << 17


def kernels():
    """The compiled kernels, or None (numba absent, disabled, or failing to compile)."""
    global _kernels
    if _kernels is None:
        _kernels = _compile() or False
    return _kernels or None


# What loading the kernels adds to the process's own memory (numba's and llvmlite's heap and the
# compiled code, as measured, beside 85 MiB of library pages the page cache shares): a RAM
# budget taken before they load leaves them this much room.
KERNELS_BYTES = 65 << 20


def pending_bytes() -> int:
    """KERNELS_BYTES where the kernels will be loaded at their first use and are not yet, else 0."""
    if _kernels is not None or not config.settings.numba:
        return 0
    import importlib.util
    return KERNELS_BYTES if importlib.util.find_spec("numba") is not None else 0


def _compile():
    if not config.settings.numba:
        return None
    try:
        import numba
    except ImportError:
        return None
    from numba import njit, prange
    flags = {"reassoc", "contract"}

    def variants(parallel):
        loop = prange if parallel else range

        @njit(parallel=parallel, fastmath=flags, cache=True, nogil=True)
        def row_sums(x, out):
            rows, n = x.shape
            for r in loop(rows):
                acc = np.float32(0)
                for s in range(n):
                    acc += x[r, s]
                out[r] = acc

        @njit(parallel=parallel, fastmath=flags, cache=True, nogil=True)
        def center_squares(x, mean, xn, out):
            rows, n = x.shape
            channels = mean.shape[0]
            for r in loop(rows):
                m = mean[r % channels]
                acc = np.float32(0)
                for s in range(n):
                    v = x[r, s] - m
                    xn[r, s] = v
                    acc += v * v
                out[r] = acc

        @njit(parallel=parallel, fastmath=flags, cache=True, nogil=True)
        def two_sums(dy, xn, sum_dy, sum_dy_xn):
            rows, n = dy.shape
            for r in loop(rows):
                a = np.float32(0)
                b = np.float32(0)
                for s in range(n):
                    g = dy[r, s]
                    a += g
                    b += g * xn[r, s]
                sum_dy[r] = a
                sum_dy_xn[r] = b
        # no fastmath: each operation rounded to float32 in NumPy's order, no fused multiply-add
        @njit(parallel=parallel, cache=True, nogil=True)
        def sgd_step(data, diff, history, decay, rate, momentum):
            for i in loop(data.shape[0]):
                g = (data[i] * decay + diff[i]) * rate
                h = history[i] * momentum + g
                data[i] = data[i] - h
                history[i] = h
                diff[i] = h

        @njit(parallel=parallel, cache=True, nogil=True)
        def sgd_step_no_decay(data, diff, history, rate, momentum):
            for i in loop(data.shape[0]):
                h = history[i] * momentum + diff[i] * rate
                data[i] = data[i] - h
                history[i] = h
                diff[i] = h

        # Eltwise SUM and the in-place ReLU after it (graph.EltwiseReLU), no fastmath: NumPy's
        # np.add then np.maximum(s, 0) (NaN kept, -0 and negatives to +0), and backward its
        # np.multiply(dy, y > 0): dy * 1 or dy * 0 (so NaN * 0 stays NaN, -1 * 0 is -0)
        @njit(parallel=parallel, cache=True, nogil=True)
        def add_relu(a, b, y):
            zero = np.float32(0)
            for i in loop(y.shape[0]):
                s = a[i] + b[i]
                y[i] = s if (s > zero or s != s) else zero

        @njit(parallel=parallel, cache=True, nogil=True)
        def relu_grad_copy(y, dy, dx0, dx1):       # one bottom: the same array twice
            one, zero = np.float32(1), np.float32(0)
            for i in loop(y.shape[0]):
                g = dy[i] * (one if y[i] > zero else zero)
                dy[i] = g
                dx0[i] = g
                dx1[i] = g
        return {"row_sums": row_sums, "center_squares": center_squares, "two_sums": two_sums,
                "sgd_step": sgd_step, "sgd_step_no_decay": sgd_step_no_decay, "add_relu": add_relu,
                "relu_grad_copy": relu_grad_copy}

    @njit(cache=True, nogil=True)       # serial only: a few hundred values
    def image_sum(part, out, first):
        images, channels = part.shape
        start = 0
        if first:
            for c in range(channels):
                out[c] = part[0, c]
            start = 1
        for i in range(start, images):          # image after image: the order is the result
            for c in range(channels):
                out[c] += part[i, c]
    serial = _warm(dict(variants(False), image_sum=image_sum))
    # the parallel build only where a kernel is first given more than one thread: its first call
    # starts numba's OpenMP pool
    return serial and _Kernels(numba, serial, lambda: _warm(variants(True)))


def _warm(build):
    """``build`` compiled now (or loaded from numba's cache), or None where this numba cannot."""
    try:
        x = np.zeros((2, 3), np.float32)
        out = np.zeros(2, np.float32)
        build["row_sums"](x, out)
        build["center_squares"](x, out[:1], x.copy(), out)
        build["two_sums"](x, x, out, out.copy())
        one = np.float32(1)
        build["sgd_step"](out, out.copy(), out.copy(), one, one, one)
        build["sgd_step_no_decay"](out, out.copy(), out.copy(), one, one)
        build["add_relu"](out, out.copy(), out.copy())
        build["relu_grad_copy"](out, out.copy(), out.copy(), out.copy())
        if "image_sum" in build:
            build["image_sum"](x, out[:3].copy(), True)
        return build
    except Exception:           # a numba that cannot build these: einsum, as without it
        return None


class _Kernels:
    def __init__(self, numba, serial, parallel):
        self.numba, self.serial, self._parallel, self.parallel = numba, serial, parallel, None

    def parallel_build(self):
        """The parallel kernels, built on first use (False where numba cannot build them)."""
        if self.parallel is None:
            self.parallel = self._parallel() or False
        return self.parallel

    def _pick(self, name, size=None):
        budget = _threads.current().threads
        if budget > 1 and (size is None or size >= PARALLEL_MIN) and \
                threading.current_thread() is threading.main_thread():
            if not self.parallel_build():
                return self.serial[name]
            if self.numba.get_num_threads() != budget:
                self.numba.set_num_threads(min(budget, self.numba.config.NUMBA_NUM_THREADS))
            return self.parallel[name]
        return self.serial[name]

    def row_sums(self, x, out):
        self._pick("row_sums")(_rows(x), out.reshape(-1))

    def center_squares(self, x, mean, xn, out):
        self._pick("center_squares")(_rows(x), mean, _rows(xn), out.reshape(-1))

    def two_sums(self, dy, xn, sum_dy, sum_dy_xn):
        self._pick("two_sums")(_rows(dy), _rows(xn), sum_dy.reshape(-1), sum_dy_xn.reshape(-1))

    def sgd_step(self, data, diff, history, decay, rate, momentum):
        """SGD's whole step on one parameter in one pass, the bytes of NumPy's separate calls:
        diff = ((data * decay) + diff) * rate (no decay: diff * rate); history = (history *
        momentum) + diff; data -= history; diff = history (what Caffe's diff holds after
        ApplyUpdate)."""
        d, g, h = data.reshape(-1), diff.reshape(-1), history.reshape(-1)
        t = d.dtype.type            # the scalars in the arrays' type: a Python float would be float64
        if decay:
            self._pick("sgd_step", d.size)(d, g, h, t(decay), t(rate), t(momentum))
        else:
            self._pick("sgd_step_no_decay", d.size)(d, g, h, t(rate), t(momentum))

    def add_relu(self, a, b, y):
        """y = max(a + b, 0) in one pass, the bytes of np.add then np.maximum(y, 0, out=y)."""
        y = y.reshape(-1)
        self._pick("add_relu", y.size)(a.reshape(-1), b.reshape(-1), y)

    def relu_grad_copy(self, y, dy, *dx):
        """dy = dy * (y > 0) in place (a ReLU's in-place backward), copied into each of one or
        two ``dx`` in the same pass."""
        y, dy, dx = y.reshape(-1), dy.reshape(-1), [d.reshape(-1) for d in dx]
        self._pick("relu_grad_copy", y.size)(y, dy, dx[0], dx[-1])

    def image_sum(self, part, out, first):
        """out (C,) = part's rows (N, C) added one image after another, starting from part[0]
        (``first``) or from out: what ``normalization.sum_over_images`` adds in a Python loop."""
        self.serial["image_sum"](part, out, first)


def _rows(a):
    """An (images, channels, spatial) array as (rows, spatial), a view."""
    return a.reshape(-1, a.shape[-1])


def usable(*arrays) -> bool:
    """Whether the kernels take these arrays: float32, C-contiguous NumPy arrays."""
    return kernels() is not None and all(
        type(a) is np.ndarray and a.dtype == np.float32 and a.flags.c_contiguous for a in arrays)
