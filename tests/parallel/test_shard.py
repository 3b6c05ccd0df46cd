"""Sharded data: rank r of N at batch B gets rows [r*B, (r+1)*B) of what one process gets at batch N*B.

Data (LMDB, with random crops and mirrors), ImageData (shuffled, mirrored),
HDF5Data (shuffled), MemoryData and the synthetic Input feed, each over
several batches so the wrap-around and the reshuffles are crossed too.
No MPI needed: the shard is set by hand, as DataParallel sets it.
"""
import h5py
import numpy as np
import pytest

from sncaffe import Net
from sncaffe.backend.cpu import CPUDevice
from sncaffe.data.synthetic import SyntheticInputs
from sncaffe.data import datum as datums
from sncaffe.data import image
from sncaffe.data.db import LMDBWriter
from sncaffe.proto import sncaffe_pb2 as pb
from sncaffe.prototxt import parse_text

RANKS, BATCH, PASSES = 3, 2, 5


def net_of(layer, batch, seed=5, tops=("data", "label")):
    top = " ".join(f'top: "{t}"' for t in tops)
    text = f'name: "d" layer {{ name: "src" {top} {layer.replace("BATCH", str(batch))} }}'
    return Net(parse_text(text, pb.NetParameter()), "TRAIN", device=CPUDevice(16 << 20), seed=seed)


def read(net, passes, reset=None):
    if reset:
        reset(net.layers[0])
    out = []
    for _ in range(passes):
        net.forward()
        out.append({k: b.data.copy() for k, b in net.blobs.items()})
    if hasattr(net.layers[0], "close"):
        net.layers[0].close()
    return out


def assert_sharded(layer, reset=None):
    whole = read(net_of(layer, BATCH * RANKS), PASSES, reset)
    for rank in range(RANKS):
        net = net_of(layer, BATCH)
        net.layers[0].shard = (rank, RANKS)
        for mine, all_ in zip(read(net, PASSES, reset), whole):
            for k in mine:
                np.testing.assert_array_equal(mine[k], all_[k][rank * BATCH:(rank + 1) * BATCH], err_msg=k)


def images(n, shape, seed=0):
    return np.random.default_rng(seed).integers(0, 256, (n, *shape), dtype=np.uint8)


def test_data_with_random_crops_and_mirrors(tmp_path):
    with LMDBWriter(tmp_path / "db") as db:
        for i, x in enumerate(images(13, (3, 6, 5))):
            db.put(f"{i:08d}", datums.from_array(x, i).SerializeToString())
    assert_sharded(f'type: "Data" transform_param {{ crop_size: 4 mirror: true scale: 0.5 }} '
                   f'data_param {{ source: "{tmp_path}/db" batch_size: BATCH backend: LMDB }}')


def test_image_data_shuffled_and_mirrored(tmp_path):
    (tmp_path / "im").mkdir()
    for i, x in enumerate(images(7, (3, 4, 5))):
        (tmp_path / "im" / f"{i}.png").write_bytes(image.encode(x, "png"))
    (tmp_path / "list.txt").write_text("".join(f"{i}.png {i}\n" for i in range(7)))
    assert_sharded(f'type: "ImageData" transform_param {{ mirror: true }} image_data_param {{ '
                   f'source: "{tmp_path}/list.txt" root_folder: "{tmp_path}/im/" batch_size: BATCH '
                   f'shuffle: true }}')


def test_hdf5_data_shuffled_over_files(tmp_path):
    rng = np.random.default_rng(2)
    for name, n in (("a", 5), ("b", 8)):
        with h5py.File(tmp_path / f"{name}.h5", "w") as f:
            f["data"] = rng.standard_normal((n, 2, 3)).astype(np.float32)
            f["label"] = np.arange(n, dtype=np.float32) + (100 if name == "b" else 0)
    (tmp_path / "list.txt").write_text(f"{tmp_path}/a.h5\n{tmp_path}/b.h5\n")
    assert_sharded(f'type: "HDF5Data" hdf5_data_param {{ source: "{tmp_path}/list.txt" batch_size: BATCH '
                   f'shuffle: true }}')


def test_memory_data_wraps_around():
    data = np.random.default_rng(3).standard_normal((12, 1, 2, 3)).astype(np.float32)
    labels = np.arange(12, dtype=np.float32)
    assert_sharded('type: "MemoryData" memory_data_param { batch_size: BATCH channels: 1 height: 2 width: 3 }',
                   reset=lambda layer: layer.reset(data, labels))


@pytest.mark.parametrize("phase", ["TRAIN", "TEST"])
def test_synthetic_inputs_shard_train_nets(phase):
    def fed(batch, shard=(0, 1)):
        text = (f'name: "s" layer {{ name: "in" type: "Input" top: "x" top: "label" input_param {{ '
                f'shape {{ dim: {batch} dim: 3 }} shape {{ dim: {batch} }} }} }} '
                f'layer {{ name: "ip" type: "InnerProduct" bottom: "x" top: "y" '
                f'inner_product_param {{ num_output: 5 }} }} '
                f'layer {{ name: "loss" type: "SoftmaxWithLoss" bottom: "y" bottom: "label" top: "loss" }}')
        net, feed = Net(parse_text(text, pb.NetParameter()), phase, device=CPUDevice(1 << 20)), SyntheticInputs(9)
        feed.shard = shard
        feed(net, 4)
        return {k: net.blobs[k].data.copy() for k in ("x", "label")}
    whole = fed(BATCH * RANKS)
    for rank in range(RANKS):
        mine = fed(BATCH, (rank, RANKS))
        # Test nets run on rank 0 alone, on the batches one process would test on.
        expected = {k: v[rank * BATCH:(rank + 1) * BATCH] for k, v in whole.items()} if phase == "TRAIN" \
            else fed(BATCH)
        for k in mine:
            np.testing.assert_array_equal(mine[k], expected[k], err_msg=k)
