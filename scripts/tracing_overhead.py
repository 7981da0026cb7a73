"""Measure what tracing costs: the same workload through `specdec up`-style stacks with
tracing off and with tracing on (exporting every span over OTLP/gRPC to a receiver in
this process), alternating, and print the tokens/s of each and their ratio.

    python scripts/tracing_overhead.py [--target NAME] [--draft NAME] [--requests 8] [--rounds 2]
"""

import argparse
import statistics
import threading
import time
from concurrent import futures

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

import specdec
from specdec.launcher import Stack, StackConfig
from specdec.redis_server import free_port

PROMPTS = [
    "Explain what a hash table is.",
    "Write a Python function that reverses a string.",
    "Repeat this sentence twice: the quick brown fox jumps over the lazy dog.",
    "List three uses of speculative decoding.",
]


class CountingReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self):
        self.spans = 0
        self.lock = threading.Lock()

    def Export(self, request, context):
        with self.lock:
            self.spans += sum(len(s.spans) for r in request.resource_spans for s in r.scope_spans)
        return trace_service_pb2.ExportTraceServiceResponse()


def run_workload(address: str, requests: int, new_tokens: int) -> float:
    """Generated tokens per second over `requests` sequential greedy requests."""
    tokens, started = 0, time.perf_counter()
    with specdec.Client(address) as client:
        for i in range(requests):
            result = client.generate(PROMPTS[i % len(PROMPTS)], max_new_tokens=new_tokens, ignore_eos=True)
            tokens += len(result.token_ids)
    return tokens / (time.perf_counter() - started)


def measure(args, env: dict) -> float:
    config = StackConfig(port=free_port(), target=args.target, draft=args.draft, env=env)
    with Stack(config, quiet=True) as stack:
        run_workload(stack.address, 1, 8)  # warm-up
        return run_workload(stack.address, args.requests, args.new_tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--draft", default="ngram")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=2, help="off/on pairs, alternated")
    args = parser.parse_args()

    receiver = CountingReceiver()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    traced = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}", "OTEL_EXPORTER_OTLP_INSECURE": "true",
              "OTEL_TRACES_SAMPLER": "always_on"}  # fmt: skip
    off, on = [], []
    for round_ in range(args.rounds):
        off.append(measure(args, {"OTEL_SDK_DISABLED": "true"}))
        on.append(measure(args, traced))
        print(f"round {round_ + 1}: off {off[-1]:.2f} tok/s, on {on[-1]:.2f} tok/s", flush=True)
    server.stop(0)
    ratio = statistics.median(on) / statistics.median(off)
    print(f"tracing off: {statistics.median(off):.2f} tok/s; on: {statistics.median(on):.2f} tok/s; "
          f"on/off = {ratio:.3f}; spans exported: {receiver.spans}")  # fmt: skip


if __name__ == "__main__":
    main()
