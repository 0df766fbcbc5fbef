"""One text at a time through ``VLLMModel`` after an idle gap, the engine stepped on the caller's loop
when idle or by its thread, in alternating blocks (medians). Needs ``step_when_idle.patch`` (beside this
file) applied: ``git apply bench/results/step_when_idle_1628/step_when_idle.patch``, then
``VLLM_CPU_KVCACHE_SPACE=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 OMP_NUM_THREADS=1 .venv/bin/python
bench/results/step_when_idle_1628/driver_probe.py 0.003``."""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from riskserve.demo.dataset import intent_texts  # noqa: E402
from riskserve.wrappers.vllm_model import VLLMModel, VLLMSettings  # noqa: E402


async def main(gap_s: float) -> None:
    models = {}
    for on in (True, False):
        artifact = ROOT / "models" / "intent"
        settings = VLLMSettings(name="intent", artifact=artifact, max_model_len=128, max_num_seqs=32)
        model = VLLMModel(settings.model_copy(update={"step_when_idle": on}))
        await model.load()
        models[on] = model
    texts, _ = intent_texts(150, 99)
    blocks: dict[bool, list[float]] = {True: [], False: []}
    for block in range(6):
        for on in (True, False) if block % 2 == 0 else (False, True):
            latencies = []
            for text in texts:
                await asyncio.sleep(gap_s)
                started = time.perf_counter()
                await models[on].predict([text])
                latencies.append((time.perf_counter() - started) * 1e3)
            blocks[on].append(statistics.median(latencies))
            print(f"block {block} step_when_idle={on}: p50 {blocks[on][-1]:.3f} ms", flush=True)
    for on, medians in blocks.items():
        print(f"step_when_idle={on}: median of blocks {statistics.median(medians):.3f} ms", medians)
    for model in models.values():
        await model.unload()


if __name__ == "__main__":
    import uvloop

    uvloop.run(main(float(sys.argv[1]) if len(sys.argv) > 1 else 0.003))
