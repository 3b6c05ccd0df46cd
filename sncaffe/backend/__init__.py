"""Devices: ``cpu`` (NumPy) and, where a GPU is usable, ``cuda`` (CuPy + cuDNN)."""
from .cpu import CPUDevice


def default_device(capacity=None):
    return make_device("cpu", capacity)


def make_device(name="cpu", capacity=None):
    name = (name or "cpu").lower()
    if name == "cpu" or name.startswith("cpu:"):
        return CPUDevice(capacity)
    if name.startswith("cuda"):
        raise RuntimeError("the cuda device is not available in this build of sncaffe yet; use --device cpu")
    raise ValueError(f"unknown device {name!r} (cpu, cuda)")
