"""One gradient checker for every layer: central finite differences in float64.

The objective is ``sum_i <top_i, G_i>`` with random top diffs ``G_i``, so the
analytic bottom and parameter diffs from ``backward`` must equal its numerical
derivatives. Forward is rerun with the same RNG state for every probe, so
stochastic layers (Dropout) keep their mask.
"""
from __future__ import annotations

import numpy as np

from .layers import create_layer
from .layers.base import TRAIN, Blob


def make_layer(text: str, phase=TRAIN, inplace=False, n_bottoms=1, n_tops=1):
    """A layer from the text of a LayerParameter (``type: "ReLU" relu_param {...}``).

    Bottom and top names default to b0.. and t0.. (top = bottom when in place).
    """
    from google.protobuf import text_format
    from .proto import sncaffe_pb2 as pb
    lp = text_format.Parse(text, pb.LayerParameter())
    if not lp.name:
        lp.name = lp.type.lower() or "layer"
    if not lp.bottom:
        lp.bottom.extend(f"b{i}" for i in range(n_bottoms))
    if not lp.top:
        lp.top.extend(list(lp.bottom[:n_tops]) if inplace else [f"t{i}" for i in range(n_tops)])
    layer = create_layer(lp, phase)
    layer.inplace = inplace
    return layer


class Harness:
    """Binds a layer to plain NumPy arrays (not a device pool) for tests."""

    def __init__(self, layer, bottoms, dtype=np.float64, seed=0, params=None):
        self.layer, self.dtype, self.seed = layer, dtype, seed
        layer.dtype = np.dtype(dtype)       # as build_graph does: setup picks the kernels for it
        self.inputs = [np.asarray(b, dtype=dtype).copy() for b in bottoms]
        layer.check_counts(len(bottoms), len(layer.param.top))
        top_shapes = layer.setup([b.shape for b in self.inputs])
        rng = np.random.default_rng(seed)
        layer.blobs = [Blob(f"{layer.name}[{i}]", np.zeros(s, dtype), np.zeros(s, dtype))
                       for i, s in enumerate(layer.param_shapes)]
        if params is not None:
            for blob, value in zip(layer.blobs, params):
                blob.data[...] = value
        elif layer.blobs:
            layer.init_params(rng)
            for blob in layer.blobs:   # random, not the filler's (often constant) values
                if layer.learnable:
                    blob.data[...] = rng.standard_normal(blob.data.shape)
        layer.scratch = {k: np.zeros(s, d or dtype) for k, (s, d) in layer.scratch_specs.items()}
        specs = {**layer.workspace_specs, **(layer.backward_workspace_specs or {})}
        layer.workspace = {k: np.zeros(s, d or dtype) for k, (s, d) in specs.items()}
        self.bottom = [Blob(n, np.zeros(x.shape, dtype), np.zeros(x.shape, dtype))
                       for n, x in zip(layer.param.bottom, self.inputs)]
        if layer.inplace:
            self.top = self.bottom[:len(top_shapes)]
        else:
            self.top = [Blob(n, np.zeros(s, dtype), np.zeros(s, dtype))
                        for n, s in zip(layer.param.top, top_shapes)]
        self.top_shapes = top_shapes

    def forward(self):
        for blob, x in zip(self.bottom, self.inputs):
            blob.data[...] = x
        self.layer.rng = np.random.default_rng(self.seed + 1)
        self.layer.forward(self.bottom, self.top)
        return [t.data.copy() for t in self.top]

    def backward(self, top_diffs, propagate_down=None):
        if propagate_down is None:
            propagate_down = [self.layer.allow_force_backward(i) for i in range(len(self.bottom))]
        for blob, g in zip(self.top, top_diffs):
            blob.diff[...] = g
        for blob in self.layer.blobs:
            blob.diff[...] = 0
        for i, blob in enumerate(self.bottom):
            if propagate_down[i] and not self.layer.inplace:
                blob.diff[...] = np.nan      # backward must overwrite, not accumulate
        self.layer.backward(self.top, propagate_down, self.bottom)
        return ([b.diff.copy() for b in self.bottom], [p.diff.copy() for p in self.layer.blobs])


def check_gradient(layer, bottoms, *, seed=0, eps=1e-6, rtol=1e-5, atol=1e-7,
                   check_bottoms=None, check_params=True, max_probes=400, params=None,
                   propagate_down=None, ignored_tops=(), dtype=np.float64):
    """Assert that backward matches finite differences. Returns the Harness.

    ``propagate_down``: per bottom (default: where the layer allows force_backward).
    ``ignored_tops``: indices of tops whose diff the layer ignores by design (Caffe's exposed
    recurrent state); they get a zero gradient so the objective leaves them out. ``dtype``: the
    layer's (float32 checks float32-only kernels, with a larger ``eps`` and tolerances)."""
    h = Harness(layer, bottoms, dtype, seed, params)
    rng = np.random.default_rng(seed + 7)
    tops = h.forward()
    grads = [rng.standard_normal(t.shape) * (i not in ignored_tops) for i, t in enumerate(tops)]

    def objective():
        return sum(float(np.sum(t * g)) for t, g in zip(h.forward(), grads))

    if check_bottoms is None:
        check_bottoms = [i for i in range(len(bottoms)) if layer.allow_force_backward(i)]
    h.forward()
    bottom_diffs, param_diffs = h.backward(grads, propagate_down)
    targets = [(f"bottom[{i}]", h.inputs[i], bottom_diffs[i]) for i in check_bottoms]
    if check_params and layer.learnable:
        targets += [(f"param[{i}]", p.data, d) for i, (p, d) in enumerate(zip(layer.blobs, param_diffs))]
    for what, x, analytic in targets:
        flat = x.reshape(-1)
        idx = np.arange(flat.size)
        if flat.size > max_probes:
            idx = rng.choice(flat.size, max_probes, replace=False)
        numeric = np.empty(len(idx))
        for k, j in enumerate(idx):
            old = flat[j]
            flat[j] = old + eps
            fp = objective()
            flat[j] = old - eps
            fm = objective()
            flat[j] = old
            numeric[k] = (fp - fm) / (2 * eps)
        np.testing.assert_allclose(analytic.reshape(-1)[idx], numeric, rtol=rtol, atol=atol,
                                   err_msg=f'{layer.type} "{layer.name}": gradient of {what}')
    return h
