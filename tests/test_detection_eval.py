"""SSD's mean average precision for test nets (sncaffe/solvers/detection_eval.py), by hand."""
import numpy as np
import pytest

from sncaffe.solvers.detection_eval import DetectionScores, average_precision


@pytest.mark.parametrize("version,want", [("Integral", 1 / 3 + 2 / 9), ("MaxIntegral", 1 / 3 + 2 / 9),
                                          ("11point", (4 + 3 * 2 / 3) / 11)])
def test_average_precision_by_hand(version, want):
    # Ranked tp, fp, tp against 3 boxes: precision 1, 1/2, 2/3 at recall 1/3, 1/3, 2/3.
    assert average_precision([0.7, 0.9, 0.8], [1, 1, 0], 3, version) == pytest.approx(want, rel=1e-6)


def test_a_false_positive_ranked_first():
    # fp, tp against 1 box: precision 0 then 1/2 at recall 0 then 1. Integral: 1/2; VOC2012
    # interpolated curve: 1/2 as well; 11point: 1/2 at every recall level.
    for version in ("Integral", "MaxIntegral", "11point"):
        assert average_precision([0.9, 0.5], [0, 1], 1, version) == pytest.approx(0.5, rel=1e-6)


def test_scores_from_detection_evaluate_rows():
    s = DetectionScores()
    # Two test batches: class 1 has 2 boxes, class 2 one box; a difficult match (0, 0) is left out.
    s.add([[-1, 1, 1, -1, -1], [-1, 2, 1, -1, -1], [0, 1, 0.9, 1, 0], [0, 1, 0.5, 0, 0], [0, 2, 0.4, 0, 1]])
    s.add(np.array([[-1, 1, 1, -1, -1], [-1, 2, 0, -1, -1], [1, 1, 0.8, 1, 0]]))
    mean, per_class = s.mean_ap("Integral")
    assert per_class == {1: pytest.approx(1.0), 2: 0.0}
    assert mean == pytest.approx(0.5)
    assert DetectionScores().mean_ap() == (0.0, {})


# The fork's ComputeAP test (test_bbox_util.cpp): 11 ranked detections (ties kept in order), 5 boxes.
FORK_SCORES = [1.0, 1.0, 0.9, 0.9, 0.8, 0.7, 0.7, 0.6, 0.5, 0.4, 0.4]
FORK_TP = [0, 1, 1, 0, 1, 0, 1, 0, 0, 0, 1]


@pytest.mark.parametrize("version,want,cut", [("Integral", 0.558528, 5 / 11 * 0.2),
                                              ("MaxIntegral", 0.591861, 5 / 11 * 0.2),
                                              ("11point", 0.598662, 5 / 11 * 2 / 11)])
def test_average_precision_reproduces_the_forks_test(version, want, cut):
    assert average_precision(FORK_SCORES, FORK_TP, 5, version) == pytest.approx(want, abs=1e-5)
    assert average_precision(FORK_SCORES[:7], FORK_TP[:7], 5, version) == pytest.approx(want - cut, abs=1e-5)
