"""Caffe's command-line spelling beside sncaffe's: ``sncaffe train -solver S -gpu 0`` and the like.

``translate(argv, parser)`` rewrites Caffe's gflags (``-solver S``,
``-model=M``, ``--iterations N``, ``-gpu 0|0,1|all``, ``-stage a,b``) into
sncaffe's options before argparse sees them, and answers a flag neither knows
with the subcommand's usage and a "did you mean" hint. Caffe's commands that
sncaffe adds: ``device_query`` and ``plot``.
"""
from __future__ import annotations

import difflib
import re
import sys

POSITIONAL, GPU, IGNORED = object(), object(), object()
# Caffe's flags per command (tools/caffe.cpp) -> sncaffe's option (or the positional argument).
FLAGS = {
    "train": {"solver": POSITIONAL, "weights": "--weights", "snapshot": "--snapshot", "gpu": GPU,
              "iterations": IGNORED, "sigint_effect": "--sigint-effect", "sighup_effect": "--sighup-effect",
              "stage": "--stage", "level": "--level"},
    "test": {"model": POSITIONAL, "weights": "--weights", "iterations": "--iterations", "gpu": GPU,
             "phase": "--phase", "stage": "--stage", "level": "--level"},
    "time": {"model": POSITIONAL, "weights": "--weights", "iterations": "--iterations", "gpu": GPU,
             "phase": "--phase", "stage": "--stage", "level": "--level"},
    "device_query": {"gpu": "--gpu"},
}
NUMBER = re.compile(r"^-\d+(\.\d*)?([eE][-+]?\d+)?$")


def _gpu_count() -> int:
    from .backend.cuda import gpu_count, import_cupy
    try:
        return gpu_count(import_cupy())
    except RuntimeError:
        return 0


def gpu_device(value: str, command: str) -> str:
    """Caffe's -gpu (an id, a list of ids, or all) as a device name: one GPU per process."""
    ids = ([str(i) for i in range(_gpu_count())] or ["0"]) if value == "all" else value.split(",")
    if any(not i.strip().isdigit() for i in ids):
        raise ValueError(f"-gpu {value}: give a GPU id, ids separated by commas, or all")
    if len(ids) > 1:
        from .parallel import mpi
        comm = mpi.world()
        if comm is not None and comm.Get_size() > 1:
            return "cuda"                   # under mpiexec each rank takes its local GPU
        raise ValueError(f"-gpu {value}: sncaffe trains on several GPUs with one process per GPU: "
                         f"mpiexec -n {len(ids)} sncaffe {command} ... -gpu {value}")
    return f"cuda:{ids[0].strip()}"


def _suggest(sub, name, command):
    options = sorted({o for o in sub.options if o.startswith("--")} | {"-" + f for f in FLAGS.get(command, {})})
    close = difflib.get_close_matches(name, options, n=1, cutoff=0.6) or \
        difflib.get_close_matches("-" + name.lstrip("-"), options, n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""


def translate(argv: list, parser) -> list:
    """argv with Caffe's flags turned into sncaffe's; an unknown flag exits with the usage and a hint.
    ``parser.commands``: {command: subparser}, each with ``options``: {option: takes a value}."""
    argv = [str(a) for a in argv]
    if not argv or argv[0] not in parser.commands:
        return argv
    command, sub = argv[0], parser.commands[argv[0]]
    known, out, positional, i = FLAGS.get(command, {}), [command], [], 1
    while i < len(argv):
        tok = argv[i]
        i += 1
        if tok == "--":
            out += argv[i - 1:]
            break
        if not tok.startswith("-") or tok == "-" or NUMBER.match(tok):
            out.append(tok)
            continue
        head, eq, value = tok.partition("=")
        takes_value = sub.options.get(head)
        if takes_value is not None:          # sncaffe's own option
            out.append(tok)
            if not eq and takes_value and i < len(argv):
                out.append(argv[i])
                i += 1
            continue
        name = head.lstrip("-").replace("-", "_")
        target = known.get(name)
        if target is None:
            sub.error(f"unrecognized argument {head}{_suggest(sub, head, command)}")
        if not eq:
            if i >= len(argv):
                sub.error(f"{head} needs a value")
            value = argv[i]
            i += 1
        if target is IGNORED:        # as Caffe: train runs the solver's max_iter
            print(f"sncaffe {command}: warning: {head} is ignored by {command}, as Caffe ignores it; "
                  "give --max-iter N to train N iterations", file=sys.stderr)
        elif target is POSITIONAL:
            positional.append(value)
        elif target is GPU:
            try:
                out += ["--device", gpu_device(value, command)]
            except ValueError as e:
                sub.error(str(e))
        elif target == "--stage":
            for s in value.split(","):
                out += ["--stage", s]
        else:
            out += [target, value]
    return out[:1] + positional + out[1:]


def cmd_device_query(args) -> int:
    """Caffe's device_query: the properties of each GPU named by --gpu."""
    from .backend.cuda import gpu_count, import_cupy
    cp = import_cupy()
    n = gpu_count(cp)
    ids = list(range(n)) if args.gpu == "all" else [int(i) for i in str(args.gpu).split(",")]
    for i in ids:
        if not 0 <= i < n:
            raise ValueError(f"-gpu {i}: this machine has {n} GPU(s) (0..{n - 1})")
        p = cp.cuda.runtime.getDeviceProperties(i)
        name = p["name"].decode() if isinstance(p["name"], bytes) else p["name"]
        print(f"Querying GPUs {i}")
        for label, value in (("Device id", i), ("Major revision number", p["major"]),
                             ("Minor revision number", p["minor"]), ("Name", name),
                             ("Total global memory", p["totalGlobalMem"]),
                             ("Total shared memory per block", p["sharedMemPerBlock"]),
                             ("Total registers per block", p["regsPerBlock"]), ("Warp size", p["warpSize"]),
                             ("Maximum threads per block", p["maxThreadsPerBlock"]),
                             ("Maximum dimension of block", ", ".join(map(str, p["maxThreadsDim"]))),
                             ("Maximum dimension of grid", ", ".join(map(str, p["maxGridSize"]))),
                             ("Clock rate", p["clockRate"]), ("Total constant memory", p["totalConstMem"]),
                             ("Number of multiprocessors", p["multiProcessorCount"]),
                             ("Kernel execution timeout", "Yes" if p["kernelExecTimeoutEnabled"] else "No")):
            print(f"{label + ':':<34}{value}")
    return 0


def cmd_plot(args) -> int:
    """Loss, accuracy and learning rate against iterations, from a training log, to a PNG."""
    from .tools.parse_log import plot
    out = args.out or args.log + ".png"
    plot(args.log, out)
    print(f"sncaffe plot: {out}")
    return 0
