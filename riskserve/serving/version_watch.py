"""A replica pulls what it serves: it watches its pipeline's versions record and applies every change.

Every replica that runs a model (each ingress replica for the models placed in it, each model deployment's
replica for its model) holds one :class:`VersionWatcher`. Before the replica serves anything it applies
the record as it stands (so a replica started later, on a restart, a new node or by autoscaling, serves
what the record says, not the YAML's artifact); then it polls the record's generation every ``poll_s``
(one indexed read) and applies a new one: each model whose entry changed is fetched (artifact-store URIs
into the local cache, verified), checked to hold the recorded version, and flipped atomically by its
:class:`~riskserve.platform.runner.ModelRunner`. A candidate that fails keeps the serving version and is
reported. After each generation, and every ``heartbeat_s``, the replica reports what it serves
(:meth:`~riskserve.state.versions.VersionsStore.report`): that report is how a publisher knows every live
replica confirmed, and which did not. Nothing here redeploys anything.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from riskserve.platform.artifact_store import ArtifactStore, fetch_verified
from riskserve.platform.errors import RiskServeError
from riskserve.platform.runner import ModelRunner
from riskserve.state.versions import VersionsRecord, VersionsStore

__all__ = ["HEARTBEAT_S", "POLL_S", "VersionWatcher", "replica_identity"]

logger = logging.getLogger(__name__)

POLL_S = 0.1
"""How often a replica reads the record's generation (one indexed read; ~10 a second per replica)."""
HEARTBEAT_S = 1.0
"""How often a replica reports what it serves when nothing changes (a publisher counts it live)."""

ShadowHook = Callable[[dict[str, dict[str, Any]]], Awaitable[None]]


def replica_identity() -> tuple[str, str]:
    """This replica's id and node (Ray's actor and node ids; a random id outside Ray)."""
    try:
        import ray

        if ray.is_initialized():
            context = ray.get_runtime_context()
            actor = context.get_actor_id()
            if actor:
                return str(actor), str(context.get_node_id())
    except Exception:  # outside Ray (unit tests)
        pass
    return uuid.uuid4().hex, "local"


class VersionWatcher:
    """Keeps ``runners`` serving what the versions record of ``pipeline`` names (see the module)."""

    def __init__(
        self,
        store: VersionsStore,
        pipeline: str,
        runners: Mapping[str, ModelRunner],
        yaml_artifacts: Mapping[str, str],
        *,
        shadows: ShadowHook | None = None,
        poll_s: float = POLL_S,
        heartbeat_s: float = HEARTBEAT_S,
        identity: tuple[str, str] | None = None,
    ) -> None:
        """``yaml_artifacts``: each model's YAML artifact (what serves without a record, and the ``base`` a
        record entry must have been written over); ``shadows``: where the ingress takes the record's shadow
        candidates (``None``: not an ingress); a model's signing key is its runner's."""
        self.store = store
        self.pipeline = pipeline
        self._runners = dict(runners)
        self._yaml = dict(yaml_artifacts)
        self._shadows = shadows
        self._poll_s = poll_s
        self._heartbeat_s = heartbeat_s
        self.replica, self.node = identity or replica_identity()
        self.generation = -1
        """The last generation applied (-1: none yet)."""
        self._error = ""
        self._applied: dict[str, tuple[str, str | None]] = {}
        """Model -> the (artifact, version) last applied: an unchanged entry is not fetched again."""
        self._reported_at = 0.0
        self._task: asyncio.Task[None] | None = None

    async def apply_now(self) -> None:
        """Read the record and apply it (the first call raises if a model cannot load: nothing to serve)."""
        record = await asyncio.to_thread(self.store.read, self.pipeline)
        await self._apply(record)

    async def _apply(self, record: VersionsRecord) -> None:
        errors = []
        for name, runner in self._runners.items():
            entry = record.serving(name, self._yaml[name])
            target = self._yaml[name] if entry is None else entry.artifact
            expected = None if entry is None else entry.version
            if self._applied.get(name) == (target, expected) and runner.ready:
                continue  # another model or the shadows changed: this one stays as it is
            try:
                local = await asyncio.to_thread(_local, runner, target)
                await runner.serve(local, expected)
            except RiskServeError as error:
                if not runner.ready:
                    raise  # the first load: this replica has nothing to serve
                errors.append(f"{name}: {error}")
                continue
            if runner.status().last_swap_error:
                errors.append(f"{name}: {runner.status().last_swap_error}")
            else:
                self._applied[name] = (target, expected)
        if self._shadows is not None:
            await self._shadows(dict(record.shadows))
        self.generation = record.generation
        self._error = "; ".join(errors)
        if errors:
            logger.error("%s: generation %d not fully applied: %s", self.pipeline, record.generation, errors)
        await asyncio.to_thread(self._report)

    def serving(self) -> dict[str, str]:
        """Model -> the version this replica serves now."""
        runners = self._runners.items()
        return {name: str(runner.status().version or "") for name, runner in runners if runner.ready}

    def _report(self) -> None:
        self.store.report(
            self.pipeline,
            self.replica,
            node=self.node,
            models=sorted(self._runners),
            generation=self.generation,
            serving=self.serving(),
            error=self._error,
        )
        self._reported_at = time.monotonic()

    def start(self) -> None:
        """Watch in the background (after :meth:`apply_now`)."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        while True:
            try:
                generation = await asyncio.to_thread(self.store.generation, self.pipeline)
                if generation != self.generation:
                    await self._apply(await asyncio.to_thread(self.store.read, self.pipeline))
                elif time.monotonic() - self._reported_at >= self._heartbeat_s:
                    await asyncio.to_thread(self._report)
            except asyncio.CancelledError:
                raise
            except Exception:  # the store is down: keep serving what is loaded, try again
                logger.warning("%s: cannot read the versions record", self.pipeline, exc_info=True)
                await asyncio.sleep(self._heartbeat_s)
            await asyncio.sleep(self._poll_s)

    async def stop(self) -> None:
        """Stop watching and take this replica off the record's list of live replicas."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        with contextlib.suppress(Exception):
            await asyncio.to_thread(self.store.forget, self.pipeline, self.replica)


def _local(runner: ModelRunner, artifact: str) -> str:
    """A local, verified directory for ``artifact`` (artifact-store URIs are fetched into the cache)."""
    if not ArtifactStore.is_remote(artifact):
        return artifact
    return str(fetch_verified(artifact, kind=runner.artifact_kind, public_key=runner.public_key))
