"""Convolution and Deconvolution (Caffe's ConvolutionParameter), 2-D over NCHW.

Both run in Caffe's conv view (image -> grid side) on one of two CPU engines:
oneDNN (``conv_onednn.py``) for float32 where it loads, else the reference
kernels of ``im2col.ConvPlan`` (float64, ``SNCAFFE_CONV=native``); on the GPU,
cuDNN (``conv_gpu.py``). A Convolution's forward is the plan's forward; a
Deconvolution's forward is the plan's backward-data (Caffe's transposed
convolution) and its backward-data the plan's forward. The batch runs in chunks of ``self.chunk``
images (None: the whole batch) and the workspace is sized for one chunk, so
the memory runtime can trade speed for memory: set ``chunk`` (and
``plan_options``) before ``setup``. Only a 4-D bottom with channel axis 1 is
supported (N-d convolution is a layer error).

The chunk contract (every backend follows it, so chunking never changes a bit):
``reduce_block`` is a number of images set in ``setup`` from the layer's geometry
alone, never from a capacity. The batch is cut into reduction blocks of
``reduce_block`` images from image 0; every product that sums over images (the
weight and bias gradients), and every GEMM whose result depends on how many
columns it is given (forward and backward-data on the CPU), covers one block or a
fixed part of one, computed the same way whatever the chunk, and the weight and
bias diffs take the blocks' sums in image order. A chunk (``self.chunk``) is a
multiple of ``reduce_block`` or the whole batch (``chunk_sizes`` lists the sizes the
memory runtime may choose), so a chunked pass runs exactly the unchunked pass's
arithmetic: every memory mode gives the bits of mode ``none``.
"""
from __future__ import annotations

import numpy as np

from ..backend import is_gpu
from ..fillers import fill
from . import conv_gpu, conv_onednn
from .base import Layer, array_module, register
from .im2col import ConvPlan
from ..validate import check_shape


def _spatial(layer, p, name, default):
    """Caffe's repeated field ``name`` with its ``name_h``/``name_w`` override, as (h, w)."""
    values = list(getattr(p, name))
    short = "kernel" if name == "kernel_size" else name
    hw = [f"{short}_h", f"{short}_w"] if name != "dilation" else []
    if any(p.HasField(f) for f in hw):
        if values:
            raise layer.error(f"give either {name} or {short}_h/{short}_w, not both")
        return getattr(p, hw[0]), getattr(p, hw[1])
    if not values:
        return default, default
    if len(values) == 1:
        return values[0], values[0]
    if len(values) == 2:
        return tuple(values)
    raise layer.error(f"{name} needs 1 or 2 values for a 2-D convolution, got {len(values)}")


class _ConvolutionBase(Layer):
    min_bottoms = 1
    backward_needs = ("bottom",)    # weight gradient reads bottom data; top data is never read
    deconv = False
    chunk = None                    # images per pass (None: the whole batch)
    reduce_block = 1                # images per reduction block (the chunk contract above)
    dnn = None                      # conv_onednn.Geometry where oneDNN runs the layer
    plan_options: dict = {}         # ConvPlan layout overrides (tests, benchmarks)

    def setup(self, bottom_shapes):
        p = self.param.convolution_param
        if len(self.param.top) != len(bottom_shapes):
            raise self.error(f"needs one top per bottom ({len(bottom_shapes)} bottoms, {len(self.param.top)} tops)")
        shape = tuple(bottom_shapes[0])
        if any(tuple(s) != shape for s in bottom_shapes):
            raise self.error(f"all bottoms must have the same shape, got {[tuple(s) for s in bottom_shapes]}")
        if len(shape) != 4:
            raise self.error(f"only 2-D convolution (a 4-D NCHW bottom) is supported, bottom is {shape}")
        if p.axis not in (1, -3):
            raise self.error(f"only channel axis 1 is supported, got axis {p.axis}")
        kernel = _spatial(self, p, "kernel_size", 0)
        stride = _spatial(self, p, "stride", 1)
        pad = _spatial(self, p, "pad", 0)
        dilation = _spatial(self, p, "dilation", 1)
        for what, v in (("kernel size", kernel), ("stride", stride), ("dilation", dilation)):
            if min(v) < 1:
                raise self.error(f"{what} must be positive, got {v}")
        N, C, H, W = shape
        M, group = p.num_output, p.group
        if M < 1:
            raise self.error("convolution_param.num_output must be set (> 0)")
        if group < 1 or C % group or M % group:
            raise self.error(f"channels ({C}) and num_output ({M}) must be multiples of group ({group})")
        extent = [d * (k - 1) + 1 for k, d in zip(kernel, dilation)]
        if self.deconv:
            out = tuple(s * (n - 1) + e - 2 * q for n, s, e, q in zip((H, W), stride, extent, pad))
            if min(out) < 1:
                raise self.error(f"output size {out} < 1 (input {H}x{W}, kernel extent {extent}, pad {pad})")
            check_shape((N, M) + out, f'top "{self.param.top[0]}"', self.error)    # before an engine sees it
            # conv view: the image side is top (M channels), the grid side is bottom (C)
            self.plan = ConvPlan(M, C, group, out, kernel, stride, pad, dilation, **self.plan_options)
            self.dnn = conv_onednn.geometry(self, self.plan, out)
            self.param_shapes = [(C, M // group) + kernel]
        else:
            if any(n + 2 * q < e for n, q, e in zip((H, W), pad, extent)):
                raise self.error(f"kernel extent {extent} exceeds the padded input "
                                 f"{H + 2 * pad[0]}x{W + 2 * pad[1]}")
            self.plan = ConvPlan(C, M, group, (H, W), kernel, stride, pad, dilation, **self.plan_options)
            check_shape((N, M) + tuple(self.plan.out_shape), f'top "{self.param.top[0]}"', self.error)
            self.dnn = conv_onednn.geometry(self, self.plan, (H, W))
            out = self.plan.out_shape
            self.param_shapes = [(M, C // group) + kernel]
        self.bias_term = p.bias_term
        self.reduce_block = self.plan.reduce_block      # the CPU kernels' (geometry only)
        self.param_shapes += [(M,)] * self.bias_term
        if self.dnn:                                # oneDNN's blocks (geometry only)
            self.reduce_block = conv_onednn.reduce_block(self.plan)
        self.workspace_specs = self._cpu_workspace(self.chunk or N)
        if is_gpu(self.target):                     # cuDNN's blocks and workspace, not the CPU kernels'
            self.reduce_block = conv_gpu.reduce_block(self, shape)
            self.workspace_specs, self.backward_workspace_specs = conv_gpu.workspace_specs(self, shape, self.chunk)
        return [(N, M) + tuple(out)] * len(bottom_shapes)

    def chunk_sizes(self, n):
        """The chunks the memory runtime may choose for a batch of n: multiples of reduce_block;
        none on oneDNN, whose passes already run a block at a time (its workspace is a block's)."""
        if self.dnn:
            return range(0)
        return range(self.reduce_block, n, self.reduce_block)

    def workspace_for_chunk(self, chunk):
        """The memory runtime's choice when the full workspace does not fit: ``chunk`` images a pass."""
        if is_gpu(self.target):
            return conv_gpu.workspace_for_chunk(self, chunk)
        return self._cpu_workspace(chunk)

    def _cpu_workspace(self, n):
        if self.dnn:
            return conv_onednn.workspace(self, n)
        return {k: ((size,), None) for k, size in self.plan.workspace(n).items()}

    def init_params(self, rng):
        p = self.param.convolution_param
        fill(p.weight_filler, self.blobs[0].data, rng)
        if self.bias_term:
            fill(p.bias_filler, self.blobs[1].data, rng)

    def settings(self):
        """(kernel, stride, pad, dilation, group), (h, w) each except group: for the GPU code."""
        p = self.param.convolution_param
        return (_spatial(self, p, "kernel_size", 0), _spatial(self, p, "stride", 1), _spatial(self, p, "pad", 0),
                _spatial(self, p, "dilation", 1), int(p.group))

    def _learns(self, i):
        """Caffe skips the gradient of a blob with lr_mult 0."""
        return i >= len(self.param.param) or self.param.param[i].lr_mult != 0

    def _chunks(self, n):
        step = self.chunk or n
        if step < n and step % self.reduce_block:
            raise self.error(f"chunk of {step} images is not a multiple of its reduction block "
                             f"({self.reduce_block} images)")
        return [slice(i, min(i + step, n)) for i in range(0, n, step)]

    def forward(self, bottom, top):
        if array_module(bottom[0].data) is not np:
            return conv_gpu.forward(self, bottom, top)
        for b, t in zip(bottom, top):
            for c in self._chunks(b.data.shape[0]):
                self._forward_chunk(b.data[c], t.data[c])

    def backward(self, top, propagate_down, bottom):
        if array_module(top[0].diff) is not np:
            return conv_gpu.backward(self, top, propagate_down, bottom)
        for i, (t, b) in enumerate(zip(top, bottom)):
            for c in self._chunks(t.diff.shape[0]):
                if self.bias_term and self._learns(1):
                    self._bias_grad(t.diff[c])
                self._backward_chunk(t.diff[c], b.data[c], b.diff[c] if propagate_down[i] else None)

    def _bias_grad(self, dy):
        """bias diff += dy (n, M, H, W) summed over n, H, W (the contiguous axis first), one
        reduction block at a time."""
        n, rb = dy.shape[0], self.reduce_block
        for i in range(0, n, rb):
            block = dy[i:i + rb]
            self.blobs[1].diff += np.einsum("nms->m", block.reshape(block.shape[0], block.shape[1], -1))


@register
class Convolution(_ConvolutionBase):
    """Caffe's Convolution: weight (num_output, channels/group, kh, kw), bias (num_output,)."""
    type = "Convolution"

    def _forward_chunk(self, x, y):
        if self.dnn:
            return conv_onednn.conv_forward(self, x, y)
        bias = self.blobs[1].data if self.bias_term else None
        self.plan.forward(x, self.blobs[0].data, y, self.workspace, bias)

    def _backward_chunk(self, dy, x, dx):
        if self.dnn:
            return conv_onednn.backward(self, dy, x, dx)
        self.plan.backward(x, dy, self.blobs[0].data, self.workspace, dx=dx,
                           dw=self.blobs[0].diff if self._learns(0) else None)


@register
class Deconvolution(_ConvolutionBase):
    """Caffe's Deconvolution, the transposed convolution: weight (channels, num_output/group,
    kh, kw); top size s*(H-1) + d*(k-1) + 1 - 2p. Its forward is the convolution's
    backward-data, its backward-data the convolution's forward."""
    type = "Deconvolution"
    deconv = True

    def _forward_chunk(self, x, y):
        if self.dnn:
            return conv_onednn.deconv_forward(self, x, y)
        self.plan.backward(None, x, self.blobs[0].data, self.workspace, dx=y)
        if self.bias_term:
            y += self.blobs[1].data.reshape(-1, 1, 1)

    def _backward_chunk(self, dy, x, dx):
        if self.dnn:
            return conv_onednn.backward(self, dy, x, dx)
        if self._learns(0):
            self.plan.backward(dy, x, self.blobs[0].data, self.workspace, dw=self.blobs[0].diff)
        if dx is not None:
            self.plan.forward(dy, self.blobs[0].data, dx, self.workspace)
