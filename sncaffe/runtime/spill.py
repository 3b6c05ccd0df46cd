"""The disk tier: a spill file that offloaded values go to when the host pool cannot hold
them (ZeRO-Infinity's NVMe offload, on the same copy streams as host offloads).

One file per device, made in the spill directory (``--spill DIR``, else the system's
temporary directory) and unlinked at once: it has no name to leave behind, whatever
way the process ends, and its blocks are freed with it. Offsets come from a Pool, as
the device's blocks do, so the file's peak size is what the planner simulated. A
full disk is an error naming the directory and the file.

Parameter state the host pool cannot hold (parameters, gradients, solver history) lives in
the same file for the whole run: ``view`` maps its block as an array, so the solver, the
fillers and snapshots use it like a host array, while the executor moves it to and from the
device with pread/pwrite on the copy streams. The mapping's pages are page cache, not the
process's memory: a trimmer thread drops them from the resident set every few milliseconds
(MADV_DONTNEED on a shared file mapping loses nothing: written bytes stay in the page cache,
and a later touch maps them again), so resident memory stays within the planned pools.
"""
from __future__ import annotations

import atexit
import errno
import mmap
import os
import shutil
import tempfile
import threading
import weakref

import numpy as np

from . import streams
from .pool import Pool

UNBOUNDED = 1 << 50
WINDOW = 256 << 20          # bytes mapped at a time for views (few mappings, whatever the net)
TRIM_PERIOD = 0.02          # seconds between drops of the mapped pages from the resident set

_open: "weakref.WeakSet[SpillFile]" = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    """At exit: the streams' copies to and from the files first, then the files and their trimmers."""
    streams.close_all()
    for spill in list(_open):
        spill.close()


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
        self._maps = []              # (file offset, mmap, uint8 array over it)
        self._trimmer = None
        self._stop = threading.Event()
        _open.add(self)

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

    def view(self, offset, nbytes, dtype, shape):
        """An array over the file's block at ``offset`` (a shared mapping: what it writes is the
        file's bytes, what pwrite writes it reads)."""
        import numpy as np
        for base, mm, raw in self._maps:
            if base <= offset and offset + nbytes <= base + len(mm):
                break
        else:
            base = offset - offset % mmap.ALLOCATIONGRANULARITY
            size = max(WINDOW, offset + nbytes - base)
            size = -(-size // mmap.PAGESIZE) * mmap.PAGESIZE
            if os.fstat(self.fd).st_size < base + size:
                try:
                    os.ftruncate(self.fd, base + size)      # sparse: the disk fills as it is written
                except OSError as e:
                    raise SpillFull(e.errno, f"cannot grow the spill file {self.path} (deleted, in "
                                             f"{self.directory}): {e.strerror}", self.path) from None
            mm = mmap.mmap(self.fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE, offset=base)
            raw = np.frombuffer(mm, np.uint8)
            self._maps.append((base, mm, raw))
            if self._trimmer is None:
                self._trimmer = threading.Thread(target=self._trim_loop, name="spill trimmer", daemon=True)
                self._trimmer.start()
        return raw[offset - base:offset - base + nbytes].view(dtype).reshape(shape)

    def trim(self) -> None:
        """Drop the mapped pages from the resident set (their bytes stay in the page cache)."""
        for _, mm, _ in list(self._maps):
            mm.madvise(mmap.MADV_DONTNEED)

    def _trim_loop(self):
        while not self._stop.wait(TRIM_PERIOD):
            self.trim()

    def close(self) -> None:
        self._stop.set()
        trimmer = self._trimmer
        if trimmer is not None and trimmer is not threading.current_thread():
            trimmer.join()                  # no madvise on a mapping once it may be gone
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


def spill_peak(device) -> int:
    """The most the device's spill file held (0 where none was made)."""
    spill = getattr(device, "_spill", None)
    return spill.pool.peak if spill is not None else 0
