"""What a command shows: throughputs that never read 0, and a stdout that fails (a full disk, a
closed pipe) never prints Python's "--- Logging error ---" tracebacks, the run going on to its end."""
import os
import subprocess
import sys

import pytest

from conftest import ROOT
from sncaffe.progress import rate

NET = """name: "tiny"
layer { name: "input" type: "Input" top: "data" top: "label"
        input_param { shape { dim: 2 dim: 8 } shape { dim: 2 } } }
layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip" inner_product_param { num_output: 2 } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
"""


def _train(tmp_path, stdout, iterations=30):
    (tmp_path / "net.prototxt").write_text(NET)
    argv = [sys.executable, "-m", "sncaffe.cli", "train", "net.prototxt", "--max-iter", str(iterations),
            "--snapshot-prefix", "s/t"]
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    return subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=stdout, stderr=subprocess.PIPE, text=True)


def test_rates_keep_three_significant_digits_and_give_seconds_per_iteration_when_slow():
    assert rate(32, 1000) == "0.032 images/s"
    assert rate(2, 62.5, iterations=1) == "0.032 images/s, 62.5 s/iteration"
    assert rate(64 * 100, 3.0, iterations=100) == "2133 images/s"
    assert rate(5, 4, "img/s") == "1.25 img/s"


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full on this system")
def test_a_full_stdout_drops_the_log_with_one_note(tmp_path):
    with open("/dev/full", "w") as full:
        job = _train(tmp_path, full)
        err = job.communicate(timeout=120)[1]
    assert job.returncode == 0 and "Logging error" not in err and "Traceback" not in err, err
    assert err.count("cannot write the log to stdout (No space left on device)") == 1
    assert (tmp_path / "s" / "t_iter_30.solverstate").exists()


def test_a_closed_pipe_drops_the_log_with_one_note(tmp_path):
    job = _train(tmp_path, subprocess.PIPE, iterations=300)    # its log lines outlast the first
    job.stdout.readline()
    job.stdout.close()                                     # as `| head -1` does
    err = job.communicate(timeout=120)[1]
    assert job.returncode == 0 and "Logging error" not in err and "Exception ignored" not in err, err
    assert err.count("cannot write the log to stdout (Broken pipe)") == 1
    assert (tmp_path / "s" / "t_iter_300.solverstate").exists()

