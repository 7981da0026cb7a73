"""The SDK is typed (it ships py.typed): a type checker run on a caller's code catches a
misspelled or mistyped keyword of every public method, generate and resume included, which
take their stream method's keywords as **options."""

import inspect
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

import specdec
from specdec.client import AsyncClient, Client, GenerateOptions, ResumeOptions

CALLER = textwrap.dedent(
    """
    from typing import Unpack

    import specdec

    client = specdec.Client("localhost:50051")
    result: specdec.Result = client.generate("hi", max_new_tokens=5, temperature=0.5, stop="x", seed=1)
    client.generate(messages=[{"role": "user", "content": "hi"}], timeout=3.0, adaptive_k=True)
    client.resume("abc", received_tokens=3, received_chars=10, timeout=None)
    client.generate("hi", max_new_token=5)  # bad
    client.generate("hi", max_new_tokens="5")  # bad
    client.generate_stream("hi", temprature=1.0)  # bad
    client.resume("abc", received_token=3)  # bad
    info: specdec.ServerInfo = client.info()
    vocab: int = info.target.vocab_size + info.draft.default_k
    info.target.vocabulary  # bad


    def ask(client: specdec.Client, **options: Unpack[specdec.GenerateOptions]) -> str:
        return client.generate("hi", **options).text


    ask(client, max_new_tokens=3)
    ask(client, max_tokens=3)  # bad


    async def use_async() -> None:
        aclient = specdec.AsyncClient()
        await aclient.generate("hi", max_new_tokens=5, pipeline=False)
        await aclient.resume("abc", received_chars=2)
        await aclient.generate("hi", top_p="high")  # bad
        await aclient.resume("abc", received_chars=2.5)  # bad
    """
)


def test_a_type_checker_catches_a_misspelled_or_mistyped_keyword_of_generate_and_resume(tmp_path):
    caller = tmp_path / "caller.py"
    caller.write_text(CALLER)
    run = subprocess.run(
        [sys.executable, "-m", "mypy", "--ignore-missing-imports", "--no-error-summary",
         "--cache-dir", str(tmp_path / "cache"), str(caller)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    flagged = {int(line.split(":")[1]) for line in run.stdout.splitlines() if ": error:" in line}
    bad = {n for n, line in enumerate(CALLER.splitlines(), 1) if line.endswith("# bad")}
    assert flagged == bad, run.stdout + run.stderr


@pytest.mark.parametrize("cls", [Client, AsyncClient])
@pytest.mark.parametrize("method, options", [("generate_stream", GenerateOptions), ("resume_stream", ResumeOptions)])
def test_the_options_of_generate_and_resume_are_exactly_their_stream_methods_keywords(cls, method, options):
    params = inspect.signature(getattr(cls, method)).parameters.values()
    keywords = {p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY}
    assert set(options.__annotations__) == keywords


def test_info_is_a_typed_dataclass_holding_every_model_field_but_the_live_counters():
    """Client.info used to return the protobuf message; the SDK converts at its edge, and a
    field the proto gains must be added here too (the counters live on /metrics instead)."""
    import dataclasses

    from specdec.client import ModelInfo, ServerInfo
    from specdec.v1 import specdec_pb2 as pb

    live = {"sessions_held", "cache_bytes", "cache_evictions"}
    assert {f.name for f in dataclasses.fields(ModelInfo)} == {f.name for f in pb.ModelInfoResponse.DESCRIPTOR.fields} - live
    assert {f.name for f in dataclasses.fields(ServerInfo)} == {f.name for f in pb.InfoResponse.DESCRIPTOR.fields}
    msg = pb.InfoResponse(target=pb.ModelInfoResponse(model="t", eos_token_ids=[2, 7], max_k=16), draft=pb.ModelInfoResponse(
        model="ngram", kind="ngram", min_ngram=1, max_ngram=3), default_num_speculative_tokens=4, max_new_tokens_limit=99)
    info = ServerInfo.from_pb(msg)
    assert (info.target.model, info.target.eos_token_ids, info.target.max_k) == ("t", (2, 7), 16)
    assert (info.draft.kind, info.draft.min_ngram, info.draft.max_ngram) == ("ngram", 1, 3)
    assert (info.default_num_speculative_tokens, info.max_new_tokens_limit) == (4, 99)


def test_the_package_ships_its_py_typed_marker():
    """A type checker takes an installed package for typed only where it holds py.typed (PEP 561):
    pyproject.toml listed it but the file was missing, so `pip install .` gave callers an untyped
    SDK (the test above finds the source tree from the repository, where no marker is asked for)."""
    package = Path(specdec.__file__).parent
    assert (package / "py.typed").is_file()
    pyproject = tomllib.loads((package.parent / "pyproject.toml").read_text())
    assert "py.typed" in pyproject["tool"]["setuptools"]["package-data"]["specdec"]
