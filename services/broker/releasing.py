"""Releasing resources (crm reference §1, Release; §2.9, the release pool).

A release is begun and finished in two writes: the record is marked `deleting` (out of its pool,
with a `release` timer in case this replica dies), the operator releases its instances, and the
record is marked `released` (kept readable for the idempotency window). A release the operator
refused is retried by the `release` timer.
"""

from __future__ import annotations

import logging

from bus.idempotency import own_claim
from schemas.errors import BerthError
from services.broker import errors, transitions
from services.broker.context import RETRIES, Part
from services.broker.model import DELETING, RELEASED, Resource, now
from services.broker.operators.base import OperatorError
from services.broker.publisher import pool_event, status_event
from services.broker.store import AlreadyApplied, Stale

log = logging.getLogger("berth.broker")


class Releasing(Part):
    async def release(self, user: str, resource_id: str) -> None:
        """Release a resource; a sold one takes its broker resource along (that one first). The
        caller's record marked deleting is the request's decisive write: a retry after a run that
        died past it finishes that release instead of answering resource_not_found."""
        if await self.store.applied(own_claim()) is not None:
            return await self._released_before(user, resource_id)
        record = await self.store.load(user, resource_id)
        if record is None or record.status == RELEASED:
            raise errors.resource_not_found(resource_id)
        if record.broker_resource_id:
            target = await self.store.load(user, record.broker_resource_id)
            if target is not None and target.status != RELEASED:
                await self.release_record(target)
        try:
            await self.release_record(record, answer=b"")
        except AlreadyApplied:
            await self._released_before(user, resource_id)

    async def _released_before(self, user: str, resource_id: str) -> None:
        """Finish the release an earlier run of the request began (it may have died half way)."""
        record = await self.store.load(user, resource_id)
        if record is not None and record.status == DELETING:
            await self._finish(record)

    async def release_record(self, record: Resource, *, if_unchanged: bool = False, answer: bytes | None = None) -> bool:
        """Begin and finish releasing `record`. With `if_unchanged`, give up (False) if the record
        changed since it was read (a pool loop must not release what `apply` just sold). `answer`:
        beginning it is the request's answer (`BrokerStore.commit`)."""
        begun = await self._begin(record, if_unchanged, answer)
        if begun is None:
            return False
        await self._finish(begun)
        return True

    async def finish_release(self, user: str, resource_id: str) -> None:
        """The `release` timer: a release begun by a replica that died, or one the operator refused."""
        record = await self.store.load(user, resource_id)
        if record is None or record.status != DELETING:
            await self.store.drop_timer("release", user, resource_id)
            return
        try:
            await self._finish(record)
        except BerthError:
            pass  # rescheduled or left deleting by _failed

    async def _reloaded(self, record: Resource) -> Resource | None:
        """`record` as it is now, or None once it is gone or released."""
        reloaded = await self.store.load(record.user, record.resource_id)
        return None if reloaded is None or reloaded.status == RELEASED else reloaded

    async def _begin(self, record: Resource, if_unchanged: bool, answer: bytes | None) -> Resource | None:
        """Take the record out of its pool and mark it deleting, with a `release` timer in case we die."""
        for _ in range(RETRIES):
            if record.status == DELETING:
                return record
            deleting = transitions.deleting(record, now())
            try:
                return await self.store.begin_release(
                    deleting, now() + self.timing.claim_seconds, answer, events=[status_event(deleting)]
                )
            except Stale:
                reloaded = None if if_unchanged else await self._reloaded(record)
                if reloaded is None:
                    return None
                record = reloaded
                continue
        raise BerthError(
            f"resource {record.resource_id} keeps changing; release it again",
            code="busy",
            field="resource_id",
        )

    async def _finish(self, record: Resource) -> None:
        """Release the platform's side, then mark the record released (kept readable for the
        idempotency window)."""
        if transitions.operator_holds(record):
            try:
                await self.operator.release(record.user, record.resource_id, record.request_instance)
            except (OperatorError, BerthError) as error:
                await self._failed(record, error)
                raise BerthError(
                    f"release of {record.resource_id} failed: {error}; it will be retried",
                    code="internal",
                    field="resource_id",
                ) from None
        for _ in range(RETRIES):
            released = transitions.released(record, now())
            events = [status_event(released)]
            if record.broker_name:
                events.append(pool_event(record.user, record.broker_name, "released", record.resource_id))
            try:
                await self.store.mark_released(record, released, events=events)
            except Stale:
                reloaded = await self._reloaded(record)
                if reloaded is None:
                    return
                record = reloaded
                continue
            return

    async def _failed(self, record: Resource, error: Exception) -> None:
        """Retry every `release_retry_seconds` where crm's release pool would (see
        `transitions.release_retried`), else drop the timer."""
        log.warning("release of %s/%s failed: %s", record.user, record.resource_id, error)
        broker = await self.store.broker(record.user, record.broker_name) if record.broker_name else None
        if transitions.release_retried(broker):
            await self.store.schedule(
                "release", record.user, record.resource_id, now() + self.timing.release_retry_seconds
            )
        else:
            await self.store.drop_timer("release", record.user, record.resource_id)
