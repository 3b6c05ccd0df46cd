"""Layers, one module per family; ``REGISTRY`` maps a prototxt type to its class."""
from .base import REGISTRY, TRAIN, TEST, Blob, Layer, LayerError, register  # noqa: F401
from . import (data, conv, pooling, neuron, normalization, scale,  # noqa: F401
               inner_product, structure, loss, dataset)
from . import elementwise, reshape_ops, reduction, selection, parameter, spp, loss_extra, output  # noqa: F401
from . import recurrent, window_data, detection, annotated_data  # noqa: F401

from . import rcnn, segmentation, channels, dense_image_data  # noqa: F401  (the forks' types)
from . import conv_nd, depthwise  # noqa: F401  (after conv: N-d bottoms, the ConvolutionDepthwise alias)


def create_layer(param, phase=TRAIN) -> Layer:
    """Instantiate the class registered for ``param.type``; unknown types are an error."""
    cls = REGISTRY.get(param.type)
    if cls is None:
        from .unsupported import message
        raise LayerError(message([("", param.name, param.type)]))
    return cls(param, phase)


from . import python_layer  # noqa: E402,F401  (type "Python"; on its own line, after the others)
