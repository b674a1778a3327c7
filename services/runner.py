"""Running one worker process of a service: `python -m services.runner <module> [options]`.

A service module defines `NAME`, `STREAM` (the `bus.events.StreamSpec` keeping its events),
`add_arguments(parser)` and `async build(ctx) -> bus.Service`. The runner connects to NATS and
Redis, makes sure the events stream exists, builds and starts the service, serves until
SIGTERM/SIGINT, drains, runs the service's clean-ups and closes.

With `--metrics-port` the worker also serves Prometheus metrics on `http://<addr>:<port>/metrics`
(`bus.telemetry`); port 0 takes a free one. The first line on stdout stays `ready <name> <id>`, then
`metrics=<url>` when metrics are on; the URL is in the log (stderr) too.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import importlib
import logging
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from nats.aio.client import Client
from redis.asyncio import Redis

from bus.connection import connect
from bus.events import EventBus
from bus.redis import connect_redis, ready
from bus.subjects import NAME_PATTERN as PREFIX_PATTERN
from bus.telemetry import MetricsServer

log = logging.getLogger("berth.runner")


@dataclass
class WorkerContext:
    args: argparse.Namespace
    nc: Client
    redis: Redis
    events: EventBus
    prefix: str
    cleanups: list[Callable[[], Awaitable[Any]]] = field(default_factory=list)


def configure_logging(level: str = "INFO") -> None:
    logging.basicConfig(
        level=level,
        format="%(asctime)s level=%(levelname)s logger=%(name)s pid=%(process)d msg=%(message)s",
        stream=sys.stderr,
    )


def common_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nats", default=os.environ.get("NATS_URL"), help="NATS URL (env NATS_URL)")
    parser.add_argument(
        "--nats-user", default=os.environ.get("NATS_USER"), help="NATS user (env NATS_USER; or user:password@ in the URL)"
    )
    parser.add_argument(
        "--nats-password", default=os.environ.get("NATS_PASSWORD"),
        help="NATS password (env NATS_PASSWORD, better than this option: a command line is visible to every local user)",
    )
    parser.add_argument(
        "--nats-creds", default=os.environ.get("BERTH_NATS_CREDS"), metavar="FILE",
        help="file with user=... and password=... lines, as `berth up` writes (env BERTH_NATS_CREDS)",
    )
    parser.add_argument(
        "--nats-inbox-prefix", default=os.environ.get("BERTH_NATS_INBOX_PREFIX"),
        help="inbox root of the worker's own requests (default _INBOX_<prefix>-<service>, which the "
        "permissions `berth up` writes expect; env BERTH_NATS_INBOX_PREFIX)",
    )
    parser.add_argument(
        "--redis", default=os.environ.get("REDIS_URL"),
        help="Redis URL, redis://[user:password@]host:port/db or redis+cluster://[user:password@]host:port,... (env REDIS_URL)",
    )
    parser.add_argument(
        "--prefix", default=os.environ.get("BERTH_PREFIX", "berth"), help="subject and key prefix (env BERTH_PREFIX)"
    )
    parser.add_argument(
        "--concurrency", type=int, default=int(os.environ.get("BERTH_CONCURRENCY", "64")),
        help="requests served at once per process",
    )
    parser.add_argument("--drain-timeout", type=float, default=10.0, help="seconds to finish requests on SIGTERM")
    parser.add_argument("--memory-stream", action="store_true", help="keep the events stream in memory (tests)")
    parser.add_argument(
        "--metrics-port", type=metrics_port, default=os.environ.get("BERTH_METRICS_PORT", ""),
        metavar="PORT", help="serve Prometheus metrics on this port at /metrics, 0 for a free one "
        "(env BERTH_METRICS_PORT; default: off)",
    )
    parser.add_argument(
        "--metrics-addr", default=os.environ.get("BERTH_METRICS_ADDR", "0.0.0.0"),
        help="address the metrics server listens on (env BERTH_METRICS_ADDR)",
    )
    parser.add_argument(
        "--metrics-refresh", type=float, default=float(os.environ.get("BERTH_METRICS_REFRESH", "10")),
        metavar="SECONDS", help="figures a scrape reads from Redis (node totals, pool sizes) are read at most "
        "this often (env BERTH_METRICS_REFRESH)",
    )


def metrics_port(text: str) -> int | None:
    """A port number, or None (off) for an empty value or `off`."""
    if text.strip().lower() in ("", "off"):
        return None
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a port number (0 to 65535)")
    return port


def nats_options(args: argparse.Namespace, service: str) -> dict[str, str]:
    """The worker's NATS credentials (a creds file first, then user and password) and inbox root.

    The inbox root is the service's own (`services.credentials.inbox_prefix`), not `_INBOX`: with
    the permissions `berth up` writes, only this service may subscribe to it, so the answers to its
    requests (JetStream API, calls to other services) are not visible to clients."""
    from services.credentials import inbox_prefix, read_creds_file

    options = {"inbox_prefix": args.nats_inbox_prefix or inbox_prefix(args.prefix, service)}
    user, password = args.nats_user, args.nats_password
    if args.nats_creds:
        try:
            user, password = read_creds_file(args.nats_creds)
        except (OSError, ValueError) as error:
            raise SystemExit(f"--nats-creds: {error}") from None
    if user is not None or password is not None:
        options.update(user=user or "", password=password or "")
    return options


def load(module_name: str):
    module = importlib.import_module(module_name)
    for attribute in ("NAME", "STREAM", "add_arguments", "build"):
        if not hasattr(module, attribute):
            raise SystemExit(f"{module_name} is not a berth service module: it has no {attribute}")
    return module


async def run(module, args: argparse.Namespace) -> None:
    if not PREFIX_PATTERN.match(args.prefix):
        raise SystemExit(f"--prefix {args.prefix!r} must match [A-Za-z0-9_-]+")
    metrics = None
    if args.metrics_port is not None:
        metrics = MetricsServer(args.metrics_addr, args.metrics_port)
        try:
            await metrics.start()
        except OSError as error:
            raise SystemExit(f"--metrics-port {args.metrics_port}: {error}") from None
        log.info("serving Prometheus metrics on %s", metrics.url)
    try:
        await _serve(module, args, metrics)
    finally:
        if metrics is not None:
            await metrics.close()


async def _serve(module, args: argparse.Namespace, metrics: MetricsServer | None) -> None:
    nc = await connect(args.nats, name=f"{args.prefix}-{module.NAME}", **nats_options(args, module.NAME))
    redis = await ready(connect_redis(args.redis, max_connections=args.concurrency + 8))
    events = EventBus(nc, prefix=args.prefix)
    await events.ensure_stream(module.STREAM, memory=args.memory_stream)
    ctx = WorkerContext(args=args, nc=nc, redis=redis, events=events, prefix=args.prefix)
    try:
        service = await module.build(ctx)
        await service.start(nc)
        tail = f" metrics={metrics.url}" if metrics is not None else ""
        print(f"ready {service.name} {service.id}{tail}", flush=True)  # the supervisor and tests wait for this line
        await service.serve_until_signalled(args.drain_timeout)
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
        raise SystemExit("usage: python -m services.runner <service module> [options]")
    module = load(argv[0])
    parser = argparse.ArgumentParser(prog=f"berth worker {module.NAME}")
    common_arguments(parser)
    module.add_arguments(parser)
    args = parser.parse_args(argv[1:])
    configure_logging(os.environ.get("BERTH_LOG_LEVEL", "INFO"))
    # A worker allocates many short-lived objects per request while holding large long-lived
    # ones (capacity views, memos). With the default threshold (700) the cycle collector runs
    # every few requests and walks them: measured on bench/allocation.py, 1,400 -> 3,400
    # placements/s and p99 260 -> 29 ms with this setting.
    gc.set_threshold(50_000, 20, 100)
    asyncio.run(run(module, args))


if __name__ == "__main__":
    main()
