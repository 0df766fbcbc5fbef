"""What a shadow candidate costs the decisions it watches: latency with no shadow, a 20% and a 100% sample.

In one process, no Ray, the ``tabular_only`` decision flow as an ingress replica runs it (features, both
models in process, rules, reasons), one decision per call on one event loop, with the shadow's background
scoring sharing that loop and the machine's cores, as it does in an ingress replica. The three runs
alternate in rounds, so drift in the machine's load hits them alike.

Run under the heavy lock: ``/work/heavy .venv/bin/python bench/shadow.py --models models`` (also in
``make bench``). The candidate is ``models/candidates/fraud`` (``riskserve models build --only fraud --seed
7 --out models/candidates``), built if missing. Writes ``bench/out/shadow.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import summary, write_results
from bench.reasons import REPO, build_flow

ROUNDS = 5


def main() -> int:
    from riskserve.demo.build import build_demo_models
    from riskserve.demo.dataset import generate_transactions
    from riskserve.proto.riskserve.v1 import risk_pipeline_pb2 as pb

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", type=Path, default=REPO / "models")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "out")
    parser.add_argument("--calls", type=int, default=400, help="decisions per system per round")
    args = parser.parse_args()
    models = args.models.resolve()
    (candidate,) = build_demo_models(models / "candidates", seed=7, only=["fraud"], progress=False)
    systems: dict[str, Any] = {
        "no shadow": asyncio.run(build_flow(models, True))[0],
        "shadow 20%": asyncio.run(build_flow(models, True, {"artifact": str(candidate.path), "sample": 0.2}))[
            0
        ],
        "shadow 100%": asyncio.run(
            build_flow(models, True, {"artifact": str(candidate.path), "sample": 1.0})
        )[0],
    }
    tx = generate_transactions(args.calls, seed=77)
    requests = [
        pb.DecideRequest(
            request_id=f"tx-{i}",
            numeric={k: float(v) for k, v in tx.row(i).items() if isinstance(v, float)},
            categorical={k: str(tx.row(i)[k]) for k in ("merchant_category", "channel")},
        )
        for i in range(args.calls)
    ]
    loop = asyncio.new_event_loop()
    samples: dict[str, list[float]] = {name: [] for name in systems}
    for _ in range(ROUNDS):
        for name, flow in systems.items():
            for request in requests:
                started = time.perf_counter()
                loop.run_until_complete(flow.decide([request], "t", time.monotonic() + 30, False))
                samples[name].append(time.perf_counter() - started)
    results: dict[str, Any] = {}
    print(f"{ROUNDS} rounds of {args.calls} sequential decisions each, median / p99:")
    for name, flow in systems.items():
        if flow.shadows is not None:
            loop.run_until_complete(flow.shadows.idle())
        figures = flow.shadows.figures({})[0].model_dump() if flow.shadows is not None else {}
        results[name] = {**summary(samples[name], 1), "compared": figures.get("compared"),
                         "dropped": figures.get("dropped")}  # fmt: skip
        extra = f"  compared {figures['compared']}, dropped {figures['dropped']}" if figures else ""
        print(f"  {name:<12} {results[name]['median_us']:7.0f} µs  {results[name]['p99_us']:7.0f} µs{extra}")
    loop.close()
    path = write_results(args.out, "shadow", results)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
