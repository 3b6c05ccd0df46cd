"""Streams and events on the CPU device: in-order worker threads, events that carry errors."""
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from sncaffe.backend import CPUDevice
from sncaffe.runtime.streams import Event, Stream


def test_work_runs_in_order_on_the_stream_thread():
    stream = Stream("test")
    done, threads = [], set()

    def work(i):
        done.append(i)
        threads.add(threading.current_thread().name)
    events = [stream.submit(lambda i=i: work(i)) for i in range(200)]
    stream.synchronize()
    assert done == list(range(200))
    assert threads == {"sncaffe-test"} and threading.current_thread().name not in threads
    assert all(e.query() for e in events)
    starts = [e.start for e in events]
    assert starts == sorted(starts) and all(e.start <= e.end for e in events)


def test_event_fires_only_when_its_work_is_done():
    stream, gate = Stream("gated"), threading.Event()
    first = stream.submit(gate.wait)
    second = stream.submit(lambda: None)
    assert not first.query() and not second.query()      # in order: the second waits for the first
    gate.set()
    second.wait()
    assert first.query() and second.query()


def test_streams_run_concurrently():
    a, b, gate = Stream("a"), Stream("b"), threading.Event()
    blocked = a.submit(gate.wait)
    b.submit(lambda: None).wait()                          # b is not held up by a
    assert not blocked.query()
    gate.set()
    blocked.wait()


def test_exception_propagates_to_wait_and_stream_goes_on():
    stream = Stream("err")

    def boom():
        raise ValueError("copy failed")
    bad = stream.submit(boom)
    good = stream.submit(lambda: None)
    with pytest.raises(ValueError, match="copy failed"):
        bad.wait()
    good.wait()                                            # the worker survived
    assert bad.error is not None and good.error is None and bad.end is not None


def test_fresh_event_and_empty_synchronize():
    e = Event()
    assert not e.query() and e.start is None
    e.set()
    e.wait()
    Stream("idle").synchronize()                          # nothing submitted: returns at once


def test_device_copies_run_on_copy_streams_in_dependency_order():
    device = CPUDevice("1MiB", host_capacity="1MiB")
    src = np.arange(1000, dtype=np.float32)
    off, host = device.host_alloc(src.nbytes)
    _, dst = device.alloc(src.shape, src.dtype)
    gate = threading.Event()
    device.stream("d2h").submit(gate.wait)                # hold the d2h stream
    out = device.copy_to_host(host, src)
    back = device.copy_to_device(dst, host, after=out)    # h2d waits for the d2h event
    assert not out.query() and not back.query()
    gate.set()
    back.wait()
    assert out.query() and np.array_equal(dst, src)
    assert {s._thread.name for s in device._streams.values()} == {"sncaffe-d2h", "sncaffe-h2d"}
    device.synchronize()
    device.host_free(off)
    assert device.host_pool.in_use == 0


def test_queued_work_finishes_before_the_interpreter_exits(tmp_path):
    """A copy still queued when the main thread ends runs to its end before the interpreter frees
    anything: a daemon stream thread cut off at exit (or still writing after it) corrupts memory."""
    out = tmp_path / "done"
    code = ("import time, numpy as np\n"
            "from sncaffe.runtime.streams import Stream\n"
            "s = Stream('d2h')\n"
            "a = np.ones(1 << 20)\n"
            f"s.submit(lambda: (time.sleep(0.5), np.save({str(out)!r}, a * 2)))\n")   # main exits at once
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    assert np.load(str(out) + ".npy").sum() == 2 * (1 << 20)


def test_a_closed_stream_runs_what_was_queued_and_ends():
    s = Stream("h2d")
    seen = []
    s.submit(lambda: (time.sleep(0.05), seen.append(1)))
    assert s.close(timeout=10)
    assert seen == [1]


def test_a_spill_file_closed_stops_its_trimmer(tmp_path):
    from sncaffe.runtime.spill import SpillFile
    spill = SpillFile(tmp_path)
    off = spill.alloc(4096)
    spill.view(off, 4096, np.uint8, (4096,))[:] = 7
    trimmer = spill._trimmer
    assert trimmer.is_alive()
    spill.close()
    assert not trimmer.is_alive()
