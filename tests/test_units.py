"""Unit tests of the small pieces the services are built from."""

import argparse
import asyncio
import contextlib
import re
import time
import zlib

import grpc
import numpy as np
import pytest
import redis
import torch

from coordinator.text import TextStream, first_stop, partial_stop_length
from specdec.ngram import (
    LOOKUP_FILE, find_continuation, lookup_token, mix_lookup, parse_lookup_weights, read_lookup_file,
    resolve_lookup_weights, write_lookup_file,
)  # fmt: skip
from specdec.errors import FailedPrecondition, InvalidArgument, NotFound, OutOfRange, ResourceExhausted, Unavailable
from specdec.kvcache import SessionPool, SessionState, cache_bytes, new_cache
from specdec.rng import DRAFT, TARGET, cycle_generator
from specdec.v1 import specdec_pb2 as pb
from specdec import draft_wire
from specdec.sampling import warp
from specdec.draft_wire import draft_from_pb, draft_token_to_pb, stack_draft_probs
from specdec.wire import Sampling, sampling_from_pb


# ---------------------------------------------------------------- n-gram lookup


def test_ngram_proposes_what_followed_the_latest_match_of_the_longest_suffix_and_its_length():
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3]
    # Suffix [2, 3] last occurred before at index 5..6, followed by 7, 8, 5.
    assert find_continuation(tokens, 3, max_ngram=3, min_ngram=1) == ([7, 8, 5], 2)


def test_ngram_prefers_a_longer_match_over_a_more_recent_shorter_one():
    tokens = [4, 5, 6, 10, 11, 9, 6, 12, 4, 5, 6]
    # [4, 5, 6] matches at 0 (followed by 10); [6] alone would match at 6 (followed by 12).
    assert find_continuation(tokens, 2, max_ngram=3, min_ngram=1) == ([10, 11], 3)


def test_ngram_without_a_match_proposes_nothing():
    assert find_continuation([1, 2, 3, 4], 4, max_ngram=3, min_ngram=1) == ([], 0)
    assert find_continuation([7], 4, max_ngram=3, min_ngram=1) == ([], 0)


def scanned_continuation(tokens, k, max_ngram, min_ngram):
    """find_continuation's definition, start by start in Python (the implementation before it
    searched packed bytes in C)."""
    for n in range(min(max_ngram, len(tokens) - 1), min_ngram - 1, -1):
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == tokens[len(tokens) - n :] and tokens[start + n : start + n + k]:
                return tokens[start + n : start + n + k], n
    return [], 0


def test_ngram_lookup_finds_what_a_start_by_start_scan_finds_on_any_tokens():
    """The lookup searches the tokens packed 8 bytes each with bytes.rfind, a hit counting only
    at a token boundary: on 20,000 random contexts (vocabularies of 2 to 2**40 ids, negative
    ids, overlapping matches, k 0 to 6) it finds exactly the scan's match."""
    import random

    rng = random.Random(0)
    for _ in range(20_000):
        vocab = rng.choice([2, 3, 5, 50, 300, 2**40])
        tokens = [rng.randrange(vocab) - (vocab // 2 if rng.random() < 0.1 else 0) for _ in range(rng.randint(0, 60))]
        k, max_ngram = rng.randint(0, 6), rng.randint(1, 6)
        min_ngram = rng.randint(1, max_ngram)
        assert find_continuation(tokens, k, max_ngram, min_ngram) == scanned_continuation(tokens, k, max_ngram, min_ngram)
    # a hit across a token boundary is no match: 1 then 256 (0x100) hold 256's bytes one byte in
    assert find_continuation([0, 1, 256], 1, 1, 1) == ([], 0)
    # ... and the match it overlaps is still found: 0 then 256 hold nine zero bytes from the 0's first
    assert find_continuation([5, 0, 256, 9, 0], 1, 1, 1) == ([256], 1)


def test_ngram_drafter_tags_each_proposal_with_its_match_length_and_the_wire_keeps_it():
    from draft_service.drafters import NgramDrafter

    state = SessionState("s", held=[4, 5, 6, 10, 11, 9, 6, 12, 4, 5], pending=[6])
    proposals = list(NgramDrafter().propose(state, 2, Sampling(), torch.Generator()))
    assert proposals == [(10, None, 3), (11, None, 3)]
    message = draft_token_to_pb(0, 10, None, match_length=3)
    assert pb.DraftToken.FromString(message.SerializeToString()).match_length == 3


def test_the_lookup_token_follows_the_longest_match_and_takes_that_lengths_weight():
    weights = {1: 0.0, 2: 0.25, 3: 0.9}
    # ... 4 5 6 | 7 ... 4 5 6: the 3-gram "4 5 6" was followed by 7
    assert lookup_token([4, 5, 6, 7, 1, 4, 5, 6], weights) == (7, 0.9)
    assert find_continuation([4, 5, 9, 4], 1, 3, 1) == ([5], 1)
    assert lookup_token([4, 5, 9, 4], weights) == (-1, 0.0), "a 1-gram match whose weight is 0 mixes nothing"
    assert lookup_token([1, 2, 3], weights) == (-1, 0.0), "no match"
    # lengths count up to the largest N given: a 3-gram match is class 2 when 2 is the largest
    assert lookup_token([4, 5, 6, 7, 1, 4, 5, 6], {2: 0.5}) == (7, 0.5)


def test_mixing_the_lookup_token_keeps_a_distribution_and_moves_that_weight_onto_it():
    q = torch.tensor([0.5, 0.3, 0.2, 0.0])
    mixed = mix_lookup(q, 3, 0.4)
    assert torch.allclose(mixed, torch.tensor([0.3, 0.18, 0.12, 0.4])) and float(mixed.sum()) == pytest.approx(1.0)
    assert torch.equal(q, torch.tensor([0.5, 0.3, 0.2, 0.0])), "q itself is left alone"
    assert torch.allclose(mix_lookup(q, 0, 1.0), torch.tensor([1.0, 0, 0, 0])), "weight 1 is the n-gram draft's one-hot"


@pytest.mark.parametrize(("text", "message"), [
    ("", "no lookup weights"), ("4", "N:WEIGHT"), ("x:0.5", "N:WEIGHT"), ("0:0.5", "at least 1"), ("2:1.5", "within [0, 1]"),
])  # fmt: skip
def test_bad_lookup_weights_are_refused_with_the_reason(text, message):
    with pytest.raises(ValueError, match=message.replace("[", "\\[")):
        parse_lookup_weights(text)


def test_a_draft_directorys_lookup_file_is_used_on_auto_and_ignored_when_off(tmp_path):
    assert resolve_lookup_weights("auto", str(tmp_path)) == {}, "no file: no mixing"
    write_lookup_file(tmp_path, {1: 0.0, 2: 0.25, 4: 0.9}, note="test")
    assert resolve_lookup_weights("auto", str(tmp_path)) == {1: 0.0, 2: 0.25, 4: 0.9}
    assert resolve_lookup_weights("off", str(tmp_path)) == {}
    assert resolve_lookup_weights("3:0.5", str(tmp_path)) == {3: 0.5}, "given weights win over the file"
    (tmp_path / LOOKUP_FILE).write_text('{"weights": {"2": 7}}')
    with pytest.raises(ValueError, match=LOOKUP_FILE):
        read_lookup_file(tmp_path / LOOKUP_FILE)


def test_ngram_continuation_is_capped_at_k():
    assert find_continuation([1, 2, 3, 4, 5, 6, 1], 2, max_ngram=2, min_ngram=1) == ([2, 3], 1)


def test_ngram_lookup_finds_what_a_plain_scan_of_every_earlier_position_finds():
    """find_continuation skips most slices by comparing a candidate's last token first; on
    random short contexts over small vocabularies (many matches) it must agree with the
    obvious scan: longest n first, most recent match with a non-empty continuation."""
    import random

    def plain_scan(tokens, k, max_ngram, min_ngram):
        for n in range(min(max_ngram, len(tokens) - 1), min_ngram - 1, -1):
            suffix = tokens[len(tokens) - n :]
            for start in range(len(tokens) - n - 1, -1, -1):
                if tokens[start : start + n] == suffix and tokens[start + n : start + n + k]:
                    return tokens[start + n : start + n + k], n
        return [], 0

    rng = random.Random(0)
    for _ in range(3000):
        tokens = [rng.randrange(rng.choice([2, 3, 5, 20])) for _ in range(rng.randrange(40))]
        max_ngram = rng.randrange(1, 5)
        args = (rng.randrange(1, 5), max_ngram, rng.randrange(1, max_ngram + 1))
        assert find_continuation(tokens, *args) == plain_scan(tokens, *args)
        assert find_continuation(tuple(tokens), *args) == plain_scan(tokens, *args)


@pytest.mark.parametrize("k", [1, 3, 5])
def test_the_coordinators_ngram_lookup_gives_the_draft_services_tokens_byte_for_byte(k):
    """The coordinator looks an n-gram draft up itself (NgramLookup); what it hands the
    target must be exactly what the draft service would have streamed, cut after an end
    token as the coordinator cuts a stream (eos = 11 here)."""
    from coordinator.cycles import NgramLookup
    from draft_service.drafters import NgramDrafter

    context = [4, 5, 6, 10, 11, 9, 6, 12, 4, 5, 6]
    state = SessionState("s", held=context[:-1], pending=context[-1:])
    served = [draft_token_to_pb(i, token, q, n).SerializeToString()
              for i, (token, q, n) in enumerate(NgramDrafter().propose(state, k, Sampling(), torch.Generator()))]  # fmt: skip
    # The coordinator looks up once for K drafts and a guess (limit + 1) and cuts to what it asks.
    for looked_up_for in (k, k + 1, 8):
        looked_up = NgramLookup(find_continuation(context, looked_up_for, 3, 1), k, frozenset({11}))
        assert [t.SerializeToString() for t in looked_up.tokens] == served[:2]  # 10, then the end token 11
        assert asyncio.run(looked_up.first(k)) == looked_up.tokens[:k]
        assert looked_up.k == k
    assert NgramLookup(find_continuation([1, 2, 3], 8, 3, 1), k, frozenset()).tokens == []
    # Without an end token in the way, a longer lookup cut to k is the k-token stream.
    plain = [4, 5, 6, 7, 8, 9, 4, 5, 6]
    state = SessionState("s", held=plain[:-1], pending=plain[-1:])
    streamed = [token for token, _, _ in NgramDrafter().propose(state, k, Sampling(), torch.Generator())]
    assert len(streamed) == k
    assert [t.token_id for t in NgramLookup(find_continuation(plain, 8, 3, 1), k, frozenset()).tokens] == streamed


# ---------------------------------------------------------------- text stream


class CharTokenizer:
    """Token id = code point; enough to test the streaming logic."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


def stream_text(pieces, stop):
    stream = TextStream(CharTokenizer(), stop)
    out = []
    for piece in pieces:
        stream.add([ord(c) for c in piece])
        out.append(stream.take(final=stream.stopped))
        if stream.stopped:
            break
    out.append(stream.take(final=True))
    return out, stream


def test_output_ends_before_the_stop_string_even_across_chunks():
    out, stream = stream_text(["hello wo", "rld EN", "D more"], ["END"])
    assert "".join(out) == "hello world "
    assert stream.stopped


def test_partial_stop_string_is_held_back_not_streamed():
    out, _ = stream_text(["abc E", "N"], ["END"])
    assert out[0] == "abc "  # "E" might start "END"
    assert "".join(out) == "abc EN"


def test_text_without_stop_strings_streams_everything():
    out, stream = stream_text(["ab", "cd"], [])
    assert out[:2] == ["ab", "cd"] and not stream.stopped


def random_stop_cases(seed: int, n: int = 300):
    """(tokenizer, ids, their text, stop) n times: 30 random ids of the tiny tokenizer and a
    3-character stop string taken from their text (or "zzz" when it is shorter)."""
    from specdec.models import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    rng = np.random.default_rng(seed)
    for _ in range(n):
        ids = rng.integers(0, tokenizer.vocab_size, 30).tolist()
        full = tokenizer.decode(ids, skip_special_tokens=True)
        start = int(rng.integers(0, max(1, len(full) - 3)))
        yield tokenizer, ids, full, full[start : start + 3] or "zzz"


def test_the_text_and_its_stop_do_not_depend_on_how_the_tokens_were_chunked():
    """Resume replays a session's tokens one by one: it must reach the text and tokens the
    stream reached cycle by cycle, and tokens committed past a stop string add nothing."""
    rng = np.random.default_rng(5)
    stopped = 0
    for tokenizer, ids, full, stop in random_stop_cases(5):
        one_by_one, in_chunks = TextStream(tokenizer, [stop]), TextStream(tokenizer, [stop])
        for token in ids:
            one_by_one.add([token])
            one_by_one.take()
        cuts = np.cumsum(rng.integers(1, 6, 30))
        for begin, end in zip([0, *cuts], cuts):
            in_chunks.add(ids[begin:end])
            in_chunks.take()
        expected = full[: full.find(stop)] if stop in full else full
        assert one_by_one.text == in_chunks.text == expected, (ids, stop)
        assert one_by_one.ids == in_chunks.ids, (ids, stop)
        stopped += one_by_one.stopped
    assert stopped > 250  # the stop strings were found, nearly always


def test_the_output_tokens_end_with_the_token_that_completes_the_stop_string():
    """A cycle commits up to K+1 tokens at once; those after the one that completed a stop
    string are not output (they used to be sent in token_ids, and counted)."""
    checked = 0
    for tokenizer, ids, full, stop in random_stop_cases(6):
        if stop not in full:
            continue
        stream = TextStream(tokenizer, [stop])
        kept = [stream.add(ids[begin : begin + 4]) for begin in range(0, 30, 4)]
        n = len(stream.ids)
        assert ids[:n] == stream.ids and sum(kept) == n, (ids, stop)
        assert stop in tokenizer.decode(ids[:n], skip_special_tokens=True), (ids, stop)
        assert stop not in tokenizer.decode(ids[: n - 1], skip_special_tokens=True), (ids, stop)
        checked += 1
    assert checked > 250


def byte_level_tokenizer(merges: tuple[tuple[str, str], ...] = ()):
    """A tokenizer with one token per UTF-8 byte (byte-level BPE without merges), as
    SmolLM2's splits a character it has no token for: é is 2 tokens, 日 3, 👌 4. `merges`
    (in the byte-level alphabet, where 0xC3 is "Ã") add tokens that span characters."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {byte: i for i, byte in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab.update({a + b: len(vocab) + i for i, (a, b) in enumerate(merges)})
    backend = Tokenizer(models.BPE(vocab=vocab, merges=list(merges)))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=backend)


def test_characters_split_over_tokens_stream_whole_however_the_tokens_are_chunked():
    """Streamed in chunks of 1 to 8 tokens (a cycle's), or replayed one by one (Resume), the
    text is the tokens' decoded text, less a last character whose tokens did not all come. A
    chunk that ended inside a character used to hold back all of the chunk, and to lose it
    when the output ended there (three emojis streamed as one)."""
    tokenizer = byte_level_tokenizer()
    rng = np.random.default_rng(7)
    pieces = ["a", " b", "é", "日本", "👌🏼", "!\n"]
    ended_inside = 0
    for _ in range(200):
        ids = tokenizer("".join(rng.choice(pieces, 12)), add_special_tokens=False)["input_ids"]
        ids = ids[: len(ids) - int(rng.integers(0, 3))]  # often ends inside a character
        expected = tokenizer.decode(ids).rstrip("\ufffd")
        ended_inside += expected != tokenizer.decode(ids)
        cuts = [0, *np.cumsum(rng.integers(1, 9, len(ids))).tolist()]
        for chunks in ([ids[a:b] for a, b in zip(cuts, cuts[1:])], [[token] for token in ids]):
            stream, streamed = TextStream(tokenizer), []
            for chunk in chunks:
                stream.add(chunk)
                streamed.append(stream.take())
            streamed.append(stream.take(final=True))
            assert "".join(streamed) == stream.text == expected, (ids, chunks)
    assert ended_inside > 30  # 44 of the 200 end inside a character


class CountingDecoder:
    """A tokenizer whose decode counts the tokens it is given."""

    def __init__(self, tokenizer):
        self.tokenizer, self.decoded = tokenizer, 0

    def decode(self, ids, **kwargs):
        self.decoded += len(ids)
        return self.tokenizer.decode(ids, **kwargs)


def test_bytes_that_never_make_a_character_stream_once_past_a_characters_length_and_decode_in_linear_time():
    """A model repeating a stray byte (a token that decodes to U+FFFD and completes no
    character): the window kept ending in U+FFFD, so nothing was streamed and each token decoded
    the whole window again (2,000 tokens of SmolLM2: 0.4 s on the event loop). Now the text more
    than 4 tokens back (a character is at most 4 bytes) streams once the last tokens leave it
    unchanged; valid characters split over tokens still stream whole."""
    tokenizer = byte_level_tokenizer()
    stray = tokenizer.convert_tokens_to_ids(pre_tokenizers_byte(0x80))  # a lone continuation byte
    counting = CountingDecoder(tokenizer)
    stream = TextStream(counting)
    stream.add([stray] * 10)
    assert stream.take() == "\ufffd" * 6  # all but the last 4 tokens' bytes
    stream.add([stray] * 2990 + tokenizer("é!", add_special_tokens=False)["input_ids"])
    assert stream.take(final=True) == "\ufffd" * 2994 + "é!"
    assert stream.text == tokenizer.decode([stray] * 3000 + tokenizer("é!", add_special_tokens=False)["input_ids"])
    assert counting.decoded < 20 * 3003  # linear: ~4.5 M tokens decoded before

    rng = np.random.default_rng(11)
    pieces = ["a", " b", "é", "日本", "👌🏼", "!\n"]
    for _ in range(200):
        ids = tokenizer("".join(rng.choice(pieces, 8)), add_special_tokens=False)["input_ids"]
        for at in rng.integers(0, len(ids), 3):  # runs of stray bytes, also inside a character
            ids[at:at] = [stray] * int(rng.integers(1, 9))
        for chunked in ([ids], [[token] for token in ids]):
            stream = TextStream(tokenizer)
            streamed = "".join(stream.take() for chunk in chunked if stream.add(chunk) is not None)
            streamed += stream.take(final=True)
            assert streamed == stream.text and tokenizer.decode(ids).startswith(streamed), ids
            assert streamed.rstrip("\ufffd") == tokenizer.decode(ids).rstrip("\ufffd"), ids


def byte_fallback_tokenizer():
    """A tokenizer with byte fallback, as Llama 2's and Mistral's: a character it has no token for
    is <0xNN> tokens, which the decoder turns into text a run at a time, all of a run U+FFFD where
    any of its bytes is invalid."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    vocab.update({piece: len(vocab) + i for i, piece in enumerate(["▁", "a", "o", "k", "▁ok", "é", "x"])})
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])  # fmt: skip
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def test_held_back_bytes_stream_as_decode_gives_them_across_special_tokens_and_byte_fallback_runs(monkeypatch):
    """Text is final 4 byte-carrying tokens back, and only where the window decodes as its two
    parts do. Cut 4 tokens back whatever they were, an emoji whose bytes had skipped special tokens
    between them streamed as U+FFFD, and a cut inside a byte-fallback run (decoded as a whole: all
    U+FFFD where any byte is invalid) streamed 日 where decode gives U+FFFD (a stop string "日"
    ended such an output). Over random sequences of both kinds, the text is what it is without
    that (but for the U+FFFDs that streamed early) and, for the byte-level tokenizer, decode's
    but for a last unfinished character. (Byte fallback's own runs: see README, Left out.)"""
    from coordinator import text as text_module

    def streamed(tokenizer, ids):
        stream = TextStream(tokenizer)
        return "".join(stream.take() for token in ids if stream.add([token]) is not None) + stream.take(final=True)

    byte_level = byte_level_tokenizer()
    byte_level.add_special_tokens({"additional_special_tokens": ["<|sp|>"]})
    sp = byte_level.convert_tokens_to_ids("<|sp|>")
    emoji = byte_level("👌", add_special_tokens=False)["input_ids"]  # 4 byte tokens
    ids = byte_level("a", add_special_tokens=False)["input_ids"] + [emoji[0], sp, emoji[1], sp, emoji[2], sp, sp, emoji[3]]
    assert streamed(byte_level, ids) == byte_level.decode(ids, skip_special_tokens=True) == "a👌"
    fallback = byte_fallback_tokenizer()
    ids = fallback.convert_tokens_to_ids(["x", "<0xE5>", *["<0xE6>", "<0x97>", "<0xA5>"] * 2, "▁", "x"])
    assert streamed(fallback, ids) == fallback.decode(ids) == "x" + "\ufffd" * 7 + " x"

    rng = np.random.default_rng(12)
    for tokenizer, specials, pieces in ((byte_level, [sp], ["a", " ok", "é", "日", "👌🏼"]),
                                        (fallback, [1, 2], [" ok", "a", "é", "👌", " 日", "x"])):  # fmt: skip
        pieces = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in pieces]
        for _ in range(300):
            ids = []
            for _ in range(int(rng.integers(1, 25))):
                roll = rng.random()
                if roll < 0.1:
                    ids.append(int(rng.choice(specials)))
                elif roll < 0.3:  # a stray byte
                    ids.append(int(rng.integers(3, 259)) if tokenizer is fallback else int(rng.integers(0, 256)))
                else:
                    piece = pieces[int(rng.integers(len(pieces)))]
                    ids.extend(piece[: int(rng.integers(1, len(piece) + 1))])
            text = streamed(tokenizer, ids)
            with monkeypatch.context() as never:
                never.setattr(text_module, "CHARACTER_TOKENS", 10**9)  # nothing held back is settled early
                unsettled = streamed(tokenizer, ids)
            assert text.startswith(unsettled) and set(text[len(unsettled) :]) <= {"\ufffd"}, ids
            if tokenizer is byte_level:
                decoded = tokenizer.decode(ids, skip_special_tokens=True)
                assert decoded.startswith(text) and set(decoded[len(text) :]) <= {"\ufffd"}, ids


def pre_tokenizers_byte(byte: int) -> str:
    """The byte-level alphabet's character for `byte` (GPT-2's table: bytes outside printable
    Latin-1 map to U+0100 on)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    if byte in printable:
        return chr(byte)
    return chr(256 + [b for b in range(256) if b not in printable].index(byte))


def test_a_stop_string_completed_by_the_text_an_incomplete_last_character_held_back_ends_the_output_on_stop():
    """"STOPé" tokenized with a token "P" + é's first byte: a stream that ends (length or eos)
    after "STO" and that token has held "P" back, waiting for é's second byte. Flushed at the
    end, "P" completes the stop string "STOP": the finish reason is "stop" and no text is sent,
    in the stream and in Resume alike (the stream used to say "length" and Resume "stop")."""
    from coordinator.cycles import Plan
    from coordinator.server import finish_of, finished_as, replay_text

    tokenizer = byte_level_tokenizer(merges=(("P", "Ã"),))
    ids = tokenizer("STOPé", add_special_tokens=False)["input_ids"][:4]  # S T O P+0xC3
    assert tokenizer.decode(ids) == "STOP\ufffd"
    tokenizer.add_special_tokens({"eos_token": "<eos>"})
    eos = tokenizer.eos_token_id
    for stop, eos_end, reason, sent in ((["STOP"], False, "stop", ""), (["STOP"], True, "stop", ""),
                                        (["STOPS"], False, "length", "STOP"), (["STOPS"], True, "eos", "STOP")):  # fmt: skip
        output = ids + [eos] if eos_end else ids
        stream = TextStream(tokenizer, stop)
        stream.add(output)
        assert stream.take() == ""  # "P" held back: é may follow
        assert finish_of(stream, eos=eos_end, length_reached=not eos_end) == reason, (stop, eos_end)
        assert stream.take(final=True) == sent
        plan = Plan(session_id="s", prompt=[1], max_new_tokens=9 if eos_end else len(output),
                    sampling=Sampling(0.0, 0, 1.0, 1), k=2, eos_token_ids=frozenset({eos}), max_context=0,
                    draft_model="", draft_fingerprint="", stop=stop)  # fmt: skip
        replayed = replay_text(tokenizer, stop, output)
        assert finished_as(plan, replayed, [1, *output]) == reason and replayed.text == sent, (stop, eos_end)


def sentencepiece_like_tokenizer():
    """A tokenizer built as Llama 2's and Mistral's are: each word's token begins with "▁" for its
    space, and the decoder strips the space at the start of whatever it decodes."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    backend.pre_tokenizer = pre_tokenizers.Split("▁", behavior="merged_with_next")
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    corpus = ["Once upon a time there was a fox.", "The time is now, there is a fox here."] * 10
    trainer = trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    backend.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def test_the_output_of_a_sentencepiece_tokenizer_keeps_its_first_tokens_space_in_the_stream_and_in_resume():
    """The first window begins in the prompt: "Once upon a" + " time there ...", where decoding
    the output alone gave "time there ..." (the decoder strips a leading space), so the text
    glued to the prompt read "atime" and a stop string " time" could not end the output at its
    first token. vLLM and TGI stream the space too. A byte-level tokenizer's text is unchanged."""
    from coordinator.server import replay_text

    tokenizer = sentencepiece_like_tokenizer()
    prompt = tokenizer("Once upon a", add_special_tokens=False)["input_ids"]
    whole = tokenizer("Once upon a time there was a fox.", add_special_tokens=False)["input_ids"]
    output = whole[len(prompt) :]
    assert whole[: len(prompt)] == prompt and tokenizer.convert_ids_to_tokens(output[:1]) == ["▁time"]
    for chunks in ([output], [[token] for token in output]):
        stream = TextStream(tokenizer, (), prompt)
        streamed = [(stream.add(chunk), stream.take())[1] for chunk in chunks]
        assert "".join(streamed) + stream.take(final=True) == " time there was a fox."
    stopped = TextStream(tokenizer, [" time"], prompt)
    assert stopped.add(output) == 1 and stopped.take(final=True) == "" and stopped.stopped
    assert replay_text(tokenizer, [], output, prompt).text == " time there was a fox."
    bytes_level = byte_level_tokenizer()
    ids = bytes_level("Hi there 👌🏼 you", add_special_tokens=False)["input_ids"]
    with_prompt = TextStream(bytes_level, (), ids[:3])
    with_prompt.add(ids[3:])
    assert with_prompt.take(final=True) == bytes_level.decode(ids[3:])


def test_partial_stop_length_is_the_longest_end_of_the_text_that_begins_a_stop_string():
    """Against its definition, over short texts and stop strings of two- and four-letter
    alphabets (so that ends and beginnings overlap often)."""
    rng = np.random.default_rng(9)
    overlapping = 0
    for _ in range(5000):
        alphabet = list("ab") if rng.random() < 0.5 else list("abc ")
        text = "".join(rng.choice(alphabet, int(rng.integers(0, 12))))
        stop = ["".join(rng.choice(alphabet, int(rng.integers(1, 7)))) for _ in range(int(rng.integers(1, 4)))]
        defined = max((n for s in stop for n in range(1, len(s)) if text.endswith(s[:n])), default=0)
        assert partial_stop_length(text, stop) == defined, (text, stop)
        overlapping += defined > 1
    assert overlapping > 1000


def test_first_stop_picks_the_earliest_of_several():
    assert first_stop("xx STOP yy END", ["END", "STOP"], 0) == 3


# ---------------------------------------------------------------- wire conversions


def test_sampling_defaults_when_unset():
    s = sampling_from_pb(pb.SamplingParams())
    assert (s.temperature, s.top_k, s.top_p, s.seed) == (1.0, 0, 1.0, None)


@pytest.mark.parametrize(
    "msg, field",
    [
        (pb.SamplingParams(temperature=-0.5), "temperature"),
        (pb.SamplingParams(temperature=float("nan")), "temperature"),
        (pb.SamplingParams(top_k=-1), "top_k"),
        (pb.SamplingParams(top_p=0.0), "top_p"),
        (pb.SamplingParams(top_p=1.5), "top_p"),
    ],
)
def test_bad_sampling_params_are_invalid_arguments(msg, field):
    with pytest.raises(InvalidArgument, match=field):
        sampling_from_pb(msg)


def test_truncated_q_travels_in_fixed_point_as_id_gaps_and_weights():
    q = torch.zeros(1000)
    q[[3, 17, 999]] = torch.tensor([0.5, 0.25, 0.25])
    msg = draft_token_to_pb(0, 17, draft_wire.wire_q(q))
    assert msg.WhichOneof("q") == "fixed"
    assert list(msg.fixed.id_gaps) == [3, 14, 982] and list(msg.fixed.weights) == [131072, 65536, 65536]
    assert torch.equal(draft_from_pb(msg, 1000).q, q)


def test_fixed_point_rounding_sums_exactly_and_moves_each_token_by_at_most_one_unit():
    generator = torch.Generator().manual_seed(5)
    for scale in (0.5, 3.0, 8.0):
        q = torch.softmax(torch.randn(5000, generator=generator) * scale, -1)
        sent = draft_wire.wire_q(q)
        assert sent.dense is None, "fixed point moves under FIXED_MAX_L1 of these q's mass"
        assert int(sent.weights.sum()) == draft_wire.FIXED_ONE and int(sent.weights.min()) > 0
        fixed = sent.probs()  # [V]
        assert torch.equal(torch.from_numpy(sent.ids), torch.nonzero(fixed).squeeze(1))
        assert float((fixed.double() - q.double()).abs().max()) <= 1 / draft_wire.FIXED_ONE + 1e-9




def test_fixed_point_on_the_support_is_cumulative_rounding_over_the_whole_vocabulary():
    """draft_wire rounds on q's support only (numpy); that must be the definition itself:
    round(cumsum(q) · 2^18) over all V ids, differenced (zeros add nothing to a cumsum)."""
    generator = torch.Generator().manual_seed(8)
    for vocab, support, scale in ((50, 50, 1.0), (49152, 8192, 2.5), (49152, 900, 4.0), (1000, 3, 1.0)):
        q = torch.zeros(vocab)
        ids = torch.randperm(vocab, generator=generator)[:support]
        q[ids] = torch.softmax(torch.randn(support, generator=generator) * scale, -1)
        q64 = q.double()
        edges = torch.round(torch.cumsum(q64, 0) * (draft_wire.FIXED_ONE / q64.sum())).long()
        edges[-1] = draft_wire.FIXED_ONE
        reference = torch.diff(edges, prepend=edges.new_zeros(1)).float() / draft_wire.FIXED_ONE  # [V]
        sent = draft_wire.wire_q(q)
        assert torch.equal(sent.probs(), reference)
        assert torch.equal(draft_from_pb(draft_token_to_pb(0, int(q.argmax()), sent), vocab).q, reference)


def test_a_q_over_part_of_the_vocabulary_travels_as_the_same_q_over_all_of_it():
    """A draft whose head scores only ids [M] rounds q [M] over them; that must be the wire
    form of the same q spread over V with zeros elsewhere, whatever the order of the ids."""
    generator = torch.Generator().manual_seed(9)
    vocab = 49152
    for size, scale in ((8192, 2.5), (300, 1.0), (5000, 0.05)):  # the last is flat: dense float16
        ids = torch.randperm(vocab, generator=generator)[:size]  # [M], unsorted
        q = torch.softmax(torch.randn(size, generator=generator) * scale, -1)  # [M]
        q[: size // 10] = 0.0  # zeros inside the subset too (a truncated q)
        q = q / q.sum()
        full = torch.zeros(vocab)
        full[ids] = q
        part, whole = draft_wire.wire_q(q, ids, vocab), draft_wire.wire_q(full)
        assert part.vocab_size == whole.vocab_size == vocab
        assert torch.equal(part.probs(), whole.probs()), size
        assert draft_token_to_pb(0, 0, part).SerializeToString() == draft_token_to_pb(0, 0, whole).SerializeToString()
        if part.dense is None:
            assert (np.diff(part.ids) > 0).all() and (part.weights > 0).all()


def test_any_q_round_trips_exactly_through_the_wire_whatever_its_form():
    generator = torch.Generator().manual_seed(6)
    for vocab, scale, top_k in ((50, 1.0, 0), (49152, 0.01, 0), (49152, 3.0, 50), (49152, 2.0, 0)):
        sent = draft_wire.wire_q(warp(torch.randn(vocab, generator=generator) * scale, 1.0, top_k=top_k))
        token = sent.sample(generator)
        received = draft_from_pb(draft_token_to_pb(0, token, sent), vocab).q
        assert torch.equal(received, sent.probs()) and received[token] > 0  # exactly what the draft sampled from


def test_a_flat_full_support_q_travels_as_float16_dense_not_lossy_fixed_point():
    q = torch.softmax(torch.randn(49152, generator=torch.Generator().manual_seed(0)) * 0.01, -1)
    sent = draft_wire.wire_q(q)  # ~2e-5 per token: fixed point would move ~25% of the mass
    msg = draft_token_to_pb(1, 4, sent)
    assert msg.WhichOneof("q") == "dense" and len(msg.dense.fp16) == 2 * 49152 and not msg.dense.probs
    one_hot = draft_token_to_pb(2, 4, None)
    assert one_hot.WhichOneof("q") == "one_hot" and draft_from_pb(one_hot, 50).q is None


def test_a_dense_q_from_a_draft_whose_embedding_is_padded_otherwise_fits_the_targets_vocabulary():
    """A dense q is as long as the draft's embedding has rows: under one tokenizer Qwen2.5-0.5B
    has 151,936 and Qwen2.5-7B 152,064, and the target refused every dense q of such a pair
    (INVALID_ARGUMENT, "dense q has 151936 float16 entries; the vocabulary has 152064"). A
    shorter q is 0 at the ids it lacks; a longer one is taken when it is 0 past the target's ids."""
    short, long = 151_936, 152_064
    q = torch.softmax(torch.randn(short, generator=torch.Generator().manual_seed(3)) * 0.01, -1)  # [short], flat
    sent = draft_wire.wire_q(q)
    msg = draft_token_to_pb(0, 7, sent)
    assert msg.WhichOneof("q") == "dense"
    received = draft_from_pb(msg, long).q  # [long]
    assert torch.equal(received[:short], sent.probs()) and not received[short:].any()
    padded = draft_wire.wire_q(torch.cat([q, q.new_zeros(long - short)]))  # a draft with more rows
    assert torch.equal(draft_from_pb(draft_token_to_pb(0, 7, padded), short).q, sent.probs())
    with pytest.raises(InvalidArgument, match="mass at ids past the target's vocabulary of 151936"):
        draft_from_pb(draft_token_to_pb(0, 7, draft_wire.wire_q(torch.full((long,), 1 / long))), short)
    with pytest.raises(InvalidArgument, match="3 bytes: float16 entries take 2 each"):
        draft_from_pb(pb.DraftToken(token_id=0, dense=pb.DenseProbs(fp16=b"abc")), short)


def test_a_draft_whose_embedding_has_rows_past_its_tokenizers_ids_never_puts_mass_there():
    """Rows past the tokenizer's ids stand for no token: the draft samples (and takes its greedy
    argmax) over its ids alone, so its q fits a target of the same tokenizer without those rows (it used to spread mass
    over them, and the target refused q with ids outside its vocabulary)."""
    from draft_service.drafters import ModelDrafter, Step
    from specdec.kvcache import SessionState, new_cache
    from specdec.models import LoadedModel, build_tiny_model, build_tiny_tokenizer
    from specdec.wire import Sampling

    tokenizer = build_tiny_tokenizer()
    tokens = len(tokenizer)
    model = build_tiny_model(tokenizer, hidden_size=32, num_layers=1, seed=0, vocab_size=tokens + 128)
    drafter = ModelDrafter(LoadedModel(model=model, tokenizer=tokenizer, name="d", path="", vocab_fingerprint="",
                                       vocab_size=tokens + 128, max_context=0))  # fmt: skip
    state = SessionState("s", pending=[5, 6, 7], cache=new_cache(model.config))
    generator = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for _ in range(8):
            [(token, q, _)] = drafter.draft_batch([Step(state, Sampling(1.0, 0, 1.0, seed=1), generator)])
            assert token < tokens and not q.probs()[tokens:].any()
            received = draft_from_pb(draft_token_to_pb(0, token, q), tokens)  # the target has no padded rows
            assert torch.equal(received.q, q.probs()[:tokens])
    # Greedy too: the argmax over the tokenizer's ids, even where a padded row scores highest (it
    # used to take the argmax over every row, and the target refused the id).
    with torch.no_grad():
        model.get_output_embeddings().weight[tokens:] *= 1000
    with torch.inference_mode():
        for _ in range(8):
            [(token, q, _)] = drafter.draft_batch([Step(state, Sampling(0.0, 0, 1.0, seed=1), generator)])
            assert token < tokens and q is None


def test_float32_dense_and_sparse_q_are_still_accepted_on_the_wire():
    q = torch.softmax(torch.randn(50, generator=torch.Generator().manual_seed(1)), -1)
    msg = pb.DraftToken(token_id=3, dense=pb.DenseProbs(probs=q.tolist()))
    assert torch.equal(draft_from_pb(msg, 50).q, q / q.sum())  # renormalised (the test below)
    sparse = pb.DraftToken(token_id=3, sparse=pb.SparseProbs(ids=[3, 9], probs=[0.75, 0.25]))
    assert draft_from_pb(sparse, 50).q[[3, 9]].tolist() == [0.75, 0.25]


def test_a_flat_draft_at_top_p_or_top_k_costs_under_a_fiftieth_of_dense_float32():
    # A distilled draft is flat: at top-p 0.9 its support is ~1,000-4,000 of SmolLM2's 49,152
    # ids (median ~1,000); these logits give 50 and ~1,500.
    float32_dense = 49152 * 4
    generator = torch.Generator().manual_seed(2)
    for top_k, top_p in ((50, 1.0), (0, 0.9)):
        logits = torch.randn(49152, generator=generator) * 3.2
        q = warp(logits, 1.0, top_k=top_k, top_p=top_p)
        sent = draft_wire.wire_q(q)
        msg = draft_token_to_pb(0, int(logits.argmax()), sent)
        assert msg.WhichOneof("q") == ("fixed" if top_k == 50 else "fixed_deflated")
        assert torch.equal(draft_from_pb(msg, 49152).q, sent.probs())  # exact either way
        support = int((q > 0).sum())
        assert (top_k == 50 and support == 50) or 700 < support < 3000
        assert msg.ByteSize() * 50 < float32_dense, (support, msg.ByteSize())
        assert float((sent.probs() - q).abs().sum()) <= draft_wire.FIXED_MAX_L1  # costs ≤ 0.005 of α


def test_stacked_q_of_a_mixed_cycle_makes_one_hot_rows_explicit():
    q = torch.tensor([0.5, 0.5, 0.0])
    drafts = [draft_from_pb(draft_token_to_pb(0, 1, draft_wire.wire_q(q)), 3), draft_from_pb(draft_token_to_pb(1, 2, None), 3)]
    assert torch.equal(stack_draft_probs(drafts), torch.tensor([[0.5, 0.5, 0.0], [0.0, 0.0, 1.0]]))


FIXED_1_2 = pb.FixedProbs(id_gaps=[1, 1], weights=[131072, 131072]).SerializeToString()


def test_a_deflated_fixed_q_decodes_to_the_same_q_as_the_plain_one():
    plain = pb.DraftToken(token_id=1, fixed=pb.FixedProbs.FromString(FIXED_1_2))
    deflated = pb.DraftToken(token_id=1, fixed_deflated=zlib.compress(FIXED_1_2))
    assert torch.equal(draft_from_pb(plain, 10).q, draft_from_pb(deflated, 10).q)
    assert draft_token_to_pb(0, 1, draft_wire.wire_q(draft_from_pb(plain, 10).q)).WhichOneof("q") == "fixed"  # too small to deflate


@pytest.mark.parametrize(
    "msg, message",
    [
        (pb.DraftToken(token_id=5, sparse=pb.SparseProbs(ids=[1], probs=[1.0])), "q = 0"),
        (pb.DraftToken(token_id=1, sparse=pb.SparseProbs(ids=[1, 2], probs=[0.9, 0.9])), "sum"),
        (pb.DraftToken(token_id=1, sparse=pb.SparseProbs(ids=[1], probs=[float("nan")])), "NaN"),
        (pb.DraftToken(token_id=1, sparse=pb.SparseProbs(ids=[1, 77], probs=[0.5, 0.5])), "77"),
        (pb.DraftToken(token_id=1, dense=pb.DenseProbs(probs=[1.0])), "q = 0"),  # 0 at the ids a short q lacks
        (pb.DraftToken(token_id=1, dense=pb.DenseProbs(fp16=b"\x00\x3c" * 3)), "sums to 3"),
        (pb.DraftToken(token_id=1, dense=pb.DenseProbs(probs=[0.0] * 10 + [1.0])), "mass at ids past"),
        (pb.DraftToken(token_id=1, dense=pb.DenseProbs(fp16=b"\x00\x3c" * 10)), "sums to"),
        (pb.DraftToken(token_id=11), "vocabulary"),
        (pb.DraftToken(token_id=1, fixed=pb.FixedProbs(id_gaps=[1, 1], weights=[40000, 40000])), "sum to 80000"),
        (pb.DraftToken(token_id=1, fixed=pb.FixedProbs(id_gaps=[1, 0], weights=[32768, 32768])), "ascend"),
        (pb.DraftToken(token_id=1, fixed=pb.FixedProbs(id_gaps=[1], weights=[32768, 32768])), "2 weights"),
        (pb.DraftToken(token_id=1, fixed=pb.FixedProbs(id_gaps=[1, 20], weights=[131072, 131072])), "21"),
        (pb.DraftToken(token_id=1, fixed=pb.FixedProbs()), "sum to 0"),
        (pb.DraftToken(token_id=1, fixed_deflated=b"not zlib at all"), "not zlib"),
        (pb.DraftToken(token_id=1, fixed_deflated=zlib.compress(b"\x00" * 10_000)), "inflates past 132"),
        (pb.DraftToken(token_id=1, fixed_deflated=zlib.compress(FIXED_1_2)[:-3]), "not one whole"),
        (pb.DraftToken(token_id=1, fixed_deflated=zlib.compress(FIXED_1_2) + b"x"), "not one whole"),
        (pb.DraftToken(token_id=1, fixed_deflated=zlib.compress(b"\xff\xff")), "FixedProbs"),
        (pb.DraftToken(token_id=1, fixed_deflated=zlib.compress(pb.FixedProbs(id_gaps=[1], weights=[3]).SerializeToString())), "sum to 3"),
    ],
)
def test_a_q_that_is_not_a_distribution_is_an_invalid_argument(msg, message):
    with pytest.raises(InvalidArgument, match=message):
        draft_from_pb(msg, 10)


@pytest.mark.parametrize("form", ["sparse", "dense"])
def test_a_float32_q_that_sums_to_1_within_the_tolerance_is_judged_renormalised_as_the_draft_drew_from_it(form):
    """A sparse or float32 dense q may sum to 1 ± 1e-3 (check_distribution's tolerance): the
    draft drew in proportion to those values, so the target judges with q / Σq, as it does a
    float16 q. It used q as sent, and the output moved by up to the tolerance."""
    values = [0.5009, 0.3, 0.2]  # sums to 1.0009
    if form == "sparse":
        msg = pb.DraftToken(token_id=1, sparse=pb.SparseProbs(ids=[1, 4, 7], probs=values))
    else:
        msg = pb.DraftToken(token_id=1, dense=pb.DenseProbs(probs=[0.0, values[0], 0.0, 0.0, values[1], 0.0, 0.0, values[2]]))
    q = draft_from_pb(msg, 10).q  # [V]
    assert abs(float(q.sum()) - 1.0) < 1e-6
    expected = torch.tensor(values, dtype=torch.float64) / sum(values)
    assert torch.allclose(q[[1, 4, 7]].double(), expected, atol=1e-6)


# ---------------------------------------------------------------- random streams


def test_cycle_streams_are_reproducible_and_distinct_per_cycle_and_role():
    draw = lambda seed, cycle, role: torch.rand(4, generator=cycle_generator(seed, cycle, role)).tolist()
    assert draw(1, 0, DRAFT) == draw(1, 0, DRAFT)
    assert draw(1, 0, DRAFT) != draw(1, 1, DRAFT)
    assert draw(1, 0, DRAFT) != draw(1, 0, TARGET)
    assert draw(1, 0, DRAFT) != draw(2, 0, DRAFT)


# ---------------------------------------------------------------- session state


def committed_fetcher(committed):
    async def fetch(session_id, start, end):
        return committed[start:end]

    return fetch


def test_sync_keeps_the_valid_prefix_and_never_the_last_token():
    async def go():
        state = SessionState("s")
        fetch = committed_fetcher([])
        await state.sync(0, [1, 2, 3], fetch, 100)
        assert (state.held, state.pending) == ([], [1, 2, 3])
        state.feed(state.pending)
        state.pending = [9]  # e.g. a draft fed next
        state.feed([9])
        # The caller says the first 3 are valid and 4 follows.
        await state.sync(3, [4], fetch, 100)
        assert (state.held, state.pending) == ([1, 2, 3], [4])
        # Position covering everything: the last token is re-fed for its logits.
        state.feed([4])
        state.pending = []
        await state.sync(4, [], fetch, 100)
        assert (state.held, state.pending) == ([1, 2, 3], [4])

    asyncio.run(go())


def test_sync_fetches_what_a_restarted_service_lacks_from_the_store():
    async def go():
        state = SessionState("s")
        await state.sync(4, [5, 6], committed_fetcher([1, 2, 3, 4, 5, 6]), 100)
        assert state.tokens() == [1, 2, 3, 4, 5, 6]

    asyncio.run(go())


def test_a_draft_told_it_holds_more_than_it_does_keeps_its_own_tokens_only_as_far_as_they_are_committed():
    """The draft's sync (no committed_only) takes held[:position] on the caller's word, but a
    position past what it holds means the caller took it for another state of the session (a
    Resume, a replica it comes back to): its held tokens end in its own drafts, some rejected.
    committed[:position] is read from Redis and held kept only as far as it agrees; the
    rejected drafts used to stay as committed text for the rest of the session."""
    async def go():
        committed = [1, 2, 3, 4, 1, 2]
        fetch = committed_fetcher(committed)
        state = SessionState("s")
        await state.sync(0, list(committed), fetch, 100)
        state.feed(state.pending + [3, 4, 1])  # drafted 3, 4, 1, 6: fed all but the last
        state.pending = [6]
        committed += [9, 8, 7, 6, 5]  # none accepted, 9 resampled; then cycles without drafts
        await state.sync(len(committed) - 1, committed[-1:], fetch, 100)
        assert state.tokens() == committed
        assert state.held == [1, 2, 3, 4, 1, 2] and state.pending == [9, 8, 7, 6, 5]  # the cache of the agreeing part kept
        # A caller unsure of what the draft holds sends it all at position 0: the cache of
        # what that repeats is kept, not rebuilt.
        state.feed(state.pending[:-1])
        state.pending = state.pending[-1:]
        await state.sync(0, committed + [4], fetch, 100)
        assert state.held == committed[:-1] and state.pending == [5, 4]

    asyncio.run(go())


def test_a_draft_that_must_read_a_commit_on_its_way_waits_for_it_when_told_to():
    """A Propose sent before its cycle's commit landed (prefetch_draft) to a draft that no
    longer holds the session: with wait_s (ProposeRequest.awaits_commit) the read is repeated
    until the commit lands; without, refused OUT_OF_RANGE at once, as before."""
    async def go():
        committed = [1, 2, 3, 4, 5, 6]
        fetch = committed_fetcher(committed)
        with pytest.raises(OutOfRange, match="past the session's 6 committed tokens"):
            await SessionState("s").sync(8, [9], fetch, 100)

        async def land_later():
            await asyncio.sleep(0.05)
            committed.extend([7, 8, 9])

        landing = asyncio.ensure_future(land_later())
        state = SessionState("s")
        await state.sync(8, [9], fetch, 100, wait_s=2.0)
        await landing
        assert state.tokens() == [1, 2, 3, 4, 5, 6, 7, 8, 9]

    asyncio.run(go())


def test_sync_refuses_positions_past_the_session_and_ids_outside_the_vocabulary():
    async def go():
        state = SessionState("s")
        with pytest.raises(OutOfRange):
            await state.sync(10, [1], committed_fetcher([1, 2]), 100)
        with pytest.raises(InvalidArgument, match="outside the vocabulary"):
            await state.sync(0, [1, 100], committed_fetcher([]), 100)
        with pytest.raises(InvalidArgument, match="position"):
            await state.sync(-1, [1], committed_fetcher([]), 100)

    asyncio.run(go())


def test_pool_evicts_least_recently_used_but_never_a_busy_session():
    async def go():
        async def exists(_):
            return True

        pool = SessionPool(2, lambda: None)
        await pool.acquire("a", exists)
        await pool.acquire("b", exists)
        await pool.acquire("a", exists)  # a is now most recent
        await pool.acquire("c", exists)
        assert set(pool.sessions) == {"a", "c"} and pool.evictions == 1
        async with pool.use("a", exists):
            async with pool.use("c", exists):
                with pytest.raises(ResourceExhausted):
                    await pool.acquire("d", exists)

    asyncio.run(go())


def test_committed_only_sync_refuses_tokens_that_are_not_committed_and_changes_nothing():
    async def go():
        committed = [1, 2, 3, 4]
        fetch = committed_fetcher(committed)
        state = SessionState("s")
        await state.sync(0, [1, 2, 3], fetch, 100, committed_only=True)
        state.feed(state.pending)
        state.pending = []
        state.feed([7])  # an accepted draft, not committed (yet)
        before = (list(state.held), list(state.pending))
        # A foreign or stale caller claims [1, 2, 3, 7] and adds 8: neither is committed.
        with pytest.raises(FailedPrecondition, match="not session 's'.s committed tokens"):
            await state.sync(4, [8], fetch, 100, committed_only=True)
        with pytest.raises(FailedPrecondition):
            await state.sync(3, [9], fetch, 100, committed_only=True)
        assert (state.held, state.pending) == before
        # A caller that claims the unchecked draft 7 as held: the target keeps only what
        # agrees with Redis, and re-feeds the committed 4 in its place.
        committed.append(5)
        await state.sync(4, [5], fetch, 100, committed_only=True)
        assert (state.held, state.pending) == ([1, 2, 3], [4, 5]) and state.confirmed == 5
        with pytest.raises(OutOfRange):
            await state.sync(9, [], fetch, 100, committed_only=True)

    asyncio.run(go())


def test_a_claimed_call_works_while_its_tokens_are_checked_and_is_undone_when_they_are_not_committed():
    """SessionState.claimed (the target, held tokens all checked): the body runs on the
    caller's word; tokens that prove not to be committed undo the body's work (held,
    pending, the KV cache) and raise; committed ones leave it in place."""
    from specdec.kvcache import forward
    from specdec.models import build_tiny_model, build_tiny_tokenizer

    model = build_tiny_model(build_tiny_tokenizer(), hidden_size=32, num_layers=1, seed=0)

    async def go():
        committed = [1, 2, 3, 4]
        fetch = committed_fetcher(committed)
        state = SessionState("s", cache=new_cache(model.config))
        await state.sync(0, [1, 2, 3, 4], fetch, 100, committed_only=True)

        def work():  # what Verify does: feed pending + drafts, keep them
            forward(model, state.cache, state.pending + [6, 7])
            state.feed(state.pending + [6, 7])
            state.pending = [8]

        work()
        assert state.checked_below(4) and not state.checked_below(5)
        with pytest.raises(FailedPrecondition, match="not session 's'.s committed tokens"):
            async with state.claimed(4, [9], fetch, 100):  # 9 was never committed
                work()
        assert (state.held, state.pending, state.confirmed) == ([1, 2, 3, 4], [9], 4)
        assert state.cache.get_seq_length() == 4
        with pytest.raises(RuntimeError, match="forward failed"):
            async with state.claimed(4, [9], fetch, 100):
                raise RuntimeError("forward failed")
        assert state.held == [1, 2, 3, 4] and state.cache.get_seq_length() == 4

        committed.append(5)
        async with state.claimed(4, [5], fetch, 100):
            work()
        assert (state.held, state.pending) == ([1, 2, 3, 4, 5, 6, 7], [8])
        assert state.cache.get_seq_length() == 7

    asyncio.run(go())


def test_a_call_waits_for_a_commit_on_its_way_at_most_half_the_time_its_deadline_leaves():
    """A Propose's deadline is the draft's budget (--draft-timeout, 2 s): a wait of the full
    COMMIT_WAIT_S spent all of it, and the coordinator took the silent replica for a wedged one."""
    from types import SimpleNamespace

    from specdec.model_service import COMMIT_WAIT_S, commit_wait_s

    deadline = lambda s: SimpleNamespace(time_remaining=lambda: s)
    assert commit_wait_s(None) == commit_wait_s(deadline(None)) == COMMIT_WAIT_S == 2.0
    assert commit_wait_s(deadline(2.0)) == 1.0 and commit_wait_s(deadline(60.0)) == 2.0
    assert commit_wait_s(deadline(-1.0)) == 0.0


def test_a_commit_on_its_way_is_waited_for_and_a_missing_one_refused_once_the_wait_is_over():
    """With wait_s (VerifyRequest.awaits_commit) committed tokens that fall short are read
    again until they land; without it, or past it, the call is refused as before."""
    import time as clock

    async def go():
        committed = [1, 2, 3]
        fetch = committed_fetcher(committed)
        state = SessionState("s")
        await state.sync(0, [1, 2, 3], fetch, 100, committed_only=True)
        state.feed(state.pending)  # as a forward pass would
        state.pending = []
        with pytest.raises(ValueError, match="use sync"):
            async with state.claimed(4, [5], fetch, 100):
                pass

        async def land_later():
            await asyncio.sleep(0.05)
            committed.append(4)

        with pytest.raises(FailedPrecondition):
            await state.sync(3, [4], fetch, 100, committed_only=True)  # no wait: refused at once
        landing = asyncio.ensure_future(land_later())
        async with state.claimed(3, [4], fetch, 100, wait_s=2.0):
            pass
        await landing
        assert state.tokens() == [1, 2, 3, 4]
        state.feed(state.pending)
        state.pending = []
        started = clock.monotonic()
        with pytest.raises(FailedPrecondition):
            async with state.claimed(4, [5], fetch, 100, wait_s=0.1):  # 5 never lands
                pass
        assert 0.1 <= clock.monotonic() - started < 1.0
        committed.append(5)
        fresh = SessionState("t")  # a restarted target: the full sync waits the same way
        landing = asyncio.ensure_future(land_later())
        await fresh.sync(0, [1, 2, 3, 4, 5, 4], fetch, 100, committed_only=True, wait_s=2.0)
        await landing
        assert fresh.tokens() == [1, 2, 3, 4, 5, 4]

    asyncio.run(go())


def test_pool_evicts_idle_sessions_beyond_the_kv_memory_limit_but_never_a_busy_one():
    from transformers import DynamicCache

    from specdec.kvcache import forward
    from specdec.models import build_tiny_model, build_tiny_tokenizer

    model = build_tiny_model(build_tiny_tokenizer(), hidden_size=32, num_layers=1, seed=0)
    per_token = None

    async def go():
        nonlocal per_token

        async def exists(_):
            return True

        def fill(state, n):
            forward(model, state.cache, list(range(1, n + 1)))

        probe = DynamicCache(config=model.config)
        forward(model, probe, [1])
        per_token = cache_bytes(probe)
        pool = SessionPool(10, lambda: DynamicCache(config=model.config), max_cache_bytes=25 * per_token)
        for sid in ("a", "b"):
            async with pool.use(sid, exists) as state:
                fill(state, 10)
        assert pool.bytes_held == 20 * per_token and pool.evictions == 0
        # c's 10 tokens take the caches past 25 tokens' worth: a, the least recently used, goes.
        async with pool.use("c", exists) as state:
            fill(state, 10)
        assert list(pool.sessions) == ["b", "c"] and pool.bytes_held == 20 * per_token
        # Over the limit with every session busy: nothing is evicted, a new session is refused.
        async with pool.use("b", exists) as b, pool.use("c", exists) as c:
            fill(b, 10)
            fill(c, 10)
            with pytest.raises(ResourceExhausted, match="MiB"):
                await pool.acquire("d", exists)
        assert pool.bytes_held <= 25 * per_token

    asyncio.run(go())
    assert per_token > 0


def test_calls_for_one_session_share_its_state_and_one_waiting_for_it_keeps_it_from_eviction():
    """Two calls for a session the pool does not hold yet arrive together (a retried call
    overlapping its original) and both wait for Redis: they get the one state the pool holds
    and run one after the other (each used to make a state of its own, the first one's outside
    the pool and its memory budget). And a call waiting for its session's lock keeps the session
    from eviction when the call before it ends over the memory budget: it runs on the state the
    pool holds, not on one already dropped."""
    from transformers import DynamicCache

    from specdec.kvcache import forward
    from specdec.models import build_tiny_model, build_tiny_tokenizer

    model = build_tiny_model(build_tiny_tokenizer(), hidden_size=32, num_layers=1, seed=0)

    async def go():
        async def exists(_):
            await asyncio.sleep(0)  # Redis answering
            return True

        pool = SessionPool(10, lambda: DynamicCache(config=model.config))
        seen, order = [], []

        async def call(name):
            async with pool.use("s", exists) as state:
                seen.append(state)
                order.append(f"{name} in")
                await asyncio.sleep(0.01)
                order.append(f"{name} out")

        await asyncio.gather(call("first"), call("retry"))
        assert seen[0] is seen[1] is pool.sessions["s"]
        assert order == ["first in", "first out", "retry in", "retry out"]

        probe = DynamicCache(config=model.config)
        forward(model, probe, [1])
        pool = SessionPool(10, lambda: DynamicCache(config=model.config), max_cache_bytes=15 * cache_bytes(probe))
        waiting = asyncio.Event()

        async def second_call():
            waiting.set()
            async with pool.use("a", exists) as state:
                return state is pool.sessions.get("a"), pool.evictions

        async with pool.use("a", exists) as state:
            forward(model, state.cache, list(range(1, 21)))  # 20 tokens: over the budget when the call ends
            second = asyncio.ensure_future(second_call())
            await waiting.wait()
        assert await second == (True, 0)
        assert pool.evictions == 1 and "a" not in pool.sessions, "with no call left, the budget evicts it"

    asyncio.run(go())


def test_pool_refuses_sessions_the_store_does_not_know():
    async def go():
        async def exists(_):
            return False

        with pytest.raises(NotFound, match="unknown session"):
            await SessionPool(2, lambda: None).acquire("ghost", exists)

    asyncio.run(go())


# ---------------------------------------------------------------- adaptive K

from coordinator.adaptive import MAX_PROBE_EVERY, PROBE_EVERY, AdaptiveK
from specdec.speedup import expected_tokens_per_cycle


def feed(controller, cycles, alpha_draws, draft_ms_per_token, verify_ms):
    """Simulate cycles: the i-th draft of a cycle is accepted iff alpha_draws yields True."""
    for _ in range(cycles):
        k = controller.choose(16)
        accepted = 0
        for _ in range(k):
            if not next(alpha_draws):
                break
            accepted += 1
        controller.observe(k, accepted, k * draft_ms_per_token, verify_ms(k))


def bernoulli(p, seed=0):
    import random

    rng = random.Random(seed)
    while True:
        yield rng.random() < p


def test_adaptive_k_turns_speculation_off_for_a_useless_draft_but_keeps_probing():
    controller = AdaptiveK(max_k=8)
    feed(controller, 40, bernoulli(0.0), draft_ms_per_token=2.0, verify_ms=lambda k: 60 + 8 * k)
    chosen = [controller.choose(8) for _ in range(2 * PROBE_EVERY)]
    assert chosen.count(0) >= 2 * PROBE_EVERY - 2 and 1 in chosen


def test_rejected_probes_come_less_and_less_often_and_an_accepted_one_resets_them():
    controller = AdaptiveK(max_k=8)
    feed(controller, 40, bernoulli(0.0), draft_ms_per_token=2.0, verify_ms=lambda k: 60 + 8 * k)
    controller.cycles_since_probe, controller.probe_every = 0, PROBE_EVERY
    probes = []
    for cycle in range(2000):
        k = controller.choose(8)
        if k:
            probes.append(cycle)
        controller.observe(k, 0, 2.0 * k, 60 + 8 * k)
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert gaps[:3] == [2 * PROBE_EVERY, 4 * PROBE_EVERY, MAX_PROBE_EVERY] and set(gaps[3:]) == {MAX_PROBE_EVERY}
    assert controller.probe_every == MAX_PROBE_EVERY
    while not controller.choose(8):  # the next probe is accepted: back to probing every PROBE_EVERY
        controller.observe(0, 0, 0.0, 60)
    controller.observe(1, 1, 2.0, 68)
    assert controller.probe_every == PROBE_EVERY


def test_a_request_whose_draft_loses_probes_as_often_as_adaptive_k_says_not_twice_as_often(monkeypatch):
    """The gaps above, through the cycle loop: the next cycle's K was chosen twice, when its
    Propose was prefetched and again when the cycle began, and each choice of K = 0 counted
    towards the next probe: probes came after 16, 32, 64, 64 cycles instead of 32, 64, 128."""
    from coordinator.cycles import CycleLoop, Plan

    monkeypatch.setattr(AdaptiveK, "best_k", lambda self, limit, match_length=None: 0)  # speculation loses
    monkeypatch.setattr(AdaptiveK, "measured", lambda self: True)

    async def run():
        plan = Plan(session_id="s", prompt=[1, 2, 3], max_new_tokens=700, sampling=Sampling(0.0, 0, 1.0, 1), k=4,
                    eos_token_ids=frozenset(), max_context=0, draft_model="", draft_fingerprint="",
                    pipeline=False, adaptive=True)  # fmt: skip
        return [o async for o in CycleLoop(OneReplica(RecordingDraftStub()), OneReplica(RejectingTargetStub()),
                                           plain_store(), plan, None).run()]  # fmt: skip

    probes = [o.info.index for o in asyncio.run(run()) if o.info.drafted]
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert gaps[:3] == [2 * PROBE_EVERY, 4 * PROBE_EVERY, MAX_PROBE_EVERY] and set(gaps[3:]) == {MAX_PROBE_EVERY}, gaps


def test_one_slow_cycle_does_not_keep_its_k_or_speculation_off_for_thousands_of_cycles():
    """One cycle slowed by 30 s (a pause, a prefill, a retry's back-off) weighed in the fitted
    cost line as much as every other size's mean, and a K no longer chosen is never measured
    again: speculation stayed off in the coordinator-wide estimate for the next ~200 requests
    of 64 tokens (until the count underflowed, ~14,500 observations). Sizes weigh by their
    decayed count and stale ones drop out (STALE_COUNT): the requests after it draft as before."""
    import random

    rng = random.Random(1)

    def request(shared, slow_ms=0.0):  # 64 tokens, α 0.8, c_q 3 ms, a call 2 ms, verify 60 + 8k ms
        controller, made, ks = shared.session(8), 0, []
        while made < 64:
            k = controller.choose(min(8, 63 - made))
            accepted = next((i for i in range(k) if rng.random() >= 0.8), k)
            verify_ms = 60.0 + 8.0 * k + (slow_ms if len(ks) == 1 else 0.0)
            controller.observe(k, accepted, 2.0 + 3.0 * k if k else None, verify_ms if ks else None)
            made, ks = made + accepted + 1, ks + [k]
        return ks

    shared = AdaptiveK(max_k=8)
    for _ in range(20):
        request(shared)
    request(shared, slow_ms=30_000.0)
    after = [k for _ in range(50) for k in request(shared)]
    assert sum(k > 0 for k in after) >= 0.8 * len(after), f"{sum(k > 0 for k in after)} of {len(after)} cycles drafted"


def test_a_slow_plain_step_a_first_measurement_and_a_pipelined_draft_cost_each_count_as_measured():
    """Three ways a cost estimate went wrong, none of them for long now. (1) One plain step slowed
    by 30 s beside a useless draft (α 0.05) made K = 0 look slow; no plain step is measured while
    drafting, so the draft was asked every cycle for as long as it went on: the plain step's
    mean drops out once stale, read off the passes' line, and K = 0 comes back. (2) A first
    version capped each cost at 3x its estimate: a plain step's first measurement after a steep
    line through the passes (estimate 1e-3 ms) was stored as 0.003 ms. (3) ... and a draft whose
    pipelined cycles cost ~0 (their drafts came during the previous Verify) had its real calls
    clipped toward that, its c_draft collapsing to 0.08 ms for a 14 ms call."""
    import random

    rng = random.Random(1)

    def cycles(controller, n):
        ks = []
        for _ in range(n):
            k = controller.choose(8)
            accepted = next((i for i in range(k) if rng.random() >= 0.05), k)
            controller.observe(k, accepted, 2.0 + 30.0 * k if k else None, 60.0 + 8.0 * k)
            ks.append(k)
        return ks

    useless = AdaptiveK(max_k=8)
    cycles(useless, 400)
    useless.observe(0, 0, None, 30_060.0)
    after = cycles(useless, 2000)
    assert sum(k > 0 for k in after) <= 300 and sum(k > 0 for k in after[-1000:]) <= 60, sum(k > 0 for k in after)

    steep = AdaptiveK(max_k=8)
    for _ in range(5):
        steep.observe(3, 3, 5.0, 3.0)
        steep.observe(4, 4, 6.0, 95.0)
    steep.observe(0, 0, None, 60.0)
    assert steep.c_verify(0) == 60.0

    pipelined = AdaptiveK(max_k=8)
    for i in range(200):
        pipelined.observe(4, 4, 14.0 if i % 5 == 0 else 0.05, 50.0)  # 4 in 5 kept pipelined: ~0 ms
    assert 1.5 < pipelined.c_draft(4) < 6.0, pipelined.c_draft(4)


def test_a_probe_whose_cycle_drafted_nothing_ends_with_that_cycle():
    """A probe whose Propose failed (or fell on a cycle with drafting paused) left the probe
    flag set: the next cycles were never trimmed, and the next drafted cycle, probe or not,
    set the probe interval. The cycle after the probe's ends it, leaving the interval."""
    controller = AdaptiveK(max_k=8)
    feed(controller, 40, bernoulli(0.0), draft_ms_per_token=2.0, verify_ms=lambda k: 60 + 8 * k)
    while not controller.choose(8):
        controller.observe(0, 0, None, 60)
    every = controller.probe_every
    controller.observe(0, 0, None, 60)  # the probe's call failed: no drafts
    assert not controller.probing and controller.probe_every == every
    assert controller.trim(0, 4) == 0  # drafts are trimmed again: speculation loses


def test_adaptive_k_drafts_long_for_a_good_cheap_draft():
    controller = AdaptiveK(max_k=8)
    feed(controller, 60, bernoulli(0.95), draft_ms_per_token=1.0, verify_ms=lambda k: 60 + 5 * k)
    assert controller.choose(8) >= 6


def test_adaptive_k_maximises_the_seeds_expected_rate():
    """Independent acceptances: the position estimates come out near the one α, and K is
    the seed's best for it (within one: the estimates decay, so they stay noisy)."""
    verify = lambda k: 60 + 10 * k
    for seed in range(4):
        controller = AdaptiveK(max_k=8)
        feed(controller, 400, bernoulli(0.75, seed=seed), draft_ms_per_token=2.0, verify_ms=verify)
        assert abs(controller.alpha - 0.75) < 0.1
        assert all(abs(a - 0.75) < 0.2 for a in controller.position_alphas(0, 3))
        rate = lambda k: expected_tokens_per_cycle(0.75, k) / (k * 2.0 + verify(k)) if k else 1 / verify(0)
        assert abs(controller.choose(8) - max(range(9), key=rate)) <= 1
        assert controller.choose(8) == max(range(9), key=controller.rate)


def runs(first, then, seed=0):
    """Correlated acceptances, as an n-gram draft copying a passage has them: a cycle's first
    draft is accepted with probability `first`; after an accepted draft the next is accepted
    with probability `then`."""
    import random

    rng = random.Random(seed)
    previous = None
    while True:
        previous = rng.random() < (first if not previous else then)
        yield previous
        if not previous:
            previous = None


def test_adaptive_k_learns_that_a_draft_once_right_stays_right():
    """First drafts accepted 40% of the time, later ones 90% once reached (the extractive
    prompts' n-gram drafts measured 0.42, then 0.53, 0.75, 0.83): the per-position α̂ see it,
    and K is long."""
    controller = AdaptiveK(max_k=8)
    verify = lambda k: 100 + 6 * k  # verify passes cost about a step (packed kernels)
    for cycle in range(300):
        k = controller.choose(8)
        draws = runs(0.4, 0.9, seed=cycle)
        accepted = next((i for i in range(k) if not next(draws)), k)
        controller.observe(k, accepted, 1.0 * k, verify(k))
    first, *later = controller.position_alphas(0, 5)
    assert abs(first - 0.4) < 0.15 and min(later) > 0.7
    assert controller.choose(8) >= 5
    # the guess after 2 drafts is kept far more often than α̂_0 ^ 3 would say
    assert controller.keep_probability(2) > 2 * first**3


def test_expected_tokens_by_position_is_the_seeds_formula_at_one_alpha():
    from specdec.speedup import expected_tokens_by_position

    for alpha in (0.0, 0.3, 0.9, 1.0):
        for k in range(6):
            assert expected_tokens_by_position([alpha] * k) == pytest.approx(expected_tokens_per_cycle(alpha, k))
    assert expected_tokens_by_position([0.5, 1.0, 0.0]) == pytest.approx(1 + 0.5 + 0.5)
    with pytest.raises(ValueError):
        expected_tokens_by_position([1.5])


def test_adaptive_k_drafts_where_a_verify_pass_costs_less_than_a_plain_step():
    """Packed kernels on a CPU: a pass over 3-5 rows cost 0.71-0.74 of a single-row step
    here. A plain step's cost is its own estimate, not a point on the verify line, so a
    modest draft (α 0.3) is still used; a line through all sizes (slope clamped at 0, as
    verify costs cannot fall with k) priced K ≥ 1 at the mean and a plain step below it."""
    controller = AdaptiveK(max_k=8)
    verify = lambda k: 60.0 if k == 0 else 42.0 + 0.5 * k
    for cycle in range(60):  # plain steps (drafting paused) and cycles of 2 and 4 drafts
        k = (0, 2, 4)[cycle % 3]
        accepted = 1 if k and cycle % 10 < 3 else 0
        controller.observe(k, accepted, 3.5 * k if k else None, verify(k))
    assert controller.c_verify(0) == pytest.approx(60.0)
    assert controller.c_verify(3) == pytest.approx(43.5)
    assert controller.choose(8) > 0


def test_a_draft_calls_fixed_cost_is_not_charged_per_token():
    """An n-gram draft costs about one Propose round trip (2.5 ms) for 2 tokens or 6: c_draft
    is a line through the calls seen, not k times a mean cost per token, so 8 drafts are
    priced at a call, not 4x one."""
    controller = AdaptiveK(max_k=8)
    for cycle in range(40):
        k = (2, 6)[cycle % 2]
        controller.observe(k, 1, 2.5 + 0.01 * k, 55.0 + k)
    assert controller.c_draft(8) == pytest.approx(2.58, abs=0.01)
    assert controller.c_draft(0) == 0.0
    controller = AdaptiveK(max_k=8)  # one size seen: per token, as a model draft's cost grows
    controller.observe(2, 1, 8.0, 60.0)
    assert controller.c_draft(4) == pytest.approx(16.0)


def test_adaptive_k_respects_the_limit():
    controller = AdaptiveK(max_k=8)
    feed(controller, 30, bernoulli(1.0), draft_ms_per_token=0.5, verify_ms=lambda k: 50 + k)
    assert controller.choose(2) == 2 and controller.choose(0) == 0


def test_adaptive_k_verifies_long_ngram_matches_and_skips_short_ones():
    """Per-class α̂: an n-gram draft's 3-gram matches (accepted 90%) get a long K, its
    1-gram matches (accepted 10%) none, save a probe now and then; with the pooled α̂ of
    the two (~0.5) neither would get its right K."""
    controller = AdaptiveK(max_k=8)
    verify = lambda k: 90 + 25 * k  # a CPU: each verified token costs a quarter of a step
    draws = {3: bernoulli(0.9, seed=1), 1: bernoulli(0.1, seed=2)}
    for cycle in range(200):
        match_length = 3 if cycle % 2 else 1
        k = controller.trim(match_length, controller.choose(8, match_length))
        accepted = next((i for i in range(k) if not next(draws[match_length])), k)
        controller.observe(k, accepted, 0.01 * k, verify(k), match_length)
    assert controller.class_alpha(3) > 0.75 and controller.class_alpha(1) < 0.25
    assert controller.choose(8, 3) >= 4 and controller.trim(3, 8) >= 4
    chosen = []
    for _ in range(2 * MAX_PROBE_EVERY):
        chosen.append(controller.choose(8, 1))
        controller.observe(chosen[-1], 0, 0.01 * chosen[-1], verify(chosen[-1]), 1)
    assert chosen.count(0) >= len(chosen) - 2 and 1 in chosen  # skipped, but still probed
    assert controller.trim(1, 8) == 0  # drafts of a weak class that arrive anyway: not verified


def test_adaptive_k_keeps_every_draft_of_a_model_draft():
    """One class (a model draft): trim keeps the K that choose picked, so no drafting is wasted."""
    controller = AdaptiveK(max_k=8)
    feed(controller, 60, bernoulli(0.7, seed=4), draft_ms_per_token=5.0, verify_ms=lambda k: 60 + 10 * k)
    k = controller.choose(8)
    assert k > 0 and controller.trim(0, k) == k


def test_a_new_session_starts_from_what_earlier_sessions_learnt():
    shared = AdaptiveK(max_k=8)
    first = shared.session(8)
    feed(first, 40, bernoulli(0.0), draft_ms_per_token=2.0, verify_ms=lambda k: 60 + 8 * k)
    # The shared estimate learnt the draft is useless: a new session skips drafting at once.
    assert shared.alpha < 0.15
    assert shared.session(8).choose(8) == 0
    # A session's own observations stay its own as well.
    assert first.alpha < 0.15 and AdaptiveK(max_k=8).session(8).choose(8) > 0


# ---------------------------------------------------------------- models on a GPU


def run_sampled_cycles(device: str) -> list[tuple[int, int, list[int]]]:
    """Three sampled cycles of a tiny draft mixed with the prompt lookup and a tiny target, both
    on `device`, with the services' seeded CPU generators (specdec.rng) and each q through the
    wire; then plain sampled steps. Each cycle's (accepted, next token, plain tokens)."""
    from draft_service.drafters import ModelDrafter
    from specdec.kvcache import new_cache
    from specdec.models import LoadedModel, build_tiny_model, build_tiny_tokenizer
    from specdec.rng import DRAFT, TARGET, cycle_generator
    from specdec.wire import Sampling
    from target_service.verifier import Verifier

    tokenizer = build_tiny_tokenizer()

    def loaded(hidden, seed):
        model = build_tiny_model(tokenizer, hidden_size=hidden, num_layers=1, seed=seed, initializer_range=0.3).to(device)
        return LoadedModel(model=model, tokenizer=tokenizer, name="tiny", path="", vocab_fingerprint="",
                           vocab_size=len(tokenizer), max_context=0, device=device)  # fmt: skip

    drafter = ModelDrafter(loaded(32, 2), lookup_weights={1: 0.3, 2: 0.6})
    verifier = Verifier(loaded(64, 1))
    context = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]  # repeats: the lookup matches
    draft_state = SessionState("d", pending=list(context), cache=new_cache(drafter.model.config))
    target_state = SessionState("t", pending=list(context), cache=new_cache(verifier.model.config))
    sampling, verdicts = Sampling(1.0, 0, 1.0, seed=1), []
    with torch.inference_mode():
        for cycle in range(3):
            proposals = drafter.propose(draft_state, 3, sampling, cycle_generator(1, cycle, DRAFT))
            drafts = [draft_from_pb(draft_token_to_pb(i, token, q), len(tokenizer)) for i, (token, q, _) in enumerate(proposals)]
            verdict = verifier.verify(target_state, drafts, sampling, cycle_generator(1, cycle, TARGET))
            plain = verifier.verify(target_state, [], sampling, cycle_generator(1, 10 + cycle, TARGET), steps=3)
            verdicts.append((verdict.num_accepted, verdict.next_token, [plain.next_token, *plain.more_tokens]))
    return verdicts


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU here: runs where torch sees one")
def test_models_on_a_gpu_draft_with_the_lookup_and_verify_sampled_cycles_as_on_a_cpu():
    """The services' generators are CPU ones; torch refuses them for a GPU tensor, so every
    sampled Verify and plain step of a GPU target, and every draft mixed with the lookup on a
    GPU, failed. Now the uniforms are drawn on the CPU and moved (sampling.draw_uniforms): the
    same cycles run on a GPU, with the CPU's verdicts where float rounding allows."""
    on_gpu, on_cpu = run_sampled_cycles("cuda"), run_sampled_cycles("cpu")
    assert len(on_gpu) == 3 and all(len(plain) == 3 for _, _, plain in on_gpu)
    assert sum(a == b for a, b in zip(on_gpu, on_cpu)) >= 2


def test_the_lookup_mixes_its_token_into_q_on_qs_own_device():
    """torch's meta device stands for a GPU here (tensors without data): the weight and token
    tensors used to be made on the CPU, which a q on another device refuses."""
    from specdec.ngram import mix_lookup

    assert mix_lookup(torch.full((10,), 0.1, device="meta"), 3, 0.5).device.type == "meta"
    mixed = mix_lookup(torch.full((10,), 0.1), 3, 0.5)  # [V]
    assert torch.allclose(mixed, torch.tensor([0.05] * 3 + [0.55] + [0.05] * 6))


def test_sampled_cycles_with_the_lookup_run_on_the_cpu_as_the_gpu_test_runs_them():
    """The GPU test's cycles on the CPU: they draft, verify and step (so the GPU test, which
    this machine cannot run, exercises code that works) and are seeded: the same twice."""
    first = run_sampled_cycles("cpu")
    assert first == run_sampled_cycles("cpu") and len(first) == 3
    assert any(accepted > 0 for accepted, _, _ in first) and any(accepted < 3 for accepted, _, _ in first)


# ---------------------------------------------------------------- target threads


def test_the_target_takes_all_its_solo_threads_unless_the_draft_drafts_beside_it():
    """A draft on the same machine is idle during a cycle without drafts (adaptive K = 0) and
    during a Verify whose drafts are all in hand: the target then runs with --solo-threads,
    and with --threads only while the draft drafts on (pipelining: draft_busy)."""
    from transformers import DynamicCache

    from types import SimpleNamespace

    from specdec.models import build_tiny_model, build_tiny_tokenizer
    from specdec.draft_wire import Draft
    from target_service.verifier import Verifier

    model = build_tiny_model(build_tiny_tokenizer(), hidden_size=32, num_layers=1, seed=0)
    loaded = SimpleNamespace(model=model, max_context=512)
    before = torch.get_num_threads()
    try:
        verifier = Verifier(loaded, threads=1, solo_threads=2)
        state = SessionState("s", pending=[1, 2, 3], cache=DynamicCache(config=model.config))
        greedy = Sampling(0.0, 0, 1.0, 1)
        verifier.verify(state, [], greedy, cycle_generator(1, 0, TARGET))
        assert torch.get_num_threads() == 2
        verifier.verify(state, [Draft(token=4, q=None)], greedy, cycle_generator(1, 1, TARGET))
        assert torch.get_num_threads() == 2
        verifier.verify(state, [Draft(token=5, q=None)], greedy, cycle_generator(1, 2, TARGET), draft_busy=True)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_a_call_without_drafts_decodes_several_tokens_like_single_steps_and_stops_at_eos():
    from types import SimpleNamespace

    from transformers import DynamicCache

    from specdec.models import build_tiny_model, build_tiny_tokenizer
    from target_service.verifier import Verifier

    model = build_tiny_model(build_tiny_tokenizer(), hidden_size=32, num_layers=1, seed=0)
    greedy = Sampling(0.0, 0, 1.0, 1)

    def run(steps_per_call, calls, eos=(), sampling=greedy):
        verifier = Verifier(SimpleNamespace(model=model, max_context=512, eos_token_ids=list(eos)))
        state = SessionState("s", pending=[1, 2, 3], cache=DynamicCache(config=model.config))
        out = []
        for call in range(calls):
            verdict = verifier.verify(state, [], sampling, cycle_generator(1, call, TARGET), steps_per_call)
            out += [verdict.next_token, *verdict.more_tokens]
        return out, state

    single, _ = run(1, 8)
    several, state = run(4, 2)
    assert several == single
    assert state.held == [1, 2, 3, *several[:-1]] and state.pending == several[-1:]  # the last is not fed yet
    sampled = Sampling(1.0, 0, 1.0, 1)
    free, _ = run(8, 1, sampling=sampled)
    stop_at = next(i for i in range(1, 8) if free[i] not in free[:i])  # a token first seen mid-call
    stopped, _ = run(8, 1, eos=[free[stop_at]], sampling=sampled)
    assert stopped == free[: stop_at + 1]  # the same draws, and nothing after the end token


def test_plain_steps_stop_where_the_context_gets_an_ngram_match_and_match_single_steps():
    """With stop_at_ngram, a call of plain steps ends after the first token at which the
    context ends in an n-gram seen before (where an n-gram draft has something to propose);
    the tokens are those of single steps."""
    from types import SimpleNamespace

    from specdec.models import build_tiny_model, build_tiny_tokenizer
    from target_service.verifier import Verifier

    model = build_tiny_model(build_tiny_tokenizer(), hidden_size=32, num_layers=1, seed=0)
    greedy = Sampling(0.0, 0, 1.0, 1)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8]  # no repeated token: no match of any length yet

    def call(steps, stop):
        state = SessionState("s", pending=list(prompt), cache=new_cache(model.config))
        verdict = Verifier(SimpleNamespace(model=model, max_context=512, eos_token_ids=[])).verify(
            state, [], greedy, cycle_generator(1, 0, TARGET), steps, stop_at_ngram=stop
        )
        return [verdict.next_token, *verdict.more_tokens]

    free = call(12, None)
    context = list(prompt)
    first_match = None
    for i, token in enumerate(free):
        context.append(token)
        if find_continuation(context, 1, 2, 2)[0]:  # a bigram seen before
            first_match = i
            break
    assert first_match is not None and first_match < 11, free  # greedy tiny text repeats itself
    assert call(12, (2, 2)) == free[: first_match + 1]
    assert call(12, None) == free


# ---------------------------------------------------------------- pipelining by default


def test_a_cycle_pipelines_by_default_only_when_its_early_drafting_is_likely_kept():
    """α̂^(K+1) >= pipeline_min_keep: a prior of 0.5 does not pipeline K = 4 (0.5^5), a draft
    accepted 40 times in 40 does, one accepted a third of the time does not; a request that
    asks for pipelining (min_keep 0) pipelines every cycle, one that turns it off none."""
    from coordinator.cycles import CycleLoop, Plan

    def loop(min_keep=0.5, pipeline=True, accepted=0, judged=0):
        plan = Plan(session_id="s", prompt=[1], max_new_tokens=8, sampling=Sampling(0.0, 0, 1.0, 1), k=4,
                    eos_token_ids=frozenset(), max_context=0, draft_model="", draft_fingerprint="",
                    pipeline=pipeline, pipeline_min_keep=min_keep)  # fmt: skip
        cycles = CycleLoop(None, None, None, plan, None)
        cycles.accepted, cycles.judged = accepted, judged
        return cycles

    assert loop().keep_probability(4) == 0.5**5 and not loop().pipelines(4)
    assert loop(accepted=40, judged=40).pipelines(4)
    assert not loop(accepted=10, judged=30).pipelines(4)
    assert loop(min_keep=0.0).pipelines(4) and not loop(pipeline=False, accepted=40, judged=40).pipelines(4)


def test_ngram_first_looks_up_a_long_enough_match_and_leaves_every_other_cycle_to_the_model():
    """n-gram first (2, 3): a context ending in a 2-gram seen before gets the lookup (its
    continuation, enough for K and a guess; its class is the match length), one with only a
    1-gram match or none goes to the model (class 0); plain steps stop at such a match, in
    back-off too; adaptive K counts looked-up drafts as free."""
    from coordinator.adaptive import AdaptiveK
    from coordinator.cycles import CycleLoop, Plan

    plan = Plan(session_id="s", prompt=[1], max_new_tokens=8, sampling=Sampling(0.0, 0, 1.0, 1), k=2,
                eos_token_ids=frozenset(), max_context=0, draft_model="m", draft_fingerprint="f",
                ngram_first=(2, 3))  # fmt: skip
    cycles = CycleLoop(None, None, None, plan, None)
    match = cycles.look_up(2, [5, 6, 7, 8, 9, 5, 6])  # "5 6" seen before, followed by 7 8 9
    assert match == ([7, 8, 9], 2) and cycles.looks_up_here(match) and cycles.draft_class(match) == 2
    assert cycles.choose_k(2, match) == 2
    assert cycles.look_up(2, [5, 6, 7, 8, 9, 4, 6]) is None  # only "6" matches: the model drafts
    assert cycles.draft_class(None) == 0 and not cycles.looks_up_here(None) and cycles.choose_k(2, None) == 2
    assert cycles.ngram_stop() == pb.NgramStop(min_ngram=2, max_ngram=3)
    cycles.draft_paused_until = 5  # the draft service in back-off: lookups go on
    assert cycles.ngram_stop() == pb.NgramStop(min_ngram=2, max_ngram=3)
    lookup = cycles.start_propose([5, 6, 7, 8, 9, 5, 6], 0, None, 3, 0, match)
    assert [t.token_id for t in lookup.tokens] == [7, 8, 9]

    adaptive = AdaptiveK(4, free_classes=frozenset({2, 3}))
    for _ in range(20):  # a model draft that is slow and seldom right, n-gram drafts often right
        adaptive.observe(2, 0, 200.0, 60.0, match_length=0)
        adaptive.observe(2, 2, None, 60.0, match_length=2)
        adaptive.observe(0, 0, None, 55.0)
    assert adaptive.best_k(4, 0) == 0 and adaptive.best_k(4, 2) > 0
    assert AdaptiveK(4, classes=adaptive.classes, draft=adaptive.draft, verify=adaptive.verify).best_k(4, 2) == 0


# ---------------------------------------------------------------- prefetching the next draft


class RecordingDraftStub:
    """A draft whose Propose streams `k` copies of token 7 and records each request."""

    def __init__(self):
        self.requests: list = []
        self.started = asyncio.Event()

    def Propose(self, request, timeout=None):
        self.requests.append(request)
        self.started.set()
        return FakeDraftStream([pb.DraftToken(index=i, token_id=7) for i in range(request.k)])


class FakeDraftStream:
    def __init__(self, tokens):
        self.tokens = tokens

    def __aiter__(self):
        return self.stream()

    async def stream(self):
        for token in self.tokens:
            yield token

    def cancel(self):
        pass


class OneReplica:
    """coordinator.replicas.Replicas of one fixed replica whose stub is `stub`."""

    single = True
    adopted = None  # no target model named in Verify

    def __init__(self, stub):
        from coordinator.replicas import Replica

        self.replica = Replica("test", None, stub)

    def pick(self, session_id):
        return self.replica


class AcceptingTargetStub:
    """A target that accepts every draft and answers 7 as its next token."""

    async def Verify(self, request, timeout=None, wait_for_ready=None):
        return pb.VerifyResponse(num_accepted=len(request.drafts), next_token=7, bonus=bool(request.drafts))


class CommitWatchingStore:
    """A session store whose commit of cycle n notes whether the draft had already been asked
    for cycle n + 1 (waiting a moment for it, as a Redis round trip would)."""

    def __init__(self, draft: RecordingDraftStub):
        self.draft = draft
        self.asked_before_commit: list[bool] = []

    async def commit(self, session_id, cycle, tokens, increments, owner=""):
        self.draft.started.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.draft.started.wait(), 0.5)
        self.asked_before_commit.append(any(r.cycle == cycle + 1 for r in self.draft.requests))
        return cycle + 1, 0


def test_the_next_cycle_drafts_while_this_cycle_commits_and_nothing_else_changes():
    """Once a verdict is in, the next cycle's Propose starts before the Redis commit (the
    draft drafts while Redis writes and the client reads), asks exactly what the next cycle
    would ask (its position, tokens, K and cycle number), and the cycle that takes it is not
    counted as pipelined, and says `awaits_commit`. The last cycle starts nothing."""
    from coordinator.cycles import CycleLoop, Plan

    async def run():
        draft = RecordingDraftStub()
        store = CommitWatchingStore(draft)
        plan = Plan(session_id="s", prompt=[1, 2, 3], max_new_tokens=9, sampling=Sampling(0.0, 0, 1.0, 1), k=2,
                    eos_token_ids=frozenset(), max_context=0, draft_model="", draft_fingerprint="",
                    pipeline=False)  # fmt: skip
        loop = CycleLoop(OneReplica(draft), OneReplica(AcceptingTargetStub()), store, plan, None)
        outcomes = [outcome async for outcome in loop.run()]
        return draft.requests, store.asked_before_commit, outcomes

    requests, asked_before_commit, outcomes = asyncio.run(run())
    assert [len(o.tokens) for o in outcomes] == [3, 3, 3]  # K = 2, all accepted, + next token
    assert asked_before_commit == [True, True, False]  # the last cycle has no next one
    assert [r.cycle for r in requests] == [0, 1, 2]
    assert [(r.position, list(r.new_tokens), r.k) for r in requests] == [
        (0, [1, 2, 3], 2),  # the prompt
        (4, [7, 7], 2),  # the draft fed its drafts but the last: it lacks that one and the next token
        (7, [7, 7], 2),
    ]
    # the prefetched calls say their tokens' commit is on its way (a draft reading Redis waits for it)
    assert [r.awaits_commit for r in requests] == [False, True, True]
    assert not any(o.info.pipelined for o in outcomes)


class SyncingDraftStub:
    """A draft service's own sync rule (SessionState.sync) behind Propose, drafting 50, 51, ...
    Each call records the context it drafts after (and the committed tokens then)."""

    def __init__(self, committed: list[int]):
        self.state, self.committed, self.calls, self.contexts = SessionState("s"), committed, 0, []

    def Propose(self, request, timeout=None):
        self.calls += 1

        async def stream():
            async def fetch(session_id, start, end):
                return self.committed[start:end]

            await self.state.sync(request.position, list(request.new_tokens), fetch, 1000)
            self.contexts.append((self.state.tokens(), list(self.committed)))
            for i in range(request.k):
                self.state.feed(self.state.pending)
                self.state.pending = [50 + i]
                yield pb.DraftToken(index=i, token_id=50 + i)

        return GeneratedStream(stream())


class FailingOnceDraftStub(SyncingDraftStub):
    """SyncingDraftStub whose second call fails DEADLINE_EXCEEDED before it reaches the session
    (its deadline ran out in a queue)."""

    def Propose(self, request, timeout=None):
        if self.calls == 1:
            self.calls += 1
            return FailingDraftStream()
        return super().Propose(request, timeout)


class GeneratedStream:
    """A Propose call's stream whose tokens an async generator yields."""

    def __init__(self, tokens, initial_metadata=()):
        self.tokens = tokens
        self.metadata = initial_metadata  # what the service sent before its first token

    def __aiter__(self):
        return self.tokens

    async def initial_metadata(self):
        import grpc

        return grpc.aio.Metadata(*self.metadata)

    def cancel(self):
        pass


def FailingDraftStream(initial_metadata=()):
    async def failing():
        import grpc

        raise grpc.aio.AioRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                   "the draft's deadline ran out while it waited")  # fmt: skip
        yield

    return GeneratedStream(failing(), initial_metadata)


class ListStore:
    """A session store whose commits extend `committed`, a list of the session's tokens."""

    def __init__(self, committed: list[int]):
        self.committed = committed

    async def commit(self, session_id, cycle, tokens, increments, owner=""):
        self.committed.extend(tokens)
        return cycle + 1, len(self.committed)


class RejectingTargetStub:
    async def Verify(self, request, timeout=None, wait_for_ready=None):
        return pb.VerifyResponse(num_accepted=0, next_token=7, bonus=False)


class EmptyDraftStub:
    """A draft whose every Propose answers with no tokens (a draft model whose context is full)."""

    def __init__(self):
        self.calls = 0

    def Propose(self, request, timeout=None):
        self.calls += 1
        return FakeDraftStream([])


class StepsTargetStub:
    """A target whose every pass takes `ms` and decodes token 7 for each step asked."""

    def __init__(self, ms: float = 0.0, fail_calls: tuple[int, ...] = ()):
        self.ms, self.calls, self.fail_calls = ms, [], fail_calls  # calls (from 1) that fail UNAVAILABLE

    async def Verify(self, request, timeout=None, wait_for_ready=None):
        self.calls.append(request)
        await asyncio.sleep(self.ms / 1000)
        if len(self.calls) in self.fail_calls:
            raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), "busy")
        return pb.VerifyResponse(num_accepted=0, next_token=7, more_tokens=[7] * (request.steps - 1))


def plain_store():
    """A session store whose every commit lands (the next cycle, length 0) and whose ping answers."""
    from types import SimpleNamespace

    return SimpleNamespace(commit=lambda session_id, cycle, *rest, **options: asyncio.sleep(0, (cycle + 1, 0)),
                           ping=lambda: asyncio.sleep(0))  # fmt: skip


def test_a_draft_that_answers_with_no_drafts_is_backed_off_not_asked_every_cycle():
    """A draft that answers every Propose with nothing and no error (another implementation of
    the Draft service) was asked again each cycle, which, having asked, made one token: 40
    tokens took 40 cycles and 39 calls. It is backed off as a failed draft is (1, 2, 4, ...
    cycles of plain steps)."""
    from coordinator.cycles import CycleLoop, Plan

    async def run():
        plan = Plan(session_id="s", prompt=[1, 2, 3], max_new_tokens=40, sampling=Sampling(0.0, 0, 1.0, 1), k=4,
                    eos_token_ids=frozenset(), max_context=0, draft_model="", draft_fingerprint="",
                    pipeline=False)  # fmt: skip
        draft = EmptyDraftStub()
        outcomes = [o async for o in CycleLoop(OneReplica(draft), OneReplica(StepsTargetStub()), plain_store(), plan,
                                               None).run()]  # fmt: skip
        return outcomes, draft.calls

    outcomes, calls = asyncio.run(run())
    assert sum(len(o.tokens) for o in outcomes) == 40
    assert len(outcomes) <= 15 and calls <= 6, (len(outcomes), calls)


def test_a_requests_cycle_propose_is_cancelled_when_the_request_ends_with_an_error():
    """The cycle's own Propose was cancelled only once its Verify succeeded: a request that
    ended meanwhile (an error, the client gone) left the draft drafting for it, its session
    held, until the call's budget ran out."""
    from coordinator.cycles import CycleLoop, Plan

    class Stream(FakeDraftStream):
        cancelled = False

        def cancel(self):
            self.cancelled = True

    class Draft:
        streams: list = []

        def Propose(self, request, timeout=None):
            self.streams.append(Stream([pb.DraftToken(index=i, token_id=7) for i in range(request.k)]))
            return self.streams[-1]

    class FailingTarget:
        async def Verify(self, request, timeout=None, wait_for_ready=None):
            raise grpc.aio.AioRpcError(grpc.StatusCode.INTERNAL, grpc.aio.Metadata(), grpc.aio.Metadata(), "broken")

    async def run():
        plan = Plan(session_id="s", prompt=[1, 2, 3], max_new_tokens=40, sampling=Sampling(0.0, 0, 1.0, 1), k=4,
                    eos_token_ids=frozenset(), max_context=0, draft_model="", draft_fingerprint="",
                    pipeline=False)  # fmt: skip
        draft = Draft()
        with pytest.raises(grpc.aio.AioRpcError):
            [o async for o in CycleLoop(OneReplica(draft), OneReplica(FailingTarget()), plain_store(), plan, None).run()]
        return draft.streams

    streams = asyncio.run(run())
    assert len(streams) == 1 and streams[0].cancelled


def test_a_draft_call_cancelled_before_its_stream_began_gives_what_it_has_and_does_not_wait():
    """Cancelled before its reading task ran, a DraftCall never marked itself finished (the
    task's `finally` never ran), so asking it for its tokens waited forever."""
    from opentelemetry import trace

    from coordinator.cycles import DraftCall

    async def run():
        replicas = OneReplica(RecordingDraftStub())
        call = DraftCall(replicas.replica, pb.ProposeRequest(k=3), 1.0, frozenset(), trace.get_tracer("test"))
        call.cancel()
        return await asyncio.wait_for(call.first(3), timeout=2)

    assert asyncio.run(run()) == []


def test_adaptive_k_learns_no_cost_from_a_resumed_runs_first_cycle_or_a_retried_verify():
    """A Resume's first cycle (its cycle index not 0) prefills the context on both services, and
    a Verify sent again waited out its back-off: their times are no pass's cost. The first
    went into the coordinator-wide estimate (its verify mean rose from 10 to 250 ms)."""
    from coordinator.cycles import CycleLoop, Plan, Stats

    async def run(resume: bool, fail_calls: tuple[int, ...]):
        shared = AdaptiveK(4)
        plan = Plan(session_id="s", prompt=list(range(1, 50)), max_new_tokens=4, sampling=Sampling(0.0, 0, 1.0, 1),
                    k=2, eos_token_ids=frozenset(), max_context=0, draft_model="", draft_fingerprint="",
                    pipeline=False, adaptive=True)  # fmt: skip
        target = StepsTargetStub(ms=1.0, fail_calls=fail_calls)
        loop = CycleLoop(OneReplica(RecordingDraftStub()), OneReplica(target), plain_store(), plan, None,
                         shared_k=shared)  # fmt: skip
        if resume:
            loop.resume_at(plan.prompt + [7, 7], cycle=2, stats=Stats())
        [o async for o in loop.run()]
        return sum(count for _, count in shared.verify.values()), len(target.calls)

    fresh, _ = asyncio.run(run(False, ()))  # 4 cycles: the last 3 timed
    resumed, _ = asyncio.run(run(True, ()))  # 2 cycles: the last timed
    retried, calls = asyncio.run(run(False, (2, 3)))  # the second cycle's Verify sent 3 times: not timed
    assert (round(fresh, 4), resumed, round(retried, 4), calls) == (2.8525, 1.0, 1.95, 6)


def test_a_draft_call_that_failed_before_reaching_the_session_leaves_the_drafts_position_where_it_was():
    """After a cycle whose drafts were all rejected, the next Propose fails before it reaches the
    draft's session: the draft still holds the rejected draft it fed. The coordinator used to
    count the committed token as held there anyway, so the draft went on after [.., 50, 7]
    where the text is [.., 7, 7], for the rest of the session (acceptance, not the output)."""
    from coordinator.cycles import CycleLoop, Plan

    committed = [1, 2, 3]

    async def run():
        draft = FailingOnceDraftStub(committed)
        plan = Plan(session_id="s", prompt=[1, 2, 3], max_new_tokens=5, sampling=Sampling(0.0, 0, 1.0, 1), k=2,
                    eos_token_ids=frozenset(), max_context=0, draft_model="", draft_fingerprint="",
                    pipeline=False)  # fmt: skip
        outcomes = [o async for o in CycleLoop(OneReplica(draft), OneReplica(RejectingTargetStub()), ListStore(committed), plan, None).run()]
        return draft, outcomes

    draft, outcomes = asyncio.run(run())
    assert sum(len(o.tokens) for o in outcomes) == 5 and draft.calls >= 3 and committed == [1, 2, 3] + [7] * 5
    assert all(context == committed[: len(context)] for context, _ in draft.contexts), draft.contexts


class AlternatingReplicas(OneReplica):
    """Replicas of the draft service whose pick alternates between two, A B A B ...: a session
    that fails over and back. Each stub keeps its own state of the session."""

    single = False

    def __init__(self, stubs):
        from coordinator.replicas import Replica

        self.replicas = [Replica(f"r{i}", None, stub) for i, stub in enumerate(stubs)]
        self.picks = 0

    def pick(self, session_id):
        self.picks += 1
        return self.replicas[self.picks % 2]


def test_a_session_that_drafts_on_another_replica_and_comes_back_drafts_after_the_committed_text():
    """Drafts on replica A, then B, then A again, every draft rejected: A still holds its own
    rejected drafts where the text has the target's tokens since. The coordinator told A it
    held the committed prefix up to where B left off, and A took its stale tokens for that
    text for the rest of the session (acceptance, not the output); a call to another replica
    than the last one now sends the whole context, and A keeps only the cache of what it repeats."""
    from coordinator.cycles import CycleLoop, Plan

    committed = [1, 2, 3]

    async def run():
        drafts = [SyncingDraftStub(committed), SyncingDraftStub(committed)]
        plan = Plan(session_id="s", prompt=[1, 2, 3], max_new_tokens=8, sampling=Sampling(0.0, 0, 1.0, 1), k=2,
                    eos_token_ids=frozenset(), max_context=0, draft_model="", draft_fingerprint="",
                    pipeline=False)  # fmt: skip
        outcomes = [o async for o in CycleLoop(AlternatingReplicas(drafts), OneReplica(RejectingTargetStub()),
                                               ListStore(committed), plan, None).run()]  # fmt: skip
        return drafts, outcomes

    drafts, outcomes = asyncio.run(run())
    assert sum(len(o.tokens) for o in outcomes) == 8 and committed == [1, 2, 3] + [7] * 8
    contexts = [context for draft in drafts for context, _ in draft.contexts]
    assert len(contexts) >= 6
    assert all(context == committed[: len(context)] for context in contexts), contexts


def test_a_pipelined_call_to_the_replica_that_drafted_sends_only_what_it_lacks():
    """The speculative Propose for cycle n + 1 goes to the replica that drafted cycle n, which
    holds the context and those drafts: it is sent the guess alone. Compared with the replica
    of the cycle before (none on the first cycle), it went at position 0 with the whole
    context, prompt and all, once per request and after each failover."""
    from coordinator.cycles import CycleLoop, Plan

    class Store:
        async def commit(self, session_id, cycle, tokens, increments, owner=""):
            return cycle + 1, 0

    async def run():
        draft = RecordingDraftStub()
        plan = Plan(session_id="s", prompt=list(range(1, 41)), max_new_tokens=9, sampling=Sampling(0.0, 0, 1.0, 1), k=2,
                    eos_token_ids=frozenset(), max_context=0, draft_model="", draft_fingerprint="")  # fmt: skip
        outcomes = [o async for o in CycleLoop(OneReplica(draft), OneReplica(AcceptingTargetStub()), Store(), plan, None).run()]
        return draft.requests, outcomes

    requests, outcomes = asyncio.run(run())
    assert any(o.info.pipelined for o in outcomes), "the test needs a pipelined cycle"
    assert [(r.position, len(r.new_tokens)) for r in requests[:2]] == [(0, 40), (42, 1)]


class NoDraftReplica(OneReplica):
    """Replicas of the draft service with none to ask: every one refused (Replicas.pick)."""

    def pick(self, session_id):
        raise Unavailable("every draft replica at d:1 differs from what this coordinator started with")


class TargetArrivingLate(OneReplica):
    """Replicas of the target service with none answered yet for the first `gaps` picks: one
    that replaced the only other behind a dns:/// name, before its first ModelInfo."""

    single = False

    def __init__(self, stub, gaps: int):
        super().__init__(stub)
        self.gaps = gaps

    def pick(self, session_id):
        from coordinator.replicas import NoReplicaYet

        if self.gaps:
            self.gaps -= 1
            raise NoReplicaYet("no target replica at dns:///target:50053 has answered yet; retry shortly")
        return self.replica


def test_a_verify_with_no_target_replica_answered_yet_waits_for_one_as_for_a_lost_call():
    """It used to end the request UNAVAILABLE at once, where a lost call is retried within the
    deadline; every replica refused (another model) still fails at once."""
    from coordinator.cycles import CycleLoop, Plan

    async def run(targets):
        store = CommitWatchingStore(RecordingDraftStub())
        plan = Plan(session_id="s", prompt=[1, 2, 3], max_new_tokens=3, sampling=Sampling(0.0, 0, 1.0, 1), k=2,
                    eos_token_ids=frozenset(), max_context=0, draft_model="", draft_fingerprint="",
                    pipeline=False)  # fmt: skip
        return [outcome async for outcome in CycleLoop(NoDraftReplica(None), targets, store, plan, None).run()]

    late = TargetArrivingLate(AcceptingTargetStub(), gaps=2)
    assert sum(len(o.tokens) for o in asyncio.run(run(late))) == 3 and late.gaps == 0
    with pytest.raises(Unavailable, match="every draft replica at d:1 differs"):
        asyncio.run(run(NoDraftReplica(None)))  # stands for every replica refused: a plain Unavailable


class SilentDraftStub:
    """A draft whose every Propose ends DEADLINE_EXCEEDED having sent nothing (a frozen host);
    `began`: having sent its first answer only; `serving`: while other sessions' Proposes on
    `replica` stream tokens (a live replica prefilling one session's long prompt, say)."""

    def __init__(self, began: bool = False, serving: bool = False):
        self.calls = 0
        self.began, self.serving = began, serving
        self.replica = None  # the Replica it is, for `serving`

    def Propose(self, request, timeout=None):
        from specdec.wire import PROPOSE_STARTED

        self.calls += 1
        stream = FailingDraftStream(PROPOSE_STARTED if self.began else ())
        if self.serving:
            failing = stream.tokens

            async def serving_others():
                await asyncio.sleep(0.01)
                self.replica.answered_at = time.monotonic()  # another session's token, meanwhile
                async for token in failing:
                    yield token

            stream.tokens = serving_others()
        return stream


def test_a_draft_replica_silent_for_a_whole_propose_budget_is_skipped_where_there_are_others():
    """A Propose that hears nothing for its whole budget (a frozen replica: DEADLINE_EXCEEDED)
    now marks its replica failed, as a lost call does, when another replica can be asked; it
    used to be asked again every drafting cycle. With one replica there is nowhere else to go;
    with a budget cut short by the request's deadline, the replica is not to blame."""
    from coordinator.cycles import DRAFT_TIMEOUT_S, CycleLoop, Plan

    async def run(drafts, deadline_s=None, draft_timeout_s=DRAFT_TIMEOUT_S):
        store = CommitWatchingStore(RecordingDraftStub())
        plan = Plan(session_id="s", prompt=[1, 2, 3], max_new_tokens=2, sampling=Sampling(0.0, 0, 1.0, 1), k=2,
                    eos_token_ids=frozenset(), max_context=0, draft_model="", draft_fingerprint="",
                    pipeline=False)  # fmt: skip
        deadline = None if deadline_s is None else time.monotonic() + deadline_s
        loop = CycleLoop(drafts, OneReplica(AcceptingTargetStub()), store, plan, deadline, draft_timeout_s=draft_timeout_s)
        return [o async for o in loop.run()]

    several, alone, near_its_deadline, deadline_only = (OneReplica(SilentDraftStub()) for _ in range(4))
    several.single = near_its_deadline.single = deadline_only.single = False
    assert sum(len(o.tokens) for o in asyncio.run(run(several))) == 2
    assert several.replica.down_until > time.monotonic(), "skipped for a while"
    assert sum(len(o.tokens) for o in asyncio.run(run(alone))) == 2 and alone.replica.down_until == 0
    # A request 1 s from its deadline gives a Propose a quarter of that, not --draft-timeout (2 s):
    # silent for so short a budget, a healthy replica is not to be skipped for every session on it.
    assert sum(len(o.tokens) for o in asyncio.run(run(near_its_deadline, deadline_s=1.0))) == 2
    assert near_its_deadline.replica.down_until == 0
    # --draft-timeout 0 ("only the deadline"): the deadline's share is the whole budget.
    assert sum(len(o.tokens) for o in asyncio.run(run(deadline_only, deadline_s=1.0, draft_timeout_s=0.0))) == 2
    assert deadline_only.replica.down_until > time.monotonic()


def test_a_draft_replica_that_began_a_propose_and_ran_past_its_budget_is_busy_and_not_skipped():
    """A draft service sends its first answer (PROPOSE_STARTED, initial metadata) before any
    prefill or queue. A Propose that got it and then ran past --draft-timeout while the replica
    streamed other sessions' tokens (a long prompt's first call, prefilling in chunks between
    their passes; the chunks it fed are kept for the next call) reached a live, busy replica:
    the cycle runs target-only, and the replica stays, with every other session on it. It used
    to be marked failed as a frozen one is, its sessions moved to the others, where the same
    long prompt made each of them fail in turn."""
    from coordinator.cycles import CycleLoop, Plan

    async def run(drafts):
        store = CommitWatchingStore(RecordingDraftStub())
        plan = Plan(session_id="s", prompt=[1, 2, 3], max_new_tokens=2, sampling=Sampling(0.0, 0, 1.0, 1), k=2,
                    eos_token_ids=frozenset(), max_context=0, draft_model="", draft_fingerprint="",
                    pipeline=False)  # fmt: skip
        return [o async for o in CycleLoop(drafts, OneReplica(AcceptingTargetStub()), store, plan, None).run()]

    busy = OneReplica(SilentDraftStub(began=True, serving=True))
    busy.replica.stub.replica = busy.replica
    wedged, silent = OneReplica(SilentDraftStub(began=True)), OneReplica(SilentDraftStub())
    busy.single = wedged.single = silent.single = False
    assert sum(len(o.tokens) for o in asyncio.run(run(busy))) == 2 and busy.replica.stub.calls >= 1
    assert busy.replica.down_until == 0 and not busy.replica.recovering
    # Began the call and served nothing since (a hung worker): skipped, as a frozen one is.
    for lost in (wedged, silent):
        assert sum(len(o.tokens) for o in asyncio.run(run(lost))) == 2
        assert lost.replica.down_until > time.monotonic()


class TargetHoldingAnEarlierSession:
    """A target whose first Verify fails as a model service fails a call on a state of an
    earlier session of the same id (errors.SessionRecreated); then it accepts."""

    def __init__(self):
        self.calls = 0

    async def Verify(self, request, timeout=None, wait_for_ready=None):
        from specdec.errors import SessionRecreated, status_for

        self.calls += 1
        if self.calls == 1:
            code, details = status_for(SessionRecreated("session 's' was created again since this target held it"))
            raise grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)
        return pb.VerifyResponse(num_accepted=0, next_token=7)


def test_a_verify_refused_for_a_stale_state_of_its_session_is_sent_again_and_its_replica_is_not_skipped():
    """A target that dropped a stale state of the session (created again under its id) answered
    UNAVAILABLE, which the coordinator takes for a replica lost: it skipped a healthy replica,
    every session on it moving and rebuilding elsewhere. ABORTED is retried, the replica kept."""
    from coordinator.cycles import CycleLoop, Plan

    async def run(targets):
        plan = Plan(session_id="s", prompt=[1, 2, 3], max_new_tokens=1, sampling=Sampling(0.0, 0, 1.0, 1), k=2,
                    eos_token_ids=frozenset(), max_context=0, draft_model="", draft_fingerprint="",
                    pipeline=False)  # fmt: skip
        store = CommitWatchingStore(RecordingDraftStub())
        store.ping = lambda: asyncio.sleep(0)
        return [o async for o in CycleLoop(NoDraftReplica(None), targets, store, plan, None).run()]

    targets = OneReplica(TargetHoldingAnEarlierSession())
    targets.single = False
    assert [o.tokens for o in asyncio.run(run(targets))] == [[7]] and targets.replica.stub.calls == 2
    assert targets.replica.down_until == 0 and not targets.replica.recovering


class TargetPastTheSession:
    """A target whose every Verify finds the call's position past the session's tokens, as for
    a run whose session was deleted and created again, shorter, under its id."""

    async def Verify(self, request, timeout=None, wait_for_ready=None):
        from specdec.errors import OutOfRange, status_for

        code, details = status_for(OutOfRange(f"position {request.position} is past the session's 2 committed tokens"))
        raise grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


def test_a_run_whose_session_was_deleted_or_taken_over_ends_not_found_or_aborted_not_out_of_range():
    """A stream whose session was deleted and created again under its id (the "regenerate"
    pattern) ended OUT_OF_RANGE "position 3 is past the session's 2 committed tokens", which
    reads as the client's own request out of range; now Redis is asked whose the session is."""
    from coordinator.cycles import CycleLoop, Plan
    from specdec.errors import Aborted, NotFound

    async def run(meta: dict | None):
        store = CommitWatchingStore(RecordingDraftStub())
        store.ping = lambda: asyncio.sleep(0)

        async def read_meta(session_id):
            if meta is None:
                raise NotFound(f"session {session_id!r} does not exist (expired, deleted or never created)")
            return meta

        store.meta = read_meta
        plan = Plan(session_id="s", prompt=[1, 2, 3], max_new_tokens=2, sampling=Sampling(0.0, 0, 1.0, 1), k=2,
                    eos_token_ids=frozenset(), max_context=0, draft_model="", draft_fingerprint="",
                    pipeline=False, owner="mine")  # fmt: skip
        return [o async for o in CycleLoop(NoDraftReplica(None), OneReplica(TargetPastTheSession()), store, plan, None).run()]

    with pytest.raises(Aborted, match="session 's' was deleted or resumed by another request"):
        asyncio.run(run({"owner": "another run's"}))
    with pytest.raises(NotFound, match="does not exist"):
        asyncio.run(run(None))
    with pytest.raises(grpc.aio.AioRpcError) as still_mine:  # the session is this run's: the target's word stands
        asyncio.run(run({"owner": "mine"}))
    assert still_mine.value.code() == grpc.StatusCode.OUT_OF_RANGE


def test_with_no_draft_replica_to_ask_the_cycles_run_target_only_and_the_request_completes():
    """A Propose that cannot be sent (every draft replica refused) is a cycle without drafts,
    as a failed one is: the target decodes, the request ends, nothing is drafted."""
    from coordinator.cycles import CycleLoop, Plan

    async def run():
        store = CommitWatchingStore(RecordingDraftStub())
        plan = Plan(session_id="s", prompt=[1, 2, 3], max_new_tokens=6, sampling=Sampling(0.0, 0, 1.0, 1), k=2,
                    eos_token_ids=frozenset(), max_context=0, draft_model="", draft_fingerprint="",
                    pipeline=False)  # fmt: skip
        loop = CycleLoop(NoDraftReplica(None), OneReplica(AcceptingTargetStub()), store, plan, None)
        return [outcome async for outcome in loop.run()]

    outcomes = asyncio.run(run())
    assert sum(len(o.tokens) for o in outcomes) == 6
    assert all(o.info.drafted == 0 for o in outcomes) and all(t == 7 for o in outcomes for t in o.tokens)


def test_a_seed_the_services_would_refuse_is_a_value_error_in_the_sdk_that_says_the_range():
    from specdec.client import build_request

    options = dict(prompt_token_ids=None, max_new_tokens=4, temperature=1.0, top_k=0, top_p=1.0, num_speculative_tokens=None,
                   speculate=True, stop=None, session_id=None, ignore_eos=False)  # fmt: skip
    for seed in (-1, 2**63, 2**64):
        with pytest.raises(ValueError, match=f"seed must be an integer at least 0 and at most {2**63 - 1}, got {seed}"):
            build_request("hi", seed=seed, **options)
    assert build_request("hi", seed=2**63 - 1, **options).sampling.seed == 2**63 - 1


def test_every_channel_pings_its_peer_and_specdecs_servers_take_those_pings_as_often_as_they_come():
    """A frozen peer is found by keepalive (test_faults, test_resume); a server that took the
    pings as abuse (gRPC's default: one each 5 minutes while no data flows) would drop a long
    quiet call after two strikes (measured: 49 s into a call with 10 s pings)."""
    from specdec.client import GRPC_OPTIONS, KEEPALIVE_OPTIONS
    from specdec.serving import CLIENT_OPTIONS, SERVER_OPTIONS

    keepalive = dict(KEEPALIVE_OPTIONS)
    assert set(KEEPALIVE_OPTIONS) <= set(GRPC_OPTIONS) and set(KEEPALIVE_OPTIONS) <= set(CLIENT_OPTIONS)
    assert keepalive["grpc.http2.ping_timeout_ms"] < keepalive["grpc.keepalive_time_ms"] <= 15_000
    assert dict(SERVER_OPTIONS)["grpc.http2.min_ping_interval_without_data_ms"] <= keepalive["grpc.keepalive_time_ms"]
    assert set(KEEPALIVE_OPTIONS) <= set(SERVER_OPTIONS)  # the servers ping their clients too


def test_an_address_is_host_port_or_a_grpc_target_and_the_sdk_refuses_one_that_names_no_server():
    from specdec.client import AsyncClient, Client
    from specdec.ranges import address_problem, join_host_port, listen_host

    assert [join_host_port(h, 7) for h in ("127.0.0.1", "::", "[::1]", "name")] == ["127.0.0.1:7", "[::]:7", "[::1]:7", "name:7"]
    for host in ("::", "::1", "[::1]", "fe80::1", "0.0.0.0", "my-host"):
        assert listen_host(host) == host
    for bad in ("[::1]:7600", "0.0.0.0:7600", "http://0.0.0.0", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            listen_host(bad)

    for good in ["127.0.0.1:50051", "coordinator", "[::1]:7600", "::1", "[::1]", "ipv6:[::1]", "dns:///specdec.svc:50051", "unix:/tmp/s.sock",
                 "ipv4:10.0.0.5:50051,10.0.0.6:50051", "ipv6:[::1]:7600", "dns://8.8.8.8/c.example:443", " a:1 "]:
        assert address_problem(good) is None, good
    for bad, says in [
        ("", "the address is empty"),
        ("http://127.0.0.1:7600/", "is a URL; give the address as HOST:PORT, e.g. '127.0.0.1:7600'"),
        ("127.0.0.1:99999", "'127.0.0.1:99999' is not HOST:PORT: the port must be an integer at least 1 and at most 65535"),
        ("127.0.0.1:7600/", "'127.0.0.1:7600/' is not HOST:PORT"),
        ("dns:///coordinator:x", "'coordinator:x' in 'dns:///coordinator:x' is not HOST:PORT"),
        ("ipv4:10.0.0.5:1,10.0.0.6:0", "'10.0.0.6:0' in 'ipv4:10.0.0.5:1,10.0.0.6:0' is not HOST:PORT"),
        ("localhost:]", "'localhost:]' is not HOST:PORT"),  # ends as [::1] does, but is no bracketed host
        # gRPC's own answer: UNAVAILABLE "Misformatted domain name", at the first call
        ("127.0.0.1:50061,127.0.0.1:1", "names several addresses: give one HOST:PORT"),
    ]:
        assert says in (address_problem(bad) or ""), bad
        for client in (Client, AsyncClient):  # before a channel opens
            with pytest.raises(ValueError, match=re.escape(says)):
                client(bad)
    with Client(" 127.0.0.1:9\n") as pasted:  # gRPC took the space for part of the name
        assert pasted.address == "127.0.0.1:9"


def test_the_sdk_refuses_a_token_no_grpc_header_can_carry_without_showing_it():
    """gRPC's own answer was INTERNAL "Invalid metadata" at every call, after C-core log lines."""
    from specdec.client import AsyncClient, Client

    for token, position in (("tök-1", 2), ("ab\ncd", 3), ("a b", 2)):
        for client in (Client, AsyncClient):
            with pytest.raises(ValueError, match=f"the token's character {position} is a space, a control") as error:
                client("127.0.0.1:9", token=token)
            assert token not in str(error.value)
    Client("127.0.0.1:9", token="a.b-c_d~e=").close()


def test_text_holding_a_byte_that_is_not_utf8_is_a_value_error_in_the_sdk_that_names_the_argument():
    """A prompt read from a Latin-1 terminal (Python holds its 0xE9 as U+DCE9) used to end the
    program in protobuf's UnicodeEncodeError, which names no argument."""
    import asyncio

    from specdec.client import AsyncClient, Client, build_request

    options = dict(prompt_token_ids=None, max_new_tokens=4, temperature=1.0, top_k=0, top_p=1.0, seed=None,
                   num_speculative_tokens=None, speculate=True, ignore_eos=False)  # fmt: skip
    latin1 = "caf\udce9"
    cases = [
        (dict(prompt=latin1, stop=None, session_id=None), "prompt is not UTF-8: byte 0xe9 at character 3"),
        (dict(prompt="hi", stop=["x", latin1], session_id=None), "stop\\[1\\] is not UTF-8: byte 0xe9"),
        (dict(prompt="hi", stop=None, session_id=latin1), "session_id is not UTF-8"),
        (dict(prompt=None, messages=[{"role": "user", "content": latin1}], stop=None, session_id=None),
         "messages\\[0\\] content is not UTF-8"),
        (dict(prompt="a\ud800", stop=None, session_id=None), "prompt holds a lone surrogate, U\\+D800 at character 1"),
    ]  # fmt: skip
    for arguments, says in cases:
        with pytest.raises(ValueError, match=says):
            build_request(**arguments, **options)
    assert build_request(prompt="café ☕", stop=["é"], session_id="s-é", **options).prompt == "café ☕"
    with Client("127.0.0.1:9") as client:  # refused before any call: nothing serves there
        with pytest.raises(ValueError, match="session_id is not UTF-8"):
            client.delete(latin1)
        with pytest.raises(ValueError, match="session_id is not UTF-8"):
            next(client.resume_stream(latin1))

    async def refused() -> None:
        async with AsyncClient("127.0.0.1:9") as client:
            with pytest.raises(ValueError, match="session_id is not UTF-8"):
                await client.delete(latin1)
            with pytest.raises(ValueError, match="session_id is not UTF-8"):
                await anext(client.resume_stream(latin1))

    asyncio.run(refused())


def test_one_stop_string_is_one_stop_string_and_integers_a_request_cannot_carry_are_value_errors_naming_the_argument():
    """stop="the" used to become the three stop strings "t", "h", "e"; a token id or max_new_tokens
    of 2**40 was protobuf's "Value out of range", which names no argument."""
    from specdec.client import build_request

    options = dict(temperature=1.0, top_k=0, top_p=1.0, seed=None, num_speculative_tokens=None, speculate=True,
                   session_id=None, ignore_eos=False)  # fmt: skip
    assert list(build_request("hi", prompt_token_ids=None, max_new_tokens=4, stop="the", **options).stop) == ["the"]
    assert list(build_request("hi", prompt_token_ids=None, max_new_tokens=4, stop=("a", "b"), **options).stop) == ["a", "b"]
    with pytest.raises(ValueError, match=r"max_new_tokens holds 1099511627776, which no request carries \(a 32-bit"):
        build_request("hi", prompt_token_ids=None, max_new_tokens=2**40, stop=None, **options)
    with pytest.raises(ValueError, match=r"prompt_token_ids holds -2147483649, which no request carries"):
        build_request(None, prompt_token_ids=[5, -(2**31) - 1], max_new_tokens=4, stop=None, **options)
    edge = build_request(None, prompt_token_ids=[2**31 - 1, -(2**31)], max_new_tokens=2**31 - 1, stop=None, **options)
    assert list(edge.prompt_token_ids) == [2**31 - 1, -(2**31)]  # the server's to refuse, with the vocabulary's range
    # top_k and K too, and a Resume's counts (unsigned); a wrong type names its argument as well
    # (all were protobuf's "Value out of range: N" or a bare TypeError); numpy's integers pass.
    import numpy as np

    from specdec.client import build_resume_request

    with pytest.raises(ValueError, match=r"top_k holds 2147483648, which no request carries"):
        build_request("hi", prompt_token_ids=None, max_new_tokens=4, stop=None, **{**options, "top_k": 2**31})
    with pytest.raises(ValueError, match=r"num_speculative_tokens holds 1099511627776"):
        build_request("hi", prompt_token_ids=None, max_new_tokens=4, stop=None, **{**options, "num_speculative_tokens": 2**40})
    with pytest.raises(TypeError, match=r"max_new_tokens must be an integer, got '4'"):
        build_request("hi", prompt_token_ids=None, max_new_tokens="4", stop=None, **options)
    with pytest.raises(ValueError, match=r"received_tokens holds -1, which no request carries \(a 32-bit unsigned"):
        build_resume_request("s", -1, 0)
    with pytest.raises(ValueError, match=r"received_chars holds 4294967296"):
        build_resume_request("s", 0, 2**32)
    assert build_resume_request("s", 2**32 - 1, np.int64(3)).received_chars == 3
    assert list(build_request(None, prompt_token_ids=np.array([5, 6]), max_new_tokens=np.int32(4), stop=None,
                              **options).prompt_token_ids) == [5, 6]  # fmt: skip


def test_a_temperature_a_proto_float_would_carry_as_inf_is_refused_by_the_sdk_and_the_command_line():
    """A proto float is 32-bit: temperature=1e308 travelled as inf, and the coordinator's refusal
    said "got inf" (the CLI started a local stack first); a large float32 still travels."""
    from specdec.client import build_request
    from specdec.ranges import FLOAT32_MAX, TEMPERATURE

    options = dict(prompt_token_ids=None, max_new_tokens=4, top_k=0, top_p=1.0, seed=None, num_speculative_tokens=None,
                   speculate=True, stop=None, session_id=None, ignore_eos=False)  # fmt: skip
    with pytest.raises(ValueError, match=r"temperature must be a number at least 0 and at most 3.40282e\+38 .*got 1e\+308"):
        build_request("hi", temperature=1e308, **options)
    for past in (float("inf"), 10**400):  # inf too; an int past any float was an OverflowError
        with pytest.raises(ValueError, match="temperature must be a number at least 0 and at most 3.40282e"):
            build_request("hi", temperature=past, **options)
    assert build_request("hi", temperature=3e38, **options).sampling.temperature == pytest.approx(3e38)
    with pytest.raises(argparse.ArgumentTypeError, match="at most 3.40282e"):
        TEMPERATURE("1e308")
    assert TEMPERATURE(str(FLOAT32_MAX)) == FLOAT32_MAX


def test_a_conversation_for_a_tokenizer_without_a_chat_template_is_a_failed_precondition_that_says_so():
    from types import SimpleNamespace

    from coordinator.server import CoordinatorServicer
    from specdec.models import build_tiny_tokenizer

    templateless = build_tiny_tokenizer(list("abc "))  # no ':' or newline: the tiny template cannot be written
    server = SimpleNamespace(tokenizer=templateless, config=SimpleNamespace(tokenizer=""), target_info=SimpleNamespace(model="tiny"))
    with pytest.raises(FailedPrecondition, match="the tokenizer of tiny has no chat template: send the conversation as prompt text"):
        CoordinatorServicer.chat_ids(server, [SimpleNamespace(role="user", content="abc")])


def test_a_conversation_the_chat_template_refuses_is_an_invalid_argument_with_the_templates_reason():
    """Templates such as Mistral's and Llama 2's refuse roles that do not alternate user /
    assistant (raise_exception): the user's to fix, not a server fault."""
    from types import SimpleNamespace

    from coordinator.server import CoordinatorServicer
    from specdec.models import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    tokenizer.chat_template = (
        "{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
        "{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    )
    server = SimpleNamespace(tokenizer=tokenizer, config=SimpleNamespace(tokenizer=""), target_info=SimpleNamespace(model="tiny"))
    alternating = [SimpleNamespace(role="user", content="ab"), SimpleNamespace(role="assistant", content="c")]
    assert tokenizer.decode(CoordinatorServicer.chat_ids(server, alternating)) == "user: ab\nassistant: c\n"
    twice = [SimpleNamespace(role="user", content="ab"), SimpleNamespace(role="user", content="c")]
    with pytest.raises(InvalidArgument, match=r"the chat template refused the messages: Conversation roles must alternate user/assistant"):
        CoordinatorServicer.chat_ids(server, twice)


def test_a_stopping_coordinator_lets_its_requests_background_work_finish_then_closes_within_its_bound(
    redis_url, monkeypatch, caplog
):
    """A request's end is recorded and its caches released in the background, after its last
    chunk (CoordinatorServicer.finish): a coordinator stopped right then used to close its Redis
    connection and channels under that work ("Connection closed by server", "Channel is closed")."""
    from coordinator import server
    from specdec.session import SessionStore

    async def go():
        servicer = server.CoordinatorServicer(server.CoordinatorConfig(redis_url=redis_url), SessionStore(redis_url))
        recorded = []

        async def finish():  # stands for finish(): a pause, then a Redis write
            await asyncio.sleep(0.3)
            await servicer.store.redis.set("test:finished", "1")
            recorded.append(await servicer.store.redis.get("test:finished"))

        servicer.spawn(finish())
        await servicer.close()
        assert recorded == ["1"]

        monkeypatch.setattr(server, "CLOSE_BACKGROUND_S", 0.2)
        stuck = server.CoordinatorServicer(server.CoordinatorConfig(redis_url=redis_url), SessionStore(redis_url))
        task = stuck.spawn(asyncio.sleep(60))
        started = time.monotonic()
        await stuck.close()
        assert time.monotonic() - started < 2 and not task.done()
        task.cancel()

    asyncio.run(go())
    assert "stopping with 1 request(s) still recording their end or releasing their caches" in caplog.text


def servicer_with_models(redis_url, **config):
    """A CoordinatorServicer on a real Redis whose target and draft are taken as adopted (as
    `load` does), without the services: enough to plan requests and stream chunks made here."""
    from types import SimpleNamespace

    from coordinator import server
    from specdec.session import SessionStore
    from specdec.v1 import specdec_pb2 as pb

    servicer = server.CoordinatorServicer(server.CoordinatorConfig(redis_url=redis_url, **config), SessionStore(redis_url))
    info = pb.ModelInfoResponse(model="t", vocab_size=100, vocab_fingerprint="v", max_context=256, max_k=8)
    servicer.targets, servicer.draft_info = SimpleNamespace(adopted=info), pb.ModelInfoResponse(model="d", max_k=9)
    return servicer


def test_a_refused_request_logs_an_id_that_cannot_be_a_session_id_by_its_length_only():
    """A refused Generate or Resume logs the session id it named; an 8 MiB one went to the log
    whole, once per call (three calls: 25 MB of log), from anyone who can reach the coordinator."""
    from coordinator.server import describe_refusal

    huge = "x" * 8 * 2**20
    line = describe_refusal("request", huge, "", InvalidArgument("session_id is 8388608 characters; the limit is 128"))
    assert len(line) < 200 and "of session (not an id: 8388608 characters)" in line
    assert "of session 'conv-1' by alice:" in describe_refusal("resume", "conv-1", "alice", NotFound("no session"))


def test_a_request_that_sets_no_max_new_tokens_gets_the_default_within_the_servers_limit(redis_url):
    """A coordinator with --max-new-tokens-limit below --default-max-new-tokens (128) used to
    refuse every request that set no max_new_tokens: RESOURCE_EXHAUSTED, "max_new_tokens is 128"."""
    from specdec.errors import ResourceExhausted
    from specdec.v1 import specdec_pb2 as pb

    servicer = servicer_with_models(redis_url, max_new_tokens_limit=64)
    assert servicer.plan(pb.GenerateRequest(prompt_token_ids=[1, 2]), [1, 2]).max_new_tokens == 64
    assert servicer.plan(pb.GenerateRequest(prompt_token_ids=[1, 2], max_new_tokens=5), [1, 2]).max_new_tokens == 5
    with pytest.raises(ResourceExhausted, match="max_new_tokens is 65; this server allows at most 64"):
        servicer.plan(pb.GenerateRequest(prompt_token_ids=[1, 2], max_new_tokens=65), [1, 2])
    assert servicer_with_models(redis_url).plan(pb.GenerateRequest(), [1]).max_new_tokens == 128


def test_a_stream_cut_while_its_last_chunk_is_written_leaves_its_session_finished(redis_url, monkeypatch):
    """The session is recorded finished before its last chunk leaves; a call cancelled while
    that chunk is written (the client gone, its deadline) used to record it "cancelled" over
    that, so a Resume took a complete session over instead of sending what its client lacked."""
    from types import SimpleNamespace

    from specdec.v1 import specdec_pb2 as pb

    async def go():
        servicer = servicer_with_models(redis_url)
        plan = servicer.plan(pb.GenerateRequest(prompt_token_ids=[1, 2], max_new_tokens=1), [1, 2])
        await servicer.store.create(plan.session_id, plan.prompt, {"owner": plan.owner, "status": "running"})

        async def last_chunk_only(*args):
            yield pb.GenerateChunk(token_ids=[3], finish_reason=pb.FINISH_REASON_LENGTH)

        async def no_services(*args, **kwargs):
            pass

        monkeypatch.setattr(servicer, "generate_chunks", last_chunk_only)
        monkeypatch.setattr(servicer, "release", no_services)
        stream = servicer.stream(plan, SimpleNamespace(time_remaining=lambda: None), "", None)
        assert (await anext(stream)).finish_reason == pb.FINISH_REASON_LENGTH
        await stream.aclose()  # what cancelling the call does to the handler while the chunk is written
        await asyncio.gather(*servicer.background)  # the work that records the end
        status = (await servicer.store.meta(plan.session_id))["status"]
        await servicer.store.close()
        return status

    assert asyncio.run(go()) == "finished"


def test_an_unforeseen_error_in_a_stream_logs_its_traceback_once(redis_url, monkeypatch, caplog):
    """The stream named the error's status with status_for, which logs an unforeseen error's
    traceback, and grpc_handler, which maps it for the call, logged it again."""
    from types import SimpleNamespace

    import grpc

    from specdec.errors import grpc_handler
    from specdec.v1 import specdec_pb2 as pb

    class Aborted(Exception):
        pass

    async def abort(code, details):
        raise Aborted(code)

    async def go():
        servicer = servicer_with_models(redis_url)
        plan = servicer.plan(pb.GenerateRequest(prompt_token_ids=[1, 2], max_new_tokens=1), [1, 2])
        await servicer.store.create(plan.session_id, plan.prompt, {"owner": plan.owner, "status": "running"})

        async def broken(*args):
            raise RuntimeError("a bug")
            yield

        async def no_services(*args, **kwargs):
            pass

        monkeypatch.setattr(servicer, "generate_chunks", broken)
        monkeypatch.setattr(servicer, "release", no_services)

        @grpc_handler
        async def handler(self, request, context):
            async for chunk in self.stream(plan, context, "", None):
                yield chunk

        context = SimpleNamespace(time_remaining=lambda: None, abort=abort)
        with pytest.raises(Aborted) as aborted:
            async for _ in handler(servicer, None, context):
                pass
        await asyncio.gather(*servicer.background)
        await servicer.store.close()
        return aborted.value.args[0]

    with caplog.at_level("INFO", logger="specdec"):
        assert asyncio.run(go()) == grpc.StatusCode.INTERNAL
    assert caplog.text.count("RuntimeError: a bug") == 1 and "failed INTERNAL" in caplog.text


def test_a_child_started_to_end_with_its_parent_runs_its_command_in_its_own_process_unless_the_parent_is_gone():
    import os
    import subprocess

    from specdec.children import ending_with_parent

    child = subprocess.Popen(ending_with_parent(["sh", "-c", "echo $$ $PPID"], os.getpid()), stdout=subprocess.PIPE, text=True)
    out, _ = child.communicate(timeout=30)
    assert child.returncode == 0 and out.split() == [str(child.pid), str(os.getpid())]  # exec'd in the child: no wrapper
    # A parent that ended before the child could ask for its signal: the command never runs.
    gone = subprocess.run(ending_with_parent(["echo", "ran"], parent_pid=2**22 + 1), capture_output=True, text=True)  # past pid_max
    assert gone.returncode == 1 and gone.stdout == ""


def test_an_allocation_torch_cannot_make_is_resource_exhausted_with_its_size_not_an_internal_error(caplog):
    """On a CPU torch's allocator raises a plain RuntimeError, which used to end the call INTERNAL
    with a traceback; on a GPU torch.OutOfMemoryError."""
    import grpc

    from specdec.errors import status_for

    with pytest.raises(RuntimeError) as cpu:
        torch.empty(2**62, dtype=torch.uint8)  # past any address space: refused whatever the overcommit policy
    with caplog.at_level("WARNING", logger="specdec"):
        code, message = status_for(cpu.value)
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert message.startswith("out of memory while serving the request") and "4611686018427387904 bytes" in message
    assert "out of memory while serving a request" in caplog.text and "Traceback" not in caplog.text
    gpu = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
    assert status_for(gpu)[0] == grpc.StatusCode.RESOURCE_EXHAUSTED and "20.00 GiB" in status_for(gpu)[1]
    assert status_for(MemoryError())[0] == grpc.StatusCode.RESOURCE_EXHAUSTED
    # What a GPU reports outside torch's allocator (a kernel's launch, cuBLAS) says so in words.
    for words in ("CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported",
                  "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"):  # fmt: skip
        assert status_for(RuntimeError(words))[0] == grpc.StatusCode.RESOURCE_EXHAUSTED, words
    assert status_for(RuntimeError("shape mismatch"), quiet=True)[0] == grpc.StatusCode.INTERNAL  # a bug stays one


def test_a_context_past_the_models_limit_is_refused_before_any_new_token_is_looked_at():
    """sync and claimed checked each new token id, and copied the list, before the context's
    length: 60M new_tokens held the event loop, every other session's call with it, for 5.9 s
    before OUT_OF_RANGE. The length is now checked first, at no cost."""
    from specdec.errors import OutOfRange
    from specdec.kvcache import SessionState

    class Untouchable(list):
        """new_tokens that fail the test if anything reads them one by one."""

        def __iter__(self):
            raise AssertionError("new_tokens were read before the context's length was checked")

    async def fetch(session_id, start, end):
        return []

    async def run():
        too_long = Untouchable([5] * 101)
        with pytest.raises(OutOfRange, match="context of 101 tokens exceeds the model's limit of 100"):
            await SessionState("s").sync(0, too_long, fetch, vocab_size=40, max_context=100)
        with pytest.raises(OutOfRange, match="context of 101 tokens exceeds the model's limit of 100"):
            async with SessionState("s").claimed(100, Untouchable([5]), fetch, 40, 100):
                pass

    asyncio.run(run())


def test_a_refused_internal_credential_is_logged_once_per_call_not_again_where_only_its_status_is_asked(caplog):
    """status_for(quiet=True) is asked for the status of an error the handler maps again (metrics,
    the request's log line): the credential error logged at each ask, 2-3 times a call."""
    import logging

    from specdec.errors import status_for

    refused = grpc.aio.AioRpcError(grpc.StatusCode.UNAUTHENTICATED, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                   "missing or unknown internal token")  # fmt: skip
    with caplog.at_level(logging.ERROR, logger="specdec"):
        assert status_for(refused, quiet=True)[0] == grpc.StatusCode.INTERNAL
        assert not caplog.records
        code, message = status_for(refused)
    assert code == grpc.StatusCode.INTERNAL and "not the caller's" in message
    assert [r.getMessage() for r in caplog.records] == [
        "a downstream service refused this service's credential: missing or unknown internal token"]


class TargetWhoseRedisFailsOnce:
    """A target whose first `failures` Verifies fail as a model service fails a call when its
    Redis does not answer (UNAVAILABLE, "session store (Redis) unreachable"), or, `transport`, as
    a call to a replica that is down fails; then it accepts."""

    def __init__(self, transport: bool = False, failures: int = 1):
        self.calls, self.transport, self.failures = 0, transport, failures

    async def Verify(self, request, timeout=None, wait_for_ready=None):
        import redis

        from specdec.errors import status_for

        self.calls += 1
        if self.calls <= self.failures:
            code, details = (grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses") if self.transport else \
                status_for(redis.exceptions.ConnectionError("Error 111 connecting to redis:6379. Connection refused."))
            raise grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)
        return pb.VerifyResponse(num_accepted=0, next_token=7)


@pytest.mark.parametrize("error, code", [
    # Redis 6.2 inside a script, and Redis 7 (redis-py's OutOfMemoryError, the code stripped): the
    # second came out INTERNAL with a traceback, on the Redis the k8s manifests run
    (redis.exceptions.ResponseError("Error running script (call to f_1): @user_script:4: @user_script: 4: -OOM "
                                    "command not allowed when used memory > 'maxmemory'."), "RESOURCE_EXHAUSTED"),
    (redis.exceptions.OutOfMemoryError("command not allowed when used memory > 'maxmemory'. script: 1b2c, on "
                                       "@user_script:4."), "RESOURCE_EXHAUSTED"),
    (redis.exceptions.ResponseError("NOREPLICAS Not enough good replicas to write."), "UNAVAILABLE"),
    (redis.exceptions.ReadOnlyError("You can't write against a read only replica."), "UNAVAILABLE"),
])  # fmt: skip
def test_redis_refusing_writes_for_its_own_state_is_told_with_the_status_that_says_so_on_redis_6_and_7(error, code):
    from specdec.errors import status_for

    status, message = status_for(error)
    assert status.name == code and message.startswith("the session store (Redis)"), message


def test_a_model_service_whose_redis_fails_is_not_taken_for_a_replica_lost():
    """A model service's UNAVAILABLE naming its session store (Redis unreachable, failing over)
    marked its replica failed: skipped for 5 s, every session on it moved to another replica and
    rebuilt there, though the service was up. The call is retried on it; a replica that cannot be
    reached is still skipped. A draft's Propose alike."""
    import redis

    from coordinator.cycles import CycleLoop, Plan
    from specdec.errors import status_for

    plan = Plan(session_id="s", prompt=[1, 2, 3], max_new_tokens=1, sampling=Sampling(0.0, 0, 1.0, 1), k=2,
                eos_token_ids=frozenset(), max_context=0, draft_model="", draft_fingerprint="", pipeline=False)  # fmt: skip

    async def run(targets):
        store = CommitWatchingStore(RecordingDraftStub())
        store.ping = lambda: asyncio.sleep(0)
        return [o async for o in CycleLoop(NoDraftReplica(None), targets, store, plan, None).run()]

    for transport in (False, True):
        targets = OneReplica(TargetWhoseRedisFailsOnce(transport))
        targets.single = False
        assert [o.tokens for o in asyncio.run(run(targets))] == [[7]] and targets.replica.stub.calls == 2
        assert (targets.replica.down_until > 0) is transport, transport
    # Twice in a row: this replica's own way to Redis may be broken; skipped, its sessions move.
    targets = OneReplica(TargetWhoseRedisFailsOnce(failures=2))
    targets.single = False
    assert [o.tokens for o in asyncio.run(run(targets))] == [[7]] and targets.replica.down_until > 0
    code, details = status_for(redis.exceptions.ConnectionError("Error 111"))
    store_fault = grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)
    down = grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), "Connection refused")
    loop = CycleLoop(None, None, None, plan, None)
    assert asyncio.run(loop.replica_lost(None, store_fault)) is False
    assert asyncio.run(loop.replica_lost(None, down)) is True
    loop.draft_failures = 1  # the Propose before failed too
    assert asyncio.run(loop.replica_lost(None, store_fault)) is True


def test_a_replica_rechecked_after_a_refused_call_stays_routed_while_it_is_asked():
    """A FAILED_PRECONDITION (a stale run's Verify after a Resume or a delete-and-recreate) has the
    coordinator ask the replica what it serves; it was un-routed for that round trip, so every
    other session on the healthy replica moved away and back, rebuilding twice."""
    from coordinator.replicas import ReplicaAddress, Replicas, target_identity

    info = pb.ModelInfoResponse(model="m", vocab_fingerprint="V", weights_fingerprint="W", vocab_size=40,
                                max_context=64, eos_token_ids=[2])  # fmt: skip
    other = pb.ModelInfoResponse(model="m2", vocab_fingerprint="V", weights_fingerprint="W2", vocab_size=40,
                                 max_context=64, eos_token_ids=[2])  # fmt: skip
    serving = {"127.0.0.1:1001": info, "127.0.0.1:1002": info}

    class SlowInfoStub:
        def __init__(self, channel):
            self.endpoint = None

        async def ModelInfo(self, request, timeout=None):
            await asyncio.sleep(0.05)  # a busy target's round trip
            return serving[self.endpoint]

    async def run():
        replicas = Replicas(ReplicaAddress(endpoints=tuple(serving)), SlowInfoStub, identity=target_identity)
        await replicas.start()
        for endpoint, replica in replicas.replicas.items():
            replica.stub.endpoint = endpoint
        replicas.adopt(replicas.replicas["127.0.0.1:1001"], info)
        await replicas.settle()
        sessions = [f"s{i}" for i in range(100)]
        on_a = [s for s in sessions if replicas.pick(s).endpoint == "127.0.0.1:1001"]
        recheck = asyncio.create_task(replicas.recheck(replicas.replicas["127.0.0.1:1001"]))
        await asyncio.sleep(0.01)
        during = [replicas.pick(s).endpoint for s in on_a]
        refused = await recheck
        serving["127.0.0.1:1001"] = other  # now it serves another model: refused
        refused_now = await replicas.recheck(replicas.replicas["127.0.0.1:1001"])
        await replicas.close()
        return on_a, during, refused, refused_now

    on_a, during, refused, refused_now = asyncio.run(run())
    assert len(on_a) > 20 and set(during) == {"127.0.0.1:1001"} and refused is False
    assert refused_now is True
