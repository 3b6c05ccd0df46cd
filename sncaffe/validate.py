"""Shape and size checks at graph build, so a bad number is an error naming its field, never a
crash or a view over the wrong memory later (a negative Input dim once aliased most of the pool).

``check_fields`` looks at the settings that are sizes (dims, num_output, kernels, strides, batch
sizes) before a layer is set up; ``check_shapes`` looks at every shape a layer declares after
its setup. Blob counts are bounded by 2^31 - 1 as in Caffe's Blob::Reshape (kernels index with int).
"""
from __future__ import annotations

import math


class PrototxtError(ValueError):
    """A file that does not parse or does not make sense, located in its text."""


INT_MAX = 2**31 - 1


def located(lp) -> str:
    """ "file:line: " of a layer read from a prototxt (``defined_at``), "" for one made in code."""
    return f"{lp.defined_at}: " if lp.defined_at else ""

# (message field, field): the value, or each value of a repeated field, must be >= the bound.
_AT_LEAST = {
    ("input_param", "shape.dim"): 1,
    ("dummy_data_param", "shape.dim"): 1,
    ("dummy_data_param", "num"): 1, ("dummy_data_param", "channels"): 1,
    ("dummy_data_param", "height"): 1, ("dummy_data_param", "width"): 1,
    ("convolution_param", "num_output"): 1, ("convolution_param", "kernel_size"): 1,
    ("convolution_param", "kernel_h"): 1, ("convolution_param", "kernel_w"): 1,
    ("convolution_param", "stride"): 1, ("convolution_param", "stride_h"): 1,
    ("convolution_param", "stride_w"): 1, ("convolution_param", "dilation"): 1,
    ("convolution_param", "group"): 1, ("convolution_param", "pad"): 0,
    ("convolution_param", "pad_h"): 0, ("convolution_param", "pad_w"): 0,
    ("pooling_param", "kernel_size"): 1, ("pooling_param", "kernel_h"): 1, ("pooling_param", "kernel_w"): 1,
    ("pooling_param", "stride"): 1, ("pooling_param", "stride_h"): 1, ("pooling_param", "stride_w"): 1,
    ("pooling_param", "pad"): 0, ("pooling_param", "pad_h"): 0, ("pooling_param", "pad_w"): 0,
    ("inner_product_param", "num_output"): 1,
    ("embed_param", "num_output"): 1, ("embed_param", "input_dim"): 1,
    ("lrn_param", "local_size"): 1,
    ("data_param", "batch_size"): 1, ("image_data_param", "batch_size"): 1,
    ("hdf5_data_param", "batch_size"): 1, ("memory_data_param", "batch_size"): 1,
    ("memory_data_param", "channels"): 1, ("memory_data_param", "height"): 1,
    ("memory_data_param", "width"): 1,
    ("image_data_param", "new_height"): 0, ("image_data_param", "new_width"): 0,
    ("transform_param", "crop_size"): 0,
}


def _values(msg, path: str, prefix: str):
    """(field path as written in the prototxt, value) for a dotted path through repeated messages."""
    head, _, rest = path.partition(".")
    fd = msg.DESCRIPTOR.fields_by_name[head]
    repeated = getattr(fd, "is_repeated", None)
    if repeated is None:                   # older protobuf
        repeated = fd.label == fd.LABEL_REPEATED
    if repeated:
        items = list(enumerate(getattr(msg, head)))
    elif msg.HasField(head):
        items = [(None, getattr(msg, head))]
    else:
        items = []
    for i, v in items:
        name = f"{prefix}.{head}" + (f"[{i}]" if i is not None else "")
        if rest:
            yield from _values(v, rest, name)
        else:
            yield name, v


def check_fields(lp, error) -> None:
    """Raise ``error(msg)`` for the first size field of ``lp`` below its bound or over INT_MAX,
    or a loss weight or learning-rate multiplier that is not a finite number."""
    for i, w in enumerate(lp.loss_weight):
        if not math.isfinite(w):
            raise error(f"loss_weight[{i}] is {w}; it must be a finite number")
    for i, spec in enumerate(lp.param):
        for name in ("lr_mult", "decay_mult"):
            if not math.isfinite(getattr(spec, name)):
                raise error(f"param[{i}].{name} is {getattr(spec, name)}; it must be a finite number")
    for (sub, path), low in _AT_LEAST.items():
        if not lp.HasField(sub):
            continue
        for name, v in _values(getattr(lp, sub), path, sub):
            if v < low:
                raise error(f"{name} is {v}; it must be {'positive' if low == 1 else 'zero or more'}")
            if v > INT_MAX:
                raise error(f"{name} is {v}, over 2^31 - 1")


def check_shape(shape, what: str, error) -> None:
    """Every dim positive and the count within INT_MAX (Caffe: CHECK_LE(count_, INT_MAX))."""
    if any(d <= 0 for d in shape):
        raise error(f"{what} would have shape {tuple(shape)}: every dimension must be positive")
    n = math.prod(shape)
    if n > INT_MAX:
        raise error(f"{what} would have shape {tuple(shape)}, {n} values: over 2^31 - 1, more than "
                    "a kernel can index")
