"""The full decision with the LLM (``card_fraud``) as a team's own gateway computes it (no riskserve on
its request path).

``deploy/pipelines/card_fraud.yaml`` written out by hand, as a team without riskserve writes it in its
gateway: the intent model's prompt and label tokens (read from the artifact's ``manifest.json``, the way
the team would read its model card), the label distribution from the label tokens' log-probabilities, and
the pipeline's risk score and rules. riskserve computes the same thing from the YAML (CEL rules, every
matching rule applies and the most severe outcome wins); the harness checks the two against each other
on every answer. Shared by the two peers of that workload: the separate-services gateway
(``bench/peers/llm_gateway.py``) and plain Ray Serve (``bench/peers/ray_serve_card_fraud.py``).
"""

from __future__ import annotations

import json
import math
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from riskserve.proto.riskserve.v1 import risk_pipeline_pb2 as pb

__all__ = [
    "FALLBACK_INTENT",
    "IntentPrompt",
    "decide",
    "intent_engine",
    "intent_from_logprobs",
    "respond",
]

ROOT = Path(__file__).resolve().parents[2]
PIPELINE = ROOT / "deploy" / "pipelines" / "card_fraud.yaml"

FALLBACK_INTENT = ("unknown", 0.0)
"""The YAML's intent fallback: label ``unknown``, score 0.0, and the decision goes to REVIEW."""
_SEVERITY = {"APPROVE": 0, "REVIEW": 1, "DECLINE": 2}


@dataclass(frozen=True)
class IntentPrompt:
    """How a text is put to the intent LLM and which next tokens are its labels."""

    template: str
    labels: tuple[str, ...]
    label_token_ids: tuple[int, ...]
    max_chars: int = 500
    """``features.fields.text.max_chars`` of the pipeline."""

    @classmethod
    def read(cls, artifact: Path) -> IntentPrompt:
        """From the intent artifact's ``manifest.json`` (``info.prompt_template``, ``labels``,
        ``info.label_token_ids``: the tokens of ``label_prefix + label``)."""
        manifest = json.loads((artifact / "manifest.json").read_text())
        info = manifest["info"]
        return cls(info["prompt_template"], tuple(manifest["labels"]), tuple(info["label_token_ids"]))

    def prompt(self, text: str) -> str:
        """The completion prompt of one message (a message over ``max_chars`` raises ``ValueError``)."""
        if len(text) > self.max_chars:
            raise ValueError(f"text: {len(text)} characters, at most {self.max_chars}")
        return self.template.replace("{text}", text)


def intent_from_logprobs(prompt: IntentPrompt, logprobs: Mapping[int, float]) -> tuple[str, float]:
    """(label, probability) from the label tokens' next-token log-probabilities: a softmax over them, the
    most likely label and its probability (what riskserve's vLLM wrapper computes)."""
    values = [float(logprobs[t]) for t in prompt.label_token_ids]
    top = max(values)
    weights = [math.exp(v - top) for v in values]
    total = sum(weights)
    best = max(range(len(values)), key=values.__getitem__)
    return prompt.labels[best], weights[best] / total


def decide(
    credit: float,
    fraud: float,
    intent: tuple[str, float],
    numeric: Mapping[str, float],
    fallbacks: Sequence[str] = (),
) -> tuple[float, str, list[str]]:
    """(risk score, outcome, reasons) of one request under ``card_fraud.yaml``'s ``decision`` section.

    ``fallbacks`` names the models that did not answer (each forces REVIEW, as their ``review: true``).
    """
    label, score = intent
    risk = 0.45 * fraud + 0.35 * credit + 0.2 * (score if label in ("urgent", "account") else 0.0)
    risk = min(1.0, max(0.0, risk))
    outcome, reasons = "APPROVE", []
    matched = [
        (risk >= 0.6, "DECLINE", "high_risk: combined risk score is 0.6 or more"),
        (0.3 <= risk < 0.6, "REVIEW", "elevated_risk: combined risk score between 0.3 and 0.6"),
        (
            label == "urgent" and score >= 0.8 and numeric.get("amount", 0.0) >= 500.0,
            "REVIEW",
            "pressure_language: message shows urgency or pressure on a large amount",
        ),
        (
            numeric.get("device_change", 0.0) == 1.0 and numeric.get("country_mismatch", 0.0) == 1.0,
            "REVIEW",
            "new_device_abroad: new device and country mismatch together",
        ),
    ]
    for hit, rule_outcome, reason in matched:
        if hit:
            reasons.append(reason)
            outcome = rule_outcome if _SEVERITY[rule_outcome] > _SEVERITY[outcome] else outcome
    for model in sorted(fallbacks):
        reasons.append(f"{model}: model unavailable, decided without it")
        outcome = "REVIEW" if _SEVERITY[outcome] < _SEVERITY["REVIEW"] else outcome
    return risk, outcome, reasons or ["low risk"]


def respond(
    request: pb.DecideRequest,
    credit: float,
    fraud: float,
    intent: tuple[str, float],
    fallbacks: Sequence[str] = (),
) -> pb.DecideResponse:
    """The answer to one request: :func:`decide`'s outcome and reasons, and each model's score (a model in
    ``fallbacks`` is marked ``fallback``)."""
    risk, outcome, reasons = decide(credit, fraud, intent, request.numeric, fallbacks)
    return pb.DecideResponse(
        request_id=request.request_id or uuid.uuid4().hex,
        decision=outcome,
        risk_score=risk,
        models=[
            pb.ModelScore(model="credit", score=credit, fallback="credit" in fallbacks),
            pb.ModelScore(model="fraud", score=fraud, fallback="fraud" in fallbacks),
            pb.ModelScore(model="intent", score=intent[1], label=intent[0], fallback="intent" in fallbacks),
        ],
        reasons=reasons,
        pipeline="card_fraud",
    )


def intent_engine(models: Path, pipeline: Path = PIPELINE) -> tuple[dict[str, Any], dict[str, str]]:
    """vLLM engine arguments and environment for card_fraud's intent model: the settings riskserve's vLLM
    wrapper starts it with (its ``VLLMSettings`` defaults under the YAML's ``settings``), so every peer's
    engine does the same work per text as riskserve's.

    Returns ``(EngineArgs keyword arguments, environment variables)``; the environment must be set before
    the engine starts (vLLM reads it then). ``OMP_NUM_THREADS`` is the model's ``num_cpus``, as Ray gives
    riskserve's replica.
    """
    import yaml

    from riskserve.wrappers.vllm_model import VLLMSettings

    intent = yaml.safe_load(pipeline.read_text())["models"]["intent"]
    settings = VLLMSettings.model_validate(
        {"name": "intent", "artifact": models / "intent", **intent.get("settings", {})}
    )
    root = str((models / "intent").resolve())
    engine = {
        "model": root,
        "tokenizer": root,
        "trust_remote_code": False,
        "load_format": "safetensors",
        "dtype": settings.dtype,
        "max_model_len": settings.max_model_len,
        "max_num_seqs": settings.max_num_seqs,
        "max_num_batched_tokens": settings.max_num_batched_tokens,
        "gpu_memory_utilization": settings.gpu_memory_utilization,
        "enforce_eager": settings.enforce_eager,
        "seed": settings.seed,
        "disable_log_stats": True,
    }
    env = {
        "OMP_NUM_THREADS": str(max(int(intent.get("num_cpus", 1)), 1)),
        "VLLM_CPU_KVCACHE_SPACE": str(settings.kv_cache_space_gib),
        "VLLM_CPU_OMP_THREADS_BIND": settings.omp_threads_bind,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
    }
    return engine, env
