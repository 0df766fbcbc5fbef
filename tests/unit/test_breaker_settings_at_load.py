"""A model's breaker settings are the platform's ``BreakerSettings``, checked when the YAML loads.

Before, the YAML had its own copy of the fields without the cross-field check, so ``window_size: 5``
(below the default ``minimum_calls: 10``) loaded and failed only when the ingress built the breaker.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from riskserve.platform.breaker import BreakerSettings
from riskserve.platform.errors import ConfigError
from riskserve.schema.pipeline import load_pipeline

PIPELINES = Path(__file__).resolve().parents[2] / "deploy" / "pipelines"


def _load_with_breaker(tmp_path: Path, breaker: dict[str, Any] | None, timeout_ms: float = 200) -> Any:
    """card_fraud.yaml, written beside the shipped one's directory layout, with the fraud model's breaker."""
    data = yaml.safe_load((PIPELINES / "card_fraud.yaml").read_text())
    for model in data["models"].values():
        model["artifact"] = str((PIPELINES / model["artifact"]).resolve())
    data["models"]["fraud"]["timeout_ms"] = timeout_ms
    if breaker is not None:
        data["models"]["fraud"]["breaker"] = breaker
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(data))
    return load_pipeline(path)


@pytest.mark.parametrize(
    ("breaker", "named"),
    [
        ({"window_size": 5}, ": Value error, minimum_calls (10) must not exceed window_size (5)"),
        ({"window_size": 0}, ".window_size: Input should be greater than or equal to 1"),
        ({"minimum_calls": 0}, ".minimum_calls: Input should be greater than or equal to 1"),
        ({"failure_rate_threshold": 0}, ".failure_rate_threshold: Input should be greater"),
        ({"failure_rate_threshold": 1.5}, ".failure_rate_threshold: Input should be less"),
        ({"slow_call_rate_threshold": 0}, ".slow_call_rate_threshold: Input should be"),
        ({"slow_call_rate_threshold": 2}, ".slow_call_rate_threshold: Input should be less"),
        ({"slow_call_ms": 0}, ".slow_call_ms: Input should be greater than 0"),
        ({"open_ms": -1}, ".open_ms: Input should be greater than 0"),
        ({"open_ms": float("nan")}, ".open_ms: Input should be a finite number"),
        ({"half_open_probes": 0}, ".half_open_probes: Input should be greater than or equal"),
        ({"windw_size": 20}, ".windw_size: Extra inputs are not permitted"),
    ],
)
def test_an_invalid_breaker_fails_at_load_naming_the_field(
    tmp_path: Path, breaker: dict[str, Any], named: str
) -> None:
    with pytest.raises(ConfigError) as info:
        _load_with_breaker(tmp_path, breaker)
    assert f"models.fraud.breaker{named}" in str(info.value)


def test_the_breaker_is_the_platforms_settings_and_slow_defaults_to_the_timeout(tmp_path: Path) -> None:
    spec = _load_with_breaker(tmp_path, None, timeout_ms=150)
    assert isinstance(spec.models["fraud"].breaker, BreakerSettings)
    assert spec.models["fraud"].breaker.slow_call_ms == 150
    assert spec.models["fraud"].breaker.window_size == BreakerSettings.model_fields["window_size"].default
    own = _load_with_breaker(tmp_path, {"slow_call_ms": 40, "window_size": 10}, timeout_ms=150)
    own = own.models["fraud"]
    assert (own.breaker.slow_call_ms, own.breaker.window_size) == (40, 10)


def test_a_bad_timeout_is_reported_once_not_again_as_the_breakers(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        _load_with_breaker(tmp_path, None, timeout_ms=0)
    message = str(info.value)
    assert "models.fraud.timeout_ms: Input should be greater than 0" in message
    assert "breaker" not in message
