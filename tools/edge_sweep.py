"""Plans near the edge of the device, run: for each net and memory mode, capacities from the
peak of the plan without a cache upward in small steps; every plan that says it fits must run at
that capacity with the pool's measured peak equal to the plan's, on the device and the host.
``segments`` is ``recompute`` from the peak of its finest whole-segment plan upward: the
capacities below the per-layer plan, where recompute replays whole segments. ``chains`` is
``recompute`` at capacities spread between that peak and the per-layer plan's, where whole
segments keep the layer chains the room holds (planner.with_kept).

    python tools/edge_sweep.py                      # every net of prototxt/ (shrunk), every mode
    python tools/edge_sweep.py --nets lenet_train_test --steps 8 --json out.json

Prints one line per (net, mode) and the totals: points planned, plans that fit, runs that met
their plan, runs that did not (with the first error). Exit status 1 if any did not.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "tests" / "plan")]

from sncaffe.backend import CPUDevice  # noqa: E402
from sncaffe.plan.planner import GRANULARITIES, MODES, MemoryExhausted, make_plan  # noqa: E402
from test_modes import OWN, graph_of, net_param, train  # noqa: E402


SWEPT = (*MODES, "segments", "chains")


def sweep(path, mode, steps=6, step_fraction=0.01):
    """[(capacity, fits, met, error)] for ``steps`` capacities from the uncached peak upward."""
    param = net_param(path)
    graph = graph_of(param)
    if mode in ("segments", "chains"):
        low = make_plan(graph, "recompute", granularity=GRANULARITIES[0]).peak
        high = make_plan(graph, "recompute", granularity=0).peak
        step = max(256, int(low * step_fraction)) if mode == "segments" else max(256, (high - low) // (steps + 1))
        low += step if mode == "chains" else 0
        mode = "recompute"
    else:
        low = make_plan(graph, mode).peak
        step = max(256, int(low * step_fraction))
    points = []
    for k in range(steps):
        capacity = low + k * step
        plan = make_plan(graph, mode, capacity)
        if not plan.fits:
            points.append((capacity, False, None, plan.overflow))
            continue
        try:
            ran, peaks = _run(param, mode, capacity)
        except (MemoryExhausted, MemoryError, AssertionError) as e:
            points.append((capacity, True, False, str(e)[:300]))
            continue
        met = all(p == ran.peak for p in peaks) and ran.peak == plan.peak
        points.append((capacity, True, met, "" if met else f"pool peaks {peaks}, plan {plan.peak}"))
    return points


def _run(param, mode, capacity):
    device = CPUDevice(capacity, host_capacity="1GiB")
    plan, steps = train(param, mode, capacity, iters=1, device=device)
    return plan, [peak for peak, _ in steps]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nets", nargs="*", help="prototxt stems (default: every net of prototxt/ but ResNet-2500)")
    ap.add_argument("--modes", nargs="*", default=list(SWEPT))
    ap.add_argument("--steps", type=int, default=6, help="capacities per (net, mode)")
    ap.add_argument("--json", help="write every point here")
    args = ap.parse_args(argv)
    nets = [p for p in OWN if not args.nets or p.stem in args.nets]
    rows, total = [], {"planned": 0, "fit": 0, "met": 0, "failed": 0}
    for path in nets:
        for mode in args.modes:
            points = sweep(path, mode, args.steps)
            fit = [p for p in points if p[1]]
            failed = [p for p in fit if not p[2]]
            total["planned"] += len(points)
            total["fit"] += len(fit)
            total["met"] += len(fit) - len(failed)
            total["failed"] += len(failed)
            print(f"{path.stem:<28}{mode:<10} planned {len(points):>3}  fit {len(fit):>3}  "
                  f"ran as planned {len(fit) - len(failed):>3}" + (f"  FAILED: {failed[0][3]}" if failed else ""),
                  flush=True)
            rows += [dict(net=path.stem, mode=mode, capacity=c, fits=f, met=m, error=e) for c, f, m, e in points]
    print(f"total: {total['planned']} planned, {total['fit']} fit, {total['met']} ran as planned, "
          f"{total['failed']} did not")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(points=rows, total=total), indent=1))
    return 1 if total["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
