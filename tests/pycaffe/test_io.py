"""caffe.io and Classifier as pycaffe scripts use them, and images as Caffe's OpenCV reads them."""
from dataclasses import replace

import numpy as np
import pytest
from PIL import Image

import sncaffe.pycaffe as caffe
from sncaffe import config
from sncaffe.data import image
from pycaffe_fixtures import lenet_fixture, trained_fixture  # noqa: F401 (fixtures)


def write_png(path, rgb):
    Image.fromarray(rgb).save(path)
    return str(path)


def test_transformer_preprocess_and_deprocess(tmp_path):
    rng = np.random.default_rng(0)
    rgb = rng.integers(0, 256, (8, 10, 3), dtype=np.uint8)
    img = caffe.io.load_image(write_png(tmp_path / "a.png", rgb))
    assert img.shape == (8, 10, 3) and img.dtype == np.float32
    np.testing.assert_allclose(img, rgb / 255.0, atol=1e-6)
    mu = np.array([104.0, 117.0, 123.0])
    transformer = caffe.io.Transformer({"data": (1, 3, 8, 10)})
    transformer.set_transpose("data", (2, 0, 1))       # move image channels to outermost dimension
    transformer.set_mean("data", mu)                   # subtract the dataset-mean value in each channel
    transformer.set_raw_scale("data", 255)             # rescale from [0, 1] to [0, 255]
    transformer.set_channel_swap("data", (2, 1, 0))    # swap channels from RGB to BGR
    transformer.set_input_scale("data", 0.5)
    x = transformer.preprocess("data", img)
    want = (rgb.astype(np.float32)[:, :, ::-1].transpose(2, 0, 1) - mu[:, None, None]) * 0.5
    np.testing.assert_allclose(x, want, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(transformer.deprocess("data", x), img, atol=1e-5)
    with pytest.raises(ValueError, match="Mean channels"):
        transformer.set_mean("data", np.zeros(4))
    with pytest.raises(Exception, match="Channel swap"):
        transformer.set_channel_swap("data", (1, 0))
    big = caffe.io.load_image(write_png(tmp_path / "b.png", np.repeat(np.repeat(rgb, 2, 0), 2, 1)))
    assert transformer.preprocess("data", big).shape == (3, 8, 10)    # resized to the input


def test_blobproto_and_datum_round_trips():
    a = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    blob = caffe.io.array_to_blobproto(a)
    assert list(blob.shape.dim) == [2, 3, 4]
    np.testing.assert_array_equal(caffe.io.blobproto_to_array(blob), a)
    legacy = caffe.proto.caffe_pb2.BlobProto(num=1, channels=2, height=3, width=4)
    legacy.data.extend(range(24))
    assert caffe.io.blobproto_to_array(legacy).shape == (1, 2, 3, 4)
    arrays = caffe.io.blobprotovector_str_to_arraylist(caffe.io.arraylist_to_blobprotovector_str([a, a[0]]))
    assert [x.shape for x in arrays] == [(2, 3, 4), (3, 4)]
    u8 = np.arange(24, dtype=np.uint8).reshape(2, 3, 4)
    d = caffe.io.array_to_datum(u8, label=7)
    assert (d.channels, d.height, d.width, d.label) == (2, 3, 4, 7) and d.data == u8.tobytes()
    np.testing.assert_array_equal(caffe.io.datum_to_array(d), u8)
    f = caffe.io.datum_to_array(caffe.io.array_to_datum(a))
    np.testing.assert_array_equal(f, a)
    with pytest.raises(ValueError, match="Incorrect array shape"):
        caffe.io.array_to_datum(a[0])


def test_oversample_and_classifier(lenet, trained):
    crops = caffe.io.oversample([np.arange(6 * 6, dtype=np.float32).reshape(6, 6, 1)], (4, 4))
    assert crops.shape == (10, 4, 4, 1)
    np.testing.assert_array_equal(crops[5], crops[0][:, ::-1])        # the mirrors
    np.testing.assert_array_equal(crops[4, :, :, 0], np.arange(36).reshape(6, 6)[1:5, 1:5])
    from sncaffe.tools.convert_mnist_data import IMAGE_MAGIC, read_idx
    from pathlib import Path
    ims = read_idx(Path(__file__).resolve().parents[2] / "data/mnist/t10k-images-idx3-ubyte.gz", IMAGE_MAGIC)[:4]
    inputs = [im[:, :, None].astype(np.float32) / 256 for im in ims]
    clf = caffe.Classifier(str(lenet["deploy"]), str(trained))
    p = clf.predict(inputs, oversample=False)
    net = caffe.Net(str(lenet["deploy"]), str(trained), caffe.TEST)
    want = net.forward_all(data=np.stack([i.transpose(2, 0, 1) for i in inputs]))["prob"]
    np.testing.assert_allclose(p, want, rtol=1e-5, atol=1e-7)
    clf = caffe.Classifier(str(lenet["deploy"]), str(trained), image_dims=(32, 32))
    p = clf.predict(inputs)                     # 10 crops each, averaged
    assert p.shape == (4, 10)
    np.testing.assert_allclose(p.sum(1), 1, rtol=1e-5)


def inter_linear_row(row, out_w):
    """cv::resize INTER_LINEAR along one axis, written out: source x = (x + 0.5) * scale - 0.5, clamped."""
    scale = len(row) / out_w
    out = []
    for x in range(out_w):
        fx = (x + 0.5) * scale - 0.5
        i = int(np.floor(fx))
        t = fx - i
        if i < 0:
            i, t = 0, 0.0
        if i >= len(row) - 1:
            i, t = len(row) - 1, 0.0
        nxt = row[min(i + 1, len(row) - 1)]
        out.append((1 - t) * row[i] + t * nxt)
    return np.array(out)


@pytest.mark.skipif(image.backend() != "opencv", reason="opencv-python-headless (the opencv extra) is not installed")
def test_opencv_mode_reproduces_cv_resize_and_imread_bgr(tmp_path):
    row = np.tile(np.array([255, 0, 0, 0], np.uint8), 8)          # one bright pixel in four
    img = np.repeat(row[None], 4, 0)
    rgb = np.stack([img, np.zeros_like(img), np.zeros_like(img)], axis=2)   # red in RGB
    path = write_png(tmp_path / "row.png", rgb)
    x = image.load(path, 4, 8, True)                               # Caffe's ReadImageToCVMat
    assert x.shape == (3, 4, 8)
    np.testing.assert_array_equal(x[2, 0], inter_linear_row(row.astype(float), 8).round())
    assert (x[2] == 0).all() and (x[:2] == 0).all()                # OpenCV's rule: 0 (BGR: red is channel 2)
    up = image.load(path, 4, 64, True)[2, 0]
    np.testing.assert_allclose(up, inter_linear_row(row.astype(float), 64), atol=1)
    f = caffe.io.resize_image(rgb.astype(np.float32) / 255, (4, 12))
    np.testing.assert_allclose(f[0, :, 0], inter_linear_row(row / 255.0, 12), atol=1e-6)
    import cv2
    np.testing.assert_array_equal(image.load(path), cv2.imread(path).transpose(2, 0, 1))


def test_pillow_fallback_differs_when_shrinking(tmp_path, monkeypatch):
    row = np.tile(np.array([255, 0, 0, 0], np.uint8), 8)
    path = write_png(tmp_path / "row.png", np.repeat(row[None], 4, 0))
    monkeypatch.setattr(config, "settings", replace(config.settings, images="pillow"))
    assert image.backend() == "pillow"
    x = image.load(path, 4, 8, False)
    assert x.shape == (1, 4, 8) and x.max() > 0       # Pillow averages the area: not Caffe's 0
    f = caffe.io.resize_image(np.repeat(row[None], 4, 0)[:, :, None].astype(np.float32), (4, 8))
    assert f.shape == (4, 8, 1) and f.max() > 0
