"""Prometheus metrics, named as vLLM names them so dashboards carry over.

Each service process serves its own registry on `--metrics-port` (off when unset).
Counters are exposed with the `_total` suffix, as prometheus-client and vLLM do:
`specdec:spec_decode_num_drafts_total`, and so on.

Coordinator:
    specdec:spec_decode_num_drafts               cycles in which the draft proposed tokens
    specdec:spec_decode_num_draft_tokens         tokens drafted
    specdec:spec_decode_num_accepted_tokens      drafted tokens the target accepted
    specdec:spec_decode_num_accepted_tokens_per_pos{position}
    specdec:request_success{finished_reason}     finished requests (length, stop, eos)
    specdec:request_failure{status}              failed or cancelled requests, by gRPC status
    specdec:requests_refused{reason}             Generate / Resume calls refused before they ran:
                                                 starting, limit (--max-concurrent-requests),
                                                 caller_limit (--max-requests-per-caller), or
                                                 their status (invalid_argument, not_found, ...)
    specdec:prompt_tokens, specdec:generation_tokens
    specdec:time_to_first_token_seconds, specdec:inter_token_latency_seconds,
    specdec:e2e_request_latency_seconds          histograms
    specdec:num_requests_running                 gauge
    Mean acceptance length = 1 + accepted_tokens / num_drafts.
Draft and target:
    specdec:forward_latency_seconds{service}     one forward pass (drafting step or verify pass), once per pass
    specdec:sessions_held{service}               sessions whose KV cache is held
    specdec:cache_evictions{service}             sessions evicted (least recently used)
    specdec:prefill_chunks{service}              passes that fed a chunk of a long prompt (chunked prefill)
    specdec:prefix_reused_tokens{service}        prompt tokens copied from another session's cache
Every service with tokens:
    specdec:unauthenticated_calls                calls refused UNAUTHENTICATED (security.TokenCheck)
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 32, 64)
REQUEST_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)


class CoordinatorMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.num_drafts = Counter("specdec:spec_decode_num_drafts", "Cycles in which the draft proposed tokens.", registry=r)
        self.num_draft_tokens = Counter("specdec:spec_decode_num_draft_tokens", "Tokens drafted.", registry=r)
        self.num_accepted_tokens = Counter(
            "specdec:spec_decode_num_accepted_tokens", "Drafted tokens accepted by the target.", registry=r
        )
        self.accepted_per_pos = Counter(
            "specdec:spec_decode_num_accepted_tokens_per_pos",
            "Accepted drafted tokens by their position in the cycle.",
            ["position"],
            registry=r,
        )
        self.request_success = Counter(
            "specdec:request_success", "Finished requests by finish reason.", ["finished_reason"], registry=r
        )
        self.request_failure = Counter(
            "specdec:request_failure", "Failed or cancelled requests by gRPC status.", ["status"], registry=r
        )
        self.requests_refused = Counter(
            "specdec:requests_refused", "Calls refused before they ran, by reason.", ["reason"], registry=r
        )
        self.prompt_tokens = Counter("specdec:prompt_tokens", "Prompt tokens processed.", registry=r)
        self.generation_tokens = Counter("specdec:generation_tokens", "Tokens generated.", registry=r)
        self.time_to_first_token = Histogram(
            "specdec:time_to_first_token_seconds", "Time to the first generated token.",
            buckets=LATENCY_BUCKETS + (20.0, 40.0), registry=r,
        )  # fmt: skip
        self.inter_token_latency = Histogram(
            "specdec:inter_token_latency_seconds",
            "Time per generated token after the first (a chunk's gap spread over its tokens).",
            buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.e2e_latency = Histogram(
            "specdec:e2e_request_latency_seconds", "Request latency, start to finish.", buckets=REQUEST_BUCKETS, registry=r
        )
        self.requests_running = Gauge("specdec:num_requests_running", "Requests being generated.", registry=r)
        self.replicas = Gauge("specdec:replicas", "Replicas of a model service the coordinator knows.",
                              ["service"], registry=r)  # fmt: skip
        self.replicas_usable = Gauge(
            "specdec:replicas_usable", "Replicas of a model service not skipped after a failed call, nor unchecked.",
            ["service"], registry=r,
        )  # fmt: skip
        self.replicas_refused = Gauge(
            "specdec:replicas_refused", "Replicas refused: another target model, or draft vocabulary, than the coordinator's.",
            ["service"], registry=r,
        )  # fmt: skip

    def follow_replicas(self, service: str, replicas) -> None:
        """Report a coordinator.replicas.Replicas as `service` (draft or target) at every scrape."""
        self.replicas.labels(service=service).set_function(lambda: len(replicas.replicas))
        self.replicas_usable.labels(service=service).set_function(replicas.usable_count)
        self.replicas_refused.labels(service=service).set_function(replicas.refused_count)

    def observe_cycle(self, drafted: int, accepted: int) -> None:
        if drafted:
            self.num_drafts.inc()
            self.num_draft_tokens.inc(drafted)
            self.num_accepted_tokens.inc(accepted)
            for position in range(accepted):
                self.accepted_per_pos.labels(position=str(position)).inc()

    def observe_chunk(self, tokens: int, since_start_s: float, since_last_s: float | None) -> None:
        """A chunk of `tokens` arrived; `since_last_s` is None for the first chunk, whose
        arrival is the time to first token. A later chunk's gap is spread over its tokens."""
        self.generation_tokens.inc(tokens)
        if since_last_s is None:
            self.time_to_first_token.observe(since_start_s)
            return
        for _ in range(tokens):
            self.inter_token_latency.observe(since_last_s / tokens)


class ModelServiceMetrics:
    def __init__(self, service: str, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.service = service
        self.forward_latency = Histogram(
            "specdec:forward_latency_seconds", "Latency of one forward pass on the model's worker: a drafting step or "
            "a verify pass (with its verdicts), over all the sessions it served; an n-gram draft's lookup step.",
            ["service"], buckets=LATENCY_BUCKETS, registry=r,
        ).labels(service=service)  # fmt: skip
        self.sessions_held = Gauge(
            "specdec:sessions_held", "Sessions whose KV cache is held.", ["service"], registry=r
        ).labels(service=service)
        self.cache_evictions = Counter(
            "specdec:cache_evictions", "Sessions evicted from the KV cache pool.", ["service"], registry=r
        ).labels(service=service)
        self.cache_bytes = Gauge(
            "specdec:kv_cache_bytes", "Memory held by the sessions' KV caches.", ["service"], registry=r
        ).labels(service=service)
        self.batch_size = Histogram(
            "specdec:batch_size", "Sessions one forward pass served (the target batches Verify calls, a model draft its drafting steps).",
            ["service"], buckets=BATCH_BUCKETS, registry=r,
        ).labels(service=service)  # fmt: skip
        self.prefill_chunks = Counter(
            "specdec:prefill_chunks", "Passes that fed a chunk of a long prompt (or of a context rebuilt from Redis) "
            "before the pass of its call (chunked prefill: model_service.prefill).", ["service"], registry=r,
        ).labels(service=service)  # fmt: skip
        self.prefix_reused_tokens = Counter(
            "specdec:prefix_reused_tokens", "Tokens of a new session's context copied from the KV cache of an idle "
            "session that began alike instead of fed to the model (prefix reuse: kvcache.find_prefix).",
            ["service"], registry=r,
        ).labels(service=service)  # fmt: skip
        self.running_pass = Gauge(
            "specdec:running_pass_seconds", "Seconds the pass now running on the model's worker has run (0 while "
            "idle); one past --pass-timeout makes the service refuse calls (serving.ModelWorker).",
            ["service"], registry=r,
        ).labels(service=service)  # fmt: skip
        self._evictions_seen = 0

    def watch_worker(self, worker) -> None:
        """Read running_pass from a serving.ModelWorker at each scrape."""
        self.running_pass.set_function(worker.running_s)

    def observe_pool(self, pool) -> None:
        """Follow a kvcache.SessionPool (its on_change callback)."""
        self.sessions_held.set(len(pool))
        self.cache_bytes.set(pool.bytes_held)
        self.cache_evictions.inc(pool.evictions - self._evictions_seen)
        self._evictions_seen = pool.evictions

    def observe_pass(self, sessions: int, seconds: float) -> None:
        """A forward pass (batching.Batcher) served `sessions` in `seconds`: once per pass, where
        forward_latency was observed once per session of a pass, and, for the draft, from the
        moment each session's step began to wait for a pass."""
        self.batch_size.observe(sessions)
        self.forward_latency.observe(seconds)


def unauthenticated_calls(registry: CollectorRegistry) -> Counter:
    """The counter of calls security.TokenCheck refuses for want of an accepted token."""
    return Counter("specdec:unauthenticated_calls", "Calls refused UNAUTHENTICATED: no accepted token (or client "
                   "certificate) came with them.", registry=registry)  # fmt: skip


def serve_metrics(registry: CollectorRegistry, port: int, host: str = "0.0.0.0") -> None:
    """Serve /metrics over HTTP on `port` (0 or None: do nothing)."""
    if port:
        start_http_server(port, addr=host, registry=registry)
