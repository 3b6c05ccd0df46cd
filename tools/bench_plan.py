"""How long planning takes against depth: ResNet-50 ... ResNet-2500 (the target:
ResNet-2500 in at most 10 s). For each depth: the graph's build, then what ``sncaffe train`` does before
its first iteration, ``auto`` at a device capacity (default 12 GiB, a K40c's), and with
--modes every mode without a capacity. Wall and CPU seconds (CPU time is what a loaded
machine does not inflate); run it alone, on a quiet machine, for figures worth quoting.

    python tools/bench_plan.py                       # depths 50 101 152 302 602 1202 2500
    python tools/bench_plan.py --depths 50,2500 --capacity 12GiB --modes
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
sys.path.insert(0, str(ROOT))

from gen_resnet import blocks_for_depth, generate  # noqa: E402

from sncaffe.graph import build_graph  # noqa: E402
from sncaffe.plan.planner import MODES, auto_plan, make_plan  # noqa: E402
from sncaffe.sizes import fmt_bytes, parse_bytes  # noqa: E402
from sncaffe.proto import sncaffe_pb2 as pb  # noqa: E402
from sncaffe.prototxt import parse_text, prepare_net  # noqa: E402
from sncaffe.solvers.solver import history_blocks  # noqa: E402


def timed(fn):
    w, c = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - w, time.process_time() - c


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--depths", default="50,101,152,302,602,1202,2500")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--capacity", default="12GiB", help="device capacity auto plans for (default: %(default)s)")
    ap.add_argument("--modes", action="store_true", help="also time each mode's plan without a capacity")
    args = ap.parse_args(argv)
    capacity = parse_bytes(args.capacity)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"plan time against depth: batch {args.batch}, auto at {fmt_bytes(capacity)} with SGD history; "
          f"load average {load:.1f} on {os.cpu_count()} cores at start")
    head = f"{'depth':>6}{'layers':>8}{'graph s':>9}{'auto wall s':>13}{'auto cpu s':>12}  {'mode':<10}{'peak':>12}"
    if args.modes:
        head += "".join(f"{m + ' s':>11}" for m in MODES)
    print(head)
    print("-" * len(head))
    for depth in (int(d) for d in args.depths.split(",")):
        text = generate(blocks_for_depth(depth), batch=args.batch)
        param = prepare_net(parse_text(text, pb.NetParameter()), pb.TRAIN)
        graph, gw, _ = timed(lambda: build_graph(param, pb.TRAIN))
        history = history_blocks(graph, 1)
        plan, aw, ac = timed(lambda: auto_plan(graph, capacity, history))
        line = (f"{depth:>6}{len(graph.layers):>8}{gw:>9.1f}{aw:>13.1f}{ac:>12.1f}  "
                f"{plan.mode + ('' if plan.fits else '!'):<10}{fmt_bytes(plan.peak):>12}")
        if args.modes:
            for mode in MODES:
                _, mw, _ = timed(lambda: make_plan(graph, mode, None, history))
                line += f"{mw:>11.1f}"
        print(line, flush=True)
    print("(! : no mode fits the capacity; the leanest plan is shown)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
