"""``riskserve swap`` takes candidates only from the pipeline's models root (symlinks resolved)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from riskserve.operations.swap import admit_candidate
from riskserve.platform.errors import InvalidInput, NotFound
from riskserve.schema.pipeline import PipelineSpec, parse_pipeline

PIPELINE = Path(__file__).parents[2] / "deploy" / "pipelines" / "card_fraud.yaml"


def _spec(models: Path, **extra: Any) -> PipelineSpec:
    import yaml

    data = yaml.safe_load(PIPELINE.read_text())
    for name, model in data["models"].items():
        model["artifact"] = str(models / name)
    data["audit"]["path"] = str(models.parent / "audit")  # learned versions: beside it, not in the repo
    return parse_pipeline({**data, **extra}, base_dir=PIPELINE.parent)


@pytest.fixture
def tree(tmp_path: Path) -> dict[str, Path]:
    paths = {
        "models": tmp_path / "models",
        "inside": tmp_path / "models" / "fraud-v2",
        "outside": tmp_path / "elsewhere" / "fraud-evil",
        "link": tmp_path / "models" / "fraud-link",
    }
    for key in ("inside", "outside"):
        paths[key].mkdir(parents=True)
    (paths["models"] / "fraud").mkdir()
    paths["link"].symlink_to(paths["outside"])
    return paths


def test_a_candidate_inside_the_models_root_is_admitted_and_one_elsewhere_is_refused(
    tree: dict[str, Path],
) -> None:
    spec = _spec(tree["models"])  # default root: the directory of the YAML's artifacts
    assert admit_candidate(spec, "fraud", tree["inside"]) == tree["inside"].resolve()
    assert admit_candidate(spec, "fraud", tree["models"] / "fraud") == (tree["models"] / "fraud").resolve()
    with pytest.raises(InvalidInput, match="outside the models root") as info:
        admit_candidate(spec, "fraud", tree["outside"])
    assert info.value.field == "artifact"
    with pytest.raises(InvalidInput, match="outside the models root"):  # a link out of the root
        admit_candidate(spec, "fraud", tree["link"])
    with pytest.raises(InvalidInput):  # a path that climbs out
        admit_candidate(spec, "fraud", tree["models"] / ".." / "elsewhere" / "fraud-evil")
    with pytest.raises(NotFound):
        admit_candidate(spec, "fraud", tree["models"] / "missing")
    with pytest.raises(NotFound):
        admit_candidate(spec, "no-such-model", tree["inside"])


def test_a_configured_models_root_replaces_the_default(tree: dict[str, Path]) -> None:
    spec = _spec(tree["models"], models_root=str(tree["outside"].parent))
    assert admit_candidate(spec, "fraud", tree["outside"]) == tree["outside"].resolve()
    with pytest.raises(InvalidInput):
        admit_candidate(spec, "fraud", tree["inside"])
    assert admit_candidate(spec, "fraud", tree["models"] / "fraud")  # its own YAML artifact, always
    learned = spec.learned_dir("fraud") / "abc123"
    learned.mkdir(parents=True)
    assert admit_candidate(spec, "fraud", learned) == learned.resolve()  # a learned version, always
