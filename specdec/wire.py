"""Protobuf at the edges: conversions between wire messages and plain values.

Servers call these first thing in a handler and last thing before replying; the
rest of the code never sees a protobuf object. Validation of user-facing values
happens here too, raising InvalidArgument with a message a user can act on.

This module imports no torch (the coordinator uses it); a draft's q on the wire, which
needs torch, is specdec.draft_wire.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from specdec.errors import InvalidArgument
from specdec.ranges import sampling_problem
from specdec.v1 import specdec_pb2 as pb

if TYPE_CHECKING:
    import torch

DEFAULT_TEMPERATURE = 1.0
DEFAULT_TOP_P = 1.0
# The initial metadata a draft service sends first thing in a Propose, before any prefill or
# queue: a call that got it reached a live service, busy rather than frozen (cycles.CycleLoop).
PROPOSE_STARTED = (("specdec-propose", "started"),)


@dataclass(frozen=True)
class Sampling:
    """How p and q are warped; identical on both sides (losslessness rule 1)."""

    # 0 = greedy; > 0 divides the logits.
    temperature: float = DEFAULT_TEMPERATURE
    # Keep the k most likely tokens; 0 = off.
    top_k: int = 0
    # Nucleus mass to keep; 1.0 = off.
    top_p: float = DEFAULT_TOP_P
    # Seed of the request's random streams; None = the server picks one.
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def truncates(self) -> bool:
        """True when warping zeroes part of the vocabulary (q goes sparse on the wire)."""
        return self.greedy or self.top_k > 0 or self.top_p < 1.0

    def validate(self) -> "Sampling":
        if problem := sampling_problem(self.temperature, self.top_k, self.top_p, self.seed):
            raise InvalidArgument(problem)
        return self

    def warp(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [..., V] -> probs [..., V], warped by these settings."""
        from specdec.sampling import warp  # torch: only the model services warp, the coordinator never

        return warp(logits, self.temperature, self.top_k, self.top_p)


def check_token_ids(tokens: Sequence[int], vocab_size: int, name: str) -> None:
    """Every id in [0, vocab_size); vocab_size 0 means any id >= 0 (n-gram drafts)."""
    limit = vocab_size or 2**31
    for t in tokens:
        if not 0 <= t < limit:
            raise InvalidArgument(f"{name} holds token id {t}, outside the vocabulary [0, {vocab_size})")


def sampling_from_pb(msg: pb.SamplingParams) -> Sampling:
    return Sampling(
        temperature=msg.temperature if msg.HasField("temperature") else DEFAULT_TEMPERATURE,
        top_k=msg.top_k,
        top_p=msg.top_p if msg.HasField("top_p") else DEFAULT_TOP_P,
        seed=msg.seed if msg.HasField("seed") else None,
    ).validate()


def sampling_to_pb(s: Sampling) -> pb.SamplingParams:
    msg = pb.SamplingParams(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p)
    if s.seed is not None:
        msg.seed = s.seed
    return msg


def target_key(info: pb.ModelInfoResponse) -> tuple[str, str, str]:
    """A target model as every check compares it (replicas, Verify, Resume): its name and its
    vocabulary and weights fingerprints; describe_model(*target_key(info)) names it."""
    return info.model, info.vocab_fingerprint, info.weights_fingerprint


def model_info_to_pb(loaded) -> pb.ModelInfoResponse:
    """ModelInfoResponse fields that describe a loaded model (a models.LoadedModel)."""
    return pb.ModelInfoResponse(
        model=loaded.name,
        vocab_size=loaded.vocab_size,
        vocab_fingerprint=loaded.vocab_fingerprint,
        weights_fingerprint=loaded.weights_fingerprint,
        max_context=loaded.max_context,
        eos_token_ids=loaded.eos_token_ids,
        device=str(loaded.device),
        dtype=str(loaded.dtype),
    )
