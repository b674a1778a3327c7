"""The broker's events (DESIGN.md §4, §8): pool events per broker, status events per resource."""

from __future__ import annotations

from bus.events import EventBus
from bus.subjects import escape_token
from services.broker.messages import BrokerEvent, ResourceEvent
from services.broker.model import Resource


class Publisher:
    def __init__(self, events: EventBus) -> None:
        self.events = events

    async def pool(
        self, user: str, broker: str, kind: str, resource_id: str, caller_id: str | None = None
    ) -> None:
        """`broker.<user>.<broker>.<launched|ready|sold|released|cooling|hit|miss>`."""
        event = BrokerEvent(resource_id=resource_id, caller_id=caller_id)
        await self.events.publish(f"broker.{user}.{broker}.{kind}", event)

    async def status(self, record: Resource) -> None:
        """`broker.resource.<user>.<resource_id>.<status>`: a resource entered `record.status`."""
        event = ResourceEvent(
            resource_id=record.resource_id,
            user=record.user,
            broker_resource_id=record.broker_resource_id or None,
            broker_name=record.broker_name or None,
        )
        await self.events.publish(
            f"broker.resource.{record.user}.{escape_token(record.resource_id)}.{record.status}", event
        )
