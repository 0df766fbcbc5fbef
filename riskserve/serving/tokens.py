"""Bearer tokens of the gRPC front door: who may call, as which identity, with which roles.

Tokens come from a file (re-read when it changes, so a token is added or revoked without a restart) or an
environment variable (read once). Only SHA-256 digests are kept in memory and a presented token is compared
with every known digest by :func:`hmac.compare_digest`, so neither the comparison nor the order of the
table tells a caller how close a guess was. The call path never touches the file system:
:meth:`TokenStore.refresh` (a ``stat``, and a read only on change) runs in the front door's background
task, at most once per ``reload_s``.

The file (YAML or JSON), mode 0600 or stricter::

    tokens:
      - identity: checkout-api      # becomes the source of its labels
        roles: [decide]
        token: "<at least 16 characters; e.g. `python -c 'import secrets; print(secrets.token_hex(32))'`>"
      - identity: chargeback-feed
        roles: [feedback]
        token: "..."
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel as _Schema
from pydantic import ConfigDict, Field, ValidationError, field_validator

from riskserve.platform.errors import ConfigError

__all__ = ["Caller", "Role", "TokenEntry", "TokenFile", "TokenStore", "parse_tokens"]

logger = logging.getLogger(__name__)

Role = Literal["decide", "feedback"]
"""``decide``: Decide, DecideBatch, Describe. ``feedback``: Feedback (labels that train online models)."""


@dataclass(frozen=True)
class Caller:
    """Who made a call, as its token says; the feedback path takes a label's source from ``identity``."""

    identity: str
    roles: frozenset[str]


class TokenEntry(_Schema):
    """One bearer token: the identity it stands for and the roles it grants."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    identity: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.@:-]{0,127}$")
    """Name of the caller (a service, a feed); the ``source`` of its labels and its rate-limit key."""
    roles: list[Role] = Field(min_length=1)
    """What the token may call."""
    token: str = Field(min_length=16, max_length=512, pattern=r"^[\x21-\x7e]+$")
    """The secret, printable ASCII without spaces (it travels as ``authorization: Bearer <token>``)."""


class TokenFile(_Schema):
    """The whole token table."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tokens: list[TokenEntry] = Field(min_length=1)

    @field_validator("tokens")
    @classmethod
    def _unique(cls, tokens: list[TokenEntry]) -> list[TokenEntry]:
        seen: set[str] = set()
        for entry in tokens:
            if entry.token in seen:
                raise ValueError(f"a token is listed twice (identity '{entry.identity}')")
            seen.add(entry.token)
        return tokens


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


def parse_tokens(text: str, *, source: str) -> list[tuple[bytes, Caller]]:
    """The token table in ``text`` (YAML or JSON) as (digest, caller) pairs.

    Raises:
        ConfigError: not a valid table, naming ``source`` and the first bad path (never a token's value).
    """
    try:
        table = TokenFile.model_validate(yaml.safe_load(text))
    except yaml.YAMLError as error:
        raise ConfigError(f"{source}: not YAML or JSON ({type(error).__name__})") from None
    except ValidationError as error:
        # Name each problem's path and message only: pydantic's input echo would print a secret.
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in error.errors())
        raise ConfigError(f"{source}: {problems}") from None
    return [(_digest(e.token), Caller(e.identity, frozenset(e.roles))) for e in table.tokens]


def _file_key(status: os.stat_result) -> tuple[int, ...]:
    """What changes when the file is replaced, edited or chmod-ed (ctime moves on a chmod)."""
    return (status.st_ino, status.st_dev, status.st_size, status.st_mtime_ns, status.st_ctime_ns)


class TokenStore:
    """The current token table; :meth:`lookup` is pure memory, :meth:`refresh` re-reads a changed file.

    A file that changes into something invalid (a half-written edit, a wrong mode) is refused with an
    error in the log and the last good table stays; write the file whole and rename it into place.
    """

    def __init__(
        self,
        *,
        path: Path | None = None,
        env: str | None = None,
        reload_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """Exactly one of ``path`` and ``env``.

        Raises:
            ConfigError: no table, an invalid one, or a file other users may read or write.
        """
        if (path is None) == (env is None):
            raise ConfigError("tokens: name exactly one of a tokens file and a tokens environment variable")
        self._path = path
        self._reload_s = reload_s
        self._clock = clock
        self._checked_at = clock()
        self._key: tuple[int, ...] | None = None
        self.reloads = 0
        """Successful re-reads after the first load (tests and logs)."""
        self.errors = 0
        """Changed files refused (the last good table kept)."""
        if env is not None:
            text = os.environ.get(env)
            if not text:
                raise ConfigError(f"tokens: the environment variable {env} is not set or empty")
            self._table = parse_tokens(text, source=f"${env}")
        else:
            self._table = self._read()

    def _read(self) -> list[tuple[bytes, Caller]]:
        assert self._path is not None
        try:
            with self._path.open("rb") as handle:
                status = os.fstat(handle.fileno())
                if status.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
                    mode = stat.S_IMODE(status.st_mode)
                    raise ConfigError(
                        f"{self._path}: mode {mode:04o} lets other users read the tokens; chmod 600 it"
                    )
                text = handle.read().decode()
        except OSError as error:
            raise ConfigError(f"{self._path}: cannot read the tokens: {error.strerror}") from error
        except UnicodeDecodeError as error:
            raise ConfigError(f"{self._path}: not UTF-8 text") from error
        table = parse_tokens(text, source=str(self._path))
        self._key = _file_key(status)
        return table

    def refresh(self) -> bool:
        """Re-read the file if ``reload_s`` passed since the last check and it changed; True if reloaded."""
        if self._path is None:
            return False
        now = self._clock()
        if now - self._checked_at < self._reload_s:
            return False
        self._checked_at = now
        try:
            key = _file_key(self._path.stat())
        except OSError as error:
            if self._key is not None:
                logger.error("tokens file %s: %s; keeping the last good tokens", self._path, error.strerror)
                self.errors += 1
                self._key = None
            return False
        if key == self._key:
            return False
        try:
            self._table = self._read()
        except ConfigError as error:
            logger.error("tokens file changed but is refused (%s); keeping the last good tokens", error)
            self._key = key  # do not log the same bad file every second
            self.errors += 1
            return False
        self.reloads += 1
        logger.info("tokens file %s reloaded: %d tokens", self._path, len(self._table))
        return True

    def lookup(self, token: str) -> Caller | None:
        """The caller ``token`` stands for, or ``None``; compares with every digest in constant time."""
        presented = _digest(token)
        found: Caller | None = None
        for digest, caller in self._table:
            if hmac.compare_digest(presented, digest):
                found = caller
        return found
