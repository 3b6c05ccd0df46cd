"""sncaffe's recomputation against Checkmate's optimum (Jain et al. 2020) on nets small enough
to solve: for budgets from no recomputation down to the least any schedule needs, the FLOPs
Checkmate's MILP replays (sncaffe/plan/checkmate.py, HiGHS) and those sncaffe's plan replays at
the same budget.

    python tools/bench_checkmate.py                         # LeNet and the CIFAR-10 ResNet, batch 2
    python tools/bench_checkmate.py --nets cifar10_resnet --steps 8 --time-limit 300

The rule that makes the budgets the same: workspaces are left out of both sides (Checkmate's
model has none; the bench drops them from the graph before planning), and sncaffe's capacity is
the budget plus what its plan holds outside the model (``persistent_bytes + extra_bytes``:
parameters, their gradients, the net's inputs and outputs). sncaffe's choice at a capacity is
what ``auto`` would pick among the modes without copies: ``liveness`` where it fits, else
``recompute`` (per layer, else whole segments with the best layer chains kept).

Writes the tables, with the question and notes, to benchmarks/results/16_checkmate.json (or
where ``SNCAFFE_BENCH_RESULTS`` or ``--out`` says).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tools"), str(ROOT / "tests"), str(ROOT / "tests" / "plan")]

import tables  # noqa: E402
from sncaffe.plan import checkmate as cm  # noqa: E402
from sncaffe.plan.planner import make_plan  # noqa: E402
from test_modes import graph_of, net_param  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "16_checkmate.json"
QUESTION = ("How many FLOPs does sncaffe's recomputation replay at a memory budget, against the least any "
            "schedule replays there (Checkmate's MILP, solved exactly on small nets)?")
COLUMNS = ["net", "budget (KiB)", "Checkmate FLOPs", "solve", "sncaffe plan", "sncaffe FLOPs", "ratio",
           "sncaffe's chains in the model"]


def without_workspaces(graph):
    """Workspaces are outside Checkmate's model: left out of sncaffe's plans too."""
    for op in graph.forward_ops + graph.backward_ops:
        op.writes = [t for t in op.writes if t.kind != "workspace"]
        op.reads = [t for t in op.reads if t.kind != "workspace"]
    return graph


def sncaffe_choice(graph, capacity):
    """``liveness`` where it fits, else ``recompute``: what auto picks without copies."""
    plan = make_plan(graph, "liveness", capacity)
    if plan.fits:
        return plan, "liveness"
    plan = make_plan(graph, "recompute", capacity)
    if plan.granularity:
        how = f"segments {plan.granularity}x, {plan.kept} chains kept"
    elif plan.recompute_flops:
        how = "per layer"
    else:
        how = "recompute (not used)"
    return plan, how + ("" if plan.fits else ", does not fit")


def kib(n):
    return f"{n / 1024:,.1f}"


def flops(n):
    return "-" if n is None else f"{n:,}"


def ratio(ours, sol):
    """ours over the optimum; where the solver stopped early, the range its incumbent and its
    lower bound give (the optimum lies between them)."""
    if ours is None or not sol.feasible:
        return "-"
    one = lambda best: ("1.00" if ours == 0 else "inf") if best <= 0 else f"{ours / best:.2f}"
    return one(sol.cost) if sol.status == "optimal" else f"{one(sol.cost)}-{one(int(sol.bound or 0))}"


def bench(name, batch, steps, time_limit):
    graph = without_workspaces(graph_of(net_param(ROOT / "prototxt" / f"{name}.prototxt", batch)))
    problem = cm.build_problem(graph)
    top = cm.check(problem, *cm.replay_schedule(problem, set()))
    floor = max(problem.mem[k] + sum(problem.mem[i] for i in problem.deps[k]) for k in range(len(problem)))
    base = make_plan(graph, "liveness")
    outside = base.persistent_bytes + base.extra_bytes
    rows, facts = [], dict(net=name, batch=batch, nodes=len(problem), forward=problem.nf,
                           recomputable=sum(problem.recomputable), top=top, floor=floor, outside=outside)
    seen = set()
    for k in range(steps + 1):
        budget = top - (top - floor) * k // steps
        if budget in seen:
            continue
        seen.add(budget)
        sol = cm.solve(problem, budget, time_limit=time_limit)
        if sol.feasible:
            cm.check(problem, sol.R, sol.S, budget)          # the solver's schedule, replayed
        plan, how = sncaffe_choice(graph, budget + outside)
        ours = plan.recompute_flops if plan.fits else None
        R, S = cm.replay_schedule(problem, cm.replayed_nodes(problem, plan))
        model = f"{kib(cm.check(problem, R, S))} KiB, {cm.recomputed_flops(problem, R):,}"
        status = sol.status if sol.status in ("optimal", "infeasible") or not sol.feasible else \
            f"stopped, bound {sol.bound:,.0f}"
        rows.append([f"{name} (batch {batch}, {len(problem)} nodes)", kib(budget),
                     flops(sol.cost) if sol.feasible else sol.status, f"{status}, {sol.seconds:.1f} s",
                     how, flops(ours), ratio(ours, sol), model])
    return rows, facts


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nets", default="lenet_train_test,cifar10_resnet",
                    help="prototxt/ names (default: %(default)s)")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6, help="budgets between no recomputation and the floor")
    ap.add_argument("--time-limit", type=float, default=120.0, help="seconds per MILP (default: %(default)s)")
    ap.add_argument("--out", help=f"result file (default: $SNCAFFE_BENCH_RESULTS, else {OUT.relative_to(ROOT)})")
    args = ap.parse_args(argv)
    rows, facts = [], []
    for name in args.nets.split(","):
        r, f = bench(name, args.batch, args.steps, args.time_limit)
        rows += r
        facts.append(f)
    tables.table(rows, COLUMNS)
    notes = [
        "Same budget: workspaces left out of both sides (Checkmate's model has none; the bench drops them from "
        "the graph), sncaffe's capacity = the budget + what its plan holds outside the model (parameters, "
        "gradients, the net's inputs and outputs). sncaffe's plan: liveness where it fits, else recompute, as "
        "auto picks before copies. Ratio: sncaffe's FLOPs over Checkmate's optimum; where the MILP stopped at "
        "its time limit, the FLOPs are its best schedule's and the ratio a range (over that schedule, over the "
        "solver's lower bound).",
        "Checkmate's model: nodes are sncaffe's layer chains (a convolution or other checkpoint operator and the "
        "cheap layers after it), forward then backward; a chain's output is every value it writes, replayed "
        "whole. Budgets run from the peak with nothing replayed down to the most one node needs (its inputs and "
        "output); below the smallest feasible one Checkmate reports the budget infeasible.",
        "sncaffe's chains in the model: the chains of which sncaffe's plan replays an operator, recomputed whole "
        "as sncaffe replays (once, at the first backward need, kept to the last use), with that schedule's peak "
        "and FLOPs in Checkmate's model. Per-layer recomputation replays only the cheap layers of a chain and "
        "keeps a snapshot of the convolution's output, which the model cannot express: there sncaffe's own "
        "FLOPs are far below its chains' in the model.",
        "Where sncaffe replays less than the optimum (ratio below 1) the model is the coarser: it holds a "
        "chain's values (the convolution's output, BatchNorm's statistics and normalized copy, the ReLU) until "
        "the last use of any of them, where sncaffe frees each at its own last use and replays only the cheap "
        "layers. Where sncaffe replays more (whole segments at the tightest budgets) it replays each segment "
        "once, speed-centric, and keeps chains by FLOPs per byte, greedily; Checkmate may replay a chain twice "
        "or hold a value over a stretch to pay less.",
    ]
    for f in facts:
        notes.append(f"{f['net']} at batch {f['batch']}: {f['nodes']} nodes ({f['forward']} forward, "
                     f"{f['recomputable']} recomputable), peak with nothing replayed {kib(f['top'])} KiB, floor "
                     f"{kib(f['floor'])} KiB, {kib(f['outside'])} KiB held outside the model.")
    result = tables.results()
    result.update(title="sncaffe's recomputation against Checkmate's optimum", question=QUESTION, notes=notes)
    out = args.out or os.environ.pop(tables.RESULTS_ENV, None) or str(OUT)
    with open(out, "w") as fh:
        json.dump({k: result[k] for k in ("title", "question", "command", "machine", "threads", "tables", "notes")},
                  fh, indent=1)
        fh.write("\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
