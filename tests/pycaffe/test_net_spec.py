"""NetSpec, as Caffe's 01-learning-lenet notebook generates LeNet (only the import line changed)."""
import numpy as np
import pytest

import sncaffe.pycaffe as caffe
from sncaffe.pycaffe import layers as L, params as P
from sncaffe.prototxt import load_net
from pycaffe_fixtures import lenet_fixture  # noqa: F401 (fixtures)


def lenet(lmdb, batch_size):
    # our version of LeNet: a series of linear and simple nonlinear transformations
    n = caffe.NetSpec()
    n.data, n.label = L.Data(batch_size=batch_size, backend=P.Data.LMDB, source=lmdb,
                             transform_param=dict(scale=0.00390625), ntop=2)
    n.conv1 = L.Convolution(n.data, kernel_size=5, num_output=20, weight_filler=dict(type="xavier"))
    n.pool1 = L.Pooling(n.conv1, kernel_size=2, stride=2, pool=P.Pooling.MAX)
    n.conv2 = L.Convolution(n.pool1, kernel_size=5, num_output=50, weight_filler=dict(type="xavier"))
    n.pool2 = L.Pooling(n.conv2, kernel_size=2, stride=2, pool=P.Pooling.MAX)
    n.fc1 = L.InnerProduct(n.pool2, num_output=500, weight_filler=dict(type="xavier"),
                           param=[dict(lr_mult=1), dict(lr_mult=2)])
    n.relu1 = L.ReLU(n.fc1, in_place=True)
    n.score = L.InnerProduct(n.relu1, num_output=10, weight_filler=dict(type="xavier"))
    n.loss = L.SoftmaxWithLoss(n.score, n.label)
    return n.to_proto()


CAFFE_DATA_LAYER = '''layer {
  name: "data"
  type: "Data"
  top: "data"
  top: "label"
  transform_param {
    scale: 0.00390625
  }
  data_param {
    source: "mnist/mnist_train_lmdb"
    batch_size: 64
    backend: LMDB
  }
}
'''
CAFFE_FC1_RELU = '''layer {
  name: "fc1"
  type: "InnerProduct"
  bottom: "pool2"
  top: "fc1"
  param {
    lr_mult: 1.0
  }
  param {
    lr_mult: 2.0
  }
  inner_product_param {
    num_output: 500
    weight_filler {
      type: "xavier"
    }
  }
}
layer {
  name: "relu1"
  type: "ReLU"
  bottom: "fc1"
  top: "fc1"
}
'''


def test_netspec_text_is_caffes():
    text = str(lenet("mnist/mnist_train_lmdb", 64))
    assert text.startswith(CAFFE_DATA_LAYER)     # the text Caffe's NetSpec writes for this layer
    assert CAFFE_FC1_RELU.replace("1.0\n", "1\n").replace("2.0\n", "2\n") in text.replace("1.0\n", "1\n").replace("2.0\n", "2\n")
    names = [layer.name for layer in lenet("x", 1).layer]
    assert names == ["data", "conv1", "pool1", "conv2", "pool2", "fc1", "relu1", "score", "loss"]


def test_netspec_lenet_trains(request):
    d = request.getfixturevalue("lenet")["dir"]    # (the fixture is named like the notebook's function)
    with open(d / "lenet_auto_train.prototxt", "w") as f:
        f.write(str(lenet(str(d / "train_lmdb"), 64)))
    with open(d / "lenet_auto_test.prototxt", "w") as f:
        f.write(str(lenet(str(d / "test_lmdb"), 100)))
    (d / "lenet_auto_solver.prototxt").write_text(f"""
train_net: "{d / 'lenet_auto_train.prototxt'}"
test_net: "{d / 'lenet_auto_test.prototxt'}"
test_iter: 2
test_interval: 500
base_lr: 0.01
momentum: 0.9
weight_decay: 0.0005
lr_policy: "inv"
gamma: 0.0001
power: 0.75
display: 100
max_iter: 10000
snapshot: 5000
snapshot_prefix: "{d / 'snap/lenet_auto'}"
""")
    solver = caffe.SGDSolver(str(d / "lenet_auto_solver.prototxt"))
    assert list(solver.net.blobs)[:3] == ["data", "label", "conv1"]
    solver.step(1)
    first = solver.net.blobs["loss"].data.item()
    solver.step(14)
    assert solver.net.blobs["loss"].data.item() < first
    assert load_net(d / "lenet_auto_test.prototxt", caffe.TEST).layer[-1].type == "SoftmaxWithLoss"


def test_netspec_features():
    n = caffe.NetSpec()
    n.data = L.Input(shape=[dict(dim=[2, 3, 4, 4])])
    n.label = L.Input(input_param=dict(shape=dict(dim=[2])))
    n.a, n.b = L.Slice(n.data, slice_param=dict(axis=1, slice_point=[1]), ntop=2)
    n.silence = L.Silence(n.b, ntop=0)
    n.ip = L.InnerProduct(n.a, num_output=3, include=dict(phase=caffe.TRAIN), loss_weight=0,
                          propagate_down=[True])
    n.loss = L.SoftmaxWithLoss(n.ip, n.label, loss_param=dict(ignore_label=-1), loss_weight=2)
    net = n.to_proto()
    by_name = {layer.name: layer for layer in net.layer}
    assert list(by_name["a"].top) == ["a", "b"] and by_name["a"].slice_param.slice_point == [1]
    assert list(by_name["silence"].top) == [] and list(by_name["silence"].bottom) == ["b"]
    assert by_name["ip"].include[0].phase == caffe.TRAIN and list(by_name["ip"].propagate_down) == [True]
    assert list(by_name["loss"].loss_weight) == [2.0] and by_name["loss"].loss_param.ignore_label == -1
    assert P.Pooling.AVE == caffe.caffe_pb2.PoolingParameter.AVE
    with pytest.raises(AttributeError, match='"nonsense" is neither a field of convolution_param'):
        L.Convolution(n.data, nonsense=1).to_proto()
    with pytest.raises(TypeError, match="input 0 is not a Top"):
        L.ReLU("data")
    net_obj = caffe.Net(net, caffe.TRAIN)          # sncaffe reads it
    out = net_obj.forward(data=np.ones((2, 3, 4, 4), np.float32), label=np.zeros(2, np.float32))
    assert set(out) == {"loss"}
