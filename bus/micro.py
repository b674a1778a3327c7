"""The one place that touches `nats.micro`'s private parts (tested with nats-py 2.16: pyproject pins
that range, and tests/test_bus_runtime.py's stats and drain tests fail if those parts move).

`bus.Service` runs each request in a task of its own, so nats.micro's own bookkeeping ends when the
handler returns, before the work does. Two things nats.micro has no public way to do follow from
that: completing an endpoint's stats when the task ends (`$SRV.STATS` shows real processing times
and errors), and draining the endpoints' subscriptions, so that requests already queued are served
before the service stops (nats.micro's `stop()` drops them).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable

from nats.aio.client import Client
from nats.micro import ServiceConfig
from nats.micro.request import Request
from nats.micro.service import Endpoint, Service

log = logging.getLogger("berth.service")


class MicroService:
    """A started `nats.micro` service, its endpoints' stats and their drain."""

    def __init__(self, service: Service) -> None:
        self._service = service
        self._endpoints: dict[str, Endpoint] = {}

    @classmethod
    async def start(cls, nc: Client, config: ServiceConfig) -> MicroService:
        service = Service(nc, config)
        await service.start()
        return cls(service)

    @property
    def id(self) -> str:
        return self._service.id

    async def add_endpoint(
        self, name: str, subject: str, handler: Callable[[Request], Awaitable[None]], broadcast: bool
    ) -> None:
        """Serve `subject`; `broadcast`: in a queue group of this instance's own, so that every
        instance receives every request."""
        await self._service.add_endpoint(
            name=name, subject=subject, handler=handler, queue_group=self._service.id if broadcast else None
        )
        self._endpoints[name] = self._service._endpoints[-1]

    def record(self, name: str, elapsed_ns: int, error: str | None) -> None:
        """Complete the stats of one request that `name` received (`error`: "<code>:<message>")."""
        stats = self._endpoints.get(name)
        if stats is None:
            return
        stats._processing_time += elapsed_ns
        stats._average_processing_time = int(stats._processing_time / max(1, stats._num_requests))
        if error is not None:
            stats._num_errors += 1
            stats._last_error = error

    async def drain(self, deadline: float) -> None:
        """Stop receiving: every endpoint's subscription drains (what it holds is still served)
        by `deadline` (time.monotonic())."""
        for endpoint in self._service._endpoints:
            if endpoint._subscription is None:
                continue
            try:
                await asyncio.wait_for(endpoint._subscription.drain(), max(0.1, deadline - time.monotonic()))
            except Exception as error:  # a drain that cannot finish must not stop the others
                log.warning("drain of %s: %r", endpoint._subject, error)
            endpoint._subscription = None

    def stopped(self) -> None:
        """Mark the service stopped (its subscriptions are drained already)."""
        self._service._stopped.set()
