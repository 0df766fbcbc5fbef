"""Per-source token buckets: one label source cannot flood online learning (a guard against poisoning)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from riskserve.platform.errors import Overloaded

__all__ = ["SourceRateLimiter"]


class SourceRateLimiter:
    """``rate_per_s`` labels per second per source on average, ``burst`` at once; thread-safe."""

    def __init__(
        self,
        rate_per_s: float,
        burst: int,
        *,
        clock: Callable[[], float] = time.monotonic,
        max_sources: int = 10_000,
    ) -> None:
        self.rate_per_s = rate_per_s
        self.burst = burst
        self._clock = clock
        self._max_sources = max_sources
        self._buckets: dict[str, tuple[float, float]] = {}  # source -> (tokens, at)
        self._lock = threading.Lock()

    def take(self, source: str) -> None:
        """Spend one token of ``source``.

        Raises:
            Overloaded: the source is over its rate (RESOURCE_EXHAUSTED); nothing was recorded.
        """
        now = self._clock()
        with self._lock:
            tokens, at = self._buckets.get(source, (float(self.burst), now))
            tokens = min(float(self.burst), tokens + (now - at) * self.rate_per_s)
            if tokens < 1.0:
                self._buckets[source] = (tokens, now)
                wait_s = (1.0 - tokens) / self.rate_per_s
                raise Overloaded(
                    f"source '{source or '(none)'}' is over its label rate ({self.rate_per_s:g}/s, burst "
                    f"{self.burst}); retry in {wait_s:.2f} s"
                )
            self._buckets[source] = (tokens - 1.0, now)
            if len(self._buckets) > self._max_sources:  # forget the fullest buckets: they are at rest
                for stale in sorted(self._buckets, key=lambda s: -self._buckets[s][0])[
                    : len(self._buckets) // 2
                ]:
                    if stale != source:
                        del self._buckets[stale]
