"""riskserve's metrics through Ray's own pipeline into a real Prometheus server, as an operator scrapes them.

A small Serve application records a known mix with :class:`ModelMetrics` / :class:`PipelineMetrics` (10
decisions: 7 APPROVE and 3 DECLINE; the fraud model times out twice, the credit model fails once and changes
version); Prometheus (Debian's ``prometheus`` binary, started here on a free loopback port) scrapes the Ray
node's metrics export port every second; the counters, histogram counts and gauges it reports must equal what
was recorded, per model and per outcome, under the exact names :attr:`MetricSpec.exported` documents.

Without the binary the module is skipped with a loud reason, except under CI (``CI`` set), which installs it
and so fails instead: a skipped metrics test would hide a missing install step.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import pytest
import yaml

from riskserve.platform.metrics import (
    ALL_METRICS,
    AUDIT_RECORDS,
    DECISION_LATENCY,
    DECISIONS,
    FEATURE_LATENCY,
    INVALID_REQUESTS,
    MODEL_BATCH_ROWS,
    MODEL_BREAKER_STATE,
    MODEL_ERRORS,
    MODEL_FALLBACKS,
    MODEL_IN_FLIGHT,
    MODEL_LATENCY,
    MODEL_REQUESTS,
    MODEL_VERSION_INFO,
    REPORT_INTERVAL_ENV,
    AuditMetrics,
    LearningMetrics,
    ModelMetrics,
    PipelineMetrics,
    ShadowMetrics,
    metrics_export_port,
)

from ..conftest import REPO
from .conftest import ServeCluster
from .prometheus import PrometheusServer, find_prometheus, prometheus_version

NOT_INSTALLED = (
    "PROMETHEUS IS NOT INSTALLED: the metrics export is not tested against a real Prometheus. "
    "Install it with `apt-get install -y --no-install-recommends prometheus` "
    "(or set RISKSERVE_PROMETHEUS=/path/to/prometheus)."
)

T = TypeVar("T")

pytestmark = [
    pytest.mark.slow,
    # Evaluated before any fixture, so no Ray starts for nothing; under CI the fixture below fails instead.
    pytest.mark.skipif(find_prometheus() is None and not os.environ.get("CI"), reason=NOT_INSTALLED),
]

APP = "metrics_probe"
CREDIT, FRAUD = "probe_credit", "probe_fraud"
KINDS = {CREDIT: "sklearn", FRAUD: "treelite"}
INVALID_FIELD = "numeric.amount"
PROMETHEUS_YML = REPO / "deploy" / "prometheus.yml"
DASHBOARD = REPO / "deploy" / "grafana" / "riskserve-dashboard.json"


def _plan() -> list[dict[str, Any]]:
    """Ten decision calls: rows 1..10; outcomes 7 APPROVE, 3 DECLINE; credit fails once (call 4) and moves
    from v1 to v2 at call 5; fraud times out on calls 2 and 8 (its breaker opens)."""
    return [
        {
            "rows": i + 1,
            "outcome": "APPROVE" if i < 7 else "DECLINE",
            CREDIT: "error" if i == 4 else "ok",
            FRAUD: "TIMEOUT" if i in (2, 8) else "ok",
            "versions": {CREDIT: "v1" if i < 5 else "v2", FRAUD: "f1"},
        }
        for i in range(10)
    ]


PLAN = _plan()
# Calls each model answered: credit 9, fraud 8.
OK_CALLS: dict[str, float] = {name: sum(step[name] == "ok" for step in PLAN) for name in KINDS}


class MetricsProbe:
    """A Serve deployment standing in for the ingress and the replicas: it records exactly what it is told."""

    def __init__(self) -> None:
        self.pipeline = PipelineMetrics(APP)
        self.shadow = ShadowMetrics(APP, "fraud", "candidate-version")
        self.models = {name: ModelMetrics(name, kind) for name, kind in KINDS.items()}
        for metrics in self.models.values():
            metrics.breaker_state("closed")  # set once, long before any scrape: must still be exported
        self.learning = LearningMetrics(APP)  # what the feedback service records
        self.learning.learning_state(FRAUD, paused=False, drift=0.0)
        self.learning.refused("relabel")
        self.audit = AuditMetrics(APP)  # what each ingress replica's audit writer records

    def decide(self, step: dict[str, Any]) -> None:
        started = time.perf_counter()
        self.pipeline.feature_latency(0.0004)
        for name, metrics in self.models.items():
            with metrics.in_flight():
                if step[name] == "ok":
                    metrics.observe_call(0.002, step["rows"], step["versions"][name])
                elif step[name] == "error":
                    metrics.error("ModelUnavailable", version=step["versions"][name])
                else:
                    metrics.fallback(step[name])
                    metrics.breaker_state("open")
        self.pipeline.decision(step["outcome"])
        self.audit.records("written", step["rows"])
        if step["outcome"] != "APPROVE":
            self.pipeline.reasons(1, 0.001)
            self.shadow.compared(1, 0.9, 0.01)  # a shadow of fraud compares the risky decisions
            self.shadow.flip("DECLINE", "REVIEW")
            self.shadow.latency(0.0005)
            self.shadow.dropped(1)
            self.shadow.quality({"serving_auc": 0.9, "candidate_auc": 0.91})
        self.pipeline.decision_latency(time.perf_counter() - started)

    def invalid(self, field: str) -> None:
        self.pipeline.invalid(field)

    def refused(self, method: str, status: str) -> None:
        self.pipeline.refused(method, status)

    def report_interval_s(self) -> float:
        import ray

        return max(float(ray._config.metrics_report_interval_ms()), 1000.0) / 1000.0


def _shipped_job(name: str) -> dict[str, Any]:
    config = yaml.safe_load(PROMETHEUS_YML.read_text())
    (job,) = [job for job in config["scrape_configs"] if job["job_name"] == name]
    return dict(job)


@pytest.fixture(scope="session")
def prometheus_binary() -> str:
    """The Prometheus binary, checked before any Ray starts: a missing one skips at once (fails in CI)."""
    binary = find_prometheus()
    if binary is None:
        if os.environ.get("CI"):
            pytest.fail(f"CI installs Prometheus, yet: {NOT_INSTALLED}")
        pytest.skip(NOT_INSTALLED)
    return binary


@pytest.fixture(scope="module")
def prometheus(prometheus_binary: str, serve_cluster: ServeCluster) -> Iterator[PrometheusServer]:
    binary = prometheus_binary
    port = getattr(serve_cluster, "metrics_port", None) or metrics_export_port()
    assert port, "the Ray node reports no metrics export port"
    # The shipped scrape job for a local Ray (its relabelling included), pointed at this Ray's port.
    job = _shipped_job("riskserve-local")
    with PrometheusServer(binary, [f"127.0.0.1:{port}"], scrape_interval_s=1.0, base_job=job) as server:
        print(f"{prometheus_version(binary)} on {server.url}, scraping 127.0.0.1:{port}")
        server.wait_for(f'up{{job="{server.job}"}}', lambda up: up == 1, timeout_s=30)
        yield server


@pytest.fixture(scope="module")
def recorded(prometheus: PrometheusServer, serve_cluster: ServeCluster) -> Iterator[dict[str, float]]:
    """Deploy the probe, run the plan, and wait until Prometheus has scraped every decision.

    Yields the report interval in seconds and when (monotonic) the last call ended.
    """
    from ray import serve

    deployment: Any = serve.deployment(MetricsProbe, name="MetricsProbe", ray_actor_options={"num_cpus": 0})
    handle = serve.run(deployment.bind(), name=APP, route_prefix=f"/{APP}")
    try:
        interval_s = float(handle.report_interval_s.remote().result())
        for step in PLAN:
            handle.decide.remote(step).result()
        handle.invalid.remote(INVALID_FIELD).result()
        handle.refused.remote("Feedback", "PERMISSION_DENIED").result()
        done_at = time.monotonic()
        prometheus.wait_for(
            f'sum({DECISIONS.exported}{{pipeline="{APP}"}})',
            lambda total: total == len(PLAN),
            timeout_s=3 * interval_s + 20,
        )
        yield {"interval_s": interval_s, "done_at": done_at}
    finally:
        serve.delete(APP)


SETTLE_S = 20.0


def _settle(fetch: Callable[[], T], done: Callable[[T], bool], timeout_s: float = SETTLE_S) -> T:
    """``fetch()`` again until ``done(answer)`` or ``timeout_s`` pass; the last answer, for the assertion.

    Under load a scrape can miss its 1 s timeout, and Prometheus then marks every series of the target stale
    until the next good scrape: one query may answer nothing for a moment. What was never exported (or a
    gauge Ray dropped) stays wrong, and fails.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        answer = fetch()
        if done(answer) or time.monotonic() >= deadline:
            return answer
        time.sleep(0.1)


def _equal(fetch: Callable[[], T], expected: T) -> T:
    return _settle(fetch, lambda answer: answer == expected)


def _by(prometheus: PrometheusServer, expr: str, label: str) -> dict[str, float]:
    return prometheus.values(f"sum by ({label}) ({expr})", by=label)


def _by2(prometheus: PrometheusServer, expr: str, first: str, second: str) -> dict[tuple[str, str], float]:
    series = prometheus.query(f"sum by ({first}, {second}) ({expr})")
    return {(s["metric"][first], s["metric"][second]): float(s["value"][1]) for s in series}


def _buckets(prometheus: PrometheusServer, selector: str) -> dict[tuple[str, float], float]:
    """``{(model, upper bound): count}`` of a histogram's ``_bucket`` series (``le`` parsed as a float)."""
    series = prometheus.query(f"sum by (model, le) ({selector})")
    return {(s["metric"]["model"], float(s["metric"]["le"])): float(s["value"][1]) for s in series}


MODELS = f'model=~"{CREDIT}|{FRAUD}"'


def test_every_metric_is_exported_under_its_documented_name(
    prometheus: PrometheusServer, recorded: dict[str, float]
) -> None:
    expected = set()
    for spec in ALL_METRICS:
        if spec.type == "histogram":
            expected |= {f"{spec.exported}_bucket", f"{spec.exported}_count", f"{spec.exported}_sum"}
        else:
            expected.add(spec.exported)
    names = _settle(
        lambda: {s["metric"]["__name__"] for s in prometheus.query('{__name__=~"ray_riskserve_.+"}')},
        lambda names: expected <= names,
    )
    assert expected <= names, f"missing {sorted(expected - names)}; exported {sorted(names)}"
    assert DECISIONS.exported == "ray_riskserve_decisions_total"


def test_audit_records_are_counted_by_outcome(
    prometheus: PrometheusServer, recorded: dict[str, float]
) -> None:
    rows = float(sum(step["rows"] for step in PLAN))
    expr = f'{AUDIT_RECORDS.exported}{{pipeline="{APP}"}}'
    assert _equal(lambda: _by(prometheus, expr, "outcome"), {"written": rows}) == {"written": rows}


def test_serve_adds_deployment_replica_and_application_tags(
    prometheus: PrometheusServer, recorded: dict[str, float]
) -> None:
    series = _settle(lambda: prometheus.query(f'{DECISIONS.exported}{{pipeline="{APP}"}}'), bool)
    assert series
    for labels in (s["metric"] for s in series):
        assert labels["application"] == APP
        assert labels["deployment"] == "MetricsProbe"
        assert labels["replica"]
        assert not [name for name in labels if name.startswith("otel_scope_")]  # the shipped job drops them


def test_decisions_by_outcome(prometheus: PrometheusServer, recorded: dict[str, float]) -> None:
    decisions = f'{DECISIONS.exported}{{pipeline="{APP}"}}'
    expected = {"APPROVE": 7.0, "DECLINE": 3.0}
    assert _equal(lambda: _by(prometheus, decisions, "outcome"), expected) == expected
    invalid = f'{INVALID_REQUESTS.exported}{{pipeline="{APP}"}}'
    assert _equal(lambda: _by(prometheus, invalid, "field"), {INVALID_FIELD: 1.0}) == {INVALID_FIELD: 1}


def test_model_requests_errors_and_fallbacks_per_model(
    prometheus: PrometheusServer, recorded: dict[str, float]
) -> None:
    requests = MODEL_REQUESTS.exported
    checks: list[tuple[Callable[[], Any], Any]] = [
        (lambda: _by(prometheus, f'{requests}{{{MODELS},outcome="ok"}}', "model"), {CREDIT: 9, FRAUD: 8}),
        (lambda: _by(prometheus, f'{requests}{{{MODELS},outcome="error"}}', "model"), {CREDIT: 1}),
        (
            lambda: _by(prometheus, f'{requests}{{model="{CREDIT}",outcome="ok"}}', "version"),
            {"v1": 4, "v2": 5},
        ),
        (lambda: _by(prometheus, f"{requests}{{{MODELS}}}", "kind"), {"sklearn": 10, "treelite": 8}),
        (lambda: _by(prometheus, f"{MODEL_ERRORS.exported}{{{MODELS}}}", "reason"), {"ModelUnavailable": 1}),
        (
            lambda: _by2(prometheus, f"{MODEL_FALLBACKS.exported}{{{MODELS}}}", "model", "reason"),
            {(FRAUD, "TIMEOUT"): 2},
        ),
    ]
    assert OK_CALLS == {CREDIT: 9, FRAUD: 8}
    for fetch, expected in checks:
        assert _equal(fetch, expected) == expected


def test_histogram_counts_equal_the_calls(prometheus: PrometheusServer, recorded: dict[str, float]) -> None:
    for spec in (MODEL_LATENCY, MODEL_BATCH_ROWS):
        count = f"{spec.exported}_count{{{MODELS}}}"
        by_model: dict[str, float] = _equal(functools.partial(_by, prometheus, count, "model"), OK_CALLS)
        assert by_model == OK_CALLS
    for spec in (DECISION_LATENCY, FEATURE_LATENCY):
        total = f'sum({spec.exported}_count{{pipeline="{APP}"}})'
        expected: float | None = len(PLAN)
        assert _equal(functools.partial(prometheus.scalar, total), expected) == expected
    # Bucket counts are exact (Ray rebuilds a histogram's _sum from bucket midpoints: only approximate).
    rows_expected = {
        (name, le): float(sum(step[name] == "ok" and step["rows"] <= le for step in PLAN))
        for name in KINDS
        for le in (1.0, 2.0, 4.0, 8.0, 16.0, float("inf"))
    }
    rows = _settle(
        lambda: _buckets(prometheus, f"{MODEL_BATCH_ROWS.exported}_bucket{{{MODELS}}}"),
        lambda got: all(got.get(key) == value for key, value in rows_expected.items()),
    )
    assert {key: rows.get(key) for key in rows_expected} == rows_expected
    # Every model call took 2 ms: all in the (0.001, 0.0025] bucket.
    latency_expected = {
        **{(name, 0.001): 0.0 for name in KINDS},
        **{(name, 0.0025): float(calls) for name, calls in OK_CALLS.items()},
    }
    latency = _settle(
        lambda: _buckets(prometheus, f"{MODEL_LATENCY.exported}_bucket{{{MODELS}}}"),
        lambda got: all(got.get(key) == value for key, value in latency_expected.items()),
    )
    assert {key: latency.get(key) for key in latency_expected} == latency_expected
    # ``le`` is the very string Ray's agent wrote for a Ray histogram ("1.0", "0.0025"), so a query or a
    # stored series that pins one still matches: riskserve exports histograms as gauges with these labels.
    one_row = {CREDIT: 1.0, FRAUD: 1.0}  # the first call, one row, both models answered
    pinned = f'sum by (model) ({MODEL_BATCH_ROWS.exported}_bucket{{{MODELS},le="1.0"}})'
    assert _equal(lambda: prometheus.values(pinned, by="model"), one_row) == one_row
    pinned = f'sum by (model) ({MODEL_LATENCY.exported}_bucket{{{MODELS},le="0.0025"}})'
    assert _equal(lambda: prometheus.values(pinned, by="model"), OK_CALLS) == OK_CALLS
    p99_query = f"histogram_quantile(0.99, sum by (le) ({MODEL_LATENCY.exported}_bucket{{{MODELS}}}))"
    p99 = _settle(lambda: prometheus.scalar(p99_query), lambda value: value is not None)
    assert p99 is not None
    assert 0.001 < p99 <= 0.0025


def test_gauges_outlive_the_report_interval(prometheus: PrometheusServer, recorded: dict[str, float]) -> None:
    """Ray's agent drops a gauge its worker stops re-sending after two report intervals: ours are re-sent,
    histograms included (they are exported as gauges).

    Without the re-sending every gauge here would be gone by then: the worker reports it within one of its
    intervals, and the agent keeps it for two of *its* intervals, which only RAY_metrics_report_interval_ms
    in the environment changes (``_system_config`` reaches the workers, not the agent's own TTL).
    """
    agent_interval_s = max(float(os.environ.get(REPORT_INTERVAL_ENV, "10000")), 1000.0) / 1000.0
    wait_until = recorded["done_at"] + recorded["interval_s"] + 2 * agent_interval_s + 2
    time.sleep(max(0.0, wait_until - time.monotonic()))
    checks: list[tuple[Callable[[], Any], Any]] = [
        (
            lambda: _by(prometheus, f"{MODEL_BREAKER_STATE.exported}{{{MODELS}}}", "model"),
            {CREDIT: 0, FRAUD: 2},
        ),
        (lambda: _by(prometheus, f"{MODEL_IN_FLIGHT.exported}{{{MODELS}}}", "model"), {CREDIT: 0, FRAUD: 0}),
        (
            lambda: _by2(prometheus, f"{MODEL_VERSION_INFO.exported}{{{MODELS}}}", "model", "version"),
            {(CREDIT, "v1"): 0, (CREDIT, "v2"): 1, (FRAUD, "f1"): 1},
        ),
        (lambda: _by(prometheus, f"{MODEL_LATENCY.exported}_count{{{MODELS}}}", "model"), OK_CALLS),
        (
            lambda: _by(prometheus, f'{MODEL_BATCH_ROWS.exported}_bucket{{{MODELS},le="+Inf"}}', "model"),
            OK_CALLS,
        ),
    ]
    for fetch, expected in checks:
        assert _equal(fetch, expected) == expected


def test_shipped_prometheus_config_is_valid(prometheus_binary: str) -> None:
    promtool = shutil.which("promtool", path=os.path.dirname(prometheus_binary)) or shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed beside prometheus")
    done = subprocess.run(
        [promtool, "check", "config", str(PROMETHEUS_YML)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr


def _dashboard_exprs() -> list[tuple[str, str]]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [
        (panel["title"], target["expr"])
        for panel in dashboard["panels"]
        for target in panel.get("targets", [])
    ]


def test_dashboard_names_only_exported_metrics() -> None:
    exported = {spec.exported for spec in ALL_METRICS}
    for title, expr in _dashboard_exprs():
        for name in re.findall(r"ray_riskserve_[a-z_]+", expr):
            base = re.sub(r"_(bucket|count|sum)$", "", name)
            assert name in exported or base in exported, f"panel {title!r} reads unknown {name}"
    dashboard = json.loads(DASHBOARD.read_text())
    assert {v["name"] for v in dashboard["templating"]["list"]} >= {"datasource", "pipeline", "model"}


def test_every_dashboard_query_answers_on_the_scraped_metrics(
    prometheus: PrometheusServer, recorded: dict[str, float]
) -> None:
    """Each panel's PromQL, with Grafana's variables filled in, returns series from the real scrape."""
    variables = {"$__rate_interval": "1m", "$pipeline": APP, "$model": ".*"}
    for title, expr in _dashboard_exprs():
        query = expr
        for variable, value in variables.items():
            query = query.replace(variable, value)
        assert "$" not in query, (title, query)
        assert _settle(functools.partial(prometheus.query, query), bool), f"panel {title!r}: {query} is empty"


# -- real decisions move the real metrics ----------------------------------------------------------------

REAL = "metrics_real"
REAL_DECISIONS = 12


@pytest.fixture(scope="module")
def real_decisions(
    prometheus: PrometheusServer, serve_cluster: ServeCluster, demo_models: Any
) -> dict[str, float]:
    """A real tabular pipeline decides ``REAL_DECISIONS`` transactions over gRPC and refuses two invalid
    ones; returns the outcomes its answers gave (what the metrics must count)."""
    from riskserve.client import RiskClient
    from riskserve.demo.dataset import generate_transactions
    from riskserve.platform.errors import InvalidInput
    from riskserve.proto.riskserve.v1 import risk_pipeline_pb2 as pb

    from .conftest import deploy, endpoint, pipeline_on

    spec = pipeline_on("tabular_only.yaml", demo_models, name=REAL)
    deploy(spec)
    tx = generate_transactions(REAL_DECISIONS, seed=11)
    outcomes: dict[str, float] = {}
    with RiskClient(endpoint(spec), pipeline=REAL, timeout_s=30) as client:
        for i in range(REAL_DECISIONS):
            row = tx.row(i)
            response = client.decide(
                numeric={k: float(v) for k, v in row.items() if isinstance(v, float)},
                categorical={k: str(row[k]) for k in ("merchant_category", "channel")},
            )
            outcome = pb.Decision.Name(response.decision)
            outcomes[outcome] = outcomes.get(outcome, 0.0) + 1
        for _ in range(2):
            with pytest.raises(InvalidInput, match="amount"):
                client.decide(numeric={"amount": -1.0}, categorical={"channel": "pos"})
    return outcomes


def test_real_decisions_move_the_real_metrics(
    prometheus: PrometheusServer, real_decisions: dict[str, float]
) -> None:
    """Not the probe: the ingress of a deployed pipeline records each decision by outcome, each model
    call, the decision latency and the invalid requests, and Prometheus scrapes exactly those counts."""
    app = f'application="{REAL}"'
    decisions = f'{DECISIONS.exported}{{pipeline="{REAL}"}}'
    assert _equal(lambda: _by(prometheus, decisions, "outcome"), real_decisions) == real_decisions
    requests = f'{MODEL_REQUESTS.exported}{{{app},outcome="ok"}}'
    per_model = {"credit": float(REAL_DECISIONS), "fraud": float(REAL_DECISIONS)}
    assert _equal(lambda: _by(prometheus, requests, "model"), per_model) == per_model
    latency = f'{DECISION_LATENCY.exported}_count{{pipeline="{REAL}"}}'
    expected_latency = {REAL: float(REAL_DECISIONS)}
    assert _equal(lambda: _by(prometheus, latency, "pipeline"), expected_latency) == expected_latency
    invalid = f'{INVALID_REQUESTS.exported}{{pipeline="{REAL}"}}'
    assert _equal(lambda: _by(prometheus, invalid, "field"), {"amount": 2.0}) == {"amount": 2.0}
