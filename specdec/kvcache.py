"""Per-session model state for the draft and target services.

Terms:
    held tokens   the token ids a service has fed to its model for a session, in
                  order; the KV cache covers exactly these.
    position      (from the request) how many committed tokens the caller believes
                  the service holds; the service keeps held[:position] (and, the
                  draft, the held tokens after it that new_tokens repeat).
    new tokens    (from the request) committed tokens after `position`.

Both services follow one rule (`SessionState.sync`): keep held[:position], read
from Redis the committed tokens below `position` when the service holds fewer
(restart, eviction, another replica; held is then kept only as far as it agrees
with them), append `new_tokens`. What remains to be fed to the
model is `pending`; the cache never covers the last committed token, so there is
always at least one pending token whose logits the next step needs.

The target also checks the caller: with `committed_only`, the tokens it is asked
to keep or add must be the session's committed tokens in Redis (one read of the
few tokens it has not checked yet), so no call, stale, replayed or hostile, can
make its cache cover anything but committed text once the call is over. When the
held tokens below `position` are checked already, only `new_tokens` are left to
check, and `SessionState.claimed` checks them while the model works instead of
before: a call whose tokens prove not to be committed is refused and its work
undone before the session is released. A call may also say that the commit of
the tokens it names is still on its way (`wait_s`): the read is then repeated for
a while before a shortfall counts. The draft does not check: its pipelined calls
are fed a guessed token by design, and a wrong draft costs speed, never
correctness.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache
from transformers.cache_utils import DummyLayer, DynamicIndexedLayer, DynamicLayer, DynamicSlidingWindowLayer

from specdec import plain_forward
from specdec.errors import FailedPrecondition, InvalidArgument, NotFound, OutOfRange, ResourceExhausted, WorkerWedged
from specdec.ranges import DEFAULT_TTL_S
from specdec.wire import check_token_ids

FetchCommitted = Callable[[str, int, int], Awaitable[list[int]]]
# Pending tokens a forward pass feeds at most while a session prefills (model_service.prefill).
# SmolLM2-135M on 2 cores, a 6,000-token prompt: 18.9 s in one pass; 256 a pass, 18.7 s in
# all and 1.3 s the longest pass (the last: attention over the whole context); 128 a pass,
# 23.8 s and 0.8 s.
PREFILL_CHUNK = 256
# How often a read of committed tokens is repeated while a commit is awaited (`wait_s`).
COMMIT_POLL_S = 0.002
# Fewest leading tokens a new session copies from another session's cache (prefix reuse:
# `find_prefix`); fewer are fed to the model as any other prompt.
MIN_PREFIX_REUSE = 16


@dataclass
class SessionState:
    """One session as a model service holds it."""

    session_id: str
    # Token ids the KV cache covers, in order (cache length == len(held)).
    held: list[int] = field(default_factory=list)
    # Committed tokens not yet fed to the model; at least the last one.
    pending: list[int] = field(default_factory=list)
    # The model's KV cache; None for drafters without a model (n-gram).
    cache: DynamicCache | None = None
    # How many tokens of held + pending are known to be committed (checked against
    # Redis or read from it); only counted with committed_only.
    confirmed: int = 0
    # Bytes of the KV cache, as of the end of the last call.
    nbytes: int = 0
    # The session's created_at in Redis when this state began to hold it ("" until read): a
    # session deleted and created again under the same id is another session (model_service).
    born: str = ""
    # Set while a call runs on this session (its cache is measured then, not taken for reuse).
    busy: bool = False
    # Calls holding this session or waiting for its lock (SessionPool.use): eviction passes
    # over it while any does, so a call that waited runs on the state the pool holds.
    calls: int = 0
    # Serialises calls on one session (a retry may overlap the call it retries).
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    last_used: float = field(default_factory=time.monotonic)

    @property
    def committed_length(self) -> int:
        return len(self.held) + len(self.pending)

    def tokens(self) -> list[int]:
        """held + pending: the full context as this service knows it."""
        return self.held + self.pending

    async def sync(
        self,
        position: int,
        new_tokens: Sequence[int],
        fetch: FetchCommitted,
        vocab_size: int,
        max_context: int = 0,
        committed_only: bool = False,
        wait_s: float = 0.0,
    ) -> None:
        """Bring the session to committed[:position] + new_tokens (see module doc).
        Nothing changes when the request is refused."""
        check_position(position, new_tokens, vocab_size, max_context)
        if committed_only:
            context, valid = await self.committed_context(position, list(new_tokens), fetch, wait_s)
        else:
            context, valid = await self.claimed_context(position, list(new_tokens), fetch, wait_s)
        self.adopt(context, valid)
        self.confirmed = len(context) if committed_only else 0

    def adopt(self, context: list[int], valid: int) -> None:
        """Make `context` the session's tokens, keeping the cache of its first `valid` held
        tokens (but never the last token: it stays pending). Its length against the model's
        was checked first (check_position: it is position + len(new_tokens))."""
        if not context:
            raise InvalidArgument("the session has no tokens: send the prompt as new_tokens at position 0")
        keep = min(valid, len(context) - 1)
        crop_cache(self.cache, keep)
        self.held = self.held[:keep]
        self.pending = context[keep:]
        self.last_used = time.monotonic()

    @contextlib.asynccontextmanager
    async def brought(
        self,
        position: int,
        new_tokens: Sequence[int],
        fetch: FetchCommitted,
        vocab_size: int,
        max_context: int = 0,
        committed_only: bool = False,
        wait_s: float = 0.0,
    ):
        """The session brought to committed[:position] + new_tokens for the body of the
        `async with`: the one entry point of a call. With committed_only and every held
        token below `position` checked already, new_tokens are checked while the body runs
        (`claimed`); otherwise first (`sync`)."""
        if committed_only and self.checked_below(position):
            async with self.claimed(position, new_tokens, fetch, vocab_size, max_context, wait_s):
                yield self
            return
        await self.sync(position, new_tokens, fetch, vocab_size, max_context, committed_only, wait_s)
        yield self

    def checked_below(self, position: int) -> bool:
        """Whether every held token below `position` was checked against Redis already, so
        that a call at `position` leaves only its new_tokens to check (`claimed`)."""
        return 0 <= position <= min(self.confirmed, len(self.held))

    @contextlib.asynccontextmanager
    async def claimed(
        self,
        position: int,
        new_tokens: Sequence[int],
        fetch: FetchCommitted,
        vocab_size: int,
        max_context: int = 0,
        wait_s: float = 0.0,
    ):
        """`sync` for `committed_only` when `checked_below(position)`: take new_tokens on the
        caller's word for the body of the `async with` (the model's work) while one read
        checks them against Redis; when they prove not to be the committed tokens, undo the
        work (cache, held, pending) and raise as `sync` would (FailedPrecondition,
        OutOfRange). Also undone when the body raises or is cancelled, but for WorkerWedged: a
        pass may still be writing the state then, and the caller drops it instead."""
        check_position(position, new_tokens, vocab_size, max_context)
        new_tokens = list(new_tokens)
        if not self.checked_below(position):
            raise ValueError(f"claimed needs the held tokens below {position} checked: use sync")
        self.adopt(self.held[:position] + new_tokens, position)
        keep, pending = len(self.held), list(self.pending)
        self.confirmed = keep + len(pending)
        check = asyncio.ensure_future(self.check_committed(fetch, position, position, new_tokens, wait_s))
        try:
            yield self
            await check
        except BaseException as exc:
            if not check.cancel() and not check.cancelled():
                check.exception()  # done with an error of its own: retrieved, not logged as lost
            if isinstance(exc, WorkerWedged):
                raise  # a pass may still write this state: not undone here, dropped by the caller
            crop_cache(self.cache, keep)
            del self.held[keep:]
            self.pending = pending
            self.confirmed = keep
            raise

    async def claimed_context(
        self, position: int, new_tokens: list[int], fetch: FetchCommitted, wait_s: float = 0.0
    ) -> tuple[list[int], int]:
        """(context, how many held tokens are valid) as the caller says: held[:position], then
        new_tokens (a caller unsure of what we hold sends them all, at position 0: the held
        tokens they repeat keep their cache). Where we hold fewer than `position` tokens, the
        caller took us for another state of the session (a cache evicted, a run resumed
        elsewhere): committed[:position] is read from Redis (with wait_s, see read_committed)
        and held kept only as far as it agrees. The tokens past what the caller ever named are
        our own drafts, some rejected: they used to be kept as committed text for the rest of
        the session."""
        if position <= len(self.held):  # the cache of held tokens that new_tokens repeat stays valid too
            return self.held[:position] + new_tokens, position + common_prefix(self.held[position:], new_tokens)
        stored = await self.read_committed(fetch, 0, position, wait_s)
        if len(stored) != position:
            raise OutOfRange(f"position {position} is past the session's {len(stored)} committed tokens")
        return stored + new_tokens, common_prefix(self.held, stored)

    async def committed_context(
        self, position: int, new_tokens: list[int], fetch: FetchCommitted, wait_s: float = 0.0
    ) -> tuple[list[int], int]:
        """(context, how many held tokens are valid), checked against Redis: the context is
        committed[:position + len(new_tokens)] and new_tokens must be its last tokens
        (FailedPrecondition otherwise). Held tokens not yet checked are compared with what
        Redis holds and kept only as far as they agree, whatever the caller claims. With
        wait_s, committed tokens that fall short are read again until they arrive or wait_s
        has passed (a commit on its way)."""
        start = min(self.confirmed, len(self.held), position)
        stored = await self.check_committed(fetch, start, position, new_tokens, wait_s)
        return self.held[:start] + stored, start + common_prefix(self.held[start:position], stored)

    async def check_committed(
        self, fetch: FetchCommitted, start: int, position: int, new_tokens: list[int], wait_s: float = 0.0
    ) -> list[int]:
        """committed[start:position + len(new_tokens)], read (see read_committed) and checked:
        it must reach `position` (OutOfRange) and end in new_tokens (FailedPrecondition)."""
        stored = await self.read_committed(fetch, start, position + len(new_tokens), wait_s)
        if len(stored) < position - start:
            raise OutOfRange(f"position {position} is past the session's {start + len(stored)} committed tokens")
        if stored[position - start :] != new_tokens:
            raise FailedPrecondition(
                f"new_tokens at position {position} are not session {self.session_id!r}'s committed tokens: "
                "a stale or foreign call"
            )
        return stored

    async def read_committed(self, fetch: FetchCommitted, start: int, end: int, wait_s: float = 0.0) -> list[int]:
        """committed[start:end] from Redis; while fewer exist, read again every
        COMMIT_POLL_S until wait_s has passed."""
        deadline = time.monotonic() + wait_s
        while True:
            stored = await fetch(self.session_id, start, end)
            if len(stored) >= end - start or time.monotonic() >= deadline:
                return stored
            await asyncio.sleep(COMMIT_POLL_S)

    def feed(self, tokens: Sequence[int]) -> None:
        """Record that `tokens` were fed to the model (the cache now covers them)."""
        self.held.extend(tokens)

    def crop(self, length: int) -> None:
        """Drop held tokens (and their cache) past `length`."""
        crop_cache(self.cache, length)
        del self.held[length:]
        self.confirmed = min(self.confirmed, length)


def check_position(position: int, new_tokens: Sequence[int], vocab_size: int, max_context: int = 0) -> None:
    """InvalidArgument for a negative position or new_tokens outside the vocabulary;
    OutOfRange, first and at no cost, for a context past max_context (0: no limit): each id
    was checked, and the list copied, on the event loop before the context's length was (60M
    new_tokens: 5.9 s, every other session's call waiting)."""
    if position < 0:
        raise InvalidArgument(f"position must be >= 0, got {position}")
    if max_context and position + len(new_tokens) > max_context:
        raise OutOfRange(f"context of {position + len(new_tokens)} tokens exceeds the model's limit of {max_context}")
    check_token_ids(new_tokens, vocab_size, "new_tokens")


class GrowingLayer(DynamicLayer):
    """One layer's KV cache that appends in place.

    transformers' DynamicLayer concatenates on every forward, so each decoded token copies
    its layer's whole cache (for SmolLM2-135M at 300 tokens of context, 14 MB a step over
    its 30 layers). This layer keeps key and value buffers [B, H, capacity, D] with room to
    spare, writes the new positions into them and hands attention views of the filled part
    [B, H, length, D]; capacity doubles when full, so appending costs O(new tokens) amortised,
    and cropping (a rejected draft) only shortens `length`. `keys` and `values` are made from
    the buffers when read, so a crop touches no tensor: re-pointing stored views cost two
    slices a layer, 0.28 ms a crop over SmolLM2's 30 layers.
    """

    MIN_CAPACITY = 64

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.key_buffer = self.empty_like_with(key_states, self.MIN_CAPACITY)  # [B, H, capacity, D]
        self.value_buffer = self.empty_like_with(value_states, self.MIN_CAPACITY)  # [B, H, capacity, D]
        self.length = 0
        self.is_initialized = True

    @staticmethod
    def empty_like_with(states: torch.Tensor, capacity: int) -> torch.Tensor:
        batch, heads, _, dim = states.shape
        return states.new_empty(batch, heads, capacity, dim)

    def filled(self, buffer: str) -> torch.Tensor | None:
        """The filled part [B, H, length, D] of the key or value buffer (None before the first update)."""
        return getattr(self, buffer)[:, :, : self.length] if self.is_initialized else None

    # Read: views of the buffers. Set: only the None transformers' layer __init__ assigns.
    keys = property(lambda self: self.filled("key_buffer"), lambda self, value: refuse_views(value))
    values = property(lambda self: self.filled("value_buffer"), lambda self, value: refuse_views(value))

    def grow(self, needed: int) -> None:
        """Move to buffers of at least `needed` positions (at least twice the old capacity).
        Both new buffers are made before either replaces its old one: out of memory on the
        second (a GPU under load) left keys of the new capacity beside values of the old, and
        every later pass of the session failed on the mismatch, however much memory came free."""
        capacity = max(needed, 2 * self.key_buffer.shape[-2])
        keys = self.empty_like_with(self.key_buffer, capacity)  # [B, H, capacity, D]
        values = self.empty_like_with(self.value_buffer, capacity)  # [B, H, capacity, D]
        keys[:, :, : self.length] = self.key_buffer[:, :, : self.length]
        values[:, :, : self.length] = self.value_buffer[:, :, : self.length]
        self.key_buffer, self.value_buffer = keys, values

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append [B, H, T, D] keys and values; return all of them so far, [B, H, length, D]."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[-2]
        if end > self.key_buffer.shape[-2]:
            self.grow(end)
        self.key_buffer[:, :, self.length : end] = key_states
        self.value_buffer[:, :, self.length : end] = value_states
        self.length = end
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length if self.is_initialized else 0

    def crop(self, tokens_to_remove: int) -> None:
        """Forget the last -tokens_to_remove positions (negative, as DynamicLayer takes it)."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative count of positions to remove, got {tokens_to_remove}")
        if self.is_initialized and tokens_to_remove:
            self.length = max(0, self.length + tokens_to_remove)

    def reset(self) -> None:
        if self.is_initialized:
            self.length = 0

    def nbytes(self) -> int:
        """Memory held, spare capacity included."""
        if not self.is_initialized:
            return 0
        return sum(b.numel() * b.element_size() for b in (self.key_buffer, self.value_buffer))


def refuse_views(value) -> None:
    """A GrowingLayer's keys and values are views of its buffers: only the None that
    transformers' layer __init__ assigns may be set."""
    if value is not None:
        raise AttributeError("a GrowingLayer's keys and values follow its buffers: write through update()")


def new_cache(config) -> DynamicCache:
    """An empty KV cache for a model of `config`, appending in place (GrowingLayer) on every
    layer of full or sliding-window attention; other layer kinds keep transformers' own.

    A sliding-window layer keeps every position too, not only its window: transformers'
    DynamicSlidingWindowLayer drops the older ones and then cannot crop back past them, so
    a session longer than the window failed at its first rejected draft (Mistral, Qwen2,
    Gemma 2 and 3). The model's own mask still limits each query to its window, so the
    logits are the same; the cost is memory, the whole context's keys and values."""
    cache = DynamicCache(config=config)
    cache.layers = [GrowingLayer() if type(layer) in (DynamicLayer, DynamicSlidingWindowLayer) else layer
                    for layer in cache.layers]  # fmt: skip
    return cache


# Cache layers a crop cuts back exactly: attention keys and values (GrowingLayer; DeepSeek
# V3.2's with its indexer keys, DynamicIndexedLayer) and layers that hold nothing (DummyLayer:
# no attention, or another layer's keys shared, as in Gemma 3n).
CROPPABLE_LAYERS = (GrowingLayer, DynamicIndexedLayer, DummyLayer)


def uncroppable_layers(config) -> list[str]:
    """The kinds of cache layer (class names) a model of `config` keeps that a crop cannot cut
    back (CROPPABLE_LAYERS has those it can). Such a layer (Mamba's and Jamba's SSM state,
    LFM2's convolution, Qwen3-Next's linear attention) keeps a running state that cannot be
    cropped back to a cycle's accepted drafts: those models' logits were wrong after a prefill
    fed in chunks, and their first rejected draft failed the pass, its batch's other sessions
    too."""
    return sorted({type(layer).__name__ for layer in new_cache(config).layers if not isinstance(layer, CROPPABLE_LAYERS)})


def cache_bytes(cache: DynamicCache | None) -> int:
    """Memory held by a KV cache's keys and values (a GrowingLayer's spare room included)."""
    if cache is None:
        return 0
    total = 0
    for layer in cache.layers:
        if isinstance(layer, GrowingLayer):
            total += layer.nbytes()
            continue
        for tensor in (getattr(layer, "keys", None), getattr(layer, "values", None), getattr(layer, "indexer_keys", None)):
            if isinstance(tensor, torch.Tensor):
                total += tensor.numel() * tensor.element_size()
    return total


def crop_cache(cache: DynamicCache | None, length: int) -> None:
    """Shorten a KV cache to its first `length` positions, each layer on its own: after a pass
    that failed partway (out of memory in layer i), the layers before i hold its positions and
    the rest do not. Cutting every layer by the first layer's excess, as DynamicCache.crop does,
    cut positions the later layers needed, and the next pass computed wrong logits."""
    if cache is None:
        return
    for layer in cache.layers:
        if isinstance(layer, DummyLayer):  # holds nothing (Gemma 3n's layers that share another's keys)
            continue
        excess = layer.get_seq_length() - length
        if excess > 0:
            layer.crop(-excess)  # negative: remove that many positions from the end


class SessionPool:
    """Sessions held by one service. The least recently used idle session is evicted
    when a new one would exceed `max_sessions`, or when the caches hold more than
    `max_cache_bytes` (0 = no limit); a session in a running call is never evicted.

    A session released as finished with `retire` is kept as a retired session: no longer
    served, but its cache may give a later session its beginning (`find_prefix`). Retired
    sessions count in the memory limit, at most `max_sessions` are kept, they go first
    (oldest first) whenever room is needed, before any session still in use, and none is kept
    longer than `retired_s` (by default as long as Redis keeps a finished session's record)."""

    def __init__(
        self,
        max_sessions: int,
        new_cache: Callable[[], DynamicCache | None],
        on_change: Callable[["SessionPool"], None] | None = None,
        max_cache_bytes: int = 0,
        retired_s: float = DEFAULT_TTL_S,
    ):
        if max_sessions < 1:
            raise ValueError("max_sessions must be at least 1")
        if max_cache_bytes < 0:
            raise ValueError("max_cache_bytes must be >= 0")
        self.max_sessions = max_sessions
        self.max_cache_bytes = max_cache_bytes
        self.new_cache = new_cache
        # Called after the set of held sessions changed (metrics).
        self.on_change = on_change or (lambda pool: None)
        self.sessions: collections.OrderedDict[str, SessionState] = collections.OrderedDict()
        # Finished sessions kept for prefix reuse, oldest first.
        self.retired: collections.OrderedDict[str, SessionState] = collections.OrderedDict()
        self.retired_s = retired_s
        self.evictions = 0

    def __len__(self) -> int:
        return len(self.sessions)

    def __contains__(self, session_id: str) -> bool:
        return session_id in self.sessions

    @property
    def bytes_held(self) -> int:
        """KV cache bytes of all sessions: measured now for those in a call, as of the end
        of their last call for the others."""
        states = (*self.sessions.values(), *self.retired.values())
        return sum(cache_bytes(s.cache) if s.busy else s.nbytes for s in states)

    async def acquire(self, session_id: str, exists: Callable[[str], Awaitable[bool]]) -> SessionState:
        """The held state of a session, or a fresh one if Redis knows the session."""
        state = self.sessions.get(session_id)
        if state is None:
            if not await exists(session_id):
                raise NotFound(f"unknown session {session_id!r}: it was never created or has expired")
            state = self.sessions.get(session_id)  # another call made it while Redis answered
        if state is None:
            self._make_room()
            state = SessionState(session_id, cache=self.new_cache())
            self.sessions[session_id] = state
            self.on_change(self)
        self.sessions.move_to_end(session_id)
        return state

    @contextlib.asynccontextmanager
    async def use(self, session_id: str, exists: Callable[[str], Awaitable[bool]]):
        """Hold a session for one call: locked, and safe from eviction meanwhile, also while
        the call waits for the lock. A state dropped while the call waited for it (`drop`: a
        call before found it untrustworthy; or released for good, the session deleted) is not
        used: the call takes the session's state again, a new one if none is held (NotFound
        when Redis no longer has the session). One retired meanwhile (its stream ended) serves
        the call as before."""
        while True:
            state = await self.acquire(session_id, exists)
            state.calls += 1
            try:
                async with state.lock:
                    if self.sessions.get(session_id) is not state and self.retired.get(session_id) is not state:
                        continue
                    state.busy = True
                    try:
                        yield state
                    finally:
                        state.busy = False
                        state.last_used = time.monotonic()
                        state.nbytes = cache_bytes(state.cache)
                    return
            finally:
                state.calls -= 1
                self._trim_memory()
                self.on_change(self)

    def release(self, session_id: str, retire: bool = False) -> bool:
        """Stop serving a session; True if it was held. `retire` (it finished): keep its cache
        for prefix reuse while room allows (class doc); else drop it, retired or not."""
        state = self.sessions.pop(session_id, None)
        dropped = self.retired.pop(session_id, None)
        if retire and (kept := state or dropped) is not None and self.worth_keeping(kept):
            kept.last_used = time.monotonic()
            self.retired[session_id] = kept
            self.drop_expired()
            while len(self.retired) > self.max_sessions:
                self.retired.popitem(last=False)
            self._trim_memory()
        self.on_change(self)
        return state is not None

    def drop(self, state: SessionState) -> None:
        """Drop `state` if the pool still serves it under its id: a call that finds its state
        untrustworthy (recreated, gone) drops that one, never a newer state another call
        made under the same id meanwhile (which a drop by id took from under it). Also when
        it was retired meanwhile (a Release during its call): never to serve as a prefix."""
        if self.sessions.get(state.session_id) is state:
            self.release(state.session_id)
        elif self.retired.get(state.session_id) is state:
            del self.retired[state.session_id]
            self.on_change(self)

    def _over_memory(self) -> bool:
        return bool(self.max_cache_bytes) and self.bytes_held > self.max_cache_bytes

    def _make_room(self) -> None:
        """Drop retired sessions, then evict idle ones, until a new one fits (ResourceExhausted
        when none is idle)."""
        while len(self.sessions) >= self.max_sessions or (
            self.max_cache_bytes and self.bytes_held >= self.max_cache_bytes
        ):
            if not (len(self.sessions) < self.max_sessions and self._drop_retired() or self._evict_idle()):
                held_mb = self.bytes_held / 2**20
                raise ResourceExhausted(
                    f"all {len(self.sessions)} held sessions ({held_mb:.1f} MiB of KV cache) are in running "
                    f"cycles and this service's limits are {self.max_sessions} sessions and "
                    f"{self.max_cache_bytes / 2**20:.0f} MiB; retry later"
                )

    def _trim_memory(self) -> None:
        while self._over_memory() and (self._drop_retired() or self._evict_idle()):
            pass

    def worth_keeping(self, state: SessionState) -> bool:
        """Whether a finished session's cache adds a beginning the retired ones lack: it holds
        MIN_PREFIX_REUSE tokens or more, and no retired session holds all of them and more; the
        retired sessions whose tokens are all a beginning of its are dropped (it covers them).
        The same prompt sent again and again (greedy, a benchmark) keeps one cache, not one a
        request up to `max_sessions`."""
        held = state.held
        if len(held) < MIN_PREFIX_REUSE:
            return False
        settled = [(sid, other) for sid, other in self.retired.items() if not other.busy]
        if any(other.held[: len(held)] == held for _, other in settled):
            return False
        for sid, other in settled:
            if held[: len(other.held)] == other.held:
                del self.retired[sid]
        return True

    def drop_expired(self) -> None:
        """Drop the sessions retired more than `retired_s` ago."""
        while self.retired and next(iter(self.retired.values())).last_used < time.monotonic() - self.retired_s:
            self.retired.popitem(last=False)

    def _drop_retired(self) -> bool:
        """Drop the oldest retired session; False when there is none."""
        if not self.retired:
            return False
        self.retired.popitem(last=False)
        return True

    def _evict_idle(self) -> bool:
        """Evict the least recently used session no call holds or waits for; False when there is none."""
        idle = next((sid for sid, s in self.sessions.items() if not s.calls), None)  # a busy one has a call
        if idle is None:
            return False
        del self.sessions[idle]
        self.evictions += 1
        return True


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens `a` and `b` share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def find_prefix(pool: SessionPool, state: SessionState) -> tuple[SessionState, int] | None:
    """Prefix reuse: (the idle or retired session of `pool` whose held tokens begin with the
    longest run of `state`'s pending tokens, that run's length), when `state` holds nothing yet
    and the run is at least MIN_PREFIX_REUSE tokens (never the last pending token, whose logits its call needs);
    else None. A chat's next turn (a new session whose prompt is the conversation so far) finds
    the previous turn's session; requests sharing a long system prompt find each other. Only
    caches of GrowingLayers (full or sliding-window attention, new_cache) are reused: other
    layer kinds may not hold every position."""
    limit = len(state.pending) - 1
    if state.held or limit < MIN_PREFIX_REUSE or not growing_only(state.cache):
        return None
    pool.drop_expired()
    head, wanted = state.pending[:MIN_PREFIX_REUSE], state.pending[:limit]
    best, longest = None, MIN_PREFIX_REUSE - 1
    for other in (*pool.sessions.values(), *pool.retired.values()):
        if other is state or other.busy or other.lock.locked() or other.held[:MIN_PREFIX_REUSE] != head:
            continue
        if growing_only(other.cache) and (n := common_prefix(other.held, wanted)) > longest:
            best, longest = other, n
    return (best, longest) if best is not None else None


def growing_only(cache: DynamicCache | None) -> bool:
    return cache is not None and all(isinstance(layer, GrowingLayer) for layer in cache.layers)


@torch.inference_mode()
def take_prefix(source: DynamicCache, state: SessionState, n: int) -> None:
    """Copy the first `n` positions of `source` (another session's cache, whose held tokens
    begin with `state`'s first n pending ones) into `state`'s empty cache, and move those
    tokens from pending to held: what feeding them would give, up to float rounding, for a
    copy (SmolLM2-135M: 46 KB a token) instead of a forward pass. Run on the model worker,
    where no pass of `source`'s session can run meanwhile; its buffers are read, not its
    `keys`, whose length a crop on the event loop may shorten (a crop leaves the buffers as
    they are, and only a pass, queued after this, writes them)."""
    for copied, layer in zip(source.layers, state.cache.layers):
        layer.update(copied.key_buffer[:, :, :n], copied.value_buffer[:, :, :n])  # [1, H, n, D] each
    state.feed(state.pending[:n])
    del state.pending[:n]


@torch.inference_mode()
def forward(model, cache: DynamicCache | None, tokens: Sequence[int], keep: int = 1) -> torch.Tensor:
    """Feed `tokens` after what `cache` covers; return the logits of the last `keep` of them
    [keep, V] (float32). Only those rows go through the vocabulary projection: on a CPU that
    projection costs about a fifth of a SmolLM2-135M step per token, so a 200-token prompt
    whose every row was projected would cost a second more to prefill. A model that
    load_model marked (specdec.plain_forward) takes the plain path, with the same logits."""
    reset_dynamic_rope(model)
    if cache is not None and getattr(model, plain_forward.ENABLED, False):
        return plain_forward.plain_forward(model, cache, tokens, keep)
    return transformers_forward(model, cache, tokens, keep)


@torch.inference_mode()
def forward_batch(model, caches: Sequence[DynamicCache], token_lists: Sequence[Sequence[int]],
                  keeps: Sequence[int]) -> list[torch.Tensor]:  # fmt: skip
    """forward for several sessions: token_lists[i] after caches[i], the logits of its last
    keeps[i] tokens each. On the plain path in one pass over all their rows
    (plain_forward.plain_forward_batch), unless the model's rotary frequencies follow the
    pass's longest position (length_dependent_rope); otherwise one forward per session."""
    if len(caches) > 1 and getattr(model, plain_forward.ENABLED, False) and not length_dependent_rope(model):
        return plain_forward.plain_forward_batch(model, caches, token_lists, keeps)
    return [forward(model, cache, tokens, keep) for cache, tokens, keep in zip(caches, token_lists, keeps)]


def rope_types(model) -> list[str]:
    """The rope_type of `model`'s rotary embedding (one per layer type where it has several;
    none where it has no rotary embedding, GPT-2's say)."""
    rotary = getattr(getattr(model, "model", None), "rotary_emb", None)
    kind = getattr(rotary, "rope_type", None)
    return list(kind.values()) if isinstance(kind, dict) else [kind] if isinstance(kind, str) else []


def length_dependent_rope(model) -> bool:
    """Whether `model`'s rotary frequencies follow the longest position of each pass
    (transformers' "dynamic" NTK scaling, and "longrope", Phi-3's): sessions sharing a pass
    changed each other's logits (a short session scaled as the long one beside it), so each
    gets a pass of its own (forward_batch)."""
    return any("dynamic" in kind or kind == "longrope" for kind in rope_types(model))


def context_limit(model) -> int:
    """The positions a session of `model` may reach (0: its config does not say):
    max_position_embeddings, or, for a "longrope" model (Phi-3 128k) whose
    original_max_position_embeddings is smaller, that. Past it such a model's rotary
    frequencies switch to their long factors for every row of a pass, and the keys cached
    before were rotated with the short ones: transformers' own generate recomputes the whole
    cache at the switch, specdec's sessions kept their keys, and their logits past the switch
    were wrong (argmax wrong at 7 of 10 passes of a tiny Phi-3), so a session stops there."""
    config = model.config
    limit = int(getattr(config, "max_position_embeddings", 0) or 0)
    if "longrope" not in rope_types(model):
        return limit
    parameters = getattr(config, "rope_parameters", None) or {}
    each = list(parameters.values()) if all(isinstance(v, dict) for v in parameters.values()) and parameters else [parameters]
    longrope = [p for p in each if p.get("rope_type", p.get("type")) == "longrope"]  # not another layer type's
    originals = [int(o) for p in longrope if (o := p.get("original_max_position_embeddings"))]
    if not originals and (o := getattr(config, "original_max_position_embeddings", None)):
        originals = [int(o)]
    return min([limit, *originals] if limit else originals, default=limit)


def reset_dynamic_rope(model) -> None:
    """Put a "dynamic" rotary embedding back to its original frequencies before a pass:
    transformers keeps those of the longest pass the model has run, so a session's logits
    depended on which sessions ran before it. Each pass now scales for its own positions."""
    rotary = getattr(getattr(model, "model", None), "rotary_emb", None)
    kind = getattr(rotary, "rope_type", None)
    if not (isinstance(kind, str) and "dynamic" in kind) or rotary.max_seq_len_cached == rotary.original_max_seq_len:
        return
    rotary.register_buffer("inv_freq", rotary.original_inv_freq.to(rotary.inv_freq.device), persistent=False)
    rotary.max_seq_len_cached = rotary.original_max_seq_len


@torch.inference_mode()
def feed_pending(model, state: SessionState, n: int) -> None:
    """Feed the first `n` of a session's pending tokens to its model (a chunk of a prefill),
    leaving at least one pending: the cache covers them after, and they move to held."""
    n = min(n, len(state.pending) - 1)
    chunk = state.pending[:n]
    forward(model, state.cache, chunk)  # [1, V]: not needed, and only the last row is projected
    state.feed(chunk)
    del state.pending[:n]


def transformers_forward(model, cache: DynamicCache | None, tokens: Sequence[int], keep: int = 1) -> torch.Tensor:
    """forward through transformers' own LlamaForCausalLM.forward (or any causal LM's)."""
    device = model.device
    input_ids = torch.tensor([list(tokens)], dtype=torch.long, device=device)  # [1, T]
    keep = min(keep, len(tokens))
    out = model(input_ids=input_ids, cache=cache, use_cache=cache is not None, logits_to_keep=keep)
    return out.logits[0, -keep:].float()  # [keep, V]


def wait_for_device(tensor: torch.Tensor) -> None:
    """Wait until the GPU that holds `tensor` has done its queued work (a no-op on a CPU): a
    GPU runs a forward's kernels after the call returns, so a clock read at once would time
    their launch (the Verifier's forward_ms would leave the pass's time to the verdict's first
    read, and step_ms would charge a pass's kernels to the next one)."""
    if tensor.device.type == "cuda":
        torch.cuda.synchronize(tensor.device)


def step_ms(model, context: Sequence[int], tokens: int, repeats: int = 5) -> float:
    """Median ms of one forward of `tokens` new tokens after a cached `context`, projecting
    each of them onto the vocabulary as Verify does (tokens = 1: one decode step, c_p or c_q;
    tokens = K + 1: c_verify). See step_ms_by_size."""
    return step_ms_by_size(model, context, [tokens], repeats)[tokens]


def prefill_ms(model, tokens: Sequence[int], repeats: int = 5) -> float:
    """Median ms of one forward over `tokens` on an empty cache, only the last row projected
    onto the vocabulary: a request's first Verify (or a draft's first Propose) prefilling its
    prompt. A first, warm-up pass is not counted. Uses torch's current thread count."""
    times = []
    with torch.inference_mode():
        for round_ in range(repeats + 1):
            cache = new_cache(model.config)
            start = time.perf_counter()
            wait_for_device(forward(model, cache, tokens))
            if round_:
                times.append((time.perf_counter() - start) * 1000)
    return sorted(times)[len(times) // 2]


def step_ms_by_size(model, context: Sequence[int], sizes: Sequence[int], repeats: int = 5) -> dict[int, float]:
    """{n: median ms of one forward of n new tokens after a cached `context`} for each n of
    `sizes`, after one prefill of `context`. The cache is cropped back to `context` before
    every forward, the sizes take turns in each repeat (so a machine whose speed drifts
    moves them alike), and a first, warm-up round is not counted. Uses torch's current
    thread count."""
    times: dict[int, list[float]] = {n: [] for n in sizes}
    with torch.inference_mode():
        cache = new_cache(model.config)
        wait_for_device(forward(model, cache, context))
        for round_ in range(repeats + 1):
            for n in sizes:
                crop_cache(cache, len(context))
                start = time.perf_counter()
                wait_for_device(forward(model, cache, list(context[-n:]), keep=n))
                if round_:
                    times[n].append((time.perf_counter() - start) * 1000)
    return {n: sorted(t)[len(t) // 2] for n, t in times.items()}
