"""Artifact manifests: what is verified before anything is served."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from riskserve.platform.artifacts import MANIFEST_NAME, content_version, open_artifact, write_manifest
from riskserve.platform.errors import ArtifactIntegrityError


@pytest.fixture
def artifact(tmp_path: Path) -> Path:
    (tmp_path / "weights.bin").write_bytes(bytes(range(256)) * 4)
    (tmp_path / "golden.json").write_text('{"x": [[1.0]], "expected": [0.5]}')
    write_manifest(tmp_path, kind="sklearn", files={"weights.bin": "model", "golden.json": "golden"})
    return tmp_path


def test_a_verified_artifact_has_a_version_from_its_model_files_only(artifact: Path) -> None:
    opened = open_artifact(artifact, kind="sklearn")
    entry = opened.manifest.files["weights.bin"]
    assert opened.version == content_version({"weights.bin": entry.sha256})
    (artifact / "golden.json").write_text('{"x": [[2.0]], "expected": [0.7]}')
    write_manifest(artifact, kind="sklearn", files={"weights.bin": "model", "golden.json": "golden"})
    assert open_artifact(artifact, kind="sklearn").version == opened.version


def test_version_is_the_content_not_the_path(
    artifact: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    other = tmp_path_factory.mktemp("other")
    (other / "weights.bin").write_bytes((artifact / "weights.bin").read_bytes())
    write_manifest(other, kind="sklearn", files={"weights.bin": "model"})
    assert open_artifact(other, kind="sklearn").version == open_artifact(artifact, kind="sklearn").version
    (other / "weights.bin").write_bytes(b"different")
    write_manifest(other, kind="sklearn", files={"weights.bin": "model"})
    assert open_artifact(other, kind="sklearn").version != open_artifact(artifact, kind="sklearn").version


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda p: (p / "weights.bin").write_bytes((p / "weights.bin").read_bytes()[:100]), "truncated"),
        (lambda p: (p / "weights.bin").write_bytes(b"\x01" + (p / "weights.bin").read_bytes()[1:]), "sha256"),
        (lambda p: (p / "weights.bin").unlink(), "missing"),
        (lambda p: (p / MANIFEST_NAME).write_text("{not json"), "invalid manifest"),
        (lambda p: (p / MANIFEST_NAME).unlink(), "cannot read"),
    ],
    ids=["truncated", "tampered", "missing-file", "bad-manifest", "no-manifest"],
)
def test_damage_is_refused_with_a_reason(artifact: Path, damage: object, message: str) -> None:
    damage(artifact)  # type: ignore[operator]
    with pytest.raises(ArtifactIntegrityError, match=message):
        open_artifact(artifact, kind="sklearn")


def test_wrong_kind_and_paths_outside_the_artifact_are_refused(artifact: Path) -> None:
    with pytest.raises(ArtifactIntegrityError, match="expected 'treelite'"):
        open_artifact(artifact, kind="treelite")
    manifest = json.loads((artifact / MANIFEST_NAME).read_text())
    manifest["files"]["../outside.bin"] = manifest["files"].pop("weights.bin")
    (artifact / MANIFEST_NAME).write_text(json.dumps(manifest))
    with pytest.raises(ArtifactIntegrityError, match="outside"):
        open_artifact(artifact, kind="sklearn")


def test_unknown_manifest_fields_are_errors(artifact: Path) -> None:
    manifest = json.loads((artifact / MANIFEST_NAME).read_text())
    manifest["fetaure_names"] = ["typo"]
    (artifact / MANIFEST_NAME).write_text(json.dumps(manifest))
    with pytest.raises(ArtifactIntegrityError, match="fetaure_names"):
        open_artifact(artifact, kind="sklearn")


def test_only_listed_files_are_handed_out(artifact: Path) -> None:
    (artifact / "extra.bin").write_bytes(b"x")
    opened = open_artifact(artifact, kind="sklearn")
    with pytest.raises(ArtifactIntegrityError, match="not listed"):
        opened.path("extra.bin")
