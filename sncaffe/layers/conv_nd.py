"""N-d convolution (Caffe's im2col_nd path): Convolution and Deconvolution over any number of
spatial axes, with per-axis kernel_size, stride, pad and dilation (one value for every axis, or
one per axis), on the CPU.

A bottom with 4 axes keeps the 2-D kernels of conv.py (tuned for speed); any other number of
axes takes this path: the classes here are registered as "Convolution" and "Deconvolution" and
hand 4-D bottoms to their conv.py parents. Columns are Caffe's: row (c, k_0, ..., k_{d-1}),
column (o_0, ..., o_{d-1}), each row-major; the weight is (num_output, channels/group, *kernel).
"""
from __future__ import annotations

import math

import numpy as np

from ..backend import is_gpu
from . import conv
from .base import array_module, register


def _per_axis(layer, p, name, default, d):
    """Caffe's repeated field ``name``: empty (default), one value for every axis or one per axis."""
    short = "kernel" if name == "kernel_size" else name
    if name != "dilation" and any(p.HasField(f"{short}_{a}") for a in "hw"):
        raise layer.error(f"{short}_h/{short}_w are for 2-D convolution only; give {name} for {d} spatial axes")
    values = list(getattr(p, name))
    if not values:
        return (default,) * d
    if len(values) == 1:
        return (values[0],) * d
    if len(values) == d:
        return tuple(values)
    raise layer.error(f"{name} needs 1 or {d} values for {d} spatial axes, got {len(values)}")


class _NDMixin:
    """The N-d path of a conv.py class, taken when the bottom does not have 4 axes."""
    nd = False

    def setup(self, bottom_shapes):
        shape = tuple(bottom_shapes[0])
        self.nd = len(shape) != 4
        if not self.nd:
            return super().setup(bottom_shapes)
        p = self.param.convolution_param
        if len(self.param.top) != len(bottom_shapes):
            raise self.error(f"needs one top per bottom ({len(bottom_shapes)} bottoms, {len(self.param.top)} tops)")
        if any(tuple(s) != shape for s in bottom_shapes):
            raise self.error(f"all bottoms must have the same shape, got {[tuple(s) for s in bottom_shapes]}")
        if len(shape) < 3:
            raise self.error(f"a convolution needs a batch, a channel and a spatial axis; bottom is {shape}")
        if p.axis not in (1, 1 - len(shape)):
            raise self.error(f"N-d convolution supports channel axis 1 only, got axis {p.axis}")
        if is_gpu(self.target):
            raise self.error(f"N-d convolution (a {len(shape)}-axis bottom) runs on the CPU only")
        d = len(shape) - 2
        self.kernel = _per_axis(self, p, "kernel_size", 0, d)
        self.stride = _per_axis(self, p, "stride", 1, d)
        self.pad = _per_axis(self, p, "pad", 0, d)
        self.dilation = _per_axis(self, p, "dilation", 1, d)
        for what, v in (("kernel size", self.kernel), ("stride", self.stride), ("dilation", self.dilation)):
            if min(v) < 1:
                raise self.error(f"{what} must be positive, got {v}")
        N, C, spatial = shape[0], shape[1], shape[2:]
        M, group = p.num_output, p.group
        if M < 1:
            raise self.error("convolution_param.num_output must be set (> 0)")
        if group < 1 or C % group or M % group:
            raise self.error(f"channels ({C}) and num_output ({M}) must be multiples of group ({group})")
        extent = [dl * (k - 1) + 1 for k, dl in zip(self.kernel, self.dilation)]
        if self.deconv:
            out = tuple(s * (n - 1) + e - 2 * q for n, s, e, q in zip(spatial, self.stride, extent, self.pad))
            if min(out) < 1:
                raise self.error(f"output size {out} < 1 (input {spatial}, kernel extent {extent}, pad {self.pad})")
            # conv view: the image side is top (M channels), the grid side is bottom (C)
            self.image, self.grid, self.c_img, self.c_grid = out, spatial, M, C
            self.param_shapes = [(C, M // group) + self.kernel]
        else:
            if any(n + 2 * q < e for n, q, e in zip(spatial, self.pad, extent)):
                raise self.error(f"kernel extent {extent} exceeds the padded input {spatial} + 2 x {self.pad}")
            out = tuple((n + 2 * q - e) // s + 1 for n, q, e, s in zip(spatial, self.pad, extent, self.stride))
            self.image, self.grid, self.c_img, self.c_grid = spatial, out, C, M
            self.param_shapes = [(M, C // group) + self.kernel]
        self.group = group
        self.bias_term = p.bias_term
        self.param_shapes += [(M,)] * self.bias_term
        padded = tuple(n + 2 * q for n, q in zip(self.image, self.pad))
        rows = self.c_img * math.prod(self.kernel)
        self.workspace_specs = {"col": ((rows * math.prod(self.grid),), None),
                                "padded": ((self.c_img * math.prod(padded),), None)}
        self.backward_workspace_specs = {**self.workspace_specs,
                                         "weight_diff": ((math.prod(self.param_shapes[0]),), None)}
        return [(N, M) + tuple(out)] * len(bottom_shapes)

    def workspace_for_chunk(self, chunk):
        return None if self.nd else super().workspace_for_chunk(chunk)

    # -- Caffe's im2col_nd / col2im_nd ----------------------------------------------------------
    def _windows(self, padded):
        """A view (C, *kernel, *grid) of ``padded`` (C, *padded image): each tap's samples."""
        c = padded.shape[0]
        st = padded.strides
        strides = (st[0],) + tuple(s * dl for s, dl in zip(st[1:], self.dilation)) \
            + tuple(s * k for s, k in zip(st[1:], self.stride))
        return np.lib.stride_tricks.as_strided(padded, (c,) + self.kernel + self.grid, strides, writeable=False)

    def _padded(self, ws):
        shape = (self.c_img,) + tuple(n + 2 * q for n, q in zip(self.image, self.pad))
        return ws["padded"][:math.prod(shape)].reshape(shape)

    def _inner(self, padded):
        return padded[(slice(None),) + tuple(slice(q, q + n) for q, n in zip(self.pad, self.image))]

    def _im2col(self, x, ws):
        """Caffe's columns of one image ``x`` (C, *image), in the workspace."""
        padded = self._padded(ws)
        padded[...] = 0
        self._inner(padded)[...] = x
        col = ws["col"].reshape(self.c_img, *self.kernel, *self.grid)
        col[...] = self._windows(padded)
        return ws["col"].reshape(self.c_img * math.prod(self.kernel), -1)

    def _col2im(self, col, dx, ws):
        """dx (C, *image) = the sum of the columns ``col`` over overlapping windows."""
        padded = self._padded(ws)
        padded[...] = 0
        col = col.reshape(self.c_img, *self.kernel, *self.grid)
        for tap in np.ndindex(*self.kernel):
            window = tuple(slice(t * dl, t * dl + s * (g - 1) + 1, s)
                           for t, dl, s, g in zip(tap, self.dilation, self.stride, self.grid))
            padded[(slice(None),) + window] += col[(slice(None),) + tap]
        dx[...] = self._inner(padded)

    # -- the image -> grid convolution and its two gradients, per group ---------------------------
    def _groups(self, w):
        """(weight (M/g, C/g*K), image channel slice, grid channel slice) per group, in the conv view."""
        g, ci, cg = self.group, self.c_img // self.group, self.c_grid // self.group
        k = math.prod(self.kernel)
        # Convolution's weight (M, C/g, *k) and Deconvolution's (C, M/g, *k) are both
        # (C_grid, C_img/g, *k): group j's rows are its grid channels
        mats = [w[j * cg:(j + 1) * cg].reshape(cg, ci * k) for j in range(g)]
        return [(m, slice(j * ci * k, (j + 1) * ci * k), slice(j * cg, (j + 1) * cg)) for j, m in enumerate(mats)]

    def _conv(self, x, w, y, ws):
        """y (C_grid, *grid) = the convolution of image x (C_img, *image)."""
        col = self._im2col(x, ws)
        y2 = y.reshape(self.c_grid, -1)
        for m, rows, ch in self._groups(w):
            np.matmul(m, col[rows], out=y2[ch])

    def _conv_data_grad(self, dy, w, dx, ws):
        """dx (C_img, *image) = the image-side gradient of dy (C_grid, *grid)."""
        col = ws["col"].reshape(self.c_img * math.prod(self.kernel), -1)
        dy2 = dy.reshape(self.c_grid, -1)
        for m, rows, ch in self._groups(w):
            np.matmul(m.T, dy2[ch], out=col[rows])
        self._col2im(col, dx, ws)

    def _conv_weight_grad(self, x, dy, dw, ws):
        """dw += the weight gradient of image x and grid-side gradient dy."""
        col = self._im2col(x, ws)
        dy2 = dy.reshape(self.c_grid, -1)
        tmp = ws["weight_diff"].reshape(dw.shape)
        for (m, rows, ch), (t, _, _) in zip(self._groups(dw), self._groups(tmp)):
            np.matmul(dy2[ch], col[rows].T, out=t)
            m += t

    # -- forward / backward -------------------------------------------------------------------
    def forward(self, bottom, top):
        if not self.nd:
            return super().forward(bottom, top)
        if array_module(bottom[0].data) is not np:
            raise self.error("N-d convolution runs on the CPU only")
        w, ws = self.blobs[0].data, self.workspace
        for b, t in zip(bottom, top):
            for n in range(b.data.shape[0]):
                if self.deconv:
                    self._conv_data_grad(b.data[n], w, t.data[n], ws)
                else:
                    self._conv(b.data[n], w, t.data[n], ws)
            if self.bias_term:
                t.data += self.blobs[1].data.reshape((1, -1) + (1,) * len(self.kernel))

    def backward(self, top, propagate_down, bottom):
        if not self.nd:
            return super().backward(top, propagate_down, bottom)
        w, ws = self.blobs[0].data, self.workspace
        for i, (t, b) in enumerate(zip(top, bottom)):
            if self.bias_term and self._learns(1):
                self.blobs[1].diff += t.diff.reshape(t.diff.shape[0], t.diff.shape[1], -1).sum(axis=(0, 2))
            for n in range(t.diff.shape[0]):
                if self.deconv:         # image side: top; grid side: bottom
                    if self._learns(0):
                        self._conv_weight_grad(t.diff[n], b.data[n], self.blobs[0].diff, ws)
                    if propagate_down[i]:
                        self._conv(t.diff[n], w, b.diff[n], ws)
                else:
                    if self._learns(0):
                        self._conv_weight_grad(b.data[n], t.diff[n], self.blobs[0].diff, ws)
                    if propagate_down[i]:
                        self._conv_data_grad(t.diff[n], w, b.diff[n], ws)


@register
class Convolution(_NDMixin, conv.Convolution):
    """Caffe's Convolution: 4-D bottoms through conv.py's kernels, others through im2col_nd."""


@register
class Deconvolution(_NDMixin, conv.Deconvolution):
    """Caffe's Deconvolution: 4-D bottoms through conv.py's kernels, others through col2im_nd."""
