"""Caller identity on the gRPC front door: a server interceptor that checks bearer tokens and roles.

Every method of ``riskserve.v1.RiskPipeline`` needs ``authorization: Bearer <token>``: none or an unknown
token is UNAUTHENTICATED, a known token without the method's role PERMISSION_DENIED (a method not in
:data:`METHOD_ROLES` is refused to everyone). Health (``grpc.health.v1``) and server reflection stay open:
they tell nothing about decisions and a load balancer's probe has no token.

The caller reaches the handler through :func:`current_caller` (a context variable set around the handler,
in the handler's own task); :func:`label_source` turns it into the ``source`` of a label.
"""

from __future__ import annotations

import contextvars
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from riskserve.platform.errors import PermissionDenied, Unauthenticated
from riskserve.serving.tokens import Caller, Role, TokenStore

__all__ = ["METHOD_ROLES", "AuthInterceptor", "current_caller", "label_source"]

SERVICE_PREFIX = "/riskserve.v1.RiskPipeline/"
METHOD_ROLES: dict[str, Role] = {
    "Decide": "decide",
    "DecideBatch": "decide",
    "Describe": "decide",
    "Feedback": "feedback",
}
"""The role each RPC needs."""

_CALLER: contextvars.ContextVar[Caller | None] = contextvars.ContextVar("riskserve_caller", default=None)


def current_caller() -> Caller | None:
    """The authenticated caller of the RPC being served, or ``None`` when the front door has no tokens."""
    return _CALLER.get()


def label_source(requested: str, caller: Caller | None) -> str:
    """The ``source`` a label is recorded and rate limited under.

    Without tokens it is the request's field. With tokens it is the caller's identity: the field may be
    empty or that identity, never another one (a caller cannot label, or spend rate, as someone else).

    Raises:
        PermissionDenied: ``requested`` names another identity (field ``source``).
    """
    if caller is None:
        return requested
    if requested and requested != caller.identity:
        raise PermissionDenied(
            f"source: '{requested}' is not this caller's identity '{caller.identity}' "
            "(leave source empty: it is taken from the token)"
        )
    return caller.identity


def _bearer(metadata: Any) -> str | None:
    for key, value in metadata or ():
        if key == "authorization":
            text = value.decode("ascii", "replace") if isinstance(value, bytes) else str(value)
            scheme, _, token = text.partition(" ")
            return token.strip() if scheme.lower() == "bearer" and token.strip() else ""
    return None


def authenticate(store: TokenStore, method: str, metadata: Any) -> Caller:
    """The caller of ``method`` (its short name) by its metadata.

    Raises:
        Unauthenticated: no bearer token, or not a known one.
        PermissionDenied: the token lacks the method's role.
    """
    token = _bearer(metadata)
    if token is None:
        raise Unauthenticated("missing credentials: send the metadata 'authorization: Bearer <token>'")
    caller = store.lookup(token) if token else None
    if caller is None:
        raise Unauthenticated("invalid bearer token")
    role = METHOD_ROLES.get(method)
    if role is None or role not in caller.roles:
        raise PermissionDenied(
            f"'{caller.identity}' may not call {method} (it needs the role '{role or 'none'}'; "
            f"the token has {sorted(caller.roles)})"
        )
    return caller


class AuthInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Wraps every ``riskserve.v1.RiskPipeline`` handler with the token and role check."""

    def __init__(self, store: TokenStore, on_refused: Callable[[str, str], None] | None = None) -> None:
        """``on_refused(method, status_name)`` is told of each refusal (metrics)."""
        self._store = store
        self._on_refused = on_refused
        self._wrapped: dict[str, grpc.RpcMethodHandler] = {}

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        method_path: str = details.method
        wrapped = self._wrapped.get(method_path)  # the service's handlers never change: wrap each once
        if wrapped is not None:
            return wrapped
        handler = await continuation(details)
        if handler is None or not method_path.startswith(SERVICE_PREFIX):
            return handler  # health, reflection, unknown methods (UNIMPLEMENTED)
        wrapped = self._wrap(handler, method_path.removeprefix(SERVICE_PREFIX))
        self._wrapped[method_path] = wrapped
        return wrapped

    def _wrap(self, handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        if handler.request_streaming or handler.response_streaming:
            raise TypeError(f"{method}: only unary RPCs are wrapped")  # the service has no streams
        behavior = handler.unary_unary
        store, on_refused = self._store, self._on_refused

        async def checked(request: Any, context: Any) -> Any:
            try:
                caller = authenticate(store, method, context.invocation_metadata())
            except (Unauthenticated, PermissionDenied) as error:
                if on_refused is not None:
                    on_refused(method, error.grpc_status.name)
                await context.abort(error.grpc_status, str(error))
            token = _CALLER.set(caller)
            try:
                return await behavior(request, context)
            finally:
                _CALLER.reset(token)

        return grpc.unary_unary_rpc_method_handler(
            checked,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )
