"""MPI through mpi4py: the job's ranks, stopping them all on an error, and gradients summed by MPI.

``world()`` is ``MPI.COMM_WORLD`` when the process was started by
``mpiexec`` (MPICH's or Open MPI's launch variables are set), else None, so
a plain ``sncaffe train`` never imports mpi4py. ``abort_on_error`` is how a
failing rank stops every rank: it prints its message and calls
``MPI_Abort``, since a rank that merely exited would leave the others
waiting in a collective (and in ``MPI_Finalize``) forever. A rank that is
killed is seen by ``mpiexec``, which ends the others.

``MPIReducer`` all-reduces a gradient bucket through a host buffer: on the
CPU device a block of its host pool, on a GPU without NCCL pinned memory;
``MPI_Iallreduce``, tested with growing sleeps, so that a rank waiting for
the others leaves its core to the computation.
"""
from __future__ import annotations

import os
import sys
import time
import traceback
from contextlib import contextmanager

import numpy as np

INSTALL_HINT = "pip install 'sncaffe[mpi]' (mpi4py and MPICH from PyPI)"
# Set in each rank's environment by MPICH/Intel MPI (PMI), Open MPI and PMIx launchers.
LAUNCH_VARIABLES = ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS")
ABORT_DELAY = 0.5           # seconds between a failing rank's message and MPI_Abort
POLL_SPINS, POLL_LONGEST = 20, 5e-4     # tests before sleeping, longest sleep (s), waiting for an all-reduce


def launched() -> bool:
    """Whether this process was started by an MPI launcher (mpiexec, mpirun)."""
    return any(v in os.environ for v in LAUNCH_VARIABLES)


def import_mpi():
    """mpi4py's MPI module, or a RuntimeError saying what to install."""
    try:
        from mpi4py import MPI
    except ImportError as e:
        raise RuntimeError(f"data parallel training needs mpi4py, which cannot be imported ({e}): "
                           f"{INSTALL_HINT}") from None
    return MPI


def world():
    """``MPI.COMM_WORLD`` under mpiexec; None in a process not started by an MPI launcher."""
    return import_mpi().COMM_WORLD if launched() else None


def local_rank(comm) -> int:
    """This rank's index among the ranks on its machine (which GPU it takes)."""
    MPI = import_mpi()
    return comm.Split_type(MPI.COMM_TYPE_SHARED).Get_rank()


def agree_seed(comm, seed: int) -> int:
    """Rank 0's seed on every rank; a negative one (random_seed unset) is drawn once, by rank 0."""
    if comm.Get_rank() == 0 and seed < 0:
        seed = int(np.random.SeedSequence().entropy % 2**63)
    return comm.bcast(seed, root=0)


def message(error: BaseException) -> str:
    """An exception as one line, as the sncaffe command prints errors."""
    if isinstance(error, KeyboardInterrupt):
        return "interrupted"
    if isinstance(error, OSError) and error.strerror:
        where = f"{error.filename}: " if error.filename else ""
        return f"{where}{error.strerror}"
    return " ".join((str(error) or type(error).__name__).split())


@contextmanager
def abort_on_error(comm, prog="sncaffe"):
    """Run the block; if it raises, print ``PROG: rank R of N: error: ...`` and abort every rank."""
    try:
        yield
    except SystemExit as e:
        if e.code in (0, None):
            raise
        _abort(comm, prog, f"exit status {e.code}")
    except BaseException as e:
        expected = (ValueError, MemoryError, RuntimeError, OSError, KeyboardInterrupt)
        if not isinstance(e, expected):         # a bug: the traceback helps
            traceback.print_exc()
        _abort(comm, prog, message(e))


def _abort(comm, prog, text):
    print(f"{prog}: rank {comm.Get_rank()} of {comm.Get_size()}: error: {text}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    # Closed, and a moment given, so the launcher has forwarded what this rank wrote before the
    # abort tears the job down (else the message can be lost).
    for stream in (sys.stdout, sys.stderr):
        try:
            os.close(stream.fileno())
        except (OSError, ValueError, AttributeError):      # not a real file (a test's capture)
            pass
    time.sleep(ABORT_DELAY)
    comm.Abort(1)


def allreduce_max(comm, flags: np.ndarray, hurry=None) -> None:
    """``flags`` (int32) becomes its maximum over the ranks, in place (``hurry``: see wait_polling)."""
    MPI = import_mpi()
    wait_polling(comm.Iallreduce(MPI.IN_PLACE, flags, op=MPI.MAX), hurry=hurry)


def wait_polling(request, spins=POLL_SPINS, longest=POLL_LONGEST, hurry=None) -> None:
    """Wait for a non-blocking MPI request, sleeping between tests once it takes a while.

    A blocking MPI call busy-waits: on the comm thread it would take a core
    from this rank's backward (and the other ranks') while the slowest rank
    catches up. Testing with growing sleeps leaves the core to the
    computation, at the price of up to ``longest`` seconds of latency.
    ``hurry()`` true: this rank computes nothing more until the request is
    done (its update waits for it), so it is waited for in MPI itself, which
    drives the collective without the GIL. (Testing in a loop is no substitute:
    each ``time.sleep(0)`` between tests cost tens of microseconds, and MPICH
    needs many tests to finish one all-reduce: 50 KB between 2 ranks took a
    median 449 us tested with ``sleep(0)``, 20 us in ``Wait``, 15 us blocking.)
    """
    delay = 0.0
    while not request.Test():
        if hurry is not None and hurry():
            request.Wait()
            return
        time.sleep(delay)               # 0: only lets the other threads run
        spins -= 1
        if spins < 0:
            delay = min(max(2 * delay, 1e-5), longest)


class _Started:
    """An all-reduce already under way: its MPI request."""

    def __init__(self, request):
        self.request = request


class MPIReducer:
    """Sums a bucket over the ranks with ``MPI_Iallreduce`` on a host buffer, then divides by N."""
    name = "MPI"

    def __init__(self, comm, device):
        self.MPI = import_mpi()
        self.comm, self.device = comm, device
        self.size = comm.Get_size()
        self._blocks = []
        self.hurry = None       # () -> bool: nothing is left to compute before the update (wait_polling)

    def allocate(self, bucket) -> None:
        off, raw = self.device.host_alloc(max(bucket.nbytes, 1), f"all-reduce {bucket.name}")
        self._blocks.append(off)
        bucket.buffer = raw[:bucket.nbytes].view(bucket.dtype)

    def before(self, bucket):
        """On the issuing thread, when the all-reduce operator is issued: on a GPU (no NCCL), an event
        on its compute stream after the gradients' kernels; nothing on a CPU."""
        record = getattr(self.device, "record", None)
        return record() if record is not None else None

    def start(self, bucket, arrays):
        """On the issuing thread, once the gradients are complete (NumPy arrays): into the bucket's
        buffer, and the all-reduce started; ``reduce`` gets the request as its token."""
        if not all(isinstance(a, np.ndarray) for a in arrays):
            return self.before(bucket)
        self._copy_in(bucket, arrays)
        return _Started(self.comm.Iallreduce(self.MPI.IN_PLACE, bucket.buffer, op=self.MPI.SUM))

    def _copy_in(self, bucket, arrays):
        buf = bucket.buffer
        for s, a in zip(bucket.slots, arrays):
            view = buf[s.offset:s.offset + s.size].reshape(s.shape)
            if isinstance(a, np.ndarray):
                np.copyto(view, a)
            else:
                a.get(out=view)                 # a CuPy array: device to host

    def reduce(self, bucket, arrays, token=None) -> None:
        """The all-reduce operator's work, on the comm stream: ``arrays`` (the bucket's gradients,
        where they are now) into the bucket's host buffer, summed over the ranks, averaged, back
        (``token``: a GPU event to wait for first, or the request ``start`` began)."""
        buf = bucket.buffer
        if isinstance(token, _Started):
            request = token.request
        else:
            if token is not None:
                token.wait()                        # the gradients' kernels are done
            self._copy_in(bucket, arrays)
            request = self.comm.Iallreduce(self.MPI.IN_PLACE, buf, op=self.MPI.SUM)
        wait_polling(request, hurry=self.hurry)
        buf *= bucket.dtype.type(1.0 / self.size)
        for s, a in zip(bucket.slots, arrays):
            view = buf[s.offset:s.offset + s.size].reshape(s.shape)
            if isinstance(a, np.ndarray):
                np.copyto(a, view)
            else:
                a.set(view)
        if token is not None and not isinstance(token, _Started):     # copies back done before the update reads them
            self.device.xp.cuda.get_current_stream().synchronize()

    def close(self) -> None:
        for off in self._blocks:
            self.device.host_free(off)
        self._blocks = []
