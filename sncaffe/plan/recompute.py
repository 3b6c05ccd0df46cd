"""Recomputation: segments of forward operators whose outputs are dropped after forward.

Two granularities. Per layer (SuperNeurons): a segment starts at a checkpoint
operator (convolution, inner product, concat, eltwise, anything not cheap) and
runs over the cheap operators that follow it in forward order. In backward, the cheap operators are replayed
(``Layer.recompute``: BatchNorm without moving its running statistics,
Dropout with its kept mask) to bring back what backward reads.

Every tensor a segment's cheap operators write must be written only inside
that segment; a cheap operator that breaks this (an in-place layer on a
tensor of another segment) is made a checkpoint itself, so replaying a
segment never clobbers a value another part of the net still needs.

Coarser (Chen et al. 2016): a segment is a run of whole units, each unit the operators
between two articulation tensors (a value every path of the net crosses: a ResNet block's
output). Every operator inside is replayed, convolutions included; only what operators after
the segment read in forward is kept (the segment's output, the checkpoint), and what backward
needs of the rest is brought back by replaying the segment once. Operators whose forward
cannot be replayed without side effects (data layers, losses, random draws) are checkpoints.
"""
from __future__ import annotations

import weakref
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


# Layers whose forward, run again on the same bottoms (``Layer.recompute``), writes the same
# bits and changes nothing else: replayed in coarse segments, beside the cheap ones.
REPLAYABLE = {"Convolution", "Deconvolution", "InnerProduct", "Eltwise", "Concat", "Slice", "Crop",
              "Scale", "Bias", "BatchNorm", "Dropout"}


def is_replayable(node) -> bool:
    return bool(node.bottoms) and (node.type in REPLAYABLE or is_cheap(node))


def kept_scratch(node) -> set:
    """Scratch a replay reads instead of writing: Dropout's mask, BatchNorm's batch mean and std."""
    keep = {"Dropout": ("mask",), "BatchNorm": ("mean", "std")}.get(node.type, ())
    return {id(t) for k, t in node.scratch.items() if k in keep}


@dataclass
class Segment:
    index: int
    checkpoint: int | None               # forward op index of the checkpoint operator
    cheap: list = field(default_factory=list)   # forward op indices replayed in backward


# The last per-layer split made (planning asks for the same one several times per net: each mode
# that recomputes, the bound, the chains), keyed by its operators, held weakly: a net let go is
# not kept alive by it.
_last_split: list = [None, None, None, None]


def segments(forward_ops, persistent_ids, starts=None, fixed=()) -> list:
    """Split the forward operators into segments (see the module docstring): per layer, or
    where ``starts`` (forward indices) is given, from each start to the next; ``fixed``:
    operators kept out of replays. Fresh Segment objects each call (callers annotate them)."""
    if starts is None and not fixed and forward_ops:
        key = (len(forward_ops), hash(frozenset(persistent_ids)))
        first, last = _last_split[1], _last_split[2]
        if _last_split[0] != key or first() is not forward_ops[0] or last() is not forward_ops[-1]:
            segs, seg_of = _segments(forward_ops, persistent_ids)
            _last_split[:] = key, weakref.ref(forward_ops[0]), weakref.ref(forward_ops[-1]), \
                ([(s.index, s.checkpoint, s.cheap) for s in segs], seg_of)
        raw, seg_of = _last_split[3]
        return [Segment(i, c, list(cheap)) for i, c, cheap in raw], list(seg_of)
    return _segments(forward_ops, persistent_ids, starts, fixed)


def _segments(forward_ops, persistent_ids, starts=None, fixed=()) -> list:
    if starts is None:
        cheap = [is_cheap(op.node) for op in forward_ops]
    else:
        cheap = [i not in fixed and is_replayable(op.node) for i, op in enumerate(forward_ops)]
    while True:
        segs, seg_of = [], []
        for i, op in enumerate(forward_ops):
            if not cheap[i] or not segs or (starts is not None and i in starts):
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


def units(forward_ops, persistent_ids) -> list:
    """The forward indices where a unit starts (see ``articulations``)."""
    return [cut for cut, _ in articulations(forward_ops, persistent_ids)]


def articulations(forward_ops, persistent_ids) -> list:
    """(cut, id of the value crossing it, or None): the cuts that at most one value crosses
    (written before the cut, used after it) and that nothing after the cut writes."""
    first, last, last_write = {}, {}, {}
    for i, op in enumerate(forward_ops):
        for r, write in op_tensors(op):
            key = id(r)
            if key not in persistent_ids:
                first.setdefault(key, i)
                last[key] = i
                if write:
                    last_write[key] = i
    n = len(forward_ops)
    count, total = [0] * (n + 1), [0] * (n + 1)      # values crossing each cut, and their ids' sum
    for key, i in first.items():
        if last[key] > i:
            count[i + 1] += 1
            count[last[key] + 1] -= 1
            total[i + 1] += key
            total[last[key] + 1] -= key
    cuts, crossing, ids = [(0, None)], 0, 0
    for b in range(1, n):
        crossing += count[b]
        ids += total[b]
        if crossing == 0:
            cuts.append((b, None))
        elif crossing == 1 and last_write.get(ids, n) < b:     # one value: the sum is its id
            cuts.append((b, ids))
    return cuts


def group_units(cuts, sizes, factor) -> set:
    """Segment starts: consecutive units (starting at ``cuts``, of ``sizes`` bytes) joined while
    a segment's bytes stay within ``factor`` times the largest unit's (factor 1: about a unit
    each; larger: fewer, longer segments, fewer checkpoints)."""
    limit = factor * max(sizes, default=0)
    starts, held = set(), None
    for cut, size in zip(cuts, sizes):
        if held is None or held + size > limit:
            starts.add(cut)
            held = 0
        held += size
    return starts
