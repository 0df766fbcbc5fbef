"""The vLLM backend end to end on a real engine: the demo intent LLM, built here, served through ModelHost.

One engine serves the whole module (starting one takes ~10 s on CPU), driven by its own thread; the tests
share one event loop to call it.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import os
import shutil
import sys
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pytest

from riskserve.demo.dataset import INTENTS, intent_texts
from riskserve.platform.artifacts import open_artifact
from riskserve.platform.errors import (
    ArtifactIntegrityError,
    InvalidInput,
    MissingExtra,
    ModelLoadError,
    ModelUnavailable,
)
from riskserve.platform.host import ModelHost

pytest.importorskip("vllm")
pytest.importorskip("torch")

from riskserve.demo.intent_llm import IntentLLMReport, build_intent_llm
from riskserve.wrappers.vllm_model import VLLMModel, VLLMSettings

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

T = TypeVar("T")
_HELDOUT_SEED = 4242  # the build trains on seed 0 and evaluates on 1_000_003; this is neither


@dataclass
class Served:
    """The module's one running model, its artifact, and the loop it runs on."""

    report: IntentLLMReport
    model: VLLMModel
    host: ModelHost[Any]
    loop: asyncio.AbstractEventLoop

    def run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        return self.loop.run_until_complete(coroutine)

    async def predict(self, texts: list[str]) -> Any:
        return await self.host.predict(texts, len(texts))


@pytest.fixture(scope="module")
def artifact(tmp_path_factory: pytest.TempPathFactory) -> IntentLLMReport:
    return build_intent_llm(tmp_path_factory.mktemp("intent_llm") / "model", seed=0, progress=False)


@pytest.fixture(scope="module")
def served(artifact: IntentLLMReport) -> Iterator[Served]:
    loop = asyncio.new_event_loop()
    model = VLLMModel(VLLMSettings(name="intent", artifact=artifact.path, max_text_chars=1000))
    host: ModelHost[Any] = ModelHost(model)
    loop.run_until_complete(host.start())
    try:
        yield Served(artifact, model, host, loop)
    finally:
        loop.run_until_complete(host.stop())
        loop.close()


def test_build_learns_the_intents(artifact: IntentLLMReport) -> None:
    assert artifact.accuracy >= 0.9
    assert artifact.heldout_seed != artifact.seed


def test_classifies_heldout_texts(served: Served) -> None:
    texts, intents = intent_texts(256, _HELDOUT_SEED)
    output = served.run(served.predict(texts))
    assert output.labels is not None
    accuracy = np.mean([got == want for got, want in zip(output.labels, intents, strict=True)])
    assert accuracy >= 0.9


def test_scores_are_the_chosen_labels_probability(served: Served) -> None:
    texts, _ = intent_texts(32, _HELDOUT_SEED + 1)
    output = served.run(served.predict(texts))
    assert output.scores.dtype == np.float64
    assert ((output.scores >= 0) & (output.scores <= 1)).all()
    distributions = output.extra["distribution"]
    assert output.labels is not None
    assert len(distributions) == len(texts)
    for score, label, distribution in zip(output.scores, output.labels, distributions, strict=True):
        assert list(distribution) == list(INTENTS)
        assert all(0.0 <= p <= 1.0 for p in distribution.values())
        assert sum(distribution.values()) == pytest.approx(1.0, abs=1e-9)
        assert label == max(distribution, key=distribution.__getitem__)
        assert score == distribution[label]
        assert score >= 1 / len(INTENTS)


def test_concurrent_batches_match_sequential(served: Served) -> None:
    texts, _ = intent_texts(6 * 16, _HELDOUT_SEED + 2)
    batches = [texts[i : i + 16] for i in range(0, len(texts), 16)]
    started_at = served.model.details()["engine_started_at"]

    async def sequential() -> list[Any]:
        return [await served.predict(batch) for batch in batches]

    async def concurrent() -> list[Any]:
        return list(await asyncio.gather(*(served.predict(batch) for batch in batches)))

    one_by_one, together = served.run(sequential()), served.run(concurrent())
    for a, b in zip(one_by_one, together, strict=True):
        assert a.labels == b.labels
        # Batch composition changes the matmul shapes, so float32 sums may differ in the last bits.
        np.testing.assert_allclose(a.scores, b.scores, rtol=0, atol=1e-5)
    assert served.model.details()["engine_started_at"] == started_at  # the same engine served all of it


def test_a_second_engine_starts_while_the_first_serves_and_stops_without_breaking_it(served: Served) -> None:
    """A swap's shape in one process: the candidate's engine starts while the serving one steps, and the
    one that retires stops while the other serves. Both once broke the engine that stayed (vLLM keeps its
    forward context and parallel groups process-wide): the candidate's start failed "Forward context is
    not set", and after a stop the other engine failed "pipeline model parallel group is not initialized"."""
    texts, _ = intent_texts(16, _HELDOUT_SEED + 3)
    expected = served.run(served.predict(texts))
    second = VLLMModel(VLLMSettings(name="intent", artifact=served.report.path, max_text_chars=1000))

    async def serve_while_the_second_starts() -> list[Any]:
        answers: list[Any] = []
        starting = asyncio.ensure_future(second.load())
        while not starting.done():
            answers.append(await served.predict(texts[:4]))
        await starting
        return answers

    meanwhile = served.run(serve_while_the_second_starts())
    assert meanwhile, "the first engine answered while the second started"
    for answer in meanwhile:
        assert answer.labels == expected.labels[:4]
    both = served.run(second.predict(texts))
    assert both.labels == expected.labels  # the same artifact: the same answers
    np.testing.assert_allclose(both.scores, expected.scores, rtol=0, atol=1e-5)
    served.run(second.unload())
    after = served.run(served.predict(texts))
    assert after.labels == expected.labels
    np.testing.assert_allclose(after.scores, expected.scores, rtol=0, atol=1e-5)


def test_the_engine_runs_in_this_process_and_a_cancelled_call_leaves_nothing_in_it(served: Served) -> None:
    children = [p for p in Path("/proc").iterdir() if p.name.isdigit() and _parent(p) == os.getpid()]
    # No vLLM engine-core process of ours ("VLLM::EngineCore", cut to 15 characters in comm).
    assert not [c for c in children if "EngineCor" in _comm(c)]
    # More texts than one engine step takes (max_num_seqs 64): the call is still in the engine, several
    # steps long, when this coroutine sees it there and cancels it.
    texts, _ = intent_texts(4 * 64, _HELDOUT_SEED + 3)

    async def cancel_midway() -> int:
        call = asyncio.ensure_future(served.predict(texts))
        for _ in range(5000):
            if served.model.details()["requests_in_engine"] > 0:
                break
            await asyncio.sleep(0.001)
        assert served.model.details()["requests_in_engine"] > 0, "the call never reached the engine"
        call.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await call
        for _ in range(500):  # the driver aborts them before the engine's next step
            if served.model.details()["requests_in_engine"] == 0:
                break
            await asyncio.sleep(0.01)
        return int(served.model.details()["requests_in_engine"])

    assert served.run(cancel_midway()) == 0
    output = served.run(served.predict(texts[:4]))  # and the engine answers the next call
    assert output.labels is not None
    assert len(output.labels) == 4


def _parent(proc: Path) -> int:
    try:
        stat = (proc / "stat").read_text()
    except OSError:
        return -1
    return int(stat[stat.rindex(")") + 2 :].split()[1])


def _comm(proc: Path) -> str:
    try:
        return (proc / "comm").read_text()
    except OSError:
        return ""


@pytest.mark.parametrize(
    "batch",
    [[""], ["   "], ["fine", ""], [123], ["ok", None], "not a list", [], ["x" * 1001]],
    ids=["empty", "blank", "empty-row-1", "int", "none-row-1", "bare-string", "no-rows", "too-long"],
)
def test_invalid_texts_name_the_text_field(served: Served, batch: Any) -> None:
    with pytest.raises(InvalidInput) as caught:
        served.run(served.host.predict(batch, 1))
    assert caught.value.field == "text"


def test_prompt_over_the_token_limit_is_invalid_input(served: Served) -> None:
    limit = served.model.details()["max_prompt_tokens"]
    text = " ".join(["zq"] * (limit + 10))[:1000]  # under max_text_chars, over the token limit
    with pytest.raises(InvalidInput, match="tokens") as caught:
        served.run(served.predict([text]))
    assert caught.value.field == "text"


def test_metadata_reports_the_artifact(served: Served) -> None:
    metadata = served.model.metadata()
    assert metadata.version == open_artifact(served.report.path, kind="vllm").version
    assert metadata.version == served.report.version
    assert metadata.kind == "vllm"
    assert metadata.ready
    assert metadata.labels == list(INTENTS)
    assert metadata.inputs == ["text"]
    assert isinstance(metadata.details["engine_started_at"], float)
    assert metadata.details["vllm_version"]


def _copy(artifact: IntentLLMReport, destination: Path) -> Path:
    return Path(shutil.copytree(artifact.path, destination))


def test_tampered_weights_refuse_to_load(artifact: IntentLLMReport, tmp_path: Path) -> None:
    copy = _copy(artifact, tmp_path / "tampered")
    weights = copy / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF
    weights.write_bytes(bytes(data))
    host: ModelHost[Any] = ModelHost(VLLMModel(VLLMSettings(name="intent", artifact=copy)))
    with pytest.raises(ModelLoadError, match="sha256"):
        asyncio.run(host.start())
    assert not host.model.ready


def test_unlisted_files_refuse_to_load(artifact: IntentLLMReport, tmp_path: Path) -> None:
    copy = _copy(artifact, tmp_path / "extra")
    (copy / "model-00002.safetensors").write_bytes(b"not listed")  # vLLM would glob and load it
    host: ModelHost[Any] = ModelHost(VLLMModel(VLLMSettings(name="intent", artifact=copy)))
    with pytest.raises(ArtifactIntegrityError, match="not listed"):
        asyncio.run(host.start())


def test_predict_before_load_is_unavailable(artifact: IntentLLMReport) -> None:
    model = VLLMModel(VLLMSettings(name="intent", artifact=artifact.path))
    with pytest.raises(ModelUnavailable):
        asyncio.run(model.predict(["hello"]))
    assert model.metadata().version is None


def test_missing_vllm_names_the_extra(artifact: IntentLLMReport, monkeypatch: pytest.MonkeyPatch) -> None:
    model = VLLMModel(VLLMSettings(name="intent", artifact=artifact.path))
    monkeypatch.setitem(sys.modules, "vllm", None)  # what an environment without vLLM looks like
    with pytest.raises(MissingExtra, match=r"riskserve\[cpu\]"):
        asyncio.run(ModelHost(model).start())
    monkeypatch.delitem(sys.modules, "riskserve.wrappers.vllm_model")
    with pytest.raises(MissingExtra, match=r"riskserve\[cpu\]") as caught:
        importlib.import_module("riskserve.wrappers.vllm_model")
    assert caught.value.extra == "cpu"
