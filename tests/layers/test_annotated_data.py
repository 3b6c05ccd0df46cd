"""AnnotatedData and create_annoset: AnnotatedDatum LMDBs written from images and boxes, read back
as SSD's 8-column box rows."""
import numpy as np
import pytest

from detection_set import write_set
from sncaffe import Net
from sncaffe.backend.cpu import CPUDevice
from sncaffe.data import annotated
from sncaffe.data.db import LMDBReader
from sncaffe.graph import GraphError
from sncaffe.layers import LayerError
from sncaffe.proto import sncaffe_pb2 as pb
from sncaffe.prototxt import parse_text
from sncaffe.tools import create_annoset


@pytest.fixture(scope="module")
def annoset(tmp_path_factory):
    root = tmp_path_factory.mktemp("annoset")
    listfile, items = write_set(root / "images", 5, seed=1)
    out = root / "lmdb"
    assert create_annoset.main([str(root / "images") + "/", str(listfile), str(out), "--encoded"]) == 0
    return out, items


def records(path):
    db = LMDBReader(path)
    try:
        return [annotated.parse(next(db)[1]) for _ in range(db.entries)]
    finally:
        db.close()


def test_create_annoset_stores_normalised_boxes_by_label(annoset):
    out, items = annoset
    recs = records(out)
    assert len(recs) == len(items)
    for rec, (x, boxes) in zip(recs, items):
        assert rec.type == pb.AnnotatedDatum.BBOX and rec.datum.encoded
        _, h, w = x.shape
        got = annotated.boxes(rec)
        want = sorted(((b[0], b[1] / w, b[2] / h, b[3] / w, b[4] / h) for b in boxes))
        np.testing.assert_allclose(sorted(map(tuple, got[:, [0, 2, 3, 4, 5]])), want, rtol=1e-6)
        for g in rec.annotation_group:                  # instance ids count within each label
            assert [a.instance_id for a in g.annotation] == list(range(len(g.annotation)))


def test_create_annoset_reads_voc_xml_with_a_label_map(tmp_path):
    from sncaffe.data import image
    (tmp_path / "a.png").write_bytes(image.encode(np.zeros((3, 20, 40), np.uint8)))
    (tmp_path / "a.xml").write_text(
        "<annotation><size><width>40</width><height>20</height><depth>3</depth></size>"
        "<object><name>dog</name><difficult>1</difficult><bndbox><xmin>4</xmin><ymin>2</ymin>"
        "<xmax>20</xmax><ymax>10</ymax></bndbox></object>"
        "<object><name>cat</name><bndbox><xmin>0</xmin><ymin>0</ymin><xmax>40</xmax><ymax>20</ymax>"
        "</bndbox></object></annotation>")
    (tmp_path / "list.txt").write_text("a.png a.xml\n")
    (tmp_path / "labelmap.prototxt").write_text(
        'item { name: "none_of_the_above" label: 0 } item { name: "cat" label: 1 } item { name: "dog" label: 2 }')
    args = [str(tmp_path) + "/", str(tmp_path / "list.txt"), str(tmp_path / "db"), "--label-type", "xml",
            "--label-map-file", str(tmp_path / "labelmap.prototxt")]
    assert create_annoset.main(args) == 0
    (rec,) = records(tmp_path / "db")
    np.testing.assert_allclose(annotated.boxes(rec), [[2, 0, 0.1, 0.1, 0.5, 0.5, 1], [1, 0, 0, 0, 1, 1, 0]])
    assert (rec.datum.channels, rec.datum.height, rec.datum.width) == (3, 20, 40)


def test_create_annoset_refuses_a_bad_list_line(tmp_path):
    (tmp_path / "list.txt").write_text("only_one_path\n")
    with pytest.raises(SystemExit, match="line 1"):
        create_annoset.main([str(tmp_path) + "/", str(tmp_path / "list.txt"), str(tmp_path / "db")])


def data_net(source, batch, extra="", transform=""):
    return parse_text(f"""
layer {{ name: "data" type: "AnnotatedData" top: "data" top: "label"
  data_param {{ source: "{source}" batch_size: {batch} backend: LMDB }}
  transform_param {{ resize_param {{ resize_mode: WARP height: 24 width: 24 interp_mode: LINEAR }} {transform} }}
  {extra} }}""", pb.NetParameter())


def test_annotated_data_reads_images_and_box_rows(annoset):
    out, items = annoset
    net = Net(data_net(out, 2), "TRAIN", device=CPUDevice(64 << 20))
    assert net.blobs["data"].data.shape == (2, 3, 24, 24)
    most = max(len(b) for _, b in items)
    assert net.graph.blobs["label"].shape == (1, 1, 2 * most, 8)      # planned for the most boxes
    recs = records(out)
    for step in range(3):                       # batches wrap around the 5 records
        net.forward()
        rows = net.blobs["label"].data
        first = (2 * step) % 5
        want = [np.column_stack([np.full(len(annotated.boxes(recs[(first + i) % 5])), i),
                                 annotated.boxes(recs[(first + i) % 5])]) for i in range(2)]
        want = np.concatenate(want)
        assert rows.shape == (1, 1, len(want), 8)
        np.testing.assert_allclose(rows[0, 0], want, rtol=1e-6)
    # The image is the record's, resized to 24x24 (a red or green box keeps its colour inside).
    x = net.blobs["data"].data[0]
    assert x.max() > 150


def test_annotated_data_with_only_the_images_top(annoset):
    out, items = annoset
    text = data_net(out, 2)
    del text.layer[0].top[1:]
    net = Net(text, "TRAIN", device=CPUDevice(64 << 20))
    net.forward()
    assert net.blobs["data"].data.shape == (2, 3, 24, 24) and net.blobs["data"].data.max() > 150
    net.graph.layers[0].layer.close()


def test_annotated_data_mirror_flips_the_boxes(annoset):
    out, _ = annoset
    plain = Net(data_net(out, 5), "TRAIN", device=CPUDevice(64 << 20))
    mirrored = Net(data_net(out, 5, transform="mirror: true"), "TRAIN", device=CPUDevice(64 << 20))
    plain.forward()
    mirrored.forward()
    a, b = plain.blobs["label"].data[0, 0], mirrored.blobs["label"].data[0, 0]
    x, y = plain.blobs["data"].data, mirrored.blobs["data"].data
    flipped = [i for i in range(5) if not np.array_equal(x[i], y[i])]
    assert 0 < len(flipped) < 5                         # a coin per image
    for i in range(5):
        ra, rb = a[a[:, 0] == i], b[b[:, 0] == i]
        if i in flipped:
            np.testing.assert_array_equal(y[i], x[i][:, :, ::-1])
            np.testing.assert_allclose(rb[:, [3, 5]], 1 - ra[:, [5, 3]], atol=1e-6)
        else:
            np.testing.assert_array_equal(ra, rb)


def test_annotated_data_refuses_what_it_does_not_do(annoset):
    out, _ = annoset
    with pytest.raises((LayerError, GraphError), match="noise_param"):
        Net(data_net(out, 2, transform="noise_param { prob: 0.5 }"), "TRAIN", device=CPUDevice(64 << 20))
    with pytest.raises((LayerError, GraphError), match="crop_size"):
        Net(data_net(out, 2, transform="crop_size: 8"), "TRAIN", device=CPUDevice(64 << 20))
    bad = "annotated_data_param { batch_sampler { sampler { min_scale: 0.8 max_scale: 0.3 } } }"
    with pytest.raises((LayerError, GraphError), match="min_scale"):
        Net(data_net(out, 2, extra=bad), "TRAIN", device=CPUDevice(64 << 20))


SSD_AUGMENT = """annotated_data_param {
  batch_sampler { max_sample: 1 max_trials: 1 }
  batch_sampler { sampler { min_scale: 0.3 max_scale: 1.0 min_aspect_ratio: 0.5 max_aspect_ratio: 2.0 }
                  sample_constraint { min_jaccard_overlap: 0.3 } max_sample: 1 max_trials: 50 }
  batch_sampler { sampler { min_scale: 0.3 max_scale: 1.0 min_aspect_ratio: 0.5 max_aspect_ratio: 2.0 }
                  sample_constraint { max_jaccard_overlap: 1.0 } max_sample: 1 max_trials: 50 } }"""


@pytest.fixture(scope="module")
def one_box_set(tmp_path_factory):
    """Images with a single red rectangle on a blue background: a box must frame red pixels."""
    from sncaffe.data import image
    root = tmp_path_factory.mktemp("onebox")
    rng = np.random.default_rng(4)
    lines = []
    for i in range(6):
        h, w = (int(v) for v in rng.integers(40, 80, 2))
        x = np.zeros((3, h, w), np.uint8)
        x[0] = 200                                      # blue (BGR)
        bw, bh = int(rng.integers(w // 3, w // 2)), int(rng.integers(h // 3, h // 2))
        x0, y0 = int(rng.integers(0, w - bw)), int(rng.integers(0, h - bh))
        x[:, y0:y0 + bh, x0:x0 + bw] = np.array([0, 0, 255], np.uint8)[:, None, None]
        (root / f"{i}.png").write_bytes(image.encode(x))
        (root / f"{i}.txt").write_text(f"1 {x0} {y0} {x0 + bw} {y0 + bh}\n")
        lines.append(f"{i}.png {i}.txt\n")
    (root / "list.txt").write_text("".join(lines))
    assert create_annoset.main([str(root) + "/", str(root / "list.txt"), str(root / "db")]) == 0
    return root / "db"


def test_ssd_augmentation_keeps_the_boxes_on_the_objects(one_box_set):
    transform = ("mirror: true emit_constraint { emit_type: CENTER } "
                 "expand_param { prob: 0.5 max_expand_ratio: 3.0 } mean_value: 0 mean_value: 0 mean_value: 0")
    net = Net(data_net(one_box_set, 6, extra=SSD_AUGMENT, transform=transform), "TRAIN", device=CPUDevice(64 << 20))
    small = black = 0
    for _ in range(4):
        net.forward()
        x, rows = net.blobs["data"].data, net.blobs["label"].data[0, 0]
        assert len(rows) <= 6 and set(rows[:, 0]) <= set(range(6)) and np.all(rows[:, 1] == 1)
        for r in rows:
            x0, y0, x1, y1 = np.round(r[3:7] * 24).astype(int)
            inner = x[int(r[0]), :, y0 + 1:y1 - 1, x0 + 1:x1 - 1]
            if inner.size:                              # well inside the box: red, after resizing
                np.testing.assert_allclose(inner.mean(axis=(1, 2)), [0, 0, 255], atol=40)
            small += (r[5] - r[3]) * (r[6] - r[4]) < 0.09
        black += int((x.sum(axis=1) == 0).any(axis=(1, 2)).sum())   # the canvas of an expansion
    assert small > 0 and black > 0


def test_distortion_changes_colours_not_boxes(one_box_set):
    plain = Net(data_net(one_box_set, 6), "TRAIN", device=CPUDevice(64 << 20))
    distort = ("distort_param { brightness_prob: 1 brightness_delta: 32 contrast_prob: 1 contrast_lower: 0.5 "
               "contrast_upper: 1.5 hue_prob: 1 hue_delta: 18 saturation_prob: 1 saturation_lower: 0.5 "
               "saturation_upper: 1.5 }")
    distorted = Net(data_net(one_box_set, 6, transform=distort), "TRAIN", device=CPUDevice(64 << 20))
    plain.forward()
    distorted.forward()
    np.testing.assert_array_equal(plain.blobs["label"].data, distorted.blobs["label"].data)
    diff = np.abs(plain.blobs["data"].data - distorted.blobs["data"].data)
    assert diff.mean() > 5 and distorted.blobs["data"].data.min() >= 0 and distorted.blobs["data"].data.max() <= 255


def test_records_without_an_annotation_type_give_one_label_per_image(tmp_path):
    from sncaffe.data import datum
    from sncaffe.data.db import LMDBWriter
    with LMDBWriter(str(tmp_path / "db")) as db:
        for i in range(3):
            rec = annotated.make(datum.from_array(np.full((3, 6, 6), i * 10, np.uint8), label=i + 4), [])
            rec.ClearField("type")
            db.put(f"{i:08d}", rec.SerializeToString())
    net = Net(data_net(tmp_path / "db", 3), "TRAIN", device=CPUDevice(64 << 20))
    net.forward()
    np.testing.assert_array_equal(net.blobs["label"].data.reshape(-1), [4, 5, 6])
    assert net.blobs["label"].data.shape == (3, 1, 1, 1)
    np.testing.assert_allclose(net.blobs["data"].data.mean(axis=(1, 2, 3)), [0, 10, 20])
