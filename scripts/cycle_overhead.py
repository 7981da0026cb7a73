"""Where a cycle's time goes beyond the target's forward pass, with the n-gram draft looked
up in the coordinator (the default) and through the draft service
(`--ngram-via-draft-service`), one fresh stack per run, the two alternating.

For each run it prints the medians over drafting cycles (a request's first cycle left out)
of: the time between chunks as the client sees it, the Verify call, the forward passes
inside the target, `overhead` (between chunks minus forward: the plumbing), the draft wait
and the commit; and the CPU each process spent per cycle (from /proc: Linux only).

    python scripts/cycle_overhead.py [--target NAME] [--prompts 4] [--rounds 3] [--k 2]
"""

import argparse
import os
import statistics
import time

import specdec
from specdec.bench import encode, load_prompts
from specdec.launcher import Stack, StackConfig
from specdec.vocab import load_tokenizer
from specdec.redis_server import free_port


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of one process so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def redis_pids() -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and b"redis-server" in open(f"/proc/{entry}/cmdline", "rb").read():
                pids.append(int(entry))
        except OSError:
            pass
    return pids


def run(args, prompts: list[list[int]], via_service: bool) -> dict:
    """One stack, every prompt once; the per-cycle medians and CPU per cycle."""
    coordinator_args = ["--ngram-via-draft-service"] if via_service else []
    config = StackConfig(port=free_port(), target=args.target, draft="ngram", coordinator_args=coordinator_args)
    rows, cycles = [], 0
    with Stack(config, quiet=True) as stack:
        pids = {name: process.pid for name, process in stack.processes.items()}
        pids.update({f"redis {pid}": pid for pid in redis_pids()})
        with specdec.Client(stack.address) as client:
            client.generate(prompt_token_ids=prompts[0][:8], max_new_tokens=8, num_speculative_tokens=args.k)
            before = {name: cpu_seconds(pid) for name, pid in pids.items()}
            client_before = time.process_time()
            for seed, ids in enumerate(prompts, 1):
                last = time.perf_counter()
                for chunk in client.generate_stream(prompt_token_ids=ids, seed=seed, max_new_tokens=args.max_new_tokens,
                                                    num_speculative_tokens=args.k):  # fmt: skip
                    now = time.perf_counter()
                    cycle = chunk.cycle
                    if cycle is not None:
                        cycles += 1
                        if cycle.index > 0 and cycle.drafted and chunk.token_ids:
                            rows.append(((now - last) * 1000, cycle))
                    last = now
            cpu = {name: (cpu_seconds(pid) - before[name]) * 1000 / cycles for name, pid in pids.items()}
            cpu["client"] = (time.process_time() - client_before) * 1000 / cycles

    def median(values):
        return statistics.median(values) if values else float("nan")

    return {
        "cycles": len(rows),
        "interval": median([interval for interval, _ in rows]),
        "verify": median([c.verify_ms for _, c in rows]),
        "forward": median([c.forward_ms for _, c in rows]),
        "overhead": median([interval - c.forward_ms for interval, c in rows]),
        "draft": median([c.draft_ms for _, c in rows]),
        "commit": median([c.commit_ms for _, c in rows]),
        "cpu": cpu,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--prompts", type=int, default=4, help="how many of the bench's default prompts")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--k", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3, help="runs of each path, alternating")
    args = parser.parse_args()
    tokenizer = load_tokenizer(args.target)
    prompts = [encode(tokenizer, p, True) for p in load_prompts(None)[: args.prompts]]
    for round_ in range(args.rounds):
        for via_service in (True, False):
            r = run(args, prompts, via_service)
            path = "via the draft service" if via_service else "in the coordinator  "
            cpu = ", ".join(f"{name} {ms:.2f}" for name, ms in r["cpu"].items())
            print(f"round {round_ + 1}, n-gram {path}: {r['cycles']} drafting cycles, between chunks "
                  f"{r['interval']:.1f} ms, verify {r['verify']:.1f}, forward {r['forward']:.1f}, "
                  f"overhead {r['overhead']:.2f}, draft {r['draft']:.2f}, commit {r['commit']:.2f}; "
                  f"CPU ms per cycle: {cpu}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
