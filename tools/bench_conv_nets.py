"""Training steps of whole nets: sncaffe with oneDNN's convolutions, sncaffe on its own ConvPlan,
and PyTorch eager (not a test).

compare.py's throughput rows (its nets, weights, batches and PyTorch forms), timed by the
process's CPU time as well as the wall clock: on a shared machine the wall clock counts the
time other processes hold the core, CPU time does not (at one thread every kernel of the three
runs on the calling thread). Steps interleaved, the median of ``--iterations`` kept; per
sncaffe form the share of its forward + backward in each layer type. PyTorch's forms each step in a
process of their own (``compare.Worker``), which times them and reports their CPU time.

    python tools/bench_conv_nets.py [--iterations 5] [--only LeNet,ResNet-50] [--threads 1]
"""
from __future__ import annotations

import os
import sys
import time

RUNS = [("LeNet", 64), ("CIFAR ResNet-20", 128), ("ResNet-50", 2), ("MobileNet-v2", 8)]


def main():
    import argparse
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iterations", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--only", default="", help="comma-separated net names")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(args.threads)             # before any BLAS loads
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:0] = [os.path.join(here, os.pardir), here]
    import statistics
    import compare
    from sncaffe.backend import onednn
    import torch
    torch.set_num_threads(args.threads)
    suite = compare.load_suite()
    only = [s for s in args.only.split(",") if s]
    print(f"threads {args.threads}; oneDNN {onednn.version()}; torch {torch.__version__}; median of "
          f"{args.iterations} interleaved steps; load average {os.getloadavg()[0]:.2f} at the start")
    head = (f"{'net':16s} {'batch':>5s} | {'oneDNN':>8s} {'native':>8s} {'torch':>8s} (CPU ms/step) | "
            f"{'dnn/torch':>9s} {'nat/torch':>9s} | wall ms oneDNN/native/torch | torch form")
    print(head + "\n" + "-" * len(head))
    for name, batch in RUNS:
        if only and name not in only:
            continue
        param = compare.net_param(suite, name, batch)
        solvers = {}
        for form in ("onednn", "native"):
            os.environ["SNCAFFE_CONV"] = form           # read when the layers are set up
            solvers[form] = compare.make_solver(param, "none")
        os.environ.pop("SNCAFFE_CONV")
        graph = solvers["onednn"].net.graph
        # PyTorch in processes of their own, as its users run it (compare.Worker: one process's
        # allocator state, raised by another model's blocks, spares PyTorch its page faults)
        specs = {f"torch {v}": ("pytorch", v) for v in compare.torch_variants_for(graph, ["twin", "idiomatic"])}
        with compare.workers_on(param, specs, args.threads) as workers:
            steps = {"onednn": lambda: solvers["onednn"].step(1), "native": lambda: solvers["native"].step(1),
                     **{k: (lambda w: lambda: w.ask("step"))(w) for k, w in workers.items()}}
            for _ in range(args.warmup):
                for fn in steps.values():
                    fn()
            cpu, wall = {k: [] for k in steps}, {k: [] for k in steps}
            for _ in range(args.iterations):
                for k, fn in steps.items():
                    c0, w0 = time.process_time(), time.perf_counter()
                    got = fn()
                    cpu[k].append(got["cpu"] if got else time.process_time() - c0)
                    wall[k].append(got["s"] if got else time.perf_counter() - w0)
        cpu = {k: statistics.median(v) * 1e3 for k, v in cpu.items()}
        wall = {k: statistics.median(v) * 1e3 for k, v in wall.items()}
        form = min((k for k in steps if k.startswith("torch")), key=cpu.get)
        print(f"{name:16s} {batch:5d} | {cpu['onednn']:8.1f} {cpu['native']:8.1f} {cpu[form]:8.1f}              | "
              f"{cpu[form] / cpu['onednn']:9.2f} {cpu[form] / cpu['native']:9.2f} | "
              f"{wall['onednn']:.0f}/{wall['native']:.0f}/{wall[form]:.0f} | {form[6:]}", flush=True)
        for form_name in ("onednn", "native"):
            print(f"    {form_name} by layer type: {layer_types(solvers[form_name].net)}")
        for s in solvers.values():
            s.net.release()
    print(f"load average {os.getloadavg()[0]:.2f} at the end; ratios are PyTorch's time over sncaffe's "
          "(above 1: sncaffe faster)")


def layer_types(net, repeat=3):
    """Share of forward + backward per layer type (the largest first), by CPU time."""
    import time as _time
    totals = {}
    types = {n.name: n.type for n in net.graph.layers}
    clock = _time.perf_counter
    for _ in range(repeat):
        timings = {}
        _time.perf_counter = _time.process_time         # the executor's timer, as CPU time
        try:
            net.forward(timings=timings)
            net.backward(timings=timings)
        finally:
            _time.perf_counter = clock
        for k, v in timings.items():
            t = types.get(k.split(":")[0], "other")
            totals[t] = totals.get(t, 0.0) + v
    whole = sum(totals.values()) or 1.0
    return ", ".join(f"{t} {100 * v / whole:.0f}%" for t, v in sorted(totals.items(), key=lambda kv: -kv[1])
                     if v / whole >= 0.01)


if __name__ == "__main__":
    main()
