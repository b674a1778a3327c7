"""Durable acknowledgements: an answer waits until the Redis writes behind it are on N replicas.

Redis replicates asynchronously, so a write its primary acknowledged is lost if the primary dies
before sending it to a replica that then takes over. With `--wait-replicas N` a worker notes the
keys a request wrote (`wrote`, where its stores write) and, before answering, waits until N
replicas of every primary that took one of them hold it (`ReplicaWait.confirm`); when fewer
confirm within the timeout, the answer is `outcome_unknown` (the writes are made on the primary,
and a failover may or may not take them back) instead of an acknowledgement that a failover could
take back.

Redis's `WAIT` waits for the writes *its own connection* sent (measured on 7.0: WAIT on a second
connection returns at once, whatever the first one wrote), and a request's writes went out in the
worker's shared pipeline, on whatever connection it held. So `confirm` sends, on one connection to
the primary that took the write, a write of its own (a short-lived fence key in the same slot)
and then WAIT: a primary replicates in order, so a replica that holds the fence holds every
earlier write of that primary, the request's included. The primary is the one that owned the
key's slot when the write was made (noted with the key): if the slot has moved since (a
failover), its fence is refused and the answer is `outcome_unknown` too.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from functools import cache

from redis.asyncio import Redis, RedisCluster
from redis.asyncio.cluster import PipelineCommand
from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot
from redis.exceptions import RedisError

from bus.redis import is_cluster
from schemas.errors import OutcomeUnknown

FENCE_TTL_MS = 60_000  # a fence only has to outlive its WAIT; it then expires on its own


@dataclass(frozen=True)
class Landed:
    """Where a write landed: its slot, and the primary that owned the slot (None: a single Redis)."""

    slot: int
    primary: str | None


# The writes of the request the current task serves; None outside a request (nothing is noted).
_writes: contextvars.ContextVar[set[Landed] | None] = contextvars.ContextVar("berth_writes", default=None)


def wrote(redis: Redis | RedisCluster, *keys: str) -> None:
    """Note that the current request wrote `keys` through `redis`, so that its answer waits for them."""
    writes = _writes.get()
    if writes is not None:
        writes.update(landed(redis, key) for key in keys)


def landed(redis: Redis | RedisCluster, key: str) -> Landed:
    if not is_cluster(redis):
        return Landed(0, None)
    return Landed(redis.keyslot(key), redis.get_node_from_key(key).name)


@contextlib.contextmanager
def collecting() -> Iterator[set[Landed]]:
    """Collect what the current task (and the tasks it starts) note with `wrote`."""
    token = _writes.set(set())
    try:
        yield _writes.get()
    finally:
        _writes.reset(token)


@cache
def _slot_tags() -> tuple[str, ...]:
    """For each slot, a short hash tag that lands in it (about 170,000 CRCs, once per process)."""
    tags: list[str | None] = [None] * REDIS_CLUSTER_HASH_SLOTS
    missing, number = REDIS_CLUSTER_HASH_SLOTS, 0
    while missing:
        tag = format(number, "x")
        slot = key_slot(tag.encode())
        if tags[slot] is None:
            tags[slot], missing = tag, missing - 1
        number += 1
    return tuple(tags)  # type: ignore[arg-type]


class ReplicaWait:
    """Waits for `replicas` replicas, at most `timeout_ms` per primary (all primaries at once).

    `key_base` starts the fence keys (a service's own key prefix, which its Redis user may write)."""

    def __init__(self, redis: Redis | RedisCluster, key_base: str, replicas: int, timeout_ms: int) -> None:
        self.redis = redis
        self.key_base = key_base
        self.replicas = replicas
        self.timeout_ms = timeout_ms
        _slot_tags()  # now, not in the first request's answer (0.3 s)

    def fence_key(self, slot: int) -> str:
        return f"{self.key_base}:wait:{{{_slot_tags()[slot]}}}"

    async def confirm(self, writes: Iterable[Landed]) -> None:
        """Return once every write's primary has `replicas` replicas holding it; else `OutcomeUnknown`:
        the writes are made on the primary, and a failover may or may not lose them."""
        one_slot_each = {write.primary: write.slot for write in writes}
        if not one_slot_each:
            return
        held = await asyncio.gather(*(self._fence(primary, slot) for primary, slot in one_slot_each.items()))
        if min(held) < self.replicas:
            raise OutcomeUnknown(
                f"only {min(held)} of {self.replicas} replicas confirmed the write within {self.timeout_ms} ms; "
                "a failover could lose it: send the request again with the same request_id"
            )

    async def _fence(self, primary: str | None, slot: int) -> int:
        """Write the slot's fence and WAIT, on one connection to `primary`: the replicas that confirm."""
        commands = [("SET", self.fence_key(slot), "1", "PX", FENCE_TTL_MS), ("WAIT", self.replicas, self.timeout_ms)]
        try:
            if primary is None:
                async with self.redis.pipeline(transaction=False) as pipe:
                    for command in commands:
                        pipe.execute_command(*command)
                    return (await pipe.execute())[-1]
            node = self.redis.get_node(node_name=primary)
            if node is None:  # the cluster forgot it: it died and was replaced
                raise OutcomeUnknown(f"Redis primary {primary} is gone; the write may be lost: send the request again")
            sent = [PipelineCommand(i, *command) for i, command in enumerate(commands)]
            await node.execute_pipeline(sent)
        except RedisError as error:  # refused (MOVED: a failover took the slot) or unreachable
            raise OutcomeUnknown(f"could not confirm a write on {primary or 'Redis'} ({error!r}): send the request "
                                 "again") from None
        for command in sent:
            if isinstance(command.result, Exception):
                raise OutcomeUnknown(f"could not confirm a write on {primary} ({command.result!r}): send the request "
                                     "again")
        return sent[-1].result
