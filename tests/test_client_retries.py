"""The SDK sends a call that failed UNAVAILABLE before it began again, and resumes (never
resends) one that broke once begun: through a real gRPC server on loopback whose Generate and
Resume fail as told."""

from __future__ import annotations

import asyncio
import time
from concurrent import futures

import grpc
import pytest

import specdec
from specdec.client import SESSION_HEADER, service_config
from specdec.v1 import specdec_pb2 as pb
from specdec.v1 import specdec_pb2_grpc as pb_grpc


class FlakyCoordinator(pb_grpc.CoordinatorServicer):
    """Generate fails `code` on its first `failures` calls, before any chunk; then streams "ab",
    failing `mid_stream_code` between the two chunks when `fail_mid_stream`, or UNAVAILABLE
    after its headers and before the first chunk when `fail_before_first_chunk`. Resume is
    NOT_FOUND for a session no Generate began; it fails UNAVAILABLE its first `resume_failures`
    calls, then streams what the client lacks of "ab"."""

    def __init__(self, failures: int, code=grpc.StatusCode.UNAVAILABLE, fail_mid_stream: bool = False,
                 mid_stream_code=grpc.StatusCode.UNAVAILABLE, resume_failures: int = 0,
                 fail_before_first_chunk: bool = False):  # fmt: skip
        self.calls, self.failures, self.code, self.fail_mid_stream = 0, failures, code, fail_mid_stream
        self.mid_stream_code, self.resume_failures = mid_stream_code, resume_failures
        self.fail_before_first_chunk = fail_before_first_chunk
        self.session_ids: list[str] = []
        self.began: set[str] = set()
        self.resumes: list[pb.ResumeRequest] = []

    def Generate(self, request, context):
        self.calls += 1
        self.session_ids.append(request.session_id)
        if self.calls <= self.failures:
            context.abort(self.code, f"failure {self.calls}")
        context.send_initial_metadata(((SESSION_HEADER, request.session_id),))  # the session exists
        self.began.add(request.session_id)
        if self.fail_before_first_chunk:
            context.abort(grpc.StatusCode.UNAVAILABLE, "lost before the first chunk")
        yield pb.GenerateChunk(text="a", token_ids=[1], session_id=request.session_id)
        if self.fail_mid_stream:
            context.abort(self.mid_stream_code, "lost mid-stream")
        yield pb.GenerateChunk(text="b", token_ids=[2], finish_reason=pb.FINISH_REASON_LENGTH)

    def Resume(self, request, context):
        self.resumes.append(request)
        if request.session_id not in self.began:
            context.abort(grpc.StatusCode.NOT_FOUND, f"no session {request.session_id!r}")
        if len(self.resumes) <= self.resume_failures:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"resume failure {len(self.resumes)}")
        context.send_initial_metadata(((SESSION_HEADER, request.session_id),))
        yield pb.GenerateChunk(text="ab"[request.received_chars :], token_ids=[1, 2][request.received_tokens :],
                               finish_reason=pb.FINISH_REASON_LENGTH, session_id=request.session_id)  # fmt: skip


@pytest.fixture
def serve():
    servers = []

    def start(servicer) -> str:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        pb_grpc.add_CoordinatorServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        servers.append(server)
        return f"127.0.0.1:{port}"

    yield start
    for server in servers:
        server.stop(0)


def generate(address: str, **client_options) -> str:
    with specdec.Client(address, **client_options) as client:
        return client.generate("x", max_new_tokens=2).text


def test_a_call_failing_unavailable_before_its_first_chunk_is_sent_again_up_to_the_retries(serve):
    flaky = FlakyCoordinator(failures=2)
    assert generate(serve(flaky)) == "ab" and flaky.calls == 3  # the default: 2 retries
    flaky = FlakyCoordinator(failures=3)
    with pytest.raises(specdec.SpecdecClientError) as failed:
        generate(serve(flaky))
    assert failed.value.code == grpc.StatusCode.UNAVAILABLE and failed.value.message == "failure 3" and flaky.calls == 3
    assert not flaky.resumes, "a call that never began has no session to resume"
    flaky = FlakyCoordinator(failures=4)
    assert generate(serve(flaky), retries=4) == "ab" and flaky.calls == 5


def test_a_call_larger_than_grpcs_default_retry_buffer_is_sent_again_too(serve):
    """gRPC keeps a call's request for a retry only up to 256 KiB unless told more: a 300 kB
    prompt that failed UNAVAILABLE before any answer was not sent again (one attempt, the
    error), where a 200 kB one was."""
    flaky = FlakyCoordinator(failures=1)
    with specdec.Client(serve(flaky)) as client:
        assert client.generate("x" * 300_000, max_new_tokens=2).text == "ab"
    assert flaky.calls == 2


def test_a_client_whose_coordinator_was_away_reaches_it_within_a_couple_of_seconds_of_its_return():
    """gRPC's default reconnect backoff grows 1.6 times a try from 1 s (tries about 1, 2.6,
    5.2, 9.3 and 15.8 s into an outage), and meanwhile every call fails fast UNAVAILABLE: a
    coordinator back after 10 s was not reached before its next try, ~4.5 s or more later.
    The SDK's channels try every 0.2-1 s, as the services' do."""
    from specdec.redis_server import free_port

    port = free_port()
    address = f"127.0.0.1:{port}"
    with specdec.Client(address, retries=0) as client:
        away_until = time.monotonic() + 10.0
        while time.monotonic() < away_until:  # the outage, with calls failing meanwhile
            with pytest.raises(specdec.SpecdecClientError):
                client.generate("x", max_new_tokens=2, timeout=5)
            time.sleep(0.5)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        pb_grpc.add_CoordinatorServicer_to_server(FlakyCoordinator(failures=0), server)
        server.add_insecure_port(address)
        server.start()
        back = time.monotonic()
        try:
            while True:
                try:
                    assert client.generate("x", max_new_tokens=2, timeout=5).text == "ab"
                    break
                except specdec.SpecdecClientError as failed:
                    assert failed.code == grpc.StatusCode.UNAVAILABLE
                    assert time.monotonic() - back < 10, "never reached"
                    time.sleep(0.1)
            reached_after_s = time.monotonic() - back
        finally:
            server.stop(0)
    assert reached_after_s < 3.0, reached_after_s


def test_a_stream_broken_after_a_chunk_is_resumed_where_it_broke_and_never_sent_again(serve):
    flaky = FlakyCoordinator(failures=0, fail_mid_stream=True)
    with specdec.Client(serve(flaky)) as client:
        chunks = [chunk.text for chunk in client.generate_stream("x", max_new_tokens=2)]
    assert chunks == ["a", "b"] and flaky.calls == 1
    [resume] = flaky.resumes
    session_id = flaky.session_ids[0]
    assert len(session_id) == 32, "the SDK names the session, so it can resume it"
    assert (resume.session_id, resume.received_tokens, resume.received_chars) == (session_id, 1, 1)
    # A resume that fails UNAVAILABLE is tried again, within the same retries.
    flaky = FlakyCoordinator(failures=0, fail_mid_stream=True, resume_failures=1)
    result = specdec.Client(serve(flaky)).generate("x", max_new_tokens=2, session_id="mine")
    assert (result.text, result.token_ids, flaky.calls, len(flaky.resumes)) == ("ab", [1, 2], 1, 2)
    assert {r.session_id for r in flaky.resumes} == {"mine"}


class SlowToBreakCoordinator(FlakyCoordinator):
    """Streams "a" (its first token at 0.05 s, the stats say), breaks UNAVAILABLE 0.3 s later; Resume
    streams "b" with statistics as a coordinator gives them: the session's 2 tokens, timed over
    the Resume call alone (0.01 s, its first chunk at once)."""

    def Generate(self, request, context):
        context.send_initial_metadata(((SESSION_HEADER, request.session_id),))
        stats = pb.GenerateStats(generated_tokens=1, elapsed_s=0.05, first_token_s=0.05)
        yield pb.GenerateChunk(text="a", token_ids=[1], session_id=request.session_id, stats=stats)
        time.sleep(0.3)
        context.abort(grpc.StatusCode.UNAVAILABLE, "lost mid-stream")

    def Resume(self, request, context):
        stats = pb.GenerateStats(generated_tokens=2, elapsed_s=0.01, first_token_s=0.0)
        yield pb.GenerateChunk(text="b", token_ids=[2], finish_reason=pb.FINISH_REASON_LENGTH,
                               session_id=request.session_id, stats=stats)  # fmt: skip


def test_a_resumed_streams_statistics_time_the_whole_stream_not_only_the_resume_call(serve):
    """The last chunk's stats used to time only the Resume call while counting the session's
    tokens: 2 tokens in 0.01 s, 200 tokens/s, for a stream that took over 0.3 s."""
    address = serve(SlowToBreakCoordinator(failures=0))
    with specdec.Client(address) as client:
        result = client.generate("x", max_new_tokens=2)
    assert result.text == "ab" and result.stats.generated_tokens == 2
    assert 0.3 <= result.stats.elapsed_s <= result.client_elapsed_s + 0.05, result.stats
    assert result.stats.first_token_s == 0.05 and result.stats.tokens_per_second <= 2 / 0.3

    async def generate_async():
        async with specdec.AsyncClient(address) as client:
            return await client.generate("x", max_new_tokens=2)

    result = asyncio.run(generate_async())
    assert result.stats.elapsed_s >= 0.3 and result.stats.first_token_s == 0.05


@pytest.mark.parametrize("retries, resume_failures, mid_stream_code, resumes, message", [
    (0, 0, grpc.StatusCode.UNAVAILABLE, 0, "lost mid-stream"),
    # Each of the SDK's 2 resumes is itself a call its channel sends up to 3 times (service_config).
    (2, 99, grpc.StatusCode.UNAVAILABLE, 6, "resume failure 6"),
    (2, 0, grpc.StatusCode.INTERNAL, 0, "lost mid-stream"),
])  # fmt: skip
def test_a_broken_stream_fails_when_it_may_not_be_resumed_or_its_resumes_fail(
    serve, retries, resume_failures, mid_stream_code, resumes, message
):
    flaky = FlakyCoordinator(failures=0, fail_mid_stream=True, mid_stream_code=mid_stream_code,
                             resume_failures=resume_failures)  # fmt: skip
    chunks = []
    with specdec.Client(serve(flaky), retries=retries) as client, pytest.raises(specdec.SpecdecClientError) as failed:
        for chunk in client.generate_stream("x", max_new_tokens=2):
            chunks.append(chunk.text)
    assert chunks == ["a"] and failed.value.message == message and flaky.calls == 1 and len(flaky.resumes) == resumes


@pytest.mark.parametrize("code", [grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
                                  grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.UNAUTHENTICATED])  # fmt: skip
def test_only_unavailable_is_retried(serve, code):
    flaky = FlakyCoordinator(failures=1, code=code)
    with pytest.raises(specdec.SpecdecClientError) as failed:
        generate(serve(flaky))
    assert failed.value.code == code and flaky.calls == 1


def test_retries_zero_sends_a_call_once_and_the_async_client_retries_alike(serve):
    flaky = FlakyCoordinator(failures=1)
    with pytest.raises(specdec.SpecdecClientError):
        generate(serve(flaky), retries=0)
    assert flaky.calls == 1

    async def generate_async(address: str) -> str:
        async with specdec.AsyncClient(address) as client:
            return (await client.generate("x", max_new_tokens=2)).text

    flaky = FlakyCoordinator(failures=2)
    assert asyncio.run(generate_async(serve(flaky))) == "ab" and flaky.calls == 3
    flaky = FlakyCoordinator(failures=0, fail_mid_stream=True, resume_failures=1)
    assert asyncio.run(generate_async(serve(flaky))) == "ab" and flaky.calls == 1 and len(flaky.resumes) == 2


@pytest.mark.parametrize("retries", [-1, 5, 1.5, "2"])
def test_retries_outside_what_grpc_can_make_is_a_value_error(retries):
    with pytest.raises(ValueError, match="retries must be an integer from 0 to 4"):
        service_config(retries)
    with pytest.raises(ValueError, match="retries must be an integer from 0 to 4"):
        specdec.Client("127.0.0.1:1", retries=retries)


def test_specdec_generate_retries_as_its_retries_flag_says(serve, capsys):
    """`specdec generate --retries N` is the SDK's `retries=N` (default 2); the flag's range is the SDK's."""
    from specdec.cli import main

    flaky = FlakyCoordinator(failures=2)
    assert main(["generate", "x", "--address", serve(flaky)]) == 0 and flaky.calls == 3
    assert capsys.readouterr().out == "ab\n"
    flaky = FlakyCoordinator(failures=1)
    assert main(["generate", "x", "--address", serve(flaky), "--retries", "0"]) == 1 and flaky.calls == 1
    assert "failure 1" in capsys.readouterr().err
    flaky = FlakyCoordinator(failures=1)
    assert main(["trace", "x", "--address", serve(flaky), "--retries", "1", "--json"]) == 0 and flaky.calls == 2
    with pytest.raises(SystemExit):
        main(["generate", "x", "--retries", "5"])
    assert "--retries: expected an integer at least 0 and at most 4, got '5'" in capsys.readouterr().err


def test_specdec_generate_whose_stream_breaks_for_good_says_how_to_resume_it(serve, capsys):
    from specdec.cli import main

    flaky = FlakyCoordinator(failures=0, fail_mid_stream=True, resume_failures=99)
    address = serve(flaky)
    assert main(["generate", "x", "--address", address, "--retries", "1"]) == 1
    out, err = capsys.readouterr()
    session_id = flaky.session_ids[0]
    assert out == "a" and "error: UNAVAILABLE: resume failure 2" in err  # one resume, sent twice by its channel
    assert f"specdec resume {session_id} --address {address} --received-tokens 1 --received-chars 1" in err
    # Broken for good before its first chunk, once its session began: the hint too (it said
    # nothing, the CLI not knowing the id the SDK made), and the error names the session.
    flaky = FlakyCoordinator(failures=0, fail_before_first_chunk=True, resume_failures=99)
    address = serve(flaky)
    assert main(["generate", "x", "--address", address, "--retries", "1"]) == 1
    out, err = capsys.readouterr()
    session_id = flaky.session_ids[0]
    assert f"specdec resume {session_id} --address {address} --received-tokens 0 --received-chars 0" in err
    with specdec.Client(address, retries=0) as client, pytest.raises(specdec.SpecdecClientError) as broken:
        client.generate("x", max_new_tokens=2)
    assert broken.value.session_id == flaky.session_ids[-1]
    never = FlakyCoordinator(failures=9)
    with specdec.Client(serve(never), retries=0) as client, pytest.raises(specdec.SpecdecClientError) as refused:
        client.generate("x", max_new_tokens=2)
    assert refused.value.session_id is None  # no session began


class SlowCoordinator(FlakyCoordinator):
    """Streams "a", then nothing for a second."""

    def Generate(self, request, context):
        context.send_initial_metadata(((SESSION_HEADER, request.session_id),))
        yield pb.GenerateChunk(text="a", token_ids=[1], session_id=request.session_id)
        time.sleep(1.0)


def test_specdec_generate_whose_timeout_runs_out_says_it_was_the_timeout_and_how_to_get_the_rest(serve, capsys):
    """gRPC's own words were all it said: `DEADLINE_EXCEEDED: Deadline Exceeded`."""
    from specdec.cli import main

    address = serve(SlowCoordinator(failures=0))
    assert main(["generate", "x", "--address", address, "--timeout", "0.3"]) == 1
    out, err = capsys.readouterr()
    assert out == "a" and "error: DEADLINE_EXCEEDED" in err
    assert "(the call's --timeout of 0.3 s ran out; a longer one, or none, lets it finish)" in err
    assert "specdec resume " in err and "--received-tokens 1 --received-chars 1" in err


def test_a_load_balancing_policy_grpc_is_not_given_is_a_value_error_naming_the_choices():
    with pytest.raises(ValueError, match="load_balancing must be one of round_robin, pick_first, got 'random'"):
        specdec.Client("127.0.0.1:1", load_balancing="random")
    assert '"loadBalancingConfig": [{"pick_first": {}}]' in service_config(2, "pick_first")


def test_a_call_on_a_closed_client_is_a_value_error_that_says_to_make_a_new_client(serve):
    """After close() (or its with block), every method of Client and AsyncClient raises one
    ValueError naming the client; gRPC's own errors differed ("Cannot invoke RPC on closed
    channel!" from Client, a cygrpc UsageError, no ValueError, from AsyncClient)."""
    address = serve(FlakyCoordinator(failures=0))
    with specdec.Client(address) as client:
        assert client.generate("x").text == "ab"
    calls = [lambda: client.generate("x"), lambda: list(client.generate_stream("x")),
             lambda: client.resume("s"), lambda: client.delete("s"), lambda: client.info()]  # fmt: skip
    for call in calls:
        with pytest.raises(ValueError, match=r"this specdec\.Client is closed .*: make a new Client"):
            call()

    async def closed_async_calls():
        async with specdec.AsyncClient(address) as client:
            assert (await client.generate("x")).text == "ab"
        for call in (lambda: client.generate("x"), lambda: client.resume("s"), lambda: client.delete("s"),
                     lambda: client.info()):  # fmt: skip
            with pytest.raises(ValueError, match=r"this specdec\.AsyncClient is closed .*: make a new AsyncClient"):
                await call()

    asyncio.run(closed_async_calls())


class BrokenAfterTheEndCoordinator(FlakyCoordinator):
    """Streams "ab", its finish_reason on "b", then the connection breaks (UNAVAILABLE) before the
    stream's status: a coordinator that died just after its last chunk."""

    def Generate(self, request, context):
        self.calls += 1
        context.send_initial_metadata(((SESSION_HEADER, request.session_id),))
        yield pb.GenerateChunk(text="a", token_ids=[1], session_id=request.session_id)
        yield pb.GenerateChunk(text="b", token_ids=[2], finish_reason=pb.FINISH_REASON_LENGTH)
        context.abort(grpc.StatusCode.UNAVAILABLE, "lost after the last chunk")

    def Resume(self, request, context):
        self.resumes.append(request)
        context.send_initial_metadata(((SESSION_HEADER, request.session_id),))
        yield pb.GenerateChunk(text="ab"[request.received_chars :], token_ids=[1, 2][request.received_tokens :],
                               finish_reason=pb.FINISH_REASON_LENGTH, session_id=request.session_id)  # fmt: skip
        context.abort(grpc.StatusCode.UNAVAILABLE, "lost after the last chunk")


def test_a_stream_that_breaks_after_its_last_chunk_ends_whole_without_a_resume(serve):
    """Its output is complete: generate() used to fail UNAVAILABLE on it (there is nothing to
    resume), and so did resume() on a Resume that broke so."""
    flaky = BrokenAfterTheEndCoordinator(failures=0)
    address = serve(flaky)
    with specdec.Client(address) as client:
        result = client.generate("x", max_new_tokens=2)
    assert (result.text, result.token_ids, result.finish_reason) == ("ab", [1, 2], "length")

    async def generate_async():
        async with specdec.AsyncClient(address) as client:
            return await client.generate("x", max_new_tokens=2)

    assert asyncio.run(generate_async()).text == "ab"
    assert flaky.calls == 2 and not flaky.resumes
    with specdec.Client(address) as client:
        assert client.resume("s", received_tokens=1, received_chars=1).text == "b"

    async def resume_async():
        async with specdec.AsyncClient(address) as client:
            return await client.resume("s", received_tokens=1, received_chars=1)

    assert asyncio.run(resume_async()).token_ids == [2] and len(flaky.resumes) == 2


class EndlessCoordinator(FlakyCoordinator):
    """Streams "a" every 20 ms for 4 s, from a Generate or a Resume; Info answers after 4 s."""

    def Generate(self, request, context):
        context.send_initial_metadata(((SESSION_HEADER, request.session_id),))
        for _ in range(200):
            if not context.is_active():
                return
            yield pb.GenerateChunk(text="a", token_ids=[1], session_id=request.session_id)
            time.sleep(0.02)

    Resume = Generate

    def Info(self, request, context):
        time.sleep(4.0)
        return pb.InfoResponse()


async def aenumerate(iterable, start=1):
    """enumerate() of an async iterable."""
    index = start
    async for item in iterable:
        yield index, item
        index += 1


def test_a_call_cut_by_its_clients_close_raises_cancelled_from_both_clients_and_a_task_cancel_stays_cancelled_error(serve):
    """AsyncClient used to let asyncio.CancelledError out of a call its close() cut, where Client
    raises SpecdecClientError CANCELLED; a cancel() of the task awaiting a call is the caller's
    own and must stay a CancelledError."""
    address = serve(EndlessCoordinator(failures=0))
    client = specdec.Client(address)
    with pytest.raises(specdec.SpecdecClientError) as cut:
        for chunk_count, _ in enumerate(client.generate_stream("x", max_new_tokens=200, session_id="cut-sync"), 1):
            if chunk_count == 2:
                client.close()
    # Client's said gRPC's "Channel closed!"; AsyncClient's named no session, which client.resume takes
    assert cut.value.code == grpc.StatusCode.CANCELLED and "closed during the call" in cut.value.message
    assert cut.value.session_id == "cut-sync"

    async def cut_async_calls():
        client = specdec.AsyncClient(address)
        with pytest.raises(specdec.SpecdecClientError) as cut:
            async for chunk_count, _ in aenumerate(client.generate_stream("x", max_new_tokens=200, session_id="cut-async")):
                if chunk_count == 2:
                    await client.close()
        assert cut.value.code == grpc.StatusCode.CANCELLED and "closed during the call" in cut.value.message
        assert cut.value.session_id == "cut-async"
        for call in (lambda c: c.generate("x", max_new_tokens=200), lambda c: c.info()):
            client = specdec.AsyncClient(address)
            closing = asyncio.get_running_loop().call_later(0.3, lambda: asyncio.ensure_future(client.close()))
            with pytest.raises(specdec.SpecdecClientError) as cut:
                await call(client)
            assert cut.value.code == grpc.StatusCode.CANCELLED
            closing.cancel()
        for call in (lambda c: c.generate("x", max_new_tokens=200), lambda c: c.info()):
            for close_too in (False, True):  # the caller's cancel(), alone or as its client closes
                client = specdec.AsyncClient(address)
                task = asyncio.ensure_future(call(client))
                await asyncio.sleep(0.3)
                task.cancel()
                if close_too:
                    await client.close()
                with pytest.raises(asyncio.CancelledError):
                    await task
                await client.close()

    asyncio.run(cut_async_calls())


def test_a_stream_broken_while_its_client_waits_to_resume_it_ends_cancelled_when_the_client_closes(serve, monkeypatch):
    """A stream broken UNAVAILABLE waits a moment before its Resume; a close() meanwhile raised
    the closed client's ValueError ("make a new Client") from both clients, after the whole
    wait, where a call close() cuts raises SpecdecClientError CANCELLED (README)."""
    import threading

    monkeypatch.setattr("specdec.client.random.uniform", lambda low, high: 5.0)  # the wait before the Resume
    flaky = FlakyCoordinator(failures=0, fail_mid_stream=True)
    address = serve(flaky)
    client = specdec.Client(address)
    threading.Timer(0.5, client.close).start()
    started = time.monotonic()
    with pytest.raises(specdec.SpecdecClientError) as cut:
        list(client.generate_stream("x", max_new_tokens=2))
    assert cut.value.code == grpc.StatusCode.CANCELLED and "closed during the call" in cut.value.message
    assert cut.value.session_id == flaky.session_ids[-1], "the session, which had begun, was not named"
    assert time.monotonic() - started < 3.0, "the wait was cut short"

    async def close_while_waiting():
        client = specdec.AsyncClient(address)
        asyncio.get_running_loop().call_later(0.5, lambda: asyncio.ensure_future(client.close()))
        started = time.monotonic()
        with pytest.raises(specdec.SpecdecClientError) as cut:
            await client.generate("x", max_new_tokens=2)
        assert cut.value.code == grpc.StatusCode.CANCELLED and "closed during the call" in cut.value.message
        assert cut.value.session_id == flaky.session_ids[-1]
        assert time.monotonic() - started < 3.0, "the wait was cut short"

    asyncio.run(close_while_waiting())
    assert not flaky.resumes


class FinishedThenSlow(FlakyCoordinator):
    """Streams "ab" with its finish_reason, then takes 3 s before its closing status."""

    def Generate(self, request, context):
        yield pb.GenerateChunk(text="ab", token_ids=[1, 2], finish_reason=pb.FINISH_REASON_LENGTH,
                               session_id=request.session_id)  # fmt: skip
        time.sleep(3.0)


def test_an_output_whose_last_chunk_came_before_the_deadline_ran_out_is_returned_whole(serve):
    """A deadline that ran out after the chunk with the finish_reason and before the server's
    closing status failed generate() DEADLINE_EXCEEDED, the whole output in hand."""
    address = serve(FinishedThenSlow(failures=0))
    with specdec.Client(address) as client:
        assert client.generate("x", max_new_tokens=2, timeout=1.0).text == "ab"

    async def run():
        async with specdec.AsyncClient(address) as client:
            return (await client.generate("x", max_new_tokens=2, timeout=1.0)).text

    assert asyncio.run(run()) == "ab"


def test_an_async_stream_closed_early_cancels_its_call_before_aclose_returns(serve, monkeypatch):
    """AsyncClient's stream passed its chunks on from an inner generator without closing it:
    aclose() returned with the call still open, cancelled only once the loop finalized the
    inner generator, and the coordinator went on generating meanwhile."""
    stopped = []
    monkeypatch.setattr("specdec.client.stop_call", lambda call: stopped.append(call.cancel()))
    address = serve(EndlessCoordinator(failures=0))

    async def run():
        async with specdec.AsyncClient(address) as client:
            for stream in (client.generate_stream("x", max_new_tokens=200), client.resume_stream("endless")):
                await stream.__anext__()
                await stream.aclose()
                assert stopped, "aclose() returned before the call was cancelled"
                stopped.clear()

    asyncio.run(run())


def test_an_sdk_error_survives_pickling_and_info_and_delete_refuse_a_timeout_grpc_cannot_hold():
    """A process pool's worker that raised SpecdecClientError broke the pool (TypeError rebuilding
    it); info() and delete() took timeout=inf and failed DEADLINE_EXCEEDED at once."""
    import copy
    import pickle

    from specdec.client import SpecdecClientError

    error = SpecdecClientError(grpc.StatusCode.NOT_FOUND, "gone", "s1")
    for again in (pickle.loads(pickle.dumps(error)), copy.copy(error)):
        assert (again.code, again.message, again.session_id, str(again)) == (error.code, "gone", "s1", "NOT_FOUND: gone")
    with specdec.Client("127.0.0.1:1", retries=0) as client:
        for timeout in (float("inf"), float("nan"), 1e10, -1):
            for call in (lambda: client.info(timeout=timeout), lambda: client.delete("s", timeout=timeout)):
                with pytest.raises(ValueError, match="timeout must be a number above 0"):
                    call()
        with pytest.raises(ValueError, match="top_p must be a number above 0 and at most 1"):
            client.generate("x", top_p=1e39)  # protobuf would send inf, which the coordinator quoted back

    async def run():
        async with specdec.AsyncClient("127.0.0.1:1", retries=0) as client:
            for call in (lambda: client.info(timeout=float("inf")), lambda: client.delete("s", timeout=float("inf"))):
                with pytest.raises(ValueError, match="timeout must be a number above 0"):
                    await call()

    asyncio.run(run())


def test_a_traced_client_resumes_a_stream_broken_before_its_first_chunk_and_reports_one_that_never_began(serve):
    """With OpenTelemetry's gRPC client instrumentation (which `specdec generate` installs when
    tracing is on) a sync call is wrapped and cannot say whether its headers, which tell that
    the session began, came: a stream broken after them and before its first chunk was given
    up (UNAVAILABLE, no Resume), where an unwrapped one is resumed. Now a Resume is tried; where
    it is NOT_FOUND (the session never began) the first error stands."""
    from opentelemetry.instrumentation.grpc import GrpcInstrumentorClient

    instrumentor = GrpcInstrumentorClient()
    instrumentor.instrument()
    try:
        broken = FlakyCoordinator(failures=0, fail_before_first_chunk=True)
        with specdec.Client(serve(broken)) as client:
            assert client.generate("x", max_new_tokens=2).text == "ab"
        assert broken.calls == 1 and len(broken.resumes) == 1
        never = FlakyCoordinator(failures=3)  # each of the 3 attempts fails before the session exists
        with specdec.Client(serve(never)) as client, pytest.raises(specdec.SpecdecClientError) as failed:
            client.generate("x", max_new_tokens=2)
        assert failed.value.code == grpc.StatusCode.UNAVAILABLE and failed.value.message == "failure 3"
        assert never.calls == 3 and len(never.resumes) == 1
        # A caller's id may name an earlier session: no guess, or its output would come back as this call's.
        earlier = FlakyCoordinator(failures=3)
        earlier.began.add("mine")
        with specdec.Client(serve(earlier)) as client, pytest.raises(specdec.SpecdecClientError) as failed:
            client.generate("x", max_new_tokens=2, session_id="mine")
        assert failed.value.message == "failure 3" and not earlier.resumes
    finally:
        instrumentor.uninstrument()


class ResumeBreakingOnce(FlakyCoordinator):
    """Its first Resume sends the next character of "ab" and then breaks UNAVAILABLE."""

    def Resume(self, request, context):
        if self.resumes:
            yield from super().Resume(request, context)
            return
        self.resumes.append(request)
        context.send_initial_metadata(((SESSION_HEADER, request.session_id),))
        yield pb.GenerateChunk(text="ab"[request.received_chars], token_ids=[[1, 2][request.received_tokens]],
                               session_id=request.session_id)  # fmt: skip
        context.abort(grpc.StatusCode.UNAVAILABLE, "lost mid-resume")


def test_a_hand_made_resume_resumes_by_itself_where_it_breaks_as_a_generate_does(serve):
    """resume_stream / resume (and `specdec resume`) raised UNAVAILABLE when their own stream
    broke: a long session resumed by hand was not covered by `retries`, as a generate is."""
    coordinator = ResumeBreakingOnce(failures=0)
    coordinator.began.add("by-hand")
    address = serve(coordinator)
    with specdec.Client(address) as client:
        assert client.resume("by-hand").text == "ab"
    assert [(r.received_tokens, r.received_chars) for r in coordinator.resumes] == [(0, 0), (1, 1)]

    async def resume_async():
        async with specdec.AsyncClient(address) as client:
            return await client.resume("by-hand")

    coordinator.resumes.clear()
    assert asyncio.run(resume_async()).text == "ab" and len(coordinator.resumes) == 2
    with specdec.Client(address, retries=0) as client, pytest.raises(specdec.SpecdecClientError) as broken:
        coordinator.resumes.clear()
        client.resume("by-hand")
    assert broken.value.code == grpc.StatusCode.UNAVAILABLE and len(coordinator.resumes) == 1


class CreatedThenLost(FlakyCoordinator):
    """Its Generate creates the session and then fails UNAVAILABLE before its headers (a
    coordinator killed, or a Redis reply lost, right after the write); a second Generate of
    that id, gRPC's retry of the call, is ALREADY_EXISTS."""

    def Generate(self, request, context):
        self.calls += 1
        if request.session_id in self.began:
            context.abort(grpc.StatusCode.ALREADY_EXISTS, f"session {request.session_id!r} already exists")
        self.began.add(request.session_id)
        context.abort(grpc.StatusCode.UNAVAILABLE, "lost after the session was created")
        yield


def test_a_call_whose_retry_finds_its_own_new_session_resumes_it_and_a_callers_id_stays_already_exists(serve):
    """The SDK names a session with a uuid4 when the caller does not: ALREADY_EXISTS for it can
    only mean that an earlier attempt of this very call created it, so the stream resumes it
    (the caller got ALREADY_EXISTS for a session whose id it never saw). A caller's own id may
    be a real duplicate: that stays ALREADY_EXISTS."""
    coordinator = CreatedThenLost(failures=0)
    address = serve(coordinator)
    with specdec.Client(address) as client:
        assert client.generate("x", max_new_tokens=2).text == "ab"
        assert coordinator.calls == 2 and len(coordinator.resumes) == 1
        with pytest.raises(specdec.SpecdecClientError) as taken:
            client.generate("x", max_new_tokens=2, session_id="mine")
    assert taken.value.code == grpc.StatusCode.ALREADY_EXISTS and len(coordinator.resumes) == 1


def test_an_async_client_made_outside_an_event_loop_opens_its_channel_in_the_loop_of_its_first_call(serve):
    """A grpc.aio channel belongs to one event loop. AsyncClient opened its channel when made, so
    one made before asyncio.run failed inside it with gRPC's RuntimeError "... attached to a
    different loop" (or, made where no loop was current, at once)."""
    address = serve(FlakyCoordinator(failures=0))
    client = specdec.AsyncClient(address)

    async def use():
        assert (await client.generate("x", max_new_tokens=2)).text == "ab"
        with pytest.raises(RuntimeError, match="first used in another event loop.*make an AsyncClient in each"):
            await asyncio.to_thread(asyncio.run, client.info())
        await client.close()

    asyncio.run(use())
