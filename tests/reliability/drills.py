"""The fault drills, each a function over a running pipeline: steady load, one fault, reconcile every request.

Shared by the drills of a real ``riskserve up`` (``test_faults.py``, ``test_soak.py``, marker
``reliability``) and the short version in the default run (``tests/integration/test_faults_short.py``).
Each returns the load's :class:`~tests.reliability.load.Report` and the fault's window (monotonic start,
end), after asserting its pass rule; ``FIGURES`` collects one line per drill for RELIABILITY.md.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from riskserve.audit import AuditTrail
from riskserve.state.db import open_database

from .flood import Flood
from .harness import PIPELINE, fault_hang, fault_kill, fault_resume, replaced, replica_pids, wait_for
from .load import DECISION, HANG, LABEL, LoadClient, Report

__all__ = [
    "RATE",
    "Window",
    "answer_times",
    "hang_model_replica",
    "kill_ingress_replica",
    "kill_model_replica",
    "overload",
    "record_figures",
    "unrecorded",
]

RATE = 40.0
"""Decisions a second of the steady load (one in four gets a label)."""
LABEL_EVERY = 4
SETTLE_S = 3.0
"""Load before a fault and after the recovery, so both sides of the window are seen."""
RECOVERY_S = 120.0
"""Longest a replacement may take before the drill fails (Serve restarts a replica in seconds here)."""


@dataclass(frozen=True)
class Window:
    """A fault: what, when it was injected, when the system was whole again (monotonic seconds)."""

    fault: str
    started: float
    ended: float

    def holds(self, sent: float, grace_s: float = 0.0) -> bool:
        return self.started - grace_s <= sent <= self.ended + grace_s


def record_figures(name: str, figures: dict[str, object]) -> None:
    """Append one drill's figures as a JSON line to ``$RISKSERVE_RELIABILITY_FIGURES`` (if set)."""
    path = os.environ.get("RISKSERVE_RELIABILITY_FIGURES")
    line = json.dumps({"drill": name, **figures}, default=str)
    print(line)
    if path:
        with Path(path).open("a") as out:
            out.write(line + "\n")


def _labels_kept(load: LoadClient, report: Report) -> dict[str, int]:
    """Send every acknowledged label again: each must come back ``duplicate`` (it was kept)."""
    again = load.relabel(report)
    kept = sum(o.kind == LABEL and o.duplicate for o in again)
    assert kept == len(again), (
        f"acknowledged labels not found again: {[(o.kind, o.duplicate) for o in again]}"
    )
    return {"labels_acknowledged": len(again), "labels_lost": len(again) - kept}


def _no_hang(report: Report) -> None:
    hung = [o for o in report.outcomes if any(a.code == HANG for a in o.attempts)]
    assert not hung, f"{len(hung)} calls unanswered past their deadline"


def _steady(target: str, app: str, seed: int) -> LoadClient:
    return LoadClient(target, pipeline=app, rate=RATE, label_every=LABEL_EVERY, seed=seed)


def kill_model_replica(
    target: str, replicas: int, *, app: str = PIPELINE, seed: int = 1, settle_s: float = SETTLE_S
) -> tuple[Report, Window]:
    """``kill -9`` of one fraud-model replica under steady load, until Serve has replaced it
    (``settle_s`` of load before the fault and after the recovery).

    Pass rule: every decision answered (never a status); with two replicas not one fallback; with one,
    fallbacks only while it is down; every acknowledged label kept.
    """
    wait_for(lambda: len(replica_pids("model-fraud", app)) == replicas, RECOVERY_S, "fraud replicas")
    with _steady(target, app, seed) as load:
        time.sleep(settle_s)
        victim = replica_pids("model-fraud", app)[0]
        started = time.monotonic()
        fault_kill(victim)
        wait_for(replaced("model-fraud", victim, replicas, app), RECOVERY_S, "replacement fraud replica")
        window = Window("kill -9 model replica", started, time.monotonic())
        time.sleep(settle_s)
    report = load.report()
    _no_hang(report)
    assert report.failures({DECISION}) == [], report.summary()
    assert report.failures({LABEL}, method="Feedback") == [], report.summary()
    fallbacks = [o for o in report.of("Decide") if o.fallbacks]
    if replicas > 1:
        assert fallbacks == [], report.summary()
    else:
        late = [o for o in fallbacks if not window.holds(o.sent, grace_s=settle_s)]
        assert late == [], f"fallbacks outside the fault window: {report.summary()}"
    figures = {
        **report.summary(),
        **_labels_kept(load, report),
        "recovery_s": round(window.ended - started, 1),
    }
    record_figures(f"kill_model_replica_of_{replicas}", figures)
    return report, window


def unrecorded(audit: Path, report: Report) -> int:
    """Decisions answered but absent from the audit trail the feedback log joins labels to, once the
    replicas had time to ship (and replay) what they had: read from the state database the harness's YAML
    names (``state.sqlite`` beside ``audit/``) and the journals in ``audit``."""
    ids = {o.decision_id for o in report.of("Decide") if o.kind == DECISION}
    missing = ids
    database = open_database(f"sqlite:///{audit.parent / 'state.sqlite'}")
    trail = AuditTrail(database, audit)

    def all_there() -> bool:
        nonlocal missing
        have = {record["decision_id"] for record in trail.records(0.0, 1e12)}
        missing = ids - have
        return not missing

    try:
        with contextlib.suppress(AssertionError):
            wait_for(all_there, 30, "every decision in the audit trail")
    finally:
        trail.db.close()
    return len(missing)


def kill_ingress_replica(
    target: str,
    replicas: int,
    *,
    app: str = PIPELINE,
    seed: int = 2,
    audit: Path | None = None,
    settle_s: float = SETTLE_S,
) -> tuple[Report, Window]:
    """``kill -9`` of one ingress replica under steady load, until Serve has replaced it (``settle_s`` of
    load before the fault and after the recovery).

    Pass rule: every request ends in a decision or an acknowledged label; the only failed attempts are
    ``UNAVAILABLE`` (calls in flight on the killed replica, or sent on its connection before the client saw
    it close), each of which succeeded on retry; every acknowledged label kept.
    """
    wait_for(lambda: len(replica_pids("ingress", app)) == replicas, RECOVERY_S, "ingress replicas")
    with _steady(target, app, seed) as load:
        time.sleep(settle_s)
        victim = replica_pids("ingress", app)[0]
        started = time.monotonic()
        fault_kill(victim)
        wait_for(replaced("ingress", victim, replicas, app), RECOVERY_S, "replacement ingress replica")
        window = Window("kill -9 ingress replica", started, time.monotonic())
        time.sleep(settle_s)
    report = load.report()
    _no_hang(report)
    assert report.failures({DECISION}) == [], report.summary()
    assert report.failures({LABEL}, method="Feedback") == [], report.summary()
    for method in ("Decide", "Feedback"):
        assert set(report.attempt_codes(method)) <= {"OK", "UNAVAILABLE"}, report.summary()
    retried_late = [o for o in report.outcomes if o.retried and not window.holds(o.sent, grace_s=1.0)]
    assert retried_late == [], "retries outside the fault window"
    figures: dict[str, object] = {
        **report.summary(),
        **_labels_kept(load, report),
        "recovery_s": round(window.ended - started, 1),
    }
    if audit is not None:  # what the killed replica had buffered was journaled and adopted
        figures["decisions_unrecorded"] = missing = unrecorded(audit, report)
        assert missing == 0, figures
    record_figures(f"kill_ingress_replica_of_{replicas}", figures)
    return report, window


def hang_model_replica(
    target: str, replicas: int, *, app: str = PIPELINE, seed: int = 3
) -> tuple[Report, Window]:
    """SIGSTOP of one fraud-model replica (a hung process: alive, sockets open, never answering) under
    steady load, until Serve's health check has replaced it.

    Pass rule: every decision answered; fallbacks (TIMEOUT) only for calls sent to it before its lane's
    health probe put it aside, i.e. within the first seconds, none after; it is replaced.
    """
    wait_for(lambda: len(replica_pids("model-fraud", app)) == replicas, RECOVERY_S, "fraud replicas")
    with _steady(target, app, seed) as load:
        time.sleep(SETTLE_S)
        victim = replica_pids("model-fraud", app)[0]
        started = time.monotonic()
        fault_hang(victim)
        try:
            wait_for(replaced("model-fraud", victim, replicas, app), RECOVERY_S, "hung replica replaced")
        finally:
            fault_resume(victim)
        window = Window("SIGSTOP model replica", started, time.monotonic())
        time.sleep(SETTLE_S)
    report = load.report()
    _no_hang(report)
    assert report.failures({DECISION}) == [], report.summary()
    assert report.failures({LABEL}, method="Feedback") == [], report.summary()
    fallbacks = [o for o in report.of("Decide") if o.fallbacks]
    put_aside_s = max((o.sent - started for o in fallbacks), default=0.0)
    if replicas > 1:  # the other replica answers once the hung one's lane is put aside (probed each second)
        assert all(set(o.fallbacks) == {"fraud:TIMEOUT"} for o in fallbacks), report.summary()
        halfway = started + (window.ended - started) / 2
        assert [o for o in fallbacks if o.sent > halfway] == [], (
            f"fallbacks until it was replaced: {report.summary()}"
        )
    figures = {
        **report.summary(),
        **_labels_kept(load, report),
        "replaced_after_s": round(window.ended - started, 1),
        "last_fallback_after_s": round(put_aside_s, 1),
    }
    record_figures(f"hang_model_replica_of_{replicas}", figures)
    return report, window


def _ms(values: list[float], q: float) -> float | None:
    """The ``q`` quantile of ``values`` in ms, rounded (``None``: no values)."""
    ordered = sorted(values)
    return round(ordered[min(int(len(ordered) * q), len(ordered) - 1)] * 1e3, 1) if ordered else None


def answer_times(report: Report, kind: str, within: Window) -> dict[str, object]:
    """How long the ``Decide`` calls sent during ``within`` that ended ``kind`` took, send to answer, as
    their client measured it: count, p50, p99 (ms)."""
    took = [o.ended - o.sent for o in report.of("Decide") if o.kind == kind and within.holds(o.sent)]
    return {"count": len(took), "p50_ms": _ms(took, 0.5), "p99_ms": _ms(took, 0.99)}


def overload(
    target: str, *, app: str = PIPELINE, seconds: float = 6.0, flood: int = 600, seed: int = 4
) -> tuple[Report, Window]:
    """A flood of ``flood`` calls always in flight (far past what the ingress replicas take at once), from a
    process of its own (:class:`~tests.reliability.flood.Flood`), beside the steady load, for ``seconds``.

    Pass rule: every flood call ends in a decision or RESOURCE_EXHAUSTED (never UNAVAILABLE, never a hang;
    DEADLINE_EXCEEDED only if its 2 s deadline truly ran out); the steady load's calls end in decisions,
    RESOURCE_EXHAUSTED or DEADLINE_EXCEEDED during the flood, and only in decisions from 3 s after it.
    Promptness is measured on the steady client (not the flood's, whose own workers delay its answers):
    its refusals during the flood, send to RESOURCE_EXHAUSTED, p50 under half the flood's deadline.
    """
    with _steady(target, app, seed) as load:
        time.sleep(SETTLE_S)
        with Flood(
            target, pipeline=app, workers=flood, channels=8, deadline_s=2.0, seed=seed + 100
        ) as flooding:
            time.sleep(seconds)
        window = Window("overload", flooding.started, time.monotonic())
        time.sleep(SETTLE_S + 3.0)
    flooded, report = flooding.report(), load.report()
    _no_hang(flooded)
    _no_hang(report)
    assert set(flooded.kinds()) <= {DECISION, "RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED"}, flooded.summary()
    assert flooded.kinds()["RESOURCE_EXHAUSTED"] > 0, flooded.summary()
    after = [o for o in report.outcomes if o.sent > window.ended + 3.0]
    assert after, "no steady load after the flood"
    assert [o for o in after if o.kind not in (DECISION, LABEL)] == [], report.summary()
    during = report.failures({DECISION, "RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED"})
    assert during == [], report.summary()
    refusals = answer_times(report, "RESOURCE_EXHAUSTED", window)
    figures = {
        "flood": flooded.summary(),
        "steady": report.summary(),
        "steady_refusals": refusals,
        "steady_decisions_during": answer_times(report, DECISION, window),
        "flood_refusals": answer_times(flooded, "RESOURCE_EXHAUSTED", window),
        "flood_decisions": answer_times(flooded, DECISION, window),
        "decisions_per_s_flood": round(flooded.kinds()[DECISION] / (window.ended - window.started), 1),
    }
    record_figures("overload", figures)
    p50 = refusals["p50_ms"]
    assert not isinstance(p50, float) or p50 < 1000.0, f"refusals not prompt: {figures}"
    return report, window
