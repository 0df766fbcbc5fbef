"""Random bytes from the kernel's CSPRNG, read in blocks: one ``getrandom`` call per 4 KiB, not per id.

Every decision takes 32 random bytes (its decision id and its trace id). ``os.urandom`` is a system call,
and on the machines riskserve was measured on a system call in the decision path costs 4-8 µs once the
gRPC server's own calls have cooled the caches, against well under 1 µs to slice a block. The bytes are the
same bytes ``os.urandom`` gives, only fetched ahead: as unguessable, each handed out once. A forked child
starts with an empty block (it must never hand out its parent's bytes), and a lock keeps threads apart.
"""

from __future__ import annotations

import os
import threading

__all__ = ["random_bytes"]

_BLOCK = 4096
"""Bytes fetched per system call (a page: the kernel fills it in one call)."""


class _Pool:
    """The unread rest of one block from ``os.urandom``."""

    __slots__ = ("block", "lock", "position")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.block = b""
        self.position = 0

    def take(self, count: int) -> bytes:
        """``count`` fresh random bytes (bigger requests than a block go to the kernel directly)."""
        if count > _BLOCK:
            return os.urandom(count)
        with self.lock:
            start = self.position
            if start + count > len(self.block):
                self.block, start = os.urandom(_BLOCK), 0
            self.position = start + count
            return self.block[start : start + count]

    def forget(self) -> None:
        """Drop the block (in a forked child: its bytes are the parent's)."""
        self.lock = threading.Lock()
        self.block, self.position = b"", 0


_POOL = _Pool()
os.register_at_fork(after_in_child=_POOL.forget)


def random_bytes(count: int) -> bytes:
    """``count`` bytes from the kernel's CSPRNG, never handed out before in this process or its parent."""
    return _POOL.take(count)
