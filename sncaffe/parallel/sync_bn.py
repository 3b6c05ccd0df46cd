"""Cross-replica BatchNorm: the replicas of a BatchNorm layer normalize with the statistics of the
whole batch, as one location does, by exchange operators of the graph (Purine's way).

One location's training BatchNorm (layers/normalization.py) reduces over the
batch in three stages: per-image sums of x; mean, x - mean and per-image sums
of its squares; variance and normalization. Backward: per-image sums of dy
and dy * x_norm; dx. Between two stages the per-image sums are added image
after image. ``CrossReplicaBatchNorm`` splits each replica's forward and
backward operator at those points (``split_op``, runtime/parts.py): after the
last replica's stage, an exchange operator on the ``exchange`` stream of the
first location (its own worker: never queued behind a gradient sum on
``comm``) adds every replica's per-image sums in location order, which is
image order (``replicate`` cuts the batch in location order), and the next
stage of every replica waits for its event. So the replicas compute the bits
of one location at the summed batch: the same batch sums in the same order,
the same mean, variance and running statistics on every replica.

Forward: 2 exchanges per layer (the mean is needed before the squares are
summed: the two-pass variance one location computes), backward: 1. In one
process it needs the dispatcher's workers (several CPU locations): a
replica's next stage waits for an exchange that is issued with the last
replica's operator.

Over MPI ranks (``rank_batch_norms``, data_parallel.py) each rank has one
replica and the exchange is an all-gather of the per-image sums on the rank's
``compute`` stream (its calling thread, between the two stages it joins),
over a communicator of its own (so its collectives keep their order on every
rank apart from the gradient all-reduces on ``comm``, and never queue behind
one), added in rank order: a rank's shard is the
rank-th part of the global batch, so N ranks at B compute the batch
statistics of one process at N*B to the bit.
"""
from __future__ import annotations

import numpy as np

from ..layers.normalization import sum_over_images
from ..runtime.parts import Later, Part

STAGES = {"forward": ("sums", "center", "normalize"), "backward": ("grad sums", "grad input")}
SUMMED = {"forward": ("batch sums", "batch squares"), "backward": ("gradient sums",)}


class _Pass:
    """One forward or backward pass of the group: the events of each stage, the exchanges'."""

    def __init__(self, kind, name):
        n = len(STAGES[kind])
        self.done = [[] for _ in range(n)]          # stage k's events, replicas in issue order
        self.exchanged = [Later(f"the exchange of {name}'s {what}") for what in SUMMED[kind]]
        self.issued = set()                         # replicas whose operator is issued


class CrossReplicaBatchNorm:
    """The replicas (``nodes``, in location order) of one training BatchNorm layer, reducing their
    batch statistics together (see the module's doc)."""

    def __init__(self, name, nodes, gather=None, ranks=1, stream="exchange"):
        self.name, self.nodes, self.stream = name, list(nodes), stream
        self.layers = [n.layer for n in self.nodes]
        self.gather = gather        # over processes: this rank's per-image sums -> every rank's, in rank order
        first = self.layers[0]
        if any(layer.use_global_stats for layer in self.layers):
            raise ValueError(f"{name}: a BatchNorm with global statistics has no batch to reduce")
        count = sum(layer.view[0] for layer in self.layers) * first.view[2] * ranks
        dtype = first.blobs[0].data.dtype
        self.totals = np.zeros((2, first.view[1]), dtype)      # the reduced sums (C,) of this exchange
        self.location = first.param.location                  # exchanges on its stream ``stream``
        self._passes = {}
        # set on the replica's worker just before its forward (backward), which then runs its
        # first stage only (and clears it)
        self._arms = [lambda layer=layer: setattr(layer, "first_stage", True) for layer in self.layers]
        for i, layer in enumerate(self.layers):
            layer.count = count                     # the replicas' batch: its mean and unbiased variance
            layer.sync = self
            layer.split_op = lambda kind, recompute, i=i: self.split(i, kind, recompute)

    def detach(self):
        for layer in self.layers:
            layer.count = layer.view[0] * layer.view[2]
            layer.sync = None
            layer.__dict__.pop("split_op", None)
            layer.first_stage = False

    # -- the parts of replica i's operator (the dispatcher asks, in issue order) --------
    def split(self, i, kind, recompute):
        node = self.nodes[i]
        if recompute or kind not in STAGES or (kind == "backward" and not node.propagate_down[0]):
            return None         # a replay uses the kept statistics; no dx wanted: nothing to reduce
        p = self._passes.get(kind)
        if p is None or i in p.issued:          # (a replica again: the last pass was cut short by an error)
            p = self._passes[kind] = _Pass(kind, self.name)
        p.issued.add(i)
        last = len(p.issued) == len(self.nodes)
        if last:
            del self._passes[kind]              # the next pass starts afresh
        stages = STAGES[kind]
        parts = [Part(issued=p.done[0].append, arm=self._arms[i])]     # its operator: the first stage only
        for k in range(1, len(stages)):
            if last:
                parts.append(Part(f"exchange {self.name}'s {SUMMED[kind][k - 1]}", self._exchange(kind, k - 1),
                                  stream=self.stream, location=self.location, touches=False, after=p.done[k - 1],
                                  issued=p.exchanged[k - 1].bind))
            parts.append(Part(f"{node.name}:{kind} {stages[k]}", self._stage(i, kind, k),
                              after=[p.exchanged[k - 1]], issued=p.done[k].append))
        return parts

    def _exchange(self, kind, k):
        """The exchange after stage k: every replica's per-image sums added in image order."""
        layers, totals, gather = self.layers, self.totals, self.gather

        rows = (k,) if kind == "forward" else (0, 1)        # forward: one sum; backward: both at once

        def run():
            if gather is None:
                for j in rows:
                    sum_over_images([layer.scratch["partials"][j] for layer in layers], totals[j])
                return
            every = gather(layers[0].scratch["partials"][rows[0]:rows[-1] + 1])     # (ranks, rows, N, C)
            for r, j in enumerate(rows):
                sum_over_images(every[:, r], totals[j])
        return run

    def _stage(self, i, kind, k):
        node, layer, totals = self.nodes[i], self.layers[i], self.totals
        if kind == "backward":
            return lambda: layer.grad_input(node.top_blobs, node.bottom_blobs, totals[0], totals[1])
        if k == 1:
            return lambda: layer.center(node.bottom_blobs, totals[0])
        return lambda: layer.normalize(node.top_blobs, totals[1])


def cross_replica_batch_norms(net, groups, locations) -> list:
    """One ``CrossReplicaBatchNorm`` for each replicated training BatchNorm of ``net`` (``groups``:
    layer name -> {location: node}); none where the dispatcher has no workers or a replica is not
    on the CPU (they keep per-replica statistics)."""
    out = []
    for base, reps in groups.items():
        nodes = [reps[loc] for loc in locations if loc in reps]
        if nodes[0].type != "BatchNorm" or nodes[0].layer.use_global_stats:
            continue
        if not net.executor.threaded or any("partials" not in n.layer.scratch_specs for n in nodes):
            return []
        out.append(CrossReplicaBatchNorm(base, nodes))
    return out


def rank_batch_norms(net, comm) -> list:
    """One ``CrossReplicaBatchNorm`` for each training BatchNorm of this rank's ``net``: the batch
    statistics of all ranks (an MPI all-gather of the per-image sums, in rank order).

    The all-gathers run on a communicator of their own: on the comm stream they would queue behind
    a gradient bucket's all-reduce, and the BatchNorm's next stage, and so backward, would wait for
    that bucket (measured: a CIFAR ResNet's all-reduce hid 0 % of itself behind backward).
    Collectives of two threads on one communicator could also be matched in different orders on
    different ranks; on two communicators each keeps its order. They run on the compute stream,
    the calling thread, which waits for the all-gather anyway: a stream of their own would wake and
    wait for a thread at every BatchNorm stage (``tools/bench_parallel.py`` shows the difference)."""
    size = comm.Get_size()
    nodes = [node for node in net.graph.layers if node.type == "BatchNorm" and not node.layer.use_global_stats
             and "partials" in node.layer.scratch_specs]
    if not nodes:
        return []
    own = comm.Dup()           # collective: every rank builds the same groups at the same point

    def gather(local):
        local = np.ascontiguousarray(local)
        out = np.empty((size,) + local.shape, local.dtype)
        # blocking: the layer's next stage waits for it, and MPI waits without the GIL (polling a
        # request from Python would take the GIL from the compute thread)
        own.Allgather(local, out)
        return out
    return [CrossReplicaBatchNorm(node.name, [node], gather, size, "compute") for node in nodes]
