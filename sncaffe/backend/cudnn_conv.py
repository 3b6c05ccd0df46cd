"""cuDNN convolution plumbing: handles per (GPU, stream), descriptors and algorithm choice per shape.

Knows convolutions only as shapes in Caffe's conv view (image -> grid, a
weight, stride/pad/dilation/group); which layer asks, and which direction a
Deconvolution uses, is sncaffe/layers/conv_gpu.py's business.

``MATH`` ("fma": exact fp32; "default": TF32 allowed) and ``DETERMINISTIC``
(deterministic algorithms wherever one fits) apply to every convolution;
``WORKSPACE_LIMIT`` is a layer's workspace unless it says workspace_limit.
"""
from __future__ import annotations

import numpy as np

from . import cudnn

WORKSPACE_LIMIT = 256 << 20
MATH = "fma"
DETERMINISTIC = True
DIRECTIONS = ("forward", "backward_data", "backward_filter")

_handles: dict = {}


def register_device(device) -> None:
    """Use the device's own cuDNN handle for work on its compute stream."""
    _handles[(device.index, device.compute.ptr)] = device.cudnn


def handle():
    """The cuDNN handle bound to CuPy's current device and stream (made on first use)."""
    from .cuda import import_cupy
    cp = import_cupy()
    stream = cp.cuda.get_current_stream()
    key = (cp.cuda.Device().id, stream.ptr)
    h = _handles.get(key)
    if h is None or h.ptr is None:          # closed with its device
        h = _handles[key] = cudnn.Handle(stream)
    return h


class ConvShape:
    """One convolution at one batch size: cuDNN descriptors, and per direction the algorithms
    as cudnnFind*Ex measured them (time, workspace), found once."""

    def __init__(self, image, grid, weight, stride, pad, dilation, group, dtype):
        self.image, self.grid, self.weight = image, grid, weight
        self.dtype = np.dtype(dtype)
        self.x = cudnn.TensorDesc(image, dtype)
        self.y = cudnn.TensorDesc(grid, dtype)
        self.w = cudnn.FilterDesc(weight, dtype)
        self.conv = cudnn.ConvDesc(pad, stride, dilation, group, dtype, MATH)
        self.measured = {}          # direction -> (workspace bytes it was measured with, [Algorithm])

    def _args(self, direction, x, w, y):
        return {"forward": (self.x, x, self.w, w, self.conv, self.y, y),
                "backward_data": (self.w, w, self.y, y, self.conv, self.x, x),
                "backward_filter": (self.x, x, self.y, y, self.conv, self.w, w)}[direction]

    def measure(self, h, direction, x, w, y, workspace, nbytes):
        """Time every algorithm on these buffers (the output one is overwritten)."""
        find = getattr(cudnn, f"find_{direction}_algorithms")
        algos = find(h, *self._args(direction, x, w, y), workspace, nbytes)
        self.measured[direction] = (nbytes, algos)
        return algos

    def measure_all(self, directions, limit, stray=None):
        """Measure ``directions`` on temporary buffers of this shape's dtype (outside the pool,
        released at once, and given back to the GPU through ``stray``'s pool)."""
        from .cuda import import_cupy
        cp = import_cupy()
        x, y, w = (cp.zeros(s, self.dtype) for s in (self.image, self.grid, self.weight))
        ws = cp.empty(limit, np.uint8)
        for direction in directions:
            self.measure(handle(), direction, x, w, y, ws, limit)
        del x, y, w, ws
        if stray is not None:
            stray.pool.free_all_blocks()

    def algorithm(self, direction, limit):
        """The fastest measured algorithm whose workspace fits ``limit`` bytes (deterministic
        ones first where DETERMINISTIC); None where it has not been measured up to ``limit``."""
        nbytes, algos = self.measured.get(direction, (-1, None))
        if algos is None or (nbytes < limit and any(a.status != 0 for a in algos)):
            return None
        ok = [a for a in algos if a.status == 0 and a.memory <= limit]
        exact = [a for a in ok if a.deterministic] if DETERMINISTIC else ok
        pick = exact or ok
        if not pick:
            raise cudnn.CudnnNotSupported(3000, f"convolution {direction}",
                                          f"no algorithm runs within {limit} bytes of workspace "
                                          f"(image {self.image}, weight {self.weight})")
        return min(pick, key=lambda a: a.time)


_shapes: dict = {}


def conv_shape(image, grid, weight, settings, dtype) -> ConvShape:
    """The ConvShape of a conv view (shared by every layer of the same geometry and dtype)."""
    _, stride, pad, dilation, group = settings
    key = (image, grid, weight, stride, pad, dilation, group, np.dtype(dtype).name, MATH)
    shape = _shapes.get(key)
    if shape is None:
        shape = _shapes[key] = ConvShape(image, grid, weight, stride, pad, dilation, group, dtype)
    return shape


def pick(shape, h, direction, x, w, y, workspace, nbytes, scratch=None):
    """The algorithm for this call: measured once per shape, on these buffers the first time
    (``scratch`` stands in for an output that must not be overwritten: the weight diff)."""
    algo = shape.algorithm(direction, nbytes)
    if algo is None:
        out = {"forward": y, "backward_data": x, "backward_filter": w}[direction]
        if scratch is not None:
            out = scratch
        args = {"forward": (x, w, out), "backward_data": (out, w, y), "backward_filter": (x, out, y)}[direction]
        shape.measure(h, direction, *args, workspace, nbytes)
        algo = shape.algorithm(direction, nbytes)
    return algo


def estimate_workspace(image, grid, weight, settings, dtype, direction, limit) -> int:
    """Without a GPU to ask (``sncaffe plan --device cuda`` on a machine without one): the
    workspace of cuDNN's implicit-precomputed / explicit GEMM algorithms, the fastest that
    usually fit, is about one column buffer of the conv view (C/g kh kw x the grid's
    pixels, one image's worth per batch image); the FFT and Winograd ones that need more
    are counted out by ``limit``. An estimate: a GPU's measured table replaces it."""
    kernel, _, _, _, group = settings
    n, c = image[0], image[1]
    pixels = int(np.prod(grid[2:]))
    col = (c // group) * int(np.prod(kernel)) * pixels * n * np.dtype(dtype).itemsize
    if direction == "forward" and kernel == (1, 1):
        col = 0                     # 1x1: the GEMM reads the image directly
    return int(min(limit, col))
