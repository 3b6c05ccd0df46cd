"""Convolution and Deconvolution on oneDNN (``backend/onednn.py``): float32 on the CPU.

In Caffe's conv view (image -> grid), as ``im2col.ConvPlan``: a Convolution's forward is
oneDNN's forward, its input gradient oneDNN's backward-data; a Deconvolution's forward is
the backward-data and its input gradient the forward. oneDNN chooses the layouts of x, y and
the weights (``format_tag::any``) but where ``layout`` names one for x and y; the arrays stay NCHW
and OIHW, reordered in and out through the workspace where its kernels want another. Every primitive runs on blocks of
``layer.reduce_block`` images counted from the chunk's first image (``reduce_block``: enough
images for BLOCK_POSITIONS output positions, from the geometry alone; the chunk contract of
``conv.py``): the weight gradient of each block is added into the diff in image order, and
forward and backward-data, whose kernels may be chosen by the minibatch, see the same
minibatches whatever the chunk, so every chunk size that is a multiple of the block gives the
same bits. The workspace holds everything oneDNN uses: the pass's scratchpad and its reordered
copies of the arguments (and the block's weight gradient where it is not added by a reorder).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..backend import is_gpu, onednn

WORKSPACE = "onednn"


@dataclass(frozen=True)
class Geometry:
    """A convolution in the conv view, as oneDNN is given it."""
    channels: int           # image side
    num_output: int         # grid side
    group: int
    size: tuple             # image (h, w)
    kernel: tuple
    stride: tuple
    pad: tuple
    dilation: tuple
    layout: str = "any"     # of x and y in the kernels (``layout``)

    def conv(self, n) -> onednn.Conv:
        """The primitives at n images."""
        return onednn.conv(n, self.channels, self.num_output, self.group, self.size, self.kernel, self.stride,
                           self.pad, self.dilation, self.layout)

    @property
    def weight_size(self):
        return self.num_output * self.channels // self.group * self.kernel[0] * self.kernel[1]


def geometry(layer, plan, size):
    """The layer's Geometry where oneDNN runs it (float32 on the CPU, no ConvPlan options,
    ``SNCAFFE_CONV`` not ``native``, oneDNN loaded), else None."""
    if is_gpu(layer.target) or np.dtype(layer.dtype) != np.float32 or layer.plan_options:
        return None
    try:
        if onednn.choice() != "onednn":
            return None
    except (ValueError, RuntimeError) as e:
        raise layer.error(str(e)) from None
    return Geometry(plan.C, plan.M, plan.group, tuple(size), plan.kernel, (plan.h.stride, plan.w.stride),
                    (plan.h.pad, plan.w.pad), (plan.h.dilation, plan.w.dilation), layout(plan))


def layout(plan) -> str:
    """The layout of x and y in the layer's kernels: oneDNN's choice ("any") but for two rules."""
    if plan.kernel == (1, 1):      # one GEMM on x as given: tools/bench_toggle.py --path nchw-1x1, ResNet-50
        return "nchw"
    if plan.Cg >= 4 and plan.Mg % 8:   # no block padded to 8 or 16 outputs: bench_toggle.py --path nhwc, LeNet
        return "nhwc"
    return "any"


# A block is large enough that oneDNN's kernels run at full speed on it (the GPU path's rule:
# layers/conv_gpu.py). Every primitive runs block by block, so a block's workspace is all a
# pass needs whatever its chunk: chunking such a layer saves nothing (conv.py offers no chunks).
BLOCK_POSITIONS = 65536


# A layer with one input channel per group (not depthwise) has that channel padded to a block
# of 16 in oneDNN's copies: sixteen times the data. Its blocks hold at most this many bytes of
# copies, a rule for the plan's peak, not for speed (within noise: tools/bench_toggle.py).
SINGLE_CHANNEL_BLOCK_BYTES = 2 << 20


def reduce_block(plan) -> int:
    """Images per block: enough for BLOCK_POSITIONS positions of the image or the grid side,
    whichever is larger (the plan's conv view; geometry only); for a layer with one input channel
    per group on oneDNN's own layout, no more than SINGLE_CHANNEL_BLOCK_BYTES of padded copies."""
    positions = max(plan.out_size, plan.h.size * plan.w.size)
    images = max(1, -(-BLOCK_POSITIONS // positions))
    if plan.Cg == 1 and plan.Mg > 1 and layout(plan) == "any":
        pad = lambda c: -(-c // 16) * 16           # noqa: E731 - channels in blocks of 16
        copies = 4 * (plan.h.size * plan.w.size * pad(plan.C) + plan.out_size * pad(plan.M))
        images = max(1, min(images, SINGLE_CHANNEL_BLOCK_BYTES // copies))
    return images


def _blocks(layer, n):
    step = min(layer.reduce_block, n)
    return [slice(i, min(i + step, n)) for i in range(0, n, step)]


# The input gradient's pass and the name of dy in both backward passes: a Convolution's dy is the
# grid side of backward-data and backward-weights, a Deconvolution's the image side of forward and
# backward-weights.
_PAIR = {False: ("data", "y"), True: ("forward", "x")}


def workspace(layer, n):
    """Workspace specs for chunks of ``n`` images: one byte buffer, sized for the largest pass."""
    g = layer.dnn
    sizes = {len(range(*b.indices(n))) for b in _blocks(layer, n)}
    dw = onednn._round(4 * g.weight_size)
    # forward: a Deconvolution's is the backward-data pass
    forward = "data" if layer.deconv else "forward_bias" if layer.bias_term else "forward"
    need = [g.conv(m).nbytes(forward) for m in sizes]
    # backward: both passes' steps with dy's copy in the first slot (``backward``), after the
    # weight gradient's block where the reorder out of oneDNN's layout does not add it onto dw
    kind, shared = _PAIR[layer.deconv]
    for m in sizes:
        conv = g.conv(m)
        adds = conv.adds(shared)
        need += [(0 if adds else dw) + conv.nbytes(step, shared, adds) for step in ("weights", kind)]
    return {WORKSPACE: ((max(need),), np.uint8)}


def backward(layer, dy, x, dx):
    """Backward of Convolution or Deconvolution, block by block: dw += the block's weight gradient
    (blocks in image order), then the block's input gradient. Both passes read dy, reordered into
    oneDNN's layout once for the two (``onednn.Conv.run_two``). Where oneDNN keeps the weight
    gradient in its own layout, its reorder out adds it into dw (``onednn.Conv.adds``: the bits of
    ``dw += gradient``); else it is written into the workspace's first slot and added with NumPy."""
    g, ws, w = layer.dnn, layer.workspace[WORKSPACE], layer.blobs[0].data
    learn = layer._learns(0)
    kind, name = _PAIR[layer.deconv]
    other = "x" if name == "y" else "y"
    dw = layer.blobs[0].diff
    for s in _blocks(layer, dy.shape[0]):
        conv = g.conv(s.stop - s.start)
        adds = conv.adds(name)
        if adds:
            target, rest = dw, ws
        else:       # the weight gradient's block buffer first, the passes' workspace after it
            target = ws[:4 * g.weight_size].view(np.float32).reshape(dw.shape)
            rest = ws[onednn._round(4 * g.weight_size):]
        weights = ("weights", {other: x[s], "w": target})
        data = (kind, {other: dx[s], "w": w}) if dx is not None else None
        if learn and data:
            conv.run_two(rest, weights, data, name, dy[s], accumulate=adds)
        elif learn or data:
            todo = weights if learn else data
            conv.run(todo[0], rest, name, adds, **{name: dy[s]}, **todo[1])
        if learn and not adds:
            dw += target


def _run(layer, kind, x, y, b=None):
    """One primitive over the chunk, block by block (x: image side, y: grid side)."""
    g, ws, w = layer.dnn, layer.workspace[WORKSPACE], layer.blobs[0].data
    for s in _blocks(layer, x.shape[0]):
        g.conv(s.stop - s.start).run(kind, ws, x=x[s], w=w, y=y[s], b=b)


def conv_forward(layer, x, y):
    bias = layer.blobs[1].data if layer.bias_term else None
    _run(layer, "forward" if bias is None else "forward_bias", x, y, bias)


def deconv_forward(layer, x, y):
    _run(layer, "data", y, x)
    if layer.bias_term:
        y += layer.blobs[1].data.reshape(-1, 1, 1)
