"""Contract: bounds (DESIGN.md §8, "Pinned for the next work"; README "Bounds").

"Bounds are part of the contract and are refused as `invalid_argument` before any work." Each test
sends plain msgpack to real worker processes (one allocation worker, one metrics agent that takes
at most 3 notifier registrations) and checks the refusal, its field, and that nothing changed.
"""

from __future__ import annotations

import asyncio
import time

import msgpack
import pytest
import pytest_asyncio

from tests.contract.allocation_wire import INVALID, WRR, assert_error, changes_nothing, new_node
from tests.contract.conftest import Wire, unique

MAX_DEPLOY_COUNT = 10_000  # the worker's default --max-deploy-count
MAX_NOTIFIERS = 3  # the agent's --max-notifiers here


@pytest.fixture(scope="module", autouse=True)
def allocation_worker(module_workers):
    return module_workers("services.allocation.worker")


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def metrics_node(module_workers, wire: Wire) -> str:
    node = unique("mnode")
    module_workers(
        "services.metrics.worker", "--node", node, "--interval", "1", "--max-notifiers", str(MAX_NOTIFIERS)
    )
    await until_answering(wire, node)
    return node


async def until_answering(wire: Wire, node: str) -> None:
    """The agent answers has-synced (it may take a moment after its ready line)."""
    deadline = time.monotonic() + 15
    while True:
        try:
            if (await wire.ok(f"metrics.{node}.has-synced", {}, timeout=2))["synced"]:
                return
        except Exception:
            assert time.monotonic() < deadline, "the metrics agent does not answer"
            await asyncio.sleep(0.05)


def nested(depth: int) -> bytes:
    """A list `depth` levels deep, as raw msgpack (msgpack's packer itself refuses deep nesting)."""
    return b"\x91" * (depth - 1) + b"\x90"


def with_value(payload: dict, key: str, raw_value: bytes) -> bytes:
    """`payload` packed, with `key` added holding the raw msgpack `raw_value`."""
    packed = msgpack.packb(payload)
    assert 0x80 <= packed[0] < 0x8F, "a small map"
    return bytes([packed[0] + 1]) + packed[1:] + msgpack.packb(key) + raw_value


# -- deploy_count ----------------------------------------------------------------------------------


@pytest.mark.parametrize("count", [MAX_DEPLOY_COUNT + 1, 1_000_000])
@pytest.mark.parametrize("subject", ["resource.allocate", "resource.calculate-deploy",
                                     "resource.cpumem.calculate-deploy", "resource.storage.calculate-deploy"])
async def test_deploy_count_above_max_deploy_count_is_refused(wire, subject, count):
    """§8: "a `deploy_count` above `--max-deploy-count`" is `invalid_argument`, before any work."""
    node = await new_node(wire)
    async with changes_nothing(wire, node):
        reply = await wire.request(subject, {"nodename": node, "deploy_count": count, WRR: {}})
    assert_error(reply, INVALID, "deploy_count")
    assert str(MAX_DEPLOY_COUNT) in reply.error["message"]


# -- replies that would not fit --------------------------------------------------------------------


async def test_allocate_whose_reply_would_not_fit_is_refused_before_it_commits(wire):
    """§8: "a request whose reply could not be sent (over the server's max payload) is refused
    before it commits": 10,000 instances take far more than 1 MiB of answer."""
    node = await new_node(wire)
    async with changes_nothing(wire, node):
        reply = await wire.request(
            "resource.allocate", {"nodename": node, "deploy_count": MAX_DEPLOY_COUNT, WRR: {}}
        )
    assert_error(reply, INVALID, "deploy_count")
    assert reply.details["reply_bytes"] > reply.details["limit"]


async def test_calculate_deploy_whose_reply_would_not_fit_is_refused(wire):
    node = await new_node(wire)
    reply = await wire.request("resource.calculate-deploy", {"nodename": node, "deploy_count": MAX_DEPLOY_COUNT})
    assert_error(reply, INVALID, "deploy_count")


# -- releases up to the schema's maximum -----------------------------------------------------------


async def test_release_of_10000_workloads_of_one_node(wire):
    """The schema allows 10,000 ids in one release; all on one node works (Lua's unpack of long
    lists failed at about 8,000)."""
    node = await new_node(wire)
    ids = []
    for _ in range(10):  # allocates small enough for their answers to fit
        placed = await wire.ok("resource.allocate", {"nodename": node, "deploy_count": 1000, WRR: {}})
        ids += [a["workload_id"] for a in placed["allocations"]]
    released = await wire.ok("resource.release", {"workload_ids": ids}, timeout=60)
    assert sorted(released["released"]) == sorted(ids)
    assert (await wire.ok("resource.get-allocations", {"nodename": node}))["allocations"] == []


# -- nesting ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("depth", [33, 10_000])
async def test_nesting_deeper_than_32_is_invalid_argument_naming_the_path(wire, depth):
    """§8: "nesting deeper than 32" is `invalid_argument` (10,000 levels were `internal`)."""
    node = await new_node(wire)
    # {"cpumem": <list depth deep>}: the map is level 2, so the 32nd list is the first too deep.
    payload = with_value({"nodename": node, "deploy_count": 1}, WRR, b"\x81" + msgpack.packb("cpumem") + nested(depth))
    async with changes_nothing(wire, node):
        reply = await wire.request("resource.allocate", payload)
    assert_error(reply, INVALID, f"{WRR}.cpumem" + "[0]" * 30)
    assert "deeper than 32" in reply.error["message"]


async def test_nesting_of_32_is_not_refused_for_its_depth(wire):
    node = await new_node(wire)
    payload = with_value({"nodename": node, "deploy_count": 1}, WRR, b"\x81" + msgpack.packb("cpumem") + nested(30))
    reply = await wire.request("resource.calculate-deploy", payload)
    assert "deeper" not in str(reply.body)


async def test_nesting_is_refused_by_every_service(wire, metrics_node):
    payload = with_value({"scope": "node", "metric": "m"}, "value", nested(10_000))
    reply = await wire.request(f"metrics.{metrics_node}.put", payload)
    assert reply.status == 400 and reply.code == INVALID and reply.details["field"] == "value" + "[0]" * 31


# -- labels ----------------------------------------------------------------------------------------


async def test_labels_per_node_are_bounded(wire):
    """README "Bounds": at most 128 labels per node."""
    labels = {f"k{i}": "v" for i in range(129)}
    node = unique("lab")
    assert_error(await wire.request("resource.add-node", {"nodename": node, "labels": labels}), INVALID, "labels")
    node = await new_node(wire)
    async with changes_nothing(wire, node):
        reply = await wire.request("resource.set-node-labels", {"nodename": node, "labels": labels})
    assert_error(reply, INVALID, "labels")
    await wire.ok("resource.set-node-labels", {"nodename": node, "labels": dict(list(labels.items())[:128])})


# -- metrics: cpusets, ids, registrations ----------------------------------------------------------


@pytest.mark.parametrize("cpuset", ["0-4000000000", "0-8192", "1000001"])
async def test_cpuset_beyond_the_documented_cpus_is_refused_before_it_is_expanded(wire, metrics_node, cpuset):
    """§8: "cpusets beyond the host's CPUs": ids up to 1,000,000, at most 8,192 CPUs."""
    reply = await wire.request(f"metrics.{metrics_node}.aggregate",
                               {"kind": "cores", "agg": "sum", "metric": "m", "cpuset": cpuset})
    assert (reply.status, reply.code, reply.details.get("field")) == (400, INVALID, "cpuset"), reply.body
    await until_answering(wire, metrics_node)  # the agent lives on
    widest = {"kind": "cores", "agg": "sum", "metric": "m", "cpuset": "0-8191"}
    assert (await wire.ok(f"metrics.{metrics_node}.aggregate", widest))["value"] == 0


@pytest.mark.parametrize(("cgroup_path", "why"), [("c" * 1025, "length"), ("." * 1000, "bytes")])
async def test_metric_ids_beyond_their_maximum_are_refused(wire, metrics_node, cgroup_path, why):
    """README "Bounds": string ids of 1,024 characters at most, and an event subject of 2,048 bytes
    at most once escaped (a 4 KiB one closed the agent's NATS connection)."""
    reply = await wire.request(f"metrics.{metrics_node}.register-notifier",
                               {"scope": "cgroup", "metric": "m", "cgroup_path": cgroup_path})
    assert (reply.status, reply.code, reply.details.get("field")) == (400, INVALID, "cgroup_path"), reply.body
    await until_answering(wire, metrics_node)


async def test_notifier_registrations_per_node_are_bounded(wire, metrics_node):
    """`--max-notifiers` (3 here) live registrations per node; one more is refused until one ends."""
    call = f"metrics.{metrics_node}"
    keys = [(await wire.ok(f"{call}.register-notifier", {"scope": "node", "metric": f"m{i}"}))["key"]
            for i in range(MAX_NOTIFIERS)]
    reply = await wire.request(f"{call}.register-notifier", {"scope": "node", "metric": "one-more"})
    assert (reply.status, reply.code, reply.details.get("limit")) == (400, INVALID, MAX_NOTIFIERS), reply.body
    assert (await wire.ok(f"{call}.deregister-notifier", {"key": keys[0]}))["removed"]
    await wire.ok(f"{call}.register-notifier", {"scope": "node", "metric": "one-more"})
