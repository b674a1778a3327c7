"""Replaying the first answer for a repeated `request_id` (DESIGN.md §2).

The first request with an id claims it in Redis, runs, and keeps its answer for `ttl` seconds (24 h).
A retry that arrives meanwhile, on any replica, waits for that answer instead of running again.

A claim is a short lease (`lease`, 2 s) that its holder renews while it works, so a claim whose
worker died is free again within about `lease` seconds: the next retry takes it over and runs
again. The claim remembers how many runs it had (`Claim.attempt`, 0 for the first), so that a
handler can tell a takeover from a first run and give back what a dead run left behind.

Internal errors, an unreachable store (`unavailable`) and refusals of malformed input (400) are
not kept, so a retry can succeed. A request id reused with a different payload is refused rather
than answered with someone else's reply. Every Redis step is one script on one key (Redis Cluster
safe), sent in the worker's shared pipeline (`bus.redis.Pipelined`); the scripts are the
`idempotency_*.lua` files beside this module.

The claim is a lease, but not a `bus.lease` one, on purpose: it lives inside the hash that keeps
the answer for 24 h (a `bus.lease` lease ends with its key's TTL, which would take the kept answer
with it), its end is a field timed by the server's clock, and the same step checks the payload's
digest and counts the runs. Expressing that with the generic lease would take a second key per
request and a second script call per step.
"""

from __future__ import annotations

import asyncio
import contextvars
import hashlib
import logging
import uuid
from dataclasses import dataclass
from typing import Awaitable, Callable

import msgspec
from redis.asyncio import Redis

from bus import scripts
from bus.errors import BerthError, InvalidArgument
from bus.redis import Pipelined
from bus.replicas import ReplicaWait, landed

log = logging.getLogger("berth.idempotency")

# Answers that are not kept for a retry: a request refused as malformed (400) did nothing, so its
# id stays free for the corrected request; an internal error (500) or an unreachable store may
# succeed when tried again.
_NOT_KEPT = frozenset({"400", "500"})
_UNAVAILABLE = msgspec.msgpack.encode("unavailable")


def _kept(status: str | None, body: bytes) -> bool:
    return status not in _NOT_KEPT and not (status == "503" and _UNAVAILABLE in body)


class Reply(msgspec.Struct):
    """An encoded reply: the body and, for an error, its headers."""

    body: bytes
    headers: dict[str, str] | None = None


@dataclass(frozen=True)
class Claim:
    """The request a handler is running under: its id, and which run of it this is."""

    request_id: str
    attempt: int  # 0 the first time; n after n runs that never kept an answer (their worker died)


# The claim of the request the current task runs, for handlers that need it (None without one).
current_claim: contextvars.ContextVar[Claim | None] = contextvars.ContextVar("berth_claim", default=None)

# A claim is a hash: d (payload digest), t (holder's token), u (lease end, ms of server time),
# a (runs so far), r (the kept answer). Its scripts are idempotency_*.lua beside this module; the
# claim is not a `bus.lease` lease (idempotency_claim.lua says why).


class IdempotencyStore:
    def __init__(
        self,
        redis: Redis,
        *,
        prefix: str = "berth",
        ttl: float = 24 * 3600,
        lease: float = 2.0,
        wait: float = 10.0,
        poll: float = 0.01,
        replicas: ReplicaWait | None = None,
    ) -> None:
        self.redis = redis
        self.prefix = prefix
        self.ttl = int(ttl)
        self.lease = lease
        self.wait = wait
        self.poll = poll
        self.replicas = replicas  # the kept answer must be on replicas before it is sent (bus.replicas)
        self.batch = Pipelined.of(redis)
        self._claim = scripts.register(redis, "bus", "idempotency_claim")
        self._keep = scripts.register(redis, "bus", "idempotency_keep")
        self._renew = scripts.register(redis, "bus", "idempotency_renew")
        self._release = scripts.register(redis, "bus", "idempotency_release")
        self._held: dict[str, str] = {}  # claims this process holds now: key -> token
        self._renewal: asyncio.TimerHandle | None = None

    def key(self, scope: str, request_id: str) -> str:
        return f"{self.prefix}:idem:{scope}:{request_id}"

    async def run(
        self,
        scope: str,
        request_id: str,
        payload: bytes,
        call: Callable[[], Awaitable[Reply]],
        undo: Callable[[Reply], Awaitable[None]] | None = None,
    ) -> Reply:
        """The kept answer for (scope, request_id), or the answer of `call()`, kept for next time.

        `undo` gives back the effect of an answer that could not be kept because this run lost its
        claim (its lease ran out while it worked, and a retry took over): the retry's answer counts.
        """
        if len(request_id) > 200:
            raise InvalidArgument("request_id", "must be at most 200 characters")
        key = self.key(scope, request_id)
        token = uuid.uuid4().hex
        attempt = await self._take(key, token, hashlib.sha1(payload).digest(), request_id)
        if isinstance(attempt, Reply):
            await self._replicated(key)  # the first run may have answered unavailable for want of it
            return attempt
        self._hold(key, token)
        claim = current_claim.set(Claim(request_id, attempt))
        try:
            reply = await call()
        except BaseException:
            await asyncio.shield(self.batch.script(self._release, [key], [token, "expire"]))
            raise
        finally:
            current_claim.reset(claim)
            self._held.pop(key, None)
        status = (reply.headers or {}).get("Nats-Service-Error-Code")
        if not _kept(status, reply.body):
            await self.batch.script(self._release, [key], [token, "forget" if status == "400" else "expire"])
        elif not await self.batch.script(self._keep, [key], [token, msgspec.msgpack.encode(reply), self.ttl]):
            log.warning("request %s: the claim was taken over while it ran; its answer is not the one kept", request_id)
            if undo is not None and status is None:  # an error answer changed nothing to give back
                await undo(reply)
            raise BerthError(f"request {request_id} took too long and was taken over; retry", code="busy",
                             field="request_id")
        else:
            await self._replicated(key)
        return reply

    async def _replicated(self, key: str) -> None:
        """With `replicas`: wait until the kept answer is on them, else raise `Unavailable`. The
        answer stays kept: a retry sends it once it is (what it reports was confirmed before it
        was kept, see `bus.service`)."""
        if self.replicas is not None:
            await self.replicas.confirm([landed(self.redis, key)])

    def _hold(self, key: str, token: str) -> None:
        """Keep the claim's lease running while it is held: every third of a lease, one renewal
        for every claim held at that moment (a timer, not a task per request)."""
        self._held[key] = token
        if self._renewal is None:
            self._renewal = asyncio.get_running_loop().call_later(self.lease / 3, self._renew_held)

    def _renew_held(self) -> None:
        self._renewal = None
        if not self._held:
            return
        for key, token in self._held.items():
            self.batch.script(self._renew, [key], [token, int(self.lease * 1000)]).add_done_callback(_log_failure)
        self._renewal = asyncio.get_running_loop().call_later(self.lease / 3, self._renew_held)

    async def _take(self, key: str, token: str, digest: bytes, request_id: str) -> int | Reply:
        """Claim the id (the run's attempt number), or the answer kept for it; waits while another
        live run holds it."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.wait
        pause = self.poll
        while True:
            status, value = await self.batch.script(self._claim, [key], [digest, token, int(self.lease * 1000), self.ttl])
            if status == b"claimed":
                return int(value)
            if status == b"done":
                return msgspec.msgpack.decode(value, type=Reply)
            if status == b"mismatch":
                raise InvalidArgument("request_id", "was already used for a different request")
            if loop.time() > deadline:
                raise BerthError(
                    f"request {request_id} is still being processed; retry later", code="busy", field="request_id"
                )
            await asyncio.sleep(min(pause, int(value) / 1000))
            pause = min(pause * 2, 0.1)


def _log_failure(renewal: asyncio.Future) -> None:
    if not renewal.cancelled() and renewal.exception() is not None:  # the next renewal tries again
        log.warning("renewing a claim failed: %r", renewal.exception())
