"""Where the pool puts each block: the planner runs the device's own allocator (one per
location) on the plan's allocations and frees, so a plan that fits here is placed alike at
run time, fragmentation included. Without a capacity, only the bytes in use are counted."""
from __future__ import annotations

from .allocator import OutOfMemory, BestFit
from ..sizes import align
class Placement:
    def __init__(self, capacity, base, before=(), persistent=(), extra=()):
        """``base``: bytes each location holds before the iteration; the blocks placed first,
        in the order the net binds them: ``before`` (other nets'), the net's ``persistent``
        roots, then ``extra`` (the solver's history)."""
        self.capacity = capacity
        self.in_use = dict(base)
        self.sims, self.placed = {}, {}
        self.overflow = ""              # the first allocation that could not be placed
        if capacity is None:
            return
        for loc in base:
            sim = self.sims[loc] = BestFit(capacity)
            try:
                for b in before if loc == "" else ():
                    sim.alloc(b)
                for r in persistent:
                    if r.location == loc:
                        sim.alloc(r.nbytes)
                for b in extra if loc == "" else ():
                    if b:
                        sim.alloc(b)
            except OutOfMemory as e:
                self.overflow = f"at the start: {e}"
                del self.sims[loc]

    def alloc(self, tensor):
        """Place ``tensor``: the allocator's error where it cannot be placed, else None."""
        sim = self.sims.get(tensor.location)
        self.in_use[tensor.location] = self.in_use.get(tensor.location, 0) + tensor.block_bytes
        if sim is not None:
            try:
                self.placed[id(tensor)] = sim.alloc(tensor.nbytes, tensor.name)
            except OutOfMemory as e:
                return e
        return None

    def free(self, tensor):
        if id(tensor) in self.placed:
            self.sims[tensor.location].free(self.placed.pop(id(tensor)))
        self.in_use[tensor.location] -= tensor.block_bytes

    def fits(self, sizes, loc="") -> bool:
        """Whether blocks of ``sizes`` can be placed on ``loc`` now."""
        if self.capacity is None:
            return True
        sim = self.sims.get(loc)
        if sim is None:
            return self.in_use.get(loc, 0) + sum(align(n) for n in sizes) <= self.capacity
        return sim.can_place(sizes)         # a trial on the allocator, undone at once
