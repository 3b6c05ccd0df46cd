"""An LMDB's pages checked before liblmdb reads them.

liblmdb trusts its file: a damaged page makes it abort the process (a failed assertion such as
``IS_LEAF(mp)``) and a page past the end of a truncated file kills it with SIGBUS, with no
error to report. ``check`` reads the pages a reader would (the newest meta page, the main
B-tree's branch and leaf pages, the first page of each overflow run) and raises ValueError
naming what is wrong. The layout is liblmdb 0.9's (mdb.c: MDB_page, MDB_meta, MDB_node).
"""
from __future__ import annotations

import mmap
import os
import struct

P_BRANCH, P_LEAF, P_OVERFLOW, P_META, P_LEAF2 = 0x01, 0x02, 0x04, 0x08, 0x20
F_BIGDATA, F_SUBDATA, F_DUPDATA = 0x01, 0x02, 0x04
MDB_DUPSORT = 0x04
MAGIC, VERSION = 0xBEEFC0DE, 1
PAGE_HEADER, NODE_HEADER = 16, 8
P_INVALID = (1 << 64) - 1
FULL_CHECK_BYTES = 4 << 30      # larger files: the meta page and the file's length only (the walk
                                # would read a page per record of a database that size)


def data_file(path) -> str:
    return os.path.join(path, "data.mdb") if os.path.isdir(path) else str(path)


def check(path) -> None:
    """Raise ValueError if the LMDB at ``path`` (a folder or a file) is not whole."""
    name = data_file(path)
    size = os.path.getsize(name)
    if size == 0:
        raise ValueError(f"{name} is empty")
    with open(name, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        _Walk(m, size).run(size <= FULL_CHECK_BYTES)


class _Walk:
    def __init__(self, m, size):
        self.m, self.size = m, size

    def u(self, fmt, off):
        if off < 0 or off + struct.calcsize(fmt) > self.size:
            raise ValueError(f"a page reaches past the end of the file ({self.size} bytes): truncated or damaged")
        return struct.unpack_from(fmt, self.m, off)

    def _meta(self, off):
        flags, = self.u("<H", off + 10)
        magic, version = self.u("<II", off + 16)
        main_flags, depth = self.u("<HH", off + 92)         # mm_dbs[MAIN_DBI]: md_flags, md_depth
        root, = self.u("<Q", off + 128)                      # its md_root
        last, txnid = self.u("<QQ", off + 136)
        return dict(ok=bool(flags & P_META) and magic == MAGIC and version == VERSION,
                    psize=self.u("<I", off + 40)[0], main_flags=main_flags, depth=depth, root=root,
                    last=last, txnid=txnid)

    def run(self, full):
        first = self._meta(0)
        psize = first["psize"]
        if not first["ok"] or psize < 512 or psize > 65536 or psize & (psize - 1):
            raise ValueError("its first meta page is damaged (not an LMDB, or not one written by liblmdb 0.9)")
        second = self._meta(psize)
        meta = second if second["txnid"] > first["txnid"] else first    # liblmdb reads the newer
        if not meta["ok"]:
            raise ValueError("its newest meta page is damaged")
        self.psize, self.last = psize, meta["last"]
        if self.last < 1 or (self.last + 1) * psize > self.size:
            raise ValueError(f"its meta page says it has {self.last + 1} pages of {psize} bytes; the file has "
                             f"{self.size} bytes (truncated or damaged)")
        if meta["root"] == P_INVALID or not full or meta["main_flags"] & MDB_DUPSORT:
            return
        self._tree(meta["root"], meta["depth"])

    def _page(self, pgno, what):
        if not 2 <= pgno <= self.last:
            raise ValueError(f"{what} names page {pgno}, outside pages 2 to {self.last}")
        off = pgno * self.psize
        if self.u("<Q", off)[0] != pgno:
            raise ValueError(f"page {pgno} is damaged (its header names page {self.u('<Q', off)[0]})")
        return off, self.u("<H", off + 10)[0]

    def _tree(self, root, depth):
        seen = set()
        stack = [(root, depth, "the meta page")]
        while stack:
            pgno, level, what = stack.pop()
            if pgno in seen:
                raise ValueError(f"page {pgno} is reached twice in the tree (damaged)")
            seen.add(pgno)
            off, flags = self._page(pgno, what)
            kind = flags & (P_BRANCH | P_LEAF | P_OVERFLOW | P_META | P_LEAF2)
            want = P_LEAF if level == 1 else P_BRANCH
            if level < 1 or kind != want:
                raise ValueError(f"page {pgno} is damaged (flags {flags:#x} where a "
                                 f"{'leaf' if want == P_LEAF else 'branch'} page belongs)")
            lower, upper = self.u("<HH", off + 12)
            if not PAGE_HEADER <= lower <= upper <= self.psize or (lower - PAGE_HEADER) % 2:
                raise ValueError(f"page {pgno} is damaged (free space {lower}..{upper})")
            for k in range((lower - PAGE_HEADER) // 2):
                node = self.u("<H", off + PAGE_HEADER + 2 * k)[0]
                if not upper <= node <= self.psize - NODE_HEADER:
                    raise ValueError(f"page {pgno} is damaged (node {k} at {node})")
                lo, hi, nflags, ksize = self.u("<HHHH", off + node)
                end = node + NODE_HEADER + ksize
                if end > self.psize:
                    raise ValueError(f"page {pgno} is damaged (node {k}'s key runs past the page)")
                if want == P_BRANCH:
                    stack.append((lo | hi << 16 | nflags << 32, level - 1, f"page {pgno} node {k}"))
                else:
                    self._leaf_data(pgno, k, end, lo | hi << 16, nflags)

    def _leaf_data(self, pgno, k, at, dsize, flags):
        if flags & (F_SUBDATA | F_DUPDATA):
            raise ValueError(f"page {pgno} node {k}: a sub-database or duplicate, which a Caffe LMDB has not")
        if not flags & F_BIGDATA:
            if at + dsize > self.psize:
                raise ValueError(f"page {pgno} is damaged (node {k}'s value runs past the page)")
            return
        if at + 8 > self.psize:
            raise ValueError(f"page {pgno} is damaged (node {k}'s overflow page number runs past the page)")
        first = self.u("<Q", pgno * self.psize + at)[0]
        off, oflags = self._page(first, f"page {pgno} node {k}")
        pages = self.u("<I", off + 12)[0]
        if not oflags & P_OVERFLOW or pages < 1 or first + pages - 1 > self.last \
                or pages * self.psize - PAGE_HEADER < dsize:
            raise ValueError(f"overflow page {first} (a value of {dsize} bytes) is damaged")
