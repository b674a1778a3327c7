"""The idempotency window (issue 31): what is kept for a request id is small, lives as long as the
window and no longer, and an allocate retried after the window answers its placements from the
ledger instead of placing again."""

from __future__ import annotations

import asyncio

import pytest

from tests.allocation_helpers import ONE_CORE, add_node, requester
from tests.bus_helpers import eventually

WINDOW = 2.0


@pytest.fixture
async def call(serve_allocation, client):
    await serve_allocation(window=WINDOW)
    return requester(client)


async def kept(redis, prefix: str, request_id: str) -> dict[bytes, bytes]:
    [key] = [k async for k in redis.scan_iter(match=f"{prefix}:idem:*:{request_id}")]
    return await redis.hgetall(key)


async def usage(call, node: str) -> dict:
    info = await call("get-node-resource-info", {"nodename": node})
    return info["usage"]["cpumem"]


async def test_an_allocate_is_kept_as_a_few_bytes_and_its_retry_rebuilds_the_same_answer(call, redis, prefix):
    await add_node(call, "n1", cpu=4)
    request = {"nodename": "n1", "deploy_count": 2, "workload_resource_request": ONE_CORE, "request_id": "a1"}
    first = await call("allocate", request)
    record = await kept(redis, prefix, "a1")
    # a run number and a count, not two placements of ~500 bytes each
    assert len(record[b"r"]) <= 8, record[b"r"]
    # every value under Redis's listpack limit: the hash is stored compactly
    [key] = [k async for k in redis.scan_iter(match=f"{prefix}:idem:*:a1")]
    assert await redis.object("encoding", key) in (b"listpack", b"ziplist")
    assert await call("allocate", request) == first


async def test_a_release_is_kept_as_which_of_its_ids_it_removed(call, redis, prefix):
    await add_node(call, "n1", cpu=4)
    placed = await call("allocate", {"nodename": "n1", "deploy_count": 2, "workload_resource_request": ONE_CORE})
    ids = [a["workload_id"] for a in placed["allocations"]]
    request = {"workload_ids": [ids[1], "nobody-holds-this", ids[0]], "request_id": "r1"}
    first = await call("release", request)
    assert first == {"released": sorted(ids)}
    assert len((await kept(redis, prefix, "r1"))[b"r"]) <= 4  # indices 0 and 2
    assert await call("release", request) == first


async def test_what_a_request_keeps_expires_with_the_window(call, redis, prefix):
    await add_node(call, "n1", cpu=4)
    placed = await call("allocate", {"nodename": "n1", "deploy_count": 1, "workload_resource_request": ONE_CORE,
                                     "request_id": "a1"})
    await call("release", {"workload_ids": [placed["allocations"][0]["workload_id"]], "request_id": "r1"})
    per_request = [k async for k in redis.scan_iter(match=f"{prefix}:*") if b":idem:" in k or b":applied:" in k]
    assert len(per_request) == 3  # the two answers, and the release's applied marker beside the node
    for key in per_request:
        assert 0 < await redis.ttl(key) <= WINDOW
    await asyncio.sleep(WINDOW + 0.5)
    assert not [k for k in per_request if await redis.exists(k)]


async def test_an_allocate_retried_after_the_window_answers_its_placements_and_places_nothing(call, redis, prefix):
    await add_node(call, "n1", cpu=4)
    await add_node(call, "n2", cpu=4)
    request = {"nodenames": ["n1", "n2"], "strategy": "spread", "deploy_count": 2,
               "workload_resource_request": ONE_CORE, "request_id": "late"}
    first = await call("allocate", request)
    assert {a["nodename"] for a in first["allocations"]} == {"n1", "n2"}
    before = [await usage(call, node) for node in ("n1", "n2")]

    async def forgotten() -> bool:
        return not [k async for k in redis.scan_iter(match=f"{prefix}:idem:*:late")]

    await eventually(forgotten, timeout=WINDOW + 2)
    assert await call("allocate", request) == first  # rebuilt from the ledger: the same answer
    assert [await usage(call, node) for node in ("n1", "n2")] == before  # nothing placed again
    # released in part, then retried after the window: what remains is the answer
    await call("release", {"workload_ids": [first["allocations"][0]["workload_id"]]})
    await eventually(forgotten, timeout=WINDOW + 2)
    assert await call("allocate", request) == {"allocations": first["allocations"][1:]}
    assert sum([(await usage(call, node))["cpu"] for node in ("n1", "n2")]) == 1
