"""The dispatcher's cheap parts: lock-based events, the GIL switch interval while operators run
concurrently, and freed blocks found by bisection (each reuse still waits for the work on them)."""
import sys
import threading


from sncaffe.runtime.dispatcher import SWITCH_INTERVAL
from sncaffe.runtime.streams import Event, Stream
from sncaffe.parallel.replicas import Replicas, replicate

from test_replicas import LOCATIONS, make_solver, net_param


def test_an_event_wakes_every_waiter_and_passes_its_error_to_each():
    e, woke = Event(), []
    waiters = [threading.Thread(target=lambda: (e.wait(), woke.append(1))) for _ in range(3)]
    for w in waiters:
        w.start()
    e.set()
    e.set()                                  # a second set changes nothing
    for w in waiters:
        w.join(10)
    assert woke == [1, 1, 1] and e.query()
    failed = Stream("fails").submit(lambda: 1 / 0)
    for _ in range(2):                       # every waiter sees the error, not only the first
        try:
            failed.wait(10)
        except ZeroDivisionError:
            pass
        else:
            raise AssertionError("the work's error was not raised")


def test_operators_run_under_a_short_switch_interval_and_it_is_restored():
    solver = make_solver(replicate(net_param(), LOCATIONS))
    replicas = Replicas(solver)
    seen, before = [], sys.getswitchinterval()
    solver.net.step_hook = lambda op, recompute: seen.append(sys.getswitchinterval())
    solver.step(2)
    replicas.close()
    assert seen and max(seen) <= SWITCH_INTERVAL < before
    assert sys.getswitchinterval() == before


def test_a_block_reused_while_its_readers_run_waits_for_them():
    """Readers of a freed block, still running, become dependencies of whatever is allocated over
    it, found among many pending blocks; a tensor covering the block carries them on."""
    solver = make_solver(replicate(net_param(), LOCATIONS))
    ex = solver.net.executor
    gate = threading.Event()
    slow = ex.stream("cpu:0", "compute").submit(gate.wait)      # work still reading the blocks
    ex._freed["cpu:0"] = [(off, off + 64, [slow]) for off in range(0, 64 * 200, 64)]
    ex._longest["cpu:0"] = 64
    assert ex._reused("cpu:0", 64 * 10 + 8, 100) == [slow, slow]        # blocks 10 and 11 overlap it
    assert ex._reused("cpu:0", 64 * 50, 64) == [slow]                   # covers block 50: carried on
    assert all(start != 64 * 50 for start, _, _ in ex._freed["cpu:0"])
    assert ex._reused("cpu:0", 64 * 300, 64) == []
    gate.set()
    slow.wait(10)
    assert ex._reused("cpu:0", 64 * 10, 64) == []                       # done: nothing to wait for
