"""Servers the storage tests share: one redis-server and one mooncake_master (with one
Mooncake client that lends the memory objects are placed in) for the whole run, each
started when a test first asks for it and stopped by its PID at the end. Tests that
stop, fill up or reconfigure a server start their own."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def redis_srv():
    from redis_server import redis_server
    with redis_server() as s:
        yield s


@pytest.fixture(scope="session")
def mooncake_srv():
    from mooncake_master import master_server
    with master_server() as m:
        yield m


@pytest.fixture(scope="session")
def mooncake_shared(mooncake_srv):
    """The session's Mooncake client (prefix "shared:"); tests clear it when done."""
    from backend_contract import MOONCAKE_SIZES

    from uniradix.hicache.backends.mooncake import MooncakeBackend
    b = MooncakeBackend({"master": mooncake_srv.address, "prefix": "shared:", **MOONCAKE_SIZES})
    yield b
    b.close()
