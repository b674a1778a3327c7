"""Workers SIGKILLed under load, clients that retry every request with its request_id until it is
answered: no over-commit, usage equal to the ledger, and no orphans (every workload in a ledger is
one an answered request owns, and every answered placement is in a ledger)."""

from __future__ import annotations

import asyncio
import random
import signal

import pytest

from tests.allocation_helpers import allocate_until_answered, check_invariants

NODES = [f"k{i}" for i in range(8)]
CORES = 8
CLIENTS = 48
REQUESTS = 144  # more than the 64 that fit: the rest are answered insufficient_capacity
KILLS = 4
RETRIED = {"timeout", "no_responders", "busy"}  # no answer yet: send the same request again




@pytest.mark.slow
async def test_killed_workers_leave_no_orphans_when_every_request_is_retried(spawn_worker, client):
    workers = [spawn_worker("services.allocation.worker") for _ in range(3)]
    for node in NODES:
        await client.request("resource.add-node", {"nodename": node, "resource": {"cpumem": {"cpu": CORES, "memory": "64G"}}})
    answers: dict[str, dict | str] = {}
    retries: list[str] = []
    slots = asyncio.Semaphore(CLIENTS)
    killed = 0
    chaos = random.Random(7)

    async def kill_one() -> None:
        # Every so many answers, SIGKILL a worker (mid-request: 48 are in flight) and start another.
        nonlocal killed
        victim = chaos.choice([w for w in workers if w.proc.poll() is None])
        victim.signal(signal.SIGKILL)
        killed += 1
        workers.append(await asyncio.to_thread(spawn_worker, "services.allocation.worker"))

    async def one(index: int) -> None:
        async with slots:
            answers[f"req-{index}"] = await allocate_until_answered(client, NODES, f"req-{index}", retries, retried=RETRIED)
        if len(answers) % (REQUESTS // (KILLS + 1)) == 0 and killed < KILLS:
            await kill_one()

    await asyncio.gather(*(one(i) for i in range(REQUESTS)))
    assert killed == KILLS
    assert "timeout" in retries  # requests died with their worker, and were answered on a retry
    placed = {a["workload_id"] for reply in answers.values() if isinstance(reply, dict) for a in reply["allocations"]}
    refused = [reply for reply in answers.values() if not isinstance(reply, dict)]
    assert set(refused) <= {"insufficient_capacity"}, refused
    assert len(placed) == len(NODES) * CORES  # everything that fits was placed, once per request
    held = set()
    for node in NODES:
        ledger = await client.request("resource.get-allocations", {"nodename": node}, dict)
        held |= {a["workload_id"] for a in ledger["allocations"]}
    assert held == placed  # no orphan, nothing answered but missing
    assert await check_invariants(client, NODES) == len(placed)
