"""A state change whose worker dies right after its commit, before its answer: the retry with the
same request_id answers what the first run did and does not apply it again (issue 16, item 3).

The first worker runs with the `after-commit` failpoint: it SIGKILLs itself the moment its commit
has landed. The test shows the fault hit (the worker died by SIGKILL, the client got no answer,
the change is in Redis) and then retries on a healthy worker.
"""

from __future__ import annotations

import asyncio
import signal

import pytest
from nats.micro.request import ERROR_CODE_HEADER

from bus.codec import encode
from schemas.errors import BusError
from tests.bus_helpers import EventLog, eventually, stopped

GiB = 1 << 30
NODE = {"nodename": "d1", "resource": {"cpumem": {"cpu": 8, "memory": "16G"}}}
ONE_CORE = {"cpumem": {"cpu-request": 1, "memory-request": GiB}}


async def dies_after_commit(spawn_worker, client, subject: str, payload: dict) -> None:
    """Send `payload` to a worker that dies right after committing it; assert that it did."""
    doomed = spawn_worker("services.allocation.worker", env={"BERTH_FAILPOINTS": "after-commit"})
    with pytest.raises(BusError) as unanswered:
        await client.request(subject, payload, dict, timeout=3)
    assert unanswered.value.code in ("timeout", "no_responders")
    assert doomed.wait() == -signal.SIGKILL  # it died at the failpoint, after the commit


@pytest.fixture
async def node(spawn_worker, client):
    """Node d1 with two workloads on it, made by a healthy worker that then stops."""
    healthy = spawn_worker("services.allocation.worker")
    await client.request("resource.add-node", NODE)
    placed = await client.request(
        "resource.allocate",
        {"nodename": "d1", "deploy_count": 2, "workload_resource_request": ONE_CORE, "request_id": "setup"}, dict,
    )
    healthy.signal(signal.SIGTERM)
    healthy.wait()
    return [a["workload_id"] for a in placed["allocations"]]


@pytest.mark.parametrize("case", ["usage", "capacity", "realloc", "release"])
async def test_a_change_retried_after_a_crash_is_applied_once(node, spawn_worker, client, case):
    subject, payload = {
        "usage": ("resource.set-node-resource-usage",
                  {"nodename": "d1", "resource": {"cpumem": {"cpu": 1.5, "memory": GiB}}, "delta": True,
                   "incr": True}),
        "capacity": ("resource.set-node-resource-capacity",
                     {"nodename": "d1", "resource": {"cpumem": {"memory": GiB}}, "delta": True, "incr": True}),
        "realloc": ("resource.realloc",
                    {"workload_id": node[0], "workload_resource_request": {"cpumem": {"cpu-request": 1,
                                                                                        "memory-request": GiB}}}),
        "release": ("resource.release", {"workload_ids": node}),
    }[case]
    payload["request_id"] = f"{case}-1"
    info = {"nodename": "d1"}
    before = await spawn_and_read(spawn_worker, client, info)
    await dies_after_commit(spawn_worker, client, subject, payload)
    committed = await spawn_and_read(spawn_worker, client, info)
    assert committed != before  # the first run's change landed before its worker died

    spawn_worker("services.allocation.worker")
    answer = await client.request(subject, payload, dict, timeout=10)  # the retry, on a healthy worker
    after = await client.request("resource.get-node-resource-info", info, dict)
    assert after == committed  # applied once: the retry changed nothing
    assert after["diffs"] == [] or case in ("usage",)  # usage deltas bypass the ledger on purpose
    if case == "release":
        assert sorted(answer["released"]) == sorted(node)  # it names what its first run removed
    if case == "realloc":
        assert answer["workload_id"] == node[0]
        assert answer["delta_resource"]["cpumem"]["cpu_request"] == 1  # the first run's delta, once
    if case == "usage":
        assert answer["after"]["cpumem"]["cpu"] == before["usage"]["cpumem"]["cpu"] + 1.5
    if case == "capacity":
        assert answer["after"]["cpumem"]["memory"] == before["capacity"]["cpumem"]["memory"] + GiB
    # Answered once more, the same way, without applying it a third time.
    assert await client.request(subject, payload, dict, timeout=10) == answer


async def spawn_and_read(spawn_worker, client, info: dict) -> dict:
    """Node info read through a healthy worker that is stopped afterwards (so that the next
    request goes to the worker the test means)."""
    reader = spawn_worker("services.allocation.worker")
    try:
        return await client.request("resource.get-node-resource-info", info, dict)
    finally:
        reader.signal(signal.SIGTERM)
        reader.wait()


async def retried(client, subject: str, payload: dict) -> dict:
    """The answer, sending the request again while it times out (NATS may hand it to the paused
    worker, which reads nothing until it is resumed)."""
    for _ in range(10):
        try:
            return await client.request(subject, payload, dict, timeout=3)
        except BusError as error:
            if error.code != "timeout":
                raise
    raise AssertionError(f"{subject} was never answered")


async def test_a_run_paused_past_its_lease_writes_nothing_after_its_retry_answered(node, spawn_worker, client, nc,
                                                                                   prefix):
    """The fence: a worker that pauses (SIGSTOP) just before its commit, longer than its claim's
    lease, is taken over by a retry; resumed, its commit is refused and it answers `busy`."""
    log = await EventLog.open(nc, prefix, "resource.>")
    paused = spawn_worker("services.allocation.worker", env={"BERTH_FAILPOINTS": "before-commit:stop"})
    payload = {"nodename": "d1", "deploy_count": 1, "workload_resource_request": ONE_CORE, "request_id": "paused"}
    late = await nc.subscribe(nc.new_inbox())
    await nc.publish(client.subject("resource.allocate"), encode(payload), reply=late.subject)
    await eventually(lambda: asyncio.sleep(0, stopped(paused.proc.pid)))  # it reached its commit and paused

    spawn_worker("services.allocation.worker")
    answer = await retried(client, "resource.allocate", payload)  # a healthy worker takes the claim over
    placed = {a["workload_id"] for a in answer["allocations"]}
    paused.signal(signal.SIGCONT)
    first = await late.next_msg(timeout=10)  # the paused run's own answer, late
    assert first.headers[ERROR_CODE_HEADER] == "429" and b"taken over" in first.data

    # The paused run wrote nothing: its worker publishes each commit's event before it answers.
    allocated = {w for subject, event in log.events if subject.endswith(".allocated") for w in event["workload_ids"]}
    assert allocated == placed
    ledger = await client.request("resource.get-allocations", {"nodename": "d1"}, dict)
    assert {a["workload_id"] for a in ledger["allocations"]} == set(node) | placed
    await log.close()


async def test_a_run_paused_before_it_looked_leaves_its_takeovers_placement_alone(node, spawn_worker, client, nc):
    """A run paused (SIGSTOP) at its start, past its lease, resumes after the run that took it over
    placed and answered: looking for earlier runs' placements it finds that one, and when its own
    answer cannot be kept it gives back only what it placed itself: the placement the caller was
    answered stays (the chaos test once saw a stalled run release it)."""
    paused = spawn_worker("services.allocation.worker", env={"BERTH_FAILPOINTS": "run-start:stop"})
    payload = {"nodename": "d1", "deploy_count": 1, "workload_resource_request": ONE_CORE, "request_id": "looked-late"}
    late = await nc.subscribe(nc.new_inbox())
    await nc.publish(client.subject("resource.allocate"), encode(payload), reply=late.subject)
    await eventually(lambda: asyncio.sleep(0, stopped(paused.proc.pid)))  # it paused at its start

    spawn_worker("services.allocation.worker")
    answer = await retried(client, "resource.allocate", payload)  # a healthy worker takes the claim over
    placed = {a["workload_id"] for a in answer["allocations"]}
    paused.signal(signal.SIGCONT)
    first = await late.next_msg(timeout=10)  # the paused run found the placement, and could not keep it
    assert first.headers[ERROR_CODE_HEADER] == "429" and b"taken over" in first.data

    ledger = await client.request("resource.get-allocations", {"nodename": "d1"}, dict)
    assert {a["workload_id"] for a in ledger["allocations"]} == set(node) | placed
    again = await client.request("resource.allocate", payload, dict)  # and the caller's answer still holds
    assert {a["workload_id"] for a in again["allocations"]} == placed
