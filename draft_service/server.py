"""Draft gRPC server: thin handlers over a drafter and the session pool."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from draft_service.drafters import ModelDrafter, NgramDrafter, Step
from specdec import model_service, serving
from specdec.batching import Batcher
from specdec.errors import FailedPrecondition, InvalidArgument, grpc_handler
from specdec.model_service import ModelService, ModelServiceConfig
from specdec.catalog import draft_default_k
from specdec.ngram import DEFAULT_MAX_NGRAM, DEFAULT_MIN_NGRAM, NGRAM_DRAFT, format_lookup_weights, resolve_lookup_weights
from specdec.rng import DRAFT, cycle_generator
from specdec.session import SessionStore
from specdec.v1 import specdec_pb2 as pb
from specdec.v1 import specdec_pb2_grpc as pb_grpc
from specdec.draft_wire import draft_token_to_pb
from specdec.wire import PROPOSE_STARTED


@dataclass
class DraftConfig(ModelServiceConfig):
    # Catalog name, HF directory, .gguf file, or "ngram" for prompt lookup.
    model: str = NGRAM_DRAFT
    port: int = 50052
    # Longest and shortest suffix n-gram the n-gram drafter looks up.
    max_ngram: int = DEFAULT_MAX_NGRAM
    min_ngram: int = DEFAULT_MIN_NGRAM
    # A model draft's lookup weights: "auto" (its directory's specdec-lookup.json, if any),
    # "off", or "N:W,..." (specdec.ngram: q' = (1 − λ_n)·q + λ_n·δ(lookup token)).
    lookup: str = "auto"


class DraftServicer(ModelService, pb_grpc.DraftServicer):
    role = "draft"

    def __init__(self, config: DraftConfig, store: SessionStore):
        super().__init__(config, store, pb.ModelInfoResponse(model=config.model, max_k=config.max_k))
        self.drafter = None
        self.batcher: Batcher | None = None  # a model draft's steps

    def setup(self) -> None:
        """Load the drafter (ModelService.load)."""
        if self.config.model == NGRAM_DRAFT:
            self.drafter = NgramDrafter(self.config.max_ngram, self.config.min_ngram)
            self.info.kind = NGRAM_DRAFT
            self.info.min_ngram, self.info.max_ngram = self.config.min_ngram, self.config.max_ngram
            return
        loaded = self.load_model()
        weights = resolve_lookup_weights(self.config.lookup, loaded.path)  # a bad file: ValueError, one line
        if weights:
            logging.getLogger("specdec").info("the draft mixes in the prompt lookup's token, weights %s",
                                              format_lookup_weights(weights))
        self.drafter = ModelDrafter(loaded, weights)
        self.batcher = Batcher(self.worker, self.drafter.draft_batch, self.config.max_batch, self.metrics.observe_pass)
        self.info.kind = "model"
        self.info.default_k = draft_default_k(self.config.model) or 0  # the coordinator's K for requests without one

    @grpc_handler
    async def Propose(self, request: pb.ProposeRequest, context):
        await context.send_initial_metadata(PROPOSE_STARTED)  # "alive", before a long prefill
        self.ready()
        self.check_vocabulary(request)
        if not 1 <= request.k <= self.config.max_k:
            raise InvalidArgument(f"k must be between 1 and {self.config.max_k}, got {request.k}")
        sampling = self.internal_sampling(request.sampling)
        async with self.session(request, context) as state:
            await self.prefill(state)
            generator = cycle_generator(sampling.seed, request.cycle, DRAFT)
            k = drafts_that_fit(request.k, state.committed_length, self.info.max_context)
            next_proposal = self.proposals(state, k, sampling, generator)
            for index in range(k):
                started = time.perf_counter()
                item = await next_proposal()
                if item is None:
                    break
                if self.batcher is None:  # a lookup step (a model's passes are timed by its Batcher)
                    self.metrics.forward_latency.observe(time.perf_counter() - started)
                token, q, match_length = item
                yield draft_token_to_pb(index, token, q, match_length)

    def check_vocabulary(self, request: pb.ProposeRequest) -> None:
        """Refuse a call that expects drafts in another vocabulary than this model's: this
        replica was restarted on another model since the coordinator checked it (an n-gram
        draft copies the context's own ids: any vocabulary will do; empty: not checked)."""
        if not request.vocab_fingerprint or self.info.kind == NGRAM_DRAFT:
            return
        if request.vocab_fingerprint != self.info.vocab_fingerprint:
            raise FailedPrecondition(f"this draft serves {self.info.model!r} of vocabulary "
                                     f"{self.info.vocab_fingerprint[:12]}, not {request.vocab_fingerprint[:12]}, "
                                     "the vocabulary the coordinator expects drafts in")  # fmt: skip

    def proposals(self, state, k: int, sampling, generator):
        """A coroutine function giving the session's next proposal (None: no more): a model
        draft's step shares a pass with other sessions' (self.batcher); an n-gram draft's
        lookup runs on the worker."""
        if self.batcher is not None:
            return lambda: self.batcher.run(Step(state, sampling, generator))
        drafts = self.drafter.propose(state, k, sampling, generator)
        return lambda: self.worker.run(next, drafts, None)


def drafts_that_fit(k: int, context: int, max_context: int) -> int:
    """How many of k drafts a model of max_context positions (0: no limit) makes after a
    context of that many tokens: draft i (from 0) is drawn once the context and the i drafts
    before it are in its cache, so context + i <= max_context. The rest are not drafted (a
    drafter may stop early); a draft of shorter context than its target's (GPT-2's 1,024
    positions, say) used to draft past it and fail INTERNAL (an IndexError) at its end."""
    return k if not max_context else max(0, min(k, max_context - context + 1))


async def serve(config: DraftConfig) -> None:
    await model_service.serve(DraftServicer, config, serving.DRAFT_SERVICE)
