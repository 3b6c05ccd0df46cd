"""Element-wise and reduction kernels, on the calling thread or split over a pool of threads.

``split(n, work, fn)`` calls ``fn(rows)`` on contiguous slices of ``range(n)`` (images of a
batch, channels, outer rows) covering it once; ``work`` is the elements the call reads and
writes. NumPy releases the GIL inside its ufunc loops and einsum, so pieces on several threads
run in parallel. The bits never change with the pieces: every element is computed by the same
code, and a caller splits a reduction only over the axis it keeps (BatchNorm's sums per channel
are split over channels), so each sum adds in the same order.

By default the kernels run whole on the calling thread: these passes are bound by memory
bandwidth, which one core already takes on a small VM, and each piece's wake-up and GIL hand-off
is paid on top, so most nets' steps were slower with them (``tools/bench_threads.py
--alternate``; docs/benchmarks.md, "Kernel threads").

``SNCAFFE_KERNEL_THREADS=N`` (or ``KERNEL_THREADS``) deals the pieces over up to N threads of
the process's budget (``threads.current()``, the GEMMs' own: kernels and GEMMs run one after
the other, never together), for a machine whose memory bandwidth grows with its cores: one
thread per ``ELEMENTS_PER_THREAD`` elements of ``work`` (below that a wake-up costs more than it
saves), the pieces dealt out as threads ask for them (``PIECES_PER_THREAD`` each on average), the
calling thread working too, so a thread that another process keeps off its core takes fewer.
"""
from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from .. import config
from . import threads as _threads

# ~1 MiB of float32 per thread: ReLU runs it in ~40-80 us on one core, past a wake-up's cost.
ELEMENTS_PER_THREAD = 1 << 18
PIECES_PER_THREAD = 4



_PREFIX = "sncaffe-kernel"
_pool: ThreadPoolExecutor | None = None
_pool_key = (0, 0)              # (threads, process id): a forked child starts its own pool


def _executor(size: int) -> ThreadPoolExecutor:
    global _pool, _pool_key
    if _pool is None or _pool_key[0] < size or _pool_key[1] != os.getpid():
        if _pool is not None and _pool_key[1] == os.getpid():
            _pool.shutdown(wait=True)
        _pool, _pool_key = ThreadPoolExecutor(size, thread_name_prefix=_PREFIX), (size, os.getpid())
    return _pool


def threads_for(work: float, n: int) -> int:
    """Threads for ``work`` elements split into at most ``n`` pieces: sized to the work, at most
    the budget."""
    if config.settings.kernel_threads == 1:
        return 1
    budget = min(config.settings.kernel_threads, _threads.current().threads)
    return max(1, min(budget, n, int(work // ELEMENTS_PER_THREAD)))


def chunks(n: int, k: int) -> list[slice]:
    """``range(n)`` in ``k`` contiguous slices as even as they go."""
    return [slice(n * i // k, n * (i + 1) // k) for i in range(k)]


def split(n: int, work: float, fn) -> None:
    """``fn(rows)`` for contiguous slices ``rows`` covering ``range(n)``, on as many threads as
    ``work`` (elements touched) pays for; returns when all are done (re-raising an error)."""
    k = threads_for(work, n)
    if k == 1 or threading.current_thread().name.startswith(_PREFIX):    # a piece's own split: inline
        fn(slice(0, n))
        return
    # pieces of at least half a thread's share each: each costs a few microseconds of Python
    pieces = max(k, min(k * PIECES_PER_THREAD, int(2 * work // ELEMENTS_PER_THREAD)))
    parts = chunks(n, min(n, pieces))
    taken = iter(range(len(parts)))     # next() on it is atomic under the GIL

    def work_off():
        for i in taken:
            fn(parts[i])
    futures = [_executor(k - 1).submit(work_off) for _ in range(k - 1)]
    try:
        work_off()
    finally:
        # a thread that has not started yet finds nothing left: cancel it rather than wait for
        # it to be scheduled; one that started is waited for (its piece is being written)
        for f in futures:
            if not f.cancel():
                f.exception()
    for f in futures:
        if not f.cancelled():
            f.result()


def elementwise(fn, *arrays) -> None:
    """``fn(*pieces)`` on matching pieces of same-shaped NumPy arrays (None passes through as
    None), split over the first axis; flattened first where all are contiguous, so a batch of
    one splits too. Other arrays (CuPy's) go to ``fn`` whole."""
    given = [b for b in arrays if b is not None]
    if given[0].ndim == 0 or not all(type(b) is np.ndarray for b in given):
        fn(*arrays)
        return
    if all(b.flags.c_contiguous for b in given):
        arrays = tuple(None if b is None else b.reshape(-1) for b in arrays)
    n = next(b for b in arrays if b is not None).shape[0]
    split(n, given[0].size * len(given), lambda rows: fn(*(None if b is None else b[rows] for b in arrays)))
