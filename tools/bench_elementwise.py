"""Benchmark the element-wise steps of ReLU, Scale and BatchNorm: NumPy, NumPy split over sncaffe's
kernel threads, and oneDNN's kernels (not a test).

    python tools/bench_elementwise.py [--threads 1] [--shape 128,16,1024] [--repeat 30] [--warm]

One float32 tensor of ``--shape`` (images, channels, values per channel; default the CIFAR
ResNet-20's first stage at batch 128), each operation timed ``--repeat`` times; between calls
four other tensors of the same size are written, so each call reads its inputs from memory, not
from the cache (``--warm``: no flushing, the inputs stay cached). Printed: the median per call in
microseconds of each form, with the thread count and the load average. The forms:

- ``numpy``: sncaffe's NumPy code on the calling thread (the default below oneDNN's thresholds);
- ``numpy split``: the same code dealt over ``--threads`` kernel threads (``backend/workers.py``,
  what ``SNCAFFE_KERNEL_THREADS`` turns on), only where ``--threads`` > 1;
- ``onednn``: ``backend/onednn.Relu`` and ``Binary`` on the OpenMP team of ``--threads``.
"""
from __future__ import annotations

import argparse
from dataclasses import replace
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--shape", default="128,16,1024", help="images,channels,values per channel")
    ap.add_argument("--repeat", type=int, default=30)
    ap.add_argument("--warm", action="store_true", help="leave the inputs in the cache")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    import numpy as np

    from sncaffe import config

    from sncaffe.backend import onednn, workers

    from sncaffe.backend import runtimes
    runtimes.configure(args.threads)
    if onednn.version() is None:
        print(f"oneDNN is not installed ({onednn.INSTALL})")
        return 1
    view = tuple(int(v) for v in args.shape.split(","))
    rng = np.random.default_rng(0)
    x, dy, xn, t = (rng.standard_normal(view).astype(np.float32) for _ in range(4))
    y, dx = np.empty_like(x), np.empty_like(x)
    C = view[1]
    s, b, m = (rng.standard_normal(C).astype(np.float32) for _ in range(3))
    std = np.abs(s) + 1
    flush = [] if args.warm else [np.ones(view, np.float32) for _ in range(4)]

    def timed(fn):
        times = []
        for _ in range(args.repeat):
            for f in flush:
                f += 1
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1e6

    def split(fn):
        """fn(cs) over the channels, on the kernel threads."""
        def run():
            saved = config.settings
            config.settings = replace(config.settings, kernel_threads=args.threads)
            try:
                workers.split(C, 3 * x.size, fn)
            finally:
                config.settings = saved
        return run

    relu = onednn.relu(x.size, 0.0)
    scale = onednn.binary(view, onednn.MUL, ((onednn.ADD, False),))
    mul = onednn.binary(view, onednn.MUL)
    chain = onednn.binary(view, onednn.SUB, ((onednn.SUB, True), (onednn.DIV, False)))
    x1, y1, dy1, dx1 = (a.reshape(-1) for a in (x, y, dy, dx))
    cases = [
        ("ReLU forward", lambda cs: np.maximum(x[:, cs], 0, out=y[:, cs]), lambda: relu.forward(x1, y1)),
        ("ReLU backward", lambda cs: np.multiply(dy[:, cs], y[:, cs] > 0, out=dx[:, cs]),
         lambda: relu.backward(y1, dy1, dx1)),
        ("Scale x * s + b", lambda cs: (np.multiply(x[:, cs], s[cs, None], out=y[:, cs]),
                                        np.add(y[:, cs], b[cs, None], out=y[:, cs])),
         lambda: scale.run(x, s, y, b)),
        ("BatchNorm gradient", lambda cs: (np.multiply(xn[:, cs], m[cs, None], out=t[:, cs]),
                                           np.subtract(dy[:, cs], b[cs, None], out=dx[:, cs]),
                                           np.subtract(dx[:, cs], t[:, cs], out=dx[:, cs]),
                                           np.divide(dx[:, cs], std[cs, None], out=dx[:, cs])),
         lambda: (mul.run(xn, m, t), chain.run(dy, b, dx, t, std))),
    ]
    print(f"python tools/bench_elementwise.py --threads {args.threads} --shape {args.shape} --repeat {args.repeat}"
          f"{' --warm' if args.warm else ''}; {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f}; "
          f"median us per call, inputs {'cached' if args.warm else 'from memory'}")
    head = f"{'operation':<20}{'numpy':>10}" + (f"{'numpy split':>13}" if args.threads > 1 else "") + \
        f"{'onednn':>10}{'numpy/onednn':>14}"
    print(head)
    print("-" * len(head))
    everything = slice(0, C)
    for name, piece, fast in cases:
        plain = timed(lambda: piece(everything))
        row = f"{name:<20}{plain:>10.0f}"
        if args.threads > 1:
            row += f"{timed(split(piece)):>13.0f}"
        dnnl = timed(fast)
        print(row + f"{dnnl:>10.0f}{plain / dnnl:>14.2f}")
    print(f"load average {os.getloadavg()[0]:.2f} at the end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
