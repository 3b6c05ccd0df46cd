"""The planner's analysis passes: each policy is a function over the graph that returns plain
data; ``analyze`` walks them in order for one plan, and the builder (builder.py) replays the
iteration on that data to emit the schedule.

- ``liveness``:       persistent roots and each scheduled root's uses (once per graph)
- ``host_params``:    parameters and gradients kept on the host, and the steps that touch them
                      (``params_near``, ``params_after``: what a step brings in and sends back)
- ``recompute``:      segments, what each drops and replays, the snapshots in-place layers need
- ``memory_centric``: the segments replayed from their checkpoint for each need
- ``need_times``:     the steps where each root must be on the device (replays counted)
- ``offload``:        what goes to the host after forward, and when it comes back
- ``lower_bound``:    what any mode's peak is at least

The policies that depend on what is resident at each step are decided while the builder
replays the iteration, each by its own module: the LRU cache (cache.py), the tier of each
offloaded copy (tiers.py), workspaces in chunks (chunks.py), block placement (placement.py).
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass

from ..tensor import Tensor
from .liveness import analyze as uses_of, op_tensors, persistent_roots, workspaces
from .recompute import kept_scratch, segments


@dataclass
class Analysis:
    """What the passes decided for one plan, before the replay."""
    persistent: list        # roots allocated at bind time (host parameters left out)
    persistent_ids: set     # ids of every persistent root (never scheduled as activations)
    uses: dict              # id(root) -> (root, liveness.Uses)
    param_ids: dict         # id(root) -> root, parameters and gradients kept on the host
    param_ops: dict         # step -> [(root, changed)] of those the step touches
    rc: "Recompute"
    mc: set                 # indices of the segments replayed memory-centric
    times: dict             # id(root) -> sorted steps it must be on the device
    fwd_last: dict          # id(root) -> (last forward write, last forward use)
    offloaded: dict         # id(root) -> root, copied to the host after forward
    to_bring: list          # (step, order, root): each offloaded value's first backward need


def analyze(graph, ops, nf, mode, hosted=False, centric=False, min_gap=3) -> Analysis:
    """The passes below, walked in order; their data is what the builder replays. ``hosted``:
    parameters on the host; ``centric``: memory-centric replays (see ``memory_centric``).
    The same for every plan of these arguments (auto makes several at different capacities):
    analysed once per graph, and read-only to the builder."""
    key = ("_analysis", mode, bool(hosted), centric, min_gap, len(ops), nf)
    if key not in graph.__dict__:
        graph.__dict__[key] = _analyze(graph, ops, nf, mode, hosted, centric, min_gap)
    return graph.__dict__[key]


def _analyze(graph, ops, nf, mode, hosted, centric, min_gap) -> Analysis:
    roots, uses = liveness(graph, ops, mode)
    persistent_ids = {id(r) for r in roots}
    param_ids, param_ops = {}, {}
    if hosted:
        param_ids, param_ops, roots = host_params(graph, ops, roots)
    rc = recompute(ops[:nf], ops, uses, persistent_ids, mode in ("offload", "all")) \
        if mode in ("recompute", "all") else Recompute([], {}, {})
    mc = memory_centric(rc.segs, centric)
    times, fwd_last = need_times(graph, uses, nf, rc, mc)
    offloaded, to_bring = offload(uses, rc.dropped, times, nf, min_gap) if mode in ("offload", "all") else ({}, [])
    return Analysis(roots, persistent_ids, uses, param_ids, param_ops, rc, mc, times, fwd_last, offloaded, to_bring)


def liveness(graph, ops, mode):
    """(persistent roots, uses) over ``ops``: forward and backward, or forward alone for a net
    that only runs forward (a test net: nothing is then needed after forward). ``none``
    keeps every root of the net, forward's and backward's, for the whole iteration."""
    if mode == "none":
        roots, uses = _uses(graph, graph.forward_ops + graph.backward_ops)
        return roots + [r for r, _ in uses.values()], {}
    return _uses(graph, ops)


def _uses(graph, ops):
    key = ("_liveness", len(ops))
    if key not in graph.__dict__:      # the same for every mode: analysed once per graph
        roots = persistent_roots(graph)
        graph.__dict__[key] = (roots, uses_of(ops, roots))
    roots, uses = graph.__dict__[key]
    return list(roots), uses


def host_params(graph, ops, roots):
    """(param_ids, param_ops, the roots left on the device): parameters and their gradients
    live on the host; each step lists the ones it touches and whether it changes them."""
    param_ids, param_ops = {}, {}
    for node in graph.layers:
        for d, dd in node.params:
            for t in (d, dd):
                param_ids[id(t.root)] = t.root
    for i, op in enumerate(ops):
        # A layer without learnable blobs (BatchNorm) moves its statistics in forward.
        moved = op.kind == "forward" and not op.node.layer.learnable
        param_ops[i] = [(r, w or moved) for r, w in op_tensors(op) if id(r) in param_ids]
    return param_ids, param_ops, [r for r in roots if id(r) not in param_ids]


def params_near(param_ops, i, end, lookahead):
    """Host parameters of step ``i`` and the next few (prefetched: the copies overlap compute)."""
    return [r for k in range(i, min(i + lookahead + 1, end)) for r, _ in param_ops.get(k, ())]


def params_after(param_ops, i, end, lookahead):
    """(root, changed, leaving) for the host parameters of step ``i``: what it changed goes back
    to the host, and what no near step needs leaves the device."""
    soon = {id(r) for k in range(i + 1, min(i + lookahead + 1, end)) for r, _ in param_ops.get(k, ())}
    return [(r, write, id(r) not in soon) for r, write in param_ops.get(i, ())]


@dataclass
class Recompute:
    segs: list          # recompute.Segment, with snapshots, externals, dropped, needed_by
    dropped: dict       # id(root) -> its segment
    snap_at: dict       # forward index -> [(root, checkpoint tensor)] copied before it runs


def recompute(forward, ops, uses, persistent_ids, offload) -> Recompute:
    """What cheap layers produce is dropped after forward and replayed from the segment's
    checkpoint in backward; a value an in-place layer overwrites is snapshotted first."""
    nf = len(forward)
    segs, _ = segments(forward, persistent_ids)
    dropped, snap_at = {}, {}
    fidx = {id(op.node): i for i, op in enumerate(forward)}
    for seg in segs:
        seg.snapshots, seg.externals, seg.written, seg.dropped, seg.needed_by = [], [], [], [], []
        seg.done = False
        produced = set()
        cheap = set(seg.cheap)
        for k in seg.cheap:
            kept = kept_scratch(forward[k].node)
            for r, _ in op_tensors(forward[k], ("reads",)) + [(t, 0) for t in forward[k].writes if id(t) in kept]:
                if id(r) in persistent_ids or id(r) in produced:
                    continue
                if id(r) in kept or not any(w >= k for w in uses[id(r)][1].writes if w < nf):
                    if r not in seg.externals:
                        seg.externals.append(r)      # its final value, from elsewhere
                    continue
                point = min(w for w in uses[id(r)][1].writes if k <= w < nf)
                ckpt = Tensor(r.name + "@checkpoint", r.shape, r.dtype, "checkpoint", location=r.location)
                seg.snapshots.append((r, ckpt, point))
                produced.add(id(r))
            for r, write in op_tensors(forward[k]):
                if write and id(r) not in persistent_ids and id(r) not in kept and id(r) not in produced:
                    produced.add(id(r))
            for r, write in op_tensors(forward[k]):
                if write and id(r) in produced and r not in seg.written:
                    seg.written.append(r)
        own = cheap | {seg.checkpoint}
        for r in seg.written:
            u = uses[id(r)][1]
            fw = [w for w in u.writes if w < nf]
            bwd = [x for x in u.reads + u.writes if x >= nf]
            # Only what the segment's own backward reads is dropped: a value another
            # segment's backward needs (the next convolution's bottom) is a checkpoint.
            # (Without offload, dropping it anyway still saves more than it costs.)
            if bwd and fw and max(fw) in cheap and (not offload or all(
                    fidx[id(ops[x].node)] in own for x in bwd)):
                seg.dropped.append(r)
                dropped[id(r)] = seg
                seg.needed_by.extend(bwd)
        seg.needed_by = sorted(set(seg.needed_by))
        if not seg.dropped:
            seg.snapshots = []          # never replayed: nothing to snapshot
        for r, ckpt, point in seg.snapshots:
            snap_at.setdefault(point, []).append((r, ckpt))
        seg.snapshots = [(r, ckpt) for r, ckpt, _ in seg.snapshots]
    return Recompute(segs, dropped, snap_at)


def memory_centric(segs, setting):
    """Segments replayed from the checkpoint for each backward step that needs them: all
    (``True``), none (``False``), or ``"some"``: those dropping at least 3 values."""
    return {seg.index for seg in segs if seg.dropped and (
        setting is True or (setting == "some" and len(seg.dropped) >= 3))}


def replay_ops(seg, r, op, dropped, fwd_last):
    """A memory-centric replay's operators: the segment's, up to the last writer of ``r`` and
    of what else the step ``op`` reads of the segment."""
    mine = [fwd_last[id(q)][0] for q, _ in op_tensors(op) if dropped.get(id(q)) is seg]
    last = max(mine + [fwd_last[id(r)][0]])
    return [k for k in seg.cheap if k <= last]


def use_times(graph, uses, nf):
    """Per scheduled root: the sorted steps that use it, and (last forward write, last forward
    use), -1 where none. The same for every mode: computed once per graph."""
    if not uses:
        return {}, {}
    key = ("_times", id(uses))
    if key not in graph.__dict__:
        times, last = {}, {}
        for k, (r, u) in uses.items():
            times[k] = sorted(set(u.reads + u.writes))
            w = [x for x in u.writes if x < nf]
            f = [x for x in times[k] if x < nf]
            last[k] = (max(w, default=-1), max(f, default=-1))
        graph.__dict__[key] = (times, last)
    return graph.__dict__[key]


def need_times(graph, uses, nf, rc: Recompute, memory_centric=()):
    """(times, fwd_last): the steps where each root must be on the device. A dropped value is
    not needed again until backward; what a replay reads from outside its segment is needed
    at the replay (speed-centric: the first need; memory-centric: every need)."""
    base, fwd_last = use_times(graph, uses, nf)
    times = dict(base)                  # lists shared with the graph's cache: replaced, never changed
    for key in rc.dropped:
        times[key] = [x for x in base[key] if x >= nf]
    for seg in rc.segs:
        if seg.needed_by:
            needs = set(seg.needed_by) if seg.index in memory_centric else {seg.needed_by[0]}
            for r in seg.externals:
                times[id(r)] = sorted(set(times[id(r)]) | needs)
    return times, fwd_last


def offload(uses, dropped, times, nf, min_gap):
    """(offloaded, to_bring): values needed again in backward, long after forward is done with
    them, copied to the host; each brought back once, before its first need in backward."""
    out = {}
    for key, (r, u) in uses.items():
        if key in dropped:
            continue
        fwd = [x for x in u.reads + u.writes if x < nf]
        later = _after(times.get(key, []), nf - 1)
        if fwd and later and later[0] - max(fwd) >= min_gap:
            out[key] = r
    to_bring = sorted(((_after(times.get(id(r), []), nf - 1)[0], i, r) for i, r in enumerate(out.values())),
                      key=lambda x: x[:2])
    return out, to_bring


def _after(t, after):
    return t[bisect.bisect_right(t, after):]


def lower_bound(graph, ops, param_ids):
    """(bytes, step): max over steps of what that step itself touches, beside what always
    lives, in any mode (host parameters count where they are brought in)."""
    key = ("_lower_bound", bool(param_ids))
    if key not in graph.__dict__:       # the same for every mode: computed once per graph
        always = [r for r in persistent_roots(graph) if id(r) not in param_ids]
        keep = {id(r) for r in always}
        best, where = 0, ""
        for op in ops:
            need = sum(r.block_bytes for r, _ in op_tensors(op) if id(r) not in keep)
            need += sum(t.block_bytes for t in workspaces(op))
            if need > best:
                best, where = need, op.name
        graph.__dict__[key] = (sum(r.block_bytes for r in always) + best, where)
    return graph.__dict__[key]
