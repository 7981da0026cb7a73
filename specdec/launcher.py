"""Run the whole stack on this machine: Redis, draft, target, coordinator.

Each service is a separate process on loopback, exactly as in a deployment, so
the draft and the target really run side by side. Used by `specdec up`, by
`specdec generate` when nothing serves yet, and by the end-to-end tests.

The internal hops are always authenticated: each stack makes a random internal
token and hands it to its processes through the environment (never the command
line, which other users of the machine can read; the Redis URL, which may hold a
password, travels the same way). With `tls`, every hop is TLS and the internal
hops are mutual TLS, all with the one certificate given.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import IO

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec.catalog import DEFAULT_TARGET
from specdec.children import start_child
from specdec.ngram import NGRAM_DRAFT
from specdec.ranges import join_host_port
from specdec.redis_server import EmbeddedRedis, RedisStartError, free_port
from specdec.session import REDIS_URL_ENV
from specdec.security import AUTH_METADATA, BEARER, INTERNAL_TOKEN_ENV, read_pem
from specdec.serving import COORDINATOR_SERVICE, DRAFT_SERVICE, TARGET_SERVICE

STOP_TIMEOUT_S = 10.0
# What the processes of a stack, which share this machine's cores, run with unless the caller's
# environment says otherwise. libgomp's idle OpenMP threads spin 300,000 rounds before they
# sleep: after each forward pass the target's idle thread burnt ~10 ms of a core (measured on
# the 2-core machine of README "Performance"), just when the draft starts drafting beside it.
# With 10,000 rounds it burnt 0.1 ms, and the rounds still cover the gaps between the
# parallel regions of one pass: the target's in-service passes over the same passes timed
# alone (bench forward_vs_alone) were 1.04 and 0.94 with it, 1.02 and 0.96 without.
SHARED_MACHINE_ENV = {"GOMP_SPINCOUNT": "10000"}
# A terse stack's services: warnings and errors only, and no progress bar of transformers' own
# (loading weights); specdec's own bar of a first use's model preparation still shows.
TERSE_LOG_LEVEL = "WARNING"
TERSE_ENV = {"HF_HUB_DISABLE_PROGRESS_BARS": "1"}
LOG_TAIL_LINES = 20  # of a quiet service's output, in the error when it dies while starting
LOG_TAIL_BYTES = 65536  # read from its end to find them
# Hosts that mean "every interface": a service listening there is reached on loopback.
WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", "[::]"})


class StackStartError(RuntimeError):
    """A service of the stack died or never reported SERVING while the stack started."""


@dataclass
class StackTLS:
    """PEM files for a TLS stack: one certificate (valid for 127.0.0.1 / localhost, for
    server and client use) and its key, and the CA that signed it."""

    cert: str
    key: str
    ca: str


@dataclass
class StackConfig:
    port: int = 50051
    host: str = "127.0.0.1"
    target: str = DEFAULT_TARGET
    draft: str = ""  # "" = the target's default draft (specdec.catalog.default_draft)
    # The coordinator's --ngram-first (with a model draft: lookups for repeated n-grams); 0 = off.
    ngram_first: int = 0
    redis_url: str = field(default="", repr=False)  # may hold the Redis password: never in a repr
    # Torch threads for the target and draft processes (None: split the cores).
    target_threads: int | None = None
    draft_threads: int | None = None
    # Extra flags passed through to each `specdec serve` command.
    coordinator_args: list[str] = field(default_factory=list)
    draft_args: list[str] = field(default_factory=list)
    target_args: list[str] = field(default_factory=list)
    ready_timeout_s: float = 900.0
    # /metrics ports: coordinator at base, draft at base + 1, target at base + 2; 0 = off.
    metrics_port_base: int = 0
    # Extra environment for the service processes (OTEL_* settings are inherited anyway). It may
    # hold tokens (SPECDEC_AUTH_TOKEN): never in a repr.
    env: dict[str, str] = field(default_factory=dict, repr=False)
    # TLS on every hop, mutual TLS on the internal ones; None = plaintext on loopback.
    tls: StackTLS | None = None
    # API tokens file for the coordinator (clients must send one); "" = no token check.
    auth_token_file: str = ""

    def __post_init__(self) -> None:
        if not self.draft:  # the catalog draft distilled for the target, else ngram
            from specdec.catalog import default_draft

            self.draft = default_draft(self.target)


def default_threads(draft: str = "") -> tuple[int, int]:
    """(target, draft) torch threads: a model draft gets one core and the target the rest,
    so the two really run side by side; an n-gram draft needs no core of its own."""
    cores = os.cpu_count() or 2
    if draft == NGRAM_DRAFT:
        return cores, 1
    return max(1, cores - 1), 1


def service_environment(parent: Mapping[str, str], extra: Mapping[str, str]) -> dict[str, str]:
    """The environment of a stack's process: SHARED_MACHINE_ENV, then `parent` (the caller's
    own settings win), then `extra`."""
    return {**SHARED_MACHINE_ENV, **parent, **extra}


def solo_threads() -> int:
    """Target threads for cycles without drafts: the draft is idle then, so all the cores."""
    return os.cpu_count() or 2


class Stack:
    """Start with `start()`, stop with `stop()`; also a context manager.

    The services' output goes to our stderr; `terse`: only their warnings and errors (the
    stack of a one-shot command such as `specdec generate`); `quiet`: none of it, but the
    last lines of a service that dies while starting, in the error (bench, soak)."""

    def __init__(self, config: StackConfig, *, quiet: bool = False, terse: bool = False):
        self.config = config
        self.quiet = quiet
        self.terse = terse
        self.redis: EmbeddedRedis | None = None
        self.processes: dict[str, subprocess.Popen] = {}
        self.commands: dict[str, list[str]] = {}  # each process's command line (restart runs it again)
        self.kinds: dict[str, str] = {}  # process name -> its service, where they differ (add_replica)
        self.envs: dict[str, dict[str, str]] = {}
        self.ports: dict[str, int] = {}
        self.logs: dict[str, IO[bytes]] = {}  # a quiet service's output
        # The secret the coordinator sends to the draft and target services.
        self.internal_token = secrets.token_urlsafe(32)
        self.interrupts: list[int] = []  # Ctrl-Cs held while starting or stopping (holding_interrupts)
        self.ending_handlers: dict[int, object] = {}  # SIGTERM/SIGHUP handlers to restore (forward_ending_signals)
        self.holding = False  # within holding_interrupts

    @property
    def address(self) -> str:
        return join_host_port(self.config.host, self.config.port)

    @property
    def metrics_ports(self) -> dict[str, int]:
        base = self.config.metrics_port_base
        return {"coordinator": base, "draft": base + 1, "target": base + 2} if base else {}

    @property
    def metrics_urls(self) -> dict[str, str]:
        """The /metrics URL of each service with a metrics port, as this machine reaches it."""
        return {name: f"http://{self.local_address(name, port)}/metrics" for name, port in self.metrics_ports.items()}

    def host_of(self, service: str) -> str:
        """The host a process of `service` listens on: the config's host for a coordinator,
        loopback for the draft and target services."""
        return self.config.host if service == "coordinator" else "127.0.0.1"

    def local_address(self, name: str, port: int | None = None) -> str:
        """HOST:PORT where this machine reaches process `name` (on `port`, else its gRPC port):
        the host it listens on, or loopback where that is every interface (WILDCARD_HOSTS)."""
        host = self.host_of(self.kind(name))
        return join_host_port("127.0.0.1" if host in WILDCARD_HOSTS else host, self.ports[name] if port is None else port)

    @property
    def redis_url(self) -> str:
        return self.config.redis_url or (self.redis.url if self.redis else "")

    @property
    def internal_metadata(self) -> tuple[tuple[str, str], ...]:
        """Metadata that authenticates a call to this stack's draft or target service."""
        return ((AUTH_METADATA, BEARER + self.internal_token),)

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        """Credentials to reach any of this stack's services (None when plaintext)."""
        tls = self.config.tls
        if tls is None:
            return None
        return grpc.ssl_channel_credentials(
            read_pem(tls.ca, "CA certificate"), read_pem(tls.key, "TLS key"), read_pem(tls.cert, "TLS certificate")
        )

    def tls_args(self, service: str) -> list[str]:
        """The TLS flags of a process of `service`: a coordinator, added ones too, talks mutual TLS
        to the model services."""
        tls = self.config.tls
        if tls is None:
            return []
        args = ["--tls-cert", tls.cert, "--tls-key", tls.key]
        if service == "coordinator":
            return args + ["--internal-tls-ca", tls.ca, "--internal-tls-cert", tls.cert, "--internal-tls-key", tls.key]
        return args + ["--tls-client-ca", tls.ca]

    def start(self) -> "Stack":
        """Start Redis (unless the config names one) and the three services; wait until all
        report SERVING. On any error, Ctrl-C included, stop what was started and raise."""
        cfg = self.config
        self.forward_ending_signals()
        try:  # around the holding: an interrupt it raises as it ends stops the stack too
            with self.holding_interrupts():
                if not cfg.redis_url:
                    self.redis = self.start_redis()
                self.ports = {"coordinator": cfg.port}
                self.ports["draft"] = free_port_except(self.ports.values())
                self.ports["target"] = free_port_except(self.ports.values())
                for name in ("target", "draft", "coordinator"):
                    self.raise_if_interrupted()
                    self.spawn(name, name, *self.service_args(name))
                self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    @staticmethod
    def start_redis() -> EmbeddedRedis:
        """An embedded redis-server, started; StackStartError (the command's one line) where it cannot start."""
        try:
            return EmbeddedRedis().start()
        except RedisStartError as exc:  # a command's one line, as a service that cannot start
            raise StackStartError(str(exc)) from None

    @contextlib.contextmanager
    def holding_interrupts(self):
        """Within: Ctrl-C (SIGINT) is held, not raised where it lands; raise_if_interrupted
        raises it at points where nothing is half done, and leaving raises one still held.
        A KeyboardInterrupt raised inside Popen leaves the child it has forked running with
        no one to stop it (and holding our stderr open); one raised inside a gRPC call can
        leave its channel unable to close. SIGTERM and SIGHUP are held alike where this stack
        handles them (forward_ending_signals); Ctrl-C only where it raises KeyboardInterrupt
        as usual (Python's default handler). Only in the main thread."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        hold_ctrl_c = signal.getsignal(signal.SIGINT) is signal.default_int_handler
        self.interrupts.clear()
        self.holding = True
        if hold_ctrl_c:
            signal.signal(signal.SIGINT, lambda signum, frame: self.interrupts.append(signum))
        try:
            yield
        finally:
            self.holding = False
            if hold_ctrl_c:
                signal.signal(signal.SIGINT, signal.default_int_handler)
        self.raise_if_interrupted()

    def raise_if_interrupted(self) -> None:
        """KeyboardInterrupt if Ctrl-C came while interrupts were held."""
        if self.interrupts:
            self.interrupts.clear()
            raise KeyboardInterrupt

    def service_args(self, service: str) -> list[str]:
        """The flags this stack starts `service` with (but its address, TLS and metrics port)."""
        cfg = self.config
        target_threads, draft_threads = default_threads(cfg.draft)
        if service == "target":
            return ["--model", cfg.target, "--threads", str(cfg.target_threads or target_threads),
                    "--solo-threads", str(cfg.target_threads or solo_threads()), *cfg.target_args]  # fmt: skip
        if service == "draft":
            return ["--model", cfg.draft, "--threads", str(cfg.draft_threads or draft_threads), *cfg.draft_args]
        return self.coordinator_args()

    def coordinator_args(self) -> list[str]:
        cfg = self.config
        auth = ["--auth-token-file", cfg.auth_token_file] if cfg.auth_token_file else []
        lookups = ["--ngram-first", str(cfg.ngram_first)] if cfg.ngram_first else []
        return [
            "--draft-address", f"127.0.0.1:{self.ports['draft']}",
            "--target-address", f"127.0.0.1:{self.ports['target']}",
            # it waits for the models as long as the stack waits for it (it gave up after 600 s of a 900 s start)
            "--startup-timeout", f"{cfg.ready_timeout_s:g}",
            *auth, *lookups, *cfg.coordinator_args,
        ]  # fmt: skip

    def add_coordinator(self, name: str, *args: str, wait: bool = True) -> str:
        """Start one more coordinator, called `name`, on a free port, in front of this stack's
        draft, target and Redis (a replica, as behind a load balancer), with `args` added to
        its flags (later flags win); wait until it serves and return its address. stop()
        stops it with the first one."""
        return self.add_replica(name, "coordinator", *args, wait=wait)

    def add_replica(self, name: str, service: str, *args: str, wait: bool = True) -> str:
        """Start one more process of `service` (coordinator, draft or target), called `name`,
        with the first one's flags plus `args` (later flags win), on a free port; wait until
        it serves (unless not `wait`: then `wait_ready((name, ...))` waits for several started
        together) and return its address. The stack's coordinator does not call an added model
        service: name it in a coordinator's --target-address / --draft-address."""
        self.ports[name] = free_port_except(self.ports.values())
        self.spawn(name, service, *self.service_args(service), *args)
        if wait:
            self.wait_ready((name,))
        return join_host_port(self.host_of(service), self.ports[name])

    def spawn(self, name: str, service: str, *args: str) -> None:
        host = self.host_of(service)
        terse = ["--log-level", TERSE_LOG_LEVEL] if self.terse else []  # before `args`, which win
        command = [
            sys.executable, "-m", "specdec.cli", "serve", service,
            "--host", host, "--port", str(self.ports[name]), *self.tls_args(service), *terse, *args,
        ]  # fmt: skip
        if self.metrics_ports:
            command += ["--metrics-port", str(self.metrics_ports.get(name, 0))]  # an added process: none
        secrets_env = {REDIS_URL_ENV: self.redis_url, INTERNAL_TOKEN_ENV: self.internal_token}
        env = service_environment({**(TERSE_ENV if self.terse else {}), **os.environ}, {**self.config.env, **secrets_env})
        # Each process gets its own service name in traces: specdec-draft, or <yours>-draft.
        env["OTEL_SERVICE_NAME"] = f"{env.get('OTEL_SERVICE_NAME') or 'specdec'}-{name}"
        self.envs[name] = env
        self.kinds[name] = service
        # Ended by the kernel should this process be killed before it stops them (specdec.children).
        self.commands[name] = command
        self.processes[name] = start_child(command, env=env, **self.output(name))

    def restart(self, name: str, *args: str, kill: bool = False) -> None:
        """Stop one service (SIGKILL when kill; one that has exited already stays so) and start
        it again with the same command, plus `args` (later flags win)."""
        process = self.processes[name]
        (process.kill if kill else process.terminate)()
        process.wait(timeout=STOP_TIMEOUT_S)
        self.commands[name] = [*self.commands[name], *args]
        self.processes[name] = start_child(self.commands[name], env=self.envs[name], **self.output(name))

    def output(self, name: str) -> dict:
        """Children log to our stderr (stdout stays for `ready ADDRESS`), or, when quiet, to a
        temporary file whose tail goes into the error if the service dies while starting. A
        terse child's stdout, its `NAME serving on ADDRESS` line, goes nowhere."""
        if self.quiet:
            if name not in self.logs:  # a restarted service appends to the file it had
                self.logs[name] = tempfile.TemporaryFile(prefix=f"specdec-{name}-")
            return {"stdout": self.logs[name], "stderr": self.logs[name]}
        return {"stdout": subprocess.DEVNULL if self.terse else 2, "stderr": 2}

    def log_tail(self, name: str) -> str:
        """The last lines a quiet service wrote ("" when it logs to our stderr)."""
        log = self.logs.get(name)
        if log is None:
            return ""
        # pread, not seek and read: the service writes through a copy of this file descriptor,
        # which shares its offset, so a seek put the lines it wrote meanwhile over older ones.
        size = os.fstat(log.fileno()).st_size
        end = os.pread(log.fileno(), min(size, LOG_TAIL_BYTES), max(0, size - LOG_TAIL_BYTES))
        lines = end.decode(errors="replace").splitlines()[-LOG_TAIL_LINES:]
        return "".join(f"\n  {line}" for line in lines)

    def kind(self, name: str) -> str:
        """The service a process runs: coordinator, draft or target."""
        return self.kinds.get(name, name)

    def wait_ready(self, names: tuple[str, ...] = ("target", "draft", "coordinator")) -> None:
        """Wait until each of `names` reports SERVING where it listens (local_address: a
        coordinator on --host ::1 is asked there, not on 127.0.0.1, where nothing answers)."""
        services = {"target": TARGET_SERVICE, "draft": DRAFT_SERVICE, "coordinator": COORDINATOR_SERVICE}
        deadline = time.monotonic() + self.config.ready_timeout_s
        credentials = self.channel_credentials()  # read the PEM files once, not every poll
        for name in names:
            address = self.local_address(name)
            while not is_serving(address, services[self.kind(name)], credentials=credentials):
                self.raise_if_interrupted()
                self.check_running(names)  # any of them: a draft that cannot load fails at once, not after the target
                if time.monotonic() > deadline:
                    raise StackStartError(f"the {name} service did not report SERVING in {self.config.ready_timeout_s}s")
                time.sleep(0.2)

    def first_exited(self, names) -> tuple[str, int] | None:
        """(name, exit code) of the first of `names` whose process has exited; None while all run."""
        for name in names:
            if (code := self.processes[name].poll()) is not None:
                return name, code
        return None

    def exited(self) -> str | None:
        """What has ended, once a process of the running stack has exited ("the coordinator
        service exited with code -9"); None while all run."""
        if ended := self.first_exited(self.processes):
            return f"the {ended[0]} service exited with code {ended[1]}"
        if self.redis is not None and (code := self.redis.process.poll()) is not None:
            return f"its redis-server exited with code {code}"
        return None

    def check_running(self, names: tuple[str, ...]) -> None:
        """StackStartError naming the first of `names` whose process has exited, with its last output."""
        if ended := self.first_exited(names):
            name, code = ended
            raise StackStartError(f"the {name} service exited with code {code} while starting"
                                  + (f"; its last output:{tail}" if (tail := self.log_tail(name)) else ""))  # fmt: skip

    def stop(self) -> None:
        """Stop the coordinators first (they release sessions on the model services), then the
        rest. A Ctrl-C meanwhile is raised once every process is stopped."""
        with self.holding_interrupts():
            coordinators = [p for n, p in self.processes.items() if self.kind(n) == "coordinator"]
            models = [p for n, p in self.processes.items() if self.kind(n) != "coordinator"]
            for group in (coordinators, models):
                for process in group:
                    if process.poll() is None:
                        process.send_signal(signal.SIGTERM)
                deadline = time.monotonic() + STOP_TIMEOUT_S
                for process in group:
                    try:
                        process.wait(timeout=max(0.1, deadline - time.monotonic()))
                    except subprocess.TimeoutExpired:
                        process.kill()
                        process.wait()
            self.processes.clear()
            if self.redis is not None:
                self.redis.stop()
                self.redis = None
            for log in self.logs.values():
                log.close()
            self.logs.clear()
            self.restore_ending_signals()

    def forward_ending_signals(self) -> None:
        """While the stack runs, SIGTERM and SIGHUP (a process manager's stop, a closed terminal)
        end this process as Ctrl-C does, through KeyboardInterrupt (held where Ctrl-C is), so
        that the stack is stopped on the way out: their default action ended it at once and left
        the services running, one of them on the stack's port. Only signals left at that default
        (a caller's own handler stays, as does `nohup`'s ignored SIGHUP), and only in the main
        thread. `specdec up` relies on it too: it waits for the KeyboardInterrupt."""
        if threading.current_thread() is not threading.main_thread():
            return
        for ending in ENDING_SIGNALS:
            if signal.getsignal(ending) == signal.SIG_DFL:
                self.ending_handlers[ending] = signal.signal(ending, self.end_on_signal)

    def end_on_signal(self, signum, frame) -> None:
        if self.holding:
            self.interrupts.append(signum)
        else:
            raise KeyboardInterrupt

    def restore_ending_signals(self) -> None:
        for ending, handler in self.ending_handlers.items():
            signal.signal(ending, handler)
        self.ending_handlers.clear()

    def __enter__(self) -> "Stack":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


ENDING_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


def free_port_except(taken) -> int:
    """A free loopback port that is none of `taken` (ports picked but not yet bound)."""
    taken = set(taken)
    while (port := free_port()) in taken:
        pass
    return port


def is_listening(host: str, port: int, timeout_s: float = 1.0) -> bool:
    """True when something accepts TCP connections on host:port (a serving coordinator or not)."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def is_serving(
    address: str, service: str = "", timeout_s: float = 1.0, credentials: grpc.ChannelCredentials | None = None
) -> bool:
    """True when the gRPC health service at `address` reports SERVING for `service`."""
    channel = grpc.insecure_channel(address) if credentials is None else grpc.secure_channel(address, credentials)
    with channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s
            )
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING
