"""A net drawn as Caffe's draw_net.py draws it, through Graphviz.

Layers are boxes saying their name and type (and kernel, stride and pad for
convolution and pooling), coloured by type as in Caffe; blobs are grey
octagons; an edge goes from each bottom blob to its layer and from the layer
to each top, labelled with the batch size or num_output. An in-place layer
reads and writes the same octagon, so it sits on a loop beside its blob (in
Caffe's green). sncaffe's own addition: a layer with a location (the
``location`` field, model parallelism) is outlined in that location's colour,
its top blobs too, with a legend of the locations; the Copy layers that carry
blobs from one location to another (the ones the net itself inserts) are
drawn between them.

``draw(net_param, path, rankdir="LR", phase=None)`` writes .dot (or .gv)
with the ``graphviz`` package alone; .png, .svg, .pdf need Graphviz's ``dot``
program, and without it the error says how to install it.
"""
from __future__ import annotations

import re
from pathlib import Path

from .proto import sncaffe_pb2 as pb
from .prototxt import filter_net, insert_copies, upgrade_inputs

# Caffe's python/caffe/draw.py styles.
LAYER_STYLE = {"shape": "record", "style": "filled"}
NEURON_FILL = "#90EE90"                  # in-place layers
BLOB_STYLE = {"shape": "octagon", "style": "filled", "fillcolor": "#E0E0E0"}
TYPE_FILL = {"Convolution": "#FF5050", "Deconvolution": "#FF5050", "Pooling": "#FF9900",
             "InnerProduct": "#CC33FF"}
DEFAULT_FILL = "#6495ED"
COPY_FILL = "#FFFFFF"
# One colour per location, in order of first appearance (ColorBrewer Dark2).
LOCATION_COLORS = ("#1B9E77", "#D95F02", "#7570B3", "#E7298A", "#66A61E", "#E6AB02", "#A6761D", "#666666")
BATCHED = {"Data": "data_param", "ImageData": "image_data_param", "HDF5Data": "hdf5_data_param",
           "MemoryData": "memory_data_param", "WindowData": "window_data_param"}
POOL_NAMES = {v: k for k, v in pb.PoolingParameter.PoolMethod.items()}


def _first(values, default):
    return values[0] if len(values) else default


def layer_label(layer, separator) -> str:
    """Caffe's get_layer_label: name, (type), and kernel, stride, pad for convolution and pooling."""
    if layer.type in ("Convolution", "Deconvolution"):
        c = layer.convolution_param
        kernel = f"{c.kernel_h}x{c.kernel_w}" if c.kernel_h else _first(c.kernel_size, 1)
        stride = f"{c.stride_h}x{c.stride_w}" if c.stride_h else _first(c.stride, 1)
        pad = f"{c.pad_h}x{c.pad_w}" if c.pad_h or c.pad_w else _first(c.pad, 0)
        parts = [layer.name, f"({layer.type})", f"kernel size: {kernel}", f"stride: {stride}", f"pad: {pad}"]
    elif layer.type == "Pooling":
        q = layer.pooling_param
        kernel = "global" if q.global_pooling else (f"{q.kernel_h}x{q.kernel_w}" if q.kernel_h else q.kernel_size)
        stride = f"{q.stride_h}x{q.stride_w}" if q.stride_h else q.stride
        pad = f"{q.pad_h}x{q.pad_w}" if q.pad_h or q.pad_w else q.pad
        parts = [layer.name, f"({POOL_NAMES.get(q.pool, q.pool)} {layer.type})", f"kernel size: {kernel}",
                 f"stride: {stride}", f"pad: {pad}"]
    else:
        parts = [layer.name, f"({layer.type})"]
    if layer.location:
        parts.append(f"@ {layer.location}")
    return separator.join(_escape(p) for p in parts)


def edge_label(layer) -> str | None:
    """Caffe's get_edge_label: the batch size out of a data layer, num_output out of conv and inner product."""
    if layer.type in BATCHED:
        return f"Batch {getattr(layer, BATCHED[layer.type]).batch_size}"
    if layer.type in ("Convolution", "Deconvolution"):
        return str(layer.convolution_param.num_output)
    if layer.type == "InnerProduct":
        return str(layer.inner_product_param.num_output)
    return None


def _escape(text: str) -> str:
    """Characters that mean fields in a record label, taken literally."""
    return re.sub(r"([{}|<>\\])", r"\\\1", str(text))


def _graphviz():
    try:
        import graphviz
    except ImportError as e:
        raise RuntimeError(f"sncaffe draw needs the graphviz package, which cannot be imported ({e}): "
                           "pip install graphviz") from None
    return graphviz


def net_to_graph(param, rankdir="LR", phase=None):
    """A ``graphviz.Digraph`` of ``param``: every layer, or those of ``phase`` (TRAIN/TEST) only."""
    graphviz = _graphviz()
    net = upgrade_inputs(param)
    if phase is not None:
        net = filter_net(net, phase)
    if any(layer.location for layer in net.layer):
        net = insert_copies(net)
    separator = " " if rankdir in ("TB", "BT") else r"\n"
    g = graphviz.Digraph(net.name or "Net", graph_attr={"rankdir": rankdir})
    locations, blob_ids = {}, {}

    def blob(name, location=""):
        """The blob's node id; drawn when first seen, outlined again by a located producer."""
        new = name not in blob_ids
        if new:
            blob_ids[name] = f"blob{len(blob_ids)}"
        if new or location:
            outline = {"color": locations[location], "penwidth": "3"} if location else {}
            g.node(blob_ids[name], label=name, **BLOB_STYLE, **outline)
        return blob_ids[name]

    for i, layer in enumerate(net.layer):
        if layer.location and layer.location not in locations:
            locations[layer.location] = LOCATION_COLORS[len(locations) % len(LOCATION_COLORS)]
        inplace = len(layer.bottom) == 1 and len(layer.top) == 1 and layer.bottom[0] == layer.top[0]
        fill = (NEURON_FILL if inplace else COPY_FILL if layer.type == "Copy"
                else TYPE_FILL.get(layer.type, DEFAULT_FILL))
        attrs = dict(LAYER_STYLE, fillcolor=fill)
        if layer.location:
            attrs.update(color=locations[layer.location], penwidth="3")
        node = f"layer{i}"
        g.node(node, label=layer_label(layer, separator), **attrs)
        for bottom in layer.bottom:
            g.edge(blob(bottom), node)
        label = edge_label(layer)
        for top in layer.top:
            g.edge(node, blob(top, layer.location), **({"label": label} if label else {}))
    if locations:
        with g.subgraph(name="cluster_locations", graph_attr={"label": "locations"}) as legend:
            for k, (where, color) in enumerate(locations.items()):
                legend.node(f"location{k}", label=where, shape="box", color=color, penwidth="3")
            if not all(layer.location for layer in net.layer):
                legend.node("location_none", label="none: the net's device", shape="box")
    return g


def draw(param, path, rankdir="LR", phase=None) -> str:
    """Write the drawing of ``param`` to ``path``: .dot/.gv as text, else rendered by ``dot`` in the
    format the suffix names (png, svg, pdf, ...). Returns the path."""
    path = Path(path)
    g = net_to_graph(param, rankdir, phase)
    fmt = path.suffix.lower().lstrip(".")
    if fmt in ("dot", "gv"):
        path.write_text(g.source)
        return str(path)
    graphviz = _graphviz()
    if fmt not in graphviz.FORMATS:
        raise ValueError(f"{path}: unknown drawing format {fmt!r}; use .dot, .png, .svg or .pdf")
    try:
        data = g.pipe(format=fmt)
    except graphviz.ExecutableNotFound:
        raise RuntimeError(f"{path}: drawing {fmt.upper()} needs Graphviz's dot program, which is not "
                           "installed (Debian/Ubuntu: apt-get install graphviz; macOS: brew install graphviz; "
                           "conda: conda install graphviz); a .dot file needs nothing more") from None
    path.write_bytes(data)
    return str(path)
