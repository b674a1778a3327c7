"""The background work of one broker process: durable timers, and the pool loops it leads.

- Timers: every replica claims due timers (a claim pushes the timer `claim_seconds` ahead, so the
  timers of a replica that dies fall due again) and runs them.
- Pool loops: each round, the replica takes or renews the lease of every broker (a Redis key with a
  `lease_seconds` expiry) and ticks the brokers whose lease it holds. A replica that dies stops
  renewing, and another takes the lease over within `lease_seconds`. On a clean stop the leases
  are given back at once.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import uuid

from bus.tasks import cancel_and_wait, every
from services.broker.config import Timing
from services.broker.failover import Failover
from services.broker.model import now
from services.broker.pools import PoolKeeper
from services.broker.resources import BrokerResources

log = logging.getLogger("berth.broker.replica")


def replica_id() -> str:
    """Names the lease holder: host and pid say who it is, the suffix tells restarts apart."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


class Replica:
    def __init__(
        self, resources: BrokerResources, keeper: PoolKeeper, timing: Timing, failover: Failover | None = None
    ) -> None:
        self.id = replica_id()
        self.failover = failover  # reacts to instance and node events (the `allocation` operator's)
        if failover is not None:
            failover.refill = self.refill
        # One round at a time per pool: the loop's and an event's refill never launch for the same deficit.
        self._rounds: dict[tuple[str, str], asyncio.Lock] = {}
        self.resources = resources
        self.keeper = keeper
        self.store = resources.store
        self.timing = timing
        self._loops: list[asyncio.Task] = []
        self._held: set[tuple[str, str]] = set()

    async def start(self) -> None:
        if self.failover is not None:
            await self.failover.start()
        self._loops = [
            asyncio.create_task(every(self.timing.sweep_interval, self.run_timers, "timers"), name="timers"),
            asyncio.create_task(every(self.timing.pool_interval, self.run_pools, "pool loops"), name="pools"),
        ]

    async def stop(self) -> None:
        if self.failover is not None:
            await self.failover.stop()
        await cancel_and_wait(*self._loops)
        await self.resources.close()
        for user, name in self._held:
            await self.store.drop_lease(user, name, self.id)
        self._held.clear()

    async def run_timers(self) -> None:
        if delivered := await self.store.outbox.sweep():
            log.warning("published the events of %d changes whose replica had not", delivered)
        due = await self.store.claim_timers(now(), self.timing.claim_seconds)
        results = await asyncio.gather(
            *(self.resources.on_timer(*timer) for timer in due), return_exceptions=True
        )
        for timer, result in zip(due, results):
            if isinstance(result, Exception):
                log.error(
                    "timer %s failed (retried after %.0f s): %r", timer, self.timing.claim_seconds, result
                )

    async def refill(self, user: str, name: str) -> None:
        """One round of pool `user`/`name` now (a server of it was lost), if this replica leads it or
        takes the lead; else the replica that leads it does at its next round."""
        broker = await self.store.broker(user, name)
        if broker is None or not await self.store.hold_lease(user, name, self.id, self.timing.lease_seconds):
            return
        self._held.add((user, name))
        await self._round(broker)

    async def _round(self, broker) -> None:
        async with self._rounds.setdefault((broker.user, broker.name), asyncio.Lock()):
            await self.keeper.tick(broker)

    async def run_pools(self) -> None:
        mine = []
        for broker in await self.store.brokers():
            key = (broker.user, broker.name)
            if await self.store.hold_lease(broker.user, broker.name, self.id, self.timing.lease_seconds):
                if key not in self._held:
                    log.info("leading the pool of %s/%s", *key)
                self._held.add(key)
                mine.append(broker)
            else:
                self._held.discard(key)
                self._rounds.pop(key, None)
        results = await asyncio.gather(*(self._round(b) for b in mine), return_exceptions=True)
        for broker, result in zip(mine, results):
            if isinstance(result, Exception):
                log.error("pool loop of %s/%s failed: %r", broker.user, broker.name, result)
