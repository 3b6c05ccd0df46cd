"""pycaffe's Net over the one shared device: a dropped net gives its pool blocks back, and a
failed reshape leaves the net as it was."""
import gc
import weakref

import numpy as np
import pytest

import sncaffe.pycaffe as caffe
from sncaffe.graph import GraphError
from sncaffe.pycaffe import _caffe
from pycaffe_fixtures import lenet_fixture  # noqa: F401 (fixture)


def test_nets_created_and_dropped_give_their_blocks_back(lenet):
    pool = _caffe.device().pool
    caffe.Net(str(lenet["deploy"]), caffe.TEST)
    gc.collect()
    caffe.Net(str(lenet["deploy"]), caffe.TEST)            # gives back the first one's blocks
    in_use = pool.in_use
    refs = []
    for _ in range(20):
        net = caffe.Net(str(lenet["deploy"]), caffe.TEST)
        refs.append(weakref.ref(net))
        del net
        gc.collect()
    assert not any(r() for r in refs)
    assert pool.in_use == in_use                            # 8 MiB more per net, were they kept


def test_a_net_sharing_the_weights_of_a_dropped_net_keeps_them(lenet):
    source = caffe.Net(str(lenet["deploy"]), caffe.TEST)
    w = np.array(source.params["conv1"][0].data)
    net = caffe.Net(str(lenet["deploy"]), caffe.TEST)
    net.share_with(source)
    del source
    gc.collect()
    other = caffe.Net(str(lenet["deploy"]), caffe.TEST)     # would take the dropped net's blocks
    other.params["conv1"][0].data[...] = 7
    np.testing.assert_array_equal(net.params["conv1"][0].data, w)


def test_a_failed_reshape_leaves_the_net_as_it_was(lenet):
    net = caffe.Net(str(lenet["deploy"]), caffe.TEST)
    x = np.random.default_rng(0).random((10, 1, 28, 28), np.float32)
    net.blobs["data"].data[...] = x
    before = net.forward()["prob"].copy()
    net.blobs["data"].reshape(2, 1, 3, 3)
    with pytest.raises(GraphError, match=r'layer "conv1" \(Convolution\): kernel extent \[5, 5\] exceeds'):
        net.reshape()
    assert net.blobs["data"].data.shape == (10, 1, 28, 28)
    np.testing.assert_array_equal(net.blobs["data"].data, x)
    np.testing.assert_array_equal(net.forward()["prob"], before)
    net.blobs["data"].reshape(3, 1, 28, 28)
    net.reshape()
    assert net.forward()["prob"].shape == (3, 10)
