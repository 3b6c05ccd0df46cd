"""Tier placement of offloaded copies: the host pool while it has room (``host_room``, planned
as it fills), the disk tier (the spill file, spill.py) for the rest. Parameters kept on the
host have their own home there and are not placed here."""
from __future__ import annotations

class Tiers:
    def __init__(self, room, used):
        self.room = room                # host bytes copies may take (with ``used``); None: all
        self.used = used                # host bytes taken now
        self.of = {}                    # id(value) -> "host" or "disk", while its copy is held

    def place(self, tensor) -> str:
        """The tier ``tensor``'s copy goes to."""
        n = tensor.block_bytes
        tier = "host" if self.used + n <= self.room else "disk"
        if tier == "host":
            self.used += n
        self.of[id(tensor)] = tier
        return tier

    def release(self, tensor) -> None:
        """The copy is dropped: its host bytes come back."""
        if self.of.pop(id(tensor), "disk") == "host":
            self.used -= tensor.block_bytes
