"""`specdec bench`: specdec side by side with `transformers` on the same prompts and models.

In one invocation, on one machine, for the same prompt token ids, prompt by prompt in turn
(so a machine that speeds up or slows down meanwhile moves every system alike):
    target_only   the target alone, `model.generate` (greedy or sampled), loaded as
                  transformers loads it
    hf_assisted   transformers' in-process speculative decoding on the same pair
                  (`assistant_model=` for a model draft, `prompt_lookup_num_tokens=` for ngram)
    hf_assisted_packed  the same on specdec's packed linear layers (specdec.packed), where
                  packing applies: kernel for kernel with the services
    specdec       the three services as separate processes on loopback, through the SDK

Terms (the seed's performance model, design.md §3):
    α          acceptance rate: accepted draft tokens / drafted tokens (measured by specdec)
    c_q        ms per draft token (one draft step with a KV cache; ~0 for ngram)
    c_p        ms per single-token target step with a KV cache
    c_verify   ms per target pass over K+1 tokens with a KV cache (the draft idle; a
               pipelined cycle's pass, with a model draft drafting beside it, is timed on the
               target's fewer threads then: c_verify_shared)
    E[tokens]  (1 − α^(K+1)) / (1 − α) tokens per cycle
    sequential analytic tokens/s = E[tokens] / (K·c_q + c_verify)
    pipelined  analytic tokens/s = E[tokens] / max(K·c_q, c_verify_shared)
               summed over the run's own cycles (`analytic_rates`): each drafting cycle at the
               K it drafted, each token of a plain cycle (no drafts: adaptive K = 0, back-off)
               at c_p, so an adaptive run is compared with the mix it actually ran, and each
               request's first cycle at its own work alone: the prompt's prefill
    efficiency = measured specdec tokens/s / sequential analytic tokens/s
               (efficiency_without_prefill: against the model that counts a request's first
               cycle as one step c_p; the measured time includes the prefills either way)
    bytes/cycle  bytes of q on the wire per drafting cycle, against K·V·4 for dense float32
    cycle_ms   median time of drafting cycles, pipelined (drafted while the previous cycle
               verified) and sequential, to compare with max(K·c_q, c_verify) and their sum
    profile    where a cycle's time goes (`profile_cycles`), medians by kind of cycle
               (sequential, pipelined, plain): drafting, the Verify call, the target's forward
               passes inside it (timed by the target service), the same work timed alone
               (c_verify[K], or c_p per plain token), the Redis commit, and the interval between
               chunks as the client sees it
    --compare-k   specdec alone, adaptive K against fixed K and the target alone, all in one
                  stack and interleaved (`run_compare_k`): adaptive_vs_best_fixed_k
    required α (`--costs`) the smallest α at which K drafts per cycle reach 1.0× / 1.3× the
               target's own tokens/s (1 / c_p), sequential and pipelined
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from specdec.ngram import DEFAULT_K, NGRAM_DRAFT
from specdec.prompts import PromptFileError, read_json_lines
from specdec.ranges import AT_LEAST_ONE, DEFAULT_MAX_K, text_problem

DEFAULT_PROMPTS = "bench_prompts.jsonl"
# Timed rounds of each cost after each prompt (after one untimed round). With one, the costs
# ran 15-25% above the services' own forward times (a first pass after other work is slow),
# and a run's efficiency came out above 1 (1.12: ngram, extractive, K = 2); three take the
# median of three, ~0.6 s a prompt at K = 2, ~2 s at adaptive K's 8.
COST_REPEATS = 3


@dataclass
class Run:
    """One system's outputs and timings over all prompts."""

    outputs: list[list[int]] = field(default_factory=list)
    seconds: float = 0.0
    tokens: int = 0
    token_ms: list[float] = field(default_factory=list)  # per-token latencies (specdec only)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def add_bench_parser(commands) -> None:
    from specdec.cli import add_ngram_first_flag, add_stack_model_flags
    from specdec.ranges import MAX_NEW_TOKENS, TEMPERATURE, THREADS, TOP_K, TOP_P

    p = commands.add_parser(
        "bench",
        help="benchmark specdec against transformers on the same model pair",
        description=__doc__.split("\n\n")[1] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_stack_model_flags(p, " of specdec's stack and of transformers' baselines")
    add_ngram_first_flag(p, "specdec's coordinator: ")
    p.add_argument("--k", type=k_value, default=None,
                   help="tokens drafted per cycle, or `adaptive` (up to --max-k) (default: the draft's own K: a catalog "
                   f"draft's, 2 for smollm2-135m-instruct-draft, or the serving_k on the card of a directory `specdec "
                   f"distill` wrote; else {DEFAULT_K}, the coordinator's default)")  # fmt: skip
    p.add_argument("--max-k", type=AT_LEAST_ONE, default=8, help="largest K with --k adaptive (default: %(default)s)")
    p.add_argument("--prompts", default=None, help='JSONL file, one {"prompt": ...} per line (default: the shipped set)')
    p.add_argument("--kind", default=None,
                   help='only the prompts whose "kind" is this, or one of these, comma-separated: code,chat '
                   '(the shipped set has extractive, code, chat)')
    p.add_argument("--max-new-tokens", type=MAX_NEW_TOKENS, default=64, help="tokens per prompt (default: %(default)s)")
    p.add_argument("--temperature", type=TEMPERATURE, default=0.0, help="0 = greedy (default: %(default)s)")
    p.add_argument("--top-k", type=TOP_K, default=0, help="top-k warping when sampling (0 = off)")
    p.add_argument("--top-p", type=TOP_P, default=1.0, help="top-p warping when sampling (1.0 = off)")
    p.add_argument("--repeats", type=AT_LEAST_ONE, default=1, help="passes over the prompt set (default: %(default)s)")
    p.add_argument("--pipeline", choices=["auto", "on", "off"], default="auto",
                   help="specdec's pipelining: the server's choice per cycle (auto: where its early drafting "
                        "is likely kept), every cycle (on), or none (off: each cycle drafts after the previous "
                        "verdict); compare cycle_ms (default: %(default)s)")
    p.add_argument("--no-pipeline", dest="pipeline", action="store_const", const="off", help="the same as --pipeline off")
    p.add_argument("--threads", type=THREADS, default=0,
                   help="torch threads of the in-process baselines (0 = torch's default, all cores)")  # fmt: skip
    p.add_argument("--device", default="cpu",
                   help="where every model of the bench runs, the baselines and the services alike (their "
                        "SPECDEC_*_DEVICE is not read): cpu, cuda, cuda:N or auto (default: %(default)s)")  # fmt: skip
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16", "auto"],
                   help="the dtype of every model of the bench, baselines and services alike (default: %(default)s)")
    p.add_argument("--no-chat-template", action="store_true", help="use prompts as raw text")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--compare-k", type=k_list, default=None, metavar="K,K,...",
                   help="instead of the side-by-side: specdec alone, adaptive K (up to --max-k) against each of "
                        "these fixed K and the target alone (K = 0), all in one stack, interleaved prompt by "
                        "prompt; prints each one's tokens/s and adaptive / best fixed K")  # fmt: skip
    p.add_argument("--costs", action="store_true",
                   help="only measure this machine's costs (c_p, c_q, a verify pass over 2..max-k+1 tokens) "
                        "and print the acceptance rate α each K needs to match, or beat by 1.3x, the target "
                        "alone; no generation runs (seconds, not minutes)")  # fmt: skip


def k_list(text: str) -> list[int]:
    """`2,4` -> [2, 4]: the fixed K of --compare-k (each 1..DEFAULT_MAX_K, what the stack takes)."""
    try:
        ks = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected K values separated by commas, such as 2,4; got {text!r}") from None
    if not ks or ks[0] < 1 or ks[-1] > DEFAULT_MAX_K:
        raise argparse.ArgumentTypeError(f"each K must be 1..{DEFAULT_MAX_K} (the services' --max-k), got {text!r}")
    return ks


def k_value(text: str):
    from specdec.cli import k_value as parse

    return parse(text)


def refuse_what_the_stack_refuses(args) -> None:
    """End the command, before a model loads, on a K or max_new_tokens the bench's stack would
    refuse (the services' default limits); `bench --k 20` loaded both models and started its
    stack before it ended in a traceback. --costs starts no stack: its K may be any."""
    from specdec.cli import refuse_past_stack_limits

    if not args.costs:  # --compare-k runs adaptive K up to --max-k beside its fixed Ks
        ks = {"--k": args.k, "--max-k": args.max_k if args.k == "adaptive" or args.compare_k else None}
        refuse_past_stack_limits("bench", "its stack", ks, args.max_new_tokens)


def load_prompts(path: str | None, kind: str | None = None) -> list[str]:
    """The prompts of a JSONL file (default: the shipped set), only those whose "kind" is
    one of `kind`'s comma-separated names when given (the shipped set's kinds: extractive,
    code, chat). A file that cannot be read or a line that is not a prompt ends the command."""
    kinds = None if kind is None else {name.strip() for name in kind.split(",") if name.strip()}
    try:
        rows = read_json_lines(path, DEFAULT_PROMPTS)
    except PromptFileError as exc:
        raise SystemExit(str(exc)) from None
    prompts = []
    for where, item in rows:
        if not isinstance(item, dict) or not isinstance(item.get("prompt"), str):
            raise SystemExit(f"{where}: expected an object with a string 'prompt'")
        if problem := text_problem(f"{where}: the prompt", item["prompt"]):  # a "\udce9" escape
            raise SystemExit(problem)
        if kinds is None or item.get("kind") in kinds:
            prompts.append(item["prompt"])
    if not prompts:
        raise SystemExit(f"no prompts{f' of kind {kind!r}' if kind else ''} in {path or DEFAULT_PROMPTS}")
    return prompts


def encode(tokenizer, prompt: str, chat: bool) -> list[int]:
    from specdec.vocab import chat_ids, has_chat_template, text_ids

    if chat and has_chat_template(tokenizer):
        return chat_ids(tokenizer, [{"role": "user", "content": prompt}])
    return text_ids(tokenizer, prompt)


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# ---------------------------------------------------------------- in-process baselines


def hf_generate(model, ids: list[int], args, *, assistant_settings: dict | None = None, **extra) -> list[int]:
    """transformers' generate of `ids`; `assistant_settings` (assisted_kwargs) are set on the
    assistant's generation config first, each call: its heuristic schedule changes its K from
    call to call, and a timed call starts where the one before left it."""
    import torch

    for name, value in (assistant_settings or {}).items():
        setattr(extra["assistant_model"].generation_config, name, value)
    sampled = args.temperature > 0
    out = model.generate(
        torch.tensor([ids], device=model.device), attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=model.device),
        do_sample=sampled, temperature=args.temperature if sampled else None,
        top_k=args.top_k or None if sampled else None, top_p=args.top_p if sampled else None,
        max_new_tokens=args.max_new_tokens, **extra,
    )  # fmt: skip
    return out[0, len(ids) :].tolist()


def time_hf(run: Run, model, ids: list[int], args, **extra) -> None:
    """One prompt through transformers `generate`, added to `run`."""
    start = time.perf_counter()
    out = hf_generate(model, ids, args, **extra)
    run.seconds += time.perf_counter() - start
    run.tokens += len(out)
    run.outputs.append(out)


def assisted_kwargs(args, draft_model) -> dict:
    """hf_generate's arguments for transformers' assisted generation at the same K: K drafts a
    cycle (no early stop on the assistant's confidence); with --k adaptive, transformers' own
    adaptive schedule (its heuristic K from --max-k, its default confidence stop). A model
    draft's settings go on the assistant's generation config, where transformers reads them
    (AssistedCandidateGenerator): passed to generate() they were ignored, and it drafted its
    default 20 tokens a cycle, stopping below a confidence of 0.4, whatever --k."""
    from transformers import GenerationConfig

    adaptive = args.k == "adaptive"
    k = args.max_k if adaptive else args.k
    if draft_model is None:
        return {"prompt_lookup_num_tokens": k}
    threshold = GenerationConfig().assistant_confidence_threshold if adaptive else 0.0
    settings = {"num_assistant_tokens": k, "num_assistant_tokens_schedule": "heuristic" if adaptive else "constant",
                "assistant_confidence_threshold": threshold}  # fmt: skip
    return {"assistant_model": draft_model, "assistant_settings": settings}


# ---------------------------------------------------------------- costs


def ngram_ms(context: list[int], k: int) -> float:
    from specdec.ngram import find_continuation

    start = time.perf_counter()
    for _ in range(100):
        find_continuation(context, k, 3, 1)
    return (time.perf_counter() - start) * 1000 / 100 / max(k, 1)


# ---------------------------------------------------------------- specdec


def new_totals(split_looked_up: bool = False) -> dict:
    """specdec's counters over a run (see time_specdec); split_looked_up: count a model
    draft's looked-up cycles (--ngram-first) apart."""
    return {"split_looked_up": split_looked_up, "drafted": 0, "accepted": 0, "draft_cycles": 0, "cycles": 0, "draft_bytes": 0, "k_sum": 0,
            "pipelined": 0, "cycle_ms": {"sequential": [], "pipelined": []}, "cycles_by_k": {},
            "plain_tokens": 0, "cycles_seen": [],
            # --ngram-first: the cycles whose drafts were looked up (no draft model step)
            "looked_up": {"drafted": 0, "accepted": 0, "cycles_by_k": {}}}  # fmt: skip


def request_options(args) -> dict:
    """SDK options every specdec request of a bench takes: length, sampling, pipelining."""
    return dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                top_p=args.top_p, pipeline={"auto": None, "on": True, "off": False}[args.pipeline])  # fmt: skip


def specdec_options(args) -> dict:
    adaptive = args.k == "adaptive"
    return dict(request_options(args), adaptive_k=adaptive, num_speculative_tokens=args.max_k if adaptive else args.k)


def time_specdec(run: Run, totals: dict, client, ids: list[int], seed: int, options: dict) -> None:
    """One prompt through the services (SDK stream), added to `run` and `totals`."""
    out, last = [], time.perf_counter()
    start = last
    for chunk in client.generate_stream(prompt_token_ids=ids, seed=seed, **options):
        now = time.perf_counter()
        if chunk.token_ids:
            run.token_ms += [(now - last) * 1000 / len(chunk.token_ids)] * len(chunk.token_ids)
        interval_ms, last = (now - last) * 1000, now
        out += chunk.token_ids
        if chunk.cycle is not None:
            totals["cycles_seen"].append((chunk.cycle, len(chunk.token_ids), interval_ms))
            totals["draft_bytes"] += chunk.cycle.draft_bytes
            totals["pipelined"] += chunk.cycle.pipelined
            totals["k_sum"] += chunk.cycle.k if chunk.cycle.drafted else 0
            if chunk.cycle.drafted:
                # the analytic model takes the K actually drafted, and drafts looked up for a
                # model draft (n-gram first) apart: they cost no c_q and have their own α
                by_k = totals["cycles_by_k"]
                if chunk.cycle.looked_up and totals["split_looked_up"]:
                    looked_up = totals["looked_up"]
                    by_k = looked_up["cycles_by_k"]
                    looked_up["drafted"] += chunk.cycle.drafted
                    looked_up["accepted"] += chunk.cycle.accepted
                by_k[chunk.cycle.drafted] = by_k.get(chunk.cycle.drafted, 0) + 1
                # a drafting cycle's time, start of drafting to verdict
                kind = "pipelined" if chunk.cycle.pipelined else "sequential"
                totals["cycle_ms"][kind].append(chunk.cycle.draft_ms + chunk.cycle.verify_ms)
            else:
                totals["plain_tokens"] += len(chunk.token_ids)
        stats = chunk.stats
    run.seconds += time.perf_counter() - start
    run.tokens += len(out)
    run.outputs.append(out)
    totals["drafted"] += stats.draft_tokens
    totals["accepted"] += stats.accepted_tokens
    totals["draft_cycles"] += stats.draft_cycles
    totals["cycles"] += stats.cycles


def stack_config(args):
    """The services a bench runs specdec on: `specdec up`'s, with its --ngram-first."""
    from specdec.launcher import StackConfig
    from specdec.redis_server import free_port

    placed = ["--device", args.device, "--dtype", args.dtype]  # as the baselines: a GPU stack beside CPU baselines compared nothing
    return StackConfig(port=free_port(), target=args.target, draft=args.draft, ngram_first=args.ngram_first,
                       target_args=placed, draft_args=placed)  # fmt: skip


def run_interleaved(args, prompts_ids, target, draft, packed_target, packed_draft) -> tuple[dict[str, Run], dict, Costs]:
    """Every system on every prompt, prompt by prompt: target alone, transformers assisted
    (stock, then on packed layers when packing applies) and specdec, then the seed's costs
    after that prompt and its output (the models as the services load them, the services
    idle); so a machine that speeds up or slows down while the bench runs moves all of them
    alike, and the costs are medians over the run's own contexts."""
    import specdec
    from specdec.launcher import Stack

    systems = {
        "target_only": (target.model, {}),
        "hf_assisted": (target.model, assisted_kwargs(args, draft and draft.model)),
    }
    if packed_target is not None:
        systems["hf_assisted_packed"] = (packed_target.model, assisted_kwargs(args, packed_draft and packed_draft.model))
    runs = {name: Run() for name in [*systems, "specdec"]}
    totals = new_totals(split_looked_up=bool(args.ngram_first) and args.draft != NGRAM_DRAFT)
    # every K a cycle may draft: adaptive K's range, or 1..K (a draft may propose fewer)
    ks = range(1, (args.max_k if args.k == "adaptive" else args.k) + 1)
    cost_target = packed_target or target
    cost_draft = packed_draft if packed_target is not None else draft
    samples: list[Costs] = []
    options = specdec_options(args)
    progress("specdec: draft, target and coordinator as separate processes on loopback")
    with Stack(stack_config(args), quiet=True) as stack:
        with specdec.Client(stack.address) as client:
            warm = prompts_ids[0][:8]
            for model, extra in systems.values():
                hf_generate(model, warm, args, **extra)
            client.generate(prompt_token_ids=warm, **{**options, "max_new_tokens": 8})
            total = args.repeats * len(prompts_ids)
            names = ", ".join(runs)
            for number in range(total):
                ids = prompts_ids[number % len(prompts_ids)]
                progress(f"prompt {number + 1}/{total}: {names}")
                for name, (model, extra) in systems.items():
                    time_hf(runs[name], model, ids, args, **extra)
                time_specdec(runs["specdec"], totals, client, ids, number + 1, options)
                context = ids + runs["target_only"].outputs[-1]
                samples.append(measure_costs(args.draft, cost_target, cost_draft, context, ks, COST_REPEATS, ids))
    return runs, totals, median_costs(samples)


# ---------------------------------------------------------------- the command


def required_alpha(speedup: float, k: int, c_q: float, c_verify: float, c_p: float, pipelined: bool = False) -> float | None:
    """The smallest α at which K drafts per cycle make `speedup` × the target alone's
    tokens/s (1 / c_p), by the seed's model: E[tokens](α, K) / (K·c_q + c_verify), or
    / max(K·c_q, c_verify) when pipelined. None when even α = 1 falls short."""
    from specdec.speedup import expected_tokens_per_cycle

    cycle_ms = max(k * c_q, c_verify) if pipelined else k * c_q + c_verify
    needed = speedup * cycle_ms / c_p  # tokens per cycle
    if needed > k + 1:
        return None
    low, high = 0.0, 1.0
    for _ in range(50):  # E[tokens] rises with α: bisect
        middle = (low + high) / 2
        low, high = (middle, high) if expected_tokens_per_cycle(middle, k) < needed else (low, middle)
    return high


def analytic_rates(alpha: float, cycles_by_k: dict[int, int], plain_tokens: int, c_q: float,
                   c_verify: dict[int, float], c_p: float,
                   looked_up: tuple[float, dict[int, int]] | None = None,
                   prefill_ms: float = 0.0) -> tuple[float, float]:  # fmt: skip
    """(sequential, pipelined) analytic tokens/s of a run's own cycles, by the seed's model.

    cycles_by_k: {K: drafting cycles that drafted K tokens}; plain_tokens: tokens of cycles that
    drafted nothing (each one target step, c_p). A drafting cycle yields E[tokens](α, K) and takes
    K·c_q + c_verify[K] (sequential) or max(K·c_q, c_verify[K]) (pipelined), all in ms.
    With one K and no plain cycles this is E[tokens] / (K·c_q + c_verify).
    looked_up: (α, cycles_by_k) of a model draft's looked-up cycles (--ngram-first), which
    yield E[tokens] at their own α and take c_verify[K] alone (c_q = 0).
    prefill_ms: what the requests' first cycles cost beyond what the above counts for them:
    each prefills its prompt, on the target and on a model draft, where the above counts one
    step (c_p or c_verify[K], and c_q); so the sum of each prompt's passes timed alone less
    c_p (and c_q). The seed's formula is one of decoding: without this term the prefills a
    run measures count against its efficiency.
    """
    from specdec.speedup import expected_tokens_per_cycle

    groups = [(alpha, cycles_by_k, c_q)] + ([(looked_up[0], looked_up[1], 0.0)] if looked_up else [])
    tokens = plain_tokens + sum(n * expected_tokens_per_cycle(a, k) for a, by_k, _ in groups for k, n in by_k.items())
    plain_ms = prefill_ms + plain_tokens * c_p
    sequential_ms = plain_ms + sum(n * (k * q + c_verify[k]) for _, by_k, q in groups for k, n in by_k.items())
    pipelined_ms = plain_ms + sum(n * max(k * q, c_verify[k]) for _, by_k, q in groups for k, n in by_k.items())
    if not tokens or not sequential_ms:
        return 0.0, 0.0
    return tokens / sequential_ms * 1000, tokens / pipelined_ms * 1000


def profile_cycles(cycles, c_verify: dict[int, float], c_p: float, c_verify_shared: dict[int, float] | None = None) -> dict:
    """Where a cycle's time goes: per kind of cycle, the median ms of each part.

    cycles: (CycleTrace, tokens it committed, ms since the previous chunk) for every chunk;
    a request's first cycle (it prefills the prompt) is left out. Kinds: `sequential` and
    `pipelined` drafting cycles, and `plain` cycles (no drafts: K = 0, back-off). Parts:
    draft (drafts in hand), verify (the Verify call), forward (the target's forward passes,
    timed inside the target service), alone (the same work timed alone: c_verify[K], with the
    draft's core left to it for a pipelined cycle, or c_p per token of a plain cycle), forward_vs_alone (median of forward / alone), commit (Redis),
    interval (between chunks, as the client sees it: everything a cycle costs).
    """
    groups: dict[str, list] = {"sequential": [], "pipelined": [], "plain": []}
    for cycle, tokens, interval_ms in cycles:
        if cycle.index == 0 or not tokens:
            continue
        kind = "plain" if not cycle.drafted else "pipelined" if cycle.pipelined else "sequential"
        verify = (c_verify_shared or c_verify) if cycle.pipelined else c_verify
        alone = verify[cycle.drafted] if cycle.drafted else c_p * tokens
        groups[kind].append((cycle, alone, interval_ms))
    profile = {}
    for kind, rows in groups.items():
        if not rows:
            continue
        profile[kind] = {
            "cycles": len(rows),
            "draft_ms": percentile([c.draft_ms for c, _, _ in rows], 50),
            "verify_ms": percentile([c.verify_ms for c, _, _ in rows], 50),
            "forward_ms": percentile([c.forward_ms for c, _, _ in rows], 50),
            "alone_ms": percentile([alone for _, alone, _ in rows], 50),
            "forward_vs_alone": percentile([c.forward_ms / alone for c, alone, _ in rows], 50),
            "commit_ms": percentile([c.commit_ms for c, _, _ in rows], 50),
            "interval_ms": percentile([interval for _, _, interval in rows], 50),
        }
    return profile


@dataclass
class Costs:
    """What one step of each kind costs here, in ms, each model on the threads the services
    give it: the target takes every core while the draft is idle (plain steps, and Verify
    with the drafts in hand) and leaves the draft one while it drafts beside it (pipelining)."""

    c_p: float  # one target step, draft idle
    c_verify: dict[int, float]  # K -> a target pass over K+1 tokens, draft idle
    c_verify_shared: dict[int, float]  # the same while a model draft drafts beside it
    c_q: float  # one draft token
    threads: dict[str, int]  # torch threads: target (draft idle), target_shared, draft
    # A prompt's prefill per prompt token: the target's pass over it (draft idle), and a model
    # draft's (its first Propose; 0 for an n-gram draft). 0 when no prompt was timed.
    prefill: float = 0.0
    draft_prefill: float = 0.0


def measure_costs(draft_name: str, target, draft, context: list[int], ks: Sequence[int], repeats: int = 5,
                  prompt: Sequence[int] = ()) -> Costs:  # fmt: skip
    """Costs after `context` (launcher.default_threads and solo_threads), and of prefilling
    `prompt` when given, each the median of `repeats` timings; the caller's thread count is
    restored."""
    import torch

    from specdec.kvcache import prefill_ms, step_ms, step_ms_by_size
    from specdec.launcher import default_threads, solo_threads

    shared_threads, draft_threads = default_threads(draft_name)
    idle_threads = solo_threads()
    sizes = [1, *(k + 1 for k in ks)]
    threads_before = torch.get_num_threads()
    try:
        torch.set_num_threads(idle_threads)
        idle = step_ms_by_size(target.model, context, sizes, repeats)
        prefill = prefill_ms(target.model, prompt, repeats) / len(prompt) if prompt else 0.0
        shared = idle
        if shared_threads != idle_threads:
            torch.set_num_threads(shared_threads)
            shared = step_ms_by_size(target.model, context, sizes, repeats)
        torch.set_num_threads(draft_threads)
        c_q = ngram_ms(context, max(ks)) if draft is None else step_ms(draft.model, context, 1, repeats)
        draft_prefill = prefill_ms(draft.model, prompt, repeats) / len(prompt) if prompt and draft is not None else 0.0
    finally:
        torch.set_num_threads(threads_before)
    threads = {"target": idle_threads, "target_shared": shared_threads, "draft": draft_threads}
    return Costs(idle[1], {k: idle[k + 1] for k in ks}, {k: shared[k + 1] for k in ks}, c_q, threads,
                 prefill, draft_prefill)  # fmt: skip


def median_costs(samples: Sequence[Costs]) -> Costs:
    """The median of each cost over several measurements (the bench takes one per prompt)."""
    ks = samples[0].c_verify

    def median(values):
        return percentile(list(values), 50)

    return Costs(
        c_p=median(c.c_p for c in samples),
        c_verify={k: median(c.c_verify[k] for c in samples) for k in ks},
        c_verify_shared={k: median(c.c_verify_shared[k] for c in samples) for k in ks},
        c_q=median(c.c_q for c in samples),
        threads=samples[0].threads,
        prefill=median(c.prefill for c in samples),
        draft_prefill=median(c.draft_prefill for c in samples),
    )


def run_costs(args, target, draft, context: list[int]) -> int:
    """`specdec bench --costs`: what each K costs here, and the α it needs to pay."""
    max_k = args.max_k if args.k == "adaptive" else max(args.k, 1)
    progress(f"measuring a target step and verify passes over 2..{max_k + 1} tokens")
    costs = measure_costs(args.draft, target, draft, context, range(1, max_k + 1))
    c_p, c_q = costs.c_p, costs.c_q
    verify = {"sequential": costs.c_verify, "pipelined": costs.c_verify_shared}
    required = {
        mode: {
            f"{speedup:g}": {str(k): required_alpha(speedup, k, c_q, verify[mode][k], c_p, mode == "pipelined")
                             for k in verify[mode]}
            for speedup in (1.0, 1.3)
        }
        for mode in ("sequential", "pipelined")
    }  # fmt: skip
    report = {
        "target": args.target, "draft": args.draft, "device": args.device, "dtype": args.dtype,
        "context_tokens": len(context), "threads": costs.threads,
        "c_p_ms": c_p, "c_q_ms": c_q, "c_verify_ms": {str(k): ms for k, ms in costs.c_verify.items()},
        "c_verify_shared_ms": {str(k): ms for k, ms in costs.c_verify_shared.items()},
        "verify_over_step": {str(k): ms / c_p for k, ms in costs.c_verify.items()},
        "required_alpha": required,
        "kernels": {"target": target.kernels, "draft": draft.kernels if draft is not None else {}},
    }  # fmt: skip
    print(json.dumps(report) if args.json else format_costs(report))
    return 0


def format_costs(r: dict) -> str:
    def alpha(value):
        return "  never" if value is None else f"{value:>7.2f}"

    threads = r["threads"]
    lines = [
        f"target {r['target']} ({threads['target']} threads with the draft idle, {threads['target_shared']} while "
        f"it drafts beside it), draft {r['draft']} ({threads['draft']}), {r['context_tokens']} tokens of context, "
        f"on {r['device']} in {r['dtype']}",
        f"c_p {r['c_p_ms']:.1f} ms per target step, c_q {r['c_q_ms']:.2f} ms per draft token",
        f"linear kernels timed at load (or as timed before, kernels.json in the cache): target {format_kernels(r['kernels']['target'])}; "
        f"draft {format_kernels(r['kernels']['draft'])}",
        "",
        f"{'K':>3}{'c_verify':>10}{'/ c_p':>7}{'shared':>9}   α for 1.0x / 1.3x the target alone: sequential, pipelined",
    ]
    seq, pipe = r["required_alpha"]["sequential"], r["required_alpha"]["pipelined"]
    for k, ms in r["c_verify_ms"].items():
        lines.append(f"{k:>3}{ms:>8.1f}ms{r['verify_over_step'][k]:>7.2f}{r['c_verify_shared_ms'][k]:>7.1f}ms   "
                     f"{alpha(seq['1'][k])}{alpha(seq['1.3'][k])}   {alpha(pipe['1'][k])}{alpha(pipe['1.3'][k])}")  # fmt: skip
    return "\n".join(lines)


def format_kernels(kernels: dict[str, str]) -> str:
    """{"one row, 1 thread": "stock", ...} -> "stock for one row, 1 thread; ..." ("not packed" when empty)."""
    return ", ".join(f"{kernel} for {passes}" for passes, kernel in kernels.items()) or "not packed"


def compare_k_options(args) -> dict[str, dict]:
    """SDK options of each system --compare-k runs: adaptive, each fixed K, the target alone."""
    base = request_options(args)
    systems = {"adaptive": {**base, "adaptive_k": True, "num_speculative_tokens": args.max_k}}
    systems.update({f"k{k}": {**base, "num_speculative_tokens": k} for k in args.compare_k})
    systems["target_only"] = {**base, "speculate": False}
    return systems


def run_compare_k(args, prompts_ids: list[list[int]]) -> int:
    """`specdec bench --compare-k`: adaptive K against fixed K, kernel for kernel.

    Every system is specdec through the same stack, so the comparison is of the K policy
    alone; each prompt runs through all of them in turn, the order reversed every other
    prompt, so drift of the machine and what the shared adaptive estimate has learnt by
    then fall on all alike. One seed per prompt: sampled runs are comparable too.
    """
    import specdec
    from specdec.launcher import Stack

    systems = compare_k_options(args)
    runs = {name: Run() for name in systems}
    totals = {name: new_totals() for name in systems}
    progress("specdec: draft, target and coordinator as separate processes on loopback")
    with Stack(stack_config(args), quiet=True) as stack:
        with specdec.Client(stack.address) as client:
            client.generate(prompt_token_ids=prompts_ids[0][:8], max_new_tokens=8)
            total = args.repeats * len(prompts_ids)
            for number in range(total):
                ids = prompts_ids[number % len(prompts_ids)]
                order = list(systems) if number % 2 == 0 else list(systems)[::-1]
                progress(f"prompt {number + 1}/{total}: {', '.join(order)}")
                for name in order:
                    time_specdec(runs[name], totals[name], client, ids, number + 1, systems[name])
    rates = {name: run.tokens_per_s for name, run in runs.items()}
    fixed = {name: rate for name, rate in rates.items() if name.startswith("k")}
    best = max(fixed, key=fixed.get)
    agree = [len(set(map(tuple, outputs))) == 1 for outputs in zip(*(run.outputs for run in runs.values()))]
    report = {
        "target": args.target, "draft": args.draft, "device": args.device, "dtype": args.dtype, "max_k": args.max_k,
        "prompts": len(prompts_ids),
        "kind": args.kind, "repeats": args.repeats, "temperature": args.temperature, "pipeline": args.pipeline,
        "tokens_per_s": rates, "new_tokens": {name: run.tokens for name, run in runs.items()},
        "best_fixed_k": best, "adaptive_vs_best_fixed_k": rates["adaptive"] / fixed[best],
        "adaptive_vs_target_only": rates["adaptive"] / rates["target_only"],
        "adaptive_cycles_by_k": dict(sorted(totals["adaptive"]["cycles_by_k"].items())),
        "outputs_agree": [sum(agree), len(agree)] if args.temperature == 0 else None,
    }  # fmt: skip
    print(json.dumps(report) if args.json else format_compare_k(report))
    return 0


def format_compare_k(r: dict) -> str:
    lines = [f"target {r['target']}, draft {r['draft']}, {r['prompts']} prompts x {r['repeats']}, "
             f"one stack, interleaved, on {r['device']} in {r['dtype']}", "", f"{'system':<14}{'tokens/s':>10}{'tokens':>8}"]  # fmt: skip
    for name, rate in r["tokens_per_s"].items():
        lines.append(f"{name:<14}{rate:>10.2f}{r['new_tokens'][name]:>8}")
    drafted = ", ".join(f"K={k}: {n}" for k, n in r["adaptive_cycles_by_k"].items()) or "none"
    lines += ["", f"adaptive K drafted {drafted} cycles",
              f"adaptive / best fixed K ({r['best_fixed_k']}): {r['adaptive_vs_best_fixed_k']:.3f}; "
              f"adaptive / target alone: {r['adaptive_vs_target_only']:.3f}"]  # fmt: skip
    if r["outputs_agree"] is not None:
        lines.append(f"greedy outputs agree across all systems on {r['outputs_agree'][0]}/{r['outputs_agree'][1]} prompts")
    return "\n".join(lines)


def loading(role: str, load, name: str, **options):
    """load(name, **options), or the command's end in the line a service of that `role` would
    end with (serving.load_failed) where the model cannot be loaded for a reason its user fixes
    (catalog.USER_LOAD_ERRORS: a cache that cannot be written, a config that does not parse,
    ...), which was a traceback around that line."""
    from specdec.catalog import USER_LOAD_ERRORS
    from specdec.serving import load_failed

    try:
        return load(name, **options)
    except USER_LOAD_ERRORS as exc:
        raise SystemExit(load_failed(role, exc)) from None


def run_bench(args) -> int:
    from specdec.catalog import default_draft, draft_default_k
    from specdec.cli import refuse_missing_model

    if args.costs and args.compare_k:
        raise SystemExit("specdec bench: --costs measures costs only and --compare-k runs generation: give one of them")
    refuse_what_the_stack_refuses(args)
    prompts = load_prompts(args.prompts, args.kind)  # a bad file is refused before torch loads
    args.draft = args.draft or default_draft(args.target)
    refuse_missing_model("target", args.target)  # ... and so is a model that is not there
    refuse_missing_model("draft", args.draft)
    if args.k is None:  # what a stack running this draft uses for requests that set no K
        args.k = draft_default_k(args.draft) or DEFAULT_K

    import torch

    from specdec.models import load_model, resolve_device
    from specdec.packed import should_pack

    try:
        args.device = resolve_device(args.device)  # "auto" named as it resolves; one this machine lacks ends here
    except ValueError as exc:
        raise SystemExit(f"specdec bench: --device: {exc}") from None
    placed = {"device": args.device, "dtype": args.dtype}

    # transformers' assisted loop hands its assistant both a generation config and arguments,
    # then warns as if the caller had ("Passing `generation_config` together with ..."): not ours.
    logging.getLogger("transformers.generation.utils").addFilter(
        lambda record: "together with generation-related arguments" not in record.getMessage()
    )
    if args.threads:
        torch.set_num_threads(args.threads)
    progress(f"loading target {args.target}" + ("" if args.draft == NGRAM_DRAFT else f" and draft {args.draft}"))
    # The baselines run the models exactly as transformers loads them; the costs, like the
    # services, use specdec's loading (packed linear layers on a CPU, specdec.packed).
    if args.compare_k:  # specdec only: the services load the models themselves
        from specdec.vocab import load_tokenizer

        tokenizer = loading("target", load_tokenizer, args.target)
        return run_compare_k(args, [encode(tokenizer, p, not args.no_chat_template) for p in prompts])
    target = loading("target", load_model, args.target, pack=False, **placed)
    draft = None if args.draft == NGRAM_DRAFT else loading("draft", load_model, args.draft, pack=False, **placed)
    prompts_ids = [encode(target.tokenizer, p, not args.no_chat_template) for p in prompts]
    if args.costs:  # a context of ~128 tokens made of the prompts themselves
        context = [t for ids in prompts_ids for t in ids][:128]
        return run_costs(args, pack_loaded(target), pack_loaded(draft), context)

    # A second copy, loaded as the services load it, only where that packs its layers.
    packed = should_pack(target.model)
    packed_target = load_model(args.target, **placed) if packed else None
    packed_draft = load_model(args.draft, **placed) if packed and draft is not None else None
    if not packed:  # the costs run on the baselines' copies (transformers' generate ignores the plain forward)
        pack_loaded(target)
        pack_loaded(draft)
    progress(f"{len(prompts)} prompts x {args.repeats}, each through every system in turn")
    runs, totals, costs = run_interleaved(args, prompts_ids, target, draft, packed_target, packed_draft)
    target_only, hf_assisted, spec = runs["target_only"], runs["hf_assisted"], runs["specdec"]
    hf_assisted_packed = runs.get("hf_assisted_packed")
    # K of the analytic model: the fixed K, or the mean K adaptive K chose when drafting.
    k = args.k if args.k != "adaptive" else max(1, round(totals["k_sum"] / max(totals["draft_cycles"], 1)))

    threads_before = torch.get_num_threads()
    cycles_by_k = dict(sorted(totals["cycles_by_k"].items()))
    c_p, verify, c_q = costs.c_p, costs.c_verify, costs.c_q
    c_verify = verify[k]

    alpha = totals["accepted"] / totals["drafted"] if totals["drafted"] else 0.0
    # --ngram-first: the model's cycles and the looked-up ones, each at its own α
    looked = totals["looked_up"]
    looked_alpha = looked["accepted"] / looked["drafted"] if looked["drafted"] else 0.0
    model_drafted = totals["drafted"] - looked["drafted"]
    model_alpha = (totals["accepted"] - looked["accepted"]) / model_drafted if model_drafted else 0.0
    looked_up = (looked_alpha, looked["cycles_by_k"]) if looked["drafted"] else None
    # each request's first cycle prefills its prompt: beyond the one step the model counts.
    # The median rate per prompt token, as the other costs are medians over the prompts: a
    # prompt whose prefill was timed while the machine was busy moves it little.
    requests = args.repeats * len(prompts_ids)
    prompt_tokens = args.repeats * sum(len(ids) for ids in prompts_ids)
    prefill = {"target": costs.prefill * prompt_tokens, "draft": costs.draft_prefill * prompt_tokens}
    # Never below 0: a short prompt's prefill timed at the median rate can come out under one
    # step, which would credit the analytic model with time no run saves.
    prefill_extra = max(0.0, prefill["target"] - requests * c_p)
    if draft is not None:
        prefill_extra += max(0.0, prefill["draft"] - requests * c_q)
    plain_tokens = totals["plain_tokens"]
    sequential, _ = analytic_rates(model_alpha, cycles_by_k, plain_tokens, c_q, verify, c_p, looked_up, prefill_extra)
    _, pipelined = analytic_rates(model_alpha, cycles_by_k, plain_tokens, c_q, costs.c_verify_shared, c_p, looked_up,
                                  prefill_extra)  # fmt: skip
    decode_only, _ = analytic_rates(model_alpha, cycles_by_k, plain_tokens, c_q, verify, c_p, looked_up)
    vocab = load_vocab_size(args.target)
    greedy = args.temperature == 0
    runs = [target_only, hf_assisted, spec] + ([hf_assisted_packed] if packed else [])
    agree = [len(set(map(tuple, outputs))) == 1 for outputs in zip(*(run.outputs for run in runs))]
    report = {
        "target": args.target,
        "draft": args.draft,
        "device": args.device,
        "dtype": args.dtype,
        "ngram_first": args.ngram_first,
        "k": args.k,
        "prompts": len(prompts),
        "kind": args.kind,
        "pipeline": args.pipeline,
        "new_tokens": spec.tokens,
        "temperature": args.temperature,
        "top_k": args.top_k,
        "top_p": args.top_p,
        "runs": {
            "target_only": {"tokens_per_s": target_only.tokens_per_s, "new_tokens": target_only.tokens},
            "hf_assisted": {"tokens_per_s": hf_assisted.tokens_per_s, "new_tokens": hf_assisted.tokens},
            # the same, with the target's linear layers packed as specdec's services run them
            "hf_assisted_packed": None if hf_assisted_packed is None else {
                "tokens_per_s": hf_assisted_packed.tokens_per_s, "new_tokens": hf_assisted_packed.tokens},
            "specdec": {
                "tokens_per_s": spec.tokens_per_s,
                "p50_token_ms": percentile(spec.token_ms, 50),
                "p99_token_ms": percentile(spec.token_ms, 99),
            },
        },
        "alpha": alpha,
        "mean_accepted_length": 1 + totals["accepted"] / totals["draft_cycles"] if totals["draft_cycles"] else 1.0,
        "c_q_ms": c_q,
        "c_p_ms": c_p,
        "c_verify_ms": c_verify,
        "analytic_tokens_per_s": {"sequential": sequential, "pipelined": pipelined},
        "efficiency": spec.tokens_per_s / sequential if sequential else 0.0,
        # the same against the model without the prefills (a first cycle counted as one step)
        "efficiency_without_prefill": spec.tokens_per_s / decode_only if decode_only else 0.0,
        "speedup_vs_target_only": spec.tokens_per_s / target_only.tokens_per_s,
        "speedup_vs_hf_assisted": spec.tokens_per_s / hf_assisted.tokens_per_s,
        "speedup_vs_hf_assisted_packed": spec.tokens_per_s / hf_assisted_packed.tokens_per_s if packed else None,
        # per cycle that drafted (adaptive K's target-only cycles send nothing and are not counted)
        "bytes_per_cycle": totals["draft_bytes"] / totals["draft_cycles"] if totals["draft_cycles"] else 0.0,
        "dense_bytes_per_cycle": k * vocab * 4,
        "k_used": k,
        # what the analytic model summed: drafting cycles by the K they drafted, plain cycles' tokens,
        # and c_verify for each of those K
        "cycles_by_k": {str(kk): n for kk, n in cycles_by_k.items()},
        # --ngram-first with a model draft: the cycles looked up instead (not in cycles_by_k),
        # their α, and the model's cycles' own α
        "looked_up": None if not totals["split_looked_up"] else {
            "cycles_by_k": {str(kk): n for kk, n in sorted(looked["cycles_by_k"].items())},
            "alpha": looked_alpha, "model_alpha": model_alpha},
        "plain_tokens": totals["plain_tokens"],
        # the prompts' prefills timed alone (target, and draft model: the median ms per prompt
        # token times the requests' prompt tokens), and what the analytic model adds for them:
        # that less one step each (c_p, and c_q)
        "prompt_tokens": prompt_tokens,
        "prefill_ms": prefill,
        "prefill_extra_ms": prefill_extra,
        "c_verify_ms_by_k": {str(kk): ms for kk, ms in verify.items()},
        # the same passes while a model draft drafts beside the target (pipelined cycles)
        "c_verify_shared_ms_by_k": {str(kk): ms for kk, ms in costs.c_verify_shared.items()},
        "pipelined_cycles": totals["pipelined"],
        # median ms of drafting cycles whose drafts were made while the previous cycle verified
        # (pipelined) and of those that drafted after it (sequential)
        "cycle_ms": {
            kind: {"median": percentile(times, 50), "cycles": len(times)} for kind, times in totals["cycle_ms"].items()
        },
        "cycles": totals["cycles"],
        "profile": profile_cycles(totals["cycles_seen"], verify, c_p, costs.c_verify_shared),
        "greedy_outputs_agree": (sum(agree), len(agree)) if greedy else None,
        "baseline_threads": args.threads or threads_before,
        "service_threads": costs.threads,
        # which linear kernel each pass of the services' models takes, as timed at load (specdec.packed)
        "kernels": {"target": packed_target.kernels if packed else {},
                    "draft": packed_draft.kernels if packed_draft is not None else {}},
    }
    if args.json:
        print(json.dumps(report))
    else:
        print(format_report(report))
    return 0


def pack_loaded(loaded):
    """Make a loaded model compute as specdec's loading makes it, in place: linear layers
    packed where that pays (specdec.packed) and the plain forward pass where it gives
    transformers' logits (specdec.plain_forward); returns it (None stays None)."""
    from specdec.packed import pack_model
    from specdec.plain_forward import enable_plain_forward

    if loaded is not None:
        loaded.kernels = pack_model(loaded.model)
        enable_plain_forward(loaded.model)
    return loaded


def load_vocab_size(name: str) -> int:
    from transformers import AutoConfig

    from specdec.catalog import resolve_model

    path, gguf = resolve_model(name)
    return AutoConfig.from_pretrained(str(path), local_files_only=True).vocab_size if gguf is None else 0


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile of `values`, interpolated between the two nearest ranks (numpy's
    default), so q = 50 is the median; 0.0 for none. The nearest rank, rounded half to even,
    took the lower middle of 2 or 6 values and the upper of 4 or 8: the costs' "medians" leaned
    one way or the other with the number of prompts."""
    if not values:
        return 0.0
    ordered = sorted(values)
    position = q / 100 * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def format_report(r: dict) -> str:
    runs = r["runs"]
    lines = [
        f"target {r['target']}, draft {r['draft']}, K={r['k']}, {r['prompts']} prompts, "
        f"{r['new_tokens']} new tokens, temperature {r['temperature']}, on {r['device']} in {r['dtype']}",
        "",
        f"{'run':<14}{'tokens/s':>10}{'vs target':>11}",
    ]
    base = runs["target_only"]["tokens_per_s"]
    for name in ("target_only", "hf_assisted", "hf_assisted_packed", "specdec"):
        if runs.get(name) is None:
            continue
        tps = runs[name]["tokens_per_s"]
        lines.append(f"{name:<14}{tps:>10.2f}{tps / base:>10.2f}x")
    lines += [
        "",
        f"specdec per-token latency: p50 {runs['specdec']['p50_token_ms']:.1f} ms, p99 {runs['specdec']['p99_token_ms']:.1f} ms",
        f"alpha {r['alpha']:.3f}, mean accepted length {r['mean_accepted_length']:.2f}",
        f"c_q {r['c_q_ms']:.2f} ms, c_p {r['c_p_ms']:.2f} ms, c_verify(K+1) {r['c_verify_ms']:.2f} ms",
        f"analytic tokens/s: sequential {r['analytic_tokens_per_s']['sequential']:.2f}, "
        f"pipelined {r['analytic_tokens_per_s']['pipelined']:.2f}; efficiency {r['efficiency']:.3f} "
        f"({r['efficiency_without_prefill']:.3f} without the prefills in the model)",
        f"  (the run's own cycles, and {r['prefill_extra_ms']:.0f} ms of the prompts' prefills beyond one step each: "
        + ", ".join(f"{n} drafting {k}" for k, n in r["cycles_by_k"].items())
        + f"{', ' if r['cycles_by_k'] else ''}{r['plain_tokens']} tokens from plain steps)",
        *([] if not r.get("looked_up") else [
            "  looked up instead of drafted (--ngram-first): "
            + (", ".join(f"{n} of {k}" for k, n in r["looked_up"]["cycles_by_k"].items()) or "none")
            + f"; alpha {r['looked_up']['alpha']:.3f} looked up, {r['looked_up']['model_alpha']:.3f} drafted by the model"]),
        f"speedup vs target only {r['speedup_vs_target_only']:.2f}x, vs transformers assisted {r['speedup_vs_hf_assisted']:.2f}x"
        + ("" if r.get("speedup_vs_hf_assisted_packed") is None else
           f" ({r['speedup_vs_hf_assisted_packed']:.2f}x against it on packed layers)"),
        f"q on the wire: {r['bytes_per_cycle']:.0f} bytes/cycle (dense would be {r['dense_bytes_per_cycle']})",
        "drafting cycles, median ms: "
        + ", ".join(f"{kind} {c['median']:.1f} ({c['cycles']} cycles)" for kind, c in r["cycle_ms"].items()),
    ]
    lines += format_profile(r["profile"])
    if r["greedy_outputs_agree"] is not None:
        same, total = r["greedy_outputs_agree"]
        lines.append(f"greedy outputs agree across the runs: {'yes' if same == total else 'NO'} ({same}/{total} prompts)")
    return "\n".join(lines)


def format_profile(profile: dict) -> list[str]:
    if not profile:
        return []
    lines = [
        "where a cycle's time goes (medians, ms; forward is timed in the target service, alone in this process):",
        f"  {'cycles':<11}{'n':>5}{'draft':>8}{'verify':>8}{'forward':>9}{'alone':>8}{'fwd/alone':>10}{'commit':>8}{'interval':>10}",
    ]
    for kind, p in profile.items():
        lines.append(
            f"  {kind:<11}{p['cycles']:>5}{p['draft_ms']:>8.1f}{p['verify_ms']:>8.1f}{p['forward_ms']:>9.1f}"
            f"{p['alone_ms']:>8.1f}{p['forward_vs_alone']:>10.2f}{p['commit_ms']:>8.1f}{p['interval_ms']:>10.1f}"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="specdec")
    commands = parser.add_subparsers(dest="command", required=True)
    add_bench_parser(commands)
    return run_bench(parser.parse_args(["bench", *(sys.argv[1:] if argv is None else argv)]))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
