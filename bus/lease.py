"""Leases in Redis: a key held by one holder at a time, for a time.

    leases = Leases(redis)
    if await leases.hold(key, holder, seconds=3.0):   # take it, or extend it if we hold it
        ...
    await leases.release(key, holder)                 # only if we still hold it

A lease is a string key whose value is the holder, expiring with the lease (`SET ... PX`): a holder
that stops extending it loses it when it expires, and anyone may take it then. Taking, extending
and releasing are one script each on one key (Redis Cluster safe): `lease_hold.lua` and
`lease_release.lua` beside this module.
"""

from __future__ import annotations

from redis.asyncio import Redis, RedisCluster

from bus import scripts


class Leases:
    """Leases on one client; the key and the holder are given with each call."""

    def __init__(self, redis: Redis | RedisCluster) -> None:
        self._hold = scripts.register(redis, "bus", "lease_hold")
        self._release = scripts.register(redis, "bus", "lease_release")

    async def hold(self, key: str, holder: str, seconds: float) -> bool:
        """Take the lease if it is free, or extend it to `seconds` from now if `holder` holds it;
        True if `holder` holds it now, False while another holder does."""
        return bool(await self._hold(keys=[key], args=[holder, int(seconds * 1000)]))

    async def release(self, key: str, holder: str) -> bool:
        """Give the lease up if `holder` holds it (True); otherwise change nothing (False)."""
        return bool(await self._release(keys=[key], args=[holder]))
