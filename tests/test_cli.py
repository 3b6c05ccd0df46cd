import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from sncaffe import blobproto
from sncaffe.cli import main
from sncaffe.proto import sncaffe_pb2 as pb

ROOT = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, OPENBLAS_NUM_THREADS="1", PYTHONPATH=str(ROOT))

NET = """name: "tiny"
layer { name: "input" type: "Input" top: "data" top: "label"
        input_param { shape { dim: 4 dim: 3 dim: 8 dim: 8 } shape { dim: 4 } } }
layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip" inner_product_param { num_output: 5 } }
layer { name: "relu" type: "ReLU" bottom: "ip" top: "ip" }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
"""

# Learns something from synthetic data: weights drawn at random, an Accuracy output.
TRAINABLE = """name: "tiny"
layer { name: "input" type: "Input" top: "data" top: "label"
        input_param { shape { dim: 4 dim: 3 dim: 4 dim: 4 } shape { dim: 4 } } }
layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip"
        inner_product_param { num_output: 3 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
layer { name: "acc" type: "Accuracy" bottom: "ip" bottom: "label" top: "acc" }
"""

SOLVER = """net: "tiny.prototxt"
test_iter: 2
test_interval: 5
base_lr: 0.1
momentum: 0.9
lr_policy: "fixed"
display: 5
max_iter: 10
snapshot: 5
snapshot_prefix: "snap/tiny"
random_seed: 3
"""


def _run(*argv):
    return subprocess.run([sys.executable, "-m", "sncaffe.cli", *map(str, argv)], capture_output=True,
                          text=True, env=ENV, timeout=120)


def _state(path):
    return blobproto.read_binary(path, pb.SolverState())


def _params(path):
    model = blobproto.read_caffemodel(path)
    return {lp.name: [np.array(b.data) for b in lp.blobs] for lp in model.layer if lp.blobs}


@pytest.fixture
def work(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny.prototxt").write_text(TRAINABLE)
    (tmp_path / "solver.prototxt").write_text(SOLVER)
    return tmp_path


# -- time ---------------------------------------------------------------------

def test_time_prints_per_layer_times_and_pool_peak(tmp_path, capsys):
    path = tmp_path / "tiny.prototxt"
    path.write_text(NET)
    assert main(["time", str(path), "--iterations", "2", "--batch", "2", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    for layer in ("input", "ip", "relu", "loss"):
        assert any(line.split()[:1] == [layer] for line in out.splitlines()), layer
    assert "Average Forward pass" in out and "Average Backward pass" in out
    assert "Pool peak" in out and "images/s" in out
    assert out.count("CPU threads: 1 thread (--threads;") == 1      # the thread decision, once


@pytest.mark.parametrize("loss", [True, False], ids=["train-net", "deploy-net"])
def test_time_runs_the_backward_training_runs(tmp_path, capsys, monkeypatch, loss):
    """As caffe time: each layer's backward with the net's own bottom_need_backward, so the first
    layer takes no gradient of the data (training does not); a net without a loss, where nothing
    would run backward, times every layer's backward as if forced."""
    from sncaffe.layers.inner_product import InnerProduct
    calls = []
    real = InnerProduct.backward
    monkeypatch.setattr(InnerProduct, "backward",
                        lambda self, top, propagate_down, bottom: calls.append(list(propagate_down))
                        or real(self, top, propagate_down, bottom))
    text = NET if loss else NET.split('layer { name: "loss"')[0]
    path = tmp_path / "tiny.prototxt"
    path.write_text(text)
    assert main(["time", str(path), "--iterations", "2", "--batch", "2", "--threads", "1"]) == 0
    assert calls and all(c == [not loss] for c in calls)
    out = capsys.readouterr().out
    ip = next(line.split() for line in out.splitlines() if line.split()[:1] == ["ip"])
    assert float(ip[-1]) > 0                 # its backward timed either way


def test_errors_are_one_line_and_exit_nonzero(tmp_path):
    path = tmp_path / "bad.prototxt"
    path.write_text(NET.replace("num_output", "num_outputs"))
    r = _run("time", path)
    assert r.returncode == 1
    assert f'{path}:4: layer "ip": unknown field "num_outputs"' in r.stderr
    assert "Traceback" not in r.stderr


# -- train ----------------------------------------------------------------------

def test_train_a_net_with_default_solver_and_synthetic_inputs(work, capsys):
    assert main(["train", "tiny.prototxt"]) == 0
    out = capsys.readouterr().out
    assert "is a net: training it with the default solver" in out
    assert "Input layers get synthetic data: data: N(0,1), label: integers in [0, 3)" in out
    assert re.search(r"^I\d{4} [\d:.]+ \d+ solver.py:\d+\] Iteration 10 \(", out, re.M)   # glog's prefix
    # the rate of the iterations run since the last line, and the time left for the whole run
    assert re.search(r"\] Iteration 0 \([\d.]+ iter/s(, [\d.]+ s/iter)?, [\d.]+ images/s\), ETA \d+[smhd]", out)
    assert re.search(r"\] Iteration 90 \([\d.]+ iter/s(, [\d.]+ s/iter)?, [\d.]+ images/s\), ETA \d+s, loss", out)
    assert "Memory: tiny fits on cpu: mode 'none' (auto) needs device" in out       # said before binding
    assert "Iteration 100, loss = " in out and "Optimization Done." in out
    assert _state("out/tiny_iter_100.solverstate").iter == 100
    assert (work / "out/tiny_iter_100.caffemodel").is_file()


def test_train_from_a_solver_tests_and_snapshots(work, capsys):
    assert main(["train", "solver.prototxt"]) == 0
    out = capsys.readouterr().out
    assert "Iteration 10, Testing net (#0)" in out
    assert re.search(r"Test net output #\d: acc = [\d.]+", out)
    assert "Test net output #1: loss = " in out and "(* 1 = " in out
    assert "Train net output #0: acc = " in out
    assert [_state(f"snap/tiny_iter_{i}.solverstate").iter for i in (5, 10)] == [5, 10]
    assert "Trained to iteration 10 in" in out


def test_flags_override_the_solver(work, capsys):
    assert main(["train", "solver.prototxt", "--max-iter", "7", "--base-lr", "0.25", "--batch", "2",
                 "--snapshot-prefix", "deep/er/run", "--seed", "5"]) == 0
    out = capsys.readouterr().out
    assert "Iteration 0, lr = 0.25" in out
    assert sorted(p.name for p in (work / "deep/er").iterdir()) == [
        "run_iter_5.caffemodel", "run_iter_5.solverstate", "run_iter_7.caffemodel", "run_iter_7.solverstate"]
    assert _state("deep/er/run_iter_7.solverstate").iter == 7
    model = blobproto.read_caffemodel("deep/er/run_iter_7.caffemodel")
    shapes = [list(s.dim) for s in model.layer[0].input_param.shape]
    assert shapes == [[2, 3, 4, 4], [2]]                    # --batch reached the net
    assert not (work / "snap").exists()


def test_snapshot_prefix_directory_takes_the_solver_name(work, capsys):
    assert main(["train", "solver.prototxt", "--max-iter", "2", "--snapshot-prefix", "runs/"]) == 0
    assert (work / "runs/solver_iter_2.solverstate").is_file()


def test_weights_initialize_by_layer_name(work, capsys):
    assert main(["train", "tiny.prototxt", "--max-iter", "3", "--snapshot-prefix", "a/m"]) == 0
    trained = _params("a/m_iter_3.caffemodel")
    # base_lr 0: the weights given are the weights kept.
    assert main(["train", "tiny.prototxt", "--weights", "a/m_iter_3.caffemodel", "--base-lr", "0",
                 "--max-iter", "1", "--snapshot-prefix", "b/m"]) == 0
    assert "Finetuning from a/m_iter_3.caffemodel" in capsys.readouterr().out
    again = _params("b/m_iter_1.caffemodel")
    for a, b in zip(trained["ip"], again["ip"]):
        np.testing.assert_array_equal(a, b)


def test_resume_equals_an_uninterrupted_run(work, capsys):
    assert main(["train", "solver.prototxt", "--snapshot-prefix", "full/t"]) == 0
    assert main(["train", "solver.prototxt", "--max-iter", "5", "--snapshot-prefix", "half/t"]) == 0
    assert main(["train", "solver.prototxt", "--snapshot", "half/t_iter_5.solverstate",
                 "--snapshot-prefix", "half/t"]) == 0
    assert "Restoring previous solver status from half/t_iter_5.solverstate" in capsys.readouterr().out
    assert _state("half/t_iter_10.solverstate").iter == 10
    assert (work / "full/t_iter_10.caffemodel").read_bytes() == (work / "half/t_iter_10.caffemodel").read_bytes()


def test_progress_bar_on_a_terminal(work, capsys, monkeypatch):
    import sncaffe.progress
    monkeypatch.setattr(sncaffe.progress, "is_terminal", lambda: True)
    assert main(["train", "tiny.prototxt", "--max-iter", "20"]) == 0
    out, err = capsys.readouterr()
    assert "train: 100%" in err and "20/20" in err and "loss=" in err and "lr=0.01" in err
    assert "img/s" in err and "peak " in err
    assert re.search(r"20/20 \[\d\d:\d\d<\d\d:\d\d, ", err)          # the time spent, and left
    assert re.search(r"^\d\d:\d\d:\d\d Iteration 10 \(", out, re.M)   # short lines above the bar


def test_sigint_snapshots_and_exits_cleanly(work):
    (work / "long.prototxt").write_text(SOLVER.replace("max_iter: 10", "max_iter: 1000000")
                                        .replace("snapshot: 5", "snapshot: 0"))
    p = subprocess.Popen([sys.executable, "-m", "sncaffe.cli", "train", "long.prototxt"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=ENV)
    lines = []
    for line in p.stdout:
        lines.append(line)
        if "Iteration 5 (" in line:
            p.send_signal(signal.SIGINT)
            break
    out, err = p.communicate(timeout=60)
    out = "".join(lines) + out
    assert p.returncode == 0, err
    assert "SIGINT: snapshotting and stopping" in out and "Optimization stopped early." in out
    it = int(re.search(r"snap/tiny_iter_(\d+)\.solverstate", out).group(1))
    assert it >= 6 and _state(f"snap/tiny_iter_{it}.solverstate").iter == it
    assert err == ""


def test_sighup_snapshots_and_goes_on(work, capsys, monkeypatch):
    # The handler is installed in this process: a SIGHUP sent from a callback reaches it at once.
    from sncaffe.solvers import Solver
    real = Solver.__init__

    def init(self, *a, **k):
        real(self, *a, **k)
        self.callbacks.append(lambda it, loss, lr: it == 3 and os.kill(os.getpid(), signal.SIGHUP))
    monkeypatch.setattr(Solver, "__init__", init)
    assert main(["train", "solver.prototxt", "--max-iter", "5", "--snapshot-prefix", "h/t"]) == 0
    assert "SIGHUP: snapshotting after this iteration" in capsys.readouterr().out
    assert sorted(p.name for p in (work / "h").glob("*.solverstate")) == ["t_iter_3.solverstate",
                                                                         "t_iter_5.solverstate"]


def test_a_signal_during_a_log_write_logs_its_line_after_it(monkeypatch):
    """A signal's handler runs between two bytecodes of the main thread, which may be inside a write to
    the log's stream; its line must not be written from there (a nested write to a buffered stream
    raises "reentrant call" and the line was lost: a flaky test_sigint_snapshots_and_exits_cleanly)."""
    import logging
    import threading
    from types import SimpleNamespace
    from sncaffe import run
    got, nested = [], []

    class Stream(logging.Handler):
        inside = False

        def emit(self, record):
            if self.inside:                          # the write the interrupted one was in the middle of
                nested.append(record.getMessage())
                return
            self.inside = True
            try:
                if record.getMessage() == "writing":
                    os.kill(os.getpid(), signal.SIGHUP)     # the handler runs before the next bytecode
                    for _ in range(1000):
                        pass
                got.append(record.getMessage())
            finally:
                self.inside = False
    stream = Stream()
    log = logging.getLogger("sncaffe")
    monkeypatch.setattr(log, "level", logging.INFO)
    log.addHandler(stream)
    solver = SimpleNamespace(request_stop=lambda: None, snapshots=[])
    solver.request_snapshot = lambda: solver.snapshots.append(1)
    try:
        with run.signal_effects(solver, "stop", "snapshot"):
            log.info("writing")
            for t in threading.enumerate():
                if t.name == "sncaffe-signal-log":
                    t.join(10)
    finally:
        log.removeHandler(stream)
    assert nested == [] and solver.snapshots == [1]
    assert got == ["writing", "SIGHUP: snapshotting after this iteration"]


@pytest.mark.parametrize("argv, message", [
    (["train", "missing.prototxt"], "missing.prototxt: cannot read: No such file or directory"),
    (["train", "bad_solver.prototxt"], 'bad_solver.prototxt:4: unknown field "base_lrr" (in SolverParameter)'),
    (["train", "bad_net.prototxt"], 'bad_net.prototxt:4: layer "ip": unknown field "num_outputs"'),
    (["train", "uses_bad_net.prototxt"], 'bad_net.prototxt:4: layer "ip": unknown field "num_outputs"'),
    (["train", "solver.prototxt", "--snapshot", "nope.solverstate"], "nope.solverstate: cannot read"),
    (["train", "solver.prototxt", "--snapshot", "x.solverstate", "--weights", "x.caffemodel"], "not both"),
    (["train", "no_test_iter.prototxt"], "no_test_iter.prototxt: test_interval must be > 0"),
    (["test", "tiny.prototxt", "--weights", "nope.caffemodel"], "nope.caffemodel: cannot read"),
])
def test_bad_input_is_one_line_on_stderr(work, argv, message):
    (work / "bad_solver.prototxt").write_text(SOLVER.replace("base_lr", "base_lrr"))
    (work / "bad_net.prototxt").write_text(NET.replace("num_output", "num_outputs"))
    (work / "uses_bad_net.prototxt").write_text(SOLVER.replace("tiny.prototxt", "bad_net.prototxt"))
    (work / "no_test_iter.prototxt").write_text(SOLVER.replace("test_interval: 5", ""))
    r = _run(*argv)
    assert r.returncode == 1
    assert r.stderr.count("\n") == 1 and message in r.stderr, r.stderr
    assert r.stderr.startswith(f"sncaffe {argv[0]}: error: ")


# -- test -----------------------------------------------------------------------

def test_test_averages_every_output(work, capsys):
    assert main(["train", "tiny.prototxt", "--max-iter", "3", "--snapshot-prefix", "m/t"]) == 0
    capsys.readouterr()
    assert main(["test", "tiny.prototxt", "--weights", "m/t_iter_3.caffemodel", "--iterations", "3"]) == 0
    out = capsys.readouterr().out
    batches = {name: [float(v) for v in re.findall(rf"Batch \d, {name} = (\S+)", out)] for name in ("acc", "loss")}
    assert [len(v) for v in batches.values()] == [3, 3]
    acc = float(re.search(r"\] acc = (\S+)", out).group(1))
    loss = float(re.search(r"\] loss = (\S+) \(\* 1 = (\S+) loss\)", out).group(1))
    assert acc == pytest.approx(np.mean(batches["acc"]), rel=1e-5)
    assert loss == pytest.approx(np.mean(batches["loss"]), rel=1e-5)
    assert float(re.search(r"Loss: (\S+)", out).group(1)) == pytest.approx(loss, rel=1e-5)


def test_synthetic_labels_take_the_class_count_of_the_scores():
    from sncaffe.data.synthetic import SyntheticInputs, label_classes
    from sncaffe.net import Net
    from sncaffe.prototxt import parse_text
    net = Net(parse_text(TRAINABLE, pb.NetParameter()))
    assert label_classes(net) == {"label": 3}
    SyntheticInputs(1)(net, 0)
    labels = net.blobs["label"].data
    assert set(np.unique(labels)) <= {0, 1, 2} and labels.dtype == np.float32


# -- LeNet on MNIST ---------------------------------------------------------------

MNIST = ROOT / "data/mnist"


@pytest.mark.skipif(not (MNIST / "t10k-images-idx3-ubyte.gz").is_file(), reason="data/mnist not present")
def test_lenet_learns_mnist(tmp_path, capsys):
    """300 iterations at batch 64 on 2,000 MNIST images: above 90% on 500 others (about 15 s)."""
    images, labels = MNIST / "t10k-images-idx3-ubyte.gz", MNIST / "t10k-labels-idx1-ubyte.gz"
    for name, start, count in (("train", 0, 2000), ("test", 8000, 500)):
        subprocess.run([sys.executable, str(ROOT / "tools/convert_mnist_data.py"), images, labels,
                        tmp_path / name, "--start", str(start), "--count", str(count)], check=True, env=ENV,
                       capture_output=True)
    net = (ROOT / "prototxt/lenet_train_test.prototxt").read_text()
    net = net.replace("data/mnist/mnist_train_lmdb", str(tmp_path / "train"))
    net = net.replace("data/mnist/mnist_test_lmdb", str(tmp_path / "test"))
    (tmp_path / "lenet.prototxt").write_text(net)
    solver = (ROOT / "prototxt/lenet_solver.prototxt").read_text()
    solver = solver.replace('"prototxt/lenet_train_test.prototxt"', f'"{tmp_path / "lenet.prototxt"}"')
    solver = re.sub(r"test_iter: \d+", "test_iter: 5", solver)
    solver = re.sub(r"test_interval: \d+", "test_interval: 300", solver)
    (tmp_path / "solver.prototxt").write_text(solver)
    assert main(["train", str(tmp_path / "solver.prototxt"), "--max-iter", "300",
                 "--snapshot-prefix", str(tmp_path / "out/lenet")]) == 0
    out = capsys.readouterr().out
    accuracy = float(re.findall(r"Test net output #0: accuracy = (\S+)", out)[-1])
    assert accuracy > 0.9, out[-2000:]
    assert (tmp_path / "out/lenet_iter_300.caffemodel").is_file()


# -- the command line as a thin shell ---------------------------------------------------

CONV = """name: "convs"
layer { name: "input" type: "Input" top: "data" top: "label"
        input_param { shape { dim: 2 dim: 3 dim: 8 dim: 8 } shape { dim: 2 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "c1" convolution_param { num_output: 4 kernel_size: 3 } }
layer { name: "pool1" type: "Pooling" bottom: "c1" top: "p1" pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "conv2" type: "Convolution" bottom: "p1" top: "c2" convolution_param { num_output: 4 kernel_size: 3 } }
layer { name: "ip" type: "InnerProduct" bottom: "c2" top: "ip" inner_product_param { num_output: 3 } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
"""


def test_the_command_line_touches_no_private_name():
    """cli.py and caffe_cli.py call public functions only: no ``x._name`` and no import of a
    ``_name``, so what a command does, a program or a test can do the same way."""
    import ast
    for path in (ROOT / "sncaffe/cli.py", ROOT / "sncaffe/caffe_cli.py"):
        private = []
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([node.attr] if isinstance(node, ast.Attribute) else
                     [a.name.split(".")[-1] for a in node.names] + [node.module or ""]
                     if isinstance(node, ast.ImportFrom) else
                     [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            private += [f"{path.name}:{node.lineno}: {n}" for name in names for n in name.split(".")
                        if n.startswith("_") and not n.startswith("__")]
        assert private == [], private
    assert len((ROOT / "sncaffe/cli.py").read_text().splitlines()) + \
        len((ROOT / "sncaffe/caffe_cli.py").read_text().splitlines()) <= 600


def test_version_and_help_for_every_flag(capsys):
    from sncaffe import __version__
    from sncaffe.cli import parser
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out == f"sncaffe {__version__}\n"
    p = parser()
    for name, sub in p.commands.items():
        bare = [a.option_strings or a.dest for a in sub._actions if not a.help]
        assert bare == [], (name, bare)
        assert "(default: None)" not in sub.format_help(), name


def test_time_counts_convolutions_not_their_operators(tmp_path, capsys):
    from sncaffe.backend import onednn
    path = tmp_path / "convs.prototxt"
    path.write_text(CONV)
    assert main(["time", str(path), "--iterations", "1", "--threads", "1"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("CPU convolutions:"))
    if onednn.version():
        assert re.search(r": \d of 2 convolutions on oneDNN", line), line    # the pooling is not one
    else:
        assert "oneDNN not installed" in line


def test_plan_opens_with_a_verdict_for_the_device_asked(tmp_path, capsys):
    path = tmp_path / "convs.prototxt"
    path.write_text(CONV)
    assert main(["plan", str(path), "--device-memory", "64MiB"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert re.match(r"convs fits on cpu: mode '\w+' \(auto\) needs device [\d.]+ \w*B of 64.00 MiB, host .* "
                    r"moved per iteration$", first), first
    assert main(["plan", str(path), "--device-memory", "1KiB", "--memory", "liveness"]) == 0
    assert capsys.readouterr().out.startswith("convs does NOT fit on cpu: mode 'liveness' needs device")
    assert main(["plan", str(path), "--device", "cuda", "--device-memory", "1GiB"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("convs fits on cuda: mode ") and "planned for cuda: convolution workspaces" in out
