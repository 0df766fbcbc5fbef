"""Overload past capacity, on a real ``riskserve up``: a flood of 600 calls always in flight, from a process
of its own (``tests/reliability/flood.py``), beside the steady load, against ingress replicas that take 16
decisions at once and queue 16 more each, with a fraud model that takes 50 ms a call (``fault_injection``:
the real model, slowed on purpose), so that the flood is surely past capacity on 2 shared cores. What is
past it must be refused promptly with RESOURCE_EXHAUSTED (measured on the steady client's refusals), and the
steady load must decide again within seconds after. The soak floods the default limits."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from riskserve.wrappers import REGISTER_ENV

from . import drills
from .harness import Running, pipeline_file, riskserve_up

pytestmark = [pytest.mark.reliability, pytest.mark.slow]


@pytest.fixture(scope="module")
def small_capacity(tabular_models: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    # fault_injection is a test-only kind: the `riskserve up` processes register it from the environment
    before = os.environ.get(REGISTER_ENV)
    os.environ[REGISTER_ENV] = "tests.fault_injection:register"
    try:
        yield from _small_capacity(tabular_models, tmp_path_factory)
    finally:
        if before is None:
            os.environ.pop(REGISTER_ENV, None)
        else:
            os.environ[REGISTER_ENV] = before


def _small_capacity(tabular_models: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    root = tmp_path_factory.mktemp("overload")
    control = root / "fraud-faults.json"
    control.write_text(json.dumps({"delay_ms": 50}))
    fraud = {"kind": "fault_injection", "settings": {"inner_kind": "sklearn", "control_file": str(control)}}
    ingress = {"max_ongoing_requests": 16, "max_queued_requests": 16}
    grpc = {"max_concurrent_calls": 32}
    path = pipeline_file(
        tabular_models, root, fraud_replicas=2, ingress_replicas=2, fraud=fraud, ingress=ingress, grpc=grpc
    )
    with riskserve_up(path, root) as running:
        yield running


def test_overload_is_refused_promptly_with_resource_exhausted_and_recovers(small_capacity: Running) -> None:
    drills.overload(small_capacity.target)
