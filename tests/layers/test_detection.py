"""SSD's detection layers: Permute, PriorBox, Normalize, DetectionOutput, MultiBoxLoss."""
import math

import numpy as np
import pytest

from sncaffe.gradcheck import Harness, check_gradient, make_layer
from sncaffe.layers import LayerError
from sncaffe.layers.detection import jaccard, nms


def randn(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape)


# -- Permute ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("order,expect", [((0, 2, 3, 1), (0, 2, 3, 1)), ((1, 0), (1, 0, 2, 3)), ((), (0, 1, 2, 3))])
def test_permute_forward_and_gradient(order, expect):
    x = randn(2, 3, 4, 5)
    text = 'type: "Permute" permute_param { ' + " ".join(f"order: {a}" for a in order) + " }"
    h = check_gradient(make_layer(text), [x])
    np.testing.assert_array_equal(h.forward()[0], x.transpose(expect))


def test_permute_refuses_a_repeated_or_missing_axis():
    for order in ("order: 0 order: 0", "order: 4"):
        with pytest.raises(LayerError, match="Permute"):
            Harness(make_layer(f'type: "Permute" permute_param {{ {order} }}'), [randn(1, 2, 3, 4)])


# -- PriorBox --------------------------------------------------------------------------------------
def prior_box(text, fmap=(1, 8, 2, 2), img=(1, 3, 8, 8)):
    h = Harness(make_layer(f'type: "PriorBox" prior_box_param {{ {text} }}', n_bottoms=2),
                [np.zeros(fmap), np.zeros(img)], dtype=np.float32)
    return h.forward()[0]


def test_prior_box_hand_derived():
    # A 2x2 map of an 8x8 image: step 4, centres 2 and 6. Per cell: min_size 4, sqrt(4 * 9) = 6,
    # then aspect ratio 2 (4*sqrt2 x 4/sqrt2) and its flip.
    out = prior_box("min_size: 4 max_size: 9 aspect_ratio: 2 flip: true variance: 0.1 variance: 0.1 "
                    "variance: 0.2 variance: 0.2")
    assert out.shape == (1, 2, 2 * 2 * 4 * 4)
    r = math.sqrt(2)
    sizes = [(4, 4), (6, 6), (4 * r, 4 / r), (4 / r, 4 * r)]
    expect = []
    for cy in (2, 6):
        for cx in (2, 6):
            for w, h in sizes:
                expect += [(cx - w / 2) / 8, (cy - h / 2) / 8, (cx + w / 2) / 8, (cy + h / 2) / 8]
    np.testing.assert_allclose(out[0, 0], expect, rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(out[0, 1].reshape(-1, 4), np.tile(np.float32([0.1, 0.1, 0.2, 0.2]), (16, 1)))


def test_prior_box_clip_step_offset_img_size_and_truncation():
    # min_size 4.7 counts as 4 (the fork stores sizes in an int); step 3, offset 0: centres 0 and 3.
    out = prior_box("min_size: 4.7 clip: true step: 3 offset: 0 img_size: 10")
    assert out.shape == (1, 2, 2 * 2 * 1 * 4)
    expect = []
    for cy in (0, 3):
        for cx in (0, 3):
            expect += [(cx - 2) / 10, (cy - 2) / 10, (cx + 2) / 10, (cy + 2) / 10]
    np.testing.assert_allclose(out[0, 0], np.clip(expect, 0, 1), rtol=1e-6)
    np.testing.assert_allclose(out[0, 1], 0.1)                 # one default variance


def test_prior_box_shapes_of_mobilenet_ssd_heads():
    # MobileNet-SSD's first head: a 19x19 map of 300x300, min 60 (no max), ratios 2 -> 3 priors.
    assert prior_box("min_size: 60 aspect_ratio: 2 flip: true", (1, 512, 19, 19), (1, 3, 300, 300)).shape \
        == (1, 2, 19 * 19 * 3 * 4)
    # and the second: 10x10, min 105 max 150, ratios 2 and 3 with flips -> 6 priors.
    assert prior_box("min_size: 105 max_size: 150 aspect_ratio: 2 aspect_ratio: 3 flip: true",
                     (1, 1024, 10, 10), (1, 3, 300, 300)).shape == (1, 2, 10 * 10 * 6 * 4)
    with pytest.raises(LayerError, match="max_size"):
        prior_box("min_size: 10 max_size: 5")


# -- Normalize -------------------------------------------------------------------------------------
@pytest.mark.parametrize("across", [True, False])
@pytest.mark.parametrize("shared", [True, False])
def test_normalize_forward_and_gradient(across, shared):
    x = randn(2, 3, 2, 3)
    text = (f'type: "Normalize" norm_param {{ across_spatial: {str(across).lower()} '
            f'channel_shared: {str(shared).lower()} }}')
    scale = np.array(1.7) if shared else np.array([0.5, 2.0, -1.0])
    h = check_gradient(make_layer(text), [x], params=[scale])
    axes = (1, 2, 3) if across else (1,)
    norm = np.sqrt((x ** 2).sum(axis=axes, keepdims=True) + 1e-10)
    s = scale if shared else scale.reshape(1, 3, 1, 1)
    np.testing.assert_allclose(h.forward()[0], x / norm * s, rtol=1e-12)
    check_gradient(make_layer(text), [x], seed=3)              # random scales too


def test_normalize_scale_filler_and_shapes():
    layer = make_layer('type: "Normalize" norm_param { across_spatial: false channel_shared: false '
                       'scale_filler { type: "constant" value: 20 } }')
    h = Harness(layer, [randn(1, 4, 2, 2)], params=None)
    assert layer.param_shapes == [(4,)]
    layer.init_params(np.random.default_rng(0))
    np.testing.assert_array_equal(layer.blobs[0].data, 20)
    out = h.forward()[0]
    np.testing.assert_allclose(np.sqrt((out ** 2).sum(axis=1)), 20, rtol=1e-6)


# -- boxes and NMS ---------------------------------------------------------------------------------
def caffe_jaccard(a, b):
    """bbox_util.cpp's JaccardOverlap, one pair at a time."""
    if b[0] > a[2] or b[2] < a[0] or b[1] > a[3] or b[3] < a[1]:
        return 0.0
    iw, ih = min(a[2], b[2]) - max(a[0], b[0]), min(a[3], b[3]) - max(a[1], b[1])
    if iw <= 0 or ih <= 0:
        return 0.0
    size = lambda x: 0.0 if x[2] < x[0] or x[3] < x[1] else (x[2] - x[0]) * (x[3] - x[1])  # noqa: E731
    return iw * ih / (size(a) + size(b) - iw * ih)


def caffe_nms(boxes, scores, threshold, nms_threshold, eta=1.0, top_k=-1):
    """ApplyNMSFast as written in the fork: a candidate is kept if it overlaps every kept box at most."""
    cand = sorted([(s, i) for i, s in enumerate(scores) if s > threshold], key=lambda t: -t[0])
    if top_k > -1:
        cand = cand[:top_k]
    kept, adaptive = [], nms_threshold
    for _, i in cand:
        keep = all(caffe_jaccard(boxes[i], boxes[k]) <= adaptive for k in kept)
        if keep:
            kept.append(i)
            if eta < 1 and adaptive > 0.5:
                adaptive *= eta
    return kept


def random_boxes(n, seed):
    rng = np.random.default_rng(seed)
    xy = rng.uniform(0, 0.8, (n, 2))
    wh = rng.uniform(0.05, 0.4, (n, 2))
    return np.concatenate([xy, xy + wh], axis=1)


def test_jaccard_matches_the_pairwise_formula():
    a, b = random_boxes(20, 1), random_boxes(15, 2)
    b[0] = [0.5, 0.5, 0.4, 0.6]                    # an invalid box: size 0
    want = np.array([[caffe_jaccard(x, y) for y in b] for x in a])
    np.testing.assert_allclose(jaccard(a, b), want, rtol=1e-12)


@pytest.mark.parametrize("eta,top_k,threshold,ties", [(1.0, -1, 0.0, False), (1.0, 7, 0.3, False),
                                                       (0.8, -1, 0.1, False), (1.0, 20, 0.0, True)])
def test_nms_matches_the_forks_loop(eta, top_k, threshold, ties):
    boxes = random_boxes(60, 3)
    scores = np.random.default_rng(4).uniform(size=60)
    if ties:                                    # equal scores: the lower index first, as stable_sort
        scores = np.round(scores, 1)
    got = nms(boxes, scores, threshold, 0.45 if eta == 1 else 0.7, eta, top_k)
    assert list(got) == caffe_nms(boxes, scores, threshold, 0.45 if eta == 1 else 0.7, eta, top_k)
    assert len(got) > 3


# -- DetectionOutput -------------------------------------------------------------------------------
def priors_blob(P, seed=5):
    p = random_boxes(P, seed)
    var = np.tile([0.1, 0.1, 0.2, 0.2], (P, 1))
    return np.stack([p.reshape(-1), var.reshape(-1)])[None]


def reference_detections(loc, conf, prior, C, conf_thr, nms_thr, top_k, keep_top_k, share=True, bg=0):
    """The fork's DetectionOutput, loop by loop (CENTER_SIZE, variance in the priors)."""
    N, P = conf.shape[0], prior.shape[2] // 4
    pb_, var = prior[0, 0].reshape(P, 4), prior[0, 1].reshape(P, 4)
    L = 1 if share else C
    loc = loc.reshape(N, P, L, 4)
    conf = conf.reshape(N, P, C)
    rows = []
    for i in range(N):
        def box(p, c):
            l, v, q = loc[i, p, 0 if share else c], var[p], pb_[p]
            pw, ph = q[2] - q[0], q[3] - q[1]
            cx, cy = v[0] * l[0] * pw + (q[0] + q[2]) / 2, v[1] * l[1] * ph + (q[1] + q[3]) / 2
            w, h = math.exp(v[2] * l[2]) * pw, math.exp(v[3] * l[3]) * ph
            return [cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2]
        found = {}
        for c in range(C):
            if c == bg:
                continue
            boxes = [box(p, c) for p in range(P)]
            found[c] = caffe_nms(boxes, conf[i, :, c], conf_thr, nms_thr, 1.0, top_k)
        pairs = [(conf[i, p, c], c, p) for c, ps in found.items() for p in ps]
        if keep_top_k > -1 and len(pairs) > keep_top_k:
            pairs = sorted(pairs, key=lambda t: -t[0])[:keep_top_k]
            found = {}
            for _, c, p in pairs:
                found.setdefault(c, []).append(p)
        for c in sorted(found):
            for p in found[c]:
                rows.append([i, c, conf[i, p, c], *box(p, c)])
    return np.array(rows).reshape(-1, 7)


def detection_layer(C, extra=""):
    return make_layer(f'type: "DetectionOutput" detection_output_param {{ num_classes: {C} '
                      f'code_type: CENTER_SIZE {extra} }}', n_bottoms=3)


@pytest.mark.parametrize("share", [True, False])
def test_detection_output_matches_the_reference(share):
    N, P, C = 2, 40, 4
    L = 1 if share else C
    loc, prior = randn(N, P * L * 4, seed=6) * 0.5, priors_blob(P)
    conf = np.random.default_rng(7).dirichlet(np.ones(C), size=(N, P)).reshape(N, P * C)
    extra = (f"share_location: {str(share).lower()} confidence_threshold: 0.2 keep_top_k: 9 "
             "nms_param { nms_threshold: 0.45 top_k: 12 }")
    layer = detection_layer(C, extra)
    h = Harness(layer, [loc, conf, prior])
    assert h.top_shapes == [(1, 1, N * 9, 7)]          # planned for the most rows
    h.forward()
    rows = layer.detect(h.bottom)
    want = reference_detections(loc, conf, prior, C, 0.2, 0.45, 12, 9, share)
    assert rows.shape == want.shape and 0 < rows.shape[0] <= N * 9
    np.testing.assert_allclose(rows, want, rtol=1e-9, atol=1e-12)
    assert layer.top_shapes(h.bottom) == [(1, 1, len(want), 7)]
    layer.forward(h.bottom, h.top)
    np.testing.assert_allclose(h.top[0].data.reshape(-1, 7)[:len(want)], want, rtol=1e-9)


def test_detection_output_with_nothing_above_the_threshold():
    N, P, C = 3, 10, 3
    conf = np.full((N, P * C), 1.0 / C)
    layer = detection_layer(C, "confidence_threshold: 0.9 nms_param { nms_threshold: 0.45 }")
    h = Harness(layer, [randn(N, P * 4), conf, priors_blob(P)])
    rows = layer.detect(h.bottom)
    want = np.full((N, 7), -1.0)
    want[:, 0] = np.arange(N)
    np.testing.assert_array_equal(rows, want)


# -- MultiBoxLoss ----------------------------------------------------------------------------------
def loss_layer(C, extra="", neg="neg_pos_ratio: 3 neg_overlap: 0.5"):
    return make_layer(f'type: "MultiBoxLoss" propagate_down: true propagate_down: true propagate_down: false '
                      f'propagate_down: false multibox_loss_param {{ num_classes: {C} code_type: CENTER_SIZE '
                      f'overlap_threshold: 0.5 {neg} {extra} }}', n_bottoms=4)


def grid_priors(n=6):
    """n x n square priors of side 1/n plus the same count of side 2/n, centred on a grid."""
    c = (np.arange(n) + 0.5) / n
    cx, cy = np.meshgrid(c, c)
    boxes = []
    for s in (1 / n, 2 / n):
        boxes.append(np.stack([cx - s / 2, cy - s / 2, cx + s / 2, cy + s / 2], -1).reshape(-1, 4))
    p = np.concatenate(boxes)
    var = np.tile([0.1, 0.1, 0.2, 0.2], (len(p), 1))
    return np.stack([p.reshape(-1), var.reshape(-1)])[None]


def gt_rows(rows):
    return np.array(rows, np.float64).reshape(1, 1, -1, 8)


GT = gt_rows([[0, 1, 0, 0.1, 0.1, 0.45, 0.45, 0], [0, 2, 0, 0.5, 0.55, 0.9, 0.95, 0],
              [1, 1, 0, 0.3, 0.2, 0.7, 0.6, 0]])


@pytest.mark.parametrize("extra", ["", "mining_type: NONE loc_loss_type: L2 loc_weight: 0.5 match_type: BIPARTITE"])
def test_multibox_loss_gradient(extra):
    prior = grid_priors(4)
    P, C = prior.shape[2] // 4, 3
    loc, conf = randn(2, P * 4, seed=8) * 0.3, randn(2, P * C, seed=9)
    check_gradient(loss_layer(C, extra), [loc, conf, prior, GT], check_bottoms=[0, 1],
                   propagate_down=[True, True, False, False], max_probes=100)


def test_multibox_loss_matching_and_mining_by_hand():
    # Priors: A hits the box best, B overlaps it 0.6 (per prediction), D 0.2 (not a negative at
    # neg_overlap 0.1 if it overlapped more; here 0.2 >= 0.1), C and E do not overlap it.
    boxes = np.array([[0.0, 0.0, 0.5, 0.5],         # A: the box itself
                      [0.0, 0.0, 0.5, 0.3],         # B: IoU 0.6
                      [0.6, 0.6, 1.0, 1.0],         # C: 0
                      [0.3, 0.0, 0.8, 0.5],         # D: IoU 0.25
                      [0.7, 0.0, 1.0, 0.3]])        # E: 0
    var = np.tile([0.1, 0.1, 0.2, 0.2], (5, 1))
    prior = np.stack([boxes.reshape(-1), var.reshape(-1)])[None]
    gt = gt_rows([[0, 1, 0, 0.0, 0.0, 0.5, 0.5, 0]])
    C = 2
    conf = np.zeros((1, 5, C))
    conf[0, :, 1] = [0.0, 0.0, 1.0, 3.0, 2.0]       # background losses: C < E < D
    layer = loss_layer(C, neg="neg_pos_ratio: 1 neg_overlap: 0.3")
    h = Harness(layer, [np.zeros((1, 20)), conf.reshape(1, -1), prior, gt])
    loss = h.forward()[0]
    np.testing.assert_array_equal(layer.scratch["positive"][0], [1, 1, 0, 0, 0])
    # Two positives -> two negatives among C, E (D overlaps 0.25 < 0.3: also eligible): D and E.
    np.testing.assert_array_equal(layer.scratch["conf_label"][0], [1, 1, -1, 0, 0])
    # loc targets: A encodes to 0; B's (CENTER_SIZE, variance 0.1/0.2) by hand.
    np.testing.assert_allclose(layer.scratch["loc_target"][0, 0], 0, atol=1e-12)
    np.testing.assert_allclose(layer.scratch["loc_target"][0, 1],
                               [0, (0.25 - 0.15) / 0.3 / 0.1, 0, math.log(0.5 / 0.3) / 0.2])
    ce = lambda z, k: -(z[k] - np.log(np.exp(z).sum()))  # noqa: E731
    smooth = lambda d: np.where(np.abs(d) < 1, 0.5 * d * d, np.abs(d) - 0.5).sum()  # noqa: E731
    conf_loss = ce(conf[0, 0], 1) + ce(conf[0, 1], 1) + ce(conf[0, 3], 0) + ce(conf[0, 4], 0)
    loc_loss = smooth(-layer.scratch["loc_target"][0, 1])
    np.testing.assert_allclose(loss, (loc_loss + conf_loss) / 2, rtol=1e-12)


def test_multibox_loss_refuses_gradients_for_priors_and_labels():
    prior = grid_priors(2)
    P = prior.shape[2] // 4
    layer = loss_layer(2)
    h = Harness(layer, [randn(1, P * 4), randn(1, P * 2), prior, gt_rows([[0, 1, 0, 0, 0, 0.5, 0.5, 0]])])
    h.forward()
    with pytest.raises(LayerError, match="propagate_down: true true false false"):
        h.backward([np.ones(())], [True, True, True, False])


def test_multibox_loss_checks_the_counts():
    with pytest.raises(LayerError, match="location predictions"):
        Harness(loss_layer(2), [randn(1, 12), randn(1, 8), grid_priors(2), GT])
    with pytest.raises(LayerError, match="background"):
        background = gt_rows([[0, 0, 0, 0, 0, .5, .5, 0]])
        h = Harness(loss_layer(3), [randn(2, 72 * 4), randn(2, 72 * 3), grid_priors(), background])
        h.forward()


# -- DetectionEvaluate -----------------------------------------------------------------------------
def test_detection_evaluate_by_hand():
    # Image 0: two boxes of label 1 (one difficult), one of label 2. Image 1: one of label 1.
    gt = gt_rows([[0, 1, 0, 0.0, 0.0, 0.4, 0.4, 0], [0, 1, 1, 0.5, 0.5, 0.9, 0.9, 1],
                  [0, 2, 0, 0.1, 0.5, 0.4, 0.9, 0], [1, 1, 0, 0.2, 0.2, 0.6, 0.6, 0]])
    det = np.array([[0, 1, 0.6, 0.0, 0.0, 0.4, 0.4],      # tp
                    [0, 1, 0.9, 0.02, 0.0, 0.4, 0.4],     # tp (better score: takes the box first)
                    [0, 1, 0.5, 0.5, 0.5, 0.9, 0.9],      # the difficult box: neither
                    [0, 2, 0.7, 0.6, 0.0, 0.9, 0.3],      # fp: overlaps nothing
                    [1, 1, 0.8, 0.2, 0.2, 0.6, 0.6],      # tp
                    [1, 2, 0.4, 0.2, 0.2, 0.6, 0.6]]).reshape(1, 1, -1, 7)   # fp: no label-2 box there
    layer = make_layer('type: "DetectionEvaluate" detection_evaluate_param { num_classes: 3 '
                       'evaluate_difficult_gt: false }', n_bottoms=2)
    h = Harness(layer, [det, gt])
    assert h.top_shapes == [(1, 1, 2 + 6, 5)]
    want = [[-1, 1, 2, -1, -1], [-1, 2, 1, -1, -1],
            [0, 1, 0.9, 1, 0], [0, 1, 0.6, 0, 1], [0, 1, 0.5, 0, 0], [0, 2, 0.7, 0, 1],
            [1, 1, 0.8, 1, 0], [1, 2, 0.4, 0, 1]]
    np.testing.assert_allclose(h.forward()[0][0, 0], want)


def test_ssd_fields_have_the_forks_numbers():
    """The fork's field numbers, so its .caffemodel and prototxt files mean the same here."""
    from sncaffe.proto import sncaffe_pb2 as pb
    numbers = {"annotated_data_param": 200, "multibox_loss_param": 201, "permute_param": 202,
               "prior_box_param": 203, "detection_output_param": 204, "detection_evaluate_param": 205,
               "norm_param": 206, "video_data_param": 207}
    for name, n in numbers.items():
        assert pb.LayerParameter.DESCRIPTOR.fields_by_name[name].number == n
    t = pb.TransformationParameter.DESCRIPTOR.fields_by_name
    assert [t[f].number for f in ("resize_param", "noise_param", "emit_constraint", "crop_h", "crop_w",
                                  "distort_param", "expand_param")] == [8, 9, 10, 11, 12, 13, 14]
    # A record as the fork's create_annoset writes it: datum 1, type 2, annotation_group 3.
    rec = pb.AnnotatedDatum.FromString(bytes([0x0A, 0x02, 0x08, 0x03, 0x10, 0x00, 0x1A, 0x02, 0x08, 0x05]))
    assert (rec.datum.channels, rec.type, rec.annotation_group[0].group_label) == (3, pb.AnnotatedDatum.BBOX, 5)




def test_detection_output_writes_voc_results(tmp_path):
    (tmp_path / "labelmap.prototxt").write_text('item { name: "none" label: 0 } item { name: "cat" label: 1 } '
                                               'item { name: "dog" label: 2 }')
    (tmp_path / "sizes.txt").write_text("img_a 100 200\nimg_b 50 40\n")
    N, P, C = 2, 30, 3
    loc, prior = randn(N, P * 4, seed=11) * 0.5, priors_blob(P, seed=12)
    conf = np.random.default_rng(13).dirichlet(np.ones(C), size=(N, P)).reshape(N, P * C)
    save = (f'save_output_param {{ output_directory: "{tmp_path / "out"}" output_name_prefix: "comp4_" '
            f'output_format: "VOC" label_map_file: "{tmp_path / "labelmap.prototxt"}" '
            f'name_size_file: "{tmp_path / "sizes.txt"}" }}')
    layer = detection_layer(C, save + " confidence_threshold: 0.4 nms_param { nms_threshold: 0.45 }")
    h = Harness(layer, [loc, conf, prior])
    assert not (tmp_path / "out" / "comp4_cat.txt").exists()
    h.forward()                                         # both test images: the files are written
    rows = layer.detect(h.bottom)
    for label, name in ((1, "cat"), (2, "dog")):
        want = []
        for r in rows[rows[:, 1] == label]:
            img, (hh, ww) = (("img_a", (100, 200)), ("img_b", (50, 40)))[int(r[0])]
            x0, y0, x1, y1 = np.clip(r[3:7], 0, 1) * [ww, hh, ww, hh]
            bx, by = int(round(x0 * 100) / 100), int(round(y0 * 100) / 100)
            want.append(f"{img} {np.float32(r[2]):g} {bx} {by} {bx + int(round((x1 - x0) * 100) / 100)} "
                        f"{by + int(round((y1 - y0) * 100) / 100)}")
        got = (tmp_path / "out" / f"comp4_{name}.txt").read_text().splitlines()
        assert got == want and len(got) > 0
    assert not (tmp_path / "out" / "comp4_none.txt").exists()
    with pytest.raises(LayerError, match="COCO"):
        Harness(detection_layer(C, save.replace('"VOC"', '"COCO"')), [loc, conf, prior])


# The fork's own DetectionOutput tests (test_detection_output_layer.cpp): their inputs, their rows.
def fork_case(share):
    N, P, C = 2, 4, 2
    L = 1 if share else C
    boxes = [[(w + 0.5) * 0.5 - 0.15, (h + 0.5) * 0.5 - 0.15, (w + 0.5) * 0.5 + 0.15, (h + 0.5) * 0.5 + 0.15]
             for h in range(2) for w in range(2)]
    prior = np.zeros((N, 2, P * 4, 1))
    prior.reshape(-1)[:2 * P * 4] = np.concatenate([np.ravel(boxes), np.full(P * 4, 0.1)])
    conf = np.array([[j * 0.2 if i % 2 == c % 2 else 1 - j * 0.2 for j in range(P) for c in range(C)]
                     for i in range(N)])
    loc = np.array([[s * (i + c / 2 + 0.5) for h in range(2) for w in range(2) for c in range(L)
                     for s in ((-1 if w % 2 else 1), (-1 if h % 2 else 1), (-1 if w % 2 else 1), (-1 if h % 2 else 1))]
                    for i in range(N)])
    return [loc, conf, prior]


FORK_ROWS = {
    (True, False): ["0 1 1.0 0.15 0.15 0.45 0.45", "0 1 0.8 0.55 0.15 0.85 0.45", "0 1 0.6 0.15 0.55 0.45 0.85",
                    "0 1 0.4 0.55 0.55 0.85 0.85", "1 1 0.6 0.45 0.45 0.75 0.75", "1 1 0.0 0.25 0.25 0.55 0.55"],
    (True, True): ["0 1 1.0 0.15 0.15 0.45 0.45", "0 1 0.8 0.55 0.15 0.85 0.45", "1 1 0.6 0.45 0.45 0.75 0.75"],
    (False, False): ["0 0 0.6 0.55 0.55 0.85 0.85", "0 0 0.4 0.15 0.55 0.45 0.85", "0 0 0.2 0.55 0.15 0.85 0.45",
                     "0 0 0.0 0.15 0.15 0.45 0.45", "0 1 1.0 0.20 0.20 0.50 0.50", "0 1 0.8 0.50 0.20 0.80 0.50",
                     "0 1 0.6 0.20 0.50 0.50 0.80", "0 1 0.4 0.50 0.50 0.80 0.80", "1 0 1.0 0.25 0.25 0.55 0.55",
                     "1 0 0.4 0.45 0.45 0.75 0.75", "1 1 0.6 0.40 0.40 0.70 0.70"],
    (False, True): ["0 0 0.6 0.55 0.55 0.85 0.85", "0 0 0.4 0.15 0.55 0.45 0.85", "0 1 1.0 0.20 0.20 0.50 0.50",
                    "0 1 0.8 0.50 0.20 0.80 0.50", "1 0 1.0 0.25 0.25 0.55 0.55", "1 1 0.6 0.40 0.40 0.70 0.70"]}


@pytest.mark.parametrize("share,top_k", list(FORK_ROWS))
def test_detection_output_reproduces_the_forks_tests(share, top_k):
    extra = (f"share_location: {str(share).lower()} background_label_id: {0 if share else -1} "
             f"nms_param {{ nms_threshold: 0.1 {'top_k: 2' if top_k else ''} }}")
    layer = make_layer(f'type: "DetectionOutput" detection_output_param {{ num_classes: 2 {extra} }}', n_bottoms=3)
    h = Harness(layer, fork_case(share), dtype=np.float32)
    h.forward()
    rows = layer.detect(h.bottom)
    want = np.array([[float(v) for v in r.split()] for r in FORK_ROWS[(share, top_k)]])
    assert rows.shape == want.shape
    np.testing.assert_array_equal(rows[:, :2], want[:, :2])
    np.testing.assert_allclose(rows[:, 2:], want[:, 2:], atol=1e-6)


# The fork's MatchBBox tests (test_bbox_util.cpp): two boxes, six predictions, all labels.
FORK_GT = np.array([[0.1, 0.1, 0.3, 0.3], [0.3, 0.3, 0.6, 0.5]])
FORK_PRED = np.array([[0.1, 0, 0.4, 0.3], [0, 0.1, 0.2, 0.3], [0.2, 0.1, 0.4, 0.4], [0.4, 0.3, 0.7, 0.5],
                      [0.5, 0.4, 0.7, 0.7], [0.7, 0.7, 0.8, 0.8]])
FORK_OVERLAPS = [4 / 9, 2 / 6, 2 / 8, 4 / 8, 1 / 11, 0]


@pytest.mark.parametrize("match,threshold,indices", [("BIPARTITE", -1, [0, -1, -1, 1, -1, -1]),
                                                     ("PER_PREDICTION", 0.3, [0, 0, -1, 1, -1, -1]),
                                                     ("PER_PREDICTION", 0.001, [0, 0, 0, 1, 1, -1])])
def test_matching_reproduces_the_forks_tests(match, threshold, indices):
    layer = make_layer(f'type: "MultiBoxLoss" multibox_loss_param {{ num_classes: 3 match_type: {match} '
                       f'overlap_threshold: {threshold} ignore_cross_boundary_bbox: true }}', n_bottoms=4)
    got, overlaps = layer.match(FORK_PRED, FORK_GT)
    assert list(got) == indices
    np.testing.assert_allclose(overlaps, FORK_OVERLAPS, atol=1e-6)


def test_prior_box_reproduces_the_forks_test():
    # test_prior_box_layer.cpp TestCPUAspectRatio: a 10x10 map of a 100x100 image, min 4, max 9, ratio 2.
    out = prior_box("min_size: 4 max_size: 9 aspect_ratio: 2", (10, 10, 10, 10), (10, 3, 100, 100))[0, 0]
    r = math.sqrt(2)
    cell0 = [0.03, 0.03, 0.07, 0.07, 0.02, 0.02, 0.08, 0.08, 0.05 - 0.02 * r, 0.05 - 0.01 * r, 0.05 + 0.02 * r,
             0.05 + 0.01 * r, 0.05 - 0.01 * r, 0.05 - 0.02 * r, 0.05 + 0.01 * r, 0.05 + 0.02 * r]
    np.testing.assert_allclose(out[:16], cell0, atol=1e-6)
    at = 4 * 10 * 4 * 4 + 4 * 4 * 4                    # the cell at row 4, column 4
    np.testing.assert_allclose(out[at:at + 4], [0.43, 0.43, 0.47, 0.47], atol=1e-6)
    np.testing.assert_allclose(out[at + 8:at + 12], [0.45 - 0.02 * r, 0.45 - 0.01 * r, 0.45 + 0.02 * r,
                                                     0.45 + 0.01 * r], atol=1e-6)


@pytest.mark.parametrize("threshold,nms_threshold,top_k,kept", [(0, 0.3, -1, [0, 3, 2]), (0, 0.3, 2, [0]),
                                                                  (0, 0.2, 3, [0]), (0.5, 0.2, -1, [0])])
def test_nms_reproduces_the_forks_test(threshold, nms_threshold, top_k, kept):
    # test_bbox_util.cpp TestApplyNMSFast
    boxes = np.array([[0.1, 0.1, 0.3, 0.3], [0.2, 0.1, 0.4, 0.3], [0.2, 0.0, 0.4, 0.2], [0.1, 0.2, 0.4, 0.4]],
                     np.float32)
    scores = np.array([0.8, 0.7, 0.4, 0.5], np.float32)
    assert list(nms(boxes, scores, threshold, nms_threshold, 1.0, top_k)) == kept
