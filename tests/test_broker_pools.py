"""Brokers and warm pools over the bus with real HTTP servers: apply, readiness gate, cooling, idle
recycling, strategies, removal, and concurrent applies on several broker processes."""

from __future__ import annotations

import asyncio
import os
import signal
import time
import urllib.request

import pytest

from schemas.errors import BusError
from tests.broker_helpers import FAST, FAST_ARGS, SERVER, const_broker, marked, param, server
from tests.bus_helpers import EventLog, eventually

pytest_plugins = ["tests.broker_fixtures"]

U = "team-a"
ONE = {"least_instance": 1, "request_instance": 1}


def apply(resource_id: str, **param_fields) -> dict:
    return {"user": U, "resource_id": resource_id, "param": param(**param_fields), "filter": ONE}


async def collect(stream, kinds: set[str], count: int, timeout: float = 20.0) -> list[tuple[str, dict]]:
    """The next `count` events whose type is in `kinds` (others are skipped)."""
    found = []
    deadline = time.monotonic() + timeout
    while len(found) < count:
        subject, event = await stream.next(timeout=max(0.1, deadline - time.monotonic()))
        if event["type"] in kinds:
            found.append((subject, event))
    return found


async def test_warm_pool_serves_a_real_http_server(start_broker, broker_call, subscribe, prefix):
    await start_broker()
    b = broker_call
    stream = await subscribe(f"broker.{U}.warm.*")
    view = await b("add-broker", const_broker(U, "warm", 3))
    assert (view["target"], view["strategy"]) == (3, {"type": "const", "num": 3})
    pool = await b.wait_idle(U, "warm", 3)
    assert (pool["warming"], pool["sold"], pool["cooling_until"]) == (0, 0, 0.0)
    assert [e["type"] for _, e in await collect(stream, {"launched", "ready"}, 6)].count("ready") == 3

    reply = await b("apply", apply("task-1"))
    sold = reply["broker_resource_id"]
    assert sold.startswith("bwarm-")
    # The caller's resource is running at once, linked to the broker's; the endpoint serves pages.
    record = await b("get-resource", {"user": U, "resource_id": "task-1"})
    assert (record["status"], record["broker_resource_id"]) == ("running", sold)
    info = await b("get-service-info", {"user": U, "resource_id": "task-1"})
    assert info["status"] == "running" and info["current_instances"] == 1
    endpoint = info["available_endpoints"][0]
    page = await asyncio.to_thread(
        lambda: urllib.request.urlopen(
            f"http://{endpoint['ip']}:{endpoint['ports']['http']}/", timeout=5
        ).read()
    )
    assert page.decode() == f"hello from {prefix}/{U}/{sold}/0\n"
    broker_record = await b("get-resource", {"user": U, "resource_id": sold})
    assert broker_record["broker_sold"] is True and broker_record["broker_name"] == "warm"

    hit_sold = await collect(stream, {"hit", "sold"}, 2)
    assert [(s.rsplit(".", 1)[-1], e["resource_id"], e["caller_id"]) for s, e in hit_sold] == [
        ("hit", sold, "task-1"),
        ("sold", sold, "task-1"),
    ]
    # The pool refills to 3 unsold; the sold one is never handed out again.
    pool = await b.wait_idle(U, "warm", 3)
    assert pool["sold"] == 1
    second = (await b("apply", apply("task-2")))["broker_resource_id"]
    assert second != sold

    await b("release", {"user": U, "resource_id": "task-1"})
    assert (await b("get-resource", {"user": U, "resource_id": sold}))["status"] == "released"
    assert (await b.pool(U, "warm"))["sold"] == 1
    await b("release", {"user": U, "resource_id": "task-2"})
    await b.wait_idle(U, "warm", 3)  # refilled: nothing more will launch
    unsold = (await b("list-resources", {"broker_name": "warm", "broker_sold": False}))["resources"]
    unsold = sorted(r["resource_id"] for r in unsold if r["status"] != "released")
    assert len(unsold) == 3
    removed = await b("remove-broker", {"user": U, "name": "warm"})
    assert removed["released"] == unsold
    assert not marked(prefix)


async def test_launch_is_served_from_a_broker_first(start_broker, broker_call):
    await start_broker()
    b = broker_call
    await b("add-broker", const_broker(U, "warm", 1))
    await b.wait_idle(U, "warm", 1)
    await b("init", {"user": U, "resource_id": "job", "param": param()})
    reply = await b("launch", {"user": U, "resource_id": "job", "filter": ONE})
    assert reply["broker_resource_id"].startswith("bwarm-")
    assert (await b("get-resource", {"user": U, "resource_id": "job"}))["status"] == "running"
    # The pool is empty now (refilling): the next launch goes cold.
    await b("init", {"user": U, "resource_id": "cold", "param": param()})
    assert (await b("launch", {"user": U, "resource_id": "cold", "filter": ONE}))["broker_resource_id"] == ""
    await b.wait_running(U, "cold")
    for rid in ("job", "cold"):
        await b("release", {"user": U, "resource_id": rid})
    await b("remove-broker", {"user": U, "name": "warm"})


async def test_apply_errors_and_the_first_broker_with_a_ready_resource(start_broker, broker_call, subscribe):
    await start_broker()
    b = broker_call
    err = await b.error("apply", apply("x"))
    assert (err.code, err.status, err.details["field"]) == ("broker_param_not_fit", 409, "param")

    # "empty" fits but never has a resource (its target is 0); "full" fits and has one.
    await b("add-broker", const_broker(U, "empty", 0))
    err = await b.error("apply", apply("x"))
    assert (err.code, err.status, err.details["brokers"]) == ("broker_not_enough_resources", 409, ["empty"])
    await b("add-broker", const_broker(U, "full", 1))
    await b("add-broker", const_broker(U, "other-city", 1, fit_fields=["city"]) | {"param": param(city="gz")})
    await b.wait_idle(U, "full", 1)
    stream = await subscribe(f"broker.{U}.*.*")
    served = (await b("apply", apply("y")))["broker_resource_id"]
    assert served.startswith("bfull-")  # crm would have answered "not enough" from the empty first broker
    kinds = [(s.split(".")[-2], e["type"]) for s, e in await collect(stream, {"miss", "hit"}, 2)]
    assert kinds == [("empty", "miss"), ("full", "hit")]
    # A broker whose instances are fewer than the caller's least_instance is not asked.
    err = await b.error("apply", {**apply("z"), "filter": {"least_instance": 2, "request_instance": 2}})
    assert err.code == "broker_not_enough_resources"
    # An already launched caller cannot apply again.
    err = await b.error("apply", apply("y"))
    assert err.code == "application_already_launched"
    await b("release", {"user": U, "resource_id": "y"})
    for name in ("empty", "full", "other-city"):
        await b("remove-broker", {"user": U, "name": name})
    err = await b.error("remove-broker", {"user": U, "name": "full"})
    assert (err.code, err.status, err.details["field"]) == ("broker_not_found", 404, "name")


@pytest.mark.parametrize(
    "instance,failing,accepted",
    [
        (1, "0", False),
        (1, "", True),
        (2, "1", False),
        (2, "", True),
        (3, "1", True),
        (3, "0,2", False),
        (4, "1", True),
        (4, "1,2", False),
    ],
)
async def test_readiness_gate_needs_more_than_half_the_instances(
    start_broker, broker_call, subscribe, instance, failing, accepted
):
    await start_broker()
    b = broker_call
    stream = await subscribe(f"broker.{U}.gate.*")
    image = server("failing", FAIL_INSTANCES=failing) if failing else {"image": SERVER}
    await b("add-broker", const_broker(U, "gate", 1, **image, instance=instance))
    [(_, verdict)] = await collect(stream, {"ready", "cooling"}, 1)
    assert verdict["type"] == ("ready" if accepted else "cooling")
    pool = await b.pool(U, "gate")
    if accepted:
        assert pool["idle"] == 1 and pool["cooling_until"] == 0
    else:
        # The cooling began before its event was published, and lasts `cooling_seconds`.
        assert pool["idle"] == 0
        assert verdict["time"] < pool["cooling_until"] <= verdict["time"] + FAST.cooling_seconds
        assert (await b("list-resources", {"broker_name": "gate", "status": "released"}))["total"] == 1
    await b("remove-broker", {"user": U, "name": "gate"})


async def ticks_until(replica, name: str, done, timeout: float = 20.0):
    """Run the broker's pool tick ourselves (the replica's own loop is idle: `pool_interval` is an
    hour) until `done()` holds; so the test, not a clock, says how many rounds ran."""

    async def ticked():
        await replica.keeper.tick(await replica.store.broker(U, name))
        return await done()

    return await eventually(ticked, timeout)


def kinds_of(log: EventLog, start: int = 0) -> list[str]:
    return [body["type"] for _, body in log.events[start:]]


async def test_cooling_after_a_failed_launch(start_broker, broker_call, nc, prefix):
    _, replica = await start_broker(pool_interval=3600)
    b = broker_call
    log = await EventLog.open(nc, prefix, f"broker.{U}.crash.*")
    await b("add-broker", const_broker(U, "crash", 1, **server("failing", FAIL_INSTANCES="0")))

    async def cooling():
        return "cooling" in kinds_of(log)

    await ticks_until(replica, "crash", cooling)
    assert kinds_of(log) == ["launched", "released", "cooling"]
    cooled = log.events[-1][1]
    pool = await b.pool(U, "crash")
    assert cooled["time"] < pool["cooling_until"] <= cooled["time"] + FAST.cooling_seconds
    assert (pool["warming"], pool["idle"]) == (0, 0)
    err = await b.error("apply", apply("x"))
    assert (err.code, err.status, err.details["brokers"]) == ("broker_cooling", 503, ["crash"])
    # No launch while cooling, however many rounds run ...
    config = await replica.store.broker(U, "crash")
    for _ in range(3):
        await replica.keeper.tick(config)
    # ... and the next one once it is over (its end is a durable deadline: we bring it forward).
    ended = time.time()
    await replica.store.set_broker_state(U, "crash", cooling_until=ended)
    await replica.keeper.tick(config)
    launched = await log.first(lambda e: e[1]["type"] == "launched", after=3)
    assert log.events[launched][1]["time"] >= ended  # the first launch since came after the end
    await b("remove-broker", {"user": U, "name": "crash"})
    await log.close()


async def test_idle_resources_are_recycled_one_at_a_time(start_broker, broker_call, nc, prefix):
    _, replica = await start_broker(pool_interval=3600)  # recycle_seconds: 60
    b = broker_call
    log = await EventLog.open(nc, prefix, f"broker.{U}.aging.*")
    await b("add-broker", const_broker(U, "aging", 3))

    async def full():
        return (await b.pool(U, "aging"))["idle"] == 3

    await ticks_until(replica, "aging", full)
    # Now every idle resource is old enough to be recycled: all three would go at once if nothing
    # held them back.
    await b("add-broker", const_broker(U, "aging", 3, idle_keep_seconds=0.001))
    filled = len(log.events)

    async def recycled():
        return "released" in kinds_of(log, filled)

    await ticks_until(replica, "aging", recycled)
    first = log.events[filled + kinds_of(log, filled).index("released")][1]
    state = await replica.store.broker_state(U, "aging")
    assert first["time"] < state.next_recycle <= first["time"] + FAST.recycle_seconds
    # Within the period, more rounds release nothing (two resources old enough are still idle) ...
    config = await replica.store.broker(U, "aging")
    for _ in range(3):
        await replica.keeper.tick(config)
    pool = await b.pool(U, "aging")
    # The two old enough stayed idle (the replacement may be idle too by now, or still warming).
    assert pool["idle"] + pool["warming"] == 3 and pool["idle"] >= 2
    # ... and once it is over (a durable deadline: we bring it forward), the next round releases one.
    ended = time.time()
    await replica.store.set_broker_state(U, "aging", next_recycle=ended)
    await replica.keeper.tick(config)
    # The sentinel, from a later round: one more resource wanted, so that round launches one.
    await b("add-broker", const_broker(U, "aging", 4, idle_keep_seconds=0.001))
    marked_at = len(log.events)
    await replica.keeper.tick(await replica.store.broker(U, "aging"))
    sentinel = await log.first(lambda e: e[1]["type"] == "launched", after=marked_at)
    releases = [body for _, body in log.events[filled:sentinel] if body["type"] == "released"]
    assert len(releases) == 2, kinds_of(log, filled)  # one per period, two periods
    assert releases[1]["time"] >= ended  # the second only once the first period was over
    await b("remove-broker", {"user": U, "name": "aging"})
    await log.close()


async def test_const_pool_shrinks_to_a_lower_target(start_broker, broker_call):
    await start_broker()
    b = broker_call
    await b("add-broker", const_broker(U, "shrink", 3))
    await b.wait_idle(U, "shrink", 3)
    view = await b("add-broker", const_broker(U, "shrink", 1))  # an update keeps the pool
    assert view["target"] == 1

    async def shrunk():
        pool = await b.pool(U, "shrink")
        return pool if pool["idle"] + pool["warming"] == 1 else None

    await eventually(shrunk)
    await b("remove-broker", {"user": U, "name": "shrink"})


async def test_reactive_pool_follows_demand(start_broker, broker_call):
    _, replica = await start_broker()
    b = broker_call
    strategy = {"type": "reactive", "min": 0, "max": 2, "window_seconds": 1.5, "keep_seconds": 0}
    await b("add-broker", const_broker(U, "demand", 0) | {"strategy": strategy})
    await replica.keeper.tick(await replica.store.broker(U, "demand"))  # a round, done
    pool = await b.pool(U, "demand")
    assert (pool["target"], pool["warming"], pool["idle"]) == (0, 0, 0)  # no demand, no pool
    for i in range(3):
        assert (await b.error("apply", apply(f"c{i}"))).code == "broker_not_enough_resources"
    pool = await b.wait_idle(U, "demand", 2)  # three misses ask for three; max is two
    assert pool["target"] == 2
    served = (await b("apply", apply("later")))["broker_resource_id"]
    assert served.startswith("bdemand-")

    async def back_to_min():  # the window passes without applies: idle ones go
        pool = await b.pool(U, "demand")
        return pool if pool["target"] == 0 and pool["idle"] + pool["warming"] == 0 else None

    await eventually(back_to_min, timeout=10)
    await b("release", {"user": U, "resource_id": "later"})
    await b("remove-broker", {"user": U, "name": "demand"})


async def test_an_idle_server_that_dies_is_replaced(start_broker, broker_call, subscribe, prefix):
    await start_broker()
    b = broker_call
    await b("add-broker", const_broker(U, "fragile", 1))
    await b.wait_idle(U, "fragile", 1)
    [(marker, pid)] = marked(prefix).items()
    stream = await subscribe(f"broker.{U}.fragile.*")
    os.killpg(pid, signal.SIGKILL)
    kinds = [e["type"] for _, e in await collect(stream, {"released", "ready"}, 2)]
    assert kinds == ["released", "ready"]
    assert marker not in marked(prefix) and len(marked(prefix)) == 1
    await b("remove-broker", {"user": U, "name": "fragile"})


async def test_remove_broker_keeps_sold_resources(start_broker, broker_call, prefix):
    await start_broker()
    b = broker_call
    await b("add-broker", const_broker(U, "temp", 2))
    await b.wait_idle(U, "temp", 2)
    sold = (await b("apply", apply("keeper")))["broker_resource_id"]
    removed = await b("remove-broker", {"user": U, "name": "temp"})
    assert sold not in removed["released"]
    assert (await b("list-brokers", {"user": U}))["brokers"] == []
    info = await b("get-service-info", {"user": U, "resource_id": "keeper"})
    assert info["status"] == "running"
    assert list(marked(prefix)) == [f"{prefix}/{U}/{sold}/0"]
    await b("release", {"user": U, "resource_id": "keeper"})
    assert not marked(prefix)


async def test_remove_broker_releases_a_launch_committed_just_before_the_broker_went(
    start_broker, broker_call, prefix
):
    """A pool loop (of any replica) may launch into a broker's pool until the broker is gone; the
    removal must release that resource too (it was left running, with no pool loop to release it,
    when the pool was read before the broker went)."""
    _, replica = await start_broker()
    b = broker_call
    await b("add-broker", const_broker(U, "racing", 1))
    await b.wait_idle(U, "racing", 1)
    store, config = replica.store, await replica.store.broker(U, "racing")
    remove_broker, launched = store.remove_broker, []

    async def launch_then_remove(user: str, name: str, answer: bytes) -> bool:
        # Another replica's pool loop wins the race: its launch commits while the broker still exists.
        launched.append((await replica.resources.launching.launch_for_broker(config)).resource_id)
        return await remove_broker(user, name, answer)

    store.remove_broker = launch_then_remove
    removed = await b("remove-broker", {"user": U, "name": "racing"})
    assert launched and launched[0] in removed["released"]

    async def none_left():
        return not marked(prefix)

    await eventually(none_left)


async def test_sold_resource_scales_through_its_caller(start_broker, broker_call, prefix):
    await start_broker()
    b = broker_call
    await b("add-broker", const_broker(U, "base", 1))
    await b.wait_idle(U, "base", 1)
    sold = (await b("apply", apply("user-job")))["broker_resource_id"]
    reply = await b("scale", {"user": U, "resource_id": "user-job", "filter": ONE})
    assert reply == {"request_instance": 2, "broker_resource_id": ""}
    info = await b.wait_running(U, "user-job")

    async def two():
        info = await b("get-service-info", {"user": U, "resource_id": "user-job"})
        return info if info["current_instances"] == 2 else None

    await eventually(two)
    assert (await b("get-resource", {"user": U, "resource_id": sold}))["request_instance"] == 2
    assert info["status"] == "running"
    await b("release", {"user": U, "resource_id": "user-job"})
    await b("remove-broker", {"user": U, "name": "base"})
    assert not marked(prefix)


async def test_concurrent_applies_on_two_broker_processes_sell_each_resource_once(
    spawn_worker, broker_call, broker_processes, prefix
):
    for _ in range(2):
        spawn_worker("services.broker.worker", *FAST_ARGS)
    b = broker_call
    await b("add-broker", const_broker(U, "race", 4))
    await b.wait_idle(U, "race", 4)
    results = await asyncio.gather(*(b("apply", apply(f"c{i}")) for i in range(12)), return_exceptions=True)
    sold = [r["broker_resource_id"] for r in results if isinstance(r, dict)]
    refused = [r for r in results if isinstance(r, BusError)]
    # At least the four idle ones; a refill that became ready during the burst may be sold too.
    assert len(sold) >= 4 and len(sold) == len(set(sold))  # each resource sold once
    assert len(sold) + len(refused) == 12 and all(r.code == "broker_not_enough_resources" for r in refused)
    callers = (await b("list-resources", {"user": U, "status": "running", "broker_sold": False}))["resources"]
    links = sorted(r["broker_resource_id"] for r in callers if r["broker_resource_id"])
    assert links == sorted(sold)
    for i, result in enumerate(results):
        if isinstance(result, dict):
            await b("release", {"user": U, "resource_id": f"c{i}"})
    await b("remove-broker", {"user": U, "name": "race"})

    async def none_left():
        return not marked(prefix)

    await eventually(none_left)
