"""Holding every loaded compute runtime to the thread budget (threads.py decides it): oneDNN's
OpenMP team, the BLAS and its threading layer, NumPy's own BLAS. Above both runtimes, so that
neither imports the other's set-up."""
from __future__ import annotations

from threadpoolctl import threadpool_limits

from . import blas, onednn, threads as _threads

_configured = False


def configure(threads=None, share=1, shared_by="ranks") -> _threads.Decision:
    """Decide (``threads``: the ``--threads`` flag; ``share``: ranks on these cores, or replicas
    of one process whose workers compute at once, ``shared_by``) and hold every loaded runtime
    to it. Called before the BLAS loads, the decision also picks MKL's threading layer."""
    global _configured
    _threads.request(threads, share)     # the flag, for the BLAS that loads next
    onednn.preload()                     # before the BLAS: one OpenMP runtime for both
    lib = blas.BLAS                      # loads the BLAS under this flag
    decision = _threads.settle(_threads.decide(threads, blas_name=lib.name, share=share, shared_by=shared_by))
    threadpool_limits(decision.threads, user_api="blas")     # another library's OpenMP pool is its own
    if lib.name == "mkl":
        blas.set_openblas_threads(1)    # NumPy's own BLAS runs nothing of size here
    if lib.name != "numpy":             # MKL loaded sequential (a budget of one) stays so
        lib.threads = 1 if lib.sequential else decision.threads
    lib.set_threads(decision.threads)
    _configured = True
    return decision


def ensure_configured() -> None:
    """Configure from the environment unless the command line (or a benchmark) already has."""
    if not _configured:
        configure(*_threads.requested())
