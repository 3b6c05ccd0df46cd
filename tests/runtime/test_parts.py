"""``Later``: the event of an operator issued after the one waiting for it (runtime/parts.py)."""
import pytest

from sncaffe.runtime.parts import Later
from sncaffe.runtime.streams import Stream


def test_a_later_event_fires_with_the_event_bound_to_it_and_passes_its_error_on():
    later, order = Later("the exchange"), []
    waiting = Stream("waiting").submit(lambda: order.append("after"), [later])   # issued first
    assert not later.query()
    work = Stream("work").submit(lambda: order.append("exchange"))
    later.bind(work)
    waiting.wait(10)
    assert order == ["exchange", "after"] and later.query()

    failing, later = Stream("failing").submit(lambda: 1 / 0), Later("the exchange")
    later.bind(failing)
    with pytest.raises(ZeroDivisionError):
        Stream("next").submit(lambda: None, [later]).wait(10)
    assert isinstance(later.error, ZeroDivisionError)


def test_a_later_event_never_bound_says_what_was_never_issued():
    with pytest.raises(TimeoutError, match="the exchange of bn1's batch sums was never issued"):
        Later("the exchange of bn1's batch sums").wait(0.01)
