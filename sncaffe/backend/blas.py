"""GEMM with BLAS's beta on the CPU: Intel MKL where the ``mkl`` extra is installed, else the
OpenBLAS that NumPy ships, both reached through ctypes.

The CPU convolution (``layers/im2col.py``) is a sum of thin GEMMs (K = input channels, M =
output channels, 16 to 64 in a CIFAR ResNet). OpenBLAS runs those at 56-102 GFLOP/s on one
AVX-512 core, MKL at 86-139 (``tools/bench_blas.py``); MKL is what PyTorch's CPU build uses
for its GEMMs too. ``SNCAFFE_BLAS`` chooses: ``mkl``, ``openblas`` or ``numpy`` (``matmul``,
no beta: one more pass per accumulating GEMM); unset, MKL where installed.

Threads: ``backend.threads`` decides the budget (``--threads``, ``MKL_NUM_THREADS`` or
``OPENBLAS_NUM_THREADS``, else the free cores) and each GEMM here runs on as many threads as
its size pays for; a budget of one runs MKL's sequential layer (no OpenMP runtime).
"""
from __future__ import annotations

import ctypes
import glob
import os
from dataclasses import dataclass, field

import numpy as np

from .. import config
from . import threads as _threads

_ROW_MAJOR, _NO_TRANS, _TRANS = 101, 111, 112
_MKL_THREADING_INTEL, _MKL_THREADING_SEQUENTIAL, _MKL_THREADING_GNU = 0, 1, 3


def _gnu_openmp_loaded() -> bool:
    """Whether GNU's OpenMP runtime (libgomp, e.g. PyTorch's) is already in this process. MKL's
    Intel layer would then run its threads on Intel's runtime while OpenMP calls resolve to GNU's,
    and its multithreaded GEMMs compute wrong results (measured: LeNet's loss 10.2 for 2.66 with
    torch imported first); MKL's GNU layer shares libgomp instead."""
    try:
        with open("/proc/self/maps") as f:
            return any("libgomp" in line for line in f)
    except OSError:
        return False
CHOICES = ("mkl", "openblas", "numpy")


@dataclass
class Blas:
    """One loaded BLAS: its name, threads and cblas ?gemm per dtype (empty for ``numpy``)."""
    name: str
    threads: int | None = None
    gemm: dict = field(default_factory=dict)
    setter: object = None           # the library's set-threads function, or None
    active: int | None = None       # threads it was last set to
    sequential: bool = False        # MKL's sequential layer: one thread for good

    def set_threads(self, n):
        """Run the next GEMMs on ``n`` threads (where the library can be told)."""
        if self.setter is not None and n != self.active:
            self.setter(ctypes.c_int(n))
            self.active = n

    def describe(self) -> str:
        threads = f", {self.threads} thread{'s' * (self.threads != 1)}" if self.threads else ""
        return f"{self.name}{threads}"


def _bind_gemm(lib, prefix, suffix, int_t):
    """{dtype: cblas ?gemm} of ``lib`` under these symbol names, or None."""
    try:
        fns = [getattr(lib, f"{prefix}{t}gemm{suffix}") for t in "sd"]
    except AttributeError:
        return None
    for fn, real in zip(fns, (ctypes.c_float, ctypes.c_double)):
        fn.restype = None
        fn.argtypes = [ctypes.c_int] * 3 + [int_t] * 3 + [real, ctypes.c_void_p, int_t,
                                                          ctypes.c_void_p, int_t, real,
                                                          ctypes.c_void_p, int_t]
    return {np.dtype(np.float32): fns[0], np.dtype(np.float64): fns[1]}


def _openblas_lib():
    """(library, {dtype: cblas ?gemm}) of NumPy's bundled OpenBLAS, or (None, None)."""
    libs = os.path.join(os.path.dirname(np.__file__), os.pardir, "numpy.libs")
    for path in sorted(glob.glob(os.path.join(libs, "*openblas*.so*"))):
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for prefix, suffix, int_t in (("scipy_cblas_", "64_", ctypes.c_int64), ("cblas_", "64_", ctypes.c_int64),
                                      ("scipy_cblas_", "", ctypes.c_int), ("cblas_", "", ctypes.c_int)):
            fns = _bind_gemm(lib, prefix, suffix, int_t)
            if fns:
                return lib, fns
    return None, None


def _openblas_threads_fn(lib, verb):
    """NumPy's OpenBLAS's ``openblas_{verb}_num_threads`` (get or set) under its symbol names, or None."""
    for name in (f"scipy_openblas_{verb}_num_threads64_", f"openblas_{verb}_num_threads64_",
                 f"scipy_openblas_{verb}_num_threads", f"openblas_{verb}_num_threads"):
        fn = getattr(lib, name, None)
        if fn is not None:
            return fn
    return None


def openblas_threads(lib=None):
    """Threads of NumPy's OpenBLAS (``lib``, default found anew), or None where it is not found."""
    fn = _openblas_threads_fn(lib or _openblas_lib()[0], "get")
    if fn is None:
        return None
    fn.restype = ctypes.c_int
    return fn()


def set_openblas_threads(n, lib=None):
    """Set NumPy's OpenBLAS's thread count (where it is found)."""
    fn = _openblas_threads_fn(lib or _openblas_lib()[0], "set")
    if fn is not None:
        fn(ctypes.c_int(n))


def _mkl_path():
    """libmkl_rt of the installed ``mkl`` wheel, or None."""
    try:
        from importlib.metadata import PackageNotFoundError, files
        entries = files("mkl") or []
    except PackageNotFoundError:
        return None
    for entry in entries:
        if os.path.basename(str(entry)).startswith("libmkl_rt.so"):
            path = os.path.realpath(entry.locate())
            if os.path.exists(path):
                return path
    return None


def _load_mkl(threads, sequential=False):
    """Blas of MKL's single dynamic library with ``threads`` threads (``sequential``: for good,
    without an OpenMP runtime), or None."""
    path = _mkl_path()
    if path is None:
        return None
    # Intel's OpenMP threads spin long after each GEMM by default, on the cores the kernel
    # threads (backend/workers) then need; a short spin still spans one layer's GEMMs
    # (tools/bench_threads.py)
    os.environ.setdefault("KMP_BLOCKTIME", str(_threads.KMP_BLOCKTIME_MS))
    try:
        lib = ctypes.CDLL(path)
    except OSError:
        return None
    # the threading layer is chosen before any other MKL call
    layer = (_MKL_THREADING_SEQUENTIAL if sequential
             else _MKL_THREADING_GNU if _gnu_openmp_loaded() else _MKL_THREADING_INTEL)
    lib.MKL_Set_Threading_Layer(layer)
    lib.MKL_Set_Num_Threads(ctypes.c_int(threads))
    fns = _bind_gemm(lib, "cblas_", "", ctypes.c_int)          # the LP64 interface: 32-bit ints
    # per GEMM: the calling thread's count, which outranks the global one threadpoolctl sets
    return fns and Blas("mkl", threads, fns, lib.MKL_Set_Num_Threads_Local, None, sequential)


def load(choice=None) -> Blas:
    """The BLAS of ``choice`` (default ``SNCAFFE_BLAS``, else MKL where installed, else OpenBLAS)."""
    choice = (choice or config.settings.blas or "").lower()
    if choice and choice not in CHOICES:
        raise ValueError(f"SNCAFFE_BLAS={choice!r}: choose one of {', '.join(CHOICES)}")
    lib, fns = _openblas_lib() if choice != "numpy" else (None, None)
    if choice in ("", "mkl"):
        flag, share = _threads.requested()
        budget = _threads.decide(flag, blas_name="mkl", share=share)
        # a budget of one runs the sequential layer (the CLI decides before the BLAS loads)
        mkl = _load_mkl(budget.threads, sequential=budget.threads == 1)
        if mkl is not None:
            return mkl
        if choice == "mkl":
            raise RuntimeError("SNCAFFE_BLAS=mkl, but MKL is not installed: pip install 'sncaffe[mkl]'")
    if choice != "numpy" and fns:
        flag, share = _threads.requested()
        n = _threads.decide(flag, blas_name="openblas", share=share).threads
        set_openblas_threads(n, lib)
        return Blas("openblas", n, fns, _openblas_threads_fn(lib, "set"), n)
    return Blas("numpy")


def loaded() -> Blas:
    """The process's BLAS (``BLAS``), loaded on first use: after the CLI's ``--threads``."""
    lib = globals().get("BLAS")
    if lib is None:
        lib = globals()["BLAS"] = load()
    return lib


def __getattr__(name):
    if name == "BLAS":
        return loaded()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _layout(a):
    """(transpose flag, leading dimension) of a 2-D view as a row-major BLAS operand, or None."""
    m, n = a.shape
    s0, s1 = a.strides
    if s0 % a.itemsize or s1 % a.itemsize:
        return None
    s0, s1 = s0 // a.itemsize, s1 // a.itemsize
    if (s1 == 1 or n == 1) and (m == 1 or s0 >= n):
        return _NO_TRANS, max(s0 if m > 1 else n, n, 1)
    if (s0 == 1 or m == 1) and (n == 1 or s1 >= m):
        return _TRANS, max(s1 if n > 1 else m, m, 1)
    return None


def gemm(a, b, c, beta=0.0, blas=None):
    """``c = a @ b + beta * c`` for 2-D arrays (views welcome: BLAS takes their strides).
    NumPy arrays go to ``blas`` (default the loaded one); others, or layouts BLAS cannot take,
    to ``matmul``."""
    blas = blas or loaded()
    fn = type(c) is np.ndarray and blas.gemm.get(c.dtype)
    if fn and a.dtype == b.dtype == c.dtype and c.size and a.shape[1]:
        la, lb, lc = _layout(a), _layout(b), _layout(c)
        if la and lb and lc:
            if lc[0] == _TRANS:               # write c^T = b^T a^T
                a, b, la, lb = b.T, a.T, _layout(b.T), _layout(a.T)
            m, k = a.shape
            blas.set_threads(_threads.gemm_threads(2.0 * m * b.shape[1] * k))
            fn(_ROW_MAJOR, la[0], lb[0], m, b.shape[1], k, 1.0, a.ctypes.data, la[1],
               b.ctypes.data, lb[1], beta, c.ctypes.data, lc[1])
            return
    import sys                                    # a CuPy array: cupy is imported (backend/ imports no layers)
    xp = sys.modules["cupy"] if type(c).__module__.startswith("cupy") else np
    if beta == 0:
        xp.matmul(a, b, out=c)
        return
    if beta != 1:
        c *= beta
    c += xp.matmul(a, b)
