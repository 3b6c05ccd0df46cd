"""LMDB databases as Caffe uses them: records read in key order, wrapping around; written in batches.

Caffe's LEVELDB backend is in data/leveldb.py (plyvel), with the same reader interface.
"""
from __future__ import annotations

import collections
import os
import threading
import weakref
from pathlib import Path

import lmdb

from . import lmdb_pages

COMMIT_EVERY = 1000          # records per write transaction, as Caffe's converters


# py-lmdb refuses to open one environment twice in a process, so readers share it.
_shared: dict[str, list] = {}           # real path -> [environment, readers]
_lock = threading.Lock()
# Paths of readers that were closed or collected; released under the lock at the next call,
# never from inside a garbage collection (which may run while the lock is held).
_released = collections.deque()


def _drain():
    while _released:
        key = _released.popleft()
        entry = _shared.get(key)
        if entry is not None:
            entry[1] -= 1
            if entry[1] == 0:
                del _shared[key]
                entry[0].close()


def open_lmdb(path) -> "lmdb.Environment":
    """Open an LMDB read-only; a missing, empty or corrupt database is an error naming the path.

    Pair every call with ``close_lmdb(path)``.
    """
    p = Path(path)
    key = os.path.realpath(p)
    with _lock:
        _drain()
        if key in _shared:
            _shared[key][1] += 1
            return _shared[key][0]
        if not p.exists():
            raise FileNotFoundError(f"LMDB {path} does not exist")
        if p.is_dir() and not (p / "data.mdb").is_file():     # lmdb's own words: "No such file or directory"
            raise ValueError(f"{path} is not an LMDB: the directory has no data.mdb")
        if os.path.exists(lmdb_pages.data_file(p)):      # else lmdb.open says what is missing
            try:
                lmdb_pages.check(p)
            except (ValueError, OSError) as e:
                raise ValueError(f"LMDB {path} cannot be opened: {e}") from None
        try:
            env = lmdb.open(str(p), readonly=True, lock=False, readahead=False, subdir=p.is_dir())
            entries = env.stat()["entries"]
        except lmdb.Error as e:
            raise ValueError(f"LMDB {path} cannot be opened: {e}") from None
        if entries == 0:
            env.close()
            raise ValueError(f"LMDB {path} holds no records")
        _shared[key] = [env, 1]
        return env


def close_lmdb(path) -> None:
    """Release one ``open_lmdb(path)``; the last release closes the environment."""
    _released.append(os.path.realpath(path))
    with _lock:
        _drain()


class LMDBReader:
    """Records (key, value) of an LMDB in key order, starting over after the last (Caffe's cursor)."""

    def __init__(self, path):
        self.path = str(path)
        self.env = open_lmdb(path)
        self.entries = self.env.stat()["entries"]
        self._txn = self._cursor = None
        self._last = self._resume = None
        self._release = weakref.finalize(self, _released.append, os.path.realpath(self.path))

    def first(self) -> tuple[bytes, bytes]:
        try:
            with self.env.begin(buffers=False) as txn:
                cur = txn.cursor()
                cur.first()
                return cur.key(), cur.value()
        except lmdb.Error as e:
            raise self._corrupt(e) from None

    def _corrupt(self, e) -> ValueError:
        where = f"after key {self._last.decode(errors='replace')}" if self._last else "at its first record"
        return ValueError(f"LMDB {self.path} cannot be read {where}: {e} (is its data.mdb damaged?)")

    def __iter__(self):
        return self

    def __next__(self) -> tuple[bytes, bytes]:
        try:
            return self._step()
        except lmdb.Error as e:
            raise self._corrupt(e) from None

    def _step(self) -> tuple[bytes, bytes]:
        # The transaction is opened by the first call, so it belongs to the reading thread.
        if self._cursor is None:
            if self._txn is not None:
                self._txn.abort()
            self._txn = self.env.begin(buffers=False)
            self._cursor = self._txn.cursor()
            if self._resume is None:
                self._cursor.first()
            else:
                if not self._cursor.set_key(self._resume):
                    raise ValueError(f"LMDB {self.path}: key {self._resume.decode(errors='replace')}, where the "
                                     "snapshot stopped reading, is not in the database (was it rewritten?)")
                self._resume = None
                if not self._cursor.next():
                    self._cursor.first()
        elif not self._cursor.next():
            self._cursor.first()
        self._last = self._cursor.key()
        return self._last, self._cursor.value()

    # The cursor interface every key-value reader offers, so a resume continues where a run stopped.
    def tell(self) -> bytes | None:
        """The key of the last record returned (None before the first)."""
        return self._last

    def seek(self, key: bytes | None) -> None:
        """The next record returned is the one after ``key`` (the first if None)."""
        self._resume, self._cursor, self._last = key, None, key

    def close(self):
        if self._txn is not None:
            self._txn.abort()
            self._txn = self._cursor = None
        self._release()
        with _lock:
            _drain()


class Writer:
    """A new database (it must not exist yet, as Caffe's db::NEW) written in batches of
    COMMIT_EVERY records; a backend writes a batch (``_write``) and closes (``_close``)."""

    def _new(self, path) -> Path:
        self.path = Path(path)
        if self.path.exists():
            raise FileExistsError(f"{path} already exists; remove it or choose another output")
        self._pending: list[tuple[bytes, bytes]] = []
        self.count = 0
        return self.path

    def put(self, key, value: bytes) -> None:
        self._pending.append((key.encode() if isinstance(key, str) else key, value))
        self.count += 1
        if len(self._pending) >= COMMIT_EVERY:
            self.commit()

    def commit(self) -> None:
        self._write(self._pending)
        self._pending.clear()

    def close(self) -> None:
        self.commit()
        self._close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class LMDBWriter(Writer):
    """A new LMDB; the map grows as records arrive."""

    def __init__(self, path, map_size=1 << 26):
        self._new(path).mkdir(parents=True)
        self.env = lmdb.open(str(self.path), map_size=map_size, subdir=True)

    def _write(self, pending) -> None:
        while True:
            try:
                with self.env.begin(write=True) as txn:
                    for key, value in pending:
                        txn.put(key, value)
                return
            except lmdb.MapFullError:
                self.env.set_mapsize(self.env.info()["map_size"] * 2)

    def _close(self) -> None:
        self.env.close()
