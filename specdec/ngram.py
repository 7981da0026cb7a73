"""Prompt lookup: the n-gram match an n-gram draft copies from.

One function, used by the n-gram drafter (which proposes the continuation), by the
coordinator's adaptive K (which needs only the match length, the proposal's confidence
class, to decide whether asking the draft is worth a cycle), and by lookup mixing (below:
a model draft's q blended with the lookup's token).
"""

from __future__ import annotations

import json
from array import array
from collections.abc import Sequence
from pathlib import Path

NGRAM_DRAFT = "ngram"  # the name of the n-gram draft (`--draft ngram`), which needs no model, and its DraftInfo.kind

# The coordinator's K for requests that set none (`--default-k`) when the draft names no K of
# its own (a catalog draft's DraftEntry.k): the n-gram draft's fastest (README "The default draft").
DEFAULT_K = 4

# The n-gram lengths an n-gram draft looks up unless told otherwise (`--max-ngram`, `--min-ngram`).
DEFAULT_MAX_NGRAM = 3
DEFAULT_MIN_NGRAM = 1


def find_continuation(tokens: Sequence[int], k: int, max_ngram: int, min_ngram: int) -> tuple[list[int], int]:
    """(up to k tokens that followed the latest earlier match of the longest suffix n-gram,
    that n-gram's length n); ([], 0) without a match.

    A match is any earlier occurrence [start, start + n) with start + n < len(tokens) (it
    may overlap the suffix). The search runs in C: the tokens packed 8 bytes each, and
    bytes.rfind for the suffix's bytes, a hit counting only at a token boundary. It ran in
    Python, start by start, ~27 ns a token for each n tried: 2.5-4 ms a call on a 32k-token
    context, once per drafted token for a model draft mixing in the lookup, and once or
    twice a cycle on the coordinator's event loop for an n-gram draft."""
    length = len(tokens)
    if length < 2 or k <= 0:
        return [], 0
    if not isinstance(tokens, list):
        tokens = list(tokens)
    packed = array("q", tokens).tobytes()  # [8 * length] bytes
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        suffix = packed[8 * (length - n) :]
        end = 8 * (length - 1)  # a match ends before the last token: a continuation follows it
        while (at := packed.rfind(suffix, 0, end)) >= 0:
            if at % 8 == 0:
                start = at // 8
                return tokens[start + n : start + n + k], n
            end = at + len(suffix) - 1  # straddles two tokens: look for one that starts earlier
    return [], 0


# ---------------------------------------------------------------------------------------
# Lookup mixing: a model draft's q blended with the lookup's token.
#
# Terms: at a drafting position the lookup finds the latest earlier match of the context's
# longest suffix n-gram (n ≤ max_ngram) and the token c that followed it; n is the match
# length (0: no match). A model draft with lookup weights λ (one per n) drafts from
#     q' = (1 − λ_n)·q + λ_n·δ_c
# instead of its own q. q' is a distribution like any other, so verification stays exact
# (the target accepts against q', the distribution the token was drawn from). It raises α
# where the text repeats itself: on SmolLM2's greedy continuations 30% of positions match a
# 4-gram, and the token after the match carries 0.7 of p's mass there on average.

LOOKUP_FILE = "specdec-lookup.json"  # in a draft's model directory: its lookup weights
LOOKUP_MAX_NGRAM = 4  # the longest match length that gets its own weight
LOOKUP_WEIGHT_GRID = tuple(round(0.05 * i, 2) for i in range(21))  # the λ a calibration tries: 0, 0.05, ..., 1


def lookup_token(tokens: Sequence[int], weights: dict[int, float]) -> tuple[int, float]:
    """(c, λ): the token the lookup proposes after `tokens` and its weight; (-1, 0.0) when
    nothing matches or the match length has no weight. weights: match length n -> λ_n."""
    continuation, length = find_continuation(tokens, 1, max(weights, default=0), 1)
    weight = weights.get(length, 0.0) if continuation else 0.0
    return (continuation[0], weight) if weight > 0 else (-1, 0.0)


def mix_lookup(q, token, weight):
    """q' = (1 − weight)·q + weight·δ_token, q [..., V] a torch tensor whose rows sum to 1,
    so q' does; token and weight are numbers, or [...] tensors (one per row; token ≥ 0)."""
    import torch

    weight = torch.as_tensor(weight, dtype=q.dtype, device=q.device)[..., None]  # [..., 1]
    token = torch.as_tensor(token, dtype=torch.long, device=q.device)[..., None]  # [..., 1]
    return (q * (1.0 - weight)).scatter_add_(-1, token, weight.expand(token.shape))  # [..., V]


def parse_lookup_weights(text: str) -> dict[int, float]:
    """"2:0.25,3:0.4,4:0.9" -> {2: 0.25, 3: 0.4, 4: 0.9}; ValueError with the reason otherwise."""
    weights: dict[int, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        length, sep, value = part.partition(":")
        try:
            n, weight = int(length), float(value)
        except ValueError:
            raise ValueError(f"lookup weight {part!r} is not N:WEIGHT (e.g. 4:0.9)") from None
        if not sep or n < 1 or not 0.0 <= weight <= 1.0:
            raise ValueError(f"lookup weight {part!r}: N must be at least 1 and WEIGHT within [0, 1]")
        weights[n] = weight
    if not weights:
        raise ValueError("no lookup weights given (e.g. 2:0.25,3:0.4,4:0.9)")
    return weights


def format_lookup_weights(weights: dict[int, float]) -> str:
    return ",".join(f"{n}:{w:g}" for n, w in sorted(weights.items()))


def write_lookup_file(directory, weights: dict[int, float], **about) -> None:
    """Write a draft directory's LOOKUP_FILE: its weights and what chose them (`about`)."""
    payload = {"weights": {str(n): w for n, w in sorted(weights.items())}, **about}
    (Path(directory) / LOOKUP_FILE).write_text(json.dumps(payload, indent=1) + "\n")


def read_lookup_file(path) -> dict[int, float]:
    """The weights of a LOOKUP_FILE; ValueError naming the file if it is malformed."""
    try:
        raw = json.loads(Path(path).read_text())["weights"]
        return parse_lookup_weights(",".join(f"{n}:{w}" for n, w in raw.items()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"{path}: expected {{\"weights\": {{\"N\": WEIGHT, ...}}}}: {exc}") from None


def resolve_lookup_weights(setting: str, model_path: str | None) -> dict[int, float]:
    """The lookup weights a model draft serves with. setting: "auto" (those of the model
    directory's LOOKUP_FILE, none without one), "off" (none), or "N:W,..." (these)."""
    setting = setting.strip().lower()
    if setting == "off":
        return {}
    if setting == "auto":
        path = Path(model_path) / LOOKUP_FILE if model_path else None
        return read_lookup_file(path) if path is not None and path.is_file() else {}
    return parse_lookup_weights(setting)
