"""cuDNN 9 through ctypes: the library, handles, descriptors and the calls a Caffe net needs.

CuPy 14 no longer ships cuDNN bindings, so sncaffe binds cuDNN 9's C API here,
in this one module (the "legacy" API of cudnn_ops.h / cudnn_cnn.h, which
cuDNN 9 still ships). Nothing here imports CuPy.

Finding the library (``load()``, cached): ``$SNCAFFE_CUDNN`` (a path; if set
it is the only candidate), then the ``nvidia-cudnn-cu13`` / ``-cu12`` wheel's
``nvidia/cudnn/lib/libcudnn.so.9``, then the system loader. Its version must
be 9.x. Failing that, ``CudnnNotFound`` (a RuntimeError) says what was tried
and which extra to install.

Conventions for the layer code:

- Device pointers are ints, or anything with ``.data.ptr`` (a CuPy array is
  passed as is); ``None`` is NULL.
- Every call takes the handle first and raises ``CudnnError`` (with cuDNN's
  own status name and last error message) on failure: ``CudnnOutOfMemory``
  (also a MemoryError) for allocation failures, ``CudnnNotSupported`` for the
  NOT_SUPPORTED family (a reason to fall back to another algorithm or kernel).
- alpha/beta follow cuDNN: ``y = alpha * op(x) + beta * y``; beta=0 overwrites,
  beta=1 accumulates (Caffe's param diffs). Their C type comes from the data
  type (double for float64, float otherwise).
- Descriptors are objects with ``close()`` (also run by ``__del__``);
  ``tensor(shape, dtype)`` returns a cached one, so a layer can ask per call.
  Shapes of fewer than 4 axes are padded with trailing 1s (N, C) -> (N, C, 1, 1).

A forward and backward of ReLU on a CUDADevice, for instance::

    d = cudnn.tensor(x.shape, x.dtype)
    relu = cudnn.ActivationDesc("relu")            # make once per layer, keep
    cudnn.activation_forward(device.cudnn, relu, d, x, d, y)
    cudnn.activation_backward(device.cudnn, relu, d, y, d, dy, d, x, d, dx)

Descriptors and output-shape queries need no GPU; everything taking a
``Handle`` does. Which cuDNN call serves which Caffe layer, and what a layer
must do around it, is written at each call (pooling's rounding, BatchNorm's
statistics, ReLU's slope, TF32).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import glob
import importlib.util
import math
import os
import site
import sys
from collections import namedtuple
from ctypes import byref, c_double, c_float, c_int, c_size_t, c_void_p
from dataclasses import dataclass

import numpy as np

from .. import config

LIBRARY = "libcudnn.so.9"
ENV = "SNCAFFE_CUDNN"
INSTALL_HINT = ("pip install 'sncaffe[cuda13]' (CUDA 13 driver) or 'sncaffe[cuda12]' (CUDA 12), "
                f"or point ${ENV} to a libcudnn.so.9")


# -- errors -------------------------------------------------------------------------

class CudnnNotFound(RuntimeError):
    """No usable cuDNN 9 library."""


class CudnnVersionError(CudnnNotFound):
    """A cuDNN library was found, but not version 9.x."""


class CudnnError(RuntimeError):
    """A cuDNN call failed: carries the status code, its name and cuDNN's message."""

    def __init__(self, status: int, function: str = "", message: str = "", name: str | None = None):
        self.status, self.function = status, function
        self.name = name or STATUS.get(status, f"CUDNN_STATUS_{status}")
        self.category = status // 1000 * 1000
        text = f"{function}: {self.name} ({status})" if function else f"{self.name} ({status})"
        super().__init__(f"{text}: {message}" if message else text)


class CudnnOutOfMemory(CudnnError, MemoryError):
    """cuDNN could not allocate host or device memory."""


class CudnnNotSupported(CudnnError):
    """The configuration (shape, type, algorithm) is not supported by cuDNN."""


# cudnnStatus_t of cuDNN 9 (cudnn_graph.h): category * 1000 + specific error.
STATUS = {
    0: "CUDNN_STATUS_SUCCESS",
    1001: "CUDNN_STATUS_NOT_INITIALIZED",
    1002: "CUDNN_STATUS_SUBLIBRARY_VERSION_MISMATCH",
    1003: "CUDNN_STATUS_SERIALIZATION_VERSION_MISMATCH",
    1004: "CUDNN_STATUS_DEPRECATED",
    1005: "CUDNN_STATUS_LICENSE_ERROR",
    1006: "CUDNN_STATUS_RUNTIME_IN_PROGRESS",
    1007: "CUDNN_STATUS_RUNTIME_FP_OVERFLOW",
    1008: "CUDNN_STATUS_SUBLIBRARY_LOADING_FAILED",
    2000: "CUDNN_STATUS_BAD_PARAM",
    2001: "CUDNN_STATUS_INVALID_VALUE",
    2002: "CUDNN_STATUS_BAD_PARAM_NULL_POINTER",
    2003: "CUDNN_STATUS_BAD_PARAM_MISALIGNED_POINTER",
    2004: "CUDNN_STATUS_BAD_PARAM_NOT_FINALIZED",
    2005: "CUDNN_STATUS_BAD_PARAM_OUT_OF_BOUND",
    2006: "CUDNN_STATUS_BAD_PARAM_SIZE_INSUFFICIENT",
    2007: "CUDNN_STATUS_BAD_PARAM_STREAM_MISMATCH",
    2008: "CUDNN_STATUS_BAD_PARAM_SHAPE_MISMATCH",
    2009: "CUDNN_STATUS_BAD_PARAM_DUPLICATED_ENTRIES",
    2010: "CUDNN_STATUS_BAD_PARAM_ATTRIBUTE_TYPE",
    2011: "CUDNN_STATUS_BAD_PARAM_CUDA_GRAPH_MISMATCH",
    2012: "CUDNN_STATUS_BAD_PARAM_DESCRIPTOR_TYPE",
    3000: "CUDNN_STATUS_NOT_SUPPORTED",
    3001: "CUDNN_STATUS_NOT_SUPPORTED_GRAPH_PATTERN",
    3002: "CUDNN_STATUS_NOT_SUPPORTED_SHAPE",
    3003: "CUDNN_STATUS_NOT_SUPPORTED_DATA_TYPE",
    3004: "CUDNN_STATUS_NOT_SUPPORTED_LAYOUT",
    3005: "CUDNN_STATUS_NOT_SUPPORTED_INCOMPATIBLE_CUDA_DRIVER",
    3006: "CUDNN_STATUS_NOT_SUPPORTED_INCOMPATIBLE_CUDART",
    3007: "CUDNN_STATUS_NOT_SUPPORTED_ARCH_MISMATCH",
    3008: "CUDNN_STATUS_NOT_SUPPORTED_RUNTIME_PREREQUISITE_MISSING",
    3009: "CUDNN_STATUS_NOT_SUPPORTED_SUBLIBRARY_UNAVAILABLE",
    3010: "CUDNN_STATUS_NOT_SUPPORTED_SHARED_MEMORY_INSUFFICIENT",
    3011: "CUDNN_STATUS_NOT_SUPPORTED_PADDING",
    3012: "CUDNN_STATUS_NOT_SUPPORTED_BAD_LAUNCH_PARAM",
    3013: "CUDNN_STATUS_NOT_SUPPORTED_CUDA_GRAPH_NATIVE_API",
    3014: "CUDNN_STATUS_NOT_SUPPORTED_INVALID_DYNAMIC_SHAPE",
    4000: "CUDNN_STATUS_INTERNAL_ERROR",
    4001: "CUDNN_STATUS_INTERNAL_ERROR_COMPILATION_FAILED",
    4002: "CUDNN_STATUS_INTERNAL_ERROR_UNEXPECTED_VALUE",
    4003: "CUDNN_STATUS_INTERNAL_ERROR_HOST_ALLOCATION_FAILED",
    4004: "CUDNN_STATUS_INTERNAL_ERROR_DEVICE_ALLOCATION_FAILED",
    4005: "CUDNN_STATUS_INTERNAL_ERROR_BAD_LAUNCH_PARAM",
    4006: "CUDNN_STATUS_INTERNAL_ERROR_TEXTURE_CREATION_FAILED",
    5000: "CUDNN_STATUS_EXECUTION_FAILED",
    5001: "CUDNN_STATUS_EXECUTION_FAILED_CUDA_DRIVER",
    5002: "CUDNN_STATUS_EXECUTION_FAILED_CUBLAS",
    5003: "CUDNN_STATUS_EXECUTION_FAILED_CUDART",
    5004: "CUDNN_STATUS_EXECUTION_FAILED_CURAND",
}
OUT_OF_MEMORY = (4003, 4004)


def status_error(status: int, function: str = "", message: str = "", name: str | None = None) -> CudnnError:
    """The exception for a failed status (never raised for 0)."""
    if status in OUT_OF_MEMORY:
        cls = CudnnOutOfMemory
    elif status // 1000 == 3:
        cls = CudnnNotSupported
    else:
        cls = CudnnError
    return cls(status, function, message, name)


# -- the library --------------------------------------------------------------------

def parse_version(number: int) -> tuple[int, int, int]:
    """cudnnGetVersion()'s number -> (major, minor, patch): 9.x encodes major*10000, 8.x and older major*1000."""
    if number >= 10000:
        return number // 10000, number // 100 % 100, number % 100
    return number // 1000, number // 100 % 10, number % 100


def check_version(number: int, path: str = "cuDNN") -> tuple[int, int, int]:
    version = parse_version(number)
    if version[0] != 9:
        raise CudnnVersionError(f"{path} is cuDNN {'.'.join(map(str, version))}; sncaffe needs cuDNN 9.x: "
                                + INSTALL_HINT)
    return version


def _site_dirs() -> list[str]:
    """Folders that may hold the ``nvidia`` namespace package of the CUDA wheels (never imports it)."""
    dirs = []
    try:
        spec = importlib.util.find_spec("nvidia")
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        dirs += [os.path.dirname(p) for p in spec.submodule_search_locations]
    try:
        dirs += site.getsitepackages() + [site.getusersitepackages()]
    except AttributeError:                  # some virtualenvs lack site.getsitepackages
        pass
    dirs += [p for p in sys.path if p.endswith("site-packages")]
    return list(dict.fromkeys(d for d in dirs if d))


def candidates() -> list[tuple[str, str]]:
    """(where, path or name) in the order tried: the override alone, else the wheels, then the system."""
    env = config.settings.cudnn
    if env:
        return [(f"${ENV}", env)]
    found = [("nvidia-cudnn wheel", os.path.join(d, "nvidia", "cudnn", "lib", LIBRARY)) for d in _site_dirs()]
    found = [c for c in found if os.path.exists(c[1])]
    found.append(("system loader", LIBRARY))
    name = ctypes.util.find_library("cudnn")
    if name and name != LIBRARY:
        found.append(("system loader", name))
    return found


def _preload_dependencies(cuda_major: int) -> None:
    """Load cuBLAS(Lt) and NVRTC of the same CUDA major from the wheels, where present.

    cuDNN's engines dlopen them by soname; the wheels keep them outside the
    loader's path, and a library already loaded is found by its soname.
    """
    for lib in ("libcublasLt", "libcublas", "libnvrtc"):
        soname = f"{lib}.so.{cuda_major}"
        try:
            ctypes.CDLL(soname, mode=os.RTLD_NOLOAD)   # already loaded (by CuPy, or the system's)
            continue
        except OSError:
            pass
        for path in [p for d in _site_dirs() for p in glob.glob(os.path.join(d, "nvidia", "*", "lib", soname))]:
            try:
                ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
                break
            except OSError:
                pass


@functools.lru_cache(maxsize=None)
def load() -> ctypes.CDLL:
    """The cuDNN 9 library (found once per process)."""
    tried = []
    for where, path in candidates():
        if where.startswith("$") and not os.path.exists(path):
            raise CudnnNotFound(f"{where} points to {path}, which does not exist")
        try:
            lib = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        except OSError as e:
            tried.append(f"{where}: {path} ({e})")
            continue
        lib.cudnnGetVersion.restype = c_size_t
        lib.cudnnGetCudartVersion.restype = c_size_t
        try:
            check_version(lib.cudnnGetVersion(), path)
        except CudnnVersionError as e:
            if where.startswith("$"):
                raise
            tried.append(f"{where}: {e}")
            continue
        lib.path = path
        _preload_dependencies(lib.cudnnGetCudartVersion() // 1000)
        return lib
    raise CudnnNotFound("cuDNN 9 was not found; tried " + "; ".join(tried) + ". " + INSTALL_HINT)


def available() -> bool:
    try:
        load()
        return True
    except CudnnNotFound:
        return False


def version() -> tuple[int, int, int]:
    return parse_version(load().cudnnGetVersion())


def library_path() -> str:
    return load().path


# Argument types, one letter each: p pointer (descriptor, handle, device or host address),
# i int (enums too), u unsigned, d double, f float, z size_t, q unsigned long long.
_CTYPES = dict(p=c_void_p, i=c_int, u=ctypes.c_uint, d=c_double, f=c_float, z=c_size_t, q=ctypes.c_ulonglong)
_PROTOTYPES = {
    "cudnnCreate": "p", "cudnnDestroy": "p", "cudnnSetStream": "pp", "cudnnGetStream": "pp",
    "cudnnCreateTensorDescriptor": "p", "cudnnDestroyTensorDescriptor": "p",
    "cudnnSetTensor4dDescriptor": "piiiiii", "cudnnSetTensor4dDescriptorEx": "piiiiiiiii",
    "cudnnSetTensorNdDescriptor": "piipp", "cudnnGetTensorSizeInBytes": "pp",
    "cudnnCreateFilterDescriptor": "p", "cudnnDestroyFilterDescriptor": "p",
    "cudnnSetFilter4dDescriptor": "piiiiii", "cudnnSetFilterNdDescriptor": "piiip",
    "cudnnCreateConvolutionDescriptor": "p", "cudnnDestroyConvolutionDescriptor": "p",
    "cudnnSetConvolution2dDescriptor": "piiiiiiii", "cudnnSetConvolutionNdDescriptor": "pipppii",
    "cudnnSetConvolutionGroupCount": "pi", "cudnnSetConvolutionMathType": "pi",
    "cudnnGetConvolution2dForwardOutputDim": "ppppppp", "cudnnGetConvolutionNdForwardOutputDim": "pppip",
    "cudnnGetConvolutionForwardAlgorithmMaxCount": "pp",
    "cudnnGetConvolutionBackwardDataAlgorithmMaxCount": "pp",
    "cudnnGetConvolutionBackwardFilterAlgorithmMaxCount": "pp",
    "cudnnGetConvolutionForwardAlgorithm_v7": "pppppipp",
    "cudnnGetConvolutionBackwardDataAlgorithm_v7": "pppppipp",
    "cudnnGetConvolutionBackwardFilterAlgorithm_v7": "pppppipp",
    "cudnnFindConvolutionForwardAlgorithmEx": "ppppppppipppz",
    "cudnnFindConvolutionBackwardDataAlgorithmEx": "ppppppppipppz",
    "cudnnFindConvolutionBackwardFilterAlgorithmEx": "ppppppppipppz",
    "cudnnGetConvolutionForwardWorkspaceSize": "pppppip",
    "cudnnGetConvolutionBackwardDataWorkspaceSize": "pppppip",
    "cudnnGetConvolutionBackwardFilterWorkspaceSize": "pppppip",
    "cudnnConvolutionForward": "pppppppipzppp",
    "cudnnConvolutionBackwardData": "pppppppipzppp",
    "cudnnConvolutionBackwardFilter": "pppppppipzppp",
    "cudnnConvolutionBackwardBias": "ppppppp",
    "cudnnCreatePoolingDescriptor": "p", "cudnnDestroyPoolingDescriptor": "p",
    "cudnnSetPooling2dDescriptor": "piiiiiiii", "cudnnSetPoolingNdDescriptor": "piiippp",
    "cudnnGetPooling2dForwardOutputDim": "pppppp", "cudnnGetPoolingNdForwardOutputDim": "ppip",
    "cudnnPoolingForward": "pppppppp", "cudnnPoolingBackward": "pppppppppppp",
    "cudnnCreateActivationDescriptor": "p", "cudnnDestroyActivationDescriptor": "p",
    "cudnnSetActivationDescriptor": "piid",
    "cudnnActivationForward": "pppppppp", "cudnnActivationBackward": "pppppppppppp",
    "cudnnSoftmaxForward": "piipppppp", "cudnnSoftmaxBackward": "piipppppppp",
    "cudnnCreateLRNDescriptor": "p", "cudnnDestroyLRNDescriptor": "p", "cudnnSetLRNDescriptor": "puddd",
    "cudnnLRNCrossChannelForward": "ppipppppp", "cudnnLRNCrossChannelBackward": "ppi" + "p" * 10,
    "cudnnDeriveBNTensorDescriptor": "ppi",
    "cudnnBatchNormalizationForwardTraining": "pi" + "p" * 9 + "dppdpp",
    "cudnnBatchNormalizationForwardInference": "pi" + "p" * 11 + "d",
    "cudnnBatchNormalizationBackward": "pi" + "p" * 14 + "dpp",
    "cudnnCreateDropoutDescriptor": "p", "cudnnDestroyDropoutDescriptor": "p",
    "cudnnDropoutGetStatesSize": "pp", "cudnnDropoutGetReserveSpaceSize": "pp",
    "cudnnSetDropoutDescriptor": "ppfpzq", "cudnnRestoreDropoutDescriptor": "ppfpzq",
    "cudnnDropoutForward": "pppppppz", "cudnnDropoutBackward": "pppppppz",
    "cudnnCreateOpTensorDescriptor": "p", "cudnnDestroyOpTensorDescriptor": "p",
    "cudnnSetOpTensorDescriptor": "piii", "cudnnOpTensor": "ppppppppppp",
    "cudnnAddTensor": "ppppppp", "cudnnScaleTensor": "pppp", "cudnnSetTensor": "pppp",
}


@functools.lru_cache(maxsize=None)
def _function(name: str):
    f = getattr(load(), name)
    f.argtypes = [_CTYPES[c] for c in _PROTOTYPES[name]]
    f.restype = c_int
    return f


def error_string(status: int) -> str:
    f = load().cudnnGetErrorString
    f.restype, f.argtypes = ctypes.c_char_p, [c_int]
    return f(status).decode()


def last_error_string() -> str:
    """cuDNN's message about its most recent failure in this thread ('' where unavailable)."""
    lib = load()
    if not hasattr(lib, "cudnnGetLastErrorString"):
        return ""
    buf = ctypes.create_string_buffer(1024)
    lib.cudnnGetLastErrorString.restype = None
    lib.cudnnGetLastErrorString(buf, c_size_t(len(buf)))
    return buf.value.decode(errors="replace").strip()


def call(name: str, *args) -> None:
    """Call a cuDNN function by name; a failed status raises CudnnError with cuDNN's message."""
    status = _function(name)(*args)
    if status:
        raise status_error(status, name, last_error_string(), STATUS.get(status) or error_string(status))


# -- types and helpers ------------------------------------------------------------------

_DATA_TYPES = {"float32": 0, "float64": 1, "float16": 2, "int8": 3, "int32": 4, "uint8": 6,
               "bfloat16": 9, "int64": 10}


def data_type(dtype) -> int:
    name = np.dtype(dtype).name
    if name not in _DATA_TYPES:
        raise TypeError(f"cuDNN has no data type for {name}")
    return _DATA_TYPES[name]


def compute_type(dtype) -> int:
    """Accumulation type: double for float64, float for everything narrower."""
    return 1 if np.dtype(dtype) == np.float64 else 0


def _scalar(dtype, value):
    """A pointer to alpha or beta in the type cuDNN reads for this data type."""
    return byref(c_double(value) if np.dtype(dtype) == np.float64 else c_float(value))


def _ptr(a):
    """A device address: None (NULL), an int, or an array with .data.ptr (CuPy)."""
    if a is None:
        return None
    data = getattr(a, "data", None)
    return int(data.ptr) if hasattr(data, "ptr") else int(a)


def _ints(values):
    return (c_int * len(values))(*values)


def _pair(v, n=2):
    return tuple(v) if isinstance(v, (tuple, list)) else (v,) * n


def _padded_shape(shape):
    shape = tuple(int(s) for s in shape)
    return shape + (1,) * (4 - len(shape)) if len(shape) < 4 else shape


class _Descriptor:
    """A cuDNN object made by cudnnCreateX and released by cudnnDestroyX."""
    kind = None
    ptr = None

    def __init__(self):
        h = c_void_p()
        call(f"cudnnCreate{self.kind}", byref(h))
        self.ptr = h.value

    @property
    def _as_parameter_(self):              # lets ctypes take the object where a pointer is expected
        return c_void_p(self.ptr)

    def close(self):
        if self.ptr:
            call(f"cudnnDestroy{self.kind}", self.ptr)
            self.ptr = None

    def __del__(self):
        try:
            self.close()
        except Exception:                 # interpreter shutdown: the library may be gone
            pass


class Handle(_Descriptor):
    """A cuDNN handle bound to a CUDA stream (an int or an object with .ptr; 0 is the legacy stream).

    Creating one needs a GPU and makes the handle belong to the current CUDA device.
    """
    kind = ""

    def __init__(self, stream=0):
        super().__init__()
        self.set_stream(stream)

    def set_stream(self, stream) -> None:
        self.stream = int(getattr(stream, "ptr", stream) or 0)
        call("cudnnSetStream", self, self.stream)

    def get_stream(self) -> int:
        s = c_void_p()
        call("cudnnGetStream", self, byref(s))
        return s.value or 0


class TensorDesc(_Descriptor):
    """A dense tensor (NCHW, C order), or given strides in elements; fewer than 4 axes padded to 4."""
    kind = "TensorDescriptor"

    def __init__(self, shape, dtype=np.float32, strides=None):
        super().__init__()
        self.shape, self.dtype = _padded_shape(shape), np.dtype(dtype)
        dt = data_type(self.dtype)
        if strides is not None:
            strides = tuple(strides) + (1,) * (len(self.shape) - len(strides))
        if len(self.shape) == 4 and strides is None:
            call("cudnnSetTensor4dDescriptor", self, 0, dt, *self.shape)
        elif len(self.shape) == 4:
            call("cudnnSetTensor4dDescriptorEx", self, dt, *self.shape, *strides)
        else:
            strides = strides or tuple(int(np.prod(self.shape[i + 1:])) for i in range(len(self.shape)))
            call("cudnnSetTensorNdDescriptor", self, dt, len(self.shape), _ints(self.shape), _ints(strides))

    def size_in_bytes(self) -> int:
        n = c_size_t()
        call("cudnnGetTensorSizeInBytes", self, byref(n))
        return n.value


@functools.lru_cache(maxsize=4096)
def tensor(shape, dtype=np.float32) -> TensorDesc:
    """A cached dense TensorDesc (shape a tuple): cheap to ask for in every forward/backward."""
    return TensorDesc(tuple(shape), dtype)


class FilterDesc(_Descriptor):
    """Convolution weights (out, in / groups, kh, kw), Caffe's layout."""
    kind = "FilterDescriptor"

    def __init__(self, shape, dtype=np.float32):
        super().__init__()
        self.shape, self.dtype = tuple(int(s) for s in shape), np.dtype(dtype)
        if len(self.shape) == 4:
            call("cudnnSetFilter4dDescriptor", self, data_type(self.dtype), 0, *self.shape)
        else:
            call("cudnnSetFilterNdDescriptor", self, data_type(self.dtype), 0, len(self.shape), _ints(self.shape))


MATH_TYPES = {"default": 0, "tensor_op": 1, "tensor_op_allow_conversion": 2, "fma": 3}


class ConvDesc(_Descriptor):
    """Caffe's convolution: cross-correlation with pad, stride, dilation per spatial axis, and groups.

    math="fma" (the default) keeps fp32 exact, as on the CPU; "default" lets
    cuDNN use TF32 tensor cores on Ampere and later (PyTorch's default for
    convolutions: faster, ~1e-3 relative error), "tensor_op" also for fp16.
    """
    kind = "ConvolutionDescriptor"

    def __init__(self, pad, stride, dilation=1, groups=1, dtype=np.float32, math="fma", ndim=2):
        super().__init__()
        self.pad, self.stride, self.dilation = _pair(pad, ndim), _pair(stride, ndim), _pair(dilation, ndim)
        self.groups, self.dtype, self.math = groups, np.dtype(dtype), math
        cross_correlation = 1
        if len(self.pad) == 2:
            call("cudnnSetConvolution2dDescriptor", self, *self.pad, *self.stride, *self.dilation,
                 cross_correlation, compute_type(self.dtype))
        else:
            call("cudnnSetConvolutionNdDescriptor", self, len(self.pad), _ints(self.pad), _ints(self.stride),
                 _ints(self.dilation), cross_correlation, compute_type(self.dtype))
        if groups != 1:
            call("cudnnSetConvolutionGroupCount", self, groups)
        call("cudnnSetConvolutionMathType", self, MATH_TYPES[math])


def conv_output_shape(conv: ConvDesc, x: TensorDesc, w: FilterDesc) -> tuple:
    """The top shape cuDNN computes: (n, c, h, w) = Caffe's (floor) convolution output."""
    out = _ints([0] * len(x.shape))
    call("cudnnGetConvolutionNdForwardOutputDim", conv, x, w, len(x.shape), out)
    return tuple(out)


# -- convolution ----------------------------------------------------------------------

class AlgoPerf(ctypes.Structure):
    """cudnnConvolution{Fwd,BwdData,BwdFilter}AlgoPerf_t (the three share one layout)."""
    _fields_ = [("algo", c_int), ("status", c_int), ("time", c_float), ("memory", c_size_t),
                ("determinism", c_int), ("mathType", c_int), ("reserved", c_int * 3)]


Algorithm = namedtuple("Algorithm", "algo name status time memory deterministic math")
Algorithm.__doc__ = ("One algorithm's result: time in ms (-1 from a heuristic query), memory = workspace "
                     "bytes it needs, status 0 where it can run this problem.")

FWD_ALGOS = ("IMPLICIT_GEMM", "IMPLICIT_PRECOMP_GEMM", "GEMM", "DIRECT", "FFT", "FFT_TILING",
             "WINOGRAD", "WINOGRAD_NONFUSED")
BWD_DATA_ALGOS = ("ALGO_0", "ALGO_1", "FFT", "FFT_TILING", "WINOGRAD", "WINOGRAD_NONFUSED")
BWD_FILTER_ALGOS = ("ALGO_0", "ALGO_1", "FFT", "ALGO_3", "WINOGRAD", "WINOGRAD_NONFUSED", "FFT_TILING")
_MATH_NAMES = {v: k for k, v in MATH_TYPES.items()}
# direction -> (cuDNN's name in its functions, algorithm names)
_DIRECTIONS = {"forward": ("Forward", FWD_ALGOS), "backward_data": ("BackwardData", BWD_DATA_ALGOS),
               "backward_filter": ("BackwardFilter", BWD_FILTER_ALGOS)}


def _algorithms(direction, find, handle, args, workspace=None, workspace_size=0):
    word, names = _DIRECTIONS[direction]
    count = c_int()
    call(f"cudnnGetConvolution{word}AlgorithmMaxCount", handle, byref(count))
    perfs, returned = (AlgoPerf * count.value)(), c_int()
    if find:
        call(f"cudnnFindConvolution{word}AlgorithmEx", handle, *args, count.value, byref(returned), perfs,
             _ptr(workspace), workspace_size)
    else:
        call(f"cudnnGetConvolution{word}Algorithm_v7", handle, *args, count.value, byref(returned), perfs)
    return [Algorithm(p.algo, names[p.algo] if p.algo < len(names) else str(p.algo), p.status,
                      float(p.time), int(p.memory), bool(p.determinism), _MATH_NAMES.get(p.mathType, p.mathType))
            for p in perfs[:returned.value]]


def find_forward_algorithms(handle, x_desc, x, w_desc, w, conv, y_desc, y, workspace=None, workspace_size=0):
    """Every forward algorithm, timed on these buffers (cudnnFindConvolutionForwardAlgorithmEx), fastest first.

    Runs the convolutions: ``y`` is overwritten. Algorithms needing more than
    ``workspace_size`` bytes are reported with a failed status.
    """
    return _algorithms("forward", True, handle, (x_desc, _ptr(x), w_desc, _ptr(w), conv, y_desc, _ptr(y)),
                       workspace, workspace_size)


def find_backward_data_algorithms(handle, w_desc, w, dy_desc, dy, conv, dx_desc, dx, workspace=None,
                                  workspace_size=0):
    """As find_forward_algorithms, for the bottom gradient; ``dx`` is overwritten."""
    return _algorithms("backward_data", True, handle,
                       (w_desc, _ptr(w), dy_desc, _ptr(dy), conv, dx_desc, _ptr(dx)), workspace, workspace_size)


def find_backward_filter_algorithms(handle, x_desc, x, dy_desc, dy, conv, dw_desc, dw, workspace=None,
                                    workspace_size=0):
    """As find_forward_algorithms, for the weight gradient; ``dw`` is overwritten, so pass a scratch
    buffer, never the weight diff that Caffe accumulates into."""
    return _algorithms("backward_filter", True, handle,
                       (x_desc, _ptr(x), dy_desc, _ptr(dy), conv, dw_desc, _ptr(dw)), workspace, workspace_size)


def get_forward_algorithms(handle, x_desc, w_desc, conv, y_desc):
    """Every forward algorithm ranked by cuDNN's heuristics (_v7): no buffers, nothing runs, time -1."""
    return _algorithms("forward", False, handle, (x_desc, w_desc, conv, y_desc))


def get_backward_data_algorithms(handle, w_desc, dy_desc, conv, dx_desc):
    return _algorithms("backward_data", False, handle, (w_desc, dy_desc, conv, dx_desc))


def get_backward_filter_algorithms(handle, x_desc, dy_desc, conv, dw_desc):
    return _algorithms("backward_filter", False, handle, (x_desc, dy_desc, conv, dw_desc))


def fastest(algorithms, workspace_limit=None):
    """The fastest algorithm that runs and whose workspace fits ``workspace_limit`` bytes (None: any)."""
    ok = [a for a in algorithms if a.status == 0 and (workspace_limit is None or a.memory <= workspace_limit)]
    if not ok:
        raise CudnnNotSupported(3000, "fastest", f"no algorithm runs within {workspace_limit} bytes of workspace")
    return min(ok, key=lambda a: a.time) if all(a.time >= 0 for a in ok) else ok[0]


def _workspace_size(word, handle, args, algo) -> int:
    n = c_size_t()
    call(f"cudnnGetConvolution{word}WorkspaceSize", handle, *args, int(algo), byref(n))
    return n.value


def forward_workspace_size(handle, x_desc, w_desc, conv, y_desc, algo) -> int:
    return _workspace_size("Forward", handle, (x_desc, w_desc, conv, y_desc), algo)


def backward_data_workspace_size(handle, w_desc, dy_desc, conv, dx_desc, algo) -> int:
    return _workspace_size("BackwardData", handle, (w_desc, dy_desc, conv, dx_desc), algo)


def backward_filter_workspace_size(handle, x_desc, dy_desc, conv, dw_desc, algo) -> int:
    return _workspace_size("BackwardFilter", handle, (x_desc, dy_desc, conv, dw_desc), algo)


def convolution_forward(handle, x_desc, x, w_desc, w, conv, algo, workspace, workspace_size, y_desc, y,
                        alpha=1.0, beta=0.0):
    """y = alpha * conv(x, w) + beta * y. The bias is a separate add_tensor (Caffe's bias_term)."""
    call("cudnnConvolutionForward", handle, _scalar(x_desc.dtype, alpha), x_desc, _ptr(x), w_desc, _ptr(w),
         conv, int(algo), _ptr(workspace), workspace_size, _scalar(x_desc.dtype, beta), y_desc, _ptr(y))


def convolution_backward_data(handle, w_desc, w, dy_desc, dy, conv, algo, workspace, workspace_size,
                              dx_desc, dx, alpha=1.0, beta=0.0):
    """dx = alpha * conv_transpose(dy, w) + beta * dx (beta 0: Caffe overwrites bottom diffs)."""
    call("cudnnConvolutionBackwardData", handle, _scalar(dy_desc.dtype, alpha), w_desc, _ptr(w), dy_desc,
         _ptr(dy), conv, int(algo), _ptr(workspace), workspace_size, _scalar(dy_desc.dtype, beta), dx_desc, _ptr(dx))


def convolution_backward_filter(handle, x_desc, x, dy_desc, dy, conv, algo, workspace, workspace_size,
                                dw_desc, dw, alpha=1.0, beta=1.0):
    """dw = alpha * dconv/dw + beta * dw (beta 1: Caffe accumulates param diffs)."""
    call("cudnnConvolutionBackwardFilter", handle, _scalar(x_desc.dtype, alpha), x_desc, _ptr(x), dy_desc,
         _ptr(dy), conv, int(algo), _ptr(workspace), workspace_size, _scalar(x_desc.dtype, beta), dw_desc, _ptr(dw))


def convolution_backward_bias(handle, dy_desc, dy, db_desc, db, alpha=1.0, beta=1.0):
    """db (1, C, 1, 1) = alpha * sum of dy over N, H, W + beta * db (beta 1: accumulate)."""
    call("cudnnConvolutionBackwardBias", handle, _scalar(dy_desc.dtype, alpha), dy_desc, _ptr(dy),
         _scalar(dy_desc.dtype, beta), db_desc, _ptr(db))


# -- pooling --------------------------------------------------------------------------

POOLING_MODES = {"max": 0, "ave": 1, "ave_exclude_padding": 2, "max_deterministic": 3}


class PoolingDesc(_Descriptor):
    """2-d pooling: "max", "ave" (divisor counts padding, as Caffe), "ave_exclude_padding",
    "max_deterministic". cuDNN's output size rounds down: see caffe_pool_geometry."""
    kind = "PoolingDescriptor"

    def __init__(self, mode, kernel, pad=0, stride=1):
        super().__init__()
        self.mode, self.kernel, self.pad, self.stride = mode, _pair(kernel), _pair(pad), _pair(stride)
        propagate_nan = 1
        call("cudnnSetPooling2dDescriptor", self, POOLING_MODES[mode], propagate_nan,
             *self.kernel, *self.pad, *self.stride)


def pooling_output_shape(pool: PoolingDesc, x: TensorDesc) -> tuple:
    out = [c_int() for _ in range(4)]
    call("cudnnGetPooling2dForwardOutputDim", pool, x, *[byref(o) for o in out])
    return tuple(o.value for o in out)


@dataclass(frozen=True)
class PoolGeometry:
    """Caffe's pooling along one spatial axis, restated for cuDNN.

    out      Caffe's output size: ceil((size + 2 pad - kernel) / stride) + 1, less one
             where the last window would start in the padding.
    pad_end  the padding after the end that makes cuDNN's floor formula give ``out``
             (``pad`` stays before the start); ``pad_end - pad`` extra cells.
    scale    per output index, kernel / Caffe's AVE divisor: Caffe clips the last
             window at size + pad, so its divisor shrinks there (1.0 elsewhere).
    """
    out: int
    pad: int
    pad_end: int
    scale: tuple

    @property
    def extra(self) -> int:
        return self.pad_end - self.pad


def caffe_pooled_size(size: int, kernel: int, pad: int, stride: int, padded=None) -> int:
    """Caffe's PoolingLayer::Reshape output size (rounds up). ``padded``: whether the layer
    has any padding (on either axis; default pad != 0), which drops a last window
    starting in the padding."""
    out = -(-(size + 2 * pad - kernel) // stride) + 1
    if (pad if padded is None else padded) and (out - 1) * stride >= size + pad:
        out -= 1
    return out


def caffe_pool_geometry(size: int, kernel: int, pad: int, stride: int, padded=None) -> PoolGeometry:
    """How to get Caffe's pooling from cuDNN along one axis.

    cuDNN's legacy pooling pads symmetrically and rounds the output down, so
    where ``extra > 0`` the layer gives cuDNN an input with ``extra`` more rows
    (columns) after the end: a padded copy of the bottom, filled with -FLT_MAX
    for MAX (Caffe's max never takes padding) or 0 for AVE, pooled with the
    symmetric ``pad``; backward slices the padded bottom diff back. For AVE,
    multiply the top (and the top diff before backward) by ``outer(scale_h,
    scale_w)`` (mode "ave", which divides by kernel_h * kernel_w) to get Caffe's
    divisor on the clipped last window. Where ``extra == 0`` and every scale
    is 1, cuDNN with ``pad`` is Caffe exactly. (A window wholly past the input,
    possible in Caffe without padding and with stride > kernel, gives -FLT_MAX
    for MAX and 0 for AVE here, as in Caffe up to its 0/0.)
    MAX ties: cuDNN's backward finds the argmax again; Caffe keeps the first.
    """
    out = caffe_pooled_size(size, kernel, pad, stride, padded)
    pad_end = max(pad, (out - 1) * stride + kernel - size - pad)
    divisors = [min(j * stride - pad + kernel, size + pad) - (j * stride - pad) for j in range(out)]
    return PoolGeometry(out, pad, pad_end, tuple(kernel / d if d > 0 else 0.0 for d in divisors))


def pooling_forward(handle, pool, x_desc, x, y_desc, y, alpha=1.0, beta=0.0):
    call("cudnnPoolingForward", handle, pool, _scalar(x_desc.dtype, alpha), x_desc, _ptr(x),
         _scalar(x_desc.dtype, beta), y_desc, _ptr(y))


def pooling_backward(handle, pool, y_desc, y, dy_desc, dy, x_desc, x, dx_desc, dx, alpha=1.0, beta=0.0):
    """Needs the forward's x and y (MAX finds its argmax again from them)."""
    call("cudnnPoolingBackward", handle, pool, _scalar(x_desc.dtype, alpha), y_desc, _ptr(y), dy_desc, _ptr(dy),
         x_desc, _ptr(x), _scalar(x_desc.dtype, beta), dx_desc, _ptr(dx))


# -- activation, softmax, LRN ----------------------------------------------------------------

ACTIVATIONS = {"sigmoid": 0, "relu": 1, "tanh": 2, "clipped_relu": 3, "elu": 4, "identity": 5}


class ActivationDesc(_Descriptor):
    """coef: the ceiling for clipped_relu, alpha for elu. Caffe's ReLU with a negative_slope
    has no cuDNN mode (a custom kernel does it). NaN propagates, as in NumPy."""
    kind = "ActivationDescriptor"

    def __init__(self, mode, coef=0.0):
        super().__init__()
        self.mode, self.coef = mode, coef
        call("cudnnSetActivationDescriptor", self, ACTIVATIONS[mode], 1, float(coef))


def activation_forward(handle, act, x_desc, x, y_desc, y, alpha=1.0, beta=0.0):
    call("cudnnActivationForward", handle, act, _scalar(x_desc.dtype, alpha), x_desc, _ptr(x),
         _scalar(x_desc.dtype, beta), y_desc, _ptr(y))


def activation_backward(handle, act, y_desc, y, dy_desc, dy, x_desc, x, dx_desc, dx, alpha=1.0, beta=0.0):
    """sigmoid and tanh read only y; relu, clipped_relu and elu may read x (in place, pass the x kept
    in scratch, or y for relu, whose sign pattern y shares)."""
    call("cudnnActivationBackward", handle, act, _scalar(y_desc.dtype, alpha), y_desc, _ptr(y), dy_desc,
         _ptr(dy), x_desc, _ptr(x), _scalar(y_desc.dtype, beta), dx_desc, _ptr(dx))


SOFTMAX_ALGOS = {"fast": 0, "accurate": 1, "log": 2}
SOFTMAX_MODES = {"instance": 0, "channel": 1}


def softmax_forward(handle, x_desc, x, y_desc, y, algo="accurate", mode="channel", alpha=1.0, beta=0.0):
    """Softmax over axis 1 of (N, C, H, W) at every (n, h, w) in "channel" mode: for Caffe's axis
    a, describe the blob as (outer, C, inner, 1). "accurate" subtracts the max, as Caffe does."""
    call("cudnnSoftmaxForward", handle, SOFTMAX_ALGOS[algo], SOFTMAX_MODES[mode], _scalar(x_desc.dtype, alpha),
         x_desc, _ptr(x), _scalar(x_desc.dtype, beta), y_desc, _ptr(y))


def softmax_backward(handle, y_desc, y, dy_desc, dy, dx_desc, dx, algo="accurate", mode="channel",
                     alpha=1.0, beta=0.0):
    call("cudnnSoftmaxBackward", handle, SOFTMAX_ALGOS[algo], SOFTMAX_MODES[mode], _scalar(y_desc.dtype, alpha),
         y_desc, _ptr(y), dy_desc, _ptr(dy), _scalar(y_desc.dtype, beta), dx_desc, _ptr(dx))


class LRNDesc(_Descriptor):
    """Cross-channel LRN as Caffe's ACROSS_CHANNELS: y = x / (k + alpha/n * sum of x^2 over n channels)^beta.
    cuDNN needs 1 <= n <= 16, k >= 1e-5, beta >= 0.01; Caffe's WITHIN_CHANNEL is not this."""
    kind = "LRNDescriptor"

    def __init__(self, n, alpha, beta, k):
        super().__init__()
        self.n, self.alpha, self.beta, self.k = n, alpha, beta, k
        call("cudnnSetLRNDescriptor", self, n, float(alpha), float(beta), float(k))


def lrn_forward(handle, lrn, x_desc, x, y_desc, y, alpha=1.0, beta=0.0):
    call("cudnnLRNCrossChannelForward", handle, lrn, 0, _scalar(x_desc.dtype, alpha), x_desc, _ptr(x),
         _scalar(x_desc.dtype, beta), y_desc, _ptr(y))


def lrn_backward(handle, lrn, y_desc, y, dy_desc, dy, x_desc, x, dx_desc, dx, alpha=1.0, beta=0.0):
    call("cudnnLRNCrossChannelBackward", handle, lrn, 0, _scalar(x_desc.dtype, alpha), y_desc, _ptr(y),
         dy_desc, _ptr(dy), x_desc, _ptr(x), _scalar(x_desc.dtype, beta), dx_desc, _ptr(dx))


# -- batch normalization --------------------------------------------------------------------

BN_MODES = {"per_activation": 0, "spatial": 1, "spatial_persistent": 2}


def bn_param_desc(x_desc: TensorDesc, mode="spatial") -> TensorDesc:
    """The (1, C, 1, 1) descriptor of scale, bias, mean and variance for x (cudnnDeriveBNTensorDescriptor)."""
    desc = TensorDesc((1, x_desc.shape[1]) + (1,) * (len(x_desc.shape) - 2), x_desc.dtype)
    call("cudnnDeriveBNTensorDescriptor", desc, x_desc, BN_MODES[mode])
    return desc


def batch_norm_forward_training(handle, x_desc, x, y_desc, y, param_desc, scale, bias, factor,
                                running_mean, running_var, eps, save_mean, save_inv_std,
                                mode="spatial", alpha=1.0, beta=0.0):
    """y = scale * (x - mean) / sqrt(var + eps) + bias over the batch (var biased, as Caffe normalizes).

    running_* = (1 - factor) * running_* + factor * batch statistic, where the
    running variance is unbiased (m / (m - 1)); either may be None. save_mean and
    save_inv_std (C each, or None) keep 1 / sqrt(var + eps) for backward.

    Caffe's BatchNorm has no scale/bias (pass ones and zeros) and keeps
    different statistics: blobs mean += ..., variance, and a scale factor s with
    s = maf * s + 1, mean_blob = maf * mean_blob + batch mean, var_blob =
    maf * var_blob + unbiased batch var; inference uses blob / s (s == 0: 0).
    So the layer passes factor=1.0 with two C-sized scratch buffers as
    running_mean / running_var (they receive the batch mean and the unbiased
    batch variance), then updates its blobs with that arithmetic.
    """
    d = x_desc.dtype
    call("cudnnBatchNormalizationForwardTraining", handle, BN_MODES[mode], _scalar(d, alpha), _scalar(d, beta),
         x_desc, _ptr(x), y_desc, _ptr(y), param_desc, _ptr(scale), _ptr(bias), float(factor),
         _ptr(running_mean), _ptr(running_var), float(eps), _ptr(save_mean), _ptr(save_inv_std))


def batch_norm_forward_inference(handle, x_desc, x, y_desc, y, param_desc, scale, bias, mean, var, eps,
                                 mode="spatial", alpha=1.0, beta=0.0):
    """y = scale * (x - mean) / sqrt(var + eps) + bias with given statistics (Caffe's
    use_global_stats: mean = blob0 / s, var = blob1 / s, computed by the layer first)."""
    d = x_desc.dtype
    call("cudnnBatchNormalizationForwardInference", handle, BN_MODES[mode], _scalar(d, alpha), _scalar(d, beta),
         x_desc, _ptr(x), y_desc, _ptr(y), param_desc, _ptr(scale), _ptr(bias), _ptr(mean), _ptr(var), float(eps))


def batch_norm_backward(handle, x_desc, x, dy_desc, dy, dx_desc, dx, param_desc, scale, dscale, dbias, eps,
                        save_mean=None, save_inv_std=None, mode="spatial",
                        alpha_data=1.0, beta_data=0.0, alpha_param=1.0, beta_param=0.0):
    """The gradient through batch statistics: dx, and dscale, dbias (always written; C-sized
    scratch where the layer has no such params, as Caffe's BatchNorm). save_* from the
    forward, or None to recompute. With use_global_stats the statistics are constants
    and Caffe's dx is dy / sqrt(var + eps): not this call."""
    d = x_desc.dtype
    call("cudnnBatchNormalizationBackward", handle, BN_MODES[mode], _scalar(d, alpha_data), _scalar(d, beta_data),
         _scalar(d, alpha_param), _scalar(d, beta_param), x_desc, _ptr(x), dy_desc, _ptr(dy), dx_desc, _ptr(dx),
         param_desc, _ptr(scale), _ptr(dscale), _ptr(dbias), float(eps), _ptr(save_mean), _ptr(save_inv_std))


# -- dropout ----------------------------------------------------------------------------

def dropout_states_size(handle) -> int:
    """Bytes of the RNG state a DropoutDesc needs (allocate once, from the pool, keep)."""
    n = c_size_t()
    call("cudnnDropoutGetStatesSize", handle, byref(n))
    return n.value


def dropout_reserve_size(x_desc) -> int:
    """Bytes of the mask kept from forward to backward (a scratch tensor of the layer)."""
    n = c_size_t()
    call("cudnnDropoutGetReserveSpaceSize", x_desc, byref(n))
    return n.value


class DropoutDesc(_Descriptor):
    """Drop with probability ``ratio``, scale kept values by 1 / (1 - ratio), as Caffe's TRAIN phase.

    Setting it initializes ``states`` on the GPU (slow: do it once);
    restore=True reattaches states already initialized. The random stream is
    cuDNN's, so masks differ from the CPU device's.
    """
    kind = "DropoutDescriptor"

    def __init__(self, handle, ratio, states, states_size, seed=0, restore=False):
        super().__init__()
        self.ratio = ratio
        call("cudnnRestoreDropoutDescriptor" if restore else "cudnnSetDropoutDescriptor", self, handle,
             float(ratio), _ptr(states), states_size, seed)


def dropout_forward(handle, dropout, x_desc, x, y_desc, y, reserve, reserve_size):
    call("cudnnDropoutForward", handle, dropout, x_desc, _ptr(x), y_desc, _ptr(y), _ptr(reserve), reserve_size)


def dropout_backward(handle, dropout, dy_desc, dy, dx_desc, dx, reserve, reserve_size):
    call("cudnnDropoutBackward", handle, dropout, dy_desc, _ptr(dy), dx_desc, _ptr(dx), _ptr(reserve),
         reserve_size)


# -- tensor arithmetic ---------------------------------------------------------------------

OP_TENSOR = {"add": 0, "mul": 1, "min": 2, "max": 3, "sqrt": 4, "not": 5}


class OpTensorDesc(_Descriptor):
    kind = "OpTensorDescriptor"

    def __init__(self, op, dtype=np.float32):
        super().__init__()
        self.op, self.dtype = op, np.dtype(dtype)
        call("cudnnSetOpTensorDescriptor", self, OP_TENSOR[op], compute_type(dtype), 1)


def op_tensor(handle, op, a_desc, a, b_desc, b, c_desc, c, alpha1=1.0, alpha2=1.0, beta=0.0):
    """c = op(alpha1 * a, alpha2 * b) + beta * c; b may broadcast (axes of size 1)."""
    d = c_desc.dtype
    call("cudnnOpTensor", handle, op, _scalar(d, alpha1), a_desc, _ptr(a), _scalar(d, alpha2), b_desc, _ptr(b),
         _scalar(d, beta), c_desc, _ptr(c))


def add_tensor(handle, a_desc, a, c_desc, c, alpha=1.0, beta=1.0):
    """c = alpha * a + beta * c, a broadcast over c (a bias of shape (1, C, 1, 1))."""
    call("cudnnAddTensor", handle, _scalar(c_desc.dtype, alpha), a_desc, _ptr(a), _scalar(c_desc.dtype, beta),
         c_desc, _ptr(c))


def scale_tensor(handle, y_desc, y, alpha):
    """y *= alpha."""
    call("cudnnScaleTensor", handle, y_desc, _ptr(y), _scalar(y_desc.dtype, alpha))


def set_tensor(handle, y_desc, y, value):
    """y[...] = value."""
    call("cudnnSetTensor", handle, y_desc, _ptr(y), _scalar(y_desc.dtype, value))
