"""Several allocation worker processes under many concurrent clients: no over-commit, usage == ledger.

The second test SIGKILLs one worker in the middle of the run: requests it held are lost (their
clients time out), but nothing it did may leave usage that the ledger does not explain.
"""

from __future__ import annotations

import asyncio
import signal

import pytest

from schemas.errors import BusError

GiB = 1 << 30
NODES = [f"c{i}" for i in range(4)]
CORES = 8
REQUEST = {"cpumem": {"cpu-bind": True, "cpu-request": 1, "memory-request": GiB}}


async def setup_nodes(client) -> None:
    for node in NODES:
        await client.request(
            "resource.add-node", {"nodename": node, "resource": {"cpumem": {"cpu": CORES, "memory": f"{4 * CORES}G"}}}
        )


async def allocate_many(client, count: int, in_flight: int, on_reply=None) -> tuple[int, list[str]]:
    slots = asyncio.Semaphore(in_flight)
    placed, failures = 0, []

    async def one() -> None:
        nonlocal placed
        async with slots:
            try:
                reply = await client.request(
                    "resource.allocate",
                    {"nodenames": NODES, "strategy": "spread", "deploy_count": 1, "workload_resource_request": REQUEST},
                    dict, timeout=3,
                )
                placed += len(reply["allocations"])
            except BusError as error:
                failures.append(error.code)
            if on_reply:
                await on_reply(placed + len(failures))

    await asyncio.gather(*(one() for _ in range(count)))
    return placed, failures


async def allocate_until_answered(
    client, nodes: list[str], request_id: str, retries: list[str], *, retried: set[str],
    connection_may_move: bool = False,
) -> dict | str:
    """The answer to one spread allocate on `nodes` (its reply, or its error code), sending it again
    with the same `request_id` while the error is one of `retried` (each retry noted in `retries`).
    `connection_may_move`: the client's own connection is moving to another server, so an error
    of the client itself is retried too."""
    payload = {
        "nodenames": nodes, "strategy": "spread", "deploy_count": 1, "workload_resource_request": REQUEST,
        "request_id": request_id,
    }
    while True:
        try:
            return await client.request("resource.allocate", payload, dict, timeout=3)
        except BusError as error:
            if error.code not in retried:
                return error.code
            retries.append(error.code)
        except Exception as error:
            if not connection_may_move:
                raise
            retries.append(type(error).__name__)
        await asyncio.sleep(0.05)


async def check_invariants(client, nodes: list[str] = NODES) -> int:
    """No core or memory over-committed, usage equal to the ledger; returns the ledger's size."""
    held = 0
    for node in nodes:
        info = await client.request("resource.get-node-resource-info", {"nodename": node}, dict)
        assert info["diffs"] == [], (node, info["diffs"])  # usage is exactly what the ledger explains
        capacity, usage = info["capacity"]["cpumem"], info["usage"]["cpumem"]
        assert all(0 <= usage["cpu_map"][core] <= pieces for core, pieces in capacity["cpu_map"].items())
        assert 0 <= usage["memory"] <= capacity["memory"]
        ledger = await client.request("resource.get-allocations", {"nodename": node}, dict)
        held += len(ledger["allocations"])
        assert usage["cpu"] == len(ledger["allocations"])
    return held


@pytest.mark.slow
async def test_three_workers_never_over_commit(spawn_worker, client):
    for _ in range(3):
        spawn_worker("services.allocation.worker")
    await setup_nodes(client)
    placed, failures = await allocate_many(client, 200, in_flight=200)
    fits = len(NODES) * CORES
    assert placed == fits
    assert set(failures) == {"insufficient_capacity"} and len(failures) == 200 - fits
    assert await check_invariants(client) == fits


@pytest.mark.slow
async def test_killing_a_worker_mid_run_loses_nothing(spawn_worker, client):
    workers = [spawn_worker("services.allocation.worker") for _ in range(3)]
    await setup_nodes(client)
    killed = asyncio.Event()

    async def kill_midway(done: int) -> None:
        if done >= 8 and not killed.is_set():
            killed.set()
            workers[0].signal(signal.SIGKILL)

    placed, failures = await allocate_many(client, 200, in_flight=8, on_reply=kill_midway)
    assert killed.is_set()
    assert set(failures) <= {"insufficient_capacity", "timeout"}
    fits = len(NODES) * CORES
    held = await check_invariants(client)
    # Requests lost with the killed worker may have committed before it died (their clients timed
    # out), so the ledger can hold more than the replies said; but everything that fits was placed.
    assert held == fits and placed <= fits
