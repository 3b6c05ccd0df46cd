"""An operator in parts: a layer may split one operator of the plan into several, with operators
of other locations between them (cross-replica BatchNorm: per-image sums, their exchange over the
replicas on a comm stream, then normalization; parallel/sync_bn.py).

The dispatcher asks ``layer.split_op(kind, recompute)`` for each operator it runs; None keeps the
operator whole, else it issues the ``Part``s in order, each an operator of its own on its
stream. A part that ``touches`` the operator's tensors waits for their events and becomes their
writer, as the operator would; one that does not (an exchange) waits only for ``after``. A part
may wait for an operator that is issued later (the exchange after the last replica's sums): a
``Later`` stands for its event until it is bound.

The parts of an operator must be the same from one pass to the next while ``split_op`` is the
same object: the dispatcher may replay an earlier pass's parts without asking again
(runtime/dispatcher.py, ``_Recording``). What must happen on every pass goes in a part's ``arm``,
which runs on its stream just before it.
"""
from __future__ import annotations

from _thread import allocate_lock
from dataclasses import dataclass

BIND_TIMEOUT = 600.0        # seconds a part waits for an operator that is never issued (an error before it)


@dataclass(eq=False)
class Part:
    name: str | None = None         # None: the operator's own name
    fn: object = None               # None: the operator itself (its layer's forward or backward)
    stream: str = "compute"         # (the operator itself: its own)
    location: str | None = None     # None: the operator's
    after: object = ()              # events it waits for besides its tensors' (read when it is issued)
    touches: bool = True            # the operator's tensors: bound before fn, their events its own;
    #                                 False: asynchronous, even where the operators run on the calling
    #                                 thread, unless on the ``compute`` stream (then it runs there too)
    issued: object = None           # callable(event), once it is issued
    arm: object = None              # callable() run on the part's stream just before it (its fn None:
    #                                 before the operator), every pass, replayed ones included


def armed(fn, arm):
    """``fn`` preceded by ``arm`` (a Part's), or ``fn`` itself where there is none."""
    if arm is None:
        return fn

    def run():
        arm()
        fn()
    return run


class Later:
    """The event of an operator not issued yet: fires when the event bound to it (``bind``) does."""

    def __init__(self, what: str):
        self.what, self.event = what, None
        self._unbound = allocate_lock()         # held until bound (a threading.Event builds a
        self._unbound.acquire()                 # Condition: the dispatcher makes several per layer)

    def bind(self, event) -> None:
        if self.event is None:
            self.event = event
            self._unbound.release()

    @property
    def error(self):
        return None if self.event is None else self.event.error

    def query(self) -> bool:
        return self.event is not None and self.event.query()

    def wait(self, timeout=None):
        if self.event is None:
            if not self._unbound.acquire(timeout=BIND_TIMEOUT if timeout is None else timeout):
                raise TimeoutError(f"{self.what} was never issued (an error before it?)")
            self._unbound.release()             # the next waiter passes too
        self.event.wait(timeout)
