"""Old Caffe files upgraded on load, as Caffe's util/upgrade_proto.cpp.

``upgrade_net`` takes a NetParameter from a prototxt or a .caffemodel and returns it in the
current (V2, ``layer``) format: V0 (``layers { layer { type: "conv" } }``, padding layers)
to V1, V1's data-transformation fields into ``transform_param``, V1 (``layers { type:
CONVOLUTION }``) to V2, net-level inputs without shapes (the legacy caffemodel form) stripped
(with shapes they become an Input layer in prototxt.upgrade_inputs), BatchNorm's three old
ParamSpecs frozen, and the fork fields read as their BVLC equivalents (``ceil_mode``).
``upgrade_solver`` turns the old ``solver_type`` enum into ``type``. Each step logs Caffe's
notice through the "sncaffe" logger.
"""
from __future__ import annotations

import logging

from .proto import sncaffe_pb2 as pb
from .validate import PrototxtError

log = logging.getLogger("sncaffe")

V1 = pb.V1LayerParameter


class UpgradeError(PrototxtError):
    """An old file that Caffe cannot upgrade either."""


def needs_upgrade(param, binary=False) -> bool:
    return bool(param.layers) or (binary and _needs_input_strip(param)) or any(
        _old_batch_norm(lp) or lp.pooling_param.HasField("ceil_mode") for lp in param.layer)


def upgrade_net(param, source="net", binary=False):
    """``param`` in the current format (a new message; ``param`` itself is not changed). ``binary``:
    read from a .caffemodel, whose net inputs are names without shapes (stripped, as Caffe does; in
    a prototxt they are an error in prototxt.upgrade_inputs)."""
    if not needs_upgrade(param, binary):
        return param
    out = pb.NetParameter()
    out.CopyFrom(param)
    if any(l.HasField("layer") for l in out.layers):
        log.info("Attempting to upgrade input file specified using deprecated V0LayerParameter: %s", source)
        out = _v0_to_v1(out, source)
        log.warning("Note that future Caffe releases will not support V0NetParameter; use "
                    "`sncaffe upgrade` to write the upgraded net.")
    if any(_has_old_transform(l) for l in out.layers):
        log.info("Attempting to upgrade input file specified using deprecated transformation "
                 "parameters: %s", source)
        for l in out.layers:
            _move_transform(l)
    if out.layers:
        if out.layer:
            raise UpgradeError(f"{source}: refusing to upgrade inconsistent NetParameter input; the definition "
                               "includes both 'layer' and 'layers' fields. The current format defines "
                               "'layer' fields with string type like layer { type: 'Layer' ... } and not "
                               "layers { type: LAYER ... }. Manually switch the definition to 'layer' format.")
        log.info("Attempting to upgrade input file specified using deprecated V1LayerParameter: %s", source)
        for v1 in out.layers:
            out.layer.add().CopyFrom(_v1_to_v2(v1, source))
        del out.layers[:]
    if binary and _needs_input_strip(out):     # a legacy caffemodel: input names without shapes
        log.warning("Note that future Caffe releases will only support input layers and not input fields.")
        del out.input[:]
    for lp in out.layer:
        if _old_batch_norm(lp):
            for spec in lp.param:
                spec.lr_mult = spec.decay_mult = 0
        _fork_fields(lp, source)
    return out


def upgrade_solver(param, source="solver"):
    """Caffe's UpgradeSolverType: ``solver_type: NESTEROV`` becomes ``type: "Nesterov"`` (in place)."""
    if param.HasField("solver_type") and not param.HasField("type"):
        log.info("Attempting to upgrade input file specified using deprecated 'solver_type' field "
                 "(enum)': %s", source)
        param.type = ("SGD", "Nesterov", "AdaGrad", "RMSProp", "AdaDelta", "Adam")[param.solver_type]
        param.ClearField("solver_type")
    return param


# -- fork fields (the schema's comments list them) ---------------------------------------------

def _fork_fields(lp, source):
    pp = lp.pooling_param
    if pp.HasField("ceil_mode"):
        mode = pb.PoolingParameter.CEIL if pp.ceil_mode else pb.PoolingParameter.FLOOR
        if pp.HasField("round_mode") and pp.round_mode != mode:
            raise UpgradeError(f'{source}: layer "{lp.name}": pooling_param gives ceil_mode: '
                               f"{str(pp.ceil_mode).lower()} and round_mode: "
                               f"{pb.PoolingParameter.RoundMode.Name(pp.round_mode)}, which disagree")
        pp.round_mode = mode
        pp.ClearField("ceil_mode")


def _old_batch_norm(lp) -> bool:
    return lp.type == "BatchNorm" and len(lp.param) == 3


def _needs_input_strip(param) -> bool:
    return bool(param.input) and not param.input_dim and not param.input_shape


# -- V1 to V2 (UpgradeV1LayerParameter) -------------------------------------------------------

V1_TYPES = {
    "NONE": "", "ABSVAL": "AbsVal", "ACCURACY": "Accuracy", "ARGMAX": "ArgMax", "BNLL": "BNLL",
    "CONCAT": "Concat", "CONTRASTIVE_LOSS": "ContrastiveLoss", "CONVOLUTION": "Convolution",
    "DECONVOLUTION": "Deconvolution", "DATA": "Data", "DROPOUT": "Dropout", "DUMMY_DATA": "DummyData",
    "EUCLIDEAN_LOSS": "EuclideanLoss", "ELTWISE": "Eltwise", "EXP": "Exp", "FLATTEN": "Flatten",
    "HDF5_DATA": "HDF5Data", "HDF5_OUTPUT": "HDF5Output", "HINGE_LOSS": "HingeLoss", "IM2COL": "Im2col",
    "IMAGE_DATA": "ImageData", "INFOGAIN_LOSS": "InfogainLoss", "INNER_PRODUCT": "InnerProduct",
    "LRN": "LRN", "MEMORY_DATA": "MemoryData", "MULTINOMIAL_LOGISTIC_LOSS": "MultinomialLogisticLoss",
    "MVN": "MVN", "POOLING": "Pooling", "POWER": "Power", "RELU": "ReLU", "SIGMOID": "Sigmoid",
    "SIGMOID_CROSS_ENTROPY_LOSS": "SigmoidCrossEntropyLoss", "SILENCE": "Silence", "SOFTMAX": "Softmax",
    "SOFTMAX_LOSS": "SoftmaxWithLoss", "SPLIT": "Split", "SLICE": "Slice", "TANH": "TanH",
    "WINDOW_DATA": "WindowData", "THRESHOLD": "Threshold",
}
# V1's *_param sub-messages, copied as they are (the same messages in LayerParameter)
_V1_PARAMS = [f.name for f in V1.DESCRIPTOR.fields if f.name.endswith("_param") and f.message_type]


def _v1_to_v2(v1, source):
    lp = pb.LayerParameter(name=v1.name, bottom=v1.bottom, top=v1.top, include=v1.include,
                           exclude=v1.exclude, blobs=v1.blobs, loss_weight=v1.loss_weight)
    if v1.HasField("type"):
        lp.type = V1_TYPES[V1.LayerType.Name(v1.type)]

    def spec(i):
        while len(lp.param) <= i:
            lp.param.add()
        return lp.param[i]
    for i, name in enumerate(v1.param):
        spec(i).name = name
    for i, mode in enumerate(v1.blob_share_mode):
        spec(i).share_mode = mode           # STRICT/PERMISSIVE have the same numbers
    for i, lr in enumerate(v1.blobs_lr):
        spec(i).lr_mult = lr
    for i, decay in enumerate(v1.weight_decay):
        spec(i).decay_mult = decay
    for name in _V1_PARAMS:
        if v1.HasField(name):
            getattr(lp, name).CopyFrom(getattr(v1, name))
    if v1.HasField("layer"):
        log.error('%s: layer "%s": input NetParameter has V0 layer -- ignoring', source, v1.name)
    return lp


# -- V1 data transformation (UpgradeNetDataTransformation) ------------------------------------

_TRANSFORMED = {V1.DATA: "data_param", V1.IMAGE_DATA: "image_data_param", V1.WINDOW_DATA: "window_data_param"}
_TRANSFORM_FIELDS = ("scale", "mean_file", "crop_size", "mirror")


def _has_old_transform(v1) -> bool:
    name = _TRANSFORMED.get(v1.type)
    return bool(name) and v1.HasField(name) and any(getattr(v1, name).HasField(f) for f in _TRANSFORM_FIELDS)


def _move_transform(v1) -> None:
    name = _TRANSFORMED.get(v1.type)
    if not name or not v1.HasField(name):
        return
    p = getattr(v1, name)
    for f in _TRANSFORM_FIELDS:
        if p.HasField(f):
            setattr(v1.transform_param, f, getattr(p, f))
            p.ClearField(f)


# -- V0 to V1 (UpgradeV0Net, UpgradeV0PaddingLayers, UpgradeV0LayerParameter) ------------------

V0_TYPES = {
    "accuracy": "ACCURACY", "bnll": "BNLL", "concat": "CONCAT", "conv": "CONVOLUTION", "data": "DATA",
    "dropout": "DROPOUT", "euclidean_loss": "EUCLIDEAN_LOSS", "flatten": "FLATTEN", "hdf5_data": "HDF5_DATA",
    "hdf5_output": "HDF5_OUTPUT", "im2col": "IM2COL", "images": "IMAGE_DATA", "infogain_loss": "INFOGAIN_LOSS",
    "innerproduct": "INNER_PRODUCT", "lrn": "LRN", "multinomial_logistic_loss": "MULTINOMIAL_LOGISTIC_LOSS",
    "pool": "POOLING", "relu": "RELU", "sigmoid": "SIGMOID", "softmax": "SOFTMAX", "softmax_loss": "SOFTMAX_LOSS",
    "split": "SPLIT", "tanh": "TANH", "window_data": "WINDOW_DATA",
}
ANY = "*"
_DATA_SOURCES = {"data": "data_param", "hdf5_data": "hdf5_data_param", "images": "image_data_param",
                 "window_data": "window_data_param"}
# V0 field -> {V0 type (ANY: every type): (V1 sub-message, its field)}
V0_FIELDS = {
    "num_output": {"conv": ("convolution_param", "num_output"), "innerproduct": ("inner_product_param", "num_output")},
    "biasterm": {"conv": ("convolution_param", "bias_term"), "innerproduct": ("inner_product_param", "bias_term")},
    "weight_filler": {"conv": ("convolution_param", "weight_filler"),
                      "innerproduct": ("inner_product_param", "weight_filler")},
    "bias_filler": {"conv": ("convolution_param", "bias_filler"), "innerproduct": ("inner_product_param", "bias_filler")},
    "pad": {"conv": ("convolution_param", "pad"), "pool": ("pooling_param", "pad")},
    "kernelsize": {"conv": ("convolution_param", "kernel_size"), "pool": ("pooling_param", "kernel_size")},
    "group": {"conv": ("convolution_param", "group")},
    "stride": {"conv": ("convolution_param", "stride"), "pool": ("pooling_param", "stride")},
    "pool": {"pool": ("pooling_param", "pool")},            # MAX/AVE/STOCHASTIC: the same numbers
    "dropout_ratio": {"dropout": ("dropout_param", "dropout_ratio")},
    "local_size": {"lrn": ("lrn_param", "local_size")},
    "alpha": {"lrn": ("lrn_param", "alpha")},
    "beta": {"lrn": ("lrn_param", "beta")},
    "k": {"lrn": ("lrn_param", "k")},
    "source": {**{t: (p, "source") for t, p in _DATA_SOURCES.items()},
               "infogain_loss": ("infogain_loss_param", "source")},
    "scale": {ANY: ("transform_param", "scale")},
    "meanfile": {ANY: ("transform_param", "mean_file")},
    "batchsize": {t: (p, "batch_size") for t, p in _DATA_SOURCES.items()},
    "cropsize": {ANY: ("transform_param", "crop_size")},
    "mirror": {ANY: ("transform_param", "mirror")},
    "rand_skip": {"data": ("data_param", "rand_skip"), "images": ("image_data_param", "rand_skip")},
    "shuffle_images": {"images": ("image_data_param", "shuffle")},
    "new_height": {"images": ("image_data_param", "new_height")},
    "new_width": {"images": ("image_data_param", "new_width")},
    "concat_dim": {"concat": ("concat_param", "concat_dim")},
    "det_fg_threshold": {"window_data": ("window_data_param", "fg_threshold")},
    "det_bg_threshold": {"window_data": ("window_data_param", "bg_threshold")},
    "det_fg_fraction": {"window_data": ("window_data_param", "fg_fraction")},
    "det_context_pad": {"window_data": ("window_data_param", "context_pad")},
    "det_crop_mode": {"window_data": ("window_data_param", "crop_mode")},
    "hdf5_output_param": {"hdf5_output": ("hdf5_output_param", None)},
}


def _v0_to_v1(param, source):
    param = _v0_padding(param, source)
    out = pb.NetParameter()
    if param.HasField("name"):
        out.name = param.name
    for conn in param.layers:
        out.layers.add().CopyFrom(_v0_layer(conn, source))
    out.input.extend(param.input)
    out.input_dim.extend(param.input_dim)
    if param.HasField("force_backward"):
        out.force_backward = param.force_backward
    return out


def _v0_padding(param, source):
    """V0 "padding" layers folded into the conv or pool layer that reads them."""
    out = pb.NetParameter()
    out.CopyFrom(param)
    del out.layers[:]
    last_top = {name: -1 for name in param.input}
    for i, conn in enumerate(param.layers):
        lp = conn.layer
        if lp.type != "padding":
            out.layers.add().CopyFrom(conn)
        for j, blob in enumerate(conn.bottom):
            if blob not in last_top:
                raise UpgradeError(f'{source}: layer "{lp.name}": unknown bottom blob "{blob}"')
            src = last_top[blob]
            if src == -1 or param.layers[src].layer.type != "padding":
                continue
            pad_layer = param.layers[src]
            if lp.type not in ("conv", "pool") or len(conn.bottom) != 1 or len(pad_layer.bottom) != 1 \
                    or len(pad_layer.top) != 1:
                raise UpgradeError(f'{source}: layer "{lp.name}" ({lp.type}) reads padding layer '
                                   f'"{pad_layer.layer.name}": only a conv or pool layer with one bottom may, '
                                   "from a padding layer with one bottom and one top")
            out.layers[-1].layer.pad = pad_layer.layer.pad
            out.layers[-1].bottom[j] = pad_layer.bottom[0]
        for blob in conn.top:
            last_top[blob] = i
    return out


def _v0_layer(conn, source):
    v1 = pb.V1LayerParameter(bottom=conn.bottom, top=conn.top)
    if not conn.HasField("layer"):
        return v1
    v0 = conn.layer
    kind = v0.type
    if v0.HasField("name"):
        v1.name = v0.name
    if v0.HasField("type"):
        if kind not in V0_TYPES:
            raise UpgradeError(f'{source}: layer "{v0.name}": unknown V0 layer type "{kind}"')
        v1.type = V1.LayerType.Value(V0_TYPES[kind])
    v1.blobs.extend(v0.blobs)
    v1.blobs_lr.extend(v0.blobs_lr)
    v1.weight_decay.extend(v0.weight_decay)
    for field, targets in V0_FIELDS.items():
        if not v0.HasField(field):
            continue
        target = targets.get(kind, targets.get(ANY))
        if target is None:
            log.error('%s: layer "%s": unknown parameter %s for layer type %s', source, v0.name, field, kind)
            continue
        msg, name = target
        value, sub = getattr(v0, field), getattr(v1, msg)
        if name is None:
            sub.CopyFrom(value)
        elif hasattr(getattr(sub, name), "CopyFrom"):
            getattr(sub, name).CopyFrom(value)
        elif hasattr(getattr(sub, name), "append"):
            getattr(sub, name).append(value)        # Convolution's repeated pad/kernel_size/stride
        else:
            setattr(sub, name, value)
    return v1
