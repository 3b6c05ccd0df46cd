"""Scale and Bias: gradients (one and two bottoms, in place), NumPy references, golden Caffe cases."""
import numpy as np
import pytest

from sncaffe.gradcheck import Harness, check_gradient, make_layer
from sncaffe.layers.base import Blob
from conftest import needs_shared
from golden import run_golden_layer

SHAPE = (2, 3, 4, 5)

# (param text, operand shape): axis and num_axes variants; num_axes 0 is a scalar.
LEARNED = {
    "axis1": ("", (3,)),
    "axis0": ("axis: 0", (2,)),
    "axis1_2axes": ("axis: 1 num_axes: 2", (3, 4)),
    "axis1_all": ("axis: 1 num_axes: -1", (3, 4, 5)),
    "axis0_all": ("axis: 0 num_axes: -1", SHAPE),        # eltwise
    "axis_neg": ("axis: -1", (5,)),
    "axis2_0axes": ("axis: 2 num_axes: 0", ()),          # a scalar
}
# (param text, shape of bottom[1])
SECOND = {
    "axis0": ("axis: 0", (2, 3)),
    "axis1": ("axis: 1", (3, 4)),
    "axis1_rest": ("axis: 1", (3, 4, 5)),
    "axis_neg": ("axis: -2", (4, 5)),
    "scalar": ("axis: 1", ()),
}


def operand_view(operand, axis, shape=SHAPE):
    """The operand broadcast against a bottom of ``shape`` from ``axis``."""
    operand = np.asarray(operand)
    if operand.ndim == 0:
        return operand
    axis %= len(shape)
    return operand.reshape(operand.shape + (1,) * (len(shape) - axis - operand.ndim))


def axis_of(text):
    return int(text.split("axis: ")[1].split()[0]) if "axis: " in text else 1


@pytest.mark.parametrize("inplace", [False, True], ids=["out", "inplace"])
@pytest.mark.parametrize("bias_term", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("case", sorted(LEARNED))
def test_scale_learned(case, bias_term, inplace):
    text, shape = LEARNED[case]
    layer = make_layer(f'type: "Scale" scale_param {{ {text} bias_term: {str(bias_term).lower()} }}',
                       inplace=inplace)
    x = np.random.default_rng(1).standard_normal(SHAPE)
    h = check_gradient(layer, [x])
    assert layer.param_shapes == [shape] * (1 + bias_term)
    axis = axis_of(text)
    want = x * operand_view(layer.blobs[0].data, axis)
    if bias_term:
        want += operand_view(layer.blobs[1].data, axis)
    np.testing.assert_allclose(h.forward()[0], want, rtol=1e-12)
    assert layer.backward_needs == (() if inplace else ("bottom",))
    # in place: its input, and room for a BatchNorm's per-image sums (dropped unless shared: graph.Fusion)
    assert set(layer.scratch_specs) == ({"bottom", "partials"} if inplace else set())


@pytest.mark.parametrize("inplace", [False, True], ids=["out", "inplace"])
@pytest.mark.parametrize("bias_term", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("case", sorted(SECOND))
def test_scale_second_bottom(case, bias_term, inplace):
    text, shape = SECOND[case]
    layer = make_layer(f'type: "Scale" scale_param {{ {text} bias_term: {str(bias_term).lower()} }}',
                       inplace=inplace, n_bottoms=2)
    rng = np.random.default_rng(2)
    x, s = rng.standard_normal(SHAPE), rng.standard_normal(shape)
    h = check_gradient(layer, [x, s])
    assert layer.param_shapes == [shape] * bias_term     # only the bias is learned
    want = x * operand_view(s, axis_of(text))
    if bias_term:
        want += operand_view(layer.blobs[0].data, axis_of(text))
    np.testing.assert_allclose(h.forward()[0], want, rtol=1e-12)
    assert layer.backward_needs == ("bottom",)


def test_scale_propagate_down_false_leaves_second_bottom():
    layer = make_layer('type: "Scale" scale_param { axis: 0 }', n_bottoms=2)
    rng = np.random.default_rng(3)
    h = Harness(layer, [rng.standard_normal(SHAPE), rng.standard_normal((2, 3))])
    h.forward()
    g = rng.standard_normal(SHAPE)
    (dx, ds), _ = h.backward([g], propagate_down=[True, False])
    assert not ds.any()
    np.testing.assert_allclose(dx, g * h.inputs[1][:, :, None, None], rtol=1e-12)


def test_scale_param_diff_accumulates():
    layer = make_layer('type: "Scale" scale_param { bias_term: true }')
    x = np.random.default_rng(4).standard_normal(SHAPE)
    h = Harness(layer, [x])
    h.forward()
    g = np.random.default_rng(5).standard_normal(SHAPE)
    _, (ds, db) = h.backward([g])
    layer.backward(h.top, [True], h.bottom)    # a second backward adds to the param diffs
    np.testing.assert_allclose(layer.blobs[0].diff, 2 * ds, rtol=1e-12)
    np.testing.assert_allclose(layer.blobs[1].diff, 2 * db, rtol=1e-12)
    np.testing.assert_allclose(ds, (g * x).sum(axis=(0, 2, 3)), rtol=1e-12)
    np.testing.assert_allclose(db, g.sum(axis=(0, 2, 3)), rtol=1e-12)


def init(text, bottom_shapes=(SHAPE,)):
    layer = make_layer(text, n_bottoms=len(bottom_shapes))
    layer.setup(list(bottom_shapes))
    layer.blobs = [Blob(f"p{i}", np.full(s, np.nan)) for i, s in enumerate(layer.param_shapes)]
    layer.init_params(np.random.default_rng(0))
    return [b.data for b in layer.blobs]


def test_default_fillers():
    scale, bias = init('type: "Scale" scale_param { bias_term: true }')
    np.testing.assert_array_equal(scale, np.ones(3))
    np.testing.assert_array_equal(bias, np.zeros(3))
    (scale,) = init('type: "Scale" scale_param { filler { type: "constant" value: 2 } }')
    np.testing.assert_array_equal(scale, np.full(3, 2.0))
    (bias,) = init('type: "Scale" scale_param { bias_term: true bias_filler { type: "constant" value: 3 } }',
                   [SHAPE, (3,)])
    np.testing.assert_array_equal(bias, np.full(3, 3.0))
    (bias,) = init('type: "Bias"')
    np.testing.assert_array_equal(bias, np.zeros(3))


@pytest.mark.parametrize("text,bottoms,match", [
    ('type: "Scale" scale_param { axis: 2 num_axes: 3 }', [SHAPE], "extends past"),
    ('type: "Scale" scale_param { num_axes: -2 }', [SHAPE], "num_axes"),
    ('type: "Scale" scale_param { axis: 4 }', [SHAPE], "out of range"),
    ('type: "Scale" scale_param { axis: 1 }', [SHAPE, (4,)], "does not match"),
    ('type: "Scale" scale_param { axis: 2 }', [SHAPE, (4, 5, 6)], "does not match"),
    ('type: "Bias" bias_param { axis: 0 }', [SHAPE, (3,)], "does not match"),
])
def test_bad_shapes(text, bottoms, match):
    with pytest.raises(ValueError, match=match):
        make_layer(text, n_bottoms=len(bottoms)).setup(bottoms)


# -- Bias ----------------------------------------------------------------------------

@pytest.mark.parametrize("inplace", [False, True], ids=["out", "inplace"])
@pytest.mark.parametrize("case", sorted(LEARNED))
def test_bias_learned(case, inplace):
    text, shape = LEARNED[case]
    layer = make_layer(f'type: "Bias" bias_param {{ {text} }}', inplace=inplace)
    x = np.random.default_rng(6).standard_normal(SHAPE)
    h = check_gradient(layer, [x])
    assert layer.param_shapes == [shape] and layer.backward_needs == ()
    np.testing.assert_allclose(h.forward()[0], x + operand_view(layer.blobs[0].data, axis_of(text)),
                               rtol=1e-12)


@pytest.mark.parametrize("inplace", [False, True], ids=["out", "inplace"])
@pytest.mark.parametrize("case", sorted(SECOND))
def test_bias_second_bottom(case, inplace):
    text, shape = SECOND[case]
    layer = make_layer(f'type: "Bias" bias_param {{ {text} }}', inplace=inplace, n_bottoms=2)
    rng = np.random.default_rng(7)
    x, b = rng.standard_normal(SHAPE), rng.standard_normal(shape)
    h = check_gradient(layer, [x, b])
    assert layer.param_shapes == []
    np.testing.assert_allclose(h.forward()[0], x + operand_view(b, axis_of(text)), rtol=1e-12)


# -- golden Caffe cases ---------------------------------------------------------------

@needs_shared
@pytest.mark.parametrize("case", ["scale_bias", "scale_bottom", "bias"])
def test_golden(case):
    run_golden_layer(case)
