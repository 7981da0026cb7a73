"""Session state in Redis (design.md §4).

Terms:
    session    one Generate request: its committed tokens and its bookkeeping.
    committed  prompt + output tokens decided so far; what the user sees.
    cycle      how many draft/verify rounds were committed; the fencing token.

Layout (the `{session_id}` hash tag keeps one session in one Redis Cluster slot):
    specdec:{<id>}:meta    hash: sampling params, seed, models, cycle, length,
                           prompt_tokens, statistics, status, owner, plan (what
                           Resume needs besides), timestamps
    specdec:{<id>}:tokens  list of committed token ids (decimal strings)
    specdec:{<id>}:scratch written and removed in one script by a deletion, for
                           --redis-wait-replicas (never left behind; see _DELETE)
    specdec:caller:{<caller>}:running
                           sorted set: the requests of one caller (security.caller_id) in
                           progress on any coordinator, each scored with the end of its
                           lease (Redis time, s), which its coordinator renews while it runs
                           (admit, renew, leave); a lease a dead coordinator left ends alone

Every write that advances a session runs as one Lua script that first checks the
cycle number it expects, so a retried or duplicated cycle never commits twice, and
refreshes the TTL of both keys. The meta hash's `owner` names the run that may commit:
Resume's `take_over` gives it a new one, and the old run's commits are refused. A script
either runs whole or not at all, so a session is never half-written, whatever fails
around it.

When Redis is unreachable every call fails fast (no silent retries: see
`SessionStore`) with a redis ConnectionError/TimeoutError, which servers report as
UNAVAILABLE; the connection pool reconnects by itself once Redis is back.

The URL names one Redis server (`redis://`, `rediss://` for TLS) or a Redis Cluster
(`redis+cluster://` or `rediss+cluster://`, any node of it: the client learns the rest and
sends each session's keys to the node that holds its slot; see `connect`).
"""

from __future__ import annotations

import json
import logging
import os
import time
import uuid
from collections.abc import Mapping, Sequence

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from specdec.errors import Aborted, AlreadyExists, InvalidArgument, NotFound, Unavailable
from specdec.ranges import DEFAULT_TTL_S, DEFAULT_WAIT_MS
from specdec.security import redact_url

REDIS_URL_ENV = "SPECDEC_REDIS_URL"
# The URL schemes of a Redis Cluster, and the scheme redis-py takes for each.
CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}
REDIS_SCHEMES = ("redis", "rediss", "unix", *CLUSTER_SCHEMES)
# A cluster client follows MOVED / ASK redirects (a failover, a slot moving) within a command;
# a command that cannot reach its node, or meets CLUSTERDOWN, is resent this many times after a
# topology refresh (a master killed: its replica takes over after the cluster's node timeout).
CLUSTER_RETRIES = 2
MAX_SESSION_ID_LEN = 128
# Opening a connection: loopback or a LAN answers in milliseconds, so a Redis that has
# not answered in 2 s is down, and the request fails with UNAVAILABLE instead of waiting.
REDIS_CONNECT_TIMEOUT_S = 2.0
# One command: our scripts touch one session (microseconds), and even a Redis pausing to
# fork a snapshot answers within a few hundred ms; 2 s without a reply means it is stuck.
REDIS_SOCKET_TIMEOUT_S = 2.0
try:  # recent redis-py: its maintenance notifications (Redis Enterprise) skip the stale-connection check
    from redis.maint_notifications import MaintNotificationsConfig

    NO_MAINT_NOTIFICATIONS = {"maint_notifications_config": MaintNotificationsConfig(enabled=False)}
except ImportError:  # older redis-py has neither
    NO_MAINT_NOTIFICATIONS = {}

# Lua: RPUSH onto `key` ARGV[first] .. ARGV[#ARGV]; returns the list's length after it, or
# `length` when there was nothing to push. In slices: Lua's unpack fails past ~8,000 values
# ("too many results to unpack"), and a prompt may hold more tokens than that.
_PUSH_TOKENS = """
local function push_tokens(key, first, length)
  for i = first, #ARGV, 1000 do
    length = redis.call('RPUSH', key, unpack(ARGV, i, math.min(i + 999, #ARGV)))
  end
  return length
end
"""

# KEYS: meta, tokens. ARGV: ttl, now, n_fields, field, value, ..., token, token, ... Returns 1
# when it created the session, or finds it created by this very call (its `owner` field, a run's
# own id: a Redis Cluster client sends a script again when its reply was lost), else 0.
_CREATE = _PUSH_TOKENS + """
local n = tonumber(ARGV[3])
if redis.call('EXISTS', KEYS[1]) == 1 then
  for i = 0, n - 1 do
    if ARGV[4 + 2 * i] == 'owner' and redis.call('HGET', KEYS[1], 'owner') == ARGV[5 + 2 * i] then
      -- a write, so that a WAIT after it counts the replicas that hold the creation (Redis 7's
      -- WAIT counts the connection's own writes, and the resent script comes on a new one)
      redis.call('EXPIRE', KEYS[1], ARGV[1])
      redis.call('EXPIRE', KEYS[2], ARGV[1])
      return 1
    end
  end
  return 0
end
local first_token = 4 + 2 * n
-- The first write is one a full Redis refuses (HSET): then nothing is written. (After a write it
-- allows, DEL, a full Redis lets a script go on.)
redis.call('HSET', KEYS[1], 'cycle', 0, 'length', #ARGV - first_token + 1,
           'created_at', ARGV[2], 'updated_at', ARGV[2])
for i = 0, n - 1 do
  redis.call('HSET', KEYS[1], ARGV[4 + 2 * i], ARGV[5 + 2 * i])
end
redis.call('DEL', KEYS[2])  -- tokens outliving their meta (an evicting maxmemory-policy) are no one's
push_tokens(KEYS[2], first_token, 0)
redis.call('EXPIRE', KEYS[1], ARGV[1])
redis.call('EXPIRE', KEYS[2], ARGV[1])
return 1
"""

# KEYS: meta, tokens. ARGV: expected cycle, ttl, now, owner ('' = any), n_incr, field, incr, ...,
# token, ... Returns {1, new_cycle, new_length} on success, {0, current_cycle, length} when
# fenced by the cycle, {-2, current_cycle, length} when another run owns the session (Resume).
# A run's commit found applied already (the session one cycle on, still that run's, and ending in
# the very tokens sent: only the run commits, each cycle once) is its own, sent again by a Redis
# Cluster client whose reply was lost: a success (its EXPIREs the write a WAIT after it counts),
# where the fence used to end a healthy stream ABORTED.
_COMMIT = _PUSH_TOKENS + """
local function ends_in(key, first)
  local count = #ARGV - first + 1
  if count == 0 then return true end
  local tail = redis.call('LRANGE', key, -count, -1)
  for i = 1, count do
    if tail[i] ~= ARGV[first + i - 1] then return false end
  end
  return #tail == count
end
local cycle = redis.call('HGET', KEYS[1], 'cycle')
if not cycle then return {-1, 0, 0} end
local length = tonumber(redis.call('HGET', KEYS[1], 'length'))
-- its tokens evicted (a maxmemory-policy other than noeviction): the session is lost, not rebuilt
-- without its prompt
if redis.call('LLEN', KEYS[2]) ~= length then return {-1, 0, 0} end
if ARGV[4] ~= '' and redis.call('HGET', KEYS[1], 'owner') ~= ARGV[4] then
  return {-2, tonumber(cycle), length}
end
if ARGV[4] ~= '' and tonumber(cycle) == tonumber(ARGV[1]) + 1 and ends_in(KEYS[2], 6 + 2 * tonumber(ARGV[5])) then
  redis.call('EXPIRE', KEYS[1], ARGV[2])
  redis.call('EXPIRE', KEYS[2], ARGV[2])
  return {1, tonumber(cycle), length}
end
if tonumber(cycle) ~= tonumber(ARGV[1]) then
  return {0, tonumber(cycle), length}
end
local n = tonumber(ARGV[5])
for i = 0, n - 1 do
  redis.call('HINCRBY', KEYS[1], ARGV[6 + 2 * i], ARGV[7 + 2 * i])
end
length = push_tokens(KEYS[2], 6 + 2 * n, length)
local new_cycle = redis.call('HINCRBY', KEYS[1], 'cycle', 1)
redis.call('HSET', KEYS[1], 'length', length, 'updated_at', ARGV[3])
redis.call('EXPIRE', KEYS[1], ARGV[2])
redis.call('EXPIRE', KEYS[2], ARGV[2])
return {1, new_cycle, length}
"""

# KEYS: meta, tokens. ARGV: owner, ttl, created_at ('' = any). Makes ARGV[1] the session's
# owner (its commits go through, any other run's are refused) and returns the meta hash and the
# tokens as they are then, so no commit of an earlier run can land after them. {} when the
# session does not exist, or is another of the same id than the one created at ARGV[3].
_TAKE_OVER = """
if redis.call('EXISTS', KEYS[1]) == 0 then return {} end
if ARGV[3] ~= '' and redis.call('HGET', KEYS[1], 'created_at') ~= ARGV[3] then return {} end
redis.call('HSET', KEYS[1], 'owner', ARGV[1], 'status', 'running')
redis.call('EXPIRE', KEYS[1], ARGV[2])
redis.call('EXPIRE', KEYS[2], ARGV[2])
return {redis.call('HGETALL', KEYS[1]), redis.call('LRANGE', KEYS[2], 0, -1)}
"""

# KEYS: meta. ARGV: owner, field, value, ... Sets the fields only while ARGV[1] owns the
# session; returns 1 if it did.
_SET_IF_OWNER = """
if redis.call('HGET', KEYS[1], 'owner') ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV, 2))
return 1
"""


# KEYS: meta, tokens, scratch. ARGV: 1 to delete the session, 0 to leave it; created_at ('' =
# any: another session of the same id is left alone). Returns how many of its keys it deleted.
# It always writes (the scratch key, set and removed): a WAIT after it then
# counts the replicas that hold every earlier write of the node, since replication keeps their
# order, so also a deletion by an earlier call (a retried Delete) or by another coordinator.
# (Redis 7's WAIT waits for the calling connection's own last write: after a script that wrote
# nothing it would answer at once. Redis 6.2 waits for the node's offset after any command.)
_DELETE = """
redis.call('DEL', KEYS[3])  -- a first write a full Redis allows: the SET below is then allowed too
local deleted = 0
if ARGV[1] == '1' and (ARGV[2] == '' or redis.call('HGET', KEYS[1], 'created_at') == ARGV[2]) then
  deleted = redis.call('DEL', KEYS[1], KEYS[2])
end
redis.call('SET', KEYS[3], '1')
redis.call('DEL', KEYS[3])
return deleted
"""

# A caller's request holds a lease on its place under --max-requests-per-caller this long,
# renewed every third of it while the request runs: a coordinator that dies leaves places
# that free themselves within this time.
CALLER_LEASE_S = 30.0

# KEYS: running. ARGV: limit, request id, lease s. Drops ended leases; admits the request if
# fewer than `limit` are left. Returns -1 when admitted, else the count running.
_ADMIT = """
local now = redis.call('TIME')
local t = tonumber(now[1]) + tonumber(now[2]) / 1e6
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', t)
local running = redis.call('ZCARD', KEYS[1])
if running >= tonumber(ARGV[1]) then return running end
redis.call('ZADD', KEYS[1], t + tonumber(ARGV[3]), ARGV[2])
redis.call('EXPIRE', KEYS[1], math.ceil(tonumber(ARGV[3])) + 1)
return -1
"""

# KEYS: running. ARGV: lease s, request id, ... Extends the leases of those still held.
_RENEW = """
local now = redis.call('TIME')
local t = tonumber(now[1]) + tonumber(now[2]) / 1e6 + tonumber(ARGV[1])
for i = 2, #ARGV do redis.call('ZADD', KEYS[1], 'XX', t, ARGV[i]) end
redis.call('EXPIRE', KEYS[1], math.ceil(tonumber(ARGV[1])) + 1)
return 1
"""


def running_key(caller: str) -> str:
    return f"specdec:caller:{{{caller}}}:running"


def meta_key(session_id: str) -> str:
    return f"specdec:{{{session_id}}}:meta"


def tokens_key(session_id: str) -> str:
    return f"specdec:{{{session_id}}}:tokens"


def scratch_key(session_id: str) -> str:
    return f"specdec:{{{session_id}}}:scratch"


class NotReplicated(Unavailable):
    """A write that stands on its Redis node but that --redis-wait-replicas replicas did not
    acknowledge in time (SessionStore): the session is there, for a Resume once they are back."""


def session_gone(session_id: str) -> NotFound:
    """The error for a session whose keys are not in Redis."""
    return NotFound(f"session {session_id!r} does not exist (expired, deleted or never created)")


def superseded(session_id: str) -> Aborted:
    """The error for a run whose session another run owns now: a Resume took it over, or it was
    deleted and created again under its id."""
    return Aborted(f"session {session_id!r} was deleted or resumed by another request, which goes on with it; this one stops")


def new_session_id() -> str:
    return uuid.uuid4().hex


def check_session_id(session_id: str, name: str = "session_id") -> str:
    """Refuse ids that would break the key layout or are unreasonably long (`name`: what the
    request calls it; an affinity key follows the same rules)."""
    if not session_id:
        raise InvalidArgument(f"{name} is empty")
    if len(session_id) > MAX_SESSION_ID_LEN:
        raise InvalidArgument(f"{name} is {len(session_id)} characters; the limit is {MAX_SESSION_ID_LEN}")
    if any(c in session_id for c in "{}") or not session_id.isprintable():
        raise InvalidArgument(f"{name} may not contain braces or unprintable characters")
    return session_id


def connect(url: str, socket_timeout_s: float, connect_timeout_s: float) -> aioredis.Redis | aioredis.RedisCluster:
    """A client of the Redis that `url` names. `redis://` / `rediss://`: one server, every
    command sent once (SessionStore). `redis+cluster://` / `rediss+cluster://`: a Redis
    Cluster reached through the node the URL names; a session's keys share a hash tag, so
    each script runs on the one node holding its slot; a command redirected by a failover or a
    moving slot follows the redirect, and one that cannot reach its node is resent at most
    CLUSTER_RETRIES times (a commit or creation resent after a lost reply is found done and
    answered as such, never applied twice: _COMMIT, _CREATE)."""
    options = dict(socket_timeout=socket_timeout_s, socket_connect_timeout=connect_timeout_s, decode_responses=True,
                   **NO_MAINT_NOTIFICATIONS)  # fmt: skip
    scheme, _, rest = url.partition("://")
    if scheme in CLUSTER_SCHEMES:
        return aioredis.RedisCluster.from_url(f"{CLUSTER_SCHEMES[scheme]}://{rest}",
                                              retry=Retry(NoBackoff(), CLUSTER_RETRIES), **options)  # fmt: skip
    return aioredis.Redis.from_url(url, retry=Retry(NoBackoff(), 0), **options)


def redis_url_problem(url: str) -> str | None:
    """None when `url` names a Redis connect() can reach, else what is wrong with its scheme.
    Never quotes the URL, which may hold a password."""
    from urllib.parse import urlsplit

    scheme = url.partition("://")[0] if "://" in url else ""
    if scheme not in REDIS_SCHEMES:
        known = ", ".join(f"{name}://" for name in REDIS_SCHEMES)
        return f"expected a Redis URL beginning {known}; got {f'scheme {scheme!r}' if scheme else 'no scheme'}"
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - a ValueError where the port is no number
    except ValueError:
        parts = None
    if parts is None or ("@" in url.partition("://")[2].partition("?")[0] and "@" not in parts.netloc):
        # A password holding / ? # ends the host part early: redis-py then fails in a traceback
        # that shows part of the password ("Port could not be cast to integer value as '...'").
        return ("the Redis URL does not parse: percent-encode / ? # @ in its password (%2F %3F %23 %40), "
                "or give a port that is a number")
    return None


def redis_url_from_env() -> str | None:
    return os.environ.get(REDIS_URL_ENV) or None


class SessionStore:
    """Async access to sessions in Redis. One instance per process; cheap to share.

    Commands are sent once, never retried by the client library: redis-py's default
    (10 retries with backoff) would hold a request for seconds while Redis is down, and
    would replay a commit whose reply was lost, which the fence then refuses. Callers see
    the error at once; a pooled connection that Redis closed is replaced before use, so
    nothing needs restarting when Redis comes back. (redis-py skips that check while its
    maintenance notifications, a Redis Enterprise feature, are on; so they are off.)

    `wait_replicas` (--redis-wait-replicas): a write that a client relies on (create, commit,
    take_over, delete) returns only once that many replicas of its Redis node hold it (`WAIT`, on the
    write's own connection, for at most `wait_ms`), else raises NotReplicated; the write itself
    stays on the node. Replication is asynchronous: without it, a write acknowledged in the
    moment before its node dies can be lost with it, and its client already holds its tokens."""

    def __init__(
        self,
        url: str,
        *,
        ttl_s: int = DEFAULT_TTL_S,
        socket_timeout_s: float = REDIS_SOCKET_TIMEOUT_S,
        connect_timeout_s: float = REDIS_CONNECT_TIMEOUT_S,
        wait_replicas: int = 0,
        wait_ms: int = DEFAULT_WAIT_MS,
    ):
        self.url = url
        logging.getLogger("specdec").info("sessions in Redis at %s%s", redact_url(url),
                                          f", each write held until {wait_replicas} replica(s) have it"
                                          if wait_replicas else "")  # fmt: skip
        self.ttl_s = ttl_s
        self.wait_replicas = wait_replicas
        self.wait_ms = wait_ms
        self.redis = connect(url, socket_timeout_s, connect_timeout_s)
        self._create = self.redis.register_script(_CREATE)
        self._commit = self.redis.register_script(_COMMIT)
        self._take_over = self.redis.register_script(_TAKE_OVER)
        self._set_if_owner = self.redis.register_script(_SET_IF_OWNER)
        self._delete = self.redis.register_script(_DELETE)
        self._admit = self.redis.register_script(_ADMIT)
        self._renew = self.redis.register_script(_RENEW)

    async def close(self) -> None:
        await self.redis.aclose()

    async def ping(self) -> bool:
        return bool(await self.redis.ping())

    async def create(self, session_id: str, prompt_tokens: Sequence[int], meta: Mapping[str, object]) -> None:
        """Create a session holding the prompt as its committed tokens.

        Raises AlreadyExists when the id is taken (no field of it is touched)."""
        check_session_id(session_id)
        fields: list[object] = []
        for name, value in meta.items():
            fields += [name, value if isinstance(value, (str, int, float)) else json.dumps(value)]
        args = [self.ttl_s, time.time(), len(fields) // 2, *fields, *[int(t) for t in prompt_tokens]]
        created, replicas = await self._write(self._create, [meta_key(session_id), tokens_key(session_id)], args)
        if not created:
            raise AlreadyExists(f"session {session_id!r} already exists; pick another id or omit it")
        self._check_replicas(replicas, f"the creation of session {session_id!r}")

    async def commit(
        self,
        session_id: str,
        expected_cycle: int,
        tokens: Sequence[int],
        increments: Mapping[str, int] | None = None,
        owner: str = "",
    ) -> tuple[int, int]:
        """Append one cycle's tokens if the session is still at `expected_cycle` and, when
        `owner` is given, that run still owns it (`take_over`).

        `increments` are integer statistics added to the meta hash in the same step.
        Returns (new cycle, new length). Raises Aborted when the session has moved
        on (a stale or replayed cycle, or another run took it over) and NotFound when it
        does not exist; in all cases nothing is written."""
        pairs: list[object] = []
        for name, value in (increments or {}).items():
            pairs += [name, int(value)]
        args = [expected_cycle, self.ttl_s, time.time(), owner, len(pairs) // 2, *pairs, *[int(t) for t in tokens]]
        (status, cycle, length), replicas = await self._write(self._commit, [meta_key(session_id),
                                                                            tokens_key(session_id)], args)  # fmt: skip
        if status == -1:
            raise session_gone(session_id)
        if status == -2:
            raise superseded(session_id)
        if status == 0:
            raise Aborted(
                f"session {session_id!r} is at cycle {cycle}, not {expected_cycle}: "
                "this cycle was already committed or the session moved on"
            )
        self._check_replicas(replicas, f"cycle {expected_cycle} of session {session_id!r}")
        return int(cycle), int(length)

    async def take_over(self, session_id: str, owner: str, created_at: str = "") -> tuple[dict[str, str], list[int]]:
        """Make `owner` the run that goes on with a session (Resume): from now on only its
        commits land. Returns the session's meta and committed tokens as of that moment.
        Raises NotFound when it does not exist, or, given `created_at` (the meta the caller
        checked), when the id now names another session: deleted and created again meanwhile,
        which a Resume used to seize, its caller unchecked, going on with the old one's prompt."""
        check_session_id(session_id)
        found, replicas = await self._write(self._take_over, [meta_key(session_id), tokens_key(session_id)],
                                            [owner, self.ttl_s, created_at])  # fmt: skip
        if not found:
            raise session_gone(session_id)
        self._check_replicas(replicas, f"the resumption of session {session_id!r}")
        flat, tokens = found
        return dict(zip(flat[::2], flat[1::2])), [int(t) for t in tokens]

    async def _write(self, script, keys: list[str], args: list) -> tuple[object, int | Exception | None]:
        """Run a writing script: (its result, how many replicas hold the write: None when not
        asked, an exception when they could not be asked). With wait_replicas the script and
        `WAIT` go down one connection, one after the other, since WAIT counts the replicas
        that hold that connection's writes; in a cluster both go to the node of `keys`."""
        if not self.wait_replicas:
            return await script(keys=keys, args=args), None
        node = {}
        if isinstance(self.redis, aioredis.RedisCluster):
            await self.redis.initialize()  # at once once the client knows the slots
            node = {"target_nodes": self.redis.get_node_from_key(keys[0])}
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.eval(script.script, len(keys), *keys, *args)
            pipe.execute_command("WAIT", self.wait_replicas, self.wait_ms, **node)
            result, replicas = await pipe.execute(raise_on_error=False)
        if isinstance(result, Exception):
            raise result
        return result, replicas

    def _check_replicas(self, replicas: int | Exception | None, what: str, then: str = "") -> None:
        """Raise NotReplicated when a write was not acknowledged by wait_replicas replicas;
        `then` says what the caller should do (default: a stream's write, to be resumed)."""
        if replicas is None or (not isinstance(replicas, Exception) and int(replicas) >= self.wait_replicas):
            return
        held = f"could not be checked ({replicas})" if isinstance(replicas, Exception) else (
            f"reached {int(replicas)} of the {self.wait_replicas} replica(s) --redis-wait-replicas asks for "
            f"within {self.wait_ms} ms")  # fmt: skip
        then = then or ("it stands on its Redis node but could be lost with it, so the request stops before sending "
                        "anything of it; resume the session (the SDK does) once the node's replicas are back")  # fmt: skip
        raise NotReplicated(f"Redis: {what} {held}: {then}")

    async def replicas_short(self) -> list[str]:
        """The Redis masters with fewer connected replicas than wait_replicas, each as 'NODE has
        N': with one, every write there would end its request UNAVAILABLE. [] when not waiting."""
        if not self.wait_replicas:
            return []
        if isinstance(self.redis, aioredis.RedisCluster):
            infos = await self.redis.info("replication", target_nodes=aioredis.RedisCluster.PRIMARIES)
        else:
            infos = {redact_url(self.url): await self.redis.info("replication")}
        have = {name: int(info.get("connected_slaves", 0)) for name, info in infos.items()}
        return [f"{name} has {count}" for name, count in sorted(have.items()) if count < self.wait_replicas]

    async def set_if_owner(self, session_id: str, owner: str, fields: Mapping[str, object]) -> bool:
        """Set bookkeeping fields only while `owner` owns the session; whether it did."""
        args = [owner, *[str(v) for pair in fields.items() for v in pair]]
        return bool(await self._set_if_owner(keys=[meta_key(session_id)], args=args))

    async def exists(self, session_id: str) -> bool:
        return bool(await self.redis.exists(meta_key(session_id)))

    async def meta(self, session_id: str) -> dict[str, str]:
        meta = await self.redis.hgetall(meta_key(session_id))
        if not meta:
            raise session_gone(session_id)
        return meta

    async def tokens(self, session_id: str, start: int = 0, end: int | None = None) -> list[int]:
        """Committed tokens [start, end) (end None means all)."""
        stop = -1 if end is None else end - 1
        if end is not None and end <= start:
            return []
        values = await self.redis.lrange(tokens_key(session_id), start, stop)
        return [int(v) for v in values]

    async def tokens_and_birth(self, session_id: str, start: int = 0,
                               end: int | None = None) -> tuple[list[int], str | None]:  # fmt: skip
        """(committed tokens [start, end) (end None means all), the session's created_at), in one
        round trip: created_at tells this lifetime of the session from an earlier one of the same
        id (None: no session). Not a MULTI transaction: a Redis at its maxmemory refuses those,
        reads included."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.lrange(tokens_key(session_id), start, -1 if end is None else end - 1)
            pipe.hget(meta_key(session_id), "created_at")
            values, born = await pipe.execute()
        return ([int(v) for v in values] if end is None or end > start else []), born

    async def length(self, session_id: str) -> int:
        return int(await self.redis.llen(tokens_key(session_id)))

    async def touch(self, session_id: str) -> None:
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.expire(meta_key(session_id), self.ttl_s)
            pipe.expire(tokens_key(session_id), self.ttl_s)
            await pipe.execute()

    async def delete(self, session_id: str, created_at: str = "") -> bool:
        """Delete a session's keys; given `created_at` (the meta the caller checked), only that
        session's, not another created under the id meanwhile. True when it deleted them. With
        wait_replicas, return once that many replicas of its node hold the deletion, else raise
        NotReplicated (it is gone from the node)."""
        return await self._deletion(session_id, delete=True, created_at=created_at)

    async def confirm_gone(self, session_id: str) -> None:
        """For a session its node does not hold: with wait_replicas, return once that many
        replicas hold every write the node has made, so none still holds it (its deletion by
        an earlier call, say, that they had not acknowledged); else raise NotReplicated.
        Without wait_replicas, nothing to confirm."""
        if self.wait_replicas:
            await self._deletion(session_id, delete=False)

    async def _deletion(self, session_id: str, delete: bool, created_at: str = "") -> bool:
        keys = [meta_key(session_id), tokens_key(session_id), scratch_key(session_id)]
        deleted, replicas = await self._write(self._delete, keys, [int(delete), created_at])
        self._check_replicas(replicas, f"the deletion of session {session_id!r}", (
            "it is gone from its Redis node, but a failover to a replica that missed it could bring it back; "
            "delete it again once the node's replicas are back (deleted=false then confirms it is gone)"))  # fmt: skip
        return bool(deleted)

    async def admit(self, caller: str, request_id: str, limit: int, lease_s: float = CALLER_LEASE_S) -> int | None:
        """Give `request_id` one of `caller`'s `limit` places, counted over every coordinator
        of this Redis, for `lease_s` (renew extends it, leave gives it back). None when
        admitted; else how many of the caller's requests hold a place."""
        running = await self._admit(keys=[running_key(caller)], args=[limit, request_id, lease_s])
        return None if running == -1 else int(running)

    async def renew(self, caller: str, request_ids: Sequence[str], lease_s: float = CALLER_LEASE_S) -> None:
        """Extend the leases of `caller`'s requests that still hold their place."""
        if request_ids:
            await self._renew(keys=[running_key(caller)], args=[lease_s, *request_ids])

    async def leave(self, caller: str, request_id: str) -> None:
        """Give a request's place back."""
        await self.redis.zrem(running_key(caller), request_id)
