"""The allocation service on a Redis Cluster: every command whose keys span slots (multi-node
allocate with its intent, release over several nodes, realloc, labels, listings, request ids)."""

from __future__ import annotations

import pytest

from bus.client import BusClient
from bus.redis import connect_redis
from schemas.errors import BusError
from tests.conftest import new_prefix
from tests.worker_helpers import start_worker, stop_workers

BOUND = {"cpumem": {"cpu-bind": True, "cpu-request": 1}}


@pytest.fixture
async def cluster_allocation(nats_url, nc, redis_cluster):
    prefix = new_prefix()
    workers = [start_worker("services.allocation.worker", nats_url, redis_cluster.url, prefix) for _ in range(2)]
    yield BusClient(nc, prefix=prefix, timeout=10)
    stop_workers(workers)
    redis = connect_redis(redis_cluster.url)
    async for key in redis.scan_iter(match=f"{prefix}:*"):
        await redis.delete(key)
    await redis.aclose()


async def test_every_allocation_command_works_across_slots(cluster_allocation):
    client = cluster_allocation
    nodes = [f"s{i}" for i in range(6)]  # their keys fall in different slots, on different primaries
    for node in nodes:
        resource = {"cpumem": {"cpu": 2, "memory": "8G"}}
        await client.request("resource.add-node", {"nodename": node, "resource": resource, "labels": {"rack": node[-1]}})
    placed = await client.request("resource.allocate", {
        "nodenames": nodes, "strategy": "spread", "deploy_count": 6, "workload_resource_request": BOUND,
        "request_id": "cluster-1",
    })
    assert sorted(a["nodename"] for a in placed["allocations"]) == nodes  # one per node: an intent over six slots
    again = await client.request("resource.allocate", {
        "nodenames": nodes, "strategy": "spread", "deploy_count": 6, "workload_resource_request": BOUND,
        "request_id": "cluster-1",
    })
    assert again == placed  # the kept answer
    ids = [a["workload_id"] for a in placed["allocations"]]
    moved = await client.request("resource.realloc", {"workload_id": ids[0], "workload_resource_request":
                                                      {"cpumem": {"keep-cpu-bind": True, "cpu-request": 1}}})
    assert moved["workload_resource"]["cpumem"]["cpu_request"] == 2
    by_label = await client.request("resource.allocate", {"labels": {"rack": "3"}, "deploy_count": 1,
                                                          "workload_resource_request": BOUND})
    assert by_label["allocations"][0]["nodename"] == "s3"
    released = await client.request("resource.release", {"workload_ids": ids + [by_label["allocations"][0]["workload_id"]]})
    assert sorted(released["released"]) == sorted(ids + [by_label["allocations"][0]["workload_id"]])
    listing = await client.request("resource.list-nodes", {"labels": {"rack": "1"}})
    assert [n["nodename"] for n in listing["nodes"]] == ["s1"]
    for node in nodes:
        info = await client.request("resource.get-node-resource-info", {"nodename": node})
        assert info["usage"]["cpumem"]["cpu"] == 0 and info["diffs"] == []
        await client.request("resource.remove-node", {"nodename": node})
    with pytest.raises(BusError) as caught:
        await client.request("resource.get-node-resource-info", {"nodename": "s0"})
    assert caught.value.code == "node_not_found"
