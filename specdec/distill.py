"""`specdec distill`: make a small, fast draft model for any target by distillation.

A speculative decoder is only as good as its draft's agreement α with the target, so the
draft is trained to minimise KL(p ∥ q) against the target's own distributions, on text the
target itself sampled. Four steps, each resumable from files in `--out`:

1. **Data** (`generate_data`): sample continuations of a prompt set with the target at
   temperature 1 (chat template applied where the tokenizer has one), batched, and store
   the target's top-k log-probabilities at every generated position. k = 256 by default:
   SmolLM2-135M-Instruct at temperature 1 is flat (3.3 nats per token on its own samples);
   its top 64 / 256 / 1024 tokens hold 85% / 92% / 97% of p's mass on average, so 64 leaves
   too much in the tail bin, and 256 costs 1.5 kB per position (the kept mass is measured on
   every run and written to the card as `top_k_mass`).
2. **Train** (`train`): a small Llama whose input embedding is the target's embedding times
   a projection, initialised to its top-H PCA directions and learned (fixed with
   `--no-learn-projections`), and whose output head is learned over an output vocabulary of
   the `--draft-vocab` tokens that carry most of p's mass in the data (`choose_output_vocab`;
   the draft gives every other token probability 0). The stored weights are a few MB. The
   loss is KL(p ∥ q) over k + 1 bins: the target's top-k tokens plus one "everything else"
   bin (tail mass 1 - Σ top-k on both sides; a top-k token outside the output vocabulary
   counts in the tail). That is the exact KL of the coarsened distributions: it matches p
   on the tokens that matter and still pushes q's tail mass down to p's, which a
   renormalised top-k KL would leave free (and α is measured on the full softmax).
   **Calibration** (`split_calibration`, `choose_temperature`): the sequences of a few
   training prompts (`--calibration-share`) are kept out of training; they pick the
   checkpoint written and a temperature τ, and 1/τ is folded into the head (`fold_temperature`),
   so the held-out prompts only measure. Why τ: the draft learns its training text by heart
   and comes out under-confident on new text (τ 0.8 lifted run 13's held-out α 0.372 → 0.387).
   They also choose the **lookup weights** (`choose_lookup_weights`): the draft service drafts
   from q' = (1 − λ_n)·q + λ_n·δ(c), c the prompt lookup's token after a match of length n
   (specdec.ngram), one λ per n; on run 14 they lifted held-out α 0.383 → 0.412, and on the
   target's greedy continuations, which repeat themselves more, 0.417 → 0.551.
3. **Evaluate** (`evaluate`): on held-out prompts, α = mean over positions of
   Σ_x min(p(x), q(x)) with both full softmaxes at temperature 1, greedy agreement (both
   also on the target's own greedy continuations of those prompts), the
   cost of one single-token step with a KV cache (1 thread) for draft and target, and the
   seed's expected speedup at the best K; for q alone and, with lookup weights, for q'. And
   the K a stack serving the draft uses by default (`serving_k`): the seed's model with the
   target's verify pass over K + 1 tokens measured, not taken as one step.
4. **Write** (`export_draft`): a compact fp16 weights file (`draft-weights.safetensors`,
   no matrix of the full vocabulary's size inside) and, built from it by `materialize_draft`,
   a Hugging Face Llama directory (plus the output-vocabulary file) that
   `specdec.models.load_model` and `specdec serve draft --model DIR` load like any model,
   the lookup weights (`specdec-lookup.json`) and the card `specdec-draft.json`.

The catalog's distilled drafts (`specdec.catalog.DRAFT_CATALOG`) ship only the compact file; the first
use rebuilds the full directory from the target's embedding (`ensure_distilled_draft`).
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import math
import os
import pickle
import random
import shlex
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from specdec.catalog import (
    CACHE_MARKER, CATALOG, DRAFT_CARD_NAME, DRAFT_CATALOG, ModelNotFoundError, catalog_model_dir, check_model,
    packaged_weights, sha256,
)
from specdec.files import write_atomically
from specdec.ngram import (
    LOOKUP_FILE, LOOKUP_MAX_NGRAM, LOOKUP_WEIGHT_GRID, find_continuation, format_lookup_weights, mix_lookup, parse_lookup_weights,
    resolve_lookup_weights, write_lookup_file,
)  # fmt: skip
from specdec.prompts import PromptFileError, read_json_lines
from specdec.ranges import AT_LEAST_ONE, SECONDS, SEED, SHARE, TEMPERATURE, Range, model_name
from specdec.vocab import describe_model

DEFAULT_TOP_K = 256
DEFAULT_PROMPTS = Path(__file__).parent / "data" / "distill_prompts.jsonl"
WEIGHTS_NAME = "draft-weights.safetensors"
WEIGHTS_FORMAT = "specdec-draft-v2"  # v1 (before the output vocabulary) is refused: re-run distill
DATA_DIR = "distill-data"
EVAL_FILES = ("eval-00000.pt", "eval-greedy-00000.pt")  # in DATA_DIR: the held-out sets (HeldOut.sampled, .greedy)
CHECKPOINT_NAME = "distill-checkpoint.pt"
SERVING_MAX_K = 8  # the largest K evaluate() considers for the card's serving_k
CALIBRATION_TEMPERATURES = (0.5, 0.6, 0.7, 0.75, 0.8, 0.85, 0.9, 0.95, 1.0, 1.1, 1.25)  # the τ choose_temperature tries
RUN_RECORD = "target.json"  # in DATA_DIR: what the run's data was sampled from and with (run_record)
# The DistillConfig fields that fix the data a run samples, beside the target and the prompts:
# the run record keeps them, and --resume must give the same (check_resume).
DATA_OPTIONS = ("top_k", "max_new_tokens", "temperatures", "seed")
DRAFT_STAGING = ".draft-staging-"  # in --out: materialize_draft builds the model directory in one of these


# ---------------------------------------------------------------------------------------
# configuration

# The range of each numeric setting (specdec.ranges): the argparse type of its flag, and
# check_config's rule for a DistillConfig built in code. Keys are DistillConfig fields.
RANGES = {
    # At most 1e7 minutes (19 years, 6e8 s, inside specdec.ranges.SECONDS): 1e307 made the deadline
    # inf and ended the run in an OverflowError.
    "minutes": Range(float, 0, 1e7, note="0 only with --resume of a run that has a checkpoint: calibrate, write and "
                     "evaluate it again"),
    "layers": AT_LEAST_ONE, "hidden": AT_LEAST_ONE, "heads": AT_LEAST_ONE, "top_k": AT_LEAST_ONE,
    "data_tokens": AT_LEAST_ONE, "max_new_tokens": AT_LEAST_ONE, "gen_batch_size": AT_LEAST_ONE, "batch_size": AT_LEAST_ONE,
    "data_share": Range(float, 0, 1, above=True),
    "lr": Range(float, 0, above=True),
    "dropout": SHARE,
    "weight_decay": Range(float, 0),
    "calibration_share": Range(float, 0, 1, below=True, note="0 = none"),
    "lookup_ngram": Range(int, 0, note="0 = no lookup mixing"),
    "seed": SEED,
    "threads": Range(int, 0, note="0 = one per core"),
    "eval_every_s": SECONDS,
    "draft_vocab": Range(int, 0, note="0 = the whole vocabulary"),
}  # fmt: skip


def flag_of(field: str) -> str:
    """The command-line flag of a DistillConfig field: eval_every_s -> --eval-every."""
    return "--" + field.removesuffix("_s").replace("_", "-")


def format_temperatures(values) -> str:
    """(1.0, 0.6) -> "1,0.6": --temperatures as the command line writes it (parse_temperatures reads it)."""
    return ",".join(f"{t:g}" for t in values)


def show_option(value) -> str:
    """A DistillConfig value as its flag is written: 16 -> "16", (1.0, 0.0) -> "1,0"."""
    return format_temperatures(value) if isinstance(value, (list, tuple)) else str(value)


@dataclass
class DistillConfig:
    """Everything one `specdec distill` run needs; the CLI flags map onto these fields."""

    target: str  # catalog name or path of the target whose draft we make
    out: str  # output folder: HF draft dir + data cache + checkpoint
    minutes: float = 45.0  # wall-clock budget for data generation + training (eval and writing come after)
    prompts: str = str(DEFAULT_PROMPTS)  # JSONL of {"prompt": ..., "split": "train"|"eval"}
    eval_prompts: str = ""  # JSONL of held-out prompts; empty: the "eval" split of --prompts
    layers: int = 2  # draft transformer layers: each costs ~1.5 ms per step on 1 CPU thread
    hidden: int = 256  # draft width; the vocabulary projection costs V * hidden per token
    heads: int = 4  # attention heads (hidden / heads = head dim)
    learn_projections: bool = True  # train the [H, D] input embedding projection (False: keep its PCA init)
    draft_vocab: int = 8192  # the draft predicts only the tokens holding most of p's mass in the data (0: all)
    top_k: int = DEFAULT_TOP_K  # how many target log-probs to store per position
    data_tokens: int = 400_000  # target-sampled training positions to generate (at most)
    data_share: float = 0.55  # at most this share of --minutes goes to generating data (the shipped draft's setting)
    max_new_tokens: int = 160  # length of each sampled continuation
    gen_batch_size: int = 64  # sequences the target samples at once (2 CPU cores: 64 rows run ~2.5x the tokens/s of 16)
    batch_size: int = 6  # sequences per training step (~700 positions: more, cheaper steps beat fewer big ones)
    lr: float = 2e-3  # AdamW peak learning rate (2e-3 beat 3e-3 and 6e-3 on SmolLM2 in 6-minute trials)
    dropout: float = 0.1  # training only: on the draft's input, its attention and its final hidden state
    weight_decay: float = 0.1  # AdamW decoupled weight decay (with dropout 0.1: +0.014 held-out α in a 20-minute trial)
    calibration_share: float = 0.04  # share of training prompts whose sequences pick the checkpoint and τ, not train
    lookup_ngram: int = LOOKUP_MAX_NGRAM  # calibrate lookup weights for match lengths 1..this (0: no lookup mixing)
    seed: int = 0  # seeds sampling, the draft's init and batch order
    eval_every_s: float = 90.0  # held-out α on the progress bar this often
    checkpoint_every_s: float = 120.0  # write the checkpoint this often
    threads: int = 0  # torch threads; 0 = one per core (sampling and training both use them all)
    # Sampling temperature of each batch in turn (p is stored at 1 always); every fourth batch
    # greedy puts the contexts greedy decoding visits in the data (run 15 against run 14, the same
    # data but a quarter of it greedy, lookup mixed in: +0.018 α and +0.017 greedy agreement on the
    # target's greedy continuations, -0.007 α on its temperature-1 samples; README "Make a draft").
    temperatures: tuple[float, ...] = (1.0, 1.0, 1.0, 0.0)
    precision: str = "auto"  # compute dtype of target sampling and draft training: float32, bfloat16, auto (compute_precision)
    resume: bool = False  # continue from the data and checkpoint in --out
    progress: bool = True  # tqdm bars on stderr

    def command(self) -> str:
        """The canonical command line that reproduces this run (every flag explicit)."""
        parts = ["specdec", "distill", "--target", self.target, "--out", self.out, "--minutes", f"{self.minutes:g}"]
        if Path(self.prompts).resolve() != DEFAULT_PROMPTS.resolve():
            parts += ["--prompts", self.prompts]
        if self.eval_prompts:
            parts += ["--eval-prompts", self.eval_prompts]
        parts += [
            "--layers", str(self.layers), "--hidden", str(self.hidden), "--heads", str(self.heads),
            "--draft-vocab", str(self.draft_vocab), "--top-k", str(self.top_k), "--data-tokens", str(self.data_tokens),
            "--data-share", f"{self.data_share:g}", "--max-new-tokens", str(self.max_new_tokens),
            "--gen-batch-size", str(self.gen_batch_size), "--batch-size", str(self.batch_size),
            "--lr", f"{self.lr:g}", "--dropout", f"{self.dropout:g}", "--weight-decay", f"{self.weight_decay:g}",
            "--calibration-share", f"{self.calibration_share:g}", "--lookup-ngram", str(self.lookup_ngram), "--seed", str(self.seed), "--threads", str(self.threads),
            "--precision", self.precision, "--temperatures", format_temperatures(self.temperatures),
        ]  # fmt: skip
        parts.append("--learn-projections" if self.learn_projections else "--no-learn-projections")
        if self.resume:
            parts.append("--resume")
        return shlex.join(parts)


def compute_precision(precision: str) -> torch.dtype:
    """The dtype distillation computes in on the CPU: "float32", "bfloat16", or "auto" = bfloat16
    where oneDNN multiplies it natively (AVX-512 BF16 or AMX), else float32.

    Why: on this project's 2-core AMD machine (AVX-512 BF16) the target sampled 232 positions/s
    in bfloat16 against 147 in float32, and a draft training step ran 1.6x as fast under
    bfloat16 autocast; without native support bfloat16 is emulated and slower. Only the compute
    changes: the draft's weights, optimizer and every evaluation stay float32, and the stored
    log-probs are p's as the bfloat16 target computes them (training data, not the figures).
    """
    if precision == "float32":
        return torch.float32
    if precision == "bfloat16":
        return torch.bfloat16
    if precision != "auto":
        raise DistillError(f"--precision must be float32, bfloat16 or auto, not {precision!r}")
    native = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return torch.bfloat16 if native else torch.float32


class DistillError(RuntimeError):
    """A distillation run cannot proceed (bad --out state, mismatched resume, bad prompts)."""


# ---------------------------------------------------------------------------------------
# prompts


def load_prompts(path: str | os.PathLike, eval_path: str | os.PathLike | None = None) -> tuple[list, list]:
    """Return (train prompts, held-out prompts) from JSONL files.

    Each line is {"prompt": str} or {"messages": [{"role": str, "content": str}, ...]} (a line
    that is just a string is a prompt), optionally with "split": "eval"; any other line is
    refused naming its file and line (prompt_row_problem), before anything is written.
    With `eval_path`, every prompt of `path` trains and `eval_path` holds the held-out set;
    without it, the "eval" split of `path` is held out (every 10th line if none is marked).
    """

    def read(file) -> list[dict]:
        try:
            lines = read_json_lines(file)
        except PromptFileError as exc:
            raise DistillError(str(exc)) from None
        rows = []
        for where, row in lines:
            if isinstance(row, str):
                row = {"prompt": row}
            if problem := prompt_row_problem(row):
                raise DistillError(f"{where}: {problem}")
            rows.append(row)
        if not rows:
            raise DistillError(f"{file} holds no prompts")
        return rows

    def content(row):
        return row["messages"] if "messages" in row else row["prompt"]

    rows = read(path)
    if eval_path:
        train, held_out = [content(r) for r in rows], [content(r) for r in read(eval_path)]
        check_held_out(train, held_out)
        return train, held_out
    marked = any(r.get("split") == "eval" for r in rows)
    train, held_out = [], []
    for index, row in enumerate(rows):
        is_eval = row.get("split") == "eval" if marked else index % 10 == 9
        (held_out if is_eval else train).append(content(row))
    if not train or not held_out:
        raise DistillError(f"{path}: need both training and held-out prompts (got {len(train)} and {len(held_out)})")
    check_held_out(train, held_out)
    return train, held_out


def prompt_row_problem(row: object) -> str | None:
    """What is wrong with one line of a prompts file (load_prompts), None when nothing: it must be
    an object with "prompt", a string, or "messages", a non-empty list of objects each with a
    string "role" and a string "content" (where both are given, "messages" is the prompt)."""
    if not isinstance(row, dict) or not ("prompt" in row or "messages" in row):
        return "expected an object with 'prompt' or 'messages'"
    if "messages" not in row:
        return None if isinstance(row["prompt"], str) else f"'prompt' must be a string, got {json.dumps(row['prompt'])[:60]}"
    messages = row["messages"]
    if not isinstance(messages, list) or not messages:
        return f"'messages' must be a non-empty list of {{\"role\": ..., \"content\": ...}}, got {json.dumps(messages)[:60]}"
    for index, message in enumerate(messages):
        if not (isinstance(message, dict) and isinstance(message.get("role"), str) and isinstance(message.get("content"), str)):
            return f"messages[{index}] must be an object with a string 'role' and a string 'content', got {json.dumps(message)[:60]}"
    return None


def check_held_out(train: list, held_out: list) -> None:
    """DistillError when a held-out prompt is also a training prompt: the figures would measure
    text the draft trained on (the same file given as --prompts and --eval-prompts, say)."""
    seen = {json.dumps(prompt, sort_keys=True) for prompt in train}
    shared = [prompt for prompt in held_out if json.dumps(prompt, sort_keys=True) in seen]
    if shared:
        raise DistillError(f"{len(shared)} of the {len(held_out)} held-out prompts are training prompts too "
                           f"(the first: {json.dumps(shared[0])[:80]}): held-out figures must be measured on "
                           "prompts the draft never trained on; give --eval-prompts a file of other prompts")  # fmt: skip


def encode_prompt(tokenizer, prompt) -> list[int]:
    """Token ids of a prompt (str or chat messages), through the chat template when there is one."""
    from specdec.vocab import chat_ids, has_chat_template, text_ids

    messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    if has_chat_template(tokenizer):
        return chat_ids(tokenizer, messages)
    text = "\n".join(m["content"] for m in messages)
    return text_ids(tokenizer, text)


def encode_prompts(tokenizer, prompts: list) -> list[list[int]]:
    """encode_prompt of each prompt; DistillError naming the first one the tokenizer refuses (a
    role its chat template rejects, say) or that comes out as no tokens. distill() encodes
    before it writes anything, so such a prompt leaves --out as it was."""
    from jinja2 import TemplateError

    encoded = []
    for prompt in prompts:
        try:
            ids = encode_prompt(tokenizer, prompt)
        except (ValueError, TemplateError) as exc:
            raise DistillError(f"the prompt {json.dumps(prompt)[:80]} cannot be tokenized: {exc}") from None
        if not ids:
            raise DistillError(f"the prompt {json.dumps(prompt)[:80]} is no tokens at all; give it some text")
        encoded.append(ids)
    return encoded


# ---------------------------------------------------------------------------------------
# 1. data from the target


@torch.no_grad()
def sample_batch(model, prompts: list[list[int]], *, max_new_tokens: int, top_k: int, eos_ids: list[int],
                 pad_id: int, generator: torch.Generator, temperature: float = 1.0,
                 keep_features: bool = False) -> list[dict]:  # fmt: skip
    """Sample one continuation per prompt; keep p's top-k log-probs per step.

    Tokens are drawn at `temperature` (0: the argmax), but the stored log-probs are always
    p's own, at temperature 1: the temperature only chooses which contexts the data visits.

    Returns one record per prompt: ids [n_prompt + n_gen] (long), n_prompt, topk_ids [n_gen, k]
    (int32) and topk_logp [n_gen, k] (float16), row i being p at the position that produced
    generated token i. A sequence stops after its first EOS (kept, with its row), and leaves
    the batch at once: its cache rows are dropped, so the rest run on a smaller batch.
    keep_features: each record also holds `features` [n_gen, D] (bfloat16), row i the target's
    final hidden state (after its last norm, what its output head multiplies) at the position
    that produced generated token i (scripts/feature_draft_trial.py trains on them).
    """
    final_norm = getattr(getattr(model, "model", None), "norm", None)
    if keep_features and final_norm is None:
        raise DistillError(f"keep_features needs a model with a final norm at .model.norm (Llama-style); "
                           f"{type(model).__name__} has none")  # fmt: skip
    batch = len(prompts)
    longest = max(len(p) for p in prompts)
    input_ids = torch.full((batch, longest), pad_id, dtype=torch.long)  # [B, L], left padded
    attention = torch.zeros((batch, longest), dtype=torch.long)  # [B, L]
    for row, ids in enumerate(prompts):
        input_ids[row, longest - len(ids) :] = torch.tensor(ids)
        attention[row, longest - len(ids) :] = 1
    positions = (attention.cumsum(-1) - 1).clamp_min(0)  # [B, L]
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)  # filled in place by every forward
    features: list[torch.Tensor] = []  # per forward, the last position's final hidden state [b, D]
    hook = None
    if keep_features:
        hook = final_norm.register_forward_hook(
            lambda _module, _args, output: features.append(output[:, -1].to(torch.bfloat16)))
    try:
        steps = _sample_steps(model, input_ids, attention, positions, cache, max_new_tokens=max_new_tokens,
                              top_k=top_k, eos_ids=eos_ids, generator=generator, temperature=temperature,
                              features=features if keep_features else None)  # fmt: skip
    finally:
        if hook is not None:
            hook.remove()
    per_prompt: list[list[tuple]] = [[] for _ in prompts]
    for step_rows, *values in steps:
        for live, row in enumerate(step_rows.tolist()):
            per_prompt[row].append(tuple(v[live] for v in values))
    records = []
    for prompt, generated in zip(prompts, per_prompt):
        record = {
            "ids": torch.cat([torch.tensor(prompt, dtype=torch.long), torch.stack([g[0] for g in generated])]),
            "n_prompt": len(prompt),
            "topk_ids": torch.stack([g[1] for g in generated]),
            "topk_logp": torch.stack([g[2] for g in generated]),
        }  # fmt: skip
        if keep_features:
            record["features"] = torch.stack([g[3] for g in generated])
        records.append(record)
    return records


def _sample_steps(model, input_ids, attention, positions, cache, *, max_new_tokens: int, top_k: int,
                  eos_ids: list[int], generator: torch.Generator, temperature: float,
                  features: list | None) -> list[tuple]:  # fmt: skip
    """sample_batch's decoding loop: per step (rows [b], token [b], top ids [b, k], top log-probs
    [b, k][, final hidden state [b, D] when `features` collects them from the model's hook])."""
    batch = input_ids.shape[0]
    out = model(input_ids=input_ids, attention_mask=attention, position_ids=positions, cache=cache, use_cache=True)
    logits = out.logits[:, -1].float()  # [b, V], b = sequences still running
    next_position = positions[:, -1:] + 1  # [b, 1]
    rows = torch.arange(batch)  # [b]: the prompt index of each running sequence
    eos = torch.tensor(eos_ids or [-1])
    steps = []
    for _ in range(max_new_tokens):
        logp = torch.log_softmax(logits, dim=-1)  # [b, V]
        token = draw_tokens(logp, temperature, generator)  # [b]
        values, indices = logp.topk(top_k, dim=-1)  # [b, k]
        step = (rows, token, indices.to(torch.int32), values.to(torch.float16))
        steps.append(step + (features.pop(),) if features is not None else step)
        running = ~torch.isin(token, eos)  # [b]
        if not running.any():
            break
        if not running.all():  # drop finished sequences from the batch and the cache
            keep = running.nonzero().squeeze(1)  # [b']
            cache.batch_select_indices(keep)
            rows, token, attention, next_position = rows[keep], token[keep], attention[keep], next_position[keep]
        attention = torch.cat([attention, torch.ones((len(rows), 1), dtype=torch.long)], dim=1)
        out = model(input_ids=token.unsqueeze(1), attention_mask=attention, position_ids=next_position,
                    cache=cache, use_cache=True)  # fmt: skip
        logits = out.logits[:, -1].float()
        next_position = next_position + 1
    return steps


def draw_tokens(logp: torch.Tensor, temperature: float, generator: torch.Generator) -> torch.Tensor:
    """One token per row of log-probs [b, V], drawn at `temperature` (0: the argmax) -> [b]."""
    from specdec.sampling import sample_rows

    if temperature <= 0:
        return logp.argmax(-1)
    return sample_rows(torch.softmax(logp / temperature, dim=-1) if temperature != 1 else logp.exp(), generator)


def sampling_model(config: DistillConfig, target) -> torch.nn.Module:
    """The model that samples the data: the target itself, or, where --precision gives
    bfloat16 and the target is float32, a bfloat16 copy of it loaded beside it."""
    from specdec.models import load_model

    if compute_precision(config.precision) == torch.bfloat16 and target.dtype == "float32":
        return load_model(config.target, dtype="bfloat16", pack=False).model
    return target.model


def _data_dir(config: DistillConfig) -> Path:
    return Path(config.out) / DATA_DIR


def _load_shards(directory: Path, prefix: str) -> list[dict]:
    records = []
    for shard in sorted(directory.glob(f"{prefix}-*.pt")):
        records.extend(load_saved(shard))
    return records


def load_saved(path: Path) -> Any:
    """torch.load of a file a run saved in --out (shards, held-out sets, the checkpoint: tensors,
    numbers, strings, lists and dicts, so weights_only). DistillError naming the file where it
    cannot be read: cut short by a full disk or a copy, it ended --resume in a traceback."""
    try:
        return torch.load(path, weights_only=True)
    except pickle.UnpicklingError as exc:  # whole, but holding an object a weights-only load refuses
        raise DistillError(f"{path} holds what a weights-only load refuses ({str(exc).splitlines()[0]}): written by "
                           "another version of specdec? Keep it, and resume with the version that wrote it, or "
                           "pick a new --out") from None  # fmt: skip
    except (RuntimeError, EOFError, OSError) as exc:
        reason = str(exc).split(". ")[0] or "empty"
        raise DistillError(f"{path} cannot be read ({reason}): it is damaged or cut short; remove it and --resume "
                           "goes on without it, or pick a new --out") from None  # fmt: skip


def prompt_order(count: int, seed: int):
    """The training prompts' indices 0..count-1 in the order the data samples them: a shuffle of
    all of them (random.Random(seed)), then another of the same generator, and so on forever, so
    every prompt is used about equally. A generator: its memory is one block, whatever
    --data-tokens (a list sized for --data-tokens 1e9 ended the run in a MemoryError)."""
    rng = random.Random(seed)
    while count:
        block = list(range(count))
        rng.shuffle(block)
        yield from block


def _positions(records: list[dict]) -> int:
    return sum(int(r["topk_ids"].shape[0]) for r in records)


@dataclass
class HeldOut:
    """The held-out prompts' records: `sampled`, one continuation of each at temperature 1 (by
    the sampling model, as the training data), and `greedy`, the float32 target's own greedy
    continuation of each (the contexts greedy decoding through the services visits)."""

    sampled: list[dict]
    greedy: list[dict]


def generate_data(config: DistillConfig, target, encoded_train: list[list[int]], encoded_eval: list[list[int]],
                  deadline: float) -> tuple[list[dict], HeldOut, dict]:  # fmt: skip
    """Sample (or load) the held-out sets, then training data until data_tokens or `deadline`.

    encoded_train / encoded_eval: the prompts' token ids (encode_prompts). Shards are written
    as they are made (`distill-data/train-NNNNN.pt`), so an interrupted run and `--resume`
    keep everything already generated (a held-out set a run lacks is made on resume).
    Returns (train, held-out, stats).
    """
    directory = _data_dir(config)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = target.tokenizer
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (target.eos_token_ids or [0])[0]
    top_k = min(config.top_k, target.vocab_size)

    sampler = []  # the sampling model, loaded on first use (a resumed run may sample nothing)

    def draw(model, prompt_ids: list[list[int]], seed: int, temperature: float):
        return sample_batch(model, prompt_ids, max_new_tokens=config.max_new_tokens, top_k=top_k,
                            eos_ids=target.eos_token_ids, pad_id=pad_id, generator=torch.Generator().manual_seed(seed),
                            temperature=temperature)  # fmt: skip

    def run(prompt_ids: list[list[int]], seed: int, temperature: float = 1.0):
        if not sampler:
            sampler.append(sampling_model(config, target))
        return draw(sampler[0], prompt_ids, seed, temperature)

    def greedy(prompt_ids: list[list[int]], seed: int):  # the float32 target's own path, as the services decode it
        return draw(target.model, prompt_ids, seed, 0.0)

    def held_out_set(path: Path, sample) -> list[dict]:
        if not path.exists():
            records = []
            for start in range(0, len(encoded_eval), config.gen_batch_size):
                records.extend(sample(encoded_eval[start : start + config.gen_batch_size], config.seed + 10_000 + start))
            _atomic_save(records, path)
        return load_saved(path)

    # the held-out sets, made first (small, and the progress bar needs one): every eval prompt
    # once, sampled as the training data is, and the target's greedy continuation of each
    held_out = HeldOut(held_out_set(directory / EVAL_FILES[0], run), held_out_set(directory / EVAL_FILES[1], greedy))

    train = _load_shards(directory, "train")
    have = _positions(train)
    stats_path = directory / "stats.json"
    if stats_path.exists() and train:  # a finished data phase: --resume trains on exactly this data
        return train, held_out, json.loads(stats_path.read_text())
    # the next shard's number (after the highest, so a shard removed from the middle is not
    # written over), and the prompts' order past those already sampled, one record each
    shard = 1 + max((int(path.stem.removeprefix("train-")) for path in directory.glob("train-*.pt")), default=-1)
    order = prompt_order(len(encoded_train), config.seed)
    next(itertools.islice(order, len(train), len(train)), None)
    bar = tqdm(total=config.data_tokens, initial=min(have, config.data_tokens), desc="distill: sampling target",
               unit="tok", disable=not config.progress, file=sys.stderr, dynamic_ncols=True)  # fmt: skip
    started, had = time.monotonic(), have
    try:
        # the first batch is made whatever the deadline, so there is always something to train on
        while have < config.data_tokens and (time.monotonic() < deadline or not train):
            picks = list(itertools.islice(order, config.gen_batch_size))
            if not picks:
                break
            temperature = config.temperatures[shard % len(config.temperatures)]
            records = run([encoded_train[i] for i in picks], config.seed + shard, temperature)
            _atomic_save(records, directory / f"train-{shard:05d}.pt")
            train.extend(records)
            made = _positions(records)
            have += made
            shard += 1
            bar.update(min(made, config.data_tokens - bar.n))
            bar.set_postfix_str(f"{(have - had) / max(time.monotonic() - started, 1e-9):.0f} tok/s, {_left(deadline)} left")
    finally:
        bar.close()
    if not train:
        raise DistillError("no training data: the budget ended before the first batch was sampled")
    mass = torch.cat([r["topk_logp"].float().exp().sum(-1) for r in train + held_out.sampled])
    stats = {
        "train_positions": have, "train_sequences": len(train), "eval_positions": _positions(held_out.sampled),
        "eval_sequences": len(held_out.sampled), "top_k": top_k, "top_k_mass": float(mass.mean()),
        "top_k_mass_p10": float(mass.quantile(0.1)),
    }  # fmt: skip
    write_json(stats_path, stats)
    return train, held_out, stats


def prompts_fingerprint(train_prompts: list, eval_prompts: list) -> str:
    """The sha256 of the training and held-out prompts, as loaded (load_prompts)."""
    return hashlib.sha256(json.dumps([train_prompts, eval_prompts], sort_keys=True).encode()).hexdigest()[:16]


def prompt_key(record: dict) -> str:
    """A stable name for a record's prompt: the sha1 of its prompt token ids."""
    return hashlib.sha1(record["ids"][: record["n_prompt"]].long().numpy().tobytes()).hexdigest()


def split_calibration(records: list[dict], share: float) -> tuple[list[dict], list[dict]]:
    """Split the sampled training records into (train, calibration) by prompt.

    The ⌈share · prompts⌉ prompts whose keys sort first (never all of them) give every
    sequence sampled from them to calibration. By prompt, not by sequence: the draft knows the
    text it trained on by heart, so a prompt it trained on would judge it too kindly.
    The split depends only on the data, so a --resume makes the same one.
    """
    keys = [prompt_key(r) for r in records]  # one sha1 per record
    distinct = sorted(set(keys))
    count = min(math.ceil(share * len(distinct)), len(distinct) - 1) if share > 0 else 0
    chosen = set(distinct[:count])
    train = [r for r, key in zip(records, keys) if key not in chosen]
    calibration = [r for r, key in zip(records, keys) if key in chosen]
    return train, calibration


# ---------------------------------------------------------------------------------------
# 2. the draft and its training


def draft_llama_config(target_config, *, hidden: int, layers: int, heads: int, vocab_size: int):
    """The Llama config of a draft of width `hidden` for a target (ids and context copied)."""
    from transformers import LlamaConfig

    if hidden % heads:
        raise DistillError(f"--hidden {hidden} must be divisible by --heads {heads}")
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=int(getattr(target_config, "max_position_embeddings", 2048) or 2048),
        rms_norm_eps=1e-5,
        bos_token_id=getattr(target_config, "bos_token_id", None),
        eos_token_id=getattr(target_config, "eos_token_id", None),
        pad_token_id=getattr(target_config, "pad_token_id", None),
        tie_word_embeddings=False,  # input = E·P_inᵀ, output = E·P_outᵀ: two different projections
    )


def choose_output_vocab(records: list[dict], size: int, vocab_size: int) -> torch.Tensor:
    """The draft's output vocabulary: the `size` token ids holding the most of p's mass summed
    over the training positions, sorted by id ([M] long). size <= 0 or >= vocab_size: all ids.

    Why: the [V, H] output product is most of a small draft's step, in training and serving.
    On SmolLM2-135M-Instruct's own samples the 8,192 heaviest of its 49,152 tokens hold 92% of
    the mass of p's top 256 and p's argmax 94% of the time, held out; a draft confined to
    them loses at most that uncovered mass from α and gets ~6x cheaper output steps, which
    buys a learned output matrix (4 MB at fp16) and several times more training steps.
    """
    if size <= 0 or size >= vocab_size:
        return torch.arange(vocab_size)
    mass = torch.zeros(vocab_size, dtype=torch.float64)  # [V]
    for record in records:
        mass.index_add_(0, record["topk_ids"].long().flatten(), record["topk_logp"].double().exp().flatten())
    return mass.topk(size).indices.sort().values


def vocab_coverage(records: list[dict], vocab_ids: torch.Tensor, vocab_size: int) -> dict[str, float]:
    """Share of p's stored top-k mass, and of p's argmax, that falls inside `vocab_ids` (mean over positions)."""
    kept = torch.zeros(vocab_size, dtype=torch.bool)  # [V]
    kept[vocab_ids] = True
    mass = covered = argmax = count = 0.0
    for record in records:
        ids, p = record["topk_ids"].long(), record["topk_logp"].float().exp()  # [n, k] each
        mass += float(p.sum())
        covered += float((p * kept[ids]).sum())
        argmax += float(kept[ids[:, 0]].sum())
        count += ids.shape[0]
    return {"top_k_mass_share": covered / max(mass, 1e-12), "argmax_share": argmax / max(count, 1)}


class DraftModel(torch.nn.Module):
    """A small Llama body between the target's frozen embedding and a learned output head.

    Terms: E [V, D] is the target's input embedding, H the draft width, and `vocab_ids` [M]
    the draft's output vocabulary (M ≤ V token ids, see choose_output_vocab).
    input embedding = E @ proj_in.weightᵀ ([V, H], computed, never stored);
    logits = hidden @ head.T ([..., M], column j scores token vocab_ids[j]).
    Learned: the body (layers + final norm), the head [M, H] (initialised from E's kept rows
    projected onto E's top principal directions) and proj_in [H, D] (unless frozen).
    The stored weights hold nothing of size V. `dropout` (training mode only) zeroes that share
    of the input embedding's, the attention weights' and the final hidden state's entries.
    """

    def __init__(self, target_embedding: torch.Tensor, config, vocab_ids: torch.Tensor, dropout: float = 0.0):
        super().__init__()
        from transformers import LlamaModel

        # The body sees no token ids, so none of them: with the target's, a 1-token vocabulary made
        # transformers warn "bos_token_id must be ... within the vocabulary" in every run.
        no_ids = {"vocab_size": 1, "pad_token_id": None, "bos_token_id": None, "eos_token_id": None}
        body_config = config.__class__.from_dict({**config.to_dict(), **no_ids})
        self.config = config
        vocab, width = target_embedding.shape
        self.register_buffer("embedding", target_embedding.detach().float().clone(), persistent=False)  # [V, D]
        self.register_buffer("vocab_ids", vocab_ids.long().clone())  # [M], saved with the weights
        columns = torch.full((vocab,), -1, dtype=torch.long)  # [V]: token id -> head row, -1 if not kept
        columns[vocab_ids] = torch.arange(len(vocab_ids))
        self.register_buffer("columns", columns, persistent=False)
        self.body = LlamaModel(body_config)
        self.body.embed_tokens = None  # the input comes as inputs_embeds
        self.proj_in = torch.nn.Linear(width, config.hidden_size, bias=False)
        self.head = torch.nn.Parameter(torch.zeros(len(vocab_ids), config.hidden_size))  # [M, H]
        self.dropout = dropout
        for layer in self.body.layers:  # read by Llama attention in training mode only; config stays 0
            layer.self_attn.attention_dropout = dropout

    def init_from_pca(self, generator: torch.Generator) -> None:
        """proj_in and the head start from the top principal directions of E (random where H > rank)."""
        embedding = self.embedding
        centered = embedding - embedding.mean(0, keepdim=True)  # [V, D]
        _, _, basis = torch.linalg.svd(centered, full_matrices=False)  # [r, D], rows = directions
        hidden = self.config.hidden_size
        weight = torch.randn(hidden, embedding.shape[1], generator=generator) / math.sqrt(embedding.shape[1])
        rank = min(hidden, basis.shape[0])
        weight[:rank] = basis[:rank]
        # scale so the draft's embeddings have the target's per-coordinate spread
        weight *= embedding.std() / (embedding @ weight.T).std().clamp_min(1e-8)
        with torch.no_grad():
            self.proj_in.weight.copy_(weight)
            self.head.copy_(embedding[self.vocab_ids] @ weight.T)
            # start with logits of std ~1 (q near uniform, KL ~ log V - H(p)), not the ~10x larger
            # logits a unit-RMS hidden state times the projected embedding would give
            probe = torch.randn(256, hidden, generator=generator)  # unit-RMS hidden states
            spread = self.logits(probe).std().clamp_min(1e-8)
            self.body.norm.weight.fill_(1.0 / float(spread))

    def hidden_states(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [B, T] (right-padded: causal attention keeps padding out of real positions) -> [B, T, H]."""
        inputs = F.dropout(self.proj_in(F.embedding(ids, self.embedding)), self.dropout, self.training)  # [B, T, H]
        hidden = self.body(inputs_embeds=inputs, use_cache=False).last_hidden_state  # [B, T, H]
        return F.dropout(hidden, self.dropout, self.training)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., H] -> [..., M], over the output vocabulary."""
        return hidden @ self.head.T

    def freeze_input_projection(self) -> None:
        """Keep proj_in at its PCA init (--no-learn-projections; learning it costs ~7% more per step and,
        on SmolLM2, reached held-out α 0.228 instead of 0.213 in 6 minutes)."""
        self.proj_in.weight.requires_grad_(False)

    def compact_state(self) -> dict[str, torch.Tensor]:
        """What the weights file stores: body layers + norm, proj_in, head and vocab_ids."""
        return {k: v.detach().clone() for k, v in self.state_dict().items()}


def _pad(sequences: list[torch.Tensor], pad_id: int) -> torch.Tensor:
    longest = max(len(s) for s in sequences)
    batch = torch.full((len(sequences), longest), pad_id, dtype=torch.long)  # [B, T]
    for row, seq in enumerate(sequences):
        batch[row, : len(seq)] = seq
    return batch


def _gather_targets(records: list[dict]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(rows, cols) of the positions that have a stored p, and their top-k ids / log-probs."""
    rows, cols, ids, logps = [], [], [], []
    for row, r in enumerate(records):
        n_gen = r["topk_ids"].shape[0]
        start = r["n_prompt"] - 1  # the last prompt token predicts the first generated one
        rows.append(torch.full((n_gen,), row, dtype=torch.long))
        cols.append(torch.arange(start, start + n_gen))
        ids.append(r["topk_ids"].long())
        logps.append(r["topk_logp"].float())
    return torch.cat(rows), torch.cat(cols), torch.cat(ids), torch.cat(logps)


def kl_top_k(draft_logits: torch.Tensor, top_cols: torch.Tensor, top_logp: torch.Tensor) -> torch.Tensor:
    """Mean over positions of KL(p ∥ q) on k + 1 bins: the target's top-k tokens and the rest.

    draft_logits [N, M] over the draft's output vocabulary; top_cols [N, k] the columns of p's
    top-k tokens in it (-1 for a token the draft cannot predict: its p mass joins the "rest"
    bin); top_logp [N, k] their log p, normalised over the full vocabulary (Σ exp ≤ 1).
    """
    log_q = torch.log_softmax(draft_logits.float(), dim=-1)  # [N, M]
    kept = top_cols >= 0  # [N, k]
    log_q_top = log_q.gather(1, top_cols.clamp_min(0))  # [N, k]
    p_top = top_logp.exp() * kept  # [N, k]
    kl_top = (p_top * (top_logp - log_q_top)).sum(-1)  # [N]
    p_tail = (1 - p_top.sum(-1)).clamp_min(1e-6)  # [N]
    q_tail = (1 - (log_q_top.exp() * kept).sum(-1)).clamp_min(1e-6)  # [N]
    kl_tail = p_tail * (p_tail.log() - q_tail.log())  # [N]
    return (kl_top + kl_tail).mean()


@torch.no_grad()
def quick_eval(draft: DraftModel, held_out: list[dict], pad_id: int, batch: int = 8,
               temperatures: tuple[float, ...] = (1.0,)) -> dict[str, float]:  # fmt: skip
    """Held-out α and greedy agreement from the stored top-k of p (α here is a lower bound of
    the full-softmax α, short by at most p's tail mass; greedy agreement is exact).

    With more than one of `temperatures`, also "alpha_topk_at": {τ: α of q = softmax(logits / τ)}
    (greedy agreement does not depend on τ; "alpha_topk" stays α at τ = 1 when 1 is among them).
    """
    was_training = draft.training
    draft.eval()
    alpha_sums = dict.fromkeys(temperatures, 0.0)
    agree_sum = count = 0.0
    for start in range(0, len(held_out), batch):
        chunk = held_out[start : start + batch]
        rows, cols, top_ids, top_logp = _gather_targets(chunk)
        hidden = draft.hidden_states(_pad([r["ids"] for r in chunk], pad_id))[rows, cols]  # [N, H]
        logits = draft.logits(hidden)  # [N, M], once for every τ
        for temperature in temperatures:
            alpha, agree = score_top_k(draft, logits, top_ids, top_logp, temperature)
            alpha_sums[temperature] += alpha
        agree_sum, count = agree_sum + agree, count + len(rows)
    draft.train(was_training)
    alphas = {t: a / count for t, a in alpha_sums.items()}
    figures = {"alpha_topk": alphas.get(1.0, alphas[temperatures[0]]), "greedy_agreement": agree_sum / count}
    if len(temperatures) > 1:
        figures["alpha_topk_at"] = alphas
    return figures


def score_top_k(draft: DraftModel, logits: torch.Tensor, top_ids: torch.Tensor,
                top_logp: torch.Tensor, temperature: float = 1.0) -> tuple[float, float]:  # fmt: skip
    """Sums over N positions of α against p's stored top-k (Σ min(p, q) over those k tokens) and
    of greedy agreement; logits [N, M] the draft's (draft.logits of its final states),
    top_ids / top_logp [N, k] p's; q = softmax(logits / temperature)."""
    q = torch.softmax(logits / temperature, dim=-1)  # [N, M]
    top_cols = draft.columns[top_ids]  # [N, k]
    q_top = q.gather(1, top_cols.clamp_min(0)) * (top_cols >= 0)  # [N, k]
    alpha = float(torch.minimum(q_top, top_logp.exp()).sum())
    agree = float((draft.vocab_ids[q.argmax(-1)] == top_ids[:, 0]).sum())
    return alpha, agree


def choose_temperature(draft: DraftModel, calibration: list[dict], pad_id: int,
                       temperatures: tuple[float, ...] = CALIBRATION_TEMPERATURES) -> tuple[float, dict[float, float]]:  # fmt: skip
    """The τ of `temperatures` whose q = softmax(logits / τ) has the highest top-k α on the
    calibration records (ties: the one nearest 1), and the α of each τ."""
    alphas = quick_eval(draft, calibration, pad_id, temperatures=tuple(temperatures))["alpha_topk_at"]
    best = max(alphas, key=lambda t: (round(alphas[t], 6), -abs(math.log(t))))
    return best, alphas


@torch.no_grad()
def fold_temperature(draft: DraftModel, temperature: float) -> None:
    """Make the draft's q softmax(logits / temperature) for good: the head's rows times 1/τ."""
    draft.head.div_(temperature)


def lookup_matches(records: list[dict], max_ngram: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For each generated position of `records` (in _gather_targets' order): the token the prompt
    lookup proposes from the context before it (-1: none) and the match length n (0: none),
    both [N] long; n counts up to max_ngram (specdec.ngram.lookup_token's classes)."""
    tokens, lengths = [], []
    for r in records:
        ids = r["ids"].tolist()
        for i in range(r["topk_ids"].shape[0]):
            continuation, n = find_continuation(ids[: r["n_prompt"] + i], 1, max_ngram, 1)
            tokens.append(continuation[0] if continuation else -1)
            lengths.append(n if continuation else 0)
    return torch.tensor(tokens, dtype=torch.long), torch.tensor(lengths, dtype=torch.long)


@torch.no_grad()
def choose_lookup_weights(draft: DraftModel, calibration: list[dict], pad_id: int, max_ngram: int,
                          batch: int = 8) -> tuple[dict[int, float], dict[str, dict]]:  # fmt: skip
    """The lookup weight λ_n of each match length n = 1..max_ngram: the λ of LOOKUP_WEIGHT_GRID
    whose q' = (1 − λ)·q + λ·δ(lookup token) has the highest top-k α on the calibration
    positions of that length (ties: the smaller λ; none of that length: 0). The lengths
    partition the positions, so each λ_n is chosen on its own. Also returns, per n, the
    positions and their α at λ = 0 and at λ_n, for the card."""
    grid = torch.tensor(LOOKUP_WEIGHT_GRID)  # [G]
    sums = torch.zeros(max_ngram + 1, len(grid))  # [n, G]: α summed over positions of length n
    counts = torch.zeros(max_ngram + 1)
    draft.eval()
    for start in range(0, len(calibration), batch):
        chunk = calibration[start : start + batch]
        rows, cols, top_ids, top_logp = _gather_targets(chunk)
        q = torch.softmax(draft.logits(draft.hidden_states(_pad([r["ids"] for r in chunk], pad_id))[rows, cols]), -1)  # [N, M]
        top_cols = draft.columns[top_ids]  # [N, k]
        q_top = q.gather(1, top_cols.clamp_min(0)) * (top_cols >= 0)  # [N, k]
        looked_up, lengths = lookup_matches(chunk, max_ngram)  # [N], [N]
        hit = (top_ids == looked_up[:, None]).float()  # [N, k]: 1 at the lookup's token among p's top k
        mixed = q_top[:, None, :] * (1 - grid[None, :, None]) + grid[None, :, None] * hit[:, None, :]  # [N, G, k]
        alpha = torch.minimum(mixed, top_logp.exp()[:, None, :]).sum(-1)  # [N, G]
        sums.index_add_(0, lengths, alpha)
        counts += torch.bincount(lengths, minlength=max_ngram + 1).float()
    weights, report = {}, {}
    for n in range(1, max_ngram + 1):
        best = int(sums[n].argmax()) if counts[n] > 0 else 0  # argmax: the first of equal maxima, the smaller λ
        weights[n] = LOOKUP_WEIGHT_GRID[best]
        report[str(n)] = {"positions": int(counts[n]), "weight": weights[n],
                          "alpha_topk_without": round(float(sums[n, 0] / counts[n].clamp_min(1)), 4),
                          "alpha_topk_with": round(float(sums[n, best] / counts[n].clamp_min(1)), 4)}  # fmt: skip
    report["0"] = {"positions": int(counts[0]), "alpha_topk": round(float(sums[0, 0] / counts[0].clamp_min(1)), 4)}
    return weights, report


def _lr_at(step: int, fraction: float, peak: float, warmup: int = 30) -> float:
    """Linear warmup, flat, then linear decay to 10% over the last 30% of the time budget.
    step: steps since the schedule began; fraction: the part of its budget trained (schedule_of)."""
    scale = min(1.0, (step + 1) / warmup)
    if fraction > 0.7:
        scale *= max(0.1, 1 - 0.9 * (fraction - 0.7) / 0.3)
    return peak * scale


def schedule_of(state: dict, budget: float) -> dict:
    """The learning-rate schedule the training goes on with: {"start_step", "start_seconds",
    "budget_seconds"; "ended" once its run reached its deadline}, its budget of training seconds
    from that step and second on. A run interrupted before its budget was trained goes on with
    its own schedule, where it stopped (no second warmup; a decay already begun goes on); a
    fresh run, or a finished one trained further, begins one over this run's `budget`. A resumed
    run used to begin a new one always: back to the peak rate after an interruption in the decay."""
    schedule = state.get("schedule")
    # "ended": its run reached its deadline. One that began at its deadline (the data phase took
    # the minutes) had a 1 ms budget, trained less than that, and looked unfinished for good:
    # every later --resume went on with it, at the floor rate.
    if (schedule is None or schedule.get("ended")
            or state["train_seconds"] >= schedule["start_seconds"] + schedule["budget_seconds"]):  # fmt: skip
        schedule = {"start_step": state["step"], "start_seconds": state["train_seconds"], "budget_seconds": budget}
    return schedule


def train(config: DistillConfig, draft: DraftModel, train_records: list[dict], held_out: list[dict],
          pad_id: int, deadline: float, state: dict, calibration: list[dict] | None = None) -> dict:  # fmt: skip
    """Minimise KL(p ∥ q) until `deadline`; checkpoint to --out; return the updated state.

    `state` holds step, train_seconds, history, the learning-rate schedule (schedule_of) and
    the best weights so far by top-k α on the `calibration` records (on `held_out` when there
    are none); the draft ends with the best weights loaded. The progress bar shows held-out α.
    """
    compute_dtype = compute_precision(config.precision)
    params = [p for p in draft.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=config.lr, betas=(0.9, 0.95), weight_decay=config.weight_decay)
    if state.get("optimizer"):
        optimizer.load_state_dict(state["optimizer"])
        for group in optimizer.param_groups:  # the saved groups carry the old run's decay; this run's flag wins
            group["weight_decay"] = config.weight_decay
    rng = random.Random(config.seed * 1000 + state["step"])
    budget = max(deadline - time.monotonic(), 1e-3)
    started = time.monotonic()
    schedule = state["schedule"] = schedule_of(state, budget)
    last_eval = last_checkpoint = started

    def measure() -> dict:  # held-out figures, and the calibration α that picks the weights kept
        figures = quick_eval(draft, held_out, pad_id)
        if calibration:
            figures["calibration_alpha_topk"] = quick_eval(draft, calibration, pad_id)["alpha_topk"]
        return figures

    def judged(figures: dict) -> float:
        return figures.get("calibration_alpha_topk", figures["alpha_topk"])

    if not state["history"]:  # the starting point, for "α rose"
        figures = measure()
        state["history"].append({"step": 0, "seconds": 0.0, "loss": None, **figures})
        state["best"] = {"alpha_topk": judged(figures), "state": draft.compact_state(), "step": 0}
    bar = tqdm(total=round(budget), desc="distill: training", unit="s", disable=not config.progress,
               file=sys.stderr, dynamic_ncols=True, mininterval=1.0,
               bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt}s {postfix}")  # fmt: skip
    loss_avg = None
    draft.train()
    try:
        while time.monotonic() < deadline:
            trained = state["train_seconds"] + time.monotonic() - started - schedule["start_seconds"]
            for group in optimizer.param_groups:
                group["lr"] = _lr_at(state["step"] - schedule["start_step"], trained / schedule["budget_seconds"], config.lr)
            chunk = rng.sample(train_records, min(config.batch_size, len(train_records)))
            rows, cols, top_ids, top_logp = _gather_targets(chunk)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=compute_dtype == torch.bfloat16):
                hidden = draft.hidden_states(_pad([r["ids"] for r in chunk], pad_id))[rows, cols]  # [N, H]
                logits = draft.logits(hidden)  # [N, M]
            loss = kl_top_k(logits, draft.columns[top_ids], top_logp)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            state["step"] += 1
            loss_value = loss.item()
            loss_avg = loss_value if loss_avg is None else 0.95 * loss_avg + 0.05 * loss_value
            now = time.monotonic()
            if now - last_eval >= config.eval_every_s or now >= deadline:
                figures = measure()
                seconds = state["train_seconds"] + now - started
                state["history"].append({"step": state["step"], "seconds": round(seconds, 1), "loss": loss_avg, **figures})
                if judged(figures) >= state["best"]["alpha_topk"]:
                    state["best"] = {"alpha_topk": judged(figures), "state": draft.compact_state(), "step": state["step"]}
                last_eval = time.monotonic()
            last = state["history"][-1]
            bar.set_postfix_str(
                f"step {state['step']} loss {loss_avg:.3f} held-out α≥{last['alpha_topk']:.3f} "
                f"greedy {last['greedy_agreement']:.3f} left {_left(deadline)}",
                refresh=False,
            )
            bar.update(min(round(time.monotonic() - started), bar.total) - bar.n)  # redraws at most every 0.1 s
            if time.monotonic() - last_checkpoint >= config.checkpoint_every_s:
                save_checkpoint(config, draft, optimizer, state, state["train_seconds"] + time.monotonic() - started)
                last_checkpoint = time.monotonic()
    except KeyboardInterrupt:  # Ctrl-C: keep the training done so far for --resume
        save_checkpoint(config, draft, optimizer, state, state["train_seconds"] + time.monotonic() - started)
        raise
    finally:
        bar.close()
    state["train_seconds"] += time.monotonic() - started
    schedule["ended"] = True
    state["optimizer"] = optimizer.state_dict()
    save_checkpoint(config, draft, optimizer, state, state["train_seconds"])
    draft.load_state_dict(state["best"]["state"], strict=False)
    return state


def save_checkpoint(config: DistillConfig, draft: DraftModel, optimizer, state: dict, train_seconds: float) -> None:
    payload = {
        "arch": _arch(config), "draft": draft.compact_state(), "optimizer": optimizer.state_dict(),
        "step": state["step"], "train_seconds": train_seconds, "history": state["history"], "best": state["best"],
        "schedule": state.get("schedule"),
    }  # fmt: skip
    _atomic_save(payload, Path(config.out) / CHECKPOINT_NAME)


def _arch(config: DistillConfig) -> dict:
    return {"layers": config.layers, "hidden": config.hidden, "heads": config.heads,
            "learn_projections": config.learn_projections, "draft_vocab": config.draft_vocab,
            "calibration_share": config.calibration_share}  # fmt: skip


# ---------------------------------------------------------------------------------------
# 3. evaluation


@torch.no_grad()
def agreement(target, draft, records: list[dict], batch: int = 4,
              lookup_weights: dict[int, float] | None = None) -> dict[str, Any]:  # fmt: skip
    """α (mean Σ min(p, q), full softmaxes at temperature 1) and greedy agreement (argmax q =
    argmax p) over the generated positions of `records`; "positions" counts them. With
    `lookup_weights`, also "with_lookup": the same two for the q' the draft service drafts
    from (q' = (1 − λ_n)·q + λ_n·δ(lookup token), specdec.ngram)."""
    from specdec.sampling import acceptance_rate

    pad_id = 0
    max_ngram = max(lookup_weights, default=0) if lookup_weights else 0
    table = torch.tensor([0.0] + [lookup_weights.get(n, 0.0) for n in range(1, max_ngram + 1)]) if max_ngram else None
    alpha_sum = agree_sum = mixed_alpha_sum = mixed_agree_sum = count = 0.0
    for start in range(0, len(records), batch):
        chunk = records[start : start + batch]
        rows, cols, _, _ = _gather_targets(chunk)
        ids = _pad([r["ids"] for r in chunk], pad_id)
        target_logits = target.model(input_ids=ids, use_cache=False).logits[rows, cols].float()  # [N, V]
        draft_logits = draft.model(input_ids=ids, use_cache=False).logits[rows, cols].float()  # [N, V]
        vocab = min(target_logits.shape[-1], draft_logits.shape[-1])
        p = torch.softmax(target_logits[:, :vocab], -1)
        q = torch.softmax(draft_logits[:, :vocab], -1)
        alpha_sum += float(acceptance_rate(q, p).sum())
        agree_sum += float((q.argmax(-1) == p.argmax(-1)).sum())
        if table is not None:
            looked_up, lengths = lookup_matches(chunk, max_ngram)  # [N], [N]
            weight = table[lengths] * (looked_up >= 0) * (looked_up < vocab)  # [N]
            mixed = mix_lookup(q, looked_up.clamp(0, vocab - 1), weight)  # [N, V]
            mixed_alpha_sum += float(acceptance_rate(mixed, p).sum())
            mixed_agree_sum += float((mixed.argmax(-1) == p.argmax(-1)).sum())
        count += len(rows)
    figures: dict[str, Any] = {"alpha": round(alpha_sum / count, 4), "greedy_agreement": round(agree_sum / count, 4),
                               "positions": int(count)}  # fmt: skip
    if table is not None:
        figures["with_lookup"] = {"alpha": round(mixed_alpha_sum / count, 4), "greedy_agreement": round(mixed_agree_sum / count, 4)}
    return figures


@torch.no_grad()
def evaluate(target, draft, held_out: HeldOut, *, max_k: int = 12,
             lookup_weights: dict[int, float] | None = None) -> dict[str, Any]:  # fmt: skip
    """Exact held-out figures: α and greedy agreement on the sampled held-out set (and, under
    "greedy_path", on the target's greedy continuations), c_q, c_p, best K by the seed's
    formula, and "serving_k", the K of most tokens per ms with the target's verify passes over
    K + 1 tokens measured on torch's current threads ("c_verify_ms", K -> ms) and c_q on one,
    as a stack runs them; the draft service reports it; with
    `lookup_weights`, "with_lookup" holds the same for the draft mixed with the prompt lookup
    (what `specdec serve draft` drafts from; the lookup's own cost, µs per token, is left out).

    `target` and `draft` are specdec.models.LoadedModel (the draft as written to disk).
    """
    from specdec.kvcache import step_ms, step_ms_by_size
    from specdec.speedup import expected_speedup, expected_tokens_per_cycle, tokens_per_ms

    sampled = agreement(target, draft, held_out.sampled, lookup_weights=lookup_weights)
    greedy = agreement(target, draft, held_out.greedy, lookup_weights=lookup_weights)
    alpha = sampled["alpha"]
    prompt = held_out.sampled[0]["ids"][: held_out.sampled[0]["n_prompt"]].tolist()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        c_q = step_ms(draft.model, prompt, 1, repeats=24)
        c_p = step_ms(target.model, prompt, 1, repeats=24)
    finally:
        torch.set_num_threads(threads)
    ratio = c_q / c_p
    # As a stack serves: the draft on one core (c_q above), the target's verify passes on all of
    # `threads` (one per core by default), which a pass over several tokens uses well and one
    # token poorly (SmolLM2 on 2 AVX2 cores: 3 tokens in 99 ms on 2 threads, 137 ms on 1; 1 token
    # in 95 and 87 ms).
    c_verify = step_ms_by_size(target.model, prompt, range(2, SERVING_MAX_K + 2), repeats=5)  # {K + 1: ms}

    def best(alpha: float) -> tuple[int, dict[int, float]]:
        speedups = {k: expected_speedup(min(alpha, 1.0), k, ratio) for k in range(1, max_k + 1)}
        return max(speedups, key=speedups.get), speedups

    best_k, speedups = best(alpha)
    figures = {
        "alpha": alpha, "greedy_agreement": sampled["greedy_agreement"],
        "c_q_ms": round(c_q, 2), "c_p_ms": round(c_p, 2), "cost_ratio": round(ratio, 4),
        "best_k": best_k, "expected_tokens_per_cycle": round(expected_tokens_per_cycle(min(alpha, 1.0), best_k), 3),
        "expected_speedup": round(speedups[best_k], 3), "eval_positions": sampled["positions"],
        "eval_sequences": len(held_out.sampled), "timing": "median single-token step with KV cache, 1 torch thread, fp32",
        # the same held-out prompts, on the target's greedy continuations: what greedy decoding sees
        "greedy_path": {key: value for key, value in greedy.items() if key != "with_lookup"},
    }  # fmt: skip
    if lookup_weights:
        mixed_k, mixed_speedups = best(sampled["with_lookup"]["alpha"])
        figures["with_lookup"] = {
            "weights": format_lookup_weights(lookup_weights), **sampled["with_lookup"], "best_k": mixed_k,
            "expected_speedup": round(mixed_speedups[mixed_k], 3), "greedy_path": greedy["with_lookup"],
        }  # fmt: skip
    # The K a stack serving this draft uses for requests that set none (specdec.catalog.draft_default_k):
    # the most tokens per ms at the α it serves with, the verify pass over K + 1 tokens measured.
    serving_alpha = min(figures.get("with_lookup", figures)["alpha"], 1.0)
    rates = {k: tokens_per_ms(serving_alpha, k, c_q, c_verify[k + 1]) for k in range(1, SERVING_MAX_K + 1)}
    figures["serving_k"] = max(rates, key=rates.get)
    figures["c_verify_ms"] = {str(k): round(c_verify[k + 1], 2) for k in rates}
    figures["c_verify_threads"] = threads
    return figures


def evaluate_draft(config: DistillConfig, draft_name: str) -> dict[str, Any]:
    """`--evaluate DRAFT`: the figures of `evaluate` for an existing draft (a directory or a
    catalog name) on the held-out sets of the run in --out, so drafts compare on one set."""
    from specdec.models import load_model

    files = [_data_dir(config) / name for name in EVAL_FILES]
    missing = [path.name for path in files if not path.exists()]
    if missing:
        raise DistillError(f"{_data_dir(config)} lacks {', '.join(missing)}: run `specdec distill` into "
                           f"{config.out} first (--resume makes a held-out set an older run lacks)")  # fmt: skip
    check_model(config.target)  # before torch loads either
    check_model(draft_name)
    use_threads(config)
    target = load_model(config.target)
    # the held-out sets hold the run's target's continuations, which another target's p would judge
    check_sampled_from(Path(config.out), read_run_record(Path(config.out)), target_record(config.target, target),
                       "give --target the run's own target")  # fmt: skip
    draft = load_model(draft_name)
    if draft.vocab_fingerprint != target.vocab_fingerprint:
        raise DistillError(f"{draft_name} does not share {config.target}'s vocabulary")
    held_out = HeldOut(*(load_saved(path) for path in files))
    lookup_weights = resolve_lookup_weights("auto", draft.path)  # those it serves with, if its directory has any
    return {"draft": draft_name, "target": config.target, "held_out": str(_data_dir(config)),
            **evaluate(target, draft, held_out, lookup_weights=lookup_weights)}  # fmt: skip


# ---------------------------------------------------------------------------------------
# 4. writing: compact weights file -> Hugging Face directory


def save_draft_weights(draft: DraftModel, path: str | os.PathLike, *, target_name: str, fingerprint: str,
                       lookup_weights: dict[int, float] | None = None) -> Path:  # fmt: skip
    """Write the compact weights (fp16; vocab_ids as integers) with the config, and the lookup
    weights the draft serves with (if any), as metadata."""
    from safetensors.torch import save_file

    config = draft.config
    meta = {
        "format": WEIGHTS_FORMAT, "target": target_name, "target_vocab_fingerprint": fingerprint,
        "llama_config": json.dumps(config.to_dict()), "target_width": str(draft.embedding.shape[1]),
    }  # fmt: skip
    if lookup_weights:
        meta["lookup_weights"] = format_lookup_weights(lookup_weights)
    tensors = {k: (v.to(torch.float16) if v.is_floating_point() else v).contiguous() for k, v in draft.compact_state().items()}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, lambda temp: save_file(tensors, str(temp), metadata=meta))
    return path


def materialize_draft(target: str | Any, draft_weights_path: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """Build the Hugging Face draft directory from a compact weights file and the target.

    target: the target's catalog name / path, or an already loaded specdec LoadedModel. Its
    embedding supplies the input matrix E·P_inᵀ; the [V, H] lm_head holds the learned head's
    rows at vocab_ids and zeros elsewhere, and when the draft predicts fewer than V tokens the
    directory also gets the output-vocabulary file with which `specdec.models.load_model`
    gives every other token probability 0 (plain `from_pretrained` would give them logit 0),
    and the lookup file (specdec.ngram.LOOKUP_FILE) when the weights carry lookup weights.
    Its tokenizer and generation config are copied. Refuses a target whose vocabulary
    fingerprint differs from the one the weights were trained against.
    The files are built in a staging directory inside `out_dir` and moved into place after
    (publish_draft_files): a build stopped part way (Ctrl-C) leaves `out_dir` as it was, where it
    used to leave a directory that loaded with the whole vocabulary as its output vocabulary.
    """
    from safetensors import safe_open
    from transformers import LlamaConfig, LlamaForCausalLM

    from specdec.models import load_model, save_model, write_output_vocab
    from specdec.vocab import VocabMismatchError

    # the target as transformers loads it: only its embedding, tokenizer and generation config are used
    loaded = load_model(target, pack=False) if isinstance(target, (str, os.PathLike)) else target
    with safe_open(str(draft_weights_path), framework="pt") as handle:
        meta = handle.metadata() or {}
        tensors = {key: handle.get_tensor(key) for key in handle.keys()}
    if meta.get("format") != WEIGHTS_FORMAT:
        raise DistillError(
            f"{draft_weights_path} is not a {WEIGHTS_FORMAT} draft weights file (format {meta.get('format')!r}); "
            "make it again with this version's `specdec distill`"
        )
    if meta["target_vocab_fingerprint"] != loaded.vocab_fingerprint:
        raise VocabMismatchError(
            f"draft weights {draft_weights_path} were distilled for a target with vocabulary "
            f"{meta['target_vocab_fingerprint'][:12]}, but {loaded.name!r} has {loaded.vocab_fingerprint[:12]}"
        )
    config = LlamaConfig.from_dict(json.loads(meta["llama_config"]))
    embedding = loaded.model.get_input_embeddings().weight.detach().float().cpu()  # [V, D], a GPU target's too
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    state = {key.removeprefix("body."): value for key, value in tensors.items() if key.startswith("body.")}
    state = {f"model.{key}": value for key, value in state.items()}
    state = {key: value.float() for key, value in state.items()}
    vocab_ids = tensors["vocab_ids"].long()  # [M]
    with torch.no_grad():
        state["model.embed_tokens.weight"] = embedding @ tensors["proj_in.weight"].float().T  # [V, H]
        head = torch.zeros(embedding.shape[0], config.hidden_size)  # [V, H]
        head[vocab_ids] = tensors["head"].float()
        state["lm_head.weight"] = head
    model.load_state_dict(state, strict=True, assign=True)
    model.eval()
    generation_config = getattr(loaded.model, "generation_config", None)
    if generation_config is not None:
        model.generation_config = generation_config
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for leftover in out_dir.glob(f"{DRAFT_STAGING}*"):  # a build killed outright (SIGKILL) left it
        shutil.rmtree(leftover, ignore_errors=True)
    staging = out_dir / f"{DRAFT_STAGING}{os.getpid()}"
    try:
        save_model(model, loaded.tokenizer, staging)
        if len(vocab_ids) < embedding.shape[0]:
            write_output_vocab(staging, vocab_ids)
        if meta.get("lookup_weights"):
            note = ("specdec serve draft draws each token from (1 - w) * q + w * (the prompt lookup's token), w the "
                    "weight of the match length; chosen by specdec distill on its calibration sequences")  # fmt: skip
            write_lookup_file(staging, parse_lookup_weights(meta["lookup_weights"]), note=note)
        publish_draft_files(staging, out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out_dir


def publish_draft_files(staging: Path, out_dir: Path) -> None:
    """Move the model directory built in `staging` into `out_dir`, so that `out_dir` is never a
    model made of two builds or part of one: its config.json goes first (a folder without one is
    no model: specdec.catalog.local_model), then the output-vocabulary and lookup files of an
    earlier build that this one lacks (a resumed run rebuilds over its last draft, and a file left
    from it would be served: the old lookup weights under a card that says "off"), then each
    file of `staging` moves in, config.json last. Renames only: a moment's work."""
    from specdec.models import OUTPUT_VOCAB_FILE

    (out_dir / "config.json").unlink(missing_ok=True)
    for name in (OUTPUT_VOCAB_FILE, LOOKUP_FILE):
        if not (staging / name).exists():
            (out_dir / name).unlink(missing_ok=True)
    for path in sorted(staging.iterdir(), key=lambda path: path.name == "config.json"):
        os.replace(path, out_dir / path.name)


def export_draft(config: DistillConfig, draft: DraftModel, target, lookup_weights: dict[int, float] | None = None) -> Path:
    """Write draft-weights.safetensors, then the HF directory built from it, into --out."""
    out = Path(config.out)
    weights = save_draft_weights(draft, out / WEIGHTS_NAME, target_name=config.target,
                                 fingerprint=target.vocab_fingerprint, lookup_weights=lookup_weights)  # fmt: skip
    materialize_draft(target, weights, out)
    return weights


# ---------------------------------------------------------------------------------------
# distilled drafts in the catalog


def ensure_distilled_draft(name: str, *, progress: bool = True) -> Path:
    """Return the cached HF directory of catalog draft `name`, building it on first use.

    Building needs the target (itself a catalog model, fetched if missing) and the compact
    weights shipped in specdec/data; it takes a few seconds. Built in a staging dir and
    renamed into place with a marker, under a lock, like the catalog's converted models.
    """
    from specdec.models import ensure_catalog_model, publish_staged, staged_build

    entry = DRAFT_CATALOG[name]
    final = catalog_model_dir(name)
    with staged_build(name) as staging:
        if staging is None:
            return final
        bar = tqdm(total=2, desc=f"specdec: building {name}", unit="step", disable=not progress, file=sys.stderr)
        try:
            if entry.target in CATALOG:
                target_dir = ensure_catalog_model(entry.target, progress=progress)
            else:
                target_dir = Path(entry.target)
            bar.update(1)
            weights = packaged_weights(entry)
            materialize_draft(str(target_dir), weights, staging)
            marker = {
                "name": name, "built_from": entry.weights, "weights_sha256": sha256(weights), "target": entry.target,
                "created_unix": time.time(),
            }  # fmt: skip
            publish_staged(staging, final, CACHE_MARKER, marker)
            bar.update(1)
        finally:
            bar.close()
    return final


# ---------------------------------------------------------------------------------------
# the whole run


def check_config(config: DistillConfig) -> None:
    """DistillError naming the first flag no run can use; called before anything loads or is written."""
    compute_precision(config.precision)  # a bad --precision fails here
    for field, allowed in RANGES.items():
        if problem := allowed.problem(flag_of(field), getattr(config, field)):
            raise DistillError(problem)
    if config.minutes == 0 and not config.resume:
        raise DistillError("--minutes 0 needs --resume: with no time to train, a run only calibrates, writes and "
                           "evaluates the checkpoint in --out again")  # fmt: skip
    if config.hidden % config.heads or (config.hidden // config.heads) % 2:
        raise DistillError(f"--hidden ({config.hidden}) must be --heads ({config.heads}) times an even head width "
                           "(rotary position embeddings rotate pairs), e.g. --hidden 256 --heads 4")  # fmt: skip
    if not valid_temperatures(config.temperatures):
        raise DistillError(f"--temperatures must be numbers >= 0 (0: greedy), got {config.temperatures}")


def check_out(config: DistillConfig) -> None:
    """DistillError unless --out suits the run: a new or empty directory, or, with --resume, one
    holding a run (its data or checkpoint), and with --minutes 0 one holding a checkpoint (a run
    stopped while sampling had none, and --minutes 0 took its data as finished and wrote an
    untrained draft). A run writes a model directory into --out, so a folder holding anything
    else (another model, say) is refused rather than written over."""
    out = Path(config.out)
    holds_run = (out / CHECKPOINT_NAME).exists() or (out / DATA_DIR).exists()
    if out.exists() and not out.is_dir():
        raise DistillError(f"--out {out} is a file; pick a directory")
    if config.resume and not holds_run:
        raise DistillError(f"{out} holds no distillation run to resume; drop --resume to start one there")
    if config.resume and config.minutes == 0 and not (out / CHECKPOINT_NAME).exists():
        raise DistillError(f"--minutes 0 --resume needs a checkpoint to write, and {out} has none (its run stopped "
                           "before training began): resume with some minutes")  # fmt: skip
    if not config.resume and holds_run:
        raise DistillError(f"{out} already holds a distillation run; pass --resume to continue it, or pick a new --out")
    if not config.resume and out.exists() and any(out.iterdir()):
        raise DistillError(f"{out} is not empty and holds no distillation run; the run writes a model directory "
                           "there, so pick a new or empty --out")  # fmt: skip


def run_record(config: DistillConfig, target, train_prompts: list, eval_prompts: list) -> dict:
    """What distill-data/target.json records of a run, written before its first sample: the
    target (its name, and the fingerprints of its vocabulary and of its weights), the prompts'
    fingerprint (prompts_fingerprint) and, under "sampled_with", the data options
    (DATA_OPTIONS) the data is sampled with. check_resume holds a resumed run to them."""
    return {**target_record(config.target, target), "prompts_fingerprint": prompts_fingerprint(train_prompts, eval_prompts),
            "sampled_with": data_options(config)}  # fmt: skip


def target_record(name: str, target) -> dict:
    """The run record's fields of a target: `name` as given, and its two fingerprints."""
    return {"target": name, "vocab_fingerprint": target.vocab_fingerprint, "weights_fingerprint": target.weights_fingerprint}


def data_options(config: DistillConfig) -> dict:
    """The DATA_OPTIONS fields of `config`, as JSON holds them (temperatures as a list)."""
    options = {field: getattr(config, field) for field in DATA_OPTIONS}
    options["temperatures"] = list(config.temperatures)
    return options


def read_run_record(out: Path) -> dict:
    """The run record (run_record) of the run in `out`; {} where there is none."""
    path = out / DATA_DIR / RUN_RECORD
    return json.loads(path.read_text()) if path.exists() else {}


def check_sampled_from(out: Path, previous: dict, target: dict, advice: str) -> None:
    """DistillError, ending in `advice`, when the data of the run in `out` (its run record
    `previous`; {} for none) was sampled from a target other than `target` (target_record):
    another vocabulary, or other weights. A record written before weights were recorded is
    checked by vocabulary."""
    if not previous:
        return
    weights = previous.get("weights_fingerprint", target["weights_fingerprint"])
    if (previous["vocab_fingerprint"], weights) != (target["vocab_fingerprint"], target["weights_fingerprint"]):
        sampled_from = describe_model(previous["target"], previous["vocab_fingerprint"], weights)
        this = describe_model(target["target"], target["vocab_fingerprint"], target["weights_fingerprint"])
        raise DistillError(f"{out} holds data sampled from another target, {sampled_from}, not {this}; {advice}")


def check_resume(config: DistillConfig, previous: dict, record: dict) -> None:
    """DistillError unless this run (its record, run_record) may go on with the data of the run
    in --out (`previous`, its record; {} for none): sampled from the same target, from the same
    prompts, and with the same data options. Where they differ a resumed run trained on a mix of
    two targets' distributions, or on the old prompts' data while the card named the new ones,
    or crashed: shards of two --top-k do not stack. A record of a run begun before a field was
    recorded says nothing of that field, and is taken as agreeing."""
    out = Path(config.out)
    check_sampled_from(out, previous, record, "pick a new --out")
    if previous.get("prompts_fingerprint", record["prompts_fingerprint"]) != record["prompts_fingerprint"]:
        raise DistillError(f"{out} holds data sampled from other prompts than --prompts and --eval-prompts "
                           "give now; resume with the ones the run began with, or pick a new --out")  # fmt: skip
    for field, value in previous.get("sampled_with", {}).items():
        if value != record["sampled_with"].get(field, value):
            flag, shown, given = flag_of(field), show_option(value), show_option(record["sampled_with"][field])
            raise DistillError(f"{out} holds data sampled with {flag} {shown}, not {given}: resume with {flag} "
                               f"{shown}, or pick a new --out for a run with {flag} {given}")  # fmt: skip


def distill(config: DistillConfig) -> dict:
    """Run data -> train -> evaluate -> write; return the card (also written to --out)."""
    from specdec.models import load_model

    check_config(config)
    check_out(config)
    check_model(config.target)  # a wrong name or path fails here, before --out is made
    use_threads(config)
    began = time.monotonic()
    deadline = began + config.minutes * 60
    out = Path(config.out)
    checkpoint_path = out / CHECKPOINT_NAME
    train_prompts, eval_prompts = load_prompts(config.prompts, config.eval_prompts or None)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # a file on the way (/etc/passwd/x), no permission, a read-only disk: one line
        raise DistillError(f"cannot make --out {out}: {exc.strerror}") from None
    target = load_model(config.target)
    # every check of the prompts and of the run in --out comes before the first file is written
    encoded_train, encoded_eval = encode_prompts(target.tokenizer, train_prompts), encode_prompts(target.tokenizer, eval_prompts)
    record = run_record(config, target, train_prompts, eval_prompts)
    check_resume(config, read_run_record(out), record)
    (out / DATA_DIR).mkdir(parents=True, exist_ok=True)
    write_json(out / DATA_DIR / RUN_RECORD, record)

    # 1. data (at most data_share of the budget)
    data_deadline = began + config.minutes * 60 * config.data_share
    train_records, held_out, data_stats = generate_data(config, target, encoded_train, encoded_eval, data_deadline)
    if data_stats["top_k"] != min(config.top_k, target.vocab_size):
        print(f"specdec distill: the cached data holds top-{data_stats['top_k']} log-probs; using those", file=sys.stderr)
        config.top_k = data_stats["top_k"]
    train_records, calibration = split_calibration(train_records, config.calibration_share)

    # 2. the draft: fresh (PCA init) or from the checkpoint
    llama_config = draft_llama_config(target.model.config, hidden=config.hidden, layers=config.layers,
                                      heads=config.heads, vocab_size=target.vocab_size)  # fmt: skip
    embedding = target.model.get_input_embeddings().weight.detach()
    saved = load_saved(checkpoint_path) if checkpoint_path.exists() else None
    if saved is not None and saved.get("arch") != _arch(config):
        raise DistillError(f"the checkpoint in {out} is a {saved['arch']} draft; resume with the same "
                           + "/".join(flag_of(field) for field in _arch(config)))  # fmt: skip
    # a resumed run keeps the output vocabulary it started with (the token ids are in the checkpoint)
    vocab_ids = saved["draft"]["vocab_ids"] if saved else choose_output_vocab(train_records, config.draft_vocab, target.vocab_size)
    coverage = vocab_coverage(held_out.sampled, vocab_ids, target.vocab_size)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        draft = DraftModel(embedding, llama_config, vocab_ids, dropout=config.dropout)
    state: dict[str, Any] = {"step": 0, "train_seconds": 0.0, "history": [], "best": None, "optimizer": None,
                             "schedule": None}  # fmt: skip
    if saved is not None:
        draft.load_state_dict(saved["draft"], strict=False)
        state.update(step=saved["step"], train_seconds=saved["train_seconds"], history=saved["history"],
                     best=saved["best"], optimizer=saved["optimizer"], schedule=saved.get("schedule"))  # fmt: skip
    else:
        draft.init_from_pca(torch.Generator().manual_seed(config.seed))
    if not config.learn_projections:
        draft.freeze_input_projection()
    pad_id = target.tokenizer.pad_token_id if target.tokenizer.pad_token_id is not None else 0
    state = train(config, draft, train_records, held_out.sampled, pad_id, deadline, state, calibration)

    # calibration: the τ that sharpens (or flattens) q best on the calibration prompts, folded into the head
    temperature, alpha_by_temperature = choose_temperature(draft, calibration, pad_id) if calibration else (1.0, {})
    fold_temperature(draft, temperature)
    # ... and the weight of the prompt lookup's token in the q the draft serves, per match length
    lookup_weights, lookup_report = ({}, {})
    if calibration and config.lookup_ngram > 0:
        lookup_weights, lookup_report = choose_lookup_weights(draft, calibration, pad_id, config.lookup_ngram)
    if not any(lookup_weights.values()):  # no length gained from the lookup: serve q alone
        lookup_weights = {}

    # 4. write (before 3, so the figures are measured on exactly what was written)
    weights = export_draft(config, draft, target, lookup_weights)
    written = load_model(str(out))

    # 3. evaluate the written draft against the target
    figures = evaluate(target, written, held_out, lookup_weights=lookup_weights)
    card = {
        "format": WEIGHTS_FORMAT,
        "target": config.target,
        "target_vocab_fingerprint": target.vocab_fingerprint,
        "draft_vocab_fingerprint": written.vocab_fingerprint,
        "figures": figures,
        "training": {
            "steps": state["step"], "train_seconds": round(state["train_seconds"], 1),
            "best_step": state["best"]["step"], "alpha_start": state["history"][0]["alpha_topk"],
            "greedy_agreement_start": state["history"][0]["greedy_agreement"],
            "history": state["history"], "wall_seconds_this_run": round(time.monotonic() - began, 1), **data_stats,
            "train_sequences_used": len(train_records), "train_positions_used": _positions(train_records),
        },  # fmt: skip
        "calibration": {
            "temperature": temperature, "alpha_topk_by_temperature": {f"{t:g}": round(a, 4) for t, a in alpha_by_temperature.items()},
            "sequences": len(calibration), "positions": _positions(calibration),
            "prompts": len({prompt_key(r) for r in calibration}), "picked_checkpoint_on": "calibration" if calibration else "held-out",
            "lookup_weights": format_lookup_weights(lookup_weights) if lookup_weights else "off",
            "lookup_by_match_length": lookup_report,
        },  # fmt: skip
        "architecture": {**_arch(config), "vocab_size": target.vocab_size, "target_width": int(embedding.shape[1]),
                         "output_vocab": len(vocab_ids), "output_vocab_held_out": coverage,
                         "input_embedding": "target embedding (frozen) x PCA projection"
                         + (", fine-tuned" if config.learn_projections else " (fixed)"),
                         "output_head": "learned [output_vocab, hidden], initialised from the projected embedding"},  # fmt: skip
        "weights_file": weights.name,
        "weights_bytes": weights.stat().st_size,
        "command": config.command(),
        "created_unix": time.time(),
    }
    write_json(out / DRAFT_CARD_NAME, card)
    return card


# ---------------------------------------------------------------------------------------
# helpers


def use_threads(config: DistillConfig) -> None:
    """torch threads for the run: --threads, or one per core when it is 0."""
    torch.set_num_threads(config.threads if config.threads > 0 else os.cpu_count() or 1)


def write_json(path: Path, value) -> None:
    write_atomically(path, lambda temp: temp.write_text(json.dumps(value, indent=2) + "\n"))


def _atomic_save(obj, path: Path) -> None:
    write_atomically(path, lambda temp: torch.save(obj, temp))


def _left(deadline: float) -> str:
    seconds = max(0, int(deadline - time.monotonic()))
    return f"{seconds // 60}:{seconds % 60:02d}"


# ---------------------------------------------------------------------------------------
# CLI


def add_distill_parser(subparsers) -> argparse.ArgumentParser:
    """Add the `distill` command to `subparsers` (an argparse subparsers object)."""
    defaults = DistillConfig(target="", out="")
    parser = subparsers.add_parser(
        "distill",
        help="make a fast draft model for a target by distillation",
        description="Sample text from the target, train a small Llama draft to match the target's "
        "distributions (KL(p||q) on its top-k), evaluate α, greedy agreement and step costs on held-out "
        "prompts, and write a model directory `specdec serve draft --model OUT` loads, with a card "
        f"({DRAFT_CARD_NAME}). --minutes covers data generation and training; the final evaluation and writing "
        "take about a minute more.",
    )
    parser.add_argument("--target", required=True, type=model_name, help="catalog name or path of the target model")
    parser.add_argument("--out", required=True, help="output directory (draft model, card, data cache, checkpoint)")
    parser.add_argument("--minutes", type=RANGES["minutes"], default=defaults.minutes,
                        help="wall-clock budget for data + training; 0 only with --resume of a run that has a "
                        "checkpoint: calibrate, write and evaluate it again (default: %(default)s)")
    parser.add_argument("--prompts", default=defaults.prompts, help="JSONL prompt set (default: the packaged set)")
    parser.add_argument("--eval-prompts", default="", help="JSONL of held-out prompts (default: the 'eval' split of --prompts)")
    parser.add_argument("--layers", type=RANGES["layers"], default=defaults.layers, help="draft layers (default: %(default)s)")
    parser.add_argument("--hidden", type=RANGES["hidden"], default=defaults.hidden, help="draft width (default: %(default)s)")
    parser.add_argument("--heads", type=RANGES["heads"], default=defaults.heads, help="draft attention heads (default: %(default)s)")
    parser.add_argument("--top-k", type=RANGES["top_k"], default=defaults.top_k, help="target log-probs stored per position (default: %(default)s)")
    parser.add_argument("--data-tokens", type=RANGES["data_tokens"], default=defaults.data_tokens, help="target-sampled positions to generate (default: %(default)s)")
    parser.add_argument("--data-share", type=RANGES["data_share"], default=defaults.data_share, help="largest share of --minutes spent sampling data; training gets the rest (default: %(default)s)")
    parser.add_argument("--max-new-tokens", type=RANGES["max_new_tokens"], default=defaults.max_new_tokens, help="continuation length (default: %(default)s)")
    parser.add_argument("--gen-batch-size", type=RANGES["gen_batch_size"], default=defaults.gen_batch_size, help="sequences sampled at once (default: %(default)s)")
    parser.add_argument("--batch-size", type=RANGES["batch_size"], default=defaults.batch_size, help="sequences per training step (default: %(default)s)")
    parser.add_argument("--lr", type=RANGES["lr"], default=defaults.lr, help="peak learning rate (default: %(default)s)")
    parser.add_argument("--dropout", type=RANGES["dropout"], default=defaults.dropout,
                        help="share of the draft's input, attention and final-state entries zeroed in training, "
                        "against learning the training text by heart (default: %(default)s)")
    parser.add_argument("--weight-decay", type=RANGES["weight_decay"], default=defaults.weight_decay,
                        help="AdamW weight decay of the draft's training (default: %(default)s)")
    parser.add_argument("--calibration-share", type=RANGES["calibration_share"], default=defaults.calibration_share,
                        help="share of the training prompts whose sampled sequences are kept out of training: they pick "
                        "the checkpoint written and the temperature folded into the draft's head (0: none; then the "
                        "held-out prompts pick the checkpoint and the temperature stays 1; default: %(default)s)")
    parser.add_argument("--lookup-ngram", type=RANGES["lookup_ngram"], default=defaults.lookup_ngram, metavar="N",
                        help="choose, on the calibration sequences, the weight of the prompt lookup's token in the "
                        "draft's q for each match length 1..N (written to specdec-lookup.json; the draft service "
                        "drafts from (1 - w) * q + w * that token); 0: none (default: %(default)s)")
    parser.add_argument("--seed", type=RANGES["seed"], default=defaults.seed, help="random seed (default: %(default)s)")
    parser.add_argument("--threads", type=RANGES["threads"], default=defaults.threads, help="torch threads (default: 0 = one per core)")
    parser.add_argument("--precision", choices=["auto", "float32", "bfloat16"], default=defaults.precision,
                        help="compute dtype of the target's sampling and of the draft's training steps; the draft's "
                        "weights and every evaluation stay float32 (auto: bfloat16 where the CPU multiplies it "
                        "natively, AVX-512 BF16 or AMX, else float32; default: %(default)s)")
    parser.add_argument("--temperatures", type=parse_temperatures, default=defaults.temperatures, metavar="T[,T...]",
                        help="sampling temperature of each batch of sequences in turn, e.g. 1,0.6 (0: greedy); the "
                        "stored distributions are the target's at temperature 1 whatever the sampling temperature "
                        "(default: 1,1,1,0: every fourth batch is the target's greedy continuation)")
    parser.add_argument("--eval-every", type=RANGES["eval_every_s"], default=defaults.eval_every_s, help="seconds between held-out evaluations (default: %(default)s)")
    parser.add_argument("--draft-vocab", type=RANGES["draft_vocab"], default=defaults.draft_vocab,
                        help="tokens the draft can predict: the ones holding most of the target's probability mass "
                        "in the sampled data; the rest get probability 0 (0: the whole vocabulary; default: %(default)s)")
    parser.add_argument("--learn-projections", action=argparse.BooleanOptionalAction, default=defaults.learn_projections,
                        help="train the projection of the target's embedding that feeds the draft "
                        "(--no-learn-projections keeps its PCA init; default: %(default)s)")
    parser.add_argument("--resume", action="store_true",
                        help="continue the run in --out (its data and checkpoint). The run fixes its target, "
                        "--prompts, --eval-prompts, " + ", ".join(flag_of(field) for field in DATA_OPTIONS)
                        + " (its data was sampled with them) and " + ", ".join(flag_of(field) for field in _arch(defaults))
                        + " (its checkpoint's draft): give the same")
    parser.add_argument("--evaluate", metavar="DRAFT", default="",
                        help="instead of distilling, print the held-out figures (JSON) of DRAFT, a model directory "
                        "or catalog name, on the held-out sets of the run in --out: compares drafts on one set")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    return parser


def valid_temperatures(values: tuple[float, ...]) -> bool:
    """At least one sampling temperature, each finite and >= 0 (0: greedy)."""
    return bool(values) and all(t in TEMPERATURE for t in values)


def parse_temperatures(text: str) -> tuple[float, ...]:
    """"1,0.6" -> (1.0, 0.6), for --temperatures."""
    try:
        values = tuple(float(part) for part in text.split(",") if part.strip())
    except ValueError:
        values = ()
    if not valid_temperatures(values):
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated temperatures >= 0, e.g. 1,0.6 (0: greedy)")
    return values


def config_from_args(args: argparse.Namespace) -> DistillConfig:
    return DistillConfig(
        target=args.target, out=args.out, minutes=args.minutes, prompts=args.prompts, eval_prompts=args.eval_prompts,
        layers=args.layers, hidden=args.hidden, heads=args.heads, top_k=args.top_k, data_tokens=args.data_tokens, data_share=args.data_share,
        max_new_tokens=args.max_new_tokens, gen_batch_size=args.gen_batch_size, batch_size=args.batch_size,
        lr=args.lr, dropout=args.dropout, weight_decay=args.weight_decay, calibration_share=args.calibration_share, lookup_ngram=args.lookup_ngram, seed=args.seed, threads=args.threads, precision=args.precision, temperatures=args.temperatures,
        learn_projections=args.learn_projections, draft_vocab=args.draft_vocab, eval_every_s=args.eval_every, resume=args.resume,
        progress=not args.no_progress,
    )  # fmt: skip


def run_distill(args: argparse.Namespace) -> int:
    """Handler of `specdec distill`: run it, print the figures; 0 on success, 1 on a usage error."""
    from specdec.models import CatalogFetchError

    try:
        if args.evaluate:
            print(json.dumps(evaluate_draft(config_from_args(args), args.evaluate)))
            return 0
        card = distill(config_from_args(args))
    except (DistillError, ModelNotFoundError, CatalogFetchError) as exc:
        print(f"specdec distill: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"\nspecdec distill: interrupted. {args.out} keeps the data sampled so far and, once training has "
              "begun, the draft as trained until now: run the same command with --resume to continue", file=sys.stderr)  # fmt: skip
        return 130
    figures = card["figures"]
    print(
        f"draft written to {args.out}\n"
        f"held-out: alpha {figures['alpha']:.3f}, greedy agreement {figures['greedy_agreement']:.3f}, "
        f"c_q {figures['c_q_ms']:.1f} ms, c_p {figures['c_p_ms']:.1f} ms (c_q/c_p {figures['cost_ratio']:.3f}), "
        f"on the target's greedy continuations: alpha {figures['greedy_path']['alpha']:.3f}, "
        f"greedy agreement {figures['greedy_path']['greedy_agreement']:.3f}, "
        f"expected speedup {figures['expected_speedup']:.2f}x at K={figures['best_k']}; "
        f"temperature folded into the head {card['calibration']['temperature']:g}\n"
        + (f"with the prompt lookup mixed in ({figures['with_lookup']['weights']}): alpha {figures['with_lookup']['alpha']:.3f}, "
           f"greedy agreement {figures['with_lookup']['greedy_agreement']:.3f}; on the greedy continuations alpha "
           f"{figures['with_lookup']['greedy_path']['alpha']:.3f}, greedy agreement "
           f"{figures['with_lookup']['greedy_path']['greedy_agreement']:.3f}; expected speedup "
           f"{figures['with_lookup']['expected_speedup']:.2f}x at K={figures['with_lookup']['best_k']}\n"
           if "with_lookup" in figures else "")
        + f"serve it: specdec serve draft --model {args.out} (requests that set no K get K = {figures['serving_k']}, "
          f"the most tokens per ms with the verify passes measured here)"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specdec.distill")
    commands = parser.add_subparsers(dest="command")
    add_distill_parser(commands)
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] != "distill":
        argv = ["distill", *argv]
    return run_distill(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
