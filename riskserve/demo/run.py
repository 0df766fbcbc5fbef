"""``riskserve demo``: the whole story on a fresh machine, over real gRPC.

Builds the demo models if missing, starts a local Ray with the card-fraud pipeline, sends a few dozen
decisions (legitimate, risky and malformed) and prints them as a table, then shuts everything down.
"""

from __future__ import annotations

import shutil
import statistics
import time
from pathlib import Path

import yaml

from riskserve.client import RiskClient, reason_lines
from riskserve.demo.build import BuiltModel, build_demo_models
from riskserve.demo.dataset import Transactions, generate_transactions
from riskserve.operations.local import down, state_dir, up_local
from riskserve.platform.errors import RiskServeError
from riskserve.proto.riskserve.v1 import risk_pipeline_pb2 as pb

__all__ = ["run_demo"]

_BASE = {"account_age_days": 300.0, "txn_velocity_1h": 1.0, "hour": 10.0}
_CATEGORIES = {"merchant_category": "grocery", "channel": "pos"}
MALFORMED: list[tuple[str, dict[str, object]]] = [
    ("missing amount", {"numeric": _BASE, "categorical": _CATEGORIES}),
    ("NaN amount", {"numeric": {**_BASE, "amount": float("nan")}, "categorical": _CATEGORIES}),
    ("hour 27", {"numeric": {**_BASE, "amount": 10.0, "hour": 27.0}, "categorical": _CATEGORIES}),
    (
        "channel 'fax'",
        {"numeric": {**_BASE, "amount": 10.0}, "categorical": {**_CATEGORIES, "channel": "fax"}},
    ),
    ("typo 'amout'", {"numeric": {**_BASE, "amout": 10.0}, "categorical": _CATEGORIES}),
    ("text too long", {"numeric": {**_BASE, "amount": 10.0}, "categorical": _CATEGORIES, "text": "x" * 600}),
]


def _pipeline_file(pipeline: Path, models: Path) -> Path:
    """The pipeline with its artifacts pointed at ``models`` (so ``--models`` can be anywhere)."""
    data = yaml.safe_load(pipeline.read_text())
    for name, model in data["models"].items():
        model["artifact"] = str((models / name).resolve())
    if "feedback" in data:  # a fresh state (labels, cursors, learned versions) per demo run, so every run
        fresh = state_dir() / "demo-state"  # starts from the same models
        if fresh.exists():
            shutil.rmtree(fresh)
        data["state"] = {"dsn": f"sqlite:///{fresh / data['name']}.sqlite"}
        for name, model in data["models"].items():
            if "online" in model:
                model["online"]["artifact_dir"] = str(fresh / "learned" / name)
    if "audit" in data:  # the trail stays where the YAML keeps it (``var/audit/``), across demo runs
        data["audit"]["path"] = str((pipeline.parent / data["audit"]["path"]).resolve())
    target = state_dir() / f"demo-{pipeline.name}"
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(yaml.safe_dump(data, sort_keys=False))
    return target


def _request(tx_row: dict[str, float | str], request_id: str) -> pb.DecideRequest:
    numeric = {k: float(v) for k, v in tx_row.items() if isinstance(v, float)}
    categorical = {k: str(tx_row[k]) for k in ("merchant_category", "channel")}
    return pb.DecideRequest(
        request_id=request_id, numeric=numeric, categorical=categorical, text=str(tx_row["text"])
    )


def _row(response: pb.DecideResponse, truth: str, latency_ms: float) -> str:
    models = {m.model: m for m in response.models}
    intent = models.get("intent")
    intent_cell = f"{intent.label:<8} {intent.score:4.2f}" if intent else "-"
    scores = "  ".join(
        f"{m.score:5.3f}{'*' if m.fallback else ' '}" for n, m in models.items() if n != "intent"
    )
    reasons = "; ".join(r.split(":")[0] for r in response.reasons)
    decision = pb.Decision.Name(response.decision)
    return (
        f"{response.request_id:<8} {truth:<5} {decision:<8} {response.risk_score:5.3f}  "
        f"{intent_cell:<13} {scores}  {latency_ms:6.1f}  {reasons}"
    )


def _print_reasons(response: pb.DecideResponse | None) -> None:
    """Why one declined transaction was declined: its reason codes, strongest first."""
    if response is None:
        print("\nno transaction was declined")
        return
    print(f"\nwhy {response.request_id} was declined (reason codes; contribution to each model's log-odds, "
          "the intent's probability):")  # fmt: skip
    for line in reason_lines(response) or ["(none: the pipeline lists no reasons for DECLINE)"]:
        print(f"  {line}")


def _audit(pipeline_file: Path, response: pb.DecideResponse | None) -> None:
    """The declined decision as the audit trail keeps it (what ``riskserve audit show ID`` prints)."""
    from riskserve.operations.audit_cli import find_trail, show_audit

    if response is None:
        return
    try:
        trail = find_trail(str(pipeline_file))
        try:
            record = show_audit(trail, response.decision_id)
        finally:
            trail.db.close()
    except Exception as error:  # the demo goes on: say what is missing
        print(f"\naudit trail: {type(error).__name__}: {error}")
        return
    models = ", ".join(f"{m['model']} {m['version'][:12]} {m['score']:.3f}" for m in record["models"])
    print(f"\naudit trail (riskserve audit show {record['decision_id']}): {record['outcome']} at "
          f"{record['decided_at_utc']}, {models}; rules {record['rules']}, {len(record['top_reasons'])} "
          f"reason codes, {len(record['inputs']['numeric']) + len(record['inputs']['categorical'])} input "
          f"fields and the text, trace {record['trace_id']}")  # fmt: skip


def _fraud_version(client: RiskClient, row: dict[str, float | str]) -> str:
    response = client.decide_request(_request(row, "swap-probe"))
    return next(m.version for m in response.models if m.model == "fraud")


def _shadow(client: RiskClient, models: Path, pipeline: str, row: dict[str, float | str]) -> BuiltModel:
    """Retrain the fraud model with another seed and shadow it on every live decision from now on."""
    from riskserve.operations.shadowing import start_shadow

    (candidate,) = build_demo_models(models / "candidates", seed=7, only=["fraud"], progress=False)
    print(
        f"\nshadow: fraud serves {_fraud_version(client, row)}; candidate {candidate.version} (seed 7, "
        f"held-out AUC {candidate.value:.4f}) scores every decision from now on, off the request path"
    )
    start_shadow(pipeline, "fraud", candidate.path, sample=1.0)
    return candidate


def _shadow_figures(pipeline: str) -> None:
    """What the shadow saw on the decisions since it started."""
    from riskserve.operations.shadowing import shadow_status

    for f in shadow_status(pipeline)[pipeline]:
        flips = ", ".join(f"{k} {v}" for k, v in sorted(f.flips.items())) or "none"
        correlation = "-" if f.score_correlation is None else f"{f.score_correlation:.4f}"
        difference = "-" if f.mean_difference is None else f"{f.mean_difference:+.4f}"
        latency = f.candidate_latency_ms.get("p50", 0.0)
        print(f"  {f.model} {f.serving_version} vs {f.candidate_version}: {f.compared} compared "
              f"({f.dropped} dropped), score correlation {correlation}, mean difference {difference}, "
              f"flips {flips}; candidate p50 {latency:.2f} ms off the request path")  # fmt: skip
        if f.serving_logloss is not None and f.candidate_logloss is not None:
            auc = (
                "AUC -"
                if f.serving_auc is None or f.candidate_auc is None
                else (f"AUC serving {f.serving_auc:.4f}, candidate {f.candidate_auc:.4f}")
            )
            print(f"  on the {f.labelled} labelled decisions: log-loss serving {f.serving_logloss:.4f}, "
                  f"candidate {f.candidate_logloss:.4f}; {auc}")  # fmt: skip


def _hot_swap(client: RiskClient, pipeline: str, row: dict[str, float | str]) -> None:
    """Promote the shadowed candidate (a verified hot swap), then roll back; nothing else restarts."""
    from riskserve.operations.shadowing import promote_shadow
    from riskserve.operations.swap import rollback_model

    swapped = promote_shadow(pipeline, "fraud")
    print(f"  promote  {swapped.old_version} -> {swapped.new_version} in {swapped.seconds:.1f} s (hot swap); "
          f"a decision now uses {_fraud_version(client, row)}")  # fmt: skip
    back = rollback_model(pipeline, "fraud")
    now = _fraud_version(client, row)
    print(f"  rollback {back.old_version} -> {back.new_version}; a decision now uses {now}")


def _feedback_loop(client: RiskClient, pipeline: str, tx: Transactions, decided: list[str]) -> None:
    """Label past decisions (``decided[i]``: the id of row ``100 + i``'s decision) with their truth, by
    the id the server gave them (a caller's request id may name decisions of earlier runs kept in the
    audit trail); the learner applies them as one mini-batch and publishes."""
    from riskserve.operations.swap import learning_status

    before = learning_status(pipeline)["models"]["fraud"]
    print(f"\nonline learning: fraud serves {before['version']}; labelling {len(decided)} past decisions")
    t0 = time.perf_counter()
    for i, decision_id in enumerate(decided):
        client.feedback(
            decision_id=decision_id,
            label=int(tx.is_fraud[100 + i]),
            feedback_id=f"cb-{i}",
            source="chargebacks",
        )
    acked = time.perf_counter()
    print(f"  {len(decided)} labels durable (fsynced) in {(acked - t0) * 1e3:.0f} ms")
    deadline = time.monotonic() + 60
    row = tx.row(0)
    while (version := _fraud_version(client, row)) == before["version"] and time.monotonic() < deadline:
        time.sleep(0.05)
    published = time.perf_counter()
    report = learning_status(pipeline)["models"]["fraud"]["last_report"]
    if report is None:
        print("  the learner did not apply the batch within 60 s")
        return
    loss = report["logloss_before"], report["logloss_after"]
    judged = f"held-out log-loss {loss[0]:.4f} -> {loss[1]:.4f}" if loss[0] is not None else "golden rows"
    print(f"  mini-batch {report['after_seq'] + 1}..{report['last_seq']}: {report['trained_rows']} trained, "
          f"{report['holdout_rows']} held out, step {report['coef_step']:.4f}, "
          f"{report['outcome']} ({judged})")  # fmt: skip
    print(f"  {report['parent']} -> {report['version']}; a decision uses {version} "
          f"{(published - acked) * 1e3:.0f} ms after the last label")  # fmt: skip
    again = client.feedback(decision_id=decided[0], label=int(tx.is_fraud[100]), feedback_id="cb-0",
                            source="chargebacks")  # fmt: skip
    print(f"  a retried label: duplicate={again.duplicate}, seq {again.seq} (applied once)")


def run_demo(*, models: Path, pipeline: Path, grpc_port: int) -> int:
    """Run the demo end to end; returns the exit code."""
    started = time.perf_counter()
    print(f"1/5 demo models in {models}")
    build_demo_models(models, seed=0)
    path = _pipeline_file(pipeline, models)
    print(
        f"2/5 starting a local Ray + Serve with {pipeline.name} (gRPC on 127.0.0.1:{grpc_port}) ...",
        flush=True,
    )
    t0 = time.perf_counter()
    state = up_local([path], grpc_port=grpc_port, reset_served=True)  # every run starts from the built models
    print(f"    up in {time.perf_counter() - t0:.1f} s")
    try:
        with RiskClient(state.target, pipeline=state.pipelines[0], timeout_s=30) as client:
            described = client.describe()
            print(f"3/5 {described.pipeline} {described.version}: " + ", ".join(
                f"{m.name} ({m.kind} {m.version})" for m in described.models))  # fmt: skip
            tx = generate_transactions(400, seed=2026)
            frauds = [i for i in range(len(tx)) if tx.is_fraud[i]][:10]
            legit = [i for i in range(len(tx)) if not tx.is_fraud[i]][:14]
            print("4/5 decisions over gRPC ('*' = model fallback)\n")
            print(
                f"{'id':<8} {'truth':<5} {'decision':<8} {'risk':>5}  {'intent':<13} credit  fraud  ", end=""
            )
            print(f"  {'ms':>6}  reasons")
            latencies = []
            declined: pb.DecideResponse | None = None
            for i in sorted(frauds + legit):
                t1 = time.perf_counter()
                response = client.decide_request(_request(tx.row(i), f"tx-{i}"))
                latencies.append((time.perf_counter() - t1) * 1e3)
                print(_row(response, "fraud" if tx.is_fraud[i] else "ok", latencies[-1]))
                if declined is None and response.decision == pb.DECLINE:
                    declined = response
            _print_reasons(declined)
            _audit(path, declined)
            print("\nmalformed requests are refused before any model runs:")
            for label, body in MALFORMED:
                try:
                    client.decide_request(pb.DecideRequest(**body))  # type: ignore[arg-type]
                    print(f"  {label:<16} unexpectedly accepted")
                except RiskServeError as error:
                    print(f"  {label:<16} {type(error).__name__} (INVALID_ARGUMENT): {error}")
            _shadow(client, models, state.pipelines[0], tx.row(0))
            batch = [_request(tx.row(i), f"b-{i}") for i in range(64)]
            t2 = time.perf_counter()
            client.decide_batch(batch)
            batch_s = time.perf_counter() - t2
            decision_ids: list[str] = []  # what a label names: the id the server gave each decision
            for i in range(100):
                t1 = time.perf_counter()
                answer = client.decide_request(_request(tx.row(100 + i), f"lat-{i}"))
                latencies.append((time.perf_counter() - t1) * 1e3)
                decision_ids.append(answer.decision_id)
            ordered = sorted(latencies)
            p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
            _feedback_loop(client, state.pipelines[0], tx, decision_ids[:64])
            print("\nshadow comparison since it started:")
            _shadow_figures(state.pipelines[0])
            _hot_swap(client, state.pipelines[0], tx.row(0))
            p50 = statistics.median(ordered)
            print(
                f"\n5/5 Decide latency, {len(ordered)} sequential calls: p50 {p50:.1f} ms, p99 {p99:.1f} ms"
            )
            print(f"    DecideBatch of 64: {batch_s * 1e3:.0f} ms ({64 / batch_s:.0f} decisions/s)")
    finally:
        down()
    print(f"done in {time.perf_counter() - started:.0f} s (riskserve is down)")
    return 0
