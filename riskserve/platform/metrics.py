"""One metrics vocabulary for every model and pipeline, exported through Ray's metrics pipeline.

Every metric is a ``ray.serve.metrics`` Counter or Gauge; a histogram is three gauges (below). A replica
records into its own
process; Ray's core worker sends the values to the node's metrics agent every
``metrics_report_interval_ms`` (10 s by default) and the agent serves them in Prometheus text format on the
node's *metrics export port* (``http://NODE:PORT/metrics``). Inside a Serve replica Serve adds the
``deployment``, ``replica`` and ``application`` tags by itself; Ray adds ``Component``, ``NodeAddress``,
``SessionName``, ``Version`` and ``WorkerId``.

Names as Prometheus sees them (observed on Ray 2.60's ``/metrics`` page): Ray puts ``ray_`` in front of every
custom metric, and a counter gets ``_total`` after it, so the counter declared here as
``riskserve_decisions`` is scraped as ``ray_riskserve_decisions_total`` and the histogram
``riskserve_decision_latency_seconds`` as ``ray_riskserve_decision_latency_seconds_bucket`` / ``_count`` /
``_sum``. :attr:`MetricSpec.exported` gives the exact name of each one.

Histograms are kept here and exported as gauges. Each process keeps every histogram series' cumulative
bucket counts, sum and count, and sets them on three Ray gauges, ``NAME_bucket`` (tags plus ``le``),
``NAME_sum`` and ``NAME_count``: Prometheus scrapes the same names, labels (``le`` as Ray's agent writes
it: ``"0.005"``, ``"1.0"``, ``"+Inf"``) and cumulative values a Ray histogram gives, so ``histogram_quantile``
and ``rate(..._count[...])`` work unchanged; only the ``# TYPE`` line says ``gauge`` instead of
``histogram``, and ``_sum`` is now exact (Ray's agent rebuilt it from bucket midpoints). Why: Ray 2.60's
agent replays every observation of a Ray histogram, one Python call each, at every report interval (about
1 s of CPU every 10 s at 450 decisions/s on two cores); a gauge costs it one call per series. Each process
exports its own series (Serve's ``replica`` tag and Ray's ``WorkerId`` tell them apart), so replicas never
overwrite one another, and a restarted replica starts again at 0 like any counter.

Model level (tags ``model``, ``kind`` and, where relevant, ``version``, ``outcome``, ``reason``)::

    ray_riskserve_model_requests_total{model,kind,version,outcome}   outcome: ok | error
    ray_riskserve_model_errors_total{model,kind,reason}
    ray_riskserve_model_latency_seconds_*{model,kind,version}        0.1 ms .. 10 s
    ray_riskserve_model_batch_rows_*{model,kind}                     1 .. 4096 rows
    ray_riskserve_model_fallbacks_total{model,kind,reason}           CIRCUIT_OPEN|TIMEOUT|ERROR|OVERLOADED
    ray_riskserve_model_breaker_state{model,kind}                    0 closed, 1 half-open, 2 open
    ray_riskserve_model_in_flight{model,kind}
    ray_riskserve_model_version_info{model,kind,version}             1 serving, 0 replaced

Pipeline level (tag ``pipeline``)::

    ray_riskserve_decisions_total{pipeline,outcome}                  APPROVE | REVIEW | DECLINE
    ray_riskserve_invalid_requests_total{pipeline,field}
    ray_riskserve_decision_latency_seconds_*{pipeline}
    ray_riskserve_feature_latency_seconds_*{pipeline}

Online learning (tags ``pipeline`` and ``model`` or ``reason``; recorded by the feedback service)::

    ray_riskserve_labels_refused_total{pipeline,reason}             relabel | source_rate | total_rate
    ray_riskserve_learning_paused{pipeline,model}                   1 paused (drift bound reached), 0 not
    ray_riskserve_learning_drift{pipeline,model}                    L2 drift of the serving version

Audit trail (tag ``pipeline``; recorded by each ingress replica's audit writer)::

    ray_riskserve_audit_records_total{pipeline,outcome}             written | replayed | spilled | dropped

Callers stay one-liners::

    metrics = ModelMetrics("fraud", "treelite")
    with metrics.in_flight():
        ...
    metrics.observe_call(latency_s, rows, version)

    PipelineMetrics("card_fraud").decision("APPROVE")

Ray metric objects are created lazily, on first use, once per process and shared by every caller of that
process: a :class:`ModelMetrics` built in a driver and shipped to a replica (``.bind``) holds no Ray object,
and the first record inside the replica creates the real ones there, with Serve's tags. Outside Ray the same
objects are created and recorded into (Ray keeps them in the process and exports nothing), so plain unit
tests run the real code path; :func:`recorded` reads back what this process recorded. (Shipping Ray's own
metric objects instead would not do: Serve's ``Histogram`` unpickles as a plain ``ray.util.metrics``
histogram, without Serve's tags.)

Gauges (histograms included): Ray 2.60's metrics agent drops a gauge series that no report has refreshed
for two of its report intervals, and a worker reports only gauges set since its last report: a gauge set
once (a breaker that stays open, the serving version) vanishes from ``/metrics`` after ~20 s (2 s at a 1 s
interval). This module therefore keeps the last value of every gauge series of the process, and every
histogram series, and sets them again from a daemon thread every half report interval.

Where the endpoint is: :func:`metrics_export_port` (this node). Ray always runs the agent: on
``ray.init(_metrics_export_port=PORT)`` or ``ray start --metrics-export-port=PORT``, else on a free port it
picks. The report interval is the environment variable ``RAY_metrics_report_interval_ms``
(:data:`REPORT_INTERVAL_ENV`) of the process that starts Ray; ``_system_config={"metrics_report_interval_ms":
MS}`` changes the workers' cadence but not the agent's gauge TTL.
"""

from __future__ import annotations

import atexit
import bisect
import collections
import contextlib
import logging
import os
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal

from riskserve.platform.outcome import OUTCOMES, Outcome

__all__ = [
    "ALL_METRICS",
    "AUDIT_OUTCOMES",
    "AUDIT_RECORDS",
    "BATCH_ROWS_BUCKETS",
    "BREAKER_STATE_VALUES",
    "DECISIONS",
    "DECISION_LATENCY",
    "DEFAULT_METRICS_EXPORT_PORT",
    "EXPORT_PREFIX",
    "FALLBACK_REASONS",
    "FEATURE_LATENCY",
    "INVALID_REQUESTS",
    "LABELS_REFUSED",
    "LABEL_REFUSALS",
    "LATENCY_BUCKETS_S",
    "LEARNING_DRIFT",
    "LEARNING_PAUSED",
    "MODEL_BATCH_ROWS",
    "MODEL_BREAKER_STATE",
    "MODEL_ERRORS",
    "MODEL_FALLBACKS",
    "MODEL_IN_FLIGHT",
    "MODEL_LATENCY",
    "MODEL_REQUESTS",
    "MODEL_VERSION_INFO",
    "REASONS",
    "REASONS_LATENCY",
    "REFUSED_CALLS",
    "REPORT_INTERVAL_ENV",
    "SHADOW_COMPARED",
    "SHADOW_DROPPED",
    "SHADOW_FIGURE",
    "SHADOW_FLIPS",
    "SHADOW_LATENCY",
    "AuditMetrics",
    "FallbackReason",
    "LabelRefusal",
    "LearningMetrics",
    "MetricSpec",
    "MetricType",
    "ModelMetrics",
    "PipelineMetrics",
    "ShadowMetrics",
    "flush_metrics",
    "metrics_export_port",
    "recorded",
]

logger = logging.getLogger(__name__)

EXPORT_PREFIX: Final = "ray_"
"""What Ray puts in front of every custom metric name on its ``/metrics`` page."""

DEFAULT_METRICS_EXPORT_PORT: Final = 8080
"""The port KubeRay gives every Ray pod's metrics agent (container port ``metrics``); a sane fixed choice."""

REPORT_INTERVAL_ENV: Final = "RAY_metrics_report_interval_ms"
"""Environment variable that sets how often workers report metrics (Ray's default: 10000 ms, floor 1000)."""

LATENCY_BUCKETS_S: Final[tuple[float, ...]] = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)
"""Latency bucket upper bounds in seconds: 0.1 ms (a Treelite row) .. 10 s (an LLM under load)."""

BATCH_ROWS_BUCKETS: Final[tuple[float, ...]] = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
"""Batch size bucket upper bounds in rows (the ingress takes at most 1024 requests per batch)."""

FallbackReason = Literal["CIRCUIT_OPEN", "TIMEOUT", "ERROR", "OVERLOADED"]
"""Why a model's YAML fallback answered instead of the model."""

FALLBACK_REASONS: Final[tuple[FallbackReason, ...]] = ("CIRCUIT_OPEN", "TIMEOUT", "ERROR", "OVERLOADED")

LabelRefusal = Literal["relabel", "source_rate", "total_rate"]
"""Why a label was refused: the decision has another label, its source or all sources are over rate."""

LABEL_REFUSALS: Final[tuple[LabelRefusal, ...]] = ("relabel", "source_rate", "total_rate")

BREAKER_STATE_VALUES: Final[Mapping[str, int]] = {"closed": 0, "half_open": 1, "open": 2}
"""Gauge value of each circuit-breaker state (the values of ``riskserve.platform.breaker.BreakerState``)."""

MetricType = Literal["counter", "gauge", "histogram"]

_MAX_FREE_VALUES: Final = 64
"""Distinct values kept per free-form tag (an invalid request's field, an error's reason); then ``other``."""

_MAX_RETIRED_VERSIONS: Final = 4
"""Replaced model versions whose ``version_info`` series stays exported at 0."""


@dataclass(frozen=True)
class MetricSpec:
    """One metric of the vocabulary: how it is declared to Ray and how Prometheus sees it."""

    name: str
    """The name given to Ray (no ``ray_`` prefix, no ``_total`` suffix)."""
    type: MetricType
    description: str
    tag_keys: tuple[str, ...]
    boundaries: tuple[float, ...] = ()
    """Histogram bucket upper bounds."""

    @property
    def exported(self) -> str:
        """The metric name on Ray's ``/metrics`` page and in PromQL (histograms: add ``_bucket`` etc.)."""
        return EXPORT_PREFIX + self.name + ("_total" if self.type == "counter" else "")


_MODEL_TAGS: Final = ("model", "kind")

MODEL_REQUESTS: Final = MetricSpec(
    "riskserve_model_requests",
    "counter",
    "Calls a model answered (outcome=ok) or failed (outcome=error), by serving version.",
    (*_MODEL_TAGS, "version", "outcome"),
)
MODEL_ERRORS: Final = MetricSpec(
    "riskserve_model_errors",
    "counter",
    "Calls a model failed, by reason.",
    (*_MODEL_TAGS, "reason"),
)
MODEL_LATENCY: Final = MetricSpec(
    "riskserve_model_latency_seconds",
    "histogram",
    "Time a model took to answer one call (one batch), in seconds.",
    (*_MODEL_TAGS, "version"),
    LATENCY_BUCKETS_S,
)
MODEL_BATCH_ROWS: Final = MetricSpec(
    "riskserve_model_batch_rows",
    "histogram",
    "Rows in one call to a model.",
    _MODEL_TAGS,
    BATCH_ROWS_BUCKETS,
)
MODEL_FALLBACKS: Final = MetricSpec(
    "riskserve_model_fallbacks",
    "counter",
    "Calls answered by the model's fallback instead of the model: CIRCUIT_OPEN, TIMEOUT, ERROR, OVERLOADED.",
    (*_MODEL_TAGS, "reason"),
)
MODEL_BREAKER_STATE: Final = MetricSpec(
    "riskserve_model_breaker_state",
    "gauge",
    "The model's circuit breaker: 0 closed, 1 half-open, 2 open.",
    _MODEL_TAGS,
)
MODEL_IN_FLIGHT: Final = MetricSpec(
    "riskserve_model_in_flight",
    "gauge",
    "Calls to the model being answered now in this process.",
    _MODEL_TAGS,
)
MODEL_VERSION_INFO: Final = MetricSpec(
    "riskserve_model_version_info",
    "gauge",
    "1 for the version the model serves, 0 for a version it replaced.",
    (*_MODEL_TAGS, "version"),
)
DECISIONS: Final = MetricSpec(
    "riskserve_decisions",
    "counter",
    "Decisions of a pipeline, by outcome: APPROVE, REVIEW, DECLINE.",
    ("pipeline", "outcome"),
)
INVALID_REQUESTS: Final = MetricSpec(
    "riskserve_invalid_requests",
    "counter",
    "Requests a pipeline rejected as invalid, by offending field.",
    ("pipeline", "field"),
)
REFUSED_CALLS: Final = MetricSpec(
    "riskserve_refused_calls",
    "counter",
    "Calls the gRPC front door refused before serving them (credentials, roles, Watch stream caps).",
    ("pipeline", "method", "status"),
)
DECISION_LATENCY: Final = MetricSpec(
    "riskserve_decision_latency_seconds",
    "histogram",
    "End-to-end time of one decision call (features, models, rules), in seconds.",
    ("pipeline",),
    LATENCY_BUCKETS_S,
)
FEATURE_LATENCY: Final = MetricSpec(
    "riskserve_feature_latency_seconds",
    "histogram",
    "Time of the feature stage for one decision call, in seconds.",
    ("pipeline",),
    LATENCY_BUCKETS_S,
)
REASONS: Final = MetricSpec(
    "riskserve_reasons",
    "counter",
    "Decisions given reason codes (outcome=ok), or answered without them because computing them failed "
    "(outcome=error).",
    ("pipeline", "outcome"),
)
REASONS_LATENCY: Final = MetricSpec(
    "riskserve_reasons_latency_seconds",
    "histogram",
    "Time to compute the reason codes of one decision call's explained decisions, in seconds.",
    ("pipeline",),
    LATENCY_BUCKETS_S,
)
_SHADOW_TAGS: Final = ("pipeline", "model", "candidate")
SHADOW_COMPARED: Final = MetricSpec(
    "riskserve_shadow_compared",
    "counter",
    "Live decisions a shadow candidate also scored (off the request path), by model and candidate version.",
    _SHADOW_TAGS,
)
SHADOW_DROPPED: Final = MetricSpec(
    "riskserve_shadow_dropped",
    "counter",
    "Sampled decisions a shadow dropped because it was busy (under load) or failed.",
    _SHADOW_TAGS,
)
SHADOW_FLIPS: Final = MetricSpec(
    "riskserve_shadow_flips",
    "counter",
    "Compared decisions whose outcome the candidate would change, by serving and candidate outcome.",
    (*_SHADOW_TAGS, "serving", "shadow"),
)
SHADOW_LATENCY: Final = MetricSpec(
    "riskserve_shadow_latency_seconds",
    "histogram",
    "Time a shadow candidate took to score one sampled batch, in seconds.",
    _SHADOW_TAGS,
    LATENCY_BUCKETS_S,
)
SHADOW_FIGURE: Final = MetricSpec(
    "riskserve_shadow_figure",
    "gauge",
    "A shadow's comparison figure in this replica: score_correlation, mean_difference, and once labels "
    "arrive serving_logloss, candidate_logloss, serving_auc, candidate_auc.",
    (*_SHADOW_TAGS, "figure"),
)

LABELS_REFUSED: Final = MetricSpec(
    "riskserve_labels_refused",
    "counter",
    "Labels the feedback service refused: relabel (the decision has a label of the other value), "
    "source_rate, total_rate.",
    ("pipeline", "reason"),
)
LEARNING_PAUSED: Final = MetricSpec(
    "riskserve_learning_paused",
    "gauge",
    "1 while an online model's learning is paused (its drift bound was reached; an alert), else 0.",
    ("pipeline", "model"),
)
LEARNING_DRIFT: Final = MetricSpec(
    "riskserve_learning_drift",
    "gauge",
    "L2 norm of the serving online version's coefficient change from its served baseline.",
    ("pipeline", "model"),
)
AUDIT_OUTCOMES: Final = ("written", "replayed", "spilled", "dropped")
AUDIT_RECORDS: Final = MetricSpec(
    "riskserve_audit_records",
    "counter",
    "Decision audit records of an ingress replica: written (to the store from memory), spilled (memory "
    "full: on the journal only), replayed (written to the store from the journal), dropped (lost: memory "
    "and the journal were full, or a journal line was unreadable).",
    ("pipeline", "outcome"),
)

ALL_METRICS: Final[tuple[MetricSpec, ...]] = (
    MODEL_REQUESTS,
    MODEL_ERRORS,
    MODEL_LATENCY,
    MODEL_BATCH_ROWS,
    MODEL_FALLBACKS,
    MODEL_BREAKER_STATE,
    MODEL_IN_FLIGHT,
    MODEL_VERSION_INFO,
    DECISIONS,
    INVALID_REQUESTS,
    REFUSED_CALLS,
    DECISION_LATENCY,
    FEATURE_LATENCY,
    LABELS_REFUSED,
    LEARNING_PAUSED,
    LEARNING_DRIFT,
    REASONS,
    REASONS_LATENCY,
    SHADOW_COMPARED,
    SHADOW_DROPPED,
    SHADOW_FLIPS,
    SHADOW_LATENCY,
    SHADOW_FIGURE,
    AUDIT_RECORDS,
)

_Tags = tuple[tuple[str, str], ...]
"""A series' tags, ordered like the metric's tag keys (hashable)."""


def _series(spec: MetricSpec, tags: Mapping[str, str]) -> _Tags:
    """A series' tags in the metric's tag-key order (hashable, what the registry keys on)."""
    return tuple((key, tags[key]) for key in spec.tag_keys)


_FLUSH_S: Final = 0.5
"""How often records reach Ray's metric objects. Ray itself reports them to its agent at most once a second
(every 10 s by default), so a flush every 0.1 s bought nothing a scrape could see and cost the ingress 0.014
CPU-ms a decision at 1,000 decisions/s (its thread's share from ``/proc``); every 0.5 s a scrape is still at
most one report interval behind."""


def _report_interval_s() -> float:
    """How often this process's worker reports metrics (Ray floors the interval at 1 s)."""
    try:
        import ray

        interval_ms = float(ray._config.metrics_report_interval_ms())
    except Exception:  # no usable Ray: the default
        interval_ms = 10_000.0
    return max(interval_ms, 1000.0) / 1000.0


_HISTOGRAM_PARTS: Final = ("_bucket", "_sum", "_count")
"""The gauges a histogram is exported as, by the suffix Prometheus gives a histogram's series."""


def _le(bound: float) -> str:
    """A bucket's ``le`` label exactly as Ray 2.60's agent writes a Ray histogram's (``str`` of the float:
    ``0.0001``, ``0.005``, ``1.0``, ``4096.0``), so stored series and queries pinning ``le`` stay the same."""
    return str(float(bound))


_INF_LE: Final = "+Inf"


class _Histogram:
    """One histogram series of this process: per-bucket counts (the last one past every bound), sum, count.

    ``low`` is the lowest bucket observed since the last export: the cumulative buckets below it did not
    change, so an export sets only the ones from ``low`` up.
    """

    __slots__ = ("bounds", "buckets", "count", "low", "spec", "total")

    def __init__(self, spec: MetricSpec) -> None:
        self.spec = spec
        self.bounds = spec.boundaries
        self.buckets = [0.0] * (len(self.bounds) + 1)
        self.total = 0.0
        self.count = 0.0
        self.low = len(self.buckets)

    def observe(self, value: float) -> None:
        """Count ``value`` into its bucket: ``le``, so a value equal to a bound is in its bucket."""
        index = bisect.bisect_left(self.bounds, value)
        self.buckets[index] += 1.0
        if index < self.low:
            self.low = index
        self.total += value
        self.count += 1.0

    @property
    def changed(self) -> bool:
        """Whether anything was observed since the last :meth:`snapshot` that took the changes."""
        return self.low < len(self.buckets)

    def snapshot(self, everything: bool) -> _HistogramSnapshot:
        """The values to export (``everything``: every bucket, else those from ``low`` up); the changes
        count as exported from here on."""
        low = 0 if everything else self.low
        self.low = len(self.buckets)
        running, cumulative = 0.0, []
        for count in self.buckets:
            running += count
            cumulative.append(running)
        return _HistogramSnapshot(low, cumulative, self.total, self.count)


@dataclass(frozen=True, slots=True)
class _HistogramSnapshot:
    """A histogram series' cumulative ``_bucket`` values (one per bound then ``+Inf``), sum and count, taken
    under the record lock and exported outside it; ``low``: the first bucket to set."""

    low: int
    cumulative: list[float]
    total: float
    count: float


def _part(spec: MetricSpec, suffix: str) -> MetricSpec:
    """The gauge that exports one part (``_bucket``, ``_sum``, ``_count``) of a histogram."""
    tag_keys = (*spec.tag_keys, "le") if suffix == "_bucket" else spec.tag_keys
    return MetricSpec(spec.name + suffix, "gauge", spec.description, tag_keys)


_Setter = Callable[[float], None]


class _Registry:
    """This process's Ray metric objects, the last value of each gauge series and a local tally."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self._lock = threading.RLock()
        self._metrics: dict[str, Any] = {}
        self._gauges: dict[tuple[str, _Tags], float] = {}
        self._counts: dict[tuple[str, _Tags], float] = {}
        self._free_values: dict[tuple[str, str], set[str]] = {}
        self.in_flight: dict[tuple[str, str], int] = {}
        self.versions: dict[tuple[str, str], str] = {}
        self.retired: dict[tuple[str, str], list[str]] = {}
        self._refresher: threading.Thread | None = None
        self._refresh_failed = False
        self._record_lock = threading.Lock()
        """Held to tally a record and to take the tallies (never during a call into Ray)."""
        self._sums: dict[tuple[str, _Tags], float] = {}
        """Each counter series' sum since the last flush."""
        self._latest: dict[tuple[str, _Tags], tuple[MetricSpec, float]] = {}
        """Each tallied gauge series' last value since the last flush (see :meth:`move_gauge`)."""
        self._specs: dict[str, MetricSpec] = {}
        self._flusher: threading.Thread | None = None
        self._flush_lock = threading.Lock()
        self._flush_failed = False
        self._histograms: dict[tuple[str, _Tags], _Histogram] = {}
        self._histogram_setters: dict[tuple[str, _Tags], tuple[list[_Setter], _Setter, _Setter] | None] = {}
        self._histogram_lock = threading.Lock()
        """Held by whoever exports histogram gauges (flusher, refresher): a value never goes back in time."""

    def _metric(self, spec: MetricSpec) -> Any:
        metric = self._metrics.get(spec.name)
        if metric is None:
            from ray.serve import metrics as ray_serve_metrics

            serve_metrics: Any = ray_serve_metrics  # Ray annotates tag_keys as tuple[str] (one key)
            if spec.type == "counter":
                metric = serve_metrics.Counter(
                    spec.name, description=spec.description, tag_keys=spec.tag_keys
                )
            elif spec.type == "gauge":
                metric = serve_metrics.Gauge(spec.name, description=spec.description, tag_keys=spec.tag_keys)
            else:
                raise TypeError(f"{spec.name}: a histogram is exported as gauges (see _part), not made")
            self._metrics[spec.name] = metric
        return metric

    @staticmethod
    def _key(spec: MetricSpec, tags: Mapping[str, str]) -> tuple[str, _Tags]:
        return spec.name, _series(spec, tags)

    def bounded(self, spec: MetricSpec, key: str, value: str) -> str:
        """``value``, or ``other`` once the tag already has :data:`_MAX_FREE_VALUES` distinct values."""
        with self._lock:
            seen = self._free_values.setdefault((spec.name, key), set())
            if value in seen:
                return value
            if len(seen) >= _MAX_FREE_VALUES:
                return "other"
            seen.add(value)
            return value

    def inc(self, spec: MetricSpec, tags: Mapping[str, str], value: float = 1.0) -> None:
        """Count ``value`` into a counter series (the flusher hands Ray the sum)."""
        self.add(spec, _series(spec, tags), value)

    def observe(self, spec: MetricSpec, tags: Mapping[str, str], value: float) -> None:
        """One observation of a histogram series (the flusher exports its buckets)."""
        self.add(spec, _series(spec, tags), float(value))

    def add(self, spec: MetricSpec, series: _Tags, value: float) -> None:
        """Record ``value`` into one series (its tags already ordered, see :func:`_series`), tallied here.

        A counter's value is summed, a histogram's counted into its bucket, on the recording thread under
        a lock held for that alone. The flusher thread then takes the tallies whole, once per flush: its
        work grows with the number of series, not of records. (It used to take every record from a queue,
        which at a few thousand records a second kept it asking the busy event loop's thread for the GIL:
        in a tight loop of decisions that hand-off cost ~0.1 ms a decision, about the decision itself.)
        """
        key = (spec.name, series)
        with self._record_lock:
            if spec.type == "counter":
                sums = self._sums
                total = sums.get(key)
                if total is None:
                    self._specs[spec.name] = spec
                    sums[key] = value
                else:
                    sums[key] = total + value
            else:
                histogram = self._histograms.get(key)
                if histogram is None:
                    histogram = self._histograms[key] = _Histogram(spec)
                histogram.observe(value)
        if self._flusher is None:
            self._start_flusher()

    def move_gauge(self, spec: MetricSpec, series: _Tags, key: tuple[str, str], delta: int) -> int:
        """Add ``delta`` to the count ``key`` (a model's calls in flight) and tally it as the gauge
        ``series``' value; the flusher sets it in Ray (then the refresher re-sends it). Returns the count.

        For a gauge that moves twice per model call: setting it in Ray each time cost two Ray calls, and the
        lock the refresher holds while it re-sends every gauge, on the request path."""
        with self._record_lock:
            count = self.in_flight.get(key, 0) + delta
            self.in_flight[key] = count
            self._latest[(spec.name, series)] = (spec, float(count))
        if self._flusher is None:
            self._start_flusher()
        return count

    def _start_flusher(self) -> None:
        if self._flusher is None:
            with self._lock:
                if self._flusher is None:
                    self._flusher = threading.Thread(
                        target=self._flush_forever, name="riskserve-metrics", daemon=True
                    )
                    self._flusher.start()

    def _flush_forever(self) -> None:
        stop = threading.Event()
        while not stop.wait(_FLUSH_S):
            self.flush()

    def flush(self) -> None:
        """Hand what was recorded since the last flush to Ray: one ``inc`` per counter series (the sum),
        and for each histogram series observed, its cumulative buckets (those that changed), sum and
        count as gauges. Ray reports to its agent every report interval anyway, so the agent sees one value
        per series and bucket however many observations there were."""
        with self._flush_lock:
            with self._record_lock:
                sums, self._sums = self._sums, {}
                latest, self._latest = self._latest, {}
                specs = dict(self._specs)
            with self._lock:  # the local tally, and Ray's metric objects, made once under this lock
                counts = self._counts
                for key, total in sums.items():
                    counts[key] = counts.get(key, 0.0) + total
                metrics = {name: self._metric(specs[name]) for name, _ in sums}
                if latest:
                    self._start_refresher()
                for (name, tags), (spec, value) in latest.items():  # set in order with the refresher
                    self._counts[(name, tags)] = self._gauges[(name, tags)] = value
                    try:
                        self._metric(spec).set(value, tags=dict(tags))
                    except Exception:
                        self._flush_failure()
            try:
                for (name, tags), total in sums.items():
                    metrics[name].inc(total, tags=dict(tags))
                self._export_histograms(everything=False)
            except Exception:
                self._flush_failure()

    def _flush_failure(self) -> None:
        """Log the first failure to hand records to Ray (with its traceback), then stay quiet."""
        if not self._flush_failed:
            self._flush_failed = True
            logger.exception("riskserve metrics: handing records to Ray failed")

    def _export_histograms(self, everything: bool) -> None:
        """Set the gauges of every histogram series that changed (``everything``: of every series, every
        bucket). Under the histogram lock, so a gauge never goes back in time: snapshots are taken and set in
        order. ``len(boundaries) + 3`` Ray calls a series at most, however many observations."""
        with self._histogram_lock:
            with self._record_lock:
                taken = [
                    (key, histogram.spec, histogram.snapshot(everything))
                    for key, histogram in self._histograms.items()
                    if everything or histogram.changed
                ]
            if not taken:
                return
            with self._lock:
                for key, _, snapshot in taken:
                    self._counts[key] = snapshot.count
                if not everything:
                    self._start_refresher()
            for key, spec, snapshot in taken:
                setters = self._setters(spec, key[1])
                if setters is None:
                    continue
                buckets, total, count = setters
                cumulative = snapshot.cumulative
                for index in range(snapshot.low, len(cumulative)):
                    buckets[index](cumulative[index])
                total(snapshot.total)
                count(snapshot.count)

    def _setters(self, spec: MetricSpec, tags: _Tags) -> tuple[list[_Setter], _Setter, _Setter] | None:
        """The calls that set one histogram series' gauges, built once per series (None: Ray discards it)."""
        key = (spec.name, tags)
        if key in self._histogram_setters:
            return self._histogram_setters[key]
        with self._lock:
            bucket, total, count = (self._metric(_part(spec, suffix)) for suffix in _HISTOGRAM_PARTS)
        les = [*(_le(bound) for bound in spec.boundaries), _INF_LE]
        bucket_setters = [self._setter(bucket, (*tags, ("le", le))) for le in les]
        total_setter, count_setter = self._setter(total, tags), self._setter(count, tags)
        setters: tuple[list[_Setter], _Setter, _Setter] | None = None
        if total_setter and count_setter and all(bucket_setters):
            setters = ([s for s in bucket_setters if s], total_setter, count_setter)
        self._histogram_setters[key] = setters
        return setters

    @staticmethod
    def _setter(gauge: Any, tags: _Tags) -> _Setter | None:
        """The cheapest call that sets one series of a Ray gauge (flusher and refresher only).

        Ray's ``set`` merges and checks the series' tags and looks up Serve's request context on every
        call, for tags that never change: this calls the recorder Ray's own ``set`` ends in, with the tags
        Ray computes for the series (Serve's replica tags included), checked once here.
        ``None``: Ray discards the metric (an invalid name).
        """
        if getattr(gauge, "_discard_metric", False):
            return None
        native = getattr(gauge, "_metric", None)
        final = getattr(gauge, "_get_final_tags", None)
        if native is None or final is None or not hasattr(native, "record"):  # another Ray: the public API
            plain = dict(tags)

            def public(value: float) -> None:
                gauge.set(value, tags=dict(plain))

            return public
        merged = dict(final(dict(tags)))
        gauge._validate_tags(merged)  # raises as set would, once

        def direct(value: float) -> None:
            native.record(value, tags=merged)

        return direct

    def set_gauge(self, spec: MetricSpec, tags: Mapping[str, str], value: float, keep: bool = True) -> None:
        """Set a gauge series; ``keep``: re-send it until :meth:`forget` (else it ages out of Ray's agent)."""
        with self._lock:
            metric = self._metric(spec)
            key = self._key(spec, tags)
            self._counts[key] = float(value)
            if keep:
                self._gauges[key] = float(value)
                self._start_refresher()
            else:
                self._gauges.pop(key, None)
            metric.set(float(value), tags=dict(tags))

    def forget(self, spec: MetricSpec, tags: Mapping[str, str]) -> None:
        """Stop re-sending a gauge series: Ray's agent drops it after two report intervals."""
        with self._lock:
            self._gauges.pop(self._key(spec, tags), None)

    def recorded(self, spec: MetricSpec, tags: Mapping[str, str]) -> float:
        """The local tally of the series matching ``tags``, pending records included (flushed first)."""
        self.flush()
        with self._lock:
            items = [
                value
                for (name, series), value in self._counts.items()
                if name == spec.name and all(pair in series for pair in tags.items())
            ]
        return float(sum(items))

    def _start_refresher(self) -> None:
        if self._refresher is None:
            self._refresher = threading.Thread(
                target=self._refresh_forever, name="riskserve-gauges", daemon=True
            )
            self._refresher.start()

    def _refresh_forever(self) -> None:
        stop = threading.Event()
        while not stop.wait(_report_interval_s() / 2):
            self.refresh()

    def refresh(self) -> None:
        """Re-send every kept gauge series with its last value.

        Under the lock every set takes, so a re-send never overwrites a newer value with an older one.
        Then every histogram series, all its gauges, under the lock the flusher sets them under.
        """
        with self._lock:
            for (name, tags), value in self._gauges.items():
                try:
                    self._metrics[name].set(value, tags=dict(tags))
                except Exception:
                    if not self._refresh_failed:
                        self._refresh_failed = True
                        logger.exception("riskserve metrics: re-sending gauge %s failed", name)
        try:
            self._export_histograms(everything=True)
        except Exception:
            if not self._refresh_failed:
                self._refresh_failed = True
                logger.exception("riskserve metrics: re-sending histograms failed")


_registry_lock = threading.Lock()
_registry_instance: _Registry | None = None


def _registry() -> _Registry:
    """This process's registry (a new one after a fork: Ray objects do not survive one)."""
    global _registry_instance
    registry = _registry_instance
    if registry is not None and registry.pid == _PID[0]:
        return registry
    with _registry_lock:
        _PID[0] = os.getpid()
        if _registry_instance is None or _registry_instance.pid != _PID[0]:
            _registry_instance = _Registry()
        return _registry_instance


_PID = [os.getpid()]
os.register_at_fork(after_in_child=lambda: _PID.__setitem__(0, os.getpid()))


def flush_metrics() -> None:
    """Hand every pending record to Ray now (tests, and a process about to exit)."""
    if _registry_instance is not None and _registry_instance.pid == os.getpid():
        _registry_instance.flush()


atexit.register(flush_metrics)


def recorded(metric: MetricSpec, **tags: str) -> float:
    """What this process recorded into ``metric`` for the series matching ``tags`` (a subset of its tags).

    Summed over the matching series: counters their counts, histograms their numbers of observations,
    gauges their current values. For unit tests, which have no metrics agent to scrape.
    """
    unknown = set(tags) - set(metric.tag_keys)
    if unknown:
        raise ValueError(f"{metric.name} has no tag {sorted(unknown)}; its tags are {list(metric.tag_keys)}")
    return _registry().recorded(metric, tags)


def _breaker_value(state: object) -> int:
    if isinstance(state, bool):
        raise ValueError(f"not a breaker state: {state!r}")
    if isinstance(state, int):
        if state not in BREAKER_STATE_VALUES.values():
            raise ValueError(f"breaker state gauge is 0, 1 or 2, got {state}")
        return state
    name = str(getattr(state, "value", state)).lower().replace("-", "_")
    if name not in BREAKER_STATE_VALUES:
        raise ValueError(f"unknown breaker state {state!r}; expected one of {list(BREAKER_STATE_VALUES)}")
    return BREAKER_STATE_VALUES[name]


class ModelMetrics:
    """The metrics of one model, as recorded by its replica and by the ingress that calls it.

    Cheap to construct anywhere (no Ray object is created until the first record), picklable, and every
    instance of the same ``(model, kind)`` in a process shares the in-flight count and serving version.
    """

    def __init__(self, model: str, kind: str) -> None:
        """``model``: the pipeline's model name; ``kind``: its backend (``sklearn``, ``treelite``, ...)."""
        self.model = model
        self.kind = kind
        self._call_series: dict[str, tuple[_Tags, _Tags, _Tags]] = {}
        """Per version, the three series one answered call records into (built once per version)."""
        self._in_flight_series: _Tags | None = None

    def __repr__(self) -> str:
        return f"ModelMetrics(model={self.model!r}, kind={self.kind!r})"

    def _tags(self, **extra: str) -> dict[str, str]:
        return {"model": self.model, "kind": self.kind, **extra}

    @property
    def version(self) -> str:
        """The serving version last set in this process ('' before any)."""
        return _registry().versions.get((self.model, self.kind), "")

    def observe_call(self, latency_s: float, rows: int, version: str = "") -> None:
        """A call the model answered: one request (outcome ok), its latency and its batch size.

        A ``version`` other than the one serving becomes the serving version (:meth:`set_version`).
        """
        registry = _registry()
        if version and version != registry.versions.get((self.model, self.kind), ""):
            self.set_version(version)
        cache = self._call_series
        series = cache.get(version)
        if series is None:  # built once per version: a call records three series
            if len(cache) > _MAX_RETIRED_VERSIONS + 1:
                cache.clear()
            series = cache[version] = (
                _series(MODEL_REQUESTS, self._tags(version=version, outcome="ok")),
                _series(MODEL_LATENCY, self._tags(version=version)),
                _series(MODEL_BATCH_ROWS, self._tags()),
            )
        registry.add(MODEL_REQUESTS, series[0], 1.0)
        registry.add(MODEL_LATENCY, series[1], latency_s)
        registry.add(MODEL_BATCH_ROWS, series[2], float(rows))

    def error(self, reason: str, version: str = "", latency_s: float | None = None) -> None:
        """A call the model failed: one request (outcome error) and one error of ``reason``.

        ``reason`` is a short stable word (an exception class name, ``UNAVAILABLE``, ...); past 64 distinct
        reasons in a process the rest are counted as ``other``. ``latency_s``, when given, is observed too.
        """
        registry = _registry()
        registry.inc(MODEL_REQUESTS, self._tags(version=version, outcome="error"))
        registry.inc(MODEL_ERRORS, self._tags(reason=registry.bounded(MODEL_ERRORS, "reason", reason)))
        if latency_s is not None:
            registry.observe(MODEL_LATENCY, self._tags(version=version), latency_s)

    def fallback(self, reason: FallbackReason) -> None:
        """One call answered by the fallback: ``CIRCUIT_OPEN``, ``TIMEOUT``, ``ERROR`` or ``OVERLOADED``."""
        if reason not in FALLBACK_REASONS:
            raise ValueError(f"unknown fallback reason {reason!r}; expected one of {list(FALLBACK_REASONS)}")
        _registry().inc(MODEL_FALLBACKS, self._tags(reason=reason))

    def breaker_state(self, state: object) -> None:
        """The breaker's state: a ``BreakerState``, its value (``closed``/``half_open``/``open``) or 0-2."""
        _registry().set_gauge(MODEL_BREAKER_STATE, self._tags(), _breaker_value(state))

    @contextlib.contextmanager
    def in_flight(self) -> Iterator[None]:
        """Count a call as in flight while the block runs (also around ``await`` in async code)."""
        registry = _registry()
        key = (self.model, self.kind)
        series = self._in_flight_series
        if series is None:
            series = self._in_flight_series = _series(MODEL_IN_FLIGHT, self._tags())
        registry.move_gauge(MODEL_IN_FLIGHT, series, key, +1)
        try:
            yield
        finally:
            registry.move_gauge(MODEL_IN_FLIGHT, series, key, -1)

    def set_version(self, version: str) -> None:
        """``version`` is now served: its ``version_info`` series is 1, the one it replaces 0."""
        registry = _registry()
        key = (self.model, self.kind)
        with registry._lock:
            previous = registry.versions.get(key)
            registry.versions[key] = version
            retired = registry.retired.setdefault(key, [])
            if version in retired:
                retired.remove(version)
            if previous is not None and previous != version:
                registry.set_gauge(MODEL_VERSION_INFO, self._tags(version=previous), 0)
                retired.append(previous)
                while len(retired) > _MAX_RETIRED_VERSIONS:
                    registry.forget(MODEL_VERSION_INFO, self._tags(version=retired.pop(0)))
            registry.set_gauge(MODEL_VERSION_INFO, self._tags(version=version), 1)


class PipelineMetrics:
    """The metrics of one pipeline (one Serve application), recorded by its ingress."""

    def __init__(self, pipeline: str) -> None:
        """``pipeline``: the pipeline's name."""
        self.pipeline = pipeline
        self._decision_series: dict[str, _Tags] = {}
        """The ``decisions`` series of each outcome seen (checked and built once)."""
        self._latency_series: _Tags = (("pipeline", pipeline),)

    def __repr__(self) -> str:
        return f"PipelineMetrics(pipeline={self.pipeline!r})"

    def decision(self, outcome: Outcome | str, count: int = 1) -> None:
        """``count`` decisions with ``outcome`` (``APPROVE``, ``REVIEW`` or ``DECLINE``)."""
        series = self._decision_series.get(outcome)
        if series is None:
            if outcome not in OUTCOMES:
                raise ValueError(f"unknown decision outcome {outcome!r}; expected one of {list(OUTCOMES)}")
            series = self._decision_series[str(outcome)] = (
                ("pipeline", self.pipeline), ("outcome", str(outcome)),
            )  # fmt: skip
        if count > 0:
            _registry().add(DECISIONS, series, float(count))

    def decisions(self, outcomes: Sequence[Outcome | str]) -> None:
        """One decision per item of ``outcomes``: one record per outcome, not one per decision (one
        decision, a ``Decide``, skips the count)."""
        if len(outcomes) == 1:
            self.decision(outcomes[0])
            return
        for outcome, count in collections.Counter(outcomes).items():
            self.decision(outcome, count)

    def invalid(self, field: str) -> None:
        """One request rejected as invalid because of ``field`` (past 64 distinct fields: ``other``)."""
        registry = _registry()
        bounded = registry.bounded(INVALID_REQUESTS, "field", field or "unknown")
        registry.inc(INVALID_REQUESTS, {"pipeline": self.pipeline, "field": bounded})

    def refused(self, method: str, status: str) -> None:
        """One call refused at the front door (UNAUTHENTICATED, PERMISSION_DENIED, RESOURCE_EXHAUSTED)."""
        _registry().inc(REFUSED_CALLS, {"pipeline": self.pipeline, "method": method, "status": status})

    def decision_latency(self, seconds: float) -> None:
        """End-to-end time of one decision call."""
        _registry().add(DECISION_LATENCY, self._latency_series, seconds)

    def feature_latency(self, seconds: float) -> None:
        """Time of the feature stage for one decision call."""
        _registry().add(FEATURE_LATENCY, self._latency_series, seconds)

    def reasons(self, rows: int, seconds: float) -> None:
        """``rows`` decisions of one call given reason codes, computed in ``seconds``."""
        registry = _registry()
        series = (("pipeline", self.pipeline), ("outcome", "ok"))
        registry.add(REASONS, series, float(rows))
        registry.add(REASONS_LATENCY, (("pipeline", self.pipeline),), seconds)

    def reasons_failed(self, rows: int) -> None:
        """``rows`` decisions answered without the reason codes they should have had."""
        series = (("pipeline", self.pipeline), ("outcome", "error"))
        _registry().add(REASONS, series, float(rows))


class ShadowMetrics:
    """The metrics of one shadow candidate beside one model of a pipeline, recorded by the ingress."""

    def __init__(self, pipeline: str, model: str, candidate: str) -> None:
        """``candidate``: the candidate's version."""
        self._tags = {"pipeline": pipeline, "model": model, "candidate": candidate}

    def __repr__(self) -> str:
        return f"ShadowMetrics({self._tags!r})"

    def compared(self, rows: int, correlation: float | None, mean_difference: float | None) -> None:
        """``rows`` more decisions compared; the running correlation and mean difference."""
        registry = _registry()
        registry.inc(SHADOW_COMPARED, self._tags, float(rows))
        self._figures({"score_correlation": correlation, "mean_difference": mean_difference})

    def dropped(self, rows: int) -> None:
        """``rows`` sampled decisions dropped (the shadow was busy, or failed)."""
        _registry().inc(SHADOW_DROPPED, self._tags, float(rows))

    def flip(self, serving: str, shadow: str) -> None:
        """One compared decision whose outcome the candidate would change."""
        _registry().inc(SHADOW_FLIPS, {**self._tags, "serving": serving, "shadow": shadow})

    def latency(self, seconds: float) -> None:
        """One sampled batch scored by the candidate."""
        _registry().observe(SHADOW_LATENCY, self._tags, seconds)

    def quality(self, figures: Mapping[str, float | None]) -> None:
        """Both models' log-loss and AUC on the labelled compared decisions."""
        self._figures(figures)

    def _figures(self, figures: Mapping[str, float | None]) -> None:
        registry = _registry()
        for name, value in figures.items():
            if value is not None:
                registry.set_gauge(SHADOW_FIGURE, {**self._tags, "figure": name}, value)

    def forget(self) -> None:
        """Stop exporting this shadow's gauges (it was stopped or promoted)."""
        registry = _registry()
        for name in ("score_correlation", "mean_difference", "serving_logloss", "candidate_logloss",
                     "serving_auc", "candidate_auc"):  # fmt: skip
            registry.forget(SHADOW_FIGURE, {**self._tags, "figure": name})


class AuditMetrics:
    """The audit trail's counters of one pipeline, recorded by each ingress replica's audit writer."""

    def __init__(self, pipeline: str) -> None:
        """``pipeline``: the pipeline's name."""
        self.pipeline = pipeline

    def __repr__(self) -> str:
        return f"AuditMetrics(pipeline={self.pipeline!r})"

    def records(self, outcome: str, count: int) -> None:
        """``count`` more records with ``outcome`` (written, replayed, spilled, dropped)."""
        if outcome not in AUDIT_OUTCOMES:
            raise ValueError(f"unknown audit outcome {outcome!r}; expected one of {list(AUDIT_OUTCOMES)}")
        if count > 0:
            _registry().inc(AUDIT_RECORDS, {"pipeline": self.pipeline, "outcome": outcome}, float(count))


class LearningMetrics:
    """The online-learning metrics of one pipeline, recorded by its feedback service."""

    def __init__(self, pipeline: str) -> None:
        """``pipeline``: the pipeline's name."""
        self.pipeline = pipeline

    def __repr__(self) -> str:
        return f"LearningMetrics(pipeline={self.pipeline!r})"

    def refused(self, reason: LabelRefusal) -> None:
        """One label refused for ``reason``."""
        if reason not in LABEL_REFUSALS:
            raise ValueError(f"unknown refusal {reason!r}; expected one of {list(LABEL_REFUSALS)}")
        _registry().inc(LABELS_REFUSED, {"pipeline": self.pipeline, "reason": reason})

    def learning_state(self, model: str, *, paused: bool, drift: float) -> None:
        """Whether ``model``'s learning is paused, and its serving version's drift from the baseline."""
        tags = {"pipeline": self.pipeline, "model": model}
        registry = _registry()
        registry.set_gauge(LEARNING_PAUSED, tags, 1.0 if paused else 0.0)
        registry.set_gauge(LEARNING_DRIFT, tags, drift)


def _nodes() -> list[dict[str, Any]]:
    import ray

    nodes: list[dict[str, Any]] = ray.nodes()  # type: ignore[no-untyped-call]
    return nodes


def metrics_export_port() -> int | None:
    """The Prometheus port of this process's Ray node (its ``/metrics`` page), or None outside Ray.

    Ray always starts the metrics agent; without ``_metrics_export_port`` it picks a free port, found here.
    """
    import ray

    if not ray.is_initialized():
        return None
    node_id = ray.get_runtime_context().get_node_id()
    for node in _nodes():
        if node.get("NodeID") == node_id and node.get("MetricsExportPort"):
            return int(node["MetricsExportPort"])
    return None
