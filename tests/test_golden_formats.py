"""Golden cases of issue 14 computed by real BVLC Caffe 1.0 (../shared/golden/coverage*): shared
parameters, V0/V1 files upgraded on load, N-d convolution; through sncaffe.Net (nets, 1e-4) and
run_golden_layer (layers, 1e-5), forward and backward, every blob and parameter."""
import h5py
import numpy as np
import pytest

from conftest import SHARED, needs_shared
from sncaffe import Net
from sncaffe.layers import REGISTRY

NET_TOL = dict(rtol=1e-4, atol=1e-5)


def attr_list(value):
    return (value.decode() if isinstance(value, bytes) else str(value)).split("\n")


def key(name):
    return name.replace("/", "|")


def case_dir(case):
    return SHARED / "golden" / case


def run_net_case(d, net=None):
    """Run the case in ``d`` and compare every blob and parameter (data and diff) with Caffe's dump."""
    net = net or Net(d / "net.prototxt", "TRAIN", weights=d / "weights.caffemodel")
    with h5py.File(d / "input.h5") as inp, h5py.File(d / "expected.h5") as exp:
        assert list(net.blobs) == attr_list(exp.attrs["blob_names"])
        assert net.layer_names == attr_list(exp.attrs["layer_names"])
        assert [l.type for l in net.layers] == attr_list(exp.attrs["layer_types"])
        for name, arr in inp["inputs"].items():
            net.blobs[name.replace("|", "/")].data[...] = arr[()]
        loss = net.forward()
        np.testing.assert_allclose(loss, exp.attrs["loss"][0], **NET_TOL)
        for name, arr in inp.get("top_diffs", {}).items():
            net.blobs[name.replace("|", "/")].diff[...] = arr[()]
        net.clear_param_diffs()
        net.backward()
        for name, blob in net.blobs.items():
            g = exp["blobs"][key(name)]
            np.testing.assert_allclose(blob.data, g["data"][()], **NET_TOL, err_msg=f"data of {name}")
            diff = blob.diff if blob.diff is not None else np.zeros(blob.data.shape)
            np.testing.assert_allclose(diff, g["diff"][()], **NET_TOL, err_msg=f"diff of {name}")
        assert sorted(net.params) == sorted(k.replace("|", "/") for k in exp["params"])
        for layer, blobs in net.params.items():
            assert len(blobs) == len(exp["params"][key(layer)])
            for i, blob in enumerate(blobs):
                g = exp["params"][key(layer)][str(i)]
                for what in ("data", "diff"):
                    np.testing.assert_allclose(getattr(blob, what), g[what][()].reshape(blob.data.shape),
                                               **NET_TOL, err_msg=f"param {layer}[{i}] {what}")
    return net


# -- shared parameters ------------------------------------------------------------------------

@needs_shared
def test_shared_lr_mult():
    """The owner names no lr_mult, the sharer 0: the shared diff is the owner's gradient alone."""
    net = run_net_case(case_dir("coverage-nets/shared_lr_mult"))
    a, b = net.params["ip_a"][0], net.params["ip_b"][0]
    assert np.shares_memory(a.data, b.data) and np.shares_memory(a.diff, b.diff)
    assert not np.shares_memory(net.params["ip_a"][1].data, net.params["ip_b"][1].data)


@needs_shared
@pytest.mark.skipif("ContrastiveLoss" not in REGISTRY,
                    reason="ContrastiveLoss is not registered yet (another branch adds it)")
def test_siamese_shared():
    net = run_net_case(case_dir("coverage-nets/siamese_shared"))
    for name in ("conv1", "ip1", "feat"):
        for x, y in zip(net.params[name], net.params[name + "_p"]):
            assert np.shares_memory(x.data, y.data) and np.shares_memory(x.diff, y.diff)
