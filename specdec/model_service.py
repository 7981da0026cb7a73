"""What the draft and target services share: a session pool over one model worker,
the internal request checks, and the Release / ModelInfo RPCs."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from specdec import serving, telemetry
from specdec.errors import (
    FailedPrecondition, InvalidArgument, OutOfRange, SessionRecreated, Unavailable, WorkerWedged, grpc_handler,
)
from specdec.kvcache import PREFILL_CHUNK, SessionPool, SessionState, feed_pending, find_prefix, take_prefix
from specdec.metrics import ModelServiceMetrics
from specdec.ranges import DEFAULT_MAX_BATCH, DEFAULT_MAX_K, DEFAULT_PASS_TIMEOUT_S, DEFAULT_TTL_S
from specdec.security import ServerSecurity, require_caller_credential
from specdec.session import SessionStore, check_session_id, session_gone
from specdec.v1 import specdec_pb2 as pb
from specdec.wire import Sampling, model_info_to_pb, sampling_from_pb

# How long a call that says `awaits_commit` waits for the committed tokens it names: the
# coordinator's commit (one Redis round trip) is far quicker; a commit that never lands
# (its coordinator died or was fenced) ends the wait with the refusal it would have had.
COMMIT_WAIT_S = 2.0


@dataclass
class ModelServiceConfig:
    """Settings the draft and the target service share (each adds its own)."""

    # Catalog name, HF directory or .gguf file of the model to serve.
    model: str = ""
    redis_url: str = field(default="", repr=False)  # may hold the Redis password: never in a repr
    host: str = "127.0.0.1"
    port: int = 0
    # Largest K (drafts per request) accepted; bounds the work one request can ask for.
    max_k: int = DEFAULT_MAX_K
    # Sessions whose KV cache is kept; least recently used evicted beyond.
    max_sessions: int = 256
    # MiB the sessions' KV caches may hold; least recently used evicted beyond; 0 = no limit.
    max_cache_mb: float = 4096
    dtype: str = "float32"
    device: str = "cpu"
    # Port of the Prometheus /metrics endpoint; 0 = off.
    metrics_port: int = 0
    # Sessions one forward pass takes at most (specdec.batching): the target's Verify calls, or
    # a model draft's drafting steps, that wait while a pass runs share the next one; 1 = one
    # session a pass.
    max_batch: int = DEFAULT_MAX_BATCH
    # Copy a new session's first tokens from the cache of an idle session that holds them
    # (kvcache.find_prefix). Off: every session feeds its whole prompt (no timing that tells a
    # caller another session's prompt began as theirs, where callers must not learn that).
    prefix_reuse: bool = True
    # TLS / mutual TLS, and the internal token(s) the coordinator must send.
    security: ServerSecurity = field(default_factory=ServerSecurity)
    # Serve without mTLS and without an internal token (development only).
    allow_unauthenticated: bool = False
    # Seconds one pass may run per 256 tokens it feeds (a prefill chunk; a decoding step counts as
    # one) before the service takes its device for hung: calls refused UNAVAILABLE and health
    # NOT_SERVING until it ends (serving.ModelWorker); 0 = never.
    pass_timeout_s: float = DEFAULT_PASS_TIMEOUT_S
    # Seconds Redis keeps a session after its last write (the coordinator's --session-ttl): a
    # finished session's cache is kept for prefix reuse at most that long.
    session_ttl_s: int = DEFAULT_TTL_S


class ModelService:
    """Base of DraftServicer and TargetServicer (listed first, so its Release and
    ModelInfo replace the generated UNIMPLEMENTED ones)."""

    role = "model"  # "draft" or "target": names the worker thread, metrics and errors
    # Check that the tokens a call asks to keep or add are committed (kvcache module doc).
    committed_only = False

    def __init__(self, config, store: SessionStore, info: pb.ModelInfoResponse):
        self.config = config
        self.store = store
        self.info = info
        self.loading_info = pb.ModelInfoResponse()  # what ModelInfo answers until load() is done
        self.loading_info.CopyFrom(info)
        self.worker = serving.ModelWorker(f"{self.role}-model")
        self.metrics = ModelServiceMetrics(self.role)
        self.metrics.watch_worker(self.worker)
        self.pool: SessionPool | None = None  # set once the model is loaded
        self.model = None  # the loaded model (None for an n-gram draft)

    def load(self) -> None:
        """Load the model and what the service's calls need (setup; blocking: run off the event
        loop), then make the pool of sessions last: calls are let in (ready) and ModelInfo says
        the model is loaded only once everything is in place. The pool came first, and a call
        in between failed INTERNAL (no drafter or batcher yet), a ModelInfo named a vocabulary
        without the draft's kind (a replica the coordinator then refused)."""
        from specdec.kvcache import new_cache

        self.setup()
        model = self.model
        self.pool = self.make_pool((lambda: new_cache(model.config)) if model is not None else (lambda: None))

    def setup(self) -> None:
        """Load the model (load_model) and what calls need beside it; self.info describes it."""
        raise NotImplementedError

    def load_model(self):
        """Load config.model and describe it in ModelInfo."""
        from specdec.models import load_model
        from specdec.packed import kernel_choice

        loaded = load_model(self.config.model, dtype=self.config.dtype, device=self.config.device)
        if loaded.kernels:
            how = "as timed before on this machine" if kernel_choice(loaded.model).remembered else "timed here"
            logging.getLogger("specdec").info("the %s model's linear kernels, %s: %s", self.role, how, loaded.kernels)
        self.info.MergeFrom(model_info_to_pb(loaded))
        self.model = loaded.model
        return loaded

    def make_pool(self, new_cache) -> SessionPool:
        return SessionPool(self.config.max_sessions, new_cache, self.metrics.observe_pool,
                           int(self.config.max_cache_mb * 2**20), retired_s=self.config.session_ttl_s)  # fmt: skip

    def ready(self) -> SessionPool:
        """The pool of sessions, once calls can be served: Unavailable while the model loads
        or the worker is wedged (serving.ModelWorker)."""
        pool = self.loaded()
        self.worker.refuse_if_wedged()
        return pool

    def loaded(self) -> SessionPool:
        """The pool of sessions, once the model is loaded (Unavailable before)."""
        if self.pool is None:
            raise Unavailable(f"the {self.role} model is still loading; retry shortly")
        return self.pool

    def watch_passes(self) -> None:
        """Take a pass past config.pass_timeout_s for a wedged worker from now on (once loaded:
        loading runs on the worker too, and may take minutes)."""
        self.worker.pass_timeout_s = self.config.pass_timeout_s

    @staticmethod
    def internal_sampling(msg: pb.SamplingParams) -> Sampling:
        sampling = sampling_from_pb(msg)
        if sampling.seed is None:
            raise InvalidArgument("sampling.seed is required on internal calls (the coordinator sets it)")
        return sampling

    @contextlib.asynccontextmanager
    async def session(self, request, context=None):
        """The session a Propose/Verify request names, held for the call and brought to
        committed[:position] + new_tokens (rebuilt from Redis when this process lacks it).
        With committed_only, its tokens are checked against Redis (SessionState.brought).
        A request that says `awaits_commit` has committed tokens that fall short waited for
        (commit_wait_s)."""
        wait_s = commit_wait_s(context) if request.awaits_commit else 0.0
        pool = self.ready()
        session_id = check_session_id(request.session_id)
        async with pool.use(session_id, self.store.exists) as state:
            # A call that waited for the session's lock while the worker wedged is refused now,
            # before it reads Redis or touches the state (pool.use gave it a state no hung pass
            # holds: a caller that left one dropped it).
            self.ready()
            try:
                async with state.brought(
                    request.position, request.new_tokens, self.committed_reader(state), self.info.vocab_size,
                    self.info.max_context, self.committed_only, wait_s,
                ):  # fmt: skip
                    yield state
            except SessionRecreated:
                pool.drop(state)  # the earlier session's cache: never to be trusted again
                raise
            except WorkerWedged:
                pool.drop(state)  # a pass may still write it (serving.ModelWorker)
                raise
            except (FailedPrecondition, OutOfRange):
                # Tokens missing from Redis may mean the session itself is gone (deleted, expired)
                # while we held it: say so, rather than call the request stale.
                if not await self.store.exists(session_id):
                    pool.drop(state)
                    raise session_gone(session_id) from None
                raise

    def committed_reader(self, state: SessionState):
        """The reader of committed tokens (kvcache.FetchCommitted) for `state`'s calls. Each read
        also takes the session's created_at: one other than the state's means the id was deleted
        (or expired) and created again while this process held the earlier session, whose
        tokens a call would otherwise take as checked (a Resume, or a call routed back here
        after a failover, at a position inside them), so the target would verify on another
        text: SessionRecreated, and the call is sent again to a fresh state."""

        async def read(session_id: str, start: int, end: int) -> list[int]:
            tokens, born = await self.store.tokens_and_birth(session_id, start, end)
            if born is not None:
                if state.born and born != state.born:
                    raise SessionRecreated(f"session {session_id!r} was created again since this {self.role} "
                                           "held it: its state is dropped; send the call again")  # fmt: skip
                state.born = born
            return tokens

        return read

    async def prefill(self, state: SessionState) -> None:
        """A session's pending context before its call's pass: its beginning copied from an
        idle session that holds it (prefix reuse, `kvcache.find_prefix`; off with
        --no-prefix-reuse), then what is still long fed in chunks (`prefill`)."""
        if self.model is None:
            return
        if self.config.prefix_reuse and (found := find_prefix(self.ready(), state)):
            donor, n = found
            await self.worker.run(take_prefix, donor.cache, state, n)
            self.metrics.prefix_reused_tokens.inc(n)
        await prefill(self.worker, self.model, state, self.metrics.prefill_chunks.inc)

    @grpc_handler
    async def Release(self, request: pb.ReleaseRequest, context):
        # Kept only where it may be reused (an n-gram draft has no cache to copy), and only while
        # Redis has the session: a Delete's release may have come first (it drops the cache).
        retire = request.keep_for_reuse and self.config.prefix_reuse and self.model is not None
        if retire:
            try:
                retire = await self.store.exists(request.session_id)
            except Exception:  # noqa: BLE001 - Redis away: drop the cache rather than keep a deleted one's
                retire = False
        # A wedged worker's sessions are released too: their states are only dropped or kept.
        return pb.ReleaseResponse(released=self.loaded().release(request.session_id, retire=retire))

    @grpc_handler
    async def ModelInfo(self, request, context):
        info = pb.ModelInfoResponse()
        info.CopyFrom(self.info if self.pool is not None else self.loading_info)
        if self.pool is not None:
            info.sessions_held = len(self.pool)
            info.cache_bytes = self.pool.bytes_held
            info.cache_evictions = self.pool.evictions
        return info


def commit_wait_s(context) -> float:
    """How long a call that says `awaits_commit` waits for a commit on its way: COMMIT_WAIT_S,
    and at most half the time its deadline leaves, so that a call that waited in vain is
    refused within its budget (a draft's is its --draft-timeout, 2 s by default: a wait that
    spent it all looked like a wedged replica, and moved every session on it)."""
    remaining = context.time_remaining() if hasattr(context, "time_remaining") else None
    return COMMIT_WAIT_S if remaining is None else max(0.0, min(COMMIT_WAIT_S, remaining / 2))


async def prefill(worker: serving.ModelWorker, model, state: SessionState,
                  fed: Callable[[], object] = lambda: None) -> None:  # fmt: skip
    """Chunked prefill: feed a session's pending tokens (a prompt, or a context rebuilt from
    Redis) to `model` PREFILL_CHUNK a pass until at most PREFILL_CHUNK are left for the call's
    own pass. Each chunk is queued on the worker behind the passes already waiting, so the
    sessions decoding beside a long prompt wait for one chunk between their passes, not for
    the whole prompt (6,000 tokens: 19 s in one pass on 2 cores). The cache and the logits
    after are those of one pass, up to float rounding. `fed` is called after each chunk (a
    metric; a call cancelled between chunks keeps, and has counted, those fed)."""
    while len(state.pending) > PREFILL_CHUNK:
        await worker.run(feed_pending, model, state, PREFILL_CHUNK)
        fed()


async def serve(servicer_class, config, service_name: str) -> None:
    """Run a model service until a termination signal (see serving.run)."""
    if require_caller_credential(config.security, config.allow_unauthenticated, servicer_class.role):
        logging.getLogger("specdec").warning("the %s service accepts unauthenticated calls", servicer_class.role)
    telemetry.setup_tracing(f"specdec-{servicer_class.role}")
    store = SessionStore(config.redis_url)
    servicer = servicer_class(config, store)

    async def load():
        await servicer.worker.run(servicer.load)
        servicer.watch_passes()

    await serving.run(
        name=servicer_class.role,
        host=config.host,
        port=config.port,
        service_names=[service_name],
        servicer=servicer,
        load=load,
        close=store.close,
        metrics_registry=servicer.metrics.registry,
        metrics_port=config.metrics_port,
        security=config.security,
        credential="the internal token of the coordinator",
        wedged=servicer.worker.wedged,
    )
