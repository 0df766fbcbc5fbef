"""The front door's TLS, mutual TLS, bearer tokens, roles and size caps, as a client sees them.

The real :class:`FrontDoor` (grpc.aio, on a free loopback port, real certificates made at test time) serves
a small echo pipeline in place of an ingress: the security sits in the front door, and this keeps each
test under a second. One test in tests/e2e checks the same against a real ``riskserve up``.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from riskserve.client import RiskClient
from riskserve.platform.errors import (
    ConfigError,
    InvalidInput,
    ModelUnavailable,
    Overloaded,
    PermissionDenied,
    Unauthenticated,
)
from riskserve.platform.metrics import PipelineMetrics
from riskserve.proto.riskserve.v1 import risk_pipeline_pb2 as pb
from riskserve.proto.riskserve.v1 import risk_pipeline_pb2_grpc as pb_grpc
from riskserve.schema.pipeline import FrontDoorSpec, parse_pipeline
from riskserve.serving.auth import label_source
from riskserve.serving.frontdoor import Admission, FrontDoor, check_front_door
from riskserve.serving.messages import response_maker
from riskserve.serving.tokens import Caller, TokenStore

from ..conftest import PIPELINES
from ..manual_clock import ManualClock
from ..tls_helpers import Pki, make_pki, new_token, write_tokens

T = TypeVar("T")
NAME = "secure"


@dataclass
class EchoPipeline:
    """Stands in for the ingress: echoes request ids, records labels with their source as the ingress
    computes it, and can hold decisions until released (to count calls in flight)."""

    name: str = NAME
    decision_timeout_ms: float = 10_000
    metrics: PipelineMetrics = field(default_factory=lambda: PipelineMetrics(NAME))
    labels: list[tuple[str, str]] = field(default_factory=list)
    hold: asyncio.Event | None = None
    in_flight: int = 0
    most_in_flight: int = 0

    async def decide(
        self,
        requests: Sequence[pb.DecideRequest],
        trace_id: str,
        deadline: float,
        traced: bool,
        into: pb.DecideBatchResponse | None = None,
    ) -> list[pb.DecideResponse]:
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            if self.hold is not None:
                await self.hold.wait()
            make = response_maker(into)
            return [make(request_id=r.request_id, pipeline=self.name) for r in requests]
        finally:
            self.in_flight -= 1

    async def describe(self) -> pb.DescribeResponse:
        return pb.DescribeResponse(pipeline=self.name)

    async def feedback(
        self, request: pb.FeedbackRequest, caller: Caller | None, deadline: float
    ) -> pb.FeedbackResponse:
        self.labels.append((request.feedback_id, label_source(request.source, caller)))
        return pb.FeedbackResponse(accepted=True, seq=len(self.labels))


class Served:
    """A front door on its own event loop thread, as the ingress runs it."""

    def __init__(self, settings: FrontDoorSpec) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.pipeline = EchoPipeline()
        self.door = FrontDoor(self.pipeline, settings, Admission(16, 16))
        self.port = self.run(self.door.start)
        self.run(lambda: self.door.set_serving(True))
        self.target = f"127.0.0.1:{self.port}"

    def run(self, call: Callable[[], Coroutine[Any, Any, T]]) -> T:
        return asyncio.run_coroutine_threadsafe(call(), self.loop).result(timeout=30)

    def close(self) -> None:
        self.run(lambda: self.door.stop(0))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        self.loop.close()


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@dataclass(frozen=True)
class Tokens:
    path: Path
    decide: str
    feedback: str
    both: str


@pytest.fixture
def tokens(tmp_path: Path) -> Tokens:
    made = Tokens(tmp_path / "tokens.yaml", new_token(), new_token(), new_token())
    write_tokens(made.path, {
        "checkout": (made.decide, ["decide"]),
        "chargebacks": (made.feedback, ["feedback"]),
        "analyst": (made.both, ["decide", "feedback"]),
    })  # fmt: skip
    return made


def _settings(pki: Pki, tokens: Tokens | None, *, mutual: bool = False, **extra: Any) -> FrontDoorSpec:
    data: dict[str, Any] = {"port": 1, **extra}
    data["tls"] = {"cert_file": pki.server_cert, "key_file": pki.server_key}
    if mutual:
        data["tls"]["client_ca_file"] = pki.ca
    if tokens is not None:
        data["auth"] = {"tokens_file": tokens.path, "reload_s": 0.05}
    spec = FrontDoorSpec.model_validate(data)
    return spec.model_copy(update={"port": 0})  # any free port (the schema wants one a person could type)


@pytest.fixture
def served(pki: Pki, tokens: Tokens) -> Iterator[Served]:
    server = Served(_settings(pki, tokens))
    yield server
    server.close()


def _client(served: Served, pki: Pki, token: str | None, **extra: Any) -> RiskClient:
    return RiskClient(served.target, pipeline=NAME, ca_file=pki.ca, token=token, timeout_s=10, **extra)


def _code(call: Callable[[], object]) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as caught:
        call()
    return caught.value.code()  # type: ignore[no-any-return]


def test_a_plain_text_client_cannot_talk_to_the_tls_port(served: Served) -> None:
    with grpc.insecure_channel(served.target) as channel:
        stub = pb_grpc.RiskPipelineStub(channel)  # type: ignore[no-untyped-call]
        code = _code(lambda: stub.Decide(pb.DecideRequest(), metadata=(("application", NAME),), timeout=5))
    assert code == grpc.StatusCode.UNAVAILABLE  # no handshake, no call


def test_no_token_or_a_wrong_one_is_unauthenticated(served: Served, pki: Pki, tokens: Tokens) -> None:
    for token in (None, new_token(), tokens.decide[:-1]):
        with _client(served, pki, token) as client, pytest.raises(Unauthenticated):
            client.decide(request_id="r1")
    with grpc.secure_channel(served.target, grpc.ssl_channel_credentials(pki.ca.read_bytes())) as channel:
        stub = pb_grpc.RiskPipelineStub(channel)  # type: ignore[no-untyped-call]
        for header in ("Basic " + tokens.decide, tokens.decide, "Bearer "):
            metadata = (("application", NAME), ("authorization", header))
            assert _code(lambda m=metadata: stub.Decide(pb.DecideRequest(), metadata=m, timeout=5)) == (
                grpc.StatusCode.UNAUTHENTICATED
            )
    assert served.pipeline.in_flight == 0
    assert served.pipeline.most_in_flight == 0


def test_a_decide_token_decides_over_tls(served: Served, pki: Pki, tokens: Tokens) -> None:
    with _client(served, pki, tokens.decide) as client:
        assert client.decide(request_id="r1").request_id == "r1"
        assert (
            client.decide_batch([pb.DecideRequest(request_id=f"b{i}") for i in range(3)])[2].request_id
            == "b2"
        )
        assert client.describe().pipeline == NAME


def test_roles_decide_who_may_label_and_who_may_decide(served: Served, pki: Pki, tokens: Tokens) -> None:
    with _client(served, pki, tokens.decide) as client, pytest.raises(PermissionDenied) as denied:
        client.feedback(request_id="r1", label=1, feedback_id="f1")
    assert "checkout" in str(denied.value)
    assert "feedback" in str(denied.value)
    with _client(served, pki, tokens.feedback) as client, pytest.raises(PermissionDenied):
        client.decide(request_id="r1")
    assert served.pipeline.labels == []
    with _client(served, pki, tokens.feedback) as client:
        assert client.feedback(request_id="r1", label=1, feedback_id="f1").accepted


def test_a_labels_source_is_the_callers_identity(served: Served, pki: Pki, tokens: Tokens) -> None:
    with _client(served, pki, tokens.feedback) as client:
        client.feedback(request_id="r1", label=1, feedback_id="f1")
        client.feedback(request_id="r1", label=1, feedback_id="f2", source="chargebacks")
        with pytest.raises(PermissionDenied) as denied:
            client.feedback(request_id="r1", label=0, feedback_id="f3", source="someone-else")
    assert "source" in str(denied.value)
    assert served.pipeline.labels == [("f1", "chargebacks"), ("f2", "chargebacks")]


def test_health_and_reflection_answer_without_a_token(served: Served, pki: Pki) -> None:
    with grpc.secure_channel(served.target, grpc.ssl_channel_credentials(pki.ca.read_bytes())) as channel:
        health = health_pb2_grpc.HealthStub(channel)  # type: ignore[no-untyped-call]
        answer = health.Check(health_pb2.HealthCheckRequest(service=NAME), timeout=5)
        assert answer.status == health_pb2.HealthCheckResponse.SERVING
        reflection = reflection_pb2_grpc.ServerReflectionStub(channel)  # type: ignore[no-untyped-call]
        answers = reflection.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5
        )
        names = {s.name for answer in answers for s in answer.list_services_response.service}
    assert "riskserve.v1.RiskPipeline" in names


def test_a_tokens_file_change_takes_effect_without_a_restart(
    served: Served, pki: Pki, tokens: Tokens
) -> None:
    with _client(served, pki, tokens.decide) as client:
        client.decide(request_id="before")
    replacement = new_token()
    write_tokens(tokens.path, {"checkout": (replacement, ["decide"])})  # revokes the old, adds a new one
    with _client(served, pki, replacement) as client:
        _until(lambda: _decides(client))
    with _client(served, pki, tokens.decide) as client, pytest.raises(Unauthenticated):
        client.decide(request_id="revoked")


def _decides(client: RiskClient) -> bool:
    try:
        client.decide(request_id="after")
    except Unauthenticated:
        return False
    return True


def _until(condition: Callable[[], bool], timeout_s: float = 20.0) -> None:
    import time

    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "the condition never held"
        time.sleep(0.05)


def test_mutual_tls_refuses_a_client_without_a_certificate_of_its_ca(pki: Pki, tokens: Tokens) -> None:
    served = Served(_settings(pki, tokens, mutual=True))
    try:
        for cert, key in ((None, None), (pki.rogue_cert, pki.rogue_key)):
            client = _client(served, pki, tokens.decide, cert_file=cert, key_file=key)
            with client, pytest.raises(ModelUnavailable):  # UNAVAILABLE: the handshake fails, no call made
                client.decide(request_id="r1")
        with _client(
            served, pki, tokens.decide, cert_file=pki.client_cert, key_file=pki.client_key
        ) as client:
            assert client.decide(request_id="r1").request_id == "r1"
    finally:
        served.close()


# -- the tokens table -------------------------------------------------------------------------------------


def test_tokens_are_rechecked_at_most_once_per_period_and_a_bad_change_keeps_the_last_good(
    tokens: Tokens,
) -> None:
    clock = ManualClock(1000.0)
    store = TokenStore(path=tokens.path, reload_s=1.0, clock=clock)
    assert store.lookup(tokens.decide) == Caller("checkout", frozenset({"decide"}))
    fresh = new_token()
    write_tokens(tokens.path, {"checkout": (fresh, ["decide"])})
    clock.now += 0.5
    assert not store.refresh()  # within the period: not even a stat
    assert store.lookup(fresh) is None
    clock.now += 0.6
    assert store.refresh()
    assert store.lookup(fresh) is not None
    assert store.lookup(tokens.decide) is None
    tokens.path.write_text("tokens: [{identity: x, roles: [decide], token: short}]")  # invalid: kept out
    clock.now += 1.1
    assert not store.refresh()
    assert store.errors == 1
    assert store.lookup(fresh) is not None  # the last good table still serves


def test_tokens_from_an_environment_variable(tokens: Tokens, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RISKSERVE_TEST_TOKENS", tokens.path.read_text())
    store = TokenStore(env="RISKSERVE_TEST_TOKENS")
    assert store.lookup(tokens.feedback) == Caller("chargebacks", frozenset({"feedback"}))
    assert not store.refresh()  # read once
    monkeypatch.delenv("RISKSERVE_TEST_TOKENS")
    with pytest.raises(ConfigError, match="RISKSERVE_TEST_TOKENS"):
        TokenStore(env="RISKSERVE_TEST_TOKENS")


def test_a_tokens_file_others_may_read_is_refused(tokens: Tokens) -> None:
    tokens.path.chmod(0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        TokenStore(path=tokens.path)


def test_a_bad_tokens_table_names_the_problem_never_the_secret(tmp_path: Path) -> None:
    secret = "s3cret-but-too-short"[:12]
    path = tmp_path / "tokens.yaml"
    path.write_text(f"tokens: [{{identity: a, roles: [decide, admin], token: {secret}}}]")
    path.chmod(0o600)
    with pytest.raises(ConfigError) as caught:
        TokenStore(path=path)
    assert "tokens.0.roles.1" in str(caught.value)
    assert "tokens.0.token" in str(caught.value)
    assert secret not in str(caught.value)


def test_tokens_without_tls_off_loopback_are_a_config_error(tokens: Tokens) -> None:
    with pytest.raises(ValueError, match="plain text"):
        FrontDoorSpec.model_validate({"host": "0.0.0.0", "auth": {"tokens_file": tokens.path}})
    FrontDoorSpec.model_validate({"host": "127.0.0.1", "auth": {"tokens_file": tokens.path}})


def test_tls_and_tokens_files_resolve_against_the_yaml_and_up_checks_them(tmp_path: Path) -> None:
    data = yaml.safe_load((PIPELINES / "tabular_only.yaml").read_text())
    data["serving"] = {"grpc": {"tls": {"cert_file": "certs/server.pem", "key_file": "certs/server.key"},
                                "auth": {"tokens_file": "tokens.yaml"}}}  # fmt: skip
    spec = parse_pipeline(data, base_dir=PIPELINES)
    resolved = parse_pipeline(spec.resolved(), base_dir=tmp_path).serving.grpc  # what a replica gets
    assert resolved.tls is not None
    assert resolved.tls.cert_file == PIPELINES / "certs" / "server.pem"
    assert resolved.auth is not None
    assert resolved.auth.tokens_file == PIPELINES / "tokens.yaml"
    with pytest.raises(ConfigError, match="cert_file"):
        check_front_door(spec.front_door())  # the files do not exist: `riskserve up` stops here


# -- bounds -----------------------------------------------------------------------------------------------


@pytest.fixture
def bounded(pki: Pki) -> Iterator[Served]:
    settings = _settings(
        pki, None, max_batch=4, max_id_chars=16, max_source_chars=8, max_text_chars=32,
        max_concurrent_streams=2, max_watch_streams_per_client=1, max_receive_message_bytes=4096,
    )  # fmt: skip
    server = Served(settings)
    yield server
    server.close()


def test_over_long_fields_and_batches_are_invalid_naming_the_field(bounded: Served, pki: Pki) -> None:
    with _client(bounded, pki, None) as client:
        cases: list[tuple[Callable[[], object], str]] = [
            (lambda: client.decide(request_id="x" * 17), "request_id"),
            (lambda: client.decide(request_id="ok", text="t" * 33), "text"),
            (lambda: client.decide(categorical={"channel": "c" * 33}), "categorical.channel"),
            (lambda: client.decide_batch([pb.DecideRequest()] * 5), "requests"),
            (lambda: client.decide_batch([pb.DecideRequest(), pb.DecideRequest(request_id="y" * 17)]),
             "requests[1].request_id"),
            (lambda: client.feedback(request_id="r" * 17, label=1, feedback_id="f"), "request_id"),
            (lambda: client.feedback(request_id="r", label=1, feedback_id="f" * 17), "feedback_id"),
            (lambda: client.feedback(request_id="r", label=1, feedback_id="f", source="s" * 9), "source"),
        ]  # fmt: skip
        for call, field_name in cases:
            with pytest.raises(InvalidInput) as caught:
                call()
            assert caught.value.field == field_name, caught.value
        assert client.decide(request_id="x" * 16, text="t" * 32).request_id == "x" * 16  # at the cap: fine
    assert bounded.pipeline.labels == []


def test_a_message_over_the_size_cap_is_refused(bounded: Served, pki: Pki) -> None:
    with _client(bounded, pki, None) as client:
        big = [pb.DecideRequest(numeric={f"f{i}": 1.0 for i in range(1000)})]  # about 15 KB
        with pytest.raises(Overloaded):  # RESOURCE_EXHAUSTED, before it is parsed
            client.decide_batch(big)


def test_one_connection_runs_at_most_max_concurrent_streams_calls(bounded: Served, pki: Pki) -> None:
    channel = grpc.secure_channel(bounded.target, grpc.ssl_channel_credentials(pki.ca.read_bytes()))
    try:
        stub = pb_grpc.RiskPipelineStub(channel)  # type: ignore[no-untyped-call]
        metadata = (("application", NAME),)
        stub.Decide(pb.DecideRequest(), metadata=metadata, timeout=20)  # the connection knows the limit now
        hold = bounded.pipeline.hold = bounded.run(_event)
        calls = [stub.Decide.future(pb.DecideRequest(request_id=f"c{i}"), metadata=metadata, timeout=20)
                 for i in range(4)]  # fmt: skip
        _until(lambda: bounded.pipeline.in_flight == 2)
        assert not any(call.done() for call in calls)  # the others wait for a stream
        bounded.loop.call_soon_threadsafe(hold.set)
        outcomes = [_outcome(call) for call in calls]
    finally:
        channel.close()
    assert bounded.pipeline.most_in_flight == 2
    # A waiting call either runs when a stream frees or is refused (REFUSED_STREAM: UNAVAILABLE, retryable).
    assert set(outcomes) <= {"OK", "UNAVAILABLE"}, outcomes
    assert outcomes.count("OK") >= 2, outcomes


def _outcome(call: Any) -> str:
    try:
        call.result()
    except grpc.RpcError as error:
        return str(error.code().name)
    return "OK"


async def _event() -> asyncio.Event:
    return asyncio.Event()


def test_health_watch_streams_are_capped_per_client(bounded: Served, pki: Pki) -> None:
    channel = grpc.secure_channel(bounded.target, grpc.ssl_channel_credentials(pki.ca.read_bytes()))
    try:
        health = health_pb2_grpc.HealthStub(channel)  # type: ignore[no-untyped-call]
        request = health_pb2.HealthCheckRequest(service=NAME)
        first = health.Watch(request, timeout=30)
        assert next(first).status == health_pb2.HealthCheckResponse.SERVING
        assert bounded.door.watching("127.0.0.1") == 1
        second = health.Watch(request, timeout=30)  # a stream is free on the connection (2 allowed)
        with pytest.raises(grpc.RpcError) as caught:
            next(second)
        assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        first.cancel()
        _until(lambda: bounded.door.watching("127.0.0.1") == 0)
        third = health.Watch(request, timeout=30)
        assert next(third).status == health_pb2.HealthCheckResponse.SERVING  # a closed one frees its slot
        third.cancel()
    finally:
        channel.close()
