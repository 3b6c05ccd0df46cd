"""Benchmark sncaffe's cuda device (not a test): tables on stdout, exit status 1 if a stage failed.

Stages (``--stages``, in this order):

- ``resnet50``   ResNet-50 training (forward, backward, SGD step), batch 64, 224x224, images/s:
                 PyTorch eager with cuDNN (a ResNet-50 of Caffe's layout: stride in the first 1x1
                 of a block) and sncaffe (prototxt/resnet50.prototxt), side by side, in fp32 (TF32
                 off in both) and with TF32 convolutions (PyTorch's default; cudnn_conv.MATH).
- ``modes``      sncaffe's memory modes none and all on the same net: images/s and pool peak
                 (target: all at most 15% slower than none).
- ``resnet2500`` ResNet-2500 (batch 16) planned and run for one forward and backward within
                 ``--device-memory-2500`` (12GiB), SGD history reserved beside it.
- ``overlap``    a device-to-host copy of pinned memory during compute on the other stream:
                 how much of the shorter one the longer hides (the executor's offload needs it).
- ``trace``      ResNet-50 in memory mode offload, one iteration traced (``--trace``'s spans,
                 each operator waited for): how much of the copies' time overlaps compute.

    PYTHONPATH=. python tools/bench_gpu.py [--stages resnet50,modes,resnet2500,overlap]
        [--batch 64] [--iterations 10] [--device-memory 80GiB] [--quick]

Every stage prints a header and its table; a failing stage prints its traceback and the
run goes on to the next. torch is optional (its rows are skipped without it).
"""
from __future__ import annotations

import argparse
import gc
import sys
import time
import traceback
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sncaffe import Net  # noqa: E402
from sncaffe.backend import cudnn_conv  # noqa: E402
from sncaffe.proto import sncaffe_pb2 as pb  # noqa: E402
from sncaffe.prototxt import read_text, set_batch  # noqa: E402

GiB = 1 << 30


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--stages", default="resnet50,modes,resnet2500,overlap")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--iterations", type=int, default=10, help="timed iterations after 2 warm-ups")
    ap.add_argument("--device-memory", default="80GiB", help="sncaffe's device for ResNet-50 (torch gets the rest)")
    ap.add_argument("--device-memory-2500", default="12GiB")
    ap.add_argument("--host-memory-2500", default="52GiB", help="pinned host memory for ResNet-2500's offload")
    ap.add_argument("--quick", action="store_true", help="batch 16, 3 iterations, no ResNet-2500")
    ap.add_argument("--fp32-only", action="store_true", help="resnet50: fp32 rows only (no TF32)")
    return ap.parse_args(argv)


def table(rows, header):
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    line = "  ".join(f"{{:<{w}}}" if i == 0 else f"{{:>{w}}}" for i, w in enumerate(widths))
    print(line.format(*header))
    for r in rows:
        print(line.format(*r))


def resnet_param(name, batch):
    param = set_batch(read_text(ROOT / "prototxt" / f"{name}.prototxt", pb.NetParameter()), batch)
    return param


# -- sncaffe ---------------------------------------------------------------------------------

def sncaffe_net(device, param, memory="none", **kw):
    return Net(param, "TRAIN", device=device, memory=memory, seed=1, **kw)


def feed(net, rng):
    for name in net.inputs:
        blob = net.blobs[name]
        host = rng.integers(0, 1000, blob.shape) if name == "label" else rng.standard_normal(blob.shape)
        blob.data.set(host.astype(blob.data.dtype))


def sgd_step(net, lr=1e-4):
    for blobs in net.params.values():
        for b in blobs:
            b.data -= b.data.dtype.type(lr) * b.diff


def time_sncaffe(device, net, iterations, batch):
    """images/s of forward + backward + SGD step (2 warm-ups first: algorithm search, kernels)."""
    feed(net, np.random.default_rng(0))

    def step():
        net.clear_param_diffs()
        net.forward()                    # returns the loss: one host sync per iteration, as torch's .item()
        net.backward()
        sgd_step(net)
    for _ in range(2):
        step()
    device.synchronize()
    t0 = time.perf_counter()
    for _ in range(iterations):
        step()
    device.synchronize()
    return iterations * batch / (time.perf_counter() - t0)


# -- PyTorch: ResNet-50 in Caffe's layout -------------------------------------------------------

def torch_resnet50(torch):
    nn, F = torch.nn, torch.nn.functional

    class Block(nn.Module):
        def __init__(self, cin, mid, cout, stride):
            super().__init__()
            self.c1, self.b1 = nn.Conv2d(cin, mid, 1, stride, bias=False), nn.BatchNorm2d(mid)
            self.c2, self.b2 = nn.Conv2d(mid, mid, 3, 1, 1, bias=False), nn.BatchNorm2d(mid)
            self.c3, self.b3 = nn.Conv2d(mid, cout, 1, bias=False), nn.BatchNorm2d(cout)
            self.short = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                          if stride != 1 or cin != cout else None)

        def forward(self, x):
            r = x if self.short is None else self.short(x)
            y = F.relu(self.b1(self.c1(x)), inplace=True)
            y = F.relu(self.b2(self.c2(y)), inplace=True)
            return F.relu(self.b3(self.c3(y)) + r, inplace=True)

    layers, cin = [nn.Conv2d(3, 64, 7, 2, 3, bias=True), nn.BatchNorm2d(64), nn.ReLU(inplace=True),
                   nn.MaxPool2d(3, 2, ceil_mode=True)], 64
    for mid, n, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
        for i in range(n):
            layers.append(Block(cin, mid, mid * 4, stride if i == 0 else 1))
            cin = mid * 4
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2048, 1000)]
    return nn.Sequential(*layers)


def time_torch(torch, batch, iterations, tf32, benchmark):
    torch.backends.cudnn.allow_tf32 = tf32
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.benchmark = benchmark
    model = torch_resnet50(torch).cuda().train()
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    x = torch.randn(batch, 3, 224, 224, device="cuda")
    y = torch.randint(0, 1000, (batch,), device="cuda")

    def step():
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss.item()
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iterations):
        step()
    torch.cuda.synchronize()
    rate = iterations * batch / (time.perf_counter() - t0)
    del model, opt, x, y
    gc.collect()
    torch.cuda.empty_cache()
    return rate


# -- stages ---------------------------------------------------------------------------------

def stage_resnet50(args, ctx):
    rows, rates = [], {}
    try:
        import torch
    except ImportError:
        torch = None
        print("torch is not installed: sncaffe only")
    if torch is not None:
        configs = (("fp32", False, False), ("fp32, cudnn.benchmark", False, True),
                   ("tf32 (torch's default)", True, False))
        for label, tf32, bench in configs[:2] if args.fp32_only else configs:
            rate = time_torch(torch, args.batch, args.iterations, tf32, bench)
            rates["torch", label] = rate
            rows.append((f"PyTorch eager {torch.__version__}", label, f"{rate:.1f}"))
            print(f"  torch {label}: {rate:.1f} images/s", flush=True)
    device = ctx.device(args.device_memory)
    maths = (("fp32", "fma"), ("tf32 (torch's default)", "default"))
    for label, math in maths[:1] if args.fp32_only else maths:
        cudnn_conv.MATH = math
        t0 = time.perf_counter()
        net = sncaffe_net(device, resnet_param("resnet50", args.batch))
        built = time.perf_counter() - t0
        try:
            rate = time_sncaffe(device, net, args.iterations, args.batch)
        finally:
            peak = device.pool.peak
            net.release()
            del net
            gc.collect()
        rates["sncaffe", label] = rate
        rows.append(("sncaffe (cuda, memory none)", label, f"{rate:.1f}"))
        print(f"  sncaffe {label}: {rate:.1f} images/s (net built and algorithms measured in {built:.1f} s, "
              f"pool peak {peak / GiB:.2f} GiB)", flush=True)
    cudnn_conv.MATH = "fma"
    print()
    table(rows, ("ResNet-50 training, batch %d, 224x224" % args.batch, "math", "images/s"))
    for label in ("fp32", "tf32 (torch's default)"):
        if ("torch", label) in rates and ("sncaffe", label) in rates:
            best = max(v for (who, lab), v in rates.items() if who == "torch" and lab.startswith(label[:4]))
            print(f"sncaffe / best torch, {label}: {rates['sncaffe', label] / best:.2f} (target >= 1)")


def stage_modes(args, ctx):
    device = ctx.device(args.device_memory)
    rows, rates = [], {}
    for mode in ("none", "all"):
        net = sncaffe_net(device, resnet_param("resnet50", args.batch), memory=mode)
        try:
            device.pool.reset_peak()
            rates[mode] = time_sncaffe(device, net, args.iterations, args.batch)
            rows.append((mode, f"{rates[mode]:.1f}", f"{net.plan.peak / GiB:.2f}", f"{device.pool.peak / GiB:.2f}",
                         f"{device.stray.peak / GiB:.2f}"))
        finally:
            net.release()
            del net
            gc.collect()
        print(f"  mode {mode}: {rates[mode]:.1f} images/s", flush=True)
    table(rows, (f"ResNet-50 batch {args.batch}: mode", "images/s", "planned GiB", "pool peak GiB",
                 "CuPy temps peak GiB"))
    slower = 1 - rates["all"] / rates["none"]
    print(f"mode all is {100 * slower:.1f}% slower than none (target <= 15%)")


def stage_resnet2500(args, ctx):
    from sncaffe.plan.planner import MemoryExhausted
    from sncaffe.solvers.solver import history_bytes
    ctx.close()
    device = ctx.device(args.device_memory_2500, host=args.host_memory_2500)
    param = resnet_param("resnet2500", 16)
    limit = cudnn_conv.WORKSPACE_LIMIT
    for workspace in (limit, 16 << 20):
        cudnn_conv.WORKSPACE_LIMIT = workspace
        t0 = time.perf_counter()
        try:
            net = sncaffe_net(device, param, memory="all", reserve=lambda g: history_bytes(g, 1))
            break
        except MemoryExhausted as e:
            print(f"  convolution workspace limit {workspace >> 20} MiB: does not fit ({e}); trying less")
        finally:
            cudnn_conv.WORKSPACE_LIMIT = limit
    else:
        raise RuntimeError("ResNet-2500 does not fit")
    built = time.perf_counter() - t0
    print(f"  planned: device {net.plan.peak / GiB:.2f} GiB, pinned host {net.plan.host_peak / GiB:.2f} GiB "
          f"(of {device.host_pool.capacity / GiB:.0f}), {net.plan.d2h_bytes / GiB:.1f} GiB offloaded", flush=True)
    if net.plan.host_peak > device.host_pool.capacity:
        net.release()
        raise RuntimeError(f"the plan needs {net.plan.host_peak / GiB:.1f} GiB of pinned host memory: "
                           f"give --host-memory-2500")
    try:
        feed(net, np.random.default_rng(0))
        device.pool.reset_peak()
        t0 = time.perf_counter()
        loss = net.forward()
        net.backward()
        device.synchronize()
        took = time.perf_counter() - t0
        table([("ResNet-2500, batch 16", f"{args.device_memory_2500}", f"{net.plan.peak / GiB:.2f}",
                f"{device.pool.peak / GiB:.2f}", f"{net.plan.extra_bytes / GiB:.2f}", f"{built:.0f}", f"{took:.1f}",
                f"{loss:.3f}")],
              ("net", "device", "planned GiB", "pool peak GiB", "of it SGD history GiB", "build s", "iteration s",
               "loss"))
        if device.pool.peak != net.plan.peak:
            raise AssertionError(f"pool peak {device.pool.peak} != planned peak {net.plan.peak}")
        if not np.isfinite(loss):
            raise AssertionError(f"loss {loss}")
    finally:
        net.release()
        ctx.close()


def stage_overlap(args, ctx):
    device = ctx.device("4GiB", host="1GiB")
    cp = device.xp
    n = 512 << 20
    off, a = device.alloc((n // 4,), np.float32)
    hoff, host = device.host_alloc(n)
    m = cp.ones((4096, 4096), np.float32)
    repeat = [1]

    def compute():
        for _ in range(repeat[0]):
            cp.matmul(m, m)

    def timed(fn):
        device.synchronize()
        t0 = time.perf_counter()
        fn()
        device.synchronize()
        return time.perf_counter() - t0
    timed(lambda: device.copy_to_host(host, a).wait())      # warm-up: pins the host arena
    timed(compute)
    copy = timed(lambda: device.copy_to_host(host, a).wait())
    repeat[0] = max(1, round(copy / timed(compute)))         # compute about as long as the copy
    work = timed(compute)

    def both():
        event = device.copy_to_host(host, a)     # issued first: ordered after nothing pending on compute
        compute()
        event.wait()
    together = timed(both)
    hidden = (copy + work - together) / min(copy, work)     # 1: the shorter one entirely hidden
    table([(f"{n >> 20} MiB d2h", f"{1e3 * copy:.1f}", f"{1e3 * work:.1f}", f"{1e3 * together:.1f}", f"{hidden:.2f}",
            f"{n / copy / GiB:.1f}")],
          ("copy during compute", "copy ms", "compute ms", "both ms", "overlap (1 = full)", "copy GiB/s"))
    device.free(off)
    device.host_free(hoff)
    if hidden < 0.5:
        raise AssertionError(f"the copy does not overlap the compute (overlap {hidden:.2f})")


def union_overlap(copy, spans):
    """Seconds of the interval ``copy`` covered by the union of ``spans`` (sorted (start, end))."""
    start, end = copy
    covered, reach = 0.0, start
    for s, e in spans:
        s, e = max(s, reach), min(e, end)
        if e > s:
            covered += e - s
            reach = e
    return covered


def stage_trace(args, ctx):
    device = ctx.device(args.device_memory)
    net = sncaffe_net(device, resnet_param("resnet50", args.batch), memory="offload")
    try:
        feed(net, np.random.default_rng(0))
        net.forward()
        net.backward()                  # warm-up: algorithms, kernels, pinned host pool
        device.synchronize()
        net.executor.trace = []
        t0 = time.perf_counter()
        net.forward()
        net.backward()
        device.synchronize()
        wall = time.perf_counter() - t0
        spans = net.executor.trace_events()
        net.executor.trace = None
    finally:
        net.release()
        del net
        gc.collect()
    compute = sorted((s, e) for stream, _, s, e in spans if stream == "compute")
    rows = []
    for stream in ("d2h", "h2d"):
        copies = [(s, e) for st, _, s, e in spans if st == stream]
        busy = sum(e - s for s, e in copies)
        hidden = sum(union_overlap(c, compute) for c in copies)
        rows.append((stream, len(copies), f"{1e3 * busy:.1f}", f"{hidden / busy:.2f}" if busy else "-"))
    table(rows, (f"ResNet-50 batch {args.batch}, offload, traced ({1e3 * wall:.0f} ms)", "copies", "copy ms",
                 "overlapped with compute"))
    if not any(r[1] for r in rows):
        raise AssertionError("the traced iteration recorded no copies")


class Context:
    """One CUDADevice at a time (its arena is most of the GPU): made on demand, closed between stages
    that need another size."""

    def __init__(self):
        self._device, self._capacity = None, None

    def device(self, capacity, host="16GiB"):
        """host: the pinned host pool for offload (pinned on first use, never before)."""
        if self._device is not None and self._capacity != (capacity, host):
            self.close()
        if self._device is None:
            from sncaffe.backend.cuda import CUDADevice
            self._device, self._capacity = CUDADevice(capacity, host_capacity=host), (capacity, host)
        return self._device

    def close(self):
        if self._device is not None:
            self._device.close()
            self._device = None
            gc.collect()


def environment():
    from sncaffe.backend import cudnn
    from sncaffe.backend.cuda import gpu_count, import_cupy
    cupy = import_cupy()
    gpu_count(cupy)
    props = cupy.cuda.runtime.getDeviceProperties(0)
    name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    free, total = cupy.cuda.runtime.memGetInfo()
    print(f"GPU {name}, {total / GiB:.0f} GiB ({free / GiB:.0f} free); CuPy {cupy.__version__}, CUDA runtime "
          f"{cupy.cuda.runtime.runtimeGetVersion()}; cuDNN {'.'.join(map(str, cudnn.version()))} "
          f"({cudnn.library_path()})")


STAGES = {"resnet50": stage_resnet50, "modes": stage_modes, "resnet2500": stage_resnet2500, "overlap": stage_overlap,
          "trace": stage_trace}


def main(argv=None):
    args = parse_args(argv)
    stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    if args.quick:
        args.batch, args.iterations = 16, 3
        stages = [s for s in stages if s != "resnet2500"]
    unknown = [s for s in stages if s not in STAGES]
    if unknown:
        print(f"unknown stages {unknown} (one of {', '.join(STAGES)})")
        return 2
    try:
        environment()
    except Exception as e:
        print(f"no usable GPU: {e}")
        return 1
    ctx, results = Context(), []
    for name in stages:
        print(f"\n=== bench: {name} ===", flush=True)
        t0 = time.perf_counter()
        try:
            STAGES[name](args, ctx)
            results.append((name, "ok", f"{time.perf_counter() - t0:.0f}"))
        except Exception:
            traceback.print_exc(file=sys.stdout)
            results.append((name, "FAILED", f"{time.perf_counter() - t0:.0f}"))
            ctx.close()
        sys.stdout.flush()
    ctx.close()
    print("\n=== bench: summary ===")
    table(results, ("stage", "result", "seconds"))
    return 0 if all(r[1] == "ok" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
