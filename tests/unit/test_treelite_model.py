"""TreeliteModel on real XGBoost, Treelite, tl2cgen and gcc: equality, cache, integrity, input, threads."""

from __future__ import annotations

import asyncio
import hashlib
import json
import shutil
import stat
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tl2cgen
import xgboost as xgb
from numpy.typing import NDArray
from pydantic import ValidationError

from riskserve.platform import (
    InvalidInput,
    ModelHost,
    ModelLoadError,
    ModelUnavailable,
    open_artifact,
    write_manifest,
)
from riskserve.platform.secret import install_secret
from riskserve.wrappers import treelite_compile
from riskserve.wrappers.treelite_compile import GOLDEN_FILE, LIBRARY_NAME, _BuildRecord, save_xgboost_artifact
from riskserve.wrappers.treelite_model import DIRECT_MAX_ROWS, TreeliteModel, TreeliteSettings

TOLERANCE = 1e-5
NO_COMPILER = "riskserve-no-such-cc"


def _names(n: int) -> list[str]:
    return [f"f{i}" for i in range(n)]


def _train(features: int, depth: int, trees: int, seed: int, missing: float = 0.15) -> xgb.Booster:
    """A binary:logistic booster trained on data with missing values, so its splits have default sides."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(1500, features)).astype(np.float32)
    x[rng.random(x.shape) < missing] = np.nan
    filled = np.nan_to_num(x)
    logit = filled[:, 0] - 0.7 * filled[:, -1] + 0.5 * filled[:, features // 2] * filled[:, 0]
    y = (logit + rng.normal(size=x.shape[0]) > 0).astype(np.float32)
    params = {"objective": "binary:logistic", "max_depth": depth, "eta": 0.3, "nthread": 2, "seed": seed}
    return xgb.train(params, xgb.DMatrix(x, y), num_boost_round=trees)


def _rows(features: int, n: int, seed: int) -> NDArray[np.float32]:
    return np.random.default_rng(seed).normal(scale=1.5, size=(n, features)).astype(np.float32)


def _save(booster: xgb.Booster, out: Path, features: int) -> Path:
    save_xgboost_artifact(booster, out, feature_names=_names(features), golden_x=_rows(features, 16, 99))
    return out


def _settings(artifact: Path, cache: Path, **overrides: Any) -> TreeliteSettings:
    return TreeliteSettings(
        name="fraud_gbt", artifact=artifact, cache_dir=cache, parallel_comp=2, **overrides
    )


async def _started(settings: TreeliteSettings) -> tuple[ModelHost[NDArray[np.float32]], TreeliteModel]:
    model = TreeliteModel(settings)
    host = ModelHost(model)
    await host.start()
    return host, model


def _load(settings: TreeliteSettings) -> TreeliteModel:
    return asyncio.run(_started(settings))[1]


def _xgb(booster: xgb.Booster, x: NDArray[np.float32]) -> NDArray[np.float64]:
    return np.asarray(booster.inplace_predict(x), dtype=np.float64)


@dataclass(frozen=True)
class Served:
    """One compiled model shared by the tests that only read it."""

    booster: xgb.Booster
    artifact: Path
    cache: Path
    model: TreeliteModel
    features: int = 12


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Served:
    root = tmp_path_factory.mktemp("served")
    booster = _train(12, depth=5, trees=30, seed=1)
    artifact = _save(booster, root / "artifact", 12)
    model = _load(_settings(artifact, root / "cache"))
    return Served(booster=booster, artifact=artifact, cache=root / "cache", model=model)


@pytest.mark.parametrize(
    ("features", "depth", "trees", "model_file"),
    [
        (3, 2, 5, "model.json"),
        (9, 6, 40, "model.json"),
        (30, 8, 12, "model.json"),
        (7, 4, 25, "model.ubj"),
    ],
)
def test_compiled_library_matches_xgboost(
    tmp_path: Path, features: int, depth: int, trees: int, model_file: str
) -> None:
    booster = _train(features, depth, trees, seed=depth * 100 + trees)
    artifact = _save(booster, tmp_path / "artifact", features)
    if model_file == "model.ubj":  # the same model as UBJSON: the loader accepts either file
        (artifact / "model.json").unlink()
        (artifact / "model.ubj").write_bytes(bytes(booster.save_raw("ubj")))
        write_manifest(
            artifact,
            kind="treelite",
            files={"model.ubj": "model", GOLDEN_FILE: "golden"},
            feature_names=_names(features),
            labels=["0", "1"],
        )

    async def scenario() -> None:
        host, model = await _started(_settings(artifact, tmp_path / "cache"))
        details = model.metadata().details
        assert details["engine"] == "tl2cgen"
        assert details["compiled"] is True
        assert details["cache_hit"] is False
        assert details["model_file"] == model_file
        assert details["gate"]["golden_rows"] == 16
        assert details["gate"]["max_abs_diff"] <= TOLERANCE
        assert Path(details["library"]).is_file()
        for rows in (1, 7, 300):
            x = _rows(features, rows, seed=rows)
            output = await host.predict(x, rows)
            assert output.scores.dtype == np.float64
            assert output.version == model.version
            np.testing.assert_allclose(output.scores, _xgb(booster, x), rtol=0, atol=TOLERANCE)

    asyncio.run(scenario())
    assert not list((tmp_path / "cache").glob(".build-*")), "no build directory is left behind"


def test_second_load_reuses_the_library_in_this_and_a_new_process(served: Served) -> None:
    x = _rows(served.features, 200, seed=5)
    first = served.model.metadata().details
    assert first["compiled"] is True
    assert first["compile_seconds"] > 0

    again = _load(_settings(served.artifact, served.cache))
    details = again.metadata().details
    assert details["compiled"] is False
    assert details["cache_hit"] is True
    assert details["library"] == first["library"]
    np.testing.assert_array_equal(again.predict_sync(x), served.model.predict_sync(x))

    script = (
        "import asyncio, json, sys\n"
        "from pathlib import Path\n"
        "from riskserve.wrappers.treelite_model import TreeliteModel, TreeliteSettings\n"
        "model = TreeliteModel(TreeliteSettings(name='fraud_gbt', artifact=Path(sys.argv[1]),"
        " cache_dir=Path(sys.argv[2])))\n"
        "asyncio.run(model.load())\n"
        "print(json.dumps(model.details()))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script, str(served.artifact), str(served.cache)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    in_new_process = json.loads(result.stdout.strip().splitlines()[-1])
    assert in_new_process["cache_hit"] is True
    assert in_new_process["compiled"] is False
    assert in_new_process["library"] == first["library"]


@pytest.mark.parametrize("damage", ["flip_one_byte", "truncate"])
def test_damaged_model_file_is_refused(served: Served, tmp_path: Path, damage: str) -> None:
    artifact = tmp_path / "artifact"
    shutil.copytree(served.artifact, artifact)
    path = artifact / "model.json"
    data = bytearray(path.read_bytes())
    if damage == "flip_one_byte":
        data[len(data) // 2] ^= 0x01
        path.write_bytes(bytes(data))
        message = "sha256 mismatch"
    else:
        path.write_bytes(bytes(data[: len(data) // 3]))
        message = "truncated"
    model = TreeliteModel(_settings(artifact, tmp_path / "cache"))
    with pytest.raises(ModelLoadError, match=message):
        asyncio.run(ModelHost(model).start())
    assert not model.ready
    assert not (tmp_path / "cache").exists(), "nothing is compiled for a damaged artifact"


def test_golden_set_that_xgboost_disagrees_with_is_refused(served: Served, tmp_path: Path) -> None:
    artifact = tmp_path / "artifact"
    shutil.copytree(served.artifact, artifact)
    golden = json.loads((artifact / GOLDEN_FILE).read_text())
    golden["expected"][3] += 0.01
    (artifact / GOLDEN_FILE).write_text(json.dumps(golden))
    manifest = open_artifact(served.artifact, kind="treelite").manifest
    write_manifest(
        artifact,
        kind="treelite",
        files={name: entry.role for name, entry in manifest.files.items()},
        feature_names=manifest.feature_names,
        labels=manifest.labels,
    )
    with pytest.raises(ModelLoadError, match=r"disagrees with golden\.json"):
        _load(_settings(artifact, tmp_path / "cache"))


def _plant(source_dir: Path, target_dir: Path, version: str, toolchain: str) -> None:
    """Put another model's library into a cache slot, with a build record that claims it belongs there,
    signed with the cache's own key (as a bug in riskserve, not an intruder, would leave it)."""
    target_dir.mkdir(parents=True)
    shutil.copy2(source_dir / LIBRARY_NAME, target_dir / LIBRARY_NAME)
    record = _BuildRecord.model_validate_json((source_dir / "build.json").read_text())
    record = record.model_copy(update={"artifact_version": version, "toolchain": toolchain})
    key = install_secret(target_dir.parent / ".key")
    (target_dir / "build.json").write_text(record.signed(key).model_dump_json())


def _library_with_a_constructor(tmp_path: Path, marker: Path) -> bytes:
    """A shared library whose load-time constructor writes ``marker``: what dlopen of a planted library
    would run. Only its bytes are returned."""
    source = tmp_path / "evil.c"
    source.write_text(
        "#include <stdio.h>\n"
        f'__attribute__((constructor)) static void evil(void) {{ FILE *f = fopen("{marker}", "w");'
        ' if (f) { fputs("ran", f); fclose(f); } }\n'
    )
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(tmp_path / "evil.so"), str(source)], check=True)
    return (tmp_path / "evil.so").read_bytes()


def test_a_library_planted_in_the_cache_is_never_opened(served: Served, tmp_path: Path) -> None:
    marker = tmp_path / "evil-ran"
    evil = _library_with_a_constructor(tmp_path, marker)
    cache = tmp_path / "cache"
    shutil.copytree(served.cache, cache)
    slot = cache / Path(served.model.details()["library"]).parent.name
    (slot / LIBRARY_NAME).write_bytes(evil)
    record = _BuildRecord.model_validate_json((slot / "build.json").read_text())
    forged = record.model_copy(  # the intruder knows the format and the hash, not the cache's key
        update={"library_sha256": hashlib.sha256(evil).hexdigest(), "library_bytes": len(evil), "mac": ""}
    )
    (slot / "build.json").write_text(forged.model_dump_json())
    model = _load(_settings(served.artifact, cache))
    assert "no valid HMAC" in model.details()["cache_rejected"]
    assert not marker.exists(), "the planted library ran"
    assert model.details()["compiled"] is True
    x = _rows(served.features, 16, seed=11)
    np.testing.assert_array_equal(model.predict_sync(x), served.model.predict_sync(x))
    # The cache is owner-only, and the private copies that were opened are gone.
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700
    assert stat.S_IMODE(slot.stat().st_mode) == 0o700
    assert {stat.S_IMODE(p.stat().st_mode) for p in slot.iterdir()} == {0o600}
    assert not list(cache.glob(".load-*"))


def test_a_library_swapped_after_its_hash_was_checked_is_not_what_is_loaded(
    served: Served, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fault injected: an intruder replaces the cached file between the hash check and dlopen."""
    marker = tmp_path / "evil-ran"
    evil = _library_with_a_constructor(tmp_path, marker)
    cache = tmp_path / "cache"
    shutil.copytree(served.cache, cache)
    slot = cache / Path(served.model.details()["library"]).parent.name
    real_open = treelite_compile._open_predictor

    def swap_then_open(library: Path, nthread: int, n_features: int) -> Any:
        (slot / LIBRARY_NAME).write_bytes(evil)
        return real_open(library, nthread, n_features)

    monkeypatch.setattr(treelite_compile, "_open_predictor", swap_then_open)
    model = _load(_settings(served.artifact, cache))
    assert not marker.exists(), "the swapped-in library ran"
    assert model.details()["cache_hit"] is True
    x = _rows(served.features, 16, seed=12)
    np.testing.assert_array_equal(model.predict_sync(x), served.model.predict_sync(x))


def test_wrong_library_in_the_cache_fails_the_gate_and_is_deleted(served: Served, tmp_path: Path) -> None:
    other = _train(served.features, depth=5, trees=30, seed=2)  # same shape, different trees
    other_artifact = _save(other, tmp_path / "other", served.features)
    other_library = Path(_load(_settings(other_artifact, tmp_path / "other-cache")).details()["library"])
    version = open_artifact(served.artifact, kind="treelite").version
    cache = tmp_path / "cache"

    # With a compiler: the impostor is rejected, deleted and rebuilt, and the model serves correctly.
    slot = cache / Path(served.model.details()["library"]).parent.name
    _plant(other_library.parent, slot, version, "gcc")
    rebuilt = _load(_settings(served.artifact, cache))
    details = rebuilt.details()
    assert "disagrees with xgboost" in details["cache_rejected"]
    assert details["compiled"] is True
    x = _rows(served.features, 64, seed=8)
    np.testing.assert_allclose(rebuilt.predict_sync(x), _xgb(served.booster, x), rtol=0, atol=TOLERANCE)

    # Without one: the load is refused and the impostor is gone.
    slot = cache / f"{version}-{tl2cgen.__version__}-{NO_COMPILER}"
    _plant(other_library.parent, slot, version, NO_COMPILER)
    with pytest.raises(ModelLoadError, match="cannot be compiled"):
        _load(_settings(served.artifact, cache, toolchain=NO_COMPILER, allow_gtil_fallback=False))
    assert not slot.exists()


def test_truncated_cached_library_is_rebuilt_instead_of_crashing(served: Served, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    shutil.copytree(served.cache, cache)
    slot = cache / Path(served.model.details()["library"]).parent.name
    library = slot / LIBRARY_NAME
    library.write_bytes(library.read_bytes()[:4096])  # dlopen of this would kill the process (SIGBUS)
    model = _load(_settings(served.artifact, cache))
    details = model.details()
    assert "truncated or modified" in details["cache_rejected"]
    assert details["compiled"] is True
    x = _rows(served.features, 32, seed=9)
    np.testing.assert_array_equal(model.predict_sync(x), served.model.predict_sync(x))


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_value_is_refused_naming_its_column(served: Served, bad: float) -> None:
    x = _rows(served.features, 5, seed=3)
    x[2, 4] = bad
    with pytest.raises(InvalidInput, match="f4") as caught:
        asyncio.run(ModelHost(served.model).predict(x, 5))
    assert caught.value.field == "f4"


@pytest.mark.parametrize(
    "batch",
    [
        np.zeros((3, 11), dtype=np.float32),
        np.zeros((3, 13), dtype=np.float32),
        np.zeros((3, 12), dtype=np.float64),
        np.zeros(12, dtype=np.float32),
    ],
    ids=["narrow", "wide", "float64", "1-d"],
)
def test_wrong_shape_or_type_is_refused_naming_features(served: Served, batch: NDArray[Any]) -> None:
    with pytest.raises(InvalidInput) as caught:
        served.model.predict_sync(batch)
    assert caught.value.field == "features"


@pytest.mark.parametrize(
    ("overrides", "reason"),
    [
        ({"toolchain": NO_COMPILER}, f"toolchain '{NO_COMPILER}' not found"),
        ({"toolchain": "false"}, "compile failed"),  # on PATH, but `false --version` fails inside tl2cgen
        ({"compile_timeout_seconds": 0.05}, "timed out"),
    ],
    ids=["missing", "broken", "timeout"],
)
def test_gtil_fallback_reports_itself_and_agrees(
    served: Served, tmp_path: Path, overrides: dict[str, Any], reason: str
) -> None:
    model = _load(_settings(served.artifact, tmp_path / "cache", **overrides))
    details = model.metadata().details
    assert details["engine"] == "gtil"
    assert reason in details["fallback_reason"]
    assert details["library"] is None
    assert details["compiled"] is False
    assert not list((tmp_path / "cache").glob(".build-*")), "a failed compile leaves nothing behind"
    x = _rows(served.features, 256, seed=4)
    scores = model.predict_sync(x)
    np.testing.assert_allclose(scores, served.model.predict_sync(x), rtol=0, atol=TOLERANCE)
    np.testing.assert_allclose(scores, _xgb(served.booster, x), rtol=0, atol=TOLERANCE)

    with pytest.raises(ModelLoadError, match="allow_gtil_fallback is off"):
        _load(_settings(served.artifact, tmp_path / "cache", allow_gtil_fallback=False, **overrides))


def test_artifact_without_golden_set_is_gated_on_generated_rows(served: Served, tmp_path: Path) -> None:
    artifact = tmp_path / "artifact"
    shutil.copytree(served.artifact, artifact)
    (artifact / GOLDEN_FILE).unlink()
    write_manifest(
        artifact, kind="treelite", files={"model.json": "model"}, feature_names=_names(12), labels=["0", "1"]
    )
    model = _load(_settings(artifact, served.cache, check_rows=300))
    details = model.details()
    assert details["cache_hit"] is True, "the golden set is not part of the version"
    assert details["gate"]["rows"] == 300
    assert details["gate"]["golden_rows"] == 0


def test_concurrent_calls_are_serialised_and_all_correct(served: Served) -> None:
    batches = [_rows(served.features, rows, seed=100 + i) for i, rows in enumerate([1, 3, 17, 64, 250] * 2)]
    expected = [_xgb(served.booster, x) for x in batches]
    failures: list[str] = []
    start = threading.Barrier(8)

    def hammer(worker: int) -> None:
        start.wait()
        for step in range(40):
            i = (worker + step) % len(batches)
            got = served.model.predict_sync(batches[i])
            if got.shape != expected[i].shape or np.max(np.abs(got - expected[i])) > TOLERANCE:
                failures.append(f"worker {worker} step {step} batch {i}")

    threads = [threading.Thread(target=hammer, args=(w,)) for w in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []

    async def gathered() -> list[NDArray[np.float64]]:
        host = ModelHost(served.model)
        outputs = await asyncio.gather(*(host.predict(x, x.shape[0]) for x in batches * 5))
        return [output.scores for output in outputs]

    for got, want in zip(asyncio.run(gathered()), expected * 5, strict=True):
        np.testing.assert_allclose(got, want, rtol=0, atol=TOLERANCE)


def test_read_only_input_is_used_in_place(served: Served) -> None:
    x = _rows(served.features, 40, seed=6)
    want = _xgb(served.booster, x)
    shared = np.frombuffer(x.tobytes(), dtype=np.float32).reshape(x.shape)  # read-only, like shared memory
    assert not shared.flags.writeable
    frozen = x.copy()
    frozen.flags.writeable = False
    for batch in (shared, frozen):
        np.testing.assert_allclose(served.model.predict_sync(batch), want, rtol=0, atol=TOLERANCE)
        output = asyncio.run(ModelHost(served.model).predict(batch, 40))
        np.testing.assert_allclose(output.scores, want, rtol=0, atol=TOLERANCE)
        np.testing.assert_array_equal(batch, x)


def test_save_is_deterministic_and_records_xgboost_predictions(served: Served, tmp_path: Path) -> None:
    golden_x = _rows(served.features, 16, seed=99)
    a = save_xgboost_artifact(served.booster, tmp_path / "a", feature_names=_names(12), golden_x=golden_x)
    b = save_xgboost_artifact(served.booster, tmp_path / "b", feature_names=_names(12), golden_x=golden_x)
    assert a.version == b.version == open_artifact(served.artifact, kind="treelite").version
    for name in ("model.json", GOLDEN_FILE, "manifest.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    golden = a.read_json(GOLDEN_FILE)
    np.testing.assert_array_equal(np.asarray(golden["x"], dtype=np.float32), golden_x)
    np.testing.assert_array_equal(np.asarray(golden["expected"]), _xgb(served.booster, golden_x))
    assert a.manifest.labels == ["0", "1"]
    assert a.manifest.files[GOLDEN_FILE].role == "golden"


def test_save_refuses_a_mismatched_or_non_probability_booster(served: Served, tmp_path: Path) -> None:
    golden_x = _rows(served.features, 4, seed=1)
    with pytest.raises(InvalidInput) as caught:
        save_xgboost_artifact(served.booster, tmp_path / "a", feature_names=_names(11), golden_x=golden_x)
    assert caught.value.field == "feature_names"
    x = _rows(3, 200, seed=2)
    regressor = xgb.train({"objective": "reg:squarederror", "nthread": 1}, xgb.DMatrix(x, x[:, 0]), 2)
    with pytest.raises(InvalidInput) as caught:
        save_xgboost_artifact(regressor, tmp_path / "b", feature_names=_names(3), golden_x=x[:4])
    assert caught.value.field == "booster"


def test_unloaded_model_is_unavailable(served: Served) -> None:
    model = _load(_settings(served.artifact, served.cache))
    host = ModelHost(model)
    x = _rows(served.features, 2, seed=0)
    asyncio.run(host.stop())
    with pytest.raises(ModelUnavailable):
        asyncio.run(host.predict(x, 2))
    with pytest.raises(ModelUnavailable):
        model.predict_sync(x)
    assert model.metadata().version is None


@pytest.mark.parametrize("toolchain", ["gcc; rm -rf /", "-o/tmp/x", "gcc $(id)", ""])
def test_toolchain_setting_refuses_shell_syntax(tmp_path: Path, toolchain: str) -> None:
    with pytest.raises(ValidationError):
        TreeliteSettings(name="m", artifact=tmp_path, cache_dir=tmp_path, toolchain=toolchain)


def test_small_batches_call_the_compiled_rows_directly_bit_for_bit_and_without_a_lock(served: Served) -> None:
    """Up to DIRECT_MAX_ROWS rows skip tl2cgen's DMatrix and thread pool: the library's per-row function
    gives exactly the predictor's floats, from many threads at once (it keeps no state)."""
    assert served.model.details()["direct_rows"] is True, served.model.details().get("direct_rows_refused")
    batches = [np.nan_to_num(_rows(served.features, n, seed=300 + n)) for n in (1, 2, 17, DIRECT_MAX_ROWS)]
    for x in batches:
        direct = served.model.predict_now(x).scores
        assert np.array_equal(direct, served.model.predict_sync(x))
        np.testing.assert_allclose(direct, _xgb(served.booster, x), rtol=0, atol=TOLERANCE)
    failures: list[int] = []
    start = threading.Barrier(8)

    def hammer(worker: int) -> None:
        start.wait()
        for step in range(50):
            x = batches[(worker + step) % len(batches)]
            if not np.array_equal(served.model.predict_now(x).scores, served.model.predict_sync(x)):
                failures.append(worker)

    threads = [threading.Thread(target=hammer, args=(w,)) for w in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []
