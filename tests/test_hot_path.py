"""The per-cycle hot path: a KV cache that appends in place, and prepacked linear layers.

Both must change nothing a model computes beyond the last bits of rounding: the in-place
cache gives the same logits as transformers' DynamicCache through appends, crops (a
rejected draft) and growth; a packed model gives the same greedy tokens and logits within
float32 tolerance, on the single-row path of one thread bit for bit."""

import asyncio
import time

import pytest
import torch
from transformers import DynamicCache

from specdec.kvcache import (
    MIN_PREFIX_REUSE, GrowingLayer, SessionPool, SessionState, cache_bytes, crop_cache, find_prefix, forward, new_cache,
    take_prefix,
)  # fmt: skip
from specdec.models import build_tiny_model, build_tiny_tokenizer, load_model, save_model
from specdec import packed as packed_module
from specdec.packed import (
    ENV_SWITCH, EXACT_ROWS, MAX_PASS_ROWS, ONE_ROW, SEVERAL_ROWS, PackedLinear, choose_kernels, kernel_choice,
    pack_linears, packing_available, padded_rows,
)  # fmt: skip

needs_onednn = pytest.mark.skipif(not packing_available(), reason="this torch build has no oneDNN")


@pytest.fixture(scope="module")
def model():
    return build_tiny_model(build_tiny_tokenizer(), hidden_size=32, num_layers=2, seed=3, initializer_range=0.2)


def test_the_in_place_cache_gives_the_same_logits_as_dynamic_cache_through_appends_crops_and_growth(model):
    tokens = torch.randint(1, 30, (400,), generator=torch.Generator().manual_seed(0)).tolist()
    growing, dynamic = new_cache(model.config), DynamicCache(config=model.config)
    assert all(isinstance(layer, GrowingLayer) for layer in growing.layers)
    held = 0
    # prefill, single steps, K + 1 passes, crops back over a rejected draft, and growth past
    # the first capacity (64) several times.
    for feed, crop_to in [(50, None), (1, None), (5, 53), (5, None), (30, 70), (1, None), (200, 250), (9, 252)]:
        chunk = tokens[held : held + feed]
        a = forward(model, growing, chunk, keep=len(chunk))
        b = forward(model, dynamic, chunk, keep=len(chunk))
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
        held += feed
        if crop_to is not None:
            crop_cache(growing, crop_to)
            crop_cache(dynamic, crop_to)
            held = crop_to
        assert growing.get_seq_length() == dynamic.get_seq_length() == held


def test_the_in_place_cache_writes_a_step_into_its_buffers_without_copying_them(model):
    cache = new_cache(model.config)
    forward(model, cache, list(range(1, 11)))
    layer = cache.layers[0]
    buffer = layer.key_buffer
    before = buffer[:, :, :10].clone()
    forward(model, cache, [12])
    assert layer.key_buffer is buffer, "a step within capacity must not move the cache"
    assert layer.keys.data_ptr() == buffer.data_ptr() and layer.keys.shape[-2] == 11
    torch.testing.assert_close(buffer[:, :, :10], before, rtol=0, atol=0)  # the old positions untouched


def test_cache_bytes_counts_the_spare_capacity_of_an_in_place_cache(model):
    cache = new_cache(model.config)
    assert cache_bytes(cache) == 0
    forward(model, cache, [1, 2, 3])
    layer = cache.layers[0]
    per_layer = 2 * layer.key_buffer.numel() * layer.key_buffer.element_size()
    assert layer.key_buffer.shape[-2] == GrowingLayer.MIN_CAPACITY
    assert cache_bytes(cache) == per_layer * len(cache.layers)
    with pytest.raises(ValueError, match="negative"):
        layer.crop(2)


@needs_onednn
def test_a_packed_linear_matches_nn_linear_for_one_and_several_rows():
    linear = torch.nn.Linear(48, 80)
    packed = PackedLinear(linear)
    assert packed.weight is linear.weight and packed.bias is linear.bias
    with torch.inference_mode():
        one = torch.randn(1, 1, 48)
        threads = torch.get_num_threads()
        try:
            torch.set_num_threads(1)
            assert torch.equal(packed(one), linear(one))  # one row, one thread: the same path, bit for bit
            torch.set_num_threads(2)  # one row, two threads: the packed copy
            torch.testing.assert_close(packed(one), linear(one), rtol=1e-5, atol=1e-5)
        finally:
            torch.set_num_threads(threads)
        for shape in [(1, 5, 48), (3, 7, 48), (9, 48)]:
            x = torch.randn(shape)
            torch.testing.assert_close(packed(x), linear(x), rtol=1e-5, atol=1e-5)


@needs_onednn
def test_a_packed_linear_over_many_rows_pads_and_splits_them_and_still_gives_each_rows_product():
    """Rows past EXACT_ROWS run padded to padded_rows, past MAX_PASS_ROWS in several passes:
    every row's product is still its own, whatever row count or shape it arrives in."""
    linear = torch.nn.Linear(48, 80)
    packed = PackedLinear(linear)
    with torch.inference_mode():
        for shape in [(64, 48), (65, 48), (2, 33, 48), (300, 48), (MAX_PASS_ROWS, 48), (MAX_PASS_ROWS + 1, 48),
                      (3, 700, 48)]:  # fmt: skip
            x = torch.randn(shape)
            out = packed.packed_forward(x)
            assert out.shape == (*shape[:-1], 80)
            torch.testing.assert_close(out, linear(x), rtol=1e-5, atol=1e-5)


def test_packed_row_counts_are_few_and_pad_by_at_most_an_eighth():
    counts = [padded_rows(rows) for rows in range(1, MAX_PASS_ROWS + 1)]
    assert counts[:EXACT_ROWS] == list(range(1, EXACT_ROWS + 1))  # decode steps and verify passes: exact
    assert all(rows <= padded <= 1.125 * rows for rows, padded in enumerate(counts, start=1))
    assert counts == sorted(counts) and len(set(counts)) == 96 and counts[-1] == MAX_PASS_ROWS
    assert [padded_rows(rows) for rows in (65, 72, 73, 100, 129, 513)] == [72, 72, 80, 104, 144, 576]


@needs_onednn
def test_a_packed_linear_takes_the_plain_path_when_training():
    linear = torch.nn.Linear(16, 8)
    packed = PackedLinear(linear)
    x = torch.randn(4, 16, requires_grad=True)
    packed(x).sum().backward()
    assert linear.weight.grad is not None and x.grad is not None


@needs_onednn
def test_a_packed_model_keeps_its_tied_head_and_its_greedy_tokens(model):
    tokens = [3, 9, 14, 2, 7, 21, 5]
    with torch.inference_mode():
        plain = model(torch.tensor([tokens])).logits
        greedy = model.generate(torch.tensor([tokens]), max_new_tokens=12, do_sample=False)
    packed = build_tiny_model(build_tiny_tokenizer(), hidden_size=32, num_layers=2, seed=3, initializer_range=0.2)
    assert pack_linears(packed) == 2 * 7 + 1  # 7 per layer and the head
    if packed.config.tie_word_embeddings:
        assert packed.get_output_embeddings().weight is packed.get_input_embeddings().weight
    with torch.inference_mode():
        torch.testing.assert_close(packed(torch.tensor([tokens])).logits, plain, rtol=1e-4, atol=1e-4)
        assert torch.equal(packed.generate(torch.tensor([tokens]), max_new_tokens=12, do_sample=False), greedy)


@needs_onednn
def test_load_model_packs_a_float32_cpu_model_unless_switched_off(tmp_path, monkeypatch, model):
    save_model(model, build_tiny_tokenizer(), tmp_path / "m")
    loaded = load_model(str(tmp_path / "m"))
    assert any(isinstance(m, PackedLinear) for m in loaded.model.modules())
    monkeypatch.setenv(ENV_SWITCH, "0")
    loaded = load_model(str(tmp_path / "m"))
    assert not any(isinstance(m, PackedLinear) for m in loaded.model.modules())


@needs_onednn
def test_choose_kernels_keeps_the_faster_kernel_for_each_pass_and_thread_count(monkeypatch):
    """The timing decides per (rows, threads): here the packed copy is made to time slower on
    one row and faster on several, so a single row takes nn.Linear's kernel (bit for bit) and
    a verify pass the packed copy, on one thread and on two."""
    packed = build_tiny_model(build_tiny_tokenizer(), hidden_size=32, num_layers=2, seed=3, initializer_range=0.2)
    pack_linears(packed)

    def fake_time_pass(layers, inputs, use_packed):  # seconds: packed loses on 1 row, wins on 4
        rows = next(iter(inputs.values())).shape[0]
        return {(1, True): 2.0, (1, False): 1.0, (4, True): 1.0, (4, False): 2.0}[(rows, use_packed)]

    monkeypatch.setattr(packed_module, "time_pass", fake_time_pass)
    choice = choose_kernels(packed, [1, 2, 2])
    assert choice is kernel_choice(packed)
    assert choice.packed == {(ONE_ROW, 1): False, (SEVERAL_ROWS, 1): True, (ONE_ROW, 2): False, (SEVERAL_ROWS, 2): True}
    assert choice.describe() == {"one row, 1 thread": "stock", "several rows, 1 thread": "packed",
                                 "one row, 2 threads": "stock", "several rows, 2 threads": "packed"}  # fmt: skip
    calls = []
    real_packed_forward = PackedLinear.packed_forward
    monkeypatch.setattr(PackedLinear, "packed_forward", lambda self, x: calls.append(x.shape) or real_packed_forward(self, x))
    layer = packed.lm_head
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        with torch.inference_mode():
            one = torch.randn(1, 1, layer.in_features)
            assert torch.equal(layer(one), torch.nn.functional.linear(one, layer.weight, layer.bias))
            assert calls == []
            layer(torch.randn(1, 4, layer.in_features))
            assert calls == [(1, 4, layer.in_features)]
    finally:
        torch.set_num_threads(threads)


@needs_onednn
def test_a_kernel_timed_only_a_little_faster_does_not_replace_the_fixed_rules(monkeypatch):
    """Within SWITCH_BELOW (10%) the fixed rule stands: startup timings are noisy."""
    packed = build_tiny_model(build_tiny_tokenizer(), hidden_size=32, num_layers=1, seed=3, initializer_range=0.2)
    pack_linears(packed)
    # nn.Linear's kernel times 5% faster everywhere; 1 thread, 1 row is stock by the rule anyway
    monkeypatch.setattr(packed_module, "time_pass", lambda layers, inputs, use_packed: 1.0 if use_packed else 0.95)
    assert choose_kernels(packed, [1, 2]).describe() == {
        "one row, 1 thread": "stock", "several rows, 1 thread": "packed",
        "one row, 2 threads": "packed", "several rows, 2 threads": "packed",
    }  # fmt: skip
    monkeypatch.setattr(packed_module, "time_pass", lambda layers, inputs, use_packed: 1.0 if use_packed else 0.85)
    assert set(choose_kernels(packed, [1, 2]).describe().values()) == {"stock"}


@needs_onednn
def test_load_model_times_the_kernels_for_one_thread_the_current_count_and_every_core(tmp_path, monkeypatch, model):
    import os

    save_model(model, build_tiny_tokenizer(), tmp_path / "m")
    loaded = load_model(str(tmp_path / "m"))
    counts = {1, torch.get_num_threads(), os.cpu_count() or 1}
    assert set(kernel_choice(loaded.model).packed) == {(rows, t) for rows in (ONE_ROW, SEVERAL_ROWS) for t in counts}
    assert set(loaded.kernels.values()) <= {"packed", "stock"} and len(loaded.kernels) == 2 * len(counts)
    monkeypatch.setenv(ENV_SWITCH, "fixed")  # packed, nothing timed: the fixed rule
    loaded = load_model(str(tmp_path / "m"))
    assert loaded.kernels == {} and kernel_choice(loaded.model).packed == {}
    assert kernel_choice(loaded.model).use_packed(4, 1) and not kernel_choice(loaded.model).use_packed(1, 1)


@needs_onednn
def test_a_timed_kernel_choice_is_remembered_and_the_next_load_on_this_machine_is_not_timed(tmp_path, monkeypatch, model):
    """pack_model writes its timed choice to kernels.json in the cache folder; loading a model
    of the same shapes again reads it back (no timing); other shapes, or a file that is not
    JSON, are timed again."""
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    timed = []

    def fake_time_pass(layers, inputs, use_packed):  # packed loses on 1 row (against the fixed rule), wins on 4
        timed.append(use_packed)
        rows = next(iter(inputs.values())).shape[0]
        return {(1, True): 2.0, (1, False): 1.0, (4, True): 1.0, (4, False): 2.0}[(rows, use_packed)]

    monkeypatch.setattr(packed_module, "time_pass", fake_time_pass)
    tokenizer = build_tiny_tokenizer()
    save_model(model, tokenizer, tmp_path / "m")
    first = load_model(str(tmp_path / "m"))
    assert timed and not kernel_choice(first.model).remembered
    assert {kernel for passes, kernel in first.kernels.items() if passes.startswith("one row")} == {"stock"}
    assert (tmp_path / "cache" / packed_module.REMEMBERED_FILE).exists()
    timed.clear()
    second = load_model(str(tmp_path / "m"))
    assert timed == [] and kernel_choice(second.model).remembered and second.kernels == first.kernels
    wider = build_tiny_model(tokenizer, hidden_size=48, num_layers=2, seed=3, initializer_range=0.2)
    save_model(wider, tokenizer, tmp_path / "wider")
    assert not kernel_choice(load_model(str(tmp_path / "wider")).model).remembered and timed
    (tmp_path / "cache" / packed_module.REMEMBERED_FILE).write_text("{not json")
    timed.clear()
    assert not kernel_choice(load_model(str(tmp_path / "m")).model).remembered and timed
    timed.clear()
    assert kernel_choice(load_model(str(tmp_path / "m")).model).remembered and timed == []


def test_a_greedy_model_draft_sends_one_hot_q_and_the_argmax_and_a_sampled_one_its_q(model):
    """At temperature 0 the draft's q is the one-hot of its argmax: it is sent as one-hot
    (None) with no [V] tensor made; sampled, the q sent is the warped one it drew from."""
    from types import SimpleNamespace

    from draft_service.drafters import ModelDrafter
    from specdec.kvcache import SessionState
    from specdec.rng import DRAFT, cycle_generator
    from specdec.wire import Sampling

    drafter = ModelDrafter(SimpleNamespace(model=model))
    prompt = [3, 9, 14, 2]
    state = SessionState("s", pending=list(prompt), cache=new_cache(model.config))
    greedy = list(drafter.propose(state, 6, Sampling(0.0, 0, 1.0, 1), cycle_generator(1, 0, DRAFT)))
    expected, ids = [], list(prompt)
    with torch.inference_mode():  # greedy by full recomputation, no cache
        for _ in range(6):
            expected.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
            ids.append(expected[-1])
    assert [token for token, _, _ in greedy] == expected and all(q is None for _, q, _ in greedy)
    state = SessionState("s", pending=list(prompt), cache=new_cache(model.config))
    sampled = list(drafter.propose(state, 3, Sampling(1.0, 5, 1.0, 1), cycle_generator(1, 0, DRAFT)))
    assert all(q is not None and q.probs()[token] > 0 and int((q.probs() > 0).sum()) <= 5 for token, q, _ in sampled)


def test_a_model_draft_with_lookup_weights_draws_from_q_mixed_with_the_lookups_token_and_sends_that(model):
    """Each drafted token comes from q' = (1 − λ_n)·q + λ_n·δ(c), c the lookup's token after the
    context so far (drafts included), and q' is the q sent; greedy, a heavy λ makes c the token."""
    from types import SimpleNamespace

    from draft_service.drafters import ModelDrafter
    from specdec.kvcache import SessionState
    from specdec.ngram import lookup_token, mix_lookup
    from specdec.rng import DRAFT, cycle_generator
    from specdec.draft_wire import wire_q
    from specdec.wire import Sampling

    weights = {1: 0.0, 2: 0.5, 3: 0.8}
    drafter = ModelDrafter(SimpleNamespace(model=model), weights)
    prompt = [3, 9, 14, 2, 5, 3, 9, 14]  # ends in "3 9 14", which was followed by 2
    sampling = Sampling(1.0, 0, 1.0, 1)
    state = SessionState("s", pending=list(prompt), cache=new_cache(model.config))
    proposals = list(drafter.propose(state, 5, sampling, cycle_generator(1, 0, DRAFT)))
    ids, mixed = list(prompt), 0
    with torch.inference_mode():
        for token, q, _ in proposals:
            expected = sampling.warp(model(torch.tensor([ids])).logits[0, -1])  # [V], by full recomputation
            looked_up, weight = lookup_token(ids, weights)
            if weight:
                expected, mixed = mix_lookup(expected, looked_up, weight), mixed + 1
            assert torch.allclose(q.probs(), wire_q(expected).probs(), atol=1e-3) and q.probs()[token] > 0
            ids.append(token)
    assert mixed >= 1 and proposals[0][1].probs()[2] >= 0.8, "the first draft sees the 3-gram match: 0.8 on token 2"
    state = SessionState("s", pending=list(prompt), cache=new_cache(model.config))
    greedy = list(drafter.propose(state, 1, Sampling(0.0, 0, 1.0, 1), cycle_generator(1, 0, DRAFT)))
    plain = list(ModelDrafter(SimpleNamespace(model=model)).propose(
        SessionState("s", pending=list(prompt), cache=new_cache(model.config)), 1, Sampling(0.0, 0, 1.0, 1),
        cycle_generator(1, 0, DRAFT)))  # fmt: skip
    assert greedy == [(2, None, 0)] and plain[0][0] != 2, "the test needs a model whose own argmax is not 2"
    # Weight 1 after every match: greedy, each step copies what followed the match in the context
    # *including the drafts so far* (2, then 5 after "9 14 2", 3 after "14 2 5", 9 after "2 5 3").
    copier = ModelDrafter(SimpleNamespace(model=model), {1: 1.0, 2: 1.0, 3: 1.0})
    state = SessionState("s", pending=list(prompt), cache=new_cache(model.config))
    copied = [t for t, _, _ in copier.propose(state, 4, Sampling(0.0, 0, 1.0, 1), cycle_generator(1, 0, DRAFT))]
    assert copied == [2, 5, 3, 9] and state.tokens() == prompt + [2, 5, 3, 9]
    sampled = SessionState("s", pending=list(prompt), cache=new_cache(model.config))
    copied = [(t, q) for t, q, _ in copier.propose(sampled, 4, sampling, cycle_generator(1, 0, DRAFT))]
    assert [t for t, _ in copied] == [2, 5, 3, 9] and all(float(q.probs()[t]) == 1.0 for t, q in copied)


@pytest.mark.parametrize("rope", [
    {"rope_type": "dynamic", "factor": 4.0},
    {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [4.0] * 8, "original_max_position_embeddings": 16,
     "factor": 2.0},
])  # fmt: skip
def test_a_session_of_a_model_whose_rope_follows_the_pass_length_gets_the_logits_it_gets_alone(rope):
    """transformers' "dynamic" and "longrope" rotary embeddings scale their frequencies by the
    longest position of the pass, and "dynamic" keeps those of the longest pass it has run.
    A short session batched with one past the model's original length, or run after it, used
    to get the long one's scaling (logits off by up to 1.5); it now gets its logits alone on
    a fresh model, bit for bit: no shared pass for such a model, and "dynamic" reset per pass."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from specdec.kvcache import forward_batch, length_dependent_rope
    from specdec.plain_forward import enable_plain_forward

    def build():
        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=50, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=32,
                             initializer_range=0.2, rope_parameters={"rope_theta": 10000.0, **rope})  # fmt: skip
        llama = LlamaForCausalLM(config).eval()
        assert enable_plain_forward(llama) and length_dependent_rope(llama)
        return llama

    generator = torch.Generator().manual_seed(1)
    short = torch.randint(0, 50, (8,), generator=generator).tolist()
    middle = torch.randint(0, 50, (40,), generator=generator).tolist()  # past the original 32 (longrope: 16)
    long = torch.randint(0, 50, (60,), generator=generator).tolist()
    with torch.inference_mode():
        fresh = build()
        alone = forward(fresh, new_cache(fresh.config), short, keep=3)  # [3, V]
        batched = forward_batch(fresh, [new_cache(fresh.config), new_cache(fresh.config)], [short, long], [3, 1])[0]
        fresh = build()
        middle_alone = forward(fresh, new_cache(fresh.config), middle, keep=3)
        forward(fresh, new_cache(fresh.config), long)
        middle_after_long = forward(fresh, new_cache(fresh.config), middle, keep=3)
    assert torch.equal(batched, alone) and torch.equal(middle_after_long, middle_alone)


def test_greedy_with_lookup_weights_picks_the_argmax_of_q_mixed_over_the_tokenizers_ids_not_padded_rows():
    """A draft whose embedding has rows past its tokenizer's ids (padding) samples over the ids
    alone; greedy with lookup weights must choose over the same q: the argmax of
    q' = (1 − λ)·q + λ·δ(c), q the softmax over the ids. Padded rows that score high (here as
    high as id 0, times 4) used to count in q, shrinking it, so the lookup's token won where
    the argmax of q' is another token (29 of 40 contexts)."""
    from draft_service.drafters import ModelDrafter, Step
    from specdec.kvcache import SessionState
    from specdec.models import LoadedModel
    from specdec.ngram import lookup_token
    from specdec.wire import Sampling

    tokenizer = build_tiny_tokenizer()
    ids = len(tokenizer)
    padded = build_tiny_model(tokenizer, hidden_size=32, num_layers=1, seed=0, vocab_size=ids + 128)
    with torch.no_grad():
        head = padded.get_output_embeddings().weight  # [V + 128, H]
        head[ids:] = head[:1]
        head.mul_(4)
    weights = {1: 0.1, 2: 0.1, 3: 0.1}
    drafter = ModelDrafter(LoadedModel(model=padded, tokenizer=tokenizer, name="padded", path="", vocab_fingerprint="",
                                       vocab_size=ids + 128, max_context=0), weights)  # fmt: skip
    looked_up_wins = 0
    for seed in range(40):
        generator = torch.Generator().manual_seed(seed)
        context = torch.randint(0, ids, (12,), generator=generator).tolist()
        context += context[:3]  # a 3-gram seen before: the lookup proposes what followed it
        state = SessionState("s", pending=list(context), cache=new_cache(padded.config))
        with torch.inference_mode():
            logits = forward(padded, new_cache(padded.config), context)[-1]  # [V + 128]
            [(token, q, _)] = drafter.draft_batch([Step(state, Sampling(0.0, 0, 1.0, seed=1), generator)])
        looked_up, weight = lookup_token(context, weights)
        mixed = (1 - weight) * torch.softmax(logits[:ids].float(), -1)  # [V]: q' over the ids
        mixed[looked_up] += weight
        assert q is None and float(mixed[token]) >= float(mixed.max()) - 1e-6, f"context {seed}"
        looked_up_wins += token == looked_up
    assert 0 < looked_up_wins < 40, "the test needs contexts where the lookup's token wins and where it loses"


def test_a_draft_whose_head_scores_part_of_the_vocabulary_sends_the_q_of_its_full_logits(model):
    """A SubsetHead draft warps, rounds and samples over its output ids only; that must be the
    q its full [V] logits (-inf off the subset) give, at every warp, and a lookup token the
    head cannot score must still be mixed in at its weight."""
    import copy
    from types import SimpleNamespace

    from draft_service.drafters import ModelDrafter
    from specdec.draft_wire import FIXED_ONE, wire_q
    from specdec.kvcache import SessionState
    from specdec.models import restrict_output_vocab
    from specdec.rng import DRAFT, cycle_generator
    from specdec.wire import Sampling

    vocab = model.config.vocab_size
    subset = copy.deepcopy(model)
    restrict_output_vocab(subset, torch.arange(0, vocab, 2))  # the even ids
    prompt = [3, 9, 14, 2]
    for sampling in (Sampling(1.0, 0, 1.0, 1), Sampling(0.7, 4, 1.0, 2), Sampling(1.3, 0, 0.8, 3)):
        state = SessionState("s", pending=list(prompt), cache=new_cache(subset.config))
        proposals = list(ModelDrafter(SimpleNamespace(model=subset)).propose(state, 4, sampling, cycle_generator(1, 0, DRAFT)))
        ids = list(prompt)
        with torch.inference_mode():
            for token, q, _ in proposals:
                expected = wire_q(sampling.warp(subset(torch.tensor([ids])).logits[0, -1]))  # over all V ids
                assert q.dense is None and q.ids.tolist() == expected.ids.tolist() and token % 2 == 0
                assert torch.allclose(q.probs(), expected.probs(), rtol=0, atol=2 / FIXED_ONE), sampling
                ids.append(token)
    lookup = [3, 9, 14, 7, 5, 3, 9, 14]  # ends in "3 9 14", which was followed by 7: an odd id
    state = SessionState("s", pending=list(lookup), cache=new_cache(subset.config))
    drafter = ModelDrafter(SimpleNamespace(model=subset), {3: 0.8})
    [(token, q, _)] = list(drafter.propose(state, 1, Sampling(1.0, 0, 1.0, 1), cycle_generator(1, 0, DRAFT)))
    probs = q.probs()  # [V]
    assert abs(float(probs[7]) - 0.8) <= 1 / FIXED_ONE and float(probs.sum()) == 1.0
    assert set(torch.nonzero(probs).squeeze(1).tolist()) <= set(range(0, vocab, 2)) | {7}


def test_the_in_place_caches_views_follow_its_buffers_through_a_crop_and_cannot_be_replaced(model):
    cache = new_cache(model.config)
    forward(model, cache, list(range(1, 11)))
    layer = cache.layers[0]
    crop_cache(cache, 7)
    assert layer.keys.shape[-2] == layer.values.shape[-2] == 7  # the crop shortened the views it hands out
    assert layer.keys.data_ptr() == layer.key_buffer.data_ptr()
    with pytest.raises(AttributeError, match="follow its buffers"):
        layer.keys = layer.key_buffer


# ---------------------------------------------------------------- prefix reuse


def prefilled(model, session_id: str, tokens: list[int]) -> SessionState:
    """A session as a model service holds it after its calls: `tokens` fed but the last (pending)."""
    state = SessionState(session_id, cache=new_cache(model.config), pending=[tokens[-1]])
    forward(model, state.cache, tokens[:-1])
    state.feed(tokens[:-1])
    return state


def sliding_window_model(family: str):
    """A tiny model of `family` whose attention layers (all, or some: qwen2's first two,
    gemma2's every other) look back 8 positions."""
    import transformers

    common = dict(vocab_size=40, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, sliding_window=8)  # fmt: skip
    config = {
        "mistral": lambda: transformers.MistralConfig(**common),
        "qwen2": lambda: transformers.Qwen2Config(use_sliding_window=True, max_window_layers=2, **common),
        "gemma2": lambda: transformers.Gemma2Config(head_dim=16, **common),
    }[family]()
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize("family", ["mistral", "qwen2", "gemma2"])
def test_a_sliding_window_model_crops_and_copies_its_cache_past_the_window_with_the_logits_of_one_pass(family):
    """A session longer than the window: rejected drafts crop its cache, and a new session
    copies its beginning (prefix reuse); the logits are those of one pass over the tokens,
    which sees each window only. transformers' sliding-window layer kept the window alone and
    could not crop back past it: the first rejected draft of such a session failed."""
    model = sliding_window_model(family)
    tokens = torch.randint(4, 40, (60,), generator=torch.Generator().manual_seed(5)).tolist()
    cache = new_cache(model.config)
    assert all(isinstance(layer, GrowingLayer) for layer in cache.layers)
    with torch.inference_mode():
        forward(model, cache, tokens[:12])
        forward(model, cache, tokens[12:20])  # K + 1 = 8 more ...
        crop_cache(cache, 15)  # ... 3 of them accepted
        forward(model, cache, tokens[15:30])
        crop_cache(cache, 22)
        got = forward(model, cache, tokens[22:35], keep=13)  # [13, V]
        whole = model(input_ids=torch.tensor([tokens[:35]])).logits[0, 22:35].float()  # [13, V]
        torch.testing.assert_close(got, whole, rtol=0, atol=1e-5)
        pool = SessionPool(8, lambda: new_cache(model.config))
        pool.sessions["other"] = SessionState("other", held=tokens[:35], cache=cache)
        state = pool.sessions["new"] = SessionState("new", cache=new_cache(model.config), pending=tokens[:50])
        donor, n = find_prefix(pool, state)
        take_prefix(donor.cache, state, n)
        assert n == 35 and state.cache.get_seq_length() == 35
        copied = forward(model, state.cache, state.pending, keep=len(state.pending))  # [15, V]
        whole = model(input_ids=torch.tensor([tokens[:50]])).logits[0, 35:50].float()  # [15, V]
        torch.testing.assert_close(copied, whole, rtol=0, atol=1e-5)


def test_a_cache_layer_that_runs_out_of_memory_while_growing_keeps_working_once_memory_is_free(monkeypatch):
    """Growing a layer's buffers replaced the keys' before the values' was made: out of memory
    on the second (a GPU under load) left keys of the new capacity beside values of the old,
    and every later pass of the session failed on the mismatch. Both are made first now: the
    failed pass leaves the layer as it was, and the next one appends as if nothing happened."""
    layer = GrowingLayer()
    first = torch.randn(1, 2, 60, 4)
    layer.update(first, -first)
    made = []
    real = GrowingLayer.empty_like_with

    def second_allocation_fails(states, capacity):
        made.append(capacity)
        if len(made) == 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 MiB")
        return real(states, capacity)

    monkeypatch.setattr(GrowingLayer, "empty_like_with", staticmethod(second_allocation_fails))
    more = torch.randn(1, 2, 10, 4)
    with pytest.raises(torch.OutOfMemoryError):
        layer.update(more, -more)
    monkeypatch.setattr(GrowingLayer, "empty_like_with", staticmethod(real))
    assert layer.key_buffer.shape == layer.value_buffer.shape and layer.length == 60
    keys, values = layer.update(more, -more)
    assert torch.equal(keys, torch.cat([first, more], dim=2)) and torch.equal(values, -keys)


def test_a_model_whose_layers_share_other_layers_keys_crops_its_cache_with_the_logits_of_one_pass():
    """Gemma 3n's last layers reuse earlier layers' keys and values: their cache layers hold
    nothing (transformers' DummyLayer), and cropping one failed with an AttributeError at the
    session's first rejected draft. They are skipped; the logits are those of one pass."""
    import transformers

    config = transformers.Gemma3nTextConfig(
        vocab_size=40, vocab_size_per_layer_input=40, hidden_size=64, hidden_size_per_layer_input=8, intermediate_size=128,
        num_hidden_layers=4, num_kv_shared_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        sliding_window=8, laurel_rank=4, altup_num_inputs=2, activation_sparsity_pattern=[0.0] * 4,
        layer_types=["sliding_attention", "full_attention"] * 2, max_position_embeddings=256, initializer_range=0.2,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.Gemma3nForCausalLM(config).eval()
    tokens = torch.randint(4, 40, (40,), generator=torch.Generator().manual_seed(5)).tolist()
    cache = new_cache(model.config)
    with torch.inference_mode():
        forward(model, cache, tokens[:12])
        forward(model, cache, tokens[12:20])
        crop_cache(cache, 15)
        got = forward(model, cache, tokens[15:30], keep=15)  # [15, V]
        whole = model(input_ids=torch.tensor([tokens[:30]])).logits[0, 15:30].float()  # [15, V]
    torch.testing.assert_close(got, whole, rtol=0, atol=1e-5)


def test_a_new_session_copies_the_beginning_an_idle_session_holds_and_its_logits_are_those_of_feeding_it(model):
    """A prompt whose first 110 tokens another session's cache covers takes them from it
    (find_prefix, take_prefix): the cache and the logits after are those of feeding the whole
    prompt. The other session is cropped (as a call beginning on the event loop does) between
    the choice and the copy: the copy reads its buffers, which a crop leaves as they are."""
    tokens = torch.randint(1, 30, (150,), generator=torch.Generator().manual_seed(4)).tolist()
    prompt = tokens[:110] + [31, *tokens[111:130]]  # parts at token 110
    pool = SessionPool(8, lambda: new_cache(model.config))
    pool.sessions["other"] = prefilled(model, "other", tokens)
    state = pool.sessions["new"] = SessionState("new", cache=new_cache(model.config), pending=list(prompt))
    donor, n = find_prefix(pool, state)
    assert donor is pool.sessions["other"] and n == 110
    crop_cache(donor.cache, 40)
    take_prefix(donor.cache, state, n)
    assert state.held == prompt[:110] and state.pending == prompt[110:] and state.cache.get_seq_length() == 110
    fed = new_cache(model.config)
    expected = forward(model, fed, prompt, keep=len(prompt) - 110)
    torch.testing.assert_close(forward(model, state.cache, state.pending, keep=len(state.pending)), expected,
                               rtol=0, atol=1e-5)  # fmt: skip


def test_prefix_reuse_leaves_the_last_token_pending_and_takes_nothing_short_busy_or_held_already(model):
    tokens = torch.randint(1, 30, (100,), generator=torch.Generator().manual_seed(5)).tolist()
    pool = SessionPool(8, lambda: new_cache(model.config))
    other = pool.sessions["other"] = prefilled(model, "other", tokens)

    def found(pending, held=()):
        state = SessionState("new", cache=new_cache(model.config), held=list(held), pending=list(pending))
        return (lambda hit: hit and hit[1])(find_prefix(pool, state))

    assert found(tokens[:60]) == 59  # the whole prompt is held elsewhere: its last token stays pending
    assert found(tokens) == 99  # all the other session holds
    assert found(tokens[:15] + [31] * 40) is None  # 15 tokens in common: fed, not copied
    assert found(tokens[:16] + [31] * 40) == 16
    assert found(tokens[:60], held=[1]) is None  # the session holds tokens already
    other.busy = True
    assert found(tokens[:60]) is None  # a session in a call is never read
    other.busy = False


def test_a_finished_session_is_kept_for_reuse_until_room_is_needed_or_it_expires_and_a_deleted_one_is_dropped(model):
    """Release(keep_for_reuse) retires a finished session: still found by find_prefix, no longer
    served; a Delete's release drops it. Retired sessions go first when memory runs short, before
    the sessions still in use, at most max_sessions of them are kept, none past retired_s."""
    tokens = torch.randint(1, 30, (100,), generator=torch.Generator().manual_seed(6)).tolist()
    per_session = cache_bytes(prefilled(model, "x", tokens).cache)
    pool = SessionPool(2, lambda: new_cache(model.config), max_cache_bytes=3 * per_session)
    for i, name in enumerate("abc"):
        pool.sessions[name] = prefilled(model, name, tokens[:60] + [i + 1] * 40)  # each a beginning of its own
        pool.sessions[name].nbytes = per_session
    assert pool.release("a", retire=True) and "a" not in pool and list(pool.retired) == ["a"]
    assert find_prefix(pool, SessionState("new", cache=new_cache(model.config), pending=tokens[:50]))
    assert pool.release("b", retire=True) and pool.release("c", retire=True)
    assert list(pool.retired) == ["b", "c"]  # at most max_sessions (2) kept: the oldest dropped
    assert pool.release("c") is False and list(pool.retired) == ["b"]  # deleted: dropped now
    live = pool.sessions["d"] = prefilled(model, "d", tokens)
    live.nbytes = per_session
    pool.sessions["e"] = prefilled(model, "e", tokens)
    pool.sessions["e"].nbytes = 2 * per_session  # 4 sessions' bytes in all, over the limit of 3
    pool._trim_memory()
    assert not pool.retired and list(pool.sessions) == ["d", "e"]  # the retired one went, no session in use
    pool.retired_s = 0.05
    assert pool.release("d", retire=True) and pool.release("e") and list(pool.retired) == ["d"]
    time.sleep(0.1)
    assert find_prefix(pool, SessionState("new", cache=new_cache(model.config), pending=tokens[:50])) is None
    assert not pool.retired  # kept no longer than retired_s (Redis's TTL of the finished session's record)


def test_a_call_that_waited_for_a_session_dropped_meanwhile_takes_the_sessions_state_again():
    """The call holding a session drops its state (found untrustworthy: the session created
    again, or a pass of it still running on a wedged worker) while another call waits for its
    lock, or the session is retired meanwhile and then dropped: the waiting call used to go on
    with the dropped state, a cache no longer trusted and outside the pool, and a retired one
    stayed a donor for prefix reuse. The waiting call takes the session's state again, a new one.
    A state retired meanwhile (its stream ended) is no untrustworthy one: it serves the call."""

    async def exists(session_id):
        return True

    async def run():
        pool = SessionPool(4, lambda: None)
        holding = pool.use("s", exists)
        dropped = await holding.__aenter__()
        waiter = pool.use("s", exists)
        waiting = asyncio.create_task(waiter.__aenter__())
        await asyncio.sleep(0.01)  # it waits for the lock
        pool.drop(dropped)
        await holding.__aexit__(None, None, None)
        taken = await waiting
        busy = taken.busy
        await waiter.__aexit__(None, None, None)
        retiring = pool.use("r", exists)
        retired = await retiring.__aenter__()
        pool.release("r", retire=True)  # a Release during the call keeps it for reuse...
        pool.drop(retired)  # ...and the call finds it untrustworthy
        await retiring.__aexit__(None, None, None)
        finishing = pool.use("f", exists)
        finished = await finishing.__aenter__()
        finished.held = list(range(MIN_PREFIX_REUSE))  # worth keeping for reuse
        waiter = pool.use("f", exists)
        waiting = asyncio.create_task(waiter.__aenter__())
        await asyncio.sleep(0.01)
        pool.release("f", retire=True)  # the stream ended while a second call waited
        await finishing.__aexit__(None, None, None)
        after_retired = await waiting
        await waiter.__aexit__(None, None, None)
        return pool, dropped, taken, busy, finished, after_retired

    pool, dropped, taken, busy, finished, after_retired = asyncio.run(run())
    assert taken is not dropped and pool.sessions["s"] is taken and busy
    assert "r" not in pool.retired and "r" not in pool
    # a state retired (not dropped) meanwhile serves the waiting call, as before: no second state
    assert after_retired is finished and "f" not in pool and pool.retired["f"] is finished


def test_a_finished_session_whose_tokens_a_kept_one_holds_is_not_kept_twice(model):
    """The same prompt sent again (greedy: the same tokens) keeps one retired cache, not one a
    request; a longer one that begins with a kept one's tokens replaces it; one that parts from
    it is kept beside it."""
    tokens = torch.randint(1, 30, (100,), generator=torch.Generator().manual_seed(8)).tolist()
    pool = SessionPool(8, lambda: new_cache(model.config))
    kept_after = {
        "a": ["a"], "again": ["a"], "shorter": ["a"],  # the same tokens, or fewer: "a" holds them
        "longer": ["longer"],  # holds all of "a"'s and more: replaces it
        "parted": ["longer", "parted"], "tiny": ["longer", "parted"],  # parts from it; too short to keep
    }  # fmt: skip
    for name, held in (("a", tokens[:60]), ("again", tokens[:60]), ("shorter", tokens[:40]), ("longer", tokens[:80]),
                       ("parted", tokens[:50] + [31] * 20), ("tiny", tokens[:10])):  # fmt: skip
        pool.sessions[name] = prefilled(model, name, held + [1])
        assert pool.release(name, retire=True) and list(pool.retired) == kept_after[name], name


def test_a_model_service_copies_a_shared_beginning_unless_prefix_reuse_is_off(model, monkeypatch):
    """ModelService.prefill with prefix_reuse (the default) takes a new session's beginning from
    an idle session and counts it, and Release(keep_for_reuse) keeps a finished session's cache
    (not one Redis no longer has: its Delete's release may come first); with --no-prefix-reuse
    (or its variable), or without a model, it feeds the prompt and keeps nothing."""
    import asyncio

    from specdec.cli import build_parser
    from specdec.model_service import ModelService, ModelServiceConfig
    from specdec.v1 import specdec_pb2 as pb

    tokens = torch.randint(1, 30, (100,), generator=torch.Generator().manual_seed(7)).tolist()

    class Redis:  # the sessions Redis has
        async def exists(self, session_id: str) -> bool:
            return session_id != "deleted"

    def prefilled_by(reuse: bool, with_model=model) -> tuple[int, float, list[str]]:
        service = ModelService(ModelServiceConfig(prefix_reuse=reuse), store=Redis(), info=pb.ModelInfoResponse())
        service.model, service.pool = with_model, SessionPool(8, lambda: new_cache(model.config))
        service.pool.sessions["other"] = prefilled(model, "other", tokens)
        service.pool.sessions["deleted"] = prefilled(model, "deleted", tokens[::-1])
        state = service.pool.sessions["new"] = SessionState("new", cache=new_cache(model.config), pending=tokens[:80])
        asyncio.run(service.prefill(state))
        for session_id in ("other", "deleted"):  # "deleted": its Delete's release came first, Redis lacks it
            asyncio.run(service.Release(pb.ReleaseRequest(session_id=session_id, keep_for_reuse=True), None))
        service.worker.shutdown()
        return len(state.held), service.metrics.prefix_reused_tokens._value.get(), list(service.pool.retired)

    assert prefilled_by(True) == (79, 79.0, ["other"]) and prefilled_by(False) == (0, 0.0, [])
    assert prefilled_by(True, with_model=None) == (0, 0.0, [])  # an n-gram draft: no cache to copy or keep
    assert build_parser().parse_args(["serve", "target"]).no_prefix_reuse is False
    assert build_parser().parse_args(["serve", "draft", "--no-prefix-reuse"]).no_prefix_reuse is True
    monkeypatch.setenv("SPECDEC_TARGET_NO_PREFIX_REUSE", "1")
    assert build_parser().parse_args(["serve", "target"]).no_prefix_reuse is True


def test_a_call_that_finds_its_state_untrustworthy_drops_that_state_not_a_newer_one_of_the_same_id(monkeypatch):
    """Two calls waited on a stale state of a session recreated under its id: the first found it
    so (SessionRecreated), dropped it, and its retry made a new state; the second then dropped
    *by id*, taking the retry's new state from under it (a second prefill, a cache the limits
    no longer counted). A call drops only the state it holds."""
    import asyncio
    import contextlib

    from specdec.errors import SessionRecreated
    from specdec.model_service import ModelService, ModelServiceConfig
    from specdec.v1 import specdec_pb2 as pb

    class Redis:
        async def exists(self, session_id: str) -> bool:
            return True

    service = ModelService(ModelServiceConfig(), store=Redis(), info=pb.ModelInfoResponse())
    service.pool = SessionPool(8, lambda: None)
    stale = service.pool.sessions["s"] = SessionState("s")
    newer = SessionState("s")

    @contextlib.asynccontextmanager
    async def brought(state, *args, **kwargs):
        if state is stale:
            service.pool.sessions["s"] = newer  # meanwhile, another call's retry made a new state
            raise SessionRecreated("session 's' was created again since this target held it")
        yield

    monkeypatch.setattr(SessionState, "brought", brought)

    async def call():
        async with service.session(pb.VerifyRequest(session_id="s", position=0)):
            pass

    with pytest.raises(SessionRecreated):
        asyncio.run(call())
    service.worker.shutdown()
    assert service.pool.sessions.get("s") is newer


def test_a_pass_that_fails_partway_through_its_layers_is_cropped_back_and_the_next_pass_is_exact(model):
    """Out of memory in the second layer: the first layer's cache holds the failed pass's
    positions, the second's does not. Cropping back to the held tokens must leave every layer
    as it was, so the session's next pass gives the logits of a cache that never failed."""
    prompt, fed = [5, 9, 2, 7, 11, 3], [8, 4, 6]
    cache = new_cache(model.config)
    forward(model, cache, prompt)

    def out_of_memory(module, args):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1 bytes")

    hook = model.model.layers[1].input_layernorm.register_forward_pre_hook(out_of_memory)
    try:
        with pytest.raises(RuntimeError, match="can't allocate memory"):
            forward(model, cache, fed)
    finally:
        hook.remove()
    assert [layer.get_seq_length() for layer in cache.layers] == [9, 6], "the failure must come partway"
    crop_cache(cache, len(prompt))
    assert [layer.get_seq_length() for layer in cache.layers] == [6, 6]
    clean = new_cache(model.config)
    forward(model, clean, prompt)
    torch.testing.assert_close(forward(model, cache, fed, keep=3), forward(model, clean, fed, keep=3), rtol=0, atol=0)
