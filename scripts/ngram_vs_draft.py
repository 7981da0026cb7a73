"""Where an n-gram lookup beats a draft model: along the target's own greedy continuation
of each bench prompt, how often the lookup's first token is the target's next token, by the
length of the n-gram matched, against the draft model's greedy agreement at the same
positions. It picks `--ngram-first N`: the shortest match length from which the lookup is
right more often than the model.

    python scripts/ngram_vs_draft.py [--draft smollm2-135m-instruct-draft] [--kind extractive]
"""

import argparse
import collections

import torch

from specdec.bench import encode, load_prompts
from specdec.models import load_model
from specdec.ngram import DEFAULT_MAX_NGRAM, find_continuation


def agreement_by_match(target, draft, prompts: list[str], max_new_tokens: int) -> dict[int, list[int]]:
    """{match length (0 = none): [lookup right, model right, positions]} over the prompts."""
    counts = collections.defaultdict(lambda: [0, 0, 0])
    for prompt in prompts:
        ids = encode(target.tokenizer, prompt, True)
        with torch.inference_mode():
            out = target.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                        do_sample=False, max_new_tokens=max_new_tokens,
                                        pad_token_id=target.tokenizer.pad_token_id)[0].tolist()  # fmt: skip
            draft_top = draft.model(torch.tensor([out])).logits[0].argmax(-1).tolist()  # [len(out)]
        for position in range(len(ids), len(out)):
            continuation, n = find_continuation(out[:position], 1, DEFAULT_MAX_NGRAM, 1)
            row = counts[n]
            row[0] += bool(continuation) and continuation[0] == out[position]
            row[1] += draft_top[position - 1] == out[position]
            row[2] += 1
    return dict(counts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--draft", default="smollm2-135m-instruct-draft")
    parser.add_argument("--kind", default=None, help="only the bench prompts of this kind (extractive, code, chat)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args()
    target, draft = load_model(args.target), load_model(args.draft)
    counts = agreement_by_match(target, draft, load_prompts(None, args.kind), args.max_new_tokens)
    print(f"{'match':>5} {'positions':>9} {'lookup right':>12} {'model right':>11}")
    for n in sorted(counts):
        lookup, model, total = counts[n]
        print(f"{n:>5} {total:>9} {lookup / total if n else float('nan'):>12.3f} {model / total:>11.3f}")
    total = sum(row[2] for row in counts.values())
    print(f"model alone: {sum(row[1] for row in counts.values()) / total:.3f} of {total} positions")
    for first in range(1, DEFAULT_MAX_NGRAM + 1):
        right = sum(row[0] if n >= first else row[1] for n, row in counts.items())
        print(f"--ngram-first {first}: {right / total:.3f}")


if __name__ == "__main__":
    main()
