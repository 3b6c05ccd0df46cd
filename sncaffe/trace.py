"""Chrome trace JSON (chrome://tracing, Perfetto) of what ran on which location's stream, and when.

Spans are ``(stream, name, start, end)`` in perf_counter seconds (a ``Span``
also carries ``args``); ``stream`` is ``"location/kind"`` (``kind`` alone at
the net's default location), kind one of compute, d2h, h2d, comm. Each
location's streams are rows of the trace, in that order; ``args`` (the bytes a
copy moved) show on the event. ``counters``: ``(location, time, bytes)`` of a
pool's bytes in use, drawn as a counter track per location.
"""
from __future__ import annotations

import json
import os

KINDS = ("compute", "d2h", "h2d", "comm")


class Span(tuple):
    """(stream, name, start, end) that unpacks as four, with ``args`` (e.g. a copy's bytes) beside."""

    def __new__(cls, stream, name, start, end, args=None):
        span = super().__new__(cls, (stream, name, start, end))
        span.args = args or {}
        return span


def _row(stream):
    location, _, kind = stream.rpartition("/")
    return location, KINDS.index(kind) if kind in KINDS else len(KINDS), kind


def write_chrome_trace(spans, path, pid=None, origin=None, counters=()) -> None:
    pid = os.getpid() if pid is None else pid
    starts = [s[2] for s in spans] + [c[1] for c in counters]
    origin = min(starts, default=0.0) if origin is None else origin
    streams = sorted({s[0] for s in spans}, key=_row)
    tid = {name: i for i, name in enumerate(streams)}
    events = [{"name": "thread_name", "ph": "M", "pid": pid, "tid": tid[s], "args": {"name": s}} for s in streams]
    for span in spans:
        stream, name, start, end = span[:4]
        event = {"name": name, "ph": "X", "pid": pid, "tid": tid[stream],
                 "ts": (start - origin) * 1e6, "dur": max(end - start, 0.0) * 1e6}
        args = getattr(span, "args", None)
        if args:
            event["args"] = dict(args)
        events.append(event)
    for location, t, nbytes in counters:
        events.append({"name": f"pool bytes {location or 'default'}", "ph": "C", "pid": pid,
                       "ts": (t - origin) * 1e6, "args": {"bytes": nbytes}})
    with open(path, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)


def start_tracing(executor) -> None:
    executor.trace, executor._pending_trace = [], []
    if hasattr(executor, "pool_trace"):
        executor.pool_trace = []


def stop_tracing(executor):
    """The spans and pool counters recorded since ``start_tracing``; recording stops."""
    spans = executor.trace_events()
    counters = getattr(executor, "pool_trace", None) or []
    executor.trace = None
    if hasattr(executor, "pool_trace"):
        executor.pool_trace = None
    return spans, counters


def trace_iteration(net, path, feed=None) -> list:
    """Run one forward and backward of ``net`` with tracing on, write the trace, return the spans."""
    start_tracing(net.executor)
    try:
        if feed is not None:
            feed(net)
        net.forward()
        net.backward()
    finally:
        spans, counters = stop_tracing(net.executor)
    write_chrome_trace(spans, path, counters=counters)
    return spans
