"""Verification of one cycle on the target model.

One forward pass over pending + drafts gives the target's logits at every
position; the last K+1 rows, warped exactly as the draft warped q, are p for the
K drafts and for the bonus position. `rejection_sample` decides; the KV cache is
cropped back to the accepted prefix so it never covers a rejected draft.

`verify_batch` verifies the cycles of several sessions with one forward pass over all of
their rows (kvcache.forward_batch), then judges each on its own: its own drafts, sampling
and generator, so a session's verdict does not depend on which others shared its pass
(beyond float rounding in the logits).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from specdec.batching import rerun_alone
from specdec.errors import OutOfRange
from specdec.kvcache import PREFILL_CHUNK, SessionState, forward, forward_batch, wait_for_device
from specdec.ngram import find_continuation
from specdec.sampling import greedy_token, greedy_verdict, rejection_sample, sample
from specdec.draft_wire import Draft, stack_draft_probs
from specdec.wire import Sampling

log = logging.getLogger("specdec")


def use_threads(threads: int) -> None:
    """Set torch's thread count for the next forward (a no-op when 0 or already set)."""
    if threads and torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


@dataclass
class Job:
    """One Verify call's work: a session's cycle (see Verifier.verify)."""

    state: SessionState
    drafts: Sequence[Draft]
    sampling: Sampling
    generator: torch.Generator
    steps: int = 1
    draft_busy: bool = False
    stop_at_ngram: tuple[int, int] | None = None

    @property
    def batchable(self) -> bool:
        """One forward pass is all it needs (no plain decoding after it, which would hold up
        the sessions sharing its pass)."""
        return self.plain_steps == 0

    @property
    def plain_steps(self) -> int:
        """Tokens decoded one forward each after its pass: none with drafts, else `steps` - 1
        (the pass itself gives the first)."""
        return 0 if self.drafts else max(self.steps, 1) - 1

    @property
    def rows(self) -> int:
        """Its pass's size in tokens, for the pass's time limit (serving.ModelWorker): the
        session's pending tokens and the drafts, and a prefill chunk's worth for each plain
        step (a forward of its own)."""
        return len(self.state.pending) + len(self.drafts) + self.plain_steps * PREFILL_CHUNK


@dataclass
class Verdict:
    num_accepted: int
    next_token: int
    bonus: bool
    forward_ms: float
    accept_ms: float
    more_tokens: list[int] = field(default_factory=list)  # decoded after next_token (steps > 1)
    batch: int = 1  # sessions whose cycles the forward pass verified (verify_batch)


class Verifier:
    def __init__(self, loaded, threads: int = 0, solo_threads: int = 0):
        self.loaded = loaded
        self.model = loaded.model
        # Torch threads while the draft drafts beside us, and while it is idle (see
        # TargetConfig); 0 = unchanged.
        self.threads = threads
        self.solo_threads = solo_threads or threads

    def verify(
        self, state: SessionState, drafts: Sequence[Draft], sampling: Sampling, generator: torch.Generator,
        steps: int = 1, draft_busy: bool = False, stop_at_ngram: tuple[int, int] | None = None,
    ) -> Verdict:  # fmt: skip
        """Judge `drafts`; without drafts, decode up to `steps` tokens (plain sampling from p,
        one generator for the whole call), stopping after an end token, and after a token at
        which the context has an n-gram match of `stop_at_ngram` = (min, max) tokens. `draft_busy`:
        the draft keeps drafting during this call (pipelining), so leave it its core."""
        verdict = self.verify_batch([Job(state, drafts, sampling, generator, steps, draft_busy, stop_at_ngram)])[0]
        if isinstance(verdict, Exception):
            raise verdict
        return verdict

    def verify_batch(self, jobs: Sequence[Job]) -> list[Verdict | Exception]:
        """Verify each job's cycle, all in one forward pass (module doc); a job that cannot run
        (past the context) or cannot be judged (judge_or_error) gets its exception in its place
        and the others go on, and when the pass itself fails, each job is verified alone
        (verify_alone). Threads: the fewer, `threads`, while any job's draft drafts beside it."""
        use_threads(self.threads if any(job.draft_busy for job in jobs) else self.solo_threads)
        results: list[Verdict | Exception | None] = [None] * len(jobs)
        fed: dict[int, list[int]] = {}
        for i, job in enumerate(jobs):
            try:
                fed[i] = self.fed(job)
            except OutOfRange as exc:
                results[i] = exc
        start = time.perf_counter()
        ready = list(fed)
        try:
            logits = forward_batch(self.model, [jobs[i].state.cache for i in ready], [fed[i] for i in ready],
                                   [len(jobs[i].drafts) + 1 for i in ready])  # each [K+1, V]  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - the session's error, for it alone where it can be
            if len(ready) > 1:
                return self.verify_alone(jobs, results, exc)
            results[ready[0]] = exc
            return results
        if logits:
            wait_for_device(logits[0])
        forward_ms = (time.perf_counter() - start) * 1000
        for i, rows in zip(ready, logits):
            results[i] = self.judge_or_error(jobs[i], fed[i], rows, forward_ms, len(ready))
        return results

    def judge_or_error(self, job: Job, fed: list[int], logits: torch.Tensor, forward_ms: float,
                       batch: int) -> Verdict | Exception:  # fmt: skip
        """`judge`, or the job's own error (logits it cannot sample from, say) with its session
        brought back to the tokens and cache it held before the pass, so the error reaches that
        job alone and not the others judged from the same pass."""
        state = job.state
        held, pending = len(state.held), list(state.pending)
        try:
            return self.judge(job, fed, logits, forward_ms, batch)
        except Exception as exc:  # noqa: BLE001 - this job's own error, for it alone
            state.crop(held)
            state.pending = pending
            return exc

    def verify_alone(self, jobs: Sequence[Job], results: list, error: Exception) -> list[Verdict | Exception]:
        """After a pass over several sessions failed (out of memory, say: more rows than one
        session's), each session's cache brought back to what it held before the pass, then
        each job verified in a pass of its own: only a job that fails alone fails."""
        log.warning("a verify pass over %d sessions failed (%s): verifying them one at a time", len(jobs), error)
        return rerun_alone(jobs, results, self.verify_batch)

    def fed(self, job: Job) -> list[int]:
        """What the job's forward feeds: the session's pending tokens, then its drafts;
        OutOfRange when that, and any plain steps after it, would pass the context."""
        state = job.state
        fed = state.pending + [d.token for d in job.drafts]
        positions = len(state.held) + len(fed) + job.plain_steps
        if self.loaded.max_context and positions > self.loaded.max_context:
            raise OutOfRange(f"{positions} positions exceed the target's context of {self.loaded.max_context}")
        return fed

    def judge(self, job: Job, fed: list[int], logits: torch.Tensor, forward_ms: float, batch: int) -> Verdict:
        """The verdict on a job's drafts from the target's logits at its last K + 1 fed
        positions [K+1, V] (from a pass over `batch` sessions); the session brought to the
        accepted prefix; then its plain steps."""
        state, drafts, sampling, generator = job.state, job.drafts, job.sampling, job.generator
        k = len(drafts)
        forward_done = time.perf_counter()
        # Decoded from protobuf on the CPU; the target's logits may be on a GPU.
        draft_tokens = torch.tensor([d.token for d in drafts], dtype=torch.long, device=logits.device)  # [K]
        draft_probs = stack_draft_probs(drafts)  # [K, V] or None (one-hot)
        if draft_probs is not None:
            draft_probs = draft_probs.to(logits.device)
        if sampling.greedy:  # the same verdict, certain, read off the logits
            num_accepted, next_token = greedy_verdict(draft_tokens, draft_probs, logits)
        else:
            target_probs = sampling.warp(logits)  # [K+1, V]
            # draft_from_pb checked each q (a distribution, q(token) > 0) and p is warp's own.
            num_accepted, next_token = rejection_sample(draft_tokens, draft_probs, target_probs, generator, validate=False)

        # Keep what the target saw up to the accepted prefix; `next_token` is not fed yet.
        accepted_length = len(state.held) + len(state.pending) + num_accepted
        state.feed(fed)
        state.crop(accepted_length)
        state.pending = [next_token]
        accepted_at = time.perf_counter()
        more_tokens = self.decode_more(state, job.plain_steps, sampling, generator, job.stop_at_ngram)
        done = time.perf_counter()
        return Verdict(
            num_accepted=num_accepted,
            next_token=next_token,
            bonus=num_accepted == k,
            forward_ms=forward_ms + (done - accepted_at) * 1000,  # the plain steps are forwards too
            accept_ms=(accepted_at - forward_done) * 1000,
            more_tokens=more_tokens,
            batch=batch,
        )

    def decode_more(
        self, state: SessionState, steps: int, sampling: Sampling, generator: torch.Generator,
        stop_at_ngram: tuple[int, int] | None = None,
    ) -> list[int]:  # fmt: skip
        """Plain decoding after state.pending: up to `steps` tokens, none after an end token,
        none once the context ends in an n-gram match of stop_at_ngram = (min, max) tokens."""
        tokens: list[int] = []
        if steps <= 0:
            return tokens
        eos = set(self.loaded.eos_token_ids or [])
        while len(tokens) < steps and state.pending[-1] not in eos:
            if stop_at_ngram is not None and find_continuation(state.tokens(), 1, stop_at_ngram[1], stop_at_ngram[0])[0]:
                break  # the n-gram draft has something to propose from here
            logits = forward(self.model, state.cache, state.pending)  # [1, V]
            state.feed(state.pending)
            token = greedy_token(logits[-1]) if sampling.greedy else sample(sampling.warp(logits[-1]), generator)
            state.pending = [token]
            tokens.append(token)
        return tokens
