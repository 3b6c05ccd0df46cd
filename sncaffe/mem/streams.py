"""Streams and events on the CPU device: worker threads standing in for CUDA streams.

A stream runs the work submitted to it in order, on its own thread; ``submit``
returns an event that fires when that work is done. Work may first wait for
events of other streams (``after``, CUDA's cudaStreamWaitEvent): the stream
holds there, and an error in one of them becomes this work's error without
running it. NumPy copies and BLAS calls on large arrays release the GIL, so
work on one stream really overlaps work on another, as on a GPU.
"""
from __future__ import annotations

import queue
import threading
import time


class Event:
    def __init__(self):
        self._done = threading.Event()
        self.error = None
        self.start = self.end = None       # perf_counter seconds, for traces

    def set(self):
        self._done.set()

    def query(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout=None):
        """Block until the work is done (``TimeoutError`` after ``timeout`` seconds); raise its error."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"not done within {timeout:g} s")
        if self.error is not None:
            raise self.error


class Stream:
    def __init__(self, name: str):
        self.name = name
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._work, name=f"sncaffe-{name}", daemon=True)
        self._thread.start()
        self._last = None

    def _work(self):
        while True:
            fn, event, after = self._queue.get()
            try:
                for e in after:
                    e.wait()
                event.start = time.perf_counter()
                fn()
            except BaseException as e:     # handed to whoever waits on the event
                event.error = e
            event.end = time.perf_counter()
            event.set()

    def submit(self, fn, after=()) -> Event:
        """Run ``fn`` after the work before it on this stream and the events ``after``;
        ``event.start`` is when ``fn`` began (after the waits)."""
        event = Event()
        self._queue.put((fn, event, tuple(after)))
        self._last = event
        return event

    def synchronize(self):
        if self._last is not None:
            self._last.wait()
