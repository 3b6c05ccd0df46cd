"""Golden cases computed by real BVLC Caffe 1.0 (tests/data/shared/golden/coverage*): shared
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


# -- old formats upgraded on load -------------------------------------------------------------

def state(net):
    out = {f"{n}.{w}": getattr(b, w).tobytes() for n, b in net.blobs.items() for w in ("data", "diff")
           if getattr(b, w) is not None}
    out.update({f"{n}[{i}].{w}": getattr(b, w).tobytes() for n, bl in net.params.items()
                for i, b in enumerate(bl) for w in ("data", "diff")})
    return out


@needs_shared
@pytest.mark.parametrize("case", ["lenet_v1", "lenet_v0"])
def test_old_format_loads_unchanged_and_upgrades_to_the_same_bits(case, tmp_path, capsys):
    from sncaffe.cli import main
    from sncaffe.proto import sncaffe_pb2 as pb
    d = case_dir("coverage-nets/" + case)
    assert b"layers {" in (d / "net.prototxt").read_bytes()
    assert pb.NetParameter.FromString((d / "weights.caffemodel").read_bytes()).layers   # really V1/V0 inside
    old = run_net_case(d)
    assert main(["upgrade", str(d / "net.prototxt"), str(tmp_path / "net.prototxt")]) == 0
    assert main(["upgrade", str(d / "weights.caffemodel"), str(tmp_path / "weights.caffemodel")]) == 0
    text = (tmp_path / "net.prototxt").read_text()
    assert "layers {" not in text and 'type: "Input"' in text and "input_dim" not in text
    model = pb.NetParameter.FromString((tmp_path / "weights.caffemodel").read_bytes())
    assert not model.layers and [lp.name for lp in model.layer if lp.blobs] == ["conv1", "conv2", "ip1", "ip2"]
    for name in ("net.prototxt", "input.h5", "expected.h5"):
        if name != "net.prototxt":
            (tmp_path / name).symlink_to(d / name)
    new = run_net_case(tmp_path)
    assert state(new) == state(old)


# -- N-d convolution --------------------------------------------------------------------------

@needs_shared
def test_conv3d_layer():
    from layers.golden import run_golden_layer
    h = run_golden_layer("../coverage/conv3d")
    assert h.layer.nd and h.layer.blobs[0].data.shape == (3, 2, 3, 3, 3)


@needs_shared
def test_conv3d_net():
    run_net_case(case_dir("coverage/conv3d"))


def test_caffes_refusals_name_the_layer():
    """REFUSED-coverage.md: mismatched lr_mult on a shared weight; Pooling on a 5-axis blob."""
    from sncaffe.backend.cpu import CPUDevice
    from sncaffe.graph import GraphError
    from sncaffe.proto import sncaffe_pb2 as pb
    from sncaffe.prototxt import parse_text
    ip = ('layer {{ name: "{0}" type: "InnerProduct" bottom: "x" top: "{0}" param {{ name: "w" lr_mult: {1} }} '
          'inner_product_param {{ num_output: 4 }} }}')
    text = ('layer { name: "input" type: "Input" top: "x" input_param { shape { dim: 3 dim: 5 } } }'
            + ip.format("ip_a", 1) + ip.format("ip_b", 2))
    with pytest.raises(GraphError, match=r"layer \"ip_b\": shared param 'w' has mismatched lr_mult \(2 vs. 1"):
        Net(parse_text(text, pb.NetParameter()), device=CPUDevice(1 << 20))
    text = ('layer { name: "input" type: "Input" top: "x" input_param { shape { dim: 1 dim: 2 dim: 4 dim: 4 dim: 4 } } }'
            'layer { name: "pool" type: "Pooling" bottom: "x" top: "y" pooling_param { pool: MAX kernel_size: 2 stride: 2 } }')
    with pytest.raises(GraphError, match=r'layer "pool" \(Pooling\): input must have 4 axes'):
        Net(parse_text(text, pb.NetParameter()), device=CPUDevice(1 << 20))
