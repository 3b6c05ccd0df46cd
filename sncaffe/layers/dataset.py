"""Layers that read datasets: Data (LMDB or LevelDB of Datum), ImageData (an image list), HDF5Data, MemoryData.

Data, ImageData and HDF5Data make their batches on a background thread
(``sncaffe.data.prefetch``) into host buffers, ``prefetch`` batches ahead, so
the next batch is ready when forward asks for it; forward copies it into the
tops. Their shapes are fixed at setup from the first record, as Caffe reads
one record in DataLayerSetUp, and a record of another shape is an error.
Random crops, mirrors and shuffles draw from ``self.rng`` (seeded by the net),
on the reader thread only, so a run is repeatable.

Data parallel training sets ``shard = (rank, ranks)``: of every ``ranks``
batches' worth of records the layer keeps the ``rank``-th batch, so N ranks
at batch B read exactly the records (and draw exactly the random crops and
mirrors) one process reads at batch N*B.
"""
from __future__ import annotations

import weakref
import warnings
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from ..backend.upload import upload
from ..data import datum as datums
from ..data import image
from ..data.prefetch import Prefetcher
from ..data.transform import DataTransformer
from ..proto import sncaffe_pb2 as pb
from .base import DataReadError, LayerError, array_module, register
from .data import _Source

LEGACY_TRANSFORM = ("scale", "mean_file", "crop_size", "mirror", "force_encoded_color")


def _copy_to_top(top, host_arrays):
    for blob, a in zip(top, host_arrays):
        if array_module(blob.data) is np:
            blob.data[...] = a
        else:                                   # CuPy: one pinned, asynchronous copy into the block
            upload(blob.data, a)


def _permutation(values, n, error) -> np.ndarray:
    """A resume state's order, checked to be a permutation of range(n)."""
    a = np.asarray(values, np.int64)
    if a.shape != (n,) or not np.array_equal(np.sort(a), np.arange(n)):
        raise error(f"the snapshot's order is not a permutation of {n} items")
    return a


class _Prefetching(_Source):
    """Runs ``load_batch(batch)`` on a reader thread; ``batch`` is one host array per top."""
    depth = 4
    shard = (0, 1)          # (rank, ranks) of a data-parallel job

    def _records(self, batch_size):
        """For each record of the next global batch: its row in this rank's batch, or None."""
        rank, ranks = self.shard
        for g in range(batch_size * ranks):
            i = g - rank * batch_size
            yield i if 0 <= i < batch_size else None

    def _skip_transform(self, shape, out_shape):
        """Transform a blank record of another rank: the same random draws as its real one."""
        if getattr(self, "_blank", None) is None:
            self._blank = (np.zeros(shape, np.float32), np.empty(out_shape, np.float32))
        self.transformer(*self._blank, self.rng)

    def __init__(self, param, phase):
        super().__init__(param, phase)
        self._prefetcher = None
        self._closed = False
        self._consumed = None       # cursor() after the last batch forward took (the reader runs ahead)
        self._after = {}            # id(buffer) -> cursor() after the reader filled it

    # -- resume: where the reader stands, as forward has consumed it --------
    def cursor(self) -> dict | None:
        """The read position and random stream now (on the reader thread once it runs); None: a
        reader that cannot say, which a resume starts over (as Caffe's do)."""
        return None

    def set_cursor(self, state: dict) -> None:
        pass

    def resume_state(self) -> dict:
        """The position after the batches forward has taken: a resumed run reads on from here."""
        return self.cursor() if self._prefetcher is None else self._consumed

    def restore_state(self, state: dict) -> None:
        if self._prefetcher is not None:        # batches read ahead from the old position are dropped
            self._finalizer.detach()
            self._prefetcher.close()
            self._prefetcher = None
        self.set_cursor(state)

    @contextmanager
    def _named(self, where=""):
        """Report a bad file or record as this layer's error."""
        try:
            yield
        except LayerError:
            raise
        except (OSError, ValueError, ImportError) as e:      # ImportError: an optional reader (plyvel)
            raise self.error(f"{where}{e}") from None

    def _batch_size(self, n):
        if n <= 0:
            raise self.error("batch_size must be positive")
        return int(n)

    def _legacy(self, p, field):
        # Caffe ignores these in `layer` nets (only V1 nets are upgraded); sncaffe says so.
        for f in LEGACY_TRANSFORM:
            if f in p.DESCRIPTOR.fields_by_name and p.HasField(f):
                name = "force_color" if f == "force_encoded_color" else f
                raise self.error(f"{field}.{f} is Caffe's legacy field, which Caffe ignores here; "
                                 f"set transform_param.{name} instead")

    def setup(self, bottom_shapes):
        with self._named():
            return self._setup()

    def load_batch(self, batch):
        raise NotImplementedError

    def forward(self, bottom, top):
        if self._closed:
            raise self.error("the layer is closed")
        if self._prefetcher is None:            # started here: the net seeds self.rng after setup
            self._start([[np.empty(t.shape, t.data.dtype) for t in top] for _ in range(self.depth)])
        try:
            with self._prefetcher.batch() as batch:
                _copy_to_top(top, batch)
                self._consumed = self._after.pop(id(batch), self._consumed)
        except LayerError as e:
            raise DataReadError(str(e)) from None

    def _start(self, buffers):
        """Start the reader thread filling ``buffers`` (one list of host arrays per batch)."""
        ref = weakref.ref(self)                 # the thread must not keep the layer alive

        def fill(batch):
            layer = ref()
            layer.load_batch(batch)
            layer._after[id(batch)] = layer.cursor()
        self._consumed = self.cursor()
        self._after = {}
        self._prefetcher = Prefetcher(fill, buffers, name=f"{self.type} {self.name}")
        # Collected without close(): only signal the thread (a collection must not wait or lock).
        self._finalizer = weakref.finalize(self, self._prefetcher.stop)

    def close(self):
        """Stop the reader thread and release the source."""
        self._closed = True
        if self._prefetcher is not None:
            self._finalizer.detach()
            self._prefetcher.close()
            if self._prefetcher.running:
                return                          # still inside a read: leave its source open
        self._release()

    def _release(self):
        pass


@register
class Data(_Prefetching):
    type = "Data"
    max_tops = 2

    def _setup(self):
        p = self.param.data_param
        self._legacy(p, "data_param")
        batch = self._batch_size(p.batch_size)
        self.depth = max(1, p.prefetch)
        self.source = p.source
        self.transformer = DataTransformer(self.param.transform_param, self.phase)
        from ..data.leveldb import reader     # lmdb/plyvel are needed only where one is read
        self.db = reader(p.source, p.backend)
        self.kind = "LevelDB" if p.backend == pb.DataParameter.LEVELDB else "LMDB"
        self.datum_shape = self._decode(*self.db.first())[0].shape
        shape = self.transformer.infer_shape(self.datum_shape, f"the data in {p.source}")
        self._started = False
        self._read = self._skip = 0             # records read; records to skip on a resume
        return [(batch, *shape), (batch,)][:len(self.param.top)]

    def _decode(self, key, value):
        what = f"{self.kind} {self.source} key {key.decode(errors='replace')}"
        d = datums.parse(value, what)
        return datums.to_array(d, self.transformer.color, what), d.label

    def cursor(self):
        # A reader with tell/seek resumes at a key; any other is wound forward by the records read.
        tell = getattr(self.db, "tell", None)
        key = tell() if callable(tell) else None
        return {"started": self._started, "key": None if key is None else key.hex(), "records": self._read,
                "rng": self.rng.bit_generator.state}

    def set_cursor(self, state):
        self._started = bool(state["started"])
        self.rng.bit_generator.state = state["rng"]
        self._read = int(state["records"])
        if state.get("key") is not None and callable(getattr(self.db, "seek", None)):
            self.db.seek(bytes.fromhex(state["key"]))
        else:
            entries = getattr(self.db, "entries", 0)
            self._skip = self._read % entries if entries else self._read

    def _next(self):
        while self._skip:
            self._skip -= 1
            next(self.db)
        self._read += 1
        return next(self.db)

    def _skip_at_start(self):
        """Caffe's rand_skip: the first batch starts at a random record."""
        if not self._started:
            self._started = True
            skip = self.param.data_param.rand_skip
            for _ in range(self.rng.integers(skip) if skip else 0):
                self._next()

    def load_batch(self, batch):
        with self._named():
            self._skip_at_start()
            data = batch[0]
            for i in self._records(len(data)):
                key, value = self._next()
                if i is None:
                    self._skip_transform(self.datum_shape, data.shape[1:])
                    continue
                x, label = self._decode(key, value)
                if x.shape != self.datum_shape:
                    raise self.error(f"{self.kind} {self.source}: the datum at key {key.decode(errors='replace')} "
                                     f"has shape {x.shape}, the first datum {self.datum_shape}; "
                                     "every datum must have the first one's shape")
                self.transformer(x, data[i], self.rng)
                if len(batch) > 1:
                    batch[1][i] = label

    def _release(self):
        self.db.close()


@register
class ImageData(_Prefetching):
    type = "ImageData"
    exact_tops = 2

    def _setup(self):
        p = self.param.image_data_param
        self._legacy(p, "image_data_param")
        batch = self._batch_size(p.batch_size)
        if (p.new_height > 0) != (p.new_width > 0):
            raise self.error("new_height and new_width must be set together")
        self.lines = self._read_list(p.source)
        self.transformer = DataTransformer(self.param.transform_param, self.phase)
        self.image_shape = self._load(0).shape
        shape = self.transformer.infer_shape(self.image_shape, f"image {self.lines[0][1]}")
        self._order = None
        return [(batch, *shape), (batch,)]

    def _read_list(self, source):
        """Caffe's list format: a path, a space, an integer label (split at the last space)."""
        try:
            text = Path(source).read_text()
        except OSError as e:
            raise self.error(f"cannot read the image list {source}: {e.strerror}") from None
        lines = []
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            path, _, label = line.rstrip().rpartition(" ")
            try:
                lines.append((n, path, int(label)))
            except ValueError:
                raise self.error(f'{source} line {n}: expected "path label", got {line!r}') from None
            if not path:
                raise self.error(f'{source} line {n}: expected "path label", got {line!r}')
        if not lines:
            raise self.error(f"the image list {source} is empty")
        return lines

    def _load(self, i):
        p = self.param.image_data_param
        n, path, _ = self.lines[i]
        with self._named(f"{p.source} line {n}: "):
            return image.load(p.root_folder + path, p.new_height, p.new_width, p.is_color)

    def cursor(self):
        return {"order": self._order,            # never changed in place: shuffles make a new array
                "pos": getattr(self, "_pos", 0), "rng": self.rng.bit_generator.state}

    def set_cursor(self, state):
        if state["order"] is not None and len(state["order"]) != len(self.lines):
            raise self.error(f"the snapshot read a list of {len(state['order'])} images, "
                             f"{self.param.image_data_param.source} has {len(self.lines)}")
        order = None if state["order"] is None else _permutation(state["order"], len(self.lines), self.error)
        pos = int(state["pos"])
        if not 0 <= pos < len(self.lines):
            raise self.error(f"the snapshot's position {pos} is not a line of the list")
        self._order, self._pos = order, pos
        self.rng.bit_generator.state = state["rng"]

    def _shuffled(self, order):
        order = order.copy()                    # a new array: cursors taken before keep theirs
        self.rng.shuffle(order)
        return order

    def _first_order(self, p):
        """The list's order (shuffled where ``p.shuffle``) and the first position (rand_skip)."""
        self._order = np.arange(len(self.lines))
        if p.shuffle:
            self._order = self._shuffled(self._order)
        self._pos = int(self.rng.integers(p.rand_skip)) if p.rand_skip else 0
        if self._pos >= len(self.lines):
            raise self.error(f"rand_skip {p.rand_skip}: not enough images to skip")

    def load_batch(self, batch):
        p = self.param.image_data_param
        with self._named():
            if self._order is None:                 # on the reader thread: shuffle, skip
                self._first_order(p)
            data, labels = batch
            for i in self._records(len(data)):
                k = self._order[self._pos]
                if i is None:
                    self._skip_transform(self.image_shape, data.shape[1:])
                else:
                    x = self._load(k)
                    n, path, label = self.lines[k]
                    if x.shape != self.image_shape:
                        raise self.error(f"{p.source} line {n}: image {p.root_folder + path} has shape "
                                         f"{x.shape}, the first image {self.image_shape}; set new_height and "
                                         "new_width to resize them all")
                    self.transformer(x, data[i], self.rng)
                    labels[i] = label
                self._pos += 1
                if self._pos == len(self.lines):
                    self._pos = 0
                    if p.shuffle:
                        self._order = self._shuffled(self._order)


@register
class HDF5Data(_Prefetching):
    """Rows of the datasets named after the tops, file after file, as Caffe's HDF5DataLayer.

    Caffe's order: the listed files in turn (a permutation, reshuffled every
    pass, with shuffle), rows of each file in order (a permutation shuffled
    when the file is loaded and again whenever its rows run out, with
    shuffle); after the last file, back to the first.
    """
    type = "HDF5Data"
    min_tops = 1

    def _setup(self):
        if self.param.HasField("transform_param"):
            raise self.error("HDF5Data does not transform data (Caffe refuses transform_param too)")
        p = self.param.hdf5_data_param
        batch = self._batch_size(p.batch_size)
        try:
            self.files = Path(p.source).read_text().split()
        except OSError as e:
            raise self.error(f"cannot read the HDF5 file list {p.source}: {e.strerror}") from None
        if not self.files:
            raise self.error(f"the HDF5 file list {p.source} names no file")
        self.row_shapes = None
        self.row_shapes = [a.shape[1:] for a in self._read(self.files[0])]
        self._files = self._current = self._order = self._row = self._arrays = None
        return [(batch, *s) for s in self.row_shapes]

    def _read(self, path):
        import h5py
        where = f"HDF5 file {path} (listed in {self.param.hdf5_data_param.source})"
        tops = list(self.param.top)
        try:
            with h5py.File(path, "r") as f:
                missing = [t for t in tops if t not in f]
                if missing:
                    raise self.error(f'{where} has no dataset "{missing[0]}" for top "{missing[0]}" '
                                     f"(it has: {', '.join(sorted(f.keys()))})")
                arrays = [f[t][...] for t in tops]
        except OSError as e:
            raise self.error(f"{where} cannot be read: {e}") from None
        rows = {a.shape[0] if a.ndim else 0 for a in arrays}
        if len(rows) != 1 or 0 in rows:
            raise self.error(f"{where}: every top needs the same positive number of rows; "
                             + ", ".join(f'"{t}" {a.shape}' for t, a in zip(tops, arrays)))
        for t, a, s in zip(tops, arrays, self.row_shapes or [a.shape[1:] for a in arrays]):
            if a.shape[1:] != s:
                raise self.error(f'{where}: dataset "{t}" has rows of shape {a.shape[1:]}, '
                                 f"the first file {s}")
        return arrays

    def cursor(self):
        # The arrays here are never changed in place (shuffles make new ones), so a cursor taken
        # on the reader thread stays what it was.
        return {"files": self._files, "current": self._current, "order": self._order, "row": self._row,
                "rng": self.rng.bit_generator.state}

    def set_cursor(self, state):
        self.rng.bit_generator.state = state["rng"]
        if state["files"] is None:
            self._files = None
            return
        if len(state["files"]) != len(self.files):
            raise self.error(f"the snapshot read a list of {len(state['files'])} HDF5 files, "
                             f"{self.param.hdf5_data_param.source} names {len(self.files)}")
        files = _permutation(state["files"], len(self.files), self.error)
        order = _permutation(state["order"], len(state["order"]), self.error)
        current, row = int(state["current"]), int(state["row"])
        if not (0 <= current < len(files) and 0 <= row <= len(order)):
            raise self.error(f"the snapshot's file {current} and row {row} are out of range")
        self._files, self._current, self._order, self._row = files, current, order, row
        self._arrays = None                     # read again at the next row

    def _shuffled(self, a):
        a = a.copy()
        self.rng.shuffle(a)
        return a

    def _load(self):
        """The current file's arrays, and its rows in order (a permutation, with shuffle)."""
        self._arrays = self._read(self.files[self._files[self._current]])
        self._order, self._row = np.arange(len(self._arrays[0])), 0
        if self.param.hdf5_data_param.shuffle:
            self._order = self._shuffled(self._order)

    def _next_row(self):
        """(arrays, row) in Caffe's order, forever; on the reader thread."""
        shuffle = self.param.hdf5_data_param.shuffle
        if self._files is None:
            self._files, self._current = np.arange(len(self.files)), 0
            if shuffle:
                self._files = self._shuffled(self._files)
            self._load()
        elif self._arrays is None:              # resumed: the file again, rows where they were
            self._arrays = self._read(self.files[self._files[self._current]])
            if len(self._arrays[0]) != len(self._order):
                raise self.error(f"HDF5 file {self.files[self._files[self._current]]} has "
                                 f"{len(self._arrays[0])} rows, {len(self._order)} when the snapshot was taken")
        if self._row == len(self._order):       # the file's rows ran out
            if len(self._files) > 1:
                self._current += 1
                if self._current == len(self._files):
                    self._current = 0
                    if shuffle:
                        self._files = self._shuffled(self._files)
                self._load()
            if shuffle:
                self._order = self._shuffled(self._order)
            self._row = 0
        row = self._order[self._row]
        self._row += 1
        return self._arrays, row

    def load_batch(self, batch):
        for i in self._records(len(batch[0])):
            arrays, r = self._next_row()
            if i is None:
                continue
            for out, a in zip(batch, arrays):
                out[i] = a[r]


@register
class MemoryData(_Source):
    """Batches from arrays a Python caller hands over with ``reset(data, labels)`` (Caffe's Reset).

    As in Caffe, the arrays are not copied and not transformed; batches are
    served in order and wrap around.
    """
    type = "MemoryData"
    exact_tops = 2
    shard = (0, 1)          # (rank, ranks) of a data-parallel job

    def setup(self, bottom_shapes):
        p = self.param.memory_data_param
        self.shape = (p.batch_size, p.channels, p.height, p.width)
        if not all(self.shape):
            raise self.error("batch_size, channels, height and width must be set and positive "
                             "in memory_data_param")
        self._data = None
        return [self.shape, (p.batch_size,)]

    def reset(self, data, labels):
        data, labels = np.asarray(data), np.asarray(labels)
        n = len(data) if data.ndim else 0
        if data.ndim != 4 or data.shape[1:] != self.shape[1:]:
            raise self.error(f"reset: data has shape {data.shape}, expected (N, {', '.join(map(str, self.shape[1:]))})")
        if labels.size != n or (labels.ndim and labels.shape[0] != n):
            raise self.error(f"reset: {n} images but labels of shape {labels.shape}")
        if n == 0 or n % self.shape[0]:
            raise self.error(f"reset: N = {n} must be a positive multiple of batch_size {self.shape[0]}")
        if self.param.HasField("transform_param"):
            warnings.warn(f'layer "{self.name}": MemoryData does not transform the arrays given to reset()',
                          stacklevel=2)
        self._data, self._labels, self._pos = data, labels.reshape(n), 0

    def forward(self, bottom, top):
        if self._data is None:
            raise self.error("no data: call reset(data, labels) on this layer first")
        rank, ranks = self.shard
        n, batch = len(self._data), self.shape[0]
        start = (self._pos + rank * batch) % n
        rows = slice(start, start + batch) if start + batch <= n else np.arange(start, start + batch) % n
        _copy_to_top(top, (self._data[rows], self._labels[rows]))
        self._pos = (self._pos + ranks * batch) % n

    def resume_state(self) -> dict:
        return {"pos": getattr(self, "_pos", 0)}

    def restore_state(self, state) -> None:
        self._pos = int(state["pos"])           # of the arrays reset() is given (again) on a resume
