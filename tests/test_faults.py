"""Faults with real processes: a stalled draft (SIGSTOP), a draft or target model that computes NaN,
a draft replica whose drafts the target refuses, a client that reads nothing or vanishes, a
frozen target replica, Redis stopped, frozen, full, unable to save or a read-only replica, and
brought back, a replayed cycle, the coordinator SIGKILLed mid-request. Each test checks
the greedy output against the no-fault output token for token, and the status code
where a request must fail. Timings are printed (pytest -s) and bounded generously: the
machine running the tests may be busy."""

import asyncio
import contextlib
import os
import signal
import threading
import time

import grpc
import pytest
import redis

import specdec
from conftest import start_stack
from coordinator.cycles import DRAFT_DEADLINE_SHARE, draft_budget
from coordinator.replicas import DOWN_S, score
from specdec import serving
from specdec.errors import Aborted, WorkerWedged
from specdec.kvcache import SessionState
from specdec.redis_server import EmbeddedRedis
from specdec.session import REDIS_SOCKET_TIMEOUT_S, SessionStore, meta_key, tokens_key
from specdec.v1 import specdec_pb2 as pb
from specdec.v1 import specdec_pb2_grpc as pb_grpc

PROMPT = "hello world"
OPTIONS = dict(ignore_eos=True, num_speculative_tokens=3)
# The stack under test abandons a draft call after this long (a healthy tiny draft: ~10 ms).
DRAFT_TIMEOUT_S = 0.5
# How long the draft stays stopped; chunks must keep coming meanwhile.
DRAFT_STALL_S = 5.0
# Cycles with drafts the stalled-draft test waits to see, a second after SIGCONT, before it stops.
SPECULATED_CHUNKS_TO_SEE = 3


@pytest.fixture(scope="module")
def stack(redis_url, tiny_models):
    stack = start_stack(
        redis_url, tiny_models.target, tiny_models.draft, coordinator_args=["--draft-timeout", str(DRAFT_TIMEOUT_S)]
    )
    yield stack
    stack.stop()


@pytest.fixture(scope="module")
def own_redis():
    """A Redis of its own, so stopping it harms no other test."""
    with EmbeddedRedis() as server:
        yield server


@pytest.fixture(scope="module")
def redis_stack(own_redis, tiny_models):
    stack = start_stack(own_redis.url, tiny_models.target, tiny_models.draft)
    yield stack
    stack.stop()


def internal_stub(stack, name):
    channel = grpc.insecure_channel(f"127.0.0.1:{stack.ports[name]}")
    return {"draft": pb_grpc.DraftStub, "target": pb_grpc.TargetStub}[name](channel)


def generated(chunks) -> list[int]:
    return [t for c in chunks for t in c.token_ids]


def stream_until_failure(client, fault, *, after_chunks=3, **options):
    """Stream a request (Client.generate_stream options), call `fault()` after
    `after_chunks` chunks, and return
    (chunks received, the SpecdecClientError that ended the stream, seconds from the
    fault to that error)."""
    chunks = []
    faulted_at = None
    with pytest.raises(specdec.SpecdecClientError) as info:
        for chunk in client.generate_stream(**options):
            chunks.append(chunk)
            if len(chunks) == after_chunks:
                fault()
                faulted_at = time.monotonic()
    assert faulted_at is not None, "the request failed before the fault"
    return chunks, info.value, time.monotonic() - faulted_at


def stored_session(redis_url, session_id) -> tuple[dict, list[int]]:
    store = redis.Redis.from_url(redis_url, decode_responses=True)
    meta = store.hgetall(meta_key(session_id))
    tokens = [int(t) for t in store.lrange(tokens_key(session_id), 0, -1)]
    store.close()
    return meta, tokens


def check_stored_prefix(meta, tokens, prompt_ids, expected, streamed) -> int:
    """The session in Redis is the prompt plus a prefix of the no-fault output, at least
    what was streamed, and its bookkeeping agrees with it. Returns the tokens committed."""
    assert tokens[: len(prompt_ids)] == prompt_ids
    output = tokens[len(prompt_ids) :]
    assert len(streamed) <= len(output) < len(expected)
    assert output == expected[: len(output)], "a token was lost, duplicated or changed in Redis"
    assert int(meta["length"]) == len(tokens)
    assert int(meta["cycle"]) == int(meta["cycles"]), "cycle number and cycle count disagree"
    return len(output)


# ---------------------------------------------------------------- slow draft


def test_a_draft_call_may_take_the_draft_timeout_or_a_quarter_of_the_time_left():
    assert draft_budget(2.0, None) == 2.0
    assert draft_budget(2.0, 100.0) == 2.0
    assert draft_budget(2.0, 4.0) == pytest.approx(4.0 * DRAFT_DEADLINE_SHARE) == 1.0
    assert draft_budget(0.0, 4.0) == 1.0  # no timeout of its own: only the deadline's share
    assert draft_budget(0.0, None) is None
    assert draft_budget(2.0, -1.0) > 0  # a deadline already past still gives a valid gRPC timeout


def test_the_coordinator_commits_a_call_with_its_headers_once_its_session_exists(stack, redis_url):
    """The coordinator sends the response headers right after creating the session, before the
    first cycle. A client's retry policy (the SDK retries UNAVAILABLE) sends a call again only
    before its headers came, so a retry never finds its own session id taken. With the draft
    stopped the first cycle waits DRAFT_TIMEOUT_S for it: the headers come well before that."""
    request = pb.GenerateRequest(prompt=PROMPT, max_new_tokens=4, session_id="headers-first", ignore_eos=True,
                                 speculation=pb.SpeculationParams(num_speculative_tokens=3))  # fmt: skip
    pid = stack.processes["draft"].pid
    channel = grpc.insecure_channel(stack.address)
    os.kill(pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        call = pb_grpc.CoordinatorStub(channel).Generate(request, timeout=60)
        call.initial_metadata()
        headers_at = time.monotonic() - started
        _, stored = stored_session(redis_url, "headers-first")
        next(call)
        chunk_at = time.monotonic() - started
        rest = list(call)
    finally:
        os.kill(pid, signal.SIGCONT)
        channel.close()
    print(f"\nheaders after {headers_at * 1000:.0f} ms, the first chunk after {chunk_at * 1000:.0f} ms")
    assert stored, "the session exists when the headers arrive"
    assert headers_at + DRAFT_TIMEOUT_S / 2 < chunk_at
    assert rest[-1].finish_reason == pb.FINISH_REASON_LENGTH


def test_a_stalled_draft_is_abandoned_and_the_stream_goes_on_target_only(stack):
    """SIGSTOP the draft mid-request: every Propose call now hangs. Each cycle gives up on
    it after --draft-timeout and runs target-only, drafting backs off; after SIGCONT
    speculation resumes, and the test stops reading there (closing the stream cancels it).
    What was streamed is the no-fault greedy output's prefix (pipelining is on, so the
    speculative calls obey the same budget)."""
    # A cap the test never reaches: on CI's 2 cores ~500 tokens came target-only during the 5 s
    # stall, and the longest back-off after it is 32 cycles of up to 4 plain steps.
    options = dict(max_new_tokens=1800, **OPTIONS)
    pid = stack.processes["draft"].pid
    chunks, arrivals = [], []
    stopped_at = None
    speculated_again = 0  # chunks with drafts, a second after SIGCONT
    with specdec.Client(stack.address) as client:
        resume = threading.Timer(DRAFT_STALL_S, os.kill, (pid, signal.SIGCONT))
        try:
            with contextlib.closing(client.generate_stream(PROMPT, **options)) as stream:
                for chunk in stream:
                    chunks.append(chunk)
                    arrivals.append(time.monotonic())
                    if len(chunks) == 3:
                        os.kill(pid, signal.SIGSTOP)
                        stopped_at = time.monotonic()
                        resume.start()
                    elif stopped_at is not None and arrivals[-1] > stopped_at + DRAFT_STALL_S + 1.0:
                        speculated_again += chunk.cycle.drafted > 0
                        if speculated_again == SPECULATED_CHUNKS_TO_SEE:
                            break
        finally:
            resume.cancel()
            os.kill(pid, signal.SIGCONT)
        streamed = generated(chunks)
        assert chunks[-1].finish_reason is None, "the stream ended before speculation resumed"
        expected = client.generate(PROMPT, **{**options, "max_new_tokens": len(streamed)}).token_ids
    assert streamed == expected

    resumed_at = stopped_at + DRAFT_STALL_S
    during = [i for i, t in enumerate(arrivals) if stopped_at < t < resumed_at]
    gaps = [arrivals[i] - arrivals[i - 1] for i in during[1:]]
    print(f"\ndraft stopped {DRAFT_STALL_S:.0f} s: {len(during)} chunks meanwhile, longest gap {max(gaps):.2f} s; "
          f"{len(streamed)} tokens read")  # fmt: skip
    # The stream kept flowing while the draft was stopped; a waiting loop would show one gap.
    assert len(during) >= 10
    assert max(gaps) < DRAFT_TIMEOUT_S + 2.5 < DRAFT_STALL_S
    # Those cycles ran target-only (the first ones may use drafts that arrived before the stop).
    assert sum(chunks[i].cycle.drafted == 0 for i in during) >= len(during) - 2
    stack.wait_ready(("draft",))


def make_nan_model_dir(source: str, directory) -> str:
    """A copy of the model directory `source` with one layer's weights NaN: a broken checkpoint
    (or an fp16 overflow), whose every logit is NaN."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(source, directory)
    weights = directory / "model.safetensors"
    tensors = load_file(weights)
    tensors["model.layers.1.mlp.down_proj.weight"].fill_(float("nan"))
    save_file(tensors, weights, metadata={"format": "pt"})
    return str(directory)


def test_a_draft_model_that_computes_nan_costs_the_drafts_never_the_request(redis_url, tiny_models, tmp_path):
    """Every Propose of a broken draft fails (its logits are NaN): each such cycle runs target-only,
    so greedy requests get the target's own output and sampled ones an answer. They used to fail,
    every one, INVALID_ARGUMENT, for a draft only there to make them faster."""
    broken = make_nan_model_dir(tiny_models.target, tmp_path / "nan-draft")
    stack = start_stack(redis_url, tiny_models.target, broken, quiet=True)
    try:
        with specdec.Client(stack.address) as client:
            greedy = client.generate(PROMPT, max_new_tokens=24, **OPTIONS)
            assert greedy.token_ids == client.generate(PROMPT, max_new_tokens=24, speculate=False, ignore_eos=True).token_ids
            assert greedy.stats.draft_tokens == 0 and len(greedy.token_ids) == 24
            sampled = client.generate(PROMPT, max_new_tokens=24, temperature=1.0, seed=7, **OPTIONS)
            assert len(sampled.token_ids) == 24 and sampled.stats.draft_tokens == 0
        assert "draft failed or too slow (INTERNAL: logits contain NaN or +inf" in stack.log_tail("coordinator")
    finally:
        stack.stop()


def test_a_target_model_that_computes_nan_fails_requests_internal_saying_so_not_invalid_argument(
    redis_url, tiny_models, tmp_path
):
    broken = make_nan_model_dir(tiny_models.target, tmp_path / "nan-target")
    stack = start_stack(redis_url, broken, tiny_models.draft, quiet=True)
    try:
        with specdec.Client(stack.address) as client:
            for options in (dict(OPTIONS), dict(speculate=False)):
                with pytest.raises(specdec.SpecdecClientError) as failed:
                    client.generate(PROMPT, max_new_tokens=8, **options)
                assert failed.value.code == grpc.StatusCode.INTERNAL, failed.value
                assert "logits contain NaN or +inf (from a model: broken weights" in str(failed.value)
        assert "logits contain NaN or +inf" in stack.log_tail("target")  # the target's own log says so
    finally:
        stack.stop()


class DraftSendingNoDistribution(pb_grpc.DraftServicer):
    """A draft replica that speaks the protocol but sends each draft with a q summing to 0.5 (a
    draft's bug, or a draft of another version whose q this target does not read); ModelInfo is
    the real draft's, so a coordinator takes it for that draft."""

    def __init__(self, info: pb.ModelInfoResponse):
        self.info = info
        self.proposed = 0

    def Propose(self, request, context):
        for index in range(request.k):
            self.proposed += 1
            yield pb.DraftToken(token_id=5, index=index, sparse=pb.SparseProbs(ids=[5], probs=[0.5]))

    def ModelInfo(self, request, context):
        return self.info

    def Release(self, request, context):
        return pb.ReleaseResponse(released=True)


def test_drafts_the_target_refuses_cost_the_cycle_its_drafts_never_the_request(stack):
    """Each Verify carrying such drafts is refused INVALID_ARGUMENT ("q ... sums to 0.5"): the
    coordinator verifies that cycle again without them and goes on, so the output is the
    target's own. Every such request used to fail INVALID_ARGUMENT."""
    from concurrent import futures

    from conftest import internal_stub

    info = internal_stub(stack, "draft").ModelInfo(pb.ModelInfoRequest())
    bad_draft = DraftSendingNoDistribution(info)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_DraftServicer_to_server(bad_draft, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        address = stack.add_coordinator("bad-drafts", "--draft-address", f"127.0.0.1:{port}")
        with specdec.Client(address) as bad, specdec.Client(stack.address) as good:
            for options in (dict(OPTIONS), dict(OPTIONS, temperature=1.0, seed=3)):
                result = bad.generate(PROMPT, max_new_tokens=20, **options)
                assert len(result.token_ids) == 20 and result.stats.draft_tokens == 0
            expected = good.generate(PROMPT, max_new_tokens=20, **OPTIONS).token_ids
            assert bad.generate(PROMPT, max_new_tokens=20, **OPTIONS).token_ids == expected
        assert bad_draft.proposed > 0, "the coordinator never asked the bad draft"
    finally:
        if (coordinator := stack.processes.pop("bad-drafts", None)) is not None:
            coordinator.terminate()
            coordinator.wait(timeout=30)
        server.stop(0)


# ---------------------------------------------------------------- a client that reads nothing, a frozen target


def test_a_client_that_reads_nothing_frees_its_place_after_the_stall_timeout_and_resumes_with_the_same_tokens(stack):
    """A client whose flow-control window is full (it reads nothing) stops the coordinator's
    writes; after --stall-timeout its stream ends UNAVAILABLE, which frees the coordinator's only
    place for another request, and the client, reading again, gets what was sent, the status,
    and by Resume the rest: together an unbroken run's tokens and text."""
    address = stack.add_coordinator("stalls", "--stall-timeout", "1", "--max-concurrent-requests", "1")
    options = dict(prompt=PROMPT, max_new_tokens=300, **OPTIONS)
    # About 1 kB of window and no growing it: a dozen chunks, then the coordinator's writes wait.
    small_window = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024)]
    with grpc.insecure_channel(address, options=small_window) as channel, specdec.Client(address) as client:
        request = specdec.client.build_request(
            PROMPT, prompt_token_ids=None, max_new_tokens=300, temperature=0.0, top_k=0, top_p=1.0, seed=None,
            num_speculative_tokens=3, speculate=True, stop=None, session_id="reads-nothing", ignore_eos=True,
        )  # fmt: skip; the request client.generate(**options) sends
        call = pb_grpc.CoordinatorStub(channel).Generate(request)
        call.initial_metadata()  # its headers: it holds the place, its session exists
        started, waited_s = time.monotonic(), None
        while waited_s is None and time.monotonic() - started < 30:
            try:
                client.generate(PROMPT, max_new_tokens=2)
                waited_s = time.monotonic() - started
            except specdec.SpecdecClientError as exc:
                assert exc.code == grpc.StatusCode.RESOURCE_EXHAUSTED, exc
                time.sleep(0.2)
        assert waited_s is not None, "the client that reads nothing still holds the only place after 30 s"
        received = []
        with pytest.raises(grpc.RpcError) as ended:
            for chunk in call:
                received.append(chunk)
        expected = client.generate(**options)
        tokens = [t for c in received for t in c.token_ids]
        text = "".join(c.text for c in received)
        rest = client.resume("reads-nothing", received_tokens=len(tokens), received_chars=len(text))
    print(f"\nanother request ran {waited_s:.1f} s after the stalled one began; {len(tokens)} tokens had been sent")
    assert ended.value.code() == grpc.StatusCode.UNAVAILABLE and "--stall-timeout" in ended.value.details()
    assert 0 < len(tokens) < 300
    assert tokens + rest.token_ids == expected.token_ids
    assert text + rest.text == expected.text and rest.finish_reason == "length"


def test_a_session_on_a_frozen_target_replica_goes_on_on_the_other_once_the_keepalive_ping_goes_unanswered(stack):
    """Two target replicas; the one a session hashes to is frozen (SIGSTOP: a hung host, or a
    network that leaves TCP open). Its Verify gets no answer and no error, but the coordinator's
    keepalive ping goes unanswered, the connection drops within ~15 s, and the cycle is verified
    on the other replica: the request ends well inside a 40 s deadline with the no-fault output.
    (Before, the ping came after 30 s and gRPC waited a minute for its answer: ~60 s.)"""
    first = f"127.0.0.1:{stack.ports['target']}"
    second = stack.add_replica("frozen-target", "target")
    address = stack.add_coordinator("two-targets", "--target-address", f"{first},{second}")
    on_second = [f"on-second-{i}" for i in range(40) if score(f"on-second-{i}", second) > score(f"on-second-{i}", first)]
    options = dict(max_new_tokens=30, **OPTIONS)
    frozen = stack.processes["frozen-target"]
    try:
        with specdec.Client(address, retries=0) as client:
            expected = client.generate(PROMPT, session_id=on_second[0], **options)  # served by the second
            os.kill(frozen.pid, signal.SIGSTOP)
            started = time.monotonic()
            result = client.generate(PROMPT, session_id=on_second[1], timeout=40, **options)
            took = time.monotonic() - started
    finally:
        os.kill(frozen.pid, signal.SIGCONT)
        for name in ("two-targets", "frozen-target"):
            stack.processes[name].terminate()
    print(f"\na session on a frozen target replica finished in {took:.1f} s")
    assert result.token_ids == expected.token_ids


FROZEN_CLIENT = """
import sys, grpc
from specdec.v1 import specdec_pb2 as pb, specdec_pb2_grpc as pb_grpc
call = pb_grpc.CoordinatorStub(grpc.insecure_channel(sys.argv[1])).Generate(pb.GenerateRequest(prompt="x"))
next(call)
print("streaming", flush=True)
for _ in call:
    pass
"""


# The pass timeout of the in-process targets below: far above a tiny model's pass (milliseconds).
PASS_TIMEOUT_S = 1.0


class HangingTarget:
    """A real target service (the tiny target model, real Redis, real gRPC on a loopback port,
    health and its watch as `serving.run` sets them up) run in this process, whose next pass
    hangs once `hang` is set, until `release` is: a device that hangs, which a CPU machine
    cannot make. It hangs where the pass has written its rows to the sessions' caches and not
    yet judged them (verifier.wait_for_device), so a caller that undid its work meanwhile
    leaves a cache the rest of the pass then makes disagree with its tokens.
    `wedged_touches` lists the sessions whose state a call brought while the worker was wedged
    (SessionState.brought: none may be); `refused` counts the calls refused meanwhile."""

    def __init__(self, monkeypatch, model: str, redis_url: str):
        import target_service.verifier
        from target_service.server import TargetConfig, TargetServicer

        self.hang, self.release = threading.Event(), threading.Event()
        self.wedged_touches: list[str] = []
        wait_for_device, brought = target_service.verifier.wait_for_device, SessionState.brought

        def hanging(logits):
            if self.hang.is_set():
                self.hang.clear()
                self.release.wait(60)
            return wait_for_device(logits)

        def bringing(state, *args):
            if self.servicer.worker.wedged() is not None:
                self.wedged_touches.append(state.session_id)
            return brought(state, *args)

        monkeypatch.setattr(target_service.verifier, "wait_for_device", hanging)
        monkeypatch.setattr(SessionState, "brought", bringing)
        config = TargetConfig(model=model, pass_timeout_s=PASS_TIMEOUT_S, allow_unauthenticated=True)
        self.servicer = TargetServicer(config, SessionStore(redis_url))
        self.refused = 0  # calls refused for the wedged worker
        ready = self.servicer.ready

        def counting_ready():
            try:
                return ready()
            except WorkerWedged:
                self.refused += 1
                raise

        self.servicer.ready = counting_ready

    async def start(self) -> int:
        """Load and serve; returns the port."""
        from grpc_health.v1 import health, health_pb2, health_pb2_grpc

        await self.servicer.worker.run(self.servicer.load)
        self.servicer.watch_passes()
        self.server = serving.create_server()
        health_servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, self.server)
        serving.add_service(self.server, serving.TARGET_SERVICE, self.servicer)
        port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        names = [serving.TARGET_SERVICE]
        await serving.set_health(health_servicer, names, health_pb2.HealthCheckResponse.SERVING)
        self.watching = asyncio.create_task(serving.watch_health("target", health_servicer, names,
                                                                 self.servicer.worker.wedged, every_s=0.05))  # fmt: skip
        return port

    async def stop(self) -> None:
        self.release.set()
        self.watching.cancel()
        await self.server.stop(0)
        self.servicer.worker.shutdown()
        await self.servicer.store.close()

    def caches_disagreeing(self) -> list[str]:
        """The sessions held (or kept for reuse) whose cache layers do not each cover exactly
        their held tokens."""
        pool = self.servicer.pool
        return [state.session_id for state in (*pool.sessions.values(), *pool.retired.values())
                if any(layer.get_seq_length() != len(state.held) for layer in state.cache.layers)]  # fmt: skip

    def running_pass_s(self) -> float:
        return self.servicer.metrics.registry.get_sample_value("specdec:running_pass_seconds", {"service": "target"})


def test_a_target_whose_pass_hangs_refuses_calls_unavailable_and_says_not_serving_until_the_pass_ends(
    stack, redis_url, tiny_models, monkeypatch
):
    """A target whose device hangs in a pass (HangingTarget): the call in that pass, and one for
    the same session waiting behind it, end UNAVAILABLE "wedged" once the pass has run
    --pass-timeout (they waited for ever: a Verify has no timeout of its own when the request
    has no deadline, and a hung device answers the keepalive pings), the one waiting never
    touching the session's state, which the hung pass may still write; every other call is
    refused at once meanwhile, and the gRPC health says NOT_SERVING (a Release, which needs no
    pass, is still answered). Once the pass ends it serves again: the hung session's next
    Verify gets the verdict a healthy target gives."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from conftest import internal_stub

    hung_target = HangingTarget(monkeypatch, tiny_models.target, redis_url)
    with specdec.Client(stack.address) as client:
        for session_id in ("hung-a", "hung-b"):
            client.generate(PROMPT, max_new_tokens=2, session_id=session_id)
    prompt = tiny_models.tokenizer.encode(PROMPT)

    def verify(session_id):
        return pb.VerifyRequest(session_id=session_id, position=0, new_tokens=prompt,
                                sampling=pb.SamplingParams(temperature=0.0, seed=1))  # fmt: skip

    healthy = internal_stub(stack, "target").Verify(verify("hung-b"), timeout=10)
    SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING

    async def status_becomes(checks, status):
        for _ in range(100):
            reply = await checks.Check(health_pb2.HealthCheckRequest(service=serving.TARGET_SERVICE), timeout=5)
            if reply.status == status:
                return True
            await asyncio.sleep(0.05)
        return False

    async def run():
        port = await hung_target.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                target, checks = pb_grpc.TargetStub(channel), health_pb2_grpc.HealthStub(channel)
                await target.Verify(verify("hung-a"), timeout=30)  # the session held here
                hung_target.hang.set()
                started = time.monotonic()
                hung = asyncio.ensure_future(target.Verify(verify("hung-b"), timeout=30))
                await asyncio.sleep(0.2)
                behind = asyncio.ensure_future(target.Verify(verify("hung-b"), timeout=30))  # waits for its lock
                outcome = await asyncio.gather(hung, behind, return_exceptions=True)
                waited = time.monotonic() - started
                not_serving = await status_becomes(checks, NOT_SERVING)
                running_pass = hung_target.running_pass_s()
                refused_at = time.monotonic()
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await target.Verify(verify("hung-a"), timeout=30)
                refused_in = time.monotonic() - refused_at
                released = await target.Release(pb.ReleaseRequest(session_id="hung-a"), timeout=5)
                hung_target.release.set()
                serving_again = await status_becomes(checks, SERVING)
                disagreeing = hung_target.caches_disagreeing()
                after = await target.Verify(verify("hung-b"), timeout=30)
                return (outcome, waited, not_serving, running_pass, hung_target.running_pass_s(), refused.value,
                        refused_in, released, serving_again, disagreeing, after)  # fmt: skip
        finally:
            await hung_target.stop()

    (outcome, waited, not_serving, running_pass, idle_pass, refused, refused_in, released, serving_again,
     disagreeing, after) = asyncio.run(run())  # fmt: skip
    print(f"wedged calls ended after {waited:.2f} s; a call meanwhile refused in {refused_in * 1000:.1f} ms")
    for failed in outcome:
        assert isinstance(failed, grpc.aio.AioRpcError), failed
        assert failed.code() == grpc.StatusCode.UNAVAILABLE and "model worker is wedged" in failed.details()
    assert PASS_TIMEOUT_S <= waited < PASS_TIMEOUT_S + 5
    assert not_serving, "health said SERVING while a pass hung"
    assert running_pass >= PASS_TIMEOUT_S and idle_pass == 0, (running_pass, idle_pass)  # /metrics shows it
    assert refused.code() == grpc.StatusCode.UNAVAILABLE and "--pass-timeout 1 s" in refused.details()
    assert refused_in < 1.0
    assert released.released, "a Release is answered while the worker is wedged (it needs no pass)"
    assert serving_again, "health stayed NOT_SERVING after the pass ended"
    assert hung_target.wedged_touches == []
    assert disagreeing == [], "a state the hung pass wrote after its caller undid its work was kept"
    assert (after.num_accepted, after.next_token, after.bonus) == (healthy.num_accepted, healthy.next_token, healthy.bonus)


def test_a_session_on_a_target_replica_whose_pass_hangs_goes_on_on_the_other_with_the_same_tokens(
    stack, redis_url, tiny_models, monkeypatch
):
    """Two target replicas behind a coordinator, one of them a HangingTarget; a session it
    serves has its next pass hang: after --pass-timeout its Verify ends UNAVAILABLE, the
    coordinator takes the replica for lost and verifies the cycle on the other, and the request,
    which has no deadline, ends with the no-fault output. Before, it waited as long as the pass.
    Past the replica's down time, while its pass still hangs, its health says NOT_SERVING and
    the coordinator leaves it be: a session it would serve is not refused there first."""
    hung_target = HangingTarget(monkeypatch, tiny_models.target, redis_url)
    loop = asyncio.new_event_loop()
    serving_thread = threading.Thread(target=loop.run_forever, daemon=True)
    serving_thread.start()
    port = asyncio.run_coroutine_threadsafe(hung_target.start(), loop).result(120)
    first, second = f"127.0.0.1:{stack.ports['target']}", f"127.0.0.1:{port}"
    on_second = [f"hangs-{i}" for i in range(40) if score(f"hangs-{i}", second) > score(f"hangs-{i}", first)]
    options = dict(max_new_tokens=30, **OPTIONS)
    try:
        address = stack.add_coordinator("beside-hung", "--target-address", f"{first},{second}")
        with specdec.Client(stack.address) as client:
            expected = client.generate(PROMPT, session_id=on_second[0], **options)  # one target, no fault
        with specdec.Client(address, retries=0) as client:
            hung_target.hang.set()
            started = time.monotonic()
            result = client.generate(PROMPT, session_id=on_second[1], **options)
            took = time.monotonic() - started
            refused = hung_target.refused
            time.sleep(DOWN_S + 1)  # the replica's down time over: its channel connects, its pass still hangs
            later = client.generate(PROMPT, session_id=on_second[2], **options)
            refused_later = hung_target.refused - refused
    finally:
        asyncio.run_coroutine_threadsafe(hung_target.stop(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        serving_thread.join(10)
        stack.processes["beside-hung"].terminate()
    print(f"\na session whose target replica's pass hung finished in {took:.1f} s")
    assert not hung_target.hang.is_set(), "the session's pass never reached the hanging replica"
    assert result.token_ids == expected.token_ids == later.token_ids
    assert PASS_TIMEOUT_S <= took < PASS_TIMEOUT_S + 20
    assert refused_later == 0, "the coordinator called the replica again while its health said NOT_SERVING"
    assert hung_target.wedged_touches == []


def test_a_client_that_vanishes_mid_stream_has_its_call_cancelled_once_the_servers_keepalive_ping_goes_unanswered():
    """A client process frozen mid-stream (SIGSTOP: a laptop closed, a network cut that leaves
    TCP open) reads nothing and answers nothing. specdec's servers (serving.create_server) ping
    it during the call, and drop the connection when the ping goes unanswered: the handler is
    cancelled within ~15 s, which in a coordinator stops the request's generation and frees its
    place. (Before, a stream of small chunks went on until the kernel's buffers filled.)"""
    import subprocess
    import sys

    from specdec.serving import create_server

    async def run() -> float:
        cancelled = asyncio.Event()

        class Endless(pb_grpc.CoordinatorServicer):
            async def Generate(self, request, context):
                try:
                    while True:
                        yield pb.GenerateChunk(text="x")
                        await asyncio.sleep(0.05)
                except BaseException:
                    cancelled.set()
                    raise

        server = create_server()
        pb_grpc.add_CoordinatorServicer_to_server(Endless(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        client = subprocess.Popen([sys.executable, "-c", FROZEN_CLIENT, f"127.0.0.1:{port}"], stdout=subprocess.PIPE)
        try:
            assert await asyncio.to_thread(client.stdout.readline) == b"streaming\n"
            os.kill(client.pid, signal.SIGSTOP)
            frozen_at = time.monotonic()
            await asyncio.wait_for(cancelled.wait(), 60)
            return time.monotonic() - frozen_at
        finally:
            client.kill()
            client.wait()
            await server.stop(0)

    took = asyncio.run(run())
    print(f"\nthe frozen client's call was cancelled {took:.1f} s after the freeze")


# ---------------------------------------------------------------- Redis


def test_with_redis_down_a_request_fails_fast_with_unavailable_and_recovers_when_redis_returns(
    redis_stack, own_redis
):
    options = dict(max_new_tokens=30, **OPTIONS)
    pids = {name: p.pid for name, p in redis_stack.processes.items()}
    with specdec.Client(redis_stack.address) as client:
        expected = client.generate(PROMPT, **options).token_ids
        own_redis.stop()
        try:
            started = time.monotonic()
            with pytest.raises(specdec.SpecdecClientError) as info:
                client.generate(PROMPT, **options)
            failed_in = time.monotonic() - started
        finally:
            own_redis.start()  # same port, empty
        print(f"\nRedis down: Generate failed in {failed_in * 1000:.0f} ms: {info.value}")
        assert info.value.code == grpc.StatusCode.UNAVAILABLE and "Redis" in info.value.message
        assert failed_in < 10.0
        # Served again with no service restarted.
        assert client.generate(PROMPT, **options).token_ids == expected
    assert {name: p.pid for name, p in redis_stack.processes.items()} == pids


def test_redis_lost_mid_request_fails_the_stream_with_unavailable_and_later_requests_succeed(
    redis_stack, own_redis
):
    """Redis stops while a request streams: the next commit fails, the client gets
    UNAVAILABLE (not INTERNAL, not a hang). Redis comes back empty; a new request, even
    one reusing the session id whose KV caches the model services may still hold, gets
    the no-fault output."""
    with specdec.Client(redis_stack.address, retries=0) as client:  # the failure is under test: no Resume
        expected = client.generate(PROMPT, max_new_tokens=200, **OPTIONS).token_ids
        try:
            chunks, error, failed_in = stream_until_failure(
                client, own_redis.stop, prompt=PROMPT, max_new_tokens=1500, session_id="redis-lost", **OPTIONS
            )
        finally:
            own_redis.start()
        print(f"\nRedis stopped mid-request: stream failed {failed_in * 1000:.0f} ms later: {error}")
        assert error.code == grpc.StatusCode.UNAVAILABLE and "Redis" in error.message
        assert failed_in < 10.0
        streamed = generated(chunks)
        assert streamed == expected[: len(streamed)]
        again = client.generate(PROMPT, max_new_tokens=200, session_id="redis-lost", **OPTIONS)
        assert again.token_ids == expected


def refused_then_resumed(client, refuse, allow, session_id, while_refused=lambda: None):
    """Stream a 400-token session and call `refuse()`, which makes Redis refuse writes, after 3
    chunks; ask for a new request and call `while_refused()`; `allow()`; resume the session and
    check that what was streamed and what the Resume sent make an unbroken run. Returns (the
    error that ended the stream, the new request's, while_refused's result, tokens streamed)."""
    options = dict(prompt=PROMPT, max_new_tokens=400, **OPTIONS)
    expected = client.generate(**options)
    try:
        chunks, error, _ = stream_until_failure(client, refuse, session_id=session_id, **options)
        with pytest.raises(specdec.SpecdecClientError) as refused:
            client.generate(PROMPT, max_new_tokens=5, **OPTIONS)
        result = while_refused()
    finally:
        allow()
    tokens, text = generated(chunks), "".join(c.text for c in chunks)
    rest = client.resume(session_id, received_tokens=len(tokens), received_chars=len(text))
    assert tokens + rest.token_ids == expected.token_ids and text + rest.text == expected.text
    return error, refused.value, result, len(tokens)


def test_a_full_redis_refuses_sessions_and_tokens_resource_exhausted_and_the_session_resumes_once_room_is_made(
    redis_stack, own_redis
):
    """Redis at its maxmemory with policy noeviction (as the k8s manifests run it) refuses writes:
    the stream whose commit it refuses ends RESOURCE_EXHAUSTED saying the store is full, and so
    does a new request (not INTERNAL with a traceback); a Delete, which frees room, still works.
    Once there is room the session resumes to an unbroken run's tokens and text."""
    db = redis.Redis.from_url(own_redis.url)

    def fill_redis():  # a maxmemory below what it holds: full, whatever its buffers do meanwhile
        db.config_set("maxmemory-policy", "noeviction")
        db.config_set("maxmemory", db.info("memory")["used_memory"] // 2)

    with specdec.Client(redis_stack.address, retries=0) as client:  # the failure is under test: no Resume
        client.generate(PROMPT, max_new_tokens=5, session_id="to-delete", **OPTIONS)
        error, refused, deleted, streamed = refused_then_resumed(
            client, fill_redis, lambda: db.config_set("maxmemory", 0), "redis-full", lambda: client.delete("to-delete")
        )  # fmt: skip
    print(f"\nRedis full after {streamed} tokens: {error}")
    for failure in (error, refused):
        assert failure.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "(Redis) is full" in failure.message
    assert deleted and 0 < streamed < 400


def test_a_redis_that_cannot_save_its_snapshot_refuses_writes_unavailable_saying_so_and_the_session_resumes_after(
    redis_stack, own_redis
):
    """Redis that failed to save its RDB snapshot (a full or unwritable disk) refuses writes
    (MISCONF, stop-writes-on-bgsave-error): the stream and a new request end UNAVAILABLE saying
    so; once it may write again the session resumes to an unbroken run's tokens and text."""
    db = redis.Redis.from_url(own_redis.url)
    kept = {name: db.config_get(name)[name] for name in ("dir", "save")}

    def break_saving():  # a directory Redis cannot write, a save point, and a save that fails
        db.config_set("dir", "/proc")
        db.config_set("save", "3600 1")
        db.bgsave()
        while db.info("persistence")["rdb_bgsave_in_progress"]:
            time.sleep(0.05)
        assert db.info("persistence")["rdb_last_bgsave_status"] == "err"

    def restore():
        for name, value in kept.items():
            db.config_set(name, value)

    with specdec.Client(redis_stack.address, retries=0) as client:
        error, refused, _, streamed = refused_then_resumed(client, break_saving, restore, "redis-cannot-save")
    print(f"\nRedis unable to save after {streamed} tokens: {error}")
    for failure in (error, refused):
        assert failure.code == grpc.StatusCode.UNAVAILABLE and "could not save its snapshot" in failure.message
    assert 0 < streamed < 400


def test_a_coordinator_whose_redis_is_a_read_only_replica_refuses_a_request_unavailable_saying_so(redis_stack, own_redis):
    """A --redis-url naming a replica (or a master demoted by a failover): reads work, every
    write is refused, and a request is refused UNAVAILABLE naming the replica, not INTERNAL."""
    with EmbeddedRedis(replica_of=own_redis.port) as replica:
        address = redis_stack.add_coordinator("on-replica", "--redis-url", replica.url)
        try:
            with specdec.Client(address, retries=0) as client:
                with pytest.raises(specdec.SpecdecClientError) as refused:
                    client.generate(PROMPT, max_new_tokens=5, **OPTIONS)
        finally:
            redis_stack.processes["on-replica"].terminate()  # before its Redis goes
    assert refused.value.code == grpc.StatusCode.UNAVAILABLE and "read-only replica" in refused.value.message


def test_a_frozen_redis_fails_the_stream_with_unavailable_and_leaves_a_consistent_session(
    redis_stack, own_redis, tiny_models
):
    """SIGSTOP Redis mid-request: Redis calls time out (the store's socket timeout) and
    the client gets UNAVAILABLE. After SIGCONT Redis still holds the session: the prompt
    plus a prefix of the no-fault output, never a half-written cycle."""
    prompt_ids = tiny_models.tokenizer.encode(PROMPT)
    pid = own_redis.process.pid
    with specdec.Client(redis_stack.address, retries=0) as client:  # the failure is under test: no Resume
        expected = client.generate(prompt_token_ids=prompt_ids, max_new_tokens=200, **OPTIONS).token_ids
        try:
            chunks, error, failed_in = stream_until_failure(
                client, lambda: os.kill(pid, signal.SIGSTOP),
                prompt_token_ids=prompt_ids, max_new_tokens=1500, session_id="redis-frozen", **OPTIONS,
            )  # fmt: skip
        finally:
            os.kill(pid, signal.SIGCONT)
        print(f"\nRedis frozen mid-request: stream failed {failed_in:.1f} s later: {error}")
        assert error.code == grpc.StatusCode.UNAVAILABLE and "Redis" in error.message
        # The target's read times out, then the coordinator's check of Redis: two socket timeouts.
        assert failed_in < 2 * REDIS_SOCKET_TIMEOUT_S + 10.0
        meta, tokens = stored_session(own_redis.url, "redis-frozen")
        committed = check_stored_prefix(meta, tokens, prompt_ids, expected, generated(chunks))
        print(f"Redis holds {committed} generated tokens; the client saw {len(generated(chunks))}")
        assert client.generate(prompt_token_ids=prompt_ids, max_new_tokens=30, **OPTIONS).token_ids == expected[:30]


# ---------------------------------------------------------------- replayed cycle


def test_a_replayed_verify_gets_the_same_verdict_and_a_replayed_commit_is_refused(stack, redis_url):
    """A retry after a lost reply sends the same Verify again: the verdict is the same
    (same prefix, drafts and per-cycle random stream), even while sampling. Committing
    the same cycle twice writes its tokens once; the second commit is ABORTED."""
    with specdec.Client(stack.address) as client:
        client.generate(PROMPT, max_new_tokens=6, session_id="replayed", **OPTIONS)
    _, committed = stored_session(redis_url, "replayed")
    sampling = pb.SamplingParams(temperature=1.0, seed=7)
    draft, target = internal_stub(stack, "draft"), internal_stub(stack, "target")
    auth = stack.internal_metadata  # the internal hops require the stack's token
    verdicts = []
    for cycle in range(8):
        # The target holds (or rebuilds from Redis) all but the last committed token.
        propose = pb.ProposeRequest(
            session_id="replayed", position=0, new_tokens=committed, k=3, sampling=sampling, cycle=cycle
        )
        drafts = list(draft.Propose(propose, timeout=30, metadata=auth))
        verify = pb.VerifyRequest(
            session_id="replayed", position=len(committed) - 1, new_tokens=committed[-1:],
            drafts=drafts, sampling=sampling, cycle=cycle,
        )  # fmt: skip
        first = target.Verify(verify, timeout=30, metadata=auth)
        replay = target.Verify(verify, timeout=30, metadata=auth)
        verdict = (first.num_accepted, first.next_token, first.bonus)
        assert (replay.num_accepted, replay.next_token, replay.bonus) == verdict, f"cycle {cycle}"
        verdicts.append(verdict)
    assert len(set(verdicts)) > 1, "every cycle gave one verdict: the replay check proved nothing"

    async def commit_twice():
        store = SessionStore(redis_url)
        try:
            cycle = int((await store.meta("replayed"))["cycle"])
            await store.commit("replayed", cycle, [5, 6])
            with pytest.raises(Aborted):
                await store.commit("replayed", cycle, [5, 6])
            return await store.tokens("replayed"), int((await store.meta("replayed"))["cycle"]) - cycle
        finally:
            await store.close()

    tokens, cycles_added = asyncio.run(commit_twice())
    assert tokens == committed + [5, 6] and cycles_added == 1


# ---------------------------------------------------------------- coordinator killed


def test_a_coordinator_killed_mid_request_fails_the_stream_and_leaves_a_clean_prefix_in_redis(
    stack, redis_url, tiny_models
):
    """SIGKILL the coordinator mid-stream: the client gets UNAVAILABLE; Redis holds the
    prompt plus a prefix of the no-fault output (at least what was streamed); the
    restarted coordinator serves. The client does not resume here (retries=0; test_resume
    does): the session stays `running` until its TTL or a Resume, and a new request with
    its id is refused with ALREADY_EXISTS."""
    prompt_ids = tiny_models.tokenizer.encode(PROMPT)
    options = dict(prompt_token_ids=prompt_ids, **OPTIONS)
    with specdec.Client(stack.address, retries=0) as client:  # the failure is under test: no Resume
        expected = client.generate(max_new_tokens=200, **options).token_ids
        chunks, error, failed_in = stream_until_failure(
            client, lambda: stack.restart("coordinator", kill=True),
            max_new_tokens=1500, session_id="coordinator-killed", **options,
        )  # fmt: skip
    print(f"\ncoordinator killed: stream failed {failed_in * 1000:.0f} ms later: {error}")
    assert error.code == grpc.StatusCode.UNAVAILABLE
    meta, tokens = stored_session(redis_url, "coordinator-killed")
    committed = check_stored_prefix(meta, tokens, prompt_ids, expected, generated(chunks))
    print(f"Redis holds {committed} generated tokens; the client saw {len(generated(chunks))}")
    assert meta["status"] == "running"

    stack.wait_ready(("coordinator",))
    with specdec.Client(stack.address) as client:  # a new channel: the old one is in reconnect back-off
        assert client.generate(max_new_tokens=30, **options).token_ids == expected[:30]
        with pytest.raises(specdec.SpecdecClientError) as info:
            client.generate(max_new_tokens=30, session_id="coordinator-killed", **options)
        assert info.value.code == grpc.StatusCode.ALREADY_EXISTS
