"""Publish a model version (a swap, a rollback, a learned version) or a pipeline's shadows by writing the
versions record, then wait until every live replica says it serves it. Nothing is redeployed: the replicas
pull the record (:mod:`riskserve.serving.version_watch`), so the pipeline's Serve config never changes
when a version does, and ``serve deploy``, a KubeRay RayService and riskserve agree on it.

The write is a compare-and-set on the record's generation and, for a swap, on the version the candidate
was verified against (``expected``): two publishers can never undo each other. A replica that refuses the
version (its checks failed on that node) keeps serving the previous one and reports why; the publish then
takes its entry out of the record again, so every replica returns to the previous version, and raises.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from riskserve.operations.served import base_of
from riskserve.platform.errors import Conflict, ModelLoadError, ModelUnavailable, NotFound
from riskserve.platform.runner import ModelStatus
from riskserve.schema.deployments import INGRESS
from riskserve.schema.pipeline import PipelineSpec
from riskserve.serving.version_watch import HEARTBEAT_S
from riskserve.state.versions import (
    HISTORY,
    ModelVersions,
    ReplicaReport,
    Source,
    VersionEntry,
    VersionsRecord,
    VersionsStore,
)

__all__ = [
    "CONFIRM_TIMEOUT_S",
    "LIVE_S",
    "Published",
    "every_replica",
    "model_status",
    "publish_shadows",
    "publish_version",
    "replica_version",
    "wait_for_replicas",
]

CONFIRM_TIMEOUT_S = 30.0
"""How long a publish waits for every live replica to confirm before it says which did not."""
LIVE_S = 10 * HEARTBEAT_S
"""A replica that reported within this many seconds counts as live: a dead one ages out (a replica that
stops takes itself off at once), a busy one (loading an LLM engine beside the serving one) stays."""
_WAIT_S = 0.02


@dataclass(frozen=True)
class Published:
    """What a publish did: the record's new generation, and which live replicas confirmed it."""

    generation: int
    confirmed: list[str]
    unconfirmed: list[str] = field(default_factory=list)
    """Live replicas that had not applied it when the wait ended (they apply it when they can)."""
    seconds: float = 0.0
    """From the write to the last confirmation."""


def model_status(spec: PipelineSpec, model: str) -> ModelStatus:
    """What ``model`` serves now, asked of the ingress (which knows where the model runs)."""
    from ray import serve

    ingress = serve.get_deployment_handle(INGRESS, app_name=spec.name)
    status: ModelStatus = ingress.model_status.remote(model).result(timeout_s=30)
    return status


def every_replica(
    spec: PipelineSpec, model: str, *, timeout_s: float = CONFIRM_TIMEOUT_S
) -> list[ModelStatus]:
    """What EVERY replica of ``model`` serves (one status per replica actor), not a sample.

    Serve's handles pick a replica per call, so replicas are asked until as many distinct ones as the
    model runs (the ingress's replicas for a model placed there) have answered.

    Raises:
        ModelUnavailable: not every replica answered within ``timeout_s``.
    """
    model_spec = spec.models[model]
    replicas = spec.serving.ingress.replicas if model_spec.in_ingress else model_spec.replicas
    seen: dict[str, ModelStatus] = {}
    deadline = time.monotonic() + timeout_s
    while len(seen) < replicas:
        if time.monotonic() > deadline:
            raise ModelUnavailable(f"only {len(seen)} of {replicas} replicas of '{model}' answered")
        status = model_status(spec, model)
        seen[status.actor_id or f"unnamed-{len(seen)}"] = status
    return list(seen.values())


def replica_version(store: VersionsStore, pipeline: str, model: str) -> str | None:
    """The version every live replica of ``model`` reports serving (``None``: none, or they disagree)."""
    versions = {
        r.serving.get(model) for r in store.replicas(pipeline, seen_within_s=LIVE_S) if model in r.models
    }
    return versions.pop() if len(versions) == 1 else None


def _with_entry(
    record: VersionsRecord, model: str, base: str, entry: VersionEntry, expected: str | None
) -> VersionsRecord:
    new = record.model_copy(deep=True)
    served = new.models.get(model)
    if served is None or served.base != base:
        served = ModelVersions(base=base)
    if not served.entries and expected is not None:  # what served before: the YAML's, for a rollback
        served.entries.append(VersionEntry(artifact=base, version=expected, source="yaml", at=entry.at))
    served.entries = [*served.entries, entry][-HISTORY:]
    new.models[model] = served
    return new


def publish_version(
    spec: PipelineSpec,
    store: VersionsStore,
    model: str,
    artifact: str,
    version: str,
    *,
    source: Source,
    expected: str | None = None,
    note: str = "",
    timeout_s: float = CONFIRM_TIMEOUT_S,
) -> Published:
    """Make ``artifact`` (holding ``version``) what ``model`` serves, and wait for every live replica.

    Raises:
        NotFound: no such model.
        Conflict: ``model`` no longer serves ``expected`` (another publish came first): verify again.
        ModelLoadError: a replica refused it; its entry was taken out again, the previous version serves.
    """
    if model not in spec.models:
        raise NotFound(f"pipeline '{spec.name}' has no model '{model}'")
    base = base_of(spec, model)
    entry = VersionEntry(artifact=artifact, version=version, source=source, at=time.time(), note=note)

    def add(record: VersionsRecord) -> VersionsRecord:
        current = record.serving(model, base)
        serving = current.version if current is not None else replica_version(store, spec.name, model)
        if expected is not None and serving is not None and serving != expected:
            raise Conflict(
                f"'{model}' serves {serving}, not {expected} the candidate was verified against: another "
                "publish came first; run it again"
            )
        return _with_entry(record, model, base, entry, expected)

    stored = store.update(spec.name, add)
    assert stored is not None, "add() always writes"
    started = time.monotonic()
    confirmed, refused, unconfirmed = wait_for_replicas(
        store, spec.name, stored.generation, model=model, version=version, timeout_s=timeout_s
    )
    if refused:
        _take_out(store, spec.name, model, entry)
        replica, error = next(iter(refused.items()))
        raise ModelLoadError(
            f"{len(refused)} replica(s) refused {version} ({replica}: {error}); rolled back: the previous "
            "version serves"
        )
    return Published(stored.generation, confirmed, unconfirmed, time.monotonic() - started)


def _take_out(store: VersionsStore, pipeline: str, model: str, entry: VersionEntry) -> None:
    """Remove ``entry`` from ``model``'s history (a refused publish), whatever was written since."""

    def remove(record: VersionsRecord) -> VersionsRecord | None:
        served = record.models.get(model)
        if served is None or entry not in served.entries:
            return None
        new = record.model_copy(deep=True)
        new.models[model].entries = [e for e in served.entries if e != entry]
        return new

    store.update(pipeline, remove)


def publish_shadows(
    spec: PipelineSpec,
    store: VersionsStore,
    shadows: dict[str, dict[str, Any]],
    *,
    timeout_s: float = CONFIRM_TIMEOUT_S,
) -> Published:
    """Make ``shadows`` the pipeline's shadow candidates and wait until every live replica applied them."""
    stored = store.update(spec.name, lambda record: record.model_copy(update={"shadows": dict(shadows)}))
    assert stored is not None
    started = time.monotonic()
    confirmed, _, unconfirmed = wait_for_replicas(store, spec.name, stored.generation, timeout_s=timeout_s)
    return Published(stored.generation, confirmed, unconfirmed, time.monotonic() - started)


def wait_for_replicas(
    store: VersionsStore,
    pipeline: str,
    generation: int,
    *,
    model: str | None = None,
    version: str | None = None,
    timeout_s: float = CONFIRM_TIMEOUT_S,
) -> tuple[list[str], dict[str, str], list[str]]:
    """Wait until every live replica (running ``model``, when given) applied ``generation``.

    Returns the replicas that confirmed, those that refused (serving another version than ``version``:
    replica -> its error) and those that had not applied it when ``timeout_s`` ran out.

    Raises:
        ModelUnavailable: no live replica of the pipeline (or of ``model``) reported within ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        live = [
            r for r in store.replicas(pipeline, seen_within_s=LIVE_S) if model is None or model in r.models
        ]
        if not live:
            if time.monotonic() <= deadline:
                time.sleep(_WAIT_S * 10)
                continue
            what = f"'{model}' of '{pipeline}'" if model else f"'{pipeline}'"
            raise ModelUnavailable(f"no live replica of {what} reported to the versions record")
        applied = [r for r in live if r.generation >= generation]
        confirmed = [r.replica for r in applied if _serves(r, model, version)]
        refused = {
            r.replica: r.error or "serves another version" for r in applied if not _serves(r, model, version)
        }
        pending = [r.replica for r in live if r.generation < generation]
        if not pending or time.monotonic() > deadline:
            return confirmed, refused, pending
        time.sleep(_WAIT_S)


def _serves(report: ReplicaReport, model: str | None, version: str | None) -> bool:
    return model is None or version is None or report.serving.get(model) == version
