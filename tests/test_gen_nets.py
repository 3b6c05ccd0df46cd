"""tools/gen_mobilenet.py and tools/gen_densenet.py: the papers' structure (shapes from the
graph, counts of weighted layers) and a training step of small versions."""
import importlib.util

import numpy as np
import pytest

from conftest import ROOT
from sncaffe import Net
from sncaffe.graph import build_graph
from sncaffe.proto import sncaffe_pb2 as pb
from sncaffe.prototxt import parse_text, prepare_net


def _tool(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


mobilenet, densenet = _tool("gen_mobilenet"), _tool("gen_densenet")


def _graph(text):
    return build_graph(prepare_net(parse_text(text, pb.NetParameter()), pb.TRAIN), pb.TRAIN)


def _convs(graph):
    return [n for n in graph.layers if n.type == "Convolution"]


def test_mobilenet_v2_structure():
    g = _graph(mobilenet.generate(batch=1))
    convs = _convs(g)
    depthwise = [n for n in convs if n.layer.param.convolution_param.group > 1]
    assert len(depthwise) == 17 and len(convs) == 52        # the paper's 17 blocks, 52 convolutions + fc
    for n in depthwise:
        assert n.layer.param.convolution_param.group == n.bottoms[0].shape[1] == n.tops[0].shape[1]
    assert sum(n.type == "Eltwise" for n in g.layers) == 10  # residuals where stride 1 and channels match
    last = next(n for n in g.layers if n.name == "conv_last")
    assert tuple(last.tops[0].shape) == (1, 1280, 7, 7)
    weights = sum(int(np.prod(n.layer.param_shapes[0])) for n in g.layers if n.type in ("Convolution", "InnerProduct"))
    bn = sum(n.tops[0].shape[1] for n in g.layers if n.type == "BatchNorm")
    assert weights + 2 * bn + 1000 == 3_504_872     # torchvision's mobilenet_v2: + BN affine, fc bias


def test_densenet121_structure():
    g = _graph(densenet.generate(batch=1))
    assert len(_convs(g)) == 120 and sum(n.type == "InnerProduct" for n in g.layers) == 1
    final = next(n for n in g.layers if n.name == "final/bn")
    assert tuple(final.tops[0].shape) == (1, 1024, 7, 7)
    weights = sum(int(np.prod(n.layer.param_shapes[0])) for n in g.layers if n.type in ("Convolution", "InnerProduct"))
    bn = sum(n.tops[0].shape[1] for n in g.layers if n.type == "BatchNorm")
    assert weights + 2 * bn + 1000 == 7_978_856     # torchvision's densenet121: + BN affine, fc bias


@pytest.mark.parametrize("text", [mobilenet.generate(width=0.25, batch=2, image_size=32, classes=5),
                                  densenet.generate((2, 2), growth=4, batch=2, image_size=16, classes=5)],
                         ids=["mobilenet", "densenet"])
def test_small_nets_train_a_step(text):
    param = parse_text(text, pb.NetParameter())
    net = Net(param, "TRAIN")
    rng = np.random.default_rng(0)
    net.blobs["data"].data[...] = rng.standard_normal(net.blobs["data"].data.shape)
    net.blobs["label"].data[...] = rng.integers(0, 5, net.blobs["label"].data.shape)
    loss = net.forward()
    net.backward()
    assert np.isfinite(loss) and loss > 0
    grads = [b.diff for blobs in net.params.values() for b in blobs[:1]]
    assert all(np.isfinite(d).all() for d in grads) and any(np.abs(d).sum() > 0 for d in grads)


def test_bad_settings_are_refused():
    with pytest.raises(ValueError):
        mobilenet.generate(width=0)
    with pytest.raises(ValueError):
        densenet.generate(())


@pytest.mark.parametrize("tool,path", [(mobilenet, "prototxt/mobilenet_v2.prototxt"),
                                       (densenet, "prototxt/densenet121.prototxt")])
def test_committed_nets_are_current(tool, path):
    """tools/compare.yaml's MobileNet-v2 and DenseNet-121 are the generators' output."""
    name = tool.__name__
    assert (ROOT / path).read_text() == tool.generate(command=f"python tools/{name}.py -o {path}")
