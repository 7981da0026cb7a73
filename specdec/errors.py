"""Errors that cross a gRPC boundary, and the one place they become status codes.

Core code raises plain Python exceptions (ValueError for bad input, the
`SpecdecError` subclasses below for the rest). Handlers never build status
codes themselves: `grpc_handler` wraps each RPC method and maps whatever it
raises through `status_for`, so a given failure always reaches the client with
the same code and a message the user can act on.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging

import grpc
import redis.exceptions

log = logging.getLogger("specdec")


class SpecdecError(Exception):
    """Base of errors that carry their own gRPC status code."""

    code = grpc.StatusCode.INTERNAL


class InvalidArgument(SpecdecError, ValueError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(SpecdecError):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(SpecdecError):
    code = grpc.StatusCode.ALREADY_EXISTS


class FailedPrecondition(SpecdecError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class Aborted(SpecdecError):
    """A fenced write lost: the session moved on (stale or duplicated cycle)."""

    code = grpc.StatusCode.ABORTED


class OutOfRange(SpecdecError):
    code = grpc.StatusCode.OUT_OF_RANGE


class ResourceExhausted(SpecdecError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(SpecdecError):
    code = grpc.StatusCode.UNAVAILABLE


class WorkerWedged(Unavailable):
    """A model service's worker runs a pass past its --pass-timeout (serving.ModelWorker)."""


class SessionRecreated(SpecdecError):
    """A model service held a session whose id has since been deleted (or expired) and created
    again: its cache is of the earlier session's tokens. Dropped; the call is to be sent again.
    ABORTED, not UNAVAILABLE: the coordinator takes UNAVAILABLE for a replica lost and skips it,
    every session on it with it, where only this session's state was stale."""

    code = grpc.StatusCode.ABORTED


class Unauthenticated(SpecdecError):
    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(SpecdecError):
    code = grpc.StatusCode.PERMISSION_DENIED


class UnusableLogits(SpecdecError, ValueError):
    """Logits no token can be drawn from (NaN, +inf, or -inf everywhere). Passed in by a library
    caller, a ValueError like any bad argument; computed by a service's own model (broken
    weights, or values past its dtype's range), the service's fault, not the request's: INTERNAL,
    where a ValueError would have told the caller to fix its request (INVALID_ARGUMENT)."""

    code = grpc.StatusCode.INTERNAL


class MalformedRequest:
    """What a request deserializer returns for bytes that are not the expected message;
    `grpc_handler` turns it into INVALID_ARGUMENT (gRPC itself would answer INTERNAL)."""

    def __init__(self, message_name: str, reason: str):
        self.message_name = message_name
        self.reason = reason

    def error(self) -> InvalidArgument:
        return InvalidArgument(f"the request is not a valid {self.message_name} message: {self.reason}")


# A Redis Cluster between states (a node down, a failover, a slot moving), past the client's
# redirects: retry shortly. (A cross-slot command would be our bug: not in this list.)
CLUSTER_IN_FLUX = (
    redis.exceptions.ClusterError, redis.exceptions.AskError, redis.exceptions.TryAgainError,
    redis.exceptions.RedisClusterException,
)  # fmt: skip


# Calls Redis refuses for its own state or settings, not for ours, found by the words of its
# error (redis-py's OutOfMemoryError or ReadOnlyError, or the same error inside a script's
# ResponseError: "... -OOM command not allowed ..."; Redis 7's reach redis-py as the error class
# without the code, "command not allowed when used memory > 'maxmemory'", hence words the
# versions share), and what the caller is told. Redis refuses a script at its first write, so
# nothing of a refused one is written: a session stays as its last commit left it.
REDIS_REFUSALS = (
    # The URL's /DB is not below the server's `databases`: every call fails.
    ("DB index is out of range", grpc.StatusCode.UNAVAILABLE,
     "the session store (Redis) has no database of the number its URL ends in: the number after the last / "
     "of the URL (--redis-url, SPECDEC_REDIS_URL) must be below Redis's `databases` setting (16 by default)"),
    # maxmemory reached with policy noeviction, as the k8s manifests run it.
    ("command not allowed when used memory", grpc.StatusCode.RESOURCE_EXHAUSTED,
     "the session store (Redis) is full: past its maxmemory it refuses new sessions and new tokens until "
     "sessions expire (an hour after they end) or are deleted, or its maxmemory is raised; the tokens a "
     "session committed stand, so resume it then"),
    # The last snapshot failed (its disk full or unwritable) and stop-writes-on-bgsave-error is on.
    ("MISCONF", grpc.StatusCode.UNAVAILABLE,
     "the session store (Redis) refuses writes because it could not save its snapshot to disk (MISCONF: "
     "see its log; a full or unwritable disk, say) until a save succeeds; the tokens a session committed "
     "stand, so resume it then"),
    # min-replicas-to-write set, and fewer replicas in reach (Redis's own --redis-wait-replicas).
    ("NOREPLICAS", grpc.StatusCode.UNAVAILABLE,
     "the session store (Redis) refuses writes while fewer of its replicas are in reach than its "
     "min-replicas-to-write asks for; the tokens a session committed stand, so resume it then"),
    # A master demoted while a failover runs, or a --redis-url naming a replica.
    ("You can't write against a read only replica", grpc.StatusCode.UNAVAILABLE,
     "the session store (Redis) answering is a read-only replica: a failover is under way (retry shortly), "
     "or the coordinator's --redis-url names a replica instead of its master"),
)  # fmt: skip


def redis_refusal(exc: BaseException) -> tuple[grpc.StatusCode, str] | None:
    """(status code, message) when `exc` is one of REDIS_REFUSALS, else None."""
    if isinstance(exc, redis.exceptions.ResponseError):
        for words, code, message in REDIS_REFUSALS:
            if words in str(exc):
                return code, message
    return None


# What torch's RuntimeErrors say when memory ran out: its CPU allocator ("DefaultCPUAllocator:
# can't allocate memory: you tried to allocate N bytes"), and on a GPU what a kernel or library
# reports outside torch's own allocator ("CUDA error: out of memory", cuBLAS's and cuDNN's
# "..._STATUS_ALLOC_FAILED", a torch.AcceleratorError or plain RuntimeError).
OUT_OF_MEMORY_WORDS = ("can't allocate memory", "out of memory", "STATUS_ALLOC_FAILED")


def is_out_of_memory(exc: BaseException) -> bool:
    """Python's MemoryError, or an allocation torch could not make: torch.OutOfMemoryError on a
    GPU, or a RuntimeError saying so (OUT_OF_MEMORY_WORDS), which used to end a call INTERNAL."""
    if isinstance(exc, MemoryError):
        return True
    # torch's OutOfMemoryError is a RuntimeError; redis-py's of the same name is not (a full Redis).
    return isinstance(exc, RuntimeError) and (
        type(exc).__name__ == "OutOfMemoryError" or any(words in str(exc) for words in OUT_OF_MEMORY_WORDS)
    )


# How every refusal of a service for its session store begins (status_for, REDIS_REFUSALS).
STORE_FAULT_WORDS = "session store (Redis"


def is_store_fault(exc: grpc.aio.AioRpcError) -> bool:
    """True for a model service's UNAVAILABLE that names its session store (Redis unreachable,
    failing over, refusing writes or its credentials): the service is up, its Redis is not, so
    the replica is no more lost than any other; the coordinator skipped it for 5 s and moved every
    session on it as for a replica down."""
    return exc.code() == grpc.StatusCode.UNAVAILABLE and STORE_FAULT_WORDS in (exc.details() or "")


def status_for(exc: BaseException, quiet: bool = False) -> tuple[grpc.StatusCode, str]:
    """Map an exception raised while serving an RPC to (status code, message); an unforeseen
    one (INTERNAL) is logged with its traceback, unless `quiet` (it will be, where it is raised)."""
    if isinstance(exc, SpecdecError):
        if exc.code == grpc.StatusCode.INTERNAL and not quiet:
            log.error("%s", exc)  # this service's own fault: its log says so, without a traceback
        return exc.code, str(exc)
    if isinstance(exc, (ValueError, TypeError)):
        # Validation in the core raises ValueError; its message is meant for users.
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, redis.exceptions.AuthenticationError):  # Redis's words, never the URL's password
        return grpc.StatusCode.UNAVAILABLE, (
            f"the session store (Redis) refused this service's credentials ({exc}): its Redis URL "
            "(--redis-url, SPECDEC_REDIS_URL) must carry them, redis://[USER]:PASSWORD@HOST:PORT/DB"
        )
    if isinstance(exc, (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)):
        return grpc.StatusCode.UNAVAILABLE, f"session store (Redis) unreachable: {exc}"
    if isinstance(exc, CLUSTER_IN_FLUX):
        return grpc.StatusCode.UNAVAILABLE, f"session store (Redis Cluster) failing over or moving slots: {exc}"
    if isinstance(exc, grpc.aio.AioRpcError):
        if exc.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
            # This service's own credential was refused: passed on, it told a caller whose token was
            # accepted that it was not. A deployment's fault, for its operator's log.
            if not quiet:
                log.error("a downstream service refused this service's credential: %s", exc.details())
            return grpc.StatusCode.INTERNAL, (
                f"a downstream service refused this service's credential (the internal token or TLS "
                f"certificate the services share differs; not the caller's): {exc.details()}"
            )
        # A downstream call failed: pass its code on, say which hop it was.
        return exc.code(), f"downstream call failed: {exc.details()}"
    if (refused := redis_refusal(exc)) is not None:
        return refused
    if is_out_of_memory(exc):
        log.warning("out of memory while serving a request: %s", exc)
        return grpc.StatusCode.RESOURCE_EXHAUSTED, f"out of memory while serving the request: {exc}"
    if not quiet:
        log.exception("internal error", exc_info=exc)
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"


async def _abort(context: grpc.aio.ServicerContext, exc: BaseException) -> None:
    code, message = status_for(exc)
    await context.abort(code, message)


def grpc_handler(method):
    """Decorate a grpc.aio servicer method (unary or server-streaming) so that any
    exception becomes the status `status_for` chooses, and a request that did not parse
    (a MalformedRequest) becomes INVALID_ARGUMENT. Cancellation passes through."""
    if inspect.isasyncgenfunction(method):

        @functools.wraps(method)
        async def stream_wrapper(self, request, context):
            try:
                if isinstance(request, MalformedRequest):
                    raise request.error()
                async for item in method(self, request, context):
                    yield item
            except (asyncio.CancelledError, grpc.aio.AbortError):
                raise
            except Exception as exc:  # noqa: BLE001 - this is the one mapping point
                await _abort(context, exc)

        return stream_wrapper

    @functools.wraps(method)
    async def unary_wrapper(self, request, context):
        try:
            if isinstance(request, MalformedRequest):
                raise request.error()
            return await method(self, request, context)
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as exc:  # noqa: BLE001 - this is the one mapping point
            await _abort(context, exc)

    return unary_wrapper
