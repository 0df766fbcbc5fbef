"""Model artifacts on disk: a directory of files plus ``manifest.json`` that lists each with its sha256.

Every backend stores its model this way, so verifying an artifact before it is served is one function
(:func:`open_artifact`) and a model's version is always the content hash of its model files.
No artifact format here can execute code when it is read: there is no pickle anywhere.

Checksums prove integrity, not origin. With a public key (a pipeline's ``signing.public_key``) the
manifest must also carry an Ed25519 signature (``manifest.json.sig``: the base64 signature of the
manifest's exact bytes, made by :func:`sign_manifest`); the manifest is read once, its signature checked
on those bytes, and only then are they parsed and the files hashed, so nothing of an unsigned or
re-signed artifact is used.
"""

from __future__ import annotations

import base64
import binascii
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
    "SIGNATURE_NAME",
    "Artifact",
    "ArtifactManifest",
    "FileEntry",
    "content_version",
    "default_cache_dir",
    "default_state_dir",
    "load_public_key",
    "open_artifact",
    "sha256_bytes",
    "sha256_file",
    "sign_manifest",
    "write_manifest",
]

MANIFEST_NAME = "manifest.json"
SIGNATURE_NAME = "manifest.json.sig"
"""The base64 Ed25519 signature of ``manifest.json``'s bytes, beside it."""
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


def default_state_dir() -> Path:
    """The install's operating state (local deployment record, locks, the embedded state database):
    ``$RISKSERVE_STATE_DIR`` or ``<cache>/local``."""
    return Path(os.environ.get("RISKSERVE_STATE_DIR") or default_cache_dir() / "local")


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


def open_artifact(root: Path | str, *, kind: str, public_key: bytes | None = None) -> Artifact:
    """Read and verify an artifact: its signature (with ``public_key``: raw 32-byte Ed25519), manifest
    schema, kind, and every file's size and sha256.

    Raises:
        ArtifactIntegrityError: anything is missing, malformed, unsigned or badly signed, of another
            kind, or does not match.
    """
    root = Path(root)
    manifest_path = root / MANIFEST_NAME
    try:
        data = manifest_path.read_bytes()  # once: the bytes whose signature is checked are those parsed
    except OSError as error:
        raise ArtifactIntegrityError(f"{root}: cannot read {MANIFEST_NAME}: {error}") from error
    if public_key is not None:
        _check_signature(root, data, public_key)
    try:
        raw = data.decode()
    except UnicodeDecodeError as error:
        raise ArtifactIntegrityError(f"{manifest_path}: not UTF-8: {error}") from error
    try:
        manifest = ArtifactManifest.model_validate_json(raw)
    except ValidationError as error:
        raise ArtifactIntegrityError(f"{manifest_path}: invalid manifest: {error}") from error
    if manifest.kind != kind:
        raise ArtifactIntegrityError(f"{root}: a '{manifest.kind}' artifact, expected '{kind}'")
    for name, entry in manifest.files.items():
        _check_file(root, name, entry)
    return Artifact(root, manifest)


def _check_signature(root: Path, manifest: bytes, public_key: bytes) -> None:
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    try:
        signature = base64.b64decode((root / SIGNATURE_NAME).read_bytes().strip(), validate=True)
    except OSError as error:
        raise ArtifactIntegrityError(f"{root}: unsigned: cannot read {SIGNATURE_NAME}: {error}") from error
    except binascii.Error as error:
        raise ArtifactIntegrityError(f"{root / SIGNATURE_NAME}: not base64: {error}") from error
    try:
        Ed25519PublicKey.from_public_bytes(public_key).verify(signature, manifest)
    except (InvalidSignature, ValueError) as error:
        raise ArtifactIntegrityError(
            f"{root}: the signature of {MANIFEST_NAME} does not verify with the pipeline's key"
        ) from error


def load_public_key(path: Path | str) -> bytes:
    """The raw 32 bytes of an Ed25519 public key in a PEM file (``openssl pkey -pubout``).

    Raises:
        ConfigError: the file cannot be read or is not an Ed25519 public key.
    """
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat, load_pem_public_key

    from riskserve.platform.errors import ConfigError

    try:
        key = load_pem_public_key(Path(path).read_bytes())
    except (OSError, ValueError) as error:
        raise ConfigError(f"{path}: cannot read an Ed25519 public key: {error}") from error
    if not isinstance(key, Ed25519PublicKey):
        raise ConfigError(f"{path}: not an Ed25519 public key ({type(key).__name__})")
    return key.public_bytes(Encoding.Raw, PublicFormat.Raw)


def sign_manifest(root: Path | str, private_key_pem: bytes) -> None:
    """Sign ``root/manifest.json`` with an Ed25519 private key (unencrypted PEM) into its ``.sig`` file."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from cryptography.hazmat.primitives.serialization import load_pem_private_key

    key = load_pem_private_key(private_key_pem, password=None)
    if not isinstance(key, Ed25519PrivateKey):
        raise TypeError(f"not an Ed25519 private key ({type(key).__name__})")
    root = Path(root)
    signature = key.sign((root / MANIFEST_NAME).read_bytes())
    (root / SIGNATURE_NAME).write_bytes(base64.b64encode(signature) + b"\n")


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
