"""What prefix reuse saves a chat: each turn of a conversation is a new session whose prompt is
the conversation so far, and a second user's conversation begins with the same system prompt.

    specdec up --port 7600 &
    python scripts/chat_turns.py --address 127.0.0.1:7600

    SPECDEC_TARGET_NO_PREFIX_REUSE=1 SPECDEC_DRAFT_NO_PREFIX_REUSE=1 specdec up --port 7600 &
    python scripts/chat_turns.py --address 127.0.0.1:7600      # the same, every prompt fed whole

Prints, for each turn, its prompt's length in tokens, its time to first token (the coordinator's
`first_token_s`) and the whole turn's time, then a fingerprint of all the answers: greedy, so two
stacks that differ only in prefix reuse print the same one. Used for README "Limits" (prefix reuse).

With --users N, N users at once (half with one system prompt, half with another) each hold three
conversations of three turns; before a turn, one time in five, a client gives up on it after 0.3 s
(and asks again), and after a turn, one time in five, it deletes that turn's session. Prints the
wall time, the failed turns and the answers' fingerprint.
"""

from __future__ import annotations

import argparse
import hashlib
import random
import threading
import time

import specdec

PRODUCTS = ["router", "camera", "thermostat", "doorbell", "speaker", "light strip", "smart plug", "lock"]


def system_prompt(entries: int) -> str:
    """A support assistant's instructions with `entries` FAQ entries (about 30 tokens each)."""
    lines = ["You are the support assistant of Northwind Home. Answer briefly and politely, using only "
             "the facts below. If the answer is not there, say that a human agent will follow up."]  # fmt: skip
    for i in range(entries):
        product, colour = PRODUCTS[i % len(PRODUCTS)], ["blue", "green", "white"][i % 3]
        lines.append(f"Q: How do I reset the Northwind {product} model {i + 100}? A: Hold the button on its "
                     f"back for {i % 9 + 3} seconds until the light blinks {colour}.")  # fmt: skip
    return "\n".join(lines)


QUESTIONS = [
    "How do I reset the Northwind camera model 101?",
    "And what colour does its light blink?",
    "Thanks. Can I do the same with the lock model 107?",
]


def run_turns(client: specdec.Client, system: str, questions: list[str], max_new_tokens: int,
              conversation: str) -> list[tuple]:  # fmt: skip
    """Ask `questions` in one conversation, one session a turn, all of one affinity key (with
    several replicas, the turns go where the turn before's caches are): [(prompt tokens, first
    token s, turn s, text)]."""
    messages = [{"role": "system", "content": system}]
    turns = []
    for question in questions:
        messages.append({"role": "user", "content": question})
        result = client.generate(messages=messages, max_new_tokens=max_new_tokens, affinity_key=conversation)
        stats = result.stats
        turns.append((stats.prompt_tokens, stats.first_token_s, stats.elapsed_s, result.text))
        messages.append({"role": "assistant", "content": result.text})
    return turns


def busy_user(address: str, user: int, systems: list[str], max_new_tokens: int, answers: dict, errors: list) -> None:
    """One of --users: three conversations of three turns, with give-ups and deletes (module doc)."""
    rng = random.Random(user)
    with specdec.Client(address) as client:
        for conversation in range(3):
            messages = [{"role": "system", "content": systems[user % len(systems)]}]
            for turn in range(3):
                question = QUESTIONS[(user + conversation + turn) % len(QUESTIONS)]
                messages.append({"role": "user", "content": f"{question} (ticket {user}-{conversation})"})
                session_id = f"user{user}-conversation{conversation}-turn{turn}"
                if rng.random() < 0.2:
                    try:
                        client.generate(messages=messages, max_new_tokens=max_new_tokens, timeout=0.3,
                                        session_id=session_id + "-given-up",
                                        affinity_key=f"user{user}-conversation{conversation}")  # fmt: skip
                    except specdec.SpecdecClientError:
                        pass
                try:
                    result = client.generate(messages=messages, max_new_tokens=max_new_tokens, session_id=session_id,
                                             affinity_key=f"user{user}-conversation{conversation}")  # fmt: skip
                except specdec.SpecdecClientError as exc:
                    errors.append(f"{session_id}: {exc.code.name}: {exc.message}")
                    break
                answers[session_id] = result.text
                messages.append({"role": "assistant", "content": result.text})
                if rng.random() < 0.2:
                    client.delete(session_id)


def run_users(args, system: str) -> None:
    systems = [system, system.replace("Northwind", "Southwind")]
    answers: dict[str, str] = {}
    errors: list[str] = []
    threads = [threading.Thread(target=busy_user, args=(args.address, user, systems, args.max_new_tokens, answers,
                                                       errors)) for user in range(args.users)]  # fmt: skip
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    fingerprint = hashlib.sha256("\0".join(answers[k] for k in sorted(answers)).encode()).hexdigest()[:16]
    print(f"{args.users} users, {len(answers)} turns answered in {time.perf_counter() - started:.1f} s; "
          f"{len(errors)} failed{': ' + '; '.join(errors) if errors else ''}")
    print(f"answers' sha256: {fingerprint}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--address", default="127.0.0.1:7600", help="the coordinator (default: %(default)s)")
    p.add_argument("--entries", type=int, default=40, help="FAQ entries in the system prompt (default: %(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=48, help="tokens per answer (default: %(default)s)")
    p.add_argument("--users", type=int, default=0,
                   help="run this many users at once instead, giving up on and deleting some turns (module doc)")
    args = p.parse_args()
    system = system_prompt(args.entries)
    if args.users:
        return run_users(args, system)
    answers = hashlib.sha256()
    with specdec.Client(args.address) as client:
        client.generate("warm up", max_new_tokens=2)
        print(f"{'conversation':<14} {'turn':>4} {'prompt tokens':>13} {'first token s':>13} {'turn s':>7}")
        for who, questions in (("first user", QUESTIONS), ("second user", QUESTIONS[:1])):
            turns = run_turns(client, system, questions, args.max_new_tokens, conversation=who)
            for turn, (prompt, first_token, total, text) in enumerate(turns, 1):
                answers.update(text.encode())
                print(f"{who:<14} {turn:>4} {prompt:>13} {first_token:>13.2f} {total:>7.2f}")
    print(f"answers' sha256: {answers.hexdigest()[:16]}")


if __name__ == "__main__":
    main()
