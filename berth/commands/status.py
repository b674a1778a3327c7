"""`berth status`: every live service instance's statistics (`$SRV.STATS`), by service or by endpoint."""

from __future__ import annotations

import argparse
from typing import Any

from berth.commands.connection import Connection, redact
from berth.commands.exits import EXIT_OK
from berth.commands.output import emit, format_table, to_json
from berth.commands.running import add_command
from bus import discovery


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = add_command(
        sub,
        "status",
        status_command,
        help="live services: one line each (--endpoints: every endpoint of every instance)",
        description="Ask every service instance for its statistics ($SRV.STATS) and print one line per "
        "service: instances, requests, errors, mean latency. --endpoints prints one line per endpoint "
        "of each instance.",
    )
    parser.add_argument("--endpoints", action="store_true", help="one line per endpoint of each instance")
    parser.add_argument("--json", action="store_true", help="a JSON document instead of the table")
    parser.add_argument("--all", action="store_true", help="services of every prefix, not only --prefix's")
    parser.add_argument("--timeout", type=float, default=1.0, help="seconds to wait for the first answer")


def _ms(nanoseconds: float) -> float:
    return round(nanoseconds / 1e6, 3)


def of_prefix(name: str, prefix: str) -> bool:
    """Whether a service name (`<prefix>-<service>`) belongs to `prefix` (not to `<prefix>-x`)."""
    return name.startswith(f"{prefix}-") and "-" not in name[len(prefix) + 1 :]


def summarize(instances: list) -> list[dict[str, Any]]:
    services: dict[str, dict[str, Any]] = {}
    for inst in instances:
        entry = services.setdefault(
            inst.name,
            {"name": inst.name, "instances": 0, "requests": 0, "errors": 0, "processing_ns": 0, "ids": []},
        )
        entry["instances"] += 1
        entry["ids"].append(inst.id)
        for endpoint in inst.endpoints:
            entry["requests"] += endpoint.num_requests
            entry["errors"] += endpoint.num_errors
            entry["processing_ns"] += endpoint.processing_time or 0
    out = []
    for entry in sorted(services.values(), key=lambda e: e["name"]):
        processing_ns = entry.pop("processing_ns")
        entry["mean_ms"] = _ms(processing_ns / entry["requests"]) if entry["requests"] else None
        out.append(entry)
    return out


def format_services(services: list[dict[str, Any]]) -> str:
    rows = [
        (
            service["name"],
            str(service["instances"]),
            str(service["requests"]),
            str(service["errors"]),
            f"{service['mean_ms']:.3f}" if service["mean_ms"] is not None else "-",
        )
        for service in services
    ]
    lines = format_table(("service", "instances", "requests", "errors", "mean ms"), rows)
    lines.append(f"{len(services)} services, {sum(service['instances'] for service in services)} instances")
    return "\n".join(lines)


def endpoint_entries(instances: list) -> list[dict[str, Any]]:
    return [
        {
            "name": inst.name,
            "id": inst.id,
            "version": inst.version,
            "started": inst.started.isoformat() if hasattr(inst.started, "isoformat") else str(inst.started),
            "endpoints": [
                {
                    "name": endpoint.name,
                    "subject": endpoint.subject,
                    "requests": endpoint.num_requests,
                    "errors": endpoint.num_errors,
                    "mean_ms": _ms(endpoint.average_processing_time or 0) if endpoint.num_requests else None,
                    "last_error": endpoint.last_error or None,
                }
                for endpoint in sorted(inst.endpoints, key=lambda listed: listed.subject)
            ],
        }
        for inst in instances
    ]


def format_endpoints(instances: list[dict[str, Any]]) -> str:
    rows = [
        (
            inst["name"],
            inst["id"],
            endpoint["subject"],
            str(endpoint["requests"]),
            str(endpoint["errors"]),
            f"{endpoint['mean_ms'] or 0:.3f}",
        )
        for inst in instances
        for endpoint in inst["endpoints"]
    ]
    lines = format_table(("service", "instance", "endpoint", "requests", "errors", "avg ms"), rows)
    lines.append(f"{len(instances)} instances, {len(rows)} endpoints")
    return "\n".join(lines)


async def status_command(args: argparse.Namespace) -> int:
    connection = Connection(args)
    async with connection as nc:
        instances = await connection.unless_refused(discovery.stats(nc, timeout=args.timeout))
    if not args.all:
        instances = [inst for inst in instances if of_prefix(inst.name, args.prefix)]
    server = {"nats": redact(args.nats), "prefix": None if args.all else args.prefix}
    if args.endpoints:
        entries = endpoint_entries(instances)
        if args.json:
            emit(to_json({**server, "instances": entries}, pretty=True))
        else:
            emit(f"{_asked(args)}\n{format_endpoints(entries)}" if entries else _nobody(args))
    else:
        services = summarize(instances)
        if args.json:
            emit(to_json({**server, "services": services}, pretty=True))
        else:
            emit(f"{_asked(args)}\n{format_services(services)}" if services else _nobody(args))
    return EXIT_OK


def _where(args: argparse.Namespace) -> str:
    """The server and prefix asked, and where the server's URL came from (the first line of the table)."""
    source = getattr(args, "nats_source", None)
    return (f"{redact(args.nats)} ({'every prefix' if args.all else f'prefix {args.prefix}'}"
            f"{'; from ' + source if source else ''})")


def _asked(args: argparse.Namespace) -> str:
    return f"asked {_where(args)}"


def _nobody(args: argparse.Namespace) -> str:
    return f"no berth service answers at {_where(args)}"
