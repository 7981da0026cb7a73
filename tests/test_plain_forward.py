"""The plain forward pass (specdec.plain_forward) must compute transformers' logits bit for
bit, or not be used: every call shape the services make (a prompt, a decode step, a verify
pass after a cached past, a crop for a rejected draft), long contexts, grouped-query
attention, packed linears, an output-vocabulary head, bfloat16."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specdec import plain_forward as plain_module
from specdec.kvcache import forward, new_cache, transformers_forward
from specdec.models import build_tiny_model, build_tiny_tokenizer, load_model, restrict_output_vocab, save_model
from specdec.packed import pack_linears, packing_available
from specdec.plain_forward import ENABLED, ENV_SWITCH, check_plain_forward, plain_forward, supports_plain_forward

VOCAB = 64


def tiny_llama(heads: int, kv_heads: int, dtype=torch.float32, seed: int = 5) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=heads,
        num_key_value_heads=kv_heads, head_dim=48 // heads, max_position_embeddings=1024, initializer_range=0.2,
    )  # fmt: skip
    with torch.random.fork_rng():  # the global RNG is left as it was
        torch.manual_seed(seed)
        return LlamaForCausalLM(config).to(dtype).eval()


# (what, n): feed n random tokens, or crop n positions; the context ends at 547 positions,
# as long as the services' caches commonly get.
CALLS = [("feed", 300), ("feed", 1), ("feed", 3), ("crop", 2), ("feed", 1), ("feed", 240), ("feed", 5),
         ("crop", 4), ("feed", 2), ("feed", 1)]  # fmt: skip


def assert_same_logits_on_every_call(model) -> int:
    generator = torch.Generator().manual_seed(0)
    ours, theirs = new_cache(model.config), new_cache(model.config)
    compared = 0
    with torch.inference_mode():
        for what, n in CALLS:
            if what == "crop":
                ours.crop(-n)
                theirs.crop(-n)
                continue
            tokens = torch.randint(0, VOCAB, (n,), generator=generator).tolist()
            keep = min(n, 6)
            a = plain_forward(model, ours, tokens, keep=keep)  # [keep, V]
            b = transformers_forward(model, theirs, tokens, keep=keep)  # [keep, V]
            assert a.shape == b.shape == (keep, VOCAB)
            assert torch.equal(a, b), f"after {what} {n}: max difference {(a - b).abs().max().item()}"
            compared += keep
    assert ours.get_seq_length() == theirs.get_seq_length() == 300 + 1 + 3 - 2 + 1 + 240 + 5 - 4 + 2 + 1
    return compared


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2)], ids=["multi-head", "grouped-query"])
def test_the_plain_forward_gives_transformers_logits_bit_for_bit_through_prompts_steps_verify_passes_and_crops(
    heads, kv_heads
):
    assert assert_same_logits_on_every_call(tiny_llama(heads, kv_heads)) > 20


@pytest.mark.skipif(not packing_available(), reason="this torch build has no oneDNN")
def test_the_plain_forward_matches_on_packed_linears_and_an_output_vocabulary_head():
    model = tiny_llama(6, 2)
    restrict_output_vocab(model, torch.arange(0, VOCAB, 3))
    assert pack_linears(model) > 0
    assert_same_logits_on_every_call(model)


def test_the_plain_forward_matches_in_bfloat16():
    assert_same_logits_on_every_call(tiny_llama(6, 2, dtype=torch.bfloat16))


@pytest.mark.parametrize("packed", [False, True], ids=["stock", "packed"])
def test_a_batched_pass_gives_each_session_its_own_logits_and_cache_as_separate_passes_do(packed):
    """Three sessions with caches of 300, 7 and 52 positions fed 4, 1 and 3 tokens in one
    pass (a verify, a step, a verify), then 2, 5 and 1 more: each one's logits equal those of
    its own passes to float rounding, with the same argmax, and its cache holds the same keys
    and values, so the next pass on it matches too."""
    if packed and not packing_available():
        pytest.skip("this torch build has no oneDNN")
    model = tiny_llama(6, 2)
    restrict_output_vocab(model, torch.arange(0, VOCAB, 3))  # an output-vocabulary head: its rows pick kept rows
    if packed:
        assert pack_linears(model) > 0
    generator = torch.Generator().manual_seed(3)
    tokens = lambda n: torch.randint(0, VOCAB, (n,), generator=generator).tolist()  # noqa: E731
    batched, alone = [new_cache(model.config) for _ in range(3)], [new_cache(model.config) for _ in range(3)]
    with torch.inference_mode():
        for n, ours, theirs in zip((300, 7, 52), batched, alone):
            prompt = tokens(n)
            plain_forward(model, ours, prompt)
            plain_forward(model, theirs, prompt)
        for fed in ([tokens(4), tokens(1), tokens(3)], [tokens(2), tokens(5), tokens(1)]):
            keeps = [len(f) for f in fed]
            together = plain_module.plain_forward_batch(model, batched, fed, keeps)
            for i, (ours, theirs, f) in enumerate(zip(together, alone, fed)):
                separate = plain_forward(model, theirs, f, keep=len(f))  # [T, V]
                assert ours.shape == separate.shape == (len(f), VOCAB)
                torch.testing.assert_close(ours, separate, rtol=1e-5, atol=1e-5)
                assert torch.equal(ours.argmax(-1), separate.argmax(-1)), f"session {i}"
        for ours, theirs in zip(batched, alone):
            assert ours.get_seq_length() == theirs.get_seq_length()
            for a, b in zip(ours.layers, theirs.layers):
                torch.testing.assert_close(a.keys, b.keys, rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(a.values, b.values, rtol=1e-5, atol=1e-5)
    assert [c.get_seq_length() for c in batched] == [306, 13, 56]


def test_the_check_refuses_a_plain_forward_that_differs_by_one_part_in_a_million(monkeypatch):
    model = tiny_llama(6, 2)
    assert check_plain_forward(model)
    attend = plain_module.attend
    monkeypatch.setattr(plain_module, "attend", lambda *args: attend(*args) * (1 + 2**-20))
    assert not check_plain_forward(model)


def test_only_llama_decoders_take_the_plain_forward():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    qwen = Qwen2ForCausalLM(Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=2)).eval()  # fmt: skip
    assert not supports_plain_forward(qwen) and not check_plain_forward(qwen)
    llama = tiny_llama(4, 4)
    assert supports_plain_forward(llama)
    llama.train()
    assert not supports_plain_forward(llama)  # training runs transformers' forward


def test_load_model_turns_the_plain_forward_on_unless_switched_off_or_loading_as_transformers_does(
    tmp_path, monkeypatch
):
    save_model(build_tiny_model(build_tiny_tokenizer(), hidden_size=32, num_layers=2, seed=3), build_tiny_tokenizer(),
               tmp_path / "m")  # fmt: skip
    assert getattr(load_model(str(tmp_path / "m")).model, ENABLED) is True
    assert not getattr(load_model(str(tmp_path / "m"), pack=False).model, ENABLED, False)
    monkeypatch.setenv(ENV_SWITCH, "0")
    assert getattr(load_model(str(tmp_path / "m")).model, ENABLED) is False


def test_kvcache_forward_takes_the_plain_path_only_for_a_marked_model_with_a_cache(monkeypatch):
    model = tiny_llama(6, 2)
    calls = []
    monkeypatch.setattr(plain_module, "plain_forward", lambda *args: calls.append(args) or torch.zeros(1, VOCAB))
    with torch.inference_mode():
        forward(model, new_cache(model.config), [1, 2, 3])
        assert calls == []  # not marked
        setattr(model, ENABLED, True)
        forward(model, None, [1, 2, 3])
        assert calls == []  # no cache: transformers' forward
        forward(model, new_cache(model.config), [1, 2, 3])
        assert len(calls) == 1


def test_a_llama_variant_the_check_cannot_run_on_keeps_transformers_forward(monkeypatch):
    model = tiny_llama(6, 2)
    monkeypatch.delattr(model.model.layers[0].self_attn, "scaling")
    assert plain_module.enable_plain_forward(model) is False
    assert getattr(model, ENABLED) is False
