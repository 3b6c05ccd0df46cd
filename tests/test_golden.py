"""Every golden case computed by real BVLC Caffe 1.0, run through sncaffe.Net."""
import h5py
import numpy as np
import pytest

from sncaffe import Net
from conftest import SHARED, needs_shared

CASES = sorted(p.relative_to(SHARED / "golden").as_posix()
               for kind in ("layers", "nets") for p in (SHARED / "golden" / kind).iterdir()) if SHARED else []


def attr_list(value):
    return (value.decode() if isinstance(value, bytes) else str(value)).split("\n")


def key(name):
    return name.replace("/", "|")


@needs_shared
@pytest.mark.parametrize("case", CASES)
def test_golden_case(case):
    d = SHARED / "golden" / case
    rtol, atol = (1e-4, 1e-5) if case.startswith("nets/") else (1e-5, 1e-6)
    net = Net(d / "net.prototxt", "TRAIN", weights=d / "weights.caffemodel")
    with h5py.File(d / "input.h5") as inp, h5py.File(d / "expected.h5") as exp:
        assert net.graph.param.layer[0].name == "input"
        assert list(net.blobs) == attr_list(exp.attrs["blob_names"])
        assert net.layer_names == attr_list(exp.attrs["layer_names"])
        for name, arr in inp["inputs"].items():
            net.blobs[name.replace("|", "/")].data[...] = arr[()]
        loss = net.forward()
        np.testing.assert_allclose(loss, exp.attrs["loss"][0], rtol=rtol, atol=atol)
        for name, arr in inp.get("top_diffs", {}).items():
            net.blobs[name.replace("|", "/")].diff[...] = arr[()]
        net.clear_param_diffs()
        net.backward()
        for name, blob in net.blobs.items():
            g = exp["blobs"][key(name)]
            np.testing.assert_allclose(blob.data, g["data"][()], rtol=rtol, atol=atol,
                                       err_msg=f"{case}: data of {name}")
            diff = blob.diff if blob.diff is not None else np.zeros(blob.data.shape)
            np.testing.assert_allclose(diff, g["diff"][()], rtol=rtol, atol=atol,
                                       err_msg=f"{case}: diff of {name}")
        for layer, blobs in net.params.items():
            for i, blob in enumerate(blobs):
                g = exp["params"][key(layer)][str(i)]
                np.testing.assert_allclose(blob.data, g["data"][()].reshape(blob.data.shape), rtol=rtol,
                                           atol=atol, err_msg=f"{case}: param {layer}[{i}] data")
                np.testing.assert_allclose(blob.diff, g["diff"][()].reshape(blob.data.shape), rtol=rtol,
                                           atol=atol, err_msg=f"{case}: param {layer}[{i}] diff")
