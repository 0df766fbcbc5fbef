"""The one exception tree of riskserve; every class carries the gRPC status it maps to.

::

    RiskServeError                 INTERNAL
    ├── InvalidInput               INVALID_ARGUMENT   (names the offending field)
    ├── ConfigError                INVALID_ARGUMENT   (names the offending config path)
    ├── NotFound                   NOT_FOUND
    ├── ModelLoadError             FAILED_PRECONDITION
    │   └── ArtifactIntegrityError FAILED_PRECONDITION (checksum, truncation, tampering)
    ├── MissingExtra               FAILED_PRECONDITION (an optional backend is not installed)
    ├── ModelUnavailable           UNAVAILABLE        (not loaded yet, unloaded, or broken)
    │   └── InlineBusy             UNAVAILABLE        (inline predict refused: the engine is busy)
    ├── Overloaded                 RESOURCE_EXHAUSTED
    ├── DeadlineExceeded           DEADLINE_EXCEEDED
    ├── AlreadyExists              ALREADY_EXISTS     (a decision already has a label of another value)
    ├── Unauthenticated            UNAUTHENTICATED    (no or an unknown bearer token)
    ├── PermissionDenied           PERMISSION_DENIED  (a known caller without the method's role)
    └── Conflict                   ABORTED            (a concurrent operation already runs)

The gRPC layer turns any of them into ``context.abort(error.grpc_status, str(error))`` in one place.
"""

from __future__ import annotations

from typing import Any, ClassVar

import grpc

__all__ = [
    "AlreadyExists",
    "ArtifactIntegrityError",
    "ConfigError",
    "Conflict",
    "DeadlineExceeded",
    "InlineBusy",
    "InvalidInput",
    "MissingExtra",
    "ModelLoadError",
    "ModelUnavailable",
    "NotFound",
    "Overloaded",
    "PermissionDenied",
    "RiskServeError",
    "Unauthenticated",
]


class RiskServeError(Exception):
    """Root of every error riskserve raises on purpose."""

    grpc_status: ClassVar[grpc.StatusCode] = grpc.StatusCode.INTERNAL

    def __reduce__(self) -> tuple[Any, ...]:
        # Errors cross Ray process boundaries; rebuild without re-running __init__ so fields survive.
        return (_rebuild, (type(self), self.args, self.__dict__))


def _rebuild(cls: type[RiskServeError], args: tuple[Any, ...], state: dict[str, Any]) -> RiskServeError:
    error = cls.__new__(cls)
    error.args = args
    error.__dict__.update(state)
    return error


class InvalidInput(RiskServeError):
    """A request the caller must fix: it names the field (feature column, request field) at fault."""

    grpc_status = grpc.StatusCode.INVALID_ARGUMENT

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(f"{field}: {message}" if field else message)
        self.field = field


class ConfigError(RiskServeError):
    """A configuration (pipeline YAML, model settings) that cannot be used as written."""

    grpc_status = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(RiskServeError):
    """A named thing (pipeline, model, artifact, version) does not exist."""

    grpc_status = grpc.StatusCode.NOT_FOUND


class ModelLoadError(RiskServeError):
    """A model could not be loaded; the previous version (if any) keeps serving."""

    grpc_status = grpc.StatusCode.FAILED_PRECONDITION


class ArtifactIntegrityError(ModelLoadError):
    """An artifact file is missing, truncated or does not match its manifest checksum."""


class MissingExtra(RiskServeError, ImportError):
    """An optional backend is used but its extra is not installed; the message names the extra."""

    grpc_status = grpc.StatusCode.FAILED_PRECONDITION

    def __init__(self, backend: str, extra: str, module: str) -> None:
        super().__init__(
            f"the {backend} backend needs the '{module}' package: "
            f"install it with `pip install 'riskserve[{extra}]'`"
        )
        self.extra = extra


class ModelUnavailable(RiskServeError):
    """The model cannot answer now (not ready, unloaded, or failing); retrying later may succeed."""

    grpc_status = grpc.StatusCode.UNAVAILABLE


class InlineBusy(ModelUnavailable):
    """An inline predict would wait for an engine another thread holds; the caller takes a worker thread
    instead of blocking its event loop (never reaches a client)."""


class Overloaded(RiskServeError):
    """Too many requests are queued; the caller should back off."""

    grpc_status = grpc.StatusCode.RESOURCE_EXHAUSTED


class DeadlineExceeded(RiskServeError):
    """The caller's deadline passed before an answer was ready."""

    grpc_status = grpc.StatusCode.DEADLINE_EXCEEDED


class Unauthenticated(RiskServeError):
    """The call carries no credentials or unknown ones."""

    grpc_status = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(RiskServeError):
    """The caller is known but may not do this (a role it lacks, an identity not its own)."""

    grpc_status = grpc.StatusCode.PERMISSION_DENIED


class Conflict(RiskServeError):
    """Another operation on the same object is already running (for example two swaps at once)."""

    grpc_status = grpc.StatusCode.ABORTED


class AlreadyExists(RiskServeError):
    """The thing a call would create exists already with another value (a second, different label for
    one decision); retrying cannot succeed, so it is not ``ABORTED``."""

    grpc_status = grpc.StatusCode.ALREADY_EXISTS
