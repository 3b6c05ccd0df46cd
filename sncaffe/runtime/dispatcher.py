"""The dispatcher: issues a schedule's operators to the streams of their locations, each when
the events it depends on have fired.

Every instruction of the plan is an operator on a stream of one location:
layers' forward and backward, recomputation, snapshot/restore and the fill of
a fresh block on the location's compute stream; offload on its d2h stream,
prefetch on its h2d stream; a Copy between locations on the copy stream of
the location the data moves into; a gradient all-reduce (``collective``) on
its comm stream. An operator waits for

- the last writer of every tensor it reads (read after write),
- the last writer and the readers since of every tensor it writes
  (write after write, write after read: an offload still reading a block),
- through those, the users of the memory its tensors reuse: a freed block's
  pending events pass to whatever is allocated over it.

Allocation and free are not operators: the issuing thread does them in the
plan's order, without waiting, so each pool sees exactly the sequence the
planner simulated and the measured peak equals the planned one; the memory a
block reuses is protected by events, not by blocking the issuer.

Threads: with several CPU locations each location's compute stream is its
own worker thread, so independent branches at different locations run at the
same time. With one location (or a GPU: its kernels are already asynchronous
on the device's own streams) compute runs on the calling thread, in plan
order, waiting on the events of copies and collectives as a CUDA stream does.

Programs: where the workers' schedule holds only allocations, frees, operators
and collectives, each worker runs its location's instructions itself, in plan
order, and only tensors touched from two streams carry events (see
``_programs``); the general path below serves the rest (copies to and from
the host and disk tiers).

Between operators of different locations the layers' blobs must point at the
right blocks: each operator carries the arrays of its tensors from the issuing
thread and binds them just before it runs; when ``execute`` returns, every
blob points where the serial executor would have left it.

``record``: when a list, the dispatcher appends one plain dict per operator
(location, stream, name, issue index, start, end, bytes for copies): what ran
where and in which order, for traces and for tests that check concurrency by
the order of events rather than by time.
"""
from __future__ import annotations

import sys
import time
from bisect import bisect_left, bisect_right, insort
from functools import partial
from operator import itemgetter
from queue import SimpleQueue

from ..trace import Span
from .executor import SerialExecutor, workspace_names
from ..plan.liveness import op_tensors
from .parts import Later, armed
from .streams import Event, Stream


# While workers, a comm thread and the issuing thread share the GIL, a thread that wants it back
# (a GEMM or an MPI test returned, an event fired) waits until the holder gives it up, at the
# latest after the switch interval: Python's default is a whole operator of a small net, and an
# all-reduce's polls each pay it. A shorter one while operators run concurrently
# (tools/bench_dispatch.py).
SWITCH_INTERVAL = 2e-4


class AllOf:
    """Fires when all of several events have; waiting raises the first error among them."""

    def __init__(self, events):
        self.events = list(events)

    def query(self) -> bool:
        return all(e.query() for e in self.events)

    def wait(self, timeout=None):
        for e in self.events:
            e.wait()


def _live(events):
    """The events still worth waiting for: not fired, or fired with an error to pass on."""
    return [e for e in events if not e.query() or getattr(e, "error", None) is not None]


_start = itemgetter(0)


def _nothing():
    pass


_DONE = Event()         # the event of an operator run on the calling thread with nothing pending
_DONE.set()


def _static(op):
    """What the dispatcher needs of an operator each time it issues it, worked out once (the
    issuing thread's Python time competes for the GIL with the workers'): its (id(root), write)
    pairs, workspaces included; the ids of its roots; where it runs."""
    cached = op.__dict__.get("_dispatch")
    if cached is None:
        rw = [(id(r), w) for r, w in op_tensors(op)]
        rw += [(id(t.root), True) for t in op.writes if t.kind == "workspace"]
        cached = op.__dict__["_dispatch"] = (rw, [id(r) for r, _ in op_tensors(op)], Dispatcher._where(op))
    return cached


def _fail(events, exc):
    """Every event not fired yet fires with ``exc`` (whoever waits for it sees the error)."""
    for event in events:
        if not event.done:
            event.error = exc
            event.set()


class _Recording:
    """A pass of ``Dispatcher._programs`` written down, to be replayed on the next passes of the
    same schedule: the issuing thread's Python (its walk of about 400 instructions an iteration for
    two replicas of a small net, the split operators' parts, the events) competes for the GIL with
    the workers. Each step: its stream, its fn, the indices of the events it waits for, the index
    of its own (or -1). It fits a later pass while the schedule's compiled entries are the same
    object and every layer's ``split_op`` is the one it was (runtime/parts.py: the parts are then the
    same); not where a step waits for an event from outside the pass. A collective's step keeps
    how to make its run (``make``): it takes its arrays and a token as it is issued."""

    def __init__(self, entries):
        self.entries = entries
        self.splits = [(e[5], getattr(e[5], "split_op", None)) for e in entries if e is not None and e[5] is not None]
        self.steps, self.index = [], {}
        self.events = self.logged = 0

    def add(self, stream, fn, deps, event, meta=None, make=None):
        if event is not None:
            self.index[id(event)] = len(self.index)
        timeout, on_timeout = (meta[4], meta[5]) if meta is not None else (None, None)
        self.steps.append((stream, fn, deps, event, timeout, on_timeout, make))

    def finish(self, logged) -> bool:
        """Whether the pass can be replayed: every event it waited for was its own (a ``Later``,
        bound by now, counting as the one bound to it)."""
        index, steps = self.index, []
        for stream, fn, deps, event, timeout, on_timeout, make in self.steps:
            at = []
            for d in deps:
                i = index.get(id(d.event if isinstance(d, Later) else d))
                if i is None:
                    return False
                at.append(i)
            steps.append((stream, fn, tuple(at), -1 if event is None else index[id(event)], timeout, on_timeout,
                          make))
        self.steps, self.events, self.logged, self.index = steps, len(index), logged, None
        return True

    def fits(self, entries) -> bool:
        return entries is self.entries and all(getattr(layer, "split_op", None) is s for layer, s in self.splits)


class Dispatcher(SerialExecutor):
    KINDS = ("alloc", "free", "run", "offload", "prefetch", "drop", "snapshot", "restore", "collective")

    def __init__(self, *args, threaded=None, **kwargs):
        super().__init__(*args, **kwargs)      # the serial executor's arguments, whatever they become
        cpu = all(_is_cpu(d) for d in self.devices.values())
        # one worker per location where there are several CPU locations (see the module's doc)
        self.threaded = (cpu and len(self.devices) > 1) if threaded is None else threaded
        self._writer = {}           # id(root) -> event of the last operator that wrote it
        self._readers = {}          # id(root) -> events of operators that read it since
        self._freed = {}            # location -> [(start, end, events)] by start: blocks freed with work pending
        self._prune_at = {}         # location -> length of _freed[location] that prunes it
        self._longest = {}          # location -> the longest block in _freed[location]
        self._issued = []           # (event, timeout, on_timeout) of the current execute's operators
        self._dispatching = False   # inside a threaded execute: operators go to the workers
        self._dirty = set()         # roots whose blobs are bound again when execute returns
        self._own_streams = {}      # (location, kind) -> Stream where the device has none of its own
        self._issue_index = 0
        self._copies = {}           # id(event) -> event: the device's copy events (stream-side waits)
        self.record = None          # a list to append one dict per operator into (see the module's doc)
        self.pool_trace = None      # a list to append (location, time, bytes in use) into
        self.waiting_for_collectives = False    # the issuing thread waits for collectives alone
        # events of work on other threads or streams (submitted operators, copies) that may still
        # be running or have failed: while there are none, an operator on the calling thread has
        # nothing to wait for, and nothing later waits for it (it is done when issue returns)
        self._async = []
        self._async_prune = 64

    # -- streams ----------------------------------------------------------------------
    def stream(self, location, kind):
        """The location's stream ``kind`` (compute, d2h, h2d, comm): a CPU device's own worker;
        for other devices a host thread of this dispatcher (collectives, which wait on the host)."""
        device = self.devices[location]
        if _is_cpu(device):
            return device.stream(kind)
        key = (location, kind)
        if key not in self._own_streams:
            self._own_streams[key] = Stream(f"{location or 'default'}-{kind}")
        return self._own_streams[key]

    # -- dependencies -----------------------------------------------------------------
    def _deps(self, rw):
        out = []
        for key, write in rw:
            w = self._writer.get(key)
            if w is not None:
                out.append(w)
            if write:
                out.extend(self._readers.get(key, ()))
        return _live(out)

    def _touched(self, rw, event):
        for key, write in rw:
            if write:
                self._writer[key] = event
                self._readers[key] = []
            else:
                readers = self._readers.setdefault(key, [])
                if len(readers) > 8:
                    readers[:] = _live(readers)
                readers.append(event)

    def _wait_all(self, events):
        for e in events:
            self._wait(e)           # counts the waits that block (tools/bench_memory.py times them)

    def issue(self, location, kind, name, rw, fn, nbytes=None, asynchronous=False, timeout=None,
              on_timeout=None, waited=(), after=()):
        """Run ``fn`` on the location's stream ``kind`` once the events of ``rw`` ((id(root), write)
        pairs) have fired; its event becomes those tensors' event. On the calling thread when not
        dispatching to workers, unless ``asynchronous`` (a collective). Returns the event.
        ``fn`` runs under its location's device (``device.active()``: that GPU current, its
        stream and cuDNN handle), on whichever thread runs it. ``waited``: events the caller has
        already waited for on the device; ``after``: more events to wait for (runtime/parts.py)."""
        if not (self._dispatching or asynchronous or after or self._pending_async()):
            return self._run_here(location, kind, name, fn, nbytes)
        deps = [d for d in self._deps(rw) if id(d) not in waited] + list(after)
        index, self._issue_index = self._issue_index, self._issue_index + 1
        device = self.devices[location]
        work = fn

        def fn():
            with device.active():
                work()
        if self._dispatching or asynchronous:
            if any(not d.query() for d in deps):
                self.stats["waits"] += 1
            event = self.stream(location, kind).submit(fn, deps)
            self._issued.append((event, timeout, on_timeout))
            self._pending(event)
        else:
            # the device's own copies are waited for on the device (the host goes on queueing
            # kernels); the rest (host threads' events) on the host
            for d in deps:
                if id(d) in self._copies:
                    self._stream_wait(location, d)
                else:
                    self._wait(d)
            event = self._timed(device, fn)
        self._touched(rw, event)
        self._log(location, kind, name, event, nbytes, index)
        return event

    def _pending(self, event):
        self._async.append(event)
        if len(self._async) > self._async_prune:       # amortised, as _reused prunes its blocks
            self._async = _live(self._async)
            self._async_prune = max(64, 2 * len(self._async))

    def _pending_async(self) -> bool:
        """Whether work on other threads or streams may still be running, or failed (its error is
        passed on through the events that depend on it)."""
        if self._async:
            self._async = _live(self._async)
        return bool(self._async)

    def _run_here(self, location, kind, name, fn, nbytes):
        """``issue`` of an operator on the calling thread while no other work is pending: nothing
        to wait for, and its event (fired when it returns) need not be any tensor's, as every
        later operator finds it done; only the trace and the record see it."""
        index, self._issue_index = self._issue_index, self._issue_index + 1
        device = self.devices[location]
        if self.trace is None and self.record is None:
            with device.active():
                fn()
            return _DONE

        def work():
            with device.active():
                fn()
        event = self._timed(device, work)
        self._log(location, kind, name, event, nbytes, index)
        return event

    def _timed(self, device, fn):
        """Run ``fn`` here; its event, fired, with its start and end (a GPU's compute waited for
        when tracing, so the span is the kernels')."""
        start = time.perf_counter()
        fn()
        if self.trace is not None and hasattr(device, "synchronize_compute"):
            device.synchronize_compute()
        event = Event()
        event.start, event.end = start, time.perf_counter()
        event.set()
        return event

    def _log(self, location, kind, name, event, nbytes, index=None, trace=True):
        if index is None:
            index, self._issue_index = self._issue_index, self._issue_index + 1
        if self.record is not None:
            self.record.append({"location": location, "stream": kind, "name": name, "index": index,
                                "event": event, "bytes": nbytes})
        if trace and self.trace is not None and not name.startswith("fill "):     # fills: in the record only
            self._pending_trace.append((f"{location}/{kind}" if location else kind, name, event, nbytes))

    # -- memory -----------------------------------------------------------------------
    def alloc(self, t, fill=None, persistent=False):
        key = id(t)
        if not self._dispatching:
            arr = super().alloc(t, None, persistent)
        else:                       # bound per operator (see the module's doc)
            off, arr = self.devices[t.location].alloc(t.shape, t.dtype, t.name)
            self.offsets[key], self.arrays[key] = off, arr
            if not persistent:
                self.transient[key] = t
            self._dirty.add(key)
        # the block may be one that work still uses: that work's events are this tensor's readers now
        reused = self._reused(t.location, self.offsets[key], t.nbytes)
        if reused:
            self._readers.setdefault(key, []).extend(reused)
        if fill is not None:
            self.issue(t.location, "compute", "fill " + t.name, [(key, True)],
                       lambda: arr.__setitem__(Ellipsis, fill))
        self._count_pool(t.location)
        return arr

    def _reused(self, location, off, nbytes):
        freed = self._freed.get(location)
        if not freed:
            return []
        end, out = off + max(nbytes, 1), []
        # the blocks overlapping [off, end) start in (off - longest, end): found by bisection, as
        # the issuing thread runs a pass ahead of the workers and hundreds of blocks are pending
        lo = bisect_right(freed, off - self._longest[location], key=_start)
        hi = bisect_left(freed, end, key=_start)
        keep = []
        for entry in freed[lo:hi]:
            start, stop, events = entry
            if off < stop:
                out.extend(_live(events))
                if off <= start and stop <= end:
                    continue        # the new tensor carries its events now (its writer waits for them)
            keep.append(entry)
        freed[lo:hi] = keep
        if len(freed) > self._prune_at.get(location, 32):  # blocks whose work has all finished
            freed[:] = [(a, b, live) for a, b, es in freed for live in (_live(es),) if live]  # protect nothing
            self._prune_at[location] = max(32, 2 * len(freed))     # amortised: not every allocation
        return out

    def free(self, t):
        key = id(t)
        device = self.devices[t.location]
        pending = self._deps([(key, True)])
        if self._dispatching:       # the block's next users wait for them (see _reused)
            self.d2h.pop(key, None)
            self.h2d.pop(key, None)
        else:                       # as the serial executor: its device's compute waits for them
            self._stream_wait(t.location, self.d2h.pop(key, None))
            self._stream_wait(t.location, self.h2d.pop(key, None))
        off = self.offsets.pop(key)
        if pending:                 # the next tensor allocated over this block waits for them
            size = device.pool.size_of(off) if hasattr(device, "pool") else max(t.nbytes, 1)
            insort(self._freed.setdefault(t.location, []), (off, off + size, pending), key=_start)
            self._longest[t.location] = max(size, self._longest.get(t.location, 0))
        device.free(off)
        del self.arrays[key]
        self.transient.pop(key, None)
        if self._dispatching:
            self._dirty.add(key)
        else:
            home = self.home.get(key)
            for bind in self.binders.get(key, ()):
                bind(home)
        self._count_pool(t.location)

    def _count_pool(self, location):
        device = self.devices[location]
        if self.pool_trace is not None and hasattr(device, "pool"):
            self.pool_trace.append((location, time.perf_counter(), device.pool.in_use))

    def _array(self, key):
        a = self.arrays.get(key)
        return self.home.get(key) if a is None else a

    # -- instructions -----------------------------------------------------------------
    def execute(self, instrs):
        programs = self.threaded and self._programmable(instrs)
        self._dispatching = self.threaded and not programs
        concurrent = self.threaded or any(ins.kind == "collective" for ins in instrs)
        switch = sys.getswitchinterval()
        if concurrent:      # see SWITCH_INTERVAL
            sys.setswitchinterval(min(switch, SWITCH_INTERVAL))
        try:
            if programs:
                self._programs(instrs)
            else:
                for i, ins in enumerate(instrs):
                    if ins.kind not in self.KINDS:    # a newer planner's instruction: run it serially
                        self._drain()
                    self._apply(instrs, i)
        finally:
            try:
                self._finish()
            finally:
                sys.setswitchinterval(switch)

    def _drain(self):
        """Wait for every operator issued by this execute, collectives last (that wait is traced:
        what the update waits for beyond backward); the first error among them is raised."""
        issued, self._issued = self._issued, []
        error, t0 = None, None
        for event, timeout, on_timeout in sorted(issued, key=lambda x: x[2] is not None):
            if on_timeout is not None and t0 is None:
                t0 = time.perf_counter()
                self.waiting_for_collectives = True    # compute is done: they may poll without pause
            try:
                event.wait(timeout)
            except TimeoutError:
                error = error or (on_timeout() if on_timeout else TimeoutError("an operator did not finish"))
            except BaseException as exc:        # raised once all the work has stopped
                error = error or exc
        self.waiting_for_collectives = False
        if t0 is not None and self.trace is not None:
            self.trace.append(("compute", "wait for the all-reduce", t0, time.perf_counter()))
        if error is not None:
            self._forget_errors()
            raise error

    def _forget_errors(self):
        """Once an error is raised, failed events stop being dependencies (the next pass starts
        afresh instead of inheriting it)."""
        def ok(e):
            return getattr(e, "error", None) is None
        self._writer = {k: e for k, e in self._writer.items() if ok(e)}
        self._async = [e for e in self._async if ok(e)]
        self._readers = {k: [e for e in es if ok(e)] for k, es in self._readers.items()}
        for location, freed in self._freed.items():
            freed[:] = [(a, b, [e for e in es if ok(e)]) for a, b, es in freed]

    def _finish(self):
        """Wait for the operators issued (copies may go on), then bind blobs as the plan left them."""
        try:
            self._drain()
        finally:
            if self._dispatching:
                self._dispatching = False
                for key in self._dirty:
                    arr = self._array(key)
                    for bind in self.binders.get(key, ()):
                        bind(arr)
                self._dirty = set()

    # -- programs: each location's worker issues its own operators ---------------------
    # Where a schedule holds only allocations, frees, operators and collectives (no copies to
    # and from the host tier), each compute worker runs the sequence of its location's
    # instructions, a program, in the plan's order, as the serial executor runs one location's:
    # it allocates, binds the blobs, runs and frees itself, so its pool sees the planned sequence
    # and nothing of its own needs an event. Only a tensor touched from two streams (a Copy into
    # another location, a gradient the comm stream sums, a replica's part of the batch, a split
    # operator's) orders them: the instruction that waits holds the event of the one it waits
    # for. The issuing thread walks the schedule once, feeding each worker's queue as it goes
    # and submitting the other streams' operators (copies, exchanges, collectives): the
    # general path's hand-offs (an event, a queue entry, a binding and the issuing thread's
    # bookkeeping per operator) cost more than a small net's operators on two cores.
    programs = True         # False: every schedule on the general path (benchmarks switch it)
    replay = True           # False: every pass of a program walks its schedule (see _Recording)
    PROGRAM_KINDS = frozenset(("alloc", "free", "run", "collective"))

    def _programmable(self, instrs) -> bool:
        if not self.programs or self.h2d or self.d2h or not all(_is_cpu(d) for d in self.devices.values()):
            return False
        kinds = self.PROGRAM_KINDS
        for ins in instrs:
            if ins.kind not in kinds:
                return False
            if ins.kind == "collective" and not all(id(t.root) in self.arrays or id(t.root) in self.home
                                                    for t in ins.op.tensors):
                return False        # a collective's arrays are taken when it is issued
        return True

    def _shared(self, instrs) -> set:
        """The roots ``instrs`` touch from more than one stream (a split operator's parts counted
        on its own stream: see _program_run)."""
        first, shared = {}, set()
        for ins in instrs:
            if ins.kind == "alloc" or ins.kind == "free":
                sid, keys = id(self.stream(ins.tensor.location, "compute")), (id(ins.tensor),)
            elif ins.kind == "collective":
                sid, keys = id(self.stream(ins.op.location, "comm")), [id(t.root) for t in ins.op.tensors]
            else:
                rw, _, (location, kind, _) = _static(ins.op)
                sid, keys = id(self.stream(location, kind)), [k for k, _ in rw]
            for key in keys:
                if first.setdefault(key, sid) != sid:
                    shared.add(key)
        return shared

    def _programs(self, instrs):
        compute = {location: d.stream("compute") for location, d in self.devices.items()}
        shared, entries = self._compiled(instrs, compute)
        every = self.record is not None or self.trace is not None      # every operator's span wanted
        workers = {id(s) for s in compute.values()}
        recording = None
        if not every and self.replay:
            replays = self.__dict__.setdefault("_replays", {})
            done = replays.get(id(entries))
            if done is not None and done.fits(entries):
                return self._replay(done, workers)
            recording = _Recording(entries)
        queues, made, laters = {}, [], []
        writer, readers = {}, {}
        issued = self._issue_index

        def order(rw, sid, event):
            """The events of other streams' steps a step touching ``rw`` waits for; it becomes
            their writer or a reader."""
            deps = []
            for key, write in rw:
                if key not in shared:
                    continue
                w = writer.get(key)
                if w is not None and w[1] != sid:
                    deps.append(w[0])
                if write:
                    deps.extend(e for e, s in readers.get(key, ()) if s != sid)
                    writer[key], readers[key] = (event, sid), []
                else:
                    readers.setdefault(key, []).append((event, sid))
            return deps

        def step(stream, rw, after, fn, event, meta=None, make=None):
            sid = id(stream)
            if after:
                laters.extend(d for d in after if isinstance(d, Later))
            if event is None and (every or not shared.isdisjoint(k for k, _ in rw)):
                event = Event()
            deps = list(after) + order(rw, sid, event) if event is not None else list(after)
            if meta is not None and event is not None:
                self._log(meta[0], meta[1], meta[2], event, meta[3])
            if recording is not None:
                recording.add(stream, fn, deps, event, meta, make)
            if sid in workers:
                self._worker_queue(queues, stream).put((fn, deps, event))
            else:
                stream.submit(fn, deps, event)
                self._issued.append((event, meta[4] if meta else None, meta[5] if meta else None))
                self._pending(event)
            if event is not None:
                made.append(event)

        try:
            for ins, entry in zip(instrs, entries):
                if entry is not None:       # an allocation, a free, an operator not split
                    stream, fn, rw, private, meta, layer = entry
                    if layer is None or getattr(layer, "split_op", None) is None:
                        if private and not every:       # nothing to wait for, nobody waits for it
                            q = queues.get(id(stream))
                            if q is not None:
                                q.put((fn, (), None))
                                if recording is not None:
                                    recording.add(stream, fn, (), None)
                                continue
                        step(stream, rw, (), fn, None, meta)
                        continue
                if ins.kind == "collective":
                    op = ins.op
                    step(self.stream(op.location, "comm"), [(id(t.root), True) for t in op.tensors], (),
                         self._collective_run(op), Event(),
                         (op.location, "comm", op.name, op.nbytes, op.timeout, op.timed_out),
                         partial(self._collective_run, op))
                else:
                    self._program_run(ins, step, compute)
        except BaseException as exc:    # what was handed out finds its events failed, and an
            _fail(made, exc)            # exchange never issued fails at once (not after BIND_TIMEOUT)
            for later in laters:
                if later.event is None:
                    failed = Event()
                    failed.error = exc
                    failed.set()
                    later.bind(failed)
            raise
        finally:
            for q in queues.values():
                q.put(None)
        if recording is not None and recording.finish(self._issue_index - issued):
            if len(replays) > 8:
                replays.clear()
            replays[id(entries)] = recording

    def _worker_queue(self, queues, stream):
        """The queue of ``stream``'s program in this pass, its program submitted with the first step."""
        q = queues.get(id(stream))
        if q is None:
            q = queues[id(stream)] = SimpleQueue()
            self._issued.append((stream.submit(lambda: self._run_program(q.get)), None, None))
        return q

    def _collective_run(self, op):
        """A collective's run as it is issued: its arrays then, and its token (``before``)."""
        arrays = [self._array(id(t.root)) for t in op.tensors]
        token = op.before(None)
        return lambda: op.run(arrays, token)

    def _replay(self, rec, workers):
        """A pass of ``rec``'s schedule as its recorded pass issued it (``_Recording``): fresh
        events, the same steps to the same queues and streams, each waiting for the events of the
        same steps."""
        events = [Event() for _ in range(rec.events)]
        queues = {}
        try:
            for stream, fn, deps, at, timeout, on_timeout, make in rec.steps:
                if make is not None:            # a collective: its arrays and token, now
                    fn = make()
                event = events[at] if at >= 0 else None
                deps = [events[i] for i in deps] if deps else ()
                sid = id(stream)
                if sid in workers:
                    self._worker_queue(queues, stream).put((fn, deps, event))
                else:
                    event = stream.submit(fn, deps, event)
                    self._issued.append((event, timeout, on_timeout))
                    self._pending(event)
        except BaseException as exc:
            _fail(events, exc)
            raise
        finally:
            for q in queues.values():
                q.put(None)
        self._issue_index += rec.logged

    def _compiled(self, instrs, compute) -> tuple:
        """What issuing ``instrs`` takes that stays the same from one pass to the next, kept for
        the schedule: the shared roots (``_shared``) and per instruction (stream, fn, rw, private,
        record entry, layer) for an allocation, a free or an operator (``private``: it touches no
        shared root), None for a collective."""
        cache = self.__dict__.setdefault("_compiled_cache", {})
        cached, now = cache.get(id(instrs)), tuple(instrs)      # (the same instructions: a list
        if cached is not None and cached[0] is instrs and cached[1] == now:     # may change in place)
            return cached[2]
        shared, out = self._shared(instrs), []
        for ins in instrs:
            kind = ins.kind
            if kind == "alloc" or kind == "free":
                t = ins.tensor
                fn = (lambda t=t, fill=ins.fill: self._program_alloc(t, fill)) if kind == "alloc" \
                    else (lambda t=t: self._program_free(t))
                out.append((compute[t.location], fn, ((id(t), True),), id(t) not in shared, None, None))
            elif kind == "run":
                op = ins.op
                rw, _, (location, where, nbytes) = _static(op)
                name = op.name + (" (recompute)" if ins.recompute else "")
                out.append((compute[location] if where == "compute" else self.stream(location, where),
                            self._program_work(ins), rw, shared.isdisjoint(k for k, _ in rw),
                            (location, where, name, nbytes, None, None), getattr(op.node, "layer", None)))
            else:
                out.append(None)
        if len(cache) > 8:
            cache.clear()
        cache[id(instrs)] = (instrs, now, (shared, out))
        return shared, out

    def _program_work(self, ins):
        """An operator's run on its worker: its workspace's arrays as they are then."""
        op, recompute, chunk, arrays = ins.op, ins.recompute, ins.chunk, self.arrays
        names = workspace_names(ins)
        device = self.devices[_static(op)[2][0]]

        def work():
            ws = {k: arrays[id(t)] for k, t in names.items()} if names else {}
            with device.active():
                self.run_op(op, recompute, ws, chunk)
        return work

    def _program_run(self, ins, step, compute):
        op = ins.op
        node = op.node
        rw, _, (location, kind, nbytes) = _static(op)
        names = workspace_names(ins)
        arrays, recompute, work = self.arrays, ins.recompute, self._program_work(ins)
        name = op.name + (" (recompute)" if recompute else "")
        split = getattr(getattr(node, "layer", None), "split_op", None)
        parts = split(op.kind, recompute) if split is not None else None
        own = compute[location] if kind == "compute" else self.stream(location, kind)
        if not parts:
            return step(own, rw, (), work, None, (location, kind, name, nbytes, None, None))
        layer = node.layer
        for part in parts:         # as _parts: the operator itself, its later stages, exchanges
            fn, stream = part.fn, part.stream
            if fn is None:
                fn, stream = work, kind
            elif part.touches:
                def fn(f=part.fn):
                    layer.workspace = {k: arrays[id(t)] for k, t in names.items()}
                    try:
                        f()
                    finally:
                        layer.workspace = {}
            fn = armed(fn, part.arm)
            at, event = part.location or location, Event()
            there, after = self.stream(at, stream), part.after
            if part.touches and there is not own:   # between the steps before and after it on its own
                reached = Event()                   # stream (their roots counted there: _shared)
                step(own, (), (), _nothing, reached)
                after = list(after) + [reached]
            step(there, rw if part.touches else (), after, fn, event,
                 (at, stream, part.name or name, nbytes if part.fn is None else None, None, None))
            if part.touches and there is not own:
                step(own, (), (event,), _nothing, None)
            if part.issued is not None:
                part.issued(event)

    @staticmethod
    def _run_program(get):
        """A worker's program: steps (fn, events to wait for, its event or None) from ``get`` until
        None. After an error every later step fails with it (whoever waits sees it)."""
        clock, error = time.perf_counter, None
        while True:
            item = get()
            if item is None:
                break
            fn, deps, event = item
            if error is None:
                try:
                    for d in deps:
                        d.wait()
                    if event is None:
                        fn()
                        continue
                    event.start = clock()
                    fn()
                    event.end = clock()
                    event.set()
                    continue
                except BaseException as exc:
                    error = exc
            if event is not None and not event.done:
                event.error, event.end = error, clock()
                event.set()
        if error is not None:
            raise error

    def _program_alloc(self, t, fill):
        SerialExecutor.alloc(self, t, fill)
        self._count_pool(t.location)

    def _program_free(self, t):
        SerialExecutor.free(self, t)
        self._count_pool(t.location)

    @staticmethod
    def _rw(op):
        """(id(root), write) for every tensor the operator touches, its workspaces included."""
        return _static(op)[0]

    def _run(self, ins):
        op = ins.op
        node = op.node
        ws = {k: self.arrays[id(t)] for k, t in workspace_names(ins).items()}
        recompute, chunk, run_op = ins.recompute, ins.chunk, self.run_op
        rw, keys, (location, kind, nbytes) = _static(op)
        waited = set()
        if not self._dispatching and (self.h2d or self.d2h):    # the copies it depends on, on its device
            for r, write in op_tensors(op):
                for event in (self.h2d.pop(id(r), None), self.d2h.pop(id(r), None) if write else None):
                    if event is not None:
                        self._stream_wait(location, event)
                        waited.add(id(event))
        binders = self.binders
        bindings = [(binders[k], self._array(k)) for k in keys if k in binders] if self._dispatching else ()

        def bind():             # the blobs see the arrays this operator's plan step gave them
            for binds, arr in bindings:
                for b in binds:
                    b(arr)

        def work():
            bind()
            run_op(op, recompute, ws, chunk)
        name = op.name + (" (recompute)" if recompute else "")
        split = getattr(getattr(node, "layer", None), "split_op", None)
        parts = split(op.kind, recompute) if split is not None else None
        if parts:
            return self._parts(op, parts, location, kind, name, rw, work, bind, ws, nbytes, waited)
        self.issue(location, kind, name, rw, work, nbytes, waited=waited)

    def _parts(self, op, parts, location, kind, name, rw, work, bind, ws, nbytes, waited):
        """An operator its layer splits into parts (runtime/parts.py), each issued as an operator: the
        operator's own work (``fn`` None), its layer's later stages (bound, with its workspace, as
        the operator), exchanges (on another stream, waiting only for ``after``)."""
        layer = op.node.layer
        for part in parts:
            fn, stream = part.fn, part.stream
            if fn is None:
                fn, stream = work, kind
            elif part.touches:
                def fn(f=part.fn):
                    bind()
                    layer.workspace = ws
                    try:
                        f()
                    finally:
                        layer.workspace = {}
            fn = armed(fn, part.arm)
            event = self.issue(part.location or location, stream, part.name or name, rw if part.touches else [],
                               fn, nbytes if part.fn is None else None,
                               asynchronous=not part.touches and stream != "compute",
                               waited=waited, after=part.after)
            if part.issued is not None:
                part.issued(event)

    @staticmethod
    def _where(op):
        """The location and stream of an operator: a Copy runs on the copy stream of the
        location its data moves into (forward: its top's; backward: its bottom's)."""
        node = op.node
        param = getattr(getattr(node, "layer", None), "param", None)
        if getattr(node, "type", None) == "Copy" and op.writes:
            moved = op.writes[0]
            return moved.location, "h2d", moved.nbytes
        if param is not None:
            return param.location, "compute", None
        tensors = op.writes or op.reads
        return (tensors[0].location if tensors else ""), "compute", None

    def _after(self, location, deps):
        """What a copy on ``location``'s streams waits for: the events, where its device takes
        ours; else they are waited for here."""
        deps = [d for d in deps if d is not None]
        if not deps:
            return None
        if _is_cpu(self.devices[location]):
            return AllOf(deps) if len(deps) > 1 else deps[0]
        if len(deps) == 1 and not isinstance(deps[0], Event):
            return deps[0]          # the device's own event (a copy before this one)
        self._wait_all(deps)
        return None

    def _offload(self, ins):
        value, dev = ins.tensor, ins.source or ins.tensor
        if ins.tier == "disk" or id(value) in self.disk:      # the disk tier: a spill file
            after = self._deps([(id(dev), False)])
            event = self._spill_out(value, dev, AllOf(after) if after else None)
            self._copied([(id(dev), False)], dev.location, "d2h", "offload " + value.name + " to disk",
                         event, value.nbytes)
            return
        if id(value) not in self.host:
            self.host[id(value)] = self.devices[dev.location].host_alloc(max(value.nbytes, 1), value.name)
            self.host_loc[id(value)] = dev.location
        after = self._after(dev.location, self._deps([(id(dev), False)]))
        event = self.devices[dev.location].copy_to_host(self.host[id(value)][1][:value.nbytes],
                                                        self.arrays[id(dev)], after)
        self._copied([(id(dev), False)], dev.location, "d2h", "offload " + value.name, event, value.nbytes,
                     traced=False)
        self.d2h[id(dev)] = event
        self.host_events.setdefault(id(value), []).append(event)
        self.stats["d2h_bytes"] += value.nbytes

    def _prefetch(self, ins):
        value, dev = ins.tensor, ins.source or ins.tensor
        events = self.host_events.get(id(value), [])
        if id(value) in self.disk:
            deps = self._deps([(id(dev), True)]) + events[-1:]
            event = self._spill_in(value, dev, AllOf(deps) if deps else None)
            self._copied([(id(dev), True)], dev.location, "h2d", "prefetch " + value.name + " from disk",
                         event, value.nbytes)
            return
        deps = self._deps([(id(dev), True)]) + events[-1:]   # its block free of work; its host bytes written
        after = self._after(dev.location, deps)
        event = self.devices[dev.location].copy_to_device(self.arrays[id(dev)],
                                                          self.host[id(value)][1][:value.nbytes], after)
        self._copied([(id(dev), True)], dev.location, "h2d", "prefetch " + value.name, event, value.nbytes,
                     traced=False)
        self.h2d[id(dev)] = event
        self.host_events.setdefault(id(value), []).append(event)
        self.stats["h2d_bytes"] += value.nbytes

    def _copied(self, rw, location, kind, name, event, nbytes, traced=True):
        """A copy's event joins the dependencies (stream-side waits) and the record; ``traced``: the
        serial executor's spill-file code has put it in the trace already."""
        self._touched(rw, event)
        self._copy_event(event)
        self._pending(event)
        self._log(location, kind, name, event, nbytes, trace=not traced)

    def _copy_event(self, event):
        if len(self._copies) > 64:
            self._copies = {k: e for k, e in self._copies.items() if not e.query()}
        self._copies[id(event)] = event

    def _snapshot(self, ins):
        dst, src = self.arrays[id(ins.source)], self.arrays[id(ins.tensor)]
        xp = self.devices[ins.tensor.location].xp
        self.issue(ins.tensor.location, "compute", "snapshot " + ins.tensor.name,
                   [(id(ins.tensor), False), (id(ins.source), True)], lambda: xp.copyto(dst, src))

    def _restore(self, ins):
        src, dst = self.arrays[id(ins.source)], self.arrays[id(ins.tensor)]
        xp = self.devices[ins.tensor.location].xp
        self.issue(ins.tensor.location, "compute", "restore " + ins.tensor.name,
                   [(id(ins.source), False), (id(ins.tensor), True)], lambda: xp.copyto(dst, src))

    def _collective(self, ins):
        """A collective over processes (a bucket's gradient all-reduce): asynchronous on the comm
        stream, in place on the arrays its tensors have now; the operators after it that touch
        them wait for its event, and so does the end of this execute (the update)."""
        op = ins.op
        arrays = [self._array(id(t.root)) for t in op.tensors]
        rw = [(id(t.root), True) for t in op.tensors]
        ready = None
        if not self._dispatching:         # on the calling thread the gradients' producers have run
            self._wait_all(self._deps(rw))
            ready = arrays                # so the operator may start right here (no thread to wake)
        token = op.before(ready)          # e.g. a GPU's compute event after them, or a started MPI request
        self.issue(op.location, "comm", op.name, rw, lambda: op.run(arrays, token), op.nbytes,
                   asynchronous=True, timeout=op.timeout, on_timeout=op.timed_out)

    # -- traces and iteration boundaries ----------------------------------------------
    def traced(self, name, stream, event, nbytes=None):
        if self.trace is not None:
            self._pending_trace.append((stream, name, event, nbytes))

    def trace_events(self) -> list:
        """(stream, name, start, end) spans: stream is "location/kind" (kind alone at the default
        location); a copy's span has its bytes in ``args``."""
        for stream, name, event, nbytes in self._pending_trace:
            try:
                event.wait()
            except BaseException:       # its error is raised where the work is waited for
                pass
            if event.start is not None:
                self.trace.append(Span(stream, name, event.start, event.end,
                                       None if nbytes is None else {"bytes": nbytes}))
        self._pending_trace = []
        return sorted(self.trace, key=lambda x: x[2])

    def synchronize(self):
        """Wait for every operator issued so far, copies and collectives included."""
        events = list(self._writer.values()) + [e for rs in self._readers.values() for e in rs]
        for e in _live(events):
            e.wait()

    def reset(self):
        self.synchronize()
        super().reset()
        self._freed = {}


def _is_cpu(device) -> bool:
    """Whether the device runs its operators on host streams of its own (the CPU device and
    its subclasses): a capability the device declares, so the runtime imports no backend."""
    return getattr(device, "host_streams", False)
