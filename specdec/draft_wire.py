"""Draft tokens on the wire: the forms a draft's q travels in, and their exact decoding.

The draft service encodes each drafted token with `draft_token_to_pb` after sampling it
from `wire_q(q)` (a WireQ); the target service decodes it with `draft_from_pb`, which refuses a q
that is not a distribution (InvalidArgument). Apart from specdec.wire (sampling settings,
model info: no torch, so the coordinator stays light) because this half needs torch.

Terms: V is the vocabulary size, q a draft's warped distribution [V] over it, its
support the ids where q > 0.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from google.protobuf.message import DecodeError

from specdec import sampling as sampling_math
from specdec.errors import InvalidArgument
from specdec.v1 import specdec_pb2 as pb

# ---------------------------------------------------------------- draft tokens
#
# A draft token's q travels in one of these forms:
#   one_hot  q is all on the drafted token (n-gram drafts);
#   fixed    q in fixed point: integer weights over its support, summing to exactly 2^18
#            (q(x) = weight / 2^18); about 2-3 bytes per token of the support;
#   fixed_deflated  the same FixedProbs, serialized and zlib-compressed, when that is
#            smaller (supports of hundreds of ids and more: ~25% fewer bytes);
#   dense    q over the whole vocabulary, as float16 (2 bytes per vocabulary entry);
#   sparse   float32 probs over the support (8 bytes a token; accepted, no longer sent).
# Each form is exact: the draft samples from precisely the values it sends, because it
# samples from `wire_q(q)`, which is q already rounded the way it will travel. Rounding
# changes the draft's distribution, never the output's (that is the target's p whatever
# q is); fixed point is used only while it moves at most FIXED_MAX_L1 of q's mass, so
# the draft's acceptance rate drops by at most half that (α = Σ min(p, q)).

# Fixed-point weights of one q sum to exactly this. Measured on the distilled SmolLM2 draft
# at top-p 0.9 (support ~1,000-4,000 ids): 2^16 moves up to 3.4% of q's mass, 2^18 at
# most 0.8% at 4% more bytes (3.4 kB a token on average, dense float32 is 196 kB).
FIXED_ONE = 1 << 18
FIXED_MAX_L1 = 0.01  # the most Σ|q_fixed - q| fixed point may cost; else dense float16
# A FixedProbs of fewer bytes is sent as is: deflate's header would eat what it saves.
# zlib level 1 costs ~0.2 ms per 4 kB q on one CPU core, level 9 saves only 1% more.
DEFLATE_MIN_BYTES = 256
DEFLATE_LEVEL = 1


@dataclass
class Draft:
    """One drafted token and its q: None (one-hot), or a dense tensor [V]."""

    token: int
    q: torch.Tensor | None


@dataclass
class WireQ:
    """A draft's q exactly as it will travel, built once by `wire_q`: the draft samples from
    it (`sample`) and sends it (`draft_token_to_pb`) without going back to a dense [V] tensor.

    Fixed point: `ids` [S] (ascending, int64) are the ids that carry mass, `weights` [S]
    (int64, > 0) their integer weights, Σ = FIXED_ONE, so q(ids[i]) = weights[i] / FIXED_ONE.
    Dense (when fixed point would move more than FIXED_MAX_L1 of q's mass): `dense` [V] holds
    q's float16 values as float32; q is proportional to them (the target renormalises).
    """

    vocab_size: int
    ids: np.ndarray | None = None
    weights: np.ndarray | None = None
    dense: torch.Tensor | None = None

    def sample(self, generator: torch.Generator | None = None) -> int:
        """One token id drawn from exactly this q (one uniform from `generator`)."""
        if self.dense is not None:
            return int(sampling_math.sample_rows(self.dense.unsqueeze(0), generator)[0])
        index = sampling_math.sample_rows(torch.from_numpy(self.weights).unsqueeze(0), generator)[0]  # into ids
        return int(self.ids[int(index)])

    def probs(self) -> torch.Tensor:
        """q as a dense float32 [V], as the target decodes it."""
        if self.dense is not None:
            return self.dense / float(self.dense.sum())
        return _dense(self.ids, self.weights, self.vocab_size)


def wire_q(q: torch.Tensor, ids: torch.Tensor | None = None, vocab_size: int | None = None) -> WireQ:
    """q as it will travel: in fixed point when that moves at most FIXED_MAX_L1 of its mass
    (any truncated q, and most others), else rounded to float16 (see WireQ).

    q [M] is a distribution over `ids` [M] (distinct token ids, any order; None: q is over the
    whole vocabulary, ids 0..M-1), so a draft whose head scores only part of the vocabulary
    rounds and sends q over that part, never touching the other ids (0 there).
    vocab_size: V (default M, when ids is None).
    """
    values = q.detach().to("cpu", torch.float32).numpy()  # [M], a view when q already is one
    carried = np.flatnonzero(values > 0)  # [S] positions in q (on a bool mask: 5x faster than on the floats)
    mass = values[carried].astype(np.float64)  # [S]
    support = carried if ids is None else ids.cpu().numpy()[carried]  # [S] token ids
    if ids is not None and len(support) > 1 and bool((np.diff(support) < 0).any()):
        order = np.argsort(support)
        support, mass = support[order], mass[order]
    vocab_size = len(values) if vocab_size is None else vocab_size
    weights = _cumulative_round(mass)  # [S]
    moved = np.abs(weights / FIXED_ONE - mass).sum()  # 0 off the support: q = 0 there
    if moved <= FIXED_MAX_L1:
        kept = weights > 0  # a tiny q entry may round to weight 0: it cannot be drawn, nor travels
        return WireQ(vocab_size, ids=support[kept].astype(np.int64), weights=weights[kept])
    dense = torch.zeros(vocab_size)  # [V]
    dense[torch.from_numpy(support)] = torch.from_numpy(mass).to(torch.float16).to(torch.float32)
    return WireQ(vocab_size, dense=dense)


def _cumulative_round(mass: np.ndarray) -> np.ndarray:
    """mass [S] (float64, > 0) -> integer weights [S] (int64, ≥ 0, Σ = FIXED_ONE).

    Cumulative rounding: the weights are the differences of round(cumsum(mass) · FIXED_ONE),
    so they are ≥ 0, sum to FIXED_ONE exactly, and move each token's mass by at most one
    unit (a run of tiny entries keeps its total: every few tokens get one unit). On the
    support only, in numpy: ~0.1 ms for a distilled draft's q (8,192 of 49,152 ids), where
    the same rounding over all V ids in torch took ~0.7 ms.
    """
    edges = np.rint(np.cumsum(mass) * (FIXED_ONE / mass.sum())).astype(np.int64)  # [S]
    edges[-1] = FIXED_ONE
    return np.diff(edges, prepend=0)


def draft_token_to_pb(index: int, token: int, q: WireQ | None, match_length: int = 0) -> pb.DraftToken:
    """q None -> one_hot; q in fixed point -> fixed (or fixed_deflated, when smaller); else
    dense float16. q is `wire_q`'s, so either encoding is exact. match_length: see DraftToken."""
    msg = pb.DraftToken(token_id=token, index=index, match_length=match_length)
    if q is None:
        msg.one_hot.SetInParent()
    elif q.dense is not None:
        msg.dense.fp16 = q.dense.to(torch.float16).numpy().astype("<f2").tobytes()
    else:
        fixed = pb.FixedProbs(id_gaps=np.diff(q.ids, prepend=0).tolist(), weights=q.weights.tolist())
        packed = fixed.SerializeToString()
        deflated = zlib.compress(packed, DEFLATE_LEVEL) if len(packed) >= DEFLATE_MIN_BYTES else packed
        if len(deflated) < len(packed):
            msg.fixed_deflated = deflated
        else:
            msg.fixed.CopyFrom(fixed)
    return msg


def _dense(support: np.ndarray, weights: np.ndarray, vocab_size: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """float32 [V] on `device`: weights / FIXED_ONE at the support, 0 elsewhere (exact).

    Built in torch's own memory, not as a view of a numpy array: a target whose decoded q
    were numpy-backed ran its forward passes ~8% slower through the services (2 cores, an
    A/B of two stacks on the same requests, 2026-12-05; not reproduced outside the services,
    cause not found), and this way it runs them as before.
    """
    dense = torch.zeros(vocab_size, device=device)  # [V]
    dense[torch.from_numpy(support).to(device)] = torch.from_numpy(weights).to(device, torch.float32) / FIXED_ONE
    return dense


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
            q = sampling_math.sparse_to_dense(repeated_to_tensor(msg.sparse.ids, np.int64),
                                              repeated_to_tensor(msg.sparse.probs, np.float64), vocab_size)  # fmt: skip
        elif form == "fixed":
            q = fixed_from_pb(msg.fixed, vocab_size)  # a distribution once decoded (see there)
        elif form == "fixed_deflated":
            q = fixed_from_pb(inflate_fixed(msg.fixed_deflated, vocab_size), vocab_size)
        else:
            q = dense_from_pb(msg.dense, vocab_size)
        if form not in ("fixed", "fixed_deflated"):
            sampling_math.check_distribution(q, name=f"q of draft {msg.index}", vocab_size=vocab_size)
            if form == "sparse" or not msg.dense.fp16:  # float32 values
                # A sum within the tolerance of 1 is a draft that drew in proportion to these very
                # values: judged by q unnormalised, the output moved by up to the tolerance (the
                # float16 form is renormalised as it is decoded, dense_from_pb).
                q = q / q.sum()
        if q[token] <= 0:
            raise ValueError(f"draft token {token} has q = 0: the draft cannot have sampled it")
    except ValueError as exc:
        raise InvalidArgument(str(exc)) from exc
    return Draft(token, q)


def inflate_fixed(data: bytes, vocab_size: int) -> pb.FixedProbs:
    """The FixedProbs inside `fixed_deflated`; ValueError on data that is not one whole
    deflate stream of a FixedProbs, or that inflates past the largest FixedProbs a q over
    the vocabulary can need (10·V + 32 bytes: two packed uint32 varints per id), so a
    small message cannot make the target allocate without bound."""
    limit = 10 * vocab_size + 32
    inflater = zlib.decompressobj()
    try:
        packed = inflater.decompress(data, limit)
    except zlib.error as exc:
        raise ValueError(f"fixed_deflated q is not zlib data: {exc}") from None
    if inflater.unconsumed_tail:
        raise ValueError(f"fixed_deflated q inflates past {limit} bytes, more than a q over {vocab_size} ids needs")
    if not inflater.eof or inflater.unused_data:
        raise ValueError("fixed_deflated q is not one whole zlib stream (truncated, or bytes after its end)")
    try:
        return pb.FixedProbs.FromString(packed)
    except DecodeError as exc:
        raise ValueError(f"fixed_deflated q does not inflate to a FixedProbs: {exc}") from None


def repeated_to_tensor(values, dtype) -> torch.Tensor:
    """A protobuf repeated number field as a 1-D tensor, through numpy: a q's few thousand
    ids and weights in ~0.03 ms each, where torch.tensor(list(values)) took ~1.4 ms."""
    return torch.from_numpy(np.array(values, dtype=dtype))


def fixed_from_pb(msg: pb.FixedProbs, vocab_size: int) -> torch.Tensor:
    """float32 [V] from a fixed-point q; ValueError unless its ids ascend strictly inside the
    vocabulary and its weights sum to FIXED_ONE. What passes is a distribution by construction
    (entries weight / 2^18 ≥ 0, their float32 sum exactly 1), so draft_from_pb skips the
    general check for it (~0.35 ms a q; the whole decode is ~0.5 ms for 5,000 ids)."""
    gaps = np.array(msg.id_gaps, dtype=np.int64)  # [S]
    weights = np.array(msg.weights, dtype=np.int64)  # [S], ≥ 0 (uint32 on the wire)
    if len(gaps) != len(weights):
        raise ValueError(f"fixed q has {len(gaps)} ids but {len(weights)} weights")
    if len(gaps) > 1 and int(gaps[1:].min()) == 0:
        raise ValueError("fixed q ids must ascend strictly (an id gap after the first is 0)")
    total = int(weights.sum())
    if total != FIXED_ONE:
        raise ValueError(f"fixed q weights sum to {total}, not {FIXED_ONE}: not a distribution")
    ids = np.cumsum(gaps)  # [S], ascending
    if ids[-1] >= vocab_size:
        raise ValueError(f"fixed q token id {int(ids[-1])} is outside the vocabulary [0, {vocab_size})")
    return _dense(ids, weights, vocab_size)


# float16 rounds each entry by at most 2^-11 and flushes entries below ~6e-8 to zero, so
# its values may sum to 1 only within this; they are renormalised on arrival. The draft
# sampled proportionally to the very same values, so the renormalised q is exact.
FP16_SUM_TOLERANCE = 1e-2


def dense_from_pb(msg: pb.DenseProbs, vocab_size: int) -> torch.Tensor:
    """float32 [V] from either dense encoding; ValueError on a bad sum, or on mass at ids past
    the vocabulary. A dense q is as long as the draft's embedding has rows, which may differ
    from the target's V under one tokenizer (Qwen2.5-0.5B has 151,936, Qwen2.5-7B 152,064):
    a shorter q is 0 at the ids it lacks, a longer one must be 0 at those past V (`fit_length`)."""
    if msg.fp16:
        if len(msg.fp16) % 2:
            raise ValueError(f"dense q has {len(msg.fp16)} bytes: float16 entries take 2 each")
        q = fit_length(torch.from_numpy(np.frombuffer(msg.fp16, dtype="<f2").astype(np.float32)), vocab_size)
        total = float(q.sum())
        if not abs(total - 1.0) <= FP16_SUM_TOLERANCE:  # also catches NaN
            raise ValueError(f"q of draft sums to {total:.6f}, not 1: not a distribution")
        return q / total
    return fit_length(repeated_to_tensor(msg.probs, np.float32), vocab_size)


def fit_length(q: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """q [L] as [V]: zeros appended when L < V; entries past V dropped when all of them are 0
    (ValueError otherwise: the draft could have drawn an id the target cannot score)."""
    if len(q) < vocab_size:
        return torch.cat([q, q.new_zeros(vocab_size - len(q))])
    if len(q) > vocab_size:
        if bool((q[vocab_size:] != 0).any()):  # NaN too
            raise ValueError(f"dense q of {len(q)} entries has mass at ids past the target's vocabulary of "
                             f"{vocab_size}: the draft's padded rows must have q = 0")  # fmt: skip
        return q[:vocab_size]
    return q


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
