"""Launching resources (crm reference §1): init, launch, apply, scale, and a broker's own launches.

A launch is written first (instances of the capacity block reserved, the record `pending`, a
`launch` timer set) and handed to the operator after: the replica that accepted it does that at
once, and the `launch` timer is the crash guard, so any replica, also one started after a crash,
finishes it. A `launch` command answers once its record is `deploying`.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Awaitable, Callable

import msgspec

from bus.idempotency import own_claim
from bus.tasks import cancel_and_wait
from schemas.broker import InstanceFilter, ResourceParam
from schemas.errors import BerthError
from services.broker import errors, model, telemetry, transitions
from services.broker.brokers import BrokerRegistry
from services.broker.context import RETRIES, Context, Part
from services.broker.model import DEPLOYING, INIT, RELEASED, RUNNING, BrokerConfig, Resource, now
from services.broker.operators.base import LaunchSpec, OperatorError
from services.broker.publisher import pool_event, status_event
from services.broker.store import AlreadyApplied, Announced, Stale

log = logging.getLogger("berth.broker")


class Launching(Part):
    def __init__(self, context: Context, registry: BrokerRegistry) -> None:
        super().__init__(context)
        self.registry = registry
        self._tasks: set[asyncio.Task] = set()

    def check(self, param: ResourceParam) -> None:
        """A param this broker can launch (or reject with the field at fault)."""
        model.check_param(param)
        self.operator.validate(param)

    async def init(self, user: str, resource_id: str, param: ResourceParam) -> Resource | None:
        self.check(param)
        if await self.store.applied(own_claim()) is not None:
            return None  # an earlier run of this request created it, then died unanswered
        current = await self.store.load(user, resource_id)
        if current is not None and current.status != RELEASED:
            raise errors.already_init(resource_id)
        created = transitions.created(user, resource_id, param, now())
        try:
            return await self.store.create(
                created, current.version if current else 0, answer=b"", events=[status_event(created)]
            )
        except AlreadyApplied:
            return None
        except Stale:
            raise errors.already_init(resource_id) from None

    async def launch(
        self, user: str, resource_id: str, city: str | None, instance_filter: InstanceFilter
    ) -> Resource:
        """Serve from the user's brokers if one has a ready resource, else reserve and launch cold."""
        model.check_filter(instance_filter)
        if await self.store.applied(own_claim()) is not None:
            return await self.launched_before(user, resource_id)
        record = await self.live(user, resource_id)
        if record.status != INIT or record.launched:
            raise errors.already_launched(resource_id, record.status)
        record = transitions.in_city(record, city)
        try:
            return await self.registry.claim(record, instance_filter)
        except AlreadyApplied:
            return await self.launched_before(user, resource_id)
        except BerthError as error:
            if error.code == "application_already_launched":
                raise
            log.debug("launch %s/%s: no broker serves it (%s); launching cold", user, resource_id, error.code)
        self.check(record.param)
        block = self.operator.block_key(record.param)
        free, available = await self._capacity(record.param, block)
        need = model.take_instances(instance_filter, available)
        written = await self._write_launch(
            transitions.launched(record, block, need, now() + self.timing.trace_timeout),
            need,
            free,
            refuse=lambda left: errors.no_enough_resources(left, instance_filter.least_instance),
            wait=True,
        )
        telemetry.COLD.inc()
        return written

    async def apply(
        self, user: str, resource_id: str, param: ResourceParam, instance_filter: InstanceFilter
    ) -> Resource:
        """A ready resource of the first fitting broker, linked to the caller's resource (init'ed if new;
        nothing is written if no resource is sold)."""
        started = time.perf_counter()
        histogram = telemetry.APPLY_ERROR
        try:
            model.check_filter(instance_filter)
            self.check(param)
            # One Redis round trip: the claim script itself refuses a caller that is launched already.
            caller = model.new_record(user, resource_id, param)
            try:
                sold = await self.registry.claim(caller, instance_filter)
            except AlreadyApplied as kept:  # an earlier run of this request sold it, then died
                sold = msgspec.structs.replace(caller, broker_resource_id=kept.answer.decode())
            histogram = telemetry.APPLY_SOLD
            return sold
        except BerthError:
            histogram = telemetry.APPLY_REFUSED
            raise
        finally:
            histogram.observe(time.perf_counter() - started)

    async def launch_for_broker(self, broker: BrokerConfig) -> Resource:
        """A new resource in `broker`'s pool (crm's Broker.Launch); it warms until its gate accepts it."""
        block = self.operator.block_key(broker.param)
        free, available = await self._capacity(broker.param, block)
        if available < broker.instance:
            raise errors.broker_not_enough(available, broker.instance, broker.name)
        t = now()
        record = transitions.pool_resource(
            broker, model.pool_resource_id(broker.name), block, t, t + self.timing.ready_timeout
        )
        return await self._write_launch(
            record,
            broker.instance,
            free,
            refuse=lambda left: errors.broker_not_enough(left, broker.instance, broker.name),
            into_pool=True,
            events=[pool_event(broker.user, broker.name, "launched", record.resource_id)],
        )

    async def scale(self, user: str, resource_id: str, instance_filter: InstanceFilter) -> Resource:
        """More instances for a running resource (a sold one scales its broker resource)."""
        model.check_filter(instance_filter)
        if await self.store.applied(own_claim()) is not None:
            return await self.launched_before(user, resource_id)
        record = await self.live(user, resource_id)
        if record.status != RUNNING:
            raise errors.not_running(resource_id, record.status)
        if record.broker_resource_id:
            return await self.scale(user, record.broker_resource_id, instance_filter)
        free, available = await self._capacity(record.param, record.resource_block_key)
        need = model.take_instances(instance_filter, available)
        scaled = transitions.scaled(record, need, now() + self.timing.trace_timeout)
        return await self._write_launch(
            scaled,
            need,
            free,
            refuse=lambda left: errors.no_enough_resources(left, instance_filter.least_instance),
            events=[status_event(scaled)],
        )

    async def _capacity(self, param: ResourceParam, block: str) -> tuple[int, int]:
        """Instances of `block` the operator can still start, and how many of those are not reserved."""
        free = await self.operator.free_instances(param)
        return free, free - await self.store.reserved(block)

    async def _write_launch(
        self,
        record: Resource,
        need: int,
        free: int,
        *,
        refuse: Callable[[int], BerthError],
        into_pool: bool = False,
        wait: bool = False,
        events: Announced = None,
    ) -> Resource:
        """Write a launch: reserve `need` instances of the block (at most `free` reserved in all), set
        the launch timer, and start the operator launch. Another launch that took the capacity first
        makes it `refuse(instances left)`. `into_pool`: a broker's new resource, which joins its pool.

        With `wait`, the operator launch is done before returning and the record returned is the one
        it wrote (`deploying`): a `launch` command must not answer while its record still says
        `init` (crm's `deploying` is "the platform accepted the launch"). Should that work fail
        (Redis unreachable, say), the `launch` timer finishes it; the record written so far is
        returned. Without `wait` (a broker's own launches, scale) it runs in the background."""
        t = now()
        due = t + self.timing.claim_seconds
        try:
            if into_pool:
                written = await self.store.reserve_pool_launch(
                    transitions.pending(record, t), need, free, due, events=events
                )
            else:
                written = await self.store.reserve_launch(
                    transitions.pending(record, t), need, free, due, answer=b"", events=events
                )
        except AlreadyApplied:
            return await self.launched_before(record.user, record.resource_id)
        except Stale as stale:
            if stale.reason == "capacity":
                raise refuse(free - await self.store.reserved(record.resource_block_key)) from None
            if stale.reason == "missing":
                raise errors.broker_not_found(record.user, record.broker_name) from None
            raise errors.already_launched(record.resource_id, "changed meanwhile") from None
        if not wait:
            self.background(self.finish_launch(record.user, record.resource_id))
            return written
        try:
            finished = await self.finish_launch(record.user, record.resource_id)
        except Exception as error:  # the launch timer retries what failed here
            user, resource_id = record.user, record.resource_id
            log.error("launch of %s/%s failed; its timer retries it: %r", user, resource_id, error)
            finished = None
        return finished or written

    async def launched_before(self, user: str, resource_id: str) -> Resource:
        """The answer to a launch or scale an earlier run of the request wrote and died before
        answering: that run's launch is finished now (not when its timer falls due), and the record
        as it stands answers. Another caller finishing it meanwhile is waited for."""
        for _ in range(int(self.timing.claim_seconds / 0.05) + 1):
            finished = await self.finish_launch(user, resource_id)
            if finished is not None:
                return finished
            record = await self.live(user, resource_id)
            if not record.pending:
                return record
            await asyncio.sleep(0.05)
        raise errors.busy_launch(resource_id)

    async def finish_launch(self, user: str, resource_id: str) -> Resource | None:
        """Make the operator run what the record asks for, then mark it deploying (the `launch` timer).

        Returns the record as written (`deploying`), or None when there was nothing to finish or
        another caller is finishing it (one at a time: two would start the same instance twice)."""
        holder = secrets.token_hex(8)
        if not await self.store.hold_launch(user, resource_id, holder, self.timing.claim_seconds):
            return None
        try:
            return await self._finish_launch(user, resource_id)
        finally:
            await self.store.drop_launch(user, resource_id, holder)

    async def _finish_launch(self, user: str, resource_id: str) -> Resource | None:
        for _ in range(RETRIES):
            record = await self.store.load(user, resource_id)
            if transitions.launch_abandoned(record):
                # Released while launching: stop whatever this launch may have started.
                await self.operator.release(user, resource_id, record.request_instance if record else 0)
                await self.store.drop_timer("launch", user, resource_id)
                return None
            if not record.pending:
                await self.store.drop_timer("launch", user, resource_id)
                return record
            message = ""
            try:
                await self.operator.launch(
                    LaunchSpec(user, resource_id, record.param, record.request_instance)
                )
            except (OperatorError, BerthError) as error:
                log.warning("launch of %s/%s failed: %s", user, resource_id, error)
                message = f"launch failed: {error}"
                await self.operator.release(user, resource_id, record.request_instance)
            deploying = transitions.deploying(record, message, now())
            entered = [status_event(deploying)] if record.status != DEPLOYING else None
            try:
                return await self.store.mark_deploying(deploying, trace_at=now(), events=entered)
            except Stale:
                continue
        return None

    # -- background launches ------------------------------------------------------------------------

    def background(self, work: Awaitable[None]) -> None:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._finished)

    def _finished(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("background work failed (its timer will retry it): %r", task.exception())

    async def close(self) -> None:
        """Stop background launches; their timers let another replica (or the next start) finish them."""
        await cancel_and_wait(*self._tasks)
