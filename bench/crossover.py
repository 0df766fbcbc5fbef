"""By value or through the object store: where a feature matrix sent to a model deployment should switch.

riskserve sends a model in its own Serve deployment the feature matrix by value up to
``serving.by_value_rows`` rows and, above that, ``ray.put``s it once and passes a boxed ref
(:class:`riskserve.platform.shared_matrix.SharedMatrix`, a frozen dataclass holding the ``ObjectRef`` so
Serve passes it unresolved) that the model replica awaits. This measures both for a float32 matrix of 22
columns, sent from a caller deployment to a model deployment on the same node (one local Ray), for
1 .. 16384 rows, timed in the caller per call:

  * ``by value``: ``await handle.predict.remote(matrix)``;
  * ``object store``: ``ray.put(matrix)`` + ``await handle.predict.remote(SharedMatrix(ref, ...))``, the
    model replica doing ``await shared.ref`` (what one remote model costs the ingress);
  * and its two parts: ``ray.put`` alone, and the call with an already-put ref (what each further model
    reading the same batch costs, since the ingress puts a batch once for all its remote models).

The model reads every value (``float(array.sum())``) on both paths, so a zero-copy read from shared memory
pays its page faults where it would in a real model. After the timed calls, one call per path asks the model
where the array it received lives (its ``/proc/self/maps`` mapping, as ``InputInfo`` records it): Ray
inlines task arguments up to 100 KiB and puts larger ones in the object store itself, so "by value" above
~1160 rows of 22 float32 already arrives from the shared-memory file. At the end, the object store's
bytes and objects still held once every ref is dropped are read (``memory_summary``): ~0 unless refs were
pinned, which Ray does to an ``ObjectRef`` pickled out of band (as Serve's gRPC transport pickles the
box). The two paths alternate call by call (ABBA), so drift on a busy machine hits both alike. The
crossover is the row count where the object store's median (put + call) drops below by value's,
interpolated on a log scale between the measured sizes.

Run: ``.venv/bin/python bench/crossover.py`` (about a minute; ``--quick`` for a smoke run;
``--serve-env RAY_SERVE_THROUGHPUT_OPTIMIZED=1 --name crossover-throughput`` to measure under a Serve
setting, set before Ray is imported). Writes ``bench/out/crossover.json`` and ``bench/out/crossover.png``
(``NAME.*`` with ``--name``).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import write_results

ROOT = Path(__file__).resolve().parents[1]
ROWS = (1, 16, 64, 256, 1024, 4096, 16384)
COLUMNS = 22
PATHS = ("value", "store", "store_call", "put")
LABELS = {
    "value": "by value",
    "store": "object store: put + call",
    "store_call": "object store: call with a ref already put",
    "put": "ray.put alone",
}


def log(message: str) -> None:
    """One progress line on stderr."""
    print(f"[crossover {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def deploy() -> Any:
    """Start Serve (no proxy) on the running Ray and deploy the caller and the model; the caller's handle."""
    from ray import serve
    from ray.serve.handle import DeploymentHandle

    from riskserve.platform.shared_matrix import InputInfo, SharedMatrix

    @serve.deployment(max_ongoing_requests=64, ray_actor_options={"num_cpus": 0.25})
    class Model:
        """A model replica's input handling (as ``ModelReplica.predict_features``), a trivial model."""

        async def predict(self, matrix: Any) -> tuple[int, float]:
            array = await matrix.ref if isinstance(matrix, SharedMatrix) else matrix
            return int(array.shape[0]), float(array.sum())

        async def where(self, matrix: Any) -> dict[str, Any]:
            """Where the received array's bytes live (the object store's shared file, or private memory)."""
            array = await matrix.ref if isinstance(matrix, SharedMatrix) else matrix
            info = InputInfo.of(array, copied_for_columns=False)
            return {"mapping": info.mapping or "(anonymous)", "read_only": info.read_only}

    @serve.deployment(max_ongoing_requests=64, ray_actor_options={"num_cpus": 0.25})
    class Sender:
        """The ingress's side: builds the matrix, sends it one way or the other, times each call."""

        def __init__(self, model: DeploymentHandle[Any]) -> None:
            self._model = model

        async def measure(self, rows: int, calls: int, warmup: int) -> dict[str, Any]:
            """``calls`` of each path, alternating ABBA; seconds per call (and per part of the store path),
            and where the model found the bytes on each path."""
            import uuid

            import numpy as np
            import ray

            matrix = np.random.default_rng(rows).random((rows, COLUMNS), dtype=np.float32)
            columns = tuple(f"c{i}" for i in range(COLUMNS))
            expected = (rows, float(matrix.sum()))
            samples: dict[str, list[float]] = {path: [] for path in PATHS}

            async def by_value() -> None:
                started = time.perf_counter()
                answer = await self._model.predict.remote(matrix)
                samples["value"].append(time.perf_counter() - started)
                assert answer == expected, (answer, expected)

            async def by_store() -> None:
                started = time.perf_counter()
                ref = ray.put(matrix)
                put = time.perf_counter()
                shared = SharedMatrix(ref=ref, rows=rows, columns=columns, batch_id=uuid.uuid4().hex)
                answer = await self._model.predict.remote(shared)
                done = time.perf_counter()
                samples["store"].append(done - started)
                samples["put"].append(put - started)
                samples["store_call"].append(done - put)
                assert answer == expected, (answer, expected)

            order = (by_value, by_store, by_store, by_value)
            for i in range(warmup + calls):
                if i == warmup:
                    for series in samples.values():
                        series.clear()
                await order[(2 * i) % 4]()
                await order[(2 * i + 1) % 4]()
            ref = ray.put(matrix)
            shared = SharedMatrix(ref=ref, rows=rows, columns=columns, batch_id=uuid.uuid4().hex)
            received = {
                "value": await self._model.where.remote(matrix),
                "store": await self._model.where.remote(shared),
            }
            return {"samples": samples, "received": received}

    app = Sender.bind(Model.bind())  # type: ignore[attr-defined]
    return serve.run(app, name="crossover", route_prefix=None)


async def measure_all(
    handle: Any, calls: int, warmup: int
) -> tuple[dict[int, dict[str, dict[str, float]]], dict[int, dict[str, Any]]]:
    """Each row count in turn: both paths' summaries, and where the model found the bytes."""
    points: dict[int, dict[str, dict[str, float]]] = {}
    received: dict[int, dict[str, Any]] = {}
    for rows in ROWS:
        measured = await handle.measure.remote(rows, calls, warmup)
        points[rows] = {path: summarize(measured["samples"][path]) for path in PATHS}
        received[rows] = measured["received"]
        log(
            f"{rows:>5} rows: by value {points[rows]['value']['median_us']:.0f} µs, "
            f"object store {points[rows]['store']['median_us']:.0f} µs"
        )
    return points, received


def store_in_use(settle_s: float = 3.0) -> dict[str, Any]:
    """Bytes and objects still in the object store once every ref of the run is dropped (after
    ``settle_s``): ~0 unless refs were pinned (an ``ObjectRef`` pickled out of band is pinned for the
    life of the worker that pickled it)."""
    import gc
    import re

    import ray
    from ray._private.internal_api import memory_summary

    gc.collect()
    time.sleep(settle_s)
    address = ray.get_runtime_context().gcs_address  # this run's Ray (others may run on the machine)
    text = memory_summary(address=address, stats_only=True)  # type: ignore[no-untyped-call]
    match = re.search(r"Plasma memory usage (\d+) MiB, (\d+) objects", text)
    if match is None:
        return {"summary": text.strip()[:500]}
    return {"mib": int(match.group(1)), "objects": int(match.group(2))}


def summarize(samples: Sequence[float]) -> dict[str, float]:
    """Median, p90 and p99 in microseconds."""
    ordered = sorted(samples)

    def pick(q: float) -> float:
        return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] * 1e6

    return {"median_us": statistics.median(ordered) * 1e6, "p90_us": pick(0.9), "p99_us": pick(0.99)}


def crossover(points: dict[int, dict[str, dict[str, float]]]) -> dict[str, Any]:
    """Where the object store's median (put + call) first drops below by value's, interpolated in
    log(rows) on log(store / value); ``None`` when it never does in the measured range."""
    rows = sorted(points)
    logs = [math.log(points[r]["store"]["median_us"] / points[r]["value"]["median_us"]) for r in rows]
    for k, (r, gap) in enumerate(zip(rows, logs, strict=True)):
        if gap < 0:
            if k == 0:
                return {"rows": float(r), "note": f"the object store is already faster at {r} rows"}
            r0, g0 = rows[k - 1], logs[k - 1]
            t = g0 / (g0 - gap)
            at = math.exp(math.log(r0) + t * (math.log(r) - math.log(r0)))
            return {"rows": at, "between": [r0, r], "note": f"between {r0} and {r} rows"}
    return {"rows": None, "note": f"by value stays faster up to {rows[-1]} rows"}


def print_table(points: dict[int, dict[str, dict[str, float]]], cross: dict[str, Any]) -> None:
    """Medians per row count, both paths and the store path's parts, and the ratio store / value."""
    print("\nfloat32 matrix of 22 columns, caller deployment -> model deployment (same node), median µs")
    header = (
        f"{'rows':>6} {'KiB':>7} | {'by value':>9} {'p99':>8} | {'put+call':>9} {'p99':>8} | "
        f"{'put':>7} {'call w/ ref':>11} | {'store/value':>11}"
    )
    print(header)
    print("-" * len(header))
    for rows, point in sorted(points.items()):
        value, store = point["value"], point["store"]
        kib = rows * COLUMNS * 4 / 1024
        print(
            f"{rows:>6} {kib:>7.1f} | {value['median_us']:>9.0f} {value['p99_us']:>8.0f} | "
            f"{store['median_us']:>9.0f} {store['p99_us']:>8.0f} | {point['put']['median_us']:>7.0f} "
            f"{point['store_call']['median_us']:>11.0f} | {store['median_us'] / value['median_us']:>10.2f}x"
        )
    rows_at = cross["rows"]
    where = f"~{rows_at:.0f} rows" if rows_at is not None else "none"
    print(f"\ncrossover (object store's put + call faster than by value): {where} ({cross['note']})")
    shared = cross.get("shared_by_two")
    if shared is not None:
        rows_two = shared["rows"]
        where = f"~{rows_two:.0f} rows" if rows_two is not None else "none"
        print(
            f"estimate for two remote models sharing one put (half the put each): {where} ({shared['note']})"
        )


def plot(
    out_dir: Path,
    name: str,
    points: dict[int, dict[str, dict[str, float]]],
    cross: dict[str, Any],
    serve_env: dict[str, str],
) -> Path:
    """Median latency against rows, log-log, one line per path, the crossover marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sorted(points)
    figure, axis = plt.subplots(figsize=(8, 5))
    styles = {"value": "-", "store": "-", "store_call": "--", "put": ":"}
    for path in PATHS:
        axis.plot(
            rows, [points[r][path]["median_us"] for r in rows], styles[path], marker="o", label=LABELS[path]
        )
    if cross["rows"] is not None:
        axis.axvline(cross["rows"], color="grey", alpha=0.6)
        axis.annotate(
            f"crossover ~{cross['rows']:.0f} rows",
            (cross["rows"], axis.get_ylim()[0]),
            xytext=(5, 10),
            textcoords="offset points",
            fontsize=8,
        )
    axis.set_xscale("log")
    axis.set_yscale("log")
    axis.set_xlabel("rows (float32 x 22 columns)")
    axis.set_ylabel("median latency per call (µs)")
    title = "feature matrix to a model deployment: by value vs object store (one node)"
    if serve_env:
        title += "\n" + ", ".join(f"{k}={v}" for k, v in serve_env.items())
    axis.set_title(title, fontsize=10)
    axis.grid(True, which="both", alpha=0.3)
    axis.legend(fontsize=8)
    figure.tight_layout()
    png = out_dir / f"{name}.png"
    figure.savefig(png, dpi=110)
    plt.close(figure)
    return png


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "out")
    parser.add_argument("--calls", type=int, default=300, help="calls of each path per row count")
    parser.add_argument("--warmup", type=int, default=20, help="untimed calls of each path first")
    parser.add_argument("--quick", action="store_true", help="tiny counts: a smoke run, not a measurement")
    parser.add_argument(
        "--serve-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a Serve setting for this run, e.g. RAY_SERVE_THROUGHPUT_OPTIMIZED=1 (repeatable)",
    )
    parser.add_argument("--name", default="crossover", help="output file names: OUT/NAME.json, OUT/NAME.png")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    calls, warmup = (20, 4) if args.quick else (args.calls, args.warmup)
    serve_env = dict(item.split("=", 1) for item in args.serve_env)
    os.environ.update(serve_env)  # before Ray is imported: this process starts Ray, the replicas inherit it
    import ray

    load = os.getloadavg()
    log(f"rows {ROWS}, {calls} calls per path each; {serve_env or 'Serve defaults'}; load {load[0]:.2f}")
    started = time.perf_counter()
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        handle = deploy()
        log(f"Serve up after {time.perf_counter() - started:.1f} s")
        # Awaited on a loop of the driver's own: with RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP=0 a handle must
        # first be used inside a running loop.
        points, received = asyncio.run(measure_all(handle, calls, warmup))
        store = store_in_use()
        log(f"object store after the run (every ref dropped): {store}")
    finally:
        ray.shutdown()
    cross = crossover(points)
    # Two remote models reading one batch: the ingress puts it once, each call pays half the put.
    shared_two = {
        r: {
            "value": p["value"],
            "store": {"median_us": p["store_call"]["median_us"] + p["put"]["median_us"] / 2},
        }
        for r, p in points.items()
    }
    cross["shared_by_two"] = crossover(shared_two)
    print_table(points, cross)
    print(f"object store after the run, every ref dropped: {store}")
    print("\nwhere the model replica found the bytes (by value / object store):")
    for rows, where in sorted(received.items()):
        value, store = where["value"], where["store"]
        print(f"  {rows:>6} rows: {value['mapping']} / {store['mapping']}")
    document = {
        "rows": {str(r): p for r, p in points.items()},
        "ratio_store_over_value": {
            str(r): p["store"]["median_us"] / p["value"]["median_us"] for r, p in points.items()
        },
        "crossover": cross,
        "received": {str(r): where for r, where in received.items()},
        "columns": COLUMNS,
        "serve_env": serve_env,
        "object_store_after_run": store,
        "calls_per_path": calls,
        "machine": {"cpus": os.cpu_count(), "load_average_at_start": load},
        "seconds": time.perf_counter() - started,
    }
    json_path = write_results(args.out, args.name, document)
    png = plot(args.out, args.name, points, cross, serve_env)
    print(f"\nresults: {json_path}\nplot:    {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
