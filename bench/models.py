"""Micro-benchmarks of the three model wrappers: median latency at batch 1 / 64 / 1024 and rows per second.

Ratios printed side by side in one run (the machine is noisy, absolute numbers drift):
  * TL2cgen compiled library vs ``xgboost.Booster.inplace_predict``, same thread count (nthread=1);
  * scikit-learn ``predict_proba`` (through the wrapper) vs a hand-written numpy ``expit(x @ w + b)`` floor;
  * vLLM intent labelling, per batch through the async engine.

Run: ``.venv/bin/python bench/models.py --models models`` (``make bench``). Writes ``bench/out/models.json``
and ``bench/out/models.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import plot_latency, summary, time_calls, write_results

BATCHES = (1, 64, 1024)


def _tabular(models: Path, repeats: int, progress: tqdm) -> dict[str, Any]:  # type: ignore[type-arg]
    import xgboost

    from riskserve.demo.dataset import generate_transactions, tabular_features
    from riskserve.platform.host import ModelHost
    from riskserve.wrappers.sklearn_model import SklearnModel, SklearnSettings
    from riskserve.wrappers.treelite_model import TreeliteModel, TreeliteSettings

    x_all = tabular_features(generate_transactions(4096, seed=99))
    cache = Path(tempfile.mkdtemp(prefix="riskserve-bench-"))
    credit = TreeliteModel(TreeliteSettings(name="credit", artifact=models / "credit", cache_dir=cache))
    fraud = SklearnModel(SklearnSettings(name="fraud", artifact=models / "fraud"))
    hosts = [ModelHost(credit), ModelHost(fraud)]
    loop = asyncio.new_event_loop()
    for host in hosts:
        loop.run_until_complete(host.start())
    booster = xgboost.Booster()
    booster.load_model(bytearray((models / "credit" / "model.json").read_bytes()))
    booster.set_param({"nthread": 1})
    snapshot = fraud.snapshot

    results: dict[str, Any] = {}
    for batch in BATCHES:
        x = np.ascontiguousarray(x_all[:batch])
        n = repeats if batch < 1024 else max(repeats // 4, 20)
        row: dict[str, Any] = {
            "tl2cgen": summary(time_calls(lambda: credit.predict_sync(x), repeats=n), batch),
            "xgboost_inplace_predict": summary(
                time_calls(lambda: booster.inplace_predict(x), repeats=n), batch
            ),
            "tl2cgen_via_host": summary(
                time_calls(lambda: loop.run_until_complete(hosts[0].predict(x, batch)), repeats=n), batch
            ),
            "sklearn_predict_proba": summary(time_calls(lambda: fraud.score_sync(x), repeats=n), batch),
            "numpy_floor": summary(time_calls(lambda: snapshot.score_floor(x), repeats=n), batch),
            "sklearn_via_host": summary(
                time_calls(lambda: loop.run_until_complete(hosts[1].predict(x, batch)), repeats=n), batch
            ),
        }
        row["ratio_tl2cgen_over_xgboost"] = (
            row["tl2cgen"]["median_us"] / row["xgboost_inplace_predict"]["median_us"]
        )
        row["ratio_sklearn_over_numpy"] = (
            row["sklearn_predict_proba"]["median_us"] / row["numpy_floor"]["median_us"]
        )
        results[str(batch)] = row
        progress.update(1)
    big = np.ascontiguousarray(np.tile(x_all, (64, 1)))  # 262,144 rows: where joblib threads could pay off
    parallel = SklearnModel(
        SklearnSettings(name="fraud", artifact=models / "fraud", n_jobs=2, parallel_min_rows=1)
    )
    loop.run_until_complete(ModelHost(parallel).start())
    results["sklearn_262144_rows"] = {
        "one_thread": summary(time_calls(lambda: fraud.score_sync(big), repeats=10, warmup=1), len(big)),
        "joblib_two_threads": summary(
            time_calls(lambda: parallel.score_sync(big), repeats=10, warmup=1), len(big)
        ),
    }
    progress.update(1)
    results["details"] = {"credit": credit.details(), "fraud": fraud.details()}
    loop.close()
    return results


def _vllm(models: Path, repeats: int, progress: tqdm) -> dict[str, Any]:  # type: ignore[type-arg]
    from riskserve.demo.dataset import intent_texts
    from riskserve.platform.host import ModelHost
    from riskserve.wrappers.vllm_model import VLLMModel, VLLMSettings

    texts, _ = intent_texts(1024, seed=4242)
    model = VLLMModel(VLLMSettings(name="intent", artifact=models / "intent"))
    host = ModelHost(model)
    loop = asyncio.new_event_loop()
    loop.run_until_complete(host.start())
    results: dict[str, Any] = {}
    for batch in BATCHES:
        chunk = texts[:batch]
        n = repeats if batch == 1 else (max(repeats // 5, 10) if batch == 64 else 3)
        results[str(batch)] = {
            "vllm_intent": summary(
                time_calls(
                    lambda: loop.run_until_complete(host.predict(chunk, len(chunk))), repeats=n, warmup=1
                ),
                batch,
            )
        }
        progress.update(1)
    results["details"] = model.details()
    loop.run_until_complete(host.stop())
    loop.close()
    return results


def _print(tabular: dict[str, Any], llm: dict[str, Any] | None) -> None:
    print("\nmedian latency in µs (rows/s at the median)")
    names = ("tl2cgen", "xgboost", "ratio", "sklearn", "numpy", "ratio")
    header = f"{'batch':>6} | " + " | ".join(f"{n:>16}" if n != "ratio" else f"{n:>6}" for n in names)
    if llm:
        header += f" | {'vLLM intent':>18}"
    print(header)
    for batch in BATCHES:
        row = tabular[str(batch)]

        def cell(name: str, data: dict[str, Any] = row) -> str:
            return f"{data[name]['median_us']:>8.1f} ({data[name]['rows_per_s']:>5.0f})"

        line = (
            f"{batch:>6} | {cell('tl2cgen')} | {cell('xgboost_inplace_predict')} | "
            f"{row['ratio_tl2cgen_over_xgboost']:>6.2f} | {cell('sklearn_predict_proba')} | "
            f"{cell('numpy_floor')} | {row['ratio_sklearn_over_numpy']:>6.2f}"
        )
        if llm:
            line += f" | {cell('vllm_intent', llm[str(batch)])}"
        print(line)
    big = tabular["sklearn_262144_rows"]
    print(
        f"\nsklearn, 262,144 rows: one thread {big['one_thread']['median_us'] / 1e3:.1f} ms, "
        f"joblib 2 threads {big['joblib_two_threads']['median_us'] / 1e3:.1f} ms"
    )


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", type=Path, default=Path("models"))
    parser.add_argument("--repeats", type=int, default=300)
    parser.add_argument("--out", type=Path, default=Path("bench/out"))
    parser.add_argument("--skip-vllm", action="store_true")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    with tqdm(
        total=len(BATCHES) * (1 if args.skip_vllm else 2) + 1, desc="benchmarks", unit="step"
    ) as progress:
        tabular = _tabular(args.models, args.repeats, progress)
        llm = None if args.skip_vllm else _vllm(args.models, args.repeats, progress)
    _print(tabular, llm)
    results = {"tabular": tabular, "vllm": llm, "cpus": os.cpu_count()}
    json_path = write_results(args.out, "models", results)
    series = {
        "tl2cgen": {b: tabular[str(b)]["tl2cgen"]["median_us"] for b in BATCHES},
        "xgboost inplace_predict": {
            b: tabular[str(b)]["xgboost_inplace_predict"]["median_us"] for b in BATCHES
        },
        "sklearn predict_proba": {b: tabular[str(b)]["sklearn_predict_proba"]["median_us"] for b in BATCHES},
        "numpy floor": {b: tabular[str(b)]["numpy_floor"]["median_us"] for b in BATCHES},
    }
    if llm:
        series["vLLM intent"] = {b: llm[str(b)]["vllm_intent"]["median_us"] for b in BATCHES}
    png = plot_latency(args.out, "models", series, "riskserve model wrappers, median latency")
    print(f"\nresults: {json_path}\nplot:    {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
