"""Tracing with the real OpenTelemetry SDK: one trace per decision, continued across processes.

The pipeline's replicas are separate processes that share nothing but the small W3C carrier the ingress
passes along with each handle call. These tests play the ingress, the feature stage, the model replicas
and the decision step in this process (asyncio tasks, as in a replica) and in a spawned process that
appends to the same JSON-lines file, then read the file back and check the tree.
"""

from __future__ import annotations

import asyncio
import json
import logging
import multiprocessing
import os
import warnings
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import yaml
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from pydantic import ValidationError

from riskserve.features.encoder import RawRequest
from riskserve.features.stage import FeatureStage
from riskserve.platform.errors import ConfigError
from riskserve.platform.runner import ModelRunner
from riskserve.platform.tracing import (
    SPAN_DECIDE,
    SPAN_DECISION,
    SPAN_FEATURES,
    SPAN_MODEL,
    SPAN_MODEL_PREDICT,
    SpanKind,
    TracingSettings,
    carrier_from_grpc,
    configure_tracing,
    current_trace_id,
    extract,
    flush_tracing,
    inject,
    mark_error,
    shutdown_tracing,
    start_span,
)
from riskserve.proto.riskserve.v1 import risk_pipeline_pb2 as pb
from riskserve.schema.pipeline import PipelineSpec, parse_pipeline
from riskserve.serving.flow import DecisionFlow
from riskserve.serving.frontdoor import APPLICATION_METADATA, Admission, _Service
from riskserve.serving.guarded_call import GuardedModel, LocalEndpoint
from riskserve.serving.model_replica import ModelReplica
from riskserve.wrappers import backend

CALLER_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"
SAMPLED = f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"
UNSAMPLED = f"00-{CALLER_TRACE}-{CALLER_SPAN}-00"


@pytest.fixture(autouse=True)
def _fresh_tracing() -> Iterator[None]:
    """Every test starts and ends unconfigured (the module keeps one provider per process)."""
    shutdown_tracing()
    yield
    shutdown_tracing()


class FakeGrpcContext:
    """The part of a gRPC servicer context the ingress reads."""

    def __init__(self, *metadata: tuple[str, str | bytes]) -> None:
        self._metadata = metadata

    def invocation_metadata(self) -> tuple[tuple[str, str | bytes], ...]:
        return self._metadata


def file_settings(path: Path, **overrides: Any) -> TracingSettings:
    return TracingSettings.model_validate({"exporter": "file", "file_path": path, **overrides})


def read_spans(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def by_name(spans: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [s for s in spans if s["name"] == name]


# -- the pipeline's real roles: the front door's servicer over the ingress's decision flow -----------------

PIPELINE = Path(__file__).parents[2] / "deploy" / "pipelines" / "tabular_only.yaml"


def _request(request_id: str, amount: float) -> pb.DecideRequest:
    return pb.DecideRequest(
        request_id=request_id,
        numeric={"amount": amount, "account_age_days": 900.0, "txn_velocity_1h": 0.0, "hour": 14.0},
        categorical={"merchant_category": "grocery", "channel": "pos"},
    )


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo's tabular models (credit: compiled XGBoost, fraud: logistic regression), in the ingress."""
    from riskserve.demo.build import build_demo_models

    out = tmp_path_factory.mktemp("models")
    build_demo_models(out, seed=0, only=["credit", "fraud"], progress=False)
    return out


class ServicerContext(FakeGrpcContext):
    """The part of a gRPC servicer context the front door reads and sets (no server runs here)."""

    def __init__(self, *metadata: tuple[str, str | bytes]) -> None:
        super().__init__(*metadata)
        self.code: grpc.StatusCode | None = None
        self.details = ""

    def time_remaining(self) -> float | None:
        return 30.0

    def set_code(self, code: grpc.StatusCode) -> None:
        self.code = code

    def set_details(self, details: str) -> None:
        self.details = details


class Ingress:
    """What the ingress hands its front door: the pipeline's name, budget and decision flow."""

    def __init__(self, spec: PipelineSpec, flow: DecisionFlow) -> None:
        self.name = spec.name
        self.decision_timeout_ms = spec.serving.decision_timeout_ms
        self.metrics = flow.metrics
        self.decide = flow.decide


def pipeline_spec(models: Path, settings: TracingSettings) -> PipelineSpec:
    data = yaml.safe_load(PIPELINE.read_text())
    for name, model in data["models"].items():
        model["artifact"] = str(models / name)
    data["tracing"] = settings.model_dump(mode="json")
    return parse_pipeline(data, base_dir=PIPELINE.parent)


async def front_door(spec: PipelineSpec) -> _Service:
    """The front door's servicer over the ingress's pieces, built as ``PipelineIngress`` builds them for
    models placed in it (the feature stage configures tracing from the spec, as every replica does)."""
    columns = spec.features.column_names()
    guarded = {}
    for name, model in spec.models.items():
        runner = ModelRunner(
            name, model.kind, spec.runner_settings(name), columns, spec.model_columns(name),
            backends=backend, placement="ingress",
        )  # fmt: skip
        await runner.serve(str(spec.artifact_path(name)))
        guarded[name] = GuardedModel.build(name, model, LocalEndpoint(runner, spec.serving.inline_rows))
    data = spec.resolved()
    stage = FeatureStage(data["features"], data["tracing"], spec.serving.matrix_retain_s)
    flow = DecisionFlow(spec, models=guarded, local_stage=stage)
    serving = spec.serving
    admission = Admission(serving.ingress.max_ongoing_requests, serving.ingress.max_queued_requests)
    return _Service(Ingress(spec, flow), admission, serving.grpc)  # type: ignore[arg-type]


def ingress_decide(
    models: Path, settings: TracingSettings, *metadata: tuple[str, str], count: int = 1
) -> list[pb.DecideResponse]:
    """``count`` decisions through the real front door servicer and decision flow."""
    spec = pipeline_spec(models, settings)

    async def decide() -> list[pb.DecideResponse]:
        service = await front_door(spec)
        context = ServicerContext((APPLICATION_METADATA, spec.name), *metadata)
        requests = [_request(f"r{i}", 42.5 + 10 * i) for i in range(count)]
        response = await service.DecideBatch(pb.DecideBatchRequest(requests=requests), context)
        assert context.code is None, context.details
        return list(response.responses)

    return asyncio.run(decide())


# -- the trace tree -------------------------------------------------------------------------------------


def test_one_trace_per_decision_continues_the_callers_traceparent(models: Path, tmp_path: Path) -> None:
    path = tmp_path / "spans.jsonl"
    answers = ingress_decide(models, file_settings(path), ("traceparent", SAMPLED), count=2)
    assert [a.trace_id for a in answers] == [CALLER_TRACE, CALLER_TRACE]  # the responses' trace_id

    spans = read_spans(path)
    assert {s["trace_id"] for s in spans} == {CALLER_TRACE}
    assert sorted(s["name"] for s in spans) == sorted(
        [SPAN_DECIDE, SPAN_FEATURES, *[SPAN_MODEL] * 2, *[SPAN_MODEL_PREDICT] * 2, *[SPAN_DECISION] * 2]
    )
    assert len({s["span_id"] for s in spans}) == len(spans)

    (root,) = by_name(spans, SPAN_DECIDE)
    assert root["parent_span_id"] == CALLER_SPAN
    assert root["parent_is_remote"] is True
    assert root["kind"] == "SERVER"
    assert root["attributes"] == {"pipeline": "tabular_only", "request.count": 2, "rpc.method": "DecideBatch"}

    (features,) = by_name(spans, SPAN_FEATURES)
    assert features["parent_span_id"] == root["span_id"]
    assert features["attributes"]["rows"] == 2

    calls = {s["attributes"]["model.name"]: s for s in by_name(spans, SPAN_MODEL)}
    assert set(calls) == {"credit", "fraud"}
    served = {m.model: m for m in answers[0].models}
    for name, call in calls.items():
        assert call["parent_span_id"] == root["span_id"]
        assert call["kind"] == "CLIENT"
        assert call["attributes"]["model.kind"] == {"credit": "treelite", "fraud": "sklearn"}[name]
        assert call["attributes"]["model.version"] == served[name].version  # what the answer says served
        assert call["attributes"]["model.fallback"] is False
        assert call["status"]["code"] == "UNSET"
    predicts = {s["attributes"]["model.name"]: s for s in by_name(spans, SPAN_MODEL_PREDICT)}
    assert {n: p["parent_span_id"] for n, p in predicts.items()} == {
        n: c["span_id"] for n, c in calls.items()
    }

    decisions = by_name(spans, SPAN_DECISION)
    assert {d["parent_span_id"] for d in decisions} == {root["span_id"]}
    outcomes = [pb.Decision.Name(a.decision) for a in answers]
    assert [d["attributes"]["request.id"] for d in decisions] == ["r0", "r1"]
    assert [d["attributes"]["outcome"] for d in decisions] == outcomes
    assert [d["attributes"]["risk_score"] for d in decisions] == pytest.approx(
        [a.risk_score for a in answers]
    )
    for span in spans:
        assert span["start_time_ns"] <= span["end_time_ns"]
        assert span["resource"]["service.name"] == "riskserve"
        assert span["resource"]["process.pid"] == os.getpid()


def test_without_traceparent_the_decision_is_a_new_root(models: Path, tmp_path: Path) -> None:
    path = tmp_path / "spans.jsonl"
    (answer,) = ingress_decide(models, file_settings(path))
    trace_id = answer.trace_id

    spans = read_spans(path)
    (root,) = by_name(spans, SPAN_DECIDE)
    assert root["parent_span_id"] is None
    assert len(trace_id) == 32
    assert int(trace_id, 16) != 0
    assert trace_id != CALLER_TRACE
    assert {s["trace_id"] for s in spans} == {trace_id}


def _callee_process(path: str, carrier: dict[str, str], ready: Any, go: Any, spans: int) -> None:
    """A feature-stage 'replica' in its own process: same settings, same file, trace from the carrier."""
    configure_tracing(file_settings(Path(path), service_name="callee"))
    ready.set()
    go.wait(30)
    with start_span(SPAN_FEATURES, context=extract(carrier), kind=SpanKind.SERVER, attributes={"rows": 1}):
        for i in range(spans):
            with start_span("callee.filler", attributes={"i": i, "pad": "x" * 300}):
                pass
    shutdown_tracing()


def test_trace_and_file_are_shared_with_a_spawned_process(tmp_path: Path) -> None:
    path = tmp_path / "spans.jsonl"
    configure_tracing(file_settings(path))
    spawn = multiprocessing.get_context("spawn")
    ready, go = spawn.Event(), spawn.Event()
    filler = 300
    with start_span(SPAN_DECIDE, context=extract({"traceparent": SAMPLED})) as root:
        callee = spawn.Process(target=_callee_process, args=(str(path), inject(), ready, go, filler))
        callee.start()
        try:
            assert ready.wait(60), "the spawned callee did not start"
            go.set()  # both processes now append to the file at the same time
            for i in range(filler):
                with start_span("caller.filler", attributes={"i": i, "pad": "y" * 300}):
                    pass
        finally:
            callee.join(60)
        assert callee.exitcode == 0
        root_span_id = f"{root.get_span_context().span_id:016x}"

    spans = read_spans(path)  # every line parses: no two appends interleaved
    assert len(spans) == 2 * filler + 2
    assert {s["trace_id"] for s in spans} == {CALLER_TRACE}
    (features,) = by_name(spans, SPAN_FEATURES)
    assert features["parent_span_id"] == root_span_id
    assert features["resource"]["service.name"] == "callee"
    assert features["resource"]["process.pid"] not in (os.getpid(), None)
    callee_fillers = by_name(spans, "callee.filler")
    assert len(callee_fillers) == filler
    assert {s["parent_span_id"] for s in callee_fillers} == {features["span_id"]}
    assert len(by_name(spans, "caller.filler")) == filler


# -- sampling, exporters, configuration ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("ratio", "traceparent"),
    [(0.0, None), (0.0, UNSAMPLED), (1.0, UNSAMPLED)],
    ids=["ratio-0-new-root", "ratio-0-unsampled-parent", "ratio-1-unsampled-parent"],
)
def test_unsampled_traces_export_nothing_but_keep_their_ids(
    models: Path, tmp_path: Path, ratio: float, traceparent: str | None
) -> None:
    path = tmp_path / "spans.jsonl"
    metadata = [("traceparent", traceparent)] if traceparent else []
    (answer,) = ingress_decide(models, file_settings(path, sample_ratio=ratio), *metadata)
    trace_id = answer.trace_id

    assert read_spans(path) == []
    assert len(trace_id) == 32
    assert int(trace_id, 16) != 0
    if traceparent:
        assert trace_id == CALLER_TRACE


def test_a_sampled_incoming_parent_is_honoured_at_ratio_0(models: Path, tmp_path: Path) -> None:
    """Parent-based sampling: the ratio decides for new roots; a sampled caller's trace is recorded."""
    path = tmp_path / "spans.jsonl"
    ingress_decide(models, file_settings(path, sample_ratio=0.0), ("traceparent", SAMPLED))
    assert {s["trace_id"] for s in read_spans(path)} == {CALLER_TRACE}


def test_the_callee_follows_the_ingress_sampling_decision(tmp_path: Path) -> None:
    """A replica with ratio 1 records nothing of a trace the ingress did not sample (and the other way)."""
    path = tmp_path / "spans.jsonl"
    configure_tracing(file_settings(path, sample_ratio=0.0))
    with start_span(SPAN_DECIDE):
        carrier = inject()
    assert int(carrier["traceparent"].split("-")[3], 16) & 1 == 0
    spec = yaml.safe_load(PIPELINE.read_text())["features"]  # the 'callee' replica samples everything
    stage = FeatureStage(spec, file_settings(path, sample_ratio=1.0).model_dump(mode="json"))
    request = _request("r0", 5.0)
    raw = RawRequest(numeric=dict(request.numeric), categorical=dict(request.categorical), text="")
    stage.encode([raw], carrier, share=False)
    assert read_spans(path) == []


def test_a_model_replica_records_its_span_only_under_the_callers_sampled_trace(
    models: Path, tmp_path: Path
) -> None:
    """The ingress sends its trace context to a model in its own deployment only for a sampled decision.
    With it, the replica's span is a child of the caller's; without it, the replica records nothing, even
    sampling every root: a span there would start a trace holding the model alone."""
    path = tmp_path / "spans.jsonl"
    spec = pipeline_spec(models, file_settings(path, sample_ratio=1.0))
    settings = {**spec.runner_settings("fraud"), "artifact": str(spec.artifact_path("fraud"))}
    columns = spec.features.column_names()
    matrix = np.zeros((2, len(columns)), dtype=np.float32)

    class Replica(ModelReplica):
        def __del__(self) -> None:  # Serve awaits the async one at shutdown; the test awaits it below
            pass

    async def calls() -> None:
        replica = Replica.__new__(Replica)
        tracing = file_settings(path, sample_ratio=1.0).model_dump(mode="json")
        await ModelReplica.__init__(replica, "fraud", "sklearn", settings, columns, tracing=tracing)
        unsampled = await replica.predict_features(matrix, {})
        sampled = await replica.predict_features(matrix, {"traceparent": SAMPLED})
        assert len(unsampled.scores) == len(sampled.scores) == 2  # both answered
        await ModelReplica.__del__(replica)

    asyncio.run(calls())
    flush_tracing()
    predicts = by_name(read_spans(path), SPAN_MODEL_PREDICT)
    assert len(predicts) == 1
    assert predicts[0]["trace_id"] == CALLER_TRACE
    assert predicts[0]["parent_span_id"] == CALLER_SPAN
    assert predicts[0]["attributes"]["model.name"] == "fraud"


def test_exporter_none_exports_nothing_and_keeps_the_callers_trace_id(
    models: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (answer,) = ingress_decide(models, TracingSettings(exporter="none"), ("traceparent", SAMPLED))
    assert answer.trace_id == CALLER_TRACE
    with start_span(SPAN_DECIDE, context=extract({"traceparent": SAMPLED})) as span:
        assert not span.is_recording()
        assert inject()["traceparent"].split("-")[1] == CALLER_TRACE
    assert capsys.readouterr().out == ""
    assert list(tmp_path.iterdir()) == []


def test_an_unconfigured_process_still_has_trace_ids() -> None:
    with start_span(SPAN_DECIDE, context=extract({"traceparent": SAMPLED})):
        assert current_trace_id() == CALLER_TRACE
    with start_span(SPAN_DECIDE):
        assert len(current_trace_id()) == 32
    assert current_trace_id() == ""  # outside of any span


def test_configure_twice_is_harmless_and_reconfiguring_switches_files(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    first, second = tmp_path / "first.jsonl", tmp_path / "second.jsonl"
    caplog.set_level(logging.WARNING)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        configure_tracing(file_settings(first))
        configure_tracing(file_settings(first))  # every replica constructor does this: a no-op
        with start_span("once"):
            pass
        configure_tracing(file_settings(second))  # different settings: the first file is closed
        with start_span("twice"):
            pass
        shutdown_tracing()
        shutdown_tracing()  # replica __del__ and atexit may both run
    assert [s["name"] for s in read_spans(first)] == ["once"]  # exported once, not once per configure
    assert [s["name"] for s in read_spans(second)] == ["twice"]
    assert [r for r in caplog.records if r.name.startswith("opentelemetry")] == []


def test_after_shutdown_nothing_is_exported(tmp_path: Path) -> None:
    path = tmp_path / "spans.jsonl"
    configure_tracing(file_settings(path))
    shutdown_tracing()
    with start_span(SPAN_DECIDE, context=extract({"traceparent": SAMPLED})):
        assert current_trace_id() == CALLER_TRACE
    assert read_spans(path) == []


def test_console_exporter_prints_one_json_line_per_span(capsys: pytest.CaptureFixture[str]) -> None:
    configure_tracing(TracingSettings(exporter="console", service_name="ingress"))
    with start_span(SPAN_DECIDE, attributes={"pipeline": "demo"}), start_span(SPAN_DECISION):
        pass
    lines = capsys.readouterr().out.splitlines()
    spans = [json.loads(line) for line in lines]
    assert [s["name"] for s in spans] == [SPAN_DECISION, SPAN_DECIDE]
    assert spans[0]["parent_span_id"] == spans[1]["span_id"]
    assert spans[1]["resource"]["service.name"] == "ingress"


class _Collector(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.requests: list[trace_service_pb2.ExportTraceServiceRequest] = []

    def Export(  # noqa: N802
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: Any
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        self.requests.append(request)
        return trace_service_pb2.ExportTraceServiceResponse()


def test_otlp_exporter_sends_the_trace_to_a_grpc_collector() -> None:
    collector = _Collector()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collector, server)  # type: ignore[no-untyped-call]
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        configure_tracing(TracingSettings(exporter="otlp", otlp_endpoint=f"http://127.0.0.1:{port}"))
        with start_span(SPAN_DECIDE, context=extract({"traceparent": SAMPLED})), start_span(SPAN_DECISION):
            pass
        assert flush_tracing(10_000)
        shutdown_tracing()
    finally:
        server.stop(None)
    exported = [
        (span.name, span.trace_id.hex())
        for request in collector.requests
        for resource in request.resource_spans
        for scope in resource.scope_spans
        for span in scope.spans
    ]
    assert sorted(exported) == [(SPAN_DECIDE, CALLER_TRACE), (SPAN_DECISION, CALLER_TRACE)]


def test_settings_are_strict() -> None:
    with pytest.raises(ValidationError, match="file_path is required"):
        TracingSettings(exporter="file")
    with pytest.raises(ValidationError, match="Extra inputs"):
        TracingSettings.model_validate({"exporter": "none", "sampling": 0.5})
    with pytest.raises(ValidationError, match="less than or equal to 1"):
        TracingSettings(sample_ratio=1.5)
    with pytest.raises(ValidationError, match="exporter"):
        TracingSettings.model_validate({"exporter": "jaeger"})
    settings = TracingSettings()
    with pytest.raises(ValidationError, match="frozen"):
        settings.sample_ratio = 0.5  # type: ignore[misc]
    assert settings == TracingSettings()  # equal settings: configure_tracing is a no-op


def test_an_unwritable_file_path_is_a_config_error(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    with pytest.raises(ConfigError, match=r"tracing\.file_path"):
        configure_tracing(file_settings(blocker / "spans.jsonl"))
    with start_span(SPAN_DECIDE):  # the process keeps working, unconfigured
        assert current_trace_id()


# -- propagation helpers and span status ---------------------------------------------------------------


def test_carrier_from_grpc_metadata() -> None:
    context = FakeGrpcContext(
        ("application", "demo"),
        ("TraceParent", SAMPLED.encode()),
        ("tracestate", "a=1"),
        ("tracestate", "b=2"),
    )
    assert carrier_from_grpc(context) == {"traceparent": SAMPLED, "tracestate": "a=1,b=2"}
    assert carrier_from_grpc(None) == {}

    class Broken:
        def invocation_metadata(self) -> None:
            raise RuntimeError("no metadata here")

    assert carrier_from_grpc(Broken()) == {}


def test_tracestate_is_propagated_and_malformed_parents_start_new_traces() -> None:
    with start_span("x", context=extract({"traceparent": SAMPLED, "tracestate": "vendor=abc"})):
        carrier = inject()
    assert carrier["tracestate"] == "vendor=abc"
    assert carrier["traceparent"].split("-")[1] == CALLER_TRACE
    for bad in ("garbage", f"00-{'0' * 32}-{CALLER_SPAN}-01", f"00-{CALLER_TRACE}-{'0' * 16}-01"):
        with start_span("x", context=extract({"traceparent": bad})):
            assert current_trace_id() not in ("", CALLER_TRACE)
    assert inject() == {}  # no current span: nothing to propagate


def test_errors_mark_the_span(tmp_path: Path) -> None:
    path = tmp_path / "spans.jsonl"
    configure_tracing(file_settings(path))
    with pytest.raises(ValueError, match="boom"), start_span("raises"):
        raise ValueError("boom")
    with start_span("handled", attributes={"dropped": None, "kept": 1}):
        mark_error(KeyError("amount"))
    raised, handled = read_spans(path)
    assert raised["status"] == {"code": "ERROR", "description": "ValueError: boom"}
    assert [e["name"] for e in raised["events"]] == ["exception"]
    assert handled["status"]["code"] == "ERROR"
    assert handled["status"]["description"].startswith("KeyError")
    assert handled["events"][0]["attributes"]["exception.type"] == "KeyError"
    assert handled["attributes"] == {"kept": 1}


def test_without_an_exporter_the_front_door_gets_the_ids_opentelemetry_would_give() -> None:
    """With nothing recorded, the front door skips OpenTelemetry (``recording()`` is false) and takes the
    trace id from a valid ``traceparent`` or makes a new one, as a non-recording span would."""
    from riskserve.platform.tracing import new_trace_id, recording, trace_id_of

    configure_tracing(TracingSettings(exporter="none"))
    assert not recording()
    parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    assert trace_id_of({"traceparent": parent}) == "0af7651916cd43dd8448eb211c80319c"
    assert trace_id_of({"traceparent": "00-" + "0" * 32 + "-b7ad6b7169203331-01"}) == ""  # invalid: all zero
    assert trace_id_of({"traceparent": "garbage"}) == ""
    assert trace_id_of({}) == ""
    with start_span("root") as span:  # what OpenTelemetry gives a new root here: same shape
        assert len(current_trace_id()) == 32
        assert span.get_span_context().is_valid
    ids = {new_trace_id() for _ in range(1000)}
    assert len(ids) == 1000
    assert all(len(i) == 32 and int(i, 16) != 0 for i in ids)
