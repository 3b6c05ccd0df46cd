"""Caffe's command-line spelling beside sncaffe's: ``sncaffe train -solver S -gpu 0`` and the like.

``translate(argv, parser)`` rewrites Caffe's gflags (``-solver S``,
``-model=M``, ``--iterations N``, ``-gpu 0|0,1|all``, ``-stage a,b``) into
sncaffe's options before argparse sees them, and answers a flag neither knows
with the subcommand's usage and a "did you mean" hint. ``extend(sub)`` adds
what Caffe has and sncaffe lacked: ``device_query``, ``plot``, ``--stage`` and
``--level`` on train, test and time, ``--metrics`` on train. ``solver_device(p)``
honours a solver's ``solver_mode: GPU`` and ``device_id``.
"""
from __future__ import annotations

import argparse
import difflib
import json
import logging
import math
import os
import re

POSITIONAL = object()
GPU = object()
# Caffe's flags per command (tools/caffe.cpp) -> sncaffe's option (or the positional argument).
FLAGS = {
    "train": {"solver": POSITIONAL, "weights": "--weights", "snapshot": "--snapshot", "gpu": GPU,
              "iterations": "--max-iter", "sigint_effect": "--sigint-effect", "sighup_effect": "--sighup-effect",
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


def _suggest(parser, name, command):
    options = sorted({o for o in parser._option_string_actions if o.startswith("--")} |
                     {"-" + f for f in FLAGS.get(command, {})})
    close = difflib.get_close_matches(name, options, n=1, cutoff=0.6) or \
        difflib.get_close_matches("-" + name.lstrip("-"), options, n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""


def translate(argv: list, parser) -> list:
    """argv with Caffe's flags turned into sncaffe's; an unknown flag exits with the usage and a hint."""
    argv = [str(a) for a in argv]
    commands = next((a.choices for a in parser._actions if isinstance(a, argparse._SubParsersAction)), {})
    if not argv or argv[0] not in commands:
        return argv
    command, sub = argv[0], commands[argv[0]]
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
        action = sub._option_string_actions.get(head)
        if action is not None:          # sncaffe's own option
            out.append(tok)
            if not eq and action.nargs != 0 and i < len(argv):
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
        if target is POSITIONAL:
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


def solver_device(p, path="the solver") -> str | None:
    """``cuda[:device_id]`` for a solver that sets ``solver_mode: GPU``; a clear error where no GPU is."""
    from .proto import sncaffe_pb2 as pb
    if not (p.HasField("solver_mode") and p.solver_mode == pb.SolverParameter.GPU):
        return None
    from .backend.cuda import unusable_reason
    why = unusable_reason()
    if why:
        raise RuntimeError(f"{path} sets solver_mode: GPU (device_id {p.device_id}), but no GPU is usable "
                           f"here: {why}; set solver_mode: CPU or pass --device cpu")
    return "cuda" + (f":{p.device_id}" if p.HasField("device_id") else "")


# -- what Caffe has and sncaffe lacked ------------------------------------------------

def extend(sub) -> None:
    """Add Caffe's commands and flags to the ``sncaffe`` subparsers."""
    for name in ("train", "test", "time"):
        q = sub.choices[name]
        q.add_argument("--stage", action="append", default=[], help="a net stage (NetState.stage); repeat for more")
        q.add_argument("--level", type=int, help="the net level (NetState.level)")
    t = sub.choices["train"]
    t.add_argument("--metrics", metavar="FILE", help="write one JSON line per display and test step")
    t.set_defaults(func=_with_metrics(t.get_default("func")))
    d = sub.add_parser("device_query", help="show a GPU's properties (like caffe device_query)")
    d.add_argument("--gpu", default="0", help="GPU id, ids separated by commas, or all (default: %(default)s)")
    d.set_defaults(func=cmd_device_query)
    p = sub.add_parser("plot", help="draw the loss, accuracy and learning-rate curves of a training log to PNG")
    p.add_argument("log", help="a training log (sncaffe's or Caffe's output)")
    p.add_argument("--out", "-o", help="the PNG (default: LOG.png)")
    p.set_defaults(func=cmd_plot)


def net_state(param, args) -> None:
    """--stage and --level into a NetParameter's state (which phase filtering reads), or into a
    NetState itself (a solver's train_state, as Caffe's train does)."""
    state = param if hasattr(param, "stage") else param.state
    for s in getattr(args, "stage", None) or ():
        if s not in state.stage:
            state.stage.append(s)
    if getattr(args, "level", None) is not None:
        state.level = args.level


class MetricsHandler(logging.Handler):
    """Turns the solver's display and test lines into JSON lines, as parse_log reads them."""

    def __init__(self, path):
        super().__init__(logging.INFO)
        from .tools.parse_log import LogParser
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        self.file = open(path, "w")
        self.parser = LogParser(on_row=self.write)

    def write(self, phase, row):
        row = {k: None if isinstance(v, float) and math.isnan(v) else v for k, v in row.items()}
        self.file.write(json.dumps({"phase": phase, **row}) + "\n")
        self.file.flush()

    def emit(self, record):
        self.parser.feed(record.getMessage(), record.created)

    def close(self):
        self.parser.finish()
        self.file.close()
        super().close()


def _with_metrics(train):
    def cmd(args):
        if not args.metrics:
            return train(args)
        handler = MetricsHandler(args.metrics)
        logger = logging.getLogger("sncaffe")
        logger.addHandler(handler)
        try:
            return train(args)
        finally:
            logger.removeHandler(handler)
            handler.close()
    cmd.__doc__ = train.__doc__
    return cmd


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
