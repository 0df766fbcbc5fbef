"""Fixtures of the fault drills: the two tabular demo models, built once per session."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tabular_models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The credit (XGBoost) and fraud (logistic regression) demo models, by the project's own script."""
    from riskserve.demo.build import build_demo_models

    out = tmp_path_factory.mktemp("models")
    build_demo_models(out, seed=0, only=("credit", "fraud"), progress=False)
    return out
