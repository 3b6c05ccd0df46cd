"""The CUDA device: CuPy arrays carved from one cudaMalloc'd arena, cuDNN bound to its compute stream.

``CUDADevice(capacity=None, host_capacity=None, index=0)`` has the interface
of ``CPUDevice`` (sncaffe/backend/cpu.py), so the executor runs unchanged:

- ``alloc(shape, dtype, name, zero) -> (offset, array)``: a CuPy array viewing
  a block of the one device arena, placed by ``sncaffe.runtime.pool.Pool``
  (``device.pool``: in_use, peak, to the byte); ``free(offset)``. The whole
  arena is ``device.arena`` (uint8), at device address ``device.base``.
- ``host_alloc(nbytes, name) -> (offset, uint8 numpy view)`` / ``host_free``:
  blocks of one pinned host arena (``device.host_pool``), pinned on first use
  (pinning costs about a second per few GiB, so a run that never offloads
  never pays it).
- ``copy_to_host(host, array, after)`` / ``copy_to_device(array, host, after)``:
  async copies on the ``d2h`` / ``h2d`` streams, returning a ``CUDAEvent``.
  A copy is ordered after the work already issued to the compute stream
  (what produced, or last used, its device block) and after ``after``.
- ``CUDAEvent.query()`` / ``.wait()``: as sncaffe.runtime.streams.Event; ``wait``
  blocks the host. ``device.wait_event(event)`` instead makes the compute
  stream wait without blocking the host (what the executor does for every
  copy a kernel depends on); ``device.record()`` marks the compute stream.
  A copy's event also has ``start``/``end``: when the GPU ran it, in
  ``time.perf_counter`` seconds (timing events, mapped through the device's
  clock), None until it is done, for ``--trace``.
- ``stream(name)``: the CuPy streams ``compute``, ``d2h``, ``h2d``;
  ``synchronize()`` waits for all three, ``synchronize_compute()`` for the
  compute stream (a trace span then measures execution, not the launch).
- ``with device.active():`` makes this GPU and its compute stream current
  and restores the previous ones after: the executor runs each layer under
  its own device (model parallelism over several GPUs).

Layers use ``xp = cupy`` (``array_module``) and ``device.cudnn``, a
``cudnn.Handle`` on the compute stream; see sncaffe/backend/cudnn.py. The
compute stream is made CuPy's current stream on the constructing thread, so
CuPy kernels, cuBLAS (``cupy.matmul`` / ``cupy.cublas``), ElementwiseKernel
and RawKernel launches all go to it; another thread calls
``device.activate()`` first. The compute stream is a blocking stream: stray
work on the legacy default stream (another thread, a library) stays ordered
with it, while the copy streams are non-blocking and overlap everything.

Memory outside the pool: CuPy's own allocations (temporaries of array
expressions, reduction buffers) go through ``device.stray``, installed as
CuPy's allocator: they come from a private CuPy memory pool outside the
arena, and are counted (in_use, peak, count), so a layer that allocates
behind the plan shows up. cuDNN and cuBLAS handles, CUDA kernels and the
CUDA context live in the margin left outside the arena (capacity defaults
to the free memory less max(1 GiB, 5% of the GPU)).
"""
from __future__ import annotations

import time
from contextlib import contextmanager

import numpy as np

from ..runtime.pool import OutOfMemory, Pool
from ..sizes import fmt_bytes, parse_bytes
from .cpu import default_capacity

INSTALL_HINT = "pip install 'sncaffe[cuda13]' (CUDA 13 driver) or 'sncaffe[cuda12]' (CUDA 12 driver)"
STREAMS = ("compute", "d2h", "h2d")
HOST_TO_DEVICE, DEVICE_TO_HOST = 1, 2        # cudaMemcpyKind


def import_cupy():
    """CuPy, or a RuntimeError saying which extra to install."""
    try:
        import cupy
    except ImportError as e:
        raise RuntimeError(f"the cuda device needs CuPy and cuDNN 9, and CuPy cannot be imported ({e}): "
                           f"{INSTALL_HINT}") from None
    return cupy


def gpu_count(cp) -> int:
    """How many GPUs CuPy sees; a RuntimeError where the driver or GPU is missing."""
    try:
        n = cp.cuda.runtime.getDeviceCount()
    except Exception as e:                 # CUDARuntimeError: no driver, no device, driver too old
        raise RuntimeError(f"CuPy is installed but no GPU is usable ({e}); use --device cpu") from None
    if n == 0:
        raise RuntimeError("CuPy is installed but this machine has no GPU; use --device cpu")
    return n


PROBE = r'''extern "C" __global__ void sn_probe(float* x, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) x[i] = expf(0.0f) + (float)i;
}'''


def kernel_reason(cp):
    """Why CuPy cannot compile and run a kernel here (NVRTC or the CUDA headers missing: a CuPy
    installed without its CUDA toolkit pieces), or None."""
    try:
        x = cp.zeros(64, dtype=np.float32)
        cp.RawKernel(PROBE, "sn_probe")((1,), (64,), (x, np.int32(64)))
        got = cp.asnumpy(x)
    except Exception as e:                 # CompileException, RuntimeError (headers), CUDA errors
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return (f"CuPy cannot compile or run a CUDA kernel here ({first}): it needs the CUDA runtime "
                f"headers and NVRTC; {INSTALL_HINT} brings them")
    if not np.array_equal(got, np.arange(64, dtype=np.float32) + 1):
        return "a test kernel ran on the GPU but computed wrong values"
    return None


def unusable_reason():
    """Why ``--device cuda`` cannot work here (CuPy, a GPU, a working kernel compiler or cuDNN 9
    missing), or None: a trivial kernel is compiled and run before saying yes."""
    try:
        cp = import_cupy()
        gpu_count(cp)
    except RuntimeError as e:
        return str(e)
    reason = kernel_reason(cp)
    if reason:
        return reason
    from . import cudnn
    return None if cudnn.available() else "cuDNN 9 is not installed"


def cuda_usable() -> bool:
    """Whether ``--device cuda`` can work here: the CLI's default."""
    return unusable_reason() is None


def default_margin(total: int) -> int:
    """GPU memory left outside the arena: context, kernels, cuDNN/cuBLAS, CuPy temporaries."""
    return max(1 << 30, total // 20)


class Clock:
    """Maps CUDA timing events to time.perf_counter seconds: a reference event taken with the
    host's clock when the GPU was idle at it."""

    def __init__(self, cp):
        self._cp = cp
        self.ref = cp.cuda.Event()
        self.ref.record()
        self.ref.synchronize()
        self.t0 = time.perf_counter()

    def at(self, event) -> float:
        return self.t0 + self._cp.cuda.get_elapsed_time(self.ref, event) / 1e3


class CUDAEvent:
    """A CUDA event recorded on a stream, with the interface of sncaffe.runtime.streams.Event.
    With ``begin`` (a timing event recorded before the work) and a ``clock``, ``start`` and
    ``end`` say when the GPU ran it (perf_counter seconds), once it is done."""
    __slots__ = ("event", "begin", "clock", "error")

    def __init__(self, cp, stream, begin=None, clock=None):
        timed = begin is not None and clock is not None
        self.event = cp.cuda.Event(disable_timing=not timed)
        self.event.record(stream)
        self.begin, self.clock = (begin, clock) if timed else (None, None)
        self.error = None

    def query(self) -> bool:
        return self.event.done

    def wait(self) -> None:
        """Block the host until the work before the event is done."""
        self.event.synchronize()

    @property
    def start(self):
        return None if self.clock is None or not self.event.done else self.clock.at(self.begin)

    @property
    def end(self):
        return None if self.clock is None or not self.event.done else self.clock.at(self.event)


class StrayAllocator:
    """CuPy's allocator while a CUDADevice lives: allocations outside the pool, counted.

    They come from a private CuPy MemoryPool (fast reuse, no cudaMalloc per
    temporary); the returned memory carries a guard whose collection, when the
    last array using it dies, returns the bytes and updates ``in_use``.
    """

    def __init__(self, cp, device_id):
        self._cp, self.device_id = cp, device_id
        self.pool = cp.cuda.MemoryPool()
        self.in_use = self.peak = self.count = 0

    def __call__(self, size):
        cp = self._cp
        if size == 0:
            return self.pool.malloc(0)
        try:
            block = self.pool.malloc(size)
        except cp.cuda.memory.OutOfMemoryError:
            raise OutOfMemory(size, _GPUMemory(cp), "a CuPy temporary (outside the pool)") from None
        self.in_use += size
        self.count += 1
        self.peak = max(self.peak, self.in_use)
        mem = cp.cuda.UnownedMemory(block.ptr, size, _Release(self, block, size), self.device_id)
        return cp.cuda.MemoryPointer(mem, 0)

    def reset_peak(self) -> None:
        self.peak = self.in_use

    def stats(self) -> dict:
        return dict(in_use=self.in_use, peak=self.peak, count=self.count, cached=self.pool.total_bytes())


class _Release:
    """Owned by the memory handed to CuPy: dies with the last array using it."""
    __slots__ = ("stray", "block", "size")

    def __init__(self, stray, block, size):
        self.stray, self.block, self.size = stray, block, size

    def __del__(self):
        self.stray.in_use -= self.size     # self.block goes back to the MemoryPool with us


class _GPUMemory:
    """What OutOfMemory reports for memory outside the pool: the whole GPU."""

    def __init__(self, cp):
        free, total = cp.cuda.runtime.memGetInfo()
        self.capacity, self.in_use, self.largest_free = total, total - free, free


class _Arena:
    """The one cudaMalloc of the device pool; freed when the last array viewing it dies."""

    def __init__(self, cp, nbytes, index):
        self._cp, self.nbytes = cp, nbytes
        try:
            self.ptr = cp.cuda.runtime.malloc(nbytes)
        except cp.cuda.runtime.CUDARuntimeError as e:
            free, total = cp.cuda.runtime.memGetInfo()
            raise MemoryError(f"cannot reserve {fmt_bytes(nbytes)} on GPU cuda:{index}: {fmt_bytes(free)} of "
                              f"{fmt_bytes(total)} free ({e}); give a smaller --device-memory") from None

    def __del__(self):
        try:
            self._cp.cuda.runtime.free(self.ptr)
        except Exception:                 # interpreter shutdown
            pass


class CUDADevice:
    kind = "cuda"
    host_streams = False    # operators run on CUDA streams, not host streams (runtime/dispatcher.py)
    arena = None            # the device arena, a CuPy array over one cudaMalloc (made in __init__)
    spills = False          # no disk tier on a GPU yet: offloads go to the pinned host pool only
    spill_dir = None

    def __init__(self, capacity=None, host_capacity=None, index=0):
        cp = self.xp = import_cupy()
        n = gpu_count(cp)
        if not 0 <= index < n:
            raise RuntimeError(f"there is no GPU cuda:{index}: this machine has {n} (cuda:0 to cuda:{n - 1})")
        self.index, self.name = index, f"cuda:{index}"
        self.gpu = cp.cuda.Device(index)
        self.gpu.use()
        self._streams = {"compute": cp.cuda.Stream(non_blocking=False),
                         "d2h": cp.cuda.Stream(non_blocking=True),
                         "h2d": cp.cuda.Stream(non_blocking=True)}
        self.compute = self._streams["compute"]
        self.compute.use()
        from . import cudnn
        self.cudnn = cudnn.Handle(self.compute)
        cp.cuda.device.get_cublas_handle()           # its memory, like cuDNN's, stays outside the arena
        self.stray = StrayAllocator(cp, index)
        get = getattr(cp.cuda, "get_allocator", None)
        self._previous_allocator = get() if get else cp.get_default_memory_pool().malloc
        cp.cuda.set_allocator(self.stray)

        free, total = cp.cuda.runtime.memGetInfo()
        capacity = free - default_margin(total) if capacity is None else parse_bytes(capacity)
        if capacity <= 0:
            raise MemoryError(f"GPU cuda:{index} has only {fmt_bytes(free)} free of {fmt_bytes(total)}")
        self.pool = Pool(capacity)
        self._arena = _Arena(cp, self.pool.capacity, index)
        self.base = self._arena.ptr
        self._memory = cp.cuda.UnownedMemory(self.base, self.pool.capacity, self._arena, index)
        self.arena = cp.ndarray((self.pool.capacity,), np.uint8, cp.cuda.MemoryPointer(self._memory, 0))

        host = default_capacity() // 2 if host_capacity is None else parse_bytes(host_capacity)
        self.host_pool = Pool(host)
        self._host_arena = None
        self.clock = Clock(cp)

    # -- device memory ------------------------------------------------------------
    def alloc(self, shape, dtype=np.float32, name=None, zero=False):
        """A pool block and the CuPy array viewing it: returns (offset, array)."""
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        off = self.pool.alloc(nbytes, name)
        with self.gpu:
            arr = self.xp.ndarray(shape, dtype, self.xp.cuda.MemoryPointer(self._memory, off))
            if zero and nbytes:
                self.xp.cuda.runtime.memsetAsync(self.base + off, 0, nbytes, self.compute.ptr)
        return off, arr

    def free(self, offset: int) -> None:
        self.pool.free(offset)

    # -- pinned host memory ---------------------------------------------------------
    @property
    def host_arena(self) -> np.ndarray:
        """The pinned host arena (uint8), pinned on first use."""
        if self._host_arena is None:
            nbytes = self.host_pool.capacity
            try:
                mem = self.xp.cuda.alloc_pinned_memory(nbytes)
            except Exception as e:
                raise MemoryError(f"cannot pin {fmt_bytes(nbytes)} of host memory for offload ({e}); "
                                  f"give the device a smaller host_capacity") from None
            self._host_arena = np.frombuffer(mem, np.uint8, nbytes)   # keeps mem alive
        return self._host_arena

    def host_alloc(self, nbytes: int, name=None):
        """A block of the pinned host pool for an offloaded tensor: (offset, uint8 array)."""
        off = self.host_pool.alloc(nbytes, name)
        return off, self.host_arena[off:off + nbytes]

    def host_free(self, offset: int) -> None:
        self.host_pool.free(offset)

    # -- copies, streams, events ---------------------------------------------------------
    def copy_to_host(self, host, array, after=None) -> CUDAEvent:
        """Copy a device array into host bytes on the d2h stream; returns the event."""
        return self._copy("d2h", host.ctypes.data, array.data.ptr, host, array, after, DEVICE_TO_HOST)

    def copy_to_device(self, array, host, after=None) -> CUDAEvent:
        """Copy host bytes into a device array on the h2d stream; returns the event."""
        return self._copy("h2d", array.data.ptr, host.ctypes.data, host, array, after, HOST_TO_DEVICE)

    def _copy(self, stream_name, dst, src, host, array, after, kind):
        if host.nbytes != array.nbytes or not (host.flags.c_contiguous and array.flags.c_contiguous):
            raise ValueError(f"copy between {host.nbytes} host and {array.nbytes} device bytes, "
                             f"both must be equal and contiguous")
        stream = self._streams[stream_name]
        with self.gpu:
            stream.wait_event(self.record().event)      # the block's producer (or last reader) on compute
            if after is not None:
                stream.wait_event(after.event)
            begin = self.xp.cuda.Event()
            begin.record(stream)
            self.xp.cuda.runtime.memcpyAsync(dst, src, array.nbytes, kind, stream.ptr)
            return CUDAEvent(self.xp, stream, begin, self.clock)

    def record(self, stream="compute") -> CUDAEvent:
        """An event marking the work issued so far to a stream."""
        with self.gpu:
            return CUDAEvent(self.xp, self._streams[stream])

    def wait_event(self, event: CUDAEvent, stream="compute") -> None:
        """Order later work on ``stream`` after ``event`` without blocking the host."""
        with self.gpu:
            self._streams[stream].wait_event(event.event)

    def stream(self, name: str):
        """The CuPy stream ``compute``, ``d2h`` or ``h2d``."""
        if name not in self._streams:
            raise ValueError(f"no stream {name!r} (one of {', '.join(STREAMS)})")
        return self._streams[name]

    def activate(self) -> None:
        """Make this GPU and its compute stream current in the calling thread."""
        self.gpu.use()
        self.compute.use()

    @contextmanager
    def active(self):
        """This GPU and its compute stream current inside the block; the previous ones after."""
        cp = self.xp
        stream = cp.cuda.get_current_stream()
        if stream.ptr == self.compute.ptr:      # already current (a stream belongs to one GPU)
            yield self
            return
        device = cp.cuda.Device()
        self.activate()
        try:
            yield self
        finally:
            device.use()
            stream.use()

    def synchronize(self) -> None:
        for stream in self._streams.values():
            stream.synchronize()

    def synchronize_compute(self) -> None:
        """Wait for the kernels issued so far (a trace span then measures their execution)."""
        self.compute.synchronize()

    def close(self) -> None:
        """Wait for all work, release the cuDNN handle and give CuPy its allocator back.
        The arenas go when the last array viewing them does."""
        self.synchronize()
        self.cudnn.close()
        if getattr(self.xp.cuda, "get_allocator", lambda: None)() is self.stray:
            self.xp.cuda.set_allocator(self._previous_allocator)
        self._host_arena = None         # unpinned once the last view of it dies

    def __repr__(self):
        return f"CUDADevice({self.name}, capacity={self.pool.capacity})"
