"""The LRU cache of offloaded values: under a capacity, a value copied to the host after
forward stays on the device while it fits, and the least recently used goes first when an
allocation needs room. A value in the cache is resident; using it again is a hit (no prefetch)."""
from __future__ import annotations

from collections import OrderedDict


class LRUCache:
    def __init__(self):
        self.held = OrderedDict()       # id(value) -> value, least recently used first

    def keep(self, r) -> None:
        """``r``'s forward is done and its copy is on the host: evictable from now on."""
        self.held[id(r)] = r

    def take(self, r) -> bool:
        """``r`` is used again, or freed: no longer evictable. Whether it was cached."""
        return self.held.pop(id(r), None) is not None

    def victim(self, loc):
        """The value to evict for room on location ``loc`` (None: nothing cached there)."""
        return next((t for t in self.held.values() if t.location == loc), None)
