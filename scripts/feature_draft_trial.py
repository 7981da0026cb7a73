"""Trial: does a draft that also reads the target's hidden state learn α faster than `specdec distill`'s?

Not a product: specdec's Propose and Verify carry no hidden states, so such a draft cannot be
served yet. This script measures what it would buy (README, "Make a draft", tried since).

    python scripts/feature_draft_trial.py sample --out DIR --minutes 9
    python scripts/feature_draft_trial.py train --data DIR --variant base --minutes 10 &
    python scripts/feature_draft_trial.py train --data DIR --variant feature --minutes 10

Terms: f_j is the target's final hidden state at position j (after its last norm: p at j + 1 is
softmax of its head times f_j); x_j the token at j. `base` is the draft `specdec distill`
trains (2 × 256 Llama, embedding = target embedding × projection, head over the 8,192
heaviest tokens, KL(p ∥ q) on p's top 256 + tail). `feature` is the same draft whose input at
a generated position j also adds proj_f(f_{j-1}), the hidden state the target had when it
produced x_j (what the target knows after a Verify), and which also learns to predict f_j (a
[256 → D] map, mean squared error over the mean square of f as a second loss) so a second
draft step can feed its own prediction back. Prompt positions get f = 0 (not recorded).

Both score held-out positions j = n_prompt + i (predicting generated token i + 1); `feature`
also reports `alpha_fed_back`: every generated position fed the draft's own predicted f̂_{j-1}
instead of f_{j-1}, a pessimistic stand-in for the second token of a cycle.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from specdec import distill
from specdec.models import load_model

TARGET = "smollm2-135m-instruct"


def sample(args: argparse.Namespace) -> None:
    """Held-out set (the 30 eval prompts), then training batches of 64 until --minutes."""
    torch.set_num_threads(args.threads)
    target = load_model(args.target)
    config = distill.DistillConfig(target=args.target, out=args.out)
    model = distill.sampling_model(config, target)
    tokenizer = target.tokenizer
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else target.eos_token_ids[0]
    train_prompts, eval_prompts = distill.load_prompts(config.prompts)
    encoded = [distill.encode_prompt(tokenizer, p) for p in train_prompts]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def draw(prompts: list[list[int]], seed: int) -> list[dict]:
        return distill.sample_batch(model, prompts, max_new_tokens=config.max_new_tokens,
                                    top_k=min(config.top_k, target.vocab_size), eos_ids=target.eos_token_ids,
                                    pad_id=pad_id, generator=torch.Generator().manual_seed(seed),
                                    keep_features=True)  # fmt: skip

    torch.save(draw([distill.encode_prompt(tokenizer, p) for p in eval_prompts], 10_000), out / "eval.pt")
    order = list(range(len(encoded)))
    random.Random(0).shuffle(order)
    records, positions, started = [], 0, time.monotonic()
    for shard in range(max(len(order) // 64, 1)):  # at least one batch, whatever --minutes
        if shard and time.monotonic() - started >= args.minutes * 60:
            break
        batch = draw([encoded[i] for i in order[shard * 64 : (shard + 1) * 64]], shard)
        records.extend(batch)
        positions += sum(r["topk_ids"].shape[0] for r in batch)
        torch.save(records, out / "train.pt")
        print(f"{time.monotonic() - started:.0f} s: {positions} positions", file=sys.stderr, flush=True)


class FeatureDraft(distill.DraftModel):
    """distill.DraftModel plus proj_f [H, D] (f into the input) and predict_f [D, H] (f̂ out)."""

    def __init__(self, target_embedding: torch.Tensor, config, vocab_ids: torch.Tensor):
        super().__init__(target_embedding, config, vocab_ids)
        width = target_embedding.shape[1]
        self.proj_f = torch.nn.Linear(width, config.hidden_size, bias=False)
        torch.nn.init.normal_(self.proj_f.weight, std=0.3 / math.sqrt(width))
        self.predict_f = torch.nn.Linear(config.hidden_size, width, bias=False)

    def hidden_states(self, ids: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """ids [B, T], features [B, T, D] (f_{j-1} at position j, 0 where unknown) -> [B, T, H]."""
        inputs = self.proj_in(F.embedding(ids, self.embedding)) + self.proj_f(features)  # [B, T, H]
        return self.body(inputs_embeds=inputs, use_cache=False).last_hidden_state


def make_batch(records: list[dict], pad_id: int, width: int) -> dict[str, torch.Tensor]:
    """ids [B, T], features [B, T, D], and the scored positions: rows/cols [N], p's top-k ids and
    log-probs there [N, k], and f there [N, D] (the feature loss's target)."""
    ids = distill._pad([r["ids"] for r in records], pad_id)  # [B, T]
    features = torch.zeros(ids.shape + (width,))  # [B, T, D]
    rows, cols, top_ids, top_logp, f_next = [], [], [], [], []
    for b, r in enumerate(records):
        n_prompt, n_gen = r["n_prompt"], r["topk_ids"].shape[0]
        features[b, n_prompt : n_prompt + n_gen] = r["features"].float()
        if n_gen < 2:
            continue
        rows.append(torch.full((n_gen - 1,), b))
        cols.append(torch.arange(n_prompt, n_prompt + n_gen - 1))
        top_ids.append(r["topk_ids"][1:].long())
        top_logp.append(r["topk_logp"][1:].float())
        f_next.append(r["features"][1:].float())
    cat = torch.cat
    return {"ids": ids, "features": features, "rows": cat(rows), "cols": cat(cols), "top_ids": cat(top_ids),
            "top_logp": cat(top_logp), "f_next": cat(f_next)}  # fmt: skip


def draft_hidden(draft, batch: dict, features: torch.Tensor | None = None) -> torch.Tensor:
    """The draft's final hidden state at every position [B, T, H]."""
    if isinstance(draft, FeatureDraft):
        return draft.hidden_states(batch["ids"], batch["features"] if features is None else features)
    return draft.hidden_states(batch["ids"])


@torch.no_grad()
def evaluate(draft, held_out: list[dict], pad_id: int, width: int) -> dict[str, float]:
    """Held-out α (from p's stored top-k: a lower bound) and greedy agreement."""
    draft.eval()
    sums = {"alpha": 0.0, "greedy": 0.0, "alpha_fed_back": 0.0, "greedy_fed_back": 0.0}
    count = 0

    def score(hidden: torch.Tensor, batch: dict, prefix: str) -> None:
        hidden = hidden[batch["rows"], batch["cols"]]  # [N, H]
        alpha, agree = distill.score_top_k(draft, draft.logits(hidden), batch["top_ids"], batch["top_logp"])
        sums["alpha" + prefix] += alpha
        sums["greedy" + prefix] += agree

    for start in range(0, len(held_out), 8):
        chunk = held_out[start : start + 8]
        batch = make_batch(chunk, pad_id, width)
        hidden = draft_hidden(draft, batch)
        score(hidden, batch, "")
        count += len(batch["rows"])
        if isinstance(draft, FeatureDraft):  # feed back f̂_{j-1} = predict_f(hidden at j - 1)
            predicted, fed = draft.predict_f(hidden), batch["features"].clone()
            for b, r in enumerate(chunk):
                n_prompt, n_gen = r["n_prompt"], r["topk_ids"].shape[0]
                fed[b, n_prompt + 1 : n_prompt + n_gen] = predicted[b, n_prompt : n_prompt + n_gen - 1]
            score(draft_hidden(draft, batch, fed), batch, "_fed_back")
    draft.train()
    keep = sums if isinstance(draft, FeatureDraft) else {k: v for k, v in sums.items() if "fed" not in k}
    return {k: round(v / count, 4) for k, v in keep.items()}


def train(args: argparse.Namespace) -> None:
    """Train one variant for --minutes (distill's lr schedule, batch and bf16 autocast)."""
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    target = load_model(args.target)
    embedding = target.model.get_input_embeddings().weight.detach()  # [V, D]
    width = embedding.shape[1]
    records = torch.load(Path(args.data) / "train.pt", weights_only=True)
    held_out = torch.load(Path(args.data) / "eval.pt", weights_only=True)
    config = distill.DistillConfig(target=args.target, out=args.data)
    llama = distill.draft_llama_config(target.model.config, hidden=config.hidden, layers=config.layers,
                                       heads=config.heads, vocab_size=target.vocab_size)  # fmt: skip
    vocab_ids = distill.choose_output_vocab(records, config.draft_vocab, target.vocab_size)
    draft = (FeatureDraft if args.variant == "feature" else distill.DraftModel)(embedding, llama, vocab_ids)
    draft.init_from_pca(torch.Generator().manual_seed(0))
    pad_id = target.tokenizer.pad_token_id or 0
    f_scale = float(torch.cat([r["features"].float() for r in records[:200]]).pow(2).mean())  # mean square of f
    params = [p for p in draft.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=config.lr, betas=(0.9, 0.95), weight_decay=0.0)
    rng, budget, step = random.Random(0), args.minutes * 60, 0
    started = last = time.monotonic()
    print(json.dumps({"variant": args.variant, "positions": sum(r["topk_ids"].shape[0] for r in records),
                      "step": 0, **evaluate(draft, held_out, pad_id, width)}), flush=True)  # fmt: skip
    done = False
    while not done:  # at least one step
        for group in optimizer.param_groups:
            group["lr"] = distill._lr_at(step, (time.monotonic() - started) / budget, config.lr)
        batch = make_batch(rng.sample(records, config.batch_size), pad_id, width)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            hidden = draft_hidden(draft, batch)[batch["rows"], batch["cols"]]  # [N, H]
            logits = draft.logits(hidden)  # [N, M]
            f_hat = draft.predict_f(hidden) if isinstance(draft, FeatureDraft) else None  # [N, D]
        loss = distill.kl_top_k(logits, draft.columns[batch["top_ids"]], batch["top_logp"])
        if f_hat is not None:
            loss = loss + (f_hat.float() - batch["f_next"]).pow(2).mean() / f_scale
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        step += 1
        done = time.monotonic() - started >= budget
        if done or time.monotonic() - last >= 60:  # a line each minute, and the last
            figures = evaluate(draft, held_out, pad_id, width)
            print(json.dumps({"step": step, "seconds": round(time.monotonic() - started), "loss": round(loss.item(), 3),
                              **figures}), flush=True)  # fmt: skip
            last = time.monotonic()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    s = commands.add_parser("sample", help="sample SmolLM2 with its top-256 log-probs and hidden states")
    s.add_argument("--target", default=TARGET, help="catalog name or path (default: %(default)s)")
    s.add_argument("--out", required=True)
    s.add_argument("--minutes", type=float, default=9.0)
    s.add_argument("--threads", type=int, default=2)
    t = commands.add_parser("train", help="train one variant on the sampled data, printing held-out figures each minute")
    t.add_argument("--target", default=TARGET, help="the target the data was sampled from")
    t.add_argument("--data", required=True)
    t.add_argument("--variant", choices=["base", "feature"], required=True)
    t.add_argument("--minutes", type=float, default=10.0)
    t.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    sample(args) if args.command == "sample" else train(args)


if __name__ == "__main__":
    main()
