"""What a long command shows: Caffe's log lines, and a progress bar when the output is a terminal.

``console()`` sends the "sncaffe" logger's INFO lines to stdout. When stdout
and stderr are both terminals it also draws a tqdm bar on stderr and writes
the log lines with ``tqdm.write`` so they scroll above the bar; otherwise
(a pipe, CI, a file) the lines carry glog's prefix, as Caffe's do, so Caffe's
log tools (tools/extra/parse_log.py) read them.
"""
from __future__ import annotations

import logging
import os
import sys
import time
from contextlib import contextmanager

log = logging.getLogger("sncaffe")


def is_terminal() -> bool:
    return all(getattr(f, "isatty", lambda: False)() for f in (sys.stdout, sys.stderr))


def rate(images, seconds, unit="images/s", iterations=0) -> str:
    """A throughput that never reads 0: three significant digits (whole numbers from 100 on),
    and with ``iterations`` the seconds per iteration where an iteration takes over a second."""
    r = images / max(seconds, 1e-9)
    text = f"{r:.0f} {unit}" if r >= 100 else f"{r:.3g} {unit}"
    if iterations and seconds > iterations:
        text += f", {seconds / iterations:.3g} s/iteration"
    return text


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
