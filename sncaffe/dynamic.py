"""Shapes that change at run time, as Caffe reshapes every layer before its Forward: a layer
whose tops depend on its bottoms' values (``data_dependent``: Filter keeps the items its selector
picks) sets its top shapes at each forward, and every layer after it is set up again for the
shapes it now gets.

Memory stays planned with the shapes the net was built with (Caffe's first Reshape: Filter's
tops hold the whole batch), which bound every later shape: a blob, scratch or workspace only
shrinks with the batch. At run time each is a view of the first elements of its planned block,
in this forward's shape, so the pool sees exactly the planned allocations and the measured peak
still equals the plan. Nets without a data-dependent layer never take this path.

A top may also outgrow its block (a Python layer giving a top more elements than its first
reshape did, in ``reshape`` or in ``forward`` as py-faster-rcnn's proposal layer does): it is
then held in an array of its own for the rest of that layer's call, and ``Grown`` tells the net,
which plans again with that shape as the top's new bound and goes on with the pass (Net._grow).
"""
from __future__ import annotations

from functools import partial

import numpy as np

from .tensor import array_module


class Grown(Exception):
    """``node``'s tops {index: shape} outgrew their planned blocks in this forward."""

    def __init__(self, node, shapes):
        super().__init__(f'layer "{node.name}": tops {shapes} outgrew their planned blocks')
        self.node, self.shapes = node, shapes


def _count(shape) -> int:
    return int(np.prod(shape, dtype=np.int64))


def view(full, shape):
    """The first count(shape) elements of ``full``, in ``shape`` (``full`` itself when equal)."""
    shape = tuple(shape)
    if tuple(full.shape) == shape:
        return full
    n = int(np.prod(shape, dtype=np.int64))
    if n > full.size:
        raise ValueError(f"shape {shape} needs {n} elements, the planned block holds {full.size}")
    return full.reshape(-1)[:n].reshape(shape)


class DynamicShapes:
    def __init__(self, graph, device=None):
        self.active = any(getattr(n.layer, "data_dependent", False) for n in graph.layers)
        self.device = device
        self.current = {}       # key -> shape of this forward, where it differs from the plan
        self.full = {}          # (key, part) -> the planned array last bound
        self.planned = {}       # key -> planned shape
        self.setup_shapes = {n.name: [tuple(b.shape) for b in n.bottoms] for n in graph.layers}
        self.grown_node, self.grown = None, {}      # the layer whose tops outgrew their blocks: {index: shape}
        for n in graph.layers:
            if getattr(n.layer, "data_dependent", False):
                n.layer.reshape_top = partial(self.reshape_top, n)      # a top reshaped inside forward

    def fit(self, key, part, array, planned):
        """The array a binder gives to a blob or scratch: planned shape, or this forward's."""
        full = array.reshape(planned)
        if not self.active or key is None:
            return full
        self.full[(key, part)] = full
        self.planned[key] = tuple(planned)
        return view(full, self.current.get(key, planned))

    def _set(self, key, shape, targets):
        """Record ``key``'s shape and re-view its bound arrays: [(part, setter)]."""
        shape = tuple(shape)
        if shape == self.planned.get(key, shape):
            self.current.pop(key, None)
        else:
            self.current[key] = shape
        for part, setter in targets:
            full = self.full.get((key, part))
            if full is not None:
                setter(view(full, shape))

    def before_forward(self, node):
        """Set ``node``'s layer up for the shapes its bottoms have now; re-view its tops and scratch."""
        layer = node.layer
        if getattr(layer, "data_dependent", False):
            for i, shape in enumerate(layer.top_shapes(node.bottom_blobs)):
                self.reshape_top(node, i, shape)
            tops = ()
        else:
            shapes = [tuple(b.data.shape) for b in node.bottom_blobs]
            if shapes == self.setup_shapes[node.name]:
                return
            params = [tuple(s) for s in layer.param_shapes]
            tops = layer.setup(shapes)         # layer.target was set when the graph was built
            if [tuple(s) for s in layer.param_shapes] != params:
                raise layer.error(f"bottom shapes {shapes} change its parameter shapes {params}")
            self.setup_shapes[node.name] = shapes
        for blob, shape in zip(node.top_blobs, tops):
            self._set(blob.name, shape, [(p, lambda a, blob=blob, p=p: setattr(blob, p, a)) for p in ("data", "diff")])
        for k in node.scratch:
            self._set(("scratch", node.name, k), layer.scratch_specs[k][0],
                      [("data", lambda a, k=k: layer.scratch.__setitem__(k, a))])

    def reshape_top(self, node, i, shape):
        """Give ``node``'s top ``i`` this forward's ``shape``: a view of its block where it fits,
        else an array of its own until the net is planned again for it (``grown``)."""
        blob, shape = node.top_blobs[i], tuple(shape)
        planned = self.planned.get(blob.name, tuple(node.tops[i].shape))
        if _count(shape) <= _count(planned):
            self._set(blob.name, shape, [(p, lambda a, p=p: setattr(blob, p, a)) for p in ("data", "diff")])
            self.grown.pop(i, None)
            return
        full = self.full.get((blob.name, "data"))
        xp = array_module(full) if full is not None else np
        dtype = full.dtype if full is not None else node.tops[i].dtype
        blob.data = xp.zeros(shape, dtype)
        blob.diff = None if blob.diff is None else xp.zeros(shape, dtype)
        self.grown_node = node
        self.grown[i] = shape

    def workspace(self, layer, kind, workspace):
        """The call's workspace arrays viewed in the shapes the layer now asks for."""
        specs = layer.workspace_specs if kind == "forward" or layer.backward_workspace_specs is None \
            else layer.backward_workspace_specs
        return {k: view(a, specs[k][0]) if k in specs else a for k, a in workspace.items()}
