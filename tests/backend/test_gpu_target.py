"""The target device is an argument of build_graph: a GPU target's layers declare cuDNN's
workspaces (measured in the net's dtype where the GPU is here, estimated where it is not) and
drop what only the CPU kernels need. Checked without a GPU."""
import types
from contextlib import nullcontext

import numpy as np

from sncaffe.backend import GPUEstimate, cudnn_conv
from sncaffe.graph import build_graph
from sncaffe.layers.base import TRAIN
from sncaffe.proto import sncaffe_pb2 as pb
from sncaffe.prototxt import parse_text, prepare_net


def test_conv_algorithms_are_measured_in_the_nets_dtype(monkeypatch):
    """A float64 net built for a GPU asks cuDNN about float64 convolutions, not float32 ones."""
    asked = []

    class Shape:
        def __init__(self, dtype):
            self.dtype, self.done = np.dtype(dtype), False

        def algorithm(self, direction, limit):
            return types.SimpleNamespace(memory=4096) if self.done else None

        def measure_all(self, directions, limit, stray=None):
            self.done = True

    monkeypatch.setattr(cudnn_conv, "_handles", {})
    monkeypatch.setattr(cudnn_conv, "conv_shape",
                        lambda image, grid, weight, settings, dtype: asked.append(np.dtype(dtype)) or Shape(dtype))
    gpu = types.SimpleNamespace(kind="cuda", cudnn=object(), index=0, compute=types.SimpleNamespace(ptr=1),
                                active=nullcontext, name="cuda:0")
    text = """layer { name: "in" type: "Input" top: "x" input_param { shape { dim: 2 dim: 3 dim: 8 dim: 8 } } }
              layer { name: "c" type: "Convolution" bottom: "x" top: "y" convolution_param { num_output: 4 kernel_size: 3 } }"""
    graph = build_graph(prepare_net(parse_text(text, pb.NetParameter()), TRAIN), TRAIN, np.float64, gpu)
    assert asked and set(asked) == {np.dtype(np.float64)}
    assert graph.layer("c").workspace["cudnn"].shape == (4096,)


def test_planning_for_a_gpu_that_is_not_here_estimates_cudnn_workspaces():
    text = """layer { name: "in" type: "Input" top: "x" input_param { shape { dim: 2 dim: 3 dim: 8 dim: 8 } } }
              layer { name: "c" type: "Convolution" bottom: "x" top: "y" convolution_param { num_output: 4 kernel_size: 3 } }
              layer { name: "p" type: "Pooling" bottom: "y" top: "z" pooling_param { pool: MAX kernel_size: 3 stride: 2 } }"""
    param = prepare_net(parse_text(text, pb.NetParameter()), TRAIN)
    cpu, gpu = build_graph(param, TRAIN), build_graph(param, TRAIN, target=GPUEstimate())
    assert "cudnn" not in cpu.layer("c").workspace and set(gpu.layer("c").workspace) == {"cudnn"}
    # one column buffer of the conv view: C kh kw x 6x6 output pixels x 2 images, float32
    assert gpu.layer("c").workspace["cudnn"].nbytes == 3 * 9 * 36 * 2 * 4
    assert gpu.layer("p").workspace == {} and cpu.layer("p").workspace
