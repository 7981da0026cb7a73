"""What a sampled draft token's q costs on the wire: the draft side (`wire_q` + encoding) and
the target's decoding, per token, for q shaped like the distilled SmolLM2 draft's.

    python scripts/q_wire_cost.py                     # this tree
    python scripts/q_wire_cost.py --against HEAD~3    # ... and specdec/draft_wire.py at a git revision
                                                      # (one with the same wire_q / draft_token_to_pb calls)

Each q is a softmax over a random 8,192 of 49,152 ids (the draft's output vocabulary), at
temperature 1 and at top-p 0.9; 40 of each, best of --repeats passes, 1 thread. With
--against it also checks that both versions send the same bytes and decode the same q.
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from specdec import draft_wire
from specdec.sampling import warp

VOCAB, SUPPORT = 49152, 8192


def load_revision(revision: str):
    """specdec/draft_wire.py as it was at `revision`, imported under another name."""
    source = subprocess.run(["git", "show", f"{revision}:specdec/draft_wire.py"], capture_output=True, text=True, check=True).stdout
    path = Path(tempfile.mkdtemp()) / "draft_wire_at_revision.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("draft_wire_at_revision", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def make_qs(top_p: float, count: int, generator: torch.Generator) -> list[torch.Tensor]:
    qs = []
    for _ in range(count):
        logits = torch.full((VOCAB,), -float("inf"))  # [V]
        logits[torch.randperm(VOCAB, generator=generator)[:SUPPORT]] = torch.randn(SUPPORT, generator=generator) * 2.5
        qs.append(warp(logits, 1.0, top_p=top_p))
    return qs


def time_module(module, qs: list[torch.Tensor]) -> tuple[float, float, list]:
    """(ms per token drafting side, ms per token decoding, the messages)."""
    started = time.perf_counter()
    messages = [module.draft_token_to_pb(0, int(q.argmax()), module.wire_q(q)) for q in qs]
    send = (time.perf_counter() - started) / len(qs) * 1e3
    started = time.perf_counter()
    for message in messages:
        module.draft_from_pb(message, VOCAB)
    return send, (time.perf_counter() - started) / len(qs) * 1e3, messages


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--against", help="a git revision whose specdec/draft_wire.py to time beside this tree's")
    parser.add_argument("--repeats", type=int, default=3, help="passes over the q's; the best is reported (default 3)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    modules = {"this tree": draft_wire}
    if args.against:
        modules = {args.against: load_revision(args.against), **modules}
    generator = torch.Generator().manual_seed(0)
    for label, top_p in (("temperature 1", 1.0), ("temperature 1, top-p 0.9", 0.9)):
        qs = make_qs(top_p, 40, generator)
        best = {name: (float("inf"), float("inf")) for name in modules}
        sent = {}
        for _ in range(args.repeats):  # the versions interleaved, so drift moves both alike
            for name, module in modules.items():
                send, decode, sent[name] = time_module(module, qs)
                best[name] = (min(best[name][0], send), min(best[name][1], decode))
        ids = sum(int((draft_wire.wire_q(q).probs() > 0).sum()) for q in qs) / len(qs)
        size = sum(m.ByteSize() for m in sent["this tree"]) / len(qs)
        print(f"{label}: {ids:.0f} ids in fixed point, {size / 1000:.1f} kB a token")
        for name, (send, decode) in best.items():
            print(f"  {name:>12}: draft side {send:.2f} ms, target decoding {decode:.2f} ms per token")
        if args.against:
            old, new = modules[args.against], draft_wire
            same_bytes = all(a.SerializeToString() == b.SerializeToString() for a, b in zip(sent[args.against], sent["this tree"]))
            same_q = all(torch.equal(old.draft_from_pb(m, VOCAB).q, new.draft_from_pb(m, VOCAB).q) for m in sent["this tree"])
            print(f"  same bytes: {same_bytes}, same decoded q: {same_q}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
