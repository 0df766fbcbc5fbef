"""vLLM's bare ``generate`` on the intent model: what ``card_fraud`` is judged against.

Two forms of the same engine, configured as riskserve configures ``card_fraud``'s intent model (the
YAML's settings, the engine in process, one OpenMP thread as Ray gives the intent replica):

  * :func:`bare_scorer`: ``generate`` timed in a plain loop inside its own process, no gRPC;
  * this module run as a program: the same engine behind a hand-written grpc.aio server, the LLM's floor
    (what a team would write to serve the intent model alone). ``Decide`` takes the request's text,
    tokenizes the prompt, runs ``LLM.generate`` on the event loop (at one call at a time a thread hop
    would only cost) and answers with the label distribution's top label. No features, tabular models,
    rules, metrics or fallbacks: riskserve's ``card_fraud`` does all of those on top of this same call, and
    ``make bench`` times both with the same gRPC client.

Run: ``.venv/bin/python bench/vllm_bare.py --models models --port 0`` (in :func:`bare_env`'s
environment); it prints ``serving on HOST:PORT`` once it answers, and stops on SIGTERM or SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import serve_until_signalled

ROOT = Path(__file__).resolve().parents[1]
PIPELINES = ROOT / "deploy" / "pipelines"


def intent_model() -> tuple[float, dict[str, Any]]:
    """``num_cpus`` and ``settings`` of card_fraud's intent model, as its YAML declares them."""
    import yaml

    intent = yaml.safe_load((PIPELINES / "card_fraud.yaml").read_text())["models"]["intent"]
    return float(intent.get("num_cpus", 1.0)), dict(intent.get("settings", {}))


def bare_env() -> dict[str, str]:
    """The bare engine's environment: in process, riskserve's KV cache, and the OpenMP threads Ray gives
    riskserve's intent replica (``OMP_NUM_THREADS`` = the model's ``num_cpus``, at least 1)."""
    num_cpus, _ = intent_model()
    return {
        "OMP_NUM_THREADS": str(max(int(num_cpus), 1)),
        **os.environ,
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
    }


@dataclass
class BareScorer:
    """vLLM's engine on the intent model as riskserve configures it, and how to time it."""

    score: Callable[[Sequence[str]], list[Any]]
    """The label distribution (a numpy array over ``labels``) of each text."""
    labels: tuple[str, ...]
    version: str
    texts: list[str]
    startup_s: float
    import_s: float

    def timed(self, size: int, calls: int, offset: int = 0, gap_s: float = 0.0) -> list[float]:
        """Seconds per call of ``size`` prompts each, ``calls`` times, from prompt ``offset`` on; with
        ``gap_s``, the engine is left idle that long before each call (not counted)."""
        samples = []
        for i in range(calls):
            start = (offset + i * size) % max(len(self.texts) - size, 1)
            if gap_s:
                time.sleep(gap_s)
            t0 = time.perf_counter()
            self.score(self.texts[start : start + size])
            samples.append(time.perf_counter() - t0)
        return samples


def bare_scorer(models: Path, prompts: int) -> BareScorer:
    """Start a vLLM engine on the intent model as riskserve configures it; ``score`` tokenizes and runs
    ``generate`` of one greedy token with the label tokens' log-probabilities and the softmax over them."""
    started = time.perf_counter()
    import numpy as np
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from riskserve.demo.dataset import generate_transactions
    from riskserve.platform.artifacts import open_artifact
    from riskserve.wrappers.vllm_model import VLLMSettings

    import_s = time.perf_counter() - started
    artifact = open_artifact(models / "intent", kind="vllm")
    root = str(artifact.root.resolve())
    tokenizer = AutoTokenizer.from_pretrained(root, local_files_only=True)
    template = artifact.manifest.info["prompt_template"]
    prefix = artifact.manifest.info.get("label_prefix", " ")
    label_ids = [
        tokenizer(prefix + label, add_special_tokens=False)["input_ids"][0]
        for label in artifact.manifest.labels
    ]
    # The engine arguments riskserve starts card_fraud's intent model with (settings defaults + YAML).
    settings = VLLMSettings.model_validate({"name": "intent", "artifact": root, **intent_model()[1]})
    llm = LLM(
        model=root,
        tokenizer=root,
        skip_tokenizer_init=True,
        trust_remote_code=False,
        load_format="safetensors",
        dtype=settings.dtype,
        max_model_len=settings.max_model_len,
        max_num_seqs=settings.max_num_seqs,
        max_num_batched_tokens=settings.max_num_batched_tokens,
        gpu_memory_utilization=settings.gpu_memory_utilization,
        enforce_eager=settings.enforce_eager,
        seed=settings.seed,
        disable_log_stats=True,
    )
    params = SamplingParams(max_tokens=1, temperature=0.0, logprob_token_ids=label_ids, detokenize=False)
    startup_s = time.perf_counter() - started
    texts = list(generate_transactions(max(prompts, 8) * 8, seed=2026).text)

    def score(batch: Sequence[str]) -> list[Any]:
        ids = tokenizer([template.replace("{text}", t) for t in batch])["input_ids"]
        prompts = [TokensPrompt(prompt_token_ids=list(map(int, i))) for i in ids]
        outputs = llm.generate(prompts, params, use_tqdm=False)
        distributions = []
        for output in outputs:  # the label distribution, as riskserve computes it
            step = output.outputs[0].logprobs[0]  # type: ignore[index]
            values = np.array([step[t].logprob for t in label_ids], dtype=np.float64)
            exp = np.exp(values - values.max())
            distributions.append(exp / exp.sum())
        return distributions

    scorer = BareScorer(score, tuple(artifact.manifest.labels), artifact.version, texts, startup_s, import_s)
    scorer.timed(1, 5)  # warm-up: vLLM's first steps are slow
    return scorer


# -- the LLM's floor: the same engine behind a hand-written gRPC server ----------------------------------


def _servicer(scorer: BareScorer) -> Any:
    """``Decide`` scores the request's text; ``DecideBatch`` every request's, in one ``generate``."""
    import grpc

    from riskserve.proto.riskserve.v1 import risk_pipeline_pb2 as pb
    from riskserve.proto.riskserve.v1 import risk_pipeline_pb2_grpc as pb_grpc

    def answer(request: Any, distribution: Any, latency_ms: float) -> Any:
        top = int(distribution.argmax())
        return pb.DecideResponse(
            request_id=request.request_id or uuid.uuid4().hex,
            decision=pb.APPROVE,
            models=[
                pb.ModelScore(
                    model="intent",
                    version=scorer.version,
                    label=scorer.labels[top],
                    score=float(distribution[top]),
                    latency_ms=latency_ms,
                )
            ],
            pipeline="vllm_bare",
        )

    def decide(requests: Sequence[Any]) -> list[Any]:
        started = time.perf_counter()
        distributions = scorer.score([r.text for r in requests])
        latency_ms = (time.perf_counter() - started) * 1e3
        return [answer(r, d, latency_ms) for r, d in zip(requests, distributions, strict=True)]

    class Servicer(pb_grpc.RiskPipelineServicer):
        async def Decide(self, request: Any, context: grpc.aio.ServicerContext) -> Any:  # noqa: N802
            if not request.text.strip():
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "text: required")
            return decide([request])[0]

        async def DecideBatch(self, request: Any, context: grpc.aio.ServicerContext) -> Any:  # noqa: N802
            return pb.DecideBatchResponse(responses=decide(request.requests))

    return Servicer(), pb_grpc


async def serve(models: Path, host: str, port: int) -> None:
    """Start the engine, serve until SIGTERM or SIGINT, then stop."""
    import grpc

    scorer = bare_scorer(models, prompts=8)
    servicer, pb_grpc = _servicer(scorer)
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    pb_grpc.add_RiskPipelineServicer_to_server(servicer, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    await server.start()
    await serve_until_signalled(server, f"{host}:{bound}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", type=Path, default=ROOT / "models", help="demo models (intent)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0: any free port (printed)")
    args = parser.parse_args(argv)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(args.models.resolve(), args.host, args.port))
    return 0


if __name__ == "__main__":
    sys.exit(main())
