"""ContrastiveLoss, HingeLoss, MultinomialLogisticLoss, InfogainLoss: float64 references,
gradients, and the refusals of Caffe (labels, similarity, H)."""
import numpy as np
import pytest

from sncaffe import blobproto
from sncaffe.gradcheck import Harness, check_gradient, make_layer
from sncaffe.layers.base import LayerError


def rng(seed):
    return np.random.default_rng(seed)


def softmax(x, axis=1):
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


@pytest.mark.parametrize("legacy", [False, True])
@pytest.mark.parametrize("margin", [1.0, 2.5])
def test_contrastive_loss(legacy, margin):
    a, b = rng(0).standard_normal((6, 3)), rng(1).standard_normal((6, 3))
    sim = np.array([1.0, 0, 1, 0, 0, 1])
    text = (f'type: "ContrastiveLoss" contrastive_loss_param {{ margin: {margin} '
            f'legacy_version: {str(legacy).lower()} }}')
    layer = make_layer(text, n_bottoms=3)
    assert [layer.allow_force_backward(i) for i in range(3)] == [True, True, False]
    h = Harness(layer, [a, b, sim])
    d2 = ((a - b) ** 2).sum(1)
    apart = np.maximum(margin - d2, 0) if legacy else np.maximum(margin - np.sqrt(d2), 0) ** 2
    np.testing.assert_allclose(h.forward()[0], np.where(sim > 0, d2, apart).sum() / 12)
    # Caffe's non-legacy gradient divides by d + 1e-4, not d: exact only up to that
    check_gradient(make_layer(text, n_bottoms=3), [a, b, sim], rtol=1e-3 if not legacy else 1e-5, atol=1e-6)
    (da, db, dsim), _ = h.backward([np.array(1.0)], [True, True, True])
    np.testing.assert_array_equal(db, -da)
    assert not dsim.any()


@pytest.mark.parametrize("norm", ["L1", "L2"])
def test_hinge_loss(norm):
    x = 1.5 * rng(2).standard_normal((4, 5))
    x = np.where(np.abs(np.abs(x) - 1) < 0.05, 0.5, x)            # off the kinks at +-1
    label = np.array([0.0, 3, 4, 1])
    h = check_gradient(make_layer(f'type: "HingeLoss" hinge_loss_param {{ norm: {norm} }}', n_bottoms=2), [x, label])
    s = np.ones_like(x)
    s[np.arange(4), label.astype(int)] = -1
    m = np.maximum(0, 1 + s * x)
    np.testing.assert_allclose(h.forward()[0], (m if norm == "L1" else m ** 2).sum() / 4)
    with pytest.raises(LayerError, match="cannot backpropagate to the label"):
        h.backward([np.array(1.0)], [True, True])


def test_multinomial_logistic_loss():
    p = softmax(1.5 * rng(3).standard_normal((4, 5)))
    label = np.array([2.0, 0, 4, 4])
    h = check_gradient(make_layer('type: "MultinomialLogisticLoss"', n_bottoms=2), [p, label], rtol=1e-5)
    np.testing.assert_allclose(h.forward()[0], -np.log(p[np.arange(4), [2, 0, 4, 4]]).mean())
    (dp, _), _ = h.backward([np.array(2.0)], [True, False])
    assert np.count_nonzero(dp) == 4
    with pytest.raises(LayerError, match=r"label out of range \[0, 5\)"):
        Harness(make_layer('type: "MultinomialLogisticLoss"', n_bottoms=2), [p, label + 1]).forward()


def infogain_reference(x, label, H, axis, ignore, mode):
    p = softmax(x, axis)
    p = np.moveaxis(p, axis, -1).reshape(-1, x.shape[axis])
    lab = label.reshape(-1).astype(int)
    valid = lab != ignore if ignore is not None else np.ones(len(lab), bool)
    per = -(H[np.where(valid, lab, 0)] * np.log(np.maximum(p, 1e-20))).sum(1)
    outer = int(np.prod(x.shape[:axis]))
    n = {"VALID": valid.sum(), "FULL": len(lab), "BATCH_SIZE": outer, "NONE": 1}[mode]
    return (per * valid).sum() / max(n, 1)


@pytest.mark.parametrize("shape,axis,ignore,mode", [
    ((4, 5), 1, None, "VALID"),
    ((2, 3, 2, 2), 1, 1, "VALID"),
    ((2, 3, 2, 2), 1, 0, "FULL"),
    ((2, 2, 4), 2, None, "BATCH_SIZE"),
    ((3, 4), 1, 2, "NONE"),
])
def test_infogain_loss_with_H_bottom(shape, axis, ignore, mode):
    K = shape[axis]
    x = rng(4).standard_normal(shape)
    label = rng(5).integers(0, K, shape[:axis] + shape[axis + 1:]).astype(np.float64)
    H = np.eye(K) + 0.3 * rng(6).random((K, K))
    loss = f"normalization: {mode}" + (f" ignore_label: {ignore}" if ignore is not None else "")
    text = f'type: "InfogainLoss" infogain_loss_param {{ axis: {axis} }} loss_param {{ {loss} }}'
    h = check_gradient(make_layer(text, n_bottoms=3), [x, label, H], check_bottoms=[0],
                       propagate_down=[True, False, False])
    np.testing.assert_allclose(h.forward()[0], infogain_reference(x, label, H, axis, ignore, mode), rtol=1e-10)
    with pytest.raises(LayerError, match=r'\(InfogainLoss\): cannot backpropagate to the infogain input H'):
        h.backward([np.array(1.0)], [True, False, True])


def test_infogain_loss_from_file_and_second_top(tmp_path, monkeypatch):
    H = np.eye(3) + 0.5
    blob = blobproto.from_array(H.astype(np.float32))
    (tmp_path / "H.binaryproto").write_bytes(blob.SerializeToString())
    monkeypatch.chdir(tmp_path)
    x, label = rng(7).standard_normal((4, 3)), np.array([0.0, 2, 1, 1])
    text = 'type: "InfogainLoss" infogain_loss_param { source: "H.binaryproto" }'
    check_gradient(make_layer(text, n_bottoms=2), [x, label])
    loss, prob = Harness(make_layer(text, n_bottoms=2, n_tops=2), [x, label]).forward()
    np.testing.assert_allclose(loss, infogain_reference(x, label, H, 1, None, "VALID"), rtol=1e-6)
    np.testing.assert_allclose(prob, softmax(x))


@pytest.mark.parametrize("text,match", [
    ('type: "InfogainLoss"', "source must be specified"),
    ('type: "InfogainLoss" infogain_loss_param { source: "nowhere.binaryproto" }',
     'not found: "nowhere.binaryproto" \\(resolved against the working directory'),
    ('type: "InfogainLoss" infogain_loss_param { source: "x" } loss_param { normalize: true }',
     "normalize is deprecated"),
])
def test_infogain_loss_refusals(text, match):
    with pytest.raises(LayerError, match=rf'layer "infogainloss" \(InfogainLoss\): .*{match}'):
        Harness(make_layer(text, n_bottoms=2), [np.ones((2, 3)), np.zeros(2)])


def test_infogain_loss_H_size():
    with pytest.raises(LayerError, match="H must be 3x3"):
        Harness(make_layer('type: "InfogainLoss"', n_bottoms=3), [np.ones((2, 3)), np.zeros(2), np.ones((2, 2))])
