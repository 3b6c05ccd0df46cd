"""The planner: one iteration's schedule for a memory mode, simulated without compute.

Modes combine the techniques of SuperNeurons:

- ``none``       every tensor allocated once, as Caffe does
- ``liveness``   a tensor lives from its first use to its last
- ``offload``    liveness, and tensors backward needs are copied to host after
                 forward produces them, released, and prefetched before backward
- ``recompute``  liveness, and what cheap layers produce is dropped after
                 forward and replayed from the segment's checkpoint in backward
- ``all``        recompute and offload together (checkpoints go to host)

Given a capacity, offloaded tensors stay cached on the device while they fit
(LRU eviction), and ``auto`` picks the cheapest mode whose plan fits.

The analysis is a walk over passes (passes.py: liveness, host parameters,
recomputation, need times, offload) that return data; the builder then replays
the iteration, placing every block on the device's allocator, each offloaded
copy on a tier (host, or disk where the host is full) and each workspace whole
or in chunks, and writes the schedule the executor replays. Parameters kept on the host
(``host_params``) go, with their gradients and the solver's history, to the disk tier
where the host pool cannot hold them (``param_disk``): the spill file's base.
"""
from __future__ import annotations

import bisect
from collections import OrderedDict
from dataclasses import dataclass, field, replace

import numpy as np

from ..graph import _workspace
from . import passes
from .liveness import op_tensors, persistent_roots, workspaces
from .pool import OutOfMemory, Pool, align
from .schedule import Instr, Schedule, simulate

MODES = ("none", "liveness", "offload", "recompute", "all")
# Cheapest first: what ``auto`` tries in order.
AUTO_ORDER = ("none", "liveness", "recompute", "offload", "all")


class PlanError(ValueError):
    pass


class MemoryExhausted(MemoryError):
    """A plan or a step that does not fit the device, with what would fit."""


def advice(graph, capacity, reserve=0) -> str:
    """Which memory mode fits ``capacity``, or how much memory the leanest plan needs."""
    from .pool import fmt_bytes
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
    from .pool import fmt_bytes
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


@dataclass
class Plan:
    mode: str
    schedule: Schedule
    persistent: list                  # roots allocated at bind time
    persistent_bytes: int
    extra_bytes: int                  # pool bytes held outside the graph (solver history)
    capacity: int | None
    overflow: str = ""                # the first allocation a capacity-bound plan could not place
    note: str = ""
    peak: int = 0
    host_peak: int = 0
    lower_bound: int = 0
    lower_bound_step: str = ""
    d2h_bytes: int = 0
    h2d_bytes: int = 0
    recompute_flops: int = 0
    recomputed_ops: int = 0
    memory_centric: int = 0           # segments replayed memory-centric (from the checkpoint for each need)
    cache_hits: int = 0
    cache_misses: int = 0
    chunk_trials: int = 0             # workspace sizes tried while choosing chunks (bounded by log batch)
    offloaded: list = field(default_factory=list)
    dropped: list = field(default_factory=list)
    host_params: list = field(default_factory=list)   # roots kept on the host, brought in per step
    host_capacity: int | None = None  # the host pool's free bytes
    ram: int | None = None            # device and host pools on one RAM (the CPU): their peaks together
    host_extra: int = 0               # host bytes held beside the net (the solver's history there)
    disk_peak: int = 0                # the spill file's peak (offloads the host pool could not hold)
    disk_capacity: int | None = None  # the room on the spill file's disk (None: no disk tier)
    param_disk: bool = False          # host_params, and their state (with the history) in the spill file
    disk_base: int = 0                # spill-file bytes held across iterations (that state)
    resident: int = 0                 # the process's expected peak resident memory (one RAM), once said
    timeline: object = None           # of the device with the highest peak
    timelines: dict = field(default_factory=dict)     # location -> Timeline
    peaks: dict = field(default_factory=dict)         # location -> peak bytes

    @property
    def fits(self) -> bool:
        return self.device_fits and self.host_fits

    @property
    def device_fits(self) -> bool:
        return self.capacity is None or (self.peak <= self.capacity and not self.overflow)

    @property
    def host_fits(self) -> bool:
        """The host tier within its pool, and on one RAM both tiers together within it."""
        return ((self.host_capacity is None or self.host_peak <= self.host_capacity)
                and (self.ram is None or self.peak + self.host_peak <= self.ram)
                and (not self.disk_peak or self.disk_capacity is None or self.disk_peak <= self.disk_capacity))

    def summary(self) -> dict:
        return dict(mode=self.mode, peak=self.peak, lower_bound=self.lower_bound,
                    d2h_bytes=self.d2h_bytes, h2d_bytes=self.h2d_bytes,
                    recompute_flops=self.recompute_flops, host_peak=self.host_peak,
                    cache_hits=self.cache_hits, cache_misses=self.cache_misses, fits=self.fits)


def layer_flops(node) -> int:
    """Forward FLOPs of a layer: exact for convolutions and inner products, element counts otherwise."""
    top = node.tops[0].shape if node.tops else ()
    out = int(np.prod(top, dtype=np.int64)) if node.tops else 0
    if node.type in ("Convolution", "Deconvolution", "InnerProduct") and node.params:
        w = node.params[0][0].shape
        per_out = int(np.prod(w[1:], dtype=np.int64)) if node.type != "InnerProduct" else \
            int(np.prod(w, dtype=np.int64)) // max(1, top[-1] if top else 1)
        if node.type == "Deconvolution":
            return 2 * int(np.prod(node.bottoms[0].shape, dtype=np.int64)) * int(np.prod(w[1:], dtype=np.int64))
        return 2 * out * per_out
    per = getattr(node.layer, "flops_per_output", None)     # the layer class's own estimate
    return out * (per or {"LRN": 10, "BatchNorm": 6, "Pooling": 9}.get(node.type, 2))


def make_plan(graph, mode="none", capacity=None, extra_bytes=0, lookahead=2, min_gap=3,
              host_params=False, cost_aware=True, built=None, host_capacity=None, ram=None,
              host_extra=0, before=(), spill=None, host_room=None, memory_centric=None,
              forward_only=False, param_disk=False, disk_extra=0) -> Plan:
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
    it if it costs less. ``forward_only``: a net that only runs forward (a solver's test net;
    ``none`` or ``liveness``): what backward would need is released when the pass ends.
    ``param_disk``: with ``host_params``, the parameters, their gradients and the solver's
    history (``host_extra``'s blocks but its last two, the solver's work buffers) live in the
    spill file, not the host pool (the host cannot hold them): the disk tier's base.
    ``disk_extra``: spill-file bytes held beside this net (another net's parameters there)."""
    if forward_only and mode not in ("none", "liveness"):
        raise PlanError(f"a forward-only plan is 'none' or 'liveness', not {mode!r}")
    if mode not in MODES:
        raise PlanError(f"unknown memory mode {mode!r} (one of {', '.join(MODES)}, auto)")
    args = (capacity, extra_bytes, lookahead, min_gap, host_params,
            (host_capacity, ram, host_extra, spill, host_room), before)
    plan = _Builder(graph, mode, *args, memory_centric=bool(memory_centric), forward_only=forward_only,
                    param_disk=param_disk, disk_extra=disk_extra).build()
    # (Tried only near a fit: it trades replays for a few segments' values, not for multiples.)
    if mode in ("recompute", "all") and memory_centric is None and capacity is not None and not plan.fits \
            and plan.peak <= capacity * 5 // 4:
        lean = _Builder(graph, mode, *args, memory_centric="some", param_disk=param_disk,
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
        alt = alt or _Builder(graph, other, *args, param_disk=param_disk, disk_extra=disk_extra).build()
        if _cost(alt) < _cost(plan):
            alt = replace(alt, mode=mode, note="recomputation would not lower the peak: not used")
            return alt
    return plan


def quick_bound(graph, mode, extra_bytes=0, host_params=False) -> int:
    """A lower bound of ``mode``'s peak at any capacity, without building its plan: for
    ``none`` every tensor at once, for ``liveness`` the most bytes whose lives overlap (its
    workspaces left out: a plan under a capacity may chunk them); 0 for the others."""
    if mode not in ("none", "liveness") or host_params:
        return 0
    extra = extra_bytes if isinstance(extra_bytes, int) else sum(align(b) for b in extra_bytes if b)
    key = ("_quick_bound", mode)
    if key not in graph.__dict__:
        ops = graph.forward_ops + graph.backward_ops
        roots, uses = passes.liveness(graph, ops, "liveness")
        always = sum(align(r.nbytes) for r in roots)
        if mode == "none":
            bound = always + sum(align(r.nbytes) for r, _ in uses.values())
        else:
            delta = [0] * (len(ops) + 1)
            for r, u in uses.values():
                steps = u.reads + u.writes
                delta[min(steps)] += align(r.nbytes)
                delta[max(steps) + 1] -= align(r.nbytes)
            live = most = 0
            for d in delta:
                live += d
                most = max(most, live)
            bound = always + most
        graph.__dict__[key] = bound
    return graph.__dict__[key] + extra


def _cost(plan):
    return (not plan.fits, plan.peak, plan.d2h_bytes + plan.h2d_bytes)


def auto_plan(graph, capacity, extra_bytes=0, **kw) -> Plan:
    """The cheapest mode whose plan fits ``capacity`` (and the host tier, ``host_capacity`` and
    ``ram``); then ``all`` with parameters on the host. Modes that cannot fit by a cheap bound
    are not planned (ResNet-2500: a plan takes seconds)."""
    built, plan = {}, None
    limit = min(x for x in (capacity, kw.get("ram"), 1 << 62) if x is not None)
    for mode in AUTO_ORDER:
        if quick_bound(graph, mode, extra_bytes, kw.get("host_params")) > limit:
            continue
        _progress(graph, f"planning memory: trying mode '{mode}'")
        plan = built[mode] = _shared_ram_plan(graph, mode, capacity, extra_bytes, built=built, **kw)
        if plan.fits:
            return plan
    if not kw.get("host_params"):
        _progress(graph, "planning memory: trying mode 'all' with parameters on the host")
        kw["host_params"] = True
        kw["host_extra"] = extra_bytes          # the solver's history goes to the host with them
        return _shared_ram_plan(graph, "all", capacity, 0, **kw)
    return plan if plan is not None else make_plan(graph, "all", capacity, extra_bytes, **kw)


def _shared_ram_plan(graph, mode, capacity, extra_bytes, **kw):
    """``mode``'s plan, fitted to the host tier where the first plan is not. On one RAM (the
    CPU) what an offloading plan keeps cached on the device is held twice: plan the device
    smaller so the host's peak has room. Where the host still cannot hold what the device
    offloads, and a disk tier is given (``spill``), the device gets what its plan needs, the
    host what RAM has left (or its pool), and the rest goes to the spill file."""
    plan = make_plan(graph, mode, capacity, extra_bytes, **kw)
    if kw.get("host_params") and not kw.get("param_disk") and kw.get("spill") is not None \
            and plan.device_fits and not plan.host_fits:
        # The host cannot hold the parameter state: it goes to the disk tier, read per layer.
        _progress(graph, f"planning memory: mode '{mode}' with the parameters on disk")
        kw = {k: v for k, v in kw.items() if k != "built"}
        return _shared_ram_plan(graph, mode, capacity, extra_bytes, **kw, param_disk=True)
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
    _progress(graph, f"planning memory: mode '{mode}' with a disk tier")
    plain = {k: v for k, v in kw.items() if k not in ("spill", "host_room", "param_disk")}
    need = make_plan(graph, mode, None, extra_bytes, **plain).peak     # the device without a cache
    for slack in (1.02, 1.1, 1.3):
        device = int(need * slack) if capacity is None else min(int(need * slack), capacity)
        room = min(x for x in (host_capacity, None if ram is None else ram - device, 1 << 62) if x is not None)
        tiered = make_plan(graph, mode, device, extra_bytes, host_room=room, **kw)
        if tiered.device_fits:
            return tiered
    return plan


def _progress(graph, message):
    """A log line for nets whose plans take seconds (thousands of layers)."""
    if len(graph.layers) >= 1000:
        import logging
        logging.getLogger("sncaffe").info("%s (%d layers)", message, len(graph.layers))


class _Builder:
    def __init__(self, graph, mode, capacity, extra_bytes, lookahead, min_gap, host_params=False,
                 host=(None, None, 0, None, None), before=(), memory_centric=False, forward_only=False,
                 param_disk=False, disk_extra=0):
        self.graph, self.mode, self.capacity = graph, mode, capacity
        self.memory_centric = memory_centric
        self.host_capacity, self.ram, host_extra, self.spill, self.host_room = host
        self.param_disk = bool(param_disk and host_params)
        self.disk_extra = disk_extra    # and the solver's history in the spill file (param_disk)
        if self.param_disk and not isinstance(host_extra, int):
            self.disk_extra += sum(align(max(b, 1)) for b in host_extra[:-2])
            host_extra = host_extra[-2:]
        self.host_extra = host_extra if isinstance(host_extra, int) else sum(align(max(b, 1)) for b in host_extra)
        self.host_params = host_params
        # Blocks others take beside the net (the solver's history), in their allocation order.
        self.extra_blocks = [extra_bytes] if isinstance(extra_bytes, int) else list(extra_bytes)
        self.before_blocks = [b for b in before if b]
        self.extra = sum(align(b) for b in self.extra_blocks + self.before_blocks if b)
        self.lookahead, self.min_gap = lookahead, min_gap
        self.offload = mode in ("offload", "all")
        self.recompute = mode in ("recompute", "all")
        self.F, self.B = graph.forward_ops, [] if forward_only else graph.backward_ops
        self.ops = self.F + self.B
        self.nf = len(self.F)

    # -- bookkeeping ----------------------------------------------------------
    def emit(self, kind, tensor=None, **kw):
        if kind == "alloc":
            self.make_room(tensor)
        if kind == "offload" and self.host_room is not None and id(tensor) not in self.hosted \
                and id(tensor.root) not in self.param_ids:
            kw["tier"] = self.tier_for(tensor)
        ins = Instr(kind, tensor, **kw)
        self.out.append(ins)
        if kind == "alloc":
            self.place(tensor)
            self.in_use[tensor.location] = self.in_use.get(tensor.location, 0) + align(tensor.nbytes)
            if self.pos >= self.nf and tensor.kind != "workspace" and id(tensor) not in self.param_ids:
                last = self.need_times(tensor, -1)
                if not last or last[-1] <= self.pos:
                    self.free_at.setdefault(self.pos, []).append(tensor)   # only this step needs it
                else:
                    self.free_at.setdefault(last[-1], []).append(tensor)
            self.live[id(tensor)] = tensor
        elif kind == "free":
            if id(tensor) in self.placed:
                self.sims[tensor.location].free(self.placed.pop(id(tensor)))
            self.in_use[tensor.location] -= align(tensor.nbytes)
            self.live.pop(id(tensor), None)
            self.cache.pop(id(tensor), None)
        elif kind == "offload":
            self.hosted[id(tensor)] = tensor
            self.plan.d2h_bytes += tensor.nbytes
        elif kind == "prefetch":
            self.plan.h2d_bytes += tensor.nbytes
        elif kind == "drop":
            self.hosted.pop(id(tensor), None)
            if self.tiers.pop(id(tensor), "disk") == "host":
                self.host_used -= align(tensor.nbytes)
        return ins

    def tier_for(self, tensor):
        """The host pool while it has room, else the disk: the host tier is planned as it fills."""
        n = align(tensor.nbytes)
        if self.host_used + n <= self.host_room:
            self.host_used += n
            self.tiers[id(tensor)] = "host"
            return "host"
        self.tiers[id(tensor)] = "disk"
        return "disk"

    def place(self, tensor):
        """Where the pool will put ``tensor``: the planner runs the device's own allocator, so a
        plan that fits here is placed alike at run time (fragmentation included)."""
        sim = self.sims.get(tensor.location)
        if sim is None:
            return
        try:
            self.placed[id(tensor)] = sim.alloc(tensor.nbytes, tensor.name)
        except OutOfMemory as e:
            if not self.plan.overflow:
                step = self.ops[self.pos].name if self.pos >= 0 else "the start"
                self.plan.overflow = f"at step {step}: {e}"

    def fits_now(self, sizes, loc="") -> bool:
        if self.capacity is None:
            return True
        sim = self.sims.get(loc)
        if sim is None:
            return self.in_use.get(loc, 0) + sum(align(n) for n in sizes) <= self.capacity
        return sim.can_place(sizes)         # a trial on the allocator, undone at once

    def make_room(self, tensor=None, sizes=None, loc=None):
        """LRU: evict cached copies until ``tensor`` (or blocks of ``sizes``) can be placed."""
        loc = tensor.location if loc is None else loc
        sizes = [tensor.nbytes] if sizes is None else sizes
        while self.cache and not self.fits_now(sizes, loc):     # no trial while nothing is cached
            victim = next((t for t in self.cache.values() if t.location == loc), None)
            if victim is None:
                return
            del self.cache[id(victim)]
            self.emit("free", victim)

    def alloc(self, r, fill=None):
        if id(r) not in self.live:
            self.emit("alloc", r, fill=fill)

    def run(self, i, recompute=False):
        op = self.ops[i]
        ws, chunk = workspaces(op), None
        loc = op.node.layer.param.location
        if self.capacity is not None and ws and not self.fits_now([t.nbytes for t in ws], loc):
            self.make_room(sizes=[t.nbytes for t in ws], loc=loc)
            if not self.fits_now([t.nbytes for t in ws], loc):
                chunk, ws = self.chunked(op) or (None, ws)
        for t in ws:
            self.emit("alloc", t)
        self.out.append(Instr("run", op=op, recompute=recompute, chunk=chunk,
                              workspace={t.name.split("#", 1)[1]: t for t in ws} if chunk else None))
        for t in ws:
            self.emit("free", t)
        if recompute:
            self.plan.recompute_flops += layer_flops(op.node)
            self.plan.recomputed_ops += 1

    # -- analysis ---------------------------------------------------------------
    def analyze(self):
        """The passes (passes.py), walked in order; their data is what the replay below uses."""
        g = self.graph
        roots, self.uses = passes.liveness(g, self.ops, self.mode)
        self.persistent_ids = {id(r) for r in roots}     # never scheduled as activations
        self.param_ids, self.param_ops = {}, {}
        if self.host_params:
            self.param_ids, self.param_ops, roots = passes.host_params(g, self.ops, roots)
            self.plan.host_params = list(self.param_ids.values())
        self.persistent = roots
        rc = passes.recompute(self.F, self.ops, self.uses, self.persistent_ids, self.offload) if self.recompute \
            else passes.Recompute([], {}, {})
        self.segs, self.dropped, self.snap_at = rc.segs, rc.dropped, rc.snap_at
        self.plan.dropped = [r.name for seg in self.segs for r in seg.dropped]
        # Memory-centric segments: replayed for each step that needs them.
        self.mc = {seg.index for seg in self.segs if seg.dropped and (
            self.memory_centric is True or (self.memory_centric == "some" and len(seg.dropped) >= 3))}
        self.plan.memory_centric = len(self.mc)
        self.mc_free, self.mc_open = [], []
        self.times, self.fwd_last = passes.need_times(g, self.uses, self.nf, rc, self.mc)
        self.offloaded, self.to_bring = {}, []
        if self.offload:
            self.offloaded, self.to_bring = passes.offload(self.uses, self.dropped, self.times, self.nf, self.min_gap)
            self.plan.offloaded = [r.name for r in self.offloaded.values()]
        self.free_at = {}

    def need_times(self, r, after):
        """Op indices after ``after`` where ``r`` must be on the device (replays of segments
        that read it included: a segment is replayed at its first need, speed-centric)."""
        t = self.times.get(id(r), [])
        return t[bisect.bisect_right(t, after):]
    # -- building ---------------------------------------------------------------
    def build(self) -> Plan:
        self.plan = Plan(self.mode, Schedule(), [], 0, self.extra, self.capacity, host_capacity=self.host_capacity,
                         ram=self.ram, host_extra=self.host_extra, disk_capacity=self.spill,
                         param_disk=self.param_disk)
        self.analyze()
        plan = self.plan
        plan.persistent = self.persistent
        plan.persistent_bytes = sum(align(r.nbytes) for r in self.persistent)
        self.base = {"": self.extra}          # bytes each location holds before the iteration
        for op in self.ops:
            for t in op.reads + op.writes:
                self.base.setdefault(t.location, 0)
        for r in self.persistent:
            self.base[r.location] = self.base.get(r.location, 0) + align(r.nbytes)
        self.in_use = dict(self.base)
        self.live, self.hosted, self.cache = {}, {}, OrderedDict()
        self.tiers = {}                      # id(value) -> "host" or "disk", for offloads placed by tier
        self.host_used = plan.host_extra + (0 if self.param_disk else sum(align(r.nbytes) for r in plan.host_params))
        self.sims, self.placed = {}, {}
        if self.capacity is not None:
            for loc in self.base:
                sim = self.sims[loc] = Pool(self.capacity)
                try:
                    for b in self.before_blocks if loc == "" else ():
                        sim.alloc(b)
                    for r in self.persistent:   # in the order the net binds them
                        if r.location == loc:
                            sim.alloc(r.nbytes)
                    for b in self.extra_blocks if loc == "" else ():
                        if b:
                            sim.alloc(b)
                except OutOfMemory as e:
                    plan.overflow = f"at the start: {e}"
                    del self.sims[loc]
        self.pos = -1
        self.out = plan.schedule.forward
        for i in range(self.nf):
            self.pos = i
            self.forward_step(i)
        for r in self.live.values():            # what forward leaves for backward
            t = self.need_times(r, self.nf - 1)
            if t:
                self.free_at.setdefault(t[-1], []).append(r)
        self.out = plan.schedule.backward
        for j in range(self.nf, len(self.ops)):
            self.pos = j
            self.backward_step(j)
        homes = {}
        for r in plan.host_params:
            homes[r.location] = homes.get(r.location, 0) + align(max(r.nbytes, 1))
        disk_homes = homes if self.param_disk else {}
        homes = {} if self.param_disk else homes
        plan.disk_base = disk_homes.get("", 0) + self.disk_extra
        plan.timelines = {loc: simulate(plan.schedule, base, loc,
                                        homes.get(loc, 0) + (plan.host_extra if loc == "" else 0), plan.host_params,
                                        disk_homes.get(loc, 0) + (self.disk_extra if loc == "" else 0))
                          for loc, base in self.base.items()}
        plan.peaks = {loc: t.peak for loc, t in plan.timelines.items()}
        main = "" if len(self.base) == 1 else max(plan.peaks, key=plan.peaks.get)
        plan.timeline = plan.timelines[main]
        plan.peak, plan.host_peak = plan.timeline.peak, plan.timeline.host_peak
        plan.disk_peak = max(t.disk_peak for t in plan.timelines.values())
        plan.lower_bound, plan.lower_bound_step = self.lower_bound()
        return plan

    def forward_step(self, i):
        op = self.F[i]
        for r, ckpt in self.snap_at.get(i, []):
            if self.offload:
                self.emit("offload", ckpt, source=r)
            else:
                self.emit("alloc", ckpt)
                self.out.append(Instr("snapshot", r, source=ckpt))
        self.bring_params(i, self.nf)
        for r, write in op_tensors(op):
            if id(r) in self.persistent_ids:
                continue
            self.alloc(r, fill=None if write else 0.0)
        self.run(i)
        self.return_params(i, self.nf)
        for r, write in op_tensors(op):
            key = id(r)
            if key in self.persistent_ids:
                continue
            last_write, last_use = self.fwd_last[key]
            if key in self.offloaded and last_write == i:
                self.emit("offload", r)
            if last_use != i:
                continue
            if not self.need_times(r, self.nf - 1):
                self.emit("free", r)                  # liveness: dead after forward
            elif key in self.dropped:
                self.emit("free", r)                  # recomputed in backward
            elif key in self.offloaded:
                if self.capacity is not None:    # (offload modes only reach here)
                    self.cache[key] = r               # kept while it fits (LRU)
                else:
                    self.emit("free", r)

    def backward_step(self, j):
        op = self.ops[j]
        # Prefetch what the next few operators need, so the copy hides behind compute.
        while self.to_bring and self.to_bring[0][0] <= j + self.lookahead:
            self.bring(self.to_bring.pop(0)[2])
        self.bring_params(j, len(self.ops))
        for r, write in op_tensors(op):
            if id(r) in self.persistent_ids:
                continue
            self.ensure(r, write)
        self.run(j)
        self.return_params(j, len(self.ops))
        for t in self.mc_free:          # memory-centric replays: recomputed again where needed again
            if id(t) in self.live:
                self.emit("free", t)
        self.mc_free = []
        for seg in list(self.mc_open):
            if not any(self.need_times(r, j) for r in seg.dropped):
                self.mc_open.remove(seg)
                self.drop_snapshots(seg)
        self.release(j)

    def chunked(self, op):
        """The largest batch chunk whose workspace fits now: (chunk, workspace tensors). A
        workspace grows with the chunk, so the chunk is found by bisection: O(log batch) trials,
        whatever the batch (a batch of a million is 20 trials, not a million)."""
        node = op.node
        n = node.bottoms[0].shape[0] if node.bottoms and node.bottoms[0].shape else 0
        loc = node.layer.param.location
        sizes = node.layer.chunk_sizes(n)     # the layer's (a convolution's: its reduction blocks)
        lo, hi, best = 0, len(sizes) - 1, None
        while lo <= hi:
            mid = (lo + hi) // 2
            ws = self.chunk_workspace(node, sizes[mid], op.writes[0].dtype)
            if ws is None:
                return None             # the layer cannot work in chunks
            self.plan.chunk_trials += 1
            if self.fits_now([t.nbytes for t in ws], loc):
                best, lo = (sizes[mid], ws), mid + 1
            else:
                hi = mid - 1
        return best

    def chunk_workspace(self, node, chunk, dtype):
        """The workspace tensors of ``node`` working ``chunk`` images a pass (kept with the graph:
        every mode's plan asks for the same ones)."""
        cache = self.graph.__dict__.setdefault("_chunk_workspaces", {})
        key = (id(node), chunk)
        if key not in cache:
            specs = node.layer.workspace_for_chunk(chunk)
            cache[key] = None if specs is None else list(
                _workspace(node.name, specs, dtype, node.layer.param.location).values())
        return cache[key]

    def bring_params(self, i, end):
        """Host parameters of this step and the next few, prefetched (the copies overlap compute)."""
        for k in range(i, min(i + self.lookahead + 1, end)):
            for r, _ in self.param_ops.get(k, ()):
                if id(r) not in self.live:
                    self.emit("alloc", r)
                    self.emit("prefetch", r)

    def return_params(self, i, end, replay=False):
        """After a step: what it changed goes back to the host; what no near step needs is freed."""
        soon = {id(r) for k in range(i + 1, min(i + self.lookahead + 1, end)) for r, _ in self.param_ops.get(k, ())}
        for r, write in self.param_ops.get(i, ()):
            if write and not replay:
                self.emit("offload", r)
            if id(r) not in soon and id(r) in self.live:
                self.emit("free", r)

    def bring(self, r):
        """Make an offloaded value resident: a cache hit, or an allocation and a prefetch."""
        key = id(r)
        if key in self.live:
            if key in self.cache:
                del self.cache[key]
                self.plan.cache_hits += 1
            return
        self.emit("alloc", r)
        self.emit("prefetch", r)
        self.plan.cache_misses += 1

    def ensure(self, r, write=False):
        key = id(r)
        if key in self.live:
            self.cache.pop(key, None)
            return
        if key in self.dropped:
            seg = self.dropped[key]
            self.replay(seg, self.prefix(seg, r) if seg.index in self.mc else None)
        elif key in self.offloaded and key in self.hosted:
            self.bring(r)
        else:
            u = self.uses[key][1]
            self.alloc(r, fill=None if (write and self.pos in u.writes) else 0.0)
        if key not in self.live:
            raise PlanError(f"plan bug: {r.name} not resident at {self.ops[self.pos].name}")

    def prefix(self, seg, r):
        """A memory-centric replay's operators: the segment's, up to the last writer of ``r``
        and of what else the current step reads of it."""
        mine = [self.fwd_last[id(q)][0] for q, _ in op_tensors(self.ops[self.pos]) if self.dropped.get(id(q)) is seg]
        last = max(mine + [self.fwd_last[id(r)][0]])
        return [k for k in seg.cheap if k <= last]

    def replay(self, seg, ops=None):
        """Recompute a segment's cheap operators: speed-centric (``ops`` None) all of them once,
        keeping the results; memory-centric only ``ops``, whose results go after this step."""
        fresh = set(self.live) if ops is not None else None
        for r in seg.externals:
            self.ensure(r)
        for r, ckpt in seg.snapshots:
            self.alloc(r)
            if self.offload:
                self.emit("prefetch", ckpt, source=r)
            else:
                self.out.append(Instr("restore", r, source=ckpt))
        for k in seg.cheap if ops is None else ops:
            for r, _ in self.param_ops.get(k, ()):
                if id(r) not in self.live:
                    self.emit("alloc", r)
                    self.emit("prefetch", r)
            for r, write in op_tensors(self.F[k]):
                if id(r) not in self.persistent_ids:
                    self.ensure(r) if not write else self.alloc(r)
            self.run(k, recompute=True)
            for r, _ in self.param_ops.get(k, ()):
                if id(r) in self.live and not any(id(r) == id(q) for q, _ in self.param_ops.get(self.pos, ())):
                    self.emit("free", r)
        if ops is not None:             # memory-centric: freed after this step, checkpoints kept
            self.mc_free += [t for key, t in self.live.items() if key not in fresh and key in self.dropped]
            if seg not in self.mc_open:
                self.mc_open.append(seg)
            return
        self.drop_snapshots(seg)

    def drop_snapshots(self, seg):
        seg.done = True
        for r, ckpt in seg.snapshots:
            if self.offload:
                self.emit("drop", ckpt)
            else:
                self.emit("free", ckpt)

    def release(self, j):
        """Free the resident values no later step needs (and their host copies)."""
        for r in self.free_at.pop(j, []):
            if id(r) in self.live and not self.need_times(r, j):
                self.emit("free", r)
                if id(r) in self.hosted:
                    self.emit("drop", r)

    def lower_bound(self):
        """max over steps of what that step itself touches, beside what always lives (any mode)."""
        key = ("_lower_bound", bool(self.param_ids))
        if key not in self.graph.__dict__:      # the same for every mode: computed once per graph
            always = [r for r in persistent_roots(self.graph) if id(r) not in self.param_ids]
            keep = {id(r) for r in always}       # host parameters count where they are brought in
            best, where = 0, ""
            for op in self.ops:
                need = sum(align(r.nbytes) for r, _ in op_tensors(op) if id(r) not in keep)
                need += sum(align(t.nbytes) for t in workspaces(op))
                if need > best:
                    best, where = need, op.name
            self.graph.__dict__[key] = (sum(align(r.nbytes) for r in always) + best, where)
        best, where = self.graph.__dict__[key]
        return best + self.extra, where
