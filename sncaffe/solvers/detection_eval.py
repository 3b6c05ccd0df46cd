"""SSD's detection scoring of test nets (solver ``eval_type: "detection"``): mean average precision
over the test iterations, from DetectionEvaluate's rows [image, label, score, tp, fp] and its
per-class rows [-1, label, boxes, -1, -1] (the fork's Solver::TestDetection and ComputeAP)."""
from __future__ import annotations

from collections import defaultdict

import numpy as np

AP_VERSIONS = ("11point", "MaxIntegral", "Integral")


def average_precision(scores, tp, num_pos, version="Integral") -> float:
    """ComputeAP: AP of detections (score, tp 0/1; the others are false positives) against
    ``num_pos`` boxes. 11point is VOC2007's, MaxIntegral VOC2012's, Integral the plain sum."""
    if len(scores) == 0 or num_pos == 0:
        return 0.0
    order = np.argsort(-np.asarray(scores, np.float32), kind="stable")
    hit = np.asarray(tp, np.int64)[order]
    tp_cum, fp_cum = np.cumsum(hit), np.cumsum(1 - hit)
    prec = (tp_cum / (tp_cum + fp_cum)).astype(np.float32)
    rec = (tp_cum / num_pos).astype(np.float32)
    eps = 1e-6
    if version == "11point":                       # the fork's sweep, as written
        best, start = [np.float32(0)] * 11, len(rec) - 1
        for j in range(10, -1, -1):
            for i in range(start, -1, -1):
                if rec[i] < j / 10:
                    start = i
                    if j > 0:
                        best[j - 1] = best[j]
                    break
                best[j] = max(best[j], prec[i])
        ap = np.float32(0)
        for j in range(10, -1, -1):
            ap += best[j] / np.float32(11)
        return float(ap)
    if version == "MaxIntegral":
        ap, cur_rec, cur_prec = 0.0, float(rec[-1]), float(prec[-1])
        for i in range(len(rec) - 2, -1, -1):
            cur_prec = max(float(prec[i]), cur_prec)
            if abs(cur_rec - rec[i]) > eps:
                ap += cur_prec * abs(cur_rec - rec[i])
            cur_rec = float(rec[i])
        return ap + cur_rec * cur_prec
    ap, prev = 0.0, 0.0
    for p, r in zip(prec, rec):
        if abs(r - prev) > eps:
            ap += float(p) * abs(r - prev)
        prev = float(r)
    return ap


class DetectionScores:
    """Accumulates one output's rows over the test iterations."""

    def __init__(self):
        self.num_pos = defaultdict(int)
        self.found = defaultdict(list)      # label -> [(score, tp)]

    def add(self, rows) -> None:
        rows = np.asarray(rows, np.float64).reshape(-1, 5)
        for item, label, score, tp, fp in rows:
            if int(item) == -1:
                self.num_pos[int(label)] += int(score)
            elif int(tp) or int(fp):                    # neither: a difficult box, left out
                self.found[int(label)].append((np.float32(score), int(tp)))

    def mean_ap(self, version="Integral") -> tuple[float, dict]:
        """(mAP over the classes that have boxes, AP per class); a class never detected counts 0."""
        aps = {}
        for label, n in sorted(self.num_pos.items()):
            pairs = self.found.get(label, [])
            aps[label] = average_precision([s for s, _ in pairs], [t for _, t in pairs], n, version)
        return (sum(aps.values()) / len(aps) if aps else 0.0), aps
