"""SSD's data augmentation (weiliu89/caffe): photometric distortion, expansion onto a larger canvas,
and random crops that keep enough of the objects (batch_sampler), with the boxes following.

Images are (C, H, W) arrays in OpenCV's BGR order; box rows are [label, instance_id, xmin, ymin,
xmax, ymax, difficult] normalised to the image. Random draws come from a NumPy Generator, in the
fork's order, so a run is repeatable (not bit-identical to Caffe's own random stream).
"""
from __future__ import annotations

import math

import numpy as np

from ..proto import sncaffe_pb2 as pb
from . import image

UNIT = np.array([0.0, 0.0, 1.0, 1.0])


def _size(b):
    w, h = b[..., 2] - b[..., 0], b[..., 3] - b[..., 1]
    return np.where((w < 0) | (h < 0), 0, w * h)


def _intersection(a, b):
    """IntersectBBox's size: 0 for boxes apart."""
    lo, hi = np.maximum(a[..., :2], b[..., :2]), np.minimum(a[..., 2:], b[..., 2:])
    apart = (b[..., 0] > a[..., 2]) | (b[..., 2] < a[..., 0]) | (b[..., 1] > a[..., 3]) | (b[..., 3] < a[..., 1])
    return np.where(apart, 0, _size(np.concatenate([lo, hi], -1)))


def coverage(a, b):
    """BBoxCoverage: the share of box ``a`` inside box ``b``."""
    size = _size(a)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(size > 0, _intersection(a, b) / np.where(size > 0, size, 1), 0)


def jaccard(a, b):
    inter = _intersection(a, b)
    union = _size(a) + _size(b) - inter
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(inter > 0, inter / np.where(union > 0, union, 1), 0)


def project(rows, src, emit=None):
    """TransformAnnotation: the boxes that meet the emit constraint (against ``src``, None: none) and
    overlap ``src``, in coordinates of ``src``, clipped to it; empty boxes dropped."""
    b, src = rows[:, 2:6], np.asarray(src, np.float64)
    keep = np.ones(len(rows), bool)
    if emit is not None:
        if emit.emit_type == pb.EmitConstraint.CENTER:
            cx, cy = (b[:, 0] + b[:, 2]) / 2, (b[:, 1] + b[:, 3]) / 2
            keep &= (cx >= src[0]) & (cx <= src[2]) & (cy >= src[1]) & (cy <= src[3])
        else:
            keep &= coverage(b, src) > emit.emit_overlap
    keep &= ~((b[:, 0] >= src[2]) | (b[:, 2] <= src[0]) | (b[:, 1] >= src[3]) | (b[:, 3] <= src[1]))
    out = rows[keep].copy()
    span = np.tile(src[2:] - src[:2], 2)
    out[:, 2:6] = np.clip((out[:, 2:6] - np.tile(src[:2], 2)) / span, 0, 1)
    return out[_size(out[:, 2:6]) > 0]


# -- photometric distortion (im_transforms.cpp's ApplyDistort) --------------------------------------
def _convert(a, alpha, beta):
    """cv::Mat::convertTo on uint8: a * alpha + beta, rounded and saturated."""
    return np.clip(np.rint(a.astype(np.float32) * np.float32(alpha) + np.float32(beta)), 0, 255).astype(np.uint8)


def _hsv(hwc, channel, alpha, beta):
    cv2 = image._cv2()
    hsv = cv2.cvtColor(hwc, cv2.COLOR_BGR2HSV)
    hsv[:, :, channel] = _convert(hsv[:, :, channel], alpha, beta)
    return cv2.cvtColor(hsv, cv2.COLOR_HSV2BGR)


def distort(x, p, rng):
    """Random brightness, contrast, saturation and hue (contrast first or last, by a coin), then a
    random channel order; each with its probability."""
    if x.dtype != np.uint8 or x.shape[0] != 3:
        raise ValueError("distort_param needs 3-channel 8-bit images")
    img = np.ascontiguousarray(x.transpose(1, 2, 0))

    def brightness(img):
        if rng.uniform() < p.brightness_prob:
            delta = rng.uniform(-p.brightness_delta, p.brightness_delta)
            return _convert(img, 1, delta) if abs(delta) > 0 else img
        return img

    def contrast(img):
        if rng.uniform() < p.contrast_prob:
            delta = rng.uniform(p.contrast_lower, p.contrast_upper)
            return _convert(img, delta, 0) if abs(delta - 1) > 1e-3 else img
        return img

    def saturation(img):
        if rng.uniform() < p.saturation_prob:
            return _hsv(img, 1, rng.uniform(p.saturation_lower, p.saturation_upper), 0)
        return img

    def hue(img):
        if rng.uniform() < p.hue_prob:
            delta = rng.uniform(-p.hue_delta, p.hue_delta)
            return _hsv(img, 0, 1, delta) if abs(delta) > 0 else img
        return img

    steps = (brightness, contrast, saturation, hue) if rng.uniform() > 0.5 else (brightness, saturation, hue, contrast)
    for step in steps:
        img = step(img)
    if rng.uniform() < p.random_order_prob:
        img = img[:, :, rng.permutation(3)]
    return np.ascontiguousarray(img.transpose(2, 0, 1))


def check_distort(p):
    for lo, hi, what in ((p.contrast_lower, p.contrast_upper, "contrast"),
                         (p.saturation_lower, p.saturation_upper, "saturation")):
        if hi < lo or lo < 0:
            raise ValueError(f"distort_param: {what}_lower must be in [0, {what}_upper]")
    if p.brightness_delta < 0 or p.hue_delta < 0:
        raise ValueError("distort_param: brightness_delta and hue_delta must be non-negative")
    if (p.saturation_prob > 0 or p.hue_prob > 0) and image._cv2() is None:
        raise ValueError("distort_param's saturation and hue need OpenCV (pip install opencv-python-headless)")


# -- expansion (ExpandImage) -------------------------------------------------------------------------
def expand(x, rows, p, fill, rng, emit=None):
    """With probability ``prob``, put the image at a random place on a canvas up to
    max_expand_ratio times larger, filled with ``fill`` (the mean values, or 0)."""
    if rng.uniform() > p.prob or abs(p.max_expand_ratio - 1) < 1e-2:
        return x, rows
    ratio = rng.uniform(1, p.max_expand_ratio)
    c, h, w = x.shape
    eh, ew = int(h * ratio), int(w * ratio)
    h_off, w_off = math.floor(rng.uniform(0, eh - h)), math.floor(rng.uniform(0, ew - w))
    canvas = np.empty((c, eh, ew), x.dtype)
    canvas[...] = np.asarray(fill, np.float64).reshape(-1, 1, 1).round().clip(0, 255) if x.dtype == np.uint8 \
        else np.asarray(fill).reshape(-1, 1, 1)
    canvas[:, h_off:h_off + h, w_off:w_off + w] = x
    src = [-w_off / w, -h_off / h, (ew - w_off) / w, (eh - h_off) / h]
    return canvas, project(rows, src, emit)


# -- random crops (sampler.cpp) ----------------------------------------------------------------------
def check_sampler(s):
    m = s.sampler
    if not (0 < m.min_scale <= m.max_scale <= 1):
        raise ValueError(f"batch_sampler: need 0 < min_scale <= max_scale <= 1, got {m.min_scale:g}, {m.max_scale:g}")
    if not (0 < m.min_aspect_ratio <= m.max_aspect_ratio):
        raise ValueError("batch_sampler: need 0 < min_aspect_ratio <= max_aspect_ratio")


def sample_box(s, rng):
    """SampleBBox: a box of a random scale and aspect ratio at a random place inside the image."""
    scale = rng.uniform(s.min_scale, s.max_scale)
    ratio = rng.uniform(s.min_aspect_ratio, s.max_aspect_ratio)
    ratio = min(max(ratio, scale ** 2), 1 / scale ** 2)
    w, h = scale * math.sqrt(ratio), scale / math.sqrt(ratio)
    x0, y0 = rng.uniform(0, max(1 - w, 0)), rng.uniform(0, max(1 - h, 0))     # w, h <= 1 but for rounding
    return np.array([x0, y0, x0 + w, y0 + h])


def satisfies(box, objects, c) -> bool:
    """SatisfySampleConstraint, as the fork evaluates it object by object."""
    kinds = [(c.HasField("min_jaccard_overlap") or c.HasField("max_jaccard_overlap"),
              lambda o: jaccard(box, o), "jaccard_overlap"),
             (c.HasField("min_sample_coverage") or c.HasField("max_sample_coverage"),
              lambda o: coverage(box, o), "sample_coverage"),
             (c.HasField("min_object_coverage") or c.HasField("max_object_coverage"),
              lambda o: coverage(o, box), "object_coverage")]
    if not any(k[0] for k in kinds):
        return True
    found = False
    for o in objects:
        passed = True
        for used, value, name in kinds:
            if not used:
                continue
            v = float(value(o))
            if (c.HasField("min_" + name) and v < getattr(c, "min_" + name)) or \
                    (c.HasField("max_" + name) and v > getattr(c, "max_" + name)):
                passed = False
                break
            found = True                # the fork's flag, set by any kind that passed
        if found and passed:
            return True
    return found


def sample_crop(x, rows, samplers, rng, emit=None):
    """GenerateBatchSamples, then a crop to one of the boxes found (the image as it is if none)."""
    found = []
    for s in samplers:
        if not s.use_original_image:
            continue
        n = 0
        for _ in range(s.max_trials):
            if s.HasField("max_sample") and n >= s.max_sample:
                break
            box = sample_box(s.sampler, rng)
            if satisfies(box, rows[:, 2:6], s.sample_constraint):
                n += 1
                found.append(box)
    if not found:
        return x, rows
    box = np.clip(found[int(rng.integers(len(found)))], 0, 1)
    _, h, w = x.shape
    px = box * np.array([w, h, w, h])
    x0, y0 = int(px[0]), int(px[1])
    cw, ch = int(px[2] - px[0]), int(px[3] - px[1])
    return x[:, y0:y0 + ch, x0:x0 + cw], project(rows, box, emit)
