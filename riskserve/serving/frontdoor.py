"""riskserve's own gRPC front door, served by every ingress replica (not Ray Serve's gRPC proxy).

One grpc.aio server per ingress replica, on the pipeline's ``serving.grpc`` address (127.0.0.1 unless the
operator opens it); replicas on one node share the port through ``SO_REUSEPORT``, so the kernel spreads
connections over them and a replica that restarts binds it again. Each RPC becomes exactly one status:
riskserve's typed errors map by class (bad input INVALID_ARGUMENT naming the field, never UNKNOWN), a call
that names another pipeline (``application`` metadata) or none is NOT_FOUND, and the caller's real gRPC
deadline bounds the decision. ``grpc.health.v1`` answers from the state the ingress keeps (never a fan-out
per call) and server reflection is on. Shutdown drains: NOT_SERVING, no new calls, calls in flight finish.

With ``tls`` the port speaks only TLS (mutual TLS with a client CA); with ``auth`` every pipeline RPC needs a
bearer token with its role (:mod:`riskserve.serving.auth`), and a label's source is the caller's identity.
Sizes are bounded (:mod:`riskserve.serving.bounds`): message bytes, ids, texts, batch size, streams per
connection, health Watch streams per client.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from riskserve.platform.errors import DeadlineExceeded, InvalidInput, ModelUnavailable, NotFound, Overloaded
from riskserve.platform.metrics import PipelineMetrics
from riskserve.platform.tls import server_credentials
from riskserve.platform.tracing import (
    SPAN_DECIDE,
    SpanKind,
    carrier_from_grpc,
    current_trace_id,
    extract,
    mark_error,
    new_trace_id,
    recording,
    start_span,
    trace_id_of,
)
from riskserve.proto.riskserve.v1 import risk_pipeline_pb2 as pb
from riskserve.proto.riskserve.v1 import risk_pipeline_pb2_grpc as pb_grpc
from riskserve.schema.pipeline import FrontDoorSpec
from riskserve.serving.auth import AuthInterceptor, current_caller
from riskserve.serving.bounds import WatchLimitedHealth, check_decide_requests, check_feedback_request
from riskserve.serving.grpc_status import set_status
from riskserve.serving.tokens import Caller, TokenStore

__all__ = [
    "APPLICATION_METADATA",
    "DEADLINE_METADATA",
    "NODE_HOST_ENV",
    "SERVICE_NAME",
    "Admission",
    "FrontDoor",
    "Pipeline",
    "bind_host",
    "check_front_door",
]

logger = logging.getLogger(__name__)

SERVICE_NAME = "riskserve.v1.RiskPipeline"
APPLICATION_METADATA = "application"
"""Metadata key naming the pipeline a call is for; required, so a decision never comes from another."""
DEADLINE_METADATA = "riskserve-timeout-ms"
"""Optional metadata with a budget in ms; the gRPC deadline is used too (the shorter one wins)."""
NODE_HOST_ENV = "RISKSERVE_NODE_HOST"
"""Set where a Ray node is started: the address every front door on that node binds instead of the YAML's
``serving.grpc.host`` (the node's own address on a cluster; several nodes on one machine, each its own
loopback address)."""


def bind_host(configured: str) -> str:
    """The address a front door on this node binds: :data:`NODE_HOST_ENV`, else the YAML's host."""
    return os.environ.get(NODE_HOST_ENV) or configured


class Pipeline(Protocol):
    """What the front door asks of the ingress behind it."""

    name: str
    metrics: PipelineMetrics
    decision_timeout_ms: float

    async def decide(
        self,
        requests: Sequence[pb.DecideRequest],
        trace_id: str,
        deadline: float,
        traced: bool,
        into: pb.DecideBatchResponse | None = None,
    ) -> list[pb.DecideResponse]: ...

    async def describe(self) -> pb.DescribeResponse: ...

    async def feedback(
        self, request: pb.FeedbackRequest, caller: Caller | None, deadline: float
    ) -> pb.FeedbackResponse:
        """Record a label by ``deadline`` (monotonic, the call's own); ``caller`` is the authenticated caller
        (``None``: the front door has no tokens)."""
        ...


def _metadata(context: Any) -> dict[str, str]:
    out: dict[str, str] = {}
    for key, value in context.invocation_metadata() or ():
        out[str(key)] = value.decode("ascii", "replace") if isinstance(value, bytes) else str(value)
    return out


LAG_PROBE_S = 0.05
"""How often the event loop's lag is measured (a sleep of this long, and how late it wakes)."""
QUEUE_INTERVAL_S = 0.2
"""The queue in front of the handlers counts as standing when every call that reached a handler during one
interval this long had waited more than ``max_wait_s`` (CoDel's rule: a burst drains within an interval,
a standing queue does not)."""


class Admission:
    """The ingress's ``max_ongoing_requests`` / ``max_queued_requests`` applied to the front door's decisions:
    up to ``ongoing`` run at once, up to ``queued`` more wait (within their deadline), the rest are refused
    at once with RESOURCE_EXHAUSTED (``queued`` -1: unbounded).

    Past its capacity a replica's calls queue in front of its handlers, inside grpc (which hands the
    event loop one call at a time), where no count sees them, until their deadlines pass. Two signals see
    that queue and refuse new decisions at once while it stands, so it drains (a refusal costs a fraction of a
    decision) and what is past capacity gets a prompt RESOURCE_EXHAUSTED instead of DEADLINE_EXCEEDED:

    - ``max_wait_s``: how long calls waited before their handler ran (:meth:`arrived`), when every call
      of the last :data:`QUEUE_INTERVAL_S` waited longer than this (measured: the flood that the loop-lag
      signal never caught queued calls 1.5 s in front of a loop only 55 ms behind);
    - ``max_lag_s`` (with :meth:`watch_lag` running): the event loop runs that far behind."""

    def __init__(
        self,
        ongoing: int,
        queued: int,
        max_lag_s: float | None = None,
        max_wait_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``clock``: monotonic seconds, for the intervals of ``max_wait_s`` (injectable for tests)."""
        self.ongoing, self.queued = ongoing, queued
        self.clock = clock
        self._slots = asyncio.Semaphore(ongoing)
        self._admitted = 0
        self.max_lag_s = max_lag_s
        self.lag_s = 0.0
        """How late the last two lag probes woke up, the lesser of the two (seconds): a sustained lag, not
        one moment the process was not scheduled."""
        self.max_wait_s = max_wait_s
        self.standing_s = 0.0
        """The least wait of the calls that reached a handler in the last whole interval (0: none came)."""
        self._interval_ends = float("-inf")
        self._least_s = float("inf")

    def arrived(self, waited_s: float, now: float) -> None:
        """A call reached its handler having waited ``waited_s`` since its client sent it (monotonic
        ``now``); updates :attr:`standing_s` once an interval is over."""
        if now >= self._interval_ends:
            self.standing_s = self._least_s if now < self._interval_ends + QUEUE_INTERVAL_S else 0.0
            self._least_s = float("inf")
            self._interval_ends = now + QUEUE_INTERVAL_S
        self._least_s = min(self._least_s, waited_s)

    async def watch_lag(self) -> None:
        """Measure the event loop's lag forever (a task of the front door)."""
        loop = asyncio.get_running_loop()
        last = 0.0
        while True:
            asked = loop.time()
            await asyncio.sleep(LAG_PROBE_S)
            lag = max(loop.time() - asked - LAG_PROBE_S, 0.0)
            self.lag_s, last = min(lag, last), lag

    def slot(self, deadline: float, waited_s: float | None = None) -> _Slot:
        """A context manager that holds one of the ``ongoing`` slots while the decision runs; ``waited_s``:
        how long the call waited before its handler ran, if known.

        Raises (on entry):
            Overloaded: ``ongoing`` run and ``queued`` more wait already, or a queue stands in front of the
                handlers and this call waited in it, or the event loop runs behind.
            DeadlineExceeded: the deadline passed while waiting for a slot.
        """
        return _Slot(self, deadline, waited_s)


class _Slot:
    """One admission to an :class:`Admission` (a plain class: an ``asynccontextmanager`` costs a generator
    and two frames per decision)."""

    __slots__ = ("_admission", "_deadline", "_held", "_waited_s")

    def __init__(self, admission: Admission, deadline: float, waited_s: float | None) -> None:
        self._admission = admission
        self._deadline = deadline
        self._waited_s = waited_s
        self._held = False

    async def __aenter__(self) -> None:
        admission = self._admission
        if admission.queued >= 0 and admission._admitted >= admission.ongoing + admission.queued:
            raise Overloaded(
                f"overloaded: {admission.ongoing} decisions running, {admission.queued} queued in this "
                "ingress replica"
            )
        waited, most = self._waited_s, admission.max_wait_s
        if waited is not None and most is not None:
            admission.arrived(waited, admission.clock())
            if waited > most and admission.standing_s > most:
                raise Overloaded(
                    f"overloaded: calls wait {admission.standing_s * 1e3:.0f} ms and more in front of this "
                    f"ingress replica (max_queue_wait_ms {most * 1e3:.0f}); retry with backoff"
                )
        if admission.max_lag_s is not None and admission.lag_s > admission.max_lag_s:
            raise Overloaded(
                f"overloaded: this ingress replica runs {admission.lag_s * 1e3:.0f} ms behind "
                f"(max_loop_lag_ms {admission.max_lag_s * 1e3:.0f}); retry with backoff"
            )
        admission._admitted += 1
        try:
            slots = admission._slots
            if slots.locked():  # wait for a slot, within the deadline
                try:
                    await asyncio.wait_for(
                        slots.acquire(), timeout=max(self._deadline - time.monotonic(), 0.0)
                    )
                except TimeoutError:
                    raise DeadlineExceeded("the decision's deadline passed while it was queued") from None
            else:
                await slots.acquire()  # free: no timer (a wait_for costs a task per call)
        except BaseException:
            admission._admitted -= 1
            raise
        self._held = True

    async def __aexit__(self, *exc: object) -> None:
        if self._held:
            self._held = False
            self._admission._slots.release()
            self._admission._admitted -= 1


class _Service(pb_grpc.RiskPipelineServicer):
    """The RPCs of ``riskserve.v1.RiskPipeline``: routing check, deadline, root span, one status each."""

    def __init__(self, pipeline: Pipeline, admission: Admission, limits: FrontDoorSpec) -> None:
        self._pipeline = pipeline
        self._admission = admission
        self._limits = limits

    def _route(self, metadata: dict[str, str]) -> None:
        named = metadata.get(APPLICATION_METADATA)
        mine = self._pipeline.name
        if not named:
            raise NotFound(
                f"no pipeline named: send the '{APPLICATION_METADATA}' metadata "
                f"(this endpoint serves '{mine}')"
            )
        if named != mine:
            raise NotFound(f"pipeline '{named}' is not served here (this endpoint serves '{mine}')")

    def _deadline(self, metadata: dict[str, str], context: Any) -> tuple[float, float | None]:
        """Monotonic time by which to answer (the gRPC deadline, the metadata budget, the pipeline's own,
        the shortest), and how long the call waited before its handler ran, when it sent both a gRPC deadline
        and its budget in ``riskserve-timeout-ms`` (as :class:`~riskserve.client.RiskClient` does, both
        from one timeout): the budget less what is left of the deadline, ``None`` otherwise."""
        budget_s = self._pipeline.decision_timeout_ms / 1e3
        remaining = context.time_remaining()
        if remaining is not None:
            budget_s = min(budget_s, float(remaining))
        waited_s = None
        value = metadata.get(DEADLINE_METADATA)
        if value is not None:
            try:
                named_s = float(value) / 1e3
            except ValueError:
                raise InvalidInput(
                    f"'{value}' is not a number of milliseconds", field=DEADLINE_METADATA
                ) from None
            budget_s = min(budget_s, named_s)
            if remaining is not None:
                waited_s = max(named_s - float(remaining), 0.0)
        return time.monotonic() + budget_s, waited_s

    def _failed(self, error: BaseException, span: Any, context: Any, method: str = "") -> None:
        cause = getattr(error, "cause", error)
        if isinstance(cause, InvalidInput):
            self._pipeline.metrics.invalid(cause.field or "request")
        elif isinstance(error, Overloaded) and method:  # the front door's own refusal (not a model's)
            self._pipeline.metrics.refused(method, "RESOURCE_EXHAUSTED")
        if span is not None:
            mark_error(error, span)
        set_status(context, error)

    async def _decide(
        self,
        requests: Sequence[pb.DecideRequest],
        context: Any,
        method: str,
        into: pb.DecideBatchResponse | None = None,
    ) -> Any:
        metadata = _metadata(context)
        if not recording():  # no span could be kept: skip OpenTelemetry, keep the trace id it would give
            trace_id = trace_id_of(metadata) or new_trace_id()
            try:
                self._route(metadata)
                deadline, waited_s = self._deadline(metadata, context)
                async with self._admission.slot(deadline, waited_s):  # refusals first: they must be cheap
                    check_decide_requests(requests, self._limits)
                    return await self._pipeline.decide(requests, trace_id, deadline, False, into=into)
            except Exception as error:  # every failure becomes its status, never UNKNOWN
                self._failed(error, None, context, method)
                return None
        attributes: dict[str, str | int] = {
            "pipeline": self._pipeline.name,
            "request.count": len(requests),
            "rpc.method": method,
        }
        parent = extract(carrier_from_grpc(context))
        with start_span(SPAN_DECIDE, context=parent, kind=SpanKind.SERVER, attributes=attributes) as span:
            try:
                self._route(metadata)
                deadline, waited_s = self._deadline(metadata, context)
                traced = bool(span.is_recording())
                async with self._admission.slot(deadline, waited_s):
                    check_decide_requests(requests, self._limits)
                    trace_id = current_trace_id()
                    return await self._pipeline.decide(requests, trace_id, deadline, traced, into=into)
            except Exception as error:  # every failure becomes its status, never UNKNOWN
                self._failed(error, span, context, method)
                return None

    async def Decide(self, request: pb.DecideRequest, context: Any) -> pb.DecideResponse:  # noqa: N802
        """One decision, traced as one trace (continuing the caller's ``traceparent``)."""
        responses = await self._decide((request,), context, "Decide")
        return responses[0] if responses else pb.DecideResponse()

    async def DecideBatch(  # noqa: N802
        self, request: pb.DecideBatchRequest, context: Any
    ) -> pb.DecideBatchResponse:
        """Many decisions in one call: one feature matrix, one call per model; same order as requested."""
        batch = pb.DecideBatchResponse()  # the flow makes the responses in it: no copy of 1,000 messages
        responses = await self._decide(list(request.requests), context, "DecideBatch", into=batch)
        return batch if responses is not None else pb.DecideBatchResponse()

    async def _simple(
        self, call: Callable[[dict[str, str]], Awaitable[Any]], empty: Any, context: Any
    ) -> Any:
        """Route the call by its metadata, then run ``call`` with that metadata (parsed once)."""
        try:
            metadata = _metadata(context)
            self._route(metadata)
            return await call(metadata)
        except Exception as error:
            self._failed(error, None, context)
            return empty

    async def Describe(self, request: pb.DescribeRequest, context: Any) -> pb.DescribeResponse:  # noqa: N802
        """The pipeline's features and models with their serving versions."""
        response: pb.DescribeResponse = await self._simple(
            lambda _: self._pipeline.describe(), pb.DescribeResponse(), context
        )
        return response

    async def Feedback(self, request: pb.FeedbackRequest, context: Any) -> pb.FeedbackResponse:  # noqa: N802
        """The true outcome of a past decision; answered once the label is durable."""

        async def record(metadata: dict[str, str]) -> pb.FeedbackResponse:
            check_feedback_request(request, self._limits)
            deadline, _ = self._deadline(metadata, context)
            return await self._pipeline.feedback(request, current_caller(), deadline)

        response: pb.FeedbackResponse = await self._simple(record, pb.FeedbackResponse(), context)
        return response


def check_front_door(settings: FrontDoorSpec) -> None:
    """Read the TLS files and the tokens ``settings`` name, as a replica will (``up`` fails fast on them).

    Raises:
        ConfigError: a file is missing, not PEM, or the tokens are invalid or readable by others.
    """
    if settings.tls is not None:
        server_credentials(settings.tls.cert_file, settings.tls.key_file, settings.tls.client_ca_file)
    if settings.auth is not None:
        TokenStore(path=settings.auth.tokens_file, env=settings.auth.tokens_env)


class FrontDoor:
    """The gRPC server of one ingress replica: start, serve, report health, drain, stop."""

    def __init__(self, pipeline: Pipeline, settings: FrontDoorSpec, admission: Admission) -> None:
        self._pipeline = pipeline
        self._settings = settings
        self._admission = admission
        self._server: grpc.aio.Server | None = None
        self._health = WatchLimitedHealth(
            settings.max_watch_streams_per_client,
            on_refused=lambda: pipeline.metrics.refused("Watch", "RESOURCE_EXHAUSTED"),
        )
        self._services = ("", SERVICE_NAME, pipeline.name)
        self._reloader: asyncio.Task[None] | None = None
        self._lag_watcher: asyncio.Task[None] | None = None
        self.port = 0
        self.host = settings.host

    def _token_store(self) -> TokenStore | None:
        auth = self._settings.auth
        if auth is None:
            return None
        return TokenStore(path=auth.tokens_file, env=auth.tokens_env, reload_s=auth.reload_s)

    async def _reload_tokens(self, store: TokenStore, every_s: float) -> None:
        """Re-read a changed tokens file, off the call path (a ``stat`` per period)."""
        while True:
            await asyncio.sleep(every_s)
            try:
                store.refresh()
            except Exception:  # never let the reloader die: the last good tokens keep serving
                logger.exception("tokens reload failed")

    async def start(self) -> int:
        """Bind and serve; returns the port. NOT_SERVING until :meth:`set_serving` says otherwise.

        Raises:
            ModelUnavailable: the address cannot be bound (in use by something that is not a replica).
            ConfigError: the TLS files or the tokens cannot be read or are invalid.
        """
        settings = self._settings
        options = [
            ("grpc.so_reuseport", 1),
            ("grpc.max_receive_message_length", settings.max_receive_message_bytes),
            ("grpc.max_send_message_length", settings.max_send_message_bytes),
            ("grpc.max_concurrent_streams", settings.max_concurrent_streams),
            ("grpc.max_connection_idle_ms", int(settings.max_connection_idle_s * 1000)),
        ]
        store = self._token_store()
        interceptors = []
        if store is not None:
            metrics = self._pipeline.metrics
            interceptors.append(AuthInterceptor(store, on_refused=metrics.refused))
        credentials = None
        if settings.tls is not None:
            tls = settings.tls
            credentials = server_credentials(tls.cert_file, tls.key_file, tls.client_ca_file)
        server = grpc.aio.server(
            options=options, interceptors=interceptors, maximum_concurrent_rpcs=settings.max_concurrent_calls
        )
        servicer = _Service(self._pipeline, self._admission, settings)
        pb_grpc.add_RiskPipelineServicer_to_server(servicer, server)  # type: ignore[no-untyped-call]
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        if self._settings.reflection:
            reflection.enable_server_reflection(
                (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                 reflection.SERVICE_NAME), server,
            )  # fmt: skip
        self.host = bind_host(settings.host)
        address = f"{self.host}:{settings.port}"
        try:
            if credentials is None:
                self.port = server.add_insecure_port(address)
            else:
                self.port = server.add_secure_port(address, credentials)
        except RuntimeError as error:
            raise ModelUnavailable(f"cannot bind the gRPC endpoint {address}: {error}") from error
        for service in self._services:
            await self._health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        await server.start()
        self._server = server
        if self._admission.max_lag_s is not None:
            self._lag_watcher = asyncio.get_running_loop().create_task(self._admission.watch_lag())
        if store is not None and settings.auth is not None and settings.auth.tokens_file is not None:
            every = settings.auth.reload_s
            self._reloader = asyncio.get_running_loop().create_task(self._reload_tokens(store, every))
        closed = " (TLS)" if settings.tls else " (plain text)"
        closed += ", bearer tokens" if store is not None else ", no caller authentication"
        logger.info("pipeline '%s': gRPC on %s%s", self._pipeline.name, address, closed)
        if self.host not in ("127.0.0.1", "::1", "localhost") and (store is None or settings.tls is None):
            logger.warning("pipeline '%s': gRPC on %s is reachable from the network%s", self._pipeline.name,
                           address, closed)  # fmt: skip
        return self.port

    def watching(self, host: str) -> int:
        """Health ``Watch`` streams open now from client address ``host``."""
        return self._health.watching(host)

    async def set_serving(self, serving: bool) -> None:
        """Report SERVING or NOT_SERVING for the pipeline's services (Watch streams see the change)."""
        status = (
            health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for service in self._services:
            await self._health.set(service, status)

    async def stop(self, grace_s: float | None = None) -> None:
        """Drain: NOT_SERVING, refuse new calls, let calls in flight finish within ``grace_s``, stop."""
        server, self._server = self._server, None
        for task in (self._reloader, self._lag_watcher):
            if task is not None:
                task.cancel()
        self._reloader = self._lag_watcher = None
        if server is None:
            return
        await self._health.enter_graceful_shutdown()
        await server.stop(self._settings.drain_s if grace_s is None else grace_s)
