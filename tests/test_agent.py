"""`berth agent` against a real allocation service: it registers its host (less the reservations),
follows the host's changes without touching usage, keeps its node's lease, starts and stops
instances over the bus (admins only), drains, and stops what the node's ledger no longer holds."""

from __future__ import annotations

import logging

import pytest

from schemas.errors import BusError
from tests.agent_helpers import TTL, ready, start_request
from tests.agent_hosts import set_online
from tests.allocation_helpers import GiB, requester
from tests.bus_helpers import eventually

pytest_plugins = ["tests.agent_fixtures", "tests.broker_fixtures"]


@pytest.fixture
async def call(serve_allocation, client):
    await serve_allocation(lease_interval=0.05)
    return requester(client, service=None)  # the whole subject: resource.* and agent.*


async def node(call, name: str) -> dict:
    return (await call("resource.list-nodes", {"nodenames": [name]}))["nodes"][0]


async def test_the_agent_registers_its_host_less_the_reservations(call, start_agent):
    await start_agent("h1", cpus=8, numa_nodes=2, memory=16 * GiB, reserve_cpu=1.5, reserve_memory=2 * GiB,
                      labels={"city": "sz", "pool": "a"})
    listed = await node(call, "h1")
    cpumem = listed["capacity"]["cpumem"]
    assert sorted(cpumem["cpu_map"].items(), key=lambda kv: int(kv[0])) == [
        *((str(c), 100) for c in range(6)), ("6", 50)]  # cores 7 and half of 6 are the system's
    assert cpumem["memory"] == 14 * GiB
    assert cpumem["numa_memory"] == {"0": 7 * GiB, "1": 7 * GiB}
    assert cpumem["numa"] == {**{str(c): "0" for c in range(4)}, **{str(c): "1" for c in range(4, 7)}}
    assert listed["labels"] == {"city": "sz", "pool": "a"}
    assert listed["status"] == "up" and listed["lease"]["ttl_seconds"] == TTL
    assert listed["lease"]["agent"]["address"] == "127.0.0.1"


async def test_a_cpu_unplugged_changes_capacity_and_leaves_usage(call, start_agent, tmp_path, events):
    await start_agent("h2", cpus=4, memory=8 * GiB)
    await call("resource.allocate", {"nodename": "h2", "deploy_count": 1, "workload_resource_request": {
        "cpumem": {"cpu-request": 0.5, "memory-request": GiB}}})
    before = await node(call, "h2")
    capacity = await events.subscribe("agent.h2.host.capacity")
    try:
        set_online(tmp_path / "h2-host", [0, 1, 2])  # cpu 3 goes away
        _, event = await capacity.next(timeout=10)
    finally:
        await capacity.close()
    assert sorted(event["capacity"]["cpumem"]["cpu_map"]) == ["0", "1", "2"]
    after = await node(call, "h2")
    assert sorted(after["capacity"]["cpumem"]["cpu_map"]) == ["0", "1", "2"]
    held = ("cpu", "memory")  # the workload still holds what it held
    assert [after["usage"]["cpumem"][k] for k in held] == [before["usage"]["cpumem"][k] for k in held] == [0.5, GiB]
    assert len((await call("resource.get-allocations", {"nodename": "h2"}))["allocations"]) == 1


async def test_instances_start_and_stop_over_the_bus_with_events(call, start_agent, events):
    await start_agent("h3", cpus=2)
    stream = await events.subscribe("agent.h3.*")
    try:
        first = await call("agent.h3.start", start_request("i1", owner={"user": "u", "resource_id": "r"}))
        assert first["state"] in ("starting", "ready") and first["address"] == "127.0.0.1"
        again = await call("agent.h3.start", start_request("i1", owner={"user": "u", "resource_id": "r"}))
        assert again["pid"] == first["pid"]  # a retried start runs no second process
        info = await eventually(lambda: _instance(call, "h3", "i1", ready))
        reader_view = await call("agent.h3.list", {})
        assert reader_view["total"] == 1 and reader_view["instances"][0]["ports"] == info["ports"]
        assert (await call("agent.h3.stop", {"instance": "i1"}))["stopped"] is True
        assert (await call("agent.h3.stop", {"instance": "i1"}))["stopped"] is False
        kinds = [(await stream.next(timeout=10))[1] for _ in range(3)]
    finally:
        await stream.close()
    assert [k["type"] for k in kinds] == ["started", "ready", "stopped"]
    assert kinds[0]["owner"] == {"user": "u", "resource_id": "r", "index": 0}
    status = await call("agent.h3.status", {"instances": ["i1"]})
    assert status == {"instances": [], "missing": ["i1"]}


@pytest.mark.parametrize("payload, field", [
    ({"instance": "", "param": {"image": "http-server"}}, "instance"),
    ({"instance": "x", "param": {"image": "rm -rf /"}}, "param.image"),
    ({"instance": "x", "param": {"image": "http-server", "env": {"EVIL": "1"}}}, "param.env.EVIL"),
    ({"instance": "x", "param": {"image": "http-server", "ports": {"http": "udp"}}}, "param.ports.http"),
    ({"instance": "x", "param": {"image": "http-server"}, "cpus": [-1]}, "cpus[0]"),
    ({"instance": "x", "param": {"image": "http-server"}, "memory_limit": -5}, "memory_limit"),
    ({"param": {"image": "http-server"}}, "instance"),
    ({"instance": "x", "param": {"image": "http-server", "env": {"A=B": "1"}}}, "param.env"),
    ({"instance": "x", "param": {"image": "http-server", "ports": {f"p{i}": "tcp" for i in range(65)}}},
     "param.ports"),
    ({"instance": "x" * 257, "param": {"image": "http-server"}}, "instance"),
])
async def test_a_bad_start_names_the_field_and_starts_nothing(call, start_agent, payload, field):
    await start_agent("h4", cpus=2)
    with pytest.raises(BusError) as refused:
        await call("agent.h4.start", payload)
    assert (refused.value.code, refused.value.details["field"]) == ("invalid_argument", field)
    assert (await call("agent.h4.list", {}))["total"] == 0


async def test_a_draining_agent_starts_nothing_new_and_its_node_takes_no_placement(call, start_agent):
    await start_agent("h5", cpus=2)
    await call("agent.h5.start", start_request("kept"))
    info = await call("agent.h5.drain", {"draining": True})
    assert info["status"] == "draining"
    assert (await node(call, "h5"))["status"] == "draining"
    with pytest.raises(BusError) as refused:
        await call("agent.h5.start", start_request("new"))
    assert refused.value.code == "node_draining"
    assert (await call("agent.h5.start", start_request("kept")))["instance"] == "kept"  # a retry still answers
    with pytest.raises(BusError) as placed:
        await call("resource.allocate", {"nodename": "h5", "deploy_count": 1})
    assert placed.value.code == "node_draining"
    assert (await call("agent.h5.drain", {"draining": False}))["status"] == "up"
    assert (await node(call, "h5"))["status"] == "up"


async def test_an_instance_whose_workload_was_released_is_stopped(call, start_agent):
    agent = await start_agent("h6", cpus=2)
    placed = await call("resource.allocate", {"nodename": "h6", "deploy_count": 2, "workload_ids": ["w1", "w2"]})
    assert len(placed["allocations"]) == 2
    for workload in ("w1", "w2"):
        await call("agent.h6.start", start_request(f"i-{workload}", workload_id=workload))
    await call("resource.release", {"workload_ids": ["w1"]})
    assert await agent.reconcile() == ["i-w1"]
    status = await call("agent.h6.status", {"instances": ["i-w1", "i-w2"]})
    assert status["missing"] == ["i-w1"] and [i["instance"] for i in status["instances"]] == ["i-w2"]


async def test_an_agent_that_starts_before_the_allocation_service_waits_for_it_without_a_warning(
        serve_allocation, client, start_agent, caplog):
    """As in `berth up`, where the agent often serves before allocation does: that is waiting (INFO),
    not a fault; the node is registered once allocation answers."""
    caplog.set_level(logging.INFO, logger="berth.agent")
    await start_agent("h8", cpus=2)  # nothing serves allocation yet
    waiting = [r for r in caplog.records if r.name == "berth.agent" and "waiting for the allocation" in r.message]
    assert waiting and waiting[0].levelno == logging.INFO
    await serve_allocation(lease_interval=0.05)
    call = requester(client, service=None)

    async def registered():
        return (await call("resource.list-nodes", {"nodenames": ["h8"]}))["nodes"]

    await eventually(registered, timeout=20)
    assert not [r.message for r in caplog.records if r.name == "berth.agent" and r.levelno >= logging.WARNING]


async def test_a_node_whose_agent_stops_beating_goes_down_and_comes_back(call, start_agent, events):
    agent = await start_agent("h7", cpus=2)
    stream = await events.subscribe("resource.h7.*")
    try:
        for task in agent._loops:  # the agent freezes: no more heartbeats
            task.cancel()
        subject, _ = await stream.next(timeout=10)
        assert subject.endswith(".down")
        await agent.heartbeat()
        subject, _ = await stream.next(timeout=10)
        assert subject.endswith(".up")
    finally:
        await stream.close()


async def _instance(call, node: str, instance: str, check) -> dict | None:
    found = (await call(f"agent.{node}.status", {"instances": [instance]}))["instances"]
    return found[0] if found and check(found[0]) else None
