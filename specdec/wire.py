"""Protobuf at the edges: conversions between wire messages and plain values.

Servers call these first thing in a handler and last thing before replying; the
rest of the code never sees a protobuf object. Validation of user-facing values
happens here too, raising InvalidArgument with a message a user can act on.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from specdec import sampling as sampling_math
from specdec.errors import InvalidArgument
from specdec.v1 import specdec_pb2 as pb

DEFAULT_TEMPERATURE = 1.0
DEFAULT_TOP_P = 1.0
MAX_SEED = 2**63 - 1


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
        if math.isnan(self.temperature) or self.temperature < 0 or math.isinf(self.temperature):
            raise InvalidArgument(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k < 0:
            raise InvalidArgument(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if math.isnan(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise InvalidArgument(f"top_p must be in (0, 1] (1 = off), got {self.top_p}")
        if self.seed is not None and not 0 <= self.seed <= MAX_SEED:
            raise InvalidArgument(f"seed must be in [0, 2^63), got {self.seed}")
        return self

    def warp(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [..., V] -> probs [..., V], warped by these settings."""
        return sampling_math.warp(logits, self.temperature, self.top_k, self.top_p)


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


# ---------------------------------------------------------------- draft tokens
#
# A draft token's q travels in one of three forms:
#   one_hot  q is all on the drafted token (n-gram drafts);
#   sparse   q is zero outside `ids` (warping truncated: greedy, top-k, top-p);
#   dense    q over the whole vocabulary, as float16 (half the bytes of float32).
# Each form is exact: the draft samples from precisely the values it sends, because it
# samples from `wire_q(q)`, which is q already rounded the way it will travel.


@dataclass
class Draft:
    """One drafted token and its q: None (one-hot), or a dense tensor [V]."""

    token: int
    q: torch.Tensor | None


def is_sparse(q: torch.Tensor) -> bool:
    """Sparse form when ids + float32 probs (~8 bytes a token) beat float16 over V (2 bytes)."""
    return int(torch.count_nonzero(q)) * 4 < q.numel()


def wire_q(q: torch.Tensor) -> torch.Tensor:
    """q [V] as it will travel: unchanged when sparse, rounded to float16 when dense.
    A draft samples from this, so the q the target receives is exactly the one sampled from."""
    return q if is_sparse(q) else q.to(torch.float16).to(torch.float32)


def draft_token_to_pb(index: int, token: int, q: torch.Tensor | None) -> pb.DraftToken:
    """q None -> one_hot; a q with few non-zeros -> sparse; else dense float16. q is [V],
    already `wire_q(q)` (so the float16 encoding is exact)."""
    msg = pb.DraftToken(token_id=token, index=index)
    if q is None:
        msg.one_hot.SetInParent()
        return msg
    if is_sparse(q):
        support = torch.nonzero(q, as_tuple=True)[0]  # [S]
        msg.sparse.ids.extend(support.tolist())
        msg.sparse.probs.extend(q[support].tolist())
    else:
        msg.dense.fp16 = q.to(torch.float16).numpy().astype("<f2").tobytes()
    return msg


def draft_from_pb(msg: pb.DraftToken, vocab_size: int) -> Draft:
    """Decode one DraftToken; bad ids or a q that is not a distribution -> InvalidArgument."""
    token = msg.token_id
    if not 0 <= token < vocab_size:
        raise InvalidArgument(f"draft token id {token} is outside the vocabulary [0, {vocab_size})")
    form = msg.WhichOneof("q")
    try:
        if form is None or form == "one_hot":
            return Draft(token, None)
        if form == "sparse":
            q = sampling_math.sparse_to_dense(list(msg.sparse.ids), list(msg.sparse.probs), vocab_size)
        else:
            q = dense_from_pb(msg.dense, vocab_size)
        sampling_math.check_distribution(q, name=f"q of draft {msg.index}", vocab_size=vocab_size)
        if q[token] <= 0:
            raise ValueError(f"draft token {token} has q = 0: the draft cannot have sampled it")
    except ValueError as exc:
        raise InvalidArgument(str(exc)) from exc
    return Draft(token, q)


# float16 rounds each entry by at most 2^-11 and flushes entries below ~6e-8 to zero, so
# its values may sum to 1 only within this; they are renormalised on arrival. The draft
# sampled proportionally to the very same values, so the renormalised q is exact.
FP16_SUM_TOLERANCE = 1e-2


def dense_from_pb(msg: pb.DenseProbs, vocab_size: int) -> torch.Tensor:
    """float32 [V] from either dense encoding; ValueError on a wrong length or a bad sum."""
    if msg.fp16:
        if len(msg.fp16) != 2 * vocab_size:
            raise ValueError(f"dense q has {len(msg.fp16) // 2} float16 entries; the vocabulary has {vocab_size}")
        q = torch.from_numpy(np.frombuffer(msg.fp16, dtype="<f2").astype(np.float32))
        total = float(q.sum())
        if not abs(total - 1.0) <= FP16_SUM_TOLERANCE:  # also catches NaN
            raise ValueError(f"q of draft sums to {total:.6f}, not 1: not a distribution")
        return q / total
    if len(msg.probs) != vocab_size:
        raise ValueError(f"dense q has {len(msg.probs)} entries; the vocabulary has {vocab_size}")
    return torch.tensor(msg.probs, dtype=torch.float32)


def stack_draft_probs(drafts: Sequence[Draft]) -> torch.Tensor | None:
    """[K, V] dense q of all drafts, or None when every draft is one-hot."""
    if all(d.q is None for d in drafts):
        return None
    rows = []
    for d in drafts:
        if d.q is None:
            one_hot = torch.zeros_like(next(x.q for x in drafts if x.q is not None))
            one_hot[d.token] = 1.0
            rows.append(one_hot)
        else:
            rows.append(d.q)
    return torch.stack(rows)  # [K, V]


def model_info_to_pb(loaded) -> pb.ModelInfoResponse:
    """ModelInfoResponse fields that describe a loaded model (a models.LoadedModel)."""
    return pb.ModelInfoResponse(
        model=loaded.name,
        vocab_size=loaded.vocab_size,
        vocab_fingerprint=loaded.vocab_fingerprint,
        max_context=loaded.max_context,
        eos_token_ids=loaded.eos_token_ids,
        device=str(loaded.device),
        dtype=str(loaded.dtype),
    )
