"""Pure manager-level arithmetic: merging plugin answers and choosing nodes for instances.

Merges follow eru core (reference §5.2) with its deliberate fixes: deploy capacity takes the nodes
every plugin can serve, the minimum capacity and a proper weighted mean of rate and usage; totals
saturate. Strategies place `count` instances over nodes whose per-node capacity is known.
"""

from __future__ import annotations

from schemas.errors import BerthError
from schemas.sizes import MAX_INT
from services.allocation.plugins.interface import DeployCapacity
from services.allocation.quantity import saturating_add


def merge(entries: list[DeployCapacity]) -> DeployCapacity:
    """One node's capacity over all plugins: the minimum, with weight-averaged rate and usage."""
    weight = sum(e.weight for e in entries)
    return DeployCapacity(
        capacity=min(e.capacity for e in entries),
        usage=sum(e.usage * e.weight for e in entries) / weight if weight else 0.0,
        rate=sum(e.rate * e.weight for e in entries) / weight if weight else 0.0,
        weight=weight,
    )


def total_capacity(capacities: dict[str, DeployCapacity]) -> int:
    total = 0
    for cap in capacities.values():
        total = saturating_add(total, cap.capacity)
    return min(total, MAX_INT)


def insufficient(wanted: int, available: int) -> BerthError:
    return BerthError(
        f"cannot place {wanted} instances: the nodes have room for {available}",
        code="insufficient_capacity",
        details={"wanted": wanted, "available": available, "unit": "instances"},
    )


def each(room: dict[str, int], count: int) -> None:
    """Refuse unless every node has room for `count` instances (each places on all, or none)."""
    for node, have in room.items():
        if have < count:
            raise BerthError(
                f"node {node} has room for {have} instances, {count} wanted",
                code="insufficient_capacity",
                details={"nodename": node, "wanted": count, "available": have, "unit": "instances"},
            )


def most_idle(loads: dict[str, float]) -> str:
    """The node with the smallest load; ties go to the smallest name."""
    return min(loads.items(), key=lambda item: (item[1], item[0]))[0]
