"""Shared by the online-learning and hot-swap tests: decide over gRPC, label, compute the reference model,
and ask every ingress replica what it serves."""

from __future__ import annotations

import time
from typing import Any

import grpc
import numpy as np

from riskserve.client import RiskClient
from riskserve.demo.dataset import generate_transactions
from riskserve.features.encoder import FeatureEncoder, RawRequest
from riskserve.learning.feedback_log import FeedbackLog
from riskserve.learning.learner import is_holdout
from riskserve.platform.errors import RiskServeError
from riskserve.platform.runner import ModelStatus
from riskserve.proto.riskserve.v1 import risk_pipeline_pb2 as pb
from riskserve.schema.pipeline import PipelineSpec
from riskserve.state.db import open_database
from riskserve.wrappers.sklearn_model import LinearSnapshot

BATCH = 16
HOLDOUT_EVERY = 4
ONLINE: dict[str, Any] = {
    "batch_size": BATCH,
    "interval_ms": 600_000,  # only full mini-batches: their boundaries are then known in advance
    "holdout_every": HOLDOUT_EVERY,
    "min_holdout_rows": 10_000,  # honest labels here; the revert is tested in tests/unit
    "max_coef_step": 100.0,
    "max_golden_shift": 1.0,
    "max_drift": 100.0,  # the drift bound is tested in tests/unit
    "max_drift_logloss": 100.0,
}
"""The fraud model's ``online`` section in these tests."""


def reference_step(
    parent: LinearSnapshot, x: np.ndarray, y: np.ndarray, *, update_scaler: bool
) -> LinearSnapshot:
    """One mini-batch of online learning computed here, not by riskserve's ``train_step``: a plain
    scikit-learn ``StandardScaler`` and ``SGDClassifier`` set from the parent's stored numbers, then
    ``partial_fit``. Only the content version (the artifact's identity) comes from riskserve, so a bug in
    the production step (wrong rows, scaler not updated, state not carried) makes the versions differ."""
    from sklearn.linear_model import SGDClassifier
    from sklearn.preprocessing import StandardScaler

    stored = parent.params.model_dump()
    rows = np.asarray(x, dtype=np.float64)
    scaler = StandardScaler()
    scaler.mean_ = np.array(stored["scaler"]["mean"], dtype=np.float64)
    scaler.var_ = np.array(stored["scaler"]["var"], dtype=np.float64)
    scaler.scale_ = np.array(stored["scaler"]["scale"], dtype=np.float64)
    scaler.n_samples_seen_ = np.int64(stored["scaler"]["n_samples_seen"])
    scaler.n_features_in_ = rows.shape[1]
    if update_scaler:
        scaler.partial_fit(rows)
    hyper = stored["hyperparameters"]
    classifier = SGDClassifier(
        loss="log_loss",
        penalty="l2",
        alpha=hyper["alpha"],
        learning_rate=hyper["learning_rate"],
        eta0=hyper["eta0"],
        random_state=hyper["random_state"],
        shuffle=False,
    )
    classifier.classes_ = np.array([0, 1])
    classifier.coef_ = np.array([stored["coef"]], dtype=np.float64)
    classifier.intercept_ = np.array([stored["intercept"]], dtype=np.float64)
    classifier.t_ = stored["t"]
    classifier.n_features_in_ = rows.shape[1]
    classifier.partial_fit(scaler.transform(rows), np.asarray(y, dtype=np.int64))
    stored.update(
        coef=classifier.coef_.ravel().tolist(),
        intercept=float(classifier.intercept_[0]),
        t=float(classifier.t_),
        scaler={
            "mean": scaler.mean_.tolist(),
            "var": scaler.var_.tolist(),
            "scale": scaler.scale_.tolist(),
            "n_samples_seen": int(scaler.n_samples_seen_),
        },
        parent=parent.version,
    )
    return LinearSnapshot.from_params(type(parent.params).model_validate(stored))


def replica_statuses(app: str, model: str, replicas: int, *, timeout_s: float = 60) -> dict[str, ModelStatus]:
    """``model`` as each of the ``replicas`` ingress replicas of ``app`` serves it, keyed by replica actor id.

    A model placed in the ingress runs in every ingress replica; Serve's handle picks a replica per call,
    so the ingress is asked until each replica has answered.

    Raises:
        AssertionError: not every replica answered within ``timeout_s``.
    """
    from ray import serve

    handle = serve.get_deployment_handle("ingress", app_name=app)
    seen: dict[str, ModelStatus] = {}
    deadline = time.monotonic() + timeout_s
    while len(seen) < replicas:
        if time.monotonic() > deadline:
            raise AssertionError(f"only {len(seen)} of {replicas} ingress replicas answered: {sorted(seen)}")
        status: ModelStatus = handle.model_status.remote(model).result(timeout_s=30)
        seen[status.actor_id] = status
    return seen


def own_connection(target: str) -> grpc.Channel:
    """A channel with a TCP connection of its own to ``target``.

    gRPC shares one connection per target between the channels of a process, and the kernel spreads the
    ingress replicas' shared port (``SO_REUSEPORT``) per connection, not per call: clients that should
    reach several replicas need connections of their own.
    """
    return grpc.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)])


def _request(row: dict[str, float | str], request_id: str) -> pb.DecideRequest:
    numeric = {k: float(v) for k, v in row.items() if isinstance(v, float)}
    categorical = {k: str(row[k]) for k in ("merchant_category", "channel")}
    return pb.DecideRequest(request_id=request_id, numeric=numeric, categorical=categorical)


class Labels:
    """Requests decided over gRPC and the labels acknowledged for them, in acknowledgement order."""

    def __init__(self, spec: PipelineSpec, client: RiskClient) -> None:
        self.client = client
        self.spec = spec
        self.encoder = FeatureEncoder(spec.features)
        self.tx = generate_transactions(400, seed=77)
        self.requests: dict[str, pb.DecideRequest] = {}
        self.acked: list[tuple[str, str, int]] = []  # (request_id, feedback_id, label)
        self.seqs: dict[str, int] = {}

    def decide(self, start: int, count: int) -> list[pb.DecideResponse]:
        out = []
        for i in range(start, start + count):
            request = _request(self.tx.row(i), f"req-{i}")
            self.requests[request.request_id] = request
            out.append(self.client.decide_request(request))
        return out

    def send(self, start: int, count: int, *, retry_s: float = 0.0, source: str = "bank") -> None:
        """Label decisions ``start..``; with ``retry_s``, retry each (same feedback_id) until acknowledged."""
        for i in range(start, start + count):
            request_id, feedback_id, label = f"req-{i}", f"fb-{i}", int(self.tx.is_fraud[i])
            deadline = time.monotonic() + retry_s
            retried = False
            while True:
                try:
                    ack = self.client.feedback(
                        request_id=request_id, label=label, feedback_id=feedback_id, source=source
                    )
                    break
                except RiskServeError:
                    if time.monotonic() > deadline:
                        raise
                    retried = True
                    time.sleep(0.2)
            assert ack.accepted
            # A retry is a duplicate when the failed call before it had recorded the label (only its
            # answer was lost): this acknowledgement is the label's first, and it is learned once.
            if not ack.duplicate or (retried and feedback_id not in self.seqs):
                self.acked.append((request_id, feedback_id, label))
            self.seqs.setdefault(feedback_id, ack.seq)

    def reference(self, base: LinearSnapshot) -> str:
        """The version the acknowledged labels give, trained here in mini-batches of ``BATCH``."""
        assert len(self.acked) % BATCH == 0
        rows = [self.encoder.validate(_raw(self.requests[r])) for r, _, _ in self.acked]
        matrix = self.encoder.encode(rows).matrix
        labels = np.array([label for _, _, label in self.acked], dtype=np.int64)
        key = _holdout_key(self.spec)
        train = np.array([not is_holdout(f, HOLDOUT_EVERY, key) for _, f, _ in self.acked])
        snapshot = base
        for start in range(0, len(self.acked), BATCH):
            part = slice(start, start + BATCH)
            keep = train[part]
            snapshot = reference_step(snapshot, matrix[part][keep], labels[part][keep], update_scaler=True)
        return snapshot.version


def _holdout_key(spec: PipelineSpec) -> bytes:
    """The holdout key the feedback service made in the pipeline's state database when it started."""
    db = open_database(spec.state_dsn())
    try:
        return FeedbackLog(db).holdout_key()
    finally:
        db.close()


def _raw(request: pb.DecideRequest) -> RawRequest:
    return RawRequest(numeric=dict(request.numeric), categorical=dict(request.categorical), text=request.text)
