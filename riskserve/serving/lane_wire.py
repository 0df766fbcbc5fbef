"""The lane's wire: length-prefixed protobuf frames over one loopback TCP connection, calls interleaved.

A grpc.aio unary call between two processes costs about 1 ms on this project's 2-core machine (p50,
loopback, trivial handler), most of it Python in grpc's event-loop integration on both sides; a frame
each way on an asyncio protocol costs about 0.3 ms. The lane carries one kind of caller (riskserve's own
ingress), so it needs no more than this: a call number to match answers, a status in gRPC's codes, the
caller's cancellation, and a ping for liveness.

A frame is a 4-byte little-endian length and a serialized ``LaneRequest`` (to the replica) or
``LaneResponse`` (back). A frame longer than :data:`MAX_FRAME_BYTES` or one that does not parse ends the
connection: the peer is not a riskserve lane.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import struct
from collections.abc import Awaitable, Callable
from typing import Any, cast

import grpc

from riskserve.proto.riskserve.internal.v1 import model_lane_pb2 as lane_pb

__all__ = ["MAX_FRAME_BYTES", "LaneConnection", "LaneConnectionLost", "LaneServer"]

logger = logging.getLogger(__name__)

MAX_FRAME_BYTES = 64 * 1024 * 1024
"""The largest frame either side accepts (a matrix of 1,000 rows x 16k float32 columns)."""
UNAVAILABLE: int = grpc.StatusCode.UNAVAILABLE.value[0]
"""What a stopping lane answers (without a verdict: the caller uses the handle)."""
INTERNAL: int = grpc.StatusCode.INTERNAL.value[0]
"""What a handler that raised instead of answering gets (without a verdict, as UNAVAILABLE)."""
_LENGTH = struct.Struct("<I")


class LaneConnectionLost(Exception):
    """The connection closed or could not open; calls on it did not get an answer."""


class _Frames(asyncio.Protocol):
    """Cuts the byte stream into frames and hands each one, still serialized, to ``on_frame``."""

    def __init__(
        self, on_frame: Callable[[bytes], None], on_lost: Callable[[Exception | None], None]
    ) -> None:
        self._on_frame = on_frame
        self._on_lost = on_lost
        self._buffer = bytearray()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # asyncio's or uvloop's (Serve runs replicas on uvloop, whose transports are not subclasses); both
        # set TCP_NODELAY, so a frame leaves at once
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        buffer = self._buffer
        buffer += data
        start = 0
        end = len(buffer)
        while end - start >= 4:
            (size,) = _LENGTH.unpack_from(buffer, start)
            if size > MAX_FRAME_BYTES:
                logger.warning("lane frame of %d bytes refused: closing the connection", size)
                self.close()
                return
            if end - start - 4 < size:
                break
            frame = bytes(buffer[start + 4 : start + 4 + size])
            start += 4 + size
            self._on_frame(frame)
        if start:
            del buffer[:start]

    def send(self, message: Any) -> bool:
        """Write one message as a frame; False if the connection is closed."""
        transport = self.transport
        if transport is None or transport.is_closing():
            return False
        body = message.SerializeToString()
        transport.write(_LENGTH.pack(len(body)) + body)
        return True

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self._on_lost(exc)


# -- the model replica's side ------------------------------------------------------------------------------

Handler = Callable[[lane_pb.LaneRequest], Awaitable[lane_pb.LaneResponse]]


class LaneServer:
    """Listens on a loopback port and answers each request with ``handler``'s response, as a task of its own
    (so a slow model call does not hold the calls behind it); pings are answered at once."""

    def __init__(self, handler: Handler) -> None:
        self._handler = handler
        self._server: asyncio.Server | None = None
        self._calls: dict[tuple[int, int], asyncio.Task[None]] = {}
        self._connections: set[_Frames] = set()
        self._stopping = False
        self._ids = itertools.count()

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """Listen on ``host:port`` (0: a port the kernel picks); returns the port."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(self._connection, host, port, reuse_port=False)
        return int(self._server.sockets[0].getsockname()[1])

    def _connection(self) -> _Frames:
        connection_id = next(self._ids)
        frames: _Frames

        def on_frame(frame: bytes) -> None:
            try:
                request = lane_pb.LaneRequest.FromString(frame)
            except Exception:  # not a lane request: whoever this is, it is not riskserve's ingress
                logger.warning("unreadable lane frame: closing the connection")
                frames.close()
                return
            self._take(connection_id, frames, request)

        def on_lost(exc: Exception | None) -> None:
            self._connections.discard(frames)
            for (owner, _), task in list(self._calls.items()):
                if owner == connection_id:  # nobody waits for the answer any more
                    task.cancel()

        frames = _Frames(on_frame, on_lost)
        self._connections.add(frames)
        return frames

    def _take(self, connection_id: int, frames: _Frames, request: lane_pb.LaneRequest) -> None:
        kind = request.WhichOneof("body")
        key = (connection_id, request.call)
        if kind == "cancel":
            task = self._calls.get(key)
            if task is not None:
                task.cancel()
            return
        if kind == "ping":
            frames.send(lane_pb.LaneResponse(call=request.call))
            return
        if self._stopping:
            frames.send(
                lane_pb.LaneResponse(call=request.call, code=UNAVAILABLE, details="the lane is stopping")
            )
            return
        self._calls[key] = asyncio.get_running_loop().create_task(self._answer(key, frames, request))

    async def _answer(self, key: tuple[int, int], frames: _Frames, request: lane_pb.LaneRequest) -> None:
        try:
            response = await self._handler(request)
        except asyncio.CancelledError:
            return  # the caller cancelled or went away: it reads no answer
        except Exception as error:  # the handler gives statuses; this is a bug of the lane's own
            logger.exception("lane handler failed")
            response = lane_pb.LaneResponse(code=INTERNAL, details=f"lane handler failed: {error!r}")
        finally:
            self._calls.pop(key, None)
        response.call = request.call
        frames.send(response)

    async def stop(self, grace_s: float) -> None:
        """Take no new calls (they are answered UNAVAILABLE, and the callers use the handle), let the calls
        in flight finish for up to ``grace_s``, then cancel the rest and close every connection."""
        self._stopping = True
        if self._server is not None:
            self._server.close()
        calls = list(self._calls.values())
        if calls:
            _, pending = await asyncio.wait(calls, timeout=grace_s)
            for task in pending:
                task.cancel()
        for frames in list(self._connections):
            frames.close()


# -- the ingress's side ------------------------------------------------------------------------------------


class LaneConnection:
    """One connection to a lane, opened on first use and again after it is lost; any number of concurrent
    calls share it."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self._frames: _Frames | None = None
        self._opening: asyncio.Future[_Frames] | None = None
        self._waiting: dict[int, asyncio.Future[lane_pb.LaneResponse]] = {}
        self._ids = itertools.count(1)

    async def call(self, request: lane_pb.LaneRequest) -> lane_pb.LaneResponse:
        """Send ``request`` (its ``call`` number is set here) and wait for its response; a cancelled wait
        tells the replica to stop the call.

        Raises:
            LaneConnectionLost: the connection could not open or closed before the answer came.
        """
        frames = self._frames if self._frames is not None else await self._open()
        number = next(self._ids)
        request.call = number
        answer: asyncio.Future[lane_pb.LaneResponse] = asyncio.get_running_loop().create_future()
        self._waiting[number] = answer
        if not frames.send(request):
            self._waiting.pop(number, None)
            raise LaneConnectionLost(f"lane {self.host}:{self.port}: the connection is closed")
        try:
            return await answer
        except asyncio.CancelledError:
            if self._waiting.pop(number, None) is not None:
                frames.send(lane_pb.LaneRequest(call=number, cancel=lane_pb.Cancel()))
            raise
        finally:
            self._waiting.pop(number, None)

    async def _open(self) -> _Frames:
        if self._opening is None:  # one connect for every caller that arrives while it is under way
            self._opening = asyncio.ensure_future(self._connect())
        opening = self._opening
        try:
            return await asyncio.shield(opening)
        finally:
            if opening.done():
                self._opening = None

    async def _connect(self) -> _Frames:
        loop = asyncio.get_running_loop()
        frames = _Frames(self._on_frame, lambda exc: self._on_lost(frames, exc))
        try:
            await loop.create_connection(lambda: frames, self.host, self.port)
        except OSError as error:
            raise LaneConnectionLost(f"lane {self.host}:{self.port}: {error}") from error
        self._frames = frames
        return frames

    def _on_frame(self, frame: bytes) -> None:
        try:
            response = lane_pb.LaneResponse.FromString(frame)
        except Exception:
            logger.warning("unreadable frame from lane %s:%d: closing the connection", self.host, self.port)
            if self._frames is not None:
                self._frames.close()
            return
        waiter = self._waiting.pop(response.call, None)
        if waiter is not None and not waiter.done():
            waiter.set_result(response)

    def _on_lost(self, frames: _Frames, exc: Exception | None) -> None:
        if frames is not self._frames:  # an earlier connection, closed on purpose: its calls have ended
            return
        self._frames = None
        waiting, self._waiting = self._waiting, {}
        for waiter in waiting.values():
            if not waiter.done():
                waiter.set_exception(
                    LaneConnectionLost(f"lane {self.host}:{self.port}: connection lost ({exc})")
                )

    async def close(self) -> None:
        """Close the connection (calls waiting on it fail with :class:`LaneConnectionLost`)."""
        frames, self._frames = self._frames, None
        if frames is not None:
            frames.close()
            waiting, self._waiting = self._waiting, {}
            for waiter in waiting.values():
                if not waiter.done():
                    waiter.set_exception(LaneConnectionLost(f"lane {self.host}:{self.port}: closed"))
