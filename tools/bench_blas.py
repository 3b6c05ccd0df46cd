"""sncaffe's CPU GEMMs on each BLAS it can load (not a test): MKL (the ``mkl`` extra) against the
OpenBLAS that NumPy ships, on the shapes its convolutions run.

``sncaffe.backend.blas`` picks MKL where installed (``SNCAFFE_BLAS`` overrides). This prints,
for each BLAS, the GFLOP/s of a 1024^3 GEMM and of the thin GEMMs a CIFAR ResNet's 3x3
convolutions are made of (per tap: M = K = channels, N = the batch's packed positions; the
weight gradient: K = positions), then the time of whole convolution passes (forward, weight
gradient, backward-data) with each BLAS, and the ratio.

    .venv/bin/python tools/bench_blas.py [--threads 1] [--repeat 5]
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from bench_conv import best_times  # the script's folder is on sys.path
from bench_conv_layouts import SHAPES
from tables import table

# GEMMs (M, K, N): what one tap of a 3x3 convolution runs at batch 128 in the CIFAR ResNet
GEMMS = {
    "1024^3": (1024, 1024, 1024),
    "tap 16ch 32x32": (16, 16, 128 * 33 * 33),
    "tap 32ch 16x16": (32, 32, 128 * 17 * 17),
    "tap 64ch 8x8": (64, 64, 128 * 9 * 9),
    "weight grad 16ch": (16, 128 * 33 * 33, 16),
    "weight grad 64ch": (64, 128 * 9 * 9, 64),
    "col 20>50 5x5 (LeNet conv2)": (50, 500, 64 * 64),
}
# convolutions (tools/bench_conv_layouts.py's shapes)
CONVS = {name: SHAPES[name] for name in ("CIFAR-RN 3x3 16", "CIFAR-RN 3x3 32", "CIFAR-RN 3x3 64", "LeNet conv2",
                                         "ResNet-50 3x3 128")}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1, help="BLAS threads (default 1)")
    ap.add_argument("--repeat", type=int, default=5, help="timed calls per figure, fastest kept")
    args = ap.parse_args()
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(args.threads)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import numpy as np
    from sncaffe.backend import blas
    from sncaffe.layers.im2col import ConvPlan

    libs = {}
    for name in ("mkl", "openblas"):
        try:
            libs[name] = blas.load(name)
        except RuntimeError as e:
            print(f"{name}: {e}")
    print(f"threads: {args.threads}; loaded: " + ", ".join(b.describe() for b in libs.values())
          + f"; default: {blas.BLAS.describe()}")
    rng = np.random.default_rng(0)
    rows = []
    for label, (m, k, n) in GEMMS.items():
        a, b = rng.standard_normal((m, k), dtype=np.float32), rng.standard_normal((k, n), dtype=np.float32)
        c = np.zeros((m, n), np.float32)
        times = best_times([lambda lib=lib: blas.gemm(a, b, c, 1.0, blas=lib) for lib in libs.values()], args.repeat)
        rates = [2 * m * k * n / t / 1e9 for t in times]
        rows.append([label, f"{m}x{k} @ {k}x{n}", *[f"{r:.0f}" for r in rates],
                     f"{rates[0] / rates[-1]:.2f}" if len(rates) > 1 else "-"])
    print("\n## GEMM GFLOP/s (beta 1, fastest call)\n")
    names = list(libs)
    table(rows, ["GEMM", "shape", *names, f"{names[0]} / {names[-1]}"])

    rows = []
    for label, (N, C, M, H, k, s, p) in CONVS.items():
        plan = ConvPlan(C, M, 1, (H, H), (k, k), (s, s), (p, p), (1, 1))
        ws = {key: np.zeros(v, np.float32) for key, v in plan.workspace(N).items()}
        x = rng.standard_normal((N, C, H, H), dtype=np.float32)
        w = rng.standard_normal((M, C, k, k), dtype=np.float32)
        y = np.empty((N, M) + plan.out_shape, np.float32)
        dy = rng.standard_normal(y.shape, dtype=np.float32)
        dw, dx = np.zeros_like(w), np.empty_like(x)
        passes = {"forward": lambda: plan.forward(x, w, y, ws),
                  "weight gradient": lambda: plan.backward(x, dy, w, ws, dw=dw),
                  "backward-data": lambda: plan.backward(x, dy, w, ws, dx=dx)}
        for pass_name, fn in passes.items():
            ms = []
            for lib in libs.values():
                blas.BLAS = lib                 # what im2col's gemm uses by default
                ms.append(best_times([fn], args.repeat)[0] * 1e3)
            rows.append([label, pass_name, *[f"{v:.2f}" for v in ms],
                         f"{ms[-1] / ms[0]:.2f}" if len(ms) > 1 else "-"])
    print("\n## Convolution passes, ms (fastest call)\n")
    table(rows, ["conv", "pass", *names, f"{names[-1]} / {names[0]}"])


if __name__ == "__main__":
    main()
