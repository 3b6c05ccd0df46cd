"""Benchmark sncaffe's CPU Convolution on ResNet-50's distinct convolutions (not a test).

Prints the machine's fp32 GEMM rate (on sncaffe's BLAS), then per shape the forward,
backward-data and backward-filter time of sncaffe's layer (GFLOP/s and the
fraction of the GEMM rate) and, when torch is importable, torch's conv2d on the
same shape. The totals weight each shape by how often ResNet-50 has it (conv1's
backward-data is left out: the data layer below it takes no gradient).

With --backends: per shape (LeNet's at --lenet-batch, CIFAR ResNet-20's at --cifar-batch,
ResNet-50's at --batch) forward + both backward passes of the layer on each CPU engine: oneDNN
(backend/onednn.py, the layouts of its choice) and sncaffe's own ConvPlan, and torch's.

    .venv/bin/python tools/bench_conv.py [--threads 1] [--repeat 3] [--batch 8] [--quick] [--backends]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

# CIFAR ResNet-20 (name, channels, num_output, input size, kernel, stride, pad, bias, count)
CIFAR = [("cifar 3x3 3>16 32", 3, 16, 32, 3, 1, 1, False, 1), ("cifar 3x3 16 32", 16, 16, 32, 3, 1, 1, False, 6),
         ("cifar 3x3/2 16>32", 16, 32, 32, 3, 2, 1, False, 1), ("cifar 3x3 32 16", 32, 32, 16, 3, 1, 1, False, 5),
         ("cifar 3x3/2 32>64", 32, 64, 16, 3, 2, 1, False, 1), ("cifar 3x3 64 8", 64, 64, 8, 3, 1, 1, False, 5)]
LENET = [("lenet 5x5 1>20 28", 1, 20, 28, 5, 1, 0, True, 1), ("lenet 5x5 20>50 12", 20, 50, 12, 5, 1, 0, True, 1)]
# (name, channels, num_output, input size, kernel, stride, pad, bias, count in ResNet-50)
SHAPES = [
    ("conv1 7x7/2", 3, 64, 224, 7, 2, 3, True, 1),
    ("res2 1x1 64>64", 64, 64, 56, 1, 1, 0, False, 1),
    ("res2 3x3 64", 64, 64, 56, 3, 1, 1, False, 3),
    ("res2 1x1 64>256", 64, 256, 56, 1, 1, 0, False, 4),
    ("res2 1x1 256>64", 256, 64, 56, 1, 1, 0, False, 2),
    ("res3 1x1/2 256>512", 256, 512, 56, 1, 2, 0, False, 1),
    ("res3 1x1/2 256>128", 256, 128, 56, 1, 2, 0, False, 1),
    ("res3 3x3 128", 128, 128, 28, 3, 1, 1, False, 4),
    ("res3 1x1 128>512", 128, 512, 28, 1, 1, 0, False, 4),
    ("res3 1x1 512>128", 512, 128, 28, 1, 1, 0, False, 3),
    ("res4 1x1/2 512>1024", 512, 1024, 28, 1, 2, 0, False, 1),
    ("res4 1x1/2 512>256", 512, 256, 28, 1, 2, 0, False, 1),
    ("res4 3x3 256", 256, 256, 14, 3, 1, 1, False, 6),
    ("res4 1x1 256>1024", 256, 1024, 14, 1, 1, 0, False, 6),
    ("res4 1x1 1024>256", 1024, 256, 14, 1, 1, 0, False, 5),
    ("res5 1x1/2 1024>2048", 1024, 2048, 14, 1, 2, 0, False, 1),
    ("res5 1x1/2 1024>512", 1024, 512, 14, 1, 2, 0, False, 1),
    ("res5 3x3 512", 512, 512, 7, 3, 1, 1, False, 3),
    ("res5 1x1 512>2048", 512, 2048, 7, 1, 1, 0, False, 3),
    ("res5 1x1 2048>512", 2048, 512, 7, 1, 1, 0, False, 2),
]


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1, help="BLAS and torch threads (default 1)")
    ap.add_argument("--repeat", type=int, default=3, help="timed runs per measurement, best kept")
    ap.add_argument("--quick", action="store_true", help="one timed run per measurement")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--only", default="", help="run shapes whose name contains this")
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--backends", action="store_true", help="oneDNN, ConvPlan and torch")
    ap.add_argument("--cifar-batch", type=int, default=128)
    ap.add_argument("--lenet-batch", type=int, default=64)
    return ap.parse_args()


CLOCK = time.perf_counter      # main: the process's CPU time at one thread (the shared machine's load aside)


def best_times(fns, repeat):
    """Best seconds of each function, the runs interleaved so that load from other
    processes hits all of them alike."""
    for fn in fns:
        fn()                                # warm up (and first-touch the buffers)
    best = [float("inf")] * len(fns)
    for _ in range(repeat):
        for i, fn in enumerate(fns):
            t = CLOCK()
            fn()
            best[i] = min(best[i], CLOCK() - t)
    return best


def gemm_rate(np, repeat):
    """GFLOP/s of a 2048^3 fp32 GEMM on the BLAS sncaffe's convolutions run on (backend/blas.py)."""
    from sncaffe.backend.blas import gemm
    a, b = (np.random.default_rng(0).standard_normal((2048, 2048), dtype=np.float32) for _ in range(2))
    c = np.empty_like(a)
    return 2 * 2048 ** 3 / best_times([lambda: gemm(a, b, c)], repeat)[0] / 1e9


def sncaffe_passes(np, shape, N, engine=""):
    """(forward, backward-data, backward-filter) of sncaffe's Convolution, as functions, on the
    engine ``SNCAFFE_CONV`` names (``engine``; "": the default)."""
    from sncaffe.gradcheck import Harness, make_layer
    _, C, M, H, k, s, p, bias, _ = shape
    text = (f'type: "Convolution" convolution_param {{ num_output: {M} kernel_size: {k} '
            f'stride: {s} pad: {p} bias_term: {str(bias).lower()} }}')
    x = np.random.default_rng(0).standard_normal((N, C, H, H), dtype=np.float32)

    def harness(frozen):
        before = os.environ.get("SNCAFFE_CONV")
        os.environ["SNCAFFE_CONV"] = engine         # read when the layer is set up
        try:
            return Harness(make_layer(text + frozen), [x], np.float32)
        finally:
            if before is None:
                del os.environ["SNCAFFE_CONV"]
            else:
                os.environ["SNCAFFE_CONV"] = before
    # lr_mult 0: Caffe (and sncaffe) skip the parameter gradients, leaving backward-data
    h, hd = (harness(frozen) for frozen in ("", " param { lr_mult: 0 } param { lr_mult: 0 }"))
    for one in (h, hd):
        one.forward()
        for t in one.top:
            t.diff[...] = np.random.default_rng(1).standard_normal(t.diff.shape, dtype=np.float32)
    return (lambda: h.layer.forward(h.bottom, h.top),
            lambda: hd.layer.backward(hd.top, [True], hd.bottom),
            lambda: h.layer.backward(h.top, [False], h.bottom))


def sncaffe_layer(np, shape, N):
    """sncaffe's Convolution of ``shape`` set up at N images (its ``dnn``: where oneDNN runs it)."""
    from sncaffe.gradcheck import Harness, make_layer
    _, C, M, H, k, s, p, bias, _ = shape
    layer = make_layer(f'type: "Convolution" convolution_param {{ num_output: {M} kernel_size: {k} '
                       f'stride: {s} pad: {p} bias_term: {str(bias).lower()} }}')
    Harness(layer, [np.zeros((N, C, H, H), np.float32)], np.float32)
    return layer


def torch_passes(torch, shape, N):
    _, C, M, H, k, s, p, bias, _ = shape
    x = torch.randn(N, C, H, H)
    w = torch.randn(M, C, k, k)
    b = torch.randn(M) if bias else None
    dy = torch.randn_like(torch.nn.functional.conv2d(x, w, b, s, p))
    bwd = torch.ops.aten.convolution_backward

    def run(mask):
        return lambda: bwd(dy, x, w, [M] if bias else None, [s, s], [p, p], [1, 1], False, [0, 0], 1, mask)
    return (lambda: torch.nn.functional.conv2d(x, w, b, s, p), run([True, False, False]),
            run([False, True, bias]))


def backends(np, torch, args):
    """The --backends table: fwd+bwd ms per shape on each engine, and the weighted totals."""
    from sncaffe.backend import onednn
    have = onednn.choice() == "onednn"
    paths = ("oneDNN", "native", "torch")
    head = f"{'shape':22s} {'n':>3s} {'x':>2s} | " + " ".join(f"{p:>7s}" for p in paths) + " | " \
           f"{'dnn/torch':>9s} {'nat/torch':>9s}  oneDNN's kernels (fwd, bwd-data, bwd-weights)"
    print(head + "\n" + "-" * len(head))
    totals = {}
    for net, shapes, N in (("LeNet", LENET, args.lenet_batch), ("CIFAR ResNet-20", CIFAR, args.cifar_batch),
                           ("ResNet-50", SHAPES, args.batch)):
        sums = [0.0] * len(paths)
        for shape in shapes:
            name, C, M, H, k, s, p, bias, count = shape
            if args.only not in name:
                continue
            fns = []
            for engine in ("onednn", "native")[0 if have else 1:]:
                f = sncaffe_passes(np, shape, N, engine)
                fns.append(lambda f=f: (f[0](), f[1](), f[2]()))
            if torch:
                t = torch_passes(torch, shape, N)
                fns.append(lambda t=t: (t[0](), t[1](), t[2]()))
            times = best_times(fns, 1 if args.quick else args.repeat)
            times = ([] if have else [None]) + times + ([None] if not torch else [])
            for i, t in enumerate(times):
                sums[i] += count * (t or 0)
            ms = " ".join(f"{t * 1e3:7.2f}" if t else f"{'-':>7s}" for t in times)
            ratio = " ".join(f"{t / times[2]:9.2f}" if t and times[2] else f"{'-':>9s}" for t in times[:2])
            kinds = ""
            if have:
                g = sncaffe_layer(np, shape, N).dnn
                kinds = ", ".join(g.conv(N).impl(kind) for kind in ("forward", "data", "weights"))
            print(f"{name:22s} {N:3d} {count:2d} | {ms} | {ratio}  {kinds}", flush=True)
        totals[net] = sums
    for net, sums in totals.items():
        line = ", ".join(f"{what} {t:.3f} s" for what, t in zip(paths, sums) if t)
        print(f"{net} convolutions, fwd+bwd, weighted by count: {line}"
              + (f"; oneDNN/torch {sums[0] / sums[2]:.2f}, native/torch {sums[1] / sums[2]:.2f}"
                 if sums[0] and sums[2] else ""))


def main():
    global CLOCK
    args = parse_args()
    if args.threads == 1:       # every kernel runs on the calling thread: CPU time is its time
        CLOCK = time.process_time
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(args.threads)     # before NumPy loads its BLAS
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))
    import numpy as np
    torch = None
    if not args.no_torch:
        try:
            import torch
            torch.set_num_threads(args.threads)
            torch.set_grad_enabled(False)       # plain kernels, no autograd bookkeeping
        except ImportError:
            pass
    repeat = 1 if args.quick else args.repeat
    N = args.batch
    rate = gemm_rate(np, repeat)
    print(f"threads {args.threads} (OPENBLAS_NUM_THREADS{', torch.set_num_threads' if torch else ''}), "
          f"batch {N}, best of {repeat}, {'CPU time' if CLOCK is time.process_time else 'wall clock'}")
    from sncaffe.backend.blas import BLAS
    print(f"fp32 GEMM (2048^3, {BLAS.describe()}): {rate:.1f} GFLOP/s")
    print(f"torch {torch.__version__}" if torch else "torch: not importable, sncaffe only")
    if args.backends:
        backends(np, torch, args)
        print("load average %.2f %.2f %.2f" % os.getloadavg())
        return
    head = f"{'shape':22s} {'n':>2s} | {'fwd ms':>7s} {'GF/s':>5s} {'%gemm':>5s} | {'bwdD ms':>7s} {'GF/s':>5s} " \
           f"{'%gemm':>5s} | {'bwdF ms':>7s} {'GF/s':>5s} {'%gemm':>5s}"
    if torch:
        head += f" || {'torch fwd':>9s} {'bwdD':>7s} {'bwdF':>7s} | {'sn/torch':>8s}"
    print(head)
    print("-" * len(head))
    total_sn = total_torch = 0.0
    for shape in SHAPES:
        name, C, M, H, k, s, p, bias, count = shape
        if args.only not in name:
            continue
        Ho = (H + 2 * p - k) // s + 1
        flops = 2.0 * N * M * C * k * k * Ho * Ho
        fns = list(sncaffe_passes(np, shape, N)) + (list(torch_passes(torch, shape, N)) if torch else [])
        times = best_times(fns, repeat)
        sn, th = times[:3], times[3:]
        skip_data = name.startswith("conv1")
        line = f"{name:22s} {count:2d} |"
        for t in sn:
            line += f" {t * 1e3:7.2f} {flops / t / 1e9:5.1f} {100 * flops / t / 1e9 / rate:4.0f}% |"
        sn_sum = sn[0] + sn[2] + (0 if skip_data else sn[1])
        total_sn += count * sn_sum
        if torch:
            th_sum = th[0] + th[2] + (0 if skip_data else th[1])
            total_torch += count * th_sum
            line = line[:-1] + f"| {th[0] * 1e3:9.2f} {th[1] * 1e3:7.2f} {th[2] * 1e3:7.2f} | {sn_sum / th_sum:8.2f}"
        print(line, flush=True)
    print(f"ResNet-50 convolutions, fwd+bwd, weighted by count: sncaffe {total_sn:.3f} s", end="")
    print(f", torch {total_torch:.3f} s, ratio {total_sn / total_torch:.2f}" if torch and total_torch else "")
    if hasattr(os, "getloadavg"):       # other processes on the machine make timings noisy
        print("load average %.2f %.2f %.2f" % os.getloadavg())


if __name__ == "__main__":
    main()
