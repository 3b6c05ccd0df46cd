"""PyTorch's memory for one training step, measured in a real run in a process of its own.

    python tools/torch_memory.py --blocks 3,4,6,3 --batch 16 --image-size 224 --variant eager
    python tools/torch_memory.py ... --deepest 3GiB --by rss       # deepest [3, 4, k, 3] within 3 GiB

The net is tools/torch_idiomatic's ResNet (torchvision's layout, affine BatchNorm2d, in-place
ReLU), trained by SGD with momentum; parameters' gradients and momentum buffers exist before
the step (as sncaffe's diffs and history do). Variants, PyTorch's own memory savers:

eager                    the plain step
checkpoint               torch.utils.checkpoint.checkpoint_sequential over the blocks
                         (--segments; by default the count that needs least memory, searched)
save_on_cpu              torch.autograd.graph.save_on_cpu: every tensor autograd saves goes to
                         host memory and comes back for backward
checkpoint+save_on_cpu   both

Each figure comes from a step that really ran (nothing estimated on the meta device):

rss      the process's peak resident set (VmHWM) over the first step: what the machine
         gave the whole process, libraries included (sncaffe is measured the same way)
device   the bytes malloc holds (glibc's mallinfo2: in arenas plus mmapped chunks), read after
         every aten op of a second step, at their highest, less what malloc held before the net
         was built (the libraries' own heap): torch's CPU allocator takes every tensor from
         malloc, so this is what a GPU would have to hold.
         The profiler's memory timeline cannot be used: it fails under saved-tensor hooks.
host     the peak bytes of save_on_cpu's host copies, which live in anonymous mmaps outside
         malloc (so outside "device"), as pinned host buffers live outside a GPU's memory.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

TOOLS = Path(__file__).resolve().parent
VARIANTS = ("eager", "checkpoint", "save_on_cpu", "checkpoint+save_on_cpu")
UNITS = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


class MallocPeak:
    """A dispatch mode reading mallinfo2() after every aten op; ``peak``: the highest in-use bytes."""

    FIELDS = ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
              "fordblks", "keepcost")

    def __new__(cls):
        import ctypes

        from torch.utils._python_dispatch import TorchDispatchMode

        class Info(ctypes.Structure):
            _fields_ = [(f, ctypes.c_size_t) for f in cls.FIELDS]
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = Info

        class Mode(TorchDispatchMode):
            peak = 0

            @staticmethod
            def in_use():
                i = libc.mallinfo2()
                return i.uordblks + i.hblkhd

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                self.peak = max(self.peak, self.in_use())
                return out
        return Mode()


class HostSaved:
    """save_on_cpu's hooks with the host copies in NumPy memory, counted: pack copies a saved
    tensor to the host, unpack copies it back (a device allocation, as on a GPU)."""

    def __init__(self, np, torch):
        self.np, self.torch = np, torch
        self.live = self.peak = 0

    class _Packed:
        __slots__ = ("owner", "tensor", "nbytes")

        def __init__(self, owner, tensor, nbytes):
            self.owner, self.tensor, self.nbytes = owner, tensor, nbytes

        def __del__(self):
            self.owner.live -= self.nbytes

    def pack(self, t):
        if t.requires_grad and t.is_leaf:        # parameters stay where they are
            return t
        import mmap
        nbytes = t.numel() * t.element_size()
        buf = mmap.mmap(-1, max(nbytes, 1))
        dtype = self.np.dtype(str(t.dtype)[6:])
        host = self.torch.from_numpy(self.np.frombuffer(buf, dtype, t.numel()).reshape(tuple(t.shape)))
        host.copy_(t)
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        return HostSaved._Packed(self, host, nbytes)

    @staticmethod
    def unpack(p):
        return p.tensor.clone() if isinstance(p, HostSaved._Packed) else p


def rss_now(field="VmRSS") -> int:
    """This process's resident bytes (VmRSS), or its peak (VmHWM: unlike ru_maxrss, which a child
    inherits from the parent it was forked from, the peak of this process's own memory alone)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def best_segments(n: int) -> int:
    """checkpoint_sequential's segment count that keeps least: about sqrt(n) boundaries live."""
    return max(1, round(math.sqrt(n)))


def measure(blocks, batch, image_size, variant, segments=None, seed=0) -> dict:
    """One real training step of ``variant`` in this process: rss, device and host peaks (bytes)."""
    import contextlib

    import numpy as np
    import torch
    import torch.nn.functional as F
    from torch.utils.checkpoint import checkpoint_sequential
    sys.path.insert(0, str(TOOLS))
    import torch_idiomatic

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    import gc
    gc.collect()                      # what an earlier caller dropped must not be freed inside the step
    watch = MallocPeak()
    base = watch.in_use()             # the libraries' own heap, before the net exists
    torch.manual_seed(seed)
    model = torch_idiomatic.resnet(tuple(blocks))
    params = [p for p in model.parameters()]
    for p in params:
        p.grad = torch.zeros_like(p)
    opt = torch.optim.SGD(params, lr=1e-3, momentum=0.9, weight_decay=5e-4)
    for p in params:
        opt.state[p]["momentum_buffer"] = torch.zeros_like(p)
    x = torch.randn(batch, 3, image_size, image_size)
    y = torch.randint(0, 1000, (batch,))
    seq = torch_idiomatic.sequential(model)
    segments = segments or best_segments(len(seq))
    host = HostSaved(np, torch)

    def step(update=True):
        opt.zero_grad(set_to_none=False)
        saver = (torch.autograd.graph.saved_tensors_hooks(host.pack, host.unpack) if "save_on_cpu" in variant
                 else contextlib.nullcontext())
        with saver:
            if variant.startswith("checkpoint"):
                logits = checkpoint_sequential(seq, segments, x, use_reentrant=False)
            else:
                logits = model(x)
            loss = F.cross_entropy(logits, y)
            loss.backward()
        if update:
            opt.step()
        return float(loss.detach())

    before = rss_now()
    t0 = time.perf_counter()
    loss = step()
    seconds = time.perf_counter() - t0
    rss = rss_now("VmHWM")
    with watch:
        step()
    device = watch.peak - base
    return {"variant": variant, "blocks": list(blocks), "batch": batch, "image_size": image_size,
            "segments": segments if variant.startswith("checkpoint") else None, "loss": loss,
            "rss": rss, "rss_before_step": before, "device": device, "host": host.peak,
            "seconds": seconds, "threads": torch.get_num_threads()}


def measure_in_child(blocks, batch, image_size, variant, segments=None, timeout=7200) -> dict:
    """``measure`` in a fresh process (one thread), so the peak RSS is this step's alone."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--blocks", ",".join(map(str, blocks)),
           "--batch", str(batch), "--image-size", str(image_size), "--variant", variant, "--json"]
    if segments:
        cmd += ["--segments", str(segments)]
    env = {**os.environ, **{v: "1" for v in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")}}
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if r.returncode:
        # a step that does not fit the machine dies (MemoryError or the OOM killer): it does not fit
        return {"variant": variant, "blocks": list(blocks), "failed": (r.stderr or r.stdout)[-400:],
                "rss": math.inf, "device": math.inf, "host": math.inf}
    return json.loads(r.stdout.strip().splitlines()[-1])


def parse_bytes(text: str) -> int:
    for unit, n in sorted(UNITS.items(), key=lambda kv: -len(kv[0])):
        if text.endswith(unit):
            return int(float(text[:-len(unit)]) * n)
    return int(text)


def deepest(budget, by, batch, image_size, variant, k_max, say=print) -> tuple:
    """The largest k <= k_max whose real step's ``by`` figure fits ``budget`` (bisection over
    real runs), and every run made on the way."""
    sys.path.insert(0, str(TOOLS))
    from compare import deepest as search
    runs = {}

    def peak(k):
        runs[k] = measure_in_child((3, 4, k, 3), batch, image_size, variant)
        say(f"  {variant} k={k} (ResNet-{3 * (k + 10) + 2}): {by} {runs[k][by] / (1 << 30):.3f} GiB")
        return runs[k][by]
    return search(peak, budget, k_max), runs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", default="3,4,6,3", help="bottleneck blocks per stage (default: ResNet-50)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--variant", choices=VARIANTS, default="eager")
    ap.add_argument("--segments", type=int, help="checkpoint_sequential's segments (default: sqrt of the blocks)")
    ap.add_argument("--deepest", help="a budget (e.g. 3GiB): search the deepest [3, 4, k, 3] that fits")
    ap.add_argument("--by", choices=("rss", "device"), default="rss", help="which figure must fit the budget")
    ap.add_argument("--k-max", type=int, default=822)
    ap.add_argument("--json", action="store_true", help="print the result as one JSON line")
    args = ap.parse_args(argv)
    if args.deepest:
        k, runs = deepest(parse_bytes(args.deepest), args.by, args.batch, args.image_size, args.variant,
                          args.k_max)
        print(json.dumps({"deepest_k": k, "depth": 3 * (k + 10) + 2 if k else None, "budget": args.deepest,
                          "by": args.by, "runs": {str(k2): r for k2, r in sorted(runs.items())}}))
        return 0
    r = measure(tuple(int(b) for b in args.blocks.split(",")), args.batch, args.image_size, args.variant,
                args.segments)
    if args.json:
        print(json.dumps(r))
    else:
        g = 1 << 30
        print(f"{r['variant']}: rss {r['rss'] / g:.3f} GiB (before the step {r['rss_before_step'] / g:.3f}), "
              f"device {r['device'] / g:.3f} GiB, host {r['host'] / g:.3f} GiB, loss {r['loss']:.4f}, "
              f"{r['seconds']:.1f} s, {r['threads']} thread(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
