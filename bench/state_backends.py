"""The state store's two backends side by side: the embedded SQLite file against a PostgreSQL server.

Two figures, each judged against its target:

  * **The hot path with the audit trail on.** ``tabular_only`` with its audit trail (as ``hotpath.py``'s
    ``tabular_audit``: every decision journaled, then shipped to the state database by a background
    thread of each ingress replica) runs twice with ``riskserve up``, each copy with its own
    ``RISKSERVE_STATE_DIR`` and port: one whose ``state.dsn`` is a SQLite file, one whose ``state.dsn`` is
    a database of a PostgreSQL server started here (``tests/pg_server.py``, fsync on, data on the same
    disk). Both stay up and are measured in alternating rounds (:func:`latency_rounds`, the way
    ``hotpath.py`` pairs ``tabular_only`` with its floor): the copy not measured is frozen with SIGSTOP,
    PostgreSQL's processes with the PostgreSQL copy, and the two take turns going first. A turn is
    ``bench/loadgen.py``'s closed loop at concurrency 1 (p50, p99) and 8 (decisions/s), one connection,
    through ``hotpath.closed``. The figures are the medians over rounds of each round's ratio
    PostgreSQL/SQLite; the target is PostgreSQL within 5% of SQLite on c=1 p50 and on c=8 decisions/s.
    After each turn the audit records in that copy's database are counted until they cover every decision
    the turn made (the trail kept up, or how far it was behind).
  * **Label → new version.** ``tabular_only`` with a learning fraud model (``online`` as
    ``tests/learning_helpers.py``'s ``ONLINE``: mini-batches of 16 labels) and ``feedback: {}``, on each
    backend, both up, turns alternated the same way (:func:`label_rounds`). A turn decides 16 new
    transactions, labels them by their decision ids (each label acknowledged once durable), and times
    from the last acknowledgement until a ``Decide`` answer (one every 10 ms) names a new fraud version:
    the learner's mini-batch, its checks, the publish to the versions record and the replica's pull. The
    target is at most 1 s (medians over turns, per backend).

Prints a line per phase on stderr, a summary and the verdicts on stdout; writes ``OUT/state_backends.json``
and ``OUT/state_backends.png`` (each round's value per backend). Every server started here (PostgreSQL,
each ``riskserve up``) is stopped at the end, whatever happens. On 2 shared cores the client, riskserve and
PostgreSQL share the machine: compare the ratios of one run, not absolute milliseconds across runs.

Needs PostgreSQL's binaries (``apt-get install postgresql``). Run:
``.venv/bin/python bench/state_backends.py --models models`` (in ``make bench``); ``--quick`` for one round,
two label turns and short windows (a smoke run, not a measurement).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import hotpath
from bench._common import save_figure, write_local_pipeline, write_results
from bench.hotpath import Running, closed, frozen, settle, warm_up

if TYPE_CHECKING:
    from tests.pg_server import PostgresServer

ROOT = Path(__file__).resolve().parents[1]
BACKENDS = ("sqlite", "postgresql")
PIPELINE = "tabular_only"
LIMIT_RATIO = 0.05
"""PostgreSQL within 5% of SQLite: c=1 p50 at most 1.05x, c=8 decisions/s at least 0.95x."""
LIMIT_LABEL_S = 1.0
"""Label → new version serving in at most a second (median over turns, per backend)."""
LABEL_BATCH = 16
"""Labels per mini-batch of the learning pipeline, and per label turn."""
POLL_S = 0.010
"""A ``Decide`` every 10 ms while waiting for the new version."""
LABEL_WAIT_S = 30.0
"""A turn whose new version has not shown after this long is recorded as a miss."""
AUDIT_WAIT_S = 30.0
"""How long after a turn the audit count may take to cover the turn's decisions."""
IDLE_S = 2.0
"""Seconds of each turn in which the copy's CPU at rest is measured (after it settled, before c=1)."""
LOADGEN_WARMUP = 20
"""Untimed calls ``hotpath.closed`` asks loadgen for before each window (they are audited too)."""


@dataclass(frozen=True)
class Plan:
    """How much is measured: paired rounds of the hot path, label turns per backend, and each window."""

    rounds: int
    """Rounds of the hot path, each a turn of each backend (``hotpath.FULL.tabular_rounds`` is 4)."""
    label_turns: int
    """Label → new version turns per backend."""
    window: hotpath.Plan
    """What ``hotpath.closed`` and ``hotpath.warm_up`` read: warm-up calls, calls and seconds per window."""


FULL = Plan(rounds=6, label_turns=8, window=hotpath.FULL)
QUICK = Plan(rounds=1, label_turns=2, window=dataclasses.replace(hotpath.QUICK, closed_seconds=2.0))


def log(message: str) -> None:
    """One progress line on stderr."""
    print(f"[state_backends {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# -- the servers ---------------------------------------------------------------------------------------


@contextlib.contextmanager
def state_dir_env(path: Path) -> Iterator[None]:
    """``RISKSERVE_STATE_DIR`` set to ``path`` for the block: ``riskserve up``/``down``/``learning`` (run
    as subprocesses with this environment) and ``read_state`` then mean that copy's local deployment."""
    before = os.environ.get("RISKSERVE_STATE_DIR")
    os.environ["RISKSERVE_STATE_DIR"] = str(path)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("RISKSERVE_STATE_DIR", None)
        else:
            os.environ["RISKSERVE_STATE_DIR"] = before


@dataclass
class Copy:
    """One pipeline copy on one backend: its YAML, state directory, database and, once up, the system."""

    backend: str
    pipeline: Path
    state_dir: Path
    dsn: str
    system: Running | None = None

    def riskserve(self, *args: str, timeout_s: float) -> tuple[int, str]:
        """A ``riskserve`` command of this copy's local deployment (exit code, output)."""
        with state_dir_env(self.state_dir):
            return hotpath._riskserve(*args, timeout_s=timeout_s)


def start(copy: Copy) -> Running:
    """``riskserve up`` of ``copy`` on a free port (returns once it serves); stopped by ``riskserve down``
    in its state directory, or by killing its process group if that fails."""
    from riskserve.operations.local import read_state

    started = time.perf_counter()
    port = hotpath._free_port()
    name = f"{PIPELINE}@{copy.backend}"
    code, output = copy.riskserve(
        "up", str(copy.pipeline), "--grpc-port", str(port), timeout_s=hotpath.TABULAR_START_S
    )
    with state_dir_env(copy.state_dir):
        state = read_state()
    if code != 0 or state is None:
        if state is not None:
            copy.riskserve("down", timeout_s=180.0)
        raise RuntimeError(f"riskserve up {name} failed ({code}):\n{output[-4000:]}")

    def stop() -> None:
        code, output = copy.riskserve("down", timeout_s=180.0)
        if code != 0:
            log(f"{name}: riskserve down failed ({code}), killing its process group: {output[-500:]}")
            with contextlib.suppress(ProcessLookupError):
                os.killpg(state.pid, signal.SIGKILL)

    elapsed = time.perf_counter() - started
    return Running(name, PIPELINE, state.target, state.pid, False, stop, elapsed)


@contextlib.contextmanager
def both_up(copies: Sequence[Copy], database: Running, window: hotpath.Plan) -> Iterator[None]:
    """Every copy started (one after the other, the others frozen while one starts), stopped after the
    block whatever happens; each is settled and warmed up with the others frozen before the block."""
    with contextlib.ExitStack() as stack:
        for copy in copies:
            log(f"{copy.backend}: starting {copy.pipeline.name} (state dir {copy.state_dir})")
            with idle(copies, copy, database):
                copy.system = start(copy)
            system = copy.system
            stack.callback(_stopper(copy))
            log(f"{copy.backend}: serving on {system.target} after {system.startup_s:.1f} s")
        for copy in copies:
            assert copy.system is not None
            with idle(copies, copy, database):
                waited = settle(copy.system)
                warm_up(copy.system, window, 1)
            log(f"{copy.backend}: idle after {waited:.0f} s, warmed up ({window.warmup} calls at c=8)")
        yield


def _stopper(copy: Copy) -> Callable[[], None]:
    def stop() -> None:
        if copy.system is not None:
            log(f"{copy.backend}: stopping (riskserve down)")
            copy.system.stop()
            copy.system = None

    return stop


@contextlib.contextmanager
def idle(copies: Sequence[Copy], active: Copy, database: Running) -> Iterator[None]:
    """Every copy but ``active`` frozen (SIGSTOP) for the block, and PostgreSQL's processes too unless
    ``active`` is the PostgreSQL copy: nothing of the idle system takes CPU from the measured one."""
    with contextlib.ExitStack() as stack:
        for copy in copies:
            if copy is not active and copy.system is not None:
                stack.enter_context(frozen(copy.system))
        if active.backend != "postgresql":
            stack.enter_context(frozen(database))
        yield


@contextlib.contextmanager
def postgresql() -> Iterator[tuple[PostgresServer, Running]]:
    """A PostgreSQL server (``tests/pg_server.py``: a fresh cluster in a temporary directory, fsync on),
    with its postmaster as a :class:`Running` that :func:`frozen` can stop; removed after the block."""
    from tests.pg_server import postgres_server

    with postgres_server() as server:
        pid = int((server.data / "db" / "postmaster.pid").read_text().split()[0])
        yield server, Running("postgresql", "", "", pid, False, lambda: None, 0.0)


def create_database(server: PostgresServer, name: str) -> str:
    """A new database ``name`` on ``server``; its DSN."""
    server._run("createdb", "-h", "127.0.0.1", "-p", str(server.port), "-U", "riskserve", name)
    return f"postgresql://riskserve@127.0.0.1:{server.port}/{name}"


def pipeline_data(learning: bool) -> dict[str, Any]:
    """``tabular_only`` as shipped with the audit trail on (``hotpath.py``'s ``tabular_audit``); with
    ``learning``, a learning fraud model (``ONLINE`` of ``tests/learning_helpers.py``, mini-batches of
    :data:`LABEL_BATCH`) and a feedback section too."""
    import yaml

    data: dict[str, Any] = yaml.safe_load((hotpath.PIPELINES / f"{PIPELINE}.yaml").read_text())
    data["audit"] = {"path": "audit"}
    if learning:
        from tests.learning_helpers import ONLINE

        online = {**ONLINE, "batch_size": LABEL_BATCH, "artifact_dir": "learned"}  # rewritten to the run dir
        data["models"]["fraud"]["online"] = online
        data["feedback"] = {}
    return data


def copies_for(kind: str, models: Path, run_dir: Path, server: PostgresServer) -> list[Copy]:
    """The SQLite and the PostgreSQL copy of the ``kind`` pipeline ("latency" or "learning")."""
    out = []
    for backend in BACKENDS:
        stem = f"{kind}-{backend}"
        if backend == "sqlite":
            dsn = f"sqlite:///{run_dir / f'{stem}-state.sqlite'}"
        else:
            dsn = create_database(server, kind)
        path = write_local_pipeline(pipeline_data(kind == "learning"), models, run_dir, stem, dsn=dsn)
        state = run_dir / f"{stem}-state"
        state.mkdir()
        out.append(Copy(backend, path, state, dsn))
    return out


# -- the hot path --------------------------------------------------------------------------------------


def audit_count(dsn: str) -> int:
    """Audit records in the database at ``dsn``."""
    from riskserve.audit import AuditStore
    from riskserve.state.db import open_database

    db = open_database(dsn)
    try:
        return AuditStore(db).count()
    finally:
        db.close()


def audit_caught_up(dsn: str, before: int, sent: int) -> dict[str, Any]:
    """Count the records of a turn that sent ``sent`` decisions (``before`` were there) until they are all
    in, or :data:`AUDIT_WAIT_S` passed: how far behind the trail was when the turn ended, and how long it
    took to catch up."""
    started = time.perf_counter()
    behind_at_end = sent - (audit_count(dsn) - before)
    shipped = sent - behind_at_end
    while shipped < sent and time.perf_counter() - started < AUDIT_WAIT_S:
        time.sleep(0.05)
        shipped = audit_count(dsn) - before
    return {
        "sent": sent,
        "shipped": shipped,
        "behind_at_end": behind_at_end,
        "caught_up_s": time.perf_counter() - started if shipped >= sent else None,
    }


def idle_cores(system: Running, database: Running, seconds: float = IDLE_S) -> dict[str, float]:
    """Cores the copy's processes and PostgreSQL's keep busy at rest (replicas polling the versions
    record, the audit writers' timers, Ray's and Serve's own); PostgreSQL's are frozen in SQLite's turns."""
    from bench._procs import cpu_delta, sample_tree

    roots = {"riskserve": system.root_pid, "database": database.root_pid}
    before = {name: sample_tree(pid) for name, pid in roots.items()}
    time.sleep(seconds)
    return {name: cpu_delta(before[name], sample_tree(pid))[0] / seconds for name, pid in roots.items()}


def latency_turn(copy: Copy, database: Running, window: hotpath.Plan) -> dict[str, Any]:
    """One copy's turn: settled, its CPU at rest, c=1, c=8, then its audit records counted until they
    cover the turn."""
    assert copy.system is not None
    waited = settle(copy.system, patience_s=10.0)
    turn: dict[str, Any] = {"settled_s": waited, "idle_cores": idle_cores(copy.system, database)}
    before = audit_count(copy.dsn)
    # PostgreSQL's CPU over each window as well (``others.database``: its processes are not riskserve's);
    # sampled in SQLite's turns too (frozen there: nothing), so that both pay the same for the sampling.
    others = {"database": database.root_pid}
    turn["c1"] = closed(copy.system, 1, window.c1_calls, window, 1, others=others)
    turn["c8"] = closed(copy.system, 8, window.c8_calls, window, 1, others=others)
    sent = sum(turn[phase]["decisions"] + LOADGEN_WARMUP for phase in ("c1", "c8"))
    turn["audit"] = audit_caught_up(copy.dsn, before, sent)
    return turn


RATIOS = ("p50_c1", "p99_c1", "throughput_c8")


def latency_rounds(copies: Sequence[Copy], database: Running, plan: Plan) -> dict[str, Any]:
    """Both copies up; in each round each takes a turn (SQLite first in even rounds, PostgreSQL first in odd
    ones), the other frozen; each round's ratios PostgreSQL/SQLite, and their medians over rounds."""
    rounds = []
    for index in range(plan.rounds):
        order = list(copies) if index % 2 == 0 else list(reversed(copies))
        turns: dict[str, dict[str, Any]] = {}
        for copy in order:
            with idle(copies, copy, database):
                turns[copy.backend] = latency_turn(copy, database, plan.window)
            turn = turns[copy.backend]
            log(
                f"hot path round {index + 1}/{plan.rounds}, {copy.backend}: c=1 p50 "
                f"{turn['c1']['latency_ms']['p50']:.3f} ms, p99 {turn['c1']['latency_ms']['p99']:.3f} ms; "
                f"c=8 {turn['c8']['decisions_per_s']:.0f}/s; audit {turn['audit']['shipped']}/"
                f"{turn['audit']['sent']} records in, {turn['audit']['behind_at_end']} behind at the end"
            )
        pg, lite = turns["postgresql"], turns["sqlite"]
        ratios = {
            "p50_c1": pg["c1"]["latency_ms"]["p50"] / lite["c1"]["latency_ms"]["p50"],
            "p99_c1": pg["c1"]["latency_ms"]["p99"] / lite["c1"]["latency_ms"]["p99"],
            "throughput_c8": pg["c8"]["decisions_per_s"] / lite["c8"]["decisions_per_s"],
        }
        errors = sum(t[phase]["error_count"] for t in turns.values() for phase in ("c1", "c8"))
        rounds.append({"first": order[0].backend, "ratios": ratios, "errors": errors, "turns": turns})
        figures = ", ".join(f"{key} {ratios[key]:.3f}x" for key in RATIOS)
        log(f"hot path round {index + 1}/{plan.rounds}: PostgreSQL/SQLite {figures}")
    return {
        "rounds": rounds,
        "ratios_median": {key: statistics.median(r["ratios"][key] for r in rounds) for key in RATIOS},
        "medians": {backend: backend_medians([r["turns"][backend] for r in rounds]) for backend in BACKENDS},
        "errors": sum(r["errors"] for r in rounds),
    }


def backend_medians(turns: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One backend's figures over its turns: medians of latency, throughput, CPU per decision at c=8
    (riskserve's processes and PostgreSQL's) and cores busy at rest; the audit records in and sent."""
    return {
        "p50_c1_ms": statistics.median(t["c1"]["latency_ms"]["p50"] for t in turns),
        "p99_c1_ms": statistics.median(t["c1"]["latency_ms"]["p99"] for t in turns),
        "decisions_per_s_c8": statistics.median(t["c8"]["decisions_per_s"] for t in turns),
        "cpu_ms_per_decision_c8": statistics.median(
            t["c8"]["server"]["cpu_ms_per_decision"] + t["c8"]["others"]["database"]["cpu_ms_per_decision"]
            for t in turns
        ),
        "idle_cores": statistics.median(sum(t["idle_cores"].values()) for t in turns),
        "audit_sent": sum(t["audit"]["sent"] for t in turns),
        "audit_shipped": sum(t["audit"]["shipped"] for t in turns),
        "audit_behind_at_end_max": max(t["audit"]["behind_at_end"] for t in turns),
    }


# -- label → new version -------------------------------------------------------------------------------


def _request(row: dict[str, float | str], request_id: str) -> Any:
    from riskserve.proto.riskserve.v1 import risk_pipeline_pb2 as pb

    numeric = {k: float(v) for k, v in row.items() if isinstance(v, float)}
    categorical = {k: str(row[k]) for k in ("merchant_category", "channel")}
    return pb.DecideRequest(request_id=request_id, numeric=numeric, categorical=categorical)


def label_turn(copy: Copy, tx: Any, start: int) -> dict[str, Any]:
    """Decide transactions ``start..start+16``, label them by decision id, and time from the last label's
    acknowledgement until a ``Decide`` (one every :data:`POLL_S`) answers with another fraud version
    (the demo's feedback loop, ``riskserve/demo/run.py``, timed the same way)."""
    from riskserve.client import RiskClient

    assert copy.system is not None
    with RiskClient(copy.system.target, pipeline=PIPELINE, timeout_s=10) as client:
        probe = _request(tx.row(0), "probe")

        def fraud_version() -> str:
            answer = client.decide_request(probe)
            return next(m.version for m in answer.models if m.model == "fraud")

        before = fraud_version()
        rows = range(start, start + LABEL_BATCH)
        ids = [client.decide_request(_request(tx.row(i), f"tx-{i}")).decision_id for i in rows]
        labelled = time.perf_counter()
        for i, decision_id in zip(rows, ids, strict=True):
            ack = client.feedback(
                decision_id=decision_id, label=int(tx.is_fraud[i]), feedback_id=f"fb-{i}", source="bench"
            )
            assert ack.accepted, (i, ack)
            assert not ack.duplicate, (i, ack)
        acked = time.perf_counter()
        polls, version = 0, before
        while version == before and time.perf_counter() - acked < LABEL_WAIT_S:
            next_poll = acked + (polls + 1) * POLL_S
            time.sleep(max(0.0, next_poll - time.perf_counter()))
            version = fraud_version()
            polls += 1
        seen = time.perf_counter()
    return {
        "start": start,
        "labels_s": acked - labelled,
        "label_to_version_s": seen - acked if version != before else None,
        "polls": polls,
        "before": before,
        "after": version,
    }


def label_rounds(copies: Sequence[Copy], database: Running, plan: Plan) -> dict[str, Any]:
    """Both learning copies up; each round a label turn of each (order alternated, the other frozen), on
    the same transactions for both; the medians per backend."""
    from riskserve.demo.dataset import generate_transactions

    tx = generate_transactions(LABEL_BATCH * (plan.label_turns + 1), seed=2027)
    rounds: list[dict[str, Any]] = []
    for index in range(plan.label_turns):
        order = list(copies) if index % 2 == 0 else list(reversed(copies))
        turns: dict[str, dict[str, Any]] = {}
        for copy in order:
            with idle(copies, copy, database):
                assert copy.system is not None
                settle(copy.system, patience_s=10.0)
                turns[copy.backend] = turn = label_turn(copy, tx, LABEL_BATCH * (index + 1))
            waited = turn["label_to_version_s"]
            took = f"{waited * 1e3:.0f} ms" if waited is not None else f"NOT within {LABEL_WAIT_S:.0f} s"
            log(
                f"label turn {index + 1}/{plan.label_turns}, {copy.backend}: {LABEL_BATCH} labels "
                f"acknowledged in {turn['labels_s'] * 1e3:.0f} ms; fraud {turn['before']} -> {turn['after']} "
                f"{took} after the last"
            )
        rounds.append({"first": order[0].backend, "turns": turns})
    medians = {}
    for backend in BACKENDS:
        times = [r["turns"][backend]["label_to_version_s"] for r in rounds]
        done = [t for t in times if t is not None]
        median = statistics.median(t if t is not None else math.inf for t in times)  # a miss: never
        medians[backend] = {
            "label_to_version_s": median if math.isfinite(median) else None,
            "label_to_version_s_max": max(done) if len(done) == len(times) else None,
            "missed": len(times) - len(done),
            "labels_s": statistics.median(r["turns"][backend]["labels_s"] for r in rounds),
        }
    return {"rounds": rounds, "medians": medians}


def learning_status(copy: Copy) -> dict[str, Any]:
    """``riskserve learning`` of the copy (the learner's batches and the audit writers' counts), trimmed to
    what the report needs; the command's error when it fails (it is informative, not measured)."""
    code, output = copy.riskserve("learning", PIPELINE, timeout_s=120.0)
    start, end = output.find("\n{") + 1, output.rfind("\n}") + 2
    if output.startswith("{"):
        start = 0
    try:
        status: dict[str, Any] = json.loads(output[start:end])
    except ValueError:
        return {"error": f"riskserve learning exited {code}: {output[-1500:]}"}
    fraud = status.get("models", {}).get("fraud", {})
    return {
        "fraud": {k: v for k, v in fraud.items() if k != "last_report"},
        "fraud_last_report": fraud.get("last_report"),
        "audit": status.get("audit"),
        "replicas_answered": status.get("replicas_answered"),
    }


# -- the report ----------------------------------------------------------------------------------------


def targets(latency: dict[str, Any], labels: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's targets with this run's figures: PostgreSQL within 5% of SQLite (medians of the rounds'
    ratios), and label → new version at most 1 s on each backend (medians over turns)."""
    out: list[dict[str, Any]] = []
    if "ratios_median" in latency:
        rounds = f"median of {len(latency['rounds'])} paired rounds"
        p50 = latency["ratios_median"]["p50_c1"]
        out.append({
            "target": "PostgreSQL/SQLite c=1 p50", "value": p50, "limit": f"<= {1 + LIMIT_RATIO:.2f}x",
            "met": p50 <= 1 + LIMIT_RATIO, "source": rounds,
        })  # fmt: skip
        rate = latency["ratios_median"]["throughput_c8"]
        out.append({
            "target": "PostgreSQL/SQLite c=8 decisions/s (one connection)", "value": rate,
            "limit": f">= {1 - LIMIT_RATIO:.2f}x", "met": rate >= 1 - LIMIT_RATIO, "source": rounds,
        })  # fmt: skip
    for backend, figures in labels.get("medians", {}).items():
        value, worst = figures["label_to_version_s"], figures["label_to_version_s_max"]
        turns = len(labels["rounds"])
        out.append({
            "target": f"label -> new version serving, {backend} (s)",
            "value": value, "limit": f"<= {LIMIT_LABEL_S:g} s",
            "met": value is not None and value <= LIMIT_LABEL_S,
            "source": f"median of {turns} turns ({figures['missed']} missed, counted as never), max "
            + ("-" if worst is None else f"{worst:.3f} s"),
        })  # fmt: skip
    return out


def print_report(latency: dict[str, Any], labels: dict[str, Any], verdicts: Sequence[dict[str, Any]]) -> None:
    """The per-backend medians, each round's ratios, the label turns, and one line per target."""
    if "medians" in latency:
        print(f"\n{PIPELINE} with the audit trail, {len(latency['rounds'])} alternating rounds (medians)")
        print(
            f"{'backend':<11} | {'c=1 p50':>8} {'p99':>7} | {'c=8 dec/s':>9} | {'CPU-ms/dec':>10} | "
            f"{'idle cores':>10} | audit records in/sent"
        )
        for backend, m in latency["medians"].items():
            print(
                f"{backend:<11} | {m['p50_c1_ms']:>8.3f} {m['p99_c1_ms']:>7.3f} | "
                f"{m['decisions_per_s_c8']:>9.0f} | "
                f"{m['cpu_ms_per_decision_c8']:>10.3f} | {m['idle_cores']:>10.3f} | "
                f"{m['audit_shipped']}/{m['audit_sent']} "
                f"(at most {m['audit_behind_at_end_max']} behind at a turn's end)"
            )
        print("PostgreSQL/SQLite per round:")
        for key in RATIOS:
            each = ", ".join(f"{r['ratios'][key]:.3f}" for r in latency["rounds"])
            print(f"  {key:<14} median {latency['ratios_median'][key]:.3f}x  ({each})")
    if "medians" in labels:
        print(f"\nlabel -> new version ({LABEL_BATCH} labels, then a Decide every {POLL_S * 1e3:.0f} ms)")
        for backend, m in labels["medians"].items():
            each = ", ".join(
                f"{t * 1e3:.0f}" if (t := r["turns"][backend]["label_to_version_s"]) is not None else "miss"
                for r in labels["rounds"]
            )
            median = "-" if m["label_to_version_s"] is None else f"{m['label_to_version_s'] * 1e3:.0f} ms"
            print(
                f"  {backend:<11} median {median} ({each} ms); labels acknowledged in "
                f"{m['labels_s'] * 1e3:.0f} ms"
            )
    if verdicts:
        print("\ntargets in this run")
        for v in verdicts:
            mark = "met" if v["met"] else "MISSED"
            value = "-" if v["value"] is None else f"{v['value']:.3f}"
            print(f"  {v['target']:<52} {value:>7}  {v['limit']:<9} {mark:<6}  ({v['source']})")


def plot(out_dir: Path, latency: dict[str, Any], labels: dict[str, Any]) -> Path:
    """Four panels of bars, one bar per round and backend: c=1 p50, c=1 p99, c=8 decisions/s, and label →
    new version; each backend's median as a dashed line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(2, 2, figsize=(12, 8))
    panels: list[tuple[Any, str, str, list[list[float | None]]]] = []
    rounds = latency.get("rounds", [])
    picks: tuple[tuple[Any, str, str, Callable[[dict[str, Any]], float]], ...] = (
        (axes[0][0], "Decide at concurrency 1: p50", "ms", lambda t: t["c1"]["latency_ms"]["p50"]),
        (axes[0][1], "Decide at concurrency 1: p99", "ms", lambda t: t["c1"]["latency_ms"]["p99"]),
        (
            axes[1][0],
            "Decide at concurrency 8, one connection",
            "decisions/s",
            lambda t: t["c8"]["decisions_per_s"],
        ),
    )
    for axis, title, unit, pick in picks:
        panels.append((axis, title, unit, [[pick(r["turns"][b]) for r in rounds] for b in BACKENDS]))
    times = [[r["turns"][b]["label_to_version_s"] for r in labels.get("rounds", [])] for b in BACKENDS]
    panels.append((axes[1][1], f"label -> new version ({LABEL_BATCH} labels)", "ms",
                   [[t * 1e3 if t is not None else None for t in series] for series in times]))  # fmt: skip
    for axis, title, unit, series in panels:
        width = 0.8 / len(BACKENDS)
        for k, (backend, values) in enumerate(zip(BACKENDS, series, strict=True)):
            shown = [v if v is not None else 0.0 for v in values]
            offsets = [i - 0.4 + width * (k + 0.5) for i in range(len(values))]
            bars = axis.bar(offsets, shown, width, label=backend, color=f"C{k}")
            axis.bar_label(bars, labels=[f"{v:.3g}" if v is not None else "miss" for v in values], fontsize=7)
            done = [v for v in values if v is not None]
            if done:
                axis.axhline(statistics.median(done), color=f"C{k}", ls="--", lw=1)
        label = "turn" if "label" in title else "round"
        axis.set_xticks(list(range(len(series[0]))), [str(i + 1) for i in range(len(series[0]))])
        axis.set_xlabel(f"{label} (dashed: median)")
        axis.set_title(title)
        axis.set_ylabel(unit)
        axis.grid(True, axis="y", alpha=0.3)
        if "label" in title:
            axis.axhline(LIMIT_LABEL_S * 1e3, color="red", lw=1, label="target")
        axis.legend(fontsize=8)
    figure.suptitle(f"{PIPELINE} with the audit trail: the state store on SQLite and on PostgreSQL")
    return save_figure(figure, out_dir, "state_backends")


# -- main ----------------------------------------------------------------------------------------------


def _phase(what: str, run: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """One part of the run, timed; a part that fails is recorded with its error and the run goes on."""
    started = time.perf_counter()
    try:
        result = run()
    except (RuntimeError, subprocess.SubprocessError, OSError, AssertionError) as error:
        log(f"{what}: FAILED: {error}")
        result = {"error": str(error)}
    log(f"{what}: done in {time.perf_counter() - started:.0f} s")
    return result


def _commit() -> str:
    done = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    )
    dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain"], capture_output=True, text=True)
    return done.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def run(models: Path, plan: Plan, run_dir: Path) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """PostgreSQL up, the hot path's rounds, then the label turns; every server stopped after whatever
    happens. A part that fails is recorded with its error and the run goes on."""
    extra: dict[str, Any] = {}
    log("starting PostgreSQL (tests/pg_server.py)")
    with postgresql() as (server, database):
        version = server._run("postgres", "--version").stdout.strip()
        log(f"PostgreSQL serves on 127.0.0.1:{server.port} ({version}, pid {database.root_pid})")
        extra["postgresql"] = version

        def hot_path() -> dict[str, Any]:
            copies = copies_for("latency", models, run_dir, server)
            with both_up(copies, database, plan.window):
                log(f"hot path: {plan.rounds} alternating rounds (c=1, c=8; the idle copy frozen)")
                return latency_rounds(copies, database, plan)

        def label_to_version() -> dict[str, Any]:
            copies = copies_for("learning", models, run_dir, server)
            with both_up(copies, database, plan.window):
                log(f"label -> new version: {plan.label_turns} turns per backend, alternated")
                found = label_rounds(copies, database, plan)
                found["learning_status"] = {copy.backend: learning_status(copy) for copy in copies}
                return found

        latency = _phase("hot path", hot_path)
        labels = _phase("label -> new version", label_to_version)
        log("stopping PostgreSQL")
    return latency, labels, extra


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", type=Path, default=ROOT / "models", help="demo models (make models)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    parser.add_argument(
        "--quick", action="store_true", help="1 round, 2 label turns, short windows: a smoke run"
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    from tests.pg_server import pg_bin

    if pg_bin() is None:
        print("state_backends: PostgreSQL is not installed (apt-get install postgresql)", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a stopped run still stops what it started
    models = args.models.resolve()
    plan = QUICK if args.quick else FULL
    load = os.getloadavg()
    commit = _commit()
    started = time.perf_counter()
    log(
        f"models {models}; load average {load[0]:.2f}; commit {commit}; "
        f"{'quick' if args.quick else 'full'} plan"
    )
    # Same disk as PostgreSQL's data directory (tests/pg_server.py puts it in the temporary directory).
    with tempfile.TemporaryDirectory(prefix="riskserve-state-backends-") as directory:
        latency, labels, extra = run(models, plan, Path(directory))
    verdicts = targets(latency, labels)
    print_report(latency, labels, verdicts)
    document = {
        "latency": latency,
        "label_to_version": labels,
        "targets": verdicts,
        "settings": {
            "quick": args.quick,
            "plan": asdict(plan),
            "channels": 1,
            "models": str(models),
            "pipeline": PIPELINE,
            "label_batch": LABEL_BATCH,
            "poll_ms": POLL_S * 1e3,
            **extra,
        },
        "machine": {"cpus": os.cpu_count(), "load_average_at_start": load},
        "commit": commit,
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "seconds": time.perf_counter() - started,
    }
    json_path = write_results(args.out, "state_backends", document)
    png = plot(args.out, latency, labels)
    print(f"\nresults: {json_path}\nplot:    {png}")
    failed = "error" in latency or "error" in labels
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
