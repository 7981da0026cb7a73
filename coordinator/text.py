"""Turning committed token ids into streamed text, with stop strings.

Incremental detokenization decodes a short window (from `prefix_offset`) twice:
once up to what was already emitted (`read_offset`) and once to the end, and
emits the difference; a window that ends inside a multi-byte character (decodes
to U+FFFD) waits for the next tokens. Tokens are added one at a time, so a
character split over tokens holds back only itself, never the characters a cycle
committed before it, and at the end (`flush`) what a last incomplete character
held back is emitted and that character dropped. Bytes that never make a character
(U+FFFD) are held back only while they are among the window's last CHARACTER_TOKENS
tokens (`_settle`). Text that could still grow into
a stop string is held back, so the stream never shows part of a stop string.

The first window begins in the prompt (`context`: its last CONTEXT_TOKENS tokens,
decoded, never emitted), as vLLM and TGI stream: a SentencePiece tokenizer (Llama 2,
Mistral) drops the space at the start of whatever it decodes, so the output's first
token decoded alone lost its leading space ("Once upon a" + "time").
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

REPLACEMENT_CHAR = "\ufffd"
CONTEXT_TOKENS = 4  # of the prompt's last tokens, decoded before the output (module doc)
# A character is at most 4 UTF-8 bytes and a token that is not special at least one: what decodes
# before a window's last 4 such tokens is final once they do not change it (TextStream._settle).
CHARACTER_TOKENS = 4
BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")  # a byte-fallback token (SentencePiece: Llama 2, Mistral)


@dataclass
class TextStream:
    tokenizer: object
    stop: Sequence[str] = ()
    # The prompt's token ids: its last CONTEXT_TOKENS begin the first window (module doc).
    context: Sequence[int] = ()
    # Output token ids so far (never the prompt), up to the one that completed a stop string.
    ids: list[int] = field(default_factory=list)
    # Detokenized output so far, and how much of it was handed out.
    text: str = ""
    emitted: int = 0
    prefix_offset: int = 0
    read_offset: int = 0
    # Set once a stop string was found; text is cut before it.
    stopped: bool = False
    # What the windows decode: the context's tokens, then the output's; the offsets index it.
    window_ids: list[int] = field(default_factory=list)
    # The tokenizer's special tokens: decoded to nothing (skip_special_tokens), they carry no byte.
    special_ids: frozenset[int] = field(default_factory=frozenset)

    def __post_init__(self) -> None:
        self.special_ids = frozenset(getattr(self.tokenizer, "all_special_ids", ()))
        self.window_ids = list(self.context[-CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.window_ids)

    def add(self, new_ids: Sequence[int]) -> int:
        """Append tokens; look for stop strings in the text they add. Returns how many of
        `new_ids` the output keeps: all of them, or those up to the one that completed a stop
        string. Once a stop string was found the output is complete: the tokens a cycle
        committed past it, and any added later, are not kept (nor counted, nor sent).

        One token at a time (see the module doc): a cycle's tokens decoded as one window that
        ended inside a character used to hold back the whole window, and lose it when the
        output ended there (three emojis streamed as one)."""
        if self.stopped:
            return 0
        for kept, token in enumerate(new_ids, 1):
            self.ids.append(token)
            self.window_ids.append(token)
            if self._extend(self._decode_delta()):
                return kept
        return len(new_ids)

    def flush(self) -> None:
        """The output ended: emit the characters a window held back for an incomplete
        character after them, and drop that character (its other tokens never came)."""
        if not self.stopped:
            self._extend(self._decode_delta(final=True))  # a stop string in it cuts the text there

    def take(self, final: bool = False) -> str:
        """Text ready to stream: all of it when final (after `flush`), else all that cannot
        begin a stop string."""
        if final:
            self.flush()
        end = len(self.text)
        if not final and not self.stopped and self.stop:
            end = max(self.emitted, end - partial_stop_length(self.text, self.stop))
        delta = self.text[self.emitted : end]
        self.emitted = end
        return delta

    def _extend(self, delta: str) -> bool:
        """Append decoded text and look for a stop string where it could end; True when one
        was found (the text is cut before it)."""
        searched = max(0, len(self.text) - max_len(self.stop) + 1)  # no stop string ends before
        self.text += delta
        cut = first_stop(self.text, self.stop, searched) if self.stop and delta else None
        if cut is not None:
            self.text = self.text[:cut]
            self.stopped = True
        return self.stopped

    def _decode_delta(self, final: bool = False) -> str:
        """The text the tokens after `read_offset` add (module doc): "" while the window ends
        inside a character, unless `final`, where that last character is dropped instead."""
        decode = self.tokenizer.decode
        prefix = decode(self.window_ids[self.prefix_offset : self.read_offset], skip_special_tokens=True)
        full = decode(self.window_ids[self.prefix_offset :], skip_special_tokens=True)
        if final:
            full = full.rstrip(REPLACEMENT_CHAR)
        if len(full) > len(prefix) and not full.endswith(REPLACEMENT_CHAR):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.window_ids)
            return full[len(prefix) :]
        if len(self.window_ids) - self.read_offset > CHARACTER_TOKENS:
            return self._settle(prefix, full)
        return ""

    def _settle(self, prefix: str, full: str) -> str:
        """The text before the window's last CHARACTER_TOKENS tokens that carry bytes, once it can
        no longer change. Invalid bytes (tokens that decode to U+FFFD and never complete a
        character, a model repeating a stray byte) kept the window ending in U+FFFD: nothing was
        streamed, and each token decoded the whole window again, quadratic (2,000 such tokens of
        SmolLM2: 0.4 s on the event loop every session shares). A character ends within
        CHARACTER_TOKENS byte-carrying tokens of its first byte (skipped special tokens carry
        none, and may stand between its bytes), so text before them is final where the window
        decodes as its two parts do (not where the tokenizer joins or strips text at the cut),
        and not inside a run of byte-fallback tokens (in_byte_run)."""
        settled, carrying = len(self.window_ids), 0
        while settled > self.read_offset and carrying < CHARACTER_TOKENS:
            settled -= 1
            carrying += self.window_ids[settled] not in self.special_ids
        if carrying < CHARACTER_TOKENS or settled <= self.read_offset or self.in_byte_run(settled):
            return ""
        decode = self.tokenizer.decode
        head = decode(self.window_ids[self.prefix_offset : settled], skip_special_tokens=True)
        if len(head) <= len(prefix) or head + decode(self.window_ids[settled:], skip_special_tokens=True) != full:
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, settled
        return head[len(prefix) :]

    def in_byte_run(self, at: int) -> bool:
        """Whether the tokens on both sides of `at`, special tokens skipped as decode skips them,
        are byte-fallback tokens (<0xNN>): one run, which the decoder turns into text as a whole,
        all of it U+FFFD if any of it is invalid, so no cut inside it is final (bytes that come
        later may make its end valid)."""
        convert = getattr(self.tokenizer, "convert_ids_to_tokens", None)
        if convert is None:  # a tokenizer that names no tokens has no byte-fallback ones
            return False
        window, before, after = self.window_ids, at - 1, at
        while before >= 0 and window[before] in self.special_ids:
            before -= 1
        while after < len(window) and window[after] in self.special_ids:
            after += 1
        if before < 0 or after == len(window):
            return False
        return all(isinstance(t, str) and BYTE_TOKEN.fullmatch(t) for t in convert([window[before], window[after]]))


def max_len(stop: Sequence[str]) -> int:
    return max((len(s) for s in stop), default=0)


def partial_stop_length(text: str, stop: Sequence[str]) -> int:
    """Length of the longest end of `text` that is the beginning of a stop string (and not all
    of it). Each stop string's candidates are the places of its first character among the last
    len(s) - 1 characters, longest first, each compared once: with 64 stop strings of 1,000
    characters, 0.05 ms a call, where comparing every prefix (text.endswith(s[:n]) for every n)
    took 8.3 ms, on the event loop every session shares, once per cycle."""
    longest = 0
    for s in stop:
        tail = text[max(0, len(text) - len(s) + 1) :]
        start = tail.find(s[0]) if s else -1
        while start != -1 and len(tail) - start > longest:
            if s.startswith(tail[start:]):
                longest = len(tail) - start
                break
            start = tail.find(s[0], start + 1)
    return longest


def first_stop(text: str, stop: Sequence[str], start: int) -> int | None:
    """Index in `text` where the earliest stop string begins (searching from `start`)."""
    hits = [i for i in (text.find(s, start) for s in stop if s) if i >= 0]
    return min(hits) if hits else None
