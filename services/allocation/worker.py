"""The allocation worker: `berth worker allocation` runs this module (see bus/runner.py)."""

from __future__ import annotations

from bus.idempotency import IdempotencyStore
from bus.replicas import ReplicaWait
from bus.service import Service
from bus.telemetry import on_scrape
from services.allocation.commands import (
    COMMANDS,
    EVENTS,
    MANAGER_COMMANDS,
    PLUGIN_NAMES,
    STREAM,
    plugin_commands,
)
from services.allocation.config import AllocationServiceConfig
from services.allocation.endpoints import AllocationEndpoints
from services.allocation.manager import AllocationManager
from services.allocation.plugins.cpumem import CpuMemPlugin
from services.allocation.plugins.gpu import GpuPlugin
from services.allocation.plugins.interface import ResourcePlugin
from services.allocation.plugins.storage import StoragePlugin
from services.allocation.store import NodeStore
from services.allocation.telemetry import NodeTotals
from services.allocation.view import SpreadSample

NAME = "allocation"
CONFIG = AllocationServiceConfig
__all__ = ["NAME", "COMMANDS", "CONFIG", "EVENTS", "STREAM", "build", "make_service"]


def make_plugins(share_base: int = 100, max_share: int = -1, max_deploy_count: int = 10000) -> dict[str, ResourcePlugin]:
    plugins: list[ResourcePlugin] = [
        CpuMemPlugin(share_base=share_base, max_share=max_share, max_deploy_count=max_deploy_count),
        StoragePlugin(max_deploy_count=max_deploy_count),
        GpuPlugin(),
    ]
    assert tuple(p.name for p in plugins) == PLUGIN_NAMES
    return {p.name: p for p in plugins}


def make_service(
    manager: AllocationManager, prefix: str, idempotency: IdempotencyStore, concurrency: int = 64,
    max_payload: int = 1 << 20, replicas: ReplicaWait | None = None, max_deploy_count: int = 10000,
) -> Service:
    service = Service(
        f"{prefix}-allocation", prefix=prefix, concurrency=concurrency, idempotency=idempotency, replicas=replicas,
        description="node capacity, CPU/NUMA, memory, volume and GPU allocation (eru resource plugins)",
    )
    bounds = {"max_payload": max_payload, "max_deploy_count": max_deploy_count}
    service.bind(MANAGER_COMMANDS, AllocationEndpoints(manager, **bounds))
    for plugin in manager.plugins:
        service.bind(plugin_commands(plugin), AllocationEndpoints(manager, plugin, **bounds))
    return service


async def build(ctx) -> Service:
    """`ctx.config`: the frozen `services.allocation.config.AllocationServiceConfig`."""
    config = ctx.config
    plugins = make_plugins(config.share_base, config.max_share, config.max_deploy_count)
    manager = AllocationManager(
        NodeStore(ctx.redis, ctx.prefix), plugins, ctx.events, spread_sample=SpreadSample(config.spread_sample)
    )
    await manager.watch(lease_interval=config.lease_interval)
    ctx.cleanups.append(manager.unwatch)
    ctx.cleanups.append(on_scrape("allocation totals", NodeTotals(manager).refresh, every=ctx.common.metrics_refresh))
    replicas = None
    if config.wait_replicas:  # durable answers: commits and kept answers on replicas first (bus/replicas.py)
        replicas = ReplicaWait(ctx.redis, manager.store.base, config.wait_replicas, config.wait_timeout_ms)
    idempotency = IdempotencyStore(
        ctx.redis, prefix=ctx.prefix, replicas=replicas, window=ctx.common.idempotency_window
    )
    return make_service(
        manager, ctx.prefix, idempotency, ctx.common.concurrency, ctx.nc.max_payload, replicas, config.max_deploy_count
    )
