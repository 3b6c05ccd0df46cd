"""Benchmark every kernel form of sncaffe's CPU convolution on the shapes that matter (not a test).

``sncaffe.layers.im2col.ConvPlan`` runs a convolution in one of several forms:
per-tap GEMMs on the packed batch ("taps"), per-tap GEMMs per image ("image"),
or a column matrix ("col"); the weight gradient by per-tap GEMMs or a column
matrix; a stride-1 backward-data by scatter-add or as the convolution of the
top diff with the flipped kernel ("flip"). Its defaults are rules drawn from
this table. For each shape (LeNet, the CIFAR ResNet, ResNet-50's 3x3s, CIFAR-10
full's and AlexNet's), it prints each form's forward, weight-gradient and
backward-data time, marks the form the default picks for each pass and how
far the default is from the fastest form.

    .venv/bin/python tools/bench_conv_layouts.py [--threads 1] [--repeat 3] [--only c32]
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from tables import table  # tools/tables.py: python puts the script's folder on sys.path

# name: (batch, channels, num_output, input size, kernel, stride, pad)
SHAPES = {
    "LeNet conv1": (64, 1, 20, 28, 5, 1, 0),
    "LeNet conv2": (64, 20, 50, 12, 5, 1, 0),
    "CIFAR-RN conv1": (128, 3, 16, 32, 3, 1, 1),
    "CIFAR-RN 3x3 16": (128, 16, 16, 32, 3, 1, 1),
    "CIFAR-RN 3x3/2 16>32": (128, 16, 32, 32, 3, 2, 1),
    "CIFAR-RN 3x3 32": (128, 32, 32, 16, 3, 1, 1),
    "CIFAR-RN 3x3 64": (128, 64, 64, 8, 3, 1, 1),
    "CIFAR-10 full conv2": (100, 32, 32, 16, 5, 1, 2),
    "CIFAR-10 full conv3": (100, 32, 64, 8, 5, 1, 2),
    "ResNet-50 conv1": (8, 3, 64, 224, 7, 2, 3),
    "ResNet-50 3x3 64": (8, 64, 64, 56, 3, 1, 1),
    "ResNet-50 3x3 128": (8, 128, 128, 28, 3, 1, 1),
    "ResNet-50 3x3 256": (8, 256, 256, 14, 3, 1, 1),
    "ResNet-50 3x3 512": (8, 512, 512, 7, 3, 1, 1),
    "AlexNet conv2": (16, 96, 256, 27, 5, 1, 2),
    "AlexNet conv4": (16, 384, 384, 13, 3, 1, 1),
}
# form: ConvPlan options of the forward (the weight gradient and backward-data vary below)
FORMS = {"taps": dict(col=False, batched=True), "image": dict(col=False, batched=False), "col": dict(col=True)}


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1, help="BLAS threads (default 1)")
    ap.add_argument("--repeat", type=int, default=3, help="timed runs per measurement, best kept")
    ap.add_argument("--only", default="", help="run shapes whose name contains this")
    return ap.parse_args()


def measure(np, ConvPlan, best_times, shape, repeat):
    """{(pass, form): seconds} for every form that applies, and the default plan."""
    N, C, M, H, k, s, p = shape
    rng = np.random.default_rng(0)
    x = rng.standard_normal((N, C, H, H), dtype=np.float32)
    w = rng.standard_normal((M, C, k, k), dtype=np.float32)
    geometry = (C, M, 1, (H, H), (k, k), (s, s), (p, p), (1, 1))
    out = {}
    for form, opts in FORMS.items():
        for filt in ("taps", "col"):
            for flip in (False, True):
                if form == "col" and filt == "taps" or form == "image" and filt == "col":
                    continue            # a column forward sums its gradient by columns; image has none
                plan = ConvPlan(*geometry, col_filter=filt == "col", flip=flip, **opts)
                if flip and not plan.flip:
                    continue
                ws = {name: np.zeros(n, np.float32) for name, n in plan.workspace(N).items()}
                y = np.zeros((N, M) + plan.out_shape, np.float32)
                dy = rng.standard_normal(y.shape, dtype=np.float32)
                dx, dw = np.zeros_like(x), np.zeros_like(w)
                fns = {("backward-data", form + (" flip" if flip else ""),):
                       lambda: plan.backward(x, dy, w, ws, dx=dx)}
                if not flip:
                    fns[("weight gradient", form if form == "col" else f"{form}, {filt} filter")] = \
                        lambda: plan.backward(x, dy, w, ws, dw=dw)
                    if filt == "taps" or form == "col":
                        fns[("forward", form)] = lambda: plan.forward(x, w, y, ws)
                for key, t in zip(fns, best_times(list(fns.values()), repeat)):
                    out.setdefault(key, t)
    return out, ConvPlan(*geometry)


def default_forms(plan):
    form = "col" if plan.col else ("taps" if plan.batched else "image")
    filt = "col" if form == "col" else f"{form}, {'col' if plan.col_filter else 'taps'} filter"
    return {"forward": form, "weight gradient": filt, "backward-data": form + (" flip" if plan.flip else "")}


def main():
    args = parse_args()
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(args.threads)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import numpy as np
    from bench_conv import best_times
    from sncaffe.layers.im2col import ConvPlan
    print(f"threads: {args.threads} (OPENBLAS_NUM_THREADS); load average {os.getloadavg()[0]:.2f}\n")
    summary = []
    for name, shape in SHAPES.items():
        if args.only not in name:
            continue
        times, plan = measure(np, ConvPlan, best_times, shape, args.repeat)
        chosen = default_forms(plan)
        rows = []
        for (pass_, form), t in sorted(times.items(), key=lambda kv: (kv[0][0], kv[1])):
            rows.append([pass_, form, f"{t * 1e3:.2f}", "default" if chosen[pass_] == form else ""])
        N, C, M, H, k, s, p = shape
        print(f"## {name}: batch {N}, {C}>{M} channels, {H}x{H}, {k}x{k} stride {s} pad {p}\n")
        table(rows, ["pass", "form", "ms", ""])
        for pass_ in ("forward", "weight gradient", "backward-data"):
            mine = [t for (q, f), t in times.items() if q == pass_ and f == chosen[pass_]]
            best = min(t for (q, _), t in times.items() if q == pass_)
            summary.append([name, pass_, chosen[pass_], f"{mine[0] * 1e3:.2f}" if mine else "-",
                            f"{best * 1e3:.2f}", f"{mine[0] / best:.2f}" if mine else "-"])
    print("## the default against the fastest form\n")
    table(summary, ["shape", "pass", "default form", "default ms", "fastest ms", "default/fastest"])


if __name__ == "__main__":
    main()
