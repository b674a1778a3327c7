"""The metrics service's transport: which command answers on which subject, and how.

Every command is `metrics.<node>.<command>` below the prefix, so each node's agent answers for its
own node only. Handlers translate between the wire Structs and the store, agent and notifier,
which do the work.
"""

from __future__ import annotations

from msgspec import UNSET

from bus import outcome
from bus.failpoints import failpoint
from schemas.common import Empty
from schemas.metrics import (
    Aggregate,
    Deregistered,
    Entries,
    Entry,
    Get,
    Lease,
    ListMetrics,
    NotifierRequest,
    Put,
    RegisterNotifier,
    Synced,
)
from services.metrics.agent import Agent
from services.metrics.notifier import Notifier
from services.metrics.notifier_store import PutTimes
from services.metrics.store import MetricValue, Store




def _given(value):
    """An optional field's value, None when it was left out."""
    return None if value is UNSET else value


class MetricsEndpoints:
    def __init__(
        self, store: Store, agent: Agent, notifier: Notifier, put_times: PutTimes, interval_seconds: float
    ) -> None:
        self.store = store
        self.put_times = put_times
        self.agent = agent
        self.notifier = notifier
        self.interval_seconds = interval_seconds

    async def get(self, req: Get) -> MetricValue:
        return self.store.get(req.scope, req.metric, req.ids())

    async def aggregate(self, req: Aggregate) -> MetricValue:
        return self.store.aggregate(
            req.kind, req.agg, req.metric, req.pods, _given(req.numa_id), _given(req.cpuset)
        )

    async def put(self, req: Put) -> MetricValue:
        sample_time = _given(req.time)
        if sample_time is None and req.request_id:  # the same time on every agent and every retry
            sample_time = await self.put_times.first(req.request_id, self.store.now())
        value = self.store.put(
            req.scope, req.metric, req.value, req.ids(), sample_time, _given(req.ttl_seconds)
        )
        outcome.changed()
        failpoint("after-commit")  # stored in this agent's memory, not yet announced or answered
        self.notifier.wake()
        return value

    async def register_notifier(self, req: RegisterNotifier) -> Lease:
        return await self.notifier.register(req, _given(req.lease_seconds))

    async def renew_notifier(self, req: NotifierRequest) -> Lease:
        return await self.notifier.renew(req.key)

    async def deregister_notifier(self, req: NotifierRequest) -> Deregistered:
        return Deregistered(await self.notifier.deregister(req.key))

    async def has_synced(self, req: Empty) -> Synced:
        return Synced(self.agent.synced, self.agent.failed, self.interval_seconds)

    async def list(self, req: ListMetrics) -> Entries:
        entries = self.store.list(_given(req.scope))
        page = entries[req.offset : req.offset + req.limit]
        return Entries(
            [Entry(scope=e.scope, metric=e.metric, value=e.value, time=e.time, **e.ids) for e in page],
            len(entries),
        )
