"""Caffe's DataTransformer: crop, mirror, mean subtraction and scale of one (C, H, W) image.

Per pixel, as Caffe: ``top = (x - mean) * scale`` where the mean file is
read at the crop's offset (it has the full image size) and mean_value is one
value or one per channel. With ``mirror`` a coin is drawn first (in either
phase, as Caffe does), then in TRAIN the crop's row and column offsets; in
TEST the crop is centred.
"""
from __future__ import annotations

import numpy as np

from .. import blobproto
from ..proto import sncaffe_pb2 as pb


def read_mean(path) -> np.ndarray:
    """A mean BlobProto file (shape (1, C, H, W), as compute_image_mean writes) as (C, H, W) float32."""
    blob = blobproto.read_binary(path, pb.BlobProto())
    try:
        mean = blobproto.to_array(blob, np.float32)
    except ValueError as e:
        raise ValueError(f"mean file {path}: {e}") from None
    if mean.ndim == 4 and mean.shape[0] == 1:
        mean = mean[0]
    if mean.ndim != 3:
        raise ValueError(f"mean file {path} has shape {mean.shape}; expected (1, C, H, W)")
    return mean


class DataTransformer:
    def __init__(self, param: "pb.TransformationParameter", phase=pb.TRAIN):
        self.param, self.phase = param, phase
        self.scale = param.scale
        self.crop = param.crop_size
        self.mirror = param.mirror      # Caffe mirrors in TEST too when asked: only the crop depends on the phase
        if param.mean_file and len(param.mean_value):
            raise ValueError("transform_param: give mean_file or mean_value, not both")
        if param.force_color and param.force_gray:
            raise ValueError("transform_param: force_color and force_gray cannot both be set")
        self.mean = read_mean(param.mean_file) if param.mean_file else None
        self.mean_values = np.asarray(param.mean_value, np.float32) if len(param.mean_value) else None
        # How encoded images are decoded: None keeps their own channels.
        self.color = True if param.force_color else False if param.force_gray else None

    def infer_shape(self, shape, what="the data") -> tuple:
        """The top shape (C, H', W') for images of ``shape`` (C, H, W); checks the settings fit them."""
        c, h, w = shape
        if self.mean is not None and self.mean.shape != tuple(shape):
            raise ValueError(f"mean file {self.param.mean_file} has shape (1, {', '.join(map(str, self.mean.shape))}), "
                             f"{what} has (1, {c}, {h}, {w})")
        if self.mean_values is not None and len(self.mean_values) not in (1, c):
            raise ValueError(f"transform_param: give 1 mean_value or {c} (one per channel), "
                             f"got {len(self.mean_values)}")
        if self.crop and (self.crop > h or self.crop > w):
            raise ValueError(f"crop_size {self.crop} is larger than {what} ({h}x{w})")
        return (c, self.crop, self.crop) if self.crop else (c, h, w)

    def __call__(self, x: np.ndarray, out: np.ndarray, rng) -> None:
        """Transform one image ``x`` (C, H, W) into ``out`` (C, H', W') of the top's dtype."""
        _, h, w = x.shape
        mirror = self.mirror and rng.integers(2) == 1
        mean = self.mean
        if self.crop:
            if self.phase == pb.TRAIN:
                h_off, w_off = rng.integers(h - self.crop + 1), rng.integers(w - self.crop + 1)
            else:
                h_off, w_off = (h - self.crop) // 2, (w - self.crop) // 2
            rows, cols = slice(h_off, h_off + self.crop), slice(w_off, w_off + self.crop)
            x = x[:, rows, cols]
            mean = None if mean is None else mean[:, rows, cols]
        if mirror:
            x = x[:, :, ::-1]
            mean = None if mean is None else mean[:, :, ::-1]
        if mean is not None:
            np.subtract(x, mean, out=out)
        elif self.mean_values is not None:
            np.subtract(x, self.mean_values.reshape(-1, 1, 1), out=out)
        else:
            out[...] = x
        if self.scale != 1:
            out *= out.dtype.type(self.scale)
