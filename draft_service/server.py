"""Draft gRPC server: thin handlers over a drafter and the session pool."""

from __future__ import annotations

import time
from dataclasses import dataclass

from draft_service.drafters import ModelDrafter, NgramDrafter
from specdec import serving, telemetry
from specdec.errors import InvalidArgument, Unavailable, grpc_handler
from specdec.kvcache import SessionPool
from specdec.metrics import ModelServiceMetrics
from specdec.rng import DRAFT, cycle_generator
from specdec.session import SessionStore, check_session_id
from specdec.v1 import specdec_pb2 as pb
from specdec.v1 import specdec_pb2_grpc as pb_grpc
from specdec.wire import draft_token_to_pb, model_info_to_pb, sampling_from_pb

NGRAM = "ngram"


@dataclass
class DraftConfig:
    # Catalog name, HF directory, .gguf file, or "ngram" for prompt lookup.
    model: str = NGRAM
    redis_url: str = ""
    host: str = "127.0.0.1"
    port: int = 50052
    # Largest K accepted; bounds the work one request can ask for.
    max_k: int = 16
    # Sessions whose KV cache is kept; least recently used evicted beyond.
    max_sessions: int = 256
    dtype: str = "float32"
    device: str = "cpu"
    # Longest and shortest suffix n-gram the n-gram drafter looks up.
    max_ngram: int = 3
    min_ngram: int = 1
    # Port of the Prometheus /metrics endpoint; 0 = off.
    metrics_port: int = 0


class DraftServicer(pb_grpc.DraftServicer):
    def __init__(self, config: DraftConfig, store: SessionStore):
        self.config = config
        self.store = store
        self.worker = serving.ModelWorker("draft-model")
        self.drafter = None
        self.info = pb.ModelInfoResponse(model=config.model, max_k=config.max_k)
        self.pool: SessionPool | None = None
        self.metrics = ModelServiceMetrics("draft")

    def load(self) -> None:
        """Load the drafter (blocking; run off the event loop)."""
        if self.config.model == NGRAM:
            self.drafter = NgramDrafter(self.config.max_ngram, self.config.min_ngram)
            self.info.kind = NGRAM
            self.pool = SessionPool(self.config.max_sessions, lambda: None, self.metrics.observe_pool)
            return
        from specdec.models import load_model
        from transformers import DynamicCache

        loaded = load_model(self.config.model, dtype=self.config.dtype, device=self.config.device)
        self.drafter = ModelDrafter(loaded)
        self.info.MergeFrom(model_info_to_pb(loaded))
        self.info.kind = "model"
        self.pool = SessionPool(
            self.config.max_sessions, lambda: DynamicCache(config=loaded.model.config), self.metrics.observe_pool
        )

    @grpc_handler
    async def Propose(self, request: pb.ProposeRequest, context):
        pool = self.ready()
        session_id = check_session_id(request.session_id)
        k = request.k
        if not 1 <= k <= self.config.max_k:
            raise InvalidArgument(f"k must be between 1 and {self.config.max_k}, got {k}")
        sampling = sampling_from_pb(request.sampling)
        if sampling.seed is None:
            raise InvalidArgument("sampling.seed is required on internal calls (the coordinator sets it)")
        async with pool.use(session_id, self.store.exists) as state:
            await state.sync(
                request.position, request.new_tokens, self.store.tokens, self.info.vocab_size, self.info.max_context
            )
            generator = cycle_generator(sampling.seed, request.cycle, DRAFT)
            drafts = self.drafter.propose(state, k, sampling, generator)
            for index in range(k):
                started = time.perf_counter()
                item = await self.worker.run(next, drafts, None)
                if item is None:
                    break
                self.metrics.forward_latency.observe(time.perf_counter() - started)
                token, q = item
                yield draft_token_to_pb(index, token, q)

    def ready(self) -> SessionPool:
        if self.pool is None:
            raise Unavailable("the draft model is still loading; retry shortly")
        return self.pool

    @grpc_handler
    async def Release(self, request: pb.ReleaseRequest, context):
        return pb.ReleaseResponse(released=self.ready().release(request.session_id))

    @grpc_handler
    async def ModelInfo(self, request, context):
        info = pb.ModelInfoResponse()
        info.CopyFrom(self.info)
        info.sessions_held = len(self.pool) if self.pool else 0
        return info


async def serve(config: DraftConfig) -> None:
    telemetry.setup_tracing("specdec-draft")
    store = SessionStore(config.redis_url)
    servicer = DraftServicer(config, store)

    async def load():
        await servicer.worker.run(servicer.load)

    await serving.run(
        name="draft",
        host=config.host,
        port=config.port,
        service_names=[serving.DRAFT_SERVICE],
        register=lambda server: pb_grpc.add_DraftServicer_to_server(servicer, server),
        load=load,
        close=store.close,
        metrics_registry=servicer.metrics.registry,
        metrics_port=config.metrics_port,
    )
