"""Fixtures shared by every tier: the demo models, built once per test session."""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.pg_server import PostgresServer, postgres_server

os.environ.setdefault("RISKSERVE_CACHE_DIR", str(Path(__file__).resolve().parents[1] / ".cache"))

REPO = Path(__file__).resolve().parents[1]
PIPELINES = REPO / "deploy" / "pipelines"


@pytest.fixture(scope="session")
def demo_models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """All three demo models (credit, fraud, intent), built by the project's own script.

    ``make test`` runs the unit tests beside the type check, then the rest, in two pytest processes that
    share one build: ``RISKSERVE_TEST_MODELS`` names a fresh directory that the first process to need it
    builds under an exclusive lock and marks complete; the other waits for the lock and reuses it.
    """
    from riskserve.demo.build import build_demo_models

    shared = os.environ.get("RISKSERVE_TEST_MODELS")
    if not shared:
        out = tmp_path_factory.mktemp("models")
        build_demo_models(out, seed=0, progress=False)
        return out
    out = Path(shared)
    out.mkdir(parents=True, exist_ok=True)
    with (out / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / ".complete").exists():
            build_demo_models(out / "models", seed=0, progress=False)
            (out / ".complete").touch()
    return out / "models"


@pytest.fixture(scope="session")
def postgres() -> Iterator[PostgresServer]:
    """One real PostgreSQL server for the whole session (each test takes a database of its own)."""
    with postgres_server() as server:
        yield server


@pytest.fixture(params=["sqlite", "postgresql"])
def state_dsn(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A fresh, empty state database on each backend: a SQLite file, or a new PostgreSQL database."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'state.sqlite'}"
    server: PostgresServer = request.getfixturevalue("postgres")
    return server.new_database()
