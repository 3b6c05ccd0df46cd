"""``sncaffe export`` and ``Net.to_onnx``/``to_torch``: files written only after the check, errors
a user can act on, a module that loads from its own file."""
import re
import subprocess
import sys

import numpy as np
import pytest

from conftest import ROOT

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
torch = pytest.importorskip("torch")

from sncaffe import Net  # noqa: E402
from sncaffe.cli import main  # noqa: E402
from sncaffe.export import ExportError  # noqa: E402
from sncaffe.export.deploy import load  # noqa: E402
from sncaffe.proto import sncaffe_pb2 as pb  # noqa: E402
from sncaffe.prototxt import read_text, set_batch  # noqa: E402

LENET = str(ROOT / "prototxt" / "lenet_train_test.prototxt")


def test_onnx_export_prints_every_output_and_writes_the_deploy_graph(tmp_path, capsys):
    out = tmp_path / "lenet.onnx"
    weights = tmp_path / "lenet.caffemodel"
    src = load(LENET, "TEST", shapes={"data": (1, 1, 28, 28)}, seed=5)
    src.save(weights)
    assert main(["export", LENET, str(weights), "--onnx", str(out), "--input", "data=3,1,28,28"]) == 0
    text = capsys.readouterr().out
    assert "inputs: data (3, 1, 28, 28)" in text
    assert "ip2 (3, 10): largest relative difference" in text
    model = onnx.load(str(out))
    assert [i.name for i in model.graph.input] == ["data"]          # the label fed only the losses
    assert [o.name for o in model.graph.output] == ["ip2"]
    assert not {n.op_type for n in model.graph.node} & {"SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss"}
    conv1 = next(t for t in model.graph.initializer if t.name.startswith("conv1/weight"))
    assert np.array_equal(onnx.numpy_helper.to_array(conv1), src.params["conv1"][0].data)


def test_torch_export_writes_source_and_state_dict_that_load_alone(tmp_path, capsys):
    out = tmp_path / "cifar.py"
    assert main(["export", str(ROOT / "prototxt" / "cifar10_resnet.prototxt"), "--torch", str(out), "--batch", "1"]) == 0
    assert "21 BatchNorm layers hold no statistics" in capsys.readouterr().out
    # the user's own Python, without sncaffe: the file and its weights
    code = (f"import sys, torch; sys.path.insert(0, {str(tmp_path)!r}); import cifar; "
            "m = cifar.CIFAR10ResNet20(); "
            f"m.load_state_dict(torch.load({str(tmp_path / 'cifar.pt')!r})); m.eval(); "
            "print(tuple(m(torch.randn(1, 3, 32, 32)).shape), m.conv1_bn.factor.item())")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={"PYTHONNOUSERSITE": "1", "PATH": "/usr/bin:/bin", "OPENBLAS_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["(1,", "10)", "0.0"]        # written as they are: no statistics yet


def test_a_failed_check_exits_1_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "lenet.onnx"
    code = main(["export", LENET, "--onnx", str(out), "--input", "data=1,1,28,28", "--rtol", "0"])
    err = capsys.readouterr().err
    assert code == 1 and "differs from sncaffe by more than 0" in err and "ip2 (1, 10)" in err
    assert not out.exists()


@pytest.mark.parametrize("args, message", [
    ([LENET, "--onnx", "x.onnx"], 'layer "mnist" \\(Data\\): LMDB .* does not exist; .*--input data=N,C,H,W'),
    ([LENET, "--onnx", "x.onnx", "--input", "data=1,x"], "--input data=1,x: give BLOB=N,C,H,W"),
    ([LENET, "--torch", "x.pt", "--input", "data=1,1,28,28"], "give the module a .py name"),
])
def test_errors_name_what_to_change(args, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["export", *args]) == 1
    assert re.search(message, capsys.readouterr().err)


def test_help_says_what_is_exported_and_refused(capsys):
    with pytest.raises(SystemExit):
        main(["export", "--help"])
    text = capsys.readouterr().out
    for words in ("data layers", "dropped", "refused by name", "--rtol", "STOCHASTIC", "relative"):
        assert words in text


def cifar_resnet(phase):
    param = set_batch(read_text(ROOT / "prototxt" / "cifar10_resnet.prototxt", pb.NetParameter()), 2)
    return Net(param, phase, seed=2)


def test_net_methods_export_the_deploy_part(tmp_path):
    net = cifar_resnet("TEST")
    assert "loss" in net.layer_names and "label" in net.inputs
    for node in net.graph.layers:                   # trained-like statistics
        if node.type == "BatchNorm":
            node.layer.blobs[1].data[...] = 1
            node.layer.blobs[2].data[...] = 1
    model = net.to_onnx(tmp_path / "c.onnx")
    assert [o.name for o in model.graph.output] == ["fc10"] and (tmp_path / "c.onnx").is_file()
    module = net.to_torch()
    assert not module.training and module.outputs == ("fc10",)
    train = cifar_resnet("TRAIN").to_torch()
    assert train.training
    with pytest.raises(ExportError, match="batch's statistics"):
        cifar_resnet("TRAIN").to_onnx()


def test_a_missing_extra_is_named(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "onnxruntime", None)       # as if not installed
    assert main(["export", LENET, "--onnx", "x.onnx", "--input", "data=1,1,28,28"]) == 1
    assert "needs onnxruntime: pip install 'sncaffe[onnx]'" in capsys.readouterr().err
