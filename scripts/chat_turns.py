"""What prefix reuse saves a chat: each turn of a conversation is a new session whose prompt is
the conversation so far, and a second user's conversation begins with the same system prompt.

    specdec up --port 7600 &
    python scripts/chat_turns.py --address 127.0.0.1:7600

    SPECDEC_TARGET_NO_PREFIX_REUSE=1 SPECDEC_DRAFT_NO_PREFIX_REUSE=1 specdec up --port 7600 &
    python scripts/chat_turns.py --address 127.0.0.1:7600      # the same, every prompt fed whole

Prints, for each turn, its prompt's length in tokens, its time to first token (the coordinator's
`first_token_s`) and the whole turn's time, then a fingerprint of all the answers: greedy, so two
stacks that differ only in prefix reuse print the same one. Used for README "Limits" (prefix reuse).
"""

from __future__ import annotations

import argparse
import hashlib

import specdec

PRODUCTS = ["router", "camera", "thermostat", "doorbell", "speaker", "light strip", "smart plug", "lock"]


def system_prompt(entries: int) -> str:
    """A support assistant's instructions with `entries` FAQ entries (about 30 tokens each)."""
    lines = ["You are the support assistant of Northwind Home. Answer briefly and politely, using only "
             "the facts below. If the answer is not there, say that a human agent will follow up."]  # fmt: skip
    for i in range(entries):
        product = PRODUCTS[i % len(PRODUCTS)]
        lines.append(f"Q: How do I reset the Northwind {product} model {i + 100}? A: Hold the button on its "
                     f"back for {i % 9 + 3} seconds until the light blinks {['blue', 'green', 'white'][i % 3]}.")  # fmt: skip
    return "\n".join(lines)


QUESTIONS = [
    "How do I reset the Northwind camera model 101?",
    "And what colour does its light blink?",
    "Thanks. Can I do the same with the lock model 107?",
]


def run_turns(client: specdec.Client, system: str, questions: list[str], max_new_tokens: int) -> list[tuple]:
    """Ask `questions` in one conversation, one session a turn: [(prompt tokens, first token s, turn s, text)]."""
    messages = [{"role": "system", "content": system}]
    turns = []
    for question in questions:
        messages.append({"role": "user", "content": question})
        result = client.generate(messages=messages, max_new_tokens=max_new_tokens)
        stats = result.stats
        turns.append((stats.prompt_tokens, stats.first_token_s, stats.elapsed_s, result.text))
        messages.append({"role": "assistant", "content": result.text})
    return turns


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--address", default="127.0.0.1:7600", help="the coordinator (default: %(default)s)")
    p.add_argument("--entries", type=int, default=40, help="FAQ entries in the system prompt (default: %(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=48, help="tokens per answer (default: %(default)s)")
    args = p.parse_args()
    system = system_prompt(args.entries)
    answers = hashlib.sha256()
    with specdec.Client(args.address) as client:
        client.generate("warm up", max_new_tokens=2)
        print(f"{'conversation':<14} {'turn':>4} {'prompt tokens':>13} {'first token s':>13} {'turn s':>7}")
        for who, questions in (("first user", QUESTIONS), ("second user", QUESTIONS[:1])):
            for turn, (prompt, first_token, total, text) in enumerate(run_turns(client, system, questions,
                                                                                args.max_new_tokens), 1):  # fmt: skip
                answers.update(text.encode())
                print(f"{who:<14} {turn:>4} {prompt:>13} {first_token:>13.2f} {total:>7.2f}")
    print(f"answers' sha256: {answers.hexdigest()[:16]}")


if __name__ == "__main__":
    main()
