"""SegNet's DenseImageData: a list of "image label_image" lines, read as ImageData reads its list.

Tops: the images, transformed (mean, scale) as ImageData's, and the label images (N, 1, H, W),
read as grey levels and never transformed; a resize takes the nearest label, as the fork. The
fork's own mirror and crop (crop_height x crop_width, at a random offset) move image and label
together; transform_param's mirror and crop_size would move them apart, so the fork refuses
them and so does this layer.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from ..data import image
from ..data.transform import DataTransformer
from .base import register
from .dataset import ImageData


@register
class DenseImageData(ImageData):
    type = "DenseImageData"
    exact_tops = 2

    def _setup(self):
        p = self.param.dense_image_data_param
        self.p = p
        batch = self._batch_size(p.batch_size)
        if (p.new_height > 0) != (p.new_width > 0):
            raise self.error("new_height and new_width must be set together")
        if (p.crop_height > 0) != (p.crop_width > 0):
            raise self.error("crop_height and crop_width must be set together")
        t = self.param.transform_param
        if t.mirror or t.crop_size:
            raise self.error("transform_param's mirror and crop_size would move image and label apart; "
                             "use dense_image_data_param's mirror, crop_height and crop_width")
        self.lines = self._read_list(p.source)
        self.transformer = DataTransformer(t, self.phase)
        x, lab = self._pair(0)
        if lab.shape[1:] != x.shape[1:]:
            raise self.error(f"{p.source} line {self.lines[0][0]}: the label image {lab.shape[1:]} and the "
                             f"image {x.shape[1:]} differ in size")
        self.image_shape = x.shape
        c, h, w = x.shape
        if p.crop_height:
            if p.crop_height > h or p.crop_width > w:
                raise self.error(f"crop {p.crop_height}x{p.crop_width} is larger than the images ({h}x{w})")
            h, w = p.crop_height, p.crop_width
        shape = self.transformer.infer_shape((c, h, w), f"image {self.lines[0][1]}")
        self._order = None
        return [(batch, *shape), (batch, 1, h, w)]

    def _read_list(self, source):
        try:
            text = Path(source).read_text()
        except OSError as e:
            raise self.error(f"cannot read the image list {source}: {e.strerror}") from None
        lines = []
        for n, line in enumerate(text.splitlines(), 1):
            words = line.split()
            if not words:
                continue
            if len(words) != 2:
                raise self.error(f'{source} line {n}: expected "image label_image", got {line!r}')
            lines.append((n, *words))
        if not lines:
            raise self.error(f"the image list {source} is empty")
        return lines

    def _pair(self, i):
        """Image (C, H, W) and label (1, H, W) of line i."""
        p = self.p
        n, path, label = self.lines[i]
        with self._named(f"{p.source} line {n}: "):
            x = image.load(p.root_folder + path, p.new_height, p.new_width, p.is_color)
            lab = image.load(p.root_folder + label, 0, 0, False)
            if p.new_height > 0:
                lab = image.resize(lab.transpose(1, 2, 0), (p.new_height, p.new_width), order=0)
                lab = lab.reshape(p.new_height, p.new_width, 1).transpose(2, 0, 1)
        return x, lab

    def load_batch(self, batch):
        p = self.p
        with self._named():
            if self._order is None:                 # on the reader thread: shuffle, skip
                self._first_order(p)
            data, labels = batch
            for i in self._records(len(data)):
                k = self._order[self._pos]
                x, lab = self._pair(k)
                if x.shape != self.image_shape or lab.shape[1:] != x.shape[1:]:
                    raise self.error(f"{p.source} line {self.lines[k][0]}: image {x.shape} and label "
                                     f"{lab.shape} must match the first image {self.image_shape}")
                if p.mirror and self.rng.integers(2) == 1:
                    x, lab = x[:, :, ::-1], lab[:, :, ::-1]
                if p.crop_height:
                    h0 = int(self.rng.integers(x.shape[1] - p.crop_height + 1))
                    w0 = int(self.rng.integers(x.shape[2] - p.crop_width + 1))
                    rows, cols = slice(h0, h0 + p.crop_height), slice(w0, w0 + p.crop_width)
                    x, lab = x[:, rows, cols], lab[:, rows, cols]
                if i is not None:
                    self.transformer(np.ascontiguousarray(x), data[i], self.rng)
                    labels[i] = lab
                self._pos += 1
                if self._pos == len(self.lines):
                    self._pos = 0
                    if p.shuffle:
                        self._order = self._shuffled(self._order)
