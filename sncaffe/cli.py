"""The ``sncaffe`` command."""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from .mem.pool import fmt_bytes


def _net_param(args):
    from .proto import sncaffe_pb2 as pb
    from .prototxt import read_text, set_batch
    param = read_text(args.net, pb.NetParameter())
    if args.batch:
        param = set_batch(param, args.batch)
    return param


def _device(args):
    from .backend import make_device
    return make_device(args.device, args.device_memory)


def cmd_time(args) -> int:
    """Per-layer forward and backward times, like ``caffe time``."""
    from .net import Net
    param = _net_param(args)
    param.force_backward = True           # time every layer's backward, as caffe time does
    net = Net(param, args.phase, device=_device(args), weights=args.weights)
    rng = np.random.default_rng(0)
    for name in net.inputs:
        blob = net.blobs[name]
        blob.data[...] = 0 if "label" in name else rng.standard_normal(blob.data.shape)
    for name in net.outputs:
        blob = net.blobs[name]
        if blob.diff is not None and blob.data.ndim:
            blob.diff[...] = rng.standard_normal(blob.diff.shape)
    print(f"sncaffe time: {args.net} ({net.name or 'net'}), phase {args.phase}, "
          f"{args.iterations} iterations, device {net.device.name}", flush=True)
    net.forward()                          # warm-up, as caffe time does
    net.backward()
    fwd, bwd = {}, {}
    t0 = time.perf_counter()
    for _ in range(args.iterations):
        net.forward(timings=fwd)
        net.backward(timings=bwd)
    total = time.perf_counter() - t0
    n = args.iterations
    width = max(len(x) for x in net.layer_names) + 2
    print(f"{'layer':<{width}}{'type':<24}{'forward ms':>12}{'backward ms':>13}")
    for node in net.graph.layers:
        f = fwd.get(node.name + ":forward", 0.0) / n * 1e3
        b = bwd.get(node.name + ":backward", 0.0) / n * 1e3
        print(f"{node.name:<{width}}{node.type:<24}{f:>12.3f}{b:>13.3f}")
    f_all, b_all = sum(fwd.values()) / n * 1e3, sum(bwd.values()) / n * 1e3
    batch = net.blobs[net.inputs[0]].data.shape[0] if net.inputs else 0
    print(f"Average Forward pass: {f_all:.3f} ms.")
    print(f"Average Backward pass: {b_all:.3f} ms.")
    print(f"Average Forward-Backward: {total / n * 1e3:.3f} ms"
          + (f" ({batch * n / total:.1f} images/s)." if batch else "."))
    print(f"Total Time: {total * 1e3:.1f} ms.")
    st = net.device.pool.stats()
    print(f"Pool peak: {fmt_bytes(st['peak'])} ({st['peak']} bytes) of {fmt_bytes(st['capacity'])}.")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="sncaffe", description="Train and run Caffe networks.")
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("time", help="time forward and backward per layer (like caffe time)")
    t.add_argument("net", help="net prototxt")
    t.add_argument("--iterations", "-n", type=int, default=50)
    t.add_argument("--phase", default="TRAIN", choices=["TRAIN", "TEST"])
    t.add_argument("--batch", type=int, help="override the batch size")
    t.add_argument("--weights", help=".caffemodel to load")
    t.add_argument("--device", default="cpu")
    t.add_argument("--device-memory", help="device capacity, e.g. 12GiB")
    t.set_defaults(func=cmd_time)
    args = p.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, MemoryError, RuntimeError) as e:
        print(f"sncaffe {args.command}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
