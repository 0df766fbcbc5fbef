"""The intent-LLM build is a pure function of its seed: same seed, same bytes, same version."""

from __future__ import annotations

from pathlib import Path

import pytest

from riskserve.demo.dataset import INTENTS
from riskserve.platform.artifacts import open_artifact
from riskserve.platform.errors import ConfigError

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from riskserve.demo.intent_llm import PROMPT_TEMPLATE, build_intent_llm

_STEPS = 3  # determinism does not need a trained model; three steps keep the test to a few seconds


def test_same_seed_gives_the_same_artifact(tmp_path: Path) -> None:
    first = build_intent_llm(tmp_path / "a", seed=5, progress=False, steps=_STEPS)
    second = build_intent_llm(tmp_path / "b", seed=5, progress=False, steps=_STEPS)
    other = build_intent_llm(tmp_path / "c", seed=6, progress=False, steps=_STEPS)

    a, b = open_artifact(first.path, kind="vllm"), open_artifact(second.path, kind="vllm")
    assert a.manifest.files == b.manifest.files  # every file's sha256 and size
    assert first.version == second.version == a.version
    assert other.version != first.version
    assert first.accuracy == second.accuracy


def test_artifact_lists_every_file_and_the_prompt(tmp_path: Path) -> None:
    report = build_intent_llm(tmp_path / "m", seed=0, progress=False, steps=_STEPS)
    artifact = open_artifact(report.path, kind="vllm")

    on_disk = {p.name for p in report.path.iterdir() if p.name != "manifest.json"}
    assert set(artifact.manifest.files) == on_disk
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= on_disk
    assert artifact.files_with_role("model") == sorted(on_disk)
    assert artifact.manifest.labels == list(INTENTS)
    info = artifact.manifest.info
    assert info["prompt_template"] == PROMPT_TEMPLATE
    assert info["seed"] == 0
    assert info["heldout_seed"] != 0
    assert len(info["label_token_ids"]) == len(set(info["label_token_ids"])) == len(INTENTS)


def test_steps_must_be_positive(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="steps"):
        build_intent_llm(tmp_path / "x", steps=0, progress=False)
