"""Tokenizers and vocabularies, without torch where the model's tokenizer allows.

`load_tokenizer` reads the tokenizer of a catalog name, a Hugging Face directory or a
`.gguf` file; `vocab_fingerprint` hashes its vocabulary; `check_vocab_match` refuses a
draft whose fingerprint differs from the target's.

Why here and not in specdec.models: the coordinator needs a tokenizer (text prompts in,
text out) but never a model. transformers' AutoTokenizer imports torch (its config
classes do), ~10 s of CPU at start on this project's 2-core machine; the generic fast
tokenizer class it would pick for most Llama checkpoints (`TokenizersBackend`, alias
`PreTrainedTokenizerFast`) imports no torch. `load_tokenizer` builds that class directly
where AutoTokenizer would pick it for certain (`generic_fast_tokenizer`), and goes through
AutoTokenizer for anything else (another class, custom code, a `.gguf` file).

Terms:
    fingerprint  sha256 of every (id, token string) pair of a vocabulary; equal
                 fingerprints mean a token id names the same string on both sides.
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path

from specdec.catalog import resolve_model

# The tokenizer classes AutoTokenizer builds from tokenizer.json as they are (in transformers
# 5 both names are one class), and the model types whose tokenizer it takes from that
# declaration without a fix-up table of its own: the Llama family specdec serves.
GENERIC_TOKENIZER_CLASSES = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})
GENERIC_TOKENIZER_MODEL_TYPES = frozenset({"llama"})


class VocabMismatchError(ValueError):
    """Draft and target do not share a tokenizer, so their token ids mean different things."""


def has_chat_template(tokenizer) -> bool:
    """True when the tokenizer renders conversations (an instruct model's); chat_ids needs one."""
    return bool(getattr(tokenizer, "chat_template", None))


def chat_ids(tokenizer, messages: Sequence[Mapping[str, str]]) -> list[int]:
    """Token ids of a conversation (dicts with "role" and "content") as the tokenizer's chat
    template renders it, ending with the assistant's turn opened (add_generation_prompt): the
    prompt an instruct model answers. ValueError when the tokenizer has no chat template.

    A role holding the text of a special token is refused (ValueError). A message's content is
    text: where it holds the text of a special token (`<|im_end|>`,
    `<|im_start|>`), that text is tokenized as ordinary text, not as the token, so that no
    message can close its turn and open another (a user's text forging a system turn), as
    OpenAI's API treats it. Such a message is rendered with a marker in its place and its
    content tokenized on its own (split_special_tokens); every other message stays in the
    rendered text, tokenized whole, as transformers' apply_chat_template(tokenize=True) does."""
    if not has_chat_template(tokenizer):
        raise ValueError("the tokenizer has no chat template")
    specials = special_token_texts(tokenizer)
    markers: dict[str, str] = {}  # marker -> the content it stands for
    shown = []
    for i, message in enumerate(messages):
        message = dict(message)
        if held := [special for special in specials if special in message["role"]]:
            raise ValueError(f"messages[{i}] has a role that holds the text of the special token {held[0]!r}")
        if any(special in message["content"] for special in specials):
            marker = f"specdec-literal-{secrets.token_hex(8)}"
            markers[marker], message["content"] = message["content"], marker
        shown.append(message)
    text = tokenizer.apply_chat_template(shown, tokenize=False, add_generation_prompt=True)
    if not markers:
        return text_ids(tokenizer, text, special_tokens=False)
    pieces = re.split(f"({'|'.join(markers)})", text)  # template text, marker, template text, ...
    if sorted(pieces[1::2]) != sorted(markers):
        raise ValueError("the chat template did not keep as it is the text of a message that holds a special "
                         "token's text, so its text cannot be kept apart from the template's tokens")  # fmt: skip
    ids: list[int] = []
    for i, piece in enumerate(pieces):
        if i % 2:
            ids += encode(tokenizer, markers[piece], add_special_tokens=False, split_special_tokens=True)
        elif piece:
            ids += text_ids(tokenizer, piece, special_tokens=False)
    return ids


def special_token_texts(tokenizer) -> list[str]:
    """The texts the tokenizer reads as one of its special tokens (BOS, EOS, a chat
    template's turn markers), wherever they stand in a text it tokenizes."""
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    texts = {token.content for token in added.values() if getattr(token, "special", False)}
    return sorted(texts | set(getattr(tokenizer, "all_special_tokens", [])))


def text_ids(tokenizer, text: str, special_tokens: bool = True) -> list[int]:
    """Token ids of `text` (with the tokenizer's own special tokens, e.g. BOS, unless
    `special_tokens` is False), without transformers' warning that a text over the model's
    length "will result in indexing errors": callers check the length themselves (the
    coordinator refuses such a prompt RESOURCE_EXHAUSTED), and an operator reading the
    warning in a service's log would look for a fault that is not there."""
    return encode(tokenizer, text, add_special_tokens=special_tokens, verbose=False)


def encode(tokenizer, text: str, *, add_special_tokens: bool, split_special_tokens: bool = False, **options) -> list[int]:
    """Token ids of `text`, one call at a time (ENCODE_LOCK): a fast tokenizer sets its
    split_special_tokens switch on the shared Rust tokenizer, then encodes, so two requests
    tokenized at once on the coordinator's threads read each other's switch: a message's
    special-token text became real turn markers, or a plain prompt lost its template's."""
    with ENCODE_LOCK:
        return list(tokenizer(text, add_special_tokens=add_special_tokens, split_special_tokens=split_special_tokens,
                              **options)["input_ids"])  # fmt: skip


ENCODE_LOCK = threading.Lock()


def load_tokenizer(name_or_path: str):
    """Load only the tokenizer of a catalog name, model directory, or `.gguf` file (no
    weights; a catalog model not yet in the cache is fetched and converted first).
    Returns a transformers tokenizer (PreTrainedTokenizerBase)."""
    path, gguf_file = resolve_model(name_or_path)
    if gguf_file is None and generic_fast_tokenizer(path):
        from transformers import PreTrainedTokenizerFast  # no torch

        return PreTrainedTokenizerFast.from_pretrained(str(path), local_files_only=True)
    from transformers import AutoTokenizer  # imports torch

    if gguf_file is None:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    return AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name, local_files_only=True)


def generic_fast_tokenizer(directory: Path) -> bool:
    """Whether AutoTokenizer would build the generic fast class from `directory`'s
    tokenizer.json: a Llama config, a tokenizer_config naming a generic class, no custom code."""
    try:
        tokenizer_config = json.loads((directory / "tokenizer_config.json").read_text())
        model_type = json.loads((directory / "config.json").read_text()).get("model_type")
    except (OSError, ValueError):
        return False
    return (
        (directory / "tokenizer.json").is_file()
        and tokenizer_config.get("tokenizer_class") in GENERIC_TOKENIZER_CLASSES
        and "auto_map" not in tokenizer_config
        and model_type in GENERIC_TOKENIZER_MODEL_TYPES
    )


def vocab_fingerprint(tokenizer) -> str:
    """sha256 hex of the vocabulary: every (id, token string) pair, added tokens included, sorted by id.

    Two tokenizers with the same fingerprint map every token id to the same string, which
    is what lets a draft's token ids be fed to a target.
    """
    pairs = sorted((int(index), token) for token, index in tokenizer.get_vocab().items())
    # JSON keeps token strings with tabs/newlines/quotes unambiguous
    encoded = json.dumps(pairs, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    return hashlib.sha256(encoded).hexdigest()


def describe_model(model: str, vocabulary: str, weights: str = "") -> str:
    """A model as messages name it: its name and the start of its fingerprints."""
    return f"{model} (vocabulary {vocabulary[:12] or 'none'}{f', weights {weights[:12]}' if weights else ''})"


def check_vocab_match(draft_name: str, draft_fingerprint: str, target_name: str, target_fingerprint: str) -> None:
    """Raise VocabMismatchError unless the draft and target vocabulary fingerprints are equal."""
    if draft_fingerprint == target_fingerprint:
        return
    raise VocabMismatchError(
        f"draft model {draft_name!r} (vocabulary {draft_fingerprint[:12]}) and target model {target_name!r} "
        f"(vocabulary {target_fingerprint[:12]}) do not share a tokenizer; speculative decoding needs the draft "
        "and the target to use the same tokenizer. Pick a draft from the target's model family, or the n-gram drafter."
    )
