"""CPU seconds and resident memory of a process tree, read from ``/proc`` (Linux only).

A server is often more than one process (Ray: GCS, raylet, workers, replicas; vLLM: an engine core), so
CPU is summed over a pid and all of its descendants. Usage::

    before = sample_tree(pid)
    ...  # the measured window
    after = sample_tree(pid)
    cpu_s = cpu_delta(before, after)

What is counted: for every process alive at the end of the window, its CPU at the end minus its CPU at
the start (a process that appeared during the window counts from zero). What is lost: CPU of processes
that *exited* during the window (their ``/proc`` entry is gone by the end; the parent's ``cutime`` would
hold it only once reaped, and would also hold CPU from before the window, so it is not used). Servers
under a steady load do not fork and reap per request, so this loss is nil in practice; the number of
such processes is reported so that a surprise shows. Processes are keyed by (pid, start time), so a pid
reused during the window is not mistaken for the old process.
"""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

__all__ = ["TreeSample", "cpu_delta", "descendants", "listening_pids", "rss_bytes", "sample_tree"]

_PROC = Path("/proc")
_TICKS = os.sysconf("SC_CLK_TCK")
_PAGE = os.sysconf("SC_PAGE_SIZE")


@dataclass(frozen=True)
class TreeSample:
    """CPU seconds (user + system) of every process of a tree at one instant, keyed by (pid, start)."""

    cpu_s: dict[tuple[int, int], float]

    @property
    def total_s(self) -> float:
        """Sum over the tree (each process's CPU since it started)."""
        return sum(self.cpu_s.values())


def _stat_fields(pid: int) -> list[str] | None:
    """Fields of ``/proc/PID/stat`` after the command name (which may hold spaces and parentheses)."""
    try:
        text = (_PROC / str(pid) / "stat").read_text()
    except OSError:  # exited (or never existed) between listing and reading
        return None
    return text[text.rindex(")") + 2 :].split()


def _parents() -> dict[int, int]:
    """pid -> parent pid of every process visible now."""
    out: dict[int, int] = {}
    for entry in _PROC.iterdir():
        if entry.name.isdigit():
            fields = _stat_fields(int(entry.name))
            if fields is not None:
                out[int(entry.name)] = int(fields[1])  # field 4 of stat: ppid
    return out


def descendants(pid: int) -> list[int]:
    """``pid`` and every process below it, alive now (breadth first)."""
    children: dict[int, list[int]] = {}
    for child, parent in _parents().items():
        children.setdefault(parent, []).append(child)
    tree, queue = [], [pid]
    while queue:
        current = queue.pop(0)
        tree.append(current)
        queue.extend(children.get(current, []))
    return tree


def _cpu(pid: int) -> tuple[int, float] | None:
    """(start time in ticks, utime + stime in seconds) of one process, or ``None`` if it is gone."""
    fields = _stat_fields(pid)
    if fields is None:
        return None
    # After the name: state is index 0, so stat field N is index N - 3 (utime 14, stime 15, start 22).
    return int(fields[19]), (int(fields[11]) + int(fields[12])) / _TICKS


def sample_tree(pid: int) -> TreeSample:
    """CPU seconds of ``pid`` and its descendants, now."""
    out: dict[tuple[int, int], float] = {}
    for member in descendants(pid):
        sample = _cpu(member)
        if sample is not None:
            out[(member, sample[0])] = sample[1]
    return TreeSample(out)


def cpu_delta(before: TreeSample, after: TreeSample) -> tuple[float, int]:
    """CPU seconds the tree used between two samples, and how many processes exited in between (lost)."""
    used = sum(cpu - before.cpu_s.get(key, 0.0) for key, cpu in after.cpu_s.items())
    exited = len(set(before.cpu_s) - set(after.cpu_s))
    return used, exited


def rss_bytes(pid: int) -> int:
    """Resident memory of ``pid`` and its descendants, summed (shared pages counted once per process)."""
    total = 0
    for member in descendants(pid):
        try:
            resident_pages = int((_PROC / str(member) / "statm").read_text().split()[1])
        except (OSError, IndexError, ValueError):
            continue
        total += resident_pages * _PAGE
    return total


def listening_pids(port: int) -> list[int]:
    """Pids of the processes listening on TCP ``port``, in the order ``ss`` lists them, each once (several
    ingress replicas share a port)."""
    out = subprocess.run(["ss", "-Hltnp", f"sport = :{port}"], capture_output=True, text=True).stdout
    return list(dict.fromkeys(int(pid) for pid in re.findall(r"pid=(\d+)", out)))
