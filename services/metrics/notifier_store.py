"""The notifier's records in Redis (the notifier itself is in notifier.py): its registrations, the
publisher lease and what was published, and the sample time of each put without `time`.

Every key of a node starts with `<prefix>:metrics:{<node>}:` (see `node_base`): one ACL pattern
(`~<prefix>:metrics:*`) covers the service, and the hash tag `{<node>}` keeps every script and
transaction on one node's keys, so in one Redis Cluster slot. Every agent of the node sees the same
keys, so any of them can register, renew or deregister. The keys:
- `notifiers`, a set: the keys of the node's registrations (one whose lease ended stays until a
  script next looks at it);
- `notifier:<key>`, a hash: the registration (`ref`, the watched metric; `lease_ms`), which expires
  with its lease unless renewed;
- `removed:<request id>`, a string: whether that deregister request removed its registration (for
  the idempotency window);
- `publisher`, a string: the agent that publishes the node's events, a `bus.lease` lease;
- `sent`, a hash: subject -> the sample time last published on it, so that an agent that takes over
  publishing does not repeat samples (it disappears a day after the node is gone);
- `put-time:<request id>`, a string: the sample time of that put without `time` (`PutTimes`).

Scripts: notifier_add.lua, notifier_live.lua, notifier_renew.lua and notifier_remove.lua beside this
module (loaded by package, `services.metrics`).
"""

from __future__ import annotations

import hashlib
import time
import uuid

from redis.asyncio import Redis

from bus import scripts
from bus.codec import decode_stored, encode
from bus.idempotency import DEFAULT_WINDOW, current_claim
from bus.lease import Leases
from bus.outcome import deciding
from schemas.errors import InvalidArgument
from schemas.metrics import MetricRef

PUBLISHER_LEASE_SECONDS = 3.0  # a publisher that stops syncing is replaced this long after
SENT_RECORD_SECONDS = 24 * 3600  # the record of a node that is gone disappears after this


def node_base(prefix: str, node: str) -> str:
    """The start of every Redis key of one node's agents (the keys are in the module docstring); the
    hash tag `{<node>}` puts them in one Redis Cluster slot."""
    return f"{prefix}:metrics:{{{node}}}"


class Registrations:
    """The node's notifier registrations in Redis."""

    def __init__(self, redis: Redis, prefix: str, node: str) -> None:
        self.redis = redis
        self.base = node_base(prefix, node)  # one hash tag: Redis-Cluster-safe scripts
        self.index = f"{self.base}:notifiers"
        self._add = scripts.register(redis, "services.metrics", "notifier_add")
        self._live = scripts.register(redis, "services.metrics", "notifier_live")
        self._renew = scripts.register(redis, "services.metrics", "notifier_renew")
        self._remove = scripts.register(redis, "services.metrics", "notifier_remove")

    def _key(self, key: str) -> str:
        return f"{self.base}:notifier:{key}"

    async def add(self, ref: MetricRef, lease_seconds: float, most: int) -> str:
        """Register; doing it again under the same request id rewrites the same registration. A node
        holding `most` live registrations takes no more: each costs the publisher work every round."""
        key = _registration_key()
        lease_ms = int(lease_seconds * 1000)
        args = [key, encode(ref), lease_ms, most, f"{self.base}:notifier:"]
        if not await deciding(self._add(keys=[self._key(key), self.index], args=args)):
            raise InvalidArgument(
                "$", f"this node already has {most} notifier registrations, the most it takes "
                "(--max-notifiers): deregister some first", limit=most,
            )
        return key

    async def renew(self, key: str) -> float | None:
        """The lease in seconds, restarted now; None if the registration has ended."""
        lease_ms = await deciding(self._renew(keys=[self._key(key)]))
        return None if lease_ms is None else int(lease_ms) / 1000

    async def remove(self, key: str) -> bool:
        """True if this request removed the registration (under a request id, also when a retry
        finds that its dead first run did)."""
        keys, args = [self._key(key), self.index], [key]
        claim = current_claim.get()
        if claim is not None:
            keys.append(f"{self.base}:removed:{claim.marker}")
            args.append(claim.window)  # as long as the answer to the request id
        return bool(await deciding(self._remove(keys=keys, args=args)))

    async def live(self) -> dict[str, float]:
        """Live registration key -> unix time its lease ends at the latest."""
        asked = time.time()  # the lease cannot end before asked + remaining time
        flat = await self._live(keys=[self.index], args=[f"{self.base}:notifier:"])
        return {flat[i].decode(): asked + int(flat[i + 1]) / 1000 for i in range(0, len(flat), 2)}

    async def refs(self, keys: list[str]) -> dict[str, MetricRef]:
        """What each registration watches (those that ended meanwhile are left out)."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.hget(self._key(key), "ref")
            bodies = await pipe.execute()
        return {key: decode_stored(body, MetricRef) for key, body in zip(keys, bodies) if body}

    async def count(self) -> int:
        """The registrations the index holds (one SCARD: ended ones count until a script drops them)."""
        return await self.redis.scard(self.index)


def _registration_key() -> str:
    """A new registration's key. Under a request id it is derived from the request: a retry whose
    first run died after registering (its answer lost) finds that registration again instead of
    adding a second one that nobody knows the key of, so nobody can deregister."""
    claim = current_claim.get()
    if claim is None:
        return uuid.uuid4().hex
    return hashlib.sha256(claim.marker.encode()).hexdigest()[:32]


class Publishing:
    """Which agent of the node publishes events (whoever holds the lease key), and the sample time
    last published on each subject (a hash, so that a new publisher does not repeat samples)."""

    def __init__(
        self, redis: Redis, prefix: str, node: str, seconds: float = PUBLISHER_LEASE_SECONDS
    ) -> None:
        self.redis = redis
        self.lease_key = f"{node_base(prefix, node)}:publisher"
        self.sent_key = f"{node_base(prefix, node)}:sent"
        self.holder = uuid.uuid4().hex
        self.seconds = seconds
        self._leases = Leases(redis)

    async def hold(self) -> bool:
        """Take or extend the lease; True if this agent holds it now."""
        return await self._leases.hold(self.lease_key, self.holder, self.seconds)

    async def release(self) -> None:
        await self._leases.release(self.lease_key, self.holder)

    async def last_sent(self) -> dict[str, float]:
        record = await self.redis.hgetall(self.sent_key)
        return {subject.decode(): float(t) for subject, t in record.items()}

    async def record(self, sent: dict[str, float], unwatched: set[str]) -> None:
        async with self.redis.pipeline(transaction=True) as pipe:
            if sent:
                pipe.hset(self.sent_key, mapping={subject: repr(t) for subject, t in sent.items()})
            if unwatched:
                pipe.hdel(self.sent_key, *unwatched)
            pipe.expire(self.sent_key, SENT_RECORD_SECONDS)
            await pipe.execute()


class PutTimes:
    """The sample time of a `put` without `time`, taken once per request id for every agent of a node.

    A put reaches every agent of the node, and each stores it in its own memory. If each took "now"
    from its own clock, one put would be a different sample on each agent, and a retry that reaches
    an agent which never saw the first run (one restarted after a crash) would store a newer one
    still: the answers would disagree, and a publisher that changes hands would announce the put
    again as a new sample. Under a request id, the first agent to ask fixes the time in Redis (under
    the node's hash tag, for the idempotency window like the answer to the request id) and the
    others, and every retry, take it.
    """

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
