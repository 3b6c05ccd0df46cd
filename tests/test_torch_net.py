"""sncaffe against its PyTorch twin (tools/torch_net.py): forward values, loss, input and
parameter gradients of small nets covering every layer type the twin knows, and the
golden nets with Caffe's weights."""
import sys

import numpy as np
import pytest

from conftest import ROOT, SHARED, needs_shared

torch = pytest.importorskip("torch", reason="PyTorch (the optional extra sncaffe[torch]) is not installed")
sys.path.insert(0, str(ROOT / "tools"))
from torch_net import TorchNet, TorchNetError  # noqa: E402

from sncaffe import Net  # noqa: E402
from sncaffe.backend.cpu import CPUDevice  # noqa: E402
from sncaffe.proto import sncaffe_pb2 as pb  # noqa: E402
from sncaffe.prototxt import parse_text  # noqa: E402

TOL = {np.float32: 1e-4, np.float64: 1e-9}


def layer(name, type, bottoms, tops, body=""):
    b = " ".join(f'bottom: "{x}"' for x in bottoms.split())
    t = " ".join(f'top: "{x}"' for x in tops.split())
    return f'layer {{ name: "{name}" type: "{type}" {b} {t} {body} }}\n'


def inputs(*shapes):
    """An Input layer: shapes as ("name", dims...)."""
    tops = " ".join(s[0] for s in shapes)
    body = " ".join("shape { " + " ".join(f"dim: {d}" for d in s[1:]) + " }" for s in shapes)
    return layer("input", "Input", "", tops, f"input_param {{ {body} }}")


# Small nets, batch 2. Labels are named label*; every other input is N(0, 1).
NETS = {
    "conv_pool": "force_backward: true\n"
    + inputs(("data", 2, 3, 9, 9), ("label", 2))
    + layer("conv", "Convolution", "data", "conv",
            "convolution_param { num_output: 6 kernel_size: 3 stride: 2 pad: 1 dilation: 2 group: 3 }")
    + layer("relu", "ReLU", "conv", "conv", "relu_param { negative_slope: 0.1 }")
    + layer("deconv", "Deconvolution", "conv", "deconv",
            "convolution_param { num_output: 4 kernel_size: 3 stride: 2 pad: 1 group: 2 }")
    + layer("conv_rect", "Convolution", "deconv", "rect",
            "convolution_param { num_output: 3 kernel_h: 3 kernel_w: 2 stride_h: 1 stride_w: 2 "
            "pad_h: 0 pad_w: 1 bias_term: false }")
    + layer("pool_max", "Pooling", "rect", "pmax", "pooling_param { pool: MAX kernel_size: 3 stride: 2 pad: 1 }")
    + layer("pool_ave", "Pooling", "rect", "pave",
            "pooling_param { pool: AVE kernel_h: 2 kernel_w: 3 stride: 2 pad_h: 1 pad_w: 1 }")
    + layer("deconv2", "Deconvolution", "pave", "deconv2",
            "convolution_param { num_output: 3 kernel_size: 2 dilation: 2 bias_term: false }")
    + layer("pool_ceil", "Pooling", "deconv2", "pceil", "pooling_param { pool: AVE kernel_size: 3 stride: 2 }")
    + layer("ip1", "InnerProduct", "pmax", "ip1", "inner_product_param { num_output: 5 }")
    + layer("ip2", "InnerProduct", "pceil", "ip2", "inner_product_param { num_output: 5 }")
    + layer("sum", "Eltwise", "ip1 ip2", "ip")
    + layer("loss", "SoftmaxWithLoss", "ip label", "loss")
    + layer("acc", "Accuracy", "ip label", "acc", "accuracy_param { top_k: 2 }"),

    "pool_modes": "force_backward: true\n"
    + inputs(("data", 2, 3, 7, 8))
    + layer("gmax", "Pooling", "data", "gmax", "pooling_param { pool: MAX global_pooling: true }")
    + layer("gave", "Pooling", "data", "gave", "pooling_param { pool: AVE global_pooling: true }")
    + layer("max_ceil", "Pooling", "data", "max_ceil", "pooling_param { pool: MAX kernel_size: 3 stride: 2 }")
    + layer("max_floor", "Pooling", "data", "max_floor",
            "pooling_param { pool: MAX kernel_size: 3 stride: 2 pad: 1 round_mode: FLOOR }")
    + layer("max_mask", "Pooling", "data", "max_2 mask", "pooling_param { pool: MAX kernel_size: 2 stride: 2 }")
    + layer("big_pad", "Pooling", "data", "big_pad", "pooling_param { pool: AVE kernel_size: 3 stride: 3 pad: 2 }")
    + layer("max_pad", "Pooling", "data", "max_pad",
            "pooling_param { pool: MAX kernel_h: 2 kernel_w: 3 stride: 2 pad: 1 }"),

    "neurons": "force_backward: true\n"
    + inputs(("data", 2, 4, 3, 3), ("target", 2, 24, 3))
    + layer("prelu", "PReLU", "data", "a")
    + layer("prelu_shared", "PReLU", "a", "a", "prelu_param { channel_shared: true }")
    + layer("elu", "ELU", "a", "b", "elu_param { alpha: 0.5 }")
    + layer("sig", "Sigmoid", "b", "c")
    + layer("tanh", "TanH", "b", "d")
    + layer("abs", "AbsVal", "a", "e")
    + layer("pow", "Power", "e", "e", "power_param { power: 2 scale: 0.5 shift: 1 }")
    + layer("pow3", "Power", "d", "f", "power_param { power: 3 scale: 0.7 }")
    + layer("sqrt", "Power", "c", "g", "power_param { power: 0.5 scale: 2 shift: 3 }")
    + layer("relu", "ReLU", "b", "h")
    + layer("lin", "Power", "a", "k", "power_param { scale: -1.5 shift: 0.2 }")
    + layer("leaky", "ReLU", "k", "k", "relu_param { negative_slope: -0.2 }")
    + layer("prod", "Eltwise", "c d e", "prod", "eltwise_param { operation: PROD }")
    + layer("max", "Eltwise", "f g h", "max", "eltwise_param { operation: MAX }")
    + layer("sum", "Eltwise", "prod max k", "sum", "eltwise_param { operation: SUM coeff: 1 coeff: -0.5 coeff: 2 }")
    + layer("concat", "Concat", "sum a", "cat", "concat_param { axis: 1 }")
    + layer("slice", "Slice", "cat", "s1 s2 s3", "slice_param { axis: 1 slice_point: 1 slice_point: 5 }")
    + layer("slice_eq", "Slice", "s2", "q1 q2", "slice_param { slice_dim: 1 }")
    + layer("concat2", "Concat", "q2 s1 q1 s3", "cat2")
    + layer("reshape", "Reshape", "cat2", "r", "reshape_param { shape { dim: 0 dim: -1 dim: 3 } }")
    + layer("loss", "EuclideanLoss", "r target", "loss", "loss_weight: 0.5"),

    "norm": "force_backward: true\n"
    + inputs(("data", 2, 5, 4, 4), ("target", 2, 5, 3), ("s", 5), ("bias_in", 2, 5))
    + layer("lrn_across", "LRN", "data", "la", "lrn_param { local_size: 3 alpha: 0.2 beta: 0.75 k: 2 }")
    + layer("lrn_within", "LRN", "la", "lw",
            "lrn_param { local_size: 3 alpha: 0.2 beta: 0.75 norm_region: WITHIN_CHANNEL }")
    + layer("bn", "BatchNorm", "lw", "bn", "batch_norm_param { eps: 1e-4 moving_average_fraction: 0.9 }")
    + layer("scale", "Scale", "bn", "bn", "scale_param { bias_term: true }")
    + layer("bn_global", "BatchNorm", "bn", "g", "batch_norm_param { use_global_stats: true }")
    + layer("scale_bottom", "Scale", "g s", "sb", "scale_param { axis: 1 }")
    + layer("bias", "Bias", "sb", "sb", "bias_param { axis: 1 num_axes: 2 }")
    + layer("bias_bottom", "Bias", "sb bias_in", "bb", "bias_param { axis: 0 }")
    + layer("drop", "Dropout", "bb", "bb", "dropout_param { dropout_ratio: 0 }")
    + layer("softmax", "Softmax", "bb", "sm", "softmax_param { axis: 2 }")
    + layer("flatten", "Flatten", "sm", "fl", "flatten_param { axis: 2 }")
    + layer("ip_axis2", "InnerProduct", "fl", "ip2", "inner_product_param { num_output: 3 axis: 2 }")
    + layer("ip_t", "InnerProduct", "bb", "ipt", "inner_product_param { num_output: 15 transpose: true }")
    + layer("reshape", "Reshape", "ipt", "ipr", "reshape_param { shape { dim: 5 dim: 3 } axis: 1 }")
    + layer("bn2", "BatchNorm", "ip2", "ip2")
    + layer("add", "Eltwise", "ip2 ipr", "out")
    + layer("silence", "Silence", "fl bias_in", "")
    + layer("loss", "SigmoidCrossEntropyLoss", "out target", "loss"),

    "softmax_loss": "force_backward: true\n"
    + inputs(("data", 2, 5, 3, 3), ("label", 2, 3, 3), ("label2", 2, 5, 3))
    + layer("scale", "Scale", "data", "x", "scale_param { axis: 0 num_axes: 0 }")
    + layer("valid", "SoftmaxWithLoss", "x label", "loss prob", "loss_param { ignore_label: -1 }")
    + layer("full", "SoftmaxWithLoss", "x label", "loss_full",
            "loss_weight: 0.3 loss_param { ignore_label: -1 normalization: FULL }")
    + layer("batch", "SoftmaxWithLoss", "x label", "loss_batch", "loss_weight: 2 loss_param { normalize: false ignore_label: -1 }")
    + layer("chan2", "SoftmaxWithLoss", "x label2", "loss_axis2",
            "softmax_param { axis: 2 } loss_param { normalization: NONE }")
    + layer("sig", "SigmoidCrossEntropyLoss", "x data", "loss_sig", "loss_param { normalization: VALID ignore_label: 0 }")
    + layer("ip", "InnerProduct", "prob", "ip", "inner_product_param { num_output: 4 } loss_weight: 0.1")
    + layer("acc", "Accuracy", "x label", "acc acc_class", "accuracy_param { ignore_label: -1 }"),
}

# The remaining BVLC layer types. Inputs named in INPUT_VALUES get those values (indices, selectors,
# sequence indicators, similarity flags, infogain matrices), the rest as above.
NETS.update({
    "neurons_more": "force_backward: true\n"
    + inputs(("data", 2, 3, 4, 5))
    + layer("bnll", "BNLL", "data", "bnll")
    + layer("clip", "Clip", "data", "clip", "clip_param { min: -0.5 max: 0.7 }")
    + layer("exp", "Exp", "data", "exp", "exp_param { scale: 0.5 shift: 0.1 }")
    + layer("exp2", "Exp", "data", "exp2", "exp_param { base: 2 scale: 0.8 shift: -0.4 }")
    + layer("log", "Log", "bnll", "log", "log_param { scale: 0.5 shift: 0.2 }")
    + layer("log10", "Log", "exp", "log10", "log_param { base: 10 scale: 2 }")
    + layer("swish", "Swish", "data", "swish", "swish_param { beta: 1.5 }")
    + layer("swish1", "Swish", "clip", "clip")
    + layer("mvn", "MVN", "swish", "mvn")
    + layer("mvn_across", "MVN", "exp2", "mvn_across", "mvn_param { across_channels: true eps: 0.1 }")
    + layer("mvn_mean", "MVN", "log", "mvn_mean", "mvn_param { normalize_variance: false }")
    + layer("mvn_eps", "MVN", "data", "mvn_eps", "mvn_param { eps: 0.3 }"),

    "shapes": "force_backward: true\n"
    + inputs(("data", 2, 3, 7, 9), ("ref", 2, 2, 3, 4), ("v", 2, 3))
    + layer("sum1", "Reduction", "data", "sum1", "reduction_param { axis: 1 }")
    + layer("asum", "Reduction", "v", "asum", "reduction_param { operation: ASUM }")
    + layer("sumsq", "Reduction", "data", "sumsq", "reduction_param { operation: SUMSQ axis: -2 coeff: -0.7 }")
    + layer("tile", "Tile", "v", "tile", "tile_param { tiles: 3 }")
    + layer("tile0", "Tile", "ref", "tile0", "tile_param { axis: 2 tiles: 2 }")
    + layer("crop", "Crop", "data ref", "crop", "crop_param { offset: 1 offset: 2 }")
    + layer("crop1", "Crop", "data ref", "crop1", "crop_param { axis: 1 offset: 1 }")
    + layer("crop0", "Crop", "tile0 ref", "crop0")
    + layer("param", "Parameter", "", "p", "parameter_param { shape { dim: 2 dim: 3 } }")
    + layer("add", "Eltwise", "v p", "vp")
    + layer("im2col", "Im2col", "data", "cols", "convolution_param { kernel_size: 3 stride: 2 pad: 1 }")
    + layer("im2col_rect", "Im2col", "data", "cols2",
            "convolution_param { kernel_h: 2 kernel_w: 3 stride_h: 1 stride_w: 2 pad_w: 1 dilation: 2 }")
    + layer("spp_max", "SPP", "data", "spp_max", "spp_param { pyramid_height: 3 }")
    + layer("spp_ave", "SPP", "data", "spp_ave", "spp_param { pyramid_height: 2 pool: AVE }")
    + layer("spp_one", "SPP", "data", "spp_one", "spp_param { pyramid_height: 1 pool: AVE }"),

    "reduction_mean": "force_backward: true\n"
    + inputs(("data", 2, 3, 4, 5))
    + layer("mean", "Reduction", "data", "mean", "reduction_param { operation: MEAN axis: 2 coeff: 0.5 }")
    + layer("mean_all", "Reduction", "data", "mean_all", "reduction_param { operation: MEAN axis: -3 }"),

    "losses": "force_backward: true\n"
    + inputs(("a", 6, 3), ("b", 6, 3), ("sim", 6), ("x", 4, 5), ("label", 4))
    + layer("contrastive", "ContrastiveLoss", "a b sim", "loss_c", "contrastive_loss_param { margin: 3 }")
    + layer("legacy", "ContrastiveLoss", "a b sim", "loss_l", "loss_weight: 0.5 "
            "contrastive_loss_param { margin: 8 legacy_version: true }")
    + layer("hinge", "HingeLoss", "x label", "loss_h1")
    + layer("hinge2", "HingeLoss", "x label", "loss_h2", "loss_weight: 2 hinge_loss_param { norm: L2 }")
    + layer("softmax", "Softmax", "x", "p")
    + layer("mlogistic", "MultinomialLogisticLoss", "p label", "loss_m"),

    # Embed, BatchReindex, Filter and InfogainLoss's H refuse force_backward (as Caffe): a Bias
    # whose parameter has the data's shape stands in front, so its gradient is the data's.
    "indices": inputs(("x", 4, 2, 3), ("t", 4, 2, 3), ("sel", 4, 1), ("idx", 5), ("words", 2, 3),
                      ("s", 4, 5), ("label", 4), ("H", 5, 5), ("s_spatial", 2, 5, 3), ("label_spatial", 2, 3))
    + layer("bias", "Bias", "x", "xb", "bias_param { axis: 0 num_axes: -1 }")
    + layer("filter", "Filter", "xb t sel", "y tf")
    + layer("loss_f", "EuclideanLoss", "y tf", "loss_f")
    + layer("reindex", "BatchReindex", "xb idx", "r")
    + layer("loss_r", "Reduction", "r", "loss_r", "loss_weight: 1 reduction_param { operation: SUMSQ }")
    + layer("embed", "Embed", "words", "e", "embed_param { input_dim: 7 num_output: 4 }")
    + layer("embed_nb", "Embed", "words", "e2", "embed_param { input_dim: 7 num_output: 2 bias_term: false }")
    + layer("ecat", "Concat", "e e2", "ee", "concat_param { axis: 2 }")
    + layer("loss_e", "Reduction", "ee", "loss_e", "loss_weight: 0.3 reduction_param { operation: SUMSQ }")
    + layer("sb", "Bias", "s", "sb", "bias_param { axis: 0 num_axes: -1 }")
    + layer("infogain", "InfogainLoss", "sb label H", "loss_i prob")
    + layer("sp", "Bias", "s_spatial", "spb", "bias_param { axis: 0 num_axes: -1 }")
    + layer("infogain_sp", "InfogainLoss", "spb label_spatial H", "loss_sp", "loss_weight: 0.7 "
            "loss_param { ignore_label: -1 normalization: BATCH_SIZE }"),

    # Threshold has no backward (Caffe stops at it with force_backward).
    "threshold": inputs(("data", 2, 3, 4), ("data2", 2, 5))
    + layer("threshold", "Threshold", "data", "above", "threshold_param { threshold: 0.2 }")
    + layer("threshold0", "Threshold", "data2", "data2"),

    "recurrent": "force_backward: true\n"
    + inputs(("x", 3, 2, 5), ("cont", 3, 2), ("x_static", 2, 3), ("h0", 1, 2, 4), ("c0", 1, 2, 4),
             ("c_prev", 1, 3, 4), ("gates", 1, 3, 16), ("cont_unit", 1, 3))
    + layer("rnn", "RNN", "x cont", "o", "recurrent_param { num_output: 4 }")
    + layer("rnn_static", "RNN", "x cont x_static", "o_static", "recurrent_param { num_output: 3 }")
    + layer("rnn_exposed", "RNN", "x cont h0", "o_exposed hT",
            "recurrent_param { num_output: 4 expose_hidden: true }")
    + layer("lstm", "LSTM", "x cont", "h", "recurrent_param { num_output: 4 }")
    + layer("lstm_static", "LSTM", "x cont x_static", "h_static", "recurrent_param { num_output: 2 }")
    + layer("lstm_exposed", "LSTM", "x cont h0 c0", "h_exposed lhT lcT",
            "recurrent_param { num_output: 4 expose_hidden: true }")
    + layer("unit", "LSTMUnit", "c_prev gates cont_unit", "c_next h_next"),
})

INPUT_VALUES = {
    "sim": lambda shape, rng: np.array([1, 0, 1, 0, 0, 1]),
    "sel": lambda shape, rng: np.array([1, 0, 1, 1]).reshape(shape),
    "idx": lambda shape, rng: np.array([3, 0, 3, 1, 0]),
    "words": lambda shape, rng: np.array([[3, 0, 3], [6, 1, 0]]),
    "H": lambda shape, rng: np.eye(shape[0]) + 0.3 * rng.random(shape),
    "cont": lambda shape, rng: np.array([[0, 0], [1, 1], [0, 1]]),      # stream 0 restarts at t=2
    # 0.5: Caffe's LSTMUnit backward takes f = cont sigmoid(f') as if it were a sigmoid
    "cont_unit": lambda shape, rng: np.array([[1, 0, 0.5]]),
}

TEST_NET = (
    "force_backward: true\n"
    + inputs(("data", 2, 3, 5, 5))
    + layer("bn", "BatchNorm", "data", "bn")
    + layer("drop", "Dropout", "bn", "bn", "dropout_param { dropout_ratio: 0.5 }")
    + layer("pool", "Pooling", "bn", "pool", "pooling_param { pool: AVE kernel_size: 2 stride: 2 }")
)


def build(text, dtype=np.float32, phase="TRAIN"):
    return Net(parse_text(text, pb.NetParameter()), phase, seed=0, dtype=dtype, device=CPUDevice(64 << 20))


def labels_for(name, shape, rng):
    """Labels for the nets above: class indices, some -1 (ignored)."""
    if name == "label2":
        return rng.integers(0, 3, shape)
    lab = rng.integers(0, 5, shape)
    return np.where(rng.random(shape) < 0.3, -1, lab) if len(shape) > 1 else lab


def randomize(net, rng):
    """Random learnable parameters, and plausible statistics for global-stat BatchNorms."""
    for node in net.graph.layers:
        for i, blob in enumerate(net.params.get(node.name, [])):
            if node.layer.learnable:
                blob.data[...] = rng.standard_normal(blob.data.shape) * 0.5
            elif node.layer.use_global_stats:
                blob.data[...] = [rng.standard_normal, rng.uniform][i % 2](size=blob.data.shape) * 3 \
                    if i < 2 else 3.0


def feed(net, rng):
    values = {}
    for name in net.inputs:
        shape = net.blobs[name].data.shape
        if name in INPUT_VALUES:
            values[name] = INPUT_VALUES[name](shape, rng)
        else:
            values[name] = labels_for(name, shape, rng) if name.startswith("label") else rng.standard_normal(shape)
        net.blobs[name].data[...] = values[name]
    return values


def close(actual, expected, rtol, what):
    """rtol, with an absolute floor of rtol times the array's scale (cancellation near 0)."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    scale = float(np.abs(expected).max(initial=0.0)) or 1.0
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=rtol * scale, err_msg=what)


def run_both(net, values, rng, rtol, top_diffs=None, twin=None):
    """Forward and backward in sncaffe and in the twin; compare everything."""
    twin = twin or TorchNet(net)       # before forward: BatchNorm statistics move in TRAIN
    loss = net.forward()
    loss_tops = {t.name for n in net.graph.layers for t, w in zip(n.tops, n.loss_weights) if w}
    diffs = {}
    for name in twin.outputs:
        blob = net.blobs[name]
        if blob.diff is not None and name not in loss_tops:
            g = top_diffs[name] if top_diffs and name in top_diffs else rng.standard_normal(blob.diff.shape)
            blob.diff[...] = diffs[name] = g
    net.clear_param_diffs()
    net.backward()

    dtype = twin.dtype
    tin = {k: torch.tensor(np.asarray(v), dtype=dtype, requires_grad=net.blobs[k].diff is not None)
           for k, v in values.items()}
    out = twin(tin, all_blobs=True)
    objective = out.loss + sum((out[k] * torch.tensor(g, dtype=dtype)).sum() for k, g in diffs.items())
    if objective.requires_grad:         # not in a forward-only net
        objective.backward()

    close(out.loss.item(), loss, rtol, "loss")
    for name, blob in net.blobs.items():
        close(out[name].detach().numpy(), blob.data, rtol, f"data of {name}")
    for name, x in tin.items():
        if x.requires_grad:
            grad = x.grad if x.grad is not None else torch.zeros_like(x)
            close(grad.numpy(), net.blobs[name].diff, rtol, f"diff of input {name}")
    for node in net.graph.layers:
        for i, (blob, t) in enumerate(zip(net.params.get(node.name, []), twin.blobs_of(node.name))):
            if node.layer.learnable and node.param_need_backward[i]:
                close(t.grad.numpy(), blob.diff, rtol, f"diff of param {node.name}[{i}]")
            close(t.detach().numpy(), blob.data, rtol, f"data of param {node.name}[{i}]")
    return out


# Known sncaffe deviations, each to be fixed in the layer (then this entry goes).
KNOWN = {}


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("name", list(NETS))
def test_small_net(name, dtype, request):
    if (name, dtype) in KNOWN:
        request.applymarker(pytest.mark.xfail(reason=KNOWN[name, dtype], strict=True))
    rng = np.random.default_rng(7)
    net = build(NETS[name], dtype)
    randomize(net, rng)
    run_both(net, feed(net, rng), rng, TOL[dtype])


def test_test_phase_batchnorm_and_dropout():
    rng = np.random.default_rng(3)
    net = build(TEST_NET, phase="TEST")
    randomize(net, rng)
    run_both(net, feed(net, rng), rng, TOL[np.float32])


RECURRENT_CARRY = (
    "force_backward: true\n"
    + inputs(("x", 3, 2, 5), ("cont_carry", 3, 2))
    + layer("rnn", "RNN", "x cont_carry", "o", "recurrent_param { num_output: 4 }")
    + layer("lstm", "LSTM", "x cont_carry", "h", "recurrent_param { num_output: 3 }")
)
INPUT_VALUES["cont_carry"] = lambda shape, rng: np.array([[1, 0], [1, 1], [0, 1]])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_recurrent_state_carries_to_the_next_forward(dtype):
    """Without expose_hidden, Caffe's RNN/LSTM start a forward from the state the last one ended
    in (stream 0 continues at t=0 here); no gradient crosses between the two forwards."""
    rng = np.random.default_rng(5)
    net = build(RECURRENT_CARRY, dtype)
    randomize(net, rng)
    twin = TorchNet(net)
    first = feed(net, rng)
    net.forward()
    twin({k: torch.tensor(np.asarray(v), dtype=twin.dtype) for k, v in first.items()})
    out = run_both(net, feed(net, rng), rng, TOL[dtype], twin=twin)
    fresh = TorchNet(net)({k: torch.tensor(net.blobs[k].data) for k in ("x", "cont_carry")})
    assert not torch.allclose(out["o"][0, 0], fresh["o"][0, 0])      # the carried state mattered


def test_no_twin_types_say_why(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    net = build(inputs(("data", 2, 3)) + layer("out", "HDF5Output", "data data", "",
                                                'hdf5_output_param { file_name: "out.h5" }'))
    with pytest.raises(TorchNetError, match='"out".*HDF5Output.*no torch twin: it writes'):
        TorchNet(net)


def test_dropout_in_train_cannot_be_twinned():
    net = build(inputs(("data", 2, 3)) + layer("drop", "Dropout", "data", "y"))
    with pytest.raises(TorchNetError, match="drop"):
        TorchNet(net)({"data": np.zeros((2, 3))})


def test_unsupported_type_is_a_clear_error():
    net = build(inputs(("data", 2, 6)) + layer("am", "ArgMax", "data", "y"))
    with pytest.raises(TorchNetError, match='"am".*ArgMax'):
        TorchNet(net)


@needs_shared
@pytest.mark.parametrize("case", ["lenet", "resblock", "inception"])
def test_golden_net(case):
    import h5py
    d = SHARED / "golden" / "nets" / case
    net = Net(d / "net.prototxt", "TRAIN", weights=d / "weights.caffemodel", device=CPUDevice(64 << 20))
    with h5py.File(d / "input.h5") as f:
        values = {k.replace("|", "/"): v[()] for k, v in f["inputs"].items()}
        top_diffs = {k.replace("|", "/"): v[()] for k, v in f.get("top_diffs", {}).items()}
    with h5py.File(d / "expected.h5") as f:
        caffe_loss = float(f.attrs["loss"][0])
    for k, v in values.items():
        net.blobs[k].data[...] = v
    out = run_both(net, values, np.random.default_rng(0), TOL[np.float32], top_diffs)
    close(out.loss.item(), caffe_loss, 1e-4, "torch loss against Caffe's")


def golden_cases():
    if SHARED is None:
        return []
    root = SHARED / "golden"
    return ([f"coverage/{p.name}" for p in sorted((root / "coverage").iterdir()) if p.name != "hdf5_output"]
            + [f"coverage-nets/{p.name}" for p in sorted((root / "coverage-nets").iterdir())])


@needs_shared
@pytest.mark.parametrize("case", golden_cases())
def test_twin_against_caffe(case, monkeypatch):
    """The twin alone against BVLC Caffe's dumps (README-coverage.md): loss, every blob's data,
    the diffs of the inputs and of every parameter, float32, at the nets' tolerance."""
    import h5py
    d = SHARED / "golden" / case
    monkeypatch.chdir(d)        # infogain_loss_file reads H.binaryproto from the working directory
    net = Net(d / "net.prototxt", "TRAIN", weights=d / "weights.caffemodel", device=CPUDevice(64 << 20))
    twin = TorchNet(net)
    with h5py.File(d / "input.h5") as f:
        values = {k.replace("|", "/"): v[()] for k, v in f["inputs"].items()}
        top_diffs = {k.replace("|", "/"): v[()] for k, v in f.get("top_diffs", {}).items()}
    # Which inputs and parameters get a gradient is the Net's graph (Caffe's need-backward rules).
    tin = {k: torch.tensor(np.asarray(v), dtype=torch.float32, requires_grad=net.blobs[k].diff is not None)
           for k, v in values.items()}
    out = twin(tin, all_blobs=True)
    objective = out.loss + sum((out[k] * torch.tensor(g)).sum() for k, g in top_diffs.items())
    if objective.requires_grad:
        objective.backward()
    rtol = 1e-4
    with h5py.File(d / "expected.h5") as f:
        close(out.loss.item(), float(f.attrs["loss"][0]), rtol, "loss")
        blobs = {k.replace("|", "/"): v for k, v in f["blobs"].items()}
        for name, tensor in out.items():
            if name in blobs:
                close(tensor.detach().numpy(), blobs[name]["data"][()], rtol, f"data of {name}")
        for name, x in tin.items():
            grad = x.grad if x.grad is not None else torch.zeros_like(x)
            close(grad.numpy(), blobs[name.replace("/", "|")]["diff"][()], rtol, f"diff of input {name}")
        for node in net.graph.layers:
            for i, t in enumerate(twin.blobs_of(node.name)):
                stored = f["params"][node.name.replace("/", "|")][str(i)]
                close(t.detach().numpy(), stored["data"][()], rtol, f"data of param {node.name}[{i}]")
                if node.layer.learnable:
                    grad = t.grad if t.grad is not None else torch.zeros_like(t)
                    close(grad.numpy(), stored["diff"][()], rtol, f"diff of param {node.name}[{i}]")
