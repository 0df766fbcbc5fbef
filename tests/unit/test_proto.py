"""The committed gRPC code is what protoc generates from the committed .proto (no drift)."""

from __future__ import annotations

from riskserve.proto import generate
from riskserve.proto.riskserve.v1 import risk_pipeline_pb2 as pb


def test_generated_code_matches_the_proto() -> None:
    assert generate.main(["--check"]) == 0


def test_the_contract_keeps_its_field_numbers() -> None:
    fields = {f.name: f.number for f in pb.DecideResponse.DESCRIPTOR.fields}
    assert fields == {
        "request_id": 1, "decision": 2, "risk_score": 3, "models": 4, "reasons": 5, "pipeline": 6,
        "pipeline_version": 7, "trace_id": 8, "decision_id": 9, "top_reasons": 10,
    }  # fmt: skip
    feedback = {f.name: f.number for f in pb.FeedbackRequest.DESCRIPTOR.fields}
    assert feedback == {"request_id": 1, "label": 2, "feedback_id": 3, "source": 4, "decision_id": 5}
    reason = {f.name: f.number for f in pb.Reason.DESCRIPTOR.fields}
    assert reason == {"field": 1, "text": 2, "contribution": 3, "model": 4, "value": 5}
    assert [m.name for m in pb.DESCRIPTOR.services_by_name["RiskPipeline"].methods] == [
        "Decide", "DecideBatch", "Describe", "Feedback",
    ]  # fmt: skip
    assert pb.Decision.Value("DECLINE") == 3


def test_raw_request_copies_every_map_entry_and_the_text() -> None:
    from riskserve.serving.messages import raw_request

    request = pb.DecideRequest(
        numeric={"amount": 12.5, "hour": 0.0}, categorical={"channel": "pos"}, text="refund please"
    )
    raw = raw_request(request)
    assert raw.numeric == {"amount": 12.5, "hour": 0.0}
    assert raw.categorical == {"channel": "pos"}
    assert raw.text == "refund please"
    assert type(raw.numeric) is dict  # plain dicts, not views of the message
    assert type(raw.categorical) is dict
    empty = raw_request(pb.DecideRequest())
    assert (empty.numeric, empty.categorical, empty.text) == ({}, {}, "")
