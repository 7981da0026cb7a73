"""Adaptive K: choose each cycle's lookahead to maximise expected tokens per second.

Terms (the seed's formulas):
    α̂            running estimate of the acceptance rate: accepted drafts / drafts the
                 target judged (a rejected draft ends its cycle's judging)
    α̂_i          α̂ of draft position i given drafts 0..i-1 were accepted (α̂_0 is the
                 chance a cycle's first draft is accepted). Acceptances are not
                 independent: an n-gram draft that copies the right passage stays right,
                 so on copy-heavy text α̂_3 ≈ 0.8 while α̂_0 ≈ 0.4, and a single α̂ would
                 undervalue long K. A position not yet judged often leans on the one
                 before it (PRIOR_WEIGHT pseudo-counts of α̂_{i-1}), so with independent
                 acceptances every α̂_i is α̂
    class        the draft's confidence class of a proposal (DraftToken.match_length):
                 an n-gram draft's match length 1..max_ngram, 0 for a model draft. One
                 set of α̂_i per class: a 3-gram match of an n-gram draft is accepted far
                 more often than a 1-gram one, so the two deserve different K
    c_draft(k)   ms to get k drafts as the coordinator sees it, the Propose call included
                 (k·c_q plus the call's own cost); 0 for a class in `free_classes` (drafts
                 looked up in the coordinator for a model draft: n-gram first)
    c_verify(k)  ms per target pass over k drafts (+ the new tokens); c_verify(0) is a plain step
                 (measured apart from the others: see `c_verify`)
    E(k)         expected tokens per cycle = 1 + Σ_{j=1..k} Π_{i<j} α̂_i, the seed's
                 (1 − α̂^(k+1)) / (1 − α̂) when every α̂_i is α̂
    rate(k)      E(k) / (c_draft(k) + c_verify(k))   for k ≥ 1
                 = 1 / c_verify(0)              for k = 0 (target only)

K is chosen before drafting (`choose`): for an n-gram draft the coordinator looks the
match up itself (specdec.ngram, under a millisecond), so K is the best for that match's class,
and a miss or a weak match costs no draft call and runs plain steps; for a model draft,
K is the best for its one class. Once drafts arrive, `trim` keeps only as many as their
own class makes worth verifying (a guard for when the class was not known beforehand).

Estimates decay (DECAY per cycle) so K follows the text as it changes. c_verify(k ≥ 1)
is a line fitted to the passes seen so far, with a prior slope until two sizes have
been seen; a plain step's cost is measured on its own. Each size weighs in a line by its
decayed count, and a size not seen lately (STALE_COUNT) not at all while another is: a
slow cycle at a K no longer chosen cannot skew the line for long. When k = 0 wins,
a one-token probe keeps α̂ current: after PROBE_EVERY cycles, and after twice as many each time a
probe is rejected (up to MAX_PROBE_EVERY), so a useless draft costs less and less; a
probe that is accepted resets the interval.

Each session starts from `session()` of the coordinator's shared estimate, which every
session also feeds: a new request does not pay to learn again what the model pair and
the machine cost, and its own estimate then follows its own text.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field

from specdec.speedup import expected_tokens_by_position

DECAY = 0.95
PRIOR_ACCEPTED = 1.0  # a Beta(1, 1) prior on α̂_0 ...
PRIOR_JUDGED = 2.0
PRIOR_WEIGHT = 2.0  # ... and α̂_i leans on α̂_{i-1} with this many pseudo-counts
# Verifying k more tokens costs this fraction of a plain step per token until measured
# (design.md §5: 5 tokens ≈ 1.6 plain steps on a CPU).
PRIOR_VERIFY_SLOPE = 0.15
# A size whose decayed count fell below this (seen once ~45 observations ago, or more often
# longer ago) is left out of a cost line while another is above it (where none is, the one of
# the largest count stays). A mean no longer fed (a K no longer chosen) kept its full weight in
# the line until its count underflowed, ~14,500 observations: one slow cycle (a pause, a
# retry's back-off) at the K in use kept speculation off that long, coordinator-wide.
STALE_COUNT = 0.1
PROBE_EVERY = 16
MAX_PROBE_EVERY = 128


@dataclass
class AdaptiveK:
    max_k: int
    # class -> per draft position i: [decayed accepted, decayed judged]
    classes: dict[int, list[list[float]]] = field(default_factory=dict)
    # tokens proposed -> [decayed sum of drafting ms, decayed count]
    draft: dict[int, list[float]] = field(default_factory=dict)
    # k -> (decayed sum of verify ms, decayed count)
    verify: dict[int, list[float]] = field(default_factory=dict)
    cycles_since_probe: int = 0
    probe_every: int = PROBE_EVERY  # target-only cycles before the next probe
    probing: bool = False  # the K just chosen is a probe
    # Classes whose drafts cost nothing to get (n-gram first's looked-up match lengths).
    free_classes: frozenset[int] = frozenset()
    # The coordinator-wide estimate this one was copied from, fed the same observations.
    shared: "AdaptiveK | None" = None

    def session(self, max_k: int) -> "AdaptiveK":
        """A per-session estimate starting from this (shared) one and feeding it."""
        own = copy.deepcopy(self)
        own.max_k, own.shared, own.cycles_since_probe, own.probe_every = max_k, self, 0, PROBE_EVERY
        return own

    @property
    def alpha(self) -> float:
        """α̂ over every class and position together."""
        counts = [c for positions in self.classes.values() for c in positions]
        return (sum(a for a, _ in counts) + PRIOR_ACCEPTED) / (sum(j for _, j in counts) + PRIOR_JUDGED)

    def class_alpha(self, match_length: int) -> float:
        """α̂ of one class over its positions (the prior's 0.5 until it is seen)."""
        counts = self.classes.get(match_length, [])
        return (sum(a for a, _ in counts) + PRIOR_ACCEPTED) / (sum(j for _, j in counts) + PRIOR_JUDGED)

    def position_alphas(self, match_length: int, k: int) -> list[float]:
        """α̂_0 .. α̂_{k-1} of one class (module doc)."""
        counts = self.classes.get(match_length, [])
        alphas, prior, weight = [], PRIOR_ACCEPTED / PRIOR_JUDGED, PRIOR_JUDGED
        for i in range(k):
            accepted, judged = counts[i] if i < len(counts) else (0.0, 0.0)
            prior = (accepted + weight * prior) / (judged + weight)
            alphas.append(prior)
            weight = PRIOR_WEIGHT
        return alphas

    def best_class(self) -> int:
        """The class whose first draft is accepted most often (0 before any is seen)."""
        return max(self.classes, key=lambda c: self.position_alphas(c, 1)[0], default=0)

    def keep_probability(self, k: int, match_length: int | None = None) -> float:
        """The chance that K drafts of class `match_length` (default: the best class) and the
        guess after them are all accepted: Π α̂_i over K + 1 positions (whether pipelining's
        next cycle is kept)."""
        match_length = self.best_class() if match_length is None else match_length
        return math.prod(self.position_alphas(match_length, k + 1))

    def c_draft(self, k: int) -> float:
        """Estimated ms to get k drafts, the Propose call included: a line fitted to the
        calls seen (one size seen: k times its cost per token). An n-gram draft's cost is
        mostly the call, the same for 1 token or 8; a model draft's grows by c_q a token."""
        points = fresh(mean_points(self.draft))
        if not points or k == 0:
            return 0.0
        if len(points) == 1:
            size, ms, _ = points[0]
            return ms * k / size
        return max(line_at(points, k), 0.0)

    def c_verify(self, k: int) -> float | None:
        """Estimated ms of a verify pass over k drafts; None before any pass was seen.

        c_verify(0), a plain step, is its own mean: on a CPU one row takes a different
        kernel from a pass over several (specdec.packed), which can cost less than a single
        row, so a plain step is not on the line through the others (unless it was not seen
        lately while passes were: then it is read off their line). For k ≥ 1, a line
        fitted to the passes seen, with the prior slope until two sizes have been seen."""
        means = mean_points(self.verify)
        points = fresh([point for point in means if point[0] > 0])
        # a plain step not seen lately while passes were (speculation won since) is left out too:
        # one slow plain step kept its mean, and speculation on, for as long as drafting went on
        plain_ms = next((ms for size, ms, count in means if size == 0 and (count >= STALE_COUNT or not points)), None)
        if k == 0 and plain_ms is not None:
            return plain_ms
        if not points:
            return None if plain_ms is None else plain_ms * (1 + PRIOR_VERIFY_SLOPE * k)
        if len(points) == 1:
            size, ms, _ = points[0]
            return ms * (1 + PRIOR_VERIFY_SLOPE * k) / (1 + PRIOR_VERIFY_SLOPE * size)
        return max(line_at(points, k), 1e-3)

    def rate(self, k: int, match_length: int | None = None) -> float:
        """Expected tokens per ms with lookahead k for drafts of class `match_length`
        (default: the best class), 0 when costs are still unknown."""
        verify = self.c_verify(k)
        if verify is None:
            return 0.0
        if k == 0:
            return 1.0 / verify
        match_length = self.best_class() if match_length is None else match_length
        draft = 0.0 if match_length in self.free_classes else self.c_draft(k)
        return expected_tokens_by_position(self.position_alphas(match_length, k)) / (draft + verify)

    def measured(self) -> bool:
        """Whether verify costs and some drafted cycle are known (before that, K is not chosen
        by the formula)."""
        return bool(self.verify and self.draft)

    def best_k(self, limit: int, match_length: int | None = None) -> int:
        return max(range(limit + 1), key=lambda k: self.rate(k, match_length))

    def choose(self, limit: int, match_length: int | None = None) -> int:
        """K for the next cycle, at most `limit` (what max_new_tokens and the context allow),
        for drafts of class `match_length` when it is known beforehand (an n-gram draft's
        match, looked up by the coordinator), else for the best class seen."""
        limit = min(limit, self.max_k)
        if limit <= 0:
            return 0
        if not self.measured():
            return min(limit, max(1, self.max_k // 2))  # nothing measured yet: start in the middle
        best = self.best_k(limit, match_length)
        return self.probe() if best == 0 else best

    def worth_drafting(self, limit: int, match_length: int) -> bool:
        """Whether drafts of class `match_length` would be verified now (no probe counted):
        some K in 1..limit beats a plain step, or nothing is measured yet."""
        limit = min(limit, self.max_k)
        if limit <= 0:
            return False
        if not self.measured():
            return True
        return self.best_k(limit, match_length) > 0

    def trim(self, match_length: int, offered: int) -> int:
        """How many of `offered` drafts of class `match_length` to verify: the K ≤ offered
        best for that class's α̂ (0: none, a plain step). A probe is never trimmed."""
        if self.probing or not self.measured():
            return offered
        best = self.best_k(offered, match_length)
        return self.probe() if best == 0 else best

    def probe(self) -> int:
        """0 (speculation loses), or 1 once every `probe_every` such calls: a one-token
        probe that keeps α̂ current."""
        self.cycles_since_probe += 1
        if self.cycles_since_probe < self.probe_every:
            return 0
        self.cycles_since_probe = 0
        self.probing = True
        return 1

    def observe(self, drafted: int, accepted: int, draft_ms: float | None, verify_ms: float | None,
                match_length: int = 0, proposed: int | None = None) -> None:  # fmt: skip
        """Fold in one cycle: `drafted` tokens of class `match_length` verified, `accepted`
        of them taken, out of `proposed` (default: `drafted`; more when trim() left some
        out) drafted in `draft_ms`. Costs of None are not folded in (a request's first
        cycle, whose calls also prefill the prompt)."""
        if self.shared is not None:
            self.shared.observe(drafted, accepted, draft_ms, verify_ms, match_length, proposed)
        proposed = drafted if proposed is None else proposed
        if self.probing:  # the probe's cycle: one that drafted nothing (its call failed, drafting paused) ends it too
            self.probing = False
            if drafted:
                self.probe_every = PROBE_EVERY if accepted else min(2 * self.probe_every, MAX_PROBE_EVERY)
        if verify_ms is not None:
            add_decayed(self.verify, drafted, verify_ms)
        if drafted:
            positions = self.classes.setdefault(match_length, [])
            for counts in positions:
                counts[0] *= DECAY
                counts[1] *= DECAY
            for i in range(min(accepted + 1, drafted)):  # judged: the accepted ones and the first rejected
                if i == len(positions):
                    positions.append([0.0, 0.0])
                positions[i][0] += i < accepted
                positions[i][1] += 1
        if proposed and draft_ms is not None:
            add_decayed(self.draft, proposed, draft_ms)


def add_decayed(costs: dict[int, list[float]], size: int, ms: float) -> None:
    """Fold one observation into {size: [decayed sum of ms, decayed count]}, every size decaying."""
    for stats in costs.values():
        stats[0] *= DECAY
        stats[1] *= DECAY
    total = costs.setdefault(size, [0.0, 0.0])
    total[0] += ms
    total[1] += 1


def mean_points(costs: dict[int, list[float]]) -> list[tuple[int, float, float]]:
    """(size, mean ms, decayed count) of every size seen in {size: [decayed sum of ms, decayed count]}."""
    return [(size, total / count, count) for size, (total, count) in costs.items() if count > 0]


def fresh(points: list[tuple[int, float, float]]) -> list[tuple[int, float, float]]:
    """The points seen lately (decayed count at least STALE_COUNT); where none is, the one
    of the largest decayed count (the most and latest seen), so a quiet spell never leaves a
    line to its prior."""
    return [p for p in points if p[2] >= STALE_COUNT] or sorted(points, key=lambda p: p[2])[-1:]


def line_at(points: list[tuple[int, float, float]], k: int) -> float:
    """The least-squares line through (size, ms, weight) points of two or more sizes, each
    weighted by its decayed count (seen often and lately counts more), at k, its slope
    clamped at 0 (a longer pass or call does not cost less)."""
    total = sum(w for _, _, w in points)
    mean_x = sum(w * x for x, _, w in points) / total
    mean_y = sum(w * y for _, y, w in points) / total
    spread = sum(w * (x - mean_x) ** 2 for x, _, w in points)
    slope = sum(w * (x - mean_x) * (y - mean_y) for x, y, w in points) / spread
    return mean_y + max(slope, 0.0) * (k - mean_x)
