"""The Caffe forks' layer types export to ONNX and to PyTorch within 1e-4 of sncaffe (the module's
input and weight gradients too); the types and settings without a faithful export are refused
by name, and the forks' data and loss layers follow the deploy rules."""
import numpy as np
import pytest

pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
torch = pytest.importorskip("torch")

from test_export_layers import TYPES_NET, layer, net_of  # noqa: E402
from test_fork_nets import RCNN, SEGNET  # noqa: E402

from sncaffe import Net  # noqa: E402
from sncaffe.export import ExportError, check, deploy, onnx as to_onnx, pytorch as to_torch  # noqa: E402
from sncaffe.proto import sncaffe_pb2 as pb  # noqa: E402
from sncaffe.prototxt import parse_text  # noqa: E402

DATA = 'layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 2 dim: 4 dim: 7 dim: 9 } } }\n'

FORK_NET = (
    'name: "forks"\n' + DATA
    + 'layer { name: "image" type: "Input" top: "image" input_param { shape { dim: 2 dim: 3 dim: 28 dim: 36 } } }\n'
    'layer { name: "rois" type: "Input" top: "rois" input_param { shape { dim: 5 dim: 5 } } }\n'
    # cropped by pad_beg/pad_end, then zoomed; a size that is no multiple; shrunk
    + layer("zoom", "Interp", "data", body="interp_param { zoom_factor: 3 pad_beg: -1 pad_end: -2 }")
    + layer("sized", "Interp", "data", body="interp_param { height: 5 width: 12 }")
    + layer("shrink", "Interp", "data", body="interp_param { shrink_factor: 2 }")
    + layer("shuffle", "ShuffleChannel", "data", body="shuffle_channel_param { group: 2 }")
    + layer("gap", "Pooling", "data", body="pooling_param { pool: AVE global_pooling: true }")
    + layer("axpy", "Axpy", ["gap", "shuffle", "data"])
    + layer("perm", "Permute", "axpy", body="permute_param { order: 0 order: 2 order: 3 order: 1 }")
    + layer("norm", "Normalize", "data", body='norm_param { across_spatial: false channel_shared: false '
            'scale_filler { type: "gaussian" std: 1 } }')
    + layer("norm_all", "Normalize", "data", body='norm_param { across_spatial: true channel_shared: true '
            'scale_filler { type: "constant" value: 20 } }')
    + layer("prior", "PriorBox", ["data", "image"], body="prior_box_param { min_size: 8 max_size: 20 "
            "aspect_ratio: 2 flip: true clip: true variance: 0.1 variance: 0.1 variance: 0.2 variance: 0.2 }")
    + layer("bn_psp", "BN", "data", body='bn_param { slope_filler { type: "gaussian" std: 1 } '
            'bias_filler { type: "gaussian" std: 1 } }')
    + layer("bn_segnet", "BN", "data", body='bn_param { bn_mode: INFERENCE scale_filler { type: "gaussian" std: 1 } '
            'shift_filler { type: "gaussian" std: 1 } }')
    + layer("roi", "ROIPooling", ["data", "rois"], body="roi_pooling_param { pooled_h: 3 pooled_w: 2 spatial_scale: 0.25 }")
    # the rois read twice (through a Split): the check's rois are valid for both
    + layer("roi_axpy", "ROIPooling", ["axpy", "rois"], body="roi_pooling_param { pooled_h: 2 pooled_w: 2 spatial_scale: 0.5 }")
    + layer("pool", "Pooling", "data", ["pool", "mask"], "pooling_param { pool: MAX kernel_size: 2 stride: 2 }")
    + layer("unpool", "Upsample", ["pool", "mask"], body="upsample_param { scale: 2 pad_out_h: true }")
    + layer("unpool_sized", "Upsample", ["pool", "mask"], body="upsample_param { upsample_h: 7 upsample_w: 9 }")
    # overlapping windows: a cell named by two windows takes the later value, as in Caffe
    + layer("pool_ov", "Pooling", "data", ["pool_ov", "mask_ov"], "pooling_param { pool: MAX kernel_size: 3 stride: 2 }")
    + layer("gain_ov", "Convolution", "pool_ov", body='convolution_param { num_output: 4 kernel_size: 1 '
            'weight_filler { type: "gaussian" std: 1 } }')      # mixes channels: the two values differ
    + layer("unpool_ov", "Upsample", ["gain_ov", "mask_ov"], body="upsample_param { upsample_h: 7 upsample_w: 9 }")
    # padded, ceil-rounded windows; the mask an output of the net
    + layer("pool_pad", "Pooling", "data", ["pool_pad", "mask_pad"], "pooling_param { pool: MAX kernel_size: 3 stride: 2 pad: 1 }")
)


def fork_net(force_backward=False):
    net = Net(parse_text(FORK_NET + f"force_backward: {str(force_backward).lower()}", pb.NetParameter()), "TEST", seed=3)
    rng = np.random.default_rng(1)
    mean, var = net.params["bn_psp"][2:]
    mean.data[...] = rng.normal(0, 0.5, mean.data.shape)
    var.data[...] = rng.uniform(0.5, 2, var.data.shape)
    return net


@pytest.fixture(scope="module")
def forks():
    return fork_net()


def test_every_mapped_type_is_in_a_test_net(forks):
    used = {n.type for n in forks.graph.layers} | {n.type for n in net_of(TYPES_NET).graph.layers}
    assert set(to_onnx.MAPS) - used == set()
    assert set(to_torch.MAPS) - used == set()


def test_forks_export_to_onnx(forks):
    against = check.expected(forks)
    model, diffs = to_onnx.export(forks, None, rtol=1e-4, against=against)
    assert [d.output for d in diffs] == forks.outputs and "mask_pad" in forks.outputs
    nodes = {n.op_type: n for n in model.graph.node}
    assert {"MaxRoiPool", "MaxUnpool", "Transpose", "ReduceSumSquare", "BatchNormalization"} <= set(nodes)
    attrs = {a.name: a for a in nodes["Resize"].attribute}
    assert attrs["coordinate_transformation_mode"].s == b"align_corners" and attrs["mode"].s == b"linear"


def test_forks_export_to_torch(forks, tmp_path):
    against = check.expected(forks)
    module, src, diffs = to_torch.export(forks, tmp_path / "forks.py", rtol=1e-4, against=against)
    assert [d.output for d in diffs] == forks.outputs
    text = (tmp_path / "forks.py").read_text()
    assert "align_corners=True" in text and "def roi_max_pool(" in text and "class ForkBN(" in text
    assert "zoom = interp(data[:, :, 1:5, 1:7], (10, 16))" in text


def test_torch_gradients_match_sncaffe():
    net = fork_net(force_backward=True)
    inputs = check.random_inputs(net, seed=1)
    rng = np.random.default_rng(2)
    grads = {o: rng.standard_normal(net.blobs[o].data.shape).astype(np.float32) for o in net.outputs}
    for n, x in inputs.items():
        net.blobs[n].data[...] = x
    net.forward()
    for o, g in grads.items():
        net.blobs[o].diff[...] = g
    net.backward()
    src = to_torch.source(net)
    module = src.module().eval()
    xs = {n: torch.from_numpy(x).requires_grad_(n == "data") for n, x in inputs.items()}
    ys = module(*(xs[n] for n in net.inputs))
    sum((y * torch.from_numpy(grads[o])).sum() for o, y in zip(net.outputs, ys)
        if y.requires_grad).backward()
    assert check.relative(net.blobs["data"].diff, xs["data"].grad.numpy()) <= 1e-4
    state = dict(module.named_parameters())
    for name in ("norm", "norm_all", "bn_segnet"):        # PSPNet's BN learns only in TRAIN, not exported
        keys = [k for k in src.blob_keys[name] if k in state]
        assert len(keys) == 2 if name.startswith("bn") else 1
        for blob, key in zip(net.params[name], keys):
            assert check.relative(blob.diff, state[key].grad.numpy().reshape(blob.diff.shape)) <= 1e-4, key


def test_roi_pooling_rounding_matches_fast_rcnn():
    """Corners on a half cell after scaling (rounded away from zero), rois past the map (empty
    bins give 0), a roi of one cell; and an Interp to a single row (its position 0)."""
    net = net_of(DATA + layer("rois", "Parameter", [], body="parameter_param { shape { dim: 6 dim: 5 } }")
                 + layer("roi", "ROIPooling", ["data", "rois"],
                         body="roi_pooling_param { pooled_h: 4 pooled_w: 3 spatial_scale: 0.25 }")
                 + layer("row", "Interp", "data", body="interp_param { height: 1 width: 3 }"))
    net.params["rois"][0].data[...] = [[0, 2, 2, 6, 6], [1, -6, -2, 10, 30], [1, 30, 22, 40, 40],
                                       [0, 0, 0, 0, 0], [1, 14, 10, 18, 30], [0, 1.9999, 6.0001, 26, 22]]
    against = check.expected(net)
    assert np.any(against[1]["roi"] == 0) and np.any(against[1]["roi"] != 0)
    for exporter in (to_onnx, to_torch):
        assert all(d.relative == 0 for d in exporter.export(net, None, rtol=1e-4, against=against)[-1])


def refused(text, match, phase="TEST", exporters=(to_onnx, to_torch)):
    net = net_of(DATA + text, phase)
    for exporter in exporters:
        with pytest.raises(ExportError, match=match):
            exporter.export(net, None, rtol=1e-4)


def test_psroi_pooling_is_refused_with_the_reason():
    refused('layer { name: "rois" type: "Input" top: "rois" input_param { shape { dim: 2 dim: 5 } } }\n'
            + layer("psroi", "PSROIPooling", ["data", "rois"],
                    body="psroi_pooling_param { spatial_scale: 1 output_dim: 1 group_size: 2 }"),
            'layer "psroi" \\(PSROIPooling\\): not exported: position-sensitive roi pooling has no ONNX operator')


def test_detection_output_is_refused_with_the_reason():
    refused('layer { name: "loc" type: "Input" top: "loc" input_param { shape { dim: 1 dim: 252 } } }\n'
            'layer { name: "conf" type: "Input" top: "conf" input_param { shape { dim: 1 dim: 126 } } }\n'
            + layer("prior", "PriorBox", ["data", "data"], body="prior_box_param { min_size: 2 }")
            + layer("detect", "DetectionOutput", ["loc", "conf", "prior"],
                    body="detection_output_param { num_classes: 2 nms_param { nms_threshold: 0.45 } }"),
            'layer "detect" \\(DetectionOutput\\): not exported: its non-maximum suppression keeps a number')


@pytest.mark.parametrize("body, phase, why", [
    ("bn_param { bn_mode: LEARN }", "TEST", "caffe-segnet's bn_mode LEARN normalizes by the batch"),
    ('bn_param { slope_filler { type: "constant" value: 1 } }', "TRAIN", "normalizes by the batch's statistics"),
])
def test_batch_statistics_bn_is_refused(body, phase, why):
    refused(layer("bn", "BN", "data", body=body), f'layer "bn" \\(BN\\): {why}', phase)


def test_upsample_needs_a_pooling_mask():
    refused('layer { name: "m" type: "Input" top: "m" input_param { shape { dim: 2 dim: 4 dim: 7 dim: 9 } } }\n'
            + layer("up", "Upsample", ["data", "m"], body="upsample_param { scale: 2 }"),
            'layer "up" \\(Upsample\\): its mask "m" is not the second top of a MAX Pooling layer')


def test_pooling_mask_settings_without_mapping_are_refused():
    refused(layer("p", "Pooling", "data", ["p", "mask"], "pooling_param { pool: MAX global_pooling: true }"),
            'layer "p" \\(Pooling\\): the second top \\(the argmax mask\\) of global pooling')
    # padding over half the kernel: only the explicit-padding helper gives Caffe's windows
    refused(layer("p", "Pooling", "data", ["p", "mask"], "pooling_param { pool: MAX kernel_size: 3 stride: 2 pad: 2 }"),
            'layer "p" \\(Pooling\\): with the mask top, PyTorch', exporters=(to_torch,))


FORK_TRAIN = '''
layer { name: "data" type: "AnnotatedData" top: "data" top: "label" include { phase: TRAIN }
        data_param { source: "absent_lmdb" batch_size: 2 backend: LMDB } }
layer { name: "seg" type: "DenseImageData" top: "image" top: "mask" include { phase: TRAIN }
        dense_image_data_param { source: "absent.txt" batch_size: 2 } }
layer { name: "loc" type: "Convolution" bottom: "data" top: "loc" convolution_param { num_output: 4 kernel_size: 1 } }
layer { name: "conf" type: "Convolution" bottom: "data" top: "conf" convolution_param { num_output: 2 kernel_size: 1 } }
layer { name: "prior" type: "PriorBox" bottom: "loc" bottom: "data" top: "prior" prior_box_param { min_size: 2 } }
layer { name: "mbox_loss" type: "MultiBoxLoss" bottom: "loc" bottom: "conf" bottom: "prior" bottom: "label"
        top: "mbox_loss" multibox_loss_param { num_classes: 2 } }
layer { name: "eval" type: "DetectionEvaluate" bottom: "conf" bottom: "label" top: "eval" }
layer { name: "box" type: "Convolution" bottom: "image" top: "box" convolution_param { num_output: 1 kernel_size: 1 } }
layer { name: "box_loss" type: "SmoothL1Loss" bottom: "box" bottom: "mask" top: "box_loss" }
'''


def test_fork_data_and_loss_layers_follow_the_deploy_rules():
    param = parse_text(FORK_TRAIN, pb.NetParameter())
    net = Net(deploy.deploy_param(param, {"data": (2, 3, 6, 6), "image": (2, 3, 5, 5)}), "TRAIN", defer=True)
    assert net.inputs == ["data", "image"] and net.outputs == ["conf", "prior", "box"]   # loc is read by prior
    assert not {"MultiBoxLoss", "SmoothL1Loss", "DetectionEvaluate", "AnnotatedData", "DenseImageData"} & {
        n.type for n in net.graph.layers}


@pytest.mark.parametrize("name, text, shapes", [
    ("rcnn", RCNN, None),
    ("segnet", SEGNET.replace("bn_param {", "bn_param { bn_mode: INFERENCE"), {"data": (2, 3, 16, 16)}),
])
def test_training_fork_nets_export_their_deploy_part(tmp_path, name, text, shapes):
    """The forks' nets that train (tests/test_fork_nets.py): the R-CNN head on random valid rois,
    SegNet with its BN in INFERENCE, their losses and label inputs dropped."""
    path = tmp_path / f"{name}.prototxt"
    path.write_text(text % {"source": tmp_path / "absent.txt"} if "%(" in text else text)
    net = deploy.load(path, "TEST", shapes=shapes)
    assert net.inputs == (["data", "rois"] if name == "rcnn" else ["data"])
    against = check.expected(net)
    for exporter in (to_onnx, to_torch):
        assert all(d.relative <= 1e-4 for d in exporter.export(net, None, rtol=1e-4, against=against)[-1])


def test_segnet_learning_bn_is_refused_through_a_file(tmp_path):
    path = tmp_path / "segnet.prototxt"
    path.write_text(SEGNET % {"source": tmp_path / "absent.txt"})
    net = deploy.load(path, "TEST", shapes={"data": (2, 3, 16, 16)})
    with pytest.raises(ExportError, match='layer "conv1_bn" \\(BN\\): caffe-segnet\'s bn_mode LEARN'):
        to_onnx.export(net, None, rtol=1e-4)
