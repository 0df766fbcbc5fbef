"""``bench/replica_tax.py``'s accounting: the serving processes' CPU is told apart from the rest of the tree,
a process that appeared in the window counts from zero, and the listener of a port is found by pid."""

from __future__ import annotations

import os
import socket
import statistics

from bench._procs import TreeSample, listening_pids
from bench.replica_tax import split_cpu, summarise


def test_split_cpu_separates_the_serving_processes_from_the_rest() -> None:
    before = TreeSample({(10, 1): 5.0, (11, 1): 2.0, (12, 1): 1.0})
    after = TreeSample({(10, 1): 7.5, (11, 1): 2.25, (12, 1): 1.5, (13, 9): 0.25})  # 13 started meanwhile
    serving, rest = split_cpu(before, after, {10})
    assert serving == 2.5
    assert rest == 0.25 + 0.5 + 0.25


def test_split_cpu_does_not_take_a_reused_pid_for_the_old_process() -> None:
    before = TreeSample({(10, 1): 5.0})
    after = TreeSample({(10, 2): 0.5})  # pid 10 exited and was reused: a new start time
    assert split_cpu(before, after, {10}) == (0.5, 0.0)


def test_listeners_finds_this_process_listening_on_a_loopback_port() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        assert listening_pids(port) == [os.getpid()]
    assert listening_pids(port) == []


def test_summarise_takes_each_systems_median_over_rounds() -> None:
    rows = [
        {"round": i, "system": "floor", "cpu_ms_per_decision": value, "serving_processes": 1}
        for i, value in enumerate((0.5, 0.7, 0.6))
    ]
    rows.append({"round": 0, "system": "tabular_only", "cpu_ms_per_decision": 0.9, "serving_processes": 2})
    summary = summarise(rows)
    assert summary["floor"]["cpu_ms_per_decision"] == statistics.median([0.5, 0.7, 0.6])
    assert summary["tabular_only"] == {"cpu_ms_per_decision": 0.9}  # counts are not averaged
