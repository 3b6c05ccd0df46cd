"""Eltwise, Concat, Slice, Split, Flatten, Reshape, Silence: gradients, NumPy references,
aliased top/bottom memory, errors, and the Caffe golden cases."""
import numpy as np
import pytest

from conftest import needs_shared
from golden import run_golden_layer
from sncaffe.gradcheck import Harness, check_gradient, make_layer
from sncaffe.layers import Blob, LayerError
from sncaffe.layers.structure import same_memory


def normals(*shapes, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s) for s in shapes]


def forward(layer, bottoms, dtype=np.float64):
    return Harness(layer, bottoms, dtype).forward()


# -- Eltwise ------------------------------------------------------------------------
ELTWISE = [  # (eltwise_param text, number of bottoms)
    ("", 2), ("operation: SUM", 3), ("coeff: 1 coeff: -0.5 coeff: 2", 3), ("coeff: 0.3 coeff: 1", 2),
    ("operation: PROD", 2), ("operation: PROD", 3),
    ("operation: PROD stable_prod_grad: false", 2), ("operation: PROD stable_prod_grad: false", 3),
    ("operation: MAX", 2), ("operation: MAX", 3), ("operation: MAX", 4),
]


def eltwise(text, n):
    return make_layer(f'type: "Eltwise" eltwise_param {{ {text} }}', n_bottoms=n)


def eltwise_reference(text, xs):
    if "PROD" in text:
        return np.prod(xs, axis=0)
    if "MAX" in text:
        return np.max(xs, axis=0)
    coeffs = [float(c) for c in text.split("coeff:")[1:]] or [1.0] * len(xs)
    return sum(c * x for c, x in zip(coeffs, xs))


@pytest.mark.parametrize("text,n", ELTWISE)
def test_eltwise_gradient(text, n):
    check_gradient(eltwise(text, n), normals(*[(2, 3, 2)] * n, seed=n))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("text,n", ELTWISE)
def test_eltwise_forward(text, n, dtype):
    xs = normals(*[(3, 4)] * n, seed=n)
    (y,) = forward(eltwise(text, n), xs, dtype)
    assert y.dtype == dtype
    np.testing.assert_allclose(y, eltwise_reference(text, xs), rtol=1e-6, atol=1e-6)


def test_eltwise_max_ties_follow_caffe():
    # Caffe: bottoms 0 vs 1 tie -> 1 wins; a later bottom must be strictly greater to win
    a, b, c = np.array([1.0, 2.0, 3.0]), np.array([1.0, 0.0, 5.0]), np.array([1.0, 2.0, 5.0])
    h = Harness(eltwise("operation: MAX", 3), [a, b, c])
    (y,) = h.forward()
    np.testing.assert_array_equal(y, [1, 2, 5])
    np.testing.assert_array_equal(h.layer.scratch["argmax"], [1, 0, 1])
    (da, db, dc), _ = h.backward([np.array([10.0, 20.0, 30.0])])
    np.testing.assert_array_equal(np.stack([da, db, dc]), [[0, 20, 0], [10, 0, 30], [0, 0, 0]])


def test_eltwise_backward_needs():
    needs = {text: eltwise(text, 2) for text in ("", "operation: MAX", "operation: PROD",
                                               "operation: PROD stable_prod_grad: false")}
    for text, layer in needs.items():
        layer.setup([(2,), (2,)])
    assert [layer.backward_needs for layer in needs.values()] == [(), (), ("bottom",), ("bottom", "top")]


def test_eltwise_errors():
    with pytest.raises(LayerError, match=r'bottom "b1" shape \(2, 4\) differs from bottom "b0" shape \(2, 3\)'):
        eltwise("", 2).setup([(2, 3), (2, 4)])
    with pytest.raises(LayerError, match="one coeff per bottom"):
        eltwise("coeff: 1", 2).setup([(2,), (2,)])
    with pytest.raises(LayerError, match="only takes coefficients for summation"):
        eltwise("operation: PROD coeff: 1 coeff: 2", 2).setup([(2,), (2,)])


# -- Concat and Slice -----------------------------------------------------------------
CONCAT = [  # (concat_param text, bottom shapes, numpy axis)
    ("", [(2, 2, 3), (2, 3, 3), (2, 1, 3)], 1),
    ("axis: 0", [(1, 3, 2), (2, 3, 2)], 0),
    ("axis: -1", [(2, 3, 1), (2, 3, 2), (2, 3, 3)], 2),
    ("axis: 2", [(2, 2, 1, 2), (2, 2, 3, 2)], 2),
    ("concat_dim: 0", [(2, 3), (1, 3)], 0),
    ("", [(2, 3, 2)], 1),
]


@pytest.mark.parametrize("text,shapes,axis", CONCAT)
def test_concat(text, shapes, axis):
    layer = make_layer(f'type: "Concat" concat_param {{ {text} }}', n_bottoms=len(shapes))
    xs = normals(*shapes)
    np.testing.assert_array_equal(forward(layer, xs)[0], np.concatenate(xs, axis))
    check_gradient(layer, xs)


SLICE = [  # (slice_param text, bottom shape, number of tops, numpy axis, numpy split points)
    ("slice_point: 1 slice_point: 3", (2, 5, 3), 3, 1, [1, 3]),
    ("axis: 0 slice_point: 2", (3, 2), 2, 0, [2]),
    ("axis: -1", (2, 3, 6), 3, 2, 3),
    ("axis: 2 slice_point: 1", (2, 1, 4, 2), 2, 2, [1]),
    ("slice_dim: 0", (4, 3), 2, 0, 2),
    ("", (2, 3), 1, 1, 1),
]


@pytest.mark.parametrize("text,shape,n_tops,axis,points", SLICE)
def test_slice(text, shape, n_tops, axis, points):
    layer = make_layer(f'type: "Slice" slice_param {{ {text} }}', n_tops=n_tops)
    (x,) = normals(shape)
    for y, ref in zip(forward(layer, [x]), np.split(x, points, axis), strict=True):
        np.testing.assert_array_equal(y, ref)
    check_gradient(layer, [x])


def test_concat_slice_errors():
    concat = make_layer('type: "Concat"', n_bottoms=2)
    with pytest.raises(LayerError, match=r'"concat".*bottom "b1" shape \(2, 4, 5\) and bottom "b0" '
                                         r'shape \(2, 3, 4\) differ outside concat axis 1'):
        concat.setup([(2, 3, 4), (2, 4, 5)])
    with pytest.raises(LayerError, match="not both"):
        make_layer('type: "Concat" concat_param { axis: 1 concat_dim: 1 }', n_bottoms=2).setup([(2, 3)] * 2)
    with pytest.raises(LayerError, match="evenly divide"):
        make_layer('type: "Slice"', n_tops=2).setup([(2, 3)])
    with pytest.raises(LayerError, match="need 3 tops"):
        make_layer('type: "Slice" slice_param { slice_point: 1 slice_point: 2 }', n_tops=2).setup([(2, 5)])
    with pytest.raises(LayerError, match="rise strictly"):
        make_layer('type: "Slice" slice_param { slice_point: 3 slice_point: 2 }', n_tops=3).setup([(2, 5)])
    with pytest.raises(LayerError, match="rise strictly"):
        make_layer('type: "Slice" slice_param { slice_point: 6 }', n_tops=2).setup([(2, 5)])


# -- Split ---------------------------------------------------------------------------------
@pytest.mark.parametrize("n_tops", [1, 2, 3])
def test_split(n_tops):
    layer = make_layer('type: "Split"', n_tops=n_tops)
    (x,) = normals((2, 3, 2))
    for y in forward(layer, [x]):
        np.testing.assert_array_equal(y, x)
    check_gradient(layer, [x])


def test_split_rejects_in_place():
    with pytest.raises(LayerError, match="in-place"):
        make_layer('type: "Split" top: "b0" top: "t1"').setup([(2,)])


# -- Flatten and Reshape ------------------------------------------------------------------
FLATTEN = [  # (flatten_param text, bottom shape, top shape)
    ("", (2, 3, 4, 5), (2, 60)),
    ("axis: 2", (2, 3, 4, 5), (2, 3, 20)),
    ("end_axis: -2", (2, 3, 4, 5), (2, 12, 5)),
    ("axis: 0", (2, 3, 4), (24,)),
    ("axis: 1 end_axis: 0", (2, 3), (2, 1, 3)),    # Caffe inserts a count(1, 1) = 1 axis
]

RESHAPE = [  # (reshape_param text, bottom shape, top shape)
    ("shape { dim: 0 dim: -1 dim: 2 }", (2, 3, 4, 5), (2, 30, 2)),
    ("shape { dim: 6 dim: 20 }", (2, 3, 4, 5), (6, 20)),
    ("shape { dim: 0 dim: 0 dim: 0 dim: 0 }", (2, 3, 4, 5), (2, 3, 4, 5)),
    ("shape { dim: 1 dim: 1 } axis: 0 num_axes: 0", (2, 3), (1, 1, 2, 3)),
    ("shape { dim: 1 dim: 1 } axis: 1 num_axes: 0", (2, 3), (2, 1, 1, 3)),
    ("shape { dim: 1 dim: 1 } axis: -1 num_axes: 0", (2, 3), (2, 3, 1, 1)),
    ("shape { dim: -1 } axis: 1 num_axes: 2", (2, 3, 4, 5), (2, 12, 5)),
    ("shape { dim: 2 dim: -1 } axis: -2", (2, 3, 4), (2, 3, 2, 2)),
    ("shape { dim: 0 dim: 3 dim: -1 } axis: 1", (2, 5, 6), (2, 5, 3, 2)),
    ("shape { }", (1, 1), ()),
]


@pytest.mark.parametrize("kind,text,shape,top_shape",
                         [("Flatten", f"flatten_param {{ {t} }}", s, ts) for t, s, ts in FLATTEN] +
                         [("Reshape", f"reshape_param {{ {t} }}", s, ts) for t, s, ts in RESHAPE])
def test_flatten_reshape(kind, text, shape, top_shape):
    layer = make_layer(f'type: "{kind}" {text}')
    (x,) = normals(shape)
    np.testing.assert_array_equal(forward(layer, [x])[0], x.reshape(top_shape))
    check_gradient(layer, [x])


@pytest.mark.parametrize("text,shape,match", [
    ("shape { dim: -1 dim: -1 }", (2, 3), "more than one -1"),
    ("shape { dim: -1 dim: 4 }", (2, 3), "not divisible"),
    ("shape { dim: 0 dim: 0 dim: 0 }", (2, 3), "no axis 2 to copy"),
    ("shape { dim: 7 }", (2, 3), "output count 7"),
    ("shape { dim: -2 dim: -3 }", (2, 3), "below -1"),
    ("shape { dim: 6 } axis: 3", (2, 3), "axis 3 out of range"),
    ("shape { dim: 6 } axis: 1 num_axes: 2", (2, 3), "num_axes 2 out of range"),
])
def test_reshape_errors(text, shape, match):
    with pytest.raises(LayerError, match=f'"reshape".*{match}'):
        make_layer(f'type: "Reshape" reshape_param {{ {text} }}').setup([shape])


def test_flatten_errors():
    with pytest.raises(LayerError, match="in-place"):
        make_layer('type: "Flatten"', inplace=True).setup([(2, 3)])
    with pytest.raises(LayerError, match="end_axis 0 comes before axis 2"):
        make_layer('type: "Flatten" flatten_param { axis: 2 end_axis: 0 }').setup([(2, 3, 4)])


# -- aliased memory: the executor may bind tops to the bottom's memory, as Caffe shares it --
def frozen(a):
    """A read-only view: writing into it (a copy that should have been skipped) raises."""
    v = a.view()
    v.flags.writeable = False
    return v


@pytest.mark.parametrize("text,n_tops", [('type: "Split"', 3), ('type: "Flatten"', 1),
                                         ('type: "Reshape" reshape_param { shape { dim: -1 } }', 1),
                                         ('type: "Slice"', 1)])
def test_aliased_tops_skip_copies(text, n_tops):
    layer = make_layer(text, n_tops=n_tops)
    x, dy = normals((2, 3, 2), (2, 3, 2))
    (top_shape, *_) = layer.setup([x.shape])
    data = frozen(x)
    bottom = Blob("b0", data, np.zeros_like(x))
    top = [Blob(f"t{i}", data.reshape(top_shape), dy.reshape(top_shape) * (i + 1)) for i in range(n_tops)]
    if text != 'type: "Split"':         # diff shared too: bottom diff is the top diff's memory
        bottom.diff = frozen(top[0].diff).reshape(x.shape)
    layer.forward([bottom], top)
    layer.backward(top, [True], [bottom])
    np.testing.assert_allclose(bottom.diff, dy * sum(range(1, n_tops + 1)))


def test_concat_single_bottom_aliased():
    layer = make_layer('type: "Concat"')
    (x,) = normals((2, 3))
    layer.setup([x.shape])
    b = Blob("b0", frozen(x), frozen(x * 2))
    layer.forward([b], [b])
    layer.backward([b], [True], [b])


def test_same_memory():
    a = np.zeros((4, 6))
    assert same_memory(a, a.reshape(24)) and same_memory(a.reshape(2, 12), a)
    assert not same_memory(a, a.copy()) and not same_memory(a, a[:2])


# -- Silence -------------------------------------------------------------------------------
def test_silence_writes_zero_diffs():
    layer = make_layer('type: "Silence"', n_bottoms=2, n_tops=0)
    h = Harness(layer, normals((2, 3), (4,)))
    assert h.top_shapes == [] and h.forward() == []
    (d0, d1), _ = h.backward([], [True, False])
    assert np.all(d0 == 0) and np.all(d1 == 0)   # d1: never written (Harness starts at zero)


# -- golden cases from BVLC Caffe ---------------------------------------------------
@needs_shared
@pytest.mark.parametrize("case", ["eltwise_sum_coeff", "eltwise_prod", "eltwise_max", "concat_axis1",
                                  "slice_axis1", "flatten", "reshape"])
def test_golden(case):
    run_golden_layer(case)
