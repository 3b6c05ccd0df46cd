"""BlobProto <-> ndarray, and reading/writing binary NetParameter files (.caffemodel)."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from .proto import sncaffe_pb2 as pb


def blob_shape(blob) -> tuple:
    """A BlobProto's shape, from ``shape`` or the legacy num/channels/height/width."""
    legacy = ("num", "channels", "height", "width")
    if any(blob.HasField(f) for f in legacy):
        return tuple(int(getattr(blob, f)) for f in legacy)
    return tuple(int(d) for d in blob.shape.dim)     # no dims at all: a scalar


def to_array(blob, dtype=np.float32, diff=False) -> np.ndarray:
    shape = blob_shape(blob)
    if diff:
        values = blob.double_diff if len(blob.double_diff) else blob.diff
    else:
        values = blob.double_data if len(blob.double_data) else blob.data
    a = np.asarray(values, dtype=dtype)
    if a.size != int(np.prod(shape, dtype=np.int64)):
        raise ValueError(f"blob with shape {shape} holds {a.size} values")
    return a.reshape(shape)


def from_array(array, blob=None, diff=None):
    blob = pb.BlobProto() if blob is None else blob
    blob.shape.dim.extend(int(d) for d in np.shape(array))
    blob.data.extend(np.asarray(array, dtype=np.float32).ravel().tolist())
    if diff is not None:
        blob.diff.extend(np.asarray(diff, dtype=np.float32).ravel().tolist())
    return blob


def read_binary(path, message):
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ValueError(f"{path}: cannot read: {e.strerror}") from None
    try:
        message.ParseFromString(data)
    except Exception as e:  # protobuf's DecodeError
        raise ValueError(f"{path}: not a binary {message.DESCRIPTOR.name}: {e}") from None
    return message


def read_caffemodel(path) -> "pb.NetParameter":
    return read_binary(path, pb.NetParameter())
