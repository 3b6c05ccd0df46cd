"""Data parallelism: one process per device, gradients averaged over the ranks by operators of the graph.

``DataParallel(solver, comm)`` joins a Solver to the other ranks of an MPI
job (every rank builds the same solver and calls ``solve()``). It is process
set-up plus one graph pass:

- rank 0's training state (``solver.state_arrays()``) and iteration are
  broadcast, so all ranks start from the same weights (whatever their seeds);
- each data layer and the solver's feed take this rank's shard: of every
  global batch of N*B records, rank r keeps records [r*B, (r+1)*B), so N
  ranks at batch B see exactly what one process sees at batch N*B;
- the pass (``insert_allreduce``) puts one all-reduce operator per gradient
  bucket into the train net's backward schedule, right after the last
  backward operator that produces one of its gradients. The dispatcher runs
  it on the comm stream once those gradients' events have fired, while
  backward goes on; whatever touches the gradients next (an offload, the
  update at the end of the pass) waits for its event. With iter_size > 1 it
  all-reduces only in the last pass of an iteration;
- a training BatchNorm normalizes with the statistics of the global batch:
  the ranks all-gather their per-image sums on the exchange stream, over a
  communicator of their own (``rank_batch_norms``, sync_bn.py), so its
  statistics are one process's;
- only rank 0 tests and snapshots (``solver.is_root``); stop and snapshot
  requests (signals) are agreed by all ranks after each iteration
  (``solver.sync_requests``).

No hook of the solver or the net is replaced. Every MPI call after start-up
is made on the comm stream, one at a time.
"""
from __future__ import annotations

import logging
import zlib

import numpy as np

from ..plan.schedule import Instr
from .buckets import BUCKET_BYTES, describe, make_buckets
from .mpi import MPIReducer, allreduce_max
from .sync_bn import rank_batch_norms

log = logging.getLogger("sncaffe")
TIMEOUT = 1800.0        # seconds a rank waits for the others in a collective before giving up


class CommTimeout(RuntimeError):
    """Another rank did not join a collective in time: it stopped or is stuck."""


def comm_timeout(name, timeout) -> CommTimeout:
    return CommTimeout(f"{name} did not finish within {timeout:g} s: another rank has stopped "
                       "or is stuck (the limit is --comm-timeout)")


class AllReduce:
    """The all-reduce operator of one bucket (a ``collective`` instruction's op): it writes the
    bucket's gradients in place, on the comm stream of their location."""
    kind = "collective"

    def __init__(self, parallel, bucket):
        self.parallel, self.bucket = parallel, bucket
        self.name = f"all-reduce {bucket.name}"
        self.layers = bucket.layers
        self.tensors = [s.diff for s in bucket.slots]
        self.location = self.tensors[0].location
        self.nbytes = bucket.nbytes
        self.timeout = parallel.timeout

    def before(self, ready=None):
        """On the issuing thread. ``ready``: the gradients' arrays when their producers have run
        (the dispatcher computes on this thread), so the all-reduce can start here."""
        return self.parallel.before(self, ready)

    def run(self, arrays, token=None):
        self.parallel.reduced(self, arrays, token)

    def timed_out(self) -> CommTimeout:
        return comm_timeout(self.name, self.timeout)

    def __repr__(self):
        return self.name


def insert_allreduce(schedule, ops) -> list:
    """The graph pass: each all-reduce operator into ``schedule.backward`` right after the last
    backward operator of a layer of its bucket. Returns the instructions inserted."""
    where = {}
    for k, ins in enumerate(schedule.backward):
        if ins.kind == "run" and ins.op.kind == "backward" and not ins.recompute:
            where[ins.op.node.name] = k
    placed = []
    for i, op in enumerate(ops):
        missing = sorted(op.layers - set(where))
        if missing:
            raise ValueError(f"data parallel: layer {missing[0]} has gradients but no backward operator")
        placed.append((max(where[name] for name in op.layers), i, Instr("collective", op=op)))
    for k, _, ins in sorted(placed, key=lambda x: x[:2], reverse=True):   # after the same op: in ops' order
        schedule.backward.insert(k + 1, ins)
    return [ins for _, _, ins in placed]


def _host(a):
    return a.get() if hasattr(a, "get") else a


def make_reducer(comm, device):
    """NCCL between GPUs where CuPy has it, else MPI through host memory."""
    from .nccl import NCCLReducer, nccl_usable
    if nccl_usable(device):
        return NCCLReducer(comm, device)
    if str(getattr(device, "name", "")).startswith("cuda"):
        log.warning("NCCL is not available to CuPy (pip install nvidia-nccl-cu12 or -cu13): gradients are "
                    "all-reduced by MPI through host memory")
    return MPIReducer(comm, device)


class DataParallel:
    def __init__(self, solver, comm, bucket_bytes=BUCKET_BYTES, timeout=TIMEOUT, reducer=None):
        self.solver, self.net, self.comm = solver, solver.net, comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.timeout = timeout or None
        self.iter_size = max(1, solver.param.iter_size)
        self._broadcast_state()
        self._shard()
        self.buckets = make_buckets(self.net, bucket_bytes)
        self.reducer = reducer or make_reducer(comm, solver.device)
        if hasattr(self.reducer, "hurry"):      # polls without pause once backward is done
            self.reducer.hurry = lambda: getattr(self.net.executor, "waiting_for_collectives", False)
        for b in self.buckets:
            self.reducer.allocate(b)
        self.ops = [AllReduce(self, b) for b in self.buckets]
        self.instructions = insert_allreduce(self.net.plan.schedule, self.ops)
        self.batch_norms = rank_batch_norms(self.net, comm) if self.size > 1 else []
        location = self.ops[0].location if self.ops else ""
        self.stream = self.net.executor.stream(location, "comm")
        self._runs, self._seen, self._pass = [0] * len(self.buckets), 0, 0
        solver.sync_requests = self.agree
        solver.is_root = self.rank == 0
        solver.images_per_iter *= self.size         # the rates logged count every rank's images
        batch, sizes = self.net.batch_size, [f"{b.nbytes / 2**20:.2f}" for b in self.buckets]
        log.info("Data parallel: %d ranks, batch %d per rank (%d in all); %d gradient buckets of at most %g MB "
                 "all-reduced by %s, in backward order (%s MB)", self.size, batch, batch * self.size,
                 len(self.buckets), bucket_bytes / 2**20, self.reducer.name,
                 ", ".join(sizes[:8] + (["..."] if len(sizes) > 8 else [])))
        log.debug("Gradient buckets: %s", describe(self.buckets))

    # -- start-up -------------------------------------------------------------------
    def _broadcast_state(self):
        """Rank 0's parameters, solver history and iteration on every rank."""
        solver = self.solver
        arrays = solver.state_arrays()
        hosts = [np.ascontiguousarray(_host(a)) for a in arrays]
        crc = 0
        for h in hosts:
            crc = zlib.crc32(h.view(np.uint8), crc)
        differ = [r for r, c in enumerate(self.comm.allgather(crc)) if c != crc]
        if self.rank == 0 and differ:
            log.info("Ranks %s started from other weights than rank 0 (another seed or file): rank 0's are "
                     "used everywhere", ", ".join(map(str, differ)))
        for a, h in zip(arrays, hosts):
            self.comm.Bcast(h, root=0)
            a[...] = h if isinstance(a, np.ndarray) else solver.device.xp.asarray(h)
        solver.iter, solver.current_step = self.comm.bcast((solver.iter, solver.current_step), root=0)

    def _shard(self):
        """Data layers and the solver's feed read this rank's share of every global batch."""
        shard = (self.rank, self.size)
        for layer in self.net.layers:
            if hasattr(layer, "shard"):
                layer.shard = shard
        feed = self.solver.feed
        if feed is not None and hasattr(feed, "shard"):
            feed.shard = shard
        elif feed is not None and self.net.inputs and self.rank == 0:
            log.warning("solver.feed has no shard attribute: each rank trains on the batches its feed "
                        "gives (shard them by rank %d of %d yourself)", self.rank, self.size)
        unsharded = sorted({n.type for n in self.net.graph.layers if not n.bottoms and n.type not in
                            ("Input",) and not hasattr(n.layer, "shard")})
        if unsharded and self.rank == 0:
            log.warning("%s layers are not sharded: every rank reads the same batches", ", ".join(unsharded))

    # -- the all-reduce operators' work (on the comm stream, in bucket order) -----------
    def before(self, op, ready):
        """Issued: where the gradients are complete and the reducer can, start the all-reduce on the
        issuing thread (the comm thread would first have to wake and take the GIL from backward,
        which in traced LeNet iterations held it until backward ended); the comm stream's operator
        then only waits for it."""
        if ready is not None and self._pass % self.iter_size == self.iter_size - 1 \
                and hasattr(self.reducer, "start"):
            return self.reducer.start(op.bucket, ready)
        return self.reducer.before(op.bucket)

    def reduced(self, op, arrays, token):
        """Bucket ``op.bucket``'s operator ran: all-reduce in the last pass of an iteration (its
        gradients are complete then), nothing in the others."""
        if self._pass % self.iter_size == self.iter_size - 1:
            self.reducer.reduce(op.bucket, arrays, token)
            self._runs[op.bucket.index] += 1
        self._seen += 1
        if self._seen == len(self.buckets):     # every bucket's operator of this pass has run
            self._seen, self._pass = 0, self._pass + 1

    # -- for callers driving the net themselves -----------------------------------------
    def wait(self) -> None:
        """Check that every bucket was all-reduced since the last check (a full backward ran):
        the solver needs no such call, its passes always run backward to the end."""
        self.net.executor.synchronize()
        missing = [b.name for b, n in zip(self.buckets, self._runs) if n == 0]
        if missing:
            raise RuntimeError(f"data parallel: gradient {missing[0]} was not all-reduced in iteration "
                               f"{self.solver.iter} (a backward pass did not run to the end)")
        self._runs = [0] * len(self.buckets)

    def agree(self, stop: bool, snapshot: bool):
        """Stop and snapshot requests of any rank, on every rank (after an iteration)."""
        flags = np.array([stop, snapshot], np.int32)
        # the caller waits for nothing else: tested without sleeping (every iteration pays its latency)
        event = self.stream.submit(lambda: allreduce_max(self.comm, flags, hurry=lambda: True))
        try:
            event.wait(self.timeout)
        except TimeoutError:
            raise comm_timeout("agreeing on stop and snapshot requests", self.timeout) from None
        return bool(flags[0]), bool(flags[1])

    def close(self) -> None:
        """After training: the all-reduce operators out of the schedule, the buffers freed. (After
        an error, don't: a collective the other ranks never join would keep the comm stream.)"""
        self.net.executor.synchronize()
        backward = self.net.plan.schedule.backward
        backward[:] = [ins for ins in backward if not any(ins is x for x in self.instructions)]
        self.solver.sync_requests = None
        for group in self.batch_norms:
            group.detach()
        self.reducer.close()
