"""What a model service pays to rebuild a session it does not hold (after a restart, an eviction,
or on another replica): a prefill of the session's committed tokens, as specdec does it, against
reading its KV cache back from Redis, as the design's optional `specdec:{id}:kv:...` blocks would.

For each context length: the median ms of a prefill (specdec.kvcache.prefill_ms, the service's
packed float32 model on --threads), the KV cache's bytes, and the median ms to write those bytes to
a real redis-server on loopback (float32, as the cache holds them) and to read them back into tensors of the cache's shapes. It also
prints what keeping the blocks would cost every cycle: the KV bytes of the tokens a cycle commits.

    python scripts/kv_rebuild_cost.py [--model smollm2-135m-instruct] [--lengths 128,512,1024,2048]
"""

from __future__ import annotations

import argparse
import time


def median_ms(run, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append((time.perf_counter() - start) * 1000)
    return sorted(times)[len(times) // 2]


def cache_tensors(cache) -> list:
    """The key and value tensors of a DynamicCache, layer by layer: [1, kv_heads, T, head_dim] each."""
    return [t for layer in cache.layers for t in (layer.keys, layer.values)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--lengths", default="128,512,1024,2048", help="context lengths, comma-separated")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (a stack's target has all but one core)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    import redis
    import torch

    from specdec.kvcache import forward, new_cache, prefill_ms
    from specdec.models import load_model
    from specdec.redis_server import EmbeddedRedis

    torch.set_num_threads(args.threads)
    model = load_model(args.model).model
    generator = torch.Generator().manual_seed(0)
    lengths = [int(n) for n in args.lengths.split(",")]
    ids = torch.randint(0, model.config.vocab_size, (max(lengths),), generator=generator).tolist()
    server = EmbeddedRedis().start()
    client = redis.Redis.from_url(server.url)
    print(f"{args.model}, {args.threads} thread(s), median of {args.repeats}")
    print(f"{'tokens':>7} {'prefill ms':>11} {'KV MiB':>8} {'Redis write ms':>15} {'Redis read ms':>14}")
    try:
        for n in lengths:
            tokens = ids[:n]
            prefill = prefill_ms(model, tokens, repeats=args.repeats)
            cache = new_cache(model.config)
            with torch.inference_mode():
                forward(model, cache, tokens)
            tensors = cache_tensors(cache)
            size = sum(t.numel() * t.element_size() for t in tensors)
            shapes = [(t.shape, t.dtype, t.numel() * t.element_size()) for t in tensors]

            def write():
                client.set("kv", b"".join(t.contiguous().view(torch.uint8).numpy().tobytes() for t in tensors))

            def read():
                data, at, out = client.get("kv"), 0, []
                for shape, dtype, nbytes in shapes:
                    out.append(torch.frombuffer(bytearray(data[at : at + nbytes]), dtype=torch.uint8).view(dtype).view(shape))
                    at += nbytes
                return out

            written, read_back = median_ms(write, args.repeats), median_ms(read, args.repeats)
            assert all(torch.equal(a, b) for a, b in zip(tensors, read()))
            print(f"{n:>7} {prefill:>11.1f} {size / 2**20:>8.1f} {written:>15.1f} {read_back:>14.1f}")
        per_token = size / lengths[-1]
        print(f"KV bytes per token: {per_token:,.0f}; a cycle committing 1.7 tokens would write {1.7 * per_token / 1024:.0f} kB")
    finally:
        client.close()
        server.stop()


if __name__ == "__main__":
    main()
