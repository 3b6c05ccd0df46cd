"""ConvolutionDepthwise, a layer type of widely used forks (MobileNet ports): a Convolution with
group = the bottom's channels. An alias, recorded in the schema's comments; it costs nothing."""
from __future__ import annotations

from ..proto import sncaffe_pb2 as pb
from .base import register
from .conv_nd import Convolution


@register
class ConvolutionDepthwise(Convolution):
    type = "ConvolutionDepthwise"

    def setup(self, bottom_shapes):
        shape = tuple(bottom_shapes[0])
        if len(shape) < 2:
            raise self.error(f"needs a channel axis; bottom is {shape}")
        p = self.param.convolution_param
        channels = shape[1]
        if p.HasField("group") and p.group not in (1, channels):
            raise self.error(f"group {p.group} given, but a depthwise convolution has group = channels ({channels})")
        param = pb.LayerParameter()
        param.CopyFrom(self.param)          # the net's LayerParameter is left as the file gave it
        param.convolution_param.group = channels
        self.param = param
        return super().setup(bottom_shapes)
