"""A per-model circuit breaker with written-down semantics, modelled on Resilience4j's CircuitBreaker.

A model that keeps failing or answering too slowly should stop receiving traffic for a while, so the
pipeline answers with the model's fallback at once instead of waiting out its timeout on every request,
and the model gets room to recover. The breaker judges a model by the outcomes of its last calls and
says, before each call, whether that call may go through.

States and transitions (every transition is reported to ``on_transition(old, new)``)::

                  +--------+  the window holds >= minimum_calls and         +------+
       start ---> | CLOSED | --- failure rate >= failure_rate_threshold --> | OPEN | <------------+
                  +--------+     or slow rate >= slow_call_rate_threshold   +------+              |
                       ^         (window cleared)                             |                   |
                       |                                                      | open_ms elapsed   |
                       |                                                      | (seen lazily on   |
                       | all half_open_probes probes succeed, none slow       v  the next look)   |
                       | (window cleared)                               +-----------+             |
                       +----------------------------------------------- | HALF_OPEN | ------------+
                                                                        +-----------+  any probe fails
                                                                                       or is slow (the
                                                                                       open timer restarts)

CLOSED
    Every call is let through. Outcomes go into a count-based sliding window of the last
    ``window_size`` *recorded* outcomes (in the order they complete). After each recorded outcome,
    once the window holds at least ``minimum_calls`` outcomes, the breaker opens if
    ``failures / calls >= failure_rate_threshold`` or ``slow / calls >= slow_call_rate_threshold``.
    A call is slow when it took longer than ``slow_call_ms`` (strictly); a slow failure counts in both
    rates, as in Resilience4j. A timeout is a failure.
OPEN
    Every call is rejected (:meth:`CircuitBreaker.try_acquire` returns ``None``). Once ``open_ms`` have
    elapsed on the injected clock the breaker is HALF_OPEN; there is no timer thread, the change happens
    on the next ``try_acquire``, ``state`` or ``snapshot`` and is dated at the moment the open time ended.
HALF_OPEN
    Exactly ``half_open_probes`` calls are let through; further calls are rejected as if open while
    those probes are in flight. The breaker closes when all of them succeed without being slow, and
    re-opens (restarting the open timer) the moment one fails or is slow; the other probes still in
    flight then become stale (below).

Outcomes are recorded through the :class:`Permit` that ``try_acquire`` returned: ``success(duration_s)``,
``failure(duration_s)`` or ``ignore()``. ``ignore`` is for calls that say nothing about the model's
health, such as client errors (INVALID_ARGUMENT) and cancellations: it never changes the rates, and in
HALF_OPEN it gives the probe slot back so another call can probe. Every permit must be resolved exactly
once: an unresolved half-open probe holds its slot for good, and resolving a permit twice raises
``RuntimeError`` (a bug in the caller). The pipeline's guarded call
(:mod:`riskserve.serving.guarded_call`) resolves its permit on every path.

Stale permits. Each transition starts a new *generation*; a permit belongs to the generation it was granted
in. An outcome resolved after its generation ended (a slow call that completes after the breaker opened,
or a half-open probe that completes after another probe already re-opened or closed the breaker) is
dropped: it was granted under a judgement that has since been made, and it must neither count in the
fresh window of a later CLOSED state nor be taken for a probe of a later HALF_OPEN state. Resilience4j
records such late outcomes in whatever state is current; we deliberately do not, so a stale probe can
never close the breaker and a stale failure can never re-open it. Opening and closing both clear the
window, so each CLOSED period is judged only on its own calls.

Concurrency. Every method is O(1) and non-blocking and takes one re-entrant lock, so the breaker can be
shared by threads and called directly from the event loop. ``on_transition`` runs under that lock
(so reports arrive in transition order), must be quick (metrics, logging) and may read the breaker;
an exception it raises is logged and swallowed so that a broken metrics hook cannot break serving.

Why not a library. None of the three candidates gives these semantics. ``pybreaker`` (1.4.1) counts
consecutive failures (``fail_max``, reset by any success) with no sliding window, failure rate, minimum
number of calls or slow-call notion, reads the wall clock (``datetime.now``) with no way to inject one,
lets every call through in half-open (``success_threshold`` counts successes but caps nothing), treats an
excluded exception as a success, supports async only through Tornado coroutines, and holds its lock for
the whole guarded call. ``aiobreaker`` (1.2.0, an asyncio port of pybreaker last released in 2021) has the
same consecutive-failure model, closes on the first half-open success with no cap on concurrent
probes, hard-wires ``datetime.utcnow``/``datetime.now`` (mixing the two), and has no lock at all.
``purgatory`` (3.0.1) is asyncio-first but is also a consecutive-failure counter reset by any success,
hard-wires ``time.time()``, has no slow calls or minimum calls, lets every half-open call through and
closes on the first success — and an excluded (client) error counts as that success. Bending any of them
to a count-based window with two rates and a fixed all-must-pass probe set would mean rewriting its
states, so this module is a small implementation of its own: one lock, a deque and a few counters.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from pydantic import BaseModel as _Schema
from pydantic import ConfigDict, Field, model_validator

__all__ = [
    "BreakerSettings",
    "BreakerSnapshot",
    "BreakerState",
    "CircuitBreaker",
    "Permit",
]

logger = logging.getLogger(__name__)


class BreakerState(enum.StrEnum):
    """Where a breaker stands; the value is the lower-case name used in metrics and logs."""

    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class BreakerSettings(_Schema):
    """How one model's breaker judges it: the window, the thresholds, and how it tries to recover."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    window_size: int = Field(default=20, ge=1)
    """Number of most recent recorded calls the CLOSED state judges on (a count-based sliding window)."""
    minimum_calls: int = Field(default=10, ge=1)
    """No judgement until the window holds this many calls, so a cold model is not opened by one error."""
    failure_rate_threshold: float = Field(default=0.5, gt=0, le=1)
    """Opens when failures / calls in the window is at least this."""
    slow_call_rate_threshold: float = Field(default=0.8, gt=0, le=1)
    """Opens when slow calls / calls in the window is at least this."""
    slow_call_ms: float = Field(gt=0)
    """A call that took longer than this is slow; the pipeline passes the model's timeout budget."""
    open_ms: float = Field(default=5000, gt=0)
    """How long the breaker stays OPEN (rejecting every call) before it lets probes through."""
    half_open_probes: int = Field(default=3, ge=1)
    """Calls let through in HALF_OPEN; all must succeed without being slow for the breaker to close."""

    @model_validator(mode="after")
    def _minimum_fits_window(self) -> BreakerSettings:
        if self.minimum_calls > self.window_size:
            raise ValueError(
                f"minimum_calls ({self.minimum_calls}) must not exceed window_size ({self.window_size}): "
                "the breaker could never judge"
            )
        return self


@dataclass(frozen=True)
class BreakerSnapshot:
    """One consistent reading of a breaker, for metrics and status pages.

    The window is cleared when the breaker opens or closes, so in OPEN and HALF_OPEN ``calls`` is 0 and both
    rates are 0.0; rates are 0.0 whenever the window is empty.
    """

    name: str
    state: BreakerState
    calls: int
    """Outcomes in the sliding window (at most ``window_size``)."""
    failure_rate: float
    """Failures / calls in the window, in [0, 1]."""
    slow_call_rate: float
    """Slow calls / calls in the window, in [0, 1]."""
    state_entered_at: float
    """Time on the breaker's clock at which the current state began."""


class Permit:
    """Leave to make one call, granted by :meth:`CircuitBreaker.try_acquire`; resolve it exactly once.

    Resolving it twice raises ``RuntimeError``. A permit whose breaker has changed state since it was
    granted is stale: resolving it is allowed but records nothing (see the module docstring).
    """

    __slots__ = ("_breaker", "_generation", "_resolved", "_state")

    def __init__(self, breaker: CircuitBreaker, generation: int, state: BreakerState) -> None:
        self._breaker = breaker
        self._generation = generation
        self._state = state
        self._resolved = False

    @property
    def state(self) -> BreakerState:
        """The state the permit was granted in: CLOSED, or HALF_OPEN for a probe."""
        return self._state

    @property
    def resolved(self) -> bool:
        """Whether an outcome has been given for this permit."""
        return self._resolved

    def success(self, duration_s: float) -> None:
        """The call answered; ``duration_s`` (seconds) decides whether it was slow."""
        self._breaker._resolve(self, failed=False, duration_s=_checked(duration_s))

    def failure(self, duration_s: float) -> None:
        """The call failed or timed out after ``duration_s`` seconds."""
        self._breaker._resolve(self, failed=True, duration_s=_checked(duration_s))

    def ignore(self) -> None:
        """The call says nothing about the model (a client error, a cancellation): record nothing.

        In HALF_OPEN this gives the probe slot back so another call can probe.
        """
        self._breaker._resolve(self, failed=None, duration_s=0.0)


def _checked(duration_s: float) -> float:
    if not duration_s >= 0:  # also refuses NaN
        raise ValueError(f"a call duration must be >= 0 seconds, got {duration_s}")
    return duration_s


class CircuitBreaker:
    """One model's breaker: ask :meth:`try_acquire` before each call and resolve the permit after it.

    ``clock`` returns seconds on a monotonic scale (tests pass a fake one); ``name`` is the model's name,
    carried by snapshots; ``on_transition(old, new)`` is told of every change.
    """

    def __init__(
        self,
        settings: BreakerSettings,
        *,
        clock: Callable[[], float] = time.monotonic,
        name: str,
        on_transition: Callable[[BreakerState, BreakerState], None] | None = None,
    ) -> None:
        self.settings = settings
        self._clock = clock
        self._name = name
        self._on_transition = on_transition
        self._lock = threading.RLock()
        self._state = BreakerState.CLOSED
        self._generation = 0
        self._entered_at = clock()
        self._half_open_at = 0.0
        """While OPEN: clock time from which the breaker is HALF_OPEN."""
        self._window: deque[tuple[bool, bool]] = deque(maxlen=settings.window_size)
        """Recorded outcomes of the current CLOSED period, as ``(failed, slow)``, oldest first."""
        self._failures = 0
        self._slow = 0
        self._probes_granted = 0
        """While HALF_OPEN: probe slots taken (in flight or passed); ``ignore`` gives one back."""
        self._probes_passed = 0

    @property
    def name(self) -> str:
        """The breaker's name (the model's name)."""
        return self._name

    @property
    def state(self) -> BreakerState:
        """The current state; an OPEN breaker whose open time has elapsed becomes HALF_OPEN here."""
        with self._lock:
            self._advance()
            return self._state

    def snapshot(self) -> BreakerSnapshot:
        """State, window size and rates, read at once under the lock."""
        with self._lock:
            self._advance()
            calls = len(self._window)
            return BreakerSnapshot(
                name=self._name,
                state=self._state,
                calls=calls,
                failure_rate=self._failures / calls if calls else 0.0,
                slow_call_rate=self._slow / calls if calls else 0.0,
                state_entered_at=self._entered_at,
            )

    def try_acquire(self) -> Permit | None:
        """A permit for one call, or ``None`` when the breaker is OPEN or all half-open probes are taken
        (the caller answers with the model's fallback at once)."""
        with self._lock:
            self._advance()
            if self._state is BreakerState.CLOSED:
                return Permit(self, self._generation, BreakerState.CLOSED)
            if (
                self._state is BreakerState.HALF_OPEN
                and self._probes_granted < self.settings.half_open_probes
            ):
                self._probes_granted += 1
                return Permit(self, self._generation, BreakerState.HALF_OPEN)
            return None

    def __repr__(self) -> str:
        return f"CircuitBreaker(name={self._name!r}, state={self.state.value})"

    # -- internals, all called with the lock held unless they take it --

    def _advance(self) -> None:
        """Move OPEN to HALF_OPEN if the open time has elapsed."""
        if self._state is BreakerState.OPEN and self._clock() >= self._half_open_at:
            self._transition(BreakerState.HALF_OPEN, entered_at=self._half_open_at)

    def _resolve(self, permit: Permit, *, failed: bool | None, duration_s: float) -> None:
        """Record one permit's outcome; ``failed=None`` means ignored."""
        with self._lock:
            if permit._resolved:
                raise RuntimeError(f"a permit of circuit breaker '{self._name}' was resolved twice")
            permit._resolved = True
            self._advance()
            if permit._generation != self._generation:
                return  # stale: its state has ended, the outcome is dropped
            if failed is None:
                if self._state is BreakerState.HALF_OPEN:
                    self._probes_granted -= 1
                return
            slow = duration_s * 1000.0 > self.settings.slow_call_ms
            if self._state is BreakerState.CLOSED:
                self._record(failed, slow)
            elif failed or slow:  # HALF_OPEN: one bad probe re-opens
                self._open()
            else:
                self._probes_passed += 1
                if self._probes_passed == self.settings.half_open_probes:
                    self._transition(BreakerState.CLOSED, entered_at=self._clock())

    def _record(self, failed: bool, slow: bool) -> None:
        if len(self._window) == self._window.maxlen:
            old_failed, old_slow = self._window[0]
            self._failures -= old_failed
            self._slow -= old_slow
        self._window.append((failed, slow))
        self._failures += failed
        self._slow += slow
        calls = len(self._window)
        if calls >= self.settings.minimum_calls and (
            self._failures / calls >= self.settings.failure_rate_threshold
            or self._slow / calls >= self.settings.slow_call_rate_threshold
        ):
            self._open()

    def _open(self) -> None:
        now = self._clock()
        self._half_open_at = now + self.settings.open_ms / 1000.0
        self._transition(BreakerState.OPEN, entered_at=now)

    def _transition(self, new: BreakerState, *, entered_at: float) -> None:
        old = self._state
        self._state = new
        self._generation += 1
        self._entered_at = entered_at
        self._window.clear()
        self._failures = 0
        self._slow = 0
        self._probes_granted = 0
        self._probes_passed = 0
        if self._on_transition is not None:
            try:
                self._on_transition(old, new)
            except Exception:
                logger.exception(
                    "on_transition of circuit breaker '%s' failed (%s -> %s)", self._name, old, new
                )
