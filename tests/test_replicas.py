"""Model service replicas (coordinator.replicas): a session keeps to one replica, sessions
spread over them, a failed replica's sessions move to the others without losing a token.
The rules are checked on Replicas itself; the behaviour through real processes: two target
services on loopback behind one coordinator, each target's forward passes counted by its
own /metrics endpoint."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from types import SimpleNamespace

import grpc
import pytest

import specdec
from conftest import internal_stub, scrape, start_stack
from coordinator.replicas import (
    ReplicaAddress,
    Replicas,
    endpoint_of,
    parse_replica_address,
    score,
)
from specdec.errors import Unavailable
from specdec.redis_server import free_port
from specdec.serving import CLIENT_OPTIONS
from specdec.v1 import specdec_pb2 as pb
from specdec.v1 import specdec_pb2_grpc as pb_grpc

PROMPT = "hello world"
OPTIONS = dict(ignore_eos=True, num_speculative_tokens=3)


# ---------------------------------------------------------------- the rules


def test_a_rollout_is_followed_once_a_replica_refused_before_serves_what_the_others_now_serve():
    """Weights A adopted; replica 1 restarts on C (a build given up) and is refused; replica 2
    restarts on B and is refused; replica 1 restarts on B. Every replica serves B: that is a
    rollout to follow. Only a replica's first refusal looked for one, so the coordinator refused
    every replica for good (UNAVAILABLE to every request until restarted), still saying replica
    1 served C."""
    from coordinator.replicas import target_identity

    def serving(weights: str) -> pb.ModelInfoResponse:
        return pb.ModelInfoResponse(model="m", vocab_fingerprint="V", weights_fingerprint=weights, vocab_size=40,
                                    max_context=64, eos_token_ids=[2])  # fmt: skip

    models = {"127.0.0.1:1": serving("A"), "127.0.0.1:2": serving("A")}

    class Stub:
        def __init__(self, channel):
            self.endpoint = None

        async def ModelInfo(self, request, timeout=None):
            return models[self.endpoint]

    async def run():
        replicas = Replicas(parse_replica_address("127.0.0.1:1,127.0.0.1:2"), Stub, name="target",
                            identity=target_identity, follow_rollout=True, refresh_s=0.05)  # fmt: skip
        await replicas.start()
        try:
            for endpoint, replica in replicas.replicas.items():
                replica.stub.endpoint = endpoint
            replicas.adopt(replicas.replicas["127.0.0.1:1"], models["127.0.0.1:1"])
            await replicas.settle()
            for endpoint, weights in (("127.0.0.1:1", "C"), ("127.0.0.1:2", "B")):
                models[endpoint] = serving(weights)
                assert await replicas.recheck(replicas.replicas[endpoint])
            models["127.0.0.1:1"] = serving("B")
            for _ in range(100):  # the refused replicas are asked again every refresh_s
                if replicas.adopted.weights_fingerprint == "B":
                    break
                await asyncio.sleep(0.02)
            return replicas.adopted.weights_fingerprint, replicas.pick("s").endpoint
        finally:
            await replicas.close()

    adopted, picked = asyncio.run(run())
    assert adopted == "B" and picked in ("127.0.0.1:1", "127.0.0.1:2")


def test_a_coordinator_waiting_for_a_model_service_says_what_it_waits_for_and_why(monkeypatch, caplog):
    """A coordinator given addresses where nothing serves said only "loading" until it gave up
    after --startup-timeout (ten minutes by default); now it logs the address and the last error as
    it waits, and the give-up names the error too, and the flag."""
    import logging

    from coordinator import server
    from specdec.errors import FailedPrecondition

    monkeypatch.setattr(server, "WAIT_LOG_S", 0.3)
    down = (f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}")

    async def wait() -> None:
        replicas = Replicas(ReplicaAddress(endpoints=down), pb_grpc.TargetStub)
        await replicas.start()
        try:
            await server.wait_for_model_info(replicas, "target", 1.0)
        finally:
            await replicas.close()

    with caplog.at_level(logging.INFO, logger="specdec.coordinator"), pytest.raises(FailedPrecondition) as gave_up:
        asyncio.run(wait())
    assert f"the target service at {down[0]},{down[1]} did not become ready in 1s (UNAVAILABLE: " in str(gave_up.value)
    assert str(gave_up.value).endswith("a model that loads longer needs a longer --startup-timeout")
    waiting = [r.getMessage() for r in caplog.records if r.getMessage().startswith("waiting for the target service")]
    assert len(waiting) >= 2 and f"at {down[0]},{down[1]} (" in waiting[0] and "at most 1): UNAVAILABLE: " in waiting[0]


def test_a_replica_address_is_one_target_a_list_or_a_dns_name_and_anything_else_is_refused():
    assert parse_replica_address("127.0.0.1:50053") == ReplicaAddress(endpoints=("127.0.0.1:50053",))
    assert parse_replica_address("unix:/tmp/target.sock").endpoints == ("unix:/tmp/target.sock",)
    assert parse_replica_address(" a:1, b:2 ").endpoints == ("a:1", "b:2")
    assert parse_replica_address("[::1]:5,127.0.0.1:6").endpoints == ("[::1]:5", "127.0.0.1:6")
    dns = parse_replica_address("dns:///specdec-target.specdec.svc.cluster.local:50053")
    assert (dns.host, dns.port, dns.endpoints) == ("specdec-target.specdec.svc.cluster.local", 50053, ())
    assert str(dns) == "dns:///specdec-target.specdec.svc.cluster.local:50053"
    for bad, says in [
        ("", "empty"),
        ("a:1,b", "'b' in 'a:1,b' is not HOST:PORT"),
        ("a:1,a:1", "names a replica twice"),
        ("a:1,b:0", "the port must be an integer at least 1 and at most 65535"),
        ("a:1,b:70000", "the port must be an integer at least 1 and at most 65535"),
        ("a:70000", "'a:70000' is not HOST:PORT: the port must be an integer at least 1 and at most 65535"),
        ("http://target:50053", "is a URL; give the address as HOST:PORT, e.g. 'target:50053'"),
        ("dns:///target", "'target' in 'dns:///target' is not HOST:PORT"),
        ("dns:///:50053", "is not HOST:PORT"),
    ]:
        with pytest.raises(ValueError, match=says):
            parse_replica_address(bad)
    assert endpoint_of("10.0.0.7", 50053) == "ipv4:10.0.0.7:50053"
    assert endpoint_of("fd00::7", 50053) == "ipv6:[fd00::7]:50053"


def picks(replicas: Replicas, sessions: list[str]) -> dict[str, str]:
    return {s: replicas.pick(s).endpoint for s in sessions}


def test_sessions_spread_evenly_and_a_removed_replica_moves_only_its_own_sessions():
    """Rendezvous hashing: 3,000 sessions over 3 replicas, each gets 30-37%; removing one
    moves exactly its sessions, spread over the other two; adding it back restores every
    session's replica."""

    async def run():
        endpoints = [f"127.0.0.1:{port}" for port in (7001, 7002, 7003)]  # never connected
        replicas = Replicas(ReplicaAddress(endpoints=tuple(endpoints)), pb_grpc.TargetStub)
        await replicas.start()
        sessions = [f"session-{i}" for i in range(3000)]
        before = picks(replicas, sessions)
        replicas.update(endpoints[:2])
        after = picks(replicas, sessions)
        replicas.update(endpoints)
        again = picks(replicas, sessions)
        await replicas.close()
        return endpoints, before, after, again

    endpoints, before, after, again = asyncio.run(run())
    shares = Counter(before.values())
    assert set(shares) == set(endpoints)
    assert all(0.30 < n / 3000 < 0.37 for n in shares.values()), shares
    moved = {s for s in before if before[s] != after[s]}
    assert moved == {s for s, e in before.items() if e == endpoints[2]}
    assert 0.4 < Counter(after[s] for s in moved)[endpoints[0]] / len(moved) < 0.6
    assert again == before


async def bare_server() -> tuple[grpc.aio.Server, str]:
    """A gRPC server with no services, on loopback: a channel to it connects (READY)."""
    server = grpc.aio.server()
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


@contextlib.asynccontextmanager
async def bare_replicas(count: int, *more: str):
    """(Replicas, endpoints) of `count` bare servers on loopback, then the endpoints `more`,
    started; closed, and the servers stopped, on the way out."""
    servers = [await bare_server() for _ in range(count)]
    endpoints = (*(address for _, address in servers), *more)
    replicas = Replicas(ReplicaAddress(endpoints=endpoints), pb_grpc.TargetStub)
    try:
        await replicas.start()
        yield replicas, endpoints
    finally:
        await replicas.close()
        for server, _ in servers:
            await server.stop(None)


async def wait_until(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline
        await asyncio.sleep(0.05)


def test_a_failed_replica_is_skipped_for_a_while_and_its_sessions_come_back_once_it_connects(monkeypatch):
    monkeypatch.setattr("coordinator.replicas.DOWN_S", 0.3)

    async def run():
        async with bare_replicas(2) as (replicas, endpoints):
            sessions = [f"s{i}" for i in range(200)]
            before = picks(replicas, sessions)
            first = replicas.replicas[endpoints[0]]
            first.failed()
            assert first.down_until - time.monotonic() == pytest.approx(0.3, abs=0.1)
            during = picks(replicas, sessions)
            usable_during = replicas.usable_count()
            await wait_until(lambda: not first.recovering)  # DOWN_S later, connected
            after = picks(replicas, sessions)
            replicas.replicas[endpoints[1]].failed()
            first.failed()
            all_down = picks(replicas, sessions)  # nowhere better to go: each session's own replica
        return endpoints, before, during, usable_during, after, all_down

    endpoints, before, during, usable_during, after, all_down = asyncio.run(run())
    assert set(during.values()) == {endpoints[1]} and usable_during == 1
    assert Counter(before.values())[endpoints[0]] > 50
    assert after == before == all_down


def test_a_failed_replica_that_accepts_connections_but_answers_nothing_stays_skipped_after_its_down_time(monkeypatch):
    """A frozen replica (a hung host, SIGSTOP): its kernel still accepts TCP, nothing answers.
    Once its DOWN_S passed it was called again while its channel was connecting, and each call
    waited for gRPC's 20 s connect timeout, every DOWN_S, for as long as it stayed frozen. Now a
    replica that failed is called again only once its channel has connected."""
    import socket

    monkeypatch.setattr("coordinator.replicas.DOWN_S", 0.3)
    mute = socket.create_server(("127.0.0.1", 0))  # listens (the kernel completes handshakes), never answers

    async def run():
        async with bare_replicas(1, f"127.0.0.1:{mute.getsockname()[1]}") as (replicas, endpoints):
            sessions = [f"s{i}" for i in range(200)]
            frozen = replicas.replicas[endpoints[1]]
            frozen.failed()
            await asyncio.sleep(2.0)  # well past DOWN_S: its channel tried to connect meanwhile
            state = frozen.channel.get_state()
            chosen = picks(replicas, sessions)
            usable = replicas.usable_count()
        return endpoints, state, chosen, usable

    try:
        endpoints, state, chosen, usable = asyncio.run(run())
    finally:
        mute.close()
    assert set(chosen.values()) == {endpoints[0]} and usable == 1
    assert state in (grpc.ChannelConnectivity.CONNECTING, grpc.ChannelConnectivity.TRANSIENT_FAILURE)


def test_a_failed_replica_whose_health_says_not_serving_stays_skipped_until_it_says_serving(monkeypatch):
    """A model service whose worker is wedged (a hung device: serving.ModelWorker) still
    connects and answers health NOT_SERVING. Once its DOWN_S passed it was called again, and
    refused at once, every DOWN_S for as long as its pass hung: its sessions moved back and
    away each time. Now a replica that failed is called again only once its health says
    SERVING; one with no health service (a proxy) once its channel has connected."""
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    monkeypatch.setattr("coordinator.replicas.DOWN_S", 0.3)
    monkeypatch.setattr("coordinator.replicas.RECONNECT_CHECK_S", 0.05)

    async def run():
        wedged = grpc.aio.server()
        checks = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(checks, wedged)
        wedged_endpoint = f"127.0.0.1:{wedged.add_insecure_port('127.0.0.1:0')}"
        await wedged.start()
        await checks.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        try:
            async with bare_replicas(1, wedged_endpoint) as (replicas, endpoints):
                sessions = [f"s{i}" for i in range(200)]
                before = picks(replicas, sessions)
                hung = replicas.replicas[endpoints[1]]
                hung.failed()
                await asyncio.sleep(1.0)  # well past DOWN_S: connected, and asked its health meanwhile
                state, during = hung.channel.get_state(), picks(replicas, sessions)
                await checks.set("", health_pb2.HealthCheckResponse.SERVING)  # its pass ended
                await wait_until(lambda: not hung.recovering, timeout_s=2.0)
                after = picks(replicas, sessions)
        finally:
            await wedged.stop(None)
        return endpoints, before, state, during, after

    endpoints, before, state, during, after = asyncio.run(run())
    assert state == grpc.ChannelConnectivity.READY
    assert set(during.values()) == {endpoints[0]}, "a replica whose health says NOT_SERVING was called again"
    assert Counter(before.values())[endpoints[1]] > 50 and after == before


def test_a_replica_removed_while_it_recovers_ends_its_recovery_without_an_error(monkeypatch):
    """A failed replica that its address no longer names (a pod gone) has its recovery task
    cancelled; and a health check on a channel closed meanwhile (a traced channel starts its
    call a task later) reads as not serving, where it raised out of the task."""
    monkeypatch.setattr("coordinator.replicas.DOWN_S", 0.05)

    async def run():
        async with bare_replicas(2) as (replicas, endpoints):
            gone = replicas.replicas[endpoints[1]]
            gone.failed()
            replicas.update([endpoints[0]])
            await asyncio.sleep(0.2)
            await gone.channel.close()
            return gone.recovery.cancelled(), await gone.says_serving()

    assert asyncio.run(run()) == (True, False)


def test_a_draft_service_answers_a_propose_first_thing_so_a_frozen_replica_is_told_from_a_busy_one(tiny_stack):
    """Over real gRPC (`DraftCall.answered`, which decides whether a Propose that ran out of
    time marks its replica failed): the draft service sends PROPOSE_STARTED before it looks at
    the call at all (here one for a session it does not know, refused NOT_FOUND after), so a
    call that then runs past its budget, prefilling say, is known to have reached a live
    service; a host that accepts connections and answers nothing (frozen) never sends it."""
    import socket

    from opentelemetry import trace

    from coordinator.cycles import DraftCall
    from coordinator.replicas import Replica

    class Stub:
        def __init__(self, channel, metadata):
            self.stub, self.metadata = pb_grpc.DraftStub(channel), metadata

        def Propose(self, request, timeout=None):
            return self.stub.Propose(request, timeout=timeout, metadata=self.metadata)

    mute = socket.create_server(("127.0.0.1", 0))  # listens (the kernel completes handshakes), never answers
    request = pb.ProposeRequest(session_id="ghost", position=0, new_tokens=[5], k=2,
                                sampling=pb.SamplingParams(temperature=0.0, seed=1))  # fmt: skip

    async def ask(address: str, credentials) -> tuple[grpc.StatusCode, bool]:
        channel = (grpc.aio.insecure_channel(address) if credentials is None
                   else grpc.aio.secure_channel(address, credentials))  # fmt: skip
        try:
            replica = Replica(address, channel, Stub(channel, tiny_stack.internal_metadata))
            call = DraftCall(replica, request, 1.0, frozenset(), trace.get_tracer("test"))
            with pytest.raises(grpc.aio.AioRpcError) as failure:
                await call.first(2)
            return failure.value.code(), await call.answered()
        finally:
            await channel.close()

    try:
        live = asyncio.run(ask(f"127.0.0.1:{tiny_stack.ports['draft']}", tiny_stack.channel_credentials()))
        frozen = asyncio.run(ask(f"127.0.0.1:{mute.getsockname()[1]}", None))
    finally:
        mute.close()
    assert live == (grpc.StatusCode.NOT_FOUND, True)
    assert frozen == (grpc.StatusCode.DEADLINE_EXCEEDED, False)


def test_a_tls_file_unreadable_at_a_dns_refresh_is_logged_and_the_refresh_goes_on(tmp_path, caplog):
    """A dns:/// refresh opens a channel to each new address, reading the CA file then (so a
    rotated one is taken). Unreadable for a moment (a secret being rotated), its SystemExit
    (read_pem's error for a bad flag at start) ended the refresh task and, raised from a task,
    the coordinator's event loop: the process exited."""
    from conftest import make_ca, save_pair
    from specdec.security import ChannelSecurity

    ca, _ = save_pair(tmp_path, "ca", *make_ca("refresh test CA"))
    resolved = [["10.0.0.1"]]

    async def resolver(host: str, port: int) -> list[str]:
        return resolved[-1]

    async def run():
        replicas = Replicas(ReplicaAddress(host="replicas.test", port=50053), pb_grpc.TargetStub,
                            ChannelSecurity(tls_ca=ca), refresh_s=0.05, resolver=resolver)  # fmt: skip
        try:
            await replicas.start()
            os.rename(ca, f"{ca}.away")
            resolved.append(["10.0.0.1", "10.0.0.2"])
            await asyncio.sleep(0.3)  # a few refreshes
            during = sorted(replicas.replicas), replicas.refresher.done()
            os.rename(f"{ca}.away", ca)
            await wait_until(lambda: len(replicas.replicas) == 2)
            return during
        finally:
            await replicas.close()

    with caplog.at_level("ERROR", logger="specdec.coordinator"):
        endpoints, refresher_ended = asyncio.run(run())
    assert endpoints == ["ipv4:10.0.0.1:50053"] and not refresher_ended
    assert "cannot open a channel to a new replica (cannot read the CA certificate" in caplog.text


def test_target_replicas_are_checked_against_the_adopted_model_and_one_serving_another_is_never_picked():
    """Replicas with an identity (the coordinator's targets): the replica whose ModelInfo the
    coordinator adopted is checked; the others are asked in the background and become
    checked (same model and vocabulary) or refused (another model); only checked ones are
    picked, with every replica refused pick says which model each side serves, and a refused
    replica that serves the adopted model again is taken back."""
    from coordinator.replicas import target_identity

    infos = {
        "127.0.0.1:7001": pb.ModelInfoResponse(model="smol", vocab_fingerprint="v1", vocab_size=9, eos_token_ids=[2]),
        "127.0.0.1:7002": pb.ModelInfoResponse(model="smol", vocab_fingerprint="v1", vocab_size=9, eos_token_ids=[2]),
        "127.0.0.1:7003": pb.ModelInfoResponse(model="smol-v2", vocab_fingerprint="v1", vocab_size=9, eos_token_ids=[2]),
    }

    async def run():
        replicas = Replicas(ReplicaAddress(endpoints=tuple(infos)), pb_grpc.TargetStub, identity=target_identity,
                            refresh_s=0.05)  # a refused replica is asked again this often
        await replicas.start()
        for endpoint, replica in replicas.replicas.items():
            async def model_info(request, timeout=None, endpoint=endpoint):
                return infos[endpoint]
            replica.stub = SimpleNamespace(ModelInfo=model_info)
        assert replicas.usable_count() == 0
        with pytest.raises(Unavailable, match="has answered yet"):
            replicas.pick("s")
        first = replicas.replicas["127.0.0.1:7001"]
        replicas.adopt(first, infos["127.0.0.1:7001"])
        await replicas.settle()
        checked = {e for e, r in replicas.replicas.items() if r.checked}
        refused = {e: r.refused for e, r in replicas.replicas.items() if r.refused}
        chosen = set(picks(replicas, [f"s{i}" for i in range(200)]).values())
        usable = replicas.usable_count()
        replicas.update(["127.0.0.1:7003"])  # only the replica serving another model is left
        with pytest.raises(Unavailable) as info:
            replicas.pick("s")
        infos["127.0.0.1:7003"] = infos["127.0.0.1:7001"]  # it serves the adopted model again
        for _ in range(100):
            if replicas.usable_count():
                break
            await asyncio.sleep(0.02)
        back = replicas.pick("s").endpoint
        await replicas.close()
        return checked, refused, chosen, usable, str(info.value), back

    checked, refused, chosen, usable, message, back = asyncio.run(run())
    assert back == "127.0.0.1:7003", "a refused replica serving the adopted model again is taken back"
    assert checked == chosen == {"127.0.0.1:7001", "127.0.0.1:7002"} and usable == 2
    assert refused == {"127.0.0.1:7003": "127.0.0.1:7003 serves smol-v2 (vocabulary v1)"}
    assert "differs from what this coordinator serves, smol (vocabulary v1)" in message
    assert "smol-v2" in message and "restart the coordinator" in message


def test_once_every_target_replica_serves_one_other_model_of_the_same_vocabulary_it_is_adopted_and_not_before():
    """follow_rollout (the coordinator's targets): a replica serving other weights is refused
    while any replica serves the adopted model; once the replicas left all serve one other
    model of the adopted vocabulary, it is adopted and they are picked. Replicas serving two
    different new models, or a model of another vocabulary, are not adopted: pick stays
    Unavailable, saying to restart the coordinator."""
    from coordinator.replicas import target_identity

    def info(model, vocabulary, weights):
        return pb.ModelInfoResponse(model=model, vocab_fingerprint=vocabulary, weights_fingerprint=weights, vocab_size=9)

    old, tuned = info("smol", "v1", "w1"), info("smol", "v1", "w2")
    infos = {"127.0.0.1:7001": old, "127.0.0.1:7002": tuned, "127.0.0.1:7003": tuned,
             "127.0.0.1:7004": info("smol", "v1", "w3"), "127.0.0.1:7005": info("smol", "v1", "w5"),
             "127.0.0.1:7006": info("big", "v2", "w4")}  # fmt: skip

    async def settled(replicas, endpoints):
        replicas.update(endpoints)
        for replica in replicas.replicas.values():
            async def model_info(request, timeout=None, endpoint=replica.endpoint):
                return infos[endpoint]
            replica.stub = SimpleNamespace(ModelInfo=model_info)
        await replicas.settle()
        replicas.follow()  # as the end of update() and every refused check do
        return replicas

    async def run():
        replicas = Replicas(ReplicaAddress(endpoints=tuple(infos)), pb_grpc.TargetStub, identity=target_identity,
                            refresh_s=0.05, follow_rollout=True)  # fmt: skip
        await settled(replicas, ["127.0.0.1:7001", "127.0.0.1:7002"])
        replicas.adopt(replicas.replicas["127.0.0.1:7001"], old)
        await replicas.settle()
        during = (replicas.adopted.weights_fingerprint, replicas.refused_count(), replicas.pick("s").endpoint)
        await settled(replicas, ["127.0.0.1:7002", "127.0.0.1:7003"])  # the old replica is gone
        after = (replicas.adopted.weights_fingerprint, replicas.refused_count(),
                 set(picks(replicas, [f"s{i}" for i in range(50)]).values()))  # fmt: skip
        messages = []
        for endpoints in (["127.0.0.1:7004", "127.0.0.1:7005"], ["127.0.0.1:7006"]):
            await settled(replicas, endpoints)
            with pytest.raises(Unavailable) as refused:
                replicas.pick("s")
            messages.append((replicas.adopted.weights_fingerprint, str(refused.value)))
        await replicas.close()
        return during, after, messages

    during, after, messages = asyncio.run(run())
    assert during == ("w1", 1, "127.0.0.1:7001"), "refused while a replica serves the adopted model"
    assert after == ("w2", 0, {"127.0.0.1:7002", "127.0.0.1:7003"}), "the rollout's model adopted"
    (mixed_adopted, mixed), (other_adopted, other) = messages
    assert mixed_adopted == other_adopted == "w2"
    assert "smol (vocabulary v1, weights w3)" in mixed and "restart the coordinator" in mixed
    assert "big (vocabulary v2, weights w4)" in other and "restart the coordinator" in other


def test_a_single_target_address_that_refuses_a_verify_is_asked_what_it_serves_and_a_rollout_there_followed():
    """One fixed --target-address is never checked nor refused (it may be a load balancer);
    after it refused a call, recheck asks its ModelInfo: other weights of the adopted
    vocabulary are adopted; another vocabulary, the same model, a service still loading or not
    answering, or follow_rollout off, change nothing. The call is never retried elsewhere."""
    from coordinator.replicas import target_identity

    def info(vocabulary, weights, vocab_size=9):
        return pb.ModelInfoResponse(model="smol", vocab_fingerprint=vocabulary, weights_fingerprint=weights,
                                    vocab_size=vocab_size)  # fmt: skip

    old = info("v1", "w1")
    answers = [info("v2", "w9"), info("v1", "w1"), info("v1", "w2", vocab_size=0), None, info("v1", "w2")]

    async def run(follow_rollout):
        replicas = Replicas(ReplicaAddress(endpoints=("127.0.0.1:7001",)), pb_grpc.TargetStub,
                            identity=target_identity, follow_rollout=follow_rollout)  # fmt: skip
        await replicas.start()
        replica = replicas.replicas["127.0.0.1:7001"]
        replicas.adopt(replica, old)
        adopted = []
        for answer in answers:
            async def model_info(request, timeout=None, answer=answer):
                if answer is None:
                    raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, None, None, "down")
                return answer
            replica.stub = SimpleNamespace(ModelInfo=model_info)
            assert await replicas.recheck(replica) is False
            adopted.append(replicas.adopted.weights_fingerprint)
        picked = replicas.pick("s").endpoint
        await replicas.close()
        return adopted, picked

    assert asyncio.run(run(True)) == (["w1", "w1", "w1", "w1", "w2"], "127.0.0.1:7001")
    assert asyncio.run(run(False)) == (["w1"] * 5, "127.0.0.1:7001")


def test_with_several_target_replicas_an_unavailable_verify_is_retried_until_the_deadline_not_given_up():
    """With one target a lost connection is waited for (wait_for_ready) and the retries end
    after TARGET_RETRY_BACKOFF_S; with several, calls fail fast, so UNAVAILABLE goes on being
    retried at the last pause (the request's deadline ends it), while other codes still end."""
    from coordinator.cycles import TARGET_RETRY_BACKOFF_S, target_retry_pause

    unavailable, exhausted = grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED
    steps = len(TARGET_RETRY_BACKOFF_S)
    for single in (True, False):
        assert [target_retry_pause(unavailable, a, single) for a in range(steps)] == list(TARGET_RETRY_BACKOFF_S)
        assert target_retry_pause(exhausted, steps, single) is None
        assert target_retry_pause(grpc.StatusCode.INVALID_ARGUMENT, 0, single) is None
    assert target_retry_pause(unavailable, steps, single=True) is None
    assert target_retry_pause(unavailable, steps + 100, single=False) == TARGET_RETRY_BACKOFF_S[-1]


def test_a_dns_address_follows_what_the_name_resolves_to_and_keeps_its_replicas_when_resolving_fails():
    answers = [["10.0.0.1", "10.0.0.2"], ["10.0.0.2", "10.0.0.3", "fd00::4"], OSError("no such host"), [], ["10.0.0.3"]]

    async def resolver(host, port):
        assert (host, port) == ("target.example", 50053)
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    async def run():
        replicas = Replicas(parse_replica_address("dns:///target.example:50053"), pb_grpc.TargetStub,
                            refresh_s=3600, resolver=resolver)  # fmt: skip
        seen = []
        await replicas.start()
        seen.append(sorted(replicas.replicas))
        for _ in range(4):
            await replicas.refresh()
            seen.append(sorted(replicas.replicas))
        assert not replicas.single
        await replicas.close()
        return seen

    seen = asyncio.run(run())
    assert seen == [
        ["ipv4:10.0.0.1:50053", "ipv4:10.0.0.2:50053"],
        ["ipv4:10.0.0.2:50053", "ipv4:10.0.0.3:50053", "ipv6:[fd00::4]:50053"],
        ["ipv4:10.0.0.2:50053", "ipv4:10.0.0.3:50053", "ipv6:[fd00::4]:50053"],  # OSError: kept
        ["ipv4:10.0.0.2:50053", "ipv4:10.0.0.3:50053", "ipv6:[fd00::4]:50053"],  # nothing: kept
        ["ipv4:10.0.0.3:50053"],
    ]


def test_the_coordinator_refuses_a_malformed_replica_address_before_it_starts():
    result = subprocess.run(
        [sys.executable, "-m", "specdec.cli", "serve", "coordinator", "--target-address", "10.0.0.1:50053,10.0.0.2"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2
    assert "argument --target-address: '10.0.0.2' in '10.0.0.1:50053,10.0.0.2' is not HOST:PORT" in result.stderr


# ---------------------------------------------------------------- through the services


def test_a_dns_replica_is_reached_by_its_ip_and_its_tls_certificate_checked_against_the_name(
    tmp_path, redis_url, tiny_models
):
    """dns:///localhost:PORT connects to the address localhost resolves to, and TLS checks the
    target's certificate against `localhost`, the name: a certificate for localhost alone (not
    for 127.0.0.1) is accepted through the name and refused through the IP."""
    from cryptography import x509

    from conftest import make_ca, make_leaf, save_pair
    from specdec.security import ChannelSecurity, TokenSource

    ca_key, ca_cert = make_ca("replica test CA")
    ca, _ = save_pair(tmp_path, "ca", ca_key, ca_cert)
    cert, key = save_pair(tmp_path, "leaf", *make_leaf(ca_key, ca_cert, "target", names=[x509.DNSName("localhost")]))
    port, token = free_port(), "replica-test-token"
    command = [sys.executable, "-m", "specdec.cli", "serve", "target", "--model", tiny_models.target, "--threads", "1",
               "--host", "127.0.0.1", "--port", str(port), "--tls-cert", cert, "--tls-key", key]  # fmt: skip
    env = {**os.environ, "SPECDEC_REDIS_URL": redis_url, "SPECDEC_INTERNAL_TOKEN": token}
    security = ChannelSecurity(tls_ca=ca, source=TokenSource({token: ""}))

    async def model_info(address: str, wait_s: float):
        replicas = Replicas(parse_replica_address(address), pb_grpc.TargetStub, security)
        await replicas.start()
        deadline = time.monotonic() + wait_s
        try:
            while True:
                try:
                    return await replicas.any().stub.ModelInfo(pb.ModelInfoRequest(), timeout=5)
                except grpc.aio.AioRpcError as exc:
                    if exc.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                        return exc
                    await asyncio.sleep(0.3)
        finally:
            await replicas.close()

    with subprocess.Popen(command, env=env) as target:
        try:
            through_name = asyncio.run(model_info(f"dns:///localhost:{port}", wait_s=120))
            through_ip = asyncio.run(model_info(f"127.0.0.1:{port}", wait_s=0))
        finally:
            target.terminate()
    assert isinstance(through_name, pb.ModelInfoResponse), through_name
    assert through_name.model == tiny_models.target
    assert isinstance(through_ip, grpc.aio.AioRpcError) and through_ip.code() == grpc.StatusCode.UNAVAILABLE


def by_service(port: int, name: str, service: str) -> float:
    """The sample `name` labelled service=`service` on the /metrics endpoint at `port`."""
    return scrape(port).get((name, (("service", service),)), 0.0)


def forward_passes(port: int, service: str = "target") -> float:
    return by_service(port, "specdec:forward_latency_seconds_count", service)


def wait_until_both_usable(metrics_port: int, service: str) -> None:
    """Wait until the coordinator at `metrics_port` calls both replicas of `service` again, one
    of them killed and restarted (DOWN_S after the kill)."""
    deadline = time.monotonic() + 30
    while by_service(metrics_port, "specdec:replicas_usable", service) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    # The gauge reads no channel state, but a session goes to a replica only while the channel to
    # it is not failing (Replica.usable): the one to the killed replica is back once it retries,
    # within its reconnect backoff (at most 1 s, +20% jitter). Sent sooner, a session went to the
    # other replica and nothing was refused (a CI run, once).
    time.sleep(2 * dict(CLIENT_OPTIONS)["grpc.max_reconnect_backoff_ms"] / 1000)


def owner(session_id: str, endpoints) -> str:
    """The replica among `endpoints` that rendezvous hashing gives `session_id`."""
    return max(endpoints, key=lambda endpoint: score(session_id, endpoint))


def picker(endpoints, wanted: str, prefix: str) -> str:
    """A session id whose replica among `endpoints` is `wanted`."""
    return next(s for s in (f"{prefix}-{i}" for i in range(100)) if owner(s, endpoints) == wanted)


@pytest.fixture(scope="module")
def two_of_each(redis_url, tiny_models, tmp_path_factory):
    """A tiny stack (one draft, one target, its coordinator) plus a second target and a second
    draft process, and a coordinator (`spread`) that names both of each. Every process but
    the stack's coordinator serves /metrics: `targets` and `drafts` map each replica's address
    to its /metrics port. The targets load the tiny target through a link, `target_link`, as
    pods load whatever their model path holds (a rollout may put other weights there)."""
    ports = {name: free_port() for name in ("target", "second-target", "draft", "second-draft", "spread")}
    target_link = tmp_path_factory.mktemp("rollout") / "target"
    target_link.symlink_to(tiny_models.target)
    stack = start_stack(redis_url, str(target_link), tiny_models.draft,
                        target_args=["--metrics-port", str(ports["target"])],
                        draft_args=["--metrics-port", str(ports["draft"])])  # fmt: skip
    try:
        for name in ("second-target", "second-draft"):  # loading side by side
            stack.add_replica(name, name.split("-")[1], "--metrics-port", str(ports[name]), wait=False)
        stack.wait_ready(("second-target", "second-draft"))
        targets = {f"127.0.0.1:{stack.ports[name]}": ports[name] for name in ("target", "second-target")}
        drafts = {f"127.0.0.1:{stack.ports[name]}": ports[name] for name in ("draft", "second-draft")}
        address = stack.add_coordinator("spread", "--target-address", ",".join(targets), "--draft-address",
                                        ",".join(drafts), "--metrics-port", str(ports["spread"]))  # fmt: skip
        yield SimpleNamespace(stack=stack, address=address, targets=targets, drafts=drafts, metrics=ports["spread"],
                              target_link=target_link)  # fmt: skip
    finally:
        stack.stop()


def test_each_session_keeps_to_the_one_target_replica_its_id_picks_and_sessions_spread(two_of_each, tiny_models):
    """Ten greedy requests through the coordinator in front of two targets, one at a time:
    every forward pass of a request runs on the replica rendezvous hashing picks for its
    session id, both replicas serve some sessions, no replica keeps a session afterwards (its
    Release went where its cache was), and the tokens are those of the one-target stack."""
    stack, address, metrics_ports = two_of_each.stack, two_of_each.address, two_of_each.targets
    prompt_ids = tiny_models.tokenizer.encode(PROMPT)
    options = dict(prompt_token_ids=prompt_ids, max_new_tokens=24, **OPTIONS)
    with specdec.Client(stack.address) as client:
        expected = client.generate(**options).token_ids
    # Sessions spread: over 400 ids each replica gets 35-65% (6 standard deviations of a fair
    # split). Ten ids alone all fall on one replica once in 512 runs (the ports are random), so the
    # requests below take the first id of each replica and eight more.
    spread = Counter(owner(f"spread-{i}", metrics_ports) for i in range(400))
    assert len(spread) == 2 and all(140 <= n <= 260 for n in spread.values()), spread
    session_ids = [picker(metrics_ports, target, "replica-test") for target in metrics_ports]
    session_ids += [f"replica-test-{i}" for i in range(100) if f"replica-test-{i}" not in session_ids][:8]
    served = Counter()
    with specdec.Client(address) as client:
        for session_id in session_ids:
            chosen = owner(session_id, metrics_ports)
            before = {t: forward_passes(p) for t, p in metrics_ports.items()}
            assert client.generate(session_id=session_id, **options).token_ids == expected
            after = {t: forward_passes(p) for t, p in metrics_ports.items()}
            ran = {t for t in metrics_ports if after[t] > before[t]}
            assert ran == {chosen}, f"session {session_id}: forward passes on {ran}, expected only {chosen}"
            served[chosen] += 1
    assert len(served) == 2, served
    for service in ("target", "draft"):
        known = by_service(two_of_each.metrics, "specdec:replicas", service)
        assert known == by_service(two_of_each.metrics, "specdec:replicas_usable", service) == 2
    for name in ("target", "second-target"):
        held = internal_stub(stack, name).ModelInfo(pb.ModelInfoRequest(), timeout=10)
        assert held.sessions_held == 0, f"{name} still holds {held.sessions_held} session(s)"


def test_sessions_of_one_affinity_key_go_to_the_replica_it_picks_and_a_delete_releases_them_there(two_of_each, tiny_models):
    """Two sessions whose ids pick the other target replica, both with affinity_key
    "conversation-7": every forward pass of both runs on the replica the key picks (so a
    conversation's turns find each other's caches), the second copies the first's prompt from its
    kept cache there, and deleting them releases the kept cache on that replica."""
    stack, address, metrics_ports = two_of_each.stack, two_of_each.address, two_of_each.targets
    chosen = owner("conversation-7", metrics_ports)
    (name,) = [n for n in ("target", "second-target") if chosen.endswith(f":{stack.ports[n]}")]
    cache_bytes = lambda: internal_stub(stack, name).ModelInfo(pb.ModelInfoRequest(), timeout=10).cache_bytes
    reused = lambda: by_service(metrics_ports[chosen], "specdec:prefix_reused_tokens_total", "target")
    prompt = tiny_models.tokenizer.encode("one conversation, its turns on one replica")
    options = dict(max_new_tokens=24, affinity_key="conversation-7", **OPTIONS)
    (other,) = set(metrics_ports) - {chosen}
    session_ids = [picker(metrics_ports, other, "affinity"), picker(metrics_ports, other, "affinity-turn-2")]
    kept_before, reused_before = cache_bytes(), reused()
    with specdec.Client(address) as client:
        before = {t: forward_passes(p) for t, p in metrics_ports.items()}
        first = client.generate(session_id=session_ids[0], prompt_token_ids=prompt, **options).token_ids
        client.generate(session_id=session_ids[1], prompt_token_ids=prompt + first, **options)
        ran = {t for t, p in metrics_ports.items() if forward_passes(p) > before[t]}
        assert ran == {chosen}, f"forward passes on {ran}, expected only {chosen}"
        assert reused() - reused_before >= len(prompt)
        deadline = time.monotonic() + 10
        while cache_bytes() == kept_before:  # the finished sessions' release, in the background
            assert time.monotonic() < deadline, "the finished sessions' caches should be kept"
            time.sleep(0.1)
        assert all(client.delete(session_id) for session_id in session_ids)
    while cache_bytes() != kept_before:
        assert time.monotonic() < deadline + 10, "a delete should drop the kept cache where the key put it"
        time.sleep(0.1)


def test_a_delete_drops_the_sessions_caches_on_every_replica_where_a_failover_left_a_copy(two_of_each, tiny_models):
    """A session served on one target and one draft replica, whose calls a failover once sent to
    the others (here: a Verify and a Propose sent there directly, as the coordinator does after a
    failover), holds a cache on every replica. Its Delete drops them all: it went to the replicas
    the session's id picks alone, and the copies elsewhere stayed held until evicted."""
    stack, address = two_of_each.stack, two_of_each.address
    session_id = "deleted-everywhere"
    others = {}  # service -> the process name of the replica the session's id does not pick
    for service, endpoints in (("target", two_of_each.targets), ("draft", two_of_each.drafts)):
        (other,) = set(endpoints) - {owner(session_id, endpoints)}
        others[service] = next(n for n in (service, f"second-{service}") if other.endswith(f":{stack.ports[n]}"))
    held = lambda name: internal_stub(stack, name).ModelInfo(pb.ModelInfoRequest(), timeout=10).sessions_held
    prompt = tiny_models.tokenizer.encode(PROMPT)
    sampling = pb.SamplingParams(temperature=0.0, seed=1)
    with specdec.Client(address) as client:
        client.generate(session_id=session_id, prompt_token_ids=prompt, max_new_tokens=8, **OPTIONS)
        before = {name: held(name) for name in others.values()}
        internal_stub(stack, others["target"]).Verify(
            pb.VerifyRequest(session_id=session_id, position=0, new_tokens=prompt, sampling=sampling), timeout=10)
        list(internal_stub(stack, others["draft"]).Propose(
            pb.ProposeRequest(session_id=session_id, position=0, new_tokens=prompt, k=1, sampling=sampling), timeout=10))
        assert {name: held(name) for name in others.values()} == {name: n + 1 for name, n in before.items()}
        assert client.delete(session_id)
    deadline = time.monotonic() + 10
    while {name: held(name) for name in others.values()} != before:  # the Delete's releases, in the background
        assert time.monotonic() < deadline, "a copy a failover left on another replica is still held"
        time.sleep(0.1)


def test_a_resumed_session_keeps_to_the_replica_its_affinity_key_picks(two_of_each, tiny_models):
    """A stream with an affinity key, given up after two chunks and resumed: the Resume reads the
    key from the session's record, so every pass, before and after, runs on the key's replica
    (its id picks the other), and the tokens are those of an unbroken run."""
    address, metrics_ports = two_of_each.address, two_of_each.targets
    chosen = owner("conversation-8", metrics_ports)
    (other,) = set(metrics_ports) - {chosen}
    session_id = picker(metrics_ports, other, "affinity-resumed")
    options = dict(prompt_token_ids=tiny_models.tokenizer.encode(PROMPT), max_new_tokens=40, **OPTIONS)
    with specdec.Client(address, retries=0) as client:
        expected = client.generate(affinity_key="conversation-8", **options).token_ids
        before = {t: forward_passes(p) for t, p in metrics_ports.items()}
        stream = client.generate_stream(session_id=session_id, affinity_key="conversation-8", **options)
        received = [token for chunk in itertools.islice(stream, 2) for token in chunk.token_ids]
        stream.close()
        rest = client.resume(session_id, received_tokens=len(received)).token_ids
    assert received + rest == expected
    ran = {t for t, p in metrics_ports.items() if forward_passes(p) > before[t]}
    assert ran == {chosen}, f"forward passes on {ran}, expected only {chosen}"


def test_replicas_serving_another_target_model_or_draft_vocabulary_are_refused_and_get_no_session(
    two_of_each, tiny_models, tmp_path
):
    """A coordinator in front of two target and two draft replicas, the second target started
    with another model (the tiny draft's weights: the same vocabulary) and the second draft
    with another vocabulary (four more characters), both as the coordinator starts: it keeps
    the target model and draft vocabulary it started with, counts each odd replica as known
    and refused, and every session runs on the first target and drafts on the first draft:
    no forward pass on the odd ones, the tokens those of the one-target stack."""
    from conftest import make_tiny_model_dir
    from specdec.models import TINY_SYMBOLS, build_tiny_tokenizer

    stack = two_of_each.stack
    wider = build_tiny_tokenizer([*TINY_SYMBOLS, "0", "1", "2", "3"])
    odd_models = {"odd-target": tiny_models.draft,
                  "odd-draft": make_tiny_model_dir(wider, tmp_path / "wider", hidden_size=32, num_layers=1, seed=5)}
    ports = {name: free_port() for name in (*odd_models, "mixed")}
    odd = {name: stack.add_replica(name, name.split("-")[1], "--model", model, "--metrics-port", str(ports[name]),
                                   wait=False) for name, model in odd_models.items()}  # fmt: skip
    address = stack.add_coordinator("mixed", "--target-address", f"127.0.0.1:{stack.ports['target']},{odd['odd-target']}",
                                    "--draft-address", f"127.0.0.1:{stack.ports['draft']},{odd['odd-draft']}",
                                    "--metrics-port", str(ports["mixed"]))  # fmt: skip
    stack.wait_ready(tuple(odd_models))
    refused = lambda: [by_service(ports["mixed"], "specdec:replicas_refused", s) for s in ("target", "draft")]
    deadline = time.monotonic() + 30
    while refused() != [1, 1] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert refused() == [1, 1], "both odd replicas should be refused"
    for service in ("target", "draft"):
        assert by_service(ports["mixed"], "specdec:replicas", service) == 2
        assert by_service(ports["mixed"], "specdec:replicas_usable", service) == 1
    options = dict(prompt_token_ids=tiny_models.tokenizer.encode(PROMPT), max_new_tokens=24, **OPTIONS)
    with specdec.Client(stack.address) as client:
        expected = client.generate(**options).token_ids
    drafted = 0
    with specdec.Client(address) as client:
        assert client.info().target.model == str(two_of_each.target_link)
        for i in range(8):  # rendezvous hashing would give each odd replica about half of them
            result = client.generate(session_id=f"odd-{i}", **options)
            assert result.token_ids == expected
            drafted += result.stats.draft_tokens
    assert drafted > 0, "the sessions should draft on the first draft replica"
    assert forward_passes(ports["odd-target"]) == forward_passes(ports["odd-draft"], "draft") == 0


def test_a_draft_replica_killed_mid_stream_costs_a_cycle_of_drafts_then_the_session_drafts_on_the_other(
    two_of_each, tiny_models
):
    """SIGKILL the draft replica a running stream drafts on: its cycle runs target-only, the
    next ones draft on the other replica, and the tokens are the one-draft stack's."""
    stack, drafts = two_of_each.stack, two_of_each.drafts
    options = dict(prompt_token_ids=tiny_models.tokenizer.encode(PROMPT), max_new_tokens=600, **OPTIONS)
    with specdec.Client(stack.address) as client:
        expected = client.generate(**options).token_ids
    second = f"127.0.0.1:{stack.ports['second-draft']}"
    first = next(d for d in drafts if d != second)
    before = forward_passes(drafts[first], "draft")
    chunks = []
    with specdec.Client(two_of_each.address, retries=0) as client:
        for chunk in client.generate_stream(session_id=picker(drafts, second, "draft-killed"), **options):
            chunks.append(chunk)
            if len(chunks) == 3:
                stack.processes["second-draft"].send_signal(signal.SIGKILL)
    assert [t for c in chunks for t in c.token_ids] == expected
    assert forward_passes(drafts[first], "draft") > before, "the other draft replica never took the session over"
    drafted_after = sum(c.cycle.drafted for c in chunks[4:] if c.cycle is not None)
    print(f"\nsecond draft killed after 3 chunks; {drafted_after} tokens drafted in the {len(chunks) - 4} chunks after")
    assert drafted_after > 0


def test_a_draft_replica_restarted_on_another_vocabulary_refuses_the_propose_and_the_sessions_draft_on_the_other(
    two_of_each, tiny_models, tmp_path
):
    """The draft replica killed above comes back at the same address on a model of another
    vocabulary (four more characters): the coordinator had checked it before, so a session it
    owns asks it for drafts; the draft refuses that Propose (FAILED_PRECONDITION: the request
    names the vocabulary the coordinator expects), the coordinator checks the replica again and
    refuses it, and the session drafts on the other replica: the tokens are the one-draft
    stack's, the sessions draft, and no forward pass runs on the restarted replica (which used
    to draft every session it owned in ids the target does not share)."""
    from conftest import make_tiny_model_dir
    from specdec.models import TINY_SYMBOLS, build_tiny_tokenizer

    stack, drafts = two_of_each.stack, two_of_each.drafts
    assert stack.processes["second-draft"].poll() is not None, "the test before kills this replica"
    wider = build_tiny_tokenizer([*TINY_SYMBOLS, "0", "1", "2", "3"])
    stack.restart("second-draft", "--model", make_tiny_model_dir(wider, tmp_path / "wider", hidden_size=32,
                                                                  num_layers=1, seed=5))  # fmt: skip
    stack.wait_ready(("second-draft",))
    wait_until_both_usable(two_of_each.metrics, "draft")
    second = f"127.0.0.1:{stack.ports['second-draft']}"
    options = dict(prompt_token_ids=tiny_models.tokenizer.encode(PROMPT), max_new_tokens=24, **OPTIONS)
    with specdec.Client(stack.address) as client:
        expected = client.generate(**options).token_ids
    drafted = 0
    with specdec.Client(two_of_each.address, retries=0) as client:
        for i in range(3):
            result = client.generate(session_id=picker(drafts, second, f"other-vocabulary-{i}"), **options)
            assert result.token_ids == expected
            drafted += result.stats.draft_tokens
    assert drafted > 0, "the sessions should draft on the other replica"
    assert by_service(two_of_each.metrics, "specdec:replicas_refused", "draft") == 1
    assert by_service(two_of_each.metrics, "specdec:replicas_usable", "draft") == 1
    assert forward_passes(drafts[second], "draft") == 0


def test_a_target_replica_killed_mid_stream_hands_its_sessions_to_the_other_without_losing_a_token(
    two_of_each, tiny_models
):
    """SIGKILL the replica that serves a running stream: the stream goes on to its end on the
    other replica (which rebuilds the session from Redis), its tokens identical to the
    one-target stack's, and the coordinator's next sessions all go to the replica left."""
    stack, address, metrics_ports = two_of_each.stack, two_of_each.address, two_of_each.targets
    prompt_ids = tiny_models.tokenizer.encode(PROMPT)
    options = dict(prompt_token_ids=prompt_ids, max_new_tokens=600, **OPTIONS)
    with specdec.Client(stack.address) as client:
        unbroken_s = time.monotonic()
        expected = client.generate(**options).token_ids
        unbroken_s = time.monotonic() - unbroken_s
    second = f"127.0.0.1:{stack.ports['second-target']}"
    # A session id that picks the second replica, which is killed mid-stream.
    session_id = picker(metrics_ports, second, "target-killed")
    first = next(t for t in metrics_ports if t != second)
    tokens = []
    started = time.monotonic()
    before = forward_passes(metrics_ports[first])
    with specdec.Client(address, retries=0) as client:  # no Resume: the coordinator itself must carry on
        for n, chunk in enumerate(client.generate_stream(session_id=session_id, **options)):
            tokens += chunk.token_ids
            if n == 2:
                stack.processes["second-target"].send_signal(signal.SIGKILL)
                killed_at = len(tokens)
        print(f"\nsecond target killed after {killed_at} tokens; the stream ended after {len(tokens)} "
              f"in {time.monotonic() - started:.1f} s (unbroken, one target: {unbroken_s:.1f} s)")  # fmt: skip
        assert tokens == expected
        assert forward_passes(metrics_ports[first]) > before, "the first replica never took the session over"
        before = forward_passes(metrics_ports[first])
        for i in range(4):
            reply = client.generate(session_id=f"after-kill-{i}", **dict(options, max_new_tokens=12))
            assert reply.token_ids == expected[:12]
        assert forward_passes(metrics_ports[first]) > before


def test_a_target_replica_restarted_with_other_weights_at_its_model_path_refuses_the_sessions_verify_and_they_go_on_on_the_other(
    two_of_each, tiny_models, tmp_path
):
    """The replica killed above comes back at the same address with the same flags, but its
    model path now holds other weights (a fine-tune: the target's with 1% noise; the same name
    and vocabulary): the coordinator had checked it before, so a session it owns is sent there;
    the target refuses that Verify (FAILED_PRECONDITION: the request names the coordinator's
    model and weights), the coordinator checks the replica again, refuses it and sends the
    Verify to the session's next replica: the tokens are the one-target stack's and no forward
    pass runs on the restarted replica."""
    from conftest import make_tiny_model_dir

    stack, address, metrics_ports = two_of_each.stack, two_of_each.address, two_of_each.targets
    assert stack.processes["second-target"].poll() is not None, "the test before kills this replica"
    tuned = make_tiny_model_dir(tiny_models.tokenizer, tmp_path / "tuned", hidden_size=64, num_layers=2, seed=1,
                                noise=0.01)  # fmt: skip
    moved = tmp_path / "link"
    moved.symlink_to(tuned)
    moved.replace(two_of_each.target_link)  # the rollout: the model path now holds the fine-tune
    stack.restart("second-target")
    stack.wait_ready(("second-target",))
    second = f"127.0.0.1:{stack.ports['second-target']}"
    wait_until_both_usable(two_of_each.metrics, "target")
    options = dict(prompt_token_ids=tiny_models.tokenizer.encode(PROMPT), max_new_tokens=24, **OPTIONS)
    with specdec.Client(stack.address) as client:
        expected = client.generate(**options).token_ids
    with specdec.Client(address, retries=0) as client:
        for i in range(3):
            session_id = picker(metrics_ports, second, f"restarted-{i}")
            assert client.generate(session_id=session_id, **options).token_ids == expected
    assert by_service(two_of_each.metrics, "specdec:replicas_refused", "target") == 1
    assert by_service(two_of_each.metrics, "specdec:replicas_usable", "target") == 1
    assert forward_passes(metrics_ports[second]) == 0


def test_once_the_last_target_replica_serves_the_fine_tune_too_the_coordinator_adopts_it_and_older_sessions_cannot_resume(
    two_of_each, tiny_models
):
    """The rollout ends: the other target replica restarts with the fine-tune at its model path
    too. With no replica left serving the coordinator's weights, and both serving one other
    model of its vocabulary, the coordinator adopts that model (no restart): requests that
    began on the old weights end FAILED_PRECONDITION (or wait while the replica restarts), the
    next ones run on both replicas, the stack reports the fine-tune's weights, and a session
    made before the rollout cannot be resumed on the new weights."""
    stack, address, metrics_ports = two_of_each.stack, two_of_each.address, two_of_each.targets
    tuned = internal_stub(stack, "second-target").ModelInfo(pb.ModelInfoRequest(), timeout=10).weights_fingerprint
    options = dict(prompt_token_ids=tiny_models.tokenizer.encode(PROMPT), max_new_tokens=24, **OPTIONS)
    with specdec.Client(address) as client:
        client.generate(session_id="before-rollout", **options)  # on the first replica's old weights
    stack.restart("target")  # its model path, the link, holds the fine-tune since the test before
    stack.wait_ready(("target",))
    failures = []
    deadline = time.monotonic() + 30
    with specdec.Client(address, retries=0) as client:
        while True:  # until the coordinator has found both replicas on the fine-tune
            try:
                client.generate(session_id=f"rolled-out-{len(failures)}", **options)
                break
            except specdec.SpecdecClientError as exc:
                failures.append(exc.code)
                assert time.monotonic() < deadline, failures
                time.sleep(0.2)
        assert set(failures) <= {grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNAVAILABLE}, failures
        assert client.info().target.weights_fingerprint == tuned
        # The restarted replica failed calls while it started: it is skipped for DOWN_S after them.
        while by_service(two_of_each.metrics, "specdec:replicas_usable", "target") < 2:
            assert time.monotonic() < deadline + 30, "both replicas should be usable again"
            time.sleep(0.2)
        before = {t: forward_passes(p) for t, p in metrics_ports.items()}
        for i in range(8):
            assert len(client.generate(session_id=f"after-rollout-{i}", **options).token_ids) == 24
        ran = {t for t, p in metrics_ports.items() if forward_passes(p) > before[t]}
        with pytest.raises(specdec.SpecdecClientError) as refused:
            client.resume("before-rollout")
    assert ran == set(metrics_ports), "sessions spread over both replicas again"
    assert by_service(two_of_each.metrics, "specdec:replicas_refused", "target") == 0
    assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION and f"weights {tuned[:12]}" in refused.value.message


def test_a_coordinator_with_one_target_address_follows_a_restart_of_it_on_other_weights(redis_url, tiny_models, tmp_path):
    """The common one-target stack (`specdec up`, one --target-address): its target restarts with
    a fine-tune at its model path. The first request after ends FAILED_PRECONDITION (its Verify
    names the old weights), the coordinator asks the target what it serves and adopts it: the next
    requests run, `Info` reports the fine-tune's weights, and a session from before cannot resume
    on them. Before, every request failed until the coordinator restarted."""
    from conftest import make_tiny_model_dir

    link = tmp_path / "target"
    link.symlink_to(tiny_models.target)
    stack = start_stack(redis_url, str(link), tiny_models.draft)
    try:
        options = dict(prompt_token_ids=tiny_models.tokenizer.encode(PROMPT), max_new_tokens=16, **OPTIONS)
        with specdec.Client(stack.address) as client:
            client.generate(session_id="before-restart", **options)
            tuned = make_tiny_model_dir(tiny_models.tokenizer, tmp_path / "tuned", hidden_size=64, num_layers=2,
                                        seed=1, noise=0.01)  # fmt: skip
            moved = tmp_path / "moved"
            moved.symlink_to(tuned)
            moved.replace(link)
            stack.restart("target")
            stack.wait_ready(("target",))
            weights = internal_stub(stack, "target").ModelInfo(pb.ModelInfoRequest(), timeout=10).weights_fingerprint
            with pytest.raises(specdec.SpecdecClientError) as first:
                client.generate(session_id="at-the-switch", **options)
            assert first.value.code == grpc.StatusCode.FAILED_PRECONDITION
            assert len(client.generate(session_id="after-restart", **options).token_ids) == 16
            assert client.info().target.weights_fingerprint == weights
            with pytest.raises(specdec.SpecdecClientError) as refused:
                client.resume("before-restart")
        assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION
    finally:
        stack.stop()
