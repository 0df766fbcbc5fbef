"""Histograms are kept in the process and handed to Ray as gauges: a Ray call per bucket, not per observation.

Ray 2.60's metrics agent replays every observation of a Ray histogram with one Python call at each report
interval; riskserve's gauges cost it one call per series. These tests run the real registry on Ray's real
metric objects (outside a cluster Ray keeps them in the process); the only addition is a wrapper that
counts the calls reaching Ray's own recorder and passes each one on.
"""

from __future__ import annotations

import random
import threading
from typing import Any

import pytest

from riskserve.platform import metrics
from riskserve.platform.metrics import DECISION_LATENCY, MODEL_BATCH_ROWS, MetricSpec

from .metric_recorders import CountingRecorder


def _watched(registry: Any, spec: MetricSpec) -> dict[str, CountingRecorder]:
    """The three gauges ``spec`` is exported as, made now in ``registry`` with their recorders counted."""
    watched = {}
    for suffix in ("_bucket", "_sum", "_count"):
        gauge = registry._metric(metrics._part(spec, suffix))
        watched[suffix] = gauge._metric = CountingRecorder(gauge._metric)
    return watched


def _last(calls: list[tuple[float, dict[str, str]]], key: str = "") -> dict[str, float]:
    """The last value set per ``tags[key]`` (``le``), or under ``""`` without a key."""
    return {tags.get(key, ""): value for value, tags in calls}


def _observe_in_one_flush(registry: Any, spec: MetricSpec, series: Any, values: list[float]) -> None:
    """Record ``values`` while the flusher is held off, then flush: exactly one export of the series."""
    with registry._flush_lock:
        for value in values:
            registry.add(spec, series, value)
    registry.flush()  # this or the background flusher exports them, the other finds nothing pending


def test_a_histogram_series_costs_ray_one_call_per_bucket_not_per_observation() -> None:
    registry = metrics._Registry()
    spec = DECISION_LATENCY
    series = (("pipeline", "histo_unit"),)
    watched = _watched(registry, spec)
    rng = random.Random(7)
    values = [rng.choice(spec.boundaries) * rng.choice((0.5, 1.0, 1.5)) for _ in range(5000)]
    values += [20.0, 0.0]  # past the last bound (+Inf only) and at zero

    _observe_in_one_flush(registry, spec, series, values)

    buckets = len(spec.boundaries) + 1
    assert len(watched["_bucket"].calls) == buckets  # not 5002
    assert len(watched["_sum"].calls) == len(watched["_count"].calls) == 1
    les = [str(float(bound)) for bound in spec.boundaries] + ["+Inf"]
    assert [tags["le"] for _, tags in watched["_bucket"].calls] == les
    assert les[:3] == ["0.0001", "0.00025", "0.0005"]
    assert les[-2:] == ["10.0", "+Inf"]
    assert all(tags["pipeline"] == "histo_unit" for _, tags in watched["_bucket"].calls)
    expected = {
        le: float(sum(v <= bound for v in values))
        for le, bound in zip(les[:-1], spec.boundaries, strict=True)
    }
    expected["+Inf"] = float(len(values))
    assert _last(watched["_bucket"].calls, "le") == expected  # cumulative, and exact at each bound
    assert _last(watched["_count"].calls) == {"": float(len(values))}
    assert _last(watched["_sum"].calls)[""] == pytest.approx(sum(values))  # exact, not from midpoints
    assert "le" not in watched["_sum"].calls[0][1]
    assert "le" not in watched["_count"].calls[0][1]

    # More observations in the top bucket only: the buckets below it did not change and are not re-set.
    for recorder in watched.values():
        recorder.calls.clear()
    _observe_in_one_flush(registry, spec, series, [7.0] * 300)
    assert [tags["le"] for _, tags in watched["_bucket"].calls] == ["10.0", "+Inf"]
    top = {"10.0": expected["10.0"] + 300, "+Inf": float(len(values) + 300)}
    assert _last(watched["_bucket"].calls, "le") == top
    assert _last(watched["_count"].calls) == {"": float(len(values) + 300)}

    # The refresher re-sets every bucket with the values already exported, so none ages out of Ray's agent.
    for recorder in watched.values():
        recorder.calls.clear()
    registry.refresh()
    refreshed = _last(watched["_bucket"].calls, "le")
    assert len(watched["_bucket"].calls) == buckets
    assert refreshed == {**expected, **top}
    assert _last(watched["_count"].calls) == {"": float(len(values) + 300)}
    assert registry.recorded(spec, {"pipeline": "histo_unit"}) == len(values) + 300


def test_each_series_keeps_its_own_buckets_with_le_written_as_ray_writes_it() -> None:
    """Integer bounds are written as Ray's agent writes them (``1.0``), and two series never mix."""
    registry = metrics._Registry()
    spec = MODEL_BATCH_ROWS
    watched = _watched(registry, spec)
    small = (("model", "a"), ("kind", "treelite"))
    large = (("model", "b"), ("kind", "sklearn"))
    with registry._flush_lock:
        for rows in (1, 1, 2, 3):
            registry.add(spec, small, float(rows))
        for rows in (4096, 5000):
            registry.add(spec, large, float(rows))
    registry.flush()

    per_model: dict[str, dict[str, float]] = {}
    for value, tags in watched["_bucket"].calls:
        per_model.setdefault(tags["model"], {})[tags["le"]] = value
    assert list(per_model["a"])[:3] == ["1.0", "2.0", "4.0"]
    assert (per_model["a"]["1.0"], per_model["a"]["2.0"], per_model["a"]["4.0"]) == (2.0, 3.0, 4.0)
    assert per_model["a"]["+Inf"] == 4.0
    # b observed only the top buckets: only 4096.0 and +Inf were set for it.
    assert per_model["b"] == {"4096.0": 1.0, "+Inf": 2.0}
    counts = {tags["model"]: value for value, tags in watched["_count"].calls}
    assert counts == {"a": 4.0, "b": 2.0}
    assert registry.recorded(spec, {"kind": "treelite"}) == 4.0


def test_records_from_many_threads_during_flushes_are_all_counted_once() -> None:
    """Records are tallied where they are made, and each flush takes the tallies whole: four threads
    recording while flushes run back to back lose no record and count none twice (a flush that took a
    tally while a record was being added to it would lose that record)."""
    registry = metrics._Registry()
    counter = metrics.DECISIONS
    counted = (("pipeline", "threads_unit"), ("outcome", "APPROVE"))
    timed = (("pipeline", "threads_unit"),)
    per_thread, threads = 20_000, 4
    start = threading.Barrier(threads + 1)

    def record() -> None:
        start.wait()
        for i in range(per_thread):
            registry.add(counter, counted, 1.0)
            registry.add(DECISION_LATENCY, timed, 0.001 * (i % 7))

    workers = [threading.Thread(target=record) for _ in range(threads)]
    for worker in workers:
        worker.start()
    start.wait()
    flushes = 0
    while any(worker.is_alive() for worker in workers):
        registry.flush()
        flushes += 1
    for worker in workers:
        worker.join()
    assert flushes > 1  # the flushes really ran while the records were being made
    assert registry.recorded(counter, {"pipeline": "threads_unit"}) == threads * per_thread
    assert registry.recorded(DECISION_LATENCY, {"pipeline": "threads_unit"}) == threads * per_thread
    histogram = registry._histograms[(DECISION_LATENCY.name, timed)]
    assert histogram.total == pytest.approx(threads * sum(0.001 * (i % 7) for i in range(per_thread)))


def test_recording_keeps_one_tally_per_series_not_one_entry_per_record() -> None:
    """What the flusher takes grows with the series, not the records: 10,000 records of two series leave
    two tallies, so a flush is as cheap after a busy second as after a quiet one."""
    registry = metrics._Registry()
    with registry._flush_lock:  # the background flusher waits
        for _ in range(5_000):
            registry.add(metrics.DECISIONS, (("pipeline", "tally_unit"), ("outcome", "REVIEW")), 1.0)
            registry.add(DECISION_LATENCY, (("pipeline", "tally_unit"),), 0.002)
        assert registry._sums == {
            (metrics.DECISIONS.name, (("pipeline", "tally_unit"), ("outcome", "REVIEW"))): 5_000.0
        }
        assert [h.count for h in registry._histograms.values()] == [5_000.0]
