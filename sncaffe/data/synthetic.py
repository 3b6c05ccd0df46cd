"""Synthetic batches for a net's Input blobs: data N(0,1), labels integers in [0, classes), and a
Faster R-CNN's ``im_info`` the image's height, width and scale 1."""
from __future__ import annotations

import numpy as np

from ..proto import sncaffe_pb2 as pb
from ..tensor import array_module


def label_classes(net) -> dict:
    """Input blobs that are labels of a loss or Accuracy layer, and their number of classes.

    A label is a bottom after the first that the layer never differentiates;
    its classes are the extent of the layer's first bottom (the scores) along
    the class axis, i.e. the num_output of the layer feeding the loss.
    """
    out = {}
    for node in net.graph.layers:
        for i, bottom in enumerate(node.bottoms[1:], 1):
            if node.layer.allow_force_backward(i):
                continue
            while bottom.producer.type in ("Split", "Copy", "Slice"):     # through placement and replicas
                bottom = bottom.producer.bottoms[0]
            if bottom.producer.type != "Input":
                continue
            lp, shape = node.layer.param, node.bottoms[0].shape
            axis = lp.accuracy_param.axis if node.type == "Accuracy" else lp.softmax_param.axis
            n = 2 if node.type == "SigmoidCrossEntropyLoss" else (
                int(shape[axis]) if -len(shape) <= axis < len(shape) else 0)
            out[bottom.name] = max(out.get(bottom.name, 0), n)
    return out


def _image_info(net, name):
    """(height, width, 1) for py-faster-rcnn's and R-FCN's ``im_info`` input, (N, 3) beside a 4-D
    image input; else None."""
    shape = net.blobs[name].data.shape
    if name != "im_info" or len(shape) != 2 or shape[1] != 3:
        return None
    images = [net.blobs[n].data.shape for n in net.inputs if net.blobs[n].data.ndim == 4]
    return (images[0][2], images[0][3], 1) if images else None


class SyntheticInputs:
    """Fills a net's Input blobs: data N(0,1), labels integers in [0, classes) (0 when unknown).

    A batch depends only on (seed, phase, index, pass within the index), so a
    resumed run sees the same batches as an uninterrupted one. With ``shard =
    (rank, ranks)`` (data parallel) a train net gets rows [rank*B, (rank+1)*B)
    of the global batch of ranks*B that one process would get.
    """

    def __init__(self, seed=0):
        self.seed = seed
        self.shard = (0, 1)
        self.labels = {}
        self.last, self.passes = None, 0

    def __call__(self, net, index=0):
        labels = self.labels.get(id(net))
        if labels is None:
            labels = self.labels[id(net)] = label_classes(net)
        key = (id(net), index)
        self.passes = self.passes + 1 if key == self.last else 0    # iter_size passes of one iteration
        self.last = key
        rng = np.random.default_rng([self.seed % 2**63, int(net.phase), index, self.passes])
        rank, ranks = self.shard if net.phase == pb.TRAIN else (0, 1)   # rank 0 tests alone
        for name in net.inputs:
            data = net.blobs[name].data
            b = data.shape[0] if data.ndim else 1
            shape = (b * ranks, *data.shape[1:]) if data.ndim else data.shape
            if name in labels:
                x = rng.integers(max(labels[name], 1), size=shape)
            elif _image_info(net, name):        # its proposals then lie in the image, as in a real pass
                x = np.broadcast_to(np.array(_image_info(net, name), np.float64), shape)
            else:
                x = rng.standard_normal(shape)
            data[...] = array_module(data).asarray(x[rank * b:(rank + 1) * b] if data.ndim else x,
                                                   dtype=data.dtype)

    @staticmethod
    def describe(net) -> str:
        labels = label_classes(net)
        parts = [f"{n}: integers in [0, {labels[n]})" if labels.get(n) else
                 f"{n}: 0" if n in labels else
                 f"{n}: the image's height, width and scale {_image_info(net, n)}" if _image_info(net, n) else
                 f"{n}: N(0,1)" for n in net.inputs]
        return ", ".join(parts)
