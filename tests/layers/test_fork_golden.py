"""The forks' layers against golden data recorded from each fork's own C++ code (built CPU-only).

tests/data/fork_golden/README.md says how the data was made. Each case holds the LayerParameter
text, the bottoms, any parameter blobs and top diffs, and the fork's tops, bottom diffs and
parameter diffs, all float32.
"""
from pathlib import Path

import numpy as np
import pytest

from sncaffe.gradcheck import Harness, make_layer

DATA = Path(__file__).resolve().parents[1] / "data" / "fork_golden"
CASES = sorted(DATA.glob("*/*.npz"))


def _group(case, key):
    out, i = [], 0
    while f"{key}{i}" in case:
        out.append(case[f"{key}{i}"])
        i += 1
    return out


def test_golden_data_is_there():
    assert len(CASES) >= 18, CASES


@pytest.mark.parametrize("path", CASES, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_layer_matches_the_fork(path):
    case = dict(np.load(path))
    layer = make_layer(str(case["prototxt"]))
    bottoms, params = _group(case, "bottom"), _group(case, "param")
    h = Harness(layer, bottoms, dtype=np.float32, params=params or None)
    tops = h.forward()
    expect = _group(case, "top")
    assert len(tops) == len(expect)
    for got, want in zip(tops, expect):
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    top_diffs = _group(case, "top_diff")
    if layer.is_loss:
        weight = layer.param.loss_weight[0] if layer.param.loss_weight else 1.0
        top_diffs = [np.full(t.shape, weight, np.float32) for t in tops]
    if not top_diffs:
        return
    prop = [bool(p) for p in case["propagate_down"]]
    bottom_diffs, param_diffs = h.backward(top_diffs, prop)
    for i, (got, want) in enumerate(zip(bottom_diffs, _group(case, "bottom_diff"))):
        if prop[i]:
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=f"bottom {i} diff")
    for i, (got, want) in enumerate(zip(param_diffs, _group(case, "param_diff"))):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=f"param {i} diff")
