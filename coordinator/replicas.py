"""Which replica of a model service serves a session.

A model service (draft or target) may run as several replicas: processes serving the same
model, each keeping KV caches of the sessions it served. The coordinator sends every call of
a session to one replica, so that replica's caches stay warm, and spreads the sessions over
the replicas by rendezvous hashing: session s goes to the replica r with the highest
score(s, r). Adding or removing a replica moves only the sessions it gains or held; a
session that moves is rebuilt from Redis by its new replica (specdec.kvcache), so a move
costs one prefill, never a token.

Terms:
    address   what --target-address / --draft-address names. One of
                `host:port`            one replica (or one load balancer in front of several);
                `h1:p1,h2:p2,...`      one replica each;
                `dns:///host:port`     every address `host` resolves to is a replica, resolved
                                       again every REPLICA_REFRESH_S seconds (a Kubernetes headless
                                       Service: one address per ready pod).
    down      a replica whose call failed UNAVAILABLE is skipped for DOWN_S seconds, and after
              that until its channel has connected again and its gRPC health says SERVING
              (not while its model worker is wedged); one whose connection is failing, while
              it is: its sessions go to their next-best replica meanwhile.
    checked   a replica whose ModelInfo matches what the coordinator started with (`identity`:
              for a target the same model, weights and vocabulary, for a draft the same kind and
              vocabulary). Sessions go only to checked replicas: a session that moved to a
              target serving another model would go on under that model's distribution, and
              a draft of another vocabulary proposes ids the target refuses. A replica that serves another model is
              refused: logged, and never called until it serves the coordinator's model again
              (asked every refresh_s). A single fixed address is not checked (it is the one
              the coordinator started with, or a load balancer).
    follow    the end of a target rollout: once every replica is refused, all serving one
              other model of the same vocabulary, that model is adopted (Replicas.follow);
              a single fixed address, once it refuses a Verify for serving another model of
              the same vocabulary (Replicas.follow_single).
"""

from __future__ import annotations

import asyncio
import hashlib
import ipaddress
import logging
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec import serving
from specdec.errors import Unavailable
from specdec.ngram import NGRAM_DRAFT
from specdec.ranges import PORT, REPLICA_REFRESH_S, address_problem
from specdec.security import ChannelSecurity
from specdec.v1 import specdec_pb2 as pb
from specdec.vocab import describe_model
from specdec.wire import target_key

log = logging.getLogger("specdec.coordinator")

DNS_SCHEME = "dns:///"
DOWN_S = 5.0
RECONNECT_CHECK_S = 0.5  # how often a failed replica's channel is looked at, once DOWN_S passed
CHECK_RETRY_S = 1.0  # a replica that did not answer ModelInfo is asked again after this
CHECK_TIMEOUT_S = 5.0
# How long a removed replica's channel stays open for the calls still running on it.
CLOSE_GRACE_S = 30.0


@dataclass(frozen=True)
class ReplicaAddress:
    """A parsed --target-address / --draft-address: fixed `endpoints`, or a `host` and `port`
    to resolve (dns:///)."""

    endpoints: tuple[str, ...] = ()
    host: str = ""
    port: int = 0

    def __str__(self) -> str:
        return f"{DNS_SCHEME}{self.host}:{self.port}" if self.host else ",".join(self.endpoints)


def parse_replica_address(text: str) -> ReplicaAddress:
    """A ReplicaAddress, or ValueError with a message naming what is wrong."""
    text = text.strip()
    if text.startswith(DNS_SCHEME):
        host, port = split_host_port(text[len(DNS_SCHEME) :], text)
        return ReplicaAddress(host=host, port=port)
    parts = [part.strip() for part in text.split(",")]
    if len(parts) == 1:
        if problem := address_problem(parts[0]):  # empty, a URL, a port outside 1-65535
            raise ValueError(problem)
        return ReplicaAddress(endpoints=(parts[0],))  # any gRPC target, as before: unix:..., a name
    for part in parts:
        split_host_port(part, text)
    if len(set(parts)) != len(parts):
        raise ValueError(f"{text!r} names a replica twice")
    return ReplicaAddress(endpoints=tuple(parts))


def split_host_port(part: str, whole: str) -> tuple[str, int]:
    host, sep, port = part.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or int(port) not in PORT:
        raise ValueError(f"{part!r} in {whole!r} is not HOST:PORT: the port must be {PORT.describe()}")
    return host, int(port)


def endpoint_of(ip: str, port: int) -> str:
    """The gRPC target of one resolved address."""
    return f"ipv6:[{ip}]:{port}" if ipaddress.ip_address(ip).version == 6 else f"ipv4:{ip}:{port}"


def score(session_id: str, endpoint: str) -> int:
    """The rendezvous score of a replica for a session: the highest-scoring replica serves it."""
    digest = hashlib.blake2b(f"{endpoint}\0{session_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


@dataclass
class Replica:
    endpoint: str  # the gRPC target this replica's channel connects to
    channel: object  # grpc.aio.Channel (or specdec.security.TokenChannel)
    stub: object  # DraftStub / TargetStub on `channel`
    down_until: float = 0.0  # time.monotonic() before which it is skipped
    recovering: bool = False  # failed, and not seen connected and SERVING since (usable, recover)
    checked: bool = False  # serves the coordinator's model (module doc); set by Replicas
    refused: str = ""  # why it is never called: it serves another model
    info: pb.ModelInfoResponse | None = None  # what it answered when last checked
    # time.monotonic() a Propose on it last streamed a token (a draft replica busy with one
    # session's long prefill serves the others meanwhile; a wedged one serves none: cycles)
    answered_at: float = 0.0
    recovery: asyncio.Task | None = None  # the last task of `recover`
    # A grpc.health.v1 HealthStub on `channel`, made with it: a stub made on a closed channel
    # blocked the event loop for good (grpcio 1.85, in _get_registered_call_handle).
    health: object = None

    def failed(self) -> None:
        """Skip this replica for DOWN_S seconds (a call to it failed UNAVAILABLE, or a Propose
        heard nothing from it for its whole budget), and after that until it has recovered
        (`recovering`; see recover)."""
        self.down_until = time.monotonic() + DOWN_S
        if not self.recovering:
            self.recovering = True
            self.recovery = asyncio.get_running_loop().create_task(self.recover())

    async def recover(self) -> None:
        """Once DOWN_S passed, look every RECONNECT_CHECK_S until the channel has connected and
        the replica's gRPC health says SERVING: only then is it called again. One frozen (a hung
        host: its kernel still accepts TCP, it answers nothing) used to be called while its
        channel was connecting, and each call waited for gRPC's 20 s connect timeout, every
        DOWN_S for as long as it stayed frozen; one whose model worker is wedged (a hung device:
        serving.ModelWorker) still connects, and was called again every DOWN_S only to refuse.
        A look may take CHECK_TIMEOUT_S (a health Check that hangs). Ends when the channel is
        closed or the task cancelled (the replica removed, the coordinator closing)."""
        await asyncio.sleep(DOWN_S)
        while (state := self.channel.get_state(try_to_connect=True)) != grpc.ChannelConnectivity.SHUTDOWN:
            if state == grpc.ChannelConnectivity.READY and await self.says_serving():
                self.recovering = False
                return
            await asyncio.sleep(RECONNECT_CHECK_S)

    async def says_serving(self) -> bool:
        """Whether the replica's gRPC health says SERVING (a loaded model service whose worker is
        not wedged). One without a health service (a proxy in front of it) is taken at its
        channel's word."""
        try:
            reply = await self.health.Check(health_pb2.HealthCheckRequest(), timeout=CHECK_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            return exc.code() == grpc.StatusCode.UNIMPLEMENTED
        except grpc.aio.UsageError:  # its channel closed meanwhile (the replica removed): recover stops
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    def usable(self, now: float) -> bool:
        if now < self.down_until or self.recovering:
            return False
        state = self.channel.get_state(try_to_connect=False)
        return state != grpc.ChannelConnectivity.TRANSIENT_FAILURE


Resolver = Callable[[str, int], Awaitable[list[str]]]
Identity = Callable[[pb.ModelInfoResponse], tuple]


def target_identity(info: pb.ModelInfoResponse) -> tuple:
    """What every target replica must share: the model and its weights (a session keeps its
    distribution wherever it moves) and its vocabulary (token ids, end tokens, context length).
    Starts, as every identity, with what describe_model names: (name, vocabulary, weights)."""
    return (*target_key(info), info.vocab_size, info.max_context, tuple(info.eos_token_ids))


def draft_identity(info: pb.ModelInfoResponse) -> tuple:
    """What every draft replica must share: its kind and vocabulary (any draft of the target's
    vocabulary keeps the output the target's, so the model itself may differ: a draft rollout;
    one of another vocabulary proposes ids the target would refuse, or cannot use)."""
    return (f"a{'n' if info.kind == NGRAM_DRAFT else ''} {info.kind} draft", info.vocab_fingerprint, "")


def describe_identity(identity: tuple) -> str:
    return describe_model(*identity[:3])


def loaded(info: pb.ModelInfoResponse) -> bool:
    """A ModelInfo of a service that has loaded its model (an n-gram draft has no vocabulary)."""
    return bool(info.vocab_size) or info.kind == NGRAM_DRAFT


async def loaded_info(replica: Replica) -> pb.ModelInfoResponse | None:
    """`replica`'s ModelInfo, asked once; None where it does not answer within CHECK_TIMEOUT_S
    or has not loaded its model yet (check, follow_single, serves_reference)."""
    try:
        info = await replica.stub.ModelInfo(pb.ModelInfoRequest(), timeout=CHECK_TIMEOUT_S)
    except grpc.aio.AioRpcError:
        return None
    return info if loaded(info) else None


async def resolve(host: str, port: int) -> list[str]:
    """The IP addresses `host` resolves to, sorted, without duplicates."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({info[4][0] for info in infos})


class NoReplicaYet(Unavailable):
    """No replica to call for a moment: the address resolves to none yet, or none has answered
    its first ModelInfo (one that replaced another behind a dns:/// name, say). A cycle's
    Verify waits it out as it does a lost call (CycleLoop.verify)."""


@dataclass
class Replicas:
    """The replicas of one model service (see the module doc). `start()` before `pick()`;
    `close()` at the end."""

    address: ReplicaAddress
    stub_class: type
    security: ChannelSecurity | None = None
    refresh_s: float = REPLICA_REFRESH_S
    resolver: Resolver = resolve
    replicas: dict[str, Replica] = field(default_factory=dict)  # endpoint -> replica
    refresher: asyncio.Task | None = None
    closing: set[asyncio.Task] = field(default_factory=set)
    # Replicas serve `name` (for messages); with `identity`, only checked ones are called.
    name: str = "target"
    identity: Identity | None = None
    adopted: pb.ModelInfoResponse | None = None  # the ModelInfo the coordinator started with (adopt)
    # Adopt the model every replica serves once none serves the adopted one (follow).
    follow_rollout: bool = False
    checks: dict[str, asyncio.Task] = field(default_factory=dict)  # endpoint -> its running check

    @property
    def single(self) -> bool:
        """A single fixed address: calls wait for it to come back (wait_for_ready) rather
        than fail over, as there is nowhere else to go."""
        return len(self.address.endpoints) == 1

    async def start(self) -> None:
        if not self.address.host:
            self.update(list(self.address.endpoints))
            return
        await self.refresh()
        self.refresher = asyncio.get_running_loop().create_task(self.keep_refreshing())

    @property
    def checking(self) -> bool:
        """Only checked replicas are called (module doc)."""
        return self.identity is not None and not self.single

    @property
    def reference(self) -> tuple | None:
        """The identity every replica must have: the adopted ModelInfo's."""
        return None if self.adopted is None else self.identity(self.adopted)

    def cleared(self, replica: Replica) -> bool:
        """May be called: checked, where replicas are checked."""
        return replica.checked or not self.checking

    def every(self) -> list[Replica]:
        """Every replica known, usable, checked or not (for calls any of them may need: a
        deleted session's Release)."""
        return list(self.replicas.values())

    def pick(self, session_id: str) -> Replica:
        """The replica that serves `session_id`: the highest-scoring usable one, or the
        highest-scoring one when none is usable (its calls then fail or wait). Where replicas
        are checked, only checked ones count, and none: Unavailable, saying why."""
        if not self.replicas:
            raise NoReplicaYet(f"{self.address} resolves to no address yet; retry shortly")
        return self.best([r for r in self.replicas.values() if self.cleared(r)], session_id)

    def best(self, candidates: list[Replica], session_id: str) -> Replica:
        """Of `candidates`, the highest-scoring usable one for `session_id`, else the
        highest-scoring one; none: Unavailable, saying why."""
        if not candidates:
            raise self.none_checked()
        ranked = sorted(candidates, key=lambda r: score(session_id, r.endpoint), reverse=True)
        now = time.monotonic()
        return next((r for r in ranked if r.usable(now)), ranked[0])

    def none_checked(self) -> Unavailable:
        """Why no replica may be called: every one refused (for good, until a restart or a
        rollout to follow), or none has answered yet (NoReplicaYet: for a moment)."""
        refused = [r for r in self.replicas.values() if r.refused]
        if refused and len(refused) == len(self.replicas):
            return Unavailable(f"every {self.name} replica at {self.address} differs from what this coordinator "
                               f"serves, {describe_identity(self.reference)}: {refused[0].refused}; restart the "
                               "coordinator to adopt it")  # fmt: skip
        return NoReplicaYet(f"no {self.name} replica at {self.address} has answered yet; retry shortly")

    def usable_count(self) -> int:
        """Replicas not skipped after a failed call, nor unchecked or refused (the metrics
        thread calls this: it reads no channel state, only down_until, recovering and the checks)."""
        now = time.monotonic()
        return sum(r.down_until <= now and not r.recovering and self.cleared(r) for r in list(self.replicas.values()))

    def refused_count(self) -> int:
        return sum(bool(r.refused) for r in list(self.replicas.values()))

    def any(self) -> Replica:
        """A replica for calls that concern no session (ModelInfo): the highest-scoring usable
        one not refused, checked or not."""
        return self.best([r for r in self.replicas.values() if not r.refused], "")

    def adopt(self, replica: Replica, info: pb.ModelInfoResponse) -> None:
        """Take `info`, which `replica` answered, as the coordinator's model, and check every
        other replica against it (in the background; `settle` waits for the first answers)."""
        if self.identity is None:
            return
        self.adopted = info
        replica.checked = True
        for other in self.replicas.values():
            self.start_check(other)

    def start_check(self, replica: Replica) -> None:
        if self.checking and self.adopted is not None and not replica.checked and replica.endpoint not in self.checks:
            task = asyncio.get_running_loop().create_task(self.check(replica))
            self.checks[replica.endpoint] = task
            task.add_done_callback(lambda done: self.checks.get(replica.endpoint) is done and self.checks.pop(replica.endpoint))

    async def check(self, replica: Replica) -> None:
        """Ask `replica` for its ModelInfo until it answers (every CHECK_RETRY_S: it may be
        loading), then mark it checked, or refused; a refused one is asked again every
        refresh_s, and taken back once it serves the coordinator's model."""
        while replica.endpoint in self.replicas:
            if (info := await loaded_info(replica)) is None:
                await asyncio.sleep(CHECK_RETRY_S)
                continue
            replica.info = info
            identity = self.identity(info)
            if identity == self.reference:
                if replica.refused:
                    log.info("%s replica %s now serves %s: taken back", self.name, replica.endpoint,
                             describe_identity(identity))  # fmt: skip
                replica.refused, replica.checked = "", True
                return
            refused = f"{replica.endpoint} serves {describe_identity(identity)}"
            if replica.refused != refused:  # refused now, or serving yet another model than when refused
                if not replica.refused:
                    log.error("%s replica %s; this coordinator serves %s: refused, no session goes to it",
                              self.name, refused, describe_identity(self.reference))  # fmt: skip
                replica.refused = refused
                # Each change may complete a rollout: a replica refused before, restarted on the
                # model the others now serve, used to leave every replica refused for good.
                self.follow()
            await asyncio.sleep(self.refresh_s)

    def follow(self) -> None:
        """The end of a rollout (with follow_rollout): once every replica is refused, all for
        serving one other model of the adopted vocabulary (other weights, another name: the
        coordinator's tokenizer still holds), adopt that model: new sessions run on it. A
        session begun on the old one cannot go on (its Verify names that model, and every
        replica refuses it) nor be resumed. Another vocabulary needs a coordinator restart."""
        replicas = list(self.replicas.values())
        if not (self.follow_rollout and self.adopted is not None and replicas and all(r.refused for r in replicas)):
            return
        if len({self.identity(r.info) for r in replicas}) != 1 or not self.is_rollout(replicas[0].info):
            return
        self.take_rollout(replicas[0].info, f"every {self.name} replica at {self.address}")
        for replica in replicas:
            replica.refused, replica.checked = "", True

    def is_rollout(self, info: pb.ModelInfoResponse) -> bool:
        """Whether `info` is a model a rollout may replace the adopted one with: another model
        of the adopted vocabulary (the coordinator's tokenizer still holds)."""
        return self.identity(info) != self.reference and info.vocab_fingerprint == self.adopted.vocab_fingerprint

    def take_rollout(self, info: pb.ModelInfoResponse, where: str) -> None:
        """Adopt the model a rollout put in place of the adopted one (follow, follow_single)."""
        log.warning("%s now serves %s: adopted, new sessions run on it (this coordinator served %s; sessions "
                    "begun on that cannot go on)", where, describe_identity(self.identity(info)),
                    describe_identity(self.reference))  # fmt: skip
        self.adopted = info

    async def follow_single(self, replica: Replica) -> None:
        """follow for a single fixed address, which is never checked (it may be a load balancer
        in front of several pods): after it refused a call, ask what it serves, and adopt that
        when it is another model of the adopted vocabulary. Behind a balancer in mid-rollout the
        answer is one pod's: a session that then meets a pod of the other model is refused, as
        it would be anyway; once every pod serves the new model, so does the coordinator."""
        if not self.follow_rollout:
            return
        if (info := await loaded_info(replica)) is not None and self.is_rollout(info):
            self.take_rollout(info, f"the {self.name} at {self.address}")

    async def recheck(self, replica: Replica) -> bool:
        """Check `replica` again (a call it refused may mean it now serves another model);
        True when it is refused now. A single fixed address is never refused: it is asked
        what it serves, to follow a rollout there (follow_single)."""
        if self.identity is None or self.adopted is None:
            return False
        if self.single:
            await self.follow_single(replica)
            return False
        if await self.serves_reference(replica):  # the refusal was of the call (a stale run's), not the model
            return False
        replica.checked = False
        self.start_check(replica)
        await self.decided([replica])
        return bool(replica.refused)

    async def serves_reference(self, replica: Replica) -> bool:
        """Whether `replica` answers ModelInfo with the coordinator's model, asked once; it stays
        routed meanwhile. recheck un-routed it for the whole round trip, so every other session
        on a healthy replica moved away and back (rebuilding twice) after one stale run's refusal."""
        info = await loaded_info(replica)
        return info is not None and self.identity(info) == self.reference

    async def settle(self) -> None:
        """Wait until every replica has been checked or refused once (at most CHECK_TIMEOUT_S)."""
        if self.checking:
            await self.decided(list(self.replicas.values()))

    async def decided(self, replicas: list[Replica], timeout_s: float = CHECK_TIMEOUT_S) -> None:
        """Wait (at most timeout_s) until each of `replicas` is checked, refused or removed."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and any(
            self.replicas.get(r.endpoint) is r and not (r.checked or r.refused) for r in replicas
        ):
            await asyncio.sleep(0.02)

    async def refresh(self) -> None:
        try:
            ips = await self.resolver(self.address.host, self.address.port)
        except OSError as exc:
            log.warning("resolving %s: %s; keeping %d replica(s)", self.address, exc, len(self.replicas))
            return
        if ips:  # a name that resolves to nothing keeps the last replicas rather than none
            self.update([endpoint_of(ip, self.address.port) for ip in ips])

    async def keep_refreshing(self) -> None:
        while True:
            await asyncio.sleep(self.refresh_s)
            try:
                await self.refresh()
            except SystemExit as exc:
                # A new address's channel reads the TLS files (read_pem), and one unreadable for a
                # moment (a certificate being rotated) is a SystemExit, the error of a bad flag at
                # start: raised from this task it ended the coordinator's event loop, and the process.
                log.error("%s: cannot open a channel to a new replica (%s); tried again in %.0f s",
                          self.address, exc, self.refresh_s)  # fmt: skip

    def update(self, endpoints: list[str]) -> None:
        """Open channels to new endpoints and close (after CLOSE_GRACE_S) those gone."""
        added = [endpoint for endpoint in endpoints if endpoint not in self.replicas]
        gone = [endpoint for endpoint in self.replicas if endpoint not in endpoints]
        for endpoint in added:
            # A resolved address is an IP: TLS checks the certificate against the name.
            channel = serving.channel(endpoint, self.security, server_name=self.address.host)
            health = health_pb2_grpc.HealthStub(channel)
            self.replicas[endpoint] = Replica(endpoint, channel, self.stub_class(channel), health=health)
            self.start_check(self.replicas[endpoint])
        for endpoint in gone:
            replica = self.replicas.pop(endpoint)
            if (check := self.checks.pop(endpoint, None)) is not None:
                check.cancel()
            if replica.recovery is not None:
                replica.recovery.cancel()
            task = asyncio.get_running_loop().create_task(replica.channel.close(CLOSE_GRACE_S))
            self.closing.add(task)
            task.add_done_callback(self.closing.discard)
        if self.address.host and (added or gone):
            log.info("%s: %d replica(s): %s", self.address, len(self.replicas), ", ".join(sorted(self.replicas)))
        if gone:  # the last replicas of the adopted model may have gone
            self.follow()

    async def close(self) -> None:
        if self.refresher is not None:
            self.refresher.cancel()
        for task in [*self.checks.values(), *(r.recovery for r in self.replicas.values() if r.recovery)]:
            task.cancel()
        await asyncio.gather(*(r.channel.close() for r in self.replicas.values()), *self.closing,
                             return_exceptions=True)  # fmt: skip
