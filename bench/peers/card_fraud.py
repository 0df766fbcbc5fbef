"""The full decision with the LLM (``card_fraud``) as a team's own gateway computes it: numpy only.

``deploy/pipelines/card_fraud.yaml`` written out by hand, as a team without riskserve writes it in its
gateway: the intent model's prompt and label tokens (read from the artifact's ``manifest.json``, the way
the team would read its model card), the label distribution from the label tokens' log-probabilities, and
the pipeline's risk score and rules. riskserve computes the same thing from the YAML (CEL rules, every
matching rule applies and the most severe outcome wins); the harness checks the two against each other
on every answer.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["FALLBACK_INTENT", "IntentPrompt", "decide", "intent_from_logprobs"]

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
