"""Python layers (``type: "Python"``), as Caffe's PythonLayer runs them.

``python_param { module: "m" layer: "C" param_str: "..." }`` imports ``m`` from
``sys.path`` (so ``PYTHONPATH``; the prototxt's folder is not searched, as in
Caffe) and builds ``C(layer_param)``, then sets ``param_str`` and ``phase`` on
it. The object gets pycaffe's calls with pycaffe's blobs (``BlobView``):
``setup(bottom, top)`` and ``reshape(bottom, top)`` once at build time (the
blobs carry shapes and read-only zeros), where ``top[i].reshape(...)``
declares the top shapes the memory plan is made for; ``reshape`` again before
every ``forward(bottom, top)``, and ``backward(top, propagate_down, bottom)``.
A top may get a new shape in that ``reshape``, or in ``forward`` as py-faster-rcnn's
proposal layer does (Caffe reshapes every layer before its Forward): the layer is
``data_dependent``, so sncaffe.dynamic views the top in its new shape inside its planned
block and sets the later layers up again; a top that outgrows its block makes the net plan
again with the new shape as its bound (sncaffe.dynamic.grow, logged). Its tops, bottoms
and learnable blobs (``self.blobs.add_blob(...)`` in setup) are pool tensors
planned like any other, and what the object keeps on itself is its own Python memory. It
is never recomputed unless its class says ``recomputable = True``: then the
memory runtime may drop its tops after forward and call ``reshape`` and
``forward`` again in backward (as for ReLU or Pooling), so its forward must be
a pure function of its bottoms and blobs.
"""
from __future__ import annotations

import importlib

import numpy as np

from .base import Layer, LayerError, register


class BlobView:
    """pycaffe's Blob over an sncaffe Blob: data, diff, shape, count, num/channels/height/width."""

    def __init__(self, blob, on_reshape=None):
        self._blob = blob
        self._on_reshape = on_reshape      # callable(new shape) or None: a fixed shape

    @property
    def data(self):
        return self._blob.data

    @property
    def diff(self):
        return self._blob.diff

    @property
    def shape(self):
        return tuple(self._blob.shape)

    @property
    def count(self):
        return int(np.prod(self.shape, dtype=np.int64))

    def _legacy(self, axis):
        s = self.shape
        return int(s[axis]) if axis < len(s) else 1     # Caffe's LegacyShape

    num = property(lambda self: self._legacy(0))
    channels = property(lambda self: self._legacy(1))
    height = property(lambda self: self._legacy(2))
    width = property(lambda self: self._legacy(3))

    def reshape(self, *shape):
        shape = tuple(int(d) for d in (shape[0] if len(shape) == 1 and not np.isscalar(shape[0]) else shape))
        if self._on_reshape is not None:
            self._on_reshape(shape)
        elif shape != self.shape:
            raise ValueError(f'blob "{self._blob.name}": its shape {self.shape} is planned; reshaping it to '
                             f"{shape} needs the net rebuilt (pycaffe: reshape the input blobs, then net.reshape())")

    def __repr__(self):
        return f"<Blob {self._blob.name!r} {self.shape}>"


class _Shaped:
    """A build-time blob: a shape (zero data that costs nothing) and a settable shape for tops."""
    __slots__ = ("name", "data", "diff", "dtype")

    def __init__(self, name, shape, dtype):
        self.name, self.dtype = name, dtype
        self.data = self.diff = None if shape is None else np.broadcast_to(np.zeros((), dtype), shape)

    @property
    def shape(self):
        return () if self.data is None else self.data.shape

    def view(self):
        """A pycaffe blob whose ``reshape`` sets this blob's shape."""
        def set_shape(shape):
            self.data = self.diff = np.broadcast_to(np.zeros((), self.dtype), shape)
        return BlobView(self, set_shape)


class RawBlobVec(list):
    """The ``bottom`` and ``top`` a Python layer's calls get (pycaffe's ``caffe._caffe.RawBlobVec``)."""


class Phase(int):
    """A Python layer's ``self.phase``: 0 or 1 as in BVLC pycaffe, and ``str()`` gives "TRAIN" or
    "TEST" as the Faster R-CNN fork's enum did (its layers look ``cfg[str(self.phase)]`` up)."""

    def __str__(self):
        return ("TRAIN", "TEST")[self]


class BlobVec(list):
    """``self.blobs`` of a Python layer: ``add_blob(*shape)`` in setup adds a learnable blob."""

    def add_blob(self, *shape):
        from .base import Blob
        shape = tuple(int(d) for d in shape)
        self.append(BlobView(Blob(f"blob{len(self)}", np.zeros(shape, np.float32), np.zeros(shape, np.float32))))


class PythonLayerBase:
    """The base class pycaffe calls ``caffe.Layer``: a Python layer derives from it."""
    type = "Python"
    # True: forward depends on the bottoms and blobs alone, and costs little, so the memory
    # runtime may drop the tops after forward and run forward again in backward (plan/recompute.py).
    recomputable = False

    def __init__(self, param=None):
        self.param = param
        self.param_str = self.param_str_ = param.python_param.param_str if param is not None else ""
        self.phase = Phase(0)
        self.blobs = BlobVec()

    def setup(self, bottom, top):
        pass

    def reshape(self, bottom, top):
        raise NotImplementedError(f"{type(self).__name__} must define reshape(bottom, top)")

    def forward(self, bottom, top):
        raise NotImplementedError(f"{type(self).__name__} must define forward(bottom, top)")

    def backward(self, top, propagate_down, bottom):
        raise NotImplementedError(f"{type(self).__name__} must define backward(top, propagate_down, bottom)")


def load_class(lp):
    """The class ``python_param`` names, or a LayerError naming the layer and the module."""
    p = lp.python_param
    where = f'layer "{lp.name}" (Python)'
    if not p.module or not p.layer:
        raise LayerError(f"{where}: python_param needs both module and layer")
    try:
        module = importlib.import_module(p.module)
    except Exception as e:      # a module that fails on import is the user's error to read
        raise LayerError(f'{where}: cannot import python_param.module "{p.module}": {type(e).__name__}: {e} '
                         f"(the module must be on sys.path or PYTHONPATH; the prototxt's folder is not "
                         f"searched, as in Caffe)") from e
    cls = getattr(module, p.layer, None)
    if cls is None:
        raise LayerError(f'{where}: module "{p.module}" ({getattr(module, "__file__", "?")}) has no '
                         f'python_param.layer "{p.layer}"')
    if not (isinstance(cls, type) and issubclass(cls, PythonLayerBase)):   # never call what it is not
        what = "a class not derived from caffe.Layer" if isinstance(cls, type) else f"a {type(cls).__name__}"
        raise LayerError(f'{where}: python_param.layer "{p.layer}" of module "{p.module}" is {what}; it must '
                         f"name a class derived from caffe.Layer (sncaffe.pycaffe.Layer)")
    return cls


@register
class Python(Layer):
    type = "Python"
    data_dependent = True       # reshape may give the tops new shapes at every forward (sncaffe.dynamic)
    _reshaped = False           # top_shapes has just called the object's reshape
    _set_up = False             # the object's setup has run
    reshape_top = None          # (index, shape) -> None: sncaffe.dynamic's, for a top reshaped in forward

    def __init__(self, param, phase=0):
        super().__init__(param, phase)
        cls = load_class(param)
        self.label = f'layer "{self.name}" (Python {param.python_param.module}.{param.python_param.layer})'
        try:
            try:
                obj = cls(param)
            except TypeError:
                obj = cls()         # a class whose __init__ takes no LayerParameter
        except Exception as e:
            raise LayerError(f"{self.label}: creating it raised {type(e).__name__}: {e}") from e
        if not isinstance(getattr(obj, "blobs", None), list):
            obj.blobs = BlobVec()
        # param_str_: the name the Faster R-CNN fork's layers read
        obj.param_str = obj.param_str_ = param.python_param.param_str
        obj.phase = Phase(phase)
        self.obj = obj
        self.cheap = bool(getattr(obj, "recomputable", False))     # read by plan/recompute.is_cheap
        if self.cheap and not param.bottom:
            raise LayerError(f"{self.label}: recomputable = True, but a layer without bottoms (a data layer) "
                             f"would draw new data when forward runs again")

    def _call(self, what, *args):
        try:
            return getattr(self.obj, what)(*args)
        except (LayerError, KeyboardInterrupt):
            raise
        except Exception as e:
            raise LayerError(f"{self.label}: {what} raised {type(e).__name__}: {e}") from e

    def setup(self, bottom_shapes):
        dtype = np.float32
        bottoms = RawBlobVec(BlobView(_Shaped(n, s, dtype)) for n, s in zip(self.param.bottom, bottom_shapes))
        # Set up again (its net rebuilt, the object kept): Caffe's Reshape alone, from the tops' bounds
        bounds = self.shapes if self._set_up else [None] * len(self.param.top)
        tops = [_Shaped(n, s, dtype) for n, s in zip(self.param.top, bounds)]
        top_views = RawBlobVec(t.view() for t in tops)
        if not self._set_up:
            self._call("setup", bottoms, top_views)
            self._set_up = True
        self._call("reshape", bottoms, top_views)
        unset = [t.name for t in tops if t.data is None]
        if unset:
            raise self.error(f'reshape did not give top "{unset[0]}" a shape (top[i].reshape(...))')
        self.shapes = [t.shape for t in tops]
        self.initial = [b.data.copy() for b in self.obj.blobs]      # values set in setup
        self.param_shapes = [x.shape for x in self.initial]
        self.backward_needs = ("bottom", "top")
        return self.shapes

    def init_params(self, rng):
        # The object's blobs become views of the pool's parameter tensors, keeping setup's values.
        for blob, init in zip(self.blobs, self.initial):
            blob.data[...] = init
        self.obj.blobs[:] = [BlobView(b) for b in self.blobs]

    def _views(self, blobs):
        return RawBlobVec(BlobView(b) for b in blobs)

    def top_shapes(self, bottom):
        """This forward's top shapes: the object's reshape with this forward's bottoms (sncaffe.dynamic
        calls it before forward; forward then does not call reshape again)."""
        tops = [_Shaped(n, s, np.float32) for n, s in zip(self.param.top, self.shapes)]
        self.obj.blobs[:] = [BlobView(b) for b in self.blobs]
        self._call("reshape", self._views(bottom), RawBlobVec(t.view() for t in tops))
        self._reshaped = True
        return [t.shape for t in tops]

    def forward(self, bottom, top):
        self.obj.blobs[:] = [BlobView(b) for b in self.blobs]     # rebound by the memory runtime
        bottoms = self._views(bottom)

        def in_forward(i, blob):
            def reshape(shape):
                if shape == tuple(blob.shape):
                    return
                if self.reshape_top is None:        # run alone (the gradient checker): no net to plan again
                    raise self.error(f'forward reshaped top "{blob.name}" from {tuple(blob.shape)} to {shape} '
                                     f"outside a net")
                self.reshape_top(i, shape)
            return reshape
        tops = RawBlobVec(BlobView(b, in_forward(i, b)) for i, b in enumerate(top))
        if not self._reshaped:          # not run by sncaffe.dynamic just before (the gradient checker)
            self._call("reshape", bottoms, self._views(top))
        self._reshaped = False
        self._call("forward", bottoms, tops)

    def backward(self, top, propagate_down, bottom):
        self.obj.blobs[:] = [BlobView(b) for b in self.blobs]
        self._call("backward", self._views(top), list(propagate_down), self._views(bottom))
