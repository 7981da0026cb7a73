"""The `specdec` command line. Every flag can also be set with the environment
variable shown in its help ([env: SPECDEC_...])."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import difflib
import json
import logging
import os
import sys
from typing import NoReturn

from specdec import __version__
from specdec.ngram import DEFAULT_K, DEFAULT_MAX_NGRAM, DEFAULT_MIN_NGRAM, NGRAM_DRAFT
from specdec.ranges import (
    AT_LEAST_ONE, DEFAULT_DRAIN_S, DEFAULT_STARTUP_TIMEOUT_S, DEFAULT_MAX_BATCH, DEFAULT_MAX_K, DEFAULT_MAX_NEW_TOKENS_LIMIT, DEFAULT_RETRIES,
    DEFAULT_PASS_TIMEOUT_S, DEFAULT_STALL_TIMEOUT_S, DEFAULT_TTL_S, DEFAULT_WAIT_MS,
    DRAIN_S, MAX_NEW_TOKENS, METRICS_PORT, PASS_TIMEOUT_S, PER_CALLER, PORT, RETRIES, SECONDS, SEED, REPLICA_REFRESH_S,
    SERVICE_PORT, SESSION_TTL_S, STALL_TIMEOUT_S, TEMPERATURE, THREADS, TOP_K, TOP_P, UINT32, WAIT_MS, WAIT_REPLICAS,
    Range,
    device_name, grpc_address, listen_host, model_name, stop_text, undecodable, utf8_text,
)

DEFAULT_ADDRESS = "127.0.0.1:50051"
TRUE = {"1", "true", "yes", "on"}
FALSE = {"", "0", "false", "no", "off"}


def k_value(text: str) -> int | str:
    """A K on the command line: a positive integer or `adaptive`."""
    if text == "adaptive":
        return text
    try:
        k = int(text)
    except ValueError:
        k = 0
    if k < 1:
        raise argparse.ArgumentTypeError(f"K must be an integer of at least 1 or 'adaptive', got {text!r}")
    return k


NGRAM_FIRST_HELP = (
    "with a model draft: a cycle whose text ends in an n-gram of at least N tokens seen earlier in the "
    "context drafts the tokens that followed it, looked up in the coordinator (free, and right more often "
    "on text that repeats its input), instead of asking the draft model; 0 = off"
)
# The --draft flags of the commands that start a stack or run one (specdec.catalog.default_draft).
DEFAULT_DRAFT_HELP = ("default: the catalog draft distilled for the target if there is one, "
                      "smollm2-135m-instruct-draft for the default target; else ngram")


def ngram_first_value(text: str) -> int:
    """--ngram-first N: 0 (off) or the shortest n-gram match a lookup cycle needs (1..8)."""
    try:
        n = int(text)
    except ValueError:
        n = -1
    if not 0 <= n <= 8:
        raise argparse.ArgumentTypeError(f"--ngram-first takes 0 (off) or an n-gram length 1..8, got {text!r}")
    return n


def lookup_value(text: str) -> str:
    """--lookup: auto, off, or N:W,... (checked here, applied by the draft service)."""
    from specdec.ngram import resolve_lookup_weights

    try:
        resolve_lookup_weights(text, None)  # no model directory yet: this checks the spelling only
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{exc}; or auto, or off") from None
    return text


def replica_address(text: str) -> str:
    """--draft-address / --target-address: HOST:PORT, a comma-separated list of them, or
    dns:///HOST:PORT (checked here, used by coordinator.replicas)."""
    from coordinator.replicas import parse_replica_address

    try:
        parse_replica_address(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


SEVERAL_COORDINATORS = (
    "; or a gRPC target naming several coordinators (ipv4:10.0.0.5:50051,10.0.0.6:50051, or "
    "dns:///NAME:PORT), whose calls go to each in turn (round robin), a retry or resume to the next"
)
REPLICAS_HELP = (
    "; several replicas: a comma-separated list (HOST:PORT,HOST:PORT), or dns:///HOST:PORT for every "
    f"address the name resolves to (re-resolved every {REPLICA_REFRESH_S:g} s; a Kubernetes headless "
    "Service). Each session keeps to one replica, so its KV caches stay warm; sessions spread over the "
    "replicas; one that fails is skipped and its sessions move to the others (rebuilt from Redis)"
)


def add_stack_model_flags(p: argparse.ArgumentParser, of: str) -> None:
    """--target and --draft (SPECDEC_TARGET, SPECDEC_DRAFT): the models of the stack `of` names
    ("" for `up`'s own), read from the same variables by every command that starts a stack."""
    from specdec.catalog import DEFAULT_TARGET  # light: the launcher would import redis and gRPC's health

    env_flag(p, "--target", "SPECDEC_TARGET", default=DEFAULT_TARGET, type=model_name,
             help=f"target model{of}: catalog name, Hugging Face directory or .gguf file")  # fmt: skip
    env_flag(p, "--draft", "SPECDEC_DRAFT", default="",
             help=f"draft model{of} (as --target) or `ngram` for prompt lookup ({DEFAULT_DRAFT_HELP})")  # fmt: skip


def add_ngram_first_flag(p: argparse.ArgumentParser, scope: str = "") -> None:
    """--ngram-first N (SPECDEC_NGRAM_FIRST), for the coordinator, `up` and a local stack."""
    env_flag(p, "--ngram-first", "SPECDEC_NGRAM_FIRST", default=0, type=ngram_first_value, metavar="N",
             help=scope + NGRAM_FIRST_HELP)  # fmt: skip


class AppendOverDefault(argparse.Action):
    """A repeatable flag (--stop): each use adds its value, and the first replaces the default
    (from the environment) instead of adding to it, as a flag given overrides its variable."""

    def __call__(self, parser, namespace, values, option_string=None):
        given = getattr(namespace, self.dest)
        earlier = [] if given is None or given is self.default else given
        setattr(namespace, self.dest, [*earlier, values])


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def log_level(text: str) -> str:
    """argparse type of --log-level: one of LOG_LEVELS, in any case (`LOUD` used to end the
    service in logging's ValueError traceback)."""
    if text.strip().upper() not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(LOG_LEVELS)}, got {text!r}")
    return text.strip().upper()


def redis_url(text: str) -> str:
    """argparse type of --redis-url: the URL, or "" (none given); ArgumentTypeError naming the
    schemes for another (an http:// URL used to end the service in a traceback)."""
    from specdec.session import redis_url_problem

    if text and (problem := redis_url_problem(text)):
        raise argparse.ArgumentTypeError(problem)
    return text


def env_flag(
    parser: argparse.ArgumentParser, flag: str, env: str, *, default=None, type=str, help: str = "",
    secret: bool = False, **kw,
):  # fmt: skip
    """Add `flag`, whose default comes from `env` when that variable is set. The help of
    a `secret` flag (e.g. a URL that may hold a password) never shows the value. A value the
    flag refuses is an error of the command that takes the flag, once it runs (env_problems):
    it used to end every command, `specdec --help` included, in the words of whichever took
    the variable first (`SPECDEC_PORT=abc specdec models list`: "specdec up: error: ...");
    and not where the command line gives the flag, which overrides the variable. A variable
    set empty (`SPECDEC_TIMEOUT=`, as a compose file or a template may leave one) is unset."""
    raw = os.environ.get(env) or None
    if kw.get("action") == "store_true":
        word = (raw or "").strip().lower()
        off = opposite_switch(flag)
        if word not in TRUE | FALSE:  # "ture" or "enabled" would otherwise be a silent False
            env_problems(parser).append(((flag, off), f"{env}={raw!r} is not a valid value for {flag}: expected one of "
                                         "1, true, yes, on (set) or 0, false, no, off, empty (unset)"))  # fmt: skip
        value = word in TRUE
        parser.add_argument(flag, default=value, help=f"{help} [env: {env}; {off} overrides it]", **kw)
        parser.add_argument(off, dest=flag[2:].replace("-", "_"), action="store_false", help=argparse.SUPPRESS)
        return
    if raw is not None:
        try:
            default = type(raw)
        except (ValueError, argparse.ArgumentTypeError) as exc:
            shown = env if secret else f"{env}={raw!r}"  # a secret's value is never printed
            env_problems(parser).append(((flag,), f"{shown} is not a valid value for {flag}: {exc}"))
    if kw.get("action") == "append":  # repeatable: the variable holds one value, which the flag replaces
        kw["action"] = AppendOverDefault
        default = [default] if default else None
    suffix = f" (default: {default})" if default not in (None, "") and not secret else ""
    parser.add_argument(flag, default=default, type=type, help=f"{help}{suffix} [env: {env}]", **kw)


def opposite_switch(flag: str) -> str:
    """The flag that turns an env switch `flag` off for one command, where its variable turns
    it on (a stack's environment that sets SPECDEC_JSON, say): `--json` → `--no-json`,
    `--no-pipeline` → `--pipeline`."""
    return f"--{flag[5:]}" if flag.startswith("--no-") else f"--no-{flag[2:]}"


def env_problems(parser: argparse.ArgumentParser) -> list[tuple[tuple[str, ...], str]]:
    """The environment variables a (sub)command's flags refuse, reported when it runs (main)
    unless its command line gives one of the flags (the first item) the problem is of."""
    if not hasattr(parser, "specdec_env_problems"):
        parser.specdec_env_problems = []
    return parser.specdec_env_problems


# ---------------------------------------------------------------- parser


def command_word(argv: list[str]) -> str | None:
    """The command a command line names: its first word that is not an option (the global
    options before it, -v and --version, take no value), e.g. "distill" in `specdec -v distill`."""
    return next((word for word in argv if not word.startswith("-")), None)


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specdec",
        description="Distributed, lossless speculative decoding: a draft model proposes tokens, "
        "the target model verifies them in one pass, and the output is distributed exactly "
        "as the target's own.",
        epilog="Quick start: `specdec generate --chat \"Write a haiku about the sea.\"` brings a local stack up "
        "for the command and asks the built-in instruct model (without --chat the text is continued as it is). "
        "Run `specdec COMMAND --help` for each command's flags.",
    )
    parser.add_argument("--version", action="version", version=f"specdec {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="log at INFO level, and show all the output of the services of a local stack "
                        "that generate and trace bring up (else only their warnings and errors)")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    up = commands.add_parser(
        "up",
        help="run the whole stack on this machine",
        description="Start Redis (embedded unless --redis-url), the draft, target and coordinator services "
        "as separate processes on loopback; print `ready ADDRESS` once all report SERVING. "
        "Ctrl-C, SIGTERM or SIGHUP stops everything.",
    )
    add_stack_flags(up)

    serve = commands.add_parser("serve", help="run one service (for real deployments)",
                                description="Run one specdec service in the foreground.")  # fmt: skip
    services = serve.add_subparsers(dest="service", metavar="SERVICE", required=True)
    add_draft_flags(services.add_parser("draft", help="the draft service", description="Serve Draft.Propose."))
    add_target_flags(services.add_parser("target", help="the target service", description="Serve Target.Verify."))
    add_coordinator_flags(
        services.add_parser("coordinator", help="the public coordinator",
                            description="Serve Coordinator.Generate, Resume, Delete and Info.")  # fmt: skip
    )

    gen = commands.add_parser(
        "generate",
        help="generate text from a prompt",
        description="Stream generated text to the terminal, then print the cycle statistics. "
        "Without --address and with nothing serving on the default address, a local stack is "
        "brought up for the duration of the command (its services print only warnings and errors; "
        "`specdec -v generate ...` shows their logs).",
    )
    add_generate_flags(gen)

    trace = commands.add_parser(
        "trace",
        help="generate once and print a per-cycle timeline",
        description="Run one request and print, per cycle, K, drafted and accepted tokens, the draft "
        "and verify times as the coordinator measured them, and a bar of where the cycle's time went: "
        "what you would otherwise read off a trace viewer. Takes the flags of `generate`.",
    )
    add_generate_flags(trace)

    resume = add_session_parser(
        commands, "resume", "the session to go on with",
        help="go on with a session whose stream broke",
        description="Print the rest of a session from any coordinator on its Redis: what it committed after "
        "the tokens and characters you already have, then what it generates until it finishes (a finished "
        "session's text, without generating). The session id is in every chunk, in `generate --json` and "
        "`trace` output, or the one you chose. `generate` and the SDK resume a broken stream by themselves "
        "(--retries); this is for starting over from another process.",
    )  # fmt: skip
    resume.add_argument("--received-tokens", type=UINT32, default=0,
                        help="output tokens you already have: the token ids sent (--json's token_ids) start after "
                        "them (default 0: all)")  # fmt: skip
    resume.add_argument("--received-chars", type=UINT32, default=0,
                        help="characters of output text you already have: the text printed starts after them "
                        "(default 0: all)")  # fmt: skip
    env_flag(resume, "--json", "SPECDEC_JSON", action="store_true", help="print one JSON object instead of text")
    env_flag(resume, "--timeout", "SPECDEC_TIMEOUT", default=None, type=SECONDS, help="deadline of the call in seconds")

    add_session_parser(
        commands, "delete", "the session to delete",
        help="delete a session now instead of when it expires",
        description="Remove a session's record, prompt and tokens from Redis and its caches from the model "
        "services, through any coordinator on its Redis; a stream of it still running ends NOT_FOUND. Sessions "
        "otherwise expire the services' --session-ttl after their last use (an hour by default). Only the API "
        "token that created a session, or another "
        "token of its caller name, may delete it. Exit status 0 when it was deleted, 1 when there was no such "
        "session (expired, deleted already, or never created) or the call failed.",
    )  # fmt: skip

    from specdec.bench import add_bench_parser

    add_bench_parser(commands)
    from specdec.soak import add_soak_parser

    add_soak_parser(commands)
    if command_word(argv or []) == "distill":
        from specdec.distill import add_distill_parser  # imports torch: only when the command runs

        add_distill_parser(commands)
    else:
        commands.add_parser("distill", add_help=False,
                            help="make a fast draft model for a target by distillation (see `specdec distill --help`)")  # fmt: skip

    models = commands.add_parser("models", help="the built-in model catalog", description="The built-in model catalog.")
    model_commands = models.add_subparsers(dest="models_command", metavar="ACTION", required=True)
    model_commands.add_parser("list", help="list catalog models and whether they are cached")
    pull = model_commands.add_parser("pull", help="fetch and convert a catalog model into the cache")
    pull.add_argument("name", help="catalog name, e.g. smollm2-135m-instruct")
    return parser


def add_common_service_flags(p: argparse.ArgumentParser, prefix: str, port: int) -> None:
    env_flag(p, "--host", f"{prefix}_HOST", default="127.0.0.1", type=listen_host,
             help="address to listen on (0.0.0.0: every interface)")
    env_flag(p, "--port", f"{prefix}_PORT", default=port, type=SERVICE_PORT, help="port to listen on")
    env_flag(p, "--redis-url", "SPECDEC_REDIS_URL", default="", type=redis_url, secret=True,
             help="Redis URL for sessions: redis://[:PASSWORD@]HOST:PORT/DB, or rediss://...?ssl_ca_certs=CA.pem "
                  "for TLS, or redis+cluster://HOST:PORT (rediss+cluster://) naming any node of a Redis Cluster; "
                  "prefer the environment variable, since a password on the command line is visible "
                  "to every user of the machine")  # fmt: skip
    add_session_ttl_flag(p)
    env_flag(p, "--log-level", f"{prefix}_LOG_LEVEL", default="INFO", type=log_level,
             help=f"logging level: {', '.join(LOG_LEVELS)}")  # fmt: skip
    env_flag(p, "--metrics-port", f"{prefix}_METRICS_PORT", default=0, type=METRICS_PORT,
             help="serve Prometheus /metrics on this port (0 = off)")  # fmt: skip
    add_tls_server_flags(p, prefix)


def add_session_ttl_flag(p: argparse.ArgumentParser) -> None:
    env_flag(p, "--session-ttl", "SPECDEC_SESSION_TTL", default=DEFAULT_TTL_S, type=SESSION_TTL_S, metavar="SECONDS",
             help="seconds a session stays in Redis after its last use (its prompt and tokens; Resume and "
                  "Delete find it until then), and at most how long a model service keeps a finished "
                  "session's cache for prefix reuse; each commit renews it, so keep it above the longest "
                  "prefill of a prompt; give every service the same value (the environment variable does)")  # fmt: skip


def add_tls_server_flags(p: argparse.ArgumentParser, prefix: str) -> None:
    env_flag(p, "--tls-cert", f"{prefix}_TLS_CERT", default="", help="PEM certificate (chain) to serve TLS with")
    env_flag(p, "--tls-key", f"{prefix}_TLS_KEY", default="", help="PEM private key of --tls-cert")
    env_flag(p, "--tls-client-ca", f"{prefix}_TLS_CLIENT_CA", default="",
             help="PEM CA bundle: require client certificates it signed (mutual TLS)")  # fmt: skip


def add_model_flags(p: argparse.ArgumentParser, prefix: str, model: str) -> None:
    env_flag(p, "--model", f"{prefix}_MODEL", default=model, type=model_name,
             help="catalog name, Hugging Face directory or .gguf file")  # fmt: skip
    env_flag(p, "--dtype", f"{prefix}_DTYPE", default="float32", choices=["float32", "float16", "bfloat16", "auto"],
             help="weights and compute dtype")
    env_flag(p, "--device", f"{prefix}_DEVICE", default="cpu", type=device_name, help="cpu, cuda, cuda:N or auto")
    env_flag(p, "--threads", f"{prefix}_THREADS", default=0, type=THREADS, help="torch CPU threads (0 = torch's choice)")
    env_flag(p, "--max-k", f"{prefix}_MAX_K", default=DEFAULT_MAX_K, type=AT_LEAST_ONE, help="largest K accepted per request")
    env_flag(p, "--max-sessions", f"{prefix}_MAX_SESSIONS", default=256, type=AT_LEAST_ONE,
             help="sessions whose KV cache is kept; least recently used evicted beyond")  # fmt: skip
    env_flag(p, "--max-cache-mb", f"{prefix}_MAX_CACHE_MB", default=4096.0, type=Range(float, 0, note="0 = no limit"),
             help="memory the sessions' KV caches may hold, in MiB; least recently used evicted beyond "
                  "(never a running cycle's); 0 = no limit")  # fmt: skip
    env_flag(p, "--internal-token-file", "SPECDEC_INTERNAL_TOKEN_FILE", default="",
             help="file with the internal token(s) the coordinator must send, re-read when it changes "
                  "(or set SPECDEC_INTERNAL_TOKEN)")  # fmt: skip
    env_flag(p, "--max-batch", f"{prefix}_MAX_BATCH", default=DEFAULT_MAX_BATCH, type=AT_LEAST_ONE,
             help="sessions one forward pass takes at most: the target's Verify calls, or a model draft's "
                  "drafting steps, that wait while a pass runs share the next one, which reads the weights "
                  "once for all of them (1 = one session a pass)")  # fmt: skip
    env_flag(p, "--pass-timeout", f"{prefix}_PASS_TIMEOUT", default=DEFAULT_PASS_TIMEOUT_S, type=PASS_TIMEOUT_S,
             help="seconds one forward pass may run per 256 tokens it feeds (a prefill chunk; a decoding step "
                  "counts as one) before the service takes its device for hung: until that pass ends it refuses "
                  "every call UNAVAILABLE, so the coordinator asks another replica, and its gRPC health says "
                  "NOT_SERVING, so Kubernetes takes it out of its Service and restarts it (0 = never)")  # fmt: skip
    env_flag(p, "--no-prefix-reuse", f"{prefix}_NO_PREFIX_REUSE", action="store_true",
             help="feed every new session's whole prompt to the model, instead of copying the beginning it "
                  "shares with an idle or finished session's context (a chat's earlier turns, a common system "
                  "prompt) from that session's KV cache, and keep no finished session's cache; reuse makes such "
                  "a prompt's first token sooner, and so tells a caller, by timing, that another session began "
                  "alike")  # fmt: skip
    env_flag(p, "--allow-unauthenticated", "SPECDEC_ALLOW_UNAUTHENTICATED", action="store_true",
             help="serve without mutual TLS and without an internal token (development only)")  # fmt: skip


def add_draft_flags(p: argparse.ArgumentParser) -> None:
    add_common_service_flags(p, "SPECDEC_DRAFT", 50052)
    add_model_flags(p, "SPECDEC_DRAFT", "ngram")
    env_flag(p, "--max-ngram", "SPECDEC_DRAFT_MAX_NGRAM", default=DEFAULT_MAX_NGRAM, type=AT_LEAST_ONE, help="longest n-gram to look up (ngram)")
    env_flag(p, "--min-ngram", "SPECDEC_DRAFT_MIN_NGRAM", default=DEFAULT_MIN_NGRAM, type=AT_LEAST_ONE, help="shortest n-gram to look up (ngram)")
    env_flag(p, "--lookup", "SPECDEC_DRAFT_LOOKUP", default="auto", type=lookup_value, metavar="auto|off|N:W,...",
             help="a model draft's lookup weights: each token is drawn from (1 - W)*q + W*(the prompt lookup's "
                  "token) when the context's longest earlier n-gram match has length N. auto: those the draft's "
                  "directory holds (specdec-lookup.json, written by `specdec distill`), none without one; "
                  "off: the model's q alone; e.g. 2:0.25,3:0.4,4:0.9")  # fmt: skip


def add_target_flags(p: argparse.ArgumentParser) -> None:
    add_common_service_flags(p, "SPECDEC_TARGET", 50053)
    add_model_flags(p, "SPECDEC_TARGET", "smollm2-135m-instruct")
    env_flag(p, "--solo-threads", "SPECDEC_TARGET_SOLO_THREADS", default=0, type=Range(int, 0),
             help="torch threads for a Verify while the draft is idle (drafts in hand, or none), when a "
                  "draft shares the machine; --threads is for one while it drafts beside it (0 = --threads)")  # fmt: skip


def add_coordinator_flags(p: argparse.ArgumentParser) -> None:
    add_common_service_flags(p, "SPECDEC_COORDINATOR", 50051)
    env_flag(p, "--draft-address", "SPECDEC_DRAFT_ADDRESS", default="127.0.0.1:50052", type=replica_address,
             help="draft service address" + REPLICAS_HELP)  # fmt: skip
    env_flag(p, "--target-address", "SPECDEC_TARGET_ADDRESS", default="127.0.0.1:50053", type=replica_address,
             help="target service address (the same forms)")  # fmt: skip
    env_flag(p, "--tokenizer", "SPECDEC_TOKENIZER", default="", help="tokenizer to use (default: the target's model)")
    env_flag(p, "--default-k", "SPECDEC_DEFAULT_K", type=AT_LEAST_ONE, metavar="K",
             help="K when a request sets none (default: the K the draft service reports for its draft, "
                  f"e.g. 2 for smollm2-135m-instruct-draft, or the serving_k on the card of a distilled draft's "
                  f"directory; else {DEFAULT_K})")  # fmt: skip
    env_flag(p, "--max-k", "SPECDEC_COORDINATOR_MAX_K", default=DEFAULT_MAX_K, type=AT_LEAST_ONE,
             help="largest K a request may ask for")  # fmt: skip
    env_flag(p, "--default-max-new-tokens", "SPECDEC_DEFAULT_MAX_NEW_TOKENS", default=128, type=AT_LEAST_ONE,
             help="max_new_tokens when a request sets none (at most --max-new-tokens-limit)")  # fmt: skip
    env_flag(p, "--max-new-tokens-limit", "SPECDEC_MAX_NEW_TOKENS_LIMIT", default=DEFAULT_MAX_NEW_TOKENS_LIMIT, type=AT_LEAST_ONE,
             help="largest max_new_tokens a request may ask for")  # fmt: skip
    env_flag(p, "--adaptive-k", "SPECDEC_ADAPTIVE_K", action="store_true",
             help="requests that set no K get K chosen per cycle (up to --max-k) instead of --default-k")  # fmt: skip
    env_flag(p, "--no-pipeline", "SPECDEC_NO_PIPELINE", action="store_true",
             help="do not draft the next cycle while the target verifies (requests may still ask for it)")  # fmt: skip
    env_flag(p, "--pipeline-min-keep", "SPECDEC_PIPELINE_MIN_KEEP", default=0.5, type=Range(float, 0, 1),
             help="for requests that do not ask for pipelining: pipeline a cycle only when the session's "
                  "estimate of the chance its early drafting is kept (all K drafts and the guess accepted: a^(K+1), "
                  "or adaptive K's per-position estimate) is >= this "
                  "(0 = every cycle, for a draft and a target on separate devices)")  # fmt: skip
    env_flag(p, "--max-prompt-tokens", "SPECDEC_MAX_PROMPT_TOKENS", default=8192, type=AT_LEAST_ONE,
             help="longest prompt accepted, in tokens")  # fmt: skip
    env_flag(p, "--max-concurrent-requests", "SPECDEC_MAX_CONCURRENT_REQUESTS", default=64, type=AT_LEAST_ONE,
             help="Generate calls served at once; more are refused with RESOURCE_EXHAUSTED")  # fmt: skip
    env_flag(p, "--max-requests-per-caller", "SPECDEC_MAX_REQUESTS_PER_CALLER", default=0, type=PER_CALLER,
             help="at most this many requests of one caller (an API token, or one caller NAME of the "
                  "token file) at once, counted over every coordinator of this Redis, so one client cannot "
                  "take every slot; 0 = no such limit (without API tokens every client is one caller: only "
                  "--max-concurrent-requests applies)")  # fmt: skip
    env_flag(p, "--redis-wait-replicas", "SPECDEC_REDIS_WAIT_REPLICAS", default=0, type=WAIT_REPLICAS, metavar="N",
             help="hold each write a client relies on (a session's creation, each cycle's tokens, a resume, a delete) "
                  "until N replicas of its Redis node have it (Redis WAIT), so a failover cannot lose tokens a client "
                  "was sent or bring back a deleted session; a write not held by N within --redis-wait-ms ends its "
                  "request UNAVAILABLE before its tokens go out (the SDK resumes it; a delete is to be sent again); "
                  "0 = do not wait (Redis replicates asynchronously)")  # fmt: skip
    env_flag(p, "--redis-wait-ms", "SPECDEC_REDIS_WAIT_MS", default=DEFAULT_WAIT_MS, type=WAIT_MS,
             metavar="MS", help="how long a write waits for its --redis-wait-replicas replicas")  # fmt: skip
    env_flag(p, "--auth-token-file", "SPECDEC_AUTH_TOKEN_FILE", default="",
             help="file of API tokens clients must send as `authorization: Bearer TOKEN`, a line each: TOKEN, or "
                  "NAME TOKEN, whose sessions belong to the caller NAME (any token of it resumes them: rotate "
                  "tokens under one name); re-read when it changes; SPECDEC_AUTH_TOKEN adds entries "
                  "(comma-separated); none = no token check")  # fmt: skip
    env_flag(p, "--internal-tls-ca", "SPECDEC_INTERNAL_TLS_CA", default="",
             help="PEM CA that signed the draft and target certificates: talk TLS to them")  # fmt: skip
    env_flag(p, "--internal-tls-cert", "SPECDEC_INTERNAL_TLS_CERT", default="",
             help="PEM client certificate to present to the draft and target (mutual TLS)")  # fmt: skip
    env_flag(p, "--internal-tls-key", "SPECDEC_INTERNAL_TLS_KEY", default="", help="PEM key of --internal-tls-cert")
    env_flag(p, "--internal-token-file", "SPECDEC_INTERNAL_TOKEN_FILE", default="",
             help="file with the internal token to send to the draft and target, its first line if it lists "
                  "several; re-read when it changes, so a rotation needs no restart (or set SPECDEC_INTERNAL_TOKEN)")  # fmt: skip
    env_flag(p, "--ngram-via-draft-service", "SPECDEC_NGRAM_VIA_DRAFT_SERVICE", action="store_true",
             help="with an n-gram draft, ask the draft service for each cycle's drafts; by default the "
                  "coordinator runs the same lookup itself (the same tokens, without a network hop)")  # fmt: skip
    add_ngram_first_flag(p)
    env_flag(p, "--draft-timeout", "SPECDEC_DRAFT_TIMEOUT", default=2.0, type=Range(float, 0, note="0 = only the deadline"),
             help="seconds a cycle waits for the draft before running target-only (also at most a quarter "
                  "of a request's remaining deadline; 0 = only the deadline)")  # fmt: skip
    env_flag(p, "--startup-timeout", "SPECDEC_STARTUP_TIMEOUT", default=DEFAULT_STARTUP_TIMEOUT_S, type=SECONDS,
             metavar="SECONDS",
             help="seconds to wait at start for the draft and target services to load their models before "
                  "giving up (in Kubernetes, at least the startup probe's failureThreshold x periodSeconds)")  # fmt: skip
    env_flag(p, "--drain-s", "SPECDEC_DRAIN_S", default=DEFAULT_DRAIN_S, type=DRAIN_S,
             help="on SIGTERM, seconds running requests may go on before they are cancelled (UNAVAILABLE; "
                  "the SDK resumes them through another coordinator); keep it below the pod's "
                  "terminationGracePeriodSeconds minus its preStop wait")  # fmt: skip
    env_flag(p, "--stall-timeout", "SPECDEC_STALL_TIMEOUT", default=DEFAULT_STALL_TIMEOUT_S, type=STALL_TIMEOUT_S,
             help="seconds a chunk may wait for a client that reads nothing of its stream before the stream "
                  "ends UNAVAILABLE, freeing its place (the SDK resumes it once it reads again; 0 = never)")  # fmt: skip


def add_stack_flags(p: argparse.ArgumentParser) -> None:
    env_flag(p, "--port", "SPECDEC_PORT", default=50051, type=PORT, help="port of the public coordinator")
    env_flag(p, "--host", "SPECDEC_HOST", default="127.0.0.1", type=listen_host,
             help="address the coordinator listens on (0.0.0.0: every interface)")
    add_stack_model_flags(p, "")
    add_ngram_first_flag(p)
    env_flag(p, "--redis-url", "SPECDEC_REDIS_URL", default="", type=redis_url, secret=True,
             help="Redis URL; empty starts an embedded redis-server on a private port")  # fmt: skip
    add_session_ttl_flag(p)
    env_flag(p, "--tls-cert", "SPECDEC_TLS_CERT", default="",
             help="PEM certificate for every service (valid for the addresses used, with server and client use): "
                  "TLS on every hop, mutual TLS between the services")  # fmt: skip
    env_flag(p, "--tls-key", "SPECDEC_TLS_KEY", default="", help="PEM private key of --tls-cert")
    env_flag(p, "--tls-ca", "SPECDEC_TLS_CA", default="", help="PEM CA that signed --tls-cert")
    env_flag(p, "--auth-token-file", "SPECDEC_AUTH_TOKEN_FILE", default="",
             help="file of API tokens clients must send, a line each: TOKEN, or NAME TOKEN (a caller whose "
                  "tokens share its sessions); none = no token check")  # fmt: skip
    env_flag(p, "--metrics-port-base", "SPECDEC_METRICS_PORT_BASE", default=9400, type=Range(int, 0, 65533, note="0 = off"),
             help="Prometheus /metrics of coordinator, draft, target on this port and the next two (0 = off)")  # fmt: skip


def add_generate_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", type=utf8_text,
                   help="the text to continue (with --chat: the question to answer); - reads it from stdin, "
                        "e.g. `specdec generate --chat - < question.txt` (one trailing newline dropped)")  # fmt: skip
    env_flag(p, "--chat", "SPECDEC_CHAT", action="store_true",
             help="send the prompt as a user message, which the server renders with the target's chat template "
                  "(what an instruct model such as SmolLM2-Instruct expects); without it the text is continued "
                  "as it is")  # fmt: skip
    env_flag(p, "--system", "SPECDEC_SYSTEM", default="", type=utf8_text,
             help="a system message before the prompt (implies --chat); without it the template's own default, if any")  # fmt: skip
    env_flag(p, "--address", "SPECDEC_ADDRESS", default=None, type=grpc_address,
             help=f"coordinator address (default {DEFAULT_ADDRESS}; started locally when nothing serves there)"
                  + SEVERAL_COORDINATORS)  # fmt: skip
    env_flag(p, "--max-new-tokens", "SPECDEC_MAX_NEW_TOKENS", default=None, type=MAX_NEW_TOKENS,
             help="tokens to generate at most (default: the coordinator's own, its --default-max-new-tokens, "
                  "128 unless set)")  # fmt: skip
    env_flag(p, "--temperature", "SPECDEC_TEMPERATURE", default=0.0, type=TEMPERATURE, help="0 = greedy")
    env_flag(p, "--top-k", "SPECDEC_TOP_K", default=0, type=TOP_K, help="keep the k most likely tokens (0 = off)")
    env_flag(p, "--top-p", "SPECDEC_TOP_P", default=1.0, type=TOP_P, help="nucleus mass to keep (1.0 = off)")
    env_flag(p, "--seed", "SPECDEC_SEED", default=None, type=SEED, help="seed for reproducible sampling")
    env_flag(p, "--k", "SPECDEC_K", default=None, type=k_value,
             help="K, tokens drafted per cycle, or `adaptive` (server default when unset)")  # fmt: skip
    env_flag(p, "--stop", "SPECDEC_STOP", default=None, type=stop_text, action="append",
             help="stop string (repeatable; the variable holds one); \\n, \\t, \\r and \\\\ in it are a newline, "
                  "a tab, a carriage return and a backslash, e.g. --stop '\\n\\n'")  # fmt: skip
    env_flag(p, "--no-speculate", "SPECDEC_NO_SPECULATE", action="store_true", help="plain target decoding")
    env_flag(p, "--pipeline", "SPECDEC_PIPELINE", default=None, choices=["on", "off"],
             help="draft the next cycle during verification (default: the server's setting)")  # fmt: skip
    env_flag(p, "--json", "SPECDEC_JSON", action="store_true", help="print one JSON object instead of text")
    env_flag(p, "--timeout", "SPECDEC_TIMEOUT", default=None, type=SECONDS, help="deadline of the call in seconds")
    env_flag(p, "--retries", "SPECDEC_RETRIES", default=DEFAULT_RETRIES, type=RETRIES,
             help="times the call is sent again when it fails UNAVAILABLE before any answer (a coordinator "
                  "restarting, or its Redis or model services unreachable as the request starts), and times "
                  "a stream that breaks UNAVAILABLE once begun is resumed where it broke (Resume: any "
                  "coordinator on the session's Redis goes on with it), each after a random wait of up to "
                  "0.2 s, doubling (0 = never)")  # fmt: skip
    add_stack_model_flags(p, " of a local stack")
    add_ngram_first_flag(p, "for a local stack: ")
    add_client_security_flags(p)


def add_client_security_flags(p: argparse.ArgumentParser) -> None:
    env_flag(p, "--tls-ca", "SPECDEC_TLS_CA", default="", help="PEM CA of the coordinator's certificate: connect with TLS")
    env_flag(p, "--token-file", "SPECDEC_TOKEN_FILE", default="",
             help="file holding the API token to send (or set SPECDEC_TOKEN)")  # fmt: skip


def client_options(args) -> dict:
    """Client(...) keyword arguments from the client security flags; a token or CA file that
    cannot be read ends the command here (call it before a local stack starts)."""
    import grpc

    from specdec.security import CLIENT_TOKEN_ENV, load_tokens, read_pem

    try:
        tokens = load_tokens(args.token_file, CLIENT_TOKEN_ENV)
        credentials = grpc.ssl_channel_credentials(read_pem(args.tls_ca, "CA file (--tls-ca)")) if args.tls_ca else None
    except SystemExit as exc:  # in the command's name, as its other errors are
        raise SystemExit(f"specdec {args.command}: {exc}") from None
    return {"credentials": credentials, "token": tokens[0] if tokens else None}


# ---------------------------------------------------------------- commands


def set_threads(threads: int) -> None:
    if threads > 0:
        import torch

        torch.set_num_threads(threads)
        torch.set_num_interop_threads(1)


def server_security(args, token_file: str, token_env: str):
    """The server's TLS files and the tokens it accepts, from `token_file` (re-read when it
    changes) and the environment variable `token_env`."""
    from specdec.security import ServerSecurity

    return ServerSecurity.from_token_file(args.tls_cert, args.tls_key, args.tls_client_ca, token_file, token_env)


def refuse_missing_model(service: str, model: str) -> None:
    """Exit at once with the line a failed load would print seconds later (after importing
    torch and transformers) when --model names no file, folder or catalog model."""
    from specdec.catalog import ModelNotFoundError, check_model, check_weights
    from specdec.serving import load_failed

    if service == "draft" and model == NGRAM_DRAFT:
        return
    try:
        if (found := check_model(model)) is not None and found[1] is None:
            check_weights(found[0])
    except ModelNotFoundError as exc:
        raise SystemExit(load_failed(service, exc)) from None


def run_serve(args) -> NoReturn:
    from specdec.security import AUTH_TOKEN_ENV, INTERNAL_TOKEN_ENV, ChannelSecurity, require_caller_credential

    logging.basicConfig(level=args.log_level, format=f"%(asctime)s {args.service} %(levelname)s %(message)s")
    if not args.redis_url:
        raise SystemExit("--redis-url (or SPECDEC_REDIS_URL) is required: sessions live in Redis")
    if args.service == "coordinator":
        from coordinator.server import CoordinatorConfig, serve

        config = CoordinatorConfig(
            host=args.host, port=args.port, draft_address=args.draft_address, target_address=args.target_address,
            redis_url=args.redis_url, tokenizer=args.tokenizer, default_k=args.default_k, max_k=args.max_k,
            default_max_new_tokens=args.default_max_new_tokens, max_new_tokens_limit=args.max_new_tokens_limit,
            metrics_port=args.metrics_port, pipeline=not args.no_pipeline, adaptive_k=args.adaptive_k,
            pipeline_min_keep=args.pipeline_min_keep, draft_timeout_s=args.draft_timeout, drain_s=args.drain_s,
            startup_timeout_s=args.startup_timeout,
            stall_timeout_s=args.stall_timeout,
            ngram_via_draft_service=args.ngram_via_draft_service, ngram_first=args.ngram_first,
            max_prompt_tokens=args.max_prompt_tokens, max_concurrent_requests=args.max_concurrent_requests,
            max_requests_per_caller=args.max_requests_per_caller, redis_wait_replicas=args.redis_wait_replicas,
            redis_wait_ms=args.redis_wait_ms, session_ttl_s=args.session_ttl,
            security=server_security(args, args.auth_token_file, AUTH_TOKEN_ENV),
            internal=ChannelSecurity.from_token_file(args.internal_tls_ca, args.internal_tls_cert, args.internal_tls_key,
                                                     args.internal_token_file, INTERNAL_TOKEN_ENV),
        )  # fmt: skip
    else:  # draft or target: --model, credentials and TLS files checked before torch is imported
        refuse_missing_model(args.service, args.model)
        if args.service == "draft" and args.min_ngram > args.max_ngram:  # the draft said so after loading torch
            raise SystemExit(f"specdec serve draft: --min-ngram {args.min_ngram} is above --max-ngram {args.max_ngram}")
        security = server_security(args, args.internal_token_file, INTERNAL_TOKEN_ENV)
        require_caller_credential(security, args.allow_unauthenticated, args.service)
        security.credentials()  # a TLS flag missing its partner, or an unreadable PEM file, exits here
        set_threads(args.threads)
        shared = dict(
            model=args.model, redis_url=args.redis_url, host=args.host, port=args.port, max_k=args.max_k,
            max_sessions=args.max_sessions, dtype=args.dtype, device=args.device, metrics_port=args.metrics_port,
            max_cache_mb=args.max_cache_mb, allow_unauthenticated=args.allow_unauthenticated, security=security,
            max_batch=args.max_batch, prefix_reuse=not args.no_prefix_reuse, pass_timeout_s=args.pass_timeout,
            session_ttl_s=args.session_ttl,
        )  # fmt: skip
        if args.service == "draft":
            from draft_service.server import DraftConfig, serve

            config = DraftConfig(**shared, max_ngram=args.max_ngram, min_ngram=args.min_ngram, lookup=args.lookup)
        else:
            from target_service.server import TargetConfig, serve

            config = TargetConfig(**shared, threads=args.threads, solo_threads=args.solo_threads)
    asyncio.run(serve(config))
    exit_without_teardown(0)


def exit_without_teardown(code: int) -> NoReturn:
    """End a service that has shut down cleanly (server stopped, sessions and Redis closed,
    traces flushed) without the interpreter's teardown: its garbage collection of torch's
    bindings took 1.2-1.7 s per model service here, on every stop and every restart."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_up(args) -> int:
    import time

    from specdec.launcher import Stack, StackConfig, StackTLS

    tls_files = (args.tls_cert, args.tls_key, args.tls_ca)
    if any(tls_files) and not all(tls_files):
        # SPECDEC_TLS_CA is also the clients' CA (generate, resume, soak): set for them, it asked this for TLS
        given = [f"{flag} (from {env})" if os.environ.get(env) else flag for flag, env, value in (
            ("--tls-cert", "SPECDEC_TLS_CERT", args.tls_cert), ("--tls-key", "SPECDEC_TLS_KEY", args.tls_key),
            ("--tls-ca", "SPECDEC_TLS_CA", args.tls_ca)) if value]  # fmt: skip
        raise SystemExit(f"specdec up: TLS needs all of --tls-cert, --tls-key and --tls-ca; given only {', '.join(given)}")
    config = StackConfig(
        port=args.port, host=args.host, target=args.target, draft=args.draft, redis_url=args.redis_url,
        metrics_port_base=args.metrics_port_base, tls=StackTLS(*tls_files) if all(tls_files) else None,
        auth_token_file=args.auth_token_file,
        ngram_first=args.ngram_first, env={"SPECDEC_SESSION_TTL": str(args.session_ttl)},
    )  # fmt: skip
    print(f"starting: target {config.target}, draft {config.draft}", file=sys.stderr, flush=True)
    with Stack(config) as stack:
        # Until Ctrl-C, SIGTERM or SIGHUP, each a KeyboardInterrupt here (Stack.forward_ending_signals),
        # one that lands as `ready` is printed included. Short sleeps: a signal the kernel hands to
        # one of gRPC's threads interrupts no sleep of this one, and Python runs its handler only
        # once this thread runs again (a long sleep, or a wait on an Event that a handler sets,
        # missed or deadlocked on one).
        try:
            for name, url in stack.metrics_urls.items():
                print(f"metrics: {name} {url}", file=sys.stderr, flush=True)
            print(f"ready {stack.address}", flush=True)
            while (ended := stack.exited()) is None:
                time.sleep(0.2)
            # A service killed (out of memory, a crash): `up` went on as if serving, every request failing.
            print(f"specdec up: {ended} (its output is above); stopping the stack", file=sys.stderr, flush=True)
            status = 1
        except KeyboardInterrupt:
            status = 0
        print("stopping", file=sys.stderr, flush=True)
    return status


@contextlib.contextmanager
def serving_address(args):
    """The coordinator address to use; brings a local stack up when none was given and none
    serves. Its services print only their warnings and errors, unless -v."""
    from specdec.launcher import Stack, StackConfig, is_listening, is_serving
    from specdec.redis_server import free_port

    address = args.address or DEFAULT_ADDRESS
    if args.address is not None or args.tls_ca or is_serving(address):
        yield address
        return
    refuse_past_stack_limits(args.command, "a local stack", {"--k": args.k}, args.max_new_tokens,
                             ": give --address of a stack whose services take a larger --max-k, or a smaller --k")  # fmt: skip
    host, port = address.rsplit(":", 1)
    if is_listening(host, int(port)):  # likely a `specdec up` still loading, meant for this command: say so
        raise SystemExit(f"specdec {args.command}: something listens on {address} but is not a serving specdec "
                         f"coordinator: a stack still starting (wait for its `ready` line), or another program; "
                         f"else start one elsewhere (`specdec up --port 50052`) and pass --address 127.0.0.1:50052")  # fmt: skip
    # The stack is this command's alone: its coordinator takes a free port, not the default
    # one, so that commands run side by side (`xargs -P`) each start theirs instead of racing.
    config = StackConfig(port=free_port(), host="127.0.0.1", target=args.target, draft=args.draft,
                         ngram_first=args.ngram_first)  # fmt: skip
    print(f"nothing serves on {address}: starting a local stack (target {config.target}, draft {config.draft}) "
          "for this command", file=sys.stderr, flush=True)  # fmt: skip
    with Stack(config, terse=not args.verbose) as stack:
        yield stack.address


def refuse_past_stack_limits(command: str, stack: str, ks: dict[str, object], max_new_tokens: int | None,
                             advice: str = "") -> None:  # fmt: skip
    """End `command`, before a stack it starts itself loads anything, on a K (flag -> value) or a
    max_new_tokens its services refuse at their default limits (`stack` names it in the
    message): generate and bench used to start the whole stack, models and all, and then fail."""
    for flag, k in ks.items():
        if isinstance(k, int) and k > DEFAULT_MAX_K:
            raise SystemExit(f"specdec {command}: {flag} {k} is more than {stack} takes (at most {DEFAULT_MAX_K}, the "
                             f"services' --max-k){advice}")  # fmt: skip
    if max_new_tokens is not None and max_new_tokens > DEFAULT_MAX_NEW_TOKENS_LIMIT:
        raise SystemExit(f"specdec {command}: --max-new-tokens {max_new_tokens} is more than {stack} allows (at most "
                         f"{DEFAULT_MAX_NEW_TOKENS_LIMIT}, the coordinator's --max-new-tokens-limit)")  # fmt: skip


def prompt_arguments(args) -> dict:
    """The prompt as the request carries it: text as it is, or with --chat (or --system) one
    user message, after the system message if any, that the coordinator renders with the
    target's chat template. A prompt of `-` is read from stdin (read_stdin_prompt)."""
    if args.prompt == "-":
        args.prompt = read_stdin_prompt(args.command)
    if args.chat or args.system:
        system = [{"role": "system", "content": args.system}] if args.system else []
        return {"messages": [*system, {"role": "user", "content": args.prompt}]}
    if not args.prompt:  # refused by every coordinator: say so before a local stack starts
        raise SystemExit(f"specdec {args.command}: the prompt is empty: give the text to continue, or a question "
                         "with --chat")  # fmt: skip
    return {"prompt": args.prompt}


def read_stdin_prompt(command: str) -> str:
    """The prompt piped in (`specdec generate - < notes.txt`), read as UTF-8, without the one
    trailing newline that `echo` and editors add (the model would continue after it)."""
    if sys.stdin.isatty():
        print("reading the prompt from stdin: type it, then Ctrl-D on a line of its own", file=sys.stderr, flush=True)
    try:
        text = sys.stdin.buffer.read().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SystemExit(f"specdec {command}: the prompt on stdin is not UTF-8: {undecodable(exc)}") from None
    return text.removesuffix("\n").removesuffix("\r")


def add_session_parser(commands, name: str, session_help: str, **texts) -> argparse.ArgumentParser:
    """A subcommand on one session (`texts`: its help and description): the session id, the
    coordinator's address and the client's TLS and token flags."""
    parser = commands.add_parser(name, **texts)
    parser.add_argument("session_id", type=utf8_text, help=session_help)
    env_flag(parser, "--address", "SPECDEC_ADDRESS", default=DEFAULT_ADDRESS, type=grpc_address,
             help="coordinator address" + SEVERAL_COORDINATORS)  # fmt: skip
    add_client_security_flags(parser)
    return parser


def client_error(exc, args) -> str:
    """The line a failed call prints. UNAVAILABLE of a call that reached no coordinator says
    where it looked and how to start a stack, and of a TLS handshake that failed, what to check;
    one the coordinator answered (its Redis down, say) says what the coordinator said, and no
    more: the hint "is a coordinator serving?" came with every UNAVAILABLE."""
    import grpc

    line = f"error: {exc}"
    if exc.code == grpc.StatusCode.DEADLINE_EXCEEDED and getattr(args, "timeout", None):
        line += f"\n(the call's --timeout of {args.timeout:g} s ran out; a longer one, or none, lets it finish)"
    if exc.code == grpc.StatusCode.UNAUTHENTICATED:
        line += "\n(the API token is read from --token-file FILE, SPECDEC_TOKEN_FILE or SPECDEC_TOKEN)"
    if exc.code != grpc.StatusCode.UNAVAILABLE:
        return line
    address = args.address or DEFAULT_ADDRESS
    message = exc.message.lower()
    if not message.startswith(CONNECTION_FAILED):  # the coordinator's own words ("downstream call failed: ...")
        return line
    if "handshake" in message or "ssl" in message:
        line += (f"\n(TLS with {address} failed: does the coordinator serve TLS, with a certificate signed by "
                 "--tls-ca and naming the host dialled?)")  # fmt: skip
    elif "socket closed" in message and not getattr(args, "tls_ca", None):
        line += (f"\n(something at {address} closed the connection: a coordinator serving TLS? pass --tls-ca "
                 "with the CA that signed its certificate)")  # fmt: skip
    else:
        if getattr(args, "command", "") not in ("generate", "trace"):  # resume, delete, soak: a stack they start would not help
            started = ""
        elif getattr(args, "tls_ca", None):
            started = "; a local one is started only without --tls-ca"
        else:
            started = "; without --address, generate and trace start one for the command"
        line += f"\n(is a coordinator serving at {address}? `specdec up` starts one{started})"
        if names_no_port(address):
            port = DEFAULT_ADDRESS.rpartition(":")[2]
            line += (f"\n({address!r} names no port, so gRPC dialled 443; a coordinator listens on {port} "
                     f"unless its --port says otherwise: --address {address}:{port})")  # fmt: skip
    return line


# How gRPC's own message for a call that reached no server begins (client_error), lowercased; a
# coordinator's UNAVAILABLE may quote such words after its own ("downstream call failed: failed to
# connect ..."), and is no connection failure of this client's.
CONNECTION_FAILED = ("failed to connect", "connections to all backends failing", "dns resolution failed",
                     "empty address list")  # fmt: skip


def names_no_port(address: str) -> bool:
    """True for one host without a port (`myhost`, `10.0.0.5`, `[::1]`, `dns:///myhost`), to
    which gRPC connects on 443, the HTTPS port, not on a coordinator's; False for a host:port,
    a list, or a target of another scheme (`unix:///run/specdec.sock`)."""
    host = address.removeprefix("dns:///")
    if "/" in host:
        return False
    return "," not in host and (":" not in host or host.endswith("]"))


def generate_options(args) -> dict:
    return dict(
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
        seed=args.seed, num_speculative_tokens=None if args.k == "adaptive" else args.k,
        adaptive_k=args.k == "adaptive", speculate=not args.no_speculate, stop=args.stop,
        timeout=args.timeout, pipeline=None if args.pipeline is None else args.pipeline == "on",
    )  # fmt: skip


def run_generate(args) -> int:
    from specdec import telemetry
    from specdec.client import Client, SpecdecClientError

    options, prompt = client_options(args), prompt_arguments(args)
    telemetry.setup_tracing("specdec-cli")
    last, text, tokens = None, "", 0
    try:
        with serving_address(args) as address, Client(address, retries=args.retries, **options) as client:
            if args.json:
                print(json.dumps(client.generate(**prompt, **generate_options(args)).as_dict()))
                return 0
            for chunk in client.generate_stream(**prompt, **generate_options(args)):
                print(chunk.text, end="", flush=True)
                last, text, tokens = chunk, text + chunk.text, tokens + len(chunk.token_ids)
            print()
            if last is not None:
                print(format_stats(last.stats, last.finish_reason), file=sys.stderr)
                if not text.strip() and last.finish_reason == "eos" and "prompt" in prompt:
                    print("(the model ended its text at once; an instruct or chat model answers a question "
                          "asked with --chat)", file=sys.stderr)  # fmt: skip
    except SpecdecClientError as exc:
        print(("\n" if last is not None else "") + client_error(exc, args), file=sys.stderr)
        session_id = exc.session_id or (last.session_id if last is not None else None)  # begun, chunk or not
        if session_id and not (last is not None and last.finish_reason) and args.address:
            print(f"(the rest: specdec resume {session_id} --address {args.address} "
                  f"--received-tokens {tokens} --received-chars {len(text)})", file=sys.stderr)  # fmt: skip
        return 1
    finally:
        telemetry.shutdown_tracing()
    return 0


def run_resume(args) -> int:
    from specdec.client import Client, SpecdecClientError

    options = client_options(args)
    where = dict(received_tokens=args.received_tokens, received_chars=args.received_chars, timeout=args.timeout)
    try:
        with Client(args.address, **options) as client:
            if args.json:
                print(json.dumps(client.resume(args.session_id, **where).as_dict()))
                return 0
            last = None
            for chunk in client.resume_stream(args.session_id, **where):
                print(chunk.text, end="", flush=True)
                last = chunk
            print()
            if last is not None:
                print(format_stats(last.stats, last.finish_reason, timed=False), file=sys.stderr)
    except SpecdecClientError as exc:
        print(client_error(exc, args), file=sys.stderr)
        return 1
    return 0


def run_delete(args) -> int:
    from specdec.client import Client, SpecdecClientError

    try:
        with Client(args.address, **client_options(args)) as client:
            deleted = client.delete(args.session_id)
    except SpecdecClientError as exc:
        print(client_error(exc, args), file=sys.stderr)
        return 1
    print(f"deleted session {args.session_id}" if deleted else
          f"no session {args.session_id} deleted (expired, deleted already, never created, or created "
          "again while this call checked it)",
          file=sys.stdout if deleted else sys.stderr)  # fmt: skip
    return 0 if deleted else 1


def run_trace(args) -> int:
    from specdec import telemetry
    from specdec.client import Client, SpecdecClientError

    options, prompt = client_options(args), prompt_arguments(args)
    telemetry.setup_tracing("specdec-cli")
    try:
        with serving_address(args) as address, Client(address, retries=args.retries, **options) as client:
            result = client.generate(**prompt, **generate_options(args))
    except SpecdecClientError as exc:
        print(client_error(exc, args), file=sys.stderr)
        return 1
    finally:
        telemetry.shutdown_tracing()
    if args.json:
        print(json.dumps({**result.as_dict(), "cycles": [vars(c) for c in result.cycles]}))
        return 0
    print(format_timeline(result))
    return 0


TIMELINE_WIDTH = 40


def format_timeline(result) -> str:
    """One line per cycle: K, drafted, accepted, bonus, the output tokens it committed, draft and
    verify ms, and a bar in which `d` is drafting and `v` verifying, scaled to the slowest cycle."""
    longest = max((c.draft_ms + c.verify_ms for c in result.cycles), default=0.0) or 1.0
    lines = [f"session {result.session_id}: {len(result.token_ids)} tokens, {len(result.cycles)} cycles, "
             f"finish {result.finish_reason}",  # fmt: skip
             f"{'cycle':>5} {'k':>3} {'drafted':>7} {'accepted':>8} {'bonus':>5} {'tokens':>6} {'draft ms':>9} "
             f"{'verify ms':>9}  time"]  # fmt: skip
    for c in result.cycles:
        bar = "d" * round(TIMELINE_WIDTH * c.draft_ms / longest) + "v" * round(TIMELINE_WIDTH * c.verify_ms / longest)
        lines.append(f"{c.index:>5} {c.k:>3} {c.drafted:>7} {c.accepted:>8} {'yes' if c.bonus else '':>5} "
                     f"{c.tokens:>6} {c.draft_ms:>9.1f} {c.verify_ms:>9.1f}  {bar}")  # fmt: skip
    stats = result.stats
    draft_total = sum(c.draft_ms for c in result.cycles)
    verify_total = sum(c.verify_ms for c in result.cycles)
    lines.append(f"total: draft {draft_total:.1f} ms, verify {verify_total:.1f} ms, request {stats.elapsed_s * 1000:.1f} ms "
                 f"(other {max(0.0, stats.elapsed_s * 1000 - draft_total - verify_total):.1f} ms: Redis, gRPC, coordinator)")  # fmt: skip
    lines.append(format_stats(stats, result.finish_reason))
    return "\n".join(lines)


def format_stats(stats, finish_reason, timed: bool = True) -> str:
    """The statistics line; not `timed` (resume), it leaves out the time and rate, as the time is
    this call's only while the counts are the whole session's."""
    timing = f" in {stats.elapsed_s:.2f}s = {stats.tokens_per_second:.1f} tok/s" if timed else ""
    drafting = (f"drafted {stats.draft_tokens}, accepted {stats.accepted_tokens} (α {stats.acceptance_rate:.2f}); "
                f"{stats.mean_accepted_length:.2f} tokens per drafting cycle") if stats.draft_cycles else "nothing drafted"
    return f"[{stats.generated_tokens} tokens{timing}; {stats.cycles} cycles; {drafting}; finish: {finish_reason}]"


def run_models(args) -> int:
    from specdec import catalog  # light: listing the catalog loads no torch

    if args.models_command == "list":
        for name in catalog.list_catalog():
            state = "cached" if catalog.is_cached(name) else "not cached"
            print(f"{name}\t{state}\t{catalog.describe(name)}", flush=True)
        print(f"(the cache: {catalog.cache_dir() / 'models'}; {catalog.CACHE_ENV} moves it)", file=sys.stderr)
        return 0
    if not catalog.is_catalog_name(args.name):
        print(f"specdec models pull: {args.name!r} is not in the catalog; known: {', '.join(catalog.list_catalog())}",
              file=sys.stderr)
        return 2
    from specdec.models import CatalogFetchError, ensure_catalog_model

    try:
        print(ensure_catalog_model(args.name))
    except CatalogFetchError as exc:
        print(f"specdec models pull: {exc}", file=sys.stderr)
        return 1
    return 0


def run_bench(args) -> int:
    from specdec.bench import run_bench as bench

    return bench(args)


def run_soak(args) -> int:
    from specdec.soak import run_soak as soak

    return soak(args)


def run_distill(args) -> int:
    from specdec.distill import run_distill as distill

    return distill(args)


def command_parser(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The parser of the (sub)command that `args` ran: `specdec serve draft`'s, say, not `specdec`'s."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and getattr(args, action.dest, None) in action.choices:
            return command_parser(action.choices[getattr(args, action.dest)], args)
    return parser


GLOBAL_FLAGS = ("-v", "--verbose", "--version")  # specdec's own flags, before any command


def refuse_extra_arguments(parser: argparse.ArgumentParser, extra: list[str]) -> NoReturn:
    """Exit with the command's own usage and a line naming the `extra` arguments it does not
    take, with the nearest flag it has for a mistyped one, or a hint to quote a prompt of
    several words (argparse alone would answer with `specdec`'s usage and nothing more)."""
    message = f"unrecognized arguments: {' '.join(extra)}"
    flags = [option for action in parser._actions for option in action.option_strings]
    unknown = [arg.split("=", 1)[0] for arg in extra if arg.startswith("-")]
    misplaced = [flag for flag in unknown if flag in GLOBAL_FLAGS]
    guesses = [(flag, difflib.get_close_matches(flag, flags, n=1, cutoff=0.6)) for flag in unknown if flag not in misplaced]
    hints = [f"{flag}: did you mean {match[0]}?" for flag, match in guesses if match]
    hints += [f"{flag} goes before the command: specdec {flag} {parser.prog.removeprefix('specdec ')} ..." for flag in misplaced]
    if not unknown and any(action.dest == "prompt" for action in parser._actions):
        hints.append("a prompt of several words goes in quotes")
    parser.error("; ".join([message, *hints]))


class OutputError(OSError):
    """Writing the command's output (stdout) failed: told from any other file's error (main)."""


class GuardedOutput:
    """sys.stdout while a command runs: an OSError writing it becomes an OutputError (a
    BrokenPipeError stays one: the reader left, main ends quietly)."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text: str) -> int:
        return self.guarded(self.stream.write, text)

    def flush(self) -> None:
        self.guarded(self.stream.flush)

    @staticmethod
    def guarded(operation, *args):
        try:
            return operation(*args)
        except BrokenPipeError:
            raise
        except OSError as exc:
            raise OutputError(exc.errno, exc.strerror) from exc

    def __getattr__(self, name: str):
        return getattr(self.stream, name)


def parse_command_line(argv: list[str]) -> argparse.Namespace:
    """The arguments of a command line, or exit (status 2) with the error of the command it
    names: an argument it does not take, or an environment variable of its flags it refuses."""
    parser = build_parser(argv)
    args, extra = parser.parse_known_args(argv)
    command = command_parser(parser, args)
    if extra:
        refuse_extra_arguments(command, extra)
    for flags, problem in env_problems(command):
        if not any(word == flag or word.startswith(f"{flag}=") for word in argv for flag in flags):
            command.error(problem)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_command_line(sys.argv[1:] if argv is None else argv)
    if args.verbose:
        logging.basicConfig(level=logging.INFO)
    handlers = {
        "up": run_up, "serve": run_serve, "generate": run_generate, "trace": run_trace, "resume": run_resume, "delete": run_delete, "models": run_models,
        "bench": run_bench, "distill": run_distill, "soak": run_soak,
    }  # fmt: skip
    from specdec.launcher import StackStartError

    output, sys.stdout = sys.stdout, GuardedOutput(sys.stdout)
    try:
        status = handlers[args.command](args)
        sys.stdout.flush()  # here, not at exit: a pipe's reader that left is caught below
        return status
    except StackStartError as exc:  # a service's own error is in the message (or above, on stderr)
        print(f"specdec {args.command}: could not start the services: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C: a local stack has been stopped on the way out (Stack.__exit__)
        print(f"\nspecdec {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `specdec generate ... | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit's flush cannot fail again
        return 141  # 128 + SIGPIPE, as a shell reports a command a pipe's reader left
    except OutputError as exc:  # `> /dev/full`, a full disk or quota, a terminal gone: a traceback came
        os.dup2(os.open(os.devnull, os.O_WRONLY), output.fileno())  # so the exit's flush cannot fail again
        print(f"specdec {args.command}: cannot write the output: {exc.strerror}", file=sys.stderr)
        return 1
    finally:
        sys.stdout = output


if __name__ == "__main__":
    sys.exit(main())
