"""InnerProduct: a fully connected layer, one GEMM per pass (Caffe's inner_product_layer)."""
from __future__ import annotations

from ..fillers import fill
from .base import Layer, array_module, canonical_axis, count, register


@register
class InnerProduct(Layer):
    """top (M, N) = bottom (M, K) . W^T + bias, with bottom flattened from ``axis``.

    W is stored (N, K), or (K, N) with ``transpose``, as in Caffe.
    """
    type = "InnerProduct"
    exact_bottoms = exact_tops = 1
    backward_needs = ("bottom",)    # the weight gradient reads bottom; top is not needed

    def setup(self, bottom_shapes):
        p = self.param.inner_product_param
        if p.num_output <= 0:
            raise self.error("inner_product_param.num_output must be set (> 0)")
        shape = tuple(bottom_shapes[0])
        axis = canonical_axis(self, p.axis, len(shape))
        self.N, self.M, self.K = p.num_output, count(shape, 0, axis), count(shape, axis)
        self.transpose, self.bias_term = p.transpose, p.bias_term
        weight_shape = (self.K, self.N) if self.transpose else (self.N, self.K)
        self.param_shapes = [weight_shape] + [(self.N,)] * self.bias_term
        # matmul has no GEMM beta to accumulate with: the weight gradient lands here first
        self.backward_workspace_specs = {"weight_diff": (weight_shape, None)}
        return [shape[:axis] + (self.N,)]

    def init_params(self, rng):
        p = self.param.inner_product_param
        fill(p.weight_filler, self.blobs[0].data, rng)
        if self.bias_term:
            fill(p.bias_filler, self.blobs[1].data, rng)

    def _weight_nk(self):
        """The weight as an (N, K) matrix (a transposed view when stored (K, N))."""
        w = self.blobs[0].data
        return w.T if self.transpose else w

    def forward(self, bottom, top):
        x = bottom[0].data.reshape(self.M, self.K)
        y = top[0].data.reshape(self.M, self.N)
        array_module(x).matmul(x, self._weight_nk().T, out=y)
        if self.bias_term:
            y += self.blobs[1].data

    def backward(self, top, propagate_down, bottom):
        dy = top[0].diff.reshape(self.M, self.N)
        x = bottom[0].data.reshape(self.M, self.K)
        xp = array_module(dy)
        dw = self.workspace["weight_diff"]
        if self.transpose:
            xp.matmul(x.T, dy, out=dw)      # (K, N)
        else:
            xp.matmul(dy.T, x, out=dw)      # (N, K)
        self.blobs[0].diff += dw
        if self.bias_term:
            self.blobs[1].diff += dy.sum(axis=0)
        if propagate_down[0]:
            xp.matmul(dy, self._weight_nk(), out=bottom[0].diff.reshape(self.M, self.K))
