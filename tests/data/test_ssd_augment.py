"""SSD's augmentations (sncaffe/data/ssd_augment.py): sampled crops meet their constraints, boxes
follow expansion and crops."""
import numpy as np
import pytest

from sncaffe.data import ssd_augment
from sncaffe.proto import sncaffe_pb2 as pb
from sncaffe.prototxt import parse_text

ROWS = np.array([[1, 0, 0.1, 0.2, 0.4, 0.6, 0], [2, 0, 0.5, 0.5, 0.9, 0.8, 1]])


def sampler(text):
    return parse_text(text, pb.BatchSampler())


@pytest.mark.parametrize("lo", [0.1, 0.5, 0.7])
def test_sampled_boxes_meet_the_jaccard_constraint(lo):
    s = sampler(f"sampler {{ min_scale: 0.3 max_scale: 1 min_aspect_ratio: 0.5 max_aspect_ratio: 2 }} "
                f"sample_constraint {{ min_jaccard_overlap: {lo} }}")
    rng = np.random.default_rng(0)
    hits = 0
    for _ in range(300):
        box = ssd_augment.sample_box(s.sampler, rng)
        w, h = box[2] - box[0], box[3] - box[1]
        assert 0 <= box[0] and box[2] <= 1 + 1e-9 and 0 <= box[1] and box[3] <= 1 + 1e-9
        assert 0.3 ** 2 - 1e-9 <= w * h <= 1 + 1e-9 and 0.5 - 1e-6 <= w / h <= 2 + 1e-6
        ok = ssd_augment.satisfies(box, ROWS[:, 2:6], s.sample_constraint)
        assert ok == bool((ssd_augment.jaccard(box[None], ROWS[:, 2:6]) >= lo).any())
        hits += ok
    assert 0 < hits < 300


def test_project_clips_drops_and_keeps_centres():
    emit = parse_text("emit_type: CENTER", pb.EmitConstraint())
    crop = [0.0, 0.0, 0.5, 0.5]
    out = ssd_augment.project(ROWS, crop, emit)
    # Box 1 (centre 0.25, 0.4) stays, in crop coordinates; box 2's centre (0.7, 0.65) is outside.
    np.testing.assert_allclose(out, [[1, 0, 0.2, 0.4, 0.8, 1.0, 0]])
    out = ssd_augment.project(ROWS, crop)                   # without it box 2 would need to overlap
    assert len(out) == 1                                     # the crop: it only touches its corner
    out = ssd_augment.project(ROWS, [0.0, 0.0, 0.6, 0.6])
    np.testing.assert_allclose(out[1], [2, 0, 0.5 / 0.6, 0.5 / 0.6, 1, 1, 1])   # clipped, kept


def test_expand_and_crop_move_boxes_with_pixels():
    rng = np.random.default_rng(3)
    x = np.zeros((3, 40, 50), np.uint8)
    x[:, 8:24, 5:20] = 255                                   # box 1 in pixels: (5, 8) - (20, 24)
    rows = np.array([[1, 0, 5 / 50, 8 / 40, 20 / 50, 24 / 40, 0]])
    p = parse_text("prob: 1 max_expand_ratio: 3", pb.ExpansionParameter())
    s = sampler("sampler { min_scale: 0.5 max_scale: 1 } sample_constraint { min_object_coverage: 1 } max_trials: 50")
    canvas = 0
    for _ in range(10):
        y, r = ssd_augment.expand(x, rows, p, [7], rng)
        y, r = ssd_augment.sample_crop(y, r, [s], rng)
        (_, _, x0, y0, x1, y1, _), = r
        h, w = y.shape[1:]
        # The fork crops whole pixels but projects boxes exactly: within a pixel of the object.
        top, left, bottom, right = y0 * h, x0 * w, y1 * h, x1 * w
        inside = y[:, int(np.ceil(top)) + 1:int(bottom) - 1, int(np.ceil(left)) + 1:int(right) - 1]
        assert inside.size and (inside == 255).all()
        ys, xs = np.nonzero(y[0] == 255)
        assert top - 1 <= ys.min() and ys.max() < bottom + 1 and left - 1 <= xs.min() and xs.max() < right + 1
        assert len(ys) == 15 * 16                             # the whole object (object coverage 1)
        canvas += (y == 7).any()                              # the mean's canvas around it
    assert canvas > 0
