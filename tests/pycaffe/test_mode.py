"""caffe.set_mode_*, and the errors a pycaffe user meets first."""
import pytest

import sncaffe.pycaffe as caffe
from sncaffe.backend.cuda import unusable_reason
from pycaffe_fixtures import lenet_fixture  # noqa: F401 (fixtures)

NO_GPU = unusable_reason()


@pytest.mark.skipif(NO_GPU is None, reason="a GPU is usable here")
def test_set_mode_gpu_says_why_without_a_gpu():
    caffe.set_device(0)
    with pytest.raises(RuntimeError, match=r"caffe.set_mode_gpu\(\): .*(CuPy|GPU|cuDNN)"):
        caffe.set_mode_gpu()
    caffe.set_mode_cpu()
    assert caffe._caffe.device().name == "cpu"


def test_clear_errors(lenet):
    net = caffe.Net(str(lenet["deploy"]), caffe.TEST)
    with pytest.raises(ValueError, match='blob "conv1" is not an input of the net'):
        net.blobs["conv1"].reshape(1, 20, 24, 24)
    with pytest.raises(ValueError, match='keep: no blob "nope"'):
        caffe.Net(str(lenet["deploy"]), caffe.TEST, keep=["nope"])
    with pytest.raises(ValueError, match='no layer "nope"'):
        net.forward(end="nope")
    with pytest.raises(Exception, match="Input blob arguments do not match net inputs"):
        net.forward(label=1)
    with pytest.raises(TypeError, match="needs a phase"):
        caffe.Net(str(lenet["deploy"]))
    with pytest.raises(ValueError, match="phase must be TRAIN or TEST"):
        caffe.Net(str(lenet["deploy"]), "weights.caffemodel", "VAL")
    mem = caffe.Net(str(lenet["deploy"]), caffe.TEST, memory="liveness")
    with pytest.raises(RuntimeError, match=r"backward\(\) needs a forward\(\) first in memory mode 'liveness'"):
        mem.backward()
