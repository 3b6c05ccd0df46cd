"""Softmax, loss layers, Accuracy and ArgMax: NumPy references, gradients, Caffe's rules, golden cases."""
import numpy as np
import pytest

from sncaffe.gradcheck import Harness, check_gradient, make_layer
from sncaffe.layers.base import LayerError
from conftest import needs_shared
from golden import run_golden_layer

FLT_MIN = np.finfo(np.float32).tiny


def normal(seed, shape, scale=1.0):
    return scale * np.random.default_rng(seed).standard_normal(shape)


def labels(seed, shape, classes, ignore=None, frac=0.3):
    rng = np.random.default_rng(seed)
    lab = rng.integers(0, classes, shape).astype(np.float64)
    if ignore is not None:
        lab[rng.random(shape) < frac] = ignore
    return lab


def softmax_ref(x, axis):
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def normalizer_ref(mode, outer, inner, n_valid):
    return max(1, {"FULL": outer * inner, "VALID": n_valid, "BATCH_SIZE": outer, "NONE": 1}[mode])


def loss_text(kind, mode=None, ignore=None, extra=""):
    lp = (f"normalization: {mode} " if mode else "") + (f"ignore_label: {ignore}" if ignore is not None else "")
    return f'type: "{kind}" loss_param {{ {lp} }} {extra}'


# -- Softmax -------------------------------------------------------------------------

@pytest.mark.parametrize("axis", [0, 1, 2, -1])
@pytest.mark.parametrize("inplace", [False, True], ids=["out", "inplace"])
def test_softmax(axis, inplace):
    x = normal(1, (2, 3, 4, 5))
    layer = make_layer(f'type: "Softmax" softmax_param {{ axis: {axis} }}', inplace=inplace)
    np.testing.assert_allclose(Harness(layer, [x]).forward()[0], softmax_ref(x, axis), rtol=1e-12)
    check_gradient(make_layer(f'type: "Softmax" softmax_param {{ axis: {axis} }}', inplace=inplace), [x])


def test_softmax_stable_float32_and_needs_only_top():
    x = np.array([[1000.0, 0.0, -1000.0], [-5e4, -5e4, -5e4]])
    h = Harness(make_layer('type: "Softmax"'), [x], np.float32)
    y = h.forward()[0]
    assert y.dtype == np.float32
    np.testing.assert_allclose(y, [[1, 0, 0], [1 / 3] * 3], rtol=1e-6)
    layer = make_layer('type: "Softmax"')
    assert layer.backward_needs == ("top",)
    h = Harness(layer, [normal(2, (3, 4))])
    h.forward()
    g = normal(3, (3, 4))
    expected = h.backward([g])[0][0]
    h.bottom[0].data[...] = np.nan              # backward must not read the bottom
    np.testing.assert_array_equal(h.backward([g])[0][0], expected)


# -- SoftmaxWithLoss -----------------------------------------------------------------

def softmax_loss_ref(x, label, axis, mode, ignore):
    p = np.moveaxis(softmax_ref(x, axis), axis, -1).reshape(-1, x.shape[axis])
    lab = label.reshape(-1).astype(int)
    valid = np.ones(lab.shape, bool) if ignore is None else lab != ignore
    picked = p[np.arange(len(lab)), np.where(valid, lab, 0)]
    loss = -np.log(np.maximum(picked, FLT_MIN))[valid].sum()
    outer = int(np.prod(x.shape[:axis]))
    return loss / normalizer_ref(mode, outer, len(lab) // outer, valid.sum())


SML_SHAPES = {"flat": ((4, 5), 1), "spatial": ((2, 5, 3, 3), 1), "axis2": ((2, 3, 4, 2), 2)}


@pytest.mark.parametrize("ignore", [None, -1, 0])
@pytest.mark.parametrize("mode", ["FULL", "VALID", "BATCH_SIZE", "NONE"])
@pytest.mark.parametrize("shape", sorted(SML_SHAPES))
def test_softmax_loss(shape, mode, ignore):
    xshape, axis = SML_SHAPES[shape]
    x = normal(4, xshape, 2.0)
    lshape = xshape[:axis] + xshape[axis + 1:]
    lab = labels(5, lshape, xshape[axis], ignore=-1 if ignore == -1 else None)
    text = loss_text("SoftmaxWithLoss", mode, ignore, f"softmax_param {{ axis: {axis} }}")
    loss = Harness(make_layer(text, n_bottoms=2), [x, lab]).forward()[0]
    assert loss.shape == ()
    np.testing.assert_allclose(loss, softmax_loss_ref(x, lab, axis, mode, ignore), rtol=1e-12)
    check_gradient(make_layer(text, n_bottoms=2), [x, lab])


@pytest.mark.parametrize("text, mode", [
    ("", "VALID"),
    ("normalize: false", "BATCH_SIZE"),
    ("normalize: true", "VALID"),
    ("normalize: false normalization: FULL", "FULL"),
])
def test_softmax_loss_normalization_defaults(text, mode):
    x, lab = normal(6, (3, 4, 2)), labels(7, (3, 2), 4, ignore=-1)
    layer = make_layer(f'type: "SoftmaxWithLoss" loss_param {{ ignore_label: -1 {text} }}', n_bottoms=2)
    assert layer.allow_force_backward(0) and not layer.allow_force_backward(1)
    np.testing.assert_allclose(Harness(layer, [x, lab]).forward()[0], softmax_loss_ref(x, lab, 1, mode, -1))


def numeric_loss_gradient(h, weight, eps=1e-6):
    """d(weight * top[0]) / d bottom[0] by central differences (other tops weightless)."""
    x = h.inputs[0].reshape(-1)
    g = np.empty(x.size)
    for j in range(x.size):
        old = x[j]
        x[j] = old + eps
        fp = h.forward()[0]
        x[j] = old - eps
        fm = h.forward()[0]
        x[j] = old
        g[j] = weight * (fp - fm) / (2 * eps)
    return g.reshape(h.inputs[0].shape)


def test_softmax_loss_second_top_is_prob_and_gets_no_gradient():
    x, lab = normal(8, (2, 5, 3)), labels(9, (2, 3), 5, ignore=-1)
    text = 'type: "SoftmaxWithLoss" loss_param { ignore_label: -1 }'
    h = Harness(make_layer(text, n_bottoms=2, n_tops=2), [x, lab])
    assert h.top_shapes == [(), (2, 5, 3)] and not h.layer.workspace_specs
    loss, prob = h.forward()
    np.testing.assert_allclose(prob, softmax_ref(x, 1), rtol=1e-12)
    np.testing.assert_allclose(loss, softmax_loss_ref(x, lab, 1, "VALID", -1), rtol=1e-12)
    # Like Caffe, backward ignores the diff of the probability top.
    dx = h.backward([np.array(0.7), normal(10, prob.shape)])[0][0]
    np.testing.assert_allclose(dx, numeric_loss_gradient(h, 0.7), rtol=1e-6, atol=1e-9)
    h1 = Harness(make_layer(text, n_bottoms=2), [x, lab])
    h1.forward()
    np.testing.assert_allclose(dx, h1.backward([np.array(0.7)])[0][0], rtol=1e-14)


def test_softmax_loss_all_ignored_and_clamped_log():
    x, lab = normal(11, (2, 3)), np.full(2, 4.0)
    h = Harness(make_layer('type: "SoftmaxWithLoss" loss_param { ignore_label: 4 }', n_bottoms=2), [x, lab])
    assert h.forward()[0] == 0                  # VALID normalizer is max(1, 0)
    assert np.all(h.backward([np.array(1.0)])[0][0] == 0)
    # exp(-1000) underflows to 0: Caffe clamps the probability at FLT_MIN.
    h = Harness(make_layer('type: "SoftmaxWithLoss"', n_bottoms=2), [[[1000.0, 0.0]], [1.0]])
    np.testing.assert_allclose(h.forward()[0], -np.log(float(FLT_MIN)), rtol=1e-12)


def test_softmax_loss_errors():
    text = 'type: "SoftmaxWithLoss"'
    with pytest.raises(LayerError, match="label count"):
        Harness(make_layer(text, n_bottoms=2), [normal(0, (2, 3, 4)), np.zeros((2, 3))])
    with pytest.raises(LayerError, match="first dimension"):
        Harness(make_layer(text, n_bottoms=2), [normal(0, (2, 3)), np.zeros((1, 2))])
    h = Harness(make_layer(text, n_bottoms=2), [normal(0, (2, 3)), [0.0, 3.0]])
    with pytest.raises(LayerError, match="out of range"):
        h.forward()
    h = Harness(make_layer(text, n_bottoms=2), [normal(0, (2, 3)), [0.0, 2.0]])
    h.forward()
    with pytest.raises(LayerError, match="label"):
        h.backward([np.array(1.0)], [True, True])


# -- EuclideanLoss -------------------------------------------------------------------

@pytest.mark.parametrize("shapes", [((2, 3, 2, 2), (2, 3, 2, 2)), ((3, 8), (3, 2, 4))])
def test_euclidean_loss(shapes):
    a, b = normal(12, shapes[0]), normal(13, shapes[1])
    layer = make_layer('type: "EuclideanLoss"', n_bottoms=2)
    assert layer.allow_force_backward(0) and layer.allow_force_backward(1)
    loss = Harness(layer, [a, b]).forward()[0]
    np.testing.assert_allclose(loss, ((a - b.reshape(a.shape)) ** 2).sum() / a.shape[0] / 2, rtol=1e-12)
    h = check_gradient(make_layer('type: "EuclideanLoss"', n_bottoms=2), [a, b])
    da, db = h.backward([np.array(0.3)], [True, True])[0]
    np.testing.assert_allclose(db.reshape(a.shape), -da, rtol=1e-15)
    h.bottom[1].diff[...] = 5
    da_only, db_kept = h.backward([np.array(0.3)], [True, False])[0]
    assert np.array_equal(da_only, da) and np.all(db_kept == 5)


# -- SigmoidCrossEntropyLoss ---------------------------------------------------------

def sce_ref(x, t, mode, ignore):
    per = np.maximum(x, 0) - x * t + np.log1p(np.exp(-np.abs(x)))
    valid = np.ones(x.shape, bool) if ignore is None else t.astype(int) != ignore
    return per[valid].sum() / normalizer_ref(mode, x.shape[0], x[0].size, valid.sum())


@pytest.mark.parametrize("ignore", [None, -1])
@pytest.mark.parametrize("mode", [None, "FULL", "VALID", "BATCH_SIZE", "NONE"])
def test_sigmoid_cross_entropy_loss(mode, ignore):
    x = normal(14, (3, 4, 2), 2.0)
    t = np.random.default_rng(15).random(x.shape)
    if ignore is not None:
        t[np.random.default_rng(16).random(x.shape) < 0.3] = ignore
    text = loss_text("SigmoidCrossEntropyLoss", mode, ignore)
    layer = make_layer(text, n_bottoms=2)
    assert layer.allow_force_backward(0) and not layer.allow_force_backward(1)
    # Without loss_param.normalization Caffe divides by the batch size.
    np.testing.assert_allclose(Harness(layer, [x, t]).forward()[0], sce_ref(x, t, mode or "BATCH_SIZE", ignore),
                               rtol=1e-12)
    check_gradient(make_layer(text, n_bottoms=2), [x, t])


def test_sigmoid_cross_entropy_large_logits_float32():
    x = np.array([[100.0, -100.0, 30.0, -30.0]], np.float32)
    t = np.array([[0.0, 1.0, 1.0, 0.0]], np.float32)
    h = Harness(make_layer('type: "SigmoidCrossEntropyLoss"', n_bottoms=2), [x, t], np.float32)
    loss = h.forward()[0]
    assert loss.dtype == np.float32 and np.isfinite(loss)
    np.testing.assert_allclose(loss, 200, rtol=1e-6)
    np.testing.assert_allclose(h.backward([np.float32(2)])[0][0], [[2, -2, 0, 0]], atol=1e-6)


# -- Accuracy ------------------------------------------------------------------------

def accuracy_ref(x, lab, top_k, axis, ignore):
    s = np.moveaxis(x, axis, -1).reshape(-1, x.shape[axis])
    lab = lab.reshape(-1).astype(int)
    hits, nums = np.zeros(s.shape[1]), np.zeros(s.shape[1])
    for row, l in zip(s, lab):
        if l == ignore:
            continue
        nums[l] += 1
        hits[l] += (row >= row[l]).sum() - 1 < top_k
    per_class = np.where(nums > 0, hits / np.maximum(nums, 1), 0)
    return hits.sum() / max(nums.sum(), 1), per_class


@pytest.mark.parametrize("ignore", [None, 2])
@pytest.mark.parametrize("top_k", [1, 2, 4])
@pytest.mark.parametrize("xshape, axis", [((12, 5), 1), ((2, 5, 3, 2), 1), ((2, 3, 5), 2)])
def test_accuracy(xshape, axis, top_k, ignore):
    x = normal(17, xshape)
    lab = labels(18, xshape[:axis] + xshape[axis + 1:], xshape[axis])
    p = f"top_k: {top_k} axis: {axis}" + (f" ignore_label: {ignore}" if ignore is not None else "")
    layer = make_layer(f'type: "Accuracy" accuracy_param {{ {p} }}', n_bottoms=2, n_tops=2)
    assert not layer.allow_force_backward(0) and not layer.allow_force_backward(1)
    h = Harness(layer, [x, lab], np.float32)
    assert h.top_shapes == [(), (xshape[axis],)]
    acc, per_class = h.forward()
    ref_acc, ref_per_class = accuracy_ref(x.astype(np.float32), lab, top_k, axis, ignore)
    np.testing.assert_allclose(acc, ref_acc, rtol=1e-6)
    np.testing.assert_allclose(per_class, ref_per_class, rtol=1e-6)
    h.backward([np.zeros(()), np.zeros(xshape[axis])], [False, False])   # nothing to do
    with pytest.raises(LayerError, match="no backward"):
        h.backward([np.zeros(()), np.zeros(xshape[axis])], [True, False])


def test_accuracy_ties_count_against_and_empty_is_zero():
    x, lab = np.zeros((3, 4)), np.array([0.0, 1.0, 3.0])
    assert Harness(make_layer('type: "Accuracy" accuracy_param { top_k: 3 }', n_bottoms=2), [x, lab]).forward()[0] == 0
    assert Harness(make_layer('type: "Accuracy" accuracy_param { top_k: 4 }', n_bottoms=2), [x, lab]).forward()[0] == 1
    h = Harness(make_layer('type: "Accuracy" accuracy_param { ignore_label: 1 }', n_bottoms=2),
                [normal(0, (2, 3)), [1.0, 1.0]])
    assert h.forward()[0] == 0
    with pytest.raises(LayerError, match="top_k"):
        Harness(make_layer('type: "Accuracy" accuracy_param { top_k: 4 }', n_bottoms=2), [normal(0, (2, 3)), [0, 1]])


# -- ArgMax --------------------------------------------------------------------------

def argmax_ref(rows, k):
    """Caffe: std::partial_sort of (value, index) pairs with std::greater."""
    pairs = [sorted(((v, j) for j, v in enumerate(r)), reverse=True)[:k] for r in rows]
    return np.array([[j for v, j in p] for p in pairs]), np.array([[v for v, j in p] for p in pairs])


@pytest.mark.parametrize("maxval", [False, True])
@pytest.mark.parametrize("xshape, k", [((3, 6), 2), ((2, 5, 3, 3), 3), ((4, 1), 1)])
def test_argmax_without_axis(xshape, k, maxval):
    x = normal(19, xshape)
    layer = make_layer(f'type: "ArgMax" argmax_param {{ top_k: {k} out_max_val: {str(maxval).lower()} }}')
    h = Harness(layer, [x])
    shape = [xshape[0], 2 if maxval else 1, k] + [1] * (len(xshape) - 3)   # Caffe pads to the bottom's axes
    assert h.top_shapes == [tuple(shape)]
    y = h.forward()[0].reshape(xshape[0], -1, k)
    idx, val = argmax_ref(x.reshape(xshape[0], -1), k)
    np.testing.assert_array_equal(y[:, 0], idx)
    if maxval:
        np.testing.assert_array_equal(y[:, 1], val)


@pytest.mark.parametrize("maxval", [False, True])
@pytest.mark.parametrize("axis", [0, 1, 3, -2])
def test_argmax_with_axis(axis, maxval):
    x = normal(20, (2, 5, 3, 4))
    k = 2
    layer = make_layer(f'type: "ArgMax" argmax_param {{ top_k: {k} axis: {axis} out_max_val: {str(maxval).lower()} }}')
    h = Harness(layer, [x])
    y = h.forward()[0]
    rows = np.moveaxis(x, axis, -1)
    idx, val = argmax_ref(rows.reshape(-1, rows.shape[-1]), k)
    ref = (val if maxval else idx).reshape(rows.shape[:-1] + (k,))
    np.testing.assert_array_equal(y, np.moveaxis(ref, -1, axis))


def test_argmax_ties_larger_index_first_and_errors():
    x = np.array([[1.0, 3.0, 3.0, 0.0, 3.0]])
    y = Harness(make_layer('type: "ArgMax" argmax_param { top_k: 4 }'), [x]).forward()[0]
    np.testing.assert_array_equal(y.reshape(-1), [4, 2, 1, 0])
    with pytest.raises(LayerError, match="top_k"):
        Harness(make_layer('type: "ArgMax" argmax_param { top_k: 6 }'), [x])
    with pytest.raises(LayerError, match="top_k"):
        Harness(make_layer('type: "ArgMax" argmax_param { top_k: 2 axis: 0 }'), [x])
    layer = make_layer('type: "ArgMax"')
    assert layer.backward_needs == () and not layer.allow_force_backward(0)


# -- golden Caffe cases --------------------------------------------------------------

@needs_shared
@pytest.mark.parametrize("case", ["softmax", "softmax_loss", "euclidean_loss", "sigmoid_ce_loss",
                                  "accuracy_top2", "argmax_top2_maxval", "argmax_axis1"])
def test_golden(case):
    run_golden_layer(case)


@pytest.mark.parametrize("text, lab", [('type: "SoftmaxWithLoss"', [0.0, 3.0, 1.0]),
                                       ('type: "EuclideanLoss"', normal(22, (3, 4)))])
def test_loss_backward_needs_no_workspace(text, lab):
    x = normal(21, (3, 4))
    h = Harness(make_layer(text, n_bottoms=2), [x, lab])
    assert h.layer.backward_needs == ("bottom",) and h.layer.backward_workspace_specs == {}
    h.forward()
    expected = h.backward([np.array(0.5)])[0][0]
    h.layer.workspace = {}
    h.top[0].data[...] = np.nan                  # backward reads the bottoms only
    np.testing.assert_array_equal(h.backward([np.array(0.5)])[0][0], expected)
