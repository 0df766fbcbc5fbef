"""What the decision audit trail costs, in one process: the request path's part and the writer's.

* ``submit``: the time :meth:`AuditWriter.submit` takes on the request path per decision (one record per
  call, like ``Decide``), with the write-ahead journal (one ``write`` to the kernel, the default) and
  without it (memory only: a ``kill -9`` loses what is buffered);
* ``record``: building the record from a decision (``audit_records``) per decision;
* ``writer``: the background thread's CPU per record shipped to the state database and the records/s it
  sustains (batches of ``batch_rows``; the embedded SQLite one in a temporary directory, WAL,
  ``synchronous=FULL``, unless ``--dsn`` names another, e.g. a PostgreSQL database to fill).

Run: ``.venv/bin/python bench/audit.py [--records 20000] [--dsn DSN]`` (in ``make bench``); prints JSON and
writes ``bench/results/audit.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import write_results
from riskserve.audit import AuditWriter
from riskserve.features.encoder import RawRequest
from riskserve.schema.pipeline import load_pipeline
from riskserve.schema.rules import Decision, ModelResult
from riskserve.serving.auditing import audit_records
from riskserve.serving.reasons import Reason
from riskserve.state.db import Database, open_database

ROOT = Path(__file__).resolve().parents[1]


def _records(n: int) -> list[list[dict[str, object]]]:
    spec = load_pipeline(ROOT / "deploy" / "pipelines" / "card_fraud.yaml")
    raw = RawRequest(
        numeric={"amount": 2500.0, "account_age_days": 3.0, "txn_velocity_1h": 9.0, "hour": 3.0,
                 "country_mismatch": 1.0, "device_change": 1.0},
        categorical={"merchant_category": "crypto", "channel": "online"},
        text="urgent, send it now before the deadline",
    )  # fmt: skip
    labels = {"intent": "urgent"}
    results = {name: ModelResult(name, "v" * 16, 0.42, label=labels.get(name, "")) for name in spec.models}
    decision = Decision("DECLINE", 0.91, ["high_risk: combined risk score is 0.6 or more"])
    reasons = {0: [Reason("amount", "amount of the transaction", 1.2, "credit", "2500")] * 4}
    out: list[list[dict[str, object]]] = []
    for i in range(n):
        records = audit_records(
            spec, raw=[raw], request_ids=[f"r{i}"], decision_ids=[f"{i:032x}"],
            decided=[(decision, results)], reasons=reasons, trace_id="0" * 32,
        )  # fmt: skip
        out.append(records)  # type: ignore[arg-type]
    return out


def _database(directory: str, dsn: str | None) -> Database:
    """The state database records go to: ``dsn``, else a SQLite file in ``directory``."""
    return open_database(dsn or f"sqlite:///{Path(directory) / 'state.sqlite'}")


def _submit(records: list[list[dict[str, object]]], write_ahead: bool, dsn: str | None) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as directory:
        db = _database(directory, dsn)
        writer = AuditWriter(
            Path(directory), db, write_ahead=write_ahead, buffer_rows=len(records) + 1
        ).start()
        times = []
        for batch in records:
            started = time.perf_counter_ns()
            writer.submit(batch)  # type: ignore[arg-type]
            times.append(time.perf_counter_ns() - started)
        writer.flush(120)
        writer.close()
        db.close()
    times.sort()
    return {"p50_us": times[len(times) // 2] / 1e3, "p99_us": times[int(len(times) * 0.99)] / 1e3,
            "mean_us": statistics.fmean(times) / 1e3}  # fmt: skip


def _writer(records: list[list[dict[str, object]]], dsn: str | None) -> dict[str, float]:
    """Submit everything first (not started), then time the writer thread draining it."""
    with tempfile.TemporaryDirectory() as directory:
        db = _database(directory, dsn)
        writer = AuditWriter(Path(directory), db, buffer_rows=len(records) + 1)
        for batch in records:
            writer.submit(batch)  # type: ignore[arg-type]
        cpu: list[float] = []

        def drain() -> None:
            started = time.thread_time()
            writer.flush(300)
            cpu.append(time.thread_time() - started)

        wall = time.perf_counter()
        thread = threading.Thread(target=drain)
        thread.start()
        thread.join()
        wall = time.perf_counter() - wall
        writer.close()
        db.close()
    return {"cpu_us_per_record": cpu[0] / len(records) * 1e6, "records_per_s": len(records) / wall}


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--records", type=int, default=20_000)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    parser.add_argument("--dsn", help="the state database to ship to (default: a temporary SQLite file)")
    args = parser.parse_args()
    started = time.perf_counter()
    records = _records(args.records)
    build_us = (time.perf_counter() - started) / args.records * 1e6
    out = {
        "records": args.records,
        "record_build_us": build_us,
        "submit_write_ahead": _submit(records, True, args.dsn),
        "submit_memory_only": _submit(records, False, args.dsn),
        "writer": _writer(records, args.dsn),
        "record_bytes": len(json.dumps(records[0][0], separators=(",", ":"))),
    }
    print(json.dumps(out, indent=2))
    print(f"wrote {write_results(args.out, 'audit', out)}")


if __name__ == "__main__":
    main()
