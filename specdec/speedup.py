"""The seed's cost model of speculative decoding: expected tokens per cycle and speedup.

Terms (as in specdec.sampling): α is the chance one draft token is accepted, K the drafts
per cycle, c_q / c_p the cost of a draft pass over a target pass. Plain arithmetic, no
torch: the coordinator's adaptive K calls it on every cycle and imports nothing heavy.
"""

from __future__ import annotations

import math


def expected_tokens_per_cycle(alpha: float, k: int) -> float:
    """Expected tokens one cycle emits: (1 - α^(K+1)) / (1 - α), which is K + 1 at α = 1.

    Draft i (0-based) is reached and accepted with probability α^(i+1); the recovered or
    bonus token always comes. Summed as the geometric series 1 + α + ... + α^K, which is
    exact at α = 1 and has no cancellation near it.
    """
    if math.isnan(alpha) or not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    return expected_tokens_by_position([alpha] * k)


def expected_tokens_by_position(alphas: list[float]) -> float:
    """Expected tokens one cycle of K = len(alphas) drafts emits, where alphas[i] is the
    chance draft i is accepted given drafts 0..i-1 were: 1 + Σ_k Π_{i<k} alphas[i].

    With every alphas[i] = α this is expected_tokens_per_cycle(α, K). Acceptances are rarely
    independent: an n-gram draft that copies the right passage tends to stay right, so a
    draft's later positions, once reached, are accepted more often than its first.
    """
    tokens, reached = 1.0, 1.0
    for alpha in alphas:
        if math.isnan(alpha) or not 0.0 <= alpha <= 1.0:
            raise ValueError(f"alpha must be in [0, 1], got {alpha}")
        reached *= alpha
        tokens += reached
    return tokens


def expected_speedup(alpha: float, k: int, cost_ratio: float) -> float:
    """Expected speedup over plain target decoding, for cost_ratio = c_q / c_p.

    A sequential cycle costs K draft passes plus one target pass, K * c_q + c_p (verifying
    K + 1 positions is taken to cost about one target pass), and emits
    ``expected_tokens_per_cycle(alpha, k)`` tokens; plain decoding emits 1 per c_p.
    At α = 1 this is the ceiling (K + 1) / (K * c_q / c_p + 1) < K + 1; at α = 0 it is
    1 / (K * c_q / c_p + 1) <= 1.
    """
    if math.isnan(cost_ratio) or cost_ratio < 0:
        raise ValueError(f"cost_ratio must be >= 0, got {cost_ratio}")
    return expected_tokens_per_cycle(alpha, k) / (k * cost_ratio + 1.0)


def tokens_per_ms(alpha: float, k: int, c_q: float, c_verify: float) -> float:
    """Expected tokens per ms of sequential cycles that draft k tokens at c_q ms each and
    verify them in one target pass over K + 1 positions of c_verify ms: the seed's model
    with the verify pass measured instead of taken as c_p (on a CPU it grows with K)."""
    if not (c_q >= 0 and c_verify > 0):
        raise ValueError(f"need c_q >= 0 and c_verify > 0 ms, got {c_q}, {c_verify}")
    return expected_tokens_per_cycle(alpha, k) / (k * c_q + c_verify)
