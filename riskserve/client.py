"""``RiskClient``: call a riskserve pipeline over gRPC from a program, with riskserve's typed errors.

with RiskClient("127.0.0.1:9000", pipeline="card_fraud") as client:
    response = client.decide(numeric={"amount": 42.0, ...}, categorical={...}, text="...")

Against a front door with TLS and tokens: ``RiskClient(target, pipeline=..., ca_file=..., token=...)`` (and
``cert_file``/``key_file`` for mutual TLS).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import grpc

from riskserve.platform import errors
from riskserve.platform.tls import channel_credentials
from riskserve.proto.riskserve.v1 import risk_pipeline_pb2 as pb
from riskserve.proto.riskserve.v1 import risk_pipeline_pb2_grpc as pb_grpc

__all__ = ["RiskClient", "reason_lines", "split_fields"]

_BY_STATUS: dict[grpc.StatusCode, type[errors.RiskServeError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: errors.InvalidInput,
    grpc.StatusCode.NOT_FOUND: errors.NotFound,
    grpc.StatusCode.FAILED_PRECONDITION: errors.ModelLoadError,
    grpc.StatusCode.UNAVAILABLE: errors.ModelUnavailable,
    grpc.StatusCode.RESOURCE_EXHAUSTED: errors.Overloaded,
    grpc.StatusCode.DEADLINE_EXCEEDED: errors.DeadlineExceeded,
    grpc.StatusCode.ABORTED: errors.Conflict,
    grpc.StatusCode.ALREADY_EXISTS: errors.AlreadyExists,
    grpc.StatusCode.UNAUTHENTICATED: errors.Unauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: errors.PermissionDenied,
}


def _raise(error: grpc.RpcError) -> errors.RiskServeError:
    code = error.code()
    cls = _BY_STATUS.get(code, errors.RiskServeError)
    details = error.details() or code.name
    if cls is errors.InvalidInput and ": " in details:
        field, message = details.split(": ", 1)
        return errors.InvalidInput(message, field=field)
    return cls(details)


def split_fields(fields: Mapping[str, Any]) -> pb.DecideRequest:
    """A ``DecideRequest`` from flat fields: numbers are numeric, strings categorical, ``text`` the text.

    ``request_id`` is taken as the request id. Booleans are refused (send 0/1).
    """
    request = pb.DecideRequest()
    for name, value in fields.items():
        if name == "request_id":
            request.request_id = str(value)
        elif name == "text":
            request.text = str(value)
        elif isinstance(value, bool):
            raise errors.InvalidInput("booleans are not features; send 0 or 1", field=name)
        elif isinstance(value, int | float):
            request.numeric[name] = float(value)
        elif isinstance(value, str):
            request.categorical[name] = value
        else:
            raise errors.InvalidInput(f"unsupported value of type {type(value).__name__}", field=name)
    return request


def reason_lines(response: pb.DecideResponse) -> list[str]:
    """A decision's reason codes as lines a person reads, strongest first (empty when it has none).

    The contribution is in the named model's log-odds (the text model's: its label's probability).
    """
    return [
        f"{rank}. {r.text} ({r.field}={r.value}): {r.contribution:+.2f} {r.model}"
        for rank, r in enumerate(response.top_reasons, start=1)
    ]


class RiskClient:
    """A gRPC client of one pipeline; errors come back as riskserve exceptions with the server's message."""

    def __init__(
        self,
        target: str,
        *,
        pipeline: str,
        timeout_s: float = 10.0,
        ca_file: Path | None = None,
        cert_file: Path | None = None,
        key_file: Path | None = None,
        token: str | None = None,
        server_name: str | None = None,
    ) -> None:
        """Plain text unless ``ca_file`` (or a client certificate) is given: then TLS, trusting ``ca_file``
        (the system's roots when only a certificate is given) and presenting ``cert_file``/``key_file``.
        ``token`` is sent as ``authorization: Bearer``; ``server_name`` overrides the name the server's
        certificate is checked against (default: the target's host).

        Raises:
            ConfigError: a TLS file is missing or not PEM, or only one of ``cert_file``/``key_file``.
        """
        self.pipeline = pipeline
        self.timeout_s = timeout_s
        if ca_file is None and cert_file is None and key_file is None:
            self._channel = grpc.insecure_channel(target)
        else:
            options = [("grpc.ssl_target_name_override", server_name)] if server_name else []
            credentials = channel_credentials(ca_file, cert_file, key_file)
            self._channel = grpc.secure_channel(target, credentials, options=options)
        self._stub = pb_grpc.RiskPipelineStub(self._channel)  # type: ignore[no-untyped-call]
        metadata: tuple[tuple[str, str], ...] = (("application", pipeline),)
        self.authenticated = bool(token)
        """Whether calls carry a bearer token (the server then takes a label's source from it)."""
        if token:
            metadata += (("authorization", f"Bearer {token}"),)
        self._metadata = metadata

    def __enter__(self) -> RiskClient:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        """Close the channel."""
        self._channel.close()

    def _call(
        self, method: Any, request: Any, timeout_s: float | None, metadata: Sequence[tuple[str, str]]
    ) -> Any:
        """Call with a gRPC deadline and the same budget in ``riskserve-timeout-ms`` metadata.

        The server honours the gRPC deadline itself; the metadata carries the same budget for proxies
        in between that drop deadlines.
        """
        timeout = timeout_s or self.timeout_s
        budget = (("riskserve-timeout-ms", f"{timeout * 1e3:.0f}"),)
        try:
            return method(request, metadata=self._metadata + budget + tuple(metadata), timeout=timeout)
        except grpc.RpcError as error:
            raise _raise(error) from error

    def decide(
        self,
        *,
        numeric: Mapping[str, float] | None = None,
        categorical: Mapping[str, str] | None = None,
        text: str = "",
        request_id: str = "",
        timeout_s: float | None = None,
        metadata: Sequence[tuple[str, str]] = (),
    ) -> pb.DecideResponse:
        """One decision."""
        request = pb.DecideRequest(
            request_id=request_id, numeric=dict(numeric or {}), categorical=dict(categorical or {}), text=text
        )
        return self.decide_request(request, timeout_s=timeout_s, metadata=metadata)

    def decide_request(
        self,
        request: pb.DecideRequest,
        *,
        timeout_s: float | None = None,
        metadata: Sequence[tuple[str, str]] = (),
    ) -> pb.DecideResponse:
        """One decision from a ready ``DecideRequest``."""
        response: pb.DecideResponse = self._call(self._stub.Decide, request, timeout_s, metadata)
        return response

    def decide_batch(
        self, requests: Sequence[pb.DecideRequest], *, timeout_s: float | None = None
    ) -> list[pb.DecideResponse]:
        """Many decisions in one call, answered in the same order."""
        response = self._call(self._stub.DecideBatch, pb.DecideBatchRequest(requests=requests), timeout_s, ())
        return list(response.responses)

    def describe(self, *, timeout_s: float | None = None) -> pb.DescribeResponse:
        """The pipeline's features and models with their serving versions."""
        response: pb.DescribeResponse = self._call(self._stub.Describe, pb.DescribeRequest(), timeout_s, ())
        return response

    def feedback(
        self,
        *,
        request_id: str = "",
        label: int,
        feedback_id: str,
        source: str = "",
        decision_id: str = "",
        timeout_s: float | None = None,
    ) -> pb.FeedbackResponse:
        """Report the true outcome of a past decision; returns once the label is durable.

        Name the decision by ``decision_id`` (``DecideResponse.decision_id``) or, if only one decision
        was made for it, by ``request_id``.

        Safe to retry with the same ``feedback_id`` (the answer then says ``duplicate``).
        """
        request = pb.FeedbackRequest(
            request_id=request_id,
            label=label,
            feedback_id=feedback_id,
            source=source,
            decision_id=decision_id,
        )
        response: pb.FeedbackResponse = self._call(self._stub.Feedback, request, timeout_s, ())
        return response
