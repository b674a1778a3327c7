"""Every refusal explains itself (README "When an allocate is refused"): an allocate or a
calculate-deploy that cannot place says, in `details` and in words, the nodes of the selection, how
many were down or draining, how many lacked each resource and by how much at most, and how many
instances fit. And `dry_run: true` answers the plan without committing anything."""

from __future__ import annotations

import pytest

from schemas.errors import BusError
from tests.allocation_helpers import GiB, ONE_CORE, add_node, requester
from tests.bus_helpers import EventLog, eventually, idempotency_keys

# Three bound cores and 2 GiB an instance.
BIG = {"cpumem": {"cpu-bind": True, "cpu-request": 3, "memory-request": "2G"}}


@pytest.fixture
async def call(serve_allocation, client):
    await serve_allocation(lease_interval=0.05)
    return requester(client)


async def refused(call, command: str, payload: dict) -> BusError:
    with pytest.raises(BusError) as caught:
        await call(command, payload)
    return caught.value


async def mixed_pool(call) -> None:
    """Six nodes labelled pool=m: one down, one draining, two short of cores (by 1 and by 2), one
    short of memory (by 1 GiB), and one with room for one instance of BIG."""
    await add_node(call, "down1", cpu=4, pool="m")
    await add_node(call, "drain1", cpu=4, pool="m")
    await add_node(call, "cpu1", cpu=2, pool="m")
    await add_node(call, "cpu2", cpu=1, pool="m")
    await add_node(call, "mem1", cpu=4, memory="1G", pool="m")
    await add_node(call, "ok1", cpu=4, pool="m")
    await call("node-heartbeat", {"nodename": "drain1", "ttl_seconds": 30, "draining": True})
    await call("node-heartbeat", {"nodename": "down1", "ttl_seconds": 0.4})  # and no heartbeat follows

    async def is_down():
        listed = await call("list-nodes", {"nodenames": ["down1"]})
        return listed["nodes"][0]["status"] == "down"

    await eventually(is_down)


MIXED_COUNTS = {
    "nodes": 6, "unschedulable": 2, "down": 1, "draining": 1, "with_room": 1,
    "lacking": {
        "cpu": {"nodes": 2, "largest_shortfall": 2.0, "unit": "cores"},
        "memory": {"nodes": 1, "largest_shortfall": GiB, "unit": "bytes"},
    },
    "fit": 1,
}


def told(error: BusError) -> dict:
    """The keys a refusal's explanation adds to its details."""
    return {key: error.details[key] for key in MIXED_COUNTS}


def one_node_short(*, cores: float, fit: int) -> dict:
    """The explanation for one node (up) short of `cores` cores and of 1 GiB, with room for `fit`."""
    return {
        "nodes": 1, "unschedulable": 0, "down": 0, "draining": 0, "with_room": 0,
        "lacking": {"cpu": {"nodes": 1, "largest_shortfall": cores, "unit": "cores"},
                    "memory": {"nodes": 1, "largest_shortfall": GiB, "unit": "bytes"}},
        "fit": fit,
    }


@pytest.mark.parametrize("selection", [{"labels": {"pool": "m"}},
                                       {"nodenames": ["down1", "drain1", "cpu1", "cpu2", "mem1", "ok1"]}],
                         ids=["labels", "names"])
@pytest.mark.parametrize("strategy", ["spread", "pack"])
async def test_a_refused_allocate_counts_each_reason(call, selection, strategy):
    await mixed_pool(call)
    error = await refused(call, "allocate", {**selection, "strategy": strategy, "deploy_count": 3,
                                             "workload_resource_request": BIG, "request_id": f"big-{strategy}"})
    assert (error.code, error.status) == ("insufficient_capacity", 409)
    # The keys a refusal had stay as they were; the explanation's are added beside them.
    assert {key: error.details[key] for key in ("wanted", "available", "unit")} == {
        "wanted": 3, "available": 1, "unit": "instances"}
    assert told(error) == MIXED_COUNTS
    assert error.message == (
        "cannot place 3 instances: the nodes have room for 1; 1/6 selected nodes have room for 1 instance: "
        "1 down, 1 draining, 2 short of cpu (by up to 2 cores), 1 short of memory (by up to 1 GiB); "
        "1 instance fits"
    )
    # A retry answers the same refusal, explanation and all.
    again = await refused(call, "allocate", {**selection, "strategy": strategy, "deploy_count": 3,
                                             "workload_resource_request": BIG, "request_id": f"big-{strategy}"})
    assert (again.message, again.details) == (error.message, error.details)


async def test_each_wants_every_instance_on_every_node(call):
    await mixed_pool(call)
    error = await refused(call, "allocate", {"labels": {"pool": "m"}, "strategy": "each", "deploy_count": 2,
                                             "workload_resource_request": ONE_CORE})
    assert error.code == "insufficient_capacity"
    # Two bound cores and 2 GiB for two instances of ONE_CORE: cpu2 has one core, mem1 1 GiB;
    # ok1 and cpu1 take both, cpu2 and mem1 one each (at most 2 a node count as fitting).
    assert {key: error.details[key] for key in ("nodes", "unschedulable", "with_room", "fit")} == {
        "nodes": 6, "unschedulable": 2, "with_room": 2, "fit": 6}
    assert error.details["lacking"] == {
        "cpu": {"nodes": 1, "largest_shortfall": 1.0, "unit": "cores"},
        "memory": {"nodes": 1, "largest_shortfall": GiB, "unit": "bytes"},
    }
    assert "2/6 selected nodes have room for 2 instances: 1 down, 1 draining" in error.message


async def test_a_node_named_alone_is_wanted_for_every_instance(call):
    await add_node(call, "solo", cpu=4, memory="3G")
    error = await refused(call, "allocate", {"nodename": "solo", "deploy_count": 2, "workload_resource_request": BIG})
    # cpumem refuses first with its own details; four cores and 3 GiB miss 2 cores and 1 GiB for two.
    assert (error.code, error.details["plugin"], error.details["resource"]) == ("insufficient_capacity", "cpumem", "cpu")
    assert told(error) == one_node_short(cores=2.0, fit=1)
    assert error.message.endswith(
        "; 0/1 selected nodes have room for 2 instances: 1 short of cpu (by up to 2 cores), "
        "1 short of memory (by up to 1 GiB); 1 instance fits")


async def test_a_draining_node_named_alone_says_so(call):
    await add_node(call, "d1")
    await call("node-heartbeat", {"nodename": "d1", "ttl_seconds": 30, "draining": True})
    error = await refused(call, "allocate", {"nodename": "d1", "deploy_count": 1, "workload_resource_request": ONE_CORE})
    assert (error.code, error.details["status"]) == ("node_draining", "draining")
    assert (error.details["nodes"], error.details["draining"], error.details["fit"]) == (1, 1, 0)
    assert error.message.endswith("; 0/1 selected nodes have room for 1 instance: 1 draining; 0 instances fit")


async def test_a_label_selection_of_nodes_that_take_nothing_says_why(call):
    await add_node(call, "d1", pool="q")
    await call("node-heartbeat", {"nodename": "d1", "ttl_seconds": 30, "draining": True})
    error = await refused(call, "allocate", {"labels": {"pool": "q"}, "deploy_count": 1,
                                             "workload_resource_request": ONE_CORE})
    assert (error.code, error.details["labels"]) == ("node_not_found", {"pool": "q"})
    assert (error.details["nodes"], error.details["draining"]) == (1, 1)
    assert "1 draining" in error.message


async def test_storage_and_gpu_shortfalls_in_their_units(call):
    await add_node(call, "s1", storage={"volumes": ["/data:100G"], "storage": "200G"},
                   gpu={"prod_count_map": {"nvidia-3070": 2}})
    request = {"storage": {"storage-request": "150G", "volumes": ["AUTO:/d:rw:60G"]},
               "gpu": {"prod_count_map": {"nvidia-3070": 1}}}
    error = await refused(call, "allocate", {"nodenames": ["s1"], "deploy_count": 3, "workload_resource_request": request})
    assert error.code == "insufficient_resource"
    # 3 x (150G + 60G) of a 300G budget (200G and the volume's 100G, as eru adds them); 3 x 60G of
    # a 100G volume; 3 cards of 2.
    assert error.details["lacking"] == {
        "gpu": {"nodes": 1, "largest_shortfall": 1, "unit": "cards"},
        "storage": {"nodes": 1, "largest_shortfall": 3 * 210 * GiB - 300 * GiB, "unit": "bytes"},
        "volumes": {"nodes": 1, "largest_shortfall": 80 * GiB, "unit": "bytes"},
    }
    assert "1 short of volumes (by up to 80 GiB)" in error.message


async def test_a_refused_calculate_deploy_explains_itself(call):
    await add_node(call, "c1", cpu=2, memory="1G")
    await call("node-heartbeat", {"nodename": "c1", "ttl_seconds": 30, "draining": True})
    error = await refused(call, "calculate-deploy", {"nodename": "c1", "deploy_count": 1,
                                                     "workload_resource_request": BIG})
    assert (error.code, error.details["resource"], error.details["requested"]) == ("insufficient_capacity", "cpu", 1)
    # calculate-deploy calculates whatever the node's status: the node is judged, not counted as draining.
    assert told(error) == one_node_short(cores=1.0, fit=0)
    assert error.message.endswith(
        "; 0/1 selected nodes have room for 1 instance: 1 short of cpu (by up to 1 core), "
        "1 short of memory (by up to 1 GiB); 0 instances fit")
    # A plugin's own calculate-deploy answers as eru's plugin does, without the explanation.
    plain = await refused(call, "cpumem.calculate-deploy", {"nodename": "c1", "deploy_count": 1,
                                                           "workload_resource_request": BIG["cpumem"]})
    assert plain.code == "insufficient_capacity" and "lacking" not in plain.details and ";" not in plain.message


async def state(call, nodes: list[str]) -> list:
    return [(await call("get-node-resource-info", {"nodename": node}),
             await call("get-allocations", {"nodename": node})) for node in nodes]


async def test_a_dry_run_answers_the_plan_and_places_nothing(call, nc, redis, prefix):
    for node in ("n1", "n2"):
        await add_node(call, node, cpu=4, pool="p")
    payload = {"labels": {"pool": "p"}, "strategy": "spread", "deploy_count": 3, "workload_resource_request": ONE_CORE,
               "request_id": "plan-1"}
    before = await state(call, ["n1", "n2"])
    log = await EventLog.open(nc, prefix, "resource.>")
    plan = await call("allocate", {**payload, "dry_run": True})
    again = await call("allocate", {**payload, "dry_run": True})
    assert again == plan  # the same plan while nothing changes
    allocations = plan["allocations"]
    assert len(allocations) == 3 and {a["workload_id"] for a in allocations} == {""}  # no id minted
    assert sorted(a["nodename"] for a in allocations) in (["n1", "n1", "n2"], ["n1", "n2", "n2"])
    for allocation in allocations:  # the resources each instance would get: one bound core, 1 GiB
        cpumem = allocation["workload_resource"]["cpumem"]
        assert (cpumem["cpu_request"], cpumem["memory_request"], len(cpumem["cpu_map"])) == (1.0, GiB, 1)
        assert allocation["engine_params"]["cpumem"]["cpu_map"] == cpumem["cpu_map"]
    # Nothing changed: usage, ledgers, events, kept answers.
    assert await state(call, ["n1", "n2"]) == before
    assert await idempotency_keys(redis, prefix) == []
    await call("set-node-labels", {"nodename": "n1", "labels": {"pool": "p", "sentinel": "1"}})
    assert await log.before(log.subject("resource.n1.labels")) == []
    await log.close()
    # The real allocate with the same request (and request id) places as many, where the plan said.
    placed = (await call("allocate", payload))["allocations"]
    assert len(placed) == 3 and all(a["workload_id"] for a in placed)
    assert sorted(a["nodename"] for a in placed) == sorted(a["nodename"] for a in allocations)


async def test_a_dry_run_on_a_named_node_gives_what_the_commit_gives(call):
    await add_node(call, "n1", cpu=4)
    request = {"nodename": "n1", "deploy_count": 2, "workload_resource_request": ONE_CORE, "workload_ids": ["w1", "w2"]}
    plan = (await call("allocate", {**request, "dry_run": True}))["allocations"]
    assert (await call("get-allocations", {"nodename": "n1"}))["allocations"] == []
    placed = (await call("allocate", request))["allocations"]
    assert plan == placed  # the given ids, the same cores, the same engine params
    # A dry run refuses as the real one would, ids held included, and explains a shortfall.
    error = await refused(call, "allocate", {**request, "dry_run": True})
    assert error.code == "workload_exists"
    error = await refused(call, "allocate", {**request, "workload_ids": ["w3", "w4", "w5"], "deploy_count": 3,
                                             "dry_run": True})
    assert error.code == "insufficient_capacity" and error.details["lacking"]["cpu"]["largest_shortfall"] == 1.0
    assert len((await call("get-allocations", {"nodename": "n1"}))["allocations"]) == 2
