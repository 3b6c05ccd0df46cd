"""Data, ImageData, HDF5Data, MemoryData; the DataTransformer; the Prefetcher.

Each layer runs in a real Net reading files written here (LMDB, PNG, HDF5);
values are checked against the records and against a per-pixel transcription
of Caffe's DataTransformer loop.
"""
import os
import struct
import sys
import threading
import time
import zlib

import h5py
import numpy as np
import pytest

from conftest import SHARED, needs_shared
from sncaffe import Net
from sncaffe.backend.cpu import CPUDevice
from sncaffe.data import datum as datums
from sncaffe.data import image
from sncaffe.data.db import LMDBReader, LMDBWriter
from sncaffe.data.prefetch import Prefetcher
from sncaffe.data.transform import DataTransformer
from sncaffe.graph import GraphError
from sncaffe.layers.base import LayerError
from sncaffe.proto import sncaffe_pb2 as pb
from sncaffe.prototxt import parse_text

TRAIN, TEST = pb.TRAIN, pb.TEST


def net_of(layer, phase="TRAIN", seed=0, tops=("data", "label")):
    """A net made of one data layer (its text without name and tops)."""
    top = " ".join(f'top: "{t}"' for t in tops)
    text = f'name: "d" layer {{ name: "src" {top} {layer} }}'
    return Net(parse_text(text, pb.NetParameter()), phase, device=CPUDevice(16 << 20), seed=seed)


def batches(net, n):
    out = []
    for _ in range(n):
        net.forward()
        out.append({k: b.data.copy() for k, b in net.blobs.items()})
    return out


def write_lmdb(path, records):
    with LMDBWriter(path) as db:
        for key, d in records:
            db.put(key, d if isinstance(d, bytes) else d.SerializeToString())
    return str(path)


def images(n, shape=(3, 6, 5), seed=0):
    return np.random.default_rng(seed).integers(0, 256, (n, *shape), dtype=np.uint8)


def transform_param(text):
    return parse_text(text, pb.TransformationParameter())


def write_mean(path, mean):
    blob = pb.BlobProto(num=1, channels=mean.shape[0], height=mean.shape[1], width=mean.shape[2])
    blob.data.extend(mean.ravel().tolist())
    path.write_bytes(blob.SerializeToString())
    return str(path)


# -- DataTransformer -----------------------------------------------------------

def caffe_transform(x, scale=1.0, crop=0, h_off=0, w_off=0, mirror=False, mean=None, mean_values=None):
    """Caffe's DataTransformer::Transform loop, index for index."""
    c_, h_, w_ = x.shape
    height, width = (crop, crop) if crop else (h_, w_)
    flat, out = x.ravel(), np.zeros(c_ * height * width, np.float32)
    mv = None if mean_values is None else (list(mean_values) * c_ if len(mean_values) == 1 else mean_values)
    for c in range(c_):
        for h in range(height):
            for w in range(width):
                data_index = (c * h_ + h_off + h) * w_ + w_off + w
                top_index = (c * height + h) * width + (width - 1 - w if mirror else w)
                e = np.float32(flat[data_index])
                if mean is not None:
                    out[top_index] = (e - mean.ravel()[data_index]) * np.float32(scale)
                elif mv is not None:
                    out[top_index] = (e - np.float32(mv[c])) * np.float32(scale)
                else:
                    out[top_index] = e * np.float32(scale)
    return out.reshape(c_, height, width)


def run_transform(t, x, rng):
    out = np.empty(t.infer_shape(x.shape), np.float32)
    t(x, out, rng)
    return out


@pytest.mark.parametrize("text, kw", [
    ("", {}),
    ("scale: 0.00390625", {"scale": 0.00390625}),
    ("mean_value: 100 scale: 0.5", {"mean_values": [100.0], "scale": 0.5}),
    ("mean_value: 10 mean_value: 20 mean_value: 30.5", {"mean_values": [10, 20, 30.5]}),
    ("crop_size: 3 scale: 2", {"crop": 3, "scale": 2.0, "h_off": 1, "w_off": 1}),  # TEST: centred
])
def test_transform_matches_caffe_loop_in_test(text, kw):
    x = images(1)[0]
    t = DataTransformer(transform_param(text), TEST)
    np.testing.assert_array_equal(run_transform(t, x, np.random.default_rng(0)), caffe_transform(x, **kw))


def test_mean_file_is_read_at_the_crop_offset_then_scaled(tmp_path):
    x = images(1)[0]
    mean = np.random.default_rng(1).uniform(0, 255, x.shape).astype(np.float32)
    path = write_mean(tmp_path / "mean.binaryproto", mean)
    t = DataTransformer(transform_param(f'mean_file: "{path}" crop_size: 4 scale: 0.1'), TEST)
    expected = caffe_transform(x, scale=0.1, crop=4, h_off=1, w_off=0, mean=mean)
    np.testing.assert_allclose(run_transform(t, x, None), expected, rtol=1e-6)


@pytest.mark.parametrize("mean", [False, True])
def test_train_draws_mirror_then_crop_offsets(tmp_path, mean):
    x = images(1)[0]
    m = np.random.default_rng(2).uniform(0, 255, x.shape).astype(np.float32) if mean else None
    extra = f'mean_file: "{write_mean(tmp_path / "m.binaryproto", m)}"' if mean else "mean_value: 7"
    t = DataTransformer(transform_param(f"crop_size: 3 mirror: true scale: 0.5 {extra}"), TRAIN)
    rng, twin = np.random.default_rng(5), np.random.default_rng(5)
    seen = set()
    for _ in range(40):
        mirror = twin.integers(2) == 1
        h_off, w_off = twin.integers(6 - 3 + 1), twin.integers(5 - 3 + 1)
        seen.add((bool(mirror), int(h_off), int(w_off)))
        expected = caffe_transform(x, 0.5, 3, h_off, w_off, mirror, m, None if mean else [7])
        np.testing.assert_allclose(run_transform(t, x, rng), expected, rtol=1e-6)
    assert len(seen) > 10                       # offsets and mirrors really vary


def test_test_phase_crops_at_the_centre_and_still_mirrors_when_asked():
    x = images(1, (1, 7, 7))[0]
    t = DataTransformer(transform_param("crop_size: 3"), TEST)
    for _ in range(3):
        np.testing.assert_array_equal(run_transform(t, x, np.random.default_rng()), x[:, 2:5, 2:5])
    # Caffe's do_mirror = mirror() && Rand(2) has no phase test: a TEST net with mirror: true mirrors.
    t = DataTransformer(transform_param("mirror: true"), TEST)
    outs = {run_transform(t, x, np.random.default_rng(s)).tobytes() for s in range(20)}
    assert outs == {x.astype(np.float32).tobytes(), x[:, :, ::-1].astype(np.float32).tobytes()}


def test_transform_setting_errors(tmp_path):
    mean = write_mean(tmp_path / "m.binaryproto", np.zeros((3, 4, 4), np.float32))
    with pytest.raises(ValueError, match="not both"):
        DataTransformer(transform_param(f'mean_file: "{mean}" mean_value: 1'))
    with pytest.raises(ValueError, match=r"mean file .*m\.binaryproto has shape \(1, 3, 4, 4\).*\(1, 3, 6, 5\)"):
        DataTransformer(transform_param(f'mean_file: "{mean}"')).infer_shape((3, 6, 5))
    with pytest.raises(ValueError, match="1 mean_value or 3"):
        DataTransformer(transform_param("mean_value: 1 mean_value: 2")).infer_shape((3, 6, 5))
    with pytest.raises(ValueError, match="crop_size 7 is larger"):
        DataTransformer(transform_param("crop_size: 7")).infer_shape((3, 6, 5))
    with pytest.raises(ValueError, match="cannot read"):
        DataTransformer(transform_param(f'mean_file: "{tmp_path}/none.binaryproto"'))
    (tmp_path / "junk").write_bytes(b"\xff" * 9)
    with pytest.raises(ValueError, match="not a binary BlobProto"):
        DataTransformer(transform_param(f'mean_file: "{tmp_path}/junk"'))


# -- Data (LMDB) ---------------------------------------------------------------

def raw_lmdb(path, xs, keys=None, labels=None):
    keys = keys or [f"{i:08d}" for i in range(len(xs))]
    labels = range(len(xs)) if labels is None else labels
    return write_lmdb(path, [(k, datums.from_array(x, y)) for k, x, y in zip(keys, xs, labels)])


def test_data_reads_in_key_order_and_wraps(tmp_path):
    xs = images(10)
    order = np.random.default_rng(0).permutation(10)       # written out of order; read by key
    src = write_lmdb(tmp_path / "db", [(f"{i:08d}", datums.from_array(xs[i], i)) for i in order])
    net = net_of(f'type: "Data" transform_param {{ scale: 0.5 }} '
                 f'data_param {{ source: "{src}" batch_size: 4 backend: LMDB }}')
    assert net.blobs["data"].data.shape == (4, 3, 6, 5) and net.blobs["label"].data.shape == (4,)
    for b, rows in zip(batches(net, 4), ([0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 0, 1], [2, 3, 4, 5])):
        np.testing.assert_array_equal(b["data"], xs[rows] * np.float32(0.5))
        np.testing.assert_array_equal(b["label"], rows)
    assert net.layers[0].backward_needs == () and not net.layers[0].allow_force_backward(0)
    net.layers[0].close()


def test_data_float_datums_and_a_single_top(tmp_path):
    xs = np.random.default_rng(3).standard_normal((3, 2, 4, 4)).astype(np.float32)
    src = raw_lmdb(tmp_path / "db", xs)
    net = net_of(f'type: "Data" data_param {{ source: "{src}" batch_size: 3 backend: LMDB }}', tops=("data",))
    np.testing.assert_array_equal(batches(net, 1)[0]["data"], xs)


def huge_png(width, height) -> bytes:
    """A PNG whose header claims width x height 8-bit grey pixels, with no pixel data (a few bytes)."""
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b""))


@pytest.mark.parametrize("decoder", ["opencv", "pillow"])
def test_an_image_of_a_billion_pixels_is_refused_naming_it(tmp_path, monkeypatch, decoder):
    if decoder == "pillow":
        monkeypatch.setenv("SNCAFFE_IMAGES", "pillow")
    elif image.backend() != "opencv":
        pytest.skip("opencv-python-headless (the opencv extra) is not installed")
    bomb = huge_png(30000, 30000)
    src = write_lmdb(tmp_path / "db", [("a", datums.encoded(image.encode(images(1)[0], "png"))),
                                       ("b", datums.encoded(bomb))])
    net = net_of(f'type: "Data" data_param {{ source: "{src}" batch_size: 2 backend: LMDB }}')
    with pytest.raises(LayerError, match=r"LMDB .*db key b: Image size \(900000000 pixels\) exceeds limit"):
        net.forward()
    listing, root = image_list(tmp_path, images(2))
    (tmp_path / "im" / "img 0.png").write_bytes(bomb)
    with pytest.raises(GraphError, match=r"list.txt line 1: .*img 0.png: Image size \(900000000 pixels\)"):
        image_net(listing, root)


@pytest.mark.parametrize("force, channels", [("", 3), ("force_gray: true", 1), ("force_color: true", 3)])
def test_data_decodes_encoded_datums_in_bgr(tmp_path, force, channels):
    xs = images(3, (3, 5, 4))
    src = write_lmdb(tmp_path / "db", [(f"{i:08d}", datums.encoded(image.encode(x, "png"), 7 + i))
                                       for i, x in enumerate(xs)])
    net = net_of(f'type: "Data" transform_param {{ {force} }} '
                 f'data_param {{ source: "{src}" batch_size: 3 backend: LMDB }}')
    got = batches(net, 1)[0]
    assert got["data"].shape == (3, channels, 5, 4)
    np.testing.assert_array_equal(got["label"], [7, 8, 9])
    if channels == 3:
        np.testing.assert_array_equal(got["data"], xs)        # PNG is lossless; channels stay BGR
    else:
        b, g, r = (xs[:, c].astype(float) for c in range(3))
        assert np.abs(got["data"][:, 0] - (0.299 * r + 0.587 * g + 0.114 * b)).max() <= 1


def test_data_gray_png_stays_one_channel(tmp_path):
    xs = images(2, (1, 4, 4))
    src = write_lmdb(tmp_path / "db", [(f"{i}", datums.encoded(image.encode(x, "png"))) for i, x in enumerate(xs)])
    net = net_of(f'type: "Data" data_param {{ source: "{src}" batch_size: 2 backend: LMDB }}')
    np.testing.assert_array_equal(batches(net, 1)[0]["data"], xs)


def test_data_crop_and_mirror_repeat_with_the_seed(tmp_path):
    src = raw_lmdb(tmp_path / "db", images(6, (1, 8, 8)))
    layer = (f'type: "Data" transform_param {{ crop_size: 5 mirror: true }} '
             f'data_param {{ source: "{src}" batch_size: 3 backend: LMDB }}')
    runs = [[b["data"] for b in batches(net_of(layer, seed=s), 4)] for s in (1, 1, 2)]
    assert all(np.array_equal(a, b) for a, b in zip(runs[0], runs[1]))
    assert not all(np.array_equal(a, b) for a, b in zip(runs[0], runs[2]))
    test = batches(net_of(layer.replace("mirror: true", ""), "TEST"), 1)[0]["data"]
    np.testing.assert_array_equal(test, images(6, (1, 8, 8))[:3, :, 1:6, 1:6])


def test_data_bad_inputs(tmp_path):
    def build(src, extra=""):
        return net_of(f'type: "Data" {extra} data_param {{ source: "{src}" batch_size: 2 backend: LMDB }}')
    with pytest.raises(GraphError, match=r'"src" \(Data\): LMDB .*nowhere does not exist'):
        build(tmp_path / "nowhere")
    (tmp_path / "notdb").write_bytes(b"this is not an LMDB" * 300)
    with pytest.raises(GraphError, match=r"LMDB .*notdb cannot be opened"):
        build(tmp_path / "notdb")
    (tmp_path / "dir").mkdir()
    with pytest.raises(GraphError, match=r'"src" \(Data\): .*dir is not an LMDB: the directory has no data.mdb'):
        build(tmp_path / "dir")
    (tmp_path / "dir" / "data.mdb").write_bytes(b"\0" * 9000)
    with pytest.raises(GraphError, match=r"LMDB .*dir cannot be opened"):
        build(tmp_path / "dir")
    src = raw_lmdb(tmp_path / "db", images(3))
    with pytest.raises(GraphError, match=r"LevelDB .*db cannot be opened: .*it is an LMDB: set data_param \{ backend: LMDB \}"):
        net_of(f'type: "Data" data_param {{ source: "{src}" batch_size: 2 }}')
    with pytest.raises(GraphError, match=r"data_param.scale is Caffe's legacy field"):
        net_of(f'type: "Data" data_param {{ source: "{src}" batch_size: 2 backend: LMDB scale: 0.5 }}')
    mean = write_mean(tmp_path / "m.binaryproto", np.zeros((1, 6, 5), np.float32))
    msg = r"mean file .*m.binaryproto has shape \(1, 1, 6, 5\), the data in .*db has \(1, 3, 6, 5\)"
    with pytest.raises(GraphError, match=msg):
        build(src, f'transform_param {{ mean_file: "{mean}" }}')


def test_leveldb_without_plyvel_names_the_layer_and_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "plyvel", None)           # as where the leveldb extra is not installed
    with pytest.raises(GraphError, match=r'"src" \(Data\): reading or writing LevelDB needs plyvel: '
                                         r"pip install 'sncaffe\[leveldb\]'"):
        net_of(f'type: "Data" data_param {{ source: "{tmp_path}" batch_size: 2 backend: LEVELDB }}')


def test_data_shape_change_is_an_error_from_forward(tmp_path):
    xs = list(images(6))
    xs[5] = images(1, (3, 6, 6))[0]
    net = net_of(f'type: "Data" data_param {{ source: "{raw_lmdb(tmp_path / "db", xs)}" '
                 "batch_size: 3 backend: LMDB }")
    net.forward()                       # records 0-2 are fine
    msg = r"LMDB .*db: the datum at key 00000005 has shape \(3, 6, 6\), the first datum \(3, 6, 5\)"
    with pytest.raises(LayerError, match=msg):
        net.forward()
    with pytest.raises(LayerError, match=msg):      # and stays failed
        net.forward()


def test_corrupt_record_names_the_key(tmp_path):
    src = write_lmdb(tmp_path / "db", [("a", datums.from_array(images(1)[0])), ("b", b"\xff\xff\xff")])
    net = net_of(f'type: "Data" data_param {{ source: "{src}" batch_size: 2 backend: LMDB }}')
    with pytest.raises(LayerError, match="key b: not a Datum record"):
        net.forward()


def damage(path, at, pages=1):
    """Overwrite ``pages`` 4 KiB pages of the LMDB's data.mdb from fraction ``at`` of it, in place."""
    mdb = path / "data.mdb"
    with open(mdb, "r+b") as f:
        f.seek(max(2, int(mdb.stat().st_size * at) // 4096) * 4096)     # pages 0 and 1: LMDB's meta pages
        f.write(np.random.default_rng(1).integers(0, 256, 4096 * pages, np.uint8).tobytes())


@pytest.mark.parametrize("at, pages, msg", [(0.3, 1, r"page \d+ is damaged"), (0.0, 10**4, r"page \d+ is damaged"),
                                            (None, 0, r"its meta page says it has \d+ pages of 4096 bytes; "
                                                      r"the file has 12288 bytes \(truncated or damaged\)")])
def test_a_damaged_lmdb_is_an_error_naming_it_and_the_layer(tmp_path, at, pages, msg):
    src = raw_lmdb(tmp_path / "db", images(300, (1, 28, 28)))
    if at is None:
        os.truncate(tmp_path / "db" / "data.mdb", 3 * 4096)              # liblmdb: SIGBUS
    else:
        damage(tmp_path / "db", at, pages)                              # liblmdb: an assertion, or abort
    with pytest.raises(GraphError, match=r'"src" \(Data\): LMDB .*db cannot be opened: ' + msg):
        net_of(f'type: "Data" data_param {{ source: "{src}" batch_size: 2 backend: LMDB }}')


def test_an_lmdb_damaged_while_read_is_an_error_from_forward(tmp_path):
    src = raw_lmdb(tmp_path / "db", images(300, (1, 28, 28)))
    net = net_of(f'type: "Data" data_param {{ source: "{src}" batch_size: 50 backend: LMDB }}')
    damage(tmp_path / "db", 0.3)
    with pytest.raises(LayerError, match=r'"src" \(Data\): LMDB .*db cannot be read after key 000\d+: .*MDB_CORRUPTED'):
        for _ in range(6):                                              # from the reader thread
            net.forward()


def test_lmdb_reader_wraps_and_writer_grows(tmp_path):
    with LMDBWriter(tmp_path / "db", map_size=1 << 16) as db:     # far too small: the map must grow
        for i in range(300):
            db.put(f"{i:05d}", bytes(1000))
    r = LMDBReader(tmp_path / "db")
    keys = [next(r)[0] for _ in range(302)]
    assert keys[0] == b"00000" and keys[299] == b"00299" and keys[300:] == [b"00000", b"00001"]
    r.close()
    with pytest.raises(FileExistsError, match="already exists"):
        LMDBWriter(tmp_path / "db")


# -- ImageData -----------------------------------------------------------------

def image_list(tmp_path, xs, names=None):
    names = names or [f"img {i}.png" for i in range(len(xs))]       # a space in the name, as Caffe allows
    (tmp_path / "im").mkdir(exist_ok=True)
    for name, x in zip(names, xs):
        (tmp_path / "im" / name).write_bytes(image.encode(x, "png"))
    listing = tmp_path / "list.txt"
    listing.write_text("".join(f"{n} {10 + i}\n" for i, n in enumerate(names)))
    return str(listing), f"{tmp_path}/im/"


def image_net(listing, root, extra="", params="", phase="TRAIN", seed=0):
    return net_of(f'type: "ImageData" {extra} image_data_param {{ source: "{listing}" '
                  f'root_folder: "{root}" batch_size: 3 {params} }}', phase, seed)


def test_image_data_in_list_order_bgr_and_wraps(tmp_path):
    xs = images(4, (3, 5, 6))
    net = image_net(*image_list(tmp_path, xs), "transform_param { scale: 2 }")
    for b, rows in zip(batches(net, 2), ([0, 1, 2], [3, 0, 1])):
        np.testing.assert_array_equal(b["data"], xs[rows] * np.float32(2))
        np.testing.assert_array_equal(b["label"], np.array(rows) + 10)
    net.layers[0].close()


def test_image_data_gray_and_resize(tmp_path):
    xs = images(3, (3, 5, 6))
    b = batches(image_net(*image_list(tmp_path, xs), params="is_color: false new_height: 4 new_width: 8"), 1)[0]
    assert b["data"].shape == (3, 1, 4, 8)
    with pytest.raises(GraphError, match="together"):
        image_net(*image_list(tmp_path, xs), params="new_height: 4")


def test_image_data_shuffle_repeats_with_the_seed(tmp_path):
    xs = images(6, (1, 3, 3))
    listing, root = image_list(tmp_path, xs)
    runs = [np.concatenate([b["label"] for b in batches(image_net(listing, root, params="shuffle: true", seed=s), 4)])
            for s in (3, 3, 4)]
    np.testing.assert_array_equal(runs[0], runs[1])
    assert not np.array_equal(runs[0], runs[2])
    assert sorted(runs[0][:6]) == list(range(10, 16)) and sorted(runs[0][6:12]) == list(range(10, 16))


def test_image_data_missing_image_names_the_line(tmp_path):
    xs = images(4, (3, 5, 6))
    listing, root = image_list(tmp_path, xs)
    (tmp_path / "im" / "img 3.png").unlink()
    net = image_net(listing, root)
    net.forward()
    with pytest.raises(LayerError, match=r"list.txt line 4: .*im/img 3.png: cannot read image"):
        net.forward()
    (tmp_path / "im" / "img 0.png").write_bytes(b"not a png")
    with pytest.raises(GraphError, match=r"list.txt line 1: .*img 0.png: not an image"):
        image_net(listing, root)
    with pytest.raises(GraphError, match="cannot read the image list"):
        image_net(tmp_path / "none.txt", root)
    (tmp_path / "bad.txt").write_text("a.png x\n")
    with pytest.raises(GraphError, match='bad.txt line 1: expected "path label"'):
        image_net(tmp_path / "bad.txt", root)


# -- HDF5Data ------------------------------------------------------------------

def h5_files(tmp_path, sizes, seed=0):
    rng = np.random.default_rng(seed)
    names, rows = [], []
    for k, n in enumerate(sizes):
        data = rng.standard_normal((n, 2, 3)).astype(np.float32)
        label = np.arange(n, dtype=np.float64) + 100 * k
        with h5py.File(tmp_path / f"f{k}.h5", "w") as f:
            f["data"], f["label"] = data, label
        names.append(str(tmp_path / f"f{k}.h5"))
        rows += [(d, y) for d, y in zip(data, label)]
    (tmp_path / "files.txt").write_text("\n".join(names) + "\n")
    return str(tmp_path / "files.txt"), rows


def h5_net(listing, params="", seed=0, batch=4):
    return net_of(f'type: "HDF5Data" hdf5_data_param {{ source: "{listing}" batch_size: {batch} {params} }}',
                  seed=seed)


def test_hdf5_rows_across_files_and_wrap(tmp_path):
    listing, rows = h5_files(tmp_path, [3, 5])
    net = h5_net(listing)
    assert net.blobs["data"].data.shape == (4, 2, 3) and net.blobs["label"].data.shape == (4,)
    got = batches(net, 5)
    for i, b in enumerate(got):
        idx = [(4 * i + j) % 8 for j in range(4)]
        np.testing.assert_array_equal(b["data"], np.stack([rows[k][0] for k in idx]))
        np.testing.assert_array_equal(b["label"], [rows[k][1] for k in idx])


def test_hdf5_shuffle_repeats_and_permutes_each_file(tmp_path):
    listing, rows = h5_files(tmp_path, [3, 5])
    labels = [np.concatenate([b["label"] for b in batches(h5_net(listing, "shuffle: true", s, 1), 24)])
              for s in (1, 1, 2)]
    np.testing.assert_array_equal(labels[0], labels[1])
    assert not np.array_equal(labels[0], labels[2])
    for p in range(3):                          # each pass: one file's rows (permuted), then the other's
        one = labels[0][8 * p:8 * p + 8]
        first = one[:3] if one[0] < 100 else one[:5]
        assert sorted(one) == [0, 1, 2, 100, 101, 102, 103, 104]
        assert len({int(v) // 100 for v in first}) == 1


def test_hdf5_bad_inputs(tmp_path):
    listing, _ = h5_files(tmp_path, [3])
    with pytest.raises(GraphError, match="does not transform"):
        net_of(f'type: "HDF5Data" transform_param {{ scale: 2 }} '
               f'hdf5_data_param {{ source: "{listing}" batch_size: 2 }}')
    with pytest.raises(GraphError, match=r'f0.h5 .*has no dataset "x"'):
        net_of(f'type: "HDF5Data" hdf5_data_param {{ source: "{listing}" batch_size: 2 }}', tops=("data", "x"))
    with h5py.File(tmp_path / "g.h5", "w") as f:
        f["data"], f["label"] = np.zeros((3, 2, 3)), np.zeros(4)
    (tmp_path / "g.txt").write_text(str(tmp_path / "g.h5"))
    with pytest.raises(GraphError, match="same positive number of rows"):
        h5_net(tmp_path / "g.txt")
    with h5py.File(tmp_path / "h.h5", "w") as f:
        f["data"], f["label"] = np.zeros((3, 2, 4)), np.zeros(3)
    (tmp_path / "two.txt").write_text(f"{tmp_path}/f0.h5 {tmp_path}/h.h5")
    net = h5_net(tmp_path / "two.txt")
    with pytest.raises(LayerError, match=r'h.h5 .*"data" has rows of shape \(2, 4\), the first file \(2, 3\)'):
        net.forward()
    with pytest.raises(GraphError, match="cannot read the HDF5 file list"):
        h5_net(tmp_path / "none.txt")
    (tmp_path / "missing.txt").write_text(f"{tmp_path}/nope.h5")
    with pytest.raises(GraphError, match="nope.h5 .*cannot be read"):
        h5_net(tmp_path / "missing.txt")


@needs_shared
def test_hdf5_golden_solver_data_wraps_every_three_batches(monkeypatch):
    case = SHARED / "golden" / "solvers" / "sgd"
    monkeypatch.chdir(case)                     # Caffe reads train.txt and train.h5 from the cwd
    net = Net(str(case / "net.prototxt"), "TRAIN", device=CPUDevice(64 << 20))
    with h5py.File("train.h5", "r") as f:
        data, label = f["data"][...], f["label"][...]
    for i, b in enumerate(batches(net, 7)):
        rows = slice(4 * (i % 3), 4 * (i % 3) + 4)
        np.testing.assert_array_equal(b["data"], data[rows])
        np.testing.assert_array_equal(b["label"], label[rows])


# -- MemoryData ----------------------------------------------------------------

def test_memory_data_serves_reset_arrays_in_order():
    net = net_of('type: "MemoryData" memory_data_param { batch_size: 2 channels: 1 height: 2 width: 3 }')
    layer = net.layers[0]
    with pytest.raises(LayerError, match="call reset"):
        net.forward()
    x = np.arange(6 * 6, dtype=np.float32).reshape(6, 1, 2, 3)
    layer.reset(x, np.arange(6))
    for b, rows in zip(batches(net, 4), ([0, 1], [2, 3], [4, 5], [0, 1])):
        np.testing.assert_array_equal(b["data"], x[rows])
        np.testing.assert_array_equal(b["label"], rows)
    with pytest.raises(LayerError, match="multiple of batch_size 2"):
        layer.reset(x[:5], np.arange(5))
    with pytest.raises(LayerError, match=r"expected \(N, 1, 2, 3\)"):
        layer.reset(x.reshape(6, 1, 3, 2), np.arange(6))
    with pytest.raises(LayerError, match="labels of shape"):
        layer.reset(x, np.arange(4))
    with pytest.raises(GraphError, match="must be set and positive"):
        net_of('type: "MemoryData" memory_data_param { batch_size: 2 channels: 1 }')


# -- Prefetcher ----------------------------------------------------------------

def test_prefetcher_runs_ahead_on_a_daemon_thread_bounded_by_depth():
    made, threads = [], set()

    def fill(buf):
        threads.add(threading.get_ident())
        buf[0] = len(made)
        made.append(1)
    p = Prefetcher(fill, [np.zeros(1) for _ in range(3)])
    assert p._thread.daemon
    for expected in range(5):
        with p.batch() as buf:
            assert buf[0] == expected
    deadline = time.monotonic() + 60            # the thread's 3 ahead, however slow the machine
    while len(made) < 5 + 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)                             # time to run further ahead, were it not bounded
    assert len(made) == 5 + 3                  # 5 taken, 3 ready: never more than depth ahead
    assert threads and threading.get_ident() not in threads
    p.close()
    assert not p.running
    with pytest.raises(RuntimeError, match="closed"):
        with p.batch():
            pass


def test_prefetcher_hands_the_readers_exception_to_the_consumer():
    calls = []

    def fill(buf):
        calls.append(1)
        if len(calls) == 3:
            raise KeyError("record 3 is bad")
    p = Prefetcher(fill, [np.zeros(1), np.zeros(1)])
    for _ in range(2):
        with p.batch():
            pass
    for _ in range(2):
        with pytest.raises(KeyError, match="record 3 is bad"):
            with p.batch():
                pass
    assert not p.running


def test_data_layer_reads_on_its_thread_and_closes(tmp_path):
    src = raw_lmdb(tmp_path / "db", images(4))
    net = net_of(f'type: "Data" data_param {{ source: "{src}" batch_size: 2 backend: LMDB prefetch: 2 }}')
    net.forward()
    layer = net.layers[0]
    thread = layer._prefetcher._thread
    assert thread.daemon and thread is not threading.current_thread() and thread.is_alive()
    layer.close()
    assert not thread.is_alive()
    with pytest.raises(LayerError, match="closed"):
        net.forward()


def test_a_dropped_net_stops_its_reader_and_releases_the_lmdb(tmp_path):
    import gc
    from sncaffe.data import db
    src = raw_lmdb(tmp_path / "db", images(4))
    net = net_of(f'type: "Data" data_param {{ source: "{src}" batch_size: 2 backend: LMDB }}')
    net.forward()
    thread = net.layers[0]._prefetcher._thread
    del net
    gc.collect()
    thread.join(5)
    assert not thread.is_alive()
    db.open_lmdb(src)                                   # drains the release of the dropped reader
    db.close_lmdb(src)
    assert not any(k.endswith("/db") and str(tmp_path) in k for k in db._shared)


def test_rand_skip_starts_at_a_random_record_repeatably(tmp_path):
    src = raw_lmdb(tmp_path / "db", images(10, (1, 2, 2)))
    listing, root = image_list(tmp_path, images(10, (1, 2, 2)))
    data = f'type: "Data" data_param {{ source: "{src}" batch_size: 2 backend: LMDB rand_skip: 5 }}'
    firsts = {}
    for s in range(8):
        for name, net in (("Data", net_of(data, seed=s)),
                          ("ImageData", image_net(listing, root, params="rand_skip: 5", seed=s))):
            label = batches(net, 1)[0]["label"] - (10 if name == "ImageData" else 0)
            assert label[1] == (label[0] + 1) % 10 and 0 <= label[0] < 5
            firsts.setdefault((name, s), label[0])
            net.layers[0].close()
    again = batches(net_of(data, seed=3), 1)[0]["label"][0]
    assert again == firsts[("Data", 3)] and len({v for (n, _), v in firsts.items() if n == "Data"}) > 1
