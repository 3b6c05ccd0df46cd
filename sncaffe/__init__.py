"""sncaffe: Caffe networks in Python with a tensor-granular memory runtime."""
__version__ = "0.1.0"

from .net import Net  # noqa: E402,F401
from .prototxt import load_net, read_solver  # noqa: E402,F401
from .solvers import Solver  # noqa: E402,F401
