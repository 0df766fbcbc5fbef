"""Size caps on what a caller sends, checked at the front door before anything is decided or stored.

The message size cap (``max_receive_message_bytes``) bounds a call as a whole; these bound its parts, so an
id, a source or a text can never be larger than what logs, metrics and the feedback log are sized for.
A request over a cap is INVALID_ARGUMENT naming the field (``requests[3].request_id``); nothing is kept.
Health ``Watch`` streams never end on their own, so :class:`WatchLimitedHealth` caps them per client.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health_pb2
from grpc_health.v1.health import aio as health_aio

from riskserve.platform.errors import InvalidInput
from riskserve.proto.riskserve.v1 import risk_pipeline_pb2 as pb
from riskserve.schema.pipeline import FrontDoorSpec

__all__ = ["WatchLimitedHealth", "check_decide_requests", "check_feedback_request", "peer_host"]


def _cap(value: str, limit: int, field: str) -> None:
    if len(value) > limit:
        raise InvalidInput(f"{len(value)} characters, at most {limit} allowed", field=field)


def _within(request: pb.DecideRequest, limits: FrontDoorSpec) -> bool:
    """Whether every part of ``request`` is within its cap (the fast check; no field named). A request
    whose whole encoding fits in ``max_text_chars`` bytes holds no longer string: one C call decides it
    without visiting the map entries."""
    text_cap = limits.max_text_chars
    numeric, categorical = request.numeric, request.categorical
    if len(request.request_id) > limits.max_id_chars or len(numeric) + len(categorical) > limits.max_features:
        return False
    if request.ByteSize() <= text_cap:
        return True
    return (
        len(request.text) <= text_cap
        and all(len(name) <= text_cap for name in numeric)
        and all(len(name) <= text_cap and len(value) <= text_cap for name, value in categorical.items())
    )


def check_decide_requests(requests: Sequence[pb.DecideRequest], limits: FrontDoorSpec) -> None:
    """Refuse a batch over ``max_batch`` or a request with an over-long id, text or feature entry.

    Raises:
        InvalidInput: naming ``requests`` (count) or the request's field (``requests[i].text``).
    """
    count = len(requests)
    if not 0 < count <= limits.max_batch:
        raise InvalidInput(f"expected 1 to {limits.max_batch} requests, got {count}", field="requests")
    if all(_within(request, limits) for request in requests):
        return
    for i, request in enumerate(requests):  # something is over a cap: find it and name its field
        where = f"requests[{i}]." if count > 1 else ""
        _cap(request.request_id, limits.max_id_chars, f"{where}request_id")
        _cap(request.text, limits.max_text_chars, f"{where}text")
        entries = len(request.numeric) + len(request.categorical)
        if entries > limits.max_features:
            raise InvalidInput(
                f"{entries} numeric and categorical entries, at most {limits.max_features} allowed",
                field=f"{where}numeric",
            )
        for name in request.numeric:
            _cap(name, limits.max_text_chars, f"{where}numeric")
        for name, value in request.categorical.items():
            _cap(name, limits.max_text_chars, f"{where}categorical")
            _cap(value, limits.max_text_chars, f"{where}categorical.{name[:64]}")


def check_feedback_request(request: pb.FeedbackRequest, limits: FrontDoorSpec) -> None:
    """Refuse a label whose ids or source are over their caps.

    Raises:
        InvalidInput: naming ``request_id``, ``feedback_id`` or ``source``.
    """
    _cap(request.request_id, limits.max_id_chars, "request_id")
    _cap(request.feedback_id, limits.max_id_chars, "feedback_id")
    _cap(request.source, limits.max_source_chars, "source")


def peer_host(peer: str) -> str:
    """The client's address without its port, from a gRPC peer string (``ipv4:10.0.0.7:51234``)."""
    kind, _, rest = peer.partition(":")
    if kind == "ipv6":
        return rest.rsplit(":", 1)[0].strip("[]")
    if kind == "ipv4":
        return rest.rsplit(":", 1)[0]
    return peer


class WatchLimitedHealth(health_aio.HealthServicer):  # type: ignore[misc]
    """grpc's health servicer with at most ``per_client`` open ``Watch`` streams per client address."""

    def __init__(self, per_client: int, on_refused: Callable[[], None] | None = None) -> None:
        super().__init__()
        self._per_client = per_client
        self._on_refused = on_refused
        self._open: collections.Counter[str] = collections.Counter()

    def watching(self, host: str) -> int:
        """Open Watch streams of ``host`` now."""
        return self._open[host]

    async def Watch(self, request: health_pb2.HealthCheckRequest, context: Any) -> None:  # noqa: N802
        """The status of a service, sent now and at every change, until the client hangs up."""
        host = peer_host(context.peer() or "")
        if self._open[host] >= self._per_client:
            if self._on_refused is not None:
                self._on_refused()
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{self._per_client} health Watch streams are open from {host}; close one first",
            )
        self._open[host] += 1
        try:
            await super().Watch(request, context)
        finally:
            self._open[host] -= 1
            if self._open[host] <= 0:
                del self._open[host]
