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

    def before(self, bucket):
        """On the issuing thread, right after the bucket's last backward operator was launched:
        an event on the compute stream the all-reduce waits for."""
        return self.device.record()

    def reduce(self, bucket, arrays, token=None) -> None:
        """The all-reduce operator's work, on the comm thread: pack, all-reduce, average and unpack
        on the NCCL stream after ``token`` (the gradients' compute event); wait for it."""
        self.device.gpu.use()
        if token is not None:
            self.stream.wait_event(token.event)
        buf = bucket.buffer
        with self.stream:
            for s, a in zip(bucket.slots, arrays):
                view = buf[s.offset:s.offset + s.size].reshape(s.shape)
                view[...] = self.cp.asarray(a)
            self.comm.allReduce(buf.data.ptr, buf.data.ptr, buf.size, self._types[bucket.dtype],
                                self.nccl.NCCL_SUM, self.stream.ptr)
            buf *= bucket.dtype.type(1.0 / self.size)
            for s, a in zip(bucket.slots, arrays):
                view = buf[s.offset:s.offset + s.size].reshape(s.shape)
                if isinstance(a, np.ndarray):     # parameters kept on the host (host_params)
                    view.get(out=a, stream=self.stream)
                else:
                    a[...] = view
        self.stream.synchronize()

    def close(self) -> None:
        self.stream.synchronize()
        for off in self._blocks:
            self.device.free(off)
        self._blocks = []
        self.comm.destroy()
