"""Layers without bottoms that produce blobs: Input (filled by the caller) and DummyData."""
from __future__ import annotations

from .. import fillers
from ..proto import sncaffe_pb2 as pb
from .base import Layer, register


def _one_or_per_top(layer, items, n_tops, what):
    """Caffe's rule for repeated settings: one shared by all tops, or one per top."""
    if len(items) not in (1, n_tops):
        raise layer.error(f"give {what} once, or once per top ({n_tops}); got {len(items)}")
    return [items[0] if len(items) == 1 else items[i] for i in range(n_tops)]


class _Source(Layer):
    exact_bottoms = 0
    min_tops = 1
    backward_needs = ()

    def allow_force_backward(self, bottom_index):
        return False

    def backward(self, top, propagate_down, bottom):
        pass


@register
class Input(_Source):
    type = "Input"

    def setup(self, bottom_shapes):
        shapes = self.param.input_param.shape
        if not shapes:
            raise self.error("input_param.shape is needed to know the top shapes")
        return [tuple(s.dim) for s in _one_or_per_top(self, shapes, len(self.param.top), "input_param.shape")]

    def forward(self, bottom, top):
        pass                                 # the caller writes the data


@register
class DummyData(_Source):
    type = "DummyData"

    def setup(self, bottom_shapes):
        p = self.param.dummy_data_param
        n_tops = len(self.param.top)
        legacy = (p.num, p.channels, p.height, p.width)
        if len({len(f) for f in legacy}) != 1:
            raise self.error("num, channels, height and width must be given the same number of times")
        if p.num and p.shape:
            raise self.error("give either shape or the legacy num/channels/height/width, not both")
        if p.shape:
            shapes = [tuple(s.dim) for s in p.shape]
        elif p.num:
            shapes = list(zip(*legacy))
        else:
            raise self.error("dummy_data_param needs a shape")
        self.fillers = list(p.data_filler) or [pb.FillerParameter(type="constant", value=0)]
        self.fillers = _one_or_per_top(self, self.fillers, n_tops, "data_filler")
        return _one_or_per_top(self, shapes, n_tops, "the shape")

    def forward(self, bottom, top):
        # Caffe fills constant tops only once; sncaffe's tops are not kept between passes,
        # so every filler runs each forward (the same values for constant fillers).
        for blob, filler in zip(top, self.fillers):
            fillers.fill(filler, blob.data, self.rng)
