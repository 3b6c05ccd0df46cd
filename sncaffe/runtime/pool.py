"""The heap pool: one preallocated arena, carved by the planner's best-fit allocator
(plan/allocator.py) under a lock, since copy streams allocate and free beside the compute
thread. The pool knows nothing of arrays; a device carves views."""
from __future__ import annotations

import threading

from ..plan.allocator import BestFit, OutOfMemory  # noqa: F401  (the pool's error, raised by alloc)
from ..sizes import ALIGNMENT


class Pool(BestFit):
    def __init__(self, capacity: int, alignment: int = ALIGNMENT):
        super().__init__(capacity, alignment)
        self._lock = threading.Lock()

    def alloc(self, nbytes: int, name: str | None = None) -> int:
        with self._lock:
            return super().alloc(nbytes, name)

    def free(self, offset: int) -> None:
        with self._lock:
            super().free(offset)
