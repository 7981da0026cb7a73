"""Target gRPC server: thin handlers over the verifier and the session pool."""

from __future__ import annotations

from dataclasses import dataclass

from opentelemetry import trace

from specdec import serving, telemetry
from specdec.errors import FailedPrecondition, InvalidArgument, Unavailable, grpc_handler
from specdec.kvcache import SessionPool
from specdec.metrics import ModelServiceMetrics
from specdec.rng import TARGET, cycle_generator
from specdec.session import SessionStore, check_session_id
from specdec.v1 import specdec_pb2 as pb
from specdec.v1 import specdec_pb2_grpc as pb_grpc
from specdec.wire import draft_from_pb, model_info_to_pb, sampling_from_pb
from target_service.verifier import Verifier


@dataclass
class TargetConfig:
    # Catalog name, HF directory or .gguf file of the model whose distribution we keep.
    model: str = "smollm2-135m-instruct"
    redis_url: str = ""
    host: str = "127.0.0.1"
    port: int = 50053
    # Largest number of drafts accepted in one Verify.
    max_k: int = 16
    # Sessions whose KV cache is kept; least recently used evicted beyond.
    max_sessions: int = 256
    dtype: str = "float32"
    device: str = "cpu"
    # Port of the Prometheus /metrics endpoint; 0 = off.
    metrics_port: int = 0


class TargetServicer(pb_grpc.TargetServicer):
    def __init__(self, config: TargetConfig, store: SessionStore):
        self.config = config
        self.store = store
        self.worker = serving.ModelWorker("target-model")
        self.verifier: Verifier | None = None
        self.pool: SessionPool | None = None
        self.info = pb.ModelInfoResponse(model=config.model, kind="model", max_k=config.max_k)
        self.metrics = ModelServiceMetrics("target")

    def load(self) -> None:
        """Load the target model (blocking; run off the event loop)."""
        from specdec.models import load_model
        from transformers import DynamicCache

        loaded = load_model(self.config.model, dtype=self.config.dtype, device=self.config.device)
        self.verifier = Verifier(loaded)
        self.info.MergeFrom(model_info_to_pb(loaded))
        self.pool = SessionPool(
            self.config.max_sessions, lambda: DynamicCache(config=loaded.model.config), self.metrics.observe_pool
        )

    def ready(self) -> SessionPool:
        if self.pool is None:
            raise Unavailable("the target model is still loading; retry shortly")
        return self.pool

    @grpc_handler
    async def Verify(self, request: pb.VerifyRequest, context):
        pool = self.ready()
        session_id = check_session_id(request.session_id)
        self.check_draft_vocabulary(request)
        if len(request.drafts) > self.config.max_k:
            raise InvalidArgument(f"{len(request.drafts)} drafts exceed the limit of {self.config.max_k}")
        sampling = sampling_from_pb(request.sampling)
        if sampling.seed is None:
            raise InvalidArgument("sampling.seed is required on internal calls (the coordinator sets it)")
        drafts = [draft_from_pb(d, self.info.vocab_size) for d in request.drafts]
        async with pool.use(session_id, self.store.exists) as state:
            await state.sync(
                request.position, request.new_tokens, self.store.tokens, self.info.vocab_size, self.info.max_context
            )
            generator = cycle_generator(sampling.seed, request.cycle, TARGET)
            verdict = await self.worker.run(self.verifier.verify, state, drafts, sampling, generator)
        self.metrics.forward_latency.observe(verdict.forward_ms / 1000)
        span = trace.get_current_span()  # the gRPC server span, when tracing is on
        span.set_attribute("specdec.forward_ms", verdict.forward_ms)
        span.set_attribute("specdec.accept_ms", verdict.accept_ms)
        span.set_attribute("specdec.accepted", verdict.num_accepted)
        return pb.VerifyResponse(
            num_accepted=verdict.num_accepted,
            next_token=verdict.next_token,
            bonus=verdict.bonus,
            forward_ms=verdict.forward_ms,
            accept_ms=verdict.accept_ms,
        )

    def check_draft_vocabulary(self, request: pb.VerifyRequest) -> None:
        """Refuse drafts from a model with another vocabulary (an n-gram draft sends none)."""
        theirs = request.draft_fingerprint
        if theirs and theirs != self.info.vocab_fingerprint:
            raise FailedPrecondition(
                f"draft model {request.draft_model or '(unnamed)'} (vocabulary {theirs[:12]}) does not share "
                f"the target {self.info.model}'s vocabulary ({self.info.vocab_fingerprint[:12]}): "
                "speculative decoding needs one tokenizer on both sides"
            )

    @grpc_handler
    async def Release(self, request: pb.ReleaseRequest, context):
        return pb.ReleaseResponse(released=self.ready().release(request.session_id))

    @grpc_handler
    async def ModelInfo(self, request, context):
        info = pb.ModelInfoResponse()
        info.CopyFrom(self.info)
        info.sessions_held = len(self.pool) if self.pool else 0
        return info


async def serve(config: TargetConfig) -> None:
    telemetry.setup_tracing("specdec-target")
    store = SessionStore(config.redis_url)
    servicer = TargetServicer(config, store)

    async def load():
        await servicer.worker.run(servicer.load)

    await serving.run(
        name="target",
        host=config.host,
        port=config.port,
        service_names=[serving.TARGET_SERVICE],
        register=lambda server: pb_grpc.add_TargetServicer_to_server(servicer, server),
        load=load,
        close=store.close,
        metrics_registry=servicer.metrics.registry,
        metrics_port=config.metrics_port,
    )
