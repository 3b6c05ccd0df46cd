"""A region proposal layer for Faster R-CNN's test nets, written for sncaffe's tests from the
method's description (Ren et al., 2015, section 3.1): the module and class names are the ones
py-faster-rcnn's prototxt files name (``rpn.proposal_layer.ProposalLayer``).

bottom[0]: objectness, (1, 2A, H, W), the A background scores then the A foreground scores;
bottom[1]: box deltas, (1, 4A, H, W); bottom[2]: im_info, (1, 3): height, width, scale.
top[0]: rois, (R, 5): batch index 0, x1, y1, x2, y2 in image pixels; R changes per image, so
the top is reshaped in forward. An optional top[1] gets the scores, (R, 1).

param_str: a dict's items, as in the published prototxt ("'feat_stride': 16"); also
pre_nms_top_n, post_nms_top_n, nms_thresh, min_size (test-time defaults below) and scales.
"""
import ast

import numpy as np

try:
    import caffe
except ImportError:             # sncaffe's pycaffe under its own name
    import sncaffe.pycaffe as caffe

DEFAULTS = {"feat_stride": 16, "scales": (8, 16, 32), "ratios": (0.5, 1, 2), "base_size": 16,
            "pre_nms_top_n": 6000, "post_nms_top_n": 300, "nms_thresh": 0.7, "min_size": 16}


def anchors(base_size, ratios, scales):
    """Boxes (x1, y1, x2, y2) centred on the first cell: for each aspect ratio h/w, a box of the
    cell's area, then that box scaled by each scale."""
    centre = (base_size - 1) / 2.0
    out = []
    for r in ratios:
        w = np.round(np.sqrt(base_size * base_size / r))
        h = np.round(w * r)
        for s in scales:
            half_w, half_h = (w * s - 1) / 2.0, (h * s - 1) / 2.0
            out.append((centre - half_w, centre - half_h, centre + half_w, centre + half_h))
    return np.array(out)


def apply_deltas(boxes, deltas):
    """Shift each box's centre by (dx, dy) of its size and scale its size by exp(dw), exp(dh)."""
    w = boxes[:, 2] - boxes[:, 0] + 1.0
    h = boxes[:, 3] - boxes[:, 1] + 1.0
    cx, cy = boxes[:, 0] + 0.5 * (w - 1), boxes[:, 1] + 0.5 * (h - 1)
    cx, cy = cx + deltas[:, 0] * w, cy + deltas[:, 1] * h
    limit = np.log(1000.0 / 16)            # no box beyond the largest image from a cell's anchor
    w, h = w * np.exp(np.minimum(deltas[:, 2], limit)), h * np.exp(np.minimum(deltas[:, 3], limit))
    return np.stack([cx - 0.5 * (w - 1), cy - 0.5 * (h - 1), cx + 0.5 * (w - 1), cy + 0.5 * (h - 1)], axis=1)


def nms(boxes, scores, thresh):
    """Greedy non-maximum suppression: indices kept, best score first."""
    area = (boxes[:, 2] - boxes[:, 0] + 1) * (boxes[:, 3] - boxes[:, 1] + 1)
    order = np.argsort(-scores, kind="stable")
    keep = []
    while order.size:
        i, rest = order[0], order[1:]
        keep.append(i)
        iw = np.minimum(boxes[i, 2], boxes[rest, 2]) - np.maximum(boxes[i, 0], boxes[rest, 0]) + 1
        ih = np.minimum(boxes[i, 3], boxes[rest, 3]) - np.maximum(boxes[i, 1], boxes[rest, 1]) + 1
        inter = np.maximum(iw, 0) * np.maximum(ih, 0)
        order = rest[inter / (area[i] + area[rest] - inter) <= thresh]
    return np.array(keep, dtype=np.int64)


def propose(scores, deltas, im_info, p, cell_anchors):
    """(rois (R, 5), scores (R,)) of one image."""
    A = len(cell_anchors)
    H, W = scores.shape[-2:]
    fg = scores[0, A:].transpose(1, 2, 0).reshape(-1)                  # (H, W, A) order
    d = deltas[0].reshape(A, 4, H, W).transpose(2, 3, 0, 1).reshape(-1, 4)
    ys, xs = np.meshgrid(np.arange(H) * p["feat_stride"], np.arange(W) * p["feat_stride"], indexing="ij")
    shifts = np.stack([xs, ys, xs, ys], axis=-1).reshape(-1, 1, 4)
    boxes = apply_deltas((shifts + cell_anchors[None]).reshape(-1, 4), d)
    height, width, scale = im_info[0, :3]
    boxes[:, 0::2] = np.clip(boxes[:, 0::2], 0, width - 1)
    boxes[:, 1::2] = np.clip(boxes[:, 1::2], 0, height - 1)
    big = p["min_size"] * scale
    kept = np.flatnonzero((boxes[:, 2] - boxes[:, 0] + 1 >= big) & (boxes[:, 3] - boxes[:, 1] + 1 >= big))
    kept = kept[np.argsort(-fg[kept], kind="stable")][:p["pre_nms_top_n"]]
    boxes, fg = boxes[kept], fg[kept]
    keep = nms(boxes, fg, p["nms_thresh"])[:p["post_nms_top_n"]]
    rois = np.hstack([np.zeros((len(keep), 1)), boxes[keep]])
    return rois.astype(np.float32), fg[keep].astype(np.float32)


class ProposalLayer(caffe.Layer):
    def setup(self, bottom, top):
        given = ast.literal_eval("{%s}" % (self.param_str or ""))
        unknown = set(given) - set(DEFAULTS)
        if unknown:
            raise ValueError(f"unknown proposal settings {sorted(unknown)}")
        self.p = {**DEFAULTS, **given}
        self.cell_anchors = anchors(self.p["base_size"], self.p["ratios"], self.p["scales"])
        if bottom[0].data.shape[0] != 1:
            raise ValueError("one image at a time")
        top[0].reshape(1, 5)
        if len(top) > 1:
            top[1].reshape(1, 1)

    def reshape(self, bottom, top):
        pass            # the number of proposals is known in forward

    def forward(self, bottom, top):
        rois, scores = propose(bottom[0].data, bottom[1].data, bottom[2].data, self.p, self.cell_anchors)
        top[0].reshape(*rois.shape)
        top[0].data[...] = rois
        if len(top) > 1:
            top[1].reshape(len(scores), 1)
            top[1].data[...] = scores[:, None]

    def backward(self, top, propagate_down, bottom):
        pass
