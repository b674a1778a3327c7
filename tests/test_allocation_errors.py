"""Every allocation error code over the bus, with its status, and nothing changed by the failure."""

from __future__ import annotations

import pytest

from schemas.errors import BusError
from services.allocation.commands import MANAGER_COMMANDS
from tests.allocation_helpers import GiB, requester
from tests.bus_helpers import EventLog, idempotency_keys, with_request_id

NODE = {
    "cpumem": {"cpu": 2, "memory": "4G"},
    "storage": {"volumes": ["/data:100G"], "storage": "200G"},
    "gpu": {"prod_count_map": {"nvidia-3070": 2}},
}


@pytest.fixture
async def call(serve_allocation, client):
    await serve_allocation()
    call = requester(client)
    await call("add-node", {"nodename": "e0", "resource": NODE})
    return call


def deploy(request: dict, count: int = 1) -> dict:
    return {"nodename": "e0", "deploy_count": count, "workload_resource_request": request}


async def held_workload(call, request: dict) -> dict:
    placed = await call("allocate", deploy(request))
    return placed["allocations"][0]


CHANGES_STATE = {"add-node", "allocate", "realloc", "set-node-resource-info"}  # among the commands below
CPUMEM = "workload_resource_request.cpumem"
STORAGE = "workload_resource_request.storage"

CASES = [
    # (code, status, command, payload, for a 400 the field at fault: its path from the payload root)
    ("invalid_argument", 400, "calculate-deploy", {"nodename": "e0", "deploy_count": -1}, "deploy_count"),
    # A negative quantity is invalid_argument (DESIGN.md §2); eru's codes are for what only the
    # plugin can judge: a bound request without a quantity, a delta that leaves a negative total.
    ("invalid_argument", 400, "calculate-deploy", deploy({"cpumem": {"cpu-request": -1}}),
     f"{CPUMEM}.cpu-request"),
    ("invalid_argument", 400, "calculate-deploy", deploy({"cpumem": {"memory-request": -1}}),
     f"{CPUMEM}.memory-request"),
    ("invalid_argument", 400, "calculate-deploy", deploy({"storage": {"storage-request": "lots"}}),
     f"{STORAGE}.storage-request"),
    ("invalid_cpu", 400, "calculate-deploy", deploy({"cpumem": {"cpu-bind": True}}),
     f"{CPUMEM}.cpu-request"),
    ("invalid_cpu", 400, "realloc",
     {"workload_id": "held", "workload_resource_request": {"cpumem": {"cpu-request": -1}}},
     f"{CPUMEM}.cpu-request"),
    ("invalid_memory", 400, "realloc",
     {"workload_id": "held", "workload_resource_request": {"cpumem": {"memory-request": -GiB}}},
     f"{CPUMEM}.memory-request"),
    ("invalid_storage", 400, "realloc",
     {"workload_id": "held", "workload_resource_request": {"storage": {"storage-request": "-1G"}}},
     f"{STORAGE}.storage-request"),
    ("invalid_cpu_map", 400, "add-node", {"nodename": "x1", "resource": {"cpumem": {"memory": "1G"}}},
     "resource.cpumem.cpu"),
    ("invalid_numa_cpu", 400, "set-node-resource-info",
     {"nodename": "e0", "capacity": {"cpumem": {"cpu": 2, "cpu_map": {"0": 100, "1": 100}, "memory": GiB,
                                                "numa_memory": {"0": GiB}, "numa": {"0": "0"}}},
      "usage": {"cpumem": {}}}, "capacity.cpumem.numa"),
    ("invalid_numa_memory", 400, "add-node",
     {"nodename": "x2", "resource": {"cpumem": {"cpu": 2, "memory": "2G", "numa-cpu": ["0", "1"],
                                                "numa-memory": ["1G"]}}},
     "resource.cpumem.numa-memory"),
    ("invalid_volume", 400, "calculate-deploy", deploy({"storage": {"volumes": ["bad::::"]}}),
     f"{STORAGE}.volumes[0]"),
    ("insufficient_capacity", 409, "calculate-deploy",
     deploy({"cpumem": {"cpu-bind": True, "cpu-request": 1}}, 3), None),
    ("insufficient_resource", 409, "allocate",
     deploy({"gpu": {"prod_count_map": {"nvidia-3070": 1}}}, 3), None),
    ("insufficient_resource", 409, "calculate-deploy", deploy({"storage": {"storage-request": "1T"}}), None),
    ("insufficient_resource", 409, "allocate", deploy({"storage": {"volumes": ["AUTO:/d:rw:60G"]}}, 2), None),
    ("node_exists", 409, "add-node", {"nodename": "e0", "resource": {"cpumem": {"cpu": 1}}}, None),
    ("node_not_found", 404, "get-node-resource-info", {"nodename": "nope"}, None),
    ("plugin_not_found", 404, "calculate-deploy", deploy({"fpga": {"count": 1}}), None),
    ("workload_not_found", 404, "realloc", {"workload_id": "missing"}, None),
]  # fmt: skip


@pytest.mark.parametrize("code,status,command,payload,field", CASES, ids=[f"{c[0]}-{c[2]}" for c in CASES])
async def test_error_code(call, nc, redis, prefix, code, status, command, payload, field):
    held = {"cpumem": {"cpu-request": 0.1, "memory-request": 1 << 20}}
    await call("allocate", {**deploy(held), "workload_ids": ["held"]})  # a ledger entry

    async def state():
        return (
            await call("get-node-resource-info", {"nodename": "e0"}),
            await call("get-allocations", {"nodename": "e0"}),
            await call("list-nodes", {}),
        )

    before = await state()
    log = await EventLog.open(nc, prefix, "resource.>")
    request = with_request_id(MANAGER_COMMANDS, command, payload, f"failing-{command}")
    with pytest.raises(BusError) as caught:
        await call(command, request)
    err = caught.value
    assert (err.code, err.status) == (code, status), err.message
    assert err.message
    if status == 400:
        assert err.details["field"] == field, err.details
    with pytest.raises(BusError) as caught:  # a retry answers the same
        await call(command, request)
    again = caught.value
    assert (again.code, again.status, again.message, again.details) == (err.code, status, err.message, err.details)
    # Nothing changed by the failure: node record, ledger, listing; no event before the sentinel.
    # A 400 (the request did nothing) keeps no answer; any other refusal of a command that changes
    # state is kept for its retries (the others take no request id).
    assert await state() == before
    assert len(before[1]["allocations"]) == 1 and before[2]["total"] == 1
    kept = [key.rsplit(":", 1)[-1] for key in await idempotency_keys(redis, prefix)]
    assert kept == ([request["request_id"]] if status != 400 and command in CHANGES_STATE else [])
    await call("set-node-labels", {"nodename": "e0", "labels": {"sentinel": "1"}})
    assert await log.before(log.subject("resource.e0.labels")) == []
    await log.close()


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
