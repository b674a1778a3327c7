"""Following deployments: what the operator says about a resource, written into its record.

`refresh` asks the operator and writes what changed (deploying -> running, the not-ready
reservation shrinking); `get-service-info`, the `trace` timer and the pool loops' readiness gate
all look through it. The `trace` timer releases a resource still deploying past its deadline.
"""

from __future__ import annotations

import logging

from schemas.broker import ServiceInfo
from services.broker import model, transitions
from services.broker.context import Context, Part
from services.broker.model import DEPLOYING, Resource, now
from services.broker.publisher import status_event
from services.broker.releasing import Releasing
from services.broker.store import Stale

log = logging.getLogger("berth.broker")


class Tracking(Part):
    def __init__(self, context: Context, releasing: Releasing) -> None:
        super().__init__(context)
        self.releasing = releasing

    async def refresh(self, record: Resource) -> tuple[Resource, ServiceInfo]:
        """Ask the operator how `record` is doing and write what changed."""
        info = (
            model.failed_launch(record)
            if record.message
            else await self.operator.status(record.user, record.resource_id)
        )
        updated = model.observed(record, info)
        if updated is record:
            return record, info
        entered = [status_event(updated)] if updated.status != record.status else None
        try:
            updated = await self.store.observe(record, updated, events=entered)
        except Stale:
            return record, info  # someone else wrote first; the next look will see it
        return updated, info

    async def trace(self, user: str, resource_id: str) -> None:
        """The `trace` timer: follow a deploying resource; past its deadline, release it."""
        record = await self.store.load(user, resource_id)
        if record is None or not transitions.traced(record):
            await self.store.drop_timer("trace", user, resource_id)
            return
        record, _ = await self.refresh(record)
        if record.status != DEPLOYING:
            return
        if now() > record.deadline:
            log.warning("%s/%s did not finish deploying in time: releasing it", user, resource_id)
            await self.releasing.release_record(record)
        else:
            await self.store.schedule("trace", user, resource_id, now() + self.timing.sweep_interval)
