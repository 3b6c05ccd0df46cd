"""tools/bench_gemm_bound.py: the GEMM FLOPs of one iteration, counted per layer, and the measured rate."""
import math
import sys

from conftest import ROOT

sys.path.insert(0, str(ROOT / "tools"))
import bench_gemm_bound  # noqa: E402

from sncaffe.graph import build_graph  # noqa: E402
from sncaffe.proto import sncaffe_pb2 as pb  # noqa: E402
from sncaffe.prototxt import parse_text, prepare_net  # noqa: E402

NET = """
layer { name: "data" type: "Input" top: "data" top: "label"
        input_param { shape { dim: 2 dim: 3 dim: 8 dim: 8 } shape { dim: 2 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
        convolution_param { num_output: 4 kernel_size: 3 } }
layer { name: "conv2" type: "Convolution" bottom: "conv1" top: "conv2"
        convolution_param { num_output: 6 kernel_size: 3 group: 2 } }
layer { name: "ip" type: "InnerProduct" bottom: "conv2" top: "ip" inner_product_param { num_output: 5 } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
"""


def test_flops_count_forward_weight_and_data_gradients():
    graph = build_graph(prepare_net(parse_text(NET, pb.NetParameter()), pb.TRAIN), pb.TRAIN)
    work = {name: (shape, flops) for name, shape, flops in bench_gemm_bound.layer_work(graph)}
    # conv1: 2x6x6 positions, 4 outputs of 3*3*3 each; its bottom (the data) takes no gradient
    assert work["conv1"] == ((4, 27, 72), 2 * (2 * 4 * 27 * 72))
    # conv2, two groups: 3 outputs of 2*3*3 each per group, 2x4x4 positions; forward, weights, data
    assert work["conv2"] == ((3, 18, 32), 3 * (2 * 6 * 18 * 32))
    assert work["ip"] == ((5, 96, 2), 3 * (2 * 5 * 96 * 2))


def test_the_rate_is_measured_on_a_gemm():
    rate = bench_gemm_bound.gemm_rate(64, 64, 256, repeat=2)
    assert math.isfinite(rate) and rate > 1e6
