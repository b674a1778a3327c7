"""The metrics service's transport: which command answers on which subject, and how.

Every command is `metrics.<node>.<command>` below the prefix, so each node's agent answers for its
own node only. Handlers translate between the wire Structs and the store, agent and notifier,
which do the work.
"""

from __future__ import annotations

from msgspec import UNSET

from bus.callers import Role
from bus.events import StreamSpec
from bus.failpoints import failpoint
from bus.service import Command
from schemas.common import Empty
from services.metrics.agent import Agent
from services.metrics.messages import (
    EVENT_PATTERN,
    Aggregate,
    Deregistered,
    Entries,
    Entry,
    Get,
    Lease,
    ListMetrics,
    MetricEvent,
    NotifierRequest,
    Put,
    RegisterNotifier,
    Synced,
)
from services.metrics.notifier import Notifier
from services.metrics.put_times import PutTimes
from services.metrics.store import MetricValue, Store


def commands(node: str) -> list[Command]:
    """The commands of one node's agent (`node` is "<node>" in the exported schema)."""
    group = f"metrics.{node}"
    return [
        Command(f"{group}.get", Get, MetricValue, "get"),
        Command(f"{group}.aggregate", Aggregate, MetricValue, "aggregate"),
        # Every agent of the node keeps its own store, so every one of them must receive a put (and
        # each keeps its own answers to request ids: see `Service._idempotency_scope`).
        Command(f"{group}.put", Put, MetricValue, "put", idempotent=True, broadcast=True),
        Command(f"{group}.register-notifier", RegisterNotifier, Lease, "register_notifier", idempotent=True,
                role=Role.READER),
        Command(f"{group}.renew-notifier", NotifierRequest, Lease, "renew_notifier", idempotent=True,
                role=Role.READER),
        Command(
            f"{group}.deregister-notifier", NotifierRequest, Deregistered, "deregister_notifier", idempotent=True,
            role=Role.READER,
        ),
        Command(f"{group}.has-synced", Empty, Synced, "has_synced"),
        Command(f"{group}.list", ListMetrics, Entries, "list"),
    ]


COMMANDS = commands("<node>")
EVENTS = {EVENT_PATTERN: MetricEvent}
# A watched metric publishes a sample a second: samples get a stream of their own, kept an hour and
# at most 600 per metric (ten minutes at 1 s), so they never crowd out the day of change events.
STREAM = StreamSpec("metrics", ("metrics.>",), max_age=3600, max_bytes=256 << 20, max_msgs_per_subject=600)


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
