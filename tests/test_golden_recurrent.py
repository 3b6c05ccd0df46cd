"""The recurrent golden cases computed by real BVLC Caffe 1.0 (coverage/{lstm,lstm_unit,rnn,rnn_static},
coverage-nets/lstm_seq), run through sncaffe.Net: every blob's data and diff, every parameter's."""
import h5py
import numpy as np
import pytest
from google.protobuf import text_format

from sncaffe import Net
from sncaffe.layers import REGISTRY
from sncaffe.proto import sncaffe_pb2 as pb
from conftest import SHARED, needs_shared

LAYER_TOL = dict(rtol=1e-5, atol=1e-6)
NET_TOL = dict(rtol=1e-4, atol=1e-5)


def attr_list(value):
    return (value.decode() if isinstance(value, bytes) else str(value)).split("\n")


def run_case(d, net, tol, fed=()):
    """Feed the case's inputs (and ``fed`` blobs from expected.h5), run forward and backward,
    compare everything Caffe dumped for the blobs and layers the net has."""
    with h5py.File(d / "input.h5") as inp, h5py.File(d / "expected.h5") as exp:
        for name, arr in inp["inputs"].items():
            if name in net.blobs:
                net.blobs[name].data[...] = arr[()]
        for name in fed:
            net.blobs[name].data[...] = exp["blobs"][name]["data"][()]
        loss = net.forward()
        np.testing.assert_allclose(loss, exp.attrs["loss"][0], **tol)
        for name, arr in inp.get("top_diffs", {}).items():
            net.blobs[name].diff[...] = arr[()]
        net.clear_param_diffs()
        net.backward()
        for name, blob in net.blobs.items():
            g = exp["blobs"][name]
            np.testing.assert_allclose(blob.data, g["data"][()], **tol, err_msg=f"{d.name}: data of {name}")
            diff = blob.diff if blob.diff is not None else np.zeros(blob.data.shape)
            np.testing.assert_allclose(diff, g["diff"][()], **tol, err_msg=f"{d.name}: diff of {name}")
        for layer, blobs in net.params.items():
            stored = exp["params"][layer]
            assert len(blobs) == len(stored), f"{layer}: Caffe's parameter count"
            for i, blob in enumerate(blobs):
                g = stored[str(i)]
                assert blob.data.shape == g["data"].shape, f"{layer}[{i}]: Caffe's parameter shape"
                np.testing.assert_allclose(blob.data, g["data"][()], **tol, err_msg=f"{layer}[{i}] data")
                np.testing.assert_allclose(blob.diff, g["diff"][()], **tol, err_msg=f"{layer}[{i}] diff")
    return net


@needs_shared
@pytest.mark.parametrize("case", ["lstm", "lstm_unit", "rnn", "rnn_static"])
def test_coverage_case(case):
    d = SHARED / "golden" / "coverage" / case
    net = Net(d / "net.prototxt", "TRAIN", weights=d / "weights.caffemodel")
    with h5py.File(d / "expected.h5") as exp:
        assert list(net.blobs) == attr_list(exp.attrs["blob_names"])
        assert net.layer_names == attr_list(exp.attrs["layer_names"])
    run_case(d, net, LAYER_TOL)


@needs_shared
@pytest.mark.skipif("Embed" not in REGISTRY, reason='lstm_seq needs the Embed layer, which is not registered '
                    '(helper "layers" adds it on another branch)')
def test_lstm_seq():
    d = SHARED / "golden" / "coverage-nets" / "lstm_seq"
    run_case(d, Net(d / "net.prototxt", "TRAIN", weights=d / "weights.caffemodel"), NET_TOL)


@needs_shared
def test_lstm_seq_from_its_embedding():
    """lstm_seq with Caffe's Embed output fed in its place: LSTM, InnerProduct and the loss, with
    force_backward so the embedding gets its diff, as Embed's backward needs it."""
    d = SHARED / "golden" / "coverage-nets" / "lstm_seq"
    param = text_format.Parse((d / "net.prototxt").read_text(), pb.NetParameter())
    embed = next(l for l in param.layer if l.type == "Embed")
    embed.type, embed.name = "Input", "embedding"       # renamed: the file's Embed weights skip it
    embed.ClearField("bottom")
    embed.ClearField("embed_param")
    embed.input_param.shape.add().dim.extend([4, 2, 5])
    param.force_backward = True
    net = Net(param, "TRAIN", weights=d / "weights.caffemodel")
    run_case(d, net, NET_TOL, fed=["embedded_input_sentence"])
