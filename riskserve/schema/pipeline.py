"""The pipeline YAML: features, models, pools and decision rules, validated in one pass.

:func:`load_pipeline` reports every problem at once, each with its path
(``models.fraud.timeout_ms: must be > 0``), so a person fixes a file in one round.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import AfterValidator, ConfigDict, Field, ValidationError, model_validator

from riskserve.features.spec import FeatureSpec
from riskserve.platform.artifacts import default_state_dir
from riskserve.platform.breaker import BreakerSettings
from riskserve.platform.errors import ConfigError
from riskserve.platform.outcome import Outcome
from riskserve.platform.tracing import TracingSettings
from riskserve.schema.base import NAME as _NAME
from riskserve.schema.base import Strict as _Strict
from riskserve.schema.rules import DecisionEngine, DecisionSpec, RuleScope, RuleSpec, rule_errors
from riskserve.wrappers import backend, known_kind

__all__ = [
    "AuditSpec",
    "AuthSpec",
    "BatchingSpec",
    "DecisionSpec",
    "FallbackSpec",
    "FeedbackSpec",
    "FrontDoorSpec",
    "IngressSpec",
    "ModelSpec",
    "OnlineLearningSpec",
    "PipelineSpec",
    "PoolSpec",
    "ReasonsSpec",
    "RuleSpec",
    "ServingSpec",
    "SigningSpec",
    "StageSpec",
    "TlsSpec",
    "load_pipeline",
    "parse_pipeline",
]


def _queue_limit(value: int) -> int:
    if value < 1 and value != -1:
        raise ValueError("must be -1 (no limit) or a positive number of requests")
    return value


QueueLimit = Annotated[int, AfterValidator(_queue_limit)]
DEFAULT_HEALTH_CHECK_TIMEOUT_S = 3.0
"""Serve's health check timeout for riskserve's replicas (Serve's own default is 30 s)."""
LLM_HEALTH_CHECK_TIMEOUT_S = 10.0
"""A replica that runs an LLM's engine answers health checks between engine work on the same CPU."""


class PoolSpec(_Strict):
    """A named share of the cluster that models are placed on (a Ray custom resource per pool)."""

    cpus: float = Field(default=0, ge=0)
    """CPU capacity of the pool, shared by the models placed on it."""
    gpus: float = Field(default=0, ge=0)
    """GPU capacity of the pool; models take fractions of it."""
    memory_gb: float | None = Field(default=None, gt=0)
    """Memory capacity, if the pool limits it."""
    node_group: str | None = None
    """KubeRay worker group whose nodes carry this pool (informational on a single machine)."""


class FallbackSpec(_Strict):
    """What stands in for a model's answer when it fails, times out or its breaker is open."""

    score: float | None = Field(default=None, ge=0, le=1)
    """Fixed score used in the decision."""
    label: str | None = None
    """Fixed label (text models)."""
    review: bool = False
    """Force at least REVIEW when this model falls back."""

    @model_validator(mode="after")
    def _something(self) -> FallbackSpec:
        if self.score is None and not self.review:
            raise ValueError("a fallback needs a 'score' or 'review: true'")
        return self


class OnlineLearningSpec(_Strict):
    """How a scikit-learn model learns from the pipeline's feedback (semantics in
    :mod:`riskserve.learning.learner`): mini-batches of ``partial_fit``, validated before they are served."""

    batch_size: int = Field(default=64, ge=1, le=65536)
    """Labels per mini-batch."""
    interval_ms: float = Field(default=5000, gt=0)
    """A partial mini-batch is applied once its oldest label has waited this long."""
    holdout_every: int = Field(default=5, ge=0)
    """One label in this many (chosen by an HMAC of its ``feedback_id`` under the pipeline's secret key,
    kept in its state database, so a caller cannot pick which labels validate) validates instead of
    training; 0 holds nothing out."""
    holdout_window: int = Field(default=1000, ge=1)
    """The most recent held-out labels a candidate version is judged on."""
    min_holdout_rows: int = Field(default=50, ge=1)
    """Fewer held-out labels than this: the log-loss check is skipped (the golden checks still run)."""
    max_logloss_increase: float = Field(default=0.005, ge=0)
    """A candidate whose held-out log-loss exceeds the serving version's by more is reverted."""
    max_golden_shift: float = Field(default=0.2, gt=0, le=1)
    """A candidate that moves any golden-row score by more than this in one mini-batch is reverted."""
    max_coef_step: float = Field(default=0.25, gt=0)
    """Cap on the L2 norm of one mini-batch's change to (coefficients, intercept); a larger step is
    scaled down to it (a guard rail against poisoned labels; on the demo data an honest batch of 1,000
    labels moves about 0.03, a batch of 1,000 flipped labels about 0.7)."""
    max_drift: float = Field(default=0.5, gt=0)
    """Cap on the L2 norm of the TOTAL change of (coefficients, intercept) from the served baseline (the
    version last adopted: the YAML's or a swap's), across every batch since. A candidate past it is not
    served: learning pauses (labels stay pending), ``riskserve learning`` says why and the
    ``riskserve_learning_paused`` gauge fires; a swap (adopting a reviewed version) resumes it."""
    max_drift_logloss: float = Field(default=0.01, gt=0)
    """Cap on the candidate's log-loss on the baseline's golden rows, scored against the baseline's own
    probabilities, above the baseline's (the mean KL divergence from the baseline on a fixed reference
    set): catches drift through the scaler, which the coefficient norm does not see. Past it: as
    ``max_drift``."""
    update_scaler: bool = True
    """Whether mini-batches also update the scaler's running mean and variance."""
    artifact_dir: Path | None = None
    """Where learned versions are written (one verifiable artifact each); default: ``<audit.path>.learned/
    <model>``, beside the audit trail (the feedback service and the ingress replicas share its file system,
    so the replicas can load what the learner writes). A node lacking a version rebuilds it here from its
    checkpoint in the state database."""
    keep_versions: int = Field(default=50, ge=2)
    """Learned artifacts kept on disk (the serving one is always kept)."""


class SigningSpec(_Strict):
    """Ed25519 signatures on model artifacts: every artifact a model loads (the YAML's, a swap candidate)
    must carry ``manifest.json.sig`` made with the private half of ``public_key``; it is checked before
    anything of the artifact is read. An online model's learned versions (written by the server in its
    own directory) are exempt."""

    public_key: Path
    """PEM file of the Ed25519 public key (``openssl pkey -in key.pem -pubout``); relative to the YAML."""


class FeedbackSpec(_Strict):
    """How labels for online learning are admitted and kept. They are kept in the pipeline's state
    database (``state``: durable on commit, shared by every node), and the decisions they label are the
    audit trail's records (the pipeline needs an enabled ``audit`` section)."""

    retention_hours: float = Field(default=168, gt=0)
    """How long after a decision a label for it is taken (joined to its audit record)."""
    source_rate_per_s: float = Field(default=50, gt=0)
    """Labels per second one source (the caller's identity when the front door authenticates, else
    ``FeedbackRequest.source``) may send, on average."""
    source_burst: int = Field(default=500, ge=1)
    """Labels one source may send at once before its rate applies."""
    total_rate_per_s: float = Field(default=200, gt=0)
    """Labels per second ALL sources together may send: inventing sources does not buy more labels."""
    total_burst: int = Field(default=2000, ge=1)
    """Labels all sources together may send at once before ``total_rate_per_s`` applies."""
    pool: str | None = None
    """Pool of the feedback service (one replica: it runs the learners); default: the first pool."""
    num_cpus: float = Field(default=0.25, ge=0)

    @property
    def stage(self) -> StageSpec:
        """Placement of the feedback service: one replica, the one learner of each online model."""
        return StageSpec(pool=self.pool, num_cpus=self.num_cpus, replicas=1)


class AuditSpec(_Strict):
    """The decision audit trail: every decision kept durably, off the request path
    (:mod:`riskserve.audit`): in the pipeline's state database (``state``), shipped in small batched
    transactions by a background thread of each ingress replica from its journal on the node's disk."""

    enabled: bool = True
    """Keep the trail (``false``: decisions are not kept; the section documents where they would be)."""
    path: Path | None = None
    """Directory of the replicas' journals on each node's local disk (mode 0700; its files 0600: they hold
    the requests' input fields): what is not shipped to the database yet. A relative path is relative to
    the YAML. Every ingress replica on a node takes a slot of its own in it. Default: ``journal/<pipeline>``
    in the state directory of the node the replica runs on (``RISKSERVE_STATE_DIR`` where it started)."""
    retention_days: float = Field(default=1825, gt=0)
    """Records older than this are purged, a few hundred rows per transaction."""
    buffer: int = Field(default=10_000, ge=1)
    """Records an ingress replica holds in memory for the writer; past it they stay only in the journal
    (spilled) until the database takes records again."""
    flush_ms: float = Field(default=100, gt=0, le=10_000)
    """The writer ships what is buffered to the database this often (sooner when ``batch_rows`` are
    waiting): about what a lost node loses."""
    batch_rows: int = Field(default=512, ge=1, le=100_000)
    """Records per write transaction at most, so the writer never holds the database long."""
    write_ahead: bool = True
    """Append each record to the replica's journal (one ``write`` to the kernel) before the decision is
    answered, so an answered decision survives ``kill -9`` of the replica (not a power loss: no fsync).
    ``false``: records wait in memory, and those still there when the process dies are lost uncounted."""
    spill_mb: float = Field(default=256, gt=0)
    """Bound of the journal on disk (records not yet in the store); past it records are dropped and counted
    (``riskserve_audit_records_total{outcome="dropped"}``) and logged."""
    purge_rows: int = Field(default=500, ge=1, le=100_000)
    """Rows deleted per retention transaction."""


class StateSpec(_Strict):
    """Where what must survive a node lives: the versions record, the feedback log, the audit trail and
    learner checkpoints in one database, and learned model versions in one artifact store."""

    dsn: str | None = None
    """``postgresql://USER@HOST[:PORT]/DB`` for a cluster, or ``sqlite:///ABSOLUTE/PATH``. Default:
    ``$RISKSERVE_STATE_DSN``, else an embedded SQLite file in the install's state directory (one machine).
    Put a password in ``dsn_file`` or the environment, not here."""
    dsn_file: Path | None = None
    """A file holding the DSN (a mounted secret), read by every process that opens the store."""
    artifacts: str | None = None
    """Where learned versions are written: a directory every node mounts or an ``fsspec`` URI
    (``s3://bucket/prefix``). Default: ``$RISKSERVE_ARTIFACT_STORE``, else each online model's
    ``artifact_dir`` (one machine)."""

    def resolve_dsn(self, default_name: str = "riskserve") -> str:
        """The DSN: ``dsn``, else the one in ``dsn_file``, else ``$RISKSERVE_STATE_DSN``, else a SQLite file
        ``<state dir>/state/<default_name>.sqlite``.

        Raises:
            ConfigError: ``dsn_file`` cannot be read.
        """
        if self.dsn is not None:
            return self.dsn
        if self.dsn_file is not None:
            try:
                return self.dsn_file.read_text().strip()
            except OSError as error:
                raise ConfigError(f"state.dsn_file: cannot read {self.dsn_file}: {error}") from error
        from_env = os.environ.get("RISKSERVE_STATE_DSN")
        if from_env:
            return from_env
        return f"sqlite:///{default_state_dir() / 'state' / default_name}.sqlite"


class BatchingSpec(_Strict):
    """Adaptive batching of a model in its own deployment (Serve's ``@serve.batch``): concurrent decisions'
    inputs reach the backend as one call of up to ``max_batch_size`` items, waiting at most ``max_wait_ms``
    for the batch to fill."""

    max_batch_size: int = Field(default=16, ge=1, le=1024)
    max_wait_ms: float = Field(default=2.0, ge=0, le=1000)
    max_concurrent_batches: int = Field(default=2, ge=1, le=64)
    """Batches in the backend at once (Serve's ``max_concurrent_batches``). With 1 (Serve's default), a batch
    waits for the one in front of it: ``card_fraud`` at c=8 held 0.5-0.8x the decisions/s of no batching.
    With 2 the next batch forms while one is in the engine, whose continuous batching (riskserve's vLLM
    driver adds every waiting text to its next step) merges them: 0.9-1.3x (BENCHMARKS.md)."""
    wait_only_when_busy: bool = True
    """A batch waits up to ``max_wait_ms`` only while an earlier batch is in the backend; one that would
    find the backend idle leaves at once with what is queued. At an idle engine the wait only delays the
    first text (``card_fraud`` at c=1: 17.6 against 12.3 ms p50 unbatched at 12:45); while the engine
    steps, a text waits for the step anyway and the batch fills meanwhile. ``false``: Serve's own rule,
    every batch may wait ``max_wait_ms``."""


Placement = Literal["ingress", "deployment"]
_DEFAULT_PLACEMENT: dict[str, Placement] = {"treelite": "ingress", "sklearn": "ingress", "vllm": "deployment"}
"""Where each built-in kind runs unless the YAML says; any other (a test's) kind: its own deployment."""


class ModelSpec(_Strict):
    """One model of the pipeline and how it is served."""

    kind: Annotated[str, AfterValidator(known_kind)]
    """Backend: ``treelite``, ``sklearn`` or ``vllm`` (or a test-only kind its test registered)."""
    artifact: Path
    """Artifact directory; a relative path is relative to the YAML file."""
    pool: str
    """Name of the pool the model's replicas are placed on."""
    replicas: int = Field(default=1, ge=1, le=64)
    num_cpus: float = Field(default=1.0, ge=0)
    """CPUs each replica takes from its pool."""
    num_gpus: float = Field(default=0, ge=0, le=8)
    """GPUs (fractions allowed) each replica takes from its pool."""
    timeout_ms: float = Field(gt=0, le=60_000)
    """Budget of one call; past it the fallback is used."""
    fallback: FallbackSpec
    columns: list[str] | Literal["all"] = "all"
    """Feature columns the model reads, in order (tabular models)."""
    settings: dict[str, Any] = Field(default_factory=dict)
    """Backend settings (see each wrapper's settings class), checked when the pipeline is validated."""
    max_ongoing_requests: int = Field(default=16, ge=1)
    """Requests one replica works on at once."""
    max_queued_requests: QueueLimit = 64
    """Requests waiting for a replica before the call is refused (-1: unbounded); a refused model call
    gets the fallback (reason OVERLOADED)."""
    breaker: BreakerSettings
    """The model's circuit breaker (semantics and checks in :mod:`riskserve.platform.breaker`, the same
    settings class, so a bad value fails here at load); ``slow_call_ms`` defaults to ``timeout_ms``."""
    health_check_period_s: float = Field(default=1.0, gt=0, le=600)
    """How often Serve asks each replica whether it is healthy (see :class:`StageSpec`)."""
    health_check_timeout_s: float | None = Field(default=None, gt=0, le=600)
    """A check unanswered this long fails; three failures in a row and Serve replaces the replica (a hung
    process too). Default 3 s, 10 s for an LLM (its engine shares the replica's CPU)."""
    online: OnlineLearningSpec | None = None
    """Learn from the pipeline's feedback (scikit-learn models; needs the pipeline's ``feedback``)."""
    placement: Placement | None = None
    """``ingress``: the model runs inside every ingress replica, a function call on the matrix the feature
    stage just built (no Serve hop); ``deployment``: its own Serve deployment with its own replicas, pool
    and GPU share. Default: ``ingress`` for ``treelite`` and ``sklearn``, ``deployment`` for ``vllm``. An
    LLM placed in the ingress runs an engine in every ingress replica (no lane round trip, no second
    process to wake, but each replica carries the engine's memory and CPU, and Serve does not batch it)."""
    batching: BatchingSpec | None = None
    """Adaptive batching across concurrent decisions (models in their own deployment only)."""

    @model_validator(mode="before")
    @classmethod
    def _slow_call_default(cls, data: Any) -> Any:
        """A call slower than the model's timeout is slow unless the breaker says otherwise."""
        if not isinstance(data, dict):
            return data  # pydantic reports the type error
        breaker = data.get("breaker", {})
        if not isinstance(breaker, dict) or "slow_call_ms" in breaker:
            return data
        timeout = data.get("timeout_ms")
        valid = isinstance(timeout, int | float) and not isinstance(timeout, bool) and timeout > 0
        # without a valid timeout_ms its own error is reported; 1.0 only stands in so it is the one error
        return {**data, "breaker": {**breaker, "slow_call_ms": timeout if valid else 1.0}}

    @property
    def in_ingress(self) -> bool:
        """Whether the model runs inside the ingress replicas (its placement, or its kind's default)."""
        return (self.placement or _DEFAULT_PLACEMENT.get(self.kind, "deployment")) == "ingress"

    @property
    def health_check_timeout(self) -> float:
        """The health check timeout, or its default for this kind of model."""
        if self.health_check_timeout_s is not None:
            return self.health_check_timeout_s
        return LLM_HEALTH_CHECK_TIMEOUT_S if self.reads_text else DEFAULT_HEALTH_CHECK_TIMEOUT_S

    @functools.cached_property
    def reads_text(self) -> bool:
        """Whether the model is fed the request text (LLMs) instead of the feature matrix (read per call:
        worked out once, from the artifacts its backend serves)."""
        if self.kind in _DEFAULT_PLACEMENT:
            return self.kind == "vllm"
        model_class, _ = backend(self.kind)  # a wrapping (test) backend serves another kind's artifacts
        return model_class.artifact_kind(self.settings) == "vllm"


class ReasonsSpec(_Strict):
    """Reason codes: the input fields that pushed a decision's score up, in words, for the outcomes listed
    (computation in :mod:`riskserve.serving.reasons`). A decision of another outcome computes nothing.

    Tabular models placed in the ingress attribute their log-odds exactly to their columns (the logistic
    regression: coefficient × scaled value; XGBoost: TreeSHAP), summed back to the request field each
    column was computed from; the text model gives its label and score when the label has a text here.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    top: int = Field(default=4, ge=1, le=32)
    """Reasons per decision at most, strongest first, each naming a different field."""
    for_: list[Outcome] = Field(default=["DECLINE", "REVIEW"], alias="for", min_length=1)
    """Outcomes whose decisions carry reasons (written ``for:`` in YAML)."""
    texts: dict[str, str] = Field(default_factory=dict)
    """Per request field, the words a customer notice or an analyst reads (``amount: "amount unusually
    high for this account"``); a field without a text is named as it is."""
    labels: dict[str, str] = Field(default_factory=dict)
    """Per label of the text model, the words of its reason (``urgent: "message pressures for speed"``);
    a label not listed here is no reason."""
    models: list[str] | None = None
    """Models whose contributions count; default: every model placed in the ingress that can attribute its
    score, and the text model."""
    min_contribution: float = Field(default=0.0, ge=0)
    """A field whose contribution (log-odds) is at or below this is not a reason."""


class StageSpec(_Strict):
    """Placement of a pipeline's own deployments (the feature stage, the ingress)."""

    pool: str | None = None
    """Pool to place it on; default: the first pool declared."""
    num_cpus: float = Field(default=0.25, ge=0)
    replicas: int = Field(default=1, ge=1, le=64)
    max_ongoing_requests: int = Field(default=64, ge=1)
    max_queued_requests: QueueLimit = 256
    health_check_period_s: float = Field(default=1.0, gt=0, le=600)
    """How often Serve asks each replica whether it is healthy."""
    health_check_timeout_s: float = Field(default=DEFAULT_HEALTH_CHECK_TIMEOUT_S, gt=0, le=600)
    """A check unanswered this long fails; after three failures in a row Serve kills the replica and
    starts another, so a hung replica (a stopped or deadlocked process) is replaced within about
    ``3 * (period + timeout)`` (Serve's defaults, 10 s and 30 s, took two minutes)."""


class IngressSpec(StageSpec):
    """Placement of the ingress: two replicas by default, so that a crash of one costs only the calls in
    flight on it (its peer shares the port and keeps answering while Serve replaces it); one replica
    saves about 300 MB and an event loop, and makes every crash an outage of several seconds."""

    replicas: int = Field(default=2, ge=1, le=64)
    max_replicas_per_node: int | None = Field(default=None, ge=1)
    """At most this many ingress replicas on one Ray node (Serve's ``max_replicas_per_node``): ``1`` spreads
    them so that every node that takes traffic runs a front door, and losing a node loses one replica."""
    event_loop: Literal["shared", "separate"] = "shared"
    """``shared`` (default): the front door and the decisions run on the event loop Serve's replica runs
    on (Serve's ``RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD=0``, set in the ingress replicas' runtime
    env). Serve starts a grpc.aio server of its own in every replica, and grpc.aio wakes every event loop
    that holds a server for each of the front door's events: with two loops, each call woke both and
    the second handed it over. One loop cost 0.19-0.38 CPU-ms less per decision (0.69-0.82x) in three
    alternated rounds of a c=8 load (BENCHMARKS.md). ``separate``: Serve's default, user code on a loop
    of its own."""


class TlsSpec(_Strict):
    """TLS of the gRPC endpoint; PEM files, relative paths against the YAML file's directory."""

    cert_file: Path
    """The server's certificate chain."""
    key_file: Path
    """The server's private key (keep it 0600)."""
    client_ca_file: Path | None = None
    """Set: mutual TLS, every client must present a certificate signed by this CA (else no handshake)."""


class AuthSpec(_Strict):
    """Bearer tokens on the gRPC endpoint (format in :mod:`riskserve.serving.tokens`): each token has an
    identity and roles (``decide``, ``feedback``). Health and reflection stay open."""

    tokens_file: Path | None = None
    """The token table (mode 0600); re-read when it changes, so tokens are added and revoked live."""
    tokens_env: str | None = Field(default=None, pattern=r"^[A-Z_][A-Z0-9_]*$")
    """Or: an environment variable of the ingress processes holding the table (read once at start)."""
    reload_s: float = Field(default=1.0, gt=0, le=3600)
    """How often the file is checked for a change (a ``stat``; never on the call path)."""

    @model_validator(mode="after")
    def _one_source(self) -> AuthSpec:
        if (self.tokens_file is None) == (self.tokens_env is None):
            raise ValueError("give exactly one of 'tokens_file' and 'tokens_env'")
        return self


_LOOPBACK = ("127.0.0.1", "::1", "localhost")


class FrontDoorSpec(_Strict):
    """riskserve's own gRPC endpoint, served by every ingress replica (replicas on one node share the port
    through ``SO_REUSEPORT``). One port per pipeline: a call naming another pipeline gets ``NOT_FOUND``."""

    host: str = "127.0.0.1"
    """Address to bind; loopback unless the operator opens it (``0.0.0.0`` for every interface)."""
    port: int = Field(default=9000, ge=1, le=65535)
    """Port of this pipeline (``riskserve up --grpc-port`` overrides it)."""
    tls: TlsSpec | None = None
    """Serve TLS (and mutual TLS with ``client_ca_file``); plain text when absent."""
    auth: AuthSpec | None = None
    """Require a bearer token with the method's role on every call; open to every caller when absent."""
    max_receive_message_bytes: int = Field(default=1024 * 1024, ge=1024, le=256 * 1024 * 1024)
    """Largest request accepted; a larger one gets RESOURCE_EXHAUSTED before it is parsed."""
    max_send_message_bytes: int = Field(default=16 * 1024 * 1024, ge=1024, le=256 * 1024 * 1024)
    max_batch: int = Field(default=1024, ge=1, le=65536)
    """Most requests in one ``DecideBatch`` (more: INVALID_ARGUMENT naming ``requests``)."""
    max_id_chars: int = Field(default=128, ge=1, le=4096)
    """Longest ``request_id`` and ``feedback_id`` (longer: INVALID_ARGUMENT naming the field)."""
    max_source_chars: int = Field(default=128, ge=1, le=4096)
    """Longest ``source`` of a label."""
    max_text_chars: int = Field(default=4000, ge=1, le=1_000_000)
    """Longest ``text`` of a request, whatever the pipeline's features (they may cap it lower)."""
    max_features: int = Field(default=256, ge=1, le=100_000)
    """Most numeric plus categorical entries in one request (each name and value at most
    ``max_text_chars``)."""
    max_concurrent_calls: int = Field(default=128, ge=1, le=100_000)
    """Calls in progress in one ingress replica, every method and connection together (health ``Watch``
    streams count while open); one more is refused with RESOURCE_EXHAUSTED ("Concurrent RPC limit
    exceeded!", by grpc before any handler runs: nothing ran), so an overload is a retryable refusal instead
    of a queue that outgrows its callers' deadlines. The refusal too waits its turn to be taken from grpc
    by the replica's event loop, one call at a time (see ``max_queue_wait_ms``). The admission limit of
    decisions (``serving.ingress`` ``max_ongoing_requests`` + ``max_queued_requests``) applies within it."""
    max_queue_wait_ms: float = Field(default=250, ge=0, le=60_000)
    """Overload shedding: while calls reach an ingress replica's handlers having waited more than this in
    front of them (every call of the last 200 ms did: a queue that stands, not a burst), a decision that
    waited that long is refused at once with RESOURCE_EXHAUSTED (0: off). Past capacity the queue forms
    inside grpc, before any handler, where neither ``max_concurrent_calls`` nor the loop lag sees it, until
    the calls' deadlines pass; refusing drains it. Measured for calls that send their budget in
    ``riskserve-timeout-ms`` beside their gRPC deadline (``RiskClient`` does, both from one timeout): the
    budget less what is left of the deadline."""
    max_loop_lag_ms: float = Field(default=250, ge=0, le=60_000)
    """Overload shedding: while an ingress replica's event loop runs more than this behind (two probes 50 ms
    apart in a row, so one moment without a CPU is not an overload), it refuses new decisions at once with
    RESOURCE_EXHAUSTED instead of letting them wait out their deadlines in front of it (0: off). A refusal
    costs a fraction of a decision, so past capacity the replica keeps deciding at about its capacity and
    refuses the rest promptly."""
    max_concurrent_streams: int = Field(default=256, ge=1, le=10_000)
    """Calls in flight on one HTTP/2 connection (``grpc.max_concurrent_streams``), the last line behind
    ``max_concurrent_calls``; more wait in the client or are refused with UNAVAILABLE (HTTP/2
    REFUSED_STREAM, safe to retry: nothing ran)."""
    max_watch_streams_per_client: int = Field(default=4, ge=1, le=1000)
    """Open health ``Watch`` streams per client address; more get RESOURCE_EXHAUSTED."""
    max_connection_idle_s: float = Field(default=300, gt=0, le=86_400)
    """A connection with no call for this long is closed (``grpc.max_connection_idle_ms``)."""
    reflection: bool = True
    """Serve gRPC server reflection (``grpcurl list`` works without the proto)."""
    drain_s: float = Field(default=5.0, ge=0, le=300)
    """At shutdown: health NOT_SERVING, no new calls, calls in flight get this long to finish."""

    @model_validator(mode="after")
    def _tokens_need_tls_off_loopback(self) -> FrontDoorSpec:
        if self.auth is not None and self.tls is None and self.host not in _LOOPBACK:
            raise ValueError(
                f"bearer tokens on {self.host} without 'tls' would cross the network in plain text: "
                "add serving.grpc.tls, or bind loopback"
            )
        return self


class ServingSpec(_Strict):
    """How the pipeline's own stages are served."""

    grpc: FrontDoorSpec = FrontDoorSpec()
    features: StageSpec = StageSpec()
    ingress: IngressSpec = IngressSpec()
    access_log: bool = False
    """Ray Serve's per-request access log lines; off by default, they cost CPU on every hop."""
    feature_stage: Literal["deployment", "ingress"] = "ingress"
    """Where requests are validated and encoded, once per request batch either way: ``ingress`` (default),
    inside each ingress replica, so models placed in the ingress read the matrix in process with no copy;
    ``deployment``, a Serve deployment of its own (placed by ``serving.features``, scaled apart from the
    ingress), one Serve hop more per decision."""
    inline_rows: int = Field(default=64, ge=0, le=1_000_000)
    """Batches up to this many rows are scored by in-ingress models on the event loop (tens of µs); larger
    ones go to a worker thread, so the front door keeps answering other calls. (Validation and encoding,
    pure Python that a thread cannot run beside the loop, stay on the loop up to 1,024 rows.)"""
    by_value_rows: int = Field(default=1024, ge=0, le=1_000_000)
    """A model in its own deployment gets a matrix of up to this many rows by value in the call; a larger
    one through Ray's shared-memory object store (``ray.put`` once, read without a copy). Measured here
    (``bench/crossover.py``): by value is never slower up to 16,384 rows (Ray moves an argument over
    100 KiB through shared memory itself) and a ``ray.put`` in a replica costs 1-1.7 ms, so the store pays
    only when several remote models read one large matrix (from about 2,500 rows)."""
    model_lanes: bool = True
    """Call a model in its own deployment through its replicas' loopback gRPC lanes when they run on the
    ingress's node (about 0.5 ms a call instead of a Serve handle's 6 ms here; see
    ``riskserve/serving/model_lane.py``); off, or for replicas on other nodes, through the handle."""
    decision_timeout_ms: float = Field(default=5000, gt=0, le=600_000)
    """Longest a decision may take when the caller sets no shorter deadline (``riskserve-timeout-ms``
    metadata, which RiskClient sends from its gRPC timeout); past it the call is DEADLINE_EXCEEDED."""

    @property
    def matrix_retain_s(self) -> float:
        """How long the feature stage holds each matrix it puts: past the longest decision (see
        :class:`~riskserve.features.stage.FeatureStage` on why it must)."""
        return max(10.0, 2 * self.decision_timeout_ms / 1e3)


class PipelineSpec(_Strict):
    """A whole risk-decision pipeline."""

    name: str = Field(pattern=_NAME)
    """Also the Ray Serve application name, chosen by the gRPC ``application`` metadata."""
    version: str = Field(min_length=1)
    description: str = ""
    features: FeatureSpec
    models: dict[str, ModelSpec] = Field(min_length=1)
    pools: dict[str, PoolSpec] = Field(min_length=1)
    decision: DecisionSpec
    serving: ServingSpec = ServingSpec()
    tracing: TracingSettings = TracingSettings()
    """OpenTelemetry export: ``none`` (ids only), ``console``, ``file`` (JSON lines) or ``otlp``."""
    feedback: FeedbackSpec | None = None
    """Keep decisions and accept labels (the ``Feedback`` RPC) for online learning."""
    signing: SigningSpec | None = None
    """Require Ed25519-signed artifact manifests (see :class:`SigningSpec`); default: checksums only."""
    models_root: Path | None = None
    """The only directory ``riskserve swap`` takes candidates from (symlinks resolved); a model's own
    YAML artifact and its learned versions are always accepted. Default: the directory that holds the
    model's YAML artifact (``models/`` for ``models/fraud``). A relative path is relative to the YAML."""
    state: StateSpec = Field(default_factory=StateSpec)
    """Where the pipeline's durable state lives (one machine by default; PostgreSQL for a cluster)."""
    audit: AuditSpec | None = None
    """The decision audit trail (``riskserve audit show/export``); absent: decisions are not kept."""
    reasons: ReasonsSpec | None = None
    """Reason codes with the decisions of the outcomes listed (``top``, ``for``, per-field ``texts``)."""
    base_dir: Path = Field(default=Path("."), exclude=True)
    """Directory relative artifact paths are resolved against (the YAML file's; not written in YAML)."""

    def _relative(self, path: Path) -> Path:
        """``path`` made absolute against the YAML file's directory."""
        return path if path.is_absolute() else (self.base_dir / path).resolve()

    def artifact_path(self, model: str) -> Path:
        """Absolute artifact directory of a model."""
        return self._relative(self.models[model].artifact)

    def runner_settings(self, model: str) -> dict[str, Any]:
        """The settings a model's runner loads it with: the YAML's, plus the signature requirement."""
        settings = dict(self.models[model].settings)
        if self.signing is not None:
            from riskserve.platform.artifacts import load_public_key

            settings["manifest_public_key"] = load_public_key(self._relative(self.signing.public_key)).hex()
            if self.models[model].online is not None:
                settings["unsigned_root"] = str(self.learned_dir(model))
        return settings

    def candidate_root(self, model: str) -> Path:
        """Absolute directory swap candidates of ``model`` must be inside (see ``models_root``)."""
        if self.models_root is not None:
            return self._relative(self.models_root)
        return self.artifact_path(model).parent

    def audit_dir(self) -> Path:
        """Absolute directory of the audit trail (the pipeline must have ``audit``)."""
        if self.audit is None:
            raise ConfigError(f"pipeline '{self.name}' has no audit section")
        if self.audit.path is None:  # resolved in each process: each node's own disk
            return default_state_dir() / "journal" / self.name
        return self._relative(self.audit.path)

    def state_dsn(self) -> str:
        """The state database's DSN (:meth:`StateSpec.resolve_dsn`; ``dsn_file`` from the YAML's folder)."""
        state = self.state
        if state.dsn is None and state.dsn_file is not None:
            state = state.model_copy(update={"dsn_file": self._relative(state.dsn_file)})
        return state.resolve_dsn(default_name=self.name)

    def learned_dir(self, model: str) -> Path:
        """Absolute directory of a model's learned versions: the YAML's ``artifact_dir``, else
        ``<audit dir>.learned/<model>`` (see :attr:`OnlineLearningSpec.artifact_dir` for why there)."""
        online = self.models[model].online
        if online is not None and online.artifact_dir is not None:
            return self._relative(online.artifact_dir)
        audit = self.audit_dir()
        return audit.with_name(f"{audit.name}.learned") / model

    def front_door(self) -> FrontDoorSpec:
        """``serving.grpc`` with its TLS and tokens files made absolute against the YAML file's directory."""
        front = self.serving.grpc
        update: dict[str, Any] = {}
        if front.tls is not None:
            tls = front.tls
            client_ca = self._relative(tls.client_ca_file) if tls.client_ca_file is not None else None
            update["tls"] = tls.model_copy(update={
                "cert_file": self._relative(tls.cert_file), "key_file": self._relative(tls.key_file),
                "client_ca_file": client_ca,
            })  # fmt: skip
        if front.auth is not None and front.auth.tokens_file is not None:
            tokens = self._relative(front.auth.tokens_file)
            update["auth"] = front.auth.model_copy(update={"tokens_file": tokens})
        return front.model_copy(update=update)

    def rule_scope(self) -> RuleScope:
        """What the decision rules see of this pipeline (see :class:`~riskserve.schema.rules.RuleScope`)."""
        review = frozenset(name for name, m in self.models.items() if m.fallback.review)
        return RuleScope(self.name, self.decision, self.features, tuple(self.models), review)

    def decision_engine(self) -> DecisionEngine:
        """The compiled decision: its CEL rules, and a REVIEW forced by the fallback of a model that asks."""
        return DecisionEngine(self.rule_scope())

    def online_models(self) -> list[str]:
        """Models that learn from feedback."""
        return [name for name, model in self.models.items() if model.online is not None]

    def model_columns(self, model: str) -> list[str]:
        """Feature columns a model reads, in order ("all" expanded)."""
        columns = self.models[model].columns
        return self.features.column_names() if columns == "all" else list(columns)

    def runner_columns(self, model: str) -> tuple[list[str] | None, list[str] | None]:
        """What a model's runner is given, wherever it runs: the shared matrix's columns and those the
        model reads (both ``None`` for a text model, which is fed the request's text)."""
        if self.models[model].reads_text:
            return None, None
        return self.features.column_names(), self.model_columns(model)

    @staticmethod
    def pool_resource(pool: str) -> str:
        """Ray custom resource that stands for a pool's capacity."""
        return f"riskserve_pool_{pool}"

    def stage_pool(self, stage: StageSpec) -> str:
        """The pool a pipeline stage runs on."""
        return stage.pool or next(iter(self.pools))

    def ingress_health_check_timeout(self) -> float:
        """The ingress's health check timeout: its own, raised to an LLM's default when an LLM runs in the
        ingress and the YAML did not set one (its engine shares the replica's CPU and interpreter)."""
        ingress = self.serving.ingress
        if "health_check_timeout_s" in ingress.model_fields_set:
            return ingress.health_check_timeout_s
        if any(model.in_ingress and model.reads_text for model in self.models.values()):
            return max(ingress.health_check_timeout_s, LLM_HEALTH_CHECK_TIMEOUT_S)
        return ingress.health_check_timeout_s

    def resolved(self) -> dict[str, Any]:
        """The spec as plain data with absolute artifact paths, for passing to Serve deployments."""
        data = self.model_dump(mode="json")
        for name in self.models:
            data["models"][name]["artifact"] = str(self.artifact_path(name))
        if self.feedback is not None:
            for name in self.online_models():
                data["models"][name]["online"]["artifact_dir"] = str(self.learned_dir(name))
        if self.audit is not None and self.audit.path is not None:
            data["audit"]["path"] = str(self.audit_dir())
        if self.state.dsn_file is not None:  # every process reads the secret itself
            data["state"]["dsn_file"] = str(self._relative(self.state.dsn_file))
        else:  # resolved once, by the deployer, so every replica opens the same store
            data["state"]["dsn"] = self.state_dsn()
        data["state"]["artifacts"] = self.state.artifacts or os.environ.get("RISKSERVE_ARTIFACT_STORE")
        if self.tracing.file_path is not None:
            data["tracing"]["file_path"] = str(self._relative(self.tracing.file_path))
        if self.models_root is not None:
            data["models_root"] = str(self._relative(self.models_root))
        if self.signing is not None:
            data["signing"]["public_key"] = str(self._relative(self.signing.public_key))
        data["serving"]["grpc"] = self.front_door().model_dump(mode="json")
        return data


def _path(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(top level)"


def _reference_errors(spec: PipelineSpec) -> list[str]:

    errors: list[str] = []
    stage_pools = {
        f"serving.{name}.pool": getattr(spec.serving, name).pool for name in ("features", "ingress")
    }
    if spec.feedback is not None:
        stage_pools["feedback.pool"] = spec.feedback.pool
    for where, pool in stage_pools.items():
        if pool is not None and pool not in spec.pools:
            errors.append(f"{where}: unknown pool '{pool}' (pools: {', '.join(spec.pools)})")
    if spec.feedback is not None:
        if spec.audit is None or not spec.audit.enabled:
            errors.append(
                "audit: a pipeline with 'feedback' needs an enabled audit trail (labels are joined to its "
                "records; the feedback log keeps no copy of the decisions)"
            )
        elif spec.audit.retention_days * 24 < spec.feedback.retention_hours:
            errors.append(
                f"audit.retention_days: {spec.audit.retention_days:g} days is shorter than "
                f"feedback.retention_hours ({spec.feedback.retention_hours:g} h): a label would find no "
                "decision"
            )
    columns = set(spec.features.column_names())
    for name, model in spec.models.items():
        where = f"models.{name}"
        if model.pool not in spec.pools:
            errors.append(f"{where}.pool: unknown pool '{model.pool}' (pools: {', '.join(spec.pools)})")
        if model.columns != "all":
            missing = [c for c in model.columns if c not in columns]
            if missing:
                errors.append(f"{where}.columns: not produced by the features: {missing}")
        if model.online is not None and model.kind != "sklearn":
            errors.append(f"{where}.online: only sklearn models learn online, this one is '{model.kind}'")
        if model.online is not None and spec.feedback is None:
            errors.append(f"{where}.online: needs the pipeline's 'feedback' section (where labels are kept)")
        if model.fallback.label is not None and not model.reads_text:
            errors.append(f"{where}.fallback.label: only text models have labels")
        if model.in_ingress:
            ingress_pool = spec.stage_pool(spec.serving.ingress)
            if model.num_gpus > 0:
                errors.append(f"{where}.num_gpus: a model placed in the ingress takes no GPU share")
            if model.replicas != 1:
                errors.append(f"{where}.replicas: a model in the ingress runs in every ingress replica; "
                              "scale it with serving.ingress.replicas")  # fmt: skip
            if model.pool != ingress_pool:
                errors.append(f"{where}.pool: a model placed in the ingress runs on the ingress's pool "
                              f"'{ingress_pool}', not '{model.pool}'")  # fmt: skip
            if model.batching is not None:
                errors.append(f"{where}.batching: only models in their own deployment batch across calls")
        try:
            _, settings_class = backend(model.kind)
            settings_class.model_validate(
                {"name": name, "artifact": spec.artifact_path(name), **model.settings}
            )
        except ValidationError as error:
            for item in error.errors():
                errors.append(f"{where}.settings.{_path(item['loc'])}: {item['msg']}")
    errors += _reasons_errors(spec)
    errors += rule_errors(spec.rule_scope())
    return errors


def _reasons_errors(spec: PipelineSpec) -> list[str]:
    """A reasons section that names a field, model or placement the pipeline does not have."""
    reasons = spec.reasons
    if reasons is None:
        return []
    errors: list[str] = []
    fields = spec.features.fields
    for name in reasons.texts:
        if name not in fields:
            errors.append(f"reasons.texts.{name}: unknown field (fields: {', '.join(fields)})")
    if reasons.labels and not any(m.reads_text for m in spec.models.values()):
        errors.append("reasons.labels: the pipeline has no text model to give labels")
    for i, name in enumerate(reasons.models or []):
        model = spec.models.get(name)
        if model is None:
            errors.append(f"reasons.models[{i}]: unknown model '{name}' (models: {', '.join(spec.models)})")
        elif not model.reads_text and not (model.in_ingress and model.kind in _EXPLAINING_KINDS):
            kinds = sorted(_EXPLAINING_KINDS)
            errors.append(f"reasons.models[{i}]: '{name}' cannot give reasons (only {kinds} models placed "
                          "in the ingress, and text models)")  # fmt: skip
    return errors


_EXPLAINING_KINDS = frozenset({"treelite", "sklearn"})
"""Backends that attribute their scores to their columns (``BaseModel.explains``)."""


def parse_pipeline(data: object, *, base_dir: Path | str = ".", source: str = "pipeline") -> PipelineSpec:
    """Validate a parsed YAML document as a pipeline.

    Raises:
        ConfigError: listing every problem with its path.
    """
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping at the top level")
    try:
        spec = PipelineSpec.model_validate({**data, "base_dir": Path(base_dir)})
    except ValidationError as error:
        lines = [f"{_path(item['loc'])}: {item['msg']}" for item in error.errors()]
        raise ConfigError(f"{source}: {len(lines)} error(s)\n  " + "\n  ".join(lines)) from error
    problems = _reference_errors(spec)
    if problems:
        raise ConfigError(f"{source}: {len(problems)} error(s)\n  " + "\n  ".join(problems))
    return spec


def load_pipeline(path: Path | str) -> PipelineSpec:
    """Read and validate a pipeline YAML file; relative artifact paths resolve against its directory."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as error:
        raise ConfigError(f"{path}: cannot read the pipeline: {error}") from error
    return parse_pipeline(data, base_dir=path.parent.resolve(), source=str(path))
