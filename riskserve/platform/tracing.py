"""One OpenTelemetry trace per decision, across the Ray Serve replicas that make it.

::

    riskserve.decide            ingress replica   (continues the caller's gRPC ``traceparent``, or a new root)
    ├── riskserve.features      feature-stage replica (continued from the carrier the ingress passed)
    ├── riskserve.model         ingress, one per model: version, kind, fallback and its reason, rows
    │   └── riskserve.model.predict   model replica (continued from the carrier)
    └── riskserve.decision      ingress, one per request: outcome, risk_score

Every replica is its own process, so every replica calls :func:`configure_tracing` in its constructor and
releases the :class:`TracingLease` it got when it stops; the exporter closes with the last lease, so a
second holder in the same process (the ingress's in-process feature stage) keeps tracing. The trace
crosses processes as a small W3C carrier dict (``{"traceparent": ..., "tracestate": ...}``):
:func:`inject` makes it from the current span and the callee's :func:`extract` turns it back into the
parent context of its span.

riskserve keeps its own ``TracerProvider`` and never installs the process-global one: Ray Serve's own
tracing (``RAY_SERVE_TRACING_*``) sets the global provider in replicas, and the global one can be set
only once per process, which would make :func:`configure_tracing` neither idempotent nor reconfigurable.
The W3C propagator is used directly (not the env-configurable global one) so the carrier format is fixed.

Sampling is parent-based: ``sample_ratio`` decides for new roots; a span with a parent follows the
parent's sampled flag. The ingress makes the decision once and every downstream replica follows it, so a
trace is exported whole or not at all. An incoming ``traceparent`` whose sampled flag is set is honoured.
Trace ids exist even for unsampled traces and for ``exporter: none``, so a response's ``trace_id`` is
always the trace's id (the caller's, when it sent a ``traceparent``).
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import sys
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
    SpanExporter,
    SpanExportResult,
)
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ParentBasedTraceIdRatio, Sampler
from opentelemetry.trace import INVALID_SPAN, Span, SpanKind, Status, StatusCode, Tracer, get_current_span
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.util.types import AttributeValue
from pydantic import BaseModel as _Schema
from pydantic import ConfigDict, Field, model_validator

from riskserve.platform.entropy import random_bytes
from riskserve.platform.errors import ConfigError

__all__ = [
    "SPAN_DECIDE",
    "SPAN_DECISION",
    "SPAN_FEATURES",
    "SPAN_MODEL",
    "SPAN_MODEL_PREDICT",
    "JsonLinesSpanExporter",
    "SpanKind",
    "TracingLease",
    "TracingSettings",
    "carrier_from_grpc",
    "configure_tracing",
    "current_trace_id",
    "extract",
    "flush_tracing",
    "inject",
    "mark_error",
    "new_trace_id",
    "optional_span",
    "recording",
    "shutdown_tracing",
    "span_to_dict",
    "start_span",
    "trace_id_of",
    "tracing_holders",
]

SPAN_DECIDE = "riskserve.decide"
"""Root of a decision's trace, in the ingress: attributes ``pipeline``, ``request.count``, ``rpc.method``."""
SPAN_FEATURES = "riskserve.features"
"""The feature stage's validation and encoding, in its replica: attribute ``rows``."""
SPAN_MODEL = "riskserve.model"
"""One model call as the ingress sees it (including timeouts and fallbacks): ``model.*`` and ``rows``."""
SPAN_MODEL_PREDICT = "riskserve.model.predict"
"""The model's work in its replica, child of :data:`SPAN_MODEL`: ``model.name``, ``model.version``, ``rows``.
"""
SPAN_DECISION = "riskserve.decision"
"""The decision rules for one request, in the ingress: ``request.id``, ``outcome``, ``risk_score``."""

TRACER_NAME = "riskserve"
_CARRIER_KEYS = ("traceparent", "tracestate")
_PROPAGATOR = TraceContextTextMapPropagator()
_log = logging.getLogger(__name__)


class TracingSettings(_Schema):
    """How a process exports its spans; the same settings are given to every replica of a pipeline."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    exporter: Literal["none", "console", "file", "otlp"] = "none"
    """``none``: ids and propagation only, nothing recorded; ``console``: one JSON line per span on stdout
    (Ray puts it in the replica's log); ``file``: one JSON line per span appended to ``file_path``;
    ``otlp``: OTLP over gRPC to ``otlp_endpoint`` (batched, in a background thread)."""
    file_path: Path | None = None
    """The JSON-lines file of the ``file`` exporter; all of a pipeline's processes may append to it."""
    otlp_endpoint: str = "http://127.0.0.1:4317"
    """The collector's OTLP/gRPC address; ``http://`` means plaintext, ``https://`` TLS. The standard
    ``OTEL_EXPORTER_OTLP_*`` variables (headers, certificates, timeout, compression) still apply."""
    service_name: str = Field(default="riskserve", min_length=1)
    """The ``service.name`` resource attribute of every span this process exports."""
    sample_ratio: float = Field(default=1.0, ge=0.0, le=1.0)
    """Share of new traces that are recorded (by trace id); spans with a parent follow the parent's flag."""

    @model_validator(mode="after")
    def _file_needs_path(self) -> TracingSettings:
        if self.exporter == "file" and self.file_path is None:
            raise ValueError("file_path is required when exporter is 'file'")
        return self


def span_to_dict(span: ReadableSpan) -> dict[str, Any]:
    """The JSON object the file and console exporters write for one span (ids in lowercase hex)."""
    context = span.get_span_context()
    parent = span.parent
    return {
        "name": span.name,
        "trace_id": f"{context.trace_id:032x}" if context else None,
        "span_id": f"{context.span_id:016x}" if context else None,
        "parent_span_id": f"{parent.span_id:016x}" if parent is not None else None,
        "parent_is_remote": parent.is_remote if parent is not None else None,
        "kind": span.kind.name,
        "start_time_ns": span.start_time,
        "end_time_ns": span.end_time,
        "attributes": _plain(span.attributes),
        "status": {"code": span.status.status_code.name, "description": span.status.description},
        "events": [
            {"name": event.name, "time_ns": event.timestamp, "attributes": _plain(event.attributes)}
            for event in span.events
        ],
        "resource": _plain(span.resource.attributes),
    }


def _plain(attributes: Mapping[str, AttributeValue] | None) -> dict[str, Any]:
    return {k: list(v) if isinstance(v, tuple | list) else v for k, v in (attributes or {}).items()}


def _json_line(span: ReadableSpan) -> str:
    # ensure_ascii: a line is pure ASCII, so its byte length is its character length and no reader trips
    # over an encoding; default=str: an exporter never fails a request over an odd attribute value.
    return json.dumps(span_to_dict(span), separators=(",", ":"), ensure_ascii=True, default=str) + "\n"


class JsonLinesSpanExporter(SpanExporter):
    """Appends one JSON object per span, one line each, to a file that several processes may share.

    The file is opened with ``O_APPEND`` and every line goes out in a single ``write(2)``. ``O_APPEND``
    makes "seek to the end, then write" one atomic step, so processes never overwrite each other; and
    Linux holds the inode's lock for the whole of a ``write`` to a regular file, so concurrent lines do
    not interleave whatever their length on local filesystems (ext4, xfs, tmpfs, overlayfs). PIPE_BUF
    (4096 bytes) is the guarantee for pipes and FIFOs, not for files: it is not what this relies on. NFS
    and other network filesystems give no such guarantee; use ``otlp`` there. Within a process a lock
    keeps threads (the event loop, a batch worker) from interleaving, and finishes the rare short write
    (disk full, signal) before another line starts.
    """

    def __init__(self, path: Path) -> None:
        self._path = Path(path)
        self._lock = threading.Lock()
        try:
            self._path.parent.mkdir(parents=True, exist_ok=True)
            self._fd: int | None = os.open(
                self._path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644
            )
        except OSError as error:
            raise ConfigError(f"tracing.file_path: cannot append to {self._path}: {error}") from error

    @property
    def path(self) -> Path:
        """The file the spans are appended to."""
        return self._path

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        """Append every span as one line; FAILURE (logged, never raised) if the file cannot be written."""
        lines = [_json_line(span).encode("ascii") for span in spans]
        with self._lock:
            if self._fd is None:
                return SpanExportResult.FAILURE
            try:
                for line in lines:
                    written = os.write(self._fd, line)
                    while written < len(line):  # a short write only happens on ENOSPC or a signal
                        written += os.write(self._fd, line[written:])
            except OSError as error:
                _log.warning("tracing: cannot append spans to %s: %s", self._path, error)
                return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        """Nothing is buffered: every line is in the kernel when :meth:`export` returns."""
        return True

    def shutdown(self) -> None:
        """Close the file; later exports fail (they are not written to a closed descriptor)."""
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


def _processor(settings: TracingSettings) -> SpanProcessor | None:
    """The span processor of ``settings.exporter``; ``None`` for ``none``.

    ``file`` and ``console`` export synchronously when a span ends (SimpleSpanProcessor): one local
    ``write`` of a few hundred bytes costs microseconds, a line is readable as soon as its span ends (no
    waiting or flushing in tests, ``tail -f`` shows live traces), and nothing is lost when Serve kills a
    replica without running ``__del__``. ``otlp`` talks to the network, which must never block a request or
    the event loop, so its spans are batched and sent from the BatchSpanProcessor's thread.
    """
    if settings.exporter == "file":
        assert settings.file_path is not None  # the settings validator guarantees it
        return SimpleSpanProcessor(JsonLinesSpanExporter(settings.file_path))
    if settings.exporter == "console":
        return SimpleSpanProcessor(ConsoleSpanExporter(out=sys.stdout, formatter=_json_line))
    if settings.exporter == "otlp":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        return BatchSpanProcessor(OTLPSpanExporter(endpoint=settings.otlp_endpoint))
    return None


def _resource(settings: TracingSettings) -> Resource:
    """``service.name``, ``process.pid`` and, inside a Serve replica, its application/deployment/replica."""
    attributes: dict[str, AttributeValue] = {
        "service.name": settings.service_name,
        "process.pid": os.getpid(),
    }
    attributes.update(_replica_attributes())
    return Resource.create(attributes)


def _replica_attributes() -> dict[str, AttributeValue]:
    # A replica has imported ray.serve long before its constructor runs; anywhere else, do not pay for it.
    serve = sys.modules.get("ray.serve")
    if serve is None:
        return {}
    try:
        replica = serve.get_replica_context()
        return {
            "ray.serve.app": str(replica.app_name),
            "ray.serve.deployment": str(replica.deployment),
            "ray.serve.replica": str(replica.replica_tag),
        }
    except Exception:  # not inside a replica (a driver, a test): no replica attributes
        return {}


@dataclass
class _State:
    provider: TracerProvider
    tracer: Tracer
    settings: TracingSettings | None
    """``None``: the default, unconfigured state (ids and propagation, nothing recorded)."""


def _new_state(settings: TracingSettings | None) -> _State:
    sampler: Sampler
    if settings is None or settings.exporter == "none":
        sampler = ALWAYS_OFF  # nothing would be exported: do not even record (ids are still made)
    else:
        sampler = ParentBasedTraceIdRatio(settings.sample_ratio)
    resource = _resource(settings or TracingSettings())
    # shutdown_on_exit=False: one atexit hook of this module shuts down whichever provider is current.
    provider = TracerProvider(sampler=sampler, resource=resource, shutdown_on_exit=False)
    processor = _processor(settings) if settings is not None else None
    if processor is not None:
        provider.add_span_processor(processor)
    return _State(provider=provider, tracer=provider.get_tracer(TRACER_NAME), settings=settings)


_lock = threading.Lock()
_state: _State | None = None
"""This process's tracer provider (OpenTelemetry's is per process too); ``None``: not configured."""
_holders = 0
"""Leases on ``_state`` not yet released: the provider is shut down when the last one is."""
_generation = 0
"""Bumped by :func:`shutdown_tracing`: leases taken before it are void (their release does nothing)."""


def _current() -> _State:
    global _state
    state = _state
    if state is None:
        with _lock:
            if _state is None:
                _state = _new_state(None)
            state = _state
    return state


class TracingLease:
    """One holder's use of the process's tracing, from :func:`configure_tracing` to :meth:`release`.

    Several holders can share a process (an ingress and its in-process feature stage, two replicas that
    Ray put in one worker): each releases its own lease when it stops, and the exporter is flushed and
    closed only when the last one does, so one stopping never silences another.
    """

    __slots__ = ("_generation", "_released")

    def __init__(self, generation: int) -> None:
        self._generation = generation
        self._released = False

    @property
    def released(self) -> bool:
        """Whether :meth:`release` has run."""
        return self._released

    def release(self, timeout_ms: int = 5000) -> None:
        """Give the lease back (a replica's shutdown); the last one closes the exporter. Idempotent."""
        global _state, _holders
        with _lock:
            if self._released:
                return
            self._released = True
            if self._generation != _generation:
                return  # shutdown_tracing closed everything since this lease was taken
            _holders -= 1
            if _holders:
                return
            old, _state = _state, None
        if old is not None:
            _shutdown(old.provider, timeout_ms)


def configure_tracing(settings: TracingSettings) -> TracingLease:
    """Install this process's tracer provider and take a lease on it; every Serve replica calls it in its
    constructor and releases the lease when it stops (:meth:`TracingLease.release`).

    Equal settings share the provider (several deployments in one process, a constructor retried by
    Serve). Different settings replace it for every holder: new spans go to the new one, then the old one
    is flushed and shut down, so what it ended is exported once, to where it was meant to go. Never
    touches the process-global provider.

    Raises:
        ConfigError: the ``file`` exporter cannot open ``file_path`` for appending.
    """
    global _state, _holders
    with _lock:
        if _state is not None and _state.settings == settings:
            _holders += 1
            return TracingLease(_generation)
        new = _new_state(settings)
        old, _state = _state, new
        _holders += 1
        lease = TracingLease(_generation)
    if old is not None:
        _shutdown(old.provider)
    _log.debug("tracing: exporter=%s sample_ratio=%s", settings.exporter, settings.sample_ratio)
    return lease


def tracing_holders() -> int:
    """Leases taken by :func:`configure_tracing` and not yet released, in this process."""
    return _holders


def flush_tracing(timeout_ms: int = 5000) -> bool:
    """Export what is pending (only ``otlp`` batches); ``False`` if the timeout passed first."""
    state = _state
    return state.provider.force_flush(timeout_ms) if state is not None else True


def shutdown_tracing(timeout_ms: int = 5000) -> None:
    """Flush and close this process's exporter whoever holds it: at process exit (``atexit``) and in
    tests. A replica releases its :class:`TracingLease` instead. Safe to call more than once.

    Afterwards the process is back to the unconfigured state: spans still get ids and propagate, nothing is
    exported, and :func:`configure_tracing` may install a provider again (earlier leases are void).
    """
    global _state, _holders, _generation
    with _lock:
        old, _state, _holders = _state, None, 0
        _generation += 1
    if old is not None:
        _shutdown(old.provider, timeout_ms)


def _shutdown(provider: TracerProvider, timeout_ms: int = 5000) -> None:
    provider.force_flush(timeout_ms)
    provider.shutdown()


atexit.register(shutdown_tracing)


def inject(context: Context | None = None) -> dict[str, str]:
    """The W3C carrier (``traceparent``, and ``tracestate`` when set) of the current span, for a callee.

    Empty when there is no span. Pass it along with a Serve handle call; the callee calls :func:`extract`.
    """
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=context)
    return carrier


def extract(carrier: Mapping[str, str] | None) -> Context:
    """The parent context in ``carrier``: pass it as ``start_span(..., context=...)`` to continue the trace.

    A missing, empty or malformed carrier gives an empty context, so the span becomes a new root. The
    result holds only the remote parent: whatever is current in the callee (Ray Serve's own spans) is
    deliberately not mixed in.
    """
    if not carrier:
        return Context()
    return _PROPAGATOR.extract({k.lower(): v for k, v in carrier.items() if k.lower() in _CARRIER_KEYS})


def recording() -> bool:
    """Whether this process can record any span (an exporter is configured). When not, a caller may skip
    OpenTelemetry on the request path entirely and use :func:`trace_id_of` / :func:`new_trace_id`: the
    trace ids are the ones OpenTelemetry would have given, and no span would have been kept anyway."""
    settings = _current().settings
    return settings is not None and settings.exporter != "none"


def trace_id_of(carrier: Mapping[str, str] | None) -> str:
    """The trace id of a valid ``traceparent`` in ``carrier`` (32 lowercase hex digits), else ``""``."""
    if not carrier or "traceparent" not in carrier:
        return ""
    context = get_current_span(extract(carrier)).get_span_context()
    return f"{context.trace_id:032x}" if context.is_valid else ""


def new_trace_id() -> str:
    """A new random, valid (non-zero) trace id, 32 lowercase hex digits, as a new root would get."""
    while True:
        value = random_bytes(16).hex()
        if value != "0" * 32:
            return value


def carrier_from_grpc(grpc_context: Any) -> dict[str, str]:
    """The ``traceparent``/``tracestate`` of a gRPC call's invocation metadata (``{}`` without any)."""
    carrier: dict[str, str] = {}
    try:
        metadata = grpc_context.invocation_metadata() if grpc_context is not None else ()
    except Exception:  # a context without metadata (tests, a proxy that strips it): start a new trace
        return carrier
    for key, value in metadata or ():
        name = str(key).lower()
        if name in _CARRIER_KEYS:
            text = value.decode("ascii", "replace") if isinstance(value, bytes) else str(value)
            carrier[name] = f"{carrier[name]},{text}" if name in carrier else text
    return carrier


@contextmanager
def start_span(
    name: str,
    *,
    context: Context | None = None,
    kind: SpanKind = SpanKind.INTERNAL,
    attributes: Mapping[str, AttributeValue | None] | None = None,
) -> Iterator[Span]:
    """A span that is current inside the ``with`` block and ends with it; yields the span.

    ``context``: the parent (from :func:`extract`); ``None`` means the current span (or a new root).
    Attributes whose value is ``None`` are left out (OpenTelemetry rejects them). An exception leaving the
    block is recorded on the span and sets its status to ERROR; it is re-raised.
    """
    clean = {k: v for k, v in (attributes or {}).items() if v is not None}
    tracer = _current().tracer
    with tracer.start_as_current_span(name, context=context, kind=kind, attributes=clean) as span:
        yield span


def optional_span(
    enabled: bool,
    name: str,
    *,
    context: Context | None = None,
    kind: SpanKind = SpanKind.INTERNAL,
    attributes: Mapping[str, AttributeValue | None] | None = None,
) -> AbstractContextManager[Span]:
    """:func:`start_span` when ``enabled`` (the trace is sampled), else a no-op span for free.

    A child of an unsampled trace records nothing either; skipping it spares the context switch and
    attribute work on every decision that is not sampled. The trace id still reaches the caller.
    """
    if enabled:
        return start_span(name, context=context, kind=kind, attributes=attributes)
    return nullcontext(INVALID_SPAN)


def mark_error(error: BaseException | str, span: Span | None = None) -> None:
    """Set ERROR status (and record the exception) on ``span`` or the current span.

    For errors that are handled inside a span's block and so never reach :func:`start_span`: a status
    turned into a gRPC error, a model call replaced by its fallback.
    """
    target = span if span is not None else get_current_span()
    if isinstance(error, BaseException):
        target.record_exception(error)
        description = f"{type(error).__name__}: {error}"
    else:
        description = error
    target.set_status(Status(StatusCode.ERROR, description))


def current_trace_id() -> str:
    """The current span's trace id in 32 lowercase hex digits; ``""`` outside of any span.

    Inside :func:`start_span` there is always one, sampled or not, whatever the exporter.
    """
    context = get_current_span().get_span_context()
    return f"{context.trace_id:032x}" if context.is_valid else ""
