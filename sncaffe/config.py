"""Every setting of sncaffe in one place: what can be configured, the environment variable that
sets it, and its default. The environment is read once, when this module loads; code reads
``config.settings``, and the CLI, the API and tests change it in a scope with ``config.using``
(as ``chainer.using_config``). Nothing here writes the environment: the one variable the
command line sets for its own process is in ``process_environment``, applied by ``sncaffe.entry``.
"""
from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass, fields, replace

log = logging.getLogger("sncaffe")


@dataclass(frozen=True)
class Settings:
    conv: str = ""              # SNCAFFE_CONV: "native" runs the reference GEMM convolutions, not oneDNN
    blas: str = ""              # SNCAFFE_BLAS: mkl | openblas | numpy ("": MKL where installed, else OpenBLAS)
    kernel_threads: int = 1     # SNCAFFE_KERNEL_THREADS: threads the element-wise kernels may use
    numba: bool = True          # SNCAFFE_NUMBA=0: the compiled (numba) kernels off
    images: str = ""            # SNCAFFE_IMAGES=pillow: decode images with Pillow, not OpenCV
    cudnn: str = ""             # SNCAFFE_CUDNN: the cuDNN library to load, instead of the wheel's
    threads: int | None = None  # the thread budget (--threads); None: decided from the free cores


VARIABLES = {"conv": "SNCAFFE_CONV", "blas": "SNCAFFE_BLAS", "kernel_threads": "SNCAFFE_KERNEL_THREADS",
             "numba": "SNCAFFE_NUMBA", "images": "SNCAFFE_IMAGES", "cudnn": "SNCAFFE_CUDNN"}


def _kernel_threads(text: str) -> int:
    try:
        return max(1, int(text))
    except ValueError:
        log.warning("SNCAFFE_KERNEL_THREADS=%r is not a number of threads: the kernels run on the "
                    "calling thread", text)
        return 1


def from_environment(env=None) -> Settings:
    """The settings the environment ``env`` (default ``os.environ``) gives."""
    env = os.environ if env is None else env
    get = lambda field: env.get(VARIABLES[field], "").strip()           # noqa: E731
    return Settings(conv=get("conv").lower(), blas=get("blas").lower(),
                    kernel_threads=_kernel_threads(get("kernel_threads") or "1"),
                    numba=get("numba") != "0", images=get("images").lower(), cudnn=get("cudnn"))


settings = from_environment()


@contextlib.contextmanager
def using(**changes):
    """Run the enclosed code with some settings changed (``using(conv="native")``)."""
    global settings
    unknown = set(changes) - {f.name for f in fields(Settings)}
    if unknown:
        raise TypeError(f"unknown setting(s): {', '.join(sorted(unknown))}")
    before = settings
    settings = replace(settings, **changes)
    try:
        yield settings
    finally:
        settings = before


def process_environment() -> dict:
    """Variables the command line sets for its own process before NumPy loads OpenBLAS (a value
    the user set is kept). OpenBLAS's threads spin after every GEMM before they sleep; beside
    oneDNN's OpenMP team that spin holds the core the other pool's thread needs (tools/bench_threads.py)."""
    return {"OPENBLAS_THREAD_TIMEOUT": "4"}
