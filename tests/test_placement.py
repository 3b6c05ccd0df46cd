"""Model parallelism: layers placed at locations, Copy operators where blobs cross."""
import numpy as np
import pytest

from sncaffe import Net
from sncaffe.backend.cpu import CPUDevice
from sncaffe.gradcheck import check_gradient, make_layer
from sncaffe.proto import sncaffe_pb2 as pb
from sncaffe.prototxt import PrototxtError, parse_text, place, prepare_net

NET = """
name: "two"
layer { name: "input" type: "Input" top: "data" top: "label"
        input_param { shape { dim: 2 dim: 3 dim: 8 dim: 8 } shape { dim: 2 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
        convolution_param { num_output: 4 kernel_size: 3 pad: 1 weight_filler { type: "xavier" } } }
layer { name: "bn1" type: "BatchNorm" bottom: "conv1" top: "conv1" }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }
layer { name: "pool1" type: "Pooling" bottom: "conv1" top: "pool1" pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "conv2" type: "Convolution" bottom: "pool1" top: "conv2"
        convolution_param { num_output: 4 kernel_size: 3 pad: 1 weight_filler { type: "xavier" } } }
layer { name: "sum" type: "Eltwise" bottom: "conv2" bottom: "pool1" top: "sum" }
layer { name: "ip" type: "InnerProduct" bottom: "sum" top: "ip" inner_product_param { num_output: 3 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
"""
SPLIT = {"input": "cpu:0", "conv1": "cpu:0", "bn1": "cpu:0", "relu1": "cpu:0", "pool1": "cpu:0",
         "conv2": "cpu:1", "sum": "cpu:1", "ip": "cpu:1", "loss": "cpu:1"}


def param():
    return parse_text(NET, pb.NetParameter())


def run(net, seed=0):
    rng = np.random.default_rng(seed)
    net.blobs["data"].data[...] = rng.standard_normal(net.blobs["data"].data.shape)
    net.blobs["label"].data[...] = [0, 2]
    loss = net.forward()
    net.backward()
    return loss


def test_copies_are_inserted_where_blobs_cross_locations():
    prepared = prepare_net(place(param(), SPLIT))
    copies = [layer for layer in prepared.layer if layer.type == "Copy"]
    # One copy of pool1 serves both of its readers at cpu:1 (the split comes after the copy).
    assert [c.name for c in copies] == ["pool1_to_cpu:1", "label_to_cpu:1"]
    assert all(c.location == "cpu:1" for c in copies)
    split = next(layer for layer in prepared.layer if layer.type == "Split")
    assert split.location == "cpu:1" and list(split.bottom) == ["pool1_to_cpu:1"]
    conv2 = next(layer for layer in prepared.layer if layer.name == "conv2")
    assert list(conv2.bottom) == ["pool1_to_cpu:1_pool1_to_cpu:1_0_split_0"]


@pytest.mark.parametrize("mode", ["none", "liveness", "offload", "recompute", "all"])
def test_model_parallel_equals_one_device_and_each_pool_meets_its_plan(mode):
    one = Net(param(), "TRAIN", device=CPUDevice(64 << 20), seed=3, memory=mode)
    two = Net(place(param(), SPLIT), "TRAIN", device=CPUDevice(64 << 20), seed=3, memory=mode,
              devices={"cpu:0": CPUDevice(64 << 20), "cpu:1": CPUDevice(64 << 20)})
    for d in two.devices.values():
        d.pool.reset_peak()
    assert run(one) == run(two)
    for name in one.params:
        for a, b in zip(one.params[name], two.params[name]):
            assert np.array_equal(a.data, b.data) and np.array_equal(a.diff, b.diff), name
    assert set(two.plan.peaks) == {"", "cpu:0", "cpu:1"}
    for loc, peak in two.plan.peaks.items():
        assert two.devices[loc].pool.peak == peak, loc
    # Each device holds only its own layers' parameters.
    conv2 = two.params["conv2"][0].data
    assert np.shares_memory(conv2, two.devices["cpu:1"].arena)
    assert not np.shares_memory(conv2, two.devices["cpu:0"].arena)


def test_in_place_across_locations_is_refused():
    bad = place(param(), {"relu1": "cpu:1"})
    with pytest.raises(PrototxtError, match='layer "relu1" \\(ReLU\\) runs in place on "conv1"'):
        prepare_net(bad)


def test_place_names_unknown_layers():
    with pytest.raises(PrototxtError, match='unknown layer "nope"'):
        place(param(), {"nope": "cpu:1"})


def test_copy_gradient():
    check_gradient(make_layer('type: "Copy"'), [np.random.default_rng(0).standard_normal((2, 3, 4))])
