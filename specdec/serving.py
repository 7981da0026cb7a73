"""What every specdec gRPC server shares: options, health, reflection, security,
request parsing, lifecycle.

`run` starts a grpc.aio server with the standard health service reporting
NOT_SERVING, calls `load()` off the event loop (model loading takes seconds),
flips health to SERVING, and serves until SIGTERM/SIGINT; then it reports
NOT_SERVING, stops accepting calls and lets running ones finish within `grace_s`.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from specdec import telemetry
from specdec.catalog import USER_LOAD_ERRORS
from specdec.client import CHANNEL_OPTIONS, GRPC_OPTIONS
from specdec.errors import FailedPrecondition, MalformedRequest, WorkerWedged
from specdec.metrics import serve_metrics
from specdec.ranges import DEFAULT_DRAIN_S, join_host_port
from specdec.security import ChannelSecurity, ServerSecurity, TokenChannel
from specdec.v1 import specdec_pb2 as pb

log = logging.getLogger("specdec")

CLIENT_OPTIONS = GRPC_OPTIONS + CHANNEL_OPTIONS  # a replaced service is picked up within a second

COORDINATOR_SERVICE = pb.DESCRIPTOR.services_by_name["Coordinator"].full_name
DRAFT_SERVICE = pb.DESCRIPTOR.services_by_name["Draft"].full_name
TARGET_SERVICE = pb.DESCRIPTOR.services_by_name["Target"].full_name


class ModelWorker:
    """One thread that runs all model work of a service, off the event loop.

    A single thread keeps forwards from competing for the CPU cores and for one
    session's KV cache; the event loop stays free for network I/O meanwhile.

    Terms:
        job      one call of `run`: a function run on the thread (a pass, a prefill chunk).
        chunks   a job's size in prefill chunks (kvcache.PREFILL_CHUNK tokens each, at least 1):
                 a pass over 8 sessions' last 256-token chunks is 8, a decoding step 1.
        limit    how long a job may run: `pass_timeout_s` per chunk (0: no limit; set once the
                 model is loaded, since loading is no pass).
        wedged   the running job is past its limit: a hung device or driver, as far as anyone
                 outside can tell. Until that job ends, every job waiting for the thread (the
                 wedged one's caller too) ends in WorkerWedged and new ones are refused with it
                 at once, so calls end UNAVAILABLE, which the coordinator answers by asking
                 another replica, where they used to wait for ever. A caller that gets
                 WorkerWedged may have a pass still writing its session: it drops the session
                 rather than undo its work (model_service.ModelService.session).
    """

    def __init__(self, name: str, pass_timeout_s: float = 0.0):
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self.pass_timeout_s = pass_timeout_s
        # (time.monotonic() the running job began, its limit in seconds, its chunks); None while idle.
        self.running: tuple[float, float, int] | None = None

    async def run(self, fn, *args, chunks: int = 1):
        """fn(*args) on the thread. Cancelled, the caller waits for a job that has begun (a
        forward cannot be interrupted, and it changes the session the caller then releases),
        however often it is cancelled, then the cancellation goes on; a job not begun never
        runs. WorkerWedged once the worker is wedged (class doc) and this job is not done."""
        self.refuse_if_wedged()
        job = self.executor.submit(self.timed, chunks, fn, *args)
        done = asyncio.wrap_future(job)
        done.add_done_callback(retrieve)  # its error is raised below, or nobody waits for it any more
        cancelled = False
        while not job.done() and self.wedged() is None:
            try:
                await asyncio.wait([done], timeout=self.until_wedged())
            except asyncio.CancelledError:
                cancelled = True
                if job.cancel():
                    raise
        if not job.done():
            job.cancel()
            raise WorkerWedged(self.wedged_message(self.wedged()))
        if cancelled:
            await wait_out(done)  # the job is done: its result is on its way
            raise asyncio.CancelledError
        return await done

    def timed(self, chunks: int, fn, *args):
        """Run `fn` on the thread, kept in `running` (see `wedged`)."""
        self.running = (time.monotonic(), self.pass_timeout_s * chunks, chunks)
        try:
            return fn(*args)
        finally:
            self.running = None

    def until_wedged(self) -> float | None:
        """Seconds until the running job is past its limit, or until any job beginning from now
        on could be (pass_timeout_s), whichever is sooner; None: never."""
        if self.pass_timeout_s <= 0:
            return None
        running = self.running
        left = self.pass_timeout_s if running is None else running[1] - (time.monotonic() - running[0])
        return max(0.01, min(left, self.pass_timeout_s) + 0.01)

    def running_s(self) -> float:
        """Seconds the running job has run; 0 while idle."""
        running = self.running
        return 0.0 if running is None else time.monotonic() - running[0]

    def wedged(self) -> str | None:
        """Why the worker takes no job now (class doc: wedged), or None."""
        running = self.running
        if self.pass_timeout_s <= 0 or running is None:
            return None
        began, limit, chunks = running
        if (seconds := time.monotonic() - began) <= limit:
            return None
        over, times = (f" the size of {chunks} prefill chunks", f"{chunks} × ") if chunks > 1 else ("", "")
        return (f"one forward pass{over} has run for {seconds:.0f} s, past {times}--pass-timeout "
                f"{self.pass_timeout_s:g} s: a hung device or driver?")  # fmt: skip

    def wedged_message(self, reason: str | None) -> str:
        """WorkerWedged's message for `reason` (None: the wedged pass ended just now)."""
        reason = reason or f"a forward pass ran past its --pass-timeout {self.pass_timeout_s:g} s"
        return (f"this replica's model worker is wedged ({reason}); it refuses every call until that pass ends: "
                "ask another replica")  # fmt: skip

    def refuse_if_wedged(self) -> None:
        if (reason := self.wedged()) is not None:
            raise WorkerWedged(self.wedged_message(reason))

    def shutdown(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)


def retrieve(future: asyncio.Future) -> None:
    """Mark `future`'s exception as seen (asyncio logs one never retrieved)."""
    if not future.cancelled():
        future.exception()


async def wait_out(future: asyncio.Future) -> None:
    """Wait until `future` is done, however often the waiting task is cancelled meanwhile: a
    second cancellation used to end the wait at once, and the caller then released (and
    rolled back) a session whose forward was still writing to it, so the next call on it
    verified after the wrong context."""
    while not future.done():
        try:
            await asyncio.wait([future])
        except asyncio.CancelledError:
            continue


# How often a loaded service asks whether it is wedged (ModelWorker.wedged) for its health.
HEALTH_CHECK_S = 1.0

# gRPC sets SO_REUSEPORT on Linux by default, so a second server on a port already served
# binds without error and the kernel splits the connections between the two (a second
# `specdec up` on 50051 would take half of the first one's clients); off, it is refused.
# A client's keepalive pings (specdec.client.KEEPALIVE_OPTIONS, in GRPC_OPTIONS: every 10 s) are
# welcome even while no data flows; gRPC's default, one each 5 minutes, counts more as abuse and
# drops the connection. The servers ping their clients as often, while a call runs: a client that
# vanished (a laptop closed, a network cut) has its calls cancelled within ~15 s, which stops
# their generation.
SERVER_OPTIONS = GRPC_OPTIONS + [
    ("grpc.so_reuseport", 0),
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
]


def create_server(interceptors=()) -> grpc.aio.Server:
    return grpc.aio.server(options=SERVER_OPTIONS, interceptors=list(interceptors))


def channel(address: str, security: ChannelSecurity | None = None, server_name: str = "") -> grpc.aio.Channel:
    """An aio channel to `address`: TLS when `security` names a CA, and its token on every call.
    `server_name`: the name the server's certificate must hold, where `address` is an IP that
    a name resolved to (coordinator.replicas)."""
    security = security or ChannelSecurity()
    credentials = security.credentials()
    if credentials is None:
        opened = grpc.aio.insecure_channel(address, options=CLIENT_OPTIONS)
    else:
        named = [("grpc.ssl_target_name_override", server_name)] if server_name else []
        opened = grpc.aio.secure_channel(address, credentials, options=CLIENT_OPTIONS + named)
    return TokenChannel(opened, security) if security.sends_token else opened


def parse_request(message_class):
    """A request deserializer that never raises: bytes that are not a `message_class`
    become a MalformedRequest, which `grpc_handler` answers with INVALID_ARGUMENT."""

    def parse(data: bytes):
        try:
            return message_class.FromString(data)
        except (DecodeError, ValueError, RuntimeError) as exc:
            return MalformedRequest(message_class.DESCRIPTOR.full_name, str(exc) or type(exc).__name__)

    return parse


def add_service(server: grpc.aio.Server, service_name: str, servicer) -> None:
    """Register `servicer`'s methods for the specdec.v1 service `service_name`
    (what the generated add_*_to_server does, with `parse_request` deserializers)."""
    service = pb.DESCRIPTOR.services_by_name[service_name.rsplit(".", 1)[-1]]
    handlers = {}
    for method in service.methods:
        request_class = getattr(pb, method.input_type.name)
        response_class = getattr(pb, method.output_type.name)
        make = grpc.unary_stream_rpc_method_handler if method.server_streaming else grpc.unary_unary_rpc_method_handler
        handlers[method.name] = make(
            getattr(servicer, method.name),
            request_deserializer=parse_request(request_class),
            response_serializer=response_class.SerializeToString,
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
    server.add_registered_method_handlers(service.full_name, handlers)


async def run(
    *,
    name: str,
    host: str,
    port: int,
    service_names: Sequence[str],
    servicer,
    load: Callable[[], Awaitable[None]],
    close: Callable[[], Awaitable[None]] | None = None,
    grace_s: float = DEFAULT_DRAIN_S,
    metrics_registry=None,
    metrics_port: int = 0,
    security: ServerSecurity | None = None,
    credential: str = "a token",
    wedged: Callable[[], str | None] | None = None,
) -> None:
    """Serve until a termination signal; see the module docstring for the order of steps.
    `wedged`: why the service cannot serve now (ModelWorker.wedged), looked at every
    HEALTH_CHECK_S once loaded: health says NOT_SERVING while it names a reason.
    `servicer` serves every service of `service_names`; `security` says how calls are
    secured (TLS, mTLS) and authenticated (bearer tokens naming `credential`).
    Call telemetry.setup_tracing before this (and before making channels or Redis clients)."""
    security = security or ServerSecurity()
    credentials = security.credentials()
    server = create_server(security.interceptors(credential, metrics_registry))
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection([*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    for service_name in service_names:
        add_service(server, service_name, servicer)
    address = join_host_port(host, port)
    try:  # grpcio returns 0 or raises RuntimeError, by version, for an address it cannot bind
        bound = server.add_insecure_port(address) if credentials is None else server.add_secure_port(address, credentials)
    except RuntimeError:
        bound = 0
    if bound == 0:
        tls = "" if credentials is None else "; or the TLS certificate and key do not belong together"
        raise SystemExit(f"{name}: cannot listen on {address}: the port is taken (another service or stack "
                         f"serves there?) or the host is not an address of this machine; pass another --port{tls}")  # fmt: skip
    address = join_host_port(host, bound)  # --port 0: the free port the system picked
    if metrics_registry is not None and metrics_port:  # before the server starts: a taken port ends us cleanly
        try:
            serve_metrics(metrics_registry, metrics_port, host)
        except OSError as exc:
            raise SystemExit(f"{name}: cannot serve metrics on {join_host_port(host, metrics_port)}: {exc.strerror}; pass another "
                             "--metrics-port (specdec up: --metrics-port-base), or 0 for none") from None  # fmt: skip
        log.info("%s metrics on http://%s/metrics", name, join_host_port(host, metrics_port))
    await set_health(health_servicer, service_names, health_pb2.HealthCheckResponse.NOT_SERVING)
    await server.start()
    log.info("%s listening on %s (%s), loading", name, address, describe(security))

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    load_task = asyncio.create_task(load())
    stop_task = asyncio.create_task(stop.wait())
    done, _ = await asyncio.wait({load_task, stop_task}, return_when=asyncio.FIRST_COMPLETED)
    if load_task in done:
        if (error := load_task.exception()) is not None:  # a failed load ends the process, saying why
            await server.stop(0)
            raise SystemExit(load_failed(name, error))
        await set_health(health_servicer, service_names, health_pb2.HealthCheckResponse.SERVING)
        log.info("%s serving on %s", name, address)
        print(f"{name} serving on {address}", flush=True)
        watching = asyncio.create_task(watch_health(name, health_servicer, service_names, wedged)) if wedged else None
        await stop.wait()
        if watching is not None:
            watching.cancel()
    else:
        load_task.cancel()

    log.info("%s shutting down", name)
    await set_health(health_servicer, service_names, health_pb2.HealthCheckResponse.NOT_SERVING)
    await server.stop(grace_s)
    if close is not None:
        await close()
    telemetry.shutdown_tracing()


def load_failed(name: str, exc: BaseException) -> str:
    """The process's last line when `load()` failed. A user's error (a model path that is
    not there or not loadable, a draft for another vocabulary, a catalog model it cannot fetch
    or cache: catalog.USER_LOAD_ERRORS; a coordinator's model services that never became ready
    within --startup-timeout: FailedPrecondition) is that one line; anything else logs its
    traceback first."""
    if not isinstance(exc, (*USER_LOAD_ERRORS, FailedPrecondition)):
        log.error("%s could not load", name, exc_info=exc)
    else:  # one line; where it is a bug after all, --log-level DEBUG shows where it came from
        log.debug("%s could not load", name, exc_info=exc)
    return f"{name}: could not load: {exc}"


def describe(security: ServerSecurity) -> str:
    """How a server is secured, for its log (never the secrets themselves)."""
    transport = "mutual TLS" if security.mutual_tls else "TLS" if security.tls else "plaintext"
    return f"{transport}, {'bearer token required' if security.tokens else 'no token'}"


async def watch_health(name: str, servicer, service_names: Sequence[str], wedged: Callable[[], str | None],
                       every_s: float = HEALTH_CHECK_S) -> None:  # fmt: skip
    """Health NOT_SERVING while `wedged()` names a reason, SERVING again once it names none: a
    Kubernetes readiness probe then takes the pod out of its Service, and its liveness probe
    restarts it if the reason lasts."""
    was = None
    while True:
        await asyncio.sleep(every_s)
        reason = wedged()
        if (reason is None) == (was is None):
            continue
        if reason is not None:
            log.error("%s: %s; health says NOT_SERVING until it ends", name, reason)
            await set_health(servicer, service_names, health_pb2.HealthCheckResponse.NOT_SERVING)
        else:
            log.warning("%s: the wedged pass ended; serving again", name)
            await set_health(servicer, service_names, health_pb2.HealthCheckResponse.SERVING)
        was = reason


async def set_health(servicer, service_names: Sequence[str], status) -> None:
    for service in ["", *service_names]:
        await servicer.set(service, status)
