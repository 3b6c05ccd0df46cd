"""The CPU device: NumPy arrays carved from one preallocated arena."""
from __future__ import annotations

import os

import numpy as np

from ..mem.pool import Pool, parse_bytes


def default_capacity() -> int:
    """Half of physical RAM: the arena is virtual until touched, so this costs nothing up front."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2
    except (ValueError, OSError, AttributeError):
        return 8 << 30


class CPUDevice:
    name = "cpu"
    xp = np

    def __init__(self, capacity=None):
        capacity = default_capacity() if capacity is None else parse_bytes(capacity)
        self.pool = Pool(capacity)
        self.arena = np.empty(self.pool.capacity, dtype=np.uint8)

    def alloc(self, shape, dtype=np.float32, name=None, zero=False):
        """A pool block and the array viewing it: returns (offset, array)."""
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        off = self.pool.alloc(nbytes, name)
        arr = self.arena[off:off + nbytes].view(dtype).reshape(shape)
        if zero:
            arr.fill(0)
        return off, arr

    def free(self, offset: int) -> None:
        self.pool.free(offset)

    def synchronize(self) -> None:
        pass

    def __repr__(self):
        return f"CPUDevice(capacity={self.pool.capacity})"
