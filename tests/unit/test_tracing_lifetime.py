"""The process's tracing lives as long as its last holder: one replica stopping never silences another.

Before, every replica's ``__del__`` called ``shutdown_tracing``, which reset the process's provider for
everyone: an ingress whose in-process feature stage was collected exported nothing more.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from riskserve.features.stage import FeatureStage
from riskserve.platform.tracing import (
    TracingSettings,
    configure_tracing,
    shutdown_tracing,
    start_span,
    tracing_holders,
)
from riskserve.schema.pipeline import load_pipeline

PIPELINES = Path(__file__).resolve().parents[2] / "deploy" / "pipelines"


@pytest.fixture(autouse=True)
def _fresh_tracing() -> Iterator[None]:
    shutdown_tracing()
    yield
    shutdown_tracing()


def _settings(path: Path) -> TracingSettings:
    return TracingSettings(exporter="file", file_path=path, sample_ratio=1.0, service_name="test")


def _names(path: Path) -> list[str]:
    if not path.exists():
        return []
    return [json.loads(line)["name"] for line in path.read_text().splitlines() if line.strip()]


def test_one_holder_releasing_leaves_the_other_tracing(tmp_path: Path) -> None:
    path = tmp_path / "spans.jsonl"
    ingress = configure_tracing(_settings(path))
    stage = configure_tracing(_settings(path))  # a second holder in the same process
    assert tracing_holders() == 2
    stage.release()
    stage.release()  # idempotent: a second release does not take the ingress's lease
    assert tracing_holders() == 1
    with start_span("after-the-stage-stopped"):
        pass
    ingress.release()
    assert tracing_holders() == 0
    with start_span("after-everyone-stopped"):
        pass
    assert _names(path) == ["after-the-stage-stopped"]  # exported, flushed; nothing after the last release


def test_an_in_process_feature_stage_collected_does_not_stop_the_ingress_tracing(tmp_path: Path) -> None:
    path = tmp_path / "spans.jsonl"
    spec = load_pipeline(PIPELINES / "tabular_only.yaml")
    tracing = _settings(path).model_dump(mode="json")
    ingress = configure_tracing(TracingSettings.model_validate(tracing))
    stage = FeatureStage(spec.features.model_dump(mode="json"), tracing)
    assert tracing_holders() == 2
    del stage  # the ingress drops its local stage (reference counting collects it here)
    assert tracing_holders() == 1
    with start_span("ingress-still-tracing"):
        pass
    ingress.release()
    assert _names(path) == ["ingress-still-tracing"]


def test_a_lease_from_before_a_forced_shutdown_is_void(tmp_path: Path) -> None:
    old = configure_tracing(_settings(tmp_path / "old.jsonl"))
    shutdown_tracing()  # process exit hook, or a test resetting the state
    path = tmp_path / "new.jsonl"
    new = configure_tracing(_settings(path))
    old.release()  # must not close the provider the new holder installed
    assert tracing_holders() == 1
    with start_span("still-exported"):
        pass
    new.release()
    assert _names(path) == ["still-exported"]
