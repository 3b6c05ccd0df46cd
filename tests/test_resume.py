"""Bit-exact resume for every data layer: 2N iterations equal N, a snapshot,
a resume and N more, to the last bit; the reader's cursor and every random stream are restored."""
import h5py
import numpy as np
import pytest
from google.protobuf import text_format

from sncaffe import blobproto
from sncaffe.data import datum as datums
from sncaffe.data.db import LMDBWriter
from sncaffe.data.image import encode
from sncaffe.proto import sncaffe_pb2 as pb
from sncaffe.solvers import Solver

N = 4           # iterations per half; 10 records at batch 4: the readers wrap and reshuffle in each half
RECORDS = 10

HEAD = """
layer { name: "ip1" type: "InnerProduct" bottom: "data" top: "ip1"
        inner_product_param { num_output: 6 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "drop" type: "Dropout" bottom: "ip1" top: "ip1" dropout_param { dropout_ratio: 0.5 } }
layer { name: "ip2" type: "InnerProduct" bottom: "ip1" top: "ip2"
        inner_product_param { num_output: 3 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip2" bottom: "label" top: "loss" }
"""


def images(seed=0, shape=(3, 6, 5)):
    return np.random.default_rng(seed).integers(0, 256, (RECORDS, *shape), dtype=np.uint8)


def lmdb_layer(tmp_path):
    with LMDBWriter(tmp_path / "db") as db:
        for i, x in enumerate(images()):
            db.put(f"{i:08d}", datums.from_array(x, i % 3).SerializeToString())
    return (f'layer {{ name: "d" type: "Data" top: "data" top: "label" data_param {{ source: "{tmp_path / "db"}" '
            'batch_size: 4 backend: LMDB rand_skip: 3 } transform_param { crop_size: 4 mirror: true scale: 0.01 } }')


def leveldb_layer(tmp_path):
    from sncaffe.data.leveldb import LevelDBWriter
    with LevelDBWriter(tmp_path / "ldb") as db:
        for i, x in enumerate(images()):
            db.put(f"{i:08d}", datums.from_array(x, i % 3).SerializeToString())
    return (f'layer {{ name: "d" type: "Data" top: "data" top: "label" data_param {{ source: "{tmp_path / "ldb"}" '
            'batch_size: 4 backend: LEVELDB rand_skip: 3 } transform_param { crop_size: 4 mirror: true scale: 0.01 } }')


def image_layer(tmp_path):
    lines = []
    for i, x in enumerate(images()):
        (tmp_path / f"{i}.png").write_bytes(encode(x))
        lines.append(f"{i}.png {i % 3}")
    (tmp_path / "list.txt").write_text("\n".join(lines) + "\n")
    return (f'layer {{ name: "d" type: "ImageData" top: "data" top: "label" image_data_param {{ '
            f'source: "{tmp_path / "list.txt"}" root_folder: "{tmp_path}/" batch_size: 4 shuffle: true }} '
            'transform_param { crop_size: 4 mirror: true scale: 0.01 } }')


def window_layer(tmp_path):
    lines = []
    for k, x in enumerate(images(shape=(3, 12, 10))[:2]):
        (tmp_path / f"w{k}.png").write_bytes(encode(x))
        windows = ["1 0.9 1 1 6 6", "2 0.8 2 2 8 9", "0 0.1 0 0 4 4", "0 0.2 3 5 9 11"]
        lines += [f"# {k}", f"w{k}.png", "3", "12", "10", str(len(windows)), *windows]
    (tmp_path / "windows.txt").write_text("\n".join(lines) + "\n")
    return (f'layer {{ name: "d" type: "WindowData" top: "data" top: "label" window_data_param {{ '
            f'source: "{tmp_path / "windows.txt"}" root_folder: "{tmp_path}/" batch_size: 4 fg_fraction: 0.5 }} '
            'transform_param { crop_size: 4 mirror: true scale: 0.01 } }')


def hdf5_layer(tmp_path):
    rng = np.random.default_rng(1)
    names = []
    for k, rows in enumerate((4, 6, 3)):
        with h5py.File(tmp_path / f"f{k}.h5", "w") as f:
            f["data"] = rng.standard_normal((rows, 3, 4, 4)).astype(np.float32)
            f["label"] = rng.integers(0, 3, rows).astype(np.float32)
        names.append(str(tmp_path / f"f{k}.h5"))
    (tmp_path / "h5.txt").write_text("\n".join(names) + "\n")
    return (f'layer {{ name: "d" type: "HDF5Data" top: "data" top: "label" hdf5_data_param {{ '
            f'source: "{tmp_path / "h5.txt"}" batch_size: 4 shuffle: true }} }}')


def memory_layer(tmp_path):
    return ('layer { name: "d" type: "MemoryData" top: "data" top: "label" memory_data_param { '
            'batch_size: 4 channels: 3 height: 4 width: 4 } }')


LAYERS = {"Data": lmdb_layer, "Data (LevelDB)": leveldb_layer, "ImageData": image_layer, "HDF5Data": hdf5_layer, "WindowData": window_layer, "MemoryData": memory_layer}


def solver(layer, prefix, max_iter):
    p = text_format.Parse(f'base_lr: 0.1 momentum: 0.9 lr_policy: "fixed" random_seed: 7 '
                          f'snapshot_prefix: "{prefix}" max_iter: {max_iter}', pb.SolverParameter())
    text_format.Parse(layer + HEAD, p.net_param)
    s = Solver(p)
    if "MemoryData" in layer:                   # handed its arrays again by the caller on a resume
        rng = np.random.default_rng(2)
        s.net.layers[0].reset(rng.standard_normal((RECORDS * 2, 3, 4, 4)).astype(np.float32),
                              rng.integers(0, 3, RECORDS * 2).astype(np.float32))
    return s


def params(s):
    return {f"{name}[{i}]": b.data.copy() for name, blobs in s.net.params.items() for i, b in enumerate(blobs)}


def run(s, resume=None):
    try:
        s.solve(resume)
        return params(s)
    finally:
        for layer in s.net.layers:
            if hasattr(layer, "close"):
                layer.close()


@pytest.mark.parametrize("kind", list(LAYERS))
def test_2n_iterations_equal_n_resume_n_to_the_last_bit(tmp_path, kind):
    layer = LAYERS[kind](tmp_path)
    straight = run(solver(layer, tmp_path / "a", 2 * N))
    run(solver(layer, tmp_path / "b", N))
    state = tmp_path / f"b_iter_{N}.solverstate"
    kinds = {s.layer: s for s in blobproto.read_binary(state, pb.SolverState()).layer_state}
    assert kinds["d"].cursor and kinds["drop"].rng           # the data cursor and Dropout's stream
    resumed = run(solver(layer, tmp_path / "b", 2 * N), state)
    for k, v in straight.items():
        assert np.array_equal(resumed[k], v), k
    assert (tmp_path / f"a_iter_{2 * N}.caffemodel").read_bytes() == \
        (tmp_path / f"b_iter_{2 * N}.caffemodel").read_bytes()


def test_a_reader_without_tell_and_seek_resumes_by_counting_records(tmp_path, monkeypatch):
    import sncaffe.data.db as db

    class Plain(db.LMDBReader):         # only iteration, as a key-value reader may offer
        tell = seek = None
    monkeypatch.setattr(db, "LMDBReader", Plain)
    layer = lmdb_layer(tmp_path)
    straight = run(solver(layer, tmp_path / "a", 2 * N))
    run(solver(layer, tmp_path / "b", N))
    state = tmp_path / f"b_iter_{N}.solverstate"
    cursor = [s.cursor for s in blobproto.read_binary(state, pb.SolverState()).layer_state if s.layer == "d"][0]
    assert '"key": null' in cursor and '"records": ' in cursor
    resumed = run(solver(layer, tmp_path / "b", 2 * N), state)
    for k, v in straight.items():
        assert np.array_equal(resumed[k], v), k


def test_an_old_solverstate_without_the_record_loads_and_restarts_the_reader(tmp_path):
    layer = lmdb_layer(tmp_path)
    straight = run(solver(layer, tmp_path / "a", 2 * N))
    run(solver(layer, tmp_path / "b", N))
    path = tmp_path / f"b_iter_{N}.solverstate"
    state = blobproto.read_binary(path, pb.SolverState())
    state.ClearField("layer_state")                  # as Caffe or an older sncaffe wrote it
    path.write_bytes(state.SerializeToString())
    resumed = run(solver(layer, tmp_path / "b", 2 * N), path)
    assert resumed.keys() == straight.keys()
    assert not np.array_equal(resumed["ip1[0]"], straight["ip1[0]"])   # the reader started over, as in Caffe


def test_a_resume_state_that_does_not_fit_the_data_is_an_error(tmp_path):
    layer = image_layer(tmp_path)
    run(solver(layer, tmp_path / "b", N))
    (tmp_path / "list.txt").write_text("0.png 0\n1.png 1\n")          # the list changed since
    with pytest.raises(ValueError, match=r'resume state of layer "d" \(train net\) does not fit it: .*list of '
                                         r"10 images"):
        run(solver(layer, tmp_path / "b", 2 * N), tmp_path / f"b_iter_{N}.solverstate")
