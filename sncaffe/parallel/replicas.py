"""Data parallelism inside one process, Purine's way: the net replicated over locations, gradients
summed by operators of the graph.

``replicate(param, locations)`` rewrites a NetParameter: the layers without
bottoms (data, Input) stay once, at the default location, and a Slice cuts
each of their tops along the batch into one part per location; every other
layer is repeated at each location (``name@location``, its blobs likewise),
reading that location's part. Copy operators then carry each part to its
location (``prepare_net``), so the replicas run concurrently, each on its
location's worker. Loss weights are divided by the number of replicas: the
net's loss is the mean over the whole batch, as one location would compute it.

``Replicas(solver)`` (the train net built from such a parameter) makes the
replicas start from the weights the unreplicated net gets from the solver's
seed (``fresh=False``: from replica 0's; ``weights``: an unreplicated
net's .caffemodel, by layer name) and inserts, after the last backward
operator of each layer's replicas, a summing operator: it adds the replicas'
gradients of that layer (in location order) and writes the sum into every
replica, on the comm stream of the first location, while backward goes on.
Each replica then applies the same update to the same weights, so they stay
equal to the bit, each on its own location's worker with the replicas at once
(``Solver.update_streams``), as Purine's update operators run where their
weights are. The result is that of one location at the summed batch up
to float summation order: one location sums a parameter's gradient over the
whole batch in one GEMM, the replicas in parts, then across parts.

A training BatchNorm normalizes with the statistics of the whole batch, not
of its replica's part: its replicas exchange per-image sums through operators
of the graph (``CrossReplicaBatchNorm``, sync_bn.py) and compute one
location's bits, running statistics included. (Where the dispatcher has no
workers, a GPU's replicas, each replica keeps its own batch statistics, as in
Caffe's multi-GPU training.)
"""
from __future__ import annotations

import logging
import zlib

import numpy as np

from ..proto import sncaffe_pb2 as pb
from .data_parallel import insert_allreduce
from .sync_bn import cross_replica_batch_norms

log = logging.getLogger("sncaffe")


def replica_name(name: str, location: str) -> str:
    return f"{name}@{location}"


def replicate(param, locations) -> "pb.NetParameter":
    """``param`` with its computation repeated at every location of ``locations`` (see the module's doc)."""
    locations = list(locations)
    if len(locations) < 2 or len(set(locations)) != len(locations):
        raise ValueError(f"replicate needs two or more distinct locations, got {locations}")
    n = len(locations)
    out = pb.NetParameter()
    out.CopyFrom(param)
    del out.layer[:]
    data_tops = set()
    for layer in param.layer:
        if layer.location:
            raise ValueError(f'layer "{layer.name}" is placed at "{layer.location}": a replicated net '
                             "places its layers itself")
        if not layer.bottom:
            out.layer.add().CopyFrom(layer)
            for top in layer.top:
                data_tops.add(top)
                cut = out.layer.add(name=f"{top}_replicas", type="Slice", bottom=[top],
                                    top=[replica_name(top, loc) for loc in locations])
                cut.slice_param.axis = 0
                for rule in layer.include:
                    cut.include.add().CopyFrom(rule)
                for rule in layer.exclude:
                    cut.exclude.add().CopyFrom(rule)
            continue
        weights = list(layer.loss_weight)
        if not weights and layer.type.endswith("Loss"):     # Caffe's default: 1 on a loss layer's first top
            weights = [1.0] + [0.0] * (len(layer.top) - 1)
        for loc in locations:
            rep = out.layer.add()
            rep.CopyFrom(layer)
            rep.name, rep.location = replica_name(layer.name, loc), loc
            rep.bottom[:] = [replica_name(b, loc) for b in layer.bottom]
            rep.top[:] = [replica_name(t, loc) for t in layer.top]
            if weights:
                rep.loss_weight[:] = [w / n for w in weights]
            for spec in rep.param:
                if spec.name:                  # shared parameters: shared within a replica
                    spec.name = replica_name(spec.name, loc)
    return out


def _renamed(weights, groups, location):
    """A caffemodel's layers renamed to their replicas at ``location``."""
    from .. import blobproto
    src = weights if isinstance(weights, pb.NetParameter) else blobproto.read_caffemodel(weights)
    out = pb.NetParameter()
    out.CopyFrom(src)
    for lp in out.layer:
        if lp.name in groups:
            lp.name = replica_name(lp.name, location)
    return out


class ReplicaSum:
    """The operator summing one layer's gradients over the replicas (a ``collective`` instruction)."""
    kind = "collective"
    timeout = None

    def __init__(self, owner, name, layers, slots):
        self.owner, self.layers = owner, layers       # the replicas' layer names
        self.name = f"sum of {name}'s gradients"
        self.slots = slots                                  # [replica][param] -> graph diff tensor
        self.tensors = [t for rep in slots for t in rep]
        self.location = slots[0][0].location
        self.nbytes = sum(t.nbytes for t in self.tensors)

    def before(self, ready=None):
        return None

    def run(self, arrays, token=None):
        if not self.owner.last_pass(self):
            return
        n, per = len(self.slots), len(self.slots[0])
        for j in range(per):
            total = arrays[j]               # summed in place in the first replica's gradient (a
            for k in range(1, n):           # pool block), in replica order, then copied to the others
                total += arrays[k * per + j]
            for k in range(1, n):
                np.copyto(arrays[k * per + j], total)

    def timed_out(self):
        return TimeoutError(f"{self.name} did not finish")

    def __repr__(self):
        return self.name


def _share_cores(n):
    """The replicas' workers compute at once: where nobody chose the thread budget (no --threads,
    no OMP/MKL/OPENBLAS_NUM_THREADS), each gets its share of the cores, as a rank does. With the
    whole budget each worker's oneDNN and MKL calls ran teams of all the cores, two workers
    oversubscribed them, and a CIFAR ResNet's replicas ended 10 iterations at a different loss
    from one run to the next (docs/parallel.md). Returns the decision it replaced (to restore),
    or None."""
    from ..backend import threads
    from ..backend import runtimes
    before = threads.current()
    if before.source != "cores" or before.share >= n:
        return None
    log.info("CPU threads: %s", runtimes.configure(None, n, "replicas").describe())
    return before


class Replicas:
    """Equal starting weights and the summing operators for a solver whose train net is replicated."""

    def __init__(self, solver, locations=None, fresh=True, weights=None):
        self.solver, self.net = solver, solver.net
        self.iter_size = max(1, solver.param.iter_size)
        groups = {}                         # original layer -> {location: node}
        for node in self.net.graph.layers:
            base, at, loc = node.name.rpartition("@")
            if at and node.layer.blobs:
                groups.setdefault(base, {})[loc] = node
        if not groups:
            raise ValueError("the train net has no replicated layers with parameters (build it with replicate())")
        self.locations = locations or sorted({loc for g in groups.values() for loc in g})
        if fresh:           # the weights the unreplicated layers get (Net.init_params: seed and layer name)
            for base, reps in groups.items():
                reps[self.locations[0]].layer.init_params(np.random.default_rng(
                    np.random.SeedSequence([solver.seed, zlib.crc32(base.encode())])))
        if weights is not None:     # an unreplicated net's .caffemodel, by layer name, into replica 0
            self.net.copy_from(_renamed(weights, groups, self.locations[0]))
        self.ops = []
        for base, reps in groups.items():
            nodes = [reps[loc] for loc in self.locations]
            for node in nodes[1:]:          # every replica starts from replica 0's weights
                for src, dst in zip(nodes[0].layer.blobs, node.layer.blobs):
                    np.copyto(dst.data, src.data)
            need = nodes[0].param_need_backward
            slots = [[d for (_, d), keep in zip(node.params, need) if keep] for node in nodes]
            if slots[0]:
                self.ops.append(ReplicaSum(self, base, {node.name for node in nodes}, slots))
        self.instructions = insert_allreduce(self.net.plan.schedule, self.ops)
        executor = self.net.executor
        self._threads = None
        if getattr(executor, "threaded", False):    # each replica's update on its own location's worker
            solver.update_streams = {loc: executor.stream(loc, "compute") for loc in self.locations}
            self._threads = _share_cores(len(self.locations))
        self.batch_norms = cross_replica_batch_norms(self.net, groups, self.locations)
        bn = sum(1 for g in groups.values() if next(iter(g.values())).type == "BatchNorm")
        if bn and not self.batch_norms:
            log.warning("BatchNorm keeps per-replica batch statistics: cross-replica BatchNorm needs the "
                        "dispatcher's workers (replicas on CPU locations)")
        self._seen, self._pass = 0, 0
        log.info("Data parallel in one process: %d replicas at %s, %d summing operators, %d cross-replica "
                 "BatchNorm layers", len(self.locations), ", ".join(self.locations), len(self.ops),
                 len(self.batch_norms))

    def last_pass(self, op) -> bool:
        """Whether this pass is the last of an iteration (its gradients complete); counts passes."""
        last = self._pass % self.iter_size == self.iter_size - 1
        self._seen += 1
        if self._seen == len(self.ops):
            self._seen, self._pass = 0, self._pass + 1
        return last

    def close(self) -> None:
        self.net.executor.synchronize()
        self.solver.update_streams = None
        if self._threads is not None:       # the budget as it was before the replicas
            from ..backend import runtimes
            runtimes.configure(None, self._threads.share, self._threads.shared_by)
            self._threads = None
        for group in self.batch_norms:
            group.detach()
        backward = self.net.plan.schedule.backward
        backward[:] = [ins for ins in backward if not any(ins is x for x in self.instructions)]
