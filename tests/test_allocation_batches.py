"""Deploys to one node are committed in batches: exactly what fits is placed, a refused deploy fails
alone, and a caller that goes away while waiting leaves nothing placed."""

from __future__ import annotations

import asyncio

import pytest

from schemas.errors import BerthError, BusError
from tests.allocation_helpers import ONE_CORE, add_node, requester


@pytest.fixture
async def manager(serve_allocation):
    return await serve_allocation()


@pytest.fixture
def call(client, manager):
    return requester(client)


async def held(call, node: str) -> tuple[float, int]:
    """(cpu used, workloads in the ledger) of a node."""
    info = await call("get-node-resource-info", {"nodename": node})
    assert info["diffs"] == [], info["diffs"]  # usage is exactly what the ledger explains
    ledger = (await call("get-allocations", {"nodename": node}))["allocations"]
    return info["usage"]["cpumem"]["cpu"], len(ledger)


async def test_concurrent_pack_places_exactly_what_fits(call):
    for node in ("p1", "p2", "p3"):
        await add_node(call, node, cpu=4, memory="64G")

    async def one() -> str:
        try:
            reply = await call("allocate", {"nodenames": ["p1", "p2", "p3"], "strategy": "pack", "deploy_count": 1,
                                            "workload_resource_request": ONE_CORE})
            return reply["allocations"][0]["nodename"]
        except BusError as error:
            return error.code

    outcomes = await asyncio.gather(*(one() for _ in range(40)))
    assert sorted(o for o in outcomes if o.startswith("p")) == ["p1"] * 4 + ["p2"] * 4 + ["p3"] * 4
    assert outcomes.count("insufficient_capacity") == 28
    for node in ("p1", "p2", "p3"):
        assert await held(call, node) == (4.0, 4)


async def test_a_deploy_that_names_a_taken_id_fails_alone(call, manager):
    await add_node(call, "q1", cpu=8, memory="64G")
    first = await call("allocate", {"nodename": "q1", "deploy_count": 1, "workload_resource_request": ONE_CORE,
                                    "workload_ids": ["taken"]})
    assert first["allocations"][0]["workload_id"] == "taken"

    async def one(ids: list[str]):
        try:
            return await call("allocate", {"nodename": "q1", "deploy_count": len(ids), "workload_ids": ids,
                                           "workload_resource_request": ONE_CORE})
        except BusError as error:
            return error.code

    outcomes = await asyncio.gather(one(["a1"]), one(["taken"]), one(["b1", "b2"]), one(["c1"]))
    assert outcomes[1] == "workload_exists"
    assert [[a["workload_id"] for a in o["allocations"]] for i, o in enumerate(outcomes) if i != 1] == [
        ["a1"], ["b1", "b2"], ["c1"]]
    assert await held(call, "q1") == (5.0, 5)  # taken, a1, b1, b2, c1: the first "taken" was not released


async def test_two_deploys_of_one_batch_that_name_the_same_id_place_it_once(call, manager):
    await add_node(call, "s1", cpu=8, memory="64G")
    requests = {name: ONE_CORE.get(name) for name in manager.plugins}
    leader = asyncio.create_task(manager.deploys.deploy("s1", ["lead"], requests))
    await asyncio.sleep(0)  # the leader's commit is in flight: the next two wait, and go together
    followers = [asyncio.create_task(manager.deploys.deploy("s1", ids, requests))
                 for ids in (["same"], ["x", "same"])]
    await leader
    outcomes = await asyncio.gather(*followers, return_exceptions=True)
    assert [a.workload_id for a in outcomes[0].allocations] == ["same"]
    assert isinstance(outcomes[1], BerthError) and outcomes[1].code == "workload_exists"
    assert await held(call, "s1") == (2.0, 2)  # usage is what the ledger explains: lead and same, once


async def test_a_caller_that_goes_away_while_waiting_leaves_nothing_placed(call, manager):
    await add_node(call, "r1", cpu=8, memory="64G")
    requests = {name: ONE_CORE.get(name) for name in manager.plugins}
    leader = asyncio.create_task(manager.deploys.deploy("r1", ["lead"], requests))
    await asyncio.sleep(0)  # the leader's commit is in flight: the next deploy waits for it
    assert "r1" in manager.deploys._waiting
    follower = asyncio.create_task(manager.deploys.deploy("r1", ["gone"], requests))
    await asyncio.sleep(0)
    follower.cancel()
    await leader
    with pytest.raises(asyncio.CancelledError):
        await follower

    async def settled() -> bool:
        return "r1" not in manager.deploys._waiting

    deadline = asyncio.get_running_loop().time() + 10
    while not await settled():
        assert asyncio.get_running_loop().time() < deadline
        await asyncio.sleep(0.01)
    allocations = (await call("get-allocations", {"nodename": "r1"}))["allocations"]
    assert [a["workload_id"] for a in allocations] == ["lead"]
    assert await held(call, "r1") == (1.0, 1)
