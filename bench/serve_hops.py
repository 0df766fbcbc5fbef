"""One Ray Serve handle hop, deployment to deployment, under each of Serve's throughput settings.

What riskserve's ingress does to reach a model in its own deployment (the LLM): an async replica awaits
``handle.method.remote(payload)`` on its own event loop (where its grpc.aio front door runs). Here a
``Caller`` deployment drives that from a local asyncio loop of calls to a trivial async ``Callee``
(``return 1``), and measures in the caller:

  * concurrency 1: p50 / p99 of one awaited handle call, a list of one string and a 1x22 float32 numpy
    matrix alternating call by call (does the matrix cost more than the text?);
  * concurrency 8: calls per second of 8 tasks calling back to back (windows of each payload), and the CPU
    milliseconds per call of every process of that Ray (``/proc``: controller, GCS, raylet, replicas).

Settings compared: ``RAY_SERVE_THROUGHPUT_OPTIMIZED=1``, and each flag that bundle sets on its own. The
bundle is read from Ray's own source (``ray/serve/_private/constants.py``, the ``if RAY_SERVE_THROUGHPUT_
OPTIMIZED:`` block), so the names are Ray's; a flag whose bundled value is already the default (a no-op
alone) is measured switched the other way instead; the bundle's two threading flags are also measured
together. Each setting runs in a fresh subprocess owning its own Ray, its environment set before Ray is
imported (the replicas inherit it from the raylet); each child reports the values its caller replica
actually sees, so a flag that did not reach the replica shows.

Side by side: one Ray with Serve's defaults runs for the whole benchmark, and each setting's Ray is started
beside it and measured in alternation with it (ABBA blocks of c=1 calls, then of c=8 windows), so the
ratio to the default is taken over the same minutes of a shared, noisy machine. The last setting is a
second default Ray against the first: its ratios are the noise floor of the method.

Run: ``.venv/bin/python bench/serve_hops.py`` (about a minute per setting, 10 settings; ``--quick`` for a
smoke run; ``--settings RAY_SERVE_THROUGHPUT_OPTIMIZED,control`` for a subset). Writes
``bench/out/serve_hops.json`` and ``bench/out/serve_hops.png``.
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import contextlib
import json
import os
import queue
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import write_results

ROOT = Path(__file__).resolve().parents[1]
LOOPBACK_RAY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}
BUNDLE = "RAY_SERVE_THROUGHPUT_OPTIMIZED"
CHILD_START_S = 300.0
TEXT = "hi, my card was declined twice at the fuel station, can you unblock it now please?"
COLUMNS = 22
THREAD_FLAGS = ("RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD", "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP")


@dataclass(frozen=True)
class Plan:
    """How much each pair of Rays is measured."""

    blocks: int
    """Alternations of the two Rays (ABBA...), for c=1 and again for c=8."""
    c1_calls: int
    """Calls of each payload per c=1 block (the payloads alternate call by call)."""
    c8_seconds: float
    """Length of each c=8 window (one per payload per block)."""
    warmup: int
    """Untimed calls of each payload on each Ray first."""


FULL = Plan(blocks=4, c1_calls=150, c8_seconds=1.0, warmup=100)
QUICK = Plan(blocks=2, c1_calls=30, c8_seconds=0.5, warmup=10)
NOTE_DEFAULT = "the Ray every setting was measured beside: medians over all pairs"
CONTROL = "default beside default (control)"


@dataclass(frozen=True)
class Setting:
    """One configuration: a label and the environment variables it sets."""

    name: str
    env: dict[str, str]
    note: str = ""


@dataclass
class Outcome:
    """What one pair measured ("reference" and "setting" sides, the setting's startup and flags), or why
    it failed."""

    setting: Setting
    result: dict[str, Any] = field(default_factory=dict)
    error: str = ""


def log(message: str) -> None:
    """One progress line on stderr."""
    print(f"[serve_hops {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# -- the settings, from Ray's source ---------------------------------------------------------------------


def _constants_path() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("ray")
    assert spec is not None
    assert spec.origin is not None
    return Path(spec.origin).parent / "serve" / "_private" / "constants.py"


def bundled_flags(path: Path | None = None) -> dict[str, str]:
    """The environment variables ``RAY_SERVE_THROUGHPUT_OPTIMIZED=1`` sets and to what, from Ray's source.

    Each assignment in the ``if RAY_SERVE_THROUGHPUT_OPTIMIZED:`` block reads ``get_env_*("NAME", default)``:
    that default is the bundle's value.
    """
    tree = ast.parse((path or _constants_path()).read_text())
    for node in tree.body:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == BUNDLE:
            flags: dict[str, str] = {}
            for statement in node.body:
                if not (isinstance(statement, ast.Assign) and isinstance(statement.value, ast.Call)):
                    continue
                args = statement.value.args
                if len(args) >= 2 and all(isinstance(a, ast.Constant) for a in args[:2]):
                    name, value = (a.value for a in args[:2])  # type: ignore[attr-defined]
                    flags[str(name)] = str(value)
            return flags
    raise RuntimeError(f"no 'if {BUNDLE}:' block in {path or _constants_path()}")


def effective_values(names: Sequence[str], env: dict[str, str]) -> dict[str, Any]:
    """Serve's constants as a process with ``env`` (and no other ``RAY_SERVE_*``) sees them."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("RAY_SERVE_")}
    code = (
        "import json, sys; from ray.serve._private import constants as c; "
        "print(json.dumps({n: getattr(c, n) for n in sys.argv[1:]}))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, *names],
        env={**clean, **LOOPBACK_RAY_ENV, **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    values: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return values


def _as_env(value: Any) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    return str(value)


def settings_to_compare() -> tuple[list[Setting], dict[str, str], dict[str, Any]]:
    """The bundle, each bundled flag alone (the other way round when the bundle keeps the default), its two
    threading flags together, a second default (the control); plus the bundle's flags and Serve's
    defaults for them."""
    flags = bundled_flags()
    defaults = effective_values(list(flags), {})
    bundled = effective_values(list(flags), {BUNDLE: "1"})
    out = [Setting(f"{BUNDLE}=1", {BUNDLE: "1"})]
    for name, value in flags.items():
        if _as_env(defaults[name]) == _as_env(bundled[name]):
            other = "0" if _as_env(defaults[name]) != "0" else "1"
            note = f"the bundle keeps the default ({_as_env(defaults[name])}): measured switched to {other}"
            out.append(Setting(f"{name}={other}", {name: other}, note))
        else:
            out.append(Setting(f"{name}={value}", {name: value}))
    threads = {n: flags[n] for n in THREAD_FLAGS if n in flags}
    if len(threads) == len(THREAD_FLAGS):
        note = "both threading flags of the bundle together, nothing else"
        out.append(Setting(" + ".join(f"{n}={v}" for n, v in threads.items()), threads, note))
    out.append(Setting(CONTROL, {}, "a second Ray with the defaults: the method's noise floor"))
    return out, flags, defaults


# -- the child: one Ray, two deployments, measuring on command ---------------------------------------------

MARK = "@@serve_hops "
"""Prefix of the child's answer lines on stdout (anything else there is Ray's or Serve's chatter)."""


def child(flag_names: Sequence[str]) -> None:
    """In a fresh process (environment already set): start Ray and Serve, deploy, then measure on command.

    Reads one JSON command per stdin line (``c1``, ``c8``, ``quit``) and answers each with one ``MARK`` line.
    """
    import ray
    from ray import serve
    from ray.serve.handle import DeploymentHandle

    @serve.deployment(max_ongoing_requests=64, ray_actor_options={"num_cpus": 0.25})
    class Callee:
        async def echo(self, payload: Any) -> int:
            return 1

    @serve.deployment(max_ongoing_requests=64, ray_actor_options={"num_cpus": 0.25})
    class Caller:
        def __init__(self, callee: DeploymentHandle[Any]) -> None:
            import numpy as np

            self._callee = callee
            rng = np.random.default_rng(0)
            self._payloads: dict[str, Any] = {
                "text": [TEXT],
                "matrix": rng.random((1, COLUMNS), dtype=np.float32),
            }

        async def seen(self, names: list[str]) -> dict[str, Any]:
            """The flags as this replica sees them, and where its user code runs."""
            import threading

            from ray.serve._private import constants

            return {
                "constants": {n: getattr(constants, n, None) for n in names},
                "user_code_thread": threading.current_thread().name,
            }

        async def one_by_one(self, calls: int, warmup: int) -> dict[str, list[float]]:
            """Awaited calls one at a time, payloads alternating call by call; seconds per call."""
            samples: dict[str, list[float]] = {kind: [] for kind in self._payloads}
            for i in range(warmup + calls):
                for kind, payload in self._payloads.items():
                    started = time.perf_counter()
                    await self._callee.echo.remote(payload)
                    if i >= warmup:
                        samples[kind].append(time.perf_counter() - started)
            return samples

        async def concurrent(self, kind: str, concurrency: int, seconds: float) -> dict[str, Any]:
            """``concurrency`` tasks calling back to back for ``seconds``: calls done, latencies."""
            payload = self._payloads[kind]
            latencies: list[float] = []
            deadline = time.perf_counter() + seconds

            async def lane() -> None:
                while time.perf_counter() < deadline:
                    started = time.perf_counter()
                    await self._callee.echo.remote(payload)
                    latencies.append(time.perf_counter() - started)

            started = time.perf_counter()
            await asyncio.gather(*(lane() for _ in range(concurrency)))
            return {"calls": len(latencies), "seconds": time.perf_counter() - started, "latencies": latencies}

    started = time.perf_counter()
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            http_port = int(sock.getsockname()[1])
        serve.start(proxy_location="Disabled", http_options={"host": "127.0.0.1", "port": http_port})
        app = Caller.bind(Callee.bind())  # type: ignore[attr-defined]
        handle = serve.run(app, name="hops", route_prefix=None)
        # The driver awaits its calls on an asyncio loop of its own: with
        # RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP=0 a handle must first be used inside a running loop.
        asyncio.run(_serve_commands(handle, flag_names, time.perf_counter() - started))
    finally:
        ray.shutdown()


def _answer(document: dict[str, Any]) -> None:
    print(MARK + json.dumps(document), flush=True)


async def _serve_commands(handle: Any, flag_names: Sequence[str], startup_s: float) -> None:
    """Announce readiness, then run each command from stdin as one call to the caller replica (which
    times its own calls to the callee); the CPU of this Ray's whole process tree is sampled around c=8."""
    from bench._procs import cpu_delta, sample_tree

    loop = asyncio.get_running_loop()
    _answer({"ready": True, "startup_s": startup_s, "seen": await handle.seen.remote(list(flag_names))})
    while True:
        line = await loop.run_in_executor(None, sys.stdin.readline)
        command = json.loads(line) if line.strip() else {"op": "quit"}
        if command["op"] == "quit":
            return
        if command["op"] == "c1":
            _answer(await handle.one_by_one.remote(command["calls"], command["warmup"]))
        elif command["op"] == "c8":
            before = sample_tree(os.getpid())
            window = await handle.concurrent.remote(command["kind"], 8, command["seconds"])
            window["cpu_s"], _ = cpu_delta(before, sample_tree(os.getpid()))
            _answer(window)


# -- the parent: a default Ray beside each setting's, measured in alternation ----------------------------


def _kill_tree(pid: int) -> None:
    from bench._procs import descendants

    for member in reversed(descendants(pid)):
        with contextlib.suppress(ProcessLookupError):
            os.kill(member, signal.SIGKILL)


class Cluster:
    """A child process owning one Ray with ``setting``'s environment, measured on command."""

    def __init__(self, setting: Setting, flag_names: Sequence[str], log_path: Path) -> None:
        self.setting = setting
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_SERVE_")}
        env |= {**LOOPBACK_RAY_ENV, **setting.env}
        command = [sys.executable, __file__, "--child", "--flags", ",".join(flag_names)]
        self.log_path = log_path
        with log_path.open("w") as stderr:
            self._process = subprocess.Popen(
                command,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=stderr,
                text=True,
                env=env,
                cwd=ROOT,
                start_new_session=True,
            )
        self._answers: queue.Queue[dict[str, Any] | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        ready = self._next(CHILD_START_S)
        self.startup_s: float = ready["startup_s"]
        self.seen: dict[str, Any] = ready["seen"]

    def _read(self) -> None:
        assert self._process.stdout is not None
        for line in self._process.stdout:
            if line.startswith(MARK):
                self._answers.put(json.loads(line[len(MARK) :]))
        self._answers.put(None)  # the child exited

    def _next(self, timeout_s: float) -> dict[str, Any]:
        try:
            answer = self._answers.get(timeout=timeout_s)
        except queue.Empty:
            answer = None
        if answer is None:
            self.close()
            tail = self.log_path.read_text(errors="replace")[-2500:]
            raise RuntimeError(f"{self.setting.name}: the child died or stalled:\n{tail}")
        return answer

    def ask(self, command: dict[str, Any], timeout_s: float = 240.0) -> dict[str, Any]:
        """Send one command and wait for its answer."""
        assert self._process.stdin is not None
        self._process.stdin.write(json.dumps(command) + "\n")
        self._process.stdin.flush()
        return self._next(timeout_s)

    def one_by_one(self, calls: int, warmup: int) -> dict[str, list[float]]:
        return self.ask({"op": "c1", "calls": calls, "warmup": warmup})

    def concurrent(self, kind: str, seconds: float) -> dict[str, Any]:
        return self.ask({"op": "c8", "kind": kind, "seconds": seconds})

    def close(self) -> None:
        """Ask the child to stop its Ray; kill its process tree if it has not within a minute."""
        if self._process.poll() is None:
            with contextlib.suppress(OSError, ValueError):
                assert self._process.stdin is not None
                self._process.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self._process.stdin.close()
            try:
                self._process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                _kill_tree(self._process.pid)
                self._process.wait()


def compare(reference: Cluster, other: Cluster, plan: Plan) -> dict[str, dict[str, Any]]:
    """Both clusters measured in alternation (ABBA blocks): c=1 calls, then c=8 windows of both payloads.

    Returns each side's figures ("reference", "setting") over all its blocks, and its p50 per block.
    """
    sides = {"reference": reference, "setting": other}
    c1: dict[str, dict[str, list[float]]] = {side: {"text": [], "matrix": []} for side in sides}
    c1_blocks: dict[str, list[float]] = {side: [] for side in sides}
    c8: dict[str, dict[str, list[dict[str, Any]]]] = {side: {"text": [], "matrix": []} for side in sides}
    for cluster in sides.values():  # warm-up: both clusters' first calls are slower
        cluster.one_by_one(0, plan.warmup)
        cluster.concurrent("text", 1.0)
    for block in range(plan.blocks):
        for side in ("reference", "setting") if block % 2 == 0 else ("setting", "reference"):
            samples = sides[side].one_by_one(plan.c1_calls, 5)
            for kind, values in samples.items():
                c1[side][kind].extend(values)
            c1_blocks[side].append(statistics.median(samples["text"]) * 1e3)
    for block in range(plan.blocks):
        for side in ("reference", "setting") if block % 2 == 0 else ("setting", "reference"):
            for kind in ("text", "matrix"):
                c8[side][kind].append(sides[side].concurrent(kind, plan.c8_seconds))
    return {
        side: {
            "c1": {kind: _latency(values) for kind, values in c1[side].items()},
            "c8": {kind: _throughput(windows) for kind, windows in c8[side].items()},
            "p50_ms_by_block": c1_blocks[side],
        }
        for side in sides
    }


def _latency(samples: Sequence[float]) -> dict[str, float]:
    ordered = sorted(samples)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return {"p50_ms": statistics.median(ordered) * 1e3, "p99_ms": p99 * 1e3, "n": len(ordered)}


def _throughput(windows: Sequence[dict[str, Any]]) -> dict[str, float]:
    calls = sum(w["calls"] for w in windows)
    seconds = sum(w["seconds"] for w in windows)
    cpu_s = sum(w["cpu_s"] for w in windows)
    latencies = [x for w in windows for x in w["latencies"]]
    return {
        "calls_per_s": calls / seconds,
        "calls": calls,
        "p50_ms": statistics.median(latencies) * 1e3,
        "cpu_ms_per_call": cpu_s * 1e3 / max(calls, 1),
        "cores_busy": cpu_s / seconds,
    }


def _figures(side: dict[str, Any]) -> dict[str, Any]:
    c1, c8 = side["c1"]["text"], side["c8"]["text"]
    return {
        "p50_ms": c1["p50_ms"],
        "p99_ms": c1["p99_ms"],
        "calls_per_s_c8": c8["calls_per_s"],
        "p50_ms_c8": c8["p50_ms"],
        "cpu_ms_per_call_c8": c8["cpu_ms_per_call"],
        "matrix_p50_ms": side["c1"]["matrix"]["p50_ms"],
        "matrix_p99_ms": side["c1"]["matrix"]["p99_ms"],
        "matrix_calls_per_s_c8": side["c8"]["matrix"]["calls_per_s"],
        "matrix_over_text_p50": side["c1"]["matrix"]["p50_ms"] / c1["p50_ms"],
        "matrix_over_text_calls_per_s": side["c8"]["matrix"]["calls_per_s"] / c8["calls_per_s"],
        "p50_ms_by_block": side["p50_ms_by_block"],
    }


def table(outcomes: Sequence[Outcome]) -> list[dict[str, Any]]:
    """One row per setting: its figures, and its ratios to the default Ray measured beside it.

    The first row is the default itself: its figures are the medians over every pair it was part of.
    """
    rows: list[dict[str, Any]] = []
    references = [_figures(o.result["reference"]) for o in outcomes if not o.error]
    if references:
        default: dict[str, Any] = {"setting": "default", "env": {}, "note": NOTE_DEFAULT}
        for key, value in references[0].items():
            if isinstance(value, float):
                default[key] = statistics.median(r[key] for r in references)
        default["p50_ms_by_block"] = [r["p50_ms"] for r in references]
        default["ratio_to_default"] = dict.fromkeys(
            ("p50", "p99", "calls_per_s_c8", "cpu_ms_per_call_c8"), 1.0
        )
        rows.append(default)
    for outcome in outcomes:
        row: dict[str, Any] = {"setting": outcome.setting.name, "env": outcome.setting.env}
        if outcome.setting.note:
            row["note"] = outcome.setting.note
        if outcome.error:
            rows.append(row | {"error": outcome.error})
            continue
        mine, ref = _figures(outcome.result["setting"]), _figures(outcome.result["reference"])
        row |= mine
        row["default_beside"] = {
            k: ref[k] for k in ("p50_ms", "p99_ms", "calls_per_s_c8", "cpu_ms_per_call_c8")
        }
        row["ratio_to_default"] = {
            "p50": mine["p50_ms"] / ref["p50_ms"],
            "p99": mine["p99_ms"] / ref["p99_ms"],
            "calls_per_s_c8": mine["calls_per_s_c8"] / ref["calls_per_s_c8"],
            "cpu_ms_per_call_c8": mine["cpu_ms_per_call_c8"] / ref["cpu_ms_per_call_c8"],
        }
        row["seen_in_replica"] = outcome.result["seen"]
        row["startup_s"] = outcome.result["startup_s"]
        rows.append(row)
    return rows


def print_table(rows: Sequence[dict[str, Any]]) -> None:
    """The summary: text payload at c=1 and c=8, ratios to the default Ray beside, the matrix's p50."""
    width = max([len("setting"), *(len(r["setting"]) for r in rows)])
    header = (
        f"{'setting':<{width}} | {'p50 ms':>7} {'p99 ms':>7} | {'calls/s c=8':>11} {'CPU ms/call':>11} | "
        f"{'x p50':>6} {'x p99':>6} {'x calls/s':>9} {'x CPU':>6} | {'matrix p50':>10} {'mat/text':>8} | "
        f"{'p50 per block (ms)':<24}"
    )
    print(
        "\none Serve handle hop, caller deployment -> trivial async deployment (a list of 1 string); "
        "ratios to the default Ray measured beside each setting"
    )
    print(header)
    print("-" * len(header))
    for row in rows:
        if "error" in row:
            print(f"{row['setting']:<{width}} | failed: {row['error'].splitlines()[0][:80]}")
            continue
        ratio = row.get("ratio_to_default", {})
        print(
            f"{row['setting']:<{width}} | {row['p50_ms']:>7.3f} {row['p99_ms']:>7.3f} | "
            f"{row['calls_per_s_c8']:>11.0f} {row['cpu_ms_per_call_c8']:>11.3f} | "
            f"{ratio.get('p50', 0):>5.2f}x {ratio.get('p99', 0):>5.2f}x "
            f"{ratio.get('calls_per_s_c8', 0):>8.2f}x "
            f"{ratio.get('cpu_ms_per_call_c8', 0):>5.2f}x | {row['matrix_p50_ms']:>10.3f} "
            f"{row['matrix_over_text_p50']:>7.2f}x | "
            f"{' '.join(f'{v:.2f}' for v in row['p50_ms_by_block'])}"
        )
    for row in rows:
        if "note" in row:
            print(f"  {row['setting']}: {row['note']}")
    print(
        "ratios: x p50/p99/CPU > 1 is worse, x calls/s > 1 is better, each over the default Ray measured in"
        " alternation with it;\nCPU = every process of that Ray (controller, GCS, raylet, both replicas, the"
        " driver); the default row's p50 per block is its p50 in each pair"
    )


def plot(out_dir: Path, rows: Sequence[dict[str, Any]]) -> Path:
    """Per setting, two bars: the setting and the default Ray measured beside it (p50 at c=1, calls/s at
    c=8, CPU per call), the ratio written above the pair."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    good = [r for r in rows if "error" not in r and "default_beside" in r]
    names = [r["setting"].replace("RAY_SERVE_", "").replace(" + ", " +\n") for r in good]
    figure, axes = plt.subplots(3, 1, figsize=(13, 12), sharex=True)
    positions = list(range(len(good)))
    panels = [
        (axes[0], "p50_ms", "p50", "ms", "one awaited handle call at concurrency 1: p50 (list of 1 string)"),
        (axes[1], "calls_per_s_c8", "calls_per_s_c8", "calls/s", "calls per second at concurrency 8"),
        (axes[2], "cpu_ms_per_call_c8", "cpu_ms_per_call_c8", "CPU ms per call", "CPU of the whole Ray, c=8"),
    ]
    for axis, key, ratio_key, unit, title in panels:
        mine = [r[key] for r in good]
        beside = [r["default_beside"][key] for r in good]
        axis.bar([x - 0.2 for x in positions], beside, 0.4, label="default Ray beside it", color="#bbbbbb")
        bars = axis.bar([x + 0.2 for x in positions], mine, 0.4, label="setting", color="#1f77b4")
        axis.bar_label(bars, labels=[f"{r['ratio_to_default'][ratio_key]:.2f}x" for r in good], fontsize=8)
        axis.set_ylabel(unit)
        axis.set_title(title)
        axis.grid(True, axis="y", alpha=0.3)
        axis.legend(fontsize=8)
    axes[-1].set_xticks(positions, names, fontsize=7, rotation=30, ha="right")
    figure.suptitle("Ray Serve handle hop between deployments: each setting beside the default")
    figure.tight_layout()
    path = out_dir / "serve_hops.png"
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def _keys(setting: Setting) -> set[str]:
    """Names ``--settings`` knows a setting by: its label, its flag's name, 'threads', 'control'."""
    if " + " in setting.name:
        return {setting.name, "threads"}
    if setting.name == CONTROL:
        return {setting.name, "control"}
    return {setting.name, setting.name.split("=")[0]}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "out")
    parser.add_argument("--quick", action="store_true", help="tiny counts: a smoke run, not a measurement")
    parser.add_argument(
        "--settings",
        default="",
        help="comma-separated subset: flag names, 'threads' (both threading flags), 'control'",
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--flags", default="", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def run_pairs(settings: Sequence[Setting], plan: Plan, flag_names: Sequence[str], tmp: Path) -> list[Outcome]:
    """The default Ray up for the whole run; each setting's Ray beside it in turn, compared, stopped."""
    log("default: starting the reference Ray")
    reference = Cluster(Setting("default", {}), flag_names, tmp / "default.log")
    log(f"default: up after {reference.startup_s:.0f} s; replica sees {reference.seen['constants']}")
    outcomes = []
    try:
        for k, setting in enumerate(settings):
            log(f"{setting.name}: starting ({setting.env or 'no flag'})")
            try:
                other = Cluster(setting, flag_names, tmp / f"setting-{k}.log")
                try:
                    seen = other.seen["constants"]
                    log(f"{setting.name}: up after {other.startup_s:.0f} s; replica sees {seen}")
                    pair = compare(reference, other, plan)
                finally:
                    other.close()
            except RuntimeError as error:
                log(f"{setting.name}: FAILED {str(error)[-600:]}")
                outcomes.append(Outcome(setting, error=str(error)))
                continue
            result = {**pair, "seen": other.seen, "startup_s": other.startup_s}
            outcomes.append(Outcome(setting, result=result))
            mine, ref = _figures(pair["setting"]), _figures(pair["reference"])
            log(
                f"{setting.name}: p50 {mine['p50_ms']:.3f} ms (default beside {ref['p50_ms']:.3f}), "
                f"{mine['calls_per_s_c8']:.0f} calls/s at c=8 (default beside {ref['calls_per_s_c8']:.0f})"
            )
    finally:
        reference.close()
    return outcomes


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    plan = QUICK if args.quick else FULL
    if args.child:
        child([f for f in args.flags.split(",") if f])
        return 0
    settings, flags, defaults = settings_to_compare()
    log(f"{BUNDLE}=1 sets {flags}; Serve's defaults for them: {defaults}")
    if args.settings:
        wanted = {s.strip() for s in args.settings.split(",") if s.strip()}
        settings = [s for s in settings if _keys(s) & wanted]
    load = os.getloadavg()
    log(f"{len(settings)} settings, each in a fresh Ray beside the default one; load average {load[0]:.2f}")
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="serve-hops-") as tmp:
        outcomes = run_pairs(settings, plan, list(flags), Path(tmp))
    rows = table(outcomes)
    print_table(rows)
    document = {
        "bundle": {"flag": BUNDLE, "sets": flags, "serve_defaults": defaults},
        "rows": rows,
        "pairs": [{"setting": asdict(o.setting), "result": o.result, "error": o.error} for o in outcomes],
        "plan": asdict(plan),
        "machine": {
            "cpus": os.cpu_count(),
            "load_average_at_start": load,
            "load_average_at_end": os.getloadavg(),
        },
        "seconds": time.perf_counter() - started,
    }
    json_path = write_results(args.out, "serve_hops", document)
    png = plot(args.out, rows)
    print(f"\nresults: {json_path}\nplot:    {png}")
    return 1 if any(o.error for o in outcomes) else 0


if __name__ == "__main__":
    sys.exit(main())
