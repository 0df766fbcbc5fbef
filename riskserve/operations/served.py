"""The one durable record of what each model of a pipeline serves: the YAML's artifact, a swap, a
rollback or a version the online learner published.

One JSON file per pipeline in ``<state>/models/`` (:func:`~riskserve.operations.state.state_dir`),
written atomically (temporary file, fsync, rename, fsync of the directory), so a reader sees the old
record or the new one, never half of one. Every publish that every replica confirmed appends an entry
(:func:`record_served`, called by :func:`~riskserve.operations.publish.publish_checked`, the one way
anything is published); the application builder reads it (:func:`served_artifacts`), so the shutdown
drain, ``riskserve up`` after ``down`` and ``riskserve export serve-config`` all serve what it says.
``riskserve up --reset`` deletes it (:func:`reset`): the YAML's artifacts serve again.

An entry counts only while the YAML still names the artifact it was recorded over (``base``): an
operator who points the YAML at another artifact has chosen it, and the record of the old one is ignored.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

from pydantic import BaseModel as _Schema
from pydantic import ConfigDict, ValidationError

from riskserve.operations.state import state_dir
from riskserve.platform.artifacts import open_artifact
from riskserve.platform.errors import ArtifactIntegrityError, ConfigError, NotFound
from riskserve.schema.pipeline import PipelineSpec

__all__ = [
    "HISTORY",
    "RECORD_FORMAT",
    "ServedEntry",
    "ServedModel",
    "ServedRecord",
    "Source",
    "after_rollback",
    "read_record",
    "record_path",
    "record_rollback",
    "record_served",
    "records_dir",
    "reset",
    "served_artifacts",
]

logger = logging.getLogger(__name__)

RECORD_FORMAT: Literal[1] = 1
"""The record's format version; a file of another format is refused, never guessed at."""
HISTORY = 32
"""Entries kept per model (the current one and those a rollback may return to)."""

Source = Literal["yaml", "swap", "rollback", "learned"]


class ServedEntry(_Schema):
    """One artifact a model served: its verified directory, its content version and how it came."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    artifact: str
    """The artifact directory (absolute, symlinks resolved)."""
    version: str
    """The artifact's content version (the hash of its model files), checked again when it is read."""
    source: Source
    at: float
    """Unix time of the publish."""


class ServedModel(_Schema):
    """A model's entries, oldest first: the last one serves."""

    model_config = ConfigDict(extra="forbid")

    base: str
    """The YAML artifact (absolute) the entries were recorded over; a YAML naming another one wins."""
    entries: list[ServedEntry]


class ServedRecord(_Schema):
    """What each model of one pipeline serves (models never published are absent: the YAML's serve)."""

    model_config = ConfigDict(extra="forbid")

    format: Literal[1] = RECORD_FORMAT
    pipeline: str
    models: dict[str, ServedModel] = {}


def records_dir() -> Path:
    """This install's directory of served records (``<state>/models``). A process that writes records for
    another (the feedback service, in a Ray worker) is handed the directory, not left to guess it."""
    return state_dir() / "models"


def record_path(pipeline: str, directory: Path | None = None) -> Path:
    """The record file of ``pipeline`` (in ``directory``, default :func:`records_dir`)."""
    return (directory or records_dir()) / f"{pipeline}.json"


def read_record(pipeline: str, directory: Path | None = None) -> ServedRecord:
    """The record of ``pipeline`` (empty if none was written).

    Raises:
        ConfigError: the file exists but is not a record riskserve wrote (named, with the fix).
    """
    path = record_path(pipeline, directory)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return ServedRecord(pipeline=pipeline)
    except OSError as error:
        raise ConfigError(f"{path}: cannot read the served record: {error}") from error
    try:
        record = ServedRecord.model_validate_json(raw)
    except ValidationError as error:
        raise ConfigError(
            f"{path}: not a served record ({error.errors()[0]['msg']}); `riskserve up --reset` serves "
            "the YAML's artifacts and starts a new one"
        ) from error
    if record.pipeline != pipeline:
        raise ConfigError(f"{path}: the record of '{record.pipeline}', not of '{pipeline}'")
    return record


def _base(spec: PipelineSpec, model: str) -> str:
    return str(spec.artifact_path(model).resolve())


def served_artifacts(spec: PipelineSpec) -> dict[str, str]:
    """The artifact each recorded model of ``spec`` serves (models without a record are absent).

    Each recorded artifact is verified again (manifest and checksums) and must still hold the recorded
    version: an artifact changed on disk since it was published is refused, not served in its place.

    Raises:
        ConfigError: the record is unreadable, or a recorded artifact is missing or changed.
    """
    record = read_record(spec.name)
    out: dict[str, str] = {}
    for name, served in record.models.items():
        if name not in spec.models or not served.entries:
            continue
        if served.base != _base(spec, name):
            logger.warning(
                "%s/%s: the YAML now names %s, not %s the record was kept over: serving the YAML's",
                spec.name,
                name,
                _base(spec, name),
                served.base,
            )
            continue
        current = served.entries[-1]
        try:
            version = open_artifact(current.artifact, kind=spec.models[name].kind).version
        except ArtifactIntegrityError as error:
            raise ConfigError(
                f"{spec.name}/{name}: the recorded artifact cannot be served ({error}); "
                "`riskserve up --reset` serves the YAML's artifacts"
            ) from error
        if version != current.version:
            raise ConfigError(
                f"{spec.name}/{name}: {current.artifact} holds {version}, the record says "
                f"{current.version}; `riskserve up --reset` serves the YAML's artifacts"
            )
        out[name] = current.artifact
    return out


@contextlib.contextmanager
def _locked(pipeline: str, directory: Path | None = None) -> Iterator[None]:
    """The record's read-modify-write, one at a time across processes (waits; a write is quick)."""
    folder = record_path(pipeline, directory).parent
    folder.mkdir(parents=True, exist_ok=True)
    with (folder / f".{pipeline}.lock").open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _write(record: ServedRecord, directory: Path | None) -> None:
    path = record_path(record.pipeline, directory)
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("w") as handle:
        handle.write(record.model_dump_json(indent=2))
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    descriptor = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(descriptor)  # the rename itself survives a power cut
    finally:
        os.close(descriptor)


def record_served(
    spec: PipelineSpec,
    model: str,
    artifact: str,
    version: str,
    *,
    source: Source,
    previous: str | None = None,
    previous_version: str | None = None,
    directory: Path | None = None,
) -> ServedRecord:
    """Append that ``model`` now serves ``artifact`` (``version``), confirmed on every replica.

    ``previous`` (and its version) is what served before: recorded first when the model has no entry
    yet, so a rollback can return to it. ``directory``: where the records are (default :func:`records_dir`).
    """
    base = _base(spec, model)
    with _locked(spec.name, directory):
        record = read_record(spec.name, directory)
        served = record.models.get(model)
        if served is None or served.base != base:
            served = ServedModel(base=base, entries=[])
        now = time.time()
        if not served.entries and previous is not None and previous_version is not None:
            first: Source = "yaml" if str(Path(previous).resolve()) == base else "swap"
            served.entries.append(
                ServedEntry(
                    artifact=str(Path(previous).resolve()), version=previous_version, source=first, at=now
                )
            )
        entry = ServedEntry(artifact=str(Path(artifact).resolve()), version=version, source=source, at=now)
        served.entries = [*served.entries, entry][-HISTORY:]
        record.models[model] = served
        _write(record, directory)
        return record


def record_rollback(spec: PipelineSpec, model: str) -> ServedEntry:
    """The entry before the current one, which a rollback returns to.

    Raises:
        NotFound: the model has no earlier entry.
    """
    served = read_record(spec.name).models.get(model)
    if served is None or served.base != _base(spec, model) or len(served.entries) < 2:
        raise NotFound(f"{spec.name}/{model} has no earlier version to roll back to")
    return served.entries[-2]


def after_rollback(spec: PipelineSpec, model: str) -> None:
    """Once a rollback to the entry before the last is confirmed (and recorded as the newest entry),
    drop the version rolled back from and that duplicate, so the next rollback goes one further back."""
    with _locked(spec.name):
        record = read_record(spec.name)
        served = record.models.get(model)
        if served is None or len(served.entries) < 3:
            return
        *older, _target, _left, newest = served.entries  # [..., A, B, A again]: A serves, B is gone
        served.entries = [*older, newest]
        _write(record, None)


def reset(pipeline: str) -> bool:
    """Forget what ``pipeline`` served (``riskserve up --reset``): the YAML's artifacts serve next.
    Returns whether there was a record."""
    with _locked(pipeline):
        try:
            record_path(pipeline).unlink()
        except FileNotFoundError:
            return False
        return True
