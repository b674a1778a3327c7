"""Helpers shared by the tests that call the allocation service over the bus.

    @pytest.fixture
    async def call(serve_allocation, client):
        await serve_allocation(lease_interval=0.05)   # however the module wants its service
        return requester(client)

    await add_node(call, "n1", cpu=2, pool="a")       # add-node with 2 cores, 8G, labels {"pool": "a"}
    await call("allocate", {"nodename": "n1", "deploy_count": 1, "workload_resource_request": ONE_CORE})

`allocate_until_answered` and `check_invariants` are for the tests that run allocation workers
under faults (crashes, partitions, chaos, Redis out of memory).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from schemas.errors import BusError

GiB = 1 << 30
ONE_CORE = {"cpumem": {"cpu-bind": True, "cpu-request": 1, "memory-request": GiB}}  # one bound core


Call = Callable[..., Awaitable[dict]]  # `await call(command, payload, **options)` -> the reply


def requester(client, service: str | None = "resource") -> Call:
    """`await call(command, payload, timeout=...)`: the reply (a dict) of `client`'s request to
    `<service>.<command>` (with `service=None`, `command` is the whole subject)."""

    async def call(command: str, payload: dict, **options: Any) -> dict:
        subject = command if service is None else f"{service}.{command}"
        return await client.request(subject, payload, dict, **options)

    return call


async def add_node(
    call: Call, node: str, *, cpu: int = 2, memory: str = "8G",
    labels: dict | None = None, pool: str | None = None, **resources: Any,
) -> dict:
    """add-node `node` with `cpu` cores and `memory`, and any other plugin's resources
    (`storage={...}`, `gpu={...}`); `labels` are sent only when given (the service's default is none),
    `pool="a"` adds the label {"pool": "a"}."""
    resource = {"cpumem": {"cpu": cpu, "memory": memory}, **resources}
    payload: dict[str, Any] = {"nodename": node, "resource": resource}
    if labels is not None or pool is not None:
        payload["labels"] = {**(labels or {}), **({"pool": pool} if pool is not None else {})}
    return await call("add-node", payload)


async def allocate_until_answered(
    client, nodes: list[str], request_id: str, retries: list[str], *, retried: set[str],
    connection_may_move: bool = False,
) -> dict | str:
    """The answer to one spread allocate on `nodes` (its reply, or its error code), sending it again
    with the same `request_id` while the error is one of `retried` (each retry noted in `retries`).
    `connection_may_move`: the client's own connection is moving to another server, so an error
    of the client itself is retried too."""
    payload = {
        "nodenames": nodes, "strategy": "spread", "deploy_count": 1, "workload_resource_request": ONE_CORE,
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


async def check_invariants(client, nodes: list[str]) -> int:
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
