"""Running one worker process of a service: `python -m bus.runner <module> [options]`.

A service module is a `ServiceModule`: `NAME`, its contract's tables `COMMANDS` and `EVENTS`,
`STREAM` (the `bus.events.StreamSpec` keeping its events), `CONFIG` (its own config class, or None)
and `async build(ctx) -> bus.Service` (or a list of them, started and drained together); the runner
refuses a module that lacks one. Its options are read from flags and environment by
`bus.settings` (`parse_worker`): `ctx.common` is the `CommonConfig` every worker has,
`ctx.config` its service's own frozen config (None when `CONFIG` is None). The
runner connects to NATS and Redis, makes sure the events stream exists, builds and starts the
service, serves until SIGTERM/SIGINT, drains, runs the service's clean-ups and closes.

With `--metrics-port` the worker also serves Prometheus metrics on `http://<addr>:<port>/metrics`
(`bus.telemetry`); port 0 takes a free one. The first line on stdout stays `ready <name> <id>`, then
`metrics=<url>` when metrics are on; the URL is in the log (stderr) too.
"""

from __future__ import annotations

import asyncio
import gc
import importlib
import logging
import sys
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Protocol, runtime_checkable

from nats.aio.client import Client
from redis.asyncio import Redis

from bus.connection import connect, creds_values, inbox_prefix
from bus.events import EventBus, StreamMissing, StreamSpec
from bus.redis import connect_redis, ready
from bus.service import Command, Service, serve_until_signalled
from bus.settings import CommonConfig, ServiceConfig, parse_worker
from bus.telemetry import MetricsServer

log = logging.getLogger("berth.runner")


@dataclass
class WorkerContext:
    """What `build(ctx)` gets: its frozen configs, the connections, and clean-ups to run at the end."""

    common: CommonConfig
    config: Any  # the service's own frozen config, an instance of its module's CONFIG
    nc: Client
    redis: Redis
    events: EventBus
    prefix: str
    cleanups: list[Callable[[], Awaitable[Any]]] = field(default_factory=list)
    # What to run once every service serves (an agent registers its node then: a node is up only
    # when its agent answers).
    on_serving: list[Callable[[], Awaitable[Any]]] = field(default_factory=list)


def configure_logging(level: str = "INFO") -> None:
    logging.basicConfig(
        level=level,
        format="%(asctime)s level=%(levelname)s logger=%(name)s pid=%(process)d msg=%(message)s",
        stream=sys.stderr,
    )


def nats_options(common: CommonConfig, service: str, node: str | None = None) -> dict[str, str]:
    """The worker's NATS credentials (a creds file first, then user and password) and inbox root;
    `node`: the worker is that node's agent.

    The inbox root is the service's own (`bus.connection.inbox_prefix`), not `_INBOX`: with
    the permissions `berth up` writes, only this service (a node agent: only this node's) may
    subscribe to it, so the answers to its requests (JetStream API, calls to other services) are
    not visible to anyone else. A node agent's identity names its node: an agent started for
    another node stops here, rather than be refused subject by subject."""
    options = {"inbox_prefix": common.nats_inbox_prefix or inbox_prefix(common.prefix, service, node)}
    user, password = common.nats_user, common.nats_password
    if common.nats_creds:
        try:
            values = creds_values(common.nats_creds)
        except (OSError, ValueError) as error:
            raise SystemExit(f"--nats-creds: {error}") from None
        user, password, bound = values["user"], values["password"], values.get("node")
        if bound is not None and bound != node:
            doing = f"node {node}'s agent" if node else f"a {service} worker"
            raise SystemExit(f"--nats-creds {common.nats_creds}: identity {user!r} is node {bound}'s agent, and this "
                             f"is {doing}: give it {'that node' if node else 'its service'}'s own identity"
                             + (f" (berth user add NAME --role agent --node {node})" if node else ""))
    if user is not None or password is not None:
        options.update(user=user or "", password=password or "")
    return options


@runtime_checkable
class ServiceModule(Protocol):
    """What a worker module (`services/<service>/worker.py`) defines for the runner."""

    NAME: str
    COMMANDS: list[Command]
    EVENTS: dict[str, type]
    STREAM: StreamSpec
    CONFIG: type[ServiceConfig] | None

    async def build(self, ctx: WorkerContext) -> Service | list[Service]: ...


def load(module_name: str) -> ServiceModule:
    module = importlib.import_module(module_name)
    if not isinstance(module, ServiceModule):
        missing = [name for name in (*ServiceModule.__annotations__, "build") if not hasattr(module, name)]
        raise SystemExit(f"{module_name} is not a berth service module: it has no {', '.join(sorted(missing))}")
    return module


async def run(module: ServiceModule, common: CommonConfig, config: Any) -> None:
    metrics = None
    if common.metrics_port is not None:
        metrics = MetricsServer(common.metrics_addr, common.metrics_port)
        try:
            await metrics.start()
        except OSError as error:
            raise SystemExit(f"--metrics-port {common.metrics_port}: {error}") from None
        log.info("serving Prometheus metrics on %s", metrics.url)
    try:
        await _serve(module, common, config, metrics)
    except StreamMissing as error:
        raise SystemExit(str(error)) from None
    finally:
        if metrics is not None:
            await metrics.close()


async def _serve(module: ServiceModule, common: CommonConfig, config: Any, metrics: MetricsServer | None) -> None:
    node = config.node if getattr(module, "NODE_SCOPED", False) else None  # a node agent
    nc = await connect(common.nats, name=f"{common.prefix}-{module.NAME}", **nats_options(common, module.NAME, node))
    redis = await ready(connect_redis(common.redis, max_connections=common.concurrency + 8))
    events = EventBus(nc, prefix=common.prefix, js_domain=common.js_domain)
    await events.ensure_stream(module.STREAM, memory=common.memory_stream, create=common.js_domain is None)
    ctx = WorkerContext(common=common, config=config, nc=nc, redis=redis, events=events, prefix=common.prefix)
    try:
        built = await module.build(ctx)
        services = built if isinstance(built, list) else [built]  # a process may run several
        for service in services:
            await service.start(nc)
        for step in ctx.on_serving:
            await step()
        tail = f" metrics={metrics.url}" if metrics is not None else ""
        first = services[0]
        print(f"ready {first.name} {first.id}{tail}", flush=True)  # the supervisor and tests wait for this line
        await serve_until_signalled(services, common.drain_timeout)
    finally:
        for cleanup in reversed(ctx.cleanups):
            try:
                await cleanup()
            except Exception:
                log.exception("clean-up failed")
        await nc.drain()
        await redis.aclose()


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        raise SystemExit("usage: python -m bus.runner <service module> [options]")
    module = load(argv[0])
    common, config = parse_worker(module.NAME, module.CONFIG, argv[1:])
    configure_logging(common.log_level)
    # A worker allocates many short-lived objects per request while holding large long-lived
    # ones (capacity views, memos). With the default threshold (700) the cycle collector runs
    # every few requests and walks them all (docs/benchmarks.md, "Measurements behind the code").
    gc.set_threshold(50_000, 20, 100)
    asyncio.run(run(module, common, config))


if __name__ == "__main__":
    main()
