"""What the page draws, made from what the bus answers: services, nodes' bars, events; and the
server-sent event format every change travels in."""

from __future__ import annotations

import json
from datetime import UTC
from typing import Any

from berth.registry import SERVICES as KNOWN
from schemas.allocation import WORKLOAD_EVENTS

# Every service berth knows, as `berth up` starts them (an agent process also serves its node's
# metrics, so `berth up` shows one metrics instance per agent and no metrics worker).
SERVICES = tuple(KNOWN)

# What is charted for each metrics agent: (metric, at node scope; title; unit).
CHARTS = (
    ("cpu.usage.ratio.system", "CPU busy", "ratio"),
    ("cpu.load.1min.system", "load, 1 min", "count"),
    ("mem.used.system", "memory used", "bytes"),
    ("procs.running.system", "runnable tasks", "count"),
)

PLUGIN_ORDER = {"cpumem": 0, "storage": 1, "gpu": 2}
UNITS = {"cpu": "cores", "memory": "bytes", "storage": "bytes"}
# eru's rule: only bound CPU (and memory) is exclusive; unbound workloads share the cores, so their
# CPU may add up past the node's count (README, "Allocation")
SHARED_CPU = "more than the cores: unbound CPU shares them (only bound CPU and memory are exclusive)"


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def node_view(node: dict[str, Any]) -> dict[str, Any]:
    """A `list-nodes` entry as the page draws it: labels, and a bar (used of total) per resource.

    A plugin's bars are its numeric capacity keys (cpumem: cpu, memory; storage: storage) and one
    per product of a `prod_count_map` (gpu); per-core maps and volumes are left out."""
    capacity, usage = node.get("capacity") or {}, node.get("usage") or {}
    bars = []
    for plugin in sorted(capacity, key=lambda name: (PLUGIN_ORDER.get(name, 9), name)):
        total, used = capacity[plugin] or {}, usage.get(plugin) or {}
        for key, value in total.items():
            if is_number(value) and (value or used.get(key)):
                bars.append(_bar(plugin, key, used.get(key, 0), value, UNITS.get(key, "")))
                if plugin == "cpumem" and key == "cpu" and is_number(used.get(key)) and used[key] > value:
                    bars[-1]["note"] = SHARED_CPU
        products, taken = total.get("prod_count_map") or {}, used.get("prod_count_map") or {}
        for product in sorted(products):
            bars.append(_bar(plugin, product, taken.get(product, 0), products[product], "count"))
    return {"nodename": node["nodename"], "labels": node.get("labels") or {}, "bars": bars,
            "status": node.get("status") or "up", "agent": agent_view(node.get("lease"))}


def agent_view(lease: dict[str, Any] | None) -> dict[str, Any] | None:
    """What the page says of a node's agent (None: the node was added by hand, no agent keeps it):
    where its instances are reached, how many run, and when its lease ends (unix seconds)."""
    if not lease:
        return None
    agent = lease.get("agent") or {}
    return {"address": agent.get("address", ""), "instances": agent.get("instances", 0),
            "running": agent.get("running", 0), "pinning": agent.get("pinning", ""),
            "expires": lease.get("expires", 0), "ttl_seconds": lease.get("ttl_seconds", 0)}


def _bar(plugin: str, resource: str, used: Any, total: Any, unit: str) -> dict[str, Any]:
    return {
        "plugin": plugin,
        "resource": resource,
        "used": used if is_number(used) else 0,
        "total": total,
        "unit": unit,
    }


def services_view(prefix: str, stats: list) -> list[dict[str, Any]]:
    """Every berth service of the prefix, with its live instances (none: the service is absent)."""
    return [
        {
            "name": name,
            "service": f"{prefix}-{name}",
            "instances": [_instance(instance) for instance in stats if instance.name == f"{prefix}-{name}"],
        }
        for name in SERVICES
    ]


def _instance(stats) -> dict[str, Any]:
    requests = sum(endpoint.num_requests for endpoint in stats.endpoints)
    busy_ns = sum(endpoint.processing_time for endpoint in stats.endpoints)
    started = stats.started.replace(tzinfo=UTC).timestamp() if stats.started else None
    return {
        "id": stats.id,
        "version": stats.version,
        "started": started,
        "endpoints": len(stats.endpoints),
        "requests": requests,
        "errors": sum(endpoint.num_errors for endpoint in stats.endpoints),
        # each endpoint's latest error ("409:node_exists"): the page's tooltip on the count
        "last_errors": {e.name: e.last_error for e in stats.endpoints if e.num_errors},
        "avg_ms": round(busy_ns / requests / 1e6, 3) if requests else 0.0,
        "node": (stats.metadata or {}).get("node"),
    }


def shown(subject: str) -> bool:
    """Whether the page lists an event (`subject` after `<prefix>.events.`): not an owner's copy of
    a node's event (`resource.workload.<owner>.<node>.<kind>`), which repeats one it lists."""
    tokens = subject.split(".")
    return not (len(tokens) == 5 and tokens[0] == "resource" and tokens[1] == WORKLOAD_EVENTS)


def event_view(subject: str, body: dict[str, Any]) -> dict[str, Any]:
    """An event for the list: `subject` is the part after `<prefix>.events.`."""
    return {
        "time": body.get("time"),
        "subject": subject,
        "service": subject.split(".", 1)[0],
        "type": body.get("type") or subject.rsplit(".", 1)[-1],
        "detail": summary(body),
    }


_NOT_SUMMARIZED = {"type", "time", "version", "nodename", "before", "after"}


def summary(body: dict[str, Any]) -> str:
    """The event's own fields in one short line: scalars as key=value, lists by their length."""
    parts = []
    for key, value in body.items():
        if key in _NOT_SUMMARIZED:
            continue
        if isinstance(value, list):
            parts.append(f"{key}: {len(value)}")
        elif isinstance(value, (str, int, float)) and value != "":
            parts.append(f"{key}={value}")
    return " ".join(parts)


def sse(kind: str, data: Any) -> str:
    """One server-sent event (JSON has no raw newline, so one `data:` line is enough)."""
    return f"event: {kind}\ndata: {json.dumps(data, separators=(',', ':'), default=str)}\n\n"
