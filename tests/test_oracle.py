"""Oracle: greedy speculative decoding through the three services must reproduce the
target's own greedy decoding (`transformers` generate(do_sample=False)) token for
token, on the real SmolLM2-135M-Instruct, whatever the draft."""

from types import SimpleNamespace

import pytest
import torch

import specdec
from specdec.models import load_model

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Repeat after me: the quick brown fox jumps over the lazy dog. The quick brown fox",
    "List three colors of the rainbow:",
    "Once upon a time, in a small village,",
]
NEW_TOKENS = 24
KS = (1, 3, 5)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def target(smollm2_dir):
    return load_model(smollm2_dir)


@pytest.fixture(scope="module")
def oracle(target, smollm2_dir):
    """prompt ids -> the target's greedy continuation, from transformers generate on the
    model as transformers itself loads it (no packed linear layers, its own KV cache)."""
    from transformers import AutoModelForCausalLM

    stock = AutoModelForCausalLM.from_pretrained(smollm2_dir, local_files_only=True, dtype=torch.float32).eval()
    expected = {}
    for prompt in PROMPTS:
        ids = target.tokenizer.encode(prompt)
        out = stock.generate(
            torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            do_sample=False, max_new_tokens=NEW_TOKENS, pad_token_id=target.tokenizer.pad_token_id,
        )  # fmt: skip
        expected[tuple(ids)] = out[0, len(ids) :].tolist()
    return expected


@pytest.fixture(scope="module")
def tiny_shared_vocab_draft(smollm2_dir, target, tmp_path_factory):
    """A tiny random model on SmolLM2's tokenizer: it shares the vocabulary, agrees with nothing."""
    from conftest import make_tiny_model_dir

    directory = tmp_path_factory.mktemp("tiny-smol") / "draft"
    return make_tiny_model_dir(
        target.tokenizer, directory, hidden_size=32, num_layers=1, seed=3, vocab_size=target.vocab_size
    )


DRAFTS = ["ngram", "tiny-random", "target-itself"]


def k_for(draft_kind: str, prompt_index: int) -> int:
    """The K a draft's request for a prompt runs at: a Latin square, so each draft runs every K
    and each (prompt, K) pair runs with some draft, in a third of the requests of all pairs."""
    return KS[(prompt_index + DRAFTS.index(draft_kind)) % len(KS)]


@pytest.fixture(scope="module")
def services(redis_url, smollm2_dir, tiny_shared_vocab_draft):
    """One SmolLM2 target for every test here: the default stack, started as `specdec up`
    starts it on the default target with no --draft (its coordinator drafts with the shipped
    distilled draft); beside it, a coordinator with --ngram-first 2 on the same draft
    ("ngram-first"), and for each of DRAFTS a draft process and a coordinator that calls it
    and the stack's target ("via-" + the draft)."""
    from conftest import start_stack

    stack = start_stack(redis_url, "smollm2-135m-instruct", "")
    try:
        models = {"ngram": "ngram", "tiny-random": tiny_shared_vocab_draft, "target-itself": smollm2_dir}
        for kind, model in models.items():  # started side by side, then waited for
            stack.add_replica(f"{kind}-draft", "draft", "--model", model, wait=False)
            draft_address = f"127.0.0.1:{stack.ports[f'{kind}-draft']}"
            stack.add_coordinator(f"via-{kind}", "--draft-address", draft_address, wait=False)
        stack.add_coordinator("ngram-first", "--ngram-first", "2", wait=False)
        stack.wait_ready((*(f"{kind}-draft" for kind in models), *(f"via-{kind}" for kind in models), "ngram-first"))
        yield stack
    finally:
        stack.stop()


@pytest.fixture(params=DRAFTS)
def stack(request, services):
    """The address of a coordinator whose draft is `draft_kind`, one of DRAFTS."""
    return SimpleNamespace(address=f"127.0.0.1:{services.ports['via-' + request.param]}", draft_kind=request.param)


def test_greedy_output_equals_transformers_generate_for_every_draft_and_k(stack, oracle):
    drafted = accepted = pipelined = 0
    with specdec.Client(stack.address) as client:
        for index, (ids, expected) in enumerate(oracle.items()):
            k = k_for(stack.draft_kind, index)
            # Pipelining (drafting the next cycle during verification) is on by default.
            result = client.generate(prompt_token_ids=list(ids), max_new_tokens=NEW_TOKENS, num_speculative_tokens=k)
            assert result.token_ids == expected, f"draft {stack.draft_kind}, K={k}, prompt {ids[:6]}..."
            drafted += result.stats.draft_tokens
            accepted += result.stats.accepted_tokens
            pipelined += sum(c.pipelined for c in result.cycles)
    rate = accepted / drafted if drafted else 0.0
    print(f"\n{stack.draft_kind}: drafted {drafted}, accepted {accepted}, acceptance {rate:.3f}")
    if stack.draft_kind == "target-itself":
        assert rate == 1.0, "a draft identical to the target must have every token accepted"
        # Its guess of the bonus token is always right: every cycle but each request's first
        # was drafted while the target verified the one before.
        assert pipelined > 0.5 * len(oracle)
    elif stack.draft_kind == "tiny-random":
        assert drafted > 0 and rate < 0.05, "a random draft should almost never be accepted"
    else:
        assert drafted > 0 and accepted > 0, "prompt lookup should find something in the repeat prompt"


def test_adaptive_k_output_equals_transformers_generate(stack, oracle):
    """Adaptive K chooses K per cycle and, for the n-gram draft, verifies only the drafts
    its match length makes worth it: which drafts the target sees changes, the output not."""
    if stack.draft_kind == "target-itself":
        pytest.skip("the n-gram and random drafts cover the choices (skip, trim, probe)")
    with specdec.Client(stack.address) as client:
        for ids, expected in oracle.items():
            result = client.generate(prompt_token_ids=list(ids), max_new_tokens=NEW_TOKENS,
                                     num_speculative_tokens=max(KS), adaptive_k=True)  # fmt: skip
            assert result.token_ids == expected, f"draft {stack.draft_kind}, adaptive K, prompt {ids[:6]}..."


def test_text_prompt_is_tokenized_like_the_oracle(stack, oracle, target):
    if stack.draft_kind != "ngram":
        pytest.skip("one draft is enough for tokenization")
    prompt = PROMPTS[0]
    with specdec.Client(stack.address) as client:
        result = client.generate(prompt, max_new_tokens=NEW_TOKENS)
    assert result.token_ids == oracle[tuple(target.tokenizer.encode(prompt))]
    assert result.text == target.tokenizer.decode(result.token_ids, skip_special_tokens=True)


def test_the_catalog_draft_builds_from_its_shipped_weights_and_agrees_with_the_target(smollm2_dir, target):
    """smollm2-135m-instruct-draft: compact weights in specdec/data, rebuilt on first use
    from the target's embedding; same vocabulary, and its greedy choice matches the
    target's far more often than chance along the target's own greedy continuation."""
    import torch

    from specdec.models import ensure_catalog_model

    draft = load_model(str(ensure_catalog_model("smollm2-135m-instruct-draft", progress=False)))
    assert draft.vocab_fingerprint == target.vocab_fingerprint
    text = target.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Explain what a hash table is."}], add_generation_prompt=True, tokenize=False
    )
    prompt = target.tokenizer.encode(text)
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        full = target.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=40,
                                     pad_token_id=target.tokenizer.pad_token_id)  # fmt: skip
        start = len(prompt) - 1
        p_top = target.model(full).logits[0, start:-1].argmax(-1)  # [40]
        q_top = draft.model(full).logits[0, start:-1].argmax(-1)  # [40]
    agreement = (p_top == q_top).float().mean().item()
    assert agreement >= 0.1, agreement  # a random draft of this vocabulary agrees ~0 times in 40


@pytest.mark.parametrize("ngram_first", [0, 2])
def test_greedy_output_through_the_services_with_the_distilled_draft_equals_transformers_generate(
    services, oracle, ngram_first
):
    """`specdec up`'s stack with the shipped distilled draft: lossless, and the draft is
    actually used (some of its tokens are accepted), at fixed K and with pipelining on;
    with --ngram-first 2, cycles after a repeated 2-gram take looked-up drafts instead.
    Without it, the stack is the default one, started as `specdec up` starts it on the
    default target with no --draft: the distilled draft, at its own K = 2 for requests that set none."""
    assert services.config.draft == "smollm2-135m-instruct-draft"
    address = f"127.0.0.1:{services.ports['ngram-first' if ngram_first else 'coordinator']}"
    drafted = accepted = 0
    looked_up = proposed = 0
    with specdec.Client(address) as client:
        if not ngram_first:  # the draft service reports the catalog draft's K; the coordinator takes it
            info = client.info()
            assert info.draft.default_k == 2 and info.default_num_speculative_tokens == 2, info
        ks = (2, 4) if ngram_first else (None, 4)  # None: the stack's default K
        for index, (ids, expected) in enumerate(oracle.items()):  # the Ks take turns over the prompts
            k = ks[index % len(ks)]
            result = client.generate(prompt_token_ids=list(ids), max_new_tokens=NEW_TOKENS,
                                     num_speculative_tokens=k, pipeline=True)  # fmt: skip
            assert result.token_ids == expected, f"distilled draft, K={k}, prompt {ids[:6]}..."
            if k is None:
                assert max(c.drafted for c in result.cycles) == 2, [c.drafted for c in result.cycles]
            drafted += result.stats.draft_tokens
            accepted += result.stats.accepted_tokens
            looked_up += sum(c.drafted for c in result.cycles if c.looked_up)
            proposed += sum(c.drafted for c in result.cycles if not c.looked_up)
    print(f"\ndistilled draft, n-gram first {ngram_first}: drafted {drafted} ({looked_up} looked up), "
          f"accepted {accepted}, acceptance {accepted / max(drafted, 1):.3f}")  # fmt: skip
    assert drafted > 0 and accepted > 0, (drafted, accepted)
    assert proposed > 0 and (looked_up > 0) == bool(ngram_first), (proposed, looked_up)
