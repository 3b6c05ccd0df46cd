"""The CUDA C kernel cache and launcher; each layer family's kernels live beside its CPU code.

A family's GPU module (``sncaffe/layers/*_gpu.py``) registers its CUDA C with
``register(family, code)`` and launches with ``launch(family, name, n, *args,
dtype=...)``: the source is the shared ``PRELUDE`` (types ``T``/``I``, math
overloads, the grid-stride loop) plus the family's code, compiled once per
(family, dtype, index type) by NVRTC (CuPy's RawModule) and cached. Nothing
here imports CuPy at module load, so the sources can be listed, compiled by
the tests' NVRTC check or emulated under g++ without a GPU.

Compiled with ``OPTIONS``: IEEE denormals, divisions and square roots, as on
the CPU (NVRTC's defaults too; said explicitly so no CuPy default changes them).
"""
from __future__ import annotations

import functools

import numpy as np

BLOCK = 256                     # threads per block (a power of 2, at most 256)
MAX_BLOCKS = 8192               # grid-stride loops cover the rest
OPTIONS = ("-ftz=false", "-prec-div=true", "-prec-sqrt=true")

PRELUDE = r"""
typedef %(T)s T;
typedef %(I)s I;
#define SN_FLT_MAX 3.402823466e+38f
#define SN_FLT_MIN 1.175494351e-38f
#define SN_SUM_THREADS 256
#define GRID_LOOP(i, n) \
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < (n); \
       i += (long long)blockDim.x * gridDim.x)
__device__ __forceinline__ float sn_exp(float x) { return expf(x); }
__device__ __forceinline__ double sn_exp(double x) { return exp(x); }
__device__ __forceinline__ float sn_log(float x) { return logf(x); }
__device__ __forceinline__ double sn_log(double x) { return log(x); }
__device__ __forceinline__ float sn_tanh(float x) { return tanhf(x); }
__device__ __forceinline__ double sn_tanh(double x) { return tanh(x); }
__device__ __forceinline__ float sn_pow(float x, float y) { return powf(x, y); }
__device__ __forceinline__ double sn_pow(double x, double y) { return pow(x, y); }
__device__ __forceinline__ float sn_sqrt(float x) { return sqrtf(x); }
__device__ __forceinline__ double sn_sqrt(double x) { return sqrt(x); }
__device__ __forceinline__ float sn_abs(float x) { return fabsf(x); }
__device__ __forceinline__ double sn_abs(double x) { return fabs(x); }
__device__ __forceinline__ int sn_min(int a, int b) { return a < b ? a : b; }
__device__ __forceinline__ int sn_max(int a, int b) { return a > b ? a : b; }
"""

SOURCES: dict = {}              # family -> CUDA C (without the prelude)
INDEX_TYPES: dict = {}          # family -> the index types it is compiled for (pooling's argmax)
_CTYPES = {"float32": "float", "float64": "double", "uint8": "unsigned char", "int32": "int"}
i32, i64, f64 = np.int32, np.int64, np.float64


def register(family: str, code: str, index_types=(np.uint8,)) -> str:
    """Make ``code`` the kernels of ``family`` (a layer family's GPU module calls this at import)."""
    SOURCES[family] = code
    INDEX_TYPES[family] = tuple(np.dtype(t) for t in index_types)
    return code


def source(family: str, dtype, index=np.uint8) -> str:
    """The full CUDA C of one family for these types (T: data, I: pooling's argmax)."""
    return PRELUDE % {"T": _CTYPES[np.dtype(dtype).name], "I": _CTYPES[np.dtype(index).name]} + SOURCES[family]


def _cupy():
    from .cuda import import_cupy
    return import_cupy()


@functools.lru_cache(maxsize=None)
def _module(family: str, dtype: str, index: str):
    return _cupy().RawModule(code=source(family, dtype, index), options=OPTIONS)


_kernels: dict = {}


def launch(family, name, n, *args, dtype, index=np.uint8, grid=None, block=None):
    """Launch kernel ``name`` of ``family`` with ``args`` (arrays and NumPy scalars) on CuPy's
    current stream, covering ``n`` threads in a grid-stride loop unless ``grid`` is given."""
    key = (family, name, np.dtype(dtype).name, np.dtype(index).name)
    kernel = _kernels.get(key)
    if kernel is None:
        kernel = _kernels[key] = _module(family, key[2], key[3]).get_function(name)
    grid = grid or (max(1, min(-(-int(n) // BLOCK), MAX_BLOCKS)),)
    kernel(tuple(grid), (block or BLOCK,), args)


def contiguous(*arrays):
    """The kernels index flat memory: refuse a strided view rather than read the wrong elements."""
    for a in arrays:
        if a is not None and not a.flags.c_contiguous:
            raise ValueError(f"GPU kernels need C-contiguous arrays, got strides {a.strides}")
