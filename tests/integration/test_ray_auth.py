"""``up --address`` joins only a Ray cluster that checks tokens: the session's cluster runs without Ray
token authentication (``RAY_AUTH_MODE=disabled``, see conftest), so riskserve must refuse to deploy to it.
The token-mode side (a cluster that does refuse) is tests/e2e/test_closed_by_default.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from riskserve.operations.ray_auth import install_token, refuses_without_token

from ..conftest import PIPELINES
from .conftest import ServeCluster

pytestmark = pytest.mark.slow


def _gcs_address() -> str:
    import ray

    return str(ray.get_runtime_context().gcs_address)


def test_a_cluster_without_token_auth_answers_a_call_without_a_token(serve_cluster: ServeCluster) -> None:
    assert not refuses_without_token(_gcs_address())


def test_up_address_refuses_a_cluster_that_accepts_calls_without_a_token(
    serve_cluster: ServeCluster, tmp_path: Path
) -> None:
    token = install_token(tmp_path / "state")
    command = [
        sys.executable, "-m", "riskserve.cli", "up", str(PIPELINES / "tabular_only.yaml"),
        "--address", _gcs_address(), "--ray-token-file", str(token),
    ]  # fmt: skip
    done = subprocess.run(command, env=dict(os.environ), capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "accepts calls without a token" in done.stderr
