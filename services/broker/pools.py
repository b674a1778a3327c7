"""A broker's pool loop (crm reference §2.4–2.8): one `tick` per period, on the replica holding the
broker's lease. Everything it knows is read from Redis at each tick, so a new lease holder simply
continues (no in-memory counter to drift or to recover).

A tick, in order:
1. readiness gate: a warming resource that finished deploying joins the idle pool if more than
   half of its instances answer; one that failed, or is not ready by its deadline, is released
   and the broker cools down (no launches for `cooling_seconds`), unless its instances were only
   lost with their nodes (then step 4 replaces it at once);
2. idle resources whose processes died (below the gate's threshold) are released: a caller must
   never get a dead server;
3. idle recycling: with `idle_keep_seconds`, at most one resource idle longer than that is
   released per `recycle_seconds`;
4. the strategy's target: launch the deficit (stopping at the first refusal; a refusal other than
   lack of capacity cools the broker down), or release surplus idle resources.
"""

from __future__ import annotations

import asyncio
import logging

import msgspec

from bus.codec import decode_stored, encode
from bus.idempotency import own_claim
from schemas.broker import AddBroker, BrokerView
from schemas.errors import BerthError
from services.broker import errors, model, strategies
from services.broker.model import INIT, RUNNING, BrokerConfig, BrokerState, Resource, now
from services.broker.publisher import pool_event
from services.broker.queries import Visible
from services.broker.resources import BrokerResources
from services.broker.store import Stale

log = logging.getLogger("berth.broker.pool")


class PoolKeeper:
    def __init__(self, resources: BrokerResources) -> None:
        self.resources = resources
        self.store = resources.store
        self.timing = resources.timing
        self.publish = resources.publish

    # -- commands ----------------------------------------------------------------------------------

    async def add(self, req: AddBroker) -> BrokerView:
        strategies.check(req.strategy)
        self.resources.launching.check(req.param)
        config = model.broker_config(req)
        if await self.store.applied(own_claim()) is None:  # else an earlier run of the request put it
            await self.store.put_broker(config)
        return await self.view(config)

    async def remove(self, user: str, name: str) -> list[str]:
        """Remove a broker and release its unsold resources (sold ones stay with their callers).

        The pool is read before the broker goes (a pool that cannot be read fails the removal
        before anything changed) and again after: a pool loop (of any replica) may launch into it
        until the broker is gone, and no later (`reserve_pool_launch` requires the broker), so the
        second read sees what such a launch added in between, which would otherwise be left
        running with no pool loop to release it. A broker already gone whose pool still holds
        resources is finished off: a removal interrupted half way (a crash, an error) completes
        when it is asked again, instead of leaving resources no pool loop will ever release."""
        kept = await self.store.applied(own_claim())
        if kept is not None:  # an earlier run of the request removed it, and died before answering
            before, removed = set(decode_stored(kept, list[str])), True
        else:
            before = await self._unsold(user, name)
            removed = await self.store.remove_broker(user, name, encode(sorted(before)))
        unsold = sorted(before | await self._unsold(user, name))
        if not removed and not unsold:
            raise errors.broker_not_found(user, name)
        records = await self.store.load_many((user, rid) for rid in unsold)
        await asyncio.gather(*(self.resources.releasing.release_record(r) for r in records if r is not None))
        return unsold

    async def _unsold(self, user: str, name: str) -> set[str]:
        """The ids in a broker's warming, idle and deleting parts, read in the order a resource moves
        through them, so that one moving meanwhile is still seen."""
        return {
            rid
            for part in ("warming", "idle", "deleting")
            for rid in await self.store.members(user, name, part)
        }

    async def views(self, user: str | None, visible: Visible) -> list[BrokerView]:
        """The brokers of `user` (of every user: None) that the caller may see."""
        return [await self.view(config) for config in await self.store.brokers(user) if visible(config.user)]

    async def view(self, config: BrokerConfig) -> BrokerView:
        counts = await self.store.pool_counts(config.user, config.name)
        state = await self.store.broker_state(config.user, config.name)
        return BrokerView(
            **{name: getattr(config, name) for name in BrokerConfig.__struct_fields__},
            target=await self._target(config),
            warming=counts["warming"],
            idle=counts["idle"],
            sold=counts["sold"],
            deleting=counts["deleting"],
            cooling_until=state.cooling_until,
        )

    async def _target(self, config: BrokerConfig) -> int:
        demand = await self.store.demand(config.user, config.name, now() - strategies.window(config.strategy))
        return strategies.target(config.strategy, demand)

    # -- the pool loop -----------------------------------------------------------------------------

    async def tick(self, broker: BrokerConfig) -> None:
        state = await self.store.broker_state(broker.user, broker.name)
        await self._gate(broker, state)
        await self._drop_dead_idle(broker)
        await self._recycle(broker, state)
        await self._reconcile(broker, state)

    async def _gate(self, broker: BrokerConfig, state: BrokerState) -> None:
        warming = await self.store.members(broker.user, broker.name, "warming")
        records = await self.store.load_many((broker.user, rid) for rid in warming)
        await asyncio.gather(*(self._judge(broker, state, r) for r in records if r is not None and r.live))

    async def _judge(self, broker: BrokerConfig, state: BrokerState, record: Resource) -> None:
        """Accept a warming resource into the idle pool, reject it, or let it warm a little longer."""
        if record.status != INIT:
            record, info = await self.resources.tracking.refresh(record)
            if record.status == RUNNING:
                if model.ready_enough(broker.instance, info.current_instances):
                    await self._accept(broker, record)
                else:
                    reason = info.message or f"{info.current_instances} of {broker.instance} instances ready"
                    # A launch that failed (record.message) is the resource's own failure, whatever
                    # became of its instances.
                    lost = 0 if record.message else await self.resources.operator.lost_instances(
                        record.user, record.resource_id)
                    await self._reject(broker, state, record, reason, cool=not model.lost_with_nodes(info, lost))
                return
        if now() > record.deadline:
            await self._reject(broker, state, record, f"not ready within {self.timing.ready_timeout:g} s")

    async def _accept(self, broker: BrokerConfig, record: Resource) -> None:
        ready = [pool_event(broker.user, broker.name, "ready", record.resource_id)]
        try:
            await self.store.accept_idle(msgspec.structs.replace(record, updated_at=now()), events=ready)
        except Stale:
            return  # changed meanwhile (released); the next tick sees it as it is now

    async def _reject(
        self, broker: BrokerConfig, state: BrokerState, record: Resource, reason: str, *, cool: bool = True
    ) -> None:
        log.warning(
            "broker %s/%s: %s rejected (%s): releasing it%s",
            broker.user,
            broker.name,
            record.resource_id,
            reason,
            " and cooling down" if cool else "",
        )
        await self._release(record)
        if cool:
            await self._cool(broker, state, record.resource_id)

    async def _cool(self, broker: BrokerConfig, state: BrokerState, resource_id: str) -> None:
        state.cooling_until = now() + self.timing.cooling_seconds
        await self.store.set_broker_state(broker.user, broker.name, cooling_until=state.cooling_until)
        await self.publish.pool(broker.user, broker.name, "cooling", resource_id)

    async def _release(self, record: Resource) -> bool:
        """Release a pool resource unless `apply` sold it meanwhile; failures are the release loop's."""
        try:
            return await self.resources.releasing.release_record(record, if_unchanged=True)
        except BerthError as error:
            log.warning("release of %s failed: %s", record.resource_id, error)
            return False

    async def _idle(self, broker: BrokerConfig) -> list[tuple[str, float]]:
        """Idle resources with the time they became ready, longest idle first."""
        return await self.store.idle_since(broker.user, broker.name)

    async def _release_idle(self, broker: BrokerConfig, resource_id: str) -> bool:
        record = await self.store.load(broker.user, resource_id)
        return record is not None and record.in_pool and await self._release(record)

    async def _drop_dead_idle(self, broker: BrokerConfig) -> None:
        """An idle resource that no longer passes the readiness gate (its processes died) goes."""
        await self._drop_dead(broker, [rid for rid, _ in await self._idle(broker)])

    async def _drop_dead(self, broker: BrokerConfig, resource_ids: list[str]) -> None:
        counts = await self.resources.operator.running_instances(broker.user, resource_ids) if resource_ids else []
        for resource_id, running in zip(resource_ids, counts):
            if not model.ready_enough(broker.instance, running):
                log.warning(
                    "broker %s/%s: idle %s has %d instances left: releasing it",
                    broker.user,
                    broker.name,
                    resource_id,
                    running,
                )
                await self._release_idle(broker, resource_id)

    async def instances_changed(self, user: str, resource_ids: list[str], *, draining: bool = False) -> list[str]:
        """Some instances of these resources became ready, exited, stopped answering, or their node
        went down (`draining`: their node stops taking work). Warming ones are judged now (a ready
        one joins the idle pool, a failed one is rejected), idle ones that no longer pass the gate
        go, and with `draining` every idle one goes. Sold ones stay their callers' (their service info says `failed`). Returns the names
        of the pools concerned: the caller refills them now (`Replica.refill`) rather than at the
        next round of their loop."""
        records = await self.store.load_many((user, rid) for rid in resource_ids)
        by_broker: dict[str, list[Resource]] = {}
        for record in records:
            if record is not None and record.live and record.in_pool:
                by_broker.setdefault(record.broker_name, []).append(record)
        for name, pooled in by_broker.items():
            broker = await self.store.broker(user, name)
            if broker is None:
                continue
            idle = {rid for rid, _ in await self._idle(broker)}
            for record in pooled:
                if record.resource_id not in idle:
                    await self._judge(broker, await self.store.broker_state(user, name), record)
            lost = [r.resource_id for r in pooled if r.resource_id in idle]
            if draining:
                for resource_id in lost:
                    await self._release_idle(broker, resource_id)
            else:
                await self._drop_dead(broker, lost)
        return list(by_broker)

    async def _recycle(self, broker: BrokerConfig, state: BrokerState) -> None:
        t = now()
        if broker.idle_keep_seconds <= 0 or t < state.next_recycle:
            return
        for resource_id, since in await self._idle(broker):
            if t - since >= broker.idle_keep_seconds and await self._release_idle(broker, resource_id):
                state.next_recycle = t + self.timing.recycle_seconds
                await self.store.set_broker_state(broker.user, broker.name, next_recycle=state.next_recycle)
                return

    async def _reconcile(self, broker: BrokerConfig, state: BrokerState) -> None:
        counts = await self.store.pool_counts(broker.user, broker.name)
        unsold = counts["warming"] + counts["idle"]
        deficit = await self._target(broker) - unsold
        if deficit > 0 and now() >= state.cooling_until:
            await self._launch(broker, state, deficit)
        elif deficit < 0:
            await self._shrink(broker, -deficit)

    async def _launch(self, broker: BrokerConfig, state: BrokerState, count: int) -> None:
        for _ in range(count):
            try:
                await self.resources.launching.launch_for_broker(broker)
            except BerthError as error:
                if error.code == "broker_not_enough_resources":
                    return  # capacity comes back by itself: retry next tick, no cooling (crm)
                if error.code == "broker_not_found":
                    return  # removed meanwhile
                log.warning(
                    "broker %s/%s: launch refused (%s): cooling down", broker.user, broker.name, error
                )
                await self._cool(broker, state, "")
                return

    async def _shrink(self, broker: BrokerConfig, surplus: int) -> None:
        t = now()
        for resource_id, since in await self._idle(broker):
            if surplus <= 0:
                return
            if strategies.surplus_may_go(broker.strategy, since, t) and await self._release_idle(
                broker, resource_id
            ):
                surplus -= 1
