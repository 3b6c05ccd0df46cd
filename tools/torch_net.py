"""A PyTorch twin of an sncaffe Net: the same layers, parameters and order, in torch.

    net = sncaffe.Net("lenet.prototxt", "TRAIN")
    twin = TorchNet(net)                    # parameters copied from net.params
    out = twin({"data": x, "label": y})     # outputs by blob name, out.loss
    out.loss.backward()

Used to check sncaffe against an independent implementation (tests/test_torch_net.py)
and as the baseline of tools/bench_resnet50.py. Each layer is rewritten here from
Caffe's definition, not from sncaffe's code; only the graph (order, split layers,
in-place names, loss weights) and the parameter values are taken from the Net.
PyTorch is an optional extra: the sncaffe package never imports this module.
"""
from __future__ import annotations

import math
from functools import reduce

import numpy as np
import torch
import torch.nn.functional as F

TRAIN, TEST = 0, 1
OPS = {}        # prototxt type -> fn(twin, node, bottoms, blobs) -> tops
# Types with no twin on purpose, and why (the rest of the unsupported ones just lack one).
NO_TWIN = {
    "HDF5Output": "it writes its bottoms to a file and has no top or gradient to compare",
    "WindowData": "it samples windows from images at random; feed its tops to an Input layer instead",
    "Python": "it runs the user's own Python code, which has no definition to rewrite",
}
# Types whose top batch size depends on the data (Caffe reshapes them at every forward):
# the Net's setup shapes hold for them and for the layers after them only at axes >= 1.
DATA_DEPENDENT = {"Filter"}


def op(*types):
    def deco(fn):
        for t in types:
            OPS[t] = fn
        return fn
    return deco


class TorchNetError(ValueError):
    """A layer (or setting of one) the twin does not implement."""


def fail(node, msg):
    raise TorchNetError(f'layer "{node.name}" ({node.type}): {msg}')


class Outputs(dict):
    """The net's output tensors by blob name; ``.loss`` is the sum of loss_weight * top."""
    loss: torch.Tensor


class TorchNet(torch.nn.Module):
    def __init__(self, net, dtype=None):
        super().__init__()
        self.phase = net.phase
        self.layers = list(net.graph.layers)
        self.outputs = output_names(self.layers)
        np_dtype = next(iter(net.graph.blobs.values())).data.dtype
        self.dtype = dtype or torch.from_numpy(np.zeros(0, np_dtype)).dtype
        for node in self.layers:
            if node.type in NO_TWIN:
                raise TorchNetError(f'layer "{node.name}": type "{node.type}" has no torch twin: '
                                    f"{NO_TWIN[node.type]}")
            if node.type not in OPS:
                raise TorchNetError(f'layer "{node.name}": type "{node.type}" has no torch twin '
                                    f"(supported: {', '.join(sorted(OPS))})")
        self.state = {}           # layer name -> hidden state an RNN/LSTM carries to the next forward
        self._blob_attrs = {}     # layer name -> attribute names of its parameters/buffers
        self._needs = {}          # layer name -> whether each of its parameters gets a gradient
        shared = {}               # ParamSpec name -> attribute: Caffe's one blob per shared name
        for node in self.layers:
            names, specs = [], node.layer.param.param
            for i, (blob, need) in enumerate(zip(net.params.get(node.name, []), node.param_need_backward)):
                key = specs[i].name if i < len(specs) and specs[i].name else None
                if key in shared:
                    attr = shared[key]
                    if need and node.layer.learnable:
                        getattr(self, attr).requires_grad_(True)
                else:
                    attr = f"l{len(self._blob_attrs)}_{i}"
                    value = torch.tensor(np.array(blob.data), dtype=self.dtype)
                    if node.layer.learnable:
                        self.register_parameter(attr, torch.nn.Parameter(value, requires_grad=need))
                    else:
                        self.register_buffer(attr, value)      # BatchNorm's statistics
                    if key:
                        shared[key] = attr
                names.append(attr)
            self._blob_attrs[node.name] = names
            self._needs[node.name] = list(node.param_need_backward)

    def blobs_of(self, layer_name) -> list:
        """The tensors holding a layer's parameters (or BatchNorm statistics), Caffe's order;
        parameters shared by ParamSpec name are one tensor, its gradient summed over the sharers."""
        return [getattr(self, a) for a in self._blob_attrs[layer_name]]

    def forward(self, inputs: dict, all_blobs=False) -> Outputs:
        """Run every layer in the Net's order. ``inputs``: blob name -> array or tensor.

        Returns the output blobs (every blob with ``all_blobs``: its last value
        after in-place layers) and ``.loss``.
        """
        env, loss = {}, None
        self.feed = inputs
        checked = 0                 # the first axis checked: 1 after a Filter (batch sizes are the data's)
        for node in self.layers:
            # A sharer whose parameter gets no gradient (lr_mult 0) adds none to the shared one.
            blobs = [t if need else t.detach()
                     for t, need in zip(self.blobs_of(node.name), self._needs[node.name])]
            tops = OPS[node.type](self, node, [env[b.name] for b in node.bottoms], blobs)
            checked = 1 if node.type in DATA_DEPENDENT else checked
            for t, tensor, w in zip(node.tops, tops, node.loss_weights or [0] * len(tops)):
                if tuple(tensor.shape)[checked:] != tuple(t.shape)[checked:]:
                    fail(node, f'top "{t.name}" has shape {tuple(tensor.shape)}, the Net says {tuple(t.shape)}')
                env[t.name] = tensor        # an in-place layer rebinds the name
                if w:
                    term = w * tensor.sum()
                    loss = term if loss is None else loss + term
        out = Outputs((k, env[k]) for k in (env if all_blobs else self.outputs))
        out.loss = loss if loss is not None else torch.zeros((), dtype=self.dtype)
        self.feed = None
        return out


def output_names(layers) -> list:
    """Caffe's net outputs: blobs no later layer consumes (an in-place chain's blob counts)."""
    available = {}
    for node in layers:
        for b in node.bottoms:
            available.pop(b.name, None)
        available.update((t.name, None) for t in node.tops)
    return list(available)


# -- helpers --------------------------------------------------------------------
def canonical(axis, n):
    return axis % n if n else 0


def split3(x, axis):
    """x as (outer, channels, inner) around ``axis``."""
    return x.reshape(math.prod(x.shape[:axis]), x.shape[axis], -1)


def with_grad(value, surrogate):
    """``value`` forward, the gradient of ``surrogate`` backward: where Caffe's backward is not
    the exact derivative of its forward (a guard constant, a clamp), the twin copies both."""
    return value.detach() + (surrogate - surrogate.detach())


def spatial(node, p, n, name, default, hw=True):
    """Caffe's per-spatial-axis setting: ``name`` (0, 1 or n values), or name_h/name_w."""
    if hw and n == 2 and (p.HasField(f"{name}_h") or p.HasField(f"{name}_w")):
        return [getattr(p, f"{name}_h"), getattr(p, f"{name}_w")]
    values = list(getattr(p, name))
    if not values:
        return [default] * n
    if len(values) not in (1, n):
        fail(node, f"{name} needs 1 or {n} values")
    return values * n if len(values) == 1 else values


def kernel_of(node, p, n):
    """A ConvolutionParameter's kernel: kernel_h/kernel_w when either is set (2-D), or kernel_size."""
    if n == 2 and (p.HasField("kernel_h") or p.HasField("kernel_w")):
        return [p.kernel_h, p.kernel_w]
    return spatial(node, p, n, "kernel_size", None, hw=False)


@op("Input")
def input_(twin, node, bottoms, blobs):
    tops = []
    for t in node.tops:
        if t.name not in twin.feed:
            fail(node, f'no value given for input "{t.name}"')
        x = twin.feed[t.name]
        tops.append(x if isinstance(x, torch.Tensor) else torch.as_tensor(np.asarray(x), dtype=twin.dtype))
    return tops


# -- vision layers ------------------------------------------------------------------
@op("Convolution", "Deconvolution", "ConvolutionDepthwise")     # the alias's layer param holds its group
def convolution(twin, node, bottoms, blobs):
    p = node.layer.param.convolution_param
    x = bottoms[0]
    n = x.dim() - 2
    if p.axis != 1 or not 1 <= n <= 3:
        fail(node, "only channel axis 1 with 1 to 3 spatial axes")
    kernel = kernel_of(node, p, n)
    args = dict(stride=spatial(node, p, n, "stride", 1), padding=spatial(node, p, n, "pad", 0),
                dilation=spatial(node, p, n, "dilation", 1, hw=False), groups=p.group)
    w, b = blobs[0], (blobs[1] if p.bias_term else None)
    if tuple(w.shape[2:]) != tuple(kernel):
        fail(node, f"kernel {kernel} does not match the weight {tuple(w.shape)}")
    if node.type != "Deconvolution":
        return [(F.conv1d, F.conv2d, F.conv3d)[n - 1](x, w, b, **args)]
    return [(F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d)[n - 1](x, w, b, **args)]


def pooled(length, k, s, p, ceil, padded):
    """Caffe's output size: ceil rounding; with any padding, a last window starting in it is dropped."""
    span = length + 2 * p - k
    out = (-(-span // s) if ceil else span // s) + 1
    if padded and (out - 1) * s >= length + p:
        out -= 1
    return out


@op("Pooling")
def pooling(twin, node, bottoms, blobs):
    pp = node.layer.param.pooling_param
    x = bottoms[0]
    if pp.global_pooling:
        kernel, stride, pad = tuple(x.shape[2:]), (1, 1), (0, 0)
    else:
        kernel = (pp.kernel_h, pp.kernel_w) if pp.HasField("kernel_h") else (pp.kernel_size,) * 2
        stride = (pp.stride_h, pp.stride_w) if pp.HasField("stride_h") else (pp.stride,) * 2
        pad = (pp.pad_h, pp.pad_w) if pp.HasField("pad_h") else (pp.pad,) * 2
    method = {pp.MAX: "MAX", pp.AVE: "AVE"}.get(pp.pool)
    if method is None:
        fail(node, "only MAX and AVE pooling")
    return pool2d(x, method, kernel, stride, pad, pp.round_mode == pp.CEIL, len(node.tops) > 1)


def pool2d(x, method, kernel, stride, pad, ceil, mask=False):
    """Caffe's 2-D pooling. Pads explicitly to exactly the cells Caffe's windows cover, then
    pools without padding or ceil_mode (torch's own padding limits and rounding differ)."""
    H, W = x.shape[2:]
    out = [pooled(L, k, s, p, ceil, any(pad)) for L, k, s, p in zip((H, W), kernel, stride, pad)]
    # rows/cols [-p, (out-1)*s + k - p): after the input, Caffe's windows are clipped.
    extra = [(o - 1) * s + k - p - L for o, s, k, p, L in zip(out, stride, kernel, pad, (H, W))]
    widths = (pad[1], extra[1], pad[0], extra[0])
    if method == "MAX":
        xp = F.pad(x, widths, value=-math.inf)
        if not mask:
            return [F.max_pool2d(xp, kernel, stride)]
        y, idx = F.max_pool2d(xp, kernel, stride, return_indices=True)
        Wp = xp.shape[3]
        h, w = idx // Wp - pad[0], idx % Wp - pad[1]
        return [y, (h * W + w).to(x.dtype)]      # Caffe's mask: argmax as h*W+w in the input
    sums = F.avg_pool2d(F.pad(x, widths), kernel, stride, divisor_override=1)
    # AVE divides by the window clipped at the padding's end (padded cells count).
    sizes = [torch.minimum(torch.arange(o) * s - p + k, torch.tensor(L + p)) - (torch.arange(o) * s - p)
             for o, s, p, k, L in zip(out, stride, pad, kernel, (H, W))]
    return [sums / (sizes[0][:, None] * sizes[1][None, :]).to(x.dtype)]


@op("LRN")
def lrn(twin, node, bottoms, blobs):
    lp = node.layer.param.lrn_param
    x, n = bottoms[0], lp.local_size
    if lp.norm_region == lp.ACROSS_CHANNELS:
        return [F.local_response_norm(x, n, lp.alpha, lp.beta, lp.k)]
    # WITHIN_CHANNEL: Caffe's k is always 1 and the average counts the zero padding.
    mean_sq = F.avg_pool2d(x * x, n, 1, (n - 1) // 2, count_include_pad=True)
    return [x * (1 + lp.alpha * mean_sq) ** -lp.beta]


# -- neuron layers --------------------------------------------------------------
@op("ReLU")
def relu(twin, node, bottoms, blobs):
    slope = node.layer.param.relu_param.negative_slope
    return [F.leaky_relu(bottoms[0], slope) if slope else F.relu(bottoms[0])]


@op("PReLU")
def prelu(twin, node, bottoms, blobs):
    return [F.prelu(bottoms[0], blobs[0].reshape(-1))]


@op("ELU")
def elu(twin, node, bottoms, blobs):
    return [F.elu(bottoms[0], node.layer.param.elu_param.alpha)]


@op("Sigmoid", "TanH", "AbsVal")
def pointwise(twin, node, bottoms, blobs):
    return [{"Sigmoid": torch.sigmoid, "TanH": torch.tanh, "AbsVal": torch.abs}[node.type](bottoms[0])]


@op("Power")
def power(twin, node, bottoms, blobs):
    p = node.layer.param.power_param
    x = bottoms[0]
    if p.power * p.scale == 0:       # a constant: Caffe's gradient is exactly 0
        return [x * 0 + (1.0 if p.power == 0 else p.shift ** p.power)]
    return [(p.shift + p.scale * x) ** p.power]


@op("Dropout")
def dropout(twin, node, bottoms, blobs):
    p = node.layer.param.dropout_param
    if twin.phase == TRAIN:
        if p.dropout_ratio != 0:
            fail(node, "TRAIN-phase dropout draws random masks that cannot match sncaffe's")
        return [bottoms[0]]
    return [bottoms[0] if getattr(p, "scale_train", True) else bottoms[0] * (1 - p.dropout_ratio)]


@op("BatchNorm")
def batch_norm(twin, node, bottoms, blobs):
    """Caffe's BatchNorm (no affine part): blobs are mean sum, variance sum, scale factor."""
    bp = node.layer.param.batch_norm_param
    x = bottoms[0]
    x3 = x.reshape(x.shape[0], x.shape[1] if x.dim() > 1 else 1, -1)
    if bp.use_global_stats if bp.HasField("use_global_stats") else twin.phase == TEST:
        factor = blobs[2]
        inv = torch.where(factor == 0, torch.zeros_like(factor), 1 / factor)
        y = F.batch_norm(x3, blobs[0] * inv, blobs[1] * inv, training=False, eps=bp.eps)
    else:
        # Normalizes by the biased batch variance; momentum 1 leaves the batch mean and the
        # unbiased variance (what Caffe adds to its sums) in mean, var.
        mean, var = torch.zeros_like(blobs[0]), torch.zeros_like(blobs[1])
        y = F.batch_norm(x3, mean, var, training=True, momentum=1.0, eps=bp.eps)
        with torch.no_grad():
            maf = bp.moving_average_fraction
            blobs[2].mul_(maf).add_(1)
            blobs[0].mul_(maf).add_(mean)
            blobs[1].mul_(maf).add_(var if x3.shape[0] * x3.shape[2] > 1 else 0)
    return [y.reshape(x.shape)]


def broadcast(node, x, operand, p):
    """(x3, operand3): x as (outer, dim, inner) around Caffe's axis, the operand as (1, dim, 1)."""
    axis = canonical(p.axis, x.dim()) if operand.dim() else 0
    if tuple(x.shape[axis:axis + operand.dim()]) != tuple(operand.shape):
        fail(node, f"operand {tuple(operand.shape)} does not match {tuple(x.shape)} from axis {axis}")
    x3 = x.reshape(math.prod(x.shape[:axis]), operand.numel(), -1)
    return x3, operand.reshape(1, -1, 1)


@op("Scale")
def scale(twin, node, bottoms, blobs):
    p = node.layer.param.scale_param
    x = bottoms[0]
    s = bottoms[1] if len(bottoms) > 1 else blobs[0]
    x3, s3 = broadcast(node, x, s, p)
    y3 = torch.addcmul(blobs[-1].reshape(1, -1, 1), x3, s3) if p.bias_term else x3 * s3
    return [y3.reshape(x.shape)]


@op("Bias")
def bias(twin, node, bottoms, blobs):
    x = bottoms[0]
    x3, b3 = broadcast(node, x, bottoms[1] if len(bottoms) > 1 else blobs[0], node.layer.param.bias_param)
    return [(x3 + b3).reshape(x.shape)]


@op("InnerProduct")
def inner_product(twin, node, bottoms, blobs):
    p = node.layer.param.inner_product_param
    x = bottoms[0]
    axis = canonical(p.axis, x.dim())
    w = blobs[0].t() if p.transpose else blobs[0]       # (N, K)
    y = x.reshape(math.prod(x.shape[:axis]), -1) @ w.t()
    if p.bias_term:
        y = y + blobs[1]
    return [y.reshape(*x.shape[:axis], p.num_output)]


# -- structure layers --------------------------------------------------------------
@op("Eltwise")
def eltwise(twin, node, bottoms, blobs):
    p = node.layer.param.eltwise_param
    if p.operation == p.PROD:
        return [reduce(torch.mul, bottoms)]
    if p.operation == p.MAX:
        return [reduce(torch.maximum, bottoms)]
    coeffs = list(p.coeff) or [1.0] * len(bottoms)
    return [reduce(torch.add, (x if c == 1 else c * x for x, c in zip(bottoms, coeffs)))]


def cut_axis(p, legacy, n):
    return getattr(p, legacy) if p.HasField(legacy) else canonical(p.axis, n)


@op("Concat")
def concat(twin, node, bottoms, blobs):
    return [torch.cat(bottoms, dim=cut_axis(node.layer.param.concat_param, "concat_dim", bottoms[0].dim()))]


@op("Slice")
def slice_(twin, node, bottoms, blobs):
    p, x = node.layer.param.slice_param, bottoms[0]
    axis = cut_axis(p, "slice_dim", x.dim())
    bounds = [0, *p.slice_point, x.shape[axis]] if p.slice_point else None
    sizes = ([b - a for a, b in zip(bounds, bounds[1:])] if bounds
             else [x.shape[axis] // len(node.tops)] * len(node.tops))
    return list(torch.split(x, sizes, dim=axis))


@op("Split")
def split(twin, node, bottoms, blobs):
    return [bottoms[0]] * len(node.tops)     # autograd sums the top gradients


@op("Flatten")
def flatten(twin, node, bottoms, blobs):
    p, x = node.layer.param.flatten_param, bottoms[0]
    return [x.flatten(canonical(p.axis, x.dim()), canonical(p.end_axis, x.dim()))]


@op("Reshape")
def reshape(twin, node, bottoms, blobs):
    p, x = node.layer.param.reshape_param, bottoms[0]
    shape = list(x.shape)
    start = p.axis if p.axis >= 0 else len(shape) + p.axis + 1
    end = len(shape) if p.num_axes == -1 else start + p.num_axes
    dims = [shape[start + i] if d == 0 else d for i, d in enumerate(p.shape.dim)]   # 0 copies
    return [x.reshape(shape[:start] + dims + shape[end:])]                          # -1 is inferred


@op("Silence")
def silence(twin, node, bottoms, blobs):
    return []


# -- softmax, losses, accuracy ---------------------------------------------------------
@op("Softmax")
def softmax(twin, node, bottoms, blobs):
    x = bottoms[0]
    return [F.softmax(x, dim=canonical(node.layer.param.softmax_param.axis, x.dim()))]


def normalizer(lp, default, outer, inner, valid):
    """Caffe's LossLayer::GetNormalizer (at least 1): explicit mode, legacy ``normalize``, default."""
    if lp.HasField("normalization"):
        mode = lp.NormalizationMode.Name(lp.normalization)
    elif lp.HasField("normalize"):
        mode = "VALID" if lp.normalize else "BATCH_SIZE"
    else:
        mode = default
    if mode == "VALID" and valid is not None:
        return valid.sum().clamp(min=1)
    return max({"FULL": outer * inner, "VALID": outer * inner, "BATCH_SIZE": outer, "NONE": 1}[mode], 1)


def ignore(lp):
    return lp.ignore_label if lp.HasField("ignore_label") else None


@op("SoftmaxWithLoss")
def softmax_loss(twin, node, bottoms, blobs):
    lp = node.layer.param
    x = bottoms[0]
    axis = canonical(lp.softmax_param.axis, x.dim())
    x3 = split3(x, axis)
    label = bottoms[1].detach().reshape(x3.shape[0], x3.shape[2]).long()     # truncation, as static_cast<int>
    ig = ignore(lp.loss_param)
    valid = None if ig is None else label != ig
    safe = label if valid is None else torch.where(valid, label, 0)
    logp = F.log_softmax(x3, dim=1).gather(1, safe[:, None, :])[:, 0]
    if valid is not None:
        logp = logp * valid
    loss = -logp.sum() / normalizer(lp.loss_param, "VALID", x3.shape[0], x3.shape[2], valid)
    # Caffe ignores the diff of the second top (the softmax): no gradient flows through it.
    return [loss] + ([F.softmax(x, dim=axis).detach()] if len(node.tops) > 1 else [])


@op("EuclideanLoss")
def euclidean_loss(twin, node, bottoms, blobs):
    a, b = bottoms
    d = a - b.reshape(a.shape)
    return [(d * d).sum() / a.shape[0] / 2]


@op("SigmoidCrossEntropyLoss")
def sigmoid_ce_loss(twin, node, bottoms, blobs):
    lp = node.layer.param.loss_param
    x = bottoms[0]
    t = bottoms[1].detach().reshape(x.shape)
    loss = F.binary_cross_entropy_with_logits(x, t, reduction="none")
    ig = ignore(lp)
    valid = None if ig is None else t.long() != ig
    if valid is not None:
        loss = loss * valid
    return [loss.sum() / normalizer(lp, "BATCH_SIZE", x.shape[0], x[0].numel(), valid)]


@op("Accuracy")
def accuracy(twin, node, bottoms, blobs):
    p = node.layer.param.accuracy_param
    with torch.no_grad():
        x3 = split3(bottoms[0], canonical(p.axis, bottoms[0].dim()))
        label = bottoms[1].reshape(x3.shape[0], x3.shape[2]).long()
        ig = ignore(p)
        valid = torch.ones_like(label, dtype=torch.bool) if ig is None else label != ig
        safe = torch.where(valid, label, 0)
        true = x3.gather(1, safe[:, None, :])
        rank = (x3 >= true).sum(dim=1) - 1          # ties count against the true class
        hit = (rank < p.top_k) & valid
        ratio = lambda a, b: a.to(x3.dtype) / b.clamp(min=1).to(x3.dtype)   # 0 where b is 0
        tops = [ratio(hit.sum(), valid.sum())]
        if len(node.tops) > 1:
            C = x3.shape[1]
            tops.append(ratio(torch.bincount(safe[hit], minlength=C), torch.bincount(safe[valid], minlength=C)))
        return tops


# -- more neuron layers ------------------------------------------------------------
def base_log(base):
    """Caffe's log(base), with base -1 meaning e (log_base exactly 1)."""
    return 1.0 if base == -1 else math.log(base)


@op("BNLL")
def bnll(twin, node, bottoms, blobs):
    x = bottoms[0]
    return [F.relu(x) + torch.log1p(torch.exp(-x.abs()))]      # log(1 + e^x), overflow-free


@op("Clip")
def clip(twin, node, bottoms, blobs):
    p, x = node.layer.param.clip_param, bottoms[0]
    inside = (x >= p.min) & (x <= p.max)            # the gradient passes at both bounds too
    return [torch.where(inside, x, x.clamp(p.min, p.max).detach())]


@op("Exp")
def exp(twin, node, bottoms, blobs):
    p = node.layer.param.exp_param
    return [torch.exp(p.shift * base_log(p.base) + p.scale * base_log(p.base) * bottoms[0])]


@op("Log")
def log(twin, node, bottoms, blobs):
    p = node.layer.param.log_param
    return [torch.log(p.shift + p.scale * bottoms[0]) / base_log(p.base)]


@op("Swish")
def swish(twin, node, bottoms, blobs):
    x = bottoms[0]
    return [x * torch.sigmoid(node.layer.param.swish_param.beta * x)]


@op("Threshold")
def threshold(twin, node, bottoms, blobs):
    # Caffe has no backward for Threshold (it stops on "Not Implemented Yet").
    return [(bottoms[0] > node.layer.param.threshold_param.threshold).to(bottoms[0].dtype).detach()]


@op("MVN")
def mvn(twin, node, bottoms, blobs):
    """y = (x - mean) / (std + eps) per (item, channel), or per item across channels; the
    population variance. Caffe's backward treats std + eps as std (d(std)/dx = (x - mean) /
    (n (std + eps))): the twin copies that, which differs from the exact gradient by O(eps)."""
    p, x = node.layer.param.mvn_param, bottoms[0]
    x3 = x.reshape(x.shape[0], -1) if p.across_channels else x.reshape(math.prod(x.shape[:2]), -1)
    d = x3 - x3.mean(dim=1, keepdim=True)
    if not p.normalize_variance:
        return [d.reshape(x.shape)]
    var = (d * d).mean(dim=1, keepdim=True)
    s = torch.sqrt(var) + p.eps
    s = with_grad(s, var / (2 * s.detach()))
    return [(d / s).reshape(x.shape)]


# -- more structure layers ------------------------------------------------------------
@op("Reduction")
def reduction(twin, node, bottoms, blobs):
    """Reduces every axis from ``axis`` on; the top keeps the axes before it (0 of them: a scalar)."""
    p, x = node.layer.param.reduction_param, bottoms[0]
    axis = canonical(p.axis, x.dim())
    x2 = x.reshape(math.prod(x.shape[:axis]), -1)
    r = p.ReductionOp.Name(p.operation)
    y = {"SUM": lambda: x2.sum(1), "MEAN": lambda: x2.mean(1), "ASUM": lambda: x2.abs().sum(1),
         "SUMSQ": lambda: (x2 * x2).sum(1)}[r]()
    return [(y * p.coeff).reshape(x.shape[:axis])]


@op("Tile")
def tile(twin, node, bottoms, blobs):
    """The whole block from ``axis`` on, repeated ``tiles`` times (not each element)."""
    p, x = node.layer.param.tile_param, bottoms[0]
    axis = canonical(p.axis, x.dim())
    y = x.reshape(math.prod(x.shape[:axis]), -1).repeat(1, p.tiles)
    return [y.reshape(*x.shape[:axis], x.shape[axis] * p.tiles, *x.shape[axis + 1:])]


@op("Crop")
def crop(twin, node, bottoms, blobs):
    """bottom 0 cut to bottom 1's shape from ``axis`` on: one offset for all those axes, or one
    each. The reference bottom gets no gradient."""
    p, (x, ref) = node.layer.param.crop_param, bottoms
    axis = canonical(p.axis, x.dim())
    offsets = list(p.offset)
    if len(offsets) > 1 and axis + len(offsets) != x.dim():
        fail(node, f"{len(offsets)} offsets for the {x.dim() - axis} axes from {axis}")
    cut = [slice(None)] * axis
    for i in range(axis, x.dim()):
        o = offsets[0 if len(offsets) == 1 else i - axis] if offsets else 0
        cut.append(slice(o, o + ref.shape[i]))
    return [x[tuple(cut)]]


@op("Parameter")
def parameter(twin, node, bottoms, blobs):
    return [blobs[0]]         # the top is the parameter itself: its diff is the top's


# -- layers that pick items by index (never differentiated in the indices) ---------------
def indices(node, values, limit, what):
    """Float indices as ints, truncated as static_cast<int>, each in [0, limit)."""
    idx = values.detach().reshape(-1).long()
    if idx.numel() and bool(((idx < 0) | (idx >= limit)).any()):
        fail(node, f"{what} out of range [0, {limit})")
    return idx


@op("Embed")
def embed(twin, node, bottoms, blobs):
    p, x = node.layer.param.embed_param, bottoms[0]
    y = blobs[0][indices(node, x, p.input_dim, "index")]
    if p.bias_term:
        y = y + blobs[1]
    return [y.reshape(*x.shape, p.num_output)]


@op("BatchReindex")
def batch_reindex(twin, node, bottoms, blobs):
    x, idx = bottoms
    if idx.dim() != 1:
        fail(node, f"the index bottom must have 1 axis, got {tuple(idx.shape)}")
    return [x[indices(node, idx, x.shape[0], "index")]]       # backward scatter-adds


@op("Filter")
def filter_(twin, node, bottoms, blobs):
    """Items whose selector (the last bottom) is non-zero, in order, from every other bottom."""
    sel = bottoms[-1].detach()
    kept = torch.nonzero(sel.reshape(sel.shape[0], -1)[:, 0]).reshape(-1)
    return [b[kept] for b in bottoms[:-1]]


# -- more vision layers ---------------------------------------------------------------
@op("Im2col")
def im2col(twin, node, bottoms, blobs):
    """Columns (N, C*kh*kw, H', W'), channel (c*kh + i)*kw + j, as F.unfold orders them."""
    p, x = node.layer.param.convolution_param, bottoms[0]
    if canonical(p.axis, x.dim()) != 1 or x.dim() != 4 or p.force_nd_im2col:
        fail(node, "only 2-D im2col with channel axis 1")
    kernel = kernel_of(node, p, 2)
    stride, pad = spatial(node, p, 2, "stride", 1), spatial(node, p, 2, "pad", 0)
    dilation = spatial(node, p, 2, "dilation", 1, hw=False)
    cols = F.unfold(x, kernel, dilation=dilation, padding=pad, stride=stride)
    out = [(L + 2 * pd - (d * (k - 1) + 1)) // s + 1
           for L, k, s, pd, d in zip(x.shape[2:], kernel, stride, pad, dilation)]
    return [cols.reshape(x.shape[0], -1, *out)]


@op("SPP")
def spp(twin, node, bottoms, blobs):
    """Level l pools 2^l x 2^l bins with Caffe's Pooling (kernel ceil(H/bins), stride kernel,
    pad (kernel*bins - H + 1)/2, ceil rounding); levels flattened and concatenated per item.
    One level is the Pooling top itself, 4-D."""
    p, x = node.layer.param.spp_param, bottoms[0]
    method = {p.MAX: "MAX", p.AVE: "AVE"}.get(p.pool)
    if method is None or x.dim() != 4:
        fail(node, "only MAX and AVE SPP on 4-axis bottoms")
    levels = []
    for level in range(p.pyramid_height):
        bins = 2 ** level
        kernel = [-(-L // bins) for L in x.shape[2:]]
        pad = [(k * bins - L + 1) // 2 for k, L in zip(kernel, x.shape[2:])]
        levels.append(pool2d(x, method, kernel, kernel, pad, ceil=True)[0])
    if p.pyramid_height == 1:
        return levels
    return [torch.cat([y.flatten(1) for y in levels], dim=1)]


# -- more losses ------------------------------------------------------------------------
LOG_THRESHOLD = 1e-20       # Caffe's kLOG_THRESHOLD: probabilities are clamped to it before log


def clamped_log(p):
    """log(max(p, 1e-20)) with Caffe's gradient 1/max(p, 1e-20), also below the clamp."""
    return torch.log(with_grad(p.clamp(min=LOG_THRESHOLD), p))


@op("ContrastiveLoss")
def contrastive_loss(twin, node, bottoms, blobs):
    """sum over pairs / 2N: similar pairs d^2, dissimilar max(margin - d, 0)^2 (legacy:
    max(margin - d^2, 0)). Caffe's non-legacy gradient divides by d + 1e-4, not d: copied."""
    p = node.layer.param.contrastive_loss_param
    a, b, sim = bottoms
    n = a.shape[0]
    diff = (a - b).reshape(n, -1)
    dist_sq = (diff * diff).sum(1)
    similar = sim.detach().reshape(n).long() != 0         # static_cast<int>: 0.5 is dissimilar
    if p.legacy_version:
        apart = (p.margin - dist_sq).clamp(min=0)
    else:
        dist = torch.sqrt(dist_sq.detach())
        m = (p.margin - dist).clamp(min=0)
        # Caffe's gradient of m^2 with respect to diff: -2 m diff / (d + 1e-4), i.e. that of
        # -m d^2 / (d + 1e-4) with m and d held fixed.
        apart = with_grad(m * m, -m / (dist + 1e-4) * dist_sq)
    return [torch.where(similar, dist_sq, apart).sum() / n / 2]


@op("HingeLoss")
def hinge_loss(twin, node, bottoms, blobs):
    """m = max(0, 1 + s x), s = -1 at the true class and 1 elsewhere; L1 sum(m)/N, L2 sum(m^2)/N."""
    p = node.layer.param.hinge_loss_param
    x = bottoms[0].reshape(bottoms[0].shape[0], -1)
    label = indices(node, bottoms[1], x.shape[1], "label")
    s = torch.ones_like(x).scatter(1, label[:, None], -1.0)
    m = F.relu(1 + s * x)
    return [(m if p.norm == p.L1 else m * m).sum() / x.shape[0]]


def read_blobproto(node, path):
    from sncaffe.proto import sncaffe_pb2 as pb
    blob = pb.BlobProto()
    try:
        with open(path, "rb") as f:
            blob.ParseFromString(f.read())
    except OSError as e:
        fail(node, f"cannot read the infogain matrix: {e}")
    return np.array(blob.double_data or blob.data, np.float64)


@op("InfogainLoss")
def infogain_loss(twin, node, bottoms, blobs):
    """-sum_l H[y, l] log p_l / normalizer, p the softmax of bottom 0 along ``axis``; H the third
    bottom (never differentiated) or the BlobProto file ``source`` (relative to the working
    directory, as Caffe opens it). A second top is the softmax, without gradient."""
    lp = node.layer.param
    x = bottoms[0]
    axis = canonical(lp.infogain_loss_param.axis, x.dim())
    x3 = split3(x, axis)
    K = x3.shape[1]
    if len(bottoms) > 2:
        H = bottoms[2].detach().reshape(K, K)
    else:
        H = torch.as_tensor(read_blobproto(node, lp.infogain_loss_param.source), dtype=x.dtype)
        if H.numel() != K * K:
            fail(node, f"the infogain matrix has {H.numel()} values, not {K}x{K}")
        H = H.reshape(K, K)
    if lp.loss_param.HasField("normalize"):
        fail(node, 'normalize is deprecated, use "normalization" (Caffe refuses it here)')
    label = bottoms[1].detach().reshape(x3.shape[0], x3.shape[2]).long()
    ig = ignore(lp.loss_param)
    valid = torch.ones_like(label, dtype=torch.bool) if ig is None else label != ig
    safe = torch.where(valid, label, 0)
    prob = F.softmax(x3, dim=1)
    rows = H[safe].permute(0, 2, 1)                     # (outer, K, inner): H[y, l]
    per_item = -(rows * clamped_log(prob)).sum(1) * valid
    loss = per_item.sum() / normalizer(lp.loss_param, "VALID", x3.shape[0], x3.shape[2], valid)
    return [loss] + ([prob.detach().reshape(x.shape)] if len(node.tops) > 1 else [])


@op("MultinomialLogisticLoss")
def multinomial_logistic_loss(twin, node, bottoms, blobs):
    """-log(max(p[label], 1e-20)) averaged over the N items; bottom 0 holds probabilities."""
    p = bottoms[0].reshape(bottoms[0].shape[0], -1)
    label = indices(node, bottoms[1], p.shape[1], "label")
    return [-clamped_log(p.gather(1, label[:, None])).sum() / p.shape[0]]


# -- recurrent layers -------------------------------------------------------------------
def lstm_cell(c_prev, gates, cont):
    """Caffe's LSTMUnit: gates in blocks i, f, o, g (not torch's i, f, g, o);
    c = cont f c_prev + i g, h = o tanh(c). Caffe differentiates f = cont sigmoid(f') as if it
    were sigmoid(f') (f (1 - f)), exact only for cont in {0, 1}: the twin copies that."""
    i, f, o, g = gates.chunk(4, dim=-1)
    i, o, g = torch.sigmoid(i), torch.sigmoid(o), torch.tanh(g)
    fv = torch.where(cont == 0, torch.zeros_like(f), cont * torch.sigmoid(f))
    f = with_grad(fv, (fv * (1 - fv)).detach() * f)
    c = f * c_prev + i * g
    return c, o * torch.tanh(c)


@op("LSTMUnit")
def lstm_unit(twin, node, bottoms, blobs):
    c_prev, gates, cont = bottoms
    return list(lstm_cell(c_prev, gates, cont.detach()[..., None]))


def recurrence(twin, node, bottoms, n_state):
    """(x (T, N, D), cont (T, N, 1), x_static (N, Ds) or None, initial states (N, H) each).
    Exposed h_0/c_0 are read without gradient (Caffe shares only their data); otherwise the
    state is what the previous forward left (zero at first), as Caffe's RecurrentLayer."""
    p = node.layer.param.recurrent_param
    x, cont = bottoms[0], bottoms[1].detach()
    T, N = x.shape[:2]
    exposed = n_state if p.expose_hidden else 0
    static = len(bottoms) > 2 + exposed
    x_static = bottoms[2].reshape(N, -1) if static else None
    if exposed:
        states = [b.detach().reshape(N, -1) for b in bottoms[2 + static:]]
    else:
        states = twin.state.get(node.name)
        if states is None or states[0].shape[0] != N:
            states = [torch.zeros(N, p.num_output, dtype=x.dtype)] * n_state
    return x.reshape(T, N, -1), cont.reshape(T, N, 1), x_static, states


def recurrent_tops(twin, node, outputs, states):
    """The output (T, N, H), then with expose_hidden the last states (1, N, H), no gradient."""
    states = [s.detach() for s in states]
    if node.layer.param.recurrent_param.expose_hidden:
        return [torch.stack(outputs)] + [s[None] for s in states]
    twin.state[node.name] = states
    return [torch.stack(outputs)]


@op("RNN")
def rnn(twin, node, bottoms, blobs):
    """h_t = tanh(W_xh x_t + b_h [+ W_xh_static x_static] + W_hh (cont_t h_{t-1})),
    o_t = tanh(W_ho h_t + b_o); parameters W_xh, b_h, [W_xh_static], W_hh, W_ho, b_o."""
    x, cont, x_static, (h,) = recurrence(twin, node, bottoms, 1)
    W_xh, b_h, *rest = blobs
    W_hh, W_ho, b_o = rest[-3:]
    pre = x @ W_xh.t() + b_h
    if x_static is not None:
        pre = pre + x_static @ rest[0].t()
    outputs = []
    for t in range(x.shape[0]):
        h = torch.tanh((cont[t] * h) @ W_hh.t() + pre[t])
        outputs.append(torch.tanh(h @ W_ho.t() + b_o))
    return recurrent_tops(twin, node, outputs, [h])


@op("LSTM")
def lstm(twin, node, bottoms, blobs):
    """gates_t = W_xc x_t + b_c [+ W_xc_static x_static] + W_hc (cont_t h_{t-1}), through
    LSTMUnit; parameters W_xc, b_c, [W_xc_static], W_hc. Exposed states: h, then c."""
    x, cont, x_static, (h, c) = recurrence(twin, node, bottoms, 2)
    W_xc, b_c, *rest = blobs
    W_hc = rest[-1]
    pre = x @ W_xc.t() + b_c
    if x_static is not None:
        pre = pre + x_static @ rest[0].t()
    outputs = []
    for t in range(x.shape[0]):
        c, h = lstm_cell(c, (cont[t] * h) @ W_hc.t() + pre[t], cont[t])
        outputs.append(h)
    return recurrent_tops(twin, node, outputs, [h, c])
