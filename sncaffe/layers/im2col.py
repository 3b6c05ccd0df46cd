"""Convolution kernels for NCHW on NumPy: GEMMs on a packed image, without im2col's gather.

The image side of a convolution (Caffe's bottom; a Deconvolution's top) is
packed once into a workspace ``xq``: zero-padded, split into stride phases
(phase (a, b) holds padded pixels (s*h + a, s*w + b)), each phase flattened
to one row per channel. Kernel tap (i, j) then reads, for all output
positions of a chunk at once, one contiguous slice of one phase at a fixed
offset, so a convolution is a sum of per-tap GEMMs ``W[:, :, i, j] @ slice``
accumulated in place, with no copy. Outputs are computed on the packed grid
(Hq x Wq per image) and its few garbage columns are dropped on unpacking;
neighbouring rows and images share their zero padding where that is exact.

- Layout (``batched``): per image (one GEMM per image and tap; a 1x1 stride-1
  convolution then reads bottom and writes top where they lie), or the
  whole chunk as one long image (one GEMM per tap; large GEMMs for small
  images).
- Column mode (``col``), where per-tap GEMMs lose (few input channels, few
  channels under many taps, wide layers on grids with much garbage): the taps'
  slices of whole images are copied into a column matrix, one GEMM with
  K = C*kh*kw. The weight gradient may use it under a per-tap forward
  (``col_filter``). The rules were drawn from tools/bench_conv_layouts.py.
- Backward-data of a stride-1 convolution is the convolution of the top
  diff with the flipped kernel (``flip``): no scatter-add. Otherwise the
  per-tap GEMMs accumulate into the packed image and it is unpacked.
- The weight gradient reads the packed image transposed (positions x
  channels), which OpenBLAS and MKL both run faster.
- Where the geometry allows (``lead``), the backward packs the top diff once:
  the weight gradient's grid of it is the flipped convolution's packed image.
- Reduction blocks (``reduce_block`` images, from the geometry alone): every GEMM
  covers one block of images or a part of one counted from the block's start,
  and the weight gradient is summed per block and added to ``dw`` block by
  block. A chunk of images that starts at a multiple of ``reduce_block`` then
  runs exactly the GEMMs the whole batch runs on its images, so any such
  chunking gives the whole batch's bits (a GEMM's columns depend on its N:
  OpenBLAS's edge kernels, MKL's small-N path). In the batched layouts a block
  is one contiguous range of packed columns.

GEMMs accumulate through BLAS's beta (``backend.blas.gemm``: MKL where the
``mkl`` extra is installed, else NumPy's own OpenBLAS, through ctypes; other
arrays fall back to matmul).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..backend import workers
from ..backend.blas import gemm
from .base import array_module

# How large a reduction block (ConvPlan.reduce_block) is made: per-tap GEMMs (K = the input
# channels) run at their best from about 4096 packed columns, faster than one GEMM over a whole
# chunk, which leaves the cache; a column matrix's GEMM (K = channels x taps) runs as fast from
# a matrix of about 1 MiB, which also bounds its workspace, and fewer images than that pay for
# the per-tap copies per block (tools/bench_conv.py).
BLOCK_COLUMNS = 4096
COL_BLOCK_BYTES = 1 << 20

# -- geometry -----------------------------------------------------------------


@dataclass
class Dim:
    """One spatial axis: sizes, stride phases and the packed pitch."""
    size: int       # image side (conv input)
    kernel: int
    stride: int
    pad: int
    dilation: int

    def __post_init__(self):
        k, s, p, d = self.kernel, self.stride, self.pad, self.dilation
        self.out = (self.size + 2 * p - d * (k - 1) - 1) // s + 1
        offs = [i * d for i in range(k)]
        self.phases = sorted({o % s for o in offs})
        self.tap_phase = [self.phases.index(o % s) for o in offs]
        self.tap_shift = [o // s for o in offs]
        # data of phase a sits at packed positions [lo, hi): padded pixel q*s + a in [p, p + size)
        # (packed positions q >= need are never read)
        need = self.out + max(self.tap_shift)
        lo = [max(0, -(-(p - a) // s)) for a in self.phases]
        hi = [min(need, max(0, -(-(p + self.size - a) // s))) for a in self.phases]
        # smallest pitch >= out whose wrapped positions (pitch <= q < need) are zero
        # both as this row's trailing pad and as the next row's leading pad
        self.pitch = next(q for q in range(self.out, need + 1)
                          if all(h <= q and need - q <= l for l, h in zip(lo, hi)))
        self.lo = [min(l, h) for l, h in zip(lo, hi)]
        self.hi = hi

    def spans(self, ia):
        """(packed slice, image slice) of phase ``ia``'s data, or None when it has none."""
        lo, hi, s = self.lo[ia], self.hi[ia], self.stride
        if hi <= lo:
            return None
        start = lo * s + self.phases[ia] - self.pad
        return slice(lo, hi), slice(start, start + (hi - lo - 1) * s + 1, s)

    def covers_image(self):
        """Whether every image position is packed (else backward-data leaves zeros)."""
        return sum(max(0, h - lo) for lo, h in zip(self.lo, self.hi)) == self.size


class ConvPlan:
    """How one 2-D convolution runs: geometry, layout, GEMM form and workspace sizes.

    Caffe's conv view: image x (n, C, H, W) -> grid side y (n, M, Ho, Wo), weight
    w (M, C/group, kh, kw). ``forward`` computes y, ``backward`` the gradients of
    x and w. Options (None: chosen by size): ``batched`` packs the whole chunk
    as one image for big GEMMs (else per image); ``col`` uses a column matrix
    of whole images (at most ``col_bytes``) instead of per-tap GEMMs;
    ``col_filter`` does so for the weight gradient alone; ``flip`` computes a
    stride-1 backward-data as the convolution of the top diff with the
    flipped kernel (no scatter-add); ``reduce_block`` overrides the images
    per reduction block.
    """

    def __init__(self, channels, num_output, group, size, kernel, stride, pad, dilation,
                 batched=None, col=None, col_bytes=None, flip=None, col_filter=None, reduce_block=None):
        options = dict(batched=batched, col=col, col_bytes=col_bytes, col_filter=col_filter)
        self.C, self.M, self.group = channels, num_output, group
        self.Cg, self.Mg = channels // group, num_output // group
        self.kernel = tuple(kernel)
        self.h, self.w = (Dim(*a) for a in zip(size, kernel, stride, pad, dilation))
        self.taps = [(self.h.tap_phase[i] * len(self.w.phases) + self.w.tap_phase[j],
                      self.h.tap_shift[i] * self.w.pitch + self.w.tap_shift[j])
                     for i in range(kernel[0]) for j in range(kernel[1])]   # (phase, offset)
        T = len(self.taps)
        self.P = len(self.h.phases) * len(self.w.phases)
        self.grid = self.h.pitch * self.w.pitch          # packed positions per image
        self.slack = max(off for _, off in self.taps)    # zeros after the last image
        self.out_shape = (self.h.out, self.w.out)
        self.out_size = self.h.out * self.w.out
        # one tap reads each packed position once: backward-data overwrites, needs no zeroing
        self.single = T == 1 and self.P == 1 and self.slack == 0
        # ... and the image is its own packed form (1x1, stride 1, no pad)
        self.identity = self.single and pad == (0, 0) and self.grid == size[0] * size[1]
        # A column matrix where per-tap GEMMs lose (measured with OpenBLAS on one core,
        # docs/benchmarks.md "Choosing a convolution's kernels"): very few input channels
        # (ResNet's and AlexNet's conv1), few channels under many taps (each tap re-reads
        # and re-writes the whole output: LeNet's 5x5s), or many outputs on a grid with
        # much garbage (ResNet-50's res5 at 7x7). Per image only where y is its own grid.
        if col is None:
            col = (self.Cg < 8 or (T >= 16 and self.Cg < 32)
                   or (self.Mg >= 256 and 4 * self.grid >= 5 * self.out_size))
        self.col = T > 1 and col
        if batched is None:
            batched = self.grid != self.out_size or self.grid < 256
        self.batched = self.col or batched
        # The weight gradient is one long-K GEMM: a column matrix wins there more often
        # (5x5 and larger kernels, or wide layers), whatever the forward uses.
        if col_filter is None:
            col_filter = T >= 16 or self.Cg >= 256
        self.col_filter = T > 1 and self.batched and (self.col or col_filter)
        self.col_images = max(1, (col_bytes or 8 << 20) // (4 * self.Cg * T * self.out_size))
        # images per reduction block: one for per-image GEMMs, else enough for the GEMMs' columns
        # (or a column matrix of COL_BLOCK_BYTES: float32 sizes, whatever the dtype)
        blocks = (-(-COL_BLOCK_BYTES // (4 * self.Cg * T * self.out_size)) if self.col
                  else -(-BLOCK_COLUMNS // self.grid))
        self.reduce_block = reduce_block or (blocks if self.batched else 1)
        self.flip = None
        if T > 1 and stride == (1, 1) and flip is not False and all(
                p <= d * (k - 1) for p, d, k in zip(pad, dilation, kernel)):
            flipped = ConvPlan(num_output, channels, group, self.out_shape, kernel, (1, 1),
                               tuple(d * (k - 1) - p for p, d, k in zip(pad, dilation, kernel)),
                               dilation, flip=False, **options)
            # by default only where both sides run per-tap GEMMs of at least 16 channels on
            # grids of about the same size: a flipped kernel of few outputs, a column matrix,
            # or a top much smaller than the bottom (a "valid" convolution) make it slower
            # than the scatter-add
            if flip or (flip is None and not self.col and not flipped.col and min(self.Cg, self.Mg) >= 16
                        and 10 * flipped.out_size <= 11 * self.out_size):
                self.flip = flipped
                flipped.reduce_block = self.reduce_block     # chunks are multiples of ours
        # Where the weight gradient's grid of dy, shifted by ``lead`` positions, is the flipped
        # convolution's packed dy (same pitch, dy at rows lo_h.. and columns lo_w.., zeros
        # elsewhere), the backward packs dy once: that grid is written into the flipped plan's
        # image rows, and the flipped plan's output grid takes the (then spent) "xq" buffer.
        self.lead = None
        f = self.flip
        if (f is not None and self.batched and not self.col_filter and f.batched and not f.col and f.P == 1
                and not f.direct_image() and (f.h.pitch, f.w.pitch) == (self.h.pitch, self.w.pitch)
                and f.h.covers_image() and f.w.covers_image()):
            (lo_h,), (lo_w,) = f.h.lo, f.w.lo
            Ho, Wo = self.out_shape
            lead = lo_h * self.w.pitch + lo_w
            if lo_h + Ho <= self.h.pitch and lo_w + Wo <= self.w.pitch and lead <= f.slack:
                self.lead = lead

    # -- the passes ----------------------------------------------------------------
    def forward(self, x, w, y, ws, bias=None, xq=None):
        """y = conv(x, w) (+ bias per output channel); ``xq``: x already packed, if it is."""
        g = self._grid(y, ws, fill=False)
        self._gemm_forward(self._image(x, ws) if xq is None else xq, w, g, ws)
        self._unpack_grid(g, y, bias)

    def backward(self, x, dy, w, ws, dx=None, dw=None):
        """dw += the weight gradient (if dw is given; reads x), dx = the input gradient (if given)."""
        g = rows = None
        if dw is not None:
            if self.lead is None:
                g = self._grid(dy, ws, col=self.col_filter)
            else:
                g, rows = self._flip_image_grid(dy, ws)
            self._gemm_filter(self._image(x, ws, transposed=not self.col_filter), g, dw, ws)
        if dx is None:
            return
        if self.flip:     # dy packed already (rows) where the weight gradient's grid is its image
            self.flip.forward(dy, self._flipped(w, ws), dx, self._flip_ws(ws), xq=rows)
            return
        g = self._grid(dy, ws) if g is None or self.col_filter != self.col else g
        xq = self._zeroed_image(dx, ws)
        self._gemm_data(g, w, xq, ws)
        self._unpack_image(xq, dx)

    # -- sizes ---------------------------------------------------------------------
    def blocks(self, n):
        """(first image, images) of the reduction blocks of a chunk of n images."""
        rb = self.reduce_block
        return [(i, min(rb, n - i)) for i in range(0, n, rb)]

    def _gemm_blocks(self, g, per_image):
        """(row, column slice) of grid g (B, M, G) per GEMM: each image of a per-image layout,
        else each reduction block (``per_image`` columns an image)."""
        if g.shape[0] > 1 or not self.batched:
            return [(b, slice(0, g.shape[2])) for b in range(g.shape[0])]
        return [(0, slice(i * per_image, (i + k) * per_image)) for i, k in self.blocks(g.shape[2] // per_image)]

    def _rows(self, n, col=None):
        """(GEMM batch B, packed row length L, GEMM width G) for a chunk of n images
        (``col``: the column-matrix form, default the forward's)."""
        if self.col if col is None else col:
            return 1, n * self.grid + self.slack, n * self.out_size
        if self.batched:
            return 1, n * self.grid + self.slack, n * self.grid
        return n, self.grid + self.slack, self.grid

    def direct_image(self):
        """The image (and its diff) is used in place, unpacked."""
        return self.identity and not self.batched

    def direct_grid(self):
        """The grid side (y, or its diff) is used in place: no garbage, per image."""
        return not self.batched and self.grid == self.out_size

    def workspace(self, n):
        """{name: element count} for a chunk of n images (forward and backward alike)."""
        B, L, G = self._rows(n)
        T = len(self.taps)
        ws = {}
        if not self.direct_image():
            ws["xq"] = B * self.P * self.C * L
        if not self.direct_grid():
            ws["grid"] = B * self.M * G
        if self.col or self.col_filter:
            ws["col"] = self.Cg * T * min(n, self.col_images, self.reduce_block) * self.out_size
        if T > 1 and not (self.col and self.Mg >= 128):
            ws["wr"] = T * self.M * self.Cg
        if self.flip:     # used after the weight gradient: the same buffers serve both
            for k, v in self.flip.workspace(n).items():
                k = self._flip_name(k)
                ws[k] = max(ws.get(k, 0), v)
            ws["wflip"] = self.C * self.Mg * T
        return ws

    def _flip_name(self, name):
        """The workspace buffer the flipped plan's ``name`` lives in (its packed dy is our grid)."""
        return {"xq": "grid", "grid": "xq"}.get(name, name) if self.lead is not None else name

    def _flip_ws(self, ws):
        """The workspace as the flipped plan names it."""
        return ws if self.lead is None else {self._flip_name(k): v for k, v in ws.items()}

    def _flip_image_grid(self, dy, ws):
        """(grid, rows): the grid (1, M, G) of dy for the weight gradient, as a view into the
        flipped plan's packed rows (1, 1, M, L), which it completes: zeros before and after
        (``lead``)."""
        n = dy.shape[0]
        rows = self._buf(ws, "grid", (1, 1, self.M, self.flip._rows(n)[1]))
        rows[..., :self.lead] = 0
        rows[..., self.lead + n * self.grid:] = 0
        g = rows[0, :, :, self.lead:self.lead + n * self.grid]
        self._fill_grid(*self._grid_view(g, n), dy)
        return g, rows

    @staticmethod
    def _buf(ws, name, shape):
        return ws[name][:int(np.prod(shape))].reshape(shape)

    # -- packing -------------------------------------------------------------------
    # Packing copies each (image, channel) plane on its own, so the planes are split over
    # threads (backend/workers): images where the chunk has several, else channels.
    @staticmethod
    def _pieces(a, work, fn):
        """``fn(images, channels)`` over pieces of the (n, C) planes of NumPy array ``a``."""
        if type(a) is not np.ndarray:
            fn(slice(None), slice(None))
        elif a.shape[0] > 1:
            workers.split(a.shape[0], work, lambda ns: fn(ns, slice(None)))
        else:
            workers.split(a.shape[1], work, lambda cs: fn(slice(None), cs))

    def _fill_grid(self, valid, garbage, y):
        """The grid's valid view = y, its garbage views zero."""
        def fill(ns, cs):
            for v in garbage:
                v[ns, cs] = 0
            valid[ns, cs] = y[ns, cs]
        self._pieces(y, 2 * y.size, fill)

    def _phases(self, xq, n):
        """Per phase: its (n, C, Hq, Wq) view, its slack tail, and its data spans (or None).
        A packed image of 4 axes holds rows (B, P, C, L); of 5, transposed rows (B, P, L, C, 1)."""
        Hq, Wq, nw = self.h.pitch, self.w.pitch, len(self.w.phases)
        if xq.ndim == 5:
            xq = xq[..., 0].transpose(0, 1, 3, 2)
        for ph in range(self.P):
            if self.batched:
                rows = xq[0, ph]
                view = rows[:, :n * self.grid].reshape(self.C, n, Hq, Wq).transpose(1, 0, 2, 3)
                tail = rows[:, n * self.grid:]
            else:
                rows = xq[:, ph]
                view, tail = rows[:, :, :self.grid].reshape(n, self.C, Hq, Wq), rows[:, :, self.grid:]
            sh, sw = self.h.spans(ph // nw), self.w.spans(ph % nw)
            yield view, tail, (sh and sw and (sh, sw))

    def _xq(self, n, ws, transposed=False):
        B, L, _ = self._rows(n)
        if transposed:
            return self._buf(ws, "xq", (B, self.P, L, self.C, 1))
        return self._buf(ws, "xq", (B, self.P, self.C, L))

    def _image(self, x, ws, transposed=False):
        """The packed image xq (B, P, C, L) of x (n, C, H, W): x itself, or packed into ws;
        transposed (per-tap weight gradients read it faster): (B, P, L, C, 1)."""
        n = x.shape[0]
        if self.direct_image():
            return x.reshape(n, 1, self.C, -1)
        xq = self._xq(n, ws, transposed and not self.col and len(self.taps) > 1)
        phases = list(self._phases(xq, n))
        for _, tail, _ in phases:
            tail[...] = 0

        def pack(ns, cs):
            for view, _, spans in phases:
                view = view[ns, cs]
                if not spans:
                    view[...] = 0
                    continue
                (qh, ih), (qw, iw) = spans
                view[:, :, :qh.start] = 0
                view[:, :, qh.stop:] = 0
                view[:, :, qh, :qw.start] = 0
                view[:, :, qh, qw.stop:] = 0
                view[:, :, qh, qw] = x[ns, cs, ih, iw]
        self._pieces(x, x.size + xq.size, pack)
        return xq

    def _zeroed_image(self, x, ws):
        """Packed rows to accumulate the gradient of image x into (x itself when direct)."""
        n = x.shape[0]
        if self.direct_image():
            return x.reshape(n, 1, self.C, -1)
        xq = self._xq(n, ws)
        if not self.single:
            xq.fill(0)
        return xq

    def _unpack_image(self, xq, x):
        """x (n, C, H, W) = the image positions of packed rows xq (inverse of _image)."""
        if self.direct_image():
            return
        n, C, H, W = x.shape
        covered = self.h.covers_image() and self.w.covers_image()
        # positions no output reads (stride > kernel) get zero: fill and copy by cached blocks
        step = C if covered else max(1, (1 << 17) // (n * H * W))
        phases = [spans for _, _, spans in self._phases(xq, n)]
        views = [view for view, _, _ in self._phases(xq, n)]

        def unpack(ns, channels):
            c0, c1, _ = channels.indices(C)
            for cs in (slice(c, min(c + step, c1)) for c in range(c0, c1, step)):
                if not covered:
                    x[ns, cs].fill(0)
                for view, spans in zip(views, phases):
                    if spans:
                        (qh, ih), (qw, iw) = spans
                        x[ns, cs, ih, iw] = view[ns, cs, qh, qw]
        self._pieces(x, 2 * x.size, unpack)

    def _grid_view(self, g, n, col=None):
        """The (n, M, Ho, Wo) view of grid g's valid positions, and views of its garbage."""
        Ho, Wo = self.out_shape
        if self.col if col is None else col:
            return g[0].reshape(self.M, n, Ho, Wo).transpose(1, 0, 2, 3), ()
        Hq, Wq = self.h.pitch, self.w.pitch
        if self.batched:
            view = g[0].reshape(self.M, n, Hq, Wq).transpose(1, 0, 2, 3)
        else:
            view = g.reshape(n, self.M, Hq, Wq)
        return view[:, :, :Ho, :Wo], (view[:, :, :Ho, Wo:], view[:, :, Ho:])

    def _grid(self, y, ws, fill=True, col=None):
        """The grid (B, M, G) of y (n, M, Ho, Wo): y itself, or (fill) y copied in, zero garbage
        (``col``: in the column-matrix form, default the forward's)."""
        n = y.shape[0]
        B, _, G = self._rows(n, col)
        if self.direct_grid():
            return y.reshape(B, self.M, G)
        g = self._buf(ws, "grid", (B, self.M, G))
        if fill:
            self._fill_grid(*self._grid_view(g, n, col), y)
        return g

    def _unpack_grid(self, g, y, bias=None):
        """y (n, M, Ho, Wo) = the valid positions of grid g (+ bias per channel)."""
        valid = y if self.direct_grid() else self._grid_view(g, y.shape[0])[0]
        if valid is y and bias is None:
            return
        b = None if bias is None else bias.reshape(-1, 1, 1)

        def unpack(ns, cs):
            if b is None:
                y[ns, cs] = valid[ns, cs]
            else:
                array_module(y).add(valid[ns, cs], b[cs], out=y[ns, cs])
        self._pieces(y, 2 * y.size, unpack)

    # -- GEMMs ---------------------------------------------------------------------
    def _weights(self, w, ws):
        """(M, Cg*kh*kw) in col mode (w itself), else per-tap weights (taps, M, Cg) (a view for 1x1)."""
        T = len(self.taps)
        if self.col:
            return w.reshape(self.M, -1)
        if T == 1:
            return w.reshape(1, self.M, self.Cg)
        wr = self._buf(ws, "wr", (T, self.M, self.Cg))
        wr[...] = w.reshape(self.M, self.Cg, T).transpose(2, 0, 1)
        return wr

    def _flipped(self, w, ws):
        """The kernel of the transposed convolution: (C, M/group, kh, kw), spatially flipped."""
        G, (kh, kw) = self.group, self.kernel
        wf = self._buf(ws, "wflip", (self.C, self.Mg, kh, kw))
        wf.reshape(G, self.Cg, self.Mg, kh, kw)[...] = \
            w.reshape(G, self.Mg, self.Cg, kh, kw).transpose(0, 2, 1, 3, 4)[..., ::-1, ::-1]
        return wf

    def _groups(self):
        return [(slice(g * self.Cg, (g + 1) * self.Cg), slice(g * self.Mg, (g + 1) * self.Mg))
                for g in range(self.group)]

    def _col_blocks(self, xq, ws, cs, first, images):
        """Per part (at most ``col_images``) of the reduction block of ``images`` from image
        ``first``: (grid columns, column matrix (Cg, taps, ...) in the weights' (c, i, j) row
        order, and per tap the packed-image view its rows copy)."""
        Ho, Wo = self.out_shape
        Hq, Wq = self.h.pitch, self.w.pitch
        for n0 in range(first, first + images, self.col_images):
            nb = min(self.col_images, first + images - n0)
            col = self._buf(ws, "col", (self.Cg, len(self.taps), nb, Ho, Wo))
            views = [xq[0, ph, cs, n0 * self.grid + off:(n0 + nb) * self.grid + off]
                     .reshape(self.Cg, nb, Hq, Wq)[:, :, :Ho, :Wo] for ph, off in self.taps]
            yield slice(n0 * self.out_size, (n0 + nb) * self.out_size), col, views

    def _gemm_forward(self, xq, w, g, ws):
        """Grid g (B, M, G) = conv of packed image xq (B, P, C, L) with weights w."""
        wt = self._weights(w, ws)
        for cs, ms in self._groups():
            if self.col:
                for first, images in self.blocks(g.shape[2] // self.out_size):
                    for cols, col, views in self._col_blocks(xq, ws, cs, first, images):
                        for t, v in enumerate(views):
                            col[:, t] = v
                        gemm(wt[ms], col.reshape(-1, cols.stop - cols.start), g[0, ms, cols])
                continue
            for b, cols in self._gemm_blocks(g, self.grid):
                for t, (ph, off) in enumerate(self.taps):
                    gemm(wt[t, ms], xq[b, ph, cs, off + cols.start:off + cols.stop], g[b, ms, cols], float(t > 0))

    def _gemm_data(self, g, w, xq, ws):
        """Packed rows xq (from _zeroed_image) += conv^T of grid g with weights w (scatter-add)."""
        wt = self._weights(w, ws)
        beta = 0.0 if self.single else 1.0
        for cs, ms in self._groups():
            if self.col:
                for first, images in self.blocks(g.shape[2] // self.out_size):
                    for cols, col, views in self._col_blocks(xq, ws, cs, first, images):
                        gemm(wt[ms].T, g[0, ms, cols], col.reshape(-1, cols.stop - cols.start))
                        for t, v in enumerate(views):
                            v += col[:, t]
                continue
            for b, cols in self._gemm_blocks(g, self.grid):
                for t, (ph, off) in enumerate(self.taps):
                    gemm(wt[t, ms].T, g[b, ms, cols], xq[b, ph, cs, off + cols.start:off + cols.stop], beta)

    def _gemm_filter(self, xq, g, dw, ws):
        """dw (M, Cg, kh, kw) += the weight gradient from packed image xq and grid diff g, one
        reduction block at a time (each summed in workspace "wr" first where a transposed or
        per-tap order runs faster, then added to dw)."""
        T = len(self.taps)
        if self.col_filter:
            # OpenBLAS writes a thin gradient faster as (Cg*T, Mg): sum it so, then add transposed
            acc = self._buf(ws, "wr", (self.group, self.Cg * T, self.Mg)) if self.Mg < 128 else None
            for first, images in self.blocks(g.shape[2] // self.out_size):
                for k, (cs, ms) in enumerate(self._groups()):
                    for cols, col, views in self._col_blocks(xq, ws, cs, first, images):
                        for t, v in enumerate(views):
                            col[:, t] = v
                        col = col.reshape(-1, cols.stop - cols.start)
                        if acc is None:
                            gemm(g[0, ms, cols], col.T, dw[ms].reshape(self.Mg, -1), 1.0)
                        else:
                            gemm(col, g[0, ms, cols].T, acc[k], float(cols.start > first * self.out_size))
                if acc is not None:
                    dw += acc.transpose(0, 2, 1).reshape(dw.shape)
            return
        dwt = dw.reshape(1, self.M, self.Cg) if T == 1 else self._buf(ws, "wr", (T, self.M, self.Cg))
        for b, cols in self._gemm_blocks(g, self.grid):     # per image: reduce_block is 1
            for cs, ms in self._groups():
                for t, (ph, off) in enumerate(self.taps):
                    span = slice(off + cols.start, off + cols.stop)
                    rows = xq[b, ph, span, cs, 0] if xq.ndim == 5 else xq[b, ph, cs, span].T
                    gemm(g[b, ms, cols], rows, dwt[t, ms], float(T == 1))
            if T > 1:
                dw += dwt.transpose(1, 2, 0).reshape(dw.shape)
