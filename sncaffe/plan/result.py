"""A plan as plain data: what the builder writes and the runtime replays, and its errors."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from .schedule import Schedule


class PlanError(ValueError):
    pass


class MemoryExhausted(MemoryError):
    """A plan or a step that does not fit the device, with what would fit."""


@dataclass
class Plan:
    mode: str
    schedule: Schedule
    persistent: list                  # roots allocated at bind time
    persistent_bytes: int
    extra_bytes: int                  # pool bytes held outside the graph (solver history)
    capacity: int | None
    arena: int | None = None          # the pool's size the blocks were placed in, where not capacity
    overflow: str = ""                # the first allocation a capacity-bound plan could not place
    note: str = ""
    peak: int = 0
    host_peak: int = 0
    lower_bound: int = 0
    lower_bound_step: str = ""
    d2h_bytes: int = 0
    h2d_bytes: int = 0
    recompute_flops: int = 0
    recomputed_ops: int = 0
    granularity: int = 0              # recompute: 0 per layer, else segments of whole units (passes.py)
    segments: int = 0                 # with a granularity: the segments replayed in backward
    kept: int = 0                     # with a granularity: the layer chains kept (passes.chains)
    kept_bytes: int = 0               # their values' bytes, held from forward to backward
    memory_centric: int = 0           # segments replayed memory-centric (from the checkpoint for each need)
    cache_hits: int = 0
    cache_misses: int = 0
    chunk_trials: int = 0             # workspace sizes tried while choosing chunks (bounded by log batch)
    offloaded: list = field(default_factory=list)
    dropped: list = field(default_factory=list)
    host_params: list = field(default_factory=list)   # roots kept on the host, brought in per step
    host_capacity: int | None = None  # the host pool's free bytes
    ram: int | None = None            # device and host pools on one RAM (the CPU): their peaks together
    host_extra: int = 0               # host bytes held beside the net (the solver's history there)
    disk_peak: int = 0                # the spill file's peak (offloads the host pool could not hold)
    disk_capacity: int | None = None  # the room on the spill file's disk (None: no disk tier)
    param_disk: bool = False          # host_params, and their state (with the history) in the spill file
    disk_base: int = 0                # spill-file bytes held across iterations (that state)
    resident: int = 0                 # the process's expected peak resident memory (one RAM), once said
    timeline: object = None           # of the device with the highest peak
    timelines: dict = field(default_factory=dict)     # location -> Timeline
    peaks: dict = field(default_factory=dict)         # location -> peak bytes

    @property
    def fits(self) -> bool:
        return self.device_fits and self.host_fits

    @property
    def device_fits(self) -> bool:
        return self.capacity is None or (self.peak <= self.capacity and not self.overflow)

    @property
    def host_fits(self) -> bool:
        """The host tier within its pool, and on one RAM both tiers together within it."""
        return ((self.host_capacity is None or self.host_peak <= self.host_capacity)
                and (self.ram is None or self.peak + self.host_peak <= self.ram)
                and (not self.disk_peak or self.disk_capacity is None or self.disk_peak <= self.disk_capacity))

    def summary(self) -> dict:
        return dict(mode=self.mode, peak=self.peak, lower_bound=self.lower_bound,
                    d2h_bytes=self.d2h_bytes, h2d_bytes=self.h2d_bytes,
                    recompute_flops=self.recompute_flops, host_peak=self.host_peak,
                    cache_hits=self.cache_hits, cache_misses=self.cache_misses, fits=self.fits)


def layer_flops(node) -> int:
    """Forward FLOPs of a layer: exact for convolutions and inner products, element counts otherwise."""
    top = node.tops[0].shape if node.tops else ()
    out = math.prod(top) if node.tops else 0
    if node.type in ("Convolution", "Deconvolution", "InnerProduct") and node.params:
        w = node.params[0][0].shape
        per_out = math.prod(w[1:]) if node.type != "InnerProduct" else \
            math.prod(w) // max(1, top[-1] if top else 1)
        if node.type == "Deconvolution":
            return 2 * math.prod(node.bottoms[0].shape) * math.prod(w[1:])
        return 2 * out * per_out
    per = getattr(node.layer, "flops_per_output", None)     # the layer class's own estimate
    return out * (per or {"LRN": 10, "BatchNorm": 6, "Pooling": 9}.get(node.type, 2))
