"""The layer contract, as in Caffe: set up (infer shapes), forward, backward.

A layer never allocates the tensors of a run. ``setup`` declares what it
needs and the executor carves it from the device pool before each call:

- ``self.param_shapes``   learnable (or stored) blobs, Caffe's order; the
                          executor binds ``self.blobs[i]`` (a Blob: .data,
                          .diff).
- ``self.scratch_specs``  {name: (shape, dtype)} kept from forward to
                          backward (pooling argmax, BN statistics, dropout
                          mask); bound as ``self.scratch[name]``.
- ``self.workspace_specs`` {name: (shape, dtype)} needed only inside one
                          forward or backward call (im2col buffers); bound
                          as ``self.workspace[name]``.
- ``self.backward_workspace_specs`` the same for backward only, where it
                          differs (None: backward uses workspace_specs too).

dtype ``None`` in a spec means "the blobs' dtype" (float32 in a run, float64
in the gradient checker).

Semantics follow Caffe: ``backward`` overwrites bottom diffs (only where
``propagate_down[i]``) and accumulates (+=) into parameter diffs. With an
in-place layer (top name == bottom name) the executor passes the same Blob as
``bottom[0]`` and ``top[0]`` and sets ``self.inplace``.
"""
from __future__ import annotations

import numpy as np

from ..tensor import array_module  # noqa: F401  (the layers take it from here)

REGISTRY: dict[str, type["Layer"]] = {}

TRAIN, TEST = 0, 1


def register(cls):
    """Class decorator: map the prototxt ``type`` string to the class."""
    REGISTRY[cls.type] = cls
    return cls


class Blob:
    """A named view of a tensor's data and diff (either may be None)."""
    __slots__ = ("name", "data", "diff")

    def __init__(self, name, data=None, diff=None):
        self.name, self.data, self.diff = name, data, diff

    @property
    def shape(self):
        return tuple(self.data.shape if self.data is not None else self.diff.shape)

    def __repr__(self):
        return f"Blob({self.name!r}, shape={self.shape})"


class LayerError(ValueError):
    """A bad setting or shape, reported with the layer's name and type."""


class DataReadError(LayerError):
    """A data layer could not read its next batch (a damaged record or database): the net and
    solver are as they were after the last update, so a snapshot of them is sound."""


class Layer:
    type: str = None            # the prototxt type string
    # Bottom/top counts (None: unchecked), like Caffe's ExactNum*/Min*/Max*.
    exact_bottoms = exact_tops = None
    min_bottoms = min_tops = None
    max_bottoms = max_tops = None
    is_loss = False             # a loss layer: top[0] gets loss_weight 1 by default
    learnable = True            # False: stored blobs never get gradients (BatchNorm)
    # Which tensors backward reads; the memory runtime frees what is not listed.
    backward_needs = ("bottom", "top")
    # What the graph is built for, set by build_graph before setup: the target device (or a
    # planning target; None: the CPU) and the blobs' dtype. A GPU layer sizes its workspaces
    # for it (on_gpu).
    target = None
    dtype = np.dtype(np.float32)

    @property
    def on_gpu(self) -> bool:
        """Whether the target runs on a GPU (the target's kind, as backend.is_gpu reads it)."""
        return getattr(self.target, "kind", "cpu") == "cuda"

    def __init__(self, param, phase=TRAIN):
        self.param = param      # the LayerParameter
        self.name = param.name
        self.phase = phase
        self.inplace = False
        self.param_shapes: list[tuple] = []
        self.scratch_specs: dict = {}
        self.workspace_specs: dict = {}
        self.backward_workspace_specs: dict | None = None
        self.blobs: list[Blob] = []
        self.scratch: dict = {}
        self.shared_scratch: frozenset = frozenset()    # scratch another layer writes (graph.SHARED_SCRATCH)
        self.optional_scratch: frozenset = frozenset()  # scratch kept only where shared (dropped otherwise)
        self.fusion = None      # run as one with a neighbour: graph.Fusion (BatchNorm + Scale), graph.EltwiseReLU
        self.workspace: dict = {}
        self.rng = np.random.default_rng(0)

    def fused(self, kind) -> bool:
        """Whether this pass (``kind``: forward, backward) runs as one with its ``fusion`` partner."""
        return self.fusion is not None and getattr(self.fusion, kind)

    # -- contract -----------------------------------------------------------
    def setup(self, bottom_shapes: list[tuple]) -> list[tuple]:
        """Read parameters, check bottoms, declare specs; return top shapes."""
        raise NotImplementedError

    def forward(self, bottom: list[Blob], top: list[Blob]) -> None:
        raise NotImplementedError

    def backward(self, top: list[Blob], propagate_down: list[bool], bottom: list[Blob]) -> None:
        raise NotImplementedError(f"{self.type} has no backward")

    def recompute(self, bottom: list[Blob], top: list[Blob]) -> None:
        """Forward again in backward (the memory runtime): same outputs, no side effects."""
        self.forward(bottom, top)

    def workspace_for_chunk(self, chunk: int) -> dict | None:
        """Workspace specs when the batch is processed ``chunk`` images at a time
        (setting ``self.chunk``); None: this layer cannot work in chunks."""
        return None

    def chunk_sizes(self, n: int):
        """The chunk sizes (ascending, a sequence) the memory runtime may choose for a batch of n."""
        return range(1, n)

    def init_params(self, rng) -> None:
        """Fill ``self.blobs[i].data`` from the layer's fillers (parameterised layers)."""

    def allow_force_backward(self, bottom_index: int) -> bool:
        """False for inputs that are never differentiated (labels)."""
        return True

    # -- helpers ------------------------------------------------------------
    def error(self, msg) -> LayerError:
        where = getattr(self.param, "defined_at", "")       # file:line of the layer's prototxt
        return LayerError(f'{where + ": " if where else ""}layer "{self.name}" ({self.type}): {msg}')

    def check_counts(self, n_bottom: int, n_top: int) -> None:
        for what, n, exact, lo, hi in (
                ("bottom", n_bottom, self.exact_bottoms, self.min_bottoms, self.max_bottoms),
                ("top", n_top, self.exact_tops, self.min_tops, self.max_tops)):
            if exact is not None and n != exact:
                raise self.error(f"needs exactly {exact} {what} blob(s), got {n}")
            if lo is not None and n < lo:
                raise self.error(f"needs at least {lo} {what} blob(s), got {n}")
            if hi is not None and n > hi:
                raise self.error(f"takes at most {hi} {what} blob(s), got {n}")


def canonical_axis(layer: Layer, axis: int, num_axes: int) -> int:
    """Caffe's Blob::CanonicalAxisIndex with a layer-named error."""
    if not -num_axes <= axis < max(num_axes, 1):
        raise layer.error(f"axis {axis} out of range for a {num_axes}-axis blob")
    return axis % num_axes if num_axes else 0


def count(shape, start=0, end=None) -> int:
    return int(np.prod(shape[start:end], dtype=np.int64))
