"""The cuda device: clear errors where CuPy or a GPU is missing (tested everywhere), and the
device itself (one arena through the pool, pinned host pool, streams, events) where a GPU is."""
import gc
import time
import sys
import types

import numpy as np
import pytest

from sncaffe.backend.cuda import unusable_reason as cuda_unusable_reason

from sncaffe.backend import CPUDevice, make_device
from sncaffe.backend import cuda
from sncaffe.backend.cuda import CUDADevice, CUDAEvent
from sncaffe.runtime.pool import OutOfMemory


def _gpu_reason():
    return cuda_unusable_reason()

GPU_REASON = _gpu_reason()
needs_gpu = pytest.mark.skipif(GPU_REASON is not None, reason=str(GPU_REASON))
MiB = 1 << 20


# -- everywhere: errors without CuPy or a GPU ---------------------------------------------

@pytest.fixture
def no_cupy(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)          # import cupy now fails, as where it is absent


def _fake_cupy(monkeypatch, count):
    def get_count():
        if isinstance(count, Exception):
            raise count
        return count
    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=types.SimpleNamespace(getDeviceCount=get_count)))
    monkeypatch.setitem(sys.modules, "cupy", fake)


@pytest.mark.parametrize("name", ["cuda", "cuda:0", "CUDA:1"])
def test_cuda_without_cupy_names_the_extra(no_cupy, name):
    with pytest.raises(RuntimeError, match=r"needs CuPy.*pip install 'sncaffe\[cuda13\]'.*'sncaffe\[cuda12\]'"):
        make_device(name)
    assert not cuda.cuda_usable()


@pytest.mark.parametrize("count, message", [
    (RuntimeError("cudaErrorNoDevice: no CUDA-capable device is detected"), r"no GPU is usable \(cudaErrorNoDevice"),
    (RuntimeError("cudaErrorInsufficientDriver"), r"CuPy is installed but no GPU is usable"),
    (0, r"CuPy is installed but this machine has no GPU; use --device cpu"),
])
def test_cuda_with_cupy_but_no_gpu(monkeypatch, count, message):
    _fake_cupy(monkeypatch, count)
    with pytest.raises(RuntimeError, match=message):
        make_device("cuda")
    assert not cuda.cuda_usable()


def test_cuda_index_beyond_the_gpus(monkeypatch):
    _fake_cupy(monkeypatch, 2)
    with pytest.raises(RuntimeError, match=r"there is no GPU cuda:5: this machine has 2 \(cuda:0 to cuda:1\)"):
        make_device("cuda:5")
    with pytest.raises(ValueError, match="cuda or cuda:N"):
        make_device("cuda:first")


def test_cli_says_so_and_exits_nonzero(no_cupy, tmp_path, capsys):
    from sncaffe.cli import main
    net = tmp_path / "net.prototxt"
    net.write_text('layer { name: "x" type: "Input" top: "x" input_param { shape { dim: 2 dim: 3 } } }\n'
                   'layer { name: "ip" type: "InnerProduct" bottom: "x" top: "y"\n'
                   '        inner_product_param { num_output: 2 } }')
    assert main(["time", str(net), "--device", "cuda", "--iterations", "1"]) == 1
    err = capsys.readouterr().err
    assert "error:" in err and "sncaffe[cuda13]" in err


def test_same_interface_as_the_cpu_device():
    public = [n for n in dir(CPUDevice) if not n.startswith("_")]
    assert public and all(hasattr(CUDADevice, n) or n in ("name", "xp") for n in public)
    assert {"record", "wait_event", "activate", "close"} <= set(dir(CUDADevice))


# -- on a GPU -------------------------------------------------------------------------------

@pytest.fixture
def device():
    dev = CUDADevice(capacity="64MiB", host_capacity="16MiB")
    yield dev
    dev.close()
    del dev
    gc.collect()


@needs_gpu
def test_alloc_carves_the_one_arena(device):
    import cupy
    assert device.name == "cuda:0" and device.xp is cupy and device.pool.capacity == 64 * MiB
    off_a, a = device.alloc((3, 5), np.float32, "a")
    off_b, b = device.alloc((7,), np.float64, "b", zero=True)
    assert isinstance(a, cupy.ndarray) and a.shape == (3, 5) and a.dtype == np.float32
    assert a.data.ptr == device.base + off_a and b.data.ptr == device.base + off_b
    assert off_a % 256 == 0 and off_b % 256 == 0 and off_a != off_b
    assert (b.get() == 0).all()
    a[...] = cupy.arange(15, dtype=np.float32).reshape(3, 5)
    np.testing.assert_array_equal(device.arena[off_a:off_a + 60].view(np.float32).get(), np.arange(15))
    assert device.pool.in_use == 512
    device.free(off_a)
    device.free(off_b)
    assert device.pool.in_use == 0 and device.pool.peak == 512


@needs_gpu
def test_zero_fills_a_reused_block(device):
    off, a = device.alloc((1000,), np.float32)
    a.fill(7)
    device.free(off)
    off2, b = device.alloc((1000,), np.float32, zero=True)
    assert off2 == off and float(b.sum()) == 0.0
    device.free(off2)


@needs_gpu
def test_peak_and_out_of_memory(device):
    sizes = [8 * MiB, 16 * MiB, 4 * MiB]
    offs = [device.alloc((n // 4,), np.float32, f"t{i}")[0] for i, n in enumerate(sizes)]
    device.free(offs[1])
    offs[1] = device.alloc((2 * MiB,), np.uint8)[0]             # fits in the hole
    assert device.pool.peak == sum(sizes) and device.pool.in_use == 14 * MiB
    with pytest.raises(OutOfMemory, match='tensor "huge"'):
        device.alloc((64 * MiB,), np.uint8, "huge")
    for off in offs:
        device.free(off)
    assert device.pool.in_use == 0


@needs_gpu
def test_offload_then_prefetch_with_events(device):
    import cupy
    n = 2 * MiB
    off_a, a = device.alloc((n,), np.float32)
    off_b, b = device.alloc((n,), np.float32, zero=True)
    hoff, host = device.host_alloc(a.nbytes, "a")
    base = device.host_arena.base
    assert isinstance(base.obj if isinstance(base, memoryview) else base, cupy.cuda.PinnedMemoryPointer)
    assert device.host_pool.in_use == a.nbytes and host.ctypes.data == device.host_arena.ctypes.data + hoff
    a[...] = 3                                 # a kernel on the compute stream, not waited for
    out = device.copy_to_host(host, a)         # the d2h copy is ordered after it
    assert isinstance(out, CUDAEvent)
    back = device.copy_to_device(b, host, after=out)     # the h2d copy after the offload
    device.wait_event(back)                    # compute waits on the device, the host does not
    assert float(b.sum()) == 3.0 * n
    back.wait()
    out.wait()
    assert out.query() and back.query()
    assert out.start <= out.end <= back.start <= back.end     # --trace's spans: the prefetch after the offload
    assert (host.view(np.float32) == 3).all()
    device.host_free(hoff)
    device.free(off_a)
    device.free(off_b)
    assert device.host_pool.in_use == 0 and device.pool.in_use == 0


@needs_gpu
def test_copy_sizes_must_match(device):
    off, a = device.alloc((16,), np.float32)
    hoff, host = device.host_alloc(32)
    with pytest.raises(ValueError, match="32 host and 64 device bytes"):
        device.copy_to_host(host, a)
    device.host_free(hoff)
    device.free(off)


@needs_gpu
def test_streams_and_handles(device):
    import cupy
    assert [device.stream(n) for n in ("compute", "d2h", "h2d")] == [device.compute] + \
        [device._streams[n] for n in ("d2h", "h2d")]
    assert len({device.stream(n).ptr for n in ("compute", "d2h", "h2d")}) == 3
    assert cupy.cuda.get_current_stream().ptr == device.compute.ptr
    assert device.cudnn.get_stream() == device.compute.ptr
    with pytest.raises(ValueError, match="no stream 'p2p'"):
        device.stream("p2p")
    ev = device.record()
    ev.wait()
    assert ev.query()
    device.synchronize()


@needs_gpu
def test_cupy_temporaries_are_counted_outside_the_pool(device):
    import cupy
    assert cupy.cuda.get_allocator() is device.stray
    off, a = device.alloc((1 << 16,), np.float32)
    before, in_pool = device.stray.in_use, device.pool.in_use
    t = a * 2                                  # a temporary: CuPy's allocator, not the pool
    assert device.stray.in_use >= before + a.nbytes and device.stray.peak >= before + a.nbytes
    assert device.pool.in_use == in_pool and device.stray.count >= 1
    del t
    assert device.stray.in_use == before
    device.free(off)


@needs_gpu
def test_make_device_and_default_capacity():
    import cupy
    dev = make_device("cuda", "32MiB")
    assert isinstance(dev, CUDADevice) and dev.pool.capacity == 32 * MiB and dev.name == "cuda:0"
    dev.close()
    del dev
    gc.collect()
    free, total = cupy.cuda.runtime.memGetInfo()
    dev = CUDADevice()
    assert 0 < dev.pool.capacity <= free - cuda.default_margin(total)
    dev.close()
    del dev
    gc.collect()
    assert cuda.cuda_usable()


# -- without a GPU: the probe kernel, the trace's copy events ------------------------------------

def _cupy_that_cannot_compile(monkeypatch, error):
    def kernel(code, name):
        raise error
    fake = types.SimpleNamespace(
        cuda=types.SimpleNamespace(runtime=types.SimpleNamespace(getDeviceCount=lambda: 1)),
        zeros=np.zeros, asnumpy=np.asarray, RawKernel=kernel)
    monkeypatch.setitem(sys.modules, "cupy", fake)


@pytest.mark.parametrize("error", [RuntimeError("Failed to find CUDA headers"),
                                   OSError("failed to load libnvrtc.so.12")])
def test_a_cupy_that_cannot_compile_is_not_usable(monkeypatch, error):
    """CuPy installed without its CUDA toolkit pieces sees the GPU but compiles nothing: the
    device is unusable (tests skip, the CLI says which extra brings them), not usable."""
    _cupy_that_cannot_compile(monkeypatch, error)
    reason = cuda.unusable_reason()
    assert reason is not None and "cannot compile" in reason and str(error) in reason
    assert "sncaffe[cuda13]" in reason


def test_a_probe_that_computes_wrong_values_is_not_usable(monkeypatch):
    def kernel(code, name):
        return lambda grid, block, args: None             # "runs", writes nothing
    fake = types.SimpleNamespace(zeros=np.zeros, asnumpy=np.asarray, RawKernel=kernel)
    assert "wrong values" in cuda.kernel_reason(fake)


class _FakeEvent:
    """A cupy.cuda.Event stand-in: recorded at the host's clock, done at once."""
    def __init__(self, disable_timing=False):
        self.timing, self.t = not disable_timing, None

    def record(self, stream=None):
        self.t = time.perf_counter()

    done = True

    def synchronize(self):
        pass


def _elapsed_ms(a, b):
    assert a.timing and b.timing, "elapsed time between events without timing"
    return (b.t - a.t) * 1e3


def test_copy_events_have_start_and_end_for_the_trace():
    """--trace records copies as (stream, name, start, end): a CUDAEvent has them once done."""
    from sncaffe.runtime.dispatcher import Dispatcher
    cp = types.SimpleNamespace(cuda=types.SimpleNamespace(Event=_FakeEvent, get_elapsed_time=_elapsed_ms))
    clock = cuda.Clock(cp)
    begin = _FakeEvent()
    begin.record()
    time.sleep(0.002)
    event = CUDAEvent(cp, None, begin, clock)
    assert clock.t0 <= event.start < event.end <= time.perf_counter()
    untimed = CUDAEvent(cp, None)
    assert untimed.start is None and untimed.end is None and not untimed.event.timing
    ex = Dispatcher(CPUDevice("1MiB", host_capacity="1MiB"), {}, lambda *a: None)
    ex.trace = []
    ex.traced("offload x", "d2h", event)
    ex.traced("prefetch y", "h2d", untimed)
    assert ex.trace_events() == [("d2h", "offload x", event.start, event.end)]


@needs_gpu
def test_close_releases_the_pinned_arena():
    dev = CUDADevice(capacity="16MiB", host_capacity="8MiB")
    off, _ = dev.host_alloc(1024)
    assert dev._host_arena is not None
    dev.host_free(off)
    dev.close()
    assert dev._host_arena is None
