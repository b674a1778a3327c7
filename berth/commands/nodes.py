"""`berth nodes`: the allocation service's nodes, paged through `resource.list-nodes`, as a table."""

from __future__ import annotations

import argparse
from typing import Any, Callable

from berth.commands.connection import Connection
from berth.commands.exits import EXIT_FAILED, EXIT_NO_ANSWER, EXIT_OK, EXIT_REFUSED, EXIT_USAGE, CommandError
from berth.commands.output import emit, format_table, to_json
from berth.commands.running import add_command
from bus.client import BusClient
from schemas.errors import BusError, NoResponders, RequestTimeout
from schemas.sizes import format_size


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = add_command(
        sub,
        "nodes",
        nodes_command,
        help="table of the allocation service's nodes",
        description="List every node (paging through resource.list-nodes): its status (up, draining, or down "
        "once its agent's lease lapsed; a node added by hand has no agent), labels, CPU, memory, storage "
        "and GPUs as used/total.",
    )
    parser.add_argument(
        "--labels",
        action="append",
        default=[],
        metavar="K=V[,K=V]",
        help="only nodes with these labels (repeatable)",
    )
    parser.add_argument("--json", action="store_true", help="a JSON document instead of the table")
    parser.add_argument("--page-size", type=int, default=200, help="nodes asked per request (1-1000)")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for each page")


def parse_labels(values: list[str]) -> dict[str, str]:
    labels = {}
    for value in values:
        for pair in filter(None, (part.strip() for part in value.split(","))):
            key, sep, label = pair.partition("=")
            if not sep or not key:
                raise CommandError(f"--labels {pair!r}: give key=value", EXIT_USAGE)
            labels[key] = label
    return labels


def _number(value: Any) -> float | int | None:
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def node_row(node: dict[str, Any]) -> dict[str, Any]:
    """A node's figures: {used, total} of cpu, memory and storage (bytes), gpu (count, per product)."""
    capacity, usage = node.get("capacity") or {}, node.get("usage") or {}

    def pair(plugin: str, field: str) -> dict[str, Any] | None:
        total = _number((capacity.get(plugin) or {}).get(field))
        if total is None:
            return None
        return {"used": _number((usage.get(plugin) or {}).get(field)) or 0, "total": total}

    gpu = None
    products = (capacity.get("gpu") or {}).get("prod_count_map")
    if isinstance(products, dict):
        used = (usage.get("gpu") or {}).get("prod_count_map") or {}
        per_product = {
            product: {"used": used.get(product, 0), "total": count}
            for product, count in sorted(products.items())
        }
        gpu = {
            "used": sum(figures["used"] for figures in per_product.values()),
            "total": sum(figures["total"] for figures in per_product.values()),
            "products": per_product,
        }
    return {
        "nodename": node.get("nodename"),
        "status": node.get("status") or "up",
        "agent": node.get("lease") is not None,
        "labels": node.get("labels") or {},
        "cpu": pair("cpumem", "cpu"),
        "memory": pair("cpumem", "memory"),
        "storage": pair("storage", "storage"),
        "gpu": gpu,
    }


def _amount(value: float) -> str:
    return f"{value:.2f}".rstrip("0").rstrip(".") if isinstance(value, float) else str(value)


def human_bytes(value: float) -> str:
    """Bytes as a request takes them back (`format_size`: "16Gi", "1.5Ki", or exact bytes)."""
    return str(value) if isinstance(value, float) and not value.is_integer() else format_size(int(value))


def format_nodes(rows: list[dict[str, Any]], total: int) -> str:
    def used_total(entry: dict[str, Any] | None, show: Callable[[Any], str]) -> str:
        return f"{show(entry['used'])}/{show(entry['total'])}" if entry else "-"

    if not rows:
        return "no node"
    table = [
        (
            row["nodename"],
            row["status"] if row["agent"] else f"{row['status']} (no agent)",
            ",".join(f"{key}={label}" for key, label in sorted(row["labels"].items())) or "-",
            used_total(row["cpu"], _amount),
            used_total(row["memory"], human_bytes),
            used_total(row["storage"], human_bytes),
            used_total(row["gpu"], _amount),
        )
        for row in rows
    ]
    lines = format_table(("name", "status", "labels", "cpu", "memory", "storage", "gpu"), table)
    lines.append(f"{len(rows)} node{'' if len(rows) == 1 else 's'}" + (f" of {total}" if total != len(rows) else ""))
    return "\n".join(lines)


async def nodes_command(args: argparse.Namespace) -> int:

    labels = parse_labels(args.labels)
    if not 1 <= args.page_size <= 1000:
        raise CommandError("--page-size must be between 1 and 1000", EXIT_USAGE)
    nodes: list[dict[str, Any]] = []
    total = 0
    connection = Connection(args)
    async with connection as nc:
        client = BusClient(nc, prefix=args.prefix, timeout=args.timeout)
        offset: int | None = 0
        while offset is not None:
            request = {"offset": offset, "limit": args.page_size, **({"labels": labels} if labels else {})}
            try:
                page = await connection.unless_refused(client.request("resource.list-nodes", request, dict))
            except NoResponders:
                raise CommandError(
                    f"no allocation service answers on {client.subject('resource.list-nodes')} "
                    f"(is `berth worker allocation` running under prefix {args.prefix!r}?)",
                    EXIT_NO_ANSWER,
                ) from None
            except RequestTimeout as error:
                raise CommandError(error.message, EXIT_NO_ANSWER) from None
            except BusError as error:
                if error.code == "node_not_found" and error.field == "labels":
                    break  # no node has these labels: an empty listing
                raise CommandError(
                    f"{error.code} ({error.status}): {error.message}",
                    EXIT_REFUSED if 400 <= error.status < 500 else EXIT_FAILED,
                ) from None
            nodes += page.get("nodes") or []
            total = page.get("total", len(nodes))
            following = page.get("next_offset")
            offset = following if isinstance(following, int) and following > offset else None
    rows = [node_row(node) for node in nodes]
    if args.json:
        emit(to_json({"nodes": rows, "total": total}, pretty=True))
    else:
        emit(format_nodes(rows, total))
    return EXIT_OK
