"""Where a ``DecideBatch`` of 1,000 rows spends its time, stage by stage, against the floor's same call.

In one process, no Ray and no gRPC (both add the same parse and serialization to either side): the
``tabular_only`` decision flow as an ingress replica builds it (``bench/reasons.py: build_flow``, reasons
included), stage by stage, and the floor's ``Floor.decide`` (``bench/floor_server.py``) on the same 1,000
requests. Each figure is the median of ``--repeats`` calls; the stages are timed one after the other on
one event loop, as the flow runs them (features on the loop, models and reasons in worker threads).

Run under the heavy lock: ``/work/heavy .venv/bin/python bench/batch_stages.py --models models``. Writes
``bench/out/batch_stages.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import write_results
from bench.floor_server import Floor
from bench.loadgen import make_requests
from bench.reasons import REPO, build_flow

STAGES = ("raw", "features", "models", "rules", "reasons", "responses")


async def measure(models: Path, rows: int, repeats: int) -> dict[str, Any]:
    """Median milliseconds of each stage of the flow, of the whole flow, and of the floor, on ``rows``."""
    from riskserve.serving.messages import decide_response, raw_request

    flow, _ = await build_flow(models, with_reasons=True)
    floor = await Floor.load(REPO / "deploy" / "pipelines" / "tabular_only.yaml", models)
    requests = make_requests(rows, 7, False)
    times: dict[str, list[float]] = {name: [] for name in (*STAGES, "sum", "flow", "floor")}
    flagged = 0
    for _ in range(repeats + 3):  # the first three warm up
        marks = [time.perf_counter()]
        raw = [raw_request(r) for r in requests]
        marks.append(time.perf_counter())
        stage = await flow._features(raw, time.monotonic() + 60, False)
        marks.append(time.perf_counter())
        per_model = await flow._run_models(stage, time.monotonic() + 60, False)
        marks.append(time.perf_counter())
        decisions = flow._engine.decide_batch(stage.rows, per_model)
        decided = [(d, {n: per_model[n][i] for n in flow._names}) for i, d in enumerate(decisions)]
        marks.append(time.perf_counter())
        reasons = await flow._reasons(stage, decided)
        marks.append(time.perf_counter())
        spec = flow.spec
        [
            decide_response(request_id="r", decision_id="d", decision=decision, results=results, spec=spec,
                            trace_id="t", top_reasons=reasons.get(i, ()))
            for i, (decision, results) in enumerate(decided)
        ]  # fmt: skip
        marks.append(time.perf_counter())
        for name, start, end in zip(STAGES, marks, marks[1:], strict=False):
            times[name].append((end - start) * 1e3)
        times["sum"].append((marks[-1] - marks[0]) * 1e3)
        flagged = len(reasons)
        started = time.perf_counter()
        await flow.decide(requests, "t", time.monotonic() + 60, False)
        times["flow"].append((time.perf_counter() - started) * 1e3)
        started = time.perf_counter()
        floor.decide(requests)
        times["floor"].append((time.perf_counter() - started) * 1e3)
    medians = {name: statistics.median(values[3:]) for name, values in times.items()}
    return {"rows": rows, "declined_or_reviewed": flagged, "repeats": repeats, "median_ms": medians,
            "flow_over_floor": medians["flow"] / medians["floor"]}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=Path, default=REPO / "models")
    parser.add_argument("--rows", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "out")
    args = parser.parse_args()
    result = asyncio.run(measure(args.models.resolve(), args.rows, args.repeats))
    medians = result["median_ms"]
    print(f"DecideBatch({args.rows}) in process, {result['declined_or_reviewed']} rows explained, medians:")
    for name in (*STAGES, "sum"):
        print(f"  {name:<10} {medians[name]:6.2f} ms")
    print(f"  flow.decide {medians['flow']:6.2f} ms against the floor's {medians['floor']:6.2f} ms: "
          f"{result['flow_over_floor']:.2f}x")  # fmt: skip
    path = write_results(args.out, "batch_stages", result)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
