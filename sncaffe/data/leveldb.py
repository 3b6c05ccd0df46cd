"""LevelDB databases as Caffe uses them (its default Data backend), through plyvel (the
``leveldb`` extra): records read in key order, wrapping around; written in batches.

The reader and writer have the interface of db.LMDBReader and db.LMDBWriter. LevelDB lets one
handle open a database at a time, so readers in one process share it (as LMDB readers do).
"""
from __future__ import annotations

import os
import threading
from pathlib import Path

from .db import Writer

_shared: dict[str, list] = {}           # real path -> [plyvel.DB, readers]
_lock = threading.RLock()     # reentrant: a reader collected inside the lock closes under it


def _plyvel():
    try:
        import plyvel
    except ImportError:
        raise ImportError("reading or writing LevelDB needs plyvel: pip install 'sncaffe[leveldb]' "
                          "(or convert the data to LMDB)") from None
    return plyvel


def open_leveldb(path):
    """Open a LevelDB for reading; a missing, locked, corrupt or empty database is an error naming
    the path. Pair every call with ``close_leveldb(path)``."""
    plyvel = _plyvel()
    p = Path(path)
    key = os.path.realpath(p)
    with _lock:
        if key in _shared:
            _shared[key][1] += 1
            return _shared[key][0]
        if not p.is_dir():
            raise FileNotFoundError(f"LevelDB {path} does not exist")
        try:
            db = plyvel.DB(str(p), create_if_missing=False, max_open_files=100)
        except plyvel.Error as e:
            hint = ("; it is an LMDB: set data_param { backend: LMDB } (Caffe's default backend is LEVELDB)"
                    if (p / "data.mdb").exists() else "")
            raise ValueError(f"LevelDB {path} cannot be opened: {e}{hint}") from None
        if next(db.iterator(include_value=False), None) is None:
            db.close()
            raise ValueError(f"LevelDB {path} holds no records")
        _shared[key] = [db, 1]
        return db


def close_leveldb(path) -> None:
    """Release one ``open_leveldb(path)``; the last release closes the database."""
    key = os.path.realpath(path)
    with _lock:
        entry = _shared.get(key)
        if entry is not None:
            entry[1] -= 1
            if entry[1] == 0:
                del _shared[key]
                entry[0].close()


class LevelDBReader:
    """Records (key, value) of a LevelDB in key order, starting over after the last (Caffe's cursor)."""

    def __init__(self, path):
        self.path = str(path)
        self.db = open_leveldb(path)
        self._iter = None
        self._last = self._resume = None
        self._closed = False

    @property
    def entries(self) -> int:
        """The number of records (LevelDB keeps no count: one pass over the keys)."""
        with self.db.iterator(include_value=False) as it:
            return sum(1 for _ in it)

    def first(self) -> tuple[bytes, bytes]:
        with self.db.iterator() as it:
            return next(it)

    def __iter__(self):
        return self

    def __next__(self) -> tuple[bytes, bytes]:
        # The iterator is made by the first call, so it belongs to the reading thread.
        if self._iter is None:
            self._iter = self.db.iterator()
            if self._resume is not None:
                self._iter.seek(self._resume)
                item = next(self._iter, None)
                if item is None or item[0] != self._resume:
                    raise ValueError(f"LevelDB {self.path}: key {self._resume.decode(errors='replace')}, where "
                                     "the snapshot stopped reading, is not in the database (was it rewritten?)")
                self._resume = None
        item = next(self._iter, None)
        if item is None:
            self._iter.close()
            self._iter = self.db.iterator()
            item = next(self._iter)
        self._last = item[0]
        return item

    # The cursor interface of db.LMDBReader, so a resumed run continues where a run stopped.
    def tell(self) -> bytes | None:
        """The key of the last record returned (None before the first)."""
        return self._last

    def seek(self, key: bytes | None) -> None:
        """The next record returned is the one after ``key`` (the first if None)."""
        if self._iter is not None:
            self._iter.close()
        self._iter, self._resume, self._last = None, key, key

    def close(self):
        if self._iter is not None:
            self._iter.close()
            self._iter = None
        if not self._closed:
            self._closed = True
            close_leveldb(self.path)

    def __del__(self):
        try:
            self.close()
        except Exception:       # interpreter shutdown
            pass


class LevelDBWriter(Writer):
    """A new LevelDB, written in batches."""

    def __init__(self, path):
        plyvel = _plyvel()
        self._new(path)
        # Caffe's LevelDB::Open for NEW: error_if_exists, a 256 MB write buffer
        self.db = plyvel.DB(str(self.path), create_if_missing=True, error_if_exists=True,
                            write_buffer_size=256 << 20)

    def _write(self, pending) -> None:
        with self.db.write_batch() as batch:
            for key, value in pending:
                batch.put(key, value)

    def _close(self) -> None:
        self.db.close()


def reader(path, backend):
    """A reader of ``backend`` (DataParameter.DB: LEVELDB or LMDB)."""
    from ..proto import sncaffe_pb2 as pb
    if backend == pb.DataParameter.LEVELDB:
        return LevelDBReader(path)
    from .db import LMDBReader
    return LMDBReader(path)


def writer(path, backend: str):
    """A writer for the converters' ``--backend`` (lmdb or leveldb)."""
    if backend == "leveldb":
        return LevelDBWriter(path)
    from .db import LMDBWriter
    return LMDBWriter(path)
