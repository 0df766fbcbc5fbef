"""The versions record: what every model of a pipeline serves, as data every replica pulls.

One row per pipeline holds a :class:`VersionsRecord` (each model's entries, oldest first, the last one
serving; the shadow candidates) and a ``generation`` that every change increments. Swaps, rollbacks,
shadow changes and the online learner only WRITE it, as a compare-and-set on the generation they read
(:meth:`VersionsStore.compare_and_set`); every replica that runs a model watches the generation, applies a
new record (verifying each artifact before it serves it) and reports back what it serves
(:meth:`VersionsStore.report`). The Serve application never changes when a model version does.

An entry counts only while the YAML still names the artifact it was recorded over (``base``): an operator
who points the YAML at another artifact has chosen it, and the record of the old one is ignored.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel as _Schema
from pydantic import ConfigDict, Field, ValidationError

from riskserve.platform.errors import ConfigError, Conflict
from riskserve.state.db import Database, Migration

__all__ = [
    "HISTORY",
    "MIGRATIONS",
    "ModelVersions",
    "ReplicaReport",
    "Source",
    "VersionEntry",
    "VersionsRecord",
    "VersionsStore",
]

HISTORY = 32
"""Entries kept per model (the current one and those a rollback may return to)."""

Source = Literal["yaml", "swap", "rollback", "learned"]

MIGRATIONS = (
    Migration(
        1,
        """
        CREATE TABLE versions (
            pipeline   TEXT PRIMARY KEY,
            generation BIGINT NOT NULL,
            record     TEXT NOT NULL,
            updated_at DOUBLE PRECISION NOT NULL
        );
        CREATE TABLE replicas (
            pipeline   TEXT NOT NULL,
            replica    TEXT NOT NULL,
            node       TEXT NOT NULL,
            models     TEXT NOT NULL,
            generation BIGINT NOT NULL,
            serving    TEXT NOT NULL,
            error      TEXT NOT NULL,
            seen_at    DOUBLE PRECISION NOT NULL,
            PRIMARY KEY (pipeline, replica)
        )
        """,
    ),
)


class VersionEntry(_Schema):
    """One artifact a model served: where it is, its content version, and why it serves."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    artifact: str
    """The artifact: an absolute directory (a shared volume) or an artifact-store URI."""
    version: str
    """The artifact's content version (the hash of its model files), checked again by every replica."""
    source: Source
    at: float
    """Unix time of the write."""
    note: str = ""
    """What made it: ``learned from 64 labels``, the operator's reason for a swap, ..."""


class ModelVersions(_Schema):
    """A model's entries, oldest first: the last one serves."""

    model_config = ConfigDict(extra="forbid")

    base: str
    """The YAML artifact the entries were recorded over; a YAML naming another one wins."""
    entries: list[VersionEntry] = Field(default_factory=list)

    @property
    def current(self) -> VersionEntry | None:
        """The entry that serves (``None``: the YAML's artifact serves)."""
        return self.entries[-1] if self.entries else None


class VersionsRecord(_Schema):
    """What each model of one pipeline serves (models never published are absent: the YAML's serve)."""

    model_config = ConfigDict(extra="forbid")

    pipeline: str
    generation: int = 0
    """Incremented by every write; 0: nothing was ever written."""
    models: dict[str, ModelVersions] = Field(default_factory=dict)
    shadows: dict[str, dict[str, Any]] = Field(default_factory=dict)
    """Model -> the shadow candidate's settings (``riskserve shadow``), scored beside it by the ingress."""
    reset_at: float = 0.0
    """When ``riskserve up --reset`` last forgot every version (0: never): a learner whose model has no
    entry since then adopts the YAML's artifact instead of publishing its own last version again."""

    def serving(self, model: str, base: str) -> VersionEntry | None:
        """The recorded entry ``model`` serves when the YAML names ``base``, else ``None`` (the YAML's)."""
        served = self.models.get(model)
        if served is None or served.base != base:
            return None
        return served.current


class ReplicaReport(_Schema):
    """What one replica last said it serves (its heartbeat and its confirmation of a generation)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    replica: str
    node: str
    models: list[str]
    generation: int
    """The last generation it applied (or refused: see ``error``)."""
    serving: dict[str, str]
    """Model -> the version it serves."""
    error: str
    seen_at: float


class VersionsStore:
    """The versions record and the replicas' reports in a pipeline's state database."""

    def __init__(self, db: Database) -> None:
        self.db = db
        db.migrate("versions", MIGRATIONS)

    def generation(self, pipeline: str) -> int:
        """The record's generation (one indexed read: what a replica polls)."""
        with self.db.transaction(write=False) as tx:
            row = tx.one("SELECT generation FROM versions WHERE pipeline = ?", (pipeline,))
        return 0 if row is None else int(row[0])

    def read(self, pipeline: str) -> VersionsRecord:
        """The pipeline's record (an empty one, generation 0, when none was written).

        Raises:
            ConfigError: the stored record is not one riskserve wrote.
        """
        with self.db.transaction(write=False) as tx:
            row = tx.one("SELECT generation, record FROM versions WHERE pipeline = ?", (pipeline,))
        if row is None:
            return VersionsRecord(pipeline=pipeline)
        try:
            record = VersionsRecord.model_validate_json(row[1])
        except ValidationError as error:
            raise ConfigError(
                f"the versions record of '{pipeline}' is unreadable ({error.errors()[0]['msg']}); "
                "`riskserve up --reset` serves the YAML's artifacts and starts a new one"
            ) from error
        return record.model_copy(update={"generation": int(row[0])})

    def compare_and_set(self, record: VersionsRecord, expected: int) -> VersionsRecord:
        """Write ``record`` as the next generation if the stored one is still ``expected``; returns it as
        stored.

        Raises:
            Conflict: another write came first (read again and redo the change).
        """
        new = record.model_copy(update={"generation": expected + 1})
        body = new.model_dump_json(exclude={"generation"})
        now = time.time()
        with self.db.transaction() as tx:
            if expected == 0:
                changed = tx.execute(
                    "INSERT INTO versions (pipeline, generation, record, updated_at) VALUES (?, 1, ?, ?) "
                    "ON CONFLICT (pipeline) DO NOTHING",
                    (record.pipeline, body, now),
                )
            else:
                changed = tx.execute(
                    "UPDATE versions SET generation = ?, record = ?, updated_at = ? "
                    "WHERE pipeline = ? AND generation = ?",
                    (expected + 1, body, now, record.pipeline, expected),
                )
        if changed != 1:
            raise Conflict(
                f"the versions record of '{record.pipeline}' changed since generation {expected}: "
                "another publish came first"
            )
        return new

    def update(
        self, pipeline: str, change: Callable[[VersionsRecord], VersionsRecord | None]
    ) -> VersionsRecord | None:
        """Write ``change(record)`` as a compare-and-set, reading the record again and redoing the change
        when another writer came first. ``change`` returns a new record (it must not modify the one it is
        given), or ``None`` to write nothing; what it raises propagates. Returns what was stored."""
        while True:
            record = self.read(pipeline)
            new = change(record)
            if new is None:
                return None
            try:
                return self.compare_and_set(new, record.generation)
            except Conflict:
                continue

    def reset(self, pipeline: str) -> int:
        """Forget every recorded version (``riskserve up --reset``): the YAML's artifacts serve next.
        Returns how many models had a record. The generation still moves on, so watching replicas apply it."""
        forgotten = 0

        def forget(record: VersionsRecord) -> VersionsRecord | None:
            nonlocal forgotten
            forgotten = sum(1 for served in record.models.values() if served.entries)
            return None if record.generation == 0 else VersionsRecord(pipeline=pipeline, reset_at=time.time())

        return forgotten if self.update(pipeline, forget) is not None else 0

    def report(
        self,
        pipeline: str,
        replica: str,
        *,
        node: str,
        models: list[str],
        generation: int,
        serving: dict[str, str],
        error: str = "",
    ) -> None:
        """Record what ``replica`` serves as of ``generation`` (its heartbeat too)."""
        with self.db.transaction() as tx:
            tx.execute(
                "INSERT INTO replicas (pipeline, replica, node, models, generation, serving, error, seen_at) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (pipeline, replica) DO UPDATE SET "
                "node = excluded.node, models = excluded.models, generation = excluded.generation, "
                "serving = excluded.serving, error = excluded.error, seen_at = excluded.seen_at",
                (pipeline, replica, node, json.dumps(models), generation, json.dumps(serving), error,
                 time.time()),
            )  # fmt: skip

    def forget(self, pipeline: str, replica: str) -> None:
        """A replica that stops takes itself off the list (a dead one ages out: :meth:`replicas`)."""
        with self.db.transaction() as tx:
            tx.execute("DELETE FROM replicas WHERE pipeline = ? AND replica = ?", (pipeline, replica))

    def replicas(self, pipeline: str, *, seen_within_s: float) -> list[ReplicaReport]:
        """The replicas that reported within the last ``seen_within_s`` seconds (the live ones)."""
        since = time.time() - seen_within_s
        with self.db.transaction(write=False) as tx:
            rows = tx.query(
                "SELECT replica, node, models, generation, serving, error, seen_at FROM replicas "
                "WHERE pipeline = ? AND seen_at >= ? ORDER BY replica",
                (pipeline, since),
            )
        return [
            ReplicaReport(
                replica=r[0],
                node=r[1],
                models=json.loads(r[2]),
                generation=int(r[3]),
                serving=json.loads(r[4]),
                error=r[5],
                seen_at=float(r[6]),
            )
            for r in rows
        ]
