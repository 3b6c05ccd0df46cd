"""The forks' layers in nets that train: a tiny Faster R-CNN head on rois given as data, and a
tiny SegNet reading a segmentation set (DenseImageData) written here."""
import numpy as np

from sncaffe.backend.cpu import CPUDevice
from sncaffe.data import image
from sncaffe.proto import sncaffe_pb2 as pb
from sncaffe.prototxt import parse_text
from sncaffe.solver import Solver

RCNN = """
name: "tiny_rcnn"
layer { name: "input" type: "Input" top: "data" top: "rois" top: "labels" top: "bbox_targets"
        top: "bbox_inside_weights" top: "bbox_outside_weights"
        input_param { shape { dim: 2 dim: 3 dim: 16 dim: 16 } shape { dim: 16 dim: 5 } shape { dim: 16 }
                      shape { dim: 16 dim: 12 } shape { dim: 16 dim: 12 } shape { dim: 16 dim: 12 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
        convolution_param { num_output: 8 kernel_size: 3 pad: 1 weight_filler { type: "msra" } } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }
layer { name: "roi_pool" type: "ROIPooling" bottom: "conv1" bottom: "rois" top: "pool"
        roi_pooling_param { pooled_h: 3 pooled_w: 3 spatial_scale: 1 } }
layer { name: "fc" type: "InnerProduct" bottom: "pool" top: "fc"
        inner_product_param { num_output: 32 weight_filler { type: "xavier" } } }
layer { name: "relu2" type: "ReLU" bottom: "fc" top: "fc" }
layer { name: "cls_score" type: "InnerProduct" bottom: "fc" top: "cls_score"
        inner_product_param { num_output: 3 weight_filler { type: "gaussian" std: 0.01 } } }
layer { name: "bbox_pred" type: "InnerProduct" bottom: "fc" top: "bbox_pred"
        inner_product_param { num_output: 12 weight_filler { type: "gaussian" std: 0.001 } } }
layer { name: "loss_cls" type: "SoftmaxWithLoss" bottom: "cls_score" bottom: "labels" top: "loss_cls" }
layer { name: "loss_bbox" type: "SmoothL1Loss" bottom: "bbox_pred" bottom: "bbox_targets"
        bottom: "bbox_inside_weights" bottom: "bbox_outside_weights" top: "loss_bbox" }
"""


def detection_batches(n, rng):
    """Images with one square object (class 1: red, 2: green); per image 4 rois jittered around it
    (its class, regression targets to the object) and 4 elsewhere (background, no targets)."""
    batches = []
    for _ in range(n):
        data = rng.normal(0, 0.1, (2, 3, 16, 16))
        rois, labels = [], []
        targets, inside = np.zeros((16, 12)), np.zeros((16, 12))
        for b in range(2):
            cls, size = rng.integers(1, 3), 6
            y0, x0 = rng.integers(0, 16 - size, 2)
            data[b, cls - 1, y0:y0 + size, x0:x0 + size] += 1
            gt = np.array([x0, y0, x0 + size - 1, y0 + size - 1], float)
            for k in range(8):
                r = len(rois)
                if k < 4:
                    box = np.clip(gt + rng.integers(-2, 3, 4), 0, 15)
                    box[2:] = np.maximum(box[2:], box[:2])
                    labels.append(cls)
                    targets[r, 4 * cls:4 * cls + 4] = (gt - box) / size
                    inside[r, 4 * cls:4 * cls + 4] = 1
                else:
                    x, y = rng.integers(0, 12, 2)
                    box = np.array([x, y, x + 3, y + 3], float)
                    labels.append(0)
                rois.append([b, *box])
        batches.append(dict(data=data, rois=np.array(rois), labels=np.array(labels, float),
                            bbox_targets=targets, bbox_inside_weights=inside,
                            bbox_outside_weights=np.ones((16, 12))))
    return batches


def solver(net_text, **fields):
    p = pb.SolverParameter(**{**dict(base_lr=0.05, momentum=0.9, lr_policy="fixed", max_iter=1000, random_seed=3,
                                     display=0, snapshot_prefix="unused"), **fields})
    p.net_param.CopyFrom(parse_text(net_text, pb.NetParameter()))
    return p


def test_tiny_faster_rcnn_trains():
    batches = detection_batches(4, np.random.default_rng(0))

    def feed(net, i):
        for name, value in batches[i % len(batches)].items():
            net.blobs[name].data[...] = value
    s = Solver(solver(RCNN), device=CPUDevice(64 << 20), feed=feed)
    cls, box = [], []
    for _ in range(48):
        s.step(1)
        cls.append(float(s.net.blobs["loss_cls"].data))
        box.append(float(s.net.blobs["loss_bbox"].data))
    assert np.mean(cls[-8:]) < 0.5 * np.mean(cls[:8]), cls
    assert np.mean(box[-8:]) < 0.8 * np.mean(box[:8]), box


SEGNET = """
name: "tiny_segnet"
layer { name: "data" type: "DenseImageData" top: "data" top: "label"
        transform_param { scale: 0.00390625 }
        dense_image_data_param { source: "%(source)s" batch_size: 2 shuffle: true } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
        convolution_param { num_output: 8 kernel_size: 3 pad: 1 weight_filler { type: "msra" } } }
layer { name: "conv1_bn" type: "BN" bottom: "conv1" top: "conv1"
        bn_param { scale_filler { type: "constant" value: 1 } shift_filler { type: "constant" value: 0.001 } } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }
layer { name: "pool1" type: "Pooling" bottom: "conv1" top: "pool1" top: "pool1_mask"
        pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "conv2" type: "Convolution" bottom: "pool1" top: "conv2"
        convolution_param { num_output: 8 kernel_size: 3 pad: 1 weight_filler { type: "msra" } } }
layer { name: "upsample1" type: "Upsample" bottom: "conv2" bottom: "pool1_mask" top: "up1"
        upsample_param { scale: 2 } }
layer { name: "conv3" type: "Convolution" bottom: "up1" top: "conv3"
        convolution_param { num_output: 2 kernel_size: 3 pad: 1 weight_filler { type: "msra" } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "conv3" bottom: "label" top: "loss" }
"""


def write_segmentation_set(folder, n, rng):
    """n 16x16 colour images with a bright rectangle on a dark ground, and their label images
    (1 on the rectangle); the list file of "image label" lines."""
    lines = []
    for i in range(n):
        x = rng.integers(0, 60, (3, 16, 16)).astype(np.uint8)
        lab = np.zeros((1, 16, 16), np.uint8)
        y0, x0 = rng.integers(0, 8, 2)
        h, w = rng.integers(4, 9, 2)
        x[:, y0:y0 + h, x0:x0 + w] += 150
        lab[:, y0:y0 + h, x0:x0 + w] = 1
        for name, a in ((f"im{i}.png", x), (f"lab{i}.png", lab)):
            (folder / name).write_bytes(image.encode(a))
        lines.append(f"{folder / f'im{i}.png'} {folder / f'lab{i}.png'}")
    source = folder / "train.txt"
    source.write_text("\n".join(lines) + "\n")
    return source


def test_tiny_segnet_trains_on_dense_image_data(tmp_path):
    source = write_segmentation_set(tmp_path, 6, np.random.default_rng(1))
    s = Solver(solver(SEGNET % dict(source=source), base_lr=0.02), device=CPUDevice(64 << 20))
    assert s.net.blobs["label"].data.shape == (2, 1, 16, 16)
    losses = []
    for _ in range(24):
        s.step(1)
        losses.append(float(s.net.blobs["loss"].data))
    labels = s.net.blobs["label"].data
    assert set(np.unique(labels)) == {0, 1}
    assert np.mean(losses[-6:]) < 0.7 * np.mean(losses[:6]), losses
