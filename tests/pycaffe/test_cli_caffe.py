"""Every Caffe command-line form (tools/caffe.cpp's flags) run through ``sncaffe``, and the tools
Caffe installs: parse_log's CSV, ``sncaffe plot``, ``--metrics``, extract_features."""
import csv
import json
import re

import numpy as np
import pytest
from PIL import Image

from sncaffe.backend.cuda import unusable_reason
from sncaffe.cli import main
from pycaffe_fixtures import lenet_fixture, trained_fixture  # noqa: F401 (fixtures)

NO_GPU = unusable_reason()
needs_no_gpu = pytest.mark.skipif(NO_GPU is None, reason="a GPU is usable here: the no-GPU errors cannot show")


@pytest.fixture(scope="module")
def run(lenet, tmp_path_factory):
    """A 10-iteration run of `sncaffe train -solver S ...` (Caffe's spelling): its log and folder."""
    d = tmp_path_factory.mktemp("cli")
    solver = lenet["solver"].read_text().replace(str(lenet["dir"] / "snap/lenet"), str(d / "lenet"))
    solver = re.sub(r"test_interval: \d+", "test_interval: 5", re.sub(r"display: \d+", "display: 2", solver))
    (d / "solver.prototxt").write_text(solver.replace("snapshot: 0", "snapshot: 10"))
    return d


def train(capsys, *argv):
    rc = main(["train", *map(str, argv)])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_train_solver_iterations_signal_effects_and_metrics(run, capsys):
    # Caffe's train ignores -iterations (the solver's max_iter counts): so does sncaffe, saying so
    rc, log, err = train(capsys, "-solver", run / "solver.prototxt", "-iterations", 3, "--max-iter", 10,
                         "-sigint_effect", "snapshot", "--sighup_effect=none", "--metrics", run / "metrics.jsonl")
    assert rc == 0, err
    assert "sncaffe train: warning: -iterations is ignored by train" in err
    assert (run / "lenet_iter_10.caffemodel").is_file() and (run / "lenet_iter_10.solverstate").is_file()
    assert "Iteration 10, Testing net (#0)" in log
    (run / "train.log").write_text(log)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if r["phase"] == "train"]
    test_rows = [r for r in rows if r["phase"] == "test"]
    assert [r["NumIters"] for r in train_rows] == [0, 2, 4, 6, 8]
    assert sorted(r["NumIters"] for r in test_rows) == [0, 5, 10]
    assert set(test_rows[0]) == {"phase", "NumIters", "Seconds", "LearningRate", "accuracy", "loss"}
    assert f"loss = {train_rows[1]['loss']:.6g}" in log


def test_train_snapshot_and_weights(run, capsys):
    if not (run / "lenet_iter_10.solverstate").is_file():
        test_train_solver_iterations_signal_effects_and_metrics(run, capsys)
    rc, log, _ = train(capsys, "-solver", run / "solver.prototxt", "-snapshot", run / "lenet_iter_10.solverstate",
                       "--max-iter", 12)
    assert rc == 0 and "Restoring previous solver status" in log and "Iteration 12, Testing" not in log
    rc, log, _ = train(capsys, f"-solver={run / 'solver.prototxt'}", "-weights", run / "lenet_iter_10.caffemodel",
                       "--max-iter", 1)
    assert rc == 0 and f"Finetuning from {run / 'lenet_iter_10.caffemodel'}" in log


def test_test_model_weights_iterations_phase_stage_level(lenet, run, capsys, tmp_path):
    net = lenet["train_val"].read_text()
    extra = """
layer { name: "top2" type: "Accuracy" bottom: "ip2" bottom: "label" top: "top2"
  accuracy_param { top_k: 2 } include { phase: TEST stage: "top2" } }
layer { name: "top3" type: "Accuracy" bottom: "ip2" bottom: "label" top: "top3"
  accuracy_param { top_k: 3 } include { phase: TEST min_level: 1 } }
"""
    (tmp_path / "net.prototxt").write_text(net.replace('layer {\n  name: "loss"', extra + 'layer {\n  name: "loss"'))
    weights = run / "lenet_iter_10.caffemodel"
    args = ["test", "-model", tmp_path / "net.prototxt", "-weights", weights, "-iterations", 2, "-phase", "TEST"]
    assert main([str(a) for a in args]) == 0
    log = capsys.readouterr().out
    assert re.search(r"\] accuracy = [0-9.]+", log) and "top2 =" not in log and "top3 =" not in log
    assert main([str(a) for a in args + ["-stage", "top2,other", "-level", 1]]) == 0
    log = capsys.readouterr().out
    acc, top2, top3 = (float(re.search(rf"\] {k} = ([0-9.]+)", log).group(1)) for k in ("accuracy", "top2", "top3"))
    assert acc <= top2 <= top3


def test_time_model_iterations(lenet, capsys):
    assert main(["time", "-model", str(lenet["train_val"]), "-iterations", "1", "-phase", "TEST"]) == 0
    out = capsys.readouterr().out
    assert "Average Forward pass" in out and re.search(r"^conv1\s+Convolution", out, re.M)


@needs_no_gpu
def test_gpu_forms_without_a_gpu(run, capsys, tmp_path):
    rc, _, err = train(capsys, "-solver", run / "solver.prototxt", "-gpu", 0)
    assert rc == 1 and "sncaffe train: error:" in err and "cuda" in err
    rc, _, err = train(capsys, "-solver", run / "solver.prototxt", "-gpu", "all")
    assert rc == 1 and "cuda" in err
    with pytest.raises(SystemExit) as e:
        train(capsys, "-solver", run / "solver.prototxt", "-gpu", "0,1")
    assert e.value.code == 2 and "mpiexec -n 2 sncaffe train" in capsys.readouterr().err
    (tmp_path / "gpu_solver.prototxt").write_text((run / "solver.prototxt").read_text().replace(
        "solver_mode: CPU", "solver_mode: GPU\ndevice_id: 1"))
    rc, _, err = train(capsys, tmp_path / "gpu_solver.prototxt")
    assert rc == 1 and "sets solver_mode: GPU (device_id 1), but no GPU is usable here" in err
    assert main(["device_query", "-gpu", "0"]) == 1
    assert "sncaffe device_query: error:" in capsys.readouterr().err


@pytest.mark.skipif(NO_GPU is not None, reason=f"no GPU: {NO_GPU}")
def test_device_query_on_a_gpu(capsys):
    assert main(["device_query", "-gpu", "0"]) == 0
    assert "Total global memory:" in capsys.readouterr().out


@pytest.mark.parametrize("argv, hint", [
    (["train", "-solverr", "s.prototxt"], "did you mean -solver?"),
    (["test", "-model", "n.prototxt", "-weigths", "w"], "did you mean -weights?"),
    (["time", "-modle", "n.prototxt"], "did you mean -model?"),
    (["train", "s.prototxt", "--max-iterr", "3"], "did you mean --max-iter?"),
])
def test_unknown_flags_get_the_usage_and_a_hint(argv, hint, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"usage: sncaffe {argv[0]}" in err and hint in err


def test_parse_log_gives_caffes_columns(run, capsys, tmp_path):
    if not (run / "train.log").is_file():
        test_train_solver_iterations_signal_effects_and_metrics(run, capsys)
    from sncaffe.tools.parse_log import main as parse_log
    assert parse_log([str(run / "train.log"), str(tmp_path)]) == 0
    with open(tmp_path / "train.log.train") as f:
        train = list(csv.reader(f))
    with open(tmp_path / "train.log.test") as f:
        test = list(csv.reader(f))
    assert train[0] == ["NumIters", "Seconds", "LearningRate", "loss"]
    assert test[0] == ["NumIters", "Seconds", "LearningRate", "accuracy", "loss"]
    assert [float(r[0]) for r in train[1:]] == [0, 2, 4, 6, 8] and [float(r[0]) for r in test[1:]] == [0, 5, 10]
    log = (run / "train.log").read_text()
    assert float(train[2][2]) == float(re.search(r"Iteration 0, lr = ([0-9.e-]+)", log).group(1))
    secs = [float(r[1]) for r in train[1:]]
    assert secs == sorted(secs) and secs[0] >= 0


def test_plot_writes_a_png(run, capsys, tmp_path):
    if not (run / "train.log").is_file():
        test_train_solver_iterations_signal_effects_and_metrics(run, capsys)
    assert main(["plot", str(run / "train.log"), "-o", str(tmp_path / "curves.png")]) == 0
    with Image.open(tmp_path / "curves.png") as img:
        assert img.format == "PNG" and img.size[0] > 300
        assert np.asarray(img.convert("L")).std() > 5        # curves drawn, not a blank page
    (tmp_path / "empty.log").write_text("nothing here\n")
    assert main(["plot", str(tmp_path / "empty.log")]) == 1
    assert "no display or test lines" in capsys.readouterr().err
    assert main(["plot", str(run / "train.log"), "-o", str(tmp_path / "curves.xyz")]) == 1
    assert f"{tmp_path / 'curves.xyz'}: Format 'xyz' is not supported" in capsys.readouterr().err


def test_extract_features(lenet, trained, tmp_path, capsys):
    from sncaffe.data.datum import parse
    from sncaffe.data.db import LMDBReader
    from sncaffe.tools.extract_features import main as extract_features
    assert extract_features([str(trained), str(lenet["train_val"]), "ip2,pool1", f"{tmp_path / 'ip2'},{tmp_path / 'pool1'}",
                             "2", "lmdb", "CPU"]) == 0
    assert "Extracted features of 200 query images for feature blob ip2" in capsys.readouterr().out
    import sncaffe.pycaffe as caffe
    net = caffe.Net(str(lenet["train_val"]), caffe.TEST, weights=str(trained))
    first = net.forward(blobs=["pool1"])
    key, value = LMDBReader(tmp_path / "pool1").first()
    datum = parse(value)
    assert key == b"0000000000" and (datum.channels, datum.height, datum.width) == (20, 12, 12)
    np.testing.assert_allclose(np.array(datum.float_data).reshape(20, 12, 12), first["pool1"][0], rtol=1e-5)
    assert LMDBReader(tmp_path / "ip2").entries == 200
    assert extract_features(["w", "n", "a,b", "x", "1", "lmdb"]) == 1
    assert "one dataset per blob" in capsys.readouterr().err
    assert extract_features([str(trained), str(lenet["train_val"]), "ip2", str(tmp_path / "ip2"), "1", "lmdb"]) == 1
    assert "ip2 already exists" in capsys.readouterr().err


def test_extract_features_to_leveldb(lenet, trained, tmp_path, capsys):
    pytest.importorskip("plyvel", reason="LevelDB needs plyvel (the leveldb extra)")
    from sncaffe.data.datum import parse
    from sncaffe.data.leveldb import LevelDBReader
    from sncaffe.tools.extract_features import main as extract_features
    assert extract_features([str(trained), str(lenet["train_val"]), "ip2", str(tmp_path / "ip2_leveldb"),
                             "1", "leveldb"]) == 0
    import sncaffe.pycaffe as caffe
    net = caffe.Net(str(lenet["train_val"]), caffe.TEST, weights=str(trained))
    ip2 = net.forward(blobs=["ip2"])["ip2"]
    db = LevelDBReader(tmp_path / "ip2_leveldb")
    records = [next(db) for _ in range(8)]        # Caffe's cursor: it starts over after the last
    n = db.entries
    db.close()
    assert n == 100 and records[7][0] == b"0000000007"
    datum = parse(records[7][1])
    assert (datum.channels, datum.height, datum.width) == (10, 1, 1)
    np.testing.assert_allclose(datum.float_data, ip2[7], rtol=1e-5)
    assert extract_features(["w", "n", "a", "x", "1", "rocksdb"]) == 1
    assert "lmdb or leveldb" in capsys.readouterr().err


def test_train_stage_and_level(lenet, run, capsys, tmp_path):
    extra = """
layer { name: "train_acc" type: "Accuracy" bottom: "ip2" bottom: "label" top: "train_acc"
  include { phase: TRAIN stage: "watch" min_level: 2 } }
"""
    net = lenet["train_val"].read_text()
    (tmp_path / "net.prototxt").write_text(net.replace('layer {\n  name: "loss"', extra + 'layer {\n  name: "loss"'))
    solver = (run / "solver.prototxt").read_text()
    solver = re.sub(r'net: ".*"', f'net: "{tmp_path / "net.prototxt"}"', solver).replace("snapshot: 10", "snapshot: 0")
    (tmp_path / "solver.prototxt").write_text(solver.replace(str(run / "lenet"), str(tmp_path / "s")))
    for flags, shown in (([], False), (["-stage", "watch"], False), (["-stage", "other,watch", "-level", 2], True)):
        rc, log, err = train(capsys, "-solver", tmp_path / "solver.prototxt", "-iterations", 1, *flags)
        assert rc == 0, err
        assert bool(re.search(r"Train net output #\d: train_acc = ", log)) == shown
