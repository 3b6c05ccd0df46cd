"""Region layers of Faster R-CNN and R-FCN: ROIPooling, PSROIPooling and SmoothL1Loss.

Semantics follow the forks' sources (rbgirshick/caffe-fast-rcnn, daijifeng001/caffe-rfcn):
a roi is a row (batch_index, x1, y1, x2, y2) in input image coordinates, scaled by
``spatial_scale`` onto the feature map. ROIPooling walks a roi's bins one tap (cell offset) at a
time over a channels-last copy of the input, so each step gathers whole channel rows;
PSROIPooling gathers a roi's bins at once, padded to the largest bin. Backward sums into the
bottom with one bincount over every (roi, bin, cell) forward read. The code takes its array
module from the input, so CuPy runs it too (the rois are read on the host).
"""
from __future__ import annotations

import numpy as np

from .base import Layer, array_module, count, register
from .loss import _Loss


def _host(a):
    """The rois on the host: their loops index the feature map per roi."""
    return a.get() if hasattr(a, "get") else np.asarray(a)


def _round(v):
    """C's round(): halves away from zero (NumPy's rounds them to even)."""
    return np.sign(v) * np.floor(np.abs(v) + v.dtype.type(0.5))


def _cells(start, end, size):
    """Per bin, its cells padded to the widest bin: (index (bins, k) clipped into the map, valid)."""
    k = max(int((end - start).max()), 1)
    idx = start[:, None] + np.arange(k)[None, :]
    valid = idx < end[:, None]
    return np.clip(idx, 0, size - 1), valid


def _check_rois(layer, shape):
    if len(shape) < 2 or count(shape, 1) != 5:
        raise layer.error(f"rois must be (num_rois, 5): batch index, x1, y1, x2, y2; got {shape}")


def _batch_index(layer, v, n):
    b = int(v)
    if not 0 <= b < n:
        raise layer.error(f"roi batch index {v:g} is outside the batch of {n}")
    return b


@register
class ROIPooling(Layer):
    """Max pooling of each roi into pooled_h x pooled_w bins (Fast R-CNN). A roi's corners are
    rounded after scaling, its size is at least one cell, bin edges are floor/ceil of the even
    split; an empty bin gives 0. Top (num_rois, C, pooled_h, pooled_w); the argmax (h * W + w, -1
    for an empty bin) is kept for backward, which gives the rois no gradient."""
    type = "ROIPooling"
    exact_bottoms, exact_tops = 2, 1
    backward_needs = ("bottom",)

    def allow_force_backward(self, bottom_index):
        return bottom_index == 0

    def setup(self, bottom_shapes):
        p = self.param.roi_pooling_param
        x, rois = (tuple(s) for s in bottom_shapes)
        if len(x) != 4:
            raise self.error(f"input must have 4 axes (num, channels, height, width), got {x}")
        _check_rois(self, rois)
        if p.pooled_h <= 0 or p.pooled_w <= 0:
            raise self.error("roi_pooling_param.pooled_h and pooled_w must be > 0")
        self.pooled = (p.pooled_h, p.pooled_w)
        top = (rois[0], x[1]) + self.pooled
        self.scratch_specs = {"argmax": (top, np.int32)}
        self.workspace_specs = {"nhwc": ((x[0], x[2], x[3], x[1]), None),
                                "best": (self.pooled + (x[1],), None), "idx": (self.pooled + (x[1],), np.int32)}
        self.backward_workspace_specs = {}
        return [top]

    def _bins(self, roi, H, W, dtype):
        """Per bin row and column: [start, end) on the feature map."""
        scale = dtype.type(self.param.roi_pooling_param.spatial_scale)
        x1, y1, x2, y2 = (int(v) for v in _round(roi[1:5].astype(dtype) * scale))
        out = []
        for lo, hi, pooled, size in ((y1, y2, self.pooled[0], H), (x1, x2, self.pooled[1], W)):
            bin_size = dtype.type(max(hi - lo + 1, 1)) / dtype.type(pooled)
            p = np.arange(pooled, dtype=dtype)
            start = np.floor(p * bin_size).astype(np.int64) + lo
            end = np.ceil((p + 1) * bin_size).astype(np.int64) + lo
            out.append((np.clip(start, 0, size), np.clip(end, 0, size)))
        return out

    def forward(self, bottom, top):
        x, y, arg = bottom[0].data, top[0].data, self.scratch["argmax"]
        xp = array_module(x)
        N, C, H, W = x.shape
        nhwc = self.workspace["nhwc"]           # a cell's channels side by side: one gather a tap
        nhwc[...] = x.transpose(0, 2, 3, 1)
        best, idx = self.workspace["best"], self.workspace["idx"]
        for r, roi in enumerate(_host(bottom[1].data).reshape(-1, 5)):
            b = _batch_index(self, roi[0], N)
            (hs, he), (ws, we) = self._bins(roi, H, W, np.dtype(x.dtype))
            hi, hv = _cells(hs, he, H)
            wi, wv = _cells(ws, we, W)
            best.fill(-np.inf)
            idx.fill(-1)
            # one tap (row a, column c of every bin) at a time, in the fork's row-major scan;
            # strict >: the first maximum wins
            for a in range(hi.shape[1]):
                for c in range(wi.shape[1]):
                    rows, cols = hi[:, a][:, None], wi[:, c][None, :]
                    v = nhwc[b][xp.asarray(rows), xp.asarray(cols)]                    # (PH, PW, C)
                    hit = (v > best) & xp.asarray(hv[:, a][:, None] & wv[:, c][None, :])[..., None]
                    xp.copyto(best, v, where=hit)
                    xp.copyto(idx, xp.asarray((rows * W + cols).astype(np.int32))[..., None], where=hit)
            best[idx < 0] = 0                                                          # empty bins
            y[r] = best.transpose(2, 0, 1)
            arg[r] = idx.transpose(2, 0, 1)

    def backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        dy, dx, arg = top[0].diff, bottom[0].diff, self.scratch["argmax"]
        xp = array_module(dy)
        N, C, H, W = dx.shape
        batch = xp.asarray(_host(bottom[1].data).reshape(-1, 5)[:, 0].astype(np.int64))
        plane = (batch[:, None] * C + xp.arange(C)[None, :]) * (H * W)      # (R, C)
        flat = plane[:, :, None, None] + arg
        hit = arg >= 0
        dx.reshape(-1)[...] = xp.bincount(flat[hit], weights=dy[hit], minlength=dx.size)


@register
class PSROIPooling(Layer):
    """R-FCN's position-sensitive roi pooling: bin (i, j) of output channel c averages input
    channel (c * group_size + i) * group_size + j over the bin. A roi's corners are rounded
    before scaling, its far edge is one cell past x2/y2, its size at least 0.1 cell; an empty
    bin gives 0. Top (num_rois, output_dim, group_size, group_size)."""
    type = "PSROIPooling"
    exact_bottoms, exact_tops = 2, 1
    backward_needs = ("bottom",)

    def allow_force_backward(self, bottom_index):
        return bottom_index == 0

    def setup(self, bottom_shapes):
        p = self.param.psroi_pooling_param
        for f in ("spatial_scale", "output_dim", "group_size"):
            if not p.HasField(f):
                raise self.error(f"psroi_pooling_param.{f} is required")
        x, rois = (tuple(s) for s in bottom_shapes)
        if len(x) != 4:
            raise self.error(f"input must have 4 axes (num, channels, height, width), got {x}")
        _check_rois(self, rois)
        if p.output_dim <= 0 or p.group_size <= 0:
            raise self.error("psroi_pooling_param.output_dim and group_size must be > 0")
        if x[1] != p.output_dim * p.group_size ** 2:
            raise self.error(f"input channels ({x[1]}) must be output_dim * group_size^2 "
                             f"({p.output_dim} * {p.group_size}^2)")
        self.dim, self.group = p.output_dim, p.group_size
        return [(rois[0], self.dim, self.group, self.group)]

    def _gather(self, roi, N, H, W, dtype):
        """The roi's batch item, per bin its cells (rows (G, kh), cols (G, kw)), validity and area."""
        scale, G = dtype.type(self.param.psroi_pooling_param.spatial_scale), self.group
        r = _round(roi[1:5].astype(dtype))
        x1, y1 = r[0] * scale, r[1] * scale
        x2, y2 = (r[2] + 1) * scale, (r[3] + 1) * scale
        cells = []
        for lo, hi, size in ((y1, y2, H), (x1, x2, W)):
            bin_size = max(hi - lo, dtype.type(0.1)) / dtype.type(G)
            p = np.arange(G, dtype=dtype)
            start = np.clip(np.floor(p * bin_size + lo).astype(np.int64), 0, size)
            end = np.clip(np.ceil((p + 1) * bin_size + lo).astype(np.int64), 0, size)
            cells.append((*_cells(start, end, size), end - start))
        (hi, hv, hn), (wi, wv, wn) = cells
        valid = hv[:, None, :, None] & wv[None, :, None, :]                  # (G, G, kh, kw)
        return _batch_index(self, roi[0], N), hi, wi, valid, np.outer(hn, wn)

    def _index(self, xp, hi, wi):
        """Index arrays into one item (dim, G, G, H, W) giving (dim, G, G, kh, kw)."""
        G = self.group
        g = xp.arange(G)
        return (slice(None), g[:, None, None, None], g[None, :, None, None],
                xp.asarray(hi)[:, None, :, None], xp.asarray(wi)[None, :, None, :])

    def forward(self, bottom, top):
        x, y = bottom[0].data, top[0].data
        xp = array_module(x)
        N, C, H, W = x.shape
        G = self.group
        for r, roi in enumerate(_host(bottom[1].data).reshape(-1, 5)):
            b, hi, wi, valid, area = self._gather(roi, N, H, W, np.dtype(x.dtype))
            g = x[b].reshape(self.dim, G, G, H, W)[self._index(xp, hi, wi)]      # (dim, G, G, kh, kw)
            s = (g * xp.asarray(valid, dtype=x.dtype)).sum(axis=(3, 4))
            y[r] = xp.where(xp.asarray(area > 0), s / xp.asarray(np.maximum(area, 1), dtype=x.dtype), 0)

    def backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        dy, dx = top[0].diff, bottom[0].diff
        xp = array_module(dy)
        N, C, H, W = dx.shape
        G = self.group
        flats, weights = [], []
        item = xp.arange(C * H * W).reshape(self.dim, G, G, H, W)
        for r, roi in enumerate(_host(bottom[1].data).reshape(-1, 5)):
            b, hi, wi, valid, area = self._gather(roi, N, H, W, np.dtype(dx.dtype))
            flat = item[self._index(xp, hi, wi)] + b * C * H * W                  # (dim, G, G, kh, kw)
            w = dy[r] / xp.asarray(np.maximum(area, 1), dtype=dy.dtype)           # empty bins read no cell
            hit = xp.asarray(valid)[None].repeat(self.dim, 0)
            flats.append(flat[hit])
            weights.append(xp.broadcast_to(w[..., None, None], flat.shape)[hit])
        dx.reshape(-1)[...] = xp.bincount(xp.concatenate(flats), weights=xp.concatenate(weights),
                                          minlength=dx.size) if flats else 0


@register
class SmoothL1Loss(_Loss):
    """Fast R-CNN's loss: sum over every element of w_out * f(w_in * (b0 - b1)) / num, with
    f(d) = 0.5 (sigma d)^2 where |d| < 1 / sigma^2, else |d| - 0.5 / sigma^2. Bottoms 2 and 3,
    the inside and outside weights, come together or not at all."""
    type = "SmoothL1Loss"
    exact_bottoms = None
    min_bottoms, max_bottoms = 2, 4

    def allow_force_backward(self, bottom_index):
        return bottom_index < 2

    def setup(self, bottom_shapes):
        shapes = [tuple(s) for s in bottom_shapes]
        if len(shapes) == 3:
            raise self.error("with weights, give both inside and outside weights (4 bottoms)")
        self.setup_loss(shapes[:2])
        for i, s in enumerate(shapes[1:], 1):
            if count(s, 1) != count(shapes[0], 1):
                raise self.error(f"bottom {i} {s} must match bottom 0 {shapes[0]} past the first axis")
        self.sigma2 = float(self.param.smooth_l1_loss_param.sigma) ** 2
        self.workspace_specs = {"diff": (shapes[0], None), "errors": (shapes[0], None)}
        self.backward_workspace_specs = {"diff": (shapes[0], None)}
        return [()]

    def _inside(self, bottom, xp, d):
        """d = w_in * (b0 - b1)."""
        xp.subtract(bottom[0].data, bottom[1].data.reshape(d.shape), out=d)
        if len(bottom) == 4:
            d *= bottom[2].data.reshape(d.shape)

    def forward(self, bottom, top):
        xp = array_module(bottom[0].data)
        d, e = self.workspace["diff"], self.workspace["errors"]
        self._inside(bottom, xp, d)
        a = xp.abs(d)
        small = a < 1.0 / self.sigma2
        xp.copyto(e, xp.where(small, 0.5 * self.sigma2 * d * d, a - 0.5 / self.sigma2))
        if len(bottom) == 4:
            e *= bottom[3].data.reshape(e.shape)
        top[0].data[...] = e.sum() / e.dtype.type(bottom[0].shape[0])

    def backward(self, top, propagate_down, bottom):
        xp = array_module(bottom[0].data)
        d = self.workspace["diff"]
        self._inside(bottom, xp, d)
        g = xp.where(xp.abs(d) < 1.0 / self.sigma2, self.sigma2 * d, xp.sign(d))
        if len(bottom) == 4:
            g *= bottom[2].data.reshape(d.shape) * bottom[3].data.reshape(d.shape)
        for i, sign in ((0, 1), (1, -1)):
            if propagate_down[i]:
                bottom[i].diff.reshape(d.shape)[...] = g * (sign * top[0].diff / bottom[i].shape[0])
