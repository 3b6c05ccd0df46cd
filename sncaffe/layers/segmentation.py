"""Layers of the segmentation forks: Upsample (caffe-segnet), BN (caffe-segnet's and PSPNet's)
and Interp (PSPNet, DeepLab), each with its fork's semantics."""
from __future__ import annotations

import numpy as np

from ..fillers import fill
from .base import TEST, Layer, array_module, register


@register
class Upsample(Layer):
    """SegNet's unpooling: each input value goes to the cell its pooling mask names (h * W + w of
    the output plane; a later value wins a shared cell); every other cell is 0. Backward reads
    the gradient of the named cell. The output size is upsample_h x upsample_w, or the input's
    times scale (scale_h, scale_w), less one where pad_out_h (pad_out_w) is set."""
    type = "Upsample"
    exact_bottoms, exact_tops = 2, 1
    backward_needs = ("bottom",)

    def allow_force_backward(self, bottom_index):
        return bottom_index == 0

    def setup(self, bottom_shapes):
        p = self.param.upsample_param
        x, mask = (tuple(s) for s in bottom_shapes)
        if len(x) != 4 or len(mask) != 4:
            raise self.error(f"input and mask must have 4 axes (num, channels, height, width), got {x} and {mask}")
        if x != mask:
            raise self.error(f"the mask {mask} must have the input's shape {x}")
        has = p.HasField
        if has("upsample_h") and has("upsample_w"):
            if p.upsample_h <= 1 or p.upsample_w <= 1:
                raise self.error("upsample_h and upsample_w must be > 1")
            out = (p.upsample_h, p.upsample_w)
        elif (has("scale_h") or has("scale_w")) and (has("scale") or not (has("scale_h") and has("scale_w"))):
            raise self.error("give upsample_h and upsample_w, or scale, or scale_h and scale_w")
        else:
            sh, sw = (p.scale_h, p.scale_w) if has("scale_h") else (p.scale, p.scale)
            if sh <= 1 or sw <= 1:
                raise self.error("the scale must be > 1")
            for pad, s, axis in ((p.pad_out_h, sh, "h"), (p.pad_out_w, sw, "w")):
                if pad and s != 2:
                    raise self.error(f"pad_out_{axis} needs scale_{axis} == 2")
            out = (x[2] * sh - int(p.pad_out_h), x[3] * sw - int(p.pad_out_w))
        self.out = out
        return [x[:2] + out]

    def _index(self, xp, mask):
        """Per input cell: its flat index in the whole top (-1 where the mask names no cell)."""
        N, C = mask.shape[:2]
        plane = self.out[0] * self.out[1]
        m = mask.reshape(N * C, -1).astype(np.int64)
        if m.size and int(m.max()) >= plane:
            raise self.error(f"mask index {int(m.max())} is outside the {self.out[0]}x{self.out[1]} top: "
                             "the scale must match the pooling layer that made the mask")
        flat = m + (xp.arange(N * C) * plane)[:, None]
        return xp.where(m >= 0, flat, -1).reshape(-1)

    def forward(self, bottom, top):
        x, y = bottom[0].data, top[0].data
        xp = array_module(x)
        idx = self._index(xp, bottom[1].data)
        y.fill(0)
        hit = idx >= 0
        y.reshape(-1)[idx[hit]] = x.reshape(-1)[hit]

    def backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        dy, dx = top[0].diff, bottom[0].diff
        xp = array_module(dy)
        idx = self._index(xp, bottom[1].data)
        hit = idx >= 0
        dx.reshape(-1)[...] = xp.where(hit, dy.reshape(-1)[xp.where(hit, idx, 0)], 0)


@register
class BN(Layer):
    """The forks' per-channel batch normalisation with its own scale and shift, y = slope (x -
    mean) / sqrt(var + eps) + bias, with the statistics taken over (num, height, width).

    caffe-segnet's (set by scale_filler, shift_filler or bn_mode): blobs [scale, shift]; LEARN
    always uses the batch's statistics (eps 1e-9; tops 1 and 2, when given, are the batch mean
    and variance), INFERENCE computes y = scale x + shift.
    PSPNet's (otherwise): blobs [slope, bias, mean, variance] (the last two never learned); TRAIN
    uses the batch's statistics and moves the stored ones by ``momentum`` (stored = momentum
    stored + (1 - momentum) batch), TEST or ``frozen`` uses the stored ones.

    Backward is the exact gradient. In the TEST phase PSPNet's (unless frozen) applies the batch
    statistics' formula to the stored statistics, which its forward treats as constants."""
    type = "BN"
    exact_bottoms = 1
    min_tops, max_tops = 1, 3
    backward_needs = ()
    SEGNET = ("scale_filler", "shift_filler", "bn_mode")
    PSPNET = ("slope_filler", "bias_filler", "momentum", "eps", "frozen", "engine")

    def setup(self, bottom_shapes):
        p = self.param.bn_param
        shape = tuple(bottom_shapes[0])
        if len(shape) < 2:
            raise self.error(f"input must have a channel axis, got {shape}")
        segnet, pspnet = ([f for f in fields if p.HasField(f)] for fields in (self.SEGNET, self.PSPNET))
        if segnet and pspnet:
            raise self.error(f"bn_param mixes caffe-segnet's {', '.join(segnet)} with PSPNet's {', '.join(pspnet)}")
        self.segnet = bool(segnet)
        C = shape[1]
        self.view = (shape[0], C, int(np.prod(shape[2:], dtype=np.int64)))
        stat = (1, C, 1, 1)
        if self.segnet:
            self.eps = 1e-9
            self.batch_stats = p.bn_mode == p.LEARN
            self.learning = True
            self.param_shapes = [stat, stat]
        else:
            if len(self.param.top) > 1:
                raise self.error("PSPNet's BN has one top")
            self.eps = float(p.eps)
            self.batch_stats = self.phase != TEST and not p.frozen
            self.learning = self.batch_stats
            self.param_shapes = [stat] * 4
            self._freeze(p.frozen)
        self.scratch_specs = {"inv_std": ((C,), None)}
        if self.learning:           # what the parameter gradients and the batch statistics' backward read
            self.scratch_specs["x_norm"] = (shape, None)
        return [shape] + [stat] * (len(self.param.top) - 1)

    def _freeze(self, frozen):
        """As the fork's LayerSetUp: the stored statistics (and, frozen, slope and bias) never learn."""
        while len(self.param.param) < 4:
            self.param.param.add()
        for i in (0, 1, 2, 3) if frozen else (2, 3):
            self.param.param[i].lr_mult = self.param.param[i].decay_mult = 0

    def init_params(self, rng):
        p = self.param.bn_param
        fillers = (p.scale_filler, p.shift_filler) if self.segnet else (p.slope_filler, p.bias_filler)
        for blob, f in zip(self.blobs, fillers):
            fill(f, blob.data, rng)
        if not self.segnet:
            self.blobs[2].data[...] = 0
            self.blobs[3].data[...] = 1 if p.frozen else 0

    def _channel(self, a):
        return a.reshape(1, -1, 1)

    def forward(self, bottom, top, update=True):
        x, y = bottom[0].data.reshape(self.view), top[0].data.reshape(self.view)
        xp = array_module(x)
        slope, bias = (self._channel(b.data) for b in self.blobs[:2])
        inv = self.scratch["inv_std"]
        if self.segnet and not self.batch_stats:                # INFERENCE
            if self.learning:
                self.scratch["x_norm"].reshape(self.view)[...] = x
            xp.multiply(x, slope, out=y)
            y += bias
            return
        if self.batch_stats:
            mean = x.mean(axis=(0, 2))
            if self.segnet:                                     # E[x^2] - E[x]^2, as the fork
                var = (x * x).mean(axis=(0, 2)) - mean * mean
            else:
                var = ((x - mean[None, :, None]) ** 2).mean(axis=(0, 2))
            if len(top) > 1:
                top[1].data.reshape(-1)[...] = mean
            if len(top) > 2:
                top[2].data.reshape(-1)[...] = var
            if not self.segnet and update:
                m = self.param.bn_param.momentum
                for blob, v in ((self.blobs[2], mean), (self.blobs[3], var)):
                    blob.data.reshape(-1)[...] = m * blob.data.reshape(-1) + (1 - m) * v
        else:
            mean, var = self.blobs[2].data.reshape(-1), self.blobs[3].data.reshape(-1)
        inv[...] = 1 / xp.sqrt(var + self.eps)
        xp.subtract(x, mean[None, :, None], out=y)
        y *= inv[None, :, None]
        if self.learning:
            self.scratch["x_norm"].reshape(self.view)[...] = y
        y *= slope
        y += bias

    def recompute(self, bottom, top):
        """Forward again without moving the stored statistics a second time."""
        self.forward(bottom, top, update=False)

    def backward(self, top, propagate_down, bottom):
        dy = top[0].diff.reshape(self.view)
        xp = array_module(dy)
        slope = self._channel(self.blobs[0].data)
        if self.learning:
            x_norm = self.scratch["x_norm"].reshape(self.view)
            self.blobs[0].diff.reshape(-1)[...] += (dy * x_norm).sum(axis=(0, 2))
            self.blobs[1].diff.reshape(-1)[...] += dy.sum(axis=(0, 2))
        if not propagate_down[0]:
            return
        dx = bottom[0].diff.reshape(self.view)
        if self.segnet and not self.batch_stats:
            xp.multiply(dy, slope, out=dx)
            return
        g = dy * slope * self.scratch["inv_std"][None, :, None]
        if not self.batch_stats:                                # the stored statistics: linear
            dx[...] = g
            return
        # through the batch statistics: g - mean(g) - x_norm mean(g x_norm)
        dx[...] = g - g.mean(axis=(0, 2), keepdims=True) - x_norm * (g * x_norm).mean(axis=(0, 2), keepdims=True)


def interp_matrix(n_in, n_out, dtype):
    """(n_out, n_in) weights of the fork's caffe_cpu_interp2 along one axis: corners aligned,
    the ratio and the positions in float32 as the fork computes them."""
    a = np.zeros((n_out, n_in), np.float64)
    if n_in == n_out:
        np.fill_diagonal(a, 1)
        return a.astype(dtype)
    r = np.float32(n_in - 1) / np.float32(n_out - 1) if n_out > 1 else np.float32(0)
    pos = np.float32(r) * np.arange(n_out, dtype=np.float32)
    lo = pos.astype(np.int64)
    step = (lo < n_in - 1).astype(np.int64)
    lam = (pos - lo).astype(dtype)
    rows = np.arange(n_out)
    np.add.at(a, (rows, lo), 1 - lam)
    np.add.at(a, (rows, lo + step), lam)
    return a.astype(dtype)


@register
class Interp(Layer):
    """PSPNet's (DeepLab's) bilinear resize with corners aligned. The input, cropped by -pad_beg
    and -pad_end cells (paddings are <= 0), goes to height x width, or to its size shrunk
    ((n - 1) / shrink_factor + 1) and/or zoomed (n + (n - 1)(zoom_factor - 1))."""
    type = "Interp"
    exact_bottoms = exact_tops = 1
    backward_needs = ()

    def setup(self, bottom_shapes):
        p = self.param.interp_param
        shape = tuple(bottom_shapes[0])
        if len(shape) != 4:
            raise self.error(f"input must have 4 axes (num, channels, height, width), got {shape}")
        if p.pad_beg > 0 or p.pad_end > 0:
            raise self.error("only non-positive pad_beg and pad_end (cropping) are supported, as in the fork")
        N, C, H, W = shape
        he, we = H + p.pad_beg + p.pad_end, W + p.pad_beg + p.pad_end
        if he <= 0 or we <= 0:
            raise self.error(f"the cropped input {he}x{we} is empty")
        has = p.HasField
        shrink, zoom = has("shrink_factor"), has("zoom_factor")
        if shrink and p.shrink_factor < 1 or zoom and p.zoom_factor < 1:
            raise self.error("shrink_factor and zoom_factor must be >= 1")
        if shrink or zoom:
            ho, wo = he, we
            if shrink:
                ho, wo = (ho - 1) // p.shrink_factor + 1, (wo - 1) // p.shrink_factor + 1
            if zoom:
                ho, wo = ho + (ho - 1) * (p.zoom_factor - 1), wo + (wo - 1) * (p.zoom_factor - 1)
        elif has("height") and has("width"):
            ho, wo = p.height, p.width
        else:
            raise self.error("give height and width, zoom_factor, shrink_factor, or both factors")
        if ho <= 0 or wo <= 0:
            raise self.error(f"the output {ho}x{wo} is empty")
        self.crop = (slice(-p.pad_beg, -p.pad_beg + he), slice(-p.pad_beg, -p.pad_beg + we))
        self.a_h = interp_matrix(he, ho, self.dtype)
        self.a_w = interp_matrix(we, wo, self.dtype)
        return [(N, C, ho, wo)]

    def _mats(self, xp, dtype):
        return xp.asarray(self.a_h, dtype=dtype), xp.asarray(self.a_w, dtype=dtype)

    def forward(self, bottom, top):
        x = bottom[0].data[(Ellipsis,) + self.crop]
        xp = array_module(x)
        a_h, a_w = self._mats(xp, x.dtype)
        top[0].data[...] = xp.matmul(a_h, xp.matmul(x, a_w.T))

    def backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        dy, dx = top[0].diff, bottom[0].diff
        xp = array_module(dy)
        a_h, a_w = self._mats(xp, dy.dtype)
        dx.fill(0)
        dx[(Ellipsis,) + self.crop] = xp.matmul(a_h.T, xp.matmul(dy, a_w))
