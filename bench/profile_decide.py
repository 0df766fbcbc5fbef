"""Flame graph of a tabular decision in the ingress replica, under steady load (py-spy, real gRPC).

Starts ``riskserve up`` with ``tabular_only`` (its own state directory, a free port), finds the process
that listens on the pipeline's port (the ingress replica, which also runs both models), drives it with
closed-loop ``Decide`` calls from a separate client process and records it with py-spy. Writes
``bench/profile/tabular_decide.svg`` (flame graph) and ``tabular_decide.txt`` (collapsed stacks) and prints
the share of samples per riskserve function, the split BENCHMARKS.md quotes.

Run: ``.venv/bin/python bench/profile_decide.py --models models`` (py-spy needs ptrace: run as root).
"""

from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._procs import listening_pids

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
CLIENT = """
import sys, time, grpc
from riskserve.proto.riskserve.v1 import risk_pipeline_pb2 as pb, risk_pipeline_pb2_grpc as pbg
stub = pbg.RiskPipelineStub(grpc.insecure_channel(sys.argv[1]))
numeric = {"amount": 42.5, "account_age_days": 900, "txn_velocity_1h": 0, "hour": 14}
request = pb.DecideRequest(numeric=numeric, categorical={"merchant_category": "grocery", "channel": "pos"})
end = time.time() + float(sys.argv[2])
while time.time() < end:
    stub.Decide(request, metadata=(("application", "tabular_only"),), timeout=5)
"""


def _listener_pid(port: int) -> int:
    pids = listening_pids(port)
    if not pids:
        raise SystemExit(f"nothing listens on port {port}")
    return pids[0]


def _shares(raw: Path, top: int) -> list[tuple[float, str]]:
    """Inclusive share of samples per riskserve function (``file:function``)."""
    inclusive: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        total += int(count)
        names = {
            f.split(" (")[0] + " " + f.split("/")[-1].split(":")[0]
            for f in stack.split(";")
            if "riskserve/" in f
        }
        for name in names:
            inclusive[name] += int(count)
    return [(100 * n / max(total, 1), name) for name, n in inclusive.most_common(top)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=Path, default=ROOT / "models")
    parser.add_argument("--seconds", type=float, default=15)
    parser.add_argument("--port", type=int, default=9611)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "profile")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "RISKSERVE_STATE_DIR": tempfile.mkdtemp(prefix="riskserve-profile-")}
    yaml_path = ROOT / "deploy" / "pipelines" / "tabular_only.yaml"
    subprocess.run(
        [BIN / "riskserve", "up", str(yaml_path), "--grpc-port", str(args.port)], env=env, check=True
    )
    try:
        pid = _listener_pid(args.port)
        client = subprocess.Popen(
            [sys.executable, "-c", CLIENT, f"127.0.0.1:{args.port}", str(args.seconds + 5)], env=env
        )
        time.sleep(2)  # warm
        for fmt, name in (("flamegraph", "tabular_decide.svg"), ("raw", "tabular_decide.txt")):
            subprocess.run(
                [BIN / "py-spy", "record", "-p", str(pid), "-d", str(int(args.seconds / 2)), "-r", "500",
                 "--nonblocking", "--format", fmt, "-o", str(args.out / name)],
                check=True, capture_output=True,
            )  # fmt: skip
        client.wait()
    finally:
        subprocess.run([BIN / "riskserve", "down"], env=env, check=False)
    print(f"flame graph: {args.out / 'tabular_decide.svg'}")
    for share, name in _shares(args.out / "tabular_decide.txt", 25):
        print(f"{share:5.1f}%  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
