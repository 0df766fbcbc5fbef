"""A causal LM served by vLLM as a closed-set text classifier (the intent LLM).

Scoring: each text becomes ``prompt_template`` (from the manifest) and is sent as *one* request for one
greedy token with ``SamplingParams(logprob_token_ids=<the label tokens>)``. vLLM (0.32) then returns the
raw next-token log-probability of exactly those tokens, computed from the same forward pass that
prefills the prompt; a softmax over them is the distribution over the closed label set. This needs every
``label_prefix + label`` to be a single token that follows the prompt's tokens unchanged, which ``load``
checks. It is the fast choice: one forward pass per text, no vocabulary-sized logprob payload
(``logprobs=-1``), and no label-by-label requests (``prompt_logprobs`` over prompt + label would cost one
sequence per label; ``prompt_logprob_token_ids`` needs the V2 model runner, which needs Triton, absent on
CPU). The scores are the model's own next-token probabilities, not sampled.

Every text of a batch, and of every concurrent batch, is its own engine request submitted at once, so
concurrent ``predict`` calls share vLLM's continuous batching. The engine runs in this process, owned by
one thread (:class:`~riskserve.wrappers.vllm_driver.EngineDriver`): no inter-process hop per request.
Texts are tokenized on that thread with the artifact's Hugging Face tokenizer and handed to the engine as
token ids; the engine never tokenizes.

``load`` verifies the artifact's sha256 manifest and refuses files it does not list (vLLM globs the
directory for weights), then starts the engine from the local directory only (no hub access), with
safetensors as the only weight format. ``engine_process`` moves the engine core to a process of its
own (vLLM's default), at about 4 ms a request on CPU.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.util
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import numpy as np
from pydantic import Field

from riskserve.platform.artifacts import MANIFEST_NAME, Artifact, open_artifact
from riskserve.platform.base_model import BaseModel, ModelOutput, ModelSettings
from riskserve.platform.errors import (
    ArtifactIntegrityError,
    InvalidInput,
    MissingExtra,
    ModelLoadError,
    ModelUnavailable,
    Overloaded,
)
from riskserve.platform.extras import require
from riskserve.platform.validation import check_texts
from riskserve.wrappers.vllm_driver import ENGINE_LOCK, EngineDriver

__all__ = ["VLLMModel", "VLLMSettings"]

_BACKEND = "vllm"
_EXTRA = "cpu"
_DEFAULT_LABEL_PREFIX = " "
_PROBE_TEXT = "probe message"
_OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
"""Set (unless already set) before vLLM is imported: load from disk only, and report nothing anywhere."""


def _installed(module: str) -> bool:
    """Whether ``module`` can be imported, without importing it (vLLM takes seconds to import)."""
    if module in sys.modules:
        return sys.modules[module] is not None
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


if not _installed("vllm"):
    # The backend registry imports this module to use the backend: fail there, naming the extra.
    raise MissingExtra(_BACKEND, _EXTRA, "vllm")


class VLLMSettings(ModelSettings):
    """How to run the vLLM engine for one text classifier artifact."""

    dtype: Literal["float32", "bfloat16"] = "float32"
    """Weight and activation type; float32 reproduces the trained probabilities exactly on CPU."""
    max_model_len: int | None = Field(default=None, ge=16, le=131_072)
    """Longest prompt + label in tokens; ``None`` takes the model's own limit."""
    max_num_seqs: int = Field(default=64, ge=1, le=4096)
    """Sequences the engine batches in one step; more requests than this wait in its queue."""
    max_num_batched_tokens: int | None = Field(default=None, ge=16, le=1_048_576)
    """Prefill tokens per engine step; ``None`` lets vLLM choose (2048 on CPU with chunked prefill)."""
    kv_cache_space_gib: int = Field(default=1, ge=1, le=4096)
    """KV cache size in GiB (``VLLM_CPU_KVCACHE_SPACE``, set before the engine starts)."""
    gpu_memory_utilization: float = Field(default=0.1, gt=0.0, le=1.0)
    """On CPU, the share of RAM vLLM checks is free at start; a high value refuses to start beside Ray."""
    enforce_eager: bool = True
    """Run PyTorch eagerly: no torch.compile on start (minutes on CPU, and Triton has no CPU backend)."""
    omp_threads_bind: str = Field(default="nobind", pattern=r"^(auto|nobind|[0-9][0-9,|-]*)$", max_length=512)
    """``VLLM_CPU_OMP_THREADS_BIND``: ``nobind`` leaves OpenMP threads unpinned (best when sharing cores
    with Ray), ``auto`` pins them to cores and reserves one, or an explicit list such as ``0-3``."""
    engine_process: bool = False
    """Run vLLM's engine core in a process of its own (``VLLM_ENABLE_V1_MULTIPROCESSING=1``). Off, it
    runs in the replica's process, driven by one thread: no ZeroMQ round trip per request (about 4 ms on
    2 CPU cores) and one process less."""
    max_text_chars: int = Field(default=2000, ge=1, le=100_000)
    """Longest accepted text in characters; longer ones are refused as ``InvalidInput`` naming ``text``."""
    seed: int = Field(default=0, ge=0, le=2**31 - 1)
    """Engine seed (scoring is greedy and does not depend on it)."""
    warmup: bool = True
    """Score one probe text during ``load`` so the first real request does not pay vLLM's lazy start-up
    (about 2.5 s on CPU), and so a model that cannot answer fails to load instead of failing requests."""


@dataclass(frozen=True)
class _Prompting:
    """What turns a text into token ids and the label tokens to score after them."""

    template: str
    labels: tuple[str, ...]
    label_token_ids: tuple[int, ...]


@dataclass(frozen=True)
class _Engine:
    """One running engine and what it was started from; replaced as a whole, never mutated."""

    driver: EngineDriver
    """The thread that owns the ``vllm.v1.engine.llm_engine.LLMEngine``."""
    sampling_params: Any
    """The one ``SamplingParams`` every request uses."""
    tokens_input: Any
    """``vllm.inputs.tokens_input``."""
    tokenizer: Any
    """The artifact's Hugging Face tokenizer (``transformers.AutoTokenizer``)."""
    artifact: Artifact
    prompting: _Prompting
    max_prompt_tokens: int
    started_at: float
    """Unix time the engine was ready (after the warm-up)."""
    start_seconds: float
    """Wall time of ``load``: vLLM import (first time only), engine processes, model load, warm-up."""
    vllm_version: str


@dataclass(frozen=True)
class _Backend:
    """The vLLM and transformers entry points this module uses, imported once."""

    llm_engine: Any
    engine_args: Any
    sampling_params: Any
    tokens_input: Any
    auto_tokenizer: Any
    version: str


def _import_backend() -> _Backend:
    """Import vLLM (seconds; blocking) in a call of its own.

    vLLM keeps a module-level ``ModuleNotFoundError`` (optional ``torchcodec``) whose traceback holds every
    frame that was importing it, so the first importer's locals live for the life of the process: that
    must not be a frame holding the engine, or the engine is never collected and its ``__del__`` runs at
    interpreter exit, when it fails.
    """
    for name, value in _OFFLINE_ENV.items():
        os.environ.setdefault(name, value)
    vllm = require("vllm", backend=_BACKEND, extra=_EXTRA)
    transformers = require("transformers", backend=_BACKEND, extra=_EXTRA)
    arg_utils = require("vllm.engine.arg_utils", backend=_BACKEND, extra=_EXTRA)
    inputs = require("vllm.inputs", backend=_BACKEND, extra=_EXTRA)
    llm_engine = require("vllm.v1.engine.llm_engine", backend=_BACKEND, extra=_EXTRA)
    return _Backend(
        llm_engine=llm_engine.LLMEngine,
        engine_args=arg_utils.EngineArgs,
        sampling_params=vllm.SamplingParams,
        tokens_input=inputs.tokens_input,
        auto_tokenizer=transformers.AutoTokenizer,
        version=str(vllm.__version__),
    )


class VLLMModel(BaseModel[Sequence[str], VLLMSettings]):
    """A closed-set text classifier: one causal-LM forward pass per text, softmax over the label tokens."""

    kind: ClassVar[str] = "vllm"

    def __init__(self, settings: VLLMSettings) -> None:
        super().__init__(settings)
        self._engine: _Engine | None = None

    def _loaded_version(self) -> str | None:
        engine = self._engine
        return engine.artifact.version if engine is not None else None

    async def load(self) -> None:
        """Verify the artifact, start the engine (off the event loop), warm it up, then swap it in.

        Loading again while loaded starts the new engine first and then stops the old one; requests still
        in flight on the old engine fail with ``ModelUnavailable``.
        """
        started = time.perf_counter()
        backend = await asyncio.to_thread(_import_backend)
        engine = await asyncio.to_thread(self._start_engine, backend)
        try:
            if self.settings.warmup:
                await self._score(engine, [_PROBE_TEXT])
        except asyncio.CancelledError:
            await _shutdown(engine)
            raise
        except Exception as error:
            await _shutdown(engine)
            raise ModelLoadError(
                f"model '{self.name}': the engine started but cannot score: {error}"
            ) from error
        engine = dataclasses.replace(
            engine, started_at=time.time(), start_seconds=time.perf_counter() - started
        )
        previous, self._engine = self._engine, engine
        if previous is not None:
            await _shutdown(previous)

    async def predict(self, batch: Sequence[str]) -> ModelOutput:
        """Classify every text; the score is the probability of the chosen label."""
        engine = self._engine
        if engine is None:
            raise ModelUnavailable(f"model '{self.name}' is not loaded")
        texts = check_texts(batch, max_chars=self.settings.max_text_chars)
        distributions = await self._score(engine, texts)
        labels = engine.prompting.labels
        chosen = [int(np.argmax(p)) for p in distributions]
        return ModelOutput(
            scores=np.array([p[i] for p, i in zip(distributions, chosen, strict=True)], dtype=np.float64),
            labels=tuple(labels[i] for i in chosen),
            version=engine.artifact.version,
            extra={
                "distribution": [
                    {label: float(q) for label, q in zip(labels, p, strict=True)} for p in distributions
                ]
            },
        )

    async def unload(self) -> None:
        """Shut the engine (and its processes) down; idempotent."""
        engine, self._engine = self._engine, None
        if engine is not None:
            await _shutdown(engine)

    def input_names(self) -> list[str]:
        return ["text"]

    def labels(self) -> list[str]:
        engine = self._engine
        return list(engine.prompting.labels) if engine is not None else []

    def details(self) -> dict[str, Any]:
        settings = self.settings
        facts: dict[str, Any] = {
            "scoring": "next-token log-probabilities of the label tokens (logprob_token_ids), softmax",
            "dtype": settings.dtype,
            "max_num_seqs": settings.max_num_seqs,
            "kv_cache_space_gib": settings.kv_cache_space_gib,
            "omp_threads_bind": settings.omp_threads_bind,
            "engine_process": settings.engine_process,
            "enforce_eager": settings.enforce_eager,
        }
        engine = self._engine
        if engine is not None:
            facts |= {
                "requests_in_engine": engine.driver.in_flight,
                "engine_started_at": engine.started_at,
                "engine_start_seconds": round(engine.start_seconds, 3),
                "vllm_version": engine.vllm_version,
                "max_prompt_tokens": engine.max_prompt_tokens,
                "prompt_template": engine.prompting.template,
                "label_token_ids": list(engine.prompting.label_token_ids),
            }
        return facts

    # -- scoring ------------------------------------------------------------------------------------

    async def _score(self, engine: _Engine, texts: list[str]) -> list[np.ndarray[Any, np.dtype[np.float64]]]:
        """The label distribution of every text, all texts in flight in the engine at once."""
        try:
            outputs = await engine.driver.run(lambda: _prompts(engine, texts), engine.sampling_params)
        except (InvalidInput, ModelUnavailable):
            raise
        except Exception as error:
            raise _engine_error(self.name, error) from error
        return [self._distribution(engine, output) for output in outputs]

    def _distribution(self, engine: _Engine, final: Any) -> np.ndarray[Any, np.dtype[np.float64]]:
        logprobs = final.outputs[0].logprobs if final is not None and final.outputs else None
        if not logprobs:
            raise ModelUnavailable(f"model '{self.name}': the engine returned no log-probabilities")
        step = logprobs[0]
        try:
            values = np.array([step[t].logprob for t in engine.prompting.label_token_ids], dtype=np.float64)
        except KeyError as error:
            raise ModelUnavailable(
                f"model '{self.name}': no log-probability for label token {error}"
            ) from error
        if not np.isfinite(values).any():
            raise ModelUnavailable(f"model '{self.name}': every label has probability 0")
        exp = np.exp(values - values.max())
        return np.asarray(exp / exp.sum(), dtype=np.float64)

    # -- engine start (runs in a worker thread) -----------------------------------------------------

    def _start_engine(self, backend: _Backend) -> _Engine:
        settings = self.settings
        artifact = open_artifact(settings.artifact, kind="vllm", public_key=settings.manifest_key())
        _refuse_unlisted_files(artifact)
        root = str(artifact.root.resolve())
        try:
            tokenizer = backend.auto_tokenizer.from_pretrained(root, local_files_only=True)
        except Exception as error:
            raise ModelLoadError(f"{artifact.root}: cannot load the tokenizer: {error}") from error
        prompting = _prompting(artifact, tokenizer)
        args = backend.engine_args(
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
        # vLLM reads these from the process environment: one engine start at a time sets and reads them
        # (ENGINE_LOCK: the serving engine of a swap also pauses while this one starts)
        with ENGINE_LOCK:
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(settings.kv_cache_space_gib)
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = settings.omp_threads_bind
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if settings.engine_process else "0"
            try:
                llm = backend.llm_engine.from_engine_args(args)
            except Exception as error:
                raise ModelLoadError(f"{artifact.root}: the vLLM engine did not start: {error}") from error
        max_model_len = int(llm.model_config.max_model_len)
        sampling_params = backend.sampling_params(
            max_tokens=1,
            temperature=0.0,
            logprob_token_ids=list(prompting.label_token_ids),
            detokenize=False,
        )
        return _Engine(
            driver=EngineDriver(llm, self.name),
            sampling_params=sampling_params,
            tokens_input=backend.tokens_input,
            tokenizer=tokenizer,
            artifact=artifact,
            prompting=prompting,
            max_prompt_tokens=max_model_len - 1,
            started_at=0.0,  # set by load() once the warm-up passed
            start_seconds=0.0,
            vllm_version=backend.version,
        )


async def _shutdown(engine: _Engine) -> None:
    """Stop the engine's thread (failing what is in flight), then the engine core (and its process, with
    ``engine_process``), in a worker thread: both wait for work to end."""

    def stop() -> None:
        engine.driver.stop()
        client = engine.driver.engine.engine_core
        core = getattr(client, "engine_core", None)  # vLLM's in-process client holds the core itself
        finalizer = getattr(client, "_finalizer", None)  # ... and shuts it down in full when collected
        if core is None or finalizer is None:
            client.shutdown()  # the core's own process: it ends there
        elif finalizer.detach() is not None:
            _shutdown_in_process(core)

    await asyncio.to_thread(stop)


def _shutdown_in_process(core: Any) -> None:
    """What vLLM's ``EngineCore.shutdown`` does, except ``cleanup_dist_env_and_memory``: that tears down
    the process-wide distributed state every engine in the process runs on, so after a swap (the new
    engine starts before the old one stops) the new engine's next step failed ("pipeline model parallel
    group is not initialized"). The state stays for the process's lifetime; the next engine reuses it.

    Nor is the heap unfrozen and collected as vLLM does: that full collection held the interpreter for
    ~0.3 s, and without it five swaps back and forth grew the process by the same 12 MB (the KV cache of
    each retired engine is freed by reference count; that free itself holds the interpreter ~0.5 s a GiB)."""
    with ENGINE_LOCK:  # it clears process-wide caches too
        core.structured_output_manager.clear_backend()
        if core.model_executor:
            core.model_executor.shutdown()
        if core.scheduler:
            core.scheduler.shutdown()


def _refuse_unlisted_files(artifact: Artifact) -> None:
    """vLLM reads the directory (it globs for weight files), so it may hold only files the manifest lists."""
    listed = set(artifact.manifest.files)
    for path in sorted(artifact.root.rglob("*")):
        name = path.relative_to(artifact.root).as_posix()
        if path.is_file() and name != MANIFEST_NAME and name not in listed:
            raise ArtifactIntegrityError(f"{artifact.root}: '{name}' is not listed in {MANIFEST_NAME}")


def _prompting(artifact: Artifact, tokenizer: Any) -> _Prompting:
    """Prompt template and label tokens from the manifest, checked against the tokenizer.

    Raises:
        ModelLoadError: no labels or template, a label that is not one token, or a prompt whose tokens
            change when the label is appended (the one-forward-pass scoring would then be wrong).
    """
    manifest = artifact.manifest
    labels = tuple(manifest.labels)
    template = manifest.info.get("prompt_template")
    prefix = manifest.info.get("label_prefix", _DEFAULT_LABEL_PREFIX)
    if len(labels) < 2 or len(set(labels)) != len(labels):
        raise ModelLoadError(
            f"{artifact.root}: the manifest needs at least two distinct labels, got {labels}"
        )
    if not isinstance(template, str) or "{text}" not in template:
        raise ModelLoadError(f"{artifact.root}: info.prompt_template must be a string containing '{{text}}'")
    if not isinstance(prefix, str):
        raise ModelLoadError(f"{artifact.root}: info.label_prefix must be a string")
    label_ids = []
    for label in labels:
        ids = tokenizer(prefix + label, add_special_tokens=False)["input_ids"]
        if len(ids) != 1:
            raise ModelLoadError(f"{artifact.root}: label '{label}' is {len(ids)} tokens, scoring needs one")
        label_ids.append(int(ids[0]))
    if len(set(label_ids)) != len(label_ids):
        raise ModelLoadError(f"{artifact.root}: two labels share a token")
    recorded = manifest.info.get("label_token_ids")
    if recorded is not None and list(recorded) != label_ids:
        raise ModelLoadError(f"{artifact.root}: label tokens {label_ids} differ from the recorded {recorded}")
    prompt = template.replace("{text}", _PROBE_TEXT)
    prompt_ids = tokenizer(prompt)["input_ids"]
    for label, label_id in zip(labels, label_ids, strict=True):
        if tokenizer(prompt + prefix + label)["input_ids"] != [*prompt_ids, label_id]:
            raise ModelLoadError(
                f"{artifact.root}: appending label '{label}' changes the prompt's tokens; "
                "end the template before the label's leading space"
            )
    return _Prompting(template=template, labels=labels, label_token_ids=tuple(label_ids))


def _prompts(engine: _Engine, texts: list[str]) -> list[Any]:
    """The engine prompts (token ids) of every text (on the engine's thread).

    Raises:
        InvalidInput: a prompt longer than the engine takes, naming ``text`` and the row.
    """
    template = engine.prompting.template
    encoded = engine.tokenizer([template.replace("{text}", t) for t in texts])["input_ids"]
    prompts = []
    for row, ids in enumerate(encoded):
        if len(ids) > engine.max_prompt_tokens:
            raise InvalidInput(
                f"row {row} is {len(ids)} tokens, at most {engine.max_prompt_tokens} allowed", field="text"
            )
        prompts.append(engine.tokens_input(list(map(int, ids))))
    return prompts


def _engine_error(name: str, error: Exception) -> Exception:
    """Map a vLLM request failure to the platform's errors (queue full -> Overloaded, else Unavailable)."""
    kind = type(error).__name__
    if kind in {"QueueOverflowError", "MaxQueuedTokensError"}:
        return Overloaded(f"model '{name}': the engine queue is full: {error}")
    if kind == "EngineDeadError":
        return ModelUnavailable(f"model '{name}': the engine has died: {error}")
    return ModelUnavailable(f"model '{name}': the engine failed the request ({kind}): {error}")
