"""kvblock._core.CallClock / TimedCall: the call timer the vLLM scheduler bench times the KV
cache manager with (benches/vllm_sched.py). It must pass calls through unchanged, time only
outermost calls, and split results into "nothing" (None or the given empty object) and the rest.

The timers are built only with the ``bench-timers`` cargo feature (``make bench`` builds so and
runs this file; the wheel and ``make install`` leave them out): elsewhere this file skips."""

from __future__ import annotations

import time

import pytest

from kvblock import _core

if not _core.BENCH_TIMERS:
    pytest.skip("kvblock._core is built without the bench-timers cargo feature (make bench builds it with)",
                allow_module_level=True)

CallClock = _core.CallClock


def test_calls_pass_through_with_positional_and_keyword_arguments():
    clock = CallClock()

    def f(a, b=2, *, k=3):
        return (a, b, k)

    t = clock.wrap(f)
    assert t(1) == (1, 2, 3)
    assert t(1, 5, k=9) == (1, 5, 9)
    assert t(a=4, k=0) == (4, 2, 0)
    assert clock.calls == 3
    assert t.func is f
    with pytest.raises(TypeError):
        t(1, 2, 3)  # f's own error
    assert clock.calls == 4  # a call that raised is timed too, as "nothing"
    assert t.totals()[0][1] == 1 and t.totals()[1][1] == 3


def test_time_inside_the_call_is_counted():
    clock = CallClock()
    t = clock.wrap(time.sleep)
    t(0.02)
    assert clock.ns >= 20_000_000
    (ns0, n0), (ns1, n1) = t.totals()
    assert (n0, n1) == (1, 0) and ns0 == clock.ns  # sleep returns None: bucket 0


def test_nested_timed_calls_are_not_counted_twice():
    clock = CallClock()
    inner = clock.wrap(lambda: time.sleep(0.01) or 1)
    outer = clock.wrap(lambda: inner() + 1)
    assert outer() == 2
    assert clock.calls == 1
    assert inner.totals() == ((0, 0), (0, 0))
    assert outer.totals()[1][1] == 1 and outer.totals()[1][0] >= 10_000_000
    assert inner() == 1  # on its own it is timed
    assert clock.calls == 2 and inner.totals()[1][1] == 1


def test_results_are_split_by_the_empty_object():
    clock = CallClock()
    empty = object()
    t = clock.wrap(lambda x: empty if x == 0 else (None if x == 1 else x), empty)
    assert t(0) is empty and t(1) is None and t(2) == 2
    assert t.totals()[0][1] == 2 and t.totals()[1][1] == 1


def test_refuses_what_it_cannot_call_and_measures_its_own_clock():
    clock = CallClock()
    with pytest.raises(TypeError, match="callable"):
        clock.wrap(3)
    overhead = clock.overhead_ns(1000)
    assert isinstance(overhead, int) and 0 <= overhead < 1_000_000


def test_a_cycle_through_a_timed_call_is_collected():
    import gc
    import weakref

    class Holder:
        pass

    clock = CallClock()
    h = Holder()
    h.timed = clock.wrap(lambda: h)  # h -> TimedCall -> lambda -> h
    alive = weakref.ref(h)
    del h
    gc.collect()
    assert alive() is None
