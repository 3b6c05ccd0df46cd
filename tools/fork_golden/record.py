"""Records golden data from a Caffe fork's own layer code, built CPU-only with layer_driver.cpp.

    python tools/fork_golden/record.py FORK DRIVER OUT_DIR

FORK names a set of cases below (ssd, ...); DRIVER is the layer_driver built against that fork's
sources. Each case becomes OUT_DIR/<case>.npz holding the LayerParameter text, the bottoms, the
propagate_down flags, the parameter blobs, the top diffs given, and what the fork computed: the tops,
the bottom diffs and the parameter diffs. Inputs are random with a fixed seed per case.
"""
import os
import struct
import subprocess
import sys
import tempfile
import zlib

import numpy as np


def _write_blob(f, a):
    a = np.ascontiguousarray(a, np.float32)
    f.write(struct.pack(f"<{1 + a.ndim}i", a.ndim, *a.shape))
    f.write(a.tobytes())


def _read_blobs(buf, pos, n):
    out = []
    for _ in range(n):
        ndim, = struct.unpack_from("<i", buf, pos)
        shape = struct.unpack_from(f"<{ndim}i", buf, pos + 4)
        pos += 4 + 4 * ndim
        size = int(np.prod(shape, dtype=np.int64))
        out.append(np.frombuffer(buf, np.float32, size, pos).reshape(shape).copy())
        pos += 4 * size
    return out, pos


def run_case(driver, text, bottoms, propagate_down=None, params=(), top_diffs=()):
    """Runs the fork's layer once; returns (tops, bottom_diffs, params, param_diffs)."""
    propagate_down = [True] * len(bottoms) if propagate_down is None else propagate_down
    with tempfile.TemporaryDirectory() as tmp:
        paths = [os.path.join(tmp, n) for n in ("layer.prototxt", "in.bin", "out.bin")]
        with open(paths[0], "w") as f:
            f.write(text)
        with open(paths[1], "wb") as f:
            f.write(struct.pack("<i", len(bottoms)))
            for b in bottoms:
                _write_blob(f, b)
            f.write(struct.pack(f"<{len(bottoms)}i", *map(int, propagate_down)))
            for group in (params, top_diffs):
                f.write(struct.pack("<i", len(group)))
                for b in group:
                    _write_blob(f, b)
        run = subprocess.run([driver, *paths], capture_output=True, text=True)
        if run.returncode:
            sys.exit(f"{driver} failed on\n{text}\n{run.stderr[-2000:]}")
        buf = open(paths[2], "rb").read()
    n, = struct.unpack_from("<i", buf, 0)
    tops, pos = _read_blobs(buf, 4, n)
    n, = struct.unpack_from("<i", buf, pos)
    bottom_diffs, pos = _read_blobs(buf, pos + 4, n)
    n, = struct.unpack_from("<i", buf, pos)
    both, pos = _read_blobs(buf, pos + 4, 2 * n)
    return tops, bottom_diffs, both[0::2], both[1::2]


def layer_text(name, type_, n_bottoms, n_tops, body):
    bottoms = " ".join(f'bottom: "b{i}"' for i in range(n_bottoms))
    tops = " ".join(f'top: "t{i}"' for i in range(n_tops))
    return f'name: "{name}" type: "{type_}" {bottoms} {tops}\n{body}\n'


def save(out_dir, name, text, bottoms, propagate_down, params, top_diffs, result):
    """param<i>: the blobs the layer ran with (given, or its fillers' when none were given);
    param_after<i>: the blobs after forward and backward, where the layer changed them."""
    tops, bottom_diffs, params_after, param_diffs = result
    arrays = {"prototxt": np.array(text), "propagate_down": np.array(propagate_down, bool)}
    changed = any(not np.array_equal(p, a) for p, a in zip(params, params_after))
    for key, group in (("bottom", bottoms), ("param", params or params_after), ("top_diff", top_diffs),
                       ("top", tops), ("bottom_diff", bottom_diffs), ("param_diff", param_diffs),
                       ("param_after", params_after if changed else ())):
        for i, a in enumerate(group):
            arrays[f"{key}{i}"] = np.asarray(a, np.float32)
    np.savez_compressed(os.path.join(out_dir, f"{name}.npz"), **arrays)


# -- SSD (weiliu89/caffe, branch ssd) ---------------------------------------------------------------
def grid_priors(rng, fmap, img, sizes, clip=True):
    """Prior boxes as a PriorBox top (1, 2, P * 4), clipped to [0, 1] or not, variance 0.1 0.1 0.2 0.2."""
    boxes = []
    for y in range(fmap):
        for x in range(fmap):
            cx, cy = (x + 0.5) / fmap, (y + 0.5) / fmap
            for s in sizes:
                w, h = s * rng.uniform(0.8, 1.25), s * rng.uniform(0.8, 1.25)
                boxes.append([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2])
    boxes = np.clip(np.float32(boxes), 0, 1) if clip else np.float32(boxes)
    var = np.tile(np.float32([0.1, 0.1, 0.2, 0.2]), (len(boxes), 1))
    return np.stack([boxes.reshape(-1), var.reshape(-1)])[None]


def softmax(x, axis=-1):
    e = np.exp(x - x.max(axis, keepdims=True))
    return e / e.sum(axis, keepdims=True)


def ssd_cases(rng_for):
    V = "variance: 0.1 variance: 0.1 variance: 0.2 variance: 0.2"
    # PriorBox: the output depends on the shapes only
    for name, body, fmap, img in [
        ("prior_box_ratios_flip", f"min_size: 10 max_size: 20 aspect_ratio: 2 aspect_ratio: 3 flip: true {V}",
         (1, 4, 3, 3), (1, 3, 30, 30)),
        ("prior_box_clip_step_offset", f"min_size: 7 min_size: 15 max_size: 12 max_size: 24 aspect_ratio: 2 "
         f"flip: false clip: true step: 9 offset: 0.2 variance: 0.1", (2, 4, 4, 3), (2, 3, 27, 33)),
        ("prior_box_img_hw_steps", f"min_size: 6.5 aspect_ratio: 1.5 aspect_ratio: 1 clip: false img_h: 20 "
         f"img_w: 40 step_h: 5 step_w: 8 {V}", (1, 2, 4, 5), (1, 3, 16, 16)),
    ]:
        yield name, layer_text(name, "PriorBox", 2, 1, f"prior_box_param {{ {body} }}"), \
            [np.zeros(fmap), np.zeros(img)], [False, False], (), ()
    # Normalize: forward and backward, scale blob random
    for name, body, shape, scale_shape in [
        ("normalize_across_spatial_shared", "across_spatial: true channel_shared: true", (2, 3, 4, 5), (1,)),
        ("normalize_per_location_channels", "across_spatial: false channel_shared: false eps: 1e-6",
         (2, 4, 3, 3), (4,)),
        ("normalize_per_location_shared", "across_spatial: false channel_shared: true", (1, 5, 2, 3), (1,)),
    ]:
        rng = rng_for(name)
        x = rng.standard_normal(shape)
        yield name, layer_text(name, "Normalize", 1, 1, f"norm_param {{ {body} }}"), [x], [True], \
            [rng.uniform(0.5, 2, scale_shape)], [rng.standard_normal(shape)]
    for name, order, shape in [("permute_nhwc", (0, 2, 3, 1), (2, 3, 4, 5)),
                               ("permute_0312", (0, 3, 1, 2), (2, 3, 4, 5)),
                               ("permute_partial", (1, 0), (2, 3, 2, 2))]:
        rng = rng_for(name)
        x = rng.standard_normal(shape)
        body = "permute_param { " + " ".join(f"order: {a}" for a in order) + " }"
        yield name, layer_text(name, "Permute", 1, 1, body), [x], [True], (), \
            [rng.standard_normal(np.transpose(x, order + tuple(range(len(order), 4))).shape)]
    # DetectionOutput: loc (N, P*4*L), conf (N, P*C) already soft-maxed, priors (1, 2, P*4)
    for name, body, n, classes, share, ties in [
        ("detection_output_center_size", "num_classes: 4 share_location: true background_label_id: 0 "
         "nms_param { nms_threshold: 0.45 top_k: 40 } code_type: CENTER_SIZE keep_top_k: 30 "
         "confidence_threshold: 0.05", 2, 4, True, False),
        ("detection_output_keep_top_k_threshold", "num_classes: 3 share_location: true background_label_id: 0 "
         "nms_param { nms_threshold: 0.3 top_k: 10 } code_type: CENTER_SIZE keep_top_k: 5 "
         "confidence_threshold: 0.3", 2, 3, True, False),
        ("detection_output_corner_variance_in_target", "num_classes: 3 share_location: true "
         "background_label_id: 0 nms_param { nms_threshold: 0.5 } code_type: CORNER "
         "variance_encoded_in_target: true confidence_threshold: 0.1", 1, 3, True, False),
        ("detection_output_unshared_no_background", "num_classes: 3 share_location: false "
         "background_label_id: -1 nms_param { nms_threshold: 0.45 top_k: 20 eta: 0.9 } code_type: CENTER_SIZE "
         "keep_top_k: 12 confidence_threshold: 0.2", 2, 3, False, False),
        ("detection_output_score_ties", "num_classes: 2 share_location: true background_label_id: 0 "
         "nms_param { nms_threshold: 0.45 top_k: 16 } code_type: CENTER_SIZE keep_top_k: 8 "
         "confidence_threshold: 0.1", 2, 2, True, True),
        ("detection_output_corner_size_unshared", "num_classes: 3 share_location: false background_label_id: 0 "
         "nms_param { nms_threshold: 0.5 top_k: 8 } code_type: CORNER_SIZE keep_top_k: 10 "
         "confidence_threshold: 0.15", 2, 3, False, False),
        ("detection_output_nothing_found", "num_classes: 3 share_location: true background_label_id: 0 "
         "nms_param { nms_threshold: 0.45 } code_type: CENTER_SIZE confidence_threshold: 0.99", 2, 3, True, False),
    ]:
        rng = rng_for(name)
        priors = grid_priors(rng, 3, 1, (0.3, 0.55))
        p = priors.shape[2] // 4
        loc = rng.standard_normal((n, p * 4 * (1 if share else classes))) * 0.5
        if ties:
            conf = np.round(rng.uniform(0, 1, (n, p, classes)) * 4) / 4
        else:
            conf = softmax(rng.standard_normal((n, p, classes)) * 2)
        yield name, layer_text(name, "DetectionOutput", 3, 1, f"detection_output_param {{ {body} }}"), \
            [loc, conf.reshape(n, -1), priors], [False] * 3, (), ()
    # MultiBoxLoss: loss and the gradients of loc and conf; ground truth rows
    # [item, label, instance, xmin, ymin, xmax, ymax, difficult]
    for name, body, loss_body, classes, gts, clip in [
        ("multibox_loss_default", "num_classes: 3 overlap_threshold: 0.5 neg_pos_ratio: 3 neg_overlap: 0.5",
         "", 3, [[0, 1, 0, .1, .1, .45, .5, 0], [0, 2, 1, .5, .4, .95, .9, 0], [1, 1, 0, .2, .3, .7, .8, 0]],
         True),
        ("multibox_loss_difficult_bipartite_batch_norm",
         "num_classes: 4 overlap_threshold: 0.5 neg_pos_ratio: 2 use_difficult_gt: false match_type: BIPARTITE",
         "loss_param { normalization: BATCH_SIZE }", 4,
         [[0, 3, 0, .05, .05, .4, .45, 1], [0, 2, 1, .3, .3, .8, .7, 0], [1, 1, 0, .6, .1, .95, .6, 0],
          [1, 3, 1, .1, .5, .5, .95, 0]], True),
        ("multibox_loss_corner_no_mining_loc_weight",
         "num_classes: 3 overlap_threshold: 0.4 code_type: CORNER mining_type: NONE loc_weight: 2.5",
         "loss_param { normalization: FULL }", 3, [[0, 1, 0, .2, .2, .6, .7, 0], [1, 2, 0, .4, .1, .9, .5, 0]],
         True),
        ("multibox_loss_ssd_train_center_size",     # the settings of SSD's published training nets
         "loc_loss_type: SMOOTH_L1 conf_loss_type: SOFTMAX loc_weight: 1.0 num_classes: 4 share_location: true "
         "match_type: PER_PREDICTION overlap_threshold: 0.5 use_prior_for_matching: true background_label_id: 0 "
         "use_difficult_gt: true neg_pos_ratio: 3.0 neg_overlap: 0.5 code_type: CENTER_SIZE "
         "ignore_cross_boundary_bbox: false mining_type: MAX_NEGATIVE",
         "loss_param { normalization: VALID }", 4,
         [[0, 1, 0, .1, .1, .45, .5, 0], [0, 3, 1, .5, .4, .95, .9, 0], [0, 2, 2, .3, .0, .6, .35, 0],
          [1, 2, 0, .2, .3, .7, .8, 0]], True),
        ("multibox_loss_l2_background_2_cross_boundary",
         "loc_loss_type: L2 num_classes: 4 background_label_id: 2 code_type: CENTER_SIZE neg_pos_ratio: 1.5 "
         "ignore_cross_boundary_bbox: true overlap_threshold: 0.45",
         "loss_param { normalization: NONE }", 4,
         [[0, 1, 0, .0, .05, .5, .6, 0], [0, 3, 1, .5, .4, 1.0, .95, 0], [1, 0, 0, .25, .2, .75, .85, 0]], False),
    ]:
        rng = rng_for(name)
        priors = grid_priors(rng, 3, 1, (0.3, 0.55), clip)
        p = priors.shape[2] // 4
        n = 2
        loc = rng.standard_normal((n, p * 4)) * 0.3
        conf = rng.standard_normal((n, p * classes))
        label = np.float32(gts)[None, None]
        yield name, layer_text(name, "MultiBoxLoss", 4, 1, f"multibox_loss_param {{ {body} }} {loss_body}"), \
            [loc, conf, priors, label], [True, True, False, False], (), ()
    # SmoothL1Loss as MultiBoxLoss uses it: two bottoms, sum over the batch size
    name = "smooth_l1_loss_two_bottoms"
    rng = rng_for(name)
    pred = rng.standard_normal((3, 8)) * 1.5
    yield name, layer_text(name, "SmoothL1Loss", 2, 1, "loss_weight: 0.7"), \
        [pred, pred + rng.standard_normal((3, 8))], [True, True], (), ()


# -- Faster R-CNN (rbgirshick/caffe-fast-rcnn, branch faster-rcnn) --------------------------------
def faster_rcnn_cases(rng_for):
    # The fork's CPU code has ROIPooling's forward only (its backward and SmoothL1Loss are GPU-only).
    for name, body, data_shape, rois, negative in [
        ("roi_pooling_scale_1_16", "pooled_h: 3 pooled_w: 3 spatial_scale: 0.0625", (2, 3, 8, 10),
         [[0, 0, 0, 159, 127], [1, 16, 20, 100, 90], [0, 40, 8, 72, 60], [1, 150, 100, 200, 140]], False),
        ("roi_pooling_outside_tiny_halves", "pooled_h: 2 pooled_w: 4 spatial_scale: 0.5", (1, 2, 7, 9),
         [[0, -6, -4, 5, 5], [0, 3, 3, 3, 3], [0, 9, 1, 5, 11], [0, 5, 7, 25, 17], [0, 1, 1, 2.9, 13.1]],
         False),
        ("roi_pooling_negative_values_empty_bins", "pooled_h: 4 pooled_w: 3 spatial_scale: 1", (1, 3, 5, 6),
         [[0, 1, 1, 2, 2], [0, 0, 0, 5, 4], [0, 4, 3, 30, 30]], True),
    ]:
        rng = rng_for(name)
        x = rng.standard_normal(data_shape)
        if negative:
            x = -np.abs(x) - 1
        yield name, layer_text(name, "ROIPooling", 2, 1, f"roi_pooling_param {{ {body} }}"), \
            [x, np.float32(rois)], [False, False], (), ()


# -- SegNet (alexgkendall/caffe-segnet) ---------------------------------------------------------------
def max_pool_mask(x, k, s):
    """A max pooling (ceil-rounded, windows clipped at the border) and the flat index in the input
    plane of each maximum: the mask top SegNet's Pooling gives its Upsample."""
    n, c, h, w = x.shape
    ph, pw = -(-(h - k) // s) + 1, -(-(w - k) // s) + 1
    out, mask = np.zeros((n, c, ph, pw)), np.zeros((n, c, ph, pw))
    for i in range(ph):
        for j in range(pw):
            win = x[:, :, i * s:min(i * s + k, h), j * s:min(j * s + k, w)]
            flat = win.reshape(n, c, -1)
            a = flat.argmax(-1)
            ww = win.shape[3]
            out[:, :, i, j] = flat.max(-1)
            mask[:, :, i, j] = (i * s + a // ww) * w + j * s + a % ww
    return out, mask


def segnet_cases(rng_for):
    for name, body, image, backward in [
        ("upsample_scale_2", "scale: 2", (2, 3, 6, 8), True),
        ("upsample_pad_out_h", "scale: 2 pad_out_h: true", (1, 2, 5, 8), True),
        ("upsample_h_w", "upsample_h: 7 upsample_w: 9", (1, 2, 7, 9), False),
    ]:
        rng = rng_for(name)
        pooled, mask = max_pool_mask(rng.standard_normal(image), 2, 2)
        top_shape = image   # the pooled input maps back onto the image it came from
        yield name, layer_text(name, "Upsample", 2, 1, f"upsample_param {{ {body} }}"), \
            [pooled, mask], [True, False], (), [rng.standard_normal(top_shape)] if backward else ()
    # BN: blobs scale and shift (1, C, 1, 1)
    for name, body, shape, tops, backward in [
        ("bn_learn", "bn_mode: LEARN", (3, 4, 3, 2), 1, True),
        ("bn_learn_mean_variance_tops", "bn_mode: LEARN", (2, 3, 2, 2), 3, False),
        ("bn_inference", "bn_mode: INFERENCE", (2, 3, 2, 3), 1, True),
    ]:
        rng = rng_for(name)
        x = rng.standard_normal(shape) * 2 + 0.5
        c = (1, shape[1], 1, 1)
        yield name, layer_text(name, "BN", 1, tops, f"bn_param {{ {body} }}"), [x], [True], \
            [rng.uniform(0.5, 1.5, c), rng.standard_normal(c)], [rng.standard_normal(shape)] if backward else ()


# -- PSPNet (hszhao/PSPNet) -----------------------------------------------------------------------------
def pspnet_cases(rng_for):
    # BN: blobs slope, bias, running mean, running variance (1, C, 1, 1)
    for name, head, body, shape in [
        ("bn_train_running_stats", "", "momentum: 0.8 eps: 1e-4", (3, 4, 2, 3)),
        ("bn_test_phase", "phase: TEST", "eps: 1e-5", (2, 3, 3, 2)),
        ("bn_frozen", "", "frozen: true", (2, 3, 2, 2)),
    ]:
        rng = rng_for(name)
        x = rng.standard_normal(shape) * 1.5 - 0.3
        c = (1, shape[1], 1, 1)
        params = [rng.uniform(0.5, 1.5, c), rng.standard_normal(c), rng.standard_normal(c) * 0.3,
                  rng.uniform(0.5, 2, c)]
        yield name, layer_text(name, "BN", 1, 1, f"{head} bn_param {{ {body} }}"), [x], [True], params, \
            [rng.standard_normal(shape)]
    for name, body, shape, out in [
        ("interp_zoom", "zoom_factor: 2", (2, 3, 4, 5), (7, 9)),
        ("interp_shrink", "shrink_factor: 2", (1, 2, 7, 9), (4, 5)),
        ("interp_size_pad", "height: 6 width: 11 pad_beg: -1 pad_end: -1", (1, 2, 6, 7), (6, 11)),
        ("interp_shrink_zoom", "shrink_factor: 3 zoom_factor: 4", (1, 2, 10, 7), (13, 9)),
    ]:
        rng = rng_for(name)
        yield name, layer_text(name, "Interp", 1, 1, f"interp_param {{ {body} }}"), \
            [rng.standard_normal(shape)], [True], (), [rng.standard_normal(shape[:2] + out)]


# -- SENet (hujie-frank/SENet's Axpy, in BVLC Caffe) ------------------------------------------------------
def senet_cases(rng_for):
    for name, a_shape, shape, prop in [
        ("axpy_4d_scale", (2, 3, 1, 1), (2, 3, 4, 5), [True, True, True]),
        ("axpy_2d_scale", (2, 4), (2, 4, 3, 3), [True, True, True]),
        ("axpy_scale_and_y_only", (1, 3, 1, 1), (1, 3, 2, 2), [True, False, True]),
    ]:
        rng = rng_for(name)
        yield name, layer_text(name, "Axpy", 3, 1, ""), \
            [rng.standard_normal(a_shape), rng.standard_normal(shape), rng.standard_normal(shape)], prop, (), \
            [rng.standard_normal(shape)]


FORKS = {"ssd": ssd_cases, "faster_rcnn": faster_rcnn_cases, "segnet": segnet_cases, "pspnet": pspnet_cases,
         "senet": senet_cases}


def main(fork, driver, out_dir):
    os.makedirs(out_dir, exist_ok=True)

    def rng_for(name):
        return np.random.default_rng(zlib.crc32(name.encode()))

    for name, text, bottoms, prop, params, top_diffs in FORKS[fork](rng_for):
        bottoms = [np.float32(b) for b in bottoms]
        params = [np.float32(b) for b in params]
        top_diffs = [np.float32(b) for b in top_diffs]
        result = run_case(driver, text, bottoms, prop, params, top_diffs)
        save(out_dir, name, text, bottoms, prop, params, top_diffs, result)
        print(name, [t.shape for t in result[0]])


if __name__ == "__main__":
    main(*sys.argv[1:])
