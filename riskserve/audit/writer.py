"""The audit trail's writer in an ingress replica: a bounded buffer, a local journal, a background shipper.

The request path calls :meth:`AuditWriter.submit` with a batch's records. With ``write_ahead`` (the
default) it appends them to the slot's journal on the node's local disk in one ``write`` first, so a
decision is on disk (in the kernel) before it is answered and survives ``kill -9``; then it queues them in
memory. It never touches the database. A background thread ships the queue to the pipeline's state
database (:class:`~riskserve.audit.store.AuditStore`) every ``flush_s`` (sooner when ``batch_rows`` are
waiting), at most ``batch_rows`` per transaction, and deletes journal segments whose records are all
shipped.

Nothing is lost silently, and the database being down costs no decision. When it is slow or unreachable
(:class:`~riskserve.state.db.StoreUnavailable`, a driver error) the queue fills; past ``buffer_rows`` a
record stays only in the journal (counted ``spilled``; without ``write_ahead`` it is appended to the journal
then), and the segment is replayed once the database takes records again. Past ``spill_bytes`` of journal a
record that is not in memory either is dropped: counted (``dropped``, in ``riskserve_audit_records_total``)
and logged. Shipping is idempotent (``ON CONFLICT (decision_id) DO NOTHING``), so a replayed segment never
duplicates a record. On start the writer replays what its slot's journal still holds (a predecessor that was
killed), and the journals of slots on this node that no live process holds.

The bound of loss. ``counts().unshipped`` is the records submitted to this writer (or left in its slot's
journal by a predecessor) that the database does not have yet: those in memory plus those only in the
journal. A ``kill -9`` of the process with ``write_ahead`` loses none of them (the journal is replayed at
the next start on the node); without ``write_ahead``, those in memory (``buffered``). Losing the node (its
disk) loses at most ``unshipped``: normally one shipping interval of decisions (``flush_s`` and one
transaction); while the database is down it grows, at most ``buffer_rows`` plus what ``spill_bytes`` of
journal holds, beyond which records are ``dropped`` (counted) instead. A power loss may lose the journal's
last writes too (it is not fsynced).

Slots: several replicas on one node (sharing ``journal_dir``) each take ``slot-N`` by an exclusive ``flock``
on ``slot-N.lock``, released by the kernel when the process dies, and write only ``slot-N.journal/``. A
restarted replica takes the lowest free slot, usually its predecessor's. The records say which node and
slot made them.
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import itertools
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from riskserve.audit.journal import Journal, count_lines, read_layouts, read_segment, write_layout
from riskserve.audit.store import AuditRecord, AuditStore, dumps, layout_digest
from riskserve.state.db import Database, StoreUnavailable

__all__ = ["AuditCounts", "AuditWriter", "take_slot"]

logger = logging.getLogger(__name__)

SEGMENT_BYTES = 4 << 20
"""A journal segment is closed past this size (then deleted once its records are shipped)."""
ERROR_BACKOFF_S = 0.5
"""Wait after a failed shipment before the next attempt."""
PURGE_EVERY_S = 3600.0
ADOPT_RETRY_S = 30.0
"""Wait before trying again to replay a dead slot's journal that failed to replay."""
LOG_EVERY_S = 60.0
"""While the database stays unreachable, one line this often says how much waits (not one per attempt)."""


@dataclass(frozen=True)
class AuditCounts:
    """What one writer did with the records it was given (since it started)."""

    submitted: int
    written: int
    """Shipped to the database from memory."""
    replayed: int
    """Shipped to the database from a journal (spilled records, or a dead predecessor's); new rows only."""
    spilled: int
    """Kept only in the journal when they arrived (memory full)."""
    dropped: int
    """Lost: neither memory nor the journal could take them, or a journal line was unreadable."""
    buffered: int
    """In memory, not shipped yet."""
    unshipped: int
    """Not in the database yet: in memory, or only in this slot's journal. What losing the node loses."""
    journal_bytes: int
    errors: int
    """Failed shipments (the records were kept and retried)."""
    slot: str


@dataclass
class _Segment:
    pending: int = 0
    """Records of this segment still in memory (not shipped)."""
    kept: int = 0
    """Records only in this segment (spilled, or left by a predecessor): shipped by replaying it."""
    orphaned: bool = False
    """Some of its records are not in memory: the segment must be replayed before it is deleted."""


def take_slot(directory: Path) -> tuple[str, int]:
    """The lowest ``slot-N`` of ``directory`` no live process holds, and the open, locked lock file."""
    for n in itertools.count():
        name = f"slot-{n}"
        fd = os.open(directory / f"{name}.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        return name, fd
    raise AssertionError("unreachable")


class AuditWriter:
    """Ships every record it is given to ``db``, buffered in ``journal_dir`` on this node's disk, off the
    caller's thread (see the module doc). ``db`` stays the caller's: :meth:`close` leaves it open."""

    def __init__(
        self,
        journal_dir: Path,
        db: Database,
        *,
        buffer_rows: int = 10_000,
        flush_s: float = 0.1,
        batch_rows: int = 512,
        spill_bytes: int = 256 << 20,
        write_ahead: bool = True,
        retention_s: float = 1825 * 86400.0,
        purge_rows: int = 500,
        on_count: Callable[[str, int], None] = lambda outcome, n: None,
        clock: Callable[[], float] = time.time,
        node: str | None = None,
    ) -> None:
        """``on_count(outcome, n)``: called from the writer thread with new ``written``, ``replayed``,
        ``spilled`` and ``dropped`` counts (the metrics); ``node``: the name records are kept with
        (default: the host name)."""
        self.journal_dir = Path(journal_dir)
        self.journal_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.node = socket.gethostname() if node is None else node
        self._buffer_rows = buffer_rows
        self._flush_s = flush_s
        self._batch_rows = batch_rows
        self._write_ahead = write_ahead
        self.retention_s = retention_s
        self._purge_rows = purge_rows
        self._on_count = on_count
        self._clock = clock
        self.slot, self._lock_fd = take_slot(self.journal_dir)
        try:
            self._journal = Journal(
                self.journal_dir / f"{self.slot}.journal", max_bytes=spill_bytes, segment_bytes=SEGMENT_BYTES
            )
            self._segments: dict[int, _Segment] = {
                s: _Segment(kept=count_lines(self._journal.path(s)), orphaned=True)
                for s in self._journal.leftovers
            }
            self._unshipped_layouts: dict[str, tuple[str, ...]] = read_layouts(self.journal_dir)
            """Layouts the database may not have yet (those on disk are shipped again: idempotent)."""
        except BaseException:
            os.close(self._lock_fd)
            raise
        self.db = db
        self.store = AuditStore(db)
        self._lock = threading.Lock()
        self._committed = threading.Condition(self._lock)
        """Notified whenever records leave memory for the database (:meth:`flush_submitted` waits on it)."""
        self._buffer: collections.deque[tuple[AuditRecord, int, str]] = collections.deque()
        """(record, its journal segment or -1, its JSON when the request path made it, else '')."""
        self._enqueued = self._dequeued = 0
        """Records ever appended to / shipped out of the buffer (FIFO: the first ``_dequeued`` are in)."""
        self._layouts: dict[tuple[str, ...], str] = {}
        self._orphans_left = True
        """Dead slots' journals on this node not replayed yet (looked for after the first shipment)."""
        self._adopt_at = float("-inf")
        self._submitted = self._written = self._replayed = self._spilled = self._dropped = self._errors = 0
        self._journal_errors = 0
        self._journal_errors_logged = 0
        self._failures = 0
        """Failed shipments in a row (the database unreachable): logged once, then every LOG_EVERY_S."""
        self._failure_logged_at = float("-inf")
        self._reported: dict[str, int] = {}
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._closed = False

    # -- the request path ---------------------------------------------------------------------------------

    def submit(self, records: Sequence[AuditRecord]) -> None:
        """Keep ``records`` (called on the request path: one ``write`` with ``write_ahead``, else none
        unless memory is full; never touches the database, never raises)."""
        try:
            self._submit(records)
        except Exception:  # the trail must never cost a decision
            logger.exception("audit: %d records could not be kept", len(records))
            with self._lock:
                self._dropped += len(records)

    def _submit(self, records: Sequence[AuditRecord]) -> None:
        journal = self._journal
        lines = [dumps(r) for r in records] if self._write_ahead else [""] * len(records)
        data = "".join(line + "\n" for line in lines).encode() if self._write_ahead else b""
        with self._lock:  # serialized outside it: the writer thread never waits on a dumps
            self._submitted += len(records)
            segment = -1
            if self._write_ahead:
                try:
                    segment = journal.append(data) or -1
                except OSError:  # the disk is full or gone: memory still takes them (logged by the writer)
                    self._journal_errors += 1
            room = self._buffer_rows - len(self._buffer)
            kept = records if room >= len(records) else records[: max(room, 0)]
            for record, line in zip(kept, lines, strict=False):
                self._buffer.append((record, segment, line))
            self._enqueued += len(kept)
            if segment > 0:
                state = self._segments.setdefault(segment, _Segment())
                state.pending += len(kept)
            rest = records[len(kept) :]
            if rest:
                if segment > 0:  # already on the journal: replayed from there
                    self._segments[segment].orphaned = True
                    self._segments[segment].kept += len(rest)
                    self._spilled += len(rest)
                else:
                    spilled = None
                    if not self._write_ahead:
                        try:
                            spilled = journal.append("".join(dumps(r) + "\n" for r in rest).encode())
                        except OSError:
                            self._journal_errors += 1
                    if spilled is not None:
                        state = self._segments.setdefault(spilled, _Segment())
                        state.orphaned = True
                        state.kept += len(rest)
                        self._spilled += len(rest)
                    else:
                        self._dropped += len(rest)
            if len(self._buffer) >= self._batch_rows:
                self._wake.set()

    def layout(self, columns: Sequence[str]) -> str:
        """The digest records name ``columns`` by. The names are kept beside the journal at once and
        shipped to the database before any record (never blocks on the database)."""
        key = tuple(columns)
        digest = self._layouts.get(key)
        if digest is None:
            digest = layout_digest(key)
            try:
                write_layout(self.journal_dir, digest, key)
            except OSError:  # memory still ships it; a record journaled meanwhile may lack its names
                logger.exception("audit: the layout %s could not be kept in %s", digest, self.journal_dir)
            with self._lock:
                self._unshipped_layouts[digest] = key
                self._layouts[key] = digest
        return digest

    # -- lifecycle ----------------------------------------------------------------------------------------

    def start(self) -> AuditWriter:
        """Start the shipping thread; returns self."""
        self._thread = threading.Thread(target=self._run, name=f"riskserve-audit-{self.slot}", daemon=True)
        self._thread.start()
        return self

    def _idle(self) -> bool:
        """Whether everything this writer holds is in the database (lock held)."""
        return (
            not self._buffer
            and not self._segments_with_work()
            and not self._unshipped_layouts
            and not self._orphans_left
        )

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until every record submitted so far is in the database; ``False`` if it took too long."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                done = self._idle()
            if done:
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            if self._thread is None or not self._thread.is_alive():
                shipped = self.cycle()  # not started (tests, tools): work in the caller's thread
                with self._lock:
                    done = self._idle()
                if not done:  # the database refused, or a dead slot's journal waits for its retry
                    time.sleep(min(left, 0.01 if shipped else 0.05))
            else:
                self._wake.set()
                time.sleep(min(self._flush_s, 0.01))

    def flush_submitted(self, timeout_s: float) -> bool:
        """Wait until every record submitted before this call has left memory: shipped to the database,
        or (memory was full) spilled to the journal. Records submitted meanwhile are not waited for, so it
        returns promptly under load. ``False`` if it took too long.

        The feedback RPC calls it, so a label sent right after its decision finds the decision."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            target = self._enqueued
        if self._thread is None or not self._thread.is_alive():
            return self.flush(timeout_s)  # not started (tests, tools): work in the caller's thread
        self._wake.set()
        with self._committed:
            while self._dequeued < target:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._committed.wait(left)
        return True

    def close(self, timeout_s: float = 10.0) -> None:
        """Ship what is buffered, delete the drained journal, stop the thread and release the slot. What
        the database did not take stays in the journal, replayed by the next writer of the slot."""
        if self._closed:
            return
        if self._thread is None:
            self.flush(timeout_s)
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        self._closed = True
        with self._lock:
            if not self._buffer and not self._segments_with_work():  # all shipped: no journal to keep
                self._journal.rotate()
                for segment in list(self._journal.sizes):
                    self._journal.remove(segment)
                self._segments.clear()
            self._journal.close()
        os.close(self._lock_fd)

    def counts(self) -> AuditCounts:
        """What this writer did so far."""
        with self._lock:
            return AuditCounts(
                submitted=self._submitted,
                written=self._written,
                replayed=self._replayed,
                spilled=self._spilled,
                dropped=self._dropped,
                buffered=len(self._buffer),
                unshipped=self._unshipped(),
                journal_bytes=self._journal.bytes,
                errors=self._errors,
                slot=self.slot,
            )

    def _unshipped(self) -> int:
        """Records the database may not have: in memory, or only in this slot's journal (lock held)."""
        return len(self._buffer) + sum(state.kept for state in self._segments.values())

    # -- the shipping thread ------------------------------------------------------------------------------

    def _run(self) -> None:
        purged_at = float("-inf")
        while not self._stop.is_set():
            self._wake.wait(self._flush_s)
            self._wake.clear()
            if not self.cycle():
                self._stop.wait(ERROR_BACKOFF_S)
                continue
            if time.monotonic() - purged_at > PURGE_EVERY_S:
                purged_at = time.monotonic()
                try:
                    self.purge_expired()
                except Exception:
                    logger.exception("audit: retention purge failed; retried in an hour")
        for _ in range(100):  # closing: drain what is left while the database takes it
            with self._lock:
                busy = bool(self._buffer) or self._segments_with_work()
            if not busy or not self.cycle():
                break
        self._report()

    def cycle(self) -> bool:
        """Ship new layouts, the buffer in transactions of ``batch_rows``, then replay and delete drained
        journal segments (and once, dead slots' journals); ``False`` when the database failed (everything
        is kept for the next cycle)."""
        ok = self._ship_layouts() and self._commit_buffer() and self._drain_journal()
        if ok:
            ok = self._adopt_orphan_slots()
        if ok and self._failures:
            logger.warning("audit: the state database takes records again (after %d failed attempts)",
                           self._failures)  # fmt: skip
            self._failures = 0
        self._report()
        return ok

    def _failed(self, error: Exception, what: str) -> None:
        """Count a failed shipment; log the first of a run of them, then one line every LOG_EVERY_S."""
        with self._lock:
            self._errors += 1
            unshipped = self._unshipped()
        self._failures += 1
        now = time.monotonic()
        if self._failures == 1:
            logger.warning(
                "audit: the state database refused %s (%s: %s); records are kept (memory, then the journal "
                "in %s) and retried",
                what, type(error).__name__, error, self.journal_dir,
                exc_info=not isinstance(error, StoreUnavailable),
            )  # fmt: skip
            self._failure_logged_at = now
        elif now - self._failure_logged_at >= LOG_EVERY_S:
            logger.warning(
                "audit: the state database is still unreachable (%d attempts, last: %s); %d records not "
                "shipped yet", self._failures, error, unshipped,
            )  # fmt: skip
            self._failure_logged_at = now

    def _ship_layouts(self) -> bool:
        with self._lock:
            layouts = dict(self._unshipped_layouts)
        try:
            self.store.ensure_schema()
            self.store.add_layouts(layouts)
        except Exception as error:
            self._failed(error, f"{len(layouts)} layouts")
            return False
        with self._lock:
            for digest in layouts:
                self._unshipped_layouts.pop(digest, None)
        return True

    def _commit_buffer(self) -> bool:
        while True:
            with self._lock:
                batch = list(itertools.islice(self._buffer, self._batch_rows))
            if not batch:
                return True
            try:
                self.store.insert(
                    [r for r, _, _ in batch],
                    [line or dumps(r) for r, _, line in batch],
                    node=self.node,
                    replica=self.slot,
                )
            except Exception as error:
                self._failed(error, f"{len(batch)} records")
                return False
            with self._lock:
                for _, segment, _ in batch:
                    self._buffer.popleft()
                    if segment > 0:
                        self._segments[segment].pending -= 1
                self._written += len(batch)
                self._dequeued += len(batch)
                self._committed.notify_all()

    def _segments_with_work(self) -> bool:
        """Whether a journal segment still holds records the database may not have (lock held)."""
        return any(state.orphaned for state in self._segments.values())

    def _drain_journal(self) -> bool:
        journal = self._journal
        with self._lock:
            current = self._segments.get(journal.current)
            full = journal.sizes.get(journal.current, 0) >= journal.segment_bytes
            if full or (current is not None and current.orphaned):
                journal.rotate()
            done = [s for s, state in self._segments.items() if s != journal.current and state.pending <= 0]
        for segment in sorted(done):
            state = self._segments.get(segment)
            if state is not None and state.orphaned:
                try:
                    self._replay(journal.path(segment), self.slot)
                except Exception as error:
                    self._failed(error, f"the journal segment {journal.path(segment)}")
                    return False
            with self._lock:
                journal.remove(segment)
                self._segments.pop(segment, None)
        return True

    def _replay(self, path: Path, replica: str) -> None:
        """Ship a journal segment's records (``ON CONFLICT DO NOTHING``: those shipped before stay)."""
        batch: list[tuple[AuditRecord, str]] = []
        bad = 0

        def write() -> None:
            new = self.store.insert(
                [r for r, _ in batch], [t for _, t in batch], node=self.node, replica=replica
            )
            with self._lock:
                self._replayed += new
            batch.clear()

        for entry in read_segment(path):
            if entry is None:
                bad += 1
                continue
            batch.append(entry)
            if len(batch) >= self._batch_rows:
                write()
        if batch:
            write()
        if bad:
            with self._lock:
                self._dropped += bad

    def _adopt_orphan_slots(self) -> bool:
        """Replay the journals of this node's slots no live process holds (a replica that died and did not
        return), once; ``False`` when one failed (tried again after ADOPT_RETRY_S)."""
        with self._lock:
            if not self._orphans_left or time.monotonic() < self._adopt_at:
                return True
        ok = True
        for lock in sorted(self.journal_dir.glob("slot-*.lock")):
            name = lock.name.removesuffix(".lock")
            journal_dir = self.journal_dir / f"{name}.journal"
            if name == self.slot or not any(journal_dir.glob("*.jsonl")):
                continue
            fd = os.open(lock, os.O_RDWR)
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # alive: it ships its own
                for path in sorted(journal_dir.glob("*.jsonl")):
                    self._replay(path, name)
                    path.unlink()
            except Exception as error:
                self._failed(error, f"the journal of {name}")
                ok = False
            finally:
                os.close(fd)
        with self._lock:
            if ok:
                self._orphans_left = False
            else:
                self._adopt_at = time.monotonic() + ADOPT_RETRY_S
        return ok

    def purge_expired(self) -> tuple[int, int]:
        """Delete records past retention from the database, ``purge_rows`` per transaction, shipping the
        buffer between them; returns (records deleted, transactions). Every replica runs it; the deletes
        are idempotent, so replicas purging at once only share the work."""
        cutoff = self._clock() - self.retention_s
        deleted = transactions = 0
        while True:
            n = self.store.purge(cutoff, self._purge_rows)
            transactions += 1
            deleted += n
            if n < self._purge_rows:
                break
            self._commit_buffer()  # decisions keep flowing in while a long retention backlog goes
        if deleted:
            logger.info("audit: purged %d records older than %.0f days", deleted, self.retention_s / 86400)
        return deleted, transactions

    def _report(self) -> None:
        """Hand new counts to ``on_count`` and log drops (the writer thread; never the request path)."""
        with self._lock:
            journal_errors = self._journal_errors
        if journal_errors > self._journal_errors_logged:
            logger.error(
                "audit: %d appends to the journal in %s failed (disk full?); those records waited in "
                "memory only (a kill -9 then loses them)",
                journal_errors - self._journal_errors_logged,
                self.journal_dir,
            )
            self._journal_errors_logged = journal_errors
        with self._lock:
            now = {
                "written": self._written,
                "replayed": self._replayed,
                "spilled": self._spilled,
                "dropped": self._dropped,
            }
        for outcome, value in now.items():
            delta = value - self._reported.get(outcome, 0)
            if delta > 0:
                self._reported[outcome] = value
                if outcome == "dropped":
                    logger.error(
                        "audit: %d decision records DROPPED (memory and journal full, %s); %d in all",
                        delta,
                        self.journal_dir,
                        value,
                    )
                with contextlib.suppress(Exception):
                    self._on_count(outcome, delta)
