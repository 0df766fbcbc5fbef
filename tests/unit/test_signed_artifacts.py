"""Ed25519-signed manifests: with a pipeline key, an artifact is refused before anything of it is loaded
unless its manifest carries a valid signature (real keys, real artifacts, a real ModelRunner)."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import (
    Encoding,
    NoEncryption,
    PrivateFormat,
    PublicFormat,
)

from riskserve.demo.tabular import make_tabular_data, train_fraud_lr
from riskserve.platform.artifacts import (
    MANIFEST_NAME,
    SIGNATURE_NAME,
    load_public_key,
    open_artifact,
    sign_manifest,
)
from riskserve.platform.errors import ArtifactIntegrityError
from riskserve.platform.host import ModelHost
from riskserve.wrappers import backend


def _key() -> tuple[bytes, bytes]:
    """(private PEM, raw public key)."""
    private = Ed25519PrivateKey.generate()
    pem = private.private_bytes(Encoding.PEM, PrivateFormat.PKCS8, NoEncryption())
    return pem, private.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)


@pytest.fixture(scope="module")
def fraud(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("models") / "fraud"
    train_fraud_lr(make_tabular_data(4, train_rows=2000, test_rows=500), out, seed=4)
    return out


def test_only_a_manifest_signed_with_the_pipeline_key_opens(fraud: Path, tmp_path: Path) -> None:
    pem, public = _key()
    signed = tmp_path / "signed"
    shutil.copytree(fraud, signed)
    sign_manifest(signed, pem)
    assert open_artifact(signed, kind="sklearn", public_key=public).version
    with pytest.raises(ArtifactIntegrityError, match="unsigned"):
        open_artifact(fraud, kind="sklearn", public_key=public)
    _, other = _key()
    with pytest.raises(ArtifactIntegrityError, match="does not verify"):
        open_artifact(signed, kind="sklearn", public_key=other)
    manifest = json.loads((signed / MANIFEST_NAME).read_text())
    manifest["info"]["note"] = "edited after signing"
    (signed / MANIFEST_NAME).write_text(json.dumps(manifest))
    with pytest.raises(ArtifactIntegrityError, match="does not verify"):
        open_artifact(signed, kind="sklearn", public_key=public)
    (signed / SIGNATURE_NAME).write_text("not base64!")
    with pytest.raises(ArtifactIntegrityError, match="not base64"):
        open_artifact(signed, kind="sklearn", public_key=public)
    assert open_artifact(fraud, kind="sklearn").version  # without a key: checksums only, as before


def test_a_model_with_a_key_refuses_an_unsigned_artifact_but_not_a_learned_version(
    fraud: Path, tmp_path: Path
) -> None:
    """The check every backend makes in ``load``, from the settings the platform gives a runner."""
    pem_path = tmp_path / "public.pem"
    private = Ed25519PrivateKey.generate()
    pem = private.private_bytes(Encoding.PEM, PrivateFormat.PKCS8, NoEncryption())
    pem_path.write_bytes(private.public_key().public_bytes(Encoding.PEM, PublicFormat.SubjectPublicKeyInfo))
    learned = tmp_path / "learned"
    key = {"manifest_public_key": load_public_key(pem_path).hex(), "unsigned_root": str(learned)}
    signed, unsigned, own = tmp_path / "signed", tmp_path / "unsigned", learned / "v1"
    for target in (signed, unsigned, own):
        shutil.copytree(fraud, target)
    sign_manifest(signed, pem)
    model_class, settings_class = backend("sklearn")

    async def load(artifact: Path) -> str:
        host = ModelHost(
            model_class(settings_class.model_validate({"name": "fraud", "artifact": artifact, **key}))
        )
        await host.start()
        version = host.model.version
        await host.stop()
        return version

    assert asyncio.run(load(signed)) == open_artifact(fraud, kind="sklearn").version
    with pytest.raises(ArtifactIntegrityError, match="unsigned"):
        asyncio.run(load(unsigned))
    assert asyncio.run(load(own))  # the server's own learned version needs no signature


def test_the_pipeline_names_the_key_and_every_runner_gets_it(tmp_path: Path) -> None:
    import yaml

    from riskserve.schema.pipeline import PipelineSpec, parse_pipeline

    yaml_path = Path(__file__).parents[2] / "deploy" / "pipelines" / "card_fraud.yaml"
    private = Ed25519PrivateKey.generate()
    (tmp_path / "public.pem").write_bytes(
        private.public_key().public_bytes(Encoding.PEM, PublicFormat.SubjectPublicKeyInfo)
    )
    data = yaml.safe_load(yaml_path.read_text())
    data["audit"]["path"] = str(tmp_path / "audit")  # learned versions: beside it, not in the repo
    spec = parse_pipeline(
        {**data, "signing": {"public_key": str(tmp_path / "public.pem")}}, base_dir=yaml_path.parent
    )
    raw = private.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw).hex()
    fraud, credit = spec.runner_settings("fraud"), spec.runner_settings("credit")
    assert (fraud["manifest_public_key"], credit["manifest_public_key"]) == (raw, raw)
    assert fraud["unsigned_root"] == str(spec.learned_dir("fraud"))  # only an online model's own versions
    assert "unsigned_root" not in credit
    again = PipelineSpec.model_validate(spec.resolved())  # what the replicas receive
    assert again.runner_settings("credit")["manifest_public_key"] == raw
