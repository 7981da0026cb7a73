"""The specdec client SDK: `Client` (blocking) and `AsyncClient` (asyncio).

    client = specdec.Client("localhost:50051")
    result = client.generate("Once upon a time", max_new_tokens=64)
    print(result.text, result.stats.acceptance_rate)
    for chunk in client.generate_stream("Tell me a story", max_new_tokens=64):
        print(chunk.text, end="", flush=True)
    # an instruct model answers a conversation, rendered with its chat template
    answer = client.generate(messages=[{"role": "user", "content": "Tell me a story"}])

Every gRPC failure surfaces as `SpecdecClientError`, carrying the status code
(`.code`, a grpc.StatusCode) and the server's message (`.message`).

A stream that breaks once begun (its coordinator restarted or replaced, the connection
lost) is resumed where it broke, by any coordinator on the same Redis; the chunks go on
as if nothing happened. `client.resume(session_id)` does it by hand, e.g. from another process.

A secured coordinator: `Client(address, tls_ca="ca.pem", token="...")` connects with
TLS, trusting the CA in that file, and sends the token as `authorization: Bearer`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import operator
import random
import threading
import time
import urllib.parse
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TypedDict, Unpack

import grpc

from specdec.ranges import (
    DEFAULT_RETRIES, FLOAT32_MAX, INT32, RETRIES, SECONDS, SEED, TEMPERATURE, TOP_P, UINT32, Range, address_problem,
    text_problem, token_problem,
)
from specdec.v1 import specdec_pb2 as pb
from specdec.v1 import specdec_pb2_grpc as pb_grpc

DEFAULT_ADDRESS = "localhost:50051"
FINISH_NAMES = {
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_EOS: "eos",
}
# Keepalive of every specdec channel (this SDK's, and the coordinator's to the model services):
# a channel whose connection carried nothing for 10 s pings it, also in the middle of a long
# call, and drops the connection when no answer comes within 5 s. A peer that is frozen
# (SIGSTOP, a hung host) or cut off by a network that leaves TCP open then fails its calls
# UNAVAILABLE within ~15 s, and they go on elsewhere (the SDK resumes a stream through another
# coordinator; the coordinator verifies on another target replica). They used to wait ~60 s
# (the coordinator: a ping after 30 s, which gRPC gives a minute, `ping_timeout_ms`, to be
# answered; `keepalive_timeout_ms` is the older gRPCs' name) or, without a deadline, forever (the
# SDK). A peer that is only busy answers: gRPC's own threads acknowledge pings. specdec's
# servers accept pings this often (serving.SERVER_OPTIONS).
KEEPALIVE_OPTIONS = [
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.http2.ping_timeout_ms", 5_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.http2.max_pings_without_data", 0),
]
# q for a 150k vocabulary as dense float32 over K=16 drafts is ~10 MB; leave room.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# What every specdec channel and server is opened with (serving adds each side's own).
GRPC_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    *KEEPALIVE_OPTIONS,
]
# What every specdec channel (this SDK's, the coordinator's to the model services) adds:
# - a peer that comes back is reconnected to within a second: gRPC's default backoff grows to
#   minutes (1 s, then 1.6 times longer each try), and while it waits every call fails fast
#   UNAVAILABLE (a client whose coordinator was away 40 s failed for 2.9 s after it served);
# - a call is kept for a retry whole up to the largest message: gRPC keeps only 256 KiB by
#   default, and a larger one (a long prompt or chat) was never sent again.
CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1_000),
    ("grpc.enable_retries", 1),
    ("grpc.per_rpc_retry_buffer_size", MAX_MESSAGE_BYTES),
]
# The coordinator's response headers name the session once it exists (Generate and Resume):
# a stream that fails after them can be resumed; one that fails before them never began.
SESSION_HEADER = "specdec-session-id"
# A header value is printable ASCII; an id may hold any printable text ('ünï'), so the value is
# the id percent-encoded (urllib.parse.unquote gives it back): ASCII ids but '%' travel as they are.
_HEADER_SAFE = "".join(chr(c) for c in range(0x20, 0x7F) if chr(c) != "%")

# How a channel picks among the coordinators its address names (`ipv4:A,B`, or a name that
# resolves to several): round_robin sends each call to the next ready one (coordinators keep
# nothing between calls: any serves any call, and any resumes any session); pick_first sends
# every call to the first that answers, until it fails.
LOAD_BALANCING = ("round_robin", "pick_first")
# What a call cut by its AsyncClient's close() says (SpecdecClientError CANCELLED, as Client's).
CUT_BY_CLOSE = "the client was closed during the call (close() was called, or its with block ended)"
RETRY_BACKOFF_S = (0.2, 2.0)  # the first wait is random in [0, 0.2 s], each next one up to twice as long, at most 2 s


def session_header(session_id: str) -> tuple[str, str]:
    """The response header that names the session `session_id` (see SESSION_HEADER)."""
    return SESSION_HEADER, urllib.parse.quote(session_id, safe=_HEADER_SAFE)


def service_config(retries: int, load_balancing: str = "round_robin") -> str:
    """gRPC service config (JSON) of a channel to the coordinator. Calls go to the coordinators
    the address names as `load_balancing` says (LOAD_BALANCING). A call that fails UNAVAILABLE
    before the server has answered anything (nothing serving yet, a coordinator restarting or
    replaced, its model services or Redis unreachable as the request starts) is sent again, up to
    `retries` times, after a random wait (RETRY_BACKOFF_S). A stream that has begun is never sent
    again (its session exists; a retry would start another): the SDK resumes it instead
    (_Resumption)."""
    if retries not in RETRIES:  # the range `specdec generate --retries` takes
        raise ValueError(f"retries must be an integer from {RETRIES.low} to {RETRIES.high}, got {retries!r}")
    if load_balancing not in LOAD_BALANCING:
        raise ValueError(f"load_balancing must be one of {', '.join(LOAD_BALANCING)}, got {load_balancing!r}")
    method: dict = {"name": [{"service": "specdec.v1.Coordinator"}]}
    if retries:
        initial, largest = RETRY_BACKOFF_S
        method["retryPolicy"] = {"maxAttempts": retries + 1, "initialBackoff": f"{initial}s", "maxBackoff": f"{largest}s",
                                 "backoffMultiplier": 2, "retryableStatusCodes": ["UNAVAILABLE"]}  # fmt: skip
    return json.dumps({"loadBalancingConfig": [{load_balancing: {}}], "methodConfig": [method]})


class _Resumption:
    """How far a stream got, so that one broken after its session began can go on (Resume).

    A stream that fails UNAVAILABLE (its coordinator restarted, was replaced, or the connection
    dropped) is resumed on any coordinator of the same Redis, up to `retries` times, after the
    same random waits as service_config's, within the call's timeout: the server sends the tokens
    and text committed after what came here, then goes on generating. The session's id is the
    caller's, else one made here, so that even a stream that broke before its first chunk can
    be resumed. A resumed call's statistics count the whole session's tokens but time only that
    call: `saw` adds the time from the stream's start to it, so elapsed_s and tokens_per_second
    are the stream's, and first_token_s stays the first call's once a token came."""

    def __init__(self, session_id: str, retries: int, timeout: float | None, *, tokens: int = 0, chars: int = 0,
                 own_id: bool = False, began: bool = False):  # fmt: skip
        check_timeout(timeout)
        self.session_id = session_id
        self.own_id = own_id  # the id was made here (a uuid4), not the caller's
        self.tokens = tokens  # output tokens received (a hand-made Resume: those the caller has)
        self.chars = chars  # characters of output text received
        self.finished = False
        # a call of this stream was told the session exists (SESSION_HEADER, a chunk); given for
        # a hand-made Resume (resume_stream), whose session the caller had
        self.began = began
        self.resumes = 0
        self.retries = retries
        self.started = time.monotonic()
        self.deadline = None if timeout is None else self.started + timeout
        self.resumed_at_s = 0.0  # seconds from the first call to the Resume now streaming
        self.first_token_s: float | None = None  # of the stream, once a token came
        # The error after which a Resume is tried on the chance that the session began: a call's
        # whose headers are not known (headers_of: None), or ALREADY_EXISTS for an id made here
        # (see next_call).
        self.guessed: grpc.RpcError | None = None

    def saw(self, chunk: "Chunk") -> "Chunk":
        self.began = True  # a chunk comes from a session that exists, headers seen or not
        if self.resumed_at_s:
            stats = chunk.stats
            first = stats.first_token_s + self.resumed_at_s if self.first_token_s is None else self.first_token_s
            chunk.stats = replace(stats, elapsed_s=stats.elapsed_s + self.resumed_at_s, first_token_s=first)
        if self.first_token_s is None and chunk.token_ids:
            self.first_token_s = chunk.stats.first_token_s
        self.tokens += len(chunk.token_ids)
        self.chars += len(chunk.text)
        self.finished = chunk.finish_reason is not None
        return chunk

    def next_call(self, error: grpc.RpcError, headers) -> tuple[pb.ResumeRequest, float, float | None] | None:
        """(the Resume request, seconds to wait before it, its timeout) after `error` ended a
        call that received `headers` (its initial metadata; None where the call cannot say), or
        None when the error stands: not UNAVAILABLE, the session never began or had finished, no
        retry or time left. Where the headers are not known (a call wrapped by OpenTelemetry's
        instrumentation, which `specdec generate` installs when tracing is on) a session that
        sent no chunk yet may have begun: where the SDK made its id, one Resume is tried, and its
        NOT_FOUND means it had not (`error_of`). Such a stream used to be given up, where an
        unwrapped one resumed."""
        self.began = self.began or any(key == SESSION_HEADER for key, _ in headers or ())
        code = error.code()
        if code == grpc.StatusCode.ALREADY_EXISTS and self.own_id and not self.began and not self.resumes:
            # The id is a uuid4 made for this call: an earlier attempt of it (gRPC's retry policy)
            # created the session and then failed before its headers came back. Resume it, where
            # the caller used to get ALREADY_EXISTS for a session whose id it never saw.
            self.guessed, code = error, grpc.StatusCode.UNAVAILABLE
        elif headers is None and not self.began and code == grpc.StatusCode.UNAVAILABLE and self.own_id:
            # Only for an id made here: a caller's may name an earlier session, whose output a
            # Resume would hand back as this call's.
            self.guessed = self.guessed or error
        maybe_began = self.began or (self.guessed is not None and not self.resumes)  # one guess, not `retries`
        if code != grpc.StatusCode.UNAVAILABLE or not maybe_began or self.finished or self.resumes >= self.retries:
            return None
        initial, largest = RETRY_BACKOFF_S
        wait = random.uniform(0, min(largest, initial * 2**self.resumes))
        timeout = None if self.deadline is None else self.deadline - time.monotonic() - wait
        if timeout is not None and timeout <= 0:
            return None
        self.resumes += 1
        self.resumed_at_s = time.monotonic() + wait - self.started
        request = pb.ResumeRequest(session_id=self.session_id, received_tokens=self.tokens, received_chars=self.chars)
        return request, wait, timeout

    def error_of(self, error: grpc.RpcError) -> "SpecdecClientError":
        """What the stream raises when `error` ends it: its own code and message, except a
        NOT_FOUND from a Resume tried on a guess (next_call) while no chunk came: the session
        never began, and the error the guess followed stands."""
        if self.guessed is not None and not self.began and error.code() == grpc.StatusCode.NOT_FOUND:
            error = self.guessed
        return SpecdecClientError(error.code(), error.details() or "", self.session_id if self.began else None)


def check_timeout(timeout: float | None) -> None:
    """ValueError for a call timeout gRPC cannot hold (SECONDS; None: no deadline): 1e10 s, inf
    or NaN ended the call DEADLINE_EXCEEDED at once."""
    if timeout is not None and (problem := SECONDS.problem("timeout", timeout)):
        raise ValueError(f"{problem} (None: no deadline)")


# What may end a call after its last chunk came and leave the output whole: the connection
# broken, the call's deadline passed or its client closed before the server's closing status.
ENDS_A_WHOLE_OUTPUT = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)


def ended_whole(finished: bool, error: grpc.RpcError) -> bool:
    """Whether `error` (ENDS_A_WHOLE_OUTPUT) ended a stream after its last chunk (the one with
    its finish_reason, `finished`) came: the output is whole, so the stream ends as if it had
    closed cleanly. A stream or a Resume used to fail on a complete output, and generate() or
    resume() with it: on UNAVAILABLE, and until now on a deadline that ran out in between."""
    return finished and error.code() in ENDS_A_WHOLE_OUTPUT


def channel_credentials(
    tls_ca: str | None, credentials: grpc.ChannelCredentials | None
) -> grpc.ChannelCredentials | None:
    """Explicit credentials win; else TLS trusting the CA file `tls_ca`; else None (plaintext)."""
    if credentials is not None or not tls_ca:
        return credentials
    with open(tls_ca, "rb") as f:
        return grpc.ssl_channel_credentials(root_certificates=f.read())


def channel_options(address: str, retries: int = DEFAULT_RETRIES, load_balancing: str = "round_robin") -> list:
    """The options of a channel to `address`: GRPC_OPTIONS, balancing and retrying as
    service_config(retries, load_balancing) says. ValueError for an address that can name no
    server (specdec.ranges.address_problem: empty, a URL, a bad port)."""
    if problem := address_problem(address):
        raise ValueError(problem)
    config = service_config(retries, load_balancing)
    return [*GRPC_OPTIONS, *CHANNEL_OPTIONS, ("grpc.service_config", config)]


def open_channel(module, address: str, credentials: grpc.ChannelCredentials | None, options: list):
    """A channel of `module` (grpc or grpc.aio) to `address` with `options` (channel_options),
    TLS when credentials are given."""
    if credentials is None:
        return module.insecure_channel(address, options=options)
    return module.secure_channel(address, credentials, options=options)


class _Stub:
    """What Client and AsyncClient share: their stub while open. A call on a closed client raises
    ValueError (as a closed file does); gRPC's own error was "Cannot invoke RPC on closed
    channel!" from Client and a cygrpc UsageError, no ValueError, from AsyncClient."""

    _open_stub: pb_grpc.CoordinatorStub | None  # None once closed (an AsyncClient: also before its first call)

    @property
    def _stub(self) -> pb_grpc.CoordinatorStub:
        if self._open_stub is None:
            raise self._closed_error()
        return self._open_stub

    def _closed_error(self) -> ValueError:
        kind = type(self).__name__
        return ValueError(f"this specdec.{kind} is closed (close() was called, or its with block ended): "
                          f"make a new {kind} to call the coordinator again")  # fmt: skip


def auth_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """The call metadata that sends `token`; ValueError for one no header can carry (token_problem)."""
    if token and (problem := token_problem(token)):
        raise ValueError(problem)
    return (("authorization", f"Bearer {token}"),) if token else ()


class SpecdecClientError(Exception):
    """A failed call: `code` is the gRPC status code, `message` what the server said, and
    `session_id` the session a failed stream had begun (None where none had, or for another
    call): what client.resume takes to get the rest, even before any chunk came."""

    def __init__(self, code: grpc.StatusCode, message: str, session_id: str | None = None):
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message
        self.session_id = session_id

    def __reduce__(self):
        """Pickled by its own arguments (a process pool's worker sends it back so; Exception's
        default passes the one message, which __init__ does not take)."""
        return type(self), (self.code, self.message, self.session_id)


@dataclass
class Stats:
    """Statistics of one request.

    cycles                draft/verify rounds (including target-only ones)
    draft_cycles          cycles in which the draft proposed at least one token
    acceptance_rate       accepted draft tokens / drafted tokens (α as measured)
    mean_accepted_length  tokens per drafting cycle = 1 + accepted / draft_cycles (vLLM's
                          mean acceptance length); 1.0 when nothing was drafted
    tokens_per_second     generated tokens / elapsed_s, the request's wall time on the server
                          (of a stream the SDK resumed, from its first call: _Resumption)
    """

    cycles: int = 0
    draft_cycles: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    generated_tokens: int = 0
    elapsed_s: float = 0.0
    first_token_s: float = 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        return 1.0 + self.accepted_tokens / self.draft_cycles if self.draft_cycles else 1.0

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @classmethod
    def from_pb(cls, msg: pb.GenerateStats) -> "Stats":
        return cls(
            cycles=msg.cycles,
            draft_cycles=msg.draft_cycles,
            draft_tokens=msg.draft_tokens,
            accepted_tokens=msg.accepted_tokens,
            accepted_per_position=list(msg.accepted_per_position),
            prompt_tokens=msg.prompt_tokens,
            generated_tokens=msg.generated_tokens,
            elapsed_s=msg.elapsed_s,
            first_token_s=msg.first_token_s,
        )

    def as_dict(self) -> dict:
        return {
            "cycles": self.cycles,
            "draft_cycles": self.draft_cycles,
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "accepted_per_position": self.accepted_per_position,
            "acceptance_rate": self.acceptance_rate,
            "mean_accepted_length": self.mean_accepted_length,
            "prompt_tokens": self.prompt_tokens,
            "generated_tokens": self.generated_tokens,
            "elapsed_s": self.elapsed_s,
            "first_token_s": self.first_token_s,
            "tokens_per_second": self.tokens_per_second,
        }


@dataclass
class CycleTrace:
    """One draft/verify cycle as the coordinator reported it."""

    index: int
    k: int
    drafted: int
    accepted: int
    bonus: bool
    draft_ms: float
    verify_ms: float
    # Serialized size of the cycle's drafts and their q on the wire.
    draft_bytes: int = 0
    # Drafted during the previous cycle's verification (pipelining).
    pipelined: bool = False
    # Of verify_ms: the target's forward passes, timed inside the target service.
    forward_ms: float = 0.0
    # The commit of the cycle's tokens to Redis.
    commit_ms: float = 0.0
    # The drafts were looked up in the coordinator (an n-gram draft, or --ngram-first),
    # not proposed by the draft service.
    looked_up: bool = False
    # Output tokens the cycle committed: accepted + 1 for a speculative one (fewer where the
    # output ended), several for a plain one that decoded several (the chunk's token_ids).
    tokens: int = 0


@dataclass
class Chunk:
    """Tokens committed by one cycle. `finish_reason` is set on the last chunk."""

    text: str
    token_ids: list[int]
    finish_reason: str | None
    stats: Stats
    cycle: CycleTrace | None
    session_id: str

    @classmethod
    def from_pb(cls, msg: pb.GenerateChunk) -> "Chunk":
        cycle = None
        if msg.HasField("cycle"):
            c = msg.cycle
            cycle = CycleTrace(
                c.index, c.k, c.drafted, c.accepted, c.bonus, c.draft_ms, c.verify_ms, c.draft_bytes, c.pipelined,
                c.forward_ms, c.commit_ms, c.looked_up, len(msg.token_ids),
            )  # fmt: skip
        return cls(
            text=msg.text,
            token_ids=list(msg.token_ids),
            finish_reason=FINISH_NAMES.get(msg.finish_reason),
            stats=Stats.from_pb(msg.stats),
            cycle=cycle,
            session_id=msg.session_id,
        )


@dataclass
class Result:
    """A finished generation: the generated text and token ids (never the prompt)."""

    text: str
    token_ids: list[int]
    finish_reason: str
    stats: Stats
    session_id: str
    cycles: list[CycleTrace] = field(default_factory=list)
    # Wall time the client measured, from sending the request to the last chunk.
    client_elapsed_s: float = 0.0

    def as_dict(self) -> dict:
        return {
            "text": self.text,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
            "stats": self.stats.as_dict(),
            "session_id": self.session_id,
        }


@dataclass(frozen=True)
class ModelInfo:
    """The model a draft or target service serves, as the coordinator adopted it (Client.info).
    Its sessions and cache are on the service's /metrics, live."""

    model: str  # name or path it loaded: catalog name, HF directory, GGUF file, or "ngram"
    kind: str  # "model" (a neural model) or "ngram" (prompt lookup)
    vocab_size: int
    vocab_fingerprint: str  # sha256 of the tokenizer's vocabulary: draft and target agree on it
    max_context: int  # positions the model attends to (0 = unbounded)
    eos_token_ids: tuple[int, ...]
    device: str
    dtype: str
    max_k: int  # the largest K the service takes in one request
    default_k: int  # a draft's own K, for requests that set none (0 = none)
    weights_fingerprint: str  # sha256 of a sample of each tensor: other weights, another distribution
    min_ngram: int  # for kind "ngram": the n-gram lengths it matches, shortest and longest (else 0)
    max_ngram: int

    @classmethod
    def from_pb(cls, msg: pb.ModelInfoResponse) -> "ModelInfo":
        return cls(
            model=msg.model, kind=msg.kind, vocab_size=msg.vocab_size, vocab_fingerprint=msg.vocab_fingerprint,
            max_context=msg.max_context, eos_token_ids=tuple(msg.eos_token_ids), device=msg.device, dtype=msg.dtype,
            max_k=msg.max_k, default_k=msg.default_k, weights_fingerprint=msg.weights_fingerprint,
            min_ngram=msg.min_ngram, max_ngram=msg.max_ngram,
        )  # fmt: skip


@dataclass(frozen=True)
class ServerInfo:
    """What a coordinator serves (Client.info): its target and draft, the K of a request that
    sets none, and the most tokens a request may ask for."""

    target: ModelInfo
    draft: ModelInfo
    default_num_speculative_tokens: int
    max_new_tokens_limit: int

    @classmethod
    def from_pb(cls, msg: pb.InfoResponse) -> "ServerInfo":
        return cls(ModelInfo.from_pb(msg.target), ModelInfo.from_pb(msg.draft), msg.default_num_speculative_tokens,
                   msg.max_new_tokens_limit)  # fmt: skip


def check_integers(name: str, values: Sequence, field: Range) -> None:
    """TypeError / ValueError naming the argument where one of `values` is no integer or lies
    outside the proto `field`'s range (ranges.INT32, UINT32); protobuf's own ("Value out of
    range: N", a bare TypeError) name none. Anything with __index__ is an integer (numpy's
    too), as protobuf takes it."""
    for value in values:
        try:
            number = operator.index(value)
        except TypeError:
            raise TypeError(f"{name} must be an integer, got {value!r}") from None
        if number not in field:
            kind = "32-bit integer" if field.low < 0 else "32-bit unsigned integer"
            raise ValueError(f"{name} holds {number}, which no request carries (a {kind} field)")


def check_text(name: str, text: str | None) -> None:
    """ValueError naming the argument when `text` cannot travel as a protobuf string (a byte
    that is not UTF-8: specdec.ranges.text_problem); protobuf's own UnicodeEncodeError names none."""
    if text and (problem := text_problem(name, text)):
        raise ValueError(problem)


def build_request(
    prompt: str | None,
    *,
    prompt_token_ids: Sequence[int] | None,
    max_new_tokens: int | None,
    temperature: float,
    top_k: int,
    top_p: float,
    seed: int | None,
    num_speculative_tokens: int | None,
    speculate: bool,
    stop: str | Sequence[str] | None,
    session_id: str | None,
    ignore_eos: bool,
    pipeline: bool | None = None,
    adaptive_k: bool = False,
    messages: Sequence[Mapping[str, str]] | None = None,
    affinity_key: str | None = None,
) -> pb.GenerateRequest:
    if sum(given is not None for given in (prompt, prompt_token_ids, messages)) != 1:
        raise ValueError("pass exactly one of prompt, prompt_token_ids and messages")
    if not all(isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in messages or []):
        raise ValueError('each message is a mapping with "role" and "content" strings, e.g. '
                         '{"role": "user", "content": "Hi"}')  # fmt: skip
    if isinstance(stop, str):  # one stop string, as OpenAI's API takes it (list("the") would be three)
        stop = [stop]
    for name, value in (("max_new_tokens", max_new_tokens), ("top_k", top_k), ("num_speculative_tokens", num_speculative_tokens)):
        check_integers(name, [] if value is None else [value], INT32)
    for name, number, allowed in (("temperature", temperature, TEMPERATURE), ("top_p", top_p, TOP_P)):
        if isinstance(number, (int, float)) and abs(number) > FLOAT32_MAX:  # protobuf would send inf
            raise ValueError(allowed.problem(name, number))
    ids = [] if prompt_token_ids is None else list(prompt_token_ids)  # a list, a tuple, a numpy array, ...
    check_integers("prompt_token_ids", ids, INT32)
    check_text("prompt", prompt)
    check_text("session_id", session_id)
    check_text("affinity_key", affinity_key)
    for i, message in enumerate(messages or []):
        check_text(f"messages[{i}] role", message["role"])
        check_text(f"messages[{i}] content", message["content"])
    for i, text in enumerate(stop or []):
        check_text(f"stop[{i}]", text)
        if not text:  # every coordinator refuses it
            raise ValueError(f"stop[{i}] is empty: a stop string must hold at least one character")
    request = pb.GenerateRequest(
        prompt=prompt or "",
        prompt_token_ids=[operator.index(i) for i in ids],
        messages=[pb.ChatMessage(role=m["role"], content=m["content"]) for m in messages or []],
        max_new_tokens=max_new_tokens,  # None leaves the field unset: the coordinator's default
        sampling=pb.SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p),
        stop=list(stop or []),
        speculation=pb.SpeculationParams(disabled=not speculate, adaptive=adaptive_k),
        session_id=session_id or "",
        ignore_eos=ignore_eos,
        affinity_key=affinity_key or "",
    )
    if seed is not None:
        if problem := SEED.problem("seed", seed):  # the server's own range; protobuf's is wider
            raise ValueError(problem)
        request.sampling.seed = seed
    if num_speculative_tokens is not None:
        request.speculation.num_speculative_tokens = num_speculative_tokens
    if pipeline is not None:
        request.speculation.pipeline = pipeline
    return request


def build_resume_request(session_id: str, received_tokens: int, received_chars: int) -> pb.ResumeRequest:
    """A caller's Resume, its arguments checked as build_request checks a Generate's."""
    check_text("session_id", session_id)
    check_integers("received_tokens", [received_tokens], UINT32)
    check_integers("received_chars", [received_chars], UINT32)
    return pb.ResumeRequest(session_id=session_id, received_tokens=received_tokens, received_chars=received_chars)


def headers_of(call):
    """The response headers a finished streaming call received (empty if none came), or None
    where the call cannot say: one wrapped, e.g. by OpenTelemetry's instrumentation."""
    try:
        return call.initial_metadata() or ()
    except AttributeError:
        return None
    except grpc.RpcError:
        return ()


async def headers_of_async(call):
    try:
        return await call.initial_metadata() or ()
    except AttributeError:
        return None
    except grpc.RpcError:
        return ()


def cut_by_close(resumption: "_Resumption | None" = None) -> "SpecdecClientError":
    """What a call cut by its client's close() raises, from either client: a stream's names its
    session where it had begun (client.resume takes it), as any other failed stream's does."""
    session_id = resumption.session_id if resumption is not None and resumption.began else None
    return SpecdecClientError(grpc.StatusCode.CANCELLED, CUT_BY_CLOSE, session_id)


def stop_call(call) -> None:
    """Cancel a streaming call (a no-op once it finished), so a caller that stops reading
    early frees the server. With OpenTelemetry's gRPC instrumentation the call is wrapped
    in a generator: closing that cancels the call it wraps."""
    stop = getattr(call, "cancel", None) or getattr(call, "close", None)
    if stop is not None:
        stop()


class _Collector:
    """Folds streamed chunks into a Result."""

    def __init__(self):
        self.started = time.perf_counter()
        self.text: list[str] = []
        self.ids: list[int] = []
        self.cycles: list[CycleTrace] = []
        self.last: Chunk | None = None

    def add(self, chunk: Chunk) -> None:
        self.text.append(chunk.text)
        self.ids.extend(chunk.token_ids)
        if chunk.cycle is not None:
            self.cycles.append(chunk.cycle)
        self.last = chunk

    def result(self) -> Result:
        if self.last is None:
            raise SpecdecClientError(grpc.StatusCode.INTERNAL, "the server ended the stream without a chunk")
        return Result(
            text="".join(self.text),
            token_ids=self.ids,
            finish_reason=self.last.finish_reason or "length",
            stats=self.last.stats,
            session_id=self.last.session_id,
            cycles=self.cycles,
            client_elapsed_s=time.perf_counter() - self.started,
        )


class GenerateOptions(TypedDict, total=False):
    """The keyword arguments of generate_stream, which generate takes as **options: a type
    checker checks them there too (defaults and meanings: generate_stream)."""

    prompt_token_ids: Sequence[int] | None
    messages: Sequence[Mapping[str, str]] | None
    max_new_tokens: int | None
    temperature: float
    top_k: int
    top_p: float
    seed: int | None
    num_speculative_tokens: int | None
    speculate: bool
    stop: str | Sequence[str] | None
    timeout: float | None
    session_id: str | None
    ignore_eos: bool
    pipeline: bool | None
    adaptive_k: bool
    affinity_key: str | None


class ResumeOptions(TypedDict, total=False):
    """The keyword arguments of resume_stream, which resume takes as **options."""

    received_tokens: int
    received_chars: int
    timeout: float | None


_GENERATE_DOC = """
        Arguments:
            prompt: the text to continue, as it is (or pass prompt_token_ids or messages instead).
            messages: a conversation, [{"role": "user", "content": "..."}, ...], which the
                server renders with the target's chat template and answers as the assistant:
                what an instruct model expects (FAILED_PRECONDITION where it has no template).
            max_new_tokens: tokens to generate at most (None = the coordinator's default, its
                --default-max-new-tokens, 128 unless set, within its --max-new-tokens-limit).
            temperature: 0 is greedy; higher samples more freely.
            top_k: keep only the k most likely tokens (0 = off).
            top_p: keep the smallest set of tokens with this much mass (1.0 = off).
            seed: makes sampled output reproducible for a fixed K and setup (0 to 2**63 - 1).
            num_speculative_tokens: K, tokens drafted per cycle (None = server default).
            speculate: False decodes with the target alone, through the same services.
            stop: strings that end generation (or one string); the output ends before them.
            timeout: seconds for the whole call (a gRPC deadline).
            session_id: optional id for the session (unique); else one is made here (a uuid4).
                A stream that breaks is resumed under it (see `retries`).
            ignore_eos: keep generating past end-of-sequence tokens.
            pipeline: draft the next cycle while the target verifies (None = server default).
            adaptive_k: choose K per cycle to maximise expected tokens/s (0 when drafting
                loses); num_speculative_tokens is then the largest K.
            affinity_key: requests with the same key are served by the same draft and target
                replicas: pass a conversation's id with each of its turns, so that each finds
                the caches of the turn before (prefix reuse). None: spread by session id.

        ValueError, before anything is sent, for arguments no server would take: a seed out
        of range, not exactly one of prompt, prompt_token_ids and messages, a malformed message,
        or text (a prompt, message, stop string, session_id or affinity_key) holding a byte that
        is not UTF-8.
        """


class Client(_Stub):
    """Blocking client of the Coordinator service; also a context manager."""

    def __init__(
        self,
        address: str = DEFAULT_ADDRESS,
        *,
        tls_ca: str | None = None,
        token: str | None = None,
        credentials: grpc.ChannelCredentials | None = None,
        retries: int = DEFAULT_RETRIES,
        load_balancing: str = "round_robin",
    ):
        """Connect to the coordinator at `address`: host:port, or any gRPC target naming
        several coordinators (`ipv4:10.0.0.5:50051,10.0.0.6:50051`, `dns:///name:50051`).
        `tls_ca`: path of the PEM CA that signed the coordinator's certificate (TLS); `token`:
        API token sent with every call; `credentials`: full control over the channel's TLS
        (overrides tls_ca); `retries`: how often a call failing UNAVAILABLE before it began is
        sent again, and how often a stream failing UNAVAILABLE once begun is resumed where it
        broke (0 to 4, after a random wait of up to 0.2 s, 0.4 s, ...; see service_config and
        _Resumption); `load_balancing`: "round_robin" sends each call to the next ready
        coordinator the address names, "pick_first" every call to the first that answers."""
        self.address = address = address.strip()  # " host:port" pasted with its space
        self._metadata = auth_metadata(token)
        self.retries = retries
        credentials = channel_credentials(tls_ca, credentials)
        self._channel = open_channel(grpc, address, credentials, channel_options(address, retries, load_balancing))
        self._open_stub = pb_grpc.CoordinatorStub(self._channel)
        self._closing = threading.Event()  # set by close(): cuts a stream's wait before a Resume

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Close the channel; a call after it raises ValueError, and a call it cuts raises
        SpecdecClientError CANCELLED."""
        self._open_stub = None
        self._closing.set()
        self._channel.close()

    def generate_stream(
        self,
        prompt: str | None = None,
        *,
        prompt_token_ids: Sequence[int] | None = None,
        messages: Sequence[Mapping[str, str]] | None = None,
        max_new_tokens: int | None = None,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
        num_speculative_tokens: int | None = None,
        speculate: bool = True,
        stop: str | Sequence[str] | None = None,
        timeout: float | None = None,
        session_id: str | None = None,
        ignore_eos: bool = False,
        pipeline: bool | None = None,
        adaptive_k: bool = False,
        affinity_key: str | None = None,
    ) -> Iterator[Chunk]:
        request = build_request(
            prompt, prompt_token_ids=prompt_token_ids, max_new_tokens=max_new_tokens, temperature=temperature,
            top_k=top_k, top_p=top_p, seed=seed, num_speculative_tokens=num_speculative_tokens,
            speculate=speculate, stop=stop, session_id=session_id, ignore_eos=ignore_eos, pipeline=pipeline,
            adaptive_k=adaptive_k, messages=messages, affinity_key=affinity_key,
        )  # fmt: skip
        resumption = _Resumption(request.session_id or uuid.uuid4().hex, self.retries, timeout,
                                 own_id=not request.session_id)  # fmt: skip
        request.session_id = resumption.session_id
        call = self._stub.Generate(request, timeout=timeout, metadata=self._metadata)
        yield from self._follow(call, resumption)

    def _follow(self, call, resumption: _Resumption) -> Iterator[Chunk]:
        """The chunks of `call`, then of each Resume that goes on where it broke (_Resumption)."""
        while True:
            try:
                for msg in call:
                    yield resumption.saw(Chunk.from_pb(msg))
                return
            except grpc.RpcError as exc:
                if ended_whole(resumption.finished, exc):
                    return
                if self._open_stub is None:  # close() cut it (gRPC: CANCELLED "Channel closed!")
                    raise cut_by_close(resumption) from None
                if (resume := resumption.next_call(exc, headers_of(call))) is None:
                    raise resumption.error_of(exc) from None
            finally:
                stop_call(call)
            resume_request, wait, timeout = resume
            if self._closing.wait(wait) or self._open_stub is None:  # close() during the wait cuts the stream
                raise cut_by_close(resumption)
            call = self._stub.Resume(resume_request, timeout=timeout, metadata=self._metadata)

    generate_stream.__doc__ = "Yield a Chunk per cycle as the server commits it.\n" + _GENERATE_DOC

    def resume_stream(self, session_id: str, *, received_tokens: int = 0, received_chars: int = 0,
                      timeout: float | None = None) -> Iterator[Chunk]:  # fmt: skip
        """Go on with the session `session_id` (a Chunk's session_id, or the id you chose) after
        its stream broke: yield a Chunk of what it committed after the first `received_tokens`
        output tokens and `received_chars` characters of text you have, then a Chunk per cycle
        until it finishes (at once, if it had). generate_stream resumes by itself; this is for a
        process that starts over. It resumes by itself too, as generate_stream does: a stream that
        breaks UNAVAILABLE is resumed where it broke, up to `retries` times. NOT_FOUND for an
        unknown or expired session, OUT_OF_RANGE when you claim more than it committed,
        FAILED_PRECONDITION from a coordinator of another target, PERMISSION_DENIED where the
        session was created with another API token."""
        request = build_resume_request(session_id, received_tokens, received_chars)
        resumption = _Resumption(session_id, self.retries, timeout, tokens=received_tokens, chars=received_chars,
                                 began=True)  # fmt: skip
        call = self._stub.Resume(request, timeout=timeout, metadata=self._metadata)
        yield from self._follow(call, resumption)

    def resume(self, session_id: str, **options: Unpack[ResumeOptions]) -> Result:
        """Resume and return the rest as a Result (same arguments as resume_stream)."""
        collector = _Collector()
        for chunk in self.resume_stream(session_id, **options):
            collector.add(chunk)
        return collector.result()

    def generate(self, prompt: str | None = None, **options: Unpack[GenerateOptions]) -> Result:
        """Generate and return the whole Result (same arguments as generate_stream)."""
        collector = _Collector()
        for chunk in self.generate_stream(prompt, **options):
            collector.add(chunk)
        return collector.result()

    def delete(self, session_id: str, timeout: float | None = 10.0) -> bool:
        """Delete the session `session_id` now instead of when it expires (the services'
        --session-ttl after its last use, an hour by default): its record, prompt and tokens
        leave Redis and the model services drop its caches; a stream of it still running ends
        NOT_FOUND. True if it existed; False if not
        (expired, deleted already, or never created), or if another session was created under
        its id while the call checked it (that one is left alone). PERMISSION_DENIED where the session was
        created with another API token, as for resume. Behind a coordinator run with
        --redis-wait-replicas it answers once Redis's replicas hold the deletion too, and
        raises UNAVAILABLE when they do not in time (it is gone from the Redis master then:
        delete again once the replicas are back; False then confirms it)."""
        check_text("session_id", session_id)
        check_timeout(timeout)
        try:
            reply = self._stub.Delete(pb.DeleteRequest(session_id=session_id), timeout=timeout, metadata=self._metadata)
        except grpc.RpcError as exc:
            raise SpecdecClientError(exc.code(), exc.details() or "") from None
        return reply.deleted

    def info(self, timeout: float | None = 10.0) -> ServerInfo:
        """The models the stack serves (target and draft) and its request defaults, as the
        coordinator reports them."""
        check_timeout(timeout)
        try:
            return ServerInfo.from_pb(self._stub.Info(pb.InfoRequest(), timeout=timeout, metadata=self._metadata))
        except grpc.RpcError as exc:
            raise SpecdecClientError(exc.code(), exc.details() or "") from None


class AsyncClient(_Stub):
    """asyncio client of the Coordinator service; the same methods as Client, awaited.

    Its channel opens at its first call, in the event loop running that call (a grpc.aio
    channel belongs to one loop), so an AsyncClient may be made outside any loop, e.g. before
    asyncio.run; it used to open the channel at once, and a client made outside the loop that
    used it failed there with gRPC's RuntimeError "... attached to a different loop". A call
    from another loop than the first call's is refused with a RuntimeError saying so.

    A call its client's close() cuts raises SpecdecClientError CANCELLED, as Client's does; a
    cancel() of the task awaiting the call still raises asyncio.CancelledError."""

    def __init__(
        self,
        address: str = DEFAULT_ADDRESS,
        *,
        tls_ca: str | None = None,
        token: str | None = None,
        credentials: grpc.ChannelCredentials | None = None,
        retries: int = DEFAULT_RETRIES,
        load_balancing: str = "round_robin",
    ):
        """Connect to the coordinator(s) at `address`; the arguments are Client's. The channel
        opens at the first call (see the class); a bad argument is refused here, at once."""
        self.address = address = address.strip()  # " host:port" pasted with its space
        self._metadata = auth_metadata(token)
        self.retries = retries
        self._credentials = channel_credentials(tls_ca, credentials)
        self._options = channel_options(address, retries, load_balancing)
        self._channel: grpc.aio.Channel | None = None  # opened by the first call (_stub)
        self._open_stub = None
        self._loop: asyncio.AbstractEventLoop | None = None  # the event loop the channel belongs to
        self._closed = False
        self._closing = asyncio.Event()  # set by close(): cuts a stream's wait before a Resume

    @property
    def _stub(self) -> pb_grpc.CoordinatorStub:
        """The stub, its channel opened in the running event loop at the first call."""
        if self._closed:
            raise self._closed_error()
        loop = asyncio.get_running_loop()
        if self._open_stub is None:
            self._channel = open_channel(grpc.aio, self.address, self._credentials, self._options)
            self._open_stub = stub = pb_grpc.CoordinatorStub(self._channel)
            self._loop = loop
            return stub
        if loop is not self._loop:
            raise RuntimeError("this specdec.AsyncClient was first used in another event loop, which its channel "
                               "belongs to: make an AsyncClient in each event loop (each asyncio.run) that calls")  # fmt: skip
        return self._open_stub

    @contextlib.contextmanager
    def _cut_by_close(self, resumption: _Resumption | None = None):
        """Raise SpecdecClientError CANCELLED where this client's close() cut the call within (it
        cancels the channel's calls, which grpc.aio ends in asyncio.CancelledError), as Client
        does; a cancel() of the task awaiting the call goes on as CancelledError."""
        try:
            yield
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if self._closed and task is not None and not task.cancelling():
                raise cut_by_close(resumption) from None
            raise

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the channel; a call after it raises ValueError, and a call it cuts raises
        SpecdecClientError CANCELLED."""
        self._closed = True
        self._closing.set()
        if self._channel is not None:
            await self._channel.close()

    async def generate_stream(
        self,
        prompt: str | None = None,
        *,
        prompt_token_ids: Sequence[int] | None = None,
        messages: Sequence[Mapping[str, str]] | None = None,
        max_new_tokens: int | None = None,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
        num_speculative_tokens: int | None = None,
        speculate: bool = True,
        stop: str | Sequence[str] | None = None,
        timeout: float | None = None,
        session_id: str | None = None,
        ignore_eos: bool = False,
        pipeline: bool | None = None,
        adaptive_k: bool = False,
        affinity_key: str | None = None,
    ) -> AsyncIterator[Chunk]:
        request = build_request(
            prompt, prompt_token_ids=prompt_token_ids, max_new_tokens=max_new_tokens, temperature=temperature,
            top_k=top_k, top_p=top_p, seed=seed, num_speculative_tokens=num_speculative_tokens,
            speculate=speculate, stop=stop, session_id=session_id, ignore_eos=ignore_eos, pipeline=pipeline,
            adaptive_k=adaptive_k, messages=messages, affinity_key=affinity_key,
        )  # fmt: skip
        resumption = _Resumption(request.session_id or uuid.uuid4().hex, self.retries, timeout,
                                 own_id=not request.session_id)  # fmt: skip
        request.session_id = resumption.session_id
        call = self._stub.Generate(request, timeout=timeout, metadata=self._metadata)
        # A stream closed (aclose, or abandoned in an `async with aclosing`) cancels its call now,
        # not when the loop finalizes the inner generator: the coordinator went on generating.
        async with contextlib.aclosing(self._follow(call, resumption)) as chunks:
            async for chunk in chunks:
                yield chunk

    async def _follow(self, call, resumption: _Resumption) -> AsyncGenerator[Chunk, None]:
        """Client._follow, awaited."""
        while True:
            try:
                with self._cut_by_close(resumption):
                    async for msg in call:
                        yield resumption.saw(Chunk.from_pb(msg))
                return
            except grpc.aio.AioRpcError as exc:
                if ended_whole(resumption.finished, exc):
                    return
                if (resume := resumption.next_call(exc, await headers_of_async(call))) is None:
                    raise resumption.error_of(exc) from None
            finally:
                stop_call(call)
            resume_request, wait, timeout = resume
            with contextlib.suppress(TimeoutError):  # close() during the wait cuts the stream, as it cuts a call
                await asyncio.wait_for(self._closing.wait(), wait)
            if self._closed:
                raise cut_by_close(resumption)
            call = self._stub.Resume(resume_request, timeout=timeout, metadata=self._metadata)

    generate_stream.__doc__ = "Yield a Chunk per cycle as the server commits it.\n" + _GENERATE_DOC

    async def resume_stream(self, session_id: str, *, received_tokens: int = 0, received_chars: int = 0,
                            timeout: float | None = None) -> AsyncIterator[Chunk]:  # fmt: skip
        """Client.resume_stream, awaited."""
        request = build_resume_request(session_id, received_tokens, received_chars)
        resumption = _Resumption(session_id, self.retries, timeout, tokens=received_tokens, chars=received_chars,
                                 began=True)  # fmt: skip
        call = self._stub.Resume(request, timeout=timeout, metadata=self._metadata)
        async with contextlib.aclosing(self._follow(call, resumption)) as chunks:
            async for chunk in chunks:
                yield chunk

    async def resume(self, session_id: str, **options: Unpack[ResumeOptions]) -> Result:
        """Resume and return the rest as a Result (same arguments as resume_stream)."""
        collector = _Collector()
        async for chunk in self.resume_stream(session_id, **options):
            collector.add(chunk)
        return collector.result()

    async def generate(self, prompt: str | None = None, **options: Unpack[GenerateOptions]) -> Result:
        """Generate and return the whole Result (same arguments as generate_stream)."""
        collector = _Collector()
        async for chunk in self.generate_stream(prompt, **options):
            collector.add(chunk)
        return collector.result()

    async def delete(self, session_id: str, timeout: float | None = 10.0) -> bool:
        """Client.delete, awaited."""
        check_text("session_id", session_id)
        check_timeout(timeout)
        try:
            with self._cut_by_close():
                reply = await self._stub.Delete(pb.DeleteRequest(session_id=session_id), timeout=timeout,
                                                metadata=self._metadata)  # fmt: skip
        except grpc.aio.AioRpcError as exc:
            raise SpecdecClientError(exc.code(), exc.details() or "") from None
        return reply.deleted

    async def info(self, timeout: float | None = 10.0) -> ServerInfo:
        """Client.info, awaited."""
        check_timeout(timeout)
        try:
            with self._cut_by_close():
                return ServerInfo.from_pb(await self._stub.Info(pb.InfoRequest(), timeout=timeout, metadata=self._metadata))
        except grpc.aio.AioRpcError as exc:
            raise SpecdecClientError(exc.code(), exc.details() or "") from None
