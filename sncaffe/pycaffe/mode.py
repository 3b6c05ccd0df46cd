"""The process-wide state pycaffe keeps (mode, device, seed, solver count) and the small
types ``caffe._caffe`` exposes, apart from the net and solver classes (``_caffe`` re-exports
all of them with those).

All nets of a process share one device (as Caffe's singleton), so their tensors
come from one pool and each net's plan sees what the others took.
"""
from __future__ import annotations

import logging
import time

from ..layers.base import TRAIN, TEST  # noqa: F401
from ..layers.python_layer import BlobVec, BlobView as Blob, Phase, RawBlobVec  # noqa: F401
from ..layers.python_layer import PythonLayerBase as Layer  # noqa: F401
from .. import __version__  # noqa: F401


class LayerVec(list):
    """``net.layers``."""


class StringVec(list):
    pass


class IntVec(list):
    pass


class BoolVec(list):
    pass


class DtypeVec(list):
    pass


class NetVec(list):
    pass


class Timer:
    """Caffe's Timer: ``start()``, ``stop()``, and ``ms`` between them."""

    def __init__(self):
        self._start, self._ms = None, 0.0

    def start(self):
        self._start = time.perf_counter()

    def stop(self):
        if self._start is not None:
            self._ms = (time.perf_counter() - self._start) * 1e3

    @property
    def ms(self):
        return self._ms


def log(message):
    """Caffe's LOG(INFO), through sncaffe's logger."""
    logging.getLogger("sncaffe").info("%s", message)


def init_log(*args):
    """Caffe's glog set-up; sncaffe logs through the ``logging`` module."""


def has_nccl():
    return False


_solvers = {"count": 1, "rank": 0, "multiprocess": False}


def solver_count():
    return _solvers["count"]


def set_solver_count(count):
    _solvers["count"] = int(count)


def solver_rank():
    return _solvers["rank"]


def set_solver_rank(rank):
    _solvers["rank"] = int(rank)


def set_multiprocess(multiprocess):
    _solvers["multiprocess"] = bool(multiprocess)

_state = {"mode": "cpu", "gpu": 0, "device": None, "seed": 0}


def set_mode_cpu():
    _state["mode"] = "cpu"


def set_mode_gpu():
    """GPU mode; a clear RuntimeError now where no GPU is usable (CuPy, a GPU or cuDNN missing)."""
    from ..backend.cuda import unusable_reason
    why = unusable_reason()
    if why:
        raise RuntimeError(f"caffe.set_mode_gpu(): {why}")
    _state["mode"] = "gpu"


def set_device(device_id):
    _state["gpu"] = int(device_id)


def set_random_seed(seed):
    _state["seed"] = int(seed)


def device():
    """The device of the current mode, made on first use and shared by every net."""
    name = "cpu" if _state["mode"] == "cpu" else f"cuda:{_state['gpu']}"
    dev = _state["device"]
    if dev is None or getattr(dev, "_pycaffe_name", None) != name:
        from ..backend import make_device
        dev = _state["device"] = make_device(name)
        dev._pycaffe_name = name
    return dev


def seed():
    return _state["seed"]


def layer_type_list():
    from ..layers import REGISTRY
    return sorted(REGISTRY)
