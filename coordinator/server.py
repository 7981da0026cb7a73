"""Coordinator gRPC server: validates a request, runs the cycle loop, streams chunks."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import grpc
from opentelemetry import trace
from opentelemetry.trace import StatusCode

from coordinator.adaptive import AdaptiveK
from coordinator.cycles import DRAFT_TIMEOUT_S, CycleLoop, Plan, Stats
from coordinator.replicas import Replicas, draft_identity, loaded, parse_replica_address, target_identity
from coordinator.text import TextStream
from specdec import serving, telemetry
from specdec.client import session_header
from specdec.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    OutOfRange,
    PermissionDenied,
    ResourceExhausted,
    Unavailable,
    grpc_handler,
    status_for,
)
from specdec.metrics import CoordinatorMetrics
from specdec.ngram import DEFAULT_K, DEFAULT_MAX_NGRAM, DEFAULT_MIN_NGRAM, NGRAM_DRAFT
from specdec.ranges import (
    DEFAULT_DRAIN_S, DEFAULT_MAX_K, DEFAULT_MAX_NEW_TOKENS_LIMIT, DEFAULT_STALL_TIMEOUT_S, DEFAULT_STARTUP_TIMEOUT_S,
    DEFAULT_TTL_S, DEFAULT_WAIT_MS,
)
from specdec.security import ChannelSecurity, ServerSecurity, caller_id, is_caller, redact_url
from specdec.session import CALLER_LEASE_S, NotReplicated, SessionStore, check_session_id, new_session_id, session_gone
from specdec.vocab import chat_ids, describe_model, has_chat_template, text_ids
from specdec.v1 import specdec_pb2 as pb
from specdec.v1 import specdec_pb2_grpc as pb_grpc
from specdec.wire import Sampling, check_token_ids, sampling_from_pb, target_key

log = logging.getLogger("specdec.coordinator")

FINISH = {"length": pb.FINISH_REASON_LENGTH, "stop": pb.FINISH_REASON_STOP, "eos": pb.FINISH_REASON_EOS}
FINISH_NAMES = {code: name for name, code in FINISH.items()}
RELEASE_TIMEOUT_S = 2.0
# How long a stopping coordinator waits, after its drain, for the background work of its last
# requests (recording how each ended: one Redis write; releasing its caches: one Release per model
# service, in parallel, at most RELEASE_TIMEOUT_S) before it closes its channels and its Redis
# connection under them. Milliseconds normally; the k8s manifests leave room for all of it.
CLOSE_BACKGROUND_S = 3.0
# No tokenizer makes tokens of fewer characters than this on average: a text prompt
# longer than this times max_prompt_tokens is refused without tokenizing it.
PROMPT_CHARS_PER_TOKEN = 16
# Stop strings a request may set, and their longest: every committed chunk is searched for each
# (on the event loop every session shares), and the text a stop string could still begin in is
# held back from the stream, so 100,000 of them, or one of 100,000 characters, would slow every
# session or stop the streaming of this one.
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 1000
WAIT_LOG_S = 10.0  # how often a coordinator waiting for a model service says so (wait_for_model_info)
MODEL_INFO_TIMEOUT_S = 5.0  # one ModelInfo call while waiting for a model service
# A stream cancelled this close to its call's deadline, or later, was ended by the deadline
# (gRPC cancels the handler for both; the server's deadline timer and our clock differ a little).
DEADLINE_SLACK_S = 0.01


class StallWatch:
    """Ends the stream of a client that reads nothing.

    A chunk's write waits while the client's HTTP/2 flow-control window is full. A gRPC client
    that does not read still takes a lot (Python's takes a whole 4,096-token stream, 250 kB),
    but one with a small window (a few kB), or a reader that hangs, would hold the request's
    place, and the services' caches of its session, for as long as it stays connected. A write
    that waits longer than `timeout_s` (`--stall-timeout`; 0 = never) ends the call UNAVAILABLE
    and cancels its handler, which frees both at once. Every chunk sent is committed in Redis:
    once the client reads again it gets the chunks sent before, then the status, and the SDK
    resumes the session."""

    def __init__(self, context, timeout_s: float, session_id: str, spawn):
        self.context = context
        self.timeout_s = timeout_s
        self.session_id = session_id
        self.spawn = spawn  # runs a coroutine as a task kept until it ends (Coordinator.spawn)
        self.handler = asyncio.current_task()  # the call's task: it drives every generator of the stream
        self.tripped = False

    @contextlib.contextmanager
    def writing(self):
        """Around a `yield` of a chunk: gRPC writes it meanwhile."""
        if self.timeout_s <= 0:
            yield
            return
        timer = asyncio.get_running_loop().call_later(self.timeout_s, self.trip)
        try:
            yield
        finally:
            timer.cancel()

    def trip(self) -> None:
        self.tripped = True
        message = (f"session {self.session_id!r}: this client read nothing of its stream for {self.timeout_s:g} s "
                   "(the coordinator's --stall-timeout), so the stream ended to free its place; every chunk "
                   "sent stands committed: resume the session (the SDK does)")  # fmt: skip
        # The status goes out behind the chunks the client has yet to read (the task waits until it
        # has, or the call ends), then abort raises AbortError, which is the task's to swallow.
        ending = self.spawn(self.context.abort(grpc.StatusCode.UNAVAILABLE, message))
        ending.add_done_callback(lambda done: done.cancelled() or done.exception())
        self.handler.cancel()


@dataclass
class CoordinatorConfig:
    host: str = "127.0.0.1"
    port: int = 50051
    draft_address: str = "127.0.0.1:50052"
    target_address: str = "127.0.0.1:50053"
    redis_url: str = field(default="", repr=False)  # may hold the Redis password: never in a repr
    # Tokenizer for text prompts; default: the model the target reports.
    tokenizer: str = ""
    # K used when a request does not set one; None = the draft's own K, as the draft service
    # reports it (a catalog draft's, or a distilled draft directory's card's serving_k), else
    # specdec.ngram.DEFAULT_K. See pick_default_k.
    default_k: int | None = None
    # Largest K a request may ask for (also bounded by what the services accept).
    max_k: int = DEFAULT_MAX_K
    # max_new_tokens when a request does not set one, and the most it may ask for.
    default_max_new_tokens: int = 128
    max_new_tokens_limit: int = DEFAULT_MAX_NEW_TOKENS_LIMIT
    # Longest prompt accepted, in tokens (RESOURCE_EXHAUSTED beyond; the target's context
    # bounds it too). Text prompts longer than PROMPT_CHARS_PER_TOKEN times this are
    # refused before they are tokenized.
    max_prompt_tokens: int = 8192
    # Generate calls running at once; more are refused with RESOURCE_EXHAUSTED at once
    # (a client retries with back-off) instead of queueing without bound.
    max_concurrent_requests: int = 64
    # At most this many requests of one caller (specdec.security: an API token, or a caller
    # name shared by several) at once, over all the coordinators of this Redis (each request
    # holds a place: SessionStore.admit), so one client cannot take every slot; 0 = no such
    # limit. Without API tokens every caller is one and only the limit above applies.
    max_requests_per_caller: int = 0
    # Each write a client relies on (a session's creation, each cycle's commit, a Resume's
    # take-over, a Delete) waits until this many replicas of its Redis node hold it, for at most
    # redis_wait_ms, else the request ends UNAVAILABLE without the write's tokens, which a
    # Resume then sends, or the Delete does, to be sent again (specdec.session.SessionStore);
    # 0 = do not wait.
    redis_wait_replicas: int = 0
    redis_wait_ms: int = DEFAULT_WAIT_MS
    # Seconds a session stays in Redis after its last write (SessionStore.ttl_s).
    session_ttl_s: int = DEFAULT_TTL_S
    # How long to wait for the model services at start-up.
    startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S  # --startup-timeout
    # Port of the Prometheus /metrics endpoint; 0 = off.
    metrics_port: int = 0
    # Draft the next cycle while the target verifies (requests may override).
    pipeline: bool = True
    # ... but, unless a request asks for pipelining, only in cycles whose speculative drafting
    # is likely kept: the session's estimate of that chance, α̂^(K+1) (adaptive K: Π α̂_i), >= this (0 = every
    # cycle). A pipelined cycle keeps the draft busy while the target verifies, and a
    # target sharing the draft's cores then verifies on fewer threads (coordinator.cycles).
    pipeline_min_keep: float = 0.5
    # Requests that set no K get an adaptive K (up to max_k) instead of default_k.
    adaptive_k: bool = False
    # TLS and bearer tokens of the public API.
    security: ServerSecurity = field(default_factory=ServerSecurity)
    # TLS / mTLS and the internal token of the calls to the draft and target services.
    internal: ChannelSecurity = field(default_factory=ChannelSecurity)
    # Longest a cycle waits for the draft before running target-only (0 = only the request
    # deadline bounds it); see coordinator.cycles.draft_budget.
    draft_timeout_s: float = DRAFT_TIMEOUT_S
    # On SIGTERM, how long running requests may go on before they are cancelled (serving.run).
    drain_s: float = DEFAULT_DRAIN_S
    # How long one chunk's write may wait for a client that reads nothing before its stream
    # ends UNAVAILABLE and frees its slot (StallWatch; 0 = never).
    stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S
    # With an n-gram draft, call the draft service for drafts instead of looking them up
    # here (coordinator.cycles.NgramLookup: the same tokens, no network hop).
    ngram_via_draft_service: bool = False
    # With a model draft: cycles whose context ends in an earlier n-gram of at least this many
    # tokens draft its continuation by lookup here, the others ask the model (coordinator.cycles:
    # n-gram first); 0 = off.
    ngram_first: int = 0


def pick_default_k(configured: int | None, draft_k: int, max_k: int) -> int:
    """K for requests that set none: the coordinator's --default-k (`configured`) when set,
    else the K the draft service reports for its draft (`draft_k`, ModelInfoResponse.default_k:
    specdec.catalog.draft_default_k; 0 = none), else DEFAULT_K; never above max_k."""
    return min(configured or draft_k or DEFAULT_K, max_k)


class CoordinatorServicer(pb_grpc.CoordinatorServicer):
    def __init__(self, config: CoordinatorConfig, store: SessionStore):
        self.config = config
        self.store = store
        # Every call of a session goes to one replica of each model service (coordinator.replicas).
        # A target replica must serve the same model; a draft replica the same vocabulary.
        self.drafts = Replicas(parse_replica_address(config.draft_address), pb_grpc.DraftStub, config.internal,
                               name="draft", identity=draft_identity)  # fmt: skip
        self.targets = Replicas(parse_replica_address(config.target_address), pb_grpc.TargetStub, config.internal,
                                name="target", identity=target_identity, follow_rollout=True)  # fmt: skip
        self.draft_info: pb.ModelInfoResponse | None = None
        self.tokenizer = None
        self.background: set[asyncio.Task] = set()
        self.metrics = CoordinatorMetrics()
        self.metrics.follow_replicas("draft", self.drafts)
        self.metrics.follow_replicas("target", self.targets)
        # What adaptive K has learnt about this draft/target pair, shared by all sessions.
        self.shared_k = AdaptiveK(config.max_k)
        self.running = 0  # Generate and Resume calls in progress
        # The places (SessionStore.admit) this coordinator's requests hold, by caller; renewed.
        self.places: dict[str, set[str]] = {}
        self.renewer: asyncio.Task | None = None

    @property
    def target_info(self) -> pb.ModelInfoResponse | None:
        """The target model new sessions run on: the adopted one (Replicas.adopt; after a
        rollout, the one every replica then serves, Replicas.follow)."""
        return self.targets.adopted

    async def load(self) -> None:
        """Wait for both model services, check they share a vocabulary, load the tokenizer."""
        timeout = self.config.startup_timeout_s
        await self.targets.start()
        await self.drafts.start()
        await wait_for_model_info(self.targets, "target", timeout)  # adopted: target_info
        self.draft_info = await wait_for_model_info(self.drafts, "draft", timeout)
        await asyncio.gather(self.targets.settle(), self.drafts.settle())  # the other replicas' first answers
        if self.draft_info.kind != NGRAM_DRAFT:
            from specdec.vocab import check_vocab_match

            check_vocab_match(
                self.draft_info.model,
                self.draft_info.vocab_fingerprint,
                self.target_info.model,
                self.target_info.vocab_fingerprint,
            )
        from specdec.vocab import load_tokenizer

        name = self.config.tokenizer or self.target_info.model
        self.tokenizer = await asyncio.to_thread(load_tokenizer, name)
        if (lengths := self.ngram_first_lengths()) is not None:  # looked-up drafts cost adaptive K nothing
            self.shared_k.free_classes = frozenset(range(lengths[0], lengths[1] + 1))
        source = "--default-k" if self.config.default_k else "the draft's own" if self.draft_info.default_k else "default"
        log.info("draft %s, target %s; requests that set no K get K = %d (%s)",
                 self.draft_info.model, self.target_info.model, self.default_k(), source)  # fmt: skip
        await self.check_redis()

    async def check_redis(self) -> None:
        """Warn when Redis does not answer, or a master has fewer replicas than
        --redis-wait-replicas asks for: either way requests end UNAVAILABLE. Redis down at start
        is no reason to stop (it may come up later), but a mistyped --redis-url used to leave a
        stack saying `ready` and no word of it but each request's error."""
        try:
            await self.store.ping()
        except Exception as exc:  # noqa: BLE001 - a warning either way
            log.warning("Redis at %s does not answer (%s): every request fails UNAVAILABLE until it does; "
                        "check --redis-url (SPECDEC_REDIS_URL)", redact_url(self.store.url), exc)  # fmt: skip
            return
        try:
            short = await self.store.replicas_short()
        except Exception as exc:  # noqa: BLE001 - a warning either way
            log.warning("could not ask Redis how many replicas it has (--redis-wait-replicas): %s", exc)
            return
        if short:
            log.warning("--redis-wait-replicas %d, but %s: until it has them, the requests whose sessions it holds "
                        "end UNAVAILABLE", self.config.redis_wait_replicas, "; ".join(short))  # fmt: skip

    async def close(self) -> None:
        """Stop renewing places, let the background work of the requests that ran finish
        (CLOSE_BACKGROUND_S at most), then close the channels and the Redis connection."""
        if self.renewer is not None:
            self.renewer.cancel()
        if self.background:
            _, pending = await asyncio.wait(set(self.background), timeout=CLOSE_BACKGROUND_S)
            if pending:
                log.warning("stopping with %d request(s) still recording their end or releasing their caches",
                            len(pending))  # fmt: skip
        await self.drafts.close()
        await self.targets.close()
        await self.store.close()

    def max_k(self) -> int:
        return min(self.config.max_k, self.draft_info.max_k or self.config.max_k, self.target_info.max_k)

    def default_k(self) -> int:
        return pick_default_k(self.config.default_k, self.draft_info.default_k, self.max_k())

    @grpc_handler
    async def Generate(self, request: pb.GenerateRequest, context):
        caller = caller_id(context.invocation_metadata(), self.config.security)
        chunks = self.generate(request, context, caller)
        async for chunk in self.admitted(chunks, caller, "request", request.session_id):
            yield chunk

    @grpc_handler
    async def Resume(self, request: pb.ResumeRequest, context):
        caller = caller_id(context.invocation_metadata(), self.config.security)
        chunks = self.resume(request, context, caller)
        async for chunk in self.admitted(chunks, caller, "resume", request.session_id):
            yield chunk

    async def admitted(self, chunks, caller: str, verb: str, session_id: str):
        """`chunks` if this coordinator is ready and below its limit of requests at once, and
        `caller` (caller_id; "" = no API tokens, no limit of its own) below its limit over all
        the coordinators of this Redis (take_place). A refusal is logged (the `verb` "request"
        or "resume" of `session_id`)."""
        with self.refusals(verb, session_id, caller):
            if (refused := self.refusal()) is not None:
                raise refused
        self.running += 1
        place = secrets.token_hex(16) if caller and self.config.max_requests_per_caller else ""
        try:
            with self.refusals(verb, session_id, caller):
                await self.take_place(caller, place)
            async for chunk in chunks:
                yield chunk
        finally:
            self.running -= 1
            if place:  # given back before the stream's end reaches the client, even when cancelled
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.shield(self.spawn(self.give_back_place(caller, place)))

    @contextlib.contextmanager
    def refusals(self, verb: str, session_id: str, caller: str):
        """Log a request that fails before its stream runs (its stream logs the rest:
        describe_request), and count it in requests_refused: by its `refusal_reason` (a limit),
        else by its status (invalid_argument, not_found, ...)."""
        try:
            yield
        except Exception as exc:
            reason = getattr(exc, "refusal_reason", "") or status_for(exc, quiet=True)[0].name.lower()
            self.metrics.requests_refused.labels(reason=reason).inc()
            log.info(describe_refusal(verb, session_id, caller, exc))
            raise

    def refusal(self) -> Exception | None:
        """Why a call cannot start on this coordinator now (the error to raise, with the reason
        requests_refused counts it under: starting, limit), or None."""
        if self.tokenizer is None:
            return refusal_for("starting", Unavailable("the coordinator is still starting; retry shortly"))
        if self.running >= self.config.max_concurrent_requests:
            return refusal_for("limit", ResourceExhausted(
                f"{self.running} requests are running, the limit of this coordinator; retry with back-off"
            ))  # fmt: skip
        return None

    async def take_place(self, caller: str, place: str) -> None:
        """Hold `place` (a request's id; "" = no per-caller limit applies) among `caller`'s
        --max-requests-per-caller places in Redis, renewed while the request runs
        (renew_places), or ResourceExhausted, counted as reason caller_limit."""
        if not place:
            return
        running = await self.store.admit(caller, place, self.config.max_requests_per_caller)
        if running is not None:
            raise refusal_for("caller_limit", ResourceExhausted(
                f"{running} requests of this API token's caller are running on the coordinators sharing this "
                "Redis, the limit of one caller; retry with back-off once one ends"
            ))  # fmt: skip
        self.places.setdefault(caller, set()).add(place)
        if self.renewer is None:
            self.renewer = asyncio.get_running_loop().create_task(self.renew_places())

    async def give_back_place(self, caller: str, place: str) -> None:
        """Stop renewing a request's place and give it back (one never taken: harmless)."""
        held = self.places.get(caller, set())
        held.discard(place)
        if not held:
            self.places.pop(caller, None)
        try:
            await self.store.leave(caller, place)
        except Exception as exc:  # Redis away: the lease ends by itself within CALLER_LEASE_S
            log.warning("could not give back a place of a caller (%s); its lease ends within %.0f s",
                        type(exc).__name__, CALLER_LEASE_S)  # fmt: skip

    async def renew_places(self) -> None:
        """Every third of CALLER_LEASE_S, extend the leases of the places held here."""
        while True:
            await asyncio.sleep(CALLER_LEASE_S / 3)
            for caller, held in list(self.places.items()):
                try:
                    await self.store.renew(caller, sorted(held))
                except Exception as exc:  # tried again next round, before the lease ends
                    log.warning("could not renew %d places of a caller (%s)", len(held), type(exc).__name__)

    async def generate(self, request: pb.GenerateRequest, context, caller: str):
        # Tokenizing (and rendering a chat) off the event loop every stream shares: a prompt at
        # the character limit takes ~50 ms (the tokenizer lets go of the GIL meanwhile).
        with self.refusals("request", request.session_id, caller):
            prompt = await asyncio.to_thread(self.prompt_ids, request)
            plan = self.plan(request, prompt)
            # Refused here (e.g. the id is taken), the request never touches the session again:
            # only a session this request created is finished and released below.
            try:
                await self.store.create(plan.session_id, plan.prompt, session_meta(plan, self, caller))
            except NotReplicated:  # created on its Redis node, not yet on its replicas: resumable, not retried
                await context.send_initial_metadata((session_header(plan.session_id),))
                raise
            # The response headers commit the call: a client's retry policy (the SDK retries
            # UNAVAILABLE) sends a call again only while no header came, that is only while no
            # session was created for it, so a retry never finds its session id taken. They name
            # the session: a stream that breaks after them is one the SDK may Resume.
            await context.send_initial_metadata((session_header(plan.session_id),))
        text = TextStream(self.tokenizer, plan.stop, plan.prompt)
        async for chunk in self.stream(plan, context, caller, text):
            yield chunk

    async def resume(self, request: pb.ResumeRequest, context, caller: str):
        """Resume: check the request against the session as it is, take the session over (a
        run of it still going stops at its next commit), send the client what it lacks, then go
        on generating. A finished session only gets what the client lacks (and a log line)."""
        started = time.monotonic()
        with self.refusals("resume", request.session_id, caller):
            session_id = check_session_id(request.session_id)
            meta = await self.store.meta(session_id)
            self.check_caller(session_id, meta, context, "resume")
            committed, born = await self.store.tokens_and_birth(session_id)
            if born != meta.get("created_at"):  # deleted, and maybe created again, since `meta`: not its tokens
                raise session_gone(session_id)
            plan = self.resumed_plan(session_id, meta, committed)  # refused before the session is touched
            output = committed[len(plan.prompt):]
            # ~30 µs a token with SmolLM2's tokenizer: off the event loop every session shares.
            text = await asyncio.to_thread(replay_text, self.tokenizer, plan.stop, output, plan.prompt)
            # An output that ended is flushed, as its stream's last chunk was (finish_of).
            finished_as(plan, text, committed, meta.get("status") == "finished")
            if request.received_tokens > len(text.ids) or request.received_chars > len(text.text):
                raise OutOfRange(f"the client says it received {request.received_tokens} tokens and "
                                 f"{request.received_chars} characters, but session {session_id!r} has "
                                 f"{len(text.ids)} output tokens and {len(text.text)} characters so far")  # fmt: skip
            if meta.get("status") != "finished":
                plan.owner = secrets.token_hex(8)
                meta, committed = await self.store.take_over(session_id, plan.owner, meta.get("created_at", ""))
                replay_tokens(text, committed[len(plan.prompt) + len(output):])
            text.emitted = request.received_chars
            await context.send_initial_metadata((session_header(session_id),))
            stats = stored_stats(meta, len(committed) - len(plan.prompt))
            catch_up = catch_up_chunk(plan, text, committed, request.received_tokens, stats,
                                      finished=meta.get("status") == "finished")  # fmt: skip
        if meta.get("status") == "finished":
            yield catch_up
            outcome = f"already finished ({FINISH_NAMES[catch_up.finish_reason]}): sent what the client lacked"
            log.info(describe_request(plan, True, caller, outcome, catch_up, time.monotonic() - started))
            return
        async for chunk in self.stream(plan, context, caller, text, (committed, int(meta["cycle"]), stats), catch_up):
            yield chunk

    @grpc_handler
    async def Delete(self, request: pb.DeleteRequest, context):
        session_id = check_session_id(request.session_id)
        try:
            meta = await self.store.meta(session_id)
        except NotFound:
            # With --redis-wait-replicas: not until the node's replicas lack it too (a Delete sent
            # again after its deletion was not acknowledged in time).
            await self.store.confirm_gone(session_id)
            return pb.DeleteResponse(deleted=False)
        self.check_caller(session_id, meta, context, "delete")
        deleted = False
        try:  # only the session checked: not another created under its id meanwhile (its caches stay)
            deleted = await self.store.delete(session_id, meta.get("created_at", ""))
        except NotReplicated:  # gone from its Redis node even when its replicas did not acknowledge it in time
            deleted = True
            raise
        finally:
            if deleted:
                self.spawn(self.release(session_id))
        return pb.DeleteResponse(deleted=deleted)

    def check_caller(self, session_id: str, meta: dict, context, verb: str) -> None:
        """PermissionDenied unless the call comes from the session's caller (is_caller). A
        session made without API tokens (or before callers were recorded) names none: anyone's."""
        if not is_caller(meta.get("caller", ""), context.invocation_metadata(), self.config.security):
            raise PermissionDenied(f"session {session_id!r} was created with another API token: only the token "
                                   f"that created a session, or another token of its caller name, can {verb} it")  # fmt: skip

    async def stream(self, plan: Plan, context, caller: str, text: TextStream, resume_at=None, catch_up=None):
        """Run the cycles of a session this request owns and stream its chunks, with the
        request's span, metrics and log line (naming `caller`, its caller_id); release the
        session however the stream ends. Resume passes where the session is (`resume_at`, see
        generate_chunks) and the `catch_up` chunk to send first."""
        deadline = None if context.time_remaining() is None else time.monotonic() + context.time_remaining()
        attributes = generate_attributes(plan, self) | {"specdec.resumed": resume_at is not None}
        span = telemetry.tracer().start_span(telemetry.GENERATE_SPAN, attributes=attributes)
        metrics = self.metrics
        metrics.requests_running.inc()
        status, outcome, last, started = "cancelled", "cancelled", None, time.monotonic()
        watch = StallWatch(context, self.config.stall_timeout_s, plan.session_id, self.spawn)
        try:
            chunks = self.generate_chunks(plan, text, deadline, trace.set_span_in_context(span), resume_at, catch_up)
            async for chunk in chunks:
                if chunk.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                    # Recorded before the last chunk leaves, so a client that reads the session
                    # once its stream has ended sees its final status, never "running".
                    await self.store.set_if_owner(plan.session_id, plan.owner, {"status": "finished"})
                    status = "finished"
                last = chunk
                with watch.writing():
                    yield chunk
            finish_reason = FINISH_NAMES[chunk.finish_reason]  # generate_chunks always yields a last chunk
            span.set_attribute("specdec.output_tokens", chunk.stats.generated_tokens)
            span.set_attribute("specdec.finish_reason", finish_reason)
            metrics.request_success.labels(finished_reason=finish_reason).inc()
            outcome = f"finished ({finish_reason})"
        except BaseException as exc:
            if isinstance(exc, Exception):  # grpc_handler maps it (and logs an unforeseen one's traceback)
                code = status_for(exc, quiet=True)[0].name
            elif watch.tripped:
                code = "UNAVAILABLE"
            else:  # the call ended under the stream: its deadline passed, or the client cancelled it
                past_deadline = deadline is not None and time.monotonic() >= deadline - DEADLINE_SLACK_S
                code = "DEADLINE_EXCEEDED" if past_deadline else "CANCELLED"
            if status != "finished":  # a session whose last chunk was made stays finished
                status = "cancelled" if code == "CANCELLED" else "failed"
            outcome = "cancelled" if code == "CANCELLED" else f"failed {code}"
            if watch.tripped:
                outcome += f" (its client read nothing for {watch.timeout_s:g} s: --stall-timeout)"
            metrics.request_failure.labels(status=code).inc()
            span.set_status(StatusCode.ERROR, code)
            raise
        finally:
            metrics.requests_running.dec()
            span.end()
            # Runs on cancellation too; the release must outlive the cancelled handler task.
            self.spawn(self.finish(plan, status))
            log.info(describe_request(plan, resume_at is not None, caller, outcome, last, time.monotonic() - started))

    async def generate_chunks(self, plan: Plan, text: TextStream, deadline: float | None, trace_context,
                              resume_at: tuple[list[int], int, Stats] | None = None,
                              catch_up: pb.GenerateChunk | None = None):  # fmt: skip
        """Run the cycles of a session and turn each outcome into a GenerateChunk. Resume
        passes `resume_at` (committed tokens, the next cycle's number, statistics so far) and
        `catch_up`, the chunk of what the client lacks: it goes first, and last if the session
        had already finished."""
        metrics = self.metrics
        if resume_at is None:
            metrics.prompt_tokens.inc(len(plan.prompt))
        loop = CycleLoop(
            self.drafts, self.targets, self.store, plan, deadline, trace_context, self.shared_k,
            draft_timeout_s=self.config.draft_timeout_s,
        )  # fmt: skip
        started = time.perf_counter()
        if resume_at is not None:
            loop.resume_at(*resume_at)
            yield catch_up
            if catch_up.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                return
        first_token_s = 0.0
        # A resumed stream's first cycle is no first token (time_to_first_token): a gap after the resume.
        last_chunk_at = None if resume_at is None else started
        finish = ""
        async for outcome in loop.run():
            now = time.perf_counter()
            first_token_s = first_token_s or now - started
            metrics.observe_cycle(outcome.info.drafted, outcome.info.accepted)
            kept = text.add(outcome.tokens)
            metrics.observe_chunk(kept, now - started, None if last_chunk_at is None else now - last_chunk_at)
            last_chunk_at = now
            finish = finish_of(text, outcome.eos, outcome.length_reached)
            yield pb.GenerateChunk(
                token_ids=outcome.tokens[:kept],
                text=text.take(final=bool(finish)),
                finish_reason=FINISH[finish] if finish else pb.FINISH_REASON_UNSPECIFIED,
                stats=stats_pb(output_stats(outcome.stats, text), len(plan.prompt), time.perf_counter() - started,
                               first_token_s),  # fmt: skip
                cycle=outcome.info,
                session_id=plan.session_id,
            )
            if finish:
                break
        if not finish:
            # The loop ended on the context limit without a cycle saying so.
            finish = finish_of(text, eos=False, length_reached=True)
            yield pb.GenerateChunk(
                text=text.take(final=True),
                finish_reason=FINISH[finish],
                stats=stats_pb(loop.stats, len(plan.prompt), time.perf_counter() - started, first_token_s),
                session_id=plan.session_id,
            )
        metrics.e2e_latency.observe(time.perf_counter() - started)

    def plan(self, request: pb.GenerateRequest, prompt: list[int]) -> Plan:
        """Validate a GenerateRequest, whose prompt tokenized to `prompt` (prompt_ids), into a
        Plan (InvalidArgument / OutOfRange otherwise)."""
        cfg = self.config
        # Unset: the default, within the server's limit (a client that asked for nothing is not refused).
        max_new = (request.max_new_tokens if request.HasField("max_new_tokens")
                   else min(cfg.default_max_new_tokens, cfg.max_new_tokens_limit))  # fmt: skip
        if max_new < 1:
            raise InvalidArgument(f"max_new_tokens must be at least 1, got {max_new}")
        if max_new > cfg.max_new_tokens_limit:
            raise ResourceExhausted(f"max_new_tokens is {max_new}; this server allows at most {cfg.max_new_tokens_limit}")
        max_context = self.target_info.max_context
        if max_context and len(prompt) >= max_context:
            raise OutOfRange(
                f"the prompt has {len(prompt)} tokens; the target's context is {max_context}, "
                "so nothing could be generated"
            )
        sampling = sampling_from_pb(request.sampling)
        if sampling.seed is None:
            sampling = Sampling(sampling.temperature, sampling.top_k, sampling.top_p, secrets.randbits(63))
        spec = request.speculation
        adaptive = spec.adaptive or (cfg.adaptive_k and not spec.HasField("num_speculative_tokens"))
        if spec.HasField("num_speculative_tokens"):
            k = spec.num_speculative_tokens
        else:
            k = self.max_k() if adaptive else self.default_k()
        if not spec.disabled and not 1 <= k <= self.max_k():
            raise InvalidArgument(f"num_speculative_tokens (K) must be between 1 and {self.max_k()}, got {k}")
        if any(not s for s in request.stop):
            raise InvalidArgument("stop strings must not be empty")
        if len(request.stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in request.stop):
            raise ResourceExhausted(f"this server takes at most {MAX_STOP_STRINGS} stop strings of at most "
                                    f"{MAX_STOP_CHARS} characters each; got {len(request.stop)}, the longest "
                                    f"{max(map(len, request.stop))} characters")  # fmt: skip
        session_id = check_session_id(request.session_id) if request.session_id else new_session_id()
        affinity_key = check_session_id(request.affinity_key, "affinity_key") if request.affinity_key else ""
        eos = frozenset() if request.ignore_eos else frozenset(self.target_info.eos_token_ids)
        # A request that asks for pipelining gets it in every cycle; the server default, only
        # where it is likely to pay (pipeline_min_keep).
        if spec.HasField("pipeline"):
            pipeline, min_keep = spec.pipeline, 0.0
        else:
            pipeline, min_keep = cfg.pipeline, cfg.pipeline_min_keep
        # The guess is one draft token more than K; the draft must accept K + 1.
        pipeline = pipeline and (not self.draft_info.max_k or k < self.draft_info.max_k)
        return Plan(
            session_id=session_id,
            prompt=prompt,
            max_new_tokens=max_new,
            sampling=sampling,
            k=0 if spec.disabled else k,
            eos_token_ids=eos,
            max_context=max_context,
            pipeline=pipeline,
            pipeline_min_keep=min_keep,
            adaptive=adaptive,
            stop=tuple(request.stop),
            owner=secrets.token_hex(8),
            affinity_key=affinity_key,
            target=self.target_info,
            **self.draft_fields(),
        )

    def resumed_plan(self, session_id: str, meta: dict[str, str], committed: list[int]) -> Plan:
        """The Plan of a session to resume, from what its creator stored (session_meta), with
        this coordinator's draft (any draft keeps the output the target's). FailedPrecondition
        when this coordinator's target is not the session's, or the session cannot be resumed."""
        if "plan" not in meta:
            raise FailedPrecondition(f"session {session_id!r} was started by a coordinator too old to resume it")
        target = self.target_info
        # A session stored before weights were recorded is checked by name and vocabulary.
        weights = meta.get("target_weights", target.weights_fingerprint)
        session_target = (meta.get("target_model", ""), meta.get("target_fingerprint", ""), weights)
        served = target_key(target)
        if session_target != served:
            raise FailedPrecondition(f"session {session_id!r} was generated by the target "
                                     f"{describe_model(*session_target)}; this coordinator serves "
                                     f"{describe_model(*served)}: resume it through one that serves the session's "
                                     "target")  # fmt: skip
        saved = json.loads(meta["plan"])
        k = int(meta["k"])
        pipeline = saved["pipeline"] and (not self.draft_info.max_k or k < self.draft_info.max_k)
        return Plan(
            session_id=session_id,
            prompt=committed[: int(meta["prompt_tokens"])],
            max_new_tokens=int(meta["max_new_tokens"]),
            sampling=Sampling(float(meta["temperature"]), int(meta["top_k"]), float(meta["top_p"]), int(meta["seed"])),
            k=min(k, self.max_k()),
            eos_token_ids=frozenset(saved["eos_token_ids"]),
            max_context=target.max_context,
            pipeline=pipeline,
            pipeline_min_keep=saved["pipeline_min_keep"],
            adaptive=saved["adaptive"],
            stop=tuple(saved["stop"]),
            affinity_key=saved.get("affinity_key", ""),
            target=target,
            **self.draft_fields(),
        )

    def draft_fields(self) -> dict:
        """The Plan fields that come from this coordinator's draft."""
        return dict(
            draft_model=self.draft_info.model,
            draft_fingerprint="" if self.draft_info.kind == NGRAM_DRAFT else self.draft_info.vocab_fingerprint,
            ngram=self.ngram_lengths(),
            local_ngram=self.draft_info.kind == NGRAM_DRAFT and not self.config.ngram_via_draft_service,
            ngram_first=self.ngram_first_lengths(),
        )

    def ngram_lengths(self) -> tuple[int, int] | None:
        """An n-gram draft's (min_ngram, max_ngram), for adaptive K's own lookup; None for a model."""
        if self.draft_info.kind != NGRAM_DRAFT:
            return None
        return self.draft_info.min_ngram or DEFAULT_MIN_NGRAM, self.draft_info.max_ngram or DEFAULT_MAX_NGRAM

    def ngram_first_lengths(self) -> tuple[int, int] | None:
        """(min_ngram, max_ngram) of n-gram first with a model draft; None when off."""
        n = self.config.ngram_first
        if n <= 0 or self.draft_info.kind == NGRAM_DRAFT:
            return None
        return n, max(n, DEFAULT_MAX_NGRAM)

    def prompt_ids(self, request: pb.GenerateRequest) -> list[int]:
        """The request's prompt as token ids: its prompt_token_ids, its messages through the
        chat template, or its text tokenized; InvalidArgument / ResourceExhausted when it is
        not one of them, empty, or over --max-prompt-tokens. Run off the event loop."""
        limit = self.config.max_prompt_tokens
        given = [name for name in ("prompt", "prompt_token_ids", "messages") if getattr(request, name)]
        if len(given) > 1:
            raise InvalidArgument(f"set one of prompt, prompt_token_ids and messages, not {' and '.join(given)}")
        characters = len(request.prompt) + sum(len(m.role) + len(m.content) for m in request.messages)
        if characters > limit * PROMPT_CHARS_PER_TOKEN:
            raise ResourceExhausted(f"the prompt has {characters} characters, far over this server's "
                                    f"limit of {limit} tokens")  # fmt: skip
        if request.prompt_token_ids:
            ids = list(request.prompt_token_ids)
        elif request.messages:
            ids = self.chat_ids(request.messages)
        elif not request.prompt:
            raise InvalidArgument("the prompt is empty: set prompt (text), prompt_token_ids or messages")
        else:
            ids = text_ids(self.tokenizer, request.prompt)
            if not ids:
                raise InvalidArgument("the prompt encodes to no tokens")
        if len(ids) > limit:
            raise ResourceExhausted(f"the prompt has {len(ids)} tokens; this server allows at most {limit}")
        check_token_ids(ids, self.target_info.vocab_size, "prompt_token_ids")
        return ids

    def chat_ids(self, messages) -> list[int]:
        """The token ids of a conversation through the target tokenizer's chat template."""
        import jinja2

        if not has_chat_template(self.tokenizer):
            raise FailedPrecondition(f"the tokenizer of {self.config.tokenizer or self.target_info.model} has no "
                                     "chat template: send the conversation as prompt text instead")  # fmt: skip
        if not all(m.role for m in messages):
            raise InvalidArgument("every message needs a role, such as user, assistant or system")
        try:
            return chat_ids(self.tokenizer, [{"role": m.role, "content": m.content} for m in messages])
        except (jinja2.TemplateError, ValueError, TypeError) as exc:  # a template may refuse roles or their order
            raise InvalidArgument(f"the chat template refused the messages: {exc}") from None

    async def finish(self, plan: Plan, status: str) -> None:
        """Record how the session ended and free it on both model services, unless another
        request resumed it meanwhile (it owns the session then, and uses the services' caches)."""
        try:
            if not await self.store.set_if_owner(plan.session_id, plan.owner, {"status": status}):
                return
        except Exception as exc:  # noqa: BLE001 - Redis down: free the caches anyway
            log.warning("recording the end of session %s: %s", plan.session_id, exc)
        await self.release(plan.session_id, plan.route)

    async def release(self, session_id: str, route: str | None = None) -> None:
        """Free the session's caches (failures logged). A finished session's (`route`: its
        Plan.route) on the draft and target replicas the route picks, which keep them for
        prefix reuse; a deleted one's (no route) dropped on every replica, since a failover may
        have left a copy on any of them (a Delete went to the route's alone, and a copy
        elsewhere stayed until evicted)."""
        keep_for_reuse = route is not None
        request = pb.ReleaseRequest(session_id=session_id, keep_for_reuse=keep_for_reuse)

        calls, results = [], []
        for replicas in (self.drafts, self.targets):
            try:
                chosen = [replicas.pick(route)] if keep_for_reuse else replicas.every()
            except Unavailable as exc:  # no replica to ask
                results.append(exc)
                continue
            calls += [replica.stub.Release(request, timeout=RELEASE_TIMEOUT_S) for replica in chosen]
        results += await asyncio.gather(*calls, return_exceptions=True)
        for result in results:
            if isinstance(result, grpc.aio.AioRpcError):
                log.warning("releasing session %s: %s %s", session_id, result.code().name, result.details())
            elif isinstance(result, Exception):
                log.warning("releasing session %s: %s", session_id, result)

    def spawn(self, coro) -> asyncio.Task:
        """Run `coro` as a task that outlives the caller's (kept until it ends)."""
        task = asyncio.get_running_loop().create_task(coro)
        self.background.add(task)
        task.add_done_callback(self.background.discard)
        return task

    @grpc_handler
    async def Info(self, request, context):
        if self.tokenizer is None:
            raise Unavailable("the coordinator is still starting; retry shortly")
        return pb.InfoResponse(
            target=self.target_info,
            draft=self.draft_info,
            default_num_speculative_tokens=self.default_k(),
            max_new_tokens_limit=self.config.max_new_tokens_limit,
        )


def generate_attributes(plan: Plan, servicer: CoordinatorServicer) -> dict:
    s = plan.sampling
    return {
        "specdec.session_id": plan.session_id,
        "specdec.target_model": servicer.target_info.model,
        "specdec.draft_model": servicer.draft_info.model,
        "specdec.prompt_tokens": len(plan.prompt),
        "specdec.k": plan.k,
        "specdec.temperature": s.temperature,
        "specdec.top_k": s.top_k,
        "specdec.top_p": s.top_p,
        "specdec.max_new_tokens": plan.max_new_tokens,
        "specdec.pipeline": plan.pipeline,
        "specdec.adaptive_k": plan.adaptive,
    }


def describe_request(plan: Plan, resumed: bool, caller: str, outcome: str, last: pb.GenerateChunk | None,
                     seconds: float) -> str:
    """The coordinator's log line of a request that ended (an access log): the session, the
    caller (specdec.security.caller_id) where API tokens are on, how it ended, its tokens and
    cycles (a resumed session's in all), the acceptance rate α and the time the call took.
    Never the text: a prompt may be private."""
    stats = last.stats if last is not None else pb.GenerateStats()
    who = f" by {caller}" if caller else ""
    alpha = f", α {stats.accepted_tokens / stats.draft_tokens:.2f}" if stats.draft_tokens else ""
    counted = f"{count(stats.generated_tokens, 'output token')}, {count(stats.cycles, 'cycle')}{alpha}"
    if resumed:
        counted += " (the session's in all)"
    return (f"{'resume' if resumed else 'request'} of session {plan.session_id!r}{who}: {outcome}; "
            f"{count(len(plan.prompt), 'prompt token')}, {counted}, {seconds:.2f} s")  # fmt: skip


def refusal_for(reason: str, error: Exception) -> Exception:
    """`error`, marked with the reason requests_refused counts it under (CoordinatorServicer.refusals)."""
    error.refusal_reason = reason
    return error


def describe_refusal(verb: str, session_id: str, caller: str, exc: Exception) -> str:
    """The coordinator's log line of a request refused before it ran: its status and message
    (which never hold the prompt), the session it named and the caller, as describe_request."""
    code, message = status_for(exc, quiet=True)
    session = f" of session {loggable_id(session_id)}" if session_id else ""
    who = f" by {caller}" if caller else ""
    return f"{verb}{session}{who}: refused {code.name}: {message}"


def loggable_id(session_id: str) -> str:
    """A session id a request named, as a log line shows it: quoted when it could be one
    (check_session_id), else only its length (a caller's megabytes of id used to go to the log
    whole, once per refused call)."""
    try:
        return repr(check_session_id(session_id))
    except InvalidArgument:
        return f"(not an id: {len(session_id)} characters)"


def count(n: int, noun: str) -> str:
    """'1 cycle', '3 cycles'."""
    return f"{n} {noun}{'s' * (n != 1)}"


def session_meta(plan: Plan, servicer: CoordinatorServicer, caller: str) -> dict:
    """A new session's Redis record: what Resume needs, who may resume it (caller_id)."""
    s = plan.sampling
    return {
        "seed": s.seed,
        "temperature": s.temperature,
        "top_k": s.top_k,
        "top_p": s.top_p,
        "k": plan.k,
        "max_new_tokens": plan.max_new_tokens,
        "prompt_tokens": len(plan.prompt),
        "target_model": plan.target.model,
        "target_fingerprint": plan.target.vocab_fingerprint,
        "target_weights": plan.target.weights_fingerprint,
        "draft_model": servicer.draft_info.model,
        "draft_fingerprint": servicer.draft_info.vocab_fingerprint,
        "status": "running",
        "owner": plan.owner,
        "caller": caller,
        "plan": session_meta_plan(plan),
    }


def session_meta_plan(plan: Plan) -> str:
    """What Resume needs of a plan beyond session_meta's own fields (resumed_plan), as JSON."""
    return json.dumps({
        "stop": list(plan.stop),
        "eos_token_ids": sorted(plan.eos_token_ids),
        "pipeline": plan.pipeline,
        "pipeline_min_keep": plan.pipeline_min_keep,
        "adaptive": plan.adaptive,
        "affinity_key": plan.affinity_key,
    })  # fmt: skip


def replay_text(tokenizer, stop, output: list[int], prompt: Sequence[int] = ()) -> TextStream:
    """A TextStream that has streamed `output` after `prompt` (Resume): fed token by token, as a
    stream is fed."""
    text = TextStream(tokenizer, list(stop), prompt)
    replay_tokens(text, output)
    return text


def replay_tokens(text: TextStream, tokens: list[int]) -> None:
    for token in tokens:
        text.add([token])
        text.take()


def finish_of(text: TextStream, eos: bool, length_reached: bool) -> str:
    """How the output streamed into `text` ends: "stop", "eos", "length", or "" (it goes on).
    An output that ends is flushed first: the characters an incomplete last character held
    back may complete a stop string (the stream used to say "length" or "eos" there, Resume "stop")."""
    if eos or length_reached:
        text.flush()
    if text.stopped:
        return "stop"
    return "eos" if eos else "length" if length_reached else ""


def finished_as(plan: Plan, text: TextStream, committed: list[int], finished: bool = False) -> str:
    """How a session with these committed tokens finished ("stop", "eos", "length"), or "";
    one recorded as `finished` ended at least on "length" (a context limit)."""
    generated = len(committed) - len(plan.prompt)
    eos = bool(generated) and committed[-1] in plan.eos_token_ids
    at_limit = bool(plan.max_context) and len(committed) >= plan.max_context
    length = finished or generated >= plan.max_new_tokens or at_limit
    return finish_of(text, eos, length)


def catch_up_chunk(plan: Plan, text: TextStream, committed: list[int], received_tokens: int, stats: Stats,
                   finished: bool) -> pb.GenerateChunk:  # fmt: skip
    """Resume's first chunk: the committed tokens after the `received_tokens` the client has, the
    text after what `text` has emitted, the session's statistics, and its finish reason when the
    tokens end it (or, for a session recorded as `finished`, "length" at least)."""
    finish = finished_as(plan, text, committed, finished)
    return pb.GenerateChunk(
        token_ids=text.ids[received_tokens:],
        text=text.take(final=bool(finish)),
        finish_reason=FINISH[finish] if finish else pb.FINISH_REASON_UNSPECIFIED,
        stats=stats_pb(output_stats(stats, text), len(plan.prompt), 0.0, 0.0),
        session_id=plan.session_id,
    )


def output_stats(stats: Stats, text: TextStream) -> Stats:
    """The statistics a client is sent: once a stop string ended the output, its
    `generated_tokens` are the output's, not the tokens committed past the stop string."""
    return replace(stats, generated_tokens=len(text.ids)) if text.stopped else stats


def stored_stats(meta: dict[str, str], generated: int) -> Stats:
    """A session's statistics as its commits counted them in Redis."""
    positions = []
    while f"accepted_pos_{len(positions)}" in meta:
        positions.append(int(meta[f"accepted_pos_{len(positions)}"]))
    count = {name: int(meta.get(name, 0)) for name in ("cycles", "draft_cycles", "draft_tokens", "accepted_tokens")}
    return Stats(**count, accepted_per_position=positions, generated_tokens=generated)


def stats_pb(stats: Stats, prompt_tokens: int, elapsed_s: float, first_token_s: float) -> pb.GenerateStats:
    return pb.GenerateStats(
        cycles=stats.cycles,
        draft_cycles=stats.draft_cycles,
        draft_tokens=stats.draft_tokens,
        accepted_tokens=stats.accepted_tokens,
        accepted_per_position=stats.accepted_per_position,
        prompt_tokens=prompt_tokens,
        generated_tokens=stats.generated_tokens,
        elapsed_s=elapsed_s,
        first_token_s=first_token_s,
    )


async def wait_for_model_info(replicas: Replicas, name: str, timeout_s: float) -> pb.ModelInfoResponse:
    """ModelInfo from a model service (one of its started replicas), waiting while it starts
    and loads its model, and, for a dns:/// address, until the name resolves. Every
    WAIT_LOG_S it logs what it waits for and why (a coordinator given a wrong address used to
    say only "loading" for the ten minutes before it gave up)."""
    started = time.monotonic()
    deadline, next_log = started + timeout_s, started + WAIT_LOG_S
    while True:
        if not replicas.replicas:
            await replicas.refresh()
        problem = "its address resolves to no replica"
        try:
            if replicas.replicas:
                replica = replicas.any()
                info = await replica.stub.ModelInfo(pb.ModelInfoRequest(), timeout=MODEL_INFO_TIMEOUT_S,
                                                    wait_for_ready=replicas.single)  # fmt: skip
                if loaded(info):
                    replicas.adopt(replica, info)
                    return info
                problem = "it is loading its model"
        except grpc.aio.AioRpcError as exc:
            if exc.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise
            if exc.code() == grpc.StatusCode.UNAVAILABLE:
                problem = f"UNAVAILABLE: {exc.details()}"
                replica.failed()
            else:  # a single address waits for a connection (wait_for_ready) and says no more
                problem = (f"no answer in {MODEL_INFO_TIMEOUT_S:.0f} s: nothing serves there yet, or the address is "
                           "wrong or unreachable")  # fmt: skip
        if (now := time.monotonic()) > deadline:
            raise FailedPrecondition(
                f"the {name} service at {replicas.address} did not become ready in {timeout_s:.0f}s ({problem}); "
                "a model that loads longer needs a longer --startup-timeout"
            )
        if now >= next_log:
            log.info("waiting for the %s service at %s (%.0f s so far, at most %.0f): %s",
                     name, replicas.address, now - started, timeout_s, problem)  # fmt: skip
            next_log = now + WAIT_LOG_S
        await asyncio.sleep(0.2)


async def serve(config: CoordinatorConfig) -> None:
    telemetry.setup_tracing("specdec-coordinator")
    store = SessionStore(config.redis_url, ttl_s=config.session_ttl_s, wait_replicas=config.redis_wait_replicas,
                         wait_ms=config.redis_wait_ms)  # fmt: skip
    servicer = CoordinatorServicer(config, store)
    await serving.run(
        name="coordinator",
        host=config.host,
        port=config.port,
        service_names=[serving.COORDINATOR_SERVICE],
        servicer=servicer,
        load=servicer.load,
        close=servicer.close,
        metrics_registry=servicer.metrics.registry,
        metrics_port=config.metrics_port,
        grace_s=config.drain_s,
        security=config.security,
        credential="an API token",
    )
