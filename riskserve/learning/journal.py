"""A crash journal of the decisions an ingress replica has buffered but not yet sent to the feedback log.

The recorder answers a Decide before its decision reaches the log (the log commits every ``flush_ms``),
so a ``kill -9`` of an ingress replica used to lose what it held. Now each replica also appends every
decision it buffers to a segment file of its own (a JSON line each, one unbuffered ``write`` per batch:
it outlives the process in the kernel's page cache, though not a crash of the machine), starts a new
segment each time it sends its buffer, and deletes the segments a send covered once the log committed
them. A replica adopts the segments of replicas that died (pid gone, or reused by another process: the
start time is in the name) and sends them again; the log keeps a decision it already has once, so a
record sent twice is harmless. JSON only: nothing is ever unpickled.
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import json
import logging
import os
import secrets
from pathlib import Path

import numpy as np

from riskserve.learning.feedback_log import DecisionRecord

__all__ = ["DecisionJournal", "journal_dir"]

logger = logging.getLogger(__name__)

_SUFFIX = ".jsonl"


def journal_dir(log_path: Path | str) -> Path:
    """Where the ingress replicas of the pipeline whose log is ``log_path`` keep their journals."""
    path = Path(log_path)
    return path.with_name(path.name + ".journal")


def _start_time(pid: int) -> str | None:
    """The process's start time (clock ticks since boot), or ``None`` if it does not exist."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _record_line(record: DecisionRecord) -> str:
    """One JSON line; the features as the base64 of their little-endian float32 bytes (exact, and a tenth
    of the cost of a list of floats)."""
    features = np.ascontiguousarray(record.features, dtype="<f4")
    return json.dumps(
        {
            "decision_id": record.decision_id,
            "pipeline": record.pipeline,
            "model_version": record.model_version,
            "features": base64.b64encode(features.tobytes()).decode("ascii"),
            "shape": list(features.shape),
            "columns": list(record.columns),
            "request_id": record.request_id,
        },
        separators=(",", ":"),
    )


def _record_of(line: str) -> DecisionRecord:
    data = json.loads(line)
    raw = np.frombuffer(base64.b64decode(data["features"], validate=True), dtype="<f4")
    features = raw.astype(np.float32).reshape(data["shape"])
    return DecisionRecord(
        decision_id=str(data["decision_id"]),
        pipeline=str(data["pipeline"]),
        model_version=str(data["model_version"]),
        features=features,
        columns=tuple(str(c) for c in data["columns"]),
        request_id=str(data["request_id"]),
    )


class DecisionJournal:
    """This process's segments in ``directory`` (0700; files 0600): append, rotate, forget, adopt."""

    def __init__(self, directory: Path | str) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._owner = f"{os.getpid()}-{_start_time(os.getpid())}"
        self._instance = secrets.token_hex(4)  # two journals of one process never share a name
        self._seq = itertools.count()
        self._closed: list[Path] = []
        self._fd, self._current = self._open()
        self._written = False
        self.recovered = 0
        """Decisions adopted from the journals of replicas that died."""
        self.unjournaled = 0
        """Decisions whose journal write failed (sent all the same, but a crash before then loses them)."""
        self.unreadable = 0
        """Lines of adopted journals that could not be read (a write cut short): decisions lost."""

    def _open(self) -> tuple[int, Path]:
        path = self.directory / f"{self._owner}-{self._instance}-{next(self._seq)}{_SUFFIX}"
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_EXCL, 0o600), path

    def append(self, records: list[DecisionRecord]) -> None:
        """Journal ``records`` (one ``write``; no fsync: it must outlive the process, not the machine). A
        write that fails (a full disk) is logged and counted, never a failed decision: the records are
        still buffered and sent, only a crash before then would lose them."""
        if not records:
            return
        try:
            os.write(self._fd, "".join(_record_line(r) + "\n" for r in records).encode())
        except OSError as error:
            self.unjournaled += len(records)
            logger.warning("could not journal %d decisions: %s", len(records), error)
            return
        self._written = True

    def rotate(self) -> list[Path]:
        """Close the current segment and start another; returns every closed segment not yet forgotten
        (what a send of the whole buffer now covers). An empty segment is kept open."""
        if self._written:
            os.close(self._fd)
            self._closed.append(self._current)
            self._fd, self._current = self._open()
            self._written = False
        return list(self._closed)

    def forget(self, segments: list[Path]) -> None:
        """The log committed what ``segments`` hold: delete them."""
        for path in segments:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            with contextlib.suppress(ValueError):
                self._closed.remove(path)

    def adopt(self) -> list[DecisionRecord]:
        """The records of dead replicas' segments, which become this journal's closed segments (a rename:
        of two replicas adopting at once, one wins each segment). The caller buffers and sends them."""
        records: list[DecisionRecord] = []
        for path in sorted(self.directory.glob(f"*{_SUFFIX}")):
            pid, _, rest = path.name.partition("-")
            start = rest.split("-", 1)[0]
            if not pid.isdigit() or f"{pid}-{start}" == self._owner or _start_time(int(pid)) == start:
                continue  # ours, or its owner still runs
            mine = self.directory / f"{self._owner}-{self._instance}-{next(self._seq)}{_SUFFIX}"
            try:
                path.rename(mine)
            except FileNotFoundError:
                continue  # another replica adopted it first
            self._closed.append(mine)
            for line in mine.read_text().splitlines():
                try:
                    records.append(_record_of(line))
                except (ValueError, KeyError, TypeError):  # binascii.Error is a ValueError
                    self.unreadable += 1
        if records:
            logger.warning(
                "adopted %d decisions from the journals of ingress replicas that died", len(records)
            )
        self.recovered += len(records)
        return records

    def close(self) -> None:
        """Stop journaling (the segments stay until forgotten or adopted)."""
        with contextlib.suppress(OSError):
            os.close(self._fd)
