"""What a dead worker leaves behind is cleaned up: half-done multi-node allocations, unanswered retries."""

from __future__ import annotations

import time

import pytest

from services.allocation.records import Intent
from tests.allocation_helpers import ONE_CORE, add_node, requester
from tests.bus_helpers import eventually


@pytest.fixture
async def manager(serve_allocation):
    return await serve_allocation(sweep_interval=0.2)


@pytest.fixture
def call(client, manager):
    return requester(client)


async def used_cpus(call, node: str) -> float:
    return (await call("get-node-resource-info", {"nodename": node}))["usage"]["cpumem"]["cpu"]


async def test_half_done_multi_node_allocation_is_released_by_the_reaper(call, manager):
    for node in ("h1", "h2"):
        await add_node(call, node, cpu=4)
    # What a worker that died between its two node commits leaves: one node committed, the
    # intent naming all ids still there, its deadline passed.
    await call("allocate", {"nodename": "h1", "deploy_count": 1, "workload_resource_request": ONE_CORE,
                            "workload_ids": ["w1"]})
    await manager.store.begin_intent("dead-worker", Intent(time.time() - 1, ["w1", "w2"], None))
    assert await used_cpus(call, "h1") == 1

    async def reaped():
        return await used_cpus(call, "h1") == 0

    await eventually(reaped)
    assert await manager.store.expired_intents(time.time() + 3600) == {}
    assert (await call("get-allocations", {"nodename": "h1"}))["allocations"] == []


async def test_finished_multi_node_allocation_leaves_no_intent(call, manager):
    for node in ("m1", "m2"):
        await add_node(call, node, cpu=1)
    placed = await call("allocate", {"nodenames": ["m1", "m2"], "strategy": "spread", "deploy_count": 2,
                                     "workload_resource_request": ONE_CORE})
    assert sorted(a["nodename"] for a in placed["allocations"]) == ["m1", "m2"]
    assert await manager.store.expired_intents(time.time() + 3600) == {}


async def test_retry_of_an_unanswered_allocate_places_once(call, redis, prefix):
    await add_node(call, "u1", cpu=4)
    request = {"nodename": "u1", "deploy_count": 2, "workload_resource_request": ONE_CORE, "request_id": "job-9"}
    first = await call("allocate", request)
    # The worker died after committing but before it could keep its answer: its claim is left
    # without an answer, and its lease runs out.
    [claim] = [k async for k in redis.scan_iter(match=f"{prefix}:idem:*")]
    await redis.hdel(claim, "r")
    await redis.hset(claim, mapping={"t": "a-dead-worker", "u": 0})
    again = await call("allocate", request)
    # The retry took the claim over: it gave back what the unanswered run placed and placed anew.
    first_ids = {a["workload_id"] for a in first["allocations"]}
    again_ids = {a["workload_id"] for a in again["allocations"]}
    assert len(again_ids) == 2 and not first_ids & again_ids
    held = await call("get-allocations", {"nodename": "u1"})
    assert {a["workload_id"] for a in held["allocations"]} == again_ids
    assert await used_cpus(call, "u1") == 2
    info = await call("get-node-resource-info", {"nodename": "u1"})
    assert info["diffs"] == []
    # And that answer is kept: a further retry replays it.
    assert await call("allocate", request) == again

@pytest.mark.parametrize("selection", [{"nodename": "f1"}, {"nodenames": ["f1", "f2"]}], ids=["node", "nodes"])
async def test_a_retry_whose_claim_was_lost_gives_back_its_own_placement_on_a_full_node(
    call, redis, prefix, selection
):
    # A Redis failover can lose a claim's last writes (replication is asynchronous) while the
    # node's ledger, in another slot, keeps the placement. The retry then runs as the first run
    # again, and the only room left is the room that very run took.
    for node in ("f1", "f2"):
        await add_node(call, node, cpu=1)
    await call("allocate", {"nodename": "f2", "deploy_count": 1, "workload_resource_request": ONE_CORE})  # f2 full
    request = {**selection, "deploy_count": 1, "workload_resource_request": ONE_CORE, "request_id": "lost-1"}
    first = await call("allocate", request)
    [claim] = [k async for k in redis.scan_iter(match=f"{prefix}:idem:*")]
    await redis.delete(claim)
    again = await call("allocate", request)
    assert again == first  # the same run's ids, placed once: nothing left behind, nothing refused
    held = await call("get-allocations", {"nodename": "f1"})
    assert [a["workload_id"] for a in held["allocations"]] == [a["workload_id"] for a in first["allocations"]]
    assert await used_cpus(call, "f1") == 1
