"""OpenTelemetry tracing, configured the standard way (OTEL_* environment variables).

Tracing is on when an exporter is asked for: OTEL_TRACES_EXPORTER is set (otlp,
console), or an OTLP endpoint is (OTEL_EXPORTER_OTLP_ENDPOINT or
OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, exported over OTLP/gRPC). It is off when
OTEL_SDK_DISABLED=true, when OTEL_TRACES_EXPORTER=none, or when nothing asks for
it; then no provider, exporter or instrumentation is installed and every span
below is the API's no-op (nothing measurable).

When on, the gRPC instrumentation (server and client, aio and blocking) carries
the context in gRPC metadata, so one Generate call is one trace across the
coordinator, draft and target processes; Redis commands appear as spans too.
The sampler comes from OTEL_TRACES_SAMPLER, the service name from OTEL_SERVICE_NAME.

Span names (design.md §6): specdec.generate, specdec.cycle, specdec.draft.propose,
specdec.target.verify; and specdec.draft.call, the Propose call itself (its gRPC span's
parent), under the cycle that started it, which with pipelining is the cycle before the one
it drafts for (its `specdec.cycle`); the propose span of the cycle that takes its drafts links
to it.
"""

from __future__ import annotations

import logging
import os
import sys

from opentelemetry import trace

log = logging.getLogger("specdec")

TRACER_NAME = "specdec"
GENERATE_SPAN = "specdec.generate"
CYCLE_SPAN = "specdec.cycle"
PROPOSE_SPAN = "specdec.draft.propose"
DRAFT_CALL_SPAN = "specdec.draft.call"
VERIFY_SPAN = "specdec.target.verify"

# Health checks and reflection are not worth a span.
UNTRACED_SERVICES = ("grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection")

_provider = None


def tracer() -> trace.Tracer:
    return trace.get_tracer(TRACER_NAME)


def tracing_requested(environ=os.environ) -> bool:
    """True when the OTEL_* settings ask for traces to be exported (see module doc)."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporter = environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporter:
        return exporter != "none"
    return bool(environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))


def setup_tracing(default_service_name: str):
    """Install the tracer provider, exporter and instrumentations if tracing is requested.

    Call once per process, before creating gRPC servers, channels or Redis clients.
    Returns the TracerProvider, or None when tracing is off (nothing was installed)."""
    global _provider
    if _provider is not None or not tracing_requested():
        return _provider
    from opentelemetry.instrumentation.grpc import (
        GrpcAioInstrumentorClient,
        GrpcAioInstrumentorServer,
        GrpcInstrumentorClient,
        filters,
    )
    from opentelemetry.instrumentation.redis import RedisInstrumentor
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    resource = Resource.create({} if os.environ.get("OTEL_SERVICE_NAME") else {SERVICE_NAME: default_service_name})
    provider = TracerProvider(resource=resource)  # sampler from OTEL_TRACES_SAMPLER
    for exporter in make_exporters():
        provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)

    untraced = filters.negate(filters.any_of(*[filters.service_name(s) for s in UNTRACED_SERVICES]))
    GrpcAioInstrumentorServer(filter_=untraced).instrument()
    GrpcAioInstrumentorClient(filter_=untraced).instrument()
    GrpcInstrumentorClient(filter_=untraced).instrument()
    RedisInstrumentor().instrument()
    _provider = provider
    log.info("tracing on: exporting %s spans as %s", ",".join(exporter_names()), resource.attributes[SERVICE_NAME])
    return provider


def exporter_names() -> list[str]:
    names = os.environ.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() or "otlp"
    return [n.strip() for n in names.split(",") if n.strip() and n.strip() != "none"]


def make_exporters() -> list:
    """Span exporters named by OTEL_TRACES_EXPORTER (default otlp = OTLP over gRPC)."""
    exporters = []
    for name in exporter_names():
        if name == "otlp":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            exporters.append(OTLPSpanExporter())  # endpoint, headers, TLS from OTEL_EXPORTER_OTLP_*
        elif name == "console":
            from opentelemetry.sdk.trace.export import ConsoleSpanExporter

            exporters.append(ConsoleSpanExporter(out=sys.stderr))  # stdout is a command's output (--json)
        else:
            raise SystemExit(f"OTEL_TRACES_EXPORTER={name!r} is not supported here; use otlp, console or none")
    return exporters


def shutdown_tracing() -> None:
    """Flush and stop the exporter (on process shutdown)."""
    if _provider is not None:
        _provider.shutdown()
