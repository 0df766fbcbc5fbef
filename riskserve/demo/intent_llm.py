"""Train the demo's intent LLM: a tiny Llama causal LM with its own byte-level BPE tokenizer.

The model reads ``message: <text>\\nintent:`` and is trained so that its next token is ``" <label>"``, one
of :data:`riskserve.demo.dataset.INTENTS`. The prompt ends *before* the space, so byte-level BPE keeps
``" label"`` as one piece and the prompt's tokens are an exact prefix of prompt + label: serving then scores
every label with a single forward pass (the next-token log-probabilities of the label tokens).

The result is a Hugging Face model directory (config, safetensors weights, generation config, tokenizer)
plus the riskserve manifest, so the vLLM backend serves it like any other local checkpoint. Training is
single-threaded with fixed seeds and deterministic algorithms: the same seed gives the same bytes.
Torch, transformers and tokenizers are the ``cpu`` extra and are only imported inside functions.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from tqdm import tqdm

from riskserve.demo.dataset import INTENTS, intent_texts
from riskserve.platform.artifacts import MANIFEST_NAME, Artifact, write_manifest
from riskserve.platform.errors import ConfigError, ModelLoadError
from riskserve.platform.extras import require

__all__ = [
    "DEFAULT_STEPS",
    "LABEL_PREFIX",
    "PROMPT_TEMPLATE",
    "SPECIAL_TOKENS",
    "IntentLLMReport",
    "build_intent_llm",
    "format_prompt",
]

PROMPT_TEMPLATE = "message: {text}\nintent:"
"""How a message is shown to the model; it ends before the space that starts the label."""
LABEL_PREFIX = " "
"""What joins the prompt and a label: the label token is ``LABEL_PREFIX + label``."""
SPECIAL_TOKENS = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}
"""The tokenizer's special tokens; ids 0, 1, 2 in this order."""

_BACKEND = "vllm"
_EXTRA = "cpu"
_TRAIN_ROWS = 2000
_HELDOUT_ROWS = 500
_HELDOUT_SEED_OFFSET = 1_000_003
_VOCAB_SIZE = 512
DEFAULT_STEPS = 60
"""Optimizer steps of a build (about 4 s on one core); held-out accuracy reaches 1.0 by about 30 steps."""
_BATCH = 64
_LEARNING_RATE = 3e-3
_MODEL_SHAPE: dict[str, Any] = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "head_dim": 64,  # vLLM's CPU attention kernels support 64 (not 16)
    "max_position_embeddings": 256,
}


@dataclass(frozen=True)
class IntentLLMReport:
    """What a build produced: where, which version, and how well it classifies held-out messages."""

    path: Path
    version: str
    accuracy: float
    """Share of held-out messages (drawn with another seed) whose most likely label is the true intent."""
    seed: int
    heldout_seed: int
    heldout_rows: int
    train_rows: int
    vocab_size: int
    seconds: float
    """Wall time of the whole build (tokenizer, training, evaluation, saving)."""


def format_prompt(text: str, template: str = PROMPT_TEMPLATE) -> str:
    """The prompt for one message (the label, prefixed by :data:`LABEL_PREFIX`, is what follows it)."""
    return template.replace("{text}", text)


def _train_tokenizer(texts: list[str]) -> Any:
    """Train a byte-level BPE on the prompts + labels, with ``<s> $A`` as the post-processor (adds BOS)."""
    tokenizers = require("tokenizers", backend=_BACKEND, extra=_EXTRA)
    bos, eos, pad = SPECIAL_TOKENS["bos_token"], SPECIAL_TOKENS["eos_token"], SPECIAL_TOKENS["pad_token"]
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE())
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=_VOCAB_SIZE,
        min_frequency=2,
        special_tokens=[bos, eos, pad],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    tokenizer.post_processor = tokenizers.processors.TemplateProcessing(
        single=f"{bos} $A", special_tokens=[(bos, tokenizer.token_to_id(bos))]
    )
    return tokenizer


def _label_token_ids(tokenizer: Any) -> list[int]:
    """The single token id of each ``" label"``; a label that BPE split is a build error."""
    ids = []
    for label in INTENTS:
        pieces = tokenizer.encode(LABEL_PREFIX + label, add_special_tokens=False).ids
        if len(pieces) != 1:
            raise ModelLoadError(f"label '{label}' is {len(pieces)} tokens, the scorer needs exactly one")
        ids.append(pieces[0])
    return ids


def _encode_prompts(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    return [encoding.ids for encoding in tokenizer.encode_batch([format_prompt(t) for t in texts])]


def _pad(rows: list[list[int]], pad_id: int) -> tuple[Any, Any]:
    """Right-padded ``(input_ids, last_index)`` tensors; right padding cannot affect earlier positions."""
    torch = require("torch", backend=_BACKEND, extra=_EXTRA)
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
    last = torch.tensor([len(r) - 1 for r in rows], dtype=torch.long)
    return ids, last


def _next_token_logits(model: Any, ids: Any, last: Any) -> Any:
    """Logits of the token after each row's last prompt token, shape ``(rows, vocab)``."""
    logits = model(input_ids=ids).logits
    return logits[range(ids.shape[0]), last]


def _check_prefix_property(tokenizer: Any, texts: list[str], labels: list[str]) -> None:
    """Prompt tokens + the label token must equal the tokens of prompt + label (what serving relies on)."""
    label_id = dict(zip(INTENTS, _label_token_ids(tokenizer), strict=True))
    for text, label in zip(texts, labels, strict=True):
        prompt = tokenizer.encode(format_prompt(text)).ids
        full = tokenizer.encode(format_prompt(text) + LABEL_PREFIX + label).ids
        if full != [*prompt, label_id[label]]:
            raise ModelLoadError(f"prompt + label does not tokenize as prompt tokens + label token: {text!r}")


def build_intent_llm(
    out_dir: Path, *, seed: int = 0, progress: bool = True, steps: int = DEFAULT_STEPS
) -> IntentLLMReport:
    """Train the intent LLM on ``intent_texts(2000, seed)``, evaluate it on another seed, save an artifact.

    ``out_dir`` should be new or empty: every file in it becomes part of the artifact (and its version).
    ``steps`` (optimizer steps of 64 prompts) is there for cheap tests; the default reaches 100% held-out.

    Raises:
        ConfigError: ``steps`` is below 1.
        MissingExtra: torch, transformers or tokenizers is not installed (``riskserve[cpu]``).
        ModelLoadError: the tokenizer split a label into several tokens (the scorer needs one).
    """
    if steps < 1:
        raise ConfigError(f"steps must be at least 1, got {steps}")
    torch = require("torch", backend=_BACKEND, extra=_EXTRA)
    transformers = require("transformers", backend=_BACKEND, extra=_EXTRA)
    started = time.perf_counter()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    train_texts, train_labels = intent_texts(_TRAIN_ROWS, seed)
    heldout_seed = seed + _HELDOUT_SEED_OFFSET
    heldout_texts, heldout_labels = intent_texts(_HELDOUT_ROWS, heldout_seed)
    corpus = [format_prompt(t) + LABEL_PREFIX + y for t, y in zip(train_texts, train_labels, strict=True)]
    tokenizer = _train_tokenizer(corpus)
    label_ids = _label_token_ids(tokenizer)
    _check_prefix_property(tokenizer, train_texts[:200], train_labels[:200])
    target = dict(zip(INTENTS, label_ids, strict=True))
    pad_id = tokenizer.token_to_id(SPECIAL_TOKENS["pad_token"])

    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    try:
        torch.manual_seed(seed)
        generator = torch.Generator().manual_seed(seed)
        config = transformers.LlamaConfig(
            vocab_size=tokenizer.get_vocab_size(),
            bos_token_id=tokenizer.token_to_id(SPECIAL_TOKENS["bos_token"]),
            eos_token_id=tokenizer.token_to_id(SPECIAL_TOKENS["eos_token"]),
            pad_token_id=pad_id,
            tie_word_embeddings=False,
            dtype="float32",
            **_MODEL_SHAPE,
        )
        model = transformers.LlamaForCausalLM(config)
        model.train()
        prompts = _encode_prompts(tokenizer, train_texts)
        ids, last = _pad(prompts, pad_id)
        targets = torch.tensor([target[y] for y in train_labels], dtype=torch.long)
        optimizer = torch.optim.AdamW(model.parameters(), lr=_LEARNING_RATE, weight_decay=0.0)
        bar = tqdm(range(steps), desc="training intent LLM", unit="step", disable=not progress)
        for _ in bar:
            rows = torch.randint(0, len(prompts), (_BATCH,), generator=generator)
            width = int(last[rows].max()) + 1
            logits = _next_token_logits(model, ids[rows, :width], last[rows])
            loss = torch.nn.functional.cross_entropy(logits, targets[rows])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            bar.set_postfix(loss=f"{loss.item():.4f}", refresh=False)

        model.eval()
        with torch.no_grad():
            ids_h, last_h = _pad(_encode_prompts(tokenizer, heldout_texts), pad_id)
            label_logits = _next_token_logits(model, ids_h, last_h)[:, label_ids]
            predicted = [INTENTS[int(i)] for i in label_logits.argmax(dim=-1)]
        accuracy = sum(p == y for p, y in zip(predicted, heldout_labels, strict=True)) / len(heldout_labels)
        _save_quietly(transformers, model, out_dir, progress)
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)

    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, **SPECIAL_TOKENS)
    fast.save_pretrained(out_dir)
    files: dict[str, Literal["model"]] = {
        p.relative_to(out_dir).as_posix(): "model"
        for p in sorted(out_dir.rglob("*"))
        if p.is_file() and p.name != MANIFEST_NAME
    }
    manifest = write_manifest(
        out_dir,
        kind="vllm",
        files=files,
        labels=list(INTENTS),
        info={
            "seed": seed,
            "heldout_seed": heldout_seed,
            "heldout_rows": len(heldout_labels),
            "heldout_accuracy": accuracy,
            "train_rows": len(train_labels),
            "train_steps": steps,
            "prompt_template": PROMPT_TEMPLATE,
            "label_prefix": LABEL_PREFIX,
            "label_token_ids": label_ids,
        },
    )
    return IntentLLMReport(
        path=out_dir,
        version=Artifact(out_dir, manifest).version,
        accuracy=accuracy,
        seed=seed,
        heldout_seed=heldout_seed,
        heldout_rows=len(heldout_labels),
        train_rows=len(train_labels),
        vocab_size=tokenizer.get_vocab_size(),
        seconds=time.perf_counter() - started,
    )


def _save_quietly(transformers: Any, model: Any, out_dir: Path, progress: bool) -> None:
    """``save_pretrained``, without transformers' own progress bar unless progress is wanted."""
    hf_logging = transformers.utils.logging
    was_enabled = hf_logging.is_progress_bar_enabled()
    if not progress:
        hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(out_dir)
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()
