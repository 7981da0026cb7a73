"""Write a soak prompt set whose prompts all differ in length.

The shipped prompts come in a few lengths; a service in production meets prompts of every
length, and each new length is a new row count for its first forward pass (specdec.packed pads
those to a few counts). The prompts have --shortest, --shortest + --step, ... words, drawn with a
fixed seed from the words of the packaged distillation prompts, and come in a seeded random order,
so that a soak's start and end see the same mix of lengths.

    python scripts/varied_prompts.py --out varied.jsonl --count 400
    specdec soak --prompts varied.jsonl --minutes 5 --max-new-tokens 8 --clients 4
"""

from __future__ import annotations

import argparse
import json
import random
from importlib import resources


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="JSONL file to write, one {\"prompt\": ...} per line")
    parser.add_argument("--count", type=int, default=400, help="how many prompts (default: %(default)s)")
    parser.add_argument("--shortest", type=int, default=5, help="words in the first prompt (default: %(default)s)")
    parser.add_argument("--step", type=int, default=2, help="words added per prompt (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    text = resources.files("specdec").joinpath("data/distill_prompts.jsonl").read_text()
    words = [w for line in text.splitlines() for w in json.loads(line)["prompt"].split()]
    rng = random.Random(args.seed)
    lengths = [args.shortest + i * args.step for i in range(args.count)]
    rng.shuffle(lengths)
    with open(args.out, "w") as out:
        for n in lengths:
            start = rng.randrange(len(words))
            prompt = " ".join(words[(start + j) % len(words)] for j in range(n))
            out.write(json.dumps({"prompt": prompt}) + "\n")
    print(f"{args.count} prompts of {args.shortest} to {args.shortest + (args.count - 1) * args.step} words -> {args.out}")


if __name__ == "__main__":
    main()
