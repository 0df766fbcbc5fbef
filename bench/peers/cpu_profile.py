"""Where each system of the peer benchmark spends its CPU: py-spy on its whole process tree under c=8 load.

For each system (``--workload``, ``--systems``, as ``bench/peers/run.py``): start it as the benchmark does,
let it go idle, warm it up, then drive it with ``bench/loadgen.py`` at concurrency 8 while py-spy samples
every Python process of its tree (``--subprocesses``, ``--nonblocking``: the servers are not paused) for
``--seconds``, twice: once as a flame graph (``OUT/WORKLOAD-SYSTEM.svg``) and once as collapsed stacks,
which are summarised in ``OUT/WORKLOAD-SYSTEM.txt`` and ``OUT/summary.json``: the share of samples by
process, by the package of the innermost frame (where the time is spent itself), and the top functions
by self and by inclusive share, beside the cores each process kept busy (from ``/proc``). Ray systems
(riskserve, plain Ray Serve) are sampled actor by actor (``OUT/WORKLOAD-SYSTEM-ROLE.svg``): under a
raylet, ``--subprocesses`` caught only a few samples of riskserve's LLM replica. py-spy counts only
threads that are running (not idle ones), so the shares are of busy CPU; time in native code shows as
the Python frame that called it.

Run (heavy: through ``/work/heavy``): ``PYTHONPATH=. .venv/bin/python bench/peers/cpu_profile.py --workload
tabular_only --systems floor,riskserve``. Needs ``py-spy`` in the venv (``.venv/bin/pip install py-spy``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench._procs import TreeSample, descendants, sample_tree
from bench.hotpath import Running, loadgen, log, settle

ROOT = Path(__file__).resolve().parents[2]
RATE_HZ = 100
_FRAME = re.compile(r"^(?P<function>.*) \((?P<file>[^()]*?):?(?P<line>\d*)\)$")


def py_spy() -> str:
    """The py-spy executable beside this interpreter, else on PATH."""
    beside = Path(sys.executable).parent / "py-spy"
    found = str(beside) if beside.exists() else shutil.which("py-spy")
    if not found:
        raise RuntimeError("py-spy is not installed: .venv/bin/pip install py-spy")
    return found


def record(pid: int, seconds: float, out: Path, fmt: str, children: bool = True) -> None:
    """``py-spy record`` of ``pid`` and its subprocesses for ``seconds`` into ``out`` (flamegraph or raw)."""
    command = [py_spy(), "record", "--nonblocking", *(["--subprocesses"] if children else []), "-p", str(pid)]
    command += ["-r", str(RATE_HZ), "-d", str(int(seconds)), "-o", str(out), "--format", fmt]
    done = subprocess.run(command, capture_output=True, text=True, timeout=seconds + 60)
    if done.returncode != 0 or not out.exists():
        raise RuntimeError(f"py-spy failed ({done.returncode}): {done.stderr[-2000:]}")


def ray_actors(root: int) -> dict[str, int]:
    """Role -> pid of the Ray actors in ``root``'s tree (Serve's replicas, proxy and controller): sampled one
    by one, because ``--subprocesses`` under a raylet caught only a few samples of an LLM replica."""
    out: dict[str, int] = {}
    for pid in descendants(root):
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
        except OSError:
            continue
        if command.startswith("ray::"):
            role = re.sub(r"[^A-Za-z0-9_.-]+", "-", command.removeprefix("ray::")).strip("-")[:60]
            out[role if role not in out else f"{role}-{pid}"] = pid
    return out


def record_each(actors: dict[str, int], seconds: float, out_dir: Path, stem: str) -> Path:
    """Flame graphs of every actor at once (``STEM-ROLE.svg``), then collapsed stacks of every actor at
    once, merged into ``STEM.raw.txt`` with the role as each stack's first frame."""
    for fmt in ("flamegraph", "raw"):
        outputs = {
            role: out_dir / (f"{stem}-{role}.svg" if fmt == "flamegraph" else f".{stem}-{role}.raw")
            for role in actors
        }
        threads = [
            threading.Thread(
                target=record, args=(pid, seconds, outputs[role], fmt), kwargs={"children": False}
            )
            for role, pid in actors.items()
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    merged = out_dir / f"{stem}.raw.txt"
    with merged.open("w") as sink:
        for role in actors:
            part = out_dir / f".{stem}-{role}.raw"
            if part.exists():
                for line in part.read_text(errors="replace").splitlines():
                    sink.write(f'process 0:"{role}";{line}\n')
                part.unlink()
    return merged


def _command(pid: int) -> str:
    """A process's name for the report: its ``ray::`` name, else its command line's first words."""
    try:
        words = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return f"pid {pid} (exited)"
    text = " ".join(" ".join(w.decode(errors="replace") for w in words if w).split())
    return text if text.startswith("ray::") else text[:100]


def cpu_by_process(before: TreeSample, after: TreeSample, seconds: float) -> list[tuple[str, float]]:
    """Cores each process of the tree kept busy between two ``/proc`` samples, busiest first (exact, not
    sampled: a check on py-spy, which can miss samples of a busy process)."""
    used = {key: cpu - before.cpu_s.get(key, 0.0) for key, cpu in after.cpu_s.items()}
    named = [(f"{_command(pid)} [{pid}]", round(cpu / seconds, 3)) for (pid, _), cpu in used.items()]
    return sorted((n for n in named if n[1] >= 0.005), key=lambda n: -n[1])


def _package(frame: str) -> str:
    """The package a frame's file belongs to (``grpc``, ``asyncio``, ``vllm``, ``riskserve``, ...)."""
    match = _FRAME.match(frame)
    if not match:
        return frame.split(" ", 1)[0]
    path = match["file"]
    for marker in ("site-packages/", "lib/python3.11/"):
        if marker in path:
            path = path.split(marker, 1)[1]
            break
    if "/bench/" in path or path.startswith("bench/"):
        return "bench (the harness's own server code)"
    if "/riskserve/" in path or path.startswith("riskserve/"):
        return "riskserve"
    head = path.lstrip("/").split("/", 1)[0]
    return head.removesuffix(".py") or path


def _process_name(frame: str) -> str:
    """``process PID:"COMMAND LINE"`` as the command line's first words (no pid: one name per role)."""
    match = re.match(r'^process \d+:"(?P<command>.*)"$', frame, re.DOTALL)
    command = " ".join((match["command"] if match else frame).split())
    return command[:100] or "?"


def summarize(raw: Path, top: int = 12) -> dict[str, Any]:
    """Shares of the collapsed stacks in ``raw``: by process, by leaf package, top self and inclusive."""
    processes: Counter[str] = Counter()
    packages: Counter[str] = Counter()
    leaf: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    total = 0
    pending: list[str] = []
    for line in raw.read_text(errors="replace").splitlines():
        pending.append(line)  # a process frame holds its command line, which may span lines
        stack, _, count_text = "\n".join(pending).rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        pending = []
        count = int(count_text)
        frames = stack.split(";")
        # With --subprocesses every ancestor process is a frame too: the innermost one ran the stack.
        owners = [f for f in frames if f.startswith("process ")]
        frames = [f for f in frames if not f.startswith(("process ", "thread "))]
        if not frames:
            continue
        total += count
        processes[_process_name(owners[-1] if owners else "")] += count
        packages[_package(frames[-1])] += count
        leaf[frames[-1]] += count
        for frame in set(frames):
            inclusive[frame] += count

    def shares(counter: Counter[str], n: int) -> list[tuple[str, float]]:
        return [(k, round(100.0 * v / max(total, 1), 1)) for k, v in counter.most_common(n)]

    return {
        "samples": total,
        "by_process": shares(processes, top),
        "by_package_self": shares(packages, top),
        "top_self": shares(leaf, top),
        "top_inclusive": shares(inclusive, top),
    }


def _text(name: str, summary: dict[str, Any]) -> str:
    lines = [f"{name}: {summary['samples']} samples at {RATE_HZ} Hz (busy threads only)"]
    lines.append("\ncores busy by process, from /proc over both recordings:")
    lines += [f"  {cores:5.2f}  {what}" for what, cores in summary.get("cores_by_process", [])]
    for key, title in (
        ("by_process", "by process (py-spy samples)"),
        ("by_package_self", "by package of the innermost frame (self)"),
        ("top_self", "top functions, self"),
        ("top_inclusive", "top functions, inclusive"),
    ):
        lines.append(f"\n{title}:")
        lines += [f"  {share:5.1f}%  {what}" for what, share in summary[key]]
    return "\n".join(lines) + "\n"


def profile_system(
    system: Running, seconds: float, out_dir: Path, stem: str, each: bool = False
) -> dict[str, Any]:
    """Warm up, then flame graph and collapsed stacks under c=8, each over ``seconds`` (``each``: every Ray
    actor of the tree on its own, see :func:`ray_actors`)."""
    waited = settle(system, patience_s=45.0)
    log(f"{system.name}: idle after {waited:.0f} s; warm-up")
    loadgen(system, "closed", ["-c8", "--calls=300", "--seconds=60", "--warmup=0"], bound_s=130.0)
    svg, raw = out_dir / f"{stem}.svg", out_dir / f"{stem}.raw.txt"
    failures: list[BaseException] = []

    cpu: dict[str, Any] = {}

    def sample() -> None:
        try:
            time.sleep(1.0)  # past the window's first calls
            cpu["before"], cpu["t0"] = sample_tree(system.root_pid), time.perf_counter()
            if each:
                record_each(ray_actors(system.root_pid), seconds, out_dir, stem)
            else:
                record(system.root_pid, seconds, svg, "flamegraph")
                record(system.root_pid, seconds, raw, "raw")
            cpu["after"], cpu["t1"] = sample_tree(system.root_pid), time.perf_counter()
        except (RuntimeError, OSError, subprocess.SubprocessError) as error:
            failures.append(error)

    sampler = threading.Thread(target=sample, daemon=True)
    window = 2 * seconds + 8.0
    options = ["-c8", "--calls=10000000", f"--seconds={window}", "--warmup=0"]
    result = loadgen(system, "closed", options, bound_s=window + 120.0, on_start=sampler.start)
    sampler.join(timeout=seconds * 2 + 120.0)
    if failures:
        raise RuntimeError(str(failures[0]))
    summary = summarize(raw) | {
        "cores_by_process": cpu_by_process(cpu["before"], cpu["after"], cpu["t1"] - cpu["t0"]),
        "decisions_per_s": result["decisions_per_s"],
        "p50_ms": result["latency_ms"]["p50"],
        "errors": result["error_count"],
        "wrong": result["wrong"],
    }
    (out_dir / f"{stem}.txt").write_text(_text(stem, summary))
    raw.unlink()  # the summary and the flame graphs are kept; the raw stacks hold every command line
    log(f"{system.name}: {summary['samples']} samples; by package {summary['by_package_self'][:5]}")
    return summary


def main(argv: Sequence[str] | None = None) -> int:
    from bench.peers.run import reference_answers
    from bench.peers.systems import WORKLOADS, start, write_spec

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", type=Path, default=ROOT / "models")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "profile" / "peers")
    parser.add_argument("--workload", choices=tuple(WORKLOADS), default="tabular_only")
    parser.add_argument("--systems", help="comma-separated; default: every system of the workload")
    parser.add_argument("--seconds", type=float, default=10.0, help="length of each of the two recordings")
    args = parser.parse_args(argv)
    names = [s for s in (args.systems or ",".join(WORKLOADS[args.workload])).split(",") if s]
    models = args.models.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    py_spy()
    summary_path = args.out / "summary.json"
    summaries: dict[str, Any] = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    run_dir = Path(tempfile.mkdtemp(prefix=".profile-", dir=args.out))
    os.environ["RISKSERVE_STATE_DIR"] = str(run_dir / "state")
    try:
        spec = write_spec(run_dir)
        expect = reference_answers(models, run_dir / "expect.json", args.workload)
        for name in names:
            stem = f"{args.workload}-{name}"
            log(f"{stem}: starting")
            try:
                system = start(name, models, run_dir, spec, expect, args.workload)
                if "--expect" not in system.client:
                    system.client = (*system.client, "--expect", str(expect))
                try:
                    each = name in ("riskserve", "ray_serve")  # a Ray cluster: each actor apart
                    summaries[stem] = profile_system(system, args.seconds, args.out, stem, each)
                finally:
                    system.stop()
            except (RuntimeError, OSError, subprocess.SubprocessError, KeyError) as error:
                log(f"{stem}: FAILED: {error}")
                summaries[stem] = {"error": str(error)}
            summary_path.write_text(json.dumps(summaries, indent=2) + "\n")
    finally:
        with contextlib.suppress(OSError):
            shutil.rmtree(run_dir)
    return 1 if any("error" in summaries.get(f"{args.workload}-{n}", {}) for n in names) else 0


if __name__ == "__main__":
    sys.exit(main())
