"""Prompt lookup: the n-gram match an n-gram draft copies from.

One function, used by the n-gram drafter (which proposes the continuation) and by the
coordinator's adaptive K (which needs only the match length, the proposal's confidence
class, to decide whether asking the draft is worth a cycle).
"""

from __future__ import annotations

from collections.abc import Sequence

# The n-gram lengths an n-gram draft looks up unless told otherwise (`--max-ngram`, `--min-ngram`).
DEFAULT_MAX_NGRAM = 3
DEFAULT_MIN_NGRAM = 1


def find_continuation(tokens: Sequence[int], k: int, max_ngram: int, min_ngram: int) -> tuple[list[int], int]:
    """(up to k tokens that followed the latest earlier match of the longest suffix n-gram,
    that n-gram's length n); ([], 0) without a match."""
    length = len(tokens)
    if not isinstance(tokens, list):
        tokens = list(tokens)
    last = tokens[-1] if tokens else None
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        suffix = tokens[length - n :]
        # Scan backwards so the most recent match wins; a match must end before the suffix starts.
        # Comparing its last token first skips the slice for almost every start (this runs
        # on every cycle in the coordinator, over the whole context).
        for start in range(length - n - 1, -1, -1):
            if tokens[start + n - 1] == last and tokens[start : start + n] == suffix:
                continuation = list(tokens[start + n : start + n + k])
                if continuation:
                    return continuation, n
    return [], 0
