"""`specdec bench` runs the three systems on the same prompts and reports the seed's figures.
(A smoke test of the command with tiny models; the ratios themselves are not asserted.)"""

import json
import subprocess
import sys

REQUIRED = {
    "target", "draft", "k", "prompts", "new_tokens", "runs", "alpha", "mean_accepted_length", "c_q_ms", "c_p_ms",
    "c_verify_ms", "analytic_tokens_per_s", "efficiency", "speedup_vs_target_only", "speedup_vs_hf_assisted",
    "bytes_per_cycle", "dense_bytes_per_cycle", "cycle_ms",
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
    report = json.loads(out.stdout)
    assert REQUIRED <= set(report)
    assert set(report["runs"]) == {"target_only", "hf_assisted", "specdec"}
    assert report["runs"]["specdec"]["tokens_per_s"] > 0 and report["runs"]["specdec"]["p99_token_ms"] > 0
    assert report["greedy_outputs_agree"] == [2, 2]
    cycles = report["cycle_ms"]
    assert cycles["sequential"]["cycles"] + cycles["pipelined"]["cycles"] >= 1 and cycles["sequential"]["median"] > 0
    assert 0.0 <= report["alpha"] <= 1.0 and report["dense_bytes_per_cycle"] == 3 * 39 * 4
    expected = (1 - report["alpha"] ** 4) / (1 - report["alpha"])
    sequential = expected / (3 * report["c_q_ms"] + report["c_verify_ms"]) * 1000
    assert abs(report["analytic_tokens_per_s"]["sequential"] - sequential) < 1e-6 * sequential


def test_bench_refuses_a_malformed_prompt_file(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "no prompt key"}\n')
    out = subprocess.run([sys.executable, "-m", "specdec.cli", "bench", "--prompts", str(bad)],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode != 0 and "expected an object with a string 'prompt'" in out.stderr


def test_bench_kind_keeps_only_the_prompts_of_that_kind():
    import pytest

    from specdec.bench import load_prompts

    extractive = load_prompts(None, "extractive")
    assert len(extractive) == 4 and all(p in load_prompts(None) for p in extractive)
    with pytest.raises(SystemExit, match="no prompts of kind 'poetry'"):
        load_prompts(None, "poetry")


def test_bench_costs_prints_each_ks_cost_and_the_alpha_it_needs(tiny_models, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "hello world, hello world"}\n')
    out = subprocess.run(
        [sys.executable, "-m", "specdec.cli", "bench", "--target", tiny_models.target, "--draft", tiny_models.draft,
         "--prompts", str(prompts), "--k", "3", "--costs", "--json"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout)
    assert set(report["c_verify_ms"]) == {"1", "2", "3"} and report["c_p_ms"] > 0
    for mode in ("sequential", "pipelined"):
        for k in ("1", "2", "3"):
            need, more = report["required_alpha"][mode]["1"][k], report["required_alpha"][mode]["1.3"][k]
            assert need is None or 0.0 <= need <= 1.0
            assert more is None or (need is not None and more >= need)  # a bigger speedup needs more α


def test_required_alpha_is_where_the_seeds_rate_reaches_the_speedup():
    from specdec.bench import required_alpha
    from specdec.sampling import expected_tokens_per_cycle

    c_p, c_q, c_verify = 100.0, 10.0, 180.0
    alpha = required_alpha(1.3, 4, c_q, c_verify, c_p)
    rate = expected_tokens_per_cycle(alpha, 4) / (4 * c_q + c_verify)
    assert abs(rate - 1.3 / c_p) < 1e-6 / c_p
    assert required_alpha(1.0, 1, 0.0, 250.0, c_p) is None  # 2 tokens per 2.5 steps: never pays
    assert required_alpha(1.0, 4, 40.0, 180.0, c_p, pipelined=True) < required_alpha(1.0, 4, 40.0, 180.0, c_p)
