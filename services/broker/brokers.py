"""Serving a caller from the warm pools: crm's BrokerSet.Apply, made atomic.

The user's brokers are tried in the order they were added. A broker serves a request when its
`fit_fields` match and its `instance` satisfies the caller's filter. Unlike crm, the first fitting
broker *that has a ready resource* serves it: an empty broker passes the request on. The choice and
the sale (the broker resource marked sold, the caller's record written running and linked to it)
happen in one Redis script, so two replicas never sell one resource twice.
"""

from __future__ import annotations

import secrets

import msgspec

from bus.outbox import journal
from schemas.broker import InstanceFilter
from schemas.errors import BerthError
from services.broker import errors, model, telemetry, transitions
from services.broker.model import BrokerConfig, Resource, now
from services.broker.publisher import Publisher, pool_event, status_event
from services.broker.store import BrokerStore

# Reloads of the broker list one apply tolerates while brokers are being added or removed.
RELOADS = 3


class BrokerRegistry:
    def __init__(self, store: BrokerStore, publisher: Publisher) -> None:
        self.store = store
        self.publish = publisher
        # Every broker config as of a version of the broker set. The claim script checks the version,
        # so `apply` needs no extra round trip to know the list is current.
        self._version = -1
        self._brokers: list[BrokerConfig] = []

    async def _reload(self) -> None:
        version = await self.store.brokers_version()  # read first: a change after it shows next time
        self._brokers = await self.store.brokers()
        self._version = version

    async def claim(self, caller: Resource, instance_filter: InstanceFilter) -> Resource:
        """Sell `caller` (new, released, or initialized and not launched) a ready resource of its
        user's brokers; its record becomes running, linked to that resource."""
        if self._version < 0:
            await self._reload()
        for _ in range(RELOADS):
            sold = await self._claim(caller, instance_filter)
            if sold is not None:
                telemetry.WARM.inc()
                return sold
            await self._reload()
        raise BerthError("the brokers keep changing; retry", code="busy", field="param")

    async def _claim(self, caller: Resource, instance_filter: InstanceFilter) -> Resource | None:
        """The sold record, or None if the broker list was outdated."""
        fitting = [b for b in self._brokers if b.user == caller.user and model.fits(b, caller.param)]
        # crm calls the caller's filter with the broker's instance count: it must not refuse it.
        eligible = [b for b in fitting if b.instance >= max(instance_filter.least_instance, 1)]
        t = now()
        sold = transitions.sold(caller, t)
        claim = await self._claim_one(sold, eligible, t) if eligible else None
        if claim is None:
            if await self.store.brokers_version() != self._version:
                return None
            if not fitting:
                raise errors.param_not_fit(caller.user)
            raise errors.pool_empty([b.name for b in fitting])  # none takes the caller's least_instance
        if claim.stale:
            return None
        if claim.taken:
            raise errors.already_launched(caller.resource_id, claim.taken)
        if not claim.position:
            for broker in eligible:
                await self.publish.pool(broker.user, broker.name, "miss", caller.resource_id)
            await self._refuse(eligible, t)
        await self.store.outbox.deliver(self.store.keys.outbox, claim.field, claim.announced)
        return claim.record

    async def _claim_one(self, sold: Resource, eligible: list[BrokerConfig], t: float):
        """The claim script's answer; a sale's events are journaled with it: for each candidate,
        the misses of the brokers before it, its hit and sale, and the caller's new status."""
        placeholder = secrets.token_hex(64)
        sales = []
        for position, winner in enumerate(eligible):
            sold_id = placeholder[: model.pool_resource_id_length(winner.name)]
            events = [pool_event(b.user, b.name, "miss", sold.resource_id) for b in eligible[:position]]
            events += [pool_event(winner.user, winner.name, kind, sold_id, sold.resource_id) for kind in ("hit", "sold")]
            events.append(status_event(msgspec.structs.replace(sold, broker_resource_id=sold_id)))
            sales.append(journal(events))
        # Each candidate's placeholder is a prefix as long as its ids, so the script swaps in the
        # sold id without changing the encoding.
        return await self.store.claim(sold, eligible, self._version, t, sales, placeholder)

    async def _refuse(self, eligible: list[BrokerConfig], t: float) -> None:
        names = [b.name for b in eligible]
        states = [await self.store.broker_state(b.user, b.name) for b in eligible]
        if all(s.cooling_until > t for s in states):
            raise errors.cooling(names, min(s.cooling_until for s in states))
        raise errors.pool_empty(names)
