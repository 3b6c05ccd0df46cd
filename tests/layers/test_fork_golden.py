"""The forks' layers against golden data recorded from each fork's own C++ code (built CPU-only).

tests/data/fork_golden/README.md says how the data was made. Each case holds the LayerParameter
text, the bottoms, any parameter blobs and top diffs, and the fork's tops, bottom diffs and
parameter diffs, all float32.
"""
from pathlib import Path

import numpy as np
import pytest
from google.protobuf import text_format

from sncaffe.gradcheck import Harness, make_layer
from sncaffe.layers.base import TEST, TRAIN
from sncaffe.proto import sncaffe_pb2 as pb

DATA = Path(__file__).resolve().parents[1] / "data" / "fork_golden"
CASES = sorted(DATA.glob("*/*.npz"))
# Gradients where sncaffe and the fork part (each checked on its own below): SSD's Normalize
# scales the projected gradient by the channel's scale, not the exact gradient; PSPNet's BN in the
# TEST phase differentiates through batch statistics it did not use, where sncaffe's is exact for
# the input, and sncaffe gives slope and bias no gradient there (it keeps no normalised input).
EXACT_NOT_FORK = {"ssd/normalize_per_location_channels": {"bottom0"},
                  "pspnet/bn_test_phase": {"bottom0", "param0", "param1"}}


def _group(case, key):
    out, i = [], 0
    while f"{key}{i}" in case:
        out.append(case[f"{key}{i}"])
        i += 1
    return out


def test_golden_data_is_there():
    for fork in ("ssd", "faster_rcnn", "segnet", "pspnet", "senet"):
        assert (DATA / fork / "LICENSE").is_file()
        assert len(list((DATA / fork).glob("*.npz"))) >= 3, fork


@pytest.mark.parametrize("path", CASES, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_layer_matches_the_fork(path):
    case = dict(np.load(path))
    text = str(case["prototxt"])
    phase = TEST if text_format.Parse(text, pb.LayerParameter()).phase == pb.TEST else TRAIN
    layer = make_layer(text, phase=phase)
    bottoms, params = _group(case, "bottom"), _group(case, "param")
    h = Harness(layer, bottoms, dtype=np.float32, params=params or None)
    tops = h.forward()
    if getattr(layer, "data_dependent", False):
        # The harness holds the planned (largest) top; the rows the layer found come first.
        shapes = layer.top_shapes(h.bottom)
        tops = [t.reshape(-1)[:int(np.prod(s))].reshape(s) for t, s in zip(tops, shapes)]
    expect = _group(case, "top")
    assert len(tops) == len(expect)
    for got, want in zip(tops, expect):
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    top_diffs = _group(case, "top_diff")
    if layer.is_loss:
        weight = layer.param.loss_weight[0] if layer.param.loss_weight else 1.0
        top_diffs = [np.full(t.shape, weight, np.float32) for t in tops]
    if top_diffs:
        _check_backward(case, path, layer, h, top_diffs)
    for i, want in enumerate(_group(case, "param_after")):    # running statistics
        np.testing.assert_allclose(layer.blobs[i].data, want, rtol=1e-5, atol=1e-6, err_msg=f"param {i}")


def _check_backward(case, path, layer, h, top_diffs):
    prop = [bool(p) for p in case["propagate_down"]]
    own = EXACT_NOT_FORK.get(f"{path.parent.name}/{path.stem}", set())
    bottom_diffs, param_diffs = h.backward(top_diffs, prop)
    for i, (got, want) in enumerate(zip(bottom_diffs, _group(case, "bottom_diff"))):
        if prop[i] and f"bottom{i}" not in own:
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=f"bottom {i} diff")
    for i, (got, want) in enumerate(zip(param_diffs, _group(case, "param_diff"))):
        if f"param{i}" not in own:
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=f"param {i} diff")


def test_normalize_fork_gradient_differs_only_by_where_the_scale_applies():
    case = dict(np.load(DATA / "ssd" / "normalize_per_location_channels.npz"))
    x, scale, dy = case["bottom0"].astype(np.float64), case["param0"].astype(np.float64), case["top_diff0"]
    layer = make_layer(str(case["prototxt"]))
    h = Harness(layer, [x], params=[scale])
    h.forward()
    exact = h.backward([dy], [True])[0][0]
    norm = np.sqrt((x * x).sum(axis=1, keepdims=True) + 1e-6)
    xhat, s = x / norm, scale.reshape(1, -1, 1, 1)
    fork = (dy - xhat * (xhat * dy).sum(axis=1, keepdims=True)) / norm * s
    np.testing.assert_allclose(case["bottom_diff0"], fork, rtol=1e-4, atol=1e-5)
    g = dy * s
    np.testing.assert_allclose(exact, (g - xhat * (xhat * g).sum(axis=1, keepdims=True)) / norm, rtol=1e-10)
    assert not np.allclose(exact, case["bottom_diff0"], rtol=1e-3, atol=1e-4)


def test_pspnet_bn_fork_test_phase_gradient_is_the_training_formula_on_stored_statistics():
    case = dict(np.load(DATA / "pspnet" / "bn_test_phase.npz"))
    x, dy = case["bottom0"].astype(np.float64), case["top_diff0"].astype(np.float64)
    slope, bias, mean, var = (case[f"param{i}"].astype(np.float64) for i in range(4))
    inv = 1 / np.sqrt(var + 1e-5)
    x_norm = (x - mean) * inv
    g = dy * slope * inv
    fork = g - g.mean(axis=(0, 2, 3), keepdims=True) - x_norm * (g * x_norm).mean(axis=(0, 2, 3), keepdims=True)
    np.testing.assert_allclose(case["bottom_diff0"], fork, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(case["param_diff0"], (dy * x_norm).sum(axis=(0, 2, 3), keepdims=True), rtol=1e-4)
    layer = make_layer(str(case["prototxt"]), phase=TEST)
    h = Harness(layer, [x], params=[slope, bias, mean, var])
    h.forward()
    np.testing.assert_allclose(h.backward([dy], [True])[0][0], g, rtol=1e-10)   # exact: linear in x
