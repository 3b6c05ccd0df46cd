"""Real Caffe prototxt files from the zoo load, and their nets run forward and backward."""
import numpy as np
import pytest

from sncaffe import Net
from sncaffe.proto import sncaffe_pb2 as pb
from sncaffe.prototxt import read_solver, read_text, replace_data_layers, set_batch
from conftest import SHARED, needs_shared

ZOO = sorted((SHARED / "zoo").rglob("*.prototxt")) if SHARED else []
NETS = [p for p in ZOO if "solver" not in p.name]
# Input shapes (C, H, W) standing in for each train_val net's data layer.
DATA_SHAPES = {"bvlc_alexnet": (3, 227, 227), "bvlc_googlenet": (3, 224, 224),
               "cifar10": (3, 32, 32), "mnist": (1, 28, 28)}


@needs_shared
@pytest.mark.parametrize("path", ZOO, ids=lambda p: p.name)
def test_zoo_file_loads(path):
    if "solver" in path.name:
        assert read_solver(path).base_lr > 0
    else:
        for phase in ("TRAIN", "TEST"):
            Net(path if not _has_data(path) else _inputs(path, 1), phase)


def _has_data(path):
    return any(layer.type == "Data" for layer in read_text(path, pb.NetParameter()).layer)


def _inputs(path, batch):
    param = read_text(path, pb.NetParameter())
    chw = next(v for k, v in DATA_SHAPES.items() if path.name.startswith(k) or k in path.name)
    param = replace_data_layers(param, {"data": (batch,) + chw, "label": (batch,)})
    return set_batch(param, batch)


@needs_shared
@pytest.mark.parametrize("path", NETS, ids=lambda p: p.name)
def test_zoo_net_forward_backward(path):
    param = _inputs(path, 2) if _has_data(path) else set_batch(read_text(path, pb.NetParameter()), 2)
    param.force_backward = True
    net = Net(param, "TRAIN", seed=1)
    rng = np.random.default_rng(0)
    for layer in net.layers:            # deploy nets have no fillers: their weights would all be zero
        if layer.learnable and layer.blobs and not any(np.any(b.data) for b in layer.blobs):
            w = layer.blobs[0].data       # unit-variance activations, so the softmax does not saturate
            w[...] = rng.normal(0, 1 / np.sqrt(max(1, w[0].size)), w.shape)
        elif layer.type == "BatchNorm" and not layer.blobs[2].data.any():
            layer.blobs[1].data[...] = 1          # unit running variance
            layer.blobs[2].data[...] = 1
    for name in net.inputs:
        blob = net.blobs[name]
        blob.data[...] = rng.integers(0, 2, blob.data.shape) if name == "label" else rng.standard_normal(blob.data.shape)
    loss = net.forward()
    assert np.isfinite(loss)
    for name in net.outputs:          # deploy nets have no loss: feed a gradient into their outputs
        blob = net.blobs[name]
        if blob.diff is not None and blob.data.ndim:
            blob.diff[...] = rng.standard_normal(blob.diff.shape)
    net.backward()
    for name, blobs in net.params.items():
        for b in blobs:
            assert np.all(np.isfinite(b.diff)), name
    assert any(np.any(b.diff != 0) for blobs in net.params.values() for b in blobs)
    data = net.blobs[net.inputs[0]]
    assert data.diff is not None and np.any(data.diff != 0)
