"""``caffe._caffe``: the names published Python layers and scripts import from it
(``RawBlobVec``, ``BlobVec``, ``Layer``, the solvers, ``set_mode_cpu`` ...)."""
from .mode import *  # noqa: F401,F403
from .mode import (TRAIN, TEST, Blob, BlobVec, Layer, LayerVec, Phase, RawBlobVec, Timer,  # noqa: F401
                   __version__, _solvers, _state)
from .net import Net  # noqa: F401
from .solver import (AdaDeltaSolver, AdaGradSolver, AdamSolver, NesterovSolver, RMSPropSolver,  # noqa: F401
                     SGDSolver, Solver, get_solver)
