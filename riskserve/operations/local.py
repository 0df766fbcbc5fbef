"""Run pipelines on a local Ray (a background process that owns it) or deploy them to a Ray cluster.

``riskserve up`` starts ``python -m riskserve.operations.local`` detached: it starts an embedded Ray bound to
loopback, in token mode with this install's own token (:mod:`riskserve.operations.ray_auth`; the one socket
Ray opens on every interface, each Serve replica's inter-deployment gRPC server, refuses calls without it),
without its dashboard, and Serve without its proxies (each pipeline's ingress replicas serve gRPC
themselves, one port per pipeline), deploys the pipelines, writes a state file and serves until it gets
SIGTERM (``riskserve down``), when it drains and shuts Serve and its own Ray down. Only that process's
cluster is touched; other Ray clusters on the machine are left alone.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

from pydantic import BaseModel as _Schema
from pydantic import ConfigDict, ValidationError

from riskserve.operations.ray_auth import (
    install_token,
    refuses_without_token,
    token_mode_env,
    use_token_mode,
)
from riskserve.operations.served import check_record, open_versions, reset
from riskserve.operations.state import state_dir
from riskserve.platform.errors import ConfigError, ModelUnavailable, NotFound
from riskserve.schema.deployments import FEEDBACK
from riskserve.schema.endpoints import assign_endpoints, endpoint_of
from riskserve.schema.pipeline import PipelineSpec, load_pipeline
from riskserve.schema.pools import check_pools, single_node_resources

__all__ = [
    "LOOPBACK_RAY_ENV",
    "QUIET_SERVE_ENV",
    "LocalState",
    "connected",
    "deploy_to_cluster",
    "down",
    "pool_resources",
    "read_state",
    "state_dir",
    "up_local",
]

logger = logging.getLogger(__name__)

READY_TIMEOUT_S = 600.0
LOOPBACK_RAY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}
"""Single-machine Ray: every Ray process uses 127.0.0.1 as its node address (read when Ray is imported)."""
QUIET_SERVE_ENV = {"RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5"}
"""Defaults for the Ray that ``up`` starts, each overridden by the operator's own environment. Serve's
controller runs its control loop every 0.1 s by default: at rest that loop and the GCS calls it makes took
5.6% of a core of the local Ray's 12.6% (2 cores, ``tabular_only``); every 0.5 s, 2.7%. A deploy, a swap or a
replica restart is noticed up to 0.4 s later; decisions never pass through the controller."""


class LocalState(_Schema):
    """What ``up`` left running, for ``down``, ``status`` and the clients."""

    model_config = ConfigDict(extra="forbid")

    pid: int
    grpc_port: int
    """The first pipeline's gRPC port."""
    endpoints: dict[str, str] = {}
    """Pipeline name -> ``HOST:PORT`` of its gRPC front door."""
    http_port: int = 0
    metrics_port: int = 0
    """Ray's Prometheus endpoint on this node: ``http://127.0.0.1:PORT/metrics``."""
    gcs_address: str
    pipelines: list[str]
    pipeline_files: dict[str, str] = {}
    """Pipeline name -> its YAML file, for redeploys (swap, drain)."""
    log: str
    started_at: float
    ray_auth_mode: str = "token"
    """``RAY_AUTH_MODE`` the local Ray runs with; a driver joining it must use the same."""
    ray_auth_token_path: str = ""
    """The local Ray's token file (``RAY_AUTH_TOKEN_PATH``), readable by its owner only."""

    @property
    def target(self) -> str:
        """The first pipeline's gRPC address."""
        return self.endpoint(self.pipelines[0]) if self.pipelines else f"127.0.0.1:{self.grpc_port}"

    def endpoint(self, pipeline: str) -> str:
        """The gRPC address of ``pipeline``'s front door.

        Raises:
            NotFound: the pipeline is not running here.
        """
        if pipeline not in self.endpoints:
            running = ", ".join(self.endpoints) or "none"
            raise NotFound(f"no pipeline '{pipeline}' is running (running: {running})")
        return self.endpoints[pipeline]

    def running_spec(self, pipeline: str) -> PipelineSpec:
        """The pipeline as it was deployed: its YAML with the port ``up`` gave it (a redeploy must keep
        it, or the ingress would restart on another port)."""
        from riskserve.schema.endpoints import with_endpoint

        port = int(self.endpoint(pipeline).rsplit(":", 1)[1])
        return with_endpoint(load_pipeline(self.pipeline_files[pipeline]), port=port)


def read_state() -> LocalState | None:
    """The running local deployment, or ``None`` (a stale file of a dead process is removed)."""
    path = state_dir() / "state.json"
    try:
        state = LocalState.model_validate_json(path.read_text())
    except (OSError, ValidationError):
        return None
    if not _alive(state.pid):
        path.unlink(missing_ok=True)
        return None
    return state


@contextlib.contextmanager
def connected(state: LocalState) -> Iterator[None]:
    """This process joined to the local riskserve's Ray for the block (a no-op if Ray is already up).

    The local Ray binds loopback and checks a token: a driver joining it must pick the same node address,
    auth mode and token, and Ray reads them when it is imported, so they are set first.
    """
    already = "ray" in sys.modules and sys.modules["ray"].is_initialized()
    if not already:
        for key, value in LOOPBACK_RAY_ENV.items():
            os.environ.setdefault(key, value)
        if state.ray_auth_mode == "token" and state.ray_auth_token_path:
            use_token_mode(Path(state.ray_auth_token_path))
        else:
            os.environ.setdefault("RAY_AUTH_MODE", state.ray_auth_mode)
    import logging

    import ray

    if not already:
        logging.getLogger("ray.serve").setLevel(logging.WARNING)  # a CLI prints results, not Serve's chatter
        ray.init(address=state.gcs_address, log_to_driver=False, logging_level=logging.WARNING)
    try:
        yield
    finally:
        if not already:
            ray.shutdown()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def pool_resources(specs: Iterable[PipelineSpec]) -> dict[str, float]:
    """Ray custom resources one machine offers to host every pool of ``specs`` (see ``pools``)."""
    return single_node_resources(list(specs))


def _cpus_needed(specs: Iterable[PipelineSpec]) -> int:
    from riskserve.schema.pools import pool_demands

    total = sum(demand.cpus for demand in pool_demands(list(specs)).values())
    return max(os.cpu_count() or 1, math.ceil(total))


def _start_serve() -> None:
    """Serve without its HTTP and gRPC proxies: every pipeline's ingress serves its own gRPC port."""
    from ray import serve

    serve.start(proxy_location="Disabled", http_options={"host": "127.0.0.1"})


def _deploy(specs: Sequence[PipelineSpec]) -> None:
    from ray import serve

    from riskserve.operations.app import build_application

    for spec in specs:
        serve.run(build_application(spec), name=spec.name, route_prefix=None)


def _check_pools_exist(specs: Sequence[PipelineSpec]) -> None:
    import ray

    available = ray.cluster_resources()  # type: ignore[no-untyped-call]
    for spec in specs:
        for pool in spec.pools:
            if spec.pool_resource(pool) not in available:
                raise ConfigError(
                    f"{spec.name}: pool '{pool}' has no nodes in this cluster (no node offers the Ray "
                    f"resource '{spec.pool_resource(pool)}'; add it to a node group's rayStartParams)"
                )


def deploy_to_cluster(
    paths: Sequence[Path],
    *,
    address: str,
    grpc_port: int | None,
    host: str | None = None,
    ray_token_file: Path | None = None,
    reset_served: bool = False,
) -> dict[str, str]:
    """Deploy pipelines to an existing Ray cluster (``up --address``); Serve keeps them after we exit.

    The cluster must run Ray token authentication: this process joins in token mode (the token from
    ``ray_token_file``, else ``RAY_AUTH_TOKEN``/``RAY_AUTH_TOKEN_PATH``/``~/.ray/auth_token``), and a
    ``HOST:PORT`` address is first called without a token, which the cluster must refuse. Each model
    serves what this install's served record says (``reset_served``: forget it, serve the YAML's).

    Returns each pipeline's gRPC endpoint (on every node that runs one of its ingress replicas).

    Raises:
        ConfigError: no token, or the cluster at ``address`` accepts calls without one.
    """
    specs = assign_endpoints([load_pipeline(p) for p in paths], base_port=grpc_port, host=host)
    check_pools(specs)
    use_token_mode(ray_token_file)
    if not address.startswith("ray://") and ":" in address and not refuses_without_token(address):
        raise ConfigError(
            f"the Ray cluster at {address} accepts calls without a token: start every node with "
            "RAY_AUTH_MODE=token (and the cluster's token) before riskserve deploys to it"
        )
    import ray

    if reset_served:
        for spec in specs:
            reset(spec)
    ray.init(address=address, log_to_driver=False)
    try:
        _check_pools_exist(specs)
        _start_serve()
        _deploy(specs)
    finally:
        ray.shutdown()
    return {s.name: endpoint_of(s) for s in specs}


def up_local(
    paths: Sequence[Path],
    *,
    grpc_port: int | None,
    host: str | None = None,
    timeout_s: float = READY_TIMEOUT_S,
    reset_served: bool = False,
) -> LocalState:
    """Start a local Ray with the pipelines in a background process and wait until they serve.

    Each model serves what the pipeline's served record says (its last swap, rollback or learned
    version; :mod:`riskserve.operations.served`), else its YAML artifact; ``reset_served`` forgets the
    record first, so the YAML's artifacts serve (``riskserve up --reset``).

    Raises:
        ConfigError: a pipeline file is invalid, or a recorded artifact is missing or changed (checked
            before anything starts).
        ModelUnavailable: the background process died or did not become ready in time (its log is named).
    """
    from riskserve.serving.frontdoor import check_front_door

    specs = [load_pipeline(p) for p in paths]  # fail fast, in the foreground, on a bad file
    for spec in specs:
        check_front_door(spec.front_door())  # and on TLS files or tokens a replica could not read
    assign_endpoints(specs, base_port=grpc_port, host=host)  # two pipelines on one port are refused here
    check_pools(specs)  # pipelines sharing a pool name share its capacity
    if read_state() is not None:
        raise ConfigError("a local riskserve is already running: `riskserve down` first")
    for spec in specs:
        if reset_served:
            reset(spec)
        with open_versions(spec) as store:
            check_record(spec, store)  # a recorded artifact that cannot serve fails here, naming --reset
    directory = state_dir()
    token = install_token(directory)  # makes the directory 0700 too
    log_path = directory / "riskserve.log"
    command = [sys.executable, "-m", "riskserve.operations.local"]
    if grpc_port is not None:
        command += ["--grpc-port", str(grpc_port)]
    if host is not None:
        command += ["--host", host]
    command += [str(Path(p).resolve()) for p in paths]
    env = {**QUIET_SERVE_ENV, **os.environ, **LOOPBACK_RAY_ENV, **token_mode_env(token)}
    env.pop("RAY_AUTH_TOKEN", None)  # it would win over the install's token file
    with log_path.open("w") as log:
        process = subprocess.Popen(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = read_state()
        if state is not None and state.pid == process.pid:
            return state
        if process.poll() is not None:
            tail = log_path.read_text()[-3000:]
            raise ModelUnavailable(
                f"riskserve exited while starting (code {process.returncode}); {log_path}:\n{tail}"
            )
        time.sleep(0.1)
    os.killpg(process.pid, signal.SIGKILL)
    raise ModelUnavailable(
        f"{', '.join(s.name for s in specs)} not ready after {timeout_s:.0f} s; see {log_path}"
    )


def down(timeout_s: float = 90.0) -> LocalState:
    """Stop the local deployment: SIGTERM, then SIGKILL of its process group if it does not exit in time.

    Raises:
        NotFound: nothing is running.
    """
    state = read_state()
    if state is None:
        raise NotFound("no local riskserve is running")
    os.kill(state.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and _alive(state.pid):
        time.sleep(0.05)
    if _alive(state.pid):
        os.killpg(state.pid, signal.SIGKILL)
    (state_dir() / "state.json").unlink(missing_ok=True)
    return state


DRAIN_S = 2.0
"""How long health checks report NOT_SERVING before Serve shuts down, so load balancers move away."""


def _drain(specs: Sequence[PipelineSpec]) -> None:
    from ray import serve

    from riskserve.operations.app import build_application

    for spec in specs:
        if spec.feedback is not None:  # no learner publish may follow (it would redeploy the pipeline)
            try:
                serve.get_deployment_handle(FEEDBACK, app_name=spec.name).fence.remote().result(
                    timeout_s=DRAIN_S * 15
                )
            except Exception:
                logger.exception("could not fence the learner of '%s'; draining anyway", spec.name)
        # What the served record says each model serves (swapped, rolled back or learned; the fence
        # stopped every later publish), never the YAML's: draining changes nothing else.
        app = build_application(spec, draining=True)
        serve.run(app, name=spec.name, route_prefix=None)
    time.sleep(DRAIN_S)


def _serve_forever(paths: Sequence[Path], grpc_port: int | None, host: str | None = None) -> int:
    """Body of the background process: own a local Ray and Serve until SIGTERM."""
    import ray

    specs = assign_endpoints([load_pipeline(p) for p in paths], base_port=grpc_port, host=host)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    metrics_port = _free_port()
    ray.init(
        address="local",
        num_cpus=_cpus_needed(specs),
        resources=pool_resources(specs),
        include_dashboard=False,
        log_to_driver=False,
        _metrics_export_port=metrics_port,
    )
    try:
        _start_serve()
        _deploy(specs)
        endpoints = {s.name: endpoint_of(s) for s in specs}
        state = LocalState(
            pid=os.getpid(),
            grpc_port=specs[0].serving.grpc.port,
            endpoints=endpoints,
            metrics_port=metrics_port,
            gcs_address=ray.get_runtime_context().gcs_address,
            pipelines=[s.name for s in specs],
            pipeline_files={s.name: str(Path(p).resolve()) for s, p in zip(specs, paths, strict=True)},
            log=str(state_dir() / "riskserve.log"),
            started_at=time.time(),
            ray_auth_mode=os.environ.get("RAY_AUTH_MODE", "token"),
            ray_auth_token_path=os.environ.get("RAY_AUTH_TOKEN_PATH", ""),
        )
        path = state_dir() / "state.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(state.model_dump_json(indent=2))
        tmp.rename(path)  # readers see no file or a whole one
        print(f"serving {', '.join(f'{n} on {e}' for n, e in endpoints.items())}", flush=True)
        stop.wait()
        _drain(specs)
    finally:
        from ray import serve

        serve.shutdown()  # type: ignore[no-untyped-call]
        ray.shutdown()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the background process (``python -m riskserve.operations.local``)."""
    parser = argparse.ArgumentParser(prog="riskserve-local")
    parser.add_argument("--grpc-port", type=int, default=None)
    parser.add_argument("--host", default=None)
    parser.add_argument("pipelines", nargs="+", type=Path)
    args = parser.parse_args(argv)
    return _serve_forever(args.pipelines, args.grpc_port, args.host)


if __name__ == "__main__":
    sys.exit(main())
