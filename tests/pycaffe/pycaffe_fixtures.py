"""Fixtures for the pycaffe-style scripts: small MNIST LMDBs and LeNet prototxt, as a Caffe user has.

Test modules import them (``from pycaffe_fixtures import lenet_fixture``); not a conftest.py,
whose module name would shadow tests/conftest.py for ``from conftest import ...`` elsewhere.
Each is made once per session (the cache below), whichever modules use it.
"""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MNIST = ROOT / "data/mnist"
IMAGES, LABELS = MNIST / "t10k-images-idx3-ubyte.gz", MNIST / "t10k-labels-idx1-ubyte.gz"

DEPLOY = """name: "LeNet"
layer { name: "data" type: "Input" top: "data" input_param { shape: { dim: 10 dim: 1 dim: 28 dim: 28 } } }
"""


_MADE = {}


@pytest.fixture(scope="session", name="lenet")
def lenet_fixture(tmp_path_factory):
    """Caffe's LeNet train_val and solver over 640 training and 200 test images (LMDBs made by
    convert_mnist_data), and its deploy net: {"train_val", "solver", "deploy", "dir"}."""
    if not IMAGES.is_file():
        pytest.skip("data/mnist not present")
    if "lenet" not in _MADE:
        _MADE["lenet"] = _make_lenet(tmp_path_factory)
    return _MADE["lenet"]


def _make_lenet(tmp_path_factory):
    from sncaffe.tools.convert_mnist_data import main as convert
    d = tmp_path_factory.mktemp("lenet")
    convert([str(IMAGES), str(LABELS), str(d / "train_lmdb"), "--count", "640"])
    convert([str(IMAGES), str(LABELS), str(d / "test_lmdb"), "--start", "8000", "--count", "200"])
    net = (ROOT / "prototxt/lenet_train_test.prototxt").read_text()
    net = net.replace("data/mnist/mnist_train_lmdb", str(d / "train_lmdb"))
    net = net.replace("data/mnist/mnist_test_lmdb", str(d / "test_lmdb"))
    (d / "lenet_train_test.prototxt").write_text(net)
    solver = (ROOT / "prototxt/lenet_solver.prototxt").read_text()
    solver = solver.replace('"prototxt/lenet_train_test.prototxt"', f'"{d / "lenet_train_test.prototxt"}"')
    solver = re.sub(r"test_iter: \d+", "test_iter: 2", solver)
    solver = re.sub(r"test_interval: \d+", "test_interval: 25", solver)
    solver = re.sub(r"display: \d+", "display: 10", solver)
    solver = re.sub(r"max_iter: \d+", "max_iter: 50", solver)
    solver = re.sub(r"snapshot: \d+", "snapshot: 0", solver)
    solver = solver.replace('"out/lenet"', f'"{d / "snap/lenet"}"')
    (d / "snap").mkdir()
    (d / "lenet_solver.prototxt").write_text(solver)
    # Caffe's lenet.prototxt: the deploy net (an Input layer, no loss, a Softmax "prob").
    body = net[net.index('layer {\n  name: "conv1"'):net.index('layer {\n  name: "accuracy"')]
    deploy = DEPLOY + body + 'layer { name: "prob" type: "Softmax" bottom: "ip2" top: "prob" }\n'
    (d / "lenet.prototxt").write_text(deploy)
    return {"dir": d, "train_val": d / "lenet_train_test.prototxt", "solver": d / "lenet_solver.prototxt",
            "deploy": d / "lenet.prototxt"}


@pytest.fixture(scope="session", name="trained")
def trained_fixture(lenet):
    """LeNet trained 50 iterations by the pycaffe SGDSolver; its .caffemodel."""
    if "trained" in _MADE:
        return _MADE["trained"]
    import sncaffe.pycaffe as caffe
    solver = caffe.SGDSolver(str(lenet["solver"]))
    solver.step(50)
    path = lenet["dir"] / "lenet_50.caffemodel"
    solver.net.save(str(path))
    _MADE["trained"] = path
    return path
