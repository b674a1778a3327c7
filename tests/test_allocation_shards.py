"""How allocation workers split the nodes (shards.py), over a real Redis: every node has exactly
one owner among the live workers, a worker that leaves hands its nodes to the others, and one
whose membership lapsed drops out of the others' split."""

from __future__ import annotations

import asyncio

from services.allocation.shards import Shards
from services.allocation.store import NodeStore

NODES = [f"node{i:04d}" for i in range(600)]


async def test_each_node_has_exactly_one_owner_and_the_shares_are_even(redis, prefix):
    workers = [Shards(NodeStore(redis, prefix), worker=f"w{i}") for i in range(3)]
    for shards in workers + workers:  # twice: the first ones saw only those before them
        await shards.renew()
    assert all(shards.workers == ("w0", "w1", "w2") for shards in workers)
    owners = {node: [s.worker for s in workers if s.mine(node)] for node in NODES}
    assert all(len(owner) == 1 for owner in owners.values())
    shares = [sum(owner == [s.worker] for owner in owners.values()) for s in workers]
    assert all(120 < share < 280 for share in shares), shares  # about 200 each


async def test_a_worker_that_leaves_or_lapses_hands_only_its_own_nodes_to_the_others(redis, prefix):
    first, second, third = (Shards(NodeStore(redis, prefix), worker=name) for name in ("a", "b", "c"))
    for shards in (first, second, third, first, second):
        await shards.renew()
    before = {node for node in NODES if first.mine(node)}
    await third.leave()
    assert await first.renew()  # the workers changed
    after = {node for node in NODES if first.mine(node)}
    assert before < after  # it keeps its own and takes some of the leaver's
    # A worker whose membership ends without a renewal (it died) leaves the split too.
    await redis.zadd(first.store.workers_key, {"b": 0})
    assert await first.renew() and first.workers == ("a",)
    assert all(first.mine(node) for node in NODES)
    assert not await first.renew()  # nothing changed since


async def test_a_lone_worker_owns_every_node(redis, prefix):
    alone = Shards(NodeStore(redis, prefix))
    await alone.renew()
    assert all(alone.mine(node) for node in NODES)
    await asyncio.sleep(0)
