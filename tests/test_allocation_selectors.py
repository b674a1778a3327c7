"""Selecting nodes by label (or every node) instead of listing them: allocate,
get-nodes-deploy-capacity, get-most-idle-node and list-nodes, kept exact as nodes come, go and are
relabelled, also across worker processes."""

from __future__ import annotations

import asyncio

import pytest

from schemas.errors import BusError
from tests.allocation_helpers import ONE_CORE, add_node, requester


@pytest.fixture
async def call(serve_allocation, client):
    await serve_allocation()
    return requester(client)


def nodes_of(reply: dict) -> list[str]:
    return sorted(a["nodename"] for a in reply["allocations"])


async def allocate(call, count: int, **selection) -> dict:
    return await call("allocate", {"deploy_count": count, "workload_resource_request": ONE_CORE, **selection})


async def test_allocate_by_labels_places_only_on_matching_nodes(call):
    await add_node(call, "a1", labels={"pool": "a", "zone": "x"})
    await add_node(call, "a2", labels={"pool": "a", "zone": "y"})
    await add_node(call, "b1", labels={"pool": "b", "zone": "x"})
    placed = await allocate(call, 4, labels={"pool": "a"}, strategy="spread")
    assert nodes_of(placed) == ["a1", "a1", "a2", "a2"]
    # Every key must match.
    err = await call_error(call, "allocate", {"deploy_count": 1, "labels": {"pool": "a", "zone": "x"},
                                              "workload_resource_request": ONE_CORE})
    assert (err.code, err.status) == ("insufficient_capacity", 409)
    assert nodes_of(await allocate(call, 2, labels={"zone": "x"})) == ["b1", "b1"]


async def test_neither_nodenames_nor_labels_means_every_node(call):
    for node in ("e1", "e2", "e3"):
        await add_node(call, node, labels={"n": node})
    assert nodes_of(await allocate(call, 6, strategy="spread")) == ["e1", "e1", "e2", "e2", "e3", "e3"]
    capacity = await call("get-nodes-deploy-capacity", {"workload_resource_request": ONE_CORE})
    assert capacity["total"] == 0 and sorted(capacity["nodes_deploy_capacity_map"]) == []
    free = await call("get-nodes-deploy-capacity", {"workload_resource_request": {"cpumem": {"cpu-request": 0.1}}})
    assert sorted(free["nodes_deploy_capacity_map"]) == ["e1", "e2", "e3"]


async def test_each_places_on_every_matching_node(call):
    await add_node(call, "c1", labels={"rack": "r1"})
    await add_node(call, "c2", labels={"rack": "r1"})
    await add_node(call, "c3", labels={"rack": "r2"})
    placed = await allocate(call, 1, labels={"rack": "r1"}, strategy="each")
    assert nodes_of(placed) == ["c1", "c2"]


async def test_nodenames_and_labels_together_select_the_listed_nodes_that_match(call):
    await add_node(call, "d1", labels={"pool": "a"})
    await add_node(call, "d2", labels={"pool": "a"})
    await add_node(call, "d3", labels={"pool": "b"})
    capacity = await call("get-nodes-deploy-capacity", {
        "nodenames": ["d2", "d3"], "labels": {"pool": "a"}, "workload_resource_request": ONE_CORE})
    assert capacity["nodes_deploy_capacity_map"].keys() == {"d2"} and capacity["total"] == 2


async def test_views_follow_nodes_added_removed_and_relabelled(call):
    await add_node(call, "f1", labels={"pool": "a"})
    assert nodes_of(await allocate(call, 2, labels={"pool": "a"})) == ["f1", "f1"]  # f1 is full now
    await add_node(call, "f2", labels={"pool": "a"})  # joins the selection the worker already holds
    assert nodes_of(await allocate(call, 1, labels={"pool": "a"})) == ["f2"]
    await call("set-node-labels", {"nodename": "f2", "labels": {"pool": "b"}})  # leaves it
    err = await call_error(call, "allocate", {"deploy_count": 1, "labels": {"pool": "a"}, "workload_resource_request": ONE_CORE})
    assert err.code == "insufficient_capacity"
    assert nodes_of(await allocate(call, 1, labels={"pool": "b"})) == ["f2"]
    await call("set-node-labels", {"nodename": "f1", "labels": {}})
    err = await call_error(call, "allocate", {"deploy_count": 1, "labels": {"pool": "a"}, "workload_resource_request": ONE_CORE})
    assert (err.code, err.status, err.details["field"]) == ("node_not_found", 404, "labels")


async def test_most_idle_by_labels(call):
    await add_node(call, "g1", labels={"pool": "a"}, cpu=4)
    await add_node(call, "g2", labels={"pool": "a"}, cpu=4)
    await add_node(call, "g3", labels={"pool": "b"}, cpu=4)
    await allocate(call, 1, nodename="g1")
    assert (await call("get-most-idle-node", {"labels": {"pool": "a"}}))["nodename"] == "g2"
    assert (await call("get-most-idle-node", {}))["nodename"] == "g2"  # g2 and g3 tie: the smaller name
    err = await call_error(call, "get-most-idle-node", {"labels": {"pool": "zzz"}})
    assert (err.code, err.details["field"]) == ("node_not_found", "labels")


async def test_a_node_missing_a_plugin_is_left_out_of_a_label_selection(call, client):
    await add_node(call, "h1", labels={"pool": "a"})
    await add_node(call, "h2", labels={"pool": "a"})
    await client.request("resource.gpu.remove-node", {"nodename": "h2"}, dict)
    capacity = await call("get-nodes-deploy-capacity", {"labels": {"pool": "a"}, "workload_resource_request": ONE_CORE})
    assert capacity["nodes_deploy_capacity_map"].keys() == {"h1"}
    # Listed by name, the same node is an error that names the missing plugin.
    err = await call_error(call, "get-nodes-deploy-capacity", {"nodenames": ["h2"], "workload_resource_request": ONE_CORE})
    assert (err.code, err.details["plugin"]) == ("node_not_found", "gpu")


async def test_list_nodes_pages_by_labels_and_in_full(call):
    for i in range(7):
        await add_node(call, f"l{i}", labels={"odd": str(i % 2)})
    page = await call("list-nodes", {"labels": {"odd": "1"}, "limit": 2})
    assert [n["nodename"] for n in page["nodes"]] == ["l1", "l3"] and page["total"] == 3
    page = await call("list-nodes", {"labels": {"odd": "1"}, "offset": 2, "limit": 2})
    assert [n["nodename"] for n in page["nodes"]] == ["l5"] and page["total"] == 3
    everything = await call("list-nodes", {"offset": 5, "limit": 10})
    assert [n["nodename"] for n in everything["nodes"]] == ["l5", "l6"] and everything["total"] == 7
    assert (await call("list-nodes", {"labels": {"odd": "2"}})) == {"nodes": [], "total": 0, "next_offset": None}


async def test_nodename_with_labels_or_nodenames_is_invalid(call):
    await add_node(call, "i1", labels={"pool": "a"})
    for extra in ({"labels": {"pool": "a"}}, {"nodenames": ["i1"]}):
        err = await call_error(call, "allocate", {"nodename": "i1", "deploy_count": 1, **extra})
        assert (err.code, err.status, err.details["field"]) == ("invalid_argument", 400, "nodename")


async def test_label_changes_made_through_one_worker_reach_the_others(spawn_worker, client):
    spawn_worker("services.allocation.worker")
    spawn_worker("services.allocation.worker")

    call = requester(client)
    await add_node(call, "w1", labels={"pool": "a"}, cpu=64)
    await add_node(call, "w2", labels={"pool": "b"}, cpu=64)
    for _ in range(8):  # both workers hold a view of pool a (a queue group spreads the requests)
        assert nodes_of(await allocate(call, 1, labels={"pool": "a"})) == ["w1"]
    await call("set-node-labels", {"nodename": "w1", "labels": {"pool": "b"}})
    await call("set-node-labels", {"nodename": "w2", "labels": {"pool": "a"}})

    async def only_w2() -> bool:
        placed = [nodes_of(await allocate(call, 1, labels={"pool": "a"})) for _ in range(8)]
        return all(p == ["w2"] for p in placed)

    # The other worker learns of the change from its event; poll until both place on w2 only.
    deadline = asyncio.get_running_loop().time() + 10
    while not await only_w2():
        assert asyncio.get_running_loop().time() < deadline, "a worker kept placing on a node that left the pool"


async def call_error(call, command: str, payload: dict) -> BusError:
    with pytest.raises(BusError) as caught:
        await call(command, payload)
    return caught.value


async def test_a_capacity_query_over_more_nodes_than_a_reply_can_carry_names_the_selection(
    serve_allocation, client
):
    await serve_allocation(watch=False, max_payload=16 * 1024)

    call = requester(client)
    for i in range(400):  # about 40 bytes each in the answer: 16 KiB holds fewer
        await add_node(call, f"n{i:03d}", labels={"pool": "a"}, cpu=4)
    query = {"workload_resource_request": ONE_CORE}
    error = await call_error(call, "get-nodes-deploy-capacity", {**query, "labels": {"pool": "a"}})
    assert (error.code, error.field) == ("invalid_argument", "labels") and "400 nodes" in str(error)
    some = await call("get-nodes-deploy-capacity", {**query, "nodenames": ["n000", "n001"]})
    assert some["total"] == 8


async def test_a_view_read_a_chunk_at_a_time_counts_every_node_and_names_a_missing_one(call, monkeypatch):
    monkeypatch.setattr("services.allocation.fleet.REFRESH_CHUNK", 3)
    names = [f"c{i:02d}" for i in range(10)]
    for name in names:
        await add_node(call, name, labels={}, cpu=4)
    query = {"workload_resource_request": ONE_CORE}
    assert (await call("get-nodes-deploy-capacity", {**query, "nodenames": names}))["total"] == 40
    with_missing = {**query, "nodenames": names[:7] + ["nope"] + names[7:]}
    missing = await call_error(call, "get-nodes-deploy-capacity", with_missing)
    assert missing.code == "node_not_found" and "nope" in str(missing)
    await add_node(call, "nope", labels={}, cpu=4)
    again = await call("get-nodes-deploy-capacity", with_missing)
    assert again["total"] == 44  # the chunks after the missing node were read this time


async def test_list_nodes_pages_never_exceed_the_max_payload(serve_allocation, client):
    """No reply may exceed the server's max payload: a page of big nodes holds fewer than `limit`,
    and `next_offset` leads through every node exactly once."""
    await serve_allocation(watch=False, max_payload=16 * 1024)
    names = [f"big{i:02d}" for i in range(30)]
    for name in names:
        await client.request("resource.add-node", {"nodename": name, "resource": {"cpumem": {"cpu": 128, "memory": "8G"}}}, dict)
    seen, offset, pages = [], 0, 0
    while offset is not None:
        page = await client.request("resource.list-nodes", {"offset": offset, "limit": 1000}, dict)
        assert page["total"] == 30 and page["nodes"]
        seen += [n["nodename"] for n in page["nodes"]]
        offset, pages = page["next_offset"], pages + 1
    assert seen == names and pages > 1
