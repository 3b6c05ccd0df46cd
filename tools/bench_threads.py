"""Benchmark sncaffe's CPU training step at 1 and 2 threads, with and without kernel threads (not a test).

    python tools/bench_threads.py [--nets resnet50,cifar] [--threads 1,2] [--iterations 3] [--rounds 2]
    python tools/bench_threads.py --alternate [--nets ...] [--iterations 6]
    python tools/bench_threads.py --turns [--nets ...] [--iterations 10]

Each configuration runs in a child process of its own (a process decides its threads once):
a net at its batch (ResNet-50 at 8, CIFAR ResNet-20 at 128), ``--threads N`` for the GEMMs
and the element-wise kernels (backend/threads.py, backend/workers.py), and for N > 1 also
"gemm only": the kernels held to one thread, which is sncaffe's default (backend/workers.py:
``SNCAFFE_KERNEL_THREADS`` unset). The configurations run in rotating order for
``--rounds`` rounds; each child times one warm-up and ``--iterations`` forward+backward
passes. Printed: seconds per iteration (best and median over all rounds; the process's CPU
seconds, all threads, in the best), the speed-up of
each configuration over one thread (best against best), the time per layer type of each
configuration's best iteration, and the load average (``uptime``) beside every figure: the
machine is shared, and other processes' load slows threaded runs most. ``--alternate`` times
the kernel threads alone: see ``alternate``.
"""
from __future__ import annotations

import argparse
from dataclasses import replace
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NETS = {"resnet50": ("prototxt/resnet50.prototxt", 8), "cifar": ("prototxt/cifar10_resnet.prototxt", 128),
        "mobilenet_v2": ("prototxt/mobilenet_v2.prototxt", 8), "densenet121": ("prototxt/densenet121.prototxt", 2)}


def child(net, threads, kernels, iterations):
    """Time ``net`` in this process; print one JSON line."""
    import resource
    from collections import defaultdict

    import numpy as np
    sys.path.insert(0, str(ROOT))
    from sncaffe import Net
    from sncaffe.backend import threads as policy
    from sncaffe.backend import runtimes
    from sncaffe import config
    from sncaffe.proto import sncaffe_pb2 as pb
    from sncaffe.prototxt import read_text, set_batch
    decision = runtimes.configure(threads)
    if kernels == "turns":          # one thread and the whole budget by turns, the kernel threads at the default
        modes = [1, threads]
    else:
        modes = [True, False] if kernels == "alt" else [kernels]
    path, batch = NETS[net]
    n = Net(set_batch(read_text(ROOT / path, pb.NetParameter()), batch), "TRAIN", seed=0)
    rng = np.random.default_rng(0)
    for name in n.inputs:
        blob = n.blobs[name].data
        blob[...] = rng.integers(0, 10, blob.shape) if "label" in name else rng.standard_normal(blob.shape)
    types = {node.name: node.type for node in n.graph.layers}
    n.forward()
    n.backward()
    runs = []
    for i in range(iterations * len(modes)):
        mode = modes[i % len(modes)]        # "alt": kernel threads on and off, iteration by iteration
        if kernels != "turns":
            config.settings = replace(config.settings, kernel_threads=decision.threads if mode else 1)
        ops = {}
        with policy.held(mode if kernels == "turns" else decision.threads):
            t0, c0 = time.perf_counter(), time.process_time()
            n.forward(timings=ops)
            n.backward(timings=ops)
            total, cpu = time.perf_counter() - t0, time.process_time() - c0
        by_type = defaultdict(float)
        for k, v in ops.items():
            by_type[types[k.rsplit(":", 1)[0]]] += v
        runs.append({"seconds": total, "cpu": cpu, "by_type": dict(by_type), "load": os.getloadavg()[0],
                     "kernels": mode})
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20
    print(json.dumps({"net": net, "batch": batch, "threads": decision.threads, "kernels": kernels,
                      "runs": runs, "rss_gib": rss}))


def run_child(net, threads, kind, iterations) -> dict:
    """One child process of ``alternate`` or ``turns`` (``kind``: "alt" or "turns"), free of the
    thread variables: its JSON line."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "KMP_BLOCKTIME")}
    out = subprocess.run([sys.executable, __file__, "--child", net, str(threads), kind, str(iterations)],
                         capture_output=True, text=True, env=env)
    if out.returncode:
        raise SystemExit(out.stderr[-2000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def alternate(args):
    """Per net, one child at the largest thread count, the kernel threads on and off every other
    iteration (the GEMMs on all threads both ways): the least disturbed iteration of each, and
    of each layer type, side by side. Load moves within seconds here, so the finest interleave
    compares best."""
    from tables import table
    t = max(int(x) for x in args.threads.split(","))
    for net in args.nets.split(","):
        load = os.getloadavg()[0]
        res = run_child(net, t, "alt", args.iterations)
        on = [r for r in res["runs"] if r["kernels"]]
        off = [r for r in res["runs"] if not r["kernels"]]
        print(f"\n## {net} (batch {res['batch']}), {t} threads for the GEMMs; kernel threads on and off by turns, "
              f"{len(on)} iterations each (load {load:.2f} before, {res['runs'][-1]['load']:.2f} after)\n")
        best = [min(rs, key=lambda r: r["seconds"]) for rs in (off, on)]
        rows = [["forward+backward", f"{best[0]['seconds']:.3f}", f"{best[1]['seconds']:.3f}",
                 f"{best[0]['seconds'] / best[1]['seconds']:.2f}x"]]
        kinds = sorted(on[0]["by_type"], key=lambda k: -on[0]["by_type"][k])
        for k in kinds:
            a, b = (min(r["by_type"].get(k, 0) for r in rs) for rs in (off, on))
            if max(a, b) >= 0.0005:
                rows.append([k, f"{a:.3f}", f"{b:.3f}", f"{a / b:.2f}x" if b else ""])
        table(rows, ["least disturbed (s)", "kernels on 1 thread", f"kernels on {t}", "speed-up"])


def turns(args):
    """Per net, one child at the largest thread count that runs its iterations on one thread and on
    all of them by turns (``threads.held``: the GEMMs, oneDNN's team and the compiled kernels held
    to one thread; MKL then runs its threaded library on one thread, not its sequential one): the
    speed-up as the ratio of the medians and of the best, both measured within seconds of each
    other, which separate processes minutes apart are not on a shared machine."""
    from tables import table
    t = max(int(x) for x in args.threads.split(","))
    print(f"python tools/bench_threads.py --turns --nets {args.nets} --threads {args.threads} --iterations "
          f"{args.iterations}; {os.cpu_count()} cores; 1 and {t} threads by turns in one process per net")
    for net in args.nets.split(","):
        load = os.getloadavg()[0]
        res = run_child(net, t, "turns", args.iterations)
        one = sorted(r["seconds"] for r in res["runs"][0::2])
        many = sorted(r["seconds"] for r in res["runs"][1::2])
        med = [x[len(x) // 2] for x in (one, many)]
        print(f"\n## {net} (batch {res['batch']}): {len(one)} iterations each (load {load:.2f} before, "
              f"{res['runs'][-1]['load']:.2f} after)\n")
        table([["median", f"{med[0]:.3f}", f"{med[1]:.3f}", f"{med[0] / med[1]:.2f}x"],
               ["best", f"{one[0]:.3f}", f"{many[0]:.3f}", f"{one[0] / many[0]:.2f}x"]],
              ["s per forward+backward", "1 thread", f"{t} threads", "speed-up"])
        rows = []
        for kind in sorted(res["runs"][0]["by_type"], key=lambda k: -res["runs"][0]["by_type"][k]):
            a, b = (sorted(r["by_type"].get(kind, 0) for r in rs) for rs in (res["runs"][0::2], res["runs"][1::2]))
            a, b = a[len(a) // 2], b[len(b) // 2]
            if max(a, b) >= 0.0005:
                rows.append([kind, f"{a:.3f}", f"{b:.3f}", f"{a / b:.2f}x" if b else ""])
        print(f"\n### {net}: seconds per layer type (medians)\n")
        table(rows, ["type", "1 thread", f"{t} threads", "speed-up"])


def configs(nets, thread_counts, blocktime):
    for net in nets:
        for t in thread_counts:
            yield net, t, True, None
            if t > 1:
                yield net, t, False, None
                if blocktime:
                    yield net, t, True, blocktime


def name(t, kernels, blocktime=None):
    return (f"{t} thread{'s' * (t > 1)}" + ("" if kernels or t == 1 else ", gemm only")
            + (f", KMP_BLOCKTIME={blocktime}" if blocktime else ""))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nets", default="resnet50,cifar")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--iterations", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--blocktime", help="also run 2 threads with this KMP_BLOCKTIME (sncaffe's default: "
                                        "backend/threads.KMP_BLOCKTIME_MS ms)")
    ap.add_argument("--alternate", action="store_true",
                    help="one process per net at the largest --threads, kernel threads on and off by turns")
    ap.add_argument("--turns", action="store_true",
                    help="one process per net: one thread and --threads' largest by turns, iteration by iteration")
    ap.add_argument("--child", nargs=4, metavar=("NET", "THREADS", "KERNELS", "ITERATIONS"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if not args.child:
        unknown = [n for n in args.nets.split(",") if n not in NETS]
        if unknown:
            ap.error(f"--nets: unknown net {', '.join(map(repr, unknown))} (known: {', '.join(NETS)})")
        if not all(t.strip().isdigit() and int(t) > 0 for t in args.threads.split(",")):
            ap.error(f"--threads: {args.threads!r} is not a comma-separated list of thread counts")
    if args.child:
        net, t, k, it = args.child
        return child(net, int(t), k if k in ("alt", "turns") else k == "1", int(it))
    if args.alternate:
        return alternate(args)
    if args.turns:
        return turns(args)
    from tables import table        # tools/tables.py
    todo = list(configs(args.nets.split(","), [int(t) for t in args.threads.split(",")], args.blocktime))
    print(f"python tools/bench_threads.py --nets {args.nets} --threads {args.threads} --iterations "
          f"{args.iterations} --rounds {args.rounds}; {os.cpu_count()} cores; the machine is shared: "
          "other processes' load (uptime, beside each figure) slows threaded runs most")
    results = {c: [] for c in todo}
    env = {k: v for k, v in os.environ.items()
           if k not in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "KMP_BLOCKTIME")}
    for r in range(args.rounds):
        for c in todo[r % len(todo):] + todo[:r % len(todo)]:       # rotating order
            net, t, k, blocktime = c
            load = os.getloadavg()[0]
            out = subprocess.run([sys.executable, __file__, "--child", net, str(t), str(int(k)), str(args.iterations)],
                                 capture_output=True, text=True,
                                 env={**env, **({"KMP_BLOCKTIME": blocktime} if blocktime else {})})
            if out.returncode:
                print(out.stderr[-2000:])
                raise SystemExit(f"child {c} failed")
            res = json.loads(out.stdout.strip().splitlines()[-1])
            res["load_before"] = load
            results[c].append(res)
            best = min(x["seconds"] for x in res["runs"])
            print(f"  round {r + 1}: {net} {name(t, k, blocktime)}: best {best:.3f} s/iter "
                  f"(load {load:.2f} before, {res['runs'][-1]['load']:.2f} after; RSS {res['rss_gib']:.2f} GiB)", flush=True)
    for net in args.nets.split(","):
        rows, base = [], None
        cs = [c for c in todo if c[0] == net]
        per_type = {}
        for c in cs:
            runs = sorted((x for res in results[c] for x in res["runs"]), key=lambda x: x["seconds"])
            best, median = runs[0], runs[len(runs) // 2]
            batch = results[c][0]["batch"]
            base = base or best["seconds"]
            loads = [res["load_before"] for res in results[c]]
            rows.append([name(*c[1:]), f"{best['seconds']:.3f}", f"{median['seconds']:.3f}", f"{best['cpu']:.3f}",
                         f"{batch / best['seconds']:.1f}", f"{base / best['seconds']:.2f}x",
                         f"{min(loads):.1f}-{max(loads):.1f}"])
            per_type[name(*c[1:])] = best["by_type"]
        print(f"\n## {net} (batch {batch}): seconds per forward+backward, over {args.rounds} rounds x "
              f"{args.iterations} iterations\n")
        table(rows, ["config", "best s", "median s", "CPU s (best)", "img/s (best)", "speed-up vs 1 thread",
                     "load before"])
        kinds = sorted({t for v in per_type.values() for t in v}, key=lambda t: -max(v.get(t, 0) for v in per_type.values()))
        print(f"\n### {net}: seconds per layer type, in each configuration's best iteration\n")
        table([[t] + [f"{per_type[n].get(t, 0):.3f}" for n in per_type] for t in kinds if
               max(per_type[n].get(t, 0) for n in per_type) >= 0.0005], ["type"] + list(per_type))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()
