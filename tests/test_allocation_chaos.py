"""What allocation answers stays true while its workers are killed and stalled (issue 16).

Three worker processes, 48 clients, 8 small nodes kept nearly full (most allocates are refused for
capacity), clients that allocate and release with a unique `request_id` each and send a request
once more with the same id whenever it timed out. Every so often one worker is SIGKILLed (and a new
one started; stopped for a moment before, so that it dies holding requests), or SIGSTOPped for
longer than the claim lease and then resumed. At the end:
- every placement a client was answered with is in its node's ledger, unless a release named it;
- every id a release named was one a client had been answered with, and is in no ledger;
- no id is in two ledgers, usage equals the ledger, nothing is over-committed;
- the ledgers hold nothing that no client was answered with (no orphan), once dead runs' claims expired.
The faults must have hit: workers died or stalled with requests in flight (clients timed out).
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time

import pytest

from schemas.errors import BusError
from tests.allocation_helpers import ONE_CORE, check_invariants

NODES = [f"x{i}" for i in range(8)]
CORES = 4
CLIENTS = 48
RETRIED = {"timeout", "busy", "unavailable", "no_responders"}  # not answered yet: send it again
TIMEOUT = 2.0  # the client's patience; a stall (3 s) outlasts it and the claim lease (2 s)
KILL_AFTER_STOP = 0.3  # seconds a worker is held stopped before it is killed


class Ledger:
    """What the clients were told."""

    def __init__(self) -> None:
        self.answered: dict[str, str] = {}  # workload id -> node, for every placement answered
        self.released: set[str] = set()  # every id a release answer named
        self.refused: dict[str, int] = {}  # error code -> how many
        self.retries = 0
        self.retried: set[str] = set()  # request ids sent more than once
        self.timed_out: list[float] = []  # when a request went unanswered (time.monotonic())
        self.held: dict[int, list[str]] = {}  # client -> the ids it holds


async def call_until_answered(client, subject: str, payload: dict, book: Ledger, deadline: float) -> dict | str:
    """The reply (or the error code) to `payload`, sent again with its request_id while unanswered."""
    while True:
        try:
            return await client.request(subject, payload, dict, timeout=TIMEOUT)
        except BusError as error:
            if error.code not in RETRIED:
                return error.code
            if error.code == "timeout":
                book.timed_out.append(time.monotonic())
            book.retries += 1
            book.retried.add(payload["request_id"])
        if time.monotonic() > deadline + 60:
            raise AssertionError(f"{subject} {payload['request_id']} was never answered")
        await asyncio.sleep(0.05)


async def one_client(client, index: int, book: Ledger, stop_at: float) -> None:
    rng = random.Random(index)
    held = book.held.setdefault(index, [])
    serial = 0
    while time.monotonic() < stop_at:
        serial += 1
        request_id = f"c{index}-{serial}"
        if held and rng.random() < 0.35:
            ids = rng.sample(held, k=min(len(held), rng.randint(1, 2)))
            reply = await call_until_answered(
                client, "resource.release", {"workload_ids": ids, "request_id": request_id}, book, stop_at
            )
            assert isinstance(reply, dict), (request_id, reply)
            # It held them, so all go, and the answer names them, also when a retry answers for a
            # run that removed them and died.
            assert set(reply["released"]) == set(ids), (request_id, request_id in book.retried, ids, reply)  # it held them: all go
            book.released |= set(reply["released"])
            held[:] = [w for w in held if w not in ids]
            continue
        payload = {
            "nodenames": NODES, "strategy": "spread", "deploy_count": 1,
            "workload_resource_request": ONE_CORE, "request_id": request_id,
        }
        reply = await call_until_answered(client, "resource.allocate", payload, book, stop_at)
        if isinstance(reply, str):
            book.refused[reply] = book.refused.get(reply, 0) + 1
            await asyncio.sleep(rng.uniform(0, 0.05))
            continue
        for placed in reply["allocations"]:
            assert placed["workload_id"] not in book.answered, placed  # never handed out twice
            book.answered[placed["workload_id"]] = placed["nodename"]
            held.append(placed["workload_id"])


async def chaos(spawn_worker, workers: list, stop_at: float, stall: bool, faults: list[float]) -> None:
    rng = random.Random(16)
    await asyncio.sleep(1.5)
    while time.monotonic() < stop_at - 3:
        victim = rng.choice([w for w in workers if w.proc.poll() is None])
        if stall:
            victim.signal(signal.SIGSTOP)
            faults.append(time.monotonic())
            await asyncio.sleep(3.0)
            victim.signal(signal.SIGCONT)
        else:
            # Stopped first: it dies in the state the stop caught it in (a kill at that very point),
            # holding the requests routed to it meanwhile, so the kill hits requests in flight even
            # at a moment when it held none (CI once killed a worker that did).
            victim.signal(signal.SIGSTOP)
            faults.append(time.monotonic())
            await asyncio.sleep(KILL_AFTER_STOP)
            victim.signal(signal.SIGKILL)
            workers.remove(victim)
            workers.append(await asyncio.to_thread(spawn_worker, "services.allocation.worker"))
        await asyncio.sleep(rng.uniform(1.0, 2.0))


async def run_under_faults(spawn_worker, client, *, stall: bool, seconds: float) -> Ledger:
    workers = [spawn_worker("services.allocation.worker") for _ in range(3)]
    for node in NODES:
        await client.request(
            "resource.add-node", {"nodename": node, "resource": {"cpumem": {"cpu": CORES, "memory": "8G"}}}
        )
    book = Ledger()
    faults: list[float] = []  # when each fault hit
    stop_at = time.monotonic() + seconds
    await asyncio.gather(
        chaos(spawn_worker, workers, stop_at, stall, faults),
        *(one_client(client, i, book, stop_at) for i in range(CLIENTS)),
    )
    # The faults hit: each killed or stopped worker held requests, which went unanswered (a client's
    # timeout within its patience after the fault), and clients had to retry.
    assert faults and book.retries > 0, (faults, book.retries)
    unfelt = [at for at in faults if not any(at <= t <= at + TIMEOUT + 1.5 for t in book.timed_out)]
    assert not unfelt, f"faults after which no request timed out: {unfelt} ({len(faults)} faults)"
    assert book.answered and book.refused.get("insufficient_capacity", 0) > len(book.answered), book.refused
    assert set(book.refused) <= {"insufficient_capacity"}, book.refused
    return book


async def check_answers_true(client, book: Ledger) -> None:
    where: dict[str, str] = {}
    for node in NODES:
        ledger = await client.request("resource.get-allocations", {"nodename": node}, dict)
        for entry in ledger["allocations"]:
            assert entry["workload_id"] not in where, entry  # no id in two ledgers
            where[entry["workload_id"]] = node
    held = {wid: node for wid, node in book.answered.items() if wid not in book.released}
    assert book.released <= set(book.answered)  # releases named only ids that were handed out
    lost = {wid: node for wid, node in held.items() if where.get(wid) != node}
    assert not lost, f"answered placements missing from their ledger: {lost}"
    orphans = set(where) - set(held)
    assert not orphans, f"ledger entries no client holds: {orphans}"
    assert await check_invariants(client, NODES) == len(held)


@pytest.mark.parametrize("stall", [False, True], ids=["kill", "stall"])
async def test_answers_stay_true_when_workers_die_or_stall(spawn_worker, client, stall):
    seconds = float(os.environ.get("BERTH_CHAOS_SECONDS", "20"))
    book = await run_under_faults(spawn_worker, client, stall=stall, seconds=seconds)
    await asyncio.sleep(2.5)  # a dead run's claim lease (2 s) ends; its retry already cleaned up
    await check_answers_true(client, book)
