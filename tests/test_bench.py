"""`specdec bench` runs the three systems on the same prompts and reports the seed's figures.
(A smoke test of the command with tiny models; the ratios themselves are not asserted.)"""

import json
import subprocess
import sys

import pytest

REQUIRED = {
    "target", "draft", "k", "prompts", "new_tokens", "runs", "alpha", "mean_accepted_length", "c_q_ms", "c_p_ms",
    "c_verify_ms", "analytic_tokens_per_s", "efficiency", "speedup_vs_target_only", "speedup_vs_hf_assisted",
    "bytes_per_cycle", "dense_bytes_per_cycle", "cycle_ms", "profile", "prefill_ms", "prefill_extra_ms",
    "efficiency_without_prefill",
}  # fmt: skip


def test_bench_json_has_every_figure_and_greedy_outputs_agree(tiny_models, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "hello world, hello world"}\n{"prompt": "the cat sat on the mat"}\n')
    out = subprocess.run(
        [sys.executable, "-m", "specdec.cli", "bench", "--target", tiny_models.target, "--draft", tiny_models.draft,
         "--prompts", str(prompts), "--max-new-tokens", "16", "--k", "3", "--json"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Passing `generation_config` together" not in out.stderr  # transformers' warning about its own call
    report = json.loads(out.stdout)
    assert REQUIRED <= set(report)
    # transformers assisted also runs a second time on specdec's packed layers (where packing applies)
    from specdec.packed import packing_available

    assert set(report["runs"]) == {"target_only", "hf_assisted", "hf_assisted_packed", "specdec"}
    assert (report["runs"]["hf_assisted_packed"] is not None) == packing_available()
    assert report["runs"]["specdec"]["tokens_per_s"] > 0 and report["runs"]["specdec"]["p99_token_ms"] > 0
    assert report["greedy_outputs_agree"] == [2, 2]
    cycles = report["cycle_ms"]
    assert cycles["sequential"]["cycles"] + cycles["pipelined"]["cycles"] >= 1 and cycles["sequential"]["median"] > 0
    assert 0.0 <= report["alpha"] <= 1.0 and report["dense_bytes_per_cycle"] == 3 * 39 * 4
    # the analytic model sums the run's own cycles: each drafting cycle at the K it drafted (at most 3)
    alpha, c_q, c_p = report["alpha"], report["c_q_ms"], report["c_p_ms"]
    by_k = {int(k): n for k, n in report["cycles_by_k"].items()}
    assert by_k and set(by_k) <= {1, 2, 3} and sum(by_k.values()) == cycles["sequential"]["cycles"] + cycles["pipelined"]["cycles"]
    verify = {int(k): ms for k, ms in report["c_verify_ms_by_k"].items()}
    tokens = report["plain_tokens"] + sum(n * (1 - alpha ** (k + 1)) / (1 - alpha) for k, n in by_k.items())
    ms = report["plain_tokens"] * c_p + sum(n * (k * c_q + verify[k]) for k, n in by_k.items())
    # and each of the 2 requests' prefills, target's and draft's timed alone, beyond one step (none below 0)
    prefill = report["prefill_ms"]
    assert prefill["target"] > 0 and prefill["draft"] > 0
    extra = max(0.0, prefill["target"] - 2 * c_p) + max(0.0, prefill["draft"] - 2 * c_q)
    assert abs(report["prefill_extra_ms"] - extra) < 1e-6
    sequential = tokens / (ms + extra) * 1000
    assert abs(report["analytic_tokens_per_s"]["sequential"] - sequential) < 1e-6 * sequential
    speed = report["runs"]["specdec"]["tokens_per_s"]
    assert abs(report["efficiency"] - speed / sequential) < 1e-6
    assert abs(report["efficiency_without_prefill"] - speed / (tokens / ms * 1000)) < 1e-6
    # the table without --json says both
    from specdec.bench import format_report

    text = format_report(report)
    assert f"efficiency {report['efficiency']:.3f} ({report['efficiency_without_prefill']:.3f} without the prefills" in text
    # the profile splits a drafting cycle: the target's forward is part of the Verify call,
    # which is part of what the client waits between chunks
    for kind in set(report["profile"]) & {"sequential", "pipelined"}:
        part = report["profile"][kind]
        assert 0 < part["forward_ms"] <= part["verify_ms"] <= part["interval_ms"]
        assert part["alone_ms"] > 0 and part["forward_vs_alone"] > 0 and part["commit_ms"] > 0


def test_transformers_assisted_baseline_drafts_the_benchs_k_each_cycle(tiny_models, monkeypatch):
    """The baseline's K went to generate() as arguments, which transformers ignores (it reads
    them from the assistant's generation config): it drafted its default 20 tokens a cycle,
    stopping below a confidence of 0.4, so "vs transformers assisted" compared other work.
    Counted by the drafts of each cycle transformers' candidate generator made."""
    import argparse

    import transformers.generation.candidate_generator as candidates

    from specdec.bench import assisted_kwargs, hf_generate
    from specdec.models import load_model

    drafted: list[tuple[int, int]] = []  # (drafts made, the generator's K then)
    real = candidates.AssistedCandidateGenerator.get_candidates

    def counting(self, input_ids, *rest, **options):
        ids, logits = real(self, input_ids, *rest, **options)
        drafted.append((ids.shape[1] - input_ids.shape[1], self.num_assistant_tokens))
        return ids, logits

    monkeypatch.setattr(candidates.AssistedCandidateGenerator, "get_candidates", counting)
    target, draft = load_model(tiny_models.target, pack=False), load_model(tiny_models.draft, pack=False)
    ids = target.tokenizer("the cat sat on the mat")["input_ids"]
    fixed = argparse.Namespace(temperature=0.0, top_k=0, top_p=1.0, max_new_tokens=40, k=3, max_k=8)
    assert len(hf_generate(target.model, ids, fixed, **assisted_kwargs(fixed, draft.model))) == 40
    # K a cycle, fewer only in the last ones, where fewer tokens are left to make than K + 1
    assert len(drafted) > 8 and all(k == 3 for _, k in drafted) and all(n == 3 for n, _ in drafted[:-4]), drafted
    adaptive = argparse.Namespace(**{**vars(fixed), "k": "adaptive"})
    for _ in range(2):  # transformers' heuristic changes K within a call; each timed call starts at --max-k
        drafted.clear()
        hf_generate(target.model, ids, adaptive, **assisted_kwargs(adaptive, draft.model))
        assert drafted[0][1] == 8, drafted


def test_analytic_rates_sum_the_runs_own_cycles():
    from specdec.bench import analytic_rates

    c_q, c_p, verify = 5.0, 100.0, {2: 150.0, 4: 200.0}
    # one K, no plain cycles: the seed's E[tokens] / (K·c_q + c_verify), and / max(...) pipelined
    sequential, pipelined = analytic_rates(0.5, {4: 10}, 0, c_q, verify, c_p)
    expected = (1 - 0.5**5) / 0.5
    assert abs(sequential - expected / 220.0 * 1000) < 1e-9 and abs(pipelined - expected / 200.0 * 1000) < 1e-9
    # only plain steps: the target's own rate
    assert analytic_rates(0.0, {}, 50, c_q, verify, c_p) == (10.0, 10.0)
    # a mix weighs each cycle by its own cost: 3 cycles of K=2, 1 of K=4 and 20 plain tokens
    e2, e4 = (1 - 0.5**3) / 0.5, expected
    mixed, _ = analytic_rates(0.5, {2: 3, 4: 1}, 20, c_q, verify, c_p)
    assert abs(mixed - (3 * e2 + e4 + 20) / (3 * 160.0 + 220.0 + 20 * 100.0) * 1000) < 1e-9
    assert analytic_rates(0.0, {}, 0, c_q, verify, c_p) == (0.0, 0.0)
    # --ngram-first: looked-up cycles at their own α (0.8 here) and without c_q
    e2_looked_up = (1 - 0.8**3) / 0.2
    with_lookups, _ = analytic_rates(0.5, {4: 1}, 0, c_q, verify, c_p, looked_up=(0.8, {2: 2}))
    assert abs(with_lookups - (e4 + 2 * e2_looked_up) / (220.0 + 2 * 150.0) * 1000) < 1e-9
    # the prefills beyond one step each (900 ms): added to the time, sequential and pipelined
    with_prefills, pipelined = analytic_rates(0.5, {4: 10}, 20, c_q, verify, c_p, prefill_ms=900.0)
    assert abs(with_prefills - (10 * e4 + 20) / (10 * 220.0 + 20 * 100.0 + 900.0) * 1000) < 1e-9
    assert abs(pipelined - (10 * e4 + 20) / (10 * 200.0 + 20 * 100.0 + 900.0) * 1000) < 1e-9


def test_profile_cycles_splits_each_kind_of_cycle_and_compares_its_forward_with_the_same_work_alone():
    from specdec.bench import profile_cycles
    from specdec.client import CycleTrace

    def cycle(index, drafted, pipelined=False, forward=100.0):
        return CycleTrace(index, 4, drafted, 0, False, 2.0, forward + 5, pipelined=pipelined, forward_ms=forward, commit_ms=1.0)

    c_verify, c_p = {2: 80.0, 4: 100.0}, 50.0
    rows = [
        (cycle(0, 4, forward=900.0), 3, 1000.0),  # the first cycle prefills: left out
        (cycle(1, 4, forward=120.0), 3, 130.0),
        (cycle(2, 2, forward=120.0), 1, 130.0),
        (cycle(6, 4, forward=100.0), 2, 110.0),
        (cycle(3, 4, pipelined=True, forward=150.0), 5, 160.0),
        (cycle(4, 0, forward=220.0), 4, 230.0),  # a plain cycle of 4 tokens: alone is 4 · c_p
        (cycle(5, 4, forward=10.0), 0, 1.0),  # the last chunk of a request carries no tokens: left out
    ]
    profile = profile_cycles(rows, c_verify, c_p)
    assert set(profile) == {"sequential", "pipelined", "plain"}
    assert profile["sequential"]["cycles"] == 3 and profile["pipelined"]["cycles"] == 1
    # per cycle forward / alone: 120/100, 120/80, 100/100; the median is 1.2, not 120/median(alone)
    assert profile["sequential"]["forward_vs_alone"] == 1.2 and profile["sequential"]["interval_ms"] == 130.0
    assert profile["pipelined"]["forward_vs_alone"] == 1.5 and profile["pipelined"]["alone_ms"] == 100.0
    assert profile["plain"]["alone_ms"] == 200.0 and profile["plain"]["forward_vs_alone"] == 1.1
    assert profile_cycles([], c_verify, c_p) == {}


def test_bench_refuses_a_malformed_or_missing_prompt_file_and_a_missing_model_with_one_line(tmp_path):
    bad, not_json = tmp_path / "bad.jsonl", tmp_path / "not-json.jsonl"
    bad.write_text('{"text": "no prompt key"}\n')
    not_json.write_text("just text\n")
    latin1, escaped = tmp_path / "latin1.jsonl", tmp_path / "escaped.jsonl"
    latin1.write_bytes('{"prompt": "café"}\n'.encode("latin-1"))
    escaped.write_text('{"prompt": "caf\\udce9"}\n')
    cases = [
        (["--prompts", str(latin1)], f"the prompts file '{latin1}' is not UTF-8: byte 0xe9 at offset 15"),
        (["--prompts", str(escaped)], "escaped.jsonl:1: the prompt is not UTF-8: byte 0xe9 at character 3"),
        (["--prompts", str(bad)], "bad.jsonl:1: expected an object with a string 'prompt'"),
        (["--prompts", str(not_json)], "not-json.jsonl:1: not JSON: "),
        (["--prompts", str(tmp_path / "missing.jsonl")], f"cannot read the prompts file '{tmp_path / 'missing.jsonl'}'"),
        (["--draft", str(tmp_path / "no-draft")], f"draft: could not load: model '{tmp_path / 'no-draft'}' not found"),
    ]
    import torch

    if not torch.cuda.is_available():
        cases.append((["--device", "cuda:0"], "specdec bench: --device: device 'cuda:0' requested but CUDA is not available"))
    for flags, says in cases:
        out = subprocess.run([sys.executable, "-m", "specdec.cli", "bench", *flags], capture_output=True, text=True, timeout=120)
        assert out.returncode == 1 and says in out.stderr and "Traceback" not in out.stderr, (flags, out.stderr)


def test_the_benchs_stack_runs_its_models_on_the_device_and_dtype_of_its_baselines():
    """The baselines load on --device in --dtype and so do the services the bench starts:
    they inherited SPECDEC_*_DEVICE instead, so a GPU stack was timed against CPU baselines."""
    from specdec.bench import stack_config
    from specdec.cli import build_parser

    args = build_parser().parse_args(["bench", "--draft", "ngram", "--device", "cuda:1", "--dtype", "bfloat16"])
    config = stack_config(args)
    assert config.target_args == config.draft_args == ["--device", "cuda:1", "--dtype", "bfloat16"]
    defaults = build_parser().parse_args(["bench", "--draft", "ngram"])
    assert stack_config(defaults).target_args == ["--device", "cpu", "--dtype", "float32"]


def test_bench_kind_keeps_only_the_prompts_of_that_kind():
    import pytest

    from specdec.bench import load_prompts

    extractive = load_prompts(None, "extractive")
    assert len(extractive) == 4 and all(p in load_prompts(None) for p in extractive)
    with pytest.raises(SystemExit, match="no prompts of kind 'poetry'"):
        load_prompts(None, "poetry")
    code, chat = load_prompts(None, "code"), load_prompts(None, "chat")
    assert load_prompts(None, "code,chat") == [p for p in load_prompts(None) if p in code + chat] and len(code) == len(chat) == 2


def test_bench_costs_prints_each_ks_cost_and_the_alpha_it_needs(tiny_models, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "hello world, hello world"}\n')
    out = subprocess.run(
        [sys.executable, "-m", "specdec.cli", "bench", "--target", tiny_models.target, "--draft", tiny_models.draft,
         "--prompts", str(prompts), "--k", "3", "--costs", "--json", "--dtype", "bfloat16"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout)
    assert set(report["c_verify_ms"]) == {"1", "2", "3"} and report["c_p_ms"] > 0
    # measured on the models as --dtype loads them: bfloat16 takes no packed float32 kernels
    assert (report["device"], report["dtype"], report["kernels"]["target"]) == ("cpu", "bfloat16", {})
    for mode in ("sequential", "pipelined"):
        for k in ("1", "2", "3"):
            need, more = report["required_alpha"][mode]["1"][k], report["required_alpha"][mode]["1.3"][k]
            assert need is None or 0.0 <= need <= 1.0
            assert more is None or (need is not None and more >= need)  # a bigger speedup needs more α


def test_required_alpha_is_where_the_seeds_rate_reaches_the_speedup():
    from specdec.bench import required_alpha
    from specdec.speedup import expected_tokens_per_cycle

    c_p, c_q, c_verify = 100.0, 10.0, 180.0
    alpha = required_alpha(1.3, 4, c_q, c_verify, c_p)
    rate = expected_tokens_per_cycle(alpha, 4) / (4 * c_q + c_verify)
    assert abs(rate - 1.3 / c_p) < 1e-6 / c_p
    assert required_alpha(1.0, 1, 0.0, 250.0, c_p) is None  # 2 tokens per 2.5 steps: never pays
    assert required_alpha(1.0, 4, 40.0, 180.0, c_p, pipelined=True) < required_alpha(1.0, 4, 40.0, 180.0, c_p)


def test_bench_compare_k_runs_adaptive_against_each_fixed_k_in_one_stack(tiny_models, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "hello world, hello world"}\n{"prompt": "the cat sat on the mat"}\n')
    out = subprocess.run(
        [sys.executable, "-m", "specdec.cli", "bench", "--target", tiny_models.target, "--draft", tiny_models.draft,
         "--prompts", str(prompts), "--max-new-tokens", "12", "--compare-k", "1,3", "--max-k", "4", "--json"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout)
    assert set(report["tokens_per_s"]) == {"adaptive", "k1", "k3", "target_only"}
    assert all(rate > 0 for rate in report["tokens_per_s"].values())
    assert len(set(report["new_tokens"].values())) == 1 and report["new_tokens"]["adaptive"] > 0
    assert report["outputs_agree"] == [2, 2]  # greedy: the K policy never changes the output
    best = report["best_fixed_k"]
    assert best in ("k1", "k3")
    ratio = report["tokens_per_s"]["adaptive"] / report["tokens_per_s"][best]
    assert abs(report["adaptive_vs_best_fixed_k"] - ratio) < 1e-9
    assert set(report["adaptive_cycles_by_k"]) <= {"1", "2", "3", "4"}


def test_bench_compare_k_refuses_a_k_list_it_cannot_use():
    out = subprocess.run([sys.executable, "-m", "specdec.cli", "bench", "--compare-k", "2,x"],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode == 2 and "expected K values separated by commas" in out.stderr
    # its adaptive system runs up to --max-k: past the stack's limit it loaded both models and
    # started the stack before the coordinator's refusal ended it in a traceback
    out = subprocess.run([sys.executable, "-m", "specdec.cli", "bench", "--compare-k", "2", "--max-k", "20"],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode == 1 and out.stderr.strip() == (
        "specdec bench: --max-k 20 is more than its stack takes (at most 16, the services' --max-k)")


def test_a_median_of_an_even_count_is_the_mean_of_the_middle_two_whatever_the_count():
    """Nearest rank rounded half to even took the lower middle of 2 or 6 values and the upper of
    4 or 8, so the costs' medians leaned with the number of prompts."""
    from specdec.bench import percentile

    assert [percentile(list(range(1, n + 1)), 50) for n in (1, 2, 3, 4, 6, 8)] == [1, 1.5, 2, 2.5, 3.5, 4.5]
    assert percentile([5.0, 1.0, 3.0], 50) == 3.0 and percentile([], 50) == 0.0
    assert percentile(list(range(1, 101)), 99) == pytest.approx(99.01) and percentile([1, 9], 100) == 9
