"""Shared helpers for the benchmarks: timing with medians, JSON results and plots."""

from __future__ import annotations

import asyncio
import json
import signal
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def time_calls(call: Callable[[], object], *, repeats: int, warmup: int = 3) -> list[float]:
    """Wall-clock seconds of ``repeats`` calls after ``warmup`` untimed ones."""
    for _ in range(warmup):
        call()
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        samples.append(time.perf_counter() - started)
    return samples


def summary(samples: list[float], rows: int) -> dict[str, float]:
    """Median and p99 in microseconds, and rows per second at the median."""
    ordered = sorted(samples)
    median = statistics.median(ordered)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return {"median_us": median * 1e6, "p99_us": p99 * 1e6, "rows_per_s": rows / median}


def write_results(out_dir: Path, name: str, results: dict[str, Any]) -> Path:
    """Write ``results`` as ``out_dir/name.json`` and return the path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps(results, indent=2) + "\n")
    return path


def save_figure(figure: Any, out_dir: Path, name: str) -> Path:
    """Lay out ``figure``, write it as ``out_dir/name.png`` (the directory made if needed) and close it."""
    import matplotlib.pyplot as plt

    figure.tight_layout()
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.png"
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def plot_latency(out_dir: Path, name: str, series: dict[str, dict[int, float]], title: str) -> Path:
    """Median latency against batch size, one line per series, log-log, as ``out_dir/name.png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4.5))
    for label, points in series.items():
        batches = sorted(points)
        axis.plot(batches, [points[b] for b in batches], marker="o", label=label)
    axis.set_xscale("log")
    axis.set_yscale("log")
    axis.set_xlabel("batch size (rows)")
    axis.set_ylabel("median latency (µs)")
    axis.set_title(title)
    axis.grid(True, which="both", alpha=0.3)
    axis.legend()
    return save_figure(figure, out_dir, name)


def write_local_pipeline(
    data: dict[str, Any], models: Path, run_dir: Path, stem: str, *, dsn: str | None = None
) -> Path:
    """A pipeline document made to run from a scratch directory: artifacts at absolute paths into
    ``models``; its state database (the feedback log), audit trail, learned versions and traces under
    ``run_dir``, named from ``stem``. ``dsn``: the state database instead (always set, with or without
    ``feedback``: e.g. a PostgreSQL database the benchmark started).
    Written as ``run_dir/STEM.yaml``, whose path is returned (a benchmark never writes into ``var/``)."""
    import yaml

    for model_name, model in data["models"].items():
        model["artifact"] = str((models / model_name).resolve())
        if model.get("online", {}).get("artifact_dir"):
            model["online"]["artifact_dir"] = str(run_dir / f"{stem}-learned" / model_name)
    if dsn is not None:
        data["state"] = {"dsn": dsn}
    elif "feedback" in data:  # labels, cursors and checkpoints: the pipeline's state database
        data["state"] = {"dsn": f"sqlite:///{run_dir / f'{stem}-state.sqlite'}"}
    if "audit" in data:
        data["audit"]["path"] = str(run_dir / f"{stem}-audit")
    tracing = data.get("tracing", {})
    if tracing.get("file_path"):
        tracing["file_path"] = str(run_dir / f"{stem}-traces.jsonl")
    path = run_dir / f"{stem}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


async def serve_until_signalled(server: Any, address: str) -> None:
    """Say ``serving on ADDRESS`` (a started grpc.aio ``server``'s; what the harness waits for), then
    serve until SIGTERM or SIGINT, and stop (calls in flight get a second to finish)."""
    print(f"serving on {address}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    await stop.wait()
    await server.stop(grace=1.0)
