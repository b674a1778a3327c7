"""bus.lease against a real Redis: one holder at a time, extended by its holder only, free again
when it expires, released only by its holder."""

from __future__ import annotations

import asyncio

from bus.lease import Leases


async def test_a_lease_is_held_by_one_holder_at_a_time(redis, prefix):
    leases, key = Leases(redis), f"{prefix}:lease"
    assert await leases.hold(key, "a", 5.0)
    assert not await leases.hold(key, "b", 5.0)
    assert await redis.get(key) == b"a"


async def test_only_the_holder_extends_it(redis, prefix):
    leases, key = Leases(redis), f"{prefix}:lease"
    assert await leases.hold(key, "a", 0.5)
    assert not await leases.hold(key, "b", 60.0)
    assert 0 < await redis.pttl(key) <= 500  # b's attempt changed nothing
    assert await leases.hold(key, "a", 60.0)
    assert 30_000 < await redis.pttl(key) <= 60_000


async def test_an_expired_lease_is_free_for_anyone(redis, prefix):
    leases, key = Leases(redis), f"{prefix}:lease"
    assert await leases.hold(key, "a", 0.1)
    await asyncio.sleep(0.2)
    assert await leases.hold(key, "b", 5.0)
    assert not await leases.hold(key, "a", 5.0)


async def test_release_by_a_non_holder_does_nothing(redis, prefix):
    leases, key = Leases(redis), f"{prefix}:lease"
    assert not await leases.release(key, "a")  # nobody holds it
    assert await leases.hold(key, "a", 5.0)
    assert not await leases.release(key, "b")
    assert await redis.get(key) == b"a"
    assert not await leases.hold(key, "b", 5.0)
    assert await leases.release(key, "a")
    assert await redis.get(key) is None
    assert await leases.hold(key, "b", 5.0)


async def test_leases_on_different_keys_are_independent(redis, prefix):
    leases = Leases(redis)
    assert await leases.hold(f"{prefix}:lease:1", "a", 5.0)
    assert await leases.hold(f"{prefix}:lease:2", "b", 5.0)
