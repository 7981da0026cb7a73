"""`specdec soak`, the short version CI runs: a few seconds of concurrent clients against tiny models.
(The real soak, 8 clients for 10 minutes, is a command a person runs; nothing here is timed.)"""

import json
import signal
import subprocess
import sys
import time

from specdec.cli import main


def soak_json(capsys, *args) -> tuple[int, dict]:
    code = main(["soak", "--json", "--no-progress", "--max-new-tokens", "8", *args])
    return code, json.loads(capsys.readouterr().out)


def prompts_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "hello world, hello world"}\n{"prompt": "the cat sat on the mat"}\n')
    return str(path)


def test_soak_against_a_running_stack_reports_no_errors_and_rss_only_for_named_pids(tiny_stack, capsys, tmp_path):
    coordinator = tiny_stack.processes["coordinator"].pid
    code, report = soak_json(capsys, "--address", tiny_stack.address, "--clients", "2", "--minutes", "0.05",
                             "--prompts", prompts_file(tmp_path), "--pid", f"coordinator={coordinator}")  # fmt: skip
    assert code == 0, report["error_samples"]
    assert report["errors"] == 0 and report["errors_by_code"] == {}
    assert report["requests"] > 0 and report["tokens"] > 0 and report["tokens_per_s"] > 0
    assert 0 < report["p50_latency_ms"] <= report["p99_latency_ms"]
    assert 0 < report["p50_token_ms"] <= report["p99_token_ms"]
    assert list(report["processes"]) == ["coordinator"]
    assert report["processes"]["coordinator"]["pid"] == coordinator
    assert report["processes"]["coordinator"]["rss_end_mib"] > 0


def test_soak_against_a_running_stack_without_pids_says_rss_is_not_measured(tiny_stack, capsys, tmp_path):
    code = main(["soak", "--no-progress", "--address", tiny_stack.address, "--clients", "1", "--minutes", "0.02",
                 "--max-new-tokens", "4", "--prompts", prompts_file(tmp_path)])  # fmt: skip
    table = capsys.readouterr().out
    assert code == 0 and "errors            0" in table
    assert "RSS not measured" in table


def test_soak_counts_refused_requests_by_status_code_and_exits_1(tiny_stack, capsys, tmp_path):
    # The coordinator refuses more than its --max-new-tokens-limit (4096) with RESOURCE_EXHAUSTED.
    code, report = soak_json(capsys, "--address", tiny_stack.address, "--clients", "2", "--minutes", "0.02",
                             "--prompts", prompts_file(tmp_path), "--max-new-tokens", "100000")  # fmt: skip
    assert code == 1
    assert report["errors"] == report["requests"] > 0
    assert report["errors_by_code"] == {"RESOURCE_EXHAUSTED": report["errors"]}
    assert len(report["error_samples"]) == 1 and "max_new_tokens" in report["error_samples"][0]
    assert report["tokens"] == 0
    # No request succeeded: no latency (it read 0.0 ms); and each client paused 0.1 s after each
    # failure (2 clients for 1.2 s sent thousands of requests, each refused at once).
    assert report["p50_latency_ms"] is None and report["p99_token_ms"] is None
    assert report["requests"] <= 2 * (1.2 / 0.1 + 2)


def test_soak_against_a_coordinator_that_does_not_answer_or_a_pid_no_process_has_ends_at_once(capsys):
    """Against a dead address it ran all its minutes (10 by default), every client failing
    thousands of calls a second; a --pid no process has ran, reported `gone`, and passed."""
    import pytest

    from specdec.redis_server import free_port

    address = f"127.0.0.1:{free_port()}"
    with pytest.raises(SystemExit, match=f"the coordinator at {address} does not answer"):
        main(["soak", "--no-progress", "--address", address, "--minutes", "0.01"])
    with pytest.raises(SystemExit, match="--pid coordinator=4194305: no process has that id"):  # above Linux's pid_max
        main(["soak", "--no-progress", "--address", address, "--minutes", "0.01", "--pid", "coordinator=4194305"])


def test_soak_with_its_own_stack_reports_rss_of_every_process(tiny_models, capsys, tmp_path):
    code, report = soak_json(capsys, "--target", tiny_models.target, "--draft", tiny_models.draft, "--clients", "2",
                             "--minutes", "0.1", "--warmup-s", "1", "--prompts", prompts_file(tmp_path))  # fmt: skip
    assert code == 0, report["error_samples"]
    assert report["errors"] == 0 and report["requests"] > 0 and report["tokens"] > 0
    assert report["p50_latency_ms"] <= report["p99_latency_ms"]
    assert report["warmup_s"] == 1 and report["duration_s"] >= 6 and 1 <= report["rss_start_t_s"] < 3
    assert list(report["processes"]) == ["redis", "coordinator", "draft", "target"]
    for name, process in report["processes"].items():
        assert process["rss_start_mib"] > 0 and process["rss_end_mib"] > 0, name
        assert process["growth_pct"] is not None, name
        assert len(process["rss_series_mib"]) == len(report["rss_series_t_s"]) >= 2, name


def test_the_soak_bar_counts_the_time_left_down_from_the_runs_length():
    """tqdm's own estimate of the time left, from its rate, swung from 00:07 to 00:14 and back."""
    import asyncio
    import io
    import re
    import time

    from tqdm import tqdm

    from specdec.soak import Tally, watch

    async def run():
        out = io.StringIO()
        with tqdm(total=3, file=out, bar_format="{n_fmt}/{total_fmt} s{postfix}") as bar:
            task = asyncio.create_task(watch({}, time.monotonic(), 3.0, 0.0, bar, Tally()))
            await asyncio.sleep(2.2)
            task.cancel()
        return out.getvalue()

    shown = [int(s) for s in re.findall(r"00:(\d\d) left", asyncio.run(run()))]
    assert shown[0] == 3 and shown[-1] <= 1 and shown == sorted(shown, reverse=True), shown


def test_ctrl_c_ends_a_soak_early_with_the_report_of_the_time_that_ran_marked_interrupted(tiny_stack, tmp_path):
    """A soak of many minutes stopped by Ctrl-C used to end in a KeyboardInterrupt traceback and
    no report; now the requests in flight are cancelled (not errors) and the report covers what ran."""
    soak = subprocess.Popen([sys.executable, "-m", "specdec.cli", "soak", "--json", "--address", tiny_stack.address,
                             "--clients", "2", "--minutes", "10", "--max-new-tokens", "8", "--prompts", prompts_file(tmp_path),
                             "--pid", f"coordinator={tiny_stack.processes['coordinator'].pid}", "--warmup-s", "60"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert "soak:" in read_until(soak.stderr, "soak:", timeout_s=60)  # the bar: the clients run
        time.sleep(2)
        soak.send_signal(signal.SIGINT)
        out, err = soak.communicate(timeout=60)
    finally:
        soak.kill()
    assert soak.returncode == 130, err
    report = json.loads(out)
    assert report["interrupted"] is True and report["duration_s"] < 60
    assert report["requests"] > 0 and report["tokens"] > 0 and report["errors"] == 0, report
    # Stopped within its warm-up: the start RSS is the run's first sample, and the report says when.
    assert report["rss_start_t_s"] < 2 and report["processes"]["coordinator"]["rss_start_mib"] > 0
    assert "Traceback" not in err


def read_until(stream, text: str, timeout_s: float) -> str:
    """What `stream` gave until a chunk holding `text` (or its end, or timeout_s)."""
    seen, deadline = "", time.monotonic() + timeout_s
    while text not in seen and time.monotonic() < deadline:
        chunk = stream.read(1)
        if not chunk:
            break
        seen += chunk
    return seen
