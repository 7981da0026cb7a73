"""The range of each numeric setting, defined once and worded once.

A `Range` is a setting's rule and the words that state it. The same object is the argparse type of
its flag (a value no run can use fails before a stack starts or a model loads), the check of a
config built in code (`specdec distill`'s), and the wording of the services' own refusal of a
request (`specdec.wire`), so the command line, the SDK and the server cannot disagree on an edge.

Terms: `low` and `high` are the edges; `above` / `below` say the edge itself is outside (top_p is
above 0 and at most 1); `note` says what an edge value means ("0 = greedy").

Text has one rule, here too: it travels as UTF-8 (`text_problem`: the command line's `utf8_text`
type, the SDK's check_text; `undecodable` words a file that is not UTF-8).
"""

from __future__ import annotations

import argparse
import math
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Range:
    kind: type  # int or float
    low: float
    high: float = math.inf
    above: bool = False  # low itself is outside
    below: bool = False  # high itself is outside
    note: str = ""

    def __contains__(self, value: object) -> bool:
        if isinstance(value, bool) or not isinstance(value, int if self.kind is int else (int, float)):
            return False
        try:
            if not math.isfinite(value):
                return False
        except OverflowError:  # an int past any float (10**400)
            return False
        over_low = value > self.low if self.above else value >= self.low
        under_high = value < self.high if self.below else value <= self.high
        return over_low and under_high

    def rule(self) -> str:
        """'at least 0 and below 1', 'above 0', ... (the edges only)."""
        words = f"{'above' if self.above else 'at least'} {self.show(self.low)}"
        if self.high < math.inf:
            words += f" and {'below' if self.below else 'at most'} {self.show(self.high)}"
        return words

    def describe(self) -> str:
        """'an integer at least 1 and at most 65535 (0 = off)': what a valid value is."""
        noun = "an integer" if self.kind is int else "a number"
        return f"{noun} {self.rule()}{f' ({self.note})' if self.note else ''}"

    def show(self, value: float) -> str:
        return str(int(value)) if self.kind is int else f"{value:g}"

    def problem(self, name: str, value: object) -> str | None:
        """None when `value` is in range, else '{name} must be ..., got {value}'."""
        if value in self:
            return None
        return f"{name} must be {self.describe()}, got {value!r}"

    def __call__(self, text: str):
        """argparse type: the value of `text`, or ArgumentTypeError stating the rule."""
        try:
            value = self.kind(text)
        except ValueError:
            value = None
        if value not in self:
            raise argparse.ArgumentTypeError(f"expected {self.describe()}, got {text!r}")
        return value


# Every request may set these (the coordinator refuses the rest with INVALID_ARGUMENT).
# A proto float is 32-bit: a larger value would travel as inf.
FLOAT32_MAX = 3.4028234663852886e38
TEMPERATURE = Range(float, 0, FLOAT32_MAX, note="0 = greedy")
TOP_K = Range(int, 0, note="0 = off")
TOP_P = Range(float, 0, 1, above=True, note="1 = off")
# The seeds the services take: below 2**63, though the proto field is a uint64.
SEED = Range(int, 0, 2**63 - 1)
# A duration. gRPC holds a deadline as 64-bit nanoseconds (292 years): a timeout of 1e10 s or more
# ended a call DEADLINE_EXCEEDED at once. 1e9 s is 31 years.
SECONDS = Range(float, 0, 1e9, above=True)
# How often the SDK sends a call that failed UNAVAILABLE before any answer again (gRPC makes at
# most 5 attempts of a call: specdec.client.service_config), and resumes a stream that broke.
RETRIES = Range(int, 0, 4)
DEFAULT_RETRIES = 2
AT_LEAST_ONE = Range(int, 1)
# A count in a uint32 proto field (ResumeRequest's received_tokens and received_chars).
UINT32 = Range(int, 0, 2**32 - 1)
# An int32 proto field (max_new_tokens, top_k, num_speculative_tokens, prompt_token_ids).
INT32 = Range(int, -(2**31), 2**31 - 1)
MAX_NEW_TOKENS = AT_LEAST_ONE
# The services' limits unless told otherwise (--max-k of all three, the coordinator's
# --max-new-tokens-limit): what a stack a command brings up itself takes.
DEFAULT_MAX_K = 16
DEFAULT_MAX_NEW_TOKENS_LIMIT = 4096
# Ports, and the service flags no deployment can use outside their range.
PORT = Range(int, 1, 65535)
SERVICE_PORT = Range(int, 0, 65535, note="0 = a free port, printed once serving")
METRICS_PORT = Range(int, 0, 65535, note="0 = off")
THREADS = Range(int, 0, note="0 = torch's choice")
PER_CALLER = Range(int, 0, note="0 = no limit")  # requests one caller may run at once
# --redis-wait-replicas / --redis-wait-ms (specdec.session: a write waits for its replicas).
WAIT_REPLICAS = Range(int, 0, note="0 = do not wait")
# The wait's bound stays below the 2 s Redis socket timeout (session.REDIS_SOCKET_TIMEOUT_S), so a
# missing replica is reported as such, not as a stuck Redis.
WAIT_MS = Range(int, 1, 1500)
DEFAULT_WAIT_MS = 500
# Seconds a session stays in Redis after its last write (`--session-ttl`, SPECDEC_SESSION_TTL: one
# setting read by the coordinator, which writes sessions, and the model services, which keep a
# finished session's cache for prefix reuse no longer than Redis keeps the session). Each commit
# renews it, so it must outlast the longest wait between two commits (a long prompt's prefill on a
# CPU takes minutes): at least a minute. Redis EXPIRE takes whole seconds.
DEFAULT_TTL_S = 3600
SESSION_TTL_S = Range(int, 60, 10**9)
# Seconds a stopping service lets running calls go on (serving.run's grace; `--drain-s`).
DRAIN_S = Range(float, 0)
DEFAULT_DRAIN_S = 5.0
# How long a starting coordinator waits for its model services to load (--startup-timeout).
DEFAULT_STARTUP_TIMEOUT_S = 600.0
# Seconds one chunk's write to a client may wait before the coordinator ends its stream
# (coordinator.server.StallWatch; `--stall-timeout`).
STALL_TIMEOUT_S = Range(float, 0, note="0 = never")
DEFAULT_STALL_TIMEOUT_S = 30.0
# Seconds between two resolutions of a dns:/// replica address (coordinator.replicas).
REPLICA_REFRESH_S = 10.0
# Sessions one forward pass of the target or the draft takes at most (specdec.batching; `--max-batch`).
DEFAULT_MAX_BATCH = 8
# Seconds one pass of a model service may run before its device is taken for hung (`--pass-timeout`,
# serving.ModelWorker): a prefill chunk of a 7B model in float32 takes about a minute on 2 CPU
# cores, a GPU's pass milliseconds.
DEFAULT_PASS_TIMEOUT_S = 300.0
PASS_TIMEOUT_S = Range(float, 0, note="0 = never")
SHARE = Range(float, 0, 1, below=True)  # a fraction that must leave something over


def text_problem(name: str, text: str) -> str | None:
    """None when `text` can travel as a protobuf string, which must be UTF-8, else what stops it:
    a lone surrogate, which is how Python holds a byte of a command-line argument, environment
    variable or file name that is not UTF-8 (0xE9, an é from a Latin-1 terminal, becomes U+DCE9)."""
    try:
        text.encode("utf-8")
        return None
    except UnicodeEncodeError as exc:
        code = ord(text[exc.start])
        if 0xDC80 <= code <= 0xDCFF:
            return (f"{name} is not UTF-8: byte {code - 0xDC00:#04x} at character {exc.start} (from a terminal, "
                    "file or variable in another encoding? specdec sends text as UTF-8)")  # fmt: skip
        return f"{name} holds a lone surrogate, U+{code:04X} at character {exc.start}, which UTF-8 cannot carry"


def undecodable(exc: UnicodeDecodeError) -> str:
    """'byte 0xe9 at offset 15': where a file read as UTF-8 is not, for the error that names it."""
    return f"byte {exc.object[exc.start]:#04x} at offset {exc.start}"


def utf8_text(text: str) -> str:
    """argparse type of a text argument (a prompt, a stop string): `text`, or ArgumentTypeError
    when it holds a byte that is not UTF-8, which the request could not carry."""
    if problem := text_problem("the text", text):
        raise argparse.ArgumentTypeError(problem)
    return text


# What --stop reads as an escape: a shell passes `--stop "\n"` as a backslash and an n.
STOP_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\"}


def stop_text(text: str) -> str:
    """argparse type of a stop string: utf8_text, with \\n, \\t, \\r and \\\\ read as a newline,
    a tab, a carriage return and one backslash (what a user typing `--stop "\\n\\n"` means, as
    llama.cpp reads its own strings); any other backslash stays as it is. An empty one, which
    every coordinator refuses, is refused here (a local stack used to start first)."""
    if not text:
        raise argparse.ArgumentTypeError("a stop string must not be empty")
    return re.sub(r"\\([ntr\\])", lambda escape: STOP_ESCAPES[escape.group(1)], utf8_text(text))


def sampling_problem(temperature: object, top_k: object, top_p: object, seed: object = None) -> str | None:
    """None when a request's sampling settings are all in range, else what the first one breaks
    (the services refuse the request with it as INVALID_ARGUMENT, the sampler raises ValueError)."""
    for name, value, allowed in (("temperature", temperature, TEMPERATURE), ("top_k", top_k, TOP_K), ("top_p", top_p, TOP_P)):
        if problem := allowed.problem(name, value):
            return problem
    return None if seed is None else SEED.problem("seed", seed)


# What a server address is, for the SDK, the command line's --address flags and the
# coordinator's --draft-address / --target-address: HOST:PORT ([::1]:PORT for IPv6), or a gRPC
# target: dns:///HOST:PORT, ipv4:HOST:PORT,HOST:PORT, ipv6:[IP]:PORT,..., unix:PATH and the like.
URL_SCHEMES = ("http", "https", "grpc", "grpcs", "tcp")
GRPC_SCHEMES = ("dns:", "ipv4:", "ipv6:", "unix:", "unix-abstract:", "vsock:", "xds:", "google-c2p:")


def address_problem(address: str) -> str | None:
    """None when `address` can name a gRPC server, else what is wrong with it: empty, a URL
    (gRPC would fail to resolve 'http://...'), or a port that is no port (gRPC takes 99999 as
    34463, another port, and ':7600/' fails as an unresolvable name). A HOST alone is left to
    gRPC, which means port 443 by it (TLS behind a load balancer)."""
    text = address.strip()
    if not text:
        return "the address is empty: give HOST:PORT, e.g. 127.0.0.1:50051"
    scheme, sep, rest = text.partition("://")
    if sep and scheme.lower() in URL_SCHEMES:
        return (f"{address!r} is a URL; give the address as HOST:PORT, e.g. {rest.split('/')[0] or '127.0.0.1:50051'!r} "
                "(gRPC speaks HTTP/2 itself; TLS is a flag of its own: --tls-ca, --internal-tls-ca, the SDK's "
                "tls_ca)")  # fmt: skip
    scheme = next((s for s in GRPC_SCHEMES if text.lower().startswith(s)), "")
    if not scheme and "," in text:  # gRPC: "Misformatted domain name"
        return (f"{address!r} names several addresses: give one HOST:PORT (a load balancer in front of "
                "several), or a gRPC target of several IPs: ipv4:IP:PORT,IP:PORT (or dns:///NAME:PORT)")
    if scheme not in ("", "dns:", "ipv4:", "ipv6:"):
        return None  # unix:PATH and the like: no port
    rest = text[len(scheme):].rpartition("/")[2] if scheme == "dns:" else text[len(scheme):]
    for piece in rest.split(","):
        host, sep, port = piece.strip().rpartition(":")
        bracketed = piece.strip().startswith("[") and piece.strip().endswith("]")  # [::1]: an IPv6 host alone
        if not sep or (":" in host and not host.startswith("[")) or bracketed:  # a HOST alone; an IPv6 address without a port
            continue
        if not (port.isdigit() and int(port) in PORT):
            where = f" in {address!r}" if piece.strip() != text else ""
            return f"{piece.strip()!r}{where} is not HOST:PORT: the port must be {PORT.describe()}"
    return None


def grpc_address(text: str) -> str:
    """argparse type of an --address flag: `text`, or ArgumentTypeError saying what is wrong (address_problem)."""
    if problem := address_problem(text):
        raise argparse.ArgumentTypeError(problem)
    return text.strip()


def device_problem(device: str) -> str | None:
    """None when `device` (lowercased, stripped) names a device specdec places models on, else
    what is wrong: cpu, cuda, cuda:N or auto."""
    if device in ("auto", "cpu", "cuda") or (device.startswith("cuda:") and device[5:].isdigit()):
        return None
    return f"unknown device {device!r}; use cpu, cuda, cuda:N or auto"


def device_name(text: str) -> str:
    """argparse type of --device (device_problem), checked before torch is imported."""
    if problem := device_problem(text.strip().lower()):
        raise argparse.ArgumentTypeError(problem)
    return text


def model_name(text: str) -> str:
    """argparse type of --model / --target: `text`, or ArgumentTypeError for an empty one, which
    named the current directory (a model there was served without a word)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("the model is empty: give a catalog name (`specdec models list`), a "
                                         "Hugging Face directory or a .gguf file")  # fmt: skip
    return text


def listen_host(text: str) -> str:
    """argparse type of --host, the address a service listens on: a host name or an IP address
    (`0.0.0.0` or `::` for every interface), or ArgumentTypeError for a URL or a HOST:PORT, which
    gRPC failed to bind with advice to change the port."""
    host = text.strip()
    if not host:
        raise argparse.ArgumentTypeError("the host is empty: 127.0.0.1 (this machine only) or 0.0.0.0 (every interface)")
    if "://" in host:
        raise argparse.ArgumentTypeError(f"{text!r} is a URL; give a host name or IP address, e.g. "
                                         f"{host.partition('://')[2].split('/')[0].rsplit(':', 1)[0]!r}")  # fmt: skip
    name, sep, port = host.rpartition(":")
    if sep and port.isdigit() and (":" not in name or name.startswith("[") and name.endswith("]")):  # not "::1"
        raise argparse.ArgumentTypeError(f"{text!r} holds a port; give the host alone ({name!r}) and the port with --port")
    return host


def join_host_port(host: str, port: int) -> str:
    """'127.0.0.1:50051', '[::]:50051': an IPv6 address is bracketed, or its colons would read as the port's."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def token_problem(token: str) -> str | None:
    """None when `token` can travel as a bearer token, in a gRPC header (printable ASCII, and no
    space: the `authorization: Bearer TOKEN` line), else where it breaks the rule; never the
    token or its characters, which are a secret. gRPC's own refusal was INTERNAL, "Invalid
    metadata", for every call."""
    bad = next((i for i, c in enumerate(token) if not "!" <= c <= "~"), None)
    if bad is None:
        return None
    return (f"the token's character {bad + 1} is a space, a control character or not ASCII; "
            "a token travels in a gRPC header, which carries printable ASCII only")
