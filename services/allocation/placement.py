"""Pure manager-level arithmetic: merging plugin answers and choosing nodes for instances.

Merges follow eru core (reference §5.2) with its deliberate fixes: deploy capacity takes the nodes
every plugin can serve, the minimum capacity and a proper weighted mean of rate and usage; totals
saturate. Strategies place `count` instances over nodes whose per-node capacity is known.
"""

from __future__ import annotations

import heapq

from bus.errors import BerthError
from services.allocation.plugin import DeployCapacity
from services.allocation.quantity import MAX_INT, saturating_add


def merge_capacities(per_plugin: list[dict[str, DeployCapacity]]) -> dict[str, DeployCapacity]:
    """Nodes present for every plugin, with the minimum capacity and weight-averaged rate and usage."""
    if not per_plugin:
        return {}
    common = set(per_plugin[0]).intersection(*per_plugin[1:])
    merged = {}
    for node in sorted(common):
        entries = [caps[node] for caps in per_plugin]
        weight = sum(e.weight for e in entries)
        merged[node] = DeployCapacity(
            capacity=min(e.capacity for e in entries),
            usage=sum(e.usage * e.weight for e in entries) / weight if weight else 0.0,
            rate=sum(e.rate * e.weight for e in entries) / weight if weight else 0.0,
            weight=weight,
        )
    return merged


def total_capacity(capacities: dict[str, DeployCapacity]) -> int:
    total = 0
    for cap in capacities.values():
        total = saturating_add(total, cap.capacity)
    return min(total, MAX_INT)


def _insufficient(wanted: int, available: int) -> BerthError:
    return BerthError(
        f"cannot place {wanted} instances: the nodes have room for {available}",
        code="insufficient_capacity",
        details={"wanted": wanted, "available": available},
    )


def spread(capacities: dict[str, DeployCapacity], count: int) -> dict[str, int]:
    """Each instance goes to the node whose usage after taking it is lowest (eru's GLOBAL)."""
    heap = [(cap.usage + cap.rate, node) for node, cap in sorted(capacities.items()) if cap.capacity > 0]
    heapq.heapify(heap)
    placed: dict[str, int] = {}
    for _ in range(count):
        if not heap:
            raise _insufficient(count, sum(placed.values()))
        projected, node = heapq.heappop(heap)
        placed[node] = placed.get(node, 0) + 1
        cap = capacities[node]
        if placed[node] < cap.capacity:
            heapq.heappush(heap, (projected + cap.rate, node))
    return placed


def pack(capacities: dict[str, DeployCapacity], count: int) -> dict[str, int]:
    """Fill the most-used node that still fits first, then the next (ties: smallest name)."""
    placed: dict[str, int] = {}
    left = count
    for node, cap in sorted(capacities.items(), key=lambda item: (-item[1].usage, item[0])):
        if left == 0:
            break
        take = min(cap.capacity, left)
        if take > 0:
            placed[node] = take
            left -= take
    if left:
        raise _insufficient(count, count - left)
    return placed


def each(capacities: dict[str, DeployCapacity], nodes: list[str], count: int) -> dict[str, int]:
    """`count` instances on every listed node, or none at all."""
    for node in nodes:
        have = capacities[node].capacity if node in capacities else 0
        if have < count:
            raise BerthError(
                f"node {node} has room for {have} instances, {count} wanted",
                code="insufficient_capacity",
                details={"nodename": node, "wanted": count, "available": have},
            )
    return {node: count for node in nodes}


def most_idle(loads: dict[str, float]) -> str:
    """The node with the smallest load; ties go to the smallest name."""
    return min(loads.items(), key=lambda item: (item[1], item[0]))[0]
