"""Target gRPC server: thin handlers over the verifier and the session pool."""

from __future__ import annotations

from dataclasses import dataclass

from opentelemetry import trace

from specdec import model_service, serving
from specdec.errors import FailedPrecondition, InvalidArgument, grpc_handler
from specdec.model_service import ModelService, ModelServiceConfig
from specdec.vocab import VocabMismatchError, check_vocab_match, describe_model
from specdec.rng import TARGET, cycle_generator
from specdec.session import SessionStore
from specdec.v1 import specdec_pb2 as pb
from specdec.v1 import specdec_pb2_grpc as pb_grpc
from specdec.draft_wire import draft_from_pb
from specdec.wire import target_key
from specdec.batching import Batcher
from target_service.verifier import Job, Verifier


# Longest n-gram a Verify may ask the target to look up after each plain step.
MAX_STOP_NGRAM = 64


@dataclass
class TargetConfig(ModelServiceConfig):
    # The model whose distribution the output keeps.
    model: str = "smollm2-135m-instruct"
    port: int = 50053
    # Torch threads for a Verify while the draft drafts beside it (pipelining: the request
    # says draft_busy), and for one while the draft is idle (drafts already in hand, or no
    # drafts at all): a model draft on the same machine needs a core only while it drafts.
    # 0 = leave torch's setting.
    threads: int = 0
    solo_threads: int = 0


class TargetServicer(ModelService, pb_grpc.TargetServicer):
    role = "target"
    committed_only = True

    def __init__(self, config: TargetConfig, store: SessionStore):
        super().__init__(config, store, pb.ModelInfoResponse(model=config.model, kind="model", max_k=config.max_k))
        self.verifier: Verifier | None = None
        self.batcher: Batcher | None = None

    def setup(self) -> None:
        """Load the target model and its verifier (ModelService.load)."""
        self.verifier = Verifier(self.load_model(), self.config.threads, self.config.solo_threads)
        self.batcher = Batcher(self.worker, self.verifier.verify_batch, self.config.max_batch,
                               self.metrics.observe_pass)  # fmt: skip

    @grpc_handler
    async def Verify(self, request: pb.VerifyRequest, context):
        self.ready()  # before any check that needs the loaded model's ModelInfo
        self.check_target_model(request)
        self.check_draft_vocabulary(request)
        if len(request.drafts) > self.config.max_k:
            raise InvalidArgument(f"{len(request.drafts)} drafts exceed the limit of {self.config.max_k}")
        if request.steps > self.config.max_k + 1:
            raise InvalidArgument(f"steps {request.steps} exceeds the limit of {self.config.max_k + 1} tokens per call")
        sampling = self.internal_sampling(request.sampling)
        stop_at_ngram = ngram_stop_from_pb(request)
        drafts = [draft_from_pb(d, self.info.vocab_size) for d in request.drafts]
        async with self.session(request, context) as state:
            await self.prefill(state)
            generator = cycle_generator(sampling.seed, request.cycle, TARGET)
            job = Job(state, drafts, sampling, generator, request.steps, request.draft_busy, stop_at_ngram)
            verdict = await self.batcher.run(job)
        span = trace.get_current_span()  # the gRPC server span, when tracing is on
        span.set_attribute("specdec.forward_ms", verdict.forward_ms)
        span.set_attribute("specdec.accept_ms", verdict.accept_ms)
        span.set_attribute("specdec.accepted", verdict.num_accepted)
        span.set_attribute("specdec.batch", verdict.batch)
        return pb.VerifyResponse(
            num_accepted=verdict.num_accepted,
            next_token=verdict.next_token,
            bonus=verdict.bonus,
            forward_ms=verdict.forward_ms,
            accept_ms=verdict.accept_ms,
            more_tokens=verdict.more_tokens,
        )

    def check_target_model(self, request: pb.VerifyRequest) -> None:
        """Refuse a call for another target model than this one (the session's, as the
        coordinator sends it: target_model, target_fingerprint and target_weights; empty: not
        checked)."""
        served = target_key(self.info)
        wanted = (request.target_model, request.target_fingerprint, request.target_weights or served[2])
        if request.target_model and wanted != served:
            raise FailedPrecondition(f"this target serves {describe_model(*served)}, not {describe_model(*wanted)}, "
                                     "the model the coordinator runs this session on")  # fmt: skip

    def check_draft_vocabulary(self, request: pb.VerifyRequest) -> None:
        """Refuse drafts from a model with another vocabulary (an n-gram draft sends none)."""
        if not request.draft_fingerprint:
            return
        try:
            check_vocab_match(
                request.draft_model or "(unnamed draft)",
                request.draft_fingerprint,
                self.info.model,
                self.info.vocab_fingerprint,
            )
        except VocabMismatchError as exc:
            raise FailedPrecondition(str(exc)) from exc


def ngram_stop_from_pb(request: pb.VerifyRequest) -> tuple[int, int] | None:
    """(min_ngram, max_ngram) of the request's stop_at_ngram, None when unset; InvalidArgument
    outside 1 <= min <= max <= MAX_STOP_NGRAM (a longer lookup costs more than it is worth)."""
    if not request.HasField("stop_at_ngram"):
        return None
    stop = request.stop_at_ngram
    if not 1 <= stop.min_ngram <= stop.max_ngram <= MAX_STOP_NGRAM:
        raise InvalidArgument(
            f"stop_at_ngram needs 1 <= min_ngram <= max_ngram <= {MAX_STOP_NGRAM}, "
            f"got {stop.min_ngram}..{stop.max_ngram}"
        )
    return stop.min_ngram, stop.max_ngram


async def serve(config: TargetConfig) -> None:
    await model_service.serve(TargetServicer, config, serving.TARGET_SERVICE)
