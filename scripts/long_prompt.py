"""What a long prompt costs the other sessions of a running stack: how long a stream beside it
waits between chunks while it prefills, and how soon a request is served after a client gave up
on one.

    specdec up --port 7600 &
    python scripts/long_prompt.py --address 127.0.0.1:7600 --tokens 6000

Prints the streaming session's longest and median gap between chunks, the long prompt's time to
first token, and, after a client sent the long prompt with a deadline of --give-up-s seconds, how
long the next short request took. Used for README "Limits" (chunked prefill): with SmolLM2 and
its distilled draft on 2 cores, a 6,000-token prompt: the longest gap 1.23 s (19.07 s with one
prefill pass), the next request served 0.35 s after the give-up (17.51 s).

With --flood, it measures instead a stream beside two clients that send text prompts at the
coordinator's character limit (16 a token) back to back, each refused once tokenized (README
"Limits": tokenizing off the event loop).
"""

from __future__ import annotations

import argparse
import random
import threading
import time

import specdec


def long_prompt(tokens: int) -> list[int]:
    """`tokens` ids spread over SmolLM2's vocabulary (any vocabulary over 40,100 ids)."""
    return [(i * 7919) % 40000 + 100 for i in range(tokens)]


def gaps_beside(client: specdec.Client, prompt: list[int], stream_tokens: int) -> tuple[list[float], float]:
    """Stream `stream_tokens` tokens while the long prompt is sent 2 s in: (the gaps between the
    stream's chunks, sorted; the long prompt's time to first token)."""
    arrivals: list[float] = []
    first_token = []

    def stream():
        for _ in client.generate_stream("Once upon a time", max_new_tokens=stream_tokens, ignore_eos=True):
            arrivals.append(time.perf_counter())

    def send_long():
        first_token.append(client.generate(prompt_token_ids=prompt, max_new_tokens=4).stats.first_token_s)

    streaming = threading.Thread(target=stream)
    streaming.start()
    time.sleep(2)
    sending = threading.Thread(target=send_long)
    sending.start()
    streaming.join()
    sending.join()
    return sorted(b - a for a, b in zip(arrivals, arrivals[1:])), first_token[0]


def served_after_give_up(client: specdec.Client, prompt: list[int], give_up_s: float) -> float:
    """Seconds from a client giving up on the long prompt (its deadline) to a short request's end."""
    try:
        client.generate(prompt_token_ids=prompt, max_new_tokens=4, timeout=give_up_s)
    except specdec.SpecdecClientError as exc:
        print(f"long prompt with a {give_up_s:g} s deadline: {exc.code.name}")
    started = time.perf_counter()
    client.generate("Once upon a time", max_new_tokens=8)
    return time.perf_counter() - started


def gaps_beside_a_flood(client: specdec.Client, chars: int, stream_tokens: int) -> tuple[list[float], float, int]:
    """Stream `stream_tokens` tokens while two clients send `chars`-character text prompts back
    to back: (the gaps between the stream's chunks, sorted; the stream's seconds; prompts sent)."""
    rng = random.Random(0)
    words = ["the", "sea", "cat", "network", "function", "return", "x", "=", "1", "\n"]
    text = " ".join(rng.choice(words) for _ in range(chars // 3))[:chars]
    arrivals: list[float] = []
    streamed = threading.Event()
    sent = []

    def flood():
        while not streamed.is_set():
            sent.append(1)
            try:
                client.generate(text, max_new_tokens=1)
            except specdec.SpecdecClientError:
                pass  # over --max-prompt-tokens: refused once tokenized

    flooding = [threading.Thread(target=flood) for _ in range(2)]
    for thread in flooding:
        thread.start()
    for _ in client.generate_stream("Once upon a time", max_new_tokens=stream_tokens, ignore_eos=True):
        arrivals.append(time.perf_counter())
    streamed.set()
    for thread in flooding:
        thread.join()
    return sorted(b - a for a, b in zip(arrivals, arrivals[1:])), arrivals[-1] - arrivals[0], len(sent)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--address", default="127.0.0.1:50051", help="the stack's coordinator")
    parser.add_argument("--tokens", type=int, default=6000, help="length of the long prompt (default 6000)")
    parser.add_argument("--stream-tokens", type=int, default=200, help="tokens the session beside it streams")
    parser.add_argument("--give-up-s", type=float, default=3.0, help="deadline of the long prompt sent to be given up")
    parser.add_argument("--flood", type=int, default=0, metavar="CHARS",
                        help="measure a stream beside two clients sending CHARS-character text prompts instead")
    args = parser.parse_args()
    prompt = long_prompt(args.tokens)
    with specdec.Client(args.address, retries=0) as client:
        client.generate("warm up", max_new_tokens=4)
        if args.flood:
            gaps, seconds, sent = gaps_beside_a_flood(client, args.flood, args.stream_tokens)
            print(f"stream beside {sent} text prompts of {args.flood} characters: {len(gaps) + 1} chunks in "
                  f"{seconds:.1f} s, longest gap {gaps[-1] * 1000:.0f} ms, median {gaps[len(gaps) // 2] * 1000:.0f} ms")
            return 0
        gaps, first_token_s = gaps_beside(client, prompt, args.stream_tokens)
        print(f"stream beside a {args.tokens}-token prompt: {len(gaps) + 1} chunks, longest gap {gaps[-1]:.2f} s, "
              f"median {gaps[len(gaps) // 2]:.3f} s; the long prompt's first token after {first_token_s:.1f} s")  # fmt: skip
        after = served_after_give_up(client, prompt, args.give_up_s)
        print(f"a short request after the client gave up: done in {after:.2f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
