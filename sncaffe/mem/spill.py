"""The disk tier: a spill file that offloaded values go to when the host pool cannot hold
them (ZeRO-Infinity's NVMe offload, on the same copy streams as host offloads).

One file per device, made in the spill directory (``--spill DIR``, else the system's
temporary directory) and unlinked at once: it has no name to leave behind, whatever
way the process ends, and its blocks are freed with it. Offsets come from a Pool, as
the device's blocks do, so the file's peak size is what the planner simulated. A
full disk is an error naming the directory and the file.
"""
from __future__ import annotations

import errno
import os
import shutil
import tempfile

import numpy as np

from .pool import Pool

UNBOUNDED = 1 << 50


class SpillFull(OSError):
    pass


class SpillFile:
    def __init__(self, directory=None):
        self.directory = str(directory or tempfile.gettempdir())
        try:
            os.makedirs(self.directory, exist_ok=True)
            fd, self.path = tempfile.mkstemp(prefix="sncaffe-spill-", suffix=".bin", dir=self.directory)
        except OSError as e:
            raise OSError(e.errno, f"cannot make a spill file in {self.directory}: {e.strerror}",
                          self.directory) from None
        os.unlink(self.path)         # removed already: the blocks go when the process does
        self.fd = fd
        self.pool = Pool(UNBOUNDED)

    def free_space(self) -> int:
        return shutil.disk_usage(self.directory).free

    def alloc(self, nbytes, name=None) -> int:
        return self.pool.alloc(max(nbytes, 1), name)

    def free(self, offset) -> None:
        self.pool.free(offset)

    def write(self, offset, array) -> None:
        view = memoryview(np.ascontiguousarray(array).reshape(-1).view(np.uint8))
        done = 0
        try:
            while done < len(view):
                done += os.pwrite(self.fd, view[done:], offset + done)
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise SpillFull(e.errno, f"the disk is full: cannot write {len(view)} bytes to the spill file "
                                         f"{self.path} (deleted, in {self.directory}); give --spill a "
                                         f"directory with more room", self.path) from None
            raise OSError(e.errno, f"spill file {self.path}: {e.strerror}", self.path) from None

    def read(self, offset, array) -> None:
        view = memoryview(array.reshape(-1).view(np.uint8))
        done = 0
        while done < len(view):
            n = os.preadv(self.fd, [view[done:]], offset + done)
            if n <= 0:
                raise OSError(errno.EIO, f"spill file {self.path}: short read at {offset + done}", self.path)
            done += n

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


def spill_room(directory=None) -> int:
    """What the disk tier may take: the spill directory's free space less a tenth of it."""
    path = os.path.abspath(str(directory or tempfile.gettempdir()))
    while not os.path.isdir(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)         # a directory still to be made: the disk it will be on
    try:
        return int(shutil.disk_usage(path).free * 0.9)
    except OSError:
        return 0


def spill_of(device):
    """The device's spill file, made on first use in ``device.spill_dir``."""
    spill = getattr(device, "_spill", None)
    if spill is None:
        spill = device._spill = SpillFile(getattr(device, "spill_dir", None))
    return spill
