"""Shared CPU/GPU pools: the demand and over-commit checks, and real placement on a simulated cluster.

The unit tests need no Ray. The cluster test starts its own multi-node Ray (``ray.cluster_utils.Cluster``:
a head with no CPUs, a "CPU node" of the ``cpu`` pool, a "GPU node" of the ``gpu`` pool with one logical
GPU) and deploys a pipeline-shaped Serve application of placement probes built with
:func:`riskserve.schema.pools.actor_options`. It runs in a child process (this module run with
``python -m``), because the session's ``serve_cluster`` fixture owns the test process's Ray.
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from riskserve.platform.errors import ConfigError
from riskserve.schema.pipeline import PipelineSpec, parse_pipeline
from riskserve.schema.pools import (
    PIN_UNITS,
    actor_options,
    check_pools,
    ingress_cpus,
    node_group_resources,
    node_resources,
    overcommit_errors,
    pool_demands,
    single_node_resources,
)

REPO = Path(__file__).resolve().parents[2]
PIPELINES = REPO / "deploy" / "pipelines"
APP = "pools"
CHILD_BUDGET_S = 100
"""The child ends itself (and its cluster) past this; the parent kills its process group a bit later."""
RAY_ENV = {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_AUTH_MODE": "disabled",
    "RAY_USAGE_STATS_ENABLED": "0",
    # Autoscaling decisions within about a second instead of Serve's default 10 s metric pushes.
    "RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "0.5",
    "RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "0.5",
}
MB = 1024 * 1024


def _card_fraud(*, deployments: bool = True) -> dict[str, Any]:
    """The shipped card_fraud; ``deployments``: every model and the feature stage in a deployment of its
    own (what these tests place on pools one by one), instead of the tabular models inside the ingress."""
    data: dict[str, Any] = copy.deepcopy(yaml.safe_load((PIPELINES / "card_fraud.yaml").read_text()))
    if deployments:
        for model in data["models"].values():
            model["placement"] = "deployment"
        data.setdefault("serving", {})["feature_stage"] = "deployment"
    return data


def _parse(data: dict[str, Any]) -> PipelineSpec:
    return parse_pipeline(data, base_dir=PIPELINES, source="card_fraud.yaml")


def _edited(edit: Callable[[dict[str, Any]], object], *, deployments: bool = True) -> PipelineSpec:
    data = _card_fraud(deployments=deployments)
    edit(data)
    return _parse(data)


def _gpu_pools(data: dict[str, Any]) -> None:
    """card_fraud on a CPU node group and a GPU node group: the intent model takes half a GPU per replica."""
    data["pools"] = {
        "cpu": {"cpus": 2, "node_group": "cpu-workers"},
        "gpu": {"cpus": 1, "gpus": 1, "node_group": "gpu-workers"},
    }
    data["models"]["intent"].update(pool="gpu", num_cpus=0, num_gpus=0.5, replicas=2)
    data["serving"] = {"features": {"pool": "cpu"}, "ingress": {"pool": "cpu"}}


def gpu_pipeline() -> PipelineSpec:
    """The pipeline the cluster test places: 2 x 0.5 GPU on the GPU node, everything else on the CPU node."""
    return _edited(_gpu_pools)


# --- demand and over-commit (no Ray) ---------------------------------------------------------------------


def test_shipped_pipeline_fits_its_pools() -> None:
    spec = _parse(_card_fraud(deployments=False))
    demands = pool_demands(spec)
    assert set(demands) == {"cpu", "llm"}
    cpu = demands["cpu"]
    # credit and fraud run inside the ingress: their shares count once per ingress replica (two by
    # default), and the feature stage is encoded there too (no deployment of its own).
    assert cpu.cpus == pytest.approx(1.5)
    assert [(p.deployment, p.replicas, p.num_cpus) for p in cpu.placements] == [
        ("ingress (credit)", 2, 0.25),
        ("ingress (fraud)", 2, 0.25),
        ("ingress", 2, 0.25),
        ("feedback", 1, 0.0),
    ]
    assert ingress_cpus(spec) == pytest.approx(0.75)  # what Ray is asked for one ingress replica
    assert demands["llm"].cpus == pytest.approx(1.0)
    assert demands["llm"].gpus == 0.0
    assert overcommit_errors(spec) == []
    check_pools(spec)


def test_models_in_the_ingress_count_once_per_ingress_replica() -> None:
    spec = _edited(
        lambda d: d.setdefault("serving", {}).update(ingress={"replicas": 2, "num_cpus": 0.25}),
        deployments=False,
    )
    cpu = pool_demands(spec)["cpu"]
    assert cpu.cpus == pytest.approx(2 * 0.75)
    assert ingress_cpus(spec) == pytest.approx(0.75)
    placed = {p.deployment: p.replicas for p in cpu.placements}
    assert placed["ingress (credit)"] == placed["ingress (fraud)"] == placed["ingress"] == 2


def test_gpu_pool_demand_sums_fractions() -> None:
    spec = gpu_pipeline()
    gpu = pool_demands(spec)["gpu"]
    assert gpu.gpus == pytest.approx(1.0)
    assert gpu.cpus == 0.0
    assert gpu.units == pytest.approx(2 * PIN_UNITS)  # zero-CPU replicas only pin
    assert overcommit_errors(spec) == []


def test_an_overcommitted_gpu_pool_names_the_numbers() -> None:
    def edit(data: dict[str, Any]) -> None:
        _gpu_pools(data)
        data["models"]["fraud"].update(pool="gpu", num_cpus=0, num_gpus=0.5)

    assert overcommit_errors(_edited(edit)) == [
        "pools.gpu: models need 1.5 GPUs (intent 2 x 0.5, fraud 1 x 0.5), the pool has 1"
    ]


def test_an_overcommitted_cpu_pool_counts_the_pipeline_stages() -> None:
    spec = _edited(lambda d: d["models"]["credit"].update(replicas=10))
    assert overcommit_errors(spec) == [
        "pools.cpu: models need 3.5 CPUs "
        "(credit 10 x 0.25, fraud 1 x 0.25, features 1 x 0.25, ingress 2 x 0.25), the pool has 3"
    ]
    with pytest.raises(ConfigError, match="1 pool error"):
        check_pools(spec)


def test_a_gpu_model_on_a_pool_without_gpus() -> None:
    spec = _edited(lambda d: d["models"]["intent"].update(num_gpus=0.5))  # pool llm has gpus: 0
    assert overcommit_errors(spec) == [
        "models.intent.num_gpus: 0.5 GPUs per replica on pool 'llm', which has none (gpus: 0)"
    ]


def test_a_replica_larger_than_its_pool_could_never_be_placed() -> None:
    errors = overcommit_errors(_edited(lambda d: d["models"]["credit"].update(num_cpus=4)))
    big = "models.credit: one replica needs 4 CPUs, more than pool 'cpu' has (3): it could never be placed"
    assert big in errors
    assert any(e.startswith("pools.cpu: models need 5 CPUs") for e in errors)


def test_more_than_one_gpu_must_be_whole() -> None:
    def edit(data: dict[str, Any]) -> None:
        _gpu_pools(data)
        data["pools"]["gpu"]["gpus"] = 4
        data["models"]["intent"].update(num_gpus=1.5, replicas=1)

    assert overcommit_errors(_edited(edit)) == [
        "models.intent.num_gpus: 1.5 GPUs per replica cannot be placed: above 1, Ray gives whole GPUs only "
        "(use 1, 2, ... or a fraction of one)"
    ]


def test_pipelines_sharing_a_pool_add_up() -> None:
    card = _parse(_card_fraud())
    tabular_data = yaml.safe_load((PIPELINES / "tabular_only.yaml").read_text())
    tabular = parse_pipeline(tabular_data, base_dir=PIPELINES)  # its two models inside its ingress
    # card_fraud: credit, fraud, features at 0.25 each and two ingress replicas at 0.25; tabular_only:
    # two ingress replicas of 0.75 (its models inside).
    assert pool_demands([card, tabular])["cpu"].cpus == pytest.approx(2.75)
    assert overcommit_errors([card, tabular]) == []
    busier = _edited(lambda d: d["models"]["fraud"].update(replicas=3))
    assert overcommit_errors([busier, tabular]) == [
        "pools.cpu: models need 3.25 CPUs (card_fraud/credit 1 x 0.25, card_fraud/fraud 3 x 0.25, "
        "card_fraud/features 1 x 0.25, card_fraud/ingress 2 x 0.25, tabular_only/ingress (credit) 2 x 0.25, "
        "tabular_only/ingress (fraud) 2 x 0.25, tabular_only/ingress 2 x 0.25), "
        "the pool has 3"
    ]


def test_actor_options_and_node_resources() -> None:
    spec = gpu_pipeline()
    assert actor_options(spec, "cpu", 0.25) == {"num_cpus": 0.25, "resources": {"riskserve_pool_cpu": 250.0}}
    assert actor_options(spec, "gpu", 0, 0.5) == {
        "num_cpus": 0,
        "resources": {"riskserve_pool_gpu": PIN_UNITS},
        "num_gpus": 0.5,
    }
    assert actor_options(spec, "cpu", 1.5, memory_gb=2)["memory"] == 2 * 1024**3
    with pytest.raises(ConfigError, match="unknown pool 'tpu'"):
        actor_options(spec, "tpu", 1)
    assert node_resources(spec, "cpu") == {"riskserve_pool_cpu": 2001.0}
    assert node_resources(spec, "cpu", nodes=2) == {"riskserve_pool_cpu": 1001.0}
    assert node_group_resources(spec) == {
        "cpu-workers": {"riskserve_pool_cpu": 2001.0},
        "gpu-workers": {"riskserve_pool_gpu": 1001.0},
    }
    shipped = _parse(_card_fraud())  # cpu and llm on one node group: its nodes offer both
    assert node_group_resources(shipped) == {
        "cpu-workers": {"riskserve_pool_cpu": 3001.0, "riskserve_pool_llm": 1001.0}
    }
    half = _edited(lambda d: d["pools"]["cpu"].update(cpus=2.5))
    resources = single_node_resources([half, spec])
    assert resources == {
        "riskserve_pool_cpu": 2501.0,
        "riskserve_pool_llm": 1001.0,
        "riskserve_pool_gpu": 1001.0,
    }
    assert all(float(v).is_integer() for v in resources.values())  # Ray refuses fractional node resources


# --- real placement on a simulated multi-node cluster --------------------------------------------------


class PlacementProbe:
    """Not a model: a Serve replica that reports where Ray placed it and what it was given."""

    def __init__(self, deployment: str) -> None:
        self.deployment = deployment

    def where(self) -> dict[str, Any]:
        import ray
        from ray import serve

        context = ray.get_runtime_context()
        return {
            "deployment": self.deployment,
            "replica": serve.get_replica_context().replica_id.unique_id,
            "node_id": context.get_node_id(),
            "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
            "resources": context.get_assigned_resources(),
        }

    async def hold(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


class PipelineProbe(PlacementProbe):
    """Ingress-shaped placement probe: holds the feature stage's and every model's handle."""

    def __init__(self, features: Any, models: dict[str, Any]) -> None:
        super().__init__("ingress")
        self.stages = {"features": features, **models}

    async def placements(self, calls: int) -> list[dict[str, Any]]:
        responses = [s.where.remote() for s in self.stages.values() for _ in range(calls)]
        return [self.where(), *await asyncio.gather(*responses)]


def _probe_app(spec: PipelineSpec) -> Any:
    from ray import serve

    def stage(name: str, pool: str, num_cpus: float, num_gpus: float = 0.0, **options: Any) -> Any:
        return serve.deployment(PlacementProbe).options(
            name=name,
            ray_actor_options=actor_options(spec, pool, num_cpus, num_gpus),
            graceful_shutdown_timeout_s=1,
            graceful_shutdown_wait_loop_s=0.2,  # as riskserve's own deployments: no 2 s wait at shutdown
            **options,
        )

    # The burst: credit may grow into what fraud leaves free on the cpu pool.
    burst = {
        "min_replicas": 1,
        "max_replicas": 4,
        "target_ongoing_requests": 1,
        "upscale_delay_s": 0,
        "look_back_period_s": 1,
    }
    models = {}
    for name, model in spec.models.items():
        scaling = {"autoscaling_config": burst} if name == "credit" else {"num_replicas": model.replicas}
        deployment = stage(f"model-{name}", model.pool, model.num_cpus, model.num_gpus, **scaling)
        models[name] = deployment.bind(name)
    features = stage("features", spec.stage_pool(spec.serving.features), spec.serving.features.num_cpus)
    ingress = serve.deployment(PipelineProbe).options(
        name="ingress",
        graceful_shutdown_timeout_s=1,
        graceful_shutdown_wait_loop_s=0.2,
        ray_actor_options=actor_options(
            spec, spec.stage_pool(spec.serving.ingress), spec.serving.ingress.num_cpus
        ),
    )
    return ingress.bind(features.bind("features"), models)


def _placements(handle: Any, expected: dict[str, int], deadline: float) -> dict[str, dict[str, Any]]:
    """Each replica's report, by replica id; asks until every replica of ``expected`` has answered."""
    seen: dict[str, dict[str, Any]] = {}
    while True:
        for report in handle.placements.remote(8).result(timeout_s=30):
            seen[report["replica"]] = report
        counts = {d: sum(r["deployment"] == d for r in seen.values()) for d in expected}
        if counts == expected or time.monotonic() > deadline:
            return seen


def _running(deployment: str) -> int:
    from ray import serve

    status = serve.status().applications[APP].deployments[deployment]
    return int(status.replica_states.get("RUNNING", 0))


def _run_cluster(out: Path) -> None:
    """Child process: a 3-node Ray on this machine, the probe pipeline on it, a report in ``out``."""
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    timings: dict[str, float] = {}
    start = time.monotonic()
    spec = gpu_pipeline()
    node = {"object_store_memory": 100 * MB, "node_ip_address": "127.0.0.1"}
    # Cluster writes its address to Ray's "current cluster" file; put back what other Rays had there.
    address_file = Path("/tmp/ray/ray_current_cluster")
    previous = address_file.read_text() if address_file.exists() else None
    cluster = Cluster(
        initialize_head=True, head_node_args={**node, "num_cpus": 0, "include_dashboard": False}
    )
    if previous is not None:
        address_file.write_text(previous)
    try:
        # Both worker nodes start at once; then wait for the two to register.
        cpu_node = cluster.add_node(wait=False, **node, num_cpus=2, resources=node_resources(spec, "cpu"))
        gpu_node = cluster.add_node(
            wait=False, **node, num_cpus=1, num_gpus=1, resources=node_resources(spec, "gpu")
        )
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
        timings["cluster_s"] = time.monotonic() - start
        serve.start(proxy_location="Disabled")
        handle = serve.run(_probe_app(spec), name=APP, route_prefix=None)
        timings["deployed_s"] = time.monotonic() - start
        # Read before any call: the probe's calls reach credit, whose autoscaler may then add replicas.
        available = ray.available_resources()
        expected = {"features": 1, "ingress": 1, "credit": 1, "fraud": 1, "intent": 2}
        placements = _placements(handle, expected, time.monotonic() + 20)

        # A third half-GPU share of the gpu pool: the same options, but the one GPU is taken.
        @ray.remote
        class ThirdShare:
            def node(self) -> str:
                return str(ray.get_runtime_context().get_node_id())

        third = ThirdShare.options(**actor_options(spec, "gpu", 0, 0.5)).remote()
        placed, _ = ray.wait([third.node.remote()], timeout=3)
        ray.kill(third)

        # Burst: credit scales 1 -> 4 replicas into the cpu pool's room that fraud (at 1 replica) leaves.
        credit = serve.get_deployment_handle("model-credit", app_name=APP)
        held = [credit.hold.remote(30) for _ in range(8)]
        burst_deadline = time.monotonic() + 30
        while _running("model-credit") < 4 and time.monotonic() < burst_deadline:
            time.sleep(0.25)
        burst = {d: _running(d) for d in ("model-credit", "model-fraud")}
        for response in held:
            response.cancel()
        grown = _placements(handle, {"credit": 4}, time.monotonic() + 10)
        burst_nodes = {r["node_id"] for r in grown.values() if r["deployment"] == "credit"}
        timings["burst_s"] = time.monotonic() - start
        report = {
            "nodes": {"head": cluster.head_node.node_id, "cpu": cpu_node.node_id, "gpu": gpu_node.node_id},
            "placements": list(placements.values()),
            "available": available,
            "third_share_placed": bool(placed),
            "burst": burst,
            "burst_nodes": sorted(burst_nodes),
            "timings": timings,
        }
        out.write_text(json.dumps(report, indent=2))
    finally:
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()


@pytest.mark.slow
def test_models_share_pools_on_a_simulated_cluster(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    started = time.monotonic()
    child = subprocess.Popen(
        [sys.executable, "-m", "tests.integration.test_pools", str(out)],
        cwd=REPO,
        env={**os.environ, **RAY_ENV},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = child.communicate(timeout=CHILD_BUDGET_S + 30)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)  # the child's own session: its Ray processes, nothing else
        output, _ = child.communicate()
        pytest.fail(f"the cluster child did not finish in time:\n{output[-4000:]}")
    assert child.returncode == 0, output[-4000:]
    report = json.loads(out.read_text())
    nodes = report["nodes"]
    by_deployment: dict[str, list[dict[str, Any]]] = {}
    for placement in report["placements"]:
        by_deployment.setdefault(placement["deployment"], []).append(placement)

    # Both halves of the one GPU are taken by the intent replicas, on the GPU node, sharing GPU 0.
    intent = by_deployment["intent"]
    assert len(intent) == 2
    assert {p["node_id"] for p in intent} == {nodes["gpu"]}
    assert [p["gpu_ids"] for p in intent] == [["0"], ["0"]]
    assert all(p["resources"] == {"GPU": 0.5, "riskserve_pool_gpu": PIN_UNITS} for p in intent)
    assert report["available"].get("GPU", 0.0) == 0.0
    assert not report["third_share_placed"]  # a third 0.5 GPU share does not fit

    # The CPU models, the feature stage and the ingress together on the CPU node, with no GPU.
    for name in ("credit", "fraud", "features", "ingress"):
        (placement,) = by_deployment[name]
        assert placement["node_id"] == nodes["cpu"], name
        assert placement["gpu_ids"] == []
        assert placement["resources"] == {"CPU": 0.25, "riskserve_pool_cpu": 250.0}
    assert report["available"]["riskserve_pool_cpu"] == pytest.approx(2001 - 4 * 250)

    # A burst of credit grows into the pool's free room while fraud stays at its one replica.
    assert report["burst"] == {"model-credit": 4, "model-fraud": 1}
    assert report["burst_nodes"] == [nodes["cpu"]]
    print(f"pools cluster test: {report['timings']}, total {time.monotonic() - started:.1f} s")


if __name__ == "__main__":
    os.environ.update(RAY_ENV)

    def _give_up(*_: object) -> None:
        raise TimeoutError(f"the pools cluster test took more than {CHILD_BUDGET_S} s")

    signal.signal(signal.SIGALRM, _give_up)
    signal.alarm(CHILD_BUDGET_S)
    _run_cluster(Path(sys.argv[1]))
