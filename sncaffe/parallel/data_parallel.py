"""Data parallelism: one process per device, gradients averaged over the ranks while backward runs.

``DataParallel(solver, comm)`` joins a Solver to the other ranks of an MPI
job (every rank builds the same solver and calls ``solve()``):

- rank 0's parameters and solver history are broadcast, so all ranks start
  from the same weights (whatever their seeds);
- each data layer and the solver's feed take this rank's shard: of every
  global batch of N*B records, rank r keeps records [r*B, (r+1)*B), so N
  ranks at batch B see exactly what one process sees at batch N*B;
- after each layer's backward operator (``net.step_hook``) the buckets that
  have all their gradients start their all-reduce on the comm thread, while
  backward goes on; ``solver.before_update`` waits for them all and writes
  the averaged gradients back, so every rank applies the same update;
- only rank 0 tests and snapshots; stop and snapshot requests (signals) are
  agreed by all ranks after each iteration.

Every MPI call after start-up is made on the comm thread, one at a time.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
import zlib

import numpy as np

from ..solvers.solver import _host
from .buckets import BUCKET_BYTES, describe, make_buckets
from .mpi import MPIReducer, allreduce_max

log = logging.getLogger("sncaffe")
TIMEOUT = 1800.0        # seconds a rank waits for the others in a collective before giving up


class CommTimeout(RuntimeError):
    """Another rank did not join a collective in time: it stopped or is stuck."""


class CommEvent:
    """Done when the comm thread has run the work; ``start``/``end`` (perf_counter) for traces."""

    def __init__(self, name):
        self.name = name
        self._done = threading.Event()
        self.error = None
        self.start = self.end = None

    def query(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout=None) -> None:
        if not self._done.wait(timeout):
            raise CommTimeout(f"{self.name} did not finish within {timeout:g} s: another rank has stopped "
                              "or is stuck (the limit is --comm-timeout)")
        if self.error is not None:
            raise self.error


class CommStream:
    """The communication stream: one thread running collectives in the order they are submitted."""

    def __init__(self):
        self._queue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._work, name="sncaffe-comm", daemon=True)
        self._thread.start()

    def _work(self):
        while True:
            item = self._queue.get()
            if item is None:
                return
            fn, event = item
            event.start = time.perf_counter()
            try:
                fn(event)
            except BaseException as e:           # raised again by whoever waits on the event
                event.error = e
            event.end = time.perf_counter()
            event._done.set()

    def submit(self, name, fn) -> CommEvent:
        """Run ``fn(event)`` on the comm thread; it may move ``event.start`` past what it waited for."""
        event = CommEvent(name)
        self._queue.put((fn, event))
        return event

    def close(self):
        self._queue.put(None)
        self._thread.join(10)


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
        for b in self.buckets:
            self.reducer.allocate(b)
        self._of_layer = {}
        for b in self.buckets:
            for name in b.layers:
                self._of_layer.setdefault(name, []).append(b)
        self._n_backward = sum(1 for ins in self.net.plan.schedule.backward
                               if ins.kind == "run" and ins.op.kind == "backward")
        self.stream = CommStream()
        self._reset()
        self._previous_hook = self.net.step_hook
        self.net.step_hook = self._after_op
        solver.before_update = self.wait
        solver.sync_requests = self.agree
        solver.is_root = self.rank == 0
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
        arrays = [q.blob.data for q in solver._learnable] + list(solver.history)
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

    # -- backward: buckets start as their gradients are ready --------------------------
    def _reset(self):
        self._waiting = [set(b.layers) for b in self.buckets]
        self._events = [None] * len(self.buckets)
        self._done = self._pass = 0

    def _after_op(self, op, recompute):
        if self._previous_hook is not None:
            self._previous_hook(op, recompute)
        if op.kind != "backward":
            return
        if self._pass % self.iter_size == self.iter_size - 1:   # the gradients are complete
            for b in self._of_layer.get(op.node.name, ()):
                waiting = self._waiting[b.index]
                waiting.discard(op.node.name)
                if not waiting:
                    self._start(b)
        self._done += 1
        if self._done == self._n_backward:
            self._done, self._pass = 0, self._pass + 1

    def _start(self, bucket):
        previous = self._events[bucket.index]
        if previous is not None:         # a backward without an update since: its all-reduce is not used
            previous.wait(self.timeout)
        packed = self.reducer.pack(bucket)
        event = self.stream.submit(f"all-reduce of gradient {bucket.name}",
                                   lambda ev: self.reducer.allreduce(bucket, packed, ev))
        self._events[bucket.index] = event
        self.net.executor.traced(f"all-reduce {bucket.name}", "comm", event)

    # -- solver hooks ---------------------------------------------------------------
    def wait(self) -> None:
        """Before the update: every bucket all-reduced, the averages in the parameters' diffs."""
        t0 = time.perf_counter()
        missing = [b.name for b, e in zip(self.buckets, self._events) if e is None]
        if missing:
            raise RuntimeError(f"data parallel: gradient {missing[0]} was not all-reduced in iteration "
                               f"{self.solver.iter} (a backward pass did not run to the end)")
        for event in self._events:
            event.wait(self.timeout)
        for b in self.buckets:
            self.reducer.unpack(b)
        self._reset()
        trace = self.net.executor.trace
        if trace is not None:
            trace.append(("compute", "wait for the all-reduce", t0, time.perf_counter()))

    def agree(self, stop: bool, snapshot: bool):
        """Stop and snapshot requests of any rank, on every rank (after an iteration)."""
        flags = np.array([stop, snapshot], np.int32)
        self.stream.submit("agreeing on stop and snapshot requests",
                           lambda ev: allreduce_max(self.comm, flags)).wait(self.timeout)
        return bool(flags[0]), bool(flags[1])

    def close(self) -> None:
        """After training: give the hooks back, stop the comm thread, free the buffers. (After an
        error, don't: a collective the other ranks never join would keep the comm thread.)"""
        self.stream.close()
        self.net.step_hook = self._previous_hook
        self.solver.before_update = self.solver.sync_requests = None
        self.reducer.close()

