"""Grouped and depthwise convolution kernels on NumPy: every group at once, not a GEMM per group.

``ConvPlan`` runs a grouped convolution as one set of GEMMs per group; with one input channel
per group (MobileNet's and Xception's depthwise 3x3s, 32 to 1024 groups) those are 1 x 9
GEMMs, each call costing more than its work. ``GroupedPlan`` keeps ConvPlan's batched packed
image and grid, where a tap's slice of a channel is one contiguous range, and runs a block of
groups per NumPy call: the taps' slices of a block of groups and images are copied into a
column matrix (groups, Cg*taps, positions), and one stacked ``matmul`` contracts it with the
block's weights (groups, Mg, Cg*taps):

- forward: y = w @ col, into the grid;
- weight gradient: dw[..., tap] += dy @ rows(tap)^T, tap by tap (no column matrix);
- input gradient: at stride 1 the forward of the flipped kernel on dy; else col = w^T @ dy,
  scattered back into the packed image by tap.

Blocks hold about ``BLOCK_BYTES`` of columns so they stay in the core's cache between the
copy and the product; their images are parts of ConvPlan's reduction blocks (counted from a
reduction block's start, so a chunk of the batch runs the whole batch's products).
``make_plan`` chooses this plan or ConvPlan by the rule measured with tools/bench_depthwise.py
(docs/benchmarks.md "Depthwise and grouped convolution").
"""
from __future__ import annotations

import numpy as np

from .im2col import ConvPlan

BLOCK_BYTES = 1 << 21
# Measured (tools/bench_depthwise.py --grouped): the stacked form wins up to this many input
# channels per group; above it ConvPlan's per-group GEMMs are big enough.
MAX_GROUP_CHANNELS = 8


def make_plan(channels, num_output, group, size, kernel, stride, pad, dilation, **options):
    """The plan of a convolution: GroupedPlan for a grouped one with few channels per group and
    a kernel of more than one tap (or where ``options`` say ``grouped=True``), else ConvPlan
    (``options``: its layout choices, which force ConvPlan unless ``grouped`` is given)."""
    grouped = options.pop("grouped", None)
    block_bytes = options.pop("block_bytes", None)
    reduce_block = options.pop("reduce_block", None)
    taps = kernel[0] * kernel[1]
    if grouped is None:
        grouped = not options and group > 1 and channels // group <= MAX_GROUP_CHANNELS
    if grouped and taps > 1:
        plan = GroupedPlan(channels, num_output, group, size, kernel, stride, pad, dilation, block_bytes)
        if reduce_block:
            plan.reduce_block = reduce_block
            if plan.flip:
                plan.flip.reduce_block = reduce_block
        return plan
    return ConvPlan(channels, num_output, group, size, kernel, stride, pad, dilation,
                    reduce_block=reduce_block, **options)


class GroupedPlan(ConvPlan):
    """ConvPlan's batched packed image and grid (per-tap slices are contiguous row ranges), its
    GEMMs stacked over blocks of groups."""

    def __init__(self, channels, num_output, group, size, kernel, stride, pad, dilation, block_bytes=None,
                 flip=True):
        super().__init__(channels, num_output, group, size, kernel, stride, pad, dilation,
                         batched=True, col=False, col_filter=False, flip=False)
        assert len(self.taps) > 1, "GroupedPlan needs a kernel of more than one tap"
        self.block_bytes = block_bytes or BLOCK_BYTES
        # a stride-1 input gradient is the forward of the flipped kernel: no scatter-add
        if flip and tuple(stride) == (1, 1) and all(p <= d * (k - 1) for p, d, k in zip(pad, dilation, kernel)):
            self.flip = GroupedPlan(num_output, channels, group, self.out_shape, kernel, (1, 1),
                                    tuple(d * (k - 1) - p for p, d, k in zip(pad, dilation, kernel)),
                                    dilation, block_bytes, flip=False)
            self.flip.reduce_block = self.reduce_block      # chunks are multiples of ours

    def _block(self, n):
        """(images, groups) a block of a chunk of n images holds. Its images (a part of a
        reduction block) come from the geometry alone; how many groups a product stacks does
        not change any group's sums."""
        column = 4 * self.Cg * len(self.taps) * self.grid      # one group's column of one image
        nb = max(1, min(self.reduce_block, self.block_bytes // column))
        return nb, max(1, min(self.group, self.block_bytes // (column * min(n, nb))))

    def workspace(self, n):
        B, L, G = self._rows(n)
        nb, gb = self._block(n)
        ws = {"xq": self.P * self.C * L, "grid": self.M * G,
              "col": gb * self.Cg * len(self.taps) * min(n, nb) * self.grid}
        if self.flip:     # used after the weight gradient: the same buffers serve both
            for k, v in self.flip.workspace(n).items():
                ws[k] = max(ws.get(k, 0), v)
            ws["wflip"] = self.C * self.Mg * len(self.taps)
        return ws

    def _image(self, x, ws, transposed=False):
        return super()._image(x, ws)           # the weight gradient reads it as the forward does

    # -- blocks ----------------------------------------------------------------------
    def _blocks(self, xq, g, ws):
        """Per block: (column matrix (gb, Cg, T, cols), per tap the packed-image rows it holds
        (gb, Cg, cols), the grid block (gb, Mg, cols), the group slice)."""
        T, Cg, Mg, grid = len(self.taps), self.Cg, self.Mg, self.grid
        n = g.shape[2] // grid
        images, groups = self._block(n)
        parts = [(n0, min(images, first + count - n0)) for first, count in self.blocks(n)
                 for n0 in range(first, first + count, images)]
        for n0, nb in parts:
            for g0 in range(0, self.group, groups):
                gb = min(groups, self.group - g0)
                col = self._buf(ws, "col", (gb, Cg, T, nb * grid))
                rows = [xq[0, ph, g0 * Cg:(g0 + gb) * Cg, n0 * grid + off:(n0 + nb) * grid + off]
                        .reshape(gb, Cg, -1) for ph, off in self.taps]
                yield col, rows, g[0, g0 * Mg:(g0 + gb) * Mg, n0 * grid:(n0 + nb) * grid].reshape(gb, Mg, -1), \
                    slice(g0, g0 + gb)

    @staticmethod
    def _fill(col, rows):
        for t, r in enumerate(rows):
            col[:, :, t] = r
        return col.reshape(col.shape[0], -1, col.shape[-1])

    def _w3(self, w):
        return w.reshape(self.group, self.Mg, -1)          # (groups, Mg, Cg*T): the column's row order

    # -- the passes ------------------------------------------------------------------
    def _gemm_forward(self, xq, w, g, ws):
        w3 = self._w3(w)
        for col, rows, grid, gs in self._blocks(xq, g, ws):
            np.matmul(w3[gs], self._fill(col, rows), out=grid)

    def _gemm_filter(self, xq, g, dw, ws):
        # per tap, straight from the packed rows: no column matrix to write (measured 1.4x faster)
        dw4 = dw.reshape(self.group, self.Mg, self.Cg, -1)
        for _, rows, grid, gs in self._blocks(xq, g, ws):
            for t, r in enumerate(rows):
                dw4[gs, :, :, t] += np.matmul(grid, r.transpose(0, 2, 1))

    def _gemm_data(self, g, w, xq, ws):
        w3t = self._w3(w).transpose(0, 2, 1)
        for col, rows, grid, gs in self._blocks(xq, g, ws):
            c2 = col.reshape(col.shape[0], -1, col.shape[-1])
            if self.Mg == 1:        # an outer product: matmul runs it far slower than a multiply
                np.multiply(w3t[gs], grid, out=c2)
            else:
                np.matmul(w3t[gs], grid, out=c2)
            for t, r in enumerate(rows):
                r += col[:, :, t]
