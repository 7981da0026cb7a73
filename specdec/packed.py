"""Linear layers whose weights are prepacked for oneDNN, for verify passes on a CPU.

Terms:
    rows        how many token positions a linear layer multiplies at once: 1 for a decode
                step, K + 1 for a verify pass over K drafts, the prompt's length at prefill.
    prepacked   a copy of the weight in the blocked layout oneDNN's matrix multiply reads
                (`torch.ops.mkldnn._reorder_linear_weight`), made once at load.

Why: on a CPU, speculation pays only if a pass over K + 1 rows costs little more than one
over a single row. torch's `nn.Linear` on a CPU calls MKL's sgemm, and on this project's
2-core AMD machine a SmolLM2-135M pass over 5 rows took about twice a single-row step:
the K + 1 rows do not share one read of the weights. oneDNN's multiply from a prepacked
weight takes 5 rows in 1.3-1.4× a single-row step (`specdec bench --costs` prints the ratio
on your machine). A single row (a decode step, the draft's every step) takes the packed copy
too on two or more threads: MKL's single-row path did not get faster with a second thread
here (a SmolLM2 step with 200 tokens of context: 62-68 ms on 2 threads, 58-63 on 1) and
oneDNN's did (43-55 ms). On one thread the two were as fast, and a single row keeps
`nn.Linear`'s path, bit for bit what an unpacked model computes.

Which kernel wins depends on the CPU: on an Intel Xeon (AVX-512, AMX) the same packed copies
lost to MKL on a single row and on verify passes (a step 86/69 ms packed against 51/66 ms
stock). So `load_model` times both kernels on this machine (`choose_kernels`): a pass through
all of the model's linear layers on one row and on several, for each thread count the process
may use, and every pass takes the faster (`KernelChoice`). The choice is remembered
(`kernels.json` in the cache folder, keyed by the CPU, its core count, torch's version, the
thread counts and the layers' shapes), so a service that restarts on the same machine skips
the timing (about 2 s for SmolLM2-135M); delete the file to time again. `SPECDEC_PACKED_LINEAR=fixed`
skips the timing and uses the packed copy for several rows, and for one row on two or more
threads; `SPECDEC_PACKED_LINEAR=0` packs nothing.

The packed copy costs one more copy of every linear weight in memory (SmolLM2-135M: 0.54
GB more). Only float32 CPU models are packed, and only where oneDNN is available; anything
else, including training (a weight that requires grad), takes the plain path. The two paths
round differently in the last bits (about 1e-5 relative), as MKL's own paths for one and
several rows already do; greedy outputs still match `transformers` (the oracle tests).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import time
from collections.abc import Iterable

import torch
import torch.nn.functional as F

from specdec.files import write_atomically

# oneDNN picks its blocked layout for an expected number of rows: a verify pass of K + 1
# with K up to ~8. (Measured here: a layout for 5 rows served 2-9 rows as well as any.)
PACK_FOR_ROWS = 8
MIN_PACKED_ROWS = 2  # untimed, on one thread a single row keeps nn.Linear's path (module doc)
# Environment switch: "0" loads every model unpacked (plain nn.Linear everywhere); "fixed"
# packs without timing (KernelChoice's fixed rule); anything else packs and times.
ENV_SWITCH = "SPECDEC_PACKED_LINEAR"
# The passes choose_kernels times: a decode step, and a verify pass over K + 1 = 4 tokens.
ONE_ROW, SEVERAL_ROWS = "one row", "several rows"
TIMED_ROWS = {ONE_ROW: 1, SEVERAL_ROWS: 4}
TIMING_ROUNDS = 4  # per kernel, taking turns, after one warm-up round; the median decides
# The fixed rule's kernel stands unless the other one's median is below this share of its
# own: timings taken while other processes start beside us are noisy, and a flip on noise
# costs more than a few percent left on the table.
SWITCH_BELOW = 0.9
REMEMBERED_FILE = "kernels.json"  # in the cache folder: timing key -> the choice it made
# oneDNN builds and keeps a kernel for every (weight shape, row count) a packed product meets,
# and its memory stays with the process, the more the more rows: prefills of every prompt length
# (and shared passes of every mix) meet ever new counts, and SmolLM2's five weight shapes over the
# row counts 2..601 took 1.1 GB more, 10 MB of it for the counts up to 101 (`scripts/packed_rows.py`).
# So a product over more than EXACT_ROWS rows (decode steps, verify passes, most shared passes
# stay exact) pads its rows up to the next of ROW_BUCKETS_PER_DOUBLING evenly spaced counts per
# doubling (`padded_rows`), and one over more than MAX_PASS_ROWS runs in passes of that many (the
# last padded): 96 row counts in all.
EXACT_ROWS = 64
ROW_BUCKETS_PER_DOUBLING = 8
MAX_PASS_ROWS = 1024


def padded_rows(rows: int) -> int:
    """The row count a packed product over `rows` (<= MAX_PASS_ROWS) rows runs at: `rows` up to
    EXACT_ROWS, else the next multiple of an eighth of the power of two below it (65-128 -> 72,
    80, ..., 128; 129-256 -> 144, 160, ..., 256; ...): at most 12.5% more rows."""
    if rows <= EXACT_ROWS:
        return rows
    doubling = (rows - 1).bit_length() - 1  # 2**doubling < rows <= 2**(doubling + 1)
    step = (1 << doubling) // ROW_BUCKETS_PER_DOUBLING
    return -(-rows // step) * step


def fixed_rule(rows: int, threads: int) -> bool:
    """The packed copy for several rows, and for one row on two or more threads (module doc)."""
    return rows >= MIN_PACKED_ROWS or threads >= 2


class KernelChoice:
    """Which kernel each pass of one packed model takes on this machine.

    `packed[(rows, threads)]` is True where the prepacked copy was faster than nn.Linear's
    kernel for passes of `rows` (ONE_ROW or SEVERAL_ROWS) on `threads` torch threads, False
    where it was slower (`choose_kernels` fills it). A pair never timed follows the fixed
    rule: the packed copy for several rows, and for one row on two or more threads.
    """

    def __init__(self):
        self.packed: dict[tuple[str, int], bool] = {}
        self.remembered = False  # read from REMEMBERED_FILE, not timed by this process

    def use_packed(self, rows: int, threads: int) -> bool:
        timed = self.packed.get((ONE_ROW if rows < MIN_PACKED_ROWS else SEVERAL_ROWS, threads))
        return fixed_rule(rows, threads) if timed is None else timed

    def describe(self) -> dict[str, str]:
        """{"one row, 2 threads": "packed" or "stock", ...}, for logs and reports."""
        return {f"{rows}, {threads} thread{'' if threads == 1 else 's'}": "packed" if packed else "stock"
                for (rows, threads), packed in sorted(self.packed.items(), key=lambda item: (item[0][1], item[0][0]))}  # fmt: skip


def packing_available() -> bool:
    """oneDNN's prepacked linear ops exist in this torch build (x86 and ARM CPU builds)."""
    return hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and torch.backends.mkldnn.is_available()


class PackedLinear(torch.nn.Module):
    """An `nn.Linear` (same weight and bias objects, so tied weights stay tied) plus a
    prepacked copy of its weight, used for the passes where `choice` says it is faster."""

    def __init__(self, linear: torch.nn.Linear, choice: KernelChoice | None = None):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight  # [out, in], shared with the original module
        self.bias = linear.bias  # [out] or None
        self.choice = choice or KernelChoice()  # shared by all the packed layers of one model
        with torch.no_grad():
            packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), PACK_FOR_ROWS)
        self.register_buffer("packed_weight", packed, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        rows = x.numel() // self.in_features
        if (torch.is_grad_enabled() and self.weight.requires_grad) or x.dtype != torch.float32:
            return F.linear(x, self.weight, self.bias)
        if not self.choice.use_packed(rows, torch.get_num_threads()):
            return F.linear(x, self.weight, self.bias)
        return self.packed_forward(x)

    def packed_forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        """The product from the prepacked copy, whatever the choice (float32 input), in
        passes of at most MAX_PASS_ROWS rows, each padded to padded_rows (module constants)."""
        rows = x.numel() // self.in_features
        flat = x.reshape(rows, self.in_features)  # [rows, in]
        bias = None if self.bias is None else self.bias.detach()
        if rows <= MAX_PASS_ROWS:
            out = self.padded_product(flat, bias)  # [rows, out]
        else:
            out = torch.cat([self.padded_product(flat[start : start + MAX_PASS_ROWS], bias)
                             for start in range(0, rows, MAX_PASS_ROWS)])  # fmt: skip
        return out.reshape(*x.shape[:-1], self.out_features)

    def padded_product(self, flat: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:  # [n, in] -> [n, out]
        n = flat.shape[0]
        padded = padded_rows(n)
        if padded > n:
            flat = torch.cat([flat, flat.new_zeros(padded - n, self.in_features)])  # [padded, in]
        return torch.ops.mkldnn._linear_pointwise(flat, self.packed_weight, bias, "none", [], "")[:n]


def should_pack(model: torch.nn.Module) -> bool:
    """Pack by default: a float32 model on the CPU, oneDNN present, not switched off."""
    if os.environ.get(ENV_SWITCH, "1") == "0" or not packing_available():
        return False
    parameter = next(model.parameters(), None)
    return parameter is not None and parameter.device.type == "cpu" and parameter.dtype == torch.float32


def pack_linears(model: torch.nn.Module) -> int:
    """Replace every `nn.Linear` of `model` by a PackedLinear, in place (all sharing one
    KernelChoice); returns how many."""
    choice = KernelChoice()
    replaced = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is torch.nn.Linear:
                setattr(module, name, PackedLinear(child, choice))
                replaced += 1
    return replaced


def pack_model(model: torch.nn.Module) -> dict[str, str]:
    """Pack `model`'s linear layers where that applies (should_pack; a model packed already
    stays as it is) and time their kernels on this machine for one thread, the current count
    and one per core, the counts the services run with (skipped with SPECDEC_PACKED_LINEAR=fixed).
    Returns the choice as KernelChoice.describe(); {} where nothing was timed."""
    if not packed_layers(model):
        if not should_pack(model):
            return {}
        pack_linears(model)
        if os.environ.get(ENV_SWITCH) != "fixed":
            threads = {1, torch.get_num_threads(), os.cpu_count() or 1}
            if not recall_kernels(model, threads):
                choose_kernels(model, threads)
                remember_kernels(model, threads)
    return kernel_choice(model).describe()


def timing_key(model: torch.nn.Module, thread_counts: Iterable[int]) -> str:
    """What choose_kernels' result depends on, as one string: the CPU, its core count, torch's
    version, the thread counts timed and the packed layers' shapes (a digest)."""
    shapes = ",".join(f"{layer.in_features}x{layer.out_features}{'+b' if layer.bias is not None else ''}"
                      for layer in packed_layers(model))  # fmt: skip
    digest = hashlib.blake2b(shapes.encode(), digest_size=8).hexdigest()
    threads = "+".join(str(t) for t in sorted({max(1, int(t)) for t in thread_counts}))
    return f"{cpu_name()} | {os.cpu_count()} cores | torch {torch.__version__} | threads {threads} | layers {digest}"


def cpu_name() -> str:
    """The CPU's model name (Linux's /proc/cpuinfo), else what `platform` knows."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def remembered_path():
    from specdec.catalog import cache_dir

    return cache_dir() / REMEMBERED_FILE


def read_remembered() -> dict:
    """REMEMBERED_FILE's entries; {} where it is missing or unreadable."""
    try:
        entries = json.loads(remembered_path().read_text())
    except (OSError, ValueError):
        return {}
    return entries if isinstance(entries, dict) else {}


def recall_kernels(model: torch.nn.Module, thread_counts: Iterable[int]) -> bool:
    """Fill the packed model's KernelChoice from an earlier timing of the same key; False
    (nothing changed) where there is none."""
    entry = read_remembered().get(timing_key(model, thread_counts))
    try:
        packed = {(rows, int(threads)): bool(value) for rows, threads, value in entry}
    except (TypeError, ValueError):
        return False
    if not packed or {rows for rows, _ in packed} - set(TIMED_ROWS):
        return False
    choice = kernel_choice(model)
    choice.packed.update(packed)
    choice.remembered = True
    return True


def remember_kernels(model: torch.nn.Module, thread_counts: Iterable[int]) -> None:
    """Add the model's timed KernelChoice to REMEMBERED_FILE (written whole, then renamed,
    so a reader never sees half of it); a cache folder that cannot be written is left alone."""
    entries = read_remembered()
    entries[timing_key(model, thread_counts)] = [[rows, threads, packed] for (rows, threads), packed
                                                 in sorted(kernel_choice(model).packed.items())]  # fmt: skip
    path = remembered_path()
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(path, lambda temp: temp.write_text(json.dumps(entries, indent=1, sort_keys=True)))


def packed_layers(model: torch.nn.Module) -> list[PackedLinear]:
    """The model's packed linear layers, in the order a forward runs them."""
    return [module for module in model.modules() if isinstance(module, PackedLinear)]


def kernel_choice(model: torch.nn.Module) -> KernelChoice | None:
    """The KernelChoice of a packed model; None for a model without packed layers."""
    layers = packed_layers(model)
    return layers[0].choice if layers else None


def choose_kernels(model: torch.nn.Module, thread_counts: Iterable[int], rounds: int = TIMING_ROUNDS) -> KernelChoice | None:
    """Time nn.Linear's kernel against the packed copies on this machine and record, for one
    row and for several (TIMED_ROWS) on each of `thread_counts`, the faster in the model's
    KernelChoice. Each timing is one pass through all the model's linear layers in order, so
    their weights stream from memory as in a forward; the two kernels take turns, and the
    fixed rule's kernel stands unless the other's median of `rounds` is below SWITCH_BELOW
    of its own. None (nothing timed) for a model without packed layers."""
    layers = packed_layers(model)
    if not layers:
        return None
    choice = layers[0].choice
    before = torch.get_num_threads()
    try:
        with torch.inference_mode():
            for threads in sorted({max(1, int(t)) for t in thread_counts}):
                torch.set_num_threads(threads)
                for name, rows in TIMED_ROWS.items():
                    inputs = {layer.in_features: torch.randn(rows, layer.in_features) for layer in layers}  # [rows, in]
                    stock, packed = [], []  # seconds per pass, one per round
                    for _ in range(rounds + 1):
                        stock.append(time_pass(layers, inputs, False))
                        packed.append(time_pass(layers, inputs, True))
                    stock_s, packed_s = sorted(stock[1:])[rounds // 2], sorted(packed[1:])[rounds // 2]  # round 0 warms up
                    rule = fixed_rule(rows, threads)
                    kept_s, other_s = (packed_s, stock_s) if rule else (stock_s, packed_s)
                    choice.packed[(name, threads)] = rule if other_s >= SWITCH_BELOW * kept_s else not rule
    finally:
        torch.set_num_threads(before)
    return choice


def time_pass(layers: list[PackedLinear], inputs: dict[int, torch.Tensor], packed: bool) -> float:
    """Seconds for one pass through `layers`, each on the input of its width, with the packed
    copies (packed=True) or nn.Linear's kernel."""
    start = time.perf_counter()
    for layer in layers:
        x = inputs[layer.in_features]
        if packed:
            layer.packed_forward(x)
        else:
            F.linear(x, layer.weight, layer.bias)
    return time.perf_counter() - start
