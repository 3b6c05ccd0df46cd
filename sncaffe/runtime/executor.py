"""The executor: replays a schedule on a device, instruction by instruction.

Compute runs in order on the calling thread (the compute stream), each
operator under its own device (``with device.active()``: model parallelism
over GPUs); copies go to the device's d2h and h2d streams and return events.
An operator waits only for the copies it depends on: prefetches of what it
touches, offloads of what it overwrites, and it waits on the device
(``device.wait_event``: the compute stream waits, the host goes on queueing
kernels). So does a block's release: the next user of the block is ordered
after the wait on the compute stream. The host itself waits only where it
reuses memory the copies touch: a host block dropped or released.
Because allocations and frees happen exactly in the planned order, the pool's
measured peak equals the planned one.

This serial executor is the base of the one nets use:
the event-driven dispatcher of dispatcher.py (operators on the streams of
their locations, each issued when the events it depends on have fired).
"""
from __future__ import annotations

import time

import numpy as np

from ..plan.liveness import op_tensors
from ..plan.result import MemoryExhausted
from .spill import spill_of


def workspace_names(ins) -> dict:
    """A run instruction's workspace tensors by the layer's names: the chunked ones the planner
    chose, else the operator's pass's own."""
    if ins.workspace is not None:
        return ins.workspace
    node = ins.op.node
    return node.workspace if ins.op.kind == "forward" else node.backward_workspace


class SerialExecutor:
    def __init__(self, device, binders, run_op, devices=None):
        self.device = device
        self.devices = dict(devices or {})     # location -> device (model parallelism)
        self.devices.setdefault("", device)
        self.binders = binders          # id(root) -> [callable(array or None)]
        self.run_op = run_op            # (op, recompute) -> None
        self.offsets, self.arrays = {}, {}
        self.host = {}                  # id(value) -> (offset, bytes)
        self.disk = {}                  # id(value) -> (offset in the spill file, location)
        self.d2h, self.h2d = {}, {}     # id(device root) -> event of a copy out of / into it
        self.host_events = {}           # id(value) -> events reading or writing its host block
        self.transient = {}             # id(root) -> root, allocated by a schedule and not yet freed
        self.home = {}                  # id(root) -> host array a hosted parameter lives in
        self.disk_homes = set()         # id(root) of hosted parameters whose home is the spill file
        self.host_loc = {}              # id(value) -> location of the device whose host pool holds it
        self.trace = None               # a list to record (stream, name, start, end) into
        self._pending_trace = []
        self.stats = {"d2h_bytes": 0, "h2d_bytes": 0, "waits": 0}

    # -- memory -----------------------------------------------------------------
    def alloc(self, t, fill=None, persistent=False):
        device = self.devices[t.location]
        off, arr = device.alloc(t.shape, t.dtype, t.name)
        self.offsets[id(t)], self.arrays[id(t)] = off, arr
        if fill is not None:
            with device.active():       # on its own GPU's compute stream
                arr[...] = fill
        for bind in self.binders.get(id(t), ()):
            bind(arr)
        if not persistent:
            self.transient[id(t)] = t
        return arr

    def free(self, t):
        key = id(t)
        self._stream_wait(t.location, self.d2h.pop(key, None))
        self._stream_wait(t.location, self.h2d.pop(key, None))
        self.devices[t.location].free(self.offsets.pop(key))
        del self.arrays[key]
        self.transient.pop(key, None)
        home = self.home.get(key)
        for bind in self.binders.get(key, ()):
            bind(home)

    def host_home(self, t, disk=False):
        """Give ``t`` a permanent host block (a hosted parameter); its views point there between steps.
        ``disk``: the block is in the spill file (the host pool cannot hold the parameters): a
        mapped view between steps, and the copies read and write the file (_spill_in/_spill_out)."""
        if disk:
            home = self.home[id(t)] = self.disk_state(t.shape, t.dtype, t.name, t.location, key=id(t))
        else:
            off, raw = self.devices[t.location].host_alloc(max(t.nbytes, 1), t.name)
            raw = raw[:t.nbytes]
            raw[...] = 0
            self.host[id(t)] = (off, raw)
            home = self.home[id(t)] = raw.view(t.dtype).reshape(t.shape)
        for bind in self.binders.get(id(t), ()):
            bind(home)
        return home

    def disk_state(self, shape, dtype, name, location="", key=None):
        """A zeroed array kept in the spill file for the whole run (parameter state the host
        pool cannot hold); ``key``: the value the copies move (a hosted parameter's root)."""
        spill = spill_of(self.devices[location])
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        off = spill.alloc(max(nbytes, 1), name)
        if key is not None:
            self.disk[key] = (off, location)
            self.disk_homes.add(key)
        arr = spill.view(off, nbytes, dtype, shape)
        arr[...] = 0
        return arr

    def _wait(self, event):
        """The host waits (it is about to reuse memory the copy touches)."""
        if event is not None:
            if not event.query():
                self.stats["waits"] += 1
            event.wait()

    def _stream_wait(self, location, event):
        """Later compute on the device at ``location`` waits for ``event``; the host does not."""
        if event is not None:
            if not event.query():
                self.stats["waits"] += 1
            self.devices[location].wait_event(event)

    # -- instructions -----------------------------------------------------------
    def execute(self, instrs):
        for i in range(len(instrs)):
            self._apply(instrs, i)

    def _apply(self, instrs, i):
        """Run instruction ``i``; a memory error not of the plan's making names the step."""
        try:
            getattr(self, "_" + instrs[i].kind)(instrs[i])
        except MemoryError as e:     # the pool's OutOfMemory, or a library's (cuDNN, CuPy)
            if isinstance(e, MemoryExhausted):
                raise
            step = next((x.op.name for x in instrs[i:] if x.kind == "run"), "the end")
            raise MemoryExhausted(f"at step {step}: {e}; memory was taken outside the plan "
                                  f"(another net or buffer on this device?)") from None

    def _alloc(self, ins):
        self.alloc(ins.tensor, ins.fill)

    def _free(self, ins):
        self.free(ins.tensor)

    def _run(self, ins):
        op = ins.op
        node = op.node
        layer = getattr(node, "layer", None)
        location = layer.param.location if layer is not None else ""      # the op's device
        for r, write in op_tensors(op):
            self._stream_wait(location, self.h2d.pop(id(r), None))
            if write:
                self._stream_wait(location, self.d2h.pop(id(r), None))   # an offload still reading it
        ws = {k: self.arrays[id(t)] for k, t in workspace_names(ins).items()}
        device = self.devices[location]
        with device.active():           # the layer's own GPU, its stream and cuDNN handle
            if self.trace is None:
                self.run_op(op, ins.recompute, ws, ins.chunk)
                return
            t0 = time.perf_counter()
            self.run_op(op, ins.recompute, ws, ins.chunk)
            device.synchronize_compute()
        self.trace.append(("compute", op.name + (" (recompute)" if ins.recompute else ""), t0, time.perf_counter()))

    def traced(self, name, stream, event):
        """Record a copy (or any event-backed work) in the trace once it has finished."""
        if self.trace is not None:
            self._pending_trace.append((stream, name, event))

    def _offload(self, ins):
        value, dev = ins.tensor, ins.source or ins.tensor
        if ins.tier == "disk" or id(value) in self.disk:
            return self._spill_out(value, dev)
        if id(value) not in self.host:
            self.host[id(value)] = self.devices[dev.location].host_alloc(max(value.nbytes, 1), value.name)
            self.host_loc[id(value)] = dev.location
        event = self.devices[dev.location].copy_to_host(self.host[id(value)][1][:value.nbytes],
                                                        self.arrays[id(dev)])
        self.traced("offload " + value.name, "d2h", event)
        self.d2h[id(dev)] = event
        self.host_events.setdefault(id(value), []).append(event)
        self.stats["d2h_bytes"] += value.nbytes

    def _spill_out(self, value, dev, after=None):
        """Offload to the disk tier: the spill file written on the d2h stream (after ``after``)."""
        device = self.devices[dev.location]
        spill = spill_of(device)
        if id(value) not in self.disk:
            self.disk[id(value)] = (spill.alloc(value.nbytes, value.name), dev.location)
        off, array = self.disk[id(value)][0], self.arrays[id(dev)]

        def write():
            if after is not None:
                after.wait()                # the value's producer first
            spill.write(off, array)
        event = device.stream("d2h").submit(write)
        self.traced("offload " + value.name + " to disk", "d2h", event)
        self.d2h[id(dev)] = event
        self.host_events.setdefault(id(value), []).append(event)
        self.stats["d2h_bytes"] += value.nbytes
        return event

    def _spill_in(self, value, dev, after):
        device = self.devices[dev.location]
        spill, off, array = spill_of(device), self.disk[id(value)][0], self.arrays[id(dev)]

        def read():
            if after is not None:
                after.wait()                # the write of this value first
            spill.read(off, array)
        event = device.stream("h2d").submit(read)
        self.traced("prefetch " + value.name + " from disk", "h2d", event)
        self.h2d[id(dev)] = event
        self.host_events.setdefault(id(value), []).append(event)
        self.stats["h2d_bytes"] += value.nbytes
        return event

    def _prefetch(self, ins):
        value, dev = ins.tensor, ins.source or ins.tensor
        events = self.host_events.get(id(value), [])
        after = events[-1] if events else None
        if id(value) in self.disk:
            return self._spill_in(value, dev, after)
        event = self.devices[dev.location].copy_to_device(self.arrays[id(dev)],
                                                          self.host[id(value)][1][:value.nbytes], after)
        self.traced("prefetch " + value.name, "h2d", event)
        self.h2d[id(dev)] = event
        self.host_events.setdefault(id(value), []).append(event)
        self.stats["h2d_bytes"] += value.nbytes

    def _drop(self, ins):
        key = id(ins.tensor)
        for event in self.host_events.pop(key, []):
            self._wait(event)
        if key in self.disk:
            off, loc = self.disk.pop(key)
            spill_of(self.devices[loc]).free(off)
            return
        self.devices[self.host_loc.pop(key, "")].host_free(self.host.pop(key)[0])

    def _snapshot(self, ins):
        self._stream_wait(ins.tensor.location, self.h2d.pop(id(ins.tensor), None))
        device = self.devices[ins.tensor.location]
        with device.active():
            device.xp.copyto(self.arrays[id(ins.source)], self.arrays[id(ins.tensor)])

    def _restore(self, ins):
        device = self.devices[ins.tensor.location]
        with device.active():
            device.xp.copyto(self.arrays[id(ins.tensor)], self.arrays[id(ins.source)])

    def trace_events(self) -> list:
        """The recorded (stream, name, start, end) spans, copies included once they have finished."""
        for stream, name, event in self._pending_trace:
            event.wait()
            if event.start is not None:
                self.trace.append((stream, name, event.start, event.end))
        self._pending_trace = []
        return sorted(self.trace, key=lambda x: x[2])

    # -- iteration boundaries ---------------------------------------------------
    def reset(self):
        """Release everything a partial iteration left (a forward without its backward)."""
        for t in list(self.transient.values()):
            self.free(t)
        for key in list(self.host):
            for event in self.host_events.pop(key, []):
                self._wait(event)
            if key not in self.home:
                self.devices[self.host_loc.pop(key, "")].host_free(self.host.pop(key)[0])
        for key in list(self.disk):
            for event in self.host_events.pop(key, []):
                self._wait(event)
            if key in self.disk_homes:
                continue
            off, loc = self.disk.pop(key)
            spill_of(self.devices[loc]).free(off)

    @property
    def busy(self) -> bool:
        return bool(self.transient or len(self.host) + len(self.disk) > len(self.home))


# The executor nets use: the event-driven dispatcher built on the serial one above.
