"""A clock the test moves by hand, for code that takes a ``clock`` callable (rate limits, reloads)."""

from __future__ import annotations


class ManualClock:
    """Returns ``now``, which only the test changes."""

    def __init__(self, start: float = 1_000_000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now
