"""backend/upload.py: host data reaches the device through a ring of pinned buffers; the host
waits only to refill a buffer whose copy is still in flight. A CuPy stand-in records the copies."""
import types

import numpy as np

from sncaffe.backend.upload import Staging, upload


class Event:
    def __init__(self, disable_timing=True):
        self.done, self.waited = False, False

    def record(self, stream=None):
        pass

    def synchronize(self):
        self.waited, self.done = True, True


class DeviceArray(np.ndarray):
    """Takes ``set`` as CuPy does; remembers the buffers it was set from."""
    def set(self, host):
        assert host.flags.c_contiguous and host.dtype == self.dtype
        self.sources.append(host)
        self[...] = host


def device_array(shape, dtype):
    a = np.zeros(shape, dtype).view(DeviceArray)
    a.sources = []
    return a


def fake_cupy(pinned):
    def alloc_pinned_memory(n):
        buf = bytearray(n)
        pinned.append(buf)
        return buf
    return types.SimpleNamespace(cuda=types.SimpleNamespace(Event=Event, alloc_pinned_memory=alloc_pinned_memory))


def test_uploads_go_through_pinned_buffers_reused_round_robin():
    pinned = []
    ring = Staging(fake_cupy(pinned), slots=2)
    out = device_array((3, 4), np.float32)
    for k in range(5):
        host = np.full((3, 4), k, np.float64)           # cast to the device dtype on the way
        ring.upload(out, host)
        assert (out == k).all()
    assert len(pinned) == 2                             # one buffer per slot, then reused
    assert all(np.shares_memory(s, np.frombuffer(pinned[i % 2], np.uint8)) for i, s in enumerate(out.sources))
    assert ring.host_waits == 3                         # each refill waited for the slot's previous copy


def test_a_finished_copy_costs_no_wait():
    ring = Staging(fake_cupy([]), slots=2)
    out = device_array((8,), np.bool_)
    for _ in range(4):
        ring.upload(out, np.ones(8, bool))
        for slot in ring.slots:
            if slot[1] is not None:
                slot[1].done = True                     # the GPU kept up
    assert ring.host_waits == 0


def test_without_cuda_it_is_a_plain_set(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "cupy", None)
    out = device_array((2, 2), np.float32)
    upload(out, [[1, 2], [3, 4]])
    assert out.tolist() == [[1, 2], [3, 4]] and len(out.sources) == 1
