"""Real Ray Serve on loopback, shared by the integration tests of a session.

Serve runs without its proxies: each deployed pipeline's ingress replicas serve riskserve's own gRPC front
door on a port of their own (:func:`pipeline_on` gives every pipeline a free one; :func:`endpoint` and
:func:`channel` dial it).
"""

from __future__ import annotations

import os

# Before Ray is imported: bind Ray's own processes to loopback.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# Metrics reach Ray's agent each second (env, not _system_config: it must reach the agent too).
os.environ.setdefault("RAY_metrics_report_interval_ms", "1000")

import copy
import socket
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml

from riskserve.schema.endpoints import endpoint_of
from riskserve.schema.pipeline import PipelineSpec, parse_pipeline

from ..conftest import PIPELINES
from ..sockets import listening_sockets

_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A loopback port free now and never handed out before in this session: two pipelines given the same
    port would share it (the front door binds with ``SO_REUSEPORT``), and the kernel can pick a port
    again once the probing socket is closed."""
    while True:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


@dataclass(frozen=True)
class ServeCluster:
    """A running Ray + Serve (no proxies: pipelines serve their own gRPC ports)."""

    metrics_port: int = 0


def endpoint(spec: PipelineSpec) -> str:
    """``127.0.0.1:PORT`` of a deployed pipeline's front door."""
    return endpoint_of(spec)


def serving_pid(spec: PipelineSpec) -> int:
    """The one process listening on the pipeline's gRPC port (its ingress replica), found by the kernel's
    socket table, not by asking riskserve."""
    port = int(endpoint(spec).rsplit(":", 1)[1])
    sockets = {f"socket:[{inode}]" for inode, (_, bound) in listening_sockets().items() if bound == port}
    pids = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if any(os.readlink(fd) in sockets for fd in (proc / "fd").iterdir()):
                pids.add(int(proc.name))
        except OSError:  # gone, or not ours
            continue
    assert len(pids) == 1, f"expected one process listening on {port}, found {pids}"
    return pids.pop()


def channel(spec: PipelineSpec) -> grpc.Channel:
    """A new channel to a deployed pipeline's front door."""
    return grpc.insecure_channel(endpoint_of(spec))


def announced_lanes(app: str, deployment: str) -> list[Any]:
    """The lanes (:class:`~riskserve.serving.model_lane.LaneAddress`) Ray's key-value store holds for a
    model deployment's replicas, read directly (not through riskserve)."""
    from ray.experimental import internal_kv

    from riskserve.serving.model_lane import KV_NAMESPACE, LaneAddress

    keys = internal_kv._internal_kv_list(f"lane/{app}/{deployment}/", namespace=KV_NAMESPACE)
    values = [internal_kv._internal_kv_get(key, namespace=KV_NAMESPACE) for key in keys]
    return [LaneAddress.model_validate_json(value) for value in values if value is not None]


@pytest.fixture(scope="session")
def serve_cluster() -> Iterator[ServeCluster]:
    import ray
    from ray import serve

    metrics_port = free_port()
    ray.init(
        address="local",
        num_cpus=16,  # logical: test pipelines are many small replicas, mostly idle
        resources={"riskserve_pool_cpu": 16_000, "riskserve_pool_llm": 4_000},  # milli-CPUs (see pools.py)
        include_dashboard=False,
        log_to_driver=False,
        _metrics_export_port=metrics_port,
    )
    serve.start(proxy_location="Disabled", http_options={"host": "127.0.0.1"})
    # Serve's client waits for a deploy or a delete by asking the controller once a second; the session
    # deploys a few dozen applications, so ask every 50 ms instead (what is waited for is unchanged).
    import ray.serve._private.client as serve_client

    serve_client.CLIENT_POLLING_INTERVAL_S = 0.05
    try:
        yield ServeCluster(metrics_port=metrics_port)
    finally:
        serve.shutdown()
        ray.shutdown()


GENEROUS_TIMEOUT_MS = 20_000
"""Model budget in tests that check values: a loaded 2-core CI machine must not turn them into fallbacks."""


def pipeline_on(yaml_name: str, models: Path, **overrides: Any) -> PipelineSpec:
    """A shipped pipeline YAML with its artifacts pointed at ``models`` (the session's demo models).

    Model timeouts are raised to :data:`GENEROUS_TIMEOUT_MS`; the resilience tests set their own. The
    pipeline gets a free gRPC port of its own (``serving.grpc.port``), unless ``overrides`` set one, and one
    ingress replica unless ``overrides`` set ``serving.ingress``.
    """
    data = copy.deepcopy(yaml.safe_load((PIPELINES / yaml_name).read_text()))
    data.setdefault("serving", {}).setdefault("grpc", {})["port"] = free_port()
    for model_name, model in data["models"].items():
        model["artifact"] = str(models / model_name)
        model["timeout_ms"] = GENEROUS_TIMEOUT_MS
    data.setdefault("serving", {})["decision_timeout_ms"] = GENEROUS_TIMEOUT_MS
    if "feedback" in data:  # every deployment of a test gets a state database (its log) of its own
        data["state"] = {"dsn": f"sqlite:///{Path(tempfile.mkdtemp(prefix='state-')) / 'state.sqlite'}"}
    if "audit" in data:  # the same for the audit trail
        data["audit"]["path"] = tempfile.mkdtemp(prefix="audit-")
    # and its own state store (versions record, ...): a version one test published never serves in another
    data["state"] = {"dsn": f"sqlite:///{tempfile.mkdtemp(prefix='state-')}/state.sqlite"}
    # One ingress replica unless a test asks for more: one process keeps what a test says about "the
    # replica" exact and the session's small Ray enough (the default of two is drilled where it matters).
    data["serving"].setdefault("ingress", {}).setdefault("replicas", 1)
    serving = overrides.pop("serving", None)
    data.update(overrides)
    if serving is not None:  # merged, so an override of the serving section keeps the free port
        data["serving"] = {**data["serving"], **serving}
    return parse_pipeline(data, base_dir=PIPELINES, source=yaml_name)


def deploy(spec: PipelineSpec) -> None:
    """Deploy a pipeline as a Serve application named after it and wait until it is running."""
    from ray import serve

    from riskserve.operations.app import build_application

    serve.run(build_application(spec), name=spec.name, route_prefix=None)


SESSION_APPS = frozenset({"tabular_only"})
"""Applications deployed once per session (:func:`tabular_only`), never deleted after a module."""


@pytest.fixture(scope="session")
def tabular_only(serve_cluster: ServeCluster, demo_models: Path) -> PipelineSpec:
    """The shipped tabular_only as :func:`pipeline_on` makes it, deployed once for the session: the modules
    that only decide on it (and count calls by difference) share it instead of each deploying a copy."""
    spec = pipeline_on("tabular_only.yaml", demo_models)
    deploy(spec)
    return spec


RUN_NEXT = {"test_hotswap.py": "test_pipeline_grpc.py"}
"""Modules run right after another one, which leaves an application deployed for them (``LEAVE_DEPLOYED``)."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Move each module of :data:`RUN_NEXT` right behind the module it follows (the order is otherwise
    unchanged)."""
    for first, then in RUN_NEXT.items():
        moved = [item for item in items if item.path.name == then]
        rest = [item for item in items if item.path.name != then]
        ends = [i for i, item in enumerate(rest) if item.path.name == first]
        if moved and ends:
            items[:] = rest[: ends[-1] + 1] + moved + rest[ends[-1] + 1 :]


@pytest.fixture(autouse=True, scope="module")
def _delete_apps_after_module(request: pytest.FixtureRequest) -> Iterator[None]:
    """Each test module deletes the pipelines it deployed, so the session's cluster never fills up.

    A module's ``LEAVE_DEPLOYED`` names applications it leaves to the module :data:`RUN_NEXT` runs after
    it, which deploys its own version over them: Serve then restarts only the deployments whose code or
    arguments changed (a replica of the LLM, the slowest to start, is kept)."""
    yield
    import ray

    if ray.is_initialized():
        from ray import serve

        remaining = set(serve.status().applications) - SESSION_APPS
        remaining -= set(getattr(request.module, "LEAVE_DEPLOYED", ()))
        for name in remaining:
            serve.delete(name, _blocking=False)
        deadline = time.monotonic() + 120
        while remaining and time.monotonic() < deadline:
            time.sleep(0.05)
            remaining &= set(serve.status().applications)  # nothing redeploys itself: no second delete
        assert not remaining, f"applications not deleted after 120 s: {sorted(remaining)}"
