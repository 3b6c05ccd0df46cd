"""Benchmark sncaffe's CPU Net on ResNet-50 forward+backward, against its PyTorch twin (not a test).

Prints the thread count, the machine's NumPy fp32 GEMM rate, sncaffe's time per
iteration (forward + backward, batch N, 224x224), the share spent in
convolutions and their achieved GFLOP/s as a fraction of the GEMM rate, the
slowest layers, and, when torch is importable, the same net as
tools/torch_net.TorchNet timed the same way and the ratio sncaffe / torch.

    .venv/bin/python tools/bench_resnet50.py [--threads 1] [--batch 8] [--iterations 3] [--quick] [--no-torch] [--torch-profile]

The net is prototxt/resnet50.prototxt (with its loss), or else Kaiming He's
deploy file from tests/data/shared/zoo with batch statistics in its BatchNorms and a
SoftmaxWithLoss in place of its Softmax.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

from tables import table  # tools/tables.py: python puts the script's folder on sys.path

ROOT = Path(__file__).resolve().parents[1]
OURS = ROOT / "prototxt" / "resnet50.prototxt"
ZOO = ROOT / "tests" / "data" / "shared" / "zoo" / "resnet" / "ResNet-50-deploy.prototxt"


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1, help="BLAS, OpenMP and torch threads (default 1)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--iterations", type=int, default=3, help="timed iterations after one warm-up")
    ap.add_argument("--quick", action="store_true", help="one timed iteration")
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--torch-profile", action="store_true", help="profile one more torch iteration: top ops")
    return ap.parse_args()


def best(fn, seconds=1.0, least=10):
    """The fastest of repeated calls for ``seconds`` (at least ``least`` calls): other load
    on the cores only ever slows a call down."""
    fn()
    times, start = [], time.perf_counter()
    while len(times) < least or time.perf_counter() - start < seconds:
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def gemm_rates(np):
    """GFLOP/s of the fp32 GEMM sncaffe's convolutions run on (backend/blas.py: MKL or NumPy's
    OpenBLAS): 1024^3, and res4's 3x3 conv as one GEMM (batch 8)."""
    from sncaffe.backend.blas import gemm
    rng = np.random.default_rng(0)
    out = {}
    for name, (m, k, n) in {"1024^3": (1024, 1024, 1024), "256x2304 @ 2304x1568": (256, 2304, 1568)}.items():
        a, b = rng.standard_normal((m, k), dtype=np.float32), rng.standard_normal((k, n), dtype=np.float32)
        c = np.empty((m, n), np.float32)
        out[name] = 2 * m * k * n / best(lambda: gemm(a, b, c)) / 1e9
    return out


def resnet50(batch):
    """(NetParameter, source description) for ResNet-50 training at ``batch``."""
    from sncaffe.proto import sncaffe_pb2 as pb
    from sncaffe.prototxt import read_text, set_batch
    if OURS.exists():
        return set_batch(read_text(OURS, pb.NetParameter()), batch), str(OURS.relative_to(ROOT))
    param = set_batch(read_text(ZOO, pb.NetParameter()), batch)
    out = pb.NetParameter(name=param.name)
    for lp in param.layer:
        if lp.type == "Softmax":
            loss = out.layer.add(name="loss", type="SoftmaxWithLoss", top=["loss"])
            loss.bottom.extend([lp.bottom[0], "label"])
            continue
        out.layer.add().CopyFrom(lp)
        if lp.type == "BatchNorm":
            out.layer[-1].batch_norm_param.ClearField("use_global_stats")   # batch statistics in TRAIN
        if lp.type == "Input":
            label = out.layer.add(name="label", type="Input", top=["label"])
            label.input_param.shape.add().dim.append(batch)
    return out, f"{ZOO} (BatchNorm batch statistics, SoftmaxWithLoss added)"


def prepare(np, net, rng):
    """Random inputs (labels for label blobs), He-normal weights where the file gives none,
    random diffs on the outputs that are not losses. Returns the input values."""
    for node in net.graph.layers:
        if node.type in ("Convolution", "InnerProduct"):
            w = net.params[node.name][0].data
            if not w.any():
                w[...] = rng.standard_normal(w.shape) * np.sqrt(2.0 / (w.size // w.shape[0]))
    values = {}
    for name in net.inputs:
        shape = net.blobs[name].data.shape
        values[name] = (rng.integers(0, 1000, shape) if "label" in name else rng.standard_normal(shape))
        net.blobs[name].data[...] = values[name]
    losses = {t.name for n in net.graph.layers for t, w in zip(n.tops, n.loss_weights) if w}
    diffs = {}
    for name in net.outputs:
        blob = net.blobs[name]
        if blob.diff is not None and name not in losses:
            blob.diff[...] = diffs[name] = rng.standard_normal(blob.diff.shape).astype(np.float32)
    return values, diffs


def conv_flops(net):
    """Per conv layer: {"layer:forward": flops, "layer:backward": flops}. Each pass costs
    2*N*Cout*Hout*Wout*(Cin/g)*kh*kw; backward has the filter part when the weight learns and
    the data part when the bottom takes a gradient."""
    flops = {}
    for node in net.graph.layers:
        if node.type != "Convolution":
            continue
        N, Cout, Ho, Wo = node.tops[0].shape
        _, cin_g, kh, kw = net.params[node.name][0].data.shape
        f = 2.0 * N * Cout * Ho * Wo * cin_g * kh * kw
        flops[node.name + ":forward"] = f
        flops[node.name + ":backward"] = f * (node.param_need_backward[0] + node.propagate_down[0])
    return flops


def time_sncaffe(net, iterations):
    """[(forward, backward) seconds] per iteration, and seconds per op averaged over them."""
    net.forward()
    net.backward()
    runs, ops = [], defaultdict(float)
    for _ in range(iterations):
        net.clear_param_diffs()
        t0 = time.perf_counter()
        net.forward(timings=ops)
        t1 = time.perf_counter()
        net.backward(timings=ops)
        runs.append((t1 - t0, time.perf_counter() - t1))
    return runs, {k: v / iterations for k, v in ops.items()}


def time_torch(torch, twin, values, diffs, iterations):
    inputs = {k: torch.as_tensor(v, dtype=torch.float32) for k, v in values.items()}
    grads = {k: torch.from_numpy(g) for k, g in diffs.items()}

    def step():
        twin.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        out = twin(inputs)
        objective = out.loss + sum((out[k] * g).sum() for k, g in grads.items())
        t1 = time.perf_counter()
        objective.backward()
        return t1 - t0, time.perf_counter() - t1, float(out.loss.detach())
    step()
    runs = [step() for _ in range(iterations)]
    return [r[:2] for r in runs], runs[-1][2]


def torch_profile(torch, twin, values, rows=12):
    """Self CPU time of the aten ops of one forward+backward, as torch.profiler counts it."""
    from torch.profiler import ProfilerActivity, profile
    inputs = {k: torch.as_tensor(v, dtype=torch.float32) for k, v in values.items()}
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        twin(inputs).loss.backward()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows))


def mean(runs, i):
    return sum(r[i] for r in runs) / len(runs)




def main():
    args = parse_args()
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(args.threads)     # before NumPy (and torch) load their BLAS
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "tools"))
    import numpy as np
    from sncaffe import Net
    from sncaffe.backend.blas import BLAS
    torch = None
    if not args.no_torch:
        try:
            import torch
            torch.set_num_threads(args.threads)
        except ImportError:
            pass
    iterations = 1 if args.quick else args.iterations
    print(f"threads: {args.threads} (OPENBLAS_NUM_THREADS, OMP_NUM_THREADS, MKL_NUM_THREADS"
          f"{', torch.set_num_threads' if torch else ''}); os.cpu_count() {os.cpu_count()}, "
          f"load average {os.getloadavg()[0]:.2f} (other processes share the cores)")

    rates = gemm_rates(np)
    for name, r in rates.items():
        print(f"fp32 GEMM ({BLAS.describe()}) {name}: {r:.1f} GFLOP/s (fastest call in 1 s)")

    param, source = resnet50(args.batch)
    t = time.perf_counter()
    net = Net(param, "TRAIN", seed=0)
    print(f"net: {source}, batch {args.batch}, built in {time.perf_counter() - t:.1f} s; "
          f"1 warm-up + {iterations} timed iteration(s)")
    values, diffs = prepare(np, net, np.random.default_rng(0))

    runs, ops = time_sncaffe(net, iterations)
    again = gemm_rates(np)          # the machine's rate is the best seen, before or after
    print(f"fp32 GEMM 1024^3 again after sncaffe: {again['1024^3']:.1f} GFLOP/s")
    gemm = max(rates["1024^3"], again["1024^3"])
    fwd, bwd = mean(runs, 0), mean(runs, 1)
    total = fwd + bwd
    flops = conv_flops(net)
    conv_time = sum(ops.get(k, 0.0) for k in flops)
    conv_gf = sum(flops.values()) / 1e9
    sn_loss = net.loss()
    print(f"\n## sncaffe, seconds per iteration, mean of {iterations} (loss {sn_loss:.5f})\n")
    table([["forward", f"{fwd:.3f}", f"{100 * fwd / total:.0f}%"],
           ["backward", f"{bwd:.3f}", f"{100 * bwd / total:.0f}%"],
           ["forward + backward", f"{total:.3f}", "100%"],
           ["  best iteration", f"{min(map(sum, runs)):.3f}", ""],
           ["  in convolutions", f"{conv_time:.3f}", f"{100 * conv_time / total:.0f}%"],
           ["  elsewhere", f"{total - conv_time:.3f}", f"{100 * (total - conv_time) / total:.0f}%"]],
          ["", "s", "share"])
    rate = conv_gf / conv_time
    print(f"\nconvolutions: {conv_gf:.1f} GFLOP per iteration, {rate:.1f} GFLOP/s = "
          f"{100 * rate / gemm:.0f}% of the 1024^3 GEMM rate {gemm:.1f} (target >= 60%)")
    for kind in ("forward", "backward"):
        f = sum(v for k, v in flops.items() if k.endswith(kind))
        s = sum(ops[k] for k in flops if k.endswith(kind))
        print(f"  conv {kind:8s}: {f / 1e9:6.1f} GFLOP in {s:.3f} s = {f / s / 1e9:.1f} GFLOP/s "
              f"({100 * f / s / 1e9 / gemm:.0f}%)")

    by_type = defaultdict(lambda: [0.0, 0.0])
    types = {n.name: n.type for n in net.graph.layers}
    for k, v in ops.items():
        name, kind = k.rsplit(":", 1)
        by_type[types[name]][kind == "backward"] += v
    print("\n## sncaffe time by layer type (s per iteration)\n")
    table([[t, f"{f:.3f}", f"{b:.3f}", f"{100 * (f + b) / total:.1f}%"]
           for t, (f, b) in sorted(by_type.items(), key=lambda kv: -sum(kv[1]))],
          ["type", "forward", "backward", "share"])
    print("\n## sncaffe top 10 ops (s per iteration)\n")
    top = sorted(ops.items(), key=lambda kv: -kv[1])[:10]
    table([[k, types[k.rsplit(":", 1)[0]], f"{v:.4f}", f"{100 * v / total:.1f}%",
            f"{flops[k] / v / 1e9:.1f}" if flops.get(k) else ""] for k, v in top],
          ["op", "type", "s", "share", "GFLOP/s"])

    if torch is None:
        print("\ntorch: not importable (or --no-torch); no comparison")
        return
    from torch_net import TorchNet
    twin = TorchNet(net)
    t_runs, t_loss = time_torch(torch, twin, values, diffs, iterations)
    tf, tb = mean(t_runs, 0), mean(t_runs, 1)
    best_sn, best_t = min(map(sum, runs)), min(map(sum, t_runs))
    print(f"\n## sncaffe against PyTorch {torch.__version__} (TorchNet, {torch.get_num_threads()} thread(s)), "
          f"s per iteration, mean of {iterations}\n")
    table([["forward", f"{fwd:.3f}", f"{tf:.3f}", f"{fwd / tf:.2f}"],
           ["backward", f"{bwd:.3f}", f"{tb:.3f}", f"{bwd / tb:.2f}"],
           ["forward + backward", f"{total:.3f}", f"{tf + tb:.3f}", f"{total / (tf + tb):.2f}"],
           ["best iteration", f"{best_sn:.3f}", f"{best_t:.3f}", f"{best_sn / best_t:.2f}"]],
          ["", "sncaffe", "torch", "sncaffe/torch"])
    print(f"\nloss: sncaffe {sn_loss:.6f}, torch {t_loss:.6f} (target: sncaffe/torch <= 1); "
          f"load average {os.getloadavg()[0]:.2f}")
    if args.torch_profile:
        print("\n## torch profile of one more iteration\n")
        torch_profile(torch, twin, values)


if __name__ == "__main__":
    main()
