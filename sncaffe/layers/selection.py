"""Layers that pick items by index: Embed (rows of a weight table), BatchReindex and Filter
(items of the batch). Caffe never differentiates the indices or the selector: with
force_backward it stops at Backward, and so does sncaffe, with the layer named.
"""
from __future__ import annotations

import numpy as np

from ..fillers import fill
from .base import Layer, array_module, count, register


def _indices(layer, xp, values, limit, what):
    """Float indices as ints (Caffe's static_cast<int>), each checked to lie in [0, limit)."""
    idx = values.reshape(-1).astype(xp.int64)
    if idx.size and bool(((idx < 0) | (idx >= limit)).any()):
        bad = values.reshape(-1)[int(xp.argmax((idx < 0) | (idx >= limit)))]
        raise layer.error(f"{what} {float(bad)} out of range [0, {limit})")
    return idx


def _scatter_add(xp, dst, idx, rows):
    """dst[idx[i]] += rows[i], repeated indices summed."""
    if xp is np:
        np.add.at(dst, idx, rows)
    else:
        import cupyx
        cupyx.scatter_add(dst, idx, rows)


@register
class Embed(Layer):
    """top = W[index] (+ bias): W is (input_dim, num_output); the top appends num_output to the
    bottom's shape. The weight diff sums the top diff rows of each index."""
    type = "Embed"
    exact_bottoms = exact_tops = 1
    backward_needs = ("bottom",)

    def setup(self, bottom_shapes):
        p, shape = self.param.embed_param, tuple(bottom_shapes[0])
        if p.num_output <= 0:
            raise self.error("embed_param.num_output must be positive")
        if p.input_dim <= 0:
            raise self.error("embed_param.input_dim must be positive")
        self.K, self.N, self.bias_term, self.M = p.input_dim, p.num_output, p.bias_term, count(shape)
        self.param_shapes = [(self.K, self.N)] + [(self.N,)] * self.bias_term
        return [shape + (self.N,)]

    def init_params(self, rng):
        p = self.param.embed_param
        fill(p.weight_filler, self.blobs[0].data, rng)
        if self.bias_term:
            fill(p.bias_filler, self.blobs[1].data, rng)

    def forward(self, bottom, top):
        xp = array_module(bottom[0].data)
        idx = _indices(self, xp, bottom[0].data, self.K, "index")
        y = top[0].data.reshape(self.M, self.N)
        xp.take(self.blobs[0].data, idx, axis=0, out=y)
        if self.bias_term:
            y += self.blobs[1].data

    def backward(self, top, propagate_down, bottom):
        if propagate_down[0]:
            raise self.error("can't backpropagate to the Embed input (its indices), as in Caffe; "
                             "remove force_backward or the gradient this input asks for")
        xp = array_module(top[0].diff)
        dy = top[0].diff.reshape(self.M, self.N)
        _scatter_add(xp, self.blobs[0].diff, _indices(self, xp, bottom[0].data, self.K, "index"), dy)
        if self.bias_term:
            self.blobs[1].diff += dy.sum(axis=0)


@register
class BatchReindex(Layer):
    """top = bottom[0][idx]: items of the batch in the order (and multiplicity) of bottom[1];
    backward scatter-adds, so repeated items sum and unused items get 0."""
    type = "BatchReindex"
    exact_bottoms, exact_tops = 2, 1
    backward_needs = ("bottom",)

    def setup(self, bottom_shapes):
        shape, idx = (tuple(s) for s in bottom_shapes)
        if len(idx) != 1:
            raise self.error(f"the index bottom must have 1 axis, got shape {idx}")
        self.inner = count(shape, 1)
        return [(idx[0],) + shape[1:]]

    def _idx(self, xp, bottom):
        return _indices(self, xp, bottom[1].data, bottom[0].shape[0], "index")

    def forward(self, bottom, top):
        xp = array_module(bottom[0].data)
        xp.take(bottom[0].data.reshape(-1, self.inner), self._idx(xp, bottom), axis=0,
                out=top[0].data.reshape(-1, self.inner))

    def backward(self, top, propagate_down, bottom):
        if propagate_down[1]:
            raise self.error("cannot backprop to index (bottom[1]), as in Caffe; remove "
                             "force_backward or the gradient this input asks for")
        if not propagate_down[0]:
            return
        xp = array_module(top[0].diff)
        dx = bottom[0].diff.reshape(-1, self.inner)
        dx.fill(0)
        _scatter_add(xp, dx, self._idx(xp, bottom), top[0].diff.reshape(-1, self.inner))


@register
class Filter(Layer):
    """Keep the items whose selector (the last bottom, shape (N) or (N, 1, ...)) is non-zero, in
    order, from every other bottom: top i is bottom i filtered. Backward copies each kept item's
    diff back and writes 0 to dropped items.

    As in Caffe, the tops are set up with the whole batch and reshaped at every forward to the
    number of kept items (``data_dependent``: sncaffe.dynamic re-sets the later layers up). Bound
    to arrays of the whole batch (the gradient checker), the tops' first rows are used."""
    type = "Filter"
    min_bottoms, min_tops = 2, 1
    backward_needs = ("bottom",)
    data_dependent = True

    def setup(self, bottom_shapes):
        shapes = [tuple(s) for s in bottom_shapes]
        if len(self.param.top) != len(shapes) - 1:
            raise self.error(f"needs one top per bottom but the selector: {len(shapes) - 1} top(s), "
                             f"got {len(self.param.top)}")
        sel = shapes[-1]
        if any(d != 1 for d in sel[1:]):
            raise self.error(f"selector blob dimensions must be singletons (1), except the first; got {sel}")
        for i, s in enumerate(shapes[:-1]):
            if not s or s[0] != sel[0]:
                raise self.error(f"bottom {i} {s} must have the selector's first dimension {sel[0]}")
        return shapes[:-1]

    @staticmethod
    def _kept(sel):
        return array_module(sel).flatnonzero(sel.reshape(-1))

    def top_shapes(self, bottom):
        """This forward's top shapes: as many items as the selector keeps."""
        n = int(self._kept(bottom[-1].data).size)
        return [(n,) + tuple(b.data.shape[1:]) for b in bottom[:-1]]

    def forward(self, bottom, top):
        xp = array_module(bottom[0].data)
        kept = self._kept(bottom[-1].data)
        for b, t in zip(bottom, top):
            t.data[:kept.size] = xp.take(b.data, kept, axis=0)

    def backward(self, top, propagate_down, bottom):
        if propagate_down[-1]:
            raise self.error("cannot backpropagate to the filter index input (the selector, last "
                             "bottom), as in Caffe; remove force_backward or the gradient it asks for")
        kept = self._kept(bottom[-1].data)
        for b, t, down in zip(bottom, top, propagate_down):
            if down:
                b.diff.fill(0)
                b.diff[kept] = t.diff[:kept.size]
