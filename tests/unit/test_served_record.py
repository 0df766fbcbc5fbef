"""The served record (``riskserve/operations/served.py``): what each model serves, durable across
``down``/``up``, read by the application builder and by ``export serve-config``, forgotten by ``--reset``.

Real artifacts (the demo's fraud model built with two seeds), real files; no Ray cluster (the Serve
application is built, not run).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from riskserve.operations import served
from riskserve.platform.artifacts import open_artifact
from riskserve.platform.errors import ConfigError, NotFound
from riskserve.schema.pipeline import PipelineSpec, load_pipeline

PIPELINE = Path(__file__).parents[2] / "deploy" / "pipelines" / "tabular_only.yaml"


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from riskserve.demo.build import build_demo_models

    root = tmp_path_factory.mktemp("built")
    for seed in (0, 1):
        build_demo_models(root / f"seed{seed}", seed=seed, only=["fraud"], progress=False)
    return {"yaml": root / "seed0" / "fraud", "candidate": root / "seed1" / "fraud"}


@pytest.fixture
def setup(tmp_path: Path, built: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    monkeypatch.setenv("RISKSERVE_STATE_DIR", str(tmp_path / "state"))
    models = tmp_path / "models"
    shutil.copytree(built["yaml"], models / "fraud")
    shutil.copytree(built["candidate"], models / "candidates" / "fraud")
    data = yaml.safe_load(PIPELINE.read_text())
    data["models"]["fraud"]["artifact"] = str(models / "fraud")
    data["models"]["credit"]["artifact"] = str(models / "credit")  # never built: never read here
    path = tmp_path / "tabular_only.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return {"pipeline": path, "yaml": models / "fraud", "candidate": models / "candidates" / "fraud"}


def _version(path: Path) -> str:
    return open_artifact(path, kind="sklearn").version


def _swap(spec: PipelineSpec, setup: dict[str, Path]) -> None:
    served.record_served(
        spec,
        "fraud",
        str(setup["candidate"]),
        _version(setup["candidate"]),
        source="swap",
        previous=str(setup["yaml"]),
        previous_version=_version(setup["yaml"]),
    )


def test_a_recorded_publish_is_what_the_builder_serves_and_reset_forgets_it(setup: dict[str, Path]) -> None:
    spec = load_pipeline(setup["pipeline"])
    assert served.served_artifacts(spec) == {}  # nothing published: the YAML's serve
    _swap(spec, setup)
    assert served.served_artifacts(spec) == {"fraud": str(setup["candidate"].resolve())}
    data = json.loads(served.record_path("tabular_only").read_text())
    assert data["format"] == served.RECORD_FORMAT
    entries = data["models"]["fraud"]["entries"]
    assert [(e["source"], e["version"]) for e in entries] == [
        ("yaml", _version(setup["yaml"])),  # what served before, so a rollback can return to it
        ("swap", _version(setup["candidate"])),
    ]
    assert [p.name for p in served.record_path("tabular_only").parent.iterdir() if "tmp" in p.name] == []
    assert served.reset("tabular_only") is True
    assert served.served_artifacts(spec) == {}
    assert served.reset("tabular_only") is False


def test_rollback_returns_to_the_entry_before_and_then_has_nowhere_further(setup: dict[str, Path]) -> None:
    spec = load_pipeline(setup["pipeline"])
    with pytest.raises(NotFound, match="no earlier version"):
        served.record_rollback(spec, "fraud")
    _swap(spec, setup)
    target = served.record_rollback(spec, "fraud")
    assert (target.artifact, target.source) == (str(setup["yaml"].resolve()), "yaml")
    # the rollback is a swap to the target (recorded as such), then the entry rolled back from is dropped
    served.record_served(spec, "fraud", target.artifact, target.version, source="rollback")
    served.after_rollback(spec, "fraud")
    entries = served.read_record("tabular_only").models["fraud"].entries
    assert [(e.source, e.version) for e in entries] == [("rollback", _version(setup["yaml"]))]
    with pytest.raises(NotFound):
        served.record_rollback(spec, "fraud")


def test_a_recorded_artifact_changed_on_disk_is_refused_not_served(setup: dict[str, Path]) -> None:
    spec = load_pipeline(setup["pipeline"])
    _swap(spec, setup)
    params = setup["candidate"] / "params.json"
    params.write_text(params.read_text().replace('"alpha": 0.0001', '"alpha": 0.0002'))
    with pytest.raises(ConfigError, match="up --reset"):
        served.served_artifacts(spec)


def test_a_corrupt_record_is_refused_naming_the_file(setup: dict[str, Path]) -> None:
    spec = load_pipeline(setup["pipeline"])
    path = served.record_path("tabular_only")
    path.parent.mkdir(parents=True)
    path.write_text('{"format": 2, "pipeline": "tabular_only"}')
    with pytest.raises(ConfigError, match=str(path)):
        served.served_artifacts(spec)


def test_a_yaml_pointing_at_another_artifact_wins_over_the_record(
    setup: dict[str, Path], tmp_path: Path
) -> None:
    spec = load_pipeline(setup["pipeline"])
    _swap(spec, setup)
    moved = tmp_path / "models" / "fraud-v9"
    shutil.copytree(setup["yaml"], moved)
    data = yaml.safe_load(setup["pipeline"].read_text())
    data["models"]["fraud"]["artifact"] = str(moved)
    setup["pipeline"].write_text(yaml.safe_dump(data, sort_keys=False))
    assert served.served_artifacts(load_pipeline(setup["pipeline"])) == {}


def test_export_serve_config_and_the_app_builder_serve_the_recorded_artifact(setup: dict[str, Path]) -> None:
    from riskserve.operations.app import build_app
    from riskserve.operations.serve_config import serve_config

    spec = load_pipeline(setup["pipeline"])
    (before,) = serve_config([setup["pipeline"]])["applications"]
    assert "artifacts" not in before["args"]
    _swap(spec, setup)
    (app,) = serve_config([setup["pipeline"]])["applications"]
    assert app["args"]["artifacts"] == {"fraud": str(setup["candidate"].resolve())}
    served.reset("tabular_only")  # the cluster has no record of its own: the config carries it
    ingress = build_app(app["args"])._bound_deployment
    assert ingress.user_config["artifacts"]["fraud"] == str(setup["candidate"].resolve())
    assert build_app(before["args"])._bound_deployment.user_config["artifacts"]["fraud"] == str(setup["yaml"])
