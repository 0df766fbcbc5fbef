"""The append-only journal of one writer slot, on its node's local disk: records that may not be in the
state database yet (the buffer of the records a replica has not shipped).

Segments ``<slot>.journal/00000001.jsonl``, ``00000002.jsonl``, ... hold one JSON record per line, appended
with one ``write`` per decision batch (in the kernel's page cache when it returns: a ``kill -9`` of the
process loses nothing written, a power loss may). The writer deletes a segment once every record in it is
in the database, replaying it first when some of its records never reached the database from memory. The
total size is bounded: an append past ``max_bytes`` is refused and the caller counts what it could not
keep. Not thread-safe: its owner (:class:`~riskserve.audit.writer.AuditWriter`) serializes the calls.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

from riskserve.audit.store import AuditRecord, layout_digest

__all__ = ["Journal", "count_lines", "read_layout", "read_layouts", "read_segment", "write_layout"]

logger = logging.getLogger(__name__)

SUFFIX = ".jsonl"
LAYOUT_PREFIX = "layout-"
"""``<journal dir>/layout-<digest>.json``: a layout's column names, on disk before any record names it, so a
journal replayed after a crash (or read by a lookup) never names a layout the database lacks."""


class Journal:
    """Segment files of one slot; the last is the one appended to."""

    def __init__(self, directory: Path, *, max_bytes: int, segment_bytes: int) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.segment_bytes = segment_bytes
        self.sizes: dict[int, int] = {}
        for path in self.directory.glob(f"*{SUFFIX}"):
            if path.stem.isdigit():
                self.sizes[int(path.stem)] = path.stat().st_size
        self.leftovers = sorted(self.sizes)
        """Segments found at open: written by a process that died (or closed before they were drained)."""
        self.current = max(self.sizes, default=0) + 1
        self._fd: int | None = None
        self.bytes = sum(self.sizes.values())
        """Bytes in every segment on disk now."""

    def path(self, segment: int) -> Path:
        """The file of ``segment``."""
        return self.directory / f"{segment:08d}{SUFFIX}"

    def append(self, data: bytes) -> int | None:
        """Append ``data`` (whole lines) to the current segment; its number, or ``None`` past the bound."""
        if self.bytes + len(data) > self.max_bytes:
            return None
        if self._fd is None:
            flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | getattr(os, "O_NOFOLLOW", 0)
            self._fd = os.open(self.path(self.current), flags, 0o600)
            self.sizes.setdefault(self.current, 0)
        view = memoryview(data)
        while view:
            written = os.write(self._fd, view)
            view = view[written:]
        self.bytes += len(data)
        self.sizes[self.current] += len(data)
        return self.current

    def rotate(self) -> int | None:
        """Close the current segment if it holds anything (later appends start a new one); its number."""
        if self._fd is None:
            return None
        os.close(self._fd)
        self._fd = None
        closed = self.current
        self.current += 1
        return closed

    def remove(self, segment: int) -> None:
        """Delete a closed segment (every record in it is in the database)."""
        self.path(segment).unlink(missing_ok=True)
        self.bytes -= self.sizes.pop(segment, 0)

    def close(self) -> None:
        """Close the current segment's file (the segments stay on disk)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def count_lines(path: Path) -> int:
    """Whole lines in a segment: the records a dead predecessor left in it (a torn last line is not one)."""
    try:
        with open(path, "rb") as handle:
            return sum(chunk.count(b"\n") for chunk in iter(lambda: handle.read(1 << 20), b""))
    except FileNotFoundError:
        return 0


def read_segment(path: Path) -> Iterator[tuple[AuditRecord, str] | None]:
    """Each line's record and text; ``None`` for a line that is not a whole record (logged)."""
    with open(path, "rb") as handle:
        for number, raw in enumerate(handle, start=1):
            text = raw.decode("utf-8", errors="replace").rstrip("\n")
            try:
                record: AuditRecord = json.loads(text)
                record["decision_id"]
            except (ValueError, KeyError, TypeError):
                logger.error("%s:%d: not an audit record; skipped and counted as dropped", path, number)
                yield None
                continue
            yield record, text


def write_layout(directory: Path, digest: str, columns: Sequence[str]) -> None:
    """Keep a layout's column names beside the journals (mode 0600, replaced atomically: never torn)."""
    path = directory / f"{LAYOUT_PREFIX}{digest}.json"
    if path.exists():
        return
    temporary = directory / f".{path.name}.{os.getpid()}.tmp"
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0), 0o600)
    try:
        os.write(fd, json.dumps(list(columns)).encode())
    finally:
        os.close(fd)
    os.replace(temporary, path)


def read_layout(directory: Path, digest: str) -> tuple[str, ...] | None:
    """The column names of layout ``digest`` kept in ``directory``, or ``None``."""
    try:
        columns = json.loads((directory / f"{LAYOUT_PREFIX}{digest}.json").read_bytes())
    except (FileNotFoundError, ValueError):
        return None
    if not isinstance(columns, list) or layout_digest(columns) != digest:  # not what the writer wrote
        return None
    return tuple(str(c) for c in columns)


def read_layouts(directory: Path) -> dict[str, tuple[str, ...]]:
    """Every layout kept in ``directory``, by digest."""
    found: dict[str, tuple[str, ...]] = {}
    for path in directory.glob(f"{LAYOUT_PREFIX}*.json"):
        digest = path.stem.removeprefix(LAYOUT_PREFIX)
        columns = read_layout(directory, digest)
        if columns is not None:
            found[digest] = columns
    return found
