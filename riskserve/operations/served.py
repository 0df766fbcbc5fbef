"""What each model of a pipeline serves, read from and written to its versions record
(:mod:`riskserve.state.versions`) in the pipeline's state store: the YAML's artifact, a swap, a rollback
or a version the online learner published.

Publishers (:mod:`riskserve.operations.publish`) append entries; every replica pulls the record and serves
its last entry (:mod:`riskserve.serving.version_watch`); ``riskserve up --reset`` forgets it (:func:`reset`).
An entry counts only while the YAML still names the artifact it was recorded over (``base``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from riskserve.platform.artifacts import open_artifact
from riskserve.platform.errors import ArtifactIntegrityError, ConfigError, NotFound
from riskserve.schema.pipeline import PipelineSpec
from riskserve.state.db import open_database
from riskserve.state.versions import VersionEntry, VersionsStore

__all__ = [
    "base_of",
    "check_record",
    "open_versions",
    "record_rollback",
    "reset",
    "served_entries",
]


@contextlib.contextmanager
def open_versions(spec: PipelineSpec) -> Iterator[VersionsStore]:
    """The versions record of ``spec``'s state store, for one operator command (closed after it)."""
    store = VersionsStore(open_database(spec.state_dsn()))
    try:
        yield store
    finally:
        store.db.close()


def base_of(spec: PipelineSpec, model: str) -> str:
    """The YAML artifact (absolute, symlinks resolved) record entries of ``model`` are kept over."""
    return str(spec.artifact_path(model).resolve())


def served_entries(spec: PipelineSpec, store: VersionsStore) -> dict[str, VersionEntry]:
    """The recorded entry each model of ``spec`` serves (models that serve their YAML artifact are absent)."""
    record = store.read(spec.name)
    out = {}
    for name in spec.models:
        entry = record.serving(name, base_of(spec, name))
        if entry is not None:
            out[name] = entry
    return out


def check_record(spec: PipelineSpec, store: VersionsStore) -> dict[str, VersionEntry]:
    """:func:`served_entries`, each local artifact verified again (``riskserve up`` runs this before Ray
    starts, so a recorded artifact that cannot serve is named with the fix, not found by a crash-looping
    replica). Artifact-store URIs are verified by the replicas that fetch them.

    Raises:
        ConfigError: a recorded artifact is missing, damaged or holds another version.
    """
    entries = served_entries(spec, store)
    for name, entry in entries.items():
        if "://" in entry.artifact:
            continue
        try:
            version = open_artifact(entry.artifact, kind=spec.models[name].kind).version
        except ArtifactIntegrityError as error:
            raise ConfigError(
                f"{spec.name}/{name}: the recorded {entry.source} version cannot be served ({error}); "
                "`riskserve up --reset` serves the YAML's artifacts"
            ) from error
        if version != entry.version:
            raise ConfigError(
                f"{spec.name}/{name}: {entry.artifact} holds {version}, the record says {entry.version}; "
                "`riskserve up --reset` serves the YAML's artifacts"
            )
    return entries


def record_rollback(spec: PipelineSpec, store: VersionsStore, model: str) -> VersionEntry:
    """The entry before the current one, which a rollback returns to.

    Raises:
        NotFound: the model has no earlier entry.
    """
    served = store.read(spec.name).models.get(model)
    if served is None or served.base != base_of(spec, model) or len(served.entries) < 2:
        raise NotFound(f"{spec.name}/{model} has no earlier version to roll back to")
    return served.entries[-2]


def reset(spec: PipelineSpec) -> int:
    """Forget what ``spec``'s models served (``riskserve up --reset``): the YAML's artifacts serve next.
    Returns how many models had a recorded version."""
    with open_versions(spec) as store:
        return store.reset(spec.name)
