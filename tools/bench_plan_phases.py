"""CPU seconds of each phase of planning one net (default: ResNet-2500, the target: at most
10 s for `sncaffe plan` and for the plan `sncaffe train` makes before its first iteration).

``plan``: what ``sncaffe plan NET`` runs (read, then ``run.plan_report``: the graph, the table
of every mode, the verdict of auto). ``train``: what ``sncaffe train NET`` runs up to its first
iteration, less binding the tensors (read as a solver or a net, the train net's graph, the
automatic plan with the solver's history). CPU time (time.process_time) is what a loaded machine
does not inflate; wall time is printed beside it. What auto plans for depends on the RAM free
when it runs (another program's use makes it plan deeper, and longer): the budgets are printed,
and ``--ram`` plans as if the pools had that much RAM, for figures to compare.

    python tools/bench_plan_phases.py
    SNCAFFE_BENCH_RESULTS=run.json python tools/bench_plan_phases.py prototxt/resnet2500.prototxt --ram 19GiB
"""
from __future__ import annotations

import argparse
import gc
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tools")]

from tables import table  # noqa: E402

from sncaffe import run  # noqa: E402
from sncaffe.graph import update_in_backward  # noqa: E402
from sncaffe.net import Net  # noqa: E402
from sncaffe.plan import planner  # noqa: E402
from sncaffe.proto import sncaffe_pb2 as pb  # noqa: E402
from sncaffe.solvers.solver import history_blocks  # noqa: E402
from sncaffe.solvers.update import RULES  # noqa: E402
from sncaffe.backend import cpu  # noqa: E402
from sncaffe.runtime import budget  # noqa: E402
from sncaffe.sizes import fmt_bytes, parse_bytes  # noqa: E402


class Phases:
    """(phase, CPU s, wall s) rows, each phase timed as it runs."""

    def __init__(self):
        self.rows = []

    def __call__(self, name, fn):
        w, c = time.perf_counter(), time.process_time()
        out = fn()
        self.rows.append((name, time.process_time() - c, time.perf_counter() - w))
        return out

    def total(self, name="total"):
        return self.rows + [(name, sum(r[1] for r in self.rows), sum(r[2] for r in self.rows))]


def fmt(rows):
    return [(name, f"{cpu:.2f}", f"{wall:.2f}") for name, cpu, wall in rows]


def plan_command(path, ram=None):
    """The phases of ``sncaffe plan PATH`` (no flags), then the command's own function end to end."""
    t, res = Phases(), run.Resources()
    param = t("read the prototxt", lambda: run.net_param(path))
    with planner.paused_gc():       # as plan_report builds it, with the updates in backward train makes
        graph = t("graph", lambda: run.build_graph(run.prepare_net(param, "TRAIN"), 0))
        update_in_backward(graph)
    reserve = history_blocks(graph, RULES["SGD"].n_history)
    capacity, kw = res.budgets(param)
    t("every mode's plan", lambda: run.mode_plans(graph, planner.MODES, reserve))
    t("host parameters' plans", lambda: run.mode_plans(graph, ("offload", "all"), 0, host_params=True))
    chosen = t("auto's verdict", lambda: planner.auto_plan(graph, capacity, reserve, **kw))
    return t.total("sum of the phases") + [whole_command(path, ram)], chosen, len(graph.layers)


def whole_command(path, ram=None):
    """("the command, whole process", CPU s, wall s) of ``sncaffe plan PATH`` in a process of its
    own, interpreter and imports included (with ``ram``: the same budget as the phases)."""
    pin = (f"from sncaffe.backend import cpu; from sncaffe.runtime import budget; "
           f"budget.ram_budget = cpu.ram_budget = lambda: {ram}; ") if ram else ""
    code = f"import sys; {pin}from sncaffe.cli import main; sys.exit(main(['plan', {str(path)!r}]))"
    before, w = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return "the command, whole process", cpu, time.perf_counter() - w


def train_plan(path):
    """The phases of ``sncaffe train PATH --max-iter 1`` (no flags) before binding: what
    run.train and Solver do, in their order, for a solver or net without test nets."""
    t, res = Phases(), run.Resources()
    p, _ = t("read as a solver or a net", lambda: run.solver_param(path, max_iter=1, snapshot_prefix=os.devnull))
    net_param = p.net_param if p.HasField("net_param") else None
    device = t("device and its budgets", lambda: res.make_device(p, net_param))

    def graph():
        q = pb.NetParameter()
        q.CopyFrom(p.net_param)
        q.state.CopyFrom(pb.NetState(phase=pb.TRAIN))
        net = Net(q, "TRAIN", device=device, memory="auto", defer=True)
        update_in_backward(net.graph)          # as the Solver of train marks it
        return net
    net = t("graph", graph)
    history = history_blocks(net.graph, RULES[p.type or "SGD"].n_history)
    plan = t("automatic plan", lambda: net.make_plan(None, history))
    return t.total(), plan


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("net", nargs="?", default=str(ROOT / "prototxt" / "resnet2500.prototxt"))
    ap.add_argument("--only", choices=("plan", "train"), help="one command's phases only")
    ap.add_argument("--ram", help="the RAM the pools may hold together (default: this machine's now)")
    args = ap.parse_args(argv)
    if args.ram:            # both readers of the budget (the plan's and the CPU device's)
        budget.ram_budget = cpu.ram_budget = lambda ram=parse_bytes(args.ram): ram
    capacity, kw = run.Resources().budgets(None)
    print(f"budgets: device {fmt_bytes(capacity)}, RAM {fmt_bytes(kw['ram'])}"
          + ("" if args.ram else " (this machine's now)") + f", disk for the spill file {fmt_bytes(kw['spill'])}")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"{args.net}: CPU and wall seconds per phase (load average {load:.1f} on {os.cpu_count()} cores "
          "at start)\n")
    if args.only in (None, "plan"):
        rows, chosen, n = plan_command(args.net, args.ram and parse_bytes(args.ram))
        print(f"sncaffe plan: {n} layers, auto chose '{chosen.mode}', device peak {fmt_bytes(chosen.peak)}")
        table(fmt(rows), ("sncaffe plan", "CPU s", "wall s"))
    gc.collect()            # the plan phases' garbage, not the train phases' to collect
    if args.only in (None, "train"):
        rows, plan = train_plan(args.net)
        print(f"sncaffe train, before the first iteration: auto chose '{plan.mode}', "
              f"device peak {fmt_bytes(plan.peak)}")
        table(fmt(rows), ("sncaffe train's plan", "CPU s", "wall s"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
