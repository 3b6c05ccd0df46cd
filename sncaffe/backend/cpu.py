"""The CPU device: NumPy arrays carved from one preallocated arena."""
from __future__ import annotations

import logging
import math
from contextlib import nullcontext

import numpy as np

from ..runtime.pool import Pool
from ..runtime.budget import physical_ram, process_memory, ram_budget
from . import fused, runtimes
from ..sizes import fmt_bytes, parse_bytes
from ..runtime.streams import Stream

log = logging.getLogger("sncaffe")


def pools_ram(share=1) -> int:
    """The RAM the CPU device's pools may take together: this process's part (of ``share``
    processes taking theirs at once) of what the machine can give now, less the room the
    element-wise kernels will take where they are not loaded yet."""
    return ram_budget() // max(1, share) - fused.pending_bytes()


def default_capacity() -> int:
    """Half of physical RAM (what the CUDA device's pinned host pool is sized from)."""
    return physical_ram() // 2


class CPUDevice:
    name = kind = "cpu"
    host_streams = True     # operators run on this device's own host streams (runtime/dispatcher.py)
    xp = np
    spills = True           # a disk tier: offloads the host pool cannot hold go to a spill file
    spill_dir = None        # where (None: the system's temporary directory)

    def __init__(self, capacity=None, host_capacity=None, share=1):
        runtimes.ensure_configured()        # the compute runtimes held to the thread budget
        # Device and host pools are one RAM here. Unless both are given, each may take the RAM
        # this machine can give now (available RAM less a margin, see runtime/budget.py) and the
        # plan keeps their peaks together under it (``ram``). The arenas are virtual until
        # touched, so their size costs nothing up front. The element-wise kernels, loaded at the
        # first iteration (numba's JIT), get their room in it where they are not loaded yet.
        # ``share``: processes on this machine that take their RAM at the same moment (MPI ranks),
        # each planned within its part: the plans spend the RAM they are given.
        budget = pools_ram(share)
        self.ram = budget if capacity is None or host_capacity is None else None
        self.rss_at_budget = process_memory()["rss"]     # what the process held when ``ram`` was taken
        given = capacity
        capacity = budget if capacity is None else parse_bytes(capacity)
        if given is not None and self.ram is not None and capacity > self.ram:
            log.warning("device memory %s is more than the %s of RAM this process can use now: the plan "
                        "keeps the device and host pools together within %s", fmt_bytes(capacity),
                        fmt_bytes(self.ram), fmt_bytes(self.ram))
        self.pool = Pool(capacity)
        host = budget if host_capacity is None else parse_bytes(host_capacity)
        self.host_pool = Pool(host)
        self._arena = self._host_arena = None
        self._streams = {}

    # The arenas are mapped on first use (the host's only where something is offloaded): virtual
    # until touched, but counted against an address-space limit (ulimit -v, runtime/budget.py).
    @property
    def arena(self) -> np.ndarray:
        if self._arena is None:
            self._arena = np.empty(self.pool.capacity, dtype=np.uint8)
        return self._arena

    @property
    def host_arena(self) -> np.ndarray:
        if self._host_arena is None:
            self._host_arena = np.empty(self.host_pool.capacity, dtype=np.uint8)
        return self._host_arena

    def stream(self, name: str) -> Stream:
        """The ``d2h`` and ``h2d`` copy streams (started on first use)."""
        if name not in self._streams:
            self._streams[name] = Stream(name)
        return self._streams[name]

    def host_alloc(self, nbytes: int, name=None):
        """A block of the host pool for an offloaded tensor: (offset, uint8 array)."""
        off = self.host_pool.alloc(nbytes, name)
        return off, self.host_arena[off:off + nbytes]

    def host_free(self, offset: int) -> None:
        self.host_pool.free(offset)

    def copy_to_host(self, host, array, after=None):
        """Copy a device array into host bytes on the d2h stream; returns the event."""
        return self.stream("d2h").submit(lambda: _copy(host, array, after))

    def copy_to_device(self, array, host, after=None):
        """Copy host bytes into a device array on the h2d stream; returns the event."""
        return self.stream("h2d").submit(lambda: _copy(array, host, after))

    def alloc(self, shape, dtype=np.float32, name=None, zero=False):
        """A pool block and the array viewing it: returns (offset, array)."""
        dtype = np.dtype(dtype)
        nbytes = math.prod(map(int, shape)) * dtype.itemsize      # (np.prod: microseconds per call)
        off = self.pool.alloc(nbytes, name)
        arr = self.arena[off:off + nbytes].view(dtype).reshape(shape)
        if zero:
            arr.fill(0)
        return off, arr

    def free(self, offset: int) -> None:
        self.pool.free(offset)

    def synchronize(self) -> None:
        for stream in self._streams.values():
            stream.synchronize()

    def synchronize_compute(self) -> None:
        """Compute runs on the calling thread: done when the call returns."""

    def wait_event(self, event, stream="compute") -> None:
        """Order later compute after ``event``: compute is the host here, so the host waits."""
        event.wait()

    def active(self):
        """The device current inside the block (nothing to switch on the CPU)."""
        return nullcontext(self)

    def __repr__(self):
        return f"CPUDevice(capacity={self.pool.capacity})"


def _copy(dst, src, after):
    if after is not None:
        after.wait()                       # a copy this one depends on (another stream)
    np.copyto(dst.reshape(-1).view(np.uint8), src.reshape(-1).view(np.uint8))   # bytes either way
