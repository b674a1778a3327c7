"""`spread` as DESIGN.md §8 pins it, through a real worker (in this process, seeded): exact over a
selection of at most S nodes, sampled over a larger one, within two instances of even from equal
empty nodes after every placement, and never refused while any node of the selection has room."""

from __future__ import annotations

import random

import pytest

from schemas.errors import BusError
from services.allocation.view import SpreadSample
from tests.allocation_helpers import ONE_CORE, add_node, requester

SAMPLE = 16


async def placed_one_by_one(call, selection: dict, placements: int, nodes: list[str]) -> list[int]:
    """Allocate one instance at a time; the spread (max - min instances per node) after each."""
    held = dict.fromkeys(nodes, 0)
    spreads = []
    for serial in range(placements):
        reply = await call("allocate", {**selection, "strategy": "spread", "deploy_count": 1,
                                        "workload_resource_request": ONE_CORE, "request_id": f"s{serial}"})
        [placed] = reply["allocations"]
        held[placed["nodename"]] += 1
        spreads.append(max(held.values()) - min(held.values()))
    return spreads


@pytest.mark.parametrize("seed", [11, 12])
async def test_spread_over_more_nodes_than_the_sample_stays_within_two_instances(serve_allocation, client, seed):
    await serve_allocation(spread_sample=SpreadSample(SAMPLE, random.Random(seed)))
    call = requester(client)
    nodes = [f"w{i}" for i in range(80)]
    for node in nodes:
        await add_node(call, node, cpu=8, pool="wide")
    spreads = await placed_one_by_one(call, {"labels": {"pool": "wide"}}, 240, nodes)
    assert max(spreads) <= 2, spreads


async def test_spread_over_at_most_the_sample_is_exact(serve_allocation, client):
    await serve_allocation(spread_sample=SpreadSample(SAMPLE, random.Random(5)))
    call = requester(client)
    nodes = [f"x{i}" for i in range(SAMPLE)]
    for node in nodes:
        await add_node(call, node, cpu=8)
    spreads = await placed_one_by_one(call, {"nodenames": nodes}, 3 * SAMPLE, nodes)
    assert max(spreads) == 1 and spreads[SAMPLE - 1] == spreads[2 * SAMPLE - 1] == 0


async def test_sampled_spread_finds_the_one_node_with_room_before_it_refuses(serve_allocation, client):
    await serve_allocation(spread_sample=SpreadSample(SAMPLE, random.Random(3)))
    call = requester(client)
    nodes = [f"y{i}" for i in range(5 * SAMPLE)]
    for node in nodes:
        await add_node(call, node, cpu=1, pool="full")
    for node in nodes[1:]:  # all but the first are full
        await call("allocate", {"nodename": node, "deploy_count": 1, "workload_resource_request": ONE_CORE})
    reply = await call("allocate", {"labels": {"pool": "full"}, "strategy": "spread", "deploy_count": 1,
                                    "workload_resource_request": ONE_CORE})
    assert [a["nodename"] for a in reply["allocations"]] == [nodes[0]]
    with pytest.raises(BusError) as refused:
        await call("allocate", {"labels": {"pool": "full"}, "strategy": "spread", "deploy_count": 1,
                                "workload_resource_request": ONE_CORE})
    assert refused.value.code == "insufficient_capacity"
