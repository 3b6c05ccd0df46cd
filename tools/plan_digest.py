"""Digests of memory plans, to check that a change to the planner's code leaves its plans alone.

Each case (a net, a mode or ``auto``, a capacity, host parameters, a disk tier, a test net
beside its train net) is planned and reduced to one line: the mode chosen, a hash of every
instruction in order (kind, tensor, size, fill, source, tier, chunk and workspace), the peaks
of each tier and the traffic. ``--save FILE`` records them; ``--compare FILE`` plans again
and prints every case whose digest differs (exit status 1 if any does).

    python tools/plan_digest.py --save /tmp/plans.json          # before a refactoring
    python tools/plan_digest.py --compare /tmp/plans.json       # after each step
    python tools/plan_digest.py --compare /tmp/plans.json --big # with ResNet-2500 (slow)

Nets: prototxt/ and tests/data/shared/zoo, shrunk as tests/plan/test_modes.py runs them (batch 2),
and LeNet's solver with its test net (planned as one, plan/joint.py) at tight capacities.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "tests" / "plan"), str(ROOT / "tools")]

from sncaffe.plan.planner import MODES, shared_ram_plan, auto_plan, make_plan  # noqa: E402
from sncaffe.solvers.solver import history_blocks  # noqa: E402

MiB = 1 << 20


def digest(plan) -> dict:
    h = hashlib.sha1()
    for ins in plan.schedule:
        if ins.kind == "run":
            ws = sorted((k, t.name, t.nbytes) for k, t in (ins.workspace or {}).items())
            line = f"run {ins.op.name} {ins.recompute} {ins.chunk} {ws}"
        else:
            src = ins.source.name if ins.source is not None else ""
            line = f"{ins.kind} {ins.tensor.name} {ins.tensor.nbytes} {ins.fill} {src} {ins.tier}"
        h.update(line.encode() + b"\n")
    h.update(f"|{len(plan.schedule.forward)}".encode())
    return dict(mode=plan.mode, note=plan.note, fits=plan.fits, overflow=plan.overflow, instr=h.hexdigest()[:16],
                n=len(plan.schedule.forward) + len(plan.schedule.backward),
                peaks=sorted(plan.peaks.items()), peak=plan.peak, host_peak=plan.host_peak, disk_peak=plan.disk_peak,
                disk_base=plan.disk_base, param_disk=plan.param_disk, d2h=plan.d2h_bytes, h2d=plan.h2d_bytes,
                flops=plan.recompute_flops, mc=plan.memory_centric, hits=plan.cache_hits, misses=plan.cache_misses,
                chunk_trials=plan.chunk_trials, lower_bound=plan.lower_bound, persistent=plan.persistent_bytes,
                offloaded=len(plan.offloaded), dropped=len(plan.dropped), host_params=len(plan.host_params))


def net_cases(path):
    """(name, thunk) for one net's plans."""
    from test_modes import graph_of, net_param
    graph = graph_of(net_param(path))
    history = history_blocks(graph, 1)
    free = {m: make_plan(graph, m) for m in MODES}
    out = [(m, (lambda p=free[m]: p)) for m in MODES]
    def at(plan, f):        # what always lives, and a fraction of the rest
        return plan.persistent_bytes + int((plan.peak - plan.persistent_bytes) * f)
    for m in MODES:
        p = free[m].peak
        for f in (1.0, 0.9, 0.75, 0.5):
            cap = at(free[m], f) + (256 if f == 1.0 else 0)
            out.append((f"{m}@{f}", lambda m=m, cap=cap: make_plan(graph, m, cap)))
        if m in ("recompute", "all"):
            out.append((f"{m}-mc", lambda m=m: make_plan(graph, m, None, cost_aware=False, memory_centric=True)))
            out.append((f"{m}-raw@0.8", lambda m=m: make_plan(graph, m, at(free[m], 0.8), cost_aware=False)))
        if m in ("none", "liveness"):
            out.append((f"{m}-fwd", lambda m=m: make_plan(graph, m, forward_only=True)))
    hist = sum(history)
    none = free["none"].peak + hist
    for f in (1.0, 0.6, 0.3):
        out.append((f"auto@{f}", lambda f=f: auto_plan(graph, at(free["none"], f) + hist, history)))
    for m in ("all", "liveness", "offload"):
        out.append((f"{m}-hostparams@0.5", lambda m=m: make_plan(graph, m, at(free["liveness"], 0.5),
                                                                 host_params=True, host_extra=history)))
    off = free["offload"]
    for m in ("offload", "all"):       # the disk tier: a host pool a third of what is offloaded
        out.append((f"{m}-disk", lambda m=m: make_plan(graph, m, at(free[m], 1.0) + hist, history,
                                                       host_room=off.host_peak // 3, spill=1 << 40)))
        out.append((f"{m}-disk@0.6", lambda m=m: make_plan(graph, m, at(free[m], 0.6) + hist, history,
                                                           host_room=off.host_peak // 3, spill=1 << 40)))
    out.append(("auto-ram", lambda: auto_plan(graph, none, history, ram=at(free["offload"], 0.7) + off.host_peak // 2,
                                              host_capacity=off.host_peak // 2, spill=1 << 40)))
    out.append(("all-paramdisk", lambda: shared_ram_plan(graph, "all", none // 2, 0, host_params=True,
                                                          host_extra=history, host_capacity=none // 50,
                                                          spill=1 << 40)))
    return out


def solver_cases():
    """LeNet's train net and test net planned as one (the Solver's plans), at tight devices."""
    from test_joint import solver
    out = []
    for mib in (12, 16, 20, 24, 32, 40, 64):
        for mode in (None, "liveness", "recompute", "offload", "all"):
            def thunk(mib=mib, mode=mode):
                try:
                    s = solver(mib * MiB, mode)
                except MemoryError as e:
                    return {"error": str(e)[:120]}
                return [digest(s.net.plan)] + [digest(n.plan) for n in s.test_nets]
            out.append((f"lenet-solver@{mib}MiB-{mode or 'auto'}", thunk))
    return out


def big_cases():
    from gen_resnet import blocks_for_depth, generate
    from sncaffe.graph import build_graph
    from sncaffe.proto import sncaffe_pb2 as pb
    from sncaffe.prototxt import parse_text, prepare_net
    param = prepare_net(parse_text(generate(blocks_for_depth(2500), batch=16), pb.NetParameter()), pb.TRAIN)
    graph = build_graph(param, pb.TRAIN)
    history = history_blocks(graph, 1)
    return [("resnet2500/auto@12GiB", lambda: auto_plan(graph, 12 << 30, history))]


def all_cases(big=False, only=None):
    from test_modes import OWN, ZOO
    for path in OWN + ZOO:
        name = path.relative_to(path.parents[1]).as_posix()
        if only and only not in name:
            continue
        for case, thunk in net_cases(path):
            yield f"{name}/{case}", thunk
    if not only or "lenet-solver" in only:
        yield from solver_cases()
    if big:
        yield from big_cases()


def run(big=False, only=None) -> dict:
    out, t0 = {}, time.perf_counter()
    for name, thunk in all_cases(big, only):
        res = thunk()
        out[name] = res if isinstance(res, (list, dict)) and not hasattr(res, "schedule") else digest(res)
    print(f"{len(out)} plans in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--save")
    ap.add_argument("--compare")
    ap.add_argument("--big", action="store_true", help="also ResNet-2500's auto plan at 12 GiB (slow)")
    ap.add_argument("--only", help="only the cases whose net name contains this")
    args = ap.parse_args(argv)
    got = json.loads(json.dumps(run(args.big, args.only)))
    if args.save:
        Path(args.save).write_text(json.dumps(got, indent=0, sort_keys=True))
        print(f"saved {len(got)} digests to {args.save}")
    if args.compare:
        want = json.loads(Path(args.compare).read_text())
        differ = [k for k in got if k in want and got[k] != want[k]]
        missing = [k for k in got if k not in want]
        for k in differ:
            print(f"DIFFERS {k}:\n  was {want[k]}\n  now {got[k]}")
        print(f"{len(got) - len(differ) - len(missing)} identical, {len(differ)} differ, {len(missing)} not recorded")
        return 1 if differ else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
