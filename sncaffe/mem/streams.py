"""Streams and events on the CPU device: worker threads standing in for CUDA streams.

A stream runs the work submitted to it in order, on its own thread; ``submit``
returns an event that fires when that work is done. NumPy copies of large
arrays release the GIL, so a copy on the device-to-host stream really overlaps
the computation on the compute stream, as on a GPU.
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

    def wait(self):
        self._done.wait()
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
            fn, event = self._queue.get()
            event.start = time.perf_counter()
            try:
                fn()
            except BaseException as e:     # handed to whoever waits on the event
                event.error = e
            event.end = time.perf_counter()
            event.set()

    def submit(self, fn) -> Event:
        event = Event()
        self._queue.put((fn, event))
        self._last = event
        return event

    def synchronize(self):
        if self._last is not None:
            self._last.wait()
