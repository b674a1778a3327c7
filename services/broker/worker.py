"""The broker worker: `berth worker broker` runs this module (see bus/runner.py)."""

from __future__ import annotations

from nats.aio.client import Client
from redis.asyncio import Redis

from bus.client import BusClient
from bus.events import EventBus
from bus.idempotency import DEFAULT_WINDOW, IdempotencyStore
from bus.service import Service
from bus.telemetry import on_scrape
from services.broker.brokers import BrokerRegistry
from services.broker.commands import COMMANDS, EVENTS, STREAM
from services.broker.config import BrokerServiceConfig, InstanceTypes
from services.broker.endpoints import BrokerEndpoints, for_callers
from services.broker.failover import Failover
from services.broker.operators.allocation import AllocationOperator
from services.broker.operators.allocation_store import PlacementTable
from services.broker.operators.base import Operator
from services.broker.operators.process import ProcessOperator
from services.broker.operators.process_store import ProcessTable
from services.broker.pools import PoolKeeper
from services.broker.publisher import Publisher
from services.broker.replica import Replica
from services.broker.resources import BrokerResources
from services.broker.store import BrokerStore
from services.broker.telemetry import PoolSizes
from services.processes.catalog import Catalog, CatalogError

NAME = "broker"
CONFIG = BrokerServiceConfig
__all__ = ["COMMANDS", "CONFIG", "EVENTS", "NAME", "STREAM", "build", "make_broker"]


def make_operator(
    settings: BrokerServiceConfig, redis: Redis, nc: Client, prefix: str, types: InstanceTypes
) -> Operator:
    catalog = Catalog.load(settings.catalog)
    if settings.operator == "process":
        return ProcessOperator(
            ProcessTable(redis, prefix),
            prefix=prefix,
            max_instances=settings.max_instances,
            stop_grace=settings.stop_grace,
            probe_timeout=settings.probe_timeout,
            workdir=settings.workdir,
            catalog=catalog,
        )
    return AllocationOperator(
        PlacementTable(redis, prefix),
        BusClient(nc, prefix=prefix, timeout=settings.allocation_timeout),
        types,
        catalog=catalog,
        city_label=settings.city_label,
        platform_label=settings.platform_label,
        bind_cpus=settings.bind_cpus,
        placement=settings.placement,
        agent_timeout=settings.allocation_timeout,
    )


def make_broker(
    settings: BrokerServiceConfig, *, redis: Redis, nc: Client, events: EventBus, prefix: str, concurrency: int = 64,
    window: float = DEFAULT_WINDOW,
) -> tuple[Service, Replica]:
    """The service (not started) and its background work (not started)."""
    types = InstanceTypes.parse(settings.cpu_per_instance, settings.mem_per_instance, settings.instance_types)
    store = BrokerStore(redis, prefix, events, released_seconds=window)
    publisher = Publisher(events)
    operator = make_operator(settings, redis, nc, prefix, types)
    resources = BrokerResources(store, operator, BrokerRegistry(store, publisher), publisher, settings.timing)
    keeper = PoolKeeper(resources)
    service = Service(
        f"{prefix}-broker",
        prefix=prefix,
        concurrency=concurrency,
        idempotency=IdempotencyStore(redis, prefix=prefix, window=window),
        description="resources on an operator and warm pools of them (crm broker)",
    )
    service.bind(COMMANDS, for_callers(BrokerEndpoints(resources, keeper, types, settings.namespace)))
    failover = None
    if isinstance(operator, AllocationOperator):  # its instances run on agents, whose events it follows
        failover = Failover(events, operator, keeper, queue=f"{prefix}-broker")
    return service, Replica(resources, keeper, settings.timing, failover)


async def build(ctx) -> Service:
    """`ctx.config`: the frozen `services.broker.config.BrokerServiceConfig`."""
    try:
        service, replica = make_broker(
            ctx.config,
            redis=ctx.redis,
            nc=ctx.nc,
            events=ctx.events,
            prefix=ctx.prefix,
            concurrency=ctx.common.concurrency,
            window=ctx.common.idempotency_window,
        )
    except CatalogError as error:
        raise SystemExit(str(error)) from None
    await replica.start()
    ctx.cleanups.append(replica.stop)
    pools = PoolSizes(BrokerStore(ctx.redis, ctx.prefix))
    ctx.cleanups.append(on_scrape("broker pools", pools.refresh, every=ctx.common.metrics_refresh))
    return service
