"""Hot swap of the scikit-learn ``fraud`` model of a running pipeline under load, over Serve's gRPC proxy.

Starts a local Ray (its own processes, bound to loopback; other clusters on the machine are left alone) and
Serve with the gRPC proxy, deploys ``tabular_only`` (no LLM) with the demo models in ``--models`` and builds
``--candidates`` fraud candidates retrained with seeds 1, 2, ... in a temporary directory. Then, in one run:

  1. steady state: ``--repeats`` sequential ``Decide`` calls after ``--warmup`` untimed ones, no swaps,
     from the same kind of client thread as in 2;
  2. during swaps: one client thread issues the same sequential ``Decide`` load (back to back, or at
     ``--rate`` calls/s) while the main thread swaps the fraud model ``--swaps`` times, cycling through the
     candidates, one swap every ``--interval`` seconds (:func:`riskserve.operations.swap.swap`). Requests in
     flight during a swap window (swap command start to end) are compared with the steady ones and with
     the load-phase requests outside any window. Failed requests, fallbacks and fraud versions that are
     not one of the known ones are counted (all must be 0), and so are requests sent after a swap returned
     that still got the old version;
  3. swap to first request: per swap, the time from the swap command's start to the first response of the
     load thread carrying the new fraud version, next to the command's own duration (wall time, and
     ``SwapResult.seconds``: redeploy plus probes, without the candidate's verification).

The credit and fraud replicas' pid / actor id / start time are compared before and after, to show that a
swap restarts nothing. The swap history goes to a temporary ``RISKSERVE_STATE_DIR``, never the user's.
Ratios are measured side by side in the same run (the machine is noisy, absolute numbers drift).

Run: ``.venv/bin/python bench/hotswap.py --models models`` (the demo models are built there if missing).
Writes ``bench/out/hotswap.json`` and ``bench/out/hotswap.png`` (latency of every request over time with
the swap windows shaded, and latency CDFs steady / outside windows / in a window).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import write_results
from bench.decide import _requests, _spec, _start, _stats_ms, _stop

PIPELINE = "tabular_only"
MODEL = "fraud"
WATCHED = ("credit", "fraud")
"""Models whose replica identity is compared before and after the swaps."""


@dataclass(frozen=True)
class Sample:
    """One ``Decide`` call seen by the client: perf_counter timestamps, outcome and the fraud version."""

    sent: float
    received: float
    ok: bool
    version: str = ""
    fallback: bool = False
    fallback_reason: str = ""
    error: str = ""

    @property
    def latency(self) -> float:
        """Seconds from send to answer."""
        return self.received - self.sent


@dataclass(frozen=True)
class SwapRecord:
    """One swap command: when it ran (perf_counter), what it did, and its error if it failed."""

    label: str
    started: float
    ended: float
    old_version: str = ""
    new_version: str = ""
    seconds: float = 0.0
    error: str = ""

    @property
    def wall(self) -> float:
        """Seconds the swap command took, verification included."""
        return self.ended - self.started


@dataclass
class Bench:
    """What every section needs: the running pipeline, its address, requests and the known fraud versions."""

    spec: Any
    target: str
    learning_target: str
    requests: list[Any]
    candidates: dict[str, Path]
    versions: dict[str, str]
    """Label -> fraud version: ``original`` and each candidate."""
    labels: dict[str, str] = field(default_factory=dict)
    """Fraud version -> label."""

    def __post_init__(self) -> None:
        """Index the labels by version."""
        self.labels = {v: k for k, v in self.versions.items()}


def _call(client: Any, request: Any) -> Sample:
    """One ``Decide``; a failure is recorded, never raised."""
    sent = time.perf_counter()
    try:
        response = client.decide_request(request)
    except Exception as error:
        return Sample(sent, time.perf_counter(), ok=False, error=f"{type(error).__name__}: {error}")
    received = time.perf_counter()
    fraud = next((m for m in response.models if m.model == MODEL), None)
    if fraud is None:
        return Sample(sent, received, ok=False, error="no fraud model in the response")
    return Sample(
        sent, received, ok=True, version=fraud.version, fallback=fraud.fallback,
        fallback_reason=fraud.fallback_reason,
    )  # fmt: skip


class LoadThread(threading.Thread):
    """A client thread calling ``Decide`` back to back (or at ``rate`` calls/s) until stopped or ``limit``."""

    def __init__(self, bench: Bench, rate: float, offset: int, limit: int | None = None) -> None:
        super().__init__(name="hotswap-load", daemon=True)
        self.bench, self.rate, self.offset, self.limit = bench, rate, offset, limit
        self.samples: list[Sample] = []
        self._stop_event = threading.Event()

    def run(self) -> None:
        """Issue calls until :meth:`stop` or ``limit`` calls."""
        from riskserve.client import RiskClient

        requests = self.bench.requests
        with RiskClient(self.bench.target, pipeline=PIPELINE, timeout_s=20) as client:
            i = self.offset
            while not self._stop_event.is_set() and (self.limit is None or len(self.samples) < self.limit):
                sample = _call(client, requests[i % len(requests)])
                self.samples.append(sample)
                i += 1
                if self.rate > 0:
                    time.sleep(max(0.0, 1 / self.rate - (time.perf_counter() - sample.sent)))

    def stop(self) -> list[Sample]:
        """Stop, wait for the call in flight, return every sample."""
        self._stop_event.set()
        self.join()
        return self.samples


def _identities(app: str) -> dict[str, dict[str, Any]]:
    """Pid, actor id and start time of the watched models' replicas (one probe each)."""
    from ray import serve

    out = {}
    ingress = serve.get_deployment_handle("ingress", app_name=app)
    for name in WATCHED:
        meta = ingress.model_status.remote(name).result()
        out[name] = {"pid": meta.pid, "actor_id": meta.actor_id, "replica_started_at": meta.started_at}
    return out


def _candidates(root: Path, count: int) -> dict[str, Path]:
    """Fraud candidates retrained with seeds 1..count, built under ``root``."""
    from riskserve.demo.build import build_demo_models

    out = {}
    for seed in range(1, count + 1):
        (built,) = build_demo_models(root / f"seed{seed}", seed=seed, only=[MODEL], progress=False)
        out[f"seed{seed}"] = built.path
    return out


def _known_versions(models: Path, candidates: dict[str, Path]) -> dict[str, str]:
    """Label -> version of the original fraud model and of each candidate."""
    from riskserve.platform.artifacts import open_artifact

    paths = {"original": models / MODEL, **candidates}
    versions = {label: open_artifact(path, kind="sklearn").version for label, path in paths.items()}
    if len(set(versions.values())) != len(versions):
        raise RuntimeError(f"candidates share a version, swaps would not be visible: {versions}")
    return versions


def _check(samples: Sequence[Sample], bench: Bench) -> dict[str, Any]:
    """Failed calls, fallbacks and unknown fraud versions among ``samples``, with the first error."""
    failed = [s for s in samples if not s.ok]
    unknown = sorted({s.version for s in samples if s.ok and not s.fallback} - set(bench.labels))
    return {
        "requests": len(samples),
        "failed": len(failed),
        "first_error": failed[0].error if failed else "",
        "fallbacks": sum(s.fallback for s in samples),
        "fallback_reasons": dict(Counter(s.fallback_reason for s in samples if s.fallback)),
        "unknown_versions": unknown,
    }


def measure_steady(bench: Bench, args: argparse.Namespace) -> dict[str, Any]:
    """Section 1: sequential ``Decide`` latency with no swaps, from the same load thread as under swaps."""
    total = args.warmup + args.repeats
    load = LoadThread(bench, args.rate, offset=0, limit=total)
    with tqdm(total=total, desc="steady", unit="call") as progress:
        load.start()
        while load.is_alive():
            load.join(timeout=0.5)
            progress.update(len(load.samples) - progress.n)
    samples = load.samples[args.warmup :]
    good = [s.latency for s in samples if s.ok]
    return {**_stats_ms(good), **_check(samples, bench), "samples_ms": [x * 1e3 for x in good]}


def _run_swaps(bench: Bench, args: argparse.Namespace) -> tuple[list[Sample], list[SwapRecord], float]:
    """Swap the fraud model every ``interval`` s under the load thread; return samples, swaps and t0."""
    from riskserve.operations.swap import swap
    from riskserve.platform.errors import RiskServeError

    labels = list(bench.candidates)
    load = LoadThread(bench, args.rate, offset=args.warmup + args.repeats)
    origin = time.perf_counter()
    load.start()
    records: list[SwapRecord] = []
    try:
        with tqdm(total=args.swaps, desc="swaps", unit="swap") as progress:
            for i in range(args.swaps):
                time.sleep(args.interval)
                label = labels[i % len(labels)]
                started = time.perf_counter()
                try:
                    result = swap(bench.spec, MODEL, bench.candidates[label])
                except RiskServeError as error:
                    records.append(SwapRecord(label, started, time.perf_counter(), error=str(error)))
                else:
                    ended = time.perf_counter()
                    records.append(
                        SwapRecord(
                            label, started, ended, result.old_version, result.new_version, result.seconds
                        )
                    )
                progress.set_postfix_str(f"{label} in {records[-1].wall:.2f} s, {len(load.samples)} calls")
                progress.update(1)
            time.sleep(args.interval)  # the last swap's new version must be seen by the client too
    finally:
        samples = load.stop()
    return samples, records, origin


def _in_flight(sample: Sample, records: Sequence[SwapRecord]) -> bool:
    """Whether ``sample`` overlapped a swap window (command start to end)."""
    return any(sample.sent < r.ended and sample.received > r.started for r in records)


def _per_swap(samples: Sequence[Sample], record: SwapRecord, next_start: float) -> dict[str, Any]:
    """One swap's figures: first response with the new version, stale answers after it returned."""
    by_arrival = sorted((s for s in samples if s.ok and not s.fallback), key=lambda s: s.received)
    first = next(
        (s for s in by_arrival if s.received >= record.started and s.version == record.new_version), None
    )
    stale = [s for s in by_arrival if record.ended < s.sent < next_start and s.version == record.old_version]
    window = [s.latency for s in samples if s.ok and _in_flight(s, [record])]
    return {
        "candidate": record.label,
        "old_version": record.old_version,
        "new_version": record.new_version,
        "error": record.error,
        "wall_s": record.wall,
        "swap_result_s": record.seconds,
        "to_first_new_response_s": None if first is None else first.received - record.started,
        "first_new_after_return_s": None if first is None else first.received - record.ended,
        "stale_after_return": len(stale),
        "in_window": len(window),
        "in_window_p50_ms": statistics.median(window) * 1e3 if window else None,
        "in_window_max_ms": max(window) * 1e3 if window else None,
    }


def _median_max(values: Sequence[float | None]) -> dict[str, float | None]:
    """Median and max of the values that are not None (None when there are none)."""
    present = [v for v in values if v is not None]
    if not present:
        return {"median": None, "max": None}
    return {"median": statistics.median(present), "max": max(present)}


def _label(sample: Sample, bench: Bench) -> str:
    """How a sample shows in the timeline: its fraud version's label, ``fallback`` or ``FAILED``."""
    if not sample.ok:
        return "FAILED"
    return "fallback" if sample.fallback else bench.labels.get(sample.version, sample.version)


def measure_swaps(bench: Bench, args: argparse.Namespace) -> dict[str, Any]:
    """Sections 2 and 3: latency of requests in flight during swaps, and swap-to-first-new-response time."""
    before = _identities(PIPELINE)
    samples, records, origin = _run_swaps(bench, args)
    after = _identities(PIPELINE)
    good = [s for s in samples if s.ok]
    inside = [s.latency for s in good if _in_flight(s, records)]
    outside = [s.latency for s in good if not _in_flight(s, records)]
    starts = [r.started for r in records[1:]] + [float("inf")]
    swaps = [_per_swap(samples, r, n) for r, n in zip(records, starts, strict=True)]
    duration = samples[-1].received - samples[0].sent if samples else 0.0
    return {
        "in_window": _stats_ms(inside) if inside else {"n": 0},
        "outside_window": _stats_ms(outside) if outside else {"n": 0},
        "checks": {
            **_check(samples, bench),
            "fallbacks_in_window": sum(s.fallback and _in_flight(s, records) for s in good),
            "failed_swaps": sum(bool(r.error) for r in records),
            "stale_after_return": sum(s["stale_after_return"] for s in swaps),
            "restarted": sorted(n for n in WATCHED if before[n] != after[n]),
        },
        "calls_per_s": len(samples) / duration if duration else 0.0,
        "interval_s": args.interval,
        "swaps": swaps,
        "swap_wall_s": _median_max([s["wall_s"] for s in swaps if not s["error"]]),
        "swap_result_s": _median_max([s["swap_result_s"] for s in swaps if not s["error"]]),
        "to_first_new_response_s": _median_max([s["to_first_new_response_s"] for s in swaps]),
        "first_new_after_return_s": _median_max([s["first_new_after_return_s"] for s in swaps]),
        "identities": {"before": before, "after": after},
        "windows_s": [[r.started - origin, r.ended - origin] for r in records],
        "timeline": [[s.sent - origin, s.latency * 1e3, _label(s, bench)] for s in samples],
    }


LEARNING = "learning"
"""A second pipeline in the same Ray: tabular_only with a feedback log and the fraud model learning online."""


def learning_spec(models: Path, log_dir: Path, batch_size: int) -> Any:
    """``tabular_only`` with ``feedback`` and ``models.fraud.online`` (one mini-batch per ``batch_size``)."""
    import copy

    import yaml

    from bench.decide import PIPELINES
    from riskserve.schema.pipeline import parse_pipeline

    data = copy.deepcopy(yaml.safe_load((PIPELINES / f"{PIPELINE}.yaml").read_text()))
    data["name"] = LEARNING
    data["pools"] = {"cpu": {"cpus": 3}}  # two pipelines, each two ingress replicas x 0.75
    for name, model in data["models"].items():
        model["artifact"] = str((models / name).resolve())
    data["models"][MODEL]["online"] = {"batch_size": batch_size, "interval_ms": 600_000}
    data["feedback"] = {"source_burst": 100_000, "num_cpus": 0}
    data["state"] = {"dsn": f"sqlite:///{log_dir / 'state.sqlite'}"}  # the labels' log, cursor, checkpoints
    data["audit"] = {"path": str(log_dir / "audit")}  # the decisions labels are joined to
    return parse_pipeline(data, base_dir=PIPELINES, source=LEARNING)


def measure_label_to_version(bench: Bench, args: argparse.Namespace) -> dict[str, Any]:
    """Rounds of: decide ``batch`` requests, label them all; time each label's durable ack and the time
    from the last label's ack to the first ``Decide`` that carries the new fraud version."""
    from ray import serve

    from riskserve.client import RiskClient
    from riskserve.demo.dataset import generate_transactions

    batch, rounds = args.label_batch, args.label_rounds
    tx = generate_transactions(batch * rounds, seed=99)
    requests = _requests(LEARNING, batch * rounds, seed=99)
    feedback = serve.get_deployment_handle("feedback", app_name=LEARNING)
    acks: list[float] = []
    to_version: list[float] = []
    publish_s: list[float] = []
    outcomes: Counter[str] = Counter()
    with (
        RiskClient(bench.learning_target, pipeline=LEARNING, timeout_s=30) as client,
        tqdm(total=rounds, desc="label -> new version", unit="round") as progress,
    ):
        for r in range(rounds):
            chunk = range(r * batch, (r + 1) * batch)
            for i in chunk:
                client.decide_request(requests[i])
            before = _fraud_of(client, requests[r * batch])
            published = feedback.status.remote().result()["models"][MODEL]["publishes"]
            for i in chunk:
                started = time.perf_counter()
                client.feedback(
                    request_id=requests[i].request_id, label=int(tx.is_fraud[i]), feedback_id=f"l-{i}",
                    source="bench",
                )  # fmt: skip
                acks.append(time.perf_counter() - started)
            last_ack = time.perf_counter()
            deadline = last_ack + 60
            while (
                version := _fraud_of(client, requests[r * batch])
            ) == before and time.perf_counter() < deadline:
                pass
            to_version.append(time.perf_counter() - last_ack if version != before else float("nan"))
            deadline = time.perf_counter() + 60  # this round's publish returns after its version serves
            while (status := feedback.status.remote().result()["models"][MODEL])["publishes"] <= published:
                if time.perf_counter() > deadline:
                    break
                time.sleep(0.05)
            publish_s.append(float(status["last_publish_s"] or "nan"))
            outcomes[str((status["last_report"] or {}).get("outcome"))] += 1
            progress.update(1)
    return {
        "batch_size": batch,
        "rounds": rounds,
        "feedback_ack": _stats_ms(acks),
        "label_to_new_version": _stats_ms(to_version),
        "learner_publish": _stats_ms(publish_s),
        "outcomes": dict(outcomes),
    }


def _fraud_of(client: Any, request: Any) -> str:
    """The fraud version one ``Decide`` used."""
    response = client.decide_request(request)
    return str(next(m.version for m in response.models if m.model == MODEL))


SECTIONS: tuple[tuple[str, Callable[[Bench, argparse.Namespace], dict[str, Any]]], ...] = (
    ("steady", measure_steady),
    ("swaps", measure_swaps),
    ("label_to_version", measure_label_to_version),
)
"""Sections run in order on the same running pipeline; each returns its part of ``hotswap.json``."""


def _ms(value: float | None) -> str:
    """Seconds as milliseconds, or a dash."""
    return "-" if value is None else f"{value * 1e3:.1f}"


def _print_learning(section: dict[str, Any]) -> None:
    """The online-learning figures: durable ack per label, label -> new version, learner publish."""
    print(
        f"\nonline learning ({LEARNING}): {section['rounds']} mini-batches of "
        f"{section['batch_size']} labels (ms)"
    )
    print(f"{'':<40} {'n':>6} {'p50':>8} {'p90':>8} {'p99':>8} {'max':>8}")
    for label, key in (
        ("Feedback call (durable: fsynced ack)", "feedback_ack"),
        ("last label's ack -> first new version", "label_to_new_version"),
        ("learner's publish (serve.run, all replicas)", "learner_publish"),
    ):
        st = section[key]
        print(
            f"{label:<40} {st['n']:>6} {st['p50_ms']:>8.1f} {st['p90_ms']:>8.1f} "
            f"{st['p99_ms']:>8.1f} {st['max_ms']:>8.1f}"
        )
    print(f"batch outcomes: {section['outcomes']}")


def _print(results: dict[str, Any], bench: Bench) -> None:
    """The figures table and ratios of the steady and swap sections."""
    steady, swaps = results["steady"], results["swaps"]
    inside, outside = swaps["in_window"], swaps["outside_window"]
    print(f"\n{PIPELINE}: Decide over gRPC on loopback, fraud model hot swapped (ms)")
    print(f"{'requests':<34} {'n':>6} {'p50':>8} {'p90':>8} {'p99':>8} {'max':>8}")
    for label, s in (
        ("steady, no swaps (sequential)", steady),
        ("under swaps, outside windows", outside),
        ("under swaps, in flight in a swap", inside),
    ):
        if s["n"]:
            print(
                f"{label:<34} {s['n']:>6} {s['p50_ms']:>8.2f} {s['p90_ms']:>8.2f} "
                f"{s['p99_ms']:>8.2f} {s['max_ms']:>8.2f}"
            )
    if inside["n"]:
        print("\nratios (same run):")
        print(
            f"  in-swap / steady          p50 {inside['p50_ms'] / steady['p50_ms']:.2f}x, "
            f"p99 {inside['p99_ms'] / steady['p99_ms']:.2f}x"
        )
        print(
            f"  in-swap / outside windows p50 {inside['p50_ms'] / outside['p50_ms']:.2f}x, "
            f"p99 {inside['p99_ms'] / outside['p99_ms']:.2f}x"
        )
    print(f"\nswaps of the fraud model, one every {swaps['interval_s']:g} s under load (ms)")
    print(
        f"{'#':>2} {'candidate':<9} {'old':>16} -> {'new':<16} {'wall':>8} {'result.s':>8} "
        f"{'to 1st new':>10} {'1st-return':>10} {'in win':>6} {'win p50':>8} {'stale':>5}"
    )
    for i, s in enumerate(swaps["swaps"], 1):
        p50 = "-" if s["in_window_p50_ms"] is None else f"{s['in_window_p50_ms']:.1f}"
        print(
            f"{i:>2} {s['candidate']:<9} {s['old_version']:>16} -> {s['new_version']:<16} "
            f"{_ms(s['wall_s']):>8} {_ms(s['swap_result_s']):>8} {_ms(s['to_first_new_response_s']):>10} "
            f"{_ms(s['first_new_after_return_s']):>10} {s['in_window']:>6} {p50:>8} "
            f"{s['stale_after_return']:>5}" + (f"  ERROR {s['error']}" if s["error"] else "")
        )
    print("\nswap timing, median / max (ms):")
    for key, label in (
        ("swap_wall_s", "swap command, wall (verify + redeploy + probes)"),
        ("swap_result_s", "SwapResult.seconds (redeploy + probes)"),
        ("to_first_new_response_s", "swap start -> first response with new version"),
        ("first_new_after_return_s", "swap return -> first new response (<0: before)"),
    ):
        print(f"  {label:<50} {_ms(swaps[key]['median']):>8} / {_ms(swaps[key]['max'])}")
    c = swaps["checks"]
    print(
        f"\nchecks: {c['requests']} load requests ({swaps['calls_per_s']:.0f}/s), failed {c['failed']}, "
        f"fallbacks {c['fallbacks']} ({c['fallbacks_in_window']} in a window, "
        f"{c['fallback_reasons'] or 'none'}), unknown fraud versions {c['unknown_versions'] or 0}, "
        f"failed swaps {c['failed_swaps']}, old version after a swap returned {c['stale_after_return']}, "
        f"restarted replicas {c['restarted'] or 'none'}; steady: failed {steady['failed']}, "
        f"fallbacks {steady['fallbacks']}"
    )
    if c["first_error"]:
        print(f"  first failure: {c['first_error']}")
    print("known fraud versions: " + ", ".join(f"{k} {v}" for k, v in bench.versions.items()))


def _plot(out_dir: Path, results: dict[str, Any]) -> Path:
    """Latency of every load request over time (swap windows shaded) and latency CDFs, as hotswap.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    swaps = results["swaps"]
    figure, (timeline, cdf) = plt.subplots(1, 2, figsize=(13, 4.8), gridspec_kw={"width_ratios": [2.2, 1]})
    for start, end in swaps["windows_s"]:
        timeline.axvspan(start, end, color="tab:orange", alpha=0.25, lw=0)
    by_version: dict[str, list[tuple[float, float]]] = {}
    for at, latency, label in swaps["timeline"]:
        by_version.setdefault(label, []).append((at, latency))
    for label, points in sorted(by_version.items()):
        timeline.scatter([p[0] for p in points], [p[1] for p in points], s=3, label=f"fraud {label}")
    for s, (start, _) in zip(swaps["swaps"], swaps["windows_s"], strict=True):
        if s["to_first_new_response_s"] is not None:
            timeline.axvline(start + s["to_first_new_response_s"], color="black", lw=0.6, ls="--")
    timeline.set_yscale("log")
    timeline.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    timeline.yaxis.set_minor_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    timeline.tick_params(axis="y", which="minor", labelsize=7)
    timeline.set_xlabel("time since load start (s); shaded: swap command, dashed: first new-version answer")
    timeline.set_ylabel("Decide latency (ms)")
    timeline.set_title("Decide latency while the fraud model is hot swapped")
    timeline.grid(True, which="both", alpha=0.3)
    timeline.legend(fontsize=8, markerscale=3, loc="upper right")
    groups = {
        "steady": results["steady"]["samples_ms"],
        "under swaps, outside": [
            lat for at, lat, _ in swaps["timeline"] if not _overlaps(at, lat, swaps["windows_s"])
        ],
        "in flight in a swap": [
            lat for at, lat, _ in swaps["timeline"] if _overlaps(at, lat, swaps["windows_s"])
        ],
    }
    for label, values in groups.items():
        if values:
            ordered = sorted(values)
            cdf.step(
                ordered, [(i + 1) / len(ordered) for i in range(len(ordered))], where="post", label=label
            )
    cdf.set_xscale("log")
    cdf.xaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    cdf.xaxis.set_minor_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    cdf.tick_params(axis="x", which="minor", labelsize=7)
    cdf.set_xlabel("latency (ms)")
    cdf.set_ylabel("fraction of calls")
    cdf.set_title("latency CDF")
    cdf.grid(True, which="both", alpha=0.3)
    cdf.legend(fontsize=8, loc="lower right")
    figure.tight_layout()
    path = out_dir / "hotswap.png"
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def _overlaps(at: float, latency_ms: float, windows: Sequence[Sequence[float]]) -> bool:
    """Whether a timeline point (sent at ``at`` s, ``latency_ms``) overlapped a swap window."""
    return any(at < end and at + latency_ms / 1e3 > start for start, end in windows)


def _environment(state: Path) -> None:
    """Ray on loopback without usage stats or auth; the swap history in ``state`` (set before Ray starts)."""
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ["RISKSERVE_STATE_DIR"] = str(state)


def _arguments() -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", type=Path, default=Path("models"), help="demo models (built if missing)")
    parser.add_argument("--swaps", type=int, default=8, help="swaps of the fraud model under load")
    parser.add_argument("--interval", type=float, default=3.0, help="seconds between swaps")
    parser.add_argument("--candidates", type=int, default=3, help="fraud candidates (seeds 1..N) to cycle")
    parser.add_argument("--repeats", type=int, default=300, help="timed steady sequential calls")
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--rate", type=float, default=0.0, help="load calls/s during swaps (0: back to back)")
    parser.add_argument("--num-cpus", type=int, default=None, help="Ray's logical CPUs (default: enough)")
    parser.add_argument("--label-batch", type=int, default=64, help="labels per mini-batch (online learning)")
    parser.add_argument("--label-rounds", type=int, default=5, help="mini-batches timed label -> new version")
    parser.add_argument("--out", type=Path, default=Path("bench/out"))
    args = parser.parse_args()
    if args.candidates < 2:
        parser.error("--candidates must be at least 2 (consecutive swaps must change the version)")
    return args


def main() -> int:
    """Set up, run every section on one running pipeline, shut Ray down, print and write the results."""
    args = _arguments()
    wall = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="riskserve-hotswap-") as scratch:
        _environment(Path(scratch) / "state")
        from riskserve.demo.build import build_demo_models

        print(f"demo models in {args.models}; fraud candidates in {scratch}")
        build_demo_models(args.models, only=("credit", "fraud"))
        candidates = _candidates(Path(scratch) / "candidates", args.candidates)
        spec = _spec(PIPELINE, args.models)
        load = os.getloadavg()
        print(f"starting Ray + Serve (load average {load[0]:.2f}) and deploying {PIPELINE} ...")
        started = time.perf_counter()
        learning = learning_spec(args.models, Path(scratch), args.label_batch)
        endpoints = _start([spec, learning], args.num_cpus)
        startup_s = time.perf_counter() - started
        bench = Bench(
            spec, endpoints[PIPELINE], endpoints[LEARNING], _requests(PIPELINE, 4096, seed=2026), candidates,
            _known_versions(args.models, candidates),
        )  # fmt: skip
        results: dict[str, Any] = {}
        try:
            for name, section in SECTIONS:
                results[name] = section(bench, args)
        finally:
            _stop()
    _print(results, bench)
    if "label_to_version" in results:
        _print_learning(results["label_to_version"])
    import ray

    elapsed = time.perf_counter() - wall
    document = {
        **results,
        "pipeline": PIPELINE,
        "model": MODEL,
        "versions": bench.versions,
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "startup_s": startup_s,
        "wall_s": elapsed,
        "load_average_at_start": load,
        "cpus": os.cpu_count(),
        "ray_version": ray.__version__,
    }
    json_path = write_results(args.out, "hotswap", document)
    png = _plot(args.out, results)
    print(
        f"\nresults: {json_path}\nplot:    {png}\n"
        f"wall time {elapsed:.1f} s (Ray + Serve start {startup_s:.1f} s)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
