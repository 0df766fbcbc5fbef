"""The one place where a Python error becomes a gRPC status: riskserve errors map by their class.

Ray Serve's gRPC proxy turns an exception raised in the ingress into INTERNAL with a Ray traceback, so the
ingress catches everything and sets the code and details on the context itself. Nothing becomes UNKNOWN.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import grpc

from riskserve.platform.errors import Overloaded, RiskServeError

__all__ = ["set_status", "status_of"]

logger = logging.getLogger(__name__)


def _unwrap(error: BaseException) -> BaseException:
    """Ray wraps errors raised in another replica (``RayTaskError``); the cause is what we mapped."""
    cause = getattr(error, "cause", None)
    return cause if isinstance(cause, BaseException) else error


def _back_pressure(error: BaseException) -> bool:
    """Whether ``error`` is Serve's ``BackPressureError``, without importing Ray: importing this module
    must not import Ray (the CLI sets Ray's environment before Ray is imported, see
    ``operations.local.connected``), and without Ray loaded no such error can exist."""
    module = sys.modules.get("ray.serve.exceptions")
    return module is not None and isinstance(error, module.BackPressureError)


def status_of(error: BaseException) -> tuple[grpc.StatusCode, str]:
    """The gRPC status and details for an error raised while serving a call."""
    error = _unwrap(error)
    if isinstance(error, RiskServeError):
        return error.grpc_status, str(error)
    if _back_pressure(error):  # a deployment's queue is full (max_queued_requests)
        return Overloaded.grpc_status, f"overloaded: {error}"
    if isinstance(error, TimeoutError):
        return grpc.StatusCode.DEADLINE_EXCEEDED, "the decision did not finish in time"
    logger.exception("unexpected error while serving a call", exc_info=error)
    return grpc.StatusCode.INTERNAL, f"internal error ({type(error).__name__})"


def set_status(context: Any, error: BaseException) -> None:
    """Set ``error``'s status on a gRPC servicer context (the caller then returns an empty response)."""
    code, details = status_of(error)
    context.set_code(code)
    context.set_details(details)
