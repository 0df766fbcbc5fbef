"""The ``riskserve`` command line as a user runs it: subprocesses, a background local Ray, real gRPC.

Each pipeline's ingress serves its own gRPC port (``up --grpc-port``), and the tabular models run inside
the ingress by default: no ``model-*`` or ``features`` deployment exists for them.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from ..conftest import PIPELINES

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _riskserve(*args: str, env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "riskserve.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def cli_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    state = tmp_path_factory.mktemp("state")
    return {**os.environ, "RISKSERVE_STATE_DIR": str(state)}


@pytest.fixture(scope="module")
def tabular_yaml(demo_models: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    data = yaml.safe_load((PIPELINES / "tabular_only.yaml").read_text())
    for name, model in data["models"].items():
        model["artifact"] = str(demo_models / name)
        model["timeout_ms"] = 20_000  # values are checked: a loaded CI machine must not cause fallbacks
    data["audit"] = {"path": str(tmp_path_factory.mktemp("audit"))}
    # One ingress replica: this module starts it three times (up, and up again twice in the swap test);
    # what a swap or a publish does to every one of several replicas is test_hotswap's and
    # test_online_learning's (two each), the default two test_closed_by_default's.
    data["serving"] = {"ingress": {"replicas": 1}}
    path = tmp_path_factory.mktemp("pipelines") / "tabular_only.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def running(cli_env: dict[str, str], tabular_yaml: Path) -> Iterator[int]:
    port = _free_port()
    up = _riskserve("up", str(tabular_yaml), "--grpc-port", str(port), env=cli_env)
    assert up.returncode == 0, up.stderr + up.stdout
    assert f"tabular_only on 127.0.0.1:{port}" in up.stdout
    try:
        yield port
    finally:
        down = _riskserve("down", env=cli_env)
        assert down.returncode == 0, down.stderr
        assert "stopped riskserve" in down.stdout


def test_decide_and_describe_from_the_command_line(running: int, cli_env: dict[str, str]) -> None:
    fields = {"amount": 42.0, "account_age_days": 900, "txn_velocity_1h": 0, "hour": 14,
              "merchant_category": "grocery", "channel": "pos", "request_id": "cli-1"}  # fmt: skip
    decided = _riskserve("decide", "--pipeline", "tabular_only", "--json", json.dumps(fields), env=cli_env)
    assert decided.returncode == 0, decided.stderr
    response = json.loads(decided.stdout)
    assert response["request_id"] == "cli-1"
    assert response["decision"] == "APPROVE"
    assert [m["model"] for m in response["models"]] == ["credit", "fraud"]
    described = _riskserve("describe", "--pipeline", "tabular_only", env=cli_env)
    assert described.returncode == 0, described.stderr
    assert json.loads(described.stdout)["pipeline"] == "tabular_only"


def test_bad_input_and_unknown_pipeline_are_one_line_errors(running: int, cli_env: dict[str, str]) -> None:
    bad = _riskserve("decide", "--pipeline", "tabular_only", "--json", '{"amount": -5}', env=cli_env)
    assert bad.returncode == 2
    assert bad.stderr.startswith("error: amount: ")
    assert "Traceback" not in bad.stderr
    unknown = _riskserve("decide", "--pipeline", "nope", "--json", '{"amount": 5}', env=cli_env)
    assert unknown.returncode == 2
    assert unknown.stderr.startswith("error: no pipeline 'nope' is running (running: tabular_only)")
    assert "Traceback" not in unknown.stderr
    # Sent to tabular_only's own port, a call naming another pipeline is NOT_FOUND, never decided there.
    target = f"127.0.0.1:{running}"
    elsewhere = _riskserve(
        "decide", "--pipeline", "nope", "--target", target, "--json", '{"amount": 5}', env=cli_env
    )
    assert elsewhere.returncode == 2
    assert elsewhere.stderr.startswith("error: pipeline 'nope' is not served here")
    assert "Traceback" not in elsewhere.stderr


def test_status_shows_models_versions_and_health(
    running: int, cli_env: dict[str, str], demo_models: Path
) -> None:
    from riskserve.platform.artifacts import open_artifact

    status = _riskserve("status", env=cli_env)
    assert status.returncode == 0, status.stdout + status.stderr
    out = status.stdout
    assert f"tabular_only: RUNNING  gRPC 127.0.0.1:{running}" in out
    deployments = re.findall(r"^  (\S+)\s+(\S+)\s+replicas: (.*)$", out, re.MULTILINE)
    assert [(name, state) for name, state, _ in deployments] == [("ingress", "HEALTHY")], out
    assert "RUNNING" in deployments[0][2]
    for name, kind in (("credit", "treelite"), ("fraud", "sklearn")):
        version = open_artifact(demo_models / name, kind=kind).version
        assert re.search(
            rf"^  model {name}\s+{kind}\s+in ingress\s+{re.escape(version)}$", out, re.MULTILINE
        ), out


RISKY = {
    "numeric": {"amount": 2500.0, "account_age_days": 3.0, "txn_velocity_1h": 9.0, "hour": 3.0,
                "country_mismatch": 1.0, "device_change": 1.0},
    "categorical": {"merchant_category": "crypto", "channel": "online"},
}  # fmt: skip
SAFE = {
    "numeric": {"amount": 42.5, "account_age_days": 900.0, "txn_velocity_1h": 0.0, "hour": 14.0},
    "categorical": {"merchant_category": "grocery", "channel": "pos"},
}  # fmt: skip


def _assert_record_is_answer(record: dict[str, object], answer: object, sent: dict[str, object]) -> None:
    """The audit record of a decision says what its gRPC answer said (values, not just presence)."""
    from riskserve.proto.riskserve.v1 import risk_pipeline_pb2 as pb

    assert isinstance(answer, pb.DecideResponse)
    assert record["decision_id"] == answer.decision_id
    assert record["request_id"] == answer.request_id
    assert record["trace_id"] == answer.trace_id
    assert (record["pipeline"], record["pipeline_version"]) == (answer.pipeline, answer.pipeline_version)
    assert record["outcome"] == pb.Decision.Name(answer.decision)
    assert record["risk_score"] == pytest.approx(answer.risk_score, abs=1e-6)
    assert record["rule_reasons"] == list(answer.reasons)
    models = record["models"]
    assert isinstance(models, list)
    assert [(m["model"], m["version"], m["fallback"]) for m in models] == [
        (m.model, m.version, m.fallback) for m in answer.models
    ]
    for kept, told in zip(models, answer.models, strict=True):
        assert kept["score"] == pytest.approx(told.score, abs=1e-6)
    reasons = record["top_reasons"]
    assert isinstance(reasons, list)
    assert [(r["field"], r["model"]) for r in reasons] == [(r.field, r.model) for r in answer.top_reasons]
    for kept, told in zip(reasons, answer.top_reasons, strict=True):
        assert kept["contribution"] == pytest.approx(told.contribution, abs=1e-6)
    inputs = record["inputs"]
    assert isinstance(inputs, dict)
    assert inputs["numeric"] == sent["numeric"]
    assert inputs["categorical"] == sent["categorical"]


def test_the_audit_trail_holds_what_each_decision_answered(
    running: int, cli_env: dict[str, str], tmp_path: Path
) -> None:
    """Real gRPC decisions (Decide and DecideBatch), then ``riskserve audit show`` and ``export`` as a
    user runs them: each record equals its answer, the export holds every decision with the same values."""
    import pyarrow.parquet as pq

    from riskserve.client import RiskClient
    from riskserve.proto.riskserve.v1 import risk_pipeline_pb2 as pb

    with RiskClient(f"127.0.0.1:{running}", pipeline="tabular_only") as client:
        declined = client.decide(**RISKY, request_id="audit-risky")  # type: ignore[arg-type]
        batch = client.decide_batch(
            [pb.DecideRequest(request_id=f"audit-{i}", **(RISKY if i % 2 else SAFE)) for i in range(6)]  # type: ignore[arg-type]
        )
    assert pb.Decision.Name(declined.decision) == "DECLINE"
    assert declined.top_reasons, "a DECLINE carries reason codes"
    shown = _riskserve("audit", "show", declined.decision_id, "--pipeline", "tabular_only", env=cli_env)
    assert shown.returncode == 0, shown.stderr
    record = json.loads(shown.stdout)
    _assert_record_is_answer(record, declined, RISKY)
    assert record["rules"] == [reason.split(":")[0] for reason in declined.reasons]  # every rule fired
    assert "high_risk" in record["rules"]
    assert record["label"] is None
    out = tmp_path / "decisions.parquet"
    exported = _riskserve(
        "audit", "export", "--since", "10m", "--format", "parquet", "--out", str(out),
        "--pipeline", "tabular_only", env=cli_env,
    )  # fmt: skip
    assert exported.returncode == 0, exported.stderr
    rows = {row["decision_id"]: row for row in pq.read_table(out).to_pylist()}
    for i, answer in enumerate(batch):
        row = rows[answer.decision_id]
        sent = RISKY if i % 2 else SAFE
        assert (row["request_id"], row["outcome"]) == (f"audit-{i}", pb.Decision.Name(answer.decision))
        assert row["risk_score"] == pytest.approx(answer.risk_score, abs=1e-6)
        assert row["input.amount"] == sent["numeric"]["amount"]  # type: ignore[index]
        for model in answer.models:
            assert row[f"model.{model.model}.version"] == model.version
            assert row[f"model.{model.model}.score"] == pytest.approx(model.score, abs=1e-6)
    missing = _riskserve("audit", "show", "no-such-decision", "--pipeline", "tabular_only", env=cli_env)
    assert missing.returncode == 2
    assert missing.stderr.startswith("error: no audit record of decision 'no-such-decision'")


def _fraud_version(port: int) -> str:
    from riskserve.client import RiskClient

    fields = {"amount": 42.0, "account_age_days": 900, "txn_velocity_1h": 0, "hour": 14}
    with RiskClient(f"127.0.0.1:{port}", pipeline="tabular_only", timeout_s=30) as client:
        response = client.decide(
            numeric=fields, categorical={"merchant_category": "grocery", "channel": "pos"}
        )
    return next(m.version for m in response.models if m.model == "fraud")


def _exported(tabular_yaml: Path, env: dict[str, str]) -> str:
    result = _riskserve("export", "serve-config", str(tabular_yaml), env=env)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_a_swap_survives_down_and_up_is_exported_and_up_reset_serves_the_yaml(
    running: int, cli_env: dict[str, str], tabular_yaml: Path, demo_models: Path
) -> None:
    """The versions record: what a swap made serve is what `up` serves after `down`; `export serve-config`
    is the same before and after (the replicas pull versions, the config names none); `up --reset` serves
    the YAML's artifacts again. Leaves tabular_only running."""
    from riskserve.demo.build import build_demo_models
    from riskserve.platform.artifacts import open_artifact

    build_demo_models(demo_models / "candidates" / "seed7", seed=7, only=["fraud"], progress=False)
    candidate = (demo_models / "candidates" / "seed7" / "fraud").resolve()
    swapped = open_artifact(candidate, kind="sklearn").version
    original = open_artifact(demo_models / "fraud", kind="sklearn").version
    assert swapped != original
    assert _fraud_version(running) == original
    before = _exported(tabular_yaml, cli_env)
    result = _riskserve("swap", "tabular_only", "fraud", str(candidate), env=cli_env)
    assert result.returncode == 0, result.stderr
    assert _fraud_version(running) == swapped
    assert _exported(tabular_yaml, cli_env) == before
    for reset, expected in (([], swapped), (["--reset"], original)):
        down = _riskserve("down", env=cli_env)
        assert down.returncode == 0, down.stderr
        up = _riskserve("up", str(tabular_yaml), "--grpc-port", str(running), *reset, env=cli_env)
        assert up.returncode == 0, up.stderr + up.stdout
        assert _fraud_version(running) == expected, reset
    assert _exported(tabular_yaml, cli_env) == before


@pytest.mark.parametrize(
    ("edit", "serving", "message"),
    [
        ({"timeout_ms": 0}, None, "models.fraud.timeout_ms: Input should be greater than 0"),
        (
            {"num_cpus": 1.25},
            {"ingress": {"replicas": 2}},
            "pools.cpu: models need 3.5 CPUs (ingress (credit) 2 x 0.25, ingress (fraud) 2 x 1.25, "
            "ingress 2 x 0.25), the pool has 3",
        ),
        (
            {"num_cpus": 0.75, "replicas": 3, "placement": "deployment"},
            None,
            "pools.cpu: models need 3.25 CPUs (ingress (credit) 2 x 0.25, fraud 3 x 0.75, ingress 2 x 0.25), "
            "the pool has 3",
        ),
        (
            {"replicas": 2},
            None,
            "models.fraud.replicas: a model in the ingress runs in every ingress replica; "
            "scale it with serving.ingress.replicas",
        ),
    ],
    ids=["bad-field", "over-committed-ingress", "over-committed-deployment", "replicas-in-ingress"],
)
def test_up_refuses_an_invalid_pipeline_naming_the_path(
    cli_env: dict[str, str],
    tmp_path: Path,
    edit: dict[str, object],
    serving: dict[str, object] | None,
    message: str,
) -> None:
    data = yaml.safe_load((PIPELINES / "tabular_only.yaml").read_text())
    data["models"]["fraud"].update(edit)
    if serving is not None:
        data["serving"] = serving
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    result = _riskserve("up", str(path), env={**cli_env, "RISKSERVE_STATE_DIR": str(tmp_path)}, timeout=60)
    assert result.returncode == 2
    assert message in result.stderr


def test_export_serve_config_is_a_valid_serve_config_that_builds_the_app(cli_env: dict[str, str]) -> None:
    from ray.serve.schema import ServeDeploySchema

    from riskserve.operations.app import build_app

    result = _riskserve(
        "export", "serve-config", str(PIPELINES / "card_fraud.yaml"), "--grpc-port", "9100", env=cli_env
    )
    assert result.returncode == 0, result.stderr
    config = yaml.safe_load(result.stdout)
    ServeDeploySchema.model_validate(config)
    assert config["proxy_location"] == "Disabled"  # no Serve proxy: the ingress serves gRPC itself
    assert "grpc_options" not in config
    (app,) = config["applications"]
    assert app["name"] == "card_fraud"
    assert app["import_path"] == "riskserve.operations.app:build_app"
    assert app["args"] == {"pipeline": str((PIPELINES / "card_fraud.yaml").resolve()), "grpc_port": 9100}
    # Serve's graph: ingress(spec, features, models, feedback)
    ingress = build_app(app["args"])._bound_deployment
    spec, features, models, feedback = ingress.init_args
    assert ingress.name == "ingress"
    assert spec["serving"]["grpc"]["port"] == 9100  # the front door binds the exported port
    assert features is None  # the feature stage runs in the ingress by default
    assert feedback._bound_deployment.name == "feedback"
    assert feedback._bound_deployment.num_replicas == 1  # the one writer of the feedback log
    assert set(models) == {"intent"}  # only the LLM has a deployment; credit and fraud run in the ingress
    intent = models["intent"]._bound_deployment
    assert intent.name == "model-intent"
    assert intent.ray_actor_options == {"num_cpus": 1.0, "resources": {"riskserve_pool_llm": 1000.0}}
    # The ingress takes its own 0.25 CPU plus credit's and fraud's; their versions come from the record.
    # Its decisions run on Serve's own event loop of the replica (serving.ingress.event_loop: shared).
    assert ingress.ray_actor_options == {
        "num_cpus": 0.75,
        "resources": {"riskserve_pool_cpu": 750.0},
        "runtime_env": {"env_vars": {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0"}},
    }
    assert ingress.user_config == {"draining": False}  # no artifact, no shadow: the record says those


def _environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:  # gone, or not ours
        return {}
    pairs = (item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)
    return {key.decode(errors="replace"): value.decode(errors="replace") for key, value in pairs}


def test_the_local_rays_serve_controller_runs_the_quieter_control_loop(
    running: int, cli_env: dict[str, str]
) -> None:
    """``up`` starts Ray with Serve's control loop every 0.5 s (QUIET_SERVE_ENV), read from the controller's
    own environment in the kernel; an operator's own value would win (the variable is a default)."""
    from riskserve.operations.local import QUIET_SERVE_ENV

    assert "RAY_SERVE_CONTROL_LOOP_INTERVAL_S" not in cli_env  # else this run tests the operator's value
    controllers = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            command = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        environ = _environ(int(proc.name))
        if command.startswith(b"ray::ServeController") and (
            environ.get("RISKSERVE_STATE_DIR") == cli_env["RISKSERVE_STATE_DIR"]
        ):
            controllers.append(environ)
    assert len(controllers) == 1, f"{len(controllers)} Serve controllers of this riskserve up"
    assert (
        controllers[0]["RAY_SERVE_CONTROL_LOOP_INTERVAL_S"]
        == QUIET_SERVE_ENV["RAY_SERVE_CONTROL_LOOP_INTERVAL_S"]
        == "0.5"
    )
