"""The model lane's transport alone: riskserve's framed protobuf (``serving/lane_wire.py``) against the
grpc.aio unary call the lane used before, same payload, same process layout.

One server process answers an intent model's reply (a ``ModelReply`` with a label and the label
probabilities as JSON) at once; the client process sends one text and its lane token, at concurrency 1
and 8, both on uvloop (what Serve runs replicas on). Per transport: p50 and p99 latency, calls/s, and
CPU-ms per call of both processes (``/proc`` and ``process_time``). Rounds alternate the two transports,
so drift on a shared machine touches both; the figures are the medians of the rounds.

Run under the heavy lock: ``/work/heavy .venv/bin/python bench/lane_transport.py``. Writes
``OUT/lane_transport.json`` and ``OUT/lane_transport.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import write_results
from bench._procs import sample_tree

REPO = Path(__file__).resolve().parents[1]
TRANSPORTS = ("grpc_aio", "lane_wire")
TEXT = "Please transfer the money right now, it is urgent, my account will be closed tomorrow"
TOKEN = "x" * 32
_REPLY = {
    "model": "intent",
    "version": "a802e6f8dee24afe",
    "scores": [0.91],
    "has_labels": True,
    "labels": ["urgent"],
    "latency_ms": 3.2,
    "extra_json": '{"probabilities": [0.91, 0.03, 0.02, 0.02, 0.02]}',
}
_SERVICE, _METHOD = "riskserve.internal.v1.ModelLane", "PredictTexts"


def log(message: str) -> None:
    print(f"[lane_transport {time.strftime('%H:%M:%S')}] {message}", flush=True)


# -- the two servers (each in its own process) -------------------------------------------------------------


def grpc_server(ports: Any) -> None:
    """The lane as it was: a grpc.aio server whose handler reads the call's metadata (the token)."""
    import grpc
    import uvloop

    from riskserve.proto.riskserve.internal.v1 import model_lane_pb2 as lane_pb

    async def predict(request: Any, context: Any) -> Any:
        dict(context.invocation_metadata())
        return lane_pb.ModelReply(**_REPLY)

    async def main() -> None:
        server = grpc.aio.server()
        handler = grpc.unary_unary_rpc_method_handler(
            predict,
            request_deserializer=lane_pb.TextsCall.FromString,
            response_serializer=lane_pb.ModelReply.SerializeToString,
        )
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(_SERVICE, {_METHOD: handler}),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        ports.put(port)
        await server.wait_for_termination()

    uvloop.run(main())


def wire_server(ports: Any) -> None:
    """The lane now: :class:`~riskserve.serving.lane_wire.LaneServer`."""
    import uvloop

    from riskserve.proto.riskserve.internal.v1 import model_lane_pb2 as lane_pb
    from riskserve.serving.lane_wire import LaneServer

    async def predict(request: Any) -> Any:
        return lane_pb.LaneResponse(reply=lane_pb.ModelReply(**_REPLY))

    async def main() -> None:
        server = LaneServer(predict)
        ports.put(await server.start())
        await asyncio.Event().wait()

    uvloop.run(main())


# -- the client ---------------------------------------------------------------------------------------------


async def _grpc_caller(port: int) -> Callable[[], Awaitable[Any]]:
    import grpc

    from riskserve.proto.riskserve.internal.v1 import model_lane_pb2 as lane_pb

    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    call = channel.unary_unary(
        f"/{_SERVICE}/{_METHOD}",
        request_serializer=lane_pb.TextsCall.SerializeToString,
        response_deserializer=lane_pb.ModelReply.FromString,
    )
    metadata = (("x-riskserve-lane-token", TOKEN),)

    async def one() -> Any:
        return await call(lane_pb.TextsCall(texts=[TEXT]), metadata=metadata)

    return one


async def _wire_caller(port: int) -> Callable[[], Awaitable[Any]]:
    from riskserve.proto.riskserve.internal.v1 import model_lane_pb2 as lane_pb
    from riskserve.serving.lane_wire import LaneConnection

    connection = LaneConnection("127.0.0.1", port)

    async def one() -> Any:
        request = lane_pb.LaneRequest(token=TOKEN, texts=lane_pb.TextsCall(texts=[TEXT]))
        response = await connection.call(request)
        return response.reply

    return one


async def _drive(transport: str, port: int, calls: int, concurrency: int) -> tuple[list[float], float]:
    one = await (_grpc_caller if transport == "grpc_aio" else _wire_caller)(port)
    for _ in range(300):  # warm-up
        reply = await one()
    assert list(reply.labels) == ["urgent"]
    latencies: list[float] = []

    async def worker(count: int) -> None:
        for _ in range(count):
            started = time.perf_counter()
            await one()
            latencies.append((time.perf_counter() - started) * 1e3)

    started = time.perf_counter()
    await asyncio.gather(*(worker(calls // concurrency) for _ in range(concurrency)))
    return latencies, time.perf_counter() - started


def measure(transport: str, concurrency: int, calls: int) -> dict[str, float]:
    """One server process and this process as the client: latency, rate and CPU per call of both."""
    import uvloop

    context = multiprocessing.get_context("spawn")
    ports = context.Queue()
    server = context.Process(target=grpc_server if transport == "grpc_aio" else wire_server, args=(ports,))
    server.start()
    try:
        port = ports.get(timeout=60)
        time.sleep(0.2)
        server_before, client_before = sample_tree(server.pid or 0), time.process_time()
        latencies, wall_s = uvloop.run(_drive(transport, port, calls, concurrency))
        server_after, client_after = sample_tree(server.pid or 0), time.process_time()
    finally:
        server.kill()
        server.join()
    cpu_s = (server_after.total_s - server_before.total_s) + (client_after - client_before)
    latencies.sort()
    return {
        "p50_ms": latencies[len(latencies) // 2],
        "p99_ms": latencies[int(len(latencies) * 0.99)],
        "calls_per_s": len(latencies) / wall_s,
        "cpu_ms_per_call": cpu_s * 1e3 / (len(latencies) + 300),  # the warm-up's calls are in the window
    }


def plot(out: Path, medians: dict[str, dict[str, dict[str, float]]]) -> Path:
    """p50 and CPU per call, the transports side by side at each concurrency (``out/lane_transport.png``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(9, 3.8))
    labels = list(medians[TRANSPORTS[0]])
    panels = (("p50_ms", "p50 round trip (ms)"), ("cpu_ms_per_call", "CPU-ms per call, both processes"))
    for axis, (metric, title) in zip(axes, panels, strict=True):
        for offset, transport in ((-0.2, TRANSPORTS[0]), (0.2, TRANSPORTS[1])):
            values = [medians[transport][label][metric] for label in labels]
            axis.bar([i + offset for i in range(len(labels))], values, width=0.4, label=transport)
        axis.set_xticks(range(len(labels)), labels)
        axis.set_title(title)
    axes[0].legend()
    figure.suptitle("The model lane's transport, same payload, loopback, uvloop")
    figure.tight_layout()
    path = out / "lane_transport.png"
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=3000, help="measured calls per run")
    parser.add_argument("--rounds", type=int, default=3, help="alternations of the two transports")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "out")
    args = parser.parse_args()
    runs: dict[str, dict[str, list[dict[str, float]]]] = {t: {"c=1": [], "c=8": []} for t in TRANSPORTS}
    for round_ in range(args.rounds):
        for concurrency in (1, 8):
            for transport in TRANSPORTS:
                run = measure(transport, concurrency, args.calls)
                runs[transport][f"c={concurrency}"].append(run)
                log(f"round {round_ + 1}/{args.rounds} {transport:<9} c={concurrency}: "
                    f"p50 {run['p50_ms']:.3f} ms, {run['calls_per_s']:,.0f} calls/s, "
                    f"{run['cpu_ms_per_call']:.3f} CPU-ms/call")  # fmt: skip
    medians = {
        transport: {
            label: {key: statistics.median(run[key] for run in rounds) for key in rounds[0]}
            for label, rounds in by_concurrency.items()
        }
        for transport, by_concurrency in runs.items()
    }
    ratios = {
        label: {
            key: medians["grpc_aio"][label][key] / medians["lane_wire"][label][key]
            for key in ("p50_ms", "cpu_ms_per_call")
        }
        for label in ("c=1", "c=8")
    }
    for label, ratio in ratios.items():
        print(
            f"{label}: grpc.aio / lane_wire p50 {ratio['p50_ms']:.1f}x, "
            f"CPU per call {ratio['cpu_ms_per_call']:.1f}x"
        )
    result = {
        "calls": args.calls,
        "rounds": args.rounds,
        "medians": medians,
        "grpc_over_wire": ratios,
        "runs": runs,
    }
    print(f"wrote {write_results(args.out, 'lane_transport', result)} and {plot(args.out, medians)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
