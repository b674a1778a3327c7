"""The `allocation` operator: instances placed by a real allocation service on nodes whose labels
match the resource's city and platform, started by each node's agent pinned to the CPUs the
allocation bound, capacity from the allocation service, allocations freed on release (retried when
the service was away)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from bus.idempotency import IdempotencyStore
from services.allocation.manager import AllocationManager
from services.allocation.store import NodeStore
from services.allocation.worker import STREAM, make_plugins, make_service
from tests.broker_helpers import marked, param
from tests.bus_helpers import eventually

pytest_plugins = ["tests.broker_fixtures", "tests.agent_fixtures"]

U = "team-a"
ONE = {"least_instance": 1, "request_instance": 1}
TYPES = '[{"platform": "linux", "group": "sz", "cpu_per_instance": 1, "mem_per_instance": 536870912}]'


async def start_allocation(serve, redis, events, prefix):
    await events.ensure_stream(STREAM, memory=True)  # its events are published with acknowledgements
    manager = AllocationManager(NodeStore(redis, prefix), make_plugins(), events)
    return await serve(make_service(manager, prefix, IdempotencyStore(redis, prefix=prefix)))


async def add_node(start_agent, name: str, city: str, cpu: int = 2) -> None:
    """A node whose agent registers it: `cpu` cores (this machine's first ones), 4 GiB."""
    await start_agent(name, cpus=cpu, memory=4 << 30, labels={"city": city, "platform": "linux"})


async def allocations(client, node: str) -> list[str]:
    reply = await client.request("resource.get-allocations", {"nodename": node}, dict)
    return sorted(a["workload_id"] for a in reply["allocations"])


def allowed_cpus(pid: int) -> str:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Cpus_allowed_list:"):
            return line.split(":", 1)[1].strip()
    raise AssertionError("no Cpus_allowed_list")


async def test_instances_are_allocated_pinned_and_freed(
    serve, redis, events, prefix, client, start_broker, broker_call, start_agent
):
    await start_allocation(serve, redis, events, prefix)
    await add_node(start_agent, "n1", "sz")
    await add_node(start_agent, "n2", "gz")
    await start_broker(operator="allocation", instance_types=TYPES)
    b = broker_call
    assert await b("get-instance-type", {"user": U, "platform": "linux", "group": "sz"}) == {
        "cpu_per_instance": 1.0,
        "mem_per_instance": 512 << 20,
    }

    await b("init", {"user": U, "resource_id": "job", "param": param()})
    # n1 (city sz) has 2 cores for bound 1-CPU instances: 2 of the 3 asked for.
    reply = await b(
        "launch", {"user": U, "resource_id": "job", "filter": {"least_instance": 1, "request_instance": 3}}
    )
    assert reply["request_instance"] == 2
    info = await b.wait_running(U, "job")
    assert info["status"] == "running" and info["current_instances"] == 2
    assert await allocations(client, "n1") == [f"broker/{U}/job/0", f"broker/{U}/job/1"]
    assert await allocations(client, "n2") == []
    pinned = sorted(allowed_cpus(pid) for pid in marked(prefix).values())
    assert pinned == ["0", "1"]  # one bound core each

    detail = await b("get-resource-detail", {"user": U})
    sz = next(block for block in detail["blocks"] if block["block"] == "linux/sz")
    assert (sz["cpu_total"], sz["cpu_used"], sz["report_instance"]) == (2, 2, 0)

    await b("init", {"user": U, "resource_id": "more", "param": param()})
    err = await b.error(
        "launch", {"user": U, "resource_id": "more", "filter": {"least_instance": 1, "request_instance": 1}}
    )
    assert (err.code, err.details["available"]) == ("no_enough_resources", 0)
    await b("init", {"user": U, "resource_id": "far", "param": param(city="bj")})  # no node in that city
    assert (
        await b.error(
            "launch",
            {"user": U, "resource_id": "far", "filter": {"least_instance": 1, "request_instance": 1}},
        )
    ).code == "no_enough_resources"

    await b("release", {"user": U, "resource_id": "job"})
    assert await allocations(client, "n1") == [] and not marked(prefix)
    await b(
        "launch", {"user": U, "resource_id": "more", "filter": {"least_instance": 1, "request_instance": 1}}
    )
    await b.wait_running(U, "more")
    await b("release", {"user": U, "resource_id": "more"})


async def test_a_warm_pool_on_the_allocation_operator(
    serve, redis, events, prefix, client, start_broker, broker_call, start_agent
):
    await start_allocation(serve, redis, events, prefix)
    await add_node(start_agent, "n1", "sz")
    await start_broker(operator="allocation", instance_types=TYPES)
    b = broker_call
    await b(
        "add-broker", {"user": U, "name": "warm", "strategy": {"type": "const", "num": 3}, "param": param()}
    )
    pool = await b.wait_idle(U, "warm", 2)
    assert pool["idle"] + pool["warming"] == 2  # the node fits two: the third launch waits for capacity
    assert pool["cooling_until"] == 0  # lack of capacity does not cool a broker down
    sold = (
        await b(
            "apply",
            {
                "user": U,
                "resource_id": "c",
                "param": param(),
                "filter": {"least_instance": 1, "request_instance": 1},
            },
        )
    )["broker_resource_id"]
    assert f"broker/{U}/{sold}/0" in await allocations(client, "n1")
    await b("release", {"user": U, "resource_id": "c"})
    await b("remove-broker", {"user": U, "name": "warm"})

    async def freed():
        return await allocations(client, "n1") == []

    await eventually(freed)


async def test_a_warming_server_lost_with_its_node_is_replaced_without_cooling_down(
    serve, redis, events, prefix, client, start_broker, broker_call, start_agent, tmp_path
):
    """A node can go at any time (`berth up` stops its agent's instances on Ctrl-C): a server lost
    with it while warming is the platform's failure, not the image's, so the pool launches another
    at once. Cooling down would leave the pool empty for `cooling_seconds`."""
    await start_allocation(serve, redis, events, prefix)
    await add_node(start_agent, "n1", "sz")
    await start_broker(operator="allocation", instance_types=TYPES)
    b = broker_call
    opened = tmp_path / "open"  # the gated server listens once this file exists
    await b("add-broker", {"user": U, "name": "warm", "strategy": {"type": "const", "num": 1},
                           "param": param("http-server-gated", env={"WAIT_FILE": str(opened)})})

    async def warming_on_n1() -> list[str]:
        return await allocations(client, "n1")

    [first] = await eventually(warming_on_n1)
    # Its agent no longer runs it (as after its node stopped): its status says so.
    assert await client.request("agent.n1.stop", {"instance": first}, dict)

    async def replaced() -> list[str]:
        placed = await allocations(client, "n1")
        return placed if placed and first not in placed else []

    [second] = await eventually(replaced)
    pool = await b.pool(U, "warm")
    assert (pool["cooling_until"], pool["warming"]) == (0, 1), pool
    opened.touch()
    assert (await b.wait_idle(U, "warm", 1))["cooling_until"] == 0
    assert await allocations(client, "n1") == [second]
    await b("remove-broker", {"user": U, "name": "warm"})

    async def freed():
        return await allocations(client, "n1") == []

    await eventually(freed)


async def test_a_failed_release_is_retried_until_the_allocations_are_freed(
    serve, redis, events, prefix, client, start_broker, broker_call, start_agent
):
    allocation = await start_allocation(serve, redis, events, prefix)
    await add_node(start_agent, "n1", "sz")
    await start_broker(operator="allocation", instance_types=TYPES, allocation_timeout=0.5)
    b = broker_call
    await b("init", {"user": U, "resource_id": "job", "param": param()})
    await b(
        "launch", {"user": U, "resource_id": "job", "filter": {"least_instance": 1, "request_instance": 1}}
    )
    await b.wait_running(U, "job")

    await allocation.drain(timeout=5)  # the allocation service goes away
    err = await b.error("release", {"user": U, "resource_id": "job"})
    assert (err.code, err.status) == ("internal", 500) and "retried" in err.message
    assert (await b("get-resource", {"user": U, "resource_id": "job"}))["status"] == "deleting"
    assert not marked(prefix)  # the agent stopped the process; only the allocation is left to free

    await start_allocation(serve, redis, events, prefix)  # it comes back

    async def released():
        return (await b("get-resource", {"user": U, "resource_id": "job"}))["status"] == "released"

    await eventually(released, timeout=10)
    assert await allocations(client, "n1") == []


async def test_a_release_waits_for_an_allocation_service_that_is_starting(
    serve, redis, events, prefix, client, start_broker, broker_call, start_agent
):
    """`berth up` starts allocation beside the broker, whose first pool round releases the servers
    lost while it was stopped: a release finds no allocation service yet and waits for one (within
    the allocation timeout) rather than fail, which would leave a pool's own server `deleting`."""
    allocation = await start_allocation(serve, redis, events, prefix)
    await add_node(start_agent, "n1", "sz")
    await start_broker(operator="allocation", instance_types=TYPES, allocation_timeout=60)
    b = broker_call
    await b("init", {"user": U, "resource_id": "job", "param": param()})
    await b("launch", {"user": U, "resource_id": "job", "filter": ONE})
    await b.wait_running(U, "job")

    await allocation.drain(timeout=5)  # not there yet
    release = asyncio.create_task(b("release", {"user": U, "resource_id": "job"}, timeout=120))

    async def stopped():  # by its agent: the release goes on to free the allocation, which nobody serves
        return not marked(prefix)

    await eventually(stopped)
    await start_allocation(serve, redis, events, prefix)  # it starts
    assert await release == {}
    assert (await b("get-resource", {"user": U, "resource_id": "job"}))["status"] == "released"
    assert await allocations(client, "n1") == []


async def test_a_command_line_is_refused_before_anything_is_allocated(
    serve, redis, events, prefix, client, start_broker, broker_call, start_agent, tmp_path
):
    # The broker validates with its catalog, the one its agents run.
    await start_allocation(serve, redis, events, prefix)
    await add_node(start_agent, "n1", "sz")
    await start_broker(operator="allocation", instance_types=TYPES)
    b = broker_call
    target = tmp_path / "ran"
    image = f"/bin/sh -c 'touch {target}'"
    refused = await b.error("init", {"user": U, "resource_id": "evil", "param": param(image)})
    assert (refused.code, refused.details["field"]) == ("invalid_argument", "param.image")
    assert (await b.error("launch", {"user": U, "resource_id": "evil", "filter": ONE})).code == "resource_not_found"
    assert await allocations(client, "n1") == []
    assert not target.exists() and not marked(prefix)


async def test_a_server_whose_agent_cannot_start_it_cools_the_broker_down(
    serve, redis, events, prefix, client, start_broker, broker_call, start_agent
):
    """The image's own failure (its program is missing, so the agent refuses to start it) still
    cools the broker down, as in crm: its instances were never lost with a node, so a pool does not
    launch it again every round."""
    await start_allocation(serve, redis, events, prefix)
    await add_node(start_agent, "n1", "sz")
    await start_broker(operator="allocation", instance_types=TYPES)
    b = broker_call
    await b("add-broker", {"user": U, "name": "broken", "strategy": {"type": "const", "num": 1},
                           "param": param("missing-binary")})

    async def cooling() -> dict | None:
        pool = await b.pool(U, "broken")
        return pool if pool["cooling_until"] > 0 else None

    await eventually(cooling, 20)
    await b("remove-broker", {"user": U, "name": "broken"})

    async def freed():
        return await allocations(client, "n1") == []

    await eventually(freed)
