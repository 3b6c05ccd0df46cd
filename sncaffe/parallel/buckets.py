"""Gradient buckets: the parameters whose gradients are all-reduced together, in backward order.

Backward runs the layers last to first, so the buckets are filled in that
order, each up to ``bucket_bytes`` (PyTorch DDP's 25 MB): a bucket is ready,
and its all-reduce can start, as soon as the backward operators of all its
layers have run, while backward goes on with the layers before them.
Parameters that get no gradient (lr_mult 0, BatchNorm's statistics) are not
sent. Buckets are plain data: ``describe(buckets)`` prints them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

BUCKET_BYTES = 25 << 20


@dataclass(eq=False)
class Slot:
    layer: str
    index: int                  # the parameter's index in its layer
    blob: object                # net.params[layer][index]; its .diff is sent and written back
    shape: tuple
    offset: int                 # in elements, into the bucket's buffer
    size: int
    diff: object = None         # the graph tensor of that gradient (what the all-reduce operator writes)


@dataclass(eq=False)
class Bucket:
    index: int
    dtype: np.dtype
    slots: list = field(default_factory=list)
    size: int = 0               # elements
    buffer: object = None       # the flat array the reducer all-reduces (host or device)

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    @property
    def layers(self) -> set:
        return {s.layer for s in self.slots}

    @property
    def name(self) -> str:
        return f"bucket {self.index} ({self.nbytes / 2**20:.2f} MB)"


def make_buckets(net, bucket_bytes=BUCKET_BYTES) -> list:
    """The train net's gradients, in the order backward produces them, grouped into buckets."""
    buckets, dtype = [], None
    # a parameter shared by name is sent once, after the last of its sharers' backward adds into it
    last = {id(d.root): (op.node.name, i) for op in net.graph.backward_ops
            for i, ((_, d), need) in enumerate(zip(op.node.params, op.node.param_need_backward)) if need}
    for op in net.graph.backward_ops:
        node = op.node
        for i, ((_, diff), need) in enumerate(zip(node.params, node.param_need_backward)):
            if not need or last[id(diff.root)] != (node.name, i):
                continue
            dtype, size = np.dtype(diff.dtype), math.prod(diff.shape)
            if not buckets or (buckets[-1].size and (buckets[-1].size + size) * dtype.itemsize > bucket_bytes):
                buckets.append(Bucket(len(buckets), dtype))
            b = buckets[-1]
            b.slots.append(Slot(node.name, i, node.layer.blobs[i], tuple(diff.shape), b.size, size, diff))
            b.size += size
    return buckets


def describe(buckets) -> str:
    return "; ".join(f"{b.name}: " + ", ".join(f"{s.layer}[{s.index}]" for s in b.slots) for b in buckets)
