"""Benchmark depthwise convolution on the CPU against PyTorch eager (not a test).

Two tables, every ratio from runs interleaved in this one process (the same machine load):

1. MobileNet v1/v2 depthwise 3x3 layers at batch 8, forward + backward (data and weights):
   sncaffe's layer (oneDNN where it loads), its ConvPlan (a GEMM set per group: the reference
   path) and torch.nn.functional.conv2d(groups=C).
2. Depthwise-separable blocks at batch 8, forward + backward of the whole block as a Net:
   MobileNet v1 (dw 3x3 + BN + Scale + ReLU, then 1x1 + BN + Scale + ReLU) and MobileNet v2
   (1x1 expand x6, dw 3x3, 1x1 project, BN + Scale after each, ReLU after the first two, a
   residual sum where the shapes allow), against the same layers in torch.

    python tools/bench_depthwise.py [--threads 1] [--repeat 5] [--batch 8] [--only 14x14]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

# (name, input channels, output channels, size, stride): v1 blocks, dw on the input channels
V1 = [("v1 32>64 112", 32, 64, 112, 1), ("v1 64>128 112/2", 64, 128, 112, 2),
      ("v1 128>128 56", 128, 128, 56, 1), ("v1 128>256 56/2", 128, 256, 56, 2),
      ("v1 256>256 28", 256, 256, 28, 1), ("v1 256>512 28/2", 256, 512, 28, 2),
      ("v1 512>512 14", 512, 512, 14, 1), ("v1 512>1024 14/2", 512, 1024, 14, 2),
      ("v1 1024>1024 7", 1024, 1024, 7, 1)]
# v2 inverted residuals: (name, in, out, size, stride), expansion 6
V2 = [("v2 16>24 112/2", 16, 24, 112, 2), ("v2 24>24 56", 24, 24, 56, 1), ("v2 24>32 56/2", 24, 32, 56, 2),
      ("v2 32>32 28", 32, 32, 28, 1), ("v2 64>64 14", 64, 64, 14, 1), ("v2 96>96 14", 96, 96, 14, 1),
      ("v2 96>160 14/2", 96, 160, 14, 2), ("v2 160>160 7", 160, 160, 7, 1)]


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1, help="sncaffe's and torch's threads (default 1)")
    ap.add_argument("--repeat", type=int, default=5, help="interleaved timed runs; the median is kept")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--only", default="", help="run rows whose name contains this")
    return ap.parse_args()


CLOCK = time.perf_counter      # main: the process's CPU time at one thread (the shared machine's load aside)


def medians(fns, repeat):
    """Median seconds of each function, runs interleaved so load from other processes hits all alike."""
    for fn in fns:
        fn()
    times = [[] for _ in fns]
    for _ in range(repeat):
        for t, fn in zip(times, fns):
            t0 = CLOCK()
            fn()
            t.append(CLOCK() - t0)
    return [statistics.median(t) for t in times]


def sncaffe_layer(np, C, M, H, s, group, options):
    """forward + backward (data and weights) of sncaffe's Convolution, as one function."""
    from sncaffe.gradcheck import Harness, make_layer
    layer = make_layer(f'type: "Convolution" convolution_param {{ num_output: {M} kernel_size: 3 stride: {s} '
                       f'pad: 1 group: {group} bias_term: false }}')
    layer.plan_options = options
    x = np.random.default_rng(0).standard_normal((BATCH, C, H, H), dtype=np.float32)
    h = Harness(layer, [x], np.float32)
    h.forward()
    h.top[0].diff[...] = np.random.default_rng(1).standard_normal(h.top[0].diff.shape, dtype=np.float32)
    kind = layer.dnn.conv(BATCH).impl("forward") if layer.dnn else type(layer.plan).__name__
    return lambda: (layer.forward(h.bottom, h.top), layer.backward(h.top, [True], h.bottom)), kind


def torch_layer(torch, C, M, H, s, group):
    x = torch.randn(BATCH, C, H, H, requires_grad=True)
    w = torch.randn(M, C // group, 3, 3, requires_grad=True)
    dy = torch.randn_like(torch.nn.functional.conv2d(x, w, None, s, 1, 1, group))

    def run():
        x.grad = w.grad = None
        torch.nn.functional.conv2d(x, w, None, s, 1, 1, group).backward(dy)
    return run


def _conv(name, bottom, M, k, s, group=1):
    pad = k // 2
    return (f'layer {{ name: "{name}" type: "Convolution" bottom: "{bottom}" top: "{name}" convolution_param {{ '
            f'num_output: {M} kernel_size: {k} stride: {s} pad: {pad} group: {group} bias_term: false '
            f'weight_filler {{ type: "msra" }} }} }}\n')


def _bn(name, relu=True):
    text = (f'layer {{ name: "{name}/bn" type: "BatchNorm" bottom: "{name}" top: "{name}" }}\n'
            f'layer {{ name: "{name}/scale" type: "Scale" bottom: "{name}" top: "{name}" '
            f'scale_param {{ bias_term: true }} }}\n')
    return text + (f'layer {{ name: "{name}/relu" type: "ReLU" bottom: "{name}" top: "{name}" }}\n' if relu else "")


def block_prototxt(kind, C, M, H, s):
    text = f'layer {{ name: "in" type: "Input" top: "x" input_param {{ shape {{ dim: {BATCH} dim: {C} dim: {H} dim: {H} }} }} }}\n'
    if kind == "v1":
        return text + _conv("dw", "x", C, 3, s, C) + _bn("dw") + _conv("pw", "dw", M, 1, 1) + _bn("pw")
    E = 6 * C
    text += _conv("expand", "x", E, 1, 1) + _bn("expand") + _conv("dw", "expand", E, 3, s, E) + _bn("dw")
    text += _conv("project", "dw", M, 1, 1) + _bn("project", relu=False)
    if s == 1 and C == M:
        text += 'layer { name: "sum" type: "Eltwise" bottom: "x" bottom: "project" top: "sum" }\n'
    return text


def sncaffe_block(np, text):
    from sncaffe import Net
    from sncaffe.proto import sncaffe_pb2 as pb
    from sncaffe.prototxt import parse_text
    param = parse_text(text, pb.NetParameter())
    param.force_backward = True
    net = Net(param, "TRAIN")
    net.blobs["x"].data[...] = np.random.default_rng(0).standard_normal(net.blobs["x"].data.shape)
    for name in net.outputs:          # the gradient of the sum, as torch's .sum().backward()
        net.blobs[name].diff[...] = 1.0

    def run():
        net.forward()
        net.backward()
    return run, net


def torch_block(torch, kind, C, M, H, s):
    nn = torch.nn

    def cbr(cin, cout, k, stride, group, relu=True):
        mods = [nn.Conv2d(cin, cout, k, stride, k // 2, groups=group, bias=False), nn.BatchNorm2d(cout)]
        return mods + [nn.ReLU(inplace=True)] * relu
    if kind == "v1":
        body = nn.Sequential(*cbr(C, C, 3, s, C), *cbr(C, M, 1, 1, 1))
    else:
        E = 6 * C
        body = nn.Sequential(*cbr(C, E, 1, 1, 1), *cbr(E, E, 3, s, E), *cbr(E, M, 1, 1, 1, relu=False))
    residual = kind == "v2" and s == 1 and C == M
    x = torch.randn(BATCH, C, H, H, requires_grad=True)

    def run():
        body.zero_grad(set_to_none=False)
        y = body(x)
        (y + x if residual else y).sum().backward()
    return run


def layer_table(np, torch, args, tables):
    rows = []
    shapes = sorted({(C, H, s) for _, C, _, H, s in V1} | {(6 * C, H, s) for _, C, _, H, s in V2})
    for C, H, s in shapes:
        name = f"dw {C} {H}x{H}{'/2' if s == 2 else ''}"
        if args.only not in name:
            continue
        fast, kind = sncaffe_layer(np, C, C, H, s, C, {})
        native, _ = sncaffe_layer(np, C, C, H, s, C, {"flip": None})     # ConvPlan options: off oneDNN
        fns = [fast, native] + ([torch_layer(torch, C, C, H, s, C)] if torch else [])
        t = medians(fns, args.repeat)
        rows.append([name, kind, f"{t[0] * 1e3:.2f}", f"{t[1] * 1e3:.2f}", f"{t[1] / t[0]:.2f}"]
                    + ([f"{t[2] * 1e3:.2f}", f"{t[2] / t[0]:.2f}"] if torch else []))
    tables.table(rows, ["depthwise 3x3, fwd+bwd", "kernel", "sncaffe ms", "ConvPlan ms",
                        "ConvPlan/sncaffe", "torch ms", "torch/sncaffe"][:7 if torch else 5])


def block_table(np, torch, args, tables):
    rows = []
    for kind, shapes in (("v1", V1), ("v2", V2)):
        for name, C, M, H, s in shapes:
            if args.only not in name:
                continue
            run, net = sncaffe_block(np, block_prototxt(kind, C, M, H, s))
            fns = [run] + ([torch_block(torch, kind, C, M, H, s)] if torch else [])
            t = medians(fns, args.repeat)
            rows.append([name, f"{t[0] * 1e3:.2f}"] + ([f"{t[1] * 1e3:.2f}", f"{t[1] / t[0]:.2f}"] if torch else []))
            net.release()
    tables.table(rows, ["block fwd+bwd, batch %d" % BATCH, "sncaffe ms", "torch ms", "torch/sncaffe"][:4 if torch else 2])


BATCH = 8


def main():
    global BATCH, CLOCK
    args = parse_args()
    if args.threads == 1:       # every kernel runs on the calling thread: CPU time is its time
        CLOCK = time.process_time
    BATCH = args.batch
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from sncaffe.backend import runtimes
    decision = runtimes.configure(args.threads)
    import numpy as np
    import tables
    try:
        import torch
        torch.set_num_threads(args.threads)
    except ImportError:
        torch = None
    from sncaffe.backend.blas import BLAS
    print(f"sncaffe threads: {decision.describe()}; GEMMs on {BLAS.describe()}")
    print(f"torch: {torch.__version__ + f', {torch.get_num_threads()} threads' if torch else 'not installed'}; "
          f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores; median of {args.repeat} "
          f"interleaved runs ({'CPU time' if CLOCK is time.process_time else 'wall clock'}); batch {BATCH}\n")
    layer_table(np, torch, args, tables)
    block_table(np, torch, args, tables)


if __name__ == "__main__":
    main()
