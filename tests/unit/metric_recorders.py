"""A wrapper for Ray's native recorder of one metric that keeps every call it is given and passes it on,
for the tests that count what reaches Ray."""

from __future__ import annotations

from typing import Any


class CountingRecorder:
    """Ray's native recorder of one gauge, wrapped to keep every ``(value, tags)`` it is given."""

    def __init__(self, native: Any) -> None:
        self.native = native
        self.calls: list[tuple[float, dict[str, str]]] = []

    def record(self, value: float, tags: dict[str, str]) -> None:
        self.calls.append((value, dict(tags)))
        self.native.record(value, tags=tags)
