"""Convolution and Deconvolution on oneDNN (``backend/onednn.py``): float32 on the CPU.

In Caffe's conv view (image -> grid), as ``im2col.ConvPlan``: a Convolution's forward is
oneDNN's forward, its input gradient oneDNN's backward-data; a Deconvolution's forward is
the backward-data and its input gradient the forward. Every primitive runs on blocks of
``layer.reduce_block`` images counted from the chunk's first image (``reduce_block``: enough
images for BLOCK_POSITIONS output positions, from the geometry alone; the chunk contract of
``conv.py``): the weight gradient of each block is written by oneDNN into the workspace and
added into the diff in image order, and forward and backward-data, whose kernels may be
chosen by the minibatch, see the same minibatches whatever the chunk, so every chunk size
that is a multiple of the block gives the same bits. The workspace holds everything oneDNN
uses: the block's weight gradient, then the pass's scratchpad and blocked copies of its
arguments.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..backend import is_gpu, onednn
from ..backend import threads as _threads

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
    layout: str             # of x and y in the kernels: NCHW (as given), BLOCKED (the kernels' own), NHWC
                            # (reorders through the workspace where not NCHW)
    forward_layout: str = ""    # a Convolution's forward pass, where it runs in another (``forward_layout``)
    weights_layout: str = ""    # its weight gradient's pass on one thread, where another (``weights_layout``)

    @property
    def weights_every_budget(self) -> bool:
        """Whether ``weights_layout`` holds on any number of threads (its NHWC rule), not on one only."""
        return self.weights_layout == NHWC

    def conv(self, n, kind="", one_thread=None) -> onednn.Conv:
        """The primitives at n images in ``layout`` (the input gradient's pass), or in the layout of
        the ``kind`` "forward" or "weights" pass (the latter's on a budget of one thread, or as if
        ``one_thread``: the budget is read at each call)."""
        own = self.forward_layout if kind == "forward" else ""
        if kind == "weights" and self.weights_layout:
            one = _threads.current().threads == 1 if one_thread is None else one_thread
            own = self.weights_layout if one or self.weights_every_budget else ""
        return onednn.conv(n, self.channels, self.num_output, self.group, self.size, self.kernel, self.stride,
                           self.pad, self.dilation, own or self.layout)

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
    if not layer.deconv and native(plan):
        return None
    chosen = layout(plan)
    return Geometry(plan.C, plan.M, plan.group, tuple(size), plan.kernel, (plan.h.stride, plan.w.stride),
                    (plan.h.pad, plan.w.pad), (plan.h.dilation, plan.w.dilation), layout=chosen,
                    forward_layout="" if layer.deconv else forward_layout(plan, chosen),
                    weights_layout="" if layer.deconv else weights_layout(plan, chosen))


NCHW, BLOCKED, NHWC = "nchw", "blocked", "nhwc"


def native(plan) -> bool:
    """Whether a Convolution runs on sncaffe's own ConvPlan (its strided gather and one GEMM)
    rather than oneDNN: on a CPU without AVX-512, a strided 1x1 convolution with at least four
    times as many input channels per group as output positions an image (ResNet-50's res5
    projections). Measured on an AMD EPYC with AVX2 (``tools/bench_conv.py --backends``, forward
    + both backward passes, ms, oneDNN's choice / ConvPlan): one thread, batch 2, 1024 -> 512
    /2 on 14x14 7.0 / 5.2-5.9, 1024 -> 2048 /2 20.7 / 17.8-20.6; batch 8 24.8 / 16.3 and 70.4 /
    61.4; two threads, batch 8, 12.9 / 9.9 and 35.8 / 32.8. With fewer channels a position ConvPlan
    wins on one thread but loses on two (its gather runs on one): 256 -> 128 /2 on 56x56 at
    batch 8 23.5 / 21.1 on one, 12.4 / 15.2 on two; 512 -> 256 /2 on 28x28 19.9 / 18.1 and
    10.5 / 12.1."""
    return (plan.kernel == (1, 1) and (plan.h.stride > 1 or plan.w.stride > 1) and not _avx512()
            and plan.Cg >= 4 * plan.out_size)


def layout(plan) -> str:
    """The layout x and y take in the layer's oneDNN kernels: NCHW as given, else reordered in and
    out through the workspace into the kernels' own (BLOCKED: channels in blocks of the vector
    width) or NHWC. ``blocked`` gives the choice between NCHW and BLOCKED; a layer whose channels
    do not fill the vector blocks runs NHWC instead (oneDNN's brgemm kernels, which pad nothing):
    several input channels with output channels per group not a multiple of 8 (``blocked`` chose
    NCHW there: im2col and a GEMM), and on an Intel Xeon (AVX-512, blocks of 16) also more than 16
    input channels per group not a multiple of 16 (the blocked kernels pad them). Measured
    (forward + both backward passes, float32, 64 images, one thread; docs/benchmarks.md): on the
    Xeon LeNet's conv2 (20 -> 50, 5x5 on 12x12) NCHW 9.9-10.1 ms, blocked 8.97-9.43, NHWC 6.4-6.7
    (two threads 4.9 / 4.7 / 3.3); 24 -> 32 (3x3 on 28x28) blocked 5.1, NHWC 4.3; channels in
    multiples of 16 (the CIFAR and ResNet 3x3s) the same either way (0.93-1.07), depthwise 1.1-2.1x
    slower in NHWC, and first layers (3 input channels) 1.07-1.26x. On an AMD EPYC (AVX2, blocks of
    8) NCHW / NHWC: LeNet's conv2 13.8 / 12.6 ms (two threads 6.8 / 6.4), 12 -> 20 (3x3 on 28x28)
    23.3 / 16.2, 48 -> 100 (3x3 on 14x14) 55.1 / 52.5; but 24 -> 32 blocked 34.8, NHWC 40.9, so
    there more input channels never choose NHWC. Few channels do, there: with at most 16 input and
    16 output channels per group (a block or two of 8) the NHWC kernels beat the blocked ones
    (``python tools/bench_conv.py --backends --only "cifar 3x3 16"``, batch 128, one thread: the
    CIFAR ResNet's 16 -> 16 on 32x32 blocked 28.4 ms, NHWC 27.4-27.5; one-off runs of other shapes,
    NHWC / blocked: 8 -> 8 on 32x32 0.87-0.89 on one thread and two, 16 -> 16 on 16x16 0.89-0.93,
    4 -> 16 0.85, 16 -> 8 0.86, 16 -> 16 /2 0.92, 5x5 16 -> 16 0.90), but not with more on either
    side (16 -> 32 1.14, 24 -> 24 1.27-1.29, 32 -> 32 on 32x32 1.13)."""
    chosen = BLOCKED if blocked(plan) else NCHW
    if plan.kernel == (1, 1) or plan.Cg < 4:
        return chosen
    if plan.Mg % 8 or (_intel() and plan.Cg > 16 and plan.Cg % 16):
        return NHWC
    if not _avx512() and plan.Cg <= 16 and plan.Mg <= 16:
        return NHWC
    return chosen


def forward_layout(plan, chosen) -> str:
    """The layout of a Convolution's forward pass, where it differs from ``chosen`` (the backward
    passes'), else "": on a CPU without AVX-512, NHWC for a 3x3 stride-1 convolution with at least
    4 input channels per group and at most 784 output positions an image or at least 256 outputs per
    group. Its forward kernels (brgemm) beat the blocked ones there, though not their backward
    passes (measured on an AMD EPYC with AVX2, forward alone, reorders included, NHWC / blocked,
    medians of 11-15 interleaved runs, one thread and two alike: ResNet-50's 3x3s at batch 8 128 on
    28x28 0.92, 256 on 14x14 0.91-0.92, 512 on 7x7 0.83-0.84 (batch 2: 0.91, 0.95, 0.99), the CIFAR
    ResNet's 64 on 8x8 at batch 128 0.80-0.85 (32 on 16x16 0.98-1.02), DenseNet's 128 -> 32 on
    14x14 0.86-0.91, VGG's 256 on 56x56 0.96-0.97 and 512 on 28x28 0.92-0.93; but more positions
    with fewer outputs lose: 64 on 56x56 1.02-1.04, 32 on 32x32 1.17-1.19, 128 -> 32 on 56x56 1.10,
    64 on 224x224 1.05). Strided 3x3s are as fast either way (0.92-1.27 by run), and so keep theirs.
    The backward passes keep ``chosen`` (NHWC's backward-data and weights 3-15 % slower on those
    shapes); each pass reorders its arguments through the workspace, so the two need not agree."""
    if chosen == NHWC or _avx512() or plan.kernel != (3, 3) or plan.Cg < 4 \
            or (plan.h.stride, plan.w.stride, plan.h.dilation, plan.w.dilation) != (1, 1, 1, 1):
        return ""
    return NHWC if plan.out_size <= 784 or plan.Mg >= 256 else ""


def weights_layout(plan, chosen) -> str:
    """The layout of a Convolution's weight-gradient pass, where it differs from ``chosen`` (the
    input gradient's), else "".

    On an AMD CPU without AVX-512, NHWC on every budget for a layer on NCHW with one input channel
    per group and several outputs (``blocked``: a grayscale first layer such as LeNet's conv1): x
    is its own NHWC copy (one channel), dy alone is reordered, and the brgemm kernel beats NCHW's
    GEMM kernel (measured on an AMD EPYC with AVX2, weights pass alone, reorders included, batch
    64, NCHW / NHWC ms, one thread and two: LeNet's 1 -> 20 5x5 on 28x28 2.05-2.22 / 1.59-1.93 and
    2.07-2.18 / 1.02-1.20; 1 -> 32 5x5 2.62 / 2.69 and 2.43 / 1.90; 1 -> 20 3x3 1.39 / 1.43 and
    1.29 / 0.62; 1 -> 16 3x3 on 64x64 5.89 / 5.84 and 5.91 / 4.18).

    On one thread, on a CPU without AVX-512, NCHW (oneDNN's GEMM kernel,
    x and dy read as they are) for a layer with at least 256 input and 256 output channels per group.
    On two threads the blocked kernels keep it (``Geometry.conv`` reads the budget at each call):
    there the GEMM kernel gains less and NumPy's add of its gradient (one thread) costs more.
    Measured on an AMD EPYC with AVX2 (weights pass alone, reorders included, NCHW / blocked, medians of 9
    interleaved runs, one thread): ResNet-50's 3x3 256 on 14x14 at batch 2 5.66 / 6.92 ms, at
    batch 8 22.5 / 26.7, 512 on 7x7 6.00 / 8.01 and 22.1 / 28.3 (two threads, batch 2: 3.08 / 3.33
    and 3.84 / 4.18), 256 on 28x28 0.91x, VGG's 512 on 14x14 0.81x, 1024 on 7x7 0.69x; its blocked
    1x1s 1024 -> 256 on 14x14 2.34 / 2.60 (batch 8: 9.41 / 9.93), 512 -> 2048 and 2048 -> 512 on
    7x7 2.35 / 2.86 and 2.41 / 2.89. With fewer channels the blocked kernels win: 128 on 28x28 1.06x,
    128 on 14x14 and 7x7 0.93-1.01x, 64 on 8x8 1.20-1.27x, 128 -> 32 1.67-1.84x, 32 on 16x16 2.07x.
    The gradient then comes out in OIHW and is added into the diff by NumPy (``backward``). Whole
    net (``tools/bench_toggle.py --path weights-nchw``): ResNet-50 at batch 2 1.010x (three runs), at
    batch 8 1.015x on one thread; at batch 2 on two threads 0.980x, hence one thread only. The GEMM
    kernel's gradient bits follow the thread count (the blocked kernels' do not), as a threaded
    GEMM's may."""
    if _one_channel_on_amd_avx2(plan):
        return NHWC if chosen == NCHW and plan.kernel != (1, 1) else ""
    if chosen == NCHW or _avx512() or plan.Cg < 256 or plan.Mg < 256:
        return ""
    return NCHW


def _one_channel_on_amd_avx2(plan) -> bool:
    """One input channel per group and several outputs (not depthwise), on a CPU neither Intel's
    nor with AVX-512: NCHW's kernels there (``blocked``), the weight gradient NHWC's
    (``weights_layout``)."""
    return plan.Cg == 1 and plan.Mg > 1 and not _intel() and not _avx512()


def blocked(plan) -> bool:
    """Whether the layer runs on oneDNN's blocked direct kernels (its arguments reordered in and
    out) rather than on NCHW (``layout`` may choose NHWC over either). Measured
    (tools/bench_conv.py --backends, one thread): on AVX-512 a 1x1
    convolution is one GEMM on NCHW, faster than reordering its bottom and top (ResNet-50's 1x1s
    0.7-0.9x the blocked time); output channels per group that are not a multiple of the
    vector block (8 floats) pad every block (on an AMD EPYC, LeNet's 20 and 50: NCHW 0.35x and
    0.75x the blocked time); every other kernel, depthwise included, runs 1.5-3x faster blocked,
    reorders included. On an Intel Xeon (AVX-512) one input channel per group is the exception:
    LeNet's conv1 (1 -> 20) blocked, forward + backward at batch 64, 1.9 ms where NCHW takes 2.45
    on one thread and 1.1 where it takes 2.2 on two (its conv2, 20 -> 50, the same either way);
    its blocks are kept small (``reduce_block``), since one channel is padded to a block of 16.
    The measurements above were taken on AVX-512 machines (an Intel Xeon, an AMD EPYC).
    On a CPU without AVX-512 (an AMD EPYC with AVX2, ``tools/bench_conv.py --backends``, ResNet-50's
    shapes at batch 8, one thread) a 1x1 convolution with at least four times as many input
    channels per group as input positions an image runs blocked (NCHW runs a small GEMM per image:
    1024 -> 256 on 14x14 NCHW 41.9 ms, blocked 30.7; 2048 -> 512 on 7x7 48.3 and 30.1; 960 -> 160
    on 7x7 5.1 and 4.8; at twice as many 512 -> 512 on 14x14 32.2 and 29.4, but MobileNet-v2's
    576 -> 96 on 14x14 and 160 -> 960 on 7x7 blocked 5-15% slower at batch 2; 256 -> 1024 on
    14x14 28.8 and 30.0, 384 -> 64 on 28x28 10.8 and 13.2). First layers stay blocked there:
    with all three passes NCHW looks faster (ResNet-50's conv1 101 ms against 134), but a first
    layer computes no data gradient, and forward + weight gradient alone is faster blocked (53.4
    against 67.0 ms; 3x3/2 3 -> 32 on 224x224 6.4 and 10.1) or about the same (3x3 3 -> 64 on
    224x224 56.7 and 55.0). But one input channel per group (not depthwise) runs NCHW there: padded
    to a block of 8, the blocked kernels took 0.7-1.3x NCHW's time forward and 2.2-3.8x in each
    backward pass (one thread, batch 64, NCHW / blocked ms, forward, data, weights: 1 -> 32 5x5 on
    28x28 1.76 / 1.80, 2.25 / 8.53, 2.62 / 7.70; 1 -> 64 3x3 on 32x32 3.46 / 4.37, 4.88 / 12.90,
    3.63 / 12.71; 1 -> 16 3x3 on 64x64 5.67 / 4.11, 5.62 / 12.72, 5.89 / 13.07; on two threads
    0.6-1.4x forward, 2.0-4.3x backward), so NCHW wins a first layer's forward and weight gradient
    together in each (1 -> 16 on 64x64: 11.6 against 17.2 ms)."""
    if plan.kernel == (1, 1):
        return not _avx512() and plan.Mg % 8 == 0 and plan.Cg >= 4 * plan.h.size * plan.w.size
    if _one_channel_on_amd_avx2(plan):
        return False
    return plan.Cg == 1 and (plan.Mg == 1 or _intel()) or plan.Mg % 8 == 0


_CPU = []       # (vendor, AVX-512) of this machine, read once


def _cpu():
    if not _CPU:
        vendor, flags = "", set()
        try:
            with open("/proc/cpuinfo") as f:
                for line in f:
                    if line.startswith("vendor_id") and not vendor:
                        vendor = line.split(":", 1)[1].strip()
                    elif line.startswith("flags") and not flags:
                        flags = set(line.split(":", 1)[1].split())
        except OSError:
            pass
        _CPU.append((vendor, "avx512f" in flags))
    return _CPU[0]


def _intel() -> bool:
    """Whether the CPU is Intel's (the vendor in /proc/cpuinfo): one input channel per group then
    runs blocked and unfilled input channel blocks NHWC; elsewhere, or unknown, the rules measured
    on AMD."""
    return _cpu()[0] == "GenuineIntel"


def _avx512() -> bool:
    """Whether the CPU has AVX-512 (``avx512f`` in /proc/cpuinfo's flags; unknown: as if it had):
    the rules measured on the AVX-512 machines (an Intel Xeon, an AMD EPYC), else AVX2's."""
    return _cpu()[1] or not _cpu()[0]


# A block is large enough that oneDNN's kernels run at full speed on it (the GPU path's rule:
# layers/conv_gpu.py). Every primitive runs block by block, so a block's workspace is all a
# pass needs whatever its chunk: chunking such a layer saves nothing (conv.py offers no chunks).
BLOCK_POSITIONS = 65536


# A blocked layer with one input channel per group (not depthwise) pads that channel to a block
# of 16 in its blocked copies: its blocks hold at most this many bytes of copies. LeNet's conv1
# at batch 64 (one thread / two, forward + backward): 64-image blocks 2.80 / 1.56 ms with 7.61 MiB
# of workspace, 16-image blocks 2.74 / 1.77 ms with 1.94 MiB, 8-image 2.79 / 2.52 ms; NCHW 3.20 /
# 2.2 ms with 0.11 MiB.
SINGLE_CHANNEL_BLOCK_BYTES = 2 << 20


def reduce_block(plan) -> int:
    """Images per block: enough for BLOCK_POSITIONS positions of the image or the grid side,
    whichever is larger (the plan's conv view; geometry only); for a blocked layer with one input
    channel per group, no more than SINGLE_CHANNEL_BLOCK_BYTES of blocked copies."""
    positions = max(plan.out_size, plan.h.size * plan.w.size)
    images = max(1, -(-BLOCK_POSITIONS // positions))
    if plan.Cg == 1 and plan.Mg > 1 and layout(plan) == BLOCKED:
        pad = lambda c: -(-c // 16) * 16           # noqa: E731 - channels in blocks of 16
        copies = 4 * (plan.h.size * plan.w.size * pad(plan.C) + plan.out_size * pad(plan.M))
        images = max(1, min(images, SINGLE_CHANNEL_BLOCK_BYTES // copies))
    return images


def _blocks(layer, n):
    step = min(layer.reduce_block, n)
    return [slice(i, min(i + step, n)) for i in range(0, n, step)]


def workspace(layer, n):
    """Workspace specs for chunks of ``n`` images: one byte buffer, sized for the largest pass."""
    g = layer.dnn
    sizes = {len(range(*b.indices(n))) for b in _blocks(layer, n)}
    dw = onednn._round(4 * g.weight_size)
    # forward: a Deconvolution's is the backward-data pass
    forward = "data" if layer.deconv else "forward_bias" if layer.bias_term else "forward"
    need = [g.conv(m, "forward").nbytes(forward) for m in sizes]
    # backward: both passes' steps with dy's copy in the first slot (``backward``), after the
    # weight gradient's block where the reorder out of oneDNN's layout does not add it onto dw
    kind, shared = _PAIR[layer.deconv]
    for m in sizes:
        for one in (True, False) if g.weights_layout else (None,):     # either budget's weights pass
            wconv = g.conv(m, "weights", one)
            adds = wconv.adds(shared)
            need += [(0 if adds else dw) + wconv.nbytes("weights", shared, adds),
                     (0 if adds else dw) + g.conv(m).nbytes(kind, shared, adds)]
    return {WORKSPACE: ((max(need),), np.uint8)}


# The input gradient's pass and the name of dy in both backward passes: a Convolution's dy is the
# grid side of backward-data and backward-weights, a Deconvolution's the image side of forward and
# backward-weights.
_PAIR = {False: ("data", "y"), True: ("forward", "x")}


def backward(layer, dy, x, dx):
    """Backward of Convolution or Deconvolution, block by block: dw += the block's weight gradient
    (blocks in image order), then the block's input gradient. Both passes read dy: where they run
    in one layout it is reordered into it once for the two (``onednn.Conv.run_two``; else each pass
    takes its own, ``weights_layout``). Where oneDNN
    keeps the weight gradient in its own layout (the blocked and NHWC kernels), its reorder out
    adds it into dw (``onednn.Conv.adds``: the bits of ``dw += gradient``, without the gradient
    written to a buffer and read again); else it is written into the workspace's first slot and
    added with NumPy. ResNet-50's 3x3 512 -> 512 on 7x7 at batch 2, by the first way: 2.36 M
    gradients not written to and read from a buffer, about 0.7 ms of a 14 ms backward."""
    g, ws, w = layer.dnn, layer.workspace[WORKSPACE], layer.blobs[0].data
    learn = layer._learns(0)
    kind, name = _PAIR[layer.deconv]
    other = "x" if name == "y" else "y"
    dw = layer.blobs[0].diff
    for s in _blocks(layer, dy.shape[0]):
        conv, wconv = g.conv(s.stop - s.start), g.conv(s.stop - s.start, "weights")
        adds = wconv.adds(name)
        if adds:
            target, rest = dw, ws
        else:       # the weight gradient's block buffer first, the passes' workspace after it
            target = ws[:4 * g.weight_size].view(np.float32).reshape(dw.shape)
            rest = ws[onednn._round(4 * g.weight_size):]
        weights = ("weights", {other: x[s], "w": target})
        data = (kind, {other: dx[s], "w": w}) if dx is not None else None
        if learn and data and wconv is conv:
            conv.run_two(rest, weights, data, name, dy[s], accumulate=adds)
        else:           # one pass, or each in its own layout (``weights_layout``), each reordering dy
            for one, todo in ((wconv, weights if learn else None), (conv, data)):
                if todo is not None:
                    one.run(todo[0], rest, name, adds, **{name: dy[s]}, **todo[1])
        if learn and not adds:
            dw += target


def _run(layer, kind, x, y, b=None, own=""):
    """One primitive over the chunk, block by block (x: image side, y: grid side), in the layout
    of the ``own`` pass (``Geometry.conv``)."""
    g, ws, w = layer.dnn, layer.workspace[WORKSPACE], layer.blobs[0].data
    for s in _blocks(layer, x.shape[0]):
        g.conv(s.stop - s.start, own).run(kind, ws, x=x[s], w=w, y=y[s], b=b)


def conv_forward(layer, x, y):
    bias = layer.blobs[1].data if layer.bias_term else None
    _run(layer, "forward" if bias is None else "forward_bias", x, y, bias, own="forward")


def deconv_forward(layer, x, y):
    _run(layer, "data", y, x)
    if layer.bias_term:
        y += layer.blobs[1].data.reshape(-1, 1, 1)

