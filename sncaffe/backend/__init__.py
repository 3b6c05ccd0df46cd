"""Devices: ``cpu`` (NumPy) and, where a GPU is usable, ``cuda`` (CuPy + cuDNN)."""
from .cpu import CPUDevice


def is_gpu(target) -> bool:
    """Whether a graph built for ``target`` (a device, a planning target, or None: the CPU)
    runs on a GPU: its layers declare GPU workspaces in setup."""
    return getattr(target, "kind", "cpu") == "cuda"


class GPUEstimate:
    """A GPU planned for without one here: convolution workspaces are estimated
    (backend/cudnn_conv.estimate_workspace), not measured by cuDNN."""
    kind = "cuda"
    cudnn = None

    def __init__(self, name="cuda"):
        self.name = name

    def __repr__(self):
        return f"GPUEstimate({self.name})"


def plan_target(name="cpu"):
    """What ``sncaffe plan --device NAME`` builds the graph for: None (the CPU), a small
    CUDADevice where a GPU is usable here (cuDNN measures the workspaces), else a GPUEstimate."""
    name = (name or "cpu").lower()
    if name == "cpu" or name.startswith("cpu:"):
        return None
    if not (name == "cuda" or name.startswith("cuda:")):
        raise ValueError(f"unknown device {name!r} (cpu, cuda, cuda:N)")
    from .cuda import unusable_reason
    if unusable_reason() is None:
        from .cuda import CUDADevice
        index = name.partition(":")[2] or "0"
        return CUDADevice(1 << 20, host_capacity=1 << 20, index=int(index))
    return GPUEstimate(name)


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
