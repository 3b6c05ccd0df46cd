"""Convolution and Deconvolution on the GPU: cuDNN in Caffe's conv view (image -> grid side).

The layer (conv.py) calls ``forward``/``backward`` with CuPy arrays, and in setup
``workspace_specs`` when its graph is built for a GPU target: per direction the
fastest algorithm whose workspace fits the layer's ``workspace_limit``
(cudnn_conv.WORKSPACE_LIMIT unless set), measured by cuDNN on the target GPU in
the net's dtype, or estimated (cudnn_conv.estimate_workspace) where the target
is a GPU that is not here (``sncaffe plan --device cuda``). Without a declared
cuDNN workspace the layer's largest workspace buffer is used.

The chunk contract (conv.py): the weight and bias gradients run per reduction block of
``layer.reduce_block`` images, accumulating into the diffs (beta 1) in image order, and
the weight gradient's algorithm is the one for the block's shape within the layer's
workspace limit, which every chunk's workspace holds: a chunked backward runs the
whole batch's cuDNN calls for them. (Forward and backward-data run per chunk: cuDNN
computes each image's output alone, with the algorithm its chunk's shape measures.)
"""
from __future__ import annotations

import weakref

import numpy as np

from ..backend import cudnn, cudnn_conv
from .base import array_module

_bottom_shapes = weakref.WeakKeyDictionary()     # layer -> the bottom shape its specs were made for
# Output positions (images x grid pixels) a reduction block reaches on the GPU: cuDNN's weight
# gradient wants many images a call, the CPU's 4096 columns would be one image at 56x56. Chosen
# to keep calls as large as a typical whole batch of small images; not measured (no GPU here).
BLOCK_POSITIONS = 1 << 16


def conv_view(layer, bottom_shape):
    """(image, grid, weight) shapes of the layer's conv view and its settings (kernel, stride,
    pad, dilation, group): a Deconvolution's top is the image."""
    settings = kernel, stride, pad, dilation, group = layer.settings()
    N, C, H, W = (int(v) for v in bottom_shape)
    M = layer.param.convolution_param.num_output
    ext = [d * (k - 1) + 1 for k, d in zip(kernel, dilation)]
    if layer.deconv:
        out = tuple(s * (n - 1) + e - 2 * p for n, s, e, p in zip((H, W), stride, ext, pad))
        return (N, M) + out, (N, C, H, W), (C, M // group) + tuple(kernel), settings
    out = tuple((n + 2 * p - e) // s + 1 for n, s, e, p in zip((H, W), stride, ext, pad))
    return (N, C, H, W), (N, M) + out, (M, C // group) + tuple(kernel), settings


def _shape(layer, bottom_shape, n, dtype):
    image, grid, weight, settings = conv_view(layer, bottom_shape)
    return cudnn_conv.conv_shape((n,) + image[1:], (n,) + grid[1:], weight, settings, dtype)


def _directions(layer):
    """(forward's, backward's) cuDNN directions of a layer in the conv view."""
    if layer.deconv:
        return ("backward_data",), ("forward", "backward_filter")
    return ("forward",), ("backward_filter", "backward_data")


def _chunks(layer, n):
    step = layer.chunk or n
    return [slice(i, min(i + step, n)) for i in range(0, n, step)]


def _blocks(layer, c):
    """The reduction blocks (slices) of chunk slice ``c``."""
    rb = layer.reduce_block
    return [slice(i, min(i + rb, c.stop)) for i in range(c.start, c.stop, rb)]


def reduce_block(layer, bottom_shape):
    """Images per reduction block of ``layer`` on the GPU (its geometry only): enough for
    BLOCK_POSITIONS positions of the conv view's grid."""
    _, grid, _, _ = conv_view(layer, bottom_shape)
    return -(-BLOCK_POSITIONS // max(1, int(np.prod(grid[2:]))))


def _learns(layer, i):
    """Caffe skips the gradient of a blob with lr_mult 0."""
    return i >= len(layer.param.param) or layer.param.param[i].lr_mult != 0


def workspace_specs(layer, bottom_shape, chunk=None):
    """(forward, backward) workspace specs of the layer's cuDNN algorithms for ``chunk`` images
    at a time (None: the batch), for the GPU ``layer.target`` in ``layer.dtype``."""
    bottom_shape = tuple(bottom_shape)
    _bottom_shapes[layer] = bottom_shape
    dtype = np.dtype(layer.dtype)
    n = chunk or bottom_shape[0]
    # images per call: the chunk's, the weight gradient's a reduction block's
    images = {d: n for d in cudnn_conv.DIRECTIONS}
    images["backward_filter"] = min(n, layer.reduce_block)
    limit = int(getattr(layer, "workspace_limit", cudnn_conv.WORKSPACE_LIMIT))
    target = layer.target
    if getattr(target, "cudnn", None) is None:          # a GPU that is not here: estimate
        image, grid, weight, settings = conv_view(layer, bottom_shape)
        sizes = {d: cudnn_conv.estimate_workspace((images[d],) + image[1:], (images[d],) + grid[1:], weight,
                                                  settings, dtype, d, limit)
                 for d in cudnn_conv.DIRECTIONS}
    else:
        cudnn_conv.register_device(target)
        sizes = {}
        for d in cudnn_conv.DIRECTIONS:
            shape = _shape(layer, bottom_shape, images[d], dtype)
            if shape.algorithm(d, limit) is None:
                with target.active():
                    shape.measure_all([d], limit, getattr(target, "stray", None))
            sizes[d] = shape.algorithm(d, limit).memory
    forward, backward = _directions(layer)
    spec = lambda dirs: {"cudnn": ((max(1, max(sizes[d] for d in dirs)),), np.uint8)}    # noqa: E731
    return spec(forward), spec(backward)


def workspace_for_chunk(layer, chunk):
    """The memory runtime's chunked pass on the GPU: one cuDNN workspace for ``chunk`` images,
    forward's and backward's alike."""
    forward, backward = workspace_specs(layer, _bottom_shapes[layer], chunk)
    return {"cudnn": ((max(forward["cudnn"][0][0], backward["cudnn"][0][0]),), np.uint8)}


def _workspace(layer):
    """The layer's workspace as (array, bytes): its "cudnn" buffer, else its largest one."""
    ws = layer.workspace.get("cudnn")
    if ws is None and layer.workspace:
        ws = max(layer.workspace.values(), key=lambda a: a.nbytes)
    return (ws, int(ws.nbytes)) if ws is not None else (None, 0)


def _bias_desc(layer, dtype):
    return cudnn.tensor((1, layer.param.convolution_param.num_output, 1, 1), np.dtype(dtype))


def forward(layer, bottom, top):
    """Convolution: top = conv(bottom, w) + bias; Deconvolution: top = conv^T(bottom, w) + bias."""
    h, (ws, nbytes) = cudnn_conv.handle(), _workspace(layer)
    w = layer.blobs[0].data
    for b, t in zip(bottom, top):
        for c in _chunks(layer, b.data.shape[0]):
            x_, y_ = b.data[c], t.data[c]
            shape = _shape(layer, b.data.shape, x_.shape[0], x_.dtype)
            if layer.deconv:
                algo = cudnn_conv.pick(shape, h, "backward_data", y_, w, x_, ws, nbytes)
                cudnn.convolution_backward_data(h, shape.w, w, shape.y, x_, shape.conv, algo.algo, ws, nbytes,
                                                shape.x, y_)
            else:
                algo = cudnn_conv.pick(shape, h, "forward", x_, w, y_, ws, nbytes)
                cudnn.convolution_forward(h, shape.x, x_, shape.w, w, shape.conv, algo.algo, ws, nbytes,
                                          shape.y, y_)
            if layer.bias_term:
                desc = shape.x if layer.deconv else shape.y
                cudnn.add_tensor(h, _bias_desc(layer, w.dtype), layer.blobs[1].data, desc, y_)


def backward(layer, top, propagate_down, bottom):
    """Bias and weight gradients accumulate (+=, Caffe's param diffs); bottom diffs are overwritten."""
    h, (ws, nbytes) = cudnn_conv.handle(), _workspace(layer)
    w = layer.blobs[0].data
    learn_w, learn_b = _learns(layer, 0), layer.bias_term and _learns(layer, 1)
    scratch = None
    for i, (t, b) in enumerate(zip(top, bottom)):
        for c in _chunks(layer, t.diff.shape[0]):
            dy, x, dx = t.diff[c], b.data[c], (b.diff[c] if propagate_down[i] else None)
            shape = _shape(layer, b.data.shape, dy.shape[0], dy.dtype)
            for k in _blocks(layer, c):         # parameter gradients: block by block, beta 1
                dyk, xk = t.diff[k], b.data[k]
                block = _shape(layer, b.data.shape, dyk.shape[0], dyk.dtype)
                if learn_b:
                    cudnn.convolution_backward_bias(h, block.x if layer.deconv else block.y, dyk,
                                                    _bias_desc(layer, dyk.dtype), layer.blobs[1].diff)
                # in the conv view: image = (x, dx) for Convolution, (top diff) for Deconvolution
                image, grid = (dyk, xk) if layer.deconv else (xk, dyk)
                if learn_w:
                    if block.algorithm("backward_filter", nbytes) is None and scratch is None:
                        scratch = array_module(w).empty_like(w)     # measuring overwrites: not the accumulated diff
                    algo = cudnn_conv.pick(block, h, "backward_filter", image, w, grid, ws, nbytes, scratch)
                    cudnn.convolution_backward_filter(h, block.x, image, block.y, grid, block.conv, algo.algo, ws,
                                                      nbytes, block.w, layer.blobs[0].diff, beta=1.0)
            if dx is None:
                continue
            if layer.deconv:
                algo = cudnn_conv.pick(shape, h, "forward", dy, w, dx, ws, nbytes)
                cudnn.convolution_forward(h, shape.x, dy, shape.w, w, shape.conv, algo.algo, ws, nbytes,
                                          shape.y, dx)
            else:
                algo = cudnn_conv.pick(shape, h, "backward_data", dx, w, dy, ws, nbytes)
                cudnn.convolution_backward_data(h, shape.w, w, shape.y, dy, shape.conv, algo.algo, ws, nbytes,
                                                shape.x, dx)
