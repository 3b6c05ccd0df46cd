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


def make_device(name="cpu", capacity=None, host_capacity=None, share=1):
    """``cpu``, ``cuda`` or ``cuda:N``; the cuda device is a clear RuntimeError where CuPy,
    cuDNN 9 or a GPU is missing (saying which extra to install). ``share``: processes of this
    run on this machine, which split the CPU's RAM (a GPU is each rank's own)."""
    name = (name or "cpu").lower()
    if name == "cpu" or name.startswith("cpu:"):
        return CPUDevice(capacity, host_capacity, share)
    if name == "cuda" or name.startswith("cuda:"):
        index = name.partition(":")[2] or "0"
        if not index.isdigit():
            raise ValueError(f"bad device {name!r}: cuda or cuda:N")
        from .cuda import CUDADevice
        return CUDADevice(capacity, host_capacity, index=int(index))
    raise ValueError(f"unknown device {name!r} (cpu, cuda, cuda:N)")


def budgets(name="cpu", capacity=None, host_capacity=None, spill_dir=None) -> tuple:
    """(device capacity, the planner's host-tier keywords) that a device named ``name`` would
    plan with, as ``Net.budgets`` gives them for a device made with these sizes, without
    making one. On the CPU device and host share the RAM (``ram``) and a disk tier
    (``spill``) takes the rest; a GPU's capacity is its free memory less a margin, None where
    no GPU is here to ask (give ``capacity``)."""
    from ..sizes import parse_bytes
    from .cpu import default_capacity, pools_ram
    name = (name or "cpu").lower()
    size = (lambda x: None if x is None else parse_bytes(x))
    if name == "cpu" or name.startswith("cpu:"):
        from ..runtime.spill import spill_room
        ram = pools_ram()
        return (size(capacity) or ram, {"host_capacity": size(host_capacity) or ram, "spill": spill_room(spill_dir),
                                        "ram": ram if capacity is None or host_capacity is None else None})
    from .cuda import default_margin, import_cupy, unusable_reason
    if capacity is None and unusable_reason() is None:
        cp = import_cupy()
        with cp.cuda.Device(int(name.partition(":")[2] or 0)):
            free, total = cp.cuda.runtime.memGetInfo()
        capacity = free - default_margin(total)
    return size(capacity), {"host_capacity": size(host_capacity) or default_capacity() // 2, "ram": None}
