"""sncaffe: Caffe networks in Python with a tensor-granular memory runtime."""
__version__ = "0.1.0"

import os as _os

# OpenBLAS's threads spin for 2^28 cycles (~0.1 s) after every GEMM before they sleep; beside
# oneDNN's OpenMP team that spin holds the core the other pool's thread needs, so LeNet trained
# 2.5x slower on two threads than on one (the README's first command on an idle 2-core machine:
# 82 s against 33 s). 2^4 cycles: they sleep at once, and each GEMM wakes them (300 iterations:
# 13.0 s -> 4.3 s, against 5.0 s on one thread). OpenBLAS reads it when it loads, at NumPy's import,
# so it is set here, before sncaffe imports NumPy; a value the user set is kept.
_os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")

from .net import Net  # noqa: E402,F401
from .prototxt import load_net, read_solver  # noqa: E402,F401
from .solvers import Solver  # noqa: E402,F401
