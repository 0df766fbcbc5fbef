"""One way to open a SQLite file for riskserve's durable logs: WAL mode (readers never block the writer),
a busy timeout, and the ``synchronous`` level the caller's durability needs, refused loudly if SQLite
does not take them (WAL needs a local file system)."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Literal

from riskserve.platform.errors import ConfigError

__all__ = ["open_wal"]


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
