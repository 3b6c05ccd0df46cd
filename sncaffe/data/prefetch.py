"""Batches made ahead on a background thread, in a fixed set of host buffers (Caffe's prefetch queues).

A daemon thread takes a free buffer, has ``fill(buffer)`` write the next
batch into it and queues it as ready; the consumer takes ready buffers in
order and hands each back once copied. With ``depth`` buffers the reader
runs at most ``depth`` batches ahead. An exception in ``fill`` stops the
thread and is raised, as the same object, by the consumer's next take.
"""
from __future__ import annotations

import queue
import threading
from contextlib import contextmanager


class _Failure:
    def __init__(self, error):
        self.error = error


class Prefetcher:
    def __init__(self, fill, buffers, name="prefetch"):
        self._fill = fill
        self._free, self._ready = queue.Queue(), queue.Queue()
        for b in buffers:
            self._free.put(b)
        self._stopped = False
        self._error = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stopped:
            try:
                buf = self._free.get(timeout=0.5)  # wakes now and then to see stop() from a finalizer
            except queue.Empty:
                continue
            if self._stopped:
                return
            try:
                self._fill(buf)
            except BaseException as e:          # handed to the consumer, never lost in the thread
                self._ready.put(_Failure(e))
                return
            self._ready.put(buf)

    @contextmanager
    def batch(self):
        """The next ready buffer; it returns to the reader when the ``with`` block ends."""
        if self._error is not None:
            raise self._error
        if self._stopped:
            raise RuntimeError("the prefetcher is closed")
        buf = self._ready.get()
        if isinstance(buf, _Failure):
            self._error = buf.error
            raise buf.error
        try:
            yield buf
        finally:
            self._free.put(buf)

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def stop(self):
        """Ask the reader to stop after the batch it is making. Takes no lock: safe in a finalizer."""
        self._stopped = True

    def close(self, timeout=10.0):
        """Stop the reader and wait for it."""
        self.stop()
        self._free.put(None)                    # wakes a reader waiting for a free buffer
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)
