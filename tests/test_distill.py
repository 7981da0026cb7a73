"""`specdec distill`: a tiny target distilled for a few seconds, written, resumed and served.

One distillation run (module fixture) is shared by the checks; the long SmolLM2 run is a
command (README "Make a draft"), never a test.
"""

import argparse
import dataclasses
import json
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from specdec import distill as distill_module
from specdec.distill import (
    CHECKPOINT_NAME,
    DATA_DIR,
    DEFAULT_PROMPTS,
    WEIGHTS_NAME,
    DistillConfig,
    DistillError,
    add_distill_parser,
    kl_top_k,
    load_prompts,
    materialize_draft,
    run_distill,
)
from specdec import catalog
from specdec.catalog import DRAFT_CARD_NAME, draft_default_k, is_cached
from specdec.speedup import expected_tokens_per_cycle
from specdec.models import build_tiny_model, build_tiny_tokenizer, load_model, save_model
from specdec.vocab import VocabMismatchError

from conftest import TINY_INIT_RANGE, start_stack

ROOT = Path(__file__).resolve().parent.parent

TINY_PROMPTS = [
    "hello there", "tell me a story", "what is the sea", "write a poem", "how are you", "list three fruits",
    "explain the sun", "say something nice", "count to ten", "why is the sky blue", "give me advice",
    "name a color", "sing a song", "where is the moon", "describe a cat", "what time is it",
]  # fmt: skip
DISTILL_FLAGS = [
    "--layers", "1", "--hidden", "32", "--heads", "2", "--data-tokens", "2500", "--max-new-tokens", "40",
    "--eval-every", "1", "--no-progress", "--draft-vocab", "32",
]  # fmt: skip


def parse(argv):
    parser = argparse.ArgumentParser()
    add_distill_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["distill", *argv])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("distill")
    tokenizer = build_tiny_tokenizer()
    model = build_tiny_model(tokenizer, hidden_size=64, num_layers=2, seed=3, initializer_range=TINY_INIT_RANGE)
    target = save_model(model, tokenizer, root / "target")
    prompts = root / "prompts.jsonl"
    rows = [{"prompt": p, "split": "eval" if i % 4 == 3 else "train"} for i, p in enumerate(TINY_PROMPTS)]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root, str(target), str(prompts)


@pytest.fixture(scope="module")
def distilled(tiny):
    """One short run, then a resumed one; returns (out dir, first card, second card, data files before)."""
    root, target, prompts = tiny
    out = root / "draft"
    argv = ["--target", target, "--out", str(out), "--prompts", prompts, "--minutes", "0.1", *DISTILL_FLAGS]
    assert run_distill(parse(argv)) == 0
    first = json.loads((out / DRAFT_CARD_NAME).read_text())
    data_before = {p.name: p.stat().st_mtime_ns for p in (out / DATA_DIR).glob("*.pt")}
    resumed = [*argv[:-len(DISTILL_FLAGS)], *DISTILL_FLAGS, "--minutes", "0.05", "--weight-decay", "0.05", "--resume"]
    assert run_distill(parse(resumed)) == 0
    second = json.loads((out / DRAFT_CARD_NAME).read_text())
    return out, first, second, data_before


def test_alpha_rises_above_its_starting_value(distilled):
    _, first, second, _ = distilled
    for card in (first, second):
        assert card["figures"]["alpha"] > card["training"]["alpha_start"] + 0.05
    # the tiny vocabulary (39 tokens) fits in k = 64, so the stored p is the whole p
    assert first["training"]["top_k"] == 39 and first["training"]["top_k_mass"] == pytest.approx(1.0, abs=1e-3)


def test_card_records_fingerprint_figures_and_command(distilled, tiny):
    out, first, second, _ = distilled
    figures = first["figures"]
    for key in ("alpha", "greedy_agreement", "c_q_ms", "c_p_ms", "cost_ratio", "best_k", "expected_speedup"):
        assert key in figures
    assert 0 <= figures["alpha"] <= 1 and 0 <= figures["greedy_agreement"] <= 1
    assert figures["c_q_ms"] > 0 and figures["c_p_ms"] > 0 and figures["best_k"] >= 1
    # serving_k: the most tokens per ms with the verify passes measured, which the draft service reports
    c_verify = {int(k): ms for k, ms in figures["c_verify_ms"].items()}
    assert sorted(c_verify) == list(range(1, 9)) and all(ms > 0 for ms in c_verify.values())
    alpha = figures.get("with_lookup", figures)["alpha"]
    rates = {k: expected_tokens_per_cycle(alpha, k) / (k * figures["c_q_ms"] + ms) for k, ms in c_verify.items()}
    assert rates[figures["serving_k"]] >= 0.97 * max(rates.values())  # the best, up to the card's rounding of costs
    # the directory's card is the resumed run's, which measured its own costs
    assert draft_default_k(str(out)) == second["figures"]["serving_k"] >= 1
    # the same figures on the target's own greedy continuations of the held-out prompts
    greedy_path = figures["greedy_path"]
    assert 0 <= greedy_path["alpha"] <= 1 and 0 <= greedy_path["greedy_agreement"] <= 1 and greedy_path["positions"] > 0
    assert first["command"].startswith("specdec distill --target ")
    assert f"--out {out}" in first["command"] and "--hidden 32" in first["command"]
    assert first["target_vocab_fingerprint"] == load_model(tiny[1]).vocab_fingerprint


def test_written_directory_loads_with_the_targets_vocabulary(distilled, tiny):
    out, first, _, _ = distilled
    draft = load_model(str(out))
    target = load_model(tiny[1])
    assert draft.vocab_fingerprint == target.vocab_fingerprint == first["draft_vocab_fingerprint"]
    assert draft.vocab_size == target.vocab_size
    assert draft.model.config.num_hidden_layers == 1 and draft.model.config.hidden_size == 32
    assert (out / WEIGHTS_NAME).stat().st_size < 200_000  # no vocabulary-sized matrix inside


def test_the_greedy_held_out_set_is_the_targets_own_greedy_continuation(distilled, tiny):
    out, _, _, _ = distilled
    target = load_model(tiny[1])
    records = torch.load(out / DATA_DIR / "eval-greedy-00000.pt", weights_only=True)
    _, held_out = load_prompts(tiny[2])
    assert len(records) == len(held_out)
    for record in records:
        prompt = record["ids"][: record["n_prompt"]]
        with torch.no_grad():
            greedy = target.model.generate(prompt.unsqueeze(0), do_sample=False, max_new_tokens=len(record["ids"]) - len(prompt),
                                           pad_token_id=target.tokenizer.pad_token_id)[0]  # fmt: skip
        assert record["ids"].tolist() == greedy.tolist()


def test_evaluate_prints_a_drafts_figures_on_the_runs_held_out_sets(distilled, tiny, capsys, tmp_path):
    out, _, second, _ = distilled
    capsys.readouterr()
    assert run_distill(parse(["--target", tiny[1], "--out", str(out), "--evaluate", str(out)])) == 0
    figures = json.loads(capsys.readouterr().out)
    # the draft the last run wrote, on the same sets: the card's figures again
    assert figures["alpha"] == second["figures"]["alpha"]
    assert figures["greedy_path"] == second["figures"]["greedy_path"]
    assert run_distill(parse(["--target", tiny[1], "--out", str(tmp_path / "empty"), "--evaluate", str(out)])) == 1
    assert "run `specdec distill`" in capsys.readouterr().err


def test_resume_continues_training_without_regenerating_data(distilled):
    out, first, second, data_before = distilled
    assert second["training"]["steps"] > first["training"]["steps"]
    assert second["training"]["train_seconds"] > first["training"]["train_seconds"]
    assert {p.name: p.stat().st_mtime_ns for p in (out / DATA_DIR).glob("*.pt")} == data_before
    assert (out / CHECKPOINT_NAME).is_file()


def test_a_resumed_run_trains_with_its_own_weight_decay_not_the_checkpoints(distilled):
    out, first, second, _ = distilled
    assert "--dropout 0.1 --weight-decay 0.1" in first["command"]
    assert "--weight-decay 0.05" in second["command"]
    groups = torch.load(out / CHECKPOINT_NAME, weights_only=False)["optimizer"]["param_groups"]
    assert [g["weight_decay"] for g in groups] == [0.05] * len(groups)


def test_dropout_acts_in_training_only_and_leaves_the_written_config_at_zero(distilled):
    config = distill_module.draft_llama_config(argparse.Namespace(), hidden=32, layers=2, heads=2, vocab_size=40)
    torch.manual_seed(0)
    draft = distill_module.DraftModel(torch.randn(40, 16), config, torch.arange(40), dropout=0.5)
    assert [layer.self_attn.attention_dropout for layer in draft.body.layers] == [0.5, 0.5]
    ids = torch.randint(0, 40, (2, 7))  # [B, T]
    draft.train()
    first, second = draft.hidden_states(ids), draft.hidden_states(ids)  # [B, T, H]
    assert not torch.equal(first, second)  # each call drops other entries
    assert (first == 0).float().mean() > 0.3  # about half of the final state's entries dropped
    draft.eval()
    assert torch.equal(draft.hidden_states(ids), draft.hidden_states(ids))
    assert config.attention_dropout == 0.0
    out, _, _, _ = distilled
    assert json.loads((out / "config.json").read_text())["attention_dropout"] == 0.0


def _record(prompt: list[int], generated: int, seed: int) -> dict:
    """A training record of `prompt` plus `generated` tokens (p's top-k filled with noise)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.cat([torch.tensor(prompt), torch.randint(0, 40, (generated,), generator=g)])
    return {"ids": ids, "n_prompt": len(prompt), "topk_ids": torch.zeros(generated, 4, dtype=torch.int32),
            "topk_logp": torch.full((generated, 4), -2.0, dtype=torch.float16)}  # fmt: skip


def test_the_calibration_split_keeps_every_sequence_of_a_prompt_on_one_side():
    prompts = [[i, i + 1, 7] for i in range(20)]
    records = [_record(prompts[i % 20], 5, seed) for seed, i in enumerate(range(60))]  # 3 sequences per prompt
    train, calibration = distill_module.split_calibration(records, 0.1)
    key = distill_module.prompt_key
    assert len({key(r) for r in calibration}) == 2 and len(calibration) == 6
    assert not {key(r) for r in calibration} & {key(r) for r in train}
    assert len(train) + len(calibration) == len(records)
    # it depends on the data only: the same split from the records in another order
    again_train, again_calibration = distill_module.split_calibration(records[::-1], 0.1)
    assert {key(r) for r in again_calibration} == {key(r) for r in calibration}
    # never every prompt; share 0: no calibration set
    assert len({key(r) for r in distill_module.split_calibration(records, 0.99)[0]}) == 1
    assert distill_module.split_calibration(records, 0.0) == (records, [])


def test_building_a_draft_makes_transformers_warn_of_no_token_id_outside_the_vocabulary():
    """Its body's config (vocabulary of 1: the input comes as embeddings) kept the target's BOS and
    EOS ids, and every `specdec distill` printed transformers' "bos_token_id must be `None` or an
    integer within the vocabulary (between 0 and 0), got 1"."""
    import logging

    from transformers.utils import logging as hf_logging

    config = distill_module.draft_llama_config(argparse.Namespace(bos_token_id=1, eos_token_id=2), hidden=32,
                                               layers=1, heads=2, vocab_size=40)  # fmt: skip
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    library = logging.getLogger("transformers")
    library.addHandler(handler)
    hf_logging.get_logger("transformers.configuration_utils").warning_once.cache_clear()  # once per process
    try:
        distill_module.DraftModel(torch.randn(40, 16), config, torch.arange(40))
    finally:
        library.removeHandler(handler)
    assert not [r.getMessage() for r in records if "within the vocabulary" in r.getMessage()]
    assert (config.bos_token_id, config.eos_token_id) == (1, 2)  # the written draft's config keeps them


def test_choose_temperature_finds_the_tau_at_which_q_is_p_and_folding_it_makes_q_equal_p():
    config = distill_module.draft_llama_config(argparse.Namespace(), hidden=32, layers=1, heads=2, vocab_size=40)
    torch.manual_seed(0)
    draft = distill_module.DraftModel(torch.randn(40, 16), config, torch.arange(40))
    draft.init_from_pca(torch.Generator().manual_seed(0))
    draft.eval()
    records = []
    for seed in range(6):  # p = the draft's own q sharpened by τ = 0.7, over the whole vocabulary (k = V)
        record = _record([1, 2, 3], 12, seed)
        with torch.no_grad():
            logits = draft.logits(draft.hidden_states(record["ids"][None]))[0, 2:-1]  # [n_gen, V]
        record["topk_logp"], record["topk_ids"] = torch.log_softmax(logits / 0.7, -1).topk(40, -1)
        records.append(record)
    temperature, alphas = distill_module.choose_temperature(draft, records, pad_id=0)
    assert temperature == 0.7
    assert alphas[0.7] == pytest.approx(1.0, abs=1e-4) and alphas[1.0] < 0.99 and alphas[0.5] < 0.99
    distill_module.fold_temperature(draft, temperature)
    assert distill_module.quick_eval(draft, records, pad_id=0)["alpha_topk"] == pytest.approx(1.0, abs=1e-4)


def test_choose_lookup_weights_weights_the_match_lengths_whose_lookup_token_p_favours_and_no_other():
    """p puts 0.9 on the lookup's token where the match is 2 tokens or longer, and 0 on it where
    the match is 1 token: the calibration weights lengths 2+ heavily and length 1 not at all."""
    config = distill_module.draft_llama_config(argparse.Namespace(), hidden=32, layers=1, heads=2, vocab_size=40)
    torch.manual_seed(0)
    draft = distill_module.DraftModel(torch.randn(40, 16), config, torch.arange(40))
    draft.init_from_pca(torch.Generator().manual_seed(0))
    records = []
    for seed in range(8):
        g = torch.Generator().manual_seed(seed)
        motif = torch.randint(4, 40, (5,), generator=g).tolist()
        record = _record([1, 2, 3], 30, seed)
        record["ids"] = torch.tensor([1, 2, 3] + (motif * 7)[:30])  # repeats itself: matches of every length
        looked_up, lengths = distill_module.lookup_matches([record], 4)
        p = torch.full((30, 40), 1.0)
        for i, (token, n) in enumerate(zip(looked_up.tolist(), lengths.tolist())):
            if n >= 2:
                p[i] = 0.1 / 39
                p[i, token] = 0.9
            elif n == 1:
                p[i, token] = 0.0
        p = p / p.sum(-1, keepdim=True)
        record["topk_logp"], record["topk_ids"] = p.log().topk(40, -1)  # k = V: the whole p
        records.append(record)
    weights, report = distill_module.choose_lookup_weights(draft, records, pad_id=0, max_ngram=4)
    assert set(weights) == {1, 2, 3, 4} and weights[1] == 0.0
    assert all(weights[n] >= 0.8 for n in (2, 3, 4)), weights
    for n in ("2", "3", "4"):
        assert report[n]["positions"] > 0 and report[n]["alpha_topk_with"] > report[n]["alpha_topk_without"] + 0.5
    assert report["1"]["positions"] > 0 and report["1"]["alpha_topk_with"] == report["1"]["alpha_topk_without"]


def test_lookup_weights_travel_from_the_weights_file_into_the_directory_the_service_and_evaluate_read(
        distilled, tiny, tmp_path, capsys):  # fmt: skip
    from safetensors import safe_open
    from safetensors.torch import save_file

    from specdec.ngram import LOOKUP_FILE, resolve_lookup_weights

    out, _, second, _ = distilled
    assert "lookup_by_match_length" in second["calibration"] and "--lookup-ngram 4" in second["command"]
    with safe_open(str(out / WEIGHTS_NAME), framework="pt") as handle:
        meta, tensors = handle.metadata(), {key: handle.get_tensor(key) for key in handle.keys()}
    save_file(tensors, str(tmp_path / "w.safetensors"), metadata={**meta, "lookup_weights": "1:0,2:0.5,3:0.9"})
    built = materialize_draft(tiny[1], tmp_path / "w.safetensors", tmp_path / "with-lookup")
    assert resolve_lookup_weights("auto", str(built)) == {1: 0.0, 2: 0.5, 3: 0.9}
    meta.pop("lookup_weights", None)
    save_file(tensors, str(tmp_path / "plain.safetensors"), metadata=meta)
    assert not (materialize_draft(tiny[1], tmp_path / "plain.safetensors", tmp_path / "plain") / LOOKUP_FILE).exists()
    # Rebuilt without lookup weights over the directory that has them (a resumed run whose
    # calibration chose none): their file goes; it used to stay and be served under a card saying "off".
    assert resolve_lookup_weights("auto", str(materialize_draft(tiny[1], tmp_path / "plain.safetensors", built))) == {}
    built = materialize_draft(tiny[1], tmp_path / "w.safetensors", tmp_path / "with-lookup")
    capsys.readouterr()
    assert run_distill(parse(["--target", tiny[1], "--out", str(out), "--evaluate", str(built)])) == 0
    figures = json.loads(capsys.readouterr().out)
    mixed = figures["with_lookup"]
    assert mixed["weights"] == "1:0,2:0.5,3:0.9" and 0 <= mixed["alpha"] <= 1 and 0 <= mixed["greedy_agreement"] <= 1
    assert 0 <= mixed["greedy_path"]["alpha"] <= 1 and mixed["best_k"] >= 1
    assert figures["alpha"] == second["figures"]["alpha"], "the model's own figures are unchanged"


def test_the_calibration_prompts_pick_a_temperature_that_is_folded_into_the_written_head(distilled):
    out, first, second, _ = distilled
    for card in (first, second):
        calibration, training = card["calibration"], card["training"]
        table = {float(t): a for t, a in calibration["alpha_topk_by_temperature"].items()}
        assert set(table) == set(distill_module.CALIBRATION_TEMPERATURES)
        assert table[calibration["temperature"]] == max(table.values())
        assert calibration["prompts"] == 1 and calibration["sequences"] > 0  # ⌈0.04 x 12 training prompts⌉
        assert calibration["picked_checkpoint_on"] == "calibration"
        assert training["train_sequences_used"] + calibration["sequences"] == training["train_sequences"]
        assert all("calibration_alpha_topk" in h for h in training["history"])
        assert "--calibration-share 0.04" in card["command"]
    from safetensors.torch import load_file

    best = torch.load(out / CHECKPOINT_NAME, weights_only=False)["best"]["state"]["head"]
    written = load_file(out / WEIGHTS_NAME)["head"].float()
    assert torch.allclose(written, best / second["calibration"]["temperature"], rtol=2e-3, atol=1e-4)


@pytest.mark.parametrize(("flag", "value", "rule"), [
    ("--lookup-ngram", "-1", "an integer at least 0 (0 = no lookup mixing)"),
    ("--dropout", "1", "a number at least 0 and below 1"),
    ("--dropout", "-0.1", "a number at least 0 and below 1"),
    ("--weight-decay", "-1", "a number at least 0"),
    ("--calibration-share", "1", "a number at least 0 and below 1 (0 = none)"),
    ("--minutes", "-1", "a number at least 0 and at most 1e+07 (0 only with --resume"),
    ("--minutes", "nan", "a number at least 0"),
    ("--minutes", "1e307", "a number at least 0 and at most 1e+07"),  # it made the deadline inf: OverflowError
    ("--layers", "0", "an integer at least 1"),
    ("--layers", "1.5", "an integer at least 1"),
    ("--batch-size", "0", "an integer at least 1"),
    ("--top-k", "0", "an integer at least 1"),
    ("--data-share", "0", "a number above 0 and at most 1"),
    ("--lr", "0", "a number above 0"),
    ("--eval-every", "0", "a number above 0"),
    ("--draft-vocab", "-1", "an integer at least 0 (0 = the whole vocabulary)"),
    ("--threads", "-2", "an integer at least 0 (0 = one per core)"),
    ("--seed", "-1", "an integer at least 0"),
])  # fmt: skip
def test_a_numeric_flag_outside_its_range_is_refused_by_the_command_line_with_the_range(tmp_path, capsys, flag, value, rule):
    with pytest.raises(SystemExit) as exited:
        parse(["--target", "t", "--out", str(tmp_path / "run"), flag, value])
    assert exited.value.code == 2
    assert f"argument {flag}: expected {rule}" in capsys.readouterr().err


def test_each_ranged_setting_is_a_config_field_whose_flag_takes_that_same_range():
    distill_parser = add_distill_parser(argparse.ArgumentParser().add_subparsers(dest="command"))
    types = {option: action.type for action in distill_parser._actions for option in action.option_strings}
    fields = {field.name for field in dataclasses.fields(DistillConfig)}
    for field, allowed in distill_module.RANGES.items():
        assert field in fields and types[distill_module.flag_of(field)] is allowed, field


@pytest.mark.parametrize(("changes", "message"), [
    ({"layers": 0}, "--layers must be an integer at least 1, got 0"),
    ({"dropout": 1.0}, "--dropout must be a number at least 0 and below 1, got 1.0"),
    ({"eval_every_s": 0.0}, "--eval-every must be a number above 0 and at most 1e+09, got 0.0"),
    ({"minutes": float("nan")}, "--minutes must be a number at least 0"),
    ({"minutes": 1e307}, "--minutes must be a number at least 0 and at most 1e+07"),
    ({"seed": -1}, "--seed must be an integer at least 0"),
    ({"hidden": 32.0}, "--hidden must be an integer at least 1, got 32.0"),
])  # fmt: skip
def test_a_config_built_in_code_is_checked_against_the_same_ranges(tmp_path, changes, message):
    config = dataclasses.replace(DistillConfig(target="t", out=str(tmp_path / "run")), **changes)
    with pytest.raises(DistillError, match=re.escape(message)):
        distill_module.check_config(config)


@pytest.mark.parametrize(("flags", "message"), [
    (["--minutes", "0"], "--minutes 0 needs --resume"),
    (["--hidden", "30", "--heads", "4"], "--hidden (30) must be --heads (4) times an even head width"),
    (["--hidden", "30", "--heads", "2"], "--hidden (30) must be --heads (2) times an even head width"),
    (["--target", "no-such-model"], "model 'no-such-model' not found"),
    (["--resume"], "holds no distillation run to resume; drop --resume"),
    (["--prompts", "/no/such/prompts.jsonl"], "cannot read the prompts file '/no/such/prompts.jsonl'"),
])  # fmt: skip
def test_a_flag_no_run_can_use_is_refused_with_its_name_before_anything_is_written(tiny, tmp_path, capsys, flags, message):
    out = tmp_path / "run"
    argv = ["--target", tiny[1], "--out", str(out), "--prompts", tiny[2], *DISTILL_FLAGS, *flags]
    assert run_distill(parse(argv)) == 1
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_an_out_that_cannot_be_made_ends_the_run_in_one_line(tiny, tmp_path, capsys):
    """--out under a file (or where no directory may be made) ended in a NotADirectoryError
    or FileNotFoundError traceback."""
    (tmp_path / "a-file").write_text("")
    argv = ["--target", tiny[1], "--out", str(tmp_path / "a-file" / "run"), "--prompts", tiny[2], "--minutes", "0.01",
            *DISTILL_FLAGS]  # fmt: skip
    assert run_distill(parse(argv)) == 1
    assert f"cannot make --out {tmp_path / 'a-file' / 'run'}: Not a directory" in capsys.readouterr().err


def test_a_folder_holding_something_else_is_not_written_over(tiny, tmp_path, capsys):
    out = tmp_path / "my-model"
    out.mkdir()
    (out / "config.json").write_text("{}")
    argv = ["--target", tiny[1], "--out", str(out), "--prompts", tiny[2], "--minutes", "0.01", *DISTILL_FLAGS]
    assert run_distill(parse(argv)) == 1
    assert "is not empty and holds no distillation run" in capsys.readouterr().err
    assert [p.name for p in out.iterdir()] == ["config.json"] and (out / "config.json").read_text() == "{}"


def interrupt_distill(argv: list[str], until) -> str:
    """Run `specdec distill ARGV` in a process, send it Ctrl-C once `until()` holds; its stderr."""
    process = subprocess.Popen(
        [sys.executable, "-m", "specdec.cli", "distill", *argv], stderr=subprocess.PIPE, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # a background job would ignore ^C
    )  # fmt: skip
    deadline = time.monotonic() + 60
    while not until() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=60)
    assert process.returncode == 130, err
    assert "interrupted" in err and "--resume to continue" in err and "Traceback" not in err
    return err


def test_a_run_interrupted_while_sampling_keeps_its_shards_and_resume_finishes_it(tiny, tmp_path):
    out = tmp_path / "run"
    argv = ["--target", tiny[1], "--out", str(out), "--prompts", tiny[2], *DISTILL_FLAGS, "--data-tokens", "100000"]
    interrupt_distill([*argv, "--minutes", "2"], until=lambda: list((out / DATA_DIR).glob("train-*.pt")))
    kept = sorted(p.name for p in (out / DATA_DIR).glob("train-*.pt"))
    assert kept and not (out / DRAFT_CARD_NAME).exists()
    assert run_distill(parse([*argv, "--minutes", "0.05", "--resume"])) == 0
    assert set(kept) <= {p.name for p in (out / DATA_DIR).glob("train-*.pt")}
    assert json.loads((out / DRAFT_CARD_NAME).read_text())["training"]["steps"] > 0


def test_a_run_interrupted_while_training_writes_a_checkpoint_of_where_it_stopped_and_resume_goes_on(tiny, tmp_path,
                                                                                                      monkeypatch):
    out = tmp_path / "run"
    argv = ["--target", tiny[1], "--out", str(out), "--prompts", tiny[2], *DISTILL_FLAGS]
    training_since = []

    def training_a_while() -> bool:  # the data phase ends with stats.json; then train for 3 s
        if not training_since and (out / DATA_DIR / "stats.json").exists():
            training_since.append(time.monotonic())
        return bool(training_since) and time.monotonic() - training_since[0] > 3

    interrupt_distill([*argv, "--minutes", "2"], until=training_a_while)  # 2-minute checkpoints: none yet
    checkpoint = torch.load(out / CHECKPOINT_NAME, weights_only=False)
    stopped_at, schedule = checkpoint["step"], checkpoint["schedule"]
    assert stopped_at > 0 and not (out / DRAFT_CARD_NAME).exists()
    assert schedule["start_step"] == 0 and schedule["budget_seconds"] > checkpoint["train_seconds"] > 0
    # The resumed run goes on with the interrupted run's learning-rate schedule where it stopped:
    # no second warmup from step 0, the same budget (it used to start a schedule of its own).
    rates = []
    real_lr_at = distill_module._lr_at
    monkeypatch.setattr(distill_module, "_lr_at", lambda step, fraction, peak: rates.append((step, fraction))
                        or real_lr_at(step, fraction, peak))  # fmt: skip
    assert run_distill(parse([*argv, "--minutes", "0.05", "--resume"])) == 0
    assert json.loads((out / DRAFT_CARD_NAME).read_text())["training"]["steps"] > stopped_at
    assert rates[0][0] == stopped_at and rates[0][1] >= checkpoint["train_seconds"] / schedule["budget_seconds"]
    assert torch.load(out / CHECKPOINT_NAME, weights_only=False)["schedule"] == {**schedule, "ended": True}


def test_a_schedule_whose_run_reached_its_deadline_is_not_continued_however_little_it_trained():
    """A training that began at its deadline (the data phase took all the minutes) had a 1 ms
    budget and trained 40 µs of it: its schedule looked unfinished, and every later --resume went
    on with it, at the floor rate. A schedule interrupted before its end is still continued."""
    from specdec.distill import schedule_of

    tiny_budget = {"start_step": 0, "start_seconds": 0.0, "budget_seconds": 0.001}
    ended = {"step": 0, "train_seconds": 0.00004, "schedule": {**tiny_budget, "ended": True}}
    assert schedule_of(ended, 600.0) == {"start_step": 0, "start_seconds": 0.00004, "budget_seconds": 600.0}
    interrupted = {"step": 40, "train_seconds": 30.0, "schedule": {"start_step": 0, "start_seconds": 0.0, "budget_seconds": 60.0}}
    assert schedule_of(interrupted, 600.0) == interrupted["schedule"]


def test_evaluating_a_draft_that_does_not_exist_names_it(distilled, tiny, capsys):
    out, _, _, _ = distilled
    argv = ["--target", tiny[1], "--out", str(out), "--prompts", tiny[2], *DISTILL_FLAGS, "--evaluate", "no-such-draft"]
    assert run_distill(parse(argv)) == 1
    assert "model 'no-such-draft' not found" in capsys.readouterr().err


def test_a_second_run_into_the_same_dir_needs_resume(distilled, tiny, capsys):
    out, _, _, _ = distilled
    argv = ["--target", tiny[1], "--out", str(out), "--prompts", tiny[2], "--minutes", "0.01", *DISTILL_FLAGS]
    assert run_distill(parse(argv)) == 1
    assert "--resume" in capsys.readouterr().err


def test_resuming_with_a_target_of_other_weights_is_refused_and_leaves_the_run_as_it_was(distilled, tiny, tmp_path, capsys):
    """The run's data was sampled from one target; --resume naming a fine-tune of it (the same
    vocabulary, one weight moved) would train on a mix of two distributions: refused, naming
    both, and nothing in the folder is written."""
    out, _, _, _ = distilled
    copied = shutil.copytree(out, tmp_path / "run")
    before = {p: p.read_bytes() for p in copied.rglob("*") if p.is_file()}
    tokenizer = build_tiny_tokenizer()
    model = build_tiny_model(tokenizer, hidden_size=64, num_layers=2, seed=3, initializer_range=TINY_INIT_RANGE)
    with torch.no_grad():
        model.model.layers[1].self_attn.q_proj.weight[0, 0] += 1e-3
    tuned = save_model(model, tokenizer, tmp_path / "tuned")
    argv = ["--target", str(tuned), "--out", str(copied), "--prompts", tiny[2], "--minutes", "0.01", "--resume",
            *DISTILL_FLAGS]  # fmt: skip
    assert run_distill(parse(argv)) == 1
    err = capsys.readouterr().err
    assert "sampled from another target" in err and f"{tiny[1]} (vocabulary" in err and f"{tuned} (vocabulary" in err
    assert {p: p.read_bytes() for p in copied.rglob("*") if p.is_file()} == before


def test_resuming_with_other_prompts_is_refused_and_leaves_the_run_as_it_was(distilled, tiny, tmp_path, capsys):
    """--resume trains and evaluates on the data already sampled; given other prompts it went on
    with the old data while the card named the new prompts (and their held-out split): refused,
    and nothing in the folder is written. The same prompts resume as before."""
    out, _, _, _ = distilled
    copied = shutil.copytree(out, tmp_path / "run")
    before = {p: p.read_bytes() for p in copied.rglob("*") if p.is_file()}
    other = tmp_path / "other.jsonl"
    other.write_text("".join(Path(tiny[2]).read_text().splitlines(keepends=True)[1:]))  # one prompt fewer
    argv = ["--target", tiny[1], "--out", str(copied), "--prompts", str(other), "--minutes", "0.01", "--resume",
            *DISTILL_FLAGS]  # fmt: skip
    assert run_distill(parse(argv)) == 1
    assert "holds data sampled from other prompts than --prompts and --eval-prompts give now" in capsys.readouterr().err
    assert {p: p.read_bytes() for p in copied.rglob("*") if p.is_file()} == before


def files_of(folder: Path) -> dict:
    """Every file under `folder` and its bytes: what a refused run must leave as it was."""
    return {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def test_resuming_with_other_data_options_is_refused_naming_the_flag_and_leaves_the_run_as_it_was(distilled, tiny,
                                                                                                 tmp_path, capsys):
    """--top-k, --max-new-tokens, --temperatures and --seed fix the data a run samples. Resumed with
    another --top-k, a run interrupted while sampling crashed stacking shards of two k (and its
    stats.json then named the new k, so every later --resume crashed too); a finished one went on
    with the old data while the card's command named the new values. distill-data/target.json
    records them, and --resume with another is refused before anything is written. A run recorded
    before they were resumes with any."""
    out, first, _, _ = distilled
    copied = shutil.copytree(out, tmp_path / "run")
    record = json.loads((copied / DATA_DIR / "target.json").read_text())
    assert record["sampled_with"] == {"top_k": 256, "max_new_tokens": 40, "temperatures": [1, 1, 1, 0], "seed": 0}
    assert "--top-k 256" in first["command"] and "--max-new-tokens 40" in first["command"]
    before = files_of(copied)
    argv = ["--target", tiny[1], "--out", str(copied), "--prompts", tiny[2], "--minutes", "0.01", "--resume", *DISTILL_FLAGS]
    for flag, value, recorded in [("--top-k", "8", "256"), ("--max-new-tokens", "20", "40"),
                                  ("--temperatures", "1,0.5", "1,1,1,0"), ("--seed", "3", "0")]:  # fmt: skip
        assert run_distill(parse([*argv, flag, value])) == 1
        assert (f"holds data sampled with {flag} {recorded}, not {value}: resume with {flag} {recorded}"
                in capsys.readouterr().err)  # fmt: skip
    assert files_of(copied) == before
    del record["sampled_with"]  # as a run begun before the data options were recorded
    (copied / DATA_DIR / "target.json").write_text(json.dumps(record))
    assert run_distill(parse([*argv, "--seed", "3"])) == 0


@pytest.mark.parametrize("row", [
    {"prompt": 5}, {"prompt": None}, {"messages": [{"content": "hi"}]}, {"messages": [{"role": "user"}]},
    {"messages": ["hi"]}, {"messages": []}, {"messages": "hi"}, {"messages": [{"role": "user", "content": 5}]},
])  # fmt: skip
def test_a_malformed_prompt_row_is_refused_naming_its_file_and_line_before_anything_is_written(tiny, tmp_path, capsys, row):
    """Such a row passed load_prompts and crashed the run in a traceback after target.json was
    written, and then neither a plain run nor --resume worked on that --out."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(Path(tiny[2]).read_text() + json.dumps(row) + "\n")
    with pytest.raises(DistillError, match=f"^{re.escape(str(prompts))}:17: "):
        load_prompts(prompts)
    out = tmp_path / "run"
    assert run_distill(parse(["--target", tiny[1], "--out", str(out), "--prompts", str(prompts), "--minutes", "0.01",
                              *DISTILL_FLAGS])) == 1  # fmt: skip
    err = capsys.readouterr().err
    assert f"{prompts}:17: " in err and len(err.strip().splitlines()) == 1
    assert not out.exists()


def test_a_prompt_the_tokenizer_refuses_ends_the_run_in_one_line_before_anything_is_written(tiny, tmp_path, capsys):
    """A role holding a special token's text passes load_prompts but not the chat template
    (specdec.vocab.chat_ids): it ended the run in a ValueError traceback after target.json was
    written, and --out then held a run no command could go on with."""
    prompts = tmp_path / "prompts.jsonl"
    row = {"messages": [{"role": "<s>", "content": "hi"}]}
    prompts.write_text(Path(tiny[2]).read_text() + json.dumps(row) + "\n")
    out = tmp_path / "run"
    argv = ["--target", tiny[1], "--out", str(out), "--prompts", str(prompts), "--minutes", "0.01", *DISTILL_FLAGS]
    assert run_distill(parse(argv)) == 1
    err = capsys.readouterr().err
    assert 'the prompt [{"role": "<s>", "content": "hi"}] cannot be tokenized' in err and "Traceback" not in err
    assert not any(out.iterdir())


def test_a_draft_directory_interrupted_while_written_is_no_model_and_resume_writes_it_whole(tiny, tmp_path,
                                                                                           monkeypatch, capsys):
    """Ctrl-C after the config and weights were written but before the output-vocabulary file
    left --out a model that loaded without complaint and predicted the whole vocabulary. The
    directory is built in a staging folder and moved in at the end: interrupted, --out holds no
    model, no staging folder, and `--minutes 0 --resume` writes the draft whole, as the message says."""
    import specdec.models as models

    def ctrl_c(*args, **kwargs):
        raise KeyboardInterrupt

    out = tmp_path / "run"
    argv = ["--target", tiny[1], "--out", str(out), "--prompts", tiny[2], *DISTILL_FLAGS]
    monkeypatch.setattr(models, "write_output_vocab", ctrl_c)
    assert run_distill(parse([*argv, "--minutes", "0.02"])) == 130
    assert "run the same command with --resume to continue" in capsys.readouterr().err
    assert not (out / "config.json").exists() and not list(out.glob(".*"))
    with pytest.raises(catalog.ModelNotFoundError):
        load_model(str(out))
    monkeypatch.undo()
    assert run_distill(parse([*argv, "--minutes", "0", "--resume"])) == 0
    vocab = json.loads((out / "specdec-output-vocab.json").read_text())["token_ids"]
    logits = load_model(str(out)).model(input_ids=torch.tensor([[1, 5, 9]])).logits[0]  # [T, V]
    assert len(vocab) == 32 and torch.isneginf(logits).sum(-1).tolist() == [39 - 32] * 3


def test_minutes_0_resume_of_a_run_without_a_checkpoint_is_refused_and_writes_nothing(distilled, tiny, tmp_path, capsys):
    """A run stopped while sampling has data and no checkpoint: `--minutes 0 --resume` took its
    data as finished (a batch or two) and wrote an untrained draft."""
    out, _, _, _ = distilled
    copied = shutil.copytree(out, tmp_path / "run")
    (copied / CHECKPOINT_NAME).unlink()
    before = files_of(copied)
    argv = ["--target", tiny[1], "--out", str(copied), "--prompts", tiny[2], *DISTILL_FLAGS, "--minutes", "0", "--resume"]
    assert run_distill(parse(argv)) == 1
    assert f"--minutes 0 --resume needs a checkpoint to write, and {copied} has none" in capsys.readouterr().err
    assert files_of(copied) == before


def test_the_prompt_order_is_drawn_as_it_is_sampled_so_a_large_data_tokens_costs_nothing_up_front(tiny, tmp_path,
                                                                                                  monkeypatch):
    """The order used to be a list sized for all of --data-tokens, built before the first sample
    (1e8: 15 s and 2.6 GB; 1e9: MemoryError). It is the same order, seeded shuffles of the
    prompts one after another, drawn as the batches need it."""
    import itertools
    import random

    reference, rng = [], random.Random(7)  # the order runs have sampled in: shuffles of one generator
    for _ in range(5):
        block = list(range(13))
        rng.shuffle(block)
        reference += block
    assert list(itertools.islice(distill_module.prompt_order(13, 7), 65)) == reference
    shuffled = []

    class CountingRandom(random.Random):
        def shuffle(self, x):
            shuffled.append(len(x))
            super().shuffle(x)

    monkeypatch.setattr(distill_module.random, "Random", CountingRandom)
    argv = ["--target", tiny[1], "--out", str(tmp_path / "run"), "--prompts", tiny[2], *DISTILL_FLAGS,
            "--data-tokens", str(10**7), "--gen-batch-size", "4", "--minutes", "0.02"]  # fmt: skip
    assert run_distill(parse(argv)) == 0
    sampled = json.loads((tmp_path / "run" / DRAFT_CARD_NAME).read_text())["training"]["train_sequences"]
    assert 0 < sum(shuffled) <= sampled + 12  # the prompts of the batches sampled, up to one block (was 2 million)


def test_evaluate_refuses_a_target_other_than_the_one_the_runs_data_was_sampled_from(distilled, tiny, tmp_path, capsys):
    """--evaluate judged the run's held-out sets with whatever --target it was given: another
    vocabulary ended in an IndexError, other weights under one vocabulary gave wrong figures."""
    out, _, _, _ = distilled
    tokenizer = build_tiny_tokenizer()
    model = build_tiny_model(tokenizer, hidden_size=64, num_layers=2, seed=3, initializer_range=TINY_INIT_RANGE)
    with torch.no_grad():
        model.model.layers[1].self_attn.q_proj.weight[0, 0] += 1e-3
    tuned = save_model(model, tokenizer, tmp_path / "tuned")
    assert run_distill(parse(["--target", str(tuned), "--out", str(out), "--evaluate", str(out)])) == 1
    err = capsys.readouterr().err
    assert f"holds data sampled from another target, {tiny[1]} (vocabulary" in err and f"not {tuned} (vocabulary" in err
    assert "give --target the run's own target" in err


@pytest.mark.parametrize("name", [CHECKPOINT_NAME, f"{DATA_DIR}/train-00000.pt", f"{DATA_DIR}/eval-00000.pt"])
def test_a_damaged_checkpoint_or_shard_ends_the_run_in_one_line_naming_it_and_removing_it_lets_resume_go_on(
        distilled, tiny, tmp_path, capsys, name):  # fmt: skip
    """A file cut short (a full disk, a copy) ended --resume in torch's RuntimeError traceback."""
    out, _, _, _ = distilled
    copied = shutil.copytree(out, tmp_path / "run")
    damaged = copied / name
    damaged.write_bytes(damaged.read_bytes()[: damaged.stat().st_size // 2])
    argv = ["--target", tiny[1], "--out", str(copied), "--prompts", tiny[2], *DISTILL_FLAGS, "--minutes", "0.01", "--resume"]
    assert run_distill(parse(argv)) == 1
    assert f"{damaged} cannot be read (" in capsys.readouterr().err
    damaged.unlink()
    assert run_distill(parse(argv)) == 0


def test_materialize_rebuilds_the_draft_and_refuses_another_vocabulary(distilled, tiny, tmp_path):
    out, _, _, _ = distilled
    rebuilt = materialize_draft(tiny[1], out / WEIGHTS_NAME, tmp_path / "rebuilt")
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        expected = load_model(str(out)).model(input_ids=ids).logits
        assert torch.allclose(load_model(str(rebuilt)).model(input_ids=ids).logits, expected, atol=1e-5)
    other_tokenizer = build_tiny_tokenizer(list("abcdefghij "))
    other = save_model(build_tiny_model(other_tokenizer, seed=1), other_tokenizer, tmp_path / "other")
    with pytest.raises(VocabMismatchError):
        materialize_draft(str(other), out / WEIGHTS_NAME, tmp_path / "never")


def test_distilled_draft_serves_losslessly(distilled, tiny, redis_url):
    """Real draft + target + coordinator processes; greedy output must be the target's own."""
    import specdec

    out, _, _, _ = distilled
    tokenizer = build_tiny_tokenizer()
    prompt_ids = tokenizer.encode("tell me about the sea")
    target = load_model(tiny[1])
    with torch.no_grad():
        reference = target.model.generate(
            torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            do_sample=False, max_new_tokens=30, pad_token_id=tokenizer.pad_token_id,
        )[0, len(prompt_ids) :].tolist()  # fmt: skip
    stack = start_stack(redis_url, tiny[1], str(out))
    try:
        with specdec.Client(stack.address) as client:
            result = client.generate(prompt_token_ids=prompt_ids, max_new_tokens=30, num_speculative_tokens=3)
            default_k = client.info().default_num_speculative_tokens
    finally:
        stack.stop()
    assert default_k == json.loads((out / DRAFT_CARD_NAME).read_text())["figures"]["serving_k"]  # the card's, not 4
    assert result.token_ids == reference[: len(result.token_ids)] and len(result.token_ids) > 0
    assert result.stats.draft_tokens > 0


def test_kl_top_k_is_zero_for_equal_distributions_and_counts_the_tail():
    logits = torch.randn(5, 50)
    log_p = torch.log_softmax(logits, -1)
    top_logp, top_ids = log_p.topk(8, -1)
    assert kl_top_k(logits, top_ids, top_logp).item() == pytest.approx(0.0, abs=1e-5)  # columns = ids: M = V
    # same top-k shape but q moves mass into the tail: the tail bin sees it
    shifted = logits.clone()
    shifted.scatter_add_(1, top_ids, torch.full_like(top_logp, -2.0))
    assert kl_top_k(shifted, top_ids, top_logp).item() > 0.05
    # full vocabulary as "top-k": the loss is the exact KL(p || q)
    q_logits = torch.randn(5, 50)
    full = torch.nn.functional.kl_div(torch.log_softmax(q_logits, -1), log_p, log_target=True, reduction="none").sum(-1)
    all_logp, all_ids = log_p.topk(50, -1)
    assert kl_top_k(q_logits, all_ids, all_logp).item() == pytest.approx(full.mean().item(), rel=1e-4)


def test_kl_top_k_puts_tokens_outside_the_draft_vocabulary_in_the_tail_bin():
    log_p = torch.log_softmax(torch.randn(4, 30), -1)  # [N, V]
    top_logp, top_ids = log_p.topk(10, -1)  # [N, k]
    vocab_ids = torch.arange(0, 30, 2)  # the draft predicts the even ids only: M = 15
    columns = torch.full((30,), -1)
    columns[vocab_ids] = torch.arange(15)
    q_logits = torch.randn(4, 15)  # [N, M]
    top_cols = columns[top_ids]
    assert (top_cols < 0).any() and (top_cols >= 0).any()
    # by hand: bins = p's kept top-k tokens, then one bin for everything else
    log_q = torch.log_softmax(q_logits, -1)
    expected = []
    for row in range(4):
        kept = top_cols[row] >= 0
        p_top, q_top = top_logp[row][kept].exp(), log_q[row][top_cols[row][kept]].exp()
        p_rest, q_rest = 1 - p_top.sum(), 1 - q_top.sum()
        expected.append((p_top * (p_top / q_top).log()).sum() + p_rest * (p_rest / q_rest).log())
    assert kl_top_k(q_logits, top_cols, top_logp).item() == pytest.approx(torch.stack(expected).mean().item(), rel=1e-4)


def test_output_vocab_is_the_tokens_with_most_target_mass():
    ids = torch.tensor([[5, 1], [5, 2], [3, 1]])  # [n, k]: three positions, p's top-2
    logp = torch.tensor([[0.6, 0.3], [0.5, 0.4], [0.9, 0.05]]).log()
    records = [{"topk_ids": ids, "topk_logp": logp}]
    # mass: 5 -> 1.1, 3 -> 0.9, 2 -> 0.4, 1 -> 0.35
    assert distill_module.choose_output_vocab(records, 2, 8).tolist() == [3, 5]  # sorted by id
    assert distill_module.choose_output_vocab(records, 0, 8).tolist() == list(range(8))
    coverage = distill_module.vocab_coverage(records, torch.tensor([3, 5]), 8)
    assert coverage["argmax_share"] == 1.0
    assert coverage["top_k_mass_share"] == pytest.approx(2.0 / 2.75)


def test_written_draft_predicts_only_its_output_vocab(distilled):
    out, first, _, _ = distilled
    vocab = json.loads((out / "specdec-output-vocab.json").read_text())["token_ids"]
    assert len(vocab) == 32 == first["architecture"]["output_vocab"]
    draft = load_model(str(out))
    logits = draft.model(input_ids=torch.tensor([[1, 5, 9, 12]])).logits[0]  # [T, V]
    assert logits.shape[-1] == draft.vocab_size == 39
    outside = torch.ones(39, dtype=torch.bool)
    outside[vocab] = False
    assert torch.isneginf(logits[:, outside]).all() and torch.isfinite(logits[:, ~outside]).all()


def test_a_held_out_prompt_that_is_also_a_training_prompt_is_refused_naming_it(tmp_path):
    """The same file as --prompts and --eval-prompts (or one prompt in both splits) used to train
    on every held-out prompt, and the held-out figures measured text the draft had learnt."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in TINY_PROMPTS))
    with pytest.raises(DistillError, match=r"16 of the 16 held-out prompts are training prompts too \(the first: \"hello there\"\)"):
        load_prompts(prompts, prompts)
    marked = tmp_path / "marked.jsonl"
    marked.write_text(json.dumps({"prompt": "a"}) + "\n" + json.dumps({"prompt": "a", "split": "eval"}) + "\n")
    with pytest.raises(DistillError, match="1 of the 1 held-out prompts"):
        load_prompts(marked)
    assert load_prompts(prompts) == (TINY_PROMPTS[:9] + TINY_PROMPTS[10:], [TINY_PROMPTS[9]])


def test_a_file_written_atomically_is_whole_or_as_it_was_and_leaves_no_partial_file(tmp_path):
    """stats.json, target.json, the card, checkpoints, shards and weights are written beside
    themselves and renamed: a run killed mid-write leaves the file as it was (stats.json
    and target.json were written in place, and a half of one broke every later --resume)."""
    from specdec.distill import write_json
    from specdec.files import write_atomically

    path = tmp_path / "stats.json"
    write_json(path, {"train_positions": 1})

    def killed_halfway(temp):
        temp.write_text('{"train_posi')
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_atomically(path, killed_halfway)
    assert json.loads(path.read_text()) == {"train_positions": 1} and [p.name for p in tmp_path.iterdir()] == ["stats.json"]


def test_default_prompt_set_is_varied_and_holds_out_distinct_prompts():
    train, held_out = load_prompts(DEFAULT_PROMPTS)
    assert len(train) >= 200 and len(held_out) >= 20
    assert not set(train) & set(held_out)
    text = " ".join(train).lower()
    for kind in ("explain", "list", "python", "summar", "hello"):
        assert kind in text


def test_catalog_draft_entry_points_at_a_packaged_weights_file():
    for entry in catalog.DRAFT_CATALOG.values():
        path = catalog.packaged_weights(entry)
        if not path.exists():
            pytest.skip(f"{path.name} not built yet (run the README's `specdec distill` command)")
        assert path.stat().st_size < 20 * 2**20


def test_a_catalog_draft_is_built_on_first_use_and_cached(distilled, tiny, tmp_path, monkeypatch):
    out, _, _, _ = distilled
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    entry = catalog.DraftEntry(name="tiny-draft", target=tiny[1], weights=str(out / WEIGHTS_NAME), description="")
    monkeypatch.setitem(catalog.DRAFT_CATALOG, "tiny-draft", entry)
    built = distill_module.ensure_distilled_draft("tiny-draft", progress=False)
    assert (built / "specdec-model.json").is_file()
    assert load_model(str(built)).vocab_fingerprint == load_model(tiny[1]).vocab_fingerprint
    stamp = (built / "model.safetensors").stat().st_mtime_ns
    assert distill_module.ensure_distilled_draft("tiny-draft", progress=False) == built
    assert (built / "model.safetensors").stat().st_mtime_ns == stamp  # cached: not rebuilt
    # New shipped weights (a later release) make the cached build stale: it is rebuilt from them.
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    with safe_open(str(out / WEIGHTS_NAME), "pt") as handle:
        metadata = handle.metadata()
    tensors = load_file(str(out / WEIGHTS_NAME))
    first = sorted(tensors)[0]
    tensors[first] = tensors[first] + 0.01
    save_file(tensors, str(tmp_path / "newer.safetensors"), metadata=metadata)
    monkeypatch.setitem(catalog.DRAFT_CATALOG, "tiny-draft", dataclasses.replace(entry, weights=str(tmp_path / "newer.safetensors")))
    assert not is_cached("tiny-draft")
    assert distill_module.ensure_distilled_draft("tiny-draft", progress=False) == built and is_cached("tiny-draft")
    assert (built / "model.safetensors").stat().st_mtime_ns != stamp


def test_sampling_at_temperature_zero_follows_the_greedy_path_and_still_stores_p_at_temperature_one(tiny):
    """The sampling temperature only picks the contexts: the stored log-probs are p's own."""
    target = load_model(tiny[1])
    tokenizer = target.tokenizer
    prompts = [tokenizer.encode(p) for p in ("hello there", "tell me a story")]
    records = distill_module.sample_batch(
        target.model, prompts, max_new_tokens=12, top_k=8, eos_ids=[], pad_id=tokenizer.pad_token_id,
        generator=torch.Generator().manual_seed(0), temperature=0.0,
    )  # fmt: skip
    for prompt, record in zip(prompts, records):
        greedy = list(prompt)
        with torch.no_grad():
            for _ in range(12):  # greedy by full recomputation, no cache, end tokens included
                greedy.append(int(target.model(torch.tensor([greedy])).logits[0, -1].argmax()))
            logp = torch.log_softmax(target.model(torch.tensor([greedy])).logits[0, len(prompt) - 1 : -1].float(), -1)
        assert record["ids"].tolist() == greedy
        top_logp, top_ids = logp.topk(8, -1)  # [n, 8]: p at temperature 1 on the greedy path
        assert torch.equal(record["topk_ids"].long(), top_ids)
        torch.testing.assert_close(record["topk_logp"].float(), top_logp, atol=2e-3, rtol=0)


def test_kept_features_are_the_final_hidden_states_the_stored_log_probs_come_from(tiny):
    """keep_features adds, per generated token, the hidden state the target's head turned into
    p there, and changes nothing else of the sample."""
    target = load_model(tiny[1])
    tokenizer = target.tokenizer
    prompts = [tokenizer.encode(p) for p in ("hello there", "tell me a story", "name a color")]

    def sample(keep):
        return distill_module.sample_batch(
            target.model, prompts, max_new_tokens=10, top_k=8, eos_ids=[], pad_id=tokenizer.pad_token_id,
            generator=torch.Generator().manual_seed(1), keep_features=keep,
        )  # fmt: skip

    plain, with_features = sample(False), sample(True)
    for record, featured in zip(plain, with_features):
        assert "features" not in record
        assert torch.equal(record["ids"], featured["ids"]) and torch.equal(record["topk_ids"], featured["topk_ids"])
        features = featured["features"]  # [n_gen, D]
        assert features.shape == (record["topk_ids"].shape[0], target.model.config.hidden_size)
        with torch.no_grad():
            logp = torch.log_softmax(target.model.lm_head(features.float()).float(), -1)  # [n_gen, V]
        torch.testing.assert_close(logp.gather(1, record["topk_ids"].long()), record["topk_logp"].float(),
                                   atol=0.05, rtol=0)  # fmt: skip
    assert not target.model.model.norm._forward_hooks  # the hook is gone after sampling
    with pytest.raises(distill_module.DistillError, match="final norm"):
        distill_module.sample_batch(torch.nn.Linear(2, 2), prompts, max_new_tokens=1, top_k=1, eos_ids=[], pad_id=0,
                                    generator=torch.Generator(), keep_features=True)  # fmt: skip


def test_draw_tokens_samples_from_p_sharpened_by_the_temperature():
    logp = torch.tensor([[0.6, 0.4, 0.0]]).log().expand(4000, 3)  # 4000 rows of the same p
    generator = torch.Generator().manual_seed(0)
    assert distill_module.draw_tokens(logp, 0.0, generator).eq(0).all()
    for temperature, share in [(1.0, 0.6), (0.5, 0.36 / 0.52)]:  # p^(1/T), renormalised
        tokens = distill_module.draw_tokens(logp, temperature, generator)
        assert not tokens.eq(2).any()
        sigma = (share * (1 - share) / 4000) ** 0.5
        assert abs(float(tokens.eq(0).float().mean()) - share) < 4 * sigma


def test_precision_flag_picks_bfloat16_only_where_the_cpu_multiplies_it(capsys):
    native = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert distill_module.compute_precision("auto") == (torch.bfloat16 if native else torch.float32)
    assert distill_module.compute_precision("float32") == torch.float32
    with pytest.raises(distill_module.DistillError, match="--precision"):
        distill_module.compute_precision("float8")
    args = parse(["--target", "t", "--out", "o", "--precision", "float32", "--temperatures", "1,0.6,0"])
    config = distill_module.config_from_args(args)
    assert config.temperatures == (1.0, 0.6, 0.0) and config.precision == "float32"
    assert "--precision float32 --temperatures 1,0.6,0" in config.command()
    default = distill_module.config_from_args(parse(["--target", "t", "--out", "o"]))
    assert default.temperatures == (1.0, 1.0, 1.0, 0.0)  # the shipped draft's recipe: every fourth batch greedy
    assert "--temperatures 1,1,1,0" in default.command()
    with pytest.raises(SystemExit):
        parse(["--target", "t", "--out", "o", "--temperatures", "1,-0.5"])
    assert "expected comma-separated temperatures >= 0" in capsys.readouterr().err


def test_the_packaged_prompts_are_the_scripts_output_and_no_added_prompt_names_a_held_out_topic():
    import importlib.util

    script = Path(__file__).resolve().parent.parent / "scripts" / "make_distill_prompts.py"
    spec = importlib.util.spec_from_file_location("make_distill_prompts", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    rows = [json.loads(line) for line in DEFAULT_PROMPTS.read_text().splitlines() if line.strip()]
    train = {row["prompt"] for row in rows if row.get("split") != "eval"}
    held_out = {row["prompt"] for row in rows if row.get("split") == "eval"}
    assert module.new_prompts(train | held_out) == []  # the packaged file is up to date
    added = module.new_prompts(set())  # every prompt the script adds (it refuses held-out topics)
    assert set(added) <= train and len(train) >= 1200 and len(held_out) == 30
    with pytest.raises(SystemExit, match="held-out topic"):
        module.HELD_OUT_TOPICS.append("bees")
        try:
            module.new_prompts(set())
        finally:
            module.HELD_OUT_TOPICS.pop()


def test_the_feature_draft_trial_script_samples_hidden_states_and_trains_both_variants(tiny, tmp_path, capsys):
    """scripts/feature_draft_trial.py, the README's measured trial, end to end on the tiny target."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("feature_draft_trial", ROOT / "scripts" / "feature_draft_trial.py")
    trial = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(trial)
    trial.main(["sample", "--target", tiny[1], "--out", str(tmp_path), "--minutes", "0", "--threads", "1"])
    records = torch.load(tmp_path / "train.pt", weights_only=True)
    assert len(records) == 64 and all(r["features"].shape[0] == r["topk_ids"].shape[0] for r in records)
    capsys.readouterr()
    for variant, keys in [("base", {"alpha", "greedy"}), ("feature", {"alpha", "greedy", "alpha_fed_back", "greedy_fed_back"})]:
        trial.main(["train", "--target", tiny[1], "--data", str(tmp_path), "--variant", variant, "--minutes", "0.02"])
        lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
        assert lines[0]["step"] == 0 and lines[-1]["step"] > 0
        assert keys <= set(lines[-1]) and all(0 <= lines[-1][k] <= 1 for k in keys)


class NotATensor:
    """An object a weights-only load refuses to rebuild."""


def test_a_whole_file_a_weights_only_load_refuses_is_not_called_damaged(tmp_path):
    """Loads are weights_only now: a whole file holding another kind of object (written by another
    version) must not be called "damaged or cut short; remove it", which would lose a good run."""
    import torch

    from specdec.distill import DistillError, load_saved

    path = tmp_path / "distill-checkpoint.pt"
    torch.save({"step": 3, "odd": NotATensor()}, path)
    with pytest.raises(DistillError, match="holds what a weights-only load refuses") as info:
        load_saved(path)
    assert "remove it" not in str(info.value)
    torch.save({"step": 3, "weights": torch.zeros(2)}, path)
    assert load_saved(path)["step"] == 3
