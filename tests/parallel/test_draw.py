"""``sncaffe draw``: the net as Caffe's draw_net.py draws it, and the locations of model parallelism."""
import re
import shutil
import subprocess
import sys

import pytest

from conftest import ROOT
from sncaffe.proto import sncaffe_pb2 as pb
from sncaffe.prototxt import read_text

graphviz = pytest.importorskip("graphviz", reason="the graphviz package is not installed (pip install graphviz)")
from sncaffe.draw import COPY_FILL, LOCATION_COLORS, NEURON_FILL, TYPE_FILL, draw  # noqa: E402

LENET = ROOT / "prototxt" / "lenet_train_test.prototxt"


def nodes(dot):
    """node id -> its attribute text, for every node statement of a .dot source."""
    return {m.group(1): m.group(2) for m in re.finditer(r"^\s*(\w+) \[(.*)\]$", dot, re.M)
            if m.group(1) not in ("graph", "node", "edge")}


def label(attrs):
    m = re.search(r'label=(?:"([^"]*)"|(\S+))', attrs)
    return m.group(1) if m.group(1) is not None else m.group(2)


def labels(dot, shape):
    return [label(a) for a in nodes(dot).values() if f"shape={shape}" in a]


def layers_by_name(dot):
    """The first line of each layer's label (its name) -> (node id, attributes)."""
    return {label(a).split("\\n")[0]: (i, a) for i, a in nodes(dot).items() if "shape=record" in a}


def cli(*args):
    return subprocess.run([sys.executable, "-m", "sncaffe.cli", "draw", *map(str, args)], capture_output=True,
                          text=True, timeout=60)


def test_dot_has_every_layer_and_blob_as_caffe_draws_them(tmp_path):
    out = cli(LENET, tmp_path / "lenet.dot")
    assert out.returncode == 0 and "Drawing net to" in out.stdout, out.stderr
    dot = (tmp_path / "lenet.dot").read_text()
    param = read_text(LENET, pb.NetParameter())
    layers = labels(dot, "record")
    assert len(layers) == len(param.layer)                      # both phases' data layers: Caffe's ALL
    assert {lb.split("\\n")[0] for lb in layers} == {lp.name for lp in param.layer}
    blobs = {b for lp in param.layer for b in list(lp.top) + list(lp.bottom)}
    assert sorted(labels(dot, "octagon")) == sorted(blobs)
    assert r"conv1\n(Convolution)\nkernel size: 5\nstride: 1\npad: 0" in dot
    assert r"pool1\n(MAX Pooling)\nkernel size: 2\nstride: 2\npad: 0" in dot
    named = layers_by_name(dot)
    assert f'fillcolor="{TYPE_FILL["Convolution"]}"' in named["conv1"][1]
    assert f'fillcolor="{NEURON_FILL}"' in named["relu1"][1]     # in place
    relu, ip1 = named["relu1"][0], next(i for i, a in nodes(dot).items() if "label=ip1 " in a)
    assert f"{ip1} -> {relu}" in dot and f"{relu} -> {ip1}" in dot     # the loop of an in-place layer
    assert '[label="Batch 64"]' in dot and "[label=500]" in dot


def test_phase_and_rankdir(tmp_path):
    draw(read_text(LENET, pb.NetParameter()), tmp_path / "t.dot", rankdir="TB", phase="TRAIN")
    dot = (tmp_path / "t.dot").read_text()
    assert "rankdir=TB" in dot and "accuracy" not in dot
    assert "conv1 (Convolution) kernel size: 5" in dot          # words on one line when vertical


def test_locations_are_coloured_and_copies_shown(tmp_path):
    param = read_text(LENET, pb.NetParameter())
    for lp in param.layer:
        if lp.name in ("ip1", "relu1", "ip2"):
            lp.location = "cpu:1"
    draw(param, tmp_path / "p.dot", phase="TRAIN")
    dot = (tmp_path / "p.dot").read_text()
    color = LOCATION_COLORS[0]
    copies = [a for a in nodes(dot).values() if "(Copy)" in a]
    assert [label(a).split("\\n")[0] for a in copies] == ["pool2_to_cpu:1", "ip2_to_default"]
    assert all(f'fillcolor="{COPY_FILL}"' in a for a in copies)
    located = [a for a in nodes(dot).values() if r"\n@ cpu:1" in a]
    assert {label(a).split("\\n")[0] for a in located} == {"ip1", "relu1", "ip2", "pool2_to_cpu:1"}
    assert all(f'color="{color}"' in a for a in located)
    assert "cluster_locations" in dot and 'label="cpu:1"' in dot and "the net's device" in dot


@pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz's dot is not installed (apt-get install graphviz)")
@pytest.mark.parametrize("suffix, magic", [(".png", b"\x89PNG"), (".svg", b"<?xml")])
def test_rendered_with_dot(tmp_path, suffix, magic):
    out = cli(LENET, tmp_path / f"lenet{suffix}", "--rankdir", "TB")
    assert out.returncode == 0, out.stderr
    assert (tmp_path / f"lenet{suffix}").read_bytes().startswith(magic)


def test_without_dot_png_is_a_clear_error_and_dot_still_works(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))            # no dot program to find
    param = read_text(LENET, pb.NetParameter())
    with pytest.raises(RuntimeError, match=r"drawing PNG needs Graphviz's dot program.*apt-get install graphviz"):
        draw(param, tmp_path / "x.png")
    assert draw(param, tmp_path / "x.gv").endswith("x.gv")
    with pytest.raises(ValueError, match="unknown drawing format 'jpgg'"):
        draw(param, tmp_path / "x.jpgg")


def test_cli_place_draws_the_copies(tmp_path):
    out = cli(LENET, tmp_path / "p.dot", "--phase", "TRAIN", "--place", "ip1=cpu:1")
    assert out.returncode == 0, out.stderr
    dot = (tmp_path / "p.dot").read_text()
    assert "pool2_to_cpu:1\\n(Copy)\\n@ cpu:1" in dot and 'label="cpu:1"' in dot
