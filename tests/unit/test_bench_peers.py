"""The peer benchmark's own pieces: the peers' numpy decision equals riskserve's encoder and the floor's
rules, the V2 messages round-trip, and the load generator counts a wrong answer as wrong and pauses its
own garbage collector for the measured window only."""

from __future__ import annotations

import gc
import json
from pathlib import Path

import numpy as np
import pytest
import yaml

from bench.loadgen import Tally, collector_paused, read_expected
from bench.peers.decision import BadRequest, DecisionSpec, decision_spec
from bench.peers.v2 import decision_request, outputs, pb, positive_class
from riskserve.demo.dataset import generate_transactions
from riskserve.features.encoder import FeatureEncoder, RawRequest
from riskserve.proto.riskserve.v1 import risk_pipeline_pb2 as rpb
from riskserve.schema.pipeline import load_pipeline

PIPELINE = Path(__file__).resolve().parents[2] / "deploy" / "pipelines" / "tabular_only.yaml"


@pytest.fixture
def spec() -> DecisionSpec:
    return DecisionSpec(decision_spec(yaml.safe_load(PIPELINE.read_text())))


def test_peer_encoding_equals_riskserve_encoder(spec: DecisionSpec) -> None:
    tx = generate_transactions(300, seed=7)
    requests = [tx.request_fields(i, text=False) for i in range(300)]
    requests[0]["categorical"]["channel"] = "carrier-pigeon"  # unknown category: the <unknown> column
    encoder = FeatureEncoder(load_pipeline(PIPELINE).features)
    expected = encoder.encode(
        [encoder.validate(RawRequest(numeric=r["numeric"], categorical=r["categorical"])) for r in requests]
    ).matrix
    columns = {k: [r["numeric"][k] for r in requests] for k in requests[0]["numeric"]}
    columns |= {k: [r["categorical"][k].encode() for r in requests] for k in requests[0]["categorical"]}
    assert spec.names == encoder.columns
    np.testing.assert_array_equal(spec.encode(columns, 300), expected)
    assert spec.encode(columns, 300)[0, spec.names.index("channel=<unknown>")] == 1.0


def test_peer_rules_and_bad_input(spec: DecisionSpec) -> None:
    risk, outcomes = spec.decide(np.array([0.9, 0.4, 0.1, 0.3]), np.array([0.3, 0.2, 0.1, 0.3]))
    np.testing.assert_allclose(risk, [0.6, 0.3, 0.1, 0.3])
    assert outcomes == ["DECLINE", "REVIEW", "APPROVE", "REVIEW"]
    with pytest.raises(BadRequest, match=r"^amount: -1\.0 is below the minimum 0\.01"):
        spec.encode({"amount": [-1.0]}, 1)
    with pytest.raises(BadRequest, match=r"^account_age_days: required"):
        spec.encode({"amount": [5.0]}, 1)


def test_v2_decision_request_and_raw_outputs() -> None:
    message = decision_request("decision", "r1", {"amount": [1.5, 2.5]}, {"channel": ["pos", "atm"]})
    amount, channel = message.inputs
    assert (amount.name, amount.datatype, list(amount.shape), list(amount.contents.fp64_contents)) == (
        "amount",
        "FP64",
        [2, 1],
        [1.5, 2.5],
    )
    assert list(channel.contents.bytes_contents) == [b"pos", b"atm"]
    raw = pb.ModelInferResponse(
        outputs=[
            pb.ModelInferResponse.InferOutputTensor(name="p", datatype="FP64", shape=[2, 1]),
            pb.ModelInferResponse.InferOutputTensor(name="d", datatype="BYTES", shape=[2]),
        ],
        raw_output_contents=[
            np.array([0.25, 0.75]).tobytes(),
            b"".join(len(w).to_bytes(4, "little") + w for w in (b"APPROVE", b"REVIEW")),
        ],
    )
    got = outputs(raw)
    np.testing.assert_array_equal(positive_class(got["p"]), [0.25, 0.75])
    assert got["d"] == [b"APPROVE", b"REVIEW"]
    typed = pb.ModelInferResponse(
        outputs=[
            pb.ModelInferResponse.InferOutputTensor(
                name="predict_proba",
                datatype="FP64",
                shape=[2, 2],
                contents=pb.InferTensorContents(fp64_contents=[0.9, 0.1, 0.2, 0.8]),
            )
        ]
    )
    np.testing.assert_array_equal(positive_class(outputs(typed)["predict_proba"]), [0.1, 0.8])


def test_loadgen_counts_wrong_answers(tmp_path: Path) -> None:
    path = tmp_path / "expect.json"
    path.write_text(json.dumps({"a": [0.2, 0.4, 0.3, "REVIEW"], "b": [0.1, 0.1, 0.1, "APPROVE"]}))
    expect = read_expected(path)

    def answer(request_id: str, credit: float, decision: str) -> rpb.DecideResponse:
        models = [rpb.ModelScore(model="credit", score=credit), rpb.ModelScore(model="fraud", score=0.4)]
        if request_id == "b":
            models = [rpb.ModelScore(model="credit", score=0.1), rpb.ModelScore(model="fraud", score=0.1)]
        risk = 0.3 if request_id == "a" else 0.1
        return rpb.DecideResponse(request_id=request_id, decision=decision, risk_score=risk, models=models)

    tally = Tally()
    tally.answered(0.001, [answer("a", 0.2, "REVIEW"), answer("b", 0.1, "APPROVE")], expect)
    assert (tally.decisions, tally.wrong) == (2, 0)
    tally.answered(0.001, [answer("a", 0.2002, "REVIEW")], expect)
    assert tally.wrong == 1
    assert tally.wrong_example.startswith("a: credit 0.2002")
    tally.answered(0.001, [answer("b", 0.1, "DECLINE"), answer("zz", 0.1, "APPROVE")], expect)
    assert tally.wrong == 3


def test_each_peer_row_is_its_fastest_way_and_x2_is_one_of_kserves() -> None:
    """A peer measured as gateway, runtime and two runtime processes gets one row, the way that held the
    highest rate; riskserve, the floor and plain Ray Serve keep their own rows; a wrong way never wins."""
    from bench.peers.run import rows

    def result(rate: float, per_s: float, wrong: int = 0) -> dict[str, object]:
        return {"max_rate_p99_50ms": rate, "c8": {"decisions_per_s": per_s}, "wrong": wrong}

    results = {
        "floor": result(850, 1300),
        "riskserve": result(850, 1000),
        "ray_serve": result(25, 94),
        "kserve_gateway": result(300, 404),
        "kserve_runtime": result(500, 560),
        "kserve_runtime_x2": result(700, 900),
        "mlserver_runtime": result(900, 1000, wrong=3),
        "mlserver_gateway": result(200, 396),
    }
    assert rows(results) == {
        "floor": "floor",
        "riskserve": "riskserve",
        "ray_serve": "ray_serve",
        "kserve": "kserve_runtime_x2",
        "mlserver": "mlserver_gateway",
    }


def test_loadgen_channels_are_separate_connections() -> None:
    """``--channels N`` must be N TCP connections: gRPC shares one connection among channels with the same
    target and arguments unless each has its own subchannel pool."""
    import asyncio
    import contextlib
    import socket

    from bench.loadgen import Caller

    async def connections(channels: int) -> int:
        server = socket.socket()
        server.bind(("127.0.0.1", 0))
        server.listen(16)
        server.setblocking(False)
        caller = Caller(f"127.0.0.1:{server.getsockname()[1]}", "p", channels)
        for channel in caller.channels:
            channel.get_state(try_to_connect=True)
        accepted: list[socket.socket] = []
        try:
            for _ in range(75):  # 1.5 s: every connection the channels open arrives well within it
                await asyncio.sleep(0.02)
                with contextlib.suppress(BlockingIOError):
                    accepted.append(server.accept()[0])
            return len(accepted)
        finally:
            await caller.close()
            for peer in accepted:
                peer.close()
            server.close()

    assert asyncio.run(connections(3)) == 3


def test_the_load_generator_pauses_its_own_collector_for_the_window_only() -> None:
    """A full collection in the client (23-34 ms measured) would count as the server's latency."""
    assert gc.isenabled()
    before = gc.get_freeze_count()
    with collector_paused():
        assert not gc.isenabled()
        assert gc.get_freeze_count() > before  # what existed is out of the collector's scans
    assert gc.isenabled()
    assert gc.get_freeze_count() == 0


def _window(rate: float, p99_ms: float, *, errors: int = 0, wrong: int = 0) -> dict[str, object]:
    """One open-loop window as ``bench.hotpath.open_loop`` reports it."""
    return {
        "offered_rate": rate,
        "latency_ms": {"p50": p99_ms / 3, "p99": p99_ms, "p999": p99_ms},
        "error_count": errors,
        "errors": {"RESOURCE_EXHAUSTED": errors} if errors else {},
        "wrong": wrong,
        "wrong_example": "",
        "fallback_count": 0,
        "fallbacks": {},
        "decisions": int(rate * 5),
        "decisions_per_s": rate,
    }


def _no_closed_phases(monkeypatch: pytest.MonkeyPatch) -> None:
    """The sweep tests script the open-loop windows only: no settling, and an empty closed-loop phase."""
    from bench.peers import run

    monkeypatch.setattr(run, "settle", lambda system, patience_s: 0.0)
    closed = _window(1.0, 1.0) | {"server": {"cpu_ms_per_decision": 1.0, "cores_busy": 1.0, "rss_mb": 1.0}}
    monkeypatch.setattr(run, "closed", lambda *args: closed | {"decisions": 0})


@pytest.mark.parametrize(
    ("windows", "held", "measured_twice", "checked"),
    [
        # an injected stall at 200/s: the second window holds, and the sweep goes on to 300/s
        (
            {100: [10.0], 200: [400.0, 12.0], 300: [60.0, 70.0]},
            200.0,
            [200.0, 300.0],
            500 + 1000 + 1000 + 3000,
        ),
        # the stall again on the second window: the sweep stops there
        ({100: [10.0], 200: [400.0, 380.0]}, 100.0, [200.0], 500 + 1000 + 1000),
    ],
)
def test_a_rate_failed_by_an_injected_stall_is_given_up_only_on_two_windows(
    monkeypatch: pytest.MonkeyPatch,
    windows: dict[float, list[float]],
    held: float,
    measured_twice: list[float],
    checked: int,
) -> None:
    """The open-loop sweep measures a failing rate once more before it stops, for every system, and keeps
    the failed window in the totals; the rates and p99s here are scripted, the harness is real."""
    from bench import hotpath
    from bench.peers import run

    left = {rate: list(p99s) for rate, p99s in windows.items()}
    _no_closed_phases(monkeypatch)
    monkeypatch.setattr(
        run, "open_loop", lambda system, rate, plan, connections: _window(rate, left[rate].pop(0))
    )
    system = hotpath.Running("x", "tabular_only", "127.0.0.1:1", 1, False, lambda: None, 1.0)
    sweep = run.Sweep(batches=(), rates=tuple(windows), settle_s=0.0)
    plan = run.dataclasses.replace(run.QUICK, c1_calls=0)
    out = run.measure(system, plan, sweep, (run.P99_LIMIT_MS,))
    assert out["max_rate_p99_50ms"] == held
    assert [p["offered_rate"] for p in out["open_first_tries"]] == measured_twice
    assert out["decisions_checked"] == checked
    assert all(not p for p in left.values()), "every scripted window was measured"


def test_a_wrong_answer_is_never_measured_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """A window with a wrong answer ends the sweep at once: only a stall earns a second window."""
    from bench import hotpath
    from bench.peers import run

    calls: list[float] = []
    _no_closed_phases(monkeypatch)
    monkeypatch.setattr(
        run,
        "open_loop",
        lambda system, rate, plan, connections: calls.append(rate) or _window(rate, 5.0, wrong=1),
    )
    system = hotpath.Running("x", "tabular_only", "127.0.0.1:1", 1, False, lambda: None, 1.0)
    out = run.measure(system, run.QUICK, run.Sweep(batches=(), rates=(100, 200), settle_s=0.0), (50.0,))
    assert calls == [100]
    assert out["wrong"] == 1
    assert out["max_rate_p99_50ms"] == 0.0
