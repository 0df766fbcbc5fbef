"""The Serve application's deployments are named from ``schema/deployments.py``, and test-only backend
kinds travel to the replicas that build them (built without Ray: ``build_application`` only binds)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from riskserve.operations.app import build_application
from riskserve.schema.deployments import FEEDBACK, INGRESS, deployment_names, model_deployment
from riskserve.schema.pipeline import load_pipeline, parse_pipeline
from tests import fault_injection

PIPELINES = Path(__file__).resolve().parents[2] / "deploy" / "pipelines"


def _deployments(app: Any) -> dict[str, Any]:
    """Every deployment bound into the application, by name (the ingress and what its arguments bind)."""
    found: dict[str, Any] = {}

    def visit(value: Any) -> None:
        if hasattr(value, "_bound_deployment"):
            deployment = value._bound_deployment
            found[deployment.name] = deployment
            for arg in (*deployment.init_args, *deployment.init_kwargs.values()):
                visit(arg)
        elif isinstance(value, dict):
            for item in value.values():
                visit(item)

    visit(app)
    return found


def test_the_application_names_its_deployments_from_one_place() -> None:
    spec = load_pipeline(PIPELINES / "card_fraud.yaml")
    built = _deployments(build_application(spec))
    assert (
        set(built) == set(deployment_names(spec).values()) == {INGRESS, model_deployment("intent"), FEEDBACK}
    )
    assert all("registered" not in d.init_kwargs for d in built.values())  # nothing test-only to hand on


def test_a_registered_test_kind_travels_to_the_replicas_that_build_it() -> None:
    data = yaml.safe_load((PIPELINES / "tabular_only.yaml").read_text())
    data["models"]["fraud"].update(
        kind=fault_injection.KIND, settings={"inner_kind": "sklearn", "control_file": "/nonexistent"}
    )
    data["models"]["fraud"].pop("placement", None)
    with fault_injection.registered():
        spec = parse_pipeline(data, base_dir=PIPELINES)
        built = _deployments(build_application(spec))
    entry = {fault_injection.KIND: ("tests.fault_injection", "FaultInjectingModel", "FaultInjectionSettings")}
    assert built[model_deployment("fraud")].init_kwargs["registered"] == entry
    assert built[INGRESS].init_kwargs["registered"] == entry  # the ingress validates the spec it is given


def test_the_ingress_runs_on_serves_own_event_loop_unless_the_yaml_asks_for_a_separate_one() -> None:
    data = yaml.safe_load((PIPELINES / "card_fraud.yaml").read_text())
    shared = _deployments(build_application(parse_pipeline(data, base_dir=PIPELINES)))
    env = {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0"}
    assert shared[INGRESS].ray_actor_options["runtime_env"] == {"env_vars": env}
    # Only the ingress, whose gRPC front door shares grpc's poller with Serve's own server, is changed.
    assert all("runtime_env" not in d.ray_actor_options for n, d in shared.items() if n != INGRESS)
    data.setdefault("serving", {}).setdefault("ingress", {})["event_loop"] = "separate"
    separate = _deployments(build_application(parse_pipeline(data, base_dir=PIPELINES)))
    assert "runtime_env" not in separate[INGRESS].ray_actor_options
    assert separate[INGRESS].version != shared[INGRESS].version  # a change of loop restarts the replicas


def test_an_llm_placed_in_the_ingress_gets_no_deployment_and_no_artifact_in_the_config() -> None:
    data = yaml.safe_load((PIPELINES / "card_fraud.yaml").read_text())
    data["models"]["intent"].update(placement="ingress", pool="cpu", num_cpus=0.5)
    spec = parse_pipeline(data, base_dir=PIPELINES)
    built = _deployments(build_application(spec))
    assert set(built) == set(deployment_names(spec).values()) == {INGRESS, FEEDBACK}
    ingress = built[INGRESS]
    assert ingress.user_config == {"draining": False}  # versions come from the record, not the config
    # the ingress's CPUs carry the engine: its own 0.25, the tabular models' 2 x 0.25, the LLM's 0.5
    assert ingress.ray_actor_options["num_cpus"] == pytest.approx(1.25)
    assert ingress._deployment_config.health_check_timeout_s == 10.0
