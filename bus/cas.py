"""Compare-and-set of versioned records in Redis, with the guards and index changes that go with them.

A record is a hash with a version field. A write names the version it was computed from; one
script (`cas.lua` beside this module) checks that version and every guard, and only then applies
the ops and writes the record with its version bumped, all at once. A caller whose version is
stale (`Conflict.reason == "version"`) reloads and computes again; a failed guard changes nothing
either. No WATCH loops.

    records = VersionedHash(redis, version_field="version")
    version = await records.commit(key, read_version, [fits(blocks, "b1", 2, 8), sadd(pool, "r1")],
                                   fields=["status", "running"], mode=REPLACE)

Steps are guards (checked first, in order, whatever their place) and ops (applied in order):
  guards  exists(k), hexists(k, field), hnotexists(k, field), hequals(k, field, value), hempty(k),
          fits(k, field, add, limit)
  ops     hset, hdel, hcount (a counter removed at zero or below), sadd, srem, zadd, zrem, delete(k)
  both    hadd(k, field, value): the field must not exist yet, and is set
          once(k, answer, ttl): the key must not exist yet, and keeps the answer and the new version
  fence   before(k, ms): the server's time must be before ms (the writer's lease end)
  leases  lapsed(k, field), live(k, field): the hash field's time (ms, a lease's end) has passed, or not
  op      journal(k, value): field <the record's new version> of hash k is set (an outbox)
Every key must be in the record's Redis Cluster hash slot (the caller's keys share a hash tag).

A record may have a tombstone field: a record holding it does not exist (reads as version 0) but
keeps its version, so that a record removed (`mode=TOMBSTONE`) and written again counts on from
where it was.
"""

from __future__ import annotations

from collections.abc import Awaitable, Iterable, Sequence
from typing import Any

from redis.asyncio import Redis, RedisCluster

from bus import scripts
from bus.redis import Pipelined

Step = tuple  # (name, key, *args): made by the functions below

UPDATE = "update"  # set, then delete, the fields given; a tombstone comes back to life
REPLACE = "replace"  # the record becomes exactly the fields given
TOMBSTONE = "tombstone"  # only the version and the tombstone field remain

_MODES = frozenset({UPDATE, REPLACE, TOMBSTONE})
_STEPS = frozenset({"exists", "hexists", "hnotexists", "hequals", "hempty", "fits", "hadd", "once", "before",
                    "lapsed", "live", "journal", "hset", "hdel", "hcount", "sadd", "srem", "zadd", "zrem", "del"})


# -- guards: checked before anything is written ------------------------------------------------


def exists(key: str) -> Step:
    """The key must exist."""
    return ("exists", key)


def hexists(key: str, field: str) -> Step:
    """The hash must hold the field."""
    return ("hexists", key, field)


def hnotexists(key: str, field: str) -> Step:
    """The hash must not hold the field."""
    return ("hnotexists", key, field)


def hequals(key: str, field: str, value: str) -> Step:
    """The hash's field must hold `value`; '' means the field must be absent (or empty)."""
    return ("hequals", key, field, value)


def hempty(key: str) -> Step:
    """The hash must have no field (or not exist)."""
    return ("hempty", key)


def fits(key: str, field: str, add: int, limit: int) -> Step:
    """The counter (0 if absent) plus `add` must not exceed `limit`."""
    return ("fits", key, field, str(add), str(limit))


def before(key: str, deadline_ms: int) -> Step:
    """The server's clock (ms) must not have reached `deadline_ms`: the end of the lease under
    which the writer works. Past it, a newer run may have taken the work over; the write is refused
    (`Conflict("before", <server ms>)`), so a paused writer never overwrites its successor. `key` is
    any key of the record's slot (the clock is that server's)."""
    return ("before", key, str(int(deadline_ms)))


def lapsed(key: str, field: str) -> Step:
    """The hash's field holds the end of a lease (ms of the server's clock) that has passed: the
    holder stopped renewing it. An absent field fails."""
    return ("lapsed", key, field)


def live(key: str, field: str) -> Step:
    """The hash's field holds the end of a lease (ms of the server's clock) still to come."""
    return ("live", key, field)


def once(key: str, answer: bytes, ttl: int) -> Step:
    """Guard and op: apply this write at most once. The key must not exist yet; then it becomes a
    hash {r: answer, v: the record's new version} that lives `ttl` seconds. A second write with
    the same key is refused with `Conflict("once", <the kept answer>)`."""
    return ("once", key, answer, str(int(ttl)))


# -- ops: applied in order once every guard passed ---------------------------------------------


def hadd(key: str, field: str, value: Any) -> Step:
    """Guard and op: the hash must not hold the field yet; then it is set."""
    return ("hadd", key, field, value)


def hset(key: str, field: str, value: Any) -> Step:
    return ("hset", key, field, value)


def hdel(key: str, field: str) -> Step:
    return ("hdel", key, field)


def hcount(key: str, field: str, amount: int) -> Step:
    """Add to a counter; a counter that falls to zero or below is removed."""
    return ("hcount", key, field, str(amount))


def sadd(key: str, member: str) -> Step:
    return ("sadd", key, member)


def srem(key: str, member: str) -> Step:
    return ("srem", key, member)


def zadd(key: str, score: float, member: str) -> Step:
    return ("zadd", key, repr(float(score)), member)


def zrem(key: str, member: str) -> Step:
    return ("zrem", key, member)


def journal(key: str, value: Any) -> Step:
    """Set field <the record's new version> of hash `key` to `value`: what the change must still
    announce, written in the same step as the change (`bus.outbox`)."""
    return ("journal", key, value)


def delete(key: str) -> Step:
    return ("del", key)


class Conflict(Exception):
    """A write was refused and nothing changed. `reason`: "version" (the record is not at the
    version given; `subject` is its version) or the name of the first guard that failed
    (`subject`: its field, for `exists` its key, for `hempty` the hash's length, for `once` the
    kept answer, for `before`, `lapsed` and `live` the server's time in ms)."""

    def __init__(self, reason: str, subject: str, raw: bytes = b"") -> None:
        super().__init__(f"{reason}: {subject}")
        self.reason = reason
        self.subject = subject
        self.raw = raw  # the subject as stored (for `once`, the kept answer's bytes)


class VersionedHash:
    """Records kept as hashes with a version field (and, optionally, a tombstone field).

    With `batch`, commits go in that shared pipeline (`bus.redis.Pipelined`), queued when `send`
    is called; otherwise each is its own script call.
    """

    def __init__(
        self,
        redis: Redis | RedisCluster,
        *,
        version_field: str = "version",
        tombstone_field: str = "",
        batch: Pipelined | None = None,
    ) -> None:
        self.version_field = version_field
        self.tombstone_field = tombstone_field
        self.batch = batch
        self._script = scripts.register(redis, "bus", "cas")

    async def commit(self, key: str, expected: int, steps: Iterable[Step] = (), **write: Any) -> int:
        """Write the record at `key` if it is at version `expected` (0: it must not exist) and
        every guard of `steps` holds, with the ops of `steps` (`write`: see `send`). The new
        version, or `Conflict`."""
        return self.outcome(await self.send(key, expected, steps, **write))

    def send(
        self,
        key: str,
        expected: int,
        steps: Iterable[Step] = (),
        *,
        fields: Sequence[Any] = (),
        unset: Sequence[str] = (),
        mode: str = UPDATE,
        ttl: int = 0,
        tags: tuple[str, str] | None = None,
    ) -> Awaitable[Any]:
        """`commit` in two halves: this sends it (in a batch: queued now, after the commands queued
        before it) and returns its raw answer, for `outcome`. `fields` are the record's field,
        value, ... pairs, flattened; `unset` fields to delete (UPDATE); `mode` UPDATE, REPLACE or
        TOMBSTONE; `ttl` seconds the record lives after the write (0: no expiry is set); `tags`:
        (the `tag` field read with `expected`, '' for none; the tag this write sets): the record
        must still hold the tag read, so that a version seen before a Redis failover and given
        again after it is not taken for the same write."""
        if mode not in _MODES:
            raise ValueError(f"not a compare-and-set mode: {mode!r}")
        if mode == TOMBSTONE and not self.tombstone_field:
            raise ValueError("a tombstone needs a tombstone field")
        keys = [key]
        position = {key: 1}
        flat: list[Any] = []
        for step in steps:
            name, target = step[0], step[1]
            if name not in _STEPS:
                raise ValueError(f"not a compare-and-set step: {step!r}")
            at = position.get(target)
            if at is None:
                keys.append(target)
                at = position[target] = len(keys)
            flat += (name, at, *step[2:])
        args = [
            self.version_field, self.tombstone_field, f"{expected}:{tags[0]}:{tags[1]}" if tags else expected, mode, ttl,
            len(fields), *fields, len(unset), *unset, *flat,
        ]
        if self.batch is not None:
            return self.batch.script(self._script, keys, args)
        return self._script(keys=keys, args=args)

    @staticmethod
    def outcome(answer: Any) -> int:
        """The new version a `send` answer reports, or its `Conflict`."""
        status, detail = answer
        if status == b"ok":
            return int(detail)
        raise Conflict(status.decode(), detail.decode(errors="replace"), detail)
