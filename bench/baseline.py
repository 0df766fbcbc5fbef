"""Today's figures of the old design (commit 3899600, before the rewrite), for the issue's ratios.

The old design serves ``Decide`` through Ray Serve's gRPC proxy, which hands each call to an ingress
deployment, which calls the feature stage and every model in deployments of their own (Serve handle hops).
This script checks that commit out as a git worktree (``git worktree add /tmp/rs-baseline 3899600``;
main's branch, index and files are untouched) and runs *its* ``riskserve up`` with ``PYTHONPATH`` set to the
worktree and the worktree as working directory, so the old package loads in the ``up`` process, in the
background process that owns Ray, and in every Ray worker (the venv's editable install points at
/work/main, but its import hook comes after ``PYTHONPATH``). Three checks that it is the old code: the
spawned interpreter's ``riskserve.__file__``; Ray Serve's gRPC proxy answering ``ListApplications`` on the
port (the new design has no proxy); ``PYTHONPATH`` in the ingress replica's environment.

For ``tabular_only`` and ``card_fraud`` (the worktree's YAML, rewritten into a temporary directory with
artifacts at absolute paths into ``--models`` and the feedback log in the temporary directory;
``RISKSERVE_STATE_DIR`` there too) it drives the server with ``bench/loadgen.py`` from /work/main (its own
process, one channel, metadata ``application=NAME``; card_fraud's requests carry text):

  * closed loop at concurrency 1: p50 / p99 over 200 calls, after 100 sequential warm-up calls;
  * closed loop at concurrency 8 for 20 s: decisions per second, p50 / p99, the CPU milliseconds per
    decision of every server process (``/proc``, the ``up`` process's tree), and model fallbacks per
    decision (the old design's models time out under this load and answer with their YAML fallback, which
    still counts as a decision).

With ``--designs old,new`` (the default) the current design (/work/main, no ``PYTHONPATH``) is measured the
same way in the same run, each pipeline old then new, so the ratios new / old are side by side. Progress
goes to stderr; vLLM's engine takes a minute or two to start on CPU, each ``up`` may take up to 10 min.
The worktree is removed at the end (``git worktree remove --force``).

Run: ``.venv/bin/python bench/baseline.py --models models`` (``--designs old`` for the old one only,
``--quick`` for a smoke run). Writes ``bench/out/baseline.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import write_local_pipeline, write_results
from bench._procs import TreeSample, cpu_delta, descendants, rss_bytes, sample_tree

ROOT = Path(__file__).resolve().parents[1]
BASELINE_COMMIT = "3899600"
WORKTREE = Path("/tmp/rs-baseline")
PIPELINES = ("tabular_only", "card_fraud")
TEXT_PIPELINES = ("card_fraud",)
DESIGNS = ("old", "new")
LOOPBACK_RAY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}
START_TIMEOUT_S = {"tabular_only": 300.0, "card_fraud": 600.0}


@dataclass(frozen=True)
class Plan:
    """How much each phase measures."""

    warmup_calls: int
    c1_calls: int
    c8_seconds: float


FULL = Plan(warmup_calls=100, c1_calls=200, c8_seconds=20.0)
QUICK = Plan(warmup_calls=10, c1_calls=20, c8_seconds=3.0)


@dataclass(frozen=True)
class Design:
    """Where a design's code lives and how its processes find it."""

    name: str
    root: Path
    env: dict[str, str]

    def riskserve_env(self, state_dir: Path) -> dict[str, str]:
        """The environment of ``riskserve up``/``down``: no inherited PYTHONPATH or Serve flags."""
        base = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith("RAY_SERVE_")}
        return {**base, **LOOPBACK_RAY_ENV, **self.env, "RISKSERVE_STATE_DIR": str(state_dir)}


@dataclass
class Running:
    """A started pipeline: where to call it and which process tree is the server."""

    design: str
    pipeline: str
    target: str
    root_pid: int
    startup_s: float
    checks: dict[str, Any]


def log(message: str) -> None:
    """One progress line on stderr."""
    print(f"[baseline {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# -- the worktree ------------------------------------------------------------------------------------------


@contextlib.contextmanager
def worktree(commit: str, path: Path) -> Iterator[Path]:
    """``git worktree add path commit`` for the block, ``git worktree remove --force`` after it."""
    if path.exists():
        head = subprocess.run(
            ["git", "-C", str(path), "rev-parse", "HEAD"], capture_output=True, text=True, check=False
        ).stdout.strip()
        wanted = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", commit], capture_output=True, text=True, check=True
        ).stdout.strip()
        if head != wanted:
            raise RuntimeError(f"{path} exists and is not a worktree at {commit}: remove it first")
        log(f"reusing the worktree {path} at {commit}")
    else:
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(path), commit],
            check=True,
            capture_output=True,
            text=True,
        )
        log(f"worktree {path} at {commit}")
    try:
        yield path
    finally:
        done = subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(path)],
            capture_output=True,
            text=True,
            check=False,
        )
        log(f"worktree removed ({done.returncode}){': ' + done.stderr.strip() if done.returncode else ''}")


def pipeline_copy(source: Path, models: Path, run_dir: Path, tag: str) -> Path:
    """``source`` with artifacts at absolute paths into ``models`` and the feedback log, learned versions and
    traces under ``run_dir``; written as ``run_dir/TAG-NAME.yaml``."""
    import yaml

    data = yaml.safe_load(source.read_text())
    return write_local_pipeline(data, models, run_dir, f"{tag}-{data['name']}")


# -- starting, checking, stopping -----------------------------------------------------------------------


def _riskserve(design: Design, state_dir: Path, *args: str, timeout_s: float) -> tuple[int, str]:
    """``riskserve ARGS`` of the venv, run with the design's code; (exit code, output). Past ``timeout_s``
    it is killed with every process below it (``up`` detaches its server; it is still a descendant)."""
    process = subprocess.Popen(
        [str(Path(sys.executable).parent / "riskserve"), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        env=design.riskserve_env(state_dir),
        cwd=design.root,  # `python -m` puts the working directory first on sys.path
    )
    try:
        output, _ = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        for pid in descendants(process.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        output, _ = process.communicate()
        return -9, f"timed out after {timeout_s:.0f} s\n{output}"
    return process.returncode, output


def imported_from(design: Design, state_dir: Path) -> str:
    """``riskserve.__file__`` in an interpreter started as ``riskserve up`` starts its server."""
    done = subprocess.run(
        [sys.executable, "-c", "import riskserve; print(riskserve.__file__)"],
        env=design.riskserve_env(state_dir),
        cwd=design.root,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return done.stdout.strip()


def serve_proxy_apps(target: str) -> list[str] | str:
    """Applications Ray Serve's gRPC proxy lists on ``target``, or the error (the new design has none)."""
    import grpc
    from ray.serve.generated import serve_pb2, serve_pb2_grpc

    with grpc.insecure_channel(target) as channel:
        stub = serve_pb2_grpc.RayServeAPIServiceStub(channel)  # type: ignore[no-untyped-call]
        try:
            request = serve_pb2.ListApplicationsRequest()  # type: ignore[attr-defined]
            response = stub.ListApplications(request, timeout=10)
        except grpc.RpcError as error:
            return f"{error.code().name}: {error.details()}"
    return list(response.application_names)


def replica_environment(root_pid: int, pipeline: str) -> dict[str, str]:
    """PYTHONPATH and working directory of the pipeline's ingress replica process (from ``/proc``)."""
    for pid in descendants(root_pid):
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if command.startswith("ray::ServeReplica") and pipeline in command and "ingress" in command.lower():
            try:
                raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                cwd = os.readlink(f"/proc/{pid}/cwd")
            except OSError:
                continue
            env = dict(item.decode(errors="replace").split("=", 1) for item in raw if b"=" in item)
            return {"process": command.strip(), "PYTHONPATH": env.get("PYTHONPATH", ""), "cwd": cwd}
    return {}


def start(design: Design, pipeline: str, models: Path, run_dir: Path) -> tuple[Running, Callable[[], None]]:
    """``riskserve up`` of one pipeline with the design's code; returns it once it serves, and its stop."""
    state_dir = run_dir / f"state-{design.name}"
    state_dir.mkdir(parents=True, exist_ok=True)
    where = imported_from(design, state_dir)
    expected = design.root / "riskserve" / "__init__.py"
    if Path(where) != expected:
        raise RuntimeError(f"{design.name}: riskserve loads from {where}, not {expected}")
    yaml_path = pipeline_copy(
        design.root / "deploy" / "pipelines" / f"{pipeline}.yaml", models, run_dir, design.name
    )
    port = _free_port()
    started = time.perf_counter()
    code, output = _riskserve(
        design, state_dir, "up", str(yaml_path), "--grpc-port", str(port), timeout_s=START_TIMEOUT_S[pipeline]
    )
    state_file = state_dir / "state.json"
    if code != 0 or not state_file.exists():
        if state_file.exists():
            _riskserve(design, state_dir, "down", timeout_s=180.0)
        raise RuntimeError(f"{design.name} riskserve up {pipeline} failed ({code}):\n{output[-4000:]}")
    startup_s = time.perf_counter() - started
    state = json.loads(state_file.read_text())
    endpoints = state.get("endpoints") or {}
    target = endpoints.get(pipeline) or f"127.0.0.1:{state['grpc_port']}"

    def stop() -> None:
        code, output = _riskserve(design, state_dir, "down", timeout_s=180.0)
        if code != 0:
            log(f"{design.name} {pipeline}: riskserve down failed ({code}), killing: {output[-300:]}")
            with contextlib.suppress(ProcessLookupError):
                os.killpg(int(state["pid"]), signal.SIGKILL)

    checks: dict[str, Any] = {
        "riskserve_file_in_spawned_interpreter": where,
        "serve_grpc_proxy_applications": serve_proxy_apps(target),
        "ingress_replica": replica_environment(int(state["pid"]), pipeline),
        "state_keys": sorted(state),
    }
    running = Running(design.name, pipeline, target, int(state["pid"]), startup_s, checks)
    try:
        verify(design, running)
    except RuntimeError:
        stop()
        raise
    return running, stop


def verify(design: Design, running: Running) -> None:
    """The old design answers through Serve's gRPC proxy with old code in its replicas; the new one has
    no proxy on its port."""
    apps = running.checks["serve_grpc_proxy_applications"]
    replica = running.checks["ingress_replica"]
    if design.name == "old":
        if not isinstance(apps, list) or running.pipeline not in apps:
            raise RuntimeError(f"old design: Serve's gRPC proxy does not list {running.pipeline}: {apps}")
        if replica and str(design.root) not in replica["PYTHONPATH"].split(os.pathsep):
            raise RuntimeError(f"old design: the ingress replica lacks PYTHONPATH={design.root}: {replica}")
    elif isinstance(apps, list):
        raise RuntimeError(f"new design: a Serve gRPC proxy answers on {running.target}: {apps}")


# -- measuring -----------------------------------------------------------------------------------------


def loadgen(
    running: Running, options: Sequence[str], bound_s: float, window: dict[str, Any]
) -> dict[str, Any]:
    """One ``bench/loadgen.py`` (from /work/main) against ``running``; the server tree's CPU sampled at
    its announced window's start and end into ``window``."""
    command = [sys.executable, str(ROOT / "bench" / "loadgen.py"), "--target", running.target]
    command += ["--pipeline", running.pipeline, "--mode", "closed", *options]
    if running.pipeline in TEXT_PIPELINES:
        command.append("--text")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT
    )
    watchdog = threading.Timer(bound_s, process.kill)
    watchdog.start()
    result: dict[str, Any] | None = None
    try:
        assert process.stdout is not None
        for line in process.stdout:
            document = json.loads(line)
            event = document.get("event")
            if event in ("start", "end"):
                window[event] = (sample_tree(running.root_pid), time.perf_counter())
            else:
                result = document
        stderr = process.stderr.read() if process.stderr is not None else ""
        process.wait()
    finally:
        watchdog.cancel()
    if process.returncode != 0 or result is None:
        raise RuntimeError(f"loadgen {' '.join(options)} failed ({process.returncode}):\n{stderr[-3000:]}")
    return result


def _server(window: dict[str, Any], decisions: int, root_pid: int) -> dict[str, float]:
    before: TreeSample = window["start"][0]
    after: TreeSample = window["end"][0]
    cpu_s, exited = cpu_delta(before, after)
    seconds = window["end"][1] - window["start"][1]
    return {
        "cpu_s": cpu_s,
        "window_s": seconds,
        "cores_busy": cpu_s / seconds if seconds > 0 else 0.0,
        "cpu_ms_per_decision": cpu_s * 1e3 / max(decisions, 1),
        "processes": len(after.cpu_s),
        "processes_exited_in_window": exited,
        "rss_mb": rss_bytes(root_pid) / 2**20,
    }


def _brief(result: dict[str, Any]) -> str:
    latency = result["latency_ms"]
    text = f"p50 {latency['p50']:.2f} ms, p99 {latency['p99']:.2f} ms, {result['decisions_per_s']:.1f} dec/s"
    if result["error_count"] or result["fallback_count"]:
        text += f", errors {result['errors']}, fallbacks {result['fallbacks']}"
    return text


def measure(running: Running, plan: Plan) -> dict[str, Any]:
    """Warm-up at c=1, then c=1 (p50/p99) and c=8 (throughput, server CPU).

    c=1 comes first and the warm-up is sequential: load that makes the old design's models time out
    opens their breakers, and c=1 would then time the fallbacks' answers.
    """
    tag = f"{running.design} {running.pipeline}"
    log(f"{tag}: warm-up ({plan.warmup_calls} calls at c=1)")
    loadgen(running, ["-c1", f"--calls={plan.warmup_calls}", "--seconds=120", "--warmup=0"], 300.0, {})
    out: dict[str, Any] = {"target": running.target, "startup_s": running.startup_s, "checks": running.checks}
    window: dict[str, Any] = {}
    options = ["-c1", f"--calls={plan.c1_calls}", "--seconds=120", "--warmup=20"]
    out["c1"] = loadgen(running, options, 300.0, window)
    log(f"{tag}: c=1 {_brief(out['c1'])}")
    window = {}
    options = ["-c8", "--calls=100000000", f"--seconds={plan.c8_seconds}", "--warmup=20"]
    out["c8"] = loadgen(running, options, 180.0 + plan.c8_seconds, window)
    out["c8"]["server"] = _server(window, out["c8"]["decisions"], running.root_pid)
    server = out["c8"]["server"]
    log(
        f"{tag}: c=8 {_brief(out['c8'])}; server {server['cpu_ms_per_decision']:.2f} CPU-ms/decision, "
        f"{server['cores_busy']:.2f} cores, {server['rss_mb']:.0f} MB"
    )
    return out


# -- report ---------------------------------------------------------------------------------------------


def figures(result: dict[str, Any]) -> dict[str, float]:
    """The headline numbers of one design and pipeline."""
    c1, c8 = result["c1"], result["c8"]
    return {
        "p50_c1_ms": c1["latency_ms"]["p50"],
        "p99_c1_ms": c1["latency_ms"]["p99"],
        "decisions_per_s_c8": c8["decisions_per_s"],
        "p50_c8_ms": c8["latency_ms"]["p50"],
        "p99_c8_ms": c8["latency_ms"]["p99"],
        "cpu_ms_per_decision_c8": c8["server"]["cpu_ms_per_decision"],
        "errors": c1["error_count"] + c8["error_count"],
        "fallbacks_c1": c1["fallback_count"],
        "fallbacks_per_decision_c8": c8["fallback_count"] / max(c8["decisions"], 1),
    }


def ratios(results: dict[str, dict[str, Any]]) -> dict[str, dict[str, float]]:
    """new / old per pipeline, when both were measured."""
    out = {}
    for pipeline in PIPELINES:
        old, new = results.get("old", {}).get(pipeline), results.get("new", {}).get(pipeline)
        if not old or not new or "error" in old or "error" in new:
            continue
        a, b = figures(old), figures(new)
        out[pipeline] = {
            key: b[key] / a[key]
            for key in a
            if key not in ("errors", "fallbacks_c1", "fallbacks_per_decision_c8") and a[key] > 0
        }
    return out


def print_report(results: dict[str, dict[str, Any]], table: dict[str, dict[str, float]]) -> None:
    """One line per design and pipeline, then the ratios new / old."""
    header = (
        f"{'design':<6} {'pipeline':<13} | {'c=1 p50':>8} {'p99':>8} | {'c=8 dec/s':>9} {'p50':>8} "
        f"{'p99':>8} | {'CPU-ms/dec':>10} | {'errors':>6} {'fb c=1':>6} {'fb/dec c=8':>10}"
    )
    print("\nDecide over gRPC on loopback (ms; bench/loadgen.py, one channel; fb: model fallbacks in the c=1")
    print("calls, and per decision at c=8 - a decision answered with a model's fallback counts in dec/s)")
    print(header)
    print("-" * len(header))
    for design, per_pipeline in results.items():
        for pipeline, result in per_pipeline.items():
            if "error" in result:
                print(f"{design:<6} {pipeline:<13} | failed: {result['error'].splitlines()[0][:80]}")
                continue
            f = figures(result)
            print(
                f"{design:<6} {pipeline:<13} | {f['p50_c1_ms']:>8.2f} {f['p99_c1_ms']:>8.2f} | "
                f"{f['decisions_per_s_c8']:>9.1f} {f['p50_c8_ms']:>8.2f} {f['p99_c8_ms']:>8.2f} | "
                f"{f['cpu_ms_per_decision_c8']:>10.2f} | {f['errors']:>6} {f['fallbacks_c1']:>6} "
                f"{f['fallbacks_per_decision_c8']:>10.2f}"
            )
    if table:
        print("\nnew / old (latency, CPU: < 1 is better; decisions/s: > 1 is better)")
        for pipeline, row in table.items():
            print(
                f"  {pipeline:<13} p50 c=1 {row['p50_c1_ms']:.3f}x, p99 c=1 {row['p99_c1_ms']:.3f}x, "
                f"dec/s c=8 {row['decisions_per_s_c8']:.2f}x, "
                f"CPU/decision {row['cpu_ms_per_decision_c8']:.3f}x"
            )


# -- main ----------------------------------------------------------------------------------------------


def run(designs: Sequence[Design], pipelines: Sequence[str], models: Path, plan: Plan, run_dir: Path) -> Any:
    """Each pipeline with each design in turn (old then new), one system up at a time."""
    results: dict[str, dict[str, Any]] = {d.name: {} for d in designs}
    for pipeline in pipelines:
        for design in designs:
            tag = f"{design.name} {pipeline}"
            started = time.perf_counter()
            log(f"{tag}: riskserve up (code from {design.root})")
            try:
                running, stop = start(design, pipeline, models, run_dir)
                log(f"{tag}: serving on {running.target} after {running.startup_s:.0f} s; {running.checks}")
                try:
                    results[design.name][pipeline] = measure(running, plan)
                finally:
                    log(f"{tag}: riskserve down")
                    stop()
            except (RuntimeError, subprocess.SubprocessError, OSError) as error:
                log(f"{tag}: FAILED: {error}")
                results[design.name][pipeline] = {"error": str(error)}
            log(f"{tag}: done in {time.perf_counter() - started:.0f} s")
    return results


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", type=Path, default=ROOT / "models", help="demo models (make models)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "out")
    parser.add_argument("--designs", default=",".join(DESIGNS), help=f"comma-separated subset of {DESIGNS}")
    parser.add_argument("--pipelines", default=",".join(PIPELINES), help=f"subset of {PIPELINES}")
    parser.add_argument("--commit", default=BASELINE_COMMIT, help="the old design's commit")
    parser.add_argument("--quick", action="store_true", help="tiny counts: a smoke run, not a measurement")
    args = parser.parse_args(argv)
    args.designs = [d for d in args.designs.split(",") if d]
    args.pipelines = [p for p in args.pipelines.split(",") if p]
    if set(args.designs) - set(DESIGNS) or set(args.pipelines) - set(PIPELINES):
        parser.error(f"designs from {DESIGNS}, pipelines from {PIPELINES}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    plan = QUICK if args.quick else FULL
    models = args.models.resolve()
    load = os.getloadavg()
    log(f"designs {args.designs}, pipelines {args.pipelines}, models {models}; load average {load[0]:.2f}")
    started = time.perf_counter()
    with (
        tempfile.TemporaryDirectory(prefix="rs-baseline-run-") as tmp,
        worktree(args.commit, WORKTREE) as tree,
    ):
        available = {
            "old": Design("old", tree, {"PYTHONPATH": str(tree)}),
            "new": Design("new", ROOT, {}),
        }
        designs = [available[name] for name in DESIGNS if name in args.designs]
        results = run(designs, args.pipelines, models, plan, Path(tmp))
    table = ratios(results)
    print_report(results, table)
    document = {
        "old_design": {"commit": args.commit, "results": results.get("old", {})},
        "new_design": {"results": results.get("new", {})} if "new" in results else None,
        "figures": {
            design: {p: figures(r) for p, r in per.items() if "error" not in r}
            for design, per in results.items()
        },
        "ratios_new_over_old": table,
        "plan": asdict(plan),
        "machine": {"cpus": os.cpu_count(), "load_average_at_start": load},
        "seconds": time.perf_counter() - started,
    }
    path = write_results(args.out, "baseline", document)
    print(f"\nresults: {path}")
    return 1 if any("error" in r for per in results.values() for r in per.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
