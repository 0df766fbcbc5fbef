"""Replicas pull what they serve from the versions record, on both backends (a SQLite file and a real
PostgreSQL server): real scikit-learn artifacts, real :class:`ModelRunner` s, one database connection per
"replica" as separate processes would hold, and :func:`publish_version` waiting for their reports. No Ray:
this is the mechanism itself; the integration tests run it inside Serve replicas."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest
import yaml

from riskserve.operations.publish import publish_version
from riskserve.operations.served import base_of, record_rollback
from riskserve.platform.artifacts import open_artifact
from riskserve.platform.errors import Conflict, ModelLoadError
from riskserve.platform.runner import ModelRunner
from riskserve.schema.pipeline import PipelineSpec, parse_pipeline
from riskserve.serving.version_watch import VersionWatcher
from riskserve.state.db import open_database
from riskserve.state.versions import VersionsStore
from riskserve.wrappers import backend

PIPELINE = Path(__file__).parents[2] / "deploy" / "pipelines" / "tabular_only.yaml"
T = TypeVar("T")


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from riskserve.demo.build import build_demo_models

    root = tmp_path_factory.mktemp("built")
    for seed in (0, 1):
        build_demo_models(root / f"seed{seed}", seed=seed, only=["fraud"], progress=False)
    return {"yaml": root / "seed0" / "fraud", "candidate": root / "seed1" / "fraud"}


@pytest.fixture
def spec(tmp_path: Path, built: dict[str, Path], state_dsn: str) -> PipelineSpec:
    data = yaml.safe_load(PIPELINE.read_text())
    shutil.copytree(built["yaml"], tmp_path / "models" / "fraud")
    data["models"]["fraud"]["artifact"] = str(tmp_path / "models" / "fraud")
    data["models"]["credit"]["artifact"] = str(tmp_path / "models" / "credit")  # never loaded here
    data["state"] = {"dsn": state_dsn}
    return parse_pipeline(data, base_dir=PIPELINE.parent)


def _version(path: Path | str) -> str:
    return open_artifact(path, kind="sklearn").version


class Replica:
    """One replica of the fraud model: its runner, and a watcher on a database connection of its own."""

    def __init__(self, spec: PipelineSpec, name: str) -> None:
        self.runner = ModelRunner("fraud", "sklearn", {}, None, backends=backend)
        store = VersionsStore(open_database(spec.state_dsn()))
        self.watcher = VersionWatcher(
            store, spec.name, {"fraud": self.runner}, {"fraud": base_of(spec, "fraud")},
            poll_s=0.02, heartbeat_s=0.2, identity=(name, "node-" + name),
        )  # fmt: skip

    async def start(self) -> Replica:
        await self.watcher.apply_now()
        self.watcher.start()
        return self

    @property
    def version(self) -> str:
        return str(self.runner.status().version)

    async def stop(self) -> None:
        await self.watcher.stop()
        await self.runner.stop()
        self.watcher.store.db.close()


def _publish(spec: PipelineSpec, store: VersionsStore, artifact: str, version: str, **options: Any) -> Any:
    """:func:`publish_version` of the fraud model off the event loop the replicas' watchers run on."""
    return asyncio.to_thread(publish_version, spec, store, "fraud", artifact, version, **options)


def _run(body: Callable[[], Awaitable[T]]) -> T:
    return asyncio.run(body())


def test_every_replica_serves_a_published_version_and_the_publish_returns_once_both_confirm(
    spec: PipelineSpec, built: dict[str, Path]
) -> None:
    original, candidate = _version(built["yaml"]), _version(built["candidate"])

    async def body() -> Any:
        replicas = [await Replica(spec, name).start() for name in ("a", "b")]
        assert [r.version for r in replicas] == [original, original]  # no record: the YAML's serve
        store = VersionsStore(open_database(spec.state_dsn()))
        published = await _publish(
            spec, store, str(built["candidate"]), candidate, source="swap", expected=original, timeout_s=20
        )
        versions = [r.version for r in replicas]
        for r in replicas:
            await r.stop()
        return published, versions

    published, versions = _run(body)
    assert sorted(published.confirmed) == ["a", "b"]
    assert published.unconfirmed == []
    assert versions == [candidate, candidate]  # both flipped before the publish returned


def test_a_replica_started_later_serves_the_record_not_the_yaml(
    spec: PipelineSpec, built: dict[str, Path]
) -> None:
    original, candidate = _version(built["yaml"]), _version(built["candidate"])

    async def body() -> str:
        first = await Replica(spec, "a").start()
        store = VersionsStore(open_database(spec.state_dsn()))
        await _publish(
            spec, store, str(built["candidate"]), candidate, source="learned", expected=original, timeout_s=20
        )
        await first.stop()
        later = await Replica(spec, "restarted-on-another-node").start()
        version = later.version
        await later.stop()
        return version

    assert _run(body) == candidate


def test_a_version_a_replica_refuses_is_taken_out_and_the_previous_one_serves(
    spec: PipelineSpec, built: dict[str, Path]
) -> None:
    original = _version(built["yaml"])

    async def body() -> tuple[str, list[str]]:
        replicas = [await Replica(spec, name).start() for name in ("a", "b")]
        store = VersionsStore(open_database(spec.state_dsn()))
        with pytest.raises(ModelLoadError, match="refused 0123456789abcdef"):
            # the record names a version the artifact does not hold (changed since): every replica refuses
            await _publish(
                spec,
                store,
                str(built["candidate"]),
                "0123456789abcdef",
                source="swap",
                expected=original,
                timeout_s=20,
            )
        entry = store.read(spec.name).serving("fraud", base_of(spec, "fraud"))
        await asyncio.sleep(0.3)  # the record moved back: nothing to apply, the serving version stays
        versions = [r.version for r in replicas]
        for r in replicas:
            await r.stop()
        return (entry.version if entry else "yaml"), versions

    current, versions = _run(body)
    assert current == original  # the refused entry is gone; the previous (the YAML's) is current again
    assert versions == [original, original]


def test_a_swap_verified_against_a_version_that_no_longer_serves_conflicts(
    spec: PipelineSpec, built: dict[str, Path]
) -> None:
    candidate = _version(built["candidate"])

    async def body() -> int:
        replica = await Replica(spec, "a").start()
        store = VersionsStore(open_database(spec.state_dsn()))
        with pytest.raises(Conflict, match="another publish came first"):
            await _publish(
                spec, store, str(built["candidate"]), candidate, source="swap", expected="feedfacefeedface"
            )
        await replica.stop()
        return store.generation(spec.name)

    assert _run(body) == 0  # nothing was written


def test_rollback_returns_to_the_previous_entry_and_reset_serves_the_yaml(
    spec: PipelineSpec, built: dict[str, Path]
) -> None:
    original, candidate = _version(built["yaml"]), _version(built["candidate"])

    async def body() -> tuple[str, str, str]:
        replica = await Replica(spec, "a").start()
        store = VersionsStore(open_database(spec.state_dsn()))
        await _publish(
            spec, store, str(built["candidate"]), candidate, source="swap", expected=original, timeout_s=20
        )
        swapped = replica.version
        target = record_rollback(spec, store, "fraud")
        assert (target.version, target.source) == (original, "yaml")
        assert store.reset(spec.name) == 1
        for _ in range(100):
            if replica.version == original:
                break
            await asyncio.sleep(0.05)
        after_reset = replica.version
        await replica.stop()
        return swapped, target.artifact, after_reset

    swapped, target, after_reset = _run(body)
    assert swapped == candidate
    assert target == base_of(spec, "fraud")
    assert after_reset == original
