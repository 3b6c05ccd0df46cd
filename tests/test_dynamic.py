"""sncaffe/dynamic.py: a Filter's tops take the shape of the items it keeps at each forward, the
layers after it are set up again for it (aliasing ones included), and memory stays as planned."""
import numpy as np
import pytest

from sncaffe import Net
from sncaffe.backend import CPUDevice
from sncaffe.layers.base import LayerError
from sncaffe.prototxt import parse_text
from sncaffe.proto import sncaffe_pb2 as pb

NET = """
layer { name: "input" type: "Input" top: "x" top: "t" top: "sel"
  input_param { shape { dim: 4 dim: 3 dim: 2 } shape { dim: 4 dim: 2 } shape { dim: 4 } } }
layer { name: "filter" type: "Filter" bottom: "x" bottom: "t" bottom: "sel" top: "y" top: "tf" }
layer { name: "flat" type: "Flatten" bottom: "y" top: "f" }
layer { name: "ip" type: "InnerProduct" bottom: "f" top: "ip" inner_product_param { num_output: 2 {axis}
  weight_filler { type: "gaussian" std: 0.5 } } }
layer { name: "loss" type: "EuclideanLoss" bottom: "ip" bottom: "tf" top: "loss" }
"""


@pytest.mark.parametrize("mode", ["none", "liveness", "all"])
def test_filter_reshapes_the_layers_after_it(mode):
    device = CPUDevice("64MiB")
    net = Net(parse_text(NET.replace("{axis}", ""), pb.NetParameter()), "TRAIN", device=device, memory=mode)
    rng = np.random.default_rng(0)
    w = net.params["ip"][0].data
    for sel in ([1, 0, 1, 1], [0, 0, 1, 0], [1, 1, 1, 1], [0, 1, 0, 1]):
        x, t = rng.standard_normal((4, 3, 2)), rng.standard_normal((4, 2))
        net.blobs["x"].data[...], net.blobs["t"].data[...], net.blobs["sel"].data[...] = x, t, sel
        kept = np.flatnonzero(sel)
        net.clear_param_diffs()
        device.pool.reset_peak()
        loss = net.forward()
        ip = x[kept].reshape(len(kept), 6) @ w.T
        np.testing.assert_allclose(loss, ((ip - t[kept]) ** 2).sum() / len(kept) / 2, rtol=1e-5)
        net.backward()
        assert device.pool.peak == net.plan.peak
        dip = (ip - t[kept]) / len(kept)
        np.testing.assert_allclose(net.params["ip"][0].diff, dip.T @ x[kept].reshape(len(kept), 6),
                                   rtol=1e-4, atol=1e-6)
        w -= 0.1 * net.params["ip"][0].diff


def test_a_reshape_that_changes_parameter_shapes_is_refused():
    """InnerProduct over axis 0 would need another weight for another batch."""
    text = NET.replace("{axis}", "axis: 0").split('layer { name: "loss"')[0]
    net = Net(parse_text(text, pb.NetParameter()), "TRAIN", device=CPUDevice("64MiB"))
    net.blobs["sel"].data[...] = [1, 0, 1, 1]
    with pytest.raises(LayerError, match=r'layer "ip" \(InnerProduct\): bottom shapes .* change its parameter'):
        net.forward()
