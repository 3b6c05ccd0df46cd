"""Weak scaling of data-parallel training on the CPU, and how much all-reduce hides behind backward.

    python tools/bench_parallel.py [--ranks 1 2] [--iters 30] [--nets lenet mlp]

For each net and number of ranks N it runs ``mpiexec -n N`` (the venv's
own) on this script in worker mode, one BLAS thread per rank, each rank at
the same batch (weak scaling: N times the images per iteration). A worker
trains with synthetic inputs through the Solver and DataParallel, times
``--iters`` iterations after a warm-up, and traces ``--traces`` more. The
table: ms per iteration, images/s, weak-scaling efficiency (time at 1 rank /
time at N ranks), the same for N processes that train alone (no gradient
exchange: the ceiling the machine allows, since ranks share its cores and
memory), and from the traces the all-reduce time per iteration and the
share of it that ran while backward was computing (medians), for each
gradient bucket size of ``--bucket-mb``.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# A multilayer perceptron whose gradients (about 10 MB) take real time to all-reduce.
MLP = """name: "mlp"
layer { name: "data" type: "Input" top: "data" top: "label"
        input_param { shape { dim: 64 dim: 784 } shape { dim: 64 } } }
layer { name: "ip1" type: "InnerProduct" bottom: "data" top: "ip1"
        inner_product_param { num_output: 1024 weight_filler { type: "xavier" } } }
layer { name: "relu1" type: "ReLU" bottom: "ip1" top: "ip1" }
layer { name: "ip2" type: "InnerProduct" bottom: "ip1" top: "ip2"
        inner_product_param { num_output: 1024 weight_filler { type: "xavier" } } }
layer { name: "relu2" type: "ReLU" bottom: "ip2" top: "ip2" }
layer { name: "ip3" type: "InnerProduct" bottom: "ip2" top: "ip3"
        inner_product_param { num_output: 10 weight_filler { type: "xavier" } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip3" bottom: "label" top: "loss" }
"""


def net_param(name, batch):
    from sncaffe.proto import sncaffe_pb2 as pb
    from sncaffe.prototxt import filter_net, parse_text, read_text, replace_data_layers, set_batch
    if name == "lenet":
        param = read_text(ROOT / "prototxt" / "lenet_train_test.prototxt", pb.NetParameter())
        param = replace_data_layers(filter_net(param, "TRAIN"), {"data": (batch, 1, 28, 28), "label": (batch,)})
        return param
    if name == "mlp":
        return set_batch(parse_text(MLP, pb.NetParameter()), batch)
    raise ValueError(f"unknown net {name!r} (lenet, mlp)")


def worker(args) -> None:
    """One rank: train, time, trace; rank 0 prints a JSON line."""
    import logging

    import numpy as np

    from sncaffe.cli import SyntheticInputs
    from sncaffe.parallel import DataParallel, IterationTrace, overlap, world
    from sncaffe.proto import sncaffe_pb2 as pb
    from sncaffe.solvers import Solver
    logging.getLogger("sncaffe").setLevel(logging.WARNING)
    comm = world()
    p = pb.SolverParameter(base_lr=0.01, momentum=0.9, lr_policy="fixed", max_iter=10**6, random_seed=1,
                           snapshot_after_train=False)
    p.net_param.CopyFrom(net_param(args.net, args.batch))
    solver = Solver(p, device="cpu")
    solver.feed = SyntheticInputs(1)
    parallel = None
    if comm is not None and comm.Get_size() > 1 and not args.alone:
        parallel = DataParallel(solver, comm, bucket_bytes=int(args.bucket_mb[0] * 2**20))
    solver.step(args.warmup)
    root = comm is None or comm.Get_rank() == 0
    tracers = [IterationTrace(solver, f"{args.trace}.{k}", args.warmup + k) for k in range(args.traces) if root]
    solver.step(args.traces)
    t0, cpu0 = time.perf_counter(), time.process_time()
    solver.step(args.iters)
    seconds = (time.perf_counter() - t0) / args.iters
    cpu = (time.process_time() - cpu0) / args.iters
    if parallel is not None:
        parallel.close()
    if root:
        shares = [overlap(t.spans) for t in tracers]
        median = {k: float(np.median([o[k] for o in shares])) for k in shares[0]}
        print(json.dumps({"ms": seconds * 1e3, "cpu_ms": cpu * 1e3, "buckets": len(parallel.buckets) if parallel else 0,
                          **median}), flush=True)


def run(net, ranks, args, bucket_mb=25.0, alone=False) -> dict:
    mpiexec = Path(sys.executable).parent / "mpiexec"
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [str(mpiexec), "-n", str(ranks), sys.executable, __file__, "--worker", "--net", net,
               "--batch", str(args.batch), "--iters", str(args.iters), "--warmup", str(args.warmup),
               "--traces", str(args.traces),
               "--bucket-mb", str(bucket_mb), "--trace", os.path.join(tmp, "trace.json")] + \
            (["--alone"] if alone else [])
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if out.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{out.stdout}{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nets", nargs="+", default=["lenet", "mlp"])
    ap.add_argument("--ranks", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--batch", type=int, default=64, help="images per rank (default: %(default)s)")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--traces", type=int, default=5, help="iterations traced (default: %(default)s)")
    ap.add_argument("--bucket-mb", type=float, nargs="+", default=[25.0, 1.0],
                    help="bucket sizes to try at N > 1 ranks (default: %(default)s)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--net", help=argparse.SUPPRESS)
    ap.add_argument("--trace", help=argparse.SUPPRESS)
    ap.add_argument("--alone", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    print(f"weak scaling on the CPU ({os.cpu_count()} cores), batch {args.batch} per rank, "
          f"{args.iters} iterations timed after {args.warmup + args.traces}, 1 BLAS thread per rank")
    print("efficiency: ms/iter at 1 rank / ms/iter at N ranks (1.00: perfect weak scaling); 'alone': the same N\n"
          "processes training without exchanging gradients, the ceiling this machine allows; all-reduce ms and\n"
          "hidden: per traced iteration (median), the time some all-reduce ran and the share of it under backward")
    print(f"{'net':<7}{'ranks':>6}{'bucket MB':>10}{'buckets':>8}{'ms/iter':>9}{'images/s':>10}{'efficiency':>11}"
          f"{'alone eff':>10}{'all-reduce ms':>14}{'hidden':>8}")
    for net in args.nets:
        base = None
        for n in args.ranks:
            alone = run(net, n, args, alone=True)["ms"] if n > 1 else None
            for mb in (args.bucket_mb if n > 1 else [None]):
                r = run(net, n, args, mb or 25.0)
                base = r["ms"] if base is None else base
                alone_eff = f"{base / alone:.2f}" if alone else "-"
                comm = f"{r['comm_s'] * 1e3:.1f}" if n > 1 else "-"
                hidden = f"{100 * r['hidden_share']:.0f}%" if n > 1 else "-"
                images = n * args.batch / r["ms"] * 1e3
                print(f"{net:<7}{n:>6}{mb or '-':>10}{r['buckets']:>8}{r['ms']:>9.1f}{images:>10.0f}"
                      f"{base / r['ms']:>11.2f}{alone_eff:>10}{comm:>14}{hidden:>8}", flush=True)


if __name__ == "__main__":
    main()
