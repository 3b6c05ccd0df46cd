"""Normalization layers: LRN (local response normalization) and BatchNorm."""
from __future__ import annotations

import itertools

import numpy as np

from ..backend import fused, is_gpu, onednn, workers
from . import normalization_gpu
from .base import TEST, Layer, array_module, count, register
from .pooling import padded_view

ACROSS_CHANNELS = 0     # LRNParameter.NormRegion


def window_sum(padded, out, size, axes):
    """out = sum of ``padded`` over a window of ``size`` cells along each of
    ``axes`` (``padded`` is out's shape plus size-1 cells on those axes)."""
    for t, offsets in enumerate(itertools.product(range(size), repeat=len(axes))):
        win = [slice(None)] * out.ndim
        for a, o in zip(axes, offsets):
            win[a] = slice(o, o + out.shape[a])
        if t == 0:
            out[...] = padded[tuple(win)]
        else:
            out += padded[tuple(win)]


@register
class LRN(Layer):
    """Caffe's LRN: y = x * scale^-beta, scale = k + alpha/n * (sum of x^2 over
    a zero-padded window of n cells centred on x).

    ACROSS_CHANNELS: the window is local_size channels, n = local_size.
    WITHIN_CHANNEL: a local_size x local_size square in one channel, k = 1 and
    n = local_size^2 whatever lrn_param.k says, as Caffe builds it from Power,
    AVE pooling (whose divisor counts the padding) and Eltwise PROD.
    ``scale`` is kept in scratch for backward. Not in place: backward reads x and y.
    """
    type = "LRN"
    exact_bottoms = exact_tops = 1
    backward_needs = ("bottom", "top")

    def setup(self, bottom_shapes):
        lp = self.param.lrn_param
        shape = tuple(bottom_shapes[0])
        if len(shape) != 4:
            raise self.error(f"input must have 4 axes (num, channels, height, width), got {shape}")
        if lp.local_size % 2 == 0:
            raise self.error(f"local_size must be odd, got {lp.local_size}")
        if self.param.top[0] == self.param.bottom[0]:
            raise self.error("LRN cannot run in place")
        self.size, self.beta = lp.local_size, lp.beta
        if lp.norm_region == ACROSS_CHANNELS:
            self.axes, self.k, n = (1,), lp.k, self.size
        else:
            self.axes, self.k, n = (2, 3), 1.0, self.size ** 2
        self.alpha_over_n = lp.alpha / n
        pre = (self.size - 1) // 2
        self.offsets = tuple(pre if a in self.axes else 0 for a in range(4))
        padded = tuple(d + 2 * pre if a in self.axes else d for a, d in enumerate(shape))
        self.scratch_specs = {"scale": (shape, None)}
        # The GPU's ACROSS_CHANNELS kernels sum their windows in place: no workspace.
        if not (self.axes == (1,) and is_gpu(self.target)):
            self.workspace_specs = {"padded": (padded, None)}
        return [shape]

    def forward(self, bottom, top):
        x, y, scale = bottom[0].data, top[0].data, self.scratch["scale"]
        xp = array_module(x)
        if xp is not np and self.axes == (1,):
            return normalization_gpu.lrn_forward(self, x, y, scale)
        if xp is not np:
            return self._forward(x, y, scale, self.workspace["padded"])
        ws, work = self.workspace["padded"], (4 + self.size ** len(self.axes)) * x.size
        workers.split(x.shape[0], work, lambda n: self._forward(x[n], y[n], scale[n], ws[n]))

    # Images are independent (the windows run over channels or within one): on NumPy the batch
    # is split over threads (backend/workers).
    def _forward(self, x, y, scale, ws):
        xp = array_module(x)
        xp.multiply(x, x, out=padded_view(ws, x.shape, self.offsets, 0))
        window_sum(ws, scale, self.size, self.axes)
        scale *= self.alpha_over_n
        scale += self.k
        xp.power(scale, -self.beta, out=y)
        y *= x

    def backward(self, top, propagate_down, bottom):
        # dx = dy * scale^-beta - 2 alpha beta / n * x * window_sum(dy * y / scale)
        if not propagate_down[0]:
            return
        x, y, dy, dx = bottom[0].data, top[0].data, top[0].diff, bottom[0].diff
        scale = self.scratch["scale"]
        xp = array_module(x)
        if xp is not np and self.axes == (1,):
            return normalization_gpu.lrn_backward(self, x, y, dy, dx, scale)
        if xp is not np:
            return self._backward(x, y, dy, dx, scale, self.workspace["padded"])
        ws, work = self.workspace["padded"], (7 + self.size ** len(self.axes)) * x.size
        workers.split(x.shape[0], work, lambda n: self._backward(x[n], y[n], dy[n], dx[n], scale[n], ws[n]))

    def _backward(self, x, y, dy, dx, scale, ws):
        xp = array_module(x)
        inner = padded_view(ws, x.shape, self.offsets, 0)
        xp.multiply(dy, y, out=inner)
        inner /= scale
        window_sum(ws, dx, self.size, self.axes)    # the window is symmetric: its own adjoint
        dx *= x
        dx *= -2 * self.alpha_over_n * self.beta
        xp.power(scale, -self.beta, out=inner)
        inner *= dy
        dx += inner


def sum_over_images(partials, out):
    """out = the rows of ``partials`` (per-image sums, a sequence of (N_i, C) arrays in image order)
    added one image after another. One location and the replicas of a data-parallel net reduce
    in this same order, so both get the same bits (cross-replica BatchNorm, parallel/sync_bn.py)."""
    first = True
    for part in partials:
        if len(part) and part.ndim == 2 and out.shape == part.shape[1:] and fused.usable(part, out):
            fused.kernels().image_sum(part, out, first)     # the same loop, compiled
            first = False
            continue
        for row in part:
            if first:
                out[...] = row
                first = False
            else:
                out += row
    return out


# Large float32 tensors run BatchNorm's element-wise steps on oneDNN's binary kernel
# (onednn.binary_for: one pass, all the budget's threads, each operation rounded as NumPy's own
# call rounds it, so the same bytes).
_GRAD = ((onednn.SUB, True), (onednn.DIV, False))       # ((dy - mean(dy)) - temp) / std
# after a fused Scale, one pass: dx = (((xs * -k) + dy) - mean(dy)) * (scale / std)
_FUSED_GRAD = ((onednn.ADD, True), (onednn.SUB, False), (onednn.MUL, False))


@register
class BatchNorm(Layer):
    """Caffe's BatchNorm: y = (x - mean) / sqrt(var + eps) per channel (axis 1).

    Stored blobs (Caffe's order, never learned): [0] mean sum (C,), [1]
    variance sum (C,), [2] scale factor (1,). use_global_stats defaults to
    (phase == TEST).

    - Without global stats the batch mean and biased variance (over N and
      the spatial axes) normalize, and ``forward(bottom, top, update_stats=True)``
      folds them into the running sums: factor = maf*factor + 1,
      mean_sum = maf*mean_sum + mean, var_sum = maf*var_sum + m/(m-1)*var
      (m = N*H*W). A recomputed forward (memory runtime) must pass
      ``update_stats=False`` so the statistics move once per iteration.
    - With global stats, mean = mean_sum/factor and var = var_sum/factor
      (0 when factor is 0, as in Caffe).

    On the CPU every reduction over the batch is per-image sums (``partials``)
    added image after image (``sum_over_images``), in three stages: ``sums``,
    ``center`` (after the sum: mean, x - mean, per-image squares) and
    ``normalize`` (after that sum). The replicas of a data-parallel net run
    the same stages and reduce their partials over all replicas in between
    (``sync``: parallel/sync_bn.py), so they compute one location's bits.

    Runs in place: backward reads only the top diff and scratch (``x_norm``,
    ``std``), never bottom or top data.

    Run as one with the Scale after it (graph.Fusion), a training forward leaves ``x_norm``
    centered, x - mean, not yet divided by std (``centered``): Scale computes
    ((x_norm / std) * scale) + bias in one pass, the bits of the two layers apart, where the
    division was a pass of its own. The fused backward reads it so (its sums are of dy * (x -
    mean), divided by std per channel); a pass that runs either layer apart divides it first
    (``normalized``).
    """
    type = "BatchNorm"
    exact_bottoms = exact_tops = 1
    learnable = False
    backward_needs = ()
    sync = None             # the cross-replica group reducing the batch sums (parallel/sync_bn.py)
    first_stage = False     # set by ``sync`` for one call: forward/backward run their first stage only
    centered = False        # x_norm holds x - mean, not yet divided by std (a fused forward)

    def setup(self, bottom_shapes):
        bp = self.param.batch_norm_param
        shape = tuple(bottom_shapes[0])
        if any(spec.lr_mult != 0 for spec in self.param.param):
            raise self.error("cannot configure batch normalization statistics as layer "
                             "parameters: every param lr_mult must be 0")
        self.use_global_stats = (bp.use_global_stats if bp.HasField("use_global_stats")
                                 else self.phase == TEST)
        self.maf, self.eps = bp.moving_average_fraction, bp.eps
        C = shape[1] if len(shape) > 1 else 1
        self.view = (shape[0], C, count(shape, 2))      # (num, channels, spatial)
        self.count = self.view[0] * self.view[2]        # values per channel in the batch (all replicas': sync)
        self.param_shapes = [(C,), (C,), (1,)]
        self.scratch_specs = {"std": ((C,), None)}
        if not self.use_global_stats:
            self.scratch_specs["x_norm"] = (shape, None)
            self.scratch_specs["mean"] = ((C,), None)    # kept, with std, so a replay is one pass
            if not is_gpu(self.target):           # the GPU kernels need no temp
                self.workspace_specs = {"temp": (shape, None)}
                # per-image sums: [0] of x (of dy in backward), [1] of (x - mean)^2 (of dy * x_norm)
                self.scratch_specs["partials"] = ((2, shape[0], C), None)
        return [shape]

    def init_params(self, rng):
        for blob in self.blobs:
            blob.data[...] = 0

    def recompute(self, bottom, top):
        """Forward again from the kept batch mean and std: one pass, the same bits, and the
        running statistics move once per iteration."""
        x, y = bottom[0].data.reshape(self.view), top[0].data.reshape(self.view)
        if self.use_global_stats or array_module(x) is not np:
            return self.forward(bottom, top, update_stats=False)
        mean, std, x_norm = self.scratch["mean"], self.scratch["std"], self.scratch["x_norm"].reshape(self.view)
        if self.centered:           # as the fused forward left it: Scale divides
            workers.split(self.view[1], 2 * x.size,
                          lambda cs: np.subtract(x[:, cs], mean[cs, None], out=x_norm[:, cs]))
            return

        def normalize(cs):
            np.subtract(x[:, cs], mean[cs, None], out=y[:, cs])
            y[:, cs] /= std[cs, None]
            x_norm[:, cs] = y[:, cs]
        workers.split(self.view[1], 3 * x.size, normalize)

    # Channels are independent: each stage runs a channel's whole share, its per-image sums
    # included, on one thread (backend/workers), so every sum keeps its order.
    def forward(self, bottom, top, *, update_stats=True):
        x, y = bottom[0].data.reshape(self.view), top[0].data.reshape(self.view)
        xp = array_module(x)
        if xp is not np:
            return normalization_gpu.batch_norm_forward(self, x, y, update_stats)
        std = self.scratch["std"]
        if not self.use_global_stats:
            partials = self.scratch["partials"]
            self.sums(bottom)
            if self.first_stage:        # the sums are reduced over the replicas before the next stage
                self.first_stage = False
                return
            self.center(bottom, sum_over_images([partials[0]], self.scratch["mean"]))
            self.normalize(top, sum_over_images([partials[1]], std), update_stats)
            return
        factor = self.blobs[2].data
        inv_factor = (factor != 0) / np.where(factor == 0, 1, factor)
        mean = self.blobs[0].data * inv_factor
        np.multiply(self.blobs[1].data, inv_factor, out=std)
        std += self.eps
        np.sqrt(std, out=std)

        def normalize(cs):
            np.subtract(x[:, cs], mean[cs, None], out=y[:, cs])
            y[:, cs] /= std[cs, None]
        workers.split(self.view[1], 2 * x.size, normalize)

    # -- the stages of a training forward on the CPU (see the class's doc); each is split over
    # channels on the worker threads, which keeps every (image, channel) sum in its own order.
    # The per-image sums are einsum's (its SIMD sum of one contiguous row, the same bits whatever
    # the number of images or the row's address: tests/layers/test_normalization.py), 3-5x faster
    # than np.add.reduce's pairwise sum of a row --------------------------------------------------
    def sums(self, bottom):
        """partials[0] = each image's sum of x per channel."""
        x, partials = bottom[0].data.reshape(self.view), self.scratch["partials"][0]
        if fused.usable(x, partials):       # compiled, the rows on the thread budget (backend/fused.py)
            return fused.kernels().row_sums(x, partials)
        workers.split(self.view[1], x.size, lambda cs: np.einsum("ncs->nc", x[:, cs], out=partials[:, cs]))

    def center(self, bottom, total):
        """mean = total / m; x_norm = x - mean; partials[1] = each image's sum of x_norm^2."""
        x, x_norm = bottom[0].data.reshape(self.view), self.scratch["x_norm"].reshape(self.view)
        mean, partials = self.scratch["mean"], self.scratch["partials"][1]
        np.divide(total, self.count, out=mean)
        if fused.usable(x, x_norm, mean, partials):     # x - mean and its squares' sums in one pass
            return fused.kernels().center_squares(x, mean, x_norm, partials)
        sub = onednn.binary_for(self.view, (x, x_norm, mean), onednn.SUB)

        def center(cs):
            if sub is None:
                np.subtract(x[:, cs], mean[cs, None], out=x_norm[:, cs])
            np.einsum("ncs,ncs->nc", x_norm[:, cs], x_norm[:, cs], out=partials[:, cs])
        if sub is not None:
            sub.run(x, mean, x_norm)
        workers.split(self.view[1], 3 * x.size, center)

    def normalize(self, top, total, update_stats=True):
        """var = total / m (biased); the running sums move; y = x_norm = x_norm / sqrt(var + eps),
        or, run as one with Scale, x_norm left centered (Scale divides)."""
        std = self.scratch["std"]
        np.divide(total, self.count, out=std)
        if update_stats:
            self._update_stats(self.scratch["mean"], std, self.count)
        std += self.eps
        np.sqrt(std, out=std)
        self.centered = self.fused("forward")
        if not self.centered:
            self._divide(top[0].data.reshape(self.view))

    def _divide(self, y=None):
        """x_norm /= std, in place, then copied to ``y`` (None: not)."""
        std, x_norm = self.scratch["std"], self.scratch["x_norm"].reshape(self.view)
        div = onednn.binary_for(self.view, (x_norm, std), onednn.DIV)
        if div is not None:
            div.run(x_norm, std, x_norm)
            if y is not None:
                np.copyto(y, x_norm)
            return

        def normalize(cs):
            x_norm[:, cs] /= std[cs, None]
            if y is not None:
                y[:, cs] = x_norm[:, cs]
        workers.split(self.view[1], 2 * x_norm.size, normalize)

    def normalized(self):
        """x_norm, divided by std now if a fused forward left it centered (a pass that runs
        Scale or this layer apart reads it so)."""
        if self.centered:
            self._divide()
            self.centered = False
        return self.scratch["x_norm"]

    def std_of_x_norm(self):
        """Per channel, what x_norm is still to be divided by: std while ``centered``, else None."""
        return self.scratch["std"] if self.centered else None

    def _update_stats(self, mean, var, m):
        mean_sum, var_sum, factor = (b.data for b in self.blobs)
        factor *= self.maf
        factor += 1
        mean_sum *= self.maf
        mean_sum += mean
        var_sum *= self.maf
        var_sum += var * (m / (m - 1) if m > 1 else 1)

    def backward(self, top, propagate_down, bottom):
        # dx = (dy - mean(dy) - mean(dy * x_norm) * x_norm) / std, means over N and spatial
        if not propagate_down[0]:
            return
        dy, dx = top[0].diff.reshape(self.view), bottom[0].diff.reshape(self.view)
        xp = array_module(dy)
        if xp is not np:
            return normalization_gpu.batch_norm_backward(self, dy, dx)
        std = self.scratch["std"]
        if self.use_global_stats:
            workers.split(self.view[1], 2 * dy.size, lambda cs: np.divide(dy[:, cs], std[cs, None], out=dx[:, cs]))
            return
        partials = self.scratch["partials"]
        self.grad_sums(top)
        if self.first_stage:            # the sums are reduced over the replicas before the next stage
            self.first_stage = False
            return
        C = self.view[1]
        totals = np.empty((2, C), partials.dtype)
        self.grad_input(top, bottom, sum_over_images([partials[0]], totals[0]),
                        sum_over_images([partials[1]], totals[1]))

    # -- the stages of a training backward on the CPU --------------------------------
    def grad_sums(self, top):
        """partials = each image's sums of dy and of dy * x_norm per channel."""
        dy, partials = top[0].diff.reshape(self.view), self.scratch["partials"]
        if self.fused("backward"):      # Scale took the sums of its own dy (grad_input scales them)
            return
        x_norm = self.normalized().reshape(self.view)
        if fused.usable(dy, x_norm, partials):         # both sums in one pass
            return fused.kernels().two_sums(dy, x_norm, partials[0], partials[1])

        def grad_sums(cs):
            np.einsum("ncs->nc", dy[:, cs], out=partials[0][:, cs])
            np.einsum("ncs,ncs->nc", x_norm[:, cs], dy[:, cs], out=partials[1][:, cs])
        workers.split(self.view[1], 2 * dy.size, grad_sums)

    def grad_input(self, top, bottom, sum_dy, sum_dy_xn):
        """dx from the batch sums of dy and dy * x_norm."""
        if self.fused("backward"):
            return self._fused_grad_input(top, bottom, sum_dy, sum_dy_xn)
        dy, dx = top[0].diff.reshape(self.view), bottom[0].diff.reshape(self.view)
        x_norm, temp = self.scratch["x_norm"].reshape(self.view), self.workspace["temp"].reshape(self.view)
        mean_dy_xn, mean_dy, std = sum_dy_xn / self.count, sum_dy / self.count, self.scratch["std"]
        mul = onednn.binary_for(self.view, (x_norm, temp, mean_dy_xn), onednn.MUL)
        chain = onednn.binary_for(self.view, (dy, dx, mean_dy, temp, std), onednn.SUB, _GRAD) if mul else None
        if chain is not None:       # temp = xn * mean(dy xn), then dx = ((dy - mean(dy)) - temp) / std
            mul.run(x_norm, mean_dy_xn, temp)
            chain.run(dy, mean_dy, dx, temp, std)
            return

        def grad(cs):
            xn, g, d, t = x_norm[:, cs], dy[:, cs], dx[:, cs], temp[:, cs]
            np.multiply(xn, mean_dy_xn[cs, None], out=t)
            np.subtract(g, mean_dy[cs, None], out=d)       # dx may be dy itself (in place)
            d -= t
            d /= std[cs, None]
        workers.split(self.view[1], 4 * dy.size, grad)

    def _fused_grad_input(self, top, bottom, sum_dy, sum_dy_xs):
        """After a fused Scale (graph.Fusion), whose dy this is and whose sums these are (of dy and
        of dy * xs, xs = x_norm as it is: centered or divided, ``std_of_x_norm``), one pass:
        dx = (dy * scale - scale * mean(dy) - xn * scale * mean(dy * xn)) / std
           = (((xs * -k) + dy) - mean(dy)) * (scale / std),  k = mean(dy * xs) / d^2, d the
        divisor xs still owes (std, or none)."""
        dy, dx = top[0].diff.reshape(self.view), bottom[0].diff.reshape(self.view)
        xs, std = self.scratch["x_norm"].reshape(self.view), self.scratch["std"]
        d = self.std_of_x_norm()
        k = sum_dy_xs / self.count
        if d is not None:
            k /= d
            k /= d
        neg_k, mean_dy = -k, sum_dy / self.count
        scale = self.fusion.scale.layer.blobs[0].data.reshape(-1)
        factor = scale / std
        chain = onednn.binary_for(self.view, (xs, dy, dx, neg_k), onednn.MUL, _FUSED_GRAD)
        if chain is not None:
            chain.run(xs, neg_k, dx, dy, mean_dy, factor)
        else:
            temp = self.workspace["temp"].reshape(self.view)

            def grad(cs):
                t, d_ = temp[:, cs], dx[:, cs]
                np.multiply(xs[:, cs], neg_k[cs, None], out=t)
                t += dy[:, cs]
                np.subtract(t, mean_dy[cs, None], out=d_)      # dx may be dy itself (in place): read first
                d_ *= factor[cs, None]
            workers.split(self.view[1], 4 * dy.size, grad)
        if not self.fusion.in_place:        # the top's diff as Caffe leaves it: Scale's dx, dy * scale
            mul = onednn.binary_for(self.view, (dy, scale), onednn.MUL)
            if mul is not None:
                mul.run(dy, scale, dy)
            else:
                workers.split(self.view[1], 2 * dy.size, lambda cs: np.multiply(dy[:, cs], scale[cs, None], out=dy[:, cs]))
