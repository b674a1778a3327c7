"""Pure manager-level arithmetic over nodes whose merged capacity is known: totals (saturating) and
the refusals of placing `count` instances on them. Merging the plugins' answers for one node is the
plugin set's (plugins/plugin_set.py), so that plugins/ imports nothing of this level.
"""

from __future__ import annotations

from schemas.errors import BerthError
from schemas.sizes import MAX_INT
from services.allocation.plugins.interface import DeployCapacity
from services.allocation.quantity import saturating_add


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
