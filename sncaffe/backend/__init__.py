"""Devices: ``cpu`` (NumPy) and, where a GPU is usable, ``cuda`` (CuPy + cuDNN)."""
from .cpu import CPUDevice


def default_device(capacity=None):
    return make_device("cpu", capacity)


def make_device(name="cpu", capacity=None, host_capacity=None):
    """``cpu``, ``cuda`` or ``cuda:N``; the cuda device is a clear RuntimeError where CuPy,
    cuDNN 9 or a GPU is missing (saying which extra to install)."""
    name = (name or "cpu").lower()
    if name == "cpu" or name.startswith("cpu:"):
        return CPUDevice(capacity, host_capacity)
    if name == "cuda" or name.startswith("cuda:"):
        index = name.partition(":")[2] or "0"
        if not index.isdigit():
            raise ValueError(f"bad device {name!r}: cuda or cuda:N")
        from .cuda import CUDADevice
        return CUDADevice(capacity, host_capacity, index=int(index))
    raise ValueError(f"unknown device {name!r} (cpu, cuda, cuda:N)")
