"""Turning a verified XGBoost artifact into a gated predictor: compile with tl2cgen, cache, check.

:func:`load_engine` verifies the artifact (sha256), compiles ``model.json``/``model.ubj`` with tl2cgen
into a library cache keyed by artifact version, tl2cgen version and toolchain, then runs the equality
gate: the library must reproduce ``xgboost.Booster.inplace_predict`` on the artifact's golden rows plus
rows built from the model's own split thresholds (both sides of every split, the threshold itself, missing
values). Serving the engine it returns is :mod:`riskserve.wrappers.treelite_model`'s job.

Compilation runs in a child process: the Treelite 4.1.2 bundled in tl2cgen 1.0.0 writes a version-skew
notice straight to the C stderr (no Python warning, no callback to route it), tl2cgen prints its progress to
stdout, and gcc may hang or crash; in a child all of that is captured and logged, and a timeout can kill it.
A library is published by renaming its build directory (with ``build.json``: size and sha256) into the
cache, so a crash mid-compile never leaves a half library. ``dlopen`` runs the library's code, so nothing is
opened that was not checked first, and what is opened is exactly what was checked:

- the cache is private: its directory is made (or tightened to) 0700 and must belong to this user, each
  entry is 0700 with 0600 files, and ``build.json`` carries an HMAC under the cache's own install secret
  (``.key``, 0600), so a record (and the hash in it) this process did not write is refused;
- the library's bytes are read ONCE, their size and sha256 compared with the record, and those bytes
  written to a fresh private file (0600 in a 0700 ``.load-*`` directory) that is what ``dlopen`` opens
  and is deleted once loaded: swapping the cached file after the check changes nothing (no TOCTOU). A
  fresh compile is loaded the same way, and its record names the hash of the bytes that were loaded.

A library that fails the size check would crash ``dlopen`` (SIGBUS), so the check also keeps the process up.

Without a working compiler the engine can fall back to Treelite's GTIL interpreter and says so in its
details. The artifact's format (``save_xgboost_artifact`` writes what ``load_engine`` reads) lives here too.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import hashlib
import hmac
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import tl2cgen
import treelite
import treelite.gtil
import xgboost
from numpy.typing import NDArray
from pydantic import BaseModel as _Schema
from pydantic import ConfigDict, Field, ValidationError

from riskserve.platform.artifacts import (
    Artifact,
    default_cache_dir,
    open_artifact,
    sha256_bytes,
    write_manifest,
)
from riskserve.platform.base_model import ModelSettings
from riskserve.platform.errors import ConfigError, InvalidInput, ModelLoadError
from riskserve.platform.secret import install_secret
from riskserve.platform.validation import FeatureMatrix, check_feature_matrix
from riskserve.wrappers.treeshap import TreeShap, UnsupportedModel, build_tree_shap, kernel_available

__all__ = [
    "GOLDEN_FILE",
    "LABELS",
    "LIBRARY_NAME",
    "MODEL_FILES",
    "DirectRows",
    "Engine",
    "TreeliteSettings",
    "load_engine",
    "save_xgboost_artifact",
]

logger = logging.getLogger(__name__)

MODEL_FILES: tuple[str, ...] = ("model.json", "model.ubj")
"""Accepted names of the XGBoost model file (JSON or UBJSON); an artifact lists exactly one."""
GOLDEN_FILE = "golden.json"
"""The check set: ``{"x": [[...]], "expected": [...]}`` recorded by XGBoost at save time."""
LIBRARY_NAME = "predictor.so"
"""File name of a compiled library inside its cache directory."""
_BUILD_RECORD = "build.json"
LABELS = ["0", "1"]
_PROBABILITY_OBJECTIVES = frozenset({"binary:logistic", "reg:logistic"})
_MISSING_FRACTION = 0.05
SHAP_GATE_ROWS = 160
"""Gate rows (golden first, then threshold rows with ties and missing values) on which the table
explainer must reproduce XGBoost's TreeSHAP before it serves."""
SHAP_MAX_ABS_DIFF = 1e-4
"""Largest difference, in log-odds, allowed between the tables and XGBoost (which sums in float32)."""
_LOG_TAIL_CHARS = 2000
_SKEW_NOTICE = re.compile(r"Currently running Treelite version (\S+)")

# Run by ``sys.executable -c`` with a JSON spec in argv[1] and the verified model bytes on stdin. It
# imports only treelite and tl2cgen (~0.2 s) and never imports riskserve.
_COMPILE_SCRIPT = """
import json, sys, warnings
warnings.simplefilter("default")
spec = json.loads(sys.argv[1])
raw = sys.stdin.buffer.read()
import tl2cgen, treelite
if spec["format"] == "json":
    model = treelite.frontend.from_xgboost_json(raw)
else:
    model = treelite.frontend.from_xgboost_ubjson(raw)
tl2cgen.export_lib(
    model,
    toolchain=spec["toolchain"],
    libpath=spec["library"],
    params={"parallel_comp": spec["parallel_comp"]},
    nthread=spec["jobs"],
)
"""


class TreeliteSettings(ModelSettings):
    """Where compiled libraries live, how to compile and predict, and how strict the equality gate is."""

    cache_dir: Path = Field(default_factory=lambda: default_cache_dir() / "treelite")
    """Directory of compiled libraries, one subdirectory per artifact version, tl2cgen version, toolchain;
    share it between processes (and restarts) so a second load of an artifact never recompiles.
    Default: ``$RISKSERVE_CACHE_DIR/treelite`` (``~/.cache/riskserve/treelite``)."""
    toolchain: str = Field(default="gcc", pattern=r"^[A-Za-z0-9_./][A-Za-z0-9_.+/-]*$", max_length=200)
    """C compiler command (``gcc``, ``clang``, ``gcc-12``, or a path); tl2cgen runs it through a shell,
    hence the restricted characters."""
    nthread: int = Field(default=1, ge=1, le=256)
    """Threads per prediction call (tl2cgen, GTIL, and XGBoost in the gate); 1 suits many small batches."""
    parallel_comp: int = Field(default=8, ge=0, le=1024)
    """Translation units the trees are split into, compiled in parallel (0: one file, slowest)."""
    compile_timeout_seconds: float = Field(default=900.0, gt=0, le=24 * 3600)
    """A compile taking longer is killed and treated as a toolchain failure."""
    max_abs_diff: float = Field(default=1e-5, ge=0, le=1e-2)
    """Largest allowed |compiled - XGBoost| probability on the check batch; 0 demands bit-identical."""
    check_rows: int = Field(default=512, ge=1, le=1_000_000)
    """Rows of the generated check batch, built from the model's split thresholds; checked in addition to
    the artifact's golden rows, and alone when the artifact has none."""
    allow_gtil_fallback: bool = True
    """Serve with Treelite's GTIL interpreter (slower, same answers) when compiling is impossible."""


class _BuildRecord(_Schema):
    """``build.json`` beside a cached library: what was compiled and the library's size and checksum."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    artifact_version: str
    """Artifact version the library was compiled from."""
    tl2cgen_version: str
    """tl2cgen that generated the C code."""
    toolchain: str
    """Compiler command used."""
    library_sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    """sha256 of the library, checked before every ``dlopen``."""
    library_bytes: int = Field(ge=1)
    """Size of the library in bytes."""
    compile_seconds: float = Field(ge=0)
    """Wall time of the compile that produced it."""
    mac: str = ""
    """HMAC-SHA256 of the other fields under the cache's install secret: the record is this process's
    (or another process of this user's) own, not one planted in the cache."""

    def signed(self, key: bytes) -> _BuildRecord:
        """This record with its ``mac``."""
        return self.model_copy(update={"mac": self._mac(key)})

    def authentic(self, key: bytes) -> bool:
        """Whether ``mac`` was made with ``key`` over these fields (constant-time comparison)."""
        return bool(self.mac) and hmac.compare_digest(self.mac, self._mac(key))

    def _mac(self, key: bytes) -> str:
        payload = self.model_dump_json(exclude={"mac"}).encode()
        return hmac.new(key, payload, hashlib.sha256).hexdigest()


@dataclass
class Engine:
    """A loaded predictor and the lock that keeps it to one calling thread at a time."""

    run: Callable[[FeatureMatrix], Any]
    """Raw engine call on a validated batch; call only while holding ``lock``."""
    version: str
    feature_names: list[str]
    details: dict[str, Any]
    lock: threading.Lock = field(default_factory=threading.Lock)
    direct: DirectRows | None = None
    """The library's own per-row ``predict``, for small batches (no lock: it keeps no state)."""
    booster: xgboost.Booster | None = None
    """XGBoost's reading of the same verified model file, kept for exact TreeSHAP contributions (the
    compiled library cannot give them). XGBoost's predict is thread safe, so it needs no lock."""
    shap: TreeShap | None = None
    """The same contributions from per-leaf tables, ~15x faster; set only once it reproduced XGBoost's on
    the gate rows (``details["explainer"]`` says which one explains, and why)."""


class DirectRows:
    """The generated library's ``predict(union Entry* row, int pred_margin, float* out)``, row by row.

    A finite float32 row is its own ``Entry`` array (``fvalue`` members; ``missing`` is -1 only for a NaN
    bit pattern, which a checked matrix never holds). The function reads the row and writes the score: no
    shared state, so calls need no lock. Used only after it reproduced the predictor bit for bit.
    """

    def __init__(self, library: Path, n_features: int) -> None:
        lib = ctypes.CDLL(str(library))  # the library the predictor opened, after its hash was checked
        lib.get_threshold_type.restype = ctypes.c_char_p
        lib.get_leaf_output_type.restype = ctypes.c_char_p
        lib.get_num_feature.restype = ctypes.c_int32
        lib.get_num_target.restype = ctypes.c_int32
        types = (lib.get_threshold_type(), lib.get_leaf_output_type())
        shape = (lib.get_num_feature(), lib.get_num_target())
        if types != (b"float32", b"float32") or shape != (n_features, 1):
            raise ModelLoadError(f"{library}: (threshold, leaf) types {types}, shape {shape}: no direct rows")
        self._predict = lib.predict
        self._predict.argtypes = (ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p)
        self._predict.restype = None

    def predict(self, batch: FeatureMatrix, *, with_missing: bool = False) -> NDArray[np.float64]:
        """Scores of a checked float32 C-contiguous batch; ``with_missing`` encodes NaN as a missing value
        (``Entry.missing = -1``, as tl2cgen's DMatrix does) instead of assuming finite rows."""
        if with_missing and np.isnan(batch).any():
            encoded = np.array(batch, dtype=np.float32, order="C")
            encoded.view(np.int32)[np.isnan(batch)] = -1
            batch = encoded
        rows = batch.shape[0]
        out = np.zeros(rows, dtype=np.float32)
        base, stride = int(batch.__array_interface__["data"][0]), batch.strides[0]
        target = int(out.__array_interface__["data"][0])
        predict = self._predict
        for i in range(rows):
            predict(base + i * stride, 0, target + 4 * i)
        return out.astype(np.float64)


@dataclass(frozen=True)
class _Compiled:
    """Outcome of one compile attempt: the library in its build directory, or why there is none."""

    build_dir: Path | None
    failure: str | None
    seconds: float
    notes: list[str]


def save_xgboost_artifact(
    booster: xgboost.Booster,
    out_dir: Path,
    *,
    feature_names: Sequence[str],
    golden_x: NDArray[np.float32],
    info: dict[str, Any] | None = None,
) -> Artifact:
    """Write ``model.json``, ``golden.json`` (XGBoost's own predictions) and ``manifest.json``; same booster,
    same bytes.

    Raises:
        InvalidInput: the booster is not a probability model of ``feature_names``, or ``golden_x`` is not a
            finite float32 matrix of that width (naming the column).
    """
    names = list(feature_names)
    if not names or len(set(names)) != len(names):
        raise InvalidInput("feature names must be non-empty and unique", field="feature_names")
    if booster.num_features() != len(names):
        raise InvalidInput(
            f"the booster reads {booster.num_features()} features, {len(names)} names given",
            field="feature_names",
        )
    objective = json.loads(booster.save_config())["learner"]["objective"]["name"]
    if objective not in _PROBABILITY_OBJECTIVES:
        raise InvalidInput(
            f"objective '{objective}' does not output probabilities; use one of "
            f"{sorted(_PROBABILITY_OBJECTIVES)}",
            field="booster",
        )
    golden = check_feature_matrix(np.ascontiguousarray(golden_x), names)
    expected = np.asarray(booster.inplace_predict(golden), dtype=np.float64).reshape(golden.shape[0])
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / MODEL_FILES[0]).write_bytes(bytes(booster.save_raw("json")))
    golden_doc = {"x": golden.tolist(), "expected": [float(value) for value in expected]}
    (out_dir / GOLDEN_FILE).write_text(json.dumps(golden_doc, separators=(",", ":")) + "\n")
    provenance: dict[str, Any] = {
        "objective": objective,
        "num_trees": booster.num_boosted_rounds(),
        "golden_rows": int(golden.shape[0]),
        "xgboost_version": xgboost.__version__,
    }
    write_manifest(
        out_dir,
        kind="treelite",
        files={MODEL_FILES[0]: "model", GOLDEN_FILE: "golden"},
        feature_names=names,
        labels=list(LABELS),
        info={**provenance, **(info or {})},
    )
    return open_artifact(out_dir, kind="treelite")


def load_engine(settings: TreeliteSettings) -> Engine:
    """Verify, compile (or reuse the cached library) and gate ``settings.artifact`` (blocking).

    Raises:
        ModelLoadError: the artifact, the library or the gate fails (the message says which).
    """
    return _Loader(settings).load()


class _Loader:
    """One load of one artifact with one model's settings."""

    def __init__(self, settings: TreeliteSettings) -> None:
        self.settings = settings
        self.name = settings.name

    def load(self) -> Engine:
        started = time.perf_counter()
        settings = self.settings
        artifact = open_artifact(settings.artifact, kind="treelite", public_key=settings.manifest_key())
        feature_names = list(artifact.manifest.feature_names)
        if not feature_names:
            raise ModelLoadError(f"{artifact.root}: the manifest lists no feature names")
        if list(artifact.manifest.labels) != LABELS:
            raise ModelLoadError(f"{artifact.root}: labels {artifact.manifest.labels}, expected {LABELS}")
        model_file, raw = _read_model_file(artifact)
        booster = _load_booster(raw, artifact.root / model_file, settings.nthread)
        model_json = json.loads(bytes(booster.save_raw("json")))
        try:
            objective = str(model_json["learner"]["objective"]["name"])
        except (KeyError, TypeError) as error:
            raise ModelLoadError(
                f"{artifact.root / model_file}: no objective in the model: {error}"
            ) from error
        if objective not in _PROBABILITY_OBJECTIVES:
            raise ModelLoadError(f"{artifact.root}: objective '{objective}' does not output probabilities")
        if booster.num_features() != len(feature_names):
            raise ModelLoadError(
                f"{artifact.root}: the model reads {booster.num_features()} features, "
                f"the manifest names {len(feature_names)}"
            )

        golden = _read_golden(artifact, len(feature_names))
        generated = _threshold_rows(
            _split_thresholds(model_json, len(feature_names)), settings.check_rows, int(artifact.version, 16)
        )
        check_x = generated if golden is None else np.ascontiguousarray(np.vstack([golden[0], generated]))
        reference = np.asarray(booster.inplace_predict(check_x), dtype=np.float64).reshape(check_x.shape[0])
        if golden is not None:
            drift = _max_abs_diff(reference[: golden[0].shape[0]], golden[1])
            if drift > settings.max_abs_diff:
                raise ModelLoadError(
                    f"{artifact.root}: xgboost {xgboost.__version__} disagrees with {GOLDEN_FILE} "
                    f"(max abs diff {drift:.3g} > {settings.max_abs_diff:g})"
                )
        num_trees = int(booster.num_boosted_rounds())

        details: dict[str, Any] = {
            "model_file": model_file,
            "num_trees": num_trees,
            "toolchain": settings.toolchain,
            "nthread": settings.nthread,
            "tl2cgen_version": tl2cgen.__version__,
            "treelite_version": treelite.__version__,
            "xgboost_version": xgboost.__version__,
            "fallback_reason": None,
            "cache_rejected": None,
        }
        try:
            run = self._prepare_engine(artifact, model_file, raw, check_x, reference, details)
            details["gate"]["golden_rows"] = 0 if golden is None else int(golden[0].shape[0])
            direct = _direct_rows(details, len(feature_names), run, check_x)
            shap = _gated_tree_shap(model_json, booster, check_x[:SHAP_GATE_ROWS], details)
        finally:  # dlopen holds the mapping: the private copy's name is not needed once it is loaded
            copy = details.pop("_loaded_copy", None)
            if copy is not None:
                shutil.rmtree(Path(copy).parent, ignore_errors=True)
        details["load_seconds"] = round(time.perf_counter() - started, 4)
        logger.info(
            "model '%s' version %s loaded with %s in %.2fs (compiled=%s, cache_hit=%s)",
            self.name,
            artifact.version,
            details["engine"],
            details["load_seconds"],
            details["compiled"],
            details["cache_hit"],
        )
        return Engine(
            run=run,
            version=artifact.version,
            feature_names=feature_names,
            details=details,
            direct=direct,
            booster=booster,
            shap=shap,
        )

    def _prepare_engine(
        self,
        artifact: Artifact,
        model_file: str,
        raw: bytes,
        check_x: FeatureMatrix,
        reference: NDArray[np.float64],
        details: dict[str, Any],
    ) -> Callable[[FeatureMatrix], Any]:
        """A gated tl2cgen predictor from the cache or a fresh compile, else (if allowed) GTIL."""
        settings = self.settings
        toolchain_slug = re.sub(r"[^A-Za-z0-9_.+-]", "_", settings.toolchain)  # "/usr/bin/gcc" -> one name
        key = f"{artifact.version}-{tl2cgen.__version__}-{toolchain_slug}"
        cache_dir = settings.cache_dir.expanduser().resolve()  # the compile child runs in another cwd
        key_dir = cache_dir / key
        details.update(compiled=False, cache_hit=False, library=None, compile_seconds=None)
        try:
            secret = _private_cache(cache_dir)
            lock_context = _cache_lock(cache_dir / f".{key}.lock")
        except (OSError, ConfigError) as error:
            raise ModelLoadError(f"cannot use the library cache {cache_dir}: {error}") from error
        with lock_context:
            if key_dir.exists():
                cached = self._open_cached(
                    key_dir,
                    artifact.version,
                    len(artifact.manifest.feature_names),
                    check_x,
                    reference,
                    secret,
                    details,
                )
                if isinstance(cached, str):
                    logger.warning("rejected cached library %s: %s; recompiling", key_dir, cached)
                    details["cache_rejected"] = cached
                    shutil.rmtree(key_dir, ignore_errors=True)
                else:
                    run, diff = cached
                    details.update(
                        engine="tl2cgen",
                        cache_hit=True,
                        library=str(key_dir / LIBRARY_NAME),
                        compile_seconds=0.0,
                    )
                    details["gate"] = self._gate_details(check_x, diff)
                    return run
            for stale in cache_dir.glob(f".build-{key}-*"):
                shutil.rmtree(stale, ignore_errors=True)  # left by a process that died mid-compile
            compiled = self._compile(cache_dir, key, raw, model_file)
            details["compile_seconds"] = round(compiled.seconds, 3)
            if compiled.notes:
                details["compile_notes"] = compiled.notes
            if compiled.build_dir is None:
                return self._fallback(
                    artifact, model_file, raw, check_x, reference, details, compiled.failure
                )
            build_dir = compiled.build_dir
            try:
                data = (build_dir / LIBRARY_NAME).read_bytes()  # once: what is loaded is what is recorded
                copy = _private_copy(data, cache_dir)
                details["_loaded_copy"] = str(copy)
                opened = _open_predictor(copy, settings.nthread, len(artifact.manifest.feature_names))
                diff = _max_abs_diff(_run_raw(opened, check_x), reference)
                if diff > settings.max_abs_diff:
                    raise ModelLoadError(
                        f"the compiled library disagrees with xgboost on the check batch "
                        f"(max abs diff {diff:.3g} > {settings.max_abs_diff:g}); refusing version "
                        f"{artifact.version}"
                    )
                record = _BuildRecord(
                    artifact_version=artifact.version,
                    tl2cgen_version=tl2cgen.__version__,
                    toolchain=settings.toolchain,
                    library_sha256=sha256_bytes(data),
                    library_bytes=len(data),
                    compile_seconds=round(compiled.seconds, 3),
                )
                _publish(build_dir, key_dir, record.signed(secret))
            except BaseException:
                shutil.rmtree(build_dir, ignore_errors=True)
                raise
            details.update(engine="tl2cgen", compiled=True, library=str(key_dir / LIBRARY_NAME))
            details["gate"] = self._gate_details(check_x, diff)
            return opened

    def _open_cached(
        self,
        key_dir: Path,
        version: str,
        n_features: int,
        check_x: FeatureMatrix,
        reference: NDArray[np.float64],
        secret: bytes,
        details: dict[str, Any],
    ) -> tuple[Callable[[FeatureMatrix], Any], float] | str:
        """The cached library and its gate diff, or why it cannot be used (then the caller deletes it).

        Opened from a private copy of the bytes that were hashed (``details["_loaded_copy"]``)."""
        library = key_dir / LIBRARY_NAME
        try:
            record = _BuildRecord.model_validate_json((key_dir / _BUILD_RECORD).read_text())
            if not record.authentic(secret):
                return f"{_BUILD_RECORD} was not written by riskserve for this cache (no valid HMAC)"
            built_for = (record.artifact_version, record.tl2cgen_version, record.toolchain)
            wanted = (version, tl2cgen.__version__, self.settings.toolchain)
            if built_for != wanted:
                return f"{_BUILD_RECORD} describes {built_for}, expected {wanted}"
            # Check before dlopen: a truncated library crashes the process instead of raising.
            data = _read_once(library, record.library_bytes)
            if len(data) != record.library_bytes or sha256_bytes(data) != record.library_sha256:
                return f"{LIBRARY_NAME} does not match {_BUILD_RECORD} (truncated or modified)"
            copy = _private_copy(data, key_dir.parent)
        except (OSError, ValidationError) as error:
            return f"incomplete cache entry: {error}"
        details["_loaded_copy"] = str(copy)
        try:
            run = _open_predictor(copy, self.settings.nthread, n_features)
            diff = _max_abs_diff(_run_raw(run, check_x), reference)
        except ModelLoadError as error:
            return str(error)
        if diff > self.settings.max_abs_diff:
            return f"disagrees with xgboost (max abs diff {diff:.3g} > {self.settings.max_abs_diff:g})"
        return run, diff

    def _compile(self, cache_dir: Path, key: str, raw: bytes, model_file: str) -> _Compiled:
        """Compile in a child process into a fresh build directory under ``cache_dir``."""
        settings = self.settings
        if shutil.which(settings.toolchain) is None:
            return _Compiled(None, f"toolchain '{settings.toolchain}' not found on PATH", 0.0, [])
        try:
            build_dir = Path(tempfile.mkdtemp(prefix=f".build-{key}-", dir=cache_dir))
        except OSError as error:
            raise ModelLoadError(f"cannot create a build directory in {cache_dir}: {error}") from error
        spec = {
            "format": "json" if model_file.endswith(".json") else "ubjson",
            "toolchain": settings.toolchain,
            "library": str(build_dir / LIBRARY_NAME),
            "parallel_comp": settings.parallel_comp,
            "jobs": max(1, min(settings.parallel_comp, os.cpu_count() or 1)),
        }
        started = time.perf_counter()
        try:
            process = subprocess.Popen(
                [sys.executable, "-c", _COMPILE_SCRIPT, json.dumps(spec)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                cwd=build_dir,
                start_new_session=True,  # its own process group, so a timeout also kills gcc
            )
        except OSError as error:
            shutil.rmtree(build_dir, ignore_errors=True)
            return _Compiled(None, f"cannot start the compile process: {error}", 0.0, [])
        try:
            stdout, stderr = process.communicate(raw, timeout=settings.compile_timeout_seconds)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
            shutil.rmtree(build_dir, ignore_errors=True)
            return _Compiled(
                None,
                f"compile timed out after {settings.compile_timeout_seconds:g}s",
                time.perf_counter() - started,
                [],
            )
        seconds = time.perf_counter() - started
        note, rest = _split_compile_output(stdout.decode(errors="replace"), stderr.decode(errors="replace"))
        if process.returncode != 0 or not (build_dir / LIBRARY_NAME).is_file():
            shutil.rmtree(build_dir, ignore_errors=True)
            tail = (rest or stdout.decode(errors="replace").strip())[-_LOG_TAIL_CHARS:]
            return _Compiled(None, f"compile failed (exit {process.returncode}): {tail}", seconds, [])
        notes = [note] if note else []
        if note:
            logger.info(note)
        for line in rest.splitlines():
            if line.strip():
                logger.warning("tl2cgen compile: %s", line.strip())
                notes.append(line.strip())
        logger.info("compiled %s with %s in %.2fs", key, settings.toolchain, seconds)
        return _Compiled(build_dir, None, seconds, notes)

    def _fallback(
        self,
        artifact: Artifact,
        model_file: str,
        raw: bytes,
        check_x: FeatureMatrix,
        reference: NDArray[np.float64],
        details: dict[str, Any],
        reason: str | None,
    ) -> Callable[[FeatureMatrix], Any]:
        """GTIL over the Treelite model, gated like a compiled library; only if the settings allow it."""
        settings = self.settings
        if not settings.allow_gtil_fallback:
            raise ModelLoadError(
                f"model '{self.name}' cannot be compiled ({reason}) and allow_gtil_fallback is off"
            )
        logger.warning("model '%s' falls back to Treelite GTIL: %s", self.name, reason)
        try:
            if model_file.endswith(".json"):
                tl_model = treelite.frontend.from_xgboost_json(raw)
            else:
                tl_model = treelite.frontend.from_xgboost_ubjson(raw)
        except treelite.TreeliteError as error:
            raise ModelLoadError(f"{artifact.root / model_file}: treelite cannot read it: {error}") from error
        nthread = settings.nthread

        def run(batch: FeatureMatrix) -> Any:
            return treelite.gtil.predict(tl_model, batch, nthread=nthread)

        diff = _max_abs_diff(_run_raw(run, check_x), reference)
        if diff > settings.max_abs_diff:
            raise ModelLoadError(
                f"GTIL disagrees with xgboost on the check batch (max abs diff {diff:.3g} > "
                f"{settings.max_abs_diff:g}); refusing version {artifact.version}"
            )
        details.update(engine="gtil", fallback_reason=reason)
        details["gate"] = self._gate_details(check_x, diff)
        return run

    def _gate_details(self, check_x: FeatureMatrix, diff: float) -> dict[str, Any]:
        return {"rows": int(check_x.shape[0]), "max_abs_diff": diff, "tolerance": self.settings.max_abs_diff}


# -- helpers -----------------------------------------------------------------------------------------------


def _direct_rows(
    details: dict[str, Any], n_features: int, run: Callable[[FeatureMatrix], Any], check_x: FeatureMatrix
) -> DirectRows | None:
    """The per-row path of a compiled library, if it scores the check batch exactly as the predictor."""
    details["direct_rows"] = False
    if details.get("engine") != "tl2cgen" or not details.get("_loaded_copy"):
        return None
    try:
        direct = DirectRows(Path(details["_loaded_copy"]), n_features)
        same = np.array_equal(direct.predict(check_x, with_missing=True), _run_raw(run, check_x))
    except (OSError, AttributeError, ModelLoadError) as error:
        details["direct_rows_refused"] = str(error)
        return None
    if not same:
        details["direct_rows_refused"] = "differs from the predictor on the check batch"
        return None
    details["direct_rows"] = True
    return direct


def _run_raw(run: Callable[[FeatureMatrix], Any], batch: FeatureMatrix) -> NDArray[np.float64]:
    """An unlocked engine call during load (nobody else holds the engine yet), as float64 ``(n,)``."""
    try:
        scores = np.asarray(run(batch), dtype=np.float64)
    except (tl2cgen.TL2cgenError, treelite.TreeliteError, ValueError) as error:
        raise ModelLoadError(f"the predictor failed on the check batch: {error}") from error
    if scores.size != batch.shape[0]:
        raise ModelLoadError(f"the predictor returned shape {scores.shape} for {batch.shape[0]} rows")
    return scores.reshape(batch.shape[0])


def _open_predictor(library: Path, nthread: int, n_features: int) -> Callable[[FeatureMatrix], Any]:
    """Load a compiled library and check it is a single-output model of ``n_features`` features."""
    try:
        predictor = tl2cgen.Predictor(library, nthread=nthread)
    except (tl2cgen.TL2cgenError, OSError) as error:
        raise ModelLoadError(f"cannot load {library}: {error}") from error
    shape = (predictor.num_feature, predictor.num_target, [int(c) for c in predictor.num_class])
    if shape != (n_features, 1, [1]):
        raise ModelLoadError(
            f"{library}: compiled for (features, targets, classes) {shape}, expected ({n_features}, 1, [1])"
        )

    def run(batch: FeatureMatrix) -> Any:
        # tl2cgen 1.0 returns (rows, targets, classes) = (n, 1, 1) float32 for binary:logistic.
        return predictor.predict(tl2cgen.DMatrix(batch))

    return run


def _publish(build_dir: Path, key_dir: Path, record: _BuildRecord) -> None:
    """Write the signed ``build.json`` and rename the whole build directory into place: it appears
    complete or not, owner-only (0700 directory, 0600 files)."""
    library = build_dir / LIBRARY_NAME
    try:
        (build_dir / _BUILD_RECORD).write_text(record.model_dump_json(indent=2) + "\n")
        for path in build_dir.iterdir():
            if path.is_file():
                path.chmod(0o600)
        for path in (library, build_dir / _BUILD_RECORD):
            with path.open("rb") as handle:
                os.fsync(handle.fileno())
        build_dir.chmod(0o700)  # mkdtemp makes it 0700 already; said here because it is the point
        os.rename(build_dir, key_dir)
    except OSError as error:
        raise ModelLoadError(f"cannot publish the compiled library to {key_dir}: {error}") from error


def _private_cache(cache_dir: Path) -> bytes:
    """Make ``cache_dir`` owner-only (0700) and return its install secret (``.key``, 0600).

    Raises:
        ConfigError: the directory belongs to another user (its contents cannot be trusted), or the
            secret is not private.
    """
    cache_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = os.stat(cache_dir)
    if info.st_uid != os.geteuid():
        raise ConfigError(f"{cache_dir} belongs to uid {info.st_uid}, not this user; use a cache of your own")
    if info.st_mode & 0o077:
        cache_dir.chmod(0o700)
    return install_secret(cache_dir / ".key")


def _read_once(library: Path, expected_bytes: int) -> bytes:
    """The library's bytes, read through one descriptor (no symlink followed), at most one byte past
    ``expected_bytes`` (a longer file is refused without reading it all)."""
    fd = os.open(library, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    with os.fdopen(fd, "rb") as handle:
        return handle.read(expected_bytes + 1)


def _private_copy(data: bytes, cache_dir: Path) -> Path:
    """Write checked library bytes to a fresh owner-only file (0600 in a 0700 directory) to ``dlopen``."""
    directory = Path(tempfile.mkdtemp(prefix=".load-", dir=cache_dir))
    path = directory / LIBRARY_NAME
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)
    return path


@contextlib.contextmanager
def _cache_lock(path: Path) -> Iterator[None]:
    """Exclusive lock per cache entry, across threads and processes: one compiles, the others reuse it."""
    with path.open("a") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _split_compile_output(stdout: str, stderr: str) -> tuple[str | None, str]:
    """Separate the bundled-Treelite version notice (expected) from the rest of the child's stderr.

    tl2cgen's progress lines on stdout go to debug logging. Returns the notice rewritten as one line (or
    ``None``) and the remaining stderr text, which is what a failure reason or a warning should show.
    """
    for line in stdout.splitlines():
        if line.strip():
            logger.debug("tl2cgen: %s", line.strip())
    skew = _SKEW_NOTICE.search(stderr)
    if skew is None:
        return None, stderr.strip()
    note = (
        f"tl2cgen {tl2cgen.__version__} bundles Treelite {skew.group(1)}, older than the installed Treelite "
        f"{treelite.__version__} that serialised the model; expected, and the equality gate verifies the "
        "compiled library"
    )
    rest = "\n".join(
        line
        for line in stderr.splitlines()
        if "newer Treelite version" not in line
        and "Currently running Treelite" not in line
        and "checkpoint was generated" not in line
    )
    return note, rest.strip()


def _read_model_file(artifact: Artifact) -> tuple[str, bytes]:
    """The one model file's name and bytes, re-hashed so what is loaded is exactly what was verified."""
    names = artifact.files_with_role("model")
    if len(names) != 1 or names[0] not in MODEL_FILES:
        raise ModelLoadError(
            f"{artifact.root}: expected one model file named one of {MODEL_FILES}, got {names}"
        )
    name = names[0]
    try:
        raw = artifact.path(name).read_bytes()
    except OSError as error:
        raise ModelLoadError(f"{artifact.root / name}: cannot read: {error}") from error
    if sha256_bytes(raw) != artifact.manifest.files[name].sha256:
        raise ModelLoadError(f"{artifact.root / name}: changed after it was verified")
    return name, raw


def _load_booster(raw: bytes, path: Path, nthread: int) -> Any:
    """XGBoost's reading of the model (JSON or UBJSON, detected from the bytes): the gate's reference."""
    booster = xgboost.Booster()
    try:
        booster.load_model(bytearray(raw))
    except xgboost.core.XGBoostError as error:
        raise ModelLoadError(f"{path}: xgboost cannot read it: {error}") from error
    booster.set_param({"nthread": nthread})
    return booster


def _read_golden(artifact: Artifact, n_features: int) -> tuple[FeatureMatrix, NDArray[np.float64]] | None:
    """Golden rows and their recorded predictions, or ``None`` when the artifact has no golden file."""
    if GOLDEN_FILE not in artifact.manifest.files:
        return None
    data = artifact.read_json(GOLDEN_FILE)
    try:
        x = np.ascontiguousarray(np.asarray(data["x"], dtype=np.float32))
        expected = np.asarray(data["expected"], dtype=np.float64)
    except (KeyError, TypeError, ValueError) as error:
        raise ModelLoadError(f"{artifact.root / GOLDEN_FILE}: malformed: {error}") from error
    if x.ndim != 2 or x.shape[0] == 0 or x.shape[1] != n_features or expected.shape != (x.shape[0],):
        raise ModelLoadError(
            f"{artifact.root / GOLDEN_FILE}: x {x.shape} and expected {expected.shape} do not fit "
            f"{n_features} features"
        )
    return x, expected


def _split_thresholds(model_json: Any, n_features: int) -> list[NDArray[np.float32]]:
    """Sorted unique numeric split thresholds per feature, read from XGBoost's JSON model."""
    values: list[list[float]] = [[] for _ in range(n_features)]
    try:
        gbm = model_json["learner"]["gradient_booster"]
        trees = (gbm["model"] if "model" in gbm else gbm["gbtree"]["model"])["trees"]
        for tree in trees:
            lefts = tree["left_children"]
            split_types = tree.get("split_type") or [0] * len(lefts)
            for left, feature, condition, split_type in zip(
                lefts, tree["split_indices"], tree["split_conditions"], split_types, strict=True
            ):
                if left != -1 and split_type == 0 and 0 <= feature < n_features:
                    values[feature].append(condition)
    except (KeyError, TypeError, ValueError):
        logger.debug("unexpected XGBoost JSON layout; the generated check rows will not target splits")
    return [np.unique(np.asarray(v, dtype=np.float32)) for v in values]


def _threshold_rows(thresholds: list[NDArray[np.float32]], rows: int, seed: int) -> FeatureMatrix:
    """Deterministic rows whose values sit on, just below and just above split thresholds, some missing.

    Ties at a threshold and the default direction of missing values are where a compiled model most
    plausibly differs from XGBoost, so every column is drawn from exactly those values.
    """
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, len(thresholds))).astype(np.float32)
    for column, cuts in enumerate(thresholds):
        if cuts.size == 0:
            continue
        below = np.nextafter(cuts, np.float32(-np.inf))
        above = np.nextafter(cuts, np.float32(np.inf))
        outside = np.asarray([cuts[0] - 1, cuts[-1] + 1], dtype=np.float32)
        candidates = np.concatenate([cuts, below, above, outside])
        candidates = candidates[np.isfinite(candidates)]
        x[:, column] = rng.choice(candidates, size=rows)
    x[rng.random(x.shape) < _MISSING_FRACTION] = np.nan
    return np.ascontiguousarray(x)


def _gated_tree_shap(
    model_json: dict[str, Any], booster: xgboost.Booster, rows: FeatureMatrix, details: dict[str, Any]
) -> TreeShap | None:
    """The table explainer if it reproduces XGBoost's ``pred_contribs`` on ``rows`` (values and bias
    within :data:`SHAP_MAX_ABS_DIFF` log-odds), else ``None`` (XGBoost explains); ``details`` say which."""
    details.update(explainer="xgboost", explainer_reason=None, explainer_max_abs_diff=None)
    if not kernel_available():
        details["explainer_reason"] = "the _treeshap kernel is not built"
        return None
    try:
        shap = build_tree_shap(model_json)
    except UnsupportedModel as error:
        details["explainer_reason"] = f"unsupported: {error}"
        return None
    reference = np.asarray(
        booster.predict(xgboost.DMatrix(rows, nthread=1), pred_contribs=True, validate_features=False),
        dtype=np.float64,
    )
    got = shap.contributions(rows)
    diff = max(
        _max_abs_diff(got.ravel(), reference[:, :-1].ravel()),
        _max_abs_diff(np.full(rows.shape[0], shap.bias), reference[:, -1]),
    )
    details["explainer_max_abs_diff"] = diff
    if diff > SHAP_MAX_ABS_DIFF:
        details["explainer_reason"] = f"tables differ from xgboost by {diff:.3g} on the gate rows"
        logger.warning("model tables differ from xgboost's TreeSHAP by %.3g: xgboost explains", diff)
        return None
    details.update(explainer="tables", explainer_table_mb=round(shap.table_bytes / 1e6, 2))
    return shap


def _max_abs_diff(got: NDArray[np.float64], want: NDArray[np.float64]) -> float:
    """Largest |got - want|; infinite when either holds a non-finite value."""
    if not (np.isfinite(got).all() and np.isfinite(want).all()):
        return float("inf")
    return float(np.max(np.abs(got - want))) if got.size else 0.0
