"""What hosting in a Serve replica costs, apart from what riskserve's own code costs: the floor three ways.

Systems, alternated round by round (each a fresh start, the same phases):

  * ``floor``: ``bench/floor_server.py`` as a plain process (what ``make bench`` compares against);
  * ``floor_in_replica``: the same floor code and grpc.aio server, started in the ``__init__`` of a Serve
    replica on Serve's own event loop, in a local Ray started as ``riskserve up`` starts it (no dashboard,
    no proxy): riskserve's hosting without riskserve's code;
  * ``tabular_only``: ``riskserve up deploy/pipelines/tabular_only.yaml`` as shipped.

Each: idle, 300 warm-up calls, c=1 for ``--seconds``, then c=8 for ``--seconds`` with the CPU of every
server process over exactly that window from ``/proc``, split into the processes that listen on the port
(the floor, or the replica(s)) and the rest (Ray's GCS, raylet, agents, the Serve controller, the standby
ingress replica). So ``floor_in_replica - floor`` prices the replica and Ray around it, and
``tabular_only - floor_in_replica`` riskserve's own code (front door, flow, guarded calls, rules, reasons,
metrics) in the same host.

Run under the heavy lock: ``.venv/bin/python bench/replica_tax.py --models models --rounds 3``. Writes
``OUT/replica_tax.json`` and ``OUT/replica_tax.png`` (default ``bench/out``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import hotpath
from bench._common import write_results
from bench._procs import TreeSample, listening_pids, sample_tree

SYSTEMS = ("floor", "floor_in_replica", "tabular_only")
CHILD_FLAG = "--child-floor-in-replica"


# -- the floor inside a Serve replica (child process side) ----------------------------------------------


def serve_floor_in_replica(models: Path, port: int) -> None:
    """Start a local Ray and Serve as ``riskserve up`` does, deploy the floor's server in one replica, print
    ``serving on HOST:PORT`` once it answers, and stop on SIGTERM."""
    import ray
    from ray import serve

    root = str(hotpath.ROOT)

    @serve.deployment(
        num_replicas=1,
        ray_actor_options={
            "num_cpus": 0,
            # as riskserve's ingress: user code on Serve's own loop (serving.ingress.event_loop: shared)
            "runtime_env": {
                "env_vars": {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0", "PYTHONPATH": root}
            },
        },
    )
    class FloorReplica:
        """The floor's grpc.aio server, started on the replica's event loop."""

        async def __init__(self, models: str, port: int) -> None:
            import grpc

            from bench.floor_server import Floor, FloorServicer, _check, pb_grpc

            self.floor = await Floor.load(hotpath.PIPELINES / "tabular_only.yaml", Path(models))
            _check(self.floor)
            self.server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
            pb_grpc.add_RiskPipelineServicer_to_server(FloorServicer(self.floor), self.server)  # type: ignore[no-untyped-call]
            self.server.add_insecure_port(f"127.0.0.1:{port}")
            await self.server.start()

        async def __call__(self) -> int:
            return os.getpid()

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    ray.init(address="local", include_dashboard=False, log_to_driver=False)
    try:
        serve.start(proxy_location="Disabled", http_options={"host": "127.0.0.1"})
        handle = serve.run(FloorReplica.bind(str(models), port), name="floor", route_prefix=None)
        handle.remote().result()
        print(f"serving on 127.0.0.1:{port}", flush=True)
        stop.wait()
    finally:
        serve.shutdown()
        ray.shutdown()


def start_floor_in_replica(models: Path) -> hotpath.Running:
    """The child above as a subprocess (its Ray's processes are its descendants); stopped by SIGTERM."""
    started = time.perf_counter()
    port = hotpath._free_port()
    command = [sys.executable, __file__, CHILD_FLAG, str(port), "--models", str(models)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    line = hotpath._first_line(process, timeout_s=180.0)
    if not line.startswith("serving on "):
        process.kill()
        raise RuntimeError(f"the floor in a replica did not start ({line!r})")

    target = line.removeprefix("serving on ").strip()
    stop = hotpath.terminator(process, wait_s=60.0)  # Serve and Ray shut down first
    return hotpath.Running(
        "floor_in_replica", "tabular_only", target, process.pid, False, stop, time.perf_counter() - started
    )


# -- measuring ------------------------------------------------------------------------------------------


def split_cpu(before: TreeSample, after: TreeSample, serving: set[int]) -> tuple[float, float]:
    """CPU seconds of the serving processes and of every other process of the tree, between two samples."""
    mine = rest = 0.0
    for key, cpu in after.cpu_s.items():
        used = cpu - before.cpu_s.get(key, 0.0)
        if key[0] in serving:
            mine += used
        else:
            rest += used
    return mine, rest


def measure(system: hotpath.Running, seconds: float) -> dict[str, Any]:
    """Idle, warm-up, c=1, then c=8 with the CPU split between the serving processes and the rest."""
    hotpath.settle(system)
    warmup = ["-c8", "--calls=300", "--seconds=60", "--warmup=0", "--channels=1"]
    hotpath.loadgen(system, "closed", warmup, bound_s=90)
    c1 = hotpath.loadgen(
        system,
        "closed",
        ["-c1", "--calls=100000000", f"--seconds={seconds}", "--warmup=20"],
        bound_s=90 + seconds,
    )
    serving = set(listening_pids(int(system.target.rsplit(":", 1)[1])))
    samples: dict[str, TreeSample] = {}

    def mark(which: str) -> Any:
        def sample() -> None:
            samples[which] = sample_tree(system.root_pid)

        return sample

    c8 = hotpath.loadgen(
        system,
        "closed",
        ["-c8", "--calls=100000000", f"--seconds={seconds}", "--warmup=20", "--channels=1"],
        bound_s=90 + seconds,
        on_start=mark("start"),
        on_end=mark("end"),
    )
    mine, rest = split_cpu(samples["start"], samples["end"], serving)
    decisions = max(c8["decisions"], 1)
    return {
        "c1_p50_ms": c1["latency_ms"]["p50"],
        "c8_decisions_per_s": c8["decisions_per_s"],
        "c8_p50_ms": c8["latency_ms"]["p50"],
        "serving_cpu_ms_per_decision": mine * 1e3 / decisions,
        "other_cpu_ms_per_decision": rest * 1e3 / decisions,
        "cpu_ms_per_decision": (mine + rest) * 1e3 / decisions,
        "serving_processes": len(serving),
        "errors": c8["error_count"] + c1["error_count"],
        "wrong": c8.get("wrong", 0),
    }


def start(name: str, models: Path, run_dir: Path) -> hotpath.Running:
    if name == "floor":
        return hotpath.start_floor(models, run_dir)
    if name == "floor_in_replica":
        return start_floor_in_replica(models)
    return hotpath.start_riskserve(name, models, run_dir)


def summarise(rows: list[dict[str, Any]], systems: Sequence[str] = SYSTEMS) -> dict[str, dict[str, float]]:
    """Per system, the median of each figure over the rounds."""
    out: dict[str, dict[str, float]] = {}
    for name in systems:
        mine = [r for r in rows if r["system"] == name]
        if mine:
            keys = [k for k, v in mine[0].items() if isinstance(v, float)]
            out[name] = {k: statistics.median(r[k] for r in mine) for k in keys}
    return out


def plot(out_dir: Path, summary: dict[str, dict[str, float]]) -> Path:
    """Stacked bars of CPU-ms per decision (serving process, the rest) and decisions/s at c=8."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(summary)
    fig, (cpu_axis, rate_axis) = plt.subplots(1, 2, figsize=(11, 4))
    serving = [summary[n]["serving_cpu_ms_per_decision"] for n in names]
    other = [summary[n]["other_cpu_ms_per_decision"] for n in names]
    cpu_axis.bar(names, serving, label="serving process(es)")
    cpu_axis.bar(names, other, bottom=serving, label="other processes (Ray)")
    cpu_axis.set_ylabel("CPU-ms per decision at c=8 (median)")
    cpu_axis.legend()
    rate_axis.bar(names, [summary[n]["c8_decisions_per_s"] for n in names], color="tab:green")
    rate_axis.set_ylabel("decisions/s at c=8 (median)")
    fig.suptitle("The floor as a process, the floor in a Serve replica, riskserve tabular_only")
    fig.tight_layout()
    path = out_dir / "replica_tax.png"
    fig.savefig(path, dpi=110)
    return path


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=Path, default=hotpath.ROOT / "models")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--out", type=Path, default=hotpath.ROOT / "bench" / "out")
    parser.add_argument(
        "--systems", nargs="+", default=list(SYSTEMS), help=f"a subset of {SYSTEMS} or hotpath variants"
    )
    args = parser.parse_args(argv)
    models = args.models.resolve()
    run_dir = args.out / ".replica_tax"
    run_dir.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("RISKSERVE_STATE_DIR", str(run_dir / "state"))
    rows: list[dict[str, Any]] = []
    for index in range(args.rounds):
        for name in args.systems:
            hotpath.log(f"round {index + 1}/{args.rounds}: {name}: starting")
            system = start(name, models, run_dir)
            try:
                row = {"round": index, "system": name, **measure(system, args.seconds)}
            finally:
                system.stop()
            rows.append(row)
            hotpath.log(json.dumps(row))
    summary = summarise(rows, args.systems)
    results = {"rounds": rows, "median": summary, "seconds": args.seconds}
    path = write_results(args.out, "replica_tax", results)
    for name, figures in summary.items():
        print(
            f"{name:18} c=1 p50 {figures['c1_p50_ms']:.2f} ms  c=8 {figures['c8_decisions_per_s']:6.0f}/s  "
            f"CPU-ms/decision {figures['cpu_ms_per_decision']:.3f} "
            f"(serving {figures['serving_cpu_ms_per_decision']:.3f}, "
            f"other {figures['other_cpu_ms_per_decision']:.3f})"
        )
    print(f"results: {path}\nplot:    {plot(args.out, summary)}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == CHILD_FLAG:
        serve_floor_in_replica(Path(sys.argv[sys.argv.index("--models") + 1]).resolve(), int(sys.argv[2]))
        raise SystemExit(0)
    raise SystemExit(main())
