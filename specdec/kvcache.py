"""Per-session model state for the draft and target services.

Terms:
    held tokens   the token ids a service has fed to its model for a session, in
                  order; the KV cache covers exactly these.
    position      (from the request) how many committed tokens the caller believes
                  the service holds; the service keeps held[:position].
    new tokens    (from the request) committed tokens after `position`.

Both services follow one rule (`SessionState.sync`): keep held[:position], fetch
from Redis any committed tokens the service lacks below `position` (restart,
eviction, another replica), append `new_tokens`. What remains to be fed to the
model is `pending`; the cache never covers the last committed token, so there is
always at least one pending token whose logits the next step needs.
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

from specdec.errors import InvalidArgument, NotFound, OutOfRange, ResourceExhausted

FetchCommitted = Callable[[str, int, int], Awaitable[list[int]]]


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
    # Set while a cycle runs on this session, so eviction never takes a live one.
    busy: bool = False
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
    ) -> None:
        """Bring the session to committed[:position] + new_tokens (see module doc)."""
        if position < 0:
            raise InvalidArgument(f"position must be >= 0, got {position}")
        check_token_ids(new_tokens, vocab_size, "new_tokens")
        if position > len(self.held):
            # Tokens the caller thinks we hold but we do not: read them from Redis.
            missing = await fetch(self.session_id, len(self.held), position)
            if len(missing) != position - len(self.held):
                raise OutOfRange(
                    f"position {position} is past the session's {len(self.held) + len(missing)} committed tokens"
                )
            known = self.held + missing
        else:
            known = self.held[:position]
        context = known + list(new_tokens)
        if not context:
            raise InvalidArgument("the session has no tokens: send the prompt as new_tokens at position 0")
        if max_context and len(context) > max_context:
            raise OutOfRange(f"context of {len(context)} tokens exceeds the model's limit of {max_context}")
        # Keep the longest cached prefix that is still valid, but never the last token.
        keep = min(len(self.held), position, len(context) - 1)
        crop_cache(self.cache, keep)
        self.held = self.held[:keep]
        self.pending = context[keep:]
        self.last_used = time.monotonic()

    def feed(self, tokens: Sequence[int]) -> None:
        """Record that `tokens` were fed to the model (the cache now covers them)."""
        self.held.extend(tokens)

    def crop(self, length: int) -> None:
        """Drop held tokens (and their cache) past `length`."""
        crop_cache(self.cache, length)
        del self.held[length:]


def check_token_ids(tokens: Sequence[int], vocab_size: int, name: str) -> None:
    """Every id in [0, vocab_size); vocab_size 0 means any id >= 0 (n-gram drafts)."""
    limit = vocab_size or 2**31
    for t in tokens:
        if not 0 <= t < limit:
            raise InvalidArgument(f"{name} holds token id {t}, outside the vocabulary [0, {vocab_size})")


def crop_cache(cache: DynamicCache | None, length: int) -> None:
    """Shorten a KV cache to its first `length` positions."""
    if cache is None:
        return
    excess = cache.get_seq_length() - length
    if excess > 0:
        cache.crop(-excess)  # negative: remove that many positions from the end


class SessionPool:
    """Sessions held by one service, least recently used evicted past `max_sessions`."""

    def __init__(
        self,
        max_sessions: int,
        new_cache: Callable[[], DynamicCache | None],
        on_change: Callable[["SessionPool"], None] | None = None,
    ):
        if max_sessions < 1:
            raise ValueError("max_sessions must be at least 1")
        self.max_sessions = max_sessions
        self.new_cache = new_cache
        # Called after the set of held sessions changed (metrics).
        self.on_change = on_change or (lambda pool: None)
        self.sessions: collections.OrderedDict[str, SessionState] = collections.OrderedDict()
        self.evictions = 0

    def __len__(self) -> int:
        return len(self.sessions)

    def __contains__(self, session_id: str) -> bool:
        return session_id in self.sessions

    async def acquire(self, session_id: str, exists: Callable[[str], Awaitable[bool]]) -> SessionState:
        """The held state of a session, or a fresh one if Redis knows the session."""
        state = self.sessions.get(session_id)
        if state is None:
            if not await exists(session_id):
                raise NotFound(f"unknown session {session_id!r}: it was never created or has expired")
            self._make_room()
            state = SessionState(session_id, cache=self.new_cache())
            self.sessions[session_id] = state
            self.on_change(self)
        self.sessions.move_to_end(session_id)
        return state

    @contextlib.asynccontextmanager
    async def use(self, session_id: str, exists: Callable[[str], Awaitable[bool]]):
        """Hold a session for one call: locked, and safe from eviction meanwhile."""
        state = await self.acquire(session_id, exists)
        async with state.lock:
            state.busy = True
            try:
                yield state
            finally:
                state.busy = False
                state.last_used = time.monotonic()

    def release(self, session_id: str) -> bool:
        released = self.sessions.pop(session_id, None) is not None
        self.on_change(self)
        return released

    def _make_room(self) -> None:
        while len(self.sessions) >= self.max_sessions:
            idle = next((sid for sid, s in self.sessions.items() if not s.busy), None)
            if idle is None:
                raise ResourceExhausted(
                    f"all {self.max_sessions} session slots are in use by running cycles; retry later"
                )
            del self.sessions[idle]
            self.evictions += 1


@torch.inference_mode()
def forward(model, cache: DynamicCache | None, tokens: Sequence[int]) -> torch.Tensor:
    """Feed `tokens` after what `cache` covers; return their logits [len(tokens), V] (float32)."""
    device = model.device
    input_ids = torch.tensor([list(tokens)], dtype=torch.long, device=device)  # [1, T]
    out = model(input_ids=input_ids, cache=cache, use_cache=cache is not None)
    return out.logits[0].float()  # [T, V]
