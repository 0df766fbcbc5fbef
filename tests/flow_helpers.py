"""A pipeline's decision flow in process, as an ingress replica builds it, without Ray: the models placed in
the ingress are real (compiled trees, logistic regression) and run there as function calls anyway."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from riskserve.features.stage import FeatureStage
from riskserve.platform.runner import ModelRunner
from riskserve.schema.pipeline import PipelineSpec, parse_pipeline
from riskserve.serving.flow import DecisionFlow
from riskserve.serving.guarded_call import GuardedModel, LocalEndpoint
from riskserve.serving.reasons import ReasonExplainer
from riskserve.serving.shadow import Shadows
from riskserve.wrappers import backend

from .conftest import PIPELINES


def tabular_document(artifacts: Path, **reasons: Any) -> dict[str, Any]:
    """``tabular_only.yaml`` with its models at ``artifacts/{credit,fraud}`` and ``reasons`` overridden."""
    document: dict[str, Any] = yaml.safe_load((PIPELINES / "tabular_only.yaml").read_text())
    for name in ("credit", "fraud"):
        document["models"][name]["artifact"] = str(artifacts / name)
    document["reasons"] = {**document["reasons"], **reasons}
    return document


async def serve_runners(spec: PipelineSpec) -> dict[str, ModelRunner]:
    """One loaded runner per model, as the ingress holds them."""
    runners = {}
    for name, model in spec.models.items():
        runner = ModelRunner(
            name, model.kind, dict(model.settings), spec.features.column_names(), spec.model_columns(name),
            backends=backend, placement="ingress",
        )  # fmt: skip
        await runner.serve(str(spec.artifact_path(name)))
        runners[name] = runner
    return runners


def flow_of(
    document: dict[str, Any],
    runners: dict[str, ModelRunner],
    *,
    explain: bool = True,
    shadows: Shadows | None = None,
) -> DecisionFlow:
    """The decision flow an ingress replica builds from ``document`` around ``runners``."""
    spec = parse_pipeline(document)
    guarded = {
        name: GuardedModel.build(name, spec.models[name], LocalEndpoint(runner, spec.serving.inline_rows))
        for name, runner in runners.items()
    }
    explainer = ReasonExplainer(spec, runners) if explain and spec.reasons is not None else None
    return DecisionFlow(
        spec,
        models=guarded,
        local_stage=FeatureStage(document["features"]),
        explainer=explainer,
        shadows=shadows,
    )
