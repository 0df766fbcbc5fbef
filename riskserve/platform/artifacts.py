"""Model artifacts on disk: a directory of files plus ``manifest.json`` that lists each with its sha256.

Every backend stores its model this way, so verifying an artifact before it is served is one function
(:func:`open_artifact`) and a model's version is always the content hash of its model files.
No artifact format here can execute code when it is read: there is no pickle anywhere.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel as _Schema
from pydantic import ConfigDict, Field, ValidationError

from riskserve.platform.errors import ArtifactIntegrityError

__all__ = [
    "MANIFEST_NAME",
    "Artifact",
    "ArtifactManifest",
    "FileEntry",
    "content_version",
    "default_cache_dir",
    "open_artifact",
    "sha256_bytes",
    "sha256_file",
    "write_manifest",
]

MANIFEST_NAME = "manifest.json"
FORMAT_VERSION: Literal[1] = 1
_CHUNK = 1 << 20

FileRole = Literal["model", "golden", "aux"]


class FileEntry(_Schema):
    """One file of an artifact, as the manifest records it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    """Hex sha256 of the file's bytes."""
    bytes: int = Field(ge=0)
    """Size in bytes; a shorter file is reported as truncated before it is hashed."""
    role: FileRole = "model"
    """``model`` files define the model and its version; ``golden`` is the check set; ``aux``, other."""


class ArtifactManifest(_Schema):
    """``manifest.json``: what the artifact is and the checksum of every file it consists of."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    format_version: Literal[1] = FORMAT_VERSION
    """Manifest schema version."""
    kind: Literal["treelite", "sklearn", "vllm"]
    """The backend that serves this artifact."""
    files: dict[str, FileEntry] = Field(min_length=1)
    """Relative path -> checksum; only listed files are ever read."""
    feature_names: list[str] = Field(default_factory=list)
    """Columns of the feature matrix the model reads, in order (empty for text models)."""
    labels: list[str] = Field(default_factory=list)
    """Class labels: ``["0", "1"]`` for binary scorers, the intent names for the LLM."""
    info: dict[str, Any] = Field(default_factory=dict)
    """Free-form provenance: seed, training rows, held-out quality, parent version."""


def default_cache_dir() -> Path:
    """Cache of derived files (compiled libraries): ``$RISKSERVE_CACHE_DIR`` or ``~/.cache/riskserve``."""
    return Path(os.environ.get("RISKSERVE_CACHE_DIR") or Path.home() / ".cache" / "riskserve")


def sha256_bytes(data: bytes) -> str:
    """Hex sha256 of ``data``."""
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in chunks so large weights do not sit in memory twice."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def content_version(model_file_hashes: Mapping[str, str]) -> str:
    """The version of a model: a short hash over its model files' names and hashes, independent of order."""
    canonical = json.dumps(sorted(model_file_hashes.items()), separators=(",", ":")).encode()
    return sha256_bytes(canonical)[:16]


class Artifact:
    """A verified artifact: its directory, manifest and version. Obtain one from :func:`open_artifact`."""

    def __init__(self, root: Path, manifest: ArtifactManifest) -> None:
        self.root = root
        self.manifest = manifest
        self.version = content_version(
            {name: entry.sha256 for name, entry in manifest.files.items() if entry.role == "model"}
        )

    def path(self, name: str) -> Path:
        """Path of a file the manifest lists; unlisted files are never handed out."""
        if name not in self.manifest.files:
            raise ArtifactIntegrityError(f"{self.root}: '{name}' is not listed in {MANIFEST_NAME}")
        return self.root / name

    def files_with_role(self, role: FileRole) -> list[str]:
        """Names of the listed files with ``role``, sorted."""
        return sorted(name for name, entry in self.manifest.files.items() if entry.role == role)

    def read_json(self, name: str) -> Any:
        """Parse a listed JSON file (already verified by :func:`open_artifact`)."""
        try:
            return json.loads(self.path(name).read_text())
        except (OSError, ValueError) as error:
            raise ArtifactIntegrityError(f"{self.root / name}: not valid JSON: {error}") from error


def _check_file(root: Path, name: str, entry: FileEntry) -> None:
    path = (root / name).resolve()
    if root.resolve() not in path.parents:
        raise ArtifactIntegrityError(f"{root}: manifest entry '{name}' points outside the artifact")
    if not path.is_file():
        raise ArtifactIntegrityError(f"{root}: '{name}' is listed in the manifest but missing")
    size = path.stat().st_size
    if size != entry.bytes:
        what = "truncated" if size < entry.bytes else "longer than recorded"
        raise ArtifactIntegrityError(f"{path}: {what} ({size} bytes, manifest says {entry.bytes})")
    actual = sha256_file(path)
    if actual != entry.sha256:
        raise ArtifactIntegrityError(
            f"{path}: sha256 mismatch (file {actual[:12]}…, manifest {entry.sha256[:12]}…)"
        )


def open_artifact(root: Path | str, *, kind: str) -> Artifact:
    """Read and verify an artifact: manifest schema, kind, and every file's size and sha256.

    Raises:
        ArtifactIntegrityError: anything is missing, malformed, of another kind, or does not match.
    """
    root = Path(root)
    manifest_path = root / MANIFEST_NAME
    try:
        raw = manifest_path.read_text()
    except OSError as error:
        raise ArtifactIntegrityError(f"{root}: cannot read {MANIFEST_NAME}: {error}") from error
    try:
        manifest = ArtifactManifest.model_validate_json(raw)
    except ValidationError as error:
        raise ArtifactIntegrityError(f"{manifest_path}: invalid manifest: {error}") from error
    if manifest.kind != kind:
        raise ArtifactIntegrityError(f"{root}: a '{manifest.kind}' artifact, expected '{kind}'")
    for name, entry in manifest.files.items():
        _check_file(root, name, entry)
    return Artifact(root, manifest)


def write_manifest(
    root: Path | str,
    *,
    kind: Literal["treelite", "sklearn", "vllm"],
    files: Mapping[str, FileRole],
    feature_names: list[str] | None = None,
    labels: list[str] | None = None,
    info: dict[str, Any] | None = None,
) -> ArtifactManifest:
    """Hash the named files under ``root`` and write ``manifest.json`` beside them."""
    root = Path(root)
    entries = {
        name: FileEntry(sha256=sha256_file(root / name), bytes=(root / name).stat().st_size, role=role)
        for name, role in sorted(files.items())
    }
    manifest = ArtifactManifest(
        kind=kind,
        files=entries,
        feature_names=feature_names or [],
        labels=labels or [],
        info=info or {},
    )
    (root / MANIFEST_NAME).write_text(manifest.model_dump_json(indent=2) + "\n")
    return manifest
