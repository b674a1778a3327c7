"""The broker worker: `berth worker broker` runs this module (see services/runner.py)."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field, fields

from nats.aio.client import Client
from redis.asyncio import Redis

from bus.client import BusClient
from bus.events import EventBus
from bus.idempotency import IdempotencyStore
from bus.service import Service
from bus.telemetry import on_scrape
from services.allocation.quantity import parse_size
from services.broker.brokers import BrokerRegistry
from services.broker.config import InstanceTypes, Timing
from services.broker.endpoints import COMMANDS, EVENTS, STREAM
from services.broker.endpoints import BrokerEndpoints as Endpoints
from services.broker.operators.allocation import AllocationOperator
from services.broker.operators.base import Operator
from services.broker.operators.process import ProcessOperator, ProcessTable
from services.broker.pools import PoolKeeper
from services.broker.publisher import Publisher
from services.broker.replica import Replica
from services.broker.resources import BrokerResources as ResourceManager
from services.broker.store import BrokerStore
from services.broker.telemetry import PoolSizes

NAME = "broker"
__all__ = ["COMMANDS", "EVENTS", "NAME", "STREAM", "Settings", "add_arguments", "build", "make_broker"]


@dataclass(frozen=True)
class Settings:
    operator: str = "process"
    max_instances: int = 64
    namespace: str = ""
    cpu_per_instance: float = 1.0
    mem_per_instance: int = 1 << 30
    instance_types: str = "[]"
    stop_grace: float = 5.0
    probe_timeout: float = 0.5
    workdir: str | None = None
    city_label: str = "city"
    platform_label: str = "platform"
    bind_cpus: bool = True
    placement: str = "spread"
    allocation_timeout: float = 10.0
    timing: Timing = field(default_factory=Timing)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    env = os.environ.get
    parser.add_argument(
        "--operator",
        choices=["process", "allocation"],
        default=env("BERTH_BROKER_OPERATOR", "process"),
        help="where instances run (env BERTH_BROKER_OPERATOR)",
    )
    parser.add_argument(
        "--max-instances",
        type=int,
        default=int(env("BERTH_BROKER_MAX_INSTANCES", "64")),
        help="process operator: instances it runs at most",
    )
    parser.add_argument(
        "--namespace",
        default=env("BERTH_BROKER_NAMESPACE", ""),
        help="answer of get-namespace (default: the user)",
    )
    parser.add_argument("--cpu-per-instance", type=float, default=1.0, help="default instance type: CPUs")
    parser.add_argument(
        "--mem-per-instance", default="1G", help="default instance type: memory (bytes or 1G, 512M...)"
    )
    parser.add_argument(
        "--instance-types",
        default=env("BERTH_BROKER_INSTANCE_TYPES", "[]"),
        help='JSON list of {"platform", "group", "cpu_per_instance", "mem_per_instance"}',
    )
    parser.add_argument(
        "--stop-grace", type=float, default=5.0, help="seconds between SIGTERM and SIGKILL on release"
    )
    parser.add_argument("--probe-timeout", type=float, default=0.5, help="TCP readiness probe timeout")
    parser.add_argument("--workdir", default=None, help="working directory of launched processes")
    parser.add_argument(
        "--city-label", default="city", help="allocation operator: node label holding the city"
    )
    parser.add_argument(
        "--platform-label", default="platform", help="allocation operator: node label holding the platform"
    )
    parser.add_argument(
        "--no-bind-cpus",
        dest="bind_cpus",
        action="store_false",
        help="allocation operator: do not ask for bound CPUs (no pinning)",
    )
    parser.add_argument(
        "--placement",
        choices=["spread", "pack"],
        default="spread",
        help="allocation operator: how instances are spread over nodes",
    )
    parser.add_argument(
        "--allocation-timeout", type=float, default=10.0, help="allocation operator: request timeout"
    )
    defaults = Timing()
    for timing in fields(Timing):
        parser.add_argument(
            f"--{timing.name.replace('_', '-')}",
            dest=timing.name,
            type=float,
            default=getattr(defaults, timing.name),
            help="seconds (see services/broker/config.py)",
        )


def settings_from(args: argparse.Namespace) -> Settings:
    timing = Timing(**{f.name: getattr(args, f.name) for f in fields(Timing)})
    return Settings(
        operator=args.operator,
        max_instances=args.max_instances,
        namespace=args.namespace,
        cpu_per_instance=args.cpu_per_instance,
        mem_per_instance=parse_size(args.mem_per_instance, "--mem-per-instance"),
        instance_types=args.instance_types,
        stop_grace=args.stop_grace,
        probe_timeout=args.probe_timeout,
        workdir=args.workdir,
        city_label=args.city_label,
        platform_label=args.platform_label,
        bind_cpus=args.bind_cpus,
        placement=args.placement,
        allocation_timeout=args.allocation_timeout,
        timing=timing,
    )


def make_operator(
    settings: Settings, redis: Redis, nc: Client, prefix: str, types: InstanceTypes
) -> Operator:
    processes = ProcessOperator(
        ProcessTable(redis, prefix),
        prefix=prefix,
        max_instances=settings.max_instances,
        stop_grace=settings.stop_grace,
        probe_timeout=settings.probe_timeout,
        workdir=settings.workdir,
    )
    if settings.operator == "process":
        return processes
    return AllocationOperator(
        processes,
        BusClient(nc, prefix=prefix, timeout=settings.allocation_timeout),
        types,
        city_label=settings.city_label,
        platform_label=settings.platform_label,
        bind_cpus=settings.bind_cpus,
        placement=settings.placement,
    )


def make_broker(
    settings: Settings, *, redis: Redis, nc: Client, events: EventBus, prefix: str, concurrency: int = 64
) -> tuple[Service, Replica]:
    """The service (not started) and its background work (not started)."""
    types = InstanceTypes.parse(settings.cpu_per_instance, settings.mem_per_instance, settings.instance_types)
    store = BrokerStore(redis, prefix)
    publisher = Publisher(events)
    operator = make_operator(settings, redis, nc, prefix, types)
    manager = ResourceManager(store, operator, BrokerRegistry(store, publisher), publisher, settings.timing)
    keeper = PoolKeeper(manager)
    service = Service(
        f"{prefix}-broker",
        prefix=prefix,
        concurrency=concurrency,
        idempotency=IdempotencyStore(redis, prefix=prefix),
        description="resources on an operator and warm pools of them (crm broker)",
    )
    service.bind(COMMANDS, Endpoints(manager, keeper, types, settings.namespace))
    return service, Replica(manager, keeper, settings.timing)


async def build(ctx) -> Service:
    service, replica = make_broker(
        settings_from(ctx.args),
        redis=ctx.redis,
        nc=ctx.nc,
        events=ctx.events,
        prefix=ctx.prefix,
        concurrency=ctx.args.concurrency,
    )
    replica.start()
    ctx.cleanups.append(replica.stop)
    pools = PoolSizes(BrokerStore(ctx.redis, ctx.prefix))
    ctx.cleanups.append(on_scrape("broker pools", pools.refresh, every=ctx.args.metrics_refresh))
    return service
