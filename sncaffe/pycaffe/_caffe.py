"""What pycaffe's C++ module ``_caffe`` holds: phases, the mode and device, the random seed.

All nets of a process share one device (as Caffe's singleton), so their tensors
come from one pool and each net's plan sees what the others took.
"""
from __future__ import annotations

from ..layers.base import TRAIN, TEST  # noqa: F401
from ..layers.python_layer import PythonLayerBase as Layer  # noqa: F401

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
