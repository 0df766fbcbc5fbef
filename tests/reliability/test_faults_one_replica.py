"""The fault drill with a single replica of the fraud model (its own ``riskserve up``, after the others'
module has stopped its own): ``kill -9`` of it gives fallbacks until Serve has replaced it, never an error."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from . import drills
from .harness import Running, pipeline_file, riskserve_up

pytestmark = [pytest.mark.reliability, pytest.mark.slow]


@pytest.fixture(scope="module")
def one_model_replica(tabular_models: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    """Two ingress replicas and a single replica of the fraud model."""
    root = tmp_path_factory.mktemp("one")
    with riskserve_up(
        pipeline_file(tabular_models, root, fraud_replicas=1, ingress_replicas=2), root
    ) as running:
        yield running


def test_kill_9_of_the_only_model_replica_gives_fallbacks_until_it_is_back_and_no_errors(
    one_model_replica: Running,
) -> None:
    drills.kill_model_replica(one_model_replica.target, replicas=1)
