"""Several broker processes: the pool-loop lease moves when its holder is SIGKILLed, and after every
broker process stops (or is killed) and new ones start, every launched process is still tracked —
none orphaned, none started twice — and every resource continues from the status it had."""

from __future__ import annotations

import asyncio
import signal

from tests.broker_helpers import (
    FAST_ARGS,
    SERVER,
    all_tracked_once,
    const_broker,
    marked_pids,
    param,
    server,
)
from tests.bus_helpers import eventually

pytest_plugins = ["tests.broker_fixtures"]

U = "team-a"
ONE = {"least_instance": 1, "request_instance": 1}
BROKER = "services.broker.worker"


def apply(resource_id: str) -> dict:
    return {"user": U, "resource_id": resource_id, "param": param(), "filter": ONE}


async def lease_holder_pid(redis, prefix: str, name: str) -> int | None:
    holder = await redis.get(f"{prefix}:broker:{{{prefix}}}:lease:{U}:{name}")
    return int(holder.decode().split(":")[1]) if holder else None


async def release_everything(b, redis, prefix: str) -> None:
    for broker in (await b("list-brokers", {"user": U}))["brokers"]:
        await b("remove-broker", {"user": U, "name": broker["name"]})
    # Callers take their sold broker resources along; what is left is released on its own.
    resources = (await b("list-resources", {"user": U}))["resources"]
    for record in sorted(resources, key=lambda r: bool(r["broker_name"])):
        if (await b("get-resource", {"user": U, "resource_id": record["resource_id"]}))[
            "status"
        ] != "released":
            await b("release", {"user": U, "resource_id": record["resource_id"]})

    async def none_left():
        return not marked_pids(prefix)

    await eventually(none_left)


async def test_pool_keeps_refilling_when_the_lease_holder_is_killed(
    spawn_worker, broker_call, broker_processes, redis, prefix
):
    workers = [spawn_worker(BROKER, *FAST_ARGS) for _ in range(2)]
    b = broker_call
    await b("add-broker", const_broker(U, "ha", 2))
    await b.wait_idle(U, "ha", 2)
    holder = await lease_holder_pid(redis, prefix, "ha")
    [victim] = [w for w in workers if w.proc.pid == holder]
    [survivor] = [w for w in workers if w is not victim]

    # Drain the pool, and kill the holder while it refills.
    for i in range(2):
        await b("apply", apply(f"c{i}"))
    victim.signal(signal.SIGKILL)
    await asyncio.to_thread(victim.wait)

    async def taken_over():
        return await lease_holder_pid(redis, prefix, "ha") == survivor.proc.pid

    await eventually(taken_over, timeout=10)
    pool = await b.wait_idle(U, "ha", 2, timeout=20)
    assert (pool["idle"], pool["warming"], pool["sold"]) == (2, 0, 2)
    running = await all_tracked_once(redis, prefix)
    assert len(running) == 4  # two sold, two idle
    # The survivor serves the next apply too.
    await b("apply", apply("c2"))
    await release_everything(b, redis, prefix)


async def test_restart_of_every_replica_forgets_nothing(
    spawn_worker, broker_call, broker_processes, subscribe, redis, prefix
):
    first = [spawn_worker(BROKER, *FAST_ARGS) for _ in range(2)]
    b = broker_call
    await b("add-broker", const_broker(U, "pool", 3))
    await b("init", {"user": U, "resource_id": "cold", "param": param()})
    await b(
        "launch", {"user": U, "resource_id": "cold", "filter": {"least_instance": 1, "request_instance": 2}}
    )
    await b.wait_idle(U, "pool", 3)
    sold = (await b("apply", apply("caller")))["broker_resource_id"]
    await b.wait_idle(U, "pool", 3)
    await b.wait_running(U, "cold")
    before = await all_tracked_once(redis, prefix)
    assert len(before) == 6  # 3 idle + 1 sold + 2 cold

    for worker in first:
        worker.signal(signal.SIGTERM)
    for worker in first:
        assert await asyncio.to_thread(worker.wait) == 0
    assert marked_pids(prefix) == before  # stopping the broker stops no launched process

    events = await subscribe(f"broker.{U}.pool.*")
    for _ in range(2):
        spawn_worker(BROKER, *FAST_ARGS)
    pool = await b.wait_idle(U, "pool", 3)
    assert (pool["idle"], pool["warming"], pool["sold"]) == (3, 0, 1)
    assert await all_tracked_once(redis, prefix) == before
    # Pool rounds after the restart launch nothing again. The sentinel: one more resource asked for
    # now must be the first and only launch of the new replicas, and its readiness (a later round
    # of the same loop) must come with no other launch before it.
    await b("add-broker", const_broker(U, "pool", 4))
    kinds = []
    while not kinds or kinds[-1] != "ready":
        _, event = await events.next(timeout=20)
        kinds.append(event["type"])
    assert kinds == ["launched", "ready"]
    after = await all_tracked_once(redis, prefix)
    [added] = [p for p in after if p not in before]
    assert [p for p in after if p != added] == before
    assert (await b("get-resource", {"user": U, "resource_id": "caller"}))["broker_resource_id"] == sold
    assert (await b("get-service-info", {"user": U, "resource_id": "cold"}))["current_instances"] == 2
    await b("apply", apply("after-restart"))
    await release_everything(b, redis, prefix)


async def test_every_status_recovers_after_all_replicas_are_killed(
    spawn_worker, broker_call, broker_processes, subscribe, redis, prefix, tmp_path
):
    # Servers started with this gate do not listen before the file exists: they stay deploying
    # (or warming) until the test opens it, however slow the machine is.
    gate = tmp_path / "open"
    gated = server("gated", WAIT_FILE=str(gate))
    first = [spawn_worker(BROKER, *FAST_ARGS) for _ in range(2)]
    b = broker_call
    await b("init", {"user": U, "resource_id": "fresh", "param": param()})
    for rid, image in (("steady", {"image": SERVER}), ("gone", {"image": SERVER}), ("slow", gated)):
        await b("init", {"user": U, "resource_id": rid, "param": param(**image)})
        await b("launch", {"user": U, "resource_id": rid, "filter": ONE})
        # An answered launch has reached the operator: the record is never `init` any more.
        assert (await b("get-resource", {"user": U, "resource_id": rid}))["status"] != "init"
    await b.wait_running(U, "steady")
    await b.wait_running(U, "gone")
    await b("release", {"user": U, "resource_id": "gone"})
    await b("add-broker", const_broker(U, "ready", 1))
    await b.wait_idle(U, "ready", 1)
    sold = (await b("apply", apply("buyer")))["broker_resource_id"]
    launched = await subscribe(f"broker.{U}.warmup.launched")
    await b("add-broker", const_broker(U, "warmup", 2, **gated))
    for _ in range(2):
        await launched.next(timeout=10)
    # A burst of launches, all of them still deploying when the replicas die.
    burst = [f"burst-{i}" for i in range(5)]
    for rid in burst:
        await b("init", {"user": U, "resource_id": rid, "param": param(**gated)})
    await asyncio.gather(
        *(
            b(
                "launch",
                {"user": U, "resource_id": rid, "filter": {"least_instance": 2, "request_instance": 2}},
            )
            for rid in burst
        )
    )
    statuses = {r["resource_id"]: r["status"] for r in (await b("list-resources", {"user": U}))["resources"]}
    # Every launch was answered: none of them is `init` any more; the gated ones cannot be running.
    assert {rid: statuses[rid] for rid in ["fresh", "steady", "gone", "slow", *burst]} == {
        "fresh": "init", "steady": "running", "gone": "released", "slow": "deploying",
        **{rid: "deploying" for rid in burst},
    }
    assert (await b.pool(U, "warmup"))["warming"] == 2

    for worker in first:
        worker.signal(signal.SIGKILL)
    for worker in first:
        await asyncio.to_thread(worker.wait)
    steady_before = [p for p in marked_pids(prefix) if "/steady/" in p[0]]
    for _ in range(2):
        spawn_worker(BROKER, *FAST_ARGS)
    gate.touch()  # the gated servers listen now, with the new replicas following them

    async def status(rid: str) -> str:
        return (await b("get-resource", {"user": U, "resource_id": rid}))["status"]

    async def running(rid: str):
        return await status(rid) == "running"

    for rid in ["slow", *burst]:  # deploying and preparing ones finish (the trace timer moved on)
        await eventually(lambda rid=rid: running(rid), timeout=20)
    pool = await b.wait_idle(U, "warmup", 2, timeout=20)  # warming ones were accepted after all
    assert pool["warming"] == 0
    # The ready pool's replacement for the server sold may have been launched only by the new
    # replicas: counted below once it runs (a launch in flight has a process and no pid recorded yet).
    await b.wait_idle(U, "ready", 1, timeout=20)
    assert await status("fresh") == "init" and await status("gone") == "released"
    assert [p for p in marked_pids(prefix) if "/steady/" in p[0]] == steady_before
    assert (await b("get-resource", {"user": U, "resource_id": sold}))["broker_sold"] is True
    assert (await b("get-service-info", {"user": U, "resource_id": "buyer"}))["status"] == "running"
    running_now = await all_tracked_once(redis, prefix)
    # steady 1, slow 1, burst 5 x 2, sold 1, ready pool 1, warmup pool 2: nothing more, nothing less.
    assert len(running_now) == 1 + 1 + 10 + 1 + 1 + 2
    await b("launch", {"user": U, "resource_id": "fresh", "filter": ONE})  # init survives as init
    await b.wait_running(U, "fresh")
    await release_everything(b, redis, prefix)
