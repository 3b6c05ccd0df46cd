"""Benchmark the element-wise and per-channel kernels alone at 1 and N kernel threads (not a test).

    python tools/bench_kernels.py [--threads 2] [--repeat 30]

One layer at a time (sncaffe.gradcheck.Harness: plain float32 arrays), on ResNet-50's (batch 8)
and the CIFAR ResNet-20's (batch 128) activation shapes: forward and backward timed with the
kernel threads off (the default) and on (config.settings.kernel_threads), call by call in
turn, ``--repeat`` times each. Printed: the fastest and the median call of each and the ratio of
the fastest (the least disturbed: other processes on the cores only ever slow a call), with the
load average; no GEMM runs here.
"""
from __future__ import annotations

import argparse
from dataclasses import replace
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CASES = [   # (layer text, bottom shape)
    ('type: "ReLU"', (8, 256, 56, 56)),
    ('type: "ReLU"', (128, 16, 32, 32)),
    ('type: "BatchNorm"', (8, 256, 56, 56)),
    ('type: "BatchNorm"', (8, 512, 28, 28)),
    ('type: "BatchNorm"', (128, 16, 32, 32)),
    ('type: "BatchNorm"', (128, 64, 8, 8)),
    ('type: "Scale" scale_param { bias_term: true }', (8, 256, 56, 56)),
    ('type: "Scale" scale_param { bias_term: true }', (128, 16, 32, 32)),
    ('type: "Pooling" pooling_param { pool: MAX kernel_size: 3 stride: 2 pad: 1 }', (8, 64, 112, 112)),
    ('type: "Eltwise"', (8, 256, 56, 56)),
    ('type: "Eltwise"', (128, 16, 32, 32)),
]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=30)
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "tools"))
    import numpy as np
    from tables import table
    from sncaffe import config
    from sncaffe.backend import runtimes
    from sncaffe.gradcheck import Harness, make_layer
    runtimes.configure(args.threads)
    print(f"python tools/bench_kernels.py --threads {args.threads} --repeat {args.repeat}; {os.cpu_count()} cores, "
          f"load average {os.getloadavg()[0]:.2f} at the start (the machine is shared)")
    rng = np.random.default_rng(0)
    rows = []
    for text, shape in CASES:
        n_bottoms = 2 if "Eltwise" in text else 1
        layer = make_layer(text, n_bottoms=n_bottoms)
        h = Harness(layer, [rng.standard_normal(shape) for _ in range(n_bottoms)], dtype=np.float32)
        h.forward()
        for t in h.top:
            t.diff[...] = rng.standard_normal(t.diff.shape)
        down = [True] * n_bottoms
        times = {(p, on): [] for p in ("forward", "backward") for on in (False, True)}
        for _ in range(args.repeat):
            for on in (False, True):
                config.settings = replace(config.settings, kernel_threads=args.threads if on else 1)
                for p, call in (("forward", lambda: layer.forward(h.bottom, h.top)),
                                ("backward", lambda: layer.backward(h.top, down, h.bottom))):
                    t0 = time.perf_counter()
                    call()
                    times[p, on].append(time.perf_counter() - t0)
        for p in ("forward", "backward"):
            off, on = sorted(times[p, False]), sorted(times[p, True])
            rows.append([layer.type, "x".join(map(str, shape)), p, f"{off[0] * 1e3:.2f}", f"{on[0] * 1e3:.2f}",
                         f"{off[0] / on[0]:.2f}x", f"{off[len(off) // 2] * 1e3:.2f}", f"{on[len(on) // 2] * 1e3:.2f}"])
    print()
    table(rows, ["layer", "bottom", "pass", "1 thread min ms", f"{args.threads} min ms", "speed-up (min)",
                 "1 thread median ms", f"{args.threads} median ms"])
    print(f"\nload average {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()
