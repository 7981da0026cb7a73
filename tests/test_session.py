"""The Redis session store against a real redis-server: layout, fencing, TTL."""

import asyncio
import contextlib
from types import SimpleNamespace

import pytest

from specdec.errors import Aborted, AlreadyExists, InvalidArgument, NotFound, Unavailable
from specdec.session import SessionStore, meta_key, tokens_key


@pytest.fixture
def store(redis_url):
    store = SessionStore(redis_url, ttl_s=100)
    yield store
    asyncio.run(store.close())


def run(coro):
    return asyncio.run(coro)


def test_keys_share_one_hash_tag_so_a_session_lives_in_one_cluster_slot():
    assert meta_key("abc") == "specdec:{abc}:meta"
    assert tokens_key("abc") == "specdec:{abc}:tokens"


def test_a_redis_url_naming_a_database_redis_lacks_is_unavailable_saying_which_part_of_the_url_to_fix(redis_url):
    import grpc

    from specdec.errors import status_for

    async def go():
        store = SessionStore(redis_url.rsplit("/", 1)[0] + "/99", ttl_s=100)  # Redis has 16 databases
        try:
            with pytest.raises(Exception) as refused:
                await store.meta("s-any")
        finally:
            await store.close()
        return status_for(refused.value, quiet=True)

    code, message = run(go())
    assert code == grpc.StatusCode.UNAVAILABLE and "no database of the number its URL ends in" in message


def test_a_coordinator_whose_redis_does_not_answer_at_start_says_so_and_serves(tiny_stack, capfd):
    """A mistyped --redis-url left a stack saying `ready` with no word of it but each request's
    UNAVAILABLE; Redis down at start is still no reason to stop (it may come up later)."""
    import specdec
    from specdec.redis_server import free_port

    url = f"redis://127.0.0.1:{free_port()}/0"
    address = tiny_stack.add_coordinator("no-redis", "--redis-url", url)
    err = capfd.readouterr().err
    assert f"Redis at {url} does not answer" in err and "check --redis-url (SPECDEC_REDIS_URL)" in err
    with specdec.Client(address, retries=0) as client, pytest.raises(specdec.SpecdecClientError) as refused:
        client.generate("hello", max_new_tokens=2)
    assert refused.value.code.name == "UNAVAILABLE"


def test_session_ttl_sets_how_long_redis_keeps_a_session_and_a_model_service_a_finished_ones_cache(
    tiny_stack, redis_url, tiny_models, monkeypatch
):
    """--session-ttl (SPECDEC_SESSION_TTL, one setting for every service; `specdec up` passes its
    own to all three): a coordinator given 60 s writes its sessions' keys with that TTL, where
    the TTL was fixed at an hour; a model service given it keeps a finished session's cache for
    prefix reuse no longer than that."""
    import redis

    import specdec
    from specdec.cli import build_parser
    from target_service.server import TargetConfig, TargetServicer

    address = tiny_stack.add_coordinator("short-ttl", "--session-ttl", "60")
    store = redis.Redis.from_url(redis_url)
    try:
        with specdec.Client(address) as client:
            client.generate("hello", max_new_tokens=2, session_id="kept-30-s")
        with specdec.Client(tiny_stack.address) as client:
            client.generate("hello", max_new_tokens=2, session_id="kept-an-hour")
        short = [store.ttl(key("kept-30-s")) for key in (meta_key, tokens_key)]
        default = [store.ttl(key("kept-an-hour")) for key in (meta_key, tokens_key)]
    finally:
        tiny_stack.processes["short-ttl"].terminate()
    assert all(0 < ttl <= 60 for ttl in short) and all(60 < ttl <= 3600 for ttl in default), (short, default)
    servicer = TargetServicer(TargetConfig(model=tiny_models.target, session_ttl_s=60), store=None)
    assert servicer.make_pool(lambda: None).retired_s == 60
    monkeypatch.setenv("SPECDEC_SESSION_TTL", "90")
    for command in (["serve", "target"], ["serve", "draft"], ["serve", "coordinator"], ["up"]):
        assert build_parser(command).parse_args(command).session_ttl == 90, command
    with pytest.raises(SystemExit):  # each commit renews it: shorter than a long prefill would expire sessions
        build_parser(["up"]).parse_args(["up", "--session-ttl", "30"])
    servicer.worker.shutdown()


def test_create_stores_prompt_and_meta(redis_url):
    async def go():
        store = SessionStore(redis_url, ttl_s=100)
        await store.create("s-create", [5, 6, 7], {"seed": 42, "sampling": {"temperature": 0.0}})
        meta = await store.meta("s-create")
        assert await store.tokens("s-create") == [5, 6, 7]
        assert meta["cycle"] == "0" and meta["length"] == "3" and meta["seed"] == "42"
        assert 0 < await store.redis.ttl(meta_key("s-create")) <= 100
        await store.close()

    run(go())


def test_a_prompt_and_a_commit_of_more_tokens_than_lua_unpacks_at_once_are_stored_whole(redis_url):
    """Lua's unpack fails past ~8,000 values: a prompt at the default --max-prompt-tokens (8,192)
    used to end its Generate INTERNAL ("too many results to unpack")."""
    prompt, more = list(range(20_001)), [7] * 9_000

    async def go():
        store = SessionStore(redis_url, ttl_s=100)
        await store.create("s-long", prompt, {})
        assert await store.commit("s-long", 0, more, {}) == (1, len(prompt) + len(more))
        assert await store.commit("s-long", 1, [], {}) == (2, len(prompt) + len(more))
        assert await store.tokens("s-long") == prompt + more
        assert (await store.meta("s-long"))["length"] == str(len(prompt) + len(more))
        await store.close()

    run(go())


def test_creating_an_existing_session_is_refused_and_changes_nothing(redis_url):
    async def go():
        store = SessionStore(redis_url)
        await store.create("s-dup", [1, 2], {"seed": 1})
        with pytest.raises(AlreadyExists):
            await store.create("s-dup", [9, 9, 9], {"seed": 2})
        assert await store.tokens("s-dup") == [1, 2]
        assert (await store.meta("s-dup"))["seed"] == "1"
        await store.close()

    run(go())


def test_commit_appends_tokens_advances_cycle_and_adds_statistics(redis_url):
    async def go():
        store = SessionStore(redis_url)
        await store.create("s-commit", [1], {})
        assert await store.commit("s-commit", 0, [2, 3], {"accepted_tokens": 1, "draft_tokens": 4}) == (1, 3)
        assert await store.commit("s-commit", 1, [4], {"accepted_tokens": 0, "draft_tokens": 4}) == (2, 4)
        meta = await store.meta("s-commit")
        assert await store.tokens("s-commit") == [1, 2, 3, 4]
        assert (meta["cycle"], meta["accepted_tokens"], meta["draft_tokens"]) == ("2", "1", "8")
        await store.close()

    run(go())


def test_commit_with_a_stale_cycle_number_is_refused_and_changes_nothing(redis_url):
    async def go():
        store = SessionStore(redis_url)
        await store.create("s-fence", [1], {})
        await store.commit("s-fence", 0, [2], {"accepted_tokens": 1})
        before = (await store.meta("s-fence"), await store.tokens("s-fence"))
        with pytest.raises(Aborted, match="already committed"):
            await store.commit("s-fence", 0, [2], {"accepted_tokens": 1})  # replayed cycle 0
        with pytest.raises(Aborted):
            await store.commit("s-fence", 5, [9], {"accepted_tokens": 1})  # from the future
        after = (await store.meta("s-fence"), await store.tokens("s-fence"))
        assert before[1] == after[1] == [1, 2]
        assert {k: v for k, v in before[0].items() if k != "updated_at"} == {
            k: v for k, v in after[0].items() if k != "updated_at"
        }
        await store.close()

    run(go())


def test_concurrent_commits_of_the_same_cycle_commit_exactly_once(redis_url):
    async def go():
        store = SessionStore(redis_url)
        await store.create("s-race", [0], {})
        results = await asyncio.gather(
            *[store.commit("s-race", 0, [7, 8]) for _ in range(20)], return_exceptions=True
        )
        assert sum(1 for r in results if not isinstance(r, Exception)) == 1
        assert all(isinstance(r, Aborted) for r in results if isinstance(r, Exception))
        assert await store.tokens("s-race") == [0, 7, 8]
        await store.close()

    run(go())


def test_a_session_taken_over_refuses_its_first_owners_commits_and_bookkeeping(redis_url):
    """Resume's fence: take_over makes a new owner; the old run's next commit is Aborted and
    writes nothing, its status updates are dropped, and the new owner goes on from the cycle
    and tokens take_over returned."""

    async def go():
        store = SessionStore(redis_url)
        await store.create("s-owned", [1, 2], {"owner": "first", "status": "running"})
        await store.commit("s-owned", 0, [3], {"cycles": 1}, owner="first")
        meta, tokens = await store.take_over("s-owned", "second")
        assert (meta["owner"], meta["status"], meta["cycle"], tokens) == ("second", "running", "1", [1, 2, 3])
        with pytest.raises(Aborted, match="resumed by another request"):
            await store.commit("s-owned", 1, [4], {"cycles": 1}, owner="first")
        assert not await store.set_if_owner("s-owned", "first", {"status": "cancelled"})
        assert await store.commit("s-owned", 1, [5], {"cycles": 1}, owner="second") == (2, 4)
        assert await store.set_if_owner("s-owned", "second", {"status": "finished"})
        meta = await store.meta("s-owned")
        assert (meta["status"], meta["cycles"], await store.tokens("s-owned")) == ("finished", "2", [1, 2, 3, 5])
        with pytest.raises(NotFound):
            await store.take_over("s-never-made", "third")
        assert not await store.exists("s-never-made")
        await store.close()

    run(go())


def test_a_runs_own_create_and_commit_sent_again_succeed_and_write_once(redis_url):
    """A Redis Cluster client sends a script again when its reply was lost (a timeout, a master
    failing over after it replicated the write): the run's own create then met its session and
    ended ALREADY_EXISTS, its own commit met the cycle fence and ended the stream ABORTED for good.
    Sent again by the run that owns the session, each is the success it was, written once;
    another run's stay refused."""

    async def go():
        store = SessionStore(redis_url)
        await store.create("s-resent", [1, 2], {"owner": "run-a", "status": "running"})
        await store.create("s-resent", [1, 2], {"owner": "run-a", "status": "running"})  # the same call again
        with pytest.raises(AlreadyExists):
            await store.create("s-resent", [9], {"owner": "run-b", "status": "running"})
        assert await store.commit("s-resent", 0, [3, 4], {"cycles": 1}, owner="run-a") == (1, 4)
        assert await store.commit("s-resent", 0, [3, 4], {"cycles": 1}, owner="run-a") == (1, 4)  # again
        with pytest.raises(Aborted):
            await store.commit("s-resent", 0, [3, 4], {"cycles": 1})  # a replay that names no run
        with pytest.raises(Aborted):
            await store.commit("s-resent", 0, [9], {"cycles": 1}, owner="run-a")  # not the commit it made
        meta = await store.meta("s-resent")
        assert (await store.tokens("s-resent"), meta["cycle"], meta["cycles"], meta["length"]) == ([1, 2, 3, 4], "1", "1", "4")
        await store.close()

    run(go())


def test_a_resume_or_delete_checked_against_one_session_never_acts_on_another_created_under_its_id(redis_url):
    """Resume and Delete read a session (its caller, its plan), then act: an id deleted and
    created again in between (a "regenerate this turn" while the SDK resumes the old stream)
    used to be taken over, the new run fenced out and the resumer going on with the old prompt
    over the new tokens, or deleted unchecked. Given the created_at they checked, they act only
    on that session."""

    async def go():
        store = SessionStore(redis_url)
        await store.create("s-again", [1, 2], {"owner": "first", "status": "running"})
        checked = (await store.meta("s-again"))["created_at"]
        await store.delete("s-again")
        await asyncio.sleep(0.01)  # created_at is the time of creation
        await store.create("s-again", [7, 7], {"owner": "second", "status": "running"})
        with pytest.raises(NotFound):
            await store.take_over("s-again", "resumer", checked)
        assert not await store.delete("s-again", checked)
        meta = await store.meta("s-again")
        assert (meta["owner"], await store.tokens("s-again")) == ("second", [7, 7])
        meta, tokens = await store.take_over("s-again", "resumer", meta["created_at"])  # the session checked
        assert (meta["owner"], tokens) == ("resumer", [7, 7])
        assert await store.delete("s-again", meta["created_at"]) and not await store.exists("s-again")
        await store.close()

    run(go())


def test_a_session_whose_keys_redis_evicted_apart_is_never_stitched_together(redis_url):
    """An evicting maxmemory-policy drops a session's meta and token list independently: a
    commit to a session whose tokens were evicted rebuilt the list without its prompt, and a
    session created under an id whose tokens outlived its meta was pushed onto them."""
    import redis as redis_module

    from specdec.session import meta_key, tokens_key

    raw = redis_module.Redis.from_url(redis_url)

    async def go():
        store = SessionStore(redis_url)
        await store.create("s-evicted", [1, 2, 3], {})
        raw.delete(tokens_key("s-evicted"))  # as Redis evicts it
        with pytest.raises(NotFound):
            await store.commit("s-evicted", 0, [4])
        assert raw.llen(tokens_key("s-evicted")) == 0
        await store.create("s-orphan", [1, 2, 3], {})
        raw.delete(meta_key("s-orphan"))
        await store.create("s-orphan", [7], {})
        assert await store.tokens("s-orphan") == [7]
        await store.close()

    run(go())


def test_on_a_full_redis_a_delete_deletes_and_one_that_finds_another_session_answers_false(tmp_path):
    """A full Redis (noeviction) refuses a script at its first write unless it wrote already: a
    Delete that found another session under the id (or none) skipped its DEL, and its scratch
    write was refused, RESOURCE_EXHAUSTED instead of deleted=False."""
    import redis as redis_module

    from specdec.redis_server import EmbeddedRedis

    async def go(url):
        store = SessionStore(url)
        for session_id in ("full-a", "full-b"):
            await store.create(session_id, list(range(50)), {"owner": session_id})
        checked = (await store.meta("full-a"))["created_at"]
        db = redis_module.Redis.from_url(url)
        db.config_set("maxmemory-policy", "noeviction")
        db.config_set("maxmemory", db.info("memory")["used_memory"] // 2)
        with pytest.raises(redis_module.exceptions.ResponseError, match="command not allowed when used memory"):
            await store.create("full-c", [1], {})  # full indeed
        assert not await store.delete("full-b", "another-session")
        assert not await store.delete("never-made", "")
        assert await store.delete("full-a", checked) and not await store.exists("full-a")
        await store.close()

    with EmbeddedRedis() as server:
        run(go(server.url))


def test_commit_to_a_missing_session_is_not_found(redis_url):
    async def go():
        store = SessionStore(redis_url)
        with pytest.raises(NotFound):
            await store.commit("s-never", 0, [1])
        assert not await store.exists("s-never")
        await store.close()

    run(go())


def test_token_ranges(redis_url):
    async def go():
        store = SessionStore(redis_url)
        await store.create("s-range", list(range(10)), {})
        assert await store.tokens("s-range", 3, 6) == [3, 4, 5]
        assert await store.tokens("s-range", 8) == [8, 9]
        assert await store.tokens("s-range", 4, 4) == []
        assert await store.length("s-range") == 10
        await store.close()

    run(go())


@pytest.mark.parametrize("bad", ["", "a{b}", "x" * 500, "tab\there"])
def test_bad_session_ids_are_refused(redis_url, bad):
    async def go():
        store = SessionStore(redis_url)
        with pytest.raises(InvalidArgument):
            await store.create(bad, [1], {})
        await store.close()

    run(go())


# ---------------------------------------------------------------- places of a caller


def test_a_callers_places_are_limited_leased_renewed_and_given_back(redis_url):
    """admit gives at most `limit` places of one caller, others' apart; leave gives one back; a
    lease not renewed ends by itself (a dead coordinator's places free themselves), a renewed
    one holds past its first end; the set goes when its last lease ends."""
    import time

    from specdec.session import running_key

    async def go():
        store = SessionStore(redis_url)
        try:
            assert await store.admit("name:alice", "a1", 2) is None
            assert await store.admit("name:alice", "a2", 2, lease_s=0.6) is None
            assert await store.admit("name:alice", "a3", 2) == 2
            assert await store.admit("name:bob", "b1", 2) is None  # another caller: its own places
            await store.leave("name:alice", "a1")
            assert await store.admit("name:alice", "a3", 2, lease_s=0.6) is None
            assert await store.admit("name:alice", "a4", 2) == 2
            await asyncio.sleep(0.4)
            await store.renew("name:alice", ["a3"], lease_s=0.6)  # a3 renewed, a2 not
            await asyncio.sleep(0.4)  # a2's lease has ended, a3's not
            assert await store.admit("name:alice", "a4", 2) is None
            assert await store.admit("name:alice", "a5", 2) == 2
            await store.renew("name:alice", ["gone"], lease_s=0.6)  # a place not held is not taken
            assert set(await store.redis.zrange(running_key("name:alice"), 0, -1)) == {"a3", "a4"}
            await store.leave("name:bob", "b1")
            assert not await store.redis.exists(running_key("name:bob"))
            await store.renew("name:alice", ["a3", "a4"], lease_s=0.3)
            started = time.monotonic()
            while await store.redis.exists(running_key("name:alice")):
                assert time.monotonic() - started < 5, "the set outlived its leases"
                await asyncio.sleep(0.1)
        finally:
            await store.close()

    run(go())


# ---------------------------------------------------------------- Redis Cluster


@pytest.fixture(scope="module")
def redis_cluster(tmp_path_factory):
    """Three real redis-server processes made one Redis Cluster (slots split in three, no
    replicas), as `redis-cli --cluster create` would: the address of its first node."""
    with running_cluster(tmp_path_factory.mktemp("redis-cluster")) as cluster:
        yield cluster


def wait(condition, what: str, within_s: float = 30.0, every_s: float = 0.05) -> None:
    """Poll `condition` until it holds; fail with `what` after `within_s`."""
    import time

    deadline = time.monotonic() + within_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(every_s)


@contextlib.contextmanager
def running_cluster(folder, replicas: bool = False):
    """A Redis Cluster of three masters (slots split in three), each with a replica when
    `replicas`: .address (the first master's), .nodes (the masters, then the replicas, as
    clients) and .processes, in the same order. Nodes give up on a silent peer after 1 s."""
    import subprocess

    import redis

    from specdec.redis_server import redis_server_binary

    ports = [cluster_port() for _ in range(6 if replicas else 3)]
    processes = [
        subprocess.Popen([redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1", "--cluster-enabled", "yes",
                          "--cluster-config-file", f"nodes-{port}.conf", "--cluster-node-timeout", "1000",
                          "--save", "", "--appendonly", "no", "--dir", str(folder)],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        for port in ports
    ]
    nodes = [redis.Redis(host="127.0.0.1", port=port) for port in ports]

    def answers(node) -> bool:
        try:
            return node.ping()
        except redis.exceptions.ConnectionError:
            return False

    try:
        for node in nodes:
            wait(lambda: answers(node), "a cluster node did not start", 10)
        for i, node in enumerate(nodes[:3]):
            node.execute_command("CLUSTER", "ADDSLOTS", *range(i * 16384 // 3, (i + 1) * 16384 // 3))
        for port in ports[1:]:
            nodes[0].execute_command("CLUSTER", "MEET", "127.0.0.1", port)
        for master, replica in zip(nodes[:3], nodes[3:]):
            master_id = master.execute_command("CLUSTER", "MYID").decode()
            wait(lambda: master_id.encode() in replica.execute_command("CLUSTER", "NODES"), "a replica never met its master")
            replica.execute_command("CLUSTER", "REPLICATE", master_id)
        for node in nodes:
            wait(lambda: b"cluster_state:ok" in node.execute_command("CLUSTER", "INFO"), "the cluster did not come up")
        for replica in nodes[3:]:
            wait(lambda: replica.info("replication").get("master_link_status") == "up", "a replica did not sync")
        yield SimpleNamespace(address=f"127.0.0.1:{ports[0]}", nodes=nodes, processes=processes)
    finally:
        for node in nodes:
            node.close()
        for process in processes:
            process.terminate()
            process.wait(timeout=10)


def cluster_port() -> int:
    """A free port whose cluster bus port (port + 10000, in Redis 6) is free and valid too."""
    import socket

    from specdec.redis_server import free_port

    while True:
        port = free_port()
        if port + 10000 > 65535:
            continue
        with socket.socket() as bus:
            try:
                bus.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port


# ---------------------------------------------------------------- writes held until replicas have them


@contextlib.contextmanager
def master_and_replica():
    """A redis-server and a second one replicating it, synced: (master, replica)."""
    import redis

    from specdec.redis_server import EmbeddedRedis

    with EmbeddedRedis() as master, EmbeddedRedis(replica_of=master.port) as replica:
        client = redis.Redis(port=replica.port, decode_responses=True)
        wait(lambda: client.info("replication").get("master_link_status") == "up", "the replica did not sync")
        client.close()
        yield master, replica


@contextlib.contextmanager
def frozen(process):
    """The process stopped (SIGSTOP) for the block: a replica that takes nothing in."""
    import signal

    process.send_signal(signal.SIGSTOP)
    try:
        yield
    finally:
        process.send_signal(signal.SIGCONT)


def test_with_wait_replicas_a_write_returns_once_its_replica_holds_it_and_is_unavailable_while_it_lags():
    import time

    import redis

    with master_and_replica() as (master, replica):
        on_replica = redis.Redis(port=replica.port, decode_responses=True)

        async def go():
            store = SessionStore(master.url, wait_replicas=1, wait_ms=200)
            hasty = SessionStore(master.url)  # waits for no replica
            await store.create("w", [1], {})
            assert await store.commit("w", 0, [2, 3]) == (1, 3)
            assert on_replica.lrange(tokens_key("w"), 0, -1) == ["1", "2", "3"]  # held there on return
            with frozen(replica.process):
                started = time.monotonic()
                with pytest.raises(Unavailable, match=r"cycle 1 of session 'w' reached 0 of the 1 replica"):
                    await store.commit("w", 1, [4])
                assert time.monotonic() - started >= 0.15  # it waited (200 ms) before it said so
                assert await store.tokens("w") == [1, 2, 3, 4]  # on the master, and the cycle moved on
                with pytest.raises(Aborted):  # a fenced write is refused as before, not blamed on the replica
                    await store.commit("w", 1, [5])
                assert await hasty.commit("w", 2, [5]) == (3, 5)  # without the flag, no wait
                with pytest.raises(Unavailable, match="resumption of session 'w'"):
                    await store.take_over("w", "next")
                with pytest.raises(Unavailable, match="creation of session 'v'"):
                    await store.create("v", [1], {})
            greedy = SessionStore(master.url, wait_replicas=2, wait_ms=50)  # more replicas than there are
            assert await store.replicas_short() == [] and await hasty.replicas_short() == []
            assert await greedy.replicas_short() == [f"{master.url} has 1"]
            meta, tokens = await store.take_over("w", "last")
            assert (meta["cycle"], tokens) == ("3", [1, 2, 3, 4, 5])
            assert await store.commit("w", 3, [6], owner="last") == (4, 6)
            with pytest.raises(Unavailable, match="reached 1 of the 2 replica"):
                await greedy.commit("w", 4, [7])
            for each in (store, hasty, greedy):
                await each.close()

        run(go())
        on_replica.close()


def test_with_wait_replicas_a_deletion_returns_once_its_replica_lacks_the_session_and_a_retry_waits_for_it_too():
    """A Delete is a write a client relies on (the session must not come back with a failover).
    A deletion the replica has not acknowledged is refused after the wait, the session gone from
    the master; a Delete sent again (through any connection) finds it gone and still waits until
    the replica lacks it, since its script always writes and WAIT then covers the deletion."""
    import redis

    with master_and_replica() as (master, replica):
        on_master = redis.Redis(port=master.port, decode_responses=True)
        on_replica = redis.Redis(port=replica.port, decode_responses=True)

        async def go():
            store = SessionStore(master.url, wait_replicas=1, wait_ms=200)
            hasty = SessionStore(master.url)  # waits for no replica
            for session_id in ("a", "b", "c"):
                await store.create(session_id, [1, 2], {})
            await store.delete("a")
            assert on_replica.exists(meta_key("a"), tokens_key("a")) == 0  # gone there on return
            with frozen(replica.process):
                with pytest.raises(Unavailable, match=r"deletion of session 'b' reached 0 of the 1 replica.*delete it again"):
                    await store.delete("b")
                assert on_master.exists(meta_key("b"), tokens_key("b")) == 0  # gone from the master at once
                elsewhere = SessionStore(master.url, wait_replicas=1, wait_ms=200)  # another coordinator's connection
                with pytest.raises(Unavailable, match="deletion of session 'b'"):
                    await elsewhere.confirm_gone("b")  # the retry cannot confirm what the replica lacks
                await hasty.delete("c")  # without the flag: at once
                await hasty.confirm_gone("c")
            patient = SessionStore(master.url, wait_replicas=1, wait_ms=1500)  # for a replica just woken
            await patient.confirm_gone("b")  # the replica is back and holds the deletion
            assert on_replica.exists(meta_key("b"), tokens_key("b"), meta_key("c"), tokens_key("c")) == 0
            assert on_master.keys("specdec:*") == [] and on_replica.keys("specdec:*") == []  # no scratch key stays
            for each in (store, hasty, elsewhere, patient):
                await each.close()

        run(go())
        on_master.close()
        on_replica.close()


def test_a_stream_whose_redis_replica_stops_ends_unavailable_before_the_unheld_tokens_and_resumes_after(
        tiny_models, capfd):
    """A coordinator with --redis-wait-replicas 1: requests run while the replica follows; once it
    stops, the running stream ends UNAVAILABLE, naming the flag, without the tokens no replica
    holds; once it is back, a resume sends the rest, and the whole is an undisturbed run's. A
    session whose creation the replica missed is one the SDK resumes (not one it sends again,
    which would find its id taken). A coordinator asking for more replicas than the master has
    says so when it starts."""
    import signal
    import threading

    import grpc

    import specdec
    from conftest import start_stack

    with master_and_replica() as (master, replica):
        stack = start_stack(master.url, tiny_models.target, tiny_models.draft,
                            coordinator_args=["--redis-wait-replicas", "1", "--redis-wait-ms", "200"])  # fmt: skip
        try:
            options = dict(max_new_tokens=120, ignore_eos=True, num_speculative_tokens=3)
            target = stack.processes["target"]
            with specdec.Client(stack.address, retries=0) as client:
                expected = client.generate("hello world", **options).token_ids
                chunks, errors, streamed = [], [], threading.Event()

                def stream():
                    try:
                        for chunk in client.generate_stream("hello world", session_id="lagging", **options):
                            if not chunks:  # the stream waits on a Verify from its first chunk on
                                target.send_signal(signal.SIGSTOP)
                            chunks.append(chunk)
                            streamed.set()
                    except specdec.SpecdecClientError as exc:
                        errors.append(exc)
                    finally:
                        streamed.set()

                thread = threading.Thread(target=stream)
                thread.start()
                try:
                    assert streamed.wait(timeout=60), "the stream's first chunk"
                    with frozen(replica.process):  # the replica stops before the stream's next commit
                        target.send_signal(signal.SIGCONT)
                        thread.join(timeout=60)
                finally:
                    target.send_signal(signal.SIGCONT)
                assert not thread.is_alive() and len(errors) == 1, errors
                assert errors[0].code == grpc.StatusCode.UNAVAILABLE and "--redis-wait-replicas" in errors[0].message
                received = [t for c in chunks for t in c.token_ids]
                assert 0 < len(received) < len(expected) and received == expected[: len(received)]
                rest = client.resume("lagging", received_tokens=len(received))
                assert received + rest.token_ids == expected
            with specdec.Client(stack.address) as client:  # the SDK's retries and resumes
                with frozen(replica.process):  # a session created on the master only: resumed, not sent again
                    with pytest.raises(specdec.SpecdecClientError) as refused:
                        client.generate("hello world", session_id="unheld", **options)  # never gets past creation
                assert refused.value.code == grpc.StatusCode.UNAVAILABLE, refused.value  # not ALREADY_EXISTS
                assert "session 'unheld'" in refused.value.message and "--redis-wait-replicas" in refused.value.message
                assert client.resume("unheld", received_tokens=0).token_ids == expected
                with frozen(replica.process):  # a Delete the replica misses: refused, and so are the SDK's retries
                    with pytest.raises(specdec.SpecdecClientError) as unconfirmed:
                        client.delete("unheld")
                assert unconfirmed.value.code == grpc.StatusCode.UNAVAILABLE, unconfirmed.value
                assert "deletion of session 'unheld'" in unconfirmed.value.message
                assert "delete it again" in unconfirmed.value.message
                assert client.delete("unheld") is False  # gone, and now its replica confirms it
            assert "--redis-wait-replicas 1, but" not in capfd.readouterr().err  # its master has the 1
            stack.add_coordinator("greedy", "--redis-wait-replicas", "2")
            assert f"--redis-wait-replicas 2, but {master.url} has 1" in capfd.readouterr().err
        finally:
            stack.stop()


def test_in_a_redis_cluster_a_write_waits_for_the_replica_of_its_own_node(tmp_path):
    """WAIT goes down the write's own connection to the node of its slot: with one master's
    replica stopped, exactly the sessions of that master's slots fail."""
    with running_cluster(tmp_path, replicas=True) as cluster:

        async def go():
            store = SessionStore(f"redis+cluster://{cluster.address}/0", wait_replicas=1, wait_ms=200)
            ids = [f"c{i}" for i in range(12)]
            for session_id in ids:
                await store.create(session_id, [1], {})
                await store.commit(session_id, 0, [2])
            ports = [node.connection_pool.connection_kwargs["port"] for node in cluster.nodes]
            port_of = {i: store.redis.get_node_from_key(meta_key(i)).port for i in ids}
            lagging = port_of["c0"]
            with frozen(cluster.processes[ports.index(lagging) + 3]):
                failed = []
                for session_id in ids:
                    try:
                        await store.commit(session_id, 1, [3])
                    except Unavailable:
                        failed.append(session_id)
            assert failed == [i for i in ids if port_of[i] == lagging] and len(set(port_of.values())) == 3
            greedy = SessionStore(store.url, wait_replicas=2)
            assert await store.replicas_short() == []
            assert [entry.split(" has ")[1] for entry in await greedy.replicas_short()] == ["1", "1", "1"]
            await store.close()
            await greedy.close()

        run(go())


def test_a_stack_keeps_its_sessions_in_a_redis_cluster_named_by_a_cluster_url(redis_cluster, tiny_models):
    """`redis+cluster://` one node: the services find the others and each session's keys go to the
    node of its slot (sessions land on all three), and generate, resume and delete work as on one
    server. A plain `redis://` URL of the same node cannot: most sessions live on other nodes."""
    import specdec
    from conftest import start_stack

    url = f"redis+cluster://{redis_cluster.address}/0"
    stack = start_stack(url, tiny_models.target, tiny_models.draft)
    try:
        options = dict(max_new_tokens=12, ignore_eos=True, num_speculative_tokens=3)
        with specdec.Client(stack.address) as client:
            expected = client.generate("hello world", **options).token_ids
            results = [client.generate("hello world", session_id=f"clustered-{i}", **options) for i in range(9)]
            assert all(r.token_ids == expected for r in results)

            def holder(session_id: str) -> int:
                """The node that has the session's slot's keys."""
                first = redis_cluster.nodes[0]
                slot = first.execute_command("CLUSTER", "KEYSLOT", meta_key(session_id))
                return next(i for i, node in enumerate(redis_cluster.nodes)
                            if node.execute_command("CLUSTER", "COUNTKEYSINSLOT", slot))  # fmt: skip

            assert {holder(f"clustered-{n}") for n in range(9)} == {0, 1, 2}, "sessions spread over the nodes"
            assert client.resume("clustered-4", received_tokens=5).token_ids == expected[5:]
            assert client.delete("clustered-4") is True and client.delete("clustered-4") is False

        async def plain_reads():
            import redis

            store = SessionStore(f"redis://{redis_cluster.address}/0")
            moved = 0
            for n in (0, 1, 2, 3, 5, 6, 7, 8):
                try:
                    await store.meta(f"clustered-{n}")
                except redis.exceptions.MovedError:  # the key is on another node
                    moved += 1
            await store.close()
            return moved

        assert run(plain_reads()) > 0
    finally:
        stack.stop()


def test_sessions_outlive_failovers_of_their_redis_cluster_nodes(tmp_path, tiny_models):
    """Three masters, each with a replica. (1) A graceful failover of every master (`CLUSTER
    FAILOVER` on each replica) while a stream waits on the frozen target: the stream goes on
    when the target does, its commits following the MOVED redirects to the new masters, and
    ends with the tokens of an undisturbed run; a session finished before resumes. (2) The
    master of that session's slot is killed: until its replica takes over (node timeout 1 s,
    then an election) requests fail UNAVAILABLE, never otherwise; then requests succeed again
    and the session, replicated before the kill, still resumes."""
    import signal
    import threading

    import grpc

    import specdec
    from conftest import start_stack

    def roles(nodes) -> list[str]:
        return [node.execute_command("ROLE")[0].decode() for node in nodes]

    with running_cluster(tmp_path, replicas=True) as cluster:
        stack = start_stack(f"redis+cluster://{cluster.address}/0", tiny_models.target, tiny_models.draft)
        try:
            options = dict(max_new_tokens=24, ignore_eos=True, num_speculative_tokens=3)
            with specdec.Client(stack.address) as client:
                expected = client.generate("hello world", **options).token_ids
                assert client.generate("hello world", session_id="before", **options).token_ids == expected
                chunks, streamed = [], threading.Event()

                def stream():
                    try:
                        for chunk in client.generate_stream("hello world", session_id="across", **options):
                            chunks.append(chunk)
                            streamed.set()
                    finally:
                        streamed.set()

                target = stack.processes["target"]
                thread = threading.Thread(target=stream)
                thread.start()
                wait(streamed.is_set, "the stream's first chunk", 60, 0.1)
                target.send_signal(signal.SIGSTOP)
                try:
                    for replica in cluster.nodes[3:]:
                        replica.execute_command("CLUSTER", "FAILOVER")
                    swapped = ["slave"] * 3 + ["master"] * 3
                    wait(lambda: roles(cluster.nodes) == swapped, "the graceful failovers", 60, 0.1)
                finally:
                    target.send_signal(signal.SIGCONT)
                thread.join(timeout=60)
                assert not thread.is_alive() and [t for c in chunks for t in c.token_ids] == expected
                assert client.resume("before", received_tokens=5).token_ids == expected[5:]

                slot = cluster.nodes[3].execute_command("CLUSTER", "KEYSLOT", meta_key("before"))
                holder = next(i for i in (3, 4, 5) if cluster.nodes[i].execute_command("CLUSTER", "COUNTKEYSINSLOT", slot))
                cluster.processes[holder].kill()
                cluster.processes[holder].wait(timeout=10)
                failures = []

                def resumes() -> bool:
                    try:
                        return client.resume("before", received_tokens=5).token_ids == expected[5:]
                    except specdec.SpecdecClientError as exc:
                        failures.append(exc)
                        return False

                wait(resumes, "the replica of the killed master never took over", 60, 0.1)
                assert all(exc.code == grpc.StatusCode.UNAVAILABLE for exc in failures), failures
                assert roles([cluster.nodes[holder - 3]]) == ["master"]
                assert client.generate("hello world", session_id="after", **options).token_ids == expected
        finally:
            stack.stop()


def test_a_redis_cluster_between_states_is_unavailable_to_callers_and_a_cross_slot_command_is_a_bug():
    import grpc
    import redis

    from specdec.errors import status_for

    for exc in (redis.exceptions.ClusterDownError("CLUSTERDOWN The cluster is down"),
                redis.exceptions.MovedError("3999 127.0.0.1:6381"), redis.exceptions.TryAgainError("TRYAGAIN"),
                redis.exceptions.RedisClusterException("Redis Cluster cannot be connected")):  # fmt: skip
        code, message = status_for(exc)
        assert code == grpc.StatusCode.UNAVAILABLE and "Redis Cluster" in message, exc
    assert status_for(redis.exceptions.ClusterCrossSlotError())[0] == grpc.StatusCode.INTERNAL
