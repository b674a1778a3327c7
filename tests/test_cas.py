"""bus.cas against a real Redis: a stale version or a failed guard changes nothing; the ops and the
record land together; tombstones keep counting versions."""

from __future__ import annotations

import asyncio

import pytest

from bus import cas
from bus.redis import Pipelined


async def snapshot(redis, prefix) -> dict:
    """Every key of the test with its type, value and whether it expires."""
    found = {}
    async for key in redis.scan_iter(match=f"{prefix}:*"):
        kind = (await redis.type(key)).decode()
        value = {
            "hash": redis.hgetall, "set": redis.smembers, "string": redis.get,
            "zset": lambda k: redis.zrange(k, 0, -1, withscores=True),
        }[kind](key)
        found[key] = (kind, await value, await redis.ttl(key) > 0)
    return found


@pytest.fixture
def keys(prefix):
    class Keys:
        record = f"{prefix}:{{t}}:record"
        index = f"{prefix}:{{t}}:index"
        pool = f"{prefix}:{{t}}:pool"
        counts = f"{prefix}:{{t}}:counts"
        ledger = f"{prefix}:{{t}}:ledger"

    return Keys


async def test_ops_and_record_land_together(redis, prefix, keys):
    records = cas.VersionedHash(redis)
    steps = [cas.sadd(keys.pool, "r1"), cas.zadd(keys.index, 2.5, "r1"), cas.hcount(keys.counts, "b", 3),
             cas.hset(keys.ledger, "w1", "x")]
    assert await records.commit(keys.record, 0, steps, fields=["status", "new"]) == 1
    assert await redis.hgetall(keys.record) == {b"version": b"1", b"status": b"new"}
    assert await redis.smembers(keys.pool) == {b"r1"}
    assert await redis.zrange(keys.index, 0, -1, withscores=True) == [(b"r1", 2.5)]
    assert await redis.hgetall(keys.counts) == {b"b": b"3"}
    steps = [cas.srem(keys.pool, "r1"), cas.zrem(keys.index, "r1"), cas.hcount(keys.counts, "b", -3),
             cas.hdel(keys.ledger, "w1")]
    assert await records.commit(keys.record, 1, steps, fields=["status", "gone"]) == 2
    assert await redis.hgetall(keys.record) == {b"version": b"2", b"status": b"gone"}
    assert await redis.exists(keys.pool, keys.index, keys.counts, keys.ledger) == 0  # a counter at 0 goes


async def test_a_stale_version_changes_nothing(redis, prefix, keys):
    records = cas.VersionedHash(redis)
    await records.commit(keys.record, 0, [cas.sadd(keys.pool, "a")], fields=["status", "one"])
    before = await snapshot(redis, prefix)
    steps = [cas.sadd(keys.pool, "b"), cas.hcount(keys.counts, "x", 1)]
    for stale in (0, 2, 7):
        with pytest.raises(cas.Conflict) as refused:
            await records.commit(keys.record, stale, steps, fields=["status", "two"], mode=cas.REPLACE,
                                 ttl=60)
        assert (refused.value.reason, refused.value.subject) == ("version", "1")
    assert await snapshot(redis, prefix) == before


@pytest.mark.parametrize("guard", ["exists", "hexists", "hnotexists", "hequals", "hempty", "fits"])
async def test_a_failed_guard_changes_nothing(redis, prefix, keys, guard):
    records = cas.VersionedHash(redis)
    await redis.hset(keys.ledger, mapping={"w1": "x", "w2": "y"})
    await redis.hset(keys.counts, "b", 6)
    await records.commit(keys.record, 0, fields=["status", "one"])
    before = await snapshot(redis, prefix)
    failing, subject = {
        "exists": (cas.exists(keys.pool), keys.pool),
        "hexists": (cas.hexists(keys.ledger, "w9"), "w9"),
        "hnotexists": (cas.hnotexists(keys.ledger, "w1"), "w1"),
        "hequals": (cas.hequals(keys.ledger, "w2", "x"), "w2"),
        "hempty": (cas.hempty(keys.ledger), "2"),
        "fits": (cas.fits(keys.counts, "b", 3, 8), "b"),
    }[guard]
    passing = [
        cas.hexists(keys.ledger, "w1"), cas.hnotexists(keys.ledger, "w9"), cas.fits(keys.counts, "b", 2, 8),
        cas.hequals(keys.ledger, "w2", "y"), cas.hequals(keys.ledger, "w9", ""),
    ]
    # The ops come first in the list: guards are checked before any op all the same.
    ops = [cas.sadd(keys.pool, "r"), cas.hdel(keys.ledger, "w1"), cas.hcount(keys.counts, "b", 1)]
    steps = [*ops, *passing, failing]
    for mode in (cas.UPDATE, cas.REPLACE):
        with pytest.raises(cas.Conflict) as refused:
            await records.commit(keys.record, 1, steps, fields=["status", "two"], unset=["status"], mode=mode)
        assert (refused.value.reason, refused.value.subject) == (guard, subject)
    assert await snapshot(redis, prefix) == before
    # Without the failing guard, the same write goes through.
    assert await records.commit(keys.record, 1, steps[:-1], fields=["status", "two"]) == 2
    assert await redis.smembers(keys.pool) == {b"r"}


async def test_the_first_failed_guard_is_the_one_reported(redis, prefix, keys):
    records = cas.VersionedHash(redis)
    await redis.hset(keys.ledger, "w1", "x")
    with pytest.raises(cas.Conflict) as refused:
        await records.commit(keys.record, 0, [cas.hexists(keys.ledger, "w2"), cas.hempty(keys.ledger)])
    assert (refused.value.reason, refused.value.subject) == ("hexists", "w2")


async def test_hequals_takes_an_empty_value_for_an_absent_field(redis, prefix, keys):
    records = cas.VersionedHash(redis)
    await redis.hset(keys.ledger, "w1", "x")
    for field, value in (("w2", "x"), ("w1", ""), ("w1", "xx")):
        with pytest.raises(cas.Conflict) as refused:
            await records.commit(keys.record, 0, [cas.hequals(keys.ledger, field, value)])
        assert (refused.value.reason, refused.value.subject) == ("hequals", field)
    assert await records.commit(keys.record, 0, [cas.hequals(keys.ledger, "w1", "x"),
                                                 cas.hequals(keys.ledger, "w2", "")]) == 1


async def test_fits_allows_up_to_the_limit(redis, prefix, keys):
    records = cas.VersionedHash(redis)
    steps = [cas.fits(keys.counts, "b", 8, 8), cas.hcount(keys.counts, "b", 8)]
    assert await records.commit(keys.record, 0, steps) == 1
    with pytest.raises(cas.Conflict):
        await records.commit(keys.record, 1, [cas.fits(keys.counts, "b", 1, 8)])


async def test_update_sets_then_deletes_and_replace_keeps_only_the_fields_given(redis, prefix, keys):
    records = cas.VersionedHash(redis, version_field="v")
    await records.commit(keys.record, 0, fields=["a", "1", "b", "2", "c", "3"])
    assert await records.commit(keys.record, 1, fields=["a", "9", "d", "4"], unset=["b", "d"]) == 2
    assert await redis.hgetall(keys.record) == {b"v": b"2", b"a": b"9", b"c": b"3"}
    assert await records.commit(keys.record, 2, fields=["e", "5"], mode=cas.REPLACE, ttl=100) == 3
    assert await redis.hgetall(keys.record) == {b"v": b"3", b"e": b"5"}
    assert 0 < await redis.ttl(keys.record) <= 100
    assert await records.commit(keys.record, 3, fields=["e", "6"], mode=cas.REPLACE) == 4
    assert await redis.ttl(keys.record) == -1  # no ttl: the record does not expire


async def test_a_tombstone_reads_as_missing_and_keeps_counting(redis, prefix, keys):
    records = cas.VersionedHash(redis, version_field="v", tombstone_field="gone")
    await records.commit(keys.record, 0, [cas.hset(keys.ledger, "w1", "x")], fields=["a", "1"])
    assert await records.commit(keys.record, 1, [cas.delete(keys.ledger)], mode=cas.TOMBSTONE, ttl=600) == 2
    assert await redis.hgetall(keys.record) == {b"v": b"2", b"gone": b"1"}
    assert 0 < await redis.ttl(keys.record) <= 600
    assert await redis.exists(keys.ledger) == 0
    with pytest.raises(cas.Conflict) as refused:  # the removed record does not exist: it is at 0
        await records.commit(keys.record, 2, fields=["a", "2"])
    assert (refused.value.reason, refused.value.subject) == ("version", "0")
    assert await records.commit(keys.record, 0, fields=["a", "2"]) == 3  # back, counting on
    assert await redis.hgetall(keys.record) == {b"v": b"3", b"a": b"2"}
    assert await redis.ttl(keys.record) == -1  # no longer expires


async def test_steps_are_checked_before_anything_is_sent(redis, prefix, keys):
    records = cas.VersionedHash(redis)
    with pytest.raises(ValueError):
        await records.commit(keys.record, 0, [("incr", keys.counts)])
    with pytest.raises(ValueError):
        await records.commit(keys.record, 0, mode="upsert")
    with pytest.raises(ValueError):
        await records.commit(keys.record, 0, mode=cas.TOMBSTONE)  # no tombstone field
    assert await redis.exists(keys.record, keys.counts) == 0


async def test_commits_in_a_shared_batch_keep_their_own_outcomes(redis, prefix, keys):
    records = cas.VersionedHash(redis, version_field="v", batch=Pipelined(redis))
    sent = [records.send(keys.record, 0, [cas.sadd(keys.pool, str(i))]) for i in range(5)]
    answers = await asyncio.gather(*sent)
    outcomes = []
    for answer in answers:
        try:
            outcomes.append(records.outcome(answer))
        except cas.Conflict as conflict:
            outcomes.append(conflict.reason)
    assert outcomes == [1, "version", "version", "version", "version"]
    assert await redis.smembers(keys.pool) == {b"0"}


async def test_hadd_is_a_guard_and_an_op(redis, prefix, keys):
    records = cas.VersionedHash(redis)
    assert await records.commit(keys.record, 0, [cas.hadd(keys.ledger, "w1", "x")]) == 1
    assert await redis.hgetall(keys.ledger) == {b"w1": b"x"}
    before = await snapshot(redis, prefix)
    with pytest.raises(cas.Conflict) as refused:  # the hadd of w2 comes first, and is not applied
        await records.commit(keys.record, 1, [cas.hadd(keys.ledger, "w2", "y"), cas.hadd(keys.ledger, "w1", "z")])
    assert (refused.value.reason, refused.value.subject) == ("hadd", "w1")
    assert await snapshot(redis, prefix) == before


async def test_once_applies_a_write_at_most_once_and_keeps_its_answer(redis, prefix, keys):
    records = cas.VersionedHash(redis)
    applied = f"{prefix}:{{t}}:applied:req-1"
    answer = b"\x81\xa1k\xcc\xff"  # any bytes, not only text
    assert await records.commit(keys.record, 0, [cas.once(applied, answer, 60), cas.hcount(keys.counts, "b", 1)],
                                fields=["status", "one"]) == 1
    assert await redis.hgetall(applied) == {b"r": answer, b"v": b"1"}  # the answer and the version it made
    assert 0 < await redis.ttl(applied) <= 60
    before = await snapshot(redis, prefix)
    with pytest.raises(cas.Conflict) as refused:  # the same request again, on a fresh version
        await records.commit(keys.record, 1, [cas.once(applied, b"other", 60), cas.hcount(keys.counts, "b", 1)])
    assert (refused.value.reason, refused.value.raw) == ("once", answer)
    assert await snapshot(redis, prefix) == before


async def test_before_refuses_a_write_once_the_writers_lease_has_ended(redis, prefix, keys):
    records = cas.VersionedHash(redis)
    seconds, micros = await redis.time()
    now_ms = seconds * 1000 + micros // 1000
    assert await records.commit(keys.record, 0, [cas.before(keys.record, now_ms + 60_000)], fields=["s", "1"]) == 1
    before = await snapshot(redis, prefix)
    with pytest.raises(cas.Conflict) as refused:
        await records.commit(keys.record, 1, [cas.before(keys.record, now_ms), cas.hcount(keys.counts, "b", 1)],
                             fields=["s", "2"])
    assert refused.value.reason == "before" and int(refused.value.subject) >= now_ms  # the server's clock
    assert await snapshot(redis, prefix) == before


async def test_a_version_given_again_with_another_tag_is_refused(redis, prefix, keys):
    """After a Redis failover a version can come back with other content: the write's tag tells."""
    records = cas.VersionedHash(redis)
    assert await records.commit(keys.record, 0, fields=["s", "seen"], tags=("", "t1")) == 1
    await redis.hset(keys.record, mapping={"s": "after a failover", "tag": "t9"})  # version 1, another write
    before = await snapshot(redis, prefix)
    with pytest.raises(cas.Conflict) as refused:
        await records.commit(keys.record, 1, [cas.sadd(keys.pool, "x")], fields=["s", "from t1"], tags=("t1", "t2"))
    assert (refused.value.reason, refused.value.subject) == ("version", "1")
    assert await snapshot(redis, prefix) == before
    assert await records.commit(keys.record, 1, fields=["s", "ok"], tags=("t9", "t10")) == 2
    assert await redis.hmget(keys.record, ["s", "tag"]) == [b"ok", b"t10"]


async def test_lapsed_and_live_compare_a_leases_end_with_the_servers_clock(redis, prefix, keys):
    """A node's lease (its end in ms of the server's clock) decides who may write: the sweeper that
    marks the node down only once it has lapsed, the agent that marks it up only while it is live."""
    records = cas.VersionedHash(redis)
    lease = f"{prefix}:{{t}}:lease"
    seconds, micros = await redis.time()
    now_ms = seconds * 1000 + micros // 1000
    await redis.hset(lease, "ends", now_ms + 60_000)
    assert await records.commit(keys.record, 0, [cas.live(lease, "ends")], fields=["s", "up"]) == 1
    before = await snapshot(redis, prefix)
    with pytest.raises(cas.Conflict) as refused:
        await records.commit(keys.record, 1, [cas.lapsed(lease, "ends"), cas.hcount(keys.counts, "b", 1)],
                             fields=["s", "down"])
    assert refused.value.reason == "lapsed" and int(refused.value.subject) >= now_ms
    assert await snapshot(redis, prefix) == before
    await redis.hset(lease, "ends", now_ms - 1)  # the holder stopped renewing
    with pytest.raises(cas.Conflict) as refused:
        await records.commit(keys.record, 1, [cas.live(lease, "ends")], fields=["s", "up again"])
    assert refused.value.reason == "live"
    assert await records.commit(keys.record, 1, [cas.lapsed(lease, "ends")], fields=["s", "down"]) == 2
    for guard in (cas.lapsed, cas.live):  # no lease at all: neither holds
        with pytest.raises(cas.Conflict) as refused:
            await records.commit(keys.record, 2, [guard(lease, "absent")], fields=["s", "x"])
        assert refused.value.reason == guard.__name__
