"""One training iteration against the GEMM bound: what ``sncaffe train NET --max-iter 1`` (no
other flag) takes for its iteration, wall and CPU seconds, beside the time the net's
convolutions and inner products would take at this machine's measured GEMM rate, at the same
thread count.

The FLOPs come from the net's layers: each convolution and inner product's forward
(plan/result.layer_flops), its weight gradient where the layer learns, its data gradient where
its bottom needs one (3x forward for all but the first layer); a second bound adds the forward
FLOPs the plan recomputes, at the same rate. The rate is measured here, after the thread policy has set the BLAS threads as
``train`` does: sncaffe's BLAS (blas.gemm, MKL where installed) on each distinct GEMM of the
net's layers (im2col: out channels x channels*kernel x positions), the operand kept to 64 MiB
by taking fewer positions. The bound is the sum over layers of FLOPs / the rate of its shape.

The iteration is what ``train`` runs (the same solver, plan, thread policy, synthetic inputs),
timed around ``Solver.step(1)``; nothing is snapshotted. ResNet-2500 needs about 21 GiB of RAM
and minutes:

    python tools/bench_gemm_bound.py prototxt/resnet2500.prototxt
    python tools/bench_gemm_bound.py prototxt/resnet50.prototxt --batch 2     # a quick check
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tools")]

import numpy as np  # noqa: E402
from tables import table  # noqa: E402

from sncaffe import run  # noqa: E402
from sncaffe.backend import blas  # noqa: E402
from sncaffe.data.synthetic import SyntheticInputs  # noqa: E402
from sncaffe.plan.result import layer_flops  # noqa: E402
from sncaffe.solvers import Solver  # noqa: E402

GEMM_LAYERS = ("Convolution", "InnerProduct")
OPERAND = 64 << 20          # bytes of the largest operand a rate is measured on


def gemm_shape(node) -> tuple:
    """(M, K, N) of the layer's forward GEMM: out channels (per group), what one output sums
    over, output positions of the batch (im2col)."""
    w = node.params[0][0].shape
    top = node.tops[0].shape
    if node.type == "InnerProduct":
        return int(w[0]), int(np.prod(w[1:])), int(np.prod(top[:-1]))
    group = max(1, int(node.layer.param.convolution_param.group))
    return int(w[0]) // group, int(np.prod(w[1:])), int(top[0]) * int(np.prod(top[2:]))


def layer_work(graph) -> list:
    """(name, (M, K, N), FLOPs of forward and backward) for every convolution and inner product."""
    out = []
    for node in graph.layers:
        if node.type not in GEMM_LAYERS or not node.params:
            continue
        fwd = layer_flops(node)
        learns = node.need_backward and any(node.param_need_backward or [True])
        data = node.need_backward and any(node.propagate_down or [False])
        out.append((node.name, gemm_shape(node), fwd * (1 + learns + data)))
    return out


def gemm_rate(m, k, n, repeat=3) -> float:
    """FLOP/s of sncaffe's BLAS on an (m, k) @ (k, n) single-precision GEMM, fastest of ``repeat``."""
    n = max(1, min(n, OPERAND // 4 // max(k, 1)))
    rng = np.random.default_rng(0)
    a = rng.standard_normal((m, k), dtype=np.float32)
    b = rng.standard_normal((k, n), dtype=np.float32)
    c = np.zeros((m, n), np.float32)
    blas.gemm(a, b, c)                  # warm: the BLAS's threads started, pages touched
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        blas.gemm(a, b, c)
        best = min(best, time.perf_counter() - t)
    return 2 * m * k * n / best


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("net", help="a net prototxt (trained with train's default solver) or a solver")
    ap.add_argument("--batch", type=int, help="batch size (default: the net's)")
    ap.add_argument("--threads", type=int, help="train's --threads (default: the thread policy's choice)")
    ap.add_argument("--rate-only", action="store_true", help="the FLOPs and the bound, no iteration")
    ap.add_argument("--memory", help="train's --memory (default: auto, as train with no flags)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    res = run.Resources(threads=args.threads, memory=args.memory)
    with tempfile.TemporaryDirectory() as tmp:
        p, _ = run.solver_param(args.net, max_iter=1, batch=args.batch, snapshot_prefix=os.path.join(tmp, "s"))
        p.snapshot_after_train = False
        decision = res.configure_threads()
        graph = run.build_graph(run.prepare_net(p.net_param, "TRAIN"), 0)
        work = layer_work(graph)
        shapes = list(dict.fromkeys(s for _, s, _ in work))
        before = {shape: gemm_rate(*shape) for shape in shapes}
        flops = sum(f for _, _, f in work)
        print(f"{args.net}: {len(graph.layers)} layers, {len(work)} convolutions and inner products, "
              f"{len(shapes)} distinct GEMM shapes; BLAS {blas.BLAS.describe()}; threads: {decision.describe()}")
        del graph
        rows = [["GEMM FLOPs of one iteration (forward and backward)", f"{flops / 1e9:.1f} GFLOP"]]
        bound = sum(f / before[s] for _, s, f in work)
        if args.rate_only:
            rows += [["measured GEMM rate over them", f"{flops / bound / 1e9:.1f} GFLOP/s at {decision.threads} threads"],
                     ["GEMM bound: FLOPs / rate", f"{bound:.2f} s"]]
        else:
            solver = Solver(p, device=res.make_device(p, p.net_param), memory=res.memory,
                            update_in_backward=True)      # as train makes it
            if solver.net.inputs:
                solver.feed = SyntheticInputs(solver.seed)
            recomputed = solver.net.plan.recompute_flops
            w, c = time.perf_counter(), time.process_time()
            solver.step(1)
            wall, cpu = time.perf_counter() - w, time.process_time() - c
            mode = solver.net.plan.mode
            del solver
            # The rate measured again after the iteration, each shape's faster kept: a shared host's
            # slow moment while the rate is measured would otherwise lower the bound's rate and
            # flatter the ratio.
            after = {shape: gemm_rate(*shape) for shape in shapes}
            rates = {shape: max(before[shape], after[shape]) for shape in shapes}
            bound = sum(f / rates[s] for _, s, f in work)

            def mean(r):
                return flops / sum(f / r[s] for _, s, f in work) / 1e9
            rows += [["measured GEMM rate over them, before / after the iteration",
                      f"{mean(before):.1f} / {mean(after):.1f} GFLOP/s at {decision.threads} threads"],
                     ["GEMM bound: FLOPs / rate (each shape's faster)", f"{bound:.2f} s"]]
            rows += [["memory mode", mode + (f", {recomputed / 1e9:.1f} GFLOP recomputed"
                                                            if recomputed else "")],
                     ["iteration, wall", f"{wall:.2f} s ({wall / bound:.2f}x the bound)"],
                     ["iteration, CPU (all threads)", f"{cpu:.2f} s ({cpu / (bound * decision.threads):.2f}x "
                                                      f"the bound on {decision.threads} threads)"]]
            if recomputed:
                replayed = bound * (flops + recomputed) / flops    # the recomputed forward at the mean rate
                rows += [["GEMM bound with the recomputed FLOPs", f"{replayed:.2f} s"],
                         ["iteration against it, wall / CPU", f"{wall / replayed:.2f}x / "
                                                              f"{cpu / (replayed * decision.threads):.2f}x"]]
    table(rows, ["figure", "value"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
