"""The peer benchmark cannot rot: a quick run of its harness against the floor and riskserve.

The peers themselves install from the package registry into venvs of their own and are not started here
(``make bench-peers`` measures them); what runs is the harness: start, probe, the shared load generator
with every answer checked against the reference answers, stop by pid, JSON and plots.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def test_bench_peers_quick_floor_and_riskserve(demo_models: Path, tmp_path: Path) -> None:
    command = [sys.executable, str(ROOT / "bench" / "peers" / "run.py"), "--quick"]
    command += ["--systems", "floor,riskserve", "--models", str(demo_models), "--out", str(tmp_path)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-4000:] + done.stdout[-2000:]
    document = json.loads((tmp_path / "peers.json").read_text())
    for name in ("floor", "riskserve"):
        system = document["systems"][name]
        assert system["wrong"] == 0, system
        assert system["errors"] == 0, system
        assert system["decisions_checked"] > 100
        assert system["startup_s"] > 0
        assert system["c8"]["server"]["cpu_ms_per_decision"] > 0
        assert system["batches"]["64"]["decisions"] == system["batches"]["64"]["ok"] * 64
        point = system["open"][0]
        assert point["latency_ms"]["p999"] >= point["latency_ms"]["p99"] >= point["latency_ms"]["p50"] > 0
    assert set(document["riskserve_over_row"]) == {"floor"}
    assert document["riskserve_over_row"]["floor"]["cpu_per_decision"] > 0
    assert (tmp_path / "peers_load.png").stat().st_size > 0
    assert (tmp_path / "peers_cpu.png").stat().st_size > 0
    assert not list(tmp_path.glob(".peers-*")), "the run directory is removed"
    assert "[2/2] riskserve" in done.stderr
