"""The agent: `berth agent` (or `berth worker agent`) runs this module, one process per host (see
bus/runner.py). It serves `<prefix>.agent.<node>.<command>` and, in the same process, its
node's metrics (`<prefix>.metrics.<node>.<command>`, with a pod per instance it launched)."""

from __future__ import annotations

import logging
from pathlib import Path

from bus.client import BusClient
from bus.service import Service
from services.agent.cgroups import CgroupRoot
from services.agent.commands import COMMANDS, EVENTS, STREAM, commands
from services.agent.config import AgentServiceConfig
from services.agent.endpoints import AgentEndpoints
from services.agent.host import HostUnreadable
from services.agent.host_agent import HostAgent
from services.agent.instances import Instances, StateLocked
from services.metrics.commands import STREAM as METRICS_STREAM
from services.metrics.worker import MetricsWorker
from services.processes.catalog import Catalog, CatalogError

NAME = "agent"
NODE_SCOPED = True  # runs as its node's identity (berth/accounts.py `agent_permissions`)
CONFIG = AgentServiceConfig
__all__ = ["COMMANDS", "CONFIG", "EVENTS", "NAME", "NODE_SCOPED", "STREAM", "build", "make_agent"]

log = logging.getLogger("berth.agent")


def make_agent(config: AgentServiceConfig, *, nc, events, prefix: str, concurrency: int = 64) -> tuple[Service, HostAgent]:
    """The agent's service (not started) and the agent behind it (not opened)."""
    instances = Instances(
        state_dir=Path(config.state), catalog=Catalog.load(config.catalog), node=config.node, prefix=prefix,
        address=config.address, cgroups=CgroupRoot(parent=config.cgroup_parent) if config.cgroups else None,
        stop_grace=config.stop_grace, probe_timeout=config.probe_timeout,
    )
    agent = HostAgent(config, instances, BusClient(nc, prefix=prefix, timeout=10.0), events)
    instances.on_event = agent.on_instance
    service = Service(
        f"{prefix}-agent", prefix=prefix, concurrency=concurrency, metadata={"node": config.node},
        description="one host's agent: registration, lease, the instances placed on it",
    )
    service.bind(commands(config.node), AgentEndpoints(agent))
    return service, agent


async def build(ctx) -> list[Service]:
    """`ctx.config`: the frozen `services.agent.config.AgentServiceConfig`. Serves the agent and its
    node's metrics."""
    config: AgentServiceConfig = ctx.config
    try:
        service, agent = make_agent(config, nc=ctx.nc, events=ctx.events, prefix=ctx.prefix,
                                    concurrency=ctx.common.concurrency)
    except CatalogError as error:
        raise SystemExit(str(error)) from None
    await ctx.events.ensure_stream(METRICS_STREAM, memory=ctx.common.memory_stream,
                                   create=ctx.common.js_domain is None)
    metrics = MetricsWorker(ctx.nc, ctx.redis, ctx.prefix, config.metrics, pods=agent.pods,
                            concurrency=ctx.common.concurrency, window=ctx.common.idempotency_window)
    try:
        await agent.open()
    except (StateLocked, HostUnreadable) as error:
        raise SystemExit(f"agent {config.node}: {error}") from None
    ctx.on_serving.append(agent.come_up)  # the node is up once its agent answers
    ctx.cleanups.append(agent.close)
    metrics.start()
    ctx.cleanups.append(metrics.stop)
    return [service, metrics.service]
