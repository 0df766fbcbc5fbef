"""The direct lane: an ingress calls a model replica on its own node over a loopback socket, not a Serve hop.

A Serve handle call costs about 6 ms on a 2-core machine (router, two event loops, a Ray task each way);
the intent LLM's own work is about 4 ms. So each model replica also serves its model on a loopback port
of its own (the lane, framed protobuf: :mod:`~riskserve.serving.lane_wire`) and announces it in Ray's
key-value store, and every ingress replica calls the lanes of the replicas on its node directly. The
Serve handle stays the path for the rest: replicas on other nodes, a matrix shared through the object
store, a lane that fails (the call is then made through the handle), and every operator call (status,
swap, verify).

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
from riskserve.serving.frontdoor import Admission
from riskserve.serving.grpc_status import status_of
from riskserve.serving.lane_wire import LaneConnection, LaneConnectionLost, LaneServer
from riskserve.serving.model_replica import ModelReplica

__all__ = ["LaneAddress", "LaneDown", "LaneUse", "LanedModelReplica", "Lanes"]

logger = logging.getLogger(__name__)

KV_NAMESPACE = "riskserve"
"""Ray key-value namespace of the lanes' announcements."""
DOWN_FOR_S = 5.0
"""How long a lane that failed is left alone before it is tried again."""
PROBE_TIMEOUT_S = 0.5
"""A lane whose ping does not answer in this time is put aside until one does (a hung replica:
its process and sockets are alive, so only an answer tells; Serve replaces it only after its own checks)."""
_TRACE_HEADERS = ("traceparent", "tracestate")
_NO_DEADLINE_S = 60.0


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


class _LaneHandler:
    """Answers one lane request with the replica's own handler: same span, batching and checks."""

    def __init__(self, replica: ModelReplica, token: str, admission: Admission) -> None:
        self._replica = replica
        self._token = token.encode()
        self._admission = admission

    async def __call__(self, request: lane_pb.LaneRequest) -> lane_pb.LaneResponse:
        if not hmac.compare_digest(request.token.encode(), self._token):
            return lane_pb.LaneResponse(
                code=grpc.StatusCode.UNAUTHENTICATED.value[0], details="no valid lane token"
            )
        trace = {key: value for key, value in request.trace.items() if key in _TRACE_HEADERS}
        deadline = time.monotonic() + _NO_DEADLINE_S  # a caller that gives up cancels the call instead
        try:
            async with self._admission.slot(deadline):
                if request.WhichOneof("body") == "texts":
                    answer = await self._replica.predict_texts(list(request.texts.texts), trace)
                else:
                    answer = await self._replica.predict_features(_matrix_of(request.features), trace)
        except Exception as error:
            code, details = status_of(error)
            field = getattr(error, "field", None)
            return lane_pb.LaneResponse(
                code=code.value[0], details=details, verdict=True, field=str(field or "")
            )
        return lane_pb.LaneResponse(reply=_reply_of(answer))


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
        handler = _LaneHandler(self, self._lane_token, Admission(limits["ongoing"], limits["queued"]))
        self._lane_server = LaneServer(handler)
        self._lane_port: int = await self._lane_server.start("127.0.0.1", 0)
        self._lane_key: str | None = None
        if self._runner.ready:
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
        await self._lane_server.stop(grace_s=5.0)
        await super().__del__()


# -- the ingress's side ------------------------------------------------------------------------------------


@dataclass(eq=False)
class _Lane:
    address: LaneAddress
    connection: LaneConnection
    in_flight: int = 0
    down_until: float = 0.0
    alive: bool = True
    """Whether its last ping was answered (:meth:`Lanes.probe`); a lane that is not is skipped."""


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
            await self._lanes.pop(replica).connection.close()
        for replica, address in announced.items():
            known = self._lanes.get(replica)
            if known is not None and known.address == address:
                continue
            if known is not None:
                await known.connection.close()
            self._lanes[replica] = _Lane(address, LaneConnection(address.host, address.port))

    async def probe(self) -> int:
        """Ping every lane at once (``PROBE_TIMEOUT_S``); a lane that does not answer is
        skipped by calls until it answers again. Returns the lanes alive."""

        async def check(lane: _Lane) -> None:
            try:
                async with asyncio.timeout(PROBE_TIMEOUT_S):
                    await lane.connection.call(lane_pb.LaneRequest(ping=lane_pb.Ping()))
            except (LaneConnectionLost, TimeoutError) as error:
                if lane.alive:
                    logger.warning("lane %s is not answering (%s): put aside", lane.address.target,
                                   type(error).__name__)  # fmt: skip
                lane.alive = False
            else:
                lane.alive = True

        lanes = list(self._lanes.values())
        await asyncio.gather(*(check(lane) for lane in lanes))
        return sum(lane.alive for lane in lanes)

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
            if lane.alive and lane.down_until <= now and (best is None or lane.in_flight < best.in_flight):
                best = lane
        return best

    async def predict_texts(self, texts: Sequence[str], trace: dict[str, str]) -> ModelAnswer:
        """Label ``texts`` through the least busy lane.

        Raises:
            LaneDown: no lane took the call (use the Serve handle).
            InvalidInput | Overloaded | ModelUnavailable | TimeoutError: the model's own verdict.
        """
        request = lane_pb.LaneRequest(texts=lane_pb.TextsCall(texts=texts))
        return await self._call(request, trace)

    async def predict_features(self, matrix: FeatureMatrix, trace: dict[str, str]) -> ModelAnswer:
        """Score a matrix sent by value through the least busy lane (errors as :meth:`predict_texts`)."""
        values = np.ascontiguousarray(matrix, dtype="<f4")
        call = lane_pb.FeaturesCall(rows=values.shape[0], columns=values.shape[1], values=values.tobytes())
        return await self._call(lane_pb.LaneRequest(features=call), trace)

    async def _call(self, request: lane_pb.LaneRequest, trace: dict[str, str]) -> ModelAnswer:
        lane = self._pick()
        if lane is None:
            raise LaneDown("no lane on this node")
        request.token = lane.address.token
        if trace:
            request.trace.update(trace)
        lane.in_flight += 1
        try:
            response = await lane.connection.call(request)
        except LaneConnectionLost as error:
            lane.down_until = time.monotonic() + DOWN_FOR_S
            raise LaneDown(str(error)) from error
        finally:
            lane.in_flight -= 1
        if response.code != 0:
            raise _error_of(response, lane)
        return _answer_of(response.reply)


_CODES = {code.value[0]: code for code in grpc.StatusCode}


def _error_of(response: lane_pb.LaneResponse, lane: _Lane) -> Exception:
    """The platform error a lane's status stands for; a lane that did not take the call is put aside."""
    code, details = _CODES.get(response.code, grpc.StatusCode.UNKNOWN), response.details
    if not response.verdict:  # the lane itself refused: wrong token, stopping
        lane.down_until = time.monotonic() + DOWN_FOR_S
        return LaneDown(f"lane {lane.address.target}: {code.name} {details}")
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        field = response.field
        prefix = f"{field}: "
        message = details[len(prefix) :] if field and details.startswith(prefix) else details
        return InvalidInput(message, field=field or None)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return Overloaded(details)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return TimeoutError(details)
    return ModelUnavailable(f"{code.name}: {details}")
