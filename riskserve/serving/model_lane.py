"""The direct lane: an ingress calls a model replica on its own node over loopback gRPC, not a Serve hop.

A Serve handle call costs about 6 ms on a 2-core machine (router, two event loops, a Ray task each way);
the intent LLM's own work is about 4 ms. So each model replica also serves its model on a loopback gRPC
port of its own (the lane) and announces it in Ray's key-value store, and every ingress replica calls
the lanes of the replicas on its node directly, with the decision's deadline. The Serve handle stays the
path for the rest: replicas on other nodes, a matrix shared through the object store, a lane that fails
(the call is then made through the handle), and every operator call (status, swap, verify).

A lane binds 127.0.0.1 on a port the kernel picks and answers only calls that carry its random token,
which only Ray's key-value store holds. It admits as many calls as Serve would (``max_ongoing`` +
``max_queued``), refusing the rest with RESOURCE_EXHAUSTED, which the guarded call turns into the
OVERLOADED fallback.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np
import ray
from pydantic import BaseModel as _Schema
from pydantic import ConfigDict
from ray import serve
from ray.experimental import internal_kv

from riskserve.platform.errors import InvalidInput, ModelUnavailable, Overloaded
from riskserve.platform.runner import ModelAnswer
from riskserve.platform.validation import FeatureMatrix
from riskserve.proto.riskserve.internal.v1 import model_lane_pb2 as lane_pb
from riskserve.proto.riskserve.internal.v1 import model_lane_pb2_grpc as lane_grpc
from riskserve.serving.frontdoor import Admission
from riskserve.serving.grpc_status import status_of
from riskserve.serving.model_replica import ModelReplica

__all__ = ["LaneAddress", "LaneDown", "LaneUse", "LanedModelReplica", "Lanes"]

logger = logging.getLogger(__name__)

KV_NAMESPACE = "riskserve"
"""Ray key-value namespace of the lanes' announcements."""
TOKEN_HEADER = "x-riskserve-lane-token"
FIELD_HEADER = "x-riskserve-field"
"""Trailing metadata naming the field of an INVALID_ARGUMENT, so the ingress re-raises the same error."""
VERDICT_HEADER = "x-riskserve-verdict"
"""Trailing metadata on a status the model (not the transport) gave: UNAVAILABLE then means the model is
unavailable, not that the lane is down."""
DOWN_FOR_S = 5.0
"""How long a lane that failed is left alone before it is tried again."""
_TRACE_HEADERS = ("traceparent", "tracestate")
_MAX_MESSAGE_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class LaneUse:
    """How an ingress replica reaches one remote model: lanes held, calls by lane and by Serve handle."""

    lanes: int
    lane_calls: int
    handle_calls: int


class LaneDown(Exception):
    """The lane did not take the call (not listening, wrong token, shutting down): use the handle."""


class LaneAddress(_Schema):
    """What a model replica announces: where its lane listens and the token it wants."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    replica: str
    node_id: str
    host: str
    port: int
    pid: int
    token: str

    @property
    def target(self) -> str:
        return f"{self.host}:{self.port}"


def _prefix(app: str, deployment: str) -> str:
    return f"lane/{app}/{deployment}/"


# -- the model replica's side ------------------------------------------------------------------------------


class _LaneService(lane_grpc.ModelLaneServicer):
    """The lane's two RPCs, each the replica's own handler: same span, batching and checks."""

    def __init__(self, replica: ModelReplica, token: str, admission: Admission) -> None:
        self._replica = replica
        self._token = token.encode()
        self._admission = admission

    async def PredictTexts(self, request: lane_pb.TextsCall, context: Any) -> lane_pb.ModelReply:  # noqa: N802
        texts = list(request.texts)
        return await self._answer(context, lambda trace: self._replica.predict_texts(texts, trace))

    async def PredictFeatures(self, request: lane_pb.FeaturesCall, context: Any) -> lane_pb.ModelReply:  # noqa: N802
        def call(trace: dict[str, str]) -> Any:
            matrix = _matrix_of(request)
            return self._replica.predict_features(matrix, trace)

        return await self._answer(context, call)

    async def _answer(self, context: Any, call: Any) -> lane_pb.ModelReply:
        metadata = dict(context.invocation_metadata())
        given = str(metadata.get(TOKEN_HEADER, "")).encode()
        if not hmac.compare_digest(given, self._token):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "no valid lane token")
        trace = {key: str(metadata[key]) for key in _TRACE_HEADERS if key in metadata}
        remaining = context.time_remaining()
        deadline = time.monotonic() + (remaining if remaining is not None else 60.0)
        try:
            async with self._admission.slot(deadline):
                answer: ModelAnswer = await call(trace)
        except Exception as error:
            code, details = status_of(error)
            field = getattr(error, "field", None)
            trailing = ((VERDICT_HEADER, "model"), *(((FIELD_HEADER, str(field)),) if field else ()))
            context.set_trailing_metadata(trailing)
            await context.abort(code, details)
        return _reply_of(answer)


def _matrix_of(request: lane_pb.FeaturesCall) -> FeatureMatrix:
    expected = int(request.rows) * int(request.columns) * 4
    if len(request.values) != expected:
        raise InvalidInput(
            f"{len(request.values)} bytes for {request.rows} x {request.columns} float32", field="features"
        )
    flat = np.frombuffer(request.values, dtype="<f4")
    return flat.reshape(int(request.rows), int(request.columns))


def _reply_of(answer: ModelAnswer) -> lane_pb.ModelReply:
    return lane_pb.ModelReply(
        model=answer.model,
        version=answer.version,
        scores=[float(s) for s in answer.scores],
        has_labels=answer.labels is not None,
        labels=list(answer.labels or ()),
        latency_ms=answer.latency_ms,
        extra_json=json.dumps(answer.extra, default=str) if answer.extra else "",
    )


def _answer_of(reply: lane_pb.ModelReply) -> ModelAnswer:
    return ModelAnswer(
        model=reply.model,
        version=reply.version,
        scores=list(reply.scores),
        labels=list(reply.labels) if reply.has_labels else None,
        latency_ms=reply.latency_ms,
        extra=json.loads(reply.extra_json) if reply.extra_json else {},
    )


class LanedModelReplica(ModelReplica):
    """A model replica that also serves its model on a loopback lane and announces it once it is ready."""

    async def __init__(  # type: ignore[misc]
        self, *args: Any, lane: dict[str, int] | None = None, **kwargs: Any
    ) -> None:
        """``lane``: ``{"ongoing": N, "queued": M}``, the deployment's Serve limits (see the module)."""
        await super().__init__(*args, **kwargs)
        limits = lane or {"ongoing": 16, "queued": 64}
        self._lane_token = secrets.token_urlsafe(24)
        self._lane_server = grpc.aio.server(
            options=[
                ("grpc.so_reuseport", 0),
                ("grpc.max_receive_message_length", _MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", _MAX_MESSAGE_BYTES),
            ]
        )
        service = _LaneService(self, self._lane_token, Admission(limits["ongoing"], limits["queued"]))
        lane_grpc.add_ModelLaneServicer_to_server(service, self._lane_server)  # type: ignore[no-untyped-call]
        self._lane_port: int = self._lane_server.add_insecure_port("127.0.0.1:0")
        await self._lane_server.start()
        self._lane_key: str | None = None
        if self._runner.ready:
            await self._announce()

    async def reconfigure(self, config: dict[str, Any]) -> None:
        await super().reconfigure(config)
        if self._lane_key is None and self._runner.ready:
            await self._announce()

    async def _announce(self) -> None:
        context = serve.get_replica_context()
        deployment = context.replica_id.deployment_id
        address = LaneAddress(
            replica=context.replica_id.unique_id,
            node_id=ray.get_runtime_context().get_node_id(),
            host="127.0.0.1",
            port=self._lane_port,
            pid=os.getpid(),
            token=self._lane_token,
        )
        key = _prefix(deployment.app_name, deployment.name) + address.replica
        await asyncio.to_thread(
            internal_kv._internal_kv_put, key, address.model_dump_json(), True, namespace=KV_NAMESPACE
        )
        self._lane_key = key

    def lane_port(self) -> int:
        """The loopback port of this replica's lane (tests)."""
        return self._lane_port

    async def __del__(self) -> None:
        """Withdraw the lane (ingresses fall back to the handle), finish its calls, then unload."""
        key, self._lane_key = self._lane_key, None
        if key is not None:
            try:
                await asyncio.to_thread(internal_kv._internal_kv_del, key, namespace=KV_NAMESPACE)
            except Exception:  # Ray may be going down with us; the ingress also drops dead lanes
                logger.warning("could not withdraw lane %s", key, exc_info=True)
        await self._lane_server.stop(grace=5.0)
        await super().__del__()


# -- the ingress's side ------------------------------------------------------------------------------------


@dataclass(eq=False)
class _Lane:
    address: LaneAddress
    channel: grpc.aio.Channel
    stub: lane_grpc.ModelLaneStub
    in_flight: int = 0
    down_until: float = 0.0


class Lanes:
    """The lanes of one model deployment's replicas on this node, refreshed from Ray's key-value store."""

    def __init__(self, app: str, deployment: str) -> None:
        self._prefix = _prefix(app, deployment)
        self._node_id = ray.get_runtime_context().get_node_id()
        self._lanes: dict[str, _Lane] = {}

    def __len__(self) -> int:
        return len(self._lanes)

    async def refresh(self) -> None:
        """Open lanes newly announced on this node, close withdrawn ones, forget dead replicas' lanes."""
        announced = await asyncio.to_thread(self._read)
        for replica in set(self._lanes) - set(announced):
            await self._lanes.pop(replica).channel.close()
        for replica, address in announced.items():
            known = self._lanes.get(replica)
            if known is not None and known.address == address:
                continue
            if known is not None:
                await known.channel.close()
            channel = grpc.aio.insecure_channel(
                address.target,
                options=[
                    ("grpc.max_receive_message_length", _MAX_MESSAGE_BYTES),
                    ("grpc.max_send_message_length", _MAX_MESSAGE_BYTES),
                ],
            )
            stub = lane_grpc.ModelLaneStub(channel)  # type: ignore[no-untyped-call]
            self._lanes[replica] = _Lane(address, channel, stub)

    def _read(self) -> dict[str, LaneAddress]:
        """Lanes announced on this node whose process still runs (a killed replica cannot withdraw)."""
        found: dict[str, LaneAddress] = {}
        for key in internal_kv._internal_kv_list(self._prefix, namespace=KV_NAMESPACE):
            value = internal_kv._internal_kv_get(key, namespace=KV_NAMESPACE)
            if value is None:
                continue
            address = LaneAddress.model_validate_json(value)
            if address.node_id != self._node_id:
                continue
            if not os.path.exists(f"/proc/{address.pid}"):
                internal_kv._internal_kv_del(key, namespace=KV_NAMESPACE)
                continue
            found[address.replica] = address
        return found

    def _pick(self) -> _Lane | None:
        now = time.monotonic()
        best: _Lane | None = None
        for lane in self._lanes.values():
            if lane.down_until <= now and (best is None or lane.in_flight < best.in_flight):
                best = lane
        return best

    async def predict_texts(self, texts: Sequence[str], trace: dict[str, str]) -> ModelAnswer:
        """Label ``texts`` through the least busy lane.

        Raises:
            LaneDown: no lane took the call (use the Serve handle).
            InvalidInput | Overloaded | ModelUnavailable | TimeoutError: the model's own verdict.
        """
        call = lane_pb.TextsCall(texts=texts)
        return await self._call(lambda stub, md: stub.PredictTexts(call, metadata=md), trace)

    async def predict_features(self, matrix: FeatureMatrix, trace: dict[str, str]) -> ModelAnswer:
        """Score a matrix sent by value through the least busy lane (errors as :meth:`predict_texts`)."""
        values = np.ascontiguousarray(matrix, dtype="<f4")
        call = lane_pb.FeaturesCall(rows=values.shape[0], columns=values.shape[1], values=values.tobytes())
        return await self._call(lambda stub, md: stub.PredictFeatures(call, metadata=md), trace)

    async def _call(self, send: Any, trace: dict[str, str]) -> ModelAnswer:
        lane = self._pick()
        if lane is None:
            raise LaneDown("no lane on this node")
        metadata = ((TOKEN_HEADER, lane.address.token), *trace.items())
        lane.in_flight += 1
        try:
            reply = await send(lane.stub, metadata)
        except grpc.aio.AioRpcError as error:
            raise _error_of(error, lane) from error
        finally:
            lane.in_flight -= 1
        return _answer_of(reply)


def _error_of(error: grpc.aio.AioRpcError, lane: _Lane) -> Exception:
    """The platform error a lane's status stands for; a lane that did not take the call is put aside."""
    code, details = error.code(), str(error.details() or "")
    trailing = dict(error.trailing_metadata() or ())
    if VERDICT_HEADER not in trailing:  # the lane itself failed: not listening, wrong token, stopping
        lane.down_until = time.monotonic() + DOWN_FOR_S
        return LaneDown(f"lane {lane.address.target}: {code.name} {details}")
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        field = trailing.get(FIELD_HEADER)
        prefix = f"{field}: "
        message = details[len(prefix) :] if field and details.startswith(prefix) else details
        return InvalidInput(message, field=str(field) if field else None)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return Overloaded(details)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return TimeoutError(details)
    return ModelUnavailable(f"{code.name}: {details}")
