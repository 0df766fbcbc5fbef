"""A/B of Ray's worker niceness: fresh ``riskserve up``s alternated with Ray's default (15) and with
``RAY_worker_niceness=0``, each measured with ``bench/hotpath.py``'s phases (BENCHMARKS.md, *Ray's worker
niceness*).

    .venv/bin/python bench/niceness_ab.py --pipeline tabular_only --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import hotpath

NICENESS_ENV = "RAY_worker_niceness"
"""Ray's setting (a ``RAY_CONFIG``, read from the environment of the process that starts Ray)."""
VARIANTS = {"niceness_15": None, "niceness_0": "0"}
"""The value of ``RAY_worker_niceness`` in ``riskserve up``'s environment (None: unset, Ray's 15)."""


def one_round(pipeline: str, models: Path, run_dir: Path, value: str | None) -> dict[str, Any]:
    """One fresh system: 20 s idle, 300 warm-up calls, c=1, c=8, one open-loop rate."""
    if value is None:
        os.environ.pop(NICENESS_ENV, None)
    else:
        os.environ[NICENESS_ENV] = value
    plan = hotpath.FULL
    with hotpath.running(pipeline, models, run_dir) as system:
        time.sleep(20)
        warmup = ["-c8", f"--calls={plan.warmup}", "--seconds=60", "--warmup=0", "--channels=1"]
        hotpath.loadgen(system, "closed", warmup, bound_s=90)
        c1 = hotpath.closed(system, 1, plan.c1_calls, plan, 1)
        c8 = hotpath.closed(system, 8, plan.c8_calls, plan, 1)
        rate = plan.llm_rates[-1] if system.text else plan.tabular_rates[-1]
        open_loop = hotpath.open_loop(system, rate, plan, 1)
    return {
        "c1_p50_ms": c1["latency_ms"]["p50"],
        "c1_p99_ms": c1["latency_ms"]["p99"],
        "c8_decisions_per_s": c8["decisions_per_s"],
        "c8_cpu_ms_per_decision": c8["server"]["cpu_ms_per_decision"],
        "open_rate": rate,
        "open_p50_ms": open_loop["latency_ms"]["p50"],
        "open_p99_ms": open_loop["latency_ms"]["p99"],
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pipeline", default="tabular_only", choices=["tabular_only", "card_fraud"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--models", type=Path, default=hotpath.ROOT / "models")
    parser.add_argument("--out", type=Path, default=hotpath.ROOT / "bench" / "out" / "niceness_ab")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for index in range(args.rounds):
        for variant, value in VARIANTS.items():
            measured = one_round(args.pipeline, args.models, args.out, value)
            row = {"round": index, "variant": variant, **measured}
            rows.append(row)
            hotpath.log(json.dumps(row))
    path = args.out / f"{args.pipeline}.json"
    path.write_text(json.dumps(rows, indent=1) + "\n")
    hotpath.log(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
