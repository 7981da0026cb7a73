"""Lossless speculative sampling: warping logits and the accept / resample rule.

Terms used throughout:

- **target**: the large model whose output we want. Its warped distributions are
  ``target_probs`` (the paper's p).
- **draft**: the small, cheap model (or n-gram lookup) that proposes tokens. Its warped
  distributions are ``draft_probs`` (the paper's q).
- **warped**: logits turned into the distribution a token is actually sampled from:
  temperature, then top-k, then top-p, then softmax (``warp``). Both sides must warp with the
  same settings, and the draft must sample from exactly the q it reports.
- **K**: the lookahead, the number of draft tokens proposed in one cycle.
- **draft tokens** x̃_0 .. x̃_{K-1}: the proposals. x̃_i was sampled from draft_probs[i],
  which was conditioned on the prefix plus x̃_0 .. x̃_{i-1}.
- **accepted**: x̃_i is accepted with probability min(1, p_i(x̃_i) / q_i(x̃_i)). We test
  ``u * q < p`` with u ~ U[0, 1), so q == p always accepts and p == 0 always rejects.
  Verification stops at the first rejection; every draft before it is kept, every draft
  after it is discarded (it was conditioned on the rejected token).
- **recovered token** (also: resampled): on the first rejection, at position i, one token is
  drawn from the residual distribution max(0, p_i - q_i) / Z, Z = sum(max(0, p_i - q_i)).
  The residual holds exactly the mass the target wanted and the draft under-proposed; it
  is what makes the output distributed as p. If Z is numerically zero (p_i ≈ q_i, so a
  rejection was all but impossible) we sample from p_i instead.
- **bonus token**: when all K drafts are accepted, the target's (K+1)-th distribution,
  target_probs[K], is already computed, so one more token is drawn from it for free.
- **one-hot draft**: a draft with no distribution (n-gram / prompt lookup) has q = one-hot
  of the token it proposes; pass ``draft_probs=None``.
- **α** (acceptance rate): the chance one draft token survives, sum_x min(p(x), q(x)).

One cycle emits ``num_accepted + 1`` tokens: the accepted drafts then the next token, which
is a recovered token if ``num_accepted < K`` and a bonus token if ``num_accepted == K``.
The emitted sequence is distributed exactly as sampling the target alone (Leviathan et al.
2023, Chen et al. 2023); ``tests/test_sampling.py`` checks that statistically.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from specdec.errors import UnusableLogits
from specdec.ranges import sampling_problem

# What UnusableLogits says (a model that computes such logits is broken, or overflows its dtype).
NON_FINITE = "logits contain NaN or +inf (from a model: broken weights, or values past its dtype's range)"
ALL_MINUS_INF = "a logits row is -inf everywhere: no token can be sampled"

# Logit dtypes numpy reads without a copy (greedy_ids).
NUMPY_FLOATS = (torch.float16, torch.float32, torch.float64)

# All acceptance arithmetic runs in this dtype, whatever the callers pass in.
PROB_DTYPE = torch.float32

# A distribution's rows may sum to 1 within this tolerance (float32 softmax over ~50k
# tokens, or a sparse q rounded on the wire, is off by far less).
SUM_TOLERANCE = 1e-3

# Below this residual mass Z, max(0, p - q) is float noise, not signal: sample from p.
# Reaching the recovery step at all has probability Z, so the fallback moves the output
# distribution by at most this much in total variation.
MIN_RESIDUAL_MASS = 1e-6


# --------------------------------------------------------------------------- warping


def warp(
    logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0
) -> torch.Tensor:
    """Turn logits into the distribution a token is sampled from.

    logits: [..., V] float. Returns float32 probabilities [..., V].

    temperature == 0 means greedy: the one-hot of the argmax (ties go to the lowest index,
    as ``torch.argmax``). Otherwise: divide by temperature, keep the ``top_k`` most likely
    tokens (0 or >= V: off), then keep the smallest set of most likely tokens whose
    probability mass reaches ``top_p`` (1.0: off; at least one token is always kept), then
    softmax. Removed tokens get probability exactly 0. Ties in rank go to the lowest index.
    """
    check_warp_params(temperature, top_k, top_p)
    check_logits(logits)
    vocab_size = logits.shape[-1]

    if temperature == 0:
        greedy_ids = torch.argmax(logits, dim=-1)  # [...]
        return torch.nn.functional.one_hot(greedy_ids, vocab_size).to(PROB_DTYPE)  # [..., V]

    # Shift by the max before dividing, so a tiny temperature cannot overflow to inf.
    logits = logits.to(PROB_DTYPE)  # [..., V]
    row_max = logits.amax(dim=-1, keepdim=True)  # [..., 1]
    scaled = (logits - row_max) / temperature  # [..., V]
    truncated = truncate_top_k_top_p(scaled, top_k, top_p)  # [..., V], -inf where removed
    return torch.softmax(truncated, dim=-1)  # [..., V]


def check_warp_params(temperature: float, top_k: int, top_p: float) -> None:
    """Raise ValueError unless temperature >= 0 (finite), top_k >= 0, top_p in (0, 1]."""
    if problem := sampling_problem(temperature, top_k, top_p):
        raise ValueError(problem)


def check_logits(logits: torch.Tensor) -> None:
    """Raise ValueError unless logits are a float tensor [..., V] with no NaN or +inf (then
    UnusableLogits, a ValueError too: errors.py)."""
    if not isinstance(logits, torch.Tensor):
        raise ValueError(f"logits must be a torch.Tensor, got {type(logits).__name__}")
    if not logits.is_floating_point():
        raise ValueError(f"logits must be floating point, got {logits.dtype}")
    if logits.dim() < 1 or logits.shape[-1] == 0:
        raise ValueError(f"logits must have shape [..., V] with V > 0, got {tuple(logits.shape)}")
    # One reduction finds all three: a row's max is NaN if it holds a NaN, +inf if it holds
    # +inf, -inf only if it is -inf everywhere (0.03 ms for 4 x 49,152, three scans 1.2 ms).
    row_max = logits.amax(dim=-1)  # [...]
    if torch.isnan(row_max).any() or torch.isposinf(row_max).any():
        raise UnusableLogits(NON_FINITE)
    if torch.isneginf(row_max).any():
        raise UnusableLogits(ALL_MINUS_INF)


# How many of the most likely tokens a row ranks before truncating, tried in turn before
# a full sort: a full sort of the vocabulary costs ~7 ms per row on a CPU core (49k
# entries), a top-1024 selection ~0.5 ms. Top-k alone ranks only its k tokens.
CANDIDATES = (1024, 8192)


def truncate_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Set to -inf every logit outside the top-k, then outside the top-p nucleus.

    logits: [..., V], already divided by the temperature. Returns [..., V].
    Each row ranks only its CANDIDATES most likely tokens (all tokens tied with the last
    of them included), which holds the whole result whenever those tokens hold top_p of
    the mass; otherwise the row is ranked in full. Either way the result is that of
    `truncate_by_full_sort`.
    """
    vocab_size = logits.shape[-1]
    if not (0 < top_k < vocab_size or top_p < 1.0):
        return logits
    if top_p >= 1.0:  # top-k alone: every row at once
        return logits.masked_fill(~keep_top_k(logits, top_k), -math.inf)
    return mask_rows(logits, lambda row, k: keep_mask(row, k, top_p), top_k)


def keep_top_k(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """Which tokens of logits [..., V] rank among the top_k (0 < top_k < V) of their row, ties
    to the lowest id (the full stable sort's ranking), as a bool [..., V]: every token above the
    k-th largest value, then as many tokens equal to it as the k ranks leave, lowest ids first."""
    boundary = torch.topk(logits, top_k, dim=-1).values[..., -1:]  # [..., 1]: the k-th largest
    above = logits > boundary  # [..., V]
    tied = logits == boundary  # [..., V]
    room = top_k - above.sum(dim=-1, keepdim=True)  # [..., 1]: ranks left for the tied tokens
    return above | (tied & (tied.cumsum(dim=-1) <= room))  # [..., V]


def mask_rows(logits: torch.Tensor, keep_row, top_k: int) -> torch.Tensor:
    """logits [..., V] with -inf wherever keep_row(row [V], top_k) [V] is False, row by row;
    top_k is passed as 0 when it keeps the whole vocabulary."""
    vocab_size = logits.shape[-1]
    top_k = top_k if 0 < top_k < vocab_size else 0
    rows = logits.reshape(-1, vocab_size)  # [R, V]
    if rows.shape[0] == 0:
        return logits
    keep = torch.stack([keep_row(row, top_k) for row in rows])  # [R, V]
    return logits.masked_fill(~keep.reshape(logits.shape), -math.inf)


def keep_mask(row: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Which tokens of one row [V] survive top-k (0: off) then top-p, as a bool [V]."""
    vocab_size = row.shape[0]
    sizes = [top_k] if top_p >= 1.0 else [max(top_k, size) for size in CANDIDATES]
    for size in sizes:
        if size < vocab_size:
            boundary = torch.topk(row, size).values[-1]
            candidates = torch.nonzero(row >= boundary).squeeze(1)  # [C], ascending ids, C >= size
            keep = keep_ranked(row, candidates, top_k, top_p, complete=False)
            if keep is not None:
                return keep
    return keep_ranked(row, torch.arange(vocab_size, device=row.device), top_k, top_p, complete=True)


def keep_ranked(row: torch.Tensor, candidates: torch.Tensor, top_k: int, top_p: float,
                complete: bool) -> torch.Tensor | None:  # fmt: skip
    """The definition of truncation, on `candidates` [C] (ascending ids of row [V] that hold
    every token ranked before any other): rank them, most likely first, ties to the lowest
    id; keep the first top_k ranks (0: all), then keep a token while the mass strictly
    before it (p normalised over what top-k kept) is below top_p. Returns a bool [V], or
    None when the candidates are not `complete` and the nucleus may reach past them."""
    values = row[candidates]  # [C]
    order = torch.sort(values, descending=True, stable=True).indices  # [C]
    keep_sorted = torch.ones(len(candidates), dtype=torch.bool, device=row.device)  # [C]
    if top_k:
        keep_sorted[top_k:] = False
    if top_p < 1.0:
        sorted_logits = values[order]  # [C]
        log_total = torch.logsumexp(sorted_logits[keep_sorted] if top_k else row, dim=-1)
        probs = torch.exp(sorted_logits - log_total).masked_fill(~keep_sorted, 0.0)  # [C]
        mass = probs.cumsum(dim=-1)  # [C]
        if not complete and not top_k and float(mass[-1]) < top_p:
            return None
        # Rank 0 has zero mass before it, so at least one token always survives.
        keep_sorted &= (mass - probs) < top_p
    keep = torch.zeros(row.shape[0], dtype=torch.bool, device=row.device)
    keep[candidates[order]] = keep_sorted
    return keep


def truncate_by_full_sort(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """truncate_top_k_top_p ranking every token of every row (the reference for tests).
    logits [..., V] -> [..., V] with -inf where removed."""
    everything = torch.arange(logits.shape[-1], device=logits.device)  # [V]
    return mask_rows(logits, lambda row, k: keep_ranked(row, everything, k, top_p, complete=True), top_k)


def draw_uniforms(shape, generator: torch.Generator | None, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """U[0, 1) numbers of `shape` on `device`, drawn by `generator` on the generator's own device
    and moved: the services' seeded generators are CPU ones (specdec.rng), so a model on a GPU
    draws the very numbers it would on a CPU (torch refuses a CPU generator for a GPU tensor)."""
    source = generator.device if generator is not None else device
    return torch.rand(shape, generator=generator, dtype=dtype, device=source).to(device)


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> int:
    """Draw one token id from probs [V]. Drafts use this to sample from exactly the q they send."""
    if not isinstance(probs, torch.Tensor) or probs.dim() != 1:
        raise ValueError(f"sample expects probs of shape [V], got {getattr(probs, 'shape', probs)}")
    return int(sample_rows(probs.unsqueeze(0), generator)[0])


def sample_rows(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token id per row of probs [B, V] (non-negative; a row need not sum to exactly 1).

    Inverse CDF: with u ~ U[0, 1), the first token whose cumulative mass, summed in float64,
    exceeds u · (row total). Each token is drawn with its probability up to float64 rounding,
    a token of probability 0 never (its interval is empty), and one uniform is used per row.
    On a CPU it takes 0.14 ms for a 49,152-token row, against 1.8 ms for torch.multinomial,
    which every draft token, every plain target step and every verdict pays.
    """
    cdf = probs.to(torch.float64).cumsum(-1)  # [B, V]
    total = cdf[:, -1:]  # [B, 1]
    if not bool(torch.isfinite(total).all()) or not bool((total > 0).all()):
        raise ValueError("cannot sample from a row with no probability mass, or a non-finite one")
    uniforms = draw_uniforms(total.shape, generator, probs.device, torch.float64)  # [B, 1]
    tokens = torch.searchsorted(cdf, uniforms * total, right=True).squeeze(1)  # [B]
    past_end = tokens >= probs.shape[-1]  # u · total rounded up to the total itself
    if bool(past_end.any()):
        last_with_mass = probs.shape[-1] - 1 - (probs > 0).flip(-1).int().argmax(-1)  # [B]
        tokens = torch.where(past_end, last_with_mass, tokens)
    return tokens


# --------------------------------------------------------------------------- validation


def check_distribution(
    probs: torch.Tensor, name: str = "q", vocab_size: int | None = None
) -> None:
    """Raise ValueError unless probs [..., V] is a valid (row-wise) probability distribution."""
    if not isinstance(probs, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(probs).__name__}")
    if not probs.is_floating_point():
        raise ValueError(f"{name} must be floating point, got {probs.dtype}")
    if probs.dim() < 1 or probs.shape[-1] == 0:
        raise ValueError(f"{name} must have shape [..., V] with V > 0, got {tuple(probs.shape)}")
    if vocab_size is not None and probs.shape[-1] != vocab_size:
        raise ValueError(
            f"{name} has vocabulary size {probs.shape[-1]} but {vocab_size} was expected "
            f"(shape {tuple(probs.shape)}); draft and target must share one vocabulary"
        )
    # One pass over probs for the common case: NaN and negatives fail `>= 0`, +inf makes its
    # row's sum inf; which of them it was is worked out only when one failed.
    row_sums = probs.to(PROB_DTYPE).sum(dim=-1)  # [...]
    if not (probs >= 0).all() or not torch.isfinite(row_sums).all():
        if not torch.isfinite(probs).all():
            raise ValueError(f"{name} contains NaN or inf")
        if (probs < 0).any():
            raise ValueError(f"{name} has negative entries (min {probs.min().item():.3g})")
    bad_rows = ((row_sums - 1).abs() > SUM_TOLERANCE).nonzero()
    if len(bad_rows) > 0:
        row = tuple(bad_rows[0].tolist())
        raise ValueError(
            f"{name} row {row} sums to {row_sums[row].item():.6f}, "
            f"expected 1 within {SUM_TOLERANCE}"
        )


def check_draft(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
) -> None:
    """Raise ValueError unless one cycle's inputs are consistent and well formed.

    draft_tokens [K] integer, draft_probs [K, V] or None (one-hot), target_probs [K + 1, V].
    """
    if not isinstance(draft_tokens, torch.Tensor):
        raise ValueError(f"draft_tokens must be a torch.Tensor, got {type(draft_tokens).__name__}")
    if draft_tokens.dim() != 1:
        raise ValueError(f"draft_tokens must have shape [K], got {tuple(draft_tokens.shape)}")
    if draft_tokens.is_floating_point() or draft_tokens.is_complex() or draft_tokens.dtype == torch.bool:
        raise ValueError(f"draft_tokens must be integer token ids, got {draft_tokens.dtype}")
    num_drafts = draft_tokens.shape[0]

    check_distribution(target_probs, name="target_probs (p)")
    if target_probs.dim() != 2 or target_probs.shape[0] != num_drafts + 1:
        raise ValueError(
            f"target_probs must have shape [K + 1, V] = [{num_drafts + 1}, V] for K = "
            f"{num_drafts} draft tokens, got {tuple(target_probs.shape)}"
        )
    vocab_size = target_probs.shape[1]
    if draft_tokens.device != target_probs.device:
        raise ValueError(
            f"draft_tokens are on {draft_tokens.device} but target_probs on {target_probs.device}"
        )

    check_draft_against(draft_tokens, draft_probs, vocab_size, target_probs.device)


def check_draft_against(
    draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None, vocab_size: int, device: torch.device
) -> None:
    """The draft half of `check_draft`: tokens [K] in [0, V), q [K, V] (or None) a distribution
    on `device` under which every draft token has probability > 0."""
    num_drafts = draft_tokens.shape[0]
    out_of_range = (draft_tokens < 0) | (draft_tokens >= vocab_size)  # [K]
    if out_of_range.any():
        index = int(out_of_range.nonzero()[0, 0])
        raise ValueError(
            f"draft token {int(draft_tokens[index])} at position {index} is outside "
            f"the vocabulary [0, {vocab_size})"
        )

    if draft_probs is None:
        return
    check_distribution(draft_probs, name="draft_probs (q)", vocab_size=vocab_size)
    if draft_probs.dim() != 2 or draft_probs.shape[0] != num_drafts:
        raise ValueError(
            f"draft_probs must have shape [K, V] = [{num_drafts}, {vocab_size}], "
            f"got {tuple(draft_probs.shape)}"
        )
    if draft_probs.device != device:
        raise ValueError(f"draft_probs are on {draft_probs.device} but target_probs on {device}")
    draft_token_probs = gather_token_probs(draft_probs, draft_tokens)  # [K]
    impossible = draft_token_probs <= 0  # [K]
    if impossible.any():
        index = int(impossible.nonzero()[0, 0])
        raise ValueError(
            f"draft token {int(draft_tokens[index])} at position {index} has q = 0: "
            f"the draft cannot have sampled it"
        )


def sparse_to_dense(
    ids: Sequence[int] | torch.Tensor, probs: Sequence[float] | torch.Tensor, vocab_size: int
) -> torch.Tensor:
    """Expand a sparse distribution (its support ``ids`` [S] and their ``probs`` [S]) to [V].

    Tokens outside ``ids`` get probability exactly 0. Row-sum checks are left to
    ``check_distribution``.
    """
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size <= 0:
        raise ValueError(f"vocab_size must be a positive int, got {vocab_size!r}")
    ids = torch.as_tensor(ids, dtype=torch.long)  # [S]
    probs = torch.as_tensor(probs, dtype=PROB_DTYPE)  # [S]
    if ids.dim() != 1 or probs.dim() != 1:
        raise ValueError(
            f"sparse ids and probs must be 1-D, got shapes {tuple(ids.shape)} and {tuple(probs.shape)}"
        )
    if ids.shape[0] != probs.shape[0]:
        raise ValueError(f"sparse ids has {ids.shape[0]} entries but probs has {probs.shape[0]}")
    if ids.shape[0] == 0:
        raise ValueError("sparse distribution has empty support: no token can have been sampled")
    out_of_range = (ids < 0) | (ids >= vocab_size)
    if out_of_range.any():
        bad = int(ids[out_of_range][0])
        raise ValueError(f"sparse token id {bad} is outside the vocabulary [0, {vocab_size})")
    if torch.unique(ids).shape[0] != ids.shape[0]:
        raise ValueError("sparse ids contain duplicates")
    if not torch.isfinite(probs).all():
        raise ValueError("sparse probs contain NaN or inf")
    if (probs < 0).any():
        raise ValueError(f"sparse probs have negative entries (min {probs.min().item():.3g})")
    dense = torch.zeros(vocab_size, dtype=PROB_DTYPE, device=probs.device)  # [V]
    dense[ids] = probs
    return dense


# --------------------------------------------------------------------------- accept / resample


def rejection_sample(
    draft_tokens: torch.Tensor | Sequence[int],
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    generator: torch.Generator | None = None,
    validate: bool = True,
) -> tuple[int, int]:
    """Verify one cycle's drafts; return (num_accepted, next_token) as Python ints.

    draft_tokens: [K] token ids, K >= 0 (K = 0: just sample next from target_probs[0]).
    draft_probs:  [K, V] warped q the drafts were sampled from, or None for one-hot q.
    target_probs: [K + 1, V] warped p at each draft position plus the bonus position.

    The emitted tokens are draft_tokens[:num_accepted] + [next_token]; next_token is a bonus
    token when num_accepted == K, a recovered token otherwise. Inputs are validated
    (``check_draft``) unless `validate` is False, for a caller whose inputs are valid by
    construction (the verifier: each q checked as it was decoded, p its own warp; the scans
    cost ~1.3 ms for K = 3 over 49,152 ids). Randomness is drawn exactly as
    ``rejection_sample_batch`` with B = 1.
    """
    if not isinstance(target_probs, torch.Tensor):
        raise ValueError(f"target_probs must be a torch.Tensor, got {type(target_probs).__name__}")
    if not isinstance(draft_tokens, torch.Tensor):
        draft_tokens = torch.as_tensor(list(draft_tokens), dtype=torch.long, device=target_probs.device)
    if validate:
        check_draft(draft_tokens, draft_probs, target_probs)

    num_drafts = torch.tensor([draft_tokens.shape[0]], device=target_probs.device)  # [1]
    num_accepted, next_tokens = rejection_sample_batch(
        draft_tokens.long().unsqueeze(0),  # [1, K]
        num_drafts,
        None if draft_probs is None else draft_probs.unsqueeze(0),  # [1, K, V]
        target_probs.unsqueeze(0),  # [1, K + 1, V]
        generator=generator,
    )
    return int(num_accepted[0]), int(next_tokens[0])


def greedy_verdict(
    draft_tokens: torch.Tensor | Sequence[int],
    draft_probs: torch.Tensor | None,
    target_logits: torch.Tensor,
) -> tuple[int, int]:
    """`rejection_sample`'s verdict at temperature 0, read off the target's logits without
    building p: (num_accepted, next_token).

    draft_tokens [K], draft_probs [K, V] or None (one-hot), target_logits [K + 1, V].

    At temperature 0 p_i is the one-hot of argmax_i (ties to the lowest index, as `warp`).
    A draft equal to it has p = 1 > u·q and is accepted; any other has p = 0 and is rejected.
    The next token is argmax at the first rejection (max(0, p − q) has mass only there, or
    none, and then p is the fallback) or, after K acceptances, the bonus argmax. So the
    verdict is certain and no random number is drawn; one pass over the logits replaces
    warping K + 1 rows of the vocabulary and the draws (3.3 ms for K = 2 on a CPU core).
    Inputs are validated as `rejection_sample` validates them.
    """
    if not isinstance(draft_tokens, torch.Tensor):
        draft_tokens = torch.as_tensor(list(draft_tokens), dtype=torch.long, device=target_logits.device)
    if draft_tokens.dim() != 1 or draft_tokens.is_floating_point() or draft_tokens.dtype == torch.bool:
        raise ValueError(f"draft_tokens must be integer token ids of shape [K], got {draft_tokens.dtype} "
                         f"{tuple(draft_tokens.shape)}")  # fmt: skip
    num_drafts = draft_tokens.shape[0]
    if not isinstance(target_logits, torch.Tensor) or not target_logits.is_floating_point():
        raise ValueError("target_logits must be a floating point torch.Tensor")
    if target_logits.dim() != 2 or target_logits.shape[0] != num_drafts + 1 or target_logits.shape[1] == 0:
        raise ValueError(f"target_logits must have shape [K + 1, V] = [{num_drafts + 1}, V], "
                         f"got {tuple(target_logits.shape)}")  # fmt: skip
    greedy = greedy_ids(target_logits)  # [K + 1]
    check_draft_against(draft_tokens, draft_probs, target_logits.shape[1], target_logits.device)
    drafts = draft_tokens.tolist()  # [K]
    num_accepted = 0
    while num_accepted < num_drafts and drafts[num_accepted] == greedy[num_accepted]:
        num_accepted += 1
    return num_accepted, greedy[num_accepted]


def greedy_ids(logits: torch.Tensor) -> list[int]:
    """The tokens temperature 0 samples from each row of logits [R, V]: the argmax, ties to
    the lowest index (as `warp`). Refuses what `warp` would: NaN, +inf, a row all -inf.

    On a CPU the argmax is numpy's (the first maximum; a NaN counts as the maximum, so it
    surfaces in row_max): for SmolLM2's 49,152 logits 4 us a row against 85 us for torch's
    reduction (14 against 176 us for a K = 2 verdict's 3 rows, on 2 threads), and Verify reads
    it on every cycle, a model draft on every token."""
    if logits.device.type == "cpu" and logits.dtype in NUMPY_FLOATS:
        rows = logits.detach().numpy()  # [R, V]
        ids = rows.argmax(axis=-1)  # [R]
        row_max = rows[range(len(ids)), ids]  # [R]
    else:
        ids = logits.argmax(dim=-1)  # [R]: the first maximum
        row_max = logits.gather(-1, ids.unsqueeze(-1)).squeeze(-1)  # [R]
    maxima = row_max.tolist()
    if any(math.isnan(m) or m == math.inf for m in maxima):
        raise UnusableLogits(NON_FINITE)
    if any(m == -math.inf for m in maxima):
        raise UnusableLogits(ALL_MINUS_INF)
    return ids.tolist()


def greedy_token(logits: torch.Tensor) -> int:
    """The token temperature 0 samples from logits [V]: argmax, ties to the lowest index."""
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point() or logits.dim() != 1 or not len(logits):
        raise ValueError("logits must be a non-empty floating point tensor of shape [V]")
    return greedy_ids(logits.unsqueeze(0))[0]


def rejection_sample_batch(
    draft_tokens: torch.Tensor,
    num_drafts: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify B sequences' drafts at once; return (num_accepted [B], next_tokens [B]).

    draft_tokens: [B, K_max] token ids; entries at positions >= num_drafts[b] are padding
                  and may hold anything.
    num_drafts:   [B] how many drafts each sequence has, 0 .. K_max.
    draft_probs:  [B, K_max, V] warped q (padding rows ignored), or None for one-hot q.
    target_probs: [B, K_max + 1, V] warped p.

    Row b emits draft_tokens[b, :num_accepted[b]] + [next_tokens[b]]; next_tokens[b] is a
    bonus token exactly when ``num_accepted[b] == num_drafts[b]``.

    Only shapes are checked here, not values (no q = 0 or row-sum checks): this is the fast
    path. ``rejection_sample`` validates fully. Randomness is consumed the same way for
    every input of the same shape: first one uniform per [B, K_max] slot, then one draw per
    row of a [B, V] matrix (`sample_rows`), so a seeded generator reproduces results.
    """
    batch_size, max_drafts = check_batch_shapes(draft_tokens, num_drafts, draft_probs, target_probs)
    vocab_size = target_probs.shape[-1]
    device = target_probs.device
    target_probs = target_probs.to(PROB_DTYPE)  # [B, K_max + 1, V]
    if draft_probs is not None:
        draft_probs = draft_probs.to(PROB_DTYPE)  # [B, K_max, V]

    # Padding may be garbage: point it at token 0 so gathers stay in range.
    positions = torch.arange(max_drafts, device=device)  # [K_max]
    is_real = positions < num_drafts.unsqueeze(1)  # [B, K_max]
    draft_tokens = torch.where(is_real, draft_tokens.long(), 0)  # [B, K_max]

    # 1. Accept x̃_i with probability min(1, p_i(x̃_i) / q_i(x̃_i)), as u * q < p.
    uniforms = draw_uniforms((batch_size, max_drafts), generator, device, PROB_DTYPE)  # [B, K_max]
    target_token_probs = gather_token_probs(target_probs[:, :max_drafts], draft_tokens)  # [B, K_max]
    if draft_probs is None:
        draft_token_probs = torch.ones_like(target_token_probs)  # [B, K_max]
    else:
        draft_token_probs = gather_token_probs(draft_probs, draft_tokens)  # [B, K_max]
    accepted = (uniforms * draft_token_probs < target_token_probs) & is_real  # [B, K_max]

    # 2. Keep everything before the first rejection, nothing after it.
    num_accepted = count_accepted_prefix(accepted)  # [B]
    is_bonus = num_accepted == num_drafts  # [B]

    # 3. The next token's distribution: p at the first rejected position, minus the draft's
    #    claim there (recovered token), or p after the last draft (bonus token).
    rows = torch.arange(batch_size, device=device)  # [B]
    next_target_probs = target_probs[rows, num_accepted]  # [B, V]
    if max_drafts == 0:
        next_probs = next_target_probs  # [B, V]
    else:
        rejected_position = num_accepted.clamp(max=max_drafts - 1)  # [B]; bonus rows unused
        if draft_probs is None:
            rejected_tokens = draft_tokens[rows, rejected_position]  # [B]
            rejected_draft_probs = torch.nn.functional.one_hot(rejected_tokens, vocab_size)  # [B, V]
            rejected_draft_probs = rejected_draft_probs.to(PROB_DTYPE)
        else:
            rejected_draft_probs = draft_probs[rows, rejected_position]  # [B, V]
        recovery_probs = compute_recovery_probs(next_target_probs, rejected_draft_probs)  # [B, V]
        next_probs = torch.where(is_bonus.unsqueeze(1), next_target_probs, recovery_probs)  # [B, V]

    # 4. One draw per row.
    next_tokens = sample_rows(next_probs, generator)  # [B]
    return num_accepted, next_tokens


def check_batch_shapes(
    draft_tokens: torch.Tensor,
    num_drafts: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
) -> tuple[int, int]:
    """Raise ValueError unless the batched shapes agree; return (B, K_max). Values unchecked."""
    if draft_tokens.dim() != 2:
        raise ValueError(f"draft_tokens must have shape [B, K_max], got {tuple(draft_tokens.shape)}")
    batch_size, max_drafts = draft_tokens.shape
    if num_drafts.shape != (batch_size,):
        raise ValueError(f"num_drafts must have shape [B] = [{batch_size}], got {tuple(num_drafts.shape)}")
    if target_probs.dim() != 3 or target_probs.shape[:2] != (batch_size, max_drafts + 1):
        raise ValueError(
            f"target_probs must have shape [B, K_max + 1, V] = [{batch_size}, {max_drafts + 1}, V], "
            f"got {tuple(target_probs.shape)}"
        )
    if draft_probs is not None and draft_probs.shape != (batch_size, max_drafts, target_probs.shape[2]):
        raise ValueError(
            f"draft_probs must have shape [B, K_max, V] = [{batch_size}, {max_drafts}, "
            f"{target_probs.shape[2]}], got {tuple(draft_probs.shape)}"
        )
    return batch_size, max_drafts


def gather_token_probs(probs: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """probs [..., V], tokens [...] -> the probability of each token [...]."""
    return probs.gather(-1, tokens.long().unsqueeze(-1)).squeeze(-1)


def count_accepted_prefix(accepted: torch.Tensor) -> torch.Tensor:
    """accepted [B, K] bool -> [B] number of leading True values (accepted before the first rejection)."""
    return accepted.long().cumprod(dim=1).sum(dim=1)


def compute_recovery_probs(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """The residual distribution max(0, p - q) / Z a recovered token is drawn from.

    target_probs, draft_probs: [..., V]. Returns [..., V]. Where Z <= MIN_RESIDUAL_MASS
    (p ≈ q, so rejection was all but impossible) returns target_probs instead.
    """
    residual = (target_probs - draft_probs).clamp(min=0)  # [..., V]
    residual_mass = residual.sum(dim=-1, keepdim=True)  # [..., 1]
    has_residual = residual_mass > MIN_RESIDUAL_MASS  # [..., 1]
    normalized = residual / residual_mass.clamp(min=MIN_RESIDUAL_MASS)  # [..., V]
    return torch.where(has_residual, normalized, target_probs)


# --------------------------------------------------------------------------- analytics


def acceptance_rate(draft_probs: torch.Tensor, target_probs: torch.Tensor) -> torch.Tensor:
    """α = sum_x min(p(x), q(x)) = 1 - TV(p, q): the chance one draft token is accepted.

    draft_probs, target_probs: [..., V]. Returns [...].
    """
    return torch.minimum(draft_probs, target_probs).sum(dim=-1)
