"""Artifacts by URI: published to a store every node can read, fetched into a content-keyed local cache and
verified before they are served (real fsspec filesystems: a directory, ``file://`` and ``memory://``)."""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import fsspec
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat, PublicFormat
from fsspec.implementations.memory import MemoryFileSystem

from riskserve.platform.artifact_store import ArtifactStore, fetch_verified
from riskserve.platform.artifacts import (
    MANIFEST_NAME,
    SIGNATURE_NAME,
    open_artifact,
    sha256_bytes,
    sign_manifest,
    write_manifest,
)
from riskserve.platform.errors import ArtifactIntegrityError, ConfigError

KIND = "sklearn"
LISTED = sorted([MANIFEST_NAME, "golden.json", "sub/vocab.json", "weights.bin"])
"""What a stored or fetched artifact of :func:`_artifact` holds: its manifest and the files it lists."""


class FaultyMemoryFileSystem(MemoryFileSystem):
    """``faultymem://``: the one in-memory store of ``memory://``, whose reads or writes of artifact files
    raise after the first one when armed (a connection that drops midway)."""

    protocol = "faultymem"
    fail_after: ClassVar[int | None] = None
    """Fail the open after this many artifact-file opens (``None``: never)."""
    fail_mode: ClassVar[str] = "rb"
    opened: ClassVar[list[str]] = []

    @classmethod
    def _strip_protocol(cls, path: Any) -> Any:
        if isinstance(path, str):
            path = path.removeprefix("faultymem://")
        return super()._strip_protocol(path)

    def _open(self, path: str, mode: str = "rb", *args: Any, **kwargs: Any) -> Any:
        is_artifact_file = not path.endswith((MANIFEST_NAME, SIGNATURE_NAME))
        armed = type(self).fail_after is not None and mode == type(self).fail_mode
        if armed and is_artifact_file:
            if len(type(self).opened) >= (type(self).fail_after or 0):
                raise ConnectionResetError(f"injected: connection dropped opening {path}")
            type(self).opened.append(path)
        return super()._open(path, mode, *args, **kwargs)


@pytest.fixture
def faulty() -> Iterator[type[FaultyMemoryFileSystem]]:
    fsspec.register_implementation("faultymem", FaultyMemoryFileSystem, clobber=True)
    FaultyMemoryFileSystem.opened = []
    yield FaultyMemoryFileSystem
    FaultyMemoryFileSystem.fail_after = None
    FaultyMemoryFileSystem.fail_mode = "rb"


def _artifact(directory: Path, weights: bytes = bytes(range(256)) * 8) -> Path:
    """A real artifact of three files (so a download can fail between two of them)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "weights.bin").write_bytes(weights)
    (directory / "sub").mkdir(exist_ok=True)
    (directory / "sub" / "vocab.json").write_text('{"a": 1, "b": 2}')
    (directory / "golden.json").write_text('{"x": [[1.0]], "expected": [0.5]}')
    write_manifest(
        directory,
        kind=KIND,
        files={"weights.bin": "model", "sub/vocab.json": "model", "golden.json": "golden"},
    )
    return directory


@pytest.fixture
def artifact(tmp_path: Path) -> Path:
    return _artifact(tmp_path / "local")


@pytest.fixture
def memory_root() -> Iterator[str]:
    """A fresh prefix of the process-wide in-memory filesystem, removed afterwards."""
    bucket = f"bucket-{uuid.uuid4().hex[:12]}"
    yield f"memory://{bucket}/riskserve"
    fs = fsspec.filesystem("memory")
    if fs.exists(f"/{bucket}"):
        fs.rm(f"/{bucket}", recursive=True)


@pytest.fixture(params=["directory", "file", "memory"])
def root(request: pytest.FixtureRequest, tmp_path: Path, memory_root: str) -> str:
    """A store root of each kind: a plain directory (a shared volume), ``file://`` and ``memory://``."""
    if request.param == "directory":
        return str(tmp_path / "volume")
    if request.param == "file":
        return (tmp_path / "bucket").as_uri()
    return memory_root


def _entries(cache: Path) -> list[str]:
    """Everything in a cache directory (final entries and leftovers alike)."""
    return sorted(p.name for p in cache.iterdir()) if cache.exists() else []


def _stored_names(uri: str) -> list[str]:
    """Every file under ``uri`` in its store, relative to it."""
    fs, path = (
        fsspec.core.url_to_fs(uri) if ArtifactStore.is_remote(uri) else (fsspec.filesystem("file"), uri)
    )
    return sorted(found.removeprefix(path).lstrip("/") for found in fs.find(path))


def _flip_a_byte(uri: str, name: str) -> None:
    """Change one byte of a stored object in place (same size), as corruption or tampering would."""
    fs, path = fsspec.core.url_to_fs(f"{uri}/{name}")
    data = bytearray(fs.cat_file(path))
    data[len(data) // 2] ^= 0xFF
    fs.pipe_file(path, bytes(data))


def _key() -> tuple[bytes, bytes]:
    """(private PEM, raw public key)."""
    private = Ed25519PrivateKey.generate()
    pem = private.private_bytes(Encoding.PEM, PrivateFormat.PKCS8, NoEncryption())
    return pem, private.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)


# -- put, then fetch on another node ------------------------------------------------------------------------


def test_put_then_fetch_from_another_cache_gives_the_same_verified_version(
    root: str, artifact: Path, tmp_path: Path
) -> None:
    version = open_artifact(artifact, kind=KIND).version
    uri = ArtifactStore(root, cache_dir=tmp_path / "writer-cache").put(artifact, kind=KIND)
    assert uri == f"{root}/{KIND}/{version}"

    reader_cache = tmp_path / "reader-cache"  # another node: nothing of the writer's cache
    fetched = fetch_verified(uri, kind=KIND, cache_dir=reader_cache)
    opened = open_artifact(fetched, kind=KIND)
    assert opened.version == version
    assert (fetched / "sub" / "vocab.json").read_bytes() == (artifact / "sub" / "vocab.json").read_bytes()
    if ArtifactStore.is_remote(uri):
        manifest = (artifact / MANIFEST_NAME).read_bytes()
        assert fetched == reader_cache / sha256_bytes(manifest)
        assert _entries(reader_cache) == [sha256_bytes(manifest)]
    else:
        assert fetched == Path(uri)  # a shared volume is served in place
        assert _entries(reader_cache) == []


def test_put_copies_only_what_the_manifest_lists(artifact: Path, tmp_path: Path, memory_root: str) -> None:
    (artifact / "notes.txt").write_text("not part of the artifact")
    for root in (str(tmp_path / "volume"), memory_root):
        uri = ArtifactStore(root, cache_dir=tmp_path / "cache").put(artifact, kind=KIND)
        assert _stored_names(uri) == LISTED


def test_put_is_idempotent_and_copies_nothing_the_second_time(
    artifact: Path, tmp_path: Path, memory_root: str
) -> None:
    volume = ArtifactStore(str(tmp_path / "volume"), cache_dir=tmp_path / "cache")
    uri = volume.put(artifact, kind=KIND)
    inodes = {p: p.stat().st_ino for p in [Path(uri), *Path(uri).rglob("*")]}
    time.sleep(0.01)
    kind_dir = Path(uri).parent.stat().st_mtime_ns
    assert volume.put(artifact, kind=KIND) == uri
    assert {p: p.stat().st_ino for p in [Path(uri), *Path(uri).rglob("*")]} == inodes
    assert Path(uri).parent.stat().st_mtime_ns == kind_dir  # no temporary copy was even made beside it

    memory = ArtifactStore(memory_root, cache_dir=tmp_path / "cache")
    uri = memory.put(artifact, kind=KIND)
    objects = dict(MemoryFileSystem.store)
    assert memory.put(artifact, kind=KIND) == uri
    assert all(MemoryFileSystem.store[key] is value for key, value in objects.items())  # not rewritten


@pytest.mark.parametrize("damage", ["flip", "delete-manifest"])
def test_put_replaces_a_stored_version_that_does_not_verify(
    artifact: Path, tmp_path: Path, memory_root: str, damage: str
) -> None:
    for root in (str(tmp_path / f"volume-{damage}"), memory_root):
        store = ArtifactStore(root, cache_dir=tmp_path / f"cache-{damage}")
        uri = store.put(artifact, kind=KIND)
        if damage == "flip":
            if ArtifactStore.is_remote(uri):
                _flip_a_byte(uri, "weights.bin")
            else:
                (Path(uri) / "weights.bin").write_bytes(b"\x00" * 2048)
        else:
            fs, path = fsspec.core.url_to_fs(uri) if ArtifactStore.is_remote(uri) else (None, uri)
            if fs is None:
                (Path(uri) / MANIFEST_NAME).unlink()
            else:
                fs.rm_file(f"{path}/{MANIFEST_NAME}")
        assert store.put(artifact, kind=KIND) == uri
        assert open_artifact(fetch_verified(uri, kind=KIND, cache_dir=tmp_path / "fresh"), kind=KIND)


def test_put_refuses_an_artifact_that_does_not_verify(
    artifact: Path, tmp_path: Path, memory_root: str
) -> None:
    (artifact / "weights.bin").write_bytes(b"tampered")
    for root in (str(tmp_path / "volume"), memory_root):
        with pytest.raises(ArtifactIntegrityError, match="truncated"):
            ArtifactStore(root, cache_dir=tmp_path / "cache").put(artifact, kind=KIND)
    assert not (tmp_path / "volume").exists()
    assert not fsspec.filesystem("memory").exists(memory_root.removeprefix("memory://"))


def test_an_interrupted_put_fault_injected_publishes_no_manifest(
    artifact: Path, tmp_path: Path, memory_root: str, faulty: type[FaultyMemoryFileSystem]
) -> None:
    """The manifest is written last: a put that fails after one file leaves a prefix no reader accepts,
    and the next put completes it."""
    root = memory_root.replace("memory://", "faultymem://")
    store = ArtifactStore(root, cache_dir=tmp_path / "cache")
    faulty.fail_after, faulty.fail_mode = 1, "wb"
    with pytest.raises(ArtifactIntegrityError, match="injected"):
        store.put(artifact, kind=KIND)
    uri = store.uri_of(KIND, open_artifact(artifact, kind=KIND).version)
    assert _stored_names(uri) == ["golden.json"]  # the fault struck after one file, and no manifest came
    with pytest.raises(ArtifactIntegrityError, match=re.escape(uri)):
        fetch_verified(uri, kind=KIND, cache_dir=tmp_path / "reader")

    faulty.fail_after = None
    assert store.put(artifact, kind=KIND) == uri
    assert open_artifact(fetch_verified(uri, kind=KIND, cache_dir=tmp_path / "reader"), kind=KIND)


# -- fetch: verified or refused ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["weights.bin", "sub/vocab.json", MANIFEST_NAME])
def test_a_tampered_object_is_refused_naming_the_uri_and_leaves_no_cache_entry(
    artifact: Path, tmp_path: Path, memory_root: str, name: str
) -> None:
    for root in (memory_root, (tmp_path / "bucket").as_uri()):
        uri = ArtifactStore(root, cache_dir=tmp_path / "writer").put(artifact, kind=KIND)
        _flip_a_byte(uri, name)
        cache = tmp_path / f"reader-{uuid.uuid4().hex[:6]}"
        with pytest.raises(ArtifactIntegrityError, match=re.escape(uri)) as refused:
            fetch_verified(uri, kind=KIND, cache_dir=cache)
        assert ("invalid manifest" if name == MANIFEST_NAME else "sha256 mismatch") in str(refused.value)
        assert _entries(cache) == []  # neither an entry nor a leftover temporary


def test_an_object_longer_than_its_manifest_says_is_refused(
    artifact: Path, tmp_path: Path, memory_root: str
) -> None:
    uri = ArtifactStore(memory_root, cache_dir=tmp_path / "writer").put(artifact, kind=KIND)
    fs, path = fsspec.core.url_to_fs(uri)
    fs.pipe_file(f"{path}/weights.bin", fs.cat_file(f"{path}/weights.bin") + b"\x00" * 10_000)
    with pytest.raises(ArtifactIntegrityError, match="longer than recorded"):
        fetch_verified(uri, kind=KIND, cache_dir=tmp_path / "reader")
    assert _entries(tmp_path / "reader") == []


def test_a_manifest_entry_outside_the_artifact_is_refused_before_anything_is_written(
    tmp_path: Path, memory_root: str
) -> None:
    fs = fsspec.filesystem("memory")
    base = memory_root.removeprefix("memory://")
    good = (_artifact(tmp_path / "a") / MANIFEST_NAME).read_text()
    fs.pipe_file(f"/{base}/evil/{MANIFEST_NAME}", good.replace('"golden.json"', '"../../escaped"').encode())
    fs.pipe_file(f"/{base}/evil/../../escaped", b"written outside the cache if the name were trusted")
    cache = tmp_path / "cache"
    with pytest.raises(ArtifactIntegrityError, match="outside the artifact"):
        fetch_verified(f"{memory_root}/evil", kind=KIND, cache_dir=cache)
    assert not (tmp_path / "escaped").exists()
    assert _entries(cache) == []


def test_an_object_of_another_kind_or_a_missing_uri_is_refused(
    artifact: Path, tmp_path: Path, memory_root: str
) -> None:
    uri = ArtifactStore(memory_root, cache_dir=tmp_path / "writer").put(artifact, kind=KIND)
    with pytest.raises(ArtifactIntegrityError, match="expected 'treelite'"):
        fetch_verified(uri, kind="treelite", cache_dir=tmp_path / "reader")
    missing = f"{memory_root}/{KIND}/0000000000000000"
    with pytest.raises(ArtifactIntegrityError, match=re.escape(missing)):
        fetch_verified(missing, kind=KIND, cache_dir=tmp_path / "reader")
    assert _entries(tmp_path / "reader") == []


def test_an_interrupted_download_fault_injected_leaves_no_entry_and_a_later_fetch_succeeds(
    artifact: Path, tmp_path: Path, memory_root: str, faulty: type[FaultyMemoryFileSystem]
) -> None:
    ArtifactStore(memory_root, cache_dir=tmp_path / "writer").put(artifact, kind=KIND)
    version = open_artifact(artifact, kind=KIND).version
    uri = f"{memory_root.replace('memory://', 'faultymem://')}/{KIND}/{version}"
    cache = tmp_path / "reader"
    faulty.fail_after = 1
    with pytest.raises(ArtifactIntegrityError, match=re.escape(uri)) as interrupted:
        fetch_verified(uri, kind=KIND, cache_dir=cache)
    assert "injected: connection dropped" in str(interrupted.value)
    assert len(faulty.opened) == 1  # one file came down before the connection dropped
    assert _entries(cache) == []  # no entry under the final name, no temporary left

    faulty.fail_after = None
    fetched = fetch_verified(uri, kind=KIND, cache_dir=cache)
    assert open_artifact(fetched, kind=KIND).version == version
    assert _entries(cache) == [fetched.name]


def test_a_signed_artifact_is_fetched_with_the_right_key_and_refused_with_a_wrong_one(
    artifact: Path, tmp_path: Path, memory_root: str
) -> None:
    pem, public = _key()
    sign_manifest(artifact, pem)
    uri = ArtifactStore(memory_root, cache_dir=tmp_path / "writer").put(
        artifact, kind=KIND, public_key=public
    )
    cache = tmp_path / "reader"
    fetched = fetch_verified(uri, kind=KIND, public_key=public, cache_dir=cache)
    assert (fetched / SIGNATURE_NAME).read_bytes() == (artifact / SIGNATURE_NAME).read_bytes()

    _, wrong = _key()
    with pytest.raises(ArtifactIntegrityError, match="does not verify") as refused:
        fetch_verified(uri, kind=KIND, public_key=wrong, cache_dir=tmp_path / "other")
    assert uri in str(refused.value)
    assert _entries(tmp_path / "other") == []
    with pytest.raises(ArtifactIntegrityError, match="does not verify"):
        fetch_verified(uri, kind=KIND, public_key=wrong, cache_dir=cache)
    assert open_artifact(fetched, kind=KIND, public_key=public)  # a wrong key does not evict a good entry


def test_an_unsigned_object_is_refused_when_a_key_is_required(
    artifact: Path, tmp_path: Path, memory_root: str
) -> None:
    _, public = _key()
    uri = ArtifactStore(memory_root, cache_dir=tmp_path / "writer").put(artifact, kind=KIND)
    cache = tmp_path / "reader"
    fetch_verified(uri, kind=KIND, cache_dir=cache)  # an unsigned entry is in the cache now
    with pytest.raises(ArtifactIntegrityError, match="unsigned"):
        fetch_verified(uri, kind=KIND, public_key=public, cache_dir=cache)


def test_a_plain_local_path_is_verified_and_returned_in_place(
    artifact: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "cache"
    assert fetch_verified(str(artifact), kind=KIND, cache_dir=cache) == artifact
    monkeypatch.chdir(artifact.parent)
    assert fetch_verified(artifact.name, kind=KIND, cache_dir=cache) == Path(artifact.name)
    assert not cache.exists()  # nothing was copied
    (artifact / "weights.bin").write_bytes(b"\x00" * 2048)
    with pytest.raises(ArtifactIntegrityError, match="sha256 mismatch"):
        fetch_verified(str(artifact), kind=KIND, cache_dir=cache)


# -- the cache -----------------------------------------------------------------------------------------------


def test_the_cache_is_keyed_by_content_so_two_uris_share_one_entry(
    artifact: Path, tmp_path: Path, memory_root: str
) -> None:
    first = ArtifactStore(memory_root, cache_dir=tmp_path / "writer").put(artifact, kind=KIND)
    second = ArtifactStore((tmp_path / "bucket").as_uri(), cache_dir=tmp_path / "writer").put(
        artifact, kind=KIND
    )
    assert first != second
    cache = tmp_path / "reader"
    entry = fetch_verified(first, kind=KIND, cache_dir=cache)
    assert fetch_verified(second, kind=KIND, cache_dir=cache) == entry
    assert _entries(cache) == [sha256_bytes((artifact / MANIFEST_NAME).read_bytes())]


def test_an_object_changed_under_the_same_uri_is_fetched_again_never_stale(
    tmp_path: Path, memory_root: str
) -> None:
    uri = f"{memory_root}/{KIND}/mutable"
    fs, path = fsspec.core.url_to_fs(uri)
    old, new = _artifact(tmp_path / "old"), _artifact(tmp_path / "new", weights=b"\x01" * 2048)
    fs.put(f"{old}/", f"{path}/", recursive=True)
    cache = tmp_path / "reader"
    first = fetch_verified(uri, kind=KIND, cache_dir=cache)
    fs.put(f"{new}/", f"{path}/", recursive=True)
    second = fetch_verified(uri, kind=KIND, cache_dir=cache)
    assert second != first
    assert (second / "weights.bin").read_bytes() == b"\x01" * 2048
    assert open_artifact(second, kind=KIND).version == open_artifact(new, kind=KIND).version


@pytest.mark.parametrize("damage", ["flip", "delete", "truncate-manifest"])
def test_a_cache_entry_damaged_on_disk_is_fetched_again(
    artifact: Path, tmp_path: Path, memory_root: str, damage: str
) -> None:
    uri = ArtifactStore(memory_root, cache_dir=tmp_path / "writer").put(artifact, kind=KIND)
    cache = tmp_path / "reader"
    entry = fetch_verified(uri, kind=KIND, cache_dir=cache)
    if damage == "flip":
        (entry / "weights.bin").write_bytes(b"\x00" * 2048)
    elif damage == "delete":
        (entry / "sub" / "vocab.json").unlink()
    else:
        (entry / MANIFEST_NAME).write_bytes(b"{")
    with pytest.raises(ArtifactIntegrityError):
        open_artifact(entry, kind=KIND)
    assert fetch_verified(uri, kind=KIND, cache_dir=cache) == entry
    assert open_artifact(entry, kind=KIND).version == open_artifact(artifact, kind=KIND).version
    assert _entries(cache) == [entry.name]


def test_cache_files_are_owner_only(artifact: Path, tmp_path: Path, memory_root: str) -> None:
    uri = ArtifactStore(memory_root, cache_dir=tmp_path / "writer").put(artifact, kind=KIND)
    cache = tmp_path / "reader"
    entry = fetch_verified(uri, kind=KIND, cache_dir=cache)
    for path in [cache, *cache.rglob("*")]:
        mode = stat.S_IMODE(path.stat().st_mode)
        assert mode == (0o700 if path.is_dir() else 0o600), f"{path}: {oct(mode)}"
    assert (entry / "sub").is_dir()


def test_a_cache_of_another_user_is_refused(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to make a directory another user owns")
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    os.chown(foreign, 12345, 12345)
    with pytest.raises(ConfigError, match="belongs to uid 12345"):
        ArtifactStore(str(tmp_path / "volume"), cache_dir=foreign)


def test_stale_temporaries_are_removed_when_a_store_starts(tmp_path: Path) -> None:
    cache, volume = tmp_path / "cache", tmp_path / "volume"
    stale = [cache / ".tmp-crashed", volume / KIND / ".tmp-crashed"]
    fresh = [cache / ".tmp-running", volume / KIND / ".tmp-running"]
    for path in stale + fresh:
        (path / "sub").mkdir(parents=True)
        (path / "sub" / "half.bin").write_bytes(b"half")
    two_hours_ago = time.time() - 7200
    for path in stale:
        os.utime(path, (two_hours_ago, two_hours_ago))
    ArtifactStore(str(volume), cache_dir=cache)
    assert [p.exists() for p in stale] == [False, False]
    assert [p.exists() for p in fresh] == [True, True]  # maybe another process's download in progress


# -- the API -------------------------------------------------------------------------------------------------


def test_uris_and_roots(tmp_path: Path) -> None:
    remote = {uri: ArtifactStore.is_remote(uri) for uri in ("s3://b/p", "file:///x", "/shared/x", "models/x")}
    assert remote == {"s3://b/p": True, "file:///x": True, "/shared/x": False, "models/x": False}
    cache = tmp_path / "cache"
    assert ArtifactStore("memory://b/p/", cache_dir=cache).uri_of(KIND, "ab12") == "memory://b/p/sklearn/ab12"
    assert (
        ArtifactStore(f"{tmp_path}/v/", cache_dir=cache).uri_of(KIND, "ab12") == f"{tmp_path}/v/sklearn/ab12"
    )
    with pytest.raises(ValueError, match="cannot name"):
        ArtifactStore("memory://b/p", cache_dir=cache).uri_of(KIND, "../x")
    with pytest.raises(ConfigError, match="absolute"):
        ArtifactStore("relative/artifacts", cache_dir=cache)


def test_the_module_imports_without_fsspec() -> None:
    code = (
        "import sys; sys.modules['fsspec'] = None; "
        "import riskserve.platform.artifact_store as m; print(*sorted(m.__all__))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert done.stdout.split() == ["ArtifactStore", "fetch_verified"]


def test_nothing_but_the_artifact_lands_in_an_entry(artifact: Path, tmp_path: Path, memory_root: str) -> None:
    """Files beside the artifact in the store (not in its manifest) are never downloaded."""
    uri = ArtifactStore(memory_root, cache_dir=tmp_path / "writer").put(artifact, kind=KIND)
    fs, path = fsspec.core.url_to_fs(uri)
    fs.pipe_file(f"{path}/extra.bin", b"not listed")
    entry = fetch_verified(uri, kind=KIND, cache_dir=tmp_path / "reader")
    assert sorted(str(p.relative_to(entry)) for p in entry.rglob("*") if p.is_file()) == LISTED
