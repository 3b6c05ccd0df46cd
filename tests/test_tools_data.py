"""tools/convert_mnist_data.py, convert_imageset.py and compute_image_mean.py, run as commands."""
import gzip
import subprocess
import sys

import numpy as np
import pytest

from conftest import ROOT, SHARED
from sncaffe import Net
from sncaffe.backend.cpu import CPUDevice
from sncaffe.data import datum as datums
from sncaffe.data import image
from sncaffe.data.db import LMDBReader
from sncaffe.data.transform import read_mean
from sncaffe.proto import sncaffe_pb2 as pb
from sncaffe.prototxt import parse_text

# The MNIST test set the project ships for its examples (or the shared copy it came from).
MNIST = next((d for d in (ROOT / "data" / "mnist", SHARED and SHARED / "data" / "mnist")
              if d and (d / "t10k-labels-idx1-ubyte.gz").exists()), ROOT / "data" / "mnist")
IMAGES, LABELS = MNIST / "t10k-images-idx3-ubyte.gz", MNIST / "t10k-labels-idx1-ubyte.gz"


def tool(name, *args, ok=True):
    r = subprocess.run([sys.executable, str(ROOT / "tools" / name), *map(str, args)],
                       capture_output=True, text=True, timeout=60)
    assert (r.returncode == 0) == ok, r.stdout + r.stderr
    return r.stdout + r.stderr


def records(path):
    db = LMDBReader(path)
    out = [next(db) for _ in range(db.entries)]
    db.close()
    return [(k.decode(), datums.parse(v)) for k, v in out]


def mnist():
    with gzip.open(IMAGES) as f:
        x = np.frombuffer(f.read(), np.uint8, offset=16).reshape(-1, 28, 28)
    with gzip.open(LABELS) as f:
        y = np.frombuffer(f.read(), np.uint8, offset=8)
    return x, y


def data_net(src, batch, extra=""):
    text = (f'layer {{ name: "d" type: "Data" top: "data" top: "label" {extra} '
            f'data_param {{ source: "{src}" batch_size: {batch} backend: LMDB }} }}')
    return Net(parse_text(text, pb.NetParameter()), "TEST", device=CPUDevice(16 << 20))


@pytest.mark.parametrize("start", [0, 9900])
def test_convert_mnist_data_slice(tmp_path, start):
    out = tmp_path / "lmdb"
    assert "Processed 100 files" in tool("convert_mnist_data.py", IMAGES, LABELS, out, "--start", start, "--count", 100)
    x, y = mnist()
    recs = records(out)
    assert [k for k, _ in recs] == [f"{i:08d}" for i in range(start, start + 100)]
    for i, (_, d) in zip(range(start, start + 100), recs):
        assert (d.channels, d.height, d.width, d.label, d.encoded) == (1, 28, 28, y[i], False)
        np.testing.assert_array_equal(datums.to_array(d)[0], x[i])
    tool("convert_mnist_data.py", IMAGES, LABELS, out, "--count", 100, ok=False)      # exists already
    assert "outside" in tool("convert_mnist_data.py", IMAGES, LABELS, tmp_path / "b", "--start", 9990,
                             "--count", 100, ok=False)
    assert "magic number" in tool("convert_mnist_data.py", LABELS, LABELS, tmp_path / "c", ok=False)


def test_compute_image_mean_matches_caffes_float_sum_and_feeds_mean_file(tmp_path):
    db, mean_file = tmp_path / "lmdb", tmp_path / "mean.binaryproto"
    tool("convert_mnist_data.py", IMAGES, LABELS, db, "--count", 100)
    log = tool("compute_image_mean.py", db, mean_file)
    x = mnist()[0][:100]
    total = np.zeros((28, 28), np.float32)
    for im in x:
        total += im
    expected = total / np.float32(100)
    blob = pb.BlobProto.FromString(mean_file.read_bytes())
    assert (blob.num, blob.channels, blob.height, blob.width) == (1, 1, 28, 28)
    np.testing.assert_array_equal(read_mean(mean_file)[0], expected)
    printed = float(log.split("mean_value channel [0]: ")[1].split()[0])
    assert printed == pytest.approx(float(expected.mean()), rel=1e-5)
    net = data_net(db, 10, f'transform_param {{ mean_file: "{mean_file}" scale: 0.5 }}')
    net.forward()
    np.testing.assert_allclose(net.blobs["data"].data[:, 0], (x[:10] - expected) * np.float32(0.5), rtol=1e-6)
    assert "does not exist" in tool("compute_image_mean.py", tmp_path / "none", ok=False)


@pytest.fixture
def image_files(tmp_path):
    xs = np.random.default_rng(0).integers(0, 256, (5, 3, 6, 7), dtype=np.uint8)
    (tmp_path / "im").mkdir()
    for i, x in enumerate(xs):
        (tmp_path / "im" / f"p {i}.png").write_bytes(image.encode(x, "png"))
    listing = tmp_path / "list.txt"
    listing.write_text("".join(f"p {i}.png {i % 3}\n" for i in range(5)))
    return xs, f"{tmp_path}/im/", listing


def test_convert_imageset_raw_matches_image_data(tmp_path, image_files):
    xs, root, listing = image_files
    out = tmp_path / "raw"
    assert "Processed 5 files" in tool("convert_imageset.py", root, listing, out, "--check_size")
    recs = records(out)
    assert [k for k, _ in recs] == [f"{i:08d}_p {i}.png" for i in range(5)]
    for i, (_, d) in enumerate(recs):
        assert d.label == i % 3 and not d.encoded
        np.testing.assert_array_equal(datums.to_array(d), xs[i])          # BGR, as OpenCV stores it
    net = data_net(out, 5)
    net.forward()
    text = (f'layer {{ name: "i" type: "ImageData" top: "data" top: "label" image_data_param {{ '
            f'source: "{listing}" root_folder: "{root}" batch_size: 5 }} }}')
    ref = Net(parse_text(text, pb.NetParameter()), "TEST", device=CPUDevice(16 << 20))
    ref.forward()
    np.testing.assert_array_equal(net.blobs["data"].data, ref.blobs["data"].data)
    np.testing.assert_array_equal(net.blobs["label"].data, ref.blobs["label"].data)


def test_convert_imageset_options(tmp_path, image_files):
    xs, root, listing = image_files
    tool("convert_imageset.py", root, listing, tmp_path / "g", "--gray", "--resize_height", 4, "--resize_width", 5)
    assert all((d.channels, d.height, d.width) == (1, 4, 5) for _, d in records(tmp_path / "g"))
    tool("convert_imageset.py", root, listing, tmp_path / "e", "--encoded")
    for i, (_, d) in enumerate(records(tmp_path / "e")):
        assert d.encoded and d.data == (tmp_path / "im" / f"p {i}.png").read_bytes()   # the file itself
    tool("convert_imageset.py", root, listing, tmp_path / "j", "--encoded", "--encode_type", "jpg")
    for i, (_, d) in enumerate(records(tmp_path / "j")):
        assert d.encoded and d.data[:2] == b"\xff\xd8"                               # re-encoded as JPEG
        assert datums.to_array(d).shape == (3, 6, 7)
    tool("convert_imageset.py", root, listing, tmp_path / "s", "--shuffle")
    names = [k.split("_", 1)[1] for k, _ in records(tmp_path / "s")]
    assert sorted(names) == [f"p {i}.png" for i in range(5)] and names != sorted(names)
    (tmp_path / "im" / "p 2.png").unlink()
    log = tool("convert_imageset.py", root, listing, tmp_path / "m")
    assert "p 2.png" in log and "Processed 4 files" in log
