"""Every allocation error code over the bus, with its status, and nothing changed by the failure."""

from __future__ import annotations

import pytest

from bus.errors import BusError
from services.allocation.manager import ResourceManager
from services.allocation.store import NodeStore
from services.allocation.worker import make_plugins, make_service
from bus.idempotency import IdempotencyStore

GiB = 1 << 30
NODE = {
    "cpumem": {"cpu": 2, "memory": "4G"},
    "storage": {"volumes": ["/data:100G"], "storage": "200G"},
    "gpu": {"prod_count_map": {"nvidia-3070": 2}},
}


@pytest.fixture
async def call(serve, prefix, redis, events, client):
    manager = ResourceManager(NodeStore(redis, prefix), make_plugins(), events)
    await manager.watch()
    await serve(make_service(manager, prefix, IdempotencyStore(redis, prefix=prefix)))

    async def call(command: str, payload: dict) -> dict:
        return await client.request(f"resource.{command}", payload, dict)

    await call("add-node", {"nodename": "e0", "resource": NODE})
    yield call
    await manager.unwatch()


def deploy(request: dict, count: int = 1) -> dict:
    return {"nodename": "e0", "deploy_count": count, "workload_resource_request": request}


async def held_workload(call, request: dict) -> dict:
    placed = await call("allocate", deploy(request))
    return placed["allocations"][0]


CASES = [
    # (code, status, command, payload)
    ("invalid_argument", 400, "calculate-deploy", {"nodename": "e0", "deploy_count": -1}),
    ("invalid_argument", 400, "calculate-deploy", deploy({"cpumem": {"cpu-request": -1}})),
    ("invalid_cpu", 400, "calculate-deploy", deploy({"cpumem": {"cpu-bind": True}})),
    ("invalid_argument", 400, "calculate-deploy", deploy({"cpumem": {"memory-request": -1}})),
    ("invalid_cpu_map", 400, "add-node", {"nodename": "x1", "resource": {"cpumem": {"memory": "1G"}}}),
    ("invalid_numa_cpu", 400, "set-node-resource-info",
     {"nodename": "e0", "capacity": {"cpumem": {"cpu": 2, "cpu_map": {"0": 100, "1": 100}, "memory": GiB,
                                                "numa_memory": {"0": GiB}, "numa": {"0": "0"}}},
      "usage": {"cpumem": {}}}),
    ("invalid_numa_memory", 400, "add-node",
     {"nodename": "x2", "resource": {"cpumem": {"cpu": 2, "memory": "2G", "numa-cpu": ["0", "1"],
                                                "numa-memory": ["1G"]}}}),
    ("invalid_volume", 400, "calculate-deploy", deploy({"storage": {"volumes": ["bad::::"]}})),
    ("invalid_argument", 400, "calculate-deploy", deploy({"storage": {"storage-request": "lots"}})),
    ("insufficient_capacity", 409, "calculate-deploy", deploy({"cpumem": {"cpu-bind": True, "cpu-request": 1}}, 3)),
    ("insufficient_resource", 409, "allocate", deploy({"gpu": {"prod_count_map": {"nvidia-3070": 1}}}, 3)),
    ("insufficient_resource", 409, "calculate-deploy", deploy({"storage": {"storage-request": "1T"}})),
    ("insufficient_resource", 409, "allocate", deploy({"storage": {"volumes": ["AUTO:/d:rw:60G"]}}, 2)),
    ("node_exists", 409, "add-node", {"nodename": "e0"}),
    ("node_not_found", 404, "get-node-resource-info", {"nodename": "nope"}),
    ("plugin_not_found", 404, "calculate-deploy", deploy({"fpga": {"count": 1}})),
    ("workload_not_found", 404, "realloc", {"workload_id": "missing"}),
]


@pytest.mark.parametrize("code,status,command,payload", CASES, ids=[f"{c[0]}-{c[2]}" for c in CASES])
async def test_error_code(call, code, status, command, payload):
    before = await call("get-node-resource-info", {"nodename": "e0"})
    with pytest.raises(BusError) as caught:
        await call(command, payload)
    assert (caught.value.code, caught.value.status) == (code, status), caught.value.message
    assert caught.value.message
    if status == 400:
        assert caught.value.details.get("field"), caught.value.details
    after = await call("get-node-resource-info", {"nodename": "e0"})
    assert after == before
    assert (await call("list-nodes", {}))["total"] == 1


async def test_insufficient_resource_on_bound_storage_and_gpu_realloc(call):
    cases = [
        ({"cpumem": {"cpu-bind": True, "cpu-request": 1}}, {"cpumem": {"keep-cpu-bind": True, "cpu-request": 5}}),
        ({"storage": {"volumes": ["AUTO:/data:rw:10G"]}}, {"storage": {"volumes": ["AUTO:/data:rw:500G"]}}),
        ({"gpu": {"prod_count_map": {"nvidia-3070": 1}}}, {"gpu": {"prod_count_map": {"nvidia-3070": 5}}}),
    ]
    for request, growth in cases:
        held = await held_workload(call, request)
        before = await call("get-node-resource-info", {"nodename": "e0"})
        with pytest.raises(BusError) as caught:
            await call("realloc", {"workload_id": held["workload_id"], "workload_resource_request": growth})
        assert (caught.value.code, caught.value.status) == ("insufficient_resource", 409), caught.value.message
        assert await call("get-node-resource-info", {"nodename": "e0"}) == before
        await call("release", {"workload_ids": [held["workload_id"]]})


async def test_node_not_empty_and_workload_exists(call):
    held = await held_workload(call, {"cpumem": {"cpu-request": 0.5}})
    with pytest.raises(BusError) as caught:
        await call("remove-node", {"nodename": "e0"})
    assert (caught.value.code, caught.value.status) == ("node_not_empty", 409)
    with pytest.raises(BusError) as caught:
        await call("allocate", {**deploy({"cpumem": {"cpu-request": 0.5}}), "workload_ids": [held["workload_id"]]})
    assert (caught.value.code, caught.value.status) == ("workload_exists", 409)
    info = await call("get-node-resource-info", {"nodename": "e0"})
    assert info["usage"]["cpumem"]["cpu"] == 0.5 and info["diffs"] == []
