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
            if node.type not in OPS:
                raise TorchNetError(f'layer "{node.name}": type "{node.type}" has no torch twin '
                                    f"(supported: {', '.join(sorted(OPS))})")
        self._blob_attrs = {}     # layer name -> attribute names of its parameters/buffers
        for node in self.layers:
            names = []
            for i, (blob, need) in enumerate(zip(net.params.get(node.name, []), node.param_need_backward)):
                attr = f"l{len(self._blob_attrs)}_{i}"
                value = torch.tensor(np.array(blob.data), dtype=self.dtype)
                if node.layer.learnable:
                    self.register_parameter(attr, torch.nn.Parameter(value, requires_grad=need))
                else:
                    self.register_buffer(attr, value)      # BatchNorm's statistics
                names.append(attr)
            self._blob_attrs[node.name] = names

    def blobs_of(self, layer_name) -> list:
        """The tensors holding a layer's parameters (or BatchNorm statistics), Caffe's order."""
        return [getattr(self, a) for a in self._blob_attrs[layer_name]]

    def forward(self, inputs: dict, all_blobs=False) -> Outputs:
        """Run every layer in the Net's order. ``inputs``: blob name -> array or tensor.

        Returns the output blobs (every blob with ``all_blobs``: its last value
        after in-place layers) and ``.loss``.
        """
        env, loss = {}, None
        self.feed = inputs
        for node in self.layers:
            tops = OPS[node.type](self, node, [env[b.name] for b in node.bottoms], self.blobs_of(node.name))
            for t, tensor, w in zip(node.tops, tops, node.loss_weights or [0] * len(tops)):
                if tuple(tensor.shape) != tuple(t.shape):
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


def spatial(node, p, n, name, default, hw=True):
    """Caffe's per-spatial-axis setting: ``name`` (0, 1 or n values), or name_h/name_w."""
    if hw and n == 2 and p.HasField(f"{name}_h"):
        return [getattr(p, f"{name}_h"), getattr(p, f"{name}_w")]
    values = list(getattr(p, name))
    if not values:
        return [default] * n
    if len(values) not in (1, n):
        fail(node, f"{name} needs 1 or {n} values")
    return values * n if len(values) == 1 else values


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
    if n == 2 and p.HasField("kernel_h"):
        kernel = [p.kernel_h, p.kernel_w]
    else:
        kernel = spatial(node, p, n, "kernel_size", None, hw=False)
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
    """Pad explicitly to exactly the cells Caffe's windows cover, then pool without padding
    or ceil_mode (torch's own padding limits and rounding differ from Caffe's)."""
    pp = node.layer.param.pooling_param
    x = bottoms[0]
    H, W = x.shape[2:]
    if pp.global_pooling:
        kernel, stride, pad = (H, W), (1, 1), (0, 0)
    else:
        kernel = (pp.kernel_h, pp.kernel_w) if pp.HasField("kernel_h") else (pp.kernel_size,) * 2
        stride = (pp.stride_h, pp.stride_w) if pp.HasField("stride_h") else (pp.stride,) * 2
        pad = (pp.pad_h, pp.pad_w) if pp.HasField("pad_h") else (pp.pad,) * 2
    ceil = pp.round_mode == pp.CEIL
    out = [pooled(L, k, s, p, ceil, any(pad)) for L, k, s, p in zip((H, W), kernel, stride, pad)]
    # rows/cols [-p, (out-1)*s + k - p): after the input, Caffe's windows are clipped.
    extra = [(o - 1) * s + k - p - L for o, s, k, p, L in zip(out, stride, kernel, pad, (H, W))]
    widths = (pad[1], extra[1], pad[0], extra[0])
    if pp.pool == pp.MAX:
        xp = F.pad(x, widths, value=-math.inf)
        if len(node.tops) == 1:
            return [F.max_pool2d(xp, kernel, stride)]
        y, idx = F.max_pool2d(xp, kernel, stride, return_indices=True)
        Wp = xp.shape[3]
        h, w = idx // Wp - pad[0], idx % Wp - pad[1]
        return [y, (h * W + w).to(x.dtype)]      # Caffe's mask: argmax as h*W+w in the input
    if pp.pool != pp.AVE:
        fail(node, "only MAX and AVE pooling")
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
