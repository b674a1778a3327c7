"""The `berth` command: `up`, `worker`, `status`, `schema`."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from pathlib import Path

from services.registry import SERVICES, available
from services.runner import configure_logging
from services.supervisor import Supervisor, worker_argv

log = logging.getLogger("berth")


def _url_args(args: argparse.Namespace) -> list[str]:
    return ["--nats", args.nats, "--redis", args.redis, "--prefix", args.prefix]


def cmd_up(args: argparse.Namespace, extra: list[str]) -> int:
    from services.servers import start_nats, start_redis

    state = Path(args.state).resolve()
    servers = []
    try:
        if not args.nats:
            servers.append(start_nats(state / "nats", args.nats_port))
            args.nats = servers[-1].url
        if not args.redis:
            servers.append(start_redis(state / "redis", args.redis_port))
            args.redis = servers[-1].url
        print(f"NATS_URL={args.nats}\nREDIS_URL={args.redis}\nstate: {state}", flush=True)
        supervisor = Supervisor()
        for name, module in available().items():
            supervisor.add(name, worker_argv(module, _url_args(args)))
        if not supervisor.children:
            print("no service is installed yet; serving NATS and Redis only", flush=True)
        print("berth is up; Ctrl-C stops everything", flush=True)
        return supervisor.run()
    finally:
        for server in reversed(servers):
            server.stop()
        print("berth stopped", flush=True)


def cmd_worker(args: argparse.Namespace, extra: list[str]) -> int:
    modules = available()
    if args.service not in modules:
        raise SystemExit(f"service {args.service!r} is not installed (have: {', '.join(modules) or 'none'})")
    if not args.nats or not args.redis:
        raise SystemExit("give --nats and --redis (or set NATS_URL and REDIS_URL)")
    supervisor = Supervisor()
    for i in range(args.workers):
        supervisor.add(f"{args.service}[{i}]", worker_argv(modules[args.service], _url_args(args) + extra))
    return supervisor.run()


def cmd_status(args: argparse.Namespace, extra: list[str]) -> int:
    from bus import discovery
    from bus.connection import connect

    async def show() -> None:
        nc = await connect(args.nats, worker=False)
        try:
            instances = await discovery.stats(nc, timeout=args.timeout)
        finally:
            await nc.close()
        print(format_status(instances))

    asyncio.run(show())
    return 0


def format_status(instances) -> str:
    if not instances:
        return "no service instance answered"
    rows = [("service", "instance", "endpoint", "requests", "errors", "avg ms")]
    for inst in instances:
        for ep in sorted(inst.endpoints, key=lambda e: e.subject):
            avg_ms = (ep.average_processing_time or 0) / 1e6
            rows.append((inst.name, inst.id, ep.subject, str(ep.num_requests), str(ep.num_errors), f"{avg_ms:.3f}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    total = sum(len(i.endpoints) for i in instances)
    lines.append(f"{len(instances)} instances, {total} endpoints")
    return "\n".join(lines)


def cmd_schema(args: argparse.Namespace, extra: list[str]) -> int:
    from schemas.export import main as export

    export(["--prefix", args.prefix] + (["-o", args.output] if args.output else []))
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="berth", description="berth: allocation, broker and metrics over NATS")
    sub = p.add_subparsers(dest="command", required=True)

    def urls(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--nats", default=os.environ.get("NATS_URL"), help="NATS URL (env NATS_URL)")
        sp.add_argument("--redis", default=os.environ.get("REDIS_URL"), help="Redis URL (env REDIS_URL)")
        sp.add_argument("--prefix", default=os.environ.get("BERTH_PREFIX", "berth"))

    up = sub.add_parser("up", help="start embedded nats-server and redis-server and every service")
    urls(up)
    up.set_defaults(nats=None, redis=None)  # `up` embeds servers unless told otherwise, whatever the env says
    up.add_argument("--state", default=os.environ.get("BERTH_STATE", ".berth"), help="state folder")
    up.add_argument("--nats-port", type=int, help="port for the embedded nats-server (default: a free one)")
    up.add_argument("--redis-port", type=int, help="port for the embedded redis-server (default: a free one)")
    up.set_defaults(run=cmd_up)

    worker = sub.add_parser("worker", help="run N processes of one service")
    worker.add_argument("service", choices=sorted(SERVICES))
    worker.add_argument("--workers", type=int, default=1)
    urls(worker)
    worker.set_defaults(run=cmd_worker)

    status = sub.add_parser("status", help="table of live service instances")
    status.add_argument("--nats", default=os.environ.get("NATS_URL"))
    status.add_argument("--timeout", type=float, default=1.0)
    status.set_defaults(run=cmd_status)

    schema = sub.add_parser("schema", help="JSON Schema of every message, by subject")
    schema.add_argument("--prefix", default="berth")
    schema.add_argument("-o", "--output")
    schema.set_defaults(run=cmd_schema)
    return p


def main(argv: list[str] | None = None) -> None:
    """For `worker`, options berth does not know are passed on to the service processes."""
    configure_logging(os.environ.get("BERTH_LOG_LEVEL", "INFO"))
    p = parser()
    args, extra = p.parse_known_args(sys.argv[1:] if argv is None else argv)
    if extra and args.command != "worker":
        p.error(f"unrecognized arguments: {' '.join(extra)}")
    sys.exit(args.run(args, extra))


if __name__ == "__main__":
    main()
