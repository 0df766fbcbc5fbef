"""The peers of ``card_fraud`` (separate services, plain Ray Serve) decide as riskserve does: their
hand-written rules equal riskserve's compiled ``decision`` section, their intent equals the wrapper's
softmax over the label tokens, their LLM engines get riskserve's engine settings, and the load generator
checks the intent and leaves fallback answers unchecked but counted."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from bench.loadgen import Tally, read_expected
from bench.peers.card_fraud import (
    FALLBACK_INTENT,
    IntentPrompt,
    decide,
    intent_engine,
    intent_from_logprobs,
    respond,
)
from riskserve.features.encoder import ValidRow
from riskserve.proto.riskserve.v1 import risk_pipeline_pb2 as rpb
from riskserve.schema.pipeline import load_pipeline
from riskserve.schema.rules import DecisionEngine, ModelResult

ROOT = Path(__file__).resolve().parents[2]
PIPELINE = ROOT / "deploy" / "pipelines" / "card_fraud.yaml"


def test_hand_written_rules_equal_riskserve_decision_engine() -> None:
    engine = DecisionEngine(load_pipeline(PIPELINE).rule_scope())
    rng = np.random.default_rng(11)
    labels = ["purchase", "gift", "refund", "account", "urgent", "unknown"]
    outcomes = set()
    for i in range(800):
        numeric = {
            "amount": float(rng.choice([10.0, 499.0, 500.0, 2500.0])),
            "device_change": float(rng.integers(0, 2)),
            "country_mismatch": float(rng.integers(0, 2)),
        }
        credit, fraud = float(rng.uniform()), float(rng.uniform())
        intent = (labels[i % len(labels)], float(rng.choice([0.3, 0.79, 0.8, 0.95])))
        fallbacks = ["intent"] if intent == FALLBACK_INTENT or i % 97 == 0 else []
        results = {
            "credit": ModelResult(name="credit", version="v", score=credit),
            "fraud": ModelResult(name="fraud", version="v", score=fraud),
            "intent": ModelResult(
                name="intent", version="v", score=intent[1], label=intent[0], fallback=bool(fallbacks)
            ),
        }
        want = engine.decide(ValidRow(numeric=numeric, categorical={}, text="t"), results)
        risk, outcome, _ = decide(credit, fraud, intent, numeric, fallbacks)
        assert math.isclose(risk, want.risk_score, abs_tol=1e-12), (i, numeric, credit, fraud, intent)
        assert outcome == want.outcome, (i, numeric, credit, fraud, intent, want)
        outcomes.add(outcome)
    assert outcomes == {"APPROVE", "REVIEW", "DECLINE"}


def test_intent_is_the_softmax_over_the_label_tokens(demo_models: Path) -> None:
    prompt = IntentPrompt.read(demo_models / "intent")
    assert prompt.labels == ("purchase", "gift", "refund", "account", "urgent")
    assert prompt.prompt("pay now") == "message: pay now\nintent:"
    logprobs = dict(zip(prompt.label_token_ids, [-3.0, -2.0, -9999.0, -0.5, -1.0], strict=True))
    label, score = intent_from_logprobs(prompt, logprobs)
    values = np.exp(np.array([-3.0, -2.0, -9999.0, -0.5, -1.0]))
    assert label == "account"
    assert math.isclose(score, float(values[3] / values.sum()), rel_tol=1e-12)


def test_loadgen_checks_the_intent_and_counts_fallbacks_unchecked(tmp_path: Path) -> None:
    path = tmp_path / "expect.json"
    path.write_text(json.dumps({"a": [0.2, 0.4, 0.3, "REVIEW", "urgent", 0.9]}))
    expect = read_expected(path)

    def answer(label: str, score: float, fallback: bool = False) -> rpb.DecideResponse:
        models = [
            rpb.ModelScore(model="credit", score=0.2),
            rpb.ModelScore(model="fraud", score=0.4),
            rpb.ModelScore(model="intent", score=score, label=label, fallback=fallback),
        ]
        return rpb.DecideResponse(request_id="a", decision="REVIEW", risk_score=0.3, models=models)

    tally = Tally()
    tally.answered(0.001, [answer("urgent", 0.9)], expect)
    assert tally.wrong == 0
    tally.answered(0.001, [answer("account", 0.9)], expect)
    tally.answered(0.001, [answer("urgent", 0.9002)], expect)
    assert tally.wrong == 2
    assert tally.wrong_example.startswith("a: intent ('account', 0.9)")
    tally.answered(0.001, [answer("unknown", 0.0, fallback=True)], expect)
    assert (tally.wrong, tally.fallbacks["intent"], tally.decisions) == (2, 1, 4)


def test_the_peers_answer_carries_the_decision_and_marks_fallbacks() -> None:
    request = rpb.DecideRequest(request_id="r1", numeric={"amount": 900.0, "device_change": 1.0})
    answer = respond(request, 0.2, 0.9, ("urgent", 0.85))
    risk, outcome, reasons = decide(0.2, 0.9, ("urgent", 0.85), request.numeric)
    assert (answer.request_id, answer.risk_score, answer.decision, list(answer.reasons)) == (
        "r1",
        risk,
        rpb.Decision.Value(outcome),
        reasons,
    )
    assert [(m.model, m.score, m.label, m.fallback) for m in answer.models] == [
        ("credit", 0.2, "", False),
        ("fraud", 0.9, "", False),
        ("intent", 0.85, "urgent", False),
    ]
    fallen = respond(request, 0.5, 0.5, FALLBACK_INTENT, ["intent"])
    assert [m.fallback for m in fallen.models] == [False, False, True]
    assert fallen.decision == rpb.REVIEW
    assert fallen.reasons[-1] == "intent: model unavailable, decided without it"


def test_every_peers_llm_engine_gets_riskserves_engine_settings(demo_models: Path) -> None:
    from riskserve.wrappers.vllm_model import VLLMSettings

    engine, env = intent_engine(demo_models)
    ours = VLLMSettings.model_validate(
        {
            "name": "intent",
            "artifact": demo_models / "intent",
            **load_pipeline(PIPELINE).models["intent"].settings,
        }
    )
    assert (ours.max_model_len, ours.max_num_seqs) == (128, 32)  # card_fraud.yaml's settings reach both
    assert {k: engine[k] for k in ("dtype", "max_model_len", "max_num_seqs", "enforce_eager", "seed")} == {
        "dtype": ours.dtype,
        "max_model_len": ours.max_model_len,
        "max_num_seqs": ours.max_num_seqs,
        "enforce_eager": ours.enforce_eager,
        "seed": ours.seed,
    }
    assert engine["max_num_batched_tokens"] == ours.max_num_batched_tokens
    assert engine["gpu_memory_utilization"] == ours.gpu_memory_utilization
    assert (engine["load_format"], engine["trust_remote_code"]) == ("safetensors", False)
    assert engine["model"] == str((demo_models / "intent").resolve())
    assert env["VLLM_CPU_KVCACHE_SPACE"] == str(ours.kv_cache_space_gib)
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == ours.omp_threads_bind
    assert env["OMP_NUM_THREADS"] == "1"  # the intent model's num_cpus, as Ray gives riskserve's replica
    assert env["HF_HUB_OFFLINE"] == "1"
