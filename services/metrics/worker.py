"""The metrics agent: `berth worker metrics` runs this module (see services/runner.py).

One agent per node samples the kernel, keeps the latest values in memory, answers
`<prefix>.metrics.<node>.<command>` and publishes change events. More agents on one node share the
notifier registrations (Redis) and each answers reads from its own samples; one of them publishes.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os
import re
import socket
import time
from collections.abc import Callable, Sequence

import msgspec
from nats.aio.client import Client
from redis.asyncio import Redis

from bus.idempotency import IdempotencyStore
from bus.service import Service
from bus.subjects import NAME_CHARS, NAME_PATTERN
from bus.tasks import cancel_and_wait
from bus.telemetry import on_scrape
from services.metrics.agent import Agent
from services.metrics.endpoints import COMMANDS, EVENTS, STREAM, MetricsEndpoints, commands
from services.metrics.notifier import Notifier, Publishing, Registrations
from services.metrics.provisioners import PROVISIONERS, CgroupProvisioner, Provisioner
from services.metrics.store import Store
from services.metrics.telemetry import RegistrationCount

NAME = "metrics"
__all__ = ["NAME", "COMMANDS", "EVENTS", "STREAM", "add_arguments", "build", "MetricsWorker", "Options"]

log = logging.getLogger("berth.metrics")

MIN_INTERVAL = 1.0
PROVISIONER_NAMES = tuple(p.name for p in PROVISIONERS)


class Options(msgspec.Struct, kw_only=True):
    node: str
    interval: float = 5.0
    provisioner_intervals: dict[str, float] = {}  # provisioner name -> seconds, overrides `interval`
    cgroup_paths: list[str] = []  # cgroups to sample besides the discovered ones
    insurance_seconds: float = 0.0  # 0: no staleness check; else at least 60 (katalyst's rule)
    notifier_lease: float = 30.0  # seconds a notifier registration lives unless renewed


def make_provisioners(options: Options) -> list[Provisioner]:
    def interval(cls: type[Provisioner]) -> float:
        return options.provisioner_intervals.get(cls.name, options.interval)

    return [
        cls(interval=interval(cls), cgroup_paths=options.cgroup_paths) if cls is CgroupProvisioner
        else cls(interval=interval(cls))
        for cls in PROVISIONERS
    ]


class MetricsWorker:
    """The agent's parts wired together: store, sampling loop, notifier and bus service."""

    def __init__(
        self,
        nc: Client,
        redis: Redis,
        prefix: str,
        options: Options,
        *,
        provisioners: Sequence[Provisioner] | None = None,
        concurrency: int = 64,
        clock: Callable[[], float] = time.time,
    ) -> None:
        node = options.node
        self.store = Store(options.insurance_seconds, clock)  # `clock`: the store's unix time (tests)
        self.agent = Agent(self.store, make_provisioners(options) if provisioners is None else provisioners)
        self.notifier = Notifier(
            nc, Registrations(redis, prefix, node), Publishing(redis, prefix, node), self.store,
            prefix=prefix, node=node, default_lease_seconds=options.notifier_lease,
        )
        self.agent.on_round(self.notifier.wake)
        self.service = Service(
            f"{prefix}-metrics", prefix=prefix, concurrency=concurrency,
            idempotency=IdempotencyStore(redis, prefix=prefix), metadata={"node": node},
            description="node, NUMA, CPU, device, NIC, container and cgroup metrics; reads and change events",
        )
        self.service.bind(
            commands(node), MetricsEndpoints(self.store, self.agent, self.notifier, options.interval)
        )
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


# -- command line ---------------------------------------------------------------------------------


def default_node() -> str:
    """The host name's first label, with any character a subject token cannot hold made a '-'."""
    return re.sub(f"[^{NAME_CHARS}]", "-", socket.gethostname().split(".")[0]) or "node"


def _node(text: str) -> str:
    if not NAME_PATTERN.match(text):
        raise argparse.ArgumentTypeError(f"{text!r} must match [A-Za-z0-9_-]+ (it is a subject token)")
    return text


def _seconds(minimum: float, maximum: float = math.inf) -> Callable[[str], float]:
    """An argparse type: a number of seconds within [minimum, maximum]."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
        if not minimum <= value <= maximum:  # also refuses NaN
            raise argparse.ArgumentTypeError(f"{text} s is not within [{minimum:g}, {maximum:g}] s")
        return value

    return parse


def _provisioner_interval(text: str) -> tuple[str, float]:
    name, sep, seconds = text.partition("=")
    if not sep or name not in PROVISIONER_NAMES:
        names = ", ".join(PROVISIONER_NAMES)
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME=SECONDS, NAME one of {names}")
    return name, _seconds(MIN_INTERVAL)(seconds)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    env = os.environ.get
    names = ", ".join(PROVISIONER_NAMES)
    parser.add_argument(
        "--node", type=_node, default=env("BERTH_NODE") or default_node(),
        help="this node's name in subjects (env BERTH_NODE; default: the host name)",
    )
    parser.add_argument(
        "--interval", type=_seconds(MIN_INTERVAL), default=float(env("BERTH_METRICS_INTERVAL", "5")),
        help="seconds between rounds of each provisioner, at least 1 (env BERTH_METRICS_INTERVAL)",
    )
    parser.add_argument(
        "--provisioner-interval", type=_provisioner_interval, action="append", default=[],
        metavar="NAME=SECONDS", help=f"one provisioner's interval, repeatable ({names})",
    )
    parser.add_argument(
        "--cgroup-path", action="append", default=[], metavar="PATH",
        help="a cgroup to sample besides the discovered ones (relative to the hierarchy root), repeatable",
    )
    parser.add_argument(
        "--insurance-seconds", type=_seconds(0), default=0.0,
        help="reads of values older than this answer metric_expired (0: off; else at least 60)",
    )
    parser.add_argument(
        "--notifier-lease", type=_seconds(1, 3600), default=30.0,
        help="seconds a notifier registration lives unless renewed, when it asks for no lease",
    )


def options_from(args: argparse.Namespace) -> Options:
    return Options(
        node=args.node,
        interval=args.interval,
        provisioner_intervals=dict(args.provisioner_interval),
        cgroup_paths=args.cgroup_path,
        insurance_seconds=args.insurance_seconds,
        notifier_lease=args.notifier_lease,
    )


async def build(ctx) -> Service:
    options = options_from(ctx.args)
    worker = MetricsWorker(ctx.nc, ctx.redis, ctx.prefix, options, concurrency=ctx.args.concurrency)
    worker.start()
    ctx.cleanups.append(worker.stop)
    count = RegistrationCount(worker.notifier.registrations, options.node)
    ctx.cleanups.append(on_scrape("metrics registrations", count.refresh, every=ctx.args.metrics_refresh))
    return worker.service
