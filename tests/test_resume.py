"""Resume: a session whose stream broke goes on, through any coordinator on its Redis,
with the tokens and text it would have had. Real processes: two coordinators in front of
one draft and one target, a real redis-server, the SDK over loopback gRPC."""

import json
import os
import signal
import time

import grpc
import pytest
import redis

import specdec
from conftest import scrape, start_stack
from specdec.redis_server import free_port
from specdec.session import meta_key

PROMPT_OPTIONS = dict(ignore_eos=True, num_speculative_tokens=3)
LONG = 1500  # tokens: a stream that is still running when the test breaks it (a few seconds)
TAKEN_OVER = 400  # tokens: a stream still running when another request resumes it (1-3 s)
DRAIN_S = 0.5  # the coordinators' --drain-s: how long a stopping one lets running calls go on


@pytest.fixture(scope="module")
def metrics_ports():
    """The /metrics port of each of the stack's coordinators."""
    return {"coordinator": free_port(), "spare": free_port()}


@pytest.fixture(scope="module")
def stack(redis_url, tiny_models, metrics_ports):
    """A stack with a second coordinator ("spare") on the same draft, target and Redis."""
    metrics = metrics_ports
    stack = start_stack(redis_url, tiny_models.target, tiny_models.draft,
                        coordinator_args=["--drain-s", str(DRAIN_S), "--metrics-port", str(metrics["coordinator"])])  # fmt: skip
    try:
        stack.add_coordinator("spare", "--metrics-port", str(metrics["spare"]))
        yield stack
    finally:
        stack.stop()


def both(stack) -> str:
    """One gRPC target naming both coordinators."""
    return f"ipv4:127.0.0.1:{stack.ports['coordinator']},127.0.0.1:{stack.ports['spare']}"


# The tests that break "coordinator" need the stream on it: the first coordinator the address
# names, while it answers (then the other), as a client behind a load balancer would be moved.
FIRST_THEN_OTHER = dict(load_balancing="pick_first")


def spare(stack) -> str:
    return f"127.0.0.1:{stack.ports['spare']}"


def session_meta(redis_url, session_id) -> dict:
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        return client.hgetall(meta_key(session_id))
    finally:
        client.close()


def read_chunks(stream, n: int) -> list:
    """The first n chunks of a stream, which is then closed (the call cancelled)."""
    chunks = []
    for chunk in stream:
        chunks.append(chunk)
        if len(chunks) == n:
            break
    stream.close()
    return chunks


@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=1.0, seed=7)], ids=["greedy", "seeded"])
def test_a_stream_whose_coordinator_is_killed_goes_on_through_the_other_with_the_same_tokens_and_text(
    stack, sampling
):
    """SIGKILL the coordinator mid-stream: the SDK resumes the session on the other one, and
    the caller sees every token once, the same as an unbroken run's (greedy, and sampled with a
    seed: each cycle's random stream depends on the seed and the cycle's number only)."""
    options = dict(prompt="hello world", max_new_tokens=300, **PROMPT_OPTIONS, **sampling)
    with specdec.Client(spare(stack)) as client:
        expected = client.generate(**options)
    chunks, arrived = [], []
    with specdec.Client(both(stack), retries=2, **FIRST_THEN_OTHER) as client:
        for chunk in client.generate_stream(**options):
            chunks.append(chunk)
            arrived.append(time.monotonic())
            if len(chunks) == 3:
                stack.processes["coordinator"].kill()
                killed_at = time.monotonic()
    try:
        resumed = next(i for i, c in enumerate(chunks) if c.cycle is None)
        print(f"\ncoordinator killed: the catch-up chunk ({len(chunks[resumed].token_ids)} tokens) came "
              f"{(arrived[resumed] - killed_at) * 1000:.0f} ms later, the next cycle's "
              f"{(arrived[resumed + 1] - killed_at) * 1000:.0f} ms later")  # fmt: skip
        assert [t for c in chunks for t in c.token_ids] == expected.token_ids
        assert "".join(c.text for c in chunks) == expected.text
        assert chunks[-1].finish_reason == "length"
        catch_ups = [i for i, c in enumerate(chunks) if c.cycle is None]
        assert len(catch_ups) == 1 and catch_ups[0] >= 3, "one resumption, after the kill"
        # The statistics span both runs, as Redis counted them: the same as the unbroken run's.
        counted = ("cycles", "draft_cycles", "draft_tokens", "accepted_tokens", "accepted_per_position", "generated_tokens")
        assert {name: getattr(chunks[-1].stats, name) for name in counted} == {
            name: getattr(expected.stats, name) for name in counted
        }
    finally:
        stack.restart("coordinator")
        stack.wait_ready(("coordinator",))


def test_a_stream_whose_coordinator_freezes_goes_on_through_the_other_once_its_keepalive_ping_goes_unanswered(stack):
    """SIGSTOP the coordinator mid-stream (a hung host, or a network that leaves TCP open): no
    chunk and no error comes, but the SDK's keepalive ping goes unanswered, its connection drops
    within ~15 s, and the SDK resumes the session on the other coordinator with an unbroken
    run's tokens and text. Without keepalive the stream waited until its deadline."""
    options = dict(prompt="hello world", max_new_tokens=LONG, **PROMPT_OPTIONS)
    with specdec.Client(spare(stack)) as client:
        expected = client.generate(**options)
    chunks, arrived = [], []
    coordinator = stack.processes["coordinator"]
    try:
        with specdec.Client(both(stack), **FIRST_THEN_OTHER) as client:
            for chunk in client.generate_stream(**options, timeout=90):
                chunks.append(chunk)
                arrived.append(time.monotonic())
                if len(chunks) == 3:
                    os.kill(coordinator.pid, signal.SIGSTOP)
                    frozen_at = time.monotonic()
    finally:
        os.kill(coordinator.pid, signal.SIGCONT)
        stack.restart("coordinator")
        stack.wait_ready(("coordinator",))
    resumed = next(i for i, c in enumerate(chunks) if c.cycle is None)
    print(f"\ncoordinator frozen: the catch-up chunk came {arrived[resumed] - frozen_at:.1f} s later")
    assert [t for c in chunks for t in c.token_ids] == expected.token_ids
    assert "".join(c.text for c in chunks) == expected.text and chunks[-1].finish_reason == "length"


def test_a_stream_running_past_its_stopping_coordinators_drain_is_resumed_through_the_other(stack):
    """SIGTERM, as a rolling update sends: the coordinator takes no new calls, lets running ones
    go on for --drain-s, then cancels them (UNAVAILABLE), and the SDK resumes the stream."""
    options = dict(prompt="hello world", max_new_tokens=300, **PROMPT_OPTIONS)
    with specdec.Client(spare(stack)) as client:
        expected = client.generate(**options)
    chunks = []
    with specdec.Client(both(stack), **FIRST_THEN_OTHER) as client:
        for chunk in client.generate_stream(**options):
            chunks.append(chunk)
            if len(chunks) == 3:
                stack.processes["coordinator"].terminate()
                stopped_at = time.monotonic()
    try:
        resumed = [i for i, c in enumerate(chunks) if c.cycle is None]
        print(f"\ncoordinator stopped: resumed after {len(chunks[:resumed[0]])} chunks, "
              f"{time.monotonic() - stopped_at:.1f} s from SIGTERM to the stream's end")  # fmt: skip
        assert len(resumed) == 1 and resumed[0] > 3, "the drain let the stream go on, then it was resumed once"
        assert [t for c in chunks for t in c.token_ids] == expected.token_ids
        assert "".join(c.text for c in chunks) == expected.text
    finally:
        stack.processes["coordinator"].wait(timeout=30)
        stack.restart("coordinator")
        stack.wait_ready(("coordinator",))


def requests_served(port: int) -> float:
    return sum(value for (name, _), value in scrape(port).items() if name == "specdec:request_success_total")


def test_a_client_naming_several_coordinators_spreads_its_calls_over_them(stack, metrics_ports):
    """The SDK's default, round_robin: eight calls through one address naming both
    coordinators, with the same output from each; each coordinator served some of them."""
    before = {name: requests_served(port) for name, port in metrics_ports.items()}
    options = dict(prompt="hello world", max_new_tokens=8, **PROMPT_OPTIONS)
    with specdec.Client(both(stack)) as client:
        outputs = {tuple(client.generate(**options).token_ids) for _ in range(8)}
    served = {name: requests_served(port) - before[name] for name, port in metrics_ports.items()}
    print(f"\ncalls served: {served}")
    assert len(outputs) == 1
    assert sum(served.values()) == 8 and min(served.values()) >= 2, served


def first_tokens_timed(port: int) -> float:
    return scrape(port)[("specdec:time_to_first_token_seconds_count", ())]


def test_resume_by_hand_sends_what_the_client_lacks_then_the_rest(stack, redis_url, metrics_ports):
    """A client that dropped its stream resumes the session from another process's point of
    view: the tokens after the ones it has, and the text after the characters it has. The
    resumed call times no first token (the session's came long before): its first cycle used
    to be counted as one."""
    options = dict(prompt="hello world", max_new_tokens=120, **PROMPT_OPTIONS)
    with specdec.Client(stack.address) as client:
        expected = client.generate(**options)
        received = read_chunks(client.generate_stream(session_id="dropped", **options), 2)
    tokens = sum(len(c.token_ids) for c in received)
    chars = sum(len(c.text) for c in received)
    timed = first_tokens_timed(metrics_ports["spare"])
    with specdec.Client(spare(stack)) as client:
        rest = client.resume("dropped", received_tokens=tokens, received_chars=chars)
    assert first_tokens_timed(metrics_ports["spare"]) == timed
    assert [t for c in received for t in c.token_ids] + rest.token_ids == expected.token_ids
    assert "".join(c.text for c in received) + rest.text == expected.text
    assert rest.finish_reason == "length" and rest.session_id == "dropped"
    assert session_meta(redis_url, "dropped")["status"] == "finished"


def test_resuming_a_finished_session_sends_its_tail_and_its_finish_reason_and_generates_nothing(
    stack, redis_url
):
    with specdec.Client(stack.address) as client:
        unstopped = client.generate(prompt="hello world", max_new_tokens=40, **PROMPT_OPTIONS).text
        stop = unstopped[len(unstopped) // 2 :][:3]  # a stop string that ends the output half-way
        options = dict(prompt="hello world", max_new_tokens=40, stop=[stop], **PROMPT_OPTIONS)
        done = client.generate(session_id="finished", **options)
        assert done.finish_reason == "stop"
        before = session_meta(redis_url, "finished")
        again = client.resume("finished")
        tail = client.resume("finished", received_tokens=3, received_chars=2)
    assert (again.token_ids, again.text, again.finish_reason) == (done.token_ids, done.text, "stop")
    assert (tail.token_ids, tail.text, tail.finish_reason) == (done.token_ids[3:], done.text[2:], "stop")
    assert session_meta(redis_url, "finished") == before, "a finished session is read, not touched"


def test_a_running_session_resumed_elsewhere_stops_its_first_run_with_aborted(stack):
    """Two runs of one session never both commit: the one that resumed it owns it, and the
    first stops at its next commit with ABORTED, while the resumed stream completes."""
    options = dict(prompt="hello world", max_new_tokens=TAKEN_OVER, **PROMPT_OPTIONS)
    with specdec.Client(spare(stack)) as client:
        expected = client.generate(**options).token_ids
    with specdec.Client(stack.address, retries=0) as first, specdec.Client(spare(stack)) as second:
        stream = first.generate_stream(session_id="taken-over", **options)
        received = [next(stream) for _ in range(3)]
        rest = second.resume("taken-over", received_tokens=sum(len(c.token_ids) for c in received))
        with pytest.raises(specdec.SpecdecClientError) as info:
            for chunk in stream:
                received.append(chunk)
    assert info.value.code == grpc.StatusCode.ABORTED and "resumed by another request" in info.value.message
    assert [t for c in received[:3] for t in c.token_ids] + rest.token_ids == expected
    assert rest.finish_reason == "length"


def test_resume_refuses_what_it_cannot_serve_with_a_clear_status_and_leaves_the_session_as_it_was(
    stack, redis_url
):
    with specdec.Client(stack.address) as client:
        done = client.generate(prompt="hello world", max_new_tokens=12, session_id="kept", **PROMPT_OPTIONS)
        before = session_meta(redis_url, "kept")
        cases = {
            "never-made": (dict(), grpc.StatusCode.NOT_FOUND, "does not exist"),
            "kept": (dict(received_tokens=13), grpc.StatusCode.OUT_OF_RANGE, "12 output tokens"),
            "kept ": (dict(), grpc.StatusCode.NOT_FOUND, "does not exist"),
            "{bad}": (dict(), grpc.StatusCode.INVALID_ARGUMENT, "braces"),
        }
        for session_id, (kwargs, code, words) in cases.items():
            with pytest.raises(specdec.SpecdecClientError) as info:
                client.resume(session_id, **kwargs)
            assert info.value.code == code and words in info.value.message, (session_id, info.value)
        with pytest.raises(specdec.SpecdecClientError) as info:
            client.resume("kept", received_chars=len(done.text) + 1)
        assert info.value.code == grpc.StatusCode.OUT_OF_RANGE
        assert session_meta(redis_url, "kept") == before

        store = redis.Redis.from_url(redis_url, decode_responses=True)
        try:
            weights = store.hget(meta_key("kept"), "target_weights")
            assert len(weights) == 64, "the session records its target's weights"
            store.hset(meta_key("kept"), "target_weights", "e" * 64)  # generated before a fine-tune rolled out
            with pytest.raises(specdec.SpecdecClientError) as info:
                client.resume("kept")
            assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
            assert "weights eeeeeeeeeeee" in info.value.message
            store.hdel(meta_key("kept"), "target_weights")  # a session stored before weights were recorded
            assert client.resume("kept").text == done.text
            store.hset(meta_key("kept"), "target_weights", weights)
            store.hset(meta_key("kept"), "target_fingerprint", "another-vocabulary")
            with pytest.raises(specdec.SpecdecClientError) as info:
                client.resume("kept")
            assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION and "target" in info.value.message
            store.hdel(meta_key("kept"), "plan")
            with pytest.raises(specdec.SpecdecClientError) as info:
                client.resume("kept")
            assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
        finally:
            store.close()


def test_specdec_resume_prints_the_rest_of_a_session_and_says_what_is_wrong_with_a_bad_one(stack, capsys):
    from specdec.cli import main

    with specdec.Client(stack.address) as client:
        done = client.generate(prompt="hello world", max_new_tokens=16, session_id="for-the-cli", **PROMPT_OPTIONS)
    assert main(["resume", "for-the-cli", "--address", spare(stack), "--received-chars", "3"]) == 0
    out, err = capsys.readouterr()
    assert out == done.text[3:] + "\n" and "[16 tokens; " in err and "finish: length" in err
    assert "tok/s" not in err  # the time is this call's, the counts the session's: no rate from them
    assert main(["resume", "for-the-cli", "--address", stack.address, "--received-tokens", "10"]) == 0
    assert capsys.readouterr().out == done.text + "\n"  # the text starts after --received-chars only
    assert main(["resume", "for-the-cli", "--address", stack.address, "--received-tokens", "10", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["token_ids"] == done.token_ids[10:] and printed["finish_reason"] == "length"
    assert main(["resume", "no-such-session", "--address", stack.address]) == 1
    assert "error: NOT_FOUND: session 'no-such-session' does not exist" in capsys.readouterr().err


# ---------------------------------------------------------------- delete


def test_delete_removes_a_session_from_redis_and_the_model_services_and_a_running_stream_of_it_ends_not_found(
    stack, redis_url
):
    """A finished session deleted through the other coordinator: its keys are gone, Resume says
    NOT_FOUND, deleting again says False. A running one deleted mid-stream: the stream ends
    NOT_FOUND at its next commit, nothing is written back, and the target holds no cache of it."""
    from conftest import internal_stub
    from specdec.session import tokens_key
    from specdec.v1 import specdec_pb2 as pb

    store = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        with specdec.Client(stack.address) as client, specdec.Client(spare(stack)) as other:
            client.generate(prompt="hello world", max_new_tokens=8, session_id="to-delete", **PROMPT_OPTIONS)
            assert store.exists(meta_key("to-delete"), tokens_key("to-delete")) == 2
            assert other.delete("to-delete") is True
            assert store.exists(meta_key("to-delete"), tokens_key("to-delete")) == 0
            assert client.delete("to-delete") is False
            with pytest.raises(specdec.SpecdecClientError) as info:
                client.resume("to-delete")
            assert info.value.code == grpc.StatusCode.NOT_FOUND and "deleted" in info.value.message
            with pytest.raises(specdec.SpecdecClientError) as info:
                client.delete("{bad}")
            assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT

            def held() -> int:
                return internal_stub(stack, "target").ModelInfo(pb.ModelInfoRequest(), timeout=10).sessions_held

            before = held()
            with specdec.Client(stack.address, retries=0) as streaming:
                stream = streaming.generate_stream(prompt="hello world", max_new_tokens=LONG, session_id="deleted-running",
                                                   **PROMPT_OPTIONS)  # fmt: skip
                next(stream)
                assert held() == before + 1
                assert other.delete("deleted-running") is True
                with pytest.raises(specdec.SpecdecClientError) as info:
                    for _ in stream:
                        pass
            assert info.value.code == grpc.StatusCode.NOT_FOUND
            time.sleep(0.5)  # the ended run's clean-up, had it written anything
            assert store.exists(meta_key("deleted-running"), tokens_key("deleted-running")) == 0
            deadline = time.monotonic() + 10
            while held() != before and time.monotonic() < deadline:
                time.sleep(0.1)
            assert held() == before, "the target still holds the deleted session's cache"
    finally:
        store.close()


def test_specdec_delete_deletes_a_session_and_says_when_there_is_none(stack, capsys):
    from specdec.cli import main

    with specdec.Client(stack.address) as client:
        client.generate(prompt="hello world", max_new_tokens=4, session_id="for-cli-delete", **PROMPT_OPTIONS)
    assert main(["delete", "for-cli-delete", "--address", stack.address]) == 0
    assert capsys.readouterr().out == "deleted session for-cli-delete\n"
    assert main(["delete", "for-cli-delete", "--address", stack.address]) == 1
    assert "no session for-cli-delete deleted (expired, deleted already, never created" in capsys.readouterr().err


def test_the_async_client_deletes_a_session_too(stack, redis_url):
    import asyncio

    async def go():
        async with specdec.AsyncClient(stack.address) as client:
            await client.generate(prompt="hello world", max_new_tokens=4, session_id="async-delete", **PROMPT_OPTIONS)
            return await client.delete("async-delete"), await client.delete("async-delete")

    assert asyncio.run(go()) == (True, False)
    assert session_meta(redis_url, "async-delete") == {}
