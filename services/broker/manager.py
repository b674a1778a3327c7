"""The resource manager (crm reference §1): init, launch, scale, status, release, apply.

Every state change is one compare-and-set write in Redis (`BrokerStore.commit`) made before the
command answers. Work that outlives a command is a durable timer in Redis, so any replica, also
one started after a crash, finishes it:

  launch   make the operator run what the record asks for, then mark the resource deploying
           (the replica that accepted the launch does it at once: a `launch` command answers
           once the record is `deploying`; the timer is the crash guard)
  trace    follow a deploying resource until it is finished, release it past its deadline
  release  finish a release that was begun, and retry one the operator refused

A resource in a broker's pool is followed by that broker's pool loop (`pools.py`) instead.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Iterable

import msgspec
from msgspec import UNSET

from bus.errors import BerthError
from services.broker import errors, model, telemetry
from services.broker.brokers import BrokerRegistry
from services.broker.config import Timing
from services.broker.messages import (
    BlockDetail,
    InstanceFilter,
    ListResources,
    ResourceDetail,
    ResourceDetailReply,
    ResourceList,
    ResourceParam,
    ServiceInfo,
)
from services.broker.model import DELETING, DEPLOYING, INIT, RELEASED, RUNNING, BrokerConfig, Resource, now
from services.broker.operators.base import BlockCapacity, LaunchSpec, Operator, OperatorError
from services.broker.publisher import Publisher
from services.broker.store import (
    RELEASED_TTL,
    BrokerStore,
    Op,
    Stale,
    exists,
    fits,
    hincrby,
    index_member,
    sadd,
    srem,
    timer_member,
    zadd,
    zrem,
)

log = logging.getLogger("berth.broker")

# A record changed by someone else between our read and our write is read again this many times.
RETRIES = 5


class ResourceManager:
    def __init__(
        self,
        store: BrokerStore,
        operator: Operator,
        registry: BrokerRegistry,
        publisher: Publisher,
        timing: Timing,
    ) -> None:
        self.store = store
        self.keys = store.keys
        self.operator = operator
        self.registry = registry
        self.publish = publisher
        self.timing = timing
        self._tasks: set[asyncio.Task] = set()

    # -- reading -----------------------------------------------------------------------------------

    async def live(self, user: str, resource_id: str) -> Resource:
        record = await self.store.load(user, resource_id)
        if record is None or not record.live:
            raise errors.resource_not_found(resource_id)
        return record

    async def get(self, user: str, resource_id: str) -> Resource:
        """Any record, released ones included (they stay readable for 24 h)."""
        record = await self.store.load(user, resource_id)
        if record is None:
            raise errors.resource_not_found(resource_id)
        return record

    async def is_preparing(self, user: str, resource_id: str) -> bool:
        # crm answers (false, nil) for an id it does not know, and a released record is one it has
        # deleted: so unknown and released both read "not preparing", never resource_not_found.
        record = await self.store.load(user, resource_id)
        return record is not None and record.status == INIT

    async def all_records(self) -> list[Resource]:
        refs = await self.store.index_refs()
        records = await self.store.load_many(refs)
        await self.store.forget([ref for ref, record in zip(refs, records) if record is None])
        return [record for record in records if record is not None]

    async def list_resources(self, req: ListResources) -> ResourceList:
        matching = [
            r
            for r in await self.all_records()
            if (req.user is UNSET or r.user == req.user)
            and (req.status is UNSET or r.status == req.status)
            and (req.broker_name is UNSET or r.broker_name == req.broker_name)
            and (req.broker_sold is UNSET or r.broker_sold == req.broker_sold)
        ]
        page = matching[req.offset : req.offset + req.limit]
        return ResourceList([r.view() for r in page], len(matching))

    async def detail(self, offset: int, limit: int) -> ResourceDetailReply:
        capacities = {c.block: c for c in await self.operator.blocks()}
        reserved = await self.store.reservations()
        blocks = []
        for block in sorted(set(capacities) | set(reserved)):
            c = capacities.get(block) or BlockCapacity(block, 0, 0, 0)  # a block the operator no longer has
            waiting = reserved.get(block, 0)
            blocks.append(
                BlockDetail(
                    block=block,
                    total_instance=c.total,
                    used_instance=c.used,
                    report_instance=c.free,
                    available_instance=c.free - waiting,
                    not_ready_instance=waiting,
                    cpu_total=c.cpu_total,
                    cpu_used=c.cpu_used,
                    mem_total=c.mem_total,
                    mem_used=c.mem_used,
                )
            )
        live = [r for r in await self.all_records() if r.status != RELEASED]
        resources = [
            ResourceDetail(
                resource_id=r.resource_id,
                user=r.user,
                status=r.status,
                broker_resource_id=r.broker_resource_id,
                broker_name=r.broker_name,
                broker_sold=r.broker_sold,
                request_instance=r.request_instance,
                not_ready_instance=r.no_ready_instance,
                block=r.resource_block_key,
                image=r.param.image,
                created_at=r.created_at,
            )
            for r in live[offset : offset + limit]
        ]
        return ResourceDetailReply(blocks, resources, len(live))

    # -- init and launch ---------------------------------------------------------------------------

    def check(self, param: ResourceParam) -> None:
        """A param this broker can launch (or reject with the field at fault)."""
        model.check_param(param)
        self.operator.validate(param)

    async def init(self, user: str, resource_id: str, param: ResourceParam) -> Resource:
        self.check(param)
        current = await self.store.load(user, resource_id)
        if current is not None and current.status != RELEASED:
            raise errors.already_init(resource_id)
        t = now()
        record = Resource(resource_id=resource_id, user=user, param=param, created_at=t, updated_at=t)
        try:
            record = await self.store.commit(
                record,
                current.version if current else 0,
                [zadd(self.keys.index, t, index_member(user, resource_id))],
            )
        except Stale:
            raise errors.already_init(resource_id) from None
        await self.publish.status(record)
        return record

    async def launch(self, user: str, resource_id: str, city: str | None, f: InstanceFilter) -> Resource:
        """Serve from the user's brokers if one has a ready resource, else reserve and launch cold."""
        model.check_filter(f)
        record = await self.live(user, resource_id)
        if record.status != INIT or record.launched:
            raise errors.already_launched(resource_id, record.status)
        if city:
            record = msgspec.structs.replace(record, param=msgspec.structs.replace(record.param, city=city))
        try:
            return await self.registry.claim(record, f)
        except BerthError as error:
            if error.code == "application_already_launched":
                raise
            log.debug("launch %s/%s: no broker serves it (%s); launching cold", user, resource_id, error.code)
        self.check(record.param)
        block = self.operator.block_key(record.param)
        free = await self.operator.free_instances(record.param)
        available = free - await self.store.reserved(block)
        need = model.take_instances(f, available)
        launched = msgspec.structs.replace(
            record,
            launched=True,
            resource_block_key=block,
            request_instance=need,
            no_ready_instance=need,
            deadline=now() + self.timing.trace_timeout,
        )
        written = await self._commit_launch(
            launched,
            record.version,
            need,
            free,
            refuse=lambda left: errors.no_enough_resources(left, f.least_instance),
            wait=True,
        )
        telemetry.COLD.inc()
        return written

    async def apply(self, user: str, resource_id: str, param: ResourceParam, f: InstanceFilter) -> Resource:
        """A ready resource of the first fitting broker, linked to the caller's resource (init'ed if new;
        nothing is written if no resource is sold)."""
        started = time.perf_counter()
        histogram = telemetry.APPLY_ERROR
        try:
            model.check_filter(f)
            self.check(param)
            # One Redis round trip: the claim script itself refuses a caller that is launched already.
            sold = await self.registry.claim(Resource(resource_id=resource_id, user=user, param=param), f)
            histogram = telemetry.APPLY_SOLD
            return sold
        except BerthError:
            histogram = telemetry.APPLY_REFUSED
            raise
        finally:
            histogram.observe(time.perf_counter() - started)

    async def launch_for_broker(self, broker: BrokerConfig) -> Resource:
        """A new resource in `broker`'s pool (crm's Broker.Launch); it warms until its gate accepts it."""
        param = broker.param
        block = self.operator.block_key(param)
        free = await self.operator.free_instances(param)
        available = free - await self.store.reserved(block)
        if available < broker.instance:
            raise errors.broker_not_enough(available, broker.instance, broker.name)
        t = now()
        resource_id = f"b{broker.name}-{secrets.token_hex(4)}"
        record = Resource(
            resource_id=resource_id,
            user=broker.user,
            param=param,
            broker_name=broker.name,
            created_at=t,
            updated_at=t,
            launched=True,
            resource_block_key=block,
            request_instance=broker.instance,
            no_ready_instance=broker.instance,
            deadline=t + self.timing.ready_timeout,
        )
        record = await self._commit_launch(
            record,
            0,
            broker.instance,
            free,
            refuse=lambda left: errors.broker_not_enough(left, broker.instance, broker.name),
            extra=[
                exists(self.keys.broker(broker.user, broker.name)),
                sadd(self.keys.pool(broker.user, broker.name, "warming"), resource_id),
                zadd(self.keys.index, t, index_member(broker.user, resource_id)),
            ],
        )
        await self.publish.pool(broker.user, broker.name, "launched", resource_id)
        return record

    async def scale(self, user: str, resource_id: str, f: InstanceFilter) -> Resource:
        """More instances for a running resource (a sold one scales its broker resource)."""
        model.check_filter(f)
        record = await self.live(user, resource_id)
        if record.status != RUNNING:
            raise errors.not_running(resource_id, record.status)
        if record.broker_resource_id:
            return await self.scale(user, record.broker_resource_id, f)
        block = record.resource_block_key
        free = await self.operator.free_instances(record.param)
        need = model.take_instances(f, free - await self.store.reserved(block))
        scaled = msgspec.structs.replace(
            record,
            status=DEPLOYING,
            request_instance=record.request_instance + need,
            no_ready_instance=need,
            deadline=now() + self.timing.trace_timeout,
            message="",
        )
        scaled = await self._commit_launch(
            scaled,
            record.version,
            need,
            free,
            refuse=lambda left: errors.no_enough_resources(left, f.least_instance),
        )
        await self.publish.status(scaled)
        return scaled

    async def _commit_launch(
        self,
        record: Resource,
        expected: int,
        need: int,
        free: int,
        *,
        refuse: Callable[[int], BerthError],
        extra: Iterable[Op] = (),
        wait: bool = False,
    ) -> Resource:
        """Write a launch: reserve `need` instances of the block (at most `free` reserved in all), set
        the launch timer, and start the operator launch. Another launch that took the capacity first
        makes it `refuse(instances left)`.

        With `wait`, the operator launch is done before returning and the record returned is the one
        it wrote (`deploying`): a `launch` command must not answer while its record still says
        `init` (crm's `deploying` is "the platform accepted the launch"). Should that work fail
        (Redis unreachable, say), the `launch` timer finishes it; the record written so far is
        returned. Without `wait` (a broker's own launches, scale) it runs in the background."""
        block = record.resource_block_key
        t = now()
        ops = [
            fits(self.keys.blocks, block, need, free),
            hincrby(self.keys.blocks, block, need),
            zadd(
                self.keys.timers,
                t + self.timing.claim_seconds,
                timer_member("launch", record.user, record.resource_id),
            ),
            *extra,
        ]
        try:
            written = await self.store.commit(
                msgspec.structs.replace(record, pending=True, updated_at=t), expected, ops
            )
        except Stale as stale:
            if stale.reason == "capacity":
                raise refuse(free - await self.store.reserved(block)) from None
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

    async def finish_launch(self, user: str, resource_id: str) -> Resource | None:
        """Make the operator run what the record asks for, then mark it deploying (the `launch` timer).

        Returns the record as written (`deploying`), or None when there was nothing to finish."""
        launch_timer = timer_member("launch", user, resource_id)
        for _ in range(RETRIES):
            record = await self.store.load(user, resource_id)
            if record is None or record.status in (RELEASED, DELETING):
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
            deploying = msgspec.structs.replace(
                record, status=DEPLOYING, pending=False, message=message, updated_at=now()
            )
            ops = [zrem(self.keys.timers, launch_timer)]
            if not record.in_pool:  # pool resources are followed by their broker's pool loop
                ops.append(zadd(self.keys.timers, now(), timer_member("trace", user, resource_id)))
            try:
                deploying = await self.store.commit(deploying, record.version, ops)
            except Stale:
                continue
            if record.status != DEPLOYING:
                await self.publish.status(deploying)
            return deploying
        return None

    # -- status ------------------------------------------------------------------------------------

    async def service_info(self, user: str, resource_id: str) -> ServiceInfo:
        record = await self.live(user, resource_id)
        if record.broker_resource_id:
            target = await self.store.load(user, record.broker_resource_id)
            if target is None or not target.live:
                raise errors.resource_not_found(record.broker_resource_id, field="broker_resource_id")
            return await self.operator.status(user, target.resource_id)
        if record.status == INIT:
            if not record.launched:
                raise errors.not_launched(resource_id, "it was initialized but not launched")
            return ServiceInfo(
                "staging", "preparing: the launch has not reached the operator yet", record.request_instance
            )
        _, info = await self.refresh(record)
        return info

    async def refresh(self, record: Resource) -> tuple[Resource, ServiceInfo]:
        """Ask the operator how `record` is doing and write what changed (deploying -> running,
        the not-ready reservation shrinking)."""
        info = (
            model.failed_launch(record)
            if record.message
            else await self.operator.status(record.user, record.resource_id)
        )
        updated = model.observed(record, info)
        if updated is record:
            return record, info
        ops: list[Op] = []
        released = record.no_ready_instance - updated.no_ready_instance
        if released:
            ops.append(hincrby(self.keys.blocks, record.resource_block_key, -released))
        if updated.status == RUNNING:
            ops.append(zrem(self.keys.timers, timer_member("trace", record.user, record.resource_id)))
        try:
            updated = await self.store.commit(updated, record.version, ops)
        except Stale:
            return record, info  # someone else wrote first; the next look will see it
        if updated.status != record.status:
            await self.publish.status(updated)
        return updated, info

    async def trace(self, user: str, resource_id: str) -> None:
        """The `trace` timer: follow a deploying resource; past its deadline, release it."""
        record = await self.store.load(user, resource_id)
        if record is None or record.status != DEPLOYING or record.in_pool:
            await self.store.drop_timer("trace", user, resource_id)
            return
        record, _ = await self.refresh(record)
        if record.status != DEPLOYING:
            return
        if now() > record.deadline:
            log.warning("%s/%s did not finish deploying in time: releasing it", user, resource_id)
            await self.release_record(record)
        else:
            await self.store.schedule("trace", user, resource_id, now() + self.timing.sweep_interval)

    # -- release -----------------------------------------------------------------------------------

    async def release(self, user: str, resource_id: str) -> None:
        """Release a resource; a sold one takes its broker resource along (that one first)."""
        record = await self.store.load(user, resource_id)
        if record is None or record.status == RELEASED:
            raise errors.resource_not_found(resource_id)
        if record.broker_resource_id:
            target = await self.store.load(user, record.broker_resource_id)
            if target is not None and target.status != RELEASED:
                await self.release_record(target)
        await self.release_record(record)

    async def release_record(self, record: Resource, *, if_unchanged: bool = False) -> bool:
        """Begin and finish releasing `record`. With `if_unchanged`, give up (False) if the record
        changed since it was read (a pool loop must not release what `apply` just sold)."""
        begun = await self._begin_release(record, if_unchanged)
        if begun is None:
            return False
        await self._finish_release(begun)
        return True

    async def _begin_release(self, record: Resource, if_unchanged: bool) -> Resource | None:
        """Take the record out of its pool and mark it deleting, with a `release` timer in case we die."""
        for _ in range(RETRIES):
            if record.status == DELETING:
                return record
            ops: list[Op] = [
                zadd(
                    self.keys.timers,
                    now() + self.timing.claim_seconds,
                    timer_member("release", record.user, record.resource_id),
                )
            ]
            if record.in_pool:
                ops += self._pool_exit(record)
                ops.append(
                    sadd(self.keys.pool(record.user, record.broker_name, "deleting"), record.resource_id)
                )
            deleting = msgspec.structs.replace(record, status=DELETING, updated_at=now())
            try:
                deleting = await self.store.commit(deleting, record.version, ops)
            except Stale:
                if if_unchanged:
                    return None
                reloaded = await self.store.load(record.user, record.resource_id)
                if reloaded is None or reloaded.status == RELEASED:
                    return None
                record = reloaded
                continue
            await self.publish.status(deleting)
            return deleting
        raise BerthError(
            f"resource {record.resource_id} keeps changing; release it again",
            code="busy",
            field="resource_id",
        )

    async def _finish_release(self, record: Resource) -> None:
        """Release the platform's side, then mark the record released (kept readable for 24 h)."""
        if record.launched and not record.broker_resource_id:
            try:
                await self.operator.release(record.user, record.resource_id, record.request_instance)
            except (OperatorError, BerthError) as error:
                await self._release_failed(record, error)
                raise BerthError(
                    f"release of {record.resource_id} failed: {error}; it will be retried",
                    code="internal",
                    field="resource_id",
                ) from None
        for _ in range(RETRIES):
            released = msgspec.structs.replace(record, status=RELEASED, no_ready_instance=0, updated_at=now())
            ops = [
                zrem(self.keys.timers, timer_member(kind, record.user, record.resource_id))
                for kind in ("launch", "trace", "release")
            ]
            if record.no_ready_instance:
                ops.append(hincrby(self.keys.blocks, record.resource_block_key, -record.no_ready_instance))
            if record.broker_name:
                ops += self._pool_exit(record)
                ops += [
                    srem(self.keys.pool(record.user, record.broker_name, part), record.resource_id)
                    for part in ("sold", "deleting")
                ]
            try:
                released = await self.store.commit(released, record.version, ops, ttl=RELEASED_TTL)
            except Stale:
                reloaded = await self.store.load(record.user, record.resource_id)
                if reloaded is None or reloaded.status == RELEASED:
                    return
                record = reloaded
                continue
            await self.publish.status(released)
            if record.broker_name:
                await self.publish.pool(record.user, record.broker_name, "released", record.resource_id)
            return

    async def _release_failed(self, record: Resource, error: Exception) -> None:
        """crm's release pool: retry every `release_retry_seconds`; a broker's own resources only if
        the broker has `release_loop` (else it stays `deleting` until released by hand)."""
        log.warning("release of %s/%s failed: %s", record.user, record.resource_id, error)
        retry = True
        if record.broker_name:
            broker = await self.store.broker(record.user, record.broker_name)
            retry = broker is None or broker.release_loop
        if retry:
            await self.store.schedule(
                "release", record.user, record.resource_id, now() + self.timing.release_retry_seconds
            )
        else:
            await self.store.drop_timer("release", record.user, record.resource_id)

    async def finish_release(self, user: str, resource_id: str) -> None:
        """The `release` timer: a release begun by a replica that died, or one the operator refused."""
        record = await self.store.load(user, resource_id)
        if record is None or record.status != DELETING:
            await self.store.drop_timer("release", user, resource_id)
            return
        try:
            await self._finish_release(record)
        except BerthError:
            pass  # rescheduled or left deleting by _release_failed

    def _pool_exit(self, record: Resource) -> list[Op]:
        return [
            srem(self.keys.pool(record.user, record.broker_name, "warming"), record.resource_id),
            zrem(self.keys.pool(record.user, record.broker_name, "idle"), record.resource_id),
        ]

    # -- background work ---------------------------------------------------------------------------

    async def on_timer(self, kind: str, user: str, resource_id: str) -> None:
        handlers = {"launch": self.finish_launch, "trace": self.trace, "release": self.finish_release}
        handler = handlers.get(kind)
        if handler is None:
            log.error("unknown timer %s for %s/%s: dropped", kind, user, resource_id)
            await self.store.drop_timer(kind, user, resource_id)
            return
        await handler(user, resource_id)

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
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
