"""The best-fit allocator the pool runs, as plain data: the planner runs it on the plan's
allocations and frees, so a plan places every block where the pool will at run time.

Free blocks are indexed twice: by (size, offset) in a sorted list for best fit
(sortedcontainers' SortedList: O(log n) search, insert and removal) and by
their start and end offsets in dicts for O(1) merging on free. Every size is rounded up to the alignment, so every
offset is aligned. The allocator knows nothing of arrays or threads.
"""
from __future__ import annotations

from sortedcontainers import SortedList

from ..sizes import ALIGNMENT, align, fmt_bytes


class OutOfMemory(MemoryError):
    """The pool cannot place a block; carries what a user needs to fix it. (The message is
    written when read: the planner's trials raise and catch many of these.)"""

    def __init__(self, nbytes, pool, name=None):
        self.nbytes, self.name = nbytes, name
        self.capacity, self.in_use, self.largest_free = pool.capacity, pool.in_use, pool.largest_free
        super().__init__(nbytes)

    def __str__(self):
        what = f'tensor "{self.name}"' if self.name else "a block"
        short = self.nbytes - self.largest_free
        return (f"device memory exhausted allocating {what} of {fmt_bytes(self.nbytes)}: "
                f"{fmt_bytes(self.in_use)} of {fmt_bytes(self.capacity)} in use, largest free block "
                f"{fmt_bytes(self.largest_free)} ({fmt_bytes(short)} short)")


class BestFit:
    def __init__(self, capacity: int, alignment: int = ALIGNMENT):
        self.alignment = alignment
        self.capacity = capacity // alignment * alignment
        self.full_capacity = self.capacity      # what restrict() may give back (capacity: what it allows now)
        self._by_size = SortedList([(self.capacity, 0)] if self.capacity else [])
        self._free_start: dict[int, int] = {0: self.capacity} if self.capacity else {}
        self._free_end: dict[int, int] = {self.capacity: 0} if self.capacity else {}
        self._used: dict[int, int] = {}   # offset -> size
        self.in_use = 0
        self.peak = 0

    def restrict(self, capacity: int | None) -> None:
        """Place blocks within the first ``capacity`` bytes only (None: all of them again), as
        a plan placed in a smaller arena than the pool's (plan/planner.make_plan). Only while
        nothing is allocated: the free list is then one block, and the pool's state is that
        of a pool made with this capacity."""
        if self._used:
            return
        size = self.full_capacity if capacity is None else min(self.full_capacity, capacity // self.alignment * self.alignment)
        self.capacity = size
        self._by_size = SortedList([(size, 0)] if size else [])
        self._free_start = {0: size} if size else {}
        self._free_end = {size: 0} if size else {}

    def alloc(self, nbytes: int, name: str | None = None) -> int:
        """Offset of a new block of at least ``nbytes`` (the smallest free block that fits)."""
        size = align(nbytes, self.alignment)
        i = self._by_size.bisect_left((size, -1))
        if i == len(self._by_size):
            raise OutOfMemory(size, self, name)
        bsize, off = self._by_size.pop(i)
        del self._free_start[off]
        del self._free_end[off + bsize]
        if bsize > size:
            self._insert_free(off + size, bsize - size)
        self._used[off] = size
        self.in_use += size
        self.peak = max(self.peak, self.in_use)
        return off

    def free(self, offset: int) -> None:
        size = self._used.pop(offset)
        self.in_use -= size
        start, end = offset, offset + size
        if end in self._free_start:                 # merge with the block after
            nsize = self._free_start.pop(end)
            del self._free_end[end + nsize]
            self._remove_size_index(nsize, end)
            end += nsize
        if start in self._free_end:                 # and with the block before
            pstart = self._free_end.pop(start)
            del self._free_start[pstart]
            self._remove_size_index(start - pstart, pstart)
            start = pstart
        self._insert_free(start, end - start)

    def _insert_free(self, off: int, size: int) -> None:
        self._by_size.add((size, off))
        self._free_start[off] = size
        self._free_end[off + size] = off

    def _remove_size_index(self, size: int, off: int) -> None:
        self._by_size.remove((size, off))

    def size_of(self, offset: int) -> int:
        return self._used[offset]

    def reset_peak(self) -> None:
        self.peak = self.in_use

    def can_place(self, sizes) -> bool:
        """Whether blocks of ``sizes`` could be allocated now, one after another (a trial undone)."""
        if len(sizes) == 1:
            return self.largest_free >= align(sizes[0], self.alignment)
        if sum(align(n, self.alignment) for n in sizes) > self.capacity - self.in_use:
            return False
        taken, ok = [], True
        for n in sizes:
            if self.largest_free < align(n, self.alignment):
                ok = False
                break
            taken.append(self.alloc(n))
        for off in taken:
            self.free(off)
        return ok

    @property
    def largest_free(self) -> int:
        return self._by_size[-1][0] if self._by_size else 0

    @property
    def fragmentation(self) -> float:
        """1 - largest free block / all free bytes (0 when free memory is one block)."""
        free = self.capacity - self.in_use
        return 0.0 if free == 0 else 1.0 - self.largest_free / free

    def stats(self) -> dict:
        return dict(capacity=self.capacity, in_use=self.in_use, peak=self.peak,
                    largest_free=self.largest_free, fragmentation=self.fragmentation,
                    blocks=len(self._used))
