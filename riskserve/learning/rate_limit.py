"""Label admission rates: a token bucket per source AND one for all sources together.

A per-source bucket alone stops one source flooding online learning, but not a caller who invents a new
source per label (``source`` is a request field unless the front door authenticates callers, in which case
it is the caller's identity). The shared bucket caps what all sources together can send, so inventing
sources buys nothing beyond it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Literal

from riskserve.platform.errors import Overloaded

__all__ = ["RateLimited", "SourceRateLimiter"]


class RateLimited(Overloaded):
    """A label over its rate (RESOURCE_EXHAUSTED); ``scope`` says whose: its source's or all sources'."""

    def __init__(self, message: str, *, scope: Literal["source", "total"]) -> None:
        super().__init__(message)
        self.scope = scope


class SourceRateLimiter:
    """``rate_per_s`` labels per second per source on average, ``burst`` at once, and at most
    ``total_rate_per_s`` / ``total_burst`` over all sources together; thread-safe."""

    def __init__(
        self,
        rate_per_s: float,
        burst: int,
        *,
        total_rate_per_s: float | None = None,
        total_burst: int | None = None,
        clock: Callable[[], float] = time.monotonic,
        max_sources: int = 10_000,
    ) -> None:
        """``total_rate_per_s``: the shared cap (default: none); ``total_burst`` defaults to ``burst``."""
        self.rate_per_s = rate_per_s
        self.burst = burst
        self.total_rate_per_s = total_rate_per_s
        self.total_burst = total_burst if total_burst is not None else burst
        self._clock = clock
        self._max_sources = max_sources
        self._buckets: dict[str, tuple[float, float]] = {}  # source -> (tokens, at)
        self._total = (float(self.total_burst), clock())
        self._lock = threading.Lock()

    def take(self, source: str) -> None:
        """Spend one token of ``source`` and one of the shared bucket (both or neither).

        Raises:
            RateLimited: the source, or all sources together, are over their rate (RESOURCE_EXHAUSTED);
                nothing was recorded and no token was spent.
        """
        now = self._clock()
        with self._lock:
            tokens, at = self._buckets.get(source, (float(self.burst), now))
            tokens = min(float(self.burst), tokens + (now - at) * self.rate_per_s)
            if tokens < 1.0:
                self._buckets[source] = (tokens, now)
                wait_s = (1.0 - tokens) / self.rate_per_s
                raise RateLimited(
                    f"source '{source or '(none)'}' is over its label rate ({self.rate_per_s:g}/s, burst "
                    f"{self.burst}); retry in {wait_s:.2f} s",
                    scope="source",
                )
            if self.total_rate_per_s is not None:
                total, total_at = self._total
                total = min(float(self.total_burst), total + (now - total_at) * self.total_rate_per_s)
                if total < 1.0:
                    self._total = (total, now)
                    wait_s = (1.0 - total) / self.total_rate_per_s
                    raise RateLimited(
                        f"all label sources together are over their rate ({self.total_rate_per_s:g}/s, "
                        f"burst {self.total_burst}); retry in {wait_s:.2f} s",
                        scope="total",
                    )
                self._total = (total - 1.0, now)
            self._buckets[source] = (tokens - 1.0, now)
            if len(self._buckets) > self._max_sources:  # forget the fullest buckets: they are at rest
                for stale in sorted(self._buckets, key=lambda s: -self._buckets[s][0])[
                    : len(self._buckets) // 2
                ]:
                    if stale != source:
                        del self._buckets[stale]
