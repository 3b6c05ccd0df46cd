"""PyTorch's memory for training, as its users write it, measured in a real run in a process of its own.

    python tools/torch_memory.py --blocks 3,4,6,3 --batch 16 --image-size 224 --variant eager
    python tools/compare.py depth --limit 3GiB     # the deepest [3, 4, k, 3] in a 3 GiB cgroup, run by run

The net is tools/torch_idiomatic's ResNet (torchvision's Bottleneck layout, affine BatchNorm2d,
in-place ReLU), trained by SGD with momentum as a PyTorch loop trains it: ``opt.zero_grad()`` at
its default (gradients set to None, so they exist only from backward to the update), momentum
buffers made by the first update. ``--steps`` (default 2) training steps run, so the second
holds the optimizer's state. Variants, PyTorch's own memory savers:

eager                    the plain step
checkpoint               torch.utils.checkpoint.checkpoint around every block (use_reentrant=False)
checkpoint_sequential    torch.utils.checkpoint.checkpoint_sequential over stem, blocks and head
                         (--segments; by default about sqrt of the modules)
save_on_cpu              torch.autograd.graph.save_on_cpu: every tensor autograd saves goes to
                         host memory and comes back for backward

Each figure comes from steps that really ran (nothing estimated on the meta device):

rss      the process's peak resident set (VmHWM) over every step: what the machine gave the
         whole process, libraries and malloc's fragmentation included (sncaffe is measured the
         same way). glibc's malloc settings (MALLOC_*_ in the environment) change it; the
         result names those in force.
device   the bytes malloc holds in use (glibc's mallinfo2: in arenas plus mmapped chunks), read
         after every aten op of the last step, at their highest, less what malloc held before
         the net was built (the libraries' own heap): torch's CPU allocator takes every tensor
         from malloc, so these are the tensors a GPU would have to hold, without fragmentation.
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
VARIANTS = ("eager", "checkpoint", "checkpoint_sequential", "save_on_cpu")


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
    """checkpoint_sequential's segment count by Chen et al.'s rule: about sqrt(n) boundaries live."""
    return max(1, round(math.sqrt(n)))


MALLOC_VARS = ("MALLOC_ARENA_MAX", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")


def malloc_setting(env=None) -> str:
    """glibc malloc's tunables in ``env`` (default: this process's), in words."""
    env = os.environ if env is None else env
    given = [f"{v}={env[v]}" for v in MALLOC_VARS if v in env]
    return " ".join(given) or "glibc default"


def forward_of(model, variant, segments=None):
    """``x -> logits`` for ``variant``, written as a PyTorch user writes that saver."""
    from torch.utils.checkpoint import checkpoint, checkpoint_sequential
    sys.path.insert(0, str(TOOLS))
    import torch_idiomatic
    seq = torch_idiomatic.sequential(model)
    if variant.startswith("checkpoint_sequential"):
        n = segments or best_segments(len(seq))
        return lambda x: checkpoint_sequential(seq, n, x, use_reentrant=False)
    if variant.startswith("checkpoint"):
        stem, *blocks, head = seq

        def forward(x):
            x = stem(x)
            for block in blocks:
                x = checkpoint(block, x, use_reentrant=False)
            return head(x)
        return forward
    return model


def measure(blocks, batch, image_size, variant, segments=None, seed=0, steps=2) -> dict:
    """``steps`` real training steps of ``variant`` in this process: rss, device and host peaks (bytes)."""
    import contextlib

    import numpy as np
    import torch
    import torch.nn.functional as F
    sys.path.insert(0, str(TOOLS))
    import torch_idiomatic

    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r} ({', '.join(VARIANTS)})")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    import gc
    gc.collect()                      # what an earlier caller dropped must not be freed inside the step
    watch = MallocPeak()
    base = watch.in_use()             # the libraries' own heap, before the net exists
    torch.manual_seed(seed)
    model = torch_idiomatic.resnet(tuple(blocks))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=5e-4)
    x = torch.randn(batch, 3, image_size, image_size)
    y = torch.randint(0, 1000, (batch,))
    n_modules = len(torch_idiomatic.sequential(model))
    segments = segments or best_segments(n_modules)
    forward = forward_of(model, variant, segments)
    host = HostSaved(np, torch)

    def step():
        opt.zero_grad()                                   # PyTorch's default: set_to_none=True
        saver = (torch.autograd.graph.saved_tensors_hooks(host.pack, host.unpack) if variant == "save_on_cpu"
                 else contextlib.nullcontext())
        with saver:
            loss = F.cross_entropy(forward(x), y)
            loss.backward()
        opt.step()
        return float(loss.detach())

    before = rss_now()
    t0 = time.perf_counter()
    losses = [step() for _ in range(steps - 1)]
    with watch:                                           # the last step, with the optimizer's state
        losses.append(step())
    seconds = time.perf_counter() - t0
    return {"variant": variant, "blocks": list(blocks), "batch": batch, "image_size": image_size,
            "segments": segments if variant == "checkpoint_sequential" else None, "modules": n_modules,
            "loss": losses[-1], "losses": losses, "steps": steps, "rss": rss_now("VmHWM"),
            "rss_before_step": before, "device": watch.peak - base, "host": host.peak, "seconds": seconds,
            "threads": torch.get_num_threads(), "malloc": malloc_setting()}


def child_command(blocks, batch, image_size, variant, segments=None, steps=2) -> list:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--blocks", ",".join(map(str, blocks)),
           "--batch", str(batch), "--image-size", str(image_size), "--variant", variant,
           "--steps", str(steps), "--json"]
    return cmd + (["--segments", str(segments)] if segments else [])


def measure_in_child(blocks, batch, image_size, variant, segments=None, timeout=7200) -> dict:
    """``measure`` in a fresh process (one thread), so the peak RSS is these steps' alone."""
    env = {**os.environ, **{v: "1" for v in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")}}
    r = subprocess.run(child_command(blocks, batch, image_size, variant, segments), capture_output=True,
                       text=True, timeout=timeout, env=env)
    if r.returncode:
        # a step that does not fit the machine dies (MemoryError or the OOM killer): it does not fit
        return {"variant": variant, "blocks": list(blocks), "failed": (r.stderr or r.stdout)[-400:],
                "rss": math.inf, "device": math.inf, "host": math.inf}
    return json.loads(r.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", default="3,4,6,3", help="bottleneck blocks per stage (default: ResNet-50)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--variant", choices=VARIANTS, default="eager")
    ap.add_argument("--segments", type=int, help="checkpoint_sequential's segments (default: sqrt of the modules)")
    ap.add_argument("--steps", type=int, default=2, help="training steps (default: 2, the last with momentum)")
    ap.add_argument("--json", action="store_true", help="print the result as one JSON line")
    args = ap.parse_args(argv)
    r = measure(tuple(int(b) for b in args.blocks.split(",")), args.batch, args.image_size, args.variant,
                args.segments, steps=args.steps)
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
