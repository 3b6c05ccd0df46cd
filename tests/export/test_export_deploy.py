"""The deploy part an export carries: data layers become the inputs kept layers read, losses and
Accuracy are dropped, the outputs are the blobs nothing kept reads; phase and stages as given."""
import numpy as np

from conftest import ROOT, SHARED, needs_shared

from sncaffe import Net
from sncaffe.export import check, deploy
from sncaffe.proto import sncaffe_pb2 as pb
from sncaffe.prototxt import filter_net, read_text


def deploy_graph(path, phase="TEST", shapes=None, stages=()):
    param = filter_net(read_text(path, pb.NetParameter()), phase, stages)
    return Net(deploy.deploy_param(param, shapes or {}), phase, defer=True)


def test_train_test_net_keeps_the_scores_and_drops_the_label():
    net = deploy_graph(ROOT / "prototxt" / "lenet_train_test.prototxt", shapes={"data": (1, 1, 28, 28)})
    assert net.inputs == ["data"] and net.outputs == ["ip2"]
    assert not {"SoftmaxWithLoss", "Accuracy", "Data"} & {n.type for n in net.graph.layers}


@needs_shared
def test_googlenet_outputs_its_three_classifiers():
    net = deploy_graph(SHARED / "zoo" / "bvlc" / "bvlc_googlenet__train_val.prototxt", shapes={"data": (1, 3, 224, 224)})
    assert net.outputs == ["loss1/classifier", "loss2/classifier", "loss3/classifier"]


STAGED = '''
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 1 dim: 3 } } }
layer { name: "fc" type: "InnerProduct" bottom: "data" top: "fc" inner_product_param { num_output: 2 } }
layer { name: "prob" type: "Softmax" bottom: "fc" top: "prob" include { stage: "deploy" } }
'''


def test_stages_choose_the_layers(tmp_path):
    path = tmp_path / "staged.prototxt"
    path.write_text(STAGED)
    assert deploy_graph(path).outputs == ["fc"]
    assert deploy_graph(path, stages=["deploy"]).outputs == ["prob"]
    assert deploy.load(path, "TEST", stages=["deploy"]).outputs == ["prob"]   # rules kept once filtered


def test_a_train_phase_check_leaves_batch_norm_sums_as_they_were():
    net = deploy.load(ROOT / "prototxt" / "cifar10_resnet.prototxt", "TRAIN", batch=2, seed=1)
    sums = [b for n in net.graph.layers if n.type == "BatchNorm" for b in n.layer.blobs]
    before = [np.array(b.data) for b in sums]
    check.reference(net, check.random_inputs(net))
    assert sums and all(np.array_equal(a, b.data) for a, b in zip(before, sums))
