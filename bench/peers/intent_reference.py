"""The intent LLM's reference answers for the load generator's texts, computed by riskserve's own wrapper.

Run in a process of its own (vLLM's engine and its OpenMP threads): loads ``models/intent`` with
:class:`riskserve.wrappers.vllm_model.VLLMModel` and the settings ``card_fraud.yaml`` gives it, classifies
every distinct text of the request pool 32 at a time, and writes ``{text: [label, probability]}`` as JSON.
These are what riskserve's intent model answers; every system of the ``card_fraud`` workload (riskserve
included) is checked against them.

Run: ``.venv/bin/python bench/peers/intent_reference.py --models models --out intent.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

ROOT = Path(__file__).resolve().parents[2]
CHUNK = 32


async def classify(models: Path, texts: Sequence[str]) -> dict[str, list[object]]:
    """Label and probability of each text, as card_fraud's intent model answers."""
    import yaml

    from riskserve.wrappers.vllm_model import VLLMModel, VLLMSettings

    pipeline = yaml.safe_load((ROOT / "deploy" / "pipelines" / "card_fraud.yaml").read_text())
    intent = pipeline["models"]["intent"]
    settings = VLLMSettings.model_validate(
        {"name": "intent", "artifact": models / "intent", **intent.get("settings", {})}
    )
    model = VLLMModel(settings)
    await model.load()
    try:
        out: dict[str, list[object]] = {}
        for start in range(0, len(texts), CHUNK):
            chunk = list(texts[start : start + CHUNK])
            answer = await model.predict(chunk)
            assert answer.labels is not None
            for text, label, score in zip(chunk, answer.labels, answer.scores, strict=True):
                out[text] = [label, float(score)]
        return out
    finally:
        await model.unload()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--pool", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=2026)
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from bench.loadgen import make_requests

    texts = sorted({r.text for r in make_requests(args.pool, args.seed, text=True)})
    answers = asyncio.run(classify(args.models.resolve(), texts))
    args.out.write_text(json.dumps(answers))
    return 0


if __name__ == "__main__":
    sys.exit(main())
