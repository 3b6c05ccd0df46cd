"""LevelDB (data/leveldb.py, Caffe's default Data backend) through plyvel: the reader and writer,
the converters' --backend leveldb, LeNet trained from it, and Caffe's Siamese example end to end."""
import gzip
import subprocess
import sys

import numpy as np
import pytest

from conftest import ROOT, SHARED
from sncaffe.backend.cpu import CPUDevice
from sncaffe.layers import REGISTRY
from sncaffe.proto import sncaffe_pb2 as pb
from sncaffe.prototxt import parse_text
from sncaffe.solver import Solver

plyvel = pytest.importorskip("plyvel", reason="plyvel (the leveldb extra) is not installed")
from sncaffe.data import datum as datums  # noqa: E402
from sncaffe.data.leveldb import LevelDBReader, LevelDBWriter, close_leveldb, open_leveldb  # noqa: E402

MNIST = next((d for d in (ROOT / "data" / "mnist", SHARED and SHARED / "data" / "mnist")
              if d and (d / "t10k-labels-idx1-ubyte.gz").exists()), ROOT / "data" / "mnist")


def convert(out, *args):
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "convert_mnist_data.py"),
                        str(MNIST / "t10k-images-idx3-ubyte.gz"), str(MNIST / "t10k-labels-idx1-ubyte.gz"),
                        str(out), *map(str, args)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    return out


def mnist(n):
    with gzip.open(MNIST / "t10k-images-idx3-ubyte.gz") as f:
        x = np.frombuffer(f.read(), np.uint8, offset=16)[:n * 784].reshape(n, 28, 28)
    with gzip.open(MNIST / "t10k-labels-idx1-ubyte.gz") as f:
        y = np.frombuffer(f.read(), np.uint8, offset=8)[:n]
    return x, y


def test_reader_and_writer(tmp_path):
    with LevelDBWriter(tmp_path / "db") as db:
        for i in (2, 0, 1):
            db.put(f"{i:08d}", bytes([i]) * 3)
    r = LevelDBReader(tmp_path / "db")
    assert r.entries == 3 and r.first() == (b"00000000", b"\0\0\0")
    got = [next(r) for _ in range(5)]                        # key order, starting over after the last
    assert [k for k, _ in got] == [b"00000000", b"00000001", b"00000002", b"00000000", b"00000001"]
    second = LevelDBReader(tmp_path / "db")                  # one handle, shared (LevelDB locks its folder)
    assert second.db is r.db
    second.close()
    assert next(r)[0] == b"00000002"
    assert r.tell() == b"00000002"
    r.seek(b"00000000")                                       # resume after a key (a snapshot's cursor)
    assert [next(r)[0] for _ in range(3)] == [b"00000001", b"00000002", b"00000000"]
    r.seek(None)
    assert r.tell() is None and next(r)[0] == b"00000000"
    r.seek(b"00000005")
    with pytest.raises(ValueError, match="key 00000005, where the snapshot stopped reading, is not in the database"):
        next(r)
    r.close()
    with pytest.raises(FileExistsError, match="already exists"):
        LevelDBWriter(tmp_path / "db")
    with pytest.raises(FileNotFoundError, match="LevelDB .*nowhere does not exist"):
        LevelDBReader(tmp_path / "nowhere")
    plyvel.DB(str(tmp_path / "empty"), create_if_missing=True).close()
    with pytest.raises(ValueError, match="LevelDB .*empty holds no records"):
        open_leveldb(tmp_path / "empty")
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "CURRENT").write_text("MANIFEST-000099\n")
    with pytest.raises(ValueError, match="LevelDB .*junk cannot be opened"):
        open_leveldb(tmp_path / "junk")
    close_leveldb(tmp_path / "never-opened")                 # harmless


def lenet(source, backend, batch=8):
    return f"""
name: "LeNet"
layer {{ name: "mnist" type: "Data" top: "data" top: "label" transform_param {{ scale: 0.00390625 }}
        data_param {{ source: "{source}" batch_size: {batch} backend: {backend} }} }}
layer {{ name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
        convolution_param {{ num_output: 4 kernel_size: 5 weight_filler {{ type: "xavier" }} }} }}
layer {{ name: "pool1" type: "Pooling" bottom: "conv1" top: "pool1"
        pooling_param {{ pool: MAX kernel_size: 2 stride: 2 }} }}
layer {{ name: "ip1" type: "InnerProduct" bottom: "pool1" top: "ip1"
        inner_product_param {{ num_output: 10 weight_filler {{ type: "xavier" }} }} }}
layer {{ name: "loss" type: "SoftmaxWithLoss" bottom: "ip1" bottom: "label" top: "loss" }}
"""


def solve(net_text, iters, seed=1701, **fields):
    p = pb.SolverParameter(base_lr=0.01, momentum=0.9, lr_policy="fixed", max_iter=iters, display=0,
                           random_seed=seed, snapshot_after_train=False, **fields)
    p.net_param.CopyFrom(parse_text(net_text, pb.NetParameter()))
    losses = []
    s = Solver(p, device=CPUDevice(64 << 20))
    s.callbacks.append(lambda it, loss, lr: losses.append(loss))
    return s, losses


def test_lenet_data_layer_reads_leveldb_as_lmdb(tmp_path):
    """LeNet trains from a LevelDB written by convert_mnist_data.py --backend leveldb exactly as
    from the LMDB it writes by default: the same batches, so the same losses to the bit."""
    level = convert(tmp_path / "train_leveldb", "--count", 40, "--backend", "leveldb")
    lmdb = convert(tmp_path / "train_lmdb", "--count", 40)
    assert (level / "CURRENT").exists() and (lmdb / "data.mdb").exists()
    x, y = mnist(40)
    s, level_losses = solve(lenet(level, "LEVELDB"), 6)
    net = s.net
    net.forward()
    np.testing.assert_array_equal(net.blobs["data"].data[:, 0], x[:8] * np.float32(0.00390625))
    np.testing.assert_array_equal(net.blobs["label"].data, y[:8])
    s.solve()
    other, lmdb_losses = solve(lenet(lmdb, "LMDB"), 6)
    other.net.forward()                 # the same first batch read before training
    other.solve()
    assert len(level_losses) == 6 and level_losses == lmdb_losses
    for net_ in (s.net, other.net):
        net_.layers[0].close()
    r = LevelDBReader(level)
    k, v = r.first()
    r.close()
    d = datums.parse(v)
    assert k == b"00000000" and (d.channels, d.height, d.width, d.label) == (1, 28, 28, y[0])


def test_converter_writes_siamese_pairs(tmp_path):
    db = convert(tmp_path / "pairs", "--count", 50, "--backend", "leveldb", "--pairs", "--seed", 3)
    x, y = mnist(50)
    r = LevelDBReader(db)
    recs = [datums.parse(next(r)[1]) for _ in range(r.entries)]
    r.close()
    assert len(recs) == 50
    for d in recs:
        a = np.frombuffer(d.data, np.uint8).reshape(2, 28, 28)
        i = next(i for i in range(50) if (x[i] == a[0]).all())
        j = next(j for j in range(50) if (x[j] == a[1]).all())
        assert d.label == int(y[i] == y[j])
    assert 0 < sum(d.label for d in recs) < 50


SIAMESE = """
name: "mnist_siamese_train_test"
layer { name: "pair_data" type: "Data" top: "pair_data" top: "sim" include { phase: TRAIN }
        transform_param { scale: 0.00390625 } data_param { source: "%(train)s" batch_size: 16 } }
layer { name: "pair_data" type: "Data" top: "pair_data" top: "sim" include { phase: TEST }
        transform_param { scale: 0.00390625 } data_param { source: "%(test)s" batch_size: 20 } }
layer { name: "slice_pair" type: "Slice" bottom: "pair_data" top: "data" top: "data_p"
        slice_param { slice_dim: 1 slice_point: 1 } }
%(branch)s
%(branch_p)s
layer { name: "loss" type: "ContrastiveLoss" bottom: "feat" bottom: "feat_p" bottom: "sim" top: "loss"
        contrastive_loss_param { margin: 1 } }
"""
BRANCH = """
layer { name: "conv1%(p)s" type: "Convolution" bottom: "data%(p)s" top: "conv1%(p)s"
        param { name: "conv1_w" lr_mult: 1 } param { name: "conv1_b" lr_mult: 2 }
        convolution_param { num_output: 8 kernel_size: 5 stride: 1
                            weight_filler { type: "xavier" } bias_filler { type: "constant" } } }
layer { name: "pool1%(p)s" type: "Pooling" bottom: "conv1%(p)s" top: "pool1%(p)s"
        pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "ip1%(p)s" type: "InnerProduct" bottom: "pool1%(p)s" top: "ip1%(p)s"
        param { name: "ip1_w" lr_mult: 1 } param { name: "ip1_b" lr_mult: 2 }
        inner_product_param { num_output: 32 weight_filler { type: "xavier" } bias_filler { type: "constant" } } }
layer { name: "relu1%(p)s" type: "ReLU" bottom: "ip1%(p)s" top: "ip1%(p)s" }
layer { name: "feat%(p)s" type: "InnerProduct" bottom: "ip1%(p)s" top: "feat%(p)s"
        param { name: "feat_w" lr_mult: 1 } param { name: "feat_b" lr_mult: 2 }
        inner_product_param { num_output: 2 weight_filler { type: "xavier" } bias_filler { type: "constant" } } }
"""


@pytest.mark.skipif("ContrastiveLoss" not in REGISTRY,
                    reason="ContrastiveLoss is not registered yet (helper \"layers\" adds it in another branch)")
def test_siamese_example_trains_from_leveldb(tmp_path):
    """Caffe's examples/siamese (Data from LevelDB, Caffe's default backend; Slice; weights shared
    by name; ContrastiveLoss) trains end to end from pairs written by convert_mnist_data.py."""
    train = convert(tmp_path / "mnist_siamese_train_leveldb", "--count", 320, "--backend", "leveldb", "--pairs")
    test = convert(tmp_path / "mnist_siamese_test_leveldb", "--start", 320, "--count", 80,
                   "--backend", "leveldb", "--pairs", "--seed", 1)
    text = SIAMESE % dict(train=train, test=test, branch=BRANCH % dict(p=""), branch_p=BRANCH % dict(p="_p"))
    s, losses = solve(text, 60, test_iter=[4], test_interval=60, test_initialization=True)
    assert s.net.layers[0].param.data_param.backend == pb.DataParameter.LEVELDB      # the default
    before = s.test(0)["loss"]
    s.solve()
    after = s.test_scores[0]["loss"]
    assert len(losses) == 60 and np.isfinite(losses).all()
    assert after < before, (before, after)
    for name in ("conv1", "ip1", "feat"):
        for a, b in zip(s.net.params[name], s.net.params[name + "_p"]):
            assert np.shares_memory(a.data, b.data)
    assert len(s.history) == 6          # SGD: one history blob per shared parameter, not per layer
    for net in [s.net] + s.test_nets:
        net.layers[0].close()


def test_compute_image_mean_reads_leveldb(tmp_path):
    level = convert(tmp_path / "level", "--count", 30, "--backend", "leveldb")
    lmdb = convert(tmp_path / "lmdb", "--count", 30)
    for db, extra in ((level, ["--backend", "leveldb"]), (lmdb, [])):
        r = subprocess.run([sys.executable, str(ROOT / "tools" / "compute_image_mean.py"), str(db),
                            str(db) + ".binaryproto", *extra], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
    assert (tmp_path / "level.binaryproto").read_bytes() == (tmp_path / "lmdb.binaryproto").read_bytes()
    x, _ = mnist(30)
    mean = np.array(pb.BlobProto.FromString((tmp_path / "level.binaryproto").read_bytes()).data)
    np.testing.assert_allclose(mean, x.astype(np.float64).mean(0).ravel(), rtol=1e-5)
