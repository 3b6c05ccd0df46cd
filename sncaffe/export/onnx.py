"""A deploy net (deploy.py) as an ONNX graph, written with the onnx package's helpers.

Shapes are static: the batch size is the net's (``sncaffe export --batch``). Each layer
becomes one or a few ONNX operators named after it; a blob rewritten in place gets a new
value per write (``blob/layer``), its last write the blob's own name.
"""
from __future__ import annotations

import math

import numpy as np

from . import ExportError
from . import geometry as g

OPSET = 18
MAPS = {}       # layer type -> fn(builder, node) -> the tops' values


maps = g.registrar(MAPS)


class Builder:
    """The ONNX nodes and initializers of a net, built a layer at a time."""

    def __init__(self, net):
        from onnx import helper
        self.helper, self.net = helper, net
        self.nodes, self.inits, self.value = [], [], {}      # value: blob name -> current ONNX value
        self.taken = set()
        self.last_writer = {}
        for node in net.graph.layers:
            for t in node.tops:
                self.last_writer[t.name] = node.name
        self.outputs = set(net.outputs)

    def fresh(self, base) -> str:
        name, k = base, 1
        while name in self.taken:
            name, k = f"{base}_{k}", k + 1
        self.taken.add(name)
        return name

    def const(self, node, what, array) -> str:
        from onnx import numpy_helper
        name = self.fresh(f"{node.name}/{what}")
        self.inits.append(numpy_helper.from_array(np.ascontiguousarray(array), name))
        return name

    def scalar(self, node, what, v) -> str:
        return self.const(node, what, np.array(v, np.float32))

    def ints(self, node, what, v) -> str:
        return self.const(node, what, np.array(v, np.int64))

    def op(self, node, op_type, inputs, n_out=1, **attrs):
        """Add an operator; its output value(s), named after the layer."""
        outs = [self.fresh(f"{node.name}/{op_type}") for _ in range(n_out)]
        self.nodes.append(self.helper.make_node(op_type, inputs, outs, name=self.fresh(f"{node.name}:{op_type}"),
                                                **attrs))
        return outs[0] if n_out == 1 else outs

    def bottom(self, node, i=0) -> str:
        return self.value[node.bottoms[i].name]

    def top_name(self, node, i) -> str:
        blob = node.tops[i].name
        if self.last_writer[blob] == node.name and blob not in self.taken:
            self.taken.add(blob)
            return blob
        return self.fresh(f"{blob}/{node.name}")

    def add_layer(self, node):
        first = len(self.nodes)
        tops = MAPS[node.type](self, node)
        producers = {out: n for n in self.nodes[first:] for out in n.output}
        for i, v in enumerate(tops):
            blob = node.tops[i].name
            if v in producers:              # made by this layer: renamed to the top's name
                name = self.top_name(node, i)
                n = producers[v]
                n.output[list(n.output).index(v)] = name
                self.taken.discard(v)
                v = name
            elif blob in self.outputs and self.last_writer[blob] == node.name:
                v = self.identity(node, v, i)       # an alias that is an output gets its own value
            self.value[blob] = v

    def identity(self, node, v, i):
        name = self.top_name(node, i)
        self.nodes.append(self.helper.make_node("Identity", [v], [name], name=self.fresh(f"{node.name}:Identity")))
        return name


def build(net, opset=OPSET):
    """The ModelProto of a deploy Net; ExportError names the first layer without a mapping."""
    import onnx
    from onnx import TensorProto, helper
    g.check_mapped(net, MAPS, "ONNX")
    b = Builder(net)
    inputs = []
    for node in net.graph.layers:
        if node.type == "Input":
            for t in node.tops:
                b.taken.add(t.name)
                b.value[t.name] = t.name
                inputs.append(helper.make_tensor_value_info(t.name, TensorProto.FLOAT, list(t.shape)))
        else:
            b.add_layer(node)
    outputs = [helper.make_tensor_value_info(b.value[name], TensorProto.FLOAT, list(net.blobs[name].data.shape))
               for name in net.outputs]
    graph = helper.make_graph(b.nodes, net.name or "net", inputs, outputs, b.inits)
    model = helper.make_model(graph, producer_name="sncaffe", opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = min(model.ir_version, 10)       # what current onnxruntime releases read
    model.doc_string = "exported from a Caffe net by sncaffe"
    try:
        onnx.checker.check_model(model)
    except onnx.checker.ValidationError as e:      # a mapping's fault, said without a traceback
        raise ExportError(f"the ONNX graph does not pass onnx's checker: {e}") from None
    return model, {name: b.value[name] for name in net.outputs}


def runner(model, names):
    """inputs dict -> outputs dict by blob name, through onnxruntime on the CPU."""
    import onnxruntime as ort
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])

    def run(inputs):
        values = sess.run(list(names.values()), inputs)
        return dict(zip(names, values))
    return run


def export(net, path=None, rtol=None, seed=0, against=None):
    """Write ``net``'s deploy part to ``path`` (if given) after checking it with onnxruntime
    (unless ``rtol`` is None); (ModelProto, Differences)."""
    from .check import compare
    model, names = build(net)
    diffs = [] if rtol is None else compare(net, runner(model, names), rtol, "the ONNX graph", seed, against)
    if path is not None:
        from ..blobproto import write_atomic
        write_atomic(path, [model.SerializeToString()])
    return model, diffs


# -- vision layers -------------------------------------------------------------------
@maps("Convolution", "Deconvolution", "ConvolutionDepthwise")
def convolution(b, node):
    c = g.conv(node)
    blobs = g.params(node)
    ws = [b.const(node, "weight", blobs[0])] + ([b.const(node, "bias", blobs[1])] if len(blobs) > 1 else [])
    kind = "ConvTranspose" if node.type == "Deconvolution" else "Conv"
    return [b.op(node, kind, [b.bottom(node, i)] + ws, kernel_shape=list(c.kernel), strides=list(c.stride),
                 pads=list(c.pad) * 2, dilations=list(c.dilation), group=c.group)
            for i in range(len(node.bottoms))]


@maps("Pooling")
def pooling(b, node):
    p = g.pool(node)
    x = b.bottom(node)
    if p.is_global:
        return [b.op(node, "GlobalMaxPool" if p.method == "MAX" else "GlobalAveragePool", [x])]
    pads = list(p.pad) + list(p.end_pad)
    onnx_out = [(n + a + e - k) // s + 1 for n, a, e, k, s in zip(node.layer.in_hw, p.pad, p.end_pad, p.kernel, p.stride)]
    if tuple(onnx_out) != tuple(p.out):
        g.refuse(node, f"Caffe's output size {p.out} has no ONNX padding (got {tuple(onnx_out)})")
    attrs = dict(kernel_shape=list(p.kernel), strides=list(p.stride), pads=pads)
    if p.method == "MAX" and len(node.tops) > 1:
        # ONNX's indices run over the whole (N, C, H, W) input, Caffe's mask within each H x W plane
        y, idx = b.op(node, "MaxPool", [x], n_out=2, **attrs)
        plane = b.const(node, "plane", np.array(math.prod(node.layer.in_hw), np.int64))
        return [y, b.op(node, "Cast", [b.op(node, "Mod", [idx, plane])], to=1)]
    if p.method == "MAX":
        return [b.op(node, "MaxPool", [x], **attrs)]
    y = b.op(node, "AveragePool", [x], count_include_pad=1, **attrs)
    if p.divisor is not None:           # windows clipped at the padded end: Caffe divides by fewer
        y = b.op(node, "Mul", [y, b.const(node, "window", (math.prod(p.kernel) / p.divisor)[None, None])])
    return [y]


@maps("LRN")
def lrn(b, node):
    lp = node.layer.param.lrn_param
    x, n = b.bottom(node), lp.local_size
    if lp.norm_region == lp.ACROSS_CHANNELS:
        return [b.op(node, "LRN", [x], size=n, alpha=lp.alpha, beta=lp.beta, bias=lp.k)]
    # WITHIN_CHANNEL: x (1 + alpha mean(x^2 over n x n, zero padding counted))^-beta; k is not used.
    pre = (n - 1) // 2
    sq = b.op(node, "Mul", [x, x])
    mean = b.op(node, "AveragePool", [sq], kernel_shape=[n, n], strides=[1, 1],
                pads=[pre, pre, n - 1 - pre, n - 1 - pre], count_include_pad=1)
    base = b.op(node, "Add", [b.op(node, "Mul", [mean, b.scalar(node, "alpha", lp.alpha)]), b.scalar(node, "one", 1)])
    return [b.op(node, "Mul", [x, b.op(node, "Pow", [base, b.scalar(node, "beta", -lp.beta)])])]


@maps("InnerProduct")
def inner_product(b, node):
    p = node.layer.param.inner_product_param
    axis = g.canonical(p.axis, len(node.bottoms[0].shape))
    blobs = g.params(node)
    flat = b.op(node, "Flatten", [b.bottom(node)], axis=axis)
    ins = [flat, b.const(node, "weight", blobs[0])] + ([b.const(node, "bias", blobs[1])] if len(blobs) > 1 else [])
    y = b.op(node, "Gemm", ins, transB=0 if p.transpose else 1)
    return [reshape_to(b, node, y, node.tops[0].shape) if len(node.tops[0].shape) != 2 else y]


def reshape_to(b, node, x, shape):
    return b.op(node, "Reshape", [x, b.ints(node, "shape", list(shape))])


# -- neuron layers ---------------------------------------------------------------------
@maps("ReLU")
def relu(b, node):
    slope = node.layer.param.relu_param.negative_slope
    return [b.op(node, "LeakyRelu", [b.bottom(node)], alpha=slope) if slope else b.op(node, "Relu", [b.bottom(node)])]


@maps("PReLU")
def prelu(b, node):
    slope = g.params(node)[0].reshape(-1)
    n = len(node.bottoms[0].shape)
    if slope.size > 1:
        slope = slope.reshape((-1,) + (1,) * (n - 2))
    return [b.op(node, "PRelu", [b.bottom(node), b.const(node, "slope", slope)])]


SIMPLE = {"Sigmoid": "Sigmoid", "TanH": "Tanh", "AbsVal": "Abs", "BNLL": "Softplus"}


@maps(*SIMPLE)
def simple(b, node):
    return [b.op(node, SIMPLE[node.type], [b.bottom(node)])]


@maps("ELU")
def elu(b, node):
    return [b.op(node, "Elu", [b.bottom(node)], alpha=node.layer.param.elu_param.alpha)]


def affine(b, node, x, scale, shift):
    if scale != 1:
        x = b.op(node, "Mul", [x, b.scalar(node, "scale", scale)])
    if shift != 0:
        x = b.op(node, "Add", [x, b.scalar(node, "shift", shift)])
    return x


@maps("Power")
def power(b, node):
    p = node.layer.param.power_param
    y = affine(b, node, b.bottom(node), p.scale, p.shift)
    if p.power != 1:
        y = b.op(node, "Pow", [y, b.scalar(node, "power", p.power)])
    elif y == b.bottom(node):
        y = b.op(node, "Identity", [y])
    return [y]


@maps("Exp")
def exp(b, node):
    p = node.layer.param.exp_param
    ln = g.base_log(p.base)
    return [b.op(node, "Exp", [affine(b, node, b.bottom(node), ln * p.scale, ln * p.shift)])]


@maps("Log")
def log(b, node):
    p = node.layer.param.log_param
    y = b.op(node, "Log", [affine(b, node, b.bottom(node), p.scale, p.shift)])
    ln = g.base_log(p.base)
    return [b.op(node, "Mul", [y, b.scalar(node, "inv_ln_base", 1 / ln)]) if ln != 1 else y]


@maps("Clip")
def clip(b, node):
    p = node.layer.param.clip_param
    return [b.op(node, "Clip", [b.bottom(node), b.scalar(node, "min", p.min), b.scalar(node, "max", p.max)])]


@maps("Swish")
def swish(b, node):
    x = b.bottom(node)
    beta = node.layer.param.swish_param.beta
    return [b.op(node, "Mul", [x, b.op(node, "Sigmoid", [affine(b, node, x, beta, 0)])])]


@maps("Threshold")
def threshold(b, node):
    above = b.op(node, "Greater", [b.bottom(node), b.scalar(node, "threshold", node.layer.param.threshold_param.threshold)])
    return [b.op(node, "Cast", [above], to=1)]


@maps("Dropout")
def dropout(b, node):
    p = node.layer.param.dropout_param
    if b.net.phase == 0 and p.dropout_ratio:
        g.refuse(node, "TRAIN-phase dropout draws random masks: export the TEST phase")
    return [b.bottom(node)]         # Caffe scales at TRAIN (by 1 / (1 - ratio)): TEST is the identity


# -- normalization and broadcasting ---------------------------------------------------------
@maps("BatchNorm")
def batch_norm(b, node):
    mean, var, eps = g.batch_norm(node)
    c = mean.size
    ins = [b.bottom(node), b.const(node, "scale", np.ones(c, np.float32)), b.const(node, "B", np.zeros(c, np.float32)),
           b.const(node, "mean", mean.reshape(c)), b.const(node, "var", var.reshape(c))]
    return [b.op(node, "BatchNormalization", ins, epsilon=eps)]


def operand(b, node, blob_or_bottom, shape):
    x_shape = node.bottoms[0].shape
    target = g.operand_shape(node, x_shape, shape)
    if isinstance(blob_or_bottom, np.ndarray):
        return b.const(node, "operand", blob_or_bottom.reshape(target))
    return reshape_to(b, node, blob_or_bottom, target)


@maps("Scale")
def scale(b, node):
    blobs = g.params(node)
    x = b.bottom(node)
    if len(node.bottoms) > 1:
        s = operand(b, node, b.bottom(node, 1), node.bottoms[1].shape)
    else:
        s = operand(b, node, blobs.pop(0), node.layer.blobs[0].data.shape)
    y = b.op(node, "Mul", [x, s])
    if node.layer.param.scale_param.bias_term:
        y = b.op(node, "Add", [y, operand(b, node, blobs[-1], blobs[-1].shape)])
    return [y]


@maps("Bias")
def bias(b, node):
    if len(node.bottoms) > 1:
        o = operand(b, node, b.bottom(node, 1), node.bottoms[1].shape)
    else:
        o = operand(b, node, g.params(node)[0], node.layer.blobs[0].data.shape)
    return [b.op(node, "Add", [b.bottom(node), o])]


@maps("MVN")
def mvn(b, node):
    p = node.layer.param.mvn_param
    x = b.bottom(node)
    axes = b.ints(node, "axes", list(range(1 if p.across_channels else 2, len(node.bottoms[0].shape))))
    d = b.op(node, "Sub", [x, b.op(node, "ReduceMean", [x, axes], keepdims=1)])
    if not p.normalize_variance:
        return [d]
    std = b.op(node, "Sqrt", [b.op(node, "ReduceMean", [b.op(node, "Mul", [d, d]), axes], keepdims=1)])
    return [b.op(node, "Div", [d, b.op(node, "Add", [std, b.scalar(node, "eps", p.eps)])])]


# -- structure layers ---------------------------------------------------------------------
@maps("Eltwise")
def eltwise(b, node):
    p = node.layer.param.eltwise_param
    xs = [b.bottom(node, i) for i in range(len(node.bottoms))]
    if p.operation == p.PROD:
        y = xs[0]
        for x in xs[1:]:
            y = b.op(node, "Mul", [y, x])
        return [y]
    if p.operation == p.MAX:
        return [b.op(node, "Max", xs)]
    coeffs = list(p.coeff) or [1.0] * len(xs)
    terms = [x if c == 1 else b.op(node, "Mul", [x, b.scalar(node, "coeff", c)]) for x, c in zip(xs, coeffs)]
    return [b.op(node, "Sum", terms)]


@maps("Concat")
def concat(b, node):
    return [b.op(node, "Concat", [b.bottom(node, i) for i in range(len(node.bottoms))], axis=g.concat_axis(node))]


@maps("Slice")
def slice_(b, node):
    axis, sizes = g.slice_sizes(node)
    outs = b.op(node, "Split", [b.bottom(node), b.ints(node, "split", sizes)], n_out=len(sizes), axis=axis)
    return outs if len(sizes) > 1 else [outs]


@maps("Split")
def split(b, node):
    return [b.bottom(node)] * len(node.tops)


@maps("Flatten", "Reshape")
def reshape(b, node):
    return [reshape_to(b, node, b.bottom(node), node.tops[0].shape)]


@maps("Crop")
def crop(b, node):
    offsets, shape = node.layer.offsets, node.tops[0].shape
    axes = [i for i, (o, n) in enumerate(zip(offsets, shape)) if o or n != node.bottoms[0].shape[i]]
    if not axes:
        return [b.op(node, "Identity", [b.bottom(node)])]
    return [b.op(node, "Slice", [b.bottom(node), b.ints(node, "starts", [offsets[i] for i in axes]),
                                 b.ints(node, "ends", [offsets[i] + shape[i] for i in axes]), b.ints(node, "axes", axes)])]


@maps("Softmax")
def softmax(b, node):
    axis = g.canonical(node.layer.param.softmax_param.axis, len(node.bottoms[0].shape))
    return [b.op(node, "Softmax", [b.bottom(node)], axis=axis)]


@maps("ArgMax")
def argmax(b, node):
    """Caffe's ArgMax: the top_k indices (as floats) or values along ``axis``; without an axis,
    over each item flattened, as (N, 1, k), or (N, 2, k) with out_max_val (indices, then values)."""
    p = node.layer.param.argmax_param
    k = b.ints(node, "k", [p.top_k])
    if p.HasField("axis"):
        axis = g.canonical(p.axis, len(node.bottoms[0].shape))
        values, idx = b.op(node, "TopK", [b.bottom(node), k], n_out=2, axis=axis)
        return [values if p.out_max_val else b.op(node, "Cast", [idx], to=1)]
    flat = b.op(node, "Flatten", [b.bottom(node)], axis=1)
    values, idx = b.op(node, "TopK", [flat, k], n_out=2, axis=1)
    one = b.ints(node, "axis1", [1])
    parts = [b.op(node, "Unsqueeze", [b.op(node, "Cast", [idx], to=1), one])]
    if p.out_max_val:
        parts.append(b.op(node, "Unsqueeze", [values, one]))
    y = b.op(node, "Concat", parts, axis=1) if len(parts) > 1 else parts[0]
    return [reshape_to(b, node, y, node.tops[0].shape)]


@maps("Reduction")
def reduction(b, node):
    p = node.layer.param.reduction_param
    n = len(node.bottoms[0].shape)
    axis = g.canonical(p.axis, n)
    op = {"SUM": "ReduceSum", "MEAN": "ReduceMean", "ASUM": "ReduceL1", "SUMSQ": "ReduceSumSquare"}[
        p.ReductionOp.Name(p.operation)]
    y = b.op(node, op, [b.bottom(node), b.ints(node, "axes", list(range(axis, n)))], keepdims=0)
    if p.coeff != 1:
        y = b.op(node, "Mul", [y, b.scalar(node, "coeff", p.coeff)])
    return [reshape_to(b, node, y, node.tops[0].shape)]


@maps("Tile")
def tile(b, node):
    layer = node.layer
    flat = reshape_to(b, node, b.bottom(node), (layer.outer, layer.inner))
    y = b.op(node, "Tile", [flat, b.ints(node, "repeats", [1, layer.tiles])])
    return [reshape_to(b, node, y, node.tops[0].shape)]


@maps("Parameter")
def parameter(b, node):
    return [b.op(node, "Identity", [b.const(node, "value", g.params(node)[0])])]


# -- the forks' layers ----------------------------------------------------------------------
@maps("Interp")
def interp(b, node):
    (rows, cols), size = g.interp(node)
    x, shape = b.bottom(node), node.bottoms[0].shape
    if (rows.start, rows.stop, cols.start, cols.stop) != (0, shape[2], 0, shape[3]):     # pad_beg/pad_end crop
        x = b.op(node, "Slice", [x, b.ints(node, "starts", [rows.start, cols.start]),
                                 b.ints(node, "ends", [rows.stop, cols.stop]), b.ints(node, "axes", [2, 3])])
    sizes = b.ints(node, "sizes", list(node.tops[0].shape))
    return [b.op(node, "Resize", [x, "", "", sizes], mode="linear", coordinate_transformation_mode="align_corners")]


@maps("ShuffleChannel")
def shuffle_channel(b, node):
    n, group, per, rest = node.layer.view
    y = b.op(node, "Transpose", [reshape_to(b, node, b.bottom(node), (n, group, per, rest))], perm=[0, 2, 1, 3])
    return [reshape_to(b, node, y, node.tops[0].shape)]


@maps("Axpy")
def axpy(b, node):
    shape = node.bottoms[1].shape
    a = reshape_to(b, node, b.bottom(node, 0), tuple(shape[:2]) + (1,) * (len(shape) - 2))
    return [b.op(node, "Add", [b.op(node, "Mul", [a, b.bottom(node, 1)]), b.bottom(node, 2)])]


@maps("Permute")
def permute(b, node):
    return [b.op(node, "Transpose", [b.bottom(node)], perm=list(node.layer.order))]


@maps("Normalize")
def normalize(b, node):
    layer = node.layer
    n = len(node.bottoms[0].shape)
    x = b.bottom(node)
    axes = b.ints(node, "axes", list(range(1, n)) if layer.across else [1])
    sq = b.op(node, "ReduceSumSquare", [x, axes], keepdims=1)
    norm = b.op(node, "Sqrt", [b.op(node, "Add", [sq, b.scalar(node, "eps", layer.param.norm_param.eps)])])
    s = g.params(node)[0]
    s = s.reshape(()) if layer.shared else s.reshape((-1,) + (1,) * (n - 2))
    return [b.op(node, "Mul", [b.op(node, "Div", [x, norm]), b.const(node, "scale", s)])]


@maps("PriorBox")
def prior_box(b, node):
    return [b.op(node, "Identity", [b.const(node, "boxes", g.prior_boxes(node))])]


@maps("BN")
def fork_bn(b, node):
    g.refuse_batch_bn(node)
    layer = node.layer
    blobs = [v.reshape(-1) for v in g.params(node)]
    if layer.segnet:            # INFERENCE: scale x + shift
        c = (1, -1) + (1,) * (len(node.bottoms[0].shape) - 2)
        y = b.op(node, "Mul", [b.bottom(node), b.const(node, "scale", blobs[0].reshape(c))])
        return [b.op(node, "Add", [y, b.const(node, "shift", blobs[1].reshape(c))])]
    ins = [b.bottom(node)] + [b.const(node, what, v) for what, v in zip(("slope", "bias", "mean", "var"), blobs)]
    return [b.op(node, "BatchNormalization", ins, epsilon=layer.eps)]


@maps("ROIPooling")
def roi_pooling(b, node):
    # MaxRoiPool is Fast R-CNN's: corners rounded half away from zero after scaling, a roi at
    # least one cell, bins floor/ceil of the even split clipped to the map, an empty bin 0
    p = node.layer.param.roi_pooling_param
    return [b.op(node, "MaxRoiPool", [b.bottom(node, 0), b.bottom(node, 1)],
                 pooled_shape=[p.pooled_h, p.pooled_w], spatial_scale=p.spatial_scale)]


@maps("Upsample")
def upsample(b, node):
    g.upsample_mask_source(b.net, node)
    n, c, h, w = node.tops[0].shape
    # Caffe's mask is the cell within each output plane; MaxUnpool's indices run over the whole top
    offsets = b.const(node, "plane_offsets", (np.arange(n * c, dtype=np.int64) * (h * w)).reshape(n, c, 1, 1))
    idx = b.op(node, "Add", [b.op(node, "Cast", [b.bottom(node, 1)], to=7), offsets])
    scale = [max(o // i, 1) for o, i in zip((h, w), node.bottoms[0].shape[2:])]
    return [b.op(node, "MaxUnpool", [b.bottom(node, 0), idx, b.ints(node, "shape", [n, c, h, w])],
                 kernel_shape=scale, strides=scale)]

