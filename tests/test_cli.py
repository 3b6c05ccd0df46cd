import subprocess
import sys

from sncaffe.cli import main

NET = """name: "tiny"
layer { name: "input" type: "Input" top: "data" top: "label"
        input_param { shape { dim: 4 dim: 3 dim: 8 dim: 8 } shape { dim: 4 } } }
layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip" inner_product_param { num_output: 5 } }
layer { name: "relu" type: "ReLU" bottom: "ip" top: "ip" }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
"""


def test_time_prints_per_layer_times_and_pool_peak(tmp_path, capsys):
    path = tmp_path / "tiny.prototxt"
    path.write_text(NET)
    assert main(["time", str(path), "--iterations", "2", "--batch", "2"]) == 0
    out = capsys.readouterr().out
    for layer in ("input", "ip", "relu", "loss"):
        assert any(line.split()[:1] == [layer] for line in out.splitlines()), layer
    assert "Average Forward pass" in out and "Average Backward pass" in out
    assert "Pool peak" in out and "images/s" in out


def test_errors_are_one_line_and_exit_nonzero(tmp_path):
    path = tmp_path / "bad.prototxt"
    path.write_text(NET.replace("num_output", "num_outputs"))
    r = subprocess.run([sys.executable, "-m", "sncaffe.cli", "time", str(path)], capture_output=True, text=True)
    assert r.returncode == 1
    assert f'{path}:4: layer "ip": unknown field "num_outputs"' in r.stderr
    assert "Traceback" not in r.stderr
