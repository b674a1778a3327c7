"""The sample time of a `put` without `time`, taken once per request id for every agent of a node.

A put reaches every agent of the node, and each stores it in its own memory. If each took "now"
from its own clock, one put would be a different sample on each agent, and a retry that reaches an
agent which never saw the first run (one restarted after a crash) would store a newer one still:
the answers would disagree, and a publisher that changes hands would announce the put again as a
new sample. Under a request id, the first agent to ask fixes the time in Redis (under the node's
hash tag, for the idempotency window like the answer to the request id) and the others, and every
retry, take it.
"""

from __future__ import annotations

from redis.asyncio import Redis

from bus.idempotency import DEFAULT_WINDOW, current_claim
from services.metrics.notifier import node_base


class PutTimes:
    def __init__(self, redis: Redis, prefix: str, node: str) -> None:
        self.redis = redis
        self.base = f"{node_base(prefix, node)}:put-time:"

    async def first(self, request_id: str, now: float) -> float:
        """The sample time of the put with this request id: `now` if no agent took one for it yet."""
        key = self.base + request_id
        async with self.redis.pipeline(transaction=True) as pipe:
            claim = current_claim.get()
            pipe.set(key, repr(now), nx=True, ex=claim.window if claim is not None else int(DEFAULT_WINDOW))
            pipe.get(key)
            _, taken = await pipe.execute()
        return float(taken)
