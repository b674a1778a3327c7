"""A decisive write that lands while its reply is lost (issue 32): the worker learns what happened
and answers it; only a store that stays away makes it answer `outcome_unknown`, and the same
request_id then gives the real answer.

The worker under test runs with the `after-commit:lose` failpoint: its first committed write of a
request lands, and the worker then sees `ReplyLost`, as when a link fails with the reply in flight.
Each test shows that the fault hit (the worker's `berth_outcomes_resolved_total` counts the request
it had to resolve) and that the answer is the real one, applied once.
"""

from __future__ import annotations

import asyncio
import re
import signal
import urllib.request

import pytest
from urllib.parse import urlsplit

from schemas.errors import BusError
from tests.allocation_helpers import GiB, ONE_CORE, add_node, requester
from tests.broker_helpers import FAST_ARGS, all_tracked_once, const_broker, marked_pids, param
from tests.bus_helpers import eventually, stopped
from tests.tcp_proxy import TcpProxy
from tests.worker_helpers import start_worker, stop_workers

pytest_plugins = ["tests.broker_fixtures"]

ALLOCATION, BROKER, METRICS = "services.allocation.worker", "services.broker.worker", "services.metrics.worker"
LOSE = {"BERTH_FAILPOINTS": "after-commit:lose"}
U = "team-a"
ONE = {"least_instance": 1, "request_instance": 1}


def resolved(worker) -> float:
    """The worker's `berth_outcomes_resolved_total`, read from its Prometheus endpoint."""
    url = worker.ready_line.split("metrics=")[1]
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    return float(re.search(r"^berth_outcomes_resolved_total (\S+)$", text, re.M)[1])


def lone(spawn_worker, module: str, *args: str):
    """A worker of `module` that loses the reply of its first commit (and serves Prometheus metrics)."""
    return spawn_worker(module, *args, "--metrics-port", "0", "--metrics-addr", "127.0.0.1", env=LOSE)


def stop(worker) -> None:
    worker.signal(signal.SIGTERM)
    worker.wait()


# -- allocation ------------------------------------------------------------------------------


@pytest.fixture
async def node(spawn_worker, client):
    """Node d1 with two workloads on it, made by a healthy worker that then stops."""
    healthy = spawn_worker(ALLOCATION)
    call = requester(client)
    await add_node(call, "d1", cpu=8, memory="16G")
    placed = await call("allocate", {"nodename": "d1", "deploy_count": 2, "workload_resource_request": ONE_CORE})
    stop(healthy)
    return [a["workload_id"] for a in placed["allocations"]]


async def ledger(client) -> list[str]:
    reply = await client.request("resource.get-allocations", {"nodename": "d1"}, dict)
    return sorted(a["workload_id"] for a in reply["allocations"])


@pytest.mark.parametrize("case", ["allocate", "release", "realloc", "usage"])
async def test_an_allocation_change_whose_reply_was_lost_is_answered_as_made_once(node, spawn_worker, client, case):
    subject, payload = {
        "allocate": ("resource.allocate", {"nodename": "d1", "deploy_count": 1, "workload_resource_request": ONE_CORE}),
        "release": ("resource.release", {"workload_ids": node}),
        "realloc": ("resource.realloc", {"workload_id": node[0],
                                         "workload_resource_request": {"cpumem": {"cpu-request": 1}}}),
        "usage": ("resource.set-node-resource-usage",
                  {"nodename": "d1", "resource": {"cpumem": {"memory": GiB}}, "delta": True, "incr": True}),
    }[case]
    payload["request_id"] = f"{case}-1"
    worker = lone(spawn_worker, ALLOCATION)
    before = await client.request("resource.get-node-resource-info", {"nodename": "d1"}, dict)
    answer = await client.request(subject, payload, dict, timeout=15)
    assert resolved(worker) == 1  # the fault hit: the reply was lost, and the worker learned the outcome
    after = await client.request("resource.get-node-resource-info", {"nodename": "d1"}, dict)
    if case == "allocate":
        [placed] = answer["allocations"]
        assert await ledger(client) == sorted([*node, placed["workload_id"]])  # the answer, and nothing else
    if case == "release":
        assert sorted(answer["released"]) == sorted(node) and await ledger(client) == []
    if case == "realloc":
        assert answer["delta_resource"]["cpumem"]["cpu_request"] == 1
        assert after["usage"]["cpumem"]["cpu"] == before["usage"]["cpumem"]["cpu"] + 1  # once
    if case == "usage":
        assert after["usage"]["cpumem"]["memory"] == before["usage"]["cpumem"]["memory"] + GiB  # once
    assert after["diffs"] == [] or case == "usage"  # usage deltas bypass the ledger on purpose
    assert await client.request(subject, payload, dict, timeout=10) == answer  # and kept for its retries


async def test_an_unknown_outcome_is_answered_so_and_the_same_request_id_gives_the_real_answer(
    node, client, nats_url, redis_url, prefix
):
    """A worker that pauses right after its commit, whose Redis link is cut meanwhile, cannot learn
    what happened within its time: `outcome_unknown`. Once the link heals, the same request_id
    gives the real answer, and the ledger holds exactly that."""
    parts = urlsplit(redis_url)
    proxy = await TcpProxy.start(parts.hostname, parts.port)
    worker = await asyncio.to_thread(start_worker, ALLOCATION, nats_url, proxy.url("redis", parts.path), prefix,
                                     env={"BERTH_FAILPOINTS": "after-commit:stop"})
    try:
        payload = {"nodename": "d1", "deploy_count": 1, "workload_resource_request": ONE_CORE, "request_id": "cut"}
        asked = asyncio.create_task(client.request("resource.allocate", payload, dict, timeout=30))
        await eventually(lambda: asyncio.sleep(0, stopped(worker.proc.pid)))  # it committed, and paused
        assert proxy.cut("reset") > 0  # its Redis connections are gone, and new ones are refused
        worker.signal(signal.SIGCONT)
        with pytest.raises(BusError) as unknown:
            await asked
        assert (unknown.value.code, unknown.value.status) == ("outcome_unknown", 504)
        assert proxy.refused > 0  # the fault hit: it tried to reach Redis again, in vain
        proxy.restore()
        answer = await eventually(lambda: _answered(client, payload), timeout=20)
        [placed] = answer["allocations"]
        assert await ledger(client) == sorted([*node, placed["workload_id"]])  # the answer, and no orphan
    finally:
        await asyncio.to_thread(stop_workers, [worker])
        await proxy.close()


async def _answered(client, payload: dict) -> dict | None:
    try:
        return await client.request("resource.allocate", payload, dict, timeout=5)
    except BusError as error:
        if error.code in ("timeout", "busy", "outcome_unknown"):
            return None
        raise


# -- broker ----------------------------------------------------------------------------------


async def status(b, resource_id: str) -> str:
    return (await b("get-resource", {"user": U, "resource_id": resource_id}))["status"]


async def test_a_broker_launch_whose_reply_was_lost_is_answered_and_started_once(
    spawn_worker, broker_call, broker_processes, redis, prefix
):
    b = broker_call
    healthy = spawn_worker(BROKER, *FAST_ARGS)
    await b("init", {"user": U, "resource_id": "r1", "param": param()})
    stop(healthy)
    worker = lone(spawn_worker, BROKER, *FAST_ARGS)
    answer = await b("launch", {"user": U, "resource_id": "r1", "filter": ONE, "request_id": "launch-1"}, timeout=15)
    assert resolved(worker) == 1
    assert answer["request_instance"] == 1
    await b.wait_running(U, "r1")
    assert len(await all_tracked_once(redis, prefix)) == 1  # started once, tracked
    await b("release", {"user": U, "resource_id": "r1"})
    await eventually(lambda: asyncio.sleep(0, not marked_pids(prefix)))


async def test_a_broker_apply_whose_reply_was_lost_answers_the_resource_it_sold(
    spawn_worker, broker_call, broker_processes, prefix
):
    b = broker_call
    healthy = spawn_worker(BROKER, *FAST_ARGS)
    await b("add-broker", const_broker(U, "pool", 1))
    await b.wait_idle(U, "pool", 1)
    stop(healthy)
    worker = lone(spawn_worker, BROKER, *FAST_ARGS)
    payload = {"user": U, "resource_id": "caller", "param": param(), "filter": ONE, "request_id": "apply-1"}
    answer = await b("apply", payload, timeout=15)
    assert resolved(worker) == 1
    record = await b("get-resource", {"user": U, "resource_id": "caller"})
    assert answer == {"broker_resource_id": record["broker_resource_id"]} and record["status"] == "running"
    await b("remove-broker", {"user": U, "name": "pool"})
    await b("release", {"user": U, "resource_id": "caller"})
    await eventually(lambda: asyncio.sleep(0, not marked_pids(prefix)))


async def test_a_broker_init_and_release_whose_replies_were_lost_are_answered_as_made(
    spawn_worker, broker_call, broker_processes
):
    b = broker_call
    worker = lone(spawn_worker, BROKER, *FAST_ARGS)
    assert await b("init", {"user": U, "resource_id": "r1", "param": param(), "request_id": "init-1"}, timeout=15) == {}
    assert resolved(worker) == 1 and await status(b, "r1") == "init"
    stop(worker)
    worker = lone(spawn_worker, BROKER, *FAST_ARGS)
    assert await b("release", {"user": U, "resource_id": "r1", "request_id": "release-1"}, timeout=15) == {}
    assert resolved(worker) == 1 and await status(b, "r1") == "released"


# -- metrics ---------------------------------------------------------------------------------


async def test_a_metric_put_whose_answer_could_not_be_kept_at_first_is_answered_with_one_sample(spawn_worker, client):
    worker = lone(spawn_worker, METRICS, "--node", "m1", "--interval", "5")
    payload = {"scope": "node", "metric": "lost.reply", "value": 7.0, "request_id": "put-1"}
    answer = await client.request("metrics.m1.put", payload, dict, timeout=15)
    assert resolved(worker) == 1
    assert answer["value"] == 7.0
    assert await client.request("metrics.m1.get", {"scope": "node", "metric": "lost.reply"}, dict) == answer
    assert await client.request("metrics.m1.put", payload, dict, timeout=10) == answer  # the same sample


async def test_a_retry_whose_answer_cannot_be_read_back_is_no_unavailable(spawn_worker, client):
    """A retry finds its request's answer kept; the store fails while the answer is rebuilt (an
    allocate's placements are read from the ledger): the request was made, so the answer is
    `outcome_unknown`, never `unavailable` (a partition test once saw that, and its client took
    the placement for not made). The same request_id then answers the placement."""
    spawn_worker(ALLOCATION, env={"BERTH_FAILPOINTS": "recall:lose"})
    call = requester(client)
    await add_node(call, "r1", cpu=4)
    payload = {"nodename": "r1", "deploy_count": 1, "workload_resource_request": ONE_CORE, "request_id": "read-back"}
    first = await call("allocate", payload)
    with pytest.raises(BusError) as unread:
        await call("allocate", payload)
    assert unread.value.code == "outcome_unknown" and unread.value.details.get("field") == "request_id"
    assert await call("allocate", payload) == first
