"""A flood past capacity in a process of its own, so its workers never share a GIL with the client measured.

The overload drills used to run the flood (hundreds of asyncio workers, :class:`~tests.reliability.load.
LoadClient` with ``concurrency``) as a thread of the test process: the steady client then waited for the
flood's Python to run, and its timings said more about the client than about the server. Here the flood is
``python -m tests.reliability.flood``, started by :class:`Flood` and stopped by closing its stdin; it writes
every outcome as a JSON line, read back into a :class:`~tests.reliability.load.Report`. ``time.monotonic``
is the system-wide ``CLOCK_MONOTONIC``, so its times compare with the test process's fault windows.

Run by hand (it stops at end of input, or after ``--seconds``)::

    python -m tests.reliability.flood --target 127.0.0.1:9000 --pipeline tabular_only --seconds 6
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO

from .load import Attempt, LoadClient, Outcome, Report

__all__ = ["Flood", "main", "outcome_from_json", "outcome_to_json"]

READY = "flood started"
"""First line the flood process prints, with the monotonic time its workers started."""
_ROOT = Path(__file__).resolve().parents[2]


def outcome_to_json(outcome: Outcome) -> str:
    return json.dumps(dataclasses.asdict(outcome))


def outcome_from_json(line: str) -> Outcome:
    data = json.loads(line)
    data["attempts"] = [Attempt(**a) for a in data["attempts"]]
    data["fallbacks"] = tuple(data["fallbacks"])
    return Outcome(**data)


class Flood:
    """``workers`` calls always in flight (closed loop, each with ``deadline_s``, no retries) over
    ``channels`` connections, from a child process, until the ``with`` block ends; then :meth:`report`
    has every call."""

    def __init__(
        self,
        target: str,
        *,
        pipeline: str,
        workers: int = 600,
        channels: int = 8,
        deadline_s: float = 2.0,
        seed: int = 0,
    ) -> None:
        self._command = [
            sys.executable, "-m", "tests.reliability.flood", "--target", target, "--pipeline", pipeline,
            "--workers", str(workers), "--channels", str(channels), "--deadline-s", str(deadline_s),
            "--seed", str(seed),
        ]  # fmt: skip
        self.deadline_s = deadline_s
        self._process: subprocess.Popen[str] | None = None
        self._report: Report | None = None

    def __enter__(self) -> Flood:
        path = os.pathsep.join(p for p in (str(_ROOT), os.environ.get("PYTHONPATH", "")) if p)
        self._process = process = subprocess.Popen(
            self._command, cwd=_ROOT, env={**os.environ, "PYTHONPATH": path},
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert process.stdout is not None
        first = process.stdout.readline()
        assert first.startswith(READY), f"the flood process did not start: {first!r}"
        self.started = float(first.split()[-1])
        return self

    def __exit__(self, *_: object) -> None:
        process = self._process
        assert process is not None
        assert process.stdin is not None
        assert process.stdout is not None
        process.stdin.close()  # stop: every worker ends its call in flight (each has its deadline)
        lines = process.stdout.read().splitlines()
        assert process.wait(timeout=self.deadline_s + 60) == 0, "the flood process failed"
        head = json.loads(lines[0])
        outcomes = [outcome_from_json(line) for line in lines[1:]]
        self._report = Report(outcomes, head["started"], head["ended"])

    def report(self) -> Report:
        assert self._report is not None, "the flood has not ended"
        return self._report


def _stop_at_eof(stream: IO[str], stop: threading.Event) -> None:
    for _ in stream:
        pass
    stop.set()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--pipeline", required=True)
    parser.add_argument("--workers", type=int, default=600)
    parser.add_argument("--channels", type=int, default=8)
    parser.add_argument("--deadline-s", type=float, default=2.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--seconds", type=float, default=0.0, help="0: until stdin ends")
    args = parser.parse_args(argv)
    stop = threading.Event()
    threading.Thread(target=_stop_at_eof, args=(sys.stdin, stop), daemon=True).start()
    flood = LoadClient(args.target, pipeline=args.pipeline, rate=1, deadline_s=args.deadline_s, retries=0,
                       channels=args.channels, seed=args.seed, concurrency=args.workers)  # fmt: skip
    with flood:
        print(f"{READY} {time.monotonic()!r}", flush=True)
        stop.wait(args.seconds or None)
    report = flood.report()
    out: list[str] = [json.dumps({"started": report.started, "ended": report.ended})]
    out.extend(outcome_to_json(o) for o in report.outcomes)
    sys.stdout.write("\n".join(out) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
