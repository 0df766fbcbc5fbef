"""Build every demo model into one directory, deterministically, each written atomically.

``models/credit`` (XGBoost, served through Treelite), ``models/fraud`` (online logistic regression) and
``models/intent`` (a small Llama intent LLM served by vLLM). A model already built and verifiable with
the same seed is kept, so the build is cheap to repeat.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from riskserve.demo.tabular import TabularData, make_tabular_data, train_fraud_lr, train_xgboost
from riskserve.platform.artifacts import Artifact, open_artifact
from riskserve.platform.errors import ArtifactIntegrityError, ConfigError

__all__ = ["DEMO_MODELS", "BuiltModel", "build_demo_models"]

DEMO_MODELS = {"credit": "treelite", "fraud": "sklearn", "intent": "vllm"}
"""Demo model name -> backend kind."""


@dataclass(frozen=True)
class BuiltModel:
    """One demo model: where it is, its version, its held-out quality, and whether this run built it."""

    name: str
    kind: str
    path: Path
    version: str
    metric: str
    value: float
    seconds: float
    reused: bool


def _existing(path: Path, kind: str, seed: int) -> Artifact | None:
    try:
        artifact = open_artifact(path, kind=kind)
    except ArtifactIntegrityError:
        return None
    return artifact if artifact.manifest.info.get("seed") == seed else None


def _atomic_build(target: Path, build: Callable[[Path], None]) -> None:
    """Build into a sibling temp dir and rename it into place: a crash never leaves half an artifact."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        build(staging / "artifact")
        if target.exists():
            shutil.rmtree(target)
        (staging / "artifact").rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def build_demo_models(
    out: Path | str,
    *,
    seed: int = 0,
    only: Iterable[str] | None = None,
    force: bool = False,
    progress: bool = True,
) -> list[BuiltModel]:
    """Build (or reuse) the demo models under ``out`` and report each one's held-out quality.

    Raises:
        ConfigError: ``only`` names a model that is not a demo model.
    """
    out = Path(out)
    names = list(only) if only is not None else list(DEMO_MODELS)
    unknown = sorted(set(names) - set(DEMO_MODELS))
    if unknown:
        raise ConfigError(f"unknown demo model(s) {unknown}; choose from {sorted(DEMO_MODELS)}")
    data: TabularData | None = None
    built: list[BuiltModel] = []
    for name in names:
        kind, target = DEMO_MODELS[name], out / name
        metric = "heldout_accuracy" if kind == "vllm" else "heldout_auc"
        started = time.perf_counter()
        artifact = None if force else _existing(target, kind, seed)
        reused = artifact is not None
        if artifact is None:
            if kind != "vllm" and data is None:
                data = make_tabular_data(seed)
            _atomic_build(target, _builder(name, data, seed, progress))
            artifact = open_artifact(target, kind=kind)
        model = BuiltModel(
            name=name,
            kind=kind,
            path=target,
            version=artifact.version,
            metric=metric,
            value=float(artifact.manifest.info[metric]),
            seconds=time.perf_counter() - started,
            reused=reused,
        )
        built.append(model)
        if progress:
            how = "kept" if reused else f"built in {model.seconds:.1f} s"
            print(f"  {name:<7} {kind:<9} {metric} {model.value:.4f}  version {model.version}  ({how})")
    return built


def _builder(name: str, data: TabularData | None, seed: int, progress: bool) -> Callable[[Path], None]:
    def build(path: Path) -> None:
        if name == "intent":
            from riskserve.demo.intent_llm import build_intent_llm

            build_intent_llm(path, seed=seed, progress=progress)
        elif name == "fraud":
            assert data is not None
            train_fraud_lr(data, path, seed=seed)
        else:
            assert data is not None
            train_xgboost(data, path, seed=seed, progress=progress)

    return build
