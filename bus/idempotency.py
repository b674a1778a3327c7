"""Replaying the first answer for a repeated `request_id` (DESIGN.md §2).

The first request with an id claims it in Redis with `SET NX` and a short lease, runs, and stores
its reply for `ttl` seconds. A retry that arrives meanwhile, on any replica, waits for that reply
instead of running again; a retry after the lease expired without a reply (the worker died) runs
again. Internal errors and refusals of malformed input (400) are not stored, so a retry can
succeed. A request id reused with a different payload is refused rather than answered with someone
else's reply.
"""

from __future__ import annotations

import asyncio
import hashlib
import uuid
from typing import Awaitable, Callable

import msgspec
from redis.asyncio import Redis

from bus.errors import BerthError, InvalidArgument


# Answers that are not kept for a retry: a request refused as malformed (400) did nothing, so its
# id stays free for the corrected request; an internal error (500) may succeed when tried again.
_NOT_KEPT = frozenset({"400", "500"})


class Reply(msgspec.Struct):
    """An encoded reply: the body and, for an error, its headers."""

    body: bytes
    headers: dict[str, str] | None = None


class _Entry(msgspec.Struct, array_like=True):
    token: str  # who holds the claim; empty once the reply is stored
    digest: bytes
    reply: Reply | None = None


# Store the reply only if we still hold the claim (our lease may have expired and been taken over).
_STORE = """
local current = redis.call('GET', KEYS[1])
if current and current ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[2], 'EX', ARGV[3])
return 1
"""

# Release a claim we still hold, so that a retry can run at once.
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class IdempotencyStore:
    def __init__(
        self,
        redis: Redis,
        *,
        prefix: str = "berth",
        ttl: float = 24 * 3600,
        lease: float = 30.0,
        wait: float = 10.0,
        poll: float = 0.01,
    ) -> None:
        self.redis = redis
        self.prefix = prefix
        self.ttl = int(ttl)
        self.lease = lease
        self.wait = wait
        self.poll = poll
        self._store = redis.register_script(_STORE)
        self._release = redis.register_script(_RELEASE)

    def key(self, scope: str, request_id: str) -> str:
        return f"{self.prefix}:idem:{scope}:{request_id}"

    async def run(
        self, scope: str, request_id: str, payload: bytes, call: Callable[[], Awaitable[Reply]]
    ) -> Reply:
        """The stored reply for (scope, request_id), or the result of `call()` stored for next time."""
        if len(request_id) > 200:
            raise InvalidArgument("request_id", "must be at most 200 characters")
        key = self.key(scope, request_id)
        digest = hashlib.blake2b(payload, digest_size=16).digest()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.wait
        while True:
            claim = msgspec.msgpack.encode(_Entry(uuid.uuid4().hex, digest))
            if await self.redis.set(key, claim, nx=True, px=int(self.lease * 1000)):
                return await self._run_claimed(key, claim, digest, call)
            raw = await self.redis.get(key)
            if raw is None:
                continue  # the holder released or its lease just expired: try to claim again
            entry = msgspec.msgpack.decode(raw, type=_Entry)
            if entry.digest != digest:
                raise InvalidArgument("request_id", "was already used for a different request")
            if entry.reply is not None:
                return entry.reply
            if loop.time() > deadline:
                raise BerthError(
                    f"request {request_id} is still being processed; retry later", code="busy",
                    field="request_id",
                )
            await asyncio.sleep(self.poll)

    async def _run_claimed(
        self, key: str, claim: bytes, digest: bytes, call: Callable[[], Awaitable[Reply]]
    ) -> Reply:
        try:
            reply = await call()
        except BaseException:
            await self._release(keys=[key], args=[claim])
            raise
        if reply.headers and reply.headers.get("Nats-Service-Error-Code") in _NOT_KEPT:
            await self._release(keys=[key], args=[claim])
        else:
            stored = msgspec.msgpack.encode(_Entry("", digest, reply))
            await self._store(keys=[key], args=[claim, stored, self.ttl])
        return reply
