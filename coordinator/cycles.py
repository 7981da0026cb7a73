"""The cycle loop of one request (design.md §2).

Terms:
    committed   prompt + output token ids, as stored in Redis.
    seen        per model service, how many committed tokens it holds in its cache
                (the `position` we send); the rest go as `new_tokens`.
    cycle       one draft → verify → commit round; also the fencing number of the commit.

One cycle: stream up to K drafts from the draft service (stopping early at an end
token), relay them unchanged to the target's Verify, commit drafts[:n] + [next]
to Redis fenced by the cycle number, and report what was committed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import grpc
from opentelemetry import context as otel_context
from opentelemetry import trace

from specdec import telemetry
from specdec.session import SessionStore
from specdec.v1 import specdec_pb2 as pb
from specdec.wire import Sampling, sampling_to_pb

log = logging.getLogger("specdec.coordinator")

# Target calls that fail with these codes are retried (restart, rollout, overload).
RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED}
TARGET_RETRY_BACKOFF_S = (0.05, 0.2, 0.5, 1.0, 2.0, 2.0, 4.0, 4.0, 8.0, 8.0)
# After a failed draft call, cycles run without drafting for this many cycles (doubling).
DRAFT_BACKOFF_CYCLES = (1, 2, 4, 8, 16, 32)


@dataclass
class Plan:
    """What one request asks of the loop, already validated."""

    session_id: str
    prompt: list[int]
    max_new_tokens: int
    sampling: Sampling  # seed always set
    k: int  # 0 = speculation off
    eos_token_ids: frozenset[int]
    max_context: int
    draft_model: str
    draft_fingerprint: str


@dataclass
class Outcome:
    """What one cycle committed."""

    tokens: list[int]
    info: pb.CycleInfo
    eos: bool
    length_reached: bool


@dataclass
class Stats:
    cycles: int = 0
    draft_cycles: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    generated_tokens: int = 0

    def add(self, drafted: int, accepted: int, committed: int) -> None:
        self.cycles += 1
        self.draft_cycles += drafted > 0
        self.draft_tokens += drafted
        self.accepted_tokens += accepted
        self.generated_tokens += committed
        while len(self.accepted_per_position) < accepted:
            self.accepted_per_position.append(0)
        for i in range(accepted):
            self.accepted_per_position[i] += 1


class CycleLoop:
    def __init__(
        self,
        draft,
        target,
        store: SessionStore,
        plan: Plan,
        deadline: float | None,
        trace_context: otel_context.Context | None = None,
    ):
        self.draft = draft  # DraftStub
        self.target = target  # TargetStub
        self.store = store
        self.plan = plan
        self.deadline = deadline  # time.monotonic() by which the request must end
        self.committed = list(plan.prompt)
        self.draft_seen = 0
        self.target_seen = 0
        self.cycle = 0
        self.stats = Stats()
        self.draft_failures = 0
        self.draft_paused_until = 0  # cycle index from which drafting resumes
        # Parent of the cycle spans: the request's specdec.generate span.
        self.trace_context = trace_context
        self.tracer = telemetry.tracer()

    async def run(self) -> AsyncIterator[Outcome]:
        plan = self.plan
        while True:
            generated = len(self.committed) - len(plan.prompt)
            remaining = plan.max_new_tokens - generated
            room = plan.max_context - len(self.committed) if plan.max_context else remaining
            if remaining <= 0 or room <= 0:
                return
            # Never draft past max_new_tokens or the context: a cycle emits up to k + 1 tokens.
            k = max(0, min(plan.k, remaining - 1, room - 1))
            outcome = await self.run_cycle(k, remaining)
            yield outcome
            if outcome.eos or outcome.length_reached:
                return

    async def run_cycle(self, k: int, remaining: int) -> Outcome:
        attributes = {"specdec.cycle": self.cycle, "specdec.k": k}
        with self.tracer.start_as_current_span(
            telemetry.CYCLE_SPAN, context=self.trace_context, attributes=attributes
        ) as span:
            outcome = await self.run_traced_cycle(k, remaining)
            span.set_attribute("specdec.accepted", outcome.info.accepted)
            span.set_attribute("specdec.bonus", outcome.info.bonus)
            span.set_attribute("specdec.drafted", outcome.info.drafted)
            return outcome

    async def run_traced_cycle(self, k: int, remaining: int) -> Outcome:
        start = time.perf_counter()
        drafts = await self.propose(k) if k > 0 else []
        drafted_at = time.perf_counter()
        verdict = await self.verify(drafts)
        verified_at = time.perf_counter()

        n = verdict.num_accepted
        new = [d.token_id for d in drafts[:n]] + [verdict.next_token]
        eos = False
        for i, token in enumerate(new):
            if token in self.plan.eos_token_ids:
                new, eos = new[: i + 1], True
                break
        new = new[:remaining]

        increments = {"cycles": 1, "draft_tokens": len(drafts), "accepted_tokens": n}
        increments.update({f"accepted_pos_{i}": 1 for i in range(n)})
        await self.store.commit(self.plan.session_id, self.cycle, new, increments)

        before = len(self.committed)
        self.committed.extend(new)
        # The target holds everything up to the accepted prefix; the draft fed all but its last draft.
        self.target_seen = before + n
        self.draft_seen = before + min(n, len(drafts) - 1) if drafts else self.draft_seen
        self.stats.add(len(drafts), n, len(new))
        info = pb.CycleInfo(
            index=self.cycle,
            drafted=len(drafts),
            accepted=n,
            bonus=verdict.bonus and len(drafts) > 0,
            draft_ms=(drafted_at - start) * 1000,
            verify_ms=(verified_at - drafted_at) * 1000,
            k=k,
            draft_bytes=sum(d.ByteSize() for d in drafts),
        )
        self.cycle += 1
        generated = len(self.committed) - len(self.plan.prompt)
        return Outcome(new, info, eos, generated >= self.plan.max_new_tokens)

    def timeout(self) -> float | None:
        return None if self.deadline is None else max(0.001, self.deadline - time.monotonic())

    async def propose(self, k: int) -> list[pb.DraftToken]:
        """Stream up to k drafts; on a draft fault, fall back to no drafts this cycle."""
        if self.cycle < self.draft_paused_until:
            return []
        request = pb.ProposeRequest(
            session_id=self.plan.session_id,
            position=self.draft_seen,
            new_tokens=self.committed[self.draft_seen :],
            k=k,
            sampling=sampling_to_pb(self.plan.sampling),
            cycle=self.cycle,
        )
        drafts: list[pb.DraftToken] = []
        try:
            with self.tracer.start_as_current_span(telemetry.PROPOSE_SPAN, attributes={"specdec.k": k}) as span:
                call = self.draft.Propose(request, timeout=self.timeout())
                async for token in call:
                    drafts.append(token)
                    span.add_event("draft_token", {"index": token.index, "token_id": token.token_id})
                    if token.token_id in self.plan.eos_token_ids:
                        call.cancel()  # nothing after an end token can be kept
                        break
                span.set_attribute("specdec.drafted", len(drafts))
        except grpc.aio.AioRpcError as exc:
            if exc.code() not in RETRYABLE | {grpc.StatusCode.DEADLINE_EXCEEDED}:
                raise
            backoff = DRAFT_BACKOFF_CYCLES[min(self.draft_failures, len(DRAFT_BACKOFF_CYCLES) - 1)]
            self.draft_failures += 1
            self.draft_paused_until = self.cycle + backoff
            log.warning("draft unavailable (%s); target-only for %d cycle(s)", exc.code().name, backoff)
            return []
        self.draft_failures = 0
        return drafts

    async def verify(self, drafts: Sequence[pb.DraftToken]) -> pb.VerifyResponse:
        """Verify on the target, retrying a retryable failure (the request is idempotent:
        same position, same drafts, same per-cycle random stream)."""
        request = pb.VerifyRequest(
            session_id=self.plan.session_id,
            position=self.target_seen,
            new_tokens=self.committed[self.target_seen :],
            drafts=drafts,
            sampling=sampling_to_pb(self.plan.sampling),
            cycle=self.cycle,
            draft_fingerprint=self.plan.draft_fingerprint,
            draft_model=self.plan.draft_model,
        )
        for attempt, pause in enumerate((*TARGET_RETRY_BACKOFF_S, None)):
            try:
                with self.tracer.start_as_current_span(telemetry.VERIFY_SPAN) as span:
                    span.set_attribute("specdec.drafts", len(drafts))
                    span.set_attribute("specdec.attempt", attempt)
                    reply = await self.target.Verify(request, timeout=self.timeout(), wait_for_ready=True)
                    span.set_attribute("specdec.forward_ms", reply.forward_ms)
                    span.set_attribute("specdec.accept_ms", reply.accept_ms)
                    span.set_attribute("specdec.accepted", reply.num_accepted)
                    return reply
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in RETRYABLE or pause is None:
                    raise
                if self.deadline is not None and time.monotonic() + pause > self.deadline:
                    raise
                log.warning("target %s (attempt %d); retrying in %.2fs", exc.code().name, attempt + 1, pause)
                await asyncio.sleep(pause)
        raise AssertionError("unreachable")
