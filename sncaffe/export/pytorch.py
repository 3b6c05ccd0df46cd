"""A deploy net (deploy.py) as readable PyTorch source: an ``nn.Module`` whose submodules are
named after Caffe's layers and whose ``forward`` runs them in Caffe's order, with the
weights in a state_dict saved beside it (``out.py`` and ``out.pt``), never a pickled object.

Layers PyTorch lacks are small helpers written into the file, only those the net uses:
``CaffeBatchNorm`` keeps Caffe's sums and moving-average factor (train mode normalizes by the
batch and updates them as Caffe does), ``caffe_pool2d`` covers the pooling shapes where
PyTorch's padding or rounding differ from Caffe's; the forks' types get ``interp``,
``CaffeNormalize``, ``ForkBN``, ``roi_max_pool`` (a loop, without torchvision), ``max_pool_mask``
and ``upsample``.
"""
from __future__ import annotations

import builtins
import keyword
import re
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from . import ExportError
from . import geometry as g

MAPS = {}       # layer type -> fn(gen, node) -> the tops' Python expressions

HELPERS = {
    "caffe_pool2d": '''
def caffe_pool2d(x, method, kernel, stride, pad, end_pad):
    """Caffe's pooling where PyTorch's padding or rounding differ: the input padded to exactly
    the cells Caffe's windows cover; AVE divides by each window clipped at the padded end."""
    widths = (pad[1], end_pad[1], pad[0], end_pad[0])
    if method == "max":
        return F.max_pool2d(F.pad(x, widths, value=-math.inf), kernel, stride)
    sums = F.avg_pool2d(F.pad(x, widths), kernel, stride, divisor_override=1)
    sizes = [torch.clamp(torch.arange(o) * s - p + k, max=n + p) - (torch.arange(o) * s - p)
             for o, s, p, k, n in zip(sums.shape[2:], stride, pad, kernel, x.shape[2:])]
    return sums / (sizes[0][:, None] * sizes[1][None, :]).to(x.dtype)
''',
    "lrn_within": '''
def lrn_within(x, size, alpha, beta):
    """Caffe's LRN within a channel: x (1 + alpha mean(x^2 over size x size))^-beta, the zero
    padding counted in the mean."""
    mean_sq = F.avg_pool2d(x * x, size, 1, (size - 1) // 2, count_include_pad=True)
    return x * (1 + alpha * mean_sq) ** -beta
''',
    "CaffeBatchNorm": '''
class CaffeBatchNorm(nn.Module):
    """Caffe's BatchNorm (no affine part; a Scale layer follows). Buffers as Caffe's blobs: the
    sums of the batch means and variances and their moving-average factor. In eval mode it
    normalizes by sums / factor; in train mode by the batch's mean and biased variance, adding
    the batch's mean and unbiased variance to the sums (decayed by moving_average_fraction)."""

    def __init__(self, channels, eps=1e-5, moving_average_fraction=0.999, use_global_stats=None):
        super().__init__()
        self.eps, self.maf, self.use_global_stats = eps, moving_average_fraction, use_global_stats
        self.register_buffer("mean", torch.zeros(channels))
        self.register_buffer("variance", torch.zeros(channels))
        self.register_buffer("factor", torch.zeros(1))

    def forward(self, x):
        x3 = x.reshape(x.shape[0], x.shape[1], -1)
        global_stats = not self.training if self.use_global_stats is None else self.use_global_stats
        if global_stats:
            inv = 0.0 if self.factor.item() == 0 else 1.0 / self.factor.item()
            y = F.batch_norm(x3, self.mean * inv, self.variance * inv, training=False, eps=self.eps)
            return y.reshape(x.shape)
        if self.training:
            m = x3.shape[0] * x3.shape[2]
            with torch.no_grad():
                var, mean = torch.var_mean(x3, (0, 2), unbiased=m > 1)
                self.factor.mul_(self.maf).add_(1)
                self.mean.mul_(self.maf).add_(mean)
                self.variance.mul_(self.maf).add_(var)
        # PyTorch's own batch statistics: its fused backward keeps float32's precision
        return F.batch_norm(x3, None, None, training=True, eps=self.eps).reshape(x.shape)
''',
    "CaffeScale": '''
class CaffeScale(nn.Module):
    """Caffe's Scale: x * weight (+ bias), the parameters broadcast from Caffe's axis; with a
    second input, that input is the scale."""

    def __init__(self, shape, broadcast, weight=True, bias=True):
        super().__init__()
        self.broadcast = broadcast
        self.weight = nn.Parameter(torch.ones(shape)) if weight else None
        self.bias = nn.Parameter(torch.zeros(shape)) if bias else None

    def forward(self, x, scale=None):
        y = x * (self.weight if scale is None else scale).reshape(self.broadcast)
        return y if self.bias is None else y + self.bias.reshape(self.broadcast)
''',
    "CaffeBias": '''
class CaffeBias(nn.Module):
    """Caffe's Bias: x + bias, broadcast from Caffe's axis."""

    def __init__(self, shape, broadcast):
        super().__init__()
        self.broadcast = broadcast
        self.bias = nn.Parameter(torch.zeros(shape))

    def forward(self, x):
        return x + self.bias.reshape(self.broadcast)
''',
    "caffe_argmax": '''
def caffe_argmax(x, k, axis=None, out_max_val=False, shape=None):
    """Caffe's ArgMax: the top k indices (as floats), or values, along ``axis``; without an
    axis, over each item flattened, as (N, 1, k) or (N, 2, k) (indices, then values)."""
    if axis is not None:
        top = torch.topk(x, k, dim=axis)
        return top.values if out_max_val else top.indices.to(x.dtype)
    top = torch.topk(x.flatten(1), k, dim=1)
    parts = [top.indices.to(x.dtype)] + ([top.values] if out_max_val else [])
    return torch.stack(parts, 1).reshape(shape)
''',
    "mvn": '''
def mvn(x, across_channels, normalize_variance, eps):
    """Caffe's MVN: x less its mean per item (and channel), divided by std + eps."""
    dims = tuple(range(1 if across_channels else 2, x.dim()))
    d = x - x.mean(dims, keepdim=True)
    return d / (torch.sqrt((d * d).mean(dims, keepdim=True)) + eps) if normalize_variance else d
''',
    "interp": '''
def interp(x, size):
    """PSPNet's Interp: bilinear, the corners aligned."""
    return F.interpolate(x, size=size, mode="bilinear", align_corners=True)
''',
    "CaffeNormalize": '''
class CaffeNormalize(nn.Module):
    """SSD's Normalize: x / sqrt(sum x^2 + eps) over each item (across_spatial) or each position's
    channels, times a learned scale (one, or one per channel)."""

    def __init__(self, channels, across_spatial, eps):
        super().__init__()
        self.across_spatial, self.eps = across_spatial, eps
        self.weight = nn.Parameter(torch.ones(channels))

    def forward(self, x):
        dims = tuple(range(1, x.dim())) if self.across_spatial else 1
        scale = self.weight.reshape((1, -1) + (1,) * (x.dim() - 2)) if self.weight.dim() else self.weight
        return x / torch.sqrt((x * x).sum(dims, keepdim=True) + self.eps) * scale
''',
    "ForkBN": '''
class ForkBN(nn.Module):
    """The forks' BN with its stored statistics: slope (x - mean) / sqrt(variance + eps) + bias
    (PSPNet's TEST phase, or frozen); without statistics, slope x + bias (caffe-segnet's
    INFERENCE). Train mode normalizes the same way (the batch-statistics modes are not exported)."""

    def __init__(self, channels, eps=1e-5, statistics=True):
        super().__init__()
        self.eps = eps
        shape = (1, channels, 1, 1)
        self.slope = nn.Parameter(torch.ones(shape))
        self.bias = nn.Parameter(torch.zeros(shape))
        if statistics:
            self.register_buffer("mean", torch.zeros(shape))
            self.register_buffer("variance", torch.ones(shape))
        else:
            self.mean = self.variance = None

    def forward(self, x):
        x3 = x.reshape(x.shape[0], x.shape[1], -1)
        slope, bias = self.slope.reshape(1, -1, 1), self.bias.reshape(1, -1, 1)
        if self.mean is not None:
            x3 = (x3 - self.mean.reshape(1, -1, 1)) / torch.sqrt(self.variance.reshape(1, -1, 1) + self.eps)
        return (x3 * slope + bias).reshape(x.shape)
''',
    "roi_max_pool": '''
def roi_max_pool(x, rois, pooled, spatial_scale):
    """Fast R-CNN's ROIPooling, a loop over rois and bins: a roi's corners scaled and rounded
    half away from zero (in float32), its size at least one cell, bin edges the floor and ceil
    of the even split clipped to the map; an empty bin gives 0."""
    out = x.new_zeros((rois.shape[0], x.shape[1]) + tuple(pooled))
    rois = rois.detach().reshape(-1, 5).float()
    for r in range(rois.shape[0]):
        v = rois[r, 1:] * torch.tensor(spatial_scale, dtype=torch.float32)
        x1, y1, x2, y2 = (torch.sign(v) * torch.floor(v.abs() + 0.5)).int().tolist()
        edges = []
        for lo, hi, n, size in ((y1, y2, pooled[0], x.shape[2]), (x1, x2, pooled[1], x.shape[3])):
            step = torch.tensor(max(hi - lo + 1, 1), dtype=torch.float32) / n
            p = torch.arange(n, dtype=torch.float32)
            start = (torch.floor(p * step).int() + lo).clamp(0, size).tolist()
            end = (torch.ceil((p + 1) * step).int() + lo).clamp(0, size).tolist()
            edges.append(list(zip(start, end)))
        b = int(rois[r, 0])
        for i, (hs, he) in enumerate(edges[0]):
            for j, (ws, we) in enumerate(edges[1]):
                if he > hs and we > ws:
                    out[r, :, i, j] = x[b, :, hs:he, ws:we].amax((1, 2))
    return out
''',
    "max_pool_mask": '''
def max_pool_mask(x, kernel, stride, pad, ceil_mode):
    """MAX pooling and Caffe's mask top: the argmax as h * W + w of the input plane, as floats."""
    y, idx = F.max_pool2d(x, kernel, stride, pad, ceil_mode=ceil_mode, return_indices=True)
    return y, idx.to(x.dtype)
''',
    "upsample": '''
def upsample(x, mask, size):
    """SegNet's Upsample: each value to the cell of its output plane that its mask names (h * W
    + w); every other cell 0. A cell named twice takes the later value on the CPU, as in Caffe
    (CUDA's scatter takes either)."""
    n, c = x.shape[:2]
    y = x.new_zeros((n, c, size[0] * size[1]))
    return y.scatter(2, mask.long().flatten(2), x.flatten(2)).reshape(n, c, *size)
''',
}


def python_name(name, taken, prefix="x"):
    """A Python identifier for a Caffe name, unique among ``taken`` (which it joins)."""
    s = re.sub(r"\W", "_", name) or prefix
    if s[0].isdigit() or keyword.iskeyword(s) or s in RESERVED:
        s = f"{prefix}_{s}"
    out, k = s, 1
    while out in taken:
        out, k = f"{s}_{k}", k + 1
    taken.add(out)
    return out


RESERVED = {"self", "torch", "nn", "F", "math", "os", *HELPERS, *dir(builtins)}


def class_name(name):
    words = re.findall(r"[A-Za-z0-9]+", name or "")
    s = "".join(w[:1].upper() + w[1:] for w in words) or "Net"
    return s if s[0].isalpha() else "Net" + s


@dataclass
class TorchSource:
    """The generated module: ``source`` (Python), its class name, the state_dict's arrays and
    each Caffe layer's state keys in its blob order (for comparing gradients)."""
    source: str
    class_name: str
    state: dict
    blob_keys: dict = field(default_factory=dict)
    transposed: set = field(default_factory=set)      # keys stored as the transpose of Caffe's blob

    def module(self):
        """The module, defined from the source and loaded with the weights."""
        import torch
        scope = {}
        exec(compile(self.source, f"<sncaffe export {self.class_name}>", "exec"), scope)
        model = scope[self.class_name]()
        model.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in self.state.items()})
        return model

    def write(self, path):
        """``path`` (.py) and the weights beside it (the same name, .pt)."""
        import torch
        from ..blobproto import write_atomic
        path = Path(path)
        weights = path.with_suffix(".pt")
        if weights == path:
            raise ExportError(f"{path}: give the module a .py name (the weights go to the same name, .pt)")
        source = self.source.replace("WEIGHTS_FILE", repr(weights.name))
        write_atomic(path, [source.encode()])
        tmp = weights.with_name(weights.name + ".tmp")
        torch.save({k: torch.from_numpy(np.array(v)) for k, v in self.state.items()}, tmp)
        tmp.replace(weights)
        return path, weights


class Gen:
    def __init__(self, net):
        self.net = net
        self.init, self.body, self.state, self.blob_keys, self.transposed = [], [], {}, {}, set()
        self.helpers = []
        self.vars, self.var = set(), {}       # blob -> its Python variable now
        self.attrs = set(dir(__import__("torch").nn.Module))

    def helper(self, name):
        if name not in self.helpers:
            self.helpers.append(name)

    def bottom(self, node, i=0):
        return self.var[node.bottoms[i].name]

    def submodule(self, node, ctor, state=None, buffers=()):
        """``self.<layer> = ctor`` and its state entries (``buffers``: those that are no
        parameters); the attribute."""
        attr = python_name(node.name, self.attrs, "layer")
        self.init.append(f"self.{attr} = {ctor}")
        keys = []
        for k, v in (state or {}).items():
            self.state[f"{attr}.{k}"] = v
            keys.append(f"{attr}.{k}")
        self.blob_keys[node.name] = keys
        if node.layer.learnable:
            for k, need in zip(keys, node.param_need_backward):
                if not need and k.rsplit(".", 1)[1] not in buffers:
                    self.init.append(f"self.{k}.requires_grad_(False)      # lr_mult 0: frozen, as in Caffe")
        return attr

    def assign(self, blob) -> str:
        """The variable a top is written to: the blob's own (in place), unless another blob aliases it."""
        name = self.var.get(blob)
        if name is None or list(self.var.values()).count(name) > 1:
            name = python_name(blob, self.vars)
        self.var[blob] = name
        return name

    def add(self, node):
        if any(node.param_owner or ()):
            g.refuse(node, "shares a parameter with another layer, which the module would not share")
        tops = MAPS[node.type](self, node)
        if isinstance(tops, Unpack):
            names = [self.assign(t.name) for t in node.tops]
            self.body.append(f"{', '.join(names)} = {tops.expr}")
            return
        for t, e in zip(node.tops, tops):
            if isinstance(e, Alias):
                self.var[t.name] = e.var
            else:
                self.body.append(f"{self.assign(t.name)} = {e}")


@dataclass
class Alias:
    """A top that is its bottom (Split, TEST-phase Dropout): no statement."""
    var: str


@dataclass
class Unpack:
    """One expression giving every top (a tuple)."""
    expr: str


def source(net) -> TorchSource:
    """The module of a deploy Net; ExportError names the first layer without a mapping."""
    g.check_mapped(net, MAPS, "PyTorch")
    gen = Gen(net)
    args = []
    for node in net.graph.layers:
        if node.type == "Input":
            for t in node.tops:
                gen.var[t.name] = python_name(t.name, gen.vars)
                args.append(gen.var[t.name])
        else:
            gen.add(node)
    outs = [gen.var[name] for name in net.outputs]
    cls = class_name(net.name)
    shapes = lambda names: ", ".join(f"{n} {tuple(net.blobs[n].data.shape)}" for n in names)
    doc = (f'"""{net.name or "net"}: a PyTorch module written by sncaffe export from a Caffe net.\n\n'
           "Layers run in Caffe's order, named after Caffe's layers. The weights are a state_dict\n"
           "beside this file:\n\n"
           f"    model = {cls}()\n"
           f"    model.load_state_dict(torch.load(os.path.join(os.path.dirname(__file__), WEIGHTS_FILE)))\n"
           "    model.eval()    # Caffe's TEST phase; train() is its TRAIN phase\n\n"
           f"Inputs: {shapes(net.inputs)}.\nOutputs: {shapes(net.outputs)}.\n"
           '"""\n')
    imports = ["import math"] if "caffe_pool2d" in gen.helpers else []
    lines = [doc, "import os", *imports, "", "import torch", "import torch.nn as nn", "import torch.nn.functional as F", ""]
    for h in gen.helpers:
        lines.append(HELPERS[h].rstrip("\n") + "\n")
    ret = outs[0] if len(outs) == 1 else "(" + ", ".join(outs) + ")"
    body = "\n".join(gen.init) or "pass"
    lines.append(f"\nclass {cls}(nn.Module):\n"
                 f"    inputs = {tuple(net.inputs)!r}\n"
                 f"    outputs = {tuple(net.outputs)!r}\n\n"
                 "    def __init__(self):\n"
                 "        super().__init__()\n"
                 + textwrap.indent(body, " " * 8) + "\n\n"
                 f"    def forward(self, {', '.join(args)}):\n"
                 + textwrap.indent("\n".join(gen.body + [f"return {ret}"]), " " * 8) + "\n")
    text = "\n".join(lines)
    return TorchSource(text, cls, gen.state, gen.blob_keys, gen.transposed)


def runner(model, net):
    """inputs dict -> outputs dict by blob name, through the module (no gradient)."""
    import torch

    def run(inputs):
        with torch.no_grad():
            y = model(*(torch.from_numpy(inputs[n]) for n in net.inputs))
        y = y if isinstance(y, tuple) else (y,)
        return {n: t.numpy() for n, t in zip(net.outputs, y)}
    return run


def export(net, path=None, rtol=None, seed=0, against=None):
    """The module of ``net``'s deploy part, in the mode of its phase, checked against sncaffe
    (unless ``rtol`` is None) and written to ``path`` (.py, and .pt beside it) if given;
    (module, TorchSource, Differences)."""
    from .check import compare
    src = source(net)
    drops = [n for n in net.graph.layers if n.type == "Dropout" and n.layer.param.dropout_param.dropout_ratio]
    if rtol is not None and net.phase == 0 and drops:
        g.refuse(drops[0], "TRAIN-phase dropout draws random masks, which cannot be checked: export the TEST "
                           "phase (the module's train() drops as Caffe's)")
    model = src.module()
    model.train(net.phase == 0)
    diffs = [] if rtol is None else compare(net, runner(model, net), rtol, "the PyTorch module", seed, against)
    if net.phase == 0:          # the check's train-mode forward moved BatchNorm's sums
        model.load_state_dict({k: __import__("torch").from_numpy(np.array(v)) for k, v in src.state.items()})
    if path is not None:
        src.write(path)
    return model, src, diffs


# -- layers -----------------------------------------------------------------------------
def tup(v):
    return tuple(int(x) for x in v)


maps = g.registrar(MAPS)


def num(v):
    """A float as the shortest text that reads back as the same float32 (0.7, not 0.699999988)."""
    return str(np.float32(v))


@maps("Convolution", "Deconvolution", "ConvolutionDepthwise")
def convolution(gen, node):
    c = g.conv(node)
    blobs = g.params(node)
    d = len(c.kernel)
    if not 1 <= d <= 3:
        g.refuse(node, f"{d} spatial axes (PyTorch has 1 to 3)")
    deconv = node.type == "Deconvolution"
    cin = node.bottoms[0].shape[1]
    cout = node.tops[0].shape[1]
    kind = f"nn.ConvTranspose{d}d" if deconv else f"nn.Conv{d}d"
    state = {"weight": blobs[0]} | ({"bias": blobs[1]} if len(blobs) > 1 else {})
    attr = gen.submodule(node, f"{kind}({cin}, {cout}, kernel_size={tup(c.kernel)}, stride={tup(c.stride)}, "
                               f"padding={tup(c.pad)}, dilation={tup(c.dilation)}, groups={c.group}, "
                               f"bias={len(blobs) > 1})", state)
    return [f"self.{attr}({gen.bottom(node, i)})" for i in range(len(node.bottoms))]


def torch_pooled(n, k, s, p, ceil):
    """PyTorch's pooled size (it drops a last window starting in the padding, padded or not)."""
    out = (n + 2 * p - k + (s - 1 if ceil else 0)) // s + 1
    if ceil and (out - 1) * s >= n + p:
        out -= 1
    return out


@maps("Pooling")
def pooling(gen, node):
    p = g.pool(node)
    x = gen.bottom(node)
    kind = "max" if p.method == "MAX" else "avg"
    if p.is_global:
        return [f"F.adaptive_{kind}_pool2d({x}, 1)"]
    pp = node.layer.param.pooling_param
    ceil = pp.ceil_mode if pp.HasField("ceil_mode") else pp.round_mode == pp.CEIL
    native = all(2 * a <= k for a, k in zip(p.pad, p.kernel)) and all(
        torch_pooled(n, k, s, a, ceil) == o
        for n, k, s, a, o in zip(node.layer.in_hw, p.kernel, p.stride, p.pad, p.out))
    if len(node.tops) > 1:
        if not native:
            g.refuse(node, "with the mask top, PyTorch's own pooling must give Caffe's windows (padding at "
                           "most half the kernel, the same rounding)")
        gen.helper("max_pool_mask")
        gen.blob_keys[node.name] = []
        return Unpack(f"max_pool_mask({x}, {tup(p.kernel)}, {tup(p.stride)}, {tup(p.pad)}, {ceil})")
    if native:      # PyTorch's windows and (AVE) divisors are Caffe's here
        extra = ", count_include_pad=True" if kind == "avg" else ""
        attr = gen.submodule(node, f"nn.{kind.capitalize()}Pool2d({tup(p.kernel)}, stride={tup(p.stride)}, "
                                   f"padding={tup(p.pad)}, ceil_mode={ceil}{extra})")
        return [f"self.{attr}({x})"]
    gen.helper("caffe_pool2d")
    gen.blob_keys[node.name] = []
    return [f'caffe_pool2d({x}, "{kind}", {tup(p.kernel)}, {tup(p.stride)}, {tup(p.pad)}, {tup(p.end_pad)})']


@maps("LRN")
def lrn(gen, node):
    lp = node.layer.param.lrn_param
    if lp.norm_region == lp.ACROSS_CHANNELS:
        attr = gen.submodule(node, f"nn.LocalResponseNorm({lp.local_size}, alpha={num(lp.alpha)}, "
                                   f"beta={num(lp.beta)}, k={num(lp.k)})")
        return [f"self.{attr}({gen.bottom(node)})"]
    gen.helper("lrn_within")
    return [f"lrn_within({gen.bottom(node)}, {lp.local_size}, {num(lp.alpha)}, {num(lp.beta)})"]


@maps("InnerProduct")
def inner_product(gen, node):
    p = node.layer.param.inner_product_param
    blobs = g.params(node)
    axis = g.canonical(p.axis, len(node.bottoms[0].shape))
    w = blobs[0].T.copy() if p.transpose else blobs[0]
    state = {"weight": w} | ({"bias": blobs[1]} if len(blobs) > 1 else {})
    attr = gen.submodule(node, f"nn.Linear({w.shape[1]}, {w.shape[0]}, bias={len(blobs) > 1})", state)
    if p.transpose:
        gen.transposed.add(f"{attr}.weight")
    x = gen.bottom(node)
    flat = x if axis == len(node.bottoms[0].shape) - 1 else f"{x}.flatten({axis})"
    return [f"self.{attr}({flat})"]


@maps("ReLU")
def relu(gen, node):
    slope = node.layer.param.relu_param.negative_slope
    x = gen.bottom(node)
    return [f"F.leaky_relu({x}, {num(slope)})" if slope else f"F.relu({x})"]


@maps("PReLU")
def prelu(gen, node):
    w = g.params(node)[0].reshape(-1)
    attr = gen.submodule(node, f"nn.PReLU({w.size})", {"weight": w})
    return [f"self.{attr}({gen.bottom(node)})"]


FUNCS = {"Sigmoid": "torch.sigmoid", "TanH": "torch.tanh", "AbsVal": "torch.abs", "BNLL": "F.softplus"}


@maps(*FUNCS)
def simple(gen, node):
    return [f"{FUNCS[node.type]}({gen.bottom(node)})"]


@maps("ELU")
def elu(gen, node):
    return [f"F.elu({gen.bottom(node)}, {num(node.layer.param.elu_param.alpha)})"]


def affine(x, scale, shift):
    y = x if scale == 1 else f"{num(scale)} * {x}"
    return y if shift == 0 else f"({y} + {num(shift)})"


@maps("Power")
def power(gen, node):
    p = node.layer.param.power_param
    x = gen.bottom(node)
    y = affine(x, p.scale, p.shift)
    if p.power == 1:
        return [Alias(x) if y == x else y]
    return [f"{y if y == x or y.startswith('(') else f'({y})'} ** {num(p.power)}"]


@maps("Exp")
def exp(gen, node):
    p = node.layer.param.exp_param
    ln = g.base_log(p.base)
    return [f"torch.exp({affine(gen.bottom(node), ln * p.scale, ln * p.shift)})"]


@maps("Log")
def log(gen, node):
    p = node.layer.param.log_param
    ln = g.base_log(p.base)
    y = f"torch.log({affine(gen.bottom(node), p.scale, p.shift)})"
    return [y if ln == 1 else f"{y} * {num(1 / ln)}"]


@maps("Clip")
def clip(gen, node):
    p = node.layer.param.clip_param
    return [f"torch.clamp({gen.bottom(node)}, {num(p.min)}, {num(p.max)})"]


@maps("Swish")
def swish(gen, node):
    x = gen.bottom(node)
    return [f"{x} * torch.sigmoid({affine(x, node.layer.param.swish_param.beta, 0)})"]


@maps("Threshold")
def threshold(gen, node):
    x = gen.bottom(node)
    return [f"({x} > {num(node.layer.param.threshold_param.threshold)}).to({x}.dtype)"]


@maps("Dropout")
def dropout(gen, node):
    # Caffe's train-time dropout scales the kept values by 1 / (1 - ratio), as PyTorch's does
    attr = gen.submodule(node, f"nn.Dropout({num(node.layer.param.dropout_param.dropout_ratio)})")
    return [f"self.{attr}({gen.bottom(node)})"]


@maps("BatchNorm")
def batch_norm(gen, node):
    bp = node.layer.param.batch_norm_param
    mean, var, factor = g.params(node)
    gen.helper("CaffeBatchNorm")
    fixed = f", use_global_stats={bp.use_global_stats}" if bp.HasField("use_global_stats") else ""
    attr = gen.submodule(node, f"CaffeBatchNorm({mean.size}, eps={num(bp.eps)}, moving_average_fraction="
                               f"{num(bp.moving_average_fraction)}{fixed})",
                         {"mean": mean.reshape(-1), "variance": var.reshape(-1), "factor": factor.reshape(1)})
    return [f"self.{attr}({gen.bottom(node)})"]


@maps("Scale")
def scale(gen, node):
    blobs = g.params(node)
    two = len(node.bottoms) > 1
    shape = node.bottoms[1].shape if two else blobs[0].shape
    bcast = g.operand_shape(node, node.bottoms[0].shape, shape)
    bias = node.layer.param.scale_param.bias_term
    state = ({} if two else {"weight": blobs[0]}) | ({"bias": blobs[-1]} if bias else {})
    gen.helper("CaffeScale")
    attr = gen.submodule(node, f"CaffeScale({tup(shape)}, {tup(bcast)}, weight={not two}, bias={bias})", state)
    return [f"self.{attr}({gen.bottom(node)}{', ' + gen.bottom(node, 1) if two else ''})"]


@maps("Bias")
def bias(gen, node):
    x = gen.bottom(node)
    if len(node.bottoms) > 1:
        bcast = g.operand_shape(node, node.bottoms[0].shape, node.bottoms[1].shape)
        gen.blob_keys[node.name] = []
        return [f"{x} + {gen.bottom(node, 1)}.reshape({tup(bcast)})"]
    b = g.params(node)[0]
    gen.helper("CaffeBias")
    bcast = g.operand_shape(node, node.bottoms[0].shape, b.shape)
    attr = gen.submodule(node, f"CaffeBias({tup(b.shape)}, {tup(bcast)})", {"bias": b})
    return [f"self.{attr}({x})"]


@maps("MVN")
def mvn(gen, node):
    p = node.layer.param.mvn_param
    gen.helper("mvn")
    return [f"mvn({gen.bottom(node)}, {p.across_channels}, {p.normalize_variance}, {num(p.eps)})"]


@maps("Eltwise")
def eltwise(gen, node):
    p = node.layer.param.eltwise_param
    xs = [gen.bottom(node, i) for i in range(len(node.bottoms))]
    if p.operation == p.PROD:
        return [" * ".join(xs)]
    if p.operation == p.MAX:
        y = xs[0]
        for x in xs[1:]:
            y = f"torch.maximum({y}, {x})"
        return [y]
    coeffs = list(p.coeff) or [1.0] * len(xs)
    return [" + ".join(x if c == 1 else f"{num(c)} * {x}" for x, c in zip(xs, coeffs))]


@maps("Concat")
def concat(gen, node):
    xs = ", ".join(gen.bottom(node, i) for i in range(len(node.bottoms)))
    return [f"torch.cat([{xs}], {g.concat_axis(node)})"]


@maps("Slice")
def slice_(gen, node):
    axis, sizes = g.slice_sizes(node)
    if len(sizes) == 1:
        return [Alias(gen.bottom(node))]
    return Unpack(f"torch.split({gen.bottom(node)}, {sizes}, {axis})")


@maps("Split")
def split(gen, node):
    return [Alias(gen.bottom(node))] * len(node.tops)


@maps("Flatten", "Reshape")
def reshape(gen, node):
    x = gen.bottom(node)
    shape, before = node.tops[0].shape, node.bottoms[0].shape
    if shape[:1] == before[:1] and len(shape) > 1:      # the batch kept: written as x.shape[0]
        return [f"{x}.reshape({x}.shape[0], {', '.join(str(d) for d in shape[1:])})"]
    return [f"{x}.reshape({tup(shape)})"]


@maps("Crop")
def crop(gen, node):
    offsets, shape = node.layer.offsets, node.tops[0].shape
    cut = [":" if o == 0 and n == m else f"{o}:{o + n}"
           for o, n, m in zip(offsets, shape, node.bottoms[0].shape)]
    while cut and cut[-1] == ":":
        cut.pop()
    return [f"{gen.bottom(node)}[{', '.join(cut)}]" if cut else Alias(gen.bottom(node))]


@maps("Softmax")
def softmax(gen, node):
    axis = g.canonical(node.layer.param.softmax_param.axis, len(node.bottoms[0].shape))
    return [f"F.softmax({gen.bottom(node)}, {axis})"]


@maps("ArgMax")
def argmax(gen, node):
    p = node.layer.param.argmax_param
    gen.helper("caffe_argmax")
    x = gen.bottom(node)
    if p.HasField("axis"):
        axis = g.canonical(p.axis, len(node.bottoms[0].shape))
        return [f"caffe_argmax({x}, {p.top_k}, axis={axis}, out_max_val={p.out_max_val})"]
    return [f"caffe_argmax({x}, {p.top_k}, out_max_val={p.out_max_val}, shape={tup(node.tops[0].shape)})"]


REDUCE = {"SUM": ".sum(-1)", "MEAN": ".mean(-1)", "ASUM": ".abs().sum(-1)", "SUMSQ": ".pow(2).sum(-1)"}


@maps("Reduction")
def reduction(gen, node):
    p = node.layer.param.reduction_param
    axis = g.canonical(p.axis, len(node.bottoms[0].shape))
    y = f"{gen.bottom(node)}.flatten({axis}){REDUCE[p.ReductionOp.Name(p.operation)]}"
    return [y if p.coeff == 1 else f"{num(p.coeff)} * {y}"]


@maps("Tile")
def tile(gen, node):
    layer = node.layer
    return [f"{gen.bottom(node)}.reshape({layer.outer}, {layer.inner}).repeat(1, {layer.tiles})"
            f".reshape({tup(node.tops[0].shape)})"]


@maps("Parameter")
def parameter(gen, node):
    w = g.params(node)[0]
    attr = python_name(node.name, gen.attrs, "layer")
    gen.init.append(f"self.{attr} = nn.Parameter(torch.zeros({tup(w.shape)}))")
    gen.state[attr] = w
    gen.blob_keys[node.name] = [attr]
    return [f"self.{attr}"]


# -- the forks' layers ----------------------------------------------------------------------
@maps("Interp")
def interp(gen, node):
    (rows, cols), size = g.interp(node)
    x, shape = gen.bottom(node), node.bottoms[0].shape
    if (rows.start, rows.stop, cols.start, cols.stop) != (0, shape[2], 0, shape[3]):     # pad_beg/pad_end crop
        x = f"{x}[:, :, {rows.start}:{rows.stop}, {cols.start}:{cols.stop}]"
    gen.helper("interp")
    return [f"interp({x}, {tup(size)})"]


@maps("ShuffleChannel")
def shuffle_channel(gen, node):
    view = tup(node.layer.view)
    return [f"{gen.bottom(node)}.reshape({view}).transpose(1, 2).reshape({tup(node.tops[0].shape)})"]


@maps("Axpy")
def axpy(gen, node):
    a, x, y = (gen.bottom(node, i) for i in range(3))
    ones = ", 1" * (len(node.bottoms[1].shape) - 2)
    return [f"{a}.reshape({a}.shape[0], -1{ones}) * {x} + {y}"]


@maps("Permute")
def permute(gen, node):
    return [f"{gen.bottom(node)}.permute({tup(node.layer.order)})"]


@maps("Normalize")
def normalize(gen, node):
    layer = node.layer
    w = g.params(node)[0]
    gen.helper("CaffeNormalize")
    channels = "()" if layer.shared else str(w.size)
    attr = gen.submodule(node, f"CaffeNormalize({channels}, across_spatial={layer.across}, "
                               f"eps={num(layer.param.norm_param.eps)})", {"weight": w})
    return [f"self.{attr}({gen.bottom(node)})"]


@maps("PriorBox")
def prior_box(gen, node):
    boxes = g.prior_boxes(node)
    attr = python_name(node.name, gen.attrs, "layer")
    # the boxes depend on the input shapes only, fixed in the export
    gen.init.append(f"self.register_buffer({attr!r}, torch.zeros({tup(boxes.shape)}))")
    gen.state[attr] = boxes
    gen.blob_keys[node.name] = []
    return [f"self.{attr}"]


@maps("BN")
def fork_bn(gen, node):
    g.refuse_batch_bn(node)
    layer = node.layer
    blobs = g.params(node)
    names = ("slope", "bias", "mean", "variance")
    gen.helper("ForkBN")
    attr = gen.submodule(node, f"ForkBN({blobs[0].size}, eps={num(layer.eps)}, statistics={not layer.segnet})",
                         dict(zip(names, blobs)), buffers=names[2:])
    return [f"self.{attr}({gen.bottom(node)})"]


@maps("ROIPooling")
def roi_pooling(gen, node):
    p = node.layer.param.roi_pooling_param
    gen.helper("roi_max_pool")
    return [f"roi_max_pool({gen.bottom(node)}, {gen.bottom(node, 1)}, {tup(node.layer.pooled)}, "
            f"{num(p.spatial_scale)})"]


@maps("Upsample")
def upsample(gen, node):
    g.upsample_mask_source(gen.net, node)
    gen.helper("upsample")
    return [f"upsample({gen.bottom(node)}, {gen.bottom(node, 1)}, {tup(node.tops[0].shape[2:])})"]
