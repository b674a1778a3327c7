"""A broker command whose worker dies right after its decisive write, before its answer: the
retry with the same request_id answers with what the first run did (issue 21, issue 16 item 3).

The doomed worker runs with the `after-commit` failpoint: it SIGKILLs itself the moment a
request's write has landed (pool loops and timers do not trip it). Each test shows the fault hit
(the worker died by SIGKILL, the client got no answer, the write is in Redis) and then retries on
a healthy worker; the answer must match the state, and no process may be started twice or leak.
"""

from __future__ import annotations

import asyncio
import signal

import pytest
from nats.micro.request import ERROR_CODE_HEADER

from bus.codec import encode
from schemas.errors import BusError
from tests.broker_helpers import FAST_ARGS, all_tracked_once, const_broker, marked_pids, param
from tests.bus_helpers import eventually, stopped, stream_events

pytest_plugins = ["tests.broker_fixtures"]

U = "team-a"
BROKER = "services.broker.worker"
TWO = {"least_instance": 1, "request_instance": 2}
ONE = {"least_instance": 1, "request_instance": 1}


async def dies_after_commit(spawn_worker, b, command: str, payload: dict) -> None:
    """Send `payload` to a lone worker that dies right after its write; assert that it did."""
    doomed = spawn_worker(BROKER, *FAST_ARGS, env={"BERTH_FAILPOINTS": "after-commit"})
    with pytest.raises(BusError) as unanswered:
        await b(command, payload, timeout=3)
    assert unanswered.value.code in ("timeout", "no_responders")
    assert await asyncio.to_thread(doomed.wait) == -signal.SIGKILL


async def healthy(spawn_worker):
    return spawn_worker(BROKER, *FAST_ARGS)


def stop(worker) -> None:
    worker.signal(signal.SIGTERM)
    worker.wait()


async def status(b, resource_id: str) -> str:
    return (await b("get-resource", {"user": U, "resource_id": resource_id}))["status"]


async def test_init_retried_after_a_crash_answers_as_the_first_run(spawn_worker, broker_call, broker_processes):
    b = broker_call
    payload = {"user": U, "resource_id": "r1", "param": param(), "request_id": "init-1"}
    await dies_after_commit(spawn_worker, b, "init", payload)
    await healthy(spawn_worker)
    assert await status(b, "r1") == "init"  # the first run's write landed
    assert await b("init", payload) == {}  # not resource_already_init: it is its own record


async def test_launch_retried_after_a_crash_finishes_that_launch(spawn_worker, broker_call, broker_processes, redis,
                                                                 prefix):
    b = broker_call
    first = await healthy(spawn_worker)
    await b("init", {"user": U, "resource_id": "r1", "param": param()})
    stop(first)
    payload = {"user": U, "resource_id": "r1", "filter": TWO, "request_id": "launch-1"}
    await dies_after_commit(spawn_worker, b, "launch", payload)
    await healthy(spawn_worker)
    answer = await b("launch", payload)  # not application_already_launched
    assert answer["request_instance"] == 2
    assert await status(b, "r1") in ("deploying", "running")  # the retry finished it, not a 30 s timer
    await b.wait_running(U, "r1")
    assert len(await all_tracked_once(redis, prefix)) == 2  # started once, every process tracked
    await b("release", {"user": U, "resource_id": "r1"})


async def test_apply_retried_after_a_crash_answers_the_resource_it_sold(spawn_worker, broker_call, broker_processes,
                                                                       nc, prefix):
    b = broker_call
    first = await healthy(spawn_worker)
    await b("add-broker", const_broker(U, "pool", 1))
    await b.wait_idle(U, "pool", 1)
    stop(first)
    payload = {"user": U, "resource_id": "caller", "param": param(), "filter": ONE, "request_id": "apply-1"}
    await dies_after_commit(spawn_worker, b, "apply", payload)
    await healthy(spawn_worker)
    record = await b("get-resource", {"user": U, "resource_id": "caller"})
    assert record["status"] == "running" and record["broker_resource_id"]  # the first run sold it
    answer = await b("apply", payload)  # not application_already_launched
    assert answer == {"broker_resource_id": record["broker_resource_id"]}  # the caller holds what it was sold

    async def sale_published():  # the first run died before publishing: a replica's sweep does
        sold = await stream_events(nc, f"{prefix}.events.broker.{U}.pool.sold")
        return [(e["resource_id"], e["caller_id"]) for e in sold]

    assert await eventually(sale_published) == [(record["broker_resource_id"], "caller")]
    await b("remove-broker", {"user": U, "name": "pool"})
    await b("release", {"user": U, "resource_id": "caller"})
    await eventually(lambda: asyncio.sleep(0, not marked_pids(prefix)))


async def test_release_retried_after_a_crash_finishes_that_release(spawn_worker, broker_call, broker_processes,
                                                                  prefix):
    b = broker_call
    first = await healthy(spawn_worker)
    await b("init", {"user": U, "resource_id": "r1", "param": param()})
    await b("launch", {"user": U, "resource_id": "r1", "filter": ONE})
    await b.wait_running(U, "r1")
    stop(first)
    payload = {"user": U, "resource_id": "r1", "request_id": "release-1"}
    await dies_after_commit(spawn_worker, b, "release", payload)
    await healthy(spawn_worker)
    assert await status(b, "r1") in ("deleting", "released")  # the first run began it
    assert await b("release", payload) == {}  # not resource_not_found
    assert await status(b, "r1") == "released"
    await eventually(lambda: asyncio.sleep(0, not marked_pids(prefix)))


async def test_remove_broker_retried_after_a_crash_names_what_it_released(spawn_worker, broker_call,
                                                                          broker_processes, prefix):
    b = broker_call
    first = await healthy(spawn_worker)
    await b("add-broker", const_broker(U, "pool", 1))
    idle = await b.wait_idle(U, "pool", 1)
    assert idle["idle"] == 1
    [resource] = [r["resource_id"] for r in (await b("list-resources", {"user": U}))["resources"]]
    stop(first)
    payload = {"user": U, "name": "pool", "request_id": "remove-1"}
    await dies_after_commit(spawn_worker, b, "remove-broker", payload)
    await healthy(spawn_worker)
    assert (await b("list-brokers", {"user": U}))["brokers"] == []  # the first run removed it
    assert await b("remove-broker", payload) == {"released": [resource]}  # not broker_not_found
    assert await status(b, resource) == "released"
    await eventually(lambda: asyncio.sleep(0, not marked_pids(prefix)))


async def past_the_paused(b, command: str, payload: dict) -> dict:
    """The answer, sending the request again while it times out: NATS may hand it to the paused
    worker, which reads nothing until it is resumed (a state change carries a request_id, so the
    copy the paused worker reads later replays the answer)."""
    for _ in range(10):
        try:
            return await b(command, payload, timeout=3)
        except BusError as error:
            assert error.code == "timeout"
    raise AssertionError(f"{command} was never answered")


async def test_an_apply_paused_past_its_lease_neither_sells_nor_answers_against_its_retry(
    spawn_worker, broker_call, broker_processes, nc, client, prefix
):
    """The fence: a worker that pauses (SIGSTOP) just before its sale, longer than its claim's
    lease, is taken over by a retry that sells; resumed after the caller released what it got, it
    sells nothing more and answers `busy`."""
    b = broker_call
    first = await healthy(spawn_worker)
    await b("add-broker", const_broker(U, "pool", 2))
    await b.wait_idle(U, "pool", 2)
    stop(first)
    paused = spawn_worker(BROKER, *FAST_ARGS, env={"BERTH_FAILPOINTS": "before-commit:stop"})
    payload = {"user": U, "resource_id": "caller", "param": param(), "filter": ONE, "request_id": "apply-p"}
    late = await nc.subscribe(nc.new_inbox())
    await nc.publish(client.subject("broker.apply"), encode(payload), reply=late.subject)
    await eventually(lambda: asyncio.sleep(0, stopped(paused.proc.pid)))  # it reached its sale and paused

    await healthy(spawn_worker)
    answer = await past_the_paused(b, "apply", payload)
    record = await past_the_paused(b, "get-resource", {"user": U, "resource_id": "caller"})
    assert answer == {"broker_resource_id": record["broker_resource_id"]}
    # The caller is done with it before the paused run wakes up: a late sale would give it a
    # resource it never hears of, held by nobody.
    await past_the_paused(b, "release", {"user": U, "resource_id": "caller", "request_id": "release-p"})
    paused.signal(signal.SIGCONT)
    first_answer = await late.next_msg(timeout=10)
    assert first_answer.headers[ERROR_CODE_HEADER] == "429" and b"taken over" in first_answer.data
    assert await status(b, "caller") == "released"
    assert (await b.pool(U, "pool"))["sold"] == 0  # the paused run sold nothing
    await b("remove-broker", {"user": U, "name": "pool"})
    await eventually(lambda: asyncio.sleep(0, not marked_pids(prefix)))


async def test_an_event_committed_by_a_worker_that_died_before_publishing_reaches_the_stream(
    spawn_worker, broker_call, broker_processes, nc, prefix
):
    """The record's change and its event are one write (the outbox): a replica that dies between
    the two leaves the event for another replica's sweep."""
    b = broker_call
    payload = {"user": U, "resource_id": "r1", "param": param(), "request_id": "init-e"}
    subject = f"{prefix}.events.broker.resource.{U}.r1.>"
    await dies_after_commit(spawn_worker, b, "init", payload)
    assert await stream_events(nc, subject) == []  # the fault hit: committed, not published
    await healthy(spawn_worker)
    assert await status(b, "r1") == "init"

    async def published():
        return await stream_events(nc, subject)

    [event] = await eventually(published)
    assert (event["type"], event["resource_id"]) == ("init", "r1")
