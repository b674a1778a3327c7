"""How the query commands show records and capacity (`list-resources`, `get-resource-detail`).

Pure: the callers read the records, the operator's blocks and the reservations.
"""

from __future__ import annotations

from msgspec import UNSET, structs

from schemas.broker import BlockDetail, ListResources, ResourceDetail
from services.broker.model import Resource


def matches(req: ListResources, record: Resource) -> bool:
    """Filters that are absent match everything."""
    return (
        (req.user is UNSET or record.user == req.user)
        and (req.status is UNSET or record.status == req.status)
        and (req.broker_name is UNSET or record.broker_name == req.broker_name)
        and (req.broker_sold is UNSET or record.broker_sold == req.broker_sold)
    )


def unreserved(block: str, total: int, used: int, free: int, **usage: float) -> BlockDetail:
    """A capacity block as an operator reports it: `free` instances it can still start, before the
    broker's reservations (`usage`: CPU and memory, where the operator knows them)."""
    return BlockDetail(block, total, used, free, free, 0, **usage)


def block_details(capacities: list[BlockDetail], reserved: dict[str, int]) -> list[BlockDetail]:
    """Every block the operator reports or the broker still reserves in, by name, the instances
    reserved but not ready taken off what is available."""
    by_block = {c.block: c for c in capacities}
    details = []
    for block in sorted(set(by_block) | set(reserved)):
        capacity = by_block.get(block) or unreserved(block, 0, 0, 0)  # one the operator no longer has
        waiting = reserved.get(block, 0)
        details.append(
            structs.replace(
                capacity,
                available_instance=capacity.report_instance - waiting,
                not_ready_instance=waiting,
            )
        )
    return details


def resource_detail(record: Resource) -> ResourceDetail:
    return record.shown_as(
        ResourceDetail,
        not_ready_instance=record.no_ready_instance,
        block=record.resource_block_key,
        image=record.param.image,
    )
