"""The `process` operator's records in Redis (the operator itself is in process.py).

The keys share the broker's base and hash tag (`services.broker.layout`, `services.broker.store`):
- `proc:<user>:<id>`, a hash: instance index -> `Slot` (the intent to start it, then its pid, start
  time, process group, ports and CPUs);
- `proc-slots`, a set: `<user>/<id>/<index>` of every instance (how many run, against the most);
- `ports`, a set: the ports handed out and not yet freed.

An instance's slot changes only through `set_slot.lua` (beside this module): it is set over the slot
its launcher started from, so of two overlapping launches one keeps the instance. `delete` changes a
resource's key and the deployment-wide sets in one transaction, so one slot.
"""

from __future__ import annotations

import msgspec
from redis.asyncio import Redis

from bus import scripts
from bus.codec import decode_stored, encode
from services.broker.layout import key_base


class Slot(msgspec.Struct):
    """One instance. `pid` is 0 while only the intent to start it is recorded."""

    ports: dict[str, int]
    cpus: list[int] = []
    pid: int = 0
    pgid: int = 0
    start_time: int = 0


class ProcessTable:
    """The processes each resource runs: `proc:<user>:<id>` maps instance index -> Slot."""

    def __init__(self, redis: Redis, prefix: str) -> None:
        self.redis = redis
        self.base = key_base(prefix)
        self.slots_key = f"{self.base}:proc-slots"  # "<user>/<id>/<index>" of every instance
        self.ports_key = f"{self.base}:ports"  # ports handed out and not yet freed
        self._set_slot = scripts.register(redis, "services.broker.operators", "set_slot")

    def _key(self, user: str, resource_id: str) -> str:
        return f"{self.base}:proc:{user}:{resource_id}"

    async def load(self, user: str, resource_id: str) -> dict[int, Slot]:
        return self._decode(await self.redis.hgetall(self._key(user, resource_id)))

    async def load_many(self, user: str, resource_ids: list[str]) -> list[dict[int, Slot]]:
        pipe = self.redis.pipeline(transaction=False)
        for resource_id in resource_ids:
            pipe.hgetall(self._key(user, resource_id))
        return [self._decode(raw) for raw in await pipe.execute()]

    @staticmethod
    def _decode(raw: dict[bytes, bytes]) -> dict[int, Slot]:
        return {
            int(k): decode_stored(v, Slot)
            for k, v in sorted(raw.items(), key=lambda kv: int(kv[0]))
        }

    async def set_slot(
        self, user: str, resource_id: str, index: int, seen: Slot | None, slot: Slot
    ) -> Slot | None:
        """Set instance `index` to `slot` if it is still `seen` (None: no slot); the slot as it is
        now (`slot` when set; None once the resource was released)."""
        now = await self._set_slot(
            keys=[self._key(user, resource_id), self.slots_key],
            args=[
                str(index),
                f"{user}/{resource_id}/{index}",
                encode(seen) if seen is not None else b"",
                encode(slot),
            ],
        )
        return decode_stored(now, Slot) if now else None

    async def delete(self, user: str, resource_id: str, slots: dict[int, Slot]) -> None:
        pipe = self.redis.pipeline(transaction=True)
        pipe.delete(self._key(user, resource_id))
        if slots:
            pipe.srem(self.slots_key, *(f"{user}/{resource_id}/{i}" for i in slots))
            ports = [p for slot in slots.values() for p in slot.ports.values()]
            if ports:
                pipe.srem(self.ports_key, *ports)
        await pipe.execute()

    async def free_ports(self, ports: list[int]) -> None:
        if ports:
            await self.redis.srem(self.ports_key, *ports)

    async def count(self) -> int:
        return await self.redis.scard(self.slots_key)

    async def claim_port(self, port: int) -> bool:
        return bool(await self.redis.sadd(self.ports_key, port))
