"""Fixtures shared by every tier: the demo models, built once per test session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("RISKSERVE_CACHE_DIR", str(Path(__file__).resolve().parents[1] / ".cache"))

REPO = Path(__file__).resolve().parents[1]
PIPELINES = REPO / "deploy" / "pipelines"


@pytest.fixture(scope="session")
def demo_models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """All three demo models (credit, fraud, intent), built by the project's own script."""
    from riskserve.demo.build import build_demo_models

    out = tmp_path_factory.mktemp("models")
    build_demo_models(out, seed=0, progress=False)
    return out
