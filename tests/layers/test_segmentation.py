"""Upsample against PyTorch's max_unpool2d (with the mask of sncaffe's Pooling), Interp against
interpolate(align_corners=True), both BN flavours against their forks' formulas; gradients."""
import numpy as np
import pytest

from sncaffe.gradcheck import Harness, check_gradient, make_layer
from sncaffe.layers.base import TEST, LayerError

torch = pytest.importorskip("torch")
F = torch.nn.functional


def pool_with_mask(x, k=2, s=2):
    layer = make_layer(f'type: "Pooling" pooling_param {{ pool: MAX kernel_size: {k} stride: {s} }}', n_tops=2)
    return Harness(layer, [x]).forward()


@pytest.mark.parametrize("shape,text", [((2, 3, 8, 10), "scale: 2"),
                                        ((2, 3, 7, 9), "upsample_h: 7 upsample_w: 9"),
                                        ((1, 2, 7, 8), "scale: 2 pad_out_h: true")])
def test_upsample_is_max_unpool(shape, text):
    x = np.random.default_rng(0).permutation(int(np.prod(shape))).reshape(shape) / 10.0
    pooled, mask = pool_with_mask(x)
    layer = make_layer(f'type: "Upsample" upsample_param {{ {text} }}', n_bottoms=2)
    h = check_gradient(layer, [pooled, mask])
    y = h.forward()[0]
    want = F.max_unpool2d(torch.from_numpy(pooled), torch.from_numpy(mask).long(), 2, 2, output_size=shape[2:])
    np.testing.assert_array_equal(y, want.numpy())
    assert y.shape == shape


def test_upsample_refuses_a_mask_past_its_top():
    pooled, mask = pool_with_mask(np.random.default_rng(1).standard_normal((1, 1, 8, 8)))
    layer = make_layer('type: "Upsample" upsample_param { upsample_h: 4 upsample_w: 4 }', n_bottoms=2)
    with pytest.raises(LayerError, match=r"mask index \d+ is outside the 4x4 top"):
        Harness(layer, [pooled, mask]).forward()


@pytest.mark.parametrize("shape,text,size", [((2, 3, 5, 7), "height: 9 width: 4", (9, 4)),
                                             ((1, 2, 6, 6), "zoom_factor: 3", (16, 16)),
                                             ((1, 2, 9, 7), "shrink_factor: 2", (5, 4)),
                                             ((1, 1, 5, 5), "height: 1 width: 6", (1, 6))])
def test_interp_is_align_corners_bilinear(shape, text, size):
    x = np.random.default_rng(2).standard_normal(shape)
    h = check_gradient(make_layer(f'type: "Interp" interp_param {{ {text} }}'), [x])
    want = F.interpolate(torch.from_numpy(x), size=size, mode="bilinear", align_corners=True).numpy()
    np.testing.assert_allclose(h.forward()[0], want, rtol=1e-6, atol=1e-6)   # the fork's float32 positions


def test_interp_crops_by_negative_padding():
    x = np.random.default_rng(3).standard_normal((1, 2, 9, 9))
    y = Harness(make_layer('type: "Interp" interp_param { zoom_factor: 2 pad_beg: -1 pad_end: -2 }'), [x]).forward()[0]
    want = F.interpolate(torch.from_numpy(x[:, :, 1:7, 1:7]), size=(11, 11), mode="bilinear", align_corners=True)
    np.testing.assert_allclose(y, want.numpy(), rtol=1e-6, atol=1e-6)


def bn(text, phase=0, n_tops=1):
    return make_layer(f'type: "BN" bn_param {{ {text} }}', phase=phase, n_tops=n_tops)


def test_pspnet_bn_trains_on_batch_statistics_and_moves_the_stored_ones():
    rng = np.random.default_rng(4)
    x = rng.standard_normal((3, 4, 2, 5)) * 2 + 1
    slope, bias = rng.standard_normal((1, 4, 1, 1)), rng.standard_normal((1, 4, 1, 1))
    stored_mean, stored_var = rng.random((1, 4, 1, 1)), rng.random((1, 4, 1, 1)) + 0.5
    params = [slope, bias, stored_mean, stored_var]
    h = check_gradient(bn("momentum: 0.95 eps: 1e-4"), [x], params=params, check_params=False)
    layer = h.layer
    assert [spec.lr_mult for spec in layer.param.param] == [1, 1, 0, 0]
    mean, var = x.mean(axis=(0, 2, 3), keepdims=True), x.var(axis=(0, 2, 3), keepdims=True)
    layer.blobs[2].data[...], layer.blobs[3].data[...] = stored_mean, stored_var   # then one forward
    y = h.forward()[0]
    np.testing.assert_allclose(y, slope * (x - mean) / np.sqrt(var + 1e-4) + bias, rtol=1e-10)
    m = float(np.float32(0.95))                         # the proto's float
    np.testing.assert_allclose(layer.blobs[2].data, m * stored_mean + (1 - m) * mean, rtol=1e-12)
    np.testing.assert_allclose(layer.blobs[3].data, m * stored_var + (1 - m) * var, rtol=1e-12)


def test_pspnet_bn_params_get_their_gradient():
    x = np.random.default_rng(5).standard_normal((2, 3, 2, 2))
    check_gradient(bn("frozen: false"), [x])


@pytest.mark.parametrize("text,phase", [("frozen: true", 0), ("momentum: 0.9", TEST)])
def test_pspnet_bn_uses_stored_statistics_frozen_or_in_test(text, phase):
    rng = np.random.default_rng(6)
    x = rng.standard_normal((2, 3, 2, 4))
    params = [rng.standard_normal((1, 3, 1, 1)), rng.standard_normal((1, 3, 1, 1)),
              rng.standard_normal((1, 3, 1, 1)), rng.random((1, 3, 1, 1)) + 0.1]
    h = check_gradient(bn(text, phase), [x], params=params, check_params=False)
    slope, bias, mean, var = params
    np.testing.assert_allclose(h.forward()[0], slope * (x - mean) / np.sqrt(var + 1e-5) + bias, rtol=1e-10)
    np.testing.assert_array_equal(h.layer.blobs[2].data, mean)      # never moved
    frozen = "frozen: true" in text
    assert [spec.lr_mult for spec in h.layer.param.param] == [0, 0, 0, 0] if frozen else [1, 1, 0, 0]


def test_segnet_bn_learn_and_inference():
    rng = np.random.default_rng(7)
    x = rng.standard_normal((2, 3, 3, 2)) * 3
    params = [rng.standard_normal((1, 3, 1, 1)), rng.standard_normal((1, 3, 1, 1))]
    text = 'scale_filler { type: "constant" value: 1 } shift_filler { type: "constant" value: 0.001 }'
    h = check_gradient(bn(text, n_tops=3), [x], params=params, ignored_tops=(1, 2))   # statistics: no backward
    y, mean, var = h.forward()
    m, v = x.mean(axis=(0, 2, 3), keepdims=True), x.var(axis=(0, 2, 3), keepdims=True)
    np.testing.assert_allclose(y, params[0] * (x - m) / np.sqrt(v + 1e-9) + params[1], rtol=1e-9)
    np.testing.assert_allclose(mean, m, rtol=1e-12)
    np.testing.assert_allclose(var, v, rtol=1e-9)
    h = check_gradient(bn("bn_mode: INFERENCE"), [x], params=params)
    np.testing.assert_allclose(h.forward()[0], params[0] * x + params[1], rtol=1e-12)


def test_bn_refuses_both_forks_fields():
    with pytest.raises(LayerError, match="mixes caffe-segnet's bn_mode with PSPNet's momentum"):
        Harness(bn("bn_mode: INFERENCE momentum: 0.9"), [np.ones((1, 2, 2, 2))])


def test_softmax_loss_weighted_by_class_as_caffe_segnet():
    rng = np.random.default_rng(8)
    x, lab = rng.standard_normal((2, 3, 2, 2)), rng.integers(0, 3, (2, 1, 2, 2)).astype(float)
    text = ('type: "SoftmaxWithLoss" loss_param { weight_by_label_freqs: true class_weighting: 0.5 '
            'class_weighting: 2 class_weighting: 1 }')
    h = check_gradient(make_layer(text, n_bottoms=2), [x, lab])
    p = np.exp(x) / np.exp(x).sum(axis=1, keepdims=True)
    li = lab[:, 0].astype(int)
    picked = np.take_along_axis(p, li[:, None], 1)[:, 0]
    want = -(np.array([0.5, 2, 1])[li] * np.log(picked)).sum() / li.size
    np.testing.assert_allclose(h.forward()[0], want, rtol=1e-12)


def test_dropout_samples_in_test_when_asked():
    x = np.ones((4, 100))
    text = 'type: "Dropout" dropout_param { dropout_ratio: 0.5 %s }'
    kept = Harness(make_layer(text % "", phase=TEST), [x]).forward()[0]
    sampled = Harness(make_layer(text % "sample_weights_test: true", phase=TEST), [x]).forward()[0]
    np.testing.assert_array_equal(kept, x)
    assert set(np.unique(sampled)) == {0, 2}
