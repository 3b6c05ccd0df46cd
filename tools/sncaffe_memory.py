"""What an sncaffe training process holds besides its pools, measured in a process of its own.

    python tools/sncaffe_memory.py --blocks 3,4,1,3 --batch 16 --image-size 224 --mode all
    python tools/sncaffe_memory.py --blocks 3,4,100,3 --batch 16 --image-size 224 --plan-only

The counterpart of tools/torch_memory.py for the *machine* budget of tools/compare.py, where the
device pool, the host pool and everything else share one RAM. sncaffe's pools are planned to the
byte, but a process also holds its libraries (NumPy, MKL), the graph's and the plan's Python
objects, and what the kernels allocate outside the pools for a moment (BLAS buffers, NumPy's
temporaries). Both are measured here by the process's peak resident set (VmHWM), as PyTorch's is:

step        one real SGD step of the ResNet in ``--mode`` (pools as planned, no capacity limit):
            ``rest`` = VmHWM - the device pool's peak - the host pool's peak
--plan-only the graph built and planned, no pool touched: VmHWM, which grows with depth

``overhead`` combines them without running deep nets: the rest of a real step at a shallow depth
(whose layers have the same shapes: the blocks' widths do not change with k) plus the growth of
the planned graph from that depth to the one asked.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

TOOLS = Path(__file__).resolve().parent
ONE_THREAD = {v: "1" for v in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")}


def hwm() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def measure(blocks, batch, image_size, mode, plan_only=False) -> dict:
    """In this process (which must be fresh for the figure to mean anything)."""
    sys.path.insert(0, str(TOOLS))
    import gen_resnet


    from sncaffe.backend import runtimes
    from sncaffe.backend.cpu import CPUDevice
    from sncaffe.graph import build_graph
    from sncaffe.plan.planner import make_plan
    from sncaffe.proto import sncaffe_pb2 as pb
    from sncaffe.prototxt import parse_text, prepare_net
    from sncaffe.solvers.solver import Solver, history_bytes
    runtimes.configure(1)
    param = parse_text(gen_resnet.generate(tuple(blocks), batch=batch, image_size=image_size), pb.NetParameter())
    host = mode == "all+host"
    mode = "all" if host else mode
    out = {"blocks": list(blocks), "batch": batch, "image_size": image_size, "mode": mode + "+host" * host}
    if plan_only:
        graph = build_graph(prepare_net(param, pb.TRAIN), pb.TRAIN)
        make_plan(graph, mode, None, history_bytes(graph, 1), host_params=host)
        return {**out, "rss": hwm()}
    from sncaffe.data.synthetic import SyntheticInputs
    sp = pb.SolverParameter(base_lr=1e-3, momentum=0.9, weight_decay=5e-4, lr_policy="fixed", type="SGD",
                            max_iter=1 << 30, display=0, random_seed=0, snapshot_after_train=False)
    sp.net_param.CopyFrom(param)
    sp.memory_param.mode, sp.memory_param.host_params = mode, host
    from sncaffe.runtime.budget import ram_budget
    room = ram_budget()                             # untouched pages of the arenas cost nothing
    solver = Solver(sp, device=CPUDevice(room, host_capacity=room))
    SyntheticInputs(0)(solver.net)
    solver.step(1)
    dev = solver.device
    pools = dev.pool.peak + dev.host_pool.peak
    rss = hwm()
    plan = solver.net.plan
    return {**out, "rss": rss, "device": dev.pool.peak, "host": dev.host_pool.peak, "rest": rss - pools,
            "planned_device": plan.peak, "planned_host": plan.host_peak}


def measure_in_child(blocks, batch, image_size, mode="none", plan_only=False, timeout=3600) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--blocks", ",".join(map(str, blocks)),
           "--batch", str(batch), "--image-size", str(image_size), "--mode", mode, "--json"]
    r = subprocess.run(cmd + ["--plan-only"] * plan_only, capture_output=True, text=True, timeout=timeout,
                       env={**os.environ, **ONE_THREAD})
    if r.returncode:
        raise RuntimeError(f"sncaffe_memory {' '.join(cmd[2:])} failed: {(r.stderr or r.stdout)[-400:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


class Overhead:
    """``overhead(k, mode)``: the bytes a process training ResNet [3, 4, k, 3] in ``mode`` holds
    besides its pools, from one real shallow step per mode and one planning run per depth."""

    def __init__(self, batch, image_size, k0=1):
        self.batch, self.image_size, self.k0 = batch, image_size, k0
        self._rest, self._plan = {}, {}

    def plan_rss(self, k) -> int:
        if k not in self._plan:
            self._plan[k] = measure_in_child((3, 4, k, 3), self.batch, self.image_size, plan_only=True)["rss"]
        return self._plan[k]

    def rest(self, mode) -> int:
        if mode not in self._rest:
            self._rest[mode] = measure_in_child((3, 4, self.k0, 3), self.batch, self.image_size, mode)["rest"]
        return self._rest[mode]

    def __call__(self, k, mode) -> int:
        mode = mode.split("+disk")[0]       # a disk tier's step holds what the mode's does besides
        mode = "all+host" if mode == "auto" else mode       # auto's deepest plans: all, state on the host
        return self.rest(mode) + max(0, self.plan_rss(k) - self.plan_rss(self.k0))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", default="3,4,1,3")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--mode", default="none", help="none, liveness, offload, recompute, all or all+host")
    ap.add_argument("--plan-only", action="store_true", help="build and plan the graph, run nothing")
    ap.add_argument("--json", action="store_true", help="one JSON line")
    a = ap.parse_args(argv)
    r = measure(tuple(int(b) for b in a.blocks.split(",")), a.batch, a.image_size, a.mode, a.plan_only)
    if a.json:
        print(json.dumps(r))
    else:
        for key, v in r.items():
            print(f"{key:14s} {v / 2**20:.1f} MiB" if key in ("rss", "device", "host", "rest", "planned_device",
                                                               "planned_host") else f"{key:14s} {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
