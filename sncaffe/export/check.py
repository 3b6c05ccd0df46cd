"""The numeric check of an export: one random batch through sncaffe and through the export.

The difference of an output is its largest absolute difference divided by the largest
absolute value of sncaffe's output: relative to the output's scale, so values near zero
(a ReLU's, a softmax's tail) do not turn float rounding into large ratios.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import ExportError
from .geometry import writer

DEFAULT_RTOL = 1e-4


@dataclass
class Difference:
    output: str
    shape: tuple
    relative: float         # max |export - sncaffe| / max |sncaffe|

    def __str__(self):
        return f"  {self.output} {self.shape}: largest relative difference {self.relative:.2e}"


def random_inputs(net, seed=0) -> dict:
    """N(0, 1) for every input blob of a deploy net, float32; an input read as ROIPooling's
    rois gets valid rows instead (a batch index, then corners inside the image)."""
    rng = np.random.default_rng(seed)
    out = {name: rng.standard_normal(net.blobs[name].data.shape).astype(np.float32) for name in net.inputs}
    for node in net.graph.layers:
        if node.type == "ROIPooling":
            source, i = writer(net, node.bottoms[1].name)         # through Split layers
            if source is not None and source.type == "Input":
                out[source.tops[i].name] = random_rois(rng, node)
    return out


def random_rois(rng, node) -> np.ndarray:
    """(batch index, x1, y1, x2, y2) rows over the image a ROIPooling's feature map scales from."""
    n, _, h, w = node.bottoms[0].shape
    scale = node.layer.param.roi_pooling_param.spatial_scale
    shape = node.bottoms[1].shape
    r = shape[0]
    x = np.sort(rng.uniform(0, w / scale, (r, 2)), 1)
    y = np.sort(rng.uniform(0, h / scale, (r, 2)), 1)
    rows = np.stack([rng.integers(0, n, r), x[:, 0], y[:, 0], x[:, 1], y[:, 1]], 1)
    return rows.astype(np.float32).reshape(shape)


def reference(net, inputs: dict) -> dict:
    """sncaffe's outputs for ``inputs`` (copies). A TRAIN-phase forward moves BatchNorm's sums:
    the check puts them back."""
    state = [b for n in net.graph.layers if not n.layer.learnable for b in n.layer.blobs]
    saved = [np.array(b.data) for b in state]
    for name, x in inputs.items():
        net.blobs[name].data[...] = x
    net.forward()
    for b, a in zip(state, saved):
        b.data[...] = a
    return {name: np.array(net.blobs[name].data) for name in net.outputs}


def relative(ref, out) -> float:
    ref, out = np.asarray(ref, np.float64), np.asarray(out, np.float64)
    scale = float(np.max(np.abs(ref))) if ref.size else 0.0
    diff = float(np.max(np.abs(ref - out))) if ref.size else 0.0
    return diff / scale if scale else diff


def expected(net, seed=0) -> tuple:
    """(inputs, sncaffe's outputs) for a random batch: what ``compare`` checks against."""
    inputs = random_inputs(net, seed)
    return inputs, reference(net, inputs)


def compare(net, run, rtol=DEFAULT_RTOL, what="the export", seed=0, against=None) -> list:
    """Feed a random batch to sncaffe and to ``run`` (inputs dict -> outputs dict); the
    Differences, or ExportError naming every output over ``rtol``. ``against``: the
    ``expected`` of an earlier check of the same net and parameters, reused."""
    inputs, want = against or expected(net, seed)
    bad = [name for name, y in want.items() if not np.all(np.isfinite(y))]
    if bad:
        raise ExportError(f'sncaffe\'s own output "{bad[0]}" is not finite on a random batch, so {what} '
                          "cannot be checked (untrained BatchNorm statistics? give the weights)")
    got = run(inputs)
    diffs = []
    for name, y in want.items():
        if name not in got:
            raise ExportError(f'{what} has no output "{name}"')
        if tuple(np.shape(got[name])) != y.shape:
            raise ExportError(f'{what}: output "{name}" has shape {tuple(np.shape(got[name]))}, sncaffe\'s {y.shape}')
        diffs.append(Difference(name, y.shape, relative(y, got[name])))
    over = [d for d in diffs if not d.relative <= rtol]
    if over:
        raise ExportError(f"{what} differs from sncaffe by more than {rtol:g} (relative):\n"
                          + "\n".join(str(d) for d in over))
    return diffs
