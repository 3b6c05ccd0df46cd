"""N-d convolution (layers/conv_nd.py, Caffe's im2col_nd) and the ConvolutionDepthwise alias."""
import numpy as np
import pytest

from sncaffe import Net
from sncaffe.backend.cpu import CPUDevice
from sncaffe.gradcheck import Harness, check_gradient, make_layer
from sncaffe.graph import GraphError
from sncaffe.layers.base import LayerError
from sncaffe.proto import sncaffe_pb2 as pb
from sncaffe.prototxt import parse_text

CASES = [   # (type, bottom shape, convolution_param)
    ("Convolution", (2, 4, 5, 6, 4), "num_output: 6 group: 2 kernel_size: 3 kernel_size: 2 kernel_size: 1 "
                                     "stride: 1 stride: 2 stride: 1 pad: 1 pad: 0 pad: 1 dilation: 1 dilation: 2 dilation: 1"),
    ("Convolution", (2, 3, 9), "num_output: 2 kernel_size: 3 stride: 2 pad: 1 dilation: 2"),           # 1-D
    ("Convolution", (1, 2, 3, 3, 3, 3), "num_output: 2 kernel_size: 2 bias_term: false"),             # 4-D
    ("Deconvolution", (2, 4, 3, 4, 2), "num_output: 2 group: 2 kernel_size: 2 kernel_size: 3 kernel_size: 2 "
                                       "stride: 2 stride: 1 stride: 2 pad: 1 pad: 1 pad: 0"),
]


def layer(kind, param):
    return make_layer(f'type: "{kind}" convolution_param {{ {param} weight_filler {{ type: "gaussian" }} }}')


@pytest.mark.parametrize("kind, shape, param", CASES)
def test_gradient(kind, shape, param):
    lay = layer(kind, param)
    check_gradient(lay, [np.random.default_rng(1).standard_normal(shape)])
    assert lay.nd


@pytest.mark.parametrize("kind, shape, param", [c for c in CASES if len(c[1]) == 5])
def test_matches_pytorch(kind, shape, param):
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    lay = layer(kind, param)
    x = np.random.default_rng(2).standard_normal(shape)
    h = Harness(lay, [x])
    y = h.forward()[0]
    w, b = (torch.from_numpy(blob.data) for blob in lay.blobs)
    kw = dict(stride=lay.stride, padding=lay.pad, dilation=lay.dilation, groups=lay.group)
    fn = F.conv3d if kind == "Convolution" else F.conv_transpose3d
    np.testing.assert_allclose(y, fn(torch.from_numpy(x), w, b, **kw).numpy(), rtol=1e-10, atol=1e-10)


def test_4d_bottoms_keep_the_2d_kernels():
    lay = layer("Convolution", "num_output: 2 kernel_size: 3")
    Harness(lay, [np.zeros((1, 2, 5, 5))])
    assert not lay.nd and hasattr(lay, "plan")


@pytest.mark.parametrize("param, message", [
    ("num_output: 2 kernel_size: 3 kernel_size: 2", "kernel_size needs 1 or 3 values for 3 spatial axes, got 2"),
    ("num_output: 2 kernel_h: 3 kernel_w: 2", "kernel_h/kernel_w are for 2-D convolution only"),
    ("num_output: 2 kernel_size: 9", "kernel extent"),
    ("num_output: 3 group: 2 kernel_size: 1", "multiples of group"),
])
def test_bad_settings_name_the_layer(param, message):
    with pytest.raises(LayerError, match=message) as e:
        Harness(layer("Convolution", param), [np.zeros((1, 4, 4, 4, 4))])
    assert 'layer "convolution" (Convolution)' in str(e.value)


NET = """
name: "c3"
layer { name: "input" type: "Input" top: "x" top: "t"
        input_param { shape { dim: 2 dim: 2 dim: 4 dim: 5 dim: 6 } shape { dim: 2 dim: 3 dim: 2 dim: 3 dim: 3 } } }
layer { name: "conv" type: "Convolution" bottom: "x" top: "y"
        convolution_param { num_output: 3 kernel_size: 3 pad: 1 stride: 2 weight_filler { type: "xavier" } } }
layer { name: "relu" type: "ReLU" bottom: "y" top: "y" }
layer { name: "loss" type: "EuclideanLoss" bottom: "y" bottom: "t" top: "loss" }
"""


def run(mode):
    device = CPUDevice(16 << 20)
    net = Net(parse_text(NET, pb.NetParameter()), device=device, memory=mode, seed=3)
    rng = np.random.default_rng(0)
    for name in ("x", "t"):
        net.blobs[name].data[...] = rng.standard_normal(net.blobs[name].shape)
    device.pool.reset_peak()
    loss = net.forward()
    net.clear_param_diffs()
    net.backward()
    return net, device.pool.peak, [loss] + [b.diff.copy() for b in net.params["conv"]]


@pytest.mark.parametrize("mode", ["liveness", "offload", "recompute", "all"])
def test_every_memory_mode_same_bits_and_planned_peak(mode):
    _, _, ref = run("none")
    net, peak, got = run(mode)
    assert peak == net.plan.peak
    for a, b in zip(ref, got):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


def test_convolution_depthwise_is_a_convolution_with_group_channels():
    x = np.random.default_rng(4).standard_normal((2, 3, 6, 5))
    dw = make_layer('type: "ConvolutionDepthwise" convolution_param { num_output: 6 kernel_size: 3 pad: 1 }')
    ref = make_layer('type: "Convolution" convolution_param { num_output: 6 kernel_size: 3 pad: 1 group: 3 }')
    h = check_gradient(dw, [x])
    assert dw.blobs[0].data.shape == (6, 1, 3, 3) and dw.type == "ConvolutionDepthwise"
    np.testing.assert_allclose(h.forward()[0], Harness(ref, [x], params=[b.data for b in dw.blobs]).forward()[0])
    bad = make_layer('type: "ConvolutionDepthwise" convolution_param { num_output: 6 kernel_size: 3 group: 2 }')
    with pytest.raises(LayerError, match=r"group 2 given, but a depthwise convolution has group = channels \(3\)"):
        Harness(bad, [x])
    with pytest.raises(GraphError, match="ConvolutionDepthwise"):    # through a net: the error names the layer
        Net(parse_text('layer { name: "in" type: "Input" top: "x" input_param { shape { dim: 1 dim: 3 dim: 4 dim: 4 } } }'
                       'layer { name: "dw" type: "ConvolutionDepthwise" bottom: "x" top: "y" '
                       'convolution_param { num_output: 4 kernel_size: 3 } }', pb.NetParameter()),
            device=CPUDevice(1 << 20))


TWIN = """force_backward: true
layer { name: "input" type: "Input" top: "data" top: "label"
        input_param { shape { dim: 2 dim: 2 dim: 4 dim: 5 dim: 6 } shape { dim: 2 } } }
layer { name: "c3" type: "Convolution" bottom: "data" top: "c3"
        convolution_param { num_output: 4 kernel_size: 3 kernel_size: 2 kernel_size: 3 stride: 1 stride: 2 stride: 2
                            pad: 1 dilation: 1 dilation: 1 dilation: 2 group: 2 } }
layer { name: "d3" type: "Deconvolution" bottom: "c3" top: "d3"
        convolution_param { num_output: 3 kernel_size: 2 stride: 2 pad: 1 } }
layer { name: "r" type: "Reshape" bottom: "d3" top: "r" reshape_param { shape { dim: 0 dim: 3 dim: -1 dim: 4 } } }
layer { name: "dw" type: "ConvolutionDepthwise" bottom: "r" top: "dw"
        convolution_param { num_output: 6 kernel_size: 3 pad: 1 } }
layer { name: "ip" type: "InnerProduct" bottom: "dw" top: "ip" inner_product_param { num_output: 5 } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
"""


def test_pytorch_twin_of_nd_and_depthwise_layers():
    pytest.importorskip("torch")
    from test_torch_net import build, feed, randomize, run_both
    rng = np.random.default_rng(5)
    net = build(TWIN, np.float64)
    assert net.blobs["d3"].shape == (2, 3, 6, 4, 2) and net.params["dw"][0].shape == (6, 1, 3, 3)
    randomize(net, rng)
    run_both(net, feed(net, rng), rng, 1e-9)
