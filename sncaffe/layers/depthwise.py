"""Grouped and depthwise convolution on NumPy: every group at once, not a GEMM per group.

``ConvPlan`` runs a grouped convolution as one set of GEMMs per group; with one input channel
per group (MobileNet's and Xception's depthwise 3x3s, 32 to 1024 groups) those are 1 x 9
GEMMs, each call costing more than its work. ``GroupedPlan`` keeps ConvPlan's packed image
and column-matrix geometry and runs a block of groups per NumPy call: the taps' slices of a
block of groups and images are copied into a column matrix (groups, Cg*taps, positions),
and one stacked ``matmul`` contracts it with the block's weights (groups, Mg, Cg*taps):

- forward: y = w @ col, into the grid;
- weight gradient: dw += dy @ col^T;
- input gradient: col = w^T @ dy, scattered back into the packed image by tap.

Blocks hold about ``BLOCK_BYTES`` of columns so they stay in the core's cache between the
copy and the product. ``make_plan`` chooses this plan or ConvPlan by the rule measured with
tools/bench_depthwise.py (docs/benchmarks.md "Depthwise and grouped convolution").
"""
from __future__ import annotations

import numpy as np

from .im2col import ConvPlan

BLOCK_BYTES = 1 << 19
# Measured (tools/bench_depthwise.py --grouped): the stacked form wins up to this many input
# channels per group; above it ConvPlan's per-group GEMMs are big enough.
MAX_GROUP_CHANNELS = 8


def make_plan(channels, num_output, group, size, kernel, stride, pad, dilation, **options):
    """The plan of a convolution: GroupedPlan for a grouped one with few channels per group and
    a kernel of more than one tap (or where ``options`` say ``grouped=True``), else ConvPlan
    (``options``: its layout choices, which force ConvPlan unless ``grouped`` is given)."""
    grouped = options.pop("grouped", None)
    block_bytes = options.pop("block_bytes", None)
    taps = kernel[0] * kernel[1]
    if grouped is None:
        grouped = not options and group > 1 and channels // group <= MAX_GROUP_CHANNELS
    if grouped and taps > 1:
        return GroupedPlan(channels, num_output, group, size, kernel, stride, pad, dilation, block_bytes)
    return ConvPlan(channels, num_output, group, size, kernel, stride, pad, dilation, **options)


class GroupedPlan(ConvPlan):
    """ConvPlan's batched column-matrix geometry, its GEMMs stacked over blocks of groups."""

    def __init__(self, channels, num_output, group, size, kernel, stride, pad, dilation, block_bytes=None):
        super().__init__(channels, num_output, group, size, kernel, stride, pad, dilation,
                         batched=True, col=True, col_filter=True, flip=False)
        assert self.col and len(self.taps) > 1, "GroupedPlan needs a kernel of more than one tap"
        column = 4 * self.Cg * len(self.taps) * self.out_size      # one group's column of one image
        budget = block_bytes or BLOCK_BYTES
        self.block_images = max(1, budget // column)
        self.block_groups = max(1, budget // (column * self.block_images))

    def workspace(self, n):
        B, L, G = self._rows(n)
        nb = min(n, self.block_images)
        gb = min(self.group, self.block_groups)
        return {"xq": self.P * self.C * L, "grid": self.M * G,
                "col": gb * self.Cg * len(self.taps) * nb * self.out_size}

    # -- blocks ----------------------------------------------------------------------
    def _blocks(self, xq, g, ws):
        """Per block: (column matrix (gb, Cg*T, cols), per tap the packed-image view its
        rows copy (gb, Cg, nb, Ho, Wo), the grid block (gb, Mg, cols), the group slice)."""
        Ho, Wo = self.out_shape
        Hq, Wq = self.h.pitch, self.w.pitch
        T, Cg, Mg = len(self.taps), self.Cg, self.Mg
        n = g.shape[2] // self.out_size
        for n0 in range(0, n, self.block_images):
            nb = min(self.block_images, n - n0)
            cols = slice(n0 * self.out_size, (n0 + nb) * self.out_size)
            for g0 in range(0, self.group, self.block_groups):
                gb = min(self.block_groups, self.group - g0)
                col = self._buf(ws, "col", (gb, Cg, T, nb, Ho, Wo))
                views = [xq[0, ph, g0 * Cg:(g0 + gb) * Cg, n0 * self.grid + off:(n0 + nb) * self.grid + off]
                         .reshape(gb, Cg, nb, Hq, Wq)[..., :Ho, :Wo] for ph, off in self.taps]
                grid = g[0, g0 * Mg:(g0 + gb) * Mg, cols].reshape(gb, Mg, -1)
                yield col, views, grid, slice(g0, g0 + gb)

    def _fill(self, col, views):
        for t, v in enumerate(views):
            col[:, :, t] = v
        return col.reshape(col.shape[0], -1, col[0, 0, 0].size)

    def _w3(self, w):
        return w.reshape(self.group, self.Mg, -1)          # (groups, Mg, Cg*T): the column's row order

    # -- the passes ------------------------------------------------------------------
    def _gemm_forward(self, xq, w, g, ws):
        w3 = self._w3(w)
        for col, views, grid, gs in self._blocks(xq, g, ws):
            np.matmul(w3[gs], self._fill(col, views), out=grid)

    def _gemm_filter(self, xq, g, dw, ws):
        dw3 = self._w3(dw)
        for col, views, grid, gs in self._blocks(xq, g, ws):
            dw3[gs] += np.matmul(grid, self._fill(col, views).transpose(0, 2, 1))

    def _gemm_data(self, g, w, xq, ws):
        w3 = self._w3(w)
        for col, views, grid, gs in self._blocks(xq, g, ws):
            c2 = col.reshape(col.shape[0], -1, col[0, 0, 0].size)
            np.matmul(w3[gs].transpose(0, 2, 1), grid, out=c2)
            for t, v in enumerate(views):
                v += col[:, :, t]
