"""Golden coverage cases computed by real BVLC Caffe 1.0 (tests/data/shared/golden/coverage and
coverage-nets, see README-coverage.md), run through sncaffe.Net: loss, every blob's data and diff,
every parameter's data and diff, at 1e-5 for layers and 1e-4 for nets."""
import shutil

import h5py
import numpy as np
import pytest

from conftest import SHARED, needs_shared
from layers.golden import run_golden_net

# Cases whose layer types are checked by their own layer tests instead; empty: every case runs here.
OTHER_HELPERS = set()
CASES = sorted(p.name for p in (SHARED / "golden" / "coverage").iterdir()
               if p.name not in OTHER_HELPERS) if SHARED else []
# A case whose net reads or writes files relative to the working directory, as Caffe does.
IN_CASE_DIR = {"infogain_loss_file"}
WRITES = {"hdf5_output"}


@needs_shared
@pytest.mark.parametrize("case", CASES)
def test_coverage_case(case, tmp_path, monkeypatch):
    d = SHARED / "golden" / "coverage" / case
    if case in IN_CASE_DIR:
        monkeypatch.chdir(d)
    if case in WRITES:
        monkeypatch.chdir(tmp_path)
    run_golden_net(d)
    if case == "hdf5_output":
        with h5py.File(tmp_path / "hdf5_output.h5") as got, h5py.File(d / "expected.h5") as exp:
            want = exp["files"]["hdf5_output.h5"]
            assert sorted(got) == sorted(want)
            for name in want:
                assert got[name].dtype == np.float32 and got[name].shape == want[name].shape
                np.testing.assert_array_equal(got[name][()], want[name][()])


@needs_shared
def test_infogain_source_is_resolved_against_the_working_directory(tmp_path, monkeypatch):
    """Caffe opens ``source`` relative to the process's working directory, not the prototxt's
    folder: from elsewhere the net is refused, naming the layer and the file."""
    from sncaffe import Net
    from sncaffe.graph import GraphError
    d = SHARED / "golden" / "coverage" / "infogain_loss_file"
    monkeypatch.chdir(tmp_path)
    with pytest.raises(GraphError, match=r'layer "loss" \(InfogainLoss\).*not found: "H.binaryproto"'):
        Net(d / "net.prototxt", "TRAIN")
    shutil.copy(d / "H.binaryproto", tmp_path)
    run_golden_net(d)


@needs_shared
def test_hdf5_output_file_is_created_at_construction(tmp_path, monkeypatch):
    from sncaffe import Net
    monkeypatch.chdir(tmp_path)
    Net(SHARED / "golden" / "coverage" / "hdf5_output" / "net.prototxt", "TRAIN")
    with h5py.File(tmp_path / "hdf5_output.h5") as f:
        assert list(f) == []


@needs_shared
def test_fcn_crop():
    """Crop after a Deconvolution (FCN), at the nets' tolerance."""
    run_golden_net(SHARED / "golden" / "coverage-nets" / "fcn_crop", rtol=1e-4, atol=1e-5)


# REFUSED-coverage.md: nets Caffe builds but stops at Backward, with force_backward: true.
REFUSED_AT_BACKWARD = {
    "embed": r'layer "embed" \(Embed\): can.t backpropagate to the Embed input',
    "filter": r'layer "filter" \(Filter\): cannot backpropagate to the filter index input',
    "batch_reindex": r'layer "reindex" \(BatchReindex\): cannot backprop to index',
    "infogain_loss": r'layer "loss" \(InfogainLoss\): cannot backpropagate to the infogain input H',
    "threshold": r'layer "threshold" \(Threshold\): has no backward',
}


@needs_shared
@pytest.mark.parametrize("case", sorted(REFUSED_AT_BACKWARD))
@pytest.mark.parametrize("propagate_down", [False, True], ids=["", "propagate_down_false"])
def test_force_backward_refused_as_caffe(case, propagate_down):
    """force_backward turns on the gradient of inputs Caffe cannot differentiate; propagate_down:
    false on the layer does not turn it off (REFUSED-coverage.md, second row)."""
    from sncaffe import Net
    from sncaffe.layers.base import LayerError
    from sncaffe.prototxt import read_text
    from sncaffe.proto import sncaffe_pb2 as pb
    d = SHARED / "golden" / "coverage" / case
    param = read_text(d / "net.prototxt", pb.NetParameter())
    param.force_backward = True
    if propagate_down:
        layer = param.layer[-2] if case in ("embed", "filter", "batch_reindex") else param.layer[-1]
        layer.propagate_down.extend([False] * len(layer.bottom))
    net = Net(param, "TRAIN", weights=d / "weights.caffemodel")
    with h5py.File(d / "input.h5") as inp:
        for name, arr in inp["inputs"].items():
            net.blobs[name].data[...] = arr[()]
    net.forward()
    with pytest.raises(LayerError, match=REFUSED_AT_BACKWARD[case]):
        net.backward()
