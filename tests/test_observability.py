"""Traces and metrics: a real OTLP/gRPC receiver in the test collects what the three
service processes (and the CLI's SDK client) export; /metrics is scraped over HTTP."""

import json
import os
import socket
import subprocess
import sys
import threading
import time
from concurrent import futures

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

import specdec
from conftest import scrape
from specdec import telemetry


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace endpoint that keeps every span with its service name."""

    def __init__(self):
        self.lock = threading.Lock()
        self.spans = []  # (service name, span)

    def Export(self, request, context):
        with self.lock:
            for resource_spans in request.resource_spans:
                attributes = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
                for scope_spans in resource_spans.scope_spans:
                    for span in scope_spans.spans:
                        self.spans.append((attributes.get("service.name", ""), span))
        return trace_service_pb2.ExportTraceServiceResponse()

    def take(self):
        with self.lock:
            spans, self.spans = self.spans, []
        return spans


@pytest.fixture(scope="module")
def receiver():
    servicer = Receiver()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    servicer.endpoint = f"http://127.0.0.1:{port}"
    yield servicer
    server.stop(0)


def consecutive_free_ports(count=3):
    for _ in range(50):
        sockets = []
        try:
            first = socket.socket()
            first.bind(("127.0.0.1", 0))
            sockets.append(first)
            base = first.getsockname()[1]
            for offset in range(1, count):
                extra = socket.socket()
                extra.bind(("127.0.0.1", base + offset))
                sockets.append(extra)
            return base
        except OSError:
            continue
        finally:
            for s in sockets:
                s.close()
    raise RuntimeError("no run of free ports")


def otel_env(receiver):
    return {
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
        "OTEL_EXPORTER_OTLP_INSECURE": "true",
        "OTEL_TRACES_SAMPLER": "always_on",
        "OTEL_BSP_SCHEDULE_DELAY": "50",
    }


@pytest.fixture(scope="module")
def traced_stack(redis_url, tiny_models, receiver):
    from conftest import start_stack

    stack = start_stack(
        redis_url, tiny_models.target, tiny_models.draft, quiet=True,
        env=otel_env(receiver), metrics_port_base=consecutive_free_ports(),
    )  # fmt: skip
    yield stack
    stack.stop()


def collect(receiver, predicate, timeout_s=15.0, settle_s=0.5):
    """Spans received until `predicate(spans)` holds and nothing new arrived for settle_s."""
    spans, deadline, quiet_since = [], time.monotonic() + timeout_s, time.monotonic()
    while time.monotonic() < deadline:
        new = receiver.take()
        if new:
            spans += new
            quiet_since = time.monotonic()
        elif predicate(spans) and time.monotonic() - quiet_since > settle_s:
            break
        time.sleep(0.05)
    return spans


def attr(span, key):
    for a in span.attributes:
        if a.key == key:
            v = a.value
            return {"int_value": v.int_value, "bool_value": v.bool_value, "string_value": v.string_value,
                    "double_value": v.double_value}[v.WhichOneof("value")]  # fmt: skip
    return None


def test_one_generate_is_one_trace_across_client_coordinator_draft_and_target(traced_stack, receiver):
    time.sleep(0.5)
    receiver.take()  # drop start-up spans (ModelInfo calls)
    env = dict(os.environ, **otel_env(receiver), OTEL_SERVICE_NAME="specdec-cli")
    out = subprocess.run(
        [sys.executable, "-m", "specdec.cli", "trace", "hello world", "--json", "--address", traced_stack.address,
         "--max-new-tokens", "20", "--k", "3"],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    stats = result["stats"]

    def complete(spans):
        names = [s.name for _, s in spans]
        return telemetry.GENERATE_SPAN in names and names.count(telemetry.CYCLE_SPAN) >= stats["cycles"]

    spans = collect(receiver, complete)
    assert {s.trace_id for _, s in spans} == {spans[0][1].trace_id}, "spans of one request in several traces"
    services = {service for service, _ in spans}
    assert {"specdec-cli", "specdec-coordinator", "specdec-draft", "specdec-target"} <= services

    by_id = {s.span_id: s for _, s in spans}
    generate = [s for _, s in spans if s.name == telemetry.GENERATE_SPAN]
    cycles = [s for _, s in spans if s.name == telemetry.CYCLE_SPAN]
    assert len(generate) == 1 and attr(generate[0], "specdec.session_id") == result["session_id"]
    assert attr(generate[0], "specdec.output_tokens") == len(result["token_ids"])
    assert len(cycles) == stats["cycles"] == len(result["cycles"])
    assert sum(c["tokens"] for c in result["cycles"]) == len(result["token_ids"])  # each cycle's own output
    assert sorted(attr(c, "specdec.cycle") for c in cycles) == list(range(stats["cycles"]))
    assert sum(attr(c, "specdec.accepted") for c in cycles) == stats["accepted_tokens"]
    assert all(c.parent_span_id == generate[0].span_id for c in cycles)

    def ancestors(span):
        while span.parent_span_id in by_id:
            span = by_id[span.parent_span_id]
            yield span

    server_spans = [(svc, s) for svc, s in spans if svc in ("specdec-draft", "specdec-target") and s.kind == s.SPAN_KIND_SERVER]
    assert {svc for svc, _ in server_spans} == {"specdec-draft", "specdec-target"}
    for service, span in server_spans:
        if "Release" in span.name:
            continue
        assert any(a.name == telemetry.CYCLE_SPAN for a in ancestors(span)), f"{service} {span.name} outside a cycle"
    proposes = [s for _, s in spans if s.name == telemetry.PROPOSE_SPAN]
    assert sum(len(p.events) for p in proposes) == stats["draft_tokens"], "one event per streamed draft token"
    # Each Propose call's gRPC span is under its specdec.draft.call span, which is under the cycle
    # that started the call and names the cycle it drafts for; the propose span of the cycle that
    # took its drafts links to it. The gRPC span used to hang from the starting cycle itself,
    # with nothing saying which cycle's drafts a pipelined call made.
    calls = {s.span_id: s for _, s in spans if s.name == telemetry.DRAFT_CALL_SPAN}
    cycle_of = {c.span_id: attr(c, "specdec.cycle") for c in cycles}
    clients = [s for svc, s in spans if svc == "specdec-coordinator" and s.name.endswith("/Propose")]
    assert clients and all(c.parent_span_id in calls for c in clients)
    assert all(cycle_of[call.parent_span_id] <= attr(call, "specdec.cycle") for call in calls.values())
    assert any(cycle_of[call.parent_span_id] < attr(call, "specdec.cycle") for call in calls.values()), "pipelined"
    for propose in proposes:
        [link] = propose.links
        assert attr(calls[link.span_id], "specdec.cycle") == cycle_of[propose.parent_span_id]
    verifies = [s for _, s in spans if s.name == telemetry.VERIFY_SPAN]
    assert all(attr(v, "specdec.forward_ms") > 0 for v in verifies)
    # The target's own span of each Verify says how many sessions its pass verified: one request, one.
    served = [s for svc, s in server_spans if svc == "specdec-target" and "Verify" in s.name]
    assert served and all(attr(s, "specdec.batch") == 1 for s in served)
    # Redis commands (session create and the fenced commits) are spans of the coordinator.
    redis_spans = [s for svc, s in spans if svc == "specdec-coordinator" and attr(s, "db.system") == "redis"]
    assert len(redis_spans) >= stats["cycles"]


def test_metrics_counters_equal_the_statistics_the_sdk_returned(traced_stack):
    ports = traced_stack.metrics_ports
    before = scrape(ports["coordinator"])
    results = []
    with specdec.Client(traced_stack.address) as client:
        for k, n in ((1, 10), (3, 17), (5, 25)):
            results.append(client.generate("hello world", max_new_tokens=n, num_speculative_tokens=k, ignore_eos=True))
        # Tokens a cycle commits past a stop string are not output, so not counted as generated.
        stopped = [client.generate("hello world", max_new_tokens=25, num_speculative_tokens=5, ignore_eos=True,
                                   stop=[results[-1].text[start : start + 2]])
                   for start in range(1, len(results[-1].text) - 2)]  # fmt: skip
    after = scrape(ports["coordinator"])
    every = results + stopped
    delta = lambda name, **labels: after.get((name, tuple(sorted(labels.items()))), 0) - before.get(
        (name, tuple(sorted(labels.items()))), 0
    )
    drafts = delta("specdec:spec_decode_num_drafts_total")
    accepted = delta("specdec:spec_decode_num_accepted_tokens_total")
    assert drafts == sum(r.stats.draft_cycles for r in every)
    assert delta("specdec:spec_decode_num_draft_tokens_total") == sum(r.stats.draft_tokens for r in every)
    assert accepted == sum(r.stats.accepted_tokens for r in every)
    per_pos = [sum(r.stats.accepted_per_position[i] for r in every if i < len(r.stats.accepted_per_position))
               for i in range(5)]  # fmt: skip
    assert [delta("specdec:spec_decode_num_accepted_tokens_per_pos_total", position=str(i)) for i in range(5)] == per_pos
    assert delta("specdec:request_success_total", finished_reason="length") == 3
    assert delta("specdec:request_success_total", finished_reason="stop") == len(stopped)
    assert delta("specdec:generation_tokens_total") == 10 + 17 + 25 + sum(len(r.token_ids) for r in stopped)
    assert delta("specdec:time_to_first_token_seconds_count") == 3 + len(stopped)
    assert delta("specdec:e2e_request_latency_seconds_count") == 3 + len(stopped)
    assert after[("specdec:num_requests_running", ())] == 0
    # Mean acceptance length as vLLM defines it, from the counters and from the SDK.
    single = results[-1].stats
    assert single.mean_accepted_length == pytest.approx(1 + single.accepted_tokens / single.draft_cycles)
    assert 1 + accepted / drafts == pytest.approx(
        1 + sum(r.stats.accepted_tokens for r in every) / sum(r.stats.draft_cycles for r in every)
    )
    # The model services: a forward-latency histogram per step, sessions released afterwards.
    draft, target = scrape(ports["draft"]), scrape(ports["target"])
    assert draft[("specdec:forward_latency_seconds_count", (("service", "draft"),))] >= sum(
        r.stats.draft_tokens for r in every
    )
    assert target[("specdec:forward_latency_seconds_count", (("service", "target"),))] >= sum(
        r.stats.cycles for r in every
    )
    assert target[("specdec:sessions_held", (("service", "target"),))] == 0
    assert ("specdec:cache_evictions_total", (("service", "draft"),)) in draft


def test_a_long_prompt_is_prefilled_in_chunks_by_both_model_services_and_the_output_is_the_targets_own(
    traced_stack, tiny_models
):
    """A prompt of 2 * PREFILL_CHUNK + 100 tokens: each model service feeds it in two chunks
    before its call's own pass (counted in specdec:prefill_chunks_total), and the greedy
    tokens are still the target's own greedy decoding."""
    import torch

    from specdec.kvcache import PREFILL_CHUNK
    from specdec.models import load_model

    vocab = tiny_models.tokenizer.vocab_size
    prompt = torch.randint(4, vocab, (2 * PREFILL_CHUNK + 100,), generator=torch.Generator().manual_seed(8)).tolist()
    target = load_model(tiny_models.target).model
    with torch.inference_mode():
        expected = target.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                   do_sample=False, max_new_tokens=12)[0, len(prompt) :].tolist()  # fmt: skip
    ports = traced_stack.metrics_ports
    chunks = lambda name: scrape(ports[name]).get(("specdec:prefill_chunks_total", (("service", name),)), 0)
    before = {name: chunks(name) for name in ("draft", "target")}
    with specdec.Client(traced_stack.address) as client:
        result = client.generate(prompt_token_ids=prompt, max_new_tokens=12, num_speculative_tokens=3)
    assert result.token_ids == expected[: len(result.token_ids)] and result.stats.draft_tokens > 0
    assert {name: chunks(name) - before[name] for name in before} == {"draft": 2, "target": 2}


def test_a_prompt_that_begins_as_a_finished_sessions_context_is_copied_from_its_cache_and_the_output_is_the_targets_own(
    traced_stack, tiny_models
):
    """A chat's next turn: a session of PREFILL_CHUNK + 60 tokens finishes, and a new one's
    prompt is that prompt, its output and 40 tokens more. Both model services copy the new
    prompt's first tokens from the finished session's cache (prefix reuse; Release keeps it),
    so it needs no prefill chunk where it used to need one, and its greedy tokens are still the
    target's own greedy decoding."""
    import torch

    from specdec.kvcache import PREFILL_CHUNK
    from specdec.models import load_model

    vocab = tiny_models.tokenizer.vocab_size
    first = torch.randint(4, vocab, (PREFILL_CHUNK + 60,), generator=torch.Generator().manual_seed(9)).tolist()
    ports = traced_stack.metrics_ports
    count = lambda name, metric: scrape(ports[name]).get((metric, (("service", name),)), 0)
    with specdec.Client(traced_stack.address) as client:
        earlier = client.generate(prompt_token_ids=first, max_new_tokens=12, num_speculative_tokens=3).token_ids
        prompt = first + earlier + torch.randint(4, vocab, (40,), generator=torch.Generator().manual_seed(10)).tolist()
        deadline = time.monotonic() + 10
        while any(count(name, "specdec:sessions_held") for name in ("draft", "target")):  # released, and retired
            assert time.monotonic() < deadline, "the finished session should be released"
            time.sleep(0.05)
        before = {name: (count(name, "specdec:prefix_reused_tokens_total"), count(name, "specdec:prefill_chunks_total"))
                  for name in ("draft", "target")}  # fmt: skip
        result = client.generate(prompt_token_ids=prompt, max_new_tokens=12, num_speculative_tokens=3)
    target = load_model(tiny_models.target).model
    with torch.inference_mode():
        expected = target.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                   do_sample=False, max_new_tokens=12)[0, len(prompt) :].tolist()  # fmt: skip
    assert result.token_ids == expected[: len(result.token_ids)] and result.stats.draft_tokens > 0
    for name, (reused, chunks) in before.items():
        assert len(first) <= count(name, "specdec:prefix_reused_tokens_total") - reused < len(prompt) - 40, name
        assert count(name, "specdec:prefill_chunks_total") == chunks, name  # len(prompt) > PREFILL_CHUNK: one before


def test_a_request_refused_before_it_ran_is_counted_and_logged_by_its_status_not_as_a_failure(traced_stack):
    """Validation fails before a request starts running: it is not a failure of a running request
    (specdec:request_failure_total) but a refusal, counted by its status and logged with it; a
    refused Generate or Resume used to leave no line and, but for the limits, no count."""
    port = traced_stack.metrics_ports["coordinator"]
    counts = lambda: {key: scrape(port).get(key, 0) for key in (
        ("specdec:request_failure_total", (("status", "INVALID_ARGUMENT"),)),
        ("specdec:requests_refused_total", (("reason", "invalid_argument"),)),
        ("specdec:requests_refused_total", (("reason", "not_found"),)),
    )}  # fmt: skip
    before = counts()
    with specdec.Client(traced_stack.address) as client:
        with pytest.raises(specdec.SpecdecClientError):
            client.generate("hello", temperature=-1.0, session_id="refused-1")
        with pytest.raises(specdec.SpecdecClientError):
            client.resume("never-made-1")
    assert [after - before[key] for key, after in counts().items()] == [0, 1, 1]
    line = logged_line(traced_stack, "refused-1")
    assert "request of session 'refused-1': refused INVALID_ARGUMENT: " in line and "temperature" in line
    line = logged_line(traced_stack, "never-made-1")
    assert "resume of session 'never-made-1': refused NOT_FOUND: session 'never-made-1' does not exist" in line


def logged_line(stack, session_id: str, says: str = "") -> str:
    """The coordinator's latest log line about `session_id` that holds `says`, once written."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        lines = stack.log_tail("coordinator").splitlines()
        if found := [line for line in lines if f"session {session_id!r}" in line and says in line]:
            return found[-1]
        time.sleep(0.1)
    raise AssertionError(f"no log line of {session_id} saying {says!r}: {stack.log_tail('coordinator')}")


def test_a_resume_of_a_finished_session_is_logged_too(traced_stack):
    """Resume of a finished session only sends what the client lacks; it used to leave no line."""
    with specdec.Client(traced_stack.address) as client:
        done = client.generate("hello", max_new_tokens=5, ignore_eos=True, session_id="resumed-done")
        again = client.resume("resumed-done", received_tokens=2)
    assert again.token_ids == done.token_ids[2:]
    line = logged_line(traced_stack, "resumed-done", "resume of session")
    assert "resume of session 'resumed-done': already finished (length): sent what the client lacked; " in line
    assert "5 output tokens" in line


def test_a_request_past_its_deadline_is_counted_and_logged_as_deadline_exceeded_not_cancelled(traced_stack):
    """The call's deadline ends the stream as a client's cancel does (the handler is cancelled);
    it used to be counted and logged as CANCELLED."""
    port = traced_stack.metrics_ports["coordinator"]
    counted = lambda: scrape(port).get(("specdec:request_failure_total", (("status", "DEADLINE_EXCEEDED"),)), 0)
    before = counted()
    with specdec.Client(traced_stack.address, retries=0) as client:
        with pytest.raises(specdec.SpecdecClientError) as failed:
            client.generate("hello", max_new_tokens=1000, ignore_eos=True, timeout=0.3, session_id="late-1")
    assert failed.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "request of session 'late-1': failed DEADLINE_EXCEEDED; " in logged_line(traced_stack, "late-1")
    assert counted() == before + 1


def test_the_coordinator_logs_one_line_per_ended_request_with_its_outcome_and_never_its_text(traced_stack):
    with specdec.Client(traced_stack.address) as client:
        done = client.generate("secret plans", max_new_tokens=5, num_speculative_tokens=3, ignore_eos=True,
                               session_id="logged-1")  # fmt: skip
        line = logged_line(traced_stack, "logged-1")
        alpha = done.stats.accepted_tokens / done.stats.draft_tokens
        assert (f"request of session 'logged-1': finished (length); {done.stats.prompt_tokens} prompt tokens, "
                f"5 output tokens, {done.stats.cycles} cycles, α {alpha:.2f}, ") in line, line  # fmt: skip
        for _ in client.generate_stream("secret plans", max_new_tokens=40, ignore_eos=True, session_id="logged-2"):
            break  # the client stops reading: the call is cancelled
        assert "request of session 'logged-2': cancelled; " in logged_line(traced_stack, "logged-2")
        rest = client.resume("logged-2")
        assert (f"resume of session 'logged-2': finished (length); {done.stats.prompt_tokens} prompt tokens, "
                f"40 output tokens, {rest.stats.cycles} cycles") in logged_line(traced_stack, "logged-2", "resume")  # fmt: skip
        assert "(the session's in all), " in logged_line(traced_stack, "logged-2", "resume")
    assert "secret plans" not in traced_stack.log_tail("coordinator")


DISABLED_CHECK = """
import os, sys
from specdec import telemetry
called = []
telemetry.make_exporters = lambda: called.append(1) or []
provider = telemetry.setup_tracing("x")
from opentelemetry import trace
print(provider is None, type(trace.get_tracer_provider()).__name__, called == [])
"""


@pytest.mark.parametrize(
    "env",
    [
        {},
        {"OTEL_SDK_DISABLED": "true", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9"},
        {"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9"},
    ],
)
def test_with_tracing_disabled_no_exporter_or_provider_is_created(env):
    clean = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    out = subprocess.run([sys.executable, "-c", DISABLED_CHECK], capture_output=True, text=True,
                         env={**clean, **env}, timeout=60)  # fmt: skip
    assert out.stdout.split() == ["True", "ProxyTracerProvider", "True"], out.stderr


def test_tracing_is_on_when_an_endpoint_is_given():
    clean = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    out = subprocess.run([sys.executable, "-c", DISABLED_CHECK], capture_output=True, text=True,
                         env={**clean, "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9"}, timeout=60)  # fmt: skip
    assert out.stdout.split() == ["False", "TracerProvider", "False"], out.stderr


def test_console_spans_go_to_stderr_so_a_commands_json_output_stays_one_document(tiny_stack):
    """OTEL_TRACES_EXPORTER=console wrote the CLI's spans to stdout, after `generate --json`'s
    result (before `trace --json`'s), and json.loads of the output failed."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    for command in ("generate", "trace"):
        out = subprocess.run([sys.executable, "-m", "specdec.cli", command, "--json", "--address", tiny_stack.address,
                              "--max-new-tokens", "4", "hello"], capture_output=True, text=True,
                             env={**clean, "OTEL_TRACES_EXPORTER": "console"}, timeout=120)  # fmt: skip
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)["token_ids"], command
        assert '"name": "/specdec.v1.Coordinator/Generate"' in out.stderr, command  # the client's span
