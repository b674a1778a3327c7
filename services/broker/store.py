"""Broker state in Redis: records, pools, reservations, durable timers, broker configs and leases.

Every change of a record goes through one compare-and-set script (`commit`) that also applies the
index changes that belong to it (pool membership, reservations, timers), so a reader never sees a
record and its pools disagree, and a replica that acts on an old copy of a record changes nothing.
The `apply` claim has a script of its own because it must pick the resource inside Redis.

The key layout, the record encoding and the index changes of each step are in `layout.py`.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from functools import cached_property

import msgspec
from redis.asyncio import Redis

from bus import cas, scripts
from bus.codec import decode_stored, encode
from bus.events import EventBus
from bus.failpoints import failpoint
from bus.idempotency import Claim as IdempotencyClaim
from bus.idempotency import DEFAULT_WINDOW, own_claim, taken_over
from bus.lease import Leases
from bus.outbox import Journal, journal
from bus.outcome import deciding
from bus.redis import Pipelined
from schemas.common import Event
from services.broker.layout import Changes, Keys, Op, decode_record, encode_fields, index_member, timer_member
from services.broker.model import BrokerConfig, BrokerState, Resource, now

Announced = list[tuple[str, Event]] | None  # the events a record change announces (`commit`)
POOL_PARTS = ("warming", "idle", "sold", "deleting")

# The record writes are `bus.cas` compare-and-sets (field `version`, no tombstone). The scripts of
# this module are .lua files beside it: apply_claim.lua (the `apply` claim: it picks the resource
# inside Redis, so it is its own script), claim_timers.lua and set_if_exists.lua; the pool loop's
# lease is a `bus.lease` lease.


class Claim(msgspec.Struct):
    """What an `apply` claim did: sold `record` from the broker at `position` (from 1), found all
    candidates empty (position 0), found the caller launched already (`taken`: its status), or
    chose from an outdated broker list (`stale`)."""

    position: int = 0
    record: Resource | None = None
    taken: str = ""
    stale: bool = False
    announced: bytes = b""  # the sale's events, journaled in the outbox under `field`
    field: str = ""


_STALE_REASONS = {"version": "version", "fits": "capacity", "exists": "missing"}


class Stale(Exception):
    """A write was refused: `reason` is `version` (the record changed), `capacity` or `missing`."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class AlreadyApplied(Exception):
    """The request was applied by an earlier run of it, which died unanswered: its kept answer."""

    def __init__(self, answer: bytes) -> None:
        super().__init__("already applied")
        self.answer = answer


class BrokerStore:
    def __init__(
        self, redis: Redis, prefix: str, events: EventBus | None = None, *, released_seconds: float = DEFAULT_WINDOW
    ) -> None:
        self.redis = redis
        # How long a released record stays readable: the idempotency window, the time a retried
        # release or get-resource of it can still come.
        self.released_seconds = max(1, int(released_seconds))
        self.keys = Keys(prefix)
        # The events of every record change go out through this outbox (written in the commit).
        self.outbox = Journal(events, Pipelined.of(redis), self.keys.outbox)
        self._records = cas.VersionedHash(redis, version_field="version")
        self._claim = scripts.register(redis, "services.broker", "apply_claim")
        self._claim_timers = scripts.register(redis, "services.broker", "claim_timers")
        self._set_if_exists = scripts.register(redis, "services.broker", "set_if_exists")
        self._leases = Leases(redis)

    # -- records -------------------------------------------------------------------------------

    async def load(self, user: str, resource_id: str) -> Resource | None:
        return decode_record(await self.redis.hgetall(self.keys.record(user, resource_id)))

    async def load_many(self, refs: Iterable[tuple[str, str]]) -> list[Resource | None]:
        refs = list(refs)
        records: list[Resource | None] = []
        for start in range(0, len(refs), 500):
            pipe = self.redis.pipeline(transaction=False)
            for user, resource_id in refs[start : start + 500]:
                pipe.hgetall(self.keys.record(user, resource_id))
            records += [decode_record(raw) for raw in await pipe.execute()]
        return records

    async def commit(
        self, record: Resource, expected: int, ops: Iterable[Op] = (), *, ttl: int = 0, answer: bytes | None = None,
        events: Announced = None,
    ) -> Resource:
        """Write `record` if it is still at version `expected`, with `ops`; the record as written.
        `events`: what the change announces, journaled in the same step (`bus.outbox`) and
        published once it landed.

        `answer`: this write is the decisive step of the request whose claim the task runs under
        (what it answers, or b"" when the answer is read back from the record): it is applied at
        most once (`AlreadyApplied` for a second run) and fenced by the run's lease, so a run that a
        retry took over writes nothing (`bus.idempotency.taken_over`)."""
        key = self.keys.record(record.user, record.resource_id)
        run = own_claim() if answer is not None else None
        fields = encode_fields(record)
        entries = journal(events) if events else None
        field = self.outbox.field()
        while True:
            steps = list(ops)
            if entries is not None:
                steps.append(cas.hset(self.keys.outbox, field, entries))
            if run is not None:
                steps += [cas.before(key, run.lease_end), cas.once(self.keys.applied(run.marker), answer, run.window)]
            if run is not None:
                failpoint("before-commit")
            try:
                version = await deciding(
                    self._records.commit(key, expected, steps, fields=fields, mode=cas.REPLACE, ttl=ttl)
                )
            except cas.Conflict as conflict:
                if conflict.reason == "before" and await run.still_held():
                    continue  # the lease was renewed late (a busy loop), not taken over
                raise self._refusal(conflict, run) from None
            if run is not None:
                failpoint("after-commit")
            if entries is not None:
                await self.outbox.deliver(self.keys.outbox, field, entries)
            return msgspec.structs.replace(record, version=version)

    @staticmethod
    def _refusal(conflict: cas.Conflict, run: IdempotencyClaim | None) -> Exception:
        if conflict.reason == "before":
            return taken_over(run)
        if conflict.reason == "once":
            return AlreadyApplied(conflict.raw)
        return Stale(_STALE_REASONS[conflict.reason])

    async def applied(self, run: IdempotencyClaim | None) -> bytes | None:
        """What an earlier run of this request applied and kept, if this run is a retry of one that
        died unanswered (None for a first run: nothing to look for)."""
        if run is None or not run.attempt:
            return None
        return await self.redis.hget(self.keys.applied(run.marker), "r")

    async def claim(
        self, caller: Resource, brokers: list[BrokerConfig], brokers_version: int, now: float,
        sales: list[bytes], placeholder: str,
    ) -> Claim:
        """Give `caller` the oldest idle resource of the first of `brokers` that has one, in one step.
        The candidates were chosen from the brokers as of `brokers_version`; if they changed since,
        nothing happens (`Claim.stale`). A caller that is launched already is refused (`Claim.taken`).
        Under a request's claim the sale is its answer, kept and fenced as `commit`'s `answer` is:
        an earlier run's sale is `AlreadyApplied` (its resource id). `sales`: per broker, the
        events of a sale by it (`bus.outbox.journal`), with `placeholder` for the sold id; the
        script journals the winner's in the outbox with the sale.
        """
        run = own_claim()
        keys = [self.keys.record(caller.user, caller.resource_id), self.keys.index, self.keys.brokers_version,
                self.keys.applied(run.marker if run else "-"), self.keys.outbox]
        for broker in brokers:
            keys += [self.keys.pool(broker.user, broker.name, part) for part in ("idle", "sold", "demand")]
        field = self.outbox.field()
        while True:
            args = [
                str(brokers_version),
                repr(now),
                self.keys.records(caller.user),
                index_member(caller.user, caller.resource_id),
                uuid.uuid4().hex,
                run.lease_end if run else 0,
                run.window if run else 1,
                field,
                placeholder,
                *sales,
                *encode_fields(caller, skip=("broker_resource_id", "created_at")),
            ]
            if run is not None:
                failpoint("before-commit")
            result = await deciding(self._claim(keys=keys, args=args))
            code = int(result[0])
            if code != -3:
                break
            if not await run.still_held():
                raise taken_over(run)
        if code == -4:
            raise AlreadyApplied(result[1])
        if code == -2:
            return Claim(stale=True)
        if code == -1:
            return Claim(taken=result[1].decode())
        if code == 0:
            return Claim()
        if run is not None:
            failpoint("after-commit")
        sold_id = result[1].decode()
        sold = msgspec.structs.replace(caller, broker_resource_id=sold_id, version=int(result[2]),
                                       created_at=float(result[3]))
        announced = sales[code - 1].replace(placeholder[: len(sold_id)].encode(), sold_id.encode())
        return Claim(position=code, record=sold, announced=announced, field=field)

    async def index_refs(self) -> list[tuple[str, str]]:
        """(user, resource_id) of every record, oldest first (released ones expire: see `forget`)."""
        members = await self.redis.zrange(self.keys.index, 0, -1)
        return [tuple(m.decode().split("/", 1)) for m in members]  # type: ignore[misc]

    async def forget(self, refs: list[tuple[str, str]]) -> None:
        """Drop index entries of records that expired."""
        if refs:
            await self.redis.zrem(self.keys.index, *(index_member(u, r) for u, r in refs))

    async def reservations(self) -> dict[str, int]:
        raw = await self.redis.hgetall(self.keys.blocks)
        return {k.decode(): int(v) for k, v in raw.items()}

    async def reserved(self, block: str) -> int:
        return int(await self.redis.hget(self.keys.blocks, block) or 0)

    # -- durable timers ------------------------------------------------------------------------

    async def claim_timers(self, now: float, lease: float, limit: int = 100) -> list[tuple[str, str, str]]:
        due = await self._claim_timers(keys=[self.keys.timers], args=[repr(now), repr(now + lease), limit])
        return [tuple(m.decode().split("|", 2)) for m in due]  # type: ignore[misc]

    async def schedule(self, kind: str, user: str, resource_id: str, due: float) -> None:
        await self.redis.zadd(self.keys.timers, {timer_member(kind, user, resource_id): due})

    async def drop_timer(self, kind: str, user: str, resource_id: str) -> None:
        await self.redis.zrem(self.keys.timers, timer_member(kind, user, resource_id))

    # -- brokers -------------------------------------------------------------------------------

    async def put_broker(self, config: BrokerConfig) -> None:
        """Create or update a broker; an update keeps its place in the user's order and its pool.
        Under a request's claim the request's answer is kept in the same transaction."""
        seq = await self.redis.incr(self.keys.broker_seq)
        pipe = await self._answering(b"")
        pipe.hset(self.keys.broker(config.user, config.name), "config", encode(config))
        pipe.zadd(self.keys.brokers, {f"{config.user}/{config.name}": seq}, nx=True)
        pipe.incr(self.keys.brokers_version)
        await deciding(pipe.execute())
        if own_claim() is not None:
            failpoint("after-commit")

    async def remove_broker(self, user: str, name: str, answer: bytes) -> bool:
        """Remove a broker's config, demand and lease; `answer` is kept as `put_broker` keeps one."""
        pipe = await self._answering(answer)
        pipe.delete(
            self.keys.broker(user, name), self.keys.pool(user, name, "demand"), self.keys.lease(user, name)
        )
        pipe.zrem(self.keys.brokers, f"{user}/{name}")
        pipe.incr(self.keys.brokers_version)
        *_, deleted, _, _ = await deciding(pipe.execute())
        if own_claim() is not None:
            failpoint("after-commit")
        return bool(deleted)

    async def _answering(self, answer: bytes):
        """A transaction that keeps `answer` for the request whose claim the task runs under (if
        any). Not a compare-and-set: its fence is a renewal of the run's lease just before, which
        leaves a window of a round trip (a broker's config is written whole, so a late second
        write of the same request writes what the first did)."""
        pipe = self.redis.pipeline(transaction=True)
        run = own_claim()
        if run is not None:
            if not await run.still_held():
                raise taken_over(run)
            pipe.hset(self.keys.applied(run.marker), mapping={"r": answer, "v": 0})
            pipe.expire(self.keys.applied(run.marker), run.window)
        return pipe

    async def brokers_version(self) -> int:
        return int(await self.redis.get(self.keys.brokers_version) or 0)

    async def brokers(self, user: str | None = None) -> list[BrokerConfig]:
        """Brokers in the order they were added (of one user, or of all)."""
        names = [m.decode().split("/", 1) for m in await self.redis.zrange(self.keys.brokers, 0, -1)]
        wanted = [(u, n) for u, n in names if user is None or u == user]
        if not wanted:
            return []
        pipe = self.redis.pipeline(transaction=False)
        for u, n in wanted:
            pipe.hget(self.keys.broker(u, n), "config")
        return [decode_stored(raw, BrokerConfig) for raw in await pipe.execute() if raw]

    async def broker(self, user: str, name: str) -> BrokerConfig | None:
        raw = await self.redis.hget(self.keys.broker(user, name), "config")
        return decode_stored(raw, BrokerConfig) if raw else None

    async def broker_state(self, user: str, name: str) -> BrokerState:
        raw = await self.redis.hmget(self.keys.broker(user, name), list(BrokerState.__struct_fields__))
        values = {f: float(v) for f, v in zip(BrokerState.__struct_fields__, raw) if v is not None}
        return BrokerState(**values)

    async def set_broker_state(self, user: str, name: str, **fields: float) -> None:
        """Update a broker's timers, unless the broker was removed meanwhile."""
        flat = [text for field, value in fields.items() for text in (field, repr(float(value)))]
        await self._set_if_exists(keys=[self.keys.broker(user, name)], args=flat)

    # -- record steps: a record written with the index changes that go with it (see `Changes`) ----
    # Each writes `record` if it is still at the version it was read at (`record.version`), and
    # returns it as written; `Stale` says why not.

    @cached_property
    def changes(self) -> Changes:
        return Changes(self.keys)

    async def create(
        self, record: Resource, expected: int, answer: bytes | None = None, events: Announced = None
    ) -> Resource:
        """A new record (`expected`: the version of the released record it replaces, or 0)."""
        return await self.commit(record, expected, self.changes.indexed(record), answer=answer, events=events)

    async def reserve_launch(
        self, record: Resource, need: int, free: int, due: float, answer: bytes | None = None, events: Announced = None
    ) -> Resource:
        """A launch or scale: `need` instances of the block reserved, the `launch` timer at `due`."""
        ops = self.changes.launch(record, need, free, due)
        return await self.commit(record, record.version, ops, answer=answer, events=events)

    async def reserve_pool_launch(
        self, record: Resource, need: int, free: int, due: float, events: Announced = None
    ) -> Resource:
        """A broker's new resource: reserved as a launch, and in its broker's pool (warming) and the
        index. `Stale("missing")`: the broker is gone."""
        ops = [*self.changes.launch(record, need, free, due), *self.changes.pool_entry(record)]
        return await self.commit(record, 0, ops, events=events)

    async def mark_deploying(self, record: Resource, trace_at: float, events: Announced = None) -> Resource:
        return await self.commit(record, record.version, self.changes.deploying(record, trace_at), events=events)

    async def observe(self, before: Resource, after: Resource, events: Announced = None) -> Resource:
        """`after`: `before` as the operator's report changed it."""
        return await self.commit(after, before.version, self.changes.observed(before, after), events=events)

    async def begin_release(
        self, deleting: Resource, due: float, answer: bytes | None = None, events: Announced = None
    ) -> Resource:
        ops = self.changes.release_begun(deleting, due)
        return await self.commit(deleting, deleting.version, ops, answer=answer, events=events)

    async def mark_released(self, before: Resource, released: Resource, events: Announced = None) -> Resource:
        """The record as released, kept readable for `released_seconds`; then its index entry goes too
        (the `forget` timer: without it, the index grew by an entry per resource for good)."""
        ops = self.changes.released(before, now() + self.released_seconds + 1)
        return await self.commit(released, before.version, ops, ttl=self.released_seconds, events=events)

    async def accept_idle(self, record: Resource, events: Announced = None) -> Resource:
        """A warming pool resource joins the idle pool, ready since `record.updated_at`."""
        return await self.commit(record, record.version, self.changes.accepted(record, record.updated_at), events=events)

    # -- pools ---------------------------------------------------------------------------------

    async def pool_counts(self, user: str, name: str) -> dict[str, int]:
        pipe = self.redis.pipeline(transaction=False)
        pipe.scard(self.keys.pool(user, name, "warming"))
        pipe.zcard(self.keys.pool(user, name, "idle"))
        pipe.scard(self.keys.pool(user, name, "sold"))
        pipe.scard(self.keys.pool(user, name, "deleting"))
        return dict(zip(POOL_PARTS, await pipe.execute()))

    async def members(self, user: str, name: str, part: str) -> list[str]:
        key = self.keys.pool(user, name, part)
        raw = await (self.redis.zrange(key, 0, -1) if part == "idle" else self.redis.smembers(key))
        return sorted(m.decode() for m in raw) if part != "idle" else [m.decode() for m in raw]

    async def idle_since(self, user: str, name: str) -> list[tuple[str, float]]:
        """Idle resources, longest idle first, with the time they became ready."""
        raw = await self.redis.zrange(self.keys.pool(user, name, "idle"), 0, -1, withscores=True)
        return [(m.decode(), score) for m, score in raw]

    async def demand(self, user: str, name: str, since: float) -> int:
        """Applies seen since `since`; older entries are dropped."""
        key = self.keys.pool(user, name, "demand")
        pipe = self.redis.pipeline(transaction=False)
        pipe.zremrangebyscore(key, "-inf", f"({since!r}")
        pipe.zcard(key)
        return (await pipe.execute())[1]

    # -- leases --------------------------------------------------------------------------------

    async def hold_lease(self, user: str, name: str, holder: str, ttl: float) -> bool:
        """Take or renew the lease on a broker's pool loop; False while another replica holds it."""
        return await self._leases.hold(self.keys.lease(user, name), holder, ttl)

    async def drop_lease(self, user: str, name: str, holder: str) -> None:
        await self._leases.release(self.keys.lease(user, name), holder)

    async def hold_launch(self, user: str, resource_id: str, holder: str, seconds: float) -> bool:
        """Take the right to hand a resource's launch to the operator (one caller at a time: a
        retry finishing a dead run's launch and the launch timer must not both start it)."""
        return await self._leases.hold(self.keys.launching(user, resource_id), holder, seconds)

    async def drop_launch(self, user: str, resource_id: str, holder: str) -> None:
        await self._leases.release(self.keys.launching(user, resource_id), holder)
