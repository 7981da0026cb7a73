"""The cycle loop of one request (design.md §2).

Terms:
    committed   prompt + output token ids, as stored in Redis.
    seen        per model service, how many committed tokens it holds in its cache
                (the `position` we send); the rest go as `new_tokens`.
    cycle       one draft → verify → commit round; also the fencing number of the commit.
    guess       with pipelining, the draft's (K+1)-th token: its bet on the target's
                bonus token, should all K drafts be accepted.

One cycle: stream up to K drafts from the draft service (stopping early at an end
token), relay them unchanged to the target's Verify, commit drafts[:n] + [next]
to Redis fenced by the cycle number, and report what was committed.

Pipelining: the draft is asked for K+1 tokens. Verification starts as soon as K
have arrived; meanwhile the draft produces the guess and, as soon as it arrives,
a speculative Propose for the next cycle starts from prefix + drafts + guess. If
the verdict accepts all K and its next token equals the guess, the next cycle's
drafts are already (being) drafted; otherwise the speculative call is cancelled
and the next cycle drafts from the corrected prefix. Which drafts the target sees
never depends on the timing, only on the committed prefix and the per-cycle random
streams, so the output is the same with pipelining on or off.

An n-gram draft is looked up here (`NgramLookup`) unless the plan says otherwise: the
draft service's n-gram drafter would run the same lookup on the same prefix, so the
tokens are the same, without a network hop and without the CPU that two gRPC hops and the
draft service's own work take from a target sharing the machine.

N-gram first (`plan.ngram_first`, with a model draft): a cycle whose context ends in an
n-gram of at least the plan's shortest length seen earlier drafts the tokens that followed
it, looked up here (one-hot q, no draft call); any other cycle asks the draft model. The
choice depends only on the committed prefix (or, for a pipelined call, on the prefix it
assumes), and each cycle's drafts are verified against the q they were drawn from, so the
output stays the target's. The draft model skips the looked-up cycles' tokens until its
next call, which sends them as new_tokens. Looked-up cycles go on while the draft service
is in back-off.

Commit overlap: a cycle's Redis commit runs while the next cycle drafts and verifies. The
outcome reaches the client only once its commit is in (commits land in cycle order: each
waits for the one before), and the next Verify says `awaits_commit`, so the target waits
for committed tokens that have not landed yet instead of refusing them. A failed commit
ends the request with its error, as before, and the cycle running meanwhile is cancelled.

Prefetch: a cycle that did not keep a speculative call starts the next cycle's Propose
as soon as its verdict is applied, before its Redis commit and its reply to the client,
so the draft drafts meanwhile: the same request the next cycle would send, only sooner.

Whether a cycle pipelines: the plan allows it, and the chance that its early drafting
is kept (all K accepted and the guess right: α̂^(K+1), or with adaptive K the product of
its per-position estimates α̂_0 .. α̂_K) is at least
`plan.pipeline_min_keep`. The Verify of a pipelined cycle says `draft_busy`: a target
sharing the draft's cores verifies on fewer threads then, so a guess that is seldom
kept costs more than it saves; with the draft idle the target takes every core.

Faults: a draft call that fails, or takes longer than its budget (`draft_budget`), is
abandoned and the cycle runs target-only: Verify with no drafts, the same per-cycle
random stream, so the output stays lossless (and identical for greedy). Drafting then
pauses for a growing number of cycles and resumes on its own. A target call that fails
retryably is sent again unchanged, to the session's replica as of then (coordinator.replicas:
one that failed is skipped): it is idempotent, and the Redis commit that follows is fenced
by the cycle number.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import grpc
from opentelemetry import context as otel_context
from opentelemetry import trace

from coordinator.adaptive import AdaptiveK
from coordinator.replicas import NoReplicaYet, Replica, Replicas
from specdec import telemetry
from specdec.errors import Unavailable, is_store_fault
from specdec.ngram import find_continuation
from specdec.session import SessionStore, superseded
from specdec.v1 import specdec_pb2 as pb
from specdec.wire import PROPOSE_STARTED, Sampling, sampling_to_pb, target_key

log = logging.getLogger("specdec.coordinator")

# Target calls that fail with these codes are retried (restart, rollout, overload; ABORTED: the
# target dropped a stale state of the session, errors.SessionRecreated).
RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.ABORTED}
TARGET_RETRY_BACKOFF_S = (0.05, 0.2, 0.5, 1.0, 2.0, 2.0, 4.0, 4.0, 8.0, 8.0)
# After a failed draft call, cycles run without drafting for this many cycles (doubling).
DRAFT_BACKOFF_CYCLES = (1, 2, 4, 8, 16, 32)
# A cycle without drafts (speculation off, adaptive K = 0, draft back-off) has the target
# decode up to this many tokens in one call: one round trip and one commit for all of
# them instead of one per token. A request's first cycle decodes one (time to first token).
SOLO_STEPS = 4
# Longest one Propose call may take before the cycle abandons it and runs target-only.
# A healthy draft needs K·c_q plus one gRPC hop: tens of ms for the drafts we serve
# (2-layer draft ~11 ms/token, SmolLM2-135M ~70 ms/token on CPU; K+1 = 17 of the latter
# is ~1.2 s). The first call of a session also prefills the prompt. 2 s leaves room for
# both and still bounds what a stalled draft (stopped, swapping, overloaded) costs a cycle.
DRAFT_TIMEOUT_S = 2.0
# With a request deadline, one Propose call may also take at most this share of the time
# left: a stalled draft then costs a cycle a quarter of it, and the target-only fallback
# keeps the other three quarters.
DRAFT_DEADLINE_SHARE = 0.25


def target_retry_pause(code: grpc.StatusCode, attempt: int, single: bool) -> float | None:
    """Seconds to wait before sending a Verify again after its attempt number `attempt` (0 =
    the first) failed with `code`; None: fail. A RETRYABLE code is retried after each pause of
    TARGET_RETRY_BACKOFF_S. With one target address (`single`) a lost connection never fails
    a call: the call waits for it (wait_for_ready). With several replicas calls fail fast, so
    that another replica can take them; when all of them are down (the only pod behind a
    dns:/// name restarting, say) UNAVAILABLE is retried every TARGET_RETRY_BACKOFF_S[-1]
    seconds as long as the request's deadline allows, as waiting for the connection would."""
    if code not in RETRYABLE:
        return None
    if attempt < len(TARGET_RETRY_BACKOFF_S):
        return TARGET_RETRY_BACKOFF_S[attempt]
    return TARGET_RETRY_BACKOFF_S[-1] if code == grpc.StatusCode.UNAVAILABLE and not single else None


def draft_budget(draft_timeout_s: float, remaining_s: float | None) -> float | None:
    """Seconds one Propose call may run before it is abandoned: at most draft_timeout_s
    (0 = no limit of its own) and, with a deadline `remaining_s` away, at most
    DRAFT_DEADLINE_SHARE of it. None means no limit at all."""
    limits = []
    if draft_timeout_s > 0:
        limits.append(draft_timeout_s)
    if remaining_s is not None:
        limits.append(max(0.001, DRAFT_DEADLINE_SHARE * remaining_s))
    return min(limits) if limits else None


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
    # The target model the session runs on (its ModelInfo, as adopted when the session began
    # or was resumed): every Verify names it, so a target serving another refuses it. None:
    # not named.
    target: pb.ModelInfoResponse | None = None
    # Draft the next cycle while the target verifies this one ...
    pipeline: bool = True
    # ... in cycles whose early drafting is kept with at least this estimated chance,
    # α̂^(K+1) (`CycleLoop.pipelines`); 0 = every cycle.
    pipeline_min_keep: float = 0.0
    # Choose K per cycle (coordinator.adaptive); `k` is then the largest K allowed.
    adaptive: bool = False
    # An n-gram draft's (min_ngram, max_ngram): adaptive K looks its match up beforehand.
    ngram: tuple[int, int] | None = None
    # ... and the drafts too, here instead of through the draft service (NgramLookup).
    local_ngram: bool = False
    # With a model draft: (min_ngram, max_ngram) of the n-gram matches whose cycles draft by
    # lookup instead of asking the model (module doc: n-gram first); None = off.
    ngram_first: tuple[int, int] | None = None
    # Strings that end the output (the coordinator's TextStream looks for them).
    stop: tuple[str, ...] = ()
    # The run that owns the session (SessionStore.take_over): its commits name it, so a
    # run whose session was resumed elsewhere stops at its next commit. "" = no check.
    owner: str = ""
    # Sessions of one affinity key go to the same replicas (GenerateRequest.affinity_key).
    affinity_key: str = ""

    @property
    def route(self) -> str:
        """What picks the session's draft and target replicas (Replicas.pick)."""
        return self.affinity_key or self.session_id


@dataclass
class Outcome:
    """What one cycle committed."""

    tokens: list[int]
    info: pb.CycleInfo
    eos: bool
    length_reached: bool
    # The request's statistics as of this cycle (later cycles may be running already).
    stats: "Stats"


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


class DraftCall:
    """One Propose call, streaming its DraftTokens into `tokens` in the background.

    It stops reading after an end-of-sequence token (nothing after it can be kept).
    `budget` is the call's gRPC deadline: past it the call ends with DEADLINE_EXCEEDED
    even if the draft never answers, and the cycle treats that as a draft fault.
    `span` (specdec.draft.call, telemetry) lasts as long as the call and is its gRPC span's
    parent; it used to be the cycle's span, that of the cycle before for a pipelined call."""

    def __init__(self, replica: Replica, request: pb.ProposeRequest, budget: float | None,
                 eos_token_ids: frozenset[int], tracer):  # fmt: skip
        self.replica = replica  # the draft replica asked
        self.started = time.monotonic()
        self.k = request.k  # tokens asked for
        self.budget = budget  # seconds it may run (draft_budget)
        self.tokens: list[pb.DraftToken] = []
        self.error: grpc.aio.AioRpcError | None = None
        self.finished = False
        self.eos_token_ids = eos_token_ids
        self.changed = asyncio.Event()
        attributes = {"specdec.cycle": request.cycle, "specdec.k": request.k}
        self.span = tracer.start_span(telemetry.DRAFT_CALL_SPAN, attributes=attributes)
        with trace.use_span(self.span, end_on_exit=False):  # the call's own span and task begin under it
            self.call = replica.stub.Propose(request, timeout=budget)
            self.task = asyncio.get_running_loop().create_task(self.pump())

    async def pump(self) -> None:
        try:
            async for token in self.call:
                self.tokens.append(token)
                self.replica.answered_at = time.monotonic()
                self.changed.set()
                if token.token_id in self.eos_token_ids:
                    self.call.cancel()
                    break
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.CANCELLED:
                self.error = exc
        finally:
            self.finished = True
            self.changed.set()
            self.end_span()

    def end_span(self) -> None:
        """End the call's span once (when its stream ends, or it is cancelled before its task ran)."""
        if self.span.is_recording():
            self.span.set_attribute("specdec.streamed", len(self.tokens))
            if self.error is not None:
                self.span.set_status(trace.StatusCode.ERROR, self.error.code().name)
            self.span.end()

    async def first(self, n: int) -> list[pb.DraftToken]:
        """The first n tokens, or fewer if the stream ended sooner; raises the call's error."""
        while len(self.tokens) < n and not self.finished:
            self.changed.clear()
            await self.changed.wait()
        if self.error is not None and len(self.tokens) < n:
            raise self.error
        return self.tokens[:n]

    async def answered(self) -> bool:
        """Whether the draft service began the call: it sends PROPOSE_STARTED first thing, so a
        call that got it reached a live service, however long the service then took. Does not
        wait once the call has ended."""
        metadata = await self.call.initial_metadata()
        (key, value), = PROPOSE_STARTED
        return metadata is not None and metadata.get(key) == value

    def cancel(self) -> None:
        self.call.cancel()
        self.task.cancel()
        # A task cancelled before it ran never reaches pump's finally: first() would wait forever.
        self.finished = True
        self.changed.set()
        self.end_span()


class NgramLookup:
    """An n-gram draft looked up in the coordinator, offering DraftCall's interface: the
    tokens the draft service's n-gram drafter would stream when asked for k (the same
    `find_continuation` on the same prefix), cut after an end token as DraftCall cuts them.
    `match` is a lookup for k or more tokens (`CycleLoop.look_up`): a shorter lookup's
    continuation is a prefix of a longer one's, so one lookup serves every k."""

    error = None
    finished = True

    def __init__(self, match: tuple[list[int], int], k: int, eos_token_ids: frozenset[int]):
        self.k = k
        continuation, match_length = match
        self.tokens = []
        for index, token in enumerate(continuation[:k]):
            self.tokens.append(pb.DraftToken(token_id=token, index=index, match_length=match_length, one_hot={}))
            if token in eos_token_ids:
                break

    async def first(self, n: int) -> list[pb.DraftToken]:
        return self.tokens[:n]

    def cancel(self) -> None:
        pass


class NoDrafts:
    """DraftCall's interface for a Propose that could not be sent (no draft replica to ask):
    no tokens, so the cycle runs target-only."""

    error = None
    finished = True

    def __init__(self, k: int):
        self.k = k  # tokens asked for
        self.tokens: list[pb.DraftToken] = []

    async def first(self, n: int) -> list[pb.DraftToken]:
        return []

    def cancel(self) -> None:
        pass


def discard(guess: asyncio.Task) -> None:
    """Stop a `speculate` task, and the Propose call it may already have started."""
    if guess.done() and not guess.cancelled() and guess.exception() is None and guess.result() is not None:
        guess.result().call.cancel()
    guess.cancel()


@dataclass
class Speculation:
    """A Propose already running for the cycle after the current one."""

    call: DraftCall
    # The committed tokens it assumed: prefix + all drafts of the current cycle + the guess.
    assumed: list[int]
    # The K it drafts for.
    k: int
    # Started from the committed prefix once the verdict was in (prefetch_draft), not from
    # a guess: the cycle that takes it is not a pipelined one.
    prefetched: bool = False


class CycleLoop:
    def __init__(
        self,
        drafts: Replicas,
        targets: Replicas,
        store: SessionStore,
        plan: Plan,
        deadline: float | None,
        trace_context: otel_context.Context | None = None,
        shared_k: AdaptiveK | None = None,
        draft_timeout_s: float = DRAFT_TIMEOUT_S,
    ):
        self.drafts = drafts  # the draft service's replicas (coordinator.replicas)
        self.targets = targets  # the target service's
        self.store = store
        self.plan = plan
        self.deadline = deadline  # time.monotonic() by which the request must end
        self.draft_timeout_s = draft_timeout_s  # see draft_budget
        self.committed = list(plan.prompt)
        self.draft_seen = 0
        self.draft_replica = None  # the draft replica draft_seen counts on: the last whose call reached the session
        self.target_seen = 0
        self.cycle = 0
        self.cycles_run = 0  # cycles this run has run (a Resume's run begins at its session's cycle)
        self.verify_retried = False  # whether the latest Verify took more than one attempt
        self.stats = Stats()
        # Drafts the target judged (accepted ones, and the one rejection that ends a cycle)
        # and accepted: α̂ for pipelining when adaptive K keeps no estimate of its own.
        self.judged = 0
        self.accepted = 0
        self.draft_failures = 0
        self.draft_paused_until = 0  # cycle index from which drafting resumes
        self.speculation: Speculation | None = None
        self.undrafted: list[int] | None = None  # the prefix prefetch_draft chose K = 0 for (draft_call)
        # The latest cycle's Redis commit while it runs (commit overlap, module doc), and
        # the outcomes whose commits are in (or the error that ends the request), in order.
        self.committing: asyncio.Task | None = None
        self.outbox: asyncio.Queue[Outcome | BaseException | None] = asyncio.Queue()
        # Adaptive K: a per-session estimate seeded from (and feeding) the coordinator's.
        self.adaptive = None
        if plan.adaptive and plan.k > 0:
            self.adaptive = (shared_k or AdaptiveK(plan.k)).session(plan.k)
        # Parent of the cycle spans: the request's specdec.generate span.
        self.trace_context = trace_context
        self.tracer = telemetry.tracer()

    def resume_at(self, committed: list[int], cycle: int, stats: "Stats") -> None:
        """Go on with a session another run began (Resume): its committed tokens, the number of
        its next cycle and its statistics so far, as Redis holds them. The target is told it
        holds all but the last token (one that lacks some fetches them from Redis); the draft,
        whose state this run cannot know, gets the whole context (start_propose)."""
        self.committed = list(committed)
        self.cycle = cycle
        self.stats = stats
        self.draft_seen = self.target_seen = len(committed) - 1

    async def run(self) -> AsyncIterator[Outcome]:
        """Each cycle's outcome once its commit is in; the cycles themselves run ahead in a
        task (`produce`), so a commit overlaps the next cycle (module doc)."""
        producer = asyncio.get_running_loop().create_task(self.produce())
        try:
            while (item := await self.outbox.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            producer.cancel()
            for task in (producer, self.committing):
                if task is not None:
                    with contextlib.suppress(BaseException):
                        await task
            self.drop_speculation()

    async def produce(self) -> None:
        """Run cycles until done; then, once the last commit is in, put None in the outbox.
        An error goes to the outbox instead (run raises it there)."""
        try:
            while True:
                limit = self.limit(len(self.committed))
                if limit is None:
                    break
                outcome = await self.run_cycle(limit)
                if outcome.eos or outcome.length_reached:
                    break
            if self.committing is not None:
                await self.committing
            self.outbox.put_nowait(None)
        except BaseException as exc:
            if isinstance(exc, Exception) and self.committing is not None:
                with contextlib.suppress(Exception):
                    await self.committing  # the outcome of a commit in flight goes out first
            self.outbox.put_nowait(exc)  # run raises it
            if not isinstance(exc, Exception):
                raise

    async def commit(self, previous: asyncio.Task | None, outcome: Outcome, increments: dict[str, int],
                     verified_at: float) -> None:  # fmt: skip
        """Commit a cycle's tokens, fenced by its number, after the cycle before it; then
        hand its outcome to `run`. A failed commit goes to the outbox as the request's error."""
        try:
            if previous is not None:
                await previous
            await self.store.commit(self.plan.session_id, outcome.info.index, outcome.tokens, increments,
                                    self.plan.owner)  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, which raises it
            self.outbox.put_nowait(exc)
            raise
        outcome.info.commit_ms = (time.perf_counter() - verified_at) * 1000
        self.outbox.put_nowait(outcome)

    def headroom(self, committed_length: int) -> int:
        """How many more tokens may be committed after `committed_length`: never past
        max_new_tokens or the context."""
        plan = self.plan
        remaining = plan.max_new_tokens - (committed_length - len(plan.prompt))
        room = plan.max_context - committed_length if plan.max_context else remaining
        return min(remaining, room)

    def limit(self, committed_length: int) -> int | None:
        """The largest K a cycle starting at `committed_length` may draft (a cycle emits up
        to K + 1 tokens), or None when done."""
        headroom = self.headroom(committed_length)
        if headroom <= 0:
            return None
        return max(0, min(self.plan.k, headroom - 1))

    def look_up(self, limit: int, context: Sequence[int]) -> tuple[list[int], int] | None:
        """With an n-gram draft, the match it would copy after `context`: (up to limit + 1
        tokens, enough for K drafts and a guess; the n-gram length, 0 without a match).
        With n-gram first, the same for a match of at least its shortest length, else None
        (the model drafts). None without either, or with nothing to draft (limit 0)."""
        lengths = self.plan.ngram or self.plan.ngram_first
        if lengths is None or limit <= 0:
            return None
        match = find_continuation(context, limit + 1, lengths[1], lengths[0])
        if self.plan.ngram is None and not match[1]:
            return None
        return match

    def draft_class(self, match: tuple[list[int], int] | None) -> int | None:
        """The confidence class (adaptive K) of the drafts a cycle with this `look_up` result
        gets: the match length of a lookup, 0 for the model of n-gram first, None when not
        known beforehand (a model draft: its one class)."""
        if match is not None:
            return match[1]
        return 0 if self.plan.ngram_first is not None else None

    def looks_up_here(self, match: tuple[list[int], int] | None) -> bool:
        """Whether a cycle with this `look_up` result takes its drafts from the lookup."""
        return self.plan.local_ngram or (self.plan.ngram_first is not None and match is not None)

    def choose_k(self, limit: int, match: tuple[list[int], int] | None) -> int:
        """K for a cycle that may draft up to `limit`. With an n-gram draft, `match`
        (look_up) decides first: no match, no draft call (it would propose nothing); with
        adaptive K, its match length decides K."""
        match_length = self.draft_class(match)
        if match_length == 0 and self.plan.ngram is not None:
            return 0
        if self.adaptive is None:
            return limit
        return self.adaptive.choose(limit, match_length)

    def ngram_stop(self) -> pb.NgramStop | None:
        """For a call of plain steps with an n-gram draft, or with n-gram first: stop where
        the context gets a match worth drafting (the shortest match length adaptive K would
        verify, or any for a fixed K), so the next cycle drafts from there. None: no such stop
        (no lookup, speculation off, or no match length worth it; with an n-gram draft also
        while drafting is paused: n-gram first's lookups go on then)."""
        if self.plan.k == 0:
            return None
        if self.plan.ngram is not None and self.cycle >= self.draft_paused_until:
            min_ngram, max_ngram = self.plan.ngram
        elif self.plan.ngram_first is not None:
            min_ngram, max_ngram = self.plan.ngram_first
        else:
            return None
        if self.adaptive is not None:
            limit = self.limit(len(self.committed)) or 0
            worth = [n for n in range(min_ngram, max_ngram + 1) if self.adaptive.worth_drafting(limit, n)]
            if not worth:
                return None
            min_ngram = worth[0]
        return pb.NgramStop(min_ngram=min_ngram, max_ngram=max_ngram)

    async def run_cycle(self, limit: int) -> Outcome:
        with self.tracer.start_as_current_span(
            telemetry.CYCLE_SPAN, context=self.trace_context, attributes={"specdec.cycle": self.cycle}
        ) as span:
            outcome = await self.run_traced_cycle(limit)
            span.set_attribute("specdec.k", outcome.info.k)
            span.set_attribute("specdec.accepted", outcome.info.accepted)
            span.set_attribute("specdec.bonus", outcome.info.bonus)
            span.set_attribute("specdec.drafted", outcome.info.drafted)
            span.set_attribute("specdec.pipelined", outcome.info.pipelined)
            return outcome

    async def run_traced_cycle(self, limit: int) -> Outcome:
        start = time.perf_counter()
        call, k, pipelined = self.draft_call(limit)
        try:
            drafts = await self.take_drafts(call, k) if call is not None else []
            proposed = len(drafts)
            if drafts and self.adaptive is not None:  # verify only what these drafts' class is worth
                drafts = drafts[: self.adaptive.trim(drafts[0].match_length, len(drafts))]
            drafted_at = time.perf_counter()

            guess = None
            if call is not None and call.k > k and len(drafts) == k:
                # Runs while the target verifies: wait for the guess, start the next cycle's drafting.
                guess = asyncio.get_running_loop().create_task(self.speculate(call, drafts))
            # No draft was asked for (K = 0, speculation off, draft back-off): several plain steps.
            # A draft that was asked but proposed nothing (an n-gram miss, or drafts trimmed
            # away) may match after one token.
            steps = self.solo_steps() if call is None else 1
            # Costs adaptive K may learn from: not a run's first cycle, whose calls also prefill the
            # context (a Resume's too), nor a cycle verified twice or retried (its pauses are no pass).
            timed = self.cycles_run > 0
            try:
                verdict = await self.verify(drafts, steps, draft_busy=guess is not None,
                                            stop_at_ngram=self.ngram_stop() if steps > 1 else None)  # fmt: skip
            except BaseException as exc:
                if guess is not None:
                    discard(guess)
                refused = isinstance(exc, grpc.aio.AioRpcError) and exc.code() == grpc.StatusCode.INVALID_ARGUMENT
                if not (drafts and refused):
                    raise
                # The target refused the drafts themselves (a q that is no distribution: a draft's
                # bug, or a draft of a newer version sending what this target does not read). The
                # cycle goes on without them, as after a failed draft call; the request used to end.
                guess, drafts, timed = None, [], False
                self.pause_drafting(f"failed or too slow ({exc.code().name}: {exc.details()})")
                verdict = await self.verify(drafts, steps)
            if guess is not None:
                await self.settle_speculation(guess, verdict, len(drafts))
        finally:
            if call is not None:  # a guess nobody needs, or a request that ended meanwhile: the draft stops
                call.cancel()
        verified_at = time.perf_counter()
        timed = timed and not self.verify_retried

        n = verdict.num_accepted
        more = list(verdict.more_tokens)[: steps - 1]  # decoded after next_token (steps > 1)
        new = [d.token_id for d in drafts[:n]] + [verdict.next_token] + more
        eos = False
        for i, token in enumerate(new):
            if token in self.plan.eos_token_ids:
                new, eos = new[: i + 1], True
                break
        remaining = self.plan.max_new_tokens - (len(self.committed) - len(self.plan.prompt))
        new = new[:remaining]

        before = len(self.committed)
        self.committed.extend(new)  # the Redis commit follows below; a failed one ends the request
        # The target holds everything up to the accepted prefix. The draft fed every token
        # it streamed but its last; of those, the accepted ones are still valid.
        # (after a call of several steps it also fed all of them but the last)
        self.target_seen = min(before + n + len(more), len(self.committed) - 1)
        # A call that streamed nothing may not have reached the session: the draft then holds what
        # it held before (rejected drafts included), and draft_seen stays.
        if isinstance(call, DraftCall) and call.tokens:
            fed = len(call.tokens) - 1
            self.draft_seen, self.draft_replica = before + min(n, fed), call.replica
        if self.speculation is not None and self.speculation.assumed != self.committed:
            self.drop_speculation()  # e.g. an end token cut the cycle short
        self.stats.add(len(drafts), n, len(new))
        self.accepted += n
        self.judged += n + (1 if n < len(drafts) else 0)
        if self.adaptive is not None:
            # c_verify(0) is the cost of one plain step: a call of several steps counts per token.
            verify_ms = (verified_at - drafted_at) * 1000 / (1 + len(more)) if timed else None
            draft_ms = (drafted_at - start) * 1000 if self.cycles_run else None
            if self.plan.ngram_first is not None and isinstance(call, NgramLookup):
                draft_ms = None  # c_draft is the model's: a lookup's ~0 ms would understate it
            match_length = drafts[0].match_length if drafts else 0
            self.adaptive.observe(len(drafts), n, draft_ms, verify_ms, match_length, proposed)
        generated = len(self.committed) - len(self.plan.prompt)
        if self.speculation is None and not eos and generated < self.plan.max_new_tokens:
            self.speculation = self.prefetch_draft()  # drafts while Redis commits and the client reads

        increments = {"cycles": 1, "draft_cycles": int(bool(drafts)), "draft_tokens": len(drafts), "accepted_tokens": n}
        increments.update({f"accepted_pos_{i}": 1 for i in range(n)})
        info = pb.CycleInfo(
            index=self.cycle,
            drafted=len(drafts),
            accepted=n,
            bonus=verdict.bonus and len(drafts) > 0,
            draft_ms=(drafted_at - start) * 1000,
            verify_ms=(verified_at - drafted_at) * 1000,
            k=k,
            draft_bytes=sum(d.ByteSize() for d in drafts),
            pipelined=pipelined,
            forward_ms=verdict.forward_ms,
            looked_up=isinstance(call, NgramLookup),
        )
        stats = dataclasses.replace(self.stats, accepted_per_position=list(self.stats.accepted_per_position))
        outcome = Outcome(new, info, eos, generated >= self.plan.max_new_tokens, stats)
        self.committing = asyncio.get_running_loop().create_task(
            self.commit(self.committing, outcome, increments, verified_at)
        )
        self.cycle += 1
        self.cycles_run += 1
        return outcome

    def commit_in_flight(self) -> bool:
        """Whether the last cycle's Redis commit may not have landed yet (it overlaps the next
        calls: a model service told `awaits_commit` waits for it)."""
        return self.committing is not None and not self.committing.done()

    def solo_steps(self) -> int:
        """Tokens a cycle without drafts asks the target for: 1 on the request's first cycle,
        else up to SOLO_STEPS, never past max_new_tokens or the context."""
        if self.cycle == 0:
            return 1
        return max(1, min(SOLO_STEPS, self.headroom(len(self.committed))))

    def timeout(self) -> float | None:
        return None if self.deadline is None else max(0.001, self.deadline - time.monotonic())

    # ------------------------------------------------------------ drafting

    def draft_call(self, limit: int) -> tuple[DraftCall | None, int, bool]:
        """(Propose call, K, pipelined) for this cycle: the speculative call if it assumed
        exactly what was committed, else a new one; no call when K is 0 or the draft is in
        back-off."""
        speculation, self.speculation = self.speculation, None
        undrafted, self.undrafted = self.undrafted, None
        if speculation is not None:
            if speculation.assumed == self.committed and speculation.k <= limit:
                return speculation.call, speculation.k, not speculation.prefetched
            speculation.call.cancel()
        if undrafted == self.committed:  # prefetch_draft chose K = 0 for this very prefix
            return None, 0, False
        call, k = self.new_draft_call(limit, self.cycle)
        return call, k, False

    def new_draft_call(self, limit: int, cycle: int) -> tuple[DraftCall | None, int]:
        """(Propose call, K) for `cycle` drafting after everything committed; no call when K
        is 0 or the draft is in back-off then."""
        match = self.look_up(limit, self.committed)
        k = self.choose_k(limit, match)
        if k == 0 or (cycle < self.draft_paused_until and not self.looks_up_here(match)):
            return None, k
        # With pipelining, one token more than K: the guess of the bonus token.
        want = k + 1 if self.pipelines(k, self.draft_class(match)) else k
        return self.start_propose(self.committed, self.draft_seen, self.draft_replica, want, cycle, match), k

    def prefetch_draft(self) -> Speculation | None:
        """Start the next cycle's Propose now that its prefix is known (self.committed, the
        verdict applied), before this cycle's Redis commit and its reply to the client: the
        draft drafts meanwhile. The same call the next cycle would make, so nothing changes
        but when it starts."""
        limit = self.limit(len(self.committed))
        call, k = self.new_draft_call(limit, self.cycle + 1) if limit else (None, 0)
        if call is None and k == 0:
            # Kept, so that the next cycle does not choose again: each choice of K = 0 counts
            # towards adaptive K's next probe, which came twice as often as it should.
            self.undrafted = list(self.committed)
        return None if call is None else Speculation(call, list(self.committed), k, prefetched=True)

    def keep_probability(self, k: int, match_length: int | None = None) -> float:
        """The chance a pipelined cycle of K drafts is kept (all K and the guess accepted):
        adaptive K's per-position estimate (for drafts of class `match_length`, default the
        best class), else α̂^(K+1) with α̂ = accepted / judged drafts so far under a Beta(1, 1)
        prior (0.5 before any draft was judged)."""
        if self.adaptive is not None:
            return self.adaptive.keep_probability(k, match_length)
        return ((self.accepted + 1) / (self.judged + 2)) ** (k + 1)

    def pipelines(self, k: int, match_length: int | None = None) -> bool:
        """Whether a cycle of K drafts (of class `match_length`) asks for the guess and drafts
        the next cycle early (module doc)."""
        if not self.plan.pipeline:
            return False
        min_keep = self.plan.pipeline_min_keep
        return min_keep <= 0 or self.keep_probability(k, match_length) >= min_keep

    def start_propose(self, context: Sequence[int], position: int, held_by: Replica | None, k: int, cycle: int,
                      match: tuple[list[int], int] | None) -> DraftCall | NgramLookup | NoDrafts:  # fmt: skip
        """Ask for k drafts after `context`, of which draft replica `held_by` holds the first
        `position` tokens (the rest travel as new_tokens; another replica is sent them all); an
        n-gram draft's are taken from `match` (look_up) here when the plan says so."""
        if self.looks_up_here(match):
            return NgramLookup(match, k, self.plan.eos_token_ids)
        try:
            replica = self.drafts.pick(self.plan.route)
        except Unavailable:  # no draft replica to ask (none checked yet, or every one refused: logged then)
            return NoDrafts(k)
        if replica is not held_by:
            # Another replica than the one `position` counts on (failover, a Resume): it may hold an
            # older state of the session, ending in drafts since rejected, that it would take as
            # valid. Sent the whole context, it keeps only the cache of what that repeats.
            position = 0
        request = pb.ProposeRequest(
            session_id=self.plan.session_id,
            position=position,
            new_tokens=context[position:],
            k=k,
            sampling=sampling_to_pb(self.plan.sampling),
            cycle=cycle,
            vocab_fingerprint=self.plan.target.vocab_fingerprint if self.plan.target else self.plan.draft_fingerprint,
            # a call for the next cycle (prefetch_draft, speculate) runs before this cycle's commit
            awaits_commit=cycle > self.cycle or self.commit_in_flight(),
        )
        remaining = None if self.deadline is None else self.deadline - time.monotonic()
        return DraftCall(replica, request, draft_budget(self.draft_timeout_s, remaining), self.plan.eos_token_ids,
                         self.tracer)  # fmt: skip

    async def replica_lost(self, call: DraftCall, error: grpc.aio.AioRpcError) -> bool:
        """Whether a Propose that failed with `error` says its replica is lost (UNAVAILABLE, but
        for one failure in its session store: errors.is_store_fault) or
        frozen: silent for its whole --draft-timeout, where other replicas can be asked (a frozen
        one used to cost each drafting cycle its budget). Not where it is busy: it began the call
        (`DraftCall.answered`) and streamed other calls' tokens meanwhile, as a replica does while
        one session's long prompt prefills past --draft-timeout (in chunks between the others'
        passes; which marked a healthy replica failed, and moved every session on it). One that
        began the call and served nothing since is wedged (a hung worker) and is skipped. Not for
        a --draft-timeout cut short by the request's own deadline (a quarter of the time left): a
        healthy replica was skipped for a request about to end. With --draft-timeout 0 the
        deadline's share is the budget."""
        code = error.code()
        if code == grpc.StatusCode.UNAVAILABLE:  # a store fault once is Redis's; in a row, the replica's (verify)
            return not is_store_fault(error) or self.draft_failures > 0
        whole_budget = self.draft_timeout_s <= 0 or call.budget == self.draft_timeout_s
        if code != grpc.StatusCode.DEADLINE_EXCEEDED or call.tokens or self.drafts.single or not whole_budget:
            return False
        busy = call.replica.answered_at > call.started and await call.answered()
        return not busy

    async def take_drafts(self, call: DraftCall, k: int) -> list[pb.DraftToken]:
        """The first k drafts of `call`; on a draft fault (an error, or the call's budget
        spent: DEADLINE_EXCEEDED), none: the cycle runs target-only."""
        try:
            call_span = getattr(call, "span", None)  # a DraftCall's: the drafts come from that call
            links = [trace.Link(call_span.get_span_context())] if call_span is not None else []
            attributes = {"specdec.k": k}
            with self.tracer.start_as_current_span(telemetry.PROPOSE_SPAN, attributes=attributes, links=links) as span:
                drafts = await call.first(k)
                for token in drafts:
                    span.add_event("draft_token", {"index": token.index, "token_id": token.token_id})
                span.set_attribute("specdec.drafted", len(drafts))
        except grpc.aio.AioRpcError as exc:
            # Whatever the draft's failure (down, slow, out of memory, a broken model, a bug),
            # it costs this cycle its drafts, never the request: the target alone gives the
            # same output. It used to end the request for any code but a few.
            if isinstance(call, DraftCall) and await self.replica_lost(call, exc):
                call.replica.failed()
            if isinstance(call, DraftCall) and exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
                await self.drafts.recheck(call.replica)  # restarted on another vocabulary: refused, sessions move
            call.cancel()
            self.pause_drafting(f"failed or too slow ({exc.code().name}: {exc.details()})")
            return []
        if not drafts and isinstance(call, DraftCall):
            # A draft that answers with nothing and no error (none of specdec's: past its context
            # a draft model refuses OUT_OF_RANGE) would answer so again: it is backed off as a
            # failed one, where every cycle asked it again and made one token.
            self.pause_drafting("proposed no drafts")
            return []
        self.draft_failures = 0
        # Nothing after an end token can be kept.
        for i, token in enumerate(drafts):
            if token.token_id in self.plan.eos_token_ids:
                return drafts[: i + 1]
        return drafts

    def pause_drafting(self, reason: str) -> None:
        """Run the next cycles target-only: 1, 2, 4, ... 32 of them after consecutive draft
        faults (`reason` says which, for the log); a draft call that drafts resets the count."""
        backoff = DRAFT_BACKOFF_CYCLES[min(self.draft_failures, len(DRAFT_BACKOFF_CYCLES) - 1)]
        self.draft_failures += 1
        self.draft_paused_until = self.cycle + backoff
        log.warning("draft %s; target-only for %d cycle(s)", reason, backoff)

    async def speculate(self, call: DraftCall, drafts: list[pb.DraftToken]) -> Speculation | None:
        """Wait for the guess, then start drafting the next cycle as if all drafts and the
        guess were committed. Runs while the target verifies."""
        try:
            tokens = await call.first(len(drafts) + 1)
        except grpc.aio.AioRpcError:
            return None
        if len(tokens) <= len(drafts):
            return None  # the draft stopped early: nothing to guess with
        guess = tokens[len(drafts)].token_id
        assumed = self.committed + [d.token_id for d in drafts] + [guess]
        limit = self.limit(len(assumed))
        match = self.look_up(limit, assumed) if limit else None
        k = self.choose_k(limit, match) if limit else 0
        if not k:
            return None
        # A draft model fed every draft before the guess; after a lookup it holds what it held.
        position, held_by = ((len(self.committed) + len(drafts), call.replica) if isinstance(call, DraftCall)
                             else (self.draft_seen, self.draft_replica))  # fmt: skip
        # and a guess for the cycle after, if that pipelines too
        want = k + 1 if self.pipelines(k, self.draft_class(match)) else k
        return Speculation(self.start_propose(assumed, position, held_by, want, self.cycle + 1, match), assumed, k)

    async def settle_speculation(self, guess: asyncio.Task, verdict: pb.VerifyResponse, k: int) -> None:
        """Keep the speculative call if the verdict took every draft and the guess; else cancel."""
        if verdict.num_accepted < k:
            discard(guess)
            return
        speculation = await guess
        if speculation is None:
            return
        if verdict.next_token != speculation.assumed[-1]:
            speculation.call.cancel()
            return
        self.speculation = speculation

    def drop_speculation(self) -> None:
        if self.speculation is not None:
            self.speculation.call.cancel()
            self.speculation = None

    # ------------------------------------------------------------ verifying

    def retry_pause(self, code: grpc.StatusCode, attempt: int) -> float | None:
        """The pause before Verify's next attempt after one failed with `code`
        (target_retry_pause), or None: fail, also when the pause would pass the deadline."""
        pause = target_retry_pause(code, attempt, self.targets.single)
        if pause is None or (self.deadline is not None and time.monotonic() + pause > self.deadline):
            return None
        return pause

    async def raise_if_superseded(self) -> None:
        """NotFound when this run's session is gone, Aborted when another run owns it: a target
        that finds this run's positions past the session's tokens (OUT_OF_RANGE) or its tokens
        changed (FAILED_PRECONDITION) is then speaking of a session no longer this run's (deleted
        and created again under its id, or resumed), and the stream ended OUT_OF_RANGE
        "position 13 is past the session's 11 committed tokens", as if the client's fault."""
        meta = await self.store.meta(self.plan.session_id)  # NotFound when gone
        if meta.get("owner") != self.plan.owner:
            raise superseded(self.plan.session_id)

    async def verify(self, drafts: Sequence[pb.DraftToken], steps: int = 1, draft_busy: bool = False,
                     stop_at_ngram: pb.NgramStop | None = None) -> pb.VerifyResponse:  # fmt: skip
        """Verify on the target, retrying a retryable failure (the request is idempotent:
        same position, same drafts, same per-cycle random stream) while Redis is up.
        `draft_busy`: the draft drafts on during this call (pipelining); `stop_at_ngram`:
        plain steps end where an n-gram draft has a match (ngram_stop)."""
        request = pb.VerifyRequest(
            session_id=self.plan.session_id,
            position=self.target_seen,
            new_tokens=self.committed[self.target_seen :],
            drafts=drafts,
            sampling=sampling_to_pb(self.plan.sampling),
            cycle=self.cycle,
            draft_fingerprint=self.plan.draft_fingerprint,
            draft_model=self.plan.draft_model,
            steps=steps,
            draft_busy=draft_busy,
            stop_at_ngram=stop_at_ngram,
            awaits_commit=self.commit_in_flight(),
        )
        if (target := self.plan.target) is not None:  # a target serving another model refuses the call
            request.target_model, request.target_fingerprint, request.target_weights = target_key(target)
        attempt = 0
        while True:
            # Each attempt asks the session's replica as of now: one that failed is skipped.
            try:
                replica = self.targets.pick(self.plan.route)
            except NoReplicaYet as exc:  # it used to end the request at once
                if (pause := self.retry_pause(grpc.StatusCode.UNAVAILABLE, attempt)) is None:
                    raise
                log.warning("no target replica to ask (%s); retrying in %.2fs", exc, pause)
                await asyncio.sleep(pause)
                attempt += 1
                continue
            try:
                with self.tracer.start_as_current_span(telemetry.VERIFY_SPAN) as span:
                    span.set_attribute("specdec.drafts", len(drafts))
                    span.set_attribute("specdec.attempt", attempt)
                    span.set_attribute("specdec.replica", replica.endpoint)
                    # One target: wait for it to come back. Several: fail fast and ask another.
                    reply = await replica.stub.Verify(
                        request, timeout=self.timeout(), wait_for_ready=self.targets.single
                    )
                    span.set_attribute("specdec.forward_ms", reply.forward_ms)
                    span.set_attribute("specdec.accept_ms", reply.accept_ms)
                    span.set_attribute("specdec.accepted", reply.num_accepted)
                    self.verify_retried = attempt > 0
                    return reply
            except grpc.aio.AioRpcError as exc:
                # A store fault once is Redis's (failing over, say): asked again here, as a session
                # moved for it rebuilds elsewhere and again on its return; twice in a row, this
                # replica's own way to Redis may be broken: skipped, as one lost.
                if exc.code() == grpc.StatusCode.UNAVAILABLE and (not is_store_fault(exc) or attempt > 0):
                    replica.failed()
                if exc.code() == grpc.StatusCode.FAILED_PRECONDITION and await self.targets.recheck(replica):
                    attempt += 1  # it serves another model now: refused, the session goes to its next replica
                    continue
                if exc.code() in (grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.FAILED_PRECONDITION):
                    await self.raise_if_superseded()
                if (pause := self.retry_pause(exc.code(), attempt)) is None:
                    raise
                # The target reads the session from Redis: if Redis is down no retry can
                # help, so fail now with Redis's own error (UNAVAILABLE, naming Redis).
                await self.store.ping()
                log.warning("target %s (attempt %d); retrying in %.2fs", exc.code().name, attempt + 1, pause)
                await asyncio.sleep(pause)
                attempt += 1
