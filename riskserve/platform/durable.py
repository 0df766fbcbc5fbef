"""Making a write survive a power cut: fsync a file's bytes, and the directory that names it (a rename or a
new entry is durable only once its directory is)."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["fsync_dir", "fsync_file"]


def fsync_file(path: Path) -> None:
    """Flush ``path``'s bytes to the disk."""
    with path.open("rb") as handle:
        os.fsync(handle.fileno())


def fsync_dir(path: Path) -> None:
    """Flush ``path``'s entries (the names in it, a rename into it) to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
