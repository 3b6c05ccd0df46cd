"""The ``sncaffe`` command: train, test and time, as Caffe's ``caffe`` tool, plus plan, draw and
upgrade. A thin shell: each command reads its flags and calls ``sncaffe.run``; the subcommands and
their flags are the tables COMMANDS and FLAGS."""
from __future__ import annotations

import argparse
import math
import sys
from contextlib import nullcontext

from . import __version__, caffe_cli, run
from .export import cli as export_cli
from .parallel import BUCKET_BYTES, TIMEOUT
from .parallel.placement import sharing
from .plan.planner import MODES
from .progress import console
from .sizes import parse_bytes
from .tools.parse_log import metrics_log

SIGNAL_EFFECTS = ("stop", "snapshot", "none")
LOC = "LAYER=LOC,..."


def is_size(text) -> bool:
    try:
        return parse_bytes(text) > 0
    except (ValueError, OverflowError):
        return False


# What argparse cannot say in the words of the flag: (flag, test, what is wrong).
CHECKS = [("device_memory", is_size, "not a size (e.g. 12GiB, 512MiB, 1.5G)"),
          ("base_lr", math.isfinite, "give a finite number"),
          *((f, lambda v: v >= 1, "must be positive") for f in ("iterations", "max_iter", "batch"))]


# Every flag once: its spellings and argparse keywords. A command's row may change a keyword.
FLAGS = {
    "weights": (["--weights"], dict(metavar="CAFFEMODEL", help="weights by layer name from a .caffemodel "
                                                                "(train: fine-tuning)")),
    "snapshot": (["--snapshot"], dict(metavar="SOLVERSTATE", help="resume training from a .solverstate")),
    "max_iter": (["--max-iter"], dict(type=int, metavar="N", help="iterations to train (the solver's "
                                                                       "max_iter)")),
    "base_lr": (["--base-lr"], dict(type=float, metavar="LR", help="the base learning rate (the solver's "
                                                                     "base_lr)")),
    "batch": (["--batch"], dict(type=int, metavar="N", help="batch size of every data and Input layer "
                                                                 "(train: of its train and test nets; test_iter "
                                                                 "is kept)")),
    "snapshot_prefix": (["--snapshot-prefix"], dict(metavar="PREFIX", help="where snapshots go; folders are "
                                                                           "created")),
    "seed": (["--seed"], dict(type=int, help="random seed of synthetic inputs and unset weights (train: "
                                             "random_seed)")),
    "sigint_effect": (["--sigint-effect"], dict(default="stop", choices=SIGNAL_EFFECTS, help=(
        "on Ctrl-C and SIGTERM: stop (snapshot and exit; again to abort), snapshot (and go on), none "
        "(default: %(default)s)"))),
    "sighup_effect": (["--sighup-effect"], dict(default="snapshot", choices=SIGNAL_EFFECTS,
                                                help="on SIGHUP, as Caffe (default: %(default)s)")),
    "place": (["--place"], dict(metavar=LOC, help="model parallelism: run each named layer, and the layers "
                                                  "after it, at a location (cpu:0, cpu:1, cuda:1, ...); Copy "
                                                  "operators join them")),
    "device": (["--device"], dict(default="cpu", help="cpu, cuda or cuda:N (default: %(default)s)")),
    "threads": (["--threads"], dict(type=int, help="CPU threads (default: the free cores, each GEMM on "
                                                        "as many as its size pays for; OMP/OPENBLAS/"
                                                        "MKL_NUM_THREADS also set it)")),
    "device_memory": (["--device-memory"], dict(metavar="SIZE", help=(
        "device capacity, e.g. 12GiB (default: the net's memory_param, else on the CPU the RAM available "
        "less a margin, on a GPU its free memory)"))),
    "host_memory": (["--host-memory"], dict(metavar="SIZE", help=(
        "host pool capacity for offloaded tensors, e.g. 8GiB (default: the RAM available; on the CPU "
        "device and host share it)"))),
    "spill": (["--spill"], dict(metavar="DIR", help="the disk tier: where a spill file takes the offloads the "
                                                    "host cannot hold (default: the temporary directory; the "
                                                    "file is removed at exit)")),
    "memory": (["--memory"], dict(choices=MODES + ("auto",), help=(
        "memory mode (default: the solver's or the net's memory_param, else auto: none when it fits, else "
        "the cheapest mode that fits)"))),
    "host_params": (["--host-params"], dict(action="store_true", help="keep parameters, gradients and solver "
                                                                     "history in host memory, brought in per "
                                                                     "layer")),
    "replicas": (["--replicas"], dict(metavar="LOC,LOC,...", help=(
        "data parallel in one process: the net replicated at these locations (cpu:0,cpu:1), the batch cut "
        "among them, gradients summed; snapshots hold every replica's layers"))),
    "trace": (["--trace"], dict(metavar="JSON", help="write a Chrome trace (chrome://tracing, Perfetto) of one "
                                                     "iteration: compute, d2h, h2d and comm streams (rank 0)")),
    "trace_iter": (["--trace-iter"], dict(type=int, default=1, metavar="N", help="the iteration --trace "
                                                                                 "records (default: %(default)s)")),
    "bucket_mb": (["--bucket-mb"], dict(type=float, default=BUCKET_BYTES / 2**20, metavar="MB", help=(
        "under mpiexec: megabytes of gradients all-reduced together (default: %(default)s)"))),
    "comm_timeout": (["--comm-timeout"], dict(type=float, default=TIMEOUT, metavar="SECONDS", help=(
        "under mpiexec: how long a rank waits for the others before stopping the job (default: "
        "%(default)s; 0: forever)"))),
    "metrics": (["--metrics"], dict(metavar="FILE", help="write one JSON line per display and test step")),
    "stage": (["--stage"], dict(action="append", default=[], help="a net stage (NetState.stage); repeat for "
                                                                  "more")),
    "level": (["--level"], dict(type=int, help="the net level (NetState.level)")),
    "ap_version": (["--ap-version"], dict(default="Integral", choices=run.AP_VERSIONS, help=(
        "how a DetectionEvaluate output's mean average precision is computed, as SSD's solver setting "
        "(default: %(default)s)"))),
    "iterations": (["--iterations", "-n"], dict(type=int, default=50, metavar="N",
                                                help="batches to run (default: %(default)s)")),
    "phase": (["--phase"], dict(default="TEST", choices=["TRAIN", "TEST"], help="the net's phase (default: "
                                                                                "%(default)s)")),
    "solver_type": (["--solver-type"], dict(default="SGD", help="the solver whose history is counted "
                                                                "(default: %(default)s)")),
    "png": (["--png"], dict(help="draw the memory timelines into this PNG file (default: none drawn)")),
    "rankdir": (["--rankdir"], dict(default="LR", choices=["LR", "RL", "TB", "BT"],
                                    help="direction of the graph layout (default: %(default)s)")),
    "gpu": (["--gpu"], dict(default="0", help="GPU id, ids separated by commas, or all (default: %(default)s)")),
    "out": (["--out", "-o"], dict(help="the PNG (default: LOG.png)")),
}
NET = ("net", dict(help="net prototxt"))
DEVICE = ["place", "device", "threads", "device_memory", "host_memory", "spill", "memory"]
STATE = ["stage", "level"]
TRAIN = ("Train from a solver prototxt, or from a net prototxt with these solver settings:\n" + run.DEFAULT_SOLVER +
         'snapshot_prefix: "out/<the net file\'s name>"\nInput layers get synthetic data: N(0,1), and labels in '
         "[0, classes).\nCaffe's flags work too (-solver, -weights, -snapshot, -gpu, ...); -iterations is ignored, as "
         "Caffe's train ignores it: give --max-iter.")


def resources(args) -> run.Resources:
    """The flags that say where a command runs and with how much memory, resolved by run.Resources."""
    return run.Resources(*(getattr(args, k, None) for k in ("device", "device_memory", "host_memory", "spill",
                                                            "memory", "threads")))


def net_param(args):
    return run.net_param(args.net, args.stage, args.level, args.batch, getattr(args, "place", None))


def cmd_train(args) -> int:
    """Train from a solver, or a net with default solver settings, like ``caffe train``."""
    p, from_net = run.solver_param(args.path, max_iter=args.max_iter, base_lr=args.base_lr, seed=args.seed,
                                   snapshot_prefix=args.snapshot_prefix, host_params=args.host_params,
                                   stages=args.stage, level=args.level, batch=args.batch, place=args.place,
                                   replicas=args.replicas)
    with metrics_log(args.metrics) if args.metrics else nullcontext(), args.console as con:
        run.train(p, resources(args), path=args.path, from_net=from_net, weights=args.weights,
                  snapshot=args.snapshot, sigint=args.sigint_effect, sighup=args.sighup_effect,
                  replicas=args.replicas, trace=args.trace, trace_iter=args.trace_iter, bucket_mb=args.bucket_mb,
                  comm_timeout=args.comm_timeout, console=con)
    return 0


def cmd_test(args) -> int:
    """Score a net: average every output over ``iterations`` batches, like ``caffe test``."""
    with args.console as con:
        run.score(net_param(args), resources(args), args.phase, args.weights, args.iterations, args.seed or 0, con,
                  args.ap_version)
    return 0


def cmd_time(args) -> int:
    """Per-layer forward and backward times, like ``caffe time``."""
    run.time_net(net_param(args), resources(args), args.phase, args.iterations, args.weights, args.net)
    return 0


def cmd_plan(args) -> int:
    """The memory of one iteration in every mode, simulated: nothing is allocated or computed."""
    param = net_param(args)
    if args.host_params:
        param.memory_param.host_params = True
    run.plan_report(param, resources(args), args.phase, args.solver_type, args.png, args.net)
    return 0


def cmd_draw(args) -> int:
    """Draw a net as Caffe's draw_net.py does (Graphviz): .dot, or .png/.svg/.pdf through dot."""
    from .draw import draw
    param = run.net_param(args.net, place=args.place)
    out = draw(param, args.out, rankdir=args.rankdir, phase=None if args.phase == "ALL" else args.phase)
    print(f"Drawing net to {out}")
    return 0


def cmd_upgrade(args) -> int:
    """Caffe's upgrade_net_proto_text/binary: a V0/V1 net or caffemodel in the current format."""
    from google.protobuf import text_format

    from .prototxt import upgrade_file, write_upgraded
    param, binary = upgrade_file(args.net)
    if args.out:
        write_upgraded(param, args.out, binary)
        print(f"Wrote upgraded {'NetParameter binary proto' if binary else 'NetParameter text'} to {args.out}")
    elif binary:
        raise ValueError(f"{args.net} is a binary caffemodel: give OUT, the file to write")
    else:
        print(text_format.MessageToString(param), end="")
    return 0


# (name, function, help, positionals, flags: a name of FLAGS or (name, changed keywords)); a new
# subcommand is one more row.
COMMANDS = [
    ("train", cmd_train, "train from a solver or a net prototxt (like caffe train)",
     [("path", dict(metavar="SOLVER_OR_NET", help="solver prototxt, or a net prototxt"))],
     ["weights", "snapshot", "max_iter", "base_lr", "batch", "snapshot_prefix", "seed", "sigint_effect",
      "sighup_effect", *DEVICE, ("device", dict(default=None, help="cpu, cuda or cuda:N (default: the solver's "
                                                "solver_mode and device_id, else cpu)")),
      "host_params", "replicas", "trace", "trace_iter", "bucket_mb", "comm_timeout", *STATE, "metrics"]),
    ("test", cmd_test, "score a net: average its outputs over batches (like caffe test)", [NET],
     ["weights", "iterations", "phase", "batch", "seed", "ap_version", *DEVICE, *STATE]),
    ("time", cmd_time, "time forward and backward per layer (like caffe time)", [NET],
     ["iterations", ("phase", dict(default="TRAIN")), "batch", "weights", *DEVICE, *STATE]),
    ("plan", cmd_plan, "say whether a net fits, and simulate one training iteration's memory in every mode",
     [NET], ["device_memory", "host_memory", "spill", ("device", dict(help=(
         "plan for cpu or cuda (default: %(default)s): a GPU's convolutions take cuDNN's workspaces, measured "
         "where a GPU is here, else estimated"))), "place", "batch", ("phase", dict(default="TRAIN")),
         ("memory", dict(help="the mode of the verdict (default: the net's memory_param, else auto: what train "
                              "would decide here)")), "solver_type", "host_params", "png", *STATE]),
    ("draw", cmd_draw, "draw a net with Graphviz (like Caffe's draw_net.py)",
     [NET, ("out", dict(help="the drawing: .dot (text), or .png, .svg, .pdf (these need Graphviz's dot)"))],
     ["rankdir", ("phase", dict(default="ALL", choices=["TRAIN", "TEST", "ALL"],
                                help="draw the layers of this phase (default: %(default)s, every layer)")),
      ("place", dict(help="model parallelism, as for train: draws the locations and the Copy layers between "
                          "them"))]),
    ("upgrade", cmd_upgrade, "write a V0/V1 net prototxt or .caffemodel in the current format (like Caffe's "
                             "upgrade_net_proto_text/binary)",
     [("net", dict(help="net prototxt or .caffemodel")),
      ("out", dict(nargs="?", help="where to write it (default: print a prototxt's text)"))], []),
    ("device_query", caffe_cli.cmd_device_query, "show a GPU's properties (like caffe device_query)", [], ["gpu"]),
    ("plot", caffe_cli.cmd_plot, "draw the loss, accuracy and learning-rate curves of a training log to PNG",
     [("log", dict(help="a training log (sncaffe's or Caffe's output)"))], ["out"]),
]


def parser() -> argparse.ArgumentParser:
    """The ``sncaffe`` parser, built from COMMANDS. ``p.commands`` maps each name to its
    subparser, whose ``options`` maps each option string to whether it takes a value."""
    p = argparse.ArgumentParser(prog="sncaffe", description="Train and run Caffe networks.")
    p.add_argument("--version", action="version", version=f"sncaffe {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p.commands = {}
    for name, func, help_, positionals, flags in COMMANDS:
        q = p.commands[name] = sub.add_parser(name, help=help_, description=TRAIN if name == "train" else help_,
                                              formatter_class=argparse.RawDescriptionHelpFormatter)
        q.options = {"-h": False, "--help": False}
        for arg, kw in positionals:
            q.add_argument(arg, **kw)
        rows = [(f, {}) if isinstance(f, str) else f for f in flags]
        changed = {f: kw for f, kw in rows if kw}
        for flag in dict.fromkeys(f for f, _ in rows):
            names, kw = FLAGS[flag]
            kw = {**kw, **changed.get(flag, {})}
            q.add_argument(*names, dest=flag, **kw)
            q.options.update((n, kw.get("action") not in ("store_true",)) for n in names)
        q.set_defaults(func=func)
    p.commands["export"] = export_cli.add_parser(sub)      # export: ONNX and PyTorch, checked
    return p


def main(argv=None) -> int:
    p = parser()
    args = p.parse_args(caffe_cli.translate(sys.argv[1:] if argv is None else argv, p))   # Caffe's -flags too
    for flag, ok, wrong in CHECKS:
        value = getattr(args, flag, None)
        if value is not None and not ok(value):
            p.commands[args.command].error(f"--{flag.replace('_', '-')} {value}: {wrong}")
    args.console = console()
    try:
        if hasattr(args, "threads"):      # before anything loads the BLAS (which takes MKL's sequential
            resources(args).configure_threads(*sharing(getattr(args, "replicas", None)))   # layer for one)
        return args.func(args)
    except (ValueError, MemoryError, RuntimeError, OSError) as e:
        where = f"{e.filename}: " if isinstance(e, OSError) and e.filename else ""
        msg = f"{where}{e.strerror}" if isinstance(e, OSError) and e.strerror else str(e) or type(e).__name__
        print(f"sncaffe {args.command}: error: {' '.join(msg.split())}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"sncaffe {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
