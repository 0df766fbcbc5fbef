"""``make bench``'s verdicts on issue 10's targets: which figure each one judges, against which limit."""

from __future__ import annotations

from typing import Any

from bench import hotpath

SEQUENTIAL = {"p50_c1": 1.4, "p99_c1": 2.5, "throughput_c8": 0.61, "cpu_per_decision": 1.5, "batch": 1.6}


def _verdicts(results: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {v["target"]: v for v in hotpath.targets(results, {"tabular_only": SEQUENTIAL})}


def test_the_sequential_ratios_are_judged_when_no_paired_rounds_ran() -> None:
    verdicts = _verdicts({})
    met = {key: verdicts[f"tabular_only {key}"]["met"] for key in SEQUENTIAL}
    # limits are inclusive; throughput is a floor, the rest are ceilings
    assert met == {"p50_c1": True, "p99_c1": False, "throughput_c8": True, "cpu_per_decision": True,
                   "batch": False}  # fmt: skip
    assert all("minutes after the floor" in v["source"] for v in verdicts.values())


def test_the_paired_medians_take_precedence_over_the_sequential_ratios() -> None:
    paired = {"rounds": [{}, {}, {}], "ratios_median": dict(SEQUENTIAL, batch=1.2, throughput_c8=0.59)}
    verdicts = _verdicts({hotpath.PAIRED_KEY: paired})
    assert verdicts["tabular_only batch"]["value"] == 1.2
    assert verdicts["tabular_only batch"]["met"]
    assert not verdicts["tabular_only throughput_c8"]["met"]
    assert "median of 3 rounds" in verdicts["tabular_only batch"]["source"]


def test_card_fraud_is_judged_on_the_served_engine_and_batching_on_the_issues_55_per_s() -> None:
    paired = {"rounds": [{}] * 5, "added_vs_served_ms_median": 3.01, "added_ms_median": 5.2}
    results = {"card_fraud": {"paired": paired}, "card_fraud_batched": {"c8": {"decisions_per_s": 165.0}}}
    verdicts = _verdicts(results)
    budget = verdicts["card_fraud p50 over the bare engine (ms)"]
    assert (budget["value"], budget["met"]) == (3.01, False)
    assert "+5.20 ms over its plain loop" in budget["source"]
    batched = verdicts["card_fraud_batched decisions/s at c=8, x the issue's 55/s"]
    assert (batched["value"], batched["met"]) == (3.0, True)
