"""The builder: one iteration walked step by step on the passes' data, writing the schedule.

The analysis passes (passes.py) decide before the walk what is dropped, offloaded, kept on
the host and when each value is needed; the policies that depend on what is resident decide
during it, each in its own module: which cached copy to evict (cache.py), the tier of each
offloaded copy (tiers.py), where each block lands (placement.py) and the chunk of a workspace
that does not fit (chunks.py). The walk itself only emits instructions and keeps count.
"""
from __future__ import annotations

import bisect
import gc
from collections import deque
from contextlib import contextmanager

from . import passes
from .cache import LRUCache
from .chunks import choose_chunk
from .liveness import locations, op_tensors, workspaces
from .placement import Placement
from .result import Plan, PlanError, layer_flops
from ..sizes import align
from .schedule import Instr, Schedule, simulate
from .tiers import Tiers


@contextmanager
def paused_gc():
    """The cyclic collector off while plans are made: a walk makes hundreds of thousands of
    objects and no cycles, and each plan kept makes the collector's next full pass longer: on
    the deepest nets the collector took a large share of planning, within walks and between."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()


class Builder:
    def __init__(self, graph, mode, capacity, extra_bytes, lookahead, min_gap, host_params=False,
                 host=(None, None, 0, None, None), before=(), memory_centric=False, forward_only=False,
                 param_disk=False, disk_extra=0, granularity=0, keep=0):
        self.graph, self.mode, self.capacity = graph, mode, capacity
        self.granularity = granularity if mode == "recompute" else 0
        self.keep = keep if self.granularity else 0
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
        self.F, self.B = graph.forward_ops, [] if forward_only else graph.backward_ops
        self.ops = self.F + self.B
        self.nf = len(self.F)
        self.accumulated = getattr(graph, "updated_in_backward", {})

    # -- the walk ---------------------------------------------------------------
    def build(self):
        with paused_gc():
            return self.walk()

    def walk(self):
        self.error, self.flops = PlanError, layer_flops
        plan = self.plan = Plan(self.mode, Schedule(), [], 0, self.extra, self.capacity,
                                host_capacity=self.host_capacity, ram=self.ram, host_extra=self.host_extra,
                                disk_capacity=self.spill, param_disk=self.param_disk)
        a = passes.analyze(self.graph, self.ops, self.nf, self.mode, self.host_params, self.memory_centric,
                           self.min_gap, self.granularity, self.keep)
        plan.granularity, plan.kept = self.granularity, self.keep
        plan.kept_bytes = sum(size for _, size, _ in passes.chains(self.graph, self.granularity)[:self.keep]) \
            if self.keep else 0        # (the chains' table only where some are kept)
        plan.segments = sum(1 for seg in a.rc.segs if seg.dropped) if self.granularity else 0
        self.uses, self.persistent_ids, self.param_ids, self.param_ops = a.uses, a.persistent_ids, a.param_ids, \
            a.param_ops
        self.dropped, self.snap_at, self.mc = a.rc.dropped, a.rc.snap_at, a.mc
        self.times, self.fwd_last, self.offloaded, self.to_bring = a.times, a.fwd_last, a.offloaded, a.to_bring
        plan.host_params = list(a.param_ids.values())
        plan.dropped = [r.name for seg in a.rc.segs for r in seg.dropped]
        plan.memory_centric = len(a.mc)
        plan.offloaded = [r.name for r in a.offloaded.values()]
        plan.persistent = list(a.persistent)
        plan.persistent_bytes = sum(r.block_bytes for r in a.persistent)
        self.base = {"": self.extra}          # bytes each location holds before the iteration
        for loc in locations(self.graph, self.ops):
            self.base.setdefault(loc, 0)
        for r in a.persistent:
            self.base[r.location] = self.base.get(r.location, 0) + r.block_bytes
        self.where = Placement(self.capacity, self.base, self.before_blocks, a.persistent, self.extra_blocks)
        self.live, self.hosted, self.cache, self.free_at = {}, {}, LRUCache(), {}
        self.mc_free, self.mc_open = [], []     # memory-centric replays' results, and their open segments
        hosted = 0 if self.param_disk else sum(r.block_bytes for r in plan.host_params)
        self.tiers = Tiers(self.host_room, plan.host_extra + hosted)
        self.to_bring = deque(self.to_bring)
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
        return self.finish()

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
            if id(r) not in self.persistent_ids:
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
            if not self.need_times(r, self.nf - 1) or key in self.dropped:
                self.emit("free", r)                  # dead after forward, or recomputed in backward
            elif key in self.offloaded:
                if self.capacity is not None:
                    self.cache.keep(r)                # kept while it fits (LRU)
                else:
                    self.emit("free", r)

    def backward_step(self, j):
        # Prefetch what the next few operators need, so the copy hides behind compute.
        while self.to_bring and self.to_bring[0][0] <= j + self.lookahead:
            self.bring(self.to_bring.popleft()[2])
        self.bring_params(j, len(self.ops))
        for r, write in op_tensors(self.ops[j]):
            if id(r) not in self.persistent_ids:
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

    def ensure(self, r, write=False):
        """Make ``r`` resident for the current step: replayed, brought from the host, or allocated."""
        key = id(r)
        if key in self.live:
            self.cache.take(r)
            return
        if key in self.dropped:
            seg = self.dropped[key]
            self.replay(seg, passes.replay_ops(seg, r, self.ops[self.pos], self.dropped, self.fwd_last)
                        if seg.index in self.mc else None)
        elif key in self.offloaded and key in self.hosted:
            self.bring(r)
        else:
            u = self.uses[key][1]      # (a gradient updated in backward: its layers add into it)
            written = write and self.pos in u.writes and key not in self.accumulated
            self.alloc(r, fill=None if written else 0.0)
        if key not in self.live:
            raise self.error(f"plan bug: {r.name} not resident at {self.ops[self.pos].name}")

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
                self.alloc(r, prefetch=True)
            for r, write in op_tensors(self.F[k]):
                if id(r) not in self.persistent_ids:
                    self.ensure(r) if not write else self.alloc(r)
            self.run(k, recompute=True)
            for r, _ in self.param_ops.get(k, ()):
                if id(r) in self.live and not any(id(r) == id(q) for q, _ in self.param_ops.get(self.pos, ())):
                    self.emit("free", r)
        if ops is not None:             # memory-centric: freed after this step, checkpoints kept,
            # but not what this step writes for a later one: that is backward's value now, which a
            # replay does not give back (a fused Scale's sums in BatchNorm's partials)
            step = self.pos
            written = {id(q) for q, w in op_tensors(self.ops[step]) if w and self.need_times(q, step)}
            self.mc_free += [t for key, t in self.live.items()
                             if key not in fresh and key in self.dropped and key not in written]
            if seg not in self.mc_open:
                self.mc_open.append(seg)
            return
        self.drop_snapshots(seg)

    def drop_snapshots(self, seg):
        seg.done = True
        for r, ckpt in seg.snapshots:
            self.emit("drop" if self.offload else "free", ckpt)

    def release(self, j):
        """Free the resident values no later step needs (and their host copies)."""
        for r in self.free_at.pop(j, []):
            if id(r) in self.live and not self.need_times(r, j):
                self.emit("free", r)
                if id(r) in self.hosted:
                    self.emit("drop", r)

    def need_times(self, r, after):
        """Op indices after ``after`` where ``r`` must be on the device (replays of segments
        that read it included: a segment is replayed at its first need, speed-centric)."""
        t = self.times.get(id(r), [])
        return t[bisect.bisect_right(t, after):]

    # -- host parameters ---------------------------------------------------------
    def bring_params(self, i, end):
        if not self.param_ops:
            return
        for r in passes.params_near(self.param_ops, i, end, self.lookahead):
            self.alloc(r, prefetch=True)

    def return_params(self, i, end):
        if not self.param_ops:
            return
        for r, changed, leaving in passes.params_after(self.param_ops, i, end, self.lookahead):
            if changed:
                self.emit("offload", r)
            if leaving and id(r) in self.live:
                self.emit("free", r)

    # -- instructions ------------------------------------------------------------
    def alloc(self, r, fill=None, prefetch=False):
        if id(r) not in self.live:
            self.emit("alloc", r, fill=fill)
            if prefetch:
                self.emit("prefetch", r)

    def bring(self, r):
        """Make an offloaded value resident: a cache hit, or an allocation and a prefetch."""
        if id(r) in self.live:
            self.plan.cache_hits += self.cache.take(r)
            return
        self.alloc(r, prefetch=True)
        self.plan.cache_misses += 1

    def run(self, i, recompute=False):
        op = self.ops[i]
        ws, chunk = workspaces(op), None
        loc = op.node.layer.param.location if ws else ""
        if self.capacity is not None and ws and not self.where.fits([t.nbytes for t in ws], loc):
            self.make_room([t.nbytes for t in ws], loc)
            if not self.where.fits([t.nbytes for t in ws], loc):
                best, trials = choose_chunk(self.graph, op, lambda sizes: self.where.fits(sizes, loc))
                self.plan.chunk_trials += trials
                chunk, ws = best or (None, ws)
        for t in ws:
            self.emit("alloc", t)
        self.out.append(Instr("run", None, op, recompute, None, None, chunk,
                              {t.name.split("#", 1)[1]: t for t in ws} if chunk else None))
        for t in ws:
            self.emit("free", t)
        if recompute:
            self.plan.recompute_flops += self.flops(op.node)
            self.plan.recomputed_ops += 1

    def make_room(self, sizes, loc):
        """Evict cached copies, least recently used first, until blocks of ``sizes`` can be placed."""
        while self.cache.held and not self.where.fits(sizes, loc):     # no trial while nothing is cached
            victim = self.cache.victim(loc)
            if victim is None:
                return
            self.emit("free", victim)

    def emit(self, kind, tensor, fill=None, source=None):
        key, tier = id(tensor), "host"
        if kind == "alloc":
            if self.cache.held:
                self.make_room([tensor.nbytes], tensor.location)
        elif kind == "offload" and self.host_room is not None and key not in self.hosted \
                and id(tensor.root) not in self.param_ids:
            tier = self.tiers.place(tensor)
        self.out.append(Instr(kind, tensor, None, False, fill, source, None, None, tier))
        if kind == "alloc":
            error = self.where.alloc(tensor)
            if error is not None and not self.where.overflow:
                self.where.overflow = f"at step {self.ops[self.pos].name if self.pos >= 0 else 'the start'}: {error}"
            if self.pos >= self.nf and tensor.kind != "workspace" and key not in self.param_ids:
                last = self.need_times(tensor, -1)
                # Freed after the last step that needs it (this one, where none later does).
                self.free_at.setdefault(last[-1] if last and last[-1] > self.pos else self.pos, []).append(tensor)
            self.live[key] = tensor
        elif kind == "free":
            self.where.free(tensor)
            self.live.pop(key, None)
            self.cache.take(tensor)
        elif kind == "offload":
            self.hosted[key] = tensor
            self.plan.d2h_bytes += tensor.nbytes
        elif kind == "prefetch":
            self.plan.h2d_bytes += tensor.nbytes
        elif kind == "drop":
            self.hosted.pop(key, None)
            self.tiers.release(tensor)

    # -- the plan ----------------------------------------------------------------
    def finish(self):
        """Each location's timeline, simulated from the schedule, gives the plan's peaks."""
        plan = self.plan
        plan.overflow = self.where.overflow
        homes = {}
        for r in plan.host_params:
            homes[r.location] = homes.get(r.location, 0) + r.block_bytes
        disk_homes = homes if self.param_disk else {}
        homes = {} if self.param_disk else homes
        plan.disk_base = disk_homes.get("", 0) + self.disk_extra
        plan.timelines = {loc: simulate(plan.schedule, base, loc,
                                        homes.get(loc, 0) + (plan.host_extra if loc == "" else 0), plan.host_params,
                                        disk_homes.get(loc, 0) + (self.disk_extra if loc == "" else 0),
                                        alone=len(self.base) == 1)
                          for loc, base in self.base.items()}
        plan.peaks = {loc: t.peak for loc, t in plan.timelines.items()}
        main = "" if len(self.base) == 1 else max(plan.peaks, key=plan.peaks.get)
        plan.timeline = plan.timelines[main]
        plan.peak, plan.host_peak = plan.timeline.peak, plan.timeline.host_peak
        plan.disk_peak = max(t.disk_peak for t in plan.timelines.values())
        best, where = passes.lower_bound(self.graph, self.ops, self.param_ids)
        plan.lower_bound, plan.lower_bound_step = best + self.extra, where
        return plan
