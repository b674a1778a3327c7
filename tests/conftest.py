"""Test session: real nats-server and redis-server, a clean namespace per test.

The servers are started once per session on free ports (or taken from NATS_URL / REDIS_URL).
Every test gets its own subject/key prefix, so tests never see each other's requests, events or
Redis keys; the prefix's keys and events stream are deleted afterwards.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import uuid
from pathlib import Path

import pytest
import pytest_asyncio

from berth.servers import start_nats, start_nats_cluster, start_redis, start_redis_cluster
from bus.client import BusClient
from bus.connection import connect
from bus.events import EventBus
from bus.redis import connect_redis
from tests.worker_helpers import spawning


def pytest_addoption(parser):
    parser.addoption("--long", action="store_true", help="also run the tests marked long (an hour's soak)")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--long"):
        return
    skip = pytest.mark.skip(reason="long: run with --long")
    for item in items:
        if "long" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def server_urls():
    """(nats_url, redis_url): the environment's, else servers of our own for this session."""
    if os.environ.get("NATS_URL") and os.environ.get("REDIS_URL"):
        yield os.environ["NATS_URL"], os.environ["REDIS_URL"]
        return
    state = Path(tempfile.mkdtemp(prefix="berth-test-"))
    nats = start_nats(state / "nats")
    redis = start_redis(state / "redis", appendonly=False)
    try:
        yield nats.url, redis.url
    finally:
        nats.stop()
        redis.stop()


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory):
    """A Redis Cluster (3 primaries, 3 replicas) on loopback for the session's cluster tests."""
    cluster = start_redis_cluster(tmp_path_factory.mktemp("redis-cluster"))
    yield cluster
    cluster.stop()


@pytest.fixture(scope="session")
def nats_cluster(tmp_path_factory):
    """Three routed nats-servers with clustered JetStream, for the session's cluster tests."""
    cluster = start_nats_cluster(tmp_path_factory.mktemp("nats-cluster"))
    yield cluster
    cluster.stop()


@pytest.fixture(scope="session")
def nats_url(server_urls) -> str:
    return server_urls[0]


@pytest.fixture(scope="session")
def redis_url(server_urls) -> str:
    return server_urls[1]


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def nc(nats_url):
    conn = await connect(nats_url, name="berth-tests", worker=False, max_reconnect_attempts=-1)
    yield conn
    await connected(conn)  # a synchronous test may have held the loop past the server's pings
    await conn.drain()


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def redis(redis_url):
    client = connect_redis(redis_url, max_connections=128)
    yield client
    await client.aclose()


@pytest_asyncio.fixture
async def prefix(nc, redis):
    """A fresh namespace for one test; its Redis keys and events stream go away afterwards."""
    await connected(nc)
    name = new_prefix()
    yield name
    await connected(nc)
    await clean_namespace(nc, redis, name)


async def connected(nc) -> None:
    """Wait while the session's connection reconnects: the servers drop a client that answers no
    ping for a few seconds (berth/servers.py), as this one does while synchronous tests hold
    the event loop."""
    for _ in range(100):
        if nc.is_connected:
            try:
                await nc.flush(timeout=2)  # a round trip: a connection the server closed meanwhile shows now
                return
            except Exception:
                pass  # it reconnects
        await asyncio.sleep(0.1)


def new_prefix() -> str:
    return f"t{uuid.uuid4().hex[:12]}"


async def clean_namespace(nc, redis, name: str) -> None:
    """Delete a namespace's Redis keys and its events stream."""
    keys = [k async for k in redis.scan_iter(match=f"{name}:*", count=1000)]
    if keys:
        await redis.delete(*keys)
    for stream in ("events", "metrics"):
        try:
            await nc.jetstream().delete_stream(f"{name}-{stream}")
        except Exception:
            pass  # the namespace made no such stream


@pytest.fixture
def client(nc, prefix) -> BusClient:
    return BusClient(nc, prefix=prefix, timeout=5.0)


@pytest.fixture
def events(nc, prefix) -> EventBus:
    return EventBus(nc, prefix=prefix)


@pytest_asyncio.fixture
async def serve(nc):
    """Start a `bus.Service` in this process for the test; drained at the end."""
    started = []

    async def start(service):
        await service.start(nc)
        started.append(service)
        return service

    yield start
    for service in started:
        await service.drain(timeout=5)


@pytest_asyncio.fixture
async def serve_allocation(serve, prefix, redis, events):
    """Serve the allocation service in this process: `await serve_allocation()` -> its manager,
    following the node events (`watch=False`: not; `sweep_interval`, `lease_interval`; `window`:
    the idempotency window; `spread_sample`: a seeded `SpreadSample`; other keywords go to
    `make_service`). Unwatched at the end, before the service drains."""
    from bus.idempotency import DEFAULT_WINDOW, IdempotencyStore
    from services.allocation.manager import AllocationManager
    from services.allocation.store import NodeStore
    from services.allocation.worker import STREAM, make_plugins, make_service

    watching = []

    async def start(*, watch: bool = True, sweep_interval: float = 5.0, lease_interval: float = 0.5,
                    window: float = DEFAULT_WINDOW, spread_sample=None, **service_options):
        await events.ensure_stream(STREAM, memory=True)  # its events are published with acknowledgements
        manager = AllocationManager(NodeStore(redis, prefix), make_plugins(), events, spread_sample=spread_sample)
        if watch:
            await manager.watch(sweep_interval=sweep_interval, lease_interval=lease_interval)
            watching.append(manager)
        idempotency = IdempotencyStore(redis, prefix=prefix, window=window)
        await serve(make_service(manager, prefix, idempotency, **service_options))
        return manager

    yield start
    for manager in watching:
        await manager.unwatch()


@pytest.fixture
def spawn_worker(nats_url, redis_url, prefix):
    """Start a worker process of a service module in this test's namespace (`spawn_worker(module,
    *args, env=...)` -> its `Worker`); stopped at the end."""
    with spawning(nats_url, redis_url, prefix) as spawn:
        yield spawn
