"""Talking to one node's metrics agent from Python.

    metrics = MetricsClient(nc, node="n1", prefix="berth")
    value = await metrics.get("container", "cpu.usage.container", pod_uid=uid, container=cid)

    async with metrics.watch("node", "cpu.usage.system") as events:
        async for event in events:          # MetricEvent: value, sample_time, ...
            ...

`watch` subscribes before it registers (so the first event cannot be missed), renews the lease in
the background at a third of its length, registers again if the lease was lost (the agent's Redis
forgot it, or renewals failed for longer than the lease), and deregisters on exit. Other languages
do the same with the subjects and messages in schemas/metrics.py.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence
from typing import Any

from nats.aio.client import Client

from bus.client import BusClient
from bus.codec import decoder
from bus.tasks import cancel_and_wait
from schemas.errors import BusError
from schemas.metric_scopes import MetricValue, PodRef
from schemas.metrics import (
    Deregistered,
    Entries,
    Lease,
    MetricEvent,
    MetricRef,
    Synced,
    event_subject,
)

log = logging.getLogger("berth.metrics.client")

_event = decoder(MetricEvent)


def _present(**fields: Any) -> dict[str, Any]:
    """The optional fields that were given (the wire leaves absent ones out, it has no null)."""
    return {name: value for name, value in fields.items() if value is not None}


class MetricsClient:
    def __init__(self, nc: Client, node: str, *, prefix: str = "berth", timeout: float = 5.0) -> None:
        self.nc = nc
        self.node = node
        self.prefix = prefix
        self.bus = BusClient(nc, prefix=prefix, timeout=timeout)

    async def _call(self, command: str, payload: dict[str, Any], reply: type):
        return await self.bus.request(f"metrics.{self.node}.{command}", payload, reply)

    async def get(self, scope: str, metric: str, **ids: Any) -> MetricValue:
        return await self._call("get", {"scope": scope, "metric": metric, **ids}, MetricValue)

    async def aggregate(
        self, kind: str, agg: str, metric: str, *, pods: Sequence[PodRef] = (), numa_id: int | None = None,
        cpuset: str | None = None,
    ) -> MetricValue:
        optional = _present(numa_id=numa_id, cpuset=cpuset)
        payload = {"kind": kind, "agg": agg, "metric": metric, "pods": list(pods), **optional}
        return await self._call("aggregate", payload, MetricValue)

    async def put(
        self, scope: str, metric: str, value: float, *, time: float | None = None,
        ttl_seconds: float | None = None, request_id: str | None = None, **ids: Any,
    ) -> MetricValue:
        optional = _present(time=time, ttl_seconds=ttl_seconds, request_id=request_id)
        payload = {"scope": scope, "metric": metric, "value": value, **ids, **optional}
        return await self._call("put", payload, MetricValue)

    async def list(self, scope: str | None = None, *, offset: int = 0, limit: int = 1000) -> Entries:
        return await self._call("list", {"offset": offset, "limit": limit, **_present(scope=scope)}, Entries)

    async def has_synced(self) -> Synced:
        return await self._call("has-synced", {}, Synced)

    async def register(
        self, scope: str, metric: str, *, lease_seconds: float | None = None, request_id: str | None = None,
        **ids: Any,
    ) -> Lease:
        optional = _present(lease_seconds=lease_seconds, request_id=request_id)
        payload = {"scope": scope, "metric": metric, **ids, **optional}
        return await self._call("register-notifier", payload, Lease)

    async def renew(self, key: str, *, request_id: str | None = None) -> Lease:
        return await self._call("renew-notifier", {"key": key, **_present(request_id=request_id)}, Lease)

    async def deregister(self, key: str, *, request_id: str | None = None) -> bool:
        payload = {"key": key, **_present(request_id=request_id)}
        return (await self._call("deregister-notifier", payload, Deregistered)).removed

    def watch(self, scope: str, metric: str, *, lease_seconds: float | None = None, **ids: Any) -> "Watch":
        """The metric's events while the `async with` block runs."""
        return Watch(self, MetricRef(scope=scope, metric=metric, **ids), lease_seconds)


class Watch:
    """A registration, its subscription and its renewals; iterate it for `MetricEvent`s."""

    def __init__(self, client: MetricsClient, ref: MetricRef, lease_seconds: float | None) -> None:
        self.client = client
        self.ref = ref
        self.lease_seconds = lease_seconds
        self.lease: Lease | None = None
        self._sub = None
        self._renewer: asyncio.Task | None = None

    async def __aenter__(self) -> "Watch":
        nc = self.client.nc
        self._sub = await nc.subscribe(event_subject(self.client.prefix, self.client.node, self.ref))
        await nc.flush()  # the server has the subscription before the agent can publish
        self.lease = await self._register()
        self._renewer = asyncio.create_task(self._renew_forever())
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await cancel_and_wait(self._renewer)
        try:
            await self.client.deregister(self.lease.key)
        except BusError as error:  # the agent is gone: the lease ends by itself
            log.warning("deregistering %s: %r", self.lease.key, error)
        await self._sub.unsubscribe()

    def __aiter__(self) -> AsyncIterator[MetricEvent]:
        return self._events()

    async def _events(self) -> AsyncIterator[MetricEvent]:
        async for msg in self._sub.messages:
            yield _event(msg.data)

    async def next(self, timeout: float) -> MetricEvent:
        """The next event; nats' TimeoutError if none comes within `timeout` seconds."""
        return _event((await self._sub.next_msg(timeout=timeout)).data)

    async def _register(self) -> Lease:
        return await self.client.register(
            self.ref.scope, self.ref.metric, lease_seconds=self.lease_seconds, **self.ref.ids()
        )

    async def _renew_forever(self) -> None:
        while True:
            await asyncio.sleep(self.lease.lease_seconds / 3)
            try:
                self.lease = await self.client.renew(self.lease.key)
            except BusError as error:
                if error.code != "notifier_not_found":
                    log.warning("renewing %s: %r (retrying)", self.lease.key, error)
                    continue
                log.warning("notifier %s was lost; registering again", self.lease.key)
                try:
                    self.lease = await self._register()
                except BusError as again:
                    log.warning("registering again: %r (retrying)", again)
