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
from ..sizes import align
from .recompute import articulations, group_units, is_replayable, kept_scratch, segments


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


def analyze(graph, ops, nf, mode, hosted=False, centric=False, min_gap=3, granularity=0, keep=0) -> Analysis:
    """The passes below, walked in order; their data is what the builder replays. ``hosted``:
    parameters on the host; ``centric``: memory-centric replays (see ``memory_centric``);
    ``granularity``: 0 recomputes per layer, more in segments of whole units (``recompute``);
    ``keep``: with a granularity, the first ``keep`` layer chains of ``chains`` are kept, not
    replayed. The same for every plan of these arguments (auto makes several at different
    capacities): analysed once per graph, and read-only to the builder."""
    key = ("_analysis", mode, bool(hosted), centric, min_gap, len(ops), nf, granularity, keep)
    if key not in graph.__dict__:
        graph.__dict__[key] = _analyze(graph, ops, nf, mode, hosted, centric, min_gap, granularity, keep)
    return graph.__dict__[key]


def _analyze(graph, ops, nf, mode, hosted, centric, min_gap, granularity, keep=0) -> Analysis:
    roots, uses = liveness(graph, ops, mode)
    persistent_ids = {id(r) for r in roots}
    param_ids, param_ops = {}, {}
    if hosted:          # gradients updated in backward go to the host with their parameters
        param_ids, param_ops, roots = host_params(graph, ops, roots)
        if getattr(graph, "updated_in_backward", None):
            persistent_ids |= set(param_ids)
            uses = {k: v for k, v in uses.items() if k not in param_ids}
    kept = frozenset().union(*(ids for ids, _, _ in chains(graph, granularity)[:keep])) if keep else frozenset()
    rc = recompute(ops[:nf], ops, uses, persistent_ids, mode in ("offload", "all"), granularity,
                   unit_table(graph) if granularity else None, kept) \
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


def recompute(forward, ops, uses, persistent_ids, offload, granularity=0, table=None, keep=frozenset()) -> Recompute:
    """What cheap layers produce (or, with a ``granularity``, what whole segments produce but
    their outputs and the values in ``keep``) is dropped after forward and replayed from the
    segment's checkpoint in backward; a value an in-place layer overwrites is snapshotted first."""
    nf = len(forward)
    segs = coarse_segments(forward, uses, persistent_ids, granularity, table, keep) if granularity \
        else segments(forward, persistent_ids)[0]
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
            if (id(r) in seg.drop) if granularity else (bwd and fw and max(fw) in cheap and (not offload or all(
                    fidx[id(ops[x].node)] in own for x in bwd))):
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


def coarse_segments(forward, uses, persistent_ids, granularity, table, keep=frozenset()):
    """Segments of whole units (recompute.units), joined up to ``granularity`` times the largest
    unit's bytes, each replaying only the operators behind what it drops (``seg.drop``: what
    backward reads and only the segment's own operators use in forward, less ``keep``: values
    held from forward to backward instead, whose operators then need no replay). An operator
    that would overwrite, in a replay, a value it does not drop that backward writes or that
    ``keep`` holds is kept out of replays."""
    nf = len(forward)
    cuts, _, _, written = table
    starts = group_units(cuts, written, granularity)
    fixed = set()
    while True:
        segs, seg_of = segments(forward, persistent_ids, starts, fixed)
        unsafe = set()
        for seg in segs:
            seg.span = []                                                           # replayed or not
        for k, s in enumerate(seg_of):
            segs[s].span.append(k)
        for seg in segs:
            seg.drop = _droppable(seg, forward, uses, nf, persistent_ids, seg_of) - keep
            seg.cheap = _replayed(seg, forward, seg.drop, keep)
            for k in seg.cheap:
                for r, w in op_tensors(forward[k]):
                    if w and id(r) not in persistent_ids and id(r) not in seg.drop \
                            and (id(r) in keep or any(x >= nf for x in uses[id(r)][1].writes)):
                        unsafe.add(k)
        if not unsafe:
            return segs
        fixed |= unsafe


def chains(graph, granularity) -> list:
    """The layer chains of the plan at ``granularity`` (each a checkpoint operator of per-layer
    recomputation and the cheap layers after it: a convolution, its BatchNorm, Scale and ReLU)
    that its replays run, best first: (ids of the values the chain writes and the plan drops,
    their bytes, the FLOPs its replay costs). Keeping a chain's values from forward to backward
    spares its replay: the best chains spare the most FLOPs per byte held (a 3x3 convolution's
    output before a 1x1's, and either before the cheap layers'). Once per graph."""
    key = ("_chains", granularity, len(graph.forward_ops))
    if key in graph.__dict__:
        return graph.__dict__[key]
    from .result import layer_flops
    forward = graph.forward_ops
    roots, uses = liveness(graph, forward + graph.backward_ops, "recompute")
    pid = {id(r) for r in roots}
    segs = coarse_segments(forward, uses, pid, granularity, unit_table(graph))
    drop = set().union(*(seg.drop for seg in segs))
    replayed = set().union(*(seg.cheap for seg in segs))
    out = []
    for chain in segments(forward, pid)[0]:
        ks = [k for k in [chain.checkpoint] + chain.cheap if k is not None]
        cost = sum(layer_flops(forward[k].node) for k in ks if k in replayed)
        held = {id(r): r for k in ks for r, w in op_tensors(forward[k]) if w and id(r) in drop}
        size = sum(r.block_bytes for r in held.values())
        if cost and size:
            out.append((frozenset(held), size, cost))
    out.sort(key=lambda c: -c[2] / c[1])
    graph.__dict__[key] = out
    return out


def coarse_floor(graph, granularity) -> int:
    """A lower bound of the transient bytes of the coarse plan at ``granularity``, without
    building it: at the replay of each segment, the values it drops that are local to one of
    its units are all resident, beside the checkpoints (crossing values) that start it and every
    segment before it, which backward still needs."""
    cuts, drop, ckpt, written = unit_table(graph)
    starts = group_units(cuts, written, granularity)
    floor = held = here = 0
    for u, cut in enumerate(cuts):
        if cut in starts:
            floor, here = max(floor, held + here), 0
            held += ckpt[u]
        here += drop[u]
    return max(floor, held + here)


def unit_table(graph):
    """The net's units (recompute.articulations), computed once per graph: see ``_units``."""
    key = ("_units", len(graph.forward_ops))
    if key not in graph.__dict__:
        graph.__dict__[key] = _units(graph)
    return graph.__dict__[key]


def _units(graph):
    """(cuts, per unit: bytes of the values only it uses in forward and backward reads (none
    where it has an operator that is never replayed), bytes of the value crossing its cut where
    backward reads it, bytes its operators write)."""
    forward = graph.forward_ops
    nf = len(forward)
    roots, uses = liveness(graph, forward + graph.backward_ops, "recompute")
    pid = {id(r) for r in roots}
    arts = articulations(forward, pid)
    cuts = [c for c, _ in arts]
    unit_of = [0] * nf
    for u, (a, b) in enumerate(zip(cuts, cuts[1:] + [nf])):
        unit_of[a:b] = [u] * (b - a)
    whole = [True] * len(cuts)
    kept = set()
    for i, op in enumerate(forward):
        whole[unit_of[i]] = whole[unit_of[i]] and is_replayable(op.node)
        kept |= kept_scratch(op.node)
    drop, written = [0] * len(cuts), [0] * len(cuts)
    for key, (r, u) in uses.items():
        fw = [x for x in u.reads + u.writes if x < nf]
        if not fw or not any(x < nf for x in u.writes):
            continue
        written[unit_of[min(x for x in u.writes if x < nf)]] += align(r.nbytes)
        if key not in kept and any(x >= nf for x in u.reads + u.writes) and whole[unit_of[fw[0]]] \
                and all(unit_of[x] == unit_of[fw[0]] for x in fw):
            drop[unit_of[fw[0]]] += align(r.nbytes)
    ckpt = [align(uses[k][0].nbytes) if k in uses and any(x >= nf for x in uses[k][1].reads) else 0
            for _, k in arts]
    return cuts, drop, ckpt, written


def _droppable(seg, forward, uses, nf, persistent_ids, seg_of) -> set:
    mine = set(seg.cheap)
    kept = set().union(*(kept_scratch(forward[k].node) for k in seg.cheap))
    out = set()
    for k in seg.cheap:
        for r, w in op_tensors(forward[k]):
            key = id(r)
            if not w or key in persistent_ids or key in kept or key in out:
                continue
            u = uses[key][1]
            if any(x >= nf for x in u.reads + u.writes) and all(x in mine for x in u.writes if x < nf) \
                    and all(seg_of[x] == seg.index for x in u.reads if x < nf):
                out.add(key)
    return out


def _replayed(seg, forward, drop, keep=frozenset()) -> list:
    """The segment's operators a replay runs: those writing what is dropped, and, in turn, those
    writing what they read (but what ``keep`` holds: its final value is there)."""
    need, out = set(drop), []
    for k in reversed(seg.cheap):
        if any(w and id(r) in need for r, w in op_tensors(forward[k])):
            out.append(k)
            need.update(id(r) for r, _ in op_tensors(forward[k], ("reads",)) if id(r) not in keep)
    return out[::-1]


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
