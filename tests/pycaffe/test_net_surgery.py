"""Caffe's net_surgery and feature-extraction recipes, as a pycaffe user writes them."""
from pathlib import Path

import numpy as np
import pytest

import sncaffe.pycaffe as caffe
from sncaffe.tools.convert_mnist_data import IMAGE_MAGIC, read_idx
from pycaffe_fixtures import lenet_fixture, trained_fixture  # noqa: F401 (fixtures)

IMAGES = Path(__file__).resolve().parents[2] / "data/mnist/t10k-images-idx3-ubyte.gz"


def digits(n=10):
    return read_idx(IMAGES, IMAGE_MAGIC)[:n, None].astype(np.float32) / 256


def full_conv(deploy_text):
    """LeNet with its inner products cast as convolutions (the fully convolutional version)."""
    head = deploy_text[:deploy_text.index('layer {\n  name: "ip1"')]
    return head + """
layer { name: "ip1-conv" type: "Convolution" bottom: "pool2" top: "ip1-conv" convolution_param { num_output: 500 kernel_size: 4 } }
layer { name: "relu1" type: "ReLU" bottom: "ip1-conv" top: "ip1-conv" }
layer { name: "ip2-conv" type: "Convolution" bottom: "ip1-conv" top: "ip2-conv" convolution_param { num_output: 10 kernel_size: 1 } }
layer { name: "prob" type: "Softmax" bottom: "ip2-conv" top: "prob" }
"""


def test_net_surgery_casts_inner_products_as_convolutions(lenet, trained, tmp_path):
    net = caffe.Net(str(lenet["deploy"]), str(trained), caffe.TEST)
    params = ["ip1", "ip2"]
    fc_params = {pr: (net.params[pr][0].data, net.params[pr][1].data) for pr in params}
    for fc in params:
        print("{} weights are {} dimensional and biases are {} dimensional".format(
            fc, fc_params[fc][0].shape, fc_params[fc][1].shape))
    (tmp_path / "full_conv.prototxt").write_text(full_conv(lenet["deploy"].read_text()))
    net_full_conv = caffe.Net(str(tmp_path / "full_conv.prototxt"), str(trained), caffe.TEST)
    params_full_conv = ["ip1-conv", "ip2-conv"]
    conv_params = {pr: (net_full_conv.params[pr][0].data, net_full_conv.params[pr][1].data)
                   for pr in params_full_conv}
    assert conv_params["ip1-conv"][0].shape == (500, 50, 4, 4)
    for pr, pr_conv in zip(params, params_full_conv):
        conv_params[pr_conv][0].flat = fc_params[pr][0].flat      # flat unrolled arrays
        conv_params[pr_conv][1][...] = fc_params[pr][1]
    net_full_conv.save(str(tmp_path / "full_conv.caffemodel"))

    x = digits()
    prob = net.forward(data=x)["prob"]
    again = caffe.Net(str(tmp_path / "full_conv.prototxt"), caffe.TEST, weights=str(tmp_path / "full_conv.caffemodel"))
    out = again.forward(data=x)
    np.testing.assert_allclose(out["prob"][:, :, 0, 0], prob, rtol=1e-4, atol=1e-6)
    assert (prob.argmax(1) == read_idx(IMAGES.with_name("t10k-labels-idx1-ubyte.gz"), 2049)[:10]).mean() >= 0.5


@pytest.mark.parametrize("memory", ["none", "all"])
def test_feature_extraction_with_forward_end(lenet, trained, memory):
    net = caffe.Net(str(lenet["deploy"]), caffe.TEST, weights=str(trained), memory=memory, keep=["pool2", "ip1"])
    net.blobs["data"].data[...] = digits()
    feats = net.forward(end="pool2")
    assert list(feats) == ["pool2"] and feats["pool2"].shape == (10, 50, 4, 4)
    pool2 = feats["pool2"].copy()
    out = net.forward(blobs=["ip1"])
    assert set(out) == {"prob", "ip1"}
    np.testing.assert_array_equal(net.blobs["pool2"].data, pool2)
    probs = out["prob"].copy()
    net.blobs["pool2"].data[...] = 0            # forward(start=) takes the blobs as they are
    out = net.forward(start="ip1")
    assert not np.allclose(out["prob"], probs)
    if memory == "none":
        assert net.blobs["conv1"].data.std() > 0      # every blob is readable by default
    else:
        assert net.blobs["conv1"].data is None        # not kept: its memory went back to the pool


def test_features_identical_in_every_memory_mode(lenet, trained):
    x = digits()
    ref = caffe.Net(str(lenet["deploy"]), caffe.TEST, weights=str(trained))
    want = ref.forward(data=x, blobs=["conv2"])
    for mode in ("liveness", "offload", "recompute", "all"):
        net = caffe.Net(str(lenet["deploy"]), caffe.TEST, weights=str(trained), memory=mode, keep=["conv2"])
        got = net.forward(data=x, blobs=["conv2"])
        assert net.memory_plan.peak < ref.memory_plan.peak
        for k in want:
            np.testing.assert_array_equal(got[k], want[k])


def test_backward_with_diffs_and_introspection(lenet, trained, tmp_path):
    (tmp_path / "fb.prototxt").write_text("force_backward: true\n" + lenet["deploy"].read_text())
    net = caffe.Net(str(tmp_path / "fb.prototxt"), caffe.TEST, weights=str(trained))
    assert net.inputs == ["data"] and net.outputs == ["prob"]
    assert net._layer_names[:3] == ["data", "conv1", "pool1"]
    assert net.top_names["relu1"] == ["ip1"] and net.bottom_names["ip2"] == ["ip1"]
    assert net.layer_dict["conv1"].type == "Convolution" and len(net.layers[1].blobs) == 2
    assert net.blob_loss_weights["prob"] == 0
    b = net.blobs["conv1"]
    assert (b.num, b.channels, b.height, b.width, b.count) == (10, 20, 24, 24, 10 * 20 * 24 * 24)
    out = net.forward(data=digits())
    g = np.zeros_like(out["prob"])
    g[np.arange(10), 3] = 1
    diffs = net.backward(prob=g, diffs=["ip2"])
    assert set(diffs) == {"data", "ip2"} and diffs["data"].shape == (10, 1, 28, 28)
    p = out["prob"]
    np.testing.assert_allclose(diffs["ip2"], p * (g - (g * p).sum(1, keepdims=True)), rtol=1e-4, atol=1e-7)
    assert np.abs(diffs["data"]).sum() > 0
    data_diff = diffs["data"].copy()        # a view of the blob, as in pycaffe
    all_out, all_diffs = net.forward_backward_all(data=np.concatenate([digits(10), digits(5)]),
                                                  prob=np.concatenate([g, g[:5]]))
    assert all_out["prob"].shape == (15, 10) and all_diffs["data"].shape == (15, 1, 28, 28)
    np.testing.assert_allclose(all_diffs["data"][:10], data_diff, rtol=1e-5, atol=1e-8)


def test_forward_all_reshape_and_share_with(lenet, trained):
    net = caffe.Net(str(lenet["deploy"]), caffe.TEST, weights=str(trained))
    x = digits(23)
    out = net.forward_all(data=x)
    assert out["prob"].shape == (23, 10)
    net.blobs["data"].reshape(3, 1, 28, 28)
    net.blobs["data"].data[...] = x[:3]
    net.reshape()
    assert net.blobs["conv1"].data.shape == (3, 20, 24, 24)
    np.testing.assert_allclose(net.forward()["prob"], out["prob"][:3], rtol=1e-5, atol=1e-7)
    other = caffe.Net(str(lenet["deploy"]), caffe.TEST)
    other.share_with(net)
    assert other.params["conv1"][0].data is net.params["conv1"][0].data or \
        np.shares_memory(other.params["conv1"][0].data, net.params["conv1"][0].data)
    np.testing.assert_allclose(other.forward(data=x[:10])["prob"], out["prob"][:10], rtol=1e-5, atol=1e-7)
