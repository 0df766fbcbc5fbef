"""riskserve against the floor in one run: the same requests, the same client, one system at a time.

Systems (``--systems``, in this order):

  * ``floor``: ``bench/floor_server.py``, a hand-written grpc.aio server with the same models in one process;
  * ``tabular_plain``: ``tabular_only`` without its ``reasons`` section: the floor's work exactly;
  * ``tabular_only``: ``riskserve up deploy/pipelines/tabular_only.yaml --grpc-port P`` as shipped (reason
    codes for DECLINE and REVIEW);
  * ``tabular_audit``: ``tabular_only`` with the decision audit trail on (``audit:``, its defaults);
  * ``tabular_learning``: ``tabular_audit`` with a ``feedback:`` section too (the feedback deployment;
    its audit records keep the encoded rows the feedback log joins labels to);
  * ``card_fraud``: the same with the vLLM intent model (requests carry text; the engine takes minutes to
    start on CPU, up to 10 are allowed);
  * ``card_fraud_inline``: ``card_fraud`` with the intent LLM placed in the ingress (``placement: ingress``):
    its engine runs in each ingress replica, so a decision crosses no lane and wakes no second process;
  * ``card_fraud_batched``: ``card_fraud`` with adaptive batching on the intent model
    (``batching: {max_batch_size: 8, max_wait_ms: 2}``);
  * ``vllm_bare``: vLLM's own ``generate`` for the same intent prompts in one process, no gRPC: what
    riskserve asks of the engine (one greedy token, log-probabilities of the label tokens), timed directly
    (``bench/vllm_bare.py``, which also serves the same engine behind a hand-written gRPC server: the
    LLM's floor of the paired rounds).

Each gRPC system is started, warmed up, measured, and stopped before the next starts. The client is
``bench/loadgen.py`` in its own process (its CPU is not the server's), one channel shared by its tasks.
Phases: closed loop at concurrency 1 (p50/p99) and 8 (decisions/s, p50/p99, CPU seconds per decision of
every server process over exactly that window, from ``/proc``, and resident memory), one ``DecideBatch``
of 1000 rows at a time, then open loop at fixed offered rates (latency from the intended send time), from
low to high so that overload comes last. Ratios to the floor are printed for each system, and for
card_fraud its p50 minus vLLM's bare p50 (what the platform adds around the LLM). Because the engine's
own speed moves between runs by more than that, ``card_fraud`` and ``card_fraud_inline`` also run rounds
paired with a bare engine kept up beside them (:func:`paired_card_fraud`): bare (in a plain loop, and
behind gRPC with the same client), then riskserve, alternated; the medians of the rounds' differences are
the figures for issue 10's target. For the same reason ``tabular_only`` is also measured in rounds
alternated with the floor, both kept up (:func:`paired_tabular`), after the floor's own phases; the
medians of the rounds' ratios are the tabular figures judged against issue 10's targets, which the run
prints last (:func:`targets`) and writes to the JSON.

riskserve runs with ``RISKSERVE_STATE_DIR`` in a temporary directory (a user's running instance is never
touched) and from a temporary copy of the pipeline YAML whose artifacts point at ``--models`` and whose
feedback log lives in that directory too (the run leaves nothing in ``var/``). On 2 cores the client
and server share the machine: absolute numbers include that, the ratios much less so.

Run: ``.venv/bin/python bench/hotpath.py --models models`` (``make bench``); ``--quick`` for tiny counts,
e.g. ``--quick --systems floor,tabular_only``. Writes ``OUT/hotpath.json`` and ``OUT/hotpath.png``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import save_figure, write_local_pipeline, write_results
from bench._procs import TreeSample, cpu_delta, descendants, rss_bytes, sample_tree
from bench.vllm_bare import bare_env, bare_scorer

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
PIPELINES = ROOT / "deploy" / "pipelines"
SYSTEMS = (
    "floor", "tabular_plain", "tabular_only", "tabular_audit", "tabular_learning", "card_fraud",
    "card_fraud_inline", "card_fraud_batched", "vllm_bare",
)  # fmt: skip
GRPC_SYSTEMS = (
    "floor", "tabular_plain", "tabular_only", "tabular_audit", "tabular_learning", "card_fraud",
    "card_fraud_inline", "card_fraud_batched",
)  # fmt: skip
LLM_SYSTEMS = ("card_fraud", "card_fraud_batched", "card_fraud_inline")
PAIRED_SYSTEMS = ("card_fraud", "card_fraud_inline")
"""The LLM pipelines whose c=1 p50 is judged against the bare engine's, in rounds paired with it."""


@dataclass(frozen=True)
class Variant:
    """A system that is a shipped pipeline changed: some models' fields set, some top-level sections
    dropped or added."""

    pipeline: str
    models: dict[str, dict[str, Any]]
    drop: tuple[str, ...] = ()
    add: tuple[tuple[str, dict[str, Any]], ...] = ()


VARIANTS: dict[str, Variant] = {
    # The floor's work exactly: no reason codes (a DECLINE or REVIEW pays ~2.5 ms of TreeSHAP for them).
    "tabular_plain": Variant("tabular_only", {}, drop=("reasons",)),
    # One ingress replica instead of the default two: what the second replica (availability) costs.
    "tabular_one_ingress": Variant("tabular_only", {}, add=(("serving", {"ingress": {"replicas": 1}}),)),
    # tabular_only with the decision audit trail (as card_fraud ships it: write-ahead journal, SQLite in a
    # background thread): what keeping every decision costs.
    "tabular_audit": Variant("tabular_only", {}, add=(("audit", {"path": "audit"}),)),
    # ... and a feedback log (no model learns: what a learning pipeline's every decision costs to keep).
    "tabular_learning": Variant("tabular_only", {}, add=(("audit", {"path": "audit"}), ("feedback", {}))),
    # Serve's adaptive batching on the intent model, two batches at once (BatchingSpec's default).
    "card_fraud_batched": Variant(
        "card_fraud",
        {"intent": {"batching": {"max_batch_size": 8, "max_wait_ms": 2, "max_concurrent_batches": 2}}},
    ),
    # The intent LLM inside each ingress replica (its engine thread there): no lane, no second process.
    "card_fraud_inline": Variant(
        "card_fraud", {"intent": {"placement": "ingress", "pool": "cpu", "num_cpus": 0.5}}
    ),
}
FLEET_CONNECTIONS = 8
"""The c=8 phase runs twice: its eight callers share one connection (``--channels``, one by default: what
served the floor best), then each has its own, as eight callers in a fleet would (``c8_fleet``): the kernel
then spreads them over every process listening on the port (riskserve's two ingress replicas)."""
TABULAR_START_S = 300.0
LLM_START_S = 600.0


@dataclass(frozen=True)
class Plan:
    """How much each phase measures; bounded by time as well as by count, so a slow system ends too."""

    warmup: int
    c1_calls: int
    c8_calls: int
    closed_seconds: float
    batch_rows: int
    batch_calls: int
    batch_seconds: float
    tabular_rates: tuple[float, ...]
    llm_rates: tuple[float, ...]
    open_seconds: float
    vllm_prompts: int
    paired_rounds: int = 0
    """Rounds of card_fraud c=1 alternated with vLLM's bare generate (see :func:`paired_card_fraud`)."""
    tabular_rounds: int = 0
    """Rounds of the floor and ``tabular_only`` alternated, each with every tabular phase
    (see :func:`paired_tabular`)."""


FULL = Plan(
    warmup=300,
    # the c=1 window ends on time (8 s): 2,000 calls ended it after ~2.2 s, and a p99 of 20 calls moved
    # 1.37-2.46x the floor's between the four paired rounds of one run (15:47 on 7 December)
    c1_calls=20000,
    c8_calls=20000,
    closed_seconds=8.0,
    batch_rows=1000,
    # ~2.5 s of 1,000-row tabular batches (20 gave ratios of 1.17x-1.70x); an LLM pipeline's stop at 15 s
    batch_calls=60,
    batch_seconds=15.0,
    tabular_rates=(100, 300, 600, 1000),
    llm_rates=(10, 30, 60),
    open_seconds=6.0,
    vllm_prompts=100,
    paired_rounds=5,
    tabular_rounds=4,
)
QUICK = Plan(
    warmup=20,
    c1_calls=50,
    c8_calls=200,
    closed_seconds=4.0,
    batch_rows=100,
    batch_calls=5,
    batch_seconds=10.0,
    tabular_rates=(100,),
    llm_rates=(10,),
    open_seconds=2.0,
    vllm_prompts=10,
    paired_rounds=1,
    tabular_rounds=2,
)


@dataclass
class Running:
    """A started system: where to call it, which process tree is the server, and how to stop it."""

    name: str
    application: str
    target: str
    root_pid: int
    text: bool
    stop: Callable[[], None]
    startup_s: float
    client: tuple[str, ...] = ()
    """Extra ``bench/loadgen.py`` arguments for this system (another protocol, reference answers)."""


def log(message: str) -> None:
    """One progress line on stderr."""
    print(f"[hotpath {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _tail(path: Path, chars: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


# -- starting and stopping the systems -----------------------------------------------------------------


def start_floor(models: Path, run_dir: Path) -> Running:
    """The floor server as a subprocess on a free port; returns once it printed that it serves."""
    started = time.perf_counter()
    log_path = run_dir / "floor.log"
    command = [sys.executable, str(BENCH / "floor_server.py"), "--models", str(models), "--port", "0"]
    with log_path.open("w") as stderr:
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=stderr, text=True)
    line = _first_line(process, timeout_s=300.0)
    if not line.startswith("serving on "):
        process.kill()
        raise RuntimeError(f"the floor did not start ({line!r}); {log_path}:\n{_tail(log_path)}")

    target = line.removeprefix("serving on ").strip()
    stop = terminator(process, wait_s=10.0)
    return Running("floor", "tabular_only", target, process.pid, False, stop, time.perf_counter() - started)


def start_llm_floor(models: Path, run_dir: Path) -> Running:
    """vLLM's bare engine behind a hand-written grpc.aio server (``bench/vllm_bare.py``), on a free port;
    returns once it printed that it serves. Requests carry text; answers are checked by nobody."""
    started = time.perf_counter()
    log_path = run_dir / "vllm_bare_grpc.log"
    command = [sys.executable, str(BENCH / "vllm_bare.py"), "--models", str(models), "--port", "0"]
    with log_path.open("w") as stderr:
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=stderr, text=True, env=bare_env())
    line = _first_line(process, timeout_s=LLM_START_S)
    while line and not line.startswith("serving on "):  # vLLM logs on stdout too
        line = _first_line(process, timeout_s=LLM_START_S)
    if not line.startswith("serving on "):
        process.kill()
        raise RuntimeError(f"the LLM's floor did not start ({line!r}); {log_path}:\n{_tail(log_path)}")
    target = line.removeprefix("serving on ").strip()
    stop = terminator(process, wait_s=30.0)
    return Running(
        "vllm_bare_grpc", "card_fraud", target, process.pid, True, stop, time.perf_counter() - started
    )


def terminator(process: subprocess.Popen[str], wait_s: float) -> Callable[[], None]:
    """A ``Running.stop`` for a server subprocess: SIGTERM, then SIGKILL if it is not gone in ``wait_s``."""

    def stop() -> None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    return stop


def _first_line(process: subprocess.Popen[str], timeout_s: float) -> str:
    """The first stdout line of ``process``, or '' if it exits or stays silent for ``timeout_s``."""
    stdout = process.stdout
    assert stdout is not None
    box: list[str] = []
    reader = threading.Thread(target=lambda: box.append(stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout_s)
    return box[0] if box else ""


def pipeline_copy(name: str, models: Path, run_dir: Path) -> Path:
    """The shipped pipeline YAML with absolute artifact paths into ``models`` and any feedback log (and
    learned versions) under ``run_dir``, written to ``run_dir``."""
    import yaml

    variant = VARIANTS.get(name, Variant(name, {}))
    data = yaml.safe_load((PIPELINES / f"{variant.pipeline}.yaml").read_text())
    for model_name, fields in variant.models.items():
        data["models"][model_name].update(fields)
    for section in variant.drop:
        data.pop(section, None)
    for section, value in variant.add:
        data[section] = dict(value)
    return write_local_pipeline(data, models, run_dir, name)


def _riskserve(*args: str, timeout_s: float) -> tuple[int, str]:
    """Run the ``riskserve`` command of this interpreter's environment; (exit code, its output).

    Past ``timeout_s`` it is killed with every process below it (``up`` detaches its server into a
    session of its own; it is still a descendant), and the exit code is -9.
    """
    executable = Path(sys.executable).parent / "riskserve"
    process = subprocess.Popen(
        [str(executable), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
    )
    try:
        output, _ = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        for pid in descendants(process.pid):  # by pid: never a process group that might hold us
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        output, _ = process.communicate()
        return -9, f"timed out after {timeout_s:.0f} s\n{output}"
    return process.returncode, output


def start_riskserve(name: str, models: Path, run_dir: Path) -> Running:
    """``riskserve up`` of one pipeline (returns once it serves); stopped by ``riskserve down``."""
    from riskserve.operations.local import read_state

    started = time.perf_counter()
    port = _free_port()
    timeout_s = LLM_START_S if name in LLM_SYSTEMS else TABULAR_START_S
    code, output = _riskserve(
        "up", str(pipeline_copy(name, models, run_dir)), "--grpc-port", str(port), timeout_s=timeout_s
    )
    state = read_state()
    if code != 0 or state is None:
        if state is not None:
            _riskserve("down", timeout_s=180.0)
        raise RuntimeError(f"riskserve up {name} failed ({code}):\n{output[-4000:]}")

    def stop() -> None:
        code, output = _riskserve("down", timeout_s=180.0)
        if code != 0:
            log(f"{name}: riskserve down failed ({code}), killing its process group: {output[-500:]}")
            with contextlib.suppress(ProcessLookupError):
                os.killpg(state.pid, signal.SIGKILL)

    application = VARIANTS.get(name, Variant(name, {})).pipeline
    return Running(
        name, application, state.target, state.pid, name in LLM_SYSTEMS, stop, time.perf_counter() - started
    )


@contextlib.contextmanager
def running(name: str, models: Path, run_dir: Path) -> Iterator[Running]:
    """A started system for the block, stopped after it whatever happens."""
    log(f"{name}: starting")
    system = start_floor(models, run_dir) if name == "floor" else start_riskserve(name, models, run_dir)
    log(f"{name}: serving on {system.target} after {system.startup_s:.1f} s")
    try:
        yield system
    finally:
        log(f"{name}: stopping")
        system.stop()


# -- measuring -----------------------------------------------------------------------------------------


def loadgen(
    system: Running,
    mode: str,
    options: Sequence[str],
    *,
    bound_s: float,
    on_start: Callable[[], None] = lambda: None,
    on_end: Callable[[], None] = lambda: None,
) -> dict[str, Any]:
    """One ``bench/loadgen.py`` run against ``system``; killed if it has not finished after ``bound_s``."""
    command = [
        sys.executable,
        str(BENCH / "loadgen.py"),
        "--target",
        system.target,
        "--pipeline",
        system.application,
        "--mode",
        mode,
        *options,
        *system.client,
    ]
    if system.text:
        command.append("--text")
    with tempfile.TemporaryFile("w+") as errors:  # a file, not a pipe: a chatty stderr cannot block it
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=errors, text=True)
        watchdog = threading.Timer(bound_s, process.kill)
        watchdog.start()
        try:
            result = _follow(process, on_start, on_end)
        finally:
            watchdog.cancel()
        errors.seek(0)
        stderr = errors.read()
    if process.returncode != 0 or result is None:
        raise RuntimeError(
            f"loadgen {mode} {' '.join(options)} failed ({process.returncode}):\n{stderr[-3000:]}"
        )
    return result


def _follow(
    process: subprocess.Popen[str], on_start: Callable[[], None], on_end: Callable[[], None]
) -> dict[str, Any] | None:
    """Read loadgen's JSON lines to the end: call back on the window's start and end, return the result."""
    assert process.stdout is not None
    result = None
    for line in process.stdout:
        if not line.startswith("{"):
            continue  # not ours (a library printing to stdout)
        document = json.loads(line)
        if document.get("event") == "start":
            on_start()
        elif document.get("event") == "end":
            on_end()
        else:
            result = document
    process.wait()
    return result


def _bound(seconds: float, warmup_calls: int) -> float:
    """Generous wall-clock bound of a loadgen run: start-up, warm-up, window, answers' 5 s deadline."""
    return 60.0 + seconds + 10.0 + warmup_calls * 0.5


def closed(
    system: Running,
    concurrency: int,
    calls: int,
    plan: Plan,
    channels: int,
    *,
    others: Mapping[str, int] | None = None,
) -> dict[str, Any]:
    """Closed loop at ``concurrency``, with the server tree's CPU over exactly the window and its memory.

    ``others``: more process trees (name -> root pid) whose CPU over the same window is reported too, in
    ``result["others"][name]`` (a database server the system uses: its processes are not the server's).
    """
    samples: dict[str, TreeSample] = {}
    times: dict[str, float] = {}
    roots = {"server": system.root_pid, **(others or {})}

    def mark(which: str) -> Callable[[], None]:
        def sample() -> None:
            for name, pid in roots.items():
                samples[f"{which}:{name}"] = sample_tree(pid)
            times[which] = time.perf_counter()

        return sample

    options = [f"-c{concurrency}", f"--calls={calls}", f"--seconds={plan.closed_seconds}"]
    options += [f"--channels={channels}", "--warmup=20"]
    result = loadgen(
        system,
        "closed",
        options,
        bound_s=_bound(plan.closed_seconds, 20),
        on_start=mark("start"),
        on_end=mark("end"),
    )
    cpu_s, exited = cpu_delta(samples["start:server"], samples["end:server"])
    window = times["end"] - times["start"]
    result["server"] = {
        "cpu_s": cpu_s,
        "window_s": window,
        "cores_busy": cpu_s / window if window > 0 else 0.0,
        "cpu_ms_per_decision": cpu_s * 1e3 / max(result["decisions"], 1),
        "processes": len(samples["end:server"].cpu_s),
        "processes_exited_in_window": exited,
        "rss_mb": rss_bytes(system.root_pid) / 2**20,
    }
    if others:
        result["others"] = {}
        for name in others:
            other_s, _ = cpu_delta(samples[f"start:{name}"], samples[f"end:{name}"])
            result["others"][name] = {
                "cpu_s": other_s,
                "cores_busy": other_s / window if window > 0 else 0.0,
                "cpu_ms_per_decision": other_s * 1e3 / max(result["decisions"], 1),
            }
    return result


def batch(system: Running, plan: Plan) -> dict[str, Any]:
    """``DecideBatch`` of ``plan.batch_rows`` rows, one call at a time."""
    options = [f"--batch={plan.batch_rows}", f"--calls={plan.batch_calls}", f"--seconds={plan.batch_seconds}"]
    return loadgen(system, "batch", [*options, "--warmup=2"], bound_s=_bound(plan.batch_seconds, 20))


def open_loop(system: Running, rate: float, plan: Plan, channels: int) -> dict[str, Any]:
    """Poisson arrivals at ``rate`` per second for ``plan.open_seconds``."""
    options = [f"--rate={rate}", f"--seconds={plan.open_seconds}", f"--channels={channels}", "--warmup=20"]
    return loadgen(system, "open", options, bound_s=_bound(plan.open_seconds, 20))


def _brief(result: dict[str, Any]) -> str:
    latency = result["latency_ms"]
    text = f"p50 {latency['p50']:.2f} ms, p99 {latency['p99']:.2f} ms"
    text += f", {result['decisions_per_s']:.0f} decisions/s"
    if result["error_count"] or result["fallback_count"]:
        text += f", errors {result['errors']}, fallbacks {result['fallbacks']}"
    return text


def _server_brief(result: dict[str, Any]) -> str:
    """The server side of a :func:`closed` phase: CPU per decision, cores busy, resident memory."""
    server = result["server"]
    return (
        f"server {server['cpu_ms_per_decision']:.3f} CPU-ms/decision, {server['cores_busy']:.2f} cores, "
        f"{server['rss_mb']:.0f} MB"
    )


def settle(system: Running, *, idle_cores: float = 0.1, patience_s: float = 45.0) -> float:
    """Wait until the server's processes are idle (a fresh Ray keeps starting agents for a while after
    ``riskserve up`` returns); the same rule for every system. Returns the seconds waited."""
    started = time.monotonic()
    while time.monotonic() - started < patience_s:
        before = sample_tree(system.root_pid)
        time.sleep(1.0)
        busy, _ = cpu_delta(before, sample_tree(system.root_pid))
        if busy <= idle_cores:
            break
    return time.monotonic() - started


def warm_up(system: Running, plan: Plan, channels: int) -> None:
    """``plan.warmup`` calls at c=8, unmeasured: what every system gets before its first window."""
    options = ["-c8", f"--calls={plan.warmup}", "--seconds=60", "--warmup=0", f"--channels={channels}"]
    loadgen(system, "closed", options, bound_s=_bound(60.0, 0))


def measure_grpc(system: Running, plan: Plan, channels: int) -> dict[str, Any]:
    """Every phase against one started system."""
    waited = settle(system)
    log(f"{system.name}: idle after {waited:.0f} s; warm-up ({plan.warmup} calls at c=8)")
    warm_up(system, plan, channels)
    out: dict[str, Any] = {"startup_s": system.startup_s, "target": system.target}
    out["c1"] = closed(system, 1, plan.c1_calls, plan, channels)
    log(f"{system.name}: c=1 {_brief(out['c1'])}")
    out["c8"] = closed(system, 8, plan.c8_calls, plan, channels)
    log(f"{system.name}: c=8 {_brief(out['c8'])}; {_server_brief(out['c8'])}")
    if channels < FLEET_CONNECTIONS:
        out["c8_fleet"] = closed(system, 8, plan.c8_calls, plan, FLEET_CONNECTIONS)
        fleet = out["c8_fleet"]
        phase = f"c=8 over {FLEET_CONNECTIONS} connections"
        log(f"{system.name}: {phase} {_brief(fleet)}; {_server_brief(fleet)}")
    out["batch"] = batch(system, plan)
    log(f"{system.name}: DecideBatch({plan.batch_rows}) {_brief(out['batch'])}")
    out["open"] = []
    for rate in plan.llm_rates if system.text else plan.tabular_rates:
        out["open"].append(open_loop(system, rate, plan, channels))
        log(f"{system.name}: open loop {rate:g}/s {_brief(out['open'][-1])}")
    return out


# -- vLLM on its own -----------------------------------------------------------------------------------


def measure_vllm_bare(models: Path, plan: Plan, run_dir: Path) -> dict[str, Any]:
    """Run :func:`vllm_bare_child` in a subprocess (its own engine, environment and log).

    Its OpenMP threads are what Ray gives riskserve's intent replica (``OMP_NUM_THREADS`` = the model's
    ``num_cpus``, at least 1, unless already set): on 2 busy cores 2 threads instead of 1 made a single
    prompt about 15 times slower in our measurement, which would flatter riskserve.
    """
    result_path = run_dir / "vllm_bare.json"
    log_path = run_dir / "vllm_bare.log"
    env = bare_env()
    command = [sys.executable, __file__, "--child-vllm-bare", str(result_path), "--models", str(models)]
    command += ["--vllm-prompts", str(plan.vllm_prompts)]
    log(f"vllm_bare: starting the engine in a subprocess (OMP_NUM_THREADS={env['OMP_NUM_THREADS']})")
    with log_path.open("w") as output:
        done = subprocess.run(
            command, stdout=output, stderr=subprocess.STDOUT, env=env, timeout=LLM_START_S + 300
        )
    if done.returncode != 0 or not result_path.exists():
        raise RuntimeError(f"vllm_bare failed ({done.returncode}); {log_path}:\n{_tail(log_path)}")
    result: dict[str, Any] = json.loads(result_path.read_text())
    result["omp_num_threads"] = int(env["OMP_NUM_THREADS"])
    log(
        f"vllm_bare: engine up in {result['startup_s']:.1f} s; one prompt p50 "
        f"{result['single']['p50']:.2f} ms, 8 at once p50 {result['eight']['p50']:.2f} ms"
    )
    return result


def vllm_bare_child(result_path: Path, models: Path, prompts: int) -> None:
    """In a fresh process: time the bare engine one prompt at a time and eight at once. Writes the result
    as JSON to ``result_path``."""
    from bench.loadgen import latency_ms

    scorer = bare_scorer(models, prompts)
    single = scorer.timed(1, prompts)
    eight = scorer.timed(8, max(prompts // 4, 3))
    result = {
        "startup_s": scorer.startup_s,
        "import_s": scorer.import_s,
        "single": latency_ms(single),
        "eight": latency_ms(eight),
        "eight_prompts_per_s": 8 * len(eight) / sum(eight),
        "prompts": prompts,
    }
    result_path.write_text(json.dumps(result) + "\n")


_ROUND_RESULT = "BARE-ROUND "
"""Prefix of the line a bare-engine child answers a round with (vLLM logs on the same stdout)."""


def vllm_bare_rounds_child(models: Path, prompts: int) -> None:
    """In a fresh process: start the bare engine, say ``READY``, then for each line ``N [GAP_MS]`` on stdin
    time N prompts one at a time (each after GAP_MS idle, if given) and answer with one ``BARE-ROUND
    {json}`` line; end at ``quit`` or EOF."""
    from bench.loadgen import latency_ms

    scorer = bare_scorer(models, prompts)
    print(_ROUND_RESULT + json.dumps({"ready": True, "startup_s": scorer.startup_s}), flush=True)
    offset = 0
    for line in sys.stdin:
        if line.strip() in ("", "quit"):
            break
        words = line.split()
        calls, gap_ms = int(words[0]), float(words[1]) if len(words) > 1 else 0.0
        samples = scorer.timed(1, calls, offset, gap_s=gap_ms / 1e3)
        offset += calls
        answer = {"single": latency_ms(samples), "prompts": calls, "gap_ms": gap_ms}
        print(_ROUND_RESULT + json.dumps(answer), flush=True)


class BareEngine:
    """vLLM's bare ``generate`` in a child process kept up between rounds (:func:`paired_card_fraud`).

    Idle between rounds (the synchronous engine runs nothing between calls), with the same environment
    and OpenMP threads as the standalone ``vllm_bare`` system.
    """

    def __init__(self, models: Path, plan: Plan, run_dir: Path) -> None:
        self.log_path = run_dir / "vllm_bare_rounds.log"
        command = [sys.executable, __file__, "--child-vllm-bare-rounds", "--models", str(models)]
        command += ["--vllm-prompts", str(plan.vllm_prompts)]
        self._log = self.log_path.open("w")
        self._process = subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            env=bare_env(),
            text=True,
        )
        self.startup_s = float(self._answer(LLM_START_S)["startup_s"])

    def _answer(self, timeout_s: float) -> dict[str, Any]:
        """The next round line from the child; its other output goes to the log."""
        assert self._process.stdout is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            line = self._process.stdout.readline()
            if not line:
                raise RuntimeError(f"the bare engine exited; {self.log_path}:\n{_tail(self.log_path)}")
            if line.startswith(_ROUND_RESULT):
                answer: dict[str, Any] = json.loads(line[len(_ROUND_RESULT) :])
                return answer
            self._log.write(line)
        raise RuntimeError(f"the bare engine did not answer within {timeout_s:.0f} s")

    def round(self, prompts: int, gap_ms: float = 0.0) -> dict[str, Any]:
        """Time ``prompts`` prompts one at a time in the child, back to back or each after ``gap_ms`` idle."""
        assert self._process.stdin is not None
        self._process.stdin.write(f"{prompts} {gap_ms:g}\n")
        self._process.stdin.flush()
        return self._answer(300.0)

    def close(self) -> None:
        if self._process.poll() is None:
            with contextlib.suppress(OSError):
                assert self._process.stdin is not None
                self._process.stdin.write("quit\n")
                self._process.stdin.close()
            try:
                self._process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        self._log.close()


def _is_stopped(pid: int) -> bool | None:
    """Whether ``pid`` is stopped by a signal (state ``T``), from the kernel; None once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"
    except (OSError, IndexError):
        return None


def _settle_state(pids: Sequence[int], stopped: bool, timeout_s: float = 2.0) -> None:
    """Wait until every live process of ``pids`` is (or is no longer) stopped: a signal takes effect when
    the process next enters the kernel, not when ``kill`` returns, so a running one can still be on a core."""
    deadline = time.monotonic() + timeout_s
    pending = list(pids)
    while pending and time.monotonic() < deadline:
        pending = [pid for pid in pending if _is_stopped(pid) not in (stopped, None)]
        if pending:
            time.sleep(0.001)


@contextlib.contextmanager
def frozen(system: Running) -> Iterator[None]:
    """Every process of ``system`` stopped (SIGSTOP) for the duration, then continued: its idle
    housekeeping (Ray's and Serve's timers, metrics) takes no CPU from what is measured meanwhile. The
    block starts once each process is stopped, and the context ends once each runs again."""
    pids = [system.root_pid, *descendants(system.root_pid)]
    stopped = []
    try:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
                stopped.append(pid)
        _settle_state(stopped, stopped=True)
        yield
    finally:
        for pid in reversed(stopped):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        _settle_state(stopped, stopped=False)


PACED_GAP_MS = 3.0
"""Idle before each prompt of the bare engine's paced rounds: about what a c=1 client and a gRPC front door
take around the LLM (a tabular decision's c=1 round trip is ~1.4 ms here, card_fraud's part outside the
intent replica ~2.3-2.8 ms)."""


def _riskserve_turn(system: Running, served: Running, plan: Plan, channels: int) -> dict[str, Any]:
    """riskserve's c=1 window of a paired round, the LLM's floor frozen; it starts once riskserve is idle
    again (:func:`settle`: the timers that fell due while it was frozen run first, not in the window)."""
    with frozen(served):
        settle(system, patience_s=10.0)
        return closed(system, 1, plan.c1_calls, plan, channels)


def paired_card_fraud(
    system: Running, bare: BareEngine, served: Running, plan: Plan, channels: int
) -> dict[str, Any]:
    """``card_fraud`` at c=1 and vLLM's bare ``generate`` of the same prompts, alternated round by round.

    The two are measured minutes apart otherwise, and on these 2 shared cores the engine step alone
    moves by 3.4-5.7 ms between runs: more than the 3 ms budget around it. Here each round times the
    bare engine (riskserve frozen meanwhile, so Ray's idle work costs the bare engine nothing), then
    riskserve's c=1 (the bare engine idle), in that order in even rounds and the other way round in odd
    ones; riskserve's window starts once it is idle again after being frozen. The figure is the median
    over rounds of riskserve's p50 minus the bare p50 of the same round.

    The bare engine is also timed paced (:data:`PACED_GAP_MS` idle before each prompt), as any server's
    engine is at c=1 while the caller and the front door do their part: in a plain process, the same
    engine step takes 2.3 ms back to back and 3.1 ms after 5 ms idle (caches and the idle core go cold).
    ``added_vs_paced_ms`` is riskserve's p50 minus that.

    And the same engine is timed behind a hand-written gRPC server (``served``, the LLM's floor:
    ``bench/vllm_bare.py``) by the same client at c=1 as riskserve, in the same round (riskserve frozen
    meanwhile, and the served floor frozen during riskserve's turn): every system of ``make bench`` is
    measured over real gRPC from a separate client process, and this is the bare ``generate`` so measured.
    ``added_vs_served_ms`` is riskserve's p50 minus its p50: what riskserve adds to a hand-written server
    of the same call (features, both tabular models, rules, reasons, audit, and the platform).
    """
    rounds = []
    for index in range(plan.paired_rounds):
        riskserve_first = index % 2 == 1  # neither side always takes the later minute of a round
        if riskserve_first:
            riskserve_round = _riskserve_turn(system, served, plan, channels)
        with frozen(system):
            bare_round = bare.round(plan.vllm_prompts)
            paced_round = bare.round(plan.vllm_prompts, gap_ms=PACED_GAP_MS)
            served_round = closed(served, 1, plan.c1_calls, plan, channels)
        if not riskserve_first:
            riskserve_round = _riskserve_turn(system, served, plan, channels)
        added = riskserve_round["latency_ms"]["p50"] - bare_round["single"]["p50"]
        served_p50 = served_round["latency_ms"]["p50"]
        rounds.append(
            {
                "bare_p50_ms": bare_round["single"]["p50"],
                "card_fraud_p50_ms": riskserve_round["latency_ms"]["p50"],
                "card_fraud_p99_ms": riskserve_round["latency_ms"]["p99"],
                "added_ms": added,
                "bare_paced_p50_ms": paced_round["single"]["p50"],
                "added_vs_paced_ms": riskserve_round["latency_ms"]["p50"] - paced_round["single"]["p50"],
                "bare_served_p50_ms": served_p50,
                "bare_served_p99_ms": served_round["latency_ms"]["p99"],
                "added_vs_served_ms": riskserve_round["latency_ms"]["p50"] - served_p50,
                "errors": riskserve_round["error_count"] + served_round["error_count"],
                "first": system.name if riskserve_first else "bare",
            }
        )
        log(
            f"{system.name}: paired round {index + 1}/{plan.paired_rounds}: bare p50 "
            f"{bare_round['single']['p50']:.2f} ms (paced {paced_round['single']['p50']:.2f}, over gRPC "
            f"{served_p50:.2f}), card_fraud c=1 p50 {riskserve_round['latency_ms']['p50']:.2f} ms, "
            f"+{added:.2f} ms (+{rounds[-1]['added_vs_served_ms']:.2f} over gRPC)"
        )
    return {
        "rounds": rounds,
        "added_ms_median": statistics.median(r["added_ms"] for r in rounds),
        "bare_p50_ms_median": statistics.median(r["bare_p50_ms"] for r in rounds),
        "bare_paced_p50_ms_median": statistics.median(r["bare_paced_p50_ms"] for r in rounds),
        "added_vs_paced_ms_median": statistics.median(r["added_vs_paced_ms"] for r in rounds),
        "bare_served_p50_ms_median": statistics.median(r["bare_served_p50_ms"] for r in rounds),
        "added_vs_served_ms_median": statistics.median(r["added_vs_served_ms"] for r in rounds),
        "paced_gap_ms": PACED_GAP_MS,
        "card_fraud_p50_ms_median": statistics.median(r["card_fraud_p50_ms"] for r in rounds),
        "bare_startup_s": bare.startup_s,
    }


PAIRED_TABULAR = "tabular_only"
"""The tabular system judged against the floor in alternating rounds (:func:`paired_tabular`)."""
PAIRED_KEY = "tabular_only_paired"
"""Where :func:`run_systems` keeps those rounds, beside the systems' own results."""
TABULAR_LIMITS = {"p50_c1": 1.5, "p99_c1": 2.0, "throughput_c8": 0.6, "cpu_per_decision": 1.5, "batch": 1.5}
"""Issue 10's tabular targets, as ratios to the floor; throughput is a floor (at least), the rest ceilings."""
TABULAR_RATIOS = tuple(TABULAR_LIMITS)
"""The ratios a tabular round takes (:func:`turn_ratios`), one per target."""


def tabular_turn(system: Running, plan: Plan, channels: int) -> dict[str, Any]:
    """One system's turn of a tabular round: c=1, c=8 (with the server's CPU) and ``DecideBatch``."""
    waited = settle(system, patience_s=10.0)
    turn = {"settled_s": waited, "c1": closed(system, 1, plan.c1_calls, plan, channels)}
    turn["c8"] = closed(system, 8, plan.c8_calls, plan, channels)
    turn["batch"] = batch(system, plan)
    return turn


def turn_ratios(system: dict[str, Any], floor: dict[str, Any]) -> dict[str, float]:
    """A system's figures over the floor's, phase by phase (latency and cost: higher is worse;
    throughput: lower is worse): the five figures issue 10's tabular targets are set on."""
    return {
        "p50_c1": system["c1"]["latency_ms"]["p50"] / floor["c1"]["latency_ms"]["p50"],
        "p99_c1": system["c1"]["latency_ms"]["p99"] / floor["c1"]["latency_ms"]["p99"],
        "throughput_c8": system["c8"]["decisions_per_s"] / floor["c8"]["decisions_per_s"],
        "cpu_per_decision": system["c8"]["server"]["cpu_ms_per_decision"]
        / floor["c8"]["server"]["cpu_ms_per_decision"],
        "batch": system["batch"]["latency_ms"]["p50"] / floor["batch"]["latency_ms"]["p50"],
    }


def paired_tabular(floor: Running, system: Running, plan: Plan, channels: int) -> dict[str, Any]:
    """The floor and ``tabular_only`` both up, measured in alternating turns, each round's ratios taken
    between turns a minute apart; the figures are the medians over rounds of those ratios.

    Measured one after the other, the floor and riskserve are minutes apart, and on these shared cores a
    phase's figures move 1.5-3x from one quarter hour to the next: the 14:42 run on 7 December put
    DecideBatch(1000) at 1.87x the floor while ``tabular_plain``, measured just before with the same batch
    path, took 1.12x. Here the floor and riskserve take turns (floor first in even rounds, riskserve first
    in odd ones, so neither always runs in the later minute), and the one not measured is frozen
    (SIGSTOP, :func:`frozen`): its idle timers take no CPU from the other's window. A turn starts once
    the system is idle again (:func:`settle`), and runs the same c=1, c=8 and batch phases as
    :func:`measure_grpc`, with the same plan.
    """
    rounds = []
    for index in range(plan.tabular_rounds):
        order = (floor, system) if index % 2 == 0 else (system, floor)
        turns: dict[str, dict[str, Any]] = {}
        for this in order:
            with frozen(system if this is floor else floor):
                turns[this.name] = tabular_turn(this, plan, channels)
        mine, theirs = turns[system.name], turns[floor.name]
        ratio = turn_ratios(mine, theirs)
        errors = sum(turn[phase]["error_count"] for turn in (mine, theirs) for phase in ("c1", "c8", "batch"))
        rounds.append({"first": order[0].name, "ratios": ratio, "errors": errors, "turns": turns})
        figures = ", ".join(f"{key} {ratio[key]:.2f}x" for key in TABULAR_RATIOS)
        log(
            f"{system.name} against the floor, round {index + 1}/{plan.tabular_rounds} ({order[0].name} "
            f"first): {figures} (floor c=1 p50 {theirs['c1']['latency_ms']['p50']:.2f} ms, c=8 "
            f"{theirs['c8']['decisions_per_s']:.0f}/s; {system.name} {mine['c1']['latency_ms']['p50']:.2f} "
            f"ms, {mine['c8']['decisions_per_s']:.0f}/s){f', {errors} errors' if errors else ''}"
        )
    return {
        "system": system.name,
        "rounds": rounds,
        "ratios_median": {key: statistics.median(r["ratios"][key] for r in rounds) for key in TABULAR_RATIOS},
        "errors": sum(r["errors"] for r in rounds),
    }


def measure_paired_tabular(
    floor: Running, models: Path, plan: Plan, channels: int, run_dir: Path
) -> dict[str, Any]:
    """Start :data:`PAIRED_TABULAR` beside the running floor (after the floor's own phases), warm it up
    like every system, then :func:`paired_tabular`; riskserve is stopped after."""
    with running(PAIRED_TABULAR, models, run_dir) as system:
        with frozen(floor):
            waited = settle(system)
            log(
                f"{system.name}: idle after {waited:.0f} s; warm-up, then {plan.tabular_rounds} rounds "
                "with the floor"
            )
            warm_up(system, plan, channels)
        return paired_tabular(floor, system, plan, channels)


# -- the report ----------------------------------------------------------------------------------------


def ratios(results: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Each gRPC system's figures over the floor's (latency and cost: higher is worse; throughput: lower)."""
    floor = results.get("floor")
    if not floor or "error" in floor:
        return {}
    out = {}
    for name in GRPC_SYSTEMS:
        system = results.get(name)
        if name == "floor" or not system or "error" in system:
            continue
        out[name] = turn_ratios(system, floor)
        if "c8_fleet" in system and "c8_fleet" in floor:
            fleet, floor_fleet = system["c8_fleet"], floor["c8_fleet"]
            out[name]["throughput_c8_fleet"] = fleet["decisions_per_s"] / floor_fleet["decisions_per_s"]
            out[name]["cpu_per_decision_fleet"] = (
                fleet["server"]["cpu_ms_per_decision"] / floor_fleet["server"]["cpu_ms_per_decision"]
            )
    return out


CARD_FRAUD_BUDGET_MS = 3.0
"""What card_fraud's c=1 p50 may add to the bare engine's."""
CARD_FRAUD_C8_BEFORE = 55.0
"""card_fraud's decisions/s at c=8 when issue 10 was filed; with batching it must reach 3x that."""
CARD_FRAUD_BATCHED_GAIN = 3.0


def targets(results: dict[str, Any], table: dict[str, dict[str, float]]) -> list[dict[str, Any]]:
    """Issue 10's targets, each with the figure this run measured, its limit, whether it held, and where
    the figure comes from. The tabular ratios are the paired rounds' medians when they ran (the
    sequential phases' ratios otherwise); card_fraud's budget is the paired rounds' median against the
    same engine behind a hand-written gRPC server."""
    out: list[dict[str, Any]] = []
    paired = results.get(PAIRED_KEY, {})
    if "ratios_median" in paired:
        tabular, source = (
            paired["ratios_median"],
            f"median of {len(paired['rounds'])} rounds paired with the floor",
        )
    else:
        tabular, source = table.get(PAIRED_TABULAR, {}), "measured minutes after the floor"
    for key, limit in TABULAR_LIMITS.items():
        if key in tabular:
            at_least = key == "throughput_c8"
            value = tabular[key]
            met = value >= limit if at_least else value <= limit
            bound = ">=" if at_least else "<="
            out.append(
                {
                    "target": f"{PAIRED_TABULAR} {key}",
                    "value": value,
                    "limit": f"{bound} {limit}x",
                    "met": met,
                    "source": source,
                }
            )
    card = results.get("card_fraud", {}).get("paired")
    if card:
        value = card["added_vs_served_ms_median"]
        out.append(
            {
                "target": "card_fraud p50 over the bare engine (ms)",
                "value": value,
                "limit": f"<= +{CARD_FRAUD_BUDGET_MS} ms",
                "met": value <= CARD_FRAUD_BUDGET_MS,
                "source": f"median of {len(card['rounds'])} rounds against the engine behind gRPC "
                f"(+{card['added_ms_median']:.2f} ms over its plain loop)",
            }
        )
    batched = results.get("card_fraud_batched", {})
    if "c8" in batched:
        gain = batched["c8"]["decisions_per_s"] / CARD_FRAUD_C8_BEFORE
        out.append(
            {
                "target": "card_fraud_batched decisions/s at c=8, x the issue's 55/s",
                "value": gain,
                "limit": f">= {CARD_FRAUD_BATCHED_GAIN}x",
                "met": gain >= CARD_FRAUD_BATCHED_GAIN,
                "source": f"{batched['c8']['decisions_per_s']:.0f}/s in its c=8 phase",
            }
        )
    return out


def print_targets(verdicts: Sequence[dict[str, Any]]) -> None:
    """One line per target of issue 10: the figure, its limit, and whether it held."""
    if not verdicts:
        return
    print("\nissue 10's targets in this run")
    for v in verdicts:
        mark = "met" if v["met"] else "MISSED"
        print(f"  {v['target']:<58} {v['value']:>7.2f}  {v['limit']:<10} {mark:<6}  ({v['source']})")


def print_report(results: dict[str, Any], table: dict[str, dict[str, float]], plan: Plan) -> None:
    """The summary table, ratios to the floor, open-loop lines and the LLM's share."""
    print(
        f"\n{'system':<18} | {'c=1 p50':>8} {'p99':>7} | {'c=8 dec/s':>9} {'p50':>7} {'p99':>7} | "
        f"{'CPU-ms/dec':>10} {'RSS MB':>7} | {f'batch{plan.batch_rows} ms':>12} | errors"
    )
    for name in GRPC_SYSTEMS:
        r = results.get(name)
        if not r:
            continue
        if "error" in r:
            print(f"{name:<18} | failed: {r['error'].splitlines()[0][:90]}")
            continue
        c1, c8, b = r["c1"]["latency_ms"], r["c8"], r["batch"]
        errors = sum(x["error_count"] for x in (r["c1"], r["c8"], r["batch"]))
        print(
            f"{name:<18} | {c1['p50']:>8.2f} {c1['p99']:>7.2f} | {c8['decisions_per_s']:>9.0f} "
            f"{c8['latency_ms']['p50']:>7.2f} {c8['latency_ms']['p99']:>7.2f} | "
            f"{c8['server']['cpu_ms_per_decision']:>10.3f} {c8['server']['rss_mb']:>7.0f} | "
            f"{b['latency_ms']['p50']:>12.1f} | {errors}"
        )
    if table:
        print("\nratio to the floor (latency, CPU: x slower/costlier; throughput: x of the floor's)")
        print(f"{'system':<18} | {'p50 c=1':>8} {'p99 c=1':>8} {'dec/s c=8':>10} {'CPU/dec':>8} {'batch':>7}")
        for name, row in table.items():
            print(
                f"{name:<18} | {row['p50_c1']:>7.2f}x {row['p99_c1']:>7.2f}x {row['throughput_c8']:>9.2f}x "
                f"{row['cpu_per_decision']:>7.2f}x {row['batch']:>6.2f}x"
            )
        fleet_rows = {name: row for name, row in table.items() if "throughput_c8_fleet" in row}
        if fleet_rows:
            connections = f"each caller its own connection ({FLEET_CONNECTIONS})"
            print(f"\nc=8, {connections}; ratio to the floor's same phase")
            for name, row in fleet_rows.items():
                print(
                    f"{name:<18} | dec/s {row['throughput_c8_fleet']:>5.2f}x  "
                    f"CPU/dec {row['cpu_per_decision_fleet']:>5.2f}x"
                )
    paired = results.get(PAIRED_KEY, {})
    if "rounds" in paired:
        print(
            f"\n{PAIRED_TABULAR} against the floor in {len(paired['rounds'])} alternating rounds "
            "(ratio per round)"
        )
        for key in TABULAR_RATIOS:
            each = ", ".join(f"{r['ratios'][key]:.2f}" for r in paired["rounds"])
            print(f"  {key:<18} median {paired['ratios_median'][key]:.2f}x  ({each})")
    print("\nopen loop (offered/s -> answered/s, p50 / p99 ms, errors, fallbacks)")
    for name in GRPC_SYSTEMS:
        r = results.get(name)
        for point in (r or {}).get("open", []):
            print(
                f"  {name:<18} {point['offered_rate']:>6g}/s -> {point['decisions_per_s']:>7.1f}/s  "
                f"{point['latency_ms']['p50']:>8.2f} / {point['latency_ms']['p99']:>8.2f}  "
                f"{point['error_count']:>5}  {point['fallback_count']:>5}"
            )
    bare = results.get("vllm_bare")
    for name in PAIRED_SYSTEMS:
        card = results.get(name)
        if card and bare and "error" not in card and "error" not in bare:
            added = card["c1"]["latency_ms"]["p50"] - bare["single"]["p50"]
            print(
                f"\n{name} c=1 p50 {card['c1']['latency_ms']['p50']:.2f} ms - vLLM bare p50 "
                f"{bare['single']['p50']:.2f} ms = {added:.2f} ms around the LLM (measured minutes apart)"
            )
        paired = (card or {}).get("paired")
        if paired:
            each = ", ".join(f"+{r['added_ms']:.2f}" for r in paired["rounds"])
            print(
                f"{name} paired with the bare engine, {len(paired['rounds'])} alternating rounds: "
                f"median p50 {paired['card_fraud_p50_ms_median']:.2f} - {paired['bare_p50_ms_median']:.2f} "
                f"ms, median of the rounds' differences {paired['added_ms_median']:.2f} ms ({each}); against "
                f"the bare engine paced ({paired['paced_gap_ms']:g} ms idle before each prompt, p50 "
                f"{paired['bare_paced_p50_ms_median']:.2f} ms): {paired['added_vs_paced_ms_median']:.2f} ms"
            )
            served_each = ", ".join(f"+{r['added_vs_served_ms']:.2f}" for r in paired["rounds"])
            print(
                f"{name} against the same engine behind a hand-written gRPC server, same client, same rounds "
                f"(p50 {paired['bare_served_p50_ms_median']:.2f} ms): median of the rounds' differences "
                f"{paired['added_vs_served_ms_median']:.2f} ms ({served_each})"
            )


def _bars(axis: Any, names: Sequence[str], series: dict[str, list[float]], title: str, unit: str) -> None:
    """Grouped bars on a linear axis, each labelled with its value (systems differ by orders of magnitude:
    the labels keep the small ones readable without a log axis that would misstate the ratios)."""
    width = 0.8 / len(series)
    for k, (label, values) in enumerate(series.items()):
        offsets = [i - 0.4 + width * (k + 0.5) for i in range(len(names))]
        bars = axis.bar(offsets, values, width, label=label)
        axis.bar_label(bars, labels=[f"{v:.0f}" if v >= 100 else f"{v:.3g}" for v in values], fontsize=8)
    axis.set_xticks(list(range(len(names))), names, rotation=25, ha="right")  # long names: no overlap
    axis.set_title(title)
    axis.set_ylabel(unit)
    axis.grid(True, axis="y", alpha=0.3)
    if len(series) > 1:
        axis.legend()


def _load_lines(axis: Any, names: Sequence[str], results: dict[str, Any]) -> None:
    """p50 (solid) and p99 (dashed) latency against offered load, one colour per system, log-log."""
    for name in names:
        points = results[name].get("open", [])
        rates = [p["offered_rate"] for p in points]
        line = axis.plot(rates, [p["latency_ms"]["p50"] for p in points], marker="o", label=f"{name} p50")
        color = line[0].get_color()
        p99 = [p["latency_ms"]["p99"] for p in points]
        axis.plot(rates, p99, ls="--", marker="x", color=color, label=f"{name} p99")
    axis.set_title("open loop: latency from the intended send time")
    axis.set_xlabel("offered load (decisions/s)")
    axis.set_ylabel("latency (ms)")
    axis.set_xscale("log")
    axis.set_yscale("log")
    axis.grid(True, which="both", alpha=0.3)
    if names:
        axis.legend(fontsize=7)


def plot(out_dir: Path, results: dict[str, Any]) -> Path:
    """Four panels: c=1 p50/p99 bars, c=8 throughput, CPU per decision, latency against offered load."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n in GRPC_SYSTEMS if n in results and "error" not in results[n]]
    figure, axes = plt.subplots(2, 2, figsize=(12, 8.5))
    latency = {q: [results[n]["c1"]["latency_ms"][q] for n in names] for q in ("p50", "p99")}
    _bars(axes[0][0], names, latency, "Decide at concurrency 1", "latency (ms)")
    throughput = {"c=8": [results[n]["c8"]["decisions_per_s"] for n in names]}
    _bars(axes[0][1], names, throughput, "Decide at concurrency 8", "decisions per second")
    cpu = {"CPU": [results[n]["c8"]["server"]["cpu_ms_per_decision"] for n in names]}
    _bars(
        axes[1][0], names, cpu, "server CPU per decision (every server process, c=8)", "CPU ms per decision"
    )
    _load_lines(axes[1][1], names, results)
    figure.suptitle("riskserve against a hand-written grpc.aio floor (loopback)")
    return save_figure(figure, out_dir, "hotpath")


# -- main ----------------------------------------------------------------------------------------------


def measure_card_fraud(
    models: Path, plan: Plan, channels: int, run_dir: Path, name: str = "card_fraud"
) -> dict[str, Any]:
    """``card_fraud``'s rounds paired with the bare engine, then its phases. The bare engine starts
    first, so that its start-up is not in riskserve's window; the rounds come first, on a system as fresh
    as the c=1 phase's (after the same wait and warm-up), not after the batch and open-loop phases."""
    log(f"{name}: starting vLLM's bare engine for the paired rounds, in a plain loop and behind gRPC")
    bare = BareEngine(models, plan, run_dir)
    served: Running | None = None
    try:
        served = start_llm_floor(models, run_dir)
        log(f"{name}: the LLM's floor serves on {served.target} (up in {served.startup_s:.1f} s)")
        warm_up(served, plan, channels)
        with running(name, models, run_dir) as system:
            waited = settle(system)
            log(f"{name}: idle after {waited:.0f} s; warm-up, then {plan.paired_rounds} paired rounds")
            warm_up(system, plan, channels)
            paired = paired_card_fraud(system, bare, served, plan, channels)
            served.stop()  # nothing of the floors runs beside riskserve's own phases
            served = None
            bare.close()
            result = measure_grpc(system, plan, channels)
            result["paired"] = paired
    finally:
        if served is not None:
            served.stop()
        bare.close()
    return result


def run_systems(
    names: Sequence[str], models: Path, plan: Plan, channels: int, run_dir: Path
) -> dict[str, Any]:
    """Measure each system in turn; a system that fails is recorded with its error and the run goes on."""
    results: dict[str, Any] = {}
    for name in names:
        started = time.perf_counter()
        try:
            if name == "vllm_bare":
                results[name] = measure_vllm_bare(models, plan, run_dir)
            elif name in PAIRED_SYSTEMS and plan.paired_rounds:
                results[name] = measure_card_fraud(models, plan, channels, run_dir, name)
            elif name == "floor" and PAIRED_TABULAR in names and plan.tabular_rounds:
                with running(name, models, run_dir) as floor:
                    results[name] = measure_grpc(floor, plan, channels)
                    log(f"{name}: its own phases done in {time.perf_counter() - started:.0f} s")
                    paired_started = time.perf_counter()
                    try:
                        results[PAIRED_KEY] = measure_paired_tabular(floor, models, plan, channels, run_dir)
                    except (RuntimeError, subprocess.TimeoutExpired, OSError) as error:
                        log(f"{PAIRED_KEY}: FAILED: {error}")
                        results[PAIRED_KEY] = {"error": str(error)}
                    log(f"{PAIRED_KEY}: done in {time.perf_counter() - paired_started:.0f} s")
            else:
                with running(name, models, run_dir) as system:
                    results[name] = measure_grpc(system, plan, channels)
        except (RuntimeError, subprocess.TimeoutExpired, OSError) as error:
            log(f"{name}: FAILED: {error}")
            results[name] = {"error": str(error)}
        log(f"{name}: done in {time.perf_counter() - started:.0f} s")
    return results


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", type=Path, default=ROOT / "models", help="demo models (make models)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "out")
    parser.add_argument("--quick", action="store_true", help="tiny counts: a smoke run, not a measurement")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated subset of {SYSTEMS}")
    parser.add_argument(
        "--channels", type=int, default=None, help="gRPC channels per client (loadgen default)"
    )
    parser.add_argument("--child-vllm-bare", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--child-vllm-bare-rounds", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--vllm-prompts", type=int, default=FULL.vllm_prompts, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = sorted(set(args.systems) - set(SYSTEMS))
    if unknown:
        parser.error(f"unknown systems {unknown}; choose from {SYSTEMS}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    models = args.models.resolve()
    if args.child_vllm_bare is not None:
        vllm_bare_child(args.child_vllm_bare, models, args.vllm_prompts)
        return 0
    if args.child_vllm_bare_rounds:
        vllm_bare_rounds_child(models, args.vllm_prompts)
        return 0
    from bench.loadgen import DEFAULT_CHANNELS

    plan = QUICK if args.quick else FULL
    channels = args.channels or DEFAULT_CHANNELS
    args.out.mkdir(parents=True, exist_ok=True)
    run_dir = Path(tempfile.mkdtemp(prefix=".hotpath-", dir=args.out))
    os.environ["RISKSERVE_STATE_DIR"] = str(run_dir / "state")  # never a user's running riskserve
    load = os.getloadavg()
    log(f"systems {', '.join(args.systems)}; models {models}; load average {load[0]:.2f}; run dir {run_dir}")
    started = time.perf_counter()
    try:
        results = run_systems(args.systems, models, plan, channels, run_dir)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    table = ratios(results)
    print_report(results, table, plan)
    verdicts = targets(results, table)
    print_targets(verdicts)
    document = {
        "systems": results,
        "ratios_to_floor": table,
        "targets": verdicts,
        "settings": {"quick": args.quick, "plan": asdict(plan), "channels": channels, "models": str(models)},
        "machine": {"cpus": os.cpu_count(), "load_average_at_start": load},
        "seconds": time.perf_counter() - started,
    }
    bare = results.get("vllm_bare", {})
    for name in PAIRED_SYSTEMS:  # card_fraud_... keys, card_fraud_inline_... keys
        card = results.get(name, {})
        if "c1" in card and "single" in bare:
            added = card["c1"]["latency_ms"]["p50"] - bare["single"]["p50"]
            document[f"{name}_p50_minus_vllm_bare_ms"] = added
        if "paired" in card:
            document[f"{name}_paired_added_ms_median"] = card["paired"]["added_ms_median"]
            document[f"{name}_paired_added_vs_paced_ms_median"] = card["paired"]["added_vs_paced_ms_median"]
            document[f"{name}_paired_added_vs_served_ms_median"] = card["paired"]["added_vs_served_ms_median"]
    json_path = write_results(args.out, "hotpath", document)
    png = plot(args.out, results)
    print(f"\nresults: {json_path}\nplot:    {png}")
    return 1 if any("error" in r for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
