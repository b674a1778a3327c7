"""Redis out of memory: a redis-server at its `maxmemory` with `noeviction` (as `berth up` runs it)
refuses writes; an allocation worker on it answers `unavailable` (503), writes nothing, and the
same requests with the same request_id land once memory is freed: with its scripts run by EVALSHA,
and as Redis Functions (as on `berth up`: Redis refuses a function that may write whole, before it
runs; reads carry `no-writes` and still answer)."""

from __future__ import annotations

import pytest
from redis.asyncio import Redis
from redis.exceptions import OutOfMemoryError

from berth.redis_functions import every_library
from berth.servers import memory_limit, start_redis
from bus import scripts
from bus.client import BusClient
from schemas.errors import BusError
from tests.allocation_helpers import ONE_CORE, check_invariants
from tests.worker_helpers import start_worker, stop_workers

LIMIT = 16 << 20


def node(name: str) -> dict:
    return {"nodename": name, "resource": {"cpumem": {"cpu": 4, "memory": "16G"}}}


async def fill(store: Redis) -> int:
    """Write junk until Redis refuses a write for memory; returns how many junk keys it took.

    A write is refused when the memory in use, its own request included, is above the limit, so
    right after the refusal the data alone may sit just below it. The limit is then lowered under
    what the data holds, so that Redis stays full whatever a few requests' buffers do."""
    written = 0
    with pytest.raises(OutOfMemoryError):
        while True:
            await store.set(f"junk:{written}", b"x" * 65536)
            written += 1
    used = (await store.info("memory"))["used_memory"]
    await store.config_set("maxmemory", used - (1 << 20))
    memory = await store.info("memory")
    assert memory["used_memory"] > memory["maxmemory"] > 0  # the fault holds: Redis is full
    return written


async def free(store: Redis, junk: int) -> None:
    await store.delete(*(f"junk:{i}" for i in range(junk)))
    await store.config_set("maxmemory", LIMIT)
    memory = await store.info("memory")
    assert memory["used_memory"] < memory["maxmemory"]


@pytest.mark.parametrize("functions", [False, True], ids=["evalsha", "functions"])
async def test_a_full_redis_answers_unavailable_writes_nothing_and_the_retry_lands(tmp_path, nats_url, nc, prefix,
                                                                                  functions):
    server = start_redis(tmp_path / "redis", appendonly=False, extra=memory_limit(str(LIMIT)))
    store = Redis.from_url(server.url)
    workers = []
    try:
        if functions:
            await scripts.load(store, every_library())
        workers.append(start_worker("services.allocation.worker", nats_url, server.url, prefix))
        client = BusClient(nc, prefix=prefix, timeout=5.0)
        await client.request("resource.add-node", node("n1"))
        allocate = {"nodename": "n1", "deploy_count": 2, "workload_resource_request": ONE_CORE}
        retried = {**allocate, "request_id": "oom-1"}
        junk = await fill(store)
        # add-node: a record script; allocate with no request_id: index entries then the commit
        # script; allocate with a request_id: its claim first.
        for subject, payload in (("resource.add-node", node("n2")), ("resource.allocate", allocate),
                                 ("resource.allocate", retried)):
            with pytest.raises(BusError) as refused:
                await client.request(subject, payload)
            assert (refused.value.code, refused.value.status) == ("unavailable", 503), subject
        # Nothing half-written: no node, no ledger entry, no index entry, no claim kept.
        assert [n["nodename"] for n in (await client.request("resource.list-nodes", {}))["nodes"]] == ["n1"]
        assert (await client.request("resource.get-allocations", {"nodename": "n1"}))["allocations"] == []
        assert await store.hlen(f"{prefix}:allocation:workloads") == 0
        assert [key async for key in store.scan_iter(match=f"{prefix}:idem:*")] == []
        await free(store, junk)
        placed = (await client.request("resource.allocate", retried))["allocations"]
        assert [a["nodename"] for a in placed] == ["n1", "n1"]
        await client.request("resource.add-node", node("n2"))
        assert await check_invariants(client, ["n1", "n2"]) == 2  # usage == ledger, nothing more held
        assert ("cmdstat_fcall" in await store.info("commandstats")) == functions
    finally:
        stop_workers(workers)
        await store.aclose()
        server.stop()
