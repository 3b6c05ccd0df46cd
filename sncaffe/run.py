"""What the ``sncaffe`` commands run, as functions a program or a test calls the same way.

``Resources`` resolves, once and in one place for train, test, time and plan, the device,
its memory budgets and the memory mode: flags first, then the solver's and the net's
``memory_param``, then the machine. ``solver_param`` and ``net_param`` read what a command
names and apply its flags; ``train``, ``score``, ``time_net`` and ``plan_report`` run it.
"""
from __future__ import annotations

import logging
import os
import re
import signal
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from threading import Thread, current_thread, main_thread

import numpy as np
from google.protobuf import text_format

from . import backend
from .backend import runtimes, threads
from .data.synthetic import SyntheticInputs
from .graph import build_graph, update_in_backward
from .net import Net, memory_mode
from .parallel import BUCKET_BYTES, TIMEOUT, DataParallel, IterationTrace, mpi
from .parallel.placement import place_solver_nets, placed, sharing
from .parallel.replicas import Replicas
from .plan import planner, report
from .progress import Console, StepProgress, TrainProgress, pool_peaks, rate
from .proto import sncaffe_pb2 as pb
from .prototxt import decode, parse_text, prepare_net, read_text
from .runtime.budget import process_memory
from .runtime.spill import spill_peak
from .sizes import align, fmt_bytes
from .solvers import Solver, SolverParamError
from .solvers.detection_eval import AP_VERSIONS, DetectionScores
from .solvers.solver import history_blocks, upgrade_snapshot_prefix
from .solvers.update import RULES
from .validate import PrototxtError

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
MAX_LOGGED = 10        # values of one output blob logged one per line; the rest are summarised


def _g(x) -> str:
    return f"{float(x):.6g}"


@dataclass
class Resources:
    """Where a command runs and with how much memory. ``memory``: the memory mode (None: the
    solver's or the net's memory_param, else auto); sizes as ``12GiB`` (None: the machine's)."""
    device: str | None = None
    device_memory: str | None = None
    host_memory: str | None = None
    spill: str | None = None
    memory: str | None = None
    threads: int | None = None

    def mode(self, *params) -> str:
        return self.memory or memory_mode(*params)

    def capacity(self, *params):
        """--device-memory, else the first memory_param.device_memory of ``params``."""
        return self.device_memory or next((p.memory_param.device_memory for p in params
                                           if p is not None and p.memory_param.device_memory), None)

    def make_device(self, *params, name=None, share=1):
        device = backend.make_device(name or self.device or "cpu", self.capacity(*params), self.host_memory, share)
        if self.spill:
            device.spill_dir = self.spill
        return device

    def budgets(self, *params):
        """(capacity, host-tier keywords) a plan would have on this device, nothing allocated."""
        return backend.budgets(self.device or "cpu", self.capacity(*params), self.host_memory, self.spill)

    def configure_threads(self, share=1, by="ranks"):
        return runtimes.configure(self.threads, share, by)


# -- reading what a command names --------------------------------------------------

def read_solver_or_net(path):
    """(SolverParameter, None) for a solver file, (None, NetParameter) for a net file."""
    try:
        text = decode(Path(path).read_bytes(), path)
    except OSError as e:
        raise PrototxtError(f"{path}: cannot read: {e.strerror}") from None
    try:
        solver = parse_text(text, pb.SolverParameter(), str(path))
    except PrototxtError as solver_error:
        try:
            net = parse_text(text, pb.NetParameter(), str(path), upgrade=True)   # V0/V1: located errors
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


def net_state(state, stages=(), level=None) -> None:
    """Stages and a level into a NetState (Caffe's -stage, -level)."""
    for s in stages or ():
        if s not in state.stage:
            state.stage.append(s)
    if level is not None:
        state.level = level


def net_param(path, stages=(), level=None, batch=None, place=None):
    """A net file with its state, batch size and placement set."""
    param = read_text(path, pb.NetParameter())
    net_state(param.state, stages, level)
    if not (param.layer or param.layers or param.input):
        raise PrototxtError(f"{path}: the net has no layers")
    return placed(param, place, batch)


def solver_param(path, max_iter=None, base_lr=None, seed=None, snapshot_prefix=None, host_params=False,
                 stages=(), level=None, batch=None, place=None, replicas=None):
    """(the SolverParameter to train with, whether ``path`` is a net): the file's (or, for a
    net, DEFAULT_SOLVER's) settings, then the arguments; snapshot folders are made."""
    p, net = read_solver_or_net(path)
    if net is not None:
        p = text_format.Parse(DEFAULT_SOLVER, pb.SolverParameter())
        p.net_param.CopyFrom(net)
        p.snapshot_prefix = os.path.join("out", Path(path).stem)
    for field, value in (("max_iter", max_iter), ("base_lr", base_lr), ("random_seed", seed),
                         ("snapshot_prefix", snapshot_prefix or None)):
        if value is not None:
            setattr(p, field, value)
    if host_params:
        p.memory_param.host_params = True
    net_state(p.train_state, stages, level)
    place_solver_nets(p, batch, place, replicas)
    if p.HasField("snapshot_prefix") and (p.snapshot or p.snapshot_after_train):
        if p.snapshot_prefix.endswith(("/", os.sep)):      # a directory: files named after the solver
            os.makedirs(p.snapshot_prefix, exist_ok=True)
        upgrade_snapshot_prefix(p, path)
        os.makedirs(os.path.dirname(p.snapshot_prefix) or ".", exist_ok=True)
    return p, net is not None


def solver_device(p, path="the solver") -> str | None:
    """``cuda[:device_id]`` for a solver that sets ``solver_mode: GPU``; a clear error where no GPU is."""
    if not (p.HasField("solver_mode") and p.solver_mode == pb.SolverParameter.GPU):
        return None
    from .backend.cuda import unusable_reason
    why = unusable_reason()
    if why:
        raise RuntimeError(f"{path} sets solver_mode: GPU (device_id {p.device_id}), but no GPU is usable "
                           f"here: {why}; set solver_mode: CPU or pass --device cpu")
    return "cuda" + (f":{p.device_id}" if p.HasField("device_id") else "")


def close_data_layers(nets):
    """Stop the prefetch threads of Data/ImageData/HDF5Data layers."""
    for net in nets:
        for layer in net.layers:
            if hasattr(layer, "close"):
                layer.close()


# -- train --------------------------------------------------------------------------

@contextmanager
def signal_effects(solver, sigint="stop", sighup="snapshot"):
    """Caffe's -sigint_effect / -sighup_effect: stop (snapshot and exit), snapshot (and go on), none."""
    if current_thread() is not main_thread():
        yield
        return
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


def train(p, res, *, path="the solver", from_net=False, weights=None, snapshot=None, sigint="stop",
          sighup="snapshot", replicas=None, trace=None, trace_iter=1, bucket_mb=None, comm_timeout=None,
          console=None) -> Solver:
    """Train with SolverParameter ``p`` (from ``solver_param``) as ``caffe train`` does, on
    ``res``; under ``mpiexec -n N`` data parallel over N ranks (an error on any rank stops them
    all). ``console``: a progress.Console (bars on a terminal). Returns the solver."""
    kw = dict(path=path, from_net=from_net, weights=weights, snapshot=snapshot, sigint=sigint, sighup=sighup,
              replicas=replicas, trace=trace, trace_iter=trace_iter, bucket_mb=bucket_mb,
              comm_timeout=comm_timeout, console=console)
    comm = mpi.world()
    if comm is None or comm.Get_size() == 1:
        return _train(p, res, None, **kw)
    with mpi.abort_on_error(comm, "sncaffe train"):
        return _train(p, res, comm, **kw)


def _train(p, res, comm, path, from_net, weights, snapshot, sigint, sighup, replicas, trace, trace_iter,
           bucket_mb, comm_timeout, console):
    if snapshot and weights:
        raise ValueError("give --snapshot to resume training or --weights to fine-tune, not both")
    if replicas and comm is not None:
        raise ValueError("--replicas is data parallelism inside one process: not under mpiexec")
    name = res.device or p.device or solver_device(p, path) or "cpu"
    if comm is not None:
        p.random_seed = mpi.agree_seed(comm, p.random_seed)     # the same data order on every rank
        if name == "cuda":
            name = f"cuda:{mpi.local_rank(comm)}"                # one GPU per rank on each machine
        if comm.Get_rank() > 0:
            console = None
            log.setLevel(logging.WARNING)                          # rank 0 alone logs
    con = console or Console(False)
    net_param = p.net_param if p.HasField("net_param") else None
    # ranks on this machine split its cores and, on the CPU, its RAM
    here = comm.Split_type(mpi.import_mpi().COMM_TYPE_SHARED).Get_size() if comm is not None else 1
    device = res.make_device(p, net_param, name=name, share=here)
    if device.name == "cpu":
        share, by = sharing(replicas)           # replicas: their workers compute at once (Replicas)
        if comm is not None:
            share = here
            log.info("RAM: %d ranks on this machine, each planned within 1/%d of what it has free",
                     here, here)
        log.info("CPU threads: %s", res.configure_threads(share, by).describe())
    if from_net:
        log.info("%s is a net: training it with the default solver (SGD, base_lr %s, momentum %s, "
                 "weight_decay %s, lr_policy %s, max_iter %d), snapshots to %s", path, _g(p.base_lr),
                 _g(p.momentum), _g(p.weight_decay), p.lr_policy, p.max_iter, p.snapshot_prefix)
    try:
        # replicas take an unreplicated net's weights themselves (Replicas, below), renamed
        # each gradient applied as backward completes it, except where ranks or replicas sum them first
        solver = Solver(p, device=device, weights=None if replicas else weights, memory=res.memory,
                        update_in_backward=comm is None and not replicas)
    except SolverParamError as e:
        raise SolverParamError(f"{path}: {e}") from None
    nets = [solver.net] + solver.test_nets
    hooks = []
    try:
        if not solver.net.loss_weights:
            what = "has no layers" if not solver.net.layers else "has no loss"
            raise ValueError(f"{path}: the train net {what}, so training has nothing to learn; add a loss "
                             'layer (e.g. layer { type: "SoftmaxWithLoss" bottom: "scores" bottom: "label" '
                             'top: "loss" }) or give an output a loss_weight')
        fed = [net for net in nets if net.inputs]
        if fed:
            solver.feed = SyntheticInputs(solver.seed)
            log.info("Input layers get synthetic data: %s", SyntheticInputs.describe(fed[0]))
        progress = TrainProgress(con, solver)
        solver.callbacks.append(progress)
        if len(solver.net.layers) >= 1000:     # minutes per iteration: show inside it too
            solver.net.step_hook = StepProgress(con, solver.net, solver)
        if comm is not None:
            hooks.append(DataParallel(solver, comm, bucket_bytes=int((bucket_mb or BUCKET_BYTES / 2**20) * 2**20),
                                      timeout=TIMEOUT if comm_timeout is None else comm_timeout))
        if replicas:
            hooks.append(Replicas(solver, weights=weights))
        tracer = None
        if trace and (comm is None or comm.Get_rank() == 0):
            os.makedirs(os.path.dirname(trace) or ".", exist_ok=True)
            tracer = IterationTrace(solver, trace, trace_iter)
        t0 = time.perf_counter()
        try:
            with signal_effects(solver, sigint, sighup):
                solver.solve(snapshot)
        finally:
            progress.close()
        for hook in hooks:
            hook.close()
        start = progress.start if progress.start is not None else solver.iter
        if tracer is not None and tracer.spans is None:
            log.warning("--trace: iteration %d was not trained (iterations %d to %d were), no trace written",
                        trace_iter, start, solver.iter - 1)
        wall, spilled = time.perf_counter() - t0, spill_peak(device)
        log.info("Trained to iteration %d in %.1f s (%s); pool peak %s, host pool peak %s, %speak resident "
                 "memory %s%s", solver.iter, wall, rate(solver.iter - start, wall, solver.images_per_iter),
                 pool_peaks(solver.net), fmt_bytes(device.host_pool.peak),
                 f"spill file peak {fmt_bytes(spilled)}, " if spilled else "", fmt_bytes(process_memory()["hwm"]),
                 f"; snapshot {solver.last_snapshot[0]}" if solver.last_snapshot else "")
    finally:
        close_data_layers(nets)
    return solver


# -- test and time ------------------------------------------------------------------

def _net(param, res, phase, **kw) -> Net:
    return Net(param, phase, device=res.make_device(param), memory=res.mode(param),
               host_params=param.memory_param.host_params, **kw)


def _accumulate(sums, ragged, name, values, batch):
    """Add a batch's output to its sum; an output whose number of values changes between batches
    (a Faster R-CNN's scores, one row per proposal) is averaged over all its values instead:
    ragged[name] = [sum, count]."""
    seen = sums.get(name)
    if name not in ragged and (seen is None or seen.shape == values.shape):
        sums[name] = values if seen is None else seen + values
        return
    if name not in ragged:
        log.warning('output "%s" has %d values in batch %d, %d in those before: its mean over all its values '
                    "is reported", name, values.size, batch, seen.size)
        ragged[name] = [float(seen.sum()), seen.size * batch]
        del sums[name]
    ragged[name][0] += float(values.sum())
    ragged[name][1] += values.size


def score(param, res, phase="TEST", weights=None, iterations=50, seed=0, console=None,
          ap_version="Integral") -> dict:
    """Forward ``iterations`` batches and average every output blob, like ``caffe test``;
    logs each batch's values and the means; returns {output: mean array}. A DetectionEvaluate's
    rows, whose number changes with every batch, are gathered instead and scored as SSD's solver
    scores its test nets: {output: [mean average precision]} (``ap_version``)."""
    con = console or Console(False)
    if not weights:
        log.warning("no --weights: scoring the net's initial (random) parameters")
    net = _net(param, res, phase, weights=weights, seed=seed)
    try:
        feed = None
        if net.inputs:
            feed = SyntheticInputs(seed)
            log.info("Input layers get synthetic data: %s", SyntheticInputs.describe(net))
        names = sorted(net.outputs)           # Caffe's order: a std::set of names
        detections = {name: DetectionScores() for name in names
                      if net.graph.blobs[name].producer.type == "DetectionEvaluate"}
        log.info("Running for %d iterations.", iterations)
        bar = con.progress(iterations, desc="test")
        sums, ragged, loss = {}, {}, 0.0
        try:
            for i in range(iterations):
                if feed:
                    feed(net, i)
                loss += net.forward()
                for name in names:
                    values = np.asarray(net.output(name), dtype=np.float64).ravel()
                    if name in detections:
                        detections[name].add(values)
                        if not con.bar:
                            log.info("Batch %d, %s: %d rows", i, name, values.size // 5)
                        continue
                    _accumulate(sums, ragged, name, values, i)
                    if not con.bar:
                        for v in values[:MAX_LOGGED]:
                            log.info("Batch %d, %s = %s", i, name, _g(v))
                        if len(values) > MAX_LOGGED:
                            log.info("Batch %d, %s: %d more values", i, name, len(values) - MAX_LOGGED)
                bar.update(1)
        finally:
            bar.close()
        log.info("Loss: %s", _g(loss / iterations))
        weights_of = net.loss_weights
        means = {name: sums[name] / iterations for name in sums}
        means.update((name, np.array([total / count])) for name, (total, count) in ragged.items())
        for name, found in detections.items():
            means[name] = np.array([found.mean_ap(ap_version)[0]])
            log.info("%s: mean average precision (%s) over %d classes", name, ap_version, len(found.num_pos))
        means = {name: means[name] for name in names}
        for name, m in means.items():
            w = weights_of.get(name, 0.0)
            for v in m[:MAX_LOGGED]:
                log.info("%s = %s%s", name, _g(v), f" (* {_g(w)} = {_g(w * v)} loss)" if w else "")
            if len(m) > MAX_LOGGED:     # Caffe prints every element
                log.info("%s: %d more values (of %d: min %s, mean %s, max %s)", name, len(m) - MAX_LOGGED,
                         len(m), _g(m.min()), _g(m.mean()), _g(m.max()))
        return means
    finally:
        close_data_layers([net])


def time_net(param, res, phase="TRAIN", iterations=50, weights=None, source="", out=print) -> dict:
    """Per-layer forward and backward times, like ``caffe time``: printed (by ``out``, print's
    signature), and returned as
    {"forward": {layer: s}, "backward": {layer: s}, "total": s per iteration}."""
    # caffe time runs each layer's backward with the net's own bottom_need_backward: what training
    # computes (the first convolution takes no gradient of the data)
    net = _net(param, res, phase, defer=True)                     # the graph alone
    if not net.needs_backward:
        # no loss (a deploy net): nothing would run backward; time every layer's, as if forced
        close_data_layers([net])
        param.force_backward = True
        net = _net(param, res, phase, defer=True)
    net.place(net.make_plan())
    if weights is not None:
        net.copy_from(weights)
    SyntheticInputs(0)(net)
    rng = np.random.default_rng(0)
    for name in net.outputs:
        blob = net.blobs[name]
        if blob.diff is not None and blob.data.ndim:
            blob.diff[...] = rng.standard_normal(blob.diff.shape)
    out(f"sncaffe time: {source} ({net.name or 'net'}), phase {phase}, {iterations} iterations, "
        f"device {net.device.name}", flush=True)
    if net.device.name == "cpu":
        out(f"CPU threads: {threads.current().describe()}", flush=True)
    out(report.plan_line(net.plan, net.memory == "auto", net.name), flush=True)
    try:
        net.forward()                          # warm-up, as caffe time does
        net.backward()
        fwd, bwd = {}, {}
        t0 = time.perf_counter()
        for _ in range(iterations):
            net.forward(timings=fwd)
            net.backward(timings=bwd)
        total = time.perf_counter() - t0
    finally:
        close_data_layers([net])
    n, layers = iterations, net.layer_types
    width = max(len(x) for x in layers) + 2
    out(f"{'layer':<{width}}{'type':<24}{'forward ms':>12}{'backward ms':>13}")
    fwd = {name: fwd.get(name + ":forward", 0.0) / n for name in layers}
    bwd = {name: bwd.get(name + ":backward", 0.0) / n for name in layers}
    for name, kind in layers.items():
        out(f"{name:<{width}}{kind:<24}{fwd[name] * 1e3:>12.3f}{bwd[name] * 1e3:>13.3f}")
    batch = net.batch_size
    out(f"Average Forward pass: {sum(fwd.values()) * 1e3:.3f} ms.")
    out(f"Average Backward pass: {sum(bwd.values()) * 1e3:.3f} ms.")
    out(f"Average Forward-Backward: {total / n * 1e3:.3f} ms ({rate(n, total, batch)}).")
    out(f"Total Time: {total * 1e3:.1f} ms.")
    st = net.device.pool.stats()
    out(f"Pool peak: {fmt_bytes(st['peak'])} ({st['peak']} bytes) of {fmt_bytes(st['capacity'])}.")
    if net.device.name == "cpu":
        from .backend import onednn
        from .backend.blas import BLAS
        out(f"CPU GEMMs: {BLAS.describe()} (SNCAFFE_BLAS=mkl|openblas|numpy).")
        convs = [layer for layer, kind in zip(net.layers, layers.values())
                 if kind in ("Convolution", "Deconvolution")]
        where = (f"{sum(getattr(c, 'dnn', None) is not None for c in convs)} of {len(convs)} convolutions on "
                 f"oneDNN {onednn.version()}" if onednn.version() else f"oneDNN not installed ({onednn.INSTALL})")
        out(f"CPU convolutions: {where}, the others on sncaffe's GEMMs (SNCAFFE_CONV=onednn|native).")
    return {"forward": fwd, "backward": bwd, "total": total / n}


# -- plan ---------------------------------------------------------------------------

def mode_plans(graph, modes, reserve, **kw) -> list:
    """Each mode's plan without a capacity; recompute and all reuse the plans without
    recomputation they are weighed against (liveness, offload) instead of making them again."""
    built = {}
    for mode in modes:
        built[mode] = planner.make_plan(graph, mode, None, reserve, built=built, **kw)
    return list(built.values())


@planner.paused_gc()           # (the graph and every mode's plan: millions of objects, no garbage)
def plan_report(param, res, phase="TRAIN", solver_type="SGD", png=None, source="", out=print):
    """The memory of one iteration in every mode, simulated: nothing is allocated or computed.
    First the verdict for ``res`` (the mode auto picks, or ``res.memory``), then the tables;
    returns the plan of the verdict."""
    t0 = time.perf_counter()
    device = res.device or "cpu"
    target = backend.plan_target(device)
    graph = build_graph(prepare_net(param, phase), 0 if phase == "TRAIN" else 1, target=target)
    rule = RULES.get(solver_type)
    if rule is None:
        raise ValueError(f"unknown solver type {solver_type!r} ({', '.join(RULES)})")
    train = phase == "TRAIN"
    # the history's blocks, as the solver allocates them (with the parameters on disk, it goes there too)
    blocks = history_blocks(graph, rule.n_history) if train else []
    reserve = sum(align(b) for b in blocks)
    if train:           # as train plans it: each gradient updated as soon as backward completes it
        update_in_backward(graph)
    capacity, kw = res.budgets(param)
    mode = res.mode(param)
    name = graph.param.name or "net"
    # the tables' plans first: auto's disk tier reuses the peak of the plan without a capacity
    plans = mode_plans(graph, planner.MODES, blocks)
    if capacity is None:        # a GPU with none here to ask its memory
        chosen = plans[planner.MODES.index("none" if mode == "auto" else mode)]
        out(f"{name}: mode '{chosen.mode}' needs {fmt_bytes(chosen.peak)} on {device} (no GPU here: "
            "give --device-memory for the verdict of auto)")
    else:
        chosen = (planner.auto_plan(graph, capacity, blocks, **kw) if mode == "auto"
                  else planner.shared_ram_plan(graph, mode, capacity, blocks, **kw))
        out(report.verdict(chosen, name, mode == "auto", device))
    frozen = {n.name for n in graph.layers if not n.layer.learnable}     # BatchNorm's statistics
    learnable = sum(int(np.prod(q.data.shape)) for q in graph.learnable if q.layer not in frozen)
    batch = next((t.shape[0] for n in graph.layers if not n.bottoms for t in n.tops if t.shape), 0)
    out(f"sncaffe plan: {source} ({name}), phase {phase}, batch {batch}, {len(graph.layers)} layers, "
        f"{learnable / 1e6:.1f} M learnable parameters" + (f", {solver_type} history {fmt_bytes(reserve)}"
                                                          if train else ""))
    if getattr(graph, "updated_in_backward", None):
        out(f"parameters updated in backward as their gradients complete (as train does without "
            f"clip_gradients or iter_size): {len(graph.updated_in_backward)} gradients "
            f"({fmt_bytes(sum(r.nbytes for r in graph.updated_in_backward.values()))}) live a layer at a time")
    if target is not None:
        how = "measured by cuDNN on " + target.name if target.cudnn else "estimated (no GPU here; see cudnn_conv.py)"
        out(f"planned for {device}: convolution workspaces {how}")
    copies = [n for n in graph.layers if n.type == "Copy"]
    if copies:
        out(f"{len(copies)} Copy operators join the locations:")
        for n in copies:
            out(f"  {n.name}: {n.bottoms[0].name} ({n.bottoms[0].data.location or 'default'} -> "
                f"{n.layer.param.location}), {fmt_bytes(n.tops[0].data.nbytes)}")
        for p in plans:
            out(f"  {p.mode}: " + ", ".join(f"{loc or 'default'} {fmt_bytes(v)}" for loc, v in p.peaks.items() if v))
    out(f"lower bound (the most one step needs): {fmt_bytes(plans[0].lower_bound)} at {plans[-1].lower_bound_step}")
    out(report.plan_table(plans))
    more = []
    # The tables with the parameters on the host where they matter: the device cannot hold them,
    # or the user keeps them there (a whole set of plans more, seconds on the deepest nets).
    if capacity is None or not chosen.fits or chosen.host_params or param.memory_param.host_params:
        hosted = mode_plans(graph, ("offload", "all"), 0, host_params=True)
        params = sum(r.nbytes for r in hosted[-1].host_params)
        out(f"with parameters, gradients and {solver_type} history on the host ({fmt_bytes(params + reserve)} "
            "there), brought in per layer:")
        out(report.plan_table(hosted))
        more.append(("host params", hosted))
    else:
        out("parameters, gradients and history stay on the device: the verdict fits without moving them "
            "to the host (--host-params plans that too)")
    if res.device_memory:
        given = capacity
        cached = [planner.make_plan(graph, m, given, blocks) for m in ("offload", "all")]
        out(f"device memory {fmt_bytes(given)}: offloaded tensors stay cached on the device while they fit (LRU):")
        out(report.plan_table(cached, given))
        more.append((f"at {fmt_bytes(given)}", cached))
    out(("auto" if mode == "auto" else f"mode '{mode}'") + f" ({'fits' if chosen.fits else 'does NOT fit'}): "
        + report.plan_line(chosen, mode == "auto", graph.param.name, process_memory()["rss"]))
    if png:                 # a picture only when asked: it takes longer than the plans of big nets
        report.draw_timelines(plans, png, title=f"{graph.param.name or source}, batch {batch}",
                              capacity=capacity if res.device_memory else None, more=more)
        out(f"timelines: {png}")
    out(f"planned in {time.perf_counter() - t0:.1f} s")
    return chosen
