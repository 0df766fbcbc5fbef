"""The Serve deployments a pipeline becomes, named in one place.

The application builder names its deployments with these, and every handle to them (operations, the
feedback service, status, tests) asks for them by these names, so a rename is one edit.
"""

from __future__ import annotations

from typing import Final

from riskserve.schema.pipeline import PipelineSpec

__all__ = ["FEATURES", "FEEDBACK", "INGRESS", "deployment_names", "model_deployment"]

INGRESS: Final = "ingress"
"""The request path's deployment (front door, flow, models placed in the ingress)."""
FEATURES: Final = "features"
"""The feature stage, when it is a deployment of its own (``serving.feature_stage: deployment``)."""
FEEDBACK: Final = "feedback"
"""The feedback service (labels, online learning), with a ``feedback`` section."""


def model_deployment(model: str) -> str:
    """The deployment of a model placed in a deployment of its own (``placement: deployment``)."""
    return f"model-{model}"


def deployment_names(spec: PipelineSpec) -> dict[str, str]:
    """Serve deployment name of each stage of ``spec``: the ingress, each model in its own deployment
    (by model name), the feature stage when it is a deployment, and the feedback service with feedback."""
    names = {INGRESS: INGRESS}
    if spec.serving.feature_stage != "ingress":
        names[FEATURES] = FEATURES
    names.update({m: model_deployment(m) for m, model in spec.models.items() if not model.in_ingress})
    if spec.feedback is not None:
        names[FEEDBACK] = FEEDBACK
    return names
