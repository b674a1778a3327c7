"""What the broker answers stays true while its workers are killed and stalled (issue 21).

Three broker worker processes on the `process` operator, two `const` pools, 16 clients. Each
client works on resource ids of its own: it `apply`s for a pool resource, or `init`s and
`launch`es one cold (a param no pool fits), and `release`s what it holds. Every call has a unique
`request_id` and is sent once more with the same id whenever it went unanswered (timeout, busy,
unavailable, no responders). Every 4-5 s one worker is SIGKILLed (and a new one started), or, in
the second variant, SIGSTOPped for longer than the claim lease (2 s) and then resumed.

Since no two clients share an id, every answer is decided by the client's own history: an error a
first run could not have given (`application_already_launched` to an `apply` on a fresh id,
`resource_already_init`, `resource_not_found` to a release of a held id) is a retry answering as
if its own first run were someone else's, and fails at once. At the end, once the pools settled:
- every answered command matches the state: an `apply` answered X -> the caller's record is
  `running` and linked to X, sold (or both released, after the client released it); an `apply`
  refused -> no record; an `init` + `launch` answered -> the record is running with the instances
  answered; a `launch` refused -> the record is still `init`; a `release` answered -> `released`;
- no resource is held by nobody: the live sold pool resources are exactly those the clients were
  sold and hold;
- no process leaked: what runs is what the broker tracked, no instance twice, each resource with
  the instances it was answered (pool resources one); after releasing everything and removing the
  pools, none is left.
The faults must have hit: workers died or stalled with requests in flight, and clients retried.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import random
import signal
import time
from collections import Counter
from dataclasses import dataclass, field

import pytest

from schemas.errors import BusError
from tests.broker_helpers import (
    FAST_ARGS,
    all_tracked_once,
    const_broker,
    marked,
    marked_pids,
    param,
)
from tests.bus_helpers import eventually

pytest_plugins = ["tests.broker_fixtures"]

U = "team-a"
BROKER = "services.broker.worker"
POOLS = {"small": 2, "big": 3}  # broker name -> warm resources kept (one instance each)
CLIENTS = 16
HOLD = 2  # resources a client holds at most: bounds the processes on a shared two-core machine
TIMEOUT = 3.0  # the client's patience; a stall (3 s) outlasts the claim lease (2 s)
STALL = 3.0
RETRIED = {"timeout", "busy", "unavailable", "no_responders"}  # not answered yet: send it again
COLD = param(worker_version="cold")  # fits no pool (fit fields: city, worker_version): launched cold
# The only refusals a first run can give here: every pool empty (apply); the operator full (launch).
REFUSALS = {"apply": {"broker_not_enough_resources"}, "init": set(), "launch": {"no_enough_resources"},
            "release": set()}


@dataclass
class Life:
    """One resource id of one client, and what the client was told about it."""

    kind: str  # "apply" or "cold"
    sold: str = ""  # the broker resource an apply was answered with
    instances: int = 0  # the instances a launch was answered with
    refused: str = ""  # the error code an apply or launch was answered with
    released: bool = False


@dataclass
class Book:
    """What the clients were told, and how the faults met them."""

    lives: dict[str, Life] = field(default_factory=dict)
    refused: Counter = field(default_factory=Counter)
    retried: set[str] = field(default_factory=set)  # request ids sent more than once
    retries: int = 0
    in_flight: int = 0  # requests sent and not answered yet
    faults: list[int] = field(default_factory=list)  # requests in flight at each fault


async def call(b, book: Book, command: str, payload: dict, give_up_at: float) -> dict | str:
    """The reply (or the error code) to `payload`, sent again with its request_id while unanswered.
    An error code a first run could not have given fails at once, naming the request."""
    book.in_flight += 1
    try:
        while True:
            try:
                return await b(command, payload, timeout=TIMEOUT)
            except BusError as error:
                if error.code not in RETRIED:
                    retried = payload["request_id"] in book.retried
                    assert error.code in REFUSALS[command], (command, payload["request_id"], error.code,
                                                             retried)
                    book.refused[error.code] += 1
                    return error.code
            book.retries += 1
            book.retried.add(payload["request_id"])
            assert time.monotonic() < give_up_at, f"{command} {payload['request_id']} was never answered"
            await asyncio.sleep(0.05)
    finally:
        book.in_flight -= 1


async def apply(b, book: Book, rid: str, give_up_at: float) -> None:
    one = {"least_instance": 1, "request_instance": 1}
    payload = {"user": U, "resource_id": rid, "param": param(), "filter": one}
    life = book.lives[rid] = Life("apply")
    answer = await call(b, book, "apply", {**payload, "request_id": f"{rid}-apply"}, give_up_at)
    if isinstance(answer, str):
        life.refused = answer
    else:
        life.sold = answer["broker_resource_id"]
        assert life.sold, (rid, answer)


async def init_and_launch(b, book: Book, rid: str, instances: int, give_up_at: float) -> None:
    life = book.lives[rid] = Life("cold")
    init = {"user": U, "resource_id": rid, "param": COLD, "request_id": f"{rid}-init"}
    assert await call(b, book, "init", init, give_up_at) == {}
    launch = {"user": U, "resource_id": rid, "filter": {"least_instance": 1, "request_instance": instances},
              "request_id": f"{rid}-launch"}
    answer = await call(b, book, "launch", launch, give_up_at)
    if isinstance(answer, str):
        life.refused = answer
    else:
        assert answer["broker_resource_id"] == "", (rid, answer)  # cold: no pool fits its param
        life.instances = answer["request_instance"]


async def release(b, book: Book, rid: str, give_up_at: float) -> None:
    payload = {"user": U, "resource_id": rid, "request_id": f"{rid}-release"}
    assert await call(b, book, "release", payload, give_up_at) == {}
    book.lives[rid].released = True


async def one_client(b, index: int, book: Book, stop_at: float) -> None:
    """Apply, init + launch, and release what it holds, until `stop_at`. Each resource id gets each
    command at most once, so the id and the command name the request."""
    rng = random.Random(index)
    held: list[str] = []
    give_up_at = stop_at + 60
    for serial in itertools.count():
        if time.monotonic() >= stop_at:
            return
        if held and (len(held) >= HOLD or rng.random() < 0.3):
            await release(b, book, held.pop(rng.randrange(len(held))), give_up_at)
            continue
        rid = f"c{index}-{serial}"
        if rng.random() < 0.6:
            await apply(b, book, rid, give_up_at)
        else:
            await init_and_launch(b, book, rid, rng.choice([1, 2]), give_up_at)
        life = book.lives[rid]
        if life.sold or life.instances or life.kind == "cold":
            held.append(rid)  # a cold record is held even when its launch was refused
        else:
            await asyncio.sleep(rng.uniform(0.05, 0.2))  # every pool was empty: let them refill


async def chaos(spawn_worker, workers: list, stop_at: float, stall: bool, book: Book) -> None:
    """Every 4-5 s, SIGKILL a worker and start a new one, or SIGSTOP one for `STALL` seconds."""
    rng = random.Random(21)
    await asyncio.sleep(2.0)
    while time.monotonic() < stop_at - STALL:
        victim = rng.choice(workers)
        book.faults.append(book.in_flight)
        if stall:
            victim.signal(signal.SIGSTOP)
            try:
                await asyncio.sleep(STALL)
            finally:  # also when a client failed: a stopped worker would not drain at the end
                victim.signal(signal.SIGCONT)
            await asyncio.sleep(rng.uniform(1.0, 2.0))
        else:
            victim.signal(signal.SIGKILL)
            await asyncio.to_thread(victim.wait)
            workers.remove(victim)
            workers.append(await respawn(spawn_worker))
            await asyncio.sleep(rng.uniform(4.0, 5.0))


async def respawn(spawn_worker):
    """A new broker worker, started in a thread (it takes a second). Waited for even when a failing
    client cancels the faults: the `spawn_worker` fixture stops only the workers it knows of when
    the test ends."""
    start = asyncio.ensure_future(asyncio.to_thread(spawn_worker, BROKER, *FAST_ARGS))
    try:
        return await asyncio.shield(start)
    except asyncio.CancelledError:
        await start
        raise


async def run_under_faults(spawn_worker, b, *, stall: bool, seconds: float) -> Book:
    workers = [spawn_worker(BROKER, *FAST_ARGS) for _ in range(3)]
    for name, num in POOLS.items():
        await b("add-broker", const_broker(U, name, num))
    for name, num in POOLS.items():
        await b.wait_idle(U, name, num)
    book = Book()
    stop_at = time.monotonic() + seconds
    # A task group: a client that fails at once stops the others (and the faults) with it.
    async with asyncio.TaskGroup() as group:
        group.create_task(chaos(spawn_worker, workers, stop_at, stall, book))
        for index in range(CLIENTS):
            group.create_task(one_client(b, index, book, stop_at))
    # The faults hit: workers died or stalled with requests in flight, and clients had to retry.
    assert book.faults and max(book.faults) > 0, book.faults
    assert book.retries > 0 and book.retried, book.retries
    # The load was real: resources were sold and launched, and most pools ran dry at times.
    assert any(life.sold for life in book.lives.values()), book.refused
    assert any(life.instances for life in book.lives.values()), book.refused
    return book


async def record_of(b, rid: str) -> dict | None:
    try:
        return await b("get-resource", {"user": U, "resource_id": rid})
    except BusError as error:
        assert error.code == "resource_not_found", (rid, error.code)
        return None


async def resources(b, **filters) -> list[dict]:
    listed = await b("list-resources", {"user": U, "limit": 1000, **filters})
    assert listed["total"] == len(listed["resources"]), listed["total"]  # one page holds them all
    return listed["resources"]


async def settled(b, book: Book) -> None:
    """Wait until what the faults left half done is finished: the pools are full and ready, and
    every held cold launch is running."""
    left: list = []

    async def done() -> bool:
        left[:] = await unsettled(b, book)
        return not left

    try:
        await eventually(done, timeout=30)
    except AssertionError:
        raise AssertionError(f"never settled: {left}") from None


async def unsettled(b, book: Book) -> list:
    """The pools that are not full and ready, and the held cold launches that are not running."""
    pools = [await b.pool(U, name) for name in POOLS]
    left: list = [p for p in pools if (p["idle"], p["warming"], p["deleting"]) != (POOLS[p["name"]], 0, 0)]
    for rid, life in book.lives.items():
        if life.instances and not life.released:
            record = await record_of(b, rid)
            if record["status"] != "running":
                left.append(record)
    return left


async def check_answers_match_state(b, book: Book) -> None:
    for rid, life in book.lives.items():
        record = await record_of(b, rid)
        if life.refused and life.kind == "apply":
            assert record is None, (rid, "refused apply wrote a record", record)
            continue
        assert record is not None, (rid, life)
        want = "released" if life.released else ("init" if life.refused else "running")
        assert record["status"] == want, (rid, life, record)
        if life.sold:
            assert record["broker_resource_id"] == life.sold, (rid, life, record)
            sold = await record_of(b, life.sold)
            assert sold["broker_sold"] and sold["status"] == want, (rid, life, sold)
        elif life.instances:
            assert record["request_instance"] == life.instances, (rid, life, record)


async def check_nothing_held_by_nobody(b, book: Book) -> None:
    """The live sold pool resources are exactly those the clients were answered with and hold."""
    sold = {r["resource_id"] for r in await resources(b, broker_sold=True) if r["status"] != "released"}
    held = {life.sold for life in book.lives.values() if life.sold and not life.released}
    assert sold == held, ("held by nobody", sold - held, "answered but not sold", held - sold)


async def check_no_process_leaked(b, book: Book, redis, prefix: str) -> None:
    """What runs is what the broker tracked, each resource with the instances it was answered."""
    await all_tracked_once(redis, prefix)
    running = Counter(marker.split("/")[2] for marker in marked(prefix))
    want = Counter()
    for rid, life in book.lives.items():
        if not life.released and (life.sold or life.instances):
            want[life.sold or rid] = life.instances or 1
    for record in await resources(b, broker_sold=False):
        if record["broker_name"] and record["status"] != "released":
            want[record["resource_id"]] = 1  # a pool's unsold resource: one instance
    assert running == want, ("running", running - want, "missing", want - running)


async def release_everything(b, book: Book, prefix: str, redis) -> None:
    """Release what the clients hold and remove the pools: no process may be left."""
    for rid, life in book.lives.items():
        if not life.released and not (life.kind == "apply" and life.refused):
            await b("release", {"user": U, "resource_id": rid})
    for name in POOLS:
        await b("remove-broker", {"user": U, "name": name})
    await eventually(lambda: asyncio.sleep(0, not marked_pids(prefix)), timeout=20)
    assert await all_tracked_once(redis, prefix) == []


@pytest.mark.parametrize("stall", [False, True], ids=["kill", "stall"])
async def test_broker_answers_stay_true_when_workers_die_or_stall(
    broker_processes, spawn_worker, broker_call, redis, prefix, stall
):
    # `broker_processes` before `spawn_worker`: after a failure, the workers are stopped before
    # the launched processes are killed, so that none is launched after that.
    seconds = float(os.environ.get("BERTH_CHAOS_SECONDS", "20"))
    book = await run_under_faults(spawn_worker, broker_call, stall=stall, seconds=seconds)
    await settled(broker_call, book)
    await check_answers_match_state(broker_call, book)
    await check_nothing_held_by_nobody(broker_call, book)
    await check_no_process_leaked(broker_call, book, redis, prefix)
    await release_everything(broker_call, book, prefix, redis)
