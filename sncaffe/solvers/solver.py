"""Caffe's Solver: nets from a SolverParameter, the training loop, testing, snapshots and resume.

``Solver(solver.prototxt)`` builds the train net and the test nets as
Caffe's Solver::Init does (paths relative to the current directory, NetState
merged from the solver's train_state/test_state, random_seed seeding every
net), and ``solve()`` runs Caffe's Solve/Step: the same iteration order, the
same log lines (through the ``logging`` logger "sncaffe"), the same snapshot
files. The solver history lives in the device pool next to the net.

Hooks for Python callers and the command line:

- ``feed(net, iteration)``: optional, called before every forward pass: of
  the train net with ``iteration`` = ``solver.iter`` (each of the iter_size
  passes of one iteration gets the same number), of test net ``net`` with the
  test batch index 0..test_iter-1 (``net.phase`` tells them apart). It
  writes the Input blobs (``net.blobs[name].data[...] = batch``); nets with
  data layers need none.
- ``callbacks``: functions called after every update as
  ``fn(iteration, loss, lr)``: ``iteration`` is the number of updates done
  (``solver.iter``), ``loss`` the loss as Caffe displays it (smoothed over
  average_loss), ``lr`` the learning rate of that update.
- ``request_stop()``: safe from a signal handler; training stops between
  iterations (or test batches) and ``solve()`` writes a snapshot and returns,
  like Caffe's SIGINT with -sigint_effect stop plus snapshot_after_train.
  ``request_snapshot()`` snapshots after the current iteration and goes on.
- Data parallel (sncaffe.parallel): ``before_update()`` runs after the
  backward passes, before the update (waits for the gradients' all-reduce);
  ``sync_requests(stop, snapshot)`` returns the requests agreed by all ranks
  after each iteration; ``is_root`` is False on ranks other than 0, which
  neither test nor snapshot.
"""
from __future__ import annotations

import itertools
import logging
import math
import os
import weakref
from collections import OrderedDict, namedtuple
from functools import partial
from pathlib import Path

import numpy as np

from ..backend import make_device
from ..graph import update_in_backward as mark_updates_in_backward
from ..plan.joint import plan_nets
from ..plan.report import plan_line, verdict
from ..runtime.budget import process_memory
from ..sizes import align, fmt_bytes
from .. import blobproto
from ..layers.base import Blob, DataReadError, array_module
from ..net import Net, memory_mode, within_ram
from ..proto import sncaffe_pb2 as pb
from ..progress import Pace
from ..prototxt import read_solver, read_text
from ..resume import layer_states, restore_layer_states
from .detection_eval import AP_VERSIONS, DetectionScores
from .lr_policy import SolverParamError, check_policy, learning_rate
from .snapshot_files import clean as clean_snapshots
from .snapshot_files import write_pair
from .update import global_norm, make_rule, regularize

log = logging.getLogger("sncaffe")

# One of Caffe's learnable_params, with its params_lr and params_weight_decay.
Param = namedtuple("Param", "layer index blob lr_mult decay_mult")


class TrainingError(RuntimeError):
    """Training cannot go on (a non-finite loss or parameters); the last good snapshot is kept."""


class SnapshotError(ValueError):
    """A .solverstate or .caffemodel that cannot be restored into this solver's net."""


MAX_LOGGED = 10        # values of one output blob logged one per line; the rest are summarised


def _replicas_as_one(outputs, weights):
    """Outputs of a replicated net (``name@location`` at every replica, parallel/replicas.py) as
    the one net's, as Caffe logs them: each the mean of its replicas' values (each replica's the
    mean over its equal part of the batch) under the name, with the sum of their loss weights
    (each replica's is the net's over the replicas). Other outputs as they are."""
    groups = OrderedDict()
    for name in outputs:
        base, at, loc = name.rpartition("@")
        groups.setdefault(base if at else name, []).append(name)
    merged, merged_weights = OrderedDict(), dict(weights)
    for base, names in groups.items():          # (in the order of their first replica: Caffe's)
        values = [np.asarray(outputs[n], dtype=np.float64).ravel() for n in names]
        if len(names) < 2 or base in outputs or len({v.size for v in values}) != 1:
            merged.update((n, outputs[n]) for n in names)
            continue
        merged[base] = np.mean(values, axis=0)
        merged_weights[base] = sum(weights.get(n, 0.0) for n in names)
    return merged, merged_weights


def _g(x) -> str:
    """A number as Caffe's glog prints it (C++ ostream: 6 significant digits)."""
    return f"{float(x):.6g}"


def _host(a):
    """A NumPy array of a device array (CuPy's .get())."""
    return a.get() if hasattr(a, "get") else np.asarray(a)


_write_atomic = blobproto.write_atomic


def upgrade_snapshot_prefix(param, path) -> None:
    """Caffe's UpgradeSnapshotPrefixProperty: default to the solver file's name, or put it in a directory."""
    if not param.HasField("snapshot_prefix"):
        param.snapshot_prefix = str(Path(path).with_suffix(""))
    elif os.path.isdir(param.snapshot_prefix):
        param.snapshot_prefix = os.path.join(param.snapshot_prefix, Path(path).stem)


def history_blocks(graph, n_history, dtype=np.float32) -> list:
    """The pool blocks a solver's history and work buffers take, in allocation order (for a memory plan)."""
    size = np.dtype(dtype).itemsize
    sizes = [int(np.prod(q.data.shape, dtype=np.int64)) * size for q in graph.learnable]   # owners only
    return sizes * n_history + [max(sizes, default=0)] * 2


def history_bytes(graph, n_history, dtype=np.float32) -> int:
    return sum(align(b) for b in history_blocks(graph, n_history, dtype))


def _others_need(net, nets) -> int:
    """The bytes the nets of a solver other than ``net`` allocate only while they run (a test
    net's activations; their parameters and the history are allocated already)."""
    return max((o.plan.peak - o.plan.persistent_bytes for o in nets if o is not net), default=0)


class Solver:
    def __init__(self, param, device=None, feed=None, weights=None, dtype=np.float32, memory=None,
                 update_in_backward=False):
        """``memory``: the memory mode of every net (None: each net's from the solver's, else the
        net's memory_param, else auto). ``update_in_backward``: where the solver allows it (see
        ``_updates_in_backward``), each parameter is updated as soon as backward has completed its
        gradient, which then lives a layer at a time instead of all iteration (the same bits;
        the gradients are not kept after a step, so it is for runs that do not read them, as
        ``sncaffe train``)."""
        if isinstance(param, pb.SolverParameter):
            self.param = pb.SolverParameter()
            self.param.CopyFrom(param)
        else:
            self.param = read_solver(param)
            upgrade_snapshot_prefix(self.param, param)
        p = self.param
        self.dtype = np.dtype(dtype)
        self.memory = memory
        self.rule = make_rule(p, self.dtype)
        check_policy(p)
        self._check_settings()
        if device is None or isinstance(device, str):
            device = make_device(device or p.device or "cpu")
        self.device = device
        self.seed = p.random_seed if p.random_seed >= 0 else int(np.random.SeedSequence().entropy % 2**63)
        self.net = self._train_net()
        self.test_nets = self._test_nets()
        # {backward operator's name: [parameter indices]}: updated right after that operator
        self.update_at = self._updates_in_backward() if update_in_backward else {}
        self._place_nets()
        if self.update_at and self.net.host_params:      # auto put them on the host: updated there, after
            self.update_at = {}
        self._rates = None              # this iteration's (rate, per-parameter rates), set before backward
        self._updated = set()           # parameters this iteration's backward has updated
        if self.update_at:
            self.net.update_hook = self._update_in_backward
            n, kept = sum(map(len, self.update_at.values())), self.net.graph.updated_in_backward
            log.info("Parameters updated in backward as their gradients complete: %d of %d; %s of gradients "
                     "live a layer at a time", n, len(self.net.graph.learnable),
                     fmt_bytes(sum(r.nbytes for r in kept.values())))
        extra = [weights] if isinstance(weights, (str, os.PathLike)) else list(weights or ())
        for w in list(p.weights) + extra:
            for path in str(w).split(","):
                log.info("Finetuning from %s", path)
                for net in [self.net] + self.test_nets:
                    net.copy_from(path)
        for net in self.test_nets:
            self._share_trained_layers(net)
        self._learnable = self._learnable_params()
        self._locations = [q.data.location for q in self.net.graph.learnable]
        # {location: stream}: each location's parameters updated on its own worker, concurrently
        # (data parallelism in one process, parallel/replicas.py); None: all on this thread
        self.update_streams = None
        self.history = self._alloc_history()
        self.iter = 0
        self.current_step = 0
        self.lr = 0.0
        self.smoothed_loss = 0.0
        self._losses = []
        self.feed = feed
        self.images_per_iter = self.net.batch_size * p.iter_size     # data parallel: times the ranks
        self.callbacks = []
        self.test_scores = [OrderedDict() for _ in self.test_nets]
        self.last_snapshot = None           # (caffemodel, solverstate) of the last good snapshot
        self._stop = self._snapshot_now = False
        self.before_update = self.sync_requests = None     # data parallel hooks (see the module's doc)
        self.is_root = True
        log.info("Solver scaffolding done.")

    # -- construction (Solver::Init, InitTrainNet, InitTestNets) --------------
    def _updates_in_backward(self) -> dict:
        """Where an update needs no gradient but its own (no clip_gradients, whose norm is over
        all of them; iter_size 1, which sums passes) and nothing reads the gradients after
        backward (debug_info, snapshot_diff), and the parameters stay on the device: the
        update points (graph.update_in_backward)."""
        p = self.param
        if p.clip_gradients >= 0 or p.iter_size != 1 or p.debug_info or p.snapshot_diff or self.net.host_params:
            return {}
        return mark_updates_in_backward(self.net.graph)

    def _check_settings(self):
        p = self.param
        # base_lr, momentum, ...: NaN or infinity trained NaN, and the error blamed the first layer
        for field in p.DESCRIPTOR.fields:
            if field.type in (field.TYPE_FLOAT, field.TYPE_DOUBLE):
                value = getattr(p, field.name)
                if isinstance(value, float) and not math.isfinite(value):     # a repeated field's: a container
                    raise SolverParamError(f"{field.name} is {value}: it must be a finite number")
        if p.average_loss < 1:
            raise SolverParamError(f"average_loss must be >= 1, got {p.average_loss}")
        if p.iter_size < 1:
            raise SolverParamError(f"iter_size must be >= 1, got {p.iter_size}")
        if p.regularization_type not in ("L1", "L2"):
            raise SolverParamError(f'unknown regularization_type "{p.regularization_type}" (L1 or L2)')
        if p.eval_type not in ("classification", "detection"):
            raise SolverParamError(f'unknown eval_type "{p.eval_type}" (classification or detection)')
        if p.ap_version not in AP_VERSIONS:
            raise SolverParamError(f'unknown ap_version "{p.ap_version}" ({", ".join(AP_VERSIONS)})')
        if p.snapshot_format != pb.SolverParameter.BINARYPROTO:
            raise SolverParamError("snapshot_format HDF5 is not supported; use BINARYPROTO (the default)")
        if p.snapshot > 0 or p.snapshot_after_train:
            if not p.HasField("snapshot_prefix"):
                raise SolverParamError("snapshot_prefix is not set (snapshots are written every `snapshot` "
                                       "iterations and after training unless snapshot_after_train is false)")
            folder = os.path.dirname(p.snapshot_prefix) or "."
            if not (os.path.isdir(folder) and os.access(folder, os.W_OK)):
                raise SolverParamError(f"cannot write to snapshot prefix '{p.snapshot_prefix}': make sure "
                                       f"that the directory '{folder}' exists and is writeable")

    def _make_net(self, net_param, state, seed, what):
        net_param.state.CopyFrom(state)
        log.info("Creating %s", what)
        train = state.phase == pb.TRAIN and what.startswith("training")
        mode = self.memory or memory_mode(self.param, net_param)     # given, the solver's, the net's, else auto
        host_params = self.param.memory_param.host_params or net_param.memory_param.host_params
        return Net(net_param, state.phase, device=self.device, stages=list(state.stage),
                   level=state.level, seed=seed, dtype=self.dtype, memory=mode,
                   host_params=host_params and train, defer=True)      # planned in _place_nets

    def _place_nets(self):
        """Plan the train net, the test nets and the history together (plan/joint.py), then bind
        them in the order the plans assume: train net, test nets; the history comes after."""
        history = self._history_bytes(self.net.graph)
        nets = [self.net] + self.test_nets
        for net in nets:            # planned again alone (a top outgrew its block), beside the others' blocks
            net.replan_reserve = partial(_others_need, net, nets)
        replanned = weakref.WeakMethod(self._replanned)
        for net in nets:
            net.replan_hooks.append(lambda: replanned() and replanned()())
        if not self.test_nets:
            hosted = self.net.host_params
            plans = [self.net.make_plan(None, [] if hosted else history, history if hosted else 0)]
        else:

            def make():
                capacity, kw = self.net.budgets()
                return plan_nets(self.net, self.test_nets, history, capacity, **kw)
            plan, test_plans = within_ram(self.device, len(self.net.graph.ops), make, plan_of=lambda made: made[0])
            plans = [plan] + list(test_plans)
        for net, p in zip(nets, plans):
            if self.test_nets:          # (a net planned alone said its line)
                log.info("%s", plan_line(p, net.memory == "auto", net.name + (" (test)" if net is not self.net
                                                                              else ""), process_memory()["rss"]))
            if net is self.net:         # what the run needs, said before binding (minutes on the largest nets)
                log.info("Memory: %s", verdict(p, net.name, net.memory == "auto", self.device.name))
            net.place(p)

    def _history_bytes(self, graph) -> list:
        return history_blocks(graph, self.rule.n_history, self.dtype)

    def _train_net(self):
        p = self.param
        given = [f for f in ("net", "net_param", "train_net", "train_net_param") if p.HasField(f)]
        if len(given) != 1:
            raise SolverParamError("the solver must give exactly one train net in net, net_param, train_net "
                                   f"or train_net_param (given: {', '.join(given) or 'none'})")
        field = given[0]
        if field.endswith("_param"):
            net_param, source = pb.NetParameter(), f"specified in {field}"
            net_param.CopyFrom(getattr(p, field))
        else:
            net_param = read_text(getattr(p, field), pb.NetParameter())
            source = f"from {field} file: {getattr(p, field)}"
        state = pb.NetState(phase=pb.TRAIN)     # solver default < the net's own state < train_state
        state.MergeFrom(net_param.state)
        state.MergeFrom(p.train_state)
        return self._make_net(net_param, state, self.seed, "training net " + source)

    def _test_nets(self):
        p = self.param
        generic = [f for f in ("net", "net_param") if p.HasField(f)]
        if len(generic) > 1:
            raise SolverParamError("give net or net_param, not both")
        n_given = len(p.test_net_param) + len(p.test_net)
        if len(p.test_iter) < n_given or (not generic and len(p.test_iter) != n_given):
            raise SolverParamError(f"test_iter must be given once per test net ({n_given} test nets, "
                                   f"{len(p.test_iter)} test_iter)")
        sources = [(q, "test_net_param") for q in p.test_net_param]
        sources += [(read_text(f, pb.NetParameter()), f"test_net file: {f}") for f in p.test_net]
        for _ in range(len(p.test_iter) - n_given):   # the train net file in TEST phase
            if p.HasField("net_param"):
                sources.append((p.net_param, "net_param"))
            else:
                sources.append((read_text(p.net, pb.NetParameter()), f"net file: {p.net}"))
        if p.test_state and len(p.test_state) != len(sources):
            raise SolverParamError(f"test_state must be unset or given once per test net "
                                   f"({len(sources)} test nets, {len(p.test_state)} test_state)")
        if sources and p.test_interval <= 0:
            raise SolverParamError("test_interval must be > 0 when there are test nets")
        nets = []
        for i, (src, what) in enumerate(sources):
            net_param = pb.NetParameter()
            net_param.CopyFrom(src)
            state = pb.NetState(phase=pb.TEST)
            state.MergeFrom(net_param.state)
            if p.test_state:
                state.MergeFrom(p.test_state[i])
            nets.append(self._make_net(net_param, state, self.seed + 1 + i, f"test net (#{i}) specified by {what}"))
        return nets

    def _share_trained_layers(self, test):
        """Caffe's ShareTrainedLayersWith: a test layer named like a train layer uses its weights (no copy)."""
        for node in test.graph.layers:
            src = self.net.params.get(node.name)
            if not node.layer.blobs or src is None:
                continue
            mine = node.layer.blobs
            if len(mine) != len(src) or any(a.shape != b.shape for a, b in zip(mine, src)):
                raise SolverParamError(
                    f'layer "{node.name}" has parameters {[b.shape for b in mine]} in the test net but '
                    f"{[b.shape for b in src]} in the train net: they cannot be shared")
            for j, b in enumerate(src):
                if mine[j].data is not b.data:
                    mine[j] = Blob(mine[j].name, b.data, mine[j].diff)

    def _replanned(self):
        """A net was planned again in the middle of a pass: the train net's parameters are new
        blobs, which the test nets use."""
        self._learnable = self._learnable_params()
        if self.update_at:
            self.update_at = mark_updates_in_backward(self.net.graph)   # (the new graph was marked)
        for net in self.test_nets:
            self._share_trained_layers(net)

    def _learnable_params(self):
        """Every parameter blob in the net's order (Caffe's learnable_params), with its multipliers;
        a parameter shared by name once, as its owner's blob with the merged multipliers (sharing.py)."""
        out, nodes = [], {n.name: n for n in self.net.graph.layers}
        for q in self.net.graph.learnable:
            node = nodes[q.layer]
            lr = q.lr_mult if node.layer.learnable else 0.0   # BatchNorm's statistics: lr_mult 0
            out.append(Param(q.layer, q.index, node.layer.blobs[q.index], self.dtype.type(lr),
                             self.dtype.type(q.decay_mult)))
        return out

    def state_arrays(self) -> list:
        """The arrays that are the training state: every parameter's data (net order), then the
        history (what data parallelism broadcasts from rank 0)."""
        return [q.blob.data for q in self._learnable] + list(self.history)

    def _alloc_history(self):
        alloc = self.net.alloc_state          # the device pool, or the host pool with host parameters
        history = [alloc(q.blob.shape, self.dtype, f"history{k}/{q.layer}[{q.index}]", spillable=True)
                   for k in range(self.rule.n_history) for q in self._learnable]
        size = max((q.blob.data.size for q in self._learnable), default=0)
        self._work = [alloc((size,), self.dtype, f"solver work {k}") for k in range(2)]
        return history

    # -- the update (SGDSolver::ApplyUpdate) ----------------------------------
    def _iteration_rates(self):
        """(the learning rate of this iteration, [(local decay, local rate)] per parameter)."""
        p, dt = self.param, self.dtype.type
        rate, self.current_step = learning_rate(p, self.iter, self.current_step)
        return rate, [(dt(p.weight_decay) * q.decay_mult, dt(rate) * q.lr_mult) for q in self._learnable]

    def _step_one(self, k, rates) -> bool:
        """Parameter k's whole update in one kernel where its rule has one (``Rule.step``)."""
        blob, (decay, local_rate) = self._learnable[k].blob, rates[k]
        return self.rule.step(blob.data, blob.diff, self.history[k::len(self._learnable)], local_rate, decay,
                              self.param.regularization_type)

    def _compute_one(self, k, rates):
        """Parameter k's update value into its diff: regularize, then its rule."""
        blob, (decay, local_rate) = self._learnable[k].blob, rates[k]
        work = [w[:blob.data.size].reshape(blob.shape) for w in self._work]
        regularize(blob.diff, blob.data, decay, self.param.regularization_type, work[0])
        self.rule.compute(blob.diff, self.history[k::len(self._learnable)], work, local_rate, self.iter)

    def _update_one(self, k, rates):
        """Parameter k's update: regularize, its rule, and Net::Update (data -= diff)."""
        if not self._step_one(k, rates):
            self._compute_one(k, rates)
            blob = self._learnable[k].blob
            blob.data -= blob.diff

    def _update_in_backward(self, op):
        """The net's update hook: the parameters whose gradients ``op`` completed."""
        for k in self.update_at.get(op.name, ()):
            self._update_one(k, self._rates[1])
            self._updated.add(k)

    def apply_update(self) -> float:
        p, dt = self.param, self.dtype.type
        rate, rates = self._rates if self._rates is not None else self._iteration_rates()
        self._rates = None
        self.lr = rate
        if p.display and self.iter % p.display == 0:
            log.info("Iteration %d, lr = %s", self.iter, _g(rate))
        if p.clip_gradients >= 0:
            diffs = [q.blob.diff for q in self._learnable]
            norm = global_norm(diffs)
            clip = dt(p.clip_gradients)
            if norm > clip:
                scale = clip / dt(norm)
                log.info("Gradient clipping: scaling down gradients (L2 norm %s > %s) by scale factor %s",
                         _g(norm), _g(clip), _g(scale))
                for d in diffs:
                    d *= scale
        n = len(self._learnable)
        if p.iter_size > 1:
            for q in self._learnable:
                q.blob.diff *= dt(1) / dt(p.iter_size)
        done, self._updated = self._updated, set()      # in backward (update_at)
        if done:
            for k in range(n):
                if k not in done:
                    self._update_one(k, rates)
            return rate

        stepped = self._step_at_locations(partial(self._step_one, rates=rates)) if self.update_streams else {}
        updated = set()
        for k in range(n):
            if stepped[k] if k in stepped else self._step_one(k, rates):
                updated.add(k)          # its data too (each parameter's update reads only its own)
                continue
            self._compute_one(k, rates)
        for k, q in enumerate(self._learnable):            # Net::Update
            if k not in updated:
                q.blob.data -= q.blob.diff
        return rate

    def _step_at_locations(self, step) -> dict:
        """{k: whether ``step(k)`` updated parameter k}, each location's parameters stepped on its
        stream (``update_streams``), the locations at once; what a rule cannot step (``Rule.step``
        false) is left to the caller, whose work buffers are one set."""
        done, events = {}, []
        for loc, stream in self.update_streams.items():
            ks = [k for k, where in enumerate(self._locations) if where == loc]
            events.append(stream.submit(lambda ks=ks: done.update((k, step(k)) for k in ks)))
        for e in events:
            e.wait()
        return done

    # -- the loop (Solver::Step, Solve) ---------------------------------------
    def _forward(self, net, index, backward):
        if self.feed is not None:
            self.feed(net, index)
        with np.errstate(all="ignore"):     # a non-finite loss is reported below, by layer
            loss = net.forward()
        if not math.isfinite(loss):
            raise TrainingError(self._nonfinite_message(net, loss))
        if backward:
            with np.errstate(all="ignore"):
                net.backward()
        return loss

    def _update_smoothed_loss(self, loss, start_iter):
        n = self.param.average_loss
        if len(self._losses) < n:
            self._losses.append(loss)
            size = len(self._losses)
            self.smoothed_loss = (self.smoothed_loss * (size - 1) + loss) / size
        else:
            idx = (self.iter - start_iter) % n
            self.smoothed_loss += (loss - self._losses[idx]) / n
            self._losses[idx] = loss

    def step(self, iters: int) -> None:
        p = self.param
        start_iter, stop_iter = self.iter, self.iter + iters
        self._losses, self.smoothed_loss = [], 0.0
        pace = Pace(start_iter, stop_iter, self.images_per_iter)
        while self.iter < stop_iter:
            self.net.clear_param_diffs()
            if (self.is_root and p.test_interval and self.iter % p.test_interval == 0
                    and (self.iter > 0 or p.test_initialization)):
                self.test_all()
                if self._stop and self.sync_requests is None:   # else all ranks stop after this iteration
                    break
            display = p.display and self.iter % p.display == 0
            if self.update_at:
                self._rates, self._updated = self._iteration_rates(), set()
            loss = 0.0
            for _ in range(p.iter_size):
                loss += self._forward(self.net, self.iter, backward=True)
            loss /= p.iter_size
            self._update_smoothed_loss(loss, start_iter)
            if display:
                log.info("Iteration %d %s, loss = %s", self.iter, pace.mark(self.iter), _g(self.smoothed_loss))
                self._log_outputs(self.net, "Train", self._outputs(self.net))
            if self.before_update is not None:
                self.before_update()
            with np.errstate(all="ignore"):     # non-finite parameters: the next forward reports them
                rate = self.apply_update()
            self.iter += 1
            for fn in self.callbacks:
                fn(self.iter, self.smoothed_loss, rate)
            if self.sync_requests is not None:
                self._stop, self._snapshot_now = self.sync_requests(self._stop, self._snapshot_now)
            if (p.snapshot and self.iter % p.snapshot == 0) or self._snapshot_now:
                self._snapshot_now = False
                self.snapshot()
            if self._stop:
                break

    def solve(self, resume_file=None) -> None:
        p = self.param
        log.info("Solving %s", self.net.name)
        log.info("Learning Rate Policy: %s", p.lr_policy)
        self._stop = False
        if self.is_root and p.snapshot_prefix:
            clean_snapshots(p.snapshot_prefix)      # what a killed snapshot left behind
        if resume_file:
            log.info("Restoring previous solver status from %s", resume_file)
            self.restore(resume_file)
        start_iter = self.iter
        try:
            self.step(p.max_iter - self.iter)
        except DataReadError as e:
            raise DataReadError(f"{e}{self._snapshot_after_data_error(start_iter)}") from None
        if (p.snapshot_after_train or self._stop) and (not p.snapshot or self.iter % p.snapshot != 0):
            self.snapshot()
        if self._stop:
            log.info("Optimization stopped early.")
            return
        # Caffe's one extra forward pass after the last update, to display the final loss.
        if p.display and self.iter % p.display == 0:
            loss = self._forward(self.net, self.iter, backward=False)
            self._update_smoothed_loss(loss, start_iter)
            log.info("Iteration %d, loss = %s", self.iter, _g(self.smoothed_loss))
        if self.is_root and p.test_interval and self.iter % p.test_interval == 0:
            self.test_all()
        log.info("Optimization Done.")

    def request_stop(self) -> None:
        self._stop = True

    def request_snapshot(self) -> None:
        self._snapshot_now = True

    # -- testing (Solver::TestAll, Test) --------------------------------------
    def test_all(self):
        for i in range(len(self.test_nets)):
            if self._stop:
                break
            self.test(i)
        return self.test_scores

    def test(self, i: int = 0) -> "OrderedDict":
        """Mean of every output blob of test net ``i`` over test_iter batches; also in ``test_scores[i]``."""
        net = self.test_nets[i]
        log.info("Iteration %d, Testing net (#%d)", self.iter, i)
        self._share_trained_layers(net)
        try:
            return self._test(i, net)
        finally:
            net.executor.reset()    # the blocks a forward leaves go back: the train net's plan needs them

    def _test(self, i, net):
        p = self.param
        n_iter = p.test_iter[i]
        sums, loss = None, 0.0
        detections = OrderedDict() if p.eval_type == "detection" else None
        for k in range(n_iter):
            if self._snapshot_now:
                self._snapshot_now = False
                self.snapshot()
            if self._stop:
                log.info("Test interrupted.")
                return self.test_scores[i]
            if self.feed is not None:
                self.feed(net, k)
            iter_loss = net.forward()
            if p.test_compute_loss:
                loss += iter_loss
            outs = self._outputs(net)
            if detections is not None:
                self._add_detections(net, outs, detections)
                continue
            if sums is None:     # summed in the net's dtype, as Caffe's Dtype test_score
                sums = OrderedDict((name, np.array(v, dtype=self.dtype)) for name, v in outs.items())
            else:
                for name, v in outs.items():
                    sums[name] += v
        if p.test_compute_loss:
            log.info("Test loss: %s", _g(loss / n_iter))
        if detections is not None:
            return self._detection_scores(i, detections)
        means = OrderedDict((name, s / self.dtype.type(n_iter)) for name, s in (sums or {}).items())
        self._log_outputs(net, "Test", means)
        self.test_scores[i] = OrderedDict((k, float(v.ravel()[0]) if v.size == 1 else v) for k, v in means.items())
        return self.test_scores[i]

    @staticmethod
    def _add_detections(net, outs, detections):
        """eval_type detection: each output holds DetectionEvaluate's rows (..., 5)."""
        for name, v in outs.items():
            if net.blobs[name].data.shape[-1:] != (5,):
                raise SolverParamError(f'eval_type "detection": test net output "{name}" has shape '
                                       f"{tuple(net.blobs[name].data.shape)}; it must be DetectionEvaluate's rows "
                                       "(1, 1, n, 5)")
            detections.setdefault(name, DetectionScores()).add(v)

    def _detection_scores(self, i, detections) -> "OrderedDict":
        """The mean average precision of each output, logged as the fork's TestDetection does."""
        scores = OrderedDict()
        for k, (name, found) in enumerate(detections.items()):
            scores[name], per_class = found.mean_ap(self.param.ap_version)
            if self.param.show_per_class_result:
                for label, ap in per_class.items():
                    log.info("class%d: %s", label, _g(ap))
            log.info("    Test net output #%d: %s = %s", k, name, _g(scores[name]))
        self.test_scores[i] = scores
        return scores

    @staticmethod
    def _outputs(net) -> "OrderedDict":
        """Output blobs as host arrays, in Caffe's order (a std::set: sorted by name)."""
        return OrderedDict((name, _host(net.blobs[name].data).ravel()) for name in sorted(net.outputs))

    @staticmethod
    def _log_outputs(net, which, outputs):
        weights = {t.name: w for node in net.graph.layers for w, t in zip(node.loss_weights, node.tops)}
        outputs, weights = _replicas_as_one(outputs, weights)
        idx = 0
        for name, values in outputs.items():
            w = weights.get(name, 0.0)
            values = np.asarray(values).ravel()
            for v in values[:MAX_LOGGED]:
                extra = f" (* {_g(w)} = {_g(w * float(v))} loss)" if w else ""
                log.info("    %s net output #%d: %s = %s%s", which, idx, name, _g(v), extra)
                idx += 1
            if len(values) > MAX_LOGGED:        # Caffe prints every element: 1000 lines for a classifier
                log.info("    %s net output #%d-#%d: %s: %d more values (of %d: min %s, mean %s, max %s)",
                         which, idx, idx + len(values) - MAX_LOGGED - 1, name, len(values) - MAX_LOGGED,
                         len(values), _g(values.min()), _g(values.mean(dtype=np.float64)), _g(values.max()))
                idx += len(values) - MAX_LOGGED

    def _snapshot_after_data_error(self, start_iter) -> str:
        """Keep the iterations trained before a data layer failed: the last update is complete."""
        if not (self.is_root and self.param.snapshot_prefix) or self.iter == start_iter or (
                self.last_snapshot and self.last_snapshot[1].endswith(f"_iter_{self.iter}.solverstate")):
            return self._kept()
        try:
            self.snapshot()
        except Exception as e:  # noqa: BLE001 - the data error is the one to report
            return f"; no snapshot could be written either ({e})"
        return f"; training up to iteration {self.iter} is kept in the snapshot {self.last_snapshot[1]}"

    # -- non-finite values ----------------------------------------------------
    def _nonfinite_message(self, net, loss) -> str:
        msg = f"iteration {self.iter}: the {'train' if net is self.net else 'test'} net's loss is {loss}"
        bad = next(((node, top) for node in net.graph.layers for top in node.top_blobs
                    if not np.isfinite(_host(top.data)).all()), None)
        if bad:
            node, top = bad
            writers = [n.name for n in net.graph.layers if top.name in (t.name for t in n.tops)]
            inplace = f", written in place by {', '.join(writers[1:])}" if len(writers) > 1 else ""
            params = " (its parameters are non-finite too)" if any(
                not np.isfinite(_host(b.data)).all() for b in node.layer.blobs) else ""
            msg += (f'; layer "{node.name}" ({node.type}) is the first whose output went non-finite '
                    f'(top "{top.name}"{inplace}){params}')
        return msg + self._kept()

    def _kept(self) -> str:
        if self.last_snapshot:
            return f"; the last good snapshot is {self.last_snapshot[1]}"
        return "; no snapshot was written"

    # -- snapshots (Solver::Snapshot, SGDSolver::SnapshotSolverState) ---------
    def _filename(self, ext) -> str:
        return f"{self.param.snapshot_prefix}_iter_{self.iter}{ext}"

    def snapshot(self):
        """Write <prefix>_iter_N.caffemodel and .solverstate; refuse to write non-finite parameters.
        Only rank 0 of a data-parallel job writes (the others return None)."""
        if not self.is_root:
            return None
        for q in self._learnable:
            if not bool(array_module(q.blob.data).isfinite(q.blob.data).all()):
                raise TrainingError(f'iteration {self.iter}: parameter {q.index} of layer "{q.layer}" went '
                                    "non-finite in the update; not writing a snapshot" + self._kept())
        model, path = self._filename(".caffemodel"), self._filename(".solverstate")
        log.info("Snapshotting to binary proto file %s", model)
        log.info("Snapshotting solver state to binary proto file %s", path)
        # SolverState in field order (iter, learned_net, history..., current_step, sncaffe's layer
        # states), a blob at a time; both files are written before either takes its name.
        head = pb.SolverState(iter=self.iter, learned_net=model).SerializeToString()
        tail = pb.SolverState(current_step=self.current_step,
                              layer_state=layer_states(self._resume_nets())).SerializeToString()
        blobs = (blobproto.field(3, blobproto.from_array(_host(h))) for h in self.history)
        write_pair(model, self.net.proto_chunks(write_diff=self.param.snapshot_diff),
                   path, itertools.chain([head], blobs, [tail]), kept=self._kept())
        self.last_snapshot = (model, path)
        return model, path

    def _resume_nets(self) -> dict:
        return {"train": self.net, **{f"test#{i}": net for i, net in enumerate(self.test_nets)}}

    def restore(self, path) -> None:
        """Resume from a .solverstate (and the .caffemodel it names); checked fully before anything changes."""
        path = Path(path)
        if path.suffix == ".h5":
            raise SnapshotError(f"{path}: HDF5 solver states are not supported (snapshot_format BINARYPROTO)")
        state = blobproto.read_binary(path, pb.SolverState())
        history = self._check_history(state, path)
        model = None
        if isinstance(state.learned_net, bytes):     # protobuf hands back a string that is not UTF-8 as bytes
            raise SnapshotError(f"{path}: its learned_net is not a file name (not UTF-8 text)")
        if state.learned_net:
            model_path = self._find_learned_net(state.learned_net, path)
            model = blobproto.read_caffemodel(model_path)
            self._check_model(model, model_path)
        if model is not None:
            try:
                self.net.copy_from(model)
            except ValueError as e:
                raise SnapshotError(f"{model_path}: {e}") from None
        log.info("%sSolver: restoring history", self.rule.type)
        for h, a in zip(self.history, history):
            h[...] = a
        self.iter, self.current_step = state.iter, state.current_step
        if state.layer_state:       # sncaffe's: data cursors and random streams (Caffe's files have none)
            restore_layer_states(self._resume_nets(), state.layer_state, str(path))

    @staticmethod
    def _find_learned_net(name, state_path) -> Path:
        tried = [Path(name), state_path.parent / name, state_path.parent / Path(name).name]
        for p in tried:
            if p.is_file():
                return p
        raise SnapshotError(f"{state_path}: its learned_net {name} is not found (looked for "
                            + ", ".join(str(p) for p in dict.fromkeys(tried)) + ")")

    def _check_history(self, state, path):
        n, need = len(self._learnable), len(self.history)
        out = []
        for k, blob in enumerate(state.history[:need]):
            q = self._learnable[k % n]
            try:
                a = blobproto.to_array(blob, self.dtype)
            except ValueError as e:
                raise SnapshotError(f"{path}: history blob {k}: {e}") from None
            if a.shape != q.blob.shape:
                if a.size == q.blob.data.size and blob.HasField("num"):
                    a = a.reshape(q.blob.shape)       # legacy 4-D shapes
                else:
                    raise SnapshotError(f"{path}: history blob {k} has shape {a.shape}, but parameter {q.index} "
                                        f'of layer "{q.layer}" has shape {q.blob.shape}: the state is from a '
                                        "different net")
            out.append(a)
        if len(state.history) != need:
            per = self.rule.n_history
            hint = ("a solver of another type" if len(state.history) % n == 0 and len(state.history)
                    else "a different net")
            raise SnapshotError(f"{path}: holds {len(state.history)} history blobs, but {self.rule.type} on this "
                                f"net needs {need} ({per} per learnable parameter, {n} parameters): it was "
                                f"written by {hint}")
        return out

    def _check_model(self, model, path) -> None:
        """The snapshot's layers with parameters must be exactly the net's: name, count and shapes."""
        in_file = OrderedDict((lp.name, lp) for lp in model.layer if lp.blobs)
        in_net = OrderedDict((node.name, node) for node in self.net.graph.layers if node.layer.blobs)
        for name, node in in_net.items():
            lp = in_file.get(name)
            if lp is None:
                raise SnapshotError(f'{path}: layer "{name}" ({node.type}) of the net has no parameters in the '
                                    "file: the snapshot is from a different net")
            shapes = [blobproto.blob_shape(b) for b in lp.blobs]
            mine = [b.shape for b in node.layer.blobs]
            legacy = [b.HasField("num") and math.prod(s) == math.prod(m)    # old 4-D shapes
                      for b, s, m in zip(lp.blobs, shapes, mine)]
            if len(shapes) != len(mine) or any(s != m and not ok for s, m, ok in zip(shapes, mine, legacy)):
                raise SnapshotError(f'{path}: layer "{name}" has parameters {shapes} in the file but {mine} '
                                    "in the net: the snapshot is from a different net")
        extra = [name for name in in_file if name not in in_net]
        if extra:
            raise SnapshotError(f'{path}: layer "{extra[0]}" ({in_file[extra[0]].type}) has parameters in the '
                                "file but is not in the net: the snapshot is from a different net")
