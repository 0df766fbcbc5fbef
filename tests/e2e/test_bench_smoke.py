"""The hot-path benchmark cannot rot: a tiny run against the floor, the way ``make bench`` runs it.

Only the floor (``bench/floor_server.py``) is started here, so no Ray is needed; riskserve's own serving is
exercised by the other tests and by ``make bench``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from riskserve.proto.riskserve.v1 import risk_pipeline_pb2 as pb
from riskserve.proto.riskserve.v1 import risk_pipeline_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture
def floor(demo_models: Path) -> Iterator[str]:
    """A running floor server on a free loopback port; yields its target."""
    process = subprocess.Popen(
        [sys.executable, str(BENCH / "floor_server.py"), "--models", str(demo_models), "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        assert line.startswith("serving on 127.0.0.1:"), line
        yield line.removeprefix("serving on ").strip()
    finally:
        process.terminate()
        process.wait(timeout=30)


def test_hotpath_quick_floor(demo_models: Path, tmp_path: Path) -> None:
    command = [sys.executable, str(BENCH / "hotpath.py"), "--quick", "--systems", "floor"]
    done = subprocess.run(
        [*command, "--models", str(demo_models), "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:] + done.stdout[-2000:]
    floor = json.loads((tmp_path / "hotpath.json").read_text())["systems"]["floor"]
    for phase in (floor["c1"], floor["c8"], floor["c8_fleet"], floor["batch"], *floor["open"]):
        assert phase["latency_ms"]["p50"] > 0
        assert phase["latency_ms"]["p99"] >= phase["latency_ms"]["p50"]
        assert phase["decisions"] > 0
        assert phase["error_count"] == 0, phase["errors"]
        assert phase["fallback_count"] == 0
    assert floor["batch"]["decisions"] == floor["batch"]["ok"] * 100
    assert floor["c8"]["server"]["cpu_ms_per_decision"] > 0
    assert floor["c8"]["channels"] == 1  # the eight callers share one connection,
    assert floor["c8_fleet"]["channels"] == 8  # then each has its own
    assert floor["c8_fleet"]["server"]["cpu_ms_per_decision"] > 0
    assert floor["c8"]["server"]["rss_mb"] > 0
    assert (tmp_path / "hotpath.png").stat().st_size > 0
    assert not list(tmp_path.glob(".hotpath-*")), "the run directory is removed"
    assert "floor" in done.stdout


def test_floor_refuses_bad_input_and_loadgen_counts_answers(floor: str) -> None:
    with grpc.insecure_channel(floor) as channel:
        stub = pb_grpc.RiskPipelineStub(channel)  # type: ignore[no-untyped-call]
        with pytest.raises(grpc.RpcError) as refused:
            stub.Decide(pb.DecideRequest(numeric={"amount": -1.0}), timeout=5)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.details().startswith("amount: ")

    command = [sys.executable, str(BENCH / "loadgen.py"), "--target", floor, "--pipeline", "tabular_only"]
    done = subprocess.run(
        [*command, "--mode", "closed", "-c", "2", "--calls", "40", "--warmup", "5"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    assert lines[:2] == [{"event": "start"}, {"event": "end"}]
    result = lines[2]
    assert (result["ok"], result["decisions"], result["errors"]) == (40, 40, {})
    assert sum(result["outcomes"].values()) == 40
    assert result["latency_ms"]["p50"] > 0


def test_batch_stages_quick(demo_models: Path, tmp_path: Path) -> None:
    command = [sys.executable, str(BENCH / "batch_stages.py"), "--rows", "64", "--repeats", "2"]
    done = subprocess.run(
        [*command, "--models", str(demo_models), "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:] + done.stdout[-2000:]
    result = json.loads((tmp_path / "batch_stages.json").read_text())
    assert result["rows"] == 64
    medians = result["median_ms"]
    for stage in ("raw", "features", "models", "rules", "responses", "flow", "floor"):
        assert medians[stage] > 0, stage
    assert medians["sum"] >= medians["features"] + medians["models"]
    assert result["flow_over_floor"] == medians["flow"] / medians["floor"]


def test_lane_transport_quick(tmp_path: Path) -> None:
    command = [sys.executable, str(BENCH / "lane_transport.py"), "--calls", "80", "--rounds", "1"]
    done = subprocess.run([*command, "--out", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:] + done.stdout[-2000:]
    result = json.loads((tmp_path / "lane_transport.json").read_text())
    for transport in ("grpc_aio", "lane_wire"):
        for concurrency in ("c=1", "c=8"):
            figures = result["medians"][transport][concurrency]
            assert 0 < figures["p50_ms"] <= figures["p99_ms"], (transport, concurrency)
            assert figures["calls_per_s"] > 0
            assert figures["cpu_ms_per_call"] > 0
    ratio = result["grpc_over_wire"]["c=1"]["p50_ms"]
    assert (
        ratio
        == result["medians"]["grpc_aio"]["c=1"]["p50_ms"] / result["medians"]["lane_wire"]["c=1"]["p50_ms"]
    )
    assert (tmp_path / "lane_transport.png").stat().st_size > 0


def test_frozen_stops_every_process_of_a_system_and_continues_them(tmp_path: Path) -> None:
    sys.path.insert(0, str(BENCH.parent))
    from bench.hotpath import Running, frozen

    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    script = f"import subprocess, time; subprocess.Popen({sleeper!r}); time.sleep(60)"
    parent = subprocess.Popen([sys.executable, "-c", script])
    pids = [parent.pid]
    try:
        system = Running("tree", "tree", "", parent.pid, False, lambda: None, 0.0)
        from bench._procs import descendants

        for _ in range(50):  # the child appears once the parent has started it
            if descendants(parent.pid):
                break
            time.sleep(0.1)
        pids = [parent.pid, *descendants(parent.pid)]
        assert len(pids) == 2

        def states() -> list[str]:
            return [Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] for pid in pids]

        with frozen(system):
            assert states() == ["T", "T"]  # stopped: no CPU for the bare engine's round
        assert "T" not in states()
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        parent.wait()


def test_bare_engine_rounds_time_the_prompts_they_are_asked_for(demo_models: Path, tmp_path: Path) -> None:
    sys.path.insert(0, str(BENCH.parent))
    from bench.hotpath import QUICK, BareEngine

    bare = BareEngine(demo_models, QUICK, tmp_path)
    try:
        assert bare.startup_s > 0
        first, second = bare.round(3), bare.round(4, gap_ms=20.0)
    finally:
        bare.close()
    assert (first["prompts"], second["prompts"]) == (3, 4)
    assert (first["gap_ms"], second["gap_ms"]) == (0.0, 20.0)
    # the idle gap before each prompt is not timed: a 20 ms gap would show in every sample otherwise
    assert second["single"]["p50"] < 20.0
    for answer in (first, second):
        assert 0 < answer["single"]["p50"] <= answer["single"]["max"]


def test_the_llms_floor_serves_the_bare_engine_over_grpc(demo_models: Path, tmp_path: Path) -> None:
    sys.path.insert(0, str(BENCH.parent))
    from bench.hotpath import QUICK, closed, start_llm_floor
    from riskserve.platform.artifacts import open_artifact

    labels = open_artifact(demo_models / "intent", kind="vllm").manifest.labels
    served = start_llm_floor(demo_models, tmp_path)
    try:
        with grpc.insecure_channel(served.target) as channel:
            stub = pb_grpc.RiskPipelineStub(channel)  # type: ignore[no-untyped-call]
            answer = stub.Decide(pb.DecideRequest(request_id="r1", text="please block my stolen card"))
            assert answer.request_id == "r1"
            (intent,) = answer.models
            assert intent.model == "intent"
            assert intent.label in labels
            assert 1 / len(labels) <= intent.score <= 1.0  # the top label's probability
            with pytest.raises(grpc.RpcError) as refused:
                stub.Decide(pb.DecideRequest(request_id="r2"))
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        window = closed(served, 1, 20, QUICK, 1)  # what the paired rounds run against it
        assert window["decisions"] == 20
        assert window["error_count"] == 0
        assert window["server"]["cpu_s"] > 0
    finally:
        served.stop()


def test_paired_rounds_alternate_two_servers_and_their_medians_are_judged(
    demo_models: Path, tmp_path: Path
) -> None:
    """Two floors stand in for the floor and ``tabular_only`` (no Ray here): the rounds alternate who
    goes first, each ratio is the two turns' figures divided, the medians are what the targets judge."""
    import dataclasses
    import statistics

    sys.path.insert(0, str(BENCH.parent))
    from bench import hotpath

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    floor = hotpath.start_floor(demo_models, tmp_path / "a")
    other = dataclasses.replace(hotpath.start_floor(demo_models, tmp_path / "b"), name=hotpath.PAIRED_TABULAR)
    try:
        paired = hotpath.paired_tabular(floor, other, hotpath.QUICK, 1)
    finally:
        floor.stop()
        other.stop()
    rounds = paired["rounds"]
    assert [r["first"] for r in rounds] == ["floor", hotpath.PAIRED_TABULAR]
    assert paired["errors"] == 0
    for r in rounds:
        mine, theirs = r["turns"][hotpath.PAIRED_TABULAR], r["turns"]["floor"]
        for turn in (mine, theirs):
            assert turn["batch"]["decisions"] == turn["batch"]["ok"] * hotpath.QUICK.batch_rows
            assert turn["c8"]["server"]["cpu_ms_per_decision"] > 0
        assert r["ratios"]["p99_c1"] == mine["c1"]["latency_ms"]["p99"] / theirs["c1"]["latency_ms"]["p99"]
        assert r["ratios"]["throughput_c8"] == mine["c8"]["decisions_per_s"] / theirs["c8"]["decisions_per_s"]
    for key in hotpath.TABULAR_RATIOS:
        assert paired["ratios_median"][key] == statistics.median(r["ratios"][key] for r in rounds)
    verdicts = {v["target"]: v for v in hotpath.targets({hotpath.PAIRED_KEY: paired}, {})}
    assert set(verdicts) == {f"{hotpath.PAIRED_TABULAR} {key}" for key in hotpath.TABULAR_LIMITS}
    for key, limit in hotpath.TABULAR_LIMITS.items():
        verdict = verdicts[f"{hotpath.PAIRED_TABULAR} {key}"]
        value = paired["ratios_median"][key]
        assert verdict["value"] == value
        assert verdict["met"] == (value >= limit if key == "throughput_c8" else value <= limit)
