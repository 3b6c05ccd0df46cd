"""Kill `sncaffe train` at random points and check that nothing is lost.

A small net trains with the disk tier on (offloads past a 1 MiB host pool go to a spill file),
snapshotting every other iteration, under a snapshot prefix that also holds files of the user's.
Each run is sent SIGKILL, SIGTERM or SIGINT at a random moment of a random phase: planning,
binding, the first forward, training (forward, backward, spill), a snapshot write. Then:
  - every file of the user's is there, byte for byte;
  - the newest snapshot pair loads into a fresh solver (and the next run resumes from it);
  - SIGTERM and SIGINT end the process within a minute (else it counts as stuck);
  - nothing on stderr from glibc's allocator checks or a fatal signal.
Each run resumes from the newest pair, so resumes are killed too.

    python tools/fault_inject.py -n 60                       # prints counts per signal and phase
    python tools/fault_inject.py -n 30 --malloc-check        # MALLOC_CHECK_=3, PYTHONMALLOC=debug
"""
from __future__ import annotations

import argparse
import collections
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

NET = """name: "small"
layer { name: "input" type: "Input" top: "data" top: "label"
        input_param { shape { dim: 8 dim: 3 dim: 32 dim: 32 } shape { dim: 8 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
        convolution_param { num_output: 32 kernel_size: 3 pad: 1 weight_filler { type: "xavier" } } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }
layer { name: "conv2" type: "Convolution" bottom: "conv1" top: "conv2"
        convolution_param { num_output: 32 kernel_size: 3 pad: 1 weight_filler { type: "xavier" } } }
layer { name: "relu2" type: "ReLU" bottom: "conv2" top: "conv2" }
layer { name: "pool" type: "Pooling" bottom: "conv2" top: "pool" pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "ip1" type: "InnerProduct" bottom: "pool" top: "ip1"
        inner_product_param { num_output: 256 weight_filler { type: "xavier" } } }
layer { name: "ip2" type: "InnerProduct" bottom: "ip1" top: "ip2"
        inner_product_param { num_output: 10 weight_filler { type: "xavier" } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip2" bottom: "label" top: "loss" }
"""
SOLVER = """net: "net.prototxt"
base_lr: 0.01 momentum: 0.9 lr_policy: "fixed" max_iter: 1000000 display: 1 random_seed: 1
snapshot: 2 snapshot_prefix: "snap/t"
"""
FLAGS = ["--memory", "offload", "--device-memory", "64MiB", "--host-memory", "1MiB", "--spill", "spill"]
# A phase is entered when the log shows its line; the signal comes a random moment after.
PHASES = {"planning": "Creating training net", "binding": "memory plan of", "first forward": "Solving",
          "training": "] Iteration ", "snapshot": "Snapshotting to binary proto file"}
SIGNALS = {"SIGKILL": signal.SIGKILL, "SIGTERM": signal.SIGTERM, "SIGINT": signal.SIGINT}
HEAP_WORDS = ("corrupted", "double free", "free(): ", "malloc(): ", "munmap_chunk", "Fatal Python error",
              "Segmentation fault", "Bus error", "Debug memory block")
USER_FILES = {"snap/t_iter_999.caffemodel": b"the user's own weights", "snap/t_iter_1.caffemodel": b"old weights",
              "snap/notes.txt": b"notes", "spill/keep.bin": b"a file in the spill folder"}


def setup(folder: Path) -> None:
    (folder / "net.prototxt").write_text(NET)
    (folder / "solver.prototxt").write_text(SOLVER)
    for name, data in USER_FILES.items():
        (folder / name).parent.mkdir(exist_ok=True)
        (folder / name).write_bytes(data)


def newest_pair(folder: Path):
    sys.path.insert(0, str(ROOT))
    from sncaffe.solvers.snapshot_files import latest
    return latest(str(folder / "snap" / "t"))


def check_pair(folder: Path) -> str:
    """'' if the newest pair loads into a fresh solver (or there is none yet), else why not."""
    pair = newest_pair(folder)
    if pair is None:
        return ""
    from google.protobuf import text_format

    from sncaffe.backend.cpu import CPUDevice
    from sncaffe.proto import sncaffe_pb2 as pb
    from sncaffe.solvers import Solver
    p = text_format.Parse(SOLVER.replace('net: "net.prototxt"', ""), pb.SolverParameter())
    text_format.Parse(NET, p.net_param)
    p.snapshot_prefix = str(folder / "snap" / "t")
    try:
        s = Solver(p, device=CPUDevice(256 << 20))
        s.restore(pair[1])
    except Exception as e:  # noqa: BLE001 - any failure to load is the finding
        return f"{pair[1]} does not load: {type(e).__name__}: {e}"
    return ""


def run_once(folder: Path, sig: str, phase: str, rng: random.Random, env: dict) -> dict:
    """One training run killed by ``sig`` in ``phase``; what happened."""
    pair = newest_pair(folder)
    argv = [sys.executable, "-X", "faulthandler", "-m", "sncaffe.cli", "train", "solver.prototxt", *FLAGS]
    if pair:
        argv += ["--snapshot", pair[1]]
    job = subprocess.Popen(argv, cwd=folder, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines, entered = [], threading.Event()

    def read():
        for line in job.stdout:
            lines.append(line)
            if PHASES[phase] in line:
                entered.set()
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    entered.wait(120)
    time.sleep(rng.random() * (0.3 if phase in ("planning", "binding") else 0.05))
    sent = job.poll() is None
    if sent:
        job.send_signal(SIGNALS[sig])
    try:
        job.wait(60)
        stuck = False
    except subprocess.TimeoutExpired:
        job.kill()
        job.wait()
        stuck = True
    reader.join(10)
    out = "".join(lines)
    return {"sent": sent, "entered": entered.is_set(), "rc": job.returncode, "stuck": stuck,
            "heap": [w for w in HEAP_WORDS if w in out], "traceback": "Traceback" in out, "out": out}


def lost(folder: Path) -> list:
    """The user's files that are neither in place nor moved aside whole (a snapshot took the name)."""
    def kept(name, data):
        path = folder / name
        aside = path.parent.glob(path.name.replace(".caffemodel", ".kept*.caffemodel"))
        return any(p.is_file() and p.read_bytes() == data for p in [path, *aside])
    return [name for name, data in USER_FILES.items() if not kept(name, data)]


def campaign(n: int, seed: int, malloc_check: bool, folder: Path | None = None, show=3):
    """``n`` killed runs in one folder; returns (counts, problems)."""
    rng = random.Random(seed)
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    if malloc_check:
        env.update(MALLOC_CHECK_="3", PYTHONMALLOC="debug")
    own = folder is None
    folder = Path(tempfile.mkdtemp(prefix="faults-")) if own else folder
    setup(folder)
    counts, problems = collections.Counter(), []
    for i in range(n):
        sig, phase = rng.choice(sorted(SIGNALS)), rng.choice(sorted(PHASES))
        r = run_once(folder, sig, phase, rng, env)
        counts[(sig, phase)] += 1
        what = []
        if lost(folder):
            what.append(f"user files lost or changed: {lost(folder)}")
        why = check_pair(folder)
        if why:
            what.append(why)
        if r["stuck"]:
            what.append("did not end within 60 s of the signal")
        if r["heap"]:
            what.append(f"printed {r['heap']}")
        if what:
            problems.append(f"run {i} ({sig} in {phase}, rc {r['rc']}): {'; '.join(what)}\n"
                            + "".join(r["out"].splitlines(True)[-show:]))
        counts["traceback"] += r["traceback"]
    return counts, problems, folder


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", type=int, default=60, help="killed runs (default 60)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--malloc-check", action="store_true", help="run under MALLOC_CHECK_=3 and PYTHONMALLOC=debug")
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    counts, problems, folder = campaign(args.n, args.seed, args.malloc_check)
    print(f"{'signal':<8} " + " ".join(f"{p:>13}" for p in sorted(PHASES)))
    for sig in sorted(SIGNALS):
        print(f"{sig:<8} " + " ".join(f"{counts[(sig, p)]:>13}" for p in sorted(PHASES)))
    print(f"{args.n} runs in {time.monotonic() - t0:.0f} s, {len(problems)} with a problem, "
          f"{counts['traceback']} printed a Python traceback; folder {folder}")
    for p in problems:
        print("\n" + p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
