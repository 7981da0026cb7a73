"""transformers' forward against specdec's plain forward (specdec/plain_forward.py) on one
model, in one process, the two taking turns: a one-token step and a pass over 3 tokens
(a verify pass at K = 2) after a cached context, each the median of 6 calls per round; it
prints every round's figure, the ratio of the medians (plain / transformers) and whether the
logits of the last calls were equal.

    python scripts/plain_forward_ab.py [--model NAME] [--context 400] [--threads 2] [--rounds 8]
"""

import argparse
import statistics
import time

import torch

from specdec.kvcache import new_cache, transformers_forward
from specdec.models import load_model
from specdec.plain_forward import plain_forward

CALLS_PER_ROUND = 6


def time_calls(forward, model, context: list[int], tokens: list[int]) -> tuple[float, torch.Tensor]:
    """Median ms of `forward` over `tokens` after `context`, cropped back after each call; and the last logits."""
    cache = new_cache(model.config)
    forward(model, cache, context)
    times = []
    for _ in range(CALLS_PER_ROUND):
        start = time.perf_counter()
        logits = forward(model, cache, tokens, keep=len(tokens))  # [T, V]
        times.append((time.perf_counter() - start) * 1000)
        cache.crop(-len(tokens))
    return statistics.median(times), logits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct", help="catalog name or directory")
    parser.add_argument("--context", type=int, default=400, help="tokens cached before the timed calls")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--rounds", type=int, default=8, help="rounds, each timing both forwards")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = load_model(args.model).model
    vocab = model.get_input_embeddings().weight.shape[0]
    context = [(i * 7919) % vocab for i in range(args.context)]
    forwards = {"transformers": transformers_forward, "plain": plain_forward}
    with torch.inference_mode():
        for tokens in ([5], [5, 6, 7]):
            times = {name: [] for name in forwards}
            logits = {}
            for _ in range(args.rounds):
                for name, forward in forwards.items():
                    ms, logits[name] = time_calls(forward, model, context, tokens)
                    times[name].append(ms)
            medians = {name: statistics.median(values) for name, values in times.items()}
            print(f"{args.model}, {args.threads} thread(s), {args.context} tokens of context, "
                  f"{len(tokens)} token(s) a call:")  # fmt: skip
            for name, values in times.items():
                print(f"  {name:12s} median {medians[name]:7.2f} ms  rounds {' '.join(f'{v:.2f}' for v in values)}")
            print(f"  plain / transformers {medians['plain'] / medians['transformers']:.3f}; "
                  f"logits equal: {torch.equal(logits['plain'], logits['transformers'])}")  # fmt: skip


if __name__ == "__main__":
    main()
