"""Drafters: what proposes tokens for a session.

A drafter's `propose(state, k, sampling, generator)` is a generator of
(token, q, match_length) triples, at most k of them, computed one at a time so the
service can stream each the moment it exists. q is the exact warped distribution the
token was sampled from, as it travels (a draft_wire.WireQ), or None for a one-hot q (a
drafter with no distribution, or a model drafting greedily, whose q is the one-hot of
its token).
match_length is the proposal's confidence class for adaptive K: the n-gram length an
n-gram drafter matched, 0 for a model.

After each token the drafter leaves `state` as: held = what its model has seen,
pending = [that token]; so the next proposal (or the next cycle's `sync`) knows
what the cache covers.

A model drafter also drafts one token for each of several sessions in one forward pass
(`draft_batch` over Steps, which the draft service batches as specdec.batching says): the
rows of all of them go through each linear layer together; each token is then drawn with
its own session's sampling and generator, from a q that is its own up to float rounding
(and that q is what travels, so the output stays the target's whatever the rounding).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from specdec.batching import rerun_alone
from specdec.kvcache import SessionState, forward_batch
from specdec.ngram import DEFAULT_MAX_NGRAM, DEFAULT_MIN_NGRAM, NGRAM_DRAFT, find_continuation, lookup_token, mix_lookup
from specdec.sampling import greedy_token
from specdec.draft_wire import WireQ, wire_q
from specdec.wire import Sampling


log = logging.getLogger("specdec")

Proposal = tuple[int, WireQ | None, int]  # (token, q as it travels or None for one-hot, match_length)


# A step that feeds more tokens than this (a prefill: the prompt, or a long stretch committed
# since the session last drafted) drafts in a pass of its own. oneDNN builds and keeps a kernel
# for each row count a packed linear layer meets (specdec.packed), and passes that mixed
# prefills of every length with other sessions' steps met ever new counts: over a 5-minute soak
# the draft's RSS grew 555 -> 675 MiB, where one session a pass stayed at 557. A shared pass now
# has at most max_batch * MAX_BATCHED_ROWS rows, so few distinct counts. specdec.packed has
# since padded every packed product's rows to a few counts, which bounds them for any pass, so
# this rule no longer has to; a soak without it (2026-12-06, README) served as many requests and
# grew the draft's RSS a little more (+50 against +38 MiB), so it stays.
MAX_BATCHED_ROWS = 4


@dataclass
class Step:
    """One token to draft for one session (a job of specdec.batching)."""

    state: SessionState
    sampling: Sampling
    generator: torch.Generator

    @property
    def batchable(self) -> bool:
        return len(self.state.pending) <= MAX_BATCHED_ROWS

    @property
    def rows(self) -> int:
        """Tokens its pass feeds: the session's pending ones."""
        return max(1, len(self.state.pending))


class ModelDrafter:
    """Drafts with a causal LM: one forward pass per drafted token, on the session's KV cache.

    With `lookup_weights` (match length n -> λ_n, see specdec.ngram), each token is drawn from
    q' = (1 − λ_n)·q + λ_n·δ_c, c the token the prompt lookup proposes after the context so
    far (drafts included), and q' is what travels; greedy, the token is the argmax of q' with
    q the model's softmax over the ids its head scores (below).

    A draft whose head scores only part of the vocabulary (a SubsetHead: its output ids
    [M]) is warped, rounded and sampled over those M ids alone: every other id has logit
    -inf, so q is 0 there whatever the warp, and skipping them is the same q, sooner. A draft
    whose embedding has more rows than its tokenizer has ids samples over the ids alone.
    """

    kind = "model"

    def __init__(self, loaded, lookup_weights: dict[int, float] | None = None):
        self.loaded = loaded
        self.model = loaded.model
        self.lookup_weights = dict(lookup_weights or {})
        self.output_ids = getattr(self.model.get_output_embeddings(), "token_ids", None)  # [M] or None: all
        tokens = len(loaded.tokenizer) if getattr(loaded, "tokenizer", None) is not None else 0
        if self.output_ids is None and 0 < tokens < loaded.vocab_size:
            # Embedding rows past the tokenizer's ids (padding: Qwen2.5-0.5B has 151,936 rows
            # for 151,665 tokens) stand for no token: q is 0 there, so it fits any target of
            # this tokenizer however its own rows are padded (draft_wire.fit_length).
            self.output_ids = torch.arange(tokens, device=self.model.device)  # [M]

    def propose(
        self, state: SessionState, k: int, sampling: Sampling, generator: torch.Generator
    ) -> Iterator[Proposal]:
        for _ in range(k):
            [proposal] = self.draft_batch([Step(state, sampling, generator)])
            if isinstance(proposal, Exception):
                raise proposal
            yield proposal

    def draft_batch(self, steps: Sequence[Step]) -> list[Proposal | Exception]:
        """One token for each step's session, all in one forward pass over their pending
        tokens (module doc); when that pass fails, each session's cache is cropped back to what
        it held and each drafts in a pass of its own, so only one that fails alone fails."""
        try:
            logits = forward_batch(self.model, [step.state.cache for step in steps],
                                   [step.state.pending for step in steps], [1] * len(steps))  # each [1, V]  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - the session's error, for it alone where it can be
            if len(steps) == 1:
                return [exc]
            log.warning("a draft pass over %d sessions failed (%s): drafting them one at a time", len(steps), exc)
            return rerun_alone(steps, [None] * len(steps), self.draft_batch)
        results: list[Proposal | Exception] = []
        for step, rows in zip(steps, logits):
            try:
                results.append(self.choose(step, rows[-1]))
            except Exception as exc:  # noqa: BLE001 - this session's own error
                results.append(exc)
        return results

    def choose(self, step: Step, logits: torch.Tensor) -> Proposal:
        """Draw the step's token from the model's logits [V] after its pending tokens, and
        leave its state at held = the context, pending = [that token]."""
        state, sampling = step.state, step.sampling
        state.feed(state.pending)  # held is now the whole context (pending is reset below)
        looked_up, weight = lookup_token(state.held, self.lookup_weights) if self.lookup_weights else (-1, 0.0)
        if sampling.greedy:
            # Temperature 0: q is the one-hot of the argmax, which is the token; sent as
            # one-hot, it needs no [V] tensor here, on the wire or at the target.
            scored = self.head_logits(logits)  # [M]: the argmax over the head's ids alone, as draw_q samples
            best = greedy_token(scored)
            token = best if self.output_ids is None else int(self.output_ids[best])
            draft_probs = None
            if weight > 0 and token != looked_up:
                q = torch.softmax(scored.float(), -1)  # [M], as draw_q's
                at = self.head_index(looked_up)
                q_looked_up = 0.0 if at is None else float(q[at])
                if weight + (1 - weight) * q_looked_up >= (1 - weight) * float(q[best]):
                    token = looked_up
        else:
            draft_probs = self.draw_q(logits, sampling, looked_up, weight)
            token = draft_probs.sample(step.generator)
        state.pending = [token]
        return token, draft_probs, 0

    def draw_q(self, logits: torch.Tensor, sampling: Sampling, looked_up: int, weight: float) -> WireQ:
        """The q a token is drawn from, as it travels: logits [V] warped over the head's ids,
        mixed with the lookup's token `looked_up` at `weight` (0: not mixed)."""
        ids = self.output_ids
        q = sampling.warp(self.head_logits(logits))  # [M]
        if weight > 0:
            at = self.head_index(looked_up)  # looked_up's index in q
            if at is None:  # a token the head cannot score: q [M + 1] over ids [M + 1], 0 there before mixing
                at, ids, q = len(ids), torch.cat([ids, ids.new_tensor([looked_up])]), torch.cat([q, q.new_zeros(1)])
            q = mix_lookup(q, at, weight)
        return wire_q(q, ids, logits.shape[-1])

    def head_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [V] at the ids the head scores [M] (output_ids; all V where it scores every
        id): q lives on these, never on padded rows past the tokenizer's ids."""
        return logits if self.output_ids is None else logits[self.output_ids]

    def head_index(self, token: int) -> int | None:
        """`token`'s index among the head's ids (q's rows: output_ids, else every id); None
        where the head cannot score it."""
        if self.output_ids is None:
            return token
        found = (self.output_ids == token).nonzero()  # [0 or 1, 1]
        return int(found[0, 0]) if len(found) else None


class NgramDrafter:
    """Prompt-lookup drafting: find the most recent earlier occurrence of the longest
    suffix n-gram of the context and propose the tokens that followed it. One-hot q,
    no weights, no vocabulary of its own."""

    kind = NGRAM_DRAFT

    def __init__(self, max_ngram: int = DEFAULT_MAX_NGRAM, min_ngram: int = DEFAULT_MIN_NGRAM):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    def propose(
        self, state: SessionState, k: int, sampling: Sampling, generator: torch.Generator
    ) -> Iterator[tuple[int, torch.Tensor | None, int]]:
        continuation, match_length = find_continuation(state.tokens(), k, self.max_ngram, self.min_ngram)
        for token in continuation:
            state.feed(state.pending)
            state.pending = [token]
            yield token, None, match_length
