"""Weak scaling of data-parallel training on the CPU: 2 ranks (MPI) and 2 locations of one process,
and how much gradient exchange hides behind backward.

    python tools/bench_parallel.py [--nets lenet cifar_resnet resnet50] [--batch B] [--iters 5]
    python tools/bench_parallel.py --turns [--nets ...] [--iters 8]

``--turns``: only the two locations against one location at the summed batch, both in one
process, an iteration of each by turns (the order rotating), so both meet the same load; and the
two locations once more with every pass walked (``Dispatcher.replay`` off: ``walked ms``, and
``replay``, its median over that of the replayed passes): the
median of each, their ratio (``vs 2B``), the ratio of the best iterations and the range of the
per-turn ratios. On a shared machine whose speed moves within a minute this ratio is steadier
than the one of separate processes below.

For each net, each configuration runs in a process of its own (the venv's
``mpiexec`` for ranks), one BLAS thread per rank or location, synthetic inputs:

- ``1 rank``: one process at batch B (the base);
- ``2 ranks alone``: two processes at B that do not exchange gradients (the
  ceiling this machine allows, since they share its cores and memory);
- ``2 ranks``: data parallel over MPI, B per rank, all-reduce operators on
  the comm stream (``--bucket-mb``);
- ``2 locations``: one process, the net replicated on cpu:0 and cpu:1
  (``sncaffe.parallel.replicas``), B per location, summing operators on
  cpu:0's comm stream, each location on its own worker thread;
- ``2 loc, general``: the same with the dispatcher's general path (every
  operator issued from the calling thread, ``Dispatcher.programs`` off), where
  ``2 locations`` runs each location's program on its worker (runtime/dispatcher.py);
- ``1 rank, 2B``: one process at the summed batch on one thread, what the
  2 locations are measured against (``vs 2B``: its time over theirs).

Weak-scaling efficiency is the time per iteration at 1 rank over that of the
configuration (1.00: twice the images in the same time). ``cpu ms``: CPU time
per iteration of the whole job (both ranks), which a loaded machine distorts
less than wall time. ``ceiling``: the best ``vs 2B`` two locations could reach
if they ran perfectly in parallel at no cost, one location's time at 2B over
its time at B (a location at B pays the fixed per-operator costs of one at 2B).

``exposed ms``: the gradient exchange time after this rank's last backward
operator, which the update waits for (what the exchange adds to an
iteration); ``in bwd``: the rest of the exchange time over all of it (median
of the traced iterations). It counts as not exposed what ran in backward's
gaps (a BatchNorm waiting for its batch sums, the GIL), which ``hidden`` does
not count as hidden.

``hidden``: of the time some gradient exchange (all-reduce or sum) was running,
the share during which a backward operator of this rank (rank 0, a BatchNorm's
backward stages included) was computing,
from ``--traces`` traced iterations (median). For 2 ranks ``any rank`` also
counts the time the other rank was still computing backward: an all-reduce
waiting for a rank that is behind (on a loaded machine, tens of ms) is exposed
on rank 0 but costs the job nothing beyond that rank's own backward. (Both
ranks' clocks are the machine's monotonic clock.) ``BN sums ms``: the
cross-replica BatchNorms' exchanges of batch sums (parallel/sync_bn.py), which
are not gradient exchange: each layer's next stage waits for them.
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


def mpiexec() -> str:
    """The venv's mpiexec (the ``mpi`` extra), else the one on PATH."""
    import shutil
    here = Path(sys.executable).parent / "mpiexec"
    return str(here) if here.exists() else (shutil.which("mpiexec") or str(here))

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


NETS = ("lenet", "cifar_resnet", "resnet50", "mlp")
# Images per rank or location unless --batch: LeNet at the batch its prototxt trains with (at 8 its
# whole backward, about a millisecond, is shorter than the exchange of its 1.7 MB of gradients),
# the others at 8, which two ResNet-50 replicas on one thread each run in about 2 s an iteration.
BATCH = {"lenet": 64, "cifar_resnet": 8, "resnet50": 8, "mlp": 8}


def net_param(name, batch, hw=None):
    from sncaffe.proto import sncaffe_pb2 as pb
    from sncaffe.prototxt import filter_net, parse_text, read_text, replace_data_layers, set_batch
    if name == "lenet":
        param = read_text(ROOT / "prototxt" / "lenet_train_test.prototxt", pb.NetParameter())
        param = replace_data_layers(filter_net(param, "TRAIN"), {"data": (batch, 1, 28, 28), "label": (batch,)})
        return param
    if name == "mlp":
        return set_batch(parse_text(MLP, pb.NetParameter()), batch)
    if name in ("cifar_resnet", "resnet50"):
        file = "cifar10_resnet.prototxt" if name == "cifar_resnet" else "resnet50.prototxt"
        param = set_batch(read_text(ROOT / "prototxt" / file, pb.NetParameter()), batch)
        if hw and name == "resnet50":       # smaller images; the final 7x7 average pooling made global
            for layer in param.layer:
                if layer.type == "Input":
                    layer.input_param.shape[0].dim[2] = layer.input_param.shape[0].dim[3] = hw
                elif layer.type == "Pooling" and layer.pooling_param.kernel_size == 7 \
                        and layer.pooling_param.pool == pb.PoolingParameter.AVE:
                    layer.pooling_param.ClearField("kernel_size")
                    layer.pooling_param.global_pooling = True
        return param
    raise ValueError(f"unknown net {name!r} ({', '.join(NETS)})")


def worker(args) -> None:
    """One rank: train, time, trace; rank 0 prints a JSON line."""
    import logging

    import numpy as np

    from sncaffe.data.synthetic import SyntheticInputs
    from sncaffe.parallel import DataParallel, IterationTrace, overlap, world
    from sncaffe.parallel.replicas import Replicas, replicate
    from sncaffe.proto import sncaffe_pb2 as pb
    from sncaffe.solvers import Solver
    logging.getLogger("sncaffe").setLevel(logging.WARNING)
    comm = None if args.replicas else world()
    p = pb.SolverParameter(base_lr=0.01, momentum=0.9, lr_policy="fixed", max_iter=10**6, random_seed=1,
                           snapshot_after_train=False)
    param = net_param(args.net, args.batch, args.hw)
    if args.replicas:
        from sncaffe.prototxt import set_batch
        param = replicate(set_batch(param, args.batch * args.replicas),
                          [f"cpu:{k}" for k in range(args.replicas)])
    p.net_param.CopyFrom(param)
    solver = Solver(p, device="cpu")
    solver.feed = SyntheticInputs(1)
    solver.net.executor.programs = not args.general
    parallel = None
    if comm is not None and comm.Get_size() > 1 and not args.alone:
        parallel = DataParallel(solver, comm, bucket_bytes=int(args.bucket_mb[0] * 2**20))
    elif args.replicas:
        parallel = Replicas(solver)
    solver.step(args.warmup)
    root = comm is None or comm.Get_rank() == 0
    rank = 0 if comm is None else comm.Get_rank()
    tracers = [IterationTrace(solver, f"{args.trace}.{rank}.{k}", args.warmup + k) for k in range(args.traces)]
    solver.step(args.traces)
    t0, cpu0 = time.perf_counter(), time.process_time()
    solver.step(args.iters)
    seconds = (time.perf_counter() - t0) / args.iters
    cpu = (time.process_time() - cpu0) / args.iters
    if parallel is not None:
        parallel.close()
    spans = [[tuple(x[:4]) for x in t.spans] for t in tracers]     # plain tuples: they travel by pickle
    if comm is not None:        # every rank's spans and CPU time to rank 0
        gathered = comm.gather((spans, cpu), root=0)
        if root:
            cpu = sum(c for _, c in gathered)
            others = [g[0] for g in gathered[1:]]
    if root:
        shares = [overlap(s) for s in spans]
        median = {k: float(np.median([o[k] for o in shares])) for k in shares[0]}
        if comm is not None and comm.Get_size() > 1:
            # backward of any rank: rank 0's comm spans against the union of every rank's backward
            anyrank = [overlap(s + [x for o in others for x in o[k] if x[1].endswith(":backward")])
                       for k, s in enumerate(spans)]
            median["hidden_any"] = float(np.median([o["hidden_share"] for o in anyrank]))
        print(json.dumps({"ms": seconds * 1e3, "cpu_ms": cpu * 1e3, "buckets": len(parallel.ops) if parallel else 0,
                          **median}), flush=True)


def turns_worker(args) -> None:
    """Two locations at B and one location at 2B, both in this process, one training iteration of
    each by turns: print one JSON line of the per-iteration times."""
    import logging

    from sncaffe.data.synthetic import SyntheticInputs
    from sncaffe.parallel.replicas import Replicas, replicate
    from sncaffe.proto import sncaffe_pb2 as pb
    from sncaffe.prototxt import set_batch
    from sncaffe.solvers import Solver
    logging.getLogger("sncaffe").setLevel(logging.WARNING)

    def solver(param):
        p = pb.SolverParameter(base_lr=0.01, momentum=0.9, lr_policy="fixed", max_iter=10**6, random_seed=1,
                               snapshot_after_train=False)
        p.net_param.CopyFrom(param)
        s = Solver(p, device="cpu")
        s.feed = SyntheticInputs(1)
        return s
    two = solver(replicate(set_batch(net_param(args.net, args.batch, args.hw), 2 * args.batch), ["cpu:0", "cpu:1"]))
    replicas = Replicas(two)
    one = solver(net_param(args.net, 2 * args.batch, args.hw))
    times = {"two": [], "one": [], "walked": []}
    turn = [("one", one, True), ("two", two, True), ("walked", two, False)]
    for k in range(args.warmup + args.iters):
        for name, s, replay in turn[k % 3:] + turn[:k % 3]:       # each first, second and last in turn
            s.net.executor.replay = replay      # (the replicas' recording is made in the first turns)
            t0 = time.perf_counter()
            s.step(1)
            if k >= args.warmup:
                times[name].append((time.perf_counter() - t0) * 1e3)
    replicas.close()
    print(json.dumps(times), flush=True)


def turns(args) -> None:
    """``--turns``: for each net, two locations against one at 2B by turns in one process."""
    import numpy as np
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    print(f"two locations at B against one location at 2B, one iteration of each by turns in one process "
          f"({os.cpu_count()} cores, 1 BLAS thread per location, {args.iters} iterations each after "
          f"{args.warmup}; ResNet-50 at {args.hw}x{args.hw})")
    print(f"{'net':<13}{'B':>4}{'1 loc 2B ms':>13}{'2 loc ms':>10}{'vs 2B':>7}{'best':>7}{'per turn':>14}"
          f"{'walked ms':>11}{'replay':>8}{'load':>11}")
    for net in args.nets:
        b = args.batch or BATCH[net]
        load = os.getloadavg()[0]
        cmd = [sys.executable, __file__, "--turns-worker", "--net", net, "--batch", str(b), "--iters",
               str(args.iters), "--warmup", str(args.warmup), "--hw", str(args.hw)]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
        if out.returncode:
            raise SystemExit(f"{' '.join(cmd)} failed:\n{out.stdout}{out.stderr}")
        t = json.loads(out.stdout.strip().splitlines()[-1])
        one, two, walked = np.array(t["one"]), np.array(t["two"]), np.array(t["walked"])
        ratios = one / two
        print(f"{net:<13}{b:>4}{np.median(one):>13.1f}{np.median(two):>10.1f}{np.median(one) / np.median(two):>7.2f}"
              f"{one.min() / two.min():>7.2f}{f'{ratios.min():.2f}-{ratios.max():.2f}':>14}"
              f"{np.median(walked):>11.1f}{np.median(walked) / np.median(two):>8.3f}"
              f"{f'{load:.1f}-{os.getloadavg()[0]:.1f}':>11}", flush=True)


def run(net, ranks, args, batch, bucket_mb=1.0, alone=False, replicas=0, general=False) -> dict:
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, __file__, "--worker", "--net", net,
               "--batch", str(batch), "--iters", str(args.iters), "--warmup", str(args.warmup),
               "--traces", str(args.traces), "--hw", str(args.hw),
               "--bucket-mb", str(bucket_mb), "--trace", os.path.join(tmp, "trace.json")] + \
            (["--alone"] if alone else []) + (["--replicas", str(replicas)] if replicas else []) + \
            (["--general"] if general else [])
        if not replicas:
            cmd = [mpiexec(), "-n", str(ranks)] + cmd
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    if out.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{out.stdout}{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nets", nargs="+", default=["lenet", "cifar_resnet", "resnet50"], choices=NETS)
    ap.add_argument("--batch", type=int, help="images per rank or location (default: LeNet 64, the others 8)")
    ap.add_argument("--hw", type=int, default=224, help="ResNet-50's image size (default: %(default)s)")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--traces", type=int, default=2, help="iterations traced (default: %(default)s)")
    ap.add_argument("--bucket-mb", type=float, nargs="+", default=[1.0],
                    help="bucket size for 2 ranks (default: %(default)s)")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--net", help=argparse.SUPPRESS)
    ap.add_argument("--trace", help=argparse.SUPPRESS)
    ap.add_argument("--alone", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--replicas", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--general", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--turns", action="store_true",
                    help="only two locations against one at 2B, an iteration of each by turns in one process")
    ap.add_argument("--turns-worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    if args.turns_worker:
        return turns_worker(args)
    if args.turns:
        return turns(args)
    load = os.getloadavg()
    sys.path.insert(0, str(ROOT))
    from sncaffe.backend import onednn
    conv = onednn.choice()          # the workers run this interpreter: a venv without oneDNN halves the speed
    print(f"weak scaling on the CPU ({os.cpu_count()} cores, load average {load[0]:.1f} {load[1]:.1f} "
          f"{load[2]:.1f} at the start; {sys.executable}, convolutions on {conv}), {args.iters} iterations "
          f"timed after {args.warmup + args.traces}, 1 BLAS thread per rank or location; ResNet-50 at "
          f"{args.hw}x{args.hw}")
    print(f"{'net':<13}{'configuration':<16}{'ops':>5}{'ms/iter':>10}{'cpu ms':>8}{'images/s':>10}{'efficiency':>11}"
          f"{'vs 2B':>7}{'exchange ms':>12}{'hidden':>8}{'any rank':>9}{'exposed ms':>11}{'in bwd':>8}"
          f"{'BN sums ms':>11}")
    for net in args.nets:
        b = args.batch or BATCH[net]
        print(f"{net}: batch {b} per rank or location", flush=True)
        base = run(net, 1, args, b)
        rows = [("1 rank", base), ("2 ranks alone", run(net, 2, args, b, alone=True)),
                ("2 ranks", run(net, 2, args, b, args.bucket_mb[0])), ("2 locations", run(net, 1, args, b, replicas=2)),
                ("2 loc, general", run(net, 1, args, b, replicas=2, general=True)),
                ("1 rank, 2B", run(net, 1, args, 2 * b))]
        double = rows[-1][1]["ms"]
        for name, r in rows:
            n = 1 if name == "1 rank" else 2
            exchange = name in ("2 ranks", "2 locations", "2 loc, general")
            hidden_any = f"{100 * r['hidden_any']:>8.0f}%" if "hidden_any" in r else f"{'-':>9}"
            print(f"{net:<13}{name:<16}{r['buckets']:>5}{r['ms']:>10.1f}{r['cpu_ms']:>8.1f}"
                  f"{n * b / r['ms'] * 1e3:>10.1f}"
                  + (f"{base['ms'] / r['ms']:>11.2f}" if name != "1 rank, 2B" else f"{'-':>11}")
                  + (f"{double / r['ms']:>7.2f}" if name.startswith("2 loc") else f"{'-':>7}")
                  + (f"{r['comm_s'] * 1e3:>12.1f}{100 * r['hidden_share']:>7.0f}%{hidden_any}"
                     f"{r['exposed_s'] * 1e3:>11.2f}{100 * r['in_backward_share']:>7.0f}%"
                     f"{r.get('statistics_s', 0) * 1e3:>11.1f}" if exchange
                     else f"{'-':>12}{'-':>8}{'-':>9}{'-':>11}{'-':>8}{'-':>11}"), flush=True)
        print(f"{net:<13}ceiling of 2 locations vs 2B (1 location's time at 2B over B): {double / base['ms']:.2f}; "
              f"by CPU time {rows[-1][1]['cpu_ms'] / base['cpu_ms']:.2f}", flush=True)
    print(f"load average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
