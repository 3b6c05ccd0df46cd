"""Benchmark sncaffe's memory runtime on the CPU device (not a test): prints tables.

1. depth: the deepest bottleneck ResNet (224x224, batch 16, blocks [3,4,k,3],
   depth 3*(k+10)+2, tools/gen_resnet.py's rule) whose plan fits the device
   (12 GiB) in each memory mode, the SGD solver's history in the pool; found by
   galloping over k from a linear estimate, then bisection; and whether
   ResNet-2500 [6,32,788,6] fits.
1b. ram: the same with the host counted: device and host pools on the CPU's one RAM (the
   budget sncaffe takes by default), per mode, and with --disk also through the disk tier.
2. ratio: every mode's planned need for ResNet-50/101/152/2500 at batch 16,
   the lower bound (the most any one step touches) and all/bound (target: at
   most 1.2), with the step where the peak of ``all`` falls.
3. speed: time per forward+backward of ``all`` against ``none`` (and of
   ``recompute`` and ``offload`` alone, to tell their costs apart) on a net
   that fits all of them (ResNet-50, batch 4, 224x224), each on a device just
   larger than its need, side by side in one run: one warm-up each, then timed
   iterations in rotating order (target: all at most 1.15x none); then a
   profile of where the time goes: waits for copies, copy threads, recomputation.

    .venv/bin/python tools/bench_memory.py [--threads 1] [--quick] [--skip depth,ratio,speed]

"Fits" is the plan ``Net`` makes at the capacity (every block placed by the
device's allocator, LRU-cached copies, chunked workspaces); "need" is the plan
without a capacity, whose peak is what the schedule itself requires.
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from collections import OrderedDict, defaultdict
from pathlib import Path

from tables import table  # tools/tables.py: python puts the script's folder on sys.path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
GiB = 1 << 30
MODES = ("none", "liveness", "offload", "recompute", "all")
NETS = OrderedDict([("ResNet-50", (3, 4, 6, 3)), ("ResNet-101", (3, 4, 23, 3)),
                    ("ResNet-152", (3, 8, 36, 3)), ("ResNet-2500", (6, 32, 788, 6))])


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1, help="BLAS and OpenMP threads (default 1)")
    ap.add_argument("--capacity", default="12GiB", help="device memory for the depth search (default 12GiB)")
    ap.add_argument("--batch", type=int, default=16, help="batch of the depth and ratio tables (default 16)")
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--time-blocks", default="3,4,6,3", help="blocks of the timed net (default ResNet-50)")
    ap.add_argument("--time-batch", type=int, default=4)
    ap.add_argument("--time-image-size", type=int, default=224)
    ap.add_argument("--iterations", type=int, default=7, help="timed iterations per mode (default 7)")
    ap.add_argument("--quick", action="store_true",
                    help="depth from a linear estimate (no search), timed net at batch 2, 112x112, 3 iterations")
    ap.add_argument("--skip", default="", help="comma-separated tables to skip: depth, ram, ratio, speed")
    ap.add_argument("--disk", action="store_true", help="table 1b also with the disk tier (the temporary directory)")
    return ap.parse_args(argv)


def gib(n) -> str:
    return f"{n / GiB:.2f}"




def machine(threads) -> str:
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), "unknown CPU") if Path("/proc/cpuinfo").exists() else "unknown CPU"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (f"machine: {cores} cores usable ({model}); threads: {threads} (OPENBLAS_NUM_THREADS, "
            f"OMP_NUM_THREADS, MKL_NUM_THREADS); load average {load:.2f} (other processes share the cores)")


class Planner:
    """Graphs and plans of generated ResNets, memoized: the depth and ratio tables share them."""

    def __init__(self, batch, image_size):
        from gen_resnet import generate
        from sncaffe.proto import sncaffe_pb2 as pb
        from sncaffe.prototxt import parse_text
        self.batch, self.size = batch, image_size
        self.text = lambda blocks: parse_text(generate(blocks, batch=batch, image_size=image_size),
                                              pb.NetParameter())
        self.graphs = OrderedDict()       # the last two graphs: a ResNet-2500 graph takes ~2 s to build
        self.plans = {}                   # (blocks, mode, capacity) -> plan summary
        self.count = 0

    def graph(self, blocks):
        from sncaffe.graph import build_graph
        from sncaffe.prototxt import prepare_net
        if blocks not in self.graphs:
            self.graphs[blocks] = build_graph(prepare_net(self.text(blocks), 0), 0)
            if len(self.graphs) > 2:
                self.graphs.popitem(last=False)
                gc.collect()              # the graph's cycles: the collector is off while planning
        self.graphs.move_to_end(blocks)
        return self.graphs[blocks]

    def plan(self, blocks, mode, capacity=None, ram=None, spill=None):
        """Summary of the plan of ``mode`` for ``blocks`` with the SGD solver's history in the pool:
        with ``capacity``, as ``Net`` plans it (placement, LRU cache, chunked workspaces); without,
        the schedule's own need. ``ram``: device and host pools on one RAM of that size (the CPU),
        fitted as ``Net`` fits them (the host tier, with ``spill`` bytes of disk tier if given)."""
        from sncaffe.plan.planner import shared_ram_plan, make_plan
        from sncaffe.solvers.solver import history_blocks
        from sncaffe.solvers.update import SGD
        key = (blocks, mode, capacity, ram, spill)
        if key not in self.plans:
            g = self.graph(blocks)
            if ram is None:
                p = make_plan(g, mode, capacity, history_blocks(g, SGD.n_history))
            else:
                p = shared_ram_plan(g, mode, capacity, history_blocks(g, SGD.n_history), ram=ram, spill=spill)
            t = p.timeline
            at = max(range(len(t.device)), key=t.device.__getitem__)
            self.plans[key] = SimpleNamespace(
                peak=p.peak, lower_bound=p.lower_bound, fits=p.fits, history=p.extra_bytes,
                peak_step=next((name for i, name in reversed(t.steps) if i <= at), "the start"),
                peak_instr=str(t.labels[at]), bound_step=p.lower_bound_step,
                chunked=sum(1 for ins in p.schedule if ins.kind == "run" and getattr(ins, "chunk", None)),
                host_peak=p.host_peak, disk_peak=p.disk_peak,
                params=sum(d.nbytes for n in g.layers for d, _ in n.params) // 4)
            self.count += 1
        return self.plans[key]


def res4(k):
    return (3, 4, k, 3)


def depth(blocks):
    return 3 * sum(blocks) + 2


def deepest(fits, hint, tol=1, k_max=100_000):
    """(lo, hi): lo the largest k >= 1 with fits(k) (None if k = 1 does not), hi the smallest k
    known not to fit (None if none below k_max), hi - lo <= tol. Gallops from ``hint`` with
    steps 1, 2, 4, ..., then bisects."""
    k = max(1, hint)
    step = 1
    if fits(k):
        lo = k
        while True:
            k = lo + step
            if k > k_max:
                return lo, None
            if not fits(k):
                hi = k
                break
            lo, step = k, 2 * step
    else:
        hi = k
        while True:
            k = max(1, hi - step)
            if k == hi:
                return None, 1
            if fits(k):
                lo = k
                break
            hi, step = k, 2 * step
    while hi - lo > tol:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo, hi


def depth_table(planner, capacity, quick):
    from sncaffe.sizes import fmt_bytes
    cap = fmt_bytes(capacity)
    print(f"## 1. Deepest bottleneck ResNet whose plan fits {cap} "
          f"(batch {planner.batch}, {planner.size}x{planner.size}, blocks [3,4,k,3], SGD history counted)")
    t0 = time.perf_counter()
    rows = []
    for mode in ("none", "liveness", "recompute", "offload", "all"):
        # The need grows about linearly in k: two small nets give the starting guess.
        a, b = planner.plan(res4(6), mode).peak, planner.plan(res4(23), mode).peak
        slope = max(1, b - a) / 17
        hint = max(1, int(6 + (capacity - a) / slope))
        need2500 = planner.plan(NETS["ResNet-2500"], mode)
        # A need over twice the device cannot fit: chunked workspaces save far less than that.
        fits2500 = need2500.peak < 2 * capacity and planner.plan(NETS["ResNet-2500"], mode, capacity).fits
        r2500 = f"{'yes' if fits2500 else 'no'} ({gib(need2500.peak)})"
        if quick:
            rows.append((mode, f"~{depth(res4(hint))}", f"[3,4,~{hint},3]", *[""] * 6, r2500, 2))
            continue
        before = planner.count
        hint = max(1, hint + int((capacity - planner.plan(res4(hint), mode).peak) // slope))   # a secant step
        lo, hi = deepest(lambda k: planner.plan(res4(k), mode, capacity).fits, hint)
        probes = planner.count - before
        if lo is None:
            rows.append((mode, "none fits", *[""] * 7, r2500, probes))
            continue
        need, at = planner.plan(res4(lo), mode), planner.plan(res4(lo), mode, capacity)
        rows.append((mode, depth(res4(lo)), f"[3,4,{lo},3]", gib(need.peak), gib(at.peak), gib(need.lower_bound),
                     f"{need.peak / need.lower_bound:.2f}", at.chunked, depth(res4(hi)) if hi else "-",
                     r2500, probes + 2))   # with the two plans of the guess
    table(rows, ["mode", "deepest", "blocks", "peak GiB", f"peak at {cap}", "bound GiB", "peak/bound",
                 "chunked convs", "first not fitting", "ResNet-2500 fits (need GiB)", "plans"])
    print(f"({time.perf_counter() - t0:.0f} s; fits: the plan at {cap}, as Net makes it, places every block "
          f"(fragmentation included); peak: the plan's need (no capacity: no LRU-cached copies, full "
          f"workspaces); bound: the most any one step touches, persistent tensors and history included"
          f"{'; quick: the linear estimate from k = 6 and 23, no search' if quick else ''})\n")


def ram_table(planner, spill):
    """The deepest ResNet trainable on this machine with the host counted: device and host
    pools on the CPU's one RAM (the budget sncaffe takes by default: available RAM less a margin),
    without and with the disk tier."""
    from sncaffe.runtime.budget import available_ram, ram_budget
    from sncaffe.sizes import fmt_bytes
    ram = ram_budget()
    print(f"## 1b. Deepest bottleneck ResNet trainable on this machine, host RAM counted (batch {planner.batch}, "
          f"{planner.size}x{planner.size}, [3,4,k,3], SGD history): device + host pools within "
          f"{fmt_bytes(ram)} (available {fmt_bytes(available_ram())} less the margin)"
          + (f"; with the disk tier up to {fmt_bytes(spill)}" if spill else ""))
    t0 = time.perf_counter()
    rows = []
    for mode in ("none", "liveness", "recompute", "offload", "all"):
        for disk in ((None, spill) if spill else (None,)):
            fits = lambda k: planner.plan(res4(k), mode, ram, ram, disk).fits   # noqa: E731
            a, b = planner.plan(res4(6), mode).peak, planner.plan(res4(23), mode).peak
            hint = max(1, int(6 + (ram - a) / (max(1, b - a) / 17)))
            lo, hi = deepest(fits, hint, tol=max(1, hint // 16))
            if lo is None:
                rows.append((mode, "disk" if disk else "-", "none fits", "", "", "", ""))
                continue
            p = planner.plan(res4(lo), mode, ram, ram, disk)
            rows.append((mode, "disk" if disk else "-", depth(res4(lo)), f"[3,4,{lo},3]", gib(p.peak),
                         gib(p.host_peak), gib(p.disk_peak)))
    table(rows, ["mode", "tier", "deepest", "blocks", "device GiB", "host GiB", "disk GiB"])
    print(f"({time.perf_counter() - t0:.0f} s; depth to within 1/16 of the estimate)\n")


def ratio_table(planner, capacity):
    from sncaffe.sizes import fmt_bytes
    print(f"## 2. Planned need per mode (GiB), batch {planner.batch}, {planner.size}x{planner.size}, "
          f"SGD history counted; '*' fits {fmt_bytes(capacity)}")
    t0 = time.perf_counter()
    rows = []
    for name, blocks in NETS.items():
        plans = {m: planner.plan(blocks, m) for m in MODES}
        fit = {m: plans[m].peak < 2 * capacity and planner.plan(blocks, m, capacity).fits for m in MODES}
        a = plans["all"]
        rows.append((name, f"{a.params / 1e6:.0f}M", gib(a.history),
                     *[gib(plans[m].peak) + ("*" if fit[m] else " ") for m in MODES],
                     gib(a.lower_bound), f"{a.peak / a.lower_bound:.3f}",
                     "yes" if a.peak <= 1.2 * a.lower_bound else "NO", f"{a.peak_step}: {a.peak_instr}",
                     a.bound_step))
    table(rows, ["net", "params", "history", *MODES, "bound", "all/bound", "<= 1.2", "all: peak at",
                 "bound at"])
    print(f"({time.perf_counter() - t0:.0f} s; bound: the most any one step touches, persistent tensors "
          f"and history included)\n")


# -- 3. speed ------------------------------------------------------------------
def speed(args, np):
    from gen_resnet import generate
    from sncaffe import Net
    from sncaffe.backend import CPUDevice
    from sncaffe.graph import build_graph
    from sncaffe.plan.planner import MemoryExhausted, make_plan
    from sncaffe.sizes import fmt_bytes
    from sncaffe.proto import sncaffe_pb2 as pb
    from sncaffe.prototxt import parse_text, prepare_net

    blocks = tuple(int(b) for b in args.time_blocks.split(","))
    batch, size = (2, 112) if args.quick else (args.time_batch, args.time_image_size)
    iterations = 3 if args.quick else args.iterations
    param = parse_text(generate(blocks, batch=batch, image_size=size), pb.NetParameter())
    g = build_graph(prepare_net(param, 0), 0)
    modes = ("none", "all", "recompute", "offload")
    need = {m: make_plan(g, m).peak for m in modes}
    print(f"## 3. Time per iteration (forward + backward), {depth(blocks)}-layer ResNet {list(blocks)}, "
          f"batch {batch}, {size}x{size}")
    print("planned need: " + ", ".join(f"{m} {fmt_bytes(need[m])}" for m in modes))

    rng = np.random.default_rng(0)
    data = rng.standard_normal((batch, 3, size, size)).astype(np.float32)
    label = rng.integers(0, 1000, batch).astype(np.float32)

    # The pool fragments: a capacity of exactly the planned need can fail, so each mode takes
    # the smallest of these multiples of its need at which its warm-up iteration runs.
    variants, refused = OrderedDict(), []
    for mode in modes:
        for f in (1.05, 1.1, 1.2, 1.35, 1.5, 2.0, 3.0, 5.0):
            capacity = int(need[mode] * f)
            try:
                net = Net(param, "TRAIN", device=CPUDevice(capacity), memory=mode)
                net.blobs["data"].data[...] = data
                net.blobs["label"].data[...] = label
                loss = net.forward()           # the warm-up iteration
                net.backward()
            except MemoryExhausted as e:
                refused.append(f"{mode} at {f:.2f}x its need: {str(e).split(';')[0]}")
                continue
            variants[mode] = SimpleNamespace(net=net, capacity=capacity, factor=f, loss=loss, times=[])
            break
    for line in refused:
        print("refused:", line)
    losses = {v.loss for v in variants.values()}
    print(f"warm-up losses {'identical' if len(losses) == 1 else 'DIFFER'}: "
          + ", ".join(f"{k} {v.loss!r}" for k, v in variants.items()))

    def iterate(v):
        gc.collect()
        before = dict(v.net.executor.stats)
        t = time.perf_counter()
        v.net.forward()
        v.net.backward()
        v.net.device.synchronize()
        v.times.append(time.perf_counter() - t)
        v.stats = {k: v.net.executor.stats[k] - before[k] for k in before}
    alternate(variants, iterations, iterate)
    base, fastest = statistics.median(variants["none"].times), min(variants["none"].times)
    rows = []
    for name, v in variants.items():
        p, med = v.net.plan, statistics.median(v.times)
        paired = statistics.median(t / n for t, n in zip(v.times, variants["none"].times))
        chunked = sum(1 for ins in p.schedule if ins.kind == "run" and getattr(ins, "chunk", None))
        rows.append((name, f"{fmt_bytes(v.capacity)} ({v.factor:.2f}x)", fmt_bytes(v.net.device.pool.peak),
                     f"{med:.3f}", f"{min(v.times):.3f}", f"{med / base:.3f}", f"{paired:.3f}",
                     f"{min(v.times) / fastest:.3f}",
                     f"{v.stats['d2h_bytes'] / 2**20:.0f}", f"{v.stats['h2d_bytes'] / 2**20:.0f}",
                     f"{p.recompute_flops / 1e9:.2f}", p.recomputed_ops, chunked,
                     f"{p.cache_hits}/{p.cache_misses}", v.stats["waits"]))
    table(rows, ["mode", "device capacity (x need)", "pool peak", "median s", "min s", "vs none", "paired",
                 "min vs min", "d2h MiB", "h2d MiB", "recompute GFLOP", "recomputed ops", "chunked convs",
                 "cache hit/miss", "waits"])
    print(f"({iterations} timed iterations per mode after one warm-up, in rotating order; vs none: ratio of "
          f"medians; paired: median over rounds of the ratio to none's time in the same round; min vs min: "
          f"the least disturbed iterations; target: all at most 1.15x none; "
          f"load average now {os.getloadavg()[0]:.2f})\n")
    profile(variants, 1 if args.quick else 2, np)
    for v in variants.values():
        v.net.release()


def alternate(variants, n, fn):
    """``n`` rounds of ``fn(variant)`` over all variants, the order rotated every round
    so that each variant sees the same share of the machine's noise."""
    names = list(variants)
    for it in range(n):
        for name in names[it % len(names):] + names[:it % len(names)]:
            fn(variants[name])


def traced_iteration(net):
    """One ordinary iteration with the executor's instructions timed by kind, the waits that
    blocked timed by stream and by the layer type of the waiting op, and the copies' busy time."""
    ex, dev = net.executor, net.device
    kinds = {ins.kind for ins in net.plan.schedule}
    spent, blocked, copies = defaultdict(float), defaultdict(lambda: [0, 0.0]), defaultdict(float)
    current = [None]
    wait = ex._wait

    def timed(kind, method):
        def run(ins):
            current[0] = ins
            t = time.perf_counter()
            method(ins)
            spent[kind] += time.perf_counter() - t
        return run

    def timed_wait(event):
        if event is None or event.query():
            return wait(event)
        t = time.perf_counter()
        wait(event)
        ins = current[0]
        who = (ins.op.node.type + (" recompute" if ins.recompute else f" {ins.op.kind}")) if ins.kind == "run" \
            else ins.kind
        b = blocked[(event.stream, who)]
        b[0] += 1
        b[1] += time.perf_counter() - t

    def traced(copy, stream):
        def run(*a, **kw):
            event = copy(*a, **kw)
            event.stream = stream
            events.append(event)
            return event
        return run
    events = []
    for kind in kinds:
        setattr(ex, "_" + kind, timed(kind, getattr(ex, "_" + kind)))
    ex._wait = timed_wait
    dev.copy_to_host, dev.copy_to_device = traced(dev.copy_to_host, "d2h"), traced(dev.copy_to_device, "h2d")
    try:
        gc.collect()
        t = time.perf_counter()
        net.forward()
        net.backward()
        dev.synchronize()
        wall = time.perf_counter() - t
    finally:
        for kind in kinds:
            delattr(ex, "_" + kind)
        del ex._wait, dev.copy_to_host, dev.copy_to_device
    for e in events:
        copies[e.stream] += e.end - e.start
    return SimpleNamespace(wall=wall, spent=spent, blocked=blocked, copies=copies)


def profile(variants, reps, np):
    """Where the time goes, best of ``reps`` rounds: traced iterations, then iterations with
    per-op timings (each op followed by a device synchronize), per-op minimum over the rounds."""
    print(f"### Profile (best of {reps} traced and {reps} per-op-timed iterations per mode)")
    for v in variants.values():
        v.traces, v.ops = [], {}

    def trace(v):
        v.traces.append(traced_iteration(v.net))

    def op_times(v):
        ops = {}
        gc.collect()
        v.net.forward(timings=ops)
        v.net.backward(timings=ops)
        for k, s in ops.items():
            v.ops[k] = min(s, v.ops.get(k, s))
    alternate(variants, reps, trace)
    alternate(variants, reps, op_times)
    rows, by_type = [], {}
    for name, v in variants.items():
        tr = min(v.traces, key=lambda t: t.wall)
        memory = sum(s for k, s in tr.spent.items() if k != "run")
        waits = {s: [sum(b[i] for (st, _), b in tr.blocked.items() if st == s) for i in (0, 1)] for s in ("d2h", "h2d")}
        kinds = {op.name: op.node.type for op in v.net.graph.forward_ops + v.net.graph.backward_ops}
        types = defaultdict(float)
        for op, s in v.ops.items():
            base, _, rec = op.partition(" (")
            types[(kinds[base], "recompute" if rec else base.rsplit(":", 1)[-1])] += s
        by_type[name] = types
        recompute = sum(s for k, s in types.items() if k[1] == "recompute")
        rows.append((name, f"{tr.wall:.3f}", f"{tr.spent['run']:.3f}", f"{memory:.3f}",
                     f"{waits['d2h'][1]:.3f} ({waits['d2h'][0]})", f"{waits['h2d'][1]:.3f} ({waits['h2d'][0]})",
                     f"{tr.copies['d2h']:.3f}", f"{tr.copies['h2d']:.3f}",
                     f"{sum(types.values()) - recompute:.3f}", f"{recompute:.3f}"))
        v.blocked = tr.blocked
    table(rows, ["mode", "traced s", "run instrs s", "other instrs s", "blocked on d2h (n)", "blocked on h2d (n)",
                 "d2h copying s", "h2d copying s", "ops s", "recompute ops s"])
    print("traced: an ordinary iteration, its instructions timed by kind: run (the ops, with the waits "
          "for copies they depend on) and other (alloc, free, offload, prefetch, drop, snapshot, restore); "
          "blocked: time the compute thread waited for a copy stream; copying: the copy threads' busy time; "
          "ops / recompute ops: per-op-timed iterations, minimum per op over the rounds (Net's timings "
          "synchronize the device after each op, so an op's time includes copies still in flight).\n")
    for name, v in variants.items():
        if v.blocked:
            top = sorted(v.blocked.items(), key=lambda kv: -kv[1][1])[:4]
            print(f"{name}: waits by stream and waiting op: "
                  + "; ".join(f"{st} <- {who}: {n} x, {s:.3f} s" for (st, who), (n, s) in top))
    print(f"single-thread np.copyto bandwidth: {copy_rate(np):.1f} GB/s\n")
    if "all" in by_type:
        a, n = by_type["all"], by_type["none"]
        rows = sorted(((k, a.get(k, 0.0), n.get(k, 0.0)) for k in set(a) | set(n)), key=lambda r: r[2] - r[1])
        table([(f"{t} {d}", f"{x:.3f}", f"{y:.3f}", f"{x - y:+.3f}") for (t, d), x, y in rows[:8]],
              ["layer type, pass", "all s", "none s", "all - none"])


def copy_rate(np, nbytes=64 << 20):
    a, b = np.ones(nbytes, np.uint8), np.empty(nbytes, np.uint8)
    np.copyto(b, a)
    t = time.perf_counter()
    for _ in range(5):
        np.copyto(b, a)
    return 5 * nbytes / (time.perf_counter() - t) / 1e9


def main(argv=None):
    args = parse_args(argv)
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(args.threads)        # before NumPy loads its BLAS
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "tools"))
    import numpy as np
    from sncaffe.sizes import parse_bytes
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    t0 = time.perf_counter()
    print(machine(args.threads))
    print(f"command: {' '.join([Path(sys.executable).name, *sys.argv])}; numpy {np.__version__}\n", flush=True)
    capacity = parse_bytes(args.capacity)
    planner = Planner(args.batch, args.image_size)
    gc.disable()            # planning makes millions of objects: automatic collections would cost ~40%
    try:
        if "depth" not in skip:
            depth_table(planner, capacity, args.quick)
        if "ram" not in skip:
            from sncaffe.runtime.spill import spill_room
            ram_table(planner, spill_room() if args.disk else None)
        if "ratio" not in skip:
            ratio_table(planner, capacity)
    finally:
        planner.graphs.clear()
        gc.enable()
        gc.collect()
    if "speed" not in skip:
        speed(args, np)
    print(f"total {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
