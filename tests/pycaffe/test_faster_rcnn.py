"""py-faster-rcnn's VGG16 test net and py-R-FCN's ResNet-50 one as their test scripts drive them
(pycaffe, one image at a time, ``net.forward(data=..., im_info=...)``), with a region proposal
layer written for these tests (tests/data/faster_rcnn/rpn): the proposal layer gives its rois top
a new number of rows in every forward, which plans the net again where that number outgrows the
block it had."""
import logging
import sys
from pathlib import Path

import numpy as np
import pytest

import sncaffe.pycaffe as caffe
from sncaffe.proto import sncaffe_pb2 as pb
from sncaffe.prototxt import read_text

DATA = Path(__file__).resolve().parents[1] / "data"
VGG16_TEST = DATA / "faster_rcnn/pascal_voc__VGG16__faster_rcnn_end2end__test.prototxt"
RFCN_TEST = DATA / "faster_rcnn/pascal_voc__ResNet-50__rfcn_end2end__test_agnostic.prototxt"
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "layers"))
# caffe-fast-rcnn's and caffe-rfcn's kernels, loop for loop
from test_rcnn import psroi_pool_reference, roi_pool_reference        # noqa: E402

# The backbones' widths cut by 16 (VGG16's fc6 and fc7 to 64, the RPN's and R-FCN's own 3x3 and
# 1x1 to 32), so that their parameters do not dominate a test of shapes: every layer, setting
# and blob name is the published file's, the outputs' widths (classes, boxes) too.
NARROW = {64: 4, 128: 8, 256: 16, 512: 32, 1024: 64, 2048: 128, 4096: 64}


def narrow_net(path, tmp_path):
    net = read_text(path, pb.NetParameter())
    for lp in net.layer:
        for p in (lp.convolution_param, lp.inner_product_param):
            if lp.name.startswith(("conv", "fc", "res")) and p.num_output in NARROW:
                p.num_output = NARROW[p.num_output]
        if lp.name in ("rpn_conv/3x3", "conv_new_1"):
            lp.convolution_param.num_output = 32
    out = tmp_path / path.name
    out.write_text(str(net))
    return out


def private_device(monkeypatch):
    """A pool of its own for pycaffe's nets: its peak is the net's."""
    from sncaffe.backend.cpu import CPUDevice
    from sncaffe.pycaffe import mode
    device = CPUDevice("256MiB")
    device._pycaffe_name = "cpu"
    monkeypatch.setitem(mode._state, "device", device)
    monkeypatch.setitem(mode._state, "mode", "cpu")
    return device


def fill_weights(net):
    """He's weights (objectness then varies), small box deltas, BatchNorm's statistics 0 and 1
    (the published test nets have no fillers: their weights come from a .caffemodel)."""
    types = getattr(net, "layer_types", None) or {name: layer.type for name, layer in net.layer_dict.items()}
    for i, (name, blobs) in enumerate(net.params.items()):
        rng = np.random.default_rng(i)
        if types[name] == "BatchNorm":
            blobs[0].data[...], blobs[1].data[...], blobs[2].data[...] = 0, 1, 1
            continue
        if types[name] == "Scale":
            continue                    # its filler's 1 and 0
        gain = 0.05 if "bbox" in name else 0.2 if name.endswith("branch2c") else 1.0    # residuals stay small
        blobs[0].data[...] = rng.normal(0, gain * np.sqrt(2.0 / blobs[0].data[0].size), blobs[0].data.shape)
        if len(blobs) > 1:
            blobs[1].data[...] = rng.normal(0, 0.1 * gain, blobs[1].data.shape)


# a new image size sets the net up again, the proposal layer keeping its object and the bound its
# rois grew to; the same image again gives the same rois
IMAGES = ((160, 224, 1.0), (160, 224, 1.0), (224, 288, 0.5), (128, 192, 2.0))


def detect_images(net, device, caplog, check):
    """im_detect over IMAGES; ``check(rois, h, w)`` after each. Returns the numbers of rois."""
    rng = np.random.default_rng(0)
    counts, image, bound = [], None, 1        # rois (1, 5), as the layer's setup gives
    layer = net.layer_dict["proposal"]
    for h, w, scale in IMAGES:
        same = image is not None and image.shape == (h, w, 3)
        image = image if same else rng.normal(0, 60, (h, w, 3))
        caplog.clear()
        device.pool.reset_peak()
        with caplog.at_level(logging.INFO, logger="sncaffe"):
            rois, cls_prob, bbox_pred = im_detect(net, image, scale)
        counts.append(len(rois))
        grew = [r.getMessage() for r in caplog.records if "planned again" in r.getMessage()]
        if len(rois) > bound:
            assert len(grew) == 1 and f'layer "proposal" (Python): top "rois" to {rois.shape} (planned ({bound}, 5))' \
                in grew[0]
            bound = len(rois)
        else:
            assert not grew
        if same:
            assert device.pool.peak == net.memory_plan.peak     # measured as planned
        assert net.layer_dict["proposal"] is layer and net.memory_plan.peak > 0
        assert 1 < len(rois) <= 300 and rois.shape[1] == 5 and (rois[:, 0] == 0).all()
        assert (rois[:, 1] >= 0).all() and (rois[:, 3] <= w - 1).all() and (rois[:, 4] <= h - 1).all()
        assert (rois[:, 3] - rois[:, 1] + 1 >= 16 * scale).all()             # min size, at the image's scale
        assert cls_prob.shape == (len(rois), 21) and bbox_pred.shape[0] == len(rois)
        np.testing.assert_allclose(cls_prob.sum(axis=1), 1, rtol=1e-5)
        check(rois, h, w)
    assert counts[0] == counts[1] and len(set(counts)) >= 3     # the same image, the same rois; others differ
    assert bound == max(counts) and any(c < bound for c in counts[2:])     # smaller ones in the bound's block
    return counts


@pytest.fixture
def rpn_module(monkeypatch):
    monkeypatch.syspath_prepend(str(DATA / "faster_rcnn"))
    yield
    for name in ("rpn", "rpn.proposal_layer"):
        sys.modules.pop(name, None)


def im_detect(net, image, scale):
    """py-faster-rcnn's test-time steps: the input blobs reshaped to the image, one forward."""
    data = image.transpose(2, 0, 1)[None].astype(np.float32)
    im_info = np.array([[image.shape[0], image.shape[1], scale]], np.float32)
    net.blobs["data"].reshape(*data.shape)
    net.blobs["im_info"].reshape(*im_info.shape)
    out = net.forward(data=data, im_info=im_info)
    return net.blobs["rois"].data.copy(), out["cls_prob"], out["bbox_pred"]


@pytest.mark.parametrize("memory", ["none", "liveness"])
def test_vgg16_faster_rcnn_test_net_with_proposals_of_changing_number(rpn_module, tmp_path, memory, caplog,
                                                                    monkeypatch):
    device = private_device(monkeypatch)
    net = caffe.Net(str(narrow_net(VGG16_TEST, tmp_path)), caffe.TEST, memory=memory,
                    keep=["rois", "pool5", "fc7", "cls_score"])
    fill_weights(net)
    seen = {}                   # conv5_3 as roi_pool5 reads it (under liveness its block is not kept)
    at = list(net._layer_names).index("roi_pool5")
    net.before_forward(lambda i: i == at and seen.update(conv5=net.blobs["conv5_3"].data.copy()))

    def check(rois, h, w):
        # the layers after the proposals ran on the rois and on conv5_3 carried into the new plan
        conv5 = seen.pop("conv5")
        assert conv5.shape == (1, 32, -(-h // 16), -(-w // 16))
        np.testing.assert_allclose(net.blobs["pool5"].data[:6], roi_pool_reference(conv5, rois[:6], 7, 7, 1 / 16),
                                   rtol=1e-6)
        fc7, (weight, bias) = net.blobs["fc7"].data, net.params["cls_score"]
        np.testing.assert_allclose(net.blobs["cls_score"].data, fc7 @ weight.data.T + bias.data, rtol=1e-4, atol=1e-5)
        assert net.blobs["bbox_pred"].data.shape == (len(rois), 84)
    detect_images(net, device, caplog, check)


def test_rfcn_resnet50_test_net_with_proposals_of_changing_number(rpn_module, tmp_path, caplog, monkeypatch):
    """The rois feed two PSROIPoolings (through a Split): both are set up again for each number."""
    device = private_device(monkeypatch)
    net = caffe.Net(str(narrow_net(RFCN_TEST, tmp_path)), caffe.TEST, memory="liveness",
                    keep=["rois", "psroipooled_cls_rois", "cls_score"])
    fill_weights(net)
    seen = {}
    at = list(net._layer_names).index("psroipooled_cls_rois")
    net.before_forward(lambda i: i == at and seen.update(maps=net.blobs["rfcn_cls"].data.copy()))

    def check(rois, h, w):
        maps = seen.pop("maps")
        assert maps.shape == (1, 21 * 49, -(-h // 16), -(-w // 16))
        pooled = net.blobs["psroipooled_cls_rois"].data
        assert pooled.shape == (len(rois), 21, 7, 7)
        np.testing.assert_allclose(pooled[:4], psroi_pool_reference(maps, rois[:4], 21, 7, 1 / 16), rtol=1e-5,
                                   atol=1e-6)
        np.testing.assert_allclose(net.blobs["cls_score"].data.reshape(len(rois), 21), pooled.mean(axis=(2, 3)),
                                   rtol=1e-5, atol=1e-6)
        assert net.blobs["bbox_pred"].data.shape == (len(rois), 8)
    detect_images(net, device, caplog, check)


def test_vgg16_faster_rcnn_forward_and_backward_on_synthetic_inputs(rpn_module, tmp_path):
    """What ``sncaffe time`` runs: synthetic inputs (im_info the image's size, so the proposals lie in
    it), a forward whose rois outgrow their block, then a backward through every layer, the RPN's
    Reshape views of the convolution's output included."""
    from sncaffe.backend.cpu import CPUDevice
    from sncaffe.data.synthetic import SyntheticInputs
    from sncaffe.net import Net
    param = read_text(narrow_net(VGG16_TEST, tmp_path), pb.NetParameter())
    param.force_backward = True
    net = Net(param, "TEST", device=CPUDevice("256MiB"), memory="none")
    fill_weights(net)
    SyntheticInputs(0)(net)
    assert net.blobs["im_info"].data.tolist() == [[224, 224, 1]]
    net.forward()
    rois = net.blobs["rois"].data
    assert len(rois) > 1 and net.graph.blobs["rois"].shape == rois.shape        # planned again for them
    assert net.blobs["rpn_cls_score"].data.shape == (1, 18, 14, 14)
    assert net.blobs["rpn_cls_score_reshape"].data.shape == (1, 2, 126, 14)
    rng = np.random.default_rng(1)
    for name in net.outputs:
        net.blobs[name].diff[...] = rng.standard_normal(net.blobs[name].diff.shape)
    net.backward()
    assert np.isfinite(net.blobs["data"].diff).all() and np.abs(net.blobs["data"].diff).sum() > 0
    assert np.abs(net.params["conv5_3"][0].diff).sum() > 0 and np.abs(net.params["fc6"][0].diff).sum() > 0
