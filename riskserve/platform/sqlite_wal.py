"""One way to open a SQLite file for riskserve's durable logs: WAL mode (readers never block the writer),
a busy timeout, and the ``synchronous`` level the caller's durability needs, refused loudly if SQLite
does not take them (WAL needs a local file system)."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Literal

from riskserve.platform.errors import ConfigError

__all__ = ["install_schema", "open_wal"]


def open_wal(
    path: Path, *, busy_timeout_s: float, synchronous: Literal["NORMAL", "FULL"]
) -> sqlite3.Connection:
    """A connection to ``path`` in WAL mode, shareable between threads (behind the caller's lock), with no
    implicit transactions (``isolation_level=None``: each write opens its own explicitly).

    Raises:
        ConfigError: SQLite refused WAL mode (e.g. a network file system).
    """
    db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    try:
        db.execute(f"PRAGMA busy_timeout = {int(busy_timeout_s * 1000)}")
        mode = db.execute("PRAGMA journal_mode = WAL").fetchone()[0]
        if str(mode).lower() != "wal":
            raise ConfigError(f"{path}: SQLite refused WAL mode (got '{mode}'); use a local file system")
        db.execute(f"PRAGMA synchronous = {synchronous}")
    except BaseException:
        db.close()
        raise
    return db


def install_schema(
    cur: sqlite3.Cursor,
    *,
    path: Path,
    schema: str,
    version: int,
    migrations: Mapping[int, Sequence[str]],
    indexes: Sequence[str],
    label: str,
    applies: Callable[[str], bool] = lambda statement: True,
) -> None:
    """Create ``schema`` (its tables ``IF NOT EXISTS``, one of them ``schema_version``), record ``version``
    in a fresh file, upgrade an older file's schema in the same transaction (each migration statement
    ``applies`` accepts, version by version), then create ``indexes`` (they may name migrated columns).

    Raises:
        ConfigError: the file holds a version this code cannot read (``label`` names it in the message).
    """
    for statement in filter(str.strip, schema.split(";")):
        cur.execute(statement)
    rows = cur.execute("SELECT version FROM schema_version").fetchall()
    found: int | None = version
    if not rows:
        cur.execute("INSERT INTO schema_version (version) VALUES (?)", (version,))
    else:
        found = int(rows[0][0]) if len(rows) == 1 else None
    while found is not None and found in migrations:
        for statement in migrations[found]:
            if applies(statement):
                cur.execute(statement)
        found += 1
        cur.execute("UPDATE schema_version SET version = ?", (found,))
    if found != version:
        raise ConfigError(f"{path}: {label} {[r[0] for r in rows]}, this code reads {version}")
    for statement in indexes:
        cur.execute(statement)
