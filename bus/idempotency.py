"""Replaying the first answer for a repeated `request_id` (DESIGN.md §2).

The first request with an id claims it in Redis, runs, and keeps its answer for `window` seconds
(the idempotency window, `--idempotency-window`). A retry that arrives meanwhile, on any replica,
waits for that answer instead of running again. Everything else a store keeps under a request id
(an applied marker beside a record, a fixed sample time) lives as long: `Claim.window`.

What is kept is small. An answer that can be rebuilt from the store (an `allocate`'s placements are
in the ledger under ids derived from the request) is kept as a `recipe` of a few bytes that its
endpoint turns back into the answer (`recall`); any other answer is kept whole. A kept hash whose
values all stay under Redis's `hash-max-listpack-value` (64 bytes) is stored compactly, at about a
third of the memory of one that does not.

A claim is a short lease (`lease`, 2 s) that its holder renews while it works, so a claim whose
worker died is free again within about `lease` seconds: the next retry takes it over and runs
again. The claim remembers how many runs it had (`Claim.attempt`, 0 for the first), so that a
handler can tell a takeover from a first run and give back what a dead run left behind.

Internal errors, an unreachable store (`unavailable`), an unknown outcome and refusals of
malformed input (400) are not kept, so a retry can succeed.

When the store fails after the run sent a decisive write (bus.outcome: a lost reply, a silent
link), the run may or may not have changed something. Before answering, the worker learns which,
as a client's retry would: it lets the run's lease run out (from then on none of the run's writes
can land: each is fenced by the lease, `bus.cas.before`), claims the request again, and runs it
again as a takeover, which finds what the first run did (an applied marker, a placement under the
run's ids) and answers that. A kept answer whose reply was lost is kept again, or found kept. Only
if the store stays away for `resolve_within` seconds is the answer `outcome_unknown` (504): the
request's id, sent again, gives the real answer. A request id reused with a different payload is refused rather
than answered with someone else's reply. Every Redis step is one script on one key (Redis Cluster
safe), sent in the worker's shared pipeline (`bus.redis.Pipelined`); the scripts are the
`idempotency_*.lua` files beside this module.

The claim is a lease, but not a `bus.lease` one, on purpose: it lives inside the hash that keeps
the answer for the window (a `bus.lease` lease ends with its key's TTL, which would take the kept answer
with it), its end is a field timed by the server's clock, and the same step checks the payload's
digest and counts the runs. Expressing that with the generic lease would take a second key per
request and a second script call per step.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import hashlib
import logging
import os
from typing import Awaitable, Callable

import msgspec
from redis.asyncio import Redis

from redis import exceptions as redis_errors

from bus import outcome, scripts
from bus.codec import decoder, encode
from bus.failpoints import failpoint
from bus.redis import Pipelined
from bus.replicas import ReplicaWait, landed
from bus.telemetry import OUTCOMES_RESOLVED
from schemas.errors import BerthError, InvalidArgument, OutcomeUnknown, Unavailable

log = logging.getLogger("berth.idempotency")

# Answers that are not kept for a retry: a request refused as malformed (400) did nothing, so its
# id stays free for the corrected request; an internal error (500), an unreachable store or an
# unknown outcome (504) may come out otherwise when tried again.
_NOT_KEPT = frozenset({"400", "500", "504"})
# A store that failed (bus.service answers these `unavailable` or `outcome_unknown`).
STORE_ERRORS = (redis_errors.ConnectionError, redis_errors.TimeoutError, redis_errors.ClusterError,
                redis_errors.ReadOnlyError, redis_errors.TryAgainError, redis_errors.OutOfMemoryError)
RESOLVE_SECONDS = 5.0
_UNAVAILABLE = encode("unavailable")
MAX_REQUEST_ID = 200


def _kept(status: str | None, body: bytes) -> bool:
    return status not in _NOT_KEPT and not (status == "503" and _UNAVAILABLE in body)


DEFAULT_WINDOW = 120.0  # seconds; docs/operations/sizing.md derives it from the measured bytes and rates
_RECIPE = b"\x01"  # the first byte of a kept recipe; a kept whole answer is a MessagePack array or map


class Reply(msgspec.Struct):
    """An encoded reply: the body and, for an error, its headers. `recipe`: what to keep instead of
    the body, from which the endpoint rebuilds it (never sent)."""

    body: bytes
    headers: dict[str, str] | None = None
    recipe: bytes | None = None


class _Kept(msgspec.Struct, array_like=True):
    """A whole answer as kept (an array: no key names stored with every answer)."""

    body: bytes
    headers: dict[str, str] | None = None


def kept_form(reply: Reply) -> bytes:
    """What is kept for `reply`: its recipe, else the whole answer."""
    if reply.recipe is not None and reply.headers is None:
        return _RECIPE + reply.recipe
    return encode(_Kept(reply.body, reply.headers))


_decode_kept = decoder(_Kept)
_decode_legacy = decoder(Reply)  # answers kept as a map, before recipes


Recall = Callable[[bytes], Awaitable[Reply]]


async def replayed(kept: bytes, recall: Recall | None) -> Reply:
    """The answer `kept_form` kept: rebuilt from its recipe by `recall`, or as kept."""
    if kept[:1] == _RECIPE:
        if recall is None:
            raise RuntimeError("an answer was kept as a recipe, but its command cannot rebuild it")
        return await recall(kept[1:])
    if kept[:1] and kept[0] & 0xF0 == 0x80:
        legacy = _decode_legacy(kept)
        return Reply(legacy.body, legacy.headers)
    whole = _decode_kept(kept)
    return Reply(whole.body, whole.headers)


class Claim:
    """The request a handler is running under: its id, which run of it this is, and the lease that
    fences its writes.

    A run that pauses (SIGSTOP, a VM pause) longer than its lease may be taken over by a retry. Its
    writes must then be refused: a store that can check the server's clock in the same step as a
    write guards it with `lease_end` (`bus.cas.before`), and on a refusal asks `still_held()`.
    """

    def __init__(self, store: IdempotencyStore, key: str, token: str, request_id: str, scope: str,
                 attempt: int, lease_end: int) -> None:
        self.window = store.window  # seconds: how long what a store keeps for this request must live
        self._store = store
        self._key = key
        self._token = token
        self.request_id = request_id
        self.scope = scope
        self.attempt = attempt  # 0 the first time; n after n runs that never kept an answer
        self.lease_end = lease_end  # ms of the server's time: until then no other run can take over
        self.task = asyncio.current_task()  # the request's own task (background work it starts is not)

    @property
    def marker(self) -> str:
        """Names this request (not this run) where a store keeps what it applied for it."""
        return f"{self.scope}:{self.request_id}"

    async def still_held(self) -> bool:
        """Renew the lease now: False when a newer run took the request over (or it was answered)."""
        return self.renewed(await self._store.renew(self._key, self._token))

    def renewed(self, lease_end: int) -> bool:
        self.lease_end = max(self.lease_end, lease_end)
        return lease_end > 0


def taken_over(run: Claim) -> BerthError:
    """The error of a run whose request a newer run took over: it must not answer or write."""
    return BerthError(f"request {run.request_id} took too long and was taken over; retry", code="busy",
                      field="request_id")


# The claim of the request the current task runs, for handlers that need it (None without one).
current_claim: contextvars.ContextVar[Claim | None] = contextvars.ContextVar("berth_claim", default=None)


def own_claim() -> Claim | None:
    """The claim of the request this task runs, or None: also in a background task that a request
    started (it inherits the context, but outlives the claim, so its writes are not the answer's)."""
    run = current_claim.get()
    return run if run is not None and run.task is asyncio.current_task() else None

# A claim is a hash: d (payload digest), t (holder's token), u (lease end, ms of server time),
# a (runs so far), r (the kept answer). Its scripts are idempotency_*.lua beside this module; the
# claim is not a `bus.lease` lease (idempotency_claim.lua says why).


class IdempotencyStore:
    def __init__(
        self,
        redis: Redis,
        *,
        prefix: str = "berth",
        window: float = DEFAULT_WINDOW,
        lease: float = 2.0,
        wait: float = 10.0,
        poll: float = 0.01,
        replicas: ReplicaWait | None = None,
        resolve_within: float = RESOLVE_SECONDS,
    ) -> None:
        self.redis = redis
        self.prefix = prefix
        self.window = max(1, int(window))
        self.lease = lease
        self.wait = wait
        self.poll = poll
        self.replicas = replicas  # the kept answer must be on replicas before it is sent (bus.replicas)
        self.resolve_within = resolve_within  # seconds to learn an unknown outcome before answering it
        self.batch = Pipelined.of(redis)
        self._claim = scripts.register(redis, "bus", "idempotency_claim")
        self._keep = scripts.register(redis, "bus", "idempotency_keep")
        self._renew = scripts.register(redis, "bus", "idempotency_renew")
        self._release = scripts.register(redis, "bus", "idempotency_release")
        self._held: dict[str, Claim] = {}  # claims this process holds now, by key
        self._renewal: asyncio.TimerHandle | None = None

    @staticmethod
    def check(request_id: str) -> None:
        """Refuse an id beyond the contract's bound (a request Struct that does not bound it)."""
        if len(request_id) > MAX_REQUEST_ID:
            raise InvalidArgument("request_id", f"must be at most {MAX_REQUEST_ID} characters")

    def key(self, scope: str, request_id: str) -> str:
        return f"{self.prefix}:idem:{scope}:{request_id}"

    async def run(
        self,
        scope: str,
        request_id: str,
        payload: bytes,
        call: Callable[[], Awaitable[Reply]],
        undo: Callable[[Reply], Awaitable[None]] | None = None,
        recall: Recall | None = None,
    ) -> Reply:
        """The kept answer for (scope, request_id), or the answer of `call()`, kept for next time.

        `undo` gives back the effect of an answer that could not be kept because this run lost its
        claim (its lease ran out while it worked, and a retry took over): the retry's answer counts.
        `recall` rebuilds an answer kept as a recipe (`Reply.recipe`).
        """
        key = self.key(scope, request_id)
        digest = hashlib.sha1(payload).digest()
        token = os.urandom(16).hex()  # as unguessable as uuid4, in a fifth of its time
        taken = await self._first_take(key, token, digest, request_id)
        resolving: float | None = None  # since when the store failed after a change may have been made
        while True:
            if isinstance(taken, bytes):
                await self._replicated(key)  # the first run may have answered unavailable for want of it
                return await self._replayed(request_id, taken, recall)
            run = Claim(self, key, token, request_id, scope, *taken)
            try:
                reply = await self._claimed(run, call)
            except STORE_ERRORS as error:
                tracked = outcome.current()
                if run.attempt == 0 and (tracked is None or not tracked.may_have_changed):
                    raise Unavailable(f"the store failed ({type(error).__name__}) before the request changed "
                                      "anything; nothing was changed: retry") from None
                # This run may have made the change, or an earlier run whose work a takeover was to
                # find: learn which.
                log.warning("request %s: the store failed after a change may have been made (%r); learning the "
                            "outcome", request_id, error)
                resolving = resolving or asyncio.get_running_loop().time()
                token = os.urandom(16).hex()
                taken = await self._retaken(key, token, digest, request_id, resolving + self.resolve_within)
                continue
            deadline = (resolving or asyncio.get_running_loop().time()) + self.resolve_within
            answer = await self._kept(run, reply, undo, deadline)
            if resolving is not None:
                OUTCOMES_RESOLVED.inc()
            return answer

    @staticmethod
    async def _replayed(request_id: str, kept: bytes, recall: Recall | None) -> Reply:
        """The kept answer, rebuilt. The request was made: a store that fails while the answer is
        rebuilt from it (an allocate's placements are read from the ledger) is no `unavailable`."""
        try:
            failpoint("recall")
            return await replayed(kept, recall)
        except STORE_ERRORS as error:
            raise OutcomeUnknown(
                f"request {request_id} was made, and reading its answer failed ({error!r}): send it again with "
                "the same request_id for the answer", field="request_id",
            ) from None

    async def _first_take(self, key: str, token: str, digest: bytes, request_id: str) -> tuple[int, int] | bytes:
        """Claim the request (or find its answer). A store that cannot be reached cannot say whether
        an earlier delivery of the request made the change: `outcome_unknown`. A full store refused
        the claim; it still answers reads, which say whether the request is new (`unavailable`:
        nothing of it was made), kept (its answer) or was run before (`outcome_unknown`)."""
        try:
            return await self._take(key, token, digest, request_id, asyncio.get_running_loop().time() + self.wait)
        except redis_errors.OutOfMemoryError:
            found, kept = await self.batch.execute_command("HMGET", key, "d", "r")
            if kept is not None and found == digest:
                return kept
            if found is None:
                raise Unavailable("the store is out of memory (maxmemory) and refused the request, which changed "
                                  "nothing: retry once memory is freed") from None
            raise OutcomeUnknown(f"the store is out of memory, and request {request_id} was run before: send it "
                                 "again with the same request_id once memory is freed", field="request_id") from None
        except STORE_ERRORS as error:
            raise OutcomeUnknown(
                f"the store could not be reached ({type(error).__name__}) to claim request {request_id}; an earlier "
                "delivery of it may have made the change: send it again with the same request_id",
                field="request_id",
            ) from None

    async def _claimed(self, run: Claim, call: Callable[[], Awaitable[Reply]]) -> Reply:
        """`call()` under the claim `run`, its lease renewed meanwhile. A run that fails gives its
        claim up (a retry may take over at once), unless the store failed after a change was sent:
        then its lease runs out first, so that none of its writes can land after a takeover."""
        self._hold(run._key, run)
        claim = current_claim.set(run)
        try:
            return await call()
        except BaseException as error:
            tracked = outcome.current()
            if not (isinstance(error, STORE_ERRORS) and tracked is not None and tracked.may_have_changed):
                await asyncio.shield(self._give_up(run, "expire"))
            raise
        finally:
            current_claim.reset(claim)
            self._held.pop(run._key, None)

    async def _give_up(self, run: Claim, how: str) -> None:
        """Release the claim (`forget` or `expire`, see idempotency_release.lua); a store that fails
        meanwhile lets it lapse with its lease instead."""
        try:
            await self.batch.script(self._release, [run._key], [run._token, how])
        except STORE_ERRORS as error:
            log.info("request %s: giving its claim up failed (%r); it lapses with its lease", run.request_id, error)

    async def _kept(
        self, run: Claim, reply: Reply, undo: Callable[[Reply], Awaitable[None]] | None, deadline: float
    ) -> Reply:
        """Keep `reply` as the answer to `run`'s request (or give the claim up, for an answer that is
        not kept), and return it. A keep whose reply is lost is sent again until `deadline`: the
        script finds it kept already, or keeps it, or finds the claim taken over."""
        status = (reply.headers or {}).get("Nats-Service-Error-Code")
        if not _kept(status, reply.body):
            await self._give_up(run, "forget" if status == "400" else "expire")
            return reply
        while True:
            try:
                kept = await self.batch.script(self._keep, [run._key], [run._token, kept_form(reply), self.window])
                break
            except STORE_ERRORS as error:
                if asyncio.get_running_loop().time() > deadline:
                    raise OutcomeUnknown(
                        f"request {run.request_id}: its change was made, and keeping its answer failed ({error!r}): "
                        "send it again with the same request_id for the answer", field="request_id",
                    ) from None
                await asyncio.sleep(0.1)
        if not kept:
            log.warning("request %s: the claim was taken over while it ran; its answer is not the one kept",
                        run.request_id)
            if undo is not None and status is None:  # an error answer changed nothing to give back
                await undo(reply)
            raise taken_over(run)
        await self._replicated(run._key)
        return reply

    async def _retaken(
        self, key: str, token: str, digest: bytes, request_id: str, deadline: float
    ) -> tuple[int, int] | bytes:
        """Claim the request again once the failed run's lease has run out (or find its answer),
        trying while the store fails, until `deadline`; then the outcome stays unknown."""
        pause = 0.05
        while True:
            try:
                return await self._take(key, token, digest, request_id, deadline)
            except STORE_ERRORS as error:
                if asyncio.get_running_loop().time() > deadline:
                    raise OutcomeUnknown(
                        f"request {request_id}: a change was sent and the store did not answer since ({error!r}): "
                        "it may or may not be made; send the request again with the same request_id",
                        field="request_id",
                    ) from None
                await asyncio.sleep(pause)
                pause = min(pause * 2, 0.5)
            except BerthError as error:
                if error.code != "busy":
                    raise
                raise OutcomeUnknown(
                    f"request {request_id}: a change was sent and its outcome could not be learned in time: "
                    "send the request again with the same request_id", field="request_id",
                ) from None

    async def _replicated(self, key: str) -> None:
        """With `replicas`: wait until the kept answer is on them, else raise `Unavailable`. The
        answer stays kept: a retry sends it once it is (what it reports was confirmed before it
        was kept, see `bus.service`)."""
        if self.replicas is not None:
            await self.replicas.confirm([landed(self.redis, key)])

    def _hold(self, key: str, run: Claim) -> None:
        """Keep the claim's lease running while it is held: every third of a lease, one renewal
        for every claim held at that moment (a timer, not a task per request)."""
        self._held[key] = run
        if self._renewal is None:
            self._renewal = asyncio.get_running_loop().call_later(self.lease / 3, self._renew_held)

    def _renew_held(self) -> None:
        self._renewal = None
        if not self._held:
            return
        for key, run in self._held.items():
            self.batch.script(self._renew, [key], [run._token, int(self.lease * 1000)]).add_done_callback(
                functools.partial(_renewed, run)
            )
        self._renewal = asyncio.get_running_loop().call_later(self.lease / 3, self._renew_held)

    async def renew(self, key: str, token: str) -> int:
        """Extend a claim's lease now: its new end (ms of server time), or 0 when it is not ours."""
        return int(await self.batch.script(self._renew, [key], [token, int(self.lease * 1000)]))

    async def _take(
        self, key: str, token: str, digest: bytes, request_id: str, deadline: float
    ) -> tuple[int, int] | bytes:
        """Claim the id (the run's attempt number and lease end), or the answer kept for it (as
        `kept_form` wrote it); waits while another live run holds it, until `deadline`."""
        loop = asyncio.get_running_loop()
        pause = self.poll
        while True:
            status, value, *lease_end = await self.batch.script(
                self._claim, [key], [digest, token, int(self.lease * 1000), self.window]
            )
            if status == b"claimed":
                return int(value), int(lease_end[0])
            if status == b"done":
                return value
            if status == b"mismatch":
                raise InvalidArgument("request_id", "was already used for a different request")
            if loop.time() > deadline:
                raise BerthError(
                    f"request {request_id} is still being processed; retry later", code="busy", field="request_id"
                )
            await asyncio.sleep(min(pause, int(value) / 1000))
            pause = min(pause * 2, 0.1)


def _renewed(run: Claim, renewal: asyncio.Future) -> None:
    if renewal.cancelled():
        return
    if renewal.exception() is not None:  # the next renewal tries again
        log.warning("renewing a claim failed: %r", renewal.exception())
    else:
        run.renewed(int(renewal.result()))
