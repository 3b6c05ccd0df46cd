"""The planner: one iteration's schedule for a memory mode, simulated without compute.

Modes combine the techniques of SuperNeurons:

- ``none``       every tensor allocated once, as Caffe does
- ``liveness``   a tensor lives from its first use to its last
- ``offload``    liveness, and tensors backward needs are copied to host after
                 forward produces them, released, and prefetched before backward
- ``recompute``  liveness, and what cheap layers produce is dropped after
                 forward and replayed from the segment's checkpoint in backward;
                 where that does not fit, whole segments of the net (convolutions
                 included) between checkpoints are, the least recomputation that fits
- ``all``        recompute and offload together (checkpoints go to host)

Given a capacity, offloaded tensors stay cached on the device while they fit
(LRU eviction), and ``auto`` picks the cheapest mode whose plan fits.

A plan is made by passes that return data (passes.py: liveness, host parameters,
recomputation, need times, offload), walked by the builder (builder.py), which
replays the iteration on that data and writes the schedule the executor replays;
what depends on what is resident at each step is decided during the walk by one
policy module each: the LRU cache (cache.py), the tier of each offloaded copy
(tiers.py: host, or disk where the host is full), block placement on the
device's allocator (placement.py), workspaces whole or in chunks (chunks.py). Parameters kept on the host
(``host_params``) go, with their gradients and the solver's history, to the disk tier
where the host pool cannot hold them (``param_disk``): the spill file's base.
"""
from __future__ import annotations

import logging
from dataclasses import replace

from . import passes
from .builder import Builder, paused_gc
from .liveness import locations
from .result import MemoryExhausted, Plan, PlanError, layer_flops  # noqa: F401  (the planner's API)
from ..sizes import ALIGNMENT, align, fmt_bytes

MODES = ("none", "liveness", "offload", "recompute", "all")
# Cheapest first: what ``auto`` tries in order.
AUTO_ORDER = ("none", "liveness", "recompute", "offload", "all")
# ``auto``'s steps, (mode, granularity: None lets ``recompute`` replay whole segments where
# replaying the cheap layers does not fit). Whole segments come before copies: on the CPU,
# copies to the disk tier take the cores and the memory bandwidth the compute needs
# (tools/bench_gemm_bound.py --memory on ResNet-2500: whole segments were the faster).
AUTO_STEPS = tuple((mode, None) for mode in AUTO_ORDER)


def advice(graph, capacity, reserve=0) -> str:
    """Which memory mode fits ``capacity``, or how much memory the leanest plan needs."""
    peaks = {}
    for mode in AUTO_ORDER:
        plan = make_plan(graph, mode, capacity, reserve)
        peaks[mode] = plan.peak
        if plan.fits:
            return f"memory mode '{mode}' fits ({fmt_bytes(plan.peak)})"
    lean = min(peaks, key=peaks.get)
    if peaks[lean] <= capacity:
        return (f"the leanest plan ('{lean}', {fmt_bytes(peaks[lean])}) cannot be placed in "
                f"{fmt_bytes(capacity)} because free memory is fragmented: give the device a little more")
    return (f"no memory mode fits; the leanest ('{lean}') needs {fmt_bytes(peaks[lean])}: "
            f"give the device at least that much (--device-memory) or use a smaller batch")


def check_fits(graph, plan, capacity, reserve=0) -> None:
    """Refuse, before anything runs, a plan whose peak exceeds the (default) device, or whose
    host tier exceeds the host pool or, with the device, the RAM both share."""
    if plan.disk_peak and plan.disk_capacity is not None and plan.disk_peak > plan.disk_capacity:
        raise MemoryExhausted(
            f"memory mode '{plan.mode}' needs {fmt_bytes(plan.disk_peak)} on disk for what the host cannot hold, "
            f"but the spill directory's disk has {fmt_bytes(plan.disk_capacity)} to give (--spill DIR: "
            f"a directory with more room), or use a smaller batch")
    if not plan.host_fits:
        room = plan.host_capacity if plan.host_capacity is not None else plan.ram
        where = (f"the host pool has {fmt_bytes(plan.host_capacity)}"
                 if plan.host_capacity is not None and plan.host_peak > plan.host_capacity else
                 f"with the device's {fmt_bytes(plan.peak)} that is over the {fmt_bytes(plan.ram)} of RAM "
                 f"this machine has available (less a margin)")
        raise MemoryExhausted(
            f"memory mode '{plan.mode}' needs {fmt_bytes(plan.host_peak)} of host memory but {where} "
            f"({fmt_bytes(room or 0)}); use a smaller batch, or give --host-memory/--device-memory "
            f"where the machine has more")
    if plan.peaks.get("", plan.peak) <= capacity and not plan.overflow:
        return
    if plan.peak <= capacity:
        raise MemoryExhausted(f"memory mode '{plan.mode}' cannot place every tensor in {fmt_bytes(capacity)} "
                              f"(fragmentation) {plan.overflow}; {advice(graph, capacity, reserve)}")
    t = plan.timeline
    i = max(range(len(t.device)), key=t.device.__getitem__)
    step = next((name for at, name in reversed(t.steps) if at <= i), "the start")
    raise MemoryExhausted(
        f"memory mode '{plan.mode}' needs {fmt_bytes(plan.peak)} but the device has {fmt_bytes(capacity)} free "
        f"({fmt_bytes(plan.peak - capacity)} short) at step {step}, {t.labels[i]}; {advice(graph, capacity, reserve)}")


@paused_gc()
def make_plan(graph, mode="none", capacity=None, extra_bytes=0, **kw) -> Plan:
    """``mode``'s plan under ``capacity`` (see ``plan_at``), placed on the pool's allocator.

    Best fit is not monotone in the arena's size: a plan whose blocks all fit an arena of its
    peak may fragment in a larger one. Where the blocks cannot be placed in ``capacity`` but the
    peak is within it, the plan is made again for smaller arenas between its peak and
    ``capacity``; the first that places every block is kept, with ``arena`` set to it: the
    device's pool is held to that arena when the net binds (Net.place), so the run places every
    block where the plan did. Only for a pool that holds nothing before the net (``before``)."""
    plan = plan_at(graph, mode, capacity, extra_bytes, **kw)
    if capacity is None and mode in ("none", "liveness", "offload"):
        graph.__dict__[_free_peak_key(mode, extra_bytes, kw)] = (plan.peak, plan.host_peak)
    if not plan.overflow or capacity is None or kw.get("before") or plan.peak > capacity:
        return plan
    kw.pop("built", None)
    low = plan.peak
    for arena in dict.fromkeys([capacity - (capacity - low) * k // 4 for k in (1, 2, 3)] + [low]):
        tight = plan_at(graph, mode, arena, extra_bytes, **kw)
        if not tight.overflow and tight.peak <= arena:
            tight.capacity, tight.arena = capacity, arena // ALIGNMENT * ALIGNMENT
            return tight
    return plan


def _free_peak_key(mode, extra_bytes, kw):
    """Where the (device, host) peaks of a plan without a capacity are kept on the graph: a later
    plan of the same walk reuses them (auto's disk tier, and ``sncaffe plan``'s table before it).
    The RAM and the host pool's size are left out of the key: without a capacity they change
    what fits, not the walk (modes that weigh recomputation against fits are not kept), and so
    is a granularity left to the planner (``None``, what a table's plan has)."""
    given = tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in kw.items()
                         if k not in ("built", "host_capacity", "ram", "spill")
                         and not (k == "granularity" and v is None)))
    return ("_free_peak", mode, extra_bytes if isinstance(extra_bytes, int) else tuple(extra_bytes), given)


def plan_at(graph, mode="none", capacity=None, extra_bytes=0, lookahead=2, min_gap=3,
            host_params=False, cost_aware=True, built=None, host_capacity=None, ram=None,
            host_extra=0, before=(), spill=None, host_room=None, memory_centric=None,
            forward_only=False, param_disk=False, disk_extra=0, granularity=None, keep=None) -> Plan:
    """``host_params``: parameters and their gradients live in host memory and each layer's are
    brought in for its forward and backward (the solver then updates them on the host).
    ``cost_aware``: recomputation is used only where it lowers the plan's cost.
    ``built``: plans already made with the same arguments, by mode (auto's), reused.
    ``before``: pool blocks allocated before this net's persistent tensors (the nets placed
    earlier, see joint.py); ``extra_bytes`` (an int or blocks) come after them.
    ``host_room``: host pool bytes offloaded copies may take (with what is there already);
    what does not fit goes to the disk tier, whose room is ``spill`` bytes.
    ``memory_centric``: True replays every recomputed segment from its checkpoint for each
    backward step that needs it (SuperNeurons' memory-centric strategy) instead of once,
    keeping the results (speed-centric); None tries it per segment (those with at least 3
    dropped tensors) where a capacity-bound plan does not fit (by at most a quarter), and keeps
    it if it costs less. ``forward_only``: a net that only runs forward (a solver's test net):
    each value lives until its last forward use, and with nothing needed after forward, no
    mode offloads or recomputes (the plan of ``liveness`` under the mode's name).
    ``param_disk``: with ``host_params``, the parameters, their gradients and the solver's
    history (``host_extra``'s blocks but its last two, the solver's work buffers) live in the
    spill file, not the host pool (the host cannot hold them): the disk tier's base.
    ``disk_extra``: spill-file bytes held beside this net (another net's parameters there).
    ``granularity`` (``recompute``): 0 recomputes per layer; k > 0 in segments of whole units
    of up to k times the largest unit's bytes (passes.coarse_segments); None: per layer, or
    where that does not fit ``capacity``, the finest segments that fit (see ``coarse``).
    ``keep`` (with a granularity): the best ``keep`` layer chains of ``passes.chains`` hold their
    values from forward to backward and are not replayed; None: as many as the capacity leaves
    room for (``with_kept``), 0 none."""
    if mode not in MODES:
        raise PlanError(f"unknown memory mode {mode!r} (one of {', '.join(MODES)}, auto)")
    kw = dict(lookahead=lookahead, min_gap=min_gap, host_params=host_params, host_capacity=host_capacity,
              ram=ram, host_extra=host_extra, before=before, spill=spill, host_room=host_room,
              param_disk=param_disk, disk_extra=disk_extra)
    if mode == "recompute" and granularity:
        def build(n):
            return Builder(graph, mode, capacity, extra_bytes, lookahead, min_gap, host_params,
                           (host_capacity, ram, host_extra, spill, host_room), before, param_disk=param_disk,
                           disk_extra=disk_extra, granularity=granularity, keep=n).build()
        if keep is not None or forward_only or host_params:
            return build(keep or 0)
        limit = min((x for x in (capacity, ram) if x is not None), default=None)
        return with_kept(graph, granularity, build, limit, _coarse_floor(graph, granularity, extra_bytes, before))

    def build(g):
        return plan_at(graph, mode, capacity, extra_bytes, granularity=g, **kw)
    first = None
    if mode == "recompute" and granularity is None and capacity is not None and not forward_only \
            and not host_params and quick_bound(graph, mode, extra_bytes, per_layer=True) > capacity:
        # per layer cannot fit (the bound is of its peak at any capacity): whole segments straight away
        first = plan = build(GRANULARITIES[0])
        plan.note = f"recomputation in segments of up to {GRANULARITIES[0]}x the largest unit"
    else:
        plan = _per_layer(graph, mode, capacity, extra_bytes, cost_aware, built, memory_centric, forward_only,
                          **kw)
    if mode != "recompute" or granularity is not None or capacity is None or forward_only or plan.fits \
            or plan.lower_bound > capacity:         # what always lives, and one step, already do not fit
        return plan
    base = plan.persistent_bytes + plan.extra_bytes

    def floor(g):                       # one location: a bound that spares building hopeless plans
        return base + passes.coarse_floor(graph, g) if len(plan.peaks) == 1 else 0
    return coarse(plan, build, floor, capacity, first)


# Segment sizes tried, in multiples of the largest unit's bytes: finest (least recomputed) first.
GRANULARITIES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)


def with_kept(graph, granularity, build, limit, floor=None):
    """The plan at ``granularity`` (``build(n)``: with the best ``n`` layer chains kept) with the
    chains kept that the room under ``limit`` holds (``passes.chains``: the most replayed FLOPs
    spared per byte held): the least recomputation that fits. A kept value adds at most its
    bytes to any step, so the chains whose bytes fit the room above the plan without them are
    planned; that plan's peak is first taken as ``floor`` (a lower bound, ``passes.coarse_floor``,
    which spares building it where the chains' plan fits). Where that does not fit, the plan
    without chains is built and the room taken above its peak; fewer chains, by what a plan
    overshot, twice at most; then the plan without them. A plan that leaves much of its room
    unused keeps more, once (``more``)."""
    if limit is None:
        return build(0)
    sizes = [size for _, size, _ in passes.chains(graph, granularity)]

    def more(kept, n):
        """A plan that fits with more than an eighth of its room left (kept values often cost
        less than their bytes: they end before the peak) keeps more chains, once."""
        left = limit - kept.peak
        if n < len(sizes) and left * 8 > limit - (kept.peak - sum(sizes[:n])):
            wider = build(_within(sizes, sum(sizes[:n]) + left * 15 // 16))
            if wider.fits and wider.recompute_flops < kept.recompute_flops:
                return wider
        return kept
    n = _within(sizes, (limit - floor) * 15 // 16) if floor is not None else 0
    if n:
        kept = build(n)
        if kept.fits:
            return more(kept, n)
    whole = build(0)
    if not whole.fits:
        return whole
    n = _within(sizes, (limit - whole.peak) * 15 // 16)
    for _ in range(2):
        if not n:
            break
        kept = build(n)
        if kept.fits:
            return more(kept, n)
        # over the limit: fewer chains by what it overshot; within it but fragmented: fewer
        n = min(_within(sizes, (limit - whole.peak) * 7 // 8 - (kept.peak - limit)), n * 7 // 8)
    return whole


def _coarse_floor(graph, granularity, extra_bytes, before):
    """A lower bound of the peak of the plan at ``granularity`` with no chains kept (one location:
    else None): what always lives, the blocks beside the net, ``passes.coarse_floor``."""
    ops = graph.forward_ops + graph.backward_ops
    if len(locations(graph, ops)) != 1:
        return None
    extra = [extra_bytes] if isinstance(extra_bytes, int) else list(extra_bytes)
    always = sum(r.block_bytes for r in passes.liveness(graph, ops, "recompute")[0])
    return always + sum(align(b) for b in extra + list(before) if b) + passes.coarse_floor(graph, granularity)


def _within(sizes, room):
    """How many of ``sizes``, from the first, sum within ``room``."""
    total = n = 0
    for size in sizes:
        if total + size > room:
            break
        total, n = total + size, n + 1
    return n


def coarse(per_layer, build, floor, capacity, first=None):
    """The first coarse plan that fits, finest first: each replays every operator of its
    segments once, so a finer one recomputes no more (its checkpoints' operators are not
    replayed) and holds fewer values at each replay. None fits: the lowest peak among them.
    A granularity whose ``floor`` (a lower bound of its peak) is over ``capacity`` is not built;
    ``first``: the plan of the finest, built already (``per_layer`` is then that plan)."""
    best, worse = per_layer, 0
    for g in GRANULARITIES:
        if floor(g) > capacity:
            continue
        plan = first if g == GRANULARITIES[0] and first is not None else build(g)
        plan.note = f"recomputation in segments of up to {g}x the largest unit"
        if plan.fits:
            return plan
        if (not plan.device_fits, plan.peak) < (not best.device_fits, best.peak):
            best, worse = plan, 0
        else:
            worse += 1
            if worse == 3:          # past the size where checkpoints and a segment's values balance
                break
    return best


def _per_layer(graph, mode, capacity, extra_bytes, cost_aware, built, memory_centric, forward_only, lookahead,
               min_gap, host_params, host_capacity, ram, host_extra, before, spill, host_room, param_disk,
               disk_extra):
    args = (capacity, extra_bytes, lookahead, min_gap, host_params,
            (host_capacity, ram, host_extra, spill, host_room), before)
    plan = Builder(graph, mode, *args, memory_centric=bool(memory_centric), forward_only=forward_only,
                   param_disk=param_disk, disk_extra=disk_extra).build()
    if forward_only:
        return plan
    # (Tried only near a fit: it trades replays for a few segments' values, not for multiples.)
    if mode in ("recompute", "all") and memory_centric is None and capacity is not None and not plan.fits \
            and plan.peak <= capacity * 5 // 4:
        lean = Builder(graph, mode, *args, memory_centric="some", param_disk=param_disk,
                       disk_extra=disk_extra).build()
        if lean.memory_centric and _cost(lean) < _cost(plan):
            lean.note = f"memory-centric recomputation in {lean.memory_centric} segments"
            plan = lean
    if mode in ("recompute", "all") and cost_aware:
        # Cost-aware: recomputation keeps a segment's checkpoint alive until its replay, which
        # on some nets costs more than it saves; then the plan without it is the better one.
        other = {"recompute": "liveness", "all": "offload"}[mode]
        alt = (built or {}).get(other)
        if alt is None and quick_bound(graph, other, extra_bytes, host_params) > plan.peak:
            return plan                 # the plan without recomputation cannot have a lower peak
        alt = alt or Builder(graph, other, *args, param_disk=param_disk, disk_extra=disk_extra).build()
        if _cost(alt) < _cost(plan):
            alt = replace(alt, mode=mode, note="recomputation would not lower the peak: not used")
            return alt
    return plan


def quick_bound(graph, mode, extra_bytes=0, host_params=False, per_layer=False) -> int:
    """A lower bound of ``mode``'s peak at any capacity, without building its plan: for
    ``none`` every tensor at once, for ``liveness`` the most bytes whose lives overlap (its
    workspaces left out: a plan under a capacity may chunk them), for ``recompute`` the same
    with each value recomputation drops counted only in forward and at the backward steps
    that use it, and each checkpoint copy from its copy to its segment's first replay, or
    less where whole segments replayed may hold less (``passes.coarse_floor``; ``per_layer``:
    the bound of per-layer recomputation alone); 0 for the others."""
    if mode not in ("none", "liveness", "recompute") or host_params:
        return 0
    extra = extra_bytes if isinstance(extra_bytes, int) else sum(align(b) for b in extra_bytes if b)
    key = ("_quick_bound", mode)
    if key not in graph.__dict__:
        ops = graph.forward_ops + graph.backward_ops
        roots, uses = passes.liveness(graph, ops, "liveness")
        always = sum(r.block_bytes for r in roots)
        if mode == "none":
            bound = always + sum(r.block_bytes for r, _ in uses.values())
        else:
            nf = len(graph.forward_ops)
            rc = passes.recompute(ops[:nf], ops, uses, {id(r) for r in roots}, False) \
                if mode == "recompute" else passes.Recompute([], {}, {})
            dropped = rc.dropped
            delta = [0] * (len(ops) + 1)
            copied = {id(c): at for at, snaps in rc.snap_at.items() for _, c in snaps}
            for seg in rc.segs:
                for _, c in seg.snapshots if seg.needed_by else ():
                    delta[copied[id(c)]] += c.block_bytes
                    delta[seg.needed_by[0] + 1] -= c.block_bytes
            for k, (r, u) in uses.items():
                steps = u.reads + u.writes
                lives = [(min(steps), max(steps))]
                if k in dropped:    # freed after forward, and in backward perhaps between any two uses
                    fwd = [s for s in steps if s < nf]
                    lives = [(min(fwd), max(fwd))] * bool(fwd) + [(s, s) for s in set(steps) if s >= nf]
                for a, b in lives:
                    delta[a] += r.block_bytes
                    delta[b + 1] -= r.block_bytes
            live = most = 0
            for d in delta:
                live += d
                most = max(most, live)
            bound = always + most
        coarse_bound = bound
        if mode == "recompute":         # or whole segments replayed, where per layer does not fit
            coarse_bound = min(bound, always + min(passes.coarse_floor(graph, g) for g in GRANULARITIES)
                               if len(locations(graph, ops)) == 1 else 0)
        graph.__dict__[key] = (coarse_bound, bound)
    return graph.__dict__[key][per_layer] + extra


def _cost(plan):
    return (not plan.fits, plan.peak, plan.d2h_bytes + plan.h2d_bytes)


@paused_gc()
def auto_plan(graph, capacity, extra_bytes=0, **kw) -> Plan:
    """The cheapest mode whose plan fits ``capacity`` (and the host tier, ``host_capacity`` and
    ``ram``); then ``all`` with parameters on the host. Modes that cannot fit by a cheap bound
    are not planned (ResNet-2500: a plan takes seconds)."""
    built, plan = {}, None
    limit = min(x for x in (capacity, kw.get("ram"), 1 << 62) if x is not None)
    for mode, granularity in AUTO_STEPS:
        if quick_bound(graph, mode, extra_bytes, kw.get("host_params"), per_layer=granularity == 0) > limit:
            continue
        _progress(graph, f"planning memory: trying mode '{mode}'")
        plan = shared_ram_plan(graph, mode, capacity, extra_bytes, built=built, granularity=granularity, **kw)
        built.setdefault(mode, plan)
        if plan.fits:
            return plan
    if not kw.get("host_params"):
        _progress(graph, "planning memory: trying mode 'all' with parameters on the host")
        kw["host_params"] = True
        kw["host_extra"] = extra_bytes          # the solver's history goes to the host with them
        return shared_ram_plan(graph, "all", capacity, 0, **kw)
    return plan if plan is not None else make_plan(graph, "all", capacity, extra_bytes, **kw)


@paused_gc()
def shared_ram_plan(graph, mode, capacity, extra_bytes, **kw):
    """``mode``'s plan, fitted to the host tier where the first plan is not. On one RAM (the
    CPU) what an offloading plan keeps cached on the device is held twice: plan the device
    smaller so the host's peak has room. Where the host still cannot hold what the device
    offloads, and a disk tier is given (``spill``), the device gets what its plan needs, the
    host what RAM has left (or its pool), and the rest goes to the spill file."""
    ram = kw.get("ram")
    if mode == "offload" and capacity is not None and ram is not None and kw.get("spill") is not None \
            and not kw.get("host_params"):
        need, host = _free_peaks(graph, mode, extra_bytes, kw)
        if need + host > ram:       # no cache at all, and still over the RAM: the disk tier at once
            tiered = _tiered(graph, mode, capacity, extra_bytes, kw, need)
            if tiered is not None:
                return tiered
    plan = make_plan(graph, mode, capacity, extra_bytes, **kw)
    if kw.get("host_params") and not kw.get("param_disk") and kw.get("spill") is not None \
            and plan.device_fits and not plan.host_fits:
        # The host cannot hold the parameter state: it goes to the disk tier, read per layer.
        _progress(graph, f"planning memory: mode '{mode}' with the parameters on disk")
        kw = {k: v for k, v in kw.items() if k != "built"}
        return shared_ram_plan(graph, mode, capacity, extra_bytes, **kw, param_disk=True)
    if plan.fits or not plan.device_fits or not plan.d2h_bytes:
        return plan
    kw.pop("built", None)
    ram, host_capacity = kw.get("ram"), kw.get("host_capacity")
    if ram is not None and ram - plan.host_peak > plan.lower_bound:
        smaller = make_plan(graph, mode, min(ram - plan.host_peak, capacity or ram), extra_bytes, **kw)
        if smaller.fits:
            return smaller
    if kw.get("spill") is None:
        return plan
    return _tiered(graph, mode, capacity, extra_bytes, kw, _free_peaks(graph, mode, extra_bytes, kw)[0]) or plan


def _free_peaks(graph, mode, extra_bytes, kw):
    """(device, host) peaks of ``mode``'s plan without a capacity (kept on the graph)."""
    plain = {k: v for k, v in kw.items() if k not in ("spill", "host_room", "param_disk", "built")}
    key = _free_peak_key(mode, extra_bytes, plain)
    if key not in graph.__dict__:
        free = make_plan(graph, mode, None, extra_bytes, **plain)
        graph.__dict__[key] = (free.peak, free.host_peak)
    return graph.__dict__[key]


def _tiered(graph, mode, capacity, extra_bytes, kw, need):
    """The device what its plan without a cache needs (``need``, with a little slack), the host
    what RAM has left (or its pool), the rest to the disk tier; None where the device cannot."""
    _progress(graph, f"planning memory: mode '{mode}' with a disk tier")
    kw = {k: v for k, v in kw.items() if k != "built"}
    ram, host_capacity = kw.get("ram"), kw.get("host_capacity")
    for slack in (1.02, 1.1, 1.3):
        device = int(need * slack) if capacity is None else min(int(need * slack), capacity)
        room = min(x for x in (host_capacity, None if ram is None else ram - device, 1 << 62) if x is not None)
        tiered = make_plan(graph, mode, device, extra_bytes, host_room=room, **kw)
        if tiered.device_fits:
            return tiered
    return None


def _progress(graph, message):
    """A log line for nets whose plans take seconds (thousands of layers)."""
    if len(graph.layers) >= 1000:
        logging.getLogger("sncaffe").info("%s (%d layers)", message, len(graph.layers))
