"""Change notifications: registrations are leases in Redis, new samples are published on NATS.

Katalyst's notifier sends on Go channels while holding a lock, so one stuck consumer stalls every
provisioner (katalyst-metrics.md §2.4). Here the agent only wakes the publisher after a round, and
the publisher publishes on core NATS, which never waits for subscribers (the server cuts a slow one
off). What a subscriber misses, it reads with `get`: the store always has the latest value.

- Registrations live in Redis under the node's hash tag: one per registration (the watched metric
  and its lease) that expires unless renewed, plus an index of them. Every agent of the node sees
  the same registrations, so any of them can register, renew or deregister. They, the publisher
  lease and the record of what was published are in notifier_store.py (`Registrations`,
  `Publishing`), with their keys: this module talks to Redis only through those.
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
import logging
import time

import msgspec
from nats.aio.client import Client

from bus.codec import encode
from bus.failpoints import failpoint
from schemas.errors import BerthError
from schemas.metrics import Lease, MetricEvent, MetricRef, checked_subject
from services.metrics import telemetry
from services.metrics.notifier_store import Publishing, Registrations
from services.metrics.store import Store

log = logging.getLogger("berth.metrics.notifier")

# How often the publisher lease, the registrations and the record are synced; well within the
# publisher lease (notifier_store.PUBLISHER_LEASE_SECONDS), which lapses when syncs stop.
SYNC_SECONDS = 1.0


class NotifierNotFound(BerthError):
    """The registration is unknown: deregistered, or its lease ended. Register again."""

    code = "notifier_not_found"


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
