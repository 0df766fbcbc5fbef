"""Fault drills against a real ``riskserve up`` (real Ray, real processes), each with a reconciling client:
every request sent ends in one outcome from the drill's allowed set, none hangs past its deadline, and
every acknowledged label is still there afterwards. ``make reliability`` runs them; RELIABILITY.md has
their pass rules and the figures measured."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from . import drills
from .harness import Running, pipeline_file, riskserve_up

pytestmark = [pytest.mark.reliability, pytest.mark.slow]


@pytest.fixture(scope="module")
def two_of_each(tabular_models: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    """Two ingress replicas and two replicas of the fraud model (in its own deployment)."""
    root = tmp_path_factory.mktemp("two")
    with riskserve_up(
        pipeline_file(tabular_models, root, fraud_replicas=2, ingress_replicas=2), root
    ) as running:
        yield running


def test_kill_9_of_one_of_two_model_replicas_costs_no_decision_no_fallback_and_no_label(
    two_of_each: Running,
) -> None:
    drills.kill_model_replica(two_of_each.target, replicas=2)


def test_kill_9_of_one_of_two_ingress_replicas_costs_only_its_calls_in_flight_which_retry(
    two_of_each: Running,
) -> None:
    drills.kill_ingress_replica(two_of_each.target, replicas=2, audit=two_of_each.audit)


def test_a_hung_model_replica_is_put_aside_within_seconds_and_replaced_by_its_health_check(
    two_of_each: Running,
) -> None:
    drills.hang_model_replica(two_of_each.target, replicas=2)
