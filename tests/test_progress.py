"""The log on stdout: a stdout that fails (a full disk, a closed pipe) never prints Python's
"--- Logging error ---" tracebacks, and the run goes on to its end."""
import os
import subprocess
import sys

import pytest

from conftest import ROOT

NET = """name: "tiny"
layer { name: "input" type: "Input" top: "data" top: "label"
        input_param { shape { dim: 2 dim: 8 } shape { dim: 2 } } }
layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip" inner_product_param { num_output: 2 } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
"""


def _train(tmp_path, stdout, iterations=30):
    (tmp_path / "net.prototxt").write_text(NET)
    argv = [sys.executable, "-m", "sncaffe.cli", "train", "net.prototxt", "--max-iter", str(iterations), "--snapshot-prefix", "s/t"]
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    return subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=stdout, stderr=subprocess.PIPE, text=True)


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full on this system")
def test_a_full_stdout_drops_the_log_with_one_note(tmp_path):
    with open("/dev/full", "w") as full:
        job = _train(tmp_path, full)
        err = job.communicate(timeout=120)[1]
    assert job.returncode == 0 and "Logging error" not in err and "Traceback" not in err, err
    assert err.count("cannot write the log to stdout (No space left on device)") == 1
    assert (tmp_path / "s" / "t_iter_30.solverstate").exists()


def test_a_closed_pipe_drops_the_log_with_one_note(tmp_path):
    job = _train(tmp_path, subprocess.PIPE, iterations=1000)   # its log lines outlast the first
    job.stdout.readline()
    job.stdout.close()                                     # as `| head -1` does
    err = job.communicate(timeout=120)[1]
    assert job.returncode == 0 and "Logging error" not in err and "Exception ignored" not in err, err
    assert err.count("cannot write the log to stdout (Broken pipe)") == 1
    assert (tmp_path / "s" / "t_iter_1000.solverstate").exists()
