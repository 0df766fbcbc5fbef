"""What reason codes cost per decision, and where XGBoost's TreeSHAP is fastest.

In one process, no Ray (models placed in the ingress run in process anyway), on the demo models:

* per-row cost of each model's exact contributions at batch 1 / 8 / 64 / 1000: the logistic regression
  from its coefficients, the trees as served (the per-leaf tables of ``riskserve/wrappers/treeshap.py``,
  or XGBoost where the loader's gate kept it), and XGBoost ``pred_contribs`` on the served booster with 1
  and 2 threads (the compiled library cannot give contributions);
* the decision flow of ``tabular_only`` (features, both models, rules, response) for one DECLINE and one
  APPROVE per call, with the pipeline's ``reasons`` section and without it: the difference is the cost a
  declined decision pays, and an APPROVE pays nothing.

Run under the heavy lock: ``/work/heavy .venv/bin/python bench/reasons.py --models models`` (also in
``make bench``). Writes ``bench/out/reasons.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import summary, time_calls, write_results

REPO = Path(__file__).resolve().parents[1]
DECLINE = {
    "numeric": {"amount": 2500.0, "account_age_days": 3.0, "txn_velocity_1h": 9.0, "hour": 3.0,
                "country_mismatch": 1.0, "device_change": 1.0},
    "categorical": {"merchant_category": "crypto", "channel": "online"},
}  # fmt: skip
APPROVE = {
    "numeric": {"amount": 23.5, "account_age_days": 2400.0, "txn_velocity_1h": 0.0, "hour": 12.0},
    "categorical": {"merchant_category": "grocery", "channel": "pos"},
}


async def build_flow(models: Path, with_reasons: bool, shadow: dict[str, Any] | None = None) -> Any:
    """The ``tabular_only`` decision flow on ``models`` as an ingress replica builds it (in process), with or
    without its reasons section, and with ``shadow`` (settings of a shadow of ``fraud``) if given."""
    from riskserve.features.stage import FeatureStage
    from riskserve.platform.runner import ModelRunner
    from riskserve.schema.pipeline import parse_pipeline
    from riskserve.serving.flow import DecisionFlow
    from riskserve.serving.guarded_call import GuardedModel, LocalEndpoint
    from riskserve.serving.reasons import ReasonExplainer
    from riskserve.serving.shadow import Shadows
    from riskserve.wrappers import backend

    document = yaml.safe_load((REPO / "deploy" / "pipelines" / "tabular_only.yaml").read_text())
    for name in ("credit", "fraud"):
        document["models"][name]["artifact"] = str(models / name)
    if not with_reasons:
        document.pop("reasons")
    spec = parse_pipeline(document)
    runners, guarded = {}, {}
    for name, model in spec.models.items():
        runner = ModelRunner(
            name, model.kind, dict(model.settings), spec.features.column_names(), spec.model_columns(name),
            backends=backend, placement="ingress",
        )  # fmt: skip
        await runner.serve(str(spec.artifact_path(name)))
        runners[name] = runner
        guarded[name] = GuardedModel.build(name, model, LocalEndpoint(runner, spec.serving.inline_rows))
    explainer = ReasonExplainer(spec, runners) if with_reasons else None
    shadows = None
    if shadow is not None:
        shadows = Shadows(spec, runners)
        await shadows.configure({"fraud": shadow})
        assert shadows.active, shadows.errors
    flow = DecisionFlow(
        spec,
        models=guarded,
        local_stage=FeatureStage(document["features"]),
        explainer=explainer,
        shadows=shadows,
    )
    return flow, runners


def _decisions(flow: Any, body: dict[str, Any], repeats: int) -> dict[str, float]:
    from riskserve.proto.riskserve.v1 import risk_pipeline_pb2 as pb

    request = pb.DecideRequest(request_id="bench", **body)
    loop = asyncio.new_event_loop()

    def call() -> None:
        loop.run_until_complete(flow.decide([request], "t", time.monotonic() + 30, False))

    result = summary(time_calls(call, repeats=repeats, warmup=20), 1)
    loop.close()
    return result


def _contributions(runners: dict[str, Any], repeats: int) -> dict[str, Any]:
    import xgboost

    from riskserve.demo.dataset import generate_transactions, tabular_features

    x_all = tabular_features(generate_transactions(512, seed=99))
    out: dict[str, Any] = {}
    engine = runners["credit"]._current().host.model._engine  # the served engine itself
    booster = engine.booster
    for batch in (1, 8, 64, 1000):
        x = np.ascontiguousarray(np.resize(x_all, (batch, x_all.shape[1])))
        calls = repeats if batch < 1000 else max(repeats // 10, 5)
        fraud = summary(time_calls(lambda: runners["fraud"].contributions(x), repeats=calls), batch)
        credit = summary(time_calls(lambda: runners["credit"].contributions(x), repeats=calls), batch)
        xgb_calls = max(calls // 5, 5)
        one = summary(
            time_calls(lambda: booster.predict(xgboost.DMatrix(x, nthread=1), pred_contribs=True),
                       repeats=xgb_calls),
            batch,
        )  # fmt: skip
        booster.set_param({"nthread": 2})
        two = summary(
            time_calls(lambda: booster.predict(xgboost.DMatrix(x, nthread=2), pred_contribs=True),
                       repeats=xgb_calls),
            batch,
        )  # fmt: skip
        booster.set_param({"nthread": 1})
        out[str(batch)] = {
            "lr_us_per_row": fraud["median_us"] / batch,
            "trees_served_us_per_row": credit["median_us"] / batch,
            "trees_served_by": engine.details["explainer"],
            "xgb_treeshap_1thread_us_per_row": one["median_us"] / batch,
            "xgb_treeshap_2threads_us_per_row": two["median_us"] / batch,
        }
        row = out[str(batch)]
        print(f"batch {batch:>4}: LR {row['lr_us_per_row']:7.1f} µs/row   trees as served "
              f"({row['trees_served_by']}) {row['trees_served_us_per_row']:7.1f} µs/row   XGBoost TreeSHAP "
              f"1 thread {row['xgb_treeshap_1thread_us_per_row']:7.1f}, 2 threads "
              f"{row['xgb_treeshap_2threads_us_per_row']:7.1f} µs/row")  # fmt: skip
    return out


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", type=Path, default=REPO / "models")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "out")
    parser.add_argument("--repeats", type=int, default=300)
    args = parser.parse_args()
    with_reasons, runners = asyncio.run(build_flow(args.models.resolve(), True))
    without, _ = asyncio.run(build_flow(args.models.resolve(), False))
    print("exact contributions, median per row:")
    contributions = _contributions(runners, max(args.repeats // 3, 30))
    decisions: dict[str, Any] = {}
    for label, body in (("decline", DECLINE), ("approve", APPROVE)):
        for name, flow in (("with_reasons", with_reasons), ("without_reasons", without)):
            decisions[f"{label}_{name}"] = _decisions(flow, body, args.repeats)
    print("one decision through the flow (features, models, rules, response), median / p99:")
    for key, value in decisions.items():
        print(f"  {key:<24} {value['median_us']:8.0f} µs  {value['p99_us']:8.0f} µs")
    cost = {
        label: decisions[f"{label}_with_reasons"]["median_us"]
        - decisions[f"{label}_without_reasons"]["median_us"]
        for label in ("decline", "approve")
    }
    print(f"reasons cost per decision (median difference): DECLINE {cost['decline']:.0f} µs, "
          f"APPROVE {cost['approve']:.0f} µs (nothing is computed for it: noise)")  # fmt: skip
    path = write_results(
        args.out,
        "reasons",
        {"contributions": contributions, "decisions": decisions, "reasons_cost_us": cost},
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
