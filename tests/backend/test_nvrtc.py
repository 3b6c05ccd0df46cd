"""Every registered CUDA kernel compiles with NVRTC, the compiler CuPy uses, from the pip wheel
(nvidia-cuda-nvrtc for CUDA 13, or -cu12): no GPU and no CUDA toolkit needed. Compiled for
Hopper with sncaffe's options, float32 and float64, every index type; warnings count as errors.
Skipped, with the reason, where the wheel is not installed (pip install 'sncaffe[test]')."""
import ctypes
import glob
import os
import re
import sys

import numpy as np
import pytest

import sncaffe.layers  # noqa: F401  (registers every family's kernels)
from sncaffe.backend import kernels
from sncaffe.backend.cuda import PROBE

ARCH = "compute_90"


def _find_nvrtc():
    """libnvrtc from the nvidia wheels on sys.path (CUDA 13's layout first), or $SNCAFFE_NVRTC."""
    if os.environ.get("SNCAFFE_NVRTC"):
        return os.environ["SNCAFFE_NVRTC"]
    for root in sys.path:
        for pattern in ("nvidia/cu13/lib/libnvrtc.so.13", "nvidia/cuda_nvrtc/lib/libnvrtc.so.12"):
            found = sorted(glob.glob(os.path.join(root, pattern)))
            if found:
                return found[0]
    return None


def _load():
    path = _find_nvrtc()
    if path is None:
        return None, "NVRTC is not installed (pip install nvidia-cuda-nvrtc, part of sncaffe[test])"
    try:
        lib = ctypes.CDLL(path)
    except OSError as e:
        return None, f"cannot load {path}: {e}"
    lib.nvrtcGetErrorString.restype = ctypes.c_char_p
    return lib, None


NVRTC, REASON = _load()
pytestmark = pytest.mark.skipif(NVRTC is None, reason=str(REASON))


def compile_cuda(code, options, name="k.cu"):
    """(status, log) of NVRTC compiling ``code`` to PTX."""
    prog = ctypes.c_void_p()
    status = NVRTC.nvrtcCreateProgram(ctypes.byref(prog), code.encode(), name.encode(), 0, None, None)
    assert status == 0, NVRTC.nvrtcGetErrorString(status)
    try:
        opts = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
        status = NVRTC.nvrtcCompileProgram(prog, len(options), opts)
        size = ctypes.c_size_t()
        NVRTC.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        NVRTC.nvrtcGetProgramLog(prog, log)
        ptx_size = ctypes.c_size_t()
        ptx = ""
        if status == 0:
            NVRTC.nvrtcGetPTXSize(prog, ctypes.byref(ptx_size))
            buf = ctypes.create_string_buffer(ptx_size.value)
            NVRTC.nvrtcGetPTX(prog, buf)
            ptx = buf.value.decode(errors="replace")
        return status, log.value.decode(errors="replace"), ptx
    finally:
        NVRTC.nvrtcDestroyProgram(ctypes.byref(prog))


def test_nvrtc_version():
    major, minor = ctypes.c_int(), ctypes.c_int()
    assert NVRTC.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)) == 0
    assert major.value >= 12


def test_a_broken_kernel_fails_with_its_message():
    """The check can fail: a kernel with an error is refused, with NVRTC's log."""
    status, log, _ = compile_cuda('extern "C" __global__ void k(float* x) { x[0] = undeclared; }',
                                  ["-arch=" + ARCH])
    assert status != 0 and "undeclared" in log
    status, log, _ = compile_cuda('extern "C" __global__ void k(float* x) { int unused = 3; x[0] = 1; }',
                                  ["-arch=" + ARCH, "-Werror", "all-warnings"])
    assert status != 0 and "unused" in log                 # and so is one with a warning


def test_the_probe_kernel_compiles():
    status, log, ptx = compile_cuda(PROBE, ["-arch=" + ARCH, *kernels.OPTIONS])
    assert status == 0 and ptx, log


def test_denormals_are_kept_as_on_the_cpu():
    """No flush-to-zero: float32 arithmetic keeps denormals (the CPU does); -ftz=true would not."""
    code = kernels.source("neuron", np.float32)
    def flushing(ptx):      # instructions that flush denormals; expf's own ex2.approx.ftz is exact enough
        return {m for m in re.findall(r"([a-z]+(?:\.[a-z0-9]+)*)\.ftz", ptx) if not m.endswith("approx")}
    status, log, ptx = compile_cuda(code, ["-arch=" + ARCH, *kernels.OPTIONS])
    assert status == 0 and ".f32" in ptx and not flushing(ptx), (log, flushing(ptx))
    status, _, flushed = compile_cuda(code, ["-arch=" + ARCH, "-ftz=true"])
    assert status == 0 and {"add", "mul"} <= flushing(flushed)


@pytest.mark.parametrize("family", sorted(kernels.SOURCES))
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
def test_every_kernel_compiles(family, dtype):
    for index in kernels.INDEX_TYPES[family]:
        code = kernels.source(family, dtype, index)
        status, log, ptx = compile_cuda(code, ["-arch=" + ARCH, "-Werror", "all-warnings", *kernels.OPTIONS],
                                        f"{family}.cu")
        assert status == 0 and ptx, f"{family} ({np.dtype(dtype).name}, index {index}):\n{log}"
        assert "warning" not in log.lower(), log
