"""Caffe's layer settings as the exporters need them, read from a built layer (its setup has
checked them) so that ONNX and PyTorch get the same numbers."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import ExportError

# Types that have no faithful export to either format, with the reason
REFUSED = {
    "DetectionOutput": "its non-maximum suppression keeps a number of boxes that depends on the data, in "
                       "the fork's own rows and order; without it in the prototxt, the net up to its inputs exports",
    "PSROIPooling": "position-sensitive roi pooling has no ONNX operator, and its averages over bins whose "
                    "edges depend on the rois' values have no exact composition of ONNX operators",
}


def refuse(node, why):
    raise ExportError(f'layer "{node.name}" ({node.type}): {why}')


def params(node) -> list:
    """The layer's parameter blobs as float32 arrays (copies)."""
    return [np.array(b.data, dtype=np.float32) for b in node.layer.blobs]


def canonical(axis, n):
    return axis % n if n else 0


@dataclass
class Conv:
    kernel: tuple
    stride: tuple
    pad: tuple
    dilation: tuple
    group: int


def conv(node) -> Conv:
    """A Convolution's or Deconvolution's geometry, for 1 to 3 spatial axes."""
    layer = node.layer
    p = layer.param.convolution_param          # a ConvolutionDepthwise's copy holds its group
    if canonical(p.axis, len(node.bottoms[0].shape)) != 1:
        refuse(node, "only channel axis 1 is exported")
    if getattr(layer, "nd", False):
        return Conv(layer.kernel, layer.stride, layer.pad, layer.dilation, layer.group)
    from ..layers.conv import _spatial
    return Conv(*(tuple(_spatial(layer, p, f, d)) for f, d in
                  (("kernel_size", 0), ("stride", 1), ("pad", 0), ("dilation", 1))), p.group)


@dataclass
class Pool:
    method: str              # MAX | AVE
    kernel: tuple
    stride: tuple
    pad: tuple
    end_pad: tuple           # padding after the input that Caffe's last window reaches (>= 0)
    out: tuple
    is_global: bool
    divisor: np.ndarray | None     # AVE: Caffe's window sizes where they differ from the kernel's


def pool(node) -> Pool:
    """A Pooling layer's windows as Caffe computes them: its output size (ceil or floor
    rounding, a last window starting in the padding dropped), the padding after the input
    that the last window covers, and AVE's divisor (each window clipped at the padded end)."""
    from ..layers.pooling import AVE, MAX
    layer = node.layer
    if len(node.tops) > 1 and layer.is_global:
        refuse(node, "the second top (the argmax mask) of global pooling is not exported")
    if layer.method not in (MAX, AVE):
        refuse(node, "only MAX and AVE pooling are exported (STOCHASTIC draws at random)")
    method = "MAX" if layer.method == MAX else "AVE"
    k, s, p, n, o = layer.kernel, layer.stride, layer.pad, layer.in_hw, layer.pooled
    end = tuple(max((oi - 1) * si + ki - pi - ni, 0) for oi, si, ki, pi, ni in zip(o, s, k, p, n))
    divisor = None
    if method == "AVE" and any(e > pi for e, pi in zip(end, p)):
        sizes = [np.minimum(np.arange(oi) * si - pi + ki, ni + pi) - (np.arange(oi) * si - pi)
                 for oi, si, pi, ki, ni in zip(o, s, p, k, n)]
        divisor = (sizes[0][:, None] * sizes[1][None, :]).astype(np.float32)
    return Pool(method, k, s, p, end, o, bool(layer.is_global), divisor)


def operand_shape(node, x_shape, operand_shape) -> tuple:
    """A Scale's or Bias's operand shaped to broadcast against the bottom (NumPy rules):
    its axes, then ones to the bottom's last axis."""
    p = node.layer.param.scale_param if node.type == "Scale" else node.layer.param.bias_param
    operand_shape = tuple(operand_shape)
    axis = canonical(p.axis, len(x_shape)) if operand_shape else len(x_shape)
    return operand_shape + (1,) * (len(x_shape) - axis - len(operand_shape))


def batch_norm(node):
    """(mean, variance, eps) of a BatchNorm using its stored statistics: Caffe's sums divided
    by the moving-average factor (blob 2; 0 leaves them 0)."""
    layer = node.layer
    if not layer.use_global_stats:
        refuse(node, "normalizes by the batch's statistics (use_global_stats false, or the TRAIN "
                     "phase): export the TEST phase")
    mean, var, factor = params(node)
    inv = 0.0 if factor.reshape(-1)[0] == 0 else 1.0 / factor.reshape(-1)[0]
    return mean * np.float32(inv), var * np.float32(inv), float(layer.eps)


def base_log(base):
    """Caffe's ln(base), with base -1 meaning e."""
    return 1.0 if base == -1 else float(np.log(base))


def slice_sizes(node) -> tuple:
    """(axis, sizes) of a Slice layer's tops."""
    p = node.layer.param.slice_param
    n = len(node.bottoms[0].shape)
    axis = p.slice_dim if p.HasField("slice_dim") else canonical(p.axis, n)
    return axis, [t.shape[axis] for t in node.tops]


def concat_axis(node) -> int:
    p = node.layer.param.concat_param
    return p.concat_dim if p.HasField("concat_dim") else canonical(p.axis, len(node.bottoms[0].shape))


def refuse_batch_bn(node):
    """A fork BN that normalizes by the batch's statistics has nothing to export."""
    layer = node.layer
    if layer.batch_stats:
        refuse(node, "caffe-segnet's bn_mode LEARN normalizes by the batch's statistics: export with "
                     "bn_mode: INFERENCE" if layer.segnet else "normalizes by the batch's statistics "
                     "(the TRAIN phase without frozen): export the TEST phase")
    if len(node.tops) > 1:
        refuse(node, "the batch mean and variance tops are not exported")


def interp(node) -> tuple:
    """An Interp's crop of the input (rows, columns as slices) and its output size."""
    layer = node.layer
    return layer.crop, tuple(node.tops[0].shape[2:])


def upsample_mask_source(net, node):
    """The Pooling layer whose mask top an Upsample reads; refused when the mask comes from
    elsewhere (its values would be any floats, not the cells a pooling chose)."""
    mask = node.bottoms[1].name
    other, i = writer(net, mask)
    if other is None or other.type != "Pooling" or i != 1:
        refuse(node, f'its mask "{mask}" is not the second top of a MAX Pooling layer')
    return other


def writer(net, blob) -> tuple:
    """(the layer, its top index) that wrote ``blob``, looking through Split layers; (None, 0)
    for a blob no layer writes."""
    source = {t.name: (node, i) for node in net.graph.layers for i, t in enumerate(node.tops)}
    while blob in source and source[blob][0].type == "Split":
        blob = source[blob][0].bottoms[0].name
    return source.get(blob, (None, 0))


def prior_boxes(node) -> np.ndarray:
    """A PriorBox top's values: they depend on the bottoms' shapes only, fixed in an export."""
    layer = node.layer
    boxes = layer.boxes(tuple(node.bottoms[0].shape[-2:]), tuple(node.bottoms[1].shape[-2:]))
    return boxes.astype(np.float32).reshape(node.tops[0].shape)


def check_mapped(net, maps, target):
    """ExportError naming the first layer of ``net`` with no mapping in ``maps`` (for ``target``,
    "ONNX" or "PyTorch"); a refused type's reason where there is one."""
    unmapped = [n for n in net.graph.layers if n.type not in maps and n.type != "Input"]
    if unmapped:
        n = unmapped[0]
        if n.type in REFUSED:
            refuse(n, f"not exported: {REFUSED[n.type]}")
        raise ExportError(f'layer "{n.name}": type "{n.type}" has no {target} mapping (mapped: '
                          f"{', '.join(sorted(maps))})")


def registrar(table):
    """A decorator factory that files a mapping function under the layer types it maps."""
    def maps(*types):
        def deco(fn):
            for t in types:
                table[t] = fn
            return fn
        return deco
    return maps
