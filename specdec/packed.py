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

The packed copy costs one more copy of every linear weight in memory (SmolLM2-135M: 0.54
GB more). Only float32 CPU models are packed, and only where oneDNN is available; anything
else, including training (a weight that requires grad), takes the plain path. The two paths
round differently in the last bits (about 1e-5 relative), as MKL's own paths for one and
several rows already do; greedy outputs still match `transformers` (the oracle tests).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

# oneDNN picks its blocked layout for an expected number of rows: a verify pass of K + 1
# with K up to ~8. (Measured here: a layout for 5 rows served 2-9 rows as well as any.)
PACK_FOR_ROWS = 8
MIN_PACKED_ROWS = 2  # on one thread a single row keeps nn.Linear's path (module doc)
# Environment switch: "0" loads every model unpacked (plain nn.Linear everywhere).
ENV_SWITCH = "SPECDEC_PACKED_LINEAR"


def packing_available() -> bool:
    """oneDNN's prepacked linear ops exist in this torch build (x86 and ARM CPU builds)."""
    return hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and torch.backends.mkldnn.is_available()


class PackedLinear(torch.nn.Module):
    """An `nn.Linear` (same weight and bias objects, so tied weights stay tied) plus a
    prepacked copy of its weight, used for inputs of two or more rows, and of one row on
    two or more threads (module doc)."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight  # [out, in], shared with the original module
        self.bias = linear.bias  # [out] or None
        with torch.no_grad():
            packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), PACK_FOR_ROWS)
        self.register_buffer("packed_weight", packed, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        rows = x.numel() // self.in_features
        if (rows < MIN_PACKED_ROWS and torch.get_num_threads() < 2) or (torch.is_grad_enabled() and self.weight.requires_grad) or x.dtype != torch.float32:
            return F.linear(x, self.weight, self.bias)
        flat = x.reshape(rows, self.in_features)  # [rows, in]
        bias = None if self.bias is None else self.bias.detach()
        out = torch.ops.mkldnn._linear_pointwise(flat, self.packed_weight, bias, "none", [], "")  # [rows, out]
        return out.reshape(*x.shape[:-1], self.out_features)


def should_pack(model: torch.nn.Module) -> bool:
    """Pack by default: a float32 model on the CPU, oneDNN present, not switched off."""
    if os.environ.get(ENV_SWITCH, "1") == "0" or not packing_available():
        return False
    parameter = next(model.parameters(), None)
    return parameter is not None and parameter.device.type == "cpu" and parameter.dtype == torch.float32


def pack_linears(model: torch.nn.Module) -> int:
    """Replace every `nn.Linear` of `model` by a PackedLinear, in place; returns how many."""
    replaced = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is torch.nn.Linear:
                setattr(module, name, PackedLinear(child))
                replaced += 1
    return replaced
