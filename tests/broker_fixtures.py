"""Fixtures of the broker tests (each tests/test_broker_*.py loads them with `pytest_plugins`).

Every broker test runs with short intervals, and ends with no process of its namespace alive: the
`broker_processes` fixture kills any launched process left behind and fails the test that left it.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import pytest_asyncio

from schemas.errors import BusError
from services.broker.config import BrokerServiceConfig, Timing
from services.broker.worker import STREAM, make_broker
from tests.broker_helpers import CATALOG, FAST, kill_marked
from tests.bus_helpers import eventually


class Broker:
    """Calls to the broker service of this test's namespace."""

    def __init__(self, client) -> None:
        self.client = client

    async def __call__(self, command: str, payload: dict[str, Any], timeout: float = 10.0) -> dict[str, Any]:
        return await self.client.request(f"broker.{command}", payload, dict, timeout=timeout)

    async def error(self, command: str, payload: dict[str, Any]) -> BusError:
        with pytest.raises(BusError) as caught:
            await self(command, payload)
        return caught.value

    async def pool(self, user: str, name: str) -> dict[str, Any]:
        brokers = (await self("list-brokers", {"user": user}))["brokers"]
        return next(b for b in brokers if b["name"] == name)

    async def wait_idle(self, user: str, name: str, count: int, timeout: float = 20.0) -> dict[str, Any]:
        async def ready():
            pool = await self.pool(user, name)
            return pool if pool["idle"] >= count else None

        return await eventually(ready, timeout)

    async def wait_running(self, user: str, resource_id: str, timeout: float = 20.0) -> dict[str, Any]:
        async def running():
            info = await self("get-service-info", {"user": user, "resource_id": resource_id})
            return info if info["status"] != "staging" else None

        return await eventually(running, timeout)


@pytest.fixture
def broker_call(client) -> Broker:
    return Broker(client)


@pytest_asyncio.fixture
async def subscribe(events):
    """Subscribe to events for the test (`await subscribe("broker.u.>")`); closed at the end."""
    streams = []

    async def open_stream(pattern: str):
        stream = await events.subscribe(pattern)
        streams.append(stream)
        return stream

    yield open_stream
    for stream in streams:
        await stream.close()


@pytest.fixture
def broker_processes(prefix):
    """Fails a test that leaves a launched process alive (after killing it)."""
    yield
    left = kill_marked(prefix)
    assert not left, f"processes left behind: {left}"


@pytest_asyncio.fixture
async def start_broker(serve, nc, redis, events, prefix, broker_processes):
    """Start in-process broker replicas: `await start_broker(max_instances=4, cooling_seconds=1)`.

    Keyword arguments are `BrokerServiceConfig` fields or `Timing` fields. The replicas are stopped at the
    end; the test must have released what it launched.
    """
    replicas = []

    async def start(**overrides: Any):
        timing = replace(FAST, **{k: v for k, v in overrides.items() if k in Timing.__dataclass_fields__})
        settings = BrokerServiceConfig(
            stop_grace=1.0,
            timing=timing,
            **{"catalog": str(CATALOG), **{k: v for k, v in overrides.items() if k not in Timing.__dataclass_fields__}},
        )
        await events.ensure_stream(STREAM, memory=True)  # its events are published with acknowledgements
        service, replica = make_broker(settings, redis=redis, nc=nc, events=events, prefix=prefix)
        await serve(service)
        await replica.start()
        replicas.append((service, replica))
        return service, replica

    yield start
    for service, replica in replicas:
        await service.drain(timeout=5)
        await replica.stop()
