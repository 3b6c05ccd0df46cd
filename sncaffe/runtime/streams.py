"""Streams and events on the CPU device: worker threads standing in for CUDA streams.

A stream runs the work submitted to it in order, on its own thread; ``submit``
returns an event that fires when that work is done. Work may first wait for
events of other streams (``after``, CUDA's cudaStreamWaitEvent): the stream
holds there, and an error in one of them becomes this work's error without
running it. NumPy copies and BLAS calls on large arrays release the GIL, so
work on one stream really overlaps work on another, as on a GPU.
"""
from __future__ import annotations

import atexit
import queue
import threading
import time
import weakref
from _thread import allocate_lock as _allocate_lock

# Every stream still open: at exit their work is drained before the interpreter frees the arrays
# it copies into (a daemon thread inside a NumPy copy or a pread, without the GIL, would
# otherwise go on writing into memory the finalizing interpreter has given back).
_open: "weakref.WeakSet[Stream]" = weakref.WeakSet()
# Seconds the streams' queued work may take to finish at exit, in all: a copy in flight ends in
# far less; work still waiting for an event that an aborted iteration will never set is left
# waiting (it touches no memory while it waits).
EXIT_WAIT = 10.0


class Event:
    """Fires once. A lock held until then: creating, setting and querying one cost a few
    hundred nanoseconds (``threading.Event`` builds a Condition per event, and the dispatcher
    makes one per operator: that Python time competes for the GIL with the workers)."""
    __slots__ = ("_lock", "done", "error", "start", "end")

    def __init__(self):
        self._lock = _allocate_lock()
        self._lock.acquire()
        self.done = False
        self.error = None
        self.start = self.end = None       # perf_counter seconds, for traces

    def set(self):
        if not self.done:
            self.done = True
            self._lock.release()

    def query(self) -> bool:
        return self.done

    def wait(self, timeout=None):
        """Block until the work is done (``TimeoutError`` after ``timeout`` seconds); raise its error."""
        if not self.done:
            if not self._lock.acquire(timeout=-1 if timeout is None else timeout):
                raise TimeoutError(f"not done within {timeout:g} s")
            self._lock.release()            # the next waiter passes too
        if self.error is not None:
            raise self.error


class Stream:
    def __init__(self, name: str):
        self.name = name
        self._queue = queue.SimpleQueue()   # C: no Condition per put and get
        self._thread = threading.Thread(target=self._work, name=f"sncaffe-{name}", daemon=True)
        self._thread.start()
        self._last = None
        _open.add(self)

    def _work(self):
        get, clock = self._queue.get, time.perf_counter
        while True:
            item = get()
            if item is None:                # close(): everything before it has run
                return
            fn, event, after = item
            try:
                for e in after:
                    e.wait()
                event.start = clock()
                fn()
            except BaseException as e:     # handed to whoever waits on the event
                event.error = e
            event.end = clock()
            event.set()

    def submit(self, fn, after=(), event=None) -> Event:
        """Run ``fn`` after the work before it on this stream and the events ``after``;
        ``event.start`` is when ``fn`` began (after the waits). ``event``: one made before (others
        may already wait for it), else a new one."""
        if event is None:
            event = Event()
        self._queue.put((fn, event, after))
        self._last = event
        return event

    def synchronize(self):
        if self._last is not None:
            self._last.wait()

    def close(self, timeout=None) -> bool:
        """Run what is queued, then end the thread; whether it ended within ``timeout`` seconds."""
        _open.discard(self)
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout)
        return not self._thread.is_alive()


@atexit.register
def close_all(timeout=EXIT_WAIT) -> None:
    """Drain and end every open stream (at exit, before the interpreter frees their arrays)."""
    deadline = time.monotonic() + timeout
    for stream in list(_open):
        stream.close(max(0.0, deadline - time.monotonic()))
