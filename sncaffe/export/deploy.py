"""The part of a net an export carries, as a user deploying it expects:

- data layers (Input, Data, ImageData, HDF5Data, MemoryData, WindowData, and the forks'
  DenseImageData and AnnotatedData) become inputs, only for the tops a kept layer reads (a
  label read only by a loss is no input);
- loss layers (every ``*Loss`` type: MultiBoxLoss and SmoothL1Loss too), Accuracy,
  DetectionEvaluate and Silence are dropped;
- the outputs are the blobs that no kept layer reads (a loss's logits become one).
"""
from __future__ import annotations

from ..proto import sncaffe_pb2 as pb
from ..prototxt import DATA_LAYERS as BVLC_DATA_LAYERS
from ..prototxt import PrototxtError, filter_net, prepare_net, read_text, set_batch, upgrade_inputs
from . import ExportError

DROPPED = ("Accuracy", "DetectionEvaluate", "Silence")
DATA_LAYERS = BVLC_DATA_LAYERS + ("DenseImageData", "AnnotatedData")


def dropped(layer_type: str) -> bool:
    """Whether an export drops layers of this type (losses, Accuracy, DetectionEvaluate, Silence)."""
    return layer_type.endswith("Loss") or layer_type in DROPPED


def _input_shapes(lp) -> list:
    """An Input layer's shape per top (one shape for all tops, or one each)."""
    shapes = [tuple(s.dim) for s in lp.input_param.shape]
    return shapes * len(lp.top) if len(shapes) == 1 else shapes


def deploy_param(param, shapes: dict) -> "pb.NetParameter":
    """A copy of a phase-filtered NetParameter (before Split insertion) without the dropped
    layers, whose data layers are Input layers of the tops kept layers read; ``shapes`` gives
    the data layers' top shapes (blob name -> shape)."""
    out = pb.NetParameter()
    out.CopyFrom(param)
    out.ClearField("state")
    del out.layer[:]
    kept = [lp for lp in param.layer if not dropped(lp.type)]
    read = {b for lp in kept for b in lp.bottom}
    for lp in kept:
        new = out.layer.add()
        new.CopyFrom(lp)
        new.ClearField("include")           # filtered already: a second filter must keep them all
        new.ClearField("exclude")
        if lp.type != "Input" and lp.type not in DATA_LAYERS:
            continue
        own = dict(zip(lp.top, _input_shapes(lp))) if lp.type == "Input" else {}
        tops = [t for t in lp.top if t in read]
        missing = [t for t in tops if t not in own and t not in shapes]
        if missing:
            raise ExportError(f'layer "{lp.name}" ({lp.type}): give the shape of its top "{missing[0]}" '
                              f"(--input {missing[0]}=N,C,H,W)")
        if not tops:
            out.layer.pop()
            continue
        new.CopyFrom(pb.LayerParameter(name=lp.name, type="Input", top=tops))
        for t in tops:
            new.input_param.shape.add().dim.extend(int(d) for d in shapes.get(t, own.get(t)))
    return out


def without_splits(param) -> "pb.NetParameter":
    """A prepared NetParameter with its Split layers removed, their readers reading the split blob."""
    out = pb.NetParameter()
    out.CopyFrom(param)
    del out.layer[:]
    source = {}
    for lp in param.layer:
        if lp.type == "Split" and len(lp.bottom) == 1:
            source.update((t, source.get(lp.bottom[0], lp.bottom[0])) for t in lp.top)
            continue
        new = out.layer.add()
        new.CopyFrom(lp)
        new.bottom[:] = [source.get(b, b) for b in lp.bottom]
    return out


def deploy_net(net):
    """A Net of ``net``'s deploy part with ``net``'s parameters (data tops keep their shapes)."""
    from ..net import Net
    if all(n.type == "Input" or (n.type not in DATA_LAYERS and not dropped(n.type)) for n in net.graph.layers):
        return net              # already a deploy net
    if net.graph.param.layers:
        raise ExportError("a V1 net: upgrade it first (sncaffe upgrade)")
    shapes = {name: b.shape for name, b in net.graph.blobs.items()}
    out = Net(deploy_param(without_splits(net.graph.param), shapes), net.phase, seed=net.seed)
    out.copy_from(net.to_proto())
    return out


def _data_shapes(param, phase, wanted) -> dict:
    """The shapes the data layers' own setup finds for the ``wanted`` tops (a first record read)."""
    from ..graph import build_graph
    tiny = pb.NetParameter(name=param.name)
    for lp in param.layer:
        if lp.type in DATA_LAYERS and set(lp.top) & wanted:
            tiny.layer.add().CopyFrom(lp)
    try:
        graph = build_graph(prepare_net(tiny, phase), phase)
    except (ValueError, OSError) as e:
        raise ExportError(f"{' '.join(str(e).split())}; without the data, give the input shapes "
                          f"(--input {sorted(wanted)[0]}=N,C,H,W)") from None
    for node in graph.layers:
        if hasattr(node.layer, "close"):
            node.layer.close()
    return {t: graph.blobs[t].shape for t in wanted}


def load(path, phase="TEST", stages=(), level=None, weights=None, shapes=None, batch=None, seed=0,
         force_backward=False):
    """The deploy Net of a net prototxt for ``phase`` and ``stages``, with ``weights`` (a
    .caffemodel) or else its fillers' values. ``shapes``: data tops' shapes (blob -> shape);
    tops not given are read from the data layers' sources."""
    from ..net import Net
    from ..upgrade import upgrade_net
    param = upgrade_net(read_text(path, pb.NetParameter()), str(path))
    if param.layers:
        raise ExportError(f"{path}: a V1 net that could not be upgraded")
    param = filter_net(upgrade_inputs(param), phase, stages, level)
    if batch:
        param = set_batch(param, batch)
    if not param.layer:
        raise PrototxtError(f"{path}: the net has no layers")
    shapes = dict(shapes or {})
    read = {b for lp in param.layer if not dropped(lp.type) for b in lp.bottom}
    wanted = {t for lp in param.layer if lp.type in DATA_LAYERS for t in lp.top if t in read} - set(shapes)
    if wanted:
        found = _data_shapes(param, phase, wanted)
        shapes.update((t, (batch,) + tuple(s[1:]) if batch else s) for t, s in found.items())
    param = deploy_param(param, shapes)
    param.force_backward = param.force_backward or force_backward
    return Net(param, phase, weights=weights, seed=seed)
