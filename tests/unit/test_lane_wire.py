"""The lane's wire over a real loopback socket: answers matched to their calls however they interleave, a
caller's cancellation reaches the handler, a lost connection fails its waiting calls (so the ingress uses
the Serve handle) and the next call reconnects, a stopping lane finishes what it holds and refuses the
rest, and a frame that is not the lane's closes the connection."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from riskserve.proto.riskserve.internal.v1 import model_lane_pb2 as lane_pb
from riskserve.serving.lane_wire import (
    INTERNAL,
    MAX_FRAME_BYTES,
    UNAVAILABLE,
    LaneConnection,
    LaneConnectionLost,
    LaneServer,
)


def _texts(*texts: str) -> lane_pb.LaneRequest:
    return lane_pb.LaneRequest(texts=lane_pb.TextsCall(texts=texts))


Run = Callable[[Callable[[], Awaitable[None]]], None]
Handler = Callable[[lane_pb.LaneRequest], Awaitable[lane_pb.LaneResponse]]


@contextlib.asynccontextmanager
async def _lane(handler: Handler) -> AsyncIterator[tuple[LaneServer, LaneConnection, int]]:
    """A lane serving ``handler`` on a loopback port, a connection to it, and the port; both closed after."""
    server = LaneServer(handler)
    port = await server.start()
    connection = LaneConnection("127.0.0.1", port)
    try:
        yield server, connection, port
    finally:
        await connection.close()
        await server.stop(grace_s=1)


@pytest.fixture(params=["asyncio", "uvloop"])
def run(request: pytest.FixtureRequest) -> Run:
    """Runs a test's coroutine on asyncio's own loop, then on uvloop (the loop Serve runs replicas on)."""

    def on_loop(test: Callable[[], Awaitable[None]]) -> None:
        async def bounded() -> None:
            await asyncio.wait_for(test(), timeout=20)

        if request.param == "uvloop":
            import uvloop

            uvloop.run(bounded())
        else:
            asyncio.run(bounded())

    return on_loop


class _Echo:
    """Answers each text call with its texts as labels, after the delay the first text names (ms)."""

    def __init__(self) -> None:
        self.started: list[str] = []
        self.cancelled: list[str] = []
        self.release = asyncio.Event()

    async def __call__(self, request: lane_pb.LaneRequest) -> lane_pb.LaneResponse:
        texts = list(request.texts.texts)
        self.started.append(texts[0])
        try:
            if texts[0] == "hold":
                await self.release.wait()
            else:
                await asyncio.sleep(float(texts[0]) / 1e3)
        except asyncio.CancelledError:
            self.cancelled.append(texts[0])
            raise
        return lane_pb.LaneResponse(reply=lane_pb.ModelReply(model="echo", labels=texts, has_labels=True))


def test_answers_reach_their_own_callers_when_they_come_back_out_of_order(run: Run) -> None:
    async def test() -> None:
        async with _lane(_Echo()) as (_server, connection, _port):
            delays = ["40", "5", "25", "0", "15"] * 4
            responses = await asyncio.gather(
                *(connection.call(_texts(d, f"#{i}")) for i, d in enumerate(delays))
            )
            assert [list(r.reply.labels) for r in responses] == [[d, f"#{i}"] for i, d in enumerate(delays)]
            assert [r.code for r in responses] == [0] * len(delays)
            assert len({r.call for r in responses}) == len(delays)

    run(test)


def test_the_lane_listens_on_loopback_only(run: Run) -> None:
    async def test() -> None:
        async with _lane(_Echo()) as (server, _connection, port):
            assert server._server is not None
            bound = [s.getsockname()[:2] for s in server._server.sockets]
            assert bound == [("127.0.0.1", port)]  # one socket, never 0.0.0.0 or [::]

    run(test)


def test_a_cancelled_call_cancels_the_handler_and_the_connection_keeps_serving(run: Run) -> None:
    async def test() -> None:
        echo = _Echo()
        async with _lane(echo) as (server, connection, _port):
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0.05):
                    await connection.call(_texts("hold"))
            for _ in range(100):  # the cancel frame crosses the socket
                if echo.cancelled:
                    break
                await asyncio.sleep(0.01)
            assert echo.cancelled == ["hold"]
            assert server._calls == {}
            answer = await connection.call(_texts("1", "after"))
            assert list(answer.reply.labels) == ["1", "after"]

    run(test)


def test_ping_is_answered_while_a_model_call_is_running(run: Run) -> None:
    async def test() -> None:
        echo = _Echo()
        async with _lane(echo) as (_server, connection, _port):
            held = asyncio.create_task(connection.call(_texts("hold")))
            await asyncio.sleep(0.02)
            pong = await asyncio.wait_for(connection.call(lane_pb.LaneRequest(ping=lane_pb.Ping())), 1)
            assert (pong.code, pong.HasField("reply")) == (0, False)
            assert not held.done()
            echo.release.set()
            assert list((await held).reply.labels) == ["hold"]

    run(test)


def test_a_stopping_lane_finishes_its_calls_and_refuses_new_ones_without_a_verdict(run: Run) -> None:
    async def test() -> None:
        echo = _Echo()
        async with _lane(echo) as (server, connection, port):
            held = asyncio.create_task(connection.call(_texts("hold")))
            await asyncio.sleep(0.02)
            stopping = asyncio.create_task(server.stop(grace_s=5))
            await asyncio.sleep(0.02)
            refused = await connection.call(_texts("0", "late"))
            assert (refused.code, refused.verdict) == (UNAVAILABLE, False)
            assert not held.done()
            echo.release.set()
            assert list((await held).reply.labels) == ["hold"]  # the call in flight finished
            await stopping
            with pytest.raises(LaneConnectionLost):  # stopped: connections closed, the port no longer listens
                await connection.call(_texts("0"))
            with pytest.raises(LaneConnectionLost):
                await LaneConnection("127.0.0.1", port).call(_texts("0"))

    run(test)


def test_a_lost_connection_fails_its_waiting_calls_and_the_next_call_reconnects(run: Run) -> None:
    async def test() -> None:
        echo = _Echo()
        async with _lane(echo) as (_server, connection, _port):
            held = asyncio.create_task(connection.call(_texts("hold")))
            await asyncio.sleep(0.02)
            assert connection._frames is not None
            assert connection._frames.transport is not None
            connection._frames.transport.abort()  # the socket drops (a replica's process dies)
            with pytest.raises(LaneConnectionLost):
                await held
            for _ in range(100):  # the server saw the connection go and cancelled its call
                if echo.cancelled:
                    break
                await asyncio.sleep(0.01)
            assert echo.cancelled == ["hold"]
            again = await connection.call(_texts("0", "again"))
            assert list(again.reply.labels) == ["0", "again"]

    run(test)


@pytest.mark.parametrize(
    "garbage",
    [struct.pack("<I", MAX_FRAME_BYTES + 1), struct.pack("<I", 3) + b"\xff\xff\xff"],
    ids=["oversized frame", "unreadable frame"],
)
def test_a_frame_that_is_not_the_lanes_closes_the_connection(garbage: bytes, run: Run) -> None:
    async def test() -> None:
        echo = _Echo()
        async with _lane(echo) as (_server, _connection, port):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(garbage)
            await writer.drain()
            assert await asyncio.wait_for(reader.read(), 2) == b""  # closed by the lane, nothing answered
            writer.close()
            assert echo.started == []
            answer = await LaneConnection("127.0.0.1", port).call(_texts("0", "still serving"))
            assert list(answer.reply.labels) == ["0", "still serving"]

    run(test)


def test_a_lane_that_is_not_listening_fails_the_call_at_once(run: Run) -> None:
    async def test() -> None:
        with socket.socket() as placeholder:
            placeholder.bind(("127.0.0.1", 0))
            port = placeholder.getsockname()[1]  # bound, never listening: connections are refused
            with pytest.raises(LaneConnectionLost):
                await LaneConnection("127.0.0.1", port).call(_texts("0"))

    run(test)


def test_a_handler_that_raises_is_answered_internal_without_a_verdict(run: Run) -> None:
    async def broken(request: lane_pb.LaneRequest) -> lane_pb.LaneResponse:
        raise RuntimeError("a bug")

    async def test() -> None:
        async with _lane(broken) as (_server, connection, _port):
            answer = await connection.call(_texts("0"))
            assert (answer.code, answer.verdict) == (INTERNAL, False)  # the ingress falls back to the handle
            assert "a bug" in answer.details

    run(test)
