"""SPP: spatial pyramid pooling, as Caffe's spp_layer composes Pooling, Flatten and Concat."""
from __future__ import annotations

import math

from ..proto import sncaffe_pb2 as pb
from .base import Layer, register
from .pooling import Pooling


def level_param(name, level, h, w, method) -> "pb.LayerParameter":
    """Caffe's GetPoolingParam: 2^level bins a side, kernel = stride = ceil(size / bins),
    pad = (kernel bins - size + 1) / 2."""
    bins = 2 ** level
    lp = pb.LayerParameter(name=f"{name}/level{level}", type="Pooling", bottom=["x"], top=["top"])
    pp = lp.pooling_param
    kh, kw = math.ceil(h / bins), math.ceil(w / bins)
    pp.kernel_h, pp.kernel_w, pp.stride_h, pp.stride_w = kh, kw, kh, kw
    pp.pad_h, pp.pad_w = (kh * bins - h + 1) // 2, (kw * bins - w + 1) // 2
    pp.pool = method
    return lp


@register
class SPP(Layer):
    """Pooling at levels 0 .. pyramid_height - 1 (level l: 2^l x 2^l bins, Caffe's Pooling rules:
    MAX skips padded cells, the AVE divisor counts them), each flattened per item as
    (C, bin_h, bin_w) and concatenated: top (N, C * sum 4^l). With one level the top is that
    pooling's own (N, C, 1, 1), as in Caffe."""
    type = "SPP"
    exact_bottoms = exact_tops = 1
    backward_needs = ()

    def setup(self, bottom_shapes):
        shape = tuple(bottom_shapes[0])
        if len(shape) != 4:
            raise self.error(f"input must have 4 axes (num, channels, height, width), got {shape}")
        N, C, H, W = shape
        p = self.param.spp_param
        if p.pyramid_height < 1:
            raise self.error("spp_param.pyramid_height must be >= 1")
        if H <= 0 or W <= 0:
            raise self.error("input dimensions cannot be zero")
        self.levels, self.sizes = [], []
        self.scratch_specs, self.workspace_specs = {}, {}
        for level in range(p.pyramid_height):
            pool = Pooling(level_param(self.name, level, H, W, p.pool), self.phase)
            pool.target, pool.dtype = self.target, self.dtype       # what the net is built for
            try:
                (top,) = pool.setup([shape])
            except ValueError as e:
                raise self.error(f"pyramid level {level}: {e}") from None
            self.levels.append(pool)
            self.sizes.append(top)
            for kind in ("scratch_specs", "workspace_specs"):
                getattr(self, kind).update({f"{level}/{k}": v for k, v in getattr(pool, kind).items()})
            self.workspace_specs[f"{level}/top"] = (top, None)
        self.workspace_specs["dx"] = (shape, None)
        if len(self.sizes) == 1:        # Caffe: the Pooling layer alone, its 4-D top unflattened
            return [self.sizes[0]]
        return [(N, sum(C * h * w for _, _, h, w in self.sizes))]

    def _bind(self, level, pool):
        pre = f"{level}/"
        pool.scratch = {k[len(pre):]: v for k, v in self.scratch.items() if k.startswith(pre)}
        pool.workspace = {k[len(pre):]: v for k, v in self.workspace.items() if k.startswith(pre)}
        pool.rng = self.rng

    def _pieces(self, a):
        """Views of the top (N, total) per level, as (N, C, bins, bins)."""
        out, start = [], 0
        a = a.reshape(a.shape[0], -1)
        for s in self.sizes:
            n = s[1] * s[2] * s[3]
            out.append(a[:, start:start + n].reshape(s[0], s[1], s[2], s[3]))
            start += n
        return out

    def forward(self, bottom, top):
        from .base import Blob
        for level, (pool, piece) in enumerate(zip(self.levels, self._pieces(top[0].data))):
            self._bind(level, pool)
            out = Blob("top", self.workspace[f"{level}/top"])
            pool.forward(bottom, [out])
            piece[...] = out.data

    def backward(self, top, propagate_down, bottom):
        from .base import Blob
        if not propagate_down[0]:
            return
        dx, acc = bottom[0].diff, self.workspace["dx"]
        for level, (pool, piece) in enumerate(zip(self.levels, self._pieces(top[0].diff))):
            self._bind(level, pool)
            dy = self.workspace[f"{level}/top"]
            dy[...] = piece
            pool.backward([Blob("top", None, dy)], [True], [Blob("x", bottom[0].data, acc if level else dx)])
            if level:
                dx += acc
