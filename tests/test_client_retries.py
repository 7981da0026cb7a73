"""The SDK sends a call that failed UNAVAILABLE before its first chunk again, and never one
that has streamed: through a real gRPC server on loopback whose Generate fails as told."""

from __future__ import annotations

import asyncio
from concurrent import futures

import grpc
import pytest

import specdec
from specdec.client import retry_config
from specdec.v1 import specdec_pb2 as pb
from specdec.v1 import specdec_pb2_grpc as pb_grpc


class FlakyCoordinator(pb_grpc.CoordinatorServicer):
    """Generate fails `code` on its first `failures` calls, before any chunk; then streams "ab",
    failing UNAVAILABLE between the two chunks when `fail_mid_stream`."""

    def __init__(self, failures: int, code=grpc.StatusCode.UNAVAILABLE, fail_mid_stream: bool = False):
        self.calls, self.failures, self.code, self.fail_mid_stream = 0, failures, code, fail_mid_stream

    def Generate(self, request, context):
        self.calls += 1
        if self.calls <= self.failures:
            context.abort(self.code, f"failure {self.calls}")
        yield pb.GenerateChunk(text="a", token_ids=[1], session_id="s")
        if self.fail_mid_stream:
            context.abort(grpc.StatusCode.UNAVAILABLE, "lost mid-stream")
        yield pb.GenerateChunk(text="b", token_ids=[2], finish_reason=pb.FINISH_REASON_LENGTH)


@pytest.fixture
def serve():
    servers = []

    def start(servicer) -> str:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        pb_grpc.add_CoordinatorServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        servers.append(server)
        return f"127.0.0.1:{port}"

    yield start
    for server in servers:
        server.stop(0)


def generate(address: str, **client_options) -> str:
    with specdec.Client(address, **client_options) as client:
        return client.generate("x", max_new_tokens=2).text


def test_a_call_failing_unavailable_before_its_first_chunk_is_sent_again_up_to_the_retries(serve):
    flaky = FlakyCoordinator(failures=2)
    assert generate(serve(flaky)) == "ab" and flaky.calls == 3  # the default: 2 retries
    flaky = FlakyCoordinator(failures=3)
    with pytest.raises(specdec.SpecdecClientError) as failed:
        generate(serve(flaky))
    assert failed.value.code == grpc.StatusCode.UNAVAILABLE and failed.value.message == "failure 3" and flaky.calls == 3
    flaky = FlakyCoordinator(failures=4)
    assert generate(serve(flaky), retries=4) == "ab" and flaky.calls == 5


def test_a_stream_that_has_sent_a_chunk_is_never_sent_again(serve):
    flaky = FlakyCoordinator(failures=0, fail_mid_stream=True)
    chunks = []
    with specdec.Client(serve(flaky)) as client, pytest.raises(specdec.SpecdecClientError) as failed:
        for chunk in client.generate_stream("x", max_new_tokens=2):
            chunks.append(chunk.text)
    assert chunks == ["a"] and failed.value.message == "lost mid-stream" and flaky.calls == 1


@pytest.mark.parametrize("code", [grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
                                  grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.UNAUTHENTICATED])  # fmt: skip
def test_only_unavailable_is_retried(serve, code):
    flaky = FlakyCoordinator(failures=1, code=code)
    with pytest.raises(specdec.SpecdecClientError) as failed:
        generate(serve(flaky))
    assert failed.value.code == code and flaky.calls == 1


def test_retries_zero_sends_a_call_once_and_the_async_client_retries_alike(serve):
    flaky = FlakyCoordinator(failures=1)
    with pytest.raises(specdec.SpecdecClientError):
        generate(serve(flaky), retries=0)
    assert flaky.calls == 1

    async def generate_async(address: str) -> str:
        async with specdec.AsyncClient(address) as client:
            return (await client.generate("x", max_new_tokens=2)).text

    flaky = FlakyCoordinator(failures=2)
    assert asyncio.run(generate_async(serve(flaky))) == "ab" and flaky.calls == 3


@pytest.mark.parametrize("retries", [-1, 5, 1.5, "2"])
def test_retries_outside_what_grpc_can_make_is_a_value_error(retries):
    with pytest.raises(ValueError, match="retries must be an integer from 0 to 4"):
        retry_config(retries)
    with pytest.raises(ValueError, match="retries must be an integer from 0 to 4"):
        specdec.Client("127.0.0.1:1", retries=retries)


def test_specdec_generate_retries_as_its_retries_flag_says(serve, capsys):
    """`specdec generate --retries N` is the SDK's `retries=N` (default 2); the flag's range is the SDK's."""
    from specdec.cli import main

    flaky = FlakyCoordinator(failures=2)
    assert main(["generate", "x", "--address", serve(flaky)]) == 0 and flaky.calls == 3
    assert capsys.readouterr().out == "ab\n"
    flaky = FlakyCoordinator(failures=1)
    assert main(["generate", "x", "--address", serve(flaky), "--retries", "0"]) == 1 and flaky.calls == 1
    assert "failure 1" in capsys.readouterr().err
    flaky = FlakyCoordinator(failures=1)
    assert main(["trace", "x", "--address", serve(flaky), "--retries", "1", "--json"]) == 0 and flaky.calls == 2
    with pytest.raises(SystemExit):
        main(["generate", "x", "--retries", "5"])
    assert "--retries: expected an integer at least 0 and at most 4, got '5'" in capsys.readouterr().err
