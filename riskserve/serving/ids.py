"""Decision ids: 128 random bits each, as hex, from the kernel's CSPRNG read a block at a time.

A decision id is the key a label joins on, so it must not be guessable (a caller who could guess another
caller's id could label that decision). ``uuid4`` gives the same 122+ random bits, but costs a system call
and an object per id: 2,000 of them for a ``DecideBatch`` of 1,000; :func:`random_bytes` costs a system
call per 4 KiB (128 ids).
"""

from __future__ import annotations

from riskserve.platform.entropy import random_bytes

__all__ = ["new_ids"]

_BYTES = 16


def new_ids(count: int) -> list[str]:
    """``count`` distinct-with-overwhelming-probability random ids, 32 lowercase hex characters each."""
    if count <= 0:
        return []
    text = random_bytes(_BYTES * count).hex()
    width = 2 * _BYTES
    return [text[i : i + width] for i in range(0, len(text), width)]
