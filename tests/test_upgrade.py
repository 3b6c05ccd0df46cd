"""Old formats upgraded on load (upgrade.py), as Caffe's upgrade_proto.cpp; fork fields read as BVLC's."""
import logging

import numpy as np
import pytest

from sncaffe import Net
from sncaffe.gradcheck import Harness, make_layer
from sncaffe.backend.cpu import CPUDevice
from sncaffe.cli import main
from sncaffe.prototxt import load_net, parse_text, read_solver
from sncaffe.proto import sncaffe_pb2 as pb
from sncaffe.upgrade import UpgradeError, upgrade_net

V0 = """
name: "v0"
input: "data" input_dim: 2 input_dim: 3 input_dim: 8 input_dim: 8
layers { layer { name: "pad1" type: "padding" pad: 2 } bottom: "data" top: "pad1" }
layers { layer { name: "conv1" type: "conv" num_output: 4 kernelsize: 3 stride: 2 biasterm: false
                 weight_filler { type: "xavier" } blobs_lr: 1 weight_decay: 0 } bottom: "pad1" top: "conv1" }
layers { layer { name: "pool1" type: "pool" pool: AVE kernelsize: 2 stride: 2 } bottom: "conv1" top: "pool1" }
layers { layer { name: "ip" type: "innerproduct" num_output: 5 } bottom: "pool1" top: "ip" }
layers { layer { name: "drop" type: "dropout" dropout_ratio: 0.3 } bottom: "ip" top: "ip" }
"""


def parse(text):
    return parse_text(text, pb.NetParameter())


def test_v0_net_with_a_padding_layer():
    p = upgrade_net(parse(V0))
    assert not p.layers and [l.name for l in p.layer] == ["conv1", "pool1", "ip", "drop"]
    conv = p.layer[0]
    assert conv.type == "Convolution" and list(conv.bottom) == ["data"]      # the padding layer folded in
    cp = conv.convolution_param
    assert (cp.num_output, list(cp.kernel_size), list(cp.stride), list(cp.pad), cp.bias_term) == (4, [3], [2], [2], False)
    assert cp.weight_filler.type == "xavier"
    assert [(s.lr_mult, s.decay_mult) for s in conv.param] == [(1, 0)]
    pool = p.layer[1].pooling_param
    assert p.layer[1].type == "Pooling" and (pool.pool, pool.kernel_size, pool.stride) == (pool.AVE, 2, 2)
    assert p.layer[2].inner_product_param.num_output == 5
    assert p.layer[3].type == "Dropout" and p.layer[3].dropout_param.dropout_ratio == pytest.approx(0.3)
    net = Net(parse(V0), device=CPUDevice(8 << 20))
    assert net.layer_names[0] == "input" and net.blobs["conv1"].shape == (2, 4, 5, 5)


def test_v0_unknown_type_and_bad_padding_are_errors_naming_the_layer():
    with pytest.raises(UpgradeError, match='layer "x": unknown V0 layer type "warp"'):
        upgrade_net(parse('input: "d" layers { layer { name: "x" type: "warp" } bottom: "d" top: "y" }'))
    with pytest.raises(UpgradeError, match='layer "r" \\(relu\\) reads padding layer "p"'):
        upgrade_net(parse('input: "d" layers { layer { name: "p" type: "padding" pad: 1 } bottom: "d" top: "q" }'
                          'layers { layer { name: "r" type: "relu" } bottom: "q" top: "q" }'))


def test_v1_fields_become_param_specs_and_transform_param():
    p = upgrade_net(parse("""
      layers { name: "d" type: DATA top: "data" top: "label" include { phase: TRAIN }
               data_param { source: "db" batch_size: 4 scale: 0.5 mean_file: "m.binaryproto" crop_size: 3 mirror: true } }
      layers { name: "c" type: CONVOLUTION bottom: "data" top: "c" param: "w" param: "b"
               blob_share_mode: PERMISSIVE blobs_lr: 1 blobs_lr: 2 weight_decay: 1 weight_decay: 0
               convolution_param { num_output: 2 kernel_size: 1 } }
      layers { name: "l" type: SOFTMAX_LOSS bottom: "c" bottom: "label" top: "l" loss_weight: 2 }
    """))
    d, c, loss = p.layer
    assert d.type == "Data" and d.include[0].phase == pb.TRAIN
    t = d.transform_param
    assert (t.scale, t.mean_file, t.crop_size, t.mirror) == (0.5, "m.binaryproto", 3, True)
    assert not any(d.data_param.HasField(f) for f in ("scale", "mean_file", "crop_size", "mirror"))
    assert (d.data_param.source, d.data_param.batch_size) == ("db", 4)
    assert [(s.name, s.share_mode, s.lr_mult, s.decay_mult) for s in c.param] == \
        [("w", pb.ParamSpec.PERMISSIVE, 1, 1), ("b", pb.ParamSpec.STRICT, 2, 0)]
    assert c.convolution_param.num_output == 2
    assert loss.type == "SoftmaxWithLoss" and list(loss.loss_weight) == [2]


def test_upgrade_logs_caffes_notices(tmp_path, caplog):
    (tmp_path / "v0.prototxt").write_text(V0)
    with caplog.at_level(logging.INFO, logger="sncaffe"):
        load_net(tmp_path / "v0.prototxt")
    assert f"deprecated V0LayerParameter: {tmp_path / 'v0.prototxt'}" in caplog.text
    assert "deprecated V1LayerParameter" in caplog.text


def test_old_batch_norm_params_are_frozen():
    p = upgrade_net(parse('layer { name: "bn" type: "BatchNorm" param { lr_mult: 1 } param { lr_mult: 1 } '
                          'param { lr_mult: 1 decay_mult: 1 } }'))
    assert [(s.lr_mult, s.decay_mult) for s in p.layer[0].param] == [(0, 0)] * 3


@pytest.mark.parametrize("ceil, mode", [("true", pb.PoolingParameter.CEIL), ("false", pb.PoolingParameter.FLOOR)])
def test_fork_ceil_mode_is_round_mode(ceil, mode):
    text = ('layer { name: "in" type: "Input" top: "x" input_param { shape { dim: 1 dim: 1 dim: 6 dim: 6 } } }'
            'layer { name: "p" type: "Pooling" bottom: "x" top: "y" '
            f'pooling_param {{ pool: MAX kernel_size: 3 stride: 2 ceil_mode: {ceil} }} }}')
    p = upgrade_net(parse(text))
    pp = p.layer[1].pooling_param
    assert pp.round_mode == mode and not pp.HasField("ceil_mode")
    net = Net(parse(text), device=CPUDevice(1 << 20))
    assert net.blobs["y"].shape == (1, 1) + ((3, 3) if ceil == "true" else (2, 2))
    bare = make_layer(f'type: "Pooling" pooling_param {{ pool: MAX kernel_size: 3 stride: 2 ceil_mode: {ceil} }}')
    assert Harness(bare, [np.zeros((1, 1, 6, 6))]).top_shapes == [net.blobs["y"].shape]


def test_fork_ceil_mode_disagreeing_with_round_mode_is_an_error():
    with pytest.raises(UpgradeError, match='layer "p": pooling_param gives ceil_mode: false and round_mode: CEIL'):
        upgrade_net(parse('layer { name: "p" type: "Pooling" pooling_param { ceil_mode: false round_mode: CEIL } }'))


def test_solver_type_enum_becomes_type(tmp_path):
    (tmp_path / "s.prototxt").write_text('net: "x" solver_type: ADAM base_lr: 0.1')
    p = read_solver(tmp_path / "s.prototxt")
    assert p.type == "Adam" and not p.HasField("solver_type")


def test_cli_upgrade_prints_v2_text(tmp_path, capsys):
    (tmp_path / "v0.prototxt").write_text(V0)
    assert main(["upgrade", str(tmp_path / "v0.prototxt")]) == 0
    out = parse(capsys.readouterr().out)
    assert not out.layers and not out.input and [l.type for l in out.layer] == \
        ["Input", "Convolution", "Pooling", "InnerProduct", "Dropout"]
    assert main(["upgrade", str(tmp_path / "missing.prototxt")]) == 1
    assert "missing.prototxt: cannot read" in capsys.readouterr().err
    target = tmp_path / "no" / "such" / "v2.prototxt"          # the user's name, not the temporary one
    assert main(["upgrade", str(tmp_path / "v0.prototxt"), str(target)]) == 1
    err = capsys.readouterr().err
    assert f"{target}: No such file or directory" in err and ".tmp" not in err
    assert main(["plan", str(tmp_path / "v0.prototxt"), "--batch", "3", "--png", str(tmp_path / "p.png")]) == 0
    assert "batch 3, 5 layers" in capsys.readouterr().out           # other commands read V0 nets too


def test_net_inputs_without_shapes():
    """Stripped from a caffemodel (its legacy form, as Caffe); an error in a prototxt."""
    from sncaffe.prototxt import PrototxtError, prepare_net
    p = parse('input: "data" layers { name: "r" type: RELU bottom: "data" top: "r" }')
    assert not upgrade_net(p, binary=True).input and upgrade_net(p).input
    with pytest.raises(PrototxtError, match="`input` given without input_shape or input_dim"):
        prepare_net(p)
