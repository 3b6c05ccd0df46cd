"""WindowData: R-CNN style windows cut out of images and warped to a square (Caffe's window_data_layer).

The window file (``window_data_param.source``) is read as Caffe reads it,
whitespace-separated tokens, repeated per image::

    # image_index
    image_path            (root_folder is prepended)
    channels height width
    num_windows
    class_index overlap x1 y1 x2 y2      (num_windows lines; corners inclusive, 0-based)

A window with overlap >= fg_threshold is foreground (its class_index must be
> 0); one with overlap < bg_threshold is background (label and overlap forced
to 0); the rest are never used. Every batch draws ``batch_size - num_fg``
background windows, then ``num_fg = int(batch_size * fg_fraction)``
foreground ones, each uniformly at random from its set.

A window is cut out of its image (read in colour, BGR, as cv::imread) and
warped to ``transform_param.crop_size`` squared by bilinear interpolation
with OpenCV's INTER_LINEAR geometry. With ``context_pad`` or ``crop_mode:
"square"`` the box is first grown (to a square, and by crop_size /
(crop_size - 2 context_pad)) around its centre; what falls outside the image
stays 0 in the top. Then, as Caffe: mirror (a coin per window, with
``transform_param.mirror``), ``(pixel - mean) * window_data_param.scale``
with ``transform_param.mean_file`` (read at offset (mean width - crop_size) / 2
plus the padding) or ``mean_value``. The label top holds the class.

Caffe's random stream (boost's mt19937) is not reproduced; draws come from
the layer's seeded ``rng``, so a run repeats itself.
"""
from __future__ import annotations

import math
import warnings
from pathlib import Path

import numpy as np

from ..data import image
from ..data.transform import read_mean
from .base import register
from .dataset import _Prefetching

# Fields of window_data_param that Caffe ignores in `layer` nets: transform_param has them.
LEGACY = ("mean_file", "crop_size", "mirror")
IMAGE_INDEX, LABEL, OVERLAP, X1, Y1, X2, Y2 = range(7)


def c_round(v) -> int:
    """C's round(): halves away from zero (Python's round() takes halves to even)."""
    return int(math.copysign(math.floor(abs(float(v)) + 0.5), v))


def resize_linear(src: np.ndarray, height: int, width: int) -> np.ndarray:
    """(C, h, w) uint8 -> (C, height, width) uint8 as cv::resize INTER_LINEAR: sample at
    (dst + 0.5) * src/dst - 0.5, clamped to the border pixels; rounded to the nearest level
    (OpenCV's 11-bit fixed-point weights may land one level away)."""
    def taps(n_src, n_dst):
        f = (np.arange(n_dst) + 0.5) * (n_src / n_dst) - 0.5
        i = np.floor(f).astype(np.int64)
        frac = f - i
        frac[i < 0], i[i < 0] = 0, 0
        last = i >= n_src - 1
        frac[last], i[last] = 0, n_src - 1
        return i, np.minimum(i + 1, n_src - 1), frac
    y0, y1, fy = taps(src.shape[1], height)
    x0, x1, fx = taps(src.shape[2], width)
    s = src.astype(np.float64)
    rows = s[:, y0] * (1 - fy)[:, None] + s[:, y1] * fy[:, None]
    out = rows[:, :, x0] * (1 - fx) + rows[:, :, x1] * fx
    return np.clip(np.floor(out + 0.5), 0, 255).astype(np.uint8)


@register
class WindowData(_Prefetching):
    type = "WindowData"
    exact_tops = 2

    def _setup(self):
        p, t = self.param.window_data_param, self.param.transform_param
        for f in LEGACY:
            if p.HasField(f):
                raise self.error(f"window_data_param.{f} is Caffe's legacy field, which Caffe ignores here; "
                                 f"set transform_param.{f} instead")
        if t.HasField("scale"):
            warnings.warn(f'layer "{self.name}": WindowData scales by window_data_param.scale; '
                          "Caffe ignores transform_param.scale here", stacklevel=2)
        batch = self._batch_size(p.batch_size)
        self.crop = t.crop_size
        if self.crop <= 0:
            raise self.error("transform_param.crop_size must be set (> 0): the size windows are warped to")
        if p.crop_mode not in ("warp", "square"):
            raise self.error(f'window_data_param.crop_mode must be "warp" or "square", got "{p.crop_mode}"')
        if 2 * p.context_pad >= self.crop:
            raise self.error(f"context_pad {p.context_pad} leaves nothing of crop_size {self.crop}")
        if t.mean_file and len(t.mean_value):
            raise self.error("transform_param: give mean_file or mean_value, not both")
        self.square, self.pad, self.scale = p.crop_mode == "square", p.context_pad, np.float32(p.scale)
        self.mirror = t.mirror
        self.images, self.fg, self.bg = self._read_windows(p)
        self.mean = self.mean_values = None
        if t.mean_file:
            self.mean = read_mean(t.mean_file)
            c, mh, mw = self.mean.shape
            off = (mw - self.crop) // 2
            if c != 3 or mw < self.crop or mh < off + self.crop:
                raise self.error(f"mean file {t.mean_file} has shape (1, {c}, {mh}, {mw}); WindowData needs "
                                 f"3 channels and at least {self.crop}x{self.crop} (crop_size), read at its centre")
            self.mean_off = off
        elif len(t.mean_value):
            if len(t.mean_value) not in (1, 3):
                raise self.error(f"transform_param: give 1 mean_value or 3 (one per channel), got {len(t.mean_value)}")
            self.mean_values = np.broadcast_to(np.asarray(t.mean_value, np.float32), (3,)).reshape(3, 1, 1)
        self._cache = {} if p.cache_images else None
        return [(batch, 3, self.crop, self.crop), (batch,)]

    # -- the window file ----------------------------------------------------------------
    def _read_windows(self, p):
        try:
            text = Path(p.source).read_text()
        except OSError as e:
            raise self.error(f"cannot read the window file {p.source}: {e.strerror}") from None
        tokens = [(n, tok) for n, line in enumerate(text.splitlines(), 1) for tok in line.split()]
        pos = 0

        def take(kind, what):
            nonlocal pos
            if pos == len(tokens):
                raise self.error(f"window file {p.source}: ends where {what} should be")
            n, tok = tokens[pos]
            pos += 1
            try:
                return kind(tok)
            except ValueError:
                raise self.error(f"window file {p.source} line {n}: expected {what}, got {tok!r}") from None

        if not tokens:
            raise self.error(f"window file {p.source} is empty")
        images, fg, bg = [], [], []
        while pos < len(tokens):
            n, tok = tokens[pos]
            if take(str, '"#"') != "#":
                raise self.error(f'window file {p.source} line {n}: expected "# image_index", got {tok!r}')
            index = take(int, "the image index")
            if index != len(images):
                raise self.error(f"window file {p.source} line {n}: image index {index}, expected {len(images)} "
                                 "(Caffe finds a window's image by this index, so images must be numbered 0, 1, ...)")
            path = p.root_folder + take(str, "the image path")
            channels = take(int, "channels")
            take(int, "height")
            take(int, "width")
            if channels != 3:
                raise self.error(f"window file {p.source} line {n}: image {path} has {channels} channels; WindowData "
                                 "reads every image in colour (3 channels), as Caffe's cv::imread does")
            images.append((n, path))
            for _ in range(take(int, "the number of windows")):
                line = tokens[pos][0] if pos < len(tokens) else n
                w = [index, take(int, "class_index"), take(np.float32, "overlap"), take(int, "x1"), take(int, "y1"),
                     take(int, "x2"), take(int, "y2")]
                if w[X2] < w[X1] or w[Y2] < w[Y1] or min(w[X1], w[Y1]) < 0:
                    raise self.error(f"window file {p.source} line {line}: window ({w[X1]}, {w[Y1]}, {w[X2]}, {w[Y2]}) "
                                     "needs 0 <= x1 <= x2 and 0 <= y1 <= y2")
                if w[OVERLAP] >= p.fg_threshold:
                    if w[LABEL] <= 0:
                        raise self.error(f"window file {p.source} line {line}: a foreground window (overlap "
                                         f"{w[OVERLAP]} >= fg_threshold {p.fg_threshold}) needs class_index > 0")
                    fg.append(w)
                elif w[OVERLAP] < p.bg_threshold:
                    w[LABEL] = w[OVERLAP] = 0
                    bg.append(w)
        for what, windows, rule in (("foreground", fg, f"overlap >= fg_threshold {p.fg_threshold}"),
                                    ("background", bg, f"overlap < bg_threshold {p.bg_threshold}")):
            if not windows:
                raise self.error(f"window file {p.source} has no {what} window ({rule}); Caffe needs both kinds")
        return images, np.array(fg), np.array(bg)

    def _image(self, index):
        if self._cache is not None and index in self._cache:
            return self._cache[index]
        n, path = self.images[index]
        with self._named(f"{self.param.window_data_param.source} line {n}: "):
            img = image.load(path)
        if self._cache is not None:
            self._cache[index] = img
        return img

    # -- resume: every window is drawn from the layer's random stream -----------------
    def cursor(self):
        return {"rng": self.rng.bit_generator.state}

    def set_cursor(self, state):
        self.rng.bit_generator.state = state["rng"]

    # -- batches ------------------------------------------------------------------------
    def load_batch(self, batch):
        data, labels = batch
        data[...] = 0                                   # what the warp leaves uncovered stays 0
        total = len(data) * self.shard[1]
        num_fg = int(np.float32(total) * np.float32(self.param.window_data_param.fg_fraction))
        for g, i in enumerate(self._records(len(data))):
            windows = self.fg if g >= total - num_fg else self.bg       # background first, as Caffe
            w = windows[self.rng.integers(len(windows))]
            mirror = bool(self.mirror and self.rng.integers(2))
            if i is not None:
                self.warp(w, mirror, data[i])
                labels[i] = w[LABEL]

    def warp(self, w, mirror, out):
        """Cut window ``w`` out of its image and warp it into ``out`` (3, crop, crop), as Caffe."""
        img = self._image(int(w[IMAGE_INDEX]))
        _, rows, cols = img.shape
        x1, y1, x2, y2 = (int(w[k]) for k in (X1, Y1, X2, Y2))
        crop, f32 = self.crop, np.float32
        out_h = out_w = crop
        pad_h = pad_w = 0
        if self.pad > 0 or self.square:
            # grow the box so that, warped to crop_size, context_pad pixels of context surround it
            context_scale = f32(crop) / f32(crop - 2 * self.pad)
            half_h, half_w = f32((y2 - y1 + 1) / 2.0), f32((x2 - x1 + 1) / 2.0)
            cx, cy = f32(x1) + half_w, f32(y1) + half_h
            if self.square:
                half_h = half_w = max(half_h, half_w)
            x1, x2 = c_round(cx - half_w * context_scale), c_round(cx + half_w * context_scale)
            y1, y2 = c_round(cy - half_h * context_scale), c_round(cy + half_h * context_scale)
            unclipped_h, unclipped_w = y2 - y1 + 1, x2 - x1 + 1
            pad_x1, pad_y1 = max(0, -x1), max(0, -y1)
            pad_x2, pad_y2 = max(0, x2 - cols + 1), max(0, y2 - rows + 1)
            x1, x2, y1, y2 = x1 + pad_x1, x2 - pad_x2, y1 + pad_y1, y2 - pad_y2
            scale_x, scale_y = f32(crop) / f32(unclipped_w), f32(crop) / f32(unclipped_h)
            out_w = c_round(f32(x2 - x1 + 1) * scale_x)
            out_h = c_round(f32(y2 - y1 + 1) * scale_y)
            pad_x1, pad_x2 = c_round(f32(pad_x1) * scale_x), c_round(f32(pad_x2) * scale_x)
            pad_h = c_round(f32(pad_y1) * scale_y)
            pad_w = pad_x2 if mirror else pad_x1        # the padding is mirrored too
            out_h, out_w = min(out_h, crop - pad_h), min(out_w, crop - pad_w)   # rounding may overshoot
        elif x2 >= cols or y2 >= rows:
            raise self.error(f"window ({x1}, {y1}, {x2}, {y2}) lies outside its image "
                             f"{self.images[int(w[IMAGE_INDEX])][1]} ({cols}x{rows})")
        if out_h <= 0 or out_w <= 0:
            return
        warped = resize_linear(img[:, y1:y2 + 1, x1:x2 + 1], out_h, out_w)
        if mirror:
            warped = warped[:, :, ::-1]
        region = out[:, pad_h:pad_h + out_h, pad_w:pad_w + out_w]
        if self.mean is not None:
            r, c = self.mean_off + pad_h, self.mean_off + pad_w
            np.subtract(warped, self.mean[:, r:r + out_h, c:c + out_w], out=region)
        elif self.mean_values is not None:
            np.subtract(warped, self.mean_values, out=region)
        else:
            region[...] = warped
        region *= self.scale
