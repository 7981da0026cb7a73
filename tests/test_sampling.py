"""Tests for specdec.sampling: one test per claim of the seed question bank, plus the rest.

Statistical tests use fixed seeds, so they are deterministic; their tolerances are still
derived from the sample size (``tv_bound``, ``mean_bound``) so that a correct sampler fails
a check with probability at most 1e-6 under any seed (a new seed or a new torch RNG will
not make them flaky), while each bound stays far below the distortion a wrong rule causes
(every case is built with TV(p, q) > 0.2, so "emit q" or "emit something in between" fails).
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec.sampling import (
    MIN_RESIDUAL_MASS,
    SUM_TOLERANCE,
    acceptance_rate,
    check_distribution,
    check_draft,
    rejection_sample,
    rejection_sample_batch,
    sample,
    sparse_to_dense,
    warp,
)
from specdec.speedup import expected_speedup, expected_tokens_per_cycle

# Probability that one statistical check fails although the sampler is correct.
FAILURE_PROB = 1e-6

NUM_DRAWS = 50_000  # per first-token / acceptance-rate case
NUM_SEQUENCES = 200_000  # per whole-sequence (joint) case


# --------------------------------------------------------------------------- helpers


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """The tensors here are small: one thread is as fast on an idle machine and avoids
    OpenMP oversubscription (5-10x slowdowns) when other processes share the cores."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def tv_bound(num_categories: int, num_samples: int, failure_prob: float = FAILURE_PROB) -> float:
    """t with P(TV(empirical, true) >= t) <= failure_prob for num_samples i.i.d. draws.

    TV = max over the 2^V event sets A of P̂(A) - P(A); Hoeffding bounds each one-sided
    deviation by exp(-2 N t^2); the union over 2^V sets gives 2^V exp(-2 N t^2)
    (Bretagnolle-Huber-Carol). Solving for t: sqrt((V ln 2 + ln(1/δ)) / (2N)).
    """
    return math.sqrt((num_categories * math.log(2) + math.log(1 / failure_prob)) / (2 * num_samples))


def mean_bound(value_range: float, num_samples: int, failure_prob: float = FAILURE_PROB) -> float:
    """Two-sided Hoeffding bound on |empirical mean - mean| for values in an interval of this width."""
    return value_range * math.sqrt(math.log(2 / failure_prob) / (2 * num_samples))


def tv(a: torch.Tensor, b: torch.Tensor) -> float:
    return 0.5 * (a.double() - b.double()).abs().sum().item()


def empirical(tokens: torch.Tensor, num_categories: int) -> torch.Tensor:
    """tokens [N] -> [num_categories] frequencies."""
    return torch.bincount(tokens, minlength=num_categories).double() / tokens.numel()


def random_probs(generator: torch.Generator, *shape: int, scale: float = 2.0) -> torch.Tensor:
    """Random dense distributions [*shape] (last dim = V), peaky enough to differ a lot."""
    logits = scale * torch.randn(*shape, generator=generator, dtype=torch.float64)
    return torch.softmax(logits, dim=-1).float()


def truncate(probs: torch.Tensor, keep: int) -> torch.Tensor:
    """Keep the `keep` most likely tokens of each row, renormalize (a top-k draft)."""
    logits = probs.log()
    return warp(logits, temperature=1.0, top_k=keep)


def draw_iid(probs: torch.Tensor, num_samples: int, generator: torch.Generator) -> torch.Tensor:
    """probs [V] -> [num_samples] i.i.d. token ids (torch's own sampler: independent of the code under test)."""
    return torch.multinomial(probs, num_samples, replacement=True, generator=generator)


def run_cycles(
    draft_tokens: torch.Tensor,  # [N, K]
    draft_probs: torch.Tensor | None,  # [K, V] shared by all rows, or None
    target_probs: torch.Tensor,  # [K + 1, V] shared by all rows
    generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One cycle for each of N rows that share p and q; returns (num_accepted [N], next [N])."""
    num_rows, num_drafts = draft_tokens.shape
    return rejection_sample_batch(
        draft_tokens,
        torch.full((num_rows,), num_drafts, dtype=torch.long),
        None if draft_probs is None else draft_probs.expand(num_rows, -1, -1),
        target_probs.expand(num_rows, -1, -1),
        generator=generator,
    )


def sample_drafts(draft_probs: torch.Tensor, num_rows: int, generator: torch.Generator) -> torch.Tensor:
    """draft_probs [K, V] -> draft tokens [N, K], position i sampled from draft_probs[i]."""
    columns = [draw_iid(row, num_rows, generator) for row in draft_probs]
    return torch.stack(columns, dim=1) if columns else torch.zeros(num_rows, 0, dtype=torch.long)


def first_emitted_tokens(draft_tokens, num_accepted, next_tokens) -> torch.Tensor:
    """The first token each cycle emits: draft 0 if accepted, else the recovered token."""
    if draft_tokens.shape[1] == 0:
        return next_tokens
    return torch.where(num_accepted > 0, draft_tokens[:, 0], next_tokens)


def constant_alpha_case(alpha: float, num_drafts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """p, q over V = 3 with sum(min(p, q)) = alpha at every position.

    p = [α, 1 - α, 0], q = [α, 0, 1 - α]: a draft of token 0 is always accepted
    (p/q = 1), a draft of token 2 always rejected (p = 0), so each position accepts
    independently with probability exactly α.
    """
    target_probs = torch.tensor([alpha, 1 - alpha, 0.0]).repeat(num_drafts + 1, 1)  # [K+1, 3]
    draft_probs = torch.tensor([alpha, 0.0, 1 - alpha]).repeat(num_drafts, 1)  # [K, 3]
    return draft_probs, target_probs


# --------------------------------------------------------------------------- seed bank: losslessness


FIRST_TOKEN_KINDS = ["dense", "draft_top_k", "both_top_k", "one_hot"]


def make_first_token_case(vocab_size: int, num_drafts: int, kind: str, seed: int):
    """A (draft_probs or None, target_probs, one-hot draft token or None) with TV(p0, q0) > 0.2."""
    generator = torch.Generator().manual_seed(seed)
    half = (vocab_size + 1) // 2
    for _ in range(1000):
        target_probs = random_probs(generator, num_drafts + 1, vocab_size)  # [K+1, V]
        draft_probs = random_probs(generator, num_drafts, vocab_size)  # [K, V]
        one_hot_tokens = None
        if kind in ("draft_top_k", "both_top_k"):
            draft_probs = truncate(draft_probs, half)
        if kind == "both_top_k":
            target_probs = truncate(target_probs, max(1, vocab_size - 1))
        if kind == "one_hot":
            one_hot_tokens = torch.randint(vocab_size, (num_drafts,), generator=generator)
            draft_probs = torch.nn.functional.one_hot(one_hot_tokens, vocab_size).float()
        if tv(target_probs[0], draft_probs[0]) > 0.2:
            return (None if kind == "one_hot" else draft_probs), target_probs, one_hot_tokens
    raise AssertionError("no case with TV(p, q) > 0.2 found")


@pytest.mark.parametrize("kind", FIRST_TOKEN_KINDS)
@pytest.mark.parametrize("num_drafts", [1, 2, 3, 4])
@pytest.mark.parametrize("vocab_size", [2, 3, 5, 8])
def test_first_emitted_token_is_distributed_as_target_not_draft(vocab_size, num_drafts, kind):
    """Seed bank: speculative decoding does not change what the target would sample."""
    seed = 1000 * vocab_size + 10 * num_drafts + FIRST_TOKEN_KINDS.index(kind)
    draft_probs, target_probs, one_hot_tokens = make_first_token_case(vocab_size, num_drafts, kind, seed)
    generator = torch.Generator().manual_seed(seed)
    if one_hot_tokens is None:
        draft_tokens = sample_drafts(draft_probs, NUM_DRAWS, generator)  # [N, K]
        draft_first = draft_probs[0]
    else:
        draft_tokens = one_hot_tokens.expand(NUM_DRAWS, -1)  # [N, K]
        draft_first = torch.nn.functional.one_hot(one_hot_tokens[0], vocab_size).float()

    num_accepted, next_tokens = run_cycles(draft_tokens, draft_probs, target_probs, generator)
    first = empirical(first_emitted_tokens(draft_tokens, num_accepted, next_tokens), vocab_size)

    bound = tv_bound(vocab_size, NUM_DRAWS)
    assert bound < 0.015
    assert tv(first, target_probs[0]) < bound
    # Not vacuous: the draft's own distribution is far away.
    assert tv(first, draft_first) > tv(target_probs[0], draft_first) - bound > 0.18


def make_context_model(vocab_size: int, max_context: int, seed: int, truncate_rows: bool) -> torch.Tensor:
    """A tiny random "language model": a table [C, V] of next-token distributions.

    A context (t_1 .. t_n) is encoded as code = sum_j (t_j + 1) (V + 1)^(n - j), built
    incrementally by code' = code (V + 1) + t + 1 from the empty context code 0, so every
    context of length <= max_context has its own row. With truncate_rows, about a third of
    the rows have their least likely token zeroed (a top-k model).
    """
    generator = torch.Generator().manual_seed(seed)
    num_codes = (vocab_size + 1) ** max_context
    table = random_probs(generator, num_codes, vocab_size)  # [C, V]
    if truncate_rows:
        rows = torch.rand(num_codes, generator=generator) < 1 / 3  # [C]
        table[rows] = truncate(table[rows], vocab_size - 1)
    return table


def extend_context(codes: torch.Tensor, tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    return codes * (vocab_size + 1) + tokens + 1


def simulate_speculative_decoding(
    target_table: torch.Tensor,  # [C, V]
    draft_table: torch.Tensor,  # [C, V]
    num_drafts: torch.Tensor,  # [N] K per sequence (0 .. K_max)
    num_tokens: int,
    one_hot_draft: bool,
    generator: torch.Generator,
) -> torch.Tensor:
    """Run full cycles for N sequences until each has emitted num_tokens; return [N, num_tokens].

    The draft samples K tokens autoregressively from draft_table (or, for a one-hot draft,
    proposes the argmax of draft_table deterministically, like an n-gram lookup); the
    target's distributions at the K + 1 positions come from target_table; the sampler
    decides; accepted drafts and the next token are appended; repeat.
    """
    vocab_size = target_table.shape[1]
    num_sequences = num_drafts.shape[0]
    max_drafts = int(num_drafts.max())
    emitted = torch.zeros(num_sequences, num_tokens + max_drafts + 1, dtype=torch.long)  # [N, T]
    lengths = torch.zeros(num_sequences, dtype=torch.long)  # [N]
    codes = torch.zeros(num_sequences, dtype=torch.long)  # [N] context code of the emitted prefix

    while True:
        active = (lengths < num_tokens).nonzero().squeeze(1)  # [n]
        if active.numel() == 0:
            break
        n = active.numel()
        draft_tokens = torch.zeros(n, max_drafts, dtype=torch.long)  # [n, K_max]
        draft_probs = torch.zeros(n, max_drafts, vocab_size)  # [n, K_max, V]
        target_probs = torch.zeros(n, max_drafts + 1, vocab_size)  # [n, K_max + 1, V]
        context = codes[active]  # [n]
        for i in range(max_drafts):
            target_probs[:, i] = target_table[context]
            draft_probs[:, i] = draft_table[context]
            if one_hot_draft:
                draft_tokens[:, i] = draft_table[context].argmax(dim=1)
            else:
                draft_tokens[:, i] = torch.multinomial(draft_table[context], 1, generator=generator)[:, 0]
            context = extend_context(context, draft_tokens[:, i], vocab_size)
        target_probs[:, max_drafts] = target_table[context]

        num_accepted, next_tokens = rejection_sample_batch(
            draft_tokens,
            num_drafts[active],
            None if one_hot_draft else draft_probs,
            target_probs,
            generator=generator,
        )

        # Append drafts[:num_accepted] + [next] to each active sequence.
        offsets = torch.arange(max_drafts + 1)  # [K_max + 1]
        new_tokens = torch.cat([draft_tokens, torch.zeros(n, 1, dtype=torch.long)], dim=1)  # [n, K_max + 1]
        new_tokens[torch.arange(n), num_accepted] = next_tokens
        keep = offsets.unsqueeze(0) <= num_accepted.unsqueeze(1)  # [n, K_max + 1]
        rows = active.unsqueeze(1).expand(-1, max_drafts + 1)[keep]
        columns = (lengths[active].unsqueeze(1) + offsets.unsqueeze(0))[keep]
        emitted[rows, columns] = new_tokens[keep]
        lengths[active] += num_accepted + 1

        # Context codes for the next cycle (only prefixes shorter than num_tokens matter).
        codes[active] = 0
        for j in range(num_tokens):
            grow = active[lengths[active] > j]
            codes[grow] = extend_context(codes[grow], emitted[grow, j], vocab_size)
    return emitted[:, :num_tokens]


def exact_joint(table: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """The exact probability of each token sequence of length num_tokens, [V ** num_tokens]."""
    vocab_size = table.shape[1]
    joint = torch.zeros(vocab_size**num_tokens, dtype=torch.float64)
    for index, sequence in enumerate(itertools.product(range(vocab_size), repeat=num_tokens)):
        code, prob = 0, 1.0
        for token in sequence:
            prob *= table[code, token].item()
            code = code * (vocab_size + 1) + token + 1
        joint[index] = prob
    return joint


def sequence_index(tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[N, L] -> [N] index of each sequence in itertools.product order."""
    index = torch.zeros(tokens.shape[0], dtype=torch.long)
    for column in tokens.T:
        index = index * vocab_size + column
    return index


JOINT_CASES = [
    (vocab_size, num_drafts, draft_kind)
    for vocab_size in (2, 3)
    for num_drafts in (1, 2, 3, "mixed 0-3")
    for draft_kind in ("sampled", "one_hot")
]


@pytest.mark.parametrize("vocab_size, num_drafts, draft_kind", JOINT_CASES)
def test_whole_emitted_sequence_is_distributed_as_target(vocab_size, num_drafts, draft_kind):
    """The key test: full speculative cycles over context-dependent p and q emit token
    sequences whose joint distribution is the target's own, across cycle boundaries,
    rejections, recovered and bonus tokens (and, in the mixed case, K varying by sequence).
    """
    num_tokens, max_drafts = 3, 3
    seed = 7 * vocab_size + JOINT_CASES.index((vocab_size, num_drafts, draft_kind))
    one_hot_draft = draft_kind == "one_hot"
    max_context = num_tokens - 1 + max_drafts
    target_table, draft_table, target_joint, draft_joint = make_joint_case(
        vocab_size, max_context, num_tokens, one_hot_draft, seed
    )
    generator = torch.Generator().manual_seed(seed)
    if num_drafts == "mixed 0-3":
        per_sequence = torch.randint(0, max_drafts + 1, (NUM_SEQUENCES,), generator=generator)
    else:
        per_sequence = torch.full((NUM_SEQUENCES,), num_drafts)

    emitted = simulate_speculative_decoding(
        target_table, draft_table, per_sequence, num_tokens, one_hot_draft, generator
    )
    num_sequences = vocab_size**num_tokens
    observed = empirical(sequence_index(emitted, vocab_size), num_sequences)

    bound = tv_bound(num_sequences, NUM_SEQUENCES)
    assert bound < 0.01
    assert tv(observed, target_joint) < bound
    # Not vacuous: the draft model's joint is far from the target's, and from what we saw.
    assert tv(observed, draft_joint) > tv(target_joint, draft_joint) - bound > 0.19


def make_joint_case(vocab_size: int, max_context: int, num_tokens: int, one_hot_draft: bool, seed: int):
    """Target and draft tables whose joints over num_tokens tokens differ by TV > 0.2.

    Returns (target_table, draft_table, target_joint, draft_joint). For a one-hot draft the
    draft proposes the argmax of draft_table, so its joint is a point mass.
    """
    for attempt in range(100):
        case_seed = seed + 1000 * attempt
        target_table = make_context_model(vocab_size, max_context, case_seed, truncate_rows=True)
        draft_table = make_context_model(vocab_size, max_context, case_seed + 1, truncate_rows=not one_hot_draft)
        target_joint = exact_joint(target_table, num_tokens)
        if one_hot_draft:
            point_masses = torch.nn.functional.one_hot(draft_table.argmax(1), vocab_size).double()
            draft_joint = exact_joint(point_masses, num_tokens)
        else:
            draft_joint = exact_joint(draft_table, num_tokens)
        if tv(target_joint, draft_joint) > 0.2:
            return target_table, draft_table, target_joint, draft_joint
    raise AssertionError("no target/draft pair with TV > 0.2 found")


# --------------------------------------------------------------------------- seed bank: the rule


def test_identical_draft_accepts_every_token_and_adds_target_bonus():
    """Seed bank: q = p accepts everything (min(1, p/q) = 1); K drafts give K + 1 tokens,
    the bonus drawn from target_probs[K]."""
    generator = torch.Generator().manual_seed(0)
    for num_drafts in range(1, 6):
        target_probs = random_probs(generator, num_drafts + 1, 6)  # [K+1, V]
        draft_probs = target_probs[:num_drafts].clone()  # [K, V]
        draft_tokens = sample_drafts(draft_probs, NUM_DRAWS, generator)  # [N, K]
        num_accepted, next_tokens = run_cycles(draft_tokens, draft_probs, target_probs, generator)
        assert (num_accepted == num_drafts).all()
        bonus = empirical(next_tokens, 6)
        assert tv(bonus, target_probs[num_drafts]) < tv_bound(6, NUM_DRAWS)


def test_at_alpha_one_a_draft_as_costly_as_the_target_makes_k_plus_one_tokens_for_k_plus_one_passes_no_gain():
    """Seed bank: q = p accepts every draft (the sampler: the identical-draft tests above), yet
    drafting K tokens with the target itself costs K target passes per cycle: by the speedup
    model, (K + 1) tokens for K + 1 passes, no gain at all."""
    for k in range(1, 9):
        assert expected_tokens_per_cycle(1.0, k) == pytest.approx(k + 1)
        assert expected_speedup(1.0, k, cost_ratio=1.0) == pytest.approx(1.0)
    assert expected_speedup(1.0, 4, cost_ratio=0.1) > 3  # the same α from a cheap draft is the gain


def test_identical_draft_accepts_everything_for_every_seed():
    generator = torch.Generator().manual_seed(1)
    target_probs = random_probs(generator, 4, 7)  # [4, 7]
    for seed in range(300):
        draft_tokens = torch.multinomial(target_probs[:3], 1, generator=generator).squeeze(1)  # [3]
        num_accepted, _ = rejection_sample(draft_tokens, target_probs[:3], target_probs,
                                           torch.Generator().manual_seed(seed))
        assert num_accepted == 3


def test_all_k_accepted_gives_k_plus_one_tokens_with_bonus_from_last_target_row():
    """Seed bank: all K accepted yields K + 1 tokens, not K. target_probs[K] is one-hot and
    target_probs[K - 1] puts no mass there, so an off-by-one bonus row would show."""
    vocab_size = 5
    for num_drafts in range(1, 5):
        target_probs = torch.full((num_drafts + 1, vocab_size), 0.25)
        target_probs[:, 4] = 0.0
        target_probs[num_drafts] = torch.nn.functional.one_hot(torch.tensor(4), vocab_size).float()
        draft_tokens = torch.arange(num_drafts) % 4  # [K]
        for seed in range(50):
            num_accepted, next_token = rejection_sample(
                draft_tokens, target_probs[:num_drafts], target_probs, torch.Generator().manual_seed(seed)
            )
            emitted = draft_tokens[:num_accepted].tolist() + [next_token]
            assert num_accepted == num_drafts
            assert len(emitted) == num_drafts + 1
            assert next_token == 4


def test_draft_token_with_zero_target_prob_is_always_rejected():
    """Seed bank: p(x̃) = 0 gives min(1, 0/q) = 0, whatever q(x̃) is."""
    target_probs = torch.tensor([[0.0, 0.5, 0.5, 0.0], [0.25, 0.25, 0.25, 0.25]])  # [2, V]
    for q_token in (1e-6, 0.5, 1.0):
        draft_probs = torch.tensor([[q_token, (1 - q_token) / 3, (1 - q_token) / 3, (1 - q_token) / 3]])
        for seed in range(200):
            num_accepted, next_token = rejection_sample(
                torch.tensor([0]), draft_probs, target_probs, torch.Generator().manual_seed(seed)
            )
            assert num_accepted == 0
            assert target_probs[0, next_token] > 0
    # One-hot draft too.
    for seed in range(200):
        num_accepted, _ = rejection_sample([3], None, target_probs, torch.Generator().manual_seed(seed))
        assert num_accepted == 0


def test_everything_before_first_rejection_is_kept_and_everything_after_discarded():
    """Seed bank: a rejection at position j keeps drafts 0 .. j-1 and drops j and later,
    even when the later drafts would have been accepted (break at the first rejection)."""
    vocab_size, num_drafts = 6, 4
    generator = torch.Generator().manual_seed(2)
    for rejected_at in range(num_drafts):
        target_probs = random_probs(generator, num_drafts + 1, vocab_size)  # [K+1, V]
        draft_probs = target_probs[:num_drafts].clone()  # q = p: accepts for sure ...
        target_probs[rejected_at, 0] = 0.0  # ... except token 0 at `rejected_at`, which p forbids
        target_probs[rejected_at] /= target_probs[rejected_at].sum()
        draft_tokens = torch.multinomial(draft_probs, 1, generator=generator).squeeze(1)  # [K]
        draft_tokens[rejected_at] = 0
        for seed in range(100):
            num_accepted, next_token = rejection_sample(
                draft_tokens, draft_probs, target_probs, torch.Generator().manual_seed(seed)
            )
            assert num_accepted == rejected_at
            assert next_token != 0 and target_probs[rejected_at, next_token] > 0


def test_acceptance_ratio_is_p_over_q_not_q_over_p():
    """Spot the error: accept with min(1, p/q), not min(1, q/p). p/q = 3 must always accept
    (flipped: 1/3); p/q = 1/4 must accept a quarter of the time (flipped: always)."""
    generator = torch.Generator().manual_seed(3)
    target_probs = torch.tensor([[0.6, 0.2, 0.2], [1 / 3, 1 / 3, 1 / 3]])  # [2, 3]
    draft_probs = torch.tensor([[0.2, 0.8, 0.0]])  # [1, 3]
    bound = mean_bound(1.0, NUM_DRAWS)

    num_accepted, _ = run_cycles(torch.zeros(NUM_DRAWS, 1, dtype=torch.long), draft_probs, target_probs, generator)
    assert (num_accepted == 1).all()  # p(0)/q(0) = 3

    num_accepted, _ = run_cycles(torch.ones(NUM_DRAWS, 1, dtype=torch.long), draft_probs, target_probs, generator)
    assert abs(num_accepted.double().mean().item() - 0.25) < bound  # p(1)/q(1) = 1/4


def test_acceptance_is_probabilistic_not_a_hard_p_greater_than_q_threshold():
    """Why min(1, p/q) and not 'accept iff p > q': the hard cutoff is not lossless. With
    p(x̃) = 0.3, q(x̃) = 0.6 the token must be accepted half the time, not never."""
    # The hard rule's output distribution really differs from p for this pair.
    target = torch.tensor([0.3, 0.7])
    draft = torch.tensor([0.6, 0.4])
    hard_accept = (target >= draft).double()
    residual = (target - draft).clamp(min=0) / (target - draft).clamp(min=0).sum()
    hard_output = draft * hard_accept + (draft * (1 - hard_accept)).sum() * residual
    assert tv(hard_output, target) > 0.1

    generator = torch.Generator().manual_seed(4)
    target_probs = torch.stack([target, target]).float()  # [2, 2]
    draft_tokens = torch.zeros(NUM_DRAWS, 1, dtype=torch.long)
    num_accepted, next_tokens = run_cycles(draft_tokens, draft.unsqueeze(0).float(), target_probs, generator)
    assert abs(num_accepted.double().mean().item() - 0.5) < mean_bound(1.0, NUM_DRAWS)
    # And with drafts sampled from q, the rule reproduces p where the hard cutoff would not.
    draft_tokens = sample_drafts(draft.unsqueeze(0).float(), NUM_DRAWS, generator)
    num_accepted, next_tokens = run_cycles(draft_tokens, draft.unsqueeze(0).float(), target_probs, generator)
    first = empirical(first_emitted_tokens(draft_tokens, num_accepted, next_tokens), 2)
    assert tv(first, target) < tv_bound(2, NUM_DRAWS)


def test_recovered_token_is_drawn_from_clipped_residual_not_from_q_or_p():
    """Spot the error / why max(0, p - q): after a rejection the token comes from
    max(0, p - q) / Z. Here that is [0.75, 0.25, 0, 0]; q would give [.1, .2, .3, .4],
    p [.4, .3, .3, 0], and the unclipped p - q = [.3, .1, 0, -.4] is no distribution."""
    generator = torch.Generator().manual_seed(5)
    target_probs = torch.tensor([[0.4, 0.3, 0.3, 0.0], [0.25] * 4])  # [2, 4]
    draft_probs = torch.tensor([[0.1, 0.2, 0.3, 0.4]])  # [1, 4]
    draft_tokens = torch.full((NUM_DRAWS, 1), 3)  # p(3) = 0: always rejected
    num_accepted, next_tokens = run_cycles(draft_tokens, draft_probs, target_probs, generator)
    assert (num_accepted == 0).all()
    recovered = empirical(next_tokens, 4)
    expected = torch.tensor([0.75, 0.25, 0.0, 0.0])
    assert tv(recovered, expected) < tv_bound(4, NUM_DRAWS)
    assert tv(recovered, target_probs[0]) > 0.3


def test_recovered_token_after_certain_rejection_is_the_only_residual_token():
    """max(0, p - q) can leave a single token: then the recovered token is fixed."""
    target_probs = torch.tensor([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]])  # [2, 3]
    draft_probs = torch.tensor([[0.9, 0.1, 0.0]])  # residual = [0, 0.4, 0]
    rejections = 0
    for seed in range(300):
        num_accepted, next_token = rejection_sample([0], draft_probs, target_probs, torch.Generator().manual_seed(seed))
        if num_accepted == 0:
            assert next_token == 1
            rejections += 1
    assert 80 < rejections < 190  # rejected with 1 - 0.5/0.9 = 4/9: ~133 of 300 (a sampler that never rejects passed)


def test_recovery_falls_back_to_target_when_residual_mass_is_zero():
    """If p ≈ q the residual is empty (Z = 0); a forced rejection must still sample from p."""
    from specdec.sampling import compute_recovery_probs

    target = torch.tensor([[0.2, 0.3, 0.5]])
    assert torch.equal(compute_recovery_probs(target, target.clone()), target)
    nearly = target + torch.tensor([[MIN_RESIDUAL_MASS / 10, -MIN_RESIDUAL_MASS / 10, 0.0]])
    assert torch.equal(compute_recovery_probs(target, nearly), target)


def test_a_residual_just_above_the_fallback_threshold_is_drawn_from_not_replaced_by_p():
    """The fallback to p is for a residual that is numerically nothing; one above
    MIN_RESIDUAL_MASS is the distribution. A threshold set 20,000 times too high (0.02) passed
    every sampled test, which cannot see a bias under ~1%, yet moves each recovered token by up
    to the threshold: pinned here from above, exactly."""
    from specdec.sampling import compute_recovery_probs

    delta = 2 * MIN_RESIDUAL_MASS
    target = torch.tensor([[0.5, 0.5]])
    draft = torch.tensor([[0.5 - delta, 0.5 + delta]])  # residual [delta, 0]: only token 0
    assert torch.equal(compute_recovery_probs(target, draft), torch.tensor([[1.0, 0.0]]))


def test_first_draft_rejected_still_emits_one_target_distributed_token():
    """Seed bank edge case: when the very first draft is rejected the cycle still emits one
    token. With a one-hot draft of a token the target forbids, every cycle rejects at 0 and
    the residual is p itself, so the emitted token is distributed as p."""
    generator = torch.Generator().manual_seed(6)
    target_probs = torch.tensor([[0.5, 0.3, 0.2, 0.0], [0.25] * 4, [0.25] * 4])  # [3, 4]
    draft_tokens = torch.tensor([3, 0]).expand(NUM_DRAWS, -1)  # [N, 2]
    num_accepted, next_tokens = run_cycles(draft_tokens, None, target_probs, generator)
    assert (num_accepted == 0).all()
    assert tv(empirical(next_tokens, 4), target_probs[0]) < tv_bound(4, NUM_DRAWS)
    # Supports that overlap: a cycle whose first draft is rejected still emits exactly one token,
    # drawn from the residual max(0, p - q)/Z = [0.8, 0, 0.2, 0], not from p (which the case
    # above cannot tell apart), and the first token over all cycles is distributed as p.
    draft_probs = torch.tensor([[0.1, 0.6, 0.1, 0.2], [0.25] * 4])  # [2, 4]
    draft_tokens = sample_drafts(draft_probs, NUM_DRAWS, generator)  # [N, 2]
    num_accepted, next_tokens = run_cycles(draft_tokens, draft_probs, target_probs, generator)
    rejected = num_accepted == 0
    assert 0.4 < rejected.float().mean() < 0.6  # 1 - α = 1 - 0.5
    recovered = empirical(next_tokens[rejected], 4)
    assert tv(recovered, torch.tensor([0.8, 0.0, 0.2, 0.0])) < tv_bound(4, int(rejected.sum()))
    assert tv(recovered, target_probs[0]) > 0.2
    first = first_emitted_tokens(draft_tokens, num_accepted, next_tokens)
    assert tv(empirical(first, 4), target_probs[0]) < tv_bound(4, NUM_DRAWS)


def test_alpha_zero_emits_one_token_per_cycle_and_stays_lossless():
    """Seed bank edge case α → 0: a draft whose support is disjoint from the target's is
    rejected every time; each cycle gives exactly one token, distributed as p."""
    generator = torch.Generator().manual_seed(7)
    target_probs = torch.tensor([[0.6, 0.4, 0.0, 0.0]]).repeat(4, 1)  # [K+1, 4]
    draft_probs = torch.tensor([[0.0, 0.0, 0.3, 0.7]]).repeat(3, 1)  # [K, 4]
    assert acceptance_rate(draft_probs[0], target_probs[0]) == 0
    draft_tokens = sample_drafts(draft_probs, NUM_DRAWS, generator)
    num_accepted, next_tokens = run_cycles(draft_tokens, draft_probs, target_probs, generator)
    assert (num_accepted == 0).all()
    assert tv(empirical(next_tokens, 4), target_probs[0]) < tv_bound(4, NUM_DRAWS)


def test_greedy_acceptance_degenerates_to_an_equality_check():
    """Seed bank edge case: at temperature 0, p and q are one-hot; a draft is accepted iff it
    equals the target's argmax, and the next token is the target's argmax, for every seed."""
    vocab_size, num_drafts = 8, 4
    generator = torch.Generator().manual_seed(8)
    for case in range(40):
        target_logits = torch.randn(num_drafts + 1, vocab_size, generator=generator)
        rows = torch.arange(num_drafts + 1)
        low, high = (rows + case) % vocab_size, (rows + case + 3) % vocab_size  # each row its own tied pair
        target_logits[rows, low] = target_logits[rows, high] = target_logits.max(dim=1).values + 1
        draft_logits = torch.randn(num_drafts, vocab_size, generator=generator)
        agree = case % (num_drafts + 1)  # drafts 0 .. agree-1 match the target
        draft_logits[:agree] = target_logits[:agree]
        target_probs = warp(target_logits, temperature=0)  # [K+1, V]
        draft_probs = warp(draft_logits, temperature=0)  # [K, V]
        draft_tokens = draft_probs.argmax(dim=1)  # [K]
        if agree < num_drafts:
            draft_tokens[agree] = (target_probs[agree].argmax() + 1) % vocab_size
            draft_probs[agree] = torch.nn.functional.one_hot(draft_tokens[agree], vocab_size).float()
        target_argmax = target_probs.argmax(dim=1)  # [K+1]
        assert torch.equal(target_argmax, torch.minimum(low, high))  # ties went to the lowest index
        matching_prefix = int((draft_tokens == target_argmax[:num_drafts]).long().cumprod(0).sum())
        assert matching_prefix == agree
        for seed in range(10):
            for probs in (draft_probs, None):
                num_accepted, next_token = rejection_sample(
                    draft_tokens, probs, target_probs, torch.Generator().manual_seed(seed)
                )
                assert num_accepted == matching_prefix
                assert next_token == int(target_argmax[matching_prefix])


# --------------------------------------------------------------------------- seed bank: how many tokens


def test_k_equal_one_gives_one_plus_alpha_tokens_per_cycle():
    """Seed bank edge case K = 1: expected tokens (1 - α²)/(1 - α) = 1 + α, α = Σ min(p, q)."""
    generator = torch.Generator().manual_seed(9)
    target_probs = random_probs(generator, 2, 5, scale=1.0)  # [2, 5]
    draft_probs = random_probs(generator, 1, 5, scale=1.0)  # [1, 5]
    alpha = float(acceptance_rate(draft_probs[0], target_probs[0]))
    assert 0.3 < alpha < 0.9
    assert expected_tokens_per_cycle(alpha, 1) == pytest.approx(1 + alpha)
    num_draws = 4 * NUM_DRAWS
    draft_tokens = sample_drafts(draft_probs, num_draws, generator)
    num_accepted, _ = run_cycles(draft_tokens, draft_probs, target_probs, generator)
    mean_tokens = (num_accepted + 1).double().mean().item()
    assert abs(mean_tokens - (1 + alpha)) < mean_bound(1.0, num_draws)


@pytest.mark.parametrize("alpha", [0.3, 0.6, 0.9])
@pytest.mark.parametrize("num_drafts", [1, 2, 3, 4, 5])
def test_tokens_per_cycle_follow_truncated_geometric_law(alpha, num_drafts):
    """Seed bank: P(i accepted) = α^i (1 - α) for i < K and α^K for i = K, hence expected
    tokens (1 - α^(K+1))/(1 - α) — not the wrong Σ i α^(i-1) (1 - α)."""
    generator = torch.Generator().manual_seed(int(100 * alpha) + num_drafts)
    draft_probs, target_probs = constant_alpha_case(alpha, num_drafts)
    num_draws = 4 * NUM_DRAWS
    draft_tokens = sample_drafts(draft_probs, num_draws, generator)
    num_accepted, _ = run_cycles(draft_tokens, draft_probs, target_probs, generator)

    law = torch.tensor([alpha**i * (1 - alpha) for i in range(num_drafts)] + [alpha**num_drafts])
    assert tv(empirical(num_accepted, num_drafts + 1), law) < tv_bound(num_drafts + 1, num_draws)

    expected = expected_tokens_per_cycle(alpha, num_drafts)
    mean_tokens = (num_accepted + 1).double().mean().item()
    bound = mean_bound(num_drafts, num_draws)
    assert abs(mean_tokens - expected) < bound


def test_expected_tokens_is_not_the_sum_of_i_alpha_to_the_i_minus_one():
    """Spot the error: Σ i α^(i-1) (1 - α) has the wrong exponent and forgets the recovered
    token; measured cycles match (1 - α^(K+1))/(1 - α) and are far from it."""
    alpha, num_drafts = 0.6, 3
    wrong = sum(i * alpha ** (i - 1) * (1 - alpha) for i in range(1, num_drafts + 1))
    right = expected_tokens_per_cycle(alpha, num_drafts)
    assert right == pytest.approx(sum(alpha**i for i in range(num_drafts + 1)))
    generator = torch.Generator().manual_seed(22)
    draft_probs, target_probs = constant_alpha_case(alpha, num_drafts)
    draft_tokens = sample_drafts(draft_probs, NUM_DRAWS, generator)
    num_accepted, _ = run_cycles(draft_tokens, draft_probs, target_probs, generator)
    mean_tokens = (num_accepted + 1).double().mean().item()
    bound = mean_bound(num_drafts, NUM_DRAWS)
    assert abs(mean_tokens - right) < bound
    assert abs(mean_tokens - wrong) > 10 * bound


def test_alpha_near_one_approaches_k_plus_one_tokens_per_cycle():
    """Seed bank edge case α → 1: nearly every draft plus the bonus is accepted."""
    num_drafts = 4
    assert expected_tokens_per_cycle(1.0, num_drafts) == num_drafts + 1
    assert expected_tokens_per_cycle(1 - 1e-12, num_drafts) == pytest.approx(num_drafts + 1)
    generator = torch.Generator().manual_seed(10)
    draft_probs, target_probs = constant_alpha_case(0.98, num_drafts)
    draft_tokens = sample_drafts(draft_probs, NUM_DRAWS, generator)
    num_accepted, _ = run_cycles(draft_tokens, draft_probs, target_probs, generator)
    mean_tokens = (num_accepted + 1).double().mean().item()
    assert abs(mean_tokens - expected_tokens_per_cycle(0.98, num_drafts)) < mean_bound(num_drafts, NUM_DRAWS)
    assert mean_tokens > num_drafts + 1 - 0.25


def test_expected_tokens_per_cycle_closed_form():
    for num_drafts in range(0, 8):
        assert expected_tokens_per_cycle(0.0, num_drafts) == 1.0
        assert expected_tokens_per_cycle(1.0, num_drafts) == num_drafts + 1
        for alpha in (0.1, 0.5, 0.77, 0.99):
            closed_form = (1 - alpha ** (num_drafts + 1)) / (1 - alpha)
            assert expected_tokens_per_cycle(alpha, num_drafts) == pytest.approx(closed_form, rel=1e-12)
    for bad_alpha, bad_k in ((-0.1, 3), (1.1, 3), (float("nan"), 3), (0.5, -1)):
        with pytest.raises(ValueError):
            expected_tokens_per_cycle(bad_alpha, bad_k)


# --------------------------------------------------------------------------- seed bank: speedup model


def test_max_speedup_is_below_k_plus_one_when_the_draft_costs_anything():
    """Seed bank: K + 1 is only the ceiling for a free draft; otherwise c_p(K+1)/(K c_q + c_p)."""
    for num_drafts in (1, 4, 8):
        assert expected_speedup(1.0, num_drafts, cost_ratio=0.0) == num_drafts + 1
        for cost_ratio in (0.01, 0.1, 0.5):
            ceiling = expected_speedup(1.0, num_drafts, cost_ratio)
            assert ceiling == pytest.approx((num_drafts + 1) / (num_drafts * cost_ratio + 1))
            assert ceiling < num_drafts + 1
            assert expected_speedup(0.9, num_drafts, cost_ratio) < ceiling


def test_increasing_k_does_not_always_increase_speedup():
    """Seed bank: past the point where late drafts are usually rejected, speedup falls."""
    speedups = [expected_speedup(0.6, k, cost_ratio=0.1) for k in range(1, 16)]
    best = speedups.index(max(speedups))
    assert 0 < best < len(speedups) - 1
    assert speedups[-1] < speedups[best]


def test_speculative_decoding_can_be_slower_than_plain_decoding():
    """Seed bank: lossless in output, not guaranteed faster: α → 0 gives c_p/(K c_q + c_p) <= 1."""
    assert expected_speedup(0.0, 4, cost_ratio=0.1) == pytest.approx(1 / 1.4)
    assert expected_speedup(0.05, 4, cost_ratio=0.1) < 1.0
    assert expected_speedup(0.0, 4, cost_ratio=0.0) == 1.0


def test_a_more_accurate_but_slower_draft_can_give_less_speedup():
    """Seed bank: a better draft is not always a bigger speedup; its cost K c_q counts too."""
    accurate_but_slow = expected_speedup(0.85, 4, cost_ratio=0.5)
    rougher_but_cheap = expected_speedup(0.7, 4, cost_ratio=0.05)
    assert rougher_but_cheap > accurate_but_slow


def test_acceptance_depends_on_agreement_with_target_not_draft_accuracy():
    """Seed bank: what matters is α = Σ min(p, q), not whether the draft's top token is right.
    A draft always 'right' about the argmax (q one-hot on it) agrees less than a flatter
    draft whose argmax is wrong; the sampler's acceptance rate shows it."""
    target = torch.tensor([0.6, 0.4])
    peaked_right = torch.tensor([1.0, 0.0])
    flat_wrong = torch.tensor([0.45, 0.55])
    assert float(acceptance_rate(peaked_right, target)) == pytest.approx(0.6)
    assert float(acceptance_rate(flat_wrong, target)) == pytest.approx(0.85)

    generator = torch.Generator().manual_seed(11)
    target_probs = torch.stack([target, target])  # [2, 2]
    for draft, alpha in ((peaked_right, 0.6), (flat_wrong, 0.85)):
        draft_tokens = sample_drafts(draft.unsqueeze(0), NUM_DRAWS, generator)
        num_accepted, _ = run_cycles(draft_tokens, draft.unsqueeze(0), target_probs, generator)
        assert abs(num_accepted.double().mean().item() - alpha) < mean_bound(1.0, NUM_DRAWS)


def test_distilling_toward_target_raises_acceptance_rate():
    """Seed bank: distillation lowers KL(p || q), which is what raises α: α = 1 - TV(p, q)
    and Pinsker gives 1 - α <= sqrt(KL(p || q) / 2). Moving q toward p lowers KL and
    raises α (for q_t = (1-t) q + t p, α = 1 - (1-t) TV exactly)."""
    generator = torch.Generator().manual_seed(12)
    for _ in range(20):
        target = random_probs(generator, 10).double()
        draft = random_probs(generator, 10).double()
        previous_alpha, previous_kl = -1.0, math.inf
        for t in (0.0, 0.25, 0.5, 0.75, 0.95):
            distilled = (1 - t) * draft + t * target
            alpha = float(acceptance_rate(distilled, target))
            kl = float((target * (target / distilled).log()).sum())
            assert alpha == pytest.approx(1 - tv(target, distilled))
            assert alpha == pytest.approx(1 - (1 - t) * tv(target, draft))
            assert 1 - alpha <= math.sqrt(kl / 2) + 1e-12
            assert alpha > previous_alpha and kl < previous_kl
            previous_alpha, previous_kl = alpha, kl


def test_draft_and_target_must_share_vocabulary():
    """Seed bank: p(x̃)/q(x̃) needs one token space; a vocabulary mismatch is refused."""
    target_probs = torch.full((2, 5), 0.2)
    draft_probs = torch.full((1, 6), 1 / 6)
    with pytest.raises(ValueError, match="vocabulary"):
        rejection_sample([0], draft_probs, target_probs)


# --------------------------------------------------------------------------- K = 0, batch, RNG


def test_zero_drafts_samples_next_token_from_target():
    generator = torch.Generator().manual_seed(13)
    target_probs = torch.tensor([[0.1, 0.0, 0.6, 0.3]])  # [1, 4]
    tokens = []
    for _ in range(2000):
        num_accepted, next_token = rejection_sample([], None, target_probs, generator)
        assert num_accepted == 0
        tokens.append(next_token)
    tokens = torch.tensor(tokens)
    assert tv(empirical(tokens, 4), target_probs[0]) < tv_bound(4, 2000)
    assert rejection_sample(torch.zeros(0, dtype=torch.long), torch.zeros(0, 4), target_probs, generator)[0] == 0


def test_batch_of_one_matches_single_call_under_same_generator_state():
    case_generator = torch.Generator().manual_seed(14)
    for case in range(60):
        num_drafts = case % 5
        vocab_size = 3 + case % 4
        target_probs = random_probs(case_generator, num_drafts + 1, vocab_size)
        if case % 2:
            draft_probs = random_probs(case_generator, num_drafts, vocab_size)
            draft_tokens = sample_drafts(draft_probs, 1, case_generator)[0]
        else:
            draft_probs = None
            draft_tokens = torch.randint(vocab_size, (num_drafts,), generator=case_generator)
        single = rejection_sample(draft_tokens, draft_probs, target_probs, torch.Generator().manual_seed(case))
        num_accepted, next_tokens = rejection_sample_batch(
            draft_tokens.unsqueeze(0),
            torch.tensor([num_drafts]),
            None if draft_probs is None else draft_probs.unsqueeze(0),
            target_probs.unsqueeze(0),
            generator=torch.Generator().manual_seed(case),
        )
        assert single == (int(num_accepted[0]), int(next_tokens[0]))


def test_batch_handles_mixed_draft_counts_including_zero_with_garbage_padding():
    """Rows with K = 3 (all accepted: bonus), K = 0 (next from target_probs[b, 0]), K = 2
    (rejected at 1), K = 1 (rejected at 0), K = 1 (accepted: bonus from target_probs[b, 1]
    although its padding would be accepted too), padded with out-of-range ids and NaN rows
    that must be ignored. A bonus is num_accepted == num_drafts."""
    vocab_size = 5
    one_hot = lambda token: torch.nn.functional.one_hot(torch.tensor(token), vocab_size).float()  # noqa: E731
    uniform = torch.full((vocab_size,), 1 / vocab_size)
    nan_row = torch.full((vocab_size,), float("nan"))

    draft_tokens = torch.tensor([[1, 2, 3], [-1, 99, 7], [1, 4, -5], [0, 99, 99], [2, 2, 2]])  # [B, K_max]
    num_drafts = torch.tensor([3, 0, 2, 1, 1])  # [B]
    draft_probs = torch.stack([
        torch.stack([uniform, uniform, uniform]),
        torch.stack([nan_row, nan_row, nan_row]),
        torch.stack([uniform, uniform, nan_row]),
        torch.stack([one_hot(0), nan_row, nan_row]),
        torch.stack([uniform, uniform, uniform]),
    ])  # [B, K_max, V]
    p_rejects_4 = torch.tensor([0.0, 0.0, 0.5, 0.5, 0.0])  # residual vs uniform: tokens 2, 3
    target_probs = torch.stack([
        torch.stack([uniform, uniform, uniform, one_hot(4)]),  # all accepted -> bonus 4
        torch.stack([one_hot(2), nan_row, nan_row, nan_row]),  # K = 0 -> 2
        torch.stack([uniform, p_rejects_4, nan_row, nan_row]),  # draft 4 has p = 0 at position 1
        torch.stack([one_hot(1), nan_row, nan_row, nan_row]),  # draft 0 has p = 0 -> recovered 1
        torch.stack([uniform, one_hot(0), uniform, uniform]),  # accepted -> bonus 0
    ])  # [B, K_max + 1, V]
    for seed in range(100):
        num_accepted, next_tokens = rejection_sample_batch(
            draft_tokens, num_drafts, draft_probs, target_probs, torch.Generator().manual_seed(seed)
        )
        assert num_accepted.tolist() == [3, 0, 1, 0, 1]
        assert next_tokens[0] == 4 and next_tokens[1] == 2 and next_tokens[3] == 1 and next_tokens[4] == 0
        assert next_tokens[2] in (2, 3)
        assert (num_accepted == num_drafts).tolist() == [True, True, False, False, True]


@pytest.mark.parametrize(
    "shapes, message",
    [
        (dict(draft_tokens=(4,)), r"draft_tokens must have shape \[B, K_max\]"),
        (dict(num_drafts=(3,)), r"num_drafts must have shape \[B\] = \[4\]"),
        (dict(target_probs=(4, 2, 5)), r"target_probs must have shape \[B, K_max \+ 1, V\] = \[4, 3, V\]"),
        (dict(draft_probs=(4, 2, 6)), r"draft_probs must have shape \[B, K_max, V\] = \[4, 2, 5\]"),
    ],
)
def test_batch_rejects_inconsistent_shapes(shapes, message):
    sizes = dict(draft_tokens=(4, 2), num_drafts=(4,), draft_probs=(4, 2, 5), target_probs=(4, 3, 5))
    sizes.update(shapes)
    draft_tokens = torch.zeros(sizes["draft_tokens"], dtype=torch.long)
    num_drafts = torch.full(sizes["num_drafts"], 2)
    draft_probs = torch.full(sizes["draft_probs"], 0.2)
    target_probs = torch.full(sizes["target_probs"], 0.2)
    with pytest.raises(ValueError, match=message):
        rejection_sample_batch(draft_tokens, num_drafts, draft_probs, target_probs)


def test_seeded_generator_gives_identical_results_run_to_run():
    generator = torch.Generator().manual_seed(15)
    target_probs = random_probs(generator, 4, 6)
    draft_probs = random_probs(generator, 3, 6)
    draft_tokens = sample_drafts(draft_probs, 2000, generator)
    first = run_cycles(draft_tokens, draft_probs, target_probs, torch.Generator().manual_seed(42))
    second = run_cycles(draft_tokens, draft_probs, target_probs, torch.Generator().manual_seed(42))
    other = run_cycles(draft_tokens, draft_probs, target_probs, torch.Generator().manual_seed(43))
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
    assert not (torch.equal(first[0], other[0]) and torch.equal(first[1], other[1]))
    singles = {rejection_sample(draft_tokens[0], draft_probs, target_probs, torch.Generator().manual_seed(s))
               for s in range(20)}
    assert len(singles) > 1
    assert all(
        rejection_sample(draft_tokens[0], draft_probs, target_probs, torch.Generator().manual_seed(s))
        == rejection_sample(draft_tokens[0], draft_probs, target_probs, torch.Generator().manual_seed(s))
        for s in range(20)
    )


def test_randomness_consumed_depends_only_on_shapes_not_outcomes():
    """A seeded request stays reproducible for a fixed K: the generator advances the same
    amount whether drafts are accepted or rejected, and whatever each row's K is."""
    generator = torch.Generator().manual_seed(16)
    states = []
    for draft_counts in ([3, 0, 1, 2, 3, 3, 2, 1], [0] * 8, [1, 2, 1, 2, 1, 2, 1, 2]):
        target_probs = random_probs(generator, 8, 4, 7)  # [B, K+1, V]
        draft_probs = random_probs(generator, 8, 3, 7)
        draft_tokens = torch.randint(7, (8, 3), generator=generator)
        draft_probs.scatter_(2, draft_tokens.unsqueeze(2), 0.5)
        draft_probs /= draft_probs.sum(2, keepdim=True)
        run = torch.Generator().manual_seed(99)
        rejection_sample_batch(draft_tokens, torch.tensor(draft_counts), draft_probs, target_probs, run)
        states.append(run.get_state())
    assert all(torch.equal(states[0], state) for state in states[1:])


@settings(max_examples=150, deadline=None, derandomize=True, database=None)
@given(
    vocab_size=st.integers(1, 6),
    num_drafts=st.integers(0, 4),
    data_seed=st.integers(0, 2**31 - 1),
    one_hot_draft=st.booleans(),
)
def test_output_is_always_a_valid_cycle(vocab_size, num_drafts, data_seed, one_hot_draft):
    """For any valid p and q (with zeros), 0 <= num_accepted <= K and the next token has
    p > 0 at its position: recovered tokens come from max(0, p - q) ⊂ supp(p)."""
    generator = torch.Generator().manual_seed(data_seed)
    target_probs = truncate(random_probs(generator, num_drafts + 1, vocab_size, scale=3.0), max(1, vocab_size // 2))
    if one_hot_draft:
        draft_probs = None
        draft_tokens = torch.randint(vocab_size, (num_drafts,), generator=generator)
    else:
        draft_probs = truncate(random_probs(generator, num_drafts, vocab_size, scale=3.0), max(1, vocab_size - 1))
        draft_tokens = sample_drafts(draft_probs, 1, generator)[0]
    num_accepted, next_token = rejection_sample(draft_tokens, draft_probs, target_probs, generator)
    assert 0 <= num_accepted <= num_drafts
    assert target_probs[num_accepted, next_token] > 0
    for i in range(num_accepted):
        assert target_probs[i, draft_tokens[i]] > 0


# --------------------------------------------------------------------------- validation


def valid_cycle():
    target_probs = torch.tensor([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5], [1 / 3, 1 / 3, 1 / 3]])  # [3, 3]
    draft_probs = torch.tensor([[0.25, 0.75, 0.0], [0.5, 0.0, 0.5]])  # [2, 3]
    draft_tokens = torch.tensor([1, 2])
    return draft_tokens, draft_probs, target_probs


def _set(tensor_index, index, value):
    def mutate(parts):
        parts[tensor_index] = parts[tensor_index].clone()
        parts[tensor_index][index] = value
        return parts
    return mutate


BAD_INPUTS = [
    ("q has NaN", _set(1, (0, 0), float("nan")), "draft_probs.*NaN"),
    ("p has inf", _set(2, (1, 1), float("inf")), "target_probs.*inf"),
    ("q negative", lambda parts: [parts[0], torch.tensor([[-0.25, 1.25, 0.0], [0.5, 0.0, 0.5]]), parts[2]], "negative"),
    ("q sums to 1.2", _set(1, (0, 0), 0.45), r"draft_probs \(q\) row \(0,\) sums to 1\.2"),
    ("p sums to 0.5", _set(2, (0, 0), 0.0), r"target_probs \(p\) row \(0,\) sums to 0\.5"),
    ("q integer", lambda parts: [parts[0], parts[1].long(), parts[2]], "floating point"),
    ("q wrong K", lambda parts: [parts[0], parts[1][:1], parts[2]], r"shape \[K, V\]"),
    ("p wrong K", lambda parts: [parts[0], parts[1], parts[2][:2]], r"shape \[K \+ 1, V\]"),
    ("p 1-D", lambda parts: [parts[0][:0], None, parts[2][0]], r"shape \[K \+ 1, V\]"),
    ("tokens 2-D", lambda parts: [parts[0].unsqueeze(0), parts[1], parts[2]], r"shape \[K\]"),
    ("tokens float", lambda parts: [parts[0].float(), parts[1], parts[2]], "integer token ids"),
    ("token too big", _set(0, 1, 3), r"draft token 3 at position 1 is outside the vocabulary \[0, 3\)"),
    ("token negative", _set(0, 0, -1), "draft token -1 at position 0 is outside"),
    ("q(x̃) = 0", _set(0, 0, 2), "draft token 2 at position 0 has q = 0: the draft cannot have sampled it"),
    ("q wrong vocab", lambda parts: [parts[0], torch.full((2, 4), 0.25), parts[2]], "vocabulary size 4 but 3"),
]


@pytest.mark.parametrize(
    "mutate, message", [case[1:] for case in BAD_INPUTS], ids=[case[0] for case in BAD_INPUTS]
)
def test_bad_inputs_raise_value_error_with_clear_message(mutate, message):
    draft_tokens, draft_probs, target_probs = mutate(list(valid_cycle()))
    with pytest.raises(ValueError, match=message):
        rejection_sample(draft_tokens, draft_probs, target_probs)


def test_valid_inputs_pass_checks():
    draft_tokens, draft_probs, target_probs = valid_cycle()
    check_draft(draft_tokens, draft_probs, target_probs)
    check_draft(draft_tokens, None, target_probs)
    check_distribution(target_probs, name="p", vocab_size=3)
    # Within the tolerance is accepted; past it is not.
    check_distribution(torch.tensor([0.5, 0.5 + SUM_TOLERANCE / 2]))
    with pytest.raises(ValueError, match="sums to"):
        check_distribution(torch.tensor([0.5, 0.5 + 2 * SUM_TOLERANCE]))
    with pytest.raises(ValueError, match="vocabulary size"):
        check_distribution(target_probs, vocab_size=4)
    with pytest.raises(ValueError, match="torch.Tensor"):
        check_distribution([0.5, 0.5])


def test_sparse_to_dense_expands_support_and_zeroes_the_rest():
    dense = sparse_to_dense([4, 1], torch.tensor([0.25, 0.75]), vocab_size=6)
    assert dense.dtype == torch.float32
    assert dense.tolist() == [0.0, 0.75, 0.0, 0.0, 0.25, 0.0]
    assert sparse_to_dense(torch.tensor([2]), [1.0], 3).tolist() == [0.0, 0.0, 1.0]
    # A sparse top-k q is exactly usable by the sampler.
    target_probs = torch.tensor([[0.2, 0.2, 0.2, 0.2, 0.2, 0.0], [1 / 6] * 6])
    num_accepted, _ = rejection_sample([1], dense.unsqueeze(0), target_probs, torch.Generator().manual_seed(0))
    assert num_accepted in (0, 1)


@pytest.mark.parametrize(
    "ids, probs, vocab_size, message",
    [
        ([0, 6], [0.5, 0.5], 6, r"token id 6 is outside the vocabulary \[0, 6\)"),
        ([-1, 2], [0.5, 0.5], 6, "token id -1 is outside"),
        ([1, 1], [0.5, 0.5], 6, "duplicates"),
        ([1, 2], [1.5, -0.5], 6, "negative"),
        ([1, 2], [float("nan"), 0.5], 6, "NaN"),
        ([1, 2, 3], [0.5, 0.5], 6, "3 entries but probs has 2"),
        ([], [], 6, "empty support"),
        ([0], [1.0], 0, "vocab_size must be a positive int"),
    ],
)
def test_sparse_to_dense_rejects_malformed_input(ids, probs, vocab_size, message):
    with pytest.raises(ValueError, match=message):
        sparse_to_dense(ids, probs, vocab_size)


# --------------------------------------------------------------------------- warp


def test_warp_temperature_zero_is_one_hot_argmax_with_ties_to_lowest_index():
    logits = torch.tensor([[0.0, 3.0, 1.0, 3.0], [5.0, -1.0, 5.0, 2.0]])
    probs = warp(logits, temperature=0, top_k=2, top_p=0.5)
    assert probs.dtype == torch.float32
    assert probs.tolist() == [[0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]]


@pytest.mark.parametrize("temperature", [0.3, 1.0, 2.5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_warp_temperature_scaling_matches_softmax_of_scaled_logits(temperature, dtype):
    generator = torch.Generator().manual_seed(17)
    logits = (4 * torch.randn(3, 11, generator=generator)).to(dtype)
    probs = warp(logits, temperature)
    assert probs.dtype == torch.float32 and probs.shape == (3, 11)
    expected = torch.softmax(logits.double() / temperature, dim=-1)
    torch.testing.assert_close(probs.double(), expected, atol=1e-6, rtol=1e-5)


def test_warp_tiny_temperature_does_not_overflow():
    probs = warp(torch.tensor([1.0, 3.0, 2.0]), temperature=1e-30)
    assert probs.tolist() == [0.0, 1.0, 0.0]


def test_warp_top_k_keeps_exactly_k_most_likely_tokens():
    generator = torch.Generator().manual_seed(18)
    logits = torch.randn(5, 12, generator=generator)
    for top_k in range(1, 12):
        probs = warp(logits, temperature=0.7, top_k=top_k)  # [5, 12]
        kept = probs > 0
        assert (kept.sum(dim=1) == top_k).all()
        expected_kept = torch.zeros_like(kept).scatter(1, logits.topk(top_k, dim=1).indices, True)
        assert torch.equal(kept, expected_kept)
        renormalized = torch.softmax((logits / 0.7).masked_fill(~expected_kept, -math.inf), dim=1)
        torch.testing.assert_close(probs, renormalized)
    # Ties at the boundary: still exactly k, lowest indices first.
    probs = warp(torch.tensor([1.0, 2.0, 2.0, 2.0, 0.0]), temperature=1.0, top_k=2)
    assert (probs > 0).tolist() == [False, True, True, False, False]


def test_warp_top_k_zero_or_at_least_vocab_size_is_off():
    logits = torch.tensor([0.5, -1.0, 2.0, 0.0])
    plain = torch.softmax(logits, dim=-1)
    for top_k in (0, 4, 100):
        torch.testing.assert_close(warp(logits, 1.0, top_k=top_k), plain)
    torch.testing.assert_close(warp(logits, 1.0, top_p=1.0), plain)


def test_warp_top_p_keeps_the_minimal_nucleus():
    generator = torch.Generator().manual_seed(19)
    for _ in range(50):
        logits = 2 * torch.randn(10, generator=generator)
        full = torch.softmax(logits.double(), dim=-1)
        for top_p in (0.05, 0.3, 0.5, 0.8, 0.95, 0.999):
            probs = warp(logits, temperature=1.0, top_p=top_p)
            kept = probs > 0
            kept_mass = full[kept].sum().item()
            smallest_kept = full[kept].min().item()
            assert kept_mass >= top_p - 1e-6  # reaches top_p ...
            assert kept_mass - smallest_kept < top_p + 1e-6  # ... and no token could be dropped
            if (~kept).any():  # the kept tokens are the most likely ones
                assert full[~kept].max().item() <= smallest_kept
            renormalized = torch.where(kept, full / kept_mass, 0.0)
            torch.testing.assert_close(probs.double(), renormalized, atol=1e-6, rtol=1e-5)


def test_warp_top_p_always_keeps_at_least_one_token():
    probs = warp(torch.tensor([0.0, 0.1, 0.05]), temperature=1.0, top_p=1e-9)
    assert probs.tolist() == [0.0, 1.0, 0.0]


def test_warp_applies_top_k_before_top_p_on_the_renormalized_distribution():
    """Full probs [.40, .25, .20, .15]: top-k 2 leaves [.615, .385]; top-p .6 of that keeps
    one token. Top-p on the unrenormalized mass would keep two."""
    logits = torch.tensor([0.40, 0.25, 0.20, 0.15]).log()
    assert warp(logits, 1.0, top_k=2, top_p=0.6).tolist() == [1.0, 0.0, 0.0, 0.0]
    probs = warp(logits, 1.0, top_p=0.6)
    assert (probs > 0).tolist() == [True, True, False, False]


def test_warp_masked_tokens_have_exactly_zero_probability_and_rows_sum_to_one():
    generator = torch.Generator().manual_seed(20)
    logits = torch.randn(2, 3, 50, generator=generator)  # [..., V]
    probs = warp(logits, temperature=1.3, top_k=10, top_p=0.7)
    assert probs.shape == (2, 3, 50)
    assert ((probs == 0).sum(dim=-1) >= 40).all()
    assert (probs[probs != 0] > 0).all()
    torch.testing.assert_close(probs.sum(dim=-1), torch.ones(2, 3))
    # -inf logits (e.g. vocabulary padding) stay at exactly zero too.
    assert warp(torch.tensor([0.0, -math.inf, 1.0]), 1.0)[1].item() == 0.0


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(temperature=float("inf")), "temperature"),
        (dict(temperature=1.0, top_k=-1), "top_k"),
        (dict(temperature=1.0, top_k=2.5), "top_k"),
        (dict(temperature=1.0, top_p=0.0), "top_p"),
        (dict(temperature=1.0, top_p=1.5), "top_p"),
        (dict(temperature=1.0, top_p=-0.2), "top_p"),
        (dict(temperature=1.0, top_p=float("nan")), "top_p"),
    ],
)
def test_warp_rejects_invalid_parameters(kwargs, message):
    with pytest.raises(ValueError, match=message):
        warp(torch.zeros(4), **kwargs)


@pytest.mark.parametrize(
    "logits, message",
    [
        (torch.tensor([0.0, float("nan")]), "NaN"),
        (torch.tensor([0.0, math.inf]), r"\+inf"),
        (torch.tensor([-math.inf, -math.inf]), "-inf everywhere"),
        (torch.tensor([[0.0, 1.0], [-math.inf, float("nan")]]), "NaN"),  # a NaN beside -inf, in a later row
        (torch.tensor([[0.0, 1.0], [-math.inf, -math.inf]]), "-inf everywhere"),
        (torch.tensor([[-math.inf, math.inf], [0.0, 1.0]]), r"\+inf"),
        (torch.tensor([3.0, float("nan"), -1.0], dtype=torch.bfloat16), "NaN"),
        (torch.tensor([1, 2]), "floating point"),
        (torch.zeros(2, 0), "V > 0"),
    ],
)
def test_warp_rejects_bad_logits(logits, message):
    with pytest.raises(ValueError, match=message):
        warp(logits, temperature=1.0)


@settings(max_examples=100, deadline=None, derandomize=True, database=None)
@given(
    logits=st.lists(st.floats(-30, 30), min_size=1, max_size=12),
    temperature=st.sampled_from([0.0, 0.1, 0.7, 1.0, 3.0]),
    top_k=st.integers(0, 14),
    top_p=st.sampled_from([1e-3, 0.2, 0.5, 0.9, 1.0]),
)
def test_warp_always_returns_a_distribution_on_the_most_likely_tokens(logits, temperature, top_k, top_p):
    logits = torch.tensor(logits)
    probs = warp(logits, temperature, top_k=top_k, top_p=top_p)
    check_distribution(probs, vocab_size=len(logits))
    kept = probs > 0
    assert kept.any()
    if 0 < top_k:
        assert kept.sum() <= top_k
    # Nothing dropped is more likely than something kept.
    if (~kept).any():
        assert logits[~kept].max() <= logits[kept].min()


# --------------------------------------------------------------------------- sample


def test_sample_draws_from_exactly_the_given_distribution():
    generator = torch.Generator().manual_seed(21)
    probs = torch.tensor([0.5, 0.0, 0.3, 0.2])
    draws = torch.tensor([sample(probs, generator) for _ in range(3000)])
    assert (draws != 1).all()
    assert tv(empirical(draws, 4), probs) < tv_bound(4, 3000)
    assert sample(probs, torch.Generator().manual_seed(5)) == sample(probs, torch.Generator().manual_seed(5))
    assert isinstance(sample(probs), int)
    with pytest.raises(ValueError, match=r"shape \[V\]"):
        sample(probs.unsqueeze(0))



@pytest.mark.parametrize("form", ["fixed", "dense"])
def test_a_drafts_wire_q_draws_each_token_with_the_probability_the_target_decodes(form):
    """The draft samples from its WireQ (integer weights, or float16 values) without a dense
    [V] q; the draws must follow exactly the q the target will decode from the message."""
    from specdec.draft_wire import draft_from_pb, draft_token_to_pb, wire_q

    generator = torch.Generator().manual_seed(13)
    if form == "fixed":  # over ids [M] in no order, as a draft whose head scores part of V
        ids = torch.tensor([40, 3, 17, 25, 8, 31])
        sent = wire_q(torch.tensor([0.1, 0.3, 0.0, 0.25, 0.15, 0.2]), ids, vocab_size=48)
    else:  # 0.1 of the mass spread over 40,000 ids: fixed point would move more than FIXED_MAX_L1
        q = torch.zeros(49152)
        q[torch.randperm(49152, generator=generator)[:40_000]] = 0.1 / 40_000
        q[[7, 100, 2000]] = torch.tensor([0.5, 0.3, 0.1])
        sent = wire_q(q)
    assert (sent.dense is not None) == (form == "dense")
    decoded = draft_from_pb(draft_token_to_pb(0, 3 if form == "fixed" else 7, sent), sent.vocab_size).q  # [V]
    n = 10_000
    draws = torch.tensor([sent.sample(generator) for _ in range(n)])
    assert (decoded[draws] > 0).all()
    if form == "fixed":
        assert tv(empirical(draws, 48), decoded) < tv_bound(5, n)  # 5 ids carry mass
    else:  # classes: the three heavy ids and all the rest
        classes = {7: 0, 100: 1, 2000: 2}
        drawn = torch.tensor([classes.get(int(token), 3) for token in draws])
        expected = torch.cat([decoded[[7, 100, 2000]], 1 - decoded[[7, 100, 2000]].sum(0, keepdim=True)])
        assert tv(empirical(drawn, 4), expected) < tv_bound(4, n)
    assert sent.sample(torch.Generator().manual_seed(4)) == sent.sample(torch.Generator().manual_seed(4))


# ---------------------------------------------------------------- fast truncation


@pytest.mark.parametrize("vocab_size", [50, 2000, 49152])
def test_partial_ranking_truncates_exactly_like_the_full_sort(vocab_size):
    """truncate_top_k_top_p ranks only the most likely tokens where that decides the result;
    it must keep exactly the tokens the definition (a full stable sort) keeps, ties included."""
    from specdec.sampling import truncate_by_full_sort, truncate_top_k_top_p

    generator = torch.Generator().manual_seed(vocab_size)
    cases = 0
    for scale in (0.5, 3.0, 8.0):
        for tied in (False, True):
            logits = torch.randn(6, vocab_size, generator=generator) * scale  # [R, V]
            if tied:  # many exact ties, some straddling the candidate boundary
                logits = torch.round(logits * 2) / 2
            for top_k, top_p in ((0, 0.5), (0, 0.9), (0, 0.99), (50, 1.0), (1, 1.0), (1500, 1.0), (50, 0.9), (3000, 0.8)):
                fast = truncate_top_k_top_p(logits, top_k, top_p)
                slow = truncate_by_full_sort(logits, top_k, top_p)
                assert torch.equal(fast > -math.inf, slow > -math.inf), (scale, tied, top_k, top_p)
                assert torch.equal(fast, slow)
                cases += 1
    assert cases == 48


# --------------------------------------------------------------------------- the sampler


def test_sample_rows_draws_each_token_with_its_probability_and_never_a_zero():
    from specdec.sampling import sample_rows

    generator = torch.Generator().manual_seed(11)
    probs = torch.tensor([0.0, 0.05, 0.0, 0.4, 0.25, 0.0, 0.3, 0.0])  # zeros inside and at both ends
    n = 200_000
    tokens = sample_rows(probs.expand(n, -1), generator)  # [n]
    frequencies = empirical(tokens, len(probs))
    assert frequencies[probs == 0].sum() == 0
    assert tv(frequencies, probs) < tv_bound(len(probs), n)
    # many different rows at once: each row's draws follow that row
    rows = random_probs(generator, 4, 6)  # [4, 6]
    draws = sample_rows(rows.repeat_interleave(50_000, 0), generator).view(4, 50_000)
    for row, row_draws in zip(rows, draws):
        assert tv(empirical(row_draws, 6), row) < tv_bound(6, 50_000)
    # a one-hot row (a greedy q) gives its token whatever the uniform
    assert sample_rows(torch.nn.functional.one_hot(torch.tensor([0, 7]), 8).float(), generator).tolist() == [0, 7]
    assert sample(torch.nn.functional.one_hot(torch.tensor(5), 49_152).float(), generator) == 5


def test_sample_rows_maps_a_uniform_at_the_top_to_the_last_token_with_mass(monkeypatch):
    """u · total can round up to the total itself: the draw must not run past the row or land on a zero."""
    from specdec.sampling import sample_rows

    monkeypatch.setattr(torch, "rand", lambda shape, **kwargs: torch.ones(shape, dtype=torch.float64))
    probs = torch.tensor([[0.5, 0.5, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0], [0.2, 0.0, 0.8, 0.0]])
    assert sample_rows(probs).tolist() == [1, 3, 2]


@pytest.mark.parametrize("row", [[0.0, 0.0, 0.0], [float("nan"), 0.5, 0.5], [float("inf"), 0.0, 0.0]])
def test_sample_rows_refuses_a_row_without_usable_mass(row):
    from specdec.sampling import sample_rows

    with pytest.raises(ValueError, match="no probability mass"):
        sample_rows(torch.tensor([row]))


# --------------------------------------------------------------------------- greedy fast path


def test_greedy_verdict_equals_the_rejection_rule_on_one_hot_p_with_ties_and_any_q():
    """At temperature 0 the target reads its verdict off the logits (greedy_verdict); it must
    be rejection_sample's on warp(logits, 0) for every input: ties (lowest index wins),
    n-gram (one-hot) and dense q, all, some or none of the drafts equal to the argmax."""
    from specdec.sampling import greedy_verdict

    generator = torch.Generator().manual_seed(0)
    vocab = 7
    cases = 0
    for trial in range(400):
        k = trial % 5
        logits = torch.randint(0, 3, (k + 1, vocab), generator=generator).float()  # many ties
        greedy = logits.argmax(-1)
        # drafts: the argmax for a random prefix, then anything
        agree = int(torch.randint(0, k + 1, (1,), generator=generator)) if k else 0
        drafts = torch.randint(0, vocab, (k,), generator=generator)
        drafts[:agree] = greedy[:agree]
        if trial % 2:
            q = torch.rand(k, vocab, generator=generator) + 0.01
            q = q / q.sum(-1, keepdim=True)
        else:
            q = None
        expected = rejection_sample(drafts, q, warp(logits, 0.0), torch.Generator().manual_seed(trial))
        assert greedy_verdict(drafts, q, logits) == expected, (logits, drafts, q)
        cases += expected[0] < k
    assert 50 < cases < 400  # both rejections and full acceptances were seen


def test_greedy_verdict_refuses_what_rejection_sample_refuses():
    from specdec.sampling import greedy_token, greedy_verdict

    logits = torch.zeros(2, 5)
    with pytest.raises(ValueError, match="NaN"):
        greedy_verdict([1], None, torch.tensor([[0.0, float("nan"), 0, 0, 0], [0.0] * 5]))
    with pytest.raises(ValueError, match="inf"):
        greedy_verdict([1], None, torch.tensor([[0.0, float("inf"), 0, 0, 0], [0.0] * 5]))
    with pytest.raises(ValueError, match="-inf everywhere"):
        greedy_token(torch.full((5,), float("-inf")))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        greedy_verdict([5], None, logits)
    with pytest.raises(ValueError, match="q = 0"):
        greedy_verdict([1], torch.tensor([[1.0, 0, 0, 0, 0]]), logits)
    with pytest.raises(ValueError, match=r"\[K \+ 1, V\]"):
        greedy_verdict([1, 2], None, logits)
    assert greedy_token(torch.tensor([0.0, 3.0, 3.0])) == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_greedy_ids_takes_the_first_maximum_and_refuses_nan_in_every_dtype(dtype):
    """greedy_ids reads a CPU tensor through numpy where numpy has the dtype (bfloat16 it has
    not): either way the token is the first index of the row's maximum, as `warp` picks it,
    and a NaN anywhere in a row is refused, not skipped."""
    from specdec.sampling import greedy_ids, warp

    generator = torch.Generator().manual_seed(11)
    logits = torch.randn(64, 500, generator=generator).to(dtype)  # [R, V]
    for row in range(0, 64, 2):  # plant ties of the maximum at two random places
        first, second = sorted(torch.randperm(500, generator=generator)[:2].tolist())
        logits[row, first] = logits[row, second] = logits[row].max() + 1
    expected = [int(warp(row.float().unsqueeze(0), 0.0)[0].argmax()) for row in logits]
    assert greedy_ids(logits) == expected
    for column in (0, 250, 499):  # NaN first, inside, last
        bad = logits.clone()
        bad[3, column] = float("nan")
        with pytest.raises(ValueError, match="NaN"):
            greedy_ids(bad)
