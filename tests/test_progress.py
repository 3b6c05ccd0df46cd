"""What a long run shows: rates to three significant digits and the time left; and a stdout that
fails (a full disk, a closed pipe) never prints Python's "--- Logging error ---" tracebacks, the run
going on to its end."""
import os
import subprocess
import sys

import pytest

from conftest import ROOT
from sncaffe.progress import Pace, duration, rate, sig3


@pytest.mark.parametrize("x, text", [(1366, "1370"), (1.6, "1.60"), (0.0098, "0.00980"), (99.96, "100"),
                                     (0.00012345, "0.000123"), (123456, "123000"), (0, "0")])
def test_three_significant_digits_never_zero(x, text):
    assert sig3(x) == text


@pytest.mark.parametrize("seconds, text", [(0.4, "0s"), (42, "42s"), (125, "2m05s"), (10080, "2h48m"),
                                           (90000, "1d01h")])
def test_duration(seconds, text):
    assert duration(seconds) == text


def test_rate_says_seconds_per_iteration_under_one_a_second():
    assert rate(1, 102, 1.6 * 102) == "0.00980 iter/s, 102 s/iter, 1.60 images/s"
    assert rate(10, 8.1, 64) == "1.23 iter/s, 79.0 images/s"
    assert rate(3, 1e-12) .endswith("iter/s")


def test_pace_counts_the_iterations_run_and_estimates_the_whole_run():
    now = [0.0]
    pace = Pace(0, 100, images=2, clock=lambda: now[0])
    now[0] = 102.0                       # iteration 0's passes: one iteration, not ten
    assert pace.mark(0) == "(0.00980 iter/s, 102 s/iter, 0.0196 images/s), ETA 2h48m"
    now[0] = 102.0 + 10 * 51
    # the rate since the last line; the time left at the pace of the whole run (612 s for 11)
    assert pace.mark(10) == "(0.0196 iter/s, 51.0 s/iter, 0.0392 images/s), ETA 1h22m"
    now[0] += 51
    assert pace.mark(99).endswith("ETA 0s")

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

