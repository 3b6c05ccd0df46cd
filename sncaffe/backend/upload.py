"""Host-to-device copies of data the host produces each iteration (data batches, dropout masks).

From pageable memory a copy stops the host until the GPU has caught up and staged it; from
pinned memory it is asynchronous on the current stream. ``upload(out, host)`` copies through a
small ring of pinned buffers per GPU; the host waits only to refill a buffer whose previous
copy has not finished (several uploads back).
"""
from __future__ import annotations

import numpy as np

SLOTS = 4


class Staging:
    """The pinned ring of one GPU: each slot a pinned buffer (grown as needed) and the event of
    the copy that last read it."""

    def __init__(self, cp, slots=SLOTS):
        self._cp = cp
        self.slots = [[None, None] for _ in range(slots)]
        self.next = 0
        self.host_waits = 0

    def upload(self, out, host):
        cp = self._cp
        host = np.asarray(host)
        slot = self.slots[self.next]
        self.next = (self.next + 1) % len(self.slots)
        buf, event = slot
        if event is not None and not event.done:
            self.host_waits += 1
            event.synchronize()                 # the host is about to overwrite what it copies
        nbytes = out.nbytes
        if buf is None or buf.nbytes < nbytes:
            buf = np.frombuffer(cp.cuda.alloc_pinned_memory(max(nbytes, 1)), np.uint8)
        view = buf[:nbytes].view(out.dtype).reshape(out.shape)
        np.copyto(view, host, casting="unsafe")
        out.set(view)                           # pinned: asynchronous on the current stream
        event = cp.cuda.Event(disable_timing=True)
        event.record()
        slot[:] = buf, event


_rings: dict = {}


def upload(out, host) -> None:
    """out (a device array, C-contiguous) = host (NumPy, cast to out's dtype), asynchronously."""
    import sys
    cp = sys.modules.get("cupy")
    if not hasattr(cp, "cuda"):                 # arrays that only pass for CuPy's (the emulation)
        out.set(np.ascontiguousarray(np.broadcast_to(host, out.shape), out.dtype))
        return
    key = cp.cuda.Device().id
    ring = _rings.get(key)
    if ring is None:
        ring = _rings[key] = Staging(cp)
    ring.upload(out, host)
