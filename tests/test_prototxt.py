import pytest

from sncaffe.proto import sncaffe_pb2 as pb
from sncaffe.prototxt import (PrototxtError, filter_net, insert_splits, load_net, parse_text,
                              replace_data_layers, set_batch, upgrade_inputs)

NET = """name: "t"
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 2 dim: 3 dim: 8 dim: 8 } } }
layer {
  name: "conv3"
  type: "Convolution"
  bottom: "data"
  top: "conv3"
  convolution_param {
    num_output: 4
    kernal_size: 3
  }
}
"""


def net(text):
    return parse_text(text, pb.NetParameter())


def test_unknown_field_names_file_line_layer_and_field(tmp_path):
    path = tmp_path / "net.prototxt"
    path.write_text(NET)
    with pytest.raises(PrototxtError) as e:
        load_net(path)
    assert str(e.value).startswith(f'{path}:10: layer "conv3": unknown field "kernal_size"')


def test_bad_enum_and_syntax_errors_are_located(tmp_path):
    path = tmp_path / "p.prototxt"
    path.write_text('layer {\n  name: "pool1"\n  type: "Pooling"\n  pooling_param { pool: MEDIAN }\n}\n')
    with pytest.raises(PrototxtError, match=r'p.prototxt:4: layer "pool1": .*MEDIAN'):
        load_net(path)
    path.write_text('layer {\n  name: "a"\n  type: "ReLU"\n')
    with pytest.raises(PrototxtError, match=r"p.prototxt:\d+:"):
        load_net(path)


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(PrototxtError, match="cannot read"):
        load_net(tmp_path / "nope.prototxt")


def test_phase_stage_level_rules():
    p = net("""
      state { stage: "deploy" }
      layer { name: "train_only" type: "ReLU" include { phase: TRAIN } }
      layer { name: "test_only" type: "ReLU" include { phase: TEST } }
      layer { name: "not_test" type: "ReLU" exclude { phase: TEST } }
      layer { name: "deploy" type: "ReLU" include { stage: "deploy" } }
      layer { name: "not_deploy" type: "ReLU" include { not_stage: "deploy" } }
      layer { name: "extra" type: "ReLU" include { stage: "extra" } }
      layer { name: "lvl" type: "ReLU" include { min_level: 1 } }
      layer { name: "either" type: "ReLU" include { phase: TEST } include { stage: "extra" } }
    """)
    names = lambda q: [layer.name for layer in q.layer]
    assert names(filter_net(p, "TRAIN")) == ["train_only", "not_test", "deploy"]
    assert names(filter_net(p, "TEST", stages=["extra"], level=1)) == ["test_only", "deploy", "extra", "lvl", "either"]
    with pytest.raises(PrototxtError, match="include or exclude"):
        filter_net(net('layer { name: "x" include { phase: TRAIN } exclude { phase: TEST } }'))


def test_legacy_inputs_become_an_input_layer():
    p = upgrade_inputs(net('input: "data" input_dim: 1 input_dim: 3 input_dim: 4 input_dim: 5 '
                           'input: "im_info" input_dim: 1 input_dim: 3 input_dim: 1 input_dim: 1 '
                           'layer { name: "r" type: "ReLU" bottom: "data" top: "data" }'))
    first = p.layer[0]
    assert (first.name, first.type, list(first.top)) == ("input", "Input", ["data", "im_info"])
    assert [list(s.dim) for s in first.input_param.shape] == [[1, 3, 4, 5], [1, 3, 1, 1]]
    assert not p.input and p.layer[1].name == "r"
    q = upgrade_inputs(net('input: "data" input_shape { dim: 2 dim: 3 }'))
    assert list(q.layer[0].input_param.shape[0].dim) == [2, 3]
    with pytest.raises(PrototxtError, match="4 values per input"):
        upgrade_inputs(net('input: "data" input_dim: 1 input_dim: 3'))


def test_splits_follow_caffe_names_through_in_place_layers():
    p = insert_splits(net("""
      layer { name: "input" type: "Input" top: "x" }
      layer { name: "conv" type: "Convolution" bottom: "x" top: "c" }
      layer { name: "relu" type: "ReLU" bottom: "c" top: "c" }
      layer { name: "a" type: "TanH" bottom: "c" top: "a" }
      layer { name: "b" type: "Sigmoid" bottom: "c" top: "b" }
      layer { name: "sum" type: "Eltwise" bottom: "a" bottom: "b" bottom: "c" top: "s" }
    """))
    assert [layer.name for layer in p.layer] == ["input", "conv", "relu", "c_relu_0_split", "a", "b", "sum"]
    split = p.layer[3]
    assert split.type == "Split" and list(split.bottom) == ["c"]
    assert list(split.top) == ["c_relu_0_split_0", "c_relu_0_split_1", "c_relu_0_split_2"]
    assert list(p.layer[4].bottom) == ["c_relu_0_split_0"]
    assert list(p.layer[6].bottom) == ["a", "b", "c_relu_0_split_2"]


def test_split_of_a_top_with_loss_weight_carries_the_loss():
    p = insert_splits(net("""
      layer { name: "input" type: "Input" top: "x" }
      layer { name: "r" type: "ReLU" bottom: "x" top: "y" loss_weight: 2 }
      layer { name: "s" type: "Sigmoid" bottom: "y" top: "z" }
    """))
    split = p.layer[2]
    assert list(split.loss_weight) == [2, 0] and not p.layer[1].loss_weight
    assert list(p.layer[3].bottom) == ["y_r_0_split_1"]


def test_unknown_bottom_and_v1_format():
    with pytest.raises(PrototxtError, match='layer "r" \\(ReLU\\): unknown bottom blob "nope"'):
        insert_splits(net('layer { name: "r" type: "ReLU" bottom: "nope" top: "y" }'))
    from sncaffe.prototxt import prepare_net
    with pytest.raises(PrototxtError, match="both 'layer' and 'layers'"):
        prepare_net(net('layers { name: "r" type: RELU } layer { name: "s" type: "ReLU" }'))


def test_replace_data_layers_and_set_batch():
    p = net("""
      layer { name: "mnist" type: "Data" top: "data" top: "label" include { phase: TRAIN }
              data_param { source: "x" batch_size: 64 } }
      layer { name: "r" type: "ReLU" bottom: "data" top: "data" }
    """)
    q = set_batch(replace_data_layers(p, {"data": (64, 1, 28, 28), "label": (64,)}), 5)
    first = q.layer[0]
    assert first.type == "Input" and first.include[0].phase == pb.TRAIN
    assert [list(s.dim) for s in first.input_param.shape] == [[5, 1, 28, 28], [5]]
    with pytest.raises(PrototxtError, match='no input shape given for top "label"'):
        replace_data_layers(p, {"data": (1,)})
