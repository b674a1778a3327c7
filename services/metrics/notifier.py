"""Change notifications: registrations are leases in Redis, new samples are published on NATS.

Katalyst's notifier sends on Go channels while holding a lock, so one stuck consumer stalls every
provisioner (katalyst-metrics.md §2.4). Here the agent only wakes the publisher after a round, and
the publisher publishes on core NATS, which never waits for subscribers (the server cuts a slow one
off). What a subscriber misses, it reads with `get`: the store always has the latest value.

- Registrations live in Redis under the node's hash tag: a hash per registration (the watched
  metric and its lease) that expires unless renewed, plus a set indexing them. Every key of the
  node starts with `<prefix>:metrics:{<node>}:` (see `node_base`): one ACL pattern
  (`~<prefix>:metrics:*`) covers the service, and every script and transaction touches one node's
  keys only, so one Redis Cluster slot. Every agent of the
  node sees the same registrations, so any of them can register, renew or deregister.
- One agent per node publishes: the one holding the node's publisher lease. Once a second it
  renews that lease, re-reads the registrations with their remaining lease (to learn what other
  agents changed) and records what it has published. A publishing pass itself reads no Redis: it
  uses that view, which its own register, renew and deregister keep exact at once. A registration
  is treated as ended when its lease, as last read, runs out; a pass that meets one re-reads the
  registrations first, so an event never follows the end of a lease.
- Each sample is published once per subject: the publisher skips a sample whose time equals the
  last one it sent on that subject, whatever its value (katalyst's equality rule). Registrations of
  the same metric share its subject, so their subscribers see each sample once; the first
  registration of a metric gets the current value at once, later ones get the next sample. An agent
  that takes over publishing continues from the recorded sample times (a crash can lose up to a
  second of record, and so repeat those samples).
- After `deregister` returns from the publishing agent, nothing more is published for the key; if
  another agent answered it, the publisher learns of it within a second.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
import uuid

import msgspec
from nats.aio.client import Client
from redis.asyncio import Redis

from bus import scripts
from bus.codec import decode_stored, encode
from bus.failpoints import failpoint
from bus.idempotency import current_claim
from bus.lease import Leases
from bus.outcome import deciding
from schemas.errors import BerthError, InvalidArgument
from schemas.metrics import Lease, MetricEvent, MetricRef, checked_subject
from services.metrics import telemetry
from services.metrics.store import Store

log = logging.getLogger("berth.metrics.notifier")

SYNC_SECONDS = 1.0  # how often the publisher lease, the registrations and the record are synced
PUBLISHER_LEASE_SECONDS = 3.0  # a publisher that stops syncing is replaced this long after
SENT_RECORD_SECONDS = 24 * 3600  # the record of a node that is gone disappears after this

# Scripts: notifier_live.lua, notifier_renew.lua and notifier_remove.lua beside this module; the
# publisher lease is a `bus.lease` lease.


def node_base(prefix: str, node: str) -> str:
    """The start of every Redis key of one node's agents; the hash tag `{<node>}` puts them in one
    Redis Cluster slot. Keys: `notifiers` (set of registration keys), `notifier:<key>` (hash:
    ref, lease_ms; expires with its lease), `publisher` (string: the publishing agent, a lease),
    `sent` (hash: subject -> sample time last published), `removed:<request>` (string: whether
    that deregister-notifier request removed its registration)."""
    return f"{prefix}:metrics:{{{node}}}"


class NotifierNotFound(BerthError):
    """The registration is unknown: deregistered, or its lease ended. Register again."""

    code = "notifier_not_found"


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


class _Watch(msgspec.Struct):
    """A registration as the publisher uses it: entity key and subject computed once."""

    ref: MetricRef
    entity: tuple
    subject: str
    ids: dict
    lease_ends: float  # unix time; the lease may have been renewed since (re-read then)


class Notifier:
    def __init__(
        self,
        nc: Client,
        registrations: Registrations,
        publishing: Publishing,
        store: Store,
        *,
        prefix: str,
        node: str,
        default_lease_seconds: float = 30.0,
        max_registrations: int = 1000,
    ) -> None:
        self.nc = nc
        self.max_registrations = max_registrations
        self.registrations = registrations
        self.publishing = publishing
        self.store = store
        self.prefix = prefix
        self.node = node
        self.default_lease_seconds = default_lease_seconds
        self.publisher = False  # this agent holds the node's publisher lease
        self._wake = asyncio.Event()
        self._lock = asyncio.Lock()  # guards the view below: a pass never sees it change halfway
        self._watches: dict[str, _Watch] = {}  # registration key -> what it watches
        self._subjects: dict[str, _Watch] = {}  # the watched subjects, one watch each
        self._sent: dict[str, float] = {}  # subject -> sample time last published on it
        self._unrecorded: dict[str, float] = {}  # published since the last record
        self._unwatched: set[str] = set()  # subjects nobody watches any more, to drop from the record

    # -- registrations ---------------------------------------------------------------------

    async def register(self, ref: MetricRef, lease_seconds: float | None = None) -> Lease:
        ref = MetricRef(scope=ref.scope, metric=ref.metric, **ref.ids())  # what is watched, nothing else
        watch = self._watch(ref, 0.0)  # validates the ids before anything is stored
        lease_seconds = lease_seconds or self.default_lease_seconds
        asked = time.time()
        key = await self.registrations.add(ref, lease_seconds, self.max_registrations)
        failpoint("after-commit")
        if self.publisher:
            async with self._lock:
                watch.lease_ends = asked + lease_seconds
                self._watches[key] = watch
                self._index_subjects()
            self.wake()  # the first event carries the current value, if there is one
        return Lease(key, lease_seconds)

    async def renew(self, key: str) -> Lease:
        asked = time.time()
        lease_seconds = await self.registrations.renew(key)
        failpoint("after-commit")
        if lease_seconds is None:
            raise NotifierNotFound(
                f"notifier {key} is not registered (deregistered, or its lease ended)", field="key"
            )
        if key in self._watches:
            self._watches[key].lease_ends = asked + lease_seconds
        return Lease(key, lease_seconds)

    async def deregister(self, key: str) -> bool:
        async with self._lock:
            if self._watches.pop(key, None) is not None:
                self._index_subjects()
            removed = await self.registrations.remove(key)
            failpoint("after-commit")
            return removed

    # -- publishing --------------------------------------------------------------------------

    def wake(self) -> None:
        """Ask for a publishing pass (after a round or a put); returns at once, passes coalesce."""
        self._wake.set()

    async def close(self) -> None:
        """Record what was published and give up publishing, so that another agent of the node
        takes over at once."""
        if self.publisher:
            self.publisher = False
            await self.publishing.record(self._unrecorded, self._unwatched)
        await self.publishing.release()

    async def keep_synced(self) -> None:
        """Run `sync` every second (forever)."""
        while True:
            try:
                await self.sync()
            except Exception as error:  # Redis unreachable: nobody can tell who publishes
                self.publisher = False
                log.warning("notifier sync failed: %r", error)
            await asyncio.sleep(SYNC_SECONDS)

    async def sync(self) -> None:
        """Hold (or take) the publisher lease; as the publisher, re-read the registrations and
        record what was published."""
        if not await self.publishing.hold():
            self.publisher = False
            return
        async with self._lock:
            took_over = not self.publisher
            if took_over:
                log.info("publishing events for node %s", self.node)
                self._sent = await self.publishing.last_sent()
            await self._refresh()
            self.publisher = True
            unrecorded, unwatched = self._unrecorded, self._unwatched
            self._unrecorded, self._unwatched = {}, set()
        await self.publishing.record(unrecorded, unwatched)
        if took_over:
            self.wake()

    async def publish_when_woken(self) -> None:
        """Run a publishing pass whenever `wake` was called (forever)."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            try:
                await self.publish_new_samples()
            except Exception:  # Redis or NATS trouble: the next round tries again
                log.exception("publishing pass failed")

    async def publish_new_samples(self) -> None:
        """Publish every watched metric whose sample time changed since its last event."""
        async with self._lock:
            if not self.publisher:
                return
            now = time.time()
            if any(watch.lease_ends <= now for watch in self._watches.values()):
                await self._refresh()  # renewed elsewhere, or ended: Redis knows which
            for subject, watch in self._subjects.items():
                data = self.store.latest(watch.ref.scope, watch.entity, watch.ref.metric)
                if data is None or self._sent.get(subject) == data.time:
                    continue
                event = MetricEvent(
                    scope=watch.ref.scope, metric=watch.ref.metric, value=data.value, sample_time=data.time,
                    time=now, **watch.ids,
                )
                await self.nc.publish(subject, encode(event))
                telemetry.EVENTS_PUBLISHED.inc()
                self._sent[subject] = self._unrecorded[subject] = data.time

    def _watch(self, ref: MetricRef, lease_ends: float) -> _Watch:
        return _Watch(ref, ref.entity(), checked_subject(self.prefix, self.node, ref), ref.ids(), lease_ends)

    async def _refresh(self) -> None:
        """Re-read the registrations (caller holds the lock); only new ones are read in full."""
        live = await self.registrations.live()
        for key in self._watches.keys() - live.keys():
            del self._watches[key]
        new = [key for key in live if key not in self._watches]
        if new:
            for key, ref in (await self.registrations.refs(new)).items():
                self._watches[key] = self._watch(ref, 0.0)
        for key, watch in self._watches.items():
            watch.lease_ends = live[key]
        self._index_subjects()

    def _index_subjects(self) -> None:
        """Recompute the watched subjects; one nobody watches any more forgets its last sample."""
        self._subjects = {watch.subject: watch for watch in self._watches.values()}
        for subject in self._sent.keys() - self._subjects.keys():
            del self._sent[subject]
            self._unrecorded.pop(subject, None)
            self._unwatched.add(subject)
