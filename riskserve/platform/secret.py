"""Per-install secrets: random keys only the serving user can read (mode 0600).

The one in the compiled-library cache authenticates each library's build record, so a library planted in
the cache is never opened. (The holdout split's key is not a file: it must be the same on every node, so
it lives in the pipeline's state database, :meth:`riskserve.learning.feedback_log.FeedbackLog.holdout_key`.)

A key is created once, atomically (written to a private temporary file and hard-linked into place, so two
processes opening the same cache agree on one key), and refused when another user could read it.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
from pathlib import Path
from typing import Final

from riskserve.platform.errors import ConfigError

__all__ = ["KEY_BYTES", "install_secret"]

KEY_BYTES: Final = 32


def install_secret(path: Path) -> bytes:
    """The secret at ``path``, created (32 random bytes, mode 0600) if there is none yet.

    Raises:
        ConfigError: the file is readable by group or others, is not owned by this user, is not a regular
            file or does not hold exactly ``KEY_BYTES`` bytes.
    """
    path = Path(path)
    if not path.exists():
        _create(path)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError as error:
        raise ConfigError(f"{path}: cannot open the install secret: {error}") from error
    with os.fdopen(fd, "rb") as handle:
        info = os.fstat(handle.fileno())  # checked on the open file: no window between check and read
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
            raise ConfigError(f"{path}: the install secret must be a regular file owned by this user")
        if info.st_mode & 0o077:
            raise ConfigError(
                f"{path}: the install secret is readable by others (mode {stat.S_IMODE(info.st_mode):o}); "
                "chmod 600 it or delete it to make a new one"
            )
        key = handle.read(KEY_BYTES + 1)
    if len(key) != KEY_BYTES:
        raise ConfigError(f"{path}: the install secret must hold {KEY_BYTES} bytes, it holds {len(key)}")
    return key


def _create(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(secrets.token_bytes(KEY_BYTES))
            handle.flush()
            os.fsync(handle.fileno())
        with contextlib.suppress(FileExistsError):  # another process made one first: theirs is kept
            os.link(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
