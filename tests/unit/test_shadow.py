"""A shadow candidate on live decisions: the answers stay exactly as without it, and its comparison figures
equal an offline recomputation (scikit-learn's own scores, log-loss and AUC; the rules redone in numpy).
Real models, the real decision flow in process (no Ray)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from sklearn.metrics import log_loss, roc_auc_score

from riskserve.demo.dataset import Transactions, generate_transactions
from riskserve.demo.tabular import make_tabular_data, train_fraud_lr, train_xgboost
from riskserve.features.encoder import FeatureEncoder, RawRequest
from riskserve.proto.riskserve.v1 import risk_pipeline_pb2 as pb
from riskserve.schema.pipeline import parse_pipeline
from riskserve.serving.shadow import ShadowComparison, Shadows
from riskserve.wrappers.sklearn_model import load_sklearn_artifact, snapshot_scores
from tests.flow_helpers import flow_of, serve_runners, tabular_document

ROWS, BATCH = 480, 16


@dataclass
class Models:
    document: dict[str, Any]
    candidate: Path
    broken: Path


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Models:
    """tabular_only's models, and a fraud candidate trained on other data (another version)."""
    root = tmp_path_factory.mktemp("models")
    data = make_tabular_data(5, train_rows=6000, test_rows=100)
    train_xgboost(data, root / "credit", seed=5, rounds=40, progress=False)
    train_fraud_lr(data, root / "fraud", seed=5)
    train_fraud_lr(make_tabular_data(8, train_rows=3000, test_rows=100), root / "candidate", seed=8)
    return Models(tabular_document(root), root / "candidate", root / "credit")


def _requests(tx: Transactions) -> list[pb.DecideRequest]:
    requests = []
    for i in range(len(tx)):
        row = tx.row(i)
        requests.append(
            pb.DecideRequest(
                request_id=f"tx-{i}",
                numeric={k: float(v) for k, v in row.items() if isinstance(v, float)},
                categorical={k: str(row[k]) for k in ("merchant_category", "channel")},
            )
        )
    return requests


def _answer(response: pb.DecideResponse) -> tuple[Any, ...]:
    """A response without the latencies (the only fields that differ between two runs)."""
    models = [(m.model, m.version, m.score, m.label, m.fallback) for m in response.models]
    return (response.request_id, response.decision, response.risk_score, models, list(response.reasons),
            [(r.field, r.contribution, r.model) for r in response.top_reasons])  # fmt: skip


def _outcome(risk: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """tabular_only's rules, redone: DECLINE from 0.6, REVIEW from 0.3."""
    return np.where(risk >= 0.6, "DECLINE", np.where(risk >= 0.3, "REVIEW", "APPROVE"))


def test_a_shadow_changes_no_answer_and_its_figures_equal_an_offline_recomputation(models: Models) -> None:
    tx = generate_transactions(ROWS, seed=41)
    requests = _requests(tx)
    spec = parse_pipeline(models.document)

    async def run() -> tuple[list[pb.DecideResponse], list[pb.DecideResponse], Shadows]:
        runners = await serve_runners(spec)
        shadows = Shadows(spec, runners)
        await shadows.configure({"fraud": {"artifact": str(models.candidate), "sample": 1.0}})
        assert list(shadows.active) == ["fraud"], shadows.errors
        plain = flow_of(models.document, runners)
        shadowed = flow_of(models.document, runners, shadows=shadows)
        without, with_shadow = [], []
        for start in range(0, ROWS, BATCH):
            batch = requests[start : start + BATCH]
            without += await plain.decide(batch, "t", time.monotonic() + 30, False)
            with_shadow += await shadowed.decide(batch, "t", time.monotonic() + 30, False)
            await shadows.idle()  # one sample in flight at a time: wait, so none is dropped
        return without, with_shadow, shadows

    without, with_shadow, shadows = asyncio.run(run())
    assert [_answer(r) for r in with_shadow] == [_answer(r) for r in without]

    # Offline: the candidate's scores by scikit-learn itself on independently encoded rows.
    encoder = FeatureEncoder(spec.features)
    rows = [encoder.validate(_raw(r)) for r in requests]
    matrix = encoder.encode(rows).matrix
    _, snapshot = load_sklearn_artifact(models.candidate)
    candidate = snapshot_scores(snapshot, matrix)
    scores = {name: np.array([next(m.score for m in r.models if m.model == name) for r in without])
              for name in ("fraud", "credit")}  # fmt: skip
    serving = scores["fraud"]
    flips: dict[str, int] = {}
    served = np.array([pb.Decision.Name(r.decision) for r in without])
    would = _outcome(0.5 * candidate + 0.5 * scores["credit"])
    for a, b in zip(served, would, strict=True):
        if a != b:
            flips[f"{a}->{b}"] = flips.get(f"{a}->{b}", 0) + 1
    assert flips, "the candidate is another model: some decisions must flip"

    figures = shadows.figures({"fraud": without[0].models[1].version})[0]
    assert figures.compared == ROWS
    assert figures.dropped == 0
    assert figures.score_correlation == pytest.approx(np.corrcoef(serving, candidate)[0, 1], abs=1e-9)
    assert figures.mean_difference == pytest.approx(float(np.mean(candidate - serving)), abs=1e-12)
    assert figures.flips == flips
    assert figures.candidate_version == snapshot.version != figures.serving_version
    assert set(figures.candidate_latency_ms) == {"p50", "p99"}

    # Labels arrive through Feedback for the first 300 decisions (named by the decision id each answer
    # carries): both models judged on the same ones.
    for i in range(300):
        shadows.label(with_shadow[i].decision_id, int(tx.is_fraud[i]))
    shadows.label("never-compared", 1)
    labelled = shadows.figures({})[0]
    y = tx.is_fraud[:300]
    assert labelled.labelled == 300
    assert labelled.serving_logloss == pytest.approx(log_loss(y, serving[:300]), abs=1e-9)
    assert labelled.candidate_logloss == pytest.approx(log_loss(y, candidate[:300]), abs=1e-9)
    assert labelled.serving_auc == pytest.approx(roc_auc_score(y, serving[:300]), abs=1e-12)
    assert labelled.candidate_auc == pytest.approx(roc_auc_score(y, candidate[:300]), abs=1e-12)


def test_a_shadow_waits_for_the_decisions_in_flight_and_drops_past_its_queue(models: Models) -> None:
    spec = parse_pipeline(models.document)
    requests = _requests(generate_transactions(2 * BATCH, seed=42))

    async def run() -> tuple[int, ShadowComparison]:
        runners = await serve_runners(spec)
        shadows = Shadows(spec, runners)
        settings = {"artifact": str(models.candidate), "sample": 1.0, "max_in_flight": 1}
        await shadows.configure({"fraud": settings})
        flow = flow_of(models.document, runners)  # decides; the shadow is offered its batches by hand
        stages, decided = [], []
        for start in (0, BATCH):
            batch = requests[start : start + BATCH]
            stage = flow._local_stage.encode([_raw(r) for r in batch], None, share=False)  # type: ignore[union-attr]
            responses = await flow.decide(batch, "t", time.monotonic() + 30, False)
            stages.append(stage)
            decided.append([(_decision(r), {m.model: _result(m) for m in r.models}) for r in responses])
        shadow = shadows.active["fraud"]
        ids = [[r.request_id for r in requests[s : s + BATCH]] for s in (0, BATCH)]
        shadows.gate.enter()  # a decision is in flight: the shadow must not work
        shadow.offer(stages[0], ids[0], decided[0])
        shadow.offer(stages[1], ids[1], decided[1])  # the first is still queued: dropped
        await asyncio.sleep(0.2)
        while_busy = shadow.comparison.compared
        shadows.gate.leave()
        await shadows.idle()
        return while_busy, shadow.comparison

    while_busy, comparison = asyncio.run(run())
    assert while_busy == 0
    assert (comparison.compared, comparison.dropped) == (BATCH, BATCH)


def test_a_candidate_that_fails_the_swap_checks_is_not_run_and_says_why(models: Models) -> None:
    spec = parse_pipeline(models.document)

    async def run() -> Shadows:
        shadows = Shadows(spec, await serve_runners(spec))
        await shadows.configure({"fraud": {"artifact": str(models.broken), "sample": 0.5}})
        return shadows

    shadows = asyncio.run(run())
    assert shadows.active == {}
    (figures,) = shadows.figures({})
    assert "a 'treelite' artifact, expected 'sklearn'" in figures.error
    assert shadows.config() == {"fraud": {"artifact": str(models.broken), "sample": 0.5, "max_in_flight": 4}}


def _raw(request: pb.DecideRequest) -> RawRequest:
    return RawRequest(numeric=dict(request.numeric), categorical=dict(request.categorical), text=request.text)


def _decision(response: pb.DecideResponse) -> Any:
    from riskserve.schema.rules import Decision

    return Decision(pb.Decision.Name(response.decision), response.risk_score, list(response.reasons))  # type: ignore[arg-type]


def _result(score: pb.ModelScore) -> Any:
    from riskserve.schema.rules import ModelResult

    return ModelResult(score.model, score.version, score.score, latency_ms=score.latency_ms)


def test_the_operator_commands_import_no_ray_before_they_connect() -> None:
    """``connected`` sets Ray's loopback node address before Ray is imported; a CLI module that imported Ray
    first would join the local cluster on the machine's public address and hang."""
    import subprocess
    import sys

    code = (
        "import sys, riskserve.cli, riskserve.operations.shadowing, riskserve.operations.local, "
        "riskserve.operations.audit_cli, riskserve.serving.frontdoor, riskserve.demo.run; "
        "print('ray' in sys.modules)"
    )  # local and frontdoor: `up` checks the front door in the demo's own process before it connects
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.strip() == "False"


def test_a_text_model_is_refused_as_a_shadow_target_even_in_the_ingress() -> None:
    """Shadows score the feature matrix: an LLM placed in the ingress is refused, naming the field, before
    any candidate is read or Ray is asked."""
    import yaml

    from riskserve.operations.shadowing import shadow
    from riskserve.platform.errors import InvalidInput

    pipelines = Path(__file__).resolve().parents[2] / "deploy" / "pipelines"
    data = yaml.safe_load((pipelines / "card_fraud.yaml").read_text())
    data["models"]["intent"].update(placement="ingress", pool="cpu", num_cpus=0.5)
    spec = parse_pipeline(data, base_dir=pipelines)
    with pytest.raises(InvalidInput, match="reads the request's text") as refused:
        shadow(spec, "intent", "/nonexistent/candidate", 0.1)
    assert refused.value.field == "model"
