"""The broker's resource commands (crm reference §1): init, launch, apply, scale, status, release.

Every state change is one compare-and-set write in Redis (a `BrokerStore` step) made before the
command answers. Work that outlives a command is a durable timer in Redis, so any replica, also
one started after a crash, finishes it:

  launch   make the operator run what the record asks for, then mark it deploying (`launching`)
  trace    follow a deploying resource until it is finished, release it past its deadline
           (`tracking`)
  release  finish a release that was begun, and retry one the operator refused (`releasing`)
  forget   drop a released record's index entry once the record has expired (`queries`)

A resource in a broker's pool is followed by that broker's pool loop (`pools.py`) instead.
`BrokerResources` wires the parts together and runs the timers; the commands are the parts'.
"""

from __future__ import annotations

import logging

from services.broker.brokers import BrokerRegistry
from services.broker.config import Timing
from services.broker.context import Context
from services.broker.launching import Launching
from services.broker.operators.base import Operator
from services.broker.publisher import Publisher
from services.broker.queries import Queries
from services.broker.releasing import Releasing
from services.broker.store import BrokerStore
from services.broker.tracking import Tracking

log = logging.getLogger("berth.broker")


class BrokerResources:
    def __init__(
        self,
        store: BrokerStore,
        operator: Operator,
        registry: BrokerRegistry,
        publisher: Publisher,
        timing: Timing,
    ) -> None:
        context = Context(store, operator, publisher, timing)
        self.store = store
        self.operator = operator
        self.publish = publisher
        self.timing = timing
        self.releasing = Releasing(context)
        self.tracking = Tracking(context, self.releasing)
        self.launching = Launching(context, registry)
        self.queries = Queries(context, self.tracking)
        self._timers = {
            "launch": self.launching.finish_launch,
            "trace": self.tracking.trace,
            "release": self.releasing.finish_release,
            "forget": self.queries.forget_expired,
        }

    async def on_timer(self, kind: str, user: str, resource_id: str) -> None:
        """Run a durable timer that fell due (`Replica.run_timers`)."""
        handler = self._timers.get(kind)
        if handler is None:
            log.error("unknown timer %s for %s/%s: dropped", kind, user, resource_id)
            await self.store.drop_timer(kind, user, resource_id)
            return
        await handler(user, resource_id)

    async def close(self) -> None:
        """Stop background launches; their timers let another replica (or the next start) finish them."""
        await self.launching.close()
