"""``fault_injection`` is a test-only backend: a pipeline may name it only once a test registered it."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from riskserve.platform.errors import ConfigError
from riskserve.platform.runner import ModelRunner
from riskserve.schema.pipeline import load_pipeline
from riskserve.wrappers import BUILT_IN, backend, register_backend, registered_backends
from tests import fault_injection

PIPELINES = Path(__file__).resolve().parents[2] / "deploy" / "pipelines"


def _write(tmp_path: Path, inner_kind: str = "sklearn") -> Path:
    data: dict[str, Any] = yaml.safe_load((PIPELINES / "card_fraud.yaml").read_text())
    data = copy.deepcopy(data)
    for model in data["models"].values():
        model["artifact"] = str((PIPELINES / model["artifact"]).resolve())
    model = "intent" if inner_kind == "vllm" else "fraud"
    data["models"][model]["kind"] = fault_injection.KIND
    data["models"][model]["settings"] = {"inner_kind": inner_kind, "control_file": str(tmp_path / "c.json")}
    data["models"][model].pop("placement", None)
    data["models"][model].pop("online", None)  # only sklearn models learn online
    path = tmp_path / "drill.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_a_yaml_naming_fault_injection_without_the_registration_fails_at_load(tmp_path: Path) -> None:
    assert fault_injection.KIND not in BUILT_IN
    with pytest.raises(ConfigError) as info:
        load_pipeline(_write(tmp_path))
    message = str(info.value)
    assert "models.fraud.kind: Value error, unknown model kind 'fault_injection'" in message
    assert "register_backend" in message
    with pytest.raises(ConfigError, match="unknown model kind"):
        backend(fault_injection.KIND)  # nor can a replica build it


def test_registered_it_loads_serves_its_inner_kind_and_travels_to_the_replicas(tmp_path: Path) -> None:
    with fault_injection.registered():
        spec = load_pipeline(_write(tmp_path))
        fraud = spec.models["fraud"]
        assert not fraud.in_ingress  # a test-only kind defaults to a deployment of its own
        assert not fraud.reads_text
        assert load_pipeline(_write(tmp_path, inner_kind="vllm")).models["intent"].reads_text
        assert registered_backends({"fault_injection", "sklearn"}) == {
            "fault_injection": ("tests.fault_injection", "FaultInjectingModel", "FaultInjectionSettings")
        }
        runner = ModelRunner("fraud", fraud.kind, fraud.settings, None, backends=backend)
        assert runner.artifact_kind == "sklearn"  # its manifest and golden rows are the sklearn model's
    with pytest.raises(ConfigError, match="unknown model kind"):
        load_pipeline(_write(tmp_path))  # removed again after the test


def test_a_built_in_kind_cannot_be_replaced() -> None:
    with pytest.raises(ConfigError, match="built in"):
        register_backend("sklearn", "tests.fault_injection", "FaultInjectingModel", "FaultInjectionSettings")


def test_a_process_the_tests_start_registers_from_the_environment() -> None:
    """``riskserve up`` runs in processes of its own: a test names its hook in REGISTER_ENV for them."""
    import os
    import subprocess
    import sys

    from riskserve.wrappers import REGISTER_ENV

    root = Path(__file__).resolve().parents[2]
    probe = "from riskserve.wrappers import known_kind; print(known_kind('fault_injection'))"
    env = {**os.environ, "PYTHONPATH": str(root), REGISTER_ENV: "tests.fault_injection:register"}
    done = subprocess.run([sys.executable, "-c", probe], env=env, cwd=root, capture_output=True, text=True)
    assert done.stdout.strip() == "fault_injection", done.stderr
    env.pop(REGISTER_ENV)
    refused = subprocess.run([sys.executable, "-c", probe], env=env, cwd=root, capture_output=True, text=True)
    assert "unknown model kind 'fault_injection'" in refused.stderr
