"""A model's calls in flight are tallied where they happen and handed to Ray by the flusher, not per call.

The gauge moves twice per model call (in and out). Set in Ray each time, it cost two Ray calls and the
lock the gauge refresher holds on the request path of every call to a model in its own deployment. These
tests run the real registry on Ray's real gauge (outside a cluster Ray keeps it in the process); the only
addition is a wrapper that counts the calls reaching Ray's own recorder and passes each one on.
"""

from __future__ import annotations

from riskserve.platform import metrics
from riskserve.platform.metrics import MODEL_IN_FLIGHT, ModelMetrics

from .metric_recorders import CountingRecorder


def _mine(recorder: CountingRecorder, model: str) -> list[float]:
    return [value for value, tags in recorder.calls if tags.get("model") == model]


def test_calls_in_flight_reach_ray_once_per_flush_with_the_count_at_that_moment() -> None:
    registry = metrics._registry()
    gauge = registry._metric(MODEL_IN_FLIGHT)
    recorder = gauge._metric = CountingRecorder(gauge._metric)
    model = ModelMetrics("in_flight_unit", "vllm")
    tags = {"model": "in_flight_unit", "kind": "vllm"}
    try:
        with registry._flush_lock:  # the background flusher waits: nothing may reach Ray meanwhile
            with model.in_flight(), model.in_flight(), model.in_flight():
                assert _mine(recorder, "in_flight_unit") == []  # six moves so far would have been six calls
                assert registry.in_flight[("in_flight_unit", "vllm")] == 3
            with model.in_flight():
                pass
        assert registry.recorded(MODEL_IN_FLIGHT, tags) == 0.0  # flushes first: the count now, not a sum
        assert _mine(recorder, "in_flight_unit") == [0.0]  # one call for the eight moves, with the last count

        with registry._flush_lock:
            entered = model.in_flight()
            entered.__enter__()
            entered_too = model.in_flight()
            entered_too.__enter__()
        registry.flush()
        assert _mine(recorder, "in_flight_unit") == [0.0, 2.0]
        assert registry.recorded(MODEL_IN_FLIGHT, tags) == 2.0

        registry.refresh()  # re-sent with its last value, so the series does not age out of Ray's agent
        assert _mine(recorder, "in_flight_unit")[-1] == 2.0
        entered_too.__exit__(None, None, None)
        entered.__exit__(None, None, None)
        registry.flush()
        assert _mine(recorder, "in_flight_unit")[-1] == 0.0
        assert registry.recorded(MODEL_IN_FLIGHT, tags) == 0.0
    finally:
        gauge._metric = recorder.native
