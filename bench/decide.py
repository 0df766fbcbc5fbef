"""End-to-end ``Decide`` latency and throughput of real pipelines, over each pipeline's gRPC front door.

Starts a local Ray (its own processes, bound to loopback; other clusters on the machine are left alone) and
Serve with the gRPC proxy, deploys ``tabular_only`` and ``card_fraud`` (vLLM intent model included) with the
demo models, then measures what a client sees, per pipeline, in one run:

  * sequential ``Decide``: p50 / p90 / p99 of ``--repeats`` calls after ``--warmup`` untimed ones;
  * ``DecideBatch`` of ``--batch`` requests: latency per call and decisions per second;
  * concurrent ``Decide`` from ``--threads`` client threads (one channel each), bounded by
    ``--concurrent-calls`` calls and ``--concurrent-seconds``: decisions per second and latency under load.

Ratios printed side by side (the machine is noisy, absolute numbers drift): card_fraud over tabular_only,
batch and concurrent throughput over sequential. Each answer's per-model ``latency_ms`` (measured by the
ingress around each model call) is summarised too, as a first split of where the time goes. Requests are
rows of :func:`riskserve.demo.dataset.generate_transactions`. The client runs on the same machine and
takes CPU from the server: on 2 cores that is part of the figures.

Run: ``.venv/bin/python bench/decide.py --models models`` (the demo models are built there if missing).
Writes ``bench/out/decide.json`` and ``bench/out/decide.png`` (latency CDF per pipeline). Extra Ray Serve
settings can be compared run against run with ``--serve-env RAY_SERVE_...=VALUE`` (set before Ray starts).
"""

from __future__ import annotations

import argparse
import copy
import os
import socket
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import save_figure, write_results

ROOT = Path(__file__).resolve().parents[1]
PIPELINES = ROOT / "deploy" / "pipelines"
NAMES = ("tabular_only", "card_fraud", "tabular_inline")
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    # tabular_only with its feature stage inside the ingress (serving.feature_stage: ingress): one Serve hop
    # fewer per decision. Its pool is declared larger so the three pipelines fit side by side.
    "tabular_inline": (
        "tabular_only",
        {"serving": {"feature_stage": "ingress"}, "pools": {"cpu": {"cpus": 3}}},
    ),
}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _percentile(ordered: Sequence[float], q: float) -> float:
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _stats_ms(samples: Sequence[float]) -> dict[str, float]:
    """p50 / p90 / p99 / mean / min / max of ``samples`` (seconds), in milliseconds."""
    ordered = sorted(s * 1e3 for s in samples)
    return {
        "p50_ms": statistics.median(ordered),
        "p90_ms": _percentile(ordered, 0.90),
        "p99_ms": _percentile(ordered, 0.99),
        "mean_ms": statistics.fmean(ordered),
        "min_ms": ordered[0],
        "max_ms": ordered[-1],
        "n": len(ordered),
    }


def _requests(name: str, count: int, seed: int) -> list[Any]:
    """``DecideRequest`` messages from generated transactions; text only for pipelines that read it."""
    from riskserve.demo.dataset import generate_transactions
    from riskserve.proto.riskserve.v1 import risk_pipeline_pb2 as pb

    tx = generate_transactions(count, seed=seed)
    out = []
    for i in range(count):
        fields = tx.request_fields(i, text=name == "card_fraud")
        out.append(pb.DecideRequest(request_id=f"{name}-{i}", **fields))
    return out


def _spec(name: str, models: Path) -> Any:
    """The shipped pipeline YAML with its artifacts pointed at ``models``."""
    import yaml

    from riskserve.schema.pipeline import parse_pipeline

    base, changes = VARIANTS.get(name, (name, {}))
    data = copy.deepcopy(yaml.safe_load((PIPELINES / f"{base}.yaml").read_text()))
    data.update(copy.deepcopy(changes))
    data["name"] = name
    for model_name, model in data["models"].items():
        model["artifact"] = str((models / model_name).resolve())
    return parse_pipeline(data, base_dir=PIPELINES, source=f"{name}.yaml")


def _start(specs: Sequence[Any], num_cpus: int | None) -> dict[str, str]:
    """Start a local Ray and Serve (no proxies), deploy ``specs``, each pipeline's ingress serving its own
    gRPC port; return each pipeline's ``HOST:PORT``."""
    import ray
    from ray import serve

    from riskserve.operations.app import build_application
    from riskserve.operations.local import pool_resources
    from riskserve.schema.endpoints import assign_endpoints, endpoint_of
    from riskserve.schema.pools import pool_demands

    needed = sum(demand.cpus for demand in pool_demands(list(specs)).values())
    ray.init(
        address="local",
        num_cpus=num_cpus or max(os.cpu_count() or 1, int(needed + 0.999)),
        resources=pool_resources(specs),
        include_dashboard=False,
        log_to_driver=False,
    )
    placed = assign_endpoints(list(specs), base_port=_free_port())
    serve.start(proxy_location="Disabled", http_options={"host": "127.0.0.1"})
    for spec in placed:
        started = time.perf_counter()
        serve.run(build_application(spec), name=spec.name, route_prefix=None)
        print(f"  deployed {spec.name} in {time.perf_counter() - started:.1f} s", flush=True)
    return {spec.name: endpoint_of(spec) for spec in placed}


def _stop() -> None:
    import ray
    from ray import serve

    serve.shutdown()  # type: ignore[no-untyped-call]
    ray.shutdown()


def _sequential(
    label: str,
    call: Callable[[int], object],
    warmup: int,
    repeats: int,
    progress: tqdm,  # type: ignore[type-arg]
) -> list[float]:
    """Wall-clock seconds of ``repeats`` calls after ``warmup`` untimed ones (call ``i`` sends request i)."""
    progress.set_postfix_str(label)
    for i in range(warmup):
        call(i)
        progress.update(1)
    samples = []
    for i in range(repeats):
        started = time.perf_counter()
        call(warmup + i)
        samples.append(time.perf_counter() - started)
        progress.update(1)
    return samples


def _concurrent(
    make_call: Callable[[], Callable[[int], object]],
    threads: int,
    limit: int,
    seconds: float,
    progress: tqdm,  # type: ignore[type-arg]
) -> tuple[list[float], float]:
    """``threads`` clients calling as fast as they can until ``limit`` calls or ``seconds`` have passed.

    Returns every call's latency and the wall time from the first call to the last answer.
    """
    lock = threading.Lock()
    issued = 0
    samples: list[float] = []
    errors: list[BaseException] = []
    deadline = time.perf_counter() + seconds
    barrier = threading.Barrier(threads + 1)

    def worker() -> None:
        nonlocal issued
        call = make_call()
        mine: list[float] = []
        barrier.wait()
        while time.perf_counter() < deadline:
            with lock:
                if issued >= limit:
                    break
                issued += 1
                index = issued
            started = time.perf_counter()
            try:
                call(index)
            except BaseException as error:  # report after the run, never hang the barrier
                errors.append(error)
                break
            mine.append(time.perf_counter() - started)
            progress.update(1)
        with lock:
            samples.extend(mine)

    pool = [threading.Thread(target=worker, daemon=True) for _ in range(threads)]
    for thread in pool:
        thread.start()
    barrier.wait()
    started = time.perf_counter()
    for thread in pool:
        thread.join()
    elapsed = time.perf_counter() - started
    if errors:
        raise RuntimeError(f"{len(errors)} concurrent call(s) failed, first: {errors[0]!r}") from errors[0]
    return samples, elapsed


def _measure(
    name: str,
    target: str,
    args: argparse.Namespace,
    progress: tqdm,  # type: ignore[type-arg]
) -> dict[str, Any]:
    import grpc

    from riskserve.proto.riskserve.v1 import risk_pipeline_pb2 as pb
    from riskserve.proto.riskserve.v1 import risk_pipeline_pb2_grpc as pb_grpc

    requests = _requests(name, 4096, seed=2026)
    metadata = (("application", name),)

    def decider(channel: grpc.Channel, answers: list[Any] | None = None) -> Callable[[int], object]:
        stub = pb_grpc.RiskPipelineStub(channel)  # type: ignore[no-untyped-call]

        def call(i: int) -> object:
            response = stub.Decide(requests[i % len(requests)], metadata=metadata, timeout=30)
            if answers is not None:
                answers.append(response)
            return response

        return call

    channel = grpc.insecure_channel(target)
    answers: list[Any] = []
    sequential = _sequential(f"{name} Decide", decider(channel, answers), args.warmup, args.repeats, progress)
    answers = answers[args.warmup :]
    per_model: dict[str, list[float]] = {}
    fallbacks = 0
    for response in answers:
        for model in response.models:
            per_model.setdefault(model.model, []).append(model.latency_ms)
            fallbacks += int(model.fallback)
    outcomes = {pb.Decision.Name(d): 0 for d in (pb.APPROVE, pb.REVIEW, pb.DECLINE)}
    for response in answers:
        outcomes[pb.Decision.Name(response.decision)] += 1

    stub = pb_grpc.RiskPipelineStub(channel)  # type: ignore[no-untyped-call]
    size = args.batch
    batches = [
        pb.DecideBatchRequest(requests=requests[i * size : (i + 1) * size])
        for i in range(len(requests) // size)
    ]

    def batch_call(i: int) -> object:
        response = stub.DecideBatch(batches[i % len(batches)], metadata=metadata, timeout=60)
        if len(response.responses) != size:
            raise RuntimeError(f"DecideBatch answered {len(response.responses)} of {size}")
        return response

    batch = _sequential(f"{name} DecideBatch({size})", batch_call, 3, args.batch_calls, progress)
    progress.set_postfix_str(f"{name} {args.threads} threads")
    channels: list[grpc.Channel] = []

    def make_call() -> Callable[[int], object]:
        own = grpc.insecure_channel(target)
        channels.append(own)
        return decider(own)

    concurrent, elapsed = _concurrent(
        make_call, args.threads, args.concurrent_calls, args.concurrent_seconds, progress
    )
    progress.update(args.concurrent_calls - len(concurrent))  # calls not made before the time bound
    for own in channels:
        own.close()
    channel.close()
    batch_stats = _stats_ms(batch)
    return {
        "sequential": {
            **_stats_ms(sequential),
            "decisions_per_s": 1e3 / statistics.median(s * 1e3 for s in sequential),
            "samples_ms": [s * 1e3 for s in sequential],
        },
        "model_latency_ms_in_ingress": {
            m: {"p50_ms": statistics.median(v), "p99_ms": _percentile(sorted(v), 0.99)}
            for m, v in per_model.items()
        },
        "fallbacks": fallbacks,
        "outcomes": outcomes,
        "batch": {
            **batch_stats,
            "size": size,
            "decisions_per_s": size * 1e3 / batch_stats["p50_ms"],
            "per_decision_ms": batch_stats["p50_ms"] / size,
        },
        "concurrent": {
            **_stats_ms(concurrent),
            "threads": args.threads,
            "calls": len(concurrent),
            "seconds": elapsed,
            "decisions_per_s": len(concurrent) / elapsed,
            "samples_ms": [s * 1e3 for s in concurrent],
        },
    }


def _print(results: dict[str, dict[str, Any]]) -> None:
    print("\nDecide over gRPC on loopback (ms; decisions/s)")
    print(
        f"{'pipeline':<14} | {'seq p50':>7} {'p90':>7} {'p99':>7} {'dec/s':>6} | "
        f"{'batch p50':>9} {'ms/dec':>6} {'dec/s':>6} | {'conc p50':>8} {'p99':>7} {'dec/s':>6}"
    )
    for name, r in results.items():
        s, b, c = r["sequential"], r["batch"], r["concurrent"]
        print(
            f"{name:<14} | {s['p50_ms']:>7.2f} {s['p90_ms']:>7.2f} {s['p99_ms']:>7.2f} "
            f"{s['decisions_per_s']:>6.0f} | {b['p50_ms']:>9.2f} {b['per_decision_ms']:>6.3f} "
            f"{b['decisions_per_s']:>6.0f} | {c['p50_ms']:>8.2f} {c['p99_ms']:>7.2f} "
            f"{c['decisions_per_s']:>6.0f}"
        )
    print("\nper-model call latency seen by the ingress, sequential (p50 / p99 ms):")
    for name, r in results.items():
        cells = ", ".join(
            f"{m} {v['p50_ms']:.2f} / {v['p99_ms']:.2f}" for m, v in r["model_latency_ms_in_ingress"].items()
        )
        print(f"  {name:<14} {cells}  (fallbacks: {r['fallbacks']})")
    print("\nratios:")
    for name, r in results.items():
        s, b, c = r["sequential"], r["batch"], r["concurrent"]
        print(
            f"  {name:<14} batch/sequential throughput {b['decisions_per_s'] / s['decisions_per_s']:.1f}x, "
            f"concurrent/sequential {c['decisions_per_s'] / s['decisions_per_s']:.2f}x, "
            f"p99/p50 {s['p99_ms'] / s['p50_ms']:.2f}"
        )
    for slow_name, fast_name in (("card_fraud", "tabular_only"), ("tabular_inline", "tabular_only")):
        if {slow_name, fast_name} <= set(results):
            slow, fast = results[slow_name]["sequential"], results[fast_name]["sequential"]
            print(
                f"  {slow_name} / {fast_name} sequential p50 {slow['p50_ms'] / fast['p50_ms']:.2f}x, "
                f"p99 {slow['p99_ms'] / fast['p99_ms']:.2f}x"
            )


def _plot(out_dir: Path, results: dict[str, dict[str, Any]]) -> Path:
    """Latency CDF per pipeline: sequential and concurrent calls, log-scaled milliseconds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    figure, axes = plt.subplots(1, 2, figsize=(11, 4.5), sharey=True)
    for axis, mode in zip(axes, ("sequential", "concurrent"), strict=True):
        for name, r in results.items():
            ordered = sorted(r[mode]["samples_ms"])
            fractions = [(i + 1) / len(ordered) for i in range(len(ordered))]
            label = f"{name} (p50 {r[mode]['p50_ms']:.1f} ms, p99 {r[mode]['p99_ms']:.1f} ms)"
            axis.step(ordered, fractions, where="post", label=label)
        title = "sequential Decide" if mode == "sequential" else "concurrent Decide"
        if mode == "concurrent":
            threads = next(iter(results.values()))["concurrent"]["threads"]
            title += f", {threads} client threads"
        axis.set_title(title)
        axis.set_xscale("log")
        axis.xaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
        axis.xaxis.set_minor_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
        axis.tick_params(axis="x", which="minor", labelsize=7)
        axis.set_xlabel("latency (ms)")
        axis.grid(True, which="both", alpha=0.3)
        axis.legend(fontsize=8, loc="lower right")
    axes[0].set_ylabel("fraction of calls")
    figure.suptitle("riskserve Decide over Ray Serve's gRPC proxy (loopback)")
    return save_figure(figure, out_dir, "decide")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", type=Path, default=Path("models"), help="demo models (built if missing)")
    parser.add_argument("--pipelines", nargs="+", choices=NAMES, default=list(NAMES))
    parser.add_argument("--repeats", type=int, default=500, help="timed sequential calls per pipeline")
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--batch", type=int, default=64, help="requests per DecideBatch")
    parser.add_argument("--batch-calls", type=int, default=40)
    parser.add_argument("--threads", type=int, default=8, help="concurrent client threads")
    parser.add_argument("--concurrent-calls", type=int, default=2000)
    parser.add_argument("--concurrent-seconds", type=float, default=20.0)
    parser.add_argument("--num-cpus", type=int, default=None, help="Ray's logical CPUs (default: enough)")
    parser.add_argument(
        "--serve-env", action="append", default=[], metavar="NAME=VALUE", help="set before Ray starts"
    )
    parser.add_argument("--out", type=Path, default=Path("bench/out"))
    args = parser.parse_args()

    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # Ray's processes on loopback
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    extra_env = dict(item.split("=", 1) for item in args.serve_env)
    os.environ.update(extra_env)

    from riskserve.demo.build import build_demo_models

    print(f"demo models in {args.models}")
    build_demo_models(args.models, only=("credit", "fraud", "intent"))
    specs = [_spec(name, args.models) for name in args.pipelines]
    load = os.getloadavg()
    print(f"starting Ray + Serve (load average {load[0]:.2f}) and deploying {', '.join(args.pipelines)} ...")
    started = time.perf_counter()
    endpoints = _start(specs, args.num_cpus)
    startup_s = time.perf_counter() - started
    per_pipeline = args.warmup + args.repeats + 3 + args.batch_calls + args.concurrent_calls
    results: dict[str, dict[str, Any]] = {}
    try:
        with tqdm(total=per_pipeline * len(specs), desc="calls", unit="call", mininterval=1.0) as progress:
            for spec in specs:
                results[spec.name] = _measure(spec.name, endpoints[spec.name], args, progress)
    finally:
        _stop()
    _print(results)
    import ray

    document = {
        "pipelines": results,
        "settings": {k: v for k, v in vars(args).items() if k not in {"models", "out"}}
        | {"models": str(args.models)},
        "serve_env": extra_env,
        "startup_s": startup_s,
        "load_average_at_start": load,
        "cpus": os.cpu_count(),
        "ray_version": ray.__version__,
    }
    json_path = write_results(args.out, "decide", document)
    png = _plot(args.out, results)
    print(f"\nresults: {json_path}\nplot:    {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
