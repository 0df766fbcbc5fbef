"""The soak: a real ``riskserve up`` under steady load for ``RISKSERVE_SOAK_S`` seconds (default 600), with
one fault of each kind at a random time (``RISKSERVE_SOAK_SEED`` picks them; it is printed): ``kill -9`` of a
model replica, ``kill -9`` of an ingress replica, a hung (SIGSTOPped) model replica, and a flood past
capacity. Pass rule: zero failures outside the fault windows (every request a decision or an acknowledged
label, no fallback, no retry), the fault windows within their drill's allowed set, no hang, the flood
refused (RESOURCE_EXHAUSTED) at least once at the default limits, every acknowledged label kept, and the
memory (RSS) and file descriptors of every riskserve/Ray process flat."""

from __future__ import annotations

import os
import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from .drills import LABEL_EVERY, RATE, RECOVERY_S, SETTLE_S, Window, answer_times, record_figures, unrecorded
from .flood import Flood
from .harness import (
    Running,
    TreeUse,
    fault_hang,
    fault_kill,
    fault_resume,
    pipeline_file,
    replaced,
    replica_pids,
    riskserve_up,
    tree_use,
    wait_for,
)
from .load import DECISION, HANG, LABEL, LoadClient, Outcome

SOAK_S = float(os.environ.get("RISKSERVE_SOAK_S", "600"))

# The soak itself lasts SOAK_S; the suite's 600 s per-test timeout would end the default 10-minute soak
# before its checks (it did: the first 10-minute run timed out), so it gets the soak plus 10 minutes.
pytestmark = [pytest.mark.reliability, pytest.mark.slow, pytest.mark.timeout(SOAK_S + 600)]
WARMUP_S = 30.0
"""Load before the first fault and before the memory baseline (allocators and caches settle)."""
SAMPLE_EVERY_S = 15.0
FLOOD_S = 6.0
MAX_GROWTH = 0.10
"""RSS and file descriptors at the end may exceed the baseline by at most this fraction."""


@pytest.fixture(scope="module")
def soaked(tabular_models: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    root = tmp_path_factory.mktemp("soak")
    with riskserve_up(
        pipeline_file(tabular_models, root, fraud_replicas=2, ingress_replicas=2), root
    ) as running:
        yield running


def _kill(deployment: str) -> Window:
    victim = replica_pids(deployment)[0]
    started = time.monotonic()
    fault_kill(victim)
    wait_for(replaced(deployment, victim, 2), RECOVERY_S, f"replacement {deployment} replica")
    return Window(f"kill -9 {deployment}", started, time.monotonic())


def _hang() -> Window:
    victim = replica_pids("model-fraud")[0]
    started = time.monotonic()
    fault_hang(victim)
    try:
        wait_for(replaced("model-fraud", victim, 2), RECOVERY_S, "hung replica replaced")
    finally:
        fault_resume(victim)
    return Window("SIGSTOP model-fraud", started, time.monotonic())


def _flood(target: str, seed: int) -> tuple[Window, Flood]:
    with Flood(target, pipeline="tabular_only", workers=600, channels=8, deadline_s=2.0, seed=seed) as flood:
        time.sleep(FLOOD_S)
    return Window("overload", flood.started, time.monotonic()), flood


def _allowed(window: Window, outcome: Outcome) -> bool:
    if outcome.kind == HANG or any(a.code == HANG for a in outcome.attempts):
        return False
    if window.fault == "overload":
        return outcome.kind in (DECISION, LABEL, "RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED")
    if outcome.kind not in (DECISION, LABEL):
        return False
    codes = {a.code for a in outcome.attempts}
    if window.fault == "kill -9 ingress":
        return codes <= {"OK", "UNAVAILABLE"}
    if window.fault.startswith("SIGSTOP"):
        return set(outcome.fallbacks) <= {"fraud:TIMEOUT"} and codes == {"OK"}
    return not outcome.fallbacks and codes == {"OK"}


def test_a_soak_with_one_fault_of_each_kind_at_random_times_loses_nothing_and_stays_flat(
    soaked: Running,
) -> None:
    seed = int(os.environ.get("RISKSERVE_SOAK_SEED", str(int(time.time()) % 100_000)))
    rng = random.Random(seed)
    faults = ["kill -9 model-fraud", "kill -9 ingress", "SIGSTOP model-fraud", "overload"]
    rng.shuffle(faults)
    slot = (SOAK_S - WARMUP_S) / len(faults)
    print(f"soak {SOAK_S:.0f} s, seed {seed}, faults in order {faults}")
    wait_for(
        lambda: len(replica_pids("model-fraud")) == 2 and len(replica_pids("ingress")) == 2, 120, "replicas"
    )
    samples: list[tuple[float, TreeUse]] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(SAMPLE_EVERY_S):
            samples.append((time.monotonic(), tree_use(soaked)))

    sampler = threading.Thread(target=sample, daemon=True)
    windows: list[Window] = []
    floods: list[Flood] = []
    with LoadClient(
        soaked.target, pipeline="tabular_only", rate=RATE, label_every=LABEL_EVERY, seed=seed
    ) as load:
        began = time.monotonic()
        time.sleep(WARMUP_S)
        baseline = tree_use(soaked)
        sampler.start()
        for i, fault in enumerate(faults):
            at = began + WARMUP_S + i * slot + rng.uniform(0, max(slot - 60.0, 1.0))
            time.sleep(max(at - time.monotonic(), 0.0))
            if fault == "overload":
                window, flood = _flood(soaked.target, seed + 1000)
                floods.append(flood)
            elif fault.startswith("kill"):
                window = _kill(fault.split()[-1])
            else:
                window = _hang()
            windows.append(window)
            took = window.ended - window.started
            print(f"{fault}: at {window.started - began:.0f} s, whole again after {took:.1f} s")
        time.sleep(max(began + SOAK_S - time.monotonic(), SETTLE_S))
    stop.set()
    sampler.join(timeout=30)
    final = tree_use(soaked)
    report = load.report()

    def window_of(outcome: Outcome) -> Window | None:
        """The fault window a request was in flight during (or up to 3 s after: calls then still saw it)."""
        return next(
            (w for w in windows if outcome.sent <= w.ended + 3.0 and outcome.ended >= w.started), None
        )

    outside = [o for o in report.outcomes if window_of(o) is None]
    failed_outside = [o for o in outside if o.kind not in (DECISION, LABEL) or o.fallbacks or o.retried]
    inside = [(w, o) for o in report.outcomes if (w := window_of(o)) is not None]
    failed_inside = [
        (w.fault, o.kind, [a.code for a in o.attempts], o.fallbacks) for w, o in inside if not _allowed(w, o)
    ]
    again = load.relabel(report)
    lost = [o for o in again if not (o.kind == LABEL and o.duplicate)]
    flood_kinds = {k: v for f in floods for k, v in f.report().kinds().items()}
    flooded = list(zip(floods, [w for w in windows if w.fault == "overload"], strict=True))
    decisions_lost = unrecorded(soaked.audit, report)
    figures = {
        "seed": seed,
        "seconds": round(report.ended - report.started),
        "decisions": report.kinds("Decide")[DECISION],
        "requests": len(report.outcomes),
        "outside_windows": len(outside),
        "failed_outside": len(failed_outside),
        "failed_inside": len(failed_inside),
        "windows": {
            w.fault: [round(w.started - report.started), round(w.ended - w.started, 1)] for w in windows
        },
        "summary": report.summary(),
        "flood": flood_kinds,
        "flood_refusals": [answer_times(f.report(), "RESOURCE_EXHAUSTED", w) for f, w in flooded],
        "steady_refusals": [answer_times(report, "RESOURCE_EXHAUSTED", w) for _, w in flooded],
        "labels_acknowledged": len(again),
        "labels_lost": len(lost),
        "decisions_unrecorded": decisions_lost,
        "rss_mb": [round(baseline.total_rss / 2**20), round(final.total_rss / 2**20)],
        "fds": [baseline.total_fds, final.total_fds],
        "processes": [len(baseline.rss), len(final.rss)],
        "rss_mb_samples": [round(u.total_rss / 2**20) for _, u in samples],
        "fds_samples": [u.total_fds for _, u in samples],
        "rss_mb_by_process": {name: round(rss / 2**20) for name, rss in sorted(final.rss.items())},
    }
    record_figures("soak", figures)
    assert failed_outside == [], [
        (o.method, o.kind, o.fallbacks, round(o.sent - report.started, 1)) for o in failed_outside[:20]
    ]
    assert failed_inside == [], failed_inside[:20]
    assert lost == [], f"{len(lost)} acknowledged labels lost"
    assert decisions_lost == 0, "decisions answered but never reached the feedback log"
    assert set(flood_kinds) <= {DECISION, "RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED"}, flood_kinds
    assert flood_kinds.get("RESOURCE_EXHAUSTED", 0) > 0, f"the flood was never refused: {flood_kinds}"
    assert final.total_rss <= baseline.total_rss * (1 + MAX_GROWTH), figures
    assert final.total_fds <= baseline.total_fds * (1 + MAX_GROWTH), figures
