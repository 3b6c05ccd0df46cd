"""SSD's AnnotatedData: images and their boxes from an LMDB (or LevelDB) of ``AnnotatedDatum``.

Tops: the images (N, C, H, W), transformed as Data's are, and the boxes (1, 1, G, 8), one row
per box of the batch: [item, label, instance_id, xmin, ymin, xmax, ymax, difficult], a single
row of -1 when the batch has none. Records without an annotation type (and no anno_type) give
one label per image instead, as Data does.

SSD's augmentations run in the fork's order (sncaffe.data.ssd_augment): distort_param, expand_param,
a crop from annotated_data_param.batch_sampler, then resize_param (WARP, the interp_mode drawn per
image), mirror (which flips the boxes) and the mean and scale; emit_constraint decides which boxes
a crop keeps. noise_param (with prob > 0) and fixed crops (crop_size, crop_h, crop_w) are refused
by name.

G changes from batch to batch (``data_dependent``, see sncaffe.dynamic): memory is planned for
batch_size times the most boxes a record of the database holds, counted once at setup. Batches
are made on a reader thread, ``prefetch`` ahead, as Data's; the net takes the next one when it
asks for the tops' shapes.
"""
from __future__ import annotations

import numpy as np

from ..data import annotated, image, ssd_augment
from ..data import datum as datums
from ..data.transform import DataTransformer
from ..proto import sncaffe_pb2 as pb
from .base import Blob, count, register
from .dataset import Data, _copy_to_top

CV_INTERP = {1: "INTER_LINEAR", 2: "INTER_AREA", 3: "INTER_NEAREST", 4: "INTER_CUBIC", 5: "INTER_LANCZOS4"}
ORDER = {1: 1, 3: 0, 4: 3}      # interp_mode -> image.resize's order where OpenCV is absent


def _resize(x, height, width, mode):
    """(C, H, W) -> (C, height, width) with OpenCV's interpolation ``mode`` (ResizeParameter)."""
    hwc = np.ascontiguousarray(x.transpose(1, 2, 0))
    cv2 = image._cv2()
    if cv2 is not None:
        interp = getattr(cv2, CV_INTERP[mode])
        chans = [cv2.resize(np.ascontiguousarray(hwc[:, :, k:k + 4]), (width, height), interpolation=interp)
                 .reshape(height, width, -1) for k in range(0, hwc.shape[2], 4)]
        return np.concatenate(chans, axis=2).transpose(2, 0, 1)
    if mode not in ORDER:
        name = pb.ResizeParameter.Interp_mode.Name(mode)
        raise ValueError(f"resize_param interp_mode {name} needs OpenCV (pip install opencv-python-headless)")
    return image.resize(hwc, (height, width), ORDER[mode]).transpose(2, 0, 1)


@register
class AnnotatedData(Data):
    type = "AnnotatedData"
    data_dependent = True

    def _setup(self):
        p, tp, ap = self.param.data_param, self.param.transform_param, self.param.annotated_data_param
        refused = [(tp.noise_param.prob > 0, "transform_param.noise_param (prob > 0)"),
                   (tp.crop_size or tp.crop_h or tp.crop_w, "transform_param crop_size/crop_h/crop_w")]
        for bad, what in refused:
            if bad:
                raise self.error(f"{what} is not supported")
        self.resize = tp.resize_param if tp.HasField("resize_param") else None
        if self.resize is not None:
            r = self.resize
            if r.resize_mode != pb.ResizeParameter.WARP or r.prob != 1:
                raise self.error("transform_param.resize_param: only resize_mode WARP with prob 1 is supported")
            if r.height <= 0 or r.width <= 0:
                raise self.error("transform_param.resize_param needs height and width")
        with self._named("annotated_data_param: "):
            for sampler in ap.batch_sampler:
                ssd_augment.check_sampler(sampler)
        if tp.HasField("distort_param"):
            with self._named():
                ssd_augment.check_distort(tp.distort_param)
        self.samplers = list(ap.batch_sampler)
        self.distort = tp.distort_param if tp.HasField("distort_param") else None
        self.expand = tp.expand_param if tp.HasField("expand_param") else None
        plain = pb.TransformationParameter()
        plain.CopyFrom(tp)
        plain.mirror = False                            # drawn here: the boxes flip with the image
        for f in ("resize_param", "emit_constraint", "distort_param", "expand_param"):
            plain.ClearField(f)
        shapes = super()._setup()                       # opens the database, reads the first record
        self.transformer = DataTransformer(plain, self.phase)
        self.mirror, self.emit = tp.mirror, (tp.emit_constraint if tp.HasField("emit_constraint") else None)
        first = self._record(*self.db.first())
        self.anno_type = ap.anno_type if ap.HasField("anno_type") else first.type if first.HasField("type") else None
        if self.resize is not None:
            self.datum_shape = (self.datum_shape[0], self.resize.height, self.resize.width)
        shape = self.transformer.infer_shape(self.datum_shape, f"the data in {p.source}")
        batch = shapes[0][0]
        self._pending = None
        if self.anno_type is None:
            return [(batch, *shape), (batch, 1, 1, 1)][:len(self.param.top)]     # the fork's label shape
        self.most = self._most_boxes()
        return [(batch, *shape), (1, 1, max(batch * self.most, 1), 8)][:len(self.param.top)]

    def _record(self, key, value):
        return annotated.parse(value, f"{self.kind} {self.source} key {key.decode(errors='replace')}")

    def _decode(self, key, value):
        what = f"{self.kind} {self.source} key {key.decode(errors='replace')}"
        d = self._record(key, value).datum
        return datums.to_array(d, self.transformer.color, what), d.label

    def _most_boxes(self) -> int:
        """The most boxes one record holds: a pass over the database with a reader of its own."""
        from ..data.leveldb import reader
        db = reader(self.source, self.param.data_param.backend)
        try:
            first_key, most = None, 0
            for key, value in db:
                if key == first_key:
                    break
                first_key = first_key or key
                most = max(most, annotated.count(self._record(key, value)))
            return most
        finally:
            db.close()

    def _transform(self, key, value, out):
        """Transform one record into ``out``: its label, or its box rows (n, 7) as the image now shows them."""
        record = self._record(key, value)
        what = f"{self.kind} {self.source} key {key.decode(errors='replace')}"
        x = datums.to_array(record.datum, self.transformer.color, what)
        rows = annotated.boxes(record)
        rng, emit = self.rng, self.emit
        if self.distort is not None:
            x = ssd_augment.distort(x, self.distort, rng)
        if self.expand is not None:
            fill = self.transformer.mean_values if self.transformer.mean_values is not None else [0]
            x, rows = ssd_augment.expand(x, rows, self.expand, fill, rng, emit)
        if self.samplers:
            x, rows = ssd_augment.sample_crop(x, rows, self.samplers, rng, emit)
        modes = list(self.resize.interp_mode) if self.resize is not None else []
        mode = modes[int(rng.integers(len(modes)))] if len(modes) > 1 else (modes[0] if modes else 1)
        if self.resize is not None:
            x = _resize(x, self.resize.height, self.resize.width, mode)
        if x.shape != self.datum_shape:
            raise self.error(f"{what}: an image of shape {x.shape}, the first {self.datum_shape}; "
                             "set transform_param.resize_param to resize them all")
        mirror = bool(self.mirror and rng.integers(2) == 1)
        if mirror:
            x = x[:, :, ::-1]
        self.transformer(x, out, rng)
        if self.anno_type is None:
            return record.datum.label
        rows = ssd_augment.project(rows, ssd_augment.UNIT, emit)
        if mirror:
            rows[:, [2, 4]] = 1 - rows[:, [4, 2]]
        return rows

    def load_batch(self, batch):
        """Fill one batch: the images, then (boxes) the rows and their count, or (labels) the labels."""
        with self._named():
            self._skip_at_start()
            data, found = batch[0], []
            for i in self._records(len(data)):
                key, value = self._next()
                if i is None:                       # another rank's: the same random draws
                    self._transform(key, value, np.empty_like(data[0]))
                    continue
                got = self._transform(key, value, data[i])
                if self.anno_type is None:
                    if len(batch) > 1:
                        batch[1][i] = got
                else:
                    found.append(np.column_stack([np.full(len(got), i), got]))
            if self.anno_type is not None and len(batch) > 1:
                rows = np.concatenate(found) if found else np.zeros((0, 8))
                if not len(rows):
                    rows = np.full((1, 8), -1.0)
                batch[1][:len(rows)] = rows
                batch[2][0] = len(rows)

    def setup(self, bottom_shapes):
        self._shapes = super().setup(bottom_shapes)
        return self._shapes

    def _buffers(self):
        """One batch's host arrays: images, then labels, or box rows (as many as planned) and their count."""
        out = [np.empty(self._shapes[0], np.float32)]
        if len(self._shapes) > 1 and self.anno_type is None:
            out.append(np.empty(self._shapes[1], np.float32))
        elif len(self._shapes) > 1:
            out += [np.empty((count(self._shapes[1]) // 8, 8), np.float32), np.zeros(1, np.int64)]
        return out

    def _take(self):
        """The next batch from the reader thread, copied out: (images, labels or box rows)."""
        if self._closed:
            raise self.error("the layer is closed")
        if self._prefetcher is None:            # started here: the net seeds self.rng after setup
            self._start([self._buffers() for _ in range(self.depth)])
        with self._prefetcher.batch() as batch:
            self._consumed = self._after.pop(id(batch), self._consumed)
            if len(batch) == 3:
                return [batch[0].copy(), batch[1][:int(batch[2][0])].copy()]
            return [b.copy() for b in batch]

    def top_shapes(self, bottom):
        """The next batch, taken now: the boxes top has as many rows as it has boxes."""
        self._pending = self._take()
        if len(self._pending) > 1 and self.anno_type is not None:
            return [self._pending[0].shape, (1, 1, len(self._pending[1]), 8)]
        return [tuple(s) for s in self._shapes]

    def forward(self, bottom, top):
        batch, self._pending = self._pending or self._take(), None
        _copy_to_top(top[:1], batch[:1])
        if len(top) > 1 and self.anno_type is None:
            _copy_to_top(top[1:], batch[1:])
        elif len(top) > 1:
            rows, out = batch[1], top[1].data.reshape(-1, 8)
            if len(rows) > len(out):
                raise self.error(f"{len(rows)} boxes in a batch, the top holds {len(out)}")
            out[len(rows):] = -1                        # rows of the planned block left over: no box
            _copy_to_top([Blob(top[1].name, out[:len(rows)])], [rows])
