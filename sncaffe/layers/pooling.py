"""Pooling over NCHW windows (Caffe's PoolingParameter): MAX, AVE and STOCHASTIC.

Windows are walked tap by tap: for each of the kh*kw kernel offsets one view
of the input holds that offset of every window at once, so the Python loop
runs kh*kw times and each step is one vectorized pass. With a stride, padding
or a clipped last window, the input is first laid into a workspace split by
stride phase, (N, C, sh, sw, H'/sh, W'/sw), so that every tap's view has
unit-stride rows (strided NumPy loops are several times slower). Global
pooling (a kernel covering the whole input) reduces over H*W directly.

On the CPU, float32 MAX and AVE pooling with one top run on oneDNN's JIT kernel where it loads
and has one (``onednn.Pool``: one pass each way on the OpenMP team, on NCHW or on blocked copies,
where the taps take kh*kw passes or more; ``SNCAFFE_CONV=native`` keeps NumPy's): MAX's argmax
is then oneDNN's own encoding (its workspace, in scratch ``argmax``), which only its
backward reads (a mask top needs Caffe's, so a layer with one runs on NumPy), and AVE runs there
only where no window reaches past the padding (oneDNN divides by the whole kernel, Caffe by the
cells up to the padding's end).
"""
from __future__ import annotations

import itertools

import numpy as np

from ..backend import is_gpu, onednn, workers
from . import pooling_gpu
from .base import TEST, Layer, array_module, register

MAX, AVE, STOCHASTIC = 0, 1, 2          # PoolingParameter.PoolMethod
CEIL = 0                                # PoolingParameter.RoundMode
FLT_MAX = float(np.finfo(np.float32).max)   # Caffe starts a MAX window at -FLT_MAX (float and double)
_NONE = np.empty(0, np.uint8)           # no workspace
ONEDNN = True                           # False: layers set up after it run NumPy's taps (tools/bench_toggle.py)


def pooled_size(length, k, s, p, ceil, padded):
    """Caffe's output size: rounded up (or down); with any padding, a last window
    starting inside the padding is dropped."""
    span = length + 2 * p - k
    out = (-(-span // s) if ceil else span // s) + 1
    if padded and (out - 1) * s >= length + p:
        out -= 1
    return out


def padded_view(ws, shape, offsets, fill):
    """Set the border of workspace ``ws`` to ``fill``; return the interior of
    ``shape`` placed at ``offsets`` (one per axis)."""
    for a, (o, n) in enumerate(zip(offsets, shape)):
        lead = (slice(None),) * a
        ws[lead + (slice(0, o),)] = fill
        ws[lead + (slice(o + n, None),)] = fill
    return ws[tuple(slice(o, o + n) for o, n in zip(offsets, shape))]


@register
class Pooling(Layer):
    """Caffe's Pooling layer.

    MAX and STOCHASTIC keep, per window, the index of the chosen kernel tap
    (row-major in the window) in scratch ``argmax`` for backward; an optional
    second top (MAX only) outputs Caffe's mask, the argmax as h*W+w in float.
    Backward needs neither bottom nor top data.
    """
    dnn = None          # onednn.Pool where oneDNN runs the layer
    type = "Pooling"
    exact_bottoms = 1
    min_tops, max_tops = 1, 2
    backward_needs = ()

    def setup(self, bottom_shapes):
        pp = self.param.pooling_param
        self.method = pp.pool
        if len(self.param.top) > 1 and self.method != MAX:
            raise self.error("only MAX pooling has a second top (the argmax mask)")
        shape = tuple(bottom_shapes[0])
        if len(shape) != 4:
            raise self.error(f"input must have 4 axes (num, channels, height, width), got {shape}")
        N, C, H, W = shape
        has = pp.HasField
        if pp.global_pooling:
            if has("kernel_size") or has("kernel_h") or has("kernel_w"):
                raise self.error("with global_pooling the kernel size cannot be given")
            kh, kw = H, W
        elif has("kernel_size") == (has("kernel_h") and has("kernel_w")):
            raise self.error("give kernel_size, or kernel_h and kernel_w (not both)")
        else:
            kh, kw = (pp.kernel_size,) * 2 if has("kernel_size") else (pp.kernel_h, pp.kernel_w)
        for name in ("pad", "stride"):
            if not (has(name + "_h") == has(name + "_w") and not (has(name) and has(name + "_h"))):
                raise self.error(f"give {name}, or {name}_h and {name}_w")
        ph, pw = (pp.pad_h, pp.pad_w) if has("pad_h") else (pp.pad,) * 2
        sh, sw = (pp.stride_h, pp.stride_w) if has("stride_h") else (pp.stride,) * 2
        if kh <= 0 or kw <= 0 or sh <= 0 or sw <= 0:
            raise self.error("kernel size and stride must be positive")
        if pp.global_pooling and (ph or pw or sh != 1 or sw != 1):
            raise self.error("with global_pooling only pad = 0 and stride = 1 are allowed")
        if (ph or pw) and (self.method == STOCHASTIC or ph >= kh or pw >= kw):
            raise self.error("padding needs MAX or AVE pooling and a pad smaller than the kernel")
        # the forks' ceil_mode (nets get it as round_mode from upgrade.py; a bare layer may still hold it)
        ceil = pp.ceil_mode if pp.HasField("ceil_mode") else pp.round_mode == CEIL
        PH = pooled_size(H, kh, sh, ph, ceil, ph or pw)
        PW = pooled_size(W, kw, sw, pw, ceil, ph or pw)
        if PH <= 0 or PW <= 0:
            raise self.error(f"kernel {kh}x{kw} does not fit the padded {H}x{W} input")
        self.kernel, self.stride, self.pad = (kh, kw), (sh, sw), (ph, pw)
        self.in_hw, self.pooled = (H, W), (PH, PW)
        # A kernel covering the unpadded input is global pooling, whatever the stride.
        self.is_global = (kh, kw) == (H, W) and not (ph or pw) and self.method != STOCHASTIC
        top_shape = (N, C, PH, PW)
        self.scratch_specs, self.workspace_specs = {}, {}
        if self.method != AVE:
            self.scratch_specs["argmax"] = (top_shape, np.uint8 if kh * kw <= 256 else np.int32)
        self.dnn = self._onednn(shape, len(self.param.top))
        if self.dnn is not None:
            if self.dnn.ws is not None:     # oneDNN's workspace: a byte per output value (blocked: padded)
                self.scratch_specs["argmax"] = ((self.dnn.ws_bytes,), np.uint8)
            if self.dnn.nbytes:
                self.workspace_specs["onednn"] = ((self.dnn.nbytes,), np.uint8)
            return [top_shape]
        # The GPU's MAX and AVE kernels read the input in place: no workspace.
        if not self.is_global and (self.method == STOCHASTIC or not is_gpu(self.target)):
            # Enough rows/cols for the padding and for the last window of ceil rounding.
            Lh, Lw = max(H + ph, (PH - 1) * sh + kh), max(W + pw, (PW - 1) * sw + kw)
            # Windows that tile the input exactly (kernel = stride, no padding, nothing left
            # over: LeNet's 2x2/2) read their phases as a view of the input itself.
            tiled = (kh, kw) == (sh, sw) and not (ph or pw) and (H, W) == (PH * sh, PW * sw)
            if (Lh, Lw, sh, sw) != (H, W, 1, 1) and not tiled:
                self.workspace_specs["padded"] = ((N, C, sh, sw, -(-Lh // sh), -(-Lw // sw)), None)
            self.workspace_specs["tmp"] = (top_shape, None)
            if self.method != AVE:
                self.workspace_specs["hit"] = (top_shape, np.bool_)
                self.workspace_specs["step"] = (top_shape, self.scratch_specs["argmax"][1])
        return [top_shape] * len(self.param.top)

    def _onednn(self, shape, tops):
        """oneDNN's Pool for this layer, or None where NumPy runs it (see the module's doc)."""
        if (not ONEDNN or is_gpu(self.target) or np.dtype(self.dtype) != np.float32 or self.method == STOCHASTIC
                or self.is_global or tops > 1 or self.scratch_specs.get("argmax", (0, np.uint8))[1] != np.uint8):
            return None
        past = any((p - 1) * s + k > n + 2 * q for p, s, k, n, q in zip(self.pooled, self.stride, self.kernel,
                                                                         self.in_hw, self.pad))
        if self.method == AVE and past:
            return None
        try:
            return onednn.pool(shape, self.pooled, self.kernel, self.stride, self.pad,
                               onednn.POOL_MAX if self.method == MAX else onednn.POOL_AVG)
        except (ValueError, RuntimeError):      # a misspelt SNCAFFE_CONV: the convolutions report it
            return None

    # -- helpers ------------------------------------------------------------
    def _taps(self):
        """(t, index) per kernel tap: its view, in every window, of the phase-split source."""
        (kh, kw), (sh, sw), (PH, PW) = self.kernel, self.stride, self.pooled
        for t, (i, j) in enumerate(itertools.product(range(kh), range(kw))):
            yield t, (Ellipsis, i % sh, j % sw, slice(i // sh, i // sh + PH), slice(j // sw, j // sw + PW))

    def _phases(self):
        """Per stride phase (a, b) of the padded input: its block's interior
        (offsets, size) in the workspace and the image cells that fill it."""
        (H, W), (sh, sw), (ph, pw) = self.in_hw, self.stride, self.pad
        for a, b in itertools.product(range(sh), range(sw)):
            h0, w0 = (a - ph) % sh, (b - pw) % sw       # first image row/col in this phase
            size = (len(range(h0, H, sh)), len(range(w0, W, sw)))
            yield (a, b), ((h0 + ph) // sh, (w0 + pw) // sw), size, (slice(h0, None, sh), slice(w0, None, sw))

    def _source(self, x, fill, ws):
        """x split by stride phase into workspace ``ws`` (the layer's "padded", or rows of it),
        ``fill`` around it; or a view of x split so when there is no padding or clipped window
        and the stride is 1 or tiles it."""
        if "padded" not in self.workspace_specs:
            return self._phase_view(x)
        N, C = x.shape[:2]
        for phase, offsets, size, cells in self._phases():
            padded_view(ws[(slice(None), slice(None)) + phase], (N, C) + size, (0, 0) + offsets,
                        fill)[...] = x[(Ellipsis,) + cells]
        return ws

    def _phase_view(self, x):
        """(N, C, sh, sw, H/sh, W/sw): x by stride phase, a view (stride 1, or tiled windows)."""
        N, C, H, W = x.shape
        (sh, sw), (PH, PW) = self.stride, self.pooled
        if (sh, sw) == (1, 1):
            return x.reshape(N, C, 1, 1, H, W)
        return x.reshape(N, C, PH, sh, PW, sw).transpose(0, 1, 3, 5, 2, 4)

    def _divisor(self, xp, dtype):
        """AVE window sizes (PH, PW): cells in the padding count, cells past it do not."""
        def sizes(n_out, k, s, p, length):
            start = xp.arange(n_out) * s - p
            return xp.minimum(start + k, length + p) - start
        rows, cols = (sizes(*a) for a in zip(self.pooled, self.kernel, self.stride, self.pad, self.in_hw))
        return (rows[:, None] * cols[None, :]).astype(dtype)

    def _mask(self, xp, idx, out):
        """Caffe's mask top: the argmax as h*W+w, -1 for a window holding no input cell."""
        (H, W), kw = self.in_hw, self.kernel[1]
        if self.is_global:
            out[...] = idx
            return
        h = (xp.arange(self.pooled[0]) * self.stride[0] - self.pad[0])[:, None] + idx // kw
        w = (xp.arange(self.pooled[1]) * self.stride[1] - self.pad[1])[None, :] + idx % kw
        out[...] = xp.where((h >= 0) & (h < H) & (w >= 0) & (w < W), h * W + w, -1)

    # -- forward ------------------------------------------------------------
    def _split(self, arrays, work, fn):
        """``fn({name: rows})`` over pieces of the N*C planes of ``arrays`` (each (N, C, ...),
        None skipped) and of the workspace, on threads (backend/workers): every plane's windows
        are its own, so the pieces compute exactly what the whole would."""
        arrays = {**self.workspace, **{k: a for k, a in arrays.items() if a is not None}}
        planes = {k: a.reshape((a.shape[0] * a.shape[1], 1) + a.shape[2:]) for k, a in arrays.items()}
        if any(type(a) is not np.ndarray for a in planes.values()):
            return fn(planes)                   # CuPy's (STOCHASTIC's backward): whole
        n = next(iter(planes.values())).shape[0]
        workers.split(n, work, lambda rows: fn({k: a[rows] for k, a in planes.items()}))

    def forward(self, bottom, top):
        x, y = bottom[0].data, top[0].data
        xp = array_module(x)
        idx = self.scratch.get("argmax")
        if xp is not np and self.method != STOCHASTIC:      # GPU: Caffe's kernels
            return pooling_gpu.pool_forward(self, x, y, idx, top[1].data if len(top) > 1 else None)
        if self.dnn is not None:
            return self.dnn.forward(x, y, idx, self.workspace.get("onednn", _NONE))
        if self.method == STOCHASTIC:       # one random draw for the whole top: not split
            self._forward_stochastic(xp, self._source(x, 0, self.workspace.get("padded")), y, idx)
        else:
            taps = 1 if self.is_global else self.kernel[0] * self.kernel[1]
            self._split({"x": x, "y": y, "idx": idx}, x.size + 3 * taps * y.size, self._forward_planes)
        if len(top) > 1:
            self._mask(xp, idx, top[1].data)

    def _forward_planes(self, a):
        """MAX or AVE pooling of planes a["x"] into a["y"] (and MAX's a["idx"]), with the
        workspace's rows of these planes."""
        x, y, idx = a["x"], a["y"], a.get("idx")
        if self.is_global:
            N, C, H, W = x.shape
            x3, y2 = x.reshape(N, C, H * W), y.reshape(N, C)
            if self.method == MAX:
                x3.max(axis=2, out=y2)
                idx[...] = x3.argmax(axis=2).reshape(idx.shape)   # first maximum, as Caffe's strict >
            else:
                x3.sum(axis=2, out=y2)
                y2 /= H * W
        elif self.method == MAX:
            src, hit, step = self._source(x, -FLT_MAX, a.get("padded")), a["hit"], a["step"]
            for t, win in self._taps():
                if t == 0:
                    y[...] = src[win]
                    idx.fill(0)
                    continue
                np.greater(src[win], y, out=hit)     # strict: the first maximum in the window wins
                np.maximum(y, src[win], out=y)
                # idx = t where hit, branch-free (masked copies are slow on random masks);
                # exact in uint8 too, where the arithmetic wraps modulo 256.
                np.subtract(t, idx, out=step)
                step *= hit
                idx += step
        else:
            src = self._source(x, 0, a.get("padded"))
            for t, win in self._taps():
                if t == 0:
                    y[...] = src[win]
                else:
                    y += src[win]
            y /= self._divisor(np, y.dtype)

    def _forward_stochastic(self, xp, src, y, idx):
        """Caffe's (GPU-only) STOCHASTIC pooling, for non-negative inputs. TRAIN:
        pick a cell with probability value/sum (the first whose running sum
        reaches u*sum, u uniform). TEST: the value-weighted average sum(x^2)/sum(x)."""
        tmp = self.workspace["tmp"]
        y.fill(0)
        if self.phase == TEST:
            tmp.fill(0)
            for _, win in self._taps():
                y += src[win]
                tmp += src[win] * src[win]
            positive = y > 0
            y[...] = xp.where(positive, tmp / xp.where(positive, y, 1), 0)
            return
        for _, win in self._taps():
            y += src[win]
        u = xp.asarray(self.rng.random(y.shape))
        xp.multiply(y, u.astype(y.dtype, copy=False), out=tmp)      # the threshold
        # The running sum never decreases, so the first tap reaching the
        # threshold is the count of taps still below it.
        y.fill(0)
        idx.fill(0)
        hit = self.workspace["hit"]
        for _, win in self._taps():
            y += src[win]
            xp.less(y, tmp, out=hit)
            idx += hit
        last = self.kernel[0] * self.kernel[1] - 1
        xp.minimum(idx, last, out=idx)
        for t, win in self._taps():
            xp.equal(idx, t, out=hit)
            xp.copyto(y, src[win], where=hit)

    # -- backward -----------------------------------------------------------
    def backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        dy, dx = top[0].diff, bottom[0].diff
        xp = array_module(dy)
        idx = self.scratch.get("argmax")
        if self.method == STOCHASTIC and self.phase == TEST:
            raise self.error("STOCHASTIC pooling has no backward in TEST phase: its TEST forward picks no cell")
        if xp is not np and self.method != STOCHASTIC:
            return pooling_gpu.pool_backward(self, dy, dx, idx)
        if self.dnn is not None:
            return self.dnn.backward(dy, dx, idx, self.workspace.get("onednn", _NONE))
        taps = 1 if self.is_global else self.kernel[0] * self.kernel[1]
        self._split({"dy": dy, "dx": dx, "idx": idx}, dx.size + 4 * taps * dy.size, self._backward_planes)

    def _backward_planes(self, a):
        """dx of planes a["dx"] from a["dy"] (and a["idx"]), with the workspace's rows of them."""
        dy, dx, idx = a["dy"], a["dx"], a.get("idx")
        xp = array_module(dy)
        if self.is_global:
            N, C, H, W = dx.shape
            if self.method == MAX:
                dx.fill(0)
                flat = xp.arange(N * C) * (H * W) + idx.reshape(-1)
                dx.reshape(-1)[flat] = dy.reshape(-1)
            else:
                dx.reshape(N, C, H * W)[...] = dy.reshape(N, C, 1) / (H * W)
            return
        dst = a["padded"] if "padded" in self.workspace_specs else self._phase_view(dx)
        dst.fill(0)
        tmp, hit = a["tmp"], a.get("hit")
        if self.method == AVE:
            xp.divide(dy, self._divisor(xp, dy.dtype), out=tmp)
        for t, win in self._taps():
            if self.method != AVE:
                xp.equal(idx, t, out=hit)
                xp.multiply(dy, hit, out=tmp)
            dst[win] += tmp          # overlapping windows accumulate, one tap at a time
        if "padded" in self.workspace_specs:
            for (a_, b), (q0, r0), (nq, nr), cells in self._phases():
                dx[(Ellipsis,) + cells] = dst[:, :, a_, b, q0:q0 + nq, r0:r0 + nr]
