"""The circuit breaker's written-down semantics, checked exactly with a fake clock."""

from __future__ import annotations

import itertools
import logging
import random
import sys
import threading
from collections.abc import Callable
from typing import Any

import pytest
from pydantic import ValidationError

from riskserve.platform.breaker import (
    BreakerSettings,
    BreakerState,
    CircuitBreaker,
    Permit,
)

CLOSED, OPEN, HALF_OPEN = BreakerState.CLOSED, BreakerState.OPEN, BreakerState.HALF_OPEN
FAST = 0.010
"""A call duration well below the 250 ms slow-call limit of these tests."""
SLOW = 0.300
"""A call duration above it."""


class FakeClock:
    """A clock whose time (seconds) the test sets."""

    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def make(
    clock: FakeClock | None = None,
    on_transition: Callable[[BreakerState, BreakerState], None] | None = None,
    **overrides: Any,
) -> CircuitBreaker:
    values: dict[str, Any] = {"slow_call_ms": 250.0, **overrides}
    return CircuitBreaker(
        BreakerSettings(**values), clock=clock or FakeClock(), name="fraud", on_transition=on_transition
    )


def acquire(breaker: CircuitBreaker) -> Permit:
    permit = breaker.try_acquire()
    assert permit is not None, f"rejected in {breaker.state}"
    return permit


def record(breaker: CircuitBreaker, *outcomes: str) -> None:
    """Run one call per outcome: ``ok``, ``fail``, ``slow`` (slow success), ``slowfail``, ``ignore``."""
    for outcome in outcomes:
        permit = acquire(breaker)
        if outcome == "ok":
            permit.success(FAST)
        elif outcome == "slow":
            permit.success(SLOW)
        elif outcome == "fail":
            permit.failure(FAST)
        elif outcome == "slowfail":
            permit.failure(SLOW)
        else:
            assert outcome == "ignore"
            permit.ignore()


def trip(breaker: CircuitBreaker) -> None:
    """Open a breaker with default-like settings (minimum_calls failures in a row)."""
    record(breaker, *["fail"] * breaker.settings.minimum_calls)
    assert breaker.state is OPEN


# -- settings --


def test_settings_defaults_and_strictness() -> None:
    settings = BreakerSettings(slow_call_ms=80)
    assert (settings.window_size, settings.minimum_calls, settings.half_open_probes) == (20, 10, 3)
    assert (settings.failure_rate_threshold, settings.slow_call_rate_threshold) == (0.5, 0.8)
    assert settings.open_ms == 5000
    with pytest.raises(ValidationError):
        BreakerSettings()  # type: ignore[call-arg]  # slow_call_ms is the model's budget: required
    with pytest.raises(ValidationError, match="extra"):
        BreakerSettings(slow_call_ms=80, window=5)  # type: ignore[call-arg]
    with pytest.raises(ValidationError, match="frozen"):
        settings.window_size = 5  # type: ignore[misc]


@pytest.mark.parametrize(
    "bad",
    [
        {"minimum_calls": 21},
        {"window_size": 0},
        {"failure_rate_threshold": 0},
        {"failure_rate_threshold": 1.01},
        {"slow_call_rate_threshold": 0},
        {"slow_call_ms": 0},
        {"slow_call_ms": float("inf")},
        {"open_ms": 0},
        {"half_open_probes": 0},
    ],
)
def test_settings_refuse_values_that_cannot_work(bad: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        BreakerSettings(**{"slow_call_ms": 80, **bad})


# -- CLOSED: judging the window --


def test_closed_stays_closed_below_minimum_calls_even_at_full_failure() -> None:
    breaker = make()
    record(breaker, *["fail"] * 9)
    snap = breaker.snapshot()
    assert (snap.state, snap.calls, snap.failure_rate) == (CLOSED, 9, 1.0)


def test_opens_exactly_at_the_failure_threshold_and_not_one_call_before() -> None:
    breaker = make()
    record(breaker, *["ok"] * 5, *["fail"] * 4)
    assert breaker.state is CLOSED  # 4 of 9, and below minimum_calls anyway
    record(breaker, "fail")  # 5 of 10 = 0.5
    assert breaker.state is OPEN


def test_opens_at_the_threshold_once_the_window_is_past_minimum_calls() -> None:
    breaker = make()
    record(breaker, *["ok"] * 10, *["fail"] * 9)
    snap = breaker.snapshot()
    assert (snap.state, snap.calls, snap.failure_rate) == (CLOSED, 19, 9 / 19)
    record(breaker, "fail")  # 10 of 20
    assert breaker.state is OPEN


def test_slow_calls_open_via_the_slow_call_rate() -> None:
    breaker = make()
    record(breaker, "ok", "ok", *["slow"] * 7)
    assert breaker.state is CLOSED
    record(breaker, "slow")  # 8 of 10 slow = 0.8; no failure at all
    assert breaker.state is OPEN


def test_a_call_is_slow_only_when_longer_than_slow_call_ms() -> None:
    breaker = make()
    for _ in range(10):
        acquire(breaker).success(0.25)  # exactly the limit: not slow
    assert breaker.snapshot().slow_call_rate == 0.0
    assert breaker.state is CLOSED


def test_a_slow_failure_counts_in_both_rates() -> None:
    breaker = make(failure_rate_threshold=1.0, slow_call_rate_threshold=1.0)
    record(breaker, "ok", "slowfail", "fail", "slow")
    snap = breaker.snapshot()
    assert (snap.failure_rate, snap.slow_call_rate) == (0.5, 0.5)


def test_the_sliding_window_forgets_old_outcomes() -> None:
    breaker = make(window_size=10, minimum_calls=10)
    record(breaker, *["fail"] * 4, *["ok"] * 6)
    assert breaker.snapshot().failure_rate == 0.4
    record(breaker, *["ok"] * 4)  # pushes the four failures out
    snap = breaker.snapshot()
    assert (snap.calls, snap.failure_rate) == (10, 0.0)
    record(breaker, *["fail"] * 4)
    assert breaker.snapshot().failure_rate == 0.4
    assert breaker.state is CLOSED  # 8 failures in all, but only 4 in the window
    record(breaker, "fail")
    assert breaker.state is OPEN


def test_opening_clears_the_window() -> None:
    breaker = make()
    trip(breaker)
    snap = breaker.snapshot()
    assert (snap.calls, snap.failure_rate, snap.slow_call_rate) == (0, 0.0, 0.0)


# -- OPEN and HALF_OPEN --


def test_open_rejects_until_open_ms_has_elapsed_then_is_half_open() -> None:
    clock = FakeClock(100.0)
    breaker = make(clock)
    trip(breaker)
    assert breaker.snapshot().state_entered_at == 100.0
    clock.now = 104.999
    assert breaker.try_acquire() is None
    assert breaker.state is OPEN
    clock.now = 105.0
    assert breaker.state is HALF_OPEN
    assert breaker.snapshot().state_entered_at == 105.0


def test_half_open_is_dated_when_the_open_time_ended_even_if_seen_later() -> None:
    clock = FakeClock(100.0)
    breaker = make(clock)
    trip(breaker)
    clock.now = 160.0
    snap = breaker.snapshot()
    assert (snap.state, snap.state_entered_at) == (HALF_OPEN, 105.0)


def test_half_open_admits_exactly_half_open_probes_and_rejects_the_next() -> None:
    clock = FakeClock()
    breaker = make(clock)
    trip(breaker)
    clock.now += 5
    probes = [breaker.try_acquire() for _ in range(3)]
    assert all(p is not None and p.state is HALF_OPEN for p in probes)
    assert breaker.try_acquire() is None
    assert breaker.state is HALF_OPEN


def test_all_probes_succeeding_closes_it_with_a_fresh_window() -> None:
    clock = FakeClock()
    breaker = make(clock)
    trip(breaker)
    clock.now += 5
    probes = [acquire(breaker) for _ in range(3)]
    probes[0].success(FAST)
    probes[1].success(FAST)
    assert breaker.state is HALF_OPEN
    probes[2].success(FAST)
    snap = breaker.snapshot()
    assert (snap.state, snap.calls, snap.state_entered_at) == (CLOSED, 0, 105.0)
    assert acquire(breaker).state is CLOSED


@pytest.mark.parametrize("bad", ["fail", "slow"])
def test_one_bad_probe_reopens_at_once_and_restarts_the_open_timer(bad: str) -> None:
    clock = FakeClock(100.0)
    breaker = make(clock)
    trip(breaker)
    clock.now = 105.0
    probes = [acquire(breaker) for _ in range(3)]
    probes[0].success(FAST)
    clock.now = 106.0
    if bad == "fail":
        probes[1].failure(FAST)
    else:
        probes[1].success(SLOW)
    snap = breaker.snapshot()
    assert (snap.state, snap.state_entered_at) == (OPEN, 106.0)
    clock.now = 110.999
    assert breaker.try_acquire() is None
    clock.now = 111.0
    assert breaker.state is HALF_OPEN


# -- ignored outcomes --


def test_ignored_client_errors_never_change_the_rates() -> None:
    breaker = make()
    record(breaker, *["fail"] * 4, *["ignore"] * 50, *["ok"] * 4)
    snap = breaker.snapshot()
    assert (snap.state, snap.calls, snap.failure_rate) == (CLOSED, 8, 0.5)


def test_an_ignored_probe_gives_its_slot_back_without_counting_as_passed() -> None:
    clock = FakeClock()
    breaker = make(clock)
    trip(breaker)
    clock.now += 5
    probes = [acquire(breaker) for _ in range(3)]
    assert breaker.try_acquire() is None
    probes[0].ignore()
    replacement = acquire(breaker)
    assert breaker.try_acquire() is None
    probes[1].success(FAST)
    probes[2].success(FAST)
    assert breaker.state is HALF_OPEN  # the ignored probe did not pass
    replacement.success(FAST)
    assert breaker.state is CLOSED


# -- reporting --


def test_transitions_are_reported_in_order_and_the_callback_may_read_the_breaker() -> None:
    clock = FakeClock()
    seen: list[tuple[BreakerState, BreakerState, BreakerState]] = []
    breaker: CircuitBreaker

    def on_transition(old: BreakerState, new: BreakerState) -> None:
        seen.append((old, new, breaker.snapshot().state))  # re-entrant read under the breaker's lock

    breaker = make(clock, on_transition=on_transition)
    trip(breaker)
    clock.now += 5
    acquire(breaker).failure(FAST)
    clock.now += 5
    for probe in [acquire(breaker) for _ in range(3)]:
        probe.success(FAST)
    assert seen == [
        (CLOSED, OPEN, OPEN),
        (OPEN, HALF_OPEN, HALF_OPEN),
        (HALF_OPEN, OPEN, OPEN),
        (OPEN, HALF_OPEN, HALF_OPEN),
        (HALF_OPEN, CLOSED, CLOSED),
    ]


def test_a_failing_transition_callback_is_logged_not_raised(caplog: pytest.LogCaptureFixture) -> None:
    def broken(old: BreakerState, new: BreakerState) -> None:
        raise ValueError("metrics backend down")

    breaker = make(on_transition=broken)
    with caplog.at_level(logging.ERROR, logger="riskserve.platform.breaker"):
        trip(breaker)
    assert breaker.state is OPEN
    assert "fraud" in caplog.text
    assert "metrics backend down" in caplog.text


# -- permits --


@pytest.mark.parametrize("first", ["success", "failure", "ignore"])
@pytest.mark.parametrize("second", ["success", "failure", "ignore"])
def test_a_permit_resolved_twice_raises(first: str, second: str) -> None:
    breaker = make()
    permit = acquire(breaker)

    def resolve(how: str) -> None:
        if how == "ignore":
            permit.ignore()
        else:
            getattr(permit, how)(FAST)

    resolve(first)
    assert permit.resolved
    with pytest.raises(RuntimeError, match="resolved twice"):
        resolve(second)
    assert breaker.snapshot().calls == (0 if first == "ignore" else 1)


@pytest.mark.parametrize("duration", [-0.001, float("nan")])
def test_a_bad_duration_is_refused_and_leaves_the_permit_open(duration: float) -> None:
    breaker = make()
    permit = acquire(breaker)
    with pytest.raises(ValueError, match="duration"):
        permit.success(duration)
    assert not permit.resolved
    permit.success(FAST)
    assert breaker.snapshot().calls == 1


def test_stale_half_open_probes_neither_close_nor_count_as_probes() -> None:
    clock = FakeClock()
    breaker = make(clock)
    trip(breaker)
    clock.now += 5
    a, b, c = (acquire(breaker) for _ in range(3))
    a.failure(FAST)  # re-opens; b and c are now stale
    b.success(FAST)
    assert breaker.state is OPEN
    clock.now += 5
    d, e, f = (acquire(breaker) for _ in range(3))
    c.success(FAST)  # stale: does not count as one of the new round's probes
    assert breaker.try_acquire() is None
    d.success(FAST)
    e.success(FAST)
    assert breaker.state is HALF_OPEN
    f.success(FAST)
    assert breaker.state is CLOSED


def test_a_permit_from_an_earlier_closed_period_does_not_count_in_the_new_window() -> None:
    clock = FakeClock()
    breaker = make(clock, half_open_probes=2)
    old = acquire(breaker)  # a slow call that outlives open -> half-open -> closed
    trip(breaker)
    clock.now += 5
    for probe in [acquire(breaker), acquire(breaker)]:
        probe.success(FAST)
    assert breaker.state is CLOSED
    old.failure(SLOW)
    snap = breaker.snapshot()
    assert (snap.state, snap.calls) == (CLOSED, 0)


def test_a_closed_permit_completing_in_half_open_is_dropped() -> None:
    clock = FakeClock()
    breaker = make(clock)
    slow_call = acquire(breaker)
    trip(breaker)
    clock.now += 5
    probes = [acquire(breaker) for _ in range(3)]
    slow_call.failure(SLOW)  # old evidence: must not re-open the half-open breaker
    assert breaker.state is HALF_OPEN
    for probe in probes:
        probe.success(FAST)
    assert breaker.state is CLOSED


# -- threads --


def _check_invariants(breaker: CircuitBreaker) -> None:
    """Internal consistency, read under the breaker's own lock."""
    with breaker._lock:
        settings = breaker.settings
        window = list(breaker._window)
        assert len(window) <= settings.window_size
        assert breaker._failures == sum(failed for failed, _ in window)
        assert breaker._slow == sum(slow for _, slow in window)
        assert 0 <= breaker._probes_passed <= breaker._probes_granted <= settings.half_open_probes
        if breaker._state is not CLOSED:
            assert window == []
        if breaker._state is not HALF_OPEN:
            assert breaker._probes_granted == 0


def test_thread_safety_smoke() -> None:
    ticks = itertools.count()

    def clock() -> float:
        return next(ticks) * 0.001  # every reading advances 1 ms: monotonic, and atomic under the GIL

    transitions: list[tuple[BreakerState, BreakerState]] = []
    settings = BreakerSettings(
        window_size=10, minimum_calls=5, slow_call_ms=100, open_ms=3, half_open_probes=2
    )
    breaker = CircuitBreaker(
        settings, clock=clock, name="storm", on_transition=lambda old, new: transitions.append((old, new))
    )
    failures: list[BaseException] = []
    granted = [0]
    count_lock = threading.Lock()

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(1500):
                permit = breaker.try_acquire()
                snap = breaker.snapshot()
                assert 0 <= snap.calls <= settings.window_size
                assert 0.0 <= snap.failure_rate <= 1.0
                assert 0.0 <= snap.slow_call_rate <= 1.0
                _check_invariants(breaker)
                if permit is None:
                    continue
                with count_lock:
                    granted[0] += 1
                roll = rng.random()
                if roll < 0.3:
                    permit.failure(0.01)
                elif roll < 0.4:
                    permit.ignore()
                elif roll < 0.5:
                    permit.success(0.2)
                else:
                    permit.success(0.01)
                with pytest.raises(RuntimeError):
                    permit.success(0.01)
        except BaseException as error:
            failures.append(error)

    previous = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(6)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(previous)

    assert failures == []
    assert granted[0] > 0
    allowed = {(CLOSED, OPEN), (OPEN, HALF_OPEN), (HALF_OPEN, OPEN), (HALF_OPEN, CLOSED)}
    assert set(transitions) <= allowed
    assert {(CLOSED, OPEN), (OPEN, HALF_OPEN), (HALF_OPEN, CLOSED)} <= set(transitions)
    assert transitions[0][0] is CLOSED
    for (_, reached), (left, _) in itertools.pairwise(transitions):
        assert reached is left
    _check_invariants(breaker)

    # Nothing is in flight now, so no probe slot may have leaked: good probes must close it.
    for _ in range(10_000):
        state = breaker.state
        if state is CLOSED:
            break
        if state is HALF_OPEN:
            permit = breaker.try_acquire()
            assert permit is not None, "a half-open probe slot leaked"
            permit.success(0.0)
    assert breaker.state is CLOSED
