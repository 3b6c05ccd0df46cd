"""Chrome trace JSON (chrome://tracing, Perfetto) of what ran on which stream, and when."""
from __future__ import annotations

import json
import os


def write_chrome_trace(spans, path, pid=None, origin=None) -> None:
    """``spans``: (stream, name, start, end) in perf_counter seconds; one trace row per stream."""
    pid = os.getpid() if pid is None else pid
    origin = min((s[2] for s in spans), default=0.0) if origin is None else origin
    streams = sorted({s[0] for s in spans}, key=lambda x: ("compute", "d2h", "h2d", "comm").index(x)
                     if x in ("compute", "d2h", "h2d", "comm") else 9)
    tid = {name: i for i, name in enumerate(streams)}
    events = [{"name": "thread_name", "ph": "M", "pid": pid, "tid": tid[s], "args": {"name": s}} for s in streams]
    for stream, name, start, end in spans:
        events.append({"name": name, "ph": "X", "pid": pid, "tid": tid[stream],
                       "ts": (start - origin) * 1e6, "dur": max(end - start, 0.0) * 1e6})
    with open(path, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)


def trace_iteration(net, path, feed=None) -> list:
    """Run one forward and backward of ``net`` with tracing on, write the trace, return the spans."""
    net.executor.trace, net.executor._pending_trace = [], []
    try:
        if feed is not None:
            feed(net)
        net.forward()
        net.backward()
        spans = net.executor.trace_events()
    finally:
        net.executor.trace = None
    write_chrome_trace(spans, path)
    return spans
