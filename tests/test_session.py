"""The Redis session store against a real redis-server: layout, fencing, TTL."""

import asyncio

import pytest

from specdec.errors import Aborted, AlreadyExists, InvalidArgument, NotFound
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
