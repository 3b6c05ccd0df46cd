"""The error for layer types sncaffe lacks: every such type of a file at once, each with the fork
of Caffe it comes from where known.

``FORKS`` is consulted only for types absent from ``REGISTRY``: a fork's type that sncaffe gains
is found there first, and the table never says a registered type is missing.
"""
from __future__ import annotations

from .base import REGISTRY

_SSD = "SSD, weiliu89/caffe"
_FRCNN = "Faster R-CNN, rbgirshick/caffe-fast-rcnn"
_SEGNET = "SegNet, alexgkendall/caffe-segnet"
_YOLO = "YOLO v2, the Caffe ports of darknet"

FORKS = {
    "Permute": _SSD, "PriorBox": _SSD, "DetectionOutput": _SSD, "DetectionEvaluate": _SSD,
    "Normalize": _SSD, "MultiBoxLoss": _SSD, "AnnotatedData": _SSD,
    "ROIPooling": _FRCNN, "SmoothL1Loss": _FRCNN,
    "PSROIPooling": "R-FCN, daijifeng001/caffe-rfcn",
    "Upsample": _SEGNET, "DenseImageData": _SEGNET,
    "BN": "SegNet, alexgkendall/caffe-segnet, and PSPNet, hszhao/PSPNet",
    "Interp": "PSPNet, hszhao/PSPNet, and DeepLab's Caffe",
    "Axpy": "SENet, hujie-frank/SENet",
    "ShuffleChannel": "ShuffleNet, farmingyard/ShuffleNet",
    "Reorg": _YOLO, "Region": _YOLO,
    "DepthwiseConvolution": "MobileNet, yonghenglh6/DepthwiseConvolution",
    "CenterLoss": "center loss, ydwen/caffe-face",
}


def origin(type_) -> str:
    """ " (from <fork>)" for a type sncaffe lacks whose fork is known, else ""."""
    return f" (from {FORKS[type_]})" if type_ in FORKS and type_ not in REGISTRY else ""


def missing(layers) -> list:
    """The (where, name, type) of ``layers`` whose type is not registered."""
    return [(where, name, t) for where, name, t in layers if t not in REGISTRY]


def message(layers) -> str:
    """The error for ``layers``, [(where, name, type)] of types sncaffe lacks (``where``: "file:line"
    or ""): the first in full, then each other type once, with its first layer."""
    where, name, first = layers[0]
    msg = f'{where + ": " if where else ""}layer "{name}": unsupported layer type "{first}"{origin(first)}'
    others = {}
    for w, n, t in layers[1:]:
        if t != first:
            others.setdefault(t, (w, n))
    if others:
        msg += f"; {len(others)} more unsupported type{'s' if len(others) > 1 else ''} in the net: " + "; ".join(
            f'"{t}"{origin(t)}, layer "{n}"' + (f" at {w}" if w else "") for t, (w, n) in others.items())
    return msg + f" (supported: {', '.join(sorted(REGISTRY))})"
