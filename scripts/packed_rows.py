"""Memory and time of packed products over many row counts: as specdec.packed runs them (rows
padded to a few counts, passes of at most MAX_PASS_ROWS) against exact row counts.

oneDNN keeps a kernel for every (weight shape, row count) a packed product meets. This runs one
product per distinct weight shape of a model's packed layers for every row count from 2 to
--max-rows, in a fresh process per mode, and prints the process's RSS as it goes; then the time
of one product per shape at a few prefill sizes, both ways.

    python scripts/packed_rows.py [--model smollm2-135m-instruct] [--max-rows 601] [--threads 2]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time


def rss_mib() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096 / 2**20


def one_per_shape(model_name: str) -> list:
    from specdec.models import load_model
    from specdec.packed import packed_layers

    layers = {}
    for layer in packed_layers(load_model(model_name).model):
        layers.setdefault((layer.in_features, layer.out_features), layer)
    if not layers:
        raise SystemExit(f"{model_name} loaded with no packed layers (not float32 on a CPU with oneDNN?)")
    return list(layers.values())


def exact_product(layer, x):  # [rows, in] -> [rows, out], no padding
    import torch

    return torch.ops.mkldnn._linear_pointwise(x, layer.packed_weight, layer.bias, "none", [], "")


def run_mode(args: argparse.Namespace) -> None:
    """In this process: every row count once, padded or exact; RSS every 100 counts."""
    import torch

    torch.set_num_threads(args.threads)
    layers = one_per_shape(args.model)
    product = exact_product if args.mode == "exact" else (lambda layer, x: layer.packed_forward(x))
    start = rss_mib()
    with torch.no_grad():
        for rows in range(2, args.max_rows + 1):
            for layer in layers:
                product(layer, torch.randn(rows, layer.in_features))
            if rows % 100 == 1 or rows == args.max_rows:
                print(f"{args.mode:>6}: row counts 2..{rows:<5} RSS {rss_mib():7.0f} MiB (+{rss_mib() - start:.0f})",
                      flush=True)  # fmt: skip
    if args.mode == "padded":
        print(f"{'':>6}  time of one product per shape ({len(layers)} shapes), best of 6:")
        for rows in (17, 33, 65, 129, 300, 513, 1500, 3000):
            inputs = [torch.randn(rows, layer.in_features) for layer in layers]
            times = {}
            for name, fn in (("exact", exact_product), ("padded", lambda layer, x: layer.packed_forward(x))):
                best = float("inf")
                for _ in range(6):
                    started = time.perf_counter()
                    for layer, x in zip(layers, inputs):
                        fn(layer, x)
                    best = min(best, time.perf_counter() - started)
                times[name] = best * 1000
            print(f"{'':>6}  {rows:4d} rows: exact {times['exact']:7.2f} ms, padded {times['padded']:7.2f} ms, "
                  f"ratio {times['padded'] / times['exact']:.2f}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct", help="catalog name or model directory")
    parser.add_argument("--max-rows", type=int, default=601, help="the largest row count run (from 2)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--mode", choices=["exact", "padded"], help=argparse.SUPPRESS)  # one child process
    args = parser.parse_args()
    if args.mode:
        return run_mode(args)
    for mode in ("exact", "padded"):
        subprocess.run([sys.executable, __file__, "--mode", mode, "--model", args.model,
                        "--max-rows", str(args.max_rows), "--threads", str(args.threads)], check=True)  # fmt: skip


if __name__ == "__main__":
    main()
