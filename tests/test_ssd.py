"""A tiny SSD end to end: create_annoset writes a synthetic detection set, the net trains on it
from AnnotatedData with MultiBoxLoss (the loss falls), and its deploy twin detects with
DetectionOutput from the trained weights."""
import numpy as np
import pytest

from detection_set import make_images, write_set
from sncaffe import Net
from sncaffe.backend.cpu import CPUDevice
from sncaffe.proto import sncaffe_pb2 as pb
from sncaffe.prototxt import parse_text
from sncaffe.solver import Solver
from sncaffe.tools import create_annoset

C = 3           # background, red, green
SIZE = 48


def conv(name, bottom, n, stride=1, relu=True, kernel=3):
    text = f"""layer {{ name: "{name}" type: "Convolution" bottom: "{bottom}" top: "{name}"
  convolution_param {{ num_output: {n} kernel_size: {kernel} pad: {kernel // 2} stride: {stride}
    weight_filler {{ type: "msra" }} bias_filler {{ type: "constant" value: 0 }} }} }}\n"""
    if relu:
        text += f'layer {{ name: "{name}_relu" type: "ReLU" bottom: "{name}" top: "{name}" }}\n'
    return text


def head(fmap, min_size, max_size):
    priors = 4                                  # min, sqrt(min * max), ratio 2 and 1/2
    text = ""
    for kind, n in (("loc", priors * 4), ("conf", priors * C)):
        name = f"{fmap}_mbox_{kind}"
        text += conv(name, fmap, n, relu=False)
        text += f"""layer {{ name: "{name}_perm" type: "Permute" bottom: "{name}" top: "{name}_perm"
  permute_param {{ order: 0 order: 2 order: 3 order: 1 }} }}
layer {{ name: "{name}_flat" type: "Flatten" bottom: "{name}_perm" top: "{name}_flat" }}\n"""
    text += f"""layer {{ name: "{fmap}_mbox_priorbox" type: "PriorBox" bottom: "{fmap}" bottom: "data"
  top: "{fmap}_mbox_priorbox" prior_box_param {{ min_size: {min_size} max_size: {max_size} aspect_ratio: 2
  flip: true clip: false variance: 0.1 variance: 0.1 variance: 0.2 variance: 0.2 }} }}\n"""
    return text


def body():
    text = conv("conv1", "data", 16, 2) + conv("conv2", "conv1", 32, 2) + conv("conv3", "conv2", 32, 2)
    text += conv("conv4", "conv3", 32, 2)
    text += head("conv3", 12, 24) + head("conv4", 24, 40)
    for kind, axis in (("loc_flat", 1), ("conf_flat", 1), ("priorbox", 2)):
        text += f"""layer {{ name: "mbox_{kind}" type: "Concat" bottom: "conv3_mbox_{kind}"
  bottom: "conv4_mbox_{kind}" top: "mbox_{kind}" concat_param {{ axis: {axis} }} }}\n"""
    return text


def data_layer(source, batch, mirror=True):
    return f"""layer {{ name: "data" type: "AnnotatedData" top: "data" top: "label"
  data_param {{ source: "{source}" batch_size: {batch} backend: LMDB }}
  transform_param {{ mirror: {str(mirror).lower()} mean_value: 127.5 mean_value: 127.5 mean_value: 127.5
    scale: 0.0078125 resize_param {{ resize_mode: WARP height: {SIZE} width: {SIZE} interp_mode: LINEAR }}
    emit_constraint {{ emit_type: CENTER }} }} }}
"""


def detection_tail():
    return f"""layer {{ name: "mbox_conf_reshape" type: "Reshape" bottom: "mbox_conf_flat" top: "mbox_conf_reshape"
  reshape_param {{ shape {{ dim: 0 dim: -1 dim: {C} }} }} }}
layer {{ name: "mbox_conf_softmax" type: "Softmax" bottom: "mbox_conf_reshape" top: "mbox_conf_softmax"
  softmax_param {{ axis: 2 }} }}
layer {{ name: "mbox_conf_flatten" type: "Flatten" bottom: "mbox_conf_softmax" top: "mbox_conf_flatten" }}
layer {{ name: "detection_out" type: "DetectionOutput" bottom: "mbox_loc_flat" bottom: "mbox_conf_flatten"
  bottom: "mbox_priorbox" top: "detection_out"
  detection_output_param {{ num_classes: {C} share_location: true background_label_id: 0
    nms_param {{ nms_threshold: 0.45 top_k: 50 }} code_type: CENTER_SIZE keep_top_k: 20
    confidence_threshold: 0.01 }} }}
"""


def train_net(source, batch=4):
    return f"""name: "tiny_ssd"
{data_layer(source, batch)}
{body()}
layer {{ name: "mbox_loss" type: "MultiBoxLoss" bottom: "mbox_loc_flat" bottom: "mbox_conf_flat"
  bottom: "mbox_priorbox" bottom: "label" top: "mbox_loss"
  propagate_down: true propagate_down: true propagate_down: false propagate_down: false
  loss_param {{ normalization: VALID }}
  multibox_loss_param {{ loc_loss_type: SMOOTH_L1 conf_loss_type: SOFTMAX loc_weight: 1.0 num_classes: {C}
    share_location: true match_type: PER_PREDICTION overlap_threshold: 0.5 use_prior_for_matching: true
    background_label_id: 0 use_difficult_gt: true neg_pos_ratio: 3.0 neg_overlap: 0.5 code_type: CENTER_SIZE
    mining_type: MAX_NEGATIVE }} }}
"""


def deploy_net():
    return f"""name: "tiny_ssd_deploy"
layer {{ name: "data" type: "Input" top: "data" input_param {{ shape {{ dim: 1 dim: 3 dim: {SIZE} dim: {SIZE} }} }} }}
{body()}
{detection_tail()}"""


def eval_net(source, batch):
    return f"""name: "tiny_ssd_test"
{data_layer(source, batch, mirror=False)}
{body()}
{detection_tail()}
layer {{ name: "detection_eval" type: "DetectionEvaluate" bottom: "detection_out" bottom: "label"
  top: "detection_eval" detection_evaluate_param {{ num_classes: {C} background_label_id: 0
  overlap_threshold: 0.5 evaluate_difficult_gt: false }} }}
"""


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("ssd")
    listfile, _ = write_set(root / "images", 24, seed=2)
    assert create_annoset.main([str(root / "images") + "/", str(listfile), str(root / "lmdb"), "--encoded"]) == 0
    p = parse_text(f"""base_lr: 0.01 momentum: 0.9 weight_decay: 0.0005 lr_policy: "fixed" max_iter: 100
        display: 0 random_seed: 3 snapshot_prefix: "{root / 'snap'}" type: "SGD" """, pb.SolverParameter())
    p.net_param.CopyFrom(parse_text(train_net(root / "lmdb"), pb.NetParameter()))
    solver = Solver(p, device=CPUDevice(256 << 20))
    losses = []
    solver.callbacks.append(lambda it, loss, rate: losses.append(loss))
    solver.step(100)
    weights = root / "tiny_ssd.caffemodel"
    solver.net.save(str(weights))
    return losses, weights


def test_tiny_ssd_trains(trained):
    losses, _ = trained
    assert len(losses) == 100 and np.all(np.isfinite(losses))
    first, last = np.mean(losses[:5]), np.mean(losses[-10:])
    assert last < 0.35 * first, (first, last)


def test_tiny_ssd_deploy_detects(trained):
    """On images it never saw, the best detection finds a rectangle (IoU > 0.5, its colour)."""
    from sncaffe.data import image
    from sncaffe.layers.detection import jaccard
    _, weights = trained
    net = Net(parse_text(deploy_net(), pb.NetParameter()), "TEST", device=CPUDevice(128 << 20), weights=str(weights))
    right = 0
    for x, boxes in make_images(10, seed=99):
        resized = image.resize(x.transpose(1, 2, 0), (SIZE, SIZE)).transpose(2, 0, 1)
        net.blobs["data"].data[...] = (resized.astype(np.float32) - 127.5) * 0.0078125
        net.forward()
        rows = net.blobs["detection_out"].data
        assert rows.ndim == 4 and rows.shape[:2] == (1, 1) and rows.shape[3] == 7
        assert 1 <= rows.shape[2] <= 20                 # keep_top_k bounds the rows
        rows = rows[0, 0]
        assert np.all(rows[:, 0] == 0) and set(rows[:, 1]) <= {1, 2}
        assert np.all(np.diff(rows[:, 1]) >= 0)         # by label, then by score
        for label in (1, 2):
            s = rows[rows[:, 1] == label, 2]
            assert np.all(np.diff(s) <= 0) and np.all((s > 0.01) & (s <= 1))
        best = rows[np.argmax(rows[:, 2])]
        h, w = x.shape[1:]
        gt = np.array([[b[1] / w, b[2] / h, b[3] / w, b[4] / h] for b in boxes])
        iou = jaccard(best[None, 3:7].astype(np.float64), gt)[0]
        right += iou.max() > 0.5 and boxes[int(iou.argmax())][0] == best[1]
    assert right >= 6, right


def test_tiny_ssd_test_net_evaluates_detections(trained, tmp_path):
    """SSD's test net: AnnotatedData -> DetectionOutput -> DetectionEvaluate, shapes changing every batch."""
    _, weights = trained
    listfile, items = write_set(tmp_path / "images", 6, seed=5)
    assert create_annoset.main([str(tmp_path / "images") + "/", str(listfile), str(tmp_path / "lmdb")]) == 0
    net = Net(parse_text(eval_net(tmp_path / "lmdb", 3), pb.NetParameter()), "TEST", device=CPUDevice(128 << 20),
              weights=str(weights))
    for batch in range(2):
        net.forward()
        dets = net.blobs["detection_out"].data[0, 0]
        rows = net.blobs["detection_eval"].data[0, 0]
        assert rows.shape == (2 + len(dets), 5)
        labels = [b[0] for _, boxes in items[3 * batch:3 * batch + 3] for b in boxes]
        np.testing.assert_array_equal(rows[:2, :3], [[-1, 1, labels.count(1)], [-1, 2, labels.count(2)]])
        assert np.all(rows[2:, 3] + rows[2:, 4] == 1) and rows[2:, 3].sum() >= 1


def test_solver_scores_the_test_net_by_mean_average_precision(trained, tmp_path, caplog):
    """SSD's solver settings (eval_type detection, ap_version 11point): the test net's mAP."""
    import logging
    _, weights = trained
    listfile, _ = write_set(tmp_path / "images", 6, seed=7)
    assert create_annoset.main([str(tmp_path / "images") + "/", str(listfile), str(tmp_path / "lmdb")]) == 0
    p = parse_text(f"""base_lr: 0.01 lr_policy: "fixed" max_iter: 1 display: 0 test_iter: 2 test_interval: 100
        test_initialization: false snapshot_prefix: "{tmp_path / 'snap'}" eval_type: "detection"
        ap_version: "11point" show_per_class_result: true""", pb.SolverParameter())
    p.train_net_param.CopyFrom(parse_text(train_net(tmp_path / "lmdb"), pb.NetParameter()))
    p.test_net_param.add().CopyFrom(parse_text(eval_net(tmp_path / "lmdb", 3), pb.NetParameter()))
    solver = Solver(p, device=CPUDevice(256 << 20))
    solver.net.copy_from(str(weights))
    with caplog.at_level(logging.INFO, logger="sncaffe"):
        scores = solver.test(0)
    assert list(scores) == ["detection_eval"] and 0.3 < scores["detection_eval"] <= 1
    assert "Test net output #0: detection_eval = " in caplog.text and "class1: " in caplog.text
    p.eval_type = "segmentation"
    with pytest.raises(ValueError, match='eval_type "segmentation"'):
        Solver(p, device=CPUDevice(256 << 20))


def test_sncaffe_test_scores_detection_evaluate_as_the_solver_does(trained, tmp_path):
    """``sncaffe test`` on SSD's test net: DetectionEvaluate's rows (their number changes with every
    batch) are gathered into the mean average precision the solver's test gives on the same data."""
    from sncaffe.run import Resources, score
    _, weights = trained
    listfile, _ = write_set(tmp_path / "images", 6, seed=7)
    assert create_annoset.main([str(tmp_path / "images") + "/", str(listfile), str(tmp_path / "lmdb")]) == 0
    p = parse_text(f"""base_lr: 0.01 lr_policy: "fixed" max_iter: 1 display: 0 test_iter: 2 test_interval: 100
        test_initialization: false snapshot_prefix: "{tmp_path / 'snap'}" eval_type: "detection"
        ap_version: "11point" """, pb.SolverParameter())
    p.train_net_param.CopyFrom(parse_text(train_net(tmp_path / "lmdb"), pb.NetParameter()))
    p.test_net_param.add().CopyFrom(parse_text(eval_net(tmp_path / "lmdb", 3), pb.NetParameter()))
    solver = Solver(p, device=CPUDevice(256 << 20))
    solver.net.copy_from(str(weights))
    want = solver.test(0)["detection_eval"]
    means = score(parse_text(eval_net(tmp_path / "lmdb", 3), pb.NetParameter()), Resources(memory="none"),
                  weights=str(weights), iterations=2, ap_version="11point")
    assert list(means) == ["detection_eval"] and means["detection_eval"].shape == (1,)
    assert means["detection_eval"][0] == pytest.approx(want, rel=1e-6) and 0.3 < want <= 1
    integral = score(parse_text(eval_net(tmp_path / "lmdb", 3), pb.NetParameter()), Resources(memory="none"),
                     weights=str(weights), iterations=2)["detection_eval"][0]
    assert integral != pytest.approx(want, rel=1e-6)       # the version is the one asked for
