"""The allocation service over a real NATS and Redis: every command, error code and bad input."""

from __future__ import annotations

import asyncio

import msgpack
import pytest

from schemas.errors import BusError, NoResponders
from services.allocation.commands import MANAGER_COMMANDS
from tests.allocation_helpers import ONE_CORE, GiB, add_node, requester
from tests.bus_helpers import EventLog, idempotency_keys, with_request_id

UNBOUND = {"cpumem": {"cpu-request": 0.5, "memory-request": GiB}}


@pytest.fixture
async def alloc(serve_allocation):
    return await serve_allocation()


@pytest.fixture
def call(client, alloc):
    return requester(client)


def answer(error: BusError) -> tuple:
    """What a refusal says: a retry must answer exactly this again."""
    return error.code, error.status, error.message, error.details


async def error_of(call, command: str, payload: dict) -> BusError:
    with pytest.raises(BusError) as caught:
        await call(command, payload)
    return caught.value


# -- nodes -------------------------------------------------------------------------------------


async def test_add_node_creates_every_plugin_and_publishes(call, events):
    stream = await events.subscribe("resource.n1.>")
    reply = await add_node(call, "n1", cpu=4)
    assert set(reply["capacity"]) == {"cpumem", "storage", "gpu"}
    cpumem = reply["capacity"]["cpumem"]
    assert cpumem["cpu"] == 4 and cpumem["memory"] == 8 * GiB
    assert cpumem["cpu_map"] == {"0": 100, "1": 100, "2": 100, "3": 100}
    assert reply["usage"]["cpumem"]["cpu_map"] == {"0": 0, "1": 0, "2": 0, "3": 0}
    subject, event = await stream.next(timeout=2)
    assert subject.endswith("resource.n1.added") and event["type"] == "added" and event["nodename"] == "n1"
    assert event["after"]["capacity"]["cpu"] == 4
    await stream.close()

    err = await error_of(call, "add-node", {"nodename": "n1", "resource": {"cpumem": {"cpu": 2, "memory": "1G"}}})
    assert (err.code, err.status, err.details["field"]) == ("node_exists", 409, "nodename")


async def test_plugin_level_commands_use_unkeyed_maps(client, alloc):
    reply = await client.request(
        "resource.cpumem.add-node", {"nodename": "p1", "resource": {"cpu": 2, "memory": "2G"}}, dict
    )
    assert reply["capacity"]["cpu_map"] == {"0": 100, "1": 100}
    # Only cpumem knows the node: the manager level says which plugin lacks it.
    with pytest.raises(BusError) as caught:
        await client.request("resource.calculate-deploy", {"nodename": "p1", "deploy_count": 1}, dict)
    assert caught.value.code == "node_not_found" and caught.value.details["plugin"] == "storage"
    deploy = await client.request(
        "resource.cpumem.calculate-deploy",
        {"nodename": "p1", "deploy_count": 2, "workload_resource_request": ONE_CORE["cpumem"]},
        dict,
    )
    assert [e["cpu_map"] for e in deploy["engines_params"]] == [{"0": 100}, {"1": 100}]
    await client.request("resource.cpumem.remove-node", {"nodename": "p1"}, dict)
    with pytest.raises(BusError) as caught:
        await client.request("resource.cpumem.get-node-resource-info", {"nodename": "p1"}, dict)
    assert caught.value.code == "node_not_found"
    # Removing a missing node is not an error (eru), at either level.
    assert await client.request("resource.cpumem.remove-node", {"nodename": "p1"}, dict) == {}
    assert await client.request("resource.remove-node", {"nodename": "p1"}, dict) == {}


async def test_info_defaults_and_labels(call):
    reply = await call(
        "add-node",
        {"nodename": "e1", "info": {"ncpu": 2, "memory_total": 10 * GiB, "storage_total": 100 * GiB},
         "labels": {"city": "sz", "platform": "linux"}},
    )
    assert reply["capacity"]["cpumem"]["cpu"] == 2
    assert reply["capacity"]["cpumem"]["memory"] == 8 * GiB  # 80 % of what the engine reports
    await add_node(call, "e2", labels={"city": "bj"}, cpu=4)
    listed = await call("list-nodes", {"labels": {"city": "sz"}})
    assert [n["nodename"] for n in listed["nodes"]] == ["e1"] and listed["total"] == 1
    assert listed["nodes"][0]["labels"] == {"city": "sz", "platform": "linux"}
    await call("set-node-labels", {"nodename": "e2", "labels": {"city": "sz"}})
    listed = await call("list-nodes", {"labels": {"city": "sz"}, "limit": 1, "offset": 1})
    assert [n["nodename"] for n in listed["nodes"]] == ["e2"] and listed["total"] == 2


async def test_list_nodes_pages_in_name_order(call):
    for i in (3, 1, 2):
        await add_node(call, f"ln{i}", cpu=4)
    page = await call("list-nodes", {"limit": 2})
    assert [n["nodename"] for n in page["nodes"]] == ["ln1", "ln2"] and page["total"] == 3
    page = await call("list-nodes", {"limit": 2, "offset": 2})
    assert [n["nodename"] for n in page["nodes"]] == ["ln3"]
    assert (await error_of(call, "list-nodes", {"limit": 1001})).details["field"] == "limit"


# -- calculations ------------------------------------------------------------------------------


async def test_calculations_change_nothing(call):
    await add_node(call, "c1", cpu=4)
    deploy = await call("calculate-deploy", {"nodename": "c1", "deploy_count": 3, "workload_resource_request": ONE_CORE})
    assert len(deploy["engines_params"]) == 3 and len(deploy["workloads_resource"]) == 3
    assert all(set(e) == {"cpumem", "storage", "gpu"} for e in deploy["engines_params"])
    info = await call("get-node-resource-info", {"nodename": "c1"})
    assert info["usage"]["cpumem"]["cpu"] == 0 and info["diffs"] == []

    capacity = await call(
        "get-nodes-deploy-capacity", {"nodenames": ["c1"], "workload_resource_request": ONE_CORE}
    )
    assert capacity["total"] == 4
    assert capacity["nodes_deploy_capacity_map"]["c1"]["capacity"] == 4

    workload = deploy["workloads_resource"][0]
    realloc = await call(
        "calculate-realloc",
        {"nodename": "c1", "workload_resource": workload,
         "workload_resource_request": {"cpumem": {"keep-cpu-bind": True, "cpu-request": 1}}},
    )
    assert realloc["workload_resource"]["cpumem"]["cpu_request"] == 2
    assert realloc["delta_resource"]["cpumem"]["cpu_request"] == 1

    assert await call("calculate-remap", {"nodename": "missing", "workloads_resource": {}}) == {"engine_params_map": {}}


async def test_most_idle_and_metrics(call):
    await add_node(call, "i1", cpu=4)
    await add_node(call, "i2", cpu=4)
    await call("allocate", {"nodename": "i1", "deploy_count": 1, "workload_resource_request": ONE_CORE})
    idle = await call("get-most-idle-node", {"nodenames": ["i1", "i2"]})
    assert idle == {"nodename": "i2", "priority": 100}

    described = await call("get-metrics-description", {})
    names = [d["name"] for d in described["descriptions"]]
    assert "cpu_used" in names and len(names) == len(set(names))
    metrics = await call("get-metrics", {"podname": "pod", "nodename": "i1"})
    keys = [m["key"] for m in metrics["metrics"]]
    assert len(keys) == len(set(keys))
    assert all(isinstance(m["value"], (int, float)) and not isinstance(m["value"], bool) for m in metrics["metrics"])


# -- committed allocations -----------------------------------------------------------------------


async def test_allocate_then_release_restores_usage_exactly(call, events):
    await add_node(call, "a1", cpu=4)
    before = (await call("get-node-resource-info", {"nodename": "a1"}))["usage"]
    stream = await events.subscribe("resource.a1.*")
    placed = await call("allocate", {"nodename": "a1", "deploy_count": 3,
                                     "workload_resource_request": ONE_CORE})
    ids = [a["workload_id"] for a in placed["allocations"]]
    assert len(set(ids)) == 3 and all(a["nodename"] == "a1" for a in placed["allocations"])
    _, event = await stream.next(timeout=2)
    assert event["type"] == "allocated" and event["workload_ids"] == ids

    info = await call("get-node-resource-info", {"nodename": "a1"})
    assert info["usage"]["cpumem"]["cpu"] == 3 and info["diffs"] == []
    held = await call("get-allocations", {"nodename": "a1"})
    assert sorted(a["workload_id"] for a in held["allocations"]) == sorted(ids)

    released = await call("release", {"workload_ids": ids + ["unknown"]})
    assert released == {"released": sorted(ids)}
    _, event = await stream.next(timeout=2)
    assert event["type"] == "released"
    await stream.close()
    assert (await call("get-node-resource-info", {"nodename": "a1"}))["usage"] == before
    assert (await call("get-allocations", {"nodename": "a1"}))["allocations"] == []


async def test_allocate_is_all_or_nothing(call):
    await add_node(call, "f1", cpu=2)
    await add_node(call, "f2", cpu=2)
    err = await error_of(
        call, "allocate",
        {"nodenames": ["f1", "f2"], "strategy": "spread", "deploy_count": 5, "workload_resource_request": ONE_CORE},
    )
    assert err.code == "insufficient_capacity" and err.status == 409
    err = await error_of(
        call, "allocate",
        {"nodenames": ["f1", "f2"], "strategy": "each", "deploy_count": 3, "workload_resource_request": ONE_CORE},
    )
    assert err.code == "insufficient_capacity"
    for node in ("f1", "f2"):
        info = await call("get-node-resource-info", {"nodename": node})
        assert info["usage"]["cpumem"]["cpu"] == 0
        assert (await call("get-allocations", {"nodename": node}))["allocations"] == []


async def test_strategies_spread_pack_each(call):
    for node in ("s1", "s2", "s3"):
        await add_node(call, node, cpu=4)
    await call("allocate", {"nodename": "s2", "deploy_count": 1, "workload_resource_request": ONE_CORE})

    def count(reply):
        out: dict[str, int] = {}
        for a in reply["allocations"]:
            out[a["nodename"]] = out.get(a["nodename"], 0) + 1
        return out

    nodes = ["s1", "s2", "s3"]
    spread = await call("allocate", {"nodenames": nodes, "strategy": "spread", "deploy_count": 5, "workload_resource_request": ONE_CORE})
    assert count(spread) == {"s1": 2, "s2": 1, "s3": 2}
    await call("allocate", {"nodename": "s3", "deploy_count": 1, "workload_resource_request": ONE_CORE})
    # s3 is now the most used (3 of 4 cores): pack fills it first, then one of the next most used.
    pack = await call("allocate", {"nodenames": nodes, "strategy": "pack", "deploy_count": 2, "workload_resource_request": ONE_CORE})
    packed = count(pack)
    assert packed.pop("s3") == 1 and list(packed.values()) == [1] and set(packed) <= {"s1", "s2"}
    each = await call("allocate", {"nodenames": ["s1", "s2"], "strategy": "each", "deploy_count": 1, "workload_resource_request": UNBOUND})
    assert count(each) == {"s1": 1, "s2": 1}


async def test_realloc_by_workload_id(call):
    await add_node(call, "r1", cpu=4)
    [placed] = (await call("allocate", {"nodename": "r1", "deploy_count": 1, "workload_resource_request": ONE_CORE}))["allocations"]
    reply = await call(
        "realloc",
        {"workload_id": placed["workload_id"],
         "workload_resource_request": {"cpumem": {"keep-cpu-bind": True, "cpu-request": 1}}},
    )
    assert reply["nodename"] == "r1" and reply["workload_resource"]["cpumem"]["cpu_request"] == 2
    assert reply["delta_resource"]["cpumem"]["cpu_request"] == 1
    info = await call("get-node-resource-info", {"nodename": "r1"})
    assert info["usage"]["cpumem"]["cpu"] == 2 and info["diffs"] == []
    err = await error_of(call, "realloc", {"workload_id": "nope"})
    assert (err.code, err.status) == ("workload_not_found", 404)


async def test_remove_node_refuses_while_workloads_hold_it(call):
    await add_node(call, "rm1", cpu=4)
    placed = await call("allocate", {"nodename": "rm1", "deploy_count": 1, "workload_resource_request": ONE_CORE})
    err = await error_of(call, "remove-node", {"nodename": "rm1"})
    assert (err.code, err.status) == ("node_not_empty", 409)
    await call("release", {"workload_ids": [placed["allocations"][0]["workload_id"]]})
    await call("remove-node", {"nodename": "rm1"})
    assert (await error_of(call, "get-node-resource-info", {"nodename": "rm1"})).code == "node_not_found"
    assert (await call("list-nodes", {}))["total"] == 0


async def test_allocate_with_request_id_happens_once(call):
    await add_node(call, "id1", cpu=4)
    payload = {"nodename": "id1", "deploy_count": 2, "workload_resource_request": ONE_CORE, "request_id": "req-7"}
    first, second = await asyncio.gather(call("allocate", payload), call("allocate", payload))
    assert first == second
    assert (await call("get-node-resource-info", {"nodename": "id1"}))["usage"]["cpumem"]["cpu"] == 2


# -- set, fix and round trips --------------------------------------------------------------------


async def test_fix_node_resource_repairs_usage_from_the_ledger(call):
    await add_node(call, "fx1", cpu=4)
    await call("allocate", {"nodename": "fx1", "deploy_count": 2, "workload_resource_request": ONE_CORE})
    good = (await call("get-node-resource-info", {"nodename": "fx1"}))["usage"]
    await call(
        "set-node-resource-usage",
        {"nodename": "fx1", "resource_request": {"cpumem": {"memory": "1G"}}, "delta": True, "incr": True},
    )
    drifted = await call("get-node-resource-info", {"nodename": "fx1"})
    assert drifted["diffs"] and drifted["usage"]["cpumem"]["memory"] == good["cpumem"]["memory"] + GiB
    fixed = await call("fix-node-resource", {"nodename": "fx1"})
    assert fixed["diffs"] == drifted["diffs"] and fixed["usage"] == good
    assert (await call("get-node-resource-info", {"nodename": "fx1"}))["diffs"] == []


async def test_capacity_change_and_exact_info_round_trip(call):
    await add_node(call, "cap1", cpu=4)
    changed = await call(
        "set-node-resource-capacity",
        {"nodename": "cap1", "resource_request": {"cpumem": {"memory": "2G"}}, "delta": True, "incr": True},
    )
    assert changed["after"]["cpumem"]["memory"] == changed["before"]["cpumem"]["memory"] + 2 * GiB
    info = await call("get-node-resource-info", {"nodename": "cap1"})
    # Rollback the way eru core does it: set the snapshot back; the round trip is exact.
    await call("set-node-resource-capacity", {"nodename": "cap1", "resource": changed["before"], "incr": False})
    await call("set-node-resource-info", {"nodename": "cap1", "capacity": info["capacity"], "usage": info["usage"]})
    again = await call("get-node-resource-info", {"nodename": "cap1"})
    assert again["capacity"] == info["capacity"] and again["usage"] == info["usage"]


async def test_get_remove_set_round_trip_recreates_the_node(call, events):
    """set-node-resource-info creates records for a node that does not exist (eru), so it can
    restore a removed node exactly: in the index, announced as added, with every plugin's state."""
    await add_node(call, "rt1", cpu=3, storage={"volumes": ["/data:10G"], "storage": "20G"})
    await call("set-node-resource-usage", {"nodename": "rt1", "resource_request": {"cpumem": {"cpu": "0:30"}}})
    snapshot = await call("get-node-resource-info", {"nodename": "rt1"})
    await call("remove-node", {"nodename": "rt1"})
    stream = await events.subscribe("resource.rt1.>")
    await call("set-node-resource-info", {"nodename": "rt1", "capacity": snapshot["capacity"], "usage": snapshot["usage"]})
    restored = await call("get-node-resource-info", {"nodename": "rt1"})
    assert (restored["capacity"], restored["usage"]) == (snapshot["capacity"], snapshot["usage"])
    assert [n["nodename"] for n in (await call("list-nodes", {}))["nodes"]] == ["rt1"]
    added = [await stream.next(timeout=2) for _ in range(3)]
    assert sorted(e["plugin"] for _, e in added) == ["cpumem", "gpu", "storage"]
    assert {s.rsplit(".", 1)[-1] for s, _ in added} == {"added"}


# -- errors and bad input -------------------------------------------------------------------------


async def test_unknown_node_and_plugin(call, client, nc, prefix):
    err = await error_of(call, "calculate-deploy", {"nodename": "ghost", "deploy_count": 1})
    assert (err.code, err.status, err.details["nodename"]) == ("node_not_found", 404, "ghost")
    await add_node(call, "k1", cpu=4)
    err = await error_of(
        call, "calculate-deploy", {"nodename": "k1", "deploy_count": 1, "workload_resource_request": {"tpu": {}}}
    )
    assert (err.code, err.status, err.details["field"]) == ("plugin_not_found", 404, "workload_resource_request.tpu")
    # An unknown plugin in the subject has no endpoint at all.
    with pytest.raises(NoResponders):
        await client.request("resource.tpu.add-node", {"nodename": "x"}, timeout=2)


CPUMEM = "workload_resource_request.cpumem"

# (command, bad payload, the field at fault: its path from the payload root)
BAD_INPUT = [
    ("add-node", {"nodename": "bad.name", "resource": {"cpumem": {"cpu": 1, "memory": "1G"}}}, "nodename"),
    ("add-node", {"resource": {"cpumem": {"cpu": 1}}}, "nodename"),
    ("add-node", {"nodename": "b1", "resource": {"cpumem": {"cpu": "4", "memory": "1G"}}},
         "resource.cpumem.cpu"),
    ("add-node", {"nodename": "b1", "resource": {"cpumem": {"cpu": 2, "memory": "lots"}}},
         "resource.cpumem.memory"),
    ("add-node", {"nodename": "b1", "resource": {"cpumem": {"cpu": 2, "memory": -5}}},
         "resource.cpumem.memory"),
    ("calculate-deploy", {"nodename": "b0", "deploy_count": 0}, "deploy_count"),
    ("calculate-deploy", {"nodename": "b0", "deploy_count": "1"}, "deploy_count"),
    ("calculate-deploy", {"nodename": "b0", "deploy_count": 1,
                              "workload_resource_request": {"cpumem": {"cpu-request": float("nan")}}},
         f"{CPUMEM}.cpu-request"),
    ("calculate-deploy", {"nodename": "b0", "deploy_count": 1,
                              "workload_resource_request": {"cpumem": {"cpu-request": -1}}},
         f"{CPUMEM}.cpu-request"),
    ("calculate-deploy", {"nodename": "b0", "deploy_count": 1,
                              "workload_resource_request": {"cpumem": {"cpu-bind": None, "cpu-request": 1}}},
         f"{CPUMEM}.cpu-bind"),
    ("allocate", {"nodename": "b0", "nodenames": ["b0"], "deploy_count": 1}, "nodename"),
    ("allocate", {"nodenames": ["b0"], "strategy": "random", "deploy_count": 1}, "strategy"),
    ("release", {"workload_ids": []}, "workload_ids"),
    ("get-nodes-deploy-capacity", {"nodenames": "b0"}, "nodenames"),
]  # fmt: skip


@pytest.mark.parametrize("command,payload,field", BAD_INPUT)
async def test_bad_input_is_refused_naming_the_field_and_changes_nothing(
    call, nc, redis, prefix, command, payload, field
):
    await add_node(call, "b0", cpu=4)
    await call("allocate", {"nodename": "b0", "deploy_count": 1, "workload_resource_request": ONE_CORE})

    async def state():
        return (
            await call("get-node-resource-info", {"nodename": "b0"}),
            await call("get-allocations", {"nodename": "b0"}),
            await call("list-nodes", {}),
        )

    before = await state()
    log = await EventLog.open(nc, prefix, "resource.>")
    request = with_request_id(MANAGER_COMMANDS, command, payload, f"bad-{command}")
    err = await error_of(call, command, request)
    assert (err.code, err.status, err.details["field"]) == ("invalid_argument", 400, field), err.message
    assert err.message.startswith(f"{field}: ") and len(err.message) > len(field) + 2, err.message
    assert answer(await error_of(call, command, request)) == answer(err)  # a retry answers the same
    # Nothing changed: node record, ledger and listing as they were, no answer kept for the request
    # id (the corrected request may use it), no event before the sentinel.
    assert await state() == before
    assert len(before[1]["allocations"]) == 1 and before[2]["total"] == 1
    assert await idempotency_keys(redis, prefix) == []
    await call("set-node-labels", {"nodename": "b0", "labels": {"sentinel": "1"}})
    assert await log.before(log.subject("resource.b0.labels")) == []
    await log.close()


async def test_garbage_bytes_get_invalid_argument(alloc, nc, prefix, call):
    msg = await nc.request(f"{prefix}.resource.allocate", b"\xff\x00\x13garbage", timeout=2)
    assert msg.headers["Nats-Service-Error-Code"] == "400"
    assert msgpack.unpackb(msg.data)["error"]["code"] == "invalid_argument"
    assert (await call("plugins", {})) == {"plugins": ["cpumem", "storage", "gpu"]}
