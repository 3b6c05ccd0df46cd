"""Every layer, the golden cases, whole nets and the memory runtime on the cuda device, against
the cpu device (relative 1e-4 in fp32 for layers).

Two backends run the same tests:

- ``cuda``: a CUDADevice (CuPy, cuDNN 9): skipped, with the reason, where no GPU is usable.
- ``emulated``: where no GPU is, the GPU code paths still run on the CPU: arrays are NumPy
  arrays that sncaffe takes for CuPy ones (a ``cupy`` module standing in), and the CUDA C of
  sncaffe/layers/*_gpu.py is compiled by g++ and launched block by block (threads of a
  block as real threads, for __syncthreads). Only cuDNN cannot be emulated: there a
  Convolution runs its CPU code, and the cuDNN tests are cuda-only.
"""
import ctypes
import functools
import gc
import hashlib
import re
import shutil
import subprocess
import sys
import types

import numpy as np
import pytest

from sncaffe.backend.cuda import unusable_reason as cuda_unusable_reason

from sncaffe import Net, blobproto
from sncaffe.backend import CPUDevice, cudnn, cudnn_conv, kernels
from sncaffe.gradcheck import Harness, make_layer
from sncaffe.layers import conv, conv_gpu, loss_gpu
from sncaffe.layers.base import TEST, TRAIN, Blob, array_module
from sncaffe.plan.planner import MODES, MemoryExhausted
from sncaffe.proto import sncaffe_pb2 as pb
from sncaffe.prototxt import DATA_LAYERS, read_text, replace_data_layers, set_batch
from conftest import ROOT, SHARED, needs_shared


def _gpu_reason():
    return cuda_unusable_reason()

GPU_REASON = _gpu_reason()
if GPU_REASON is None:
    EMU_REASON = "a GPU is here: the real kernels run instead of the emulation"
else:
    EMU_REASON = None if shutil.which("g++") else "g++ is not installed (it compiles the emulated kernels)"
needs_gpu = pytest.mark.skipif(GPU_REASON is not None, reason=str(GPU_REASON))
BACKENDS = [pytest.param("cuda", marks=needs_gpu),
            pytest.param("emulated", marks=pytest.mark.skipif(EMU_REASON is not None, reason=str(EMU_REASON)))]


# -- the emulation: CUDA C under g++, NumPy arrays that pass for CuPy's -------------------------

SHIM = r"""
#include <cmath>
#include <thread>
#include <vector>
#include <pthread.h>
struct sn_dim3 { unsigned x, y, z; };
static thread_local sn_dim3 threadIdx, blockIdx;
static sn_dim3 blockDim, gridDim;
static pthread_barrier_t sn_barrier;
#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static
#define __syncthreads() pthread_barrier_wait(&sn_barrier)
"""
KERNEL = re.compile(r'extern "C" __global__ void (\w+)\(([^)]*)\)')


def _param(text, T):
    """(C type for the launcher, ctypes type) of one kernel parameter."""
    name = re.findall(r"\w+", text)[-1]
    ctype = text[:text.rfind(name)].strip()
    if "*" in ctype:
        return ctype, name, ctypes.c_void_p
    scalar = {"long long": ctypes.c_longlong, "int": ctypes.c_int, "double": ctypes.c_double,
              "T": ctypes.c_float if T == "float" else ctypes.c_double}
    return ctype, name, scalar[ctype]


class EmulatedModule:
    """A cupy.RawModule stand-in: the source compiled by g++, each kernel with a launcher that
    runs the grid block by block (a block's threads in order, or as threads at a barrier)."""

    def __init__(self, code, workdir):
        T = re.search(r"typedef (\w+) T;", code).group(1)
        launchers, self.kernels = [], {}
        for m in KERNEL.finditer(code):
            name, params = m.group(1), [_param(p, T) for p in m.group(2).split(",")]
            body = code[m.end():code.find('extern "C"', m.end()) % (len(code) + 1)]
            decl = ", ".join(f"{c} {n}" for c, n, _ in params)
            args = ", ".join(n for _, n, _ in params)
            launchers.append(f"""
extern "C" void emu_{name}(unsigned sn_gx, unsigned sn_gy, unsigned sn_bx, {decl}) {{
  gridDim = {{sn_gx, sn_gy, 1}}; blockDim = {{sn_bx, 1, 1}};
  for (unsigned sn_y = 0; sn_y < sn_gy; ++sn_y) for (unsigned sn_x = 0; sn_x < sn_gx; ++sn_x) {{
    if (!{int('__syncthreads' in body)}) {{
      for (unsigned sn_t = 0; sn_t < sn_bx; ++sn_t) {{
        blockIdx = {{sn_x, sn_y, 0}}; threadIdx = {{sn_t, 0, 0}}; {name}({args});
      }}
      continue;
    }}
    pthread_barrier_init(&sn_barrier, nullptr, sn_bx);
    std::vector<std::thread> sn_threads;
    for (unsigned sn_t = 0; sn_t < sn_bx; ++sn_t)
      sn_threads.emplace_back([=] {{ blockIdx = {{sn_x, sn_y, 0}}; threadIdx = {{sn_t, 0, 0}}; {name}({args}); }});
    for (auto& th : sn_threads) th.join();
    pthread_barrier_destroy(&sn_barrier);
  }}
}}""")
            self.kernels[name] = [p[2] for p in params]
        full = SHIM + code + "\n".join(launchers)
        tag = hashlib.sha1(full.encode()).hexdigest()[:16]
        src, lib = workdir / f"k{tag}.cc", workdir / f"k{tag}.so"
        if not lib.exists():
            src.write_text(full)
            subprocess.run(["g++", "-O1", "-std=c++17", "-shared", "-fPIC", "-pthread", "-w", str(src), "-o", str(lib)],
                           check=True, capture_output=True, text=True)
        self.lib = ctypes.CDLL(str(lib))

    def get_function(self, name):
        f, types_ = getattr(self.lib, f"emu_{name}"), self.kernels[name]
        f.argtypes, f.restype = [ctypes.c_uint] * 3 + types_, None

        def launch(grid, block, args):
            assert len(args) == len(types_), name
            values = [a.ctypes.data if isinstance(a, np.ndarray) else a.item() for a in args]
            f(grid[0], grid[1] if len(grid) > 1 else 1, block[0], *values)
        return launch


class EmulatedArray(np.ndarray):
    """A NumPy array that sncaffe takes for a CuPy one (the module of its type is cupy's). Like
    CuPy, it refuses host (NumPy) arrays as operands of its arithmetic. (Assignments it lets
    through: code that asks isinstance(a, np.ndarray), as the fillers do, takes it for a host array.)"""

    def set(self, a):
        self[...] = a

    def get(self):
        return np.array(self)

    def __array_ufunc__(self, ufunc, method, *inputs, out=None, **kw):
        _device_only(ufunc.__name__, list(inputs) + list(out or ()))
        plain = [a.view(np.ndarray) if isinstance(a, EmulatedArray) else a for a in inputs]
        if out:
            kw["out"] = tuple(o.view(np.ndarray) for o in out)
        result = getattr(ufunc, method)(*plain, **kw)
        if out:
            return out[0] if len(out) == 1 else out
        return _on_device(result)


def _device_only(what, values):
    if any(isinstance(v, np.ndarray) and not isinstance(v, EmulatedArray) for v in values):
        raise TypeError(f"{what}: a NumPy array among device arrays (CuPy refuses the implicit copy)")


def _on_device(result):
    if isinstance(result, tuple):
        return tuple(_on_device(r) for r in result)
    return result.view(EmulatedArray) if type(result) is np.ndarray else result


def _fake_cupy(name):
    """cupy.<name>: numpy's, its arrays on the (emulated) device."""
    f = getattr(np, name)
    if not callable(f) or isinstance(f, type):
        return f
    return functools.wraps(f)(lambda *a, **k: _on_device(f(*a, **k)))


EmulatedArray.__module__ = "cupy._emulated"
FAKE_CUPY = types.ModuleType("cupy")
FAKE_CUPY.__getattr__ = _fake_cupy


class EmulatedDevice(CPUDevice):
    """The CPU device, its arrays passing for CuPy's: the executor and Net run unchanged."""
    name = "cuda (emulated)"
    kind = "cuda"
    xp = FAKE_CUPY

    def alloc(self, shape, dtype=np.float32, name=None, zero=False):
        off, arr = super().alloc(shape, dtype, name, zero)
        return off, arr.view(EmulatedArray)


def _cpu_blob(b):
    return Blob(b.name, None if b.data is None else np.asarray(b.data), None if b.diff is None else np.asarray(b.diff))


# -- backends ------------------------------------------------------------------------------------

class Backend:
    """Where the device side of a test runs: ``device`` (layers are set up for it), ``new_device``,
    and the copies ``put`` (host -> device array), ``get`` (device -> host) and ``set``."""

    def __init__(self, name, device, new_device, put, get):
        self.name, self.device, self.new_device, self.put, self.get = name, device, new_device, put, get

    def set(self, dst, host):
        dst.set(np.ascontiguousarray(np.broadcast_to(host, dst.shape), dtype=dst.dtype))

    def net(self, source, phase="TRAIN", device=None, **kw):
        return Net(source, phase, device=device or self.device, **kw)


def _plain(method):
    """The layer's method on plain NumPy views of its blobs and workspace: its CPU code (emulation
    has no cuDNN)."""
    @functools.wraps(method)
    def run(self, first, *rest):
        blobs, workspace = self.blobs, self.workspace
        self.blobs = [_cpu_blob(b) for b in blobs]
        self.workspace = {k: np.asarray(v) for k, v in workspace.items()}
        try:
            return method(self, [_cpu_blob(b) for b in first], *rest[:-1], [_cpu_blob(b) for b in rest[-1]])
        finally:
            self.blobs, self.workspace = blobs, workspace
    return run


def emulate(mp, workdir):
    """Launch the registered kernels compiled by g++ (small blocks, few of them: every grid-stride
    loop turns)."""
    mp.setattr(kernels, "_module", functools.lru_cache(maxsize=None)(
        lambda family, dtype, index: EmulatedModule(kernels.source(family, dtype, index), workdir)))
    mp.setattr(kernels, "_kernels", {})
    mp.setattr(kernels, "BLOCK", 4)
    mp.setattr(kernels, "MAX_BLOCKS", 8)


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request, tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        if request.param == "cuda":
            import cupy
            from sncaffe.backend.cuda import CUDADevice
            device = CUDADevice("4GiB", host_capacity="1GiB")

            def new_device(capacity="1GiB"):
                return CUDADevice(capacity, host_capacity="1GiB")
            yield Backend("cuda", device, new_device, lambda a: cupy.asarray(np.ascontiguousarray(a)),
                          cupy.asnumpy)
            device.close()
            del device
            gc.collect()
            return
        workdir = tmp_path_factory.mktemp("kernels")
        mp.setitem(sys.modules, "cupy", FAKE_CUPY)
        emulate(mp, workdir)
        for cls in (conv.Convolution, conv.Deconvolution):     # CPU code on plain views of the arrays
            for name in ("forward", "backward"):
                mp.setattr(cls, name, _plain(getattr(cls, name)))
        mp.setattr(conv_gpu, "workspace_specs",
                   lambda layer, shape, chunk=None: (layer.workspace_specs, layer.backward_workspace_specs))
        yield Backend("emulated", EmulatedDevice("2GiB", host_capacity="1GiB"),
                      lambda capacity="1GiB": EmulatedDevice(capacity, host_capacity="1GiB"),
                      lambda a: np.array(a).view(EmulatedArray), lambda a: np.array(a.view(np.ndarray)))


# -- one layer on both devices --------------------------------------------------------------------

def close(dev, cpu, what, rtol=1e-4):
    """Relative 1e-4 of the tensor's own scale, element by element."""
    cpu = np.asarray(cpu, np.float64)
    finite = np.abs(cpu[np.isfinite(cpu)])
    scale = float(finite.max()) if finite.size else 1.0
    np.testing.assert_allclose(np.asarray(dev, np.float64), cpu, rtol=rtol, atol=rtol * (scale or 1.0),
                               err_msg=what)


def close_norm(dev, cpu, what, rtol):
    """A whole net's tensor: |dev - cpu| <= rtol |cpu| in the 2-norm. Element by element is too strict
    there: a max-pooling window whose two largest values differ in the last bits, or a ReLU input
    within rounding of 0, may go either way on either device and move that gradient."""
    dev, cpu = np.asarray(dev, np.float64).ravel(), np.asarray(cpu, np.float64).ravel()
    err, ref = float(np.linalg.norm(dev - cpu)), float(np.linalg.norm(cpu))
    assert err <= rtol * ref + 1e-30, f"{what}: relative error {err / (ref or 1):.2e} > {rtol:.0e}"


def on_device(backend, text, bottoms, params, *, phase=TRAIN, inplace=False, n_tops=1, seed=0, target=True):
    """The layer set up for the device (``target``: under building_for it) with its params,
    bottoms (float32) and tops in device arrays: (layer, bottom blobs, top blobs)."""
    layer = make_layer(text, phase, inplace, len(bottoms), n_tops)
    put = backend.put
    layer.target = backend.device if target else None
    shapes = layer.setup([np.shape(b) for b in bottoms])
    layer.blobs = [Blob(f"{layer.name}[{i}]", put(v), put(np.zeros_like(v))) for i, v in enumerate(params)]
    layer.scratch = {k: put(np.zeros(s, d or np.float32)) for k, (s, d) in layer.scratch_specs.items()}
    specs = {**layer.workspace_specs, **(layer.backward_workspace_specs or {})}
    layer.workspace = {k: put(np.zeros(s, d or np.float32)) for k, (s, d) in specs.items()}
    bottom = [Blob(n, put(np.asarray(x, np.float32)), put(np.zeros(np.shape(x), np.float32)))
              for n, x in zip(layer.param.bottom, bottoms)]
    top = bottom[:len(shapes)] if inplace else [Blob(n, put(np.zeros(s, np.float32)), put(np.zeros(s, np.float32)))
                                                for n, s in zip(layer.param.top, shapes)]
    layer.rng = np.random.default_rng(seed + 1)          # as Harness.forward: Dropout's mask, stochastic pooling
    return layer, bottom, top


def parity(backend, text, bottoms, *, phase=TRAIN, inplace=False, n_tops=1, params=None, forward_only=False,
           propagate_down=None, seed=0, rtol=1e-4, target=True):
    """Forward and backward of a layer on the CPU (float32 Harness) and on the device, from the same
    parameters, inputs, top diffs and random stream; every top, bottom diff, param and param diff
    must agree."""
    bottoms = [np.asarray(b, np.float32) for b in bottoms]
    cpu_layer = make_layer(text, phase, inplace, len(bottoms), n_tops)
    h = Harness(cpu_layer, bottoms, np.float32, seed, params)
    start = [b.data.copy() for b in cpu_layer.blobs]
    tops = h.forward()
    get = backend.get
    layer, bottom, top = on_device(backend, text, bottoms, start, phase=phase, inplace=inplace, n_tops=n_tops,
                                   seed=seed, target=target)
    layer.forward(bottom, top)
    for i, (t, ref) in enumerate(zip(top, tops)):
        close(get(t.data), ref, f"{layer.type}: top[{i}]", rtol)
    for i, (b, ref) in enumerate(zip(layer.blobs, cpu_layer.blobs)):
        close(get(b.data), ref.data, f"{layer.type}: param[{i}] after forward", rtol)
    if forward_only:
        return
    rng = np.random.default_rng(seed + 7)
    grads = [rng.standard_normal(t.shape).astype(np.float32) for t in tops]
    for i, (t, g) in enumerate(zip(top, grads)):
        if cpu_layer.is_loss and i == 0:
            g = np.float32(1.5)                            # a loss weight
        backend.set(t.diff, g)
    if propagate_down is None:
        propagate_down = [layer.allow_force_backward(i) for i in range(len(bottom))]
    for b, down in zip(bottom, propagate_down):
        if down and not inplace:
            backend.set(b.diff, np.nan)                    # backward must overwrite, not accumulate
    layer.backward(top, propagate_down, bottom)
    if cpu_layer.is_loss:
        grads[0] = np.float32(1.5)
    bottom_diffs, param_diffs = h.backward(grads, propagate_down)
    for i, (b, ref) in enumerate(zip(bottom, bottom_diffs)):
        if propagate_down[i]:
            close(get(b.diff), ref, f"{layer.type}: bottom[{i}] diff", rtol)
    for i, (b, ref) in enumerate(zip(layer.blobs, param_diffs)):
        if cpu_layer.learnable:
            close(get(b.diff), ref, f"{layer.type}: param[{i}] diff", rtol)


def normal(seed, shape, scale=1.0):
    return np.random.default_rng(seed).standard_normal(shape) * scale


def away_from_zero(seed, shape=(2, 3, 4, 5), margin=0.05):
    x = normal(seed, shape)
    return np.where(np.abs(x) < margin, np.copysign(margin, x) + x, x)


def distinct(shape, seed=0):
    """No two values alike: MAX pooling and Eltwise MAX have no ties to break."""
    rng = np.random.default_rng(seed)
    return rng.permutation(int(np.prod(shape))).reshape(shape) * 0.1 - 3.0


# -- neuron layers ---------------------------------------------------------------------------------

NEURONS = {
    "relu": 'type: "ReLU"', "relu_leaky": 'type: "ReLU" relu_param { negative_slope: 0.1 }',
    "relu_negslope": 'type: "ReLU" relu_param { negative_slope: -0.3 }',
    "elu": 'type: "ELU"', "elu_half": 'type: "ELU" elu_param { alpha: 0.5 }',
    "elu_negalpha": 'type: "ELU" elu_param { alpha: -0.5 }',
    "sigmoid": 'type: "Sigmoid"', "tanh": 'type: "TanH"', "absval": 'type: "AbsVal"',
    "power_default": 'type: "Power"', "power_linear": 'type: "Power" power_param { scale: -2 shift: 0.5 }',
    "power_zero": 'type: "Power" power_param { power: 0 scale: 3 shift: 2 }',
    "power_scale0": 'type: "Power" power_param { power: 3 scale: 0 shift: 2 }',
    "power_sq": 'type: "Power" power_param { power: 2 scale: 0.5 shift: 1 }',
    "power_sq_noshift": 'type: "Power" power_param { power: 2 scale: -1.5 }',
    "power_sqrt": 'type: "Power" power_param { power: 0.5 scale: 2 shift: 3 }',
    "power_cube_noshift": 'type: "Power" power_param { power: 3 scale: 0.7 }',
    "power_recip_noshift": 'type: "Power" power_param { power: -1.5 scale: 2 }',
    "dropout_test": 'type: "Dropout" dropout_param { dropout_ratio: 0.3 }',
}
POSITIVE = {"power_sqrt", "power_recip_noshift"}


@pytest.mark.parametrize("inplace", [False, True], ids=["out", "inplace"])
@pytest.mark.parametrize("case", sorted(NEURONS))
def test_neuron(backend, case, inplace):
    x = np.random.default_rng(3).uniform(0.1, 2.0, (2, 3, 4, 5)) if case in POSITIVE else away_from_zero(3)
    parity(backend, NEURONS[case], [x], inplace=inplace, phase=TEST if case == "dropout_test" else TRAIN)


@pytest.mark.parametrize("inplace", [False, True], ids=["out", "inplace"])
@pytest.mark.parametrize("shape", [(2, 3, 4, 5), (4, 3)])
@pytest.mark.parametrize("shared", ["false", "true"])
def test_prelu(backend, shared, shape, inplace):
    parity(backend, f'type: "PReLU" prelu_param {{ channel_shared: {shared} }}', [away_from_zero(4, shape)],
           inplace=inplace)


@pytest.mark.parametrize("inplace", [False, True], ids=["out", "inplace"])
@pytest.mark.parametrize("ratio", [0.2, 0.9])
def test_dropout_shares_the_host_drawn_mask(backend, ratio, inplace):
    parity(backend, f'type: "Dropout" dropout_param {{ dropout_ratio: {ratio} }}', [normal(5, (3, 4, 5))],
           inplace=inplace)


# -- pooling, LRN, BatchNorm -------------------------------------------------------------------------

POOLING = [  # (pooling_param fields, input shape): as tests/layers/test_pooling.py
    ("kernel_size: 3 stride: 2", (2, 3, 8, 8)),
    ("kernel_size: 3 stride: 2", (1, 2, 7, 9)),
    ("kernel_size: 2 stride: 2", (2, 2, 6, 6)),
    ("kernel_size: 3 stride: 1 pad: 1", (1, 2, 5, 6)),
    ("kernel_size: 3 stride: 2 pad: 1", (2, 2, 7, 7)),
    ("kernel_h: 2 kernel_w: 3 stride: 2 pad: 1", (1, 3, 5, 8)),
    ("kernel_h: 3 kernel_w: 2 stride_h: 1 stride_w: 2 pad_h: 1 pad_w: 0", (1, 2, 6, 5)),
    ("kernel_size: 1 stride: 3", (1, 2, 7, 7)),
    ("kernel_size: 1 stride: 3", (1, 2, 5, 5)),
    ("kernel_size: 3 stride: 2 round_mode: FLOOR", (1, 2, 8, 8)),
    ("global_pooling: true", (2, 3, 5, 7)),
    ("global_pooling: true", (1, 2, 17, 16)),                 # > 256 taps: an int32 argmax
    ("kernel_h: 4 kernel_w: 5 stride: 2", (2, 2, 4, 5)),
    ("kernel_size: 17 stride: 1", (1, 1, 18, 18)),
]


@pytest.mark.parametrize("pool", ["MAX", "AVE"])
@pytest.mark.parametrize("fields,shape", POOLING)
def test_pooling(backend, pool, fields, shape):
    n_tops = 2 if pool == "MAX" else 1                      # MAX: Caffe's mask top too
    parity(backend, f'type: "Pooling" pooling_param {{ pool: {pool} {fields} }}', [distinct(shape, 2)],
           n_tops=n_tops)


@pytest.mark.parametrize("phase", [TRAIN, TEST], ids=["train", "test"])
def test_stochastic_pooling(backend, phase):
    x = np.random.default_rng(6).uniform(0, 1, (2, 2, 6, 6))
    parity(backend, 'type: "Pooling" pooling_param { pool: STOCHASTIC kernel_size: 3 stride: 2 }', [x],
           phase=phase, forward_only=phase == TEST)


LRN = [
    'norm_region: ACROSS_CHANNELS local_size: 3 alpha: 0.2 beta: 0.75 k: 2',
    'norm_region: ACROSS_CHANNELS local_size: 5 alpha: 1.5 beta: 0.6',
    'norm_region: ACROSS_CHANNELS local_size: 1 alpha: 0.5 beta: 1.3 k: 0.5',
    'norm_region: WITHIN_CHANNEL local_size: 3 alpha: 0.2 beta: 0.75 k: 2',
    'norm_region: WITHIN_CHANNEL local_size: 5 alpha: 2.0 beta: 0.5',
]


@pytest.mark.parametrize("fields", LRN)
def test_lrn(backend, fields):
    parity(backend, f'type: "LRN" lrn_param {{ {fields} }}', [normal(1, (2, 4, 5, 4))])


@pytest.mark.parametrize("inplace", [False, True], ids=["out", "inplace"])
@pytest.mark.parametrize("shape", [(4, 3), (2, 3, 4, 5), (3, 2, 7)])
@pytest.mark.parametrize("use_global", [False, True], ids=["batch", "global"])
def test_batch_norm(backend, use_global, shape, inplace):
    text = (f'type: "BatchNorm" batch_norm_param {{ use_global_stats: {str(use_global).lower()} '
            f'moving_average_fraction: 0.9 eps: 1e-4 }}')
    C = shape[1]
    rng = np.random.default_rng(8)
    params = [rng.normal(0, 1, C), rng.uniform(0.5, 2, C), [1.7]] if use_global else None
    parity(backend, text, [normal(40, shape, 1.5) + 0.7], inplace=inplace, params=params)


# -- Scale, Bias, InnerProduct ---------------------------------------------------------------------

SCALE_LEARNED = ["", "axis: 0", "axis: 1 num_axes: 2", "axis: 1 num_axes: -1", "axis: 0 num_axes: -1",
                 "axis: -1", "axis: 2 num_axes: 0"]
SCALE_SECOND = [("axis: 0", (2, 3)), ("axis: 1", (3, 4)), ("axis: 1", (3, 4, 5)), ("axis: -2", (4, 5)),
                ("axis: 1", ())]


@pytest.mark.parametrize("inplace", [False, True], ids=["out", "inplace"])
@pytest.mark.parametrize("bias", ["false", "true"])
@pytest.mark.parametrize("fields", SCALE_LEARNED)
def test_scale(backend, fields, bias, inplace):
    parity(backend, f'type: "Scale" scale_param {{ {fields} bias_term: {bias} }}', [normal(9, (2, 3, 4, 5))],
           inplace=inplace)


@pytest.mark.parametrize("bias", ["false", "true"])
@pytest.mark.parametrize("fields,shape", SCALE_SECOND)
def test_scale_by_a_bottom(backend, fields, shape, bias):
    parity(backend, f'type: "Scale" scale_param {{ {fields} bias_term: {bias} }}',
           [normal(9, (2, 3, 4, 5)), normal(10, shape)])


@pytest.mark.parametrize("inplace", [False, True], ids=["out", "inplace"])
@pytest.mark.parametrize("fields", ["", "axis: 0", "axis: 1 num_axes: 2", "axis: 2 num_axes: 0"])
def test_bias(backend, fields, inplace):
    parity(backend, f'type: "Bias" bias_param {{ {fields} }}', [normal(11, (2, 3, 4, 5))], inplace=inplace)


def test_bias_by_a_bottom(backend):
    parity(backend, 'type: "Bias" bias_param { axis: 1 }', [normal(11, (2, 3, 4, 5)), normal(12, (3, 4))])


@pytest.mark.parametrize("fields,shape", [("num_output: 4", (2, 3, 4, 5)), ("num_output: 4 transpose: true", (3, 20)),
                                          ("num_output: 3 axis: 2 bias_term: false", (2, 3, 4, 5))])
def test_inner_product(backend, fields, shape):
    parity(backend, f'type: "InnerProduct" inner_product_param {{ {fields} }}', [normal(13, shape)])


# -- structure layers ----------------------------------------------------------------------------

ELTWISE = [("", 2), ("operation: SUM", 3), ("coeff: 1 coeff: -0.5 coeff: 2", 3), ("coeff: 0.3 coeff: 1", 2),
           ("operation: PROD", 2), ("operation: PROD", 3), ("operation: PROD stable_prod_grad: false", 3),
           ("operation: MAX", 2), ("operation: MAX", 3), ("operation: MAX", 4)]


@pytest.mark.parametrize("fields,n", ELTWISE)
def test_eltwise(backend, fields, n):
    xs = [distinct((2, 3, 4), seed) for seed in range(n)]
    parity(backend, f'type: "Eltwise" eltwise_param {{ {fields} }}', xs)


def test_eltwise_max_ties_as_caffe(backend):
    a, b, c = np.array([1.0, 2.0, 3.0]), np.array([1.0, 0.0, 5.0]), np.array([1.0, 2.0, 5.0])
    parity(backend, 'type: "Eltwise" eltwise_param { operation: MAX }', [a, b, c])


@pytest.mark.parametrize("fields,shapes", [("", [(2, 2, 3), (2, 3, 3), (2, 1, 3)]), ("axis: 0", [(1, 3, 2), (2, 3, 2)]),
                                           ("axis: -1", [(2, 3, 1), (2, 3, 2), (2, 3, 3)]), ("", [(2, 3, 2)])])
def test_concat(backend, fields, shapes):
    parity(backend, f'type: "Concat" concat_param {{ {fields} }}', [normal(i, s) for i, s in enumerate(shapes)])


@pytest.mark.parametrize("fields,shape,n_tops", [("slice_point: 1 slice_point: 3", (2, 5, 3), 3),
                                                 ("axis: 0 slice_point: 2", (3, 2), 2), ("axis: -1", (2, 3, 6), 3)])
def test_slice(backend, fields, shape, n_tops):
    parity(backend, f'type: "Slice" slice_param {{ {fields} }}', [normal(14, shape)], n_tops=n_tops)


@pytest.mark.parametrize("text,n_tops", [('type: "Split"', 3), ('type: "Flatten"', 1),
                                         ('type: "Reshape" reshape_param { shape { dim: 0 dim: -1 dim: 2 } }', 1)])
def test_split_flatten_reshape(backend, text, n_tops):
    parity(backend, text, [normal(15, (2, 3, 4, 5))], n_tops=n_tops)


def test_silence(backend):
    parity(backend, 'type: "Silence"', [normal(16, (2, 3)), normal(17, (4,))], n_tops=0)


# -- softmax, losses, accuracy ---------------------------------------------------------------------

@pytest.mark.parametrize("inplace", [False, True], ids=["out", "inplace"])
@pytest.mark.parametrize("axis", [0, 1, 2, -1])
def test_softmax(backend, axis, inplace):
    parity(backend, f'type: "Softmax" softmax_param {{ axis: {axis} }}', [normal(18, (2, 5, 3, 4), 2)],
           inplace=inplace)


def labels(seed, shape, channels, ignore=None):
    lab = np.random.default_rng(seed).integers(0, channels, shape).astype(np.float64)
    if ignore is not None:
        lab[np.random.default_rng(seed + 1).random(shape) < 0.3] = ignore
    return lab


def loss_text(kind, mode, ignore, extra=""):
    fields = (f"normalization: {mode} " if mode else "") + (f"ignore_label: {ignore}" if ignore is not None else "")
    return f'type: "{kind}" loss_param {{ {fields} }} {extra}'


@pytest.mark.parametrize("ignore", [None, -1, 0])
@pytest.mark.parametrize("mode", ["FULL", "VALID", "BATCH_SIZE", "NONE"])
@pytest.mark.parametrize("xshape,axis", [((4, 5), 1), ((2, 5, 3, 3), 1), ((2, 3, 4, 2), 2)])
def test_softmax_loss(backend, xshape, axis, mode, ignore):
    lab = labels(19, xshape[:axis] + xshape[axis + 1:], xshape[axis], -1 if ignore == -1 else None)
    parity(backend, loss_text("SoftmaxWithLoss", mode, ignore, f"softmax_param {{ axis: {axis} }}"),
           [normal(20, xshape, 2), lab])


def test_softmax_loss_with_the_softmax_top(backend):
    parity(backend, 'type: "SoftmaxWithLoss" loss_param { ignore_label: 1 }',
           [normal(21, (3, 4, 2)), labels(22, (3, 2), 4)], n_tops=2)


def test_softmax_loss_label_out_of_range(backend):
    from sncaffe.layers import LayerError
    layer, bottom, top = on_device(backend, 'type: "SoftmaxWithLoss"', [normal(23, (2, 3)), [0.0, 3.0]], [])
    with pytest.raises(LayerError, match=r"label out of range \[0, 3\)"):
        layer.forward(bottom, top)
        loss_gpu.check_labels(layer, None, 3, wait=True)     # on a GPU: read once computed


def test_label_check_reads_the_flag_only_once_the_gpu_is_past_it(monkeypatch):
    """No device-to-host sync per iteration for the label check: the flag of an iteration is read
    when its event is done (a later forward), and then raises."""
    from sncaffe.layers import LayerError
    events, reads = [], []

    class Event:
        def __init__(self, disable_timing=True):
            self.done = False
            events.append(self)

        def record(self, stream=None):
            pass

    class DeviceBool:                       # a CuPy bool array: reading it would sync
        __module__ = "cupy._fake"

        def __init__(self, value):
            self.value = value

        def any(self):
            return self

        def __bool__(self):
            reads.append(self.value)
            return self.value
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(cuda=types.SimpleNamespace(Event=Event)))
    layer = make_layer('type: "SoftmaxWithLoss"', n_bottoms=2)
    loss_gpu.check_labels(layer, DeviceBool(True), 3)
    loss_gpu.check_labels(layer, DeviceBool(False), 3)
    assert reads == [] and len(events) == 2                 # nothing read while the GPU is behind
    events[0].done = True
    with pytest.raises(LayerError, match=r"label out of range \[0, 3\)"):
        loss_gpu.check_labels(layer, DeviceBool(False), 3)
    assert reads == [True]


@pytest.mark.parametrize("inplace", [False, True], ids=["out", "inplace"])
@pytest.mark.parametrize("shape", [(3, 37), (2, 300), (5, 3)])
def test_softmax_rows(backend, shape, inplace):
    """inner = 1 (classifier outputs): one block per row, C spanning several strides of a block."""
    parity(backend, 'type: "Softmax"', [normal(41, shape, 3)], inplace=inplace)
    lab = labels(42, shape[:1], shape[1])
    parity(backend, 'type: "SoftmaxWithLoss"', [normal(43, shape, 3), lab])


NAN_NEURONS = ["relu", "relu_leaky", "relu_negslope", "elu", "elu_half", "elu_negalpha", "absval", "sigmoid", "tanh"]


@pytest.mark.parametrize("case", NAN_NEURONS + ["prelu", "prelu_shared"])
def test_nan_passes_through_as_on_the_cpu(backend, case):
    """A diverging run: NaN in, NaN out where the CPU (and Caffe) gives NaN, in forward, backward
    and PReLU's slope gradient, so the NaN stop fires on the GPU too."""
    x = away_from_zero(44, (2, 3, 2, 2))
    x.reshape(-1)[[0, 5, 13]] = np.nan
    if case.startswith("prelu"):
        text = f'type: "PReLU" prelu_param {{ channel_shared: {str(case.endswith("shared")).lower()} }}'
    else:
        text = NEURONS[case]
    cpu = make_layer(text)
    cpu.setup([x.shape])
    y = Harness(cpu, [x], np.float32, 0, None).forward()[0]
    if case not in ("absval",):                            # |NaN| is NaN anyway; its backward is the point
        assert np.isnan(y).sum() == 3
    parity(backend, text, [x])


def test_batch_norm_variance_is_two_pass(backend):
    """|mean| >> std in a float64 net: E[x^2] - E[x]^2 cancels, the centered squares do not."""
    x = 1e8 + np.random.default_rng(45).standard_normal((4, 3, 5))
    layer = make_layer('type: "BatchNorm"')
    layer.setup([x.shape])
    put = backend.put
    layer.blobs = [Blob(f"b{i}", put(np.zeros(s)), put(np.zeros(s))) for i, s in enumerate(layer.param_shapes)]
    layer.scratch = {k: put(np.zeros(s, d or np.float64)) for k, (s, d) in layer.scratch_specs.items()}
    bottom = [Blob("x", put(x), put(np.zeros_like(x)))]
    top = [Blob("y", put(np.zeros_like(x)), put(np.zeros_like(x)))]
    layer.forward(bottom, top)
    var = x.transpose(1, 0, 2).reshape(3, -1).var(axis=1)
    np.testing.assert_allclose(backend.get(layer.scratch["std"]), np.sqrt(var + layer.eps), rtol=1e-6)
    np.testing.assert_allclose(backend.get(top[0].data).std(axis=(0, 2)), np.sqrt(var / (var + layer.eps)), rtol=1e-5)


@pytest.mark.parametrize("shapes", [((2, 3, 2, 2), (2, 3, 2, 2)), ((3, 8), (3, 2, 4))])
def test_euclidean_loss(backend, shapes):
    parity(backend, 'type: "EuclideanLoss"', [normal(24, shapes[0]), normal(25, shapes[1])])


@pytest.mark.parametrize("ignore", [None, -1])
@pytest.mark.parametrize("mode", [None, "FULL", "VALID", "BATCH_SIZE", "NONE"])
def test_sigmoid_cross_entropy_loss(backend, mode, ignore):
    t = np.random.default_rng(26).uniform(0, 1, (2, 4, 3))
    if ignore is not None:
        t[np.random.default_rng(27).random(t.shape) < 0.3] = ignore
    parity(backend, loss_text("SigmoidCrossEntropyLoss", mode, ignore), [normal(28, (2, 4, 3), 2), t])


@pytest.mark.parametrize("ignore", [None, 2])
@pytest.mark.parametrize("top_k", [1, 2, 4])
@pytest.mark.parametrize("xshape,axis", [((12, 5), 1), ((2, 5, 3, 2), 1), ((2, 3, 5), 2)])
def test_accuracy(backend, xshape, axis, top_k, ignore):
    fields = f"top_k: {top_k} axis: {axis}" + (f" ignore_label: {ignore}" if ignore is not None else "")
    lab = labels(29, xshape[:axis] + xshape[axis + 1:], xshape[axis])
    parity(backend, f'type: "Accuracy" accuracy_param {{ {fields} }}', [normal(30, xshape), lab], n_tops=2,
           forward_only=True)


@pytest.mark.parametrize("maxval", ["false", "true"])
@pytest.mark.parametrize("xshape,k,axis", [((3, 6), 2, None), ((2, 5, 3, 3), 3, None), ((2, 5, 3, 3), 2, 1)])
def test_argmax(backend, xshape, k, axis, maxval):
    fields = f"top_k: {k} out_max_val: {maxval}" + (f" axis: {axis}" if axis is not None else "")
    parity(backend, f'type: "ArgMax" argmax_param {{ {fields} }}', [normal(31, xshape)], forward_only=True)


# -- convolution on cuDNN --------------------------------------------------------------------------

CONV = [  # (bottom shape, num_output, convolution_param fields): as tests/layers/test_conv.py
    ((2, 3, 7, 6), 4, "kernel_size: 3"),
    ((2, 4, 9, 8), 6, "kernel_size: 3 stride: 2 pad: 1"),
    ((1, 6, 9, 9), 6, "kernel_size: 3 stride: 2 pad: 1 dilation: 2 group: 3"),
    ((2, 3, 8, 7), 4, "kernel_h: 3 kernel_w: 2 stride_h: 1 stride_w: 2 pad_h: 0 pad_w: 1 bias_term: false"),
    ((2, 5, 7, 7), 3, "kernel_size: 1 stride: 2"),
    ((2, 4, 6, 6), 4, "kernel_size: 1 group: 2 bias_term: false"),
    ((2, 2, 11, 10), 3, "kernel_size: 5 stride: 3 pad: 2"),
    ((1, 3, 9, 9), 2, "kernel_size: 2 stride: 3"),
    ((1, 2, 3, 3), 2, "kernel_size: 3 pad: 3"),
    ((1, 2, 4, 3), 128, "kernel_size: 3 pad: 1 bias_term: false"),
]
DECONV = [((2, 3, 4, 5), 6, "kernel_size: 3 stride: 2 pad: 1 group: 3"), ((1, 2, 5, 5), 3, "kernel_size: 2 dilation: 2"),
          ((2, 4, 3, 3), 2, "kernel_size: 4 stride: 2 bias_term: false")]


@needs_gpu
@pytest.mark.parametrize("kind,shape,M,fields", [("Convolution",) + c for c in CONV] +
                         [("Deconvolution",) + c for c in DECONV])
@pytest.mark.parametrize("declared", [True, False], ids=["cudnn-workspace", "cpu-workspace"])
def test_convolution(backend, kind, shape, M, fields, declared):
    """With the workspace declared for cuDNN in setup (building_for), or with only the CPU
    layer's workspace (a net built without it)."""
    text = f'type: "{kind}" convolution_param {{ num_output: {M} {fields} weight_filler {{ type: "gaussian" }} }}'
    parity(backend, text, [normal(32, shape)], target=declared)


@pytest.mark.parametrize("kind,shape,M,fields", [("Convolution",) + c for c in CONV] +
                         [("Deconvolution",) + c for c in DECONV])
def test_conv_view_matches_the_layer(kind, shape, M, fields):
    """cuDNN sees Caffe's conv view: a Convolution's top (a Deconvolution's bottom) is the grid."""
    layer = make_layer(f'type: "{kind}" convolution_param {{ num_output: {M} {fields} }}')
    (top,) = layer.setup([shape])
    image, grid, weight, _ = conv_gpu.conv_view(layer, shape)
    assert (image, grid) == ((top, shape) if kind == "Deconvolution" else (shape, top))
    assert weight == layer.param_shapes[0]


def test_algorithm_choice():
    """The fastest algorithm within the workspace, deterministic ones first; measured again when
    a larger workspace might admit algorithms that failed for lack of it."""
    A = cudnn.Algorithm
    shape = object.__new__(cudnn_conv.ConvShape)
    shape.image, shape.weight = (1, 1, 1, 1), (1, 1, 1, 1)
    shape.measured = {"forward": (1 << 20, [A(0, "a", 0, 3.0, 0, True, "fma"), A(1, "b", 0, 1.0, 1 << 20, False, "fma"),
                                            A(2, "c", 0, 2.0, 1 << 10, True, "fma"), A(3, "d", 7, -1, 1 << 30, True, "fma")])}
    assert shape.algorithm("backward_data", 0) is None
    assert shape.algorithm("forward", 1 << 20).algo == 2
    assert shape.algorithm("forward", 100).algo == 0
    assert shape.algorithm("forward", 2 << 20) is None            # "d" failed within 1 MiB: measure again
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cudnn_conv, "DETERMINISTIC", False)
        assert shape.algorithm("forward", 1 << 20).algo == 1
    shape.measured["forward"] = (1 << 20, [A(1, "b", 0, 1.0, 1 << 20, False, "fma")])
    assert shape.algorithm("forward", 1 << 20).algo == 1           # no deterministic one: the fastest
    with pytest.raises(cudnn.CudnnNotSupported, match="no algorithm runs within 0 bytes"):
        shape.algorithm("forward", 0)


@needs_gpu
def test_convolution_picks_within_the_limit_and_remembers(backend):
    text = 'type: "Convolution" convolution_param { num_output: 16 kernel_size: 3 pad: 1 }'
    sizes = []
    for limit in (0, 64 << 20):
        layer = make_layer(text)
        layer.workspace_limit = limit
        layer.target = backend.device
        layer.setup([(4, 8, 16, 16)])
        sizes.append(layer.workspace_specs["cudnn"][0][0])
    assert sizes[0] == 1 and sizes[1] >= 1          # no workspace: the algorithms that need none
    shapes = [s for s in cudnn_conv._shapes.values() if s.image == (4, 8, 16, 16)]
    assert len(shapes) == 1 and set(shapes[0].measured) == set(cudnn_conv.DIRECTIONS)


# -- whole nets: the golden cases, the zoo, the memory runtime --------------------------------------

def load_weights(backend, net, path):
    src = blobproto.read_caffemodel(path)
    for lp in src.layer:
        for bp, blob in zip(lp.blobs, net.params.get(lp.name, [])):
            backend.set(blob.data, blobproto.to_array(bp, np.float32).reshape(blob.data.shape))


GOLDEN = sorted(p.relative_to(SHARED / "golden").as_posix()
                for kind in ("layers", "nets") for p in (SHARED / "golden" / kind).iterdir()) if SHARED else []


@needs_shared
@pytest.mark.parametrize("case", GOLDEN)
def test_golden_case(backend, case):
    import h5py
    d = SHARED / "golden" / case
    rtol, atol = 1e-4, 1e-5             # fp32 on another device: relative 1e-4 (the CPU's test: 1e-5 per layer)
    net = backend.net(d / "net.prototxt", "TRAIN")
    try:
        load_weights(backend, net, d / "weights.caffemodel")
        with h5py.File(d / "input.h5") as inp, h5py.File(d / "expected.h5") as exp:
            for name, arr in inp["inputs"].items():
                backend.set(net.blobs[name.replace("|", "/")].data, arr[()])
            loss = net.forward()
            np.testing.assert_allclose(loss, exp.attrs["loss"][0], rtol=rtol, atol=atol)
            for name, arr in inp.get("top_diffs", {}).items():
                backend.set(net.blobs[name.replace("|", "/")].diff, arr[()])
            net.clear_param_diffs()
            net.backward()
            for name, blob in net.blobs.items():
                g = exp["blobs"][name.replace("/", "|")]
                np.testing.assert_allclose(backend.get(blob.data), g["data"][()], rtol=rtol, atol=atol,
                                           err_msg=f"{case}: data of {name}")
                diff = backend.get(blob.diff) if blob.diff is not None else np.zeros(blob.data.shape)
                np.testing.assert_allclose(diff, g["diff"][()], rtol=rtol, atol=atol, err_msg=f"{case}: diff of {name}")
            for layer, blobs in net.params.items():
                for i, blob in enumerate(blobs):
                    g = exp["params"][layer.replace("/", "|")][str(i)]
                    for what, a in (("data", blob.data), ("diff", blob.diff)):
                        np.testing.assert_allclose(backend.get(a), g[what][()].reshape(a.shape), rtol=rtol, atol=atol,
                                                   err_msg=f"{case}: param {layer}[{i}] {what}")
    finally:
        net.release()


ZOO = sorted(p for p in (SHARED / "zoo").rglob("*.prototxt") if "solver" not in p.name) if SHARED else []
OWN = sorted(p for p in (ROOT / "prototxt").glob("*.prototxt") if "solver" not in p.name and p.stem != "resnet2500")
DATA_SHAPES = {"bvlc_alexnet": (3, 227, 227), "bvlc_googlenet": (3, 224, 224), "cifar10": (3, 32, 32),
               "mnist": (1, 28, 28), "lenet": (1, 28, 28)}


def net_param(path, batch=2, hw=None):
    """A training net at ``batch``: Input layers for data layers, force_backward. With ``hw``:
    inputs hw x hw, every num_output / 16 and 7x7 average pooling made global (a small net with
    every layer and connection of the big one, as tests/plan/test_modes.py shrinks them)."""
    param = read_text(path, pb.NetParameter())
    if any(layer.type in DATA_LAYERS for layer in param.layer):
        chw = next(v for k, v in DATA_SHAPES.items() if k in path.name)
        param = replace_data_layers(param, {"data": (batch,) + chw[:1] + ((hw, hw) if hw else chw[1:]),
                                            "label": (batch,)})
    param = set_batch(param, batch)
    for layer in param.layer if hw else []:
        if layer.type in ("Convolution", "InnerProduct"):
            p = layer.convolution_param if layer.type == "Convolution" else layer.inner_product_param
            p.num_output = max(1, p.num_output // 16)
        elif layer.type == "Input":
            for shape in layer.input_param.shape:
                if len(shape.dim) == 4:
                    shape.dim[2] = shape.dim[3] = hw
        elif layer.type == "Pooling" and layer.pooling_param.kernel_size == 7:
            layer.pooling_param.ClearField("kernel_size")
            layer.pooling_param.global_pooling = True
    param.force_backward = True
    return param


def random_state(net, rng):
    """Random weights where a file leaves them all zero, unit running statistics; returns them."""
    values = {}
    for node in net.graph.layers:
        layer = node.layer
        for i, b in enumerate(layer.blobs):
            host = np.array(b.data.get() if hasattr(b.data, "get") else b.data)
            if layer.learnable and not np.any(host):
                host = rng.normal(0, 1 / np.sqrt(max(1, host[0].size if host.ndim else 1)), host.shape)
            elif layer.type == "BatchNorm" and i > 0 and not np.any(host):
                host = np.ones_like(host)
            values[node.name, i] = host.astype(b.data.dtype)
    return values


def feed(net, rng, put):
    for name in net.inputs:
        shape = net.blobs[name].data.shape
        put(net.blobs[name].data, rng.integers(0, 2, shape) if name == "label" else rng.standard_normal(shape))


def run_net(net, state, inputs, put, get, top_diffs):
    """Forward and backward from given params and inputs: every blob and param, on the host."""
    for (name, i), v in state.items():
        put(net.graph.layer(name).layer.blobs[i].data, v)
    for name, v in inputs.items():
        put(net.blobs[name].data, v)
    net.clear_param_diffs()
    out = {"loss": np.float64(net.forward())}
    for name, g in top_diffs.items():
        put(net.blobs[name].diff, g)
    net.backward()
    for name, blob in net.blobs.items():
        for what, a in (("", blob.data), (".diff", blob.diff)):
            if a is not None:
                out[name + what] = get(a)
    for name, blobs in net.params.items():
        for i, b in enumerate(blobs):
            out[f"{name}[{i}]"], out[f"{name}[{i}].diff"] = get(b.data), get(b.diff)
    return out


SMALL = {"mnist__lenet", "mnist__lenet_train_test", "lenet_train_test", "cifar10__cifar10_quick_train_test"}


@pytest.mark.parametrize("path", ZOO + OWN, ids=lambda p: p.name)
def test_zoo_net_parity(backend, path):
    """Batch 2 of every zoo net and sncaffe's own (the ResNets shrunk; ResNet-2500 is planned only,
    in test_planner): the device net against the cpu net, every blob, diff, param and param diff
    after forward and backward, in float64. (In float32 a deep net's gradients do not compare: a
    max-pooling window whose two largest values differ in the last bits, or a ReLU input within
    rounding of 0, goes either way on either device and moves that gradient; float32 is compared
    layer by layer above and on the golden nets.)"""
    if backend.name == "emulated" and path.stem not in SMALL:
        pytest.skip("emulated: the small nets only (time)")
    param = net_param(path, hw=32 if path.parent == ROOT / "prototxt" and "resnet" in path.stem else None)
    rng = np.random.default_rng(0)
    cpu_net = Net(param, "TRAIN", device=CPUDevice("8GiB"), seed=1, dtype=np.float64)
    dev_net = backend.net(param, "TRAIN", seed=1, dtype=np.float64)
    try:
        state = random_state(cpu_net, rng)
        shape = {n: cpu_net.blobs[n].data.shape for n in cpu_net.blobs}
        inputs = {n: rng.integers(0, 2, shape[n]) if n == "label" else rng.standard_normal(shape[n])
                  for n in cpu_net.inputs}
        diffs = {n: rng.standard_normal(shape[n]) for n in cpu_net.outputs
                 if cpu_net.blobs[n].diff is not None and cpu_net.blobs[n].data.ndim}
        ref = run_net(cpu_net, state, inputs, lambda dst, v: dst.__setitem__(Ellipsis, v), np.array, diffs)
        got = run_net(dev_net, state, inputs, backend.set, backend.get, diffs)
        assert got.keys() == ref.keys()
        for k in ref:
            close_norm(got[k], ref[k], f"{path.name}: {k}", 1e-7)
    finally:
        dev_net.release()
        cpu_net.release()


MEMORY_NETS = [ROOT / "prototxt" / "lenet_train_test.prototxt", ROOT / "prototxt" / "resnet50.prototxt"]
if SHARED:
    MEMORY_NETS.append(SHARED / "zoo" / "bvlc" / "bvlc_googlenet__train_val.prototxt")


def train(backend, param, mode, iters=2):
    """As tests/plan/test_modes.py, on a fresh device: per iteration the pool peak and every
    parameter, gradient and input gradient, on the host."""
    device = backend.new_device("2GiB")
    net = backend.net(param, "TRAIN", device=device, memory=mode, seed=1)
    rng = np.random.default_rng(0)
    state = random_state(net, rng)
    for (name, i), v in state.items():
        backend.set(net.graph.layer(name).layer.blobs[i].data, v)
    steps = []
    for _ in range(iters):
        feed(net, rng, backend.set)
        net.clear_param_diffs()
        device.pool.reset_peak()
        loss = net.forward()
        for name in net.outputs:
            blob = net.blobs[name]
            if blob.diff is not None and blob.data.ndim:
                backend.set(blob.diff, rng.standard_normal(blob.data.shape))
        net.backward()
        got = {"loss": np.float64(loss)}
        for name, blobs in net.params.items():
            for i, b in enumerate(blobs):
                got[f"{name}[{i}]"], got[f"{name}[{i}].diff"] = backend.get(b.data), backend.get(b.diff)
        for name in net.inputs:
            if net.blobs[name].diff is not None:
                got[name + ".diff"] = backend.get(net.blobs[name].diff)
        steps.append((device.pool.peak, got))
        for blobs in net.params.values():
            for b in blobs:
                b.data -= np.float32(0.01) * b.diff
    assert device.pool.in_use == net.plan.persistent_bytes, "an iteration left blocks behind"
    assert device.host_pool.in_use == 0, "an iteration left host blocks behind"
    plan = net.plan
    net.release()
    if hasattr(device, "close"):
        device.close()
        backend.device.activate()
    return plan, steps


_reference = {}


@pytest.mark.parametrize("path", MEMORY_NETS, ids=lambda p: p.stem)
@pytest.mark.parametrize("mode", MODES)
def test_memory_modes(backend, path, mode):
    """Every memory mode on the device: the pool peak is the planned peak, and every parameter and
    gradient equals mode none's to the last bit (deterministic kernels and algorithms)."""
    if backend.name == "emulated" and path.stem != "lenet_train_test":
        pytest.skip("emulated: LeNet only (time)")
    param = net_param(path, hw=32 if "resnet" in path.stem else 96 if "googlenet" in path.stem else None)
    key = (backend.name, path)
    if key not in _reference:
        _reference.clear()
        _reference[key] = train(backend, param, "none")
    ref_plan, ref_steps = _reference[key]
    plan, steps = (ref_plan, ref_steps) if mode == "none" else train(backend, param, mode)
    assert [peak for peak, _ in steps] == [plan.peak] * len(steps), "pool peak != planned peak"
    assert plan.peak <= ref_plan.peak
    for it, ((_, got), (_, ref)) in enumerate(zip(steps, ref_steps)):
        differ = [k for k in ref if got[k].tobytes() != ref[k].tobytes()]
        assert not differ, f"iteration {it}: differs from mode none in {differ[:8]}"


# -- out of memory -------------------------------------------------------------------------------------

LENET = ROOT / "prototxt" / "lenet_train_test.prototxt"


@needs_gpu
def test_cupy_out_of_memory_is_memory_exhausted(backend):
    net = backend.net(net_param(LENET), "TRAIN")
    stray = backend.device.stray
    try:
        stray.pool.free_all_blocks()
        stray.pool.set_limit(size=stray.in_use + 512)       # CuPy's temporaries have no room left
        with pytest.raises(MemoryExhausted, match="at step .*memory was taken outside the plan"):
            net.forward()
            net.backward()
    finally:
        stray.pool.set_limit(size=0)
        net.release()


@needs_gpu
def test_cudnn_out_of_memory_is_memory_exhausted(backend, monkeypatch):
    net = backend.net(net_param(LENET), "TRAIN")
    real = cudnn.call

    def call(name, *args):
        if name == "cudnnConvolutionForward":
            raise cudnn.status_error(4004, name, "simulated: device allocation failed")
        return real(name, *args)
    monkeypatch.setattr(cudnn, "call", call)
    try:
        with pytest.raises(MemoryExhausted, match=r"at step conv1.*CUDNN_STATUS_INTERNAL_ERROR_DEVICE_ALLOCATION"):
            net.forward()
    finally:
        monkeypatch.undo()
        net.release()


# -- without CuPy or a GPU -----------------------------------------------------------------------------

def test_gpu_code_imports_without_cupy(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)
    code = ("import sncaffe.layers, sncaffe.net; from sncaffe.backend import kernels; import sys; "
            "assert 'cupy' not in sys.modules; assert kernels.SOURCES; print(kernels.BLOCK)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr


def test_setup_for_a_cpu_device_declares_the_cpu_workspaces():
    text = 'type: "Pooling" pooling_param { pool: MAX kernel_size: 3 stride: 2 }'
    specs = []
    for target in (None, CPUDevice("1MiB")):
        layer = make_layer(text)
        layer.target = target
        layer.setup([(1, 2, 8, 8)])
        specs.append(layer.workspace_specs)
    # NumPy's taps' padded copy, or oneDNN's scratchpad where it runs the layer
    assert specs[0] == specs[1] and {"padded", "onednn"} & set(specs[0])


def test_setup_for_a_gpu_drops_what_only_the_cpu_needs():
    gpu = types.SimpleNamespace(kind="cuda")
    cases = [('type: "Pooling" pooling_param { pool: MAX kernel_size: 3 stride: 2 }', (1, 2, 8, 8)),
             ('type: "LRN" lrn_param { local_size: 3 }', (1, 4, 3, 3)),
             ('type: "BatchNorm"', (2, 3, 4)), ('type: "Eltwise" eltwise_param { operation: MAX }', (2, 3))]
    for text, shape in cases:
        layer = make_layer(text, n_bottoms=2 if "Eltwise" in text else 1)
        layer.target = gpu
        layer.setup([shape] * (2 if "Eltwise" in text else 1))
        assert layer.workspace_specs == {}, text


@pytest.mark.parametrize("family", sorted(kernels.SOURCES))
def test_kernel_sources_compile_with_nvcc(family, tmp_path):
    """Where nvcc is (no GPU needed): the CUDA C compiles for Hopper, warnings as errors (float32;
    the emulated tests compile float64 too)."""
    if not shutil.which("nvcc"):
        pytest.skip("nvcc is not installed")
    for dtype in (np.float32,):
        for index in kernels.INDEX_TYPES[family]:
            src = tmp_path / f"{family}.cu"
            src.write_text(kernels.source(family, dtype, index))
            out = subprocess.run(["nvcc", "-arch=sm_90", "--ptx", "-Werror", "all-warnings", str(src), "-o",
                                  str(tmp_path / "k.ptx")], capture_output=True, text=True)
            assert out.returncode == 0, out.stderr
