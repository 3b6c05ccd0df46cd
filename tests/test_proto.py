"""The schema: generated module up to date, Caffe's files parse, Caffe's defaults."""
import importlib.util
import math
import subprocess
import sys

import pytest
from google.protobuf import text_format
from google.protobuf.unknown_fields import UnknownFieldSet

from conftest import ROOT, SHARED
from sncaffe.proto import sncaffe_pb2 as pb

ZOO = (SHARED or ROOT / "tests" / "data" / "shared") / "zoo"
GOLDEN = (SHARED or ROOT / "tests" / "data" / "shared") / "golden"


def files(folder, pattern):
    if not folder.is_dir():
        return [pytest.param(None, marks=pytest.mark.skip(reason=f"{folder} not found"))]
    found = sorted(folder.rglob(pattern))
    return [pytest.param(p, id=str(p.relative_to(folder))) for p in found]


def parse_text(path):
    """Parse a prototxt as a SolverParameter if 'solver' is in its name, else a NetParameter."""
    msg = pb.SolverParameter() if "solver" in path.name else pb.NetParameter()
    return text_format.Parse(path.read_text(), msg)


def assert_no_unknown_fields(msg, where="root"):
    """Every field of a binary Caffe file is known to the schema, at any depth."""
    assert len(UnknownFieldSet(msg)) == 0, f"unknown fields in {where}"
    for field, value in msg.ListFields():
        if field.message_type is None:
            continue
        values = value if field.is_repeated else [value]
        for i, sub in enumerate(values):
            assert_no_unknown_fields(sub, f"{where}.{field.name}[{i}]")


def shape_of(blob):
    """Caffe's Blob::FromProto rule: legacy 4-D only if one of num/channels/height/width is
    set, else `shape`; a 0-axis blob (a scalar) is written with no shape at all."""
    if any(blob.HasField(f) for f in ("num", "channels", "height", "width")):
        return (blob.num, blob.channels, blob.height, blob.width)
    return tuple(blob.shape.dim)


# --- (a) the committed module matches the .proto ----------------------------

def test_generated_module_is_fresh():
    if importlib.util.find_spec("grpc_tools") is None:
        pytest.skip("grpc_tools is not installed, cannot regenerate")
    run = subprocess.run([sys.executable, str(ROOT / "tools" / "gen_proto.py"), "--check"],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr


# --- (b), (c) real Caffe text files parse ------------------------------------

@pytest.mark.parametrize("path", files(ZOO, "*.prototxt"))
def test_zoo_prototxt_parses(path):
    msg = parse_text(path)
    if isinstance(msg, pb.NetParameter):
        assert len(msg.layer) + len(msg.layers) > 0
    else:
        assert msg.base_lr > 0


@pytest.mark.parametrize("path", files(GOLDEN, "*.prototxt"))
def test_golden_prototxt_parses(path):
    msg = parse_text(path)
    if isinstance(msg, pb.NetParameter):
        assert len(msg.layer) + len(msg.layers) > 0     # V0/V1 (coverage-nets/lenet_v*): layers


# --- (c), (d) real Caffe binary files ----------------------------------------

@pytest.mark.parametrize("path", files(GOLDEN, "*.caffemodel"))
def test_golden_caffemodel(path):
    raw = path.read_bytes()
    net = pb.NetParameter.FromString(raw)
    assert len(net.layer) + len(net.layers) > 0
    assert_no_unknown_fields(net)
    old = [l.layer if l.HasField("layer") else l for l in net.layers]     # V0 keeps blobs in the V0 layer
    for layer in list(net.layer) + old:
        for blob in layer.blobs:
            assert math.prod(shape_of(blob)) == len(blob.data), layer.name
    # Caffe's files come back byte for byte (so also as an equal message).
    assert net.SerializeToString(deterministic=True) == raw
    assert pb.NetParameter.FromString(net.SerializeToString()) == net


def test_golden_caffemodels_hold_weights():
    if not GOLDEN.is_dir():
        pytest.skip(f"{GOLDEN} not found")
    net = pb.NetParameter.FromString((GOLDEN / "nets" / "lenet" / "weights.caffemodel").read_bytes())
    shapes = {layer.name: [shape_of(b) for b in layer.blobs] for layer in net.layer if layer.blobs}
    assert shapes["conv1"] == [(20, 1, 5, 5), (20,)]
    assert shapes["ip2"][1] == (10,)
    # A 0-axis parameter (PReLU's shared slope) is stored without a shape message.
    prelu = pb.NetParameter.FromString(
        (GOLDEN / "layers" / "prelu_shared" / "weights.caffemodel").read_bytes())
    slope = next(layer for layer in prelu.layer if layer.blobs).blobs[0]
    assert not slope.HasField("shape") and shape_of(slope) == () and len(slope.data) == 1


@pytest.mark.parametrize("path", files(GOLDEN, "*.solverstate"))
def test_golden_solverstate(path):
    raw = path.read_bytes()
    state = pb.SolverState.FromString(raw)
    assert_no_unknown_fields(state)
    assert state.iter == int(path.stem.rsplit("_", 1)[1])
    assert state.learned_net.endswith(".caffemodel")
    # History holds one blob per learnable parameter (Adam, AdaDelta: two).
    net = pb.NetParameter.FromString((path.parent / f"{path.stem}.caffemodel").read_bytes())
    params = [shape_of(b) for layer in net.layer for b in layer.blobs]
    history = [shape_of(b) for b in state.history]
    assert len(history) in (len(params), 2 * len(params))
    assert history == params * (len(history) // len(params))
    for blob in state.history:
        assert math.prod(shape_of(blob)) == len(blob.data)
    assert state.SerializeToString(deterministic=True) == raw


# --- legacy and sncaffe fields -------------------------------------------------

def test_legacy_v1_net_parses():
    net = text_format.Parse("""
        name: "old"
        input: "data" input_dim: 1 input_dim: 3 input_dim: 8 input_dim: 8
        layers { name: "conv" type: CONVOLUTION bottom: "data" top: "conv"
                 blobs_lr: 1 blobs_lr: 2 weight_decay: 1 weight_decay: 0
                 convolution_param { num_output: 4 kernel_size: 3 } }
        layers { layer { name: "relu" type: "relu" } }
    """, pb.NetParameter())
    assert net.layers[0].type == pb.V1LayerParameter.CONVOLUTION
    assert list(net.layers[0].blobs_lr) == [1, 2]
    assert net.layers[1].layer.type == "relu"
    assert list(net.input_dim) == [1, 3, 8, 8]


def test_sncaffe_fields():
    net = text_format.Parse("""
        memory_param { mode: "offload" device_memory: "12GiB" }
        layer { name: "c" type: "Convolution" location: "cuda:1" }
    """, pb.NetParameter())
    assert net.memory_param.mode == "offload"
    assert net.layer[0].location == "cuda:1"
    solver = text_format.Parse('device: "cuda:0" memory_param { mode: "auto" }',
                               pb.SolverParameter())
    assert solver.device == "cuda:0" and solver.memory_param.mode == "auto"
    assert pb.MemoryParameter().mode == "none"
    for msg, name in [(pb.LayerParameter, "location"), (pb.NetParameter, "memory_param"),
                      (pb.SolverParameter, "memory_param"), (pb.SolverParameter, "device")]:
        assert msg.DESCRIPTOR.fields_by_name[name].number >= 10000
    # Caffe never uses these numbers, so a file with them still parses in Caffe's schema,
    # and no Caffe field is numbered that high.
    for msg in (pb.LayerParameter, pb.NetParameter, pb.SolverParameter):
        caffe_numbers = [f.number for f in msg.DESCRIPTOR.fields if f.number < 10000]
        assert max(caffe_numbers) < 10000


# --- (e) Caffe's defaults -----------------------------------------------------

@pytest.mark.parametrize("msg, field, value", [
    (pb.ConvolutionParameter, "bias_term", True),
    (pb.ConvolutionParameter, "group", 1),
    (pb.ConvolutionParameter, "axis", 1),
    (pb.PoolingParameter, "pool", pb.PoolingParameter.MAX),
    (pb.PoolingParameter, "stride", 1),
    (pb.PoolingParameter, "round_mode", pb.PoolingParameter.CEIL),
    (pb.LRNParameter, "local_size", 5),
    (pb.LRNParameter, "alpha", 1.0),
    (pb.LRNParameter, "beta", 0.75),
    (pb.LRNParameter, "k", 1.0),
    (pb.LRNParameter, "norm_region", pb.LRNParameter.ACROSS_CHANNELS),
    (pb.BatchNormParameter, "moving_average_fraction", pytest.approx(0.999)),
    (pb.BatchNormParameter, "eps", pytest.approx(1e-5)),
    (pb.SolverParameter, "type", "SGD"),
    (pb.SolverParameter, "delta", pytest.approx(1e-8)),
    (pb.SolverParameter, "momentum2", pytest.approx(0.999)),
    (pb.SolverParameter, "rms_decay", pytest.approx(0.99)),
    (pb.SolverParameter, "regularization_type", "L2"),
    (pb.SolverParameter, "clip_gradients", -1.0),
    (pb.SolverParameter, "iter_size", 1),
    (pb.SolverParameter, "average_loss", 1),
    (pb.SolverParameter, "random_seed", -1),
    (pb.SolverParameter, "solver_mode", pb.SolverParameter.GPU),
    (pb.SolverParameter, "solver_type", pb.SolverParameter.SGD),
    (pb.SolverParameter, "test_initialization", True),
    (pb.SolverParameter, "snapshot_after_train", True),
    (pb.SolverParameter, "snapshot_format", pb.SolverParameter.BINARYPROTO),
    (pb.LossParameter, "normalization", pb.LossParameter.VALID),
    (pb.ReshapeParameter, "num_axes", -1),
    (pb.ReshapeParameter, "axis", 0),
    (pb.InnerProductParameter, "axis", 1),
    (pb.InnerProductParameter, "bias_term", True),
    (pb.SoftmaxParameter, "axis", 1),
    (pb.ConcatParameter, "axis", 1),
    (pb.SliceParameter, "axis", 1),
    (pb.FlattenParameter, "end_axis", -1),
    (pb.EltwiseParameter, "operation", pb.EltwiseParameter.SUM),
    (pb.EltwiseParameter, "stable_prod_grad", True),
    (pb.DropoutParameter, "dropout_ratio", 0.5),
    (pb.ScaleParameter, "bias_term", False),
    (pb.ScaleParameter, "num_axes", 1),
    (pb.CropParameter, "axis", 2),
    (pb.ExpParameter, "base", -1.0),
    (pb.MVNParameter, "eps", pytest.approx(1e-9)),
    (pb.FillerParameter, "type", "constant"),
    (pb.FillerParameter, "std", 1.0),
    (pb.FillerParameter, "max", 1.0),
    (pb.FillerParameter, "sparse", -1),
    (pb.FillerParameter, "variance_norm", pb.FillerParameter.FAN_IN),
    (pb.ParamSpec, "lr_mult", 1.0),
    (pb.ParamSpec, "decay_mult", 1.0),
    (pb.NetState, "phase", pb.TEST),
    (pb.AccuracyParameter, "top_k", 1),
])
def test_caffe_default(msg, field, value):
    assert getattr(msg(), field) == value


def test_field_numbers():
    """A sample of Caffe's field numbers, which binary files depend on."""
    numbers = {
        pb.NetParameter: {"layer": 100, "layers": 2, "input": 3, "input_dim": 4,
                          "input_shape": 8, "force_backward": 5, "state": 6},
        pb.LayerParameter: {"blobs": 7, "param": 6, "phase": 10, "propagate_down": 11,
                            "transform_param": 100, "convolution_param": 106,
                            "batch_norm_param": 139, "scale_param": 142, "input_param": 143,
                            "recurrent_param": 146, "swish_param": 147, "clip_param": 148},
        pb.BlobProto: {"shape": 7, "data": 5, "diff": 6, "double_data": 8, "num": 1},
        pb.SolverParameter: {"type": 40, "solver_type": 30, "momentum2": 39, "delta": 31,
                             "rms_decay": 38, "iter_size": 36, "clip_gradients": 35,
                             "layer_wise_reduce": 41, "weights": 42},
        pb.SolverState: {"iter": 1, "learned_net": 2, "history": 3, "current_step": 4},
        pb.V1LayerParameter: {"layer": 1, "param": 1001, "blob_share_mode": 1002},
    }
    for msg, fields in numbers.items():
        for name, number in fields.items():
            assert msg.DESCRIPTOR.fields_by_name[name].number == number, (msg.__name__, name)


def _varint(v):
    out = bytearray()
    while v >= 0x80:
        out.append((v & 0x7F) | 0x80)
        v >>= 7
    out.append(v)
    return bytes(out)


def _field(number, value):
    """One field as a fork's protoc writes it: int (varint), float (fixed32), bytes/str (length-delimited)."""
    import struct
    if isinstance(value, float):
        return _varint(number << 3 | 5) + struct.pack("<f", value)
    if isinstance(value, int):
        return _varint(number << 3) + _varint(value)
    value = value.encode() if isinstance(value, str) else value
    return _varint(number << 3 | 2) + _varint(len(value)) + value


def test_the_forks_binary_layers_parse():
    """Layers as the forks' own caffe.proto numbers them: where sncaffe shares a number with the
    fork, the block reads as the fork's; where it moved (a number BVLC uses), the file still
    parses and the layer's name, type and blobs load."""
    blob = _field(7, _field(1, 2)) + _field(5, b"\x00\x00\x80?\x00\x00\x00@")   # shape [2], packed 1.0, 2.0
    layers = [
        ("roi", "ROIPooling", 8266711, _field(1, 7) + _field(2, 7) + _field(3, 0.0625)),
        ("psroi", "PSROIPooling", 10001, _field(1, 0.0625) + _field(2, 21) + _field(3, 7)),
        ("psp_bn", "BN", 152, _field(3, 0.95) + _field(5, 1)),
        ("shuffle", "ShuffleChannel", 164, _field(1, 3)),
        ("segnet_bn", "BN", 45, _field(3, 1)),                          # bn_mode: INFERENCE
        ("upsample", "Upsample", 137, _field(1, 2) + _field(6, 23) + _field(7, 30)),
        ("dense", "DenseImageData", 138, _field(1, "list.txt") + _field(2, 4)),
        ("interp", "Interp", 143, _field(1, 60) + _field(2, 60)),
    ]
    wire = b"".join(_field(100, _field(1, name) + _field(2, kind) + _field(7, blob) + _field(number, body))
                    for name, kind, number, body in layers)
    net = pb.NetParameter.FromString(wire)
    assert [(l.name, l.type) for l in net.layer] == [(n, k) for n, k, _, _ in layers]
    for l in net.layer:
        assert list(l.blobs[0].data) == [1.0, 2.0]
    roi, psroi, bn, shuffle = net.layer[:4]
    assert (roi.roi_pooling_param.pooled_h, roi.roi_pooling_param.spatial_scale) == (7, 0.0625)
    assert (psroi.psroi_pooling_param.output_dim, psroi.psroi_pooling_param.group_size) == (21, 7)
    assert bn.bn_param.frozen and math.isclose(bn.bn_param.momentum, 0.95, rel_tol=1e-7)
    assert shuffle.shuffle_channel_param.group == 3
    for l in net.layer[4:]:          # moved: the fork's block is no sncaffe fork field here
        assert not any(l.HasField(f) for f in ("bn_param", "upsample_param", "dense_image_data_param",
                                               "interp_param"))


def test_an_rfcn_ohem_caffemodel_loads(tmp_path):
    """caffe-rfcn numbers box_annotator_ohem_param 10000, sncaffe's location: a model trained with
    BoxAnnotatorOHEM loads its weights by layer name, the block never read as a location."""
    import numpy as np
    from sncaffe import Net
    from sncaffe.backend.cpu import CPUDevice
    from sncaffe.prototxt import parse_text
    weights = np.arange(6, dtype=np.float32)
    blob = _field(7, _field(1, 3) + _field(1, 2)) + _field(5, weights.tobytes())      # shape [3, 2]
    ohem = _field(1, 128) + _field(2, (1 << 64) - 1)          # roi_per_img: 128, ignore_label: -1
    wire = (_field(100, _field(1, "ip") + _field(2, "InnerProduct") + _field(7, blob))
            + _field(100, _field(1, "annotator_detector") + _field(2, "BoxAnnotatorOHEM") + _field(10000, ohem)))
    (tmp_path / "rfcn_ohem.caffemodel").write_bytes(wire)
    net = Net(parse_text('layer { name: "in" type: "Input" top: "x" input_param { shape { dim: 1 dim: 2 } } } '
                         'layer { name: "ip" type: "InnerProduct" bottom: "x" top: "y" '
                         'inner_product_param { num_output: 3 bias_term: false } }', pb.NetParameter()),
              "TEST", device=CPUDevice("16MiB"), weights=str(tmp_path / "rfcn_ohem.caffemodel"))
    np.testing.assert_array_equal(net.params["ip"][0].data, weights.reshape(3, 2))
