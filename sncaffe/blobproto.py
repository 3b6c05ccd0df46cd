"""BlobProto <-> ndarray, and reading/writing binary NetParameter files (.caffemodel)."""
from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np

from .proto import sncaffe_pb2 as pb
from .upgrade import upgrade_net


def blob_shape(blob) -> tuple:
    """A BlobProto's shape, from ``shape`` or the legacy num/channels/height/width."""
    legacy = ("num", "channels", "height", "width")
    if any(blob.HasField(f) for f in legacy):
        return tuple(int(getattr(blob, f)) for f in legacy)
    return tuple(int(d) for d in blob.shape.dim)     # no dims at all: a scalar


# Field numbers of BlobProto's packed value arrays (proto/sncaffe.proto).
_VALUES = {"data": (5, "<f4"), "diff": (6, "<f4"), "double_data": (8, "<f8"), "double_diff": (9, "<f8")}


def _varint(buf, i):
    value = shift = 0
    while True:
        b = buf[i]
        value |= (b & 0x7F) << shift
        i += 1
        if b < 0x80:
            return value, i
        shift += 7


def _packed(blob, field) -> np.ndarray:
    """A packed repeated float/double field as an array, straight from the wire bytes: iterating
    protobuf's repeated container costs a Python float per value (ResNet-2500 has 0.9 billion)."""
    number, dtype = _VALUES[field]
    probe = type(blob)()
    getattr(probe, field).MergeFrom(getattr(blob, field))
    buf = memoryview(probe.SerializeToString())
    parts, i = [], 0
    while i < len(buf):
        tag, i = _varint(buf, i)
        if tag & 7 != 2:
            raise ValueError(f"BlobProto.{field}: unexpected wire type {tag & 7}")
        n, i = _varint(buf, i)
        if tag >> 3 == number:
            parts.append(np.frombuffer(buf[i:i + n], dtype))
        i += n
    if not parts:
        return np.empty(0, dtype)
    return np.concatenate(parts) if len(parts) > 1 else parts[0]


def to_array(blob, dtype=np.float32, diff=False) -> np.ndarray:
    shape = blob_shape(blob)
    field = ("double_diff" if len(blob.double_diff) else "diff") if diff else \
        ("double_data" if len(blob.double_data) else "data")
    if any(d < 0 for d in shape):
        raise ValueError(f"blob with shape {shape}: a negative dimension")
    a = _packed(blob, field).astype(dtype)
    if a.size != math.prod(shape):
        raise ValueError(f"blob with shape {shape} ({math.prod(shape)} values) holds {a.size} values")
    return a.reshape(shape)


def _field_bytes(number: int, payload: bytes) -> bytes:
    head, n = bytearray(), (number << 3) | 2
    for value in (n, len(payload)):
        while value >= 0x80:
            head.append((value & 0x7F) | 0x80)
            value >>= 7
        head.append(value)
    return bytes(head) + payload


def from_array(array, blob=None, diff=None):
    """Fill a BlobProto (shape, data, optional diff) from arrays, as packed wire bytes."""
    blob = pb.BlobProto() if blob is None else blob
    blob.shape.dim.extend(int(d) for d in np.shape(array))
    wire = _field_bytes(5, np.ascontiguousarray(array, dtype="<f4").tobytes())
    if diff is not None:
        wire += _field_bytes(6, np.ascontiguousarray(diff, dtype="<f4").tobytes())
    blob.MergeFromString(wire)
    return blob


HDF5_MAGIC = b"\x89HDF\r\n\x1a\n"


def read_binary(path, message):
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ValueError(f"{path}: cannot read: {e.strerror}") from None
    if data[:8] == HDF5_MAGIC:                  # Caffe's snapshot_format: HDF5 (a .caffemodel.h5)
        if isinstance(message, pb.NetParameter):
            return read_caffemodel_h5(path)
        raise ValueError(f"{path}: an HDF5 file, not a binary {message.DESCRIPTOR.name} (HDF5 snapshots "
                         "are not supported; use snapshot_format: BINARYPROTO)")
    try:
        message.ParseFromString(data)
    except Exception as e:  # protobuf's DecodeError
        raise ValueError(f"{path}: not a binary {message.DESCRIPTOR.name}: {e}") from None
    return message


def read_caffemodel(path) -> "pb.NetParameter":
    """A .caffemodel, V0/V1 ones upgraded as Caffe's ReadNetParamsFromBinaryFileOrDie does."""
    return upgrade_net(read_binary(path, pb.NetParameter()), str(path), binary=True)


class _Refused(Exception):
    """A layer ``keep`` refused: its own message, not a file that is no HDF5 weights."""


def read_h5_blobs(path, keep=None) -> dict:
    """Caffe's HDF5 weights (Net::ToHDF5): a group ``data`` with a group per layer holding datasets
    ``0``, ``1``, ... in blob order. Returns {layer: {index: array}} in the file's dtype; an index
    may be missing (a parameter its sharer's owner holds). ``keep(layer, {index: shape})`` says
    (or raises) from the shapes alone whether a layer's data is read: the data can be far larger
    than the file."""
    import h5py
    out = {}
    try:
        with h5py.File(path, "r") as f:
            data = f.get("data")
            if not isinstance(data, h5py.Group):
                raise ValueError("no group \"data\" (Caffe's HDF5 weights keep their layers there)")
            for name, group in data.items():
                if not isinstance(group, h5py.Group):
                    raise ValueError(f'data/{name} is not a group of blobs')
                if any(not k.isdigit() for k in group.keys()):
                    raise ValueError(f"data/{name} holds {sorted(group.keys())}; Caffe names the blobs 0, 1, ...")
                sets = {int(k): group[k] for k in group.keys()}
                bad = [k for k, d in sets.items() if not isinstance(d, h5py.Dataset) or d.dtype.kind not in "fiub"]
                if bad:
                    raise ValueError(f"data/{name}/{bad[0]} is not a dataset of numbers")
                try:
                    wanted = keep is None or keep(name, {k: d.shape for k, d in sets.items()})
                except ValueError as e:
                    raise _Refused(e) from None
                if wanted:
                    out[name] = {k: np.asarray(d[...]) for k, d in sets.items()}
    except _Refused as e:
        raise ValueError(f"{path}: {e}") from None
    except (OSError, ValueError, TypeError, KeyError, RuntimeError) as e:     # RuntimeError: HDF5's, on damage
        raise ValueError(f"{path}: not Caffe HDF5 weights: {e}") from None
    return out


def read_caffemodel_h5(path) -> "pb.NetParameter":
    """Caffe's HDF5 weights as a NetParameter (float32 blobs, as a .caffemodel holds them)."""
    out = pb.NetParameter()
    for name, blobs in read_h5_blobs(path).items():
        lp = out.layer.add(name=name)
        for i in sorted(blobs):
            from_array(np.asarray(blobs[i], np.float32), lp.blobs.add())
    return out


def write_atomic(path, chunks) -> None:
    """Write bytes (or an iterable of byte chunks) next to ``path`` and rename, so an interrupted
    write never replaces a good file."""
    path = str(path)
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            for chunk in ([chunks] if isinstance(chunks, (bytes, bytearray)) else chunks):
                f.write(chunk)
        os.replace(tmp, path)
    except BaseException as e:
        if os.path.exists(tmp):
            os.remove(tmp)
        if isinstance(e, OSError) and e.filename == tmp:
            e.filename = path           # the file the user named, not our temporary one
        raise


def field(number: int, message) -> bytes:
    """One length-delimited field holding ``message``: a message is the concatenation of its
    fields, so a huge one (a 0.9-billion-parameter caffemodel) can be written a part at a time."""
    return _field_bytes(number, message.SerializeToString())
