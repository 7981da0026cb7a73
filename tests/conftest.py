"""Shared fixtures: a real redis-server for the whole run."""

import pytest

from specdec.redis_server import EmbeddedRedis


@pytest.fixture(scope="session")
def redis_server():
    with EmbeddedRedis() as server:
        yield server


@pytest.fixture(scope="session")
def redis_url(redis_server):
    return redis_server.url
