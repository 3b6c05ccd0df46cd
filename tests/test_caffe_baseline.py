"""tools/caffe_baseline.py's output check: it rejects what no training step produces."""
import math
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import caffe_baseline  # noqa: E402


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_outputs_verdict_rejects_a_loss_that_is_not_finite_even_when_both_agree(bad):
    verdict = caffe_baseline.outputs_verdict({"loss": bad, "accuracy": 0.1}, {"loss": bad, "accuracy": 0.1})
    assert verdict.startswith("NOT FINITE") and "loss" in verdict


def test_outputs_verdict_agrees_within_rtol_and_not_beyond():
    assert caffe_baseline.outputs_verdict({"loss": 2.0}, {"loss": 2.0 * (1 + 5e-5)}) == "agree"
    assert caffe_baseline.outputs_verdict({"loss": 2.0}, {"loss": 2.0 * (1 + 5e-4)}).startswith("DIFFER")
    assert caffe_baseline.outputs_verdict({"loss": 2.0}, {"loss": 2.0, "accuracy": 0.5}).startswith("DIFFER")
    assert caffe_baseline.outputs_verdict({}, {}).startswith("DIFFER")


def test_the_test_net_of_a_fresh_batchnorm_resnet_has_a_finite_loss(tmp_path):
    """The weights the baseline hands both frameworks carry one batch's BatchNorm statistics, so
    the CIFAR ResNet's TEST-phase loss is finite (with zero statistics it overflowed to NaN)."""
    from sncaffe import Net
    from sncaffe.backend.cpu import CPUDevice
    from sncaffe.data.synthetic import SyntheticInputs
    from sncaffe.proto import sncaffe_pb2 as pb
    from sncaffe.prototxt import read_text, set_batch
    param = set_batch(read_text(ROOT / "prototxt" / "cifar10_resnet.prototxt", pb.NetParameter()), 2)
    net = caffe_baseline.write_inputs(param, tmp_path / "inputs.h5")
    net.save(tmp_path / "w.caffemodel")
    fresh = Net(param, "TEST", device=CPUDevice(), memory="none")
    SyntheticInputs(0)(fresh)
    assert not np.isfinite(fresh.forward())           # the failure the baseline used to time
    test = Net(param, "TEST", weights=tmp_path / "w.caffemodel", device=CPUDevice(), memory="none")
    SyntheticInputs(0)(test)
    assert np.isfinite(test.forward())
