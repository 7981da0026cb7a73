"""What every specdec gRPC server shares: options, health, reflection, lifecycle.

`run` starts a grpc.aio server with the standard health service reporting
NOT_SERVING, calls `load()` off the event loop (model loading takes seconds),
flips health to SERVING, and serves until SIGTERM/SIGINT; then it reports
NOT_SERVING, stops accepting calls and lets running ones finish within `grace_s`.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from specdec import telemetry
from specdec.metrics import serve_metrics
from specdec.v1 import specdec_pb2 as pb

log = logging.getLogger("specdec")

# q for a 150k vocabulary as dense float32 over K=16 drafts is ~10 MB; leave room.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]
CLIENT_OPTIONS = GRPC_OPTIONS + [
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.enable_retries", 1),
]
DEFAULT_GRACE_S = 5.0

COORDINATOR_SERVICE = pb.DESCRIPTOR.services_by_name["Coordinator"].full_name
DRAFT_SERVICE = pb.DESCRIPTOR.services_by_name["Draft"].full_name
TARGET_SERVICE = pb.DESCRIPTOR.services_by_name["Target"].full_name


class ModelWorker:
    """One thread that runs all model work of a service, off the event loop.

    A single thread keeps forwards from competing for the CPU cores and for one
    session's KV cache; the event loop stays free for network I/O meanwhile."""

    def __init__(self, name: str):
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)

    async def run(self, fn, *args):
        future = asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            # A forward cannot be interrupted: let it finish before the caller releases the
            # session it mutates (the session lock), then pass the cancellation on.
            await asyncio.wait([future])
            raise

    def shutdown(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)


def create_server() -> grpc.aio.Server:
    return grpc.aio.server(options=GRPC_OPTIONS)


def insecure_channel(address: str) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(address, options=CLIENT_OPTIONS)


async def run(
    *,
    name: str,
    host: str,
    port: int,
    service_names: Sequence[str],
    register: Callable[[grpc.aio.Server], None],
    load: Callable[[], Awaitable[None]],
    close: Callable[[], Awaitable[None]] | None = None,
    grace_s: float = DEFAULT_GRACE_S,
    metrics_registry=None,
    metrics_port: int = 0,
) -> None:
    """Serve until a termination signal; see the module docstring for the order of steps.
    Call telemetry.setup_tracing before this (and before making channels or Redis clients)."""
    server = create_server()
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection([*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    register(server)
    address = f"{host}:{port}"
    if server.add_insecure_port(address) == 0:
        raise SystemExit(f"{name}: cannot listen on {address}")
    await set_health(health_servicer, service_names, health_pb2.HealthCheckResponse.NOT_SERVING)
    await server.start()
    log.info("%s listening on %s, loading", name, address)
    if metrics_registry is not None and metrics_port:
        serve_metrics(metrics_registry, metrics_port, host)
        log.info("%s metrics on http://%s:%d/metrics", name, host, metrics_port)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    load_task = asyncio.create_task(load())
    stop_task = asyncio.create_task(stop.wait())
    done, _ = await asyncio.wait({load_task, stop_task}, return_when=asyncio.FIRST_COMPLETED)
    if load_task in done:
        load_task.result()  # a failed load ends the process with its error
        await set_health(health_servicer, service_names, health_pb2.HealthCheckResponse.SERVING)
        log.info("%s serving on %s", name, address)
        print(f"{name} serving on {address}", flush=True)
        await stop.wait()
    else:
        load_task.cancel()

    log.info("%s shutting down", name)
    await set_health(health_servicer, service_names, health_pb2.HealthCheckResponse.NOT_SERVING)
    await server.stop(grace_s)
    if close is not None:
        await close()
    telemetry.shutdown_tracing()


async def set_health(servicer, service_names: Sequence[str], status) -> None:
    for service in ["", *service_names]:
        await servicer.set(service, status)
