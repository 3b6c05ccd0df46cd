"""Recomputation: segments of cheap layers whose outputs are dropped after forward.

A segment starts at a checkpoint operator (convolution, inner product,
concat, eltwise, anything not cheap) and runs over the cheap operators that
follow it in forward order. In backward, the cheap operators are replayed
(``Layer.recompute``: BatchNorm without moving its running statistics,
Dropout with its kept mask) to bring back what backward reads.

Every tensor a segment's cheap operators write must be written only inside
that segment; a cheap operator that breaks this (an in-place layer on a
tensor of another segment) is made a checkpoint itself, so replaying a
segment never clobbers a value another part of the net still needs.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .liveness import op_tensors

# Layers worth recomputing rather than keeping: cheap in FLOPs, memory-bound.
CHEAP = {"ReLU", "PReLU", "ELU", "Sigmoid", "TanH", "AbsVal", "Power", "Pooling", "LRN",
         "BatchNorm", "Scale", "Bias", "Dropout", "Split", "Flatten", "Reshape", "Softmax"}


def is_cheap(node) -> bool:
    if node.type not in CHEAP and not getattr(node.layer, "cheap", False):   # or the class says so
        return False
    if node.type == "Pooling" and node.layer.param.pooling_param.pool == 2:   # STOCHASTIC draws anew
        return False
    return True


def kept_scratch(node) -> set:
    """Scratch a replay reads instead of writing: Dropout's mask, BatchNorm's batch mean and std."""
    keep = {"Dropout": ("mask",), "BatchNorm": ("mean", "std")}.get(node.type, ())
    return {id(t) for k, t in node.scratch.items() if k in keep}


@dataclass
class Segment:
    index: int
    checkpoint: int | None               # forward op index of the checkpoint operator
    cheap: list = field(default_factory=list)   # forward op indices replayed in backward


def segments(forward_ops, persistent_ids) -> list:
    """Split the forward operators into segments (see the module docstring)."""
    cheap = [is_cheap(op.node) for op in forward_ops]
    while True:
        segs, seg_of = [], []
        for i, op in enumerate(forward_ops):
            if not cheap[i] or not segs:
                segs.append(Segment(len(segs), None if cheap[i] else i))
            if cheap[i]:
                segs[-1].cheap.append(i)
            seg_of.append(segs[-1].index)
        writers: dict = {}
        for i, op in enumerate(forward_ops):
            for r, write in op_tensors(op):
                if write and id(r) not in persistent_ids:
                    writers.setdefault(id(r), []).append(i)
        broken = set()
        for i, op in enumerate(forward_ops):
            if not cheap[i]:
                continue
            for r, write in op_tensors(op):
                if write and id(r) in writers and any(seg_of[w] != seg_of[i] for w in writers[id(r)]):
                    broken.add(i)
        if not broken:
            return segs, seg_of
        for i in broken:
            cheap[i] = False
