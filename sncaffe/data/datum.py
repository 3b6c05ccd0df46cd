"""Caffe's ``Datum`` record <-> arrays (C, H, W): raw uint8 bytes, float_data, or an encoded image."""
from __future__ import annotations

import numpy as np

from ..proto import sncaffe_pb2 as pb
from . import image


def parse(value: bytes, what="datum", message=None):
    """``value`` parsed into ``message`` (default a Datum); a ValueError naming ``what`` where it
    is not one."""
    message = pb.Datum() if message is None else message
    try:
        message.ParseFromString(value)
    except Exception as e:  # protobuf's DecodeError
        raise ValueError(f"{what}: not a{'n' * (message.DESCRIPTOR.name[0] in 'AEIOU')} "
                         f"{message.DESCRIPTOR.name} record ({e})") from None
    return message


def to_array(datum, color=None, what="datum") -> np.ndarray:
    """The datum's pixels as (C, H, W): uint8 for bytes and images, float32 for float_data.

    ``color`` applies to encoded datums only: None keeps the image's own
    channels, True forces 3 (BGR), False forces 1 (Caffe's force_color/force_gray).
    """
    if datum.encoded:
        return image.decode(datum.data, color, what)
    shape = (datum.channels, datum.height, datum.width)
    n = shape[0] * shape[1] * shape[2]
    if datum.data:
        a = np.frombuffer(datum.data, dtype=np.uint8)
    else:
        a = np.asarray(datum.float_data, dtype=np.float32)
    if a.size != n or n == 0:
        raise ValueError(f"{what}: holds {a.size} values for shape {shape}")
    return a.reshape(shape)


def from_array(array, label=0) -> "pb.Datum":
    """A raw datum: uint8 arrays go to ``data`` bytes, any other dtype to ``float_data``."""
    a = np.asarray(array)
    if a.ndim != 3:
        raise ValueError(f"a datum holds a (C, H, W) array, got shape {a.shape}")
    datum = pb.Datum(channels=a.shape[0], height=a.shape[1], width=a.shape[2], label=int(label))
    if a.dtype == np.uint8:
        datum.data = np.ascontiguousarray(a).tobytes()
    else:
        datum.float_data.extend(a.astype(np.float32).ravel().tolist())
    return datum


def encoded(buf: bytes, label=0) -> "pb.Datum":
    """An encoded datum, as Caffe's ReadFileToDatum writes it (no channels/height/width)."""
    return pb.Datum(data=buf, label=int(label), encoded=True)
