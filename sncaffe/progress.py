"""What a long command shows: Caffe's log lines, and a progress bar when the output is a terminal.

``console()`` sends the "sncaffe" logger's INFO lines to stdout. When stdout
and stderr are both terminals it also draws a tqdm bar on stderr and writes
the log lines with ``tqdm.write`` so they scroll above the bar; otherwise
(a pipe, CI, a file) the lines carry glog's prefix, as Caffe's do, so Caffe's
log tools (tools/extra/parse_log.py) read them.
"""
from __future__ import annotations

import logging
import math
import os
import sys
import time
from contextlib import contextmanager

log = logging.getLogger("sncaffe")


def sig3(x) -> str:
    """``x`` to 3 significant digits in plain notation: 1370, 1.60, 0.00980 (never rounded to 0)."""
    x = float(x)
    if x == 0 or not math.isfinite(x):
        return f"{x:g}"
    x = round(x, 2 - math.floor(math.log10(abs(x))))          # 99.96 -> 100.0: its digits again
    return f"{x:.{max(0, 2 - math.floor(math.log10(abs(x))))}f}"


def duration(seconds) -> str:
    """A time a person reads at a glance: 42s, 2m05s, 2h48m, 3d04h."""
    s = max(0, int(round(seconds)))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def rate(iterations, seconds, images=0) -> str:
    """``1.23 iter/s, 78.7 images/s``; under one iteration a second also its seconds per iteration."""
    per_s = iterations / max(seconds, 1e-9)
    text = f"{sig3(per_s)} iter/s" + (f", {sig3(1 / per_s)} s/iter" if 0 < per_s < 1 else "")
    return text + (f", {sig3(per_s * images)} images/s" if images else "")


class Pace:
    """Rate and time left of a run of iterations, as a log line reads them: ``Iteration 10
    (0.00980 iter/s, 102 s/iter, 1.60 images/s), ETA 2h48m``. ``mark(i)`` is called when
    iteration ``i``'s passes are done (its update aside), so from one mark to the next exactly
    their difference of iterations ran, and the first mark counts one."""

    def __init__(self, start, stop, images=0, clock=time.perf_counter):
        self.start, self.stop, self.images, self.clock = start, stop, images, clock
        self.t0 = self.t = clock()
        self.last = start - 1

    def mark(self, iteration) -> str:
        now = self.clock()
        text = rate(iteration - self.last, now - self.t, self.images)
        done, left = iteration - self.start + 1, self.stop - iteration - 1
        eta = duration(left * (now - self.t0) / done) if done > 0 and left > 0 else "0s"
        self.t, self.last = now, iteration
        return f"({text}), ETA {eta}"


def is_terminal() -> bool:
    return all(getattr(f, "isatty", lambda: False)() for f in (sys.stdout, sys.stderr))


class GlogFormatter(logging.Formatter):
    """``I1130 08:33:12.123456 4242 solver.py:301] message``: glog's prefix."""

    def format(self, record):
        t = time.localtime(record.created)
        us = int(record.created % 1 * 1e6)
        return (f"{record.levelname[0]}{time.strftime('%m%d %H:%M:%S', t)}.{us:06d} {record.process} "
                f"{record.filename}:{record.lineno}] {record.getMessage()}")


class ShortFormatter(logging.Formatter):
    """``08:33:12 message`` on a terminal; warnings and errors say so."""

    def format(self, record):
        level = "" if record.levelno < logging.WARNING else record.levelname.lower() + ": "
        return f"{time.strftime('%H:%M:%S', time.localtime(record.created))} {level}{record.getMessage()}"


class _TqdmHandler(logging.Handler):
    def emit(self, record):
        from tqdm import tqdm
        try:
            tqdm.write(self.format(record), file=sys.stdout)
        except Exception:
            self.handleError(record)


class _StdoutHandler(logging.StreamHandler):
    """Log lines to stdout; when stdout fails (a closed pipe, a full disk) the run goes on without
    them: one note on stderr, and stdout pointed at the null device so nothing else fails there."""

    def handleError(self, record):
        e = sys.exc_info()[1]
        if not isinstance(e, OSError):
            return super().handleError(record)
        try:
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, sys.stdout.fileno())
            os.close(null)
            sys.stderr.write(f"sncaffe: cannot write the log to stdout ({e.strerror or e}); "
                             "the log lines are dropped from here on\n")
        except (OSError, ValueError):
            pass


class _NoBar:
    def update(self, n=1, status=None):
        pass

    def close(self):
        pass


class Bar:
    """A tqdm bar on stderr; ``status`` is the text after the counts (loss, lr, ...)."""

    def __init__(self, total, initial=0, desc=None, unit="it"):
        from tqdm import tqdm
        try:
            sized = os.get_terminal_size(sys.stderr.fileno()).columns > 0
        except (OSError, ValueError, AttributeError):
            sized = False
        # A terminal that reports no size (some ptys) would get an empty bar.
        self._bar = tqdm(total=total, initial=initial, desc=desc, unit=unit, file=sys.stderr,
                         dynamic_ncols=sized, ncols=None if sized else 100,
                         nrows=None if sized else 24, leave=True)

    def update(self, n=1, status=None):
        if status is not None:
            self._bar.set_postfix_str(status, refresh=False)
        self._bar.update(n)

    def close(self):
        self._bar.close()


class Console:
    def __init__(self, bar: bool):
        self.bar = bar

    def progress(self, total, initial=0, desc=None, unit="it"):
        """A progress bar on a terminal, else an object whose methods do nothing."""
        return Bar(total, initial, desc, unit) if self.bar else _NoBar()


@contextmanager
def console(bar: bool | None = None):
    """Show the "sncaffe" logger's INFO lines on stdout while the block runs; yields a Console."""
    bar = is_terminal() if bar is None else bar
    handler = _TqdmHandler() if bar else _StdoutHandler(sys.stdout)
    handler.setFormatter(ShortFormatter() if bar else GlogFormatter())
    saved = log.level, log.propagate
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False                   # shown once, here, not again by a root handler
    try:
        yield Console(bar)
    finally:
        log.removeHandler(handler)
        log.setLevel(saved[0])
        log.propagate = saved[1]


def pool_peaks(net) -> str:
    """The device pool's peak; with several locations (replicas, placement), each one's."""
    from .sizes import fmt_bytes
    devices = net.devices
    if len({id(d) for d in devices.values()}) == 1:
        return fmt_bytes(net.device.pool.peak)
    total = sum(d.pool.peak for d in devices.values())
    return fmt_bytes(total) + " (" + ", ".join(f"{loc or 'main'} {fmt_bytes(d.pool.peak)}"
                                              for loc, d in devices.items()) + ")"


class TrainProgress:
    """Solver callback: the bar's iteration count, loss, lr, images/s and the pool's peak."""

    def __init__(self, con, solver):
        self.solver, self.con, self.bar, self.start = solver, con, None, None
        self.t, self.rate = time.perf_counter(), None

    def __call__(self, iteration, loss, lr):
        if self.bar is None:                # made here: a resumed run starts at the restored iteration
            self.start = iteration - 1
            self.bar = self.con.progress(self.solver.param.max_iter, self.start, desc="train")
        now = time.perf_counter()
        rate = self.solver.images_per_iter / max(now - self.t, 1e-9)
        self.t = now
        self.rate = rate if self.rate is None else 0.9 * self.rate + 0.1 * rate
        self.bar.update(1, f"loss={float(loss):.6g}, lr={float(lr):.6g}, {sig3(self.rate)} img/s, "
                           f"peak {pool_peaks(self.solver.net)}")

    def close(self):
        if self.bar is not None:
            self.bar.close()


class StepProgress:
    """Progress within one iteration, for nets whose iterations are long (thousands of layers):
    a second bar on a terminal, else a log line at each quarter of the iteration and at least
    every ``EVERY`` seconds (a quarter of ResNet-2500's iteration takes minutes)."""
    EVERY = 10.0

    def __init__(self, con, net, solver):
        self.steps = sum(1 for ins in net.plan.schedule if ins.kind == "run")
        self.con, self.solver, self.bar, self.done, self.quarter = con, solver, None, 0, 0
        self.said = time.perf_counter()

    def __call__(self, op, recompute):
        now = time.perf_counter()
        if self.bar is None:
            self.bar = self.con.progress(self.steps, desc=f"iteration {self.solver.iter}", unit="op")
            self.done = self.quarter = 0
            self.began = now
        self.done += 1
        self.bar.update(1, op.name)
        if not self.con.bar and (self.done * 4 // self.steps > self.quarter or now - self.said >= self.EVERY):
            self.quarter, self.said = self.done * 4 // self.steps, now
            # the whole run at the pace of this pass so far: an estimate before the first iteration ends
            per_iter = (now - self.began) * self.steps / self.done
            left = per_iter * (self.solver.param.max_iter - self.solver.iter) - (now - self.began)
            log.info("Iteration %d: %d%% of the pass (%s), about %s s/iter, ETA %s", self.solver.iter,
                     100 * self.done // self.steps, op.name + (" (recompute)" if recompute else ""),
                     sig3(per_iter), duration(left))
        if self.done >= self.steps:
            self.bar.close()
            self.bar = None
