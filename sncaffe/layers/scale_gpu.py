"""Scale and Bias on the GPU: one kernel for y = x s[c] (+ b[c]), channel sums for the gradients."""
from __future__ import annotations

from ..backend import kernels
from ..backend.kernels import contiguous, i32, i64
from .reduce_gpu import DOT, SUM, SUM_AND_DOT, channel_sums

kernels.register("scale", r"""
// y = x * s[c] (+ b[c])
extern "C" __global__ void channel_scale(const T* x, const T* s, const T* b, int has_bias, T* y, long long n,
    int C, long long inner) {
  GRID_LOOP(i, n) {
    int c = (int)((i / inner) % C);
    T v = x[i] * s[c];
    if (has_bias) v = v + b[c];
    y[i] = v;
  }
}

""")


def scale_forward(layer, x, scale, bias, y):
    """y = x * scale (+ bias), the operands broadcast over Scale's (outer, dim, inner) view."""
    contiguous(x, scale, bias, y)
    _, C, inner = layer.view
    kernels.launch("scale", "channel_scale", x.size, x, scale, scale if bias is None else bias,
                   i32(bias is not None), y, i64(x.size), i32(C), i64(inner), dtype=x.dtype)


def scale_backward(layer, top, propagate_down, bottom):
    """Scale's backward: bias and scale gradients as one pass of channel sums, then dx."""
    dy = top[0].diff
    scale = layer.scale_blob(bottom)
    want_scale = layer.scale_is_param or propagate_down[1]
    x = (layer.scratch["bottom"] if layer.inplace else bottom[0].data) if want_scale else None
    if layer.bias_term or want_scale:
        mode = SUM_AND_DOT if layer.bias_term and want_scale else (SUM if layer.bias_term else DOT)
        s0, s1 = channel_sums(dy, layer.view, mode, b=x)
        if layer.bias_term:
            layer.sum_into(s0, layer.blobs[-1].diff, True)
        if want_scale:
            layer.sum_into(s1 if mode == SUM_AND_DOT else s0, scale.diff, layer.scale_is_param)
    if propagate_down[0]:
        scale_forward(layer, dy, scale.data, None, bottom[0].diff)


def bias_backward(layer, dy, target, accumulate):
    layer.sum_into(channel_sums(dy, layer.view, SUM)[0], target, accumulate)
