"""ROIPooling, PSROIPooling and SmoothL1Loss against loop-by-loop ports of the forks' kernels
(caffe-fast-rcnn's roi_pooling_layer.cpp and smooth_L1_loss_layer.cu, caffe-rfcn's
psroi_pooling_layer.cu), and their gradients."""
import math

import numpy as np
import pytest

from sncaffe.gradcheck import Harness, check_gradient, make_layer
from sncaffe.layers.base import LayerError

ROIS = np.array([[0, 1, 2, 12, 14], [1, 0, 0, 17, 15], [0, 5, 5, 5, 5], [1, 3.6, 2.4, 9.5, 7.5],
                 [0, -4, -3, 2, 30]], float)


def c_round(v):
    return math.floor(abs(v) + 0.5) * (1 if v >= 0 else -1)


def roi_pool_reference(x, rois, ph_, pw_, scale):
    """caffe-fast-rcnn's ROIPoolingLayer::Forward_cpu, loop for loop."""
    N, C, H, W = x.shape
    scale = float(np.float32(scale))        # the proto's float
    out = np.zeros((len(rois), C, ph_, pw_))
    for n, roi in enumerate(rois):
        b = int(roi[0])
        sw, sh, ew, eh = (c_round(v * scale) for v in roi[1:5])
        rh, rw = max(eh - sh + 1, 1), max(ew - sw + 1, 1)
        bh, bw = rh / ph_, rw / pw_
        for c in range(C):
            for ph in range(ph_):
                for pw in range(pw_):
                    hs = min(max(math.floor(ph * bh) + sh, 0), H)
                    he = min(max(math.ceil((ph + 1) * bh) + sh, 0), H)
                    ws = min(max(math.floor(pw * bw) + sw, 0), W)
                    we = min(max(math.ceil((pw + 1) * bw) + sw, 0), W)
                    if he <= hs or we <= ws:
                        out[n, c, ph, pw] = 0
                    else:
                        out[n, c, ph, pw] = x[b, c, hs:he, ws:we].max()
    return out


def psroi_pool_reference(x, rois, dim, group, scale):
    """caffe-rfcn's PSROIPoolingForward, one thread's work per output value."""
    N, C, H, W = x.shape
    scale = float(np.float32(scale))
    out = np.zeros((len(rois), dim, group, group))
    for n, roi in enumerate(rois):
        b = int(roi[0])
        sw, sh = c_round(roi[1]) * scale, c_round(roi[2]) * scale
        ew, eh = (c_round(roi[3]) + 1) * scale, (c_round(roi[4]) + 1) * scale
        bh, bw = max(eh - sh, 0.1) / group, max(ew - sw, 0.1) / group
        for ct in range(dim):
            for ph in range(group):
                for pw in range(group):
                    hs = min(max(math.floor(ph * bh + sh), 0), H)
                    he = min(max(math.ceil((ph + 1) * bh + sh), 0), H)
                    ws = min(max(math.floor(pw * bw + sw), 0), W)
                    we = min(max(math.ceil((pw + 1) * bw + sw), 0), W)
                    c = (ct * group + ph) * group + pw
                    if he > hs and we > ws:
                        out[n, ct, ph, pw] = x[b, c, hs:he, ws:we].mean()
    return out


def roi_layer(pooled=(3, 2), scale=0.5):
    return make_layer(f'type: "ROIPooling" roi_pooling_param {{ pooled_h: {pooled[0]} pooled_w: {pooled[1]} '
                      f'spatial_scale: {scale} }}', n_bottoms=2)


@pytest.mark.parametrize("pooled,scale", [((3, 2), 0.5), ((2, 2), 1.0), ((7, 7), 0.25)])
def test_roi_pooling_matches_the_fork(pooled, scale):
    x = np.random.default_rng(1).permutation(2 * 3 * 8 * 9).reshape(2, 3, 8, 9) / 7.0      # no ties
    y = Harness(roi_layer(pooled, scale), [x, ROIS]).forward()[0]
    np.testing.assert_array_equal(y, roi_pool_reference(x, ROIS, *pooled, scale))


def test_roi_pooling_gradient_goes_to_each_argmax():
    x = np.random.default_rng(2).permutation(2 * 3 * 8 * 9).reshape(2, 3, 8, 9) / 7.0
    h = check_gradient(roi_layer(), [x, ROIS], max_probes=150)
    assert h.top_shapes == [(5, 3, 3, 2)]


def test_roi_pooling_refuses_a_roi_outside_the_batch():
    with pytest.raises(LayerError, match=r"roi batch index 2 is outside the batch of 2"):
        Harness(roi_layer(), [np.ones((2, 1, 4, 4)), [[2, 0, 0, 1, 1]]]).forward()
    with pytest.raises(LayerError, match=r"rois must be \(num_rois, 5\)"):
        Harness(roi_layer(), [np.ones((2, 1, 4, 4)), [[0, 0, 0, 1]]])


@pytest.mark.parametrize("group,scale", [(3, 0.5), (2, 0.0625 * 16), (4, 0.3)])
def test_psroi_pooling_matches_the_fork(group, scale):
    dim = 2
    x = np.random.default_rng(3).standard_normal((2, dim * group * group, 8, 9))
    text = (f'type: "PSROIPooling" psroi_pooling_param {{ spatial_scale: {scale} output_dim: {dim} '
            f'group_size: {group} }}')
    y = Harness(make_layer(text, n_bottoms=2), [x, ROIS]).forward()[0]
    np.testing.assert_allclose(y, psroi_pool_reference(x, ROIS, dim, group, scale), rtol=1e-12)


def test_psroi_pooling_gradient():
    x = np.random.default_rng(5).standard_normal((2, 2 * 3 * 3, 8, 9))
    text = 'type: "PSROIPooling" psroi_pooling_param { spatial_scale: 0.5 output_dim: 2 group_size: 3 }'
    check_gradient(make_layer(text, n_bottoms=2), [x, ROIS], max_probes=150)


def test_psroi_pooling_checks_channels():
    text = 'type: "PSROIPooling" psroi_pooling_param { spatial_scale: 1 output_dim: 2 group_size: 3 }'
    with pytest.raises(LayerError, match=r"input channels \(17\) must be output_dim \* group_size\^2"):
        Harness(make_layer(text, n_bottoms=2), [np.ones((1, 17, 4, 4)), ROIS[:1]])


def smooth_l1_reference(a, b, w_in, w_out, sigma):
    d = w_in * (a - b)
    s2 = sigma * sigma
    f = np.where(np.abs(d) < 1 / s2, 0.5 * s2 * d * d, np.abs(d) - 0.5 / s2)
    return (w_out * f).sum() / a.shape[0]


@pytest.mark.parametrize("weights,sigma", [(False, 1.0), (True, 3.0)])
def test_smooth_l1_loss(weights, sigma):
    rng = np.random.default_rng(4)
    a, b = rng.standard_normal((4, 8, 2, 3)), rng.standard_normal((4, 8, 2, 3))
    bottoms = [a, b] + ([rng.random(a.shape), rng.random(a.shape)] if weights else [])
    layer = make_layer(f'type: "SmoothL1Loss" smooth_l1_loss_param {{ sigma: {sigma} }}', n_bottoms=len(bottoms))
    h = check_gradient(layer, bottoms)
    want = smooth_l1_reference(a, b, *(bottoms[2:] if weights else (1, 1)), sigma)
    np.testing.assert_allclose(h.forward()[0], want, rtol=1e-12)


def test_smooth_l1_loss_needs_both_weights():
    with pytest.raises(LayerError, match="both inside and outside weights"):
        Harness(make_layer('type: "SmoothL1Loss"', n_bottoms=3), [np.ones((2, 4))] * 3)
