"""pycaffe's Net over sncaffe.Net: pycaffe's signatures, return types and introspection.

Memory: by default (``memory="none"``) every blob keeps its block, so
``net.blobs[name].data`` is readable after ``forward()`` as pycaffe users
expect. Under a constrained mode (``liveness``, ``offload``, ``recompute``,
``all``, ``auto``) only the net's inputs, outputs and the blobs named in
``keep=[...]`` stay (``keep=True``: all); the plan counts them as persistent.
``forward(start=, end=)`` and ``backward(start=, end=)`` replay the planned
schedule's memory instructions in full and run only the chosen layers. After an
input blob's ``reshape``, a forward sets up only the layers up to its end for
the new shapes (as Caffe's Forward reshapes the layers it runs); the layers
after keep their shapes until a forward runs them. Python layers keep their
objects through a reshape, as Caffe keeps its layers.
"""
from __future__ import annotations

import contextlib
import weakref
from collections import OrderedDict
from pathlib import Path

import numpy as np

from .. import net as _sn
from ..dynamic import Grown
from ..layers.python_layer import BlobVec, BlobView
from ..layers.structure import transfer
from ..proto import sncaffe_pb2 as pb
from ..prototxt import _phase, read_text, upgrade_inputs
from .. import hdf5_weights as hdf5
from ..upgrade import upgrade_net
from . import mode as _caffe


class KeptNet(_sn.Net):
    """sncaffe.Net whose plan keeps the blobs named in ``keep`` alive across the pass."""

    def __init__(self, *args, keep=(), **kw):
        self._keep = keep
        super().__init__(*args, **kw)

    def _make_plan(self, *args, **kw):
        self.graph.keep = frozenset(self.graph.blobs) if self._keep is True else frozenset(self._keep or ())
        return super()._make_plan(*args, **kw)


def _install_callbacks(sn_net):
    """Run ``sn_net.pycaffe_callbacks`` around every operator the executor runs (the executor's
    ``run_op`` is where each layer's forward or backward starts; recomputations are skipped)."""
    run_op = sn_net.executor.run_op
    index = {n.name: i for i, n in enumerate(sn_net.graph.layers)}

    def with_callbacks(op, recompute=False, *args):
        i = None if recompute else index.get(getattr(op.node, "name", None))
        callbacks = sn_net.pycaffe_callbacks
        if i is not None:
            for run in callbacks.get(f"before_{op.kind}", ()):
                run(i)
        try:
            run_op(op, recompute, *args)
        except Grown:               # the layer ran; the net plans again before the next one
            for run in callbacks.get(f"after_{op.kind}", ()) if i is not None else ():
                run(i)
            raise
        if i is not None:
            for run in callbacks.get(f"after_{op.kind}", ()):
                run(i)
    sn_net.executor.run_op = with_callbacks


def _check_param_shapes(old, new):
    """A layer whose parameters the new input shapes would change (an InnerProduct after a larger
    image): Caffe's own check, before the old net is let go."""
    for node in new.graph.layers:
        mine = [tuple(d.shape) for d, _ in node.params]
        theirs = [tuple(b.data.shape) for b in old.params.get(node.name, [])]
        if theirs and mine != theirs:
            bottoms = ", ".join(f'"{b.name}" {tuple(b.shape)}' for b in node.bottoms)
            raise ValueError(f'layer "{node.name}" ({node.type}): the new input shapes give it bottoms {bottoms}, '
                             f"which need parameters of shapes {mine}, not its {theirs}; forward(end=...) "
                             f"reshapes only the layers up to the end it is given")


class Blob(BlobView):
    """A net's blob: reads through the net, so it stays valid when the net is rebuilt."""

    def __init__(self, pynet, name, get, shape):
        self._pynet, self._name, self._get, self._shape = pynet, name, get, shape

    @property
    def _blob(self):
        return self._get()

    @property
    def data(self):
        staged = self._pynet._staged.get(self._name)
        return staged if staged is not None else self._get().data

    @property
    def shape(self):
        staged = self._pynet._staged.get(self._name)
        if staged is not None:
            return tuple(staged.shape)
        data = self._get().data         # this forward's shape where a layer reshaped it (sncaffe.dynamic)
        return tuple(data.shape) if data is not None else tuple(self._shape())

    def reshape(self, *shape):
        shape = tuple(int(d) for d in (shape[0] if len(shape) == 1 and not np.isscalar(shape[0]) else shape))
        self._pynet._stage_reshape(self._name, shape)


class _LayerView:
    """pycaffe's Layer of a built-in type: ``type`` and ``blobs``."""

    def __init__(self, pynet, name, type_):
        self._pynet, self.name, self.type = pynet, name, type_

    @property
    def blobs(self):
        return self._pynet.params.get(self.name, [])

    def __repr__(self):
        return f"<Layer {self.name!r} ({self.type})>"


def _parse_args(args, kwargs):
    """pycaffe's Net(file, phase), Net(file, weights, phase), Net(file, phase, weights=, level=, stages=)."""
    weights, phase = kwargs.pop("weights", None), kwargs.pop("phase", None)
    args = list(args)
    if args and isinstance(args[0], (str, Path)) and not (str(args[0]).upper() in ("TRAIN", "TEST")):
        weights = args.pop(0)        # the deprecated Net(file, weights, phase)
    if args:
        phase = args.pop(0)
    if args:
        raise TypeError("Net(network_file, phase, level=0, stages=None, weights=None), "
                        "or Net(network_file, weights, phase)")
    if phase is None:
        raise TypeError("Net() needs a phase: caffe.TRAIN or caffe.TEST")
    return weights, _phase(phase)


class Net:
    def __init__(self, network_file, *args, level=0, stages=None, memory="none", keep=(), **kwargs):
        weights, phase = _parse_args(args, kwargs)
        if kwargs:
            raise TypeError(f"Net() got unexpected keyword arguments: {', '.join(kwargs)}")
        if isinstance(network_file, pb.NetParameter):
            raw = network_file
        else:
            raw = read_text(network_file, pb.NetParameter())
        self._raw = upgrade_inputs(upgrade_net(raw))
        self._opts = dict(phase=phase, stages=list(stages or ()), level=level, memory=memory, keep=keep)
        self._bind(self._build(self._raw))
        unknown = [] if keep is True else [b for b in keep or () if b not in self._net.blobs]
        if unknown:
            raise ValueError(f'keep: no blob "{unknown[0]}" in net "{self.name}"')
        if weights is not None:
            self.copy_from(str(weights))

    @classmethod
    def _wrap(cls, sn_net, raw=None):
        """A pycaffe Net over an existing sncaffe.Net (a solver's)."""
        self = cls.__new__(cls)
        self._raw = raw
        self._opts = dict(phase=sn_net.phase)
        self._bind(sn_net)
        return self

    def _build(self, raw, **kw):
        o = self._opts
        return KeptNet(raw, o["phase"], device=_caffe.device(), stages=o["stages"], level=o["level"] or None,
                       seed=_caffe.seed(), memory=o["memory"], keep=o["keep"], **kw)

    def _bind(self, sn_net, shaped=None):
        """Wrap ``sn_net``; ``shaped``: the index of the last layer set up for the current input
        shapes (None: all of them), the layers after it set up for ``_setup_shapes``."""
        if sn_net is not getattr(self, "_net", None):       # weakly: the net must not keep this view alive
            replanned = weakref.WeakMethod(self._replanned)
            sn_net.replan_hooks.append(lambda: replanned() and replanned()())
        self._net = sn_net
        self._staged = {}
        self._forwarded = False
        self._index = {n.name: i for i, n in enumerate(sn_net.graph.layers)}
        self._shaped = len(self._index) - 1 if shaped is None else shaped
        earlier = getattr(self, "_setup_shapes", {})
        self._setup_shapes = {n.name: earlier[n.name] if i > self._shaped else [tuple(b.shape) for b in n.bottoms]
                              for i, n in enumerate(sn_net.graph.layers)}
        self._blobs = OrderedDict((name, Blob(self, name, lambda n=name: self._net.blobs[n],
                                               lambda n=name: self._net.graph.blobs[n].shape))
                                  for name in sn_net.blobs)
        params = OrderedDict()
        for node in sn_net.graph.layers:
            if node.layer.blobs:
                params[node.name] = BlobVec(Blob(self, f"{node.name}[{i}]", lambda l=node.layer, i=i: l.blobs[i],
                                                 lambda node=node, i=i: node.params[i][0].shape)
                                            for i in range(len(node.layer.blobs)))
        self._params = params

    def _replanned(self):
        """``_net`` was planned again in the middle of a forward (a top outgrew its block): the
        views of its new layers, its callbacks on its new executor."""
        forwarded = self._forwarded
        self._bind(self._net, self._shaped)
        self._forwarded = forwarded
        if self._net.__dict__.get("pycaffe_callbacks"):
            _install_callbacks(self._net)

    # -- pycaffe's properties -------------------------------------------------
    @property
    def blobs(self):
        return self._blobs

    @property
    def params(self):
        return self._params

    @property
    def _layer_names(self):
        return [n.name for n in self._net.graph.layers]

    @property
    def _blob_names(self):
        return list(self._net.blobs)

    @property
    def layers(self):
        out = []
        for n in self._net.graph.layers:
            obj = getattr(n.layer, "obj", None)      # a Python layer is its own object, as in pycaffe
            out.append(obj if obj is not None else _LayerView(self, n.name, n.type))
        return _caffe.LayerVec(out)

    @property
    def layer_dict(self):
        return OrderedDict(zip(self._layer_names, self.layers))

    @property
    def top_names(self):
        return OrderedDict((n.name, [t.name for t in n.tops]) for n in self._net.graph.layers)

    @property
    def bottom_names(self):
        return OrderedDict((n.name, [b.name for b in n.bottoms]) for n in self._net.graph.layers)

    @property
    def blob_loss_weights(self):
        weights = OrderedDict((name, 0.0) for name in self._net.blobs)
        for n in self._net.graph.layers:
            for w, t in zip(n.loss_weights, n.tops):
                if w:
                    weights[t.name] = w
        return weights

    @property
    def inputs(self):
        return list(self._net.inputs)

    @property
    def outputs(self):
        return list(self._net.outputs)

    @property
    def phase(self):
        return self._net.phase

    @property
    def name(self):
        return self._net.name

    @property
    def memory_plan(self):
        """sncaffe's Plan for this net (mode, peak, persistent tensors)."""
        return self._net.plan

    # -- weights ----------------------------------------------------------------
    def copy_from(self, filename):
        """Caffe's CopyTrainedLayersFrom: a .caffemodel, or HDF5 weights (told apart as Caffe does)."""
        self._net.copy_from(str(filename))

    def save(self, filename):
        self._net.save(str(filename))

    def save_hdf5(self, filename):
        """Caffe's Net::ToHDF5: the parameters as ``data/<layer>/<index>`` datasets."""
        hdf5.save(self._net, filename)

    def load_hdf5(self, filename):
        hdf5.load(self._net, filename)

    def set_input_arrays(self, data, labels):
        """Hand arrays to the net's first layer, a MemoryData layer, without copying them (pycaffe's
        checks: float32, C-contiguous, 4-D, the layer's channels/height/width; labels 1-D or 4-D)."""
        if labels.ndim == 1:
            labels = np.ascontiguousarray(labels[:, np.newaxis, np.newaxis, np.newaxis])
        return self._set_input_arrays(data, labels)

    def _set_input_arrays(self, data, labels):
        layer = self._net.graph.layers[0].layer
        if layer.type != "MemoryData":
            raise RuntimeError("set_input_arrays may only be called if the first layer is a MemoryDataLayer "
                               f'(layer "{layer.name}" is {layer.type})')
        _, channels, height, width = layer.shape
        for arr, what, dims in ((data, "data array", (channels, height, width)), (labels, "labels array", (1, 1, 1))):
            if not isinstance(arr, np.ndarray) or not arr.flags.c_contiguous:
                raise RuntimeError(f"{what} must be C contiguous")
            if arr.ndim != 4:
                raise RuntimeError(f"{what} must be 4-d")
            if arr.dtype != np.float32:
                raise RuntimeError(f"{what} must be float32")
            for axis, want, name in zip((1, 2, 3), dims, ("channels", "height", "width")):
                if arr.shape[axis] != want:
                    raise RuntimeError(f"{what} has wrong {name} ({arr.shape[axis]}; the layer has {want})")
        if data.shape[0] != labels.shape[0]:
            raise RuntimeError("data and labels must have the same first dimension")
        if data.shape[0] % layer.shape[0] != 0:
            raise RuntimeError(f"first dimensions of input arrays must be a multiple of batch size "
                               f"({data.shape[0]} items, batch {layer.shape[0]})")
        layer.reset(data, labels)

    # -- callbacks (pycaffe's Net.before_forward ... after_backward) ----------------
    def before_forward(self, run):
        """Call ``run(layer_index)`` before each layer's forward (never for a recomputation)."""
        self._add_callback("before_forward", run)

    def after_forward(self, run):
        self._add_callback("after_forward", run)

    def before_backward(self, run):
        """Call ``run(layer_index)`` before the backward of each layer that has one."""
        self._add_callback("before_backward", run)

    def after_backward(self, run):
        self._add_callback("after_backward", run)

    def _add_callback(self, when, run):
        callbacks = self._net.__dict__.setdefault("pycaffe_callbacks", {})
        if not callbacks:
            _install_callbacks(self._net)
        callbacks.setdefault(when, []).append(run)

    def share_with(self, other):
        """Caffe's ShareTrainedLayersWith: layers named alike use ``other``'s parameter arrays."""
        from ..layers.base import Blob as SnBlob
        src = other._net if isinstance(other, Net) else other
        self._net.__dict__.setdefault("shares_from", []).append(src)   # its blocks stay while these views do
        for node in self._net.graph.layers:
            theirs = src.params.get(node.name)
            mine = node.layer.blobs
            if not mine or theirs is None:
                continue
            if len(mine) != len(theirs) or any(a.shape != b.shape for a, b in zip(mine, theirs)):
                raise ValueError(f'layer "{node.name}": parameters {[b.shape for b in mine]} here, '
                                 f"{[b.shape for b in theirs]} in the other net: they cannot be shared")
            for j, b in enumerate(theirs):
                mine[j] = SnBlob(mine[j].name, b.data, mine[j].diff)

    def clear_param_diffs(self):
        self._net.clear_param_diffs()

    # -- reshaping --------------------------------------------------------------
    def _stage_reshape(self, name, shape):
        if name not in self.inputs:
            raise ValueError(f'blob "{name}" is not an input of the net ({", ".join(self.inputs) or "none"}): '
                             f"only input blobs can be reshaped; the others follow in net.reshape()")
        if shape == tuple(self._net.blobs[name].shape) and name not in self._staged:
            return
        self._staged[name] = np.zeros(shape, np.float32)    # host staging until the net is re-planned

    def reshape(self):
        """Re-plan the net for the input shapes set with ``blob.reshape``; parameters are kept."""
        self._reshape(len(self._index) - 1)

    def _reshape(self, upto):
        """Caffe reshapes the layers a forward runs: those up to index ``upto`` are set up for the
        input shapes staged with ``blob.reshape``, the layers after keep the shapes they were set up
        for (their bottoms' shapes then, recorded in ``_setup_shapes``), and the plan is made for
        both. A later forward that runs them sets them up again."""
        if not self._staged and upto <= self._shaped:
            return
        if self._raw is None:
            raise ValueError("this net belongs to a solver: its inputs cannot be reshaped")
        shapes = {n: tuple(self._net.blobs[n].shape) for n in self.inputs}
        shapes.update((n, a.shape) for n, a in self._staged.items())
        raw = pb.NetParameter()
        raw.CopyFrom(self._raw)
        for lp in raw.layer:
            if lp.type == "Input" and any(t in shapes for t in lp.top):
                old = list(lp.input_param.shape)
                del lp.input_param.shape[:]
                for j, t in enumerate(lp.top):
                    dims = shapes.get(t, old[j if len(old) > 1 else 0].dim)
                    lp.input_param.shape.add().dim.extend(int(d) for d in dims)
        old, staged = self._net, self._staged
        kept_shapes = {n.name: self._setup_shapes[n.name] for n in old.graph.layers[upto + 1:]}
        # Python layers keep their objects (their state, the bounds their tops grew to), as in Caffe
        reuse = {n.name: (n.layer, [tuple(b.shape) for b in n.bottoms], [tuple(t.shape) for t in n.tops])
                 for n in old.graph.layers if n.type == "Python"}
        try:
            new = self._build(raw, defer=True, setup_shapes=kept_shapes, reuse=reuse)   # the graph only: the old net
            _check_param_shapes(old, new)                                   # stays usable where this fails
        except BaseException:
            self._staged = {}           # the inputs as they were, with the net
            raise
        params = {name: [np.array(b.data) for b in blobs] for name, blobs in old.params.items()}
        inputs = {n: np.array(old.blobs[n].data) for n in self.inputs}
        old.release()
        try:
            new.place(new.make_plan())
        except BaseException:           # the net as it was (the same plan fits again), then the error
            self._bind(self._build(self._raw, reuse=reuse))
            self._refill(old, params, inputs)
            raise
        self._raw = raw
        self._bind(new, upto if kept_shapes else None)
        self._refill(old, params, {n: a for n, a in inputs.items() if n not in staged} | staged)

    def _refill(self, old, params, inputs):
        """Give the rebuilt net ``old``'s callbacks, parameters and input values."""
        callbacks = old.__dict__.get("pycaffe_callbacks")
        if callbacks:                   # the rebuilt net calls them too
            self._net.pycaffe_callbacks = callbacks
            _install_callbacks(self._net)
        for name, arrays in params.items():
            for blob, a in zip(self._net.params.get(name, []), arrays):
                transfer(blob.data, a)
        for n, a in inputs.items():
            transfer(self._net.blobs[n].data, a)

    # -- running ------------------------------------------------------------------
    def _select(self, instrs, lo, hi):
        """Every memory instruction; of the runs, those of layers lo..hi (and every recomputation)."""
        return [ins for ins in instrs if ins.kind != "run" or ins.recompute
                or lo <= self._index[ins.op.node.name] <= hi]

    @contextlib.contextmanager
    def _fusions(self, kind, lo, hi):
        """Fused layers (graph.Fusion, graph.EltwiseReLU) run as one only where both are in the pass."""
        self._set_fusions(kind, lo, hi)
        try:
            yield
        finally:
            for f in self._net.graph.fusions:       # the graph's now (a net planned again has new ones)
                setattr(f, kind, f.on(kind))

    def _set_fusions(self, kind, lo, hi):
        for f in self._net.graph.fusions:
            setattr(f, kind, f.on(kind) and lo <= self._index[f.first.name] and self._index[f.last.name] <= hi)

    def _forward(self, start, end):
        self._reshape(end)
        net = self._net
        if net.executor.busy:
            net.executor.reset()        # the last forward had no backward
        def select(schedule):           # also the rest of a pass planned again: its graph's fused layers
            self._set_fusions("forward", start, end)
            return self._select(schedule.forward, start, end)
        with self._fusions("forward", start, end):
            net.execute(select)
        self._forwarded = True

    def _backward(self, start, end):
        net = self._net
        if start > self._shaped:
            names = list(self._index)
            raise RuntimeError(f'backward from layer "{names[start]}": the layers after "{names[self._shaped]}" '
                               f"keep the input shapes of an earlier forward (the last forward ended there); "
                               f"run forward through them first")
        if net.plan.mode != "none" and not self._forwarded:
            raise RuntimeError(f"backward() needs a forward() first in memory mode {net.plan.mode!r}")
        with self._fusions("backward", end, start):
            net.executor.execute(self._select(net.plan.schedule.backward, end, start))
        net.executor.reset()
        self._forwarded = False

    def _layer_index(self, name):
        try:
            return self._index[name]
        except KeyError:
            raise ValueError(f'no layer "{name}" in net "{self.name}"') from None

    def forward(self, blobs=None, start=None, end=None, **kwargs):
        """Run the layers start..end (names); kwargs fill input blobs. Returns {blob: data} of the
        net's outputs (or end's tops) and ``blobs``."""
        blobs = list(blobs or [])
        start_ind = self._layer_index(start) if start is not None else 0
        if end is not None:
            end_ind = self._layer_index(end)
            outputs = set(self.top_names[end] + blobs)
        else:
            end_ind = len(self._index) - 1
            outputs = set(self.outputs + blobs)
        if kwargs:
            if set(kwargs) != set(self.inputs):
                raise Exception("Input blob arguments do not match net inputs.")
            for name, value in kwargs.items():
                if value.shape[0] != self.blobs[name].shape[0]:
                    raise Exception("Input is not batch sized")
                self.blobs[name].data[...] = value
        self._forward(start_ind, end_ind)
        return {out: self.blobs[out].data for out in outputs}

    def backward(self, diffs=None, start=None, end=None, **kwargs):
        """Run backward from layer ``start`` down to ``end``; kwargs set output diffs. Returns
        {blob: diff} of the net's inputs (or end's bottoms) and ``diffs``."""
        diffs = list(diffs or [])
        start_ind = self._layer_index(start) if start is not None else len(self._index) - 1
        if end is not None:
            end_ind = self._layer_index(end)
            outputs = set(self.bottom_names[end] + diffs)
        else:
            end_ind = 0
            outputs = set(self.inputs + diffs)
        self._net._set_loss_diffs()      # loss weights in the loss tops' diffs, as Caffe's setup puts them
        if kwargs:
            if set(kwargs) != set(self.outputs):
                raise Exception("Top diff arguments do not match net outputs.")
            for name, value in kwargs.items():
                if value.shape[0] != self.blobs[name].shape[0]:
                    raise Exception("Diff is not batch sized")
                self.blobs[name].diff[...] = value
        self._backward(start_ind, end_ind)
        return {out: self.blobs[out].diff for out in outputs}

    def forward_backward(self):
        loss = self._net.forward()
        self._net.backward()
        return loss

    def _batch(self, blobs):
        """Batches of the arrays in ``blobs``, the last padded with zeros to the net's batch size."""
        num = len(next(iter(blobs.values())))
        batch_size = next(iter(self.blobs.values())).shape[0]
        remainder = num % batch_size
        for b in range(num // batch_size):
            i = b * batch_size
            yield {name: blobs[name][i:i + batch_size] for name in blobs}
        if remainder > 0:
            padded = {}
            for name in blobs:
                pad = np.zeros((batch_size - remainder,) + blobs[name].shape[1:])
                padded[name] = np.concatenate([blobs[name][-remainder:], pad])
            yield padded

    def forward_all(self, blobs=None, **kwargs):
        """Forward over all of ``kwargs``' items in batches; {blob: array of all items}."""
        all_outs = {out: [] for out in set(self.outputs + list(blobs or []))}
        for batch in self._batch(kwargs):
            for out, value in self.forward(blobs=blobs, **batch).items():
                all_outs[out].extend(value.copy())
        for out in all_outs:
            all_outs[out] = np.asarray(all_outs[out])
        pad = len(next(iter(all_outs.values()))) - len(next(iter(kwargs.values())))
        if pad:
            for out in all_outs:
                all_outs[out] = all_outs[out][:-pad]
        return all_outs

    def forward_backward_all(self, blobs=None, diffs=None, **kwargs):
        """forward_all and backward over every batch: (outputs, input diffs)."""
        all_outs = {out: [] for out in set(self.outputs + list(blobs or []))}
        all_diffs = {d: [] for d in set(self.inputs + list(diffs or []))}
        forward_batches = self._batch({n: kwargs[n] for n in self.inputs if n in kwargs})
        backward_batches = self._batch({n: kwargs[n] for n in self.outputs if n in kwargs})
        for fb, bb in zip(forward_batches, backward_batches):
            batch_blobs = self.forward(blobs=blobs, **fb)
            batch_diffs = self.backward(diffs=diffs, **bb)
            for out, out_blobs in batch_blobs.items():
                all_outs[out].extend(out_blobs.copy())
            for d, d_blobs in batch_diffs.items():
                all_diffs[d].extend(d_blobs.copy())
        pad = len(all_outs[next(iter(all_outs))]) - len(next(iter(kwargs.values())))
        for table in (all_outs, all_diffs):
            for k in table:
                table[k] = np.asarray(table[k])[:len(table[k]) - pad]
        return all_outs, all_diffs
