"""Replicas with cross-replica BatchNorm against one location at the summed batch, on full-size nets.

    python tools/check_sync_bn.py [--nets cifar_resnet resnet50] [--batch 8] [--iters 3] [--lr 0.1]

For each net, three trainings, each in a process of its own (one BLAS thread,
the same synthetic batches, the same starting weights):

- ``one``: one location at batch 2B;
- ``replicas``: the net replicated on cpu:0 and cpu:1 at B each, gradients
  summed, BatchNorm statistics exchanged (``sncaffe.parallel.sync_bn``);
- ``per-replica``: the same with each replica's BatchNorm on its own B
  images (the exchange taken out): what the exchange removes.

It prints, after ``--iters`` iterations, the largest absolute difference
from ``one`` and the relative one (norm of the differences over the norm of
the values) of the learned parameters, of the BatchNorm blobs (running mean
and variance sums) and of the solver history, the largest
difference between the two replicas (0: they stay equal to the bit) and the
losses. ``--lr 0`` keeps the weights fixed: then only BatchNorm's statistics
move, and what differs is what rounding reaches BatchNorm's inputs (a
convolution's GEMM may round an image's outputs by where the image sits in
the batch), not BatchNorm's own arithmetic. With learning, the replicas sum
each gradient in another order than one location, and a fresh ResNet
amplifies that rounding from one iteration to the next (``--dtype float64``
shows the same growth from a far smaller start), while per-replica
statistics differ at the level of the statistics themselves.
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

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
FILES = {"cifar_resnet": "cifar10_resnet.prototxt", "resnet50": "resnet50.prototxt"}
LOCATIONS = ["cpu:0", "cpu:1"]


def worker(args):
    """Train one configuration; write {name: array} of parameters, BatchNorm blobs and history."""
    from sncaffe.data.synthetic import SyntheticInputs
    from sncaffe.parallel.replicas import Replicas, replicate
    from sncaffe.proto import sncaffe_pb2 as pb
    from sncaffe.prototxt import read_text, set_batch
    from sncaffe.solvers import Solver
    param = set_batch(read_text(ROOT / "prototxt" / FILES[args.net], pb.NetParameter()), 2 * args.batch)
    if args.hw:                 # smaller images: the final 7x7 average pooling made global
        for layer in param.layer:
            if layer.type == "Input":
                layer.input_param.shape[0].dim[2] = layer.input_param.shape[0].dim[3] = args.hw
            elif layer.type == "Pooling" and layer.pooling_param.pool == pb.PoolingParameter.AVE:
                layer.pooling_param.ClearField("kernel_size")
                layer.pooling_param.global_pooling = True
    p = pb.SolverParameter(base_lr=args.lr, momentum=0.9, weight_decay=1e-4, lr_policy="fixed",
                           max_iter=args.iters, random_seed=7, snapshot_after_train=False, display=1)
    p.memory_param.mode = args.memory
    p.net_param.CopyFrom(param if args.config == "one" else replicate(param, LOCATIONS))
    solver = Solver(p, device="cpu", dtype=np.dtype(args.dtype))
    solver.feed = SyntheticInputs(3)
    reps = None
    if args.config != "one":
        reps = Replicas(solver)
        if args.config == "per-replica":
            for group in reps.batch_norms:
                group.detach()
    losses = []
    t0 = time.perf_counter()
    for _ in range(args.iters):
        solver.step(1)
        losses.append(float(solver.smoothed_loss))
    seconds = (time.perf_counter() - t0) / args.iters
    if reps is not None:
        reps.close()
    out = {}
    arrays = solver.state_arrays()
    bn = {node.name for node in solver.net.graph.layers if node.type == "BatchNorm"}
    names = {id(b.data): ("bn " if name in bn else "") + f"{name}[{k}]"
             for name, blobs in solver.net.params.items() for k, b in enumerate(blobs)}
    n = sum(1 for a in arrays if id(a) in names)
    for i, a in enumerate(arrays):          # the parameters (BatchNorm's blobs among them), then the history
        key = names[id(a)] if i < n else f"history {names[id(arrays[i % n])]}"
        if not key.startswith("history bn "):       # never learned: zero
            out[key] = np.array(a)
    np.savez(args.out, **out)
    print(json.dumps({"seconds": seconds, "losses": losses}))


def compare(one, other):
    """{kind: (max abs, rel)}: the largest difference; the norm of all differences over the norm of
    all values (a per-tensor ratio is noise for a tensor that stays near 0, as a convolution's
    bias before BatchNorm, whose gradient is rounding). The replicas' largest difference; the
    three tensors with the largest per-tensor ratio."""
    out, between, worst, sq = {}, 0.0, [], {}
    for key, ref in one.items():
        kind = key.split()[0] if " " in key else "param"
        name = key.partition("[")[0]        # "conv1", "bn conv1/bn", "history conv1"
        a = other[key.replace(name, f"{name}@cpu:0", 1)]
        b = other[key.replace(name, f"{name}@cpu:1", 1)]
        between = max(between, float(np.abs(a - b).max()))
        d = np.abs(a.astype(np.float64) - ref)
        diff = float(d.max())
        worst.append((diff / max(float(np.abs(ref).max()), 1e-30), key))
        num, den, m = sq.get(kind, (0.0, 0.0, 0.0))
        sq[kind] = (num + float(np.sum(d * d)), den + float(np.sum(np.square(ref, dtype=np.float64))), max(m, diff))
    for kind, (num, den, m) in sq.items():
        out[kind] = (m, (num / den) ** 0.5 if den else 0.0)
    return out, between, sorted(worst, reverse=True)[:3]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nets", nargs="+", default=["cifar_resnet", "resnet50"], choices=sorted(FILES))
    ap.add_argument("--batch", type=int, default=8, help="images per replica (one location: twice this)")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--memory", default="liveness", help="memory mode of every configuration")
    ap.add_argument("--hw", type=int, help="ResNet-50's image size (default 224)")
    ap.add_argument("-v", "--verbose", action="store_true", help="name the tensors that differ most")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--net", help=argparse.SUPPRESS)
    ap.add_argument("--config", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    print(f"batch {args.batch} per replica ({2 * args.batch} at one location), {args.iters} iterations, "
          f"lr {args.lr}, {args.dtype}, memory {args.memory}; load {os.getloadavg()[0]:.1f}")
    print(f"{'net':14} {'config':12} {'s/iter':>7} {'param abs':>10} {'param rel':>10} {'bn abs':>10} "
          f"{'bn rel':>10} {'hist abs':>10} {'hist rel':>10} {'replicas':>9}  losses")
    print("(abs: largest difference from one; rel: norm of the differences over the norm of one's values)")
    with tempfile.TemporaryDirectory() as tmp:
        for net in args.nets:
            runs = {}
            for config in ("one", "replicas", "per-replica"):
                out = Path(tmp) / f"{net}-{config}.npz"
                cmd = [sys.executable, __file__, "--worker", "--net", net, "--config", config, "--out", str(out),
                       "--batch", str(args.batch), "--iters", str(args.iters), "--lr", str(args.lr),
                       "--dtype", args.dtype, "--memory", args.memory] + (["--hw", str(args.hw)] if args.hw else [])
                res = subprocess.run(cmd, env=env, capture_output=True, text=True)
                if res.returncode:
                    sys.exit(f"{net} {config} failed:\n{res.stderr[-3000:]}")
                info = json.loads(res.stdout.strip().splitlines()[-1])
                runs[config] = (dict(np.load(out)), info)
            ref = runs["one"][0]
            for config, (arrays, info) in runs.items():
                losses = " ".join(f"{x:.6g}" for x in info["losses"])
                if config == "one":
                    print(f"{net:14} {config:12} {info['seconds']:7.2f} {'':>65}  {losses}")
                    continue
                diffs, between, worst = compare(ref, arrays)
                cells = " ".join(f"{diffs.get(k, (0, 0))[0]:10.2e} {diffs.get(k, (0, 0))[1]:10.2e}"
                                 for k in ("param", "bn", "history"))
                print(f"{net:14} {config:12} {info['seconds']:7.2f} {cells} {between:9.1e}  {losses}")
                if args.verbose:
                    print("    largest relative differences: " + ", ".join(f"{k} {r:.1e}" for r, k in worst))


if __name__ == "__main__":
    main()
