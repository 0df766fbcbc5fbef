"""Micro-benchmark: the cost of one ``ModelResult`` (made once per row per model on the request path).

Compares the ``__slots__`` class it is with the frozen dataclass it was (same fields, keyword arguments),
interleaved and best-of-N so a busy machine disturbs both alike. Run:
``PYTHONPATH=. .venv/bin/python bench/model_result.py``.
"""

from __future__ import annotations

import timeit
from dataclasses import dataclass

from riskserve.schema.rules import ModelResult


@dataclass(frozen=True)
class FrozenModelResult:
    """The shape before issue 12."""

    name: str
    version: str
    score: float
    label: str = ""
    fallback: bool = False
    fallback_reason: str = ""
    latency_ms: float = 0.0


def main(number: int = 100_000, rounds: int = 15) -> None:
    """Print the best time per object of each class and their ratio."""
    best = {FrozenModelResult: float("inf"), ModelResult: float("inf")}
    for _ in range(rounds):
        for cls in best:
            seconds = timeit.timeit(
                lambda cls=cls: cls(name="fraud", version="abc", score=0.5, label="", latency_ms=0.3),
                number=number,
            )
            best[cls] = min(best[cls], seconds / number)
    for cls, seconds in best.items():
        print(f"{cls.__name__:18s} {seconds * 1e9:7.0f} ns per object")
    print(f"ratio {best[FrozenModelResult] / best[ModelResult]:.1f}x")


if __name__ == "__main__":
    main()
