"""Artifacts by URI: a store every node of a cluster can read, and a local cache replicas serve from.

An artifact (see :mod:`riskserve.platform.artifacts`) lives at ``<root>/<kind>/<version>/``, where the root is
a directory on a shared volume or any ``fsspec`` URI (``s3://``, ``gs://``, ``file://``, ``memory://``).
Publishing never shows a half-written copy: a directory root gets a temporary sibling renamed into place;
an object store gets every file first and ``manifest.json`` last, so a reader that sees the manifest sees
every file it lists.

A replica knows only a URI. :func:`fetch_verified` downloads it into
``<cache_dir>/<sha256 of the manifest's bytes>/`` (a temporary directory renamed into place after
:func:`~riskserve.platform.artifacts.open_artifact` verified it) and returns that directory. The manifest
pins every file's sha256, so its hash is a content key: two URIs with the same content share one entry, and
an object changed under the same URI has another manifest, hence another entry, never stale bytes. An entry
already in the cache is verified again before it is handed out. A plain path (no scheme) is verified and
served in place, as on one machine.

``fsspec`` is imported inside the functions that need it, so this module imports without it.
"""

from __future__ import annotations

import errno
import logging
import os
import posixpath
import shutil
import tempfile
import time
import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, BinaryIO

from pydantic import ValidationError

from riskserve.platform.artifacts import (
    MANIFEST_NAME,
    SIGNATURE_NAME,
    ArtifactManifest,
    default_cache_dir,
    open_artifact,
    sha256_bytes,
)
from riskserve.platform.durable import fsync_dir, fsync_file
from riskserve.platform.errors import ArtifactIntegrityError, ConfigError, RiskServeError

if TYPE_CHECKING:
    from fsspec import AbstractFileSystem

__all__ = ["ArtifactStore", "fetch_verified"]

logger = logging.getLogger(__name__)

_TMP_PREFIX = ".tmp-"
"""Temporary directories (downloads, copies being published, entries being replaced) start with this."""
_STALE_TMP_SECONDS = 3600.0
"""A temporary directory older than this was left by a crashed process: removed when a store starts."""
_MAX_MANIFEST_BYTES = 16 << 20
"""A manifest larger than this is refused before it is read whole (it lists files, it holds none)."""
_CHUNK = 1 << 20
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


class ArtifactStore:
    """Where artifacts live (a directory or an fsspec URI) and the local cache replicas serve them from."""

    def __init__(self, root: str, *, cache_dir: Path | None = None) -> None:
        """A store at ``root``; prepares the private cache and removes temporaries crashed processes left.

        Args:
            root: a plain absolute path (a shared volume) or an fsspec URI (``memory://bucket/riskserve``,
                ``file:///x``, ``s3://b/p``).
            cache_dir: the local cache of fetched artifacts; ``default_cache_dir() / "artifacts"``.

        Raises:
            ConfigError: ``root`` is a relative path, or the cache belongs to another user.
        """
        if self.is_remote(root):
            while root.endswith("/") and not root.endswith("://"):
                root = root[:-1]
        else:
            if not Path(root).is_absolute():
                raise ConfigError(f"artifact store root '{root}': a plain root must be an absolute path")
            root = str(Path(root))
            _remove_stale_temporaries(Path(root).glob(f"*/{_TMP_PREFIX}*"))
        self.root = root
        self.cache_dir = cache_dir if cache_dir is not None else default_cache_dir() / "artifacts"
        _private_cache(self.cache_dir)

    @staticmethod
    def is_remote(uri: str) -> bool:
        """Whether ``uri`` has a scheme (``file://`` included) and so is read through fsspec."""
        return "://" in uri

    def uri_of(self, kind: str, version: str) -> str:
        """The URI of version ``version`` of a ``kind`` artifact in this store."""
        for segment in (kind, version):
            if not segment or segment in {".", ".."} or "/" in segment or "\\" in segment:
                raise ValueError(f"'{segment}' cannot name a directory of the artifact store")
        if self.is_remote(self.root):
            return f"{self.root}/{kind}/{version}"
        return str(Path(self.root) / kind / version)

    def put(self, local_dir: Path | str, *, kind: str, public_key: bytes | None = None) -> str:
        """Verify the local artifact, publish it at ``<root>/<kind>/<version>/`` and return its URI.

        The copy is verified again before it is published, so what the store holds is what was checked.
        Idempotent: a version already in the store that verifies is not copied again.

        Raises:
            ArtifactIntegrityError: the local artifact does not verify, or the store cannot be written.
        """
        version = open_artifact(local_dir, kind=kind, public_key=public_key).version
        uri = self.uri_of(kind, version)
        if self.is_remote(uri):
            self._put_remote(Path(local_dir), uri, kind=kind, public_key=public_key)
        else:
            self._put_directory(Path(local_dir), Path(uri), kind=kind, public_key=public_key)
        return uri

    def fetch(self, uri: str, *, kind: str, public_key: bytes | None = None) -> Path:
        """A local, verified directory holding the artifact at ``uri`` (see :func:`fetch_verified`)."""
        return _fetch(uri, kind=kind, public_key=public_key, cache_dir=self.cache_dir)

    def _put_directory(self, local_dir: Path, final: Path, *, kind: str, public_key: bytes | None) -> None:
        """Copy into a temporary sibling of ``final``, fsync it, verify it and rename it into place."""
        if final.is_dir() and _verifies(final, kind, public_key):
            return
        parent = final.parent
        try:
            created = not parent.is_dir()
            parent.mkdir(parents=True, exist_ok=True)
            if created:
                fsync_dir(parent.parent)
            staging = parent / f"{_TMP_PREFIX}{uuid.uuid4().hex}"
            staging.mkdir()  # the umask's mode, not 0700: other nodes' users may read the volume
        except OSError as error:
            raise ArtifactIntegrityError(f"{final}: cannot write the artifact store: {error}") from error
        try:
            try:
                _copy_artifact(local_dir, staging, private=False)
            except OSError as error:
                raise ArtifactIntegrityError(f"{final}: cannot copy {local_dir}: {error}") from error
            _check_copy(local_dir, staging, kind, public_key)
            _install(staging, final, kind, public_key)
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    def _put_remote(self, local_dir: Path, uri: str, *, kind: str, public_key: bytes | None) -> None:
        """Upload a verified local copy: every file under the final prefix, ``manifest.json`` last.

        The verified copy then becomes this node's cache entry, as a fetch of ``uri`` would make it."""
        try:  # the objects themselves are checked, not this node's cache entry of them
            _fetch(uri, kind=kind, public_key=public_key, cache_dir=self.cache_dir, trust_cache=False)
        except ArtifactIntegrityError as error:
            logger.debug("%s: not in the store yet or does not verify (%s): uploading it", uri, error)
        else:
            return
        staging = Path(tempfile.mkdtemp(prefix=_TMP_PREFIX, dir=self.cache_dir))
        try:
            try:
                _copy_artifact(local_dir, staging, private=True)
            except OSError as error:
                raise ArtifactIntegrityError(f"{uri}: cannot copy {local_dir}: {error}") from error
            manifest = _check_copy(local_dir, staging, kind, public_key)
            with _remote_errors(uri, "cannot write the artifact store"):
                fs, base = _filesystem(uri)
                names = [*sorted(manifest.files), SIGNATURE_NAME]
                for name in names:
                    _upload(fs, staging / name, f"{base}/{name}")
                if not (staging / SIGNATURE_NAME).is_file() and fs.exists(f"{base}/{SIGNATURE_NAME}"):
                    fs.rm_file(f"{base}/{SIGNATURE_NAME}")  # a stale one would make a keyed fetch fail
                _upload(fs, staging / MANIFEST_NAME, f"{base}/{MANIFEST_NAME}")
            key = sha256_bytes((staging / MANIFEST_NAME).read_bytes())
            _install(staging, self.cache_dir / key, kind, public_key)
        finally:
            shutil.rmtree(staging, ignore_errors=True)


def fetch_verified(
    uri: str, *, kind: str, public_key: bytes | None = None, cache_dir: Path | None = None
) -> Path:
    """A local, verified directory holding the artifact at ``uri``; what a replica calls (it knows only URIs).

    A plain path (no scheme) is verified and returned in place. Any URI with a scheme is downloaded into
    ``cache_dir/<sha256 of manifest.json's bytes>/`` through a temporary directory, verified (the signature
    too, with ``public_key``) and only then renamed into place and returned. An existing entry is verified
    again first and fetched again if it fails; a download that fails midway leaves no entry.

    Args:
        uri: a path or an fsspec URI of an artifact directory.
        kind: the backend the artifact must be for.
        public_key: raw Ed25519 key the manifest's signature must verify with; ``None``: checksums only.
        cache_dir: the local cache; ``default_cache_dir() / "artifacts"``.

    Raises:
        ArtifactIntegrityError: the artifact cannot be read or does not verify; the message names ``uri``.
    """
    return _fetch(uri, kind=kind, public_key=public_key, cache_dir=cache_dir)


def _fetch(
    uri: str, *, kind: str, public_key: bytes | None, cache_dir: Path | None, trust_cache: bool = True
) -> Path:
    """:func:`fetch_verified`; ``trust_cache=False`` downloads and verifies the objects even when a
    verified entry of the same content is already in the cache (a ``put`` checking the store)."""
    if not ArtifactStore.is_remote(uri):
        open_artifact(uri, kind=kind, public_key=public_key)
        return Path(uri)
    cache = cache_dir if cache_dir is not None else default_cache_dir() / "artifacts"
    _private_cache(cache)
    with _remote_errors(uri, "cannot fetch"):
        fs, base = _filesystem(uri)
        manifest_bytes = _read_manifest(fs, f"{base}/{MANIFEST_NAME}")
    entry = cache / sha256_bytes(manifest_bytes)
    if trust_cache and entry.is_dir() and _verifies(entry, kind, public_key):
        return entry
    staging = Path(tempfile.mkdtemp(prefix=_TMP_PREFIX, dir=cache))
    try:
        with _remote_errors(uri, "cannot fetch"):
            _download(fs, base, manifest_bytes, staging)
        try:
            open_artifact(staging, kind=kind, public_key=public_key)
        except ArtifactIntegrityError as error:
            message = str(error).replace(str(staging), uri)  # name the object, not the temporary copy
            raise ArtifactIntegrityError(message if uri in message else f"{uri}: {message}") from error
        _install(staging, entry, kind, public_key)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return entry


def _filesystem(uri: str) -> tuple[AbstractFileSystem, str]:
    """The fsspec filesystem of ``uri`` and the path in it, without a trailing slash."""
    from fsspec.core import url_to_fs

    fs, path = url_to_fs(uri)
    return fs, str(path).rstrip("/")


@contextmanager
def _remote_errors(uri: str, what: str) -> Iterator[None]:
    """Turn whatever a storage backend raises (each has its own errors) into ArtifactIntegrityError."""
    try:
        yield
    except ArtifactIntegrityError as error:
        if uri in str(error):
            raise
        raise ArtifactIntegrityError(f"{uri}: {error}") from error
    except RiskServeError:
        raise
    except Exception as error:
        raise ArtifactIntegrityError(f"{uri}: {what}: {type(error).__name__}: {error}") from error


def _read_manifest(fs: AbstractFileSystem, path: str) -> bytes:
    with fs.open(path, "rb") as handle:
        data: bytes = handle.read(_MAX_MANIFEST_BYTES + 1)
    if len(data) > _MAX_MANIFEST_BYTES:
        raise ArtifactIntegrityError(f"{path}: {MANIFEST_NAME} is larger than {_MAX_MANIFEST_BYTES} bytes")
    return data


def _download(fs: AbstractFileSystem, base: str, manifest_bytes: bytes, staging: Path) -> None:
    """Write the manifest's exact bytes, then each listed file (at most one byte past its recorded size,
    so a longer object is refused without reading it all), and the signature if there is one.

    Every name is checked before anything is downloaded: none may lead out of ``staging``."""
    try:
        manifest = ArtifactManifest.model_validate_json(manifest_bytes)
    except ValidationError as error:
        raise ArtifactIntegrityError(f"{MANIFEST_NAME}: invalid manifest: {error}") from error
    targets = {name: staging / _relative(name) for name in sorted(manifest.files)}
    _write_private(staging / MANIFEST_NAME, manifest_bytes)
    for name, target in targets.items():
        entry = manifest.files[name]
        _mkdirs_private(target.parent, staging)
        with fs.open(f"{base}/{name}", "rb") as source:
            _copy_stream(source, target, limit=entry.bytes + 1)
    try:
        with fs.open(f"{base}/{SIGNATURE_NAME}", "rb") as source:
            _copy_stream(source, staging / SIGNATURE_NAME, limit=_MAX_MANIFEST_BYTES)
    except FileNotFoundError:
        pass  # unsigned: open_artifact refuses it when a key is required
    fsync_dir(staging)


def _relative(name: str) -> PurePosixPath:
    """A manifest entry as a relative path inside the artifact; one that could leave it is refused."""
    path = PurePosixPath(name)
    if not name or path.is_absolute() or ".." in path.parts or "\\" in name or str(path) != name:
        raise ArtifactIntegrityError(f"manifest entry '{name}' points outside the artifact")
    return path


def _copy_stream(source: BinaryIO, target: Path, *, limit: int) -> None:
    """Copy at most ``limit`` bytes into a new owner-only file, fsynced."""
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as handle:
        left = limit
        while left > 0 and (chunk := source.read(min(_CHUNK, left))):
            handle.write(chunk)
            left -= len(chunk)
        handle.flush()
        os.fsync(handle.fileno())


def _write_private(target: Path, data: bytes) -> None:
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


def _mkdirs_private(directory: Path, top: Path) -> None:
    if directory != top and not directory.is_dir():
        _mkdirs_private(directory.parent, top)
        directory.mkdir(mode=0o700)


def _upload(fs: AbstractFileSystem, local: Path, remote: str) -> None:
    """Stream one file to ``remote`` (a missing local file, the signature of an unsigned artifact: none)."""
    if not local.is_file():
        return
    fs.makedirs(posixpath.dirname(remote), exist_ok=True)
    with local.open("rb") as source, fs.open(remote, "wb") as target:
        shutil.copyfileobj(source, target, _CHUNK)


def _copy_artifact(source: Path, target: Path, *, private: bool) -> None:
    """Copy the manifest, its signature and every file it lists (nothing else) from ``source`` into the
    existing directory ``target``, each file fsynced; ``private``: 0600 files and 0700 directories."""
    manifest_bytes = (source / MANIFEST_NAME).read_bytes()
    try:
        manifest = ArtifactManifest.model_validate_json(manifest_bytes)
    except ValidationError as error:
        raise ArtifactIntegrityError(f"{source / MANIFEST_NAME}: invalid manifest: {error}") from error
    names = [*sorted(manifest.files), SIGNATURE_NAME]
    for name in names:
        origin = source / _relative(name)
        if name == SIGNATURE_NAME and not origin.is_file():
            continue
        destination = target / _relative(name)
        if private:
            _mkdirs_private(destination.parent, target)
            with origin.open("rb") as handle:
                _copy_stream(handle, destination, limit=origin.stat().st_size)
        else:
            destination.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(origin, destination)
            fsync_file(destination)
    if private:
        _write_private(target / MANIFEST_NAME, manifest_bytes)
    else:
        (target / MANIFEST_NAME).write_bytes(manifest_bytes)
        fsync_file(target / MANIFEST_NAME)
    for directory in sorted({(target / name).parent for name in manifest.files}, reverse=True):
        fsync_dir(directory)
    fsync_dir(target)


def _check_copy(local_dir: Path, copy: Path, kind: str, public_key: bytes | None) -> ArtifactManifest:
    """Verify the copy about to be published; a file that changed after it was verified is caught here."""
    try:
        return open_artifact(copy, kind=kind, public_key=public_key).manifest
    except ArtifactIntegrityError as error:
        raise ArtifactIntegrityError(f"{local_dir} changed while it was copied: {error}") from error


def _install(staging: Path, final: Path, kind: str, public_key: bytes | None) -> None:
    """Rename the verified ``staging`` directory to ``final``.

    If ``final`` exists (another process got there first, or an entry that failed verification), a
    verifying one is kept and ``staging`` dropped; one that does not verify is moved aside and replaced."""
    for _ in range(3):
        try:
            os.rename(staging, final)
        except OSError as error:
            if error.errno not in {errno.EEXIST, errno.ENOTEMPTY}:
                raise ArtifactIntegrityError(f"{final}: cannot publish: {error}") from error
        else:
            fsync_dir(final.parent)
            return
        if _verifies(final, kind, public_key):
            return
        _discard(final)
    raise ArtifactIntegrityError(f"{final}: cannot replace an entry that does not verify")


def _discard(path: Path) -> None:
    """Remove a directory: renamed aside first (atomic), so nobody finds it half-deleted under its name."""
    aside = path.with_name(f"{_TMP_PREFIX}{uuid.uuid4().hex}")
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return
    shutil.rmtree(aside, ignore_errors=True)


def _verifies(root: Path, kind: str, public_key: bytes | None) -> bool:
    try:
        open_artifact(root, kind=kind, public_key=public_key)
    except ArtifactIntegrityError as error:
        logger.warning("%s does not verify: %s", root, error)
        return False
    return True


def _private_cache(cache_dir: Path) -> None:
    """Make ``cache_dir`` owner-only (0700) and remove temporary directories left by crashed processes.

    Raises:
        ConfigError: the directory belongs to another user (its contents cannot be trusted).
    """
    try:
        cache_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        info = os.stat(cache_dir)
        if info.st_uid != os.geteuid():
            raise ConfigError(
                f"{cache_dir} belongs to uid {info.st_uid}, not this user; use a cache of your own"
            )
        if info.st_mode & 0o077:
            cache_dir.chmod(0o700)
    except OSError as error:
        raise ConfigError(f"{cache_dir}: cannot use it as the artifact cache: {error}") from error
    _remove_stale_temporaries(cache_dir.glob(f"{_TMP_PREFIX}*"))


def _remove_stale_temporaries(candidates: Iterable[Path]) -> None:
    cutoff = time.time() - _STALE_TMP_SECONDS
    for path in candidates:
        try:
            if path.is_dir() and not path.is_symlink() and path.stat().st_mtime < cutoff:
                shutil.rmtree(path, ignore_errors=True)
        except OSError:
            continue  # gone meanwhile (another process cleaned it) or unreadable: not ours to fix
