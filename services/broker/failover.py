"""Reacting to what the agents and the allocation service say of instances and nodes, so that a
warm pool replaces a lost server, and takes a new one in, at once instead of at its next look
(`PoolKeeper.instances_changed`):

- `agent.<node>.ready`: an instance of a resource answers: a warming pool server may join the pool;
- `agent.<node>.exited` / `agent.<node>.unready`: an instance of a resource stopped, or stopped
  answering;
- `resource.<node>.down`: the node's agent's lease lapsed: every resource with an instance there;
- `resource.<node>.draining`: the node takes no new work: its idle pool resources are recycled.

The pools concerned are then refilled at once by the replica that leads them (`refill`), not at
the next round of their loop. Each event reaches one replica (a queue group). An event that is lost
costs only time: the pool loops look at their resources every round anyway (`running_instances`
asks the agents, and counts an instance on a down node as lost).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from nats.aio.subscription import Subscription

from bus.events import EventBus
from services.broker.operators.allocation import AllocationOperator
from services.broker.pools import PoolKeeper

log = logging.getLogger("berth.broker.failover")


class Failover:
    def __init__(self, events: EventBus, operator: AllocationOperator, keeper: PoolKeeper, queue: str) -> None:
        self.events = events
        self.operator = operator
        self.keeper = keeper
        self.queue = queue
        self._subscriptions: list[Subscription] = []
        self._work: set[asyncio.Task] = set()
        # Runs one round of a pool now, if this replica leads it (set by the replica: `Replica.refill`).
        self.refill: Callable[[str, str], Awaitable[None]] | None = None

    async def start(self) -> None:
        for pattern, handler in (("agent.*.ready", self._instance), ("agent.*.exited", self._instance),
                                 ("agent.*.unready", self._instance),
                                 ("resource.*.down", self._node), ("resource.*.draining", self._node)):
            self._subscriptions.append(await self.events.subscribe(pattern, cb=handler, queue=self.queue))

    async def stop(self) -> None:
        for subscription in self._subscriptions:
            await subscription.unsubscribe()
        self._subscriptions.clear()
        for task in list(self._work):
            await asyncio.wait([task], timeout=5)

    async def _instance(self, subject: str, event: dict) -> None:
        owner = event.get("owner") or {}
        if owner.get("user") and owner.get("resource_id"):
            self._react(owner["user"], [owner["resource_id"]], draining=False, why=subject)

    async def _node(self, subject: str, event: dict) -> None:
        node, kind = subject.rsplit(".", 2)[-2:]
        by_user: dict[str, list[str]] = {}
        for user, resource_id in await self.operator.resources_on(node):
            by_user.setdefault(user, []).append(resource_id)
        for user, resource_ids in by_user.items():
            self._react(user, resource_ids, draining=kind == "draining", why=subject)

    def _react(self, user: str, resource_ids: list[str], *, draining: bool, why: str) -> None:
        """In a task of its own: a subscription hands over one event at a time."""

        async def react() -> None:
            try:
                pools = await self.keeper.instances_changed(user, resource_ids, draining=draining)
                for name in pools if self.refill is not None else ():
                    await self.refill(user, name)
            except Exception:
                log.exception("reacting to %s failed (the pool loops look again)", why)

        task = asyncio.get_running_loop().create_task(react())
        self._work.add(task)
        task.add_done_callback(self._work.discard)
