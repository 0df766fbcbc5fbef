"""``status_of`` (``serving/grpc_status.py``): the one place a Python error becomes a gRPC status.

Every riskserve error keeps its own status and message, also when Ray wrapped it in a ``RayTaskError``
on its way from another replica; Serve's back pressure is RESOURCE_EXHAUSTED, a timeout
DEADLINE_EXCEEDED, and anything unexpected INTERNAL naming only its class (never UNKNOWN, never the
message, which may carry data).
"""

from __future__ import annotations

import grpc
import pytest
from ray.exceptions import RayTaskError
from ray.serve.exceptions import BackPressureError

from riskserve.platform import errors
from riskserve.serving.grpc_status import status_of

EXPECTED = {
    errors.InvalidInput("amount: must be >= 0", field="amount"): grpc.StatusCode.INVALID_ARGUMENT,
    errors.ConfigError("bad pipeline"): grpc.StatusCode.INVALID_ARGUMENT,
    errors.NotFound("no such decision"): grpc.StatusCode.NOT_FOUND,
    errors.ModelLoadError("refused"): grpc.StatusCode.FAILED_PRECONDITION,
    errors.ArtifactIntegrityError("checksum"): grpc.StatusCode.FAILED_PRECONDITION,
    errors.ModelUnavailable("down"): grpc.StatusCode.UNAVAILABLE,
    errors.InlineBusy("busy"): grpc.StatusCode.UNAVAILABLE,
    errors.Overloaded("queue full"): grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.DeadlineExceeded("late"): grpc.StatusCode.DEADLINE_EXCEEDED,
    errors.Unauthenticated("no token"): grpc.StatusCode.UNAUTHENTICATED,
    errors.PermissionDenied("no role"): grpc.StatusCode.PERMISSION_DENIED,
    errors.Conflict("reused id"): grpc.StatusCode.ABORTED,
    errors.AlreadyExists("labelled"): grpc.StatusCode.ALREADY_EXISTS,
}


@pytest.mark.parametrize("error", list(EXPECTED), ids=lambda e: type(e).__name__)
def test_each_riskserve_error_keeps_its_status_and_message_also_through_ray(
    error: errors.RiskServeError,
) -> None:
    assert status_of(error) == (EXPECTED[error], str(error))
    wrapped = RayTaskError("PipelineIngress.decide", "Traceback ...", error)  # as from another replica
    assert status_of(wrapped) == (EXPECTED[error], str(error))


def test_back_pressure_timeout_and_the_unexpected_map_to_their_statuses() -> None:
    code, details = status_of(BackPressureError(num_queued_requests=9, max_queued_requests=8))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert details.startswith("overloaded: ")
    assert status_of(TimeoutError()) == (
        grpc.StatusCode.DEADLINE_EXCEEDED,
        "the decision did not finish in time",
    )
    secret = ValueError("card 4111 1111 1111 1111")
    assert status_of(secret) == (grpc.StatusCode.INTERNAL, "internal error (ValueError)")
    assert status_of(RayTaskError("f", "tb", secret)) == (
        grpc.StatusCode.INTERNAL,
        "internal error (ValueError)",
    )
