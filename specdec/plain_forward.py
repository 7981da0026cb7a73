"""A plain forward pass for Llama models on a session's KV cache, for decoding and verifying.

transformers' `LlamaForCausalLM.forward` wraps each call in argument decorators, output
records and a mask builder, and dispatches attention through an interface, which copies the
whole KV cache once per query head sharing it on every pass over several tokens (repeat_kv).
On this project's 2-core CPU the plain path takes 0.79-0.99 of that forward's time for a
SmolLM2-135M step or verify pass, 0.79-0.90 for the distilled draft's (README, Performance;
`scripts/plain_forward_ab.py`).

`plain_forward` calls the same modules in the same order (embedding, rotary embedding, norms,
linear layers, packed or not, MLP, output head) and writes out only the attention between
them, so its logits are transformers' own, bit for bit: `check_plain_forward` compares the
two at load and `load_model` uses this path only where they agree.

`plain_forward_batch` feeds several sessions at once, each on its own cache: their rows go
through every linear layer together (one multiply over all of them, where the weights are read
once instead of once per session) and only the attention runs per session. Its logits agree
with one session's pass to float rounding, not bit for bit: a multiply over more rows may sum
in another order.

Terms:
    T       tokens fed in this call; S = positions the cache covers after them (past + T)
    N       rows of a batched call: the sessions' T one after another
    H, Hkv  query heads and key/value heads; G = H // Hkv queries share a key/value head
    D       head dimension
"""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, apply_rotary_pos_emb

# Environment switch: "0" keeps transformers' own forward everywhere (for A/B runs).
ENV_SWITCH = "SPECDEC_PLAIN_FORWARD"
# The attribute load_model sets on a model whose plain forward matched transformers'.
ENABLED = "specdec_plain_forward"


def supports_plain_forward(model) -> bool:
    """Whether `model` is a Llama this module writes out (every decoder layer a
    LlamaDecoderLayer), in eval mode; training runs transformers' forward."""
    inner = getattr(model, "model", None)
    if getattr(model.config, "model_type", None) != "llama" or inner is None or model.training:
        return False
    return all(type(layer) is LlamaDecoderLayer for layer in inner.layers)


def attend(attn, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Causal attention of T new queries [1, H, T, D] over all S keys and values [1, Hkv, S, D]
    (the last T of them the queries' own positions); returns [1, T, H·D].

    The G query heads of a key/value head share it inside the kernel (enable_gqa), where
    transformers copies the cache G times (repeat_kv) for a pass over T > 1 tokens after a
    cached past, such as every verify pass; the kernel's arithmetic is the same."""
    _, heads, t, dim = query.shape
    s = keys.shape[2]
    if t == 1 or s == t:  # one new token sees everything; a prompt on an empty cache is plainly causal
        out = F.scaled_dot_product_attention(query, keys, values, is_causal=t > 1, scale=attn.scaling, enable_gqa=True)
    else:  # row i sees the past and the new positions up to its own
        mask = torch.ones(t, s, dtype=torch.bool, device=query.device).tril(s - t)  # [T, S]
        out = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=attn.scaling, enable_gqa=True)
    return out.transpose(1, 2).reshape(1, t, heads * dim)  # [1, T, H·D]


def decoder_layer(layer: LlamaDecoderLayer, cache_layers, hidden: torch.Tensor, rotary, lengths: Sequence[int]):
    """One Llama decoder layer over hidden [1, N, hidden size], the rows of len(lengths)
    sessions one after another (lengths: each one's T), appending to each one's cache layer."""
    attn = layer.self_attn
    n = hidden.shape[1]
    normed = layer.input_layernorm(hidden)
    query = attn.q_proj(normed).view(1, n, -1, attn.head_dim).transpose(1, 2)  # [1, H, N, D]
    key = attn.k_proj(normed).view(1, n, -1, attn.head_dim).transpose(1, 2)  # [1, Hkv, N, D]
    value = attn.v_proj(normed).view(1, n, -1, attn.head_dim).transpose(1, 2)  # [1, Hkv, N, D]
    query, key = apply_rotary_pos_emb(query, key, *rotary)
    if len(cache_layers) == 1:  # one session (every draft step): nothing to split
        keys, values = cache_layers[0].update(key, value)  # [1, Hkv, S, D]
        attended = attend(attn, query, keys, values)  # [1, N, H·D]
    else:
        parts, start = [], 0
        for cache_layer, t in zip(cache_layers, lengths):
            rows = slice(start, start + t)
            keys, values = cache_layer.update(key[:, :, rows], value[:, :, rows])  # [1, Hkv, S, D]
            parts.append(attend(attn, query[:, :, rows], keys, values))  # [1, T, H·D]
            start += t
        attended = torch.cat(parts, dim=1)  # [1, N, H·D]
    hidden = hidden + attn.o_proj(attended)
    return hidden + layer.mlp(layer.post_attention_layernorm(hidden))


def plain_forward(model, cache, tokens: Sequence[int], keep: int = 1) -> torch.Tensor:
    """Feed `tokens` after what `cache` (a DynamicCache: one appending layer per decoder layer)
    covers; return the logits of the last `keep` of them [keep, V] (float32), as
    kvcache.forward does."""
    return plain_forward_batch(model, [cache], [tokens], [keep])[0]


def plain_forward_batch(model, caches: Sequence, token_lists: Sequence[Sequence[int]],
                        keeps: Sequence[int]) -> list[torch.Tensor]:  # fmt: skip
    """plain_forward for several sessions in one pass (module doc): feed token_lists[i] after
    what caches[i] covers; return each one's logits of its last keeps[i] tokens [keep, V]."""
    inner = model.model
    lengths = [len(tokens) for tokens in token_lists]
    input_ids = torch.tensor([[t for tokens in token_lists for t in tokens]], dtype=torch.long,
                             device=model.device)  # [1, N]  # fmt: skip
    hidden = inner.embed_tokens(input_ids)  # [1, N, hidden size]
    spans = [(cache.get_seq_length(), t) for cache, t in zip(caches, lengths)]  # (past, T) of each session
    ranges = [torch.arange(past, past + t, device=hidden.device) for past, t in spans]
    positions = (ranges[0] if len(ranges) == 1 else torch.cat(ranges))[None]  # [1, N]
    rotary = inner.rotary_emb(hidden, positions)  # cos, sin [1, N, D]
    for i, layer in enumerate(inner.layers):
        hidden = decoder_layer(layer, [cache.layers[i] for cache in caches], hidden, rotary, lengths)
    keeps = [min(keep, t) for keep, t in zip(keeps, lengths)]
    if len(caches) == 1:
        kept = hidden[:, -keeps[0] :]  # [1, keep, hidden size]
    else:
        rows = [row for end, keep in zip(itertools.accumulate(lengths), keeps) for row in range(end - keep, end)]
        kept = hidden[:, rows]  # [1, Σkeep, hidden size]
    logits = model.lm_head(inner.norm(kept))[0].float()  # [Σkeep, V]
    return list(logits.split(keeps))


# What check_plain_forward feeds both paths: a prompt, one decode step, a verify pass over
# 4 tokens, a crop of 2 (a rejected draft) and another pass over 3.
CHECK_CALLS = (("feed", 7), ("feed", 1), ("feed", 4), ("crop", 2), ("feed", 3))


def check_plain_forward(model, seed: int = 0) -> bool:
    """Whether plain_forward gives transformers' logits bit for bit on `model` (CHECK_CALLS on
    random tokens, every fed position's logits compared)."""
    from specdec.kvcache import new_cache, transformers_forward  # kvcache dispatches to this module

    if not supports_plain_forward(model) or os.environ.get(ENV_SWITCH) == "0":
        return False
    vocab = model.get_input_embeddings().weight.shape[0]
    generator = torch.Generator().manual_seed(seed)
    caches = [new_cache(model.config), new_cache(model.config)]
    with torch.inference_mode():
        for what, n in CHECK_CALLS:
            if what == "crop":
                for cache in caches:
                    cache.crop(-n)
                continue
            tokens = torch.randint(0, vocab, (n,), generator=generator).tolist()
            ours = plain_forward(model, caches[0], tokens, keep=n)
            theirs = transformers_forward(model, caches[1], tokens, keep=n)
            if not torch.equal(ours, theirs):
                return False
    return True


def enable_plain_forward(model) -> bool:
    """Mark `model` for kvcache.forward's plain path if check_plain_forward passes; returns
    that. A Llama variant the check cannot even run on keeps transformers' forward too."""
    try:
        enabled = check_plain_forward(model)
    except (AttributeError, TypeError, ValueError, RuntimeError) as exc:
        logging.getLogger("specdec").info("the plain forward does not run on this model (%s): transformers' forward", exc)
        enabled = False
    else:
        if not enabled and supports_plain_forward(model) and os.environ.get(ENV_SWITCH) != "0":
            logging.getLogger("specdec").info("the plain forward's logits differ from transformers' on this model: "
                                              "transformers' forward")  # fmt: skip
    setattr(model, ENABLED, enabled)
    return enabled
