"""The metrics agent: `berth worker metrics` runs this module (see bus/runner.py).

One agent per node samples the kernel, keeps the latest values in memory, answers
`<prefix>.metrics.<node>.<command>` and publishes change events. More agents on one node share the
notifier registrations (Redis) and each answers reads from its own samples; one of them publishes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping, Sequence

from nats.aio.client import Client
from redis.asyncio import Redis

from bus.idempotency import DEFAULT_WINDOW, IdempotencyStore
from bus.service import Service
from bus.tasks import cancel_and_wait
from bus.telemetry import on_scrape
from services.metrics.agent import Agent
from services.metrics.cgroups import PodCgroups
from services.metrics.commands import COMMANDS, EVENTS, STREAM, commands
from services.metrics.config import MetricsServiceConfig
from services.metrics.endpoints import MetricsEndpoints
from services.metrics.notifier import Notifier
from services.metrics.notifier_store import Publishing, PutTimes, Registrations
from services.metrics.provisioners import PROVISIONERS, CgroupProvisioner, Provisioner
from services.metrics.provisioners.base import Roots
from services.metrics.store import Store
from services.metrics.telemetry import RegistrationCount

NAME = "metrics"
CONFIG = MetricsServiceConfig
__all__ = ["NAME", "COMMANDS", "CONFIG", "EVENTS", "STREAM", "build", "MetricsWorker"]

log = logging.getLogger("berth.metrics")


def make_provisioners(
    options: MetricsServiceConfig, pods: Mapping[str, PodCgroups] | None = None
) -> list[Provisioner]:
    """`pods`: pods a launcher on this host names (see `CgroupProvisioner`)."""
    roots = Roots.under(options.root)

    def interval(cls: type[Provisioner]) -> float:
        return options.provisioner_intervals.get(cls.name, options.interval)

    return [
        cls(roots, interval=interval(cls), cgroup_paths=options.cgroup_paths, pods=pods) if cls is CgroupProvisioner
        else cls(roots, interval=interval(cls))
        for cls in PROVISIONERS
    ]


class MetricsWorker:
    """The agent's parts wired together: store, sampling loop, notifier and bus service."""

    def __init__(
        self,
        nc: Client,
        redis: Redis,
        prefix: str,
        options: MetricsServiceConfig,
        *,
        provisioners: Sequence[Provisioner] | None = None,
        pods: Mapping[str, PodCgroups] | None = None,
        concurrency: int = 64,
        clock: Callable[[], float] = time.time,
        window: float = DEFAULT_WINDOW,
    ) -> None:
        node = options.node
        self.store = Store(options.insurance_seconds, clock)  # `clock`: the store's unix time (tests)
        self.agent = Agent(self.store, make_provisioners(options, pods) if provisioners is None else provisioners)
        self.notifier = Notifier(
            nc, Registrations(redis, prefix, node), Publishing(redis, prefix, node), self.store,
            prefix=prefix, node=node, default_lease_seconds=options.notifier_lease,
            max_registrations=options.max_notifiers,
        )
        self.agent.on_round(self.notifier.wake)
        self.service = Service(
            f"{prefix}-metrics", prefix=prefix, concurrency=concurrency,
            idempotency=IdempotencyStore(redis, prefix=prefix, window=window), metadata={"node": node},
            description="node, NUMA, CPU, device, NIC, container and cgroup metrics; reads and change events",
        )
        endpoints = MetricsEndpoints(
            self.store, self.agent, self.notifier, PutTimes(redis, prefix, node), options.interval
        )
        self.service.bind(commands(node), endpoints)
        self._tasks: list[asyncio.Task] = []

    def start(self) -> None:
        """Start sampling and publishing in the background (the service is started separately)."""
        # Flat tasks, no task group: each can be cancelled again should one swallow a cancellation.
        loops = (self.agent.run(), self.notifier.keep_synced(), self.notifier.publish_when_woken())
        self._tasks = [asyncio.create_task(loop) for loop in loops]
        for task in self._tasks:
            task.add_done_callback(_report_crash)

    async def stop(self) -> None:
        await cancel_and_wait(*self._tasks)
        await self.notifier.close()


def _report_crash(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("metrics background task died", exc_info=task.exception())


async def build(ctx) -> Service:
    """`ctx.config`: the frozen `services.metrics.config.MetricsServiceConfig`."""
    options = ctx.config
    worker = MetricsWorker(ctx.nc, ctx.redis, ctx.prefix, options, concurrency=ctx.common.concurrency,
                           window=ctx.common.idempotency_window)
    worker.start()
    ctx.cleanups.append(worker.stop)
    count = RegistrationCount(worker.notifier.registrations, options.node)
    ctx.cleanups.append(on_scrape("metrics registrations", count.refresh, every=ctx.common.metrics_refresh))
    return worker.service
