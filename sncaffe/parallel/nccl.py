"""Gradients all-reduced between GPUs by NCCL, through CuPy's bindings (``cupy.cuda.nccl``).

One communicator per job, its id made by rank 0 and sent to the others over
MPI. Each bucket has a buffer in the GPU's arena; its gradients are packed
into it on the compute stream (in order after the backward that made them),
and the all-reduce runs on a stream of its own ("comm"), ordered after the
packing by an event, so it overlaps the rest of backward. The comm thread
issues it and waits for it, which is what the trace shows. Needs the NCCL
library CuPy loads (``pip install nvidia-nccl-cu12``, or -cu13).
"""
from __future__ import annotations

import time

import numpy as np


def nccl_available() -> bool:
    """Whether CuPy is installed and can load NCCL."""
    try:
        from cupy.cuda import nccl
    except ImportError:
        return False
    return bool(getattr(nccl, "available", True))


def nccl_usable(device) -> bool:
    """Whether ``device`` is a GPU and CuPy can load NCCL."""
    return str(getattr(device, "name", "")).startswith("cuda") and nccl_available()


class NCCLReducer:
    """Sums a bucket over the ranks with ``ncclAllReduce`` on a device buffer, then divides by N."""
    name = "NCCL"

    def __init__(self, comm, device):
        from cupy.cuda import nccl
        self.nccl, self.device, self.cp = nccl, device, device.xp
        self.size, rank = comm.Get_size(), comm.Get_rank()
        uid = comm.bcast(nccl.get_unique_id() if rank == 0 else None, root=0)
        device.activate()
        self.comm = nccl.NcclCommunicator(self.size, uid, rank)
        self.stream = self.cp.cuda.Stream(non_blocking=True)
        self._types = {np.dtype(np.float32): nccl.NCCL_FLOAT32, np.dtype(np.float64): nccl.NCCL_FLOAT64,
                       np.dtype(np.float16): nccl.NCCL_FLOAT16}
        self._blocks = []

    def allocate(self, bucket) -> None:
        if bucket.dtype not in self._types:
            raise ValueError(f"NCCL cannot all-reduce {bucket.dtype} gradients")
        off, arr = self.device.alloc((bucket.size,), bucket.dtype, f"all-reduce {bucket.name}")
        self._blocks.append(off)
        bucket.buffer = arr

    def pack(self, bucket) -> list:
        """Copy the gradients into the bucket's buffer on the compute stream; an event after them."""
        for s in bucket.slots:
            bucket.buffer[s.offset:s.offset + s.size].reshape(s.shape)[...] = s.blob.diff
        return [self.device.record()]

    def allreduce(self, bucket, packed, event) -> None:
        """On the comm thread: the all-reduce on the comm stream after the packing; wait for it."""
        self.device.gpu.use()
        for e in packed:
            self.stream.wait_event(e.event)
        event.start = time.perf_counter()
        buf = bucket.buffer
        self.comm.allReduce(buf.data.ptr, buf.data.ptr, buf.size, self._types[bucket.dtype],
                            self.nccl.NCCL_SUM, self.stream.ptr)
        with self.stream:
            buf *= bucket.dtype.type(1.0 / self.size)
        self.stream.synchronize()

    def unpack(self, bucket) -> None:
        for s in bucket.slots:
            view = bucket.buffer[s.offset:s.offset + s.size].reshape(s.shape)
            diff = s.blob.diff
            if isinstance(diff, np.ndarray):     # parameters kept on the host (host_params)
                view.get(out=diff)
            else:
                diff[...] = view

    def close(self) -> None:
        self.stream.synchronize()
        for off in self._blocks:
            self.device.free(off)
        self._blocks = []
        self.comm.destroy()
