"""Runs one golden BVLC Caffe layer case standalone through ``Harness`` and compares it with Caffe.

A case is a folder ``<shared>/golden/layers/<case>`` holding net.prototxt (an Input layer and the layer
under test), weights.caffemodel, input.h5 (``inputs/<bottom>``, ``top_diffs/<top>``) and expected.h5
(``blobs/<name>/{data,diff}``, ``params/<layer>/<i>/{data,diff}``).
"""
import h5py
import numpy as np
from google.protobuf import text_format

from conftest import SHARED
from sncaffe.gradcheck import Harness
from sncaffe.layers import create_layer
from sncaffe.layers.base import TRAIN
from sncaffe.proto import sncaffe_pb2 as pb

TOL = dict(rtol=1e-5, atol=1e-6)


def golden_dir(case, folder="layers"):
    return SHARED / "golden" / folder / case


def golden_case(case, folder="layers"):
    """The case's one non-Input LayerParameter and its stored blobs (float32; [] when it has none)."""
    d = golden_dir(case, folder)
    net = text_format.Parse((d / "net.prototxt").read_text(), pb.NetParameter())
    lp = next(l for l in net.layer if l.type != "Input")
    weights = pb.NetParameter.FromString((d / "weights.caffemodel").read_bytes())
    blobs = next((l.blobs for l in weights.layer if l.name == lp.name), [])
    return lp, [np.array(b.data, np.float32).reshape(tuple(b.shape.dim)) for b in blobs]


def run_golden_layer(case, *, check_param_data=False, attrs=None, folder="layers"):
    """Run the case's layer in float32 (TRAIN phase) and assert it matches Caffe's dump. Returns the Harness.

    Compared: every top's data; then, unless the case is forward-only (no top_diffs and not a loss),
    each bottom's diff where the layer allows backward to it (not labels), the number and shapes of
    the parameter diffs and their values. A loss top gets its loss_weight as diff; a top without a
    stored diff (Pooling's mask) gets zeros. ``check_param_data``: also compare the parameter data
    after the pass (BatchNorm's running statistics). ``attrs``: set on the layer before its setup
    (a convolution's ``plan_options``). ``folder``: ``layers`` or ``coverage``.
    """
    d = golden_dir(case, folder)
    lp, params = golden_case(case, folder)
    layer = create_layer(lp, TRAIN)
    for k, v in (attrs or {}).items():
        setattr(layer, k, v)
    with h5py.File(d / "input.h5") as inp, h5py.File(d / "expected.h5") as exp:
        h = Harness(layer, [inp["inputs"][b][()] for b in lp.bottom], np.float32, params=params or None)
        tops = h.forward()
        assert len(tops) == len(lp.top)
        for name, y in zip(lp.top, tops):
            np.testing.assert_allclose(y, exp["blobs"][name]["data"][()], **TOL, err_msg=f"{case} top {name}")
        stored = exp["params"][lp.name] if lp.name in exp.get("params", {}) else {}
        if "top_diffs" in inp or layer.is_loss:
            given = inp.get("top_diffs", {})
            weight = lp.loss_weight[0] if lp.loss_weight else 1.0
            top_diffs = [given[name][()] if name in given
                         else np.array(weight) if layer.is_loss and i == 0
                         else np.zeros_like(y)
                         for i, (name, y) in enumerate(zip(lp.top, tops))]
            bottom_diffs, param_diffs = h.backward(top_diffs)
            for i, (name, dx) in enumerate(zip(lp.bottom, bottom_diffs)):
                if layer.allow_force_backward(i):
                    np.testing.assert_allclose(dx, exp["blobs"][name]["diff"][()], **TOL,
                                               err_msg=f"{case} diff {name}")
            assert len(param_diffs) == len(stored)
            for i, dp in enumerate(param_diffs):
                g = stored[str(i)]
                assert tuple(g["data"].shape) == dp.shape
                np.testing.assert_allclose(dp, g["diff"][()], **TOL, err_msg=f"{case} param {i} diff")
        if check_param_data:
            assert len(layer.blobs) == len(stored)
            for i, blob in enumerate(layer.blobs):
                np.testing.assert_allclose(blob.data, stored[str(i)]["data"][()], **TOL,
                                           err_msg=f"{case} param {i} data")
    return h


def run_golden_net(d, rtol=1e-5, atol=1e-6, net=None):
    """Run the case folder ``d`` (net.prototxt, weights.caffemodel, input.h5, expected.h5) through
    ``sncaffe.Net`` in TRAIN: inputs in, forward, top diffs in, backward; assert the loss, every
    blob's data and diff (0 where sncaffe keeps none) and every parameter's data and diff match
    Caffe's dump. Returns the Net."""
    import h5py
    from sncaffe import Net

    def names(value):
        return (value.decode() if isinstance(value, bytes) else str(value)).split("\n")

    net = net or Net(d / "net.prototxt", "TRAIN", weights=d / "weights.caffemodel")
    with h5py.File(d / "input.h5") as inp, h5py.File(d / "expected.h5") as exp:
        assert list(net.blobs) == names(exp.attrs["blob_names"])
        assert net.layer_names == names(exp.attrs["layer_names"])
        for name, arr in inp["inputs"].items():
            net.blobs[name.replace("|", "/")].data[...] = arr[()]
        loss = net.forward()
        np.testing.assert_allclose(loss, exp.attrs["loss"][0], rtol=rtol, atol=atol, err_msg=f"{d.name}: loss")
        for name, arr in inp.get("top_diffs", {}).items():
            net.blobs[name.replace("|", "/")].diff[...] = arr[()]
        net.clear_param_diffs()
        net.backward()
        for name, blob in net.blobs.items():
            g = exp["blobs"][name.replace("/", "|")]
            np.testing.assert_allclose(blob.data, g["data"][()], rtol=rtol, atol=atol,
                                       err_msg=f"{d.name}: data of {name}")
            diff = blob.diff if blob.diff is not None else np.zeros(blob.data.shape)
            np.testing.assert_allclose(diff, g["diff"][()], rtol=rtol, atol=atol,
                                       err_msg=f"{d.name}: diff of {name}")
        assert sorted(net.params) == sorted(k.replace("|", "/") for k in exp.get("params", {}))
        for layer, blobs in net.params.items():
            stored = exp["params"][layer.replace("/", "|")]
            assert len(blobs) == len(stored), f"{d.name}: number of params of {layer}"
            for i, blob in enumerate(blobs):
                g = stored[str(i)]
                for what, mine in (("data", blob.data), ("diff", blob.diff)):
                    np.testing.assert_allclose(mine, g[what][()].reshape(mine.shape), rtol=rtol, atol=atol,
                                               err_msg=f"{d.name}: param {layer}[{i}] {what}")
    return net
