"""pycaffe, for sncaffe: existing pycaffe scripts run with ``import sncaffe.pycaffe as caffe``.

Mirrors pycaffe's python/caffe/: ``_caffe`` (mode, device, phases, Layer),
``net`` (Net), ``solver`` (SGDSolver ... get_solver), ``io``, ``net_spec``
(NetSpec, layers, params), ``classifier`` and ``proto.caffe_pb2``. sncaffe's own
API (sncaffe.Net, sncaffe.Solver) is underneath; see net.py for what memory
modes keep readable.
"""
from ._caffe import (TRAIN, TEST, Layer, layer_type_list, set_device, set_mode_cpu,  # noqa: F401
                     set_mode_gpu, set_random_seed)
from .net import Net  # noqa: F401
from .solver import (SGDSolver, NesterovSolver, AdaGradSolver, RMSPropSolver,  # noqa: F401
                     AdaDeltaSolver, AdamSolver, get_solver)
from .net_spec import NetSpec, layers, params, to_proto  # noqa: F401
from .classifier import Classifier  # noqa: F401
from . import io  # noqa: F401
from .proto import caffe_pb2  # noqa: F401
from .. import __version__  # noqa: F401
