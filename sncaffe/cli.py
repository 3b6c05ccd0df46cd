"""The ``sncaffe`` command: train, test and time, as Caffe's ``caffe`` tool."""
from __future__ import annotations

import argparse
import logging
import math
import os
import re
import signal
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from .mem.pool import fmt_bytes
from .progress import rate as rate_text

log = logging.getLogger("sncaffe")

# What `sncaffe train NET.prototxt` trains with (a net, not a solver); flags override any of it.
DEFAULT_SOLVER = """
type: "SGD"
base_lr: 0.01
momentum: 0.9
weight_decay: 0.0005
lr_policy: "fixed"
max_iter: 100
display: 10
snapshot_after_train: true
"""
SIGNAL_EFFECTS = ("stop", "snapshot", "none")


def _g(x) -> str:
    return f"{float(x):.6g}"


# -- inputs ---------------------------------------------------------------------

def _label_classes(net) -> dict:
    """Input blobs that are labels of a loss or Accuracy layer, and their number of classes.

    A label is a bottom after the first that the layer never differentiates;
    its classes are the extent of the layer's first bottom (the scores) along
    the class axis, i.e. the num_output of the layer feeding the loss.
    """
    out = {}
    for node in net.graph.layers:
        for i, bottom in enumerate(node.bottoms[1:], 1):
            if node.layer.allow_force_backward(i):
                continue
            while bottom.producer.type in ("Split", "Copy", "Slice"):     # through placement and replicas
                bottom = bottom.producer.bottoms[0]
            if bottom.producer.type != "Input":
                continue
            lp, shape = node.layer.param, node.bottoms[0].shape
            axis = lp.accuracy_param.axis if node.type == "Accuracy" else lp.softmax_param.axis
            n = 2 if node.type == "SigmoidCrossEntropyLoss" else (
                int(shape[axis]) if -len(shape) <= axis < len(shape) else 0)
            out[bottom.name] = max(out.get(bottom.name, 0), n)
    return out


class SyntheticInputs:
    """Fills a net's Input blobs: data N(0,1), labels integers in [0, classes) (0 when unknown).

    A batch depends only on (seed, phase, index, pass within the index), so a
    resumed run sees the same batches as an uninterrupted one. With ``shard =
    (rank, ranks)`` (data parallel) a train net gets rows [rank*B, (rank+1)*B)
    of the global batch of ranks*B that one process would get.
    """

    def __init__(self, seed=0):
        self.seed = seed
        self.shard = (0, 1)
        self._labels = {}
        self._last, self._pass = None, 0

    def __call__(self, net, index=0):
        from .layers.base import array_module
        from .proto import sncaffe_pb2 as pb
        labels = self._labels.get(id(net))
        if labels is None:
            labels = self._labels[id(net)] = _label_classes(net)
        key = (id(net), index)
        self._pass = self._pass + 1 if key == self._last else 0    # iter_size passes of one iteration
        self._last = key
        rng = np.random.default_rng([self.seed % 2**63, int(net.phase), index, self._pass])
        rank, ranks = self.shard if net.phase == pb.TRAIN else (0, 1)   # rank 0 tests alone
        for name in net.inputs:
            data = net.blobs[name].data
            b = data.shape[0] if data.ndim else 1
            shape = (b * ranks, *data.shape[1:]) if data.ndim else data.shape
            if name in labels:
                x = rng.integers(max(labels[name], 1), size=shape)
            else:
                x = rng.standard_normal(shape)
            data[...] = array_module(data).asarray(x[rank * b:(rank + 1) * b] if data.ndim else x,
                                                   dtype=data.dtype)

    @staticmethod
    def describe(net) -> str:
        labels = _label_classes(net)
        parts = [f"{n}: integers in [0, {labels[n]})" if labels.get(n) else
                 f"{n}: 0" if n in labels else f"{n}: N(0,1)" for n in net.inputs]
        return ", ".join(parts)


def _close_data_layers(nets):
    """Stop the prefetch threads of Data/ImageData/HDF5Data layers."""
    for net in nets:
        for layer in net.layers:
            if hasattr(layer, "close"):
                layer.close()


# -- common ---------------------------------------------------------------------

def _net_param(args):
    from .proto import sncaffe_pb2 as pb
    from .prototxt import read_text, set_batch
    param = read_text(args.net, pb.NetParameter())
    from .caffe_cli import net_state
    net_state(param, args)                  # --stage, --level (Caffe's -stage, -level)
    if args.batch:
        param = set_batch(param, args.batch)
    if not (param.layer or param.layers or param.input):
        from .prototxt import PrototxtError
        raise PrototxtError(f"{args.net}: the net has no layers")
    return _placed(param, getattr(args, "place", None))


def _device(args, param=None):
    """The device of --device, sized by --device-memory, else by the net's memory_param."""
    from .backend import make_device
    given = param.memory_param.device_memory if param is not None else None
    return _spilling(make_device(args.device, args.device_memory or given or None, args.host_memory), args)


def _spilling(device, args):
    """--spill DIR: where the disk tier's spill file goes (else the system's temporary directory)."""
    if getattr(args, "spill", None):
        device.spill_dir = args.spill
    return device


def _peak(device, net=None) -> str:
    """The pool's peak; with several locations (replicas, --place), each one's."""
    devices = getattr(net, "devices", None) or {}
    if not any(d is not device for d in devices.values()):
        return fmt_bytes(device.pool.peak)
    total = sum(d.pool.peak for d in devices.values())
    return fmt_bytes(total) + " (" + ", ".join(f"{loc or 'main'} {fmt_bytes(d.pool.peak)}"
                                              for loc, d in devices.items()) + ")"


# -- train ----------------------------------------------------------------------

def _read_solver_or_net(path):
    """(SolverParameter, None) for a solver file, (None, NetParameter) for a net file."""
    from .proto import sncaffe_pb2 as pb
    from .prototxt import PrototxtError, decode, parse_text
    try:
        text = decode(Path(path).read_bytes(), path)
    except OSError as e:
        raise PrototxtError(f"{path}: cannot read: {e.strerror}") from None
    try:
        solver = parse_text(text, pb.SolverParameter(), str(path))
    except PrototxtError as solver_error:
        try:
            net = parse_text(text, pb.NetParameter(), str(path))
        except PrototxtError as net_error:
            # Report the error against what the file looks like.
            # [ \t]*, not \s*: \s* spans newlines, so a run of blank lines is scanned quadratically.
            raise (net_error if re.search(r"^[ \t]*(layers?[ \t]*:?\s*\{|input[ \t]*:)", text, re.M)
                   else solver_error) from None
    else:
        if solver.ListFields():
            return solver, None
        net = pb.NetParameter()     # an empty file (or comments only): neither, not a solver lacking lr_policy
    if not (net.layer or net.layers or net.input):
        raise PrototxtError(f"{path}: neither a solver nor a net with layers")
    return None, net


def _placement(spec, param) -> dict:
    """``--place conv3=cpu:1,fc6=cpu:2``: each named layer and every layer after it (in file
    order, up to the next named one) runs at that location."""
    from .prototxt import PrototxtError
    marks = {}
    for item in filter(None, (x.strip() for x in spec.split(","))):
        layer, sep, loc = item.partition("=")
        if not sep or not loc:
            raise ValueError(f"--place: expected LAYER=LOCATION, got {item!r}")
        marks[layer] = loc
    names = [layer.name for layer in param.layer]
    unknown = sorted(set(marks) - set(names))
    if unknown:
        raise PrototxtError(f'--place names unknown layer "{unknown[0]}"')
    out, current = {}, None
    for name in names:
        current = marks.get(name, current)
        if current is not None:
            out[name] = current
    return out


def _placed(param, spec):
    from .prototxt import place
    from .upgrade import upgrade_net
    param = upgrade_net(param)          # a V0/V1 net: --place and draw see its layers
    return place(param, _placement(spec, param)) if spec else param


def _materialize_nets(p, batch, spec=None):
    """Read the solver's net files into its *_param fields, with every batch size set to ``batch``
    and the ``--place`` placement applied."""
    from .proto import sncaffe_pb2 as pb
    from .prototxt import read_text, set_batch
    for field in ("net", "train_net"):
        if p.HasField(field):
            getattr(p, field + "_param").CopyFrom(read_text(getattr(p, field), pb.NetParameter()))
            p.ClearField(field)
    for f in p.test_net:
        p.test_net_param.add().CopyFrom(read_text(f, pb.NetParameter()))
    del p.test_net[:]
    for field in ("net_param", "train_net_param"):
        if p.HasField(field):
            getattr(p, field).CopyFrom(_placed(set_batch(getattr(p, field), batch) if batch else getattr(p, field), spec))
    for q in p.test_net_param:
        q.CopyFrom(_placed(set_batch(q, batch) if batch else q, spec))


def _replicate_nets(p, args):
    """``--replicas cpu:0,cpu:1``: the solver's nets replicated over those locations (data parallel
    in one process; see sncaffe.parallel.replicas)."""
    from .parallel.replicas import replicate
    if args.place:
        raise ValueError("--replicas places the layers itself: give --place or --replicas, not both")
    locations = _replica_locations(args)
    if not (args.batch or args.place):
        _materialize_nets(p, None)
    for field in ("net_param", "train_net_param"):
        if p.HasField(field):
            getattr(p, field).CopyFrom(replicate(getattr(p, field), locations))
    for q in p.test_net_param:
        q.CopyFrom(replicate(q, locations))


def _replica_locations(args) -> list:
    """``--replicas cpu:0,cpu:1`` as a list of locations (empty without the flag)."""
    return [x.strip() for x in (getattr(args, "replicas", None) or "").split(",") if x.strip()]


def _sharing(args) -> tuple:
    """(share, by): how many ranks of this machine's job (from the launcher's environment:
    MPICH's, Open MPI's) or replicas of this process compute at once on its cores."""
    if getattr(args, "replicas", None):
        return len(_replica_locations(args)), "replicas"
    for var in ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE"):
        if os.environ.get(var, "").isdigit():
            return max(1, int(os.environ[var])), "ranks"
    return 1, "ranks"


def _solver_param(args):
    """The SolverParameter to train with: the file's (or the defaults for a net), then the flags."""
    from google.protobuf import text_format

    from .proto import sncaffe_pb2 as pb
    from .solvers.solver import _upgrade_snapshot_prefix
    p, net = _read_solver_or_net(args.path)
    if net is not None:
        p = text_format.Parse(DEFAULT_SOLVER, pb.SolverParameter())
        p.net_param.CopyFrom(net)
        p.snapshot_prefix = os.path.join("out", Path(args.path).stem)
    if args.max_iter is not None:
        p.max_iter = args.max_iter
    if args.base_lr is not None:
        p.base_lr = args.base_lr
    if args.seed is not None:
        p.random_seed = args.seed
    if args.snapshot_prefix:
        p.snapshot_prefix = args.snapshot_prefix
    if args.memory:
        p.memory_param.mode = args.memory
    if args.host_params:
        p.memory_param.host_params = True
    from .caffe_cli import net_state
    net_state(p.train_state, args)          # Caffe's train -stage, -level
    if args.batch:
        _materialize_nets(p, args.batch, args.place)
    elif args.place:
        _materialize_nets(p, None, args.place)
    if getattr(args, "replicas", None):
        _replicate_nets(p, args)
    if p.HasField("snapshot_prefix") and (p.snapshot or p.snapshot_after_train):
        if p.snapshot_prefix.endswith(("/", os.sep)):      # a directory: files named after the solver
            os.makedirs(p.snapshot_prefix, exist_ok=True)
        _upgrade_snapshot_prefix(p, args.path)
        os.makedirs(os.path.dirname(p.snapshot_prefix) or ".", exist_ok=True)
    return p, net is not None


@contextmanager
def _signal_effects(solver, sigint, sighup):
    """Caffe's -sigint_effect / -sighup_effect: stop (snapshot and exit), snapshot (and go on), none."""
    from threading import current_thread, main_thread
    if current_thread() is not main_thread():
        yield
        return
    from threading import Thread
    actions = {"stop": solver.request_stop, "snapshot": solver.request_snapshot, "none": None}
    stopping = []

    def say(msg, name):
        # Not from the handler itself: it runs between two bytecodes of the main thread, which may be
        # inside a write to the log's stream (a nested write there raises "reentrant call" and the
        # line is lost, with a logging error on stderr). A thread of its own waits for the handler's lock.
        Thread(target=log.info, args=(msg, name), name="sncaffe-signal-log").start()

    def handler(signum, frame):
        effect = sighup if signum == getattr(signal, "SIGHUP", None) else sigint   # SIGTERM: as SIGINT
        name = signal.Signals(signum).name
        if effect == "stop" and stopping:
            raise KeyboardInterrupt         # a second stop aborts; snapshots are written atomically
        if actions[effect] is None:
            say("%s ignored (its effect is none)", name)
            return
        actions[effect]()
        if effect == "stop":
            stopping.append(signum)
            say("%s: snapshotting and stopping after this iteration (again to abort)", name)
        else:
            say("%s: snapshotting after this iteration", name)

    # SIGTERM (a scheduler's kill) does what Ctrl-C does, so its job keeps a snapshot.
    wanted = [signal.SIGINT, signal.SIGTERM] + ([signal.SIGHUP] if hasattr(signal, "SIGHUP") else [])
    saved = {s: signal.signal(s, handler) for s in wanted}
    try:
        yield
    finally:
        for s, h in saved.items():
            signal.signal(s, h)


class _StepProgress:
    """Progress within one iteration, for nets whose iterations are long (thousands of layers):
    a second bar on a terminal, else a log line at each quarter of the iteration and at least
    every ``EVERY`` seconds (a quarter of ResNet-2500's iteration takes minutes)."""
    EVERY = 10.0

    def __init__(self, con, net, solver):
        self.steps = sum(1 for ins in net.plan.schedule if ins.kind == "run")
        self.con, self.solver, self.bar, self.done, self.quarter = con, solver, None, 0, 0
        self.said = time.perf_counter()

    def __call__(self, op, recompute):
        if self.bar is None:
            self.bar = self.con.progress(self.steps, desc=f"iteration {self.solver.iter}", unit="op")
            self.done = self.quarter = 0
        self.done += 1
        self.bar.update(1, op.name)
        now = time.perf_counter()
        if not self.con.bar and (self.done * 4 // self.steps > self.quarter or now - self.said >= self.EVERY):
            self.quarter, self.said = self.done * 4 // self.steps, now
            log.info("Iteration %d: %d%% of the pass (%s)", self.solver.iter, 100 * self.done // self.steps,
                     op.name + (" (recompute)" if recompute else ""))
        if self.done >= self.steps:
            self.bar.close()
            self.bar = None


class _TrainProgress:
    """Solver callback: the bar's iteration count, loss, lr, images/s and the pool's peak."""

    def __init__(self, con, solver):
        self.solver = solver
        self.images = solver.net.batch_size * solver.param.iter_size
        self.con, self.bar, self.start = con, None, None
        self.t, self.rate = time.perf_counter(), None

    def __call__(self, iteration, loss, lr):
        if self.bar is None:                # made here: a resumed run starts at the restored iteration
            self.start = iteration - 1
            self.bar = self.con.progress(self.solver.param.max_iter, self.start, desc="train")
        now = time.perf_counter()
        rate = self.images / max(now - self.t, 1e-9)
        self.t = now
        self.rate = rate if self.rate is None else 0.9 * self.rate + 0.1 * rate
        self.bar.update(1, f"loss={_g(loss)}, lr={_g(lr)}, {rate_text(self.rate, 1, 'img/s')}, "
                           f"peak {_peak(self.solver.device, self.solver.net)}")


def cmd_train(args) -> int:
    """Train from a solver, or a net with default solver settings, like ``caffe train``;
    under ``mpiexec -n N``, data parallel over N ranks (an error on any rank stops them all)."""
    from .parallel import mpi
    comm = mpi.world()
    if comm is None or comm.Get_size() == 1:
        return _train(args)
    with mpi.abort_on_error(comm, "sncaffe train"):
        return _train(args, comm)


def _train(args, comm=None) -> int:
    from .backend import make_device
    from .solvers import Solver, SolverParamError
    if args.snapshot and args.weights:
        raise ValueError("give --snapshot to resume training or --weights to fine-tune, not both")
    p, from_net = _solver_param(args)
    from .caffe_cli import solver_device
    device_name = args.device or p.device or solver_device(p, args.path) or "cpu"
    if comm is not None:
        from .parallel import mpi
        p.random_seed = mpi.agree_seed(comm, p.random_seed)     # the same data order on every rank
        if device_name == "cuda":
            device_name = f"cuda:{mpi.local_rank(comm)}"         # one GPU per rank on each machine
        if comm.Get_rank() > 0:
            from .progress import console
            args.console = console(bar=False)
    given = p.memory_param.device_memory or (p.net_param.memory_param.device_memory if p.HasField("net_param")
                                             else "")     # the solver's, else the net's memory_param
    device = _spilling(make_device(device_name, args.device_memory or given or None, args.host_memory), args)
    with args.console as con:
        if comm is not None and comm.Get_rank() > 0:
            log.setLevel(logging.WARNING)                      # rank 0 alone logs
        if device.name == "cpu":
            from .backend import threads
            share, by = _sharing(args)          # replicas: their workers compute at once (Replicas)
            if comm is not None:
                share = comm.Split_type(mpi.import_mpi().COMM_TYPE_SHARED).Get_size()
            log.info("CPU threads: %s", threads.configure(args.threads, share, by).describe())
        if from_net:
            log.info("%s is a net: training it with the default solver (SGD, base_lr %s, momentum %s, "
                     "weight_decay %s, lr_policy %s, max_iter %d), snapshots to %s", args.path, _g(p.base_lr),
                     _g(p.momentum), _g(p.weight_decay), p.lr_policy, p.max_iter, p.snapshot_prefix)
        try:
            # replicas take an unreplicated net's weights themselves (Replicas, below), renamed
            solver = Solver(p, device=device, weights=None if getattr(args, "replicas", None) else args.weights)
        except SolverParamError as e:
            raise SolverParamError(f"{args.path}: {e}") from None
        nets = [solver.net] + solver.test_nets
        if not any(w for node in solver.net.graph.layers for w in node.loss_weights):
            _close_data_layers(nets)
            what = "has no layers" if not solver.net.graph.layers else "has no loss"
            raise ValueError(f"{args.path}: the train net {what}, so training has nothing to learn; add a loss "
                             'layer (e.g. layer { type: "SoftmaxWithLoss" bottom: "scores" bottom: "label" '
                             'top: "loss" }) or give an output a loss_weight')
        try:
            fed = [net for net in nets if net.inputs]
            if fed:
                solver.feed = SyntheticInputs(solver.seed)
                log.info("Input layers get synthetic data: %s", SyntheticInputs.describe(fed[0]))
            progress = _TrainProgress(con, solver)
            solver.callbacks.append(progress)
            if len(solver.net.graph.layers) >= 1000:     # minutes per iteration: show inside it too
                solver.net.step_hook = _StepProgress(con, solver.net, solver)
            parallel = None
            if comm is not None:
                from .parallel import DataParallel
                parallel = DataParallel(solver, comm, bucket_bytes=int(args.bucket_mb * 2**20),
                                        timeout=args.comm_timeout)
                progress.images *= comm.Get_size()
            replicas = None
            if getattr(args, "replicas", None):
                if comm is not None:
                    raise ValueError("--replicas is data parallelism inside one process: not under mpiexec")
                from .parallel.replicas import Replicas
                replicas = Replicas(solver, weights=args.weights)
            tracer = None
            if args.trace and (comm is None or comm.Get_rank() == 0):
                from .parallel import IterationTrace
                os.makedirs(os.path.dirname(args.trace) or ".", exist_ok=True)
                tracer = IterationTrace(solver, args.trace, args.trace_iter)
            t0 = time.perf_counter()
            try:
                with _signal_effects(solver, args.sigint_effect, args.sighup_effect):
                    solver.solve(args.snapshot)
            finally:
                if progress.bar is not None:
                    progress.bar.close()
            if parallel is not None:
                parallel.close()
            if replicas is not None:
                replicas.close()
            if tracer is not None and tracer.spans is None:
                log.warning("--trace: iteration %d was not trained (iterations %d to %d were), no trace written",
                            args.trace_iter, progress.start if progress.start is not None else solver.iter,
                            solver.iter - 1)
            wall = time.perf_counter() - t0
            done = solver.iter - (progress.start if progress.start is not None else solver.iter)
            from .mem.budget import process_memory
            log.info("Trained to iteration %d in %.1f s (%s); pool peak %s, host pool peak %s, "
                     "%speak resident memory %s%s", solver.iter, wall,
                     rate_text(done * progress.images, wall, iterations=done), _peak(device, solver.net),
                     fmt_bytes(device.host_pool.peak),
                     f"spill file peak {fmt_bytes(device._spill.pool.peak)}, " if getattr(device, "_spill", None)
                     else "", fmt_bytes(process_memory()["hwm"]),
                     f"; snapshot {solver.last_snapshot[0]}" if solver.last_snapshot else "")
        finally:
            _close_data_layers(nets)
    return 0


# -- test -----------------------------------------------------------------------

def cmd_test(args) -> int:
    """Score a net: forward ``iterations`` batches and average every output blob, like ``caffe test``."""
    from .net import Net
    from .solvers.solver import MAX_LOGGED, _host
    param = _net_param(args)
    with args.console as con:
        if not args.weights:
            log.warning("no --weights: scoring the net's initial (random) parameters")
        net = Net(param, args.phase, device=_device(args, param), weights=args.weights, seed=args.seed or 0,
                  memory=args.memory)
        try:
            feed = None
            if net.inputs:
                feed = SyntheticInputs(args.seed or 0)
                log.info("Input layers get synthetic data: %s", SyntheticInputs.describe(net))
            weights = {t.name: w for node in net.graph.layers for w, t in zip(node.loss_weights, node.tops)}
            names = sorted(net.outputs)           # Caffe's order: a std::set of names
            log.info("Running for %d iterations.", args.iterations)
            bar = con.progress(args.iterations, desc="test")
            sums, loss = {}, 0.0
            try:
                for i in range(args.iterations):
                    if feed:
                        feed(net, i)
                    loss += net.forward()
                    for name in names:
                        values = _host(net.blobs[name].data).astype(np.float64).ravel()
                        sums[name] = sums.get(name, 0) + values
                        if not con.bar:
                            for v in values[:MAX_LOGGED]:
                                log.info("Batch %d, %s = %s", i, name, _g(v))
                            if len(values) > MAX_LOGGED:
                                log.info("Batch %d, %s: %d more values", i, name, len(values) - MAX_LOGGED)
                    bar.update(1)
            finally:
                bar.close()
            n = args.iterations
            log.info("Loss: %s", _g(loss / n))
            for name in names:
                w = weights.get(name, 0.0)
                means = sums[name] / n
                for v in means[:MAX_LOGGED]:
                    extra = f" (* {_g(w)} = {_g(w * v)} loss)" if w else ""
                    log.info("%s = %s%s", name, _g(v), extra)
                if len(means) > MAX_LOGGED:     # Caffe prints every element
                    log.info("%s: %d more values (of %d: min %s, mean %s, max %s)", name, len(means) - MAX_LOGGED,
                             len(means), _g(means.min()), _g(means.mean()), _g(means.max()))
        finally:
            _close_data_layers([net])
    return 0


# -- time -----------------------------------------------------------------------

def cmd_time(args) -> int:
    """Per-layer forward and backward times, like ``caffe time``."""
    from .net import Net
    param = _net_param(args)
    # caffe time runs each layer's backward with the net's own bottom_need_backward: what training
    # computes (LeNet's conv1 takes no gradient of the data: 1.1 ms of backward there, 7.0 with it)
    device = _device(args, param)
    net = Net(param, args.phase, device=device, memory=args.memory, defer=True)    # the graph alone
    if not any(node.need_backward for node in net.graph.layers):
        # no loss (a deploy net): nothing would run backward; time every layer's, as if forced
        _close_data_layers([net])
        param.force_backward = True
        net = Net(param, args.phase, device=device, memory=args.memory, defer=True)
    net.place(net.make_plan())
    if args.weights is not None:
        net.copy_from(args.weights)
    SyntheticInputs(0)(net)
    rng = np.random.default_rng(0)
    for name in net.outputs:
        blob = net.blobs[name]
        if blob.diff is not None and blob.data.ndim:
            blob.diff[...] = rng.standard_normal(blob.diff.shape)
    print(f"sncaffe time: {args.net} ({net.name or 'net'}), phase {args.phase}, "
          f"{args.iterations} iterations, device {net.device.name}", flush=True)
    if net.device.name == "cpu":
        from .backend import threads
        print(f"CPU threads: {threads.current().describe()}", flush=True)
    from .mem.report import plan_line
    print(plan_line(net.plan, net.memory == "auto", net.name), flush=True)
    try:
        net.forward()                          # warm-up, as caffe time does
        net.backward()
        fwd, bwd = {}, {}
        t0 = time.perf_counter()
        for _ in range(args.iterations):
            net.forward(timings=fwd)
            net.backward(timings=bwd)
        total = time.perf_counter() - t0
    finally:
        _close_data_layers([net])
    n = args.iterations
    width = max(len(x) for x in net.layer_names) + 2
    print(f"{'layer':<{width}}{'type':<24}{'forward ms':>12}{'backward ms':>13}")
    for node in net.graph.layers:
        f = fwd.get(node.name + ":forward", 0.0) / n * 1e3
        b = bwd.get(node.name + ":backward", 0.0) / n * 1e3
        print(f"{node.name:<{width}}{node.type:<24}{f:>12.3f}{b:>13.3f}")
    f_all, b_all = sum(fwd.values()) / n * 1e3, sum(bwd.values()) / n * 1e3
    batch = net.batch_size
    print(f"Average Forward pass: {f_all:.3f} ms.")
    print(f"Average Backward pass: {b_all:.3f} ms.")
    print(f"Average Forward-Backward: {total / n * 1e3:.3f} ms"
          + (f" ({rate_text(batch * n, total)})." if batch else "."))
    print(f"Total Time: {total * 1e3:.1f} ms.")
    st = net.device.pool.stats()
    print(f"Pool peak: {fmt_bytes(st['peak'])} ({st['peak']} bytes) of {fmt_bytes(st['capacity'])}.")
    if net.device.name == "cpu":
        from .backend.blas import BLAS
        print(f"CPU GEMMs: {BLAS.describe()} (SNCAFFE_BLAS=mkl|openblas|numpy).")
        from .backend import onednn
        convs = [node.layer for node in net.graph.layers if hasattr(node.layer, "dnn")]
        where = (f"{sum(c.dnn is not None for c in convs)} of {len(convs)} on oneDNN {onednn.version()}"
                 if onednn.version() else f"oneDNN not installed ({onednn.INSTALL})")
        print(f"CPU convolutions: {where}, the others on sncaffe's GEMMs (SNCAFFE_CONV=onednn|native).")
    return 0


# -- plan -----------------------------------------------------------------------

MEMORY_MODES = ("none", "liveness", "offload", "recompute", "all", "auto")


def cmd_plan(args) -> int:
    """The memory of one iteration in every mode, simulated: nothing is allocated or computed."""
    from .graph import build_graph
    from .mem.planner import MODES, auto_plan, make_plan
    from .mem.pool import parse_bytes
    from .mem.report import draw_timelines, plan_table
    from .prototxt import prepare_net
    from .solvers.solver import history_bytes
    from .solvers.update import RULES
    t0 = time.perf_counter()
    param = _net_param(args)
    from .backend import plan_target
    target = plan_target(args.device)
    graph = build_graph(prepare_net(param, args.phase), 0 if args.phase == "TRAIN" else 1, target=target)
    capacity = parse_bytes(args.device_memory) if args.device_memory else None
    rule = RULES.get(args.solver_type)
    if rule is None:
        raise ValueError(f"unknown solver type {args.solver_type!r} ({', '.join(RULES)})")
    train = args.phase == "TRAIN"
    reserve = history_bytes(graph, rule.n_history) if train else 0
    frozen = {n.name for n in graph.layers if not n.layer.learnable}     # BatchNorm's statistics
    learnable = sum(int(np.prod(q.data.shape)) for q in graph.learnable if q.layer not in frozen)
    batch = next((t.shape[0] for n in graph.layers if not n.bottoms for t in n.tops if t.shape), 0)
    print(f"sncaffe plan: {args.net} ({graph.param.name or 'net'}), phase {args.phase}, batch {batch}, "
          f"{len(graph.layers)} layers, {learnable / 1e6:.1f} M learnable parameters"
          + (f", {args.solver_type} history {fmt_bytes(reserve)}" if train else ""))
    if target is not None:
        how = "measured by cuDNN on " + target.name if target.cudnn else "estimated (no GPU here; see cudnn_conv.py)"
        print(f"planned for {args.device}: convolution workspaces {how}")
    plans = [make_plan(graph, mode, None, reserve) for mode in MODES]
    lb = plans[0].lower_bound
    copies = [n for n in graph.layers if n.type == "Copy"]
    if copies:
        print(f"{len(copies)} Copy operators join the locations:")
        for n in copies:
            print(f"  {n.name}: {n.bottoms[0].name} ({n.bottoms[0].data.location or 'default'} -> "
                  f"{n.layer.param.location}), {fmt_bytes(n.tops[0].data.nbytes)}")
        for p in plans:
            print(f"  {p.mode}: " + ", ".join(f"{loc or 'default'} {fmt_bytes(v)}" for loc, v in p.peaks.items() if v))
    print(f"lower bound (the most one step needs): {fmt_bytes(lb)} at {plans[-1].lower_bound_step}")
    print(plan_table(plans))
    hosted = [make_plan(graph, mode, None, 0, host_params=True) for mode in ("offload", "all")]
    params = sum(r.nbytes for r in hosted[-1].host_params)
    print(f"with parameters, gradients and {args.solver_type} history on the host "
          f"({fmt_bytes(params + reserve)} there), brought in per layer:")
    print(plan_table(hosted))
    if capacity is not None:
        cached = [make_plan(graph, mode, capacity, reserve) for mode in ("offload", "all")]
        print(f"device memory {fmt_bytes(capacity)}: offloaded tensors stay cached on the device while they "
              f"fit (LRU):")
        print(plan_table(cached, capacity))
    if args.memory in ("auto", None):
        # What train decides here: the device and host budgets of this machine (or the flags),
        # on the CPU both pools on one RAM, and the disk tier (nothing is allocated: the pools'
        # arenas are virtual until touched).
        from .backend.cpu import CPUDevice
        from .mem.report import plan_line
        from .mem.spill import spill_room
        dev = CPUDevice(args.device_memory, args.host_memory)
        chosen = auto_plan(graph, dev.pool.capacity, reserve, host_capacity=dev.host_pool.capacity, ram=dev.ram,
                           spill=spill_room(args.spill))
        verdict = "fits" if chosen.fits else "does NOT fit; the leanest plan is shown"
        print(f"auto ({verdict}): {plan_line(chosen, True, graph.param.name)}")
    elif args.memory:
        chosen = next(p for p in plans if p.mode == args.memory)
        print(f"mode '{chosen.mode}': peak {fmt_bytes(chosen.peak)}, {len(chosen.offloaded)} tensors offloaded, "
              f"{len(chosen.dropped)} dropped and recomputed ({chosen.recomputed_ops} replays)")
    if args.png:                # a picture only when asked: it takes longer than the plans of big nets
        more = [("host params", hosted)] + ([(f"at {fmt_bytes(capacity)}", cached)] if capacity is not None else [])
        draw_timelines(plans, args.png, title=f"{graph.param.name or args.net}, batch {batch}", capacity=capacity,
                       more=more)
        print(f"timelines: {args.png}")
    print(f"planned in {time.perf_counter() - t0:.1f} s")
    return 0


# -- draw -----------------------------------------------------------------------

def cmd_draw(args) -> int:
    """Draw a net as Caffe's draw_net.py does (Graphviz): .dot, or .png/.svg/.pdf through dot."""
    from .draw import draw
    from .proto import sncaffe_pb2 as pb
    from .prototxt import read_text
    param = _placed(read_text(args.net, pb.NetParameter()), args.place)
    out = draw(param, args.out, rankdir=args.rankdir, phase=None if args.phase == "ALL" else args.phase)
    print(f"Drawing net to {out}")
    return 0


def cmd_upgrade(args) -> int:
    """Caffe's upgrade_net_proto_text/binary: a V0/V1 net or caffemodel in the current format."""
    from google.protobuf import text_format

    from .upgrade import upgrade_file, write_upgraded
    param, binary = upgrade_file(args.net)
    if args.out:
        write_upgraded(param, args.out, binary)
        print(f"Wrote upgraded {'NetParameter binary proto' if binary else 'NetParameter text'} to {args.out}")
    elif binary:
        raise ValueError(f"{args.net} is a binary caffemodel: give OUT, the file to write")
    else:
        print(text_format.MessageToString(param), end="")
    return 0


# -- the command ----------------------------------------------------------------

def _parser():
    p = argparse.ArgumentParser(prog="sncaffe", description="Train and run Caffe networks.")
    sub = p.add_subparsers(dest="command", required=True)

    def memory_flag(q):
        q.add_argument("--memory", default=None, choices=MEMORY_MODES,
                       help="memory mode (default: the net's or solver's memory_param, else auto: none when "
                            "it fits, else the cheapest mode that fits)")

    def device_flags(q, default="cpu"):
        q.add_argument("--place", metavar="LAYER=LOC,...",
                       help="model parallelism: run each named layer, and the layers after it, at a location "
                            "(cpu:0, cpu:1, cuda:1, ...); Copy operators join them")
        q.add_argument("--device", default=default, help="cpu or cuda (default: %(default)s)")
        q.add_argument("--threads", type=int, help="CPU threads (default: the free cores, each GEMM on as many "
                                                   "as its size pays for; OMP/OPENBLAS/MKL_NUM_THREADS also set it)")
        q.add_argument("--device-memory", help="device capacity, e.g. 12GiB (default: on the CPU the RAM "
                                               "available, less a margin; on a GPU its free memory)")
        q.add_argument("--host-memory", help="host pool capacity for offloaded tensors, e.g. 8GiB (default: the "
                                             "RAM available; on the CPU device and host share it)")
        q.add_argument("--spill", metavar="DIR", help="the disk tier: where a spill file takes the offloads the "
                                                      "host cannot hold (default: the temporary directory; the "
                                                      "file is removed at exit)")

    t = sub.add_parser("train", help="train from a solver or a net prototxt (like caffe train)",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       description="Train from a solver prototxt, or from a net prototxt with these "
                                   "solver settings:\n" + DEFAULT_SOLVER +
                                   'snapshot_prefix: "out/<the net file\'s name>"\n'
                                   "Input layers get synthetic data: N(0,1), and labels in [0, classes).")
    t.add_argument("path", metavar="SOLVER_OR_NET", help="solver prototxt, or a net prototxt")
    t.add_argument("--weights", help="initialize from a .caffemodel, by layer name (fine-tuning)")
    t.add_argument("--snapshot", help="resume from a .solverstate")
    t.add_argument("--max-iter", type=int)
    t.add_argument("--base-lr", type=float)
    t.add_argument("--batch", type=int, help="batch size of every data/Input layer, train and test "
                                              "(test_iter is kept)")
    t.add_argument("--snapshot-prefix", help="where snapshots go; folders are created")
    t.add_argument("--seed", type=int, help="random_seed")
    t.add_argument("--sigint-effect", default="stop", choices=SIGNAL_EFFECTS,
                   help="on Ctrl-C and SIGTERM: stop (snapshot and exit; again to abort), snapshot (and go on), "
                        "none")
    t.add_argument("--sighup-effect", default="snapshot", choices=SIGNAL_EFFECTS, help="on SIGHUP (as Caffe)")
    device_flags(t, default=None)
    memory_flag(t)
    t.add_argument("--host-params", action="store_true",
                   help="keep parameters, gradients and solver history in host memory, brought in per layer")
    t.add_argument("--replicas", metavar="LOC,LOC,...",
                   help="data parallel in one process: the net replicated at these locations (cpu:0,cpu:1), "
                        "the batch cut among them, gradients summed; snapshots hold every replica's layers")
    t.add_argument("--trace", metavar="JSON", help="write a Chrome trace (chrome://tracing, Perfetto) of one "
                                                  "iteration: compute, d2h, h2d and comm streams (rank 0)")
    t.add_argument("--trace-iter", type=int, default=1, metavar="N",
                   help="the iteration --trace records (default: %(default)s)")
    from .parallel import BUCKET_BYTES, TIMEOUT
    t.add_argument("--bucket-mb", type=float, default=BUCKET_BYTES / 2**20,
                   help="under mpiexec: megabytes of gradients all-reduced together (default: %(default)s)")
    t.add_argument("--comm-timeout", type=float, default=TIMEOUT, metavar="SECONDS",
                   help="under mpiexec: how long a rank waits for the others before stopping the job "
                        "(default: %(default)s; 0: forever)")
    t.set_defaults(func=cmd_train)

    s = sub.add_parser("test", help="score a net: average its outputs over batches (like caffe test)")
    s.add_argument("net", help="net prototxt")
    s.add_argument("--weights", help=".caffemodel to score")
    s.add_argument("--iterations", "-n", type=int, default=50)
    s.add_argument("--phase", default="TEST", choices=["TRAIN", "TEST"])
    s.add_argument("--batch", type=int, help="override the batch size")
    s.add_argument("--seed", type=int, help="seed for synthetic inputs and unset weights")
    device_flags(s)
    memory_flag(s)
    s.set_defaults(func=cmd_test)

    m = sub.add_parser("time", help="time forward and backward per layer (like caffe time)")
    m.add_argument("net", help="net prototxt")
    m.add_argument("--iterations", "-n", type=int, default=50)
    m.add_argument("--phase", default="TRAIN", choices=["TRAIN", "TEST"])
    m.add_argument("--batch", type=int, help="override the batch size")
    m.add_argument("--weights", help=".caffemodel to load")
    device_flags(m)
    memory_flag(m)
    m.set_defaults(func=cmd_time)

    q = sub.add_parser("plan", help="simulate the memory of one training iteration in every mode, "
                                    "without computing")
    q.add_argument("net", help="net prototxt")
    q.add_argument("--device-memory", help="device capacity to plan for, e.g. 12GiB (default: as train, the "
                                           "machine's available RAM less a margin)")
    q.add_argument("--host-memory", help="host pool capacity to plan for (default: as train)")
    q.add_argument("--spill", metavar="DIR", help="where train's disk tier would go (default: the temporary directory)")
    q.add_argument("--device", default="cpu", help="plan for cpu or cuda (default: %(default)s): a GPU's "
                   "convolutions take cuDNN's workspaces, measured where a GPU is here, else estimated")
    q.add_argument("--place", metavar="LAYER=LOC,...", help="model parallelism, as for train")
    q.add_argument("--batch", type=int, help="override the batch size")
    q.add_argument("--phase", default="TRAIN", choices=["TRAIN", "TEST"])
    q.add_argument("--memory", default=None, choices=MEMORY_MODES,
                   help="show this mode's plan in detail (default, auto: what train would decide here)")
    q.add_argument("--solver-type", default="SGD", help="the solver whose history is counted (default: SGD)")
    q.add_argument("--png", help="draw the memory timelines into this PNG file (default: none drawn)")
    q.set_defaults(func=cmd_plan)

    d = sub.add_parser("draw", help="draw a net with Graphviz (like Caffe's draw_net.py)")
    d.add_argument("net", help="net prototxt")
    d.add_argument("out", help="the drawing: .dot (text), or .png, .svg, .pdf (these need Graphviz's dot)")
    d.add_argument("--rankdir", default="LR", choices=["LR", "RL", "TB", "BT"],
                   help="direction of the graph layout (default: %(default)s)")
    d.add_argument("--phase", default="ALL", choices=["TRAIN", "TEST", "ALL"],
                   help="draw the layers of this phase (default: %(default)s, every layer)")
    d.add_argument("--place", metavar="LAYER=LOC,...", help="model parallelism, as for train: draws the locations "
                                                           "and the Copy layers between them")
    d.set_defaults(func=cmd_draw)

    u = sub.add_parser("upgrade", help="write a V0/V1 net prototxt or .caffemodel in the current format "
                                       "(like Caffe's upgrade_net_proto_text/binary)")
    u.add_argument("net", help="net prototxt or .caffemodel")
    u.add_argument("out", nargs="?", help="where to write it (default: print a prototxt's text)")
    u.set_defaults(func=cmd_upgrade)
    from .caffe_cli import extend
    extend(sub)                             # Caffe's device_query, plot, --stage/--level, --metrics
    return p


def main(argv=None) -> int:
    from .caffe_cli import translate
    from .progress import console
    parser = _parser()
    args = parser.parse_args(translate(sys.argv[1:] if argv is None else argv, parser))   # Caffe's -flags too
    args.console = console()
    if getattr(args, "device_memory", None):
        from .mem.pool import parse_bytes
        try:
            if parse_bytes(args.device_memory) <= 0:
                raise ValueError
        except (ValueError, OverflowError):
            _parser().error(f"--device-memory {args.device_memory}: not a size (e.g. 12GiB, 512MiB, 1.5G)")
    for flag in ("iterations", "max_iter", "batch"):
        if getattr(args, flag, None) is not None and getattr(args, flag) < 1:
            _parser().error(f"--{flag.replace('_', '-')} must be positive")
    if getattr(args, "base_lr", None) is not None and not math.isfinite(args.base_lr):
        _parser().error(f"--base-lr {args.base_lr}: give a finite number")
    try:
        if hasattr(args, "threads"):      # before anything loads the BLAS (which takes MKL's
            from .backend import threads   # sequential layer for a budget of one)
            threads.configure(args.threads, *_sharing(args))
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
