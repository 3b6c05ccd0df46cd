"""InnerProduct: a fully connected layer, one GEMM per pass (Caffe's inner_product_layer)."""
from __future__ import annotations

from ..backend.blas import gemm
from ..fillers import fill
from .base import Layer, canonical_axis, count, register


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
        # the weight gradient lands here first (on a GPU, matmul has no beta to accumulate with)
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
        gemm(x, self._weight_nk().T, y)
        if self.bias_term:
            y += self.blobs[1].data

    def backward(self, top, propagate_down, bottom):
        dy = top[0].diff.reshape(self.M, self.N)
        x = bottom[0].data.reshape(self.M, self.K)
        dw = self.workspace["weight_diff"]
        if self.transpose:
            gemm(x.T, dy, dw)               # (K, N)
        else:
            gemm(dy.T, x, dw)               # (N, K)
        self.blobs[0].diff += dw
        if self.bias_term:
            self.blobs[1].diff += dy.sum(axis=0)
        if propagate_down[0]:
            gemm(dy, self._weight_nk(), bottom[0].diff.reshape(self.M, self.K))
