"""Tensors as the graph, the planner and the runtime see them: plain data with a shape, a
dtype, a kind and a location; workspaces are tensors made from a layer's declared specs."""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from .sizes import align


@dataclass(eq=False)
class Tensor:
    name: str
    shape: tuple
    dtype: np.dtype
    kind: str                       # data | diff | param | param_diff | scratch | workspace
    base: "Tensor | None" = None    # shares base's memory (aliasing layers)
    location: str = ""              # the device it lives on ("": the net's default device)

    @cached_property
    def nbytes(self) -> int:
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize

    @cached_property
    def block_bytes(self) -> int:
        """The bytes of its pool block (``nbytes`` aligned): the planner asks millions of times."""
        return align(self.nbytes)

    @property
    def root(self) -> "Tensor":
        return self if self.base is None else self.base.root

    def __repr__(self):
        return f"Tensor({self.name!r}, {self.shape}, {self.kind})"


def workspace_tensors(name, specs, dtype, location="") -> dict:
    """The workspace tensors of layer ``name`` from its specs {key: (shape, dtype or None)}."""
    return {k: Tensor(f"{name}#{k}", tuple(s), np.dtype(d or dtype), "workspace", location=location)
            for k, (s, d) in specs.items()}


def array_module(a):
    """numpy or cupy, taken from an array (Chainer's habit)."""
    if type(a).__module__.startswith("cupy"):
        import cupy
        return cupy
    return np
