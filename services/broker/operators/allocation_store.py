"""The `allocation` operator's placements in Redis (the operator itself is in allocation.py).

The keys share the broker's base and hash tag (`services.broker.layout`, `services.broker.store`):
- `alloc:<user>:<id>`, a hash: instance index -> `Placement` (node, CPUs, NUMA nodes, memory);
- `on-node:<node>`, a set: `<user>/<id>` of each resource with an instance placed on the node (what
  the node's `down` and `draining` events concern, `services.broker.failover`).

A resource's placements and its node entries are written together, and removed together, each in
one transaction.
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec
from redis.asyncio import Redis

from bus.codec import decode_stored, encode
from services.broker.layout import key_base


class Placement(msgspec.Struct):
    nodename: str
    cpus: list[int] = []
    mems: list[int] = []
    memory: int = 0


class PlacementTable:
    """Where each resource's instances were placed: `alloc:<user>:<id>` maps instance index ->
    Placement, `on-node:<node>` holds the resources placed on a node."""

    def __init__(self, redis: Redis, prefix: str) -> None:
        self.redis = redis
        self.base = key_base(prefix)

    def _key(self, user: str, resource_id: str) -> str:
        return f"{self.base}:alloc:{user}:{resource_id}"

    def _on_node_key(self, node: str) -> str:
        return f"{self.base}:on-node:{node}"

    async def load(self, user: str, resource_id: str) -> dict[int, Placement]:
        """The resource's placements, by instance index (in order)."""
        raw = await self.redis.hgetall(self._key(user, resource_id))
        placed = {int(k): decode_stored(v, Placement) for k, v in raw.items()}
        return dict(sorted(placed.items()))

    async def resources_on(self, node: str) -> list[tuple[str, str]]:
        """(user, resource id) of the resources with an instance placed on `node`."""
        members = await self.redis.smembers(self._on_node_key(node))
        return sorted(tuple(m.decode().split("/", 1)) for m in members)  # type: ignore[misc]

    async def record(self, user: str, resource_id: str, placed: dict[int, Placement]) -> None:
        """Add `placed` to the resource's placements, and the resource to each of their nodes."""
        member = f"{user}/{resource_id}"
        pipe = self.redis.pipeline(transaction=True)
        pipe.hset(self._key(user, resource_id), mapping={str(i): encode(p) for i, p in placed.items()})
        for node in {p.nodename for p in placed.values()}:
            pipe.sadd(self._on_node_key(node), member)
        await pipe.execute()

    async def forget(self, user: str, resource_id: str, nodes: Iterable[str]) -> None:
        """Remove the resource's placements, and the resource from `nodes` (those it was placed on)."""
        member = f"{user}/{resource_id}"
        pipe = self.redis.pipeline(transaction=True)
        pipe.delete(self._key(user, resource_id))
        for node in set(nodes):
            pipe.srem(self._on_node_key(node), member)
        await pipe.execute()
