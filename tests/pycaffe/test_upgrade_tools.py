"""Caffe's upgrade tools as installed commands: upgrade_net_proto_text, upgrade_net_proto_binary,
upgrade_solver_proto_text, run on old files as a Caffe user runs them."""
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from sncaffe.blobproto import read_binary
from sncaffe.proto import sncaffe_pb2 as pb
from sncaffe.prototxt import parse_text, read_text
from sncaffe.tools.upgrade_proto import net_binary, net_text, solver_text

V1_NET = """name: "v1"
input: "data" input_dim: 2 input_dim: 3 input_dim: 4 input_dim: 4
layers { name: "ip" type: INNER_PRODUCT bottom: "data" top: "ip" blobs_lr: 1 blobs_lr: 2
         inner_product_param { num_output: 5 } }
layers { name: "relu" type: RELU bottom: "ip" top: "ip" }
"""


def test_upgrade_net_proto_text_is_an_installed_command(tmp_path):
    tool = Path(sys.executable).parent / "upgrade_net_proto_text"
    if not tool.exists():
        pytest.skip("the console scripts are not installed here (pip install -e .)")
    (tmp_path / "old.prototxt").write_text(V1_NET)
    done = subprocess.run([str(tool), str(tmp_path / "old.prototxt"), str(tmp_path / "new.prototxt")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert f"Wrote upgraded NetParameter text to {tmp_path / 'new.prototxt'}" in done.stdout
    new = read_text(tmp_path / "new.prototxt", pb.NetParameter())
    assert not new.layers and not new.input
    assert [(l.name, l.type) for l in new.layer] == [("input", "Input"), ("ip", "InnerProduct"), ("relu", "ReLU")]
    assert list(new.layer[0].input_param.shape[0].dim) == [2, 3, 4, 4]
    assert [p.lr_mult for p in new.layer[1].param] == [1, 2]


def test_upgrade_net_proto_binary_keeps_the_weights(tmp_path):
    old = parse_text(V1_NET, pb.NetParameter())
    w = np.arange(5 * 48, dtype=np.float32).reshape(5, 48)
    blob = old.layers[0].blobs.add()
    blob.num, blob.channels, blob.height, blob.width = 1, 1, 5, 48     # a V1 caffemodel's 4-D shape
    blob.data.extend(w.ravel().tolist())
    (tmp_path / "old.caffemodel").write_bytes(old.SerializeToString())
    assert net_binary([str(tmp_path / "old.caffemodel"), str(tmp_path / "new.caffemodel")]) == 0
    new = read_binary(tmp_path / "new.caffemodel", pb.NetParameter())       # as written, not upgraded on read
    assert not new.layers and [l.type for l in new.layer] == ["Input", "InnerProduct", "ReLU"]
    np.testing.assert_array_equal(np.array(new.layer[1].blobs[0].data).reshape(5, 48), w)


def test_upgrade_solver_proto_text_and_errors(tmp_path, capsys):
    (tmp_path / "old_solver.prototxt").write_text('net: "n.prototxt" base_lr: 0.01 solver_type: NESTEROV')
    assert solver_text([str(tmp_path / "old_solver.prototxt"), str(tmp_path / "solver.prototxt")]) == 0
    new = read_text(tmp_path / "solver.prototxt", pb.SolverParameter())
    assert new.type == "Nesterov" and not new.HasField("solver_type") and new.base_lr == pytest.approx(0.01)
    capsys.readouterr()
    assert net_text([str(tmp_path / "missing.prototxt"), str(tmp_path / "x")]) == 1
    assert "upgrade_net_proto_text: error: " in capsys.readouterr().err
    (tmp_path / "bad.prototxt").write_text('layers { name: "x" type: CONVOLUTION bottom: "d" top: "y" nonsense: 1 }')
    assert net_text([str(tmp_path / "bad.prototxt"), str(tmp_path / "x")]) == 1
    assert "bad.prototxt:1" in capsys.readouterr().err
    assert net_binary([str(tmp_path / "only_one")]) == 2
    assert "usage: upgrade_net_proto_binary INPUT OUTPUT" in capsys.readouterr().err
