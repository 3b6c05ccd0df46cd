"""Every mapped BVLC layer type and setting, in one small net, exports to ONNX and to PyTorch
within 1e-4 of sncaffe; types and settings without a mapping are refused by name. The forks'
types are in test_export_forks.py, which checks that the two nets cover every mapping."""
import numpy as np
import pytest

pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
pytest.importorskip("torch")

from sncaffe import Net  # noqa: E402
from sncaffe.export import ExportError, check, onnx as to_onnx, pytorch as to_torch  # noqa: E402
from sncaffe.prototxt import parse_text  # noqa: E402
from sncaffe.proto import sncaffe_pb2 as pb  # noqa: E402

W = 'weight_filler { type: "gaussian" std: 0.3 } bias_filler { type: "gaussian" std: 0.1 }'


def layer(name, type_, bottoms, tops=None, body=""):
    bottoms = [bottoms] if isinstance(bottoms, str) else bottoms
    tops = [name] if tops is None else [tops] if isinstance(tops, str) else tops
    return (f'layer {{ name: "{name}" type: "{type_}" '
            + " ".join(f'bottom: "{b}"' for b in bottoms) + " "
            + " ".join(f'top: "{t}"' for t in tops) + f" {body} }}\n")


TYPES_NET = (
    'name: "types"\n'
    'layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 2 dim: 3 dim: 11 dim: 13 } } }\n'
    + layer("conv", "Convolution", "data", body="convolution_param { num_output: 6 kernel_h: 3 kernel_w: 2 "
            f"stride: 2 pad: 1 dilation: 2 group: 3 {W} }}")
    # 5x7 -> 10x14: even sizes, so AVE's last window is clipped at the padded end
    + layer("deconv", "Deconvolution", "conv", body=f"convolution_param {{ num_output: 4 kernel_size: 4 stride: 2 "
            f"pad: 1 group: 2 {W} }}")
    + layer("dw", "ConvolutionDepthwise", "deconv", body=f"convolution_param {{ num_output: 4 kernel_size: 3 pad: 1 {W} }}")
    + layer("prelu", "PReLU", "dw", "dw", 'prelu_param { filler { type: "uniform" min: 0.1 max: 0.5 } }')
    + layer("pool_ave", "Pooling", "dw", body="pooling_param { pool: AVE kernel_size: 3 stride: 2 pad: 1 }")
    + layer("pool_max", "Pooling", "dw", body="pooling_param { pool: MAX kernel_size: 2 stride: 3 pad: 1 }")
    # pad over half the kernel: PyTorch's pooling refuses it, the helper pads as Caffe
    + layer("pool_pad", "Pooling", "dw", body="pooling_param { pool: AVE kernel_size: 3 stride: 2 pad: 2 }")
    + layer("pool_pad_max", "Pooling", "dw", body="pooling_param { pool: MAX kernel_size: 3 stride: 2 pad: 2 }")
    + layer("pool_floor", "Pooling", "dw", body="pooling_param { pool: MAX kernel_size: 3 stride: 2 round_mode: FLOOR }")
    + layer("pool_global", "Pooling", "dw", body="pooling_param { pool: AVE global_pooling: true }")
    + layer("lrn_across", "LRN", "data", body="lrn_param { local_size: 3 alpha: 0.5 beta: 0.75 k: 2 }")
    + layer("lrn_within", "LRN", "data", body="lrn_param { local_size: 3 alpha: 0.5 beta: 0.75 norm_region: WITHIN_CHANNEL }")
    + layer("bn", "BatchNorm", "pool_ave")
    + layer("scale", "Scale", "bn", "bn", 'scale_param { bias_term: true filler { type: "gaussian" std: 1 } '
            'bias_filler { type: "gaussian" std: 0.1 } }')
    + layer("bias", "Bias", "pool_max", body='bias_param { filler { type: "gaussian" std: 1 } }')
    + layer("elu", "ELU", "bn", body="elu_param { alpha: 0.7 }")
    + layer("sig", "Sigmoid", "bn") + layer("tanh", "TanH", "bn") + layer("abs", "AbsVal", "bn")
    + layer("bnll", "BNLL", "bn")
    + layer("pow", "Power", "abs", body="power_param { power: 1.5 scale: 0.5 shift: 0.1 }")
    + layer("exp", "Exp", "tanh", body="exp_param { base: 2 scale: 0.5 shift: 0.1 }")
    + layer("log", "Log", "sig", body="log_param { base: 10 scale: 2 shift: 0.5 }")
    + layer("clip", "Clip", "bn", body="clip_param { min: -0.5 max: 0.5 }")
    + layer("swish", "Swish", "bn", body="swish_param { beta: 1.5 }")
    + layer("leaky", "ReLU", "bn", body="relu_param { negative_slope: 0.1 }")
    + layer("sum", "Eltwise", ["elu", "sig", "pool_pad"], body="eltwise_param { operation: SUM coeff: 0.5 coeff: -1 coeff: 2 }")
    + layer("prod", "Eltwise", ["abs", "pow"], body="eltwise_param { operation: PROD }")
    + layer("max", "Eltwise", ["bnll", "exp", "log"], body="eltwise_param { operation: MAX }")
    + layer("cat", "Concat", ["sum", "prod", "max", "clip", "swish", "leaky"], body="concat_param { axis: 1 }")
    + layer("slice", "Slice", "cat", ["s0", "s1", "s2"], "slice_param { axis: 1 slice_point: 3 slice_point: 5 }")
    + layer("crop", "Crop", ["s0", "pool_max"], body="crop_param { axis: 2 offset: 1 offset: 2 }")
    + layer("r", "Reshape", "crop", body="reshape_param { shape { dim: 0 dim: 0 dim: -1 } }")
    + layer("fc_axis", "InnerProduct", "r", body=f"inner_product_param {{ num_output: 3 axis: 2 {W} }}")
    + layer("prob2", "Softmax", "fc_axis", body="softmax_param { axis: 2 }")
    + layer("gain", "Parameter", [], body='parameter_param { shape { dim: 2 } }')
    + layer("scaled", "Scale", ["s1", "gain"], body="scale_param { axis: 1 }")
    + layer("mvn", "MVN", "scaled", body="mvn_param { across_channels: false }")
    + layer("flat", "Flatten", "mvn")
    + layer("fc", "InnerProduct", "flat", body=f"inner_product_param {{ num_output: 5 transpose: true {W} }}")
    + layer("drop", "Dropout", "fc", "fc", "dropout_param { dropout_ratio: 0.3 }")
    + layer("prob", "Softmax", "fc")
    + layer("top2", "ArgMax", "fc", body="argmax_param { top_k: 2 out_max_val: true }")
    + layer("best", "ArgMax", "fc", body="argmax_param { axis: 1 }")
    + layer("above", "Threshold", "fc", body="threshold_param { threshold: 0.1 }")
    + layer("tiled", "Tile", "fc", body="tile_param { axis: 1 tiles: 2 }")
    + layer("energy", "Reduction", "s2", body="reduction_param { operation: SUMSQ axis: 1 coeff: 0.5 }")
    + layer("mean", "Reduction", "s2", body="reduction_param { operation: MEAN axis: 2 }")
)


def net_of(text, phase="TEST"):
    return Net(parse_text(text, pb.NetParameter()), phase, seed=3)


@pytest.fixture(scope="module")
def types_net():
    net = net_of(TYPES_NET)
    bn = net.params["bn"]
    rng = np.random.default_rng(1)
    bn[0].data[...] = rng.normal(0, 0.5, bn[0].data.shape) * 3
    bn[1].data[...] = rng.uniform(0.5, 2, bn[1].data.shape) * 3
    bn[2].data[...] = 3
    return net


def test_types_export_to_onnx(types_net):
    against = check.expected(types_net)
    assert all(np.all(np.isfinite(y)) for y in against[1].values())
    model, diffs = to_onnx.export(types_net, None, rtol=1e-4, against=against)
    assert len(diffs) == len(types_net.outputs) >= 10
    ops = {n.op_type for n in model.graph.node}
    assert {"ConvTranspose", "LRN", "BatchNormalization", "TopK", "Split", "Slice", "Sum", "Max"} <= ops


def test_types_export_to_torch(types_net, tmp_path):
    against = check.expected(types_net)
    module, src, diffs = to_torch.export(types_net, tmp_path / "types.py", rtol=1e-4, against=against)
    assert len(diffs) == len(types_net.outputs)
    text = (tmp_path / "types.py").read_text()
    assert "def caffe_pool2d(" in text and "class CaffeBatchNorm(" in text
    assert "self.pool_pad" not in text          # the helper, not a module, pools it
    assert "self.pool_ave = nn.AvgPool2d(" in text
    assert (tmp_path / "types.pt").is_file()


def test_a_type_without_mapping_is_refused_by_name():
    net = net_of('layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 1 dim: 2 dim: 4 dim: 4 } } }'
                 + layer("pyramid", "SPP", "data", body="spp_param { pyramid_height: 2 }"))
    for exporter, what in ((to_onnx, "ONNX"), (to_torch, "PyTorch")):
        with pytest.raises(ExportError, match=f'layer "pyramid": type "SPP" has no {what} mapping'):
            exporter.export(net, None, rtol=1e-4)


def test_stochastic_pooling_is_refused():        # the mask top's refusals: test_export_forks.py
    net = net_of('layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 1 dim: 2 dim: 4 dim: 4 } } }'
                 + layer("p", "Pooling", "data", "p", "pooling_param { pool: STOCHASTIC kernel_size: 2 stride: 2 }"))
    for exporter in (to_onnx, to_torch):
        with pytest.raises(ExportError, match='layer "p" \\(Pooling\\): .*STOCHASTIC'):
            exporter.export(net, None, rtol=1e-4)


def test_onnx_refuses_batch_statistics():
    net = net_of('layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 2 dim: 2 dim: 3 dim: 3 } } }'
                 + layer("bn", "BatchNorm", "data"), phase="TRAIN")
    with pytest.raises(ExportError, match='layer "bn" \\(BatchNorm\\): normalizes by the batch'):
        to_onnx.export(net, None, rtol=1e-4)


def test_a_difference_over_the_tolerance_fails(types_net):
    with pytest.raises(ExportError, match="differs from sncaffe by more than 0"):
        to_onnx.export(types_net, None, rtol=0.0)


def test_train_phase_dropout_cannot_be_checked():
    net = net_of('layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 2 dim: 3 } } }'
                 + layer("drop", "Dropout", "data", body="dropout_param { dropout_ratio: 0.5 }"), phase="TRAIN")
    for exporter in (to_onnx, to_torch):
        with pytest.raises(ExportError, match='layer "drop" \\(Dropout\\): TRAIN-phase dropout draws random masks'):
            exporter.export(net, None, rtol=1e-4)
    module = to_torch.export(net, None, rtol=None)[0]       # unchecked, it drops as Caffe's
    assert module.training and module.drop.p == pytest.approx(0.5)
