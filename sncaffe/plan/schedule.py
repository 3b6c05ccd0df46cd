"""A schedule: the instructions of one iteration, in the order the executor issues them.

The planner writes a schedule and the executor replays it on the device, so
the pool sees exactly the allocations and frees the planner simulated and the
measured peak equals the planned one. Instructions:

- ``alloc T``      take T's block from the device pool (``fill``: write a value first)
- ``free T``       give it back (waits for a copy of T still in flight)
- ``run op``       an operator on the compute stream (``recompute``: a forward
                   replayed in backward, without side effects)
- ``offload T``    copy T to its host block on the device-to-host stream
- ``prefetch T``   copy T's host block into its (just allocated) device block on
                   the host-to-device stream
- ``drop T``       give T's host block back to the host pool
- ``snapshot T``   copy T into its checkpoint tensor (device to device), before
                   an in-place layer overwrites the value a recomputation starts from
- ``restore T``    copy the checkpoint back into T
"""
from __future__ import annotations

from dataclasses import dataclass, field

@dataclass(eq=False, slots=True)       # (slots: a plan of a deep net makes millions)
class Instr:
    kind: str                   # alloc | free | run | offload | prefetch | drop | snapshot | restore
    tensor: object = None       # a graph Tensor (a root), for memory instructions
    op: object = None           # a graph Operator, for run
    recompute: bool = False
    fill: float | None = None   # alloc: value to write before first use (None: leave as is)
    source: object = None       # the device tensor holding the value, when not ``tensor`` itself
    chunk: int | None = None    # run: images per pass, where the full workspace does not fit
    workspace: dict | None = None   # run: the chunked workspace tensors, by the layer's names
    tier: str = "host"          # offload: where the copy goes, the host pool or the disk (spill file)

    def __repr__(self):
        if self.kind == "run":
            return (f"run {self.op.name}" + (" (recompute)" if self.recompute else "")
                    + (f" in chunks of {self.chunk}" if self.chunk else ""))
        extra = f" fill={self.fill}" if self.fill is not None else ""
        extra += " to disk" if self.tier == "disk" else ""
        return f"{self.kind} {self.tensor.name}{extra}"


@dataclass
class Schedule:
    forward: list = field(default_factory=list)
    backward: list = field(default_factory=list)

    def __iter__(self):
        yield from self.forward
        yield from self.backward


@dataclass
class Timeline:
    """The simulated device and host bytes in use after every instruction."""
    device: list
    host: list
    labels: list                 # the instruction behind each point (an Instr: its repr is the label)
    steps: list                  # (index into device/host, op name) where each run starts
    backward_start: int = 0      # index where backward begins
    disk: list = None            # bytes in the spill file after every instruction

    @property
    def disk_peak(self) -> int:
        return max(self.disk or [0])

    @property
    def peak(self) -> int:
        return max(self.device, default=0)

    @property
    def host_peak(self) -> int:
        return max(self.host, default=0)


def simulate(schedule: Schedule, persistent: int, location: str = "", host_base: int = 0,
             hosted=(), disk_base: int = 0, alone: bool = False) -> Timeline:
    """Replay the schedule's memory instructions on one device (``location``): bytes in use,
    as its pool and its host pool will count them. ``host_base``: host bytes held across
    iterations (parameters kept on the host, ``hosted``, and the solver's history there); a
    value takes a host block at its first offload and gives it back when dropped.
    ``disk_base``: spill-file bytes held across iterations (parameter state on disk).
    ``alone``: the schedule has no other location (no test per instruction)."""
    dev, host, disk = persistent, host_base, disk_base
    homes = {id(t) for t in hosted}
    held = {}                       # id(value) -> the tier its copy is in
    d, h, k_, labels, steps = [dev], [host], [disk], ["start"], []
    backward_start = None
    for part in (schedule.forward, schedule.backward):
        if part is schedule.backward:
            backward_start = len(d) - 1
        for ins in part:            # (millions on the deepest nets: kept to one dispatch per kind)
            kind, t = ins.kind, ins.tensor
            if kind == "run":
                steps.append((len(d), ins.op.name + (" (recompute)" if ins.recompute else "")))
                continue
            if not alone and (ins.source or t).location != location:
                continue
            if kind == "alloc":
                dev += t.block_bytes
            elif kind == "free":
                dev -= t.block_bytes
            elif kind == "offload":
                key = id(t)
                if key in homes or key in held:
                    continue                    # its host block is already there
                held[key] = ins.tier
                if ins.tier == "disk":
                    disk += t.block_bytes
                else:
                    host += t.block_bytes
            elif kind == "drop":
                if held.pop(id(t), "host") == "disk":
                    disk -= t.block_bytes
                else:
                    host -= t.block_bytes
            else:
                continue
            d.append(dev)
            h.append(host)
            k_.append(disk)
            labels.append(ins)
    return Timeline(d, h, labels, steps, backward_start, k_)
