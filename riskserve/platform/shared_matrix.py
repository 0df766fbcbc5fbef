"""A feature matrix handed to a model: where its bytes live, and evidence that a model read them in place.

A model in its own Serve deployment gets a large matrix through Ray's object store (:class:`SharedMatrix`,
``ray.put`` once, read without a copy on the same node); :class:`InputSeen` records where the bytes a
model read live, so tests can prove it was the shared buffer and not a copy.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import ray

from riskserve.platform.validation import FeatureMatrix

__all__ = ["InputInfo", "InputSeen", "SharedMatrix"]


@dataclass(frozen=True)
class SharedMatrix:
    """A feature matrix in the object store; the ref is boxed so Ray Serve passes it unresolved."""

    ref: ray.ObjectRef  # type: ignore[type-arg]
    rows: int
    columns: tuple[str, ...]
    batch_id: str
    """Unique per encoded batch, so each model's :class:`InputInfo` can be matched to it."""


@dataclass(frozen=True)
class InputInfo:
    """How the model received its input: evidence that it read the shared buffer, not a copy.

    ``mapping``/``inode``/``file_offset`` locate the buffer in this process's memory map: two processes
    reading one shared-memory object show the same object-store file, inode and offset.
    """

    read_only: bool
    owns_data: bool
    copied_for_columns: bool
    mapping: str
    inode: int
    file_offset: int

    @classmethod
    def of(cls, array: FeatureMatrix, *, copied_for_columns: bool) -> InputInfo:
        """Describe where ``array``'s bytes live."""
        return InputSeen.of(array, copied_for_columns=copied_for_columns).resolve()


@dataclass(frozen=True)
class InputSeen:
    """What a call records about its input: the buffer's address and flags. Finding the mapping
    (parsing ``/proc/self/maps``, 1-5 ms in a replica, more than the model) waits until someone asks;
    the object store's mapping stays in place for the life of the process."""

    address: int
    read_only: bool
    owns_data: bool
    copied_for_columns: bool

    @classmethod
    def of(cls, array: FeatureMatrix, *, copied_for_columns: bool) -> InputSeen:
        """Record ``array``'s address and flags (cheap: no system call)."""
        return cls(
            address=int(array.__array_interface__["data"][0]),
            read_only=not array.flags.writeable,
            owns_data=bool(array.flags.owndata),
            copied_for_columns=copied_for_columns,
        )

    def resolve(self) -> InputInfo:
        """The full description, with the mapping that holds the address now."""
        mapping, inode, offset = _locate(self.address)
        return InputInfo(
            read_only=self.read_only,
            owns_data=self.owns_data,
            copied_for_columns=self.copied_for_columns,
            mapping=mapping,
            inode=inode,
            file_offset=offset,
        )


def _locate(address: int) -> tuple[str, int, int]:
    """The memory-mapped file, inode and file offset holding ``address`` (Linux ``/proc/self/maps``)."""
    maps = Path("/proc/self/maps")
    if not maps.exists():
        return "", 0, -1
    for line in maps.read_text().splitlines():
        parts = line.split(maxsplit=5)
        low, high = (int(v, 16) for v in parts[0].split("-"))
        if low <= address < high:
            return (parts[5] if len(parts) > 5 else ""), int(parts[4]), int(parts[2], 16) + address - low
    return "", 0, -1
