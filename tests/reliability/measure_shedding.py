"""Measure overload at the default limits with and without queue-wait shedding (not a test: figures only).

For each ``max_queue_wait_ms`` given (0: off), a real ``riskserve up`` of the soak's pipeline (default
limits, two ingress and two fraud replicas), steady load at 40 decisions/s in this process, and a flood of
600 calls always in flight from a process of its own for 6 s; prints one JSON line of figures per value::

    PYTHONPATH=$PWD /work/heavy .venv/bin/python -m tests.reliability.measure_shedding 0 250
"""

from __future__ import annotations

import collections
import json
import sys
import tempfile
import time
from pathlib import Path

from riskserve.demo.build import build_demo_models

from .drills import RATE, Window, answer_times
from .flood import Flood
from .harness import PIPELINE, pipeline_file, replica_pids, riskserve_up, wait_for
from .load import LoadClient


def measure(models: Path, root: Path, wait_ms: float) -> dict[str, object]:
    path = pipeline_file(
        models, root, fraud_replicas=2, ingress_replicas=2, grpc={"max_queue_wait_ms": wait_ms}
    )
    with riskserve_up(path, root) as up:
        both = lambda: len(replica_pids("ingress")) == 2 and len(replica_pids("model-fraud")) == 2  # noqa: E731
        wait_for(both, 120, "replicas")
        with LoadClient(up.target, pipeline=PIPELINE, rate=RATE, seed=1) as steady:
            time.sleep(5)
            with Flood(
                up.target, pipeline=PIPELINE, workers=600, channels=8, deadline_s=2.0, seed=7
            ) as flood:
                time.sleep(6)
            window = Window("overload", flood.started, time.monotonic())
            time.sleep(6)
    flooded, report = flood.report(), steady.report()
    return {
        "max_queue_wait_ms": wait_ms,
        "flood": dict(flooded.kinds()),
        "flood_decisions": answer_times(flooded, "DECISION", window),
        "flood_refusals": answer_times(flooded, "RESOURCE_EXHAUSTED", window),
        "flood_deadline_exceeded": answer_times(flooded, "DEADLINE_EXCEEDED", window),
        "decisions_per_s_flood": round(flooded.kinds()["DECISION"] / (window.ended - window.started), 1),
        "steady_during": dict(
            collections.Counter(o.kind for o in report.of("Decide") if window.holds(o.sent))
        ),
        "steady_after": dict(
            collections.Counter(o.kind for o in report.outcomes if o.sent > window.ended + 3)
        ),
        "steady_decisions": answer_times(report, "DECISION", window),
        "steady_refusals": answer_times(report, "RESOURCE_EXHAUSTED", window),
    }


def main(argv: list[str]) -> None:
    with tempfile.TemporaryDirectory(prefix="shedding-") as tmp:
        models = Path(tmp) / "models"
        build_demo_models(models, seed=0, only=("credit", "fraud"), progress=False)
        for n, value in enumerate(argv or ["0", "250"]):
            root = Path(tmp) / f"run-{n}"
            root.mkdir()
            print(json.dumps(measure(models, root, float(value))), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
