"""Where communication hides behind computation: one training iteration traced, and the share measured.

``IterationTrace(solver, path, iteration)`` records iteration ``iteration``
of ``solver.solve()``: every operator on the compute stream, every copy on
the d2h/h2d streams, every all-reduce on the comm stream, the wait for the
all-reduce and the update, and writes them as Chrome trace JSON
(chrome://tracing, https://ui.perfetto.dev). ``overlap(spans)`` measures
how much of the all-reduce time ran while backward was computing.
"""
from __future__ import annotations

import logging
import time

from ..trace import start_tracing, stop_tracing, write_chrome_trace

log = logging.getLogger("sncaffe")


def _union(intervals) -> list:
    out = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return out


def _length(intervals) -> float:
    return sum(end - start for start, end in intervals)


def _intersection(a, b) -> float:
    """Length of the intersection of two sorted unions of intervals."""
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def _kind(stream) -> str:
    return stream.rpartition("/")[2]


def _statistics(name) -> bool:
    """A cross-replica BatchNorm's exchange of batch sums (parallel/sync_bn.py): not a gradient's."""
    return name.startswith("exchange ")


def overlap(spans) -> dict:
    """Seconds of gradient exchange (``comm``), of backward compute, and how much of the first hid
    behind the second.

    ``hidden_share`` is the gradient exchange time (the all-reduce or summing operators on a
    comm stream) during which a backward operator (a BatchNorm's stages included) was running,
    over all of it (1.0: none of it delays the update). A cross-replica BatchNorm's exchanges of
    batch sums are not gradient exchange: the next stage of that layer waits for each, so none
    can hide by design; their time is ``statistics_s``.

    ``exposed_s`` is the gradient exchange time after the last backward operator ended: what the
    update waits for, so what the exchange adds to the iteration; ``in_backward_share`` is the
    rest over all of it. It differs from ``hidden_share`` by the exchange time that fell in
    backward's gaps: while the compute stream waited for a BatchNorm's batch sums, or for the GIL.
    """
    comm = _union((s[2], s[3]) for s in spans if _kind(s[0]) == "comm" and not _statistics(s[1]))
    statistics = _union((s[2], s[3]) for s in spans if _statistics(s[1]))
    backward = _union((s[2], s[3]) for s in spans if _kind(s[0]) == "compute" and ":backward" in s[1])
    comm_s = _length(comm)
    hidden = _intersection(comm, backward)
    end = backward[-1][1] if backward else float("-inf")
    exposed = _length([(max(a, end), b) for a, b in comm if b > end])
    return {"comm_s": comm_s, "backward_s": _length(backward), "hidden_s": hidden,
            "hidden_share": hidden / comm_s if comm_s else 0.0, "statistics_s": _length(statistics),
            "exposed_s": exposed, "in_backward_share": 1 - exposed / comm_s if comm_s else 0.0}


class IterationTrace:
    """Records one iteration of a solver's training and writes its Chrome trace (a solver callback)."""

    def __init__(self, solver, path, iteration=None):
        self.solver, self.path = solver, str(path)
        self.iteration = solver.iter + 1 if iteration is None else iteration
        self.spans = None
        solver.callbacks.append(self)
        if solver.iter == self.iteration:
            self._arm()

    def _arm(self):
        start_tracing(self.solver.net.executor)

    def __call__(self, iteration, loss, lr):
        if iteration == self.iteration:          # the update before the traced iteration is done
            self._arm()
        elif iteration == self.iteration + 1:
            spans, counters = stop_tracing(self.solver.net.executor)
            last = max((s[3] for s in spans if _kind(s[0]) == "compute"), default=time.perf_counter())
            spans.append(("compute", "update", last, time.perf_counter()))
            write_chrome_trace(spans, self.path, counters=counters)
            self.spans = spans
            o = overlap(spans)
            comm = (f"; all-reduce {o['comm_s'] * 1e3:.1f} ms, {100 * o['hidden_share']:.0f}% of it hidden behind "
                    f"backward's operators, {o['exposed_s'] * 1e3:.2f} ms after backward" if o["comm_s"] else "")
            log.info("Trace of iteration %d written to %s: %d spans%s", self.iteration, self.path, len(spans), comm)
